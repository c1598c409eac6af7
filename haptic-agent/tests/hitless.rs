//! Hitless updates end to end: sets rendered by haptic-render's reference templates (server
//! slots) from Ingresses, Services, EndpointSlices and TLS Secrets, applied to a supervised
//! agent with the real HAProxy, and checked with real traffic: endpoint, map and certificate
//! changes go through the runtime API with no reload; anything else reloads; a runtime
//! change that fails falls back to the reload and ends in the right live state.

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use base64::Engine as _;
use common::*;
use haptic_agent::store::TREE_MIN_FILES;
use haptic_agent_client::{AgentClient, Error, FileSet, Outcome};
use haptic_render::{Renderer, Stores, functions::ssl_file, reference};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use reqwest::Url;
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject as _};
use serde_json::{Value as Json, json};
use tokio::{net::TcpListener, task::JoinHandle};

/// A small HTTP backend on `ip:port` answering `backend <ip>`.
struct Endpoint {
    task: JoinHandle<()>,
}

impl Endpoint {
    async fn start(ip: &str, port: u16) -> Self {
        let listener = TcpListener::bind((ip, port)).await.expect("bind endpoint");
        let body = format!("backend {ip}");
        let app = axum::Router::new().fallback(move || {
            let body = body.clone();
            async move { body }
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { task }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A CA, and a certificate and key for `host` signed by it: (CA PEM, cert PEM, key PEM).
fn issue(host: &str) -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec![host.to_owned()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("cert");
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// The resources a controller would watch, rendered by the reference templates.
struct Cluster {
    renderer: Renderer,
    /// `extraContext.haproxy`.
    context: Json,
    stores: Stores,
    /// The port every endpoint of Service `web` listens on (on its own loopback address).
    endpoint_port: u16,
}

const NS: &str = "shop";

impl Cluster {
    fn new(http: u16, https: u16, endpoint_port: u16, slots: u64) -> Self {
        let mut set = reference::template_set();
        let context = json!({"maxconn": 1000, "bind_address": "127.0.0.1", "http_port": http,
            "https_port": https, "timeout_connect": "1s", "timeout_client": "10s",
            "timeout_server": "10s", "stats_socket": null, "route_debug": false,
            "server_slots": slots,
            // The TLS host is probed over plain HTTP too.
            "ssl_redirect": false});
        set.extra_context.insert("haproxy".into(), context.clone());
        let renderer = Renderer::compile(&set).expect("compile the reference set");
        let mut cluster = Self {
            renderer,
            context,
            stores: reference::stores().expect("stores"),
            endpoint_port,
        };
        // The Ingresses below have no class: ours through a default IngressClass of ours.
        cluster.apply(
            "ingressclasses",
            haptic_render::fixtures::ingress_class("haptic", true),
        );
        for service in ["web", "api"] {
            cluster.apply(
                "services",
                json!({"metadata": {"namespace": NS, "name": service},
                    "spec": {"ports": [{"name": "http", "port": 80}]}}),
            );
        }
        cluster
    }

    /// The same cluster rendered with the pool of spare backends growing in steps of `step`
    /// (`extraContext.haproxy.backend_pool_step`).
    fn with_pool_step(mut self, step: u64) -> Self {
        let mut set = reference::template_set();
        let mut haproxy = self.context.clone();
        haproxy["backend_pool_step"] = json!(step);
        set.extra_context.insert("haproxy".into(), haproxy);
        self.renderer = Renderer::compile(&set).expect("compile the reference set");
        self
    }

    fn apply(&mut self, store: &str, resource: Json) {
        self.stores
            .get_mut(store)
            .expect("store")
            .apply(&resource)
            .expect("resource");
    }

    fn remove(&mut self, store: &str, name: &str) {
        self.stores.get_mut(store).expect("store").remove(NS, name);
    }

    /// Service `service`'s endpoints: `(ip, ready)`.
    fn endpoints(&mut self, service: &str, endpoints: &[(&str, bool)]) {
        let endpoints: Vec<Json> = endpoints
            .iter()
            .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready}}))
            .collect();
        let port = self.endpoint_port;
        self.apply(
            "endpointslices",
            json!({"metadata": {"namespace": NS, "name": format!("{service}-1"),
                    "labels": {"kubernetes.io/service-name": service}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": port}],
                "endpoints": endpoints}),
        );
    }

    /// Ingress `name`: `host` to Service `service`, with TLS from Secret `tls` if given.
    fn ingress(&mut self, name: &str, host: &str, service: &str, tls: Option<&str>) {
        let mut spec = json!({"rules": [{"host": host, "http": {"paths": [{"path": "/",
            "pathType": "Prefix",
            "backend": {"service": {"name": service, "port": {"number": 80}}}}]}}]});
        if let Some(secret) = tls {
            spec["tls"] = json!([{"hosts": [host], "secretName": secret}]);
        }
        self.apply(
            "ingresses",
            json!({"metadata": {"namespace": NS, "name": name}, "spec": spec}),
        );
    }

    fn secret(&mut self, name: &str, cert: &str, key: &str) {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        self.apply(
            "secrets",
            json!({"metadata": {"namespace": NS, "name": name}, "type": "kubernetes.io/tls",
                "data": {"tls.crt": b64(cert), "tls.key": b64(key)}}),
        );
    }

    fn render(&self) -> FileSet {
        self.render_replacing(None)
    }

    /// The render with one file's content replaced (what a template or a certificate the
    /// renderer's checks let through would write).
    fn render_replacing(&self, replace: Option<(&str, &str)>) -> FileSet {
        let rendered = self.renderer.render(&self.stores).expect("render");
        let mut files = FileSet::new();
        for (path, content) in rendered.iter() {
            let content = match replace {
                Some((replaced, with)) if replaced == path => with.as_bytes().to_vec(),
                _ => content.to_vec(),
            };
            files.insert(path, content).expect("path");
        }
        files
    }
}

/// Applies the cluster's current render at generation `generation` and returns the report.
async fn apply(
    client: &AgentClient,
    url: &Url,
    cluster: &Cluster,
    generation: u64,
) -> Result<haptic_agent_client::ApplyReport, Error> {
    client
        .apply(url, &request(1, "leader-0", generation, cluster.render()))
        .await
}

/// One GET through HAProxy with Host `host`: the body, or the error.
async fn get(http: &reqwest::Client, port: u16, host: &str) -> Result<String, String> {
    let response = http
        .get(format!("http://127.0.0.1:{port}/"))
        .header("host", host)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response.text().await.map_err(|e| e.to_string())?;
    if status.is_success() {
        Ok(body)
    } else {
        Err(format!("{status}: {body}"))
    }
}

/// GETs until the body is `want` (bounded); the last answer.
async fn await_get(port: u16, host: &str, want: &str) -> Result<String, String> {
    let http = traffic_client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = get(&http, port, host).await;
        if got.as_deref() == Ok(want) || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TLS handshake with SNI `host` on `port`, trusting only `ca`: whether it succeeds says
/// which certificate HAProxy serves.
async fn handshake(port: u16, host: &str, ca: &str) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    tokio::time::timeout(Duration::from_secs(5), connector.connect(name, tcp))
        .await
        .map_err(|_| "handshake timed out".to_owned())?
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The sets left in the agent's staging directory.
fn staged(data: &std::path::Path) -> Vec<String> {
    match std::fs::read_dir(data.join("staging")) {
        Ok(entries) => entries
            .map(|entry| {
                entry
                    .expect("staging entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => panic!("reading the staging directory: {error}"),
    }
}

async fn worker_pids(client: &AgentClient, url: &Url) -> Vec<u32> {
    client.state(url).await.expect("state").worker_pids
}

/// Endpoints on 127.0.0.2 ..= 127.0.0.`last`, all on one port.
async fn endpoints(last: u8) -> (u16, Vec<Endpoint>) {
    let port = free_port();
    let mut running = Vec::new();
    for n in 2..=last {
        running.push(Endpoint::start(&format!("127.0.0.{n}"), port).await);
    }
    (port, running)
}

/// A TLS Secret no Ingress uses is a file HAProxy does not read; a new TLS host is that
/// certificate loaded and a crt-list line added at run time; an Ingress that goes takes its
/// line and its certificate with it: no reload in any of them, and each host's handshake says
/// what HAProxy serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_hosts_come_and_go_with_no_reload() {
    let (endpoint_port, _endpoints) = endpoints(3).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 2);
    let (web_ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    cluster.ingress("web", "web.test", "web", Some("web-tls"));
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    cluster.endpoints("api", &[("127.0.0.3", true)]);
    // Enough TLS Secrets in the bucket of api.test's (`ssl/<bucket>/`, added below) for that
    // directory to be a tree of the agent's store (shared by the sets whose certificates in it
    // did not change).
    let bucket = |name: &str| {
        let path = ssl_file(NS, name);
        path.rsplit_once('/').expect("in a bucket").0.to_owned()
    };
    let cert_dir = bucket("api-tls");
    let spares: Vec<String> = (0..)
        .map(|i| format!("spare-{i}"))
        .filter(|name| bucket(name) == cert_dir)
        .take(TREE_MIN_FILES)
        .collect();
    for spare in &spares {
        cluster.secret(spare, &cert, &key);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test over TLS");
    // The live set's bucket of spare certificates, a tree: where its link points.
    let tree = || {
        std::fs::read_link(agent.data.join("current").join(&cert_dir))
            .expect("the certificates are a tree")
    };
    let first_tree = tree();
    let workers = worker_pids(&client, &agent.url).await;
    let set_files = |cluster: &Cluster| {
        cluster
            .render()
            .iter()
            .map(|(path, _)| path.to_owned())
            .collect::<Vec<_>>()
    };
    let before = set_files(&cluster);

    // A Secret alone: its file is added, and HAProxy has nothing to load.
    let (api_ca, cert, key) = issue("api.test");
    cluster.secret("api-tls", &cert, &key);
    assert_eq!(
        set_files(&cluster).len(),
        before.len() + 1,
        "the Secret's file"
    );
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("a Secret");
    assert!(!report.reload && report.runtime_ops == 0, "{report:?}");
    assert!(handshake(https_port, "api.test", &api_ca).await.is_err());
    let second_tree = tree();
    assert_ne!(second_tree, first_tree, "a file more: a new tree");

    // The Ingress that uses it: its certificate and crt-list line, at run time.
    cluster.ingress("api", "api.test", "api", Some("api-tls"));
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("a TLS host");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert_eq!(tree(), second_tree, "no certificate changed: the same tree");
    handshake(https_port, "api.test", &api_ca)
        .await
        .expect("api.test served with its own certificate");
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test still");
    assert_eq!(
        get(&traffic_client(), http_port, "api.test").await,
        Ok("backend 127.0.0.3".to_owned())
    );

    // The Ingress and its Secret go: the line, the certificate and the file.
    cluster.remove("ingresses", "api");
    cluster.remove("secrets", "api-tls");
    assert_eq!(set_files(&cluster), before);
    let report = apply(&client, &agent.url, &cluster, 4)
        .await
        .expect("a TLS host gone");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert!(handshake(https_port, "api.test", &api_ca).await.is_err());
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test still");
    assert_eq!(worker_pids(&client, &agent.url).await, workers, "a reload");

    // The live set is the rendered one, on disk too.
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(cluster.render().checksum().as_str())
    );

    // A change that needs a reload (a backend HAProxy cannot add at run time) links what the
    // live set holds as it is: the bucket's tree is the live set's, the other certificate
    // file the live set's very file (one inode), and every certificate still served.
    let web_file = agent.data.join("current").join(ssl_file(NS, "web-tls"));
    let inode = |path: &std::path::Path| {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(path).expect("the certificate file").ino()
    };
    let web_inode = inode(&web_file);
    let shared_tree = tree();
    let h2c_service = |cluster: &mut Cluster, name: &str| {
        cluster.apply(
            "services",
            json!({"metadata": {"namespace": NS, "name": name},
                "spec": {"ports": [{"name": "http", "port": 80, "appProtocol": "kubernetes.io/h2c"}]}}),
        );
        cluster.endpoints(name, &[("127.0.0.2", true)]);
        cluster.ingress(name, &format!("{name}.test"), name, None);
    };
    h2c_service(&mut cluster, "grpc");
    let report = apply(&client, &agent.url, &cluster, 5)
        .await
        .expect("a new kind of backend");
    assert!(report.reload, "{report:?}");
    assert_ne!(worker_pids(&client, &agent.url).await, workers);
    assert_eq!(
        tree(),
        shared_tree,
        "the reload wrote the unchanged bucket again"
    );
    assert_eq!(
        inode(&web_file),
        web_inode,
        "the reload wrote web.test's certificate again"
    );
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test after the reload");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(cluster.render().checksum().as_str())
    );

    // A live set changed on disk behind the agent's back (a file replaced) is no base to link
    // from: the next reload writes the set whole, the file as the request has it.
    let rendered = cluster.render();
    let want = rendered
        .get(&ssl_file(NS, "web-tls"))
        .expect("web.test's certificate")
        .clone();
    let replaced = web_file.with_extension("drift");
    std::fs::write(&replaced, b"drifted").expect("a replacement");
    std::fs::rename(&replaced, &web_file).expect("replaced");
    h2c_service(&mut cluster, "grpc2");
    let report = apply(&client, &agent.url, &cluster, 6)
        .await
        .expect("another new kind of backend");
    assert!(report.reload, "{report:?}");
    assert_eq!(
        std::fs::read(&web_file).expect("the certificate file"),
        want.to_vec(),
        "a drifted file was linked into the new set"
    );
    assert_ne!(inode(&web_file), web_inode);
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test after the drift");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(cluster.render().checksum().as_str())
    );
}

/// A runtime apply keeps what the worker listed (maps, certificates, crt-lists) for the next
/// one, and asks again after a reload: here the reload that gives HAProxy its first TLS bind
/// and crt-list, after a runtime apply that listed none; the next TLS host is then a runtime
/// change of that crt-list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_makes_the_next_runtime_apply_list_the_new_worker_again() {
    let (endpoint_port, _endpoints) = endpoints(3).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 2);
    cluster.ingress("web", "web.test", "web", None);
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    cluster.endpoints("api", &[("127.0.0.3", true)]);
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");

    // A Secret no Ingress uses: a runtime apply that lists the worker's certificates and
    // crt-lists (none) and writes the file only.
    let (web_ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("a Secret");
    assert!(!report.reload && report.runtime_ops == 0, "{report:?}");

    // The first TLS host: an HTTPS bind and a crt-list, a reload.
    cluster.ingress("web", "web.test", "web", Some("web-tls"));
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("the first TLS host");
    assert!(report.reload, "{report:?}");
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("web.test over TLS");

    // The next TLS host: a line of the crt-list the new worker loaded, at run time.
    let (api_ca, cert, key) = issue("api.test");
    cluster.secret("api-tls", &cert, &key);
    cluster.ingress("api", "api.test", "api", Some("api-tls"));
    let report = apply(&client, &agent.url, &cluster, 4)
        .await
        .expect("a second TLS host");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    handshake(https_port, "api.test", &api_ca)
        .await
        .expect("api.test served with its own certificate");
}

/// The pool of spare backends (`haptic_render::pool`): a new Service takes a spare backend at
/// run time; the one that would leave fewer than a step of spares grows the pool, with one
/// reload; every route is served after each change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_services_take_spare_backends_and_an_outgrown_pool_reloads_once() {
    const STEP: usize = 2;
    let (endpoint_port, _endpoints) = endpoints(7).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster =
        Cluster::new(http_port, https_port, endpoint_port, 2).with_pool_step(STEP as u64);
    let service = |cluster: &mut Cluster, k: usize| {
        let name = format!("s{k}");
        cluster.apply(
            "services",
            json!({"metadata": {"namespace": NS, "name": name,
                    "creationTimestamp": format!("2026-01-01T00:00:{k:02}Z")},
                "spec": {"ports": [{"name": "http", "port": 80}]}}),
        );
        cluster.endpoints(&name, &[(&format!("127.0.0.{}", k + 2), true)]);
        cluster.ingress(&name, &format!("s{k}.test"), &name, None);
    };
    service(&mut cluster, 0);
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    await_get(http_port, "s0.test", "backend 127.0.0.2")
        .await
        .expect("served");
    let http = traffic_client();
    let (mut reloads, mut runtime) = (0, 0);
    for k in 1..=5 {
        let workers = worker_pids(&client, &agent.url).await;
        service(&mut cluster, k);
        let report = apply(&client, &agent.url, &cluster, 1 + k as u64)
            .await
            .expect("apply");
        let grows = haptic_render::pool::size(k + 1, STEP) != haptic_render::pool::size(k, STEP);
        assert_eq!(report.reload, grows, "Service s{k}: {report:?}");
        if grows {
            reloads += 1;
        } else {
            runtime += 1;
            // The spare, which has no servers, gets its two slots (`add server`, then its
            // address and weight set, in case a server of that name stayed: HAProxy keeps one
            // it would not delete; `enable health`), the one holding the endpoint put in
            // service (`state ready`), and maps/pool.map and maps/routes-prefix.map an entry
            // each (`add map`): entry by entry, where a new version of each map would take
            // three commands.
            assert_eq!(report.runtime_ops, 2 * 4 + 1 + 2, "{report:?}");
            assert_eq!(worker_pids(&client, &agent.url).await, workers);
        }
        for j in 0..=k {
            assert_eq!(
                get(&http, http_port, &format!("s{j}.test")).await,
                Ok(format!("backend 127.0.0.{}", j + 2)),
                "s{j} after s{k} came"
            );
        }
    }
    // Pools of 4, 4, 6, 6, 8, 8 backends for 1 to 6 Services: two growths.
    assert_eq!((reloads, runtime), (2, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_map_and_certificate_changes_apply_with_no_reload_and_survive_a_restart() {
    let (endpoint_port, _endpoints) = endpoints(7).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 10);
    let (old_ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    cluster.ingress("web", "web.test", "web", Some("web-tls"));
    cluster.endpoints("web", &[("127.0.0.2", true), ("127.0.0.3", true)]);

    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let first = apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    assert!(first.reload, "the first set starts HAProxy");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");
    handshake(https_port, "web.test", &old_ca)
        .await
        .expect("the first certificate is served");
    let workers = worker_pids(&client, &agent.url).await;
    assert_eq!(workers.len(), 1, "{workers:?}");

    // A loop of requests, each on a fresh connection, while endpoints come and go, roll and
    // turn not ready.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let traffic = tokio::spawn({
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        async move {
            let http = traffic_client();
            let mut failures = Vec::new();
            // Bounded: at most 20,000 requests.
            for _ in 0..20_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match get(&http, http_port, "web.test").await {
                    Ok(body) if body.starts_with("backend 127.0.0.") => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        failures.push(format!("{other:?}"));
                    }
                }
            }
            failures
        }
    });
    let burst: [&[(&str, bool)]; 8] = [
        &[
            ("127.0.0.2", true),
            ("127.0.0.3", true),
            ("127.0.0.4", true),
        ],
        &[("127.0.0.3", true), ("127.0.0.4", true)],
        &[
            ("127.0.0.3", true),
            ("127.0.0.4", false),
            ("127.0.0.5", true),
        ],
        &[
            ("127.0.0.3", true),
            ("127.0.0.4", true),
            ("127.0.0.5", true),
        ],
        &[("127.0.0.5", true), ("127.0.0.6", true)],
        &[
            ("127.0.0.5", true),
            ("127.0.0.6", true),
            ("127.0.0.7", true),
        ],
        &[("127.0.0.6", false), ("127.0.0.7", true)],
        &[("127.0.0.6", true), ("127.0.0.7", true)],
    ];
    let mut generation = 1;
    let mut runtime_ops = 0;
    for step in burst {
        cluster.endpoints("web", step);
        generation += 1;
        let report = apply(&client, &agent.url, &cluster, generation)
            .await
            .expect("endpoint change");
        assert_eq!(report.outcome, Outcome::Applied);
        assert!(!report.reload, "an endpoint change reloaded: {step:?}");
        assert!(report.runtime_ops > 0);
        runtime_ops += report.runtime_ops;
        // Let a few requests run against each state.
        let seen = ok.load(Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while ok.load(Ordering::Relaxed) < seen + 5 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let failures = traffic.await.expect("traffic");
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    assert!(ok.load(Ordering::Relaxed) >= 40, "too few requests ran");
    assert!(runtime_ops >= 8);
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "HAProxy reloaded"
    );
    // Only the live set and last-known-good stay on disk: after its answer, each runtime
    // apply removes the set before them.
    let set_dirs = || {
        std::fs::read_dir(agent.data.join("sets"))
            .expect("sets")
            .filter(|entry| entry.as_ref().is_ok_and(|e| e.path().is_dir()))
            .count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while set_dirs() != 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} sets on disk",
            set_dirs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The last state is the one served: 127.0.0.7 answers, 127.0.0.2 no longer does.
    await_get(http_port, "web.test", "backend 127.0.0.7")
        .await
        .expect("the newest endpoint is served");
    let http = traffic_client();
    for _ in 0..10 {
        let body = get(&http, http_port, "web.test").await.expect("served");
        assert!(
            body == "backend 127.0.0.6" || body == "backend 127.0.0.7",
            "{body}"
        );
    }

    // A map change: a new Ingress to the same Service routes a new host, no reload.
    assert_eq!(
        get(&http, http_port, "shop.test")
            .await
            .map_err(|e| e.contains("404")),
        Err(true)
    );
    cluster.ingress("shop", "shop.test", "web", None);
    generation += 1;
    let report = apply(&client, &agent.url, &cluster, generation)
        .await
        .expect("map change");
    assert!(!report.reload, "a map change reloaded");
    let routed = get(&http, http_port, "shop.test").await.expect("new host");
    assert!(routed.starts_with("backend 127.0.0."), "{routed}");

    // A rotated certificate: served on the next handshake, no reload.
    let (new_ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    generation += 1;
    let report = apply(&client, &agent.url, &cluster, generation)
        .await
        .expect("certificate rotation");
    assert!(!report.reload, "a certificate rotation reloaded");
    handshake(https_port, "web.test", &new_ca)
        .await
        .expect("the rotated certificate is served");
    assert!(handshake(https_port, "web.test", &old_ca).await.is_err());
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "HAProxy reloaded"
    );

    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.reloads_avoided, 10);
    assert_eq!(state.generation, Some(generation));
    let live = state.live_checksum.expect("live");
    assert_eq!(live, cluster.render().checksum());
    let metrics = reqwest::get(agent.url.join("metrics").expect("url"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("haptic_agent_reloads_avoided_total 10\n"),
        "{metrics}"
    );
    // The same set again is unchanged.
    let again = apply(&client, &agent.url, &cluster, generation)
        .await
        .expect("again");
    assert_eq!(again.outcome, Outcome::Unchanged);

    // After a restart of the agent (and its HAProxy), the live set on disk is what HAProxy
    // serves: the last endpoints, the new host, the rotated certificate.
    agent.stop().await;
    let agent = TestAgent::start(dir.path()).await;
    assert_eq!(
        await_get(http_port, "shop.test", "backend 127.0.0.7").await,
        Ok("backend 127.0.0.7".to_owned())
    );
    for _ in 0..10 {
        let body = get(&http, http_port, "web.test").await.expect("served");
        assert!(
            body == "backend 127.0.0.6" || body == "backend 127.0.0.7",
            "{body}"
        );
    }
    handshake(https_port, "web.test", &new_ca)
        .await
        .expect("the rotated certificate after the restart");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(live.as_str()));
    agent.stop().await;
}

