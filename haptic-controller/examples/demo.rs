//! `cargo xtask demo`: the whole system on one machine, with no cluster.
//!
//! The haptic-testkit API server (in this process), the CRD and the HAProxyTemplateConfig that
//! `deploy/` ships (the reference Ingress templates; made to bind each pod's own loopback
//! address, with short Lease timings), two controller replicas and two agents with supervised HAProxy (child
//! processes, each agent playing a pod on its own loopback address), and a demo app: two small
//! HTTP backends with their Services, EndpointSlices and Ingresses for two hosts, one of them
//! with TLS from a generated Secret. It prints what runs and what to try, and keeps the process
//! table up to date; Ctrl-C (or SIGTERM) stops everything and removes its temporary data.
//!
//! Gateway API: once the Gateway API CRDs are served (installed by the user, or by the demo
//! from `--gateway-api-crds <file>`, e.g. the standard-install.yaml of Gateway API v1.5.1), the
//! demo creates the GatewayClass `haptic` (controller `haproxy-haptic.org/gateway-controller`),
//! the Gateway `default/demo` whose HTTP listener shares the Ingress frontend's port, and the
//! HTTPRoute `default/gw-shop` (gw.demo.example to the shop).
//!
//! `--real` runs it on a real kube-apiserver with etcd instead (`real.rs`).
//!
//! `--smoke` checks every printed claim by itself (the shop routes, plain HTTP to the blog is
//! redirected to HTTPS, TLS serves the Secret's certificate, a newly applied Ingress routes, one
//! of another controller's class is left alone, killing the leader hands over and a later
//! change still routes), then stops and exits 0 or 1.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "demo/real.rs"]
mod real;

use std::{net::SocketAddr, process::ExitCode, time::Duration};

use common::*;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::json;

const HOSTS: [(&str, &str); 2] = [("shop.demo.example", "shop"), ("blog.demo.example", "blog")];

struct Demo {
    cluster: Cluster,
    agents: Vec<Agent>,
    controllers: Vec<Controller>,
    _backends: Vec<Backend>,
    kubeconfig: std::path::PathBuf,
    ca_pem: String,
    leaf_der: Vec<u8>,
}

async fn start() -> Demo {
    let cluster = Cluster::start().await;
    let kubeconfig = cluster.server.kubeconfig_for("admin").expect("kubeconfig");
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    // The HTC `deploy/` ships, made to run on loopback.
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/haptic-config.yaml");
    let text = std::fs::read_to_string(shipped).expect("deploy/haptic-config.yaml");
    let htc: haptic_controller::HAProxyTemplateConfig =
        serde_saphyr::from_str(&text).expect("deploy/haptic-config.yaml is an HTC");
    cluster
        .apply_htc(&local(htc.spec, agent_port, http_port))
        .await;
    let mut agents = Vec::new();
    for i in 1..=2 {
        agents.push(Agent::start(&cluster, i, agent_port, http_port).await);
    }
    let mut backends = Vec::new();
    for (host, app) in HOSTS {
        let backend = Backend::start(app).await;
        cluster.service(app, backend.addr).await;
        cluster.ingress(app, host, "/", app).await;
        backends.push(backend);
    }
    // TLS for the blog: a CA and a certificate for its host, in a kubernetes.io/tls Secret.
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec![HOSTS[1].0.to_owned()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("leaf");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "blog-tls", "namespace": NS},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": base64(leaf.pem()), "tls.key": base64(key.serialize_pem())},
    }))
    .expect("secret");
    cluster
        .api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await
        .expect("tls secret");
    let mut ingress = ingress("blog", HOSTS[1].0, "/", "blog");
    if let Some(spec) = ingress.spec.as_mut() {
        spec.tls = Some(vec![k8s_openapi::api::networking::v1::IngressTLS {
            hosts: Some(vec![HOSTS[1].0.to_owned()]),
            secret_name: Some("blog-tls".to_owned()),
        }]);
    }
    cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .replace("blog", &PostParams::default(), &{
            let mut current = cluster
                .api::<k8s_openapi::api::networking::v1::Ingress>()
                .get("blog")
                .await
                .expect("blog ingress");
            current.spec = ingress.spec;
            current
        })
        .await
        .expect("blog tls");
    let controllers = vec![
        Controller::start(&cluster, "controller-1").await,
        Controller::start(&cluster, "controller-2").await,
    ];
    Demo {
        cluster,
        agents,
        controllers,
        _backends: backends,
        kubeconfig,
        ca_pem: ca.pem(),
        leaf_der: leaf.der().to_vec(),
    }
}

