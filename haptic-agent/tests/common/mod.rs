//! Test support: agents with their own supervised HAProxy on loopback, a small HTTP backend,
//! and HAProxy configurations that route through a relative map file.
#![allow(dead_code, unreachable_pub)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use haptic_agent::{Agent, AgentConfig, metrics::Exposition};
use haptic_agent_client::{AgentClient, ApplyRequest, ClientConfig, FileSet};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use reqwest::Url;
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "test-token-0123456789";

/// The HAProxy binary, or a panic that says how to get it: these tests never skip.
pub fn haproxy_bin() -> PathBuf {
    haptic_agent::haproxy::find_binary(Path::new("haproxy")).unwrap_or_else(|| {
        panic!(
            "HAProxy is required by these tests and was found neither on PATH nor in /usr/sbin: \
             run `cargo xtask setup` (or `apt-get install haproxy`)"
        )
    })
}

/// A loopback port for a server started next ([`haptic_testkit::free_port`]).
pub fn free_port() -> u16 {
    // Below the ephemeral range: no connection can be given it before the server binds it.
    haptic_testkit::free_port()
}

/// A small HTTP backend answering `backend <name>` on every path.
pub struct Backend {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Backend {
    pub async fn start(name: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("backend addr");
        let app = axum::Router::new().fallback(move || async move { format!("backend {name}") });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, task }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// HAProxy configuration text: a frontend on `port` routing every path through
/// `maps/routes.map` (a relative path, resolved inside the set) to one backend per entry.
pub fn config(port: u16, route_to: &str, backends: &[(&str, SocketAddr)]) -> FileSet {
    let mut cfg = format!(
        "global\n  nbthread 1\n  log stderr format raw local0 warning\n\
         defaults\n  mode http\n  timeout connect 2s\n  timeout client 10s\n  timeout server 10s\n\
         frontend fe\n  bind 127.0.0.1:{port}\n  use_backend %[path,map_beg(maps/routes.map,be_none)]\n\
         backend be_none\n  http-request return status 404 content-type text/plain string \"no route\"\n"
    );
    for (name, addr) in backends {
        cfg.push_str(&format!("backend be_{name}\n  server s1 {addr}\n"));
    }
    FileSet::new()
        .with("haproxy.cfg", cfg)
        .and_then(|set| set.with("maps/routes.map", format!("/ be_{route_to}\n")))
        .expect("valid set")
}

/// The SDK and Prometheus exporter the binary installs (haptic-serve's), on a registry of this
/// agent's own (tests run agents side by side in one process).
pub fn test_metrics() -> (SdkMeterProvider, Exposition) {
    haptic_serve::prometheus_exporter().expect("exporter")
}

/// `/metrics` parsed with a Prometheus text-format parser.
pub async fn scrape(url: &Url) -> prometheus_parse::Scrape {
    let text = traffic_client()
        .get(url.join("/metrics").expect("url"))
        .send()
        .await
        .expect("GET /metrics")
        .error_for_status()
        .expect("/metrics answers 200")
        .text()
        .await
        .expect("metrics text");
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses")
}

/// The value of the counter or gauge `name` whose labels include `labels`.
pub fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    use prometheus_parse::Value;
    let sample = scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .unwrap_or_else(|| panic!("no {name}{labels:?} in {:?}", scrape.samples));
    match sample.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
        ref other => panic!("{name} is not a counter or gauge: {other:?}"),
    }
}

