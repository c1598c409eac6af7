//! ingress-nginx annotations of the reference set at the HTTP level, through a running HAProxy:
//! source allow- and deny-lists (403), the redirects (to HTTPS, permanent, temporal, app-root),
//! the body size (413), what a stored Ingress with a value that does not parse gets (its
//! annotation left out, a source list denying everyone, a Warning Event), and two Ingresses
//! sharing a Service with different annotations.
//!
//! The backend is a second HAProxy that answers with what it received.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use haptic_render::{EventRequest, Renderer, StoreConfig, Stores, fixtures, reference};
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

/// Starts HAProxy on `dir/haproxy.cfg` and waits, with a bound, until `ports` accept.
fn start(dir: tempfile::TempDir, ports: &[u16]) -> Running {
    start_in(dir, ports, false)
}

/// [`start`], in the set's directory (`-C`) when `chdir`: as the agent runs HAProxy.
fn start_in(dir: tempfile::TempDir, ports: &[u16], chdir: bool) -> Running {
    let mut command = Command::new(common::haproxy());
    if chdir {
        command.arg("-C").arg(dir.path());
    }
    let child = command
        .arg("-db")
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let running = Running { child, _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    for port in ports {
        while TcpStream::connect(("127.0.0.1", *port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "haproxy did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    running
}

/// The echo backends: plain HTTP on `plain` (on 127.0.0.1 and 127.0.0.2) answering 200 with
/// the path, Host, X-Forwarded-Prefix and HTTP version it received and the address it was
/// reached on; TLS (the fixture certificate) on `tls`; HTTP/2 in clear
/// text on `h2c`, each saying what it is.
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
         frontend plain\n    bind 127.0.0.1:{plain}\n    bind 127.0.0.2:{plain}\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"uri=%[url] host=%[req.hdr(host)] prefix=%[req.fhdr(x-forwarded-prefix)] ver=%[req.ver] cv=%[req.fhdr(ssl-client-verify)] cs=%[req.fhdr(ssl-client-subject-dn)] cc=%[req.fhdr(ssl-client-cert)] dst=%[dst]\"\n\
         frontend tls\n    bind 127.0.0.1:{tls} ssl crt echo.pem alpn h2,http/1.1\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"tls=%[ssl_fc] ver=%[req.ver]\"\n\
         frontend h2c\n    bind 127.0.0.1:{h2c} proto h2\n\
         \x20   http-request return status 200 content-type text/plain lf-string \"h2c ver=%[req.ver]\"\n"
    );
    std::fs::write(dir.path().join("haproxy.cfg"), cfg).unwrap();
    start(dir, &[plain, tls, h2c])
}

/// An answer: status, head (lowercased) and body.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    /// The value of header `name` (lowercase), if any.
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key == name).then(|| value.trim())
        })
    }
}

/// `method path` with `Host: host`, `headers` (each ending in CRLF) and `body`, on `port`.
fn request(port: u16, method: &str, host: &str, path: &str, headers: &str, body: &str) -> Answer {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n{body}"
    )
    .unwrap();
    let mut response = Vec::new();
    // A server may answer (413) and close before it read the body: what arrived counts.
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
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

fn get(port: u16, host: &str, path: &str) -> Answer {
    request(port, "GET", host, path, "", "")
}

/// The reference stores, with our class the default.
fn stores() -> Stores {
    let mut stores = Stores::new();
    for (name, index) in reference::STORES {
        stores
            .add(name, StoreConfig::index_by(index.iter().copied()))
            .unwrap();
    }
    for (name, derivation) in reference::derivations() {
        stores.derive(name, derivation).unwrap();
    }
    let mut class = fixtures::ingress_class("haproxy", true);
    class["spec"]["controller"] = json!(haptic_render::derived::DEFAULT_CONTROLLER);
    apply(&mut stores, "ingressclasses", class);
    stores
}

fn apply(stores: &mut Stores, store: &str, resource: Json) {
    stores.get_mut(store).unwrap().apply(&resource).unwrap();
}

/// A Service `name` in `namespace`: port 80 (`http`) to the plain echo, 443 (`https`) to the
/// TLS echo, 81 (`h2c`) to the h2c echo, all without appProtocol; one endpoint, 127.0.0.1.
fn service(stores: &mut Stores, namespace: &str, name: &str, ports: (u16, u16, u16)) {
    service_at(stores, namespace, name, ports, &["127.0.0.1"]);
}

/// As [`service`], with endpoints at `addresses`.
fn service_at(
    stores: &mut Stores,
    namespace: &str,
    name: &str,
    ports: (u16, u16, u16),
    addresses: &[&str],
) {
    let endpoints: Vec<Json> = addresses
        .iter()
        .map(|a| json!({"addresses": [a]}))
        .collect();
    apply(
        stores,
        "services",
        json!({"metadata": {"namespace": namespace, "name": name}, "spec": {"ports": [
            {"name": "http", "port": 80},
            {"name": "https", "port": 443},
            {"name": "h2c", "port": 81},
        ]}}),
    );
    apply(
        stores,
        "endpointslices",
        json!({"metadata": {"namespace": namespace, "name": format!("{name}-1"),
                "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": ports.0}, {"name": "https", "port": ports.1},
                {"name": "h2c", "port": ports.2}],
            "endpoints": endpoints}),
    );
}

/// An Ingress `name` in namespace `a` for `host`, Prefix `path` to Service `web` port
/// `port`, with `annotations` (names after the ingress-nginx prefix).
fn ingress(name: &str, host: &str, path: &str, port: u16, annotations: &[(&str, &str)]) -> Json {
    ingress_to(name, host, path, ("web", port), annotations)
}

/// As [`ingress`], to Service `service.0` port `service.1`.
fn ingress_to(
    name: &str,
    host: &str,
    path: &str,
    service: (&str, u16),
    annotations: &[(&str, &str)],
) -> Json {
    let (service, port) = service;
    let annotations: serde_json::Map<String, Json> = annotations
        .iter()
        .map(|(k, v)| (format!("nginx.ingress.kubernetes.io/{k}"), json!(v)))
        .collect();
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"namespace": "a", "name": name, "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": annotations, "uid": format!("uid-{name}")},
        "spec": {"rules": [{"host": host, "http": {"paths": [{"path": path, "pathType": "Prefix",
            "backend": {"service": {"name": service, "port": {"number": port}}}}]}}]}})
}

/// A front HAProxy rendering the reference set over `stores`, and the Events it asks for.
struct Front {
    http: u16,
    https: u16,
    events: Vec<EventRequest>,
    _running: Running,
}

fn front(stores: &Stores) -> Front {
    front_in(stores, false)
}

/// [`front`]; with `chdir`, HAProxy checks and runs in the set's directory (`-C`), as the
/// agent and the render gate run it: HAProxy 2.6 reads a server's `crt` after parsing,
/// relative to its working directory, not to `default-path config`.
fn front_in(stores: &Stores, chdir: bool) -> Front {
    front_with(stores, chdir, None)
}

/// [`front_in`], with `default_certificate` ("namespace/name" of a TLS Secret) served to
/// clients whose SNI matches no host.
fn front_with(stores: &Stores, chdir: bool, default_certificate: Option<&str>) -> Front {
    let (http, https) = (free_port(), free_port());
    let mut set = reference::template_set();
    set.extra_context.insert(
        "haproxy".into(),
        json!({"maxconn": 1000, "http_port": http, "https_port": https,
            "timeout_connect": "2s", "timeout_client": "10s", "timeout_server": "10s",
            "stats_socket": null, "route_debug": false, "health_checks": false,
            "default_certificate": default_certificate}),
    );
    let (files, requests) = Renderer::compile(&set).unwrap().render_all(stores).unwrap();
    let dir = tempfile::tempdir().unwrap();
    files.write_to(dir.path()).unwrap();
    if chdir {
        let check = Command::new(common::haproxy())
            .arg("-c")
            .arg("-C")
            .arg(dir.path())
            .arg("-f")
            .arg(dir.path().join("haproxy.cfg"))
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stderr)
        );
    } else {
        common::check_dir(dir.path());
    }
    Front {
        http,
        https,
        events: requests.events,
        _running: start_in(dir, &[http], chdir),
    }
}

impl Front {
    fn get(&self, host: &str, path: &str) -> Answer {
        get(self.http, host, path)
    }

    /// The Events asked for about Ingress `a/name` with `reason`: their messages.
    fn events(&self, name: &str, reason: &str) -> Vec<&str> {
        self.events
            .iter()
            .filter(|e| e.name.as_deref() == Some(name) && e.reason == reason)
            .map(|e| e.message.as_str())
            .collect()
    }
}

