//! Test support: the haptic-testkit API server in this process; the controller and the real
//! `haptic-agent` (with supervised HAProxy) as child processes; small HTTP backends; and the
//! Kubernetes objects an Ingress needs. Each agent plays a pod on its own loopback address
//! (127.0.0.N), so every HAProxy binds the same ports on its own address, as pods do. The
//! channel between them is mutual TLS, from a throwaway PKI per cluster ([`TestPki`]).
#![allow(dead_code, unreachable_pub)]

use std::{
    collections::BTreeMap,
    future::Future,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use haptic_agent_client::{AgentClient, AgentState, ClientConfig, Target};
use haptic_controller::{HAProxyTemplateConfig, HAProxyTemplateConfigSpec, reference};
use haptic_testkit::{ApiServer, TestPki};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Pod, Secret, Service},
        discovery::v1::EndpointSlice,
        networking::v1::{Ingress, IngressClass},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    process::{Child, Command},
    task::JoinHandle,
};

pub mod envtest;

pub const NS: &str = "default";
pub const TOKEN: &str = "agent-token-for-tests-0123456789";
pub const HTC: &str = "haptic-config";

/// A loopback port for a server started next ([`haptic_testkit::free_port`]).
pub fn free_port() -> u16 {
    // Below the ephemeral range: no connection can be given it before the server binds it.
    haptic_testkit::free_port()
}

/// A binary of this workspace, next to the test executable's directory.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first (`cargo build -p {name}`; `cargo xtask test` and `cargo test --workspace` do)",
        path.display()
    );
    path
}

pub fn haproxy_bin() -> PathBuf {
    for candidate in [
        "/usr/sbin/haproxy",
        "/usr/bin/haproxy",
        "/usr/local/sbin/haproxy",
    ] {
        if Path::new(candidate).exists() {
            return candidate.into();
        }
    }
    panic!(
        "HAProxy is required by these tests: run `cargo xtask setup` (or `apt-get install haproxy`)"
    );
}

/// Polls `check` every 50 ms until it returns `Some`, at most `bound`; panics naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, bound: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {bound:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The API server, with the CRD installed.
pub struct Cluster {
    pub server: ApiServer,
    pub client: kube::Client,
    pub dir: tempfile::TempDir,
    /// The agent channel's CA and certificates (agents at 127.0.0.2 to 127.0.0.12).
    pub pki: TestPki,
}

