//! `haptic-e2e`: HAPTIC's acceptance scenarios on a real cluster. Creates a kind cluster from
//! `deploy/kind/`, builds the images `deploy/` names and `kind load`s them, applies `deploy/`,
//! then runs the election, failover, disabled-election and Ingress scenarios with kube. Run it
//! as `cargo xtask e2e`.
//!
//! Flags: `--name NAME` (the kind cluster, default `haptic-e2e`), `--keep` (leave the cluster
//! up afterwards), `--skip-build` (use images already built under the names of
//! `deploy/kustomization.yaml`).

mod cluster;
mod cmd;
mod scenarios;

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Result, bail};

/// What the command line asked for.
pub(crate) struct Options {
    /// The kind cluster's name.
    pub(crate) name: String,
    /// Leave the cluster up afterwards.
    pub(crate) keep: bool,
    /// Do not build the images.
    pub(crate) skip_build: bool,
    /// The workspace root.
    pub(crate) root: PathBuf,
}

fn options() -> Result<Options> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut options = Options {
        name: "haptic-e2e".to_owned(),
        keep: false,
        skip_build: false,
        root: manifest.parent().map(PathBuf::from).unwrap_or(manifest),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keep" => options.keep = true,
            "--skip-build" => options.skip_build = true,
            "--name" => match args.next() {
                Some(name) => options.name = name,
                None => bail!("--name needs a value"),
            },
            "-h" | "--help" => {
                println!("usage: haptic-e2e [--name NAME] [--keep] [--skip-build]");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}` (known: --name NAME, --keep, --skip-build)"),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = async {
        let options = options()?;
        cmd::preflight().await?;
        let cluster = cluster::Cluster::up(&options).await?;
        let outcome = scenarios::run(&cluster).await;
        if outcome.is_err() {
            cluster.diagnose().await;
        }
        if options.keep {
            eprintln!(
                "e2e: cluster `{}` kept; kubeconfig {}",
                options.name,
                cluster.kubeconfig.display()
            );
        } else {
            cluster.delete().await;
        }
        outcome
    }
    .await;
    match result {
        Ok(()) => {
            eprintln!("e2e: all scenarios passed");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("e2e: {error:#}");
            ExitCode::FAILURE
        }
    }
}
