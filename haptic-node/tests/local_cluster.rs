//! The local cluster end to end: `up`, a Pod of the agent image running HAProxy as a process
//! (ready, reachable on its Pod address, with its downward-API env, in-cluster settings,
//! ServiceAccount token and user), an unknown image refused with a clear reason, a delete that
//! stops the process and removes the namespace, and a `down` that leaves nothing.
//!
//! Root, the envtest assets with kube-controller-manager (`cargo xtask envtest`), the
//! workspace's binaries (`cargo build --workspace --bins`) and no other local cluster on this
//! machine (one bridge, one range): so it is ignored by default.
//! `cargo test -p haptic-node --test local_cluster -- --ignored`

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::{
    Api,
    api::{DeleteParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn assets() -> PathBuf {
    if let Some(dir) = std::env::var_os("KUBEBUILDER_ASSETS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").expect("HOME");
    PathBuf::from(home).join(".cache/haptic/envtest/k8s-v1.34.4-etcd-v3.6.4")
}

fn node(args: &[&str], state: &Path) -> bool {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_haptic-node"));
    Command::new(&bin)
        .args(args)
        .arg("--state")
        .arg(state)
        .args(if args == ["up"] {
            vec![
                "--assets".to_owned(),
                assets().display().to_string(),
                "--bins".to_owned(),
                bin.parent().expect("bin dir").display().to_string(),
            ]
        } else {
            Vec::new()
        })
        .status()
        .expect("haptic-node runs")
        .success()
}

/// `down` however the test ends.
struct Cluster(PathBuf);

impl Drop for Cluster {
    fn drop(&mut self) {
        node(&["down"], &self.0);
    }
}

fn netns_count() -> usize {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("hptc-"))
        .count()
}

async fn eventually<T, F, Fut>(what: &str, bound: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
#[ignore = "root, envtest assets, built binaries, no other local cluster: -- --ignored"]
async fn a_pod_runs_as_a_process_and_leaves_nothing_behind() {
    let state = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("local-cluster-test");
    let started = Instant::now();
    assert!(node(&["up"], &state), "haptic-node up");
    let cluster = Cluster(state.clone());
    eprintln!("up in {:?}", started.elapsed());
    let kc = Kubeconfig::read_from(state.join("admin.kubeconfig")).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config");
    let client = kube::Client::try_from(config).expect("client");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "echo" },
        "data": { "haproxy.cfg": "defaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\nfrontend echo\n  bind :8080\n  http-request return status 200 content-type text/plain string \"echo\"\n" },
    }))
    .expect("cm");
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create cm");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "echo" },
        "spec": {
            "securityContext": { "runAsUser": 10001, "runAsGroup": 10001 },
            "containers": [{
                "name": "echo",
                "image": "ghcr.io/haptic-rs/haptic-agent:0.1.0",
                "command": ["/usr/sbin/haproxy", "-f", "/etc/echo/haproxy.cfg"],
                "env": [{ "name": "MY_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } },
                        { "name": "MY_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }],
                "ports": [{ "name": "http", "containerPort": 8080 }],
                "readinessProbe": { "tcpSocket": { "port": "http" }, "periodSeconds": 1 },
                "volumeMounts": [{ "name": "config", "mountPath": "/etc/echo" }],
            }],
            "volumes": [{ "name": "config", "configMap": { "name": "echo" } }],
        },
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    let ready = eventually("Pod echo Ready", Duration::from_secs(60), || async {
        let pod = pods.get("echo").await.ok()?;
        let status = pod.status?;
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        ready.then_some(status)
    })
    .await;
    assert_eq!(ready.phase.as_deref(), Some("Running"));
    let ip = ready.pod_ip.clone().expect("podIP");
    assert!(ip.starts_with("10.88.0."), "{ip}");
    let container = &ready.container_statuses.as_ref().expect("statuses")[0];
    assert!(container.ready && container.started == Some(true));
    let pid: u32 = container
        .container_id
        .as_deref()
        .and_then(|id| id.strip_prefix("process://"))
        .and_then(|p| p.parse().ok())
        .expect("process://PID");

    // Served on its Pod address, from the host over the bridge.
    let mut stream = tokio::net::TcpStream::connect((ip.as_str(), 8080))
        .await
        .expect("connect to the Pod");
    stream
        .write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read");
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("echo"),
        "{answer}"
    );

    // The process: its env, its user, its token in its own mount namespace.
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    let environ = String::from_utf8_lossy(&environ);
    for want in [
        format!("MY_IP={ip}"),
        "MY_NAME=echo".to_owned(),
        "KUBERNETES_SERVICE_HOST=10.88.0.1".to_owned(),
    ] {
        assert!(
            environ.split('\0').any(|v| v == want),
            "{want} in {environ}"
        );
    }
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    assert!(
        proc_status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.contains("10001")),
        "{proc_status}"
    );
    let token = std::fs::read_to_string(format!(
        // /var/run is a symlink to /run, which would resolve in our own root.
        "/proc/{pid}/root/run/secrets/kubernetes.io/serviceaccount/token"
    ))
    .expect("the projected token, in the container's mount namespace");
    assert_eq!(token.split('.').count(), 3, "a JWT");

    // A changed ConfigMap reaches the running container's mount (the kubelet's sync).
    let patch = json!({ "data": { "haproxy.cfg": "# changed\n" } });
    cms.patch(
        "echo",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .expect("patch cm");
    let mounted = format!("/proc/{pid}/root/etc/echo/haproxy.cfg");
    eventually(
        "the new ConfigMap in the container",
        Duration::from_secs(30),
        || async { (std::fs::read_to_string(&mounted).ok()? == "# changed\n").then_some(()) },
    )
    .await;

    // An image it does not know: Pending, ErrImagePull, and why.
    let unknown: Pod = serde_json::from_value(json!({
        "metadata": { "name": "nginx" },
        "spec": { "containers": [{ "name": "nginx", "image": "nginx:1.27" }] },
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &unknown)
        .await
        .expect("create");
    let message = eventually("ErrImagePull on nginx", Duration::from_secs(30), || async {
        let status = pods.get("nginx").await.ok()?.status?;
        let waiting = status.container_statuses?.first()?.state.clone()?.waiting?;
        (waiting.reason.as_deref() == Some("ErrImagePull")).then_some(waiting.message)
    })
    .await
    .unwrap_or_default();
    assert!(message.contains("nginx:1.27 is not known"), "{message}");

    // Delete: the process stops, the object goes, the namespace is removed.
    let before = netns_count();
    pods.delete(
        "echo",
        &DeleteParams {
            grace_period_seconds: Some(5),
            ..DeleteParams::default()
        },
    )
    .await
    .expect("delete");
    eventually("Pod echo gone", Duration::from_secs(30), || async {
        matches!(pods.get_opt("echo").await, Ok(None)).then_some(())
    })
    .await;
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "process {pid} left"
    );
    assert_eq!(netns_count(), before - 1);

    drop(cluster);
    assert!(!state.exists(), "down removes the state");
    assert_eq!(netns_count(), 0);
    let link = Command::new("ip")
        .args(["link", "show", "hptc0"])
        .output()
        .expect("ip");
    assert!(!link.status.success(), "down removes the bridge");
}
