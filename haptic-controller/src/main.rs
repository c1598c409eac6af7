//! `haptic-controller`: `run` the daemon, `validate` a config offline, print the `crd`, the
//! reference config or the `version`.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use haptic_agent_client::{policy::Policy, tls::PairFiles};
use haptic_controller::channel::{AgentChannel, MtlsFiles};
use haptic_controller::{
    config_loader::ConfigRef,
    daemon,
    validation::Checker,
    webhook::{self, FailurePolicy, WebhookSettings},
};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// mimalloc rather than glibc's malloc. A full render at 10,000 routes writes some 40 MB of
/// output and short-lived buffers; glibc handed them back to the kernel after each render (its
/// mmap and trim thresholds) and faulted them in again on the next: an eighth of a render on
/// one thread, more on two (haptic-render's README, "The allocator").
///
/// Built without mimalloc's "large" pages (`MI_ENABLE_LARGE_PAGES=0`, set for every build in
/// `.cargo/config.toml`): with them, blocks of 64-512 KiB share 4 MiB pages, one per size and
/// thread, and the leader's renders (a view's row list, a run's text, the set's file list,
/// made anew on whichever thread renders) left ~40 MiB of such pages resident but mostly
/// free after 30 changes at 10,000 Ingresses, where the follower, which renders little, had
/// none (haptic-controller/README.md, "Twenty-fifth session").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Print the CustomResourceDefinitions (YAML): the HAProxyTemplateConfig and the kinds the
    /// rendered config is published as.
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
    /// Run a HAProxyTemplateConfig's validation tests offline (no cluster): exit 0 when all
    /// pass, 1 otherwise.
    Validate(ValidateArgs),
    /// Report what moving Ingresses off ingress-nginx changes: per Ingress, each
    /// `nginx.ingress.kubernetes.io/*` annotation with its verdict (refused, not-yet-supported,
    /// unknown) and what is lost. Exit 0 when nothing changes, 1 when something would behave
    /// differently, 2 when a file cannot be read.
    Migrate(MigrateArgs),
    /// Print the version.
    Version,
}