impl Cluster {
    pub async fn start() -> Self {
        let server = ApiServer::start().await.expect("API server");
        let client = server.client_for("test").expect("client");
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in haptic_controller::crd::all_crds() {
            crds.create(&PostParams::default(), &crd)
                .await
                .expect("CRD created");
        }
        // The IngressClass `deploy/` ships (`haproxy`, ours, not the default): the Ingresses
        // of `ingress()` name it.
        let class: IngressClass =
            serde_saphyr::from_str(include_str!("../../../deploy/ingressclass.yaml"))
                .expect("deploy/ingressclass.yaml");
        Api::<IngressClass>::all(client.clone())
            .create(&PostParams::default(), &class)
            .await
            .expect("IngressClass created");
        let mut dir = tempfile::tempdir().expect("tempdir");
        if std::env::var_os("HAPTIC_TEST_KEEP").is_some() {
            // Logs and data stay for a look after a failure.
            dir.disable_cleanup(true);
            eprintln!("test data in {}", dir.path().display());
        }
        let ips: Vec<String> = (2..=12).map(|n| format!("127.0.0.{n}")).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        let pki = TestPki::generate(dir.path(), &ips).expect("test PKI");
        Self {
            server,
            client,
            dir,
            pki,
        }
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), NS)
    }

    pub async fn create_token(&self) {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "haptic-agent-token", "namespace": NS},
            "stringData": {"token": TOKEN},
            "data": {"token": base64(TOKEN)},
        }))
        .expect("secret");
        self.api::<Secret>()
            .create(&PostParams::default(), &secret)
            .await
            .expect("token secret");
    }

    pub async fn apply_htc(&self, spec: &HAProxyTemplateConfigSpec) {
        let htc = HAProxyTemplateConfig::new(HTC, spec.clone());
        let api = self.api::<HAProxyTemplateConfig>();
        match api.get_opt(HTC).await.expect("get HTC") {
            None => {
                api.create(&PostParams::default(), &htc)
                    .await
                    .expect("HTC created");
            }
            Some(_) => {
                api.patch(
                    HTC,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": spec})),
                )
                .await
                .expect("HTC patched");
            }
        }
    }

    pub async fn htc_status(&self) -> Option<serde_json::Value> {
        let htc = self.api::<HAProxyTemplateConfig>().get(HTC).await.ok()?;
        serde_json::to_value(htc.status?).ok()
    }

    pub async fn leader(&self) -> Option<String> {
        let lease = self.api::<Lease>().get_opt("haptic-leader").await.ok()??;
        lease.spec?.holder_identity.filter(|h| !h.is_empty())
    }

    /// The Lease's last `renewTime`, as wall-clock time.
    pub async fn lease_renew_time(&self) -> Option<std::time::SystemTime> {
        let lease = self.api::<Lease>().get_opt("haptic-leader").await.ok()??;
        let renew = lease.spec?.renew_time?;
        Some(std::time::SystemTime::from(renew.0))
    }

    pub async fn lease_epoch(&self) -> Option<u64> {
        let lease = self.api::<Lease>().get_opt("haptic-leader").await.ok()??;
        lease
            .metadata
            .annotations?
            .get("haptic.io/leader-epoch")?
            .parse()
            .ok()
    }

    /// A Service `name` with port 80 (`http`), its EndpointSlice to `backend`.
    pub async fn service(&self, name: &str, backend: SocketAddr) {
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": backend.port(), "protocol": "TCP"}]},
        }))
        .expect("service");
        self.api::<Service>()
            .create(&PostParams::default(), &service)
            .await
            .expect("service created");
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-1"), "namespace": NS, "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": backend.port(), "protocol": "TCP"}],
            "endpoints": [{"addresses": [backend.ip().to_string()], "conditions": {"ready": true}}],
        }))
        .expect("slice");
        self.api::<EndpointSlice>()
            .create(&PostParams::default(), &slice)
            .await
            .expect("slice created");
    }

    /// An Ingress routing `host` + `path` (Prefix) to `service` port `http`.
    pub async fn ingress(&self, name: &str, host: &str, path: &str, service: &str) {
        let ingress = ingress(name, host, path, service);
        let api = self.api::<Ingress>();
        if api.get_opt(name).await.expect("get ingress").is_some() {
            api.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&serde_json::to_value(&ingress).expect("json")),
            )
            .await
            .expect("ingress patched");
        } else {
            api.create(&PostParams::default(), &ingress)
                .await
                .expect("ingress created");
        }
    }

    pub async fn delete_ingress(&self, name: &str) {
        self.api::<Ingress>()
            .delete(name, &DeleteParams::default())
            .await
            .expect("ingress deleted");
    }
}

/// The class of the IngressClass `deploy/` ships.
pub const CLASS: &str = "haproxy";

/// An Ingress of our class ([`CLASS`]) routing `host` + `path` (Prefix) to `service` port
/// `http`.
pub fn ingress(name: &str, host: &str, path: &str, service: &str) -> Ingress {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"ingressClassName": CLASS, "rules": [{"host": host, "http": {"paths": [{
            "path": path, "pathType": "Prefix",
            "backend": {"service": {"name": service, "port": {"name": "http"}}},
        }]}}]},
    }))
    .expect("ingress")
}

