//! The `haptic-agent` binary: flags and environment, signals, and the server.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::Parser;
use haptic_agent::{Agent, AgentConfig, haproxy::RunAs};
use haptic_agent_client::policy::Policy;
use opentelemetry::metrics::MeterProvider as _;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// mimalloc rather than glibc's malloc, as the controller (its `main.rs` says why): an apply
/// receives and hashes a set of up to tens of MB, short-lived buffers glibc would hand back to
/// the kernel after each apply and fault in again on the next.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The HAPTIC agent: applies fenced HAProxy file sets pushed by the leader.
#[derive(Debug, Parser)]
#[command(name = "haptic-agent", version)]
struct Args {
    /// Address to serve the API on.
    #[arg(long, env = "HAPTIC_AGENT_LISTEN", default_value = "0.0.0.0:9090")]
    listen: SocketAddr,
    /// File holding the bearer token (surrounding whitespace is ignored).
    #[arg(long, env = "HAPTIC_AGENT_TOKEN_FILE")]
    token_file: PathBuf,
    /// The HAProxy binary.
    #[arg(long, env = "HAPTIC_AGENT_HAPROXY", default_value = "haproxy")]
    haproxy: PathBuf,
    /// Data directory: fence, sets, and the `current` symlink HAProxy runs from.
    #[arg(long, env = "HAPTIC_AGENT_DATA_DIR")]
    data_dir: PathBuf,
    /// HAProxy's master CLI socket [default: <data-dir>/master.sock].
    #[arg(long, env = "HAPTIC_AGENT_MASTER_SOCKET")]
    master_socket: Option<PathBuf>,
    /// Start HAProxy in master-worker mode and supervise it (local runs and tests).
    #[arg(long, env = "HAPTIC_AGENT_SUPERVISE")]
    supervise: bool,
    /// Reload HAProxy for every change: never apply server, map or certificate changes
    /// through its runtime API.
    #[arg(long, env = "HAPTIC_AGENT_NO_RUNTIME_UPDATES")]
    no_runtime_updates: bool,
    /// Largest request body, in bytes.
    #[arg(long, env = "HAPTIC_AGENT_MAX_BODY", default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Seconds requests in flight may take to finish after SIGTERM.
    #[arg(long, env = "HAPTIC_AGENT_DRAIN_SECONDS", default_value_t = 30)]
    drain_seconds: u64,
    /// Run HAProxy and `haproxy -c` as this user (a name, or uid:gid); set it when the agent
    /// runs as root. The master socket then defaults to <data-dir>/run/master.sock.
    #[arg(long, env = "HAPTIC_AGENT_HAPROXY_USER")]
    haproxy_user: Option<String>,
    /// Most connections served at once; one more is closed at once.
    #[arg(long, env = "HAPTIC_AGENT_MAX_CONNECTIONS", default_value_t = 256)]
    max_connections: usize,
    /// The API's PEM certificate chain (mutual TLS, the default: with --tls-key and
    /// --client-ca); every file is read again when it changes.
    #[arg(long, env = "HAPTIC_AGENT_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "HAPTIC_AGENT_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The PEM CA bundle a client (the controller) must present a certificate from.
    #[arg(long, env = "HAPTIC_AGENT_CLIENT_CA")]
    client_ca: Option<PathBuf>,
    /// Also serve /healthz, /readyz and /metrics in plain HTTP here (for the kubelet's probes
    /// and Prometheus, which cannot present the client certificate the API requires)
    /// [default: nowhere].
    #[arg(long, env = "HAPTIC_AGENT_PROBE_LISTEN")]
    probe_listen: Option<SocketAddr>,
    /// Serve plain HTTP: the token and every private key of the set cross the network in
    /// clear text. For local runs only; warned at every start.
    #[arg(
        long,
        env = "HAPTIC_AGENT_INSECURE_PLAIN_HTTP",
        conflicts_with_all = ["tls_cert", "tls_key", "client_ca"]
    )]
    insecure_plain_http: bool,
    /// Capabilities a set may use, comma-separated: lua, program, external-check, env,
    /// ssl-engine [default: none].
    #[arg(long, env = "HAPTIC_AGENT_ALLOW", value_delimiter = ',')]
    allow: Vec<String>,
    /// Absolute path prefixes a set may name (comma-separated or repeated), e.g.
    /// /etc/ssl/certs [default: none: every file inside the set].
    #[arg(long, env = "HAPTIC_AGENT_ALLOW_PATHS", value_delimiter = ',')]
    allow_path: Vec<String>,
    /// Environment variables a set may read with "${NAME}" or env(NAME), beyond POD_IP,
    /// POD_NAME, POD_NAMESPACE and HOSTNAME (comma-separated or repeated).
    #[arg(long, env = "HAPTIC_AGENT_ALLOW_ENV", value_delimiter = ',')]
    allow_env: Vec<String>,
    /// Log format.
    #[arg(
        long,
        env = "HAPTIC_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormat,
}