#[test]
fn source_lists_redirects_and_body_size() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    for (name, annotations) in [
        ("open", &[][..]),
        (
            "allowed",
            &[("allowlist-source-range", "10.0.0.0/8, 127.0.0.1")][..],
        ),
        (
            "outside",
            &[("whitelist-source-range", "10.0.0.0/8,::1/128")][..],
        ),
        // allowlist wins over its older name.
        (
            "both",
            &[
                ("whitelist-source-range", "127.0.0.0/8"),
                ("allowlist-source-range", "192.168.0.0/16"),
            ][..],
        ),
        ("denied", &[("denylist-source-range", "127.0.0.0/24")][..]),
        (
            "deny-wins",
            &[
                ("denylist-source-range", "127.0.0.1"),
                ("allowlist-source-range", "127.0.0.0/8"),
            ][..],
        ),
        (
            "broken-allow",
            &[("allowlist-source-range", "10.0.0.300/8")][..],
        ),
        ("broken-deny", &[("denylist-source-range", "nonsense")][..]),
        ("force", &[("force-ssl-redirect", "true")][..]),
        (
            "moved",
            &[("permanent-redirect", "https://new.example.com$request_uri")][..],
        ),
        (
            "moved-308",
            &[
                ("permanent-redirect", "https://new.example.com/x%20y"),
                ("permanent-redirect-code", "308"),
            ][..],
        ),
        (
            "temporary",
            &[
                ("temporal-redirect", "http://$host/maintenance"),
                ("permanent-redirect", "https://ignored.example.com"),
            ][..],
        ),
        ("rooted", &[("app-root", "/app/")][..]),
        ("limited", &[("proxy-body-size", "1k")][..]),
        ("unlimited", &[("proxy-body-size", "0")][..]),
        ("broken-size", &[("proxy-body-size", "10q")][..]),
    ] {
        apply(
            &mut s,
            "ingresses",
            ingress(name, &format!("{name}.example.com"), "/", 80, annotations),
        );
    }
    let f = front(&s);
    let status = |name: &str| f.get(&format!("{name}.example.com"), "/x").status;

    // The source lists: the client is 127.0.0.1.
    for (name, want) in [
        ("open", 200),
        ("allowed", 200),
        ("outside", 403),
        ("both", 403),
        ("denied", 403),
        ("deny-wins", 403),
        // A list that does not parse denies everyone, and says so.
        ("broken-allow", 403),
        ("broken-deny", 403),
    ] {
        assert_eq!(status(name), want, "{name}");
    }
    let invalid = f.events("broken-allow", "AnnotationInvalid");
    assert_eq!(invalid.len(), 1, "{:?}", f.events);
    assert!(
        invalid[0].contains("nginx.ingress.kubernetes.io/allowlist-source-range: \"10.0.0.300/8\" is not an IP address or CIDR: every client is denied (403)"),
        "{}",
        invalid[0]
    );
    assert!(f.events("allowed", "AnnotationInvalid").is_empty());
    assert!(f.events("allowed", "AnnotationNotSupported").is_empty());

    // The redirects.
    let answer = f.get("force.example.com", "/cart?x=1");
    assert_eq!(answer.status, 308, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("https://force.example.com/cart?x=1")
    );
    let answer = f.get("moved.example.com", "/a/b?c=d");
    assert_eq!(answer.status, 301, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("https://new.example.com/a/b?c=d")
    );
    let answer = f.get("moved-308.example.com", "/a");
    assert_eq!(answer.status, 308, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("https://new.example.com/x%20y")
    );
    let answer = f.get("temporary.example.com", "/a");
    assert_eq!(answer.status, 302, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("http://temporary.example.com/maintenance")
    );
    let answer = f.get("rooted.example.com", "/");
    assert_eq!(answer.status, 302, "{answer:?}");
    assert_eq!(answer.header("location"), Some("/app/"));
    let answer = f.get("rooted.example.com", "/app/x");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(answer.body.starts_with("uri=/app/x "), "{}", answer.body);

    // The body size: over 1k is refused with 413; 0 and a size that does not parse are no limit.
    let post = |name: &str, size: usize| {
        request(
            f.http,
            "POST",
            &format!("{name}.example.com"),
            "/upload",
            &format!("Content-Length: {size}\r\n"),
            &"x".repeat(size),
        )
        .status
    };
    assert_eq!(post("limited", 1024), 200);
    assert_eq!(post("limited", 1025), 413);
    assert_eq!(post("unlimited", 5000), 200);
    assert_eq!(post("broken-size", 5000), 200);
    assert!(
        f.events("broken-size", "AnnotationInvalid")
            .first()
            .is_some_and(|m| m
                .contains("nginx.ingress.kubernetes.io/proxy-body-size: \"10q\" is not a size")),
        "{:?}",
        f.events
    );
    let _ = f.https;
}

/// Long lists: HAProxy reads at most 64 words a line, so source lists, limit-whitelist and CORS
/// origins of 150 entries are written over several lines; every entry counts, the last one
/// (on the last line) included.
#[test]
fn long_source_lists_exempt_lists_and_origins() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    // 149 other ranges, then (last) the client's own address, 127.0.0.1.
    let others: Vec<String> = (0..149).map(|i| format!("10.{i}.0.0/16")).collect();
    let with_client = format!("{}, 127.0.0.1/32", others.join(", "));
    let without_client = format!("{}, 192.168.0.0/16", others.join(", "));
    let origins: Vec<String> = (0..149)
        .map(|i| format!("https://app{i}.example.com"))
        .collect();
    let origins = format!("{}, https://last.example.com", origins.join(", "));
    for (name, annotations) in [
        (
            "allowed",
            vec![("whitelist-source-range", with_client.as_str())],
        ),
        (
            "outside",
            vec![("allowlist-source-range", without_client.as_str())],
        ),
        (
            "denied",
            vec![("denylist-source-range", with_client.as_str())],
        ),
        (
            "not-denied",
            vec![("denylist-source-range", without_client.as_str())],
        ),
        (
            "exempt",
            vec![
                ("limit-rps", "1"),
                ("limit-whitelist", with_client.as_str()),
            ],
        ),
        (
            "cors",
            vec![
                ("enable-cors", "true"),
                ("cors-allow-origin", origins.as_str()),
            ],
        ),
    ] {
        apply(
            &mut s,
            "ingresses",
            ingress(name, &format!("{name}.example.com"), "/", 80, &annotations),
        );
    }
    // front() checks the configuration (haproxy -c) before it runs it.
    let f = front(&s);
    let status = |name: &str| f.get(&format!("{name}.example.com"), "/x").status;
    for (name, want) in [
        ("allowed", 200),
        ("outside", 403),
        ("denied", 403),
        ("not-denied", 200),
    ] {
        assert_eq!(status(name), want, "{name}");
    }
    // Exempt from limit-rps 1 (a burst of 5): a quick series of 12 all pass.
    let statuses: Vec<u16> = (0..12).map(|_| status("exempt")).collect();
    assert_eq!(statuses, [200; 12]);
    let preflight = |origin: &str| {
        request(
            f.http,
            "OPTIONS",
            "cors.example.com",
            "/api",
            &format!("Origin: {origin}\r\nAccess-Control-Request-Method: POST\r\n"),
            "",
        )
    };
    for origin in ["https://app0.example.com", "https://last.example.com"] {
        let answer = preflight(origin);
        assert_eq!(answer.status, 204, "{answer:?}");
        assert_eq!(answer.header("access-control-allow-origin"), Some(origin));
    }
    let answer = preflight("https://other.example.com");
    assert_eq!(
        answer.header("access-control-allow-origin"),
        None,
        "{answer:?}"
    );
    let _ = f.https;
}

/// Two Ingresses routing to one Service port with different annotations each keep their own:
/// the Service's backend is written once per policy.
#[test]
fn ingresses_sharing_a_service_keep_their_own_annotations() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    apply(
        &mut s,
        "ingresses",
        ingress("open", "shared.example.com", "/open", 80, &[]),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "closed",
            "shared.example.com",
            "/closed",
            80,
            &[("allowlist-source-range", "10.0.0.0/8")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "same",
            "other.example.com",
            "/",
            80,
            &[("allowlist-source-range", "10.0.0.0/8")],
        ),
    );
    let f = front(&s);
    assert_eq!(f.get("shared.example.com", "/open").status, 200);
    assert_eq!(f.get("shared.example.com", "/closed").status, 403);
    assert_eq!(f.get("other.example.com", "/").status, 403);

    // ssl-redirect "false" keeps plain HTTP for the hosts of the Ingress's TLS section.
    apply(&mut s, "secrets", fixtures::tls_secret("a", "tls"));
    for (name, annotations) in [
        ("tls-default", &[][..]),
        ("tls-plain", &[("ssl-redirect", "false")][..]),
    ] {
        let mut ing = ingress(name, &format!("{name}.example.com"), "/", 80, annotations);
        ing["spec"]["tls"] =
            json!([{"hosts": [format!("{name}.example.com")], "secretName": "tls"}]);
        apply(&mut s, "ingresses", ing);
    }
    let f = front(&s);
    assert_eq!(f.get("tls-default.example.com", "/").status, 308);
    assert_eq!(f.get("tls-plain.example.com", "/").status, 200);
}

