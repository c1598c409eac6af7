//! Ingress semantics of the reference set at the HTTP level, through a running HAProxy: which
//! Ingresses are ours (IngressClass, the legacy annotation, the default class, class-less ones),
//! conflicts between Ingresses (the oldest wins, the others get an Event naming it, deleting
//! the winner hands over), `spec.defaultBackend`, wildcard hosts, the redirect to HTTPS, the
//! X-Forwarded-* headers and a backend reached over TLS (`appProtocol: https`).
//!
//! Requests carrying `x-haptic-route-debug` are answered with the backend they would go to
//! (`route_debug`); the others reach real backends: a second HAProxy that answers with what it
//! received, on plain HTTP and on TLS.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use haptic_render::{Derivation, EventRequest, Renderer, StoreConfig, Stores, fixtures, reference};
use serde_json::{Value as Json, json};

/// A running HAProxy, killed when dropped, however the test ends.
struct Running {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    common::free_port()
}

/// Starts HAProxy on `dir/haproxy.cfg` and waits, with a bound, until `port` accepts.
fn start(dir: tempfile::TempDir, port: u16) -> Running {
    let child = Command::new(common::haproxy())
        .arg("-db")
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let running = Running { child, _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "haproxy did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    running
}

/// The echo backends: plain HTTP on `plain`, TLS (the fixture certificate) on `tls`, HTTP/2
/// in clear text on `h2c`. Each answers 200 with what it received.
fn echo_backends(plain: u16, tls: u16, h2c: u16) -> Running {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("echo.pem"),
        format!("{}{}", fixtures::TLS_CERT_PEM, fixtures::TLS_KEY_PEM),
    )
    .unwrap();
    let cfg = format!(
        "global\n    maxconn 100\n    default-path config\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
         frontend plain\n    bind 127.0.0.1:{plain}\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"plain xff=%[req.fhdr(x-forwarded-for)] n=%[req.fhdr_cnt(x-forwarded-for)] proto=%[req.fhdr(x-forwarded-proto)] port=%[req.fhdr(x-forwarded-port)] host=%[req.fhdr(x-forwarded-host)]\"\n\
         frontend tls\n    bind 127.0.0.1:{tls} ssl crt echo.pem\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"tls=%[ssl_fc]\"\n\
         frontend h2c\n    bind 127.0.0.1:{h2c} proto h2\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"h2c version=%[req.ver]\"\n"
    );
    std::fs::write(dir.path().join("haproxy.cfg"), cfg).unwrap();
    let running = start(dir, plain);
    let deadline = Instant::now() + Duration::from_secs(20);
    for port in [tls, h2c] {
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the echo did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    running
}

/// An answer: status, head (lowercased) and body.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// GET `path` with `Host: host` and `headers`, on `port`.
fn get(port: u16, host: &str, path: &str, headers: &str) -> Answer {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Answer {
        status,
        head: head.to_lowercase(),
        body: body.to_owned(),
    }
}

/// The backend a request for `host` + `path` goes to (`route_debug`): `404` for the backend
/// answering 404.
fn route(port: u16, host: &str, path: &str) -> String {
    let answer = get(port, host, path, "x-haptic-route-debug: 1\r\n");
    match (answer.status, answer.body.as_str()) {
        (200, "default-backend") => "404".to_owned(),
        (200, _) => answer.body,
        (status, _) => status.to_string(),
    }
}

/// The reference stores, every view's class filter taking class-less Ingresses or not.
fn stores(classless: bool) -> Stores {
    let mut stores = Stores::new();
    for (name, index) in reference::STORES {
        stores
            .add(name, StoreConfig::index_by(index.iter().copied()))
            .unwrap();
    }
    for (name, derivation) in reference::derivations() {
        let mut config = serde_json::to_value(&derivation).unwrap();
        if derivation.classes().is_some() {
            config["classes"]["classless"] = json!(classless);
        }
        let derivation: Derivation = serde_json::from_value(config).unwrap();
        stores.derive(name, derivation).unwrap();
    }
    stores
}

fn apply(stores: &mut Stores, store: &str, resource: Json) {
    stores.get_mut(store).unwrap().apply(&resource).unwrap();
}

/// A Service `name` in `namespace` with port 80 (`http`) and its slice to the plain echo,
/// and port 443 (`https`, appProtocol https) to the TLS echo.
fn service(stores: &mut Stores, namespace: &str, name: &str, plain: u16, tls: u16) {
    apply(
        stores,
        "services",
        json!({"metadata": {"namespace": namespace, "name": name}, "spec": {"ports": [
            {"name": "http", "port": 80},
            {"name": "https", "port": 443, "appProtocol": "https"},
        ]}}),
    );
    apply(
        stores,
        "endpointslices",
        json!({"metadata": {"namespace": namespace, "name": format!("{name}-1"),
                "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": plain}, {"name": "https", "port": tls}],
            "endpoints": [{"addresses": ["127.0.0.1"]}]}),
    );
}

