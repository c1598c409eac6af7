//! The real-API-server side of the tests and the demo: a test's namespaces with
//! deploy/rbac.yaml's objects applied, the CRDs, HTTP backends in network namespaces (a real
//! API server refuses loopback EndpointSlice addresses), agents playing pods, and controllers
//! that run with the token of the ServiceAccount deploy/ binds. Works on both [`TestApi`]
//! backends.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use haptic_controller::{HAProxyTemplateConfig, HAProxyTemplateConfigSpec};
use haptic_testkit::{TestApi, TestPki};
use k8s_openapi::{
    api::{
        core::v1::{Pod, Secret, Service},
        discovery::v1::EndpointSlice,
        networking::v1::{Ingress, IngressClass},
        rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use super::{TOKEN, eventually, free_port, get, haproxy_bin, workspace_bin};

pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
pub static NEXT: AtomicU32 = AtomicU32::new(0);

/// The HTC's name, as `common` has it.
pub const HTC: &str = super::HTC;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// A test's world: the API server, an admin client, the controller's namespace (where
/// deploy/rbac.yaml's namespaced objects go) and the application namespace of the Ingresses.
pub struct Env {
    pub api: TestApi,
    pub admin: kube::Client,
    pub ns: String,
    pub apps: String,
    pub dir: tempfile::TempDir,
    /// The agent channel's throwaway PKI: agents serve mutual TLS with it, controllers present
    /// its client certificate.
    pub pki: TestPki,
}

impl Env {
    pub async fn start(api: TestApi, prefix: &str) -> Self {
        let admin = api.admin_client().await.expect("admin client");
        let ns = api.namespace(&format!("{prefix}-sys")).await.expect("ns");
        let apps = api.namespace(&format!("{prefix}-shop")).await.expect("ns");
        install_crds(&admin).await;
        install_ingress_class(&admin).await;
        if api.is_real() {
            install_rbac(&admin, &ns).await;
        }
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "haptic-agent-token", "namespace": ns},
            "data": {"token": super::base64(TOKEN)},
        }))
        .expect("secret");
        Api::<Secret>::namespaced(admin.clone(), &ns)
            .create(&PostParams::default(), &secret)
            .await
            .expect("token secret");
        let mut dir = tempfile::tempdir().expect("tempdir");
        if std::env::var_os("HAPTIC_TEST_KEEP").is_some() {
            dir.disable_cleanup(true);
            eprintln!("test data in {}", dir.path().display());
        }
        // The agents play pods at 127.0.0.2 and up (Agent::start).
        let ips: Vec<String> = (2..=16).map(|n| format!("127.0.0.{n}")).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        let pki = TestPki::generate(dir.path(), &ips).expect("test PKI");
        Self {
            api,
            admin,
            ns,
            apps,
            dir,
            pki,
        }
    }

    pub fn api<K>(&self, ns: &str) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.admin.clone(), ns)
    }

    /// The kubeconfig the controller runs with: the ServiceAccount deploy/rbac.yaml binds.
    pub async fn controller_kubeconfig(&self) -> PathBuf {
        self.api
            .service_account_kubeconfig(&self.ns, "haptic-controller")
            .await
            .expect("controller kubeconfig")
    }

    pub async fn apply_htc(&self, spec: &HAProxyTemplateConfigSpec) {
        let mut spec = spec.clone();
        // The reference store of the HAProxy pods watches the controller's namespace, where
        // deploy/rbac.yaml's Role lets it.
        if let Some(pods) = spec.watched_resources.get_mut("haproxy_pods") {
            pods.namespace = Some(self.ns.clone());
        }
        // So does the store of the backend pool's reserve, which the leader writes there
        // (`pool_keeper`, as `reference::spec_in` sets it).
        if let Some(pool) = spec.watched_resources.get_mut("backend_pool") {
            pool.namespace = Some(self.ns.clone());
        }
        if let Some(haproxy) = spec
            .templating_settings
            .extra_context
            .get_mut("haproxy")
            .and_then(|v| v.as_object_mut())
        {
            haproxy.insert(
                "backend_pool_reserve".into(),
                json!(format!(
                    "{}/{}",
                    self.ns,
                    haptic_controller::pool_keeper::DEFAULT_NAME
                )),
            );
        }
        let htc = HAProxyTemplateConfig::new(HTC, spec.clone());
        let api = self.api::<HAProxyTemplateConfig>(&self.ns);
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

    pub async fn htc_status(&self) -> Option<Value> {
        let htc = self
            .api::<HAProxyTemplateConfig>(&self.ns)
            .get(HTC)
            .await
            .ok()?;
        serde_json::to_value(htc.status?).ok()
    }

    /// A Service `name` in the apps namespace, port 80 to `backend`'s 80, and its EndpointSlice.
    pub async fn service(&self, name: &str, backend: &NetnsBackend) {
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": self.apps},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 80, "protocol": "TCP"}]},
        }))
        .expect("service");
        self.api::<Service>(&self.apps)
            .create(&PostParams::default(), &service)
            .await
            .expect("service created");
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-1"), "namespace": self.apps,
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
            "endpoints": [{"addresses": [backend.ip], "conditions": {"ready": true}}],
        }))
        .expect("slice");
        self.api::<EndpointSlice>(&self.apps)
            .create(&PostParams::default(), &slice)
            .await
            .expect("slice created (a real server refuses loopback addresses)");
    }

    pub async fn ingress(&self, name: &str, host: &str, service: &str) {
        let ingress: Ingress = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": self.apps},
            "spec": {"ingressClassName": super::CLASS, "rules": [{"host": host, "http": {"paths": [{
                "path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": service, "port": {"name": "http"}}},
            }]}}]},
        }))
        .expect("ingress");
        self.api::<Ingress>(&self.apps)
            .create(&PostParams::default(), &ingress)
            .await
            .expect("ingress created");
    }

    /// The first Event (events.k8s.io/v1) in `ns` about a `kind` with `reason`.
    pub async fn event(
        &self,
        ns: &str,
        kind: &str,
        reason: &str,
    ) -> k8s_openapi::api::events::v1::Event {
        let api = self.api::<k8s_openapi::api::events::v1::Event>(ns);
        eventually(
            &format!("an Event {reason} on a {kind} in {ns}"),
            Duration::from_secs(20),
            || async {
                let events = api.list(&Default::default()).await.ok()?;
                events.items.into_iter().find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some(kind)
                })
            },
        )
        .await
    }
}

