//! kubectl against the stand-in: `api-resources`, `create -f` (with validation on), `get -o json`,
//! `replace` with a stale resourceVersion, `get -w` seeing a change made through the kube client,
//! and `delete`.
//!
//! kubectl is on PATH on the project's machines. Without it these tests fail loudly, unless
//! `HAPTIC_SKIP_KUBECTL=1` is set, in which case each one says so and passes.

#![allow(clippy::unwrap_used, missing_docs)]

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use haptic_testkit::ApiServer;
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A bound on one kubectl run; kubectl itself answers in well under a second.
const BOUND: Duration = Duration::from_secs(30);

/// kubectl's path, or None when it is missing and the skip is allowed. Panics, loudly, when it
/// is missing and the skip is not allowed.
fn kubectl_path() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("kubectl"))
            .find(|candidate| candidate.is_file())
    });
    if found.is_some() {
        return found;
    }
    if std::env::var("HAPTIC_SKIP_KUBECTL").as_deref() == Ok("1") {
        // Written to the stderr handle, not through eprintln!, so the test harness does not
        // swallow it for a passing test.
        let _ = writeln!(
            std::io::stderr(),
            "\n*** kubectl IS NOT ON PATH: kubectl tests SKIPPED because HAPTIC_SKIP_KUBECTL=1 ***\n"
        );
        return None;
    }
    panic!(
        "\n\n*** kubectl IS NOT ON PATH ***\nThe kubectl tests of haptic-testkit need kubectl (it is /usr/bin/kubectl on the project's \
         machines). Install it, or set HAPTIC_SKIP_KUBECTL=1 to skip these tests knowingly.\n"
    );
}

/// A kubectl bound to one server, with its own cache directory.
struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
    cache: tempfile::TempDir,
}

/// What one kubectl run printed.
#[derive(Debug)]
struct Output {
    success: bool,
    stdout: String,
    stderr: String,
}

