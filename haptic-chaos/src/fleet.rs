//! One run's system: the haptic-testkit API server in this process, the Kubernetes objects
//! (CRD, token, HAProxyTemplateConfig, backends, Services, EndpointSlices, Ingresses), three
//! `haptic-agent` processes with supervised HAProxy (each a pod on its own loopback address)
//! and three `haptic-controller` replicas. Every child runs in its own process group; all of
//! them are killed when the fleet stops, also after a failure or a Ctrl-C.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use haptic_agent::journal::{JOURNAL_PATH, JournalView};
use haptic_agent_client::{AgentClient, AgentState, ClientConfig, Target, tls::PairFiles};
use haptic_controller::{HAProxyTemplateConfig, HAProxyTemplateConfigSpec, reference};
use haptic_testkit::{ApiServer, TestPki, pki::AGENT_DNS_NAME};
use k8s_openapi::{
    api::{
        core::v1::{Pod, Secret, Service},
        discovery::v1::EndpointSlice,
        networking::v1::Ingress,
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    CustomResourceExt as _,
    api::{Api, Patch, PatchParams, PostParams},
};
use rustix::process::{Pid, Signal};
use serde_json::json;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    process::{Child, Command},
    task::JoinHandle,
};

pub(crate) const NS: &str = "default";
pub(crate) const TOKEN: &str = "chaos-agent-token-0123456789abcdef";
pub(crate) const HTC: &str = "haptic-config";
pub(crate) const LEASE: &str = "haptic-leader";
/// The backends every run starts; `canary` serves the one Ingress the writer never changes.
pub(crate) const BACKENDS: [&str; 4] = ["a", "b", "c", "canary"];
pub(crate) const CANARY_HOST: &str = "canary.chaos.test";
pub(crate) const REPLICAS: usize = 3;
pub(crate) const AGENTS: usize = 3;

/// The Lease timings of every run (LeaseDuration / RenewDeadline = 1.5, the skew tolerated).
pub(crate) const LEASE_DURATION: Duration = Duration::from_secs(3);
pub(crate) const RENEW_DEADLINE: Duration = Duration::from_secs(2);

/// A binary of this workspace beside the runner's own executable.
pub(crate) fn workspace_bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("the runner's path")?;
    let dir = exe.parent().context("the runner's directory")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} is missing: build it first (`cargo build -p {name} --bins`; `cargo xtask chaos` does)",
            path.display()
        );
    }
    Ok(path)
}

