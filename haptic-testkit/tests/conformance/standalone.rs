//! The standalone server (`cargo xtask apiserver` runs this binary): it prints a kubeconfig
//! path that clients can use.

use std::process::Stdio;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, api::PostParams};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{BOUND, lease};

#[tokio::test]
async fn standalone_server_prints_a_usable_kubeconfig() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_haptic-apiserver"))
        .arg("--kubeconfig")
        .arg(&path)
        .arg("--user")
        .arg("operator")
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let printed = tokio::time::timeout(BOUND, async {
        loop {
            let line = lines.next_line().await.unwrap().expect("the server runs");
            if let Some(p) = line.strip_prefix("kubeconfig: ") {
                return p.to_owned();
            }
        }
    })
    .await
    .expect("the kubeconfig path is printed");
    assert_eq!(printed, path.to_string_lossy());

    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let leases: Api<Lease> = Api::default_namespaced(kube::Client::try_from(config).unwrap());
    let created = tokio::time::timeout(
        BOUND,
        leases.create(&PostParams::default(), &lease("s", "a")),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(created.metadata.uid.is_some());
    child.kill().await.unwrap();
}