/// Log format.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: a pod's log, a file or a test's pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    // The agent's own memory only: HAProxy is started with the host's setting (`thp`).
    if let Err(error) = haptic_agent::thp::turn_off() {
        warn!(%error, "could not turn transparent huge pages off for the agent: its applies may take more CPU");
    }

    let token = std::fs::read_to_string(&args.token_file)
        .with_context(|| format!("reading the token file {}", args.token_file.display()))?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = args
        .data_dir
        .canonicalize()
        .with_context(|| format!("resolving {}", args.data_dir.display()))?;
    let mut config = AgentConfig::new(&data_dir, token.trim())
        .with_listen(args.listen)
        .with_haproxy_bin(args.haproxy)
        .with_supervise(args.supervise)
        .with_runtime_updates(!args.no_runtime_updates);
    if let Some(user) = &args.haproxy_user {
        let user = RunAs::resolve(user).context("resolving --haproxy-user")?;
        config = config.with_haproxy_user(user);
    } else if rustix::process::geteuid().is_root() {
        warn!("the agent runs as root and so would HAProxy and its checks: set --haproxy-user");
    }
    if let Some(socket) = args.master_socket {
        config.master_socket = socket;
    }
    config.policy.allow =
        Policy::parse_capabilities(&args.allow.join(",")).context("parsing --allow")?;
    config.policy.allowed_path_prefixes = args
        .allow_path
        .iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();
    config.policy.allowed_env.extend(
        args.allow_env
            .iter()
            .map(|name| name.trim().to_owned())
            .filter(|name| !name.is_empty()),
    );
    info!(policy = ?config.policy, "config policy");
    config.max_body_bytes = args.max_body_bytes;
    config.max_connections = args.max_connections;
    config.token_file = Some(args.token_file.clone());
    config.probe_listen = args.probe_listen;
    match (args.tls_cert, args.tls_key, args.client_ca) {
        (Some(cert), Some(key), Some(client_ca)) => {
            config.tls = Some(haptic_agent::tls::TlsFiles {
                cert,
                key,
                client_ca: Some(client_ca),
            });
        }
        _ if args.insecure_plain_http => warn!(
            "serving plain HTTP (--insecure-plain-http): the bearer token and every private key of the set cross the network in clear text"
        ),
        _ => anyhow::bail!(
            "the agent serves mutual TLS: give --tls-cert, --tls-key and --client-ca (the CA of the controller's client certificate), or --insecure-plain-http for a local run"
        ),
    }
    config.max_inflated_bytes = config.max_inflated_bytes.max(args.max_body_bytes);
    let (provider, exposition) =
        haptic_serve::prometheus_exporter().context("starting the metrics exporter")?;
    config = config.with_metrics(provider.meter("haptic-agent"), exposition);

    let agent = Agent::open(config).await.context("opening the agent")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;

    // First SIGTERM or SIGINT drains; a second one exits at once.
    let shutdown = CancellationToken::new();
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::spawn({
        let (shutdown, supervisor) = (shutdown.clone(), agent.supervisor().cloned());
        async move {
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            info!("shutting down");
            shutdown.cancel();
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            warn!("second signal: exiting now");
            // An exiting process runs no destructors: take a supervised HAProxy down with it.
            if let Some(supervisor) = supervisor {
                supervisor.kill_now();
            }
            std::process::exit(130);
        }
    });

    haptic_agent::serve(
        agent,
        listener,
        shutdown,
        Duration::from_secs(args.drain_seconds),
    )
    .await
    .context("serving")?;
    drop(provider);
    Ok(())
}
