//! `cargo xtask conformance gateway`: the official Gateway API conformance suite
//! (`sigs.k8s.io/gateway-api/conformance`, the GATEWAY-HTTP profile) against a fresh local
//! cluster with no containers (`cargo xtask cluster`), `deploy/` installed in it.
//!
//! The suite's test binary and its backend `echo-basic` are built once per machine from the Go
//! module in `xtask/conformance/` (fetched through the Go module proxy) into a cache outside
//! `target/`, keyed by the Gateway API release, as the envtest assets are. `echo-basic` is
//! linked into `target/debug/`, where the process kubelet finds the binaries of the images it
//! knows. The Gateway API CRDs are the user's to install: they are read at run time from
//! `--crds PATH`, else `$HAPTIC_GATEWAY_API_CRDS`, else [`DEFAULT_CRDS`].

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// The Gateway API release the controller targets and the suite is built from.
pub(crate) const GATEWAY_API_VERSION: &str = "v1.5.1";
/// Where the standard-channel CRDs of that release are read from when neither `--crds` nor
/// `HAPTIC_GATEWAY_API_CRDS` names a file (this project's machines keep them there).
const DEFAULT_CRDS: &str = "/work/shared/gateway-api/standard-install-v1.5.1.yaml";
/// The GatewayClass the suite is pointed at.
const GATEWAY_CLASS: &str = "haptic";
/// The controller name of our GatewayClasses (`derivedViews.gateway.controllerName`).
const CONTROLLER_NAME: &str = "haproxy-haptic.org/gateway-controller";
/// What we claim: the profile's core features and the extended ones HAPTIC implements.
const SUPPORTED_FEATURES: &str = "Gateway,HTTPRoute,ReferenceGrant,\
GatewayPort8080,GatewayHTTPListenerIsolation,\
HTTPRouteQueryParamMatching,HTTPRouteMethodMatching,HTTPRouteResponseHeaderModification,\
HTTPRoutePortRedirect,HTTPRouteSchemeRedirect,HTTPRoutePathRedirect,\
HTTPRoute303RedirectStatusCode,HTTPRoute307RedirectStatusCode,HTTPRoute308RedirectStatusCode,\
HTTPRouteHostRewrite,HTTPRoutePathRewrite,HTTPRouteParentRefPort,HTTPRouteDestinationPortMatching,\
HTTPRouteBackendProtocolH2C,HTTPRouteBackendProtocolWebSocket,HTTPRouteNamedRouteRule";
/// The suite's own bound (`go test -timeout`); the process is killed a minute after.
const SUITE_BOUND: Duration = Duration::from_secs(45 * 60);

const USAGE: &str = "usage: cargo xtask conformance gateway [--keep] [--crds PATH] [--run-test NAME] [--skip-tests A,B]";

struct Options {
    keep: bool,
    crds: PathBuf,
    run_test: Option<String>,
    skip_tests: Option<String>,
}

