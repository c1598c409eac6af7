//! `haptic-e2e`: HAPTIC's acceptance scenarios on a real cluster. Creates a kind cluster from
//! `deploy/kind/`, builds the images `deploy/` names and `kind load`s them, applies `deploy/`,
//! then runs the election, failover, disabled-election and Ingress scenarios with kube. Run it
//! as `cargo xtask e2e`.
//!
//! Flags: `--name NAME` (the kind cluster, default `haptic-e2e`), `--keep` (leave the cluster
//! up afterwards), `--skip-build` (use images already built under the names of
//! `deploy/kustomization.yaml`).
//!
//! `--local KUBECONFIG`: the same scenarios on the local cluster with no containers
//! (`cargo xtask e2e --local` starts it: `haptic-node`), freshly up; nothing is built or
//! loaded (its process kubelet runs the workspace's binaries for the images `deploy/` names),
//! HAProxy is reached at a ready endpoint of the `haproxy` Service (a Pod address on the
//! bridge: there is no kube-proxy), and the cluster is left to `cargo xtask cluster down`.
//! `--install-only` (with `--local`): `deploy/` applied and rolled out, no scenario, the
//! cluster kept (`cargo xtask conformance` installs the controller so).

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
    /// The local cluster's admin kubeconfig (`--local`), instead of kind.
    pub(crate) local: Option<PathBuf>,
    /// Only apply `deploy/` (local cluster) and keep it: no scenario.
    pub(crate) install_only: bool,
}

fn options() -> Result<Options> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut options = Options {
        name: "haptic-e2e".to_owned(),
        keep: false,
        skip_build: false,
        root: manifest.parent().map(PathBuf::from).unwrap_or(manifest),
        local: None,
        install_only: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keep" => options.keep = true,
            "--skip-build" => options.skip_build = true,
            "--install-only" => options.install_only = true,
            "--local" => match args.next() {
                Some(kubeconfig) => options.local = Some(PathBuf::from(kubeconfig)),
                None => bail!("--local needs the local cluster's kubeconfig"),
            },
            "--name" => match args.next() {
                Some(name) => options.name = name,
                None => bail!("--name needs a value"),
            },
            "-h" | "--help" => {
                println!(
                    "usage: haptic-e2e [--name NAME] [--keep] [--skip-build] | --local KUBECONFIG [--keep] [--install-only]"
                );
                std::process::exit(0);
            }
            other => bail!(
                "unknown argument `{other}` (known: --name NAME, --keep, --skip-build, --local KUBECONFIG, --install-only)"
            ),
        }
    }
    if options.install_only {
        if options.local.is_none() {
            bail!("--install-only goes with --local KUBECONFIG");
        }
        options.keep = true;
    }
    Ok(options)
}

/// `haptic-node down` for the local cluster whose kubeconfig is `kubeconfig` (it lies in the
/// cluster's state directory; haptic-node is built beside this binary).
fn local_down(kubeconfig: &std::path::Path) {
    let (Some(state), Ok(exe)) = (kubeconfig.parent(), std::env::current_exe()) else {
        return;
    };
    let node = exe.with_file_name("haptic-node");
    match std::process::Command::new(&node)
        .arg("down")
        .arg("--state")
        .arg(state)
        .status()
    {
        Ok(status) if status.success() => {}
        Ok(status) => eprintln!("e2e: {} down failed ({status})", node.display()),
        Err(error) => eprintln!("e2e: running {}: {error}", node.display()),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("e2e: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let local_down_after = options.local.clone().filter(|_| !options.keep);
    let install_only = options.install_only;
    // Ctrl-C on the local cluster still ends in `down` (unless --keep).
    let outcome = tokio::select! {
        result = run(options) => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    if let Some(kubeconfig) = local_down_after {
        local_down(&kubeconfig);
    }
    match outcome {
        Ok(()) if install_only => {
            eprintln!("e2e: deploy/ installed (--install-only)");
            ExitCode::SUCCESS
        }
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

async fn run(options: Options) -> Result<()> {
    let started = std::time::Instant::now();
    let cluster = match &options.local {
        Some(kubeconfig) => cluster::Cluster::local(&options, kubeconfig).await?,
        None => {
            cmd::preflight().await?;
            cluster::Cluster::up(&options).await?
        }
    };
    eprintln!("e2e: installed in {:.0?}", started.elapsed());
    if options.install_only {
        return Ok(());
    }
    let outcome = scenarios::run(&cluster).await;
    if outcome.is_err() {
        cluster.diagnose().await;
    }
    eprintln!("e2e: finished in {:.0?}", started.elapsed());
    if options.local.is_some() {
        // The local cluster is stopped by `main` (or kept with --keep).
    } else if options.keep {
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