/// How the backend is spoken to, what it sees, how long it is waited for, and which endpoint
/// a client sticks to.
#[test]
fn backend_protocol_host_prefix_timeouts_affinity_and_hashing() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    // A backend that accepts and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming() {
            held.push(stream);
        }
    });
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    service_at(&mut s, "a", "pair", ports, &["127.0.0.1", "127.0.0.2"]);
    service(
        &mut s,
        "a",
        "silent",
        (silent_port, silent_port, silent_port),
    );
    for (name, service, annotations) in [
        ("https", ("web", 443), &[("backend-protocol", "HTTPS")][..]),
        ("grpcs", ("web", 443), &[("backend-protocol", "GRPCS")][..]),
        ("grpc", ("web", 81), &[("backend-protocol", "GRPC")][..]),
        ("h2c", ("web", 81), &[("backend-protocol", "h2c")][..]),
        (
            "vhost",
            ("web", 80),
            &[
                ("upstream-vhost", "internal.svc:8080"),
                ("x-forwarded-prefix", "/shop"),
            ][..],
        ),
        ("slow", ("silent", 80), &[("proxy-read-timeout", "1")][..]),
        ("round", ("pair", 80), &[][..]),
        (
            "sticky",
            ("pair", 80),
            &[("affinity", "cookie"), ("session-cookie-name", "route")][..],
        ),
        (
            "hashed",
            ("pair", 80),
            &[("upstream-hash-by", "$arg_user")][..],
        ),
        (
            "ewma",
            ("pair", 80),
            &[("load-balance", "ewma"), ("proxy-connect-timeout", "2s")][..],
        ),
    ] {
        apply(
            &mut s,
            "ingresses",
            ingress_to(
                name,
                &format!("{name}.example.com"),
                "/",
                service,
                annotations,
            ),
        );
    }
    let f = front(&s);
    let body = |name: &str, path: &str| f.get(&format!("{name}.example.com"), path).body;
    assert!(
        body("https", "/").starts_with("tls=1 ver=1.1"),
        "{}",
        body("https", "/")
    );
    assert!(
        body("grpcs", "/").starts_with("tls=1 ver=2.0"),
        "{}",
        body("grpcs", "/")
    );
    assert!(
        body("grpc", "/").starts_with("h2c ver=2.0"),
        "{}",
        body("grpc", "/")
    );
    assert!(
        body("h2c", "/").starts_with("h2c ver=2.0"),
        "{}",
        body("h2c", "/")
    );
    let seen = body("vhost", "/a?b=c");
    assert!(
        seen.starts_with("uri=/a?b=c host=internal.svc:8080 prefix=/shop ver=1.1"),
        "{seen}"
    );

    // proxy-read-timeout: a silent backend is given up on (504) after a second, well before
    // the config's 10s (the client's own read timeout).
    let answer = f.get("slow.example.com", "/");
    assert_eq!(answer.status, 504, "{answer:?}");

    let dst = |answer: &Answer| {
        answer
            .body
            .rsplit_once("dst=")
            .map(|(_, d)| d.to_owned())
            .unwrap_or_default()
    };
    // Without affinity, requests spread over both endpoints.
    let spread: std::collections::BTreeSet<String> = (0..6)
        .map(|_| dst(&f.get("round.example.com", "/")))
        .collect();
    assert_eq!(spread.len(), 2, "{spread:?}");
    // With it, the cookie HAProxy sets keeps a client on one endpoint.
    let first = f.get("sticky.example.com", "/");
    let cookie = first
        .header("set-cookie")
        .and_then(|c| c.split(';').next())
        .unwrap_or_default()
        .to_owned();
    assert!(cookie.starts_with("route="), "{first:?}");
    let pinned: std::collections::BTreeSet<String> = (0..6)
        .map(|_| {
            dst(&request(
                f.http,
                "GET",
                "sticky.example.com",
                "/",
                &format!("Cookie: {cookie}\r\n"),
                "",
            ))
        })
        .collect();
    assert_eq!(pinned.len(), 1, "{pinned:?}");
    assert!(pinned.contains(&dst(&first)), "{pinned:?} {first:?}");
    // upstream-hash-by $arg_user: one user, one endpoint.
    for user in ["alice", "bob", "carol"] {
        let hashed: std::collections::BTreeSet<String> = (0..4)
            .map(|_| dst(&f.get("hashed.example.com", &format!("/?user={user}"))))
            .collect();
        assert_eq!(hashed.len(), 1, "{user}: {hashed:?}");
    }
    assert_eq!(f.get("ewma.example.com", "/").status, 200);
}

/// rewrite-target with capture groups: the Ingress's paths are regular expressions matched from
/// the start (case-insensitively), and the whole path is replaced, the query string kept.
#[test]
fn rewrite_target_with_capture_groups() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    apply(
        &mut s,
        "ingresses",
        ingress("site", "shop.example.com", "/", 80, &[]),
    );
    let mut api = ingress(
        "api",
        "shop.example.com",
        "/api(/|$)(.*)",
        80,
        &[("rewrite-target", "/v2/$2"), ("x-forwarded-prefix", "/api")],
    );
    api["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = json!("ImplementationSpecific");
    apply(&mut s, "ingresses", api);
    apply(
        &mut s,
        "ingresses",
        ingress(
            "docs",
            "docs.example.com",
            "/[a-z]+/docs",
            80,
            &[("use-regex", "true")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "strip",
            "strip.example.com",
            "/old",
            80,
            &[("rewrite-target", "/")],
        ),
    );
    let f = front(&s);
    let seen = |host: &str, path: &str| {
        let answer = f.get(host, path);
        assert_eq!(answer.status, 200, "{host}{path}: {answer:?}");
        answer.body
    };
    for (path, want) in [
        ("/api/users/7?full=1", "uri=/v2/users/7?full=1 "),
        ("/API/users", "uri=/v2/users "),
        ("/api", "uri=/v2/ "),
        // Not the regex: the site's Prefix path, unchanged.
        ("/apiary", "uri=/apiary "),
        ("/shop", "uri=/shop "),
    ] {
        let body = seen("shop.example.com", path);
        assert!(body.starts_with(want), "{path}: {body}");
    }
    assert!(seen("shop.example.com", "/api/x").contains("prefix=/api "));
    // use-regex without a rewrite: matched as a regex, passed on unchanged.
    assert!(seen("docs.example.com", "/en/docs/x").starts_with("uri=/en/docs/x "));
    assert_eq!(f.get("docs.example.com", "/12/docs").status, 404);
    // A target without captures replaces the whole path, as NGINX's rewrite does.
    assert!(seen("strip.example.com", "/old/a/b?q=1").starts_with("uri=/?q=1 "));
}

/// enable-cors: a preflight from an allowed origin is answered here (204) with the headers;
/// other answers to it carry them; an origin not listed gets none, and its preflight goes on to
/// the backend.
#[test]
fn cors_preflights_and_headers() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    apply(
        &mut s,
        "ingresses",
        ingress(
            "any",
            "any.example.com",
            "/",
            80,
            &[("enable-cors", "true")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "listed",
            "listed.example.com",
            "/",
            80,
            &[
                ("enable-cors", "true"),
                (
                    "cors-allow-origin",
                    "https://app.example.com, https://*.tenant.example.com:8443",
                ),
                ("cors-allow-methods", "GET,POST"),
                ("cors-allow-credentials", "false"),
                ("cors-expose-headers", "X-Total"),
                ("cors-max-age", "60"),
            ],
        ),
    );
    let f = front(&s);
    let preflight = |host: &str, origin: &str| {
        request(
            f.http,
            "OPTIONS",
            host,
            "/api",
            &format!("Origin: {origin}\r\nAccess-Control-Request-Method: POST\r\n"),
            "",
        )
    };
    let answer = preflight("any.example.com", "https://whoever.example.org");
    assert_eq!(answer.status, 204, "{answer:?}");
    assert_eq!(answer.header("access-control-allow-origin"), Some("*"));
    assert_eq!(
        answer.header("access-control-allow-credentials"),
        Some("true")
    );
    assert_eq!(
        answer.header("access-control-allow-methods"),
        Some("get, put, post, delete, patch, options")
    );
    assert_eq!(answer.header("access-control-max-age"), Some("1728000"));
    let answer = request(
        f.http,
        "GET",
        "any.example.com",
        "/",
        "Origin: https://whoever.example.org\r\n",
        "",
    );
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.header("access-control-allow-origin"), Some("*"));

    for origin in [
        "https://app.example.com",
        "https://eu.tenant.example.com:8443",
    ] {
        let answer = preflight("listed.example.com", origin);
        assert_eq!(answer.status, 204, "{origin}: {answer:?}");
        assert_eq!(answer.header("access-control-allow-origin"), Some(origin));
        assert_eq!(answer.header("access-control-allow-credentials"), None);
        assert_eq!(
            answer.header("access-control-allow-methods"),
            Some("get, post")
        );
        assert_eq!(
            answer.header("access-control-expose-headers"),
            Some("x-total")
        );
        assert_eq!(answer.header("access-control-max-age"), Some("60"));
    }
    for origin in [
        "https://evil.example.com",
        "http://app.example.com",
        "https://a.b.tenant.example.com:8443",
        "https://app.example.com.evil.org",
    ] {
        let answer = preflight("listed.example.com", origin);
        assert_eq!(answer.status, 200, "{origin}: {answer:?}");
        assert_eq!(
            answer.header("access-control-allow-origin"),
            None,
            "{origin}"
        );
    }
}

