//! `haptic-node`: a local Kubernetes cluster with no containers, for `cargo xtask cluster` and
//! `cargo xtask e2e --local`.
//!
//! - `haptic-node up --state DIR --assets DIR --bins DIR`: etcd, kube-apiserver and
//!   kube-controller-manager (the envtest assets), a bridge with a private Pod range, and the
//!   process kubelet (`haptic-node agent`), each a detached process whose pid is in `DIR`; waits
//!   until the Node is Ready.
//! - `haptic-node down --state DIR`: stops everything `DIR` records (and every network
//!   namespace of the cluster's prefix), removes the bridge and `DIR`. Works after a crash.
//! - `haptic-node status --state DIR`: which processes live, the kubeconfig, the Pods.
//! - `haptic-node agent ...`: the process kubelet (started by `up`).

mod cluster;
mod kubelet;
mod net;
mod node;
mod pod;

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context, Result, bail};

/// Values of `--flag VALUE` pairs after the subcommand.
pub(crate) struct Flags(Vec<(String, String)>);

impl Flags {
    fn parse(args: &[String]) -> Result<Self> {
        let mut pairs = Vec::new();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let Some(name) = flag.strip_prefix("--") else {
                bail!("unexpected argument `{flag}`");
            };
            let value = it
                .next()
                .with_context(|| format!("--{name} needs a value"))?;
            pairs.push((name.to_owned(), value.clone()));
        }
        Ok(Self(pairs))
    }

    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn path(&self, name: &str) -> Result<PathBuf> {
        self.get(name)
            .map(PathBuf::from)
            .with_context(|| format!("--{name} DIR is required"))
    }
}

const USAGE: &str = "usage: haptic-node up --state DIR --assets DIR --bins DIR | down --state DIR | status --state DIR | agent --state DIR";

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = (|| -> Result<()> {
        let (command, rest) = args.split_first().context(USAGE)?;
        let flags = Flags::parse(rest)?;
        match command.as_str() {
            "up" => cluster::up(&flags),
            "down" => cluster::down(&flags.path("state")?),
            "status" => cluster::status(&flags.path("state")?),
            "agent" => {
                let runtime = tokio::runtime::Runtime::new().context("starting tokio")?;
                runtime.block_on(node::run(&flags))
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                Ok(())
            }
            other => bail!("unknown command `{other}`\n{USAGE}"),
        }
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("haptic-node: {error:#}");
            ExitCode::FAILURE
        }
    }
}
