//! `cargo xtask envtest`: the real API server's binaries (kube-apiserver and etcd) for the
//! tests' real tier, following controller-runtime envtest's convention, and
//! kube-controller-manager beside them for the local cluster (`cargo xtask cluster`).
//!
//! When `KUBEBUILDER_ASSETS` names a directory holding the binaries a task needs (the tests:
//! kube-apiserver and etcd; the cluster: the three), that directory is the answer. Otherwise they are built once per machine with `go build` from the Go module in
//! `xtask/envtest/` (k8s.io/kubernetes and go.etcd.io/etcd, fetched through the Go module proxy
//! and nothing else) into a cache outside `target/`, keyed by their versions, so `cargo clean`
//! does not cost a 17-minute rebuild. The build goes to a temporary directory renamed into
//! place at the end: an interrupted build leaves no half-filled cache behind.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};

/// The Kubernetes release the assets are built from (the minor of k8s-openapi's `v1_34`).
pub(crate) const KUBERNETES_VERSION: &str = "v1.34.4";
/// The etcd release Kubernetes v1.34 is tested with.
pub(crate) const ETCD_VERSION: &str = "v3.6.4";
/// The binaries a build writes. A cache from before kube-controller-manager joined them still
/// serves the tests; the local cluster builds it again (with a warm Go build cache,
/// kube-controller-manager costs about 4 minutes on 2 cores, the other two a relink).
const BINARIES: [&str; 3] = ["kube-apiserver", "etcd", "kube-controller-manager"];
/// What the real-API-server tests need.
const FOR_TESTS: [&str; 2] = ["kube-apiserver", "etcd"];

/// `cargo xtask envtest [--check]`: ensures the assets and prints their directory.
pub(crate) fn run(args: &[String]) -> Result<()> {
    if let Some(other) = args.iter().find(|a| a.as_str() != "--check") {
        bail!("unknown envtest argument `{other}` (known: --check)");
    }
    let dir = if args.iter().any(|a| a == "--check") {
        existing(&BINARIES)?
            .context("no envtest assets yet: run `cargo xtask envtest` to build them")?
    } else {
        ensure_all()?
    };
    println!("{}", dir.display());
    Ok(())
}

/// The cache directory for this version pair:
/// `${XDG_CACHE_HOME:-$HOME/.cache}/haptic/envtest/k8s-VERSION-etcd-VERSION`.
pub(crate) fn cache_dir() -> Result<PathBuf> {
    let base =
        match env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => PathBuf::from(env::var_os("HOME").filter(|v| !v.is_empty()).context(
                "neither XDG_CACHE_HOME nor HOME is set: no place for the envtest cache",
            )?)
            .join(".cache"),
        };
    Ok(base
        .join("haptic")
        .join("envtest")
        .join(format!("k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}")))
}

fn complete(dir: &Path, needed: &[&str]) -> bool {
    needed.iter().all(|b| dir.join(b).is_file())
}

/// The assets when they exist already (KUBEBUILDER_ASSETS first, then the cache).
fn existing(needed: &[&str]) -> Result<Option<PathBuf>> {
    if let Some(assets) = env::var_os("KUBEBUILDER_ASSETS").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(assets);
        if complete(&dir, needed) {
            return Ok(Some(dir));
        }
        eprintln!(
            "xtask: KUBEBUILDER_ASSETS={} does not hold all of {}; using the xtask cache",
            dir.display(),
            needed.join(", ")
        );
    }
    let cache = cache_dir()?;
    Ok(complete(&cache, needed).then_some(cache))
}

/// Returns a directory holding kube-apiserver and etcd (the tests' real tier), building the
/// assets first when needed.
pub(crate) fn ensure() -> Result<PathBuf> {
    ensure_with(&FOR_TESTS)
}

/// Returns a directory holding kube-apiserver, etcd and kube-controller-manager (the local
/// cluster), building them first when needed.
pub(crate) fn ensure_all() -> Result<PathBuf> {
    ensure_with(&BINARIES)
}

fn ensure_with(needed: &[&str]) -> Result<PathBuf> {
    if let Some(dir) = existing(needed)? {
        return Ok(dir);
    }
    let cache = cache_dir()?;
    build_into(&cache)?;
    Ok(cache)
}

/// `go build` of the binaries into a temporary sibling of `cache`, then a rename.
fn build_into(cache: &Path) -> Result<()> {
    let go = which("go").context(
        "the envtest assets are built with Go, and `go` is not on PATH: install Go >= 1.24 \
         (https://go.dev/doc/install), or set KUBEBUILDER_ASSETS to a directory holding \
         kube-apiserver and etcd",
    )?;
    let module = crate::root().join("xtask").join("envtest");
    let parent = cache
        .parent()
        .context("the envtest cache directory has no parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let staging = parent.join(format!(
        ".building-{}-{}",
        std::process::id(),
        cache
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .with_context(|| format!("removing a stale {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;

    eprintln!(
        "xtask: building kube-apiserver and kube-controller-manager {KUBERNETES_VERSION} and etcd \
         {ETCD_VERSION} with {} (once per machine; cold: about 21 minutes and 2 GB of RAM on 2 \
         cores) into {}",
        go.display(),
        cache.display()
    );
    let started = Instant::now();
    let result = go_build(&go, &module, &staging);
    if let Err(error) = result {
        let _ = fs::remove_dir_all(&staging);
        return Err(error);
    }
    if !complete(&staging, &BINARIES) {
        let _ = fs::remove_dir_all(&staging);
        bail!(
            "`go build` succeeded but did not write all of {}",
            BINARIES.join(", ")
        );
    }
    if cache.exists() {
        // A half-filled directory from an older layout: the staged build replaces it.
        fs::remove_dir_all(cache).with_context(|| format!("removing {}", cache.display()))?;
    }
    fs::rename(&staging, cache)
        .with_context(|| format!("moving {} to {}", staging.display(), cache.display()))?;
    eprintln!(
        "xtask: envtest assets built in {:.0?}: {}",
        started.elapsed(),
        cache.display()
    );
    Ok(())
}

fn go_build(go: &Path, module: &Path, out: &Path) -> Result<()> {
    eprintln!(
        "xtask: go build ./kube-apiserver ./etcd ./kube-controller-manager (CGO off, -trimpath, stripped; modules come \
         through GOPROXY; each package is listed as it builds)"
    );
    let ldflags = format!(
        "-s -w -X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION} \
         -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=34"
    );
    // The output path ends in `/` so go writes each binary into the directory.
    let mut out_arg = out.as_os_str().to_owned();
    out_arg.push("/");
    let build = Command::new(go)
        .args(["build", "-v", "-trimpath", "-ldflags", &ldflags, "-o"])
        .arg(out_arg)
        .args(["./kube-apiserver", "./etcd", "./kube-controller-manager"])
        .env("CGO_ENABLED", "0")
        .current_dir(module)
        .status()
        .context("running `go build`")?;
    if !build.success() {
        let proxy = go_env(go, "GOPROXY").unwrap_or_else(|| "unset".to_owned());
        bail!(
            "`go build` of the envtest assets failed ({build}); its output is above. If a module \
             could not be fetched, the Go module proxy is unreachable from here or disabled \
             (GOPROXY={proxy})"
        );
    }
    Ok(())
}

pub(crate) fn go_env(go: &Path, key: &str) -> Option<String> {
    let out = Command::new(go).args(["env", key]).output().ok()?;
    let value = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (!value.is_empty()).then_some(value)
}

pub(crate) fn which(binary: &str) -> Option<PathBuf> {
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|dir| dir.join(binary))
            .find(|p| p.is_file())
    })
}