/// auth-type basic with auth-secret: 401 without valid credentials, 200 with them; the Secret
/// is read from the Ingress's own namespace only; hashes HAProxy cannot check are left out
/// (with an Event), and with no usable user, or no Secret, every request gets 401.
#[test]
fn basic_authentication_from_a_secret_of_the_ingress_namespace() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    // bcrypt, SHA-512-crypt and MD5-crypt of "secret"; apr1 cannot be checked by crypt(3).
    let htpasswd = "alice:$2b$05$ERu7VgXqoHLTArkD/dYmMuZv5uAxu3YTSmWkbyjNItQuph9sdytmm\n\
                    bob:$6$seeY8xusLGC0yXwP$8GJn.tKxCCQcfLEpaU4k1V64OQrqTC4NNcBOmu9bovcaGPkCNGscVdoRHU3xbCcqC3e8KMj5EDWzdrBl508d0.\n\
                    carol:$1$35.Rg.KE$1VjsdoBWBoqP/DY5oaBDb1\n";
    let secret = |namespace: &str, name: &str, text: &str| {
        use base64::Engine as _;
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"namespace": namespace, "name": name},
            "data": {"auth": base64::engine::general_purpose::STANDARD.encode(text)}})
    };
    apply(&mut s, "auth_secrets", secret("a", "users", htpasswd));
    apply(
        &mut s,
        "auth_secrets",
        secret(
            "a",
            "mixed",
            "dave:$apr1$RiVNuA2X$k/HrzK9dfZk8pRKr1yT2A/\nalice:$2b$05$ERu7VgXqoHLTArkD/dYmMuZv5uAxu3YTSmWkbyjNItQuph9sdytmm\n",
        ),
    );
    // Another namespace's Secret of the same name: never read.
    apply(&mut s, "auth_secrets", secret("b", "theirs", htpasswd));
    // A Secret without the label (only in the other Secret stores): never read either.
    apply(&mut s, "secrets", secret("a", "unlabelled", htpasswd));
    for (name, secret) in [
        ("guarded", "users"),
        ("qualified", "a/users"),
        ("mixed", "mixed"),
        ("missing", "nothing-here"),
        ("foreign", "b/theirs"),
        ("unlabelled", "unlabelled"),
    ] {
        let annotations = [
            ("auth-type", "basic"),
            ("auth-secret", secret),
            ("auth-realm", "Team A only"),
        ];
        apply(
            &mut s,
            "ingresses",
            ingress(name, &format!("{name}.example.com"), "/", 80, &annotations),
        );
    }
    let f = front(&s);
    let with = |name: &str, credentials: Option<&str>| {
        use base64::Engine as _;
        let header = credentials.map_or(String::new(), |c| {
            format!(
                "Authorization: Basic {}\r\n",
                base64::engine::general_purpose::STANDARD.encode(c)
            )
        });
        request(
            f.http,
            "GET",
            &format!("{name}.example.com"),
            "/",
            &header,
            "",
        )
    };
    let answer = with("guarded", None);
    assert_eq!(answer.status, 401, "{answer:?}");
    assert_eq!(
        answer.header("www-authenticate"),
        Some("basic realm=\"team a only\"")
    );
    for user in ["alice", "bob", "carol"] {
        assert_eq!(
            with("guarded", Some(&format!("{user}:secret"))).status,
            200,
            "{user}"
        );
        assert_eq!(
            with("qualified", Some(&format!("{user}:secret"))).status,
            200,
            "{user}"
        );
    }
    assert_eq!(with("guarded", Some("alice:wrong")).status, 401);
    assert_eq!(with("guarded", Some("mallory:secret")).status, 401);
    // The user with an apr1 hash is left out, and an Event says so; the others still log in.
    assert_eq!(with("mixed", Some("alice:secret")).status, 200);
    assert_eq!(with("mixed", Some("dave:secret")).status, 401);
    assert!(
        f.events("mixed", "AnnotationInvalid")
            .iter()
            .any(|m| m.contains("user dave: apr1 hashes cannot be checked")),
        "{:?}",
        f.events
    );
    // No such Secret, or one of another namespace: nobody gets in.
    assert_eq!(with("missing", Some("alice:secret")).status, 401);
    assert!(
        f.events("missing", "AnnotationInvalid")
            .iter()
            .any(|m| m.contains("Secret nothing-here does not exist")),
        "{:?}",
        f.events
    );
    assert_eq!(with("unlabelled", Some("alice:secret")).status, 401);
    assert!(
        f.events("unlabelled", "AnnotationInvalid")
            .iter()
            .any(|m| m.contains("Secret unlabelled does not exist or is not labelled haproxy-haptic.org/auth-secret: \"true\"")),
        "{:?}",
        f.events
    );
    assert_eq!(with("foreign", Some("alice:secret")).status, 401);
    assert!(
        f.events("foreign", "AnnotationInvalid")
            .iter()
            .any(|m| m.contains("\"b/theirs\" is not a Secret of the Ingress's own namespace")),
        "{:?}",
        f.events
    );
}

/// limit-rps: a client sending faster than the rate and its burst gets 503; one in
/// limit-whitelist never does.
#[test]
fn rate_limits_per_client_and_exempt_addresses() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    apply(
        &mut s,
        "ingresses",
        ingress(
            "limited",
            "limited.example.com",
            "/",
            80,
            &[("limit-rps", "1")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "exempt",
            "exempt.example.com",
            "/",
            80,
            &[("limit-rps", "1"), ("limit-whitelist", "127.0.0.0/8")],
        ),
    );
    let f = front(&s);
    // 1 request a second plus a burst of 5: the first 6 of a quick series pass, the rest of
    // the second are refused.
    let statuses: Vec<u16> = (0..12)
        .map(|_| f.get("limited.example.com", "/").status)
        .collect();
    assert_eq!(statuses[..6], [200; 6], "{statuses:?}");
    assert!(statuses[6..].contains(&503), "{statuses:?}");
    let statuses: Vec<u16> = (0..12)
        .map(|_| f.get("exempt.example.com", "/").status)
        .collect();
    assert_eq!(statuses, [200; 12]);
}

/// server-alias: the alias hosts route as the Ingress's own host, annotations included.
#[test]
fn server_aliases_route_like_the_host() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    apply(
        &mut s,
        "ingresses",
        ingress(
            "site",
            "shop.example.com",
            "/",
            80,
            &[
                ("server-alias", "www.shop.example.com, *.shop.example.org"),
                ("x-forwarded-prefix", "/alias"),
            ],
        ),
    );
    let f = front(&s);
    for host in [
        "shop.example.com",
        "www.shop.example.com",
        "eu.shop.example.org",
    ] {
        let answer = f.get(host, "/x");
        assert_eq!(answer.status, 200, "{host}: {answer:?}");
        assert!(
            answer.body.contains("prefix=/alias "),
            "{host}: {}",
            answer.body
        );
    }
    assert_eq!(f.get("other.example.com", "/x").status, 404);
}