pub(crate) fn haproxy_bin() -> Result<PathBuf> {
    haptic_agent::haproxy::find_binary(Path::new("haproxy"))
        .context("HAProxy is required: run `cargo xtask setup` (or `apt-get install haproxy`)")
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Sends `signal` to `pid`; a process already gone is not an error.
pub(crate) fn signal(pid: i32, signal: Signal) {
    if let Some(pid) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn signal_group(pgid: i32, signal: Signal) {
    if let Some(pid) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Process groups started by this run, killed when it ends (an agent killed with SIGKILL
/// leaves its HAProxy in its old group).
#[derive(Debug, Clone, Default)]
pub(crate) struct Groups(Arc<Mutex<Vec<i32>>>);

impl Groups {
    fn add(&self, pgid: i32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(pgid);
    }

    pub(crate) fn kill_all(&self) {
        let groups = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for pgid in groups {
            signal_group(pgid, Signal::CONT);
            signal_group(pgid, Signal::KILL);
        }
    }
}

/// Kills every process group and unmounts the tmpfs when dropped: the last line of cleanup
/// should the runner fail or panic before [`Fleet::stop`] (which does the same, gracefully
/// first).
#[derive(Debug)]
struct Cleanup {
    groups: Groups,
    mounts: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.groups.kill_all();
        for dir in &self.mounts {
            unmount(dir);
        }
    }
}

/// A child process in its own group.
#[derive(Debug)]
pub(crate) struct Proc {
    child: Child,
    pub(crate) pid: i32,
}

impl Proc {
    fn spawn(mut command: std::process::Command, log: &Path, groups: &Groups) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0);
        let child = Command::from(command)
            .spawn()
            .with_context(|| "starting a child process".to_owned())?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .context("the child's pid")?;
        groups.add(pid);
        Ok(Self { child, pid })
    }

    /// SIGKILL, and waits for it (bounded).
    pub(crate) async fn kill9(&mut self) {
        signal(self.pid, Signal::KILL);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    /// SIGTERM, then SIGKILL of the whole group after `grace`.
    async fn stop(&mut self, grace: Duration) {
        signal(self.pid, Signal::CONT);
        signal(self.pid, Signal::TERM);
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            signal_group(self.pid, Signal::KILL);
            let _ = tokio::time::timeout(Duration::from_secs(2), self.child.wait()).await;
        }
    }
}

/// A small HTTP backend answering `backend <name>`.
pub(crate) struct Backend {
    pub(crate) addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Backend {
    async fn start(name: &'static str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
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
        Ok(Self { addr, task })
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One GET through HAProxy: (status, body), or none when nothing answers within 2 s.
pub(crate) async fn http_get(addr: &str, host: &str) -> Option<(u16, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let request = format!("GET / HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.ok()?;
        let text = String::from_utf8_lossy(&response).into_owned();
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
}

/// An agent slot: pod `haproxy-N` at 127.0.0.(N+1).
pub(crate) struct AgentSlot {
    pub(crate) name: String,
    pub(crate) ip: String,
    pub(crate) dir: PathBuf,
    pub(crate) data: PathBuf,
    /// Whether `data` is a small tmpfs this run mounted (the disk-full fault needs it).
    pub(crate) tmpfs: bool,
    /// The running agent; a fault holds the lock for as long as it acts on this slot.
    pub(crate) proc: tokio::sync::Mutex<Option<Proc>>,
}

/// A controller slot.
pub(crate) struct ControllerSlot {
    pub(crate) name: String,
    pub(crate) log: PathBuf,
    pub(crate) clock_rate: Option<f64>,
    /// The running replica; a fault holds the lock for as long as it acts on this slot.
    pub(crate) proc: tokio::sync::Mutex<Option<Proc>>,
}

/// The whole system of one run.
pub(crate) struct Fleet {
    pub(crate) server: ApiServer,
    pub(crate) client: kube::Client,
    pub(crate) spec: HAProxyTemplateConfigSpec,
    pub(crate) agent_port: u16,
    pub(crate) http_port: u16,
    pub(crate) agents: Vec<AgentSlot>,
    pub(crate) controllers: Vec<ControllerSlot>,
    pub(crate) backends: BTreeMap<&'static str, Backend>,
    pub(crate) groups: Groups,
    agent_bin: PathBuf,
    controller_bin: PathBuf,
    haproxy: PathBuf,
    state_client: AgentClient,
    /// The agent channel's throwaway PKI: every agent serves mutual TLS, and the controllers
    /// verify them by the DNS name their certificate carries (as deploy/ does).
    pki: TestPki,
    _cleanup: Cleanup,
}

/// The reference config made to run here: HAProxy on `http_port` at each pod's own address,
/// short Lease timings, a fast scheduler and drift check.
pub(crate) fn spec(agent_port: u16, http_port: u16) -> Result<HAProxyTemplateConfigSpec> {
    let mut spec = reference::spec();
    spec.pod_selector.match_labels = BTreeMap::from([("app".to_owned(), "haproxy".to_owned())]);
    let le = &mut spec.controller.leader_election;
    le.lease_duration = format!("{}s", LEASE_DURATION.as_secs());
    le.renew_deadline = format!("{}s", RENEW_DEADLINE.as_secs());
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
        .context("the reference config's tunables")?;
    haproxy.insert("bind_address".into(), json!("${POD_IP}"));
    haproxy.insert("maxconn".into(), json!(1000));
    haproxy.insert("http_port".into(), json!(http_port));
    haproxy.insert("https_port".into(), json!(http_port + 1));
    Ok(spec)
}

fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T> {
    serde_json::from_value(value).context("building an object")
}

pub(crate) fn ingress(name: &str, host: &str, service: &str) -> Result<Ingress> {
    object(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"ingressClassName": "haproxy", "rules": [{"host": host, "http": {"paths": [{
            "path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": service, "port": {"name": "http"}}},
        }]}}]},
    }))
}