impl Demo {
    fn https_addr(&self) -> SocketAddr {
        let agent = &self.agents[0];
        format!("{}:{}", agent.ip, agent.http_port + 1)
            .parse()
            .expect("addr")
    }

    async fn table(&self) -> String {
        let leader = self.cluster.leader().await;
        let epoch = self.cluster.lease_epoch().await.unwrap_or(0);
        let mut out = String::new();
        for c in &self.controllers {
            let role = if leader.as_deref() == Some(&c.name) {
                format!("leader epoch {epoch}")
            } else {
                "follower".to_owned()
            };
            out.push_str(&format!("  {} pid {} {role}\n", c.name, c.pid()));
        }
        for a in &self.agents {
            let live = a
                .state()
                .await
                .and_then(|s| s.live_checksum)
                .map_or("nothing live".to_owned(), |c| {
                    format!("live sha256:{}", c.chars().take(12).collect::<String>())
                });
            out.push_str(&format!(
                "  {}-agent at {} ({live})\n",
                a.name,
                a.agent_addr()
            ));
        }
        out
    }

    fn guide(&self) -> String {
        let a = &self.agents[0];
        let k = self.kubeconfig.display();
        let (shop, blog) = (HOSTS[0].0, HOSTS[1].0);
        let https = self.https_addr();
        format!(
            "HAPTIC demo on the haptic-testkit API server\n\
             kubeconfig: {k}\n\
             HAProxy (pod haproxy-1): http://{http}  https://{https}   (pod haproxy-2: {ip2})\n\n\
             Try:\n\
             \x20 curl -H 'Host: {shop}' http://{http}/\n\
             \x20 curl --resolve {blog}:{hp}:{ip} -k https://{blog}:{hp}/\n\
             \x20 kubectl --kubeconfig {k} apply -f - <<'EOF'\n\
             apiVersion: networking.k8s.io/v1\n\
             kind: Ingress\n\
             metadata: {{name: new, namespace: default}}\n\
             spec:\n\
             \x20 ingressClassName: haproxy\n\
             \x20 rules:\n\
             \x20 - host: new.demo.example\n\
             \x20   http: {{paths: [{{path: /, pathType: Prefix, backend: {{service: {{name: shop, port: {{name: http}}}}}}}}]}}\n\
             EOF\n\
             \x20 curl -H 'Host: new.demo.example' http://{http}/\n\
             \x20 # the same with ingressClassName: nginx (another controller's class) is left alone: 404\n\
             \x20 kill <the leader's pid below>   # the other replica takes over; the demo restarts the killed one\n\
             \x20 # Gateway API: install its CRDs (or start with --gateway-api-crds <standard-install.yaml>);\n\
             \x20 # the demo then creates a GatewayClass, a Gateway and an HTTPRoute (docs/gateway-api.md)\n\n\
             Stop: Ctrl-C, or kill {demo} (the demo's pid): everything stops and its files are removed.\n",
            demo = std::process::id(),
            http = a.http_addr(),
            ip = a.ip,
            hp = https.port(),
            ip2 = self.agents[1].http_addr(),
        )
    }

