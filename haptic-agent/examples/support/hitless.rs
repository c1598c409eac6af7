//! The hitless part of `cargo xtask bench agent`: endpoint changes and certificate rotations
//! on sets rendered by haptic-render's reference templates (server slots) from its fixtures,
//! timed from the apply sent to the change served (a request answered by the new endpoint, a
//! TLS handshake that sees the new certificate), through the runtime API and, on a second
//! agent with `runtime_updates` off, through the reload path.
//!
//! Every endpoint of the fixtures is moved to a loopback address and marked not ready
//! (its slot `disabled`: no health checks, and nothing probes the fixtures' 10.x addresses),
//! except those of the measured Service, which are two small HTTP servers on 127.0.0.2 and
//! 127.0.0.3. The measured change moves that Service from one to the other. At 10,000
//! Ingresses the slots carry no `check`: HAProxy reserves a file descriptor per checked
//! server, and 133,000 of them exceed this machine's `nofile` hard limit (20,000).
//!
//! Each change is sent as a delta against the set applied before (as the leader sends it);
//! `HAPTIC_BENCH_WHOLE=1` sends whole sets instead, `HAPTIC_BENCH_RUNTIME_ONLY=1` leaves out
//! the reload-path rows.

use std::{
    net::SocketAddr,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use base64::Engine as _;
use haptic_agent::{Agent, AgentConfig};
use haptic_agent_client::{AgentClient, ApplyRequest, DeltaRequest, FileSet};
use haptic_render::{Renderer, Stores, fixtures, reference};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject as _};
use serde_json::{Value as Json, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "bench-token";
/// The measured Ingress of the fixtures (it has TLS: every 4th has).
const NAMESPACE: &str = "team-00";
const NAME: &str = "app-00000";
const HOST: &str = "app-00000.team-00.example.com";

/// Samples per measurement.
const RUNTIME_SAMPLES: usize = 40;
const CERT_RUNTIME_SAMPLES: usize = 20;

struct Cluster {
    renderer: Renderer,
    stores: Stores,
    endpoint_port: u16,
}

impl Cluster {
    fn new(ingresses: usize, http: u16, https: u16, endpoint_port: u16) -> Result<Self> {
        let mut set = reference::template_set();
        set.extra_context.insert(
            "haproxy".into(),
            json!({"maxconn": 2000, "bind_address": "127.0.0.1", "http_port": http,
                "https_port": https, "timeout_connect": "1s", "timeout_client": "10s",
                "timeout_server": "10s", "stats_socket": null, "route_debug": false,
                "server_slots": 10, "health_checks": ingresses <= 1_000,
                // The measured host has TLS; the probe asks over plain HTTP.
                "ssl_redirect": false}),
        );
        let renderer = Renderer::compile(&set)?;
        let mut stores = reference::stores()?;
        let mut generated = fixtures::generate(ingresses);
        for (i, slice) in generated.endpoint_slices.iter_mut().enumerate() {
            if let Some(endpoints) = slice["endpoints"].as_array_mut() {
                for (j, endpoint) in endpoints.iter_mut().enumerate() {
                    let k = i * 3 + j + 256;
                    endpoint["addresses"] = json!([format!(
                        "127.{}.{}.{}",
                        (k >> 16) & 255,
                        (k >> 8) & 255,
                        k & 255
                    )]);
                    endpoint["conditions"]["ready"] = json!(false);
                }
            }
        }
        generated.load(&mut stores)?;
        let mut cluster = Self {
            renderer,
            stores,
            endpoint_port,
        };
        cluster.endpoint("127.0.0.2")?;
        Ok(cluster)
    }

    /// The measured Service's one endpoint.
    fn endpoint(&mut self, ip: &str) -> Result<()> {
        let slice = json!({
            "metadata": {"namespace": NAMESPACE, "name": format!("{NAME}-bench"),
                "labels": {"kubernetes.io/service-name": NAME}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": self.endpoint_port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        });
        self.apply("endpointslices", &slice)
    }

    fn secret(&mut self, cert: &str, key: &str) -> Result<()> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let secret = json!({"metadata": {"namespace": NAMESPACE, "name": format!("{NAME}-tls")},
            "type": "kubernetes.io/tls", "data": {"tls.crt": b64(cert), "tls.key": b64(key)}});
        self.apply("secrets", &secret)
    }

    fn apply(&mut self, store: &str, resource: &Json) -> Result<()> {
        self.stores
            .get_mut(store)
            .context("store")?
            .apply(resource)?;
        Ok(())
    }

    fn render(&self) -> Result<FileSet> {
        let rendered = self.renderer.render(&self.stores)?;
        let mut files = FileSet::new();
        for (path, content) in rendered.iter() {
            files.insert(path, content.to_vec())?;
        }
        Ok(files)
    }
}

/// A CA and a certificate for [`HOST`] signed by it: (CA PEM, cert PEM, key PEM).
fn issue() -> Result<(String, String, String)> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec![HOST.to_owned()])?.signed_by(&key, &issuer)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}

async fn http_endpoint(ip: &str, port: u16) -> Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind((ip, port)).await?;
    let body = ip.to_owned();
    let app = axum::Router::new().fallback(move || {
        let body = body.clone();
        async move { body }
    });
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    }))
}