/// Standard base64, as Secret `data` holds it.
pub fn base64(bytes: impl AsRef<[u8]>) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The reference config for tests: HAProxy on `http_port` at each pod's own address, short
/// Lease timings, a fast scheduler and drift check.
pub fn spec(agent_port: u16, http_port: u16) -> HAProxyTemplateConfigSpec {
    local(reference::spec(), agent_port, http_port)
}

/// Sizes the backend pool of `spec` by a reserve the leader keeps in the ConfigMap
/// `<NS>/haptic-backend-pool` (`pool_keeper`), as `reference::spec_in` does.
pub fn with_pool_reserve(spec: &mut HAProxyTemplateConfigSpec) {
    if let Some(haproxy) = spec
        .templating_settings
        .extra_context
        .get_mut("haproxy")
        .and_then(|v| v.as_object_mut())
    {
        haproxy.insert(
            "backend_pool_reserve".into(),
            json!(format!(
                "{NS}/{}",
                haptic_controller::pool_keeper::DEFAULT_NAME
            )),
        );
    }
    if let Some(store) = spec.watched_resources.get_mut("backend_pool") {
        store.namespace = Some(NS.to_owned());
    }
}

/// `spec` made to run on this machine (see [`spec`]).
pub fn local(
    mut spec: HAProxyTemplateConfigSpec,
    agent_port: u16,
    http_port: u16,
) -> HAProxyTemplateConfigSpec {
    spec.pod_selector.match_labels = BTreeMap::from([("app".to_owned(), "haproxy".to_owned())]);
    // The reference's store of the HAProxy pods (Gateway addresses) follows the podSelector.
    if let Some(pods) = spec.watched_resources.get_mut("haproxy_pods") {
        pods.label_selector = Some("app=haproxy".to_owned());
        pods.namespace = Some(NS.to_owned());
    }
    // The store of the backend pool's reserve too (read only where `with_pool_reserve` names
    // the ConfigMap).
    if let Some(pool) = spec.watched_resources.get_mut("backend_pool") {
        pool.namespace = Some(NS.to_owned());
    }
    let le = &mut spec.controller.leader_election;
    le.lease_duration = "3s".into();
    le.renew_deadline = "2s".into();
    le.retry_period = "500ms".into();
    let agent = &mut spec.agent;
    agent.port = agent_port;
    agent.min_deployment_interval = "100ms".into();
    agent.drift_prevention_interval = "1s".into();
    agent.deployment_timeout = "20s".into();
    let haproxy = spec
        .templating_settings
        .extra_context
        .get_mut("haproxy")
        .and_then(|v| v.as_object_mut())
        .expect("reference tunables");
    haproxy.insert("bind_address".into(), json!("${POD_IP}"));
    // The reference's 50000 needs a nofile limit above this machine's.
    haproxy.insert("maxconn".into(), json!(1000));
    haproxy.insert("http_port".into(), json!(http_port));
    haproxy.insert("https_port".into(), json!(http_port + 1));
    spec
}

/// A small HTTP backend answering `backend <name>`.
pub struct Backend {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Backend {
    pub async fn start(name: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = format!("backend {name}");
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(reply.as_bytes()).await;
                });
            }
        });
        Self { addr, task }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One GET through HAProxy: (status, body), or none when nothing answers.
pub async fn get(addr: &str, host: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr))
        .await
        .ok()?
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The `haptic-agent` binary with supervised HAProxy, playing pod `name` at 127.0.0.`index`.
pub struct Agent {
    pub name: String,
    /// The channel's PKI, to reach this agent as the controller does.
    pub pki: TestPki,
    pub ip: String,
    pub agent_port: u16,
    pub http_port: u16,
    pub data: PathBuf,
    child: Option<Child>,
    /// The client [`Agent::fetch`] keeps (its connections with it): a client made per call was a
    /// TLS handshake per call, three per change in `bench_controller`, paid by the agents too.
    kept: std::sync::OnceLock<AgentClient>,
}

impl Agent {
    pub async fn start(cluster: &Cluster, index: u8, agent_port: u16, http_port: u16) -> Self {
        Self::start_with_env(cluster, index, agent_port, http_port, &[]).await
    }