/// The EndpointSlice of Service `service`, its one endpoint at `backend`.
pub(crate) fn slice(service: &str, backend: SocketAddr) -> Result<EndpointSlice> {
    object(json!({
        "metadata": {"name": format!("{service}-1"), "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": backend.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [backend.ip().to_string()], "conditions": {"ready": true}}],
    }))
}

impl Fleet {
    /// The API server with every object, the agents' directories (on tmpfs when
    /// `tmpfs_agent` names one and the machine allows mounting), nothing started yet.
    pub(crate) async fn prepare(dir: &Path, tmpfs_agent: Option<usize>) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let server = ApiServer::start()
            .await
            .context("starting the API server")?;
        let client = server.client_for("chaos-runner")?;
        let (agent_port, http_port) = (free_port()?, free_port()?);
        let spec = spec(agent_port, http_port)?;
        let groups = Groups::default();
        let mut agents = Vec::new();
        for i in 0..AGENTS {
            let name = format!("haproxy-{}", i + 1);
            let ip = format!("127.0.0.{}", i + 2);
            let adir = dir.join(&name);
            let data = adir.join("data");
            std::fs::create_dir_all(&data)?;
            std::fs::write(adir.join("token"), TOKEN)?;
            let tmpfs = tmpfs_agent == Some(i) && mount_tmpfs(&data);
            agents.push(AgentSlot {
                name,
                ip,
                dir: adir,
                data,
                tmpfs,
                proc: tokio::sync::Mutex::new(None),
            });
        }
        let ips: Vec<&str> = agents.iter().map(|a| a.ip.as_str()).collect();
        let pki = TestPki::generate(dir, &ips).context("the agent channel's PKI")?;
        let state_tls = haptic_agent_client::tls::client_config(
            &pki.ca,
            Some(AGENT_DNS_NAME),
            Some(&PairFiles {
                cert: pki.controller_cert.clone(),
                key: pki.controller_key.clone(),
            }),
        )
        .context("the runner's TLS to the agents")?;
        let controllers = (0..REPLICAS)
            .map(|i| {
                let name = format!("controller-{}", i + 1);
                ControllerSlot {
                    log: dir.join(format!("{name}.log")),
                    name,
                    clock_rate: None,
                    proc: tokio::sync::Mutex::new(None),
                }
            })
            .collect();
        let cleanup = Cleanup {
            groups: groups.clone(),
            mounts: agents
                .iter()
                .filter(|a| a.tmpfs)
                .map(|a| a.data.clone())
                .collect(),
        };
        let mut backends = BTreeMap::new();
        for name in BACKENDS {
            backends.insert(name, Backend::start(name).await?);
        }
        let fleet = Self {
            server,
            client,
            spec,
            agent_port,
            http_port,
            agents,
            controllers,
            backends,
            groups,
            agent_bin: workspace_bin("haptic-agent")?,
            controller_bin: workspace_bin("haptic-controller")?,
            haproxy: haproxy_bin()?,
            state_client: AgentClient::new(
                ClientConfig::new(TOKEN)
                    .with_request_timeout(Duration::from_secs(3))
                    .with_retries(1, Duration::from_millis(10))
                    .with_tls(state_tls),
            )
            .context("the agent client")?,
            pki,
            _cleanup: cleanup,
        };
        fleet.objects().await?;
        Ok(fleet)
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), NS)
    }

    async fn objects(&self) -> Result<()> {
        let pp = PostParams::default();
        Api::<CustomResourceDefinition>::all(self.client.clone())
            .create(&pp, &HAProxyTemplateConfig::crd())
            .await
            .context("creating the CRD")?;
        // The IngressClass `deploy/ingressclass.yaml` ships: the fleet's Ingresses name it.
        let class: k8s_openapi::api::networking::v1::IngressClass = object(json!({
            "metadata": {"name": "haproxy"},
            "spec": {"controller": haptic_render::derived::DEFAULT_CONTROLLER},
        }))?;
        Api::all(self.client.clone())
            .create(&pp, &class)
            .await
            .context("creating the IngressClass")?;
        let secret: Secret = object(json!({
            "metadata": {"name": "haptic-agent-token", "namespace": NS},
            "data": {"token": base64(TOKEN)},
        }))?;
        self.api::<Secret>().create(&pp, &secret).await?;
        self.api::<HAProxyTemplateConfig>()
            .create(&pp, &HAProxyTemplateConfig::new(HTC, self.spec.clone()))
            .await
            .context("creating the HAProxyTemplateConfig")?;
        for (name, backend) in &self.backends {
            let service: Service = object(json!({
                "metadata": {"name": format!("web-{name}"), "namespace": NS},
                "spec": {"ports": [{"name": "http", "port": 80, "targetPort": backend.addr.port(), "protocol": "TCP"}]},
            }))?;
            self.api::<Service>().create(&pp, &service).await?;
            self.api::<EndpointSlice>()
                .create(&pp, &slice(&format!("web-{name}"), backend.addr)?)
                .await?;
        }
        let ingresses = self.api::<Ingress>();
        ingresses
            .create(&pp, &ingress("canary", CANARY_HOST, "web-canary")?)
            .await?;
        ingresses
            .create(&pp, &ingress("shop", "shop.chaos.test", "web-a")?)
            .await?;
        ingresses
            .create(&pp, &ingress("blog", "blog.chaos.test", "web-b")?)
            .await?;
        Ok(())
    }

    /// Starts agent `i` and waits until it listens; the caller keeps the process.
    pub(crate) async fn spawn_agent(&self, i: usize) -> Result<Proc> {
        let slot = &self.agents[i];
        let mut command = std::process::Command::new(&self.agent_bin);
        command
            .arg("--listen")
            .arg(format!("{}:{}", slot.ip, self.agent_port))
            .arg("--token-file")
            .arg(slot.dir.join("token"))
            .arg("--data-dir")
            .arg(&slot.data)
            .arg("--haproxy")
            .arg(&self.haproxy)
            .arg("--supervise")
            .arg("--drain-seconds")
            .arg("1")
            .args(self.pki.agent_args())
            .env("POD_IP", &slot.ip)
            .env("RUST_LOG", "info");
        let proc = Proc::spawn(command, &slot.dir.join("agent.log"), &self.groups)?;
        let addr = format!("{}:{}", slot.ip, self.agent_port);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(&addr).await.is_err() {
            if tokio::time::Instant::now() > deadline {
                bail!("agent {} did not listen on {addr} within 15 s", i + 1);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(proc)
    }

    /// Registers agent `i`'s Pod, Running and ready at its address.
    pub(crate) async fn register_pod(&self, i: usize) -> Result<()> {
        let pods = self.api::<Pod>();
        let name = self.agents[i].name.clone();
        if pods.get_opt(&name).await?.is_none() {
            let pod: Pod = object(json!({
                "metadata": {"name": name, "namespace": NS, "labels": {"app": "haproxy"}},
                "spec": {"containers": [{"name": "haproxy", "image": "haproxy"}, {"name": "haptic-agent", "image": "haptic-agent"}]},
            }))?;
            pods.create(&PostParams::default(), &pod).await?;
            let status = json!({"status": {
                "phase": "Running",
                "podIP": self.agents[i].ip,
                "containerStatuses": [
                    {"name": "haproxy", "ready": true, "restartCount": 0, "image": "haproxy", "imageID": ""},
                    {"name": "haptic-agent", "ready": true, "restartCount": 0, "image": "haptic-agent", "imageID": ""},
                ],
            }});
            pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await?;
        }
        Ok(())
    }

    /// Starts replica `i` (with its test-only clock rate, if it has one); the caller keeps
    /// the process.
    pub(crate) fn spawn_controller(&self, i: usize) -> Result<Proc> {
        let slot = &self.controllers[i];
        let kubeconfig = self.server.kubeconfig_for(&slot.name)?;
        let mut command = std::process::Command::new(&self.controller_bin);
        command
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--pod-name")
            .arg(&slot.name)
            .arg("--namespace")
            .arg(NS)
            .arg("--health-addr")
            .arg(format!("127.0.0.1:{}", free_port()?))
            .arg("--haproxy")
            .arg(&self.haproxy)
            .args(self.pki.controller_args())
            .arg("--agent-server-name")
            .arg(AGENT_DNS_NAME)
            .env("RUST_LOG", "info");
        if let Some(rate) = slot.clock_rate {
            command
                .arg("--test-only-election-clock-rate")
                .arg(format!("{rate}"));
        }
        Proc::spawn(command, &slot.log, &self.groups)
    }

    pub(crate) fn agent_url(&self, i: usize) -> String {
        format!("https://{}:{}/", self.agents[i].ip, self.agent_port)
    }

    pub(crate) fn http_addr(&self, i: usize) -> String {
        format!("{}:{}", self.agents[i].ip, self.http_port)
    }

    pub(crate) async fn agent_state(&self, i: usize) -> Option<AgentState> {
        let target = Target::new(&self.agents[i].name, &self.agent_url(i)).ok()?;
        self.state_client.state(&target.url).await.ok()
    }

    /// The agent's apply journal, through its HTTP API (mutual TLS, the token).
    pub(crate) async fn journal(&self, i: usize) -> Result<JournalView> {
        let target = Target::new(&self.agents[i].name, &self.agent_url(i))?;
        let body = tokio::time::timeout(
            Duration::from_secs(10),
            self.state_client.get_raw(&target.url, JOURNAL_PATH),
        )
        .await
        .context("the journal did not arrive within 10 s")?
        .with_context(|| format!("GET {JOURNAL_PATH} on {}", self.agents[i].name))?;
        serde_json::from_slice(&body).context("parsing the journal")
    }

    /// Stops everything: controllers first (they release the Lease), then agents (they stop
    /// their HAProxy), then every process group still around; unmounts the tmpfs.
    pub(crate) async fn stop(mut self) {
        let mut stops = Vec::new();
        for slot in &mut self.controllers {
            if let Some(mut proc) = slot.proc.get_mut().take() {
                stops.push(tokio::spawn(async move {
                    proc.stop(Duration::from_secs(3)).await
                }));
            }
        }
        for stop in stops.drain(..) {
            let _ = stop.await;
        }
        for slot in &mut self.agents {
            if let Some(mut proc) = slot.proc.get_mut().take() {
                stops.push(tokio::spawn(async move {
                    proc.stop(Duration::from_secs(4)).await
                }));
            }
        }
        for stop in stops {
            let _ = stop.await;
        }
        self.groups.kill_all();
        for slot in &self.agents {
            if slot.tmpfs {
                unmount(&slot.data);
            }
        }
        self._cleanup.mounts.clear();
        self.server.shutdown().await;
    }
}

fn base64(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Size of an agent's tmpfs data directory: a few sets of the reference config fit.
pub(crate) const TMPFS_BYTES: u64 = 8 << 20;

/// Mounts a small tmpfs on `dir`; false when the machine does not allow it.
fn mount_tmpfs(dir: &Path) -> bool {
    std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={TMPFS_BYTES},mode=0700"),
        ])
        .arg("tmpfs")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub(crate) fn unmount(dir: &Path) {
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(dir)
        .stderr(Stdio::null())
        .status();
}
