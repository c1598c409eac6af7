//! `cargo xtask`: the project's tooling, one subcommand a job.
//!
//! - `test`: installs what the tests need (the Debian `haproxy` package) and the envtest
//!   assets (`envtest`), then runs `cargo fmt --check`, clippy with `-D warnings` on all targets
//!   (each skipped, and said so, when the toolchain lacks it), the whole test suite with
//!   `KUBEBUILDER_ASSETS` set, the
//!   validation tests of the config `deploy/` ships (`haptic-controller validate`), the demo's
//!   smoke check and a short fault campaign (`chaos`).
//! - `bench [election|agent|render|eventbus|controller|webhook]`: runs the project's benchmarks.
//! - `demo [--smoke] [--real]`: the whole system on one machine, no cluster (see the README);
//!   `--real` on a real kube-apiserver with etcd instead of the stand-in.
//! - `envtest`: prints a directory holding kube-apiserver and etcd for the real-API-server
//!   tier, building them once per machine with Go when `KUBEBUILDER_ASSETS` does not hold them.
//! - `cluster up|down|status`: a local cluster with no containers (`haptic-node`), and
//!   `e2e --local`: the e2e scenarios on it; `conformance gateway`: the official Gateway API
//!   conformance suite (GATEWAY-HTTP) on it.
//! - `apiserver`: runs the haptic-testkit API server until Ctrl-C and prints a kubeconfig path.
//! - `chaos [--runs N] [--seed S] [--minutes M] ...`: the seeded fault campaign (haptic-chaos).

use std::{
    env,
    path::PathBuf,
    process::{Command, ExitCode},
};

use anyhow::{Context, Result, bail};

mod cluster;
mod conformance;
mod e2e;
mod envtest;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let mut args = env::args().skip(1);
    let task = args.next().unwrap_or_else(|| "help".to_owned());
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "test" => test(&rest),
        "bench" => bench(&rest),
        "e2e" => e2e::run(&rest),
        "cluster" => cluster::run(&rest),
        "conformance" => conformance::run(&rest),
        "envtest" => envtest::run(&rest),
        "apiserver" => cargo(
            &[
                "run",
                "--quiet",
                "-p",
                "haptic-testkit",
                "--bin",
                "haptic-apiserver",
                "--",
            ],
            &rest,
        ),
        "setup" => ensure_test_tools(),
        "demo" => demo(&rest),
        "chaos" => chaos(&rest),
        "help" | "-h" | "--help" => {
            println!("{}", HELP);
            Ok(())
        }
        other => bail!("unknown task `{other}`\n{HELP}"),
    }
}