    pub async fn start_with_env(
        cluster: &Cluster,
        index: u8,
        agent_port: u16,
        http_port: u16,
        env: &[(&str, &str)],
    ) -> Self {
        let agent = Self::spawn(cluster, index, agent_port, http_port, env, false).await;
        agent.register(cluster).await;
        agent
    }

    /// An agent serving plain HTTP (`--insecure-plain-http`), its HAProxy bound to its own
    /// address, and no Pod object: a test registers one ([`register_pod`]) at the address of
    /// whatever stands in front of it.
    pub async fn start_plain_unregistered(
        cluster: &Cluster,
        index: u8,
        agent_port: u16,
        http_port: u16,
    ) -> Self {
        Self::spawn(cluster, index, agent_port, http_port, &[], true).await
    }

    async fn spawn(
        cluster: &Cluster,
        index: u8,
        agent_port: u16,
        http_port: u16,
        env: &[(&str, &str)],
        plain: bool,
    ) -> Self {
        let name = format!("haproxy-{index}");
        let ip = format!("127.0.0.{}", index + 1);
        let dir = cluster.dir.path().join(&name);
        std::fs::create_dir_all(&dir).expect("agent dir");
        let token_file = dir.join("token");
        std::fs::write(&token_file, TOKEN).expect("token file");
        let data = dir.join("data");
        let log = std::fs::File::create(dir.join("agent.log")).expect("agent log");
        let child = Command::new(workspace_bin("haptic-agent"))
            .arg("--listen")
            .arg(format!("{ip}:{agent_port}"))
            .arg("--token-file")
            .arg(&token_file)
            .arg("--data-dir")
            .arg(&data)
            .arg("--haproxy")
            .arg(haproxy_bin())
            .arg("--supervise")
            .arg("--drain-seconds")
            .arg("1")
            .args(if plain {
                vec!["--insecure-plain-http".into()]
            } else {
                cluster.pki.agent_args()
            })
            .env("POD_IP", &ip)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            // Its own process group, which its HAProxy joins: dropping the agent ends both.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("agent starts");
        let agent = Self {
            name,
            pki: cluster.pki.clone(),
            ip,
            agent_port,
            http_port,
            data,
            child: Some(child),
            kept: std::sync::OnceLock::new(),
        };
        eventually(
            "the agent answers /healthz",
            Duration::from_secs(10),
            || async {
                TcpStream::connect(agent.agent_addr())
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        agent
    }

    pub fn agent_addr(&self) -> String {
        format!("{}:{}", self.ip, self.agent_port)
    }

    pub fn http_addr(&self) -> String {
        format!("{}:{}", self.ip, self.http_port)
    }

    /// Where HAProxy serves TLS (`haproxy.https_port`: the HTTP port + 1, as the tests set it).
    pub fn https_addr(&self) -> String {
        format!("{}:{}", self.ip, self.http_port + 1)
    }

    /// The Pod object, Running and ready, with this agent's address.
    async fn register(&self, cluster: &Cluster) {
        register_pod(cluster, &self.name, &self.ip).await;
    }

    /// The agent's base URL (https: the channel is mutual TLS).
    pub fn url(&self) -> String {
        format!("https://{}/", self.agent_addr())
    }

    /// A client that reaches this agent as the controller does (its client certificate, the
    /// token, the agent verified by its IP).
    pub fn client(&self) -> AgentClient {
        let tls = haptic_agent_client::tls::client_config(
            &self.pki.ca,
            None,
            Some(&haptic_agent_client::tls::PairFiles {
                cert: self.pki.controller_cert.clone(),
                key: self.pki.controller_key.clone(),
            }),
        )
        .expect("client TLS");
        AgentClient::new(
            ClientConfig::new(TOKEN)
                .with_retries(1, Duration::from_millis(10))
                .with_tls(tls),
        )
        .expect("agent client")
    }

    pub async fn state(&self) -> Option<AgentState> {
        let target = Target::new(&self.name, &self.url()).ok()?;
        self.client().state(&target.url).await.ok()
    }

    /// Waits until the agent's live set is one `leader` applied, and returns its state. A
    /// runtime change serves before the agent writes the set and records who applied it, so
    /// a route seen through HAProxy does not mean the state says so yet.
    pub async fn await_live_from(&self, leader: &str) -> AgentState {
        eventually(
            &format!("{}'s live set applied by {leader}", self.name),
            Duration::from_secs(30),
            || async {
                self.state()
                    .await
                    .filter(|state| state.leader.as_deref() == Some(leader))
            },
        )
        .await
    }

    /// An authorized GET of `path` on the agent's API: the body of a 200.
    pub async fn fetch(&self, path: &str) -> Option<String> {
        let target = Target::new(&self.name, &self.url()).ok()?;
        let client = self.kept.get_or_init(|| self.client());
        let body = client.get_raw(&target.url, path).await.ok()?;
        Some(String::from_utf8_lossy(&body).into_owned())
    }

    /// Waits until a GET through this pod's HAProxy answers `want` (status, body).
    pub async fn await_route(&self, host: &str, path: &str, want: (u16, &str)) {
        let addr = self.http_addr();
        eventually(
            &format!("{} routes {host}{path} to {want:?}", self.name),
            Duration::from_secs(30),
            || async {
                let got = get(&addr, host, path).await?;
                (got.0 == want.0 && got.1.contains(want.1)).then_some(())
            },
        )
        .await;
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            // The agent stops its HAProxy on SIGTERM; a kill -9 of the agent alone would
            // orphan it. Then whatever is left of its process group (an HAProxy the agent did
            // not stop within the 2 s, an old worker of a reload) is killed.
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status();
                for _ in 0..100 {
                    if matches!(child.try_wait(), Ok(Some(_))) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = std::process::Command::new("kill")
                    .arg("-KILL")
                    .arg("--")
                    .arg(format!("-{pid}"))
                    .stderr(Stdio::null())
                    .status();
                let _ = child.start_kill();
            }
        }
    }
}

/// The `haptic-controller` binary as replica `name`.
pub struct Controller {
    pub name: String,
    pub log: PathBuf,
    pub health: u16,
    child: Child,
}

impl Controller {
    pub async fn start(cluster: &Cluster, name: &str) -> Self {
        Self::start_with_env(cluster, name, &[]).await
    }