/// An Ingress: `spec` as given, created at `created` (RFC 3339), with `annotations`.
fn ingress(namespace: &str, name: &str, created: &str, annotations: Json, spec: Json) -> Json {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"namespace": namespace, "name": name, "creationTimestamp": created,
            "annotations": annotations, "uid": format!("uid-{namespace}-{name}")},
        "spec": spec})
}

/// A rule: `host` (empty: none), Prefix `path` to `service` port 80.
fn rule(host: &str, path: &str, service: &str) -> Json {
    let mut rule = json!({"http": {"paths": [{"path": path, "pathType": "Prefix",
        "backend": {"service": {"name": service, "port": {"number": 80}}}}]}});
    if !host.is_empty() {
        rule["host"] = json!(host);
    }
    rule
}

fn class(name: &str, controller: &str, default: bool) -> Json {
    let mut class = fixtures::ingress_class(name, default);
    class["spec"]["controller"] = json!(controller);
    class
}

/// A front HAProxy rendering the reference set over `stores`, and the Events it asks for.
struct Front {
    http: u16,
    events: Vec<EventRequest>,
    _running: Running,
}

fn front(stores: &Stores) -> Front {
    let (http, https) = (free_port(), free_port());
    let mut set = reference::template_set();
    set.extra_context.insert(
        "haproxy".into(),
        json!({"maxconn": 1000, "http_port": http, "https_port": https,
            "timeout_connect": "2s", "timeout_client": "10s", "timeout_server": "10s",
            "stats_socket": null, "route_debug": true, "health_checks": false}),
    );
    let (files, requests) = Renderer::compile(&set).unwrap().render_all(stores).unwrap();
    let dir = tempfile::tempdir().unwrap();
    files.write_to(dir.path()).unwrap();
    common::check_dir(dir.path());
    Front {
        http,
        events: requests.events,
        _running: start(dir, http),
    }
}

impl Front {
    fn route(&self, host: &str, path: &str) -> String {
        route(self.http, host, path)
    }

    /// The Events asked for about `namespace/name` with `reason`: their messages.
    fn events(&self, namespace: &str, name: &str, reason: &str) -> Vec<&str> {
        self.events
            .iter()
            .filter(|e| {
                e.namespace.as_deref() == Some(namespace)
                    && e.name.as_deref() == Some(name)
                    && e.reason == reason
            })
            .map(|e| e.message.as_str())
            .collect()
    }
}

const OURS: &str = haptic_render::derived::DEFAULT_CONTROLLER;
const T1: &str = "2026-01-01T00:00:00Z";
const T2: &str = "2026-02-01T00:00:00Z";