    /// Installs the CRDs of `file` (multi-document YAML), if given; then, once the Gateway API
    /// is served, creates the demo's GatewayClass, Gateway and HTTPRoute. Runs until done.
    async fn gateway_api(client: kube::Client, http_port: u16, crds: Option<String>) {
        use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
        let resource = |group: &str, version: &str, kind: &str, plural: &str| {
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
        };
        if let Some(file) = crds {
            let crd = resource(
                "apiextensions.k8s.io",
                "v1",
                "CustomResourceDefinition",
                "customresourcedefinitions",
            );
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &crd);
            let docs: Vec<serde_json::Value> = match std::fs::read_to_string(&file)
                .map_err(|e| e.to_string())
                .and_then(|text| serde_saphyr::from_multiple(&text).map_err(|e| e.to_string()))
            {
                Ok(docs) => docs,
                Err(error) => {
                    eprintln!("demo: the Gateway API CRDs of {file}: {error}");
                    return;
                }
            };
            for doc in docs
                .into_iter()
                .filter(|d| d["kind"] == "CustomResourceDefinition")
            {
                let Ok(object) = serde_json::from_value::<DynamicObject>(doc) else {
                    continue;
                };
                if let Err(error) = api.create(&PostParams::default(), &object).await {
                    eprintln!("demo: creating a Gateway API CRD: {error}");
                }
            }
        }
        let gv = kube::core::GroupVersion::gv("gateway.networking.k8s.io", "v1");
        while !kube::discovery::pinned_group(&client, &gv)
            .await
            .map(|g| {
                g.versioned_resources("v1")
                    .iter()
                    .any(|(ar, _)| ar.plural == "httproutes")
            })
            .unwrap_or(false)
        {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let objects = [
            (
                resource(
                    "gateway.networking.k8s.io",
                    "v1",
                    "GatewayClass",
                    "gatewayclasses",
                ),
                None,
                json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                    "metadata": {"name": "haptic"},
                    "spec": {"controllerName": "haproxy-haptic.org/gateway-controller"}}),
            ),
            (
                resource("gateway.networking.k8s.io", "v1", "Gateway", "gateways"),
                Some(NS),
                json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                    "metadata": {"name": "demo", "namespace": NS},
                    "spec": {"gatewayClassName": "haptic", "listeners": [
                        {"name": "http", "protocol": "HTTP", "port": http_port}]}}),
            ),
            (
                resource("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
                Some(NS),
                json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                    "metadata": {"name": "gw-shop", "namespace": NS},
                    "spec": {"parentRefs": [{"name": "demo"}], "hostnames": ["gw.demo.example"],
                        "rules": [{"backendRefs": [{"name": "shop", "port": 80}]}]}}),
            ),
        ];
        for (ar, namespace, value) in objects {
            let api: Api<DynamicObject> = match namespace {
                Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
                None => Api::all_with(client.clone(), &ar),
            };
            let Ok(object) = serde_json::from_value::<DynamicObject>(value) else {
                continue;
            };
            if let Err(error) = api.create(&PostParams::default(), &object).await {
                eprintln!(
                    "demo: creating the {} of the Gateway API demo: {error}",
                    ar.kind
                );
            }
        }
        println!(
            "Gateway API: GatewayClass haptic, Gateway {NS}/demo (HTTP on the Ingress port) and HTTPRoute {NS}/gw-shop created; try\n  curl -H 'Host: gw.demo.example' http://127.0.0.2:{http_port}/"
        );
    }

    async fn stop(self) {
        for mut c in self.controllers {
            c.signal("TERM");
            let _ =
                tokio::time::timeout(Duration::from_secs(25), c.exited(Duration::from_secs(25)))
                    .await;
        }
        drop(self.agents);
        self.cluster.server.shutdown().await;
        // The cluster's temporary directory goes with it.
    }
}

async fn https_get(demo: &Demo, host: &str) -> Result<(String, Vec<u8>), String> {
    let ca = reqwest::Certificate::from_pem(demo.ca_pem.as_bytes()).map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder()
        .tls_backend_rustls()
        .tls_certs_only([ca])
        .tls_info(true)
        .resolve(host, demo.https_addr())
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let response = client
        .get(format!("https://{host}:{}/", demo.https_addr().port()))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let der = response
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|i| i.peer_certificate())
        .map(<[u8]>::to_vec)
        .unwrap_or_default();
    let body = response.text().await.map_err(|e| e.to_string())?;
    Ok((body, der))
}

async fn check(name: &str, ok: bool, failures: &mut Vec<String>) {
    println!("{} {name}", if ok { "ok  " } else { "FAIL" });
    if !ok {
        failures.push(name.to_owned());
    }
}

async fn within<F: std::future::Future<Output = bool>>(
    bound: Duration,
    mut f: impl FnMut() -> F,
) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn routes(agent: &Agent, host: &str, want: &str) -> bool {
    answers(agent, host, 200, want).await
}

/// Whether a plain HTTP GET of `host` / through `agent` gets `status` and a body containing
/// `want`, within a bound.
async fn answers(agent: &Agent, host: &str, status: u16, want: &str) -> bool {
    within(Duration::from_secs(30), || async {
        get(&agent.http_addr(), host, "/")
            .await
            .is_some_and(|(s, b)| s == status && b.contains(want))
    })
    .await
}