    pub async fn start_with_env(cluster: &Cluster, name: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(cluster, name, env, &[]).await
    }

    /// Started with `env` and these extra `run` arguments.
    pub async fn start_with(
        cluster: &Cluster,
        name: &str,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Self {
        Self::spawn(cluster, name, env, args, true).await
    }

    /// Reaching the agents over plain HTTP (`HAPTIC_AGENT_INSECURE_PLAIN_HTTP`).
    pub async fn start_plain(cluster: &Cluster, name: &str) -> Self {
        Self::spawn(
            cluster,
            name,
            &[("HAPTIC_AGENT_INSECURE_PLAIN_HTTP", "true")],
            &[],
            false,
        )
        .await
    }

    /// Started with no agent channel flags: the controller's own CA (`agent_ca`).
    pub async fn start_with_own_ca(cluster: &Cluster, name: &str) -> Self {
        Self::spawn(cluster, name, &[], &[], false).await
    }

    async fn spawn(
        cluster: &Cluster,
        name: &str,
        env: &[(&str, &str)],
        args: &[&str],
        channel_flags: bool,
    ) -> Self {
        let channel: Vec<std::ffi::OsString> = if channel_flags {
            cluster.pki.controller_args()
        } else {
            Vec::new()
        };
        let kubeconfig = cluster.server.kubeconfig_for(name).expect("kubeconfig");
        let log = cluster.dir.path().join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log file");
        let health = free_port();
        let child = Command::new(workspace_bin("haptic-controller"))
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--pod-name")
            .arg(name)
            .arg("--namespace")
            .arg(NS)
            .arg("--health-addr")
            .arg(format!("127.0.0.1:{health}"))
            .arg("--haproxy")
            .arg(haproxy_bin())
            .args(channel)
            .args(args)
            .env("RUST_LOG", "info,haptic_controller=debug")
            // No default certificate unless a test asks for one (`tenants`): its Secret would
            // be one more TLS Secret in the stores and the published set.
            .env("HAPTIC_DEFAULT_CERTIFICATE_SECRET", "none")
            // The allocator as the Deployment runs it (deploy/controller.yaml): what
            // `bench_controller` reports as the replicas' RSS is then production's.
            .env("MIMALLOC_PURGE_DELAY", "0")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("controller starts");
        Self {
            name: name.to_owned(),
            log,
            health,
            child,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().map_or(0, |p| p as i32)
    }

    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} {}", self.pid());
    }

