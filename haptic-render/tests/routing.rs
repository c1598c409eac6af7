//! Routing behaviour of the reference set, checked on a running HAProxy: requests with the
//! route-debug header are answered with the backend the frontend's map lookups chose.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use haptic_render::{Renderer, reference};
use serde_json::json;

/// Kills the HAProxy child when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    common::free_port()
}

/// The body of the answer to GET `path` with `host`, or the status line when it is not 200.
fn route(port: u16, host: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nx-haptic-route-debug: 1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if head.starts_with("HTTP/1.1 200") {
        body.to_owned()
    } else {
        head.lines().next().unwrap_or_default().to_owned()
    }
}

#[test]
fn requests_are_routed_by_host_exact_and_longest_prefix() {
    let mut stores = common::reference_stores(4);
    let prefix = |path: &str, svc: &str| {
        json!({"path": path, "pathType": "Prefix",
            "backend": {"service": {"name": svc, "port": {"number": 80}}}})
    };
    let exact = |path: &str, svc: &str| {
        json!({"path": path, "pathType": "Exact",
            "backend": {"service": {"name": svc, "port": {"number": 80}}}})
    };
    let ingresses = stores.get_mut("ingresses").unwrap();
    ingresses
        .apply(
            &json!({"metadata": {"namespace": "prec", "name": "site"}, "spec": {"rules": [
                {"host": "prec.example.com", "http": {"paths": [
                    prefix("/", "a"), prefix("/foo", "b"), exact("/foo/bar", "c"),
                    prefix("/foo/bar/baz/", "d"),
                ]}},
                {"http": {"paths": [prefix("/any", "e"), exact("/only", "e")]}},
            ]}}),
        )
        .unwrap();
    let services = stores.get_mut("services").unwrap();
    for name in ["a", "b", "c", "d", "e"] {
        services
            .apply(&json!({"metadata": {"namespace": "prec", "name": name},
                "spec": {"ports": [{"name": "http", "port": 80}]}}))
            .unwrap();
    }

    let (http, https) = (free_port(), free_port());
    let mut set = reference::template_set();
    set.extra_context.insert(
        "haproxy".into(),
        json!({"maxconn": 1000, "http_port": http, "https_port": https,
            "timeout_connect": "1s", "timeout_client": "10s", "timeout_server": "10s",
            "stats_socket": null, "route_debug": true}),
    );
    let files = Renderer::compile(&set).unwrap().render(&stores).unwrap();
    let dir = tempfile::tempdir().unwrap();
    files.write_to(dir.path()).unwrap();
    let _haproxy = Running(
        Command::new(common::haproxy())
            .arg("-db")
            .arg("-f")
            .arg(dir.path().join("haproxy.cfg"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Wait, with a bound, for HAProxy to listen.
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", http)).is_err() {
        assert!(Instant::now() < deadline, "haproxy did not start listening");
        std::thread::sleep(Duration::from_millis(50));
    }

    let host = "prec.example.com";
    for (host, path, backend) in [
        (host, "/", "prec_a_80"),
        (host, "/x", "prec_a_80"),
        // Prefix /foo matches /foo and below, element-wise: not /foobar.
        (host, "/foo", "prec_b_80"),
        (host, "/foo/", "prec_b_80"),
        (host, "/foo/x", "prec_b_80"),
        (host, "/foobar", "prec_a_80"),
        // Exact /foo/bar beats the shorter prefix, and only matches itself.
        (host, "/foo/bar", "prec_c_80"),
        (host, "/foo/bar/", "prec_b_80"),
        // The longest prefix wins; a trailing slash in the Ingress path changes nothing.
        (host, "/foo/bar/baz", "prec_d_80"),
        (host, "/foo/bar/baz/q", "prec_d_80"),
        // Host matching ignores case and the port.
        ("PREC.example.com:8080", "/foo/x", "prec_b_80"),
        // Rules without a host serve any host, after the host's own rules.
        ("other.example.com", "/any/thing", "prec_e_80"),
        ("other.example.com", "/only", "prec_e_80"),
        ("other.example.com", "/only/not", "default-backend"),
        ("other.example.com", "/elsewhere", "default-backend"),
        // Generated Ingresses: Prefix / on port 80, Exact /healthz by port name.
        (
            "app-00002.team-02.example.com",
            "/healthz",
            "team-02_app-00002_80",
        ),
        (
            "app-00003.team-03.example.com",
            "/metrics/x",
            "team-03_app-00003_9090",
        ),
        (
            "app-00000.team-00.example.com",
            "/metrics/x",
            "team-00_app-00000_9090",
        ),
        (
            "app-00002.team-02.example.com",
            "/metrics/x",
            "team-02_app-00002_80",
        ),
    ] {
        assert_eq!(route(http, host, path), backend, "{host}{path}");
    }
    // A generated Ingress with ingress-nginx annotations: its routes go to its own backend.
    let annotated = route(http, "app-00001.team-01.example.com", "/healthz");
    assert!(
        annotated.starts_with("team-01_app-00001_80_nginx_"),
        "{annotated}"
    );

    // Without the debug header, an unrouted request reaches the default backend's 404.
    let mut stream = TcpStream::connect(("127.0.0.1", http)).unwrap();
    write!(
        stream,
        "GET /nothing HTTP/1.1\r\nHost: nobody.example.com\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
}