/// The CRDs `haptic-controller crd` prints, created (idempotently: the real server is shared)
/// and awaited until Established.
/// The IngressClass `deploy/` ships (`haproxy`, ours): the Ingresses of [`Env::ingress`] name
/// it. Cluster-scoped, so tests that share a server create it once.
pub async fn install_ingress_class(admin: &kube::Client) {
    let class: IngressClass =
        serde_saphyr::from_str(include_str!("../../../deploy/ingressclass.yaml"))
            .expect("deploy/ingressclass.yaml");
    match Api::<IngressClass>::all(admin.clone())
        .create(&PostParams::default(), &class)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("IngressClass refused: {error}"),
    }
}

pub async fn install_crds(admin: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for crd in haptic_controller::crd::all_crds() {
        match crds.create(&PostParams::default(), &crd).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => panic!("CRD {:?} refused: {error}", crd.metadata.name),
        }
    }
    for crd in haptic_controller::crd::all_crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        eventually(
            &format!("CRD {name} Established"),
            Duration::from_secs(20),
            || async {
                let crd = crds.get(&name).await.ok()?;
                let conditions = crd.status?.conditions?;
                // The stand-in writes no CRD status: a CRD it holds is served at once.
                conditions
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            },
        )
        .await;
    }
}

/// deploy/rbac.yaml's objects, applied by the admin for a controller in `ns`: the namespaced
/// ones in `ns`, the cluster-wide ones named after `ns` (several tests share one server).
pub async fn install_rbac(admin: &kube::Client, ns: &str) {
    let text = std::fs::read_to_string(root().join("deploy/rbac.yaml")).expect("deploy/rbac.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple::<Value>(&text).expect("rbac.yaml parses");
    for mut doc in docs.into_iter().filter(|d| !d.is_null()) {
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        let cluster_wide = matches!(kind.as_str(), "ClusterRole" | "ClusterRoleBinding");
        if cluster_wide {
            let name = format!(
                "{}-{ns}",
                doc["metadata"]["name"].as_str().unwrap_or_default()
            );
            doc["metadata"]["name"] = json!(name);
        } else {
            doc["metadata"]["namespace"] = json!(ns);
        }
        if let Some(subjects) = doc["subjects"].as_array_mut() {
            for subject in subjects {
                subject["namespace"] = json!(ns);
            }
        }
        if kind == "ClusterRoleBinding" {
            let role = format!(
                "{}-{ns}",
                doc["roleRef"]["name"].as_str().unwrap_or_default()
            );
            doc["roleRef"]["name"] = json!(role);
        }
        let pp = PostParams::default();
        let result = match kind.as_str() {
            "ServiceAccount" => {
                Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), ns)
                    .create(&pp, &serde_json::from_value(doc).expect("ServiceAccount"))
                    .await
                    .map(drop)
            }
            "Role" => Api::<Role>::namespaced(admin.clone(), ns)
                .create(&pp, &serde_json::from_value(doc).expect("Role"))
                .await
                .map(drop),
            "RoleBinding" => Api::<RoleBinding>::namespaced(admin.clone(), ns)
                .create(&pp, &serde_json::from_value(doc).expect("RoleBinding"))
                .await
                .map(drop),
            "ClusterRole" => Api::<ClusterRole>::all(admin.clone())
                .create(&pp, &serde_json::from_value(doc).expect("ClusterRole"))
                .await
                .map(drop),
            "ClusterRoleBinding" => Api::<ClusterRoleBinding>::all(admin.clone())
                .create(
                    &pp,
                    &serde_json::from_value(doc).expect("ClusterRoleBinding"),
                )
                .await
                .map(drop),
            other => panic!("deploy/rbac.yaml has a {other} this test does not apply"),
        };
        result.unwrap_or_else(|e| panic!("applying deploy/rbac.yaml's {kind}: {e}"));
    }
}