#[test]
fn only_ingresses_of_our_classes_route() {
    let (plain, tls) = (free_port(), free_port());
    let mut s = stores(false);
    apply(&mut s, "ingressclasses", class("haproxy", OURS, false));
    apply(
        &mut s,
        "ingressclasses",
        class("nginx", "k8s.io/ingress-nginx", false),
    );
    service(&mut s, "a", "web", plain, tls);
    let none = json!({});
    let legacy = |class: &str| json!({"kubernetes.io/ingress.class": class});
    for (name, annotations, class_name) in [
        ("ours", none.clone(), Some("haproxy")),
        ("theirs", none.clone(), Some("nginx")),
        ("missing-class", none.clone(), Some("gone")),
        ("legacy-ours", legacy("haproxy"), None),
        ("legacy-theirs", legacy("nginx"), None),
        ("classless", none.clone(), None),
    ] {
        let mut spec = json!({"rules": [rule(&format!("{name}.example.com"), "/", "web")]});
        if let Some(class_name) = class_name {
            spec["ingressClassName"] = json!(class_name);
        }
        apply(
            &mut s,
            "ingresses",
            ingress("a", name, T1, annotations, spec),
        );
    }
    let f = front(&s);
    for (host, backend) in [
        ("ours.example.com", "a_web_80"),
        ("legacy-ours.example.com", "a_web_80"),
        ("theirs.example.com", "404"),
        ("missing-class.example.com", "404"),
        ("legacy-theirs.example.com", "404"),
        // No class, and none of ours is the default: not ours.
        ("classless.example.com", "404"),
    ] {
        assert_eq!(f.route(host, "/"), backend, "{host}");
    }
    // Nothing is asked of the cluster about Ingresses that are not ours.
    assert!(
        f.events.iter().all(|e| e.name.as_deref() != Some("theirs")),
        "{:?}",
        f.events
    );
    drop(f);

    // Our class becomes the default: the class-less Ingress is ours (not the others').
    apply(&mut s, "ingressclasses", class("haproxy", OURS, true));
    let f = front(&s);
    assert_eq!(f.route("classless.example.com", "/"), "a_web_80");
    assert_eq!(f.route("theirs.example.com", "/"), "404");
    drop(f);

    // An Ingress moving to another class loses its routes; one moving to ours gains them.
    apply(
        &mut s,
        "ingresses",
        ingress(
            "a",
            "ours",
            T1,
            json!({}),
            json!({"ingressClassName": "nginx", "rules": [rule("ours.example.com", "/", "web")]}),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "a",
            "theirs",
            T1,
            json!({}),
            json!({"ingressClassName": "haproxy", "rules": [rule("theirs.example.com", "/", "web")]}),
        ),
    );
    let f = front(&s);
    assert_eq!(f.route("ours.example.com", "/"), "404");
    assert_eq!(f.route("theirs.example.com", "/"), "a_web_80");
    drop(f);

    // Without a default class, the setting takes class-less Ingresses.
    let mut s2 = stores(true);
    apply(&mut s2, "ingressclasses", class("haproxy", OURS, false));
    service(&mut s2, "a", "web", plain, tls);
    apply(
        &mut s2,
        "ingresses",
        ingress(
            "a",
            "classless",
            T1,
            json!({}),
            json!({"rules": [rule("classless.example.com", "/", "web")]}),
        ),
    );
    apply(
        &mut s2,
        "ingresses",
        ingress(
            "a",
            "theirs",
            T1,
            json!({}),
            json!({"ingressClassName": "nginx", "rules": [rule("theirs.example.com", "/", "web")]}),
        ),
    );
    let f = front(&s2);
    assert_eq!(f.route("classless.example.com", "/"), "a_web_80");
    assert_eq!(f.route("theirs.example.com", "/"), "404");
}