#[derive(Parser)]
struct MigrateArgs {
    /// Files of Ingresses (YAML or JSON, multi-document; a `List`'s items too; other kinds
    /// are skipped).
    #[arg(short = 'f', long = "file", num_args = 1.., required_unless_present = "from_cluster")]
    files: Vec<PathBuf>,
    /// Read the Ingresses from the cluster too (all namespaces, or `--namespace`).
    #[arg(long)]
    from_cluster: bool,
    /// With `--from-cluster`: only this namespace.
    #[arg(long, requires = "from_cluster")]
    namespace: Option<String>,
    /// With `--from-cluster`: the kubeconfig (default: in-cluster config, else $KUBECONFIG or
    /// ~/.kube/config).
    #[arg(long, env = "KUBECONFIG", requires = "from_cluster")]
    kubeconfig: Option<PathBuf>,
    /// How to report.
    #[arg(long, value_enum, default_value = "summary")]
    output: OutputFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum OutputFormat {
    Summary,
    Json,
}

#[derive(Parser)]
struct ValidateArgs {
    /// The HAProxyTemplateConfig (YAML or JSON; the first HAProxyTemplateConfig document of a
    /// multi-document file).
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Run only this test.
    #[arg(long)]
    test: Option<String>,
    /// How to report.
    #[arg(long, value_enum, default_value = "summary")]
    output: OutputFormat,
    /// Write each test's rendered set to DIR/<test>/.
    #[arg(long, value_name = "DIR")]
    dump_rendered: Option<PathBuf>,
    /// The haproxy binary `haproxy_valid` runs.
    #[arg(long, env = "HAPTIC_HAPROXY", default_value = "haproxy")]
    haproxy: String,
    #[command(flatten)]
    policy: PolicyArgs,
}

/// The agents' allow-list, which the render gate, the webhook and `validate` apply.
#[derive(clap::Args)]
struct PolicyArgs {
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
}

impl PolicyArgs {
    fn policy(&self) -> Result<Policy> {
        let mut policy = Policy {
            allow: Policy::parse_capabilities(&self.allow.join(",")).context("parsing --allow")?,
            allowed_path_prefixes: clean(&self.allow_path),
            ..Policy::default()
        };
        policy.allowed_env.extend(clean(&self.allow_env));
        policy.validate().context("the config policy")?;
        Ok(policy)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum WebhookFailurePolicy {
    Fail,
    Ignore,
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
    #[command(flatten)]
    policy: PolicyArgs,
    /// Where the admission webhook listens (HTTPS, /validate); it runs only when
    /// --webhook-cert and --webhook-key are given.
    #[arg(long, env = "HAPTIC_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    webhook_addr: SocketAddr,
    /// The webhook's certificate chain (PEM; re-read when it changes). Without it the
    /// webhook is off.
    #[arg(long, env = "HAPTIC_WEBHOOK_CERT", requires = "webhook_key")]
    webhook_cert: Option<PathBuf>,
    /// The webhook's private key (PEM; re-read when it changes).
    #[arg(long, env = "HAPTIC_WEBHOOK_KEY", requires = "webhook_cert")]
    webhook_key: Option<PathBuf>,
    /// How long one admission review may take (milliseconds) before the failure policy
    /// answers it; keep it below the ValidatingWebhookConfiguration's timeoutSeconds.
    #[arg(long, env = "HAPTIC_WEBHOOK_BUDGET_MS", default_value_t = 8000)]
    webhook_budget_ms: u64,
    /// Most connections the webhook serves at once; one more is closed at once.
    #[arg(long, env = "HAPTIC_WEBHOOK_MAX_CONNECTIONS", default_value_t = webhook::DEFAULT_MAX_CONNECTIONS)]
    webhook_max_connections: usize,
    /// Most admission reviews judged at once (each renders and runs haproxy -c); the others
    /// wait, and the wait counts against their budget.
    #[arg(long, env = "HAPTIC_WEBHOOK_MAX_CONCURRENT_REVIEWS", default_value_t = webhook::DEFAULT_MAX_CONCURRENT_REVIEWS)]
    webhook_max_concurrent_reviews: usize,
    /// What a review past its budget, or one that cannot be checked, gets: denied (fail) or
    /// allowed with a warning (ignore).
    #[arg(
        long,
        env = "HAPTIC_WEBHOOK_FAILURE_POLICY",
        value_enum,
        default_value = "fail"
    )]
    webhook_failure_policy: WebhookFailurePolicy,
    /// The CA bundle (PEM) the agents' serving certificates are issued by: the agent channel
    /// is mutual TLS (with --agent-client-cert and --agent-client-key). Re-read when it changes.
    #[arg(long, env = "HAPTIC_AGENT_CA")]
    agent_ca: Option<PathBuf>,
    /// The controller's client certificate chain (PEM) presented to the agents; re-read when
    /// it changes.
    #[arg(long, env = "HAPTIC_AGENT_CLIENT_CERT")]
    agent_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --agent-client-cert; re-read when it changes.
    #[arg(long, env = "HAPTIC_AGENT_CLIENT_KEY")]
    agent_client_key: Option<PathBuf>,
    /// The DNS name every agent's certificate carries (e.g. haptic-agent.haptic-system.svc)
    /// [default: none: each agent's certificate must name its pod IP].
    #[arg(long, env = "HAPTIC_AGENT_SERVER_NAME")]
    agent_server_name: Option<String>,
    /// Reach the agents over plain HTTP: the agent token and every private key of every set
    /// cross the pod network in clear text. For local runs only; warned at every start.
    #[arg(
        long,
        env = "HAPTIC_AGENT_INSECURE_PLAIN_HTTP",
        conflicts_with_all = ["agent_ca", "agent_client_cert", "agent_client_key", "agent_server_name"]
    )]
    agent_insecure_plain_http: bool,
    /// The reconciler's coalescing window in milliseconds.
    #[arg(long, env = "HAPTIC_RECONCILE_WINDOW_MS", default_value_t = 150)]
    reconcile_window_ms: u64,
    /// While this replica does not lead, it renders at most once per this many milliseconds
    /// when the cluster changes, and drops the result: its renderer stays warm, so a handoff
    /// to it renders only what changed since (tens of ms at 10,000 Ingresses, not a second).
    /// 0: never (less CPU and memory on followers, a slower first render after a handoff).
    #[arg(
        long,
        env = "HAPTIC_STANDBY_RENDER_INTERVAL_MS",
        default_value_t = haptic_controller::standby::DEFAULT_INTERVAL.as_millis() as u64
    )]
    standby_render_interval_ms: u64,
    /// Where /debug/vars listens [default: nowhere].
    #[arg(long, env = "DEBUG_ADDR")]
    debug_addr: Option<SocketAddr>,
    /// The Secret in the controller's namespace that holds the default certificate (served to
    /// clients whose SNI matches no host): created with a generated self-signed certificate
    /// when absent. `none` (or empty): none is generated (name your own Secret in the HTC's
    /// `extraContext.haproxy.default_certificate`).
    #[arg(
        long,
        env = "HAPTIC_DEFAULT_CERTIFICATE_SECRET",
        default_value = haptic_controller::default_certificate::DEFAULT_SECRET
    )]
    default_certificate_secret: String,
    /// TEST ONLY (hidden): the election's clock runs this many times as fast as the real one
    /// (0.5 to 2.0), to test clock-rate skew in fault campaigns. No environment variable sets
    /// it, and it is refused inside a Kubernetes pod.
    #[arg(long = "test-only-election-clock-rate", hide = true)]
    test_clock_rate: Option<f64>,
    /// TEST ONLY (hidden): the named leader-only component (e.g. `render-gate`) panics as it
    /// starts, to test that a panic never leaves a leader that deploys nothing. No environment
    /// variable sets it, and it is refused inside a Kubernetes pod.
    #[arg(long = "test-only-panic-in", hide = true)]
    test_panic_in: Option<String>,
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
        Command::Validate(args) => match validate(&args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(error) => {
                eprintln!("haptic-controller validate: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Migrate(args) => match migrate(&args) {
            Ok(false) => ExitCode::SUCCESS,
            Ok(true) => ExitCode::FAILURE,
            Err(error) => {
                eprintln!("haptic-controller migrate: {error:#}");
                ExitCode::from(2)
            }
        },
        Command::Run(args) => {
            init_logging(args.log_format);
            no_transparent_huge_pages();
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

/// Turns transparent huge pages off for this process (and the `haproxy -c` it starts).
///
/// The daemon's heap is many small long-lived objects (the stores, the views) among a render's
/// short-lived buffers; backed by 2 MiB pages, a page a few live objects still hold stays
/// resident whole. Measured with `bench_controller 10000 --changes 20 --reload-changes 0
/// --endpoint-changes 3 --no-health-checks` (two runs each, 2026-12-03; the kernel's THP in
/// `madvise` mode): the leader's RSS 473-480 MiB with them, 380-421 without (the follower's
/// 357 and 300-310), the change to live no slower (p50 296-323 ms with, 250-270 without).
/// `MIMALLOC_PURGE_DELAY=0` (mimalloc's own, read at start) takes it lower still, 328-343 MiB,
/// for a little more CPU per change (pages handed back at once, faulted in again); the
/// Deployment in deploy/ sets it (2026-12-06: 316-317 MiB against 351-362 at 10,000).
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(error) = rustix::thread::disable_transparent_huge_pages(true) {
        warn!(
            %error,
            "could not turn transparent huge pages off for this process: its memory may be higher"
        );
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
    // Before anything records: the libraries take the global provider's meters.
    let (provider, exposition) =
        haptic_serve::prometheus_exporter().context("starting the metrics exporter")?;
    opentelemetry::global::set_meter_provider(provider.clone());
    runtime.block_on(async move {
        let election_clock_rate = test_clock_rate(args.test_clock_rate)?;
        if let Some(component) = &args.test_panic_in {
            if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
                anyhow::bail!(
                    "--test-only-panic-in is for local tests and refused inside a Kubernetes pod"
                );
            }
            warn!(%component, "TEST ONLY: this leader-only component panics as it starts");
        }
        let client = client(args.kubeconfig.as_deref()).await?;
        let token = CancellationToken::new();
        tokio::spawn(signals(token.clone()));
        let policy = args.policy.policy()?;
        let haproxy = (args.haproxy != "none").then(|| haproxy_binary(&args.haproxy));
        let webhook = match (args.webhook_cert, args.webhook_key) {
            (Some(cert), Some(key)) => Some(WebhookSettings {
                addr: args.webhook_addr,
                cert,
                key,
                checker: Checker {
                    haproxy: haproxy.clone(),
                    policy: policy.clone(),
                },
                budget: Duration::from_millis(args.webhook_budget_ms),
                failure_policy: match args.webhook_failure_policy {
                    WebhookFailurePolicy::Fail => FailurePolicy::Fail,
                    WebhookFailurePolicy::Ignore => FailurePolicy::Ignore,
                },
                max_connections: args.webhook_max_connections,
                max_concurrent_reviews: args.webhook_max_concurrent_reviews,
            }),
            _ => None,
        };
        let identity_dir = tempfile::Builder::new()
            .prefix("haptic-agent-client-")
            .tempdir()
            .context("a directory for the agent channel's client certificate")?;
        let agent_channel = match (args.agent_ca, args.agent_client_cert, args.agent_client_key) {
            (Some(ca), Some(cert), Some(key)) => AgentChannel::mtls(&MtlsFiles {
                ca,
                identity: PairFiles { cert, key },
                server_name: args.agent_server_name,
            })
            .context("setting up mutual TLS to the agents")?,
            _ if args.agent_insecure_plain_http => {
                warn!("reaching the agents over plain HTTP (--agent-insecure-plain-http): the agent token and every private key of every set cross the pod network in clear text");
                AgentChannel::PlainHttp
            }
            (None, None, None) => {
                // None configured: the CA this controller generates once and keeps in a
                // Secret it owns; this replica's client certificate lives in `identity_dir`.
                let files = haptic_controller::agent_ca::ensure(
                    client.clone(),
                    &args.namespace,
                    identity_dir.path(),
                )
                .await
                .context("setting up the agent channel's generated CA")?;
                info!(
                    ca = haptic_controller::agent_ca::CA_SECRET,
                    agents = haptic_controller::agent_ca::AGENT_SECRET,
                    "the agent channel is mutual TLS from the controller's own CA"
                );
                AgentChannel::mtls(&files).context("setting up mutual TLS to the agents")?
            }
            _ => anyhow::bail!(
                "the agent channel's files are given together: --agent-ca, --agent-client-cert and --agent-client-key (or none, for the controller's own CA; or --agent-insecure-plain-http for a local run)"
            ),
        };
        let options = daemon::Options {
            agent_channel,
            config: ConfigRef {
                name: args.config_name,
                namespace: args.namespace,
            },
            identity: args.pod_name,
            health_addr: args.health_addr,
            haproxy,
            policy,
            webhook,
            reconcile_window: Duration::from_millis(args.reconcile_window_ms),
            standby_render_interval: Some(Duration::from_millis(args.standby_render_interval_ms))
                .filter(|interval| !interval.is_zero()),
            metrics: Some(exposition),
            debug_addr: args.debug_addr,
            election_clock_rate,
            default_certificate: Some(args.default_certificate_secret)
                .filter(|name| !name.is_empty() && name != "none"),
            test_only_panic_in: args.test_panic_in,
        };
        daemon::run(client, options, token)
            .await
            .context("running the controller")
    })?;
    // Whatever a component left behind, the process ends here.
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(provider);
    Ok(())
}

/// `haptic-controller migrate`: prints the report; `Ok(true)` when something would behave
/// differently.
fn migrate(args: &MigrateArgs) -> Result<bool> {
    let mut report = haptic_controller::migrate::Report::default();
    for file in &args.files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("parsing {}", file.display()))?;
        report.add(&file.display().to_string(), &docs);
    }
    if args.from_cluster {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        let docs = runtime.block_on(cluster_ingresses(
            args.kubeconfig.as_deref(),
            args.namespace.as_deref(),
        ))?;
        report.add("cluster", &docs);
    }
    match args.output {
        OutputFormat::Summary => print!("{}", report.summary()),
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report).context("writing the report")?
        ),
    }
    Ok(report.behaves_differently)
}

