//! External commands (docker, kind, kubectl), each with a timeout: a hung tool fails the run
//! with its name and the bound, never hangs it.

use std::{path::Path, process::Stdio, time::Duration};

use anyhow::{Context, Result, bail};
use tokio::process::Command;

/// A command line to run from `dir`.
pub(crate) struct Cmd {
    program: String,
    args: Vec<String>,
    dir: Option<std::path::PathBuf>,
    timeout: Duration,
}

impl Cmd {
    /// `program` with `args`, bounded by `timeout`.
    pub(crate) fn new(program: &str, args: &[&str], timeout: Duration) -> Self {
        Self {
            program: program.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            dir: None,
            timeout,
        }
    }

    /// Runs it from `dir`.
    #[must_use]
    pub(crate) fn in_dir(mut self, dir: &Path) -> Self {
        self.dir = Some(dir.to_path_buf());
        self
    }

    fn line(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command.args(&self.args).kill_on_drop(true);
        if let Some(dir) = &self.dir {
            command.current_dir(dir);
        }
        command
    }

    /// Runs it with its output shown as it comes (builds, cluster creation).
    pub(crate) async fn show(self) -> Result<()> {
        let line = self.line();
        eprintln!("e2e: $ {line}");
        let mut command = self.command();
        command.stdin(Stdio::null());
        let status = tokio::time::timeout(self.timeout, command.status())
            .await
            .with_context(|| format!("`{line}` did not finish within {:?}", self.timeout))?
            .with_context(|| format!("running `{line}`"))?;
        if !status.success() {
            bail!("`{line}` failed ({status})");
        }
        Ok(())
    }

    /// Runs it and returns its standard output; a failure carries its standard error.
    pub(crate) async fn output(self) -> Result<String> {
        let line = self.line();
        let mut command = self.command();
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let output = tokio::time::timeout(self.timeout, command.output())
            .await
            .with_context(|| format!("`{line}` did not finish within {:?}", self.timeout))?
            .with_context(|| format!("running `{line}`"))?;
        if !output.status.success() {
            bail!(
                "`{line}` failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

/// Whether `binary` is an executable file on PATH.
pub(crate) fn on_path(binary: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(binary).is_file()))
        .unwrap_or(false)
}

/// Stops at once, naming what is missing, when docker, kind or kubectl is not on PATH or no
/// Docker engine answers.
pub(crate) async fn preflight() -> Result<()> {
    let missing: Vec<&str> = ["docker", "kind", "kubectl"]
        .into_iter()
        .filter(|b| !on_path(b))
        .collect();
    if !missing.is_empty() {
        bail!(
            "the e2e needs {} on PATH (missing: {})",
            "docker, kind and kubectl",
            missing.join(", ")
        );
    }
    Cmd::new(
        "docker",
        &["info", "--format", "{{.ServerVersion}}"],
        Duration::from_secs(20),
    )
    .output()
    .await
    .context("no Docker engine answers (`docker info` failed): start Docker and run again")?;
    Ok(())
}