#[test]
fn the_oldest_ingress_wins_a_conflict_and_hands_over_when_deleted() {
    let (plain, tls) = (free_port(), free_port());
    let mut s = stores(false);
    apply(&mut s, "ingressclasses", class("haproxy", OURS, true));
    service(&mut s, "a-team", "web", plain, tls);
    service(&mut s, "z-team", "web", plain, tls);
    // z-team's Ingress is older: it wins although its namespace sorts last.
    let tls_spec = |secret: &str| json!([{"hosts": ["shared.example.com"], "secretName": secret}]);
    apply(&mut s, "secrets", fixtures::tls_secret("a-team", "a-tls"));
    apply(&mut s, "secrets", fixtures::tls_secret("z-team", "z-tls"));
    apply(
        &mut s,
        "ingresses",
        ingress(
            "z-team",
            "site",
            T1,
            json!({}),
            json!({"tls": tls_spec("z-tls"),
            "defaultBackend": {"service": {"name": "web", "port": {"number": 80}}},
            "rules": [rule("shared.example.com", "/", "web")]}),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "a-team",
            "site",
            T2,
            json!({}),
            json!({"tls": tls_spec("a-tls"),
            "defaultBackend": {"service": {"name": "web", "port": {"number": 80}}},
            "rules": [rule("shared.example.com", "/", "web"),
                      rule("shared.example.com", "/a-only", "web")]}),
        ),
    );
    let f = front(&s);
    assert_eq!(f.route("shared.example.com", "/"), "z-team_web_80");
    assert_eq!(f.route("shared.example.com", "/x"), "z-team_web_80");
    // A path nobody else claims stays the newer Ingress's.
    assert_eq!(f.route("shared.example.com", "/a-only/x"), "a-team_web_80");
    // The defaultBackend of the oldest Ingress serves what no rule matches.
    assert_eq!(f.route("nobody.example.com", "/"), "z-team_web_80");
    // The loser is told, by name of the winner, for the route, the TLS host and the default.
    for (reason, words) in [
        (
            "RouteConflict",
            "host shared.example.com path / (Prefix) is served by the older Ingress z-team/site",
        ),
        ("TLSHostConflict", "older Ingress z-team/site"),
        ("DefaultBackendConflict", "older Ingress z-team/site"),
    ] {
        let messages = f.events("a-team", "site", reason);
        assert!(
            messages.iter().any(|m| m.contains(words)),
            "{reason}: {messages:?} in {:?}",
            f.events
        );
    }
    assert!(f.events("z-team", "site", "RouteConflict").is_empty());
    drop(f);

    // The winner deleted: the route, the TLS host and the default hand over.
    s.get_mut("ingresses").unwrap().remove("z-team", "site");
    let f = front(&s);
    assert_eq!(f.route("shared.example.com", "/"), "a-team_web_80");
    assert_eq!(f.route("nobody.example.com", "/"), "a-team_web_80");
    assert!(f.events.is_empty(), "{:?}", f.events);
    // Without any defaultBackend, the 404 backend.
    s.get_mut("ingresses").unwrap().remove("a-team", "site");
    let f = front(&s);
    assert_eq!(f.route("nobody.example.com", "/"), "404");
}

#[test]
fn wildcards_match_one_label_and_an_exact_host_wins() {
    let (plain, tls) = (free_port(), free_port());
    let mut s = stores(false);
    apply(&mut s, "ingressclasses", class("haproxy", OURS, true));
    service(&mut s, "w", "wild", plain, tls);
    service(&mut s, "w", "exact", plain, tls);
    apply(
        &mut s,
        "ingresses",
        ingress(
            "w",
            "wild",
            T1,
            json!({}),
            json!({"rules": [rule("*.foo.com", "/", "wild")]}),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "w",
            "exact",
            T2,
            json!({}),
            json!({"rules": [rule("exact.foo.com", "/", "exact")]}),
        ),
    );
    // A resource defaultBackend is unsupported: an Event, and the 404 backend stays.
    apply(
        &mut s,
        "ingresses",
        ingress(
            "w",
            "resource",
            T1,
            json!({}),
            json!({"defaultBackend": {"resource":
            {"apiGroup": "k8s.example.com", "kind": "Bucket", "name": "b"}}}),
        ),
    );
    let f = front(&s);
    for (host, backend) in [
        ("bar.foo.com", "w_wild_80"),
        ("BAR.foo.com:8080", "w_wild_80"),
        ("baz.bar.foo.com", "404"),
        ("foo.com", "404"),
        ("exact.foo.com", "w_exact_80"),
    ] {
        assert_eq!(f.route(host, "/x"), backend, "{host}");
    }
    assert_eq!(
        f.events("w", "resource", "DefaultBackendUnsupported").len(),
        1
    );
}