/// `haptic-controller validate`: `Ok(true)` when every test passed.
fn validate(args: &ValidateArgs) -> Result<bool> {
    use haptic_controller::{config, crd::HAProxyTemplateConfig, validation};

    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
        .with_context(|| format!("parsing {}", args.file.display()))?;
    let doc = docs
        .into_iter()
        .find(|d| d["kind"] == "HAProxyTemplateConfig")
        .with_context(|| format!("{} holds no HAProxyTemplateConfig", args.file.display()))?;
    let htc: HAProxyTemplateConfig = serde_json::from_value(doc)
        .with_context(|| format!("{}: not a valid HAProxyTemplateConfig", args.file.display()))?;
    let valid = match config::validate(&htc.spec, 0, "") {
        Ok(valid) => valid,
        Err(errors) => {
            anyhow::bail!(
                "{}: the config is invalid:\n  {}",
                args.file.display(),
                errors.join("\n  ")
            );
        }
    };
    let checker = Checker {
        haproxy: (args.haproxy != "none").then(|| haproxy_binary(&args.haproxy)),
        policy: args.policy.policy()?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let report = runtime.block_on(validation::run(&valid, args.test.as_deref(), &checker))?;
    if let Some(dir) = &args.dump_rendered {
        validation::dump(&report, dir).map_err(anyhow::Error::msg)?;
    }
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        OutputFormat::Summary => {
            for test in &report.tests {
                let verdict = if test.passed { "PASS" } else { "FAIL" };
                println!(
                    "{verdict} {} ({} assertions)",
                    test.name,
                    test.assertions.len()
                );
                for line in test.failures() {
                    println!("  {line}");
                }
            }
            let passed = report.tests.iter().filter(|t| t.passed).count();
            println!("{passed}/{} tests passed", report.tests.len());
        }
    }
    Ok(report.passed())
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

/// Every Ingress of the cluster (or of `namespace`), as JSON, read in pages of 500.
async fn cluster_ingresses(
    kubeconfig: Option<&std::path::Path>,
    namespace: Option<&str>,
) -> Result<Vec<serde_json::Value>> {
    use k8s_openapi::api::networking::v1::Ingress;
    let client = client(kubeconfig).await?;
    let api: kube::Api<Ingress> = match namespace {
        Some(ns) => kube::Api::namespaced(client, ns),
        None => kube::Api::all(client),
    };
    let mut docs = Vec::new();
    let mut params = kube::api::ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await.context("listing Ingresses")?;
        for ing in page.items {
            docs.push(serde_json::to_value(&ing).context("an Ingress as JSON")?);
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(docs),
        }
    }
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