/// GETs `web.test` until each endpoint of `wanted` has answered (at most 60 requests: round
/// robin evens out within a few rounds after servers change state), every answer from one of
/// them.
async fn served_by(http: &reqwest::Client, port: u16, wanted: &[&str]) {
    let wanted: std::collections::BTreeSet<String> =
        wanted.iter().map(|ip| format!("backend {ip}")).collect();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..60 {
        let body = get(http, port, "web.test").await.expect("served");
        assert!(
            wanted.contains(&body),
            "{body} answered, not one of {wanted:?}"
        );
        seen.insert(body);
        if seen == wanted {
            return;
        }
    }
    panic!("only {seen:?} of {wanted:?} answered in 60 requests");
}

/// `show stat` of the agent's HAProxy worker, through its master socket.
async fn show_stat(data: &std::path::Path) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    // The default place (the agent runs HAProxy as its own user here).
    let mut socket = tokio::net::UnixStream::connect(data.join("master.sock"))
        .await
        .expect("master socket");
    socket.write_all(b"@1 show stat\n").await.expect("ask");
    // The master CLI answers once it sees the end of the request.
    socket.shutdown().await.expect("end of the request");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), socket.read_to_string(&mut answer))
        .await
        .expect("answered in time")
        .expect("answer");
    answer
}