/// canary: a canary Ingress claims no route (though older, it takes nothing from the main
/// Ingress of the same host and path) and gets the main route's requests by header (always,
/// never, a value, a pattern), then cookie, then weight, in ingress-nginx's precedence.
#[test]
fn canaries_by_header_cookie_and_weight() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    // The main Service answers from 127.0.0.1, the canary's from 127.0.0.2.
    service(&mut s, "a", "web", ports);
    service_at(&mut s, "a", "next", ports, &["127.0.0.2"]);
    let canaries: [(&str, &[(&str, &str)]); 6] = [
        ("w0", &[("canary-weight", "0")]),
        ("w100", &[("canary-weight", "100")]),
        ("w50", &[("canary-weight", "50")]),
        (
            "prec",
            &[
                ("canary-by-header", "X-Canary"),
                ("canary-by-cookie", "canary"),
                ("canary-weight", "10"),
                ("canary-weight-total", "10"),
            ],
        ),
        (
            "hval",
            &[
                ("canary-by-header", "X-Version"),
                ("canary-by-header-value", "v2"),
            ],
        ),
        (
            "hpat",
            &[
                ("canary-by-header", "X-Version"),
                ("canary-by-header-pattern", "^(beta|v[0-9]+)$"),
            ],
        ),
    ];
    for (name, annotations) in canaries {
        let host = format!("{name}.example.com");
        // The canary sorts first (c- < m-): it would win the route if it claimed one.
        let mut with_flag = vec![("canary", "true")];
        with_flag.extend_from_slice(annotations);
        apply(
            &mut s,
            "ingresses",
            ingress_to(&format!("c-{name}"), &host, "/", ("next", 80), &with_flag),
        );
        apply(
            &mut s,
            "ingresses",
            ingress_to(&format!("m-{name}"), &host, "/", ("web", 80), &[]),
        );
    }
    // A main route with an allow-list (it admits the client): its canary gets the requests,
    // through the main's rules.
    apply(
        &mut s,
        "ingresses",
        ingress_to(
            "c-guarded",
            "guarded.example.com",
            "/",
            ("next", 80),
            &[("canary", "true"), ("canary-weight", "100")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress_to(
            "m-guarded",
            "guarded.example.com",
            "/",
            ("web", 80),
            &[("allowlist-source-range", "127.0.0.0/8")],
        ),
    );
    let f = front(&s);
    let canary = |host: &str, headers: &str| -> bool {
        let answer = request(
            f.http,
            "GET",
            &format!("{host}.example.com"),
            "/some/path",
            headers,
            "",
        );
        assert_eq!(answer.status, 200, "{host} {headers:?}: {answer:?}");
        assert!(
            answer.body.ends_with("dst=127.0.0.1") || answer.body.ends_with("dst=127.0.0.2"),
            "{}",
            answer.body
        );
        answer.body.ends_with("dst=127.0.0.2")
    };
    assert!((0..40).all(|_| !canary("w0", "")));
    assert!((0..40).all(|_| canary("w100", "")));
    // 400 requests at 50 %: the count is 200 ± 10 (one standard deviation); outside 120-280
    // is eight of them (a chance below 1e-14).
    let hits = (0..400).filter(|_| canary("w50", "")).count();
    assert!((120..=280).contains(&hits), "{hits} of 400 to the canary");
    // Header, then cookie, then weight (10 of 10: always).
    assert!(canary("prec", ""));
    assert!(!canary("prec", "X-Canary: never\r\n"));
    assert!(!canary(
        "prec",
        "X-Canary: never\r\nCookie: canary=always\r\n"
    ));
    assert!(canary(
        "prec",
        "X-Canary: always\r\nCookie: canary=never\r\n"
    ));
    assert!(!canary(
        "prec",
        "X-Canary: maybe\r\nCookie: canary=never\r\n"
    ));
    assert!(!canary("prec", "Cookie: other=1; canary=never\r\n"));
    assert!(canary("prec", "Cookie: canary=always\r\n"));
    // A value or a pattern replaces `always`; no weight: nothing else goes.
    assert!(canary("hval", "X-Version: v2\r\n"));
    assert!(!canary("hval", "X-Version: always\r\n"));
    assert!(!canary("hval", "X-Version: v3\r\n"));
    assert!(!canary("hval", ""));
    assert!(canary("hpat", "X-Version: v7\r\n"));
    assert!(canary("hpat", "X-Version: beta\r\n"));
    assert!(!canary("hpat", "X-Version: alpha\r\n"));
    assert!((0..20).all(|_| canary("guarded", "")));
    // Neither Ingress is told of a conflict.
    assert!(
        f.events.iter().all(|e| e.reason != "RouteConflict"),
        "{:?}",
        f.events
    );
}

/// canary behind a main route with a policy (annotations that ask something of its requests):
/// the canary's requests go to the canary's Service through the main Ingress's rules, as
/// ingress-nginx applies the main's location config to them: the allow-list (a client it
/// excludes gets 403 whichever Service would answer), the body size (413), basic
/// authentication (401 without credentials). A main whose path is a regex, or of another
/// namespace with a policy that reads Secrets (the canary's backend would read its own
/// namespace's), never sends requests to the canary; one of another namespace without Secrets
/// does.
#[test]
fn canaries_go_through_the_main_routes_rules() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    // The main Service answers from 127.0.0.1, the canaries' from 127.0.0.2.
    service(&mut s, "a", "web", ports);
    service_at(&mut s, "a", "next", ports, &["127.0.0.2"]);
    service_at(&mut s, "b", "next", ports, &["127.0.0.2"]);
    // bcrypt of "secret", in both namespaces: a canary of b must still not get a's main's.
    let htpasswd = "alice:$2b$05$ERu7VgXqoHLTArkD/dYmMuZv5uAxu3YTSmWkbyjNItQuph9sdytmm\n";
    for namespace in ["a", "b"] {
        use base64::Engine as _;
        apply(
            &mut s,
            "auth_secrets",
            json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"namespace": namespace, "name": "users"},
                "data": {"auth": base64::engine::general_purpose::STANDARD.encode(htpasswd)}}),
        );
    }
    let by_weight = [("canary", "true"), ("canary-weight", "100")];
    let by_header = [("canary", "true"), ("canary-by-header", "X-Canary")];
    let limited = [("proxy-body-size", "1k")];
    let auth = [("auth-type", "basic"), ("auth-secret", "users")];
    type Annotations<'a> = &'a [(&'a str, &'a str)];
    // (host, the main's annotations, the canary's, the canary's namespace)
    let mains: [(&str, Annotations, Annotations, &str); 6] = [
        (
            "open",
            &[
                ("whitelist-source-range", "127.0.0.1/32"),
                ("proxy-body-size", "1k"),
            ],
            &by_weight,
            "a",
        ),
        (
            "closed",
            &[("whitelist-source-range", "10.0.0.0/8")],
            &by_header,
            "a",
        ),
        ("authed", &auth, &by_weight, "a"),
        ("authed-elsewhere", &auth, &by_weight, "b"),
        ("limited-elsewhere", &limited, &by_weight, "b"),
        (
            "regex",
            &[("use-regex", "true"), ("proxy-body-size", "1k")],
            &by_weight,
            "a",
        ),
    ];
    for (name, main, canary, namespace) in mains {
        let host = format!("{name}.example.com");
        let mut c = ingress_to(&format!("c-{name}"), &host, "/", ("next", 80), canary);
        c["metadata"]["namespace"] = json!(namespace);
        apply(&mut s, "ingresses", c);
        apply(
            &mut s,
            "ingresses",
            ingress_to(&format!("m-{name}"), &host, "/", ("web", 80), main),
        );
    }
    let f = front(&s);
    let send = |name: &str, headers: &str, size: usize| {
        request(
            f.http,
            "POST",
            &format!("{name}.example.com"),
            "/some/path",
            &format!("{headers}Content-Length: {size}\r\n"),
            &"x".repeat(size),
        )
    };
    let to = |name: &str, headers: &str, dst: &str| {
        for _ in 0..10 {
            let answer = send(name, headers, 10);
            assert_eq!(answer.status, 200, "{name}: {answer:?}");
            assert!(answer.body.ends_with(dst), "{name}: {}", answer.body);
        }
    };
    // Allowed: every request goes to the canary, the main's body size applies.
    to("open", "", "dst=127.0.0.2");
    assert_eq!(send("open", "", 1024).status, 200);
    assert_eq!(send("open", "", 1025).status, 413);
    // Excluded by the main's allow-list: 403, to the canary or not.
    assert_eq!(send("closed", "X-Canary: always\r\n", 10).status, 403);
    assert_eq!(send("closed", "", 10).status, 403);
    // The main's authentication: credentials needed on the canary too.
    let alice = "Authorization: Basic YWxpY2U6c2VjcmV0\r\n";
    to("authed", alice, "dst=127.0.0.2");
    assert_eq!(send("authed", "", 10).status, 401);
    // Another namespace: a policy without Secrets applies to its canary...
    to("limited-elsewhere", "", "dst=127.0.0.2");
    assert_eq!(send("limited-elsewhere", "", 1025).status, 413);
    // ...one with Secrets, and a regex main route, keep their requests, their rules applied.
    to("authed-elsewhere", alice, "dst=127.0.0.1");
    assert_eq!(send("authed-elsewhere", "", 10).status, 401);
    to("regex", "", "dst=127.0.0.1");
    assert_eq!(send("regex", "", 1025).status, 413);
}

/// from-to-www-redirect: the www./bare twin of the Ingress's host is redirected to it (308, path
/// and query kept), unless a route takes the request.
#[test]
fn from_to_www_redirects_to_the_twin_host() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    let www = [("from-to-www-redirect", "true")];
    for (name, host) in [
        ("shop", "shop.example.org"),
        ("blog", "www.blog.example.org"),
        ("taken", "taken.example.org"),
    ] {
        apply(&mut s, "ingresses", ingress(name, host, "/", 80, &www));
    }
    // The twin of taken.example.org is routed by an Ingress of its own.
    apply(
        &mut s,
        "ingresses",
        ingress("twin", "www.taken.example.org", "/", 80, &[]),
    );
    let f = front(&s);
    let answer = f.get("www.shop.example.org", "/cart?item=1");
    assert_eq!(answer.status, 308, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("http://shop.example.org/cart?item=1")
    );
    let answer = f.get("blog.example.org:80", "/post");
    assert_eq!(answer.status, 308, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some("http://www.blog.example.org/post")
    );
    assert_eq!(f.get("shop.example.org", "/cart").status, 200);
    assert_eq!(f.get("www.taken.example.org", "/").status, 200);
    assert_eq!(f.get("www.other.example.org", "/").status, 404);
}

