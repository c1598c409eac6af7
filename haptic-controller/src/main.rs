//! `haptic-controller`: `run` the daemon, print the `crd`, or the `version`.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use haptic_agent_client::policy::Policy;
use haptic_controller::{config_loader::ConfigRef, daemon};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[derive(Parser)]
#[command(
    name = "haptic-controller",
    about = "HAPTIC: HAProxy configuration from Kubernetes resources, deployed fenced to every HAProxy pod"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller.
    Run(Box<RunArgs>),
    /// Print the HAProxyTemplateConfig CustomResourceDefinition (YAML).
    Crd,
    /// Print the reference HAProxyTemplateConfig (the Ingress templates) as YAML.
    ReferenceConfig {
        /// Its name.
        #[arg(long, default_value = "haptic-config")]
        name: String,
        /// Its namespace.
        #[arg(long, default_value = "haptic-system")]
        namespace: String,
    },
    /// Print the version.
    Version,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Parser)]
struct RunArgs {
    /// Kubeconfig file (default: in-cluster config, else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Name of the HAProxyTemplateConfig in the controller's namespace.
    #[arg(long, env = "CONFIG_NAME", default_value = "haptic-config")]
    config_name: String,
    /// This replica's identity (the pod name).
    #[arg(long, env = "POD_NAME")]
    pod_name: String,
    /// The controller's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Where /healthz and /readyz listen.
    #[arg(long, env = "HEALTH_ADDR", default_value = "0.0.0.0:8080")]
    health_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// The haproxy binary of the render gate; `none` turns the gate off.
    #[arg(long, env = "HAPTIC_HAPROXY", default_value = "haproxy")]
    haproxy: String,
    /// Capabilities a rendered set may use, as the agents' --allow (lua, program,
    /// external-check, env, ssl-engine; comma-separated) [default: none].
    #[arg(long, env = "HAPTIC_ALLOW", value_delimiter = ',')]
    allow: Vec<String>,
    /// Absolute path prefixes a rendered set may name, as the agents' --allow-path.
    #[arg(long, env = "HAPTIC_ALLOW_PATHS", value_delimiter = ',')]
    allow_path: Vec<String>,
    /// Environment variables a rendered set may read beyond POD_IP, POD_NAME, POD_NAMESPACE
    /// and HOSTNAME, as the agents' --allow-env.
    #[arg(long, env = "HAPTIC_ALLOW_ENV", value_delimiter = ',')]
    allow_env: Vec<String>,
    /// The reconciler's coalescing window in milliseconds.
    #[arg(long, env = "HAPTIC_RECONCILE_WINDOW_MS", default_value_t = 150)]
    reconcile_window_ms: u64,
    /// TEST ONLY (hidden): the election's clock runs this many times as fast as the real one
    /// (0.5 to 2.0), to test clock-rate skew in fault campaigns. No environment variable sets
    /// it, and it is refused inside a Kubernetes pod.
    #[arg(long = "test-only-election-clock-rate", hide = true)]
    test_clock_rate: Option<f64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => print_yaml(haptic_controller::crd::crd_yaml()),
        Command::ReferenceConfig { name, namespace } => {
            print_yaml(haptic_controller::reference::yaml(&name, &namespace))
        }
        Command::Version => {
            println!("haptic-controller {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Command::Run(args) => {
            init_logging(args.log_format);
            match run(*args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    error!(error = format!("{error:#}"), "haptic-controller failed");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn print_yaml(yaml: Result<String, serde_saphyr::SerializeError>) -> ExitCode {
    match yaml {
        Ok(yaml) => {
            print!("{yaml}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("haptic-controller: {error}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(false).init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(args: RunArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async move {
        let election_clock_rate = test_clock_rate(args.test_clock_rate)?;
        let client = client(args.kubeconfig.as_deref()).await?;
        let token = CancellationToken::new();
        tokio::spawn(signals(token.clone()));
        let mut policy = Policy {
            allow: Policy::parse_capabilities(&args.allow.join(",")).context("parsing --allow")?,
            allowed_path_prefixes: clean(&args.allow_path),
            ..Policy::default()
        };
        policy.allowed_env.extend(clean(&args.allow_env));
        policy.validate().context("the config policy")?;
        let options = daemon::Options {
            config: ConfigRef {
                name: args.config_name,
                namespace: args.namespace,
            },
            identity: args.pod_name,
            health_addr: args.health_addr,
            haproxy: (args.haproxy != "none").then(|| haproxy_binary(&args.haproxy)),
            policy,
            reconcile_window: Duration::from_millis(args.reconcile_window_ms),
            election_clock_rate,
        };
        daemon::run(client, options, token)
            .await
            .context("running the controller")
    })?;
    // Whatever a component left behind, the process ends here.
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The test-only clock rate, refused outside 0.5..=2.0 and inside a Kubernetes pod, so that
/// no deployment runs a skewed election by accident.
fn test_clock_rate(rate: Option<f64>) -> Result<Option<f64>> {
    let Some(rate) = rate else { return Ok(None) };
    if !(0.5..=2.0).contains(&rate) {
        anyhow::bail!("--test-only-election-clock-rate {rate}: must be between 0.5 and 2.0");
    }
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        anyhow::bail!(
            "--test-only-election-clock-rate is for local fault campaigns and refused inside a Kubernetes pod"
        );
    }
    warn!(
        rate,
        "TEST ONLY: the election clock runs {rate}x as fast as the real one"
    );
    Ok(Some(rate))
}

fn clean(list: &[String]) -> Vec<String> {
    list.iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// `haproxy` is looked up on PATH by the OS; Debian installs it in /usr/sbin, which a
/// non-root PATH may lack.
fn haproxy_binary(name: &str) -> PathBuf {
    let path = PathBuf::from(name);
    if path.components().count() == 1
        && std::env::var_os("PATH")
            .is_some_and(|p| !std::env::split_paths(&p).any(|dir| dir.join(name).exists()))
    {
        let sbin = PathBuf::from("/usr/sbin").join(name);
        if sbin.exists() {
            return sbin;
        }
    }
    path
}

async fn client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("finding a cluster (in-cluster, KUBECONFIG or ~/.kube/config)")?,
    };
    kube::Client::try_from(config).context("building the Kubernetes client")
}

/// First SIGTERM or SIGINT: drain (leader-only work stops, the Lease is released, the rest
/// stops), with [`daemon::SHUTDOWN_BOUND`] as a hard limit. A second signal exits at once.
async fn signals(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    info!(bound = ?daemon::SHUTDOWN_BOUND, "shutting down: stopping leader-only work, then releasing the Lease");
    token.cancel();
    tokio::select! {
        _ = term.recv() => warn!("second signal: exiting now"),
        _ = int.recv() => warn!("second signal: exiting now"),
        () = tokio::time::sleep(daemon::SHUTDOWN_BOUND) => warn!("shutdown bound passed: exiting now"),
    }
    std::process::exit(130);
}