/// An HTTP backend answering `backend NAME`: HAProxy in a network namespace of its own,
/// reached over a veth pair with a private address (10.x) that exists only there and on the
/// host end. Root only (`ip netns`).
pub struct NetnsBackend {
    pub netns: String,
    pub ip: String,
    pub child: Option<Child>,
}

impl NetnsBackend {
    pub async fn start(name: &str, dir: &Path) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id() % 10_000;
        let netns = format!("hx{pid}n{n}");
        let (host_if, peer_if) = (format!("hx{pid}h{n}"), format!("hx{pid}p{n}"));
        // 10.(200 + pid % 50).n.0/30: host end .1, backend .2.
        let net = format!("10.{}.{n}", 200 + pid % 50);
        let ip = format!("{net}.2");
        let run = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .expect("the `ip` tool runs (iproute2)");
            assert!(
                out.status.success(),
                "ip {}: {} (the routing tests need root for network namespaces)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["netns", "add", &netns]);
        let backend = Self {
            netns: netns.clone(),
            ip: ip.clone(),
            child: None,
        };
        run(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
        ]);
        run(&["link", "set", &peer_if, "netns", &netns]);
        run(&["addr", "add", &format!("{net}.1/30"), "dev", &host_if]);
        run(&["link", "set", &host_if, "up"]);
        run(&[
            "netns",
            "exec",
            &netns,
            "ip",
            "addr",
            "add",
            &format!("{ip}/30"),
            "dev",
            &peer_if,
        ]);
        run(&["netns", "exec", &netns, "ip", "link", "set", &peer_if, "up"]);
        run(&["netns", "exec", &netns, "ip", "link", "set", "lo", "up"]);
        let cfg = dir.join(format!("backend-{name}.cfg"));
        std::fs::write(
            &cfg,
            format!(
                "defaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\
                 frontend web\n  bind {ip}:80\n  http-request return status 200 content-type text/plain string \"backend {name}\"\n"
            ),
        )
        .expect("backend config");
        let child = Command::new("ip")
            .args(["netns", "exec", &netns])
            .arg(haproxy_bin())
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("backend HAProxy starts");
        let mut backend = backend;
        backend.child = Some(child);
        let addr = format!("{ip}:80");
        eventually(
            &format!("backend {name} answers on {addr}"),
            Duration::from_secs(10),
            || async {
                let (status, body) = get(&addr, "any", "/").await?;
                (status == 200 && body.contains(name)).then_some(())
            },
        )
        .await;
        backend
    }
}

impl Drop for NetnsBackend {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.start_kill();
        }
        // Deleting the namespace deletes the veth pair with it.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
    }
}

/// The agent with supervised HAProxy, playing pod `haproxy-N` at 127.0.0.(N+1) in `env.ns`.
pub struct Agent {
    pub name: String,
    pub ip: String,
    pub http_port: u16,
    pub child: Option<Child>,
}