/// service-upstream: the route's backend sends to the Service's cluster IP and port, not to its
/// endpoints; a route to the same Service without it keeps the endpoints.
#[test]
fn service_upstream_goes_to_the_cluster_ip() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    // The Service's port is the echo's, its cluster IP 127.0.0.2, its endpoint 127.0.0.1.
    apply(
        &mut s,
        "services",
        json!({"metadata": {"namespace": "a", "name": "web"},
            "spec": {"clusterIP": "127.0.0.2", "ports": [{"name": "http", "port": ports.0}]}}),
    );
    apply(
        &mut s,
        "endpointslices",
        json!({"metadata": {"namespace": "a", "name": "web-1",
                "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": ports.0}],
            "endpoints": [{"addresses": ["127.0.0.1"]}]}),
    );
    apply(
        &mut s,
        "ingresses",
        ingress(
            "upstream",
            "upstream.example.com",
            "/",
            ports.0,
            &[("service-upstream", "true")],
        ),
    );
    apply(
        &mut s,
        "ingresses",
        ingress("direct", "direct.example.com", "/", ports.0, &[]),
    );
    let f = front(&s);
    for _ in 0..5 {
        let answer = f.get("upstream.example.com", "/");
        assert!(answer.body.ends_with("dst=127.0.0.2"), "{answer:?}");
        let answer = f.get("direct.example.com", "/");
        assert!(answer.body.ends_with("dst=127.0.0.1"), "{answer:?}");
    }
}

/// A CA (certificate PEM) and a client certificate it signed for `name` (certificate and key
/// PEM).
fn client_pki(name: &str) -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut client = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    client
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let cert = client.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

/// `GET https://host/` on `port` through curl (the server's certificate not checked), with the
/// client certificate `cert` (files: certificate, key): status and body; status 0 when the
/// handshake failed.
fn https_get(
    port: u16,
    host: &str,
    cert: Option<(&std::path::Path, &std::path::Path)>,
) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sk",
        "--max-time",
        "10",
        "-w",
        "\n%{http_code}",
        "--resolve",
    ])
    .arg(format!("{host}:{port}:127.0.0.1"))
    .arg(format!("https://{host}:{port}/"));
    if let Some((c, k)) = cert {
        cmd.arg("--cert").arg(c).arg("--key").arg(k);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// auth-tls-*: a certificate the Secret's CA signed passes, another or none gets 400 (`on`),
/// `optional` admits none, auth-tls-error-page redirects, the backend learns the verdict and
/// the certificate; a Secret missing or of another namespace fails closed (403, an Event);
/// `off` asks nothing.
#[test]
fn client_certificates_verified_against_the_secret_ca() {
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", ports);
    let (ca, alice, alice_key) = client_pki("alice");
    let (_, mallory, mallory_key) = client_pki("mallory");
    let b64 = |t: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(t)
    };
    apply(
        &mut s,
        "auth_secrets",
        json!({"metadata": {"namespace": "a", "name": "client-ca",
                "labels": {"haproxy-haptic.org/auth-secret": "true"}},
            "type": "Opaque", "data": {"ca.crt": b64(&ca)}}),
    );
    apply(
        &mut s,
        "auth_secrets",
        json!({"metadata": {"namespace": "b", "name": "client-ca",
                "labels": {"haproxy-haptic.org/auth-secret": "true"}},
            "type": "Opaque", "data": {"ca.crt": b64(&ca)}}),
    );
    apply(&mut s, "secrets", fixtures::tls_secret("a", "tls"));
    for (name, annotations) in [
        (
            "on",
            &[
                ("auth-tls-secret", "a/client-ca"),
                ("auth-tls-pass-certificate-to-upstream", "true"),
            ][..],
        ),
        (
            "optional",
            &[
                ("auth-tls-secret", "client-ca"),
                ("auth-tls-verify-client", "optional"),
            ][..],
        ),
        (
            "errorpage",
            &[
                ("auth-tls-secret", "client-ca"),
                ("auth-tls-error-page", "https://login.example.com/cert"),
            ][..],
        ),
        ("missing", &[("auth-tls-secret", "nope")][..]),
        ("theirs", &[("auth-tls-secret", "b/client-ca")][..]),
        (
            "off",
            &[
                ("auth-tls-secret", "nope"),
                ("auth-tls-verify-client", "off"),
            ][..],
        ),
    ] {
        let host = format!("{name}.example.com");
        let mut ing = ingress(name, &host, "/", 80, annotations);
        ing["spec"]["tls"] = json!([{"hosts": [host], "secretName": "tls"}]);
        apply(&mut s, "ingresses", ing);
    }
    let f = front(&s);
    let dir = tempfile::tempdir().unwrap();
    let files = |name: &str, cert: &str, key: &str| {
        let (c, k) = (
            dir.path().join(format!("{name}.crt")),
            dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        (c, k)
    };
    let alice = files("alice", &alice, &alice_key);
    let mallory = files("mallory", &mallory, &mallory_key);
    let alice = Some((alice.0.as_path(), alice.1.as_path()));
    let mallory = Some((mallory.0.as_path(), mallory.1.as_path()));

    // `on`: only a certificate the CA signed passes; the backend learns who.
    let (status, body) = https_get(f.https, "on.example.com", alice);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("cv=SUCCESS cs=CN=alice "), "{body}");
    assert!(
        body.contains("cc=-----BEGIN%20CERTIFICATE-----%0AMII"),
        "{body}"
    );
    assert_eq!(https_get(f.https, "on.example.com", None).0, 400);
    assert_eq!(https_get(f.https, "on.example.com", mallory).0, 400);
    // Plain HTTP goes to HTTPS first (the host has a certificate), as with ingress-nginx.
    assert_eq!(f.get("on.example.com", "/").status, 308);
    // `optional`: no certificate passes, a bad one does not.
    let (status, body) = https_get(f.https, "optional.example.com", None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("cv=NONE "), "{body}");
    assert_eq!(https_get(f.https, "optional.example.com", alice).0, 200);
    assert_eq!(https_get(f.https, "optional.example.com", mallory).0, 400);
    // auth-tls-error-page: a redirect instead of the 400.
    assert_eq!(https_get(f.https, "errorpage.example.com", mallory).0, 302);
    assert_eq!(https_get(f.https, "errorpage.example.com", alice).0, 200);
    // A Secret that is missing, or of another namespace: every client is denied.
    assert_eq!(https_get(f.https, "missing.example.com", alice).0, 403);
    assert_eq!(https_get(f.https, "theirs.example.com", alice).0, 403);
    assert!(
        f.events("missing", "AnnotationInvalid").iter().any(|m| m
            .contains("nginx.ingress.kubernetes.io/auth-tls-secret: Secret nope does not exist")),
        "{:?}",
        f.events
    );
    assert!(
        f.events("theirs", "AnnotationInvalid")
            .iter()
            .any(|m| m.contains("\"b/client-ca\" is not a Secret of the Ingress's own namespace")),
        "{:?}",
        f.events
    );
    // `off`: no certificate asked for, the route served.
    assert_eq!(https_get(f.https, "off.example.com", None).0, 200);
    assert!(f.events("off", "AnnotationInvalid").is_empty());
}

/// A CA and a certificate it signed (certificate and key PEM) for `sans` (a client
/// certificate with a common name when empty).
fn issued(ca_name: &str, cn: &str, sans: &[&str]) -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, ca_name);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut leaf =
        rcgen::CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .unwrap();
    leaf.distinguished_name.push(rcgen::DnType::CommonName, cn);
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