/// A TLS handshake with SNI [`HOST`] trusting only `ca`.
async fn handshake(connector: &tokio_rustls::TlsConnector, port: u16) -> bool {
    let Ok(tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let Ok(name) = ServerName::try_from(HOST) else {
        return false;
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), connector.connect(name, tcp)).await,
        Ok(Ok(_))
    )
}

fn connector(ca: &str) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(cert?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// One agent with its own supervised HAProxy, served until `stop`.
struct BenchAgent {
    url: reqwest::Url,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _data: tempfile::TempDir,
}

impl BenchAgent {
    async fn start(haproxy: &Path, runtime_updates: bool) -> Result<Self> {
        let data = tempfile::tempdir()?;
        let config = AgentConfig::new(data.path(), TOKEN)
            .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
            .with_haproxy_bin(haproxy)
            .with_supervise(true)
            .with_runtime_updates(runtime_updates);
        let agent = Agent::open(config).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = reqwest::Url::parse(&format!("http://{}/", listener.local_addr()?))?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                if let Err(error) =
                    haptic_agent::serve(agent, listener, shutdown, Duration::from_secs(5)).await
                {
                    eprintln!("agent: {error}");
                }
            }
        });
        Ok(Self {
            url,
            shutdown,
            task,
            _data: data,
        })
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
}

/// Latencies of one measurement, sorted, and the reloads it took.
struct Series {
    served: Vec<Duration>,
    answered: Vec<Duration>,
    /// The agent's own time on the runtime commands (`timing.runtime_us`) and on the whole
    /// apply (`timing.total_us`).
    runtime: Vec<Duration>,
    agent: Vec<Duration>,
    reloads: usize,
}

impl Series {
    fn row(&self, what: &str, target: &str) -> String {
        let pick = |sorted: &[Duration], p: f64| {
            let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
            sorted[index.min(sorted.len() - 1)]
        };
        let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
        let mut runtime = self.runtime.clone();
        let mut agent = self.agent.clone();
        runtime.sort();
        agent.sort();
        format!(
            "| {what}, p50 / p99 of {n} (apply answered p50 / p99; agent: runtime commands p50, whole apply p50) | {s50} / {s99} ({a50} / {a99}; {r50}, {t50}), {reloads} reloads | {target} |\n",
            n = self.served.len(),
            r50 = ms(pick(&runtime, 0.5)),
            t50 = ms(pick(&agent, 0.5)),
            s50 = ms(pick(&self.served, 0.5)),
            s99 = ms(pick(&self.served, 0.99)),
            a50 = ms(pick(&self.answered, 0.5)),
            a99 = ms(pick(&self.answered, 0.99)),
            reloads = self.reloads,
        )
    }
}

