//! `cargo xtask cluster up|down|status`: a local Kubernetes cluster with no containers
//! (`haptic-node`): etcd, kube-apiserver and kube-controller-manager from the envtest assets,
//! and a process kubelet that runs the project's images as the workspace's binaries, each Pod
//! in a network namespace of its own on the bridge `hptc0` (10.88.0.0/24). Root only.
//!
//! The state (certificates, etcd's data, logs, pids, the Pods' directories) is
//! `target/local-cluster/`; `down` removes it and everything it names, also after a crash.

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};

/// The cluster's state directory.
pub(crate) fn state_dir() -> PathBuf {
    super::root().join("target").join("local-cluster")
}

/// The admin kubeconfig `up` writes.
pub(crate) fn kubeconfig() -> PathBuf {
    state_dir().join("admin.kubeconfig")
}

fn node_bin() -> PathBuf {
    super::root()
        .join("target")
        .join("debug")
        .join("haptic-node")
}

fn node(args: &[&str]) -> Result<()> {
    let status = Command::new(node_bin())
        .args(args)
        .arg("--state")
        .arg(state_dir())
        .status()
        .with_context(|| format!("running {}", node_bin().display()))?;
    if !status.success() {
        bail!("`haptic-node {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Builds the assets and the binaries when needed, then starts the cluster.
pub(crate) fn up() -> Result<()> {
    if !super::is_root() {
        bail!("the local cluster needs root (a bridge, network namespaces, mounts, setpriv)");
    }
    super::ensure_test_tools()?;
    let assets = super::envtest::ensure_all()?;
    super::cargo(
        &[
            "build",
            "--quiet",
            "-p",
            "haptic-node",
            "-p",
            "haptic-agent",
            "-p",
            "haptic-controller",
            "--bins",
        ],
        &[],
    )?;
    let bins = super::root().join("target").join("debug");
    let status = Command::new(node_bin())
        .arg("up")
        .arg("--state")
        .arg(state_dir())
        .arg("--assets")
        .arg(&assets)
        .arg("--bins")
        .arg(&bins)
        .status()
        .with_context(|| format!("running {}", node_bin().display()))?;
    if !status.success() {
        bail!("`haptic-node up` failed ({status})");
    }
    Ok(())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("up") => up(),
        Some(command @ ("down" | "status")) => {
            if !node_bin().is_file() {
                super::cargo(&["build", "--quiet", "-p", "haptic-node"], &[])?;
            }
            node(&[command])
        }
        _ => bail!("usage: cargo xtask cluster up|down|status"),
    }
}