/// proxy-ssl-*: the backend's certificate verified against the Secret's ca.crt and the
/// proxy-ssl-name (503 when it does not match), the Secret's client certificate shown to a
/// backend that requires one, proxy-ssl-name sent as SNI; a Secret that is missing fails
/// closed (503, an Event).
#[test]
fn backend_tls_verified_with_the_secret_and_a_client_certificate() {
    // The backend: TLS with a certificate for backend.internal, requiring a client
    // certificate of its own CA, answering with the SNI and the client's name.
    let (server_ca, server_cert, server_key) =
        issued("server CA", "backend", &["backend.internal"]);
    let (client_ca, client_cert, client_key) = issued("client CA", "haptic", &[]);
    let (other_ca, _, _) = issued("other CA", "x", &["backend.internal"]);
    let tls = free_port();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("server.pem"),
        format!("{server_cert}{server_key}"),
    )
    .unwrap();
    std::fs::write(dir.path().join("client-ca.pem"), &client_ca).unwrap();
    std::fs::write(
        dir.path().join("haproxy.cfg"),
        format!(
            "global\n    maxconn 100\n    default-path config\n\
             defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
             frontend tls\n    bind 127.0.0.1:{tls} ssl crt server.pem ca-file client-ca.pem verify required\n\
             \x20   http-request return status 200 content-type text/plain lf-string \"sni=%[ssl_fc_sni] client=%[ssl_c_s_dn(cn)]\"\n"
        ),
    )
    .unwrap();
    let _backend = start(dir, &[tls]);
    let ports = (free_port(), free_port(), free_port());
    let _echo = echo_backends(ports.0, ports.1, ports.2);
    let mut s = stores();
    service(&mut s, "a", "web", (ports.0, tls, ports.2));
    let b64 = |t: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(t)
    };
    for (name, ca) in [("backend-tls", &server_ca), ("wrong-ca", &other_ca)] {
        apply(
            &mut s,
            "auth_secrets",
            json!({"metadata": {"namespace": "a", "name": name,
                    "labels": {"haproxy-haptic.org/auth-secret": "true"}},
                "type": "Opaque", "data": {"ca.crt": b64(ca), "tls.crt": b64(&client_cert),
                    "tls.key": b64(&client_key)}}),
        );
    }
    let https = [("backend-protocol", "HTTPS")];
    for (name, annotations) in [
        (
            "verified",
            vec![
                ("proxy-ssl-secret", "a/backend-tls"),
                ("proxy-ssl-verify", "on"),
                ("proxy-ssl-name", "backend.internal"),
                ("proxy-ssl-server-name", "on"),
                ("proxy-ssl-protocols", "TLSv1.2 TLSv1.3"),
            ],
        ),
        (
            "wrong-name",
            vec![
                ("proxy-ssl-secret", "backend-tls"),
                ("proxy-ssl-verify", "on"),
                ("proxy-ssl-name", "other.internal"),
            ],
        ),
        (
            "wrong-ca",
            vec![("proxy-ssl-secret", "wrong-ca"), ("proxy-ssl-verify", "on")],
        ),
        ("unverified", vec![("proxy-ssl-secret", "wrong-ca")]),
        ("missing", vec![("proxy-ssl-secret", "nope")]),
        ("plain", vec![]),
    ] {
        let mut all = https.to_vec();
        all.extend(annotations);
        apply(
            &mut s,
            "ingresses",
            ingress(name, &format!("{name}.example.com"), "/", 443, &all),
        );
    }
    let f = front_in(&s, true);
    let verified = f.get("verified.example.com", "/");
    assert_eq!(verified.status, 200, "{verified:?}");
    assert_eq!(verified.body, "sni=backend.internal client=haptic");
    // A certificate that does not verify: HAProxy gives the connection up (503).
    assert_eq!(f.get("wrong-name.example.com", "/").status, 503);
    assert_eq!(f.get("wrong-ca.example.com", "/").status, 503);
    // Not verified: the client certificate is still shown (the backend requires one).
    let unverified = f.get("unverified.example.com", "/");
    assert_eq!(unverified.status, 200, "{unverified:?}");
    assert_eq!(unverified.body, "sni= client=haptic");
    // Without proxy-ssl-secret the backend refuses the handshake: no client certificate.
    let plain = f.get("plain.example.com", "/").status;
    assert!(matches!(plain, 502 | 503), "{plain}");
    assert_eq!(f.get("missing.example.com", "/").status, 503);
    assert!(
        f.events("missing", "AnnotationInvalid").iter().any(|m| m
            .contains("nginx.ingress.kubernetes.io/proxy-ssl-secret: Secret nope does not exist")),
        "{:?}",
        f.events
    );
}

/// `GET https://host:port<path>` through curl from `from` (a local address): exit code,
/// status (0 without an answer) and body. With `ca`, the server's certificate must chain to
/// it and name the host (else the handshake fails, curl's exit code 60); without, it is not
/// checked.
fn curl_https(
    port: u16,
    host: &str,
    path: &str,
    from: &str,
    ca: Option<&std::path::Path>,
) -> (i32, u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-s",
        "--max-time",
        "10",
        "-w",
        "\n%{http_code}",
        "--interface",
        from,
    ])
    .arg("--resolve")
    .arg(format!("{host}:{port}:127.0.0.1"));
    match ca {
        Some(ca) => cmd.arg("--cacert").arg(ca),
        None => cmd.arg("-k"),
    };
    let out = cmd
        .arg(format!("https://{host}:{port}{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        out.status.code().unwrap_or(-1),
        code.trim().parse().unwrap_or(0),
        body.to_owned(),
    )
}

/// An Ingress `name` of namespace `a` created at `created`, with `rules` (`[host, path,
/// service, port]` each, Prefix paths), TLS `hosts` with the Secret `tls` (none when
/// empty) and ingress-nginx `annotations`.
fn ingress_rules(
    name: &str,
    created: &str,
    rules: &[(&str, &str, &str, u16)],
    tls: &[&str],
    annotations: &[(&str, &str)],
) -> Json {
    let annotations: serde_json::Map<String, Json> = annotations
        .iter()
        .map(|(k, v)| (format!("nginx.ingress.kubernetes.io/{k}"), json!(v)))
        .collect();
    let rules: Vec<Json> = rules
        .iter()
        .map(|(host, path, service, port)| {
            json!({"host": host, "http": {"paths": [{"path": path, "pathType": "Prefix",
                "backend": {"service": {"name": service, "port": {"number": port}}}}]}})
        })
        .collect();
    let mut ing = json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"namespace": "a", "name": name, "creationTimestamp": created,
            "annotations": annotations, "uid": format!("uid-{name}")},
        "spec": {"rules": rules}});
    if !tls.is_empty() {
        ing["spec"]["tls"] = json!([{"hosts": tls, "secretName": "tls"}]);
    }
    ing
}