impl Kubectl {
    fn new(server: &ApiServer) -> Option<Self> {
        Some(Self {
            bin: kubectl_path()?,
            kubeconfig: server.kubeconfig_for("kubectl").unwrap(),
            cache: tempfile::tempdir().unwrap(),
        })
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.bin);
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.cache.path())
            .arg("--request-timeout=20s")
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn run(&self, args: &[&str]) -> Output {
        let output = tokio::time::timeout(BOUND, self.command(args).output())
            .await
            .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish within {BOUND:?}"))
            .unwrap();
        Output {
            success: output.status.success(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    async fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(out.success, "kubectl {args:?} failed: {out:?}");
        out.stdout
    }
}

fn write(dir: &Path, name: &str, value: &Value) -> String {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

fn yaml_config_map(dir: &Path) -> String {
    let path = dir.join("cm.yaml");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: demo\n  labels:\n    app: demo\ndata:\n  greeting: hello\n",
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_api_resources_lists_builtin_and_crd_resources() {
    let server = ApiServer::start().await.unwrap();
    let Some(kubectl) = Kubectl::new(&server) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.example.com" },
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"] },
            "versions": [{ "name": "v1", "served": true, "storage": true, "subresources": { "status": {} },
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }],
        },
    });
    let out = kubectl
        .ok(&["create", "-f", &write(dir.path(), "crd.json", &crd)])
        .await;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/widgets.example.com created"),
        "{out}"
    );

    let out = kubectl.ok(&["api-resources", "--no-headers"]).await;
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.first() == Some(&name))
            .unwrap_or_else(|| panic!("{name} missing from api-resources:\n{out}"))
    };
    for (name, api_version, kind) in [
        ("namespaces", "v1", "Namespace"),
        ("pods", "v1", "Pod"),
        ("services", "v1", "Service"),
        ("secrets", "v1", "Secret"),
        ("configmaps", "v1", "ConfigMap"),
        ("events", "v1", "Event"),
        ("leases", "coordination.k8s.io/v1", "Lease"),
        ("endpointslices", "discovery.k8s.io/v1", "EndpointSlice"),
        ("ingresses", "networking.k8s.io/v1", "Ingress"),
        (
            "customresourcedefinitions",
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
        ),
        ("widgets", "example.com/v1", "Widget"),
    ] {
        let r = row(name);
        assert!(r.contains(&api_version) && r.last() == Some(&kind), "{r:?}");
    }
    assert!(row("widgets").contains(&"wd"));

    // The custom resource is usable through kubectl by its short name.
    let widget = json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w1" }, "spec": { "size": 3 } });
    kubectl
        .ok(&["create", "-f", &write(dir.path(), "w.json", &widget)])
        .await;
    let got: Value =
        serde_json::from_str(&kubectl.ok(&["get", "wd", "w1", "-o", "json"]).await).unwrap();
    assert_eq!(got["spec"]["size"], 3);
    assert_eq!(got["metadata"]["generation"], 1);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_create_get_replace_and_delete() {
    let server = ApiServer::start().await.unwrap();
    let Some(kubectl) = Kubectl::new(&server) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();

    // create -f with client validation on: kubectl asks the server to validate fields.
    let out = kubectl
        .ok(&["create", "-f", &yaml_config_map(dir.path())])
        .await;
    assert_eq!(out.trim(), "configmap/demo created");
    let posted = server
        .requests()
        .into_iter()
        .find(|r| r.client == "kubectl" && r.verb == "create")
        .unwrap_or_else(|| panic!("{:#?}", server.requests()));
    assert_eq!((posted.resource.as_str(), posted.code), ("configmaps", 201));

    // get -o json shows what the kube client sees.
    let got: Value = serde_json::from_str(
        &kubectl
            .ok(&["get", "configmap", "demo", "-o", "json"])
            .await,
    )
    .unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client().unwrap());
    let via_kube = cms.get("demo").await.unwrap();
    assert_eq!(got["data"]["greeting"], "hello");
    assert_eq!(
        got["metadata"]["uid"].as_str(),
        via_kube.metadata.uid.as_deref()
    );
    assert_eq!(
        got["metadata"]["resourceVersion"].as_str(),
        via_kube.metadata.resource_version.as_deref()
    );
    let list: Value = serde_json::from_str(
        &kubectl
            .ok(&["get", "configmaps", "-l", "app=demo", "-o", "json"])
            .await,
    )
    .unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);

    // replace with a stale resourceVersion: the real server's conflict text.
    cms.patch(
        "demo",
        &PatchParams::default(),
        &Patch::Merge(json!({ "data": { "greeting": "hi" } })),
    )
    .await
    .unwrap();
    let mut stale = got.clone();
    stale["data"]["greeting"] = json!("stale");
    let stale_path = write(dir.path(), "stale.json", &stale);
    let out = kubectl.run(&["replace", "-f", &stale_path]).await;
    assert!(!out.success);
    assert!(
        out.stderr.contains(&format!(
            r#"Error from server (Conflict): error when replacing "{stale_path}": Operation cannot be fulfilled on configmaps "demo": the object has been modified; please apply your changes to the latest version and try again"#
        )),
        "{out:?}"
    );
    assert_eq!(
        cms.get("demo").await.unwrap().data.unwrap()["greeting"],
        "hi"
    );

    // replace from the current state works.
    let mut current: Value = serde_json::from_str(
        &kubectl
            .ok(&["get", "configmap", "demo", "-o", "json"])
            .await,
    )
    .unwrap();
    current["data"]["greeting"] = json!("fresh");
    let out = kubectl
        .ok(&["replace", "-f", &write(dir.path(), "fresh.json", &current)])
        .await;
    assert_eq!(out.trim(), "configmap/demo replaced");
    assert_eq!(
        cms.get("demo").await.unwrap().data.unwrap()["greeting"],
        "fresh"
    );

    // A Lease: conflict text with the group, and server-side validation errors reach kubectl.
    let lease = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": "l" },
        "spec": { "holderIdentity": "a", "leaseDurationSeconds": 10 } });
    kubectl
        .ok(&["create", "-f", &write(dir.path(), "lease.json", &lease)])
        .await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let before = leases.get("l").await.unwrap();
    leases
        .patch(
            "l",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "holderIdentity": "b" } })),
        )
        .await
        .unwrap();
    let mut stale = serde_json::to_value(&before).unwrap();
    stale["spec"]["holderIdentity"] = json!("c");
    let out = kubectl
        .run(&[
            "replace",
            "-f",
            &write(dir.path(), "stale-lease.json", &stale),
        ])
        .await;
    assert!(
        out.stderr.contains(r#"Operation cannot be fulfilled on leases.coordination.k8s.io "l": the object has been modified; please apply your changes to the latest version and try again"#),
        "{out:?}"
    );
    let invalid = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": "bad" },
        "spec": { "leaseDurationSeconds": 0 } });
    let out = kubectl
        .run(&["create", "-f", &write(dir.path(), "bad.json", &invalid)])
        .await;
    assert!(
        out.stderr.contains(r#"The Lease "bad" is invalid: spec.leaseDurationSeconds: Invalid value: 0: must be greater than 0"#),
        "{out:?}"
    );

    // kubectl asks for strict field validation; unknown fields are refused by the server.
    let typo = json!({ "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "name": "typo" }, "dta": { "a": "b" } });
    let typo_path = write(dir.path(), "typo.json", &typo);
    let out = kubectl.run(&["create", "-f", &typo_path]).await;
    assert!(
        out.stderr.contains(&format!(
            r#"Error from server (BadRequest): error when creating "{typo_path}": ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: unknown field "dta""#
        )),
        "{out:?}"
    );

    // delete, then the real NotFound text.
    let out = kubectl.ok(&["delete", "configmap", "demo"]).await;
    assert_eq!(out.trim(), r#"configmap "demo" deleted"#);
    assert_eq!(cms.get_opt("demo").await.unwrap(), None);
    let out = kubectl.run(&["get", "configmap", "demo"]).await;
    assert!(!out.success);
    assert!(
        out.stderr
            .contains(r#"Error from server (NotFound): configmaps "demo" not found"#),
        "{out:?}"
    );
    let out = kubectl
        .ok(&["delete", "-f", &write(dir.path(), "lease2.json", &lease)])
        .await;
    assert!(
        out.contains(r#"lease.coordination.k8s.io "l" deleted"#),
        "{out}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_get_watch_sees_a_change_made_through_kube() {
    let server = ApiServer::start().await.unwrap();
    let Some(kubectl) = Kubectl::new(&server) else {
        return;
    };
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let mut lease = Lease::default();
    lease.metadata.name = Some("watched".into());
    lease.spec = Some(k8s_openapi::api::coordination::v1::LeaseSpec {
        holder_identity: Some("first".into()),
        ..Default::default()
    });
    leases.create(&Default::default(), &lease).await.unwrap();

    let mut child = kubectl
        .command(&[
            "get",
            "leases",
            "--field-selector",
            "metadata.name=watched",
            "-w",
            "--output-watch-events",
            "-o",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // With --output-watch-events and -o json kubectl prints one event per line.
    let mut next_event = async || {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .expect("kubectl printed within the bound")
            .unwrap()
            .expect("kubectl is still watching");
        let event: Value = serde_json::from_str(&line).unwrap();
        (
            event["type"].as_str().unwrap().to_owned(),
            event["object"]["spec"]["holderIdentity"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    };
    assert_eq!(next_event().await, ("ADDED".into(), "first".into()));
    // kubectl watches a collection from the resourceVersion of the list it printed, so a change
    // made once the first line is out reaches it as an event, open watch or not. (For a single
    // object it would watch from "0" and fold an early change into the synthetic ADDED it drops.)
    leases
        .patch(
            "watched",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "holderIdentity": "second" } })),
        )
        .await
        .unwrap();
    assert_eq!(next_event().await, ("MODIFIED".into(), "second".into()));
    leases.delete("watched", &Default::default()).await.unwrap();
    assert_eq!(next_event().await, ("DELETED".into(), "second".into()));
    child.kill().await.unwrap();
    server.shutdown().await;
}
