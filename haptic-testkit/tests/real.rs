//! The real API server fixture itself: it starts, it authenticates the admin and
//! ServiceAccounts, RBAC applies to the latter, kubectl reaches it, and a drop leaves no process
//! and no directory behind. Needs `cargo xtask envtest`.

use std::{path::PathBuf, process::Command, time::Duration};

use haptic_testkit::RealApiServer;
use k8s_openapi::api::{
    core::v1::Secret,
    rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject},
};
use kube::{
    Api,
    api::{ListParams, ObjectMeta, PostParams},
};

fn kubectl(kubeconfig: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("kubectl runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_server_enforces_rbac_for_service_accounts_and_stops_clean() {
    let server = RealApiServer::start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "real kube-apiserver + etcd ready in {:?}",
        server.startup_time()
    );
    let (ok, text) = kubectl(
        server.admin_kubeconfig(),
        &["get", "namespaces", "-o", "name"],
    );
    assert!(ok && text.contains("namespace/default"), "{text}");
    let (_, version) = kubectl(server.admin_kubeconfig(), &["version", "-o", "json"]);
    assert!(version.contains("v1.34.4"), "{version}");

    let ns = server.create_namespace("rbac").await.expect("namespace");
    let sa = server
        .service_account_kubeconfig(&ns, "reader")
        .await
        .expect("token");
    let (_, answer) = kubectl(&sa, &["auth", "can-i", "list", "secrets", "-n", &ns]);
    assert_eq!(answer.trim(), "no", "a fresh ServiceAccount may do nothing");
    let client = server
        .service_account_client(&ns, "reader")
        .await
        .expect("client");
    let secrets: Api<Secret> = Api::namespaced(client, &ns);
    match secrets.list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("expected 403 Forbidden, got {other:?}"),
    }
    // Granted by a Role, the same token may.
    let admin = server.admin_client().await.expect("admin");
    let meta = ObjectMeta {
        name: Some("reader".into()),
        namespace: Some(ns.clone()),
        ..ObjectMeta::default()
    };
    let role = Role {
        metadata: meta.clone(),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["secrets".into()]),
            verbs: vec!["list".into()],
            ..PolicyRule::default()
        }]),
    };
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    let binding = RoleBinding {
        metadata: meta,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: "reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "reader".into(),
            namespace: Some(ns.clone()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(admin, &ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
    // RBAC changes reach the authorizer through its informer: await it, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match secrets.list(&ListParams::default()).await {
            Ok(_) => break,
            Err(error) if tokio::time::Instant::now() < deadline => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("the Role did not take effect: {error}"),
        }
    }

    // A drop stops both servers and removes the directory.
    let dir: PathBuf = server.admin_kubeconfig().parent().expect("dir").to_owned();
    let pids = std::fs::read_to_string(dir.join("pids")).expect("pids");
    drop(server);
    assert!(!dir.exists(), "{} removed", dir.display());
    for pid in pids.split_whitespace() {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} ended"
        );
    }
}

/// Run only by the test below, in a child process whose environment hides the assets.
#[tokio::test]
#[ignore = "a probe the missing-assets test runs in a child process"]
async fn probe_start_without_assets() {
    if let Err(error) = RealApiServer::start().await {
        panic!("{error}");
    }
}

#[test]
fn without_assets_the_real_tier_fails_and_names_the_command_to_run() {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "probe_start_without_assets",
            "--nocapture",
        ])
        .env("KUBEBUILDER_ASSETS", "/nonexistent/assets")
        .env("XDG_CACHE_HOME", "/nonexistent/cache")
        .output()
        .expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "it must fail, not skip:\n{text}");
    for part in [
        "run `cargo xtask envtest`",
        "KUBEBUILDER_ASSETS=/nonexistent/assets",
        "/nonexistent/cache/haptic/envtest/k8s-v1.34.4-etcd-v3.6.4",
    ] {
        assert!(text.contains(part), "{part:?} not in:\n{text}");
    }
}