/// Whether the bench sends whole sets (`HAPTIC_BENCH_WHOLE` set), as before deltas, rather
/// than a delta against the set applied before.
fn whole_sets() -> bool {
    std::env::var_os("HAPTIC_BENCH_WHOLE").is_some()
}

/// Applies `files` (a delta against `base` unless [`whole_sets`]) and waits, meanwhile, until
/// `served` says the change is served: (served after, answered after, the agent's report,
/// the request applied).
async fn timed<F: std::future::Future<Output = bool>>(
    client: &AgentClient,
    url: &reqwest::Url,
    files: FileSet,
    generation: u64,
    base: &ApplyRequest,
    served: impl Fn() -> F,
) -> Result<(
    Duration,
    Duration,
    haptic_agent_client::ApplyReport,
    ApplyRequest,
)> {
    let request = ApplyRequest::new(1, "bench", generation, files)?;
    // Prepared before the clock starts, as the leader prepares one body for every agent.
    let body = if whole_sets() {
        Ok(client.prepare(&request))
    } else {
        Err(client.prepare_delta(&DeltaRequest::between(
            &base.files,
            &base.checksum,
            &request,
        )))
    };
    let started = Instant::now();
    let apply = async {
        match &body {
            Ok(whole) => client.apply_prepared(url, whole).await,
            Err(delta) => client.apply_delta_prepared(url, delta).await,
        }
    };
    let probe = async {
        // Bounded: a change not served within 60 s fails the bench.
        while started.elapsed() < Duration::from_secs(60) {
            if served().await {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        None
    };
    let (report, seen) = tokio::join!(
        async {
            let report = apply.await;
            (report, started.elapsed())
        },
        probe
    );
    let (report, answered) = report;
    let report = report?;
    let seen = seen.context("the change was not served within 60 s")?;
    Ok((seen, answered, report, request))
}

/// The measured Service's answer through HAProxy, on a fresh connection.
async fn answer(http: &reqwest::Client, port: u16) -> Option<String> {
    let response = http
        .get(format!("http://127.0.0.1:{port}/"))
        .header("host", HOST)
        .send()
        .await
        .ok()?;
    response.text().await.ok()
}

async fn endpoint_changes(
    haproxy: &Path,
    client: &AgentClient,
    ingresses: usize,
    runtime_updates: bool,
    samples: usize,
) -> Result<Series> {
    let (http, https, endpoint_port) = (free_port()?, free_port()?, free_port()?);
    let _a = http_endpoint("127.0.0.2", endpoint_port).await?;
    let _b = http_endpoint("127.0.0.3", endpoint_port).await?;
    let mut cluster = Cluster::new(ingresses, http, https, endpoint_port)?;
    let agent = BenchAgent::start(haproxy, runtime_updates).await?;
    let traffic = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(2))
        .build()?;
    let mut base = ApplyRequest::new(1, "bench", 1, cluster.render()?)?;
    client.apply(&agent.url, &base).await?;
    let mut series = Series {
        served: Vec::new(),
        answered: Vec::new(),
        runtime: Vec::new(),
        agent: Vec::new(),
        reloads: 0,
    };
    for sample in 0..=samples {
        let ip = if sample % 2 == 0 {
            "127.0.0.3"
        } else {
            "127.0.0.2"
        };
        cluster.endpoint(ip)?;
        let files = cluster.render()?;
        let (seen, answered, report, applied) = timed(
            client,
            &agent.url,
            files,
            sample as u64 + 2,
            &base,
            || async { answer(&traffic, http).await.as_deref() == Some(ip) },
        )
        .await?;
        base = applied;
        // The first change also warms up the path; it is not counted.
        if sample > 0 {
            series.served.push(seen);
            series.answered.push(answered);
            series.reloads += usize::from(report.reload);
            series
                .runtime
                .push(Duration::from_micros(report.timing.runtime_us));
            series
                .agent
                .push(Duration::from_micros(report.timing.total_us));
        }
    }
    agent.stop().await;
    series.served.sort();
    series.answered.sort();
    Ok(series)
}

async fn certificate_rotations(
    haproxy: &Path,
    client: &AgentClient,
    ingresses: usize,
    runtime_updates: bool,
    samples: usize,
) -> Result<(Series, usize)> {
    let (http, https, endpoint_port) = (free_port()?, free_port()?, free_port()?);
    let mut cluster = Cluster::new(ingresses, http, https, endpoint_port)?;
    let pairs = [issue()?, issue()?];
    let connectors = [connector(&pairs[0].0)?, connector(&pairs[1].0)?];
    let agent = BenchAgent::start(haproxy, runtime_updates).await?;
    cluster.secret(&pairs[1].1, &pairs[1].2)?;
    let first = cluster.render()?;
    let certificates = first
        .iter()
        .filter(|(path, _)| path.starts_with("ssl/"))
        .count();
    let mut base = ApplyRequest::new(1, "bench", 1, first)?;
    client.apply(&agent.url, &base).await?;
    let mut series = Series {
        served: Vec::new(),
        answered: Vec::new(),
        runtime: Vec::new(),
        agent: Vec::new(),
        reloads: 0,
    };
    for sample in 0..=samples {
        let (_, cert, key) = &pairs[sample % 2];
        let connector = &connectors[sample % 2];
        cluster.secret(cert, key)?;
        let files = cluster.render()?;
        let (seen, answered, report, applied) =
            timed(client, &agent.url, files, sample as u64 + 2, &base, || {
                handshake(connector, https)
            })
            .await?;
        base = applied;
        if sample > 0 {
            series.served.push(seen);
            series.answered.push(answered);
            series.reloads += usize::from(report.reload);
            series
                .runtime
                .push(Duration::from_micros(report.timing.runtime_us));
            series
                .agent
                .push(Duration::from_micros(report.timing.total_us));
        }
    }
    agent.stop().await;
    series.served.sort();
    series.answered.sort();
    Ok((series, certificates))
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Collects the table's rows, each also printed to stderr as soon as it is measured.
#[derive(Default)]
struct Rows(String);

impl Rows {
    fn push_str(&mut self, row: &str) {
        eprint!("{row}");
        self.0.push_str(row);
    }
}

/// Whether only the runtime rows run (`HAPTIC_BENCH_RUNTIME_ONLY` set): the reload-path rows
/// take minutes at 10,000 Ingresses.
fn runtime_only() -> bool {
    std::env::var_os("HAPTIC_BENCH_RUNTIME_ONLY").is_some()
}

/// The hitless rows of the table.
pub(crate) async fn rows(haproxy: &Path, client: &AgentClient) -> Result<String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut rows = Rows::default();
    for (ingresses, reload_samples) in [(1_000, 10), (10_000, 5)] {
        let runtime = endpoint_changes(haproxy, client, ingresses, true, RUNTIME_SAMPLES).await?;
        rows.push_str(&runtime.row(
            &format!("endpoint change to served, {ingresses} Ingresses, runtime API"),
            "p99 <= 50 ms, 0 reloads",
        ));
        if runtime_only() {
            continue;
        }
        let reload = endpoint_changes(haproxy, client, ingresses, false, reload_samples).await?;
        rows.push_str(&reload.row(
            &format!("the same, forced through the reload path, {ingresses} Ingresses"),
            "",
        ));
    }
    let (runtime, certificates) =
        certificate_rotations(haproxy, client, 10_000, true, CERT_RUNTIME_SAMPLES).await?;
    if certificates < 2_500 {
        bail!("the 10k set holds {certificates} certificates, not 2,500");
    }
    rows.push_str(&runtime.row(
        &format!("certificate rotation to served, {certificates} TLS certificates, runtime API"),
        "<= 100 ms, 0 reloads",
    ));
    if runtime_only() {
        return Ok(rows.0);
    }
    let (reload, _) = certificate_rotations(haproxy, client, 10_000, false, 5).await?;
    rows.push_str(&reload.row(
        &format!("the same, forced through the reload path, {certificates} certificates"),
        "",
    ));
    Ok(rows.0)
}