async fn smoke(demo: &mut Demo) -> Vec<String> {
    let mut failures = Vec::new();
    for agent in &demo.agents {
        let (host, app) = HOSTS[0];
        let ok = routes(agent, host, &format!("backend {app}")).await;
        check(
            &format!("{host} routes to {app} through {}", agent.name),
            ok,
            &mut failures,
        )
        .await;
        // The blog has TLS: plain HTTP is redirected to HTTPS.
        let (host, _) = HOSTS[1];
        let ok = answers(agent, host, 308, "").await;
        check(
            &format!(
                "plain HTTP to {host} is redirected to HTTPS (308) through {}",
                agent.name
            ),
            ok,
            &mut failures,
        )
        .await;
    }
    let tls = within(Duration::from_secs(30), || async {
        https_get(demo, HOSTS[1].0)
            .await
            .is_ok_and(|(body, der)| body.contains("backend blog") && der == demo.leaf_der)
    })
    .await;
    check(
        "https serves the blog-tls Secret's certificate",
        tls,
        &mut failures,
    )
    .await;
    demo.cluster
        .ingress("new", "new.demo.example", "/", "shop")
        .await;
    let ok = routes(&demo.agents[1], "new.demo.example", "backend shop").await;
    check("a newly applied Ingress routes", ok, &mut failures).await;
    // An Ingress of another controller's class is left alone: never routed (the shop route
    // applied after it shows the config it was left out of is live).
    let mut theirs = ingress("theirs", "theirs.demo.example", "/", "shop");
    if let Some(spec) = theirs.spec.as_mut() {
        spec.ingress_class_name = Some("nginx".to_owned());
    }
    let applied = demo
        .cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .create(&PostParams::default(), &theirs)
        .await
        .is_ok();
    demo.cluster
        .ingress("after-theirs", "after.demo.example", "/", "shop")
        .await;
    let ok = applied
        && routes(&demo.agents[0], "after.demo.example", "backend shop").await
        && answers(&demo.agents[0], "theirs.demo.example", 404, "no route").await;
    check(
        "an Ingress of another class (nginx) is left alone: 404",
        ok,
        &mut failures,
    )
    .await;
    let leader = demo.cluster.leader().await.unwrap_or_default();
    let index = demo.controllers.iter().position(|c| c.name == leader);
    let handed = match index {
        Some(i) => {
            demo.controllers[i].signal("KILL");
            within(Duration::from_secs(30), || async {
                demo.cluster.leader().await.is_some_and(|l| l != leader)
            })
            .await
        }
        None => false,
    };
    check(
        "killing the leader hands over to the other replica",
        handed,
        &mut failures,
    )
    .await;
    demo.cluster
        .ingress("later", "later.demo.example", "/", "blog")
        .await;
    let mut ok = true;
    for agent in &demo.agents {
        ok &= routes(agent, "later.demo.example", "backend blog").await;
    }
    check(
        "a change after the handover still routes",
        ok,
        &mut failures,
    )
    .await;
    failures
}

async fn interactive(demo: &mut Demo) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    println!("{}", demo.guide());
    let mut shown = String::new();
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        // A replica the user killed comes back as a follower.
        for i in 0..demo.controllers.len() {
            if let Ok(Some(status)) = demo.controllers[i].try_wait() {
                let name = demo.controllers[i].name.clone();
                println!("{name} exited ({status}); restarting it");
                demo.controllers[i] = Controller::start(&demo.cluster, &name).await;
            }
        }
        let table = demo.table().await;
        if table != shown {
            println!("processes:\n{table}");
            shown = table;
        }
    }
    println!("stopping: controllers (they release the Lease), agents and HAProxy, the API server");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let smoke_mode = std::env::args().any(|a| a == "--smoke");
    if std::env::args().any(|a| a == "--real") {
        return real::run(smoke_mode).await;
    }
    let mut demo = start().await;
    let crds = std::env::args()
        .skip_while(|a| a != "--gateway-api-crds")
        .nth(1);
    // Owned by the demo: aborted when it stops.
    let gateway_api = tokio::spawn(Demo::gateway_api(
        demo.cluster.client.clone(),
        demo.agents[0].http_port,
        crds,
    ));
    let code = if smoke_mode {
        let failures = smoke(&mut demo).await;
        if failures.is_empty() {
            println!("demo smoke: all checks passed");
            ExitCode::SUCCESS
        } else {
            println!(
                "demo smoke: {} check(s) failed: {}",
                failures.len(),
                failures.join("; ")
            );
            for c in &demo.controllers {
                eprintln!("--- {} log (tail)\n{}", c.name, tail(&c.logs(), 40));
            }
            ExitCode::FAILURE
        }
    } else {
        interactive(&mut demo).await;
        ExitCode::SUCCESS
    };
    gateway_api.abort();
    demo.stop().await;
    code
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