fn options(args: &[String]) -> Result<Options> {
    let mut args = args.iter();
    match args.next().map(String::as_str) {
        Some("gateway") => {}
        _ => bail!("{USAGE}"),
    }
    let mut options = Options {
        keep: false,
        crds: env::var_os("HAPTIC_GATEWAY_API_CRDS")
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from(DEFAULT_CRDS), PathBuf::from),
        run_test: None,
        skip_tests: None,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--keep" => options.keep = true,
            "--crds" => options.crds = PathBuf::from(args.next().context("--crds needs a path")?),
            "--run-test" => {
                options.run_test = Some(args.next().context("--run-test needs a name")?.clone());
            }
            "--skip-tests" => {
                options.skip_tests = Some(args.next().context("--skip-tests needs names")?.clone());
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    Ok(options)
}

/// The cache directory: `${XDG_CACHE_HOME:-$HOME/.cache}/haptic/conformance/gateway-api-VERSION`.
fn cache_dir() -> Result<PathBuf> {
    let envtest = super::envtest::cache_dir()?;
    let haptic = envtest
        .parent()
        .and_then(Path::parent)
        .context("the envtest cache directory has no grandparent")?;
    Ok(haptic
        .join("conformance")
        .join(format!("gateway-api-{GATEWAY_API_VERSION}")))
}

const BINARIES: [&str; 2] = ["conformance.test", "echo-basic"];

/// The suite's binaries, built first when the cache does not hold them.
fn ensure_built() -> Result<PathBuf> {
    let cache = cache_dir()?;
    if BINARIES.iter().all(|b| cache.join(b).is_file()) {
        return Ok(cache);
    }
    let go = super::envtest::which("go").context(
        "the conformance suite is built with Go, and `go` is not on PATH: install Go >= 1.25",
    )?;
    let module = super::root().join("xtask").join("conformance");
    let parent = cache
        .parent()
        .context("the cache directory has no parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let staging = parent.join(format!(".building-{}", std::process::id()));
    if staging.exists() {
        fs::remove_dir_all(&staging)?;
    }
    fs::create_dir_all(&staging)?;
    eprintln!(
        "xtask: building the Gateway API {GATEWAY_API_VERSION} conformance suite and echo-basic with {} \
         (once per machine) into {}",
        go.display(),
        cache.display()
    );
    let started = Instant::now();
    let go_run = |args: &[&str]| -> Result<()> {
        let status = Command::new(&go)
            .args(args)
            .env("CGO_ENABLED", "0")
            .current_dir(&module)
            .status()
            .with_context(|| format!("running go {}", args.join(" ")))?;
        if !status.success() {
            let proxy = super::envtest::go_env(&go, "GOPROXY").unwrap_or_else(|| "unset".into());
            bail!(
                "`go {}` failed ({status}); its output is above (GOPROXY={proxy})",
                args.join(" ")
            );
        }
        Ok(())
    };
    let test_out = staging.join("conformance.test");
    let echo_out = staging.join("echo-basic");
    let built = go_run(&[
        "test",
        "-c",
        "-trimpath",
        "-o",
        &test_out.to_string_lossy(),
        ".",
    ])
    .and_then(|()| {
        go_run(&[
            "build",
            "-trimpath",
            "-ldflags",
            "-s -w",
            "-o",
            &echo_out.to_string_lossy(),
            "sigs.k8s.io/gateway-api/conformance/echo-basic",
        ])
    });
    if let Err(error) = built {
        let _ = fs::remove_dir_all(&staging);
        return Err(error);
    }
    if cache.exists() {
        fs::remove_dir_all(&cache).with_context(|| format!("removing {}", cache.display()))?;
    }
    fs::rename(&staging, &cache)
        .with_context(|| format!("moving {} to {}", staging.display(), cache.display()))?;
    eprintln!(
        "xtask: conformance suite built in {:.0?}: {}",
        started.elapsed(),
        cache.display()
    );
    Ok(cache)
}

fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Result<()> {
    let mut command = Command::new("kubectl");
    command.arg("--kubeconfig").arg(kubeconfig).args(args);
    let status = match stdin {
        None => command.status(),
        Some(text) => {
            use std::io::Write as _;
            command.stdin(std::process::Stdio::piped());
            let mut child = command.spawn().context("starting kubectl")?;
            if let Some(mut pipe) = child.stdin.take() {
                pipe.write_all(text.as_bytes())
                    .context("writing to kubectl")?;
            }
            child.wait()
        }
    }
    .context("running kubectl")?;
    if !status.success() {
        bail!("`kubectl {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let options = options(args)?;
    if !super::is_root() {
        bail!("the conformance run needs the local cluster, which needs root");
    }
    if !super::on_path("kubectl") {
        bail!("the conformance run applies manifests with kubectl, which is not on PATH");
    }
    if !options.crds.is_file() {
        bail!(
            "no Gateway API CRDs at {}: pass --crds PATH or set HAPTIC_GATEWAY_API_CRDS to the \
             standard-install.yaml of Gateway API {GATEWAY_API_VERSION}",
            options.crds.display()
        );
    }
    let started = Instant::now();
    let cache = ensure_built()?;
    let built = started.elapsed();
    // The process kubelet runs the images it knows from target/debug/.
    let debug = super::root().join("target").join("debug");
    fs::create_dir_all(&debug)?;
    let link = debug.join("echo-basic");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(cache.join("echo-basic"), &link)
        .with_context(|| format!("linking {}", link.display()))?;

    if super::cluster::state_dir().exists() {
        eprintln!("xtask: taking the running local cluster down for a fresh one");
        super::cluster::run(&["down".to_owned()])?;
    }
    let result = on_cluster(&options, &cache);
    eprintln!(
        "xtask: conformance took {:.0?} (building the suite {:.0?})",
        started.elapsed(),
        built
    );
    if options.keep {
        eprintln!(
            "xtask: cluster kept: KUBECONFIG={} (cargo xtask cluster down)",
            super::cluster::kubeconfig().display()
        );
    } else if super::cluster::state_dir().exists() {
        super::cluster::run(&["down".to_owned()])?;
    }
    result
}

fn on_cluster(options: &Options, cache: &Path) -> Result<()> {
    super::cluster::up()?;
    let kubeconfig = super::cluster::kubeconfig();
    // The CRDs before deploy/: the controller watches the Gateway API kinds from its start.
    let crds = options.crds.to_string_lossy().into_owned();
    kubectl(&kubeconfig, &["apply", "--server-side", "-f", &crds], None)?;
    kubectl(
        &kubeconfig,
        &[
            "wait",
            "--for",
            "condition=Established",
            "--timeout",
            "60s",
            "-f",
            &crds,
        ],
        None,
    )?;
    let mut install = Command::new(super::cargo_bin());
    install
        .args(["run", "--quiet", "-p", "haptic-e2e", "--", "--local"])
        .arg(&kubeconfig)
        .arg("--install-only")
        .current_dir(super::root());
    let (status, _) = super::e2e::wait_bounded_stderr(
        &mut install,
        Duration::from_secs(20 * 60),
        "haptic-e2e --local --install-only",
    )?;
    if !status.success() {
        bail!("installing deploy/ failed ({status})");
    }
    kubectl(
        &kubeconfig,
        &["apply", "-f", "-"],
        Some(&format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata:\n  name: {GATEWAY_CLASS}\nspec:\n  controllerName: {CONTROLLER_NAME}\n"
        )),
    )?;

    let out_dir = super::root().join("target").join("conformance");
    fs::create_dir_all(&out_dir)?;
    let report = out_dir.join(format!("gateway-http-report-{GATEWAY_API_VERSION}.yaml"));
    let log = out_dir.join("gateway-http.log");
    let _ = fs::remove_file(&report);
    let mut suite = Command::new(cache.join("conformance.test"));
    suite
        .env("KUBECONFIG", &kubeconfig)
        .arg("-test.v")
        .arg(format!("-test.timeout={}s", SUITE_BOUND.as_secs()))
        .arg(format!("-gateway-class={GATEWAY_CLASS}"))
        .arg("-conformance-profiles=GATEWAY-HTTP")
        .arg(format!("-supported-features={SUPPORTED_FEATURES}"))
        .arg("-organization=haptic")
        .arg("-project=haptic")
        .arg("-url=https://github.com/haptic-rs/haptic")
        .arg(format!("-version={}", env!("CARGO_PKG_VERSION")))
        .arg("-contact=https://github.com/haptic-rs/haptic/issues")
        .arg(format!("-report-output={}", report.display()))
        .current_dir(&out_dir)
        .stdout(fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?);
    if let Some(test) = &options.run_test {
        suite.arg(format!("-run-test={test}"));
    }
    if let Some(skip) = &options.skip_tests {
        suite.arg(format!("-skip-tests={skip}"));
    }
    eprintln!(
        "xtask: running the GATEWAY-HTTP conformance tests (log: {})",
        log.display()
    );
    let suite_started = Instant::now();
    let result = super::e2e::wait_bounded_stderr(
        &mut suite,
        SUITE_BOUND + Duration::from_secs(60),
        "conformance.test",
    );
    let text = fs::read_to_string(&log).unwrap_or_default();
    let (passed, failed, skipped) = summary(&text);
    eprintln!(
        "xtask: conformance: {} passed, {} failed, {} skipped, in {:.0?}",
        passed.len(),
        failed.len(),
        skipped.len(),
        suite_started.elapsed()
    );
    for name in &failed {
        eprintln!("  FAIL {name}");
    }
    if report.is_file() {
        eprintln!("xtask: report: {}", report.display());
    }
    let (status, _) = result?;
    if !status.success() {
        bail!(
            "the conformance suite failed ({status}); its log: {}",
            log.display()
        );
    }
    Ok(())
}

/// The tests `go test -v` reported (`--- PASS: TestConformance/Name`), one level below the
/// top: (passed, failed, skipped).
fn summary(log: &str) -> (Vec<String>, Vec<String>, Vec<String>) {
    let (mut passed, mut failed, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
    for line in log.lines() {
        let line = line.trim_start();
        let (list, rest) = if let Some(rest) = line.strip_prefix("--- PASS: ") {
            (&mut passed, rest)
        } else if let Some(rest) = line.strip_prefix("--- FAIL: ") {
            (&mut failed, rest)
        } else if let Some(rest) = line.strip_prefix("--- SKIP: ") {
            (&mut skipped, rest)
        } else {
            continue;
        };
        let name = rest.split_whitespace().next().unwrap_or_default();
        let mut parts = name.split('/');
        if let (Some("TestConformance"), Some(test), None) =
            (parts.next(), parts.next(), parts.next())
        {
            list.push(test.to_owned());
        }
    }
    (passed, failed, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_the_suites_tests_not_their_steps() {
        let log = "=== RUN   TestConformance\n    --- PASS: TestConformance/HTTPRouteSimpleSameNamespace (1.2s)\n        --- PASS: TestConformance/HTTPRouteSimpleSameNamespace/step (0.1s)\n    --- FAIL: TestConformance/HTTPRouteWeight (30.0s)\n    --- SKIP: TestConformance/HTTPRouteRequestMirror (0.0s)\n--- FAIL: TestConformance (40.0s)\n";
        let (passed, failed, skipped) = summary(log);
        assert_eq!(passed, ["HTTPRouteSimpleSameNamespace"]);
        assert_eq!(failed, ["HTTPRouteWeight"]);
        assert_eq!(skipped, ["HTTPRouteRequestMirror"]);
    }
}