impl Agent {
    pub async fn start(env: &Env, index: u8, agent_port: u16, http_port: u16) -> Self {
        let name = format!("haproxy-{index}");
        let ip = format!("127.0.0.{}", index + 1);
        let dir = env.dir.path().join(&name);
        std::fs::create_dir_all(&dir).expect("agent dir");
        std::fs::write(dir.join("token"), TOKEN).expect("token file");
        let log = std::fs::File::create(dir.join("agent.log")).expect("agent log");
        let child = Command::new(workspace_bin("haptic-agent"))
            .arg("--listen")
            .arg(format!("{ip}:{agent_port}"))
            .arg("--token-file")
            .arg(dir.join("token"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--haproxy")
            .arg(haproxy_bin())
            .arg("--supervise")
            .arg("--drain-seconds")
            .arg("1")
            .args(env.pki.agent_args())
            .env("POD_IP", &ip)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("agent starts");
        let agent = Self {
            name,
            ip,
            http_port,
            child: Some(child),
        };
        let addr = format!("{}:{agent_port}", agent.ip);
        eventually("the agent listens", Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(&addr).await.ok().map(drop)
        })
        .await;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": agent.name, "namespace": env.ns, "labels": {"app": "haproxy"}},
            "spec": {"containers": [{"name": "haproxy", "image": "haproxy"}, {"name": "haptic-agent", "image": "haptic-agent"}]},
        }))
        .expect("pod");
        let pods = env.api::<Pod>(&env.ns);
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("pod created");
        let status = json!({"status": {
            "phase": "Running",
            "podIP": agent.ip,
            "podIPs": [{"ip": agent.ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": "haproxy", "ready": true, "restartCount": 0, "image": "haproxy", "imageID": ""},
                {"name": "haptic-agent", "ready": true, "restartCount": 0, "image": "haptic-agent", "imageID": ""},
            ],
        }});
        pods.patch_status(&agent.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .expect("pod status");
        agent
    }

    /// Waits until a GET through this pod's HAProxy answers `want` (status, body part).
    pub async fn await_route(&self, host: &str, want: (u16, &str)) {
        let addr = format!("{}:{}", self.ip, self.http_port);
        eventually(
            &format!("{} routes {host} to {want:?}", self.name),
            Duration::from_secs(30),
            || async {
                let got = get(&addr, host, "/").await?;
                (got.0 == want.0 && got.1.contains(want.1)).then_some(())
            },
        )
        .await;
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child
            && let Some(pid) = child.id()
        {
            // The agent stops its HAProxy on SIGTERM; a kill -9 would orphan it.
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            for _ in 0..100 {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.start_kill();
        }
    }
}

/// The controller binary as replica `name`, with the ServiceAccount's kubeconfig.
pub struct Controller {
    pub name: String,
    pub log: PathBuf,
    pub health: u16,
    pub child: Child,
}

impl Controller {
    pub async fn start(env: &Env, name: &str, extra_env: &[(&str, String)]) -> Self {
        let kubeconfig = env.controller_kubeconfig().await;
        let log = env.dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let health = free_port();
        let child = Command::new(workspace_bin("haptic-controller"))
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--pod-name")
            .arg(name)
            .arg("--namespace")
            .arg(&env.ns)
            .arg("--health-addr")
            .arg(format!("127.0.0.1:{health}"))
            .arg("--haproxy")
            .arg(haproxy_bin())
            .args(env.pki.controller_args())
            .env("RUST_LOG", "info,haptic_controller=debug")
            .envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())))
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

    pub async fn ready(&self) {
        let addr = format!("127.0.0.1:{}", self.health);
        eventually(
            &format!("{} ready", self.name),
            Duration::from_secs(30),
            || async { (get(&addr, "localhost", "/readyz").await?.0 == 200).then_some(()) },
        )
        .await;
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM: the controller stops leader-only work, releases the Lease and exits.
    pub fn terminate(&self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
    }

    pub async fn kill9(&mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// The reference config for this machine, with the HAProxy Service `ns/haproxy` named (so
/// Ingress status is declared).
pub fn lb_spec(env: &Env, agent_port: u16, http_port: u16) -> HAProxyTemplateConfigSpec {
    let mut spec = super::spec(agent_port, http_port);
    spec.templating_settings
        .extra_context
        .get_mut("haproxy")
        .expect("tunables")["service"] = json!(format!("{}/haproxy", env.ns));
    spec
}

/// Any `Forbidden` the API server answered the controller, from its log.
pub fn forbidden(logs: &str) -> Vec<&str> {
    logs.lines()
        .filter(|l| l.to_ascii_lowercase().contains("forbidden"))
        .collect()
}