#[test]
fn tls_hosts_redirect_and_backends_learn_the_client() {
    let (plain, tls, h2c) = (free_port(), free_port(), free_port());
    let _echo = echo_backends(plain, tls, h2c);
    let mut s = stores(false);
    apply(&mut s, "ingressclasses", class("haproxy", OURS, true));
    service(&mut s, "h", "web", plain, tls);
    // A Service whose port speaks HTTP/2 in clear text, and an ExternalName Service.
    apply(
        &mut s,
        "services",
        json!({"metadata": {"namespace": "h", "name": "grpc"}, "spec": {"ports": [
            {"name": "grpc", "port": 81, "appProtocol": "kubernetes.io/h2c"}]}}),
    );
    apply(
        &mut s,
        "endpointslices",
        json!({"metadata": {"namespace": "h", "name": "grpc-1",
                "labels": {"kubernetes.io/service-name": "grpc"}},
            "addressType": "IPv4", "ports": [{"name": "grpc", "port": h2c}],
            "endpoints": [{"addresses": ["127.0.0.1"]}]}),
    );
    apply(
        &mut s,
        "services",
        json!({"metadata": {"namespace": "h", "name": "external"}, "spec": {"type": "ExternalName",
            "externalName": "example.org", "ports": [{"name": "http", "port": 80}]}}),
    );
    apply(&mut s, "secrets", fixtures::tls_secret("h", "tls"));
    let secure_spec = |host: &str| {
        json!({"tls": [{"hosts": [host], "secretName": "tls"}],
            "rules": [rule(host, "/", "web")]})
    };
    apply(
        &mut s,
        "ingresses",
        ingress(
            "h",
            "secure",
            T1,
            json!({}),
            secure_spec("secure.example.com"),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "h",
            "wild",
            T1,
            json!({}),
            secure_spec("*.wild.example.com"),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "h",
            "optout",
            T1,
            json!({"haproxy-haptic.org/ssl-redirect": "false"}),
            secure_spec("optout.example.com"),
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "h",
            "plain",
            T1,
            json!({}),
            json!({"rules": [
                rule("plain.example.com", "/", "web"),
                {"host": "backend-tls.example.com", "http": {"paths": [{"path": "/", "pathType": "Prefix",
                    "backend": {"service": {"name": "web", "port": {"name": "https"}}}}]}},
                {"host": "h2c.example.com", "http": {"paths": [{"path": "/", "pathType": "Prefix",
                    "backend": {"service": {"name": "grpc", "port": {"number": 81}}}}]}},
                rule("external.example.com", "/", "external"),
            ]}),
        ),
    );
    let f = front(&s);

    // Plain HTTP to a host with TLS: 308 to HTTPS, the path kept.
    for host in ["secure.example.com", "a.wild.example.com"] {
        let answer = get(f.http, host, "/cart?x=1", "");
        assert_eq!(answer.status, 308, "{host}: {}", answer.head);
        assert!(
            answer
                .head
                .contains(&format!("\r\nlocation: https://{host}/cart?x=1")),
            "{}",
            answer.head
        );
    }
    // Opted out, or without TLS: served over plain HTTP.
    for host in ["optout.example.com", "plain.example.com"] {
        let answer = get(f.http, host, "/", "");
        assert_eq!(answer.status, 200, "{host}: {}", answer.head);
        assert!(answer.body.starts_with("plain "), "{}", answer.body);
    }

    // X-Forwarded-*: the client's address replaces what it claimed; proto, port, host as sent.
    let answer = get(
        f.http,
        "plain.example.com",
        "/",
        "X-Forwarded-For: 6.6.6.6\r\nX-Forwarded-Proto: https\r\n",
    );
    assert_eq!(
        answer.body,
        format!(
            "plain xff=127.0.0.1 n=1 proto=http port={} host=plain.example.com",
            f.http
        )
    );

    // appProtocol https: the backend is reached over TLS.
    let answer = get(f.http, "backend-tls.example.com", "/", "");
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (200, "tls=1"),
        "{}",
        answer.head
    );
    // appProtocol kubernetes.io/h2c: HTTP/2 in clear text to the backend.
    let answer = get(f.http, "h2c.example.com", "/", "");
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (200, "h2c version=2.0"),
        "{}",
        answer.head
    );
    // An ExternalName Service is not routed, and its Ingress is told.
    assert_eq!(get(f.http, "external.example.com", "/", "").status, 404);
    let events = f.events("h", "plain", "ExternalNameUnsupported");
    assert_eq!(events.len(), 1, "{:?}", f.events);
}