const HELP: &str = "usage: cargo xtask <task>
  test               install test tools if missing, build the envtest assets if missing, then fmt --check, clippy -D warnings,
                     all tests (KUBEBUILDER_ASSETS set: the real-API-server tier), validate deploy/haptic-config.yaml, demo smoke, a short chaos campaign
  setup              only install the test tools (haproxy)
  envtest [--check]  print a directory holding kube-apiserver, etcd (the real-API-server tests) and kube-controller-manager
                     (KUBEBUILDER_ASSETS if it holds the three, else built once with Go into ~/.cache/haptic/envtest)
  demo [--smoke] [--real]
                     the whole system on this machine (API server, 2 controllers, 2 agents with HAProxy, a demo app); --smoke checks
                     it and exits; --real uses a real kube-apiserver + etcd (envtest assets, root for network namespaces)
  bench [NAME...] [-- ARGS]
                     run benchmarks: election, agent, render, eventbus, controller, webhook (default: all); ARGS go to the
                     one bench named (`bench controller -- 10000 --changes 3000`: HAPTIC's protocol at N = 3,000)
  e2e [ARGS]         acceptance scenarios on a kind cluster (needs docker, kind, kubectl; --keep, --skip-build)
  e2e --local [--keep]
                     the same scenarios on a fresh local cluster (below; root, kubectl), taken down at the end and on
                     Ctrl-C unless --keep: deploy/ applied as deploy/README.md says, its Pods run as local processes
  cluster up|down|status
                     a local Kubernetes cluster with no containers (root): etcd, kube-apiserver, kube-controller-manager
                     (envtest assets) and a process kubelet (haptic-node) running the project's images as the workspace's
                     binaries, each Pod in a network namespace on bridge hptc0 (10.88.0.0/24); state in target/local-cluster
                     (KUBECONFIG=target/local-cluster/admin.kubeconfig); not part of `test`
  conformance gateway [--keep] [--crds PATH] [--run-test NAME] [--skip-tests A,B]
                     the official Gateway API v1.5.1 conformance suite, profile GATEWAY-HTTP, on a fresh local cluster
                     (root, kubectl, Go; suite built once into ~/.cache/haptic/conformance); CRDs from --crds, else
                     $HAPTIC_GATEWAY_API_CRDS, else /work/shared/gateway-api/standard-install-v1.5.1.yaml; report and log in
                     target/conformance/; not part of `test`
  apiserver [ARGS]   run the haptic-testkit API server until Ctrl-C (prints the kubeconfig path)
  chaos [ARGS]       seeded fault campaign: 3 replicas, 3 agents, faults; no stale apply may go live
                     (--runs N, --seed S, --minutes M, --fault-seconds, --plan, --verbose, --keep)";

fn root() -> PathBuf {
    // xtask lives one level below the workspace root.
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

fn cargo_bin() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn cargo(args: &[&str], extra: &[String]) -> Result<()> {
    cargo_with_env(args, extra, &[])
}

fn cargo_with_env(
    args: &[&str],
    extra: &[String],
    vars: &[(&str, &std::ffi::OsStr)],
) -> Result<()> {
    let status = Command::new(cargo_bin())
        .args(args)
        .args(extra)
        .envs(vars.iter().copied())
        .current_dir(root())
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

fn on_path(binary: &str) -> bool {
    env::var_os("PATH")
        .map(|paths| env::split_paths(&paths).any(|dir| dir.join(binary).is_file()))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Installs the Debian `haproxy` package when it is missing. The tests run the real binary.
fn ensure_test_tools() -> Result<()> {
    if on_path("haproxy") || PathBuf::from("/usr/sbin/haproxy").is_file() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "the tests need HAProxy: install the Debian package (`sudo apt-get install -y haproxy`) and run again"
        );
    }
    eprintln!("xtask: installing the Debian haproxy package");
    let update = Command::new("apt-get")
        .args(["update", "-q"])
        .status()
        .context("running apt-get update")?;
    if !update.success() {
        bail!("`apt-get update` failed ({update})");
    }
    let install = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends", "haproxy"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install haproxy")?;
    if !install.success() {
        bail!("`apt-get install haproxy` failed ({install})");
    }
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    ensure_test_tools()?;
    // The real tier needs kube-apiserver and etcd: built once per machine, then reused.
    let assets = envtest::ensure()?;
    let mut skipped = Vec::new();
    if cargo_has("fmt") {
        cargo(&["fmt", "--all", "--check"], &[])?;
    } else {
        skipped
            .push("rustfmt (`cargo fmt --check`): install it with `rustup component add rustfmt`");
    }
    if cargo_has("clippy") {
        cargo(
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--locked",
                "--",
                "-D",
                "warnings",
            ],
            &[],
        )?;
    } else {
        skipped.push(
            "clippy (`cargo clippy -D warnings`): install it with `rustup component add clippy`",
        );
    }
    for what in &skipped {
        eprintln!("xtask: SKIPPED {what}");
    }
    cargo_with_env(
        &["test", "--workspace", "--locked"],
        extra,
        &[("KUBEBUILDER_ASSETS", assets.as_os_str())],
    )?;
    // The validation tests of the config deploy/ ships, as a user's CI would run them.
    cargo(
        &[
            "run",
            "--quiet",
            "--locked",
            "-p",
            "haptic-controller",
            "--",
            "validate",
            "-f",
            "deploy/haptic-config.yaml",
        ],
        &[],
    )?;
    // The main job, end to end: every claim the demo prints, checked.
    demo(&["--smoke".to_owned()])?;
    // A short fault campaign (random seeds, printed; a failing one replays with --seed):
    // runs of about 25 s, none started after 3 minutes, so it ends within about 4.
    chaos(&CI_CHAOS.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())?;
    if !skipped.is_empty() {
        eprintln!("xtask: the tests passed, but these checks were SKIPPED (tool missing):");
        for what in &skipped {
            eprintln!("xtask:   {what}");
        }
    }
    Ok(())
}