/// The CSV fields of the server slots (`s<n>`) in a `show stat` answer.
fn slot_stats(stat: &str) -> impl Iterator<Item = Vec<&str>> {
    stat.lines()
        .map(|line| line.split(',').collect::<Vec<_>>())
        .filter(|fields| {
            fields.get(1).is_some_and(|name| {
                name.strip_prefix('s')
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
        })
}

/// HAProxy refuses to delete a server with a request on it: the server the shrink takes away
/// stays, in maintenance (serving that request to its end, and no other), with no reload; a
/// growth that adds its name again sets the lingering server to the new endpoint before it
/// serves, again with no reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_deleted_with_a_request_on_it_stays_until_its_slot_comes_back() {
    let port = free_port();
    let release = Arc::new(tokio::sync::Notify::new());
    let mut running = Vec::new();
    for n in 2..=4 {
        let ip = format!("127.0.0.{n}");
        let listener = TcpListener::bind((ip.as_str(), port)).await.expect("bind");
        let body = format!("backend {ip}");
        let release = release.clone();
        let app = axum::Router::new()
            .route(
                "/hold",
                axum::routing::get(move || {
                    let release = release.clone();
                    async move {
                        release.notified().await;
                        "released"
                    }
                }),
            )
            .fallback(move || {
                let body = body.clone();
                async move { body }
            });
        running.push(tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        }));
    }
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, port, 2);
    cluster.ingress("web", "web.test", "web", None);
    let three = [
        ("127.0.0.2", true),
        ("127.0.0.3", true),
        ("127.0.0.4", true),
    ];
    cluster.endpoints("web", &three);
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");
    let workers = worker_pids(&client, &agent.url).await;

    // A request held on every server (round robin: each of the three gets two).
    let held: Vec<JoinHandle<Result<String, String>>> = (0..6)
        .map(|_| {
            tokio::spawn(async move {
                let http = reqwest::Client::builder()
                    .pool_max_idle_per_host(0)
                    .timeout(Duration::from_secs(30))
                    .build()
                    .map_err(|e| e.to_string())?;
                let response = http
                    .get(format!("http://127.0.0.1:{http_port}/hold"))
                    .header("host", "web.test")
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                response.text().await.map_err(|e| e.to_string())
            })
        })
        .collect();
    // Every server holds one before the shrink (HAProxy's count of current sessions).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let busy = |stat: &str| {
        slot_stats(stat)
            .filter(|fields| fields.get(4).is_some_and(|scur| *scur != "0"))
            .count()
    };
    loop {
        let stat = show_stat(dir.path()).await;
        if busy(&stat) >= 3 || tokio::time::Instant::now() > deadline {
            assert_eq!(busy(&stat), 3, "{stat}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The shrink (one endpoint: two slots) deletes two servers that have a request on them.
    cluster.endpoints("web", &[("127.0.0.3", true)]);
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("shrink");
    assert!(!report.reload, "{report:?}");
    let http = traffic_client();
    served_by(&http, http_port, &["127.0.0.3"]).await;
    let stat = show_stat(dir.path()).await;
    // The config has two slots now; the servers of slots 3 and 4 that stayed are in
    // maintenance.
    let lingering: Vec<&str> = slot_stats(&stat)
        .filter(|fields| matches!(fields[1], "s3" | "s4"))
        .map(|fields| fields.get(17).copied().unwrap_or_default())
        .collect();
    assert!(!lingering.is_empty(), "no server stayed: {stat}");
    assert!(
        lingering.iter().all(|status| status.starts_with("MAINT")),
        "{stat}"
    );

    // The growth adds their names again, at other endpoints than they held.
    cluster.endpoints("web", &three);
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("growth");
    assert!(!report.reload, "{report:?}");
    served_by(&http, http_port, &["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    assert_eq!(worker_pids(&client, &agent.url).await, workers);
    release.notify_waiters();
    for request in held {
        assert_eq!(request.await.expect("held"), Ok("released".to_owned()));
    }
    agent.stop().await;
    for task in running {
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_beyond_the_runtime_api_reload_and_a_failed_runtime_change_falls_back() {
    let (endpoint_port, _endpoints) = endpoints(6).await;
    let (http_port, https_port) = (free_port(), free_port());
    // Two slots per backend, so that a third endpoint outgrows them.
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 2);
    let (ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    cluster.ingress("web", "web.test", "web", Some("web-tls"));
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    cluster.endpoints("api", &[("127.0.0.6", true)]);

    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = haptic_agent::AgentConfig::new(dir.path(), TOKEN)
        .with_listen(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true);
    config.runtime_timeout = Duration::from_secs(1);
    let agent = TestAgent::start_with(config).await;
    let client = client();
    apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");
    let mut workers = worker_pids(&client, &agent.url).await;
    let http = traffic_client();

    // A new backend (an Ingress to a Service no Ingress routed to) takes a spare backend of
    // the pool (haptic_render::pool): its servers and map lines, without a reload.
    cluster.ingress("api", "api.test", "api", None);
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("new backend");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert_eq!(
        get(&http, http_port, "api.test").await,
        Ok("backend 127.0.0.6".to_owned())
    );
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "a new backend reloaded"
    );

    // A backend that outgrows its slots gets more (two slots become four): the new `server`
    // lines are added at run time (`add server`, health checks started), with no reload,
    // and each endpoint is served.
    let three = [
        ("127.0.0.2", true),
        ("127.0.0.3", true),
        ("127.0.0.4", true),
    ];
    cluster.endpoints("web", &three);
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("growth");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "a growth reloaded"
    );
    served_by(&http, http_port, &["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    // And shrinks back (one endpoint: two slots): the lines that go are deleted at run time.
    cluster.endpoints("web", &[("127.0.0.3", true)]);
    let report = apply(&client, &agent.url, &cluster, 4)
        .await
        .expect("shrink");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    served_by(&http, http_port, &["127.0.0.3"]).await;
    cluster.endpoints("web", &three);
    let report = apply(&client, &agent.url, &cluster, 5)
        .await
        .expect("growth again");
    assert!(!report.reload, "{report:?}");
    served_by(&http, http_port, &["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "a slot change reloaded"
    );

    // A backend HAProxy cannot add at run time (not one of the pool's: its Service port speaks
    // HTTP/2 in clear text) needs a reload.
    cluster.apply(
        "services",
        json!({"metadata": {"namespace": NS, "name": "grpc"},
            "spec": {"ports": [{"name": "http", "port": 80, "appProtocol": "kubernetes.io/h2c"}]}}),
    );
    cluster.endpoints("grpc", &[("127.0.0.5", true)]);
    cluster.ingress("grpc", "grpc.test", "grpc", None);
    let report = apply(&client, &agent.url, &cluster, 6)
        .await
        .expect("a new kind of backend");
    assert!(report.reload, "{report:?}");
    workers = {
        let now = worker_pids(&client, &agent.url).await;
        assert_ne!(now, workers);
        now
    };

    // The worker does not answer the runtime API (stopped): the change falls back to the
    // reload and the new set is live and served by a new worker.
    let stopped =
        rustix::process::Pid::from_raw(i32::try_from(workers[0]).expect("pid")).expect("pid");
    rustix::process::kill_process(stopped, rustix::process::Signal::STOP).expect("SIGSTOP");
    cluster.endpoints(
        "web",
        &[
            ("127.0.0.3", true),
            ("127.0.0.4", true),
            ("127.0.0.5", true),
        ],
    );
    let report = apply(&client, &agent.url, &cluster, 7).await;
    // Let the old worker run again and finish: it was told to stop by the reload.
    rustix::process::kill_process(stopped, rustix::process::Signal::CONT).expect("SIGCONT");
    let report = report.expect("fallback");
    assert!(report.reload, "{report:?}");
    assert!(report.timing.runtime_us > 0, "{report:?}");
    // The set staged beside the runtime commands is gone with them: the reload path staged
    // and promoted its own.
    assert_eq!(staged(dir.path()), Vec::<String>::new());
    assert_ne!(worker_pids(&client, &agent.url).await, workers);
    await_get(http_port, "web.test", "backend 127.0.0.5")
        .await
        .expect("the new set is served");
    for _ in 0..10 {
        let body = get(&http, http_port, "web.test").await.expect("served");
        assert_ne!(body, "backend 127.0.0.2", "a removed endpoint is served");
    }
    workers = worker_pids(&client, &agent.url).await;

    // A server change applied at run time, then a certificate whose key is not its own:
    // HAProxy refuses the certificate, the reload path refuses the set (`haproxy -c`), and
    // the agent reloads the live set, so that the server change made at run time is undone.
    // (The reference templates leave such a Secret out, so the file is written here the way a
    // template that does not check keys, or a key OpenSSL refuses and the renderer's check
    // accepts, would write it.)
    let live = client.state(&agent.url).await.expect("state").live_checksum;
    let (_, other_cert, _) = issue("web.test");
    let mismatched = format!("{}\n{}\n", other_cert.trim(), key.trim());
    cluster.endpoints(
        "web",
        &[
            ("127.0.0.3", true),
            ("127.0.0.4", true),
            ("127.0.0.6", true),
        ],
    );
    let set = cluster.render_replacing(Some((&ssl_file(NS, "web-tls"), &mismatched)));
    match client
        .apply(&agent.url, &request(1, "leader-0", 8, set))
        .await
    {
        Err(Error::Invalid { check_output }) => {
            assert!(check_output.contains("web-tls"), "{check_output}")
        }
        other => panic!("a mismatched key was not refused: {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum, live, "the refused set is not live");
    assert_eq!(staged(dir.path()), Vec::<String>::new());
    assert_ne!(
        state.worker_pids, workers,
        "the live set was not loaded again"
    );
    for _ in 0..20 {
        let body = get(&http, http_port, "web.test").await.expect("served");
        assert_ne!(
            body, "backend 127.0.0.6",
            "the refused set's server is served"
        );
    }
    handshake(https_port, "web.test", &ca)
        .await
        .expect("the live certificate is still served");
    agent.stop().await;
}

/// A TLS endpoint on `ip:port` presenting `cert` (chain and key PEM): it completes the
/// handshake of whoever connects, then closes.
struct TlsEndpoint {
    task: JoinHandle<()>,
}

impl TlsEndpoint {
    async fn start(ip: &str, port: u16, cert: &str, key: &str) -> Self {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
            .collect::<Result<_, _>>()
            .expect("certificate");
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind((ip, port))
            .await
            .expect("bind TLS endpoint");
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let _ = acceptor.accept(tcp).await;
                });
            }
        });
        Self { task }
    }
}

impl Drop for TlsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// ingress-nginx's ssl-passthrough through the agent: the TLS of a passthrough host reaches
/// the Service's endpoint (its certificate is the one the client sees) next to a host HAProxy
/// terminates; a second host of the same Service port is a map change, and the Service's
/// endpoint moving a server slot change: neither reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssl_passthrough_hosts_and_endpoints_change_with_no_reload() {
    let (endpoint_port, _endpoints) = endpoints(2).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 10);
    let (web_ca, cert, key) = issue("web.test");
    cluster.secret("web-tls", &cert, &key);
    cluster.ingress("web", "web.test", "web", Some("web-tls"));
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    // Service `api` is the passthrough one: a TLS endpoint of its own certificate.
    let (pass_ca, pass_cert, pass_key) = issue("*.pass.test");
    let first_endpoint =
        TlsEndpoint::start("127.0.0.8", endpoint_port, &pass_cert, &pass_key).await;
    cluster.endpoints("api", &[("127.0.0.8", true)]);
    let passthrough = |cluster: &mut Cluster, name: &str, host: &str| {
        cluster.apply(
            "ingresses",
            json!({"metadata": {"namespace": NS, "name": name,
                    "annotations": {"nginx.ingress.kubernetes.io/ssl-passthrough": "true"}},
                "spec": {"rules": [{"host": host, "http": {"paths": [{"path": "/",
                    "pathType": "Prefix",
                    "backend": {"service": {"name": "api", "port": {"number": 80}}}}]}}]}}),
        );
    };
    passthrough(&mut cluster, "vault-a", "a.pass.test");

    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let first = apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    assert!(first.reload, "the first set starts HAProxy");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("served");
    handshake(https_port, "a.pass.test", &pass_ca)
        .await
        .expect("the endpoint's certificate, passed through");
    handshake(https_port, "web.test", &web_ca)
        .await
        .expect("HAProxy's certificate for the terminated host");
    assert!(
        handshake(https_port, "b.pass.test", &pass_ca)
            .await
            .is_err()
    );
    let workers = worker_pids(&client, &agent.url).await;

    // A second passthrough host to the same Service port: a map change.
    passthrough(&mut cluster, "vault-b", "b.pass.test");
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("a host added");
    assert_eq!(report.outcome, Outcome::Applied);
    assert!(!report.reload, "a passthrough host added reloaded");
    handshake(https_port, "b.pass.test", &pass_ca)
        .await
        .expect("the new host, passed through");

    // The endpoint moves: a server slot change.
    drop(first_endpoint);
    let _second = TlsEndpoint::start("127.0.0.9", endpoint_port, &pass_cert, &pass_key).await;
    cluster.endpoints("api", &[("127.0.0.9", true)]);
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("an endpoint change");
    assert!(!report.reload, "a passthrough endpoint change reloaded");
    handshake(https_port, "a.pass.test", &pass_ca)
        .await
        .expect("the moved endpoint");
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "HAProxy reloaded"
    );
    agent.stop().await;
}

/// A GET of `path` with Host `host` and the headers given: the body, or the error.
async fn get_path(
    port: u16,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<String, String> {
    let http = traffic_client();
    let mut request = http
        .get(format!("http://127.0.0.1:{port}{path}"))
        .header("host", host);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response.text().await.map_err(|e| e.to_string())?;
    if status.is_success() {
        Ok(body)
    } else {
        Err(format!("{status}: {body}"))
    }
}

/// Gateway API HTTPRoutes on a listener sharing the Ingress frontend's port: a plain route (no
/// method, header or query condition, no filter, one backend) added, retargeted and removed
/// changes the gateway maps only, which the agent applies through the runtime API with no
/// reload; a route with a header match (a line of haproxy.cfg) keeps its precedence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_routes_change_with_no_reload() {
    let (endpoint_port, _endpoints) = endpoints(3).await;
    let (http_port, https_port) = (free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 10);
    cluster.ingress("web", "web.test", "web", None);
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    cluster.endpoints("api", &[("127.0.0.3", true)]);
    cluster.apply(
        "gatewayclasses",
        json!({"metadata": {"name": "haptic"},
            "spec": {"controllerName": "haproxy-haptic.org/gateway-controller"}}),
    );
    cluster.apply(
        "gateways",
        json!({"metadata": {"namespace": NS, "name": "gw"},
            "spec": {"gatewayClassName": "haptic",
                "listeners": [{"name": "http", "port": http_port, "protocol": "HTTP"}]}}),
    );
    let route = |name: &str, host: &str, rule: Json| {
        json!({"metadata": {"namespace": NS, "name": name,
                "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"parentRefs": [{"name": "gw"}], "hostnames": [host], "rules": [rule]}})
    };
    let to = |service: &str| json!([{"name": service, "port": 80}]);
    // Header matches: lines of haproxy.cfg, to api and to web (the routes' backends).
    for (name, header, service) in [("m-header", "x-api", "api"), ("m-web", "x-web", "web")] {
        cluster.apply(
            "httproutes",
            route(
                name,
                "gw.test",
                json!({"matches": [{"path": {"type": "PathPrefix", "value": "/"},
                    "headers": [{"name": header, "value": "1"}]}], "backendRefs": to(service)}),
            ),
        );
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let first = apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    assert!(first.reload, "the first set starts HAProxy");
    await_get(http_port, "web.test", "backend 127.0.0.2")
        .await
        .expect("the Ingress");
    assert_eq!(
        get_path(http_port, "gw.test", "/x", &[("x-api", "1")]).await,
        Ok("backend 127.0.0.3".to_owned())
    );
    assert!(get_path(http_port, "gw.test", "/x", &[]).await.is_err());
    let workers = worker_pids(&client, &agent.url).await;
    let live_cfg = |cluster: &Cluster| {
        String::from_utf8_lossy(cluster.render().get("haproxy.cfg").expect("haproxy.cfg"))
            .into_owned()
    };
    let cfg = live_cfg(&cluster);

    // Added: a plain route to web, named before the other.
    let plain = |service: &str| {
        route(
            "a-plain",
            "gw.test",
            json!({"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": to(service)}),
        )
    };
    cluster.apply("httproutes", plain("web"));
    assert_eq!(live_cfg(&cluster), cfg, "haproxy.cfg changed");
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("a route added");
    assert_eq!(report.outcome, Outcome::Applied);
    assert!(!report.reload, "a plain route added reloaded");
    assert!(report.runtime_ops > 0);
    assert_eq!(
        get_path(http_port, "gw.test", "/x", &[]).await,
        Ok("backend 127.0.0.2".to_owned())
    );
    // The header match goes first still (the same host and path, with a condition).
    assert_eq!(
        get_path(http_port, "gw.test", "/x", &[("x-api", "1")]).await,
        Ok("backend 127.0.0.3".to_owned())
    );

    // Retargeted to api.
    cluster.apply("httproutes", plain("api"));
    let report = apply(&client, &agent.url, &cluster, 3)
        .await
        .expect("a route retargeted");
    assert!(!report.reload, "a plain route retargeted reloaded");
    assert_eq!(
        get_path(http_port, "gw.test", "/x", &[]).await,
        Ok("backend 127.0.0.3".to_owned())
    );

    // Removed: the host is the Ingress frontend's again (no Ingress route: 404).
    cluster
        .stores
        .get_mut("httproutes")
        .expect("store")
        .remove(NS, "a-plain");
    let report = apply(&client, &agent.url, &cluster, 4)
        .await
        .expect("a route removed");
    assert!(!report.reload, "a plain route removed reloaded");
    assert!(get_path(http_port, "gw.test", "/x", &[]).await.is_err());
    assert_eq!(
        await_get(http_port, "web.test", "backend 127.0.0.2").await,
        Ok("backend 127.0.0.2".to_owned())
    );
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "HAProxy reloaded"
    );
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.reloads_avoided, 3);
    agent.stop().await;
}

/// The certificates of a Gateway's HTTPS listeners on a port of their own (the port's first
/// on the bind line, every one in the crt-list `maps/gw-certs.list`) rotate as an Ingress's
/// do: through the runtime API, no reload, the new one served on the next handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_listener_certificates_rotate_with_no_reload() {
    let (endpoint_port, _endpoints) = endpoints(2).await;
    let (http_port, https_port, gw_port) = (free_port(), free_port(), free_port());
    let mut cluster = Cluster::new(http_port, https_port, endpoint_port, 10);
    cluster.ingress("web", "web.test", "web", None);
    cluster.endpoints("web", &[("127.0.0.2", true)]);
    cluster.apply(
        "gatewayclasses",
        json!({"metadata": {"name": "haptic"},
            "spec": {"controllerName": "haproxy-haptic.org/gateway-controller"}}),
    );
    let listener = |name: &str| {
        json!({"name": name, "port": gw_port, "protocol": "HTTPS",
            "hostname": format!("{name}.gw.test"),
            "tls": {"certificateRefs": [{"name": format!("gw-{name}")}]}})
    };
    cluster.apply(
        "gateways",
        json!({"metadata": {"namespace": NS, "name": "gw"},
            "spec": {"gatewayClassName": "haptic",
                "listeners": [listener("a"), listener("b")]}}),
    );
    let issue_both = |cluster: &mut Cluster| {
        ["a", "b"].map(|name| {
            let (ca, cert, key) = issue(&format!("{name}.gw.test"));
            cluster.secret(&format!("gw-{name}"), &cert, &key);
            ca
        })
    };
    let old = issue_both(&mut cluster);
    let files = cluster.render();
    let list = String::from_utf8_lossy(files.get("maps/gw-certs.list").expect("crt-list"));
    assert!(
        list.contains(&ssl_file(NS, "gw-a")) && list.contains(&ssl_file(NS, "gw-b")),
        "{list}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let first = apply(&client, &agent.url, &cluster, 1)
        .await
        .expect("first");
    assert!(first.reload, "the first set starts HAProxy");
    for (host, ca) in [("a.gw.test", &old[0]), ("b.gw.test", &old[1])] {
        handshake(gw_port, host, ca)
            .await
            .unwrap_or_else(|e| panic!("{host}: the first certificate: {e}"));
    }
    let workers = worker_pids(&client, &agent.url).await;

    // Both rotated: the default (on the bind line and in the list) and the other.
    let new = issue_both(&mut cluster);
    let report = apply(&client, &agent.url, &cluster, 2)
        .await
        .expect("certificates rotated");
    assert_eq!(report.outcome, Outcome::Applied);
    assert!(!report.reload, "a certificate rotation reloaded");
    assert!(report.runtime_ops > 0);
    for (host, old, new) in [
        ("a.gw.test", &old[0], &new[0]),
        ("b.gw.test", &old[1], &new[1]),
    ] {
        handshake(gw_port, host, new)
            .await
            .unwrap_or_else(|e| panic!("{host}: the rotated certificate: {e}"));
        assert!(
            handshake(gw_port, host, old).await.is_err(),
            "{host}: the old certificate is still served"
        );
    }
    assert_eq!(
        worker_pids(&client, &agent.url).await,
        workers,
        "HAProxy reloaded"
    );
    agent.stop().await;
}