/// ssl-passthrough: a TLS connection whose SNI is a passthrough host (or matches a wildcard
/// one) reaches the backend untouched, which shows its own certificate; another host on the
/// same port is still terminated by HAProxy, routed by path, with the client's address in
/// X-Forwarded-For (carried by PROXY protocol through the passthrough frontend); plain HTTP to
/// the passthrough host is routed as before; an unknown SNI is refused (strict-sni) as
/// before; a host an older Ingress names is not taken (PassthroughConflict), and an older
/// passthrough takes a younger Ingress's TLS host (TLSHostConflict).
#[test]
fn ssl_passthrough_by_sni_next_to_terminated_hosts() {
    // The passthrough backend: TLS with a certificate of its own CA for the passthrough
    // hosts, answering with the SNI it got; and a plain echo showing X-Forwarded-For.
    let (ca, cert, key) = issued(
        "passthrough CA",
        "passthrough-backend",
        &["pass.example.com", "x.wild.example.com", "mine.example.com"],
    );
    let (tls, plain) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("backend.pem"), format!("{cert}{key}")).unwrap();
    std::fs::write(
        dir.path().join("haproxy.cfg"),
        format!(
            "global\n    maxconn 100\n    default-path config\n\
             defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
             frontend tls\n    bind 127.0.0.1:{tls} ssl crt backend.pem\n\
             \x20   http-request return status 200 content-type text/plain lf-string \"passthrough sni=%[ssl_fc_sni] xff=%[req.fhdr(x-forwarded-for)]\"\n\
             frontend plain\n    bind 127.0.0.1:{plain}\n\
             \x20   http-request return status 200 content-type text/plain lf-string \"plain uri=%[url] host=%[req.hdr(host)] xff=%[req.fhdr(x-forwarded-for)] proto=%[req.fhdr(x-forwarded-proto)] port=%[req.fhdr(x-forwarded-port)]\"\n"
        ),
    )
    .unwrap();
    let _backend = start(dir, &[tls, plain]);
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca_file.path(), &ca).unwrap();
    let ca = Some(ca_file.path());

    let mut s = stores();
    service(&mut s, "a", "secure", (plain, tls, plain));
    apply(&mut s, "secrets", fixtures::tls_secret("a", "tls"));
    let (old, new) = ("2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z");
    let pass = [("ssl-passthrough", "true")];
    for ing in [
        // Its `/` goes to the TLS port; /plain to the plain echo, for HTTP.
        ingress_rules(
            "pass",
            new,
            &[
                ("pass.example.com", "/", "secure", 443),
                ("pass.example.com", "/plain", "secure", 80),
            ],
            &[],
            &pass,
        ),
        ingress_rules(
            "wild",
            new,
            &[("*.wild.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
        // Terminated by HAProxy.
        ingress_rules(
            "term",
            new,
            &[("term.example.com", "/", "secure", 80)],
            &["term.example.com"],
            &[],
        ),
        // An older Ingress's TLS host is not taken by a younger passthrough...
        ingress_rules(
            "older-tls",
            old,
            &[("taken.example.com", "/", "secure", 80)],
            &["taken.example.com"],
            &[],
        ),
        ingress_rules(
            "late-pass",
            new,
            &[("taken.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
        // Nor is a host an older Ingress routes, without TLS of its own (served with the
        // default certificate, when there is one).
        ingress_rules(
            "older-route",
            old,
            &[("routed.example.com", "/", "secure", 80)],
            &[],
            &[],
        ),
        ingress_rules(
            "late-pass-2",
            new,
            &[("routed.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
        // A wildcard passthrough does not take a host one label under it that an older
        // Ingress routes.
        ingress_rules(
            "older-exact",
            old,
            &[("y.wild2.example.com", "/", "secure", 80)],
            &[],
            &[],
        ),
        ingress_rules(
            "late-wild",
            new,
            &[("*.wild2.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
        // ...and an older passthrough takes a younger Ingress's TLS host.
        ingress_rules(
            "first-pass",
            old,
            &[("mine.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
        ingress_rules(
            "late-tls",
            new,
            &[("mine.example.com", "/tls", "secure", 80)],
            &["mine.example.com"],
            &[],
        ),
    ] {
        apply(&mut s, "ingresses", ing);
    }
    let f = front(&s);

    // Passed through: the backend's own certificate (it verifies against the backend's CA,
    // for the host), the backend's answer, no header of HAProxy's.
    let (exit, status, body) = curl_https(f.https, "pass.example.com", "/", "127.0.0.2", ca);
    assert_eq!((exit, status), (0, 200), "{body}");
    assert_eq!(body, "passthrough sni=pass.example.com xff=");
    let (exit, status, body) = curl_https(f.https, "x.wild.example.com", "/", "127.0.0.1", ca);
    assert_eq!((exit, status), (0, 200), "{body}");
    assert_eq!(body, "passthrough sni=x.wild.example.com xff=");
    // The wildcard is one label.
    let (exit, _, _) = curl_https(f.https, "y.x.wild.example.com", "/", "127.0.0.1", ca);
    assert_ne!(exit, 0);

    // Terminated by HAProxy: its certificate (not the backend CA's: curl refuses it), routed
    // by path, the client's own address in X-Forwarded-For, the port it connected to.
    let (exit, _, _) = curl_https(f.https, "term.example.com", "/", "127.0.0.2", ca);
    assert_eq!(
        exit, 60,
        "HAProxy's certificate does not chain to the backend's CA"
    );
    let (exit, status, body) =
        curl_https(f.https, "term.example.com", "/docs?q=1", "127.0.0.2", None);
    assert_eq!((exit, status), (0, 200), "{body}");
    assert_eq!(
        body,
        format!(
            "plain uri=/docs?q=1 host=term.example.com:{} xff=127.0.0.2 proto=https port={}",
            f.https, f.https
        )
    );
    // An unknown SNI: no default certificate, so refused (strict-sni), as before; with one,
    // it is served (and the request finds no route).
    let (exit, status, _) = curl_https(f.https, "unknown.example.com", "/", "127.0.0.1", None);
    assert_ne!(exit, 0);
    assert_eq!(status, 0);
    let with_default = front_with(&s, false, Some("a/tls"));
    let (exit, status, body) = curl_https(
        with_default.https,
        "unknown.example.com",
        "/",
        "127.0.0.1",
        None,
    );
    assert_eq!((exit, status), (0, 404), "{body}");
    let (exit, status, body) =
        curl_https(with_default.https, "pass.example.com", "/", "127.0.0.1", ca);
    assert_eq!((exit, status), (0, 200), "{body}");
    let (exit, status, body) = curl_https(
        with_default.https,
        "routed.example.com",
        "/",
        "127.0.0.1",
        None,
    );
    assert_eq!((exit, status), (0, 200), "{body}");
    assert!(
        body.starts_with("plain uri=/ host=routed.example.com"),
        "{body}"
    );
    let (exit, status, body) = curl_https(
        with_default.https,
        "y.wild2.example.com",
        "/",
        "127.0.0.1",
        None,
    );
    assert_eq!((exit, status), (0, 200), "{body}");
    assert!(
        body.starts_with("plain uri=/ host=y.wild2.example.com"),
        "{body}"
    );
    assert_eq!(
        with_default.events("late-wild", "PassthroughConflict"),
        [
            "TLS host *.wild2.example.com is not passed through (nginx.ingress.kubernetes.io/ssl-passthrough): the older Ingress a/older-exact routes it or serves its TLS"
        ]
    );
    assert_eq!(
        with_default.events("late-pass-2", "PassthroughConflict"),
        [
            "TLS host routed.example.com is not passed through (nginx.ingress.kubernetes.io/ssl-passthrough): the older Ingress a/older-route routes it or serves its TLS"
        ]
    );
    drop(with_default);

    // Plain HTTP to the passthrough host is routed as before.
    let answer = f.get("pass.example.com", "/plain/x");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(
        answer
            .body
            .starts_with("plain uri=/plain/x host=pass.example.com xff=127.0.0.1 proto=http"),
        "{answer:?}"
    );

    // Conflicts: the oldest claim of a host wins.
    let (exit, status, body) = curl_https(f.https, "taken.example.com", "/", "127.0.0.1", None);
    assert_eq!((exit, status), (0, 200), "{body}");
    assert!(
        body.starts_with("plain uri=/ host=taken.example.com"),
        "{body}"
    );
    assert_eq!(
        f.events("late-pass", "PassthroughConflict"),
        [
            "TLS host taken.example.com is not passed through (nginx.ingress.kubernetes.io/ssl-passthrough): the older Ingress a/older-tls routes it or serves its TLS"
        ]
    );
    let (exit, status, body) = curl_https(f.https, "mine.example.com", "/tls", "127.0.0.1", ca);
    assert_eq!((exit, status), (0, 200), "{body}");
    assert_eq!(body, "passthrough sni=mine.example.com xff=");
    assert_eq!(
        f.events("late-tls", "TLSHostConflict"),
        [
            "TLS host mine.example.com is passed through (nginx.ingress.kubernetes.io/ssl-passthrough) to the backend of the older Ingress a/first-pass: Secret tls is not used for it"
        ]
    );
    assert!(
        f.events("pass", "AnnotationNotSupported").is_empty(),
        "{:?}",
        f.events
    );
}

/// ssl-passthrough in the file set: without it haproxy.cfg has no passthrough frontend (the
/// config is as it was); a host added to a passthrough Service port changes only the map
/// (a hitless runtime update); an endpoint change only a server slot.
#[test]
fn ssl_passthrough_host_changes_touch_only_the_map() {
    let mut s = stores();
    service(&mut s, "a", "secure", (8080, 8443, 8081));
    apply(
        &mut s,
        "ingresses",
        ingress_to("plain", "plain.example.com", "/", ("secure", 80), &[]),
    );
    let renderer = Renderer::compile(&reference::template_set()).unwrap();
    let before = renderer.render(&s).unwrap();
    let cfg = before.text("haproxy.cfg").unwrap().to_owned();
    assert!(!cfg.contains("passthrough"), "{cfg}");
    assert_eq!(before.text("maps/passthrough.map").map(str::trim), Some(""));

    let pass = [("ssl-passthrough", "true")];
    apply(
        &mut s,
        "ingresses",
        ingress_rules(
            "one",
            "2026-01-01T00:00:00Z",
            &[("one.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
    );
    let one = renderer.render(&s).unwrap();
    let check = common::haproxy_check(&one);
    assert!(!check.contains("WARNING"), "{check}");
    let cfg = one.text("haproxy.cfg").unwrap().to_owned();
    assert!(
        cfg.contains("\nfrontend https-passthrough\n    mode tcp\n"),
        "{cfg}"
    );
    assert!(
        cfg.contains("\nbackend a_secure_443_nginx_passthrough\n    mode tcp\n"),
        "{cfg}"
    );
    let tcp = cfg
        .split("\nbackend a_secure_443_nginx_passthrough\n")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .unwrap_or_default();
    assert!(tcp.contains(" 127.0.0.1:8443 check"), "{cfg}");
    assert!(!tcp.contains("ssl"), "{tcp}");
    assert_eq!(
        one.text("maps/passthrough.map").map(str::trim),
        Some("one.example.com a_secure_443_nginx_passthrough")
    );

    apply(
        &mut s,
        "ingresses",
        ingress_rules(
            "two",
            "2026-01-01T00:00:00Z",
            &[("two.example.com", "/", "secure", 443)],
            &[],
            &pass,
        ),
    );
    let two = renderer.render(&s).unwrap();
    assert_eq!(two.text("haproxy.cfg").unwrap(), cfg);
    assert_eq!(
        two.text("maps/passthrough.map").map(str::trim),
        Some(
            "one.example.com a_secure_443_nginx_passthrough\ntwo.example.com a_secure_443_nginx_passthrough"
        )
    );
}