/// Whether `cargo SUB --version` runs (rustfmt and clippy are rustup components that a
/// toolchain may lack).
fn cargo_has(sub: &str) -> bool {
    Command::new(cargo_bin())
        .args([sub, "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The campaign `cargo xtask test` runs.
const CI_CHAOS: [&str; 4] = ["--runs", "6", "--minutes", "3"];

/// Builds the agent, the controller and the campaign runner, then runs the campaign
/// (`haptic-chaos` finds the other binaries beside its own executable).
fn chaos(extra: &[String]) -> Result<()> {
    ensure_test_tools()?;
    build_process_bins(false)?;
    cargo(&["run", "--quiet", "-p", "haptic-chaos", "--"], extra)
}

/// Builds the binaries the demo starts, then runs it (`--smoke`: checks, then exits).
fn demo(extra: &[String]) -> Result<()> {
    ensure_test_tools()?;
    // The demo finds the binaries beside its own executable.
    build_process_bins(false)?;
    cargo(
        &[
            "run",
            "--quiet",
            "-p",
            "haptic-controller",
            "--example",
            "demo",
            "--",
        ],
        extra,
    )
}

/// Builds the agent and controller binaries that the demo and the controller bench start as
/// processes (they find them beside their own executable, in the same profile).
fn build_process_bins(release: bool) -> Result<()> {
    let mut args = vec!["build", "--quiet"];
    if release {
        args.push("--release");
    }
    args.extend(["-p", "haptic-agent", "-p", "haptic-controller", "--bins"]);
    cargo(&args, &[])
}

/// `names` are benches to run, then, after `--`, arguments for the one bench named (the
/// controller's base sizes and counts: `cargo xtask bench controller -- 10000 --changes 3000`).
fn bench(args: &[String]) -> Result<()> {
    let (names, extra) = match args.iter().position(|arg| arg == "--") {
        Some(at) => (&args[..at], &args[at + 1..]),
        None => (args, &args[args.len()..]),
    };
    if !extra.is_empty() && names.len() != 1 {
        bail!("arguments after `--` go to one bench: name exactly one before them");
    }
    let all = [
        "eventbus",
        "render",
        "election",
        "agent",
        "controller",
        "webhook",
    ];
    let selected: Vec<&str> = if names.is_empty() {
        all.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    for name in selected {
        match name {
            "eventbus" | "render" => {
                let mut args = vec!["bench", "-p", "haptic-benches", "--bench", name];
                if !extra.is_empty() {
                    args.push("--");
                }
                cargo(&args, extra)?
            }
            // The election and agent benches are harness-less programs that drive real
            // processes; each lives as an example of the crate it measures.
            "election" | "agent" => cargo(
                &[
                    "run",
                    "--release",
                    "--quiet",
                    "-p",
                    &format!("haptic-{name}"),
                    "--example",
                    &format!("bench_{name}"),
                    "--",
                ],
                extra,
            )?,
            // Real processes: the agent and controller binaries must be built in release first.
            "controller" | "webhook" => {
                build_process_bins(true)?;
                let example = format!("bench_{name}");
                cargo(
                    &[
                        "run",
                        "--release",
                        "--quiet",
                        "-p",
                        "haptic-controller",
                        "--example",
                        &example,
                        "--",
                    ],
                    extra,
                )?
            }
            other => bail!("unknown bench `{other}` (known: {})", all.join(", ")),
        }
    }
    Ok(())
}