/// An in-process agent in supervised mode on its own data directory and loopback port.
pub struct TestAgent {
    pub agent: Agent,
    pub url: Url,
    pub data: PathBuf,
    _metrics: Option<SdkMeterProvider>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl TestAgent {
    pub async fn start(data: &Path) -> Self {
        let config = AgentConfig::new(data, TOKEN)
            .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
            .with_haproxy_bin(haproxy_bin())
            .with_supervise(true);
        Self::start_with(config).await
    }

    pub async fn start_with(mut config: AgentConfig) -> Self {
        config.check_timeout = Duration::from_secs(30);
        config.reload_timeout = Duration::from_secs(30);
        Self::start_exact(config).await
    }

    /// Like [`TestAgent::start_with`], with the configuration's timeouts as given.
    pub async fn start_exact(mut config: AgentConfig) -> Self {
        let data = config.data_dir.clone();
        let mut provider = None;
        if config.exposition.is_none() {
            let (p, exposition) = test_metrics();
            config = config.with_metrics(p.meter("haptic-agent"), exposition);
            provider = Some(p);
        }
        let agent = Agent::open(config).await.expect("open agent");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind agent");
        let url =
            Url::parse(&format!("http://{}/", listener.local_addr().expect("addr"))).expect("url");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let (agent, shutdown) = (agent.clone(), shutdown.clone());
            async move {
                haptic_agent::serve(agent, listener, shutdown, Duration::from_secs(10))
                    .await
                    .expect("serve");
            }
        });
        Self {
            agent,
            url,
            data,
            _metrics: provider,
            shutdown,
            task: Some(task),
        }
    }

    /// `haptic_agent_applies_total{outcome}` as `/metrics` shows it.
    pub async fn applies(&self, outcome: &str) -> u64 {
        value(
            &scrape(&self.url).await,
            "haptic_agent_applies_total",
            &[("outcome", outcome)],
        ) as u64
    }

    /// Stops the server and its HAProxy, and waits for both (bounded).
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("agent stops within 20 s")
                .expect("agent task");
        }
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        // On a panic the runtime's drop kills HAProxy (kill_on_drop); this ends the server.
        self.shutdown.cancel();
    }
}

pub fn client() -> AgentClient {
    AgentClient::new(
        ClientConfig::new(TOKEN)
            .with_request_timeout(Duration::from_secs(60))
            .with_retries(3, Duration::from_millis(50)),
    )
    .expect("client")
}

pub fn request(epoch: u64, leader: &str, generation: u64, files: FileSet) -> ApplyRequest {
    ApplyRequest::new(epoch, leader, generation, files).expect("request")
}

/// A plain HTTP client that opens a fresh connection per request, so that a reload is seen
/// by the next request rather than by a kept-alive connection to an old worker.
pub fn traffic_client() -> reqwest::Client {
    // reqwest is built without a bundled crypto provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("traffic client")
}

/// GETs `http://127.0.0.1:<port>/` until the body equals `want` (or 20 s pass), and returns
/// the last body seen.
pub async fn await_body(port: u16, want: &str) -> String {
    let http = traffic_client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        if let Ok(response) = http.get(format!("http://127.0.0.1:{port}/")).send().await {
            last = response.text().await.unwrap_or_default();
            if last == want {
                return last;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}

/// One GET through HAProxy; the body or the error text.
pub async fn get_once(port: u16) -> String {
    match traffic_client()
        .get(format!("http://127.0.0.1:{port}/"))
        .send()
        .await
    {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(error) => format!("error: {error}"),
    }
}

/// Every path under `dir`, relative, sorted; for "nothing was written" checks.
pub fn listing(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            out.push(
                path.strip_prefix(root)
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            );
            if path.is_dir() && !path.is_symlink() {
                walk(&path, root, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `files` with the content of `path` replaced by `edit` of the old one (or added).
pub fn rewrite(files: &FileSet, path: &str, edit: impl FnOnce(&str) -> String) -> FileSet {
    let old = files
        .get(path)
        .map(|content| String::from_utf8_lossy(content).into_owned())
        .unwrap_or_default();
    let mut out = FileSet::new();
    for (name, content) in files.iter().filter(|(name, _)| *name != path) {
        out.insert(name, content.clone()).expect("valid path");
    }
    out.insert(path, edit(&old)).expect("valid path");
    out
}

/// The common starting point: a supervised agent whose HAProxy serves `backend a` on `port`,
/// from the set `live` applied at `epoch`.
pub struct Serving {
    pub backend: Backend,
    pub dir: tempfile::TempDir,
    pub agent: TestAgent,
    pub client: AgentClient,
    pub port: u16,
    pub live: ApplyRequest,
}

impl Serving {
    pub async fn start(epoch: u64) -> Self {
        let backend = Backend::start("a").await;
        let dir = tempfile::tempdir().expect("tempdir");
        let agent = TestAgent::start(dir.path()).await;
        let client = client();
        let port = free_port();
        let live = request(
            epoch,
            "leader-0",
            1,
            config(port, "a", &[("a", backend.addr)]),
        );
        client.apply(&agent.url, &live).await.expect("first apply");
        assert_eq!(await_body(port, "backend a").await, "backend a");
        Self {
            backend,
            dir,
            agent,
            client,
            port,
            live,
        }
    }

    /// The routes of `live`, pointed at `route_to`.
    pub fn set_routing_to(&self, route_to: &str) -> FileSet {
        config(self.port, route_to, &[("a", self.backend.addr)])
    }
}