    /// Waits for the process to exit, at most `bound`.
    pub async fn exited(&mut self, bound: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(bound, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within {bound:?}", self.name))
            .expect("wait")
    }

    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The controller's `/metrics` page (on its health port).
    #[allow(dead_code)]
    pub async fn metrics(&self) -> Option<String> {
        get(
            &format!("127.0.0.1:{}", self.health),
            "localhost",
            "/metrics",
        )
        .await
        .filter(|(status, _)| *status == 200)
        .map(|(_, body)| body)
    }

    /// The value of the unlabelled counter or gauge `name` on `/metrics`.
    #[allow(dead_code)]
    pub async fn metric_value(&self, name: &str) -> Option<f64> {
        let page = self.metrics().await?;
        page.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == name).then_some(())?;
            words.next()?.parse().ok()
        })
    }

    pub async fn probe(&self, path: &str) -> Option<u16> {
        get(&format!("127.0.0.1:{}", self.health), "localhost", path)
            .await
            .map(|(s, _)| s)
    }
}

/// A Pod object `name`, Running and ready, at `ip`, with the HAProxy pods' labels.
pub async fn register_pod(cluster: &Cluster, name: &str, ip: &str) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "haproxy"}},
            "spec": {"containers": [{"name": "haproxy", "image": "haproxy"}, {"name": "haptic-agent", "image": "haptic-agent"}]},
        }))
        .expect("pod");
    let api = cluster.api::<Pod>();
    api.create(&PostParams::default(), &pod)
        .await
        .expect("pod created");
    let status = json!({"status": {
        "phase": "Running",
        "podIP": ip,
        "containerStatuses": [
            {"name": "haproxy", "ready": true, "restartCount": 0, "image": "haproxy", "imageID": ""},
            {"name": "haptic-agent", "ready": true, "restartCount": 0, "image": "haptic-agent", "imageID": ""},
        ],
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("pod status");
}

/// Accepts any server certificate: the test looks at which one it was.
#[derive(Debug)]
struct AnyCertificate(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The certificate (DER) `addr` serves over TLS for `sni` (none: no SNI), any certificate
/// accepted: the caller looks at which one it is. `None` when no handshake completes in 5 s.
pub async fn served_certificate(
    addr: &str,
    sni: Option<&str>,
) -> Option<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::ServerName;
    use std::sync::Arc;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    let ip: std::net::IpAddr = addr.split(':').next()?.parse().ok()?;
    // rustls sends no SNI when the server name is an IP address.
    let name = match sni {
        Some(host) => ServerName::try_from(host.to_owned()).ok()?,
        None => ServerName::IpAddress(ip.into()),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let tls = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp),
    )
    .await
    .ok()?
    .ok()?;
    Some(
        tls.get_ref()
            .1
            .peer_certificates()?
            .first()?
            .clone()
            .into_owned(),
    )
}
