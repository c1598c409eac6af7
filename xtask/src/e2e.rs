//! `cargo xtask e2e`: HAPTIC's acceptance scenarios on a kind cluster. Checks at once that
//! docker, kind and kubectl are on PATH and that a Docker engine answers (and stops, naming
//! what is missing, when not), then runs the `haptic-e2e` binary, which creates the cluster
//! from `deploy/kind/`, builds and loads the images, applies `deploy/kind` and runs the
//! scenarios. Arguments go to it: `--name NAME`, `--keep`, `--skip-build`.

use std::{
    io::Read as _,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// The whole run (building the images included) is bounded too.
const RUN_BOUND: Duration = Duration::from_secs(3 * 60 * 60);

pub(crate) fn run(args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == "--local") {
        return local(args);
    }
    preflight()?;
    let mut command = Command::new(super::cargo_bin());
    command
        .args(["run", "--quiet", "-p", "haptic-e2e", "--"])
        .args(args)
        .current_dir(super::root());
    let (status, _) = wait_bounded_stderr(&mut command, RUN_BOUND, "cargo run -p haptic-e2e")?;
    if !status.success() {
        bail!("the e2e failed ({status})");
    }
    Ok(())
}

/// `e2e --local [--keep]`: the scenarios on a fresh local cluster (`cargo xtask cluster`),
/// taken down afterwards unless `--keep`.
fn local(args: &[String]) -> Result<()> {
    if let Some(other) = args
        .iter()
        .find(|a| !matches!(a.as_str(), "--local" | "--keep"))
    {
        bail!("e2e --local takes only --keep (got `{other}`)");
    }
    if !super::on_path("kubectl") {
        bail!("e2e --local applies deploy/ with kubectl, which is not on PATH");
    }
    let keep = args.iter().any(|a| a == "--keep");
    let started = Instant::now();
    // A fresh cluster: the scenarios install deploy/ into an empty one.
    if super::cluster::state_dir().exists() {
        eprintln!("xtask: taking the running local cluster down for a fresh one");
        super::cluster::run(&["down".to_owned()])?;
    }
    super::cluster::up()?;
    let up = started.elapsed();
    let mut command = Command::new(super::cargo_bin());
    // haptic-e2e takes the cluster down at its end, and on Ctrl-C (which ends this process
    // at once), unless --keep.
    command
        .args(["run", "--quiet", "-p", "haptic-e2e", "--", "--local"])
        .arg(super::cluster::kubeconfig())
        .args(keep.then_some("--keep"))
        .current_dir(super::root());
    let result = wait_bounded_stderr(
        &mut command,
        RUN_BOUND,
        "cargo run -p haptic-e2e -- --local",
    );
    eprintln!(
        "xtask: e2e --local took {:.0?} (cluster build and start {:.0?})",
        started.elapsed(),
        up
    );
    if keep {
        eprintln!(
            "xtask: cluster kept: KUBECONFIG={} (cargo xtask cluster down)",
            super::cluster::kubeconfig().display()
        );
    } else if super::cluster::state_dir().exists() {
        super::cluster::run(&["down".to_owned()])?;
    }
    let (status, _) = result?;
    if !status.success() {
        bail!("the e2e on the local cluster failed ({status})");
    }
    Ok(())
}

/// Fails fast, before anything is compiled, when a tool or the Docker engine is missing.
fn preflight() -> Result<()> {
    missing_tools(std::env::var_os("PATH").as_deref())?;
    // `docker info` hangs on some broken setups: bounded; its complaint is shown.
    let mut info = Command::new("docker");
    info.args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let (status, stderr) = wait_bounded_stderr(&mut info, Duration::from_secs(20), "docker info")
        .context("no Docker engine")?;
    if !status.success() {
        bail!(
            "no Docker engine: `docker info` failed ({status}): {}; start Docker and run again",
            stderr.trim()
        );
    }
    Ok(())
}

/// Fails, naming every one missing, unless docker, kind and kubectl are files in `path`.
fn missing_tools(path: Option<&std::ffi::OsStr>) -> Result<()> {
    let dirs: Vec<std::path::PathBuf> = path
        .map(|p| std::env::split_paths(p).collect())
        .unwrap_or_default();
    let missing: Vec<&str> = ["docker", "kind", "kubectl"]
        .into_iter()
        .filter(|binary| !dirs.iter().any(|dir| dir.join(binary).is_file()))
        .collect();
    if !missing.is_empty() {
        bail!(
            "e2e needs docker, kind and kubectl on PATH; missing: {} (https://kind.sigs.k8s.io/docs/user/quick-start/)",
            missing.join(", ")
        );
    }
    Ok(())
}

/// Runs `command` and waits at most `bound`; past it the child is killed. Returns the exit
/// status and, when the caller piped it, the standard error (short: it is read at exit).
pub(crate) fn wait_bounded_stderr(
    command: &mut Command,
    bound: Duration,
    what: &str,
) -> Result<(std::process::ExitStatus, String)> {
    let mut child = command
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting `{what}`"))?;
    let started = Instant::now();
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for `{what}`"))?
        {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            return Ok((status, stderr));
        }
        if started.elapsed() >= bound {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{what}` did not finish within {bound:?}; killed");
        }
        thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missing_tool_is_named() {
        let error = missing_tools(None).expect_err("no PATH");
        assert!(
            error.to_string().contains("missing: docker, kind, kubectl"),
            "{error}"
        );
        let empty = std::env::temp_dir().join(format!("xtask-e2e-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("dir");
        let error = missing_tools(Some(empty.as_os_str())).expect_err("empty dir");
        assert!(error.to_string().contains("missing: docker, kind, kubectl"));
        for tool in ["docker", "kubectl"] {
            std::fs::write(empty.join(tool), "").expect("fake tool");
        }
        let error = missing_tools(Some(empty.as_os_str())).expect_err("no kind");
        assert!(error.to_string().contains("missing: kind ("), "{error}");
        std::fs::write(empty.join("kind"), "").expect("fake kind");
        missing_tools(Some(empty.as_os_str())).expect("all there");
        let _ = std::fs::remove_dir_all(&empty);
    }

    #[test]
    fn a_command_past_its_bound_is_killed() {
        let started = Instant::now();
        let mut sleep = Command::new("sleep");
        sleep.arg("30");
        let error = wait_bounded_stderr(&mut sleep, Duration::from_millis(200), "sleep 30")
            .expect_err("bounded");
        assert!(
            error.to_string().contains("did not finish within"),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
