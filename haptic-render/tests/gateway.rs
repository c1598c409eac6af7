//! Gateway API semantics of the reference set at the HTTP level, through a running HAProxy:
//! one test per GATEWAY-HTTP core conformance behaviour, named after the upstream test
//! (kubernetes-sigs/gateway-api v1.5.1 `conformance/tests`), over the reference templates and
//! the `derived.gateway` view. Requests reach real backends: a second HAProxy whose frontends
//! answer with their name and what they received. Status is judged on what the render asks the
//! cluster to show (`set_status`).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use haptic_render::{EventRequest, FileSet, Renderer, Requests, StatusRequest, Stores, reference};
use serde_json::{Value as Json, json};

const CONTROLLER: &str = "haproxy-haptic.org/gateway-controller";
const NS: &str = "infra";

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

fn start(dir: tempfile::TempDir, ports: &[u16]) -> Running {
    let log = dir.path().join("haproxy.stderr");
    let child = Command::new(common::haproxy())
        .arg("-db")
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut running = Running { child, _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    for port in ports {
        while TcpStream::connect(("127.0.0.1", *port)).is_err() {
            let exited = running.child.try_wait().unwrap();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "haproxy did not listen on {port} (exited: {exited:?}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    running
}

/// Echo backends, one port per name: each answers 200 `backend=<name> path=<path?query>`
/// followed by the request's headers.
fn echoes(names: &[&str]) -> (Running, BTreeMap<String, u16>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = String::from(
        "global\n    maxconn 100\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n",
    );
    let mut ports = BTreeMap::new();
    for name in names {
        let port = free_port();
        cfg.push_str(&format!(
            "frontend {name}\n    bind 127.0.0.1:{port}\n\
             \x20   http-request return status 200 content-type text/plain lf-string \"backend={name} path=%[pathq]\\n%[req.hdrs]\"\n"
        ));
        ports.insert((*name).to_owned(), port);
    }
    std::fs::write(dir.path().join("haproxy.cfg"), cfg).unwrap();
    let list: Vec<u16> = ports.values().copied().collect();
    (start(dir, &list), ports)
}

struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    /// The backend that answered, `404`/`500`/... otherwise.
    fn backend(&self) -> String {
        match self.body.strip_prefix("backend=") {
            Some(rest) if self.status == 200 => {
                rest.split_whitespace().next().unwrap_or("").to_owned()
            }
            _ => self.status.to_string(),
        }
    }
}

fn get(port: u16, host: &str, path: &str, headers: &[(&str, &str)]) -> Answer {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
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
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// The reference stores with a GatewayClass of ours, a pod at 127.0.0.1, the namespaces and a
/// Service (port 8080) per echo backend, in namespace `infra` unless its name says `web-`.
struct World {
    stores: Stores,
    _echo: Running,
}

fn apply(stores: &mut Stores, store: &str, resource: Json) {
    stores.get_mut(store).unwrap().apply(&resource).unwrap();
}

fn world(names: &[&str]) -> World {
    world_in(reference::stores().unwrap(), names)
}

fn world_in(mut stores: Stores, names: &[&str]) -> World {
    let (echo, echoes) = echoes(names);
    apply(
        &mut stores,
        "gatewayclasses",
        json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": "haptic", "generation": 1},
            "spec": {"controllerName": CONTROLLER}}),
    );
    apply(
        &mut stores,
        "haproxy_pods",
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "haptic", "name": "haproxy-1"},
            "status": {"phase": "Running", "podIP": "127.0.0.1"}}),
    );
    for ns in [NS, "web"] {
        apply(
            &mut stores,
            "namespaces",
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        );
    }
    for (name, port) in &echoes {
        let ns = if name.starts_with("web-") { "web" } else { NS };
        apply(
            &mut stores,
            "services",
            json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": ns, "name": name},
                "spec": {"ports": [{"name": "http", "port": 8080}]}}),
        );
        apply(
            &mut stores,
            "endpointslices",
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": ns, "name": format!("{name}-1"),
                    "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port}],
                "endpoints": [{"addresses": ["127.0.0.1"]}]}),
        );
    }
    World {
        stores,
        _echo: echo,
    }
}

fn gateway(name: &str, listeners: Json) -> Json {
    json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"namespace": NS, "name": name, "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"gatewayClassName": "haptic", "listeners": listeners}})
}

fn route(name: &str, created: &str, spec: Json) -> Json {
    json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"namespace": NS, "name": name, "generation": 3,
            "creationTimestamp": created},
        "spec": spec})
}

fn to(backend: &str) -> Json {
    json!([{"name": backend, "port": 8080}])
}

/// A front HAProxy rendering the reference set over the world, with a Gateway `gw` listening
/// for HTTP on a free port (all namespaces), and the statuses asked for.
struct Front {
    port: u16,
    statuses: Vec<std::sync::Arc<StatusRequest>>,
    events: Vec<EventRequest>,
    _running: Running,
}

impl World {
    fn route(&mut self, resource: Json) {
        apply(&mut self.stores, "httproutes", resource);
    }

    fn front(&mut self) -> Front {
        let port = free_port();
        apply(
            &mut self.stores,
            "gateways",
            gateway(
                "gw",
                json!([{"name": "http", "port": port, "protocol": "HTTP",
                    "allowedRoutes": {"namespaces": {"from": "All"}}}]),
            ),
        );
        self.serve(port)
    }

    fn serve(&self, port: u16) -> Front {
        self.serve_with(port, free_port())
    }

    /// As [`World::serve`], the Ingress frontend on `http_port`.
    fn serve_with(&self, port: u16, http_port: u16) -> Front {
        self.serve_on(port, (http_port, free_port()))
    }

    /// The reference set rendered over the world, the Ingress frontend on `http_port` and
    /// `https_port`.
    fn render(&self, (http_port, https_port): (u16, u16)) -> (FileSet, Requests) {
        let mut set = reference::template_set();
        set.extra_context.insert(
            "haproxy".into(),
            json!({"maxconn": 1000, "http_port": http_port, "https_port": https_port,
                "bind_address": "127.0.0.1",
                "timeout_connect": "2s", "timeout_client": "10s", "timeout_server": "10s",
                "stats_socket": null, "route_debug": false, "health_checks": false}),
        );
        Renderer::compile(&set)
            .unwrap()
            .render_all(&self.stores)
            .unwrap()
    }

    /// As [`World::serve`], the Ingress frontend on `http_port` and `https_port`.
    fn serve_on(&self, port: u16, ingress_ports: (u16, u16)) -> Front {
        let (files, requests) = self.render(ingress_ports);
        let dir = tempfile::tempdir().unwrap();
        files.write_to(dir.path()).unwrap();
        common::check_dir(dir.path());
        Front {
            port,
            statuses: requests.statuses,
            events: requests.events,
            _running: start(dir, &[port]),
        }
    }
}

impl Front {
    /// The messages of the Events of `reason` on `kind` `name`.
    fn events(&self, kind: &str, name: &str, reason: &str) -> Vec<&str> {
        self.events
            .iter()
            .filter(|e| {
                e.kind.as_deref() == Some(kind)
                    && e.name.as_deref() == Some(name)
                    && e.reason == reason
            })
            .map(|e| e.message.as_str())
            .collect()
    }

    fn to(&self, host: &str, path: &str) -> String {
        get(self.port, host, path, &[]).backend()
    }

    fn with(&self, path: &str, headers: &[(&str, &str)]) -> String {
        get(self.port, "example.com", path, headers).backend()
    }

    /// The status field `field` declared for `kind` `name`.
    fn status(&self, kind: &str, name: &str, field: &str) -> Json {
        self.statuses
            .iter()
            .find(|s| s.kind == kind && s.name == name && s.field == field)
            .map(|s| (*s.value).clone())
            .unwrap_or(Json::Null)
    }

    /// The conditions of the route's first parent, as `type=status/reason`.
    fn parent_conditions(&self, route: &str) -> Vec<String> {
        let parents = self.status("HTTPRoute", route, "parents");
        parents[0]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                format!(
                    "{}={}/{}",
                    c["type"].as_str().unwrap(),
                    c["status"].as_str().unwrap(),
                    c["reason"].as_str().unwrap()
                )
            })
            .collect()
    }
}

#[test]
fn http_route_simple_same_namespace() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "simple",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.front();
    assert_eq!(f.to("anything.example", "/"), "infra-backend-v1");
    assert_eq!(
        f.parent_conditions("simple"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    let parents = f.status("HTTPRoute", "simple", "parents");
    assert_eq!(parents[0]["controllerName"], CONTROLLER);
    assert_eq!(parents[0]["conditions"][0]["observedGeneration"], 3);
    assert_eq!(
        f.status("Gateway", "gw", "addresses"),
        json!([{"type": "IPAddress", "value": "127.0.0.1"}])
    );
    assert_eq!(
        f.status("Gateway", "gw", "listeners")[0]["attachedRoutes"],
        1
    );
    assert_eq!(
        f.status("GatewayClass", "haptic", "conditions")[0]["status"],
        "True"
    );
}

#[test]
fn http_route_exact_path_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    w.route(route(
        "exact",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "Exact", "value": "/one"}}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "Exact", "value": "/two"}}], "backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/one"), "infra-backend-v1");
    assert_eq!(f.to("example.com", "/two"), "infra-backend-v2");
    for path in ["/", "/one/example", "/two/", "/Two"] {
        assert_eq!(f.to("example.com", path), "404", "{path}");
    }
}

#[test]
fn http_route_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    w.route(route(
        "matching",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}, {"headers": [{"name": "version", "value": "two"}]}],
             "backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.with("/", &[]), "infra-backend-v1");
    assert_eq!(f.with("/example", &[]), "infra-backend-v1");
    assert_eq!(f.with("/v2", &[]), "infra-backend-v2");
    assert_eq!(f.with("/v2/", &[]), "infra-backend-v2");
    assert_eq!(f.with("/v2/example", &[]), "infra-backend-v2");
    // A prefix matches whole path segments.
    assert_eq!(f.with("/v2example", &[]), "infra-backend-v1");
    assert_eq!(f.with("/", &[("version", "two")]), "infra-backend-v2");
}

#[test]
fn http_route_path_match_order() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    w.route(route(
        "order",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/match"}},
                         {"path": {"type": "PathPrefix", "value": "/match/prefix"}}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "Exact", "value": "/match/exact"}},
                         {"path": {"type": "PathPrefix", "value": "/match/prefix/one"}}], "backendRefs": to("infra-backend-v2")},
            {"matches": [{"path": {"type": "Exact", "value": "/match/exact/one"}},
                         {"path": {"type": "PathPrefix", "value": "/match/"}, "headers": [{"name": "x", "value": "y"}]},
                         {"path": {"type": "PathPrefix", "value": "/match/any"}}], "backendRefs": to("infra-backend-v3")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.with("/match/exact/one", &[]), "infra-backend-v3");
    assert_eq!(f.with("/match/exact", &[]), "infra-backend-v2");
    assert_eq!(f.with("/match", &[]), "infra-backend-v1");
    assert_eq!(f.with("/match/prefix/one/any", &[]), "infra-backend-v2");
    assert_eq!(f.with("/match/prefix/any", &[]), "infra-backend-v1");
    assert_eq!(f.with("/match/any", &[]), "infra-backend-v3");
}

#[test]
fn http_route_header_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    w.route(route(
        "headers",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"headers": [{"name": "version", "value": "one"}]}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"headers": [{"name": "version", "value": "two"}]}], "backendRefs": to("infra-backend-v2")},
            {"matches": [{"headers": [{"name": "version", "value": "two"}, {"name": "color", "value": "orange"}]}],
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.with("/", &[("Version", "one")]), "infra-backend-v1");
    assert_eq!(f.with("/", &[("version", "two")]), "infra-backend-v2");
    // More header matches win.
    assert_eq!(
        f.with("/", &[("version", "two"), ("color", "orange")]),
        "infra-backend-v1"
    );
    assert_eq!(f.with("/", &[("color", "orange")]), "404");
    assert_eq!(f.with("/", &[("version", "three")]), "404");
}

/// Implementation-specific: RegularExpression paths, PCRE2 as HAProxy compiles it, matching the
/// whole path (`^(?:<re>)$`; the query is not part of the path). The spec's order puts them
/// after the Exact paths and prefixes of their host (map entries or lines of haproxy.cfg), and
/// the host first: a regular expression of an exact host goes before a wildcard's prefix.
#[test]
fn http_route_regular_expression_path_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    let regex = |value: &str| json!({"path": {"type": "RegularExpression", "value": value}});
    w.route(route(
        "regex",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["regex.example"], "rules": [
            {"matches": [regex("/api/v[0-9]+/tasks")], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "Exact", "value": "/api/v2/tasks"}}],
             "backendRefs": to("infra-backend-v2")},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/api/v3"}}],
             "backendRefs": to("infra-backend-v3")},
            // An Exact path with a header condition: a line of haproxy.cfg, before the regex.
            {"matches": [{"path": {"type": "Exact", "value": "/api/v4/tasks"},
                          "headers": [{"name": "x", "value": "y"}]}],
             "backendRefs": to("infra-backend-v3")},
            // A regex with a header condition goes before a plain one (more header matches).
            {"matches": [{"path": {"type": "RegularExpression", "value": "/api/v[0-9]+/tasks"},
                          "headers": [{"name": "x", "value": "z"}]}],
             "backendRefs": to("infra-backend-v2")},
            // The anchors of a pattern are allowed, and alternation stays inside the group.
            {"matches": [regex("^/(one|two)\\.html$|/three")], "backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    // A less specific host's prefix comes after the exact host's regular expression.
    w.route(route(
        "wildcard",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["*.example"],
            "rules": [{"backendRefs": to("infra-backend-v3")}]}),
    ));
    // The same host's `PathPrefix /` comes before its regular expressions.
    w.route(route(
        "catchall",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["catchall.example"], "rules": [
            {"matches": [regex("/r[0-9]")], "backendRefs": to("infra-backend-v1")},
            {"backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(
        f.parent_conditions("regex"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    let to = |path: &str| f.to("regex.example", path);
    assert_eq!(to("/api/v1/tasks"), "infra-backend-v1");
    assert_eq!(to("/api/v10/tasks?q=1"), "infra-backend-v1");
    // The whole path: nothing before or after.
    assert_eq!(to("/api/v1/tasks/x"), "infra-backend-v3");
    assert_eq!(to("/x/api/v1/tasks"), "infra-backend-v3");
    assert_eq!(to("/api/vx/tasks"), "infra-backend-v3");
    // Exact paths and prefixes of the host first, map entries or lines of haproxy.cfg.
    assert_eq!(to("/api/v2/tasks"), "infra-backend-v2");
    assert_eq!(to("/api/v3/tasks"), "infra-backend-v3");
    assert_eq!(
        get(f.port, "regex.example", "/api/v4/tasks", &[("x", "y")]).backend(),
        "infra-backend-v3"
    );
    assert_eq!(to("/api/v4/tasks"), "infra-backend-v1");
    assert_eq!(
        get(f.port, "regex.example", "/api/v5/tasks", &[("x", "z")]).backend(),
        "infra-backend-v2"
    );
    for path in ["/one.html", "/two.html", "/three"] {
        assert_eq!(to(path), "infra-backend-v2", "{path}");
    }
    for path in ["/onexhtml", "/one.html/", "/threefold"] {
        assert_eq!(to(path), "infra-backend-v3", "{path}");
    }
    assert_eq!(f.to("catchall.example", "/r1"), "infra-backend-v2");
}

/// Implementation-specific: RegularExpression header and query parameter matches, PCRE2 as
/// HAProxy compiles it, matching the whole value (of each value of a header: `req.hdr`, as for
/// Exact, splits at commas; a query parameter's value as sent, not decoded). Every pattern the
/// subset takes loads (the set passes `haproxy -c`).
#[test]
fn http_route_regular_expression_header_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    let header = |name: &str, value: &str| json!({"type": "RegularExpression", "name": name, "value": value});
    w.route(route(
        "regex-headers",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"headers": [{"name": "version", "value": "v2"}]}],
             "backendRefs": to("infra-backend-v2")},
            {"matches": [{"headers": [header("version", "v[0-9]+")]}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"headers": [header("authorization", "Bearer [a-z]+")]}],
             "backendRefs": to("infra-backend-v1")},
            {"matches": [{"queryParams": [header("color", "red|blue")]}], "backendRefs": to("infra-backend-v3")},
        ]}),
    ));
    // Patterns of every construct the subset takes, on a host of their own: they load.
    let patterns = [
        "^/admin/.+$",
        "/users/\\d{1,6}(/profile)?",
        "/(foo|bar)/[a-zA-Z_.-]*",
        "[-a]|[a-]|[\\-\\]\\[]",
        "(?:a|b){2,}?",
        "x{0}y{3}z{1,1000}",
        "[0-9]{1,1000}\\d{1000,}.{0,1000}",
        "(ab){1,300}",
        "\\.\\*\\{\\}\\$\\^\\/\\\\",
        "\\bword\\B\\s\\S\\w\\W\\D",
        "[^/]*",
        "a||b|()",
        "\\_\\~\\@\\<\\>\\ \\!\\%\\;",
        "\\$\\{HOME\\}%\\[path\\]",
    ];
    w.route(route(
        "patterns",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["patterns.example"], "rules": [
            {"matches": patterns.iter().map(|p| json!({"headers": [header("x", p)]})).collect::<Vec<_>>(),
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(
        f.parent_conditions("regex-headers"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    assert_eq!(
        f.parent_conditions("patterns"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    assert_eq!(f.with("/", &[("Version", "v1")]), "infra-backend-v1");
    assert_eq!(f.with("/", &[("version", "v123")]), "infra-backend-v1");
    // The Exact match's rule comes first (as many header matches; list order).
    assert_eq!(f.with("/", &[("version", "v2")]), "infra-backend-v2");
    // The whole value.
    assert_eq!(f.with("/", &[("version", "v1x")]), "404");
    assert_eq!(f.with("/", &[("version", "xv1")]), "404");
    assert_eq!(
        f.with("/", &[("authorization", "Bearer abc")]),
        "infra-backend-v1"
    );
    assert_eq!(f.with("/", &[("authorization", "Bearer ABC")]), "404");
    assert_eq!(f.with("/?color=blue", &[]), "infra-backend-v3");
    assert_eq!(f.with("/?a=1&color=red", &[]), "infra-backend-v3");
    assert_eq!(f.with("/?color=redish", &[]), "404");
    // What single quotes keep literal in haproxy.cfg: no variable, no sample fetch.
    let at = |value: &str| get(f.port, "patterns.example", "/", &[("x", value)]).backend();
    assert_eq!(at("/admin/x"), "infra-backend-v1");
    assert_eq!(at("/users/42/profile"), "infra-backend-v1");
    assert_eq!(at("${HOME}%[path]"), "infra-backend-v1");
    assert_eq!(at("/root/"), "404");
    assert_eq!(at("_~@<> !%;"), "infra-backend-v1");
}

/// HAProxy reads at most 64 words a line: a match with the most conditions the API allows (16
/// header and 16 query parameter matches, here half of them regular expressions, and a
/// method) is written over several lines, and holds when all its conditions do, only then.
#[test]
fn a_match_of_every_condition_the_api_allows_holds_only_when_all_do() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    let kind = |i: usize| {
        if i.is_multiple_of(2) {
            "Exact"
        } else {
            "RegularExpression"
        }
    };
    let headers: Vec<Json> = (0..16)
        .map(|i| json!({"type": kind(i), "name": format!("h{i}"), "value": format!("v{i}")}))
        .collect();
    let queries: Vec<Json> = (0..16)
        .map(|i| json!({"type": kind(i), "name": format!("q{i}"), "value": format!("v{i}")}))
        .collect();
    w.route(route(
        "many",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["many.example"], "rules": [
            {"matches": [{"path": {"type": "Exact", "value": "/x"}, "method": "GET",
                          "headers": headers, "queryParams": queries}],
             "backendRefs": to("infra-backend-v1")},
            {"backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    // Rendered and checked by `haproxy -c` (serve_on): the lines load.
    let f = w.front();
    assert_eq!(
        f.parent_conditions("many"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    let names: Vec<String> = (0..16).map(|i| format!("h{i}")).collect();
    let values: Vec<String> = (0..16).map(|i| format!("v{i}")).collect();
    let all: Vec<(&str, &str)> = names
        .iter()
        .zip(&values)
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let query = |skip: Option<usize>| {
        let q: Vec<String> = (0..16)
            .filter(|i| Some(*i) != skip)
            .map(|i| format!("q{i}=v{i}"))
            .collect();
        format!("/x?{}", q.join("&"))
    };
    let at =
        |path: &str, headers: &[(&str, &str)]| get(f.port, "many.example", path, headers).backend();
    assert_eq!(at(&query(None), &all), "infra-backend-v1");
    // Any condition missing, in any of the lines: not this match.
    for skip in [0, 6, 7, 13, 15] {
        let mut some = all.clone();
        some.remove(skip);
        assert_eq!(at(&query(None), &some), "infra-backend-v2", "h{skip}");
        assert_eq!(at(&query(Some(skip)), &all), "infra-backend-v2", "q{skip}");
    }
    assert_eq!(at("/y", &all), "infra-backend-v2");
    // The next request on its own is judged afresh.
    assert_eq!(at(&query(None), &all), "infra-backend-v1");
}

/// A regular expression is text of a route written into haproxy.cfg: one the PCRE2 subset
/// does not take (it could end the word or the line, or HAProxy could refuse to compile it)
/// leaves its route not accepted (UnsupportedValue, naming the field), written nowhere; the
/// set still loads and the other routes route.
#[test]
fn a_regular_expression_haproxy_could_refuse_leaves_only_its_route_not_accepted() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    w.route(route(
        "good",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["good.example"], "rules": [
            {"matches": [{"path": {"type": "RegularExpression", "value": "/ok/.*"}}],
             "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "Exact", "value": "/plain"}}],
             "backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    let path = |value: &str| json!({"path": {"type": "RegularExpression", "value": value}});
    let header = |name: &str, value: &str| json!({"headers": [{"type": "RegularExpression", "name": name, "value": value}]});
    let query = |value: &str| json!({"queryParams": [{"type": "RegularExpression", "name": "q", "value": value}]});
    let bad = [
        (
            "unclosed",
            path("/a("),
            "spec.rules[0].matches[0].path.value",
        ),
        (
            "quote",
            path("/a' } || TRUE #"),
            "spec.rules[0].matches[0].path.value",
        ),
        (
            "newline",
            path("/a\n    use_backend x"),
            "spec.rules[0].matches[0].path.value",
        ),
        (
            "comment",
            header("x", "a#b"),
            "spec.rules[0].matches[0].headers[0].value",
        ),
        (
            "lookahead",
            header("x", "(?=a)"),
            "spec.rules[0].matches[0].headers[0].value",
        ),
        (
            "backref",
            header("x", "(a)\\1"),
            "spec.rules[0].matches[0].headers[0].value",
        ),
        (
            "huge",
            query("a{99999}"),
            "spec.rules[0].matches[0].queryParams[0].value",
        ),
        (
            "tab",
            query("a\tb"),
            "spec.rules[0].matches[0].queryParams[0].value",
        ),
        (
            "name",
            header("x#y", "a"),
            "spec.rules[0].matches[0].headers[0]",
        ),
    ];
    for (name, m, _) in &bad {
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [{"name": "gw"}], "hostnames": [format!("{name}.example")],
                "rules": [{"matches": [m], "backendRefs": to("infra-backend-v1")}]}),
        ));
    }
    // Rendered and checked by `haproxy -c` (serve_on): the set loads.
    let f = w.front();
    assert_eq!(f.to("good.example", "/ok/x"), "infra-backend-v1");
    assert_eq!(f.to("good.example", "/plain"), "infra-backend-v2");
    for (name, _, field) in &bad {
        assert_eq!(
            f.parent_conditions(name)[0],
            "Accepted=False/UnsupportedValue",
            "{name}"
        );
        let message = f.status("HTTPRoute", name, "parents")[0]["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.starts_with(field), "{name}: {message}");
        let host = format!("{name}.example");
        assert_eq!(
            get(f.port, &host, "/a", &[("x", "a")]).backend(),
            "404",
            "{name}"
        );
        assert_eq!(f.to(&host, "/a(?q=a"), "404", "{name}");
    }
    assert_eq!(
        f.status("Gateway", "gw", "listeners")[0]["attachedRoutes"],
        1,
        "only the good route is attached"
    );
}

#[test]
fn http_route_matching_across_routes() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    w.route(route(
        "part1",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["example.com", "example.net"], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    w.route(route(
        "part2",
        "2026-01-02T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["example.com"], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}, {"headers": [{"name": "version", "value": "two"}]}],
             "backendRefs": to("infra-backend-v2")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "infra-backend-v1");
    assert_eq!(f.to("example.com", "/v2"), "infra-backend-v2");
    assert_eq!(f.to("example.net", "/v2"), "infra-backend-v1");
    assert_eq!(
        get(f.port, "example.com", "/", &[("version", "two")]).backend(),
        "infra-backend-v2"
    );
    assert_eq!(f.to("example.org", "/"), "404");
}

#[test]
fn http_route_hostname_intersection() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "specific", "port": port, "protocol": "HTTP", "hostname": "very.specific.com"},
                {"name": "wildcard", "port": port, "protocol": "HTTP", "hostname": "*.wildcard.io"},
            ]),
        ),
    );
    w.route(route(
        "specific",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["non.matching.com", "*.specific.com"],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    w.route(route(
        "wild",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["bar.wildcard.io", "foo.bar.wildcard.io"],
               "rules": [{"backendRefs": to("infra-backend-v2")}]}),
    ));
    w.route(route(
        "none",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["specific.but.wrong.com"],
               "rules": [{"backendRefs": to("infra-backend-v2")}]}),
    ));
    // Hostnames given, none valid: not every host.
    w.route(route(
        "invalid",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["Not_A.Host"],
               "rules": [{"backendRefs": to("infra-backend-v2")}]}),
    ));
    // Another Gateway's catch-all listener on the same port (the conformance suite's shared
    // Gateways): the hosts the first Gateway's listeners take stay theirs.
    let mut all = gateway(
        "all",
        json!([{"name": "any", "port": port, "protocol": "HTTP"}]),
    );
    all["metadata"]["creationTimestamp"] = json!("2026-01-02T00:00:00Z");
    apply(&mut w.stores, "gateways", all);
    w.route(route(
        "on-all",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "all"}], "hostnames": ["first.com", "sub.first.com"],
               "rules": [{"backendRefs": to("infra-backend-v2")}]}),
    ));
    let f = w.serve(port);
    assert_eq!(f.to("first.com", "/"), "infra-backend-v2");
    assert_eq!(f.to("very.specific.com", "/"), "infra-backend-v1");
    assert_eq!(f.to("very.specific.com:1234", "/"), "infra-backend-v1");
    assert_eq!(f.to("non.matching.com", "/"), "404");
    assert_eq!(f.to("bar.wildcard.io", "/"), "infra-backend-v2");
    assert_eq!(f.to("foo.bar.wildcard.io", "/"), "infra-backend-v2");
    assert_eq!(f.to("baz.wildcard.io", "/"), "404");
    assert_eq!(f.to("specific.but.wrong.com", "/"), "404");
    assert_eq!(
        f.parent_conditions("none")[0],
        "Accepted=False/NoMatchingListenerHostname"
    );
    assert_eq!(
        f.parent_conditions("invalid")[0],
        "Accepted=False/NoMatchingListenerHostname"
    );
    let listeners = f.status("Gateway", "gw", "listeners");
    assert_eq!(listeners[0]["attachedRoutes"], 1);
    assert_eq!(listeners[1]["attachedRoutes"], 1);
}

/// The spec's listener precedence: a request is matched against the routes of the most
/// specific listener whose hostname matches its host, and only those: when none of them
/// matches the path it gets 404, never a less specific listener's route.
#[test]
fn a_host_uses_only_the_most_specific_listener() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "wild", "port": port, "protocol": "HTTP", "hostname": "*.example.com"},
                {"name": "foo", "port": port, "protocol": "HTTP", "hostname": "foo.example.com"},
                {"name": "any", "port": port, "protocol": "HTTP"},
            ]),
        ),
    );
    for (name, section, rule) in [
        (
            "wild",
            "wild",
            json!({"backendRefs": to("infra-backend-v1")}),
        ),
        (
            "foo",
            "foo",
            json!({"matches": [{"path": {"type": "Exact", "value": "/only"}}],
                   "backendRefs": to("infra-backend-v2")}),
        ),
        ("any", "any", json!({"backendRefs": to("infra-backend-v3")})),
    ] {
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [{"name": "gw", "sectionName": section}], "rules": [rule]}),
        ));
    }
    let f = w.serve(port);
    assert_eq!(f.to("foo.example.com", "/only"), "infra-backend-v2");
    // Not the wildcard listener's route, nor the catch-all listener's.
    assert_eq!(f.to("foo.example.com", "/"), "404");
    assert_eq!(f.to("bar.example.com", "/"), "infra-backend-v1");
    assert_eq!(f.to("a.b.example.com", "/x"), "infra-backend-v1");
    assert_eq!(f.to("example.org", "/"), "infra-backend-v3");
    // A wildcard route hostname on the catch-all listener does not take foo.example.com either.
    w.route(route(
        "any-wild",
        "2025-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw", "sectionName": "any"}], "hostnames": ["*.example.com"],
               "rules": [{"backendRefs": to("infra-backend-v3")}]}),
    ));
    let f = w.serve(port);
    assert_eq!(f.to("foo.example.com", "/"), "404");
    assert_eq!(f.to("bar.example.com", "/"), "infra-backend-v1");
}

#[test]
fn http_route_weight() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    w.route(route(
        "weights",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": [
            {"name": "infra-backend-v1", "port": 8080, "weight": 70},
            {"name": "infra-backend-v2", "port": 8080, "weight": 30},
            {"name": "infra-backend-v3", "port": 8080, "weight": 0},
        ]}]}),
    ));
    let f = w.front();
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..500 {
        *seen.entry(f.to("example.com", "/")).or_default() += 1;
    }
    let v1 = f64::from(seen.get("infra-backend-v1").copied().unwrap_or(0)) / 500.0;
    let v2 = f64::from(seen.get("infra-backend-v2").copied().unwrap_or(0)) / 500.0;
    assert!(
        (v1 - 0.7).abs() < 0.07 && (v2 - 0.3).abs() < 0.07,
        "{seen:?}"
    );
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[test]
fn http_route_request_header_modifier() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "modifier",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"filters": [{"type": "RequestHeaderModifier",
            "requestHeaderModifier": {"set": [{"name": "X-Header-Set", "value": "set-overwrites-values"}],
                "add": [{"name": "X-Header-Add", "value": "add-appends-values"}],
                "remove": ["X-Header-Remove"]}}],
            "backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.front();
    let answer = get(
        f.port,
        "example.com",
        "/",
        &[
            ("x-header-set", "some-other-value"),
            ("x-header-add", "something"),
            ("x-header-remove", "gone"),
        ],
    );
    let received = answer.body.to_lowercase();
    assert!(
        received.contains("x-header-set: set-overwrites-values"),
        "{received}"
    );
    assert!(!received.contains("some-other-value"), "{received}");
    assert!(received.contains("x-header-add: something"), "{received}");
    assert!(
        received.contains("x-header-add: add-appends-values"),
        "{received}"
    );
    assert!(!received.contains("x-header-remove"), "{received}");
}

#[test]
fn http_route_redirect_host_and_status() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "redirect",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/hostname-redirect"}}],
             "filters": [{"type": "RequestRedirect", "requestRedirect": {"hostname": "example.org"}}]},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/host-and-status"}}],
             "filters": [{"type": "RequestRedirect", "requestRedirect": {"hostname": "example.org", "statusCode": 301, "port": 80}}]},
        ]}),
    ));
    let f = w.front();
    let a = get(f.port, "example.com", "/hostname-redirect?q=1", &[]);
    assert_eq!(a.status, 302);
    let location = format!(
        "location: http://example.org:{}/hostname-redirect?q=1",
        f.port
    );
    assert!(a.head.to_lowercase().contains(&location), "{}", a.head);
    let a = get(f.port, "example.com", "/host-and-status", &[]);
    assert_eq!(a.status, 301);
    assert!(
        a.head
            .to_lowercase()
            .contains("location: http://example.org/host-and-status"),
        "{}",
        a.head
    );
}

#[test]
fn http_route_invalid_nonexistent_backend_ref() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "missing",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("nonexistent")}]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "500");
    assert_eq!(
        f.parent_conditions("missing"),
        [
            "Accepted=True/Accepted",
            "ResolvedRefs=False/BackendNotFound"
        ]
    );
}

#[test]
fn http_route_no_backend_refs() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "none",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/forward"}}], "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/omitted"}}]},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/empty"}}], "backendRefs": []},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/forward"), "infra-backend-v1");
    assert_eq!(f.to("example.com", "/omitted"), "500");
    assert_eq!(f.to("example.com", "/empty"), "500");
}

#[test]
fn http_route_reference_grant() {
    let mut w = world(&["web-backend"]);
    w.route(route(
        "cross",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": [{"name": "web-backend", "namespace": "web", "port": 8080}]}]}),
    ));
    // HTTPRouteInvalidCrossNamespaceBackendRef: without a ReferenceGrant, 500.
    {
        let f = w.front();
        assert_eq!(f.to("example.com", "/"), "500");
        assert_eq!(
            f.parent_conditions("cross"),
            [
                "Accepted=True/Accepted",
                "ResolvedRefs=False/RefNotPermitted"
            ]
        );
    }
    apply(
        &mut w.stores,
        "referencegrants",
        json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"namespace": "web", "name": "allow-infra"},
            "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": NS}],
                     "to": [{"group": "", "kind": "Service", "name": "web-backend"}]}}),
    );
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "web-backend");
    assert_eq!(
        f.parent_conditions("cross"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
}

#[test]
fn http_route_invalid_parent_ref_not_matching_section_name() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "section",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw", "sectionName": "nope"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.front();
    assert_eq!(
        f.parent_conditions("section")[0],
        "Accepted=False/NoMatchingParent"
    );
    assert_eq!(f.to("example.com", "/"), "404");
}

#[test]
fn gateway_listener_unsupported_protocol_and_invalid_route_kinds() {
    let mut w = world(&["infra-backend-v1"]);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "http", "port": port, "protocol": "HTTP"},
                {"name": "udp", "port": free_port(), "protocol": "UDP"},
                {"name": "kinds", "port": port, "protocol": "HTTP",
                 "allowedRoutes": {"kinds": [{"kind": "FooRoute"}]}},
            ]),
        ),
    );
    let f = w.serve(port);
    let listeners = f.status("Gateway", "gw", "listeners");
    let reason = |i: usize, kind: &str| {
        listeners[i]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == kind)
            .map(|c| c["reason"].as_str().unwrap().to_owned())
            .unwrap()
    };
    assert_eq!(reason(0, "Accepted"), "Accepted");
    assert_eq!(reason(1, "Accepted"), "UnsupportedProtocol");
    assert_eq!(reason(2, "ResolvedRefs"), "InvalidRouteKinds");
    assert_eq!(listeners[2]["supportedKinds"], json!([]));
}

#[test]
fn gateway_listener_shares_the_ingress_port() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    apply(
        &mut w.stores,
        "ingressclasses",
        haptic_render::fixtures::ingress_class("haptic", true),
    );
    apply(
        &mut w.stores,
        "ingresses",
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"namespace": NS, "name": "shop"},
            "spec": {"rules": [{"host": "shop.example", "http": {"paths": [{"path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": "infra-backend-v2", "port": {"number": 8080}}}}]}}]}}),
    );
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([{"name": "http", "port": port, "protocol": "HTTP", "hostname": "gw.example"}]),
        ),
    );
    w.route(route(
        "simple",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    // The listener's port is the Ingress frontend's: one frontend serves both.
    let f = w.serve_with(port, port);
    assert_eq!(f.to("gw.example", "/"), "infra-backend-v1");
    assert_eq!(f.to("shop.example", "/"), "infra-backend-v2");
    assert_eq!(f.to("other.example", "/"), "404");
}

fn route_in(namespace: &str, name: &str, spec: Json) -> Json {
    let mut r = route(name, "2026-01-01T00:00:00Z", spec);
    r["metadata"]["namespace"] = json!(namespace);
    r
}

/// The conditions of a condition list, as `type=status/reason`.
fn conditions(list: &Json) -> Vec<String> {
    list.as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|c| {
            format!(
                "{}={}/{}",
                c["type"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
                c["reason"].as_str().unwrap()
            )
        })
        .collect()
}

#[test]
fn http_route_listener_hostname_matching() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "listener-1", "port": port, "protocol": "HTTP", "hostname": "bar.com"},
                {"name": "listener-2", "port": port, "protocol": "HTTP", "hostname": "foo.bar.com"},
                {"name": "listener-3", "port": port, "protocol": "HTTP", "hostname": "*.bar.com"},
                {"name": "listener-4", "port": port, "protocol": "HTTP", "hostname": "*.foo.com"},
            ]),
        ),
    );
    for (name, sections, backend) in [
        ("backend-v1", vec!["listener-1"], "infra-backend-v1"),
        ("backend-v2", vec!["listener-2"], "infra-backend-v2"),
        (
            "backend-v3",
            vec!["listener-3", "listener-4"],
            "infra-backend-v3",
        ),
    ] {
        let parents: Vec<Json> = sections
            .iter()
            .map(|s| json!({"name": "gw", "sectionName": s}))
            .collect();
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": parents, "rules": [{"backendRefs": to(backend)}]}),
        ));
    }
    let f = w.serve(port);
    assert_eq!(f.to("bar.com", "/"), "infra-backend-v1");
    assert_eq!(f.to("foo.bar.com", "/"), "infra-backend-v2");
    for host in [
        "baz.bar.com",
        "boo.bar.com",
        "multiple.prefixes.bar.com",
        "multiple.prefixes.foo.com",
    ] {
        assert_eq!(f.to(host, "/"), "infra-backend-v3", "{host}");
    }
    assert_eq!(f.to("foo.com", "/"), "404");
    assert_eq!(f.to("no.matching.host", "/"), "404");
}

#[test]
fn http_route_cross_namespace() {
    let mut w = world(&["web-backend"]);
    w.route(route_in(
        "web",
        "cross-namespace",
        json!({"parentRefs": [{"name": "gw", "namespace": NS}],
               "rules": [{"backendRefs": [{"name": "web-backend", "port": 8080}]}]}),
    ));
    // The Gateway of World::front takes routes from all namespaces.
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "web-backend");
    assert_eq!(
        f.parent_conditions("cross-namespace"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
}

#[test]
fn http_route_invalid_cross_namespace_parent_ref() {
    let mut w = world(&["web-backend"]);
    let port = free_port();
    // allowedRoutes defaults to the Gateway's own namespace.
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([{"name": "http", "port": port, "protocol": "HTTP"}]),
        ),
    );
    w.route(route_in(
        "web",
        "invalid-cross-namespace-parent-ref",
        json!({"parentRefs": [{"name": "gw", "namespace": NS}],
               "rules": [{"backendRefs": [{"name": "web-backend", "port": 8080}]}]}),
    ));
    let f = w.serve(port);
    assert_eq!(
        f.parent_conditions("invalid-cross-namespace-parent-ref")[0],
        "Accepted=False/NotAllowedByListeners"
    );
    assert_eq!(f.to("example.com", "/"), "404");
    assert_eq!(
        f.status("Gateway", "gw", "listeners")[0]["attachedRoutes"],
        0
    );
}

#[test]
fn http_route_invalid_cross_namespace_backend_ref() {
    let mut w = world(&["web-backend"]);
    w.route(route(
        "invalid-cross-namespace-backend-ref",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}],
               "rules": [{"backendRefs": [{"name": "web-backend", "namespace": "web", "port": 8080}]}]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "500");
    assert_eq!(
        f.parent_conditions("invalid-cross-namespace-backend-ref"),
        [
            "Accepted=True/Accepted",
            "ResolvedRefs=False/RefNotPermitted"
        ]
    );
}

#[test]
fn http_route_invalid_backend_ref_unknown_kind() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "invalid-backend-ref-unknown-kind",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}],
               "rules": [{"backendRefs": [{"group": "unknownkind.example.com", "kind": "NonExistent",
                                           "name": "infra-backend-v1", "port": 8080}]}]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "500");
    assert_eq!(
        f.parent_conditions("invalid-backend-ref-unknown-kind"),
        ["Accepted=True/Accepted", "ResolvedRefs=False/InvalidKind"]
    );
}

#[test]
fn http_route_partially_invalid_via_invalid_reference_grant() {
    let mut w = world(&["infra-backend-v1", "web-backend"]);
    // A grant for another Service: it does not allow web-backend.
    apply(
        &mut w.stores,
        "referencegrants",
        json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"namespace": "web", "name": "not-this-one"},
            "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": NS}],
                     "to": [{"group": "", "kind": "Service", "name": "not-web-backend"}]}}),
    );
    w.route(route(
        "invalid-reference-grant",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
             "backendRefs": [{"name": "web-backend", "namespace": "web", "port": 8080}]},
            {"backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/"), "infra-backend-v1");
    assert_eq!(f.to("example.com", "/v2"), "500");
    assert_eq!(
        f.parent_conditions("invalid-reference-grant"),
        [
            "Accepted=True/Accepted",
            "ResolvedRefs=False/RefNotPermitted"
        ]
    );
}

#[test]
fn http_route_observed_generation_bump() {
    let mut w = world(&["infra-backend-v1"]);
    let mut r = route(
        "observed-generation-bump",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    );
    w.route(r.clone());
    let before = w.front();
    let parents = before.status("HTTPRoute", "observed-generation-bump", "parents");
    assert_eq!(parents[0]["conditions"][0]["observedGeneration"], 3);
    drop(before);
    r["metadata"]["generation"] = json!(4);
    r["spec"]["rules"][0]["matches"] = json!([{"path": {"type": "PathPrefix", "value": "/v2"}}]);
    w.route(r);
    let after = w.front();
    let parents = after.status("HTTPRoute", "observed-generation-bump", "parents");
    for c in parents[0]["conditions"].as_array().unwrap() {
        assert_eq!(c["observedGeneration"], 4, "{c}");
    }
    assert_eq!(after.to("example.com", "/v2"), "infra-backend-v1");
    assert_eq!(after.to("example.com", "/"), "404");
}

#[test]
fn gateway_observed_generation_bump() {
    let mut w = world(&["infra-backend-v1"]);
    let port = free_port();
    let mut gw = gateway(
        "gw",
        json!([{"name": "http", "port": port, "protocol": "HTTP"}]),
    );
    apply(&mut w.stores, "gateways", gw.clone());
    let f = w.serve(port);
    assert_eq!(
        f.status("Gateway", "gw", "conditions")[0]["observedGeneration"],
        1
    );
    drop(f);
    let second = free_port();
    gw["metadata"]["generation"] = json!(2);
    gw["spec"]["listeners"] = json!([
        {"name": "http", "port": port, "protocol": "HTTP"},
        {"name": "second", "port": second, "protocol": "HTTP"},
    ]);
    apply(&mut w.stores, "gateways", gw);
    let f = w.serve(port);
    for c in f.status("Gateway", "gw", "conditions").as_array().unwrap() {
        assert_eq!(c["observedGeneration"], 2, "{c}");
    }
    for l in f.status("Gateway", "gw", "listeners").as_array().unwrap() {
        for c in l["conditions"].as_array().unwrap() {
            assert_eq!(c["observedGeneration"], 2, "{c}");
        }
    }
}

#[test]
fn gateway_class_observed_generation_bump() {
    let mut w = world(&["infra-backend-v1"]);
    apply(
        &mut w.stores,
        "gatewayclasses",
        json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": "haptic", "generation": 2},
            "spec": {"controllerName": CONTROLLER, "description": "bumped"}}),
    );
    let f = w.front();
    assert_eq!(
        conditions(&f.status("GatewayClass", "haptic", "conditions")),
        ["Accepted=True/Accepted"]
    );
    assert_eq!(
        f.status("GatewayClass", "haptic", "conditions")[0]["observedGeneration"],
        2
    );
}

#[test]
fn gateway_modify_listeners() {
    let mut w = world(&["infra-backend-v1"]);
    let port = free_port();
    let added = free_port();
    let mut gw = gateway(
        "gw",
        json!([{"name": "http", "port": port, "protocol": "HTTP"}]),
    );
    apply(&mut w.stores, "gateways", gw.clone());
    w.route(route(
        "r",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    // A listener added: served, with its status.
    gw["metadata"]["generation"] = json!(2);
    gw["spec"]["listeners"] = json!([
        {"name": "http", "port": port, "protocol": "HTTP"},
        {"name": "added", "port": added, "protocol": "HTTP"},
    ]);
    apply(&mut w.stores, "gateways", gw.clone());
    let f = w.serve(added);
    assert_eq!(
        get(added, "example.com", "/", &[]).backend(),
        "infra-backend-v1"
    );
    let listeners = f.status("Gateway", "gw", "listeners");
    assert_eq!(listeners.as_array().unwrap().len(), 2);
    assert_eq!(listeners[1]["name"], "added");
    assert_eq!(listeners[1]["attachedRoutes"], 1);
    assert!(
        conditions(&listeners[1]["conditions"]).contains(&"Programmed=True/Programmed".to_owned())
    );
    drop(f);
    // A listener removed: gone from the status and from HAProxy.
    gw["metadata"]["generation"] = json!(3);
    gw["spec"]["listeners"] = json!([{"name": "http", "port": port, "protocol": "HTTP"}]);
    apply(&mut w.stores, "gateways", gw);
    let f = w.serve(port);
    let listeners = f.status("Gateway", "gw", "listeners");
    assert_eq!(listeners.as_array().unwrap().len(), 1);
    assert_eq!(listeners[0]["name"], "http");
    assert!(
        TcpStream::connect(("127.0.0.1", added)).is_err(),
        "the removed listener's port is not served"
    );
}

#[test]
fn http_route_multiple_gateways() {
    let mut w = world(&["infra-backend-v1"]);
    let (one, two) = (free_port(), free_port());
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw-one",
            json!([{"name": "http", "port": one, "protocol": "HTTP"}]),
        ),
    );
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw-two",
            json!([{"name": "http", "port": two, "protocol": "HTTP"}]),
        ),
    );
    w.route(route(
        "multiple-gateways",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw-one"}, {"name": "gw-two"}],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.serve(one);
    assert_eq!(f.to("example.com", "/"), "infra-backend-v1");
    assert_eq!(
        get(two, "example.com", "/", &[]).backend(),
        "infra-backend-v1"
    );
    let parents = f.status("HTTPRoute", "multiple-gateways", "parents");
    assert_eq!(parents.as_array().unwrap().len(), 2);
    for p in parents.as_array().unwrap() {
        assert_eq!(
            conditions(&p["conditions"]),
            ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
        );
    }
}

/// GatewayWithAttachedRoutes: a listener counts the routes attached to it, and only those. Its
/// allowedRoutes select namespaces on `kubernetes.io/metadata.name` (set by the API server on
/// every namespace); a route whose hostnames miss the listener's is not accepted and not
/// counted; an HTTPS listener whose certificate Secret is missing is not programmed and still
/// counts the route attached to it, whose missing backend leaves its refs unresolved.
#[test]
fn gateway_with_attached_routes() {
    let mut w = world(&["infra-backend-v1"]);
    let (one, two, tls) = (free_port(), free_port(), free_port());
    let from_infra = json!({"kinds": [{"kind": "HTTPRoute"}],
        "namespaces": {"from": "Selector",
            "selector": {"matchLabels": {"kubernetes.io/metadata.name": NS}}}});
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gateway-with-one-attached-route",
            json!([{"name": "http", "port": one, "protocol": "HTTP", "allowedRoutes": from_infra}]),
        ),
    );
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gateway-with-two-attached-routes",
            json!([{"name": "http", "port": two, "protocol": "HTTP", "hostname": "foo.example.com",
                "allowedRoutes": from_infra}]),
        ),
    );
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "unresolved-gateway-with-one-attached-unresolved-route",
            json!([{"name": "tls", "port": tls, "protocol": "HTTPS", "allowedRoutes": from_infra,
                "tls": {"mode": "Terminate",
                    "certificateRefs": [{"group": "", "kind": "Secret", "name": "does-not-exist"}]}}]),
        ),
    );
    let parent = |gateway: &str| json!({"kind": "Gateway", "name": gateway, "namespace": NS});
    w.route(route(
        "http-route-1",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [parent("gateway-with-one-attached-route")],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    // Not in the selected namespace: not attached (not upstream's; it shows the selector
    // selects).
    w.route(route_in(
        "web",
        "http-route-other-namespace",
        json!({"parentRefs": [parent("gateway-with-one-attached-route")],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    for name in ["http-route-2", "http-route-3"] {
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [parent("gateway-with-two-attached-routes")],
                   "rules": [{"backendRefs": to("infra-backend-v1")}]}),
        ));
    }
    w.route(route(
        "http-route-not-accepted",
        "2026-01-01T00:00:00Z",
        json!({"hostnames": ["not-accepted.test.com"],
               "parentRefs": [parent("gateway-with-two-attached-routes")],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let mut unresolved = parent("unresolved-gateway-with-one-attached-unresolved-route");
    unresolved["sectionName"] = json!("tls");
    w.route(route(
        "http-route-4",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [unresolved],
               "rules": [{"backendRefs": [{"name": "does-not-exist", "port": 8080}]}]}),
    ));
    let f = w.serve(one);
    let listener = |gateway: &str| {
        let listeners = f.status("Gateway", gateway, "listeners");
        assert_eq!(listeners.as_array().unwrap().len(), 1, "{gateway}");
        assert_eq!(
            listeners[0]["supportedKinds"],
            json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}]),
            "{gateway}"
        );
        (
            listeners[0]["attachedRoutes"].as_i64().unwrap(),
            conditions(&listeners[0]["conditions"]),
        )
    };

    let (attached, got) = listener("gateway-with-one-attached-route");
    assert_eq!(attached, 1);
    for want in ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"] {
        assert!(got.contains(&want.to_owned()), "{want}: {got:?}");
    }
    assert_eq!(
        conditions(
            &f.status("HTTPRoute", "http-route-other-namespace", "parents")[0]["conditions"]
        )[0],
        "Accepted=False/NotAllowedByListeners"
    );
    assert_eq!(
        get(one, "any.example", "/", &[]).backend(),
        "infra-backend-v1"
    );

    let (attached, got) = listener("gateway-with-two-attached-routes");
    assert_eq!(attached, 2);
    for want in ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"] {
        assert!(got.contains(&want.to_owned()), "{want}: {got:?}");
    }
    assert_eq!(
        f.parent_conditions("http-route-not-accepted")[0],
        "Accepted=False/NoMatchingListenerHostname"
    );
    assert_eq!(
        get(two, "foo.example.com", "/", &[]).backend(),
        "infra-backend-v1"
    );
    assert_eq!(get(two, "not-accepted.test.com", "/", &[]).backend(), "404");

    let (attached, got) = listener("unresolved-gateway-with-one-attached-unresolved-route");
    assert_eq!(attached, 1);
    for want in ["Programmed=False/", "ResolvedRefs=False/"] {
        assert!(got.iter().any(|c| c.starts_with(want)), "{want}: {got:?}");
    }
    assert_eq!(
        f.parent_conditions("http-route-4"),
        [
            "Accepted=True/Accepted",
            "ResolvedRefs=False/BackendNotFound"
        ]
    );
    assert!(
        TcpStream::connect(("127.0.0.1", tls)).is_err(),
        "a listener without its certificate is not served"
    );
}

/// The listener conditions of an HTTPS listener `https` whose certificateRefs are `refs`,
/// beside an HTTP listener the test's HAProxy is awaited on.
fn https_listener_conditions(w: &mut World, refs: Json) -> Vec<String> {
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "http", "port": port, "protocol": "HTTP"},
                {"name": "https", "port": free_port(), "protocol": "HTTPS",
                 "tls": {"certificateRefs": refs}},
            ]),
        ),
    );
    let f = w.serve(port);
    conditions(&f.status("Gateway", "gw", "listeners")[1]["conditions"])
}

#[test]
fn gateway_invalid_tls_configuration() {
    let mut w = world(&["infra-backend-v1"]);
    // Not a TLS Secret's content: unusable.
    apply(
        &mut w.stores,
        "secrets",
        json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"namespace": NS, "name": "malformed"},
            "data": {"tls.crt": "bm90IGEgY2VydA==", "tls.key": "bm90IGEga2V5"}}),
    );
    for refs in [
        json!([{"name": "nonexistent"}]),
        json!([{"name": "malformed"}]),
        json!([{"group": "wrong.group.company.io", "kind": "WrongKind", "name": "malformed"}]),
    ] {
        let got = https_listener_conditions(&mut w, refs.clone());
        assert!(
            got.contains(&"ResolvedRefs=False/InvalidCertificateRef".to_owned())
                && got.contains(&"Programmed=False/Invalid".to_owned()),
            "{refs}: {got:?}"
        );
    }
}

#[test]
fn gateway_secret_missing_reference_grant() {
    let mut w = world(&["infra-backend-v1"]);
    apply(
        &mut w.stores,
        "secrets",
        haptic_render::fixtures::tls_secret("web", "certificate"),
    );
    let got =
        https_listener_conditions(&mut w, json!([{"name": "certificate", "namespace": "web"}]));
    assert!(
        got.contains(&"ResolvedRefs=False/RefNotPermitted".to_owned()),
        "{got:?}"
    );
}

fn secret_grant(to_name: Option<&str>) -> Json {
    let mut to = json!({"group": "", "kind": "Secret"});
    if let Some(name) = to_name {
        to["name"] = json!(name);
    }
    json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
        "metadata": {"namespace": "web", "name": "gateway-secret"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": NS}],
                 "to": [to]}})
}

#[test]
fn gateway_secret_reference_grant_specific() {
    let mut w = world(&["infra-backend-v1"]);
    apply(
        &mut w.stores,
        "secrets",
        haptic_render::fixtures::tls_secret("web", "certificate"),
    );
    apply(
        &mut w.stores,
        "referencegrants",
        secret_grant(Some("certificate")),
    );
    let got =
        https_listener_conditions(&mut w, json!([{"name": "certificate", "namespace": "web"}]));
    assert!(
        got.contains(&"ResolvedRefs=True/ResolvedRefs".to_owned())
            && got.contains(&"Programmed=True/Programmed".to_owned()),
        "{got:?}"
    );
}

#[test]
fn gateway_secret_reference_grant_all_in_namespace() {
    let mut w = world(&["infra-backend-v1"]);
    apply(
        &mut w.stores,
        "secrets",
        haptic_render::fixtures::tls_secret("web", "certificate"),
    );
    apply(&mut w.stores, "referencegrants", secret_grant(None));
    let got =
        https_listener_conditions(&mut w, json!([{"name": "certificate", "namespace": "web"}]));
    assert!(
        got.contains(&"ResolvedRefs=True/ResolvedRefs".to_owned())
            && got.contains(&"Programmed=True/Programmed".to_owned()),
        "{got:?}"
    );
}

#[test]
fn http_route_service_types() {
    let mut w = world(&["infra-backend-v1"]);
    // The same endpoints behind a headless Service and one without a selector (its
    // EndpointSlice written by hand): routed by their EndpointSlices all the same.
    let store = w.stores.get("endpointslices").unwrap();
    let field = |path: &str| store.value_at(NS, "infra-backend-v1-1", path).unwrap();
    let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {}, "addressType": "IPv4",
        "ports": field("ports"), "endpoints": field("endpoints")});
    for (name, spec) in [
        (
            "headless",
            json!({"clusterIP": "None", "selector": {"app": "v1"}, "ports": [{"name": "http", "port": 8080}]}),
        ),
        ("manual", json!({"ports": [{"name": "http", "port": 8080}]})),
    ] {
        apply(
            &mut w.stores,
            "services",
            json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": NS, "name": name}, "spec": spec}),
        );
        let mut s = slice.clone();
        s["metadata"]["namespace"] = json!(NS);
        s["metadata"]["name"] = json!(format!("{name}-1"));
        s["metadata"]["labels"] = json!({"kubernetes.io/service-name": name});
        apply(&mut w.stores, "endpointslices", s);
    }
    w.route(route(
        "service-types",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/headless"}}],
             "backendRefs": [{"name": "headless", "port": 8080}]},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/manual"}}],
             "backendRefs": [{"name": "manual", "port": 8080}]},
        ]}),
    ));
    let f = w.front();
    assert_eq!(f.to("example.com", "/headless"), "infra-backend-v1");
    assert_eq!(f.to("example.com", "/manual"), "infra-backend-v1");
    assert_eq!(
        f.parent_conditions("service-types"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
}

/// Extended: URLRewrite with a hostname (HTTPRouteRewriteHost) and ReplaceFullPath
/// (HTTPRouteRewritePath's full-path cases). A path modifier of a type not supported, or a
/// ReplacePrefixMatch in a rule without exactly one PathPrefix match (the API's rule), leaves
/// the route not accepted (UnsupportedValue) rather than routed otherwise than it says.
#[test]
fn http_route_rewrite_host_and_full_path() {
    let mut w = world(&["infra-backend-v1"]);
    w.route(route(
        "rewrite",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/one"}}],
             "filters": [{"type": "URLRewrite", "urlRewrite": {"hostname": "one.example.org"}}],
             "backendRefs": to("infra-backend-v1")},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/full"}}],
             "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath", "replaceFullPath": "/one"}}}],
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let prefix_x = json!({"type": "ReplacePrefixMatch", "replacePrefixMatch": "/x"});
    let unsupported = [
        (
            "prefix-of-exact",
            json!([{"path": {"type": "Exact", "value": "/a"}}]),
            json!({"type": "URLRewrite", "urlRewrite": {"path": prefix_x}}),
        ),
        (
            "prefix-of-two",
            json!([{"path": {"type": "PathPrefix", "value": "/a"}},
                   {"path": {"type": "PathPrefix", "value": "/b"}}]),
            json!({"type": "URLRewrite", "urlRewrite": {"path": prefix_x}}),
        ),
        (
            "redirect-prefix-of-exact",
            json!([{"path": {"type": "Exact", "value": "/a"}}]),
            json!({"type": "RequestRedirect", "requestRedirect": {"path": prefix_x}}),
        ),
        (
            "unknown-path-type",
            json!([{"path": {"type": "PathPrefix", "value": "/a"}}]),
            json!({"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceRegexMatch"}}}),
        ),
    ];
    for (name, matches, filter) in &unsupported {
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [{"name": "gw"}], "hostnames": [format!("{name}.example")],
                "rules": [{"matches": matches, "filters": [filter],
                           "backendRefs": to("infra-backend-v1")}]}),
        ));
    }
    let f = w.front();
    let a = get(f.port, "rewrite.example", "/one/two", &[]);
    assert_eq!(a.backend(), "infra-backend-v1");
    let body = a.body.to_lowercase();
    assert!(body.contains("path=/one/two"), "{body}");
    assert!(body.contains("host: one.example.org"), "{body}");
    let a = get(f.port, "rewrite.example", "/full/path?q=1", &[]);
    assert!(a.body.contains("path=/one?q=1"), "{}", a.body);
    assert!(
        a.body.to_lowercase().contains("host: rewrite.example"),
        "{}",
        a.body
    );
    for (name, ..) in &unsupported {
        assert_eq!(
            f.parent_conditions(name)[0],
            "Accepted=False/UnsupportedValue",
            "{name}"
        );
        assert_eq!(f.to(&format!("{name}.example"), "/a"), "404", "{name}");
    }
}

/// Filters of a backendRef (extended, HTTPRouteBackendRequestHeaderModification) are not
/// supported: the route is not accepted (UnsupportedValue) and written nowhere, rather than
/// routed without them; a route with the same filter on its rule routes.
#[test]
fn a_backend_ref_with_filters_is_not_accepted() {
    let mut w = world(&["infra-backend-v1"]);
    let filter = json!({"type": "RequestHeaderModifier",
                        "requestHeaderModifier": {"set": [{"name": "X-Backend", "value": "v1"}]}});
    w.route(route(
        "backend-filter",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["backend-filter.example"],
            "rules": [{"backendRefs": [{"name": "infra-backend-v1", "port": 8080,
                                        "filters": [filter]}]}]}),
    ));
    w.route(route(
        "rule-filter",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["rule-filter.example"],
            "rules": [{"filters": [filter], "backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.front();
    assert_eq!(
        f.parent_conditions("backend-filter")[0],
        "Accepted=False/UnsupportedValue"
    );
    assert_eq!(f.to("backend-filter.example", "/"), "404");
    assert_eq!(
        f.parent_conditions("rule-filter")[0],
        "Accepted=True/Accepted"
    );
    let a = get(f.port, "rule-filter.example", "/", &[]);
    assert_eq!(a.backend(), "infra-backend-v1");
    assert!(
        a.body.to_lowercase().contains("x-backend: v1"),
        "{}",
        a.body
    );
}

/// The path (with its query) the backend received, from the echo's first line.
fn received_path(a: &Answer) -> String {
    a.body
        .lines()
        .next()
        .and_then(|l| l.split_once(" path="))
        .map(|(_, p)| p.to_owned())
        .unwrap_or_default()
}

/// Extended, HTTPRouteRewritePath (upstream's manifest and cases, and the spec's table of
/// ReplacePrefixMatch): the matched prefix replaced segment-wise, a trailing `/` of the prefix
/// or the replacement ignored, `/` or nothing as the replacement strips the prefix (never
/// leaving an empty path), the query kept; ReplaceFullPath replaces the whole path; the
/// headers of a RequestHeaderModifier in the same rule modified too.
#[test]
fn http_route_rewrite_path() {
    let mut w = world(&["infra-backend-v1"]);
    let prefix = |value: &str, with: &str| {
        json!({"matches": [{"path": {"type": "PathPrefix", "value": value}}],
            "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": with}}}],
            "backendRefs": to("infra-backend-v1")})
    };
    let full = |value: &str, with: &str| {
        json!({"matches": [{"path": {"type": "PathPrefix", "value": value}}],
            "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath", "replaceFullPath": with}}}],
            "backendRefs": to("infra-backend-v1")})
    };
    let headers = json!({"type": "RequestHeaderModifier", "requestHeaderModifier": {
        "set": [{"name": "X-Header-Set", "value": "set-overwrites-values"}],
        "add": [{"name": "X-Header-Add", "value": "header-val-1"},
                {"name": "X-Header-Add-Append", "value": "header-val-2"}],
        "remove": ["X-Header-Remove"]}});
    let mut full_and_headers = full("/full/rewrite-path-and-modify-headers", "/test");
    full_and_headers["filters"]
        .as_array_mut()
        .unwrap()
        .push(headers.clone());
    let mut prefix_and_headers = prefix("/prefix/rewrite-path-and-modify-headers", "/prefix");
    prefix_and_headers["filters"]
        .as_array_mut()
        .unwrap()
        .push(headers);
    w.route(route(
        "rewrite-path",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            prefix("/prefix/one", "/one"),
            prefix("/strip-prefix", "/"),
            full("/full/one", "/one"),
            full_and_headers,
            prefix_and_headers,
        ]}),
    ));
    // The spec's table: prefix /foo or /foo/, replacement /xyz, /xyz/, empty or /.
    w.route(route(
        "rewrite-prefix-table",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["table.example"], "rules": [
            prefix("/foo", "/xyz"),
            prefix("/foo-slash/", "/xyz/"),
            prefix("/empty", ""),
            prefix("/slash", "/"),
        ]}),
    ));
    // The prefix `/`: the replacement goes before the whole path.
    w.route(route(
        "rewrite-root",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["root.example"], "rules": [
            prefix("/", "/bar"),
        ]}),
    ));
    let f = w.front();
    for r in ["rewrite-path", "rewrite-prefix-table", "rewrite-root"] {
        assert_eq!(
            f.parent_conditions(r),
            ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"],
            "{r}"
        );
    }
    for (host, path, want) in [
        ("example.com", "/prefix/one/two", "/one/two"),
        ("example.com", "/prefix/one", "/one"),
        ("example.com", "/strip-prefix/three?q=1", "/three?q=1"),
        ("example.com", "/strip-prefix", "/"),
        ("example.com", "/full/one/two", "/one"),
        ("example.com", "/full/one/two?q=1", "/one?q=1"),
        ("table.example", "/foo/bar", "/xyz/bar"),
        ("table.example", "/foo", "/xyz"),
        ("table.example", "/foo/", "/xyz/"),
        ("table.example", "/foo?a=b", "/xyz?a=b"),
        ("table.example", "/foo/bar?a=b", "/xyz/bar?a=b"),
        ("table.example", "/foo-slash/bar", "/xyz/bar"),
        ("table.example", "/foo-slash", "/xyz"),
        ("table.example", "/empty/bar", "/bar"),
        ("table.example", "/empty/", "/"),
        ("table.example", "/empty", "/"),
        ("table.example", "/empty?a=b", "/?a=b"),
        ("table.example", "/slash/bar", "/bar"),
        ("table.example", "/slash/", "/"),
        ("table.example", "/slash", "/"),
        ("root.example", "/x/y", "/bar/x/y"),
        ("root.example", "/", "/bar/"),
    ] {
        let a = get(f.port, host, path, &[]);
        assert_eq!(a.backend(), "infra-backend-v1", "{host}{path}: {}", a.body);
        assert_eq!(received_path(&a), want, "{host}{path}");
    }
    // Not the prefix segment-wise: not this rule's.
    assert_eq!(f.to("table.example", "/foobar"), "404");
    for path in [
        "/full/rewrite-path-and-modify-headers/test",
        "/prefix/rewrite-path-and-modify-headers/one",
    ] {
        let a = get(
            f.port,
            "example.com",
            path,
            &[
                ("X-Header-Remove", "remove-val"),
                ("X-Header-Add-Append", "append-val-1"),
                ("X-Header-Set", "set-val"),
            ],
        );
        let want = if path.starts_with("/full") {
            "/test"
        } else {
            "/prefix/one"
        };
        assert_eq!(received_path(&a), want, "{path}");
        let received = a.body.to_lowercase();
        for line in [
            "x-header-add: header-val-1",
            "x-header-add-append: append-val-1",
            "x-header-add-append: header-val-2",
            "x-header-set: set-overwrites-values",
        ] {
            assert!(received.contains(line), "{path}: {line}: {received}");
        }
        assert!(!received.contains("x-header-remove"), "{path}: {received}");
        assert!(!received.contains("set-val\n"), "{path}: {received}");
    }
}

/// Extended, HTTPRouteRedirectPath (upstream's manifest and cases): the Location of a
/// RequestRedirect with ReplacePrefixMatch has the matched prefix replaced (the query kept),
/// with ReplaceFullPath the path given; its host and status as the filter says; the request's
/// host and the listener's port otherwise.
#[test]
fn http_route_redirect_path() {
    let mut w = world(&["infra-backend-v1"]);
    let rule = |value: &str, redirect: Json| {
        json!({"matches": [{"path": {"type": "PathPrefix", "value": value}}],
            "filters": [{"type": "RequestRedirect", "requestRedirect": redirect}]})
    };
    let prefix = json!({"type": "ReplacePrefixMatch", "replacePrefixMatch": "/replacement-prefix"});
    let full = |p: &str| json!({"type": "ReplaceFullPath", "replaceFullPath": p});
    w.route(route(
        "redirect-path",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [
            rule("/original-prefix", json!({"path": prefix})),
            rule("/full", json!({"path": full("/full-path-replacement")})),
            rule("/path-and-host", json!({"hostname": "example.org", "path": prefix})),
            rule("/path-and-status", json!({"path": prefix, "statusCode": 301})),
            rule("/full-path-and-host", json!({"hostname": "example.org", "path": full("/replacement-full")})),
            rule("/full-path-and-status", json!({"path": full("/replacement-full"), "statusCode": 301})),
            rule("/strip", json!({"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}})),
        ]}),
    ));
    let f = w.front();
    assert_eq!(
        f.parent_conditions("redirect-path"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    let port = f.port;
    for (path, status, location) in [
        (
            "/original-prefix/lemon",
            302,
            format!("http://example.com:{port}/replacement-prefix/lemon"),
        ),
        (
            "/original-prefix",
            302,
            format!("http://example.com:{port}/replacement-prefix"),
        ),
        (
            "/original-prefix/lemon?q=1",
            302,
            format!("http://example.com:{port}/replacement-prefix/lemon?q=1"),
        ),
        (
            "/original-prefix?q=1",
            302,
            format!("http://example.com:{port}/replacement-prefix?q=1"),
        ),
        (
            "/full/path/original",
            302,
            format!("http://example.com:{port}/full-path-replacement"),
        ),
        (
            "/path-and-host",
            302,
            format!("http://example.org:{port}/replacement-prefix"),
        ),
        (
            "/path-and-status",
            301,
            format!("http://example.com:{port}/replacement-prefix"),
        ),
        (
            "/full-path-and-host",
            302,
            format!("http://example.org:{port}/replacement-full"),
        ),
        (
            "/full-path-and-status",
            301,
            format!("http://example.com:{port}/replacement-full"),
        ),
        ("/strip/x", 302, format!("http://example.com:{port}/x")),
        ("/strip", 302, format!("http://example.com:{port}/")),
    ] {
        let a = get(port, "example.com", path, &[]);
        assert_eq!(a.status, status, "{path}: {}", a.head);
        let got = a
            .head
            .lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.eq_ignore_ascii_case("location"))
            })
            .map(|(_, v)| v.trim().to_owned());
        assert_eq!(got.as_deref(), Some(location.as_str()), "{path}");
    }
}

/// The reference stores, the gateway view reserving `reserved` and knowing the Ingress
/// frontend's ports as `ingress`.
fn stores_with_ports(reserved: Vec<u16>, ingress: (u16, u16)) -> Stores {
    let mut stores = Stores::new();
    for (name, index) in reference::STORES {
        stores
            .add(
                name,
                haptic_render::StoreConfig::index_by(index.iter().copied()),
            )
            .unwrap();
    }
    for (name, mut derivation) in reference::derivations() {
        if let haptic_render::Derivation::GatewayApi {
            reserved_ports,
            ingress_ports,
            ..
        } = &mut derivation
        {
            *reserved_ports = reserved.clone();
            ingress_ports.http = ingress.0;
            ingress_ports.https = ingress.1;
        }
        stores.derive(name, derivation).unwrap();
    }
    stores
}

#[test]
fn a_listener_on_a_reserved_or_ingress_port_is_port_unavailable_and_others_keep_routing() {
    // The agent beside HAProxy holds its port: a listener bound there would stop HAProxy from
    // loading for every tenant.
    let agent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let agent_port = agent.local_addr().unwrap().port();
    let (http_port, https_port) = (free_port(), free_port());
    let mut w = world_in(
        stores_with_ports(vec![agent_port], (http_port, https_port)),
        &["infra-backend-v1"],
    );
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([{"name": "http", "port": port, "protocol": "HTTP",
                "allowedRoutes": {"namespaces": {"from": "All"}}}]),
        ),
    );
    let mut clash = gateway(
        "clash",
        json!([
            {"name": "agent", "port": agent_port, "protocol": "HTTP"},
            {"name": "tls-on-http", "port": http_port, "protocol": "HTTPS",
             "tls": {"certificateRefs": [{"name": "missing"}]}},
            {"name": "http-on-https", "port": https_port, "protocol": "HTTP"},
        ]),
    );
    clash["metadata"]["namespace"] = json!("web");
    apply(&mut w.stores, "gateways", clash);
    w.route(route(
        "simple",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let f = w.serve_on(port, (http_port, https_port));
    // HAProxy loaded (the agent's port is not bound twice) and the other tenant routes.
    assert_eq!(f.to("example.com", "/"), "infra-backend-v1");
    drop(agent);
    let listeners = f.status("Gateway", "clash", "listeners");
    for i in 0..3 {
        let c = conditions(&listeners[i]["conditions"]);
        assert!(
            c.contains(&"Accepted=False/PortUnavailable".to_owned()),
            "{i}: {c:?}"
        );
        assert!(
            c.contains(&"Programmed=False/Invalid".to_owned()),
            "{i}: {c:?}"
        );
    }
    let ok = conditions(&f.status("Gateway", "gw", "listeners")[0]["conditions"]);
    assert!(
        ok.contains(&"Programmed=True/Programmed".to_owned()),
        "{ok:?}"
    );
}

/// A world whose Ingress frontend listens on `http_port` (the gateway view knowing it), with
/// our default IngressClass and a Gateway `gw` whose HTTP listener shares that port.
fn shared_world(http_port: u16) -> World {
    let mut w = world_in(
        stores_with_ports(Vec::new(), (http_port, free_port())),
        &["infra-backend-v1", "infra-backend-v2"],
    );
    apply(
        &mut w.stores,
        "ingressclasses",
        haptic_render::fixtures::ingress_class("haptic", true),
    );
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([{"name": "http", "port": http_port, "protocol": "HTTP",
                "allowedRoutes": {"namespaces": {"from": "All"}}}]),
        ),
    );
    w
}

/// An Ingress in `infra` created at `created`, its paths `(path, pathType)` on `host` routing
/// to `backend`.
fn shared_ingress(
    name: &str,
    created: &str,
    host: &str,
    paths: &[(&str, &str)],
    backend: &str,
) -> Json {
    let paths: Vec<Json> = paths
        .iter()
        .map(|(path, kind)| {
            json!({"path": path, "pathType": kind,
                "backend": {"service": {"name": backend, "port": {"number": 8080}}}})
        })
        .collect();
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"namespace": NS, "name": name, "creationTimestamp": created,
            "uid": format!("uid-{name}")},
        "spec": {"rules": [{"host": host, "http": {"paths": paths}}]}})
}

/// Issue 24: an HTTPRoute match on a listener sharing the Ingress frontend's port and an older
/// Ingress path with the same host and path (Prefix and PathPrefix, Exact and Exact,
/// ImplementationSpecific and PathPrefix): the Ingress keeps them, the route's other matches
/// are served, the route is told (naming the Ingress) and stays Accepted; deleting the Ingress
/// hands the route over.
#[test]
fn an_older_ingress_keeps_its_route_from_an_http_route_on_its_port_and_hands_over_when_deleted() {
    let http_port = free_port();
    let mut w = shared_world(http_port);
    apply(
        &mut w.stores,
        "ingresses",
        shared_ingress(
            "shop",
            "2025-01-01T00:00:00Z",
            "shop.example",
            &[
                ("/app", "Prefix"),
                ("/exact", "Exact"),
                ("/impl/", "ImplementationSpecific"),
            ],
            "infra-backend-v2",
        ),
    );
    w.route(route(
        "newer",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["shop.example"], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/app/"}},
                         {"path": {"type": "Exact", "value": "/exact"}},
                         {"path": {"type": "PathPrefix", "value": "/impl"}},
                         {"path": {"type": "PathPrefix", "value": "/gw"}}],
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.serve_on(http_port, (http_port, free_port()));
    for path in ["/app", "/app/x", "/exact", "/impl/y"] {
        assert_eq!(f.to("shop.example", path), "infra-backend-v2", "{path}");
    }
    // What no Ingress claims stays the route's.
    assert_eq!(f.to("shop.example", "/gw/x"), "infra-backend-v1");
    let told = f.events("HTTPRoute", "newer", "RouteConflict");
    for words in [
        format!(
            "host shop.example path /app (PathPrefix) on port {http_port} is served by the older Ingress infra/shop"
        ),
        format!(
            "host shop.example path /exact (Exact) on port {http_port} is served by the older Ingress infra/shop"
        ),
        format!(
            "host shop.example path /impl (PathPrefix) on port {http_port} is served by the older Ingress infra/shop"
        ),
    ] {
        assert!(
            told.iter().any(|m| m.contains(&words)),
            "{words} in {:?}",
            f.events
        );
    }
    assert_eq!(told.len(), 3, "{:?}", f.events);
    assert!(f.events("Ingress", "shop", "RouteConflict").is_empty());
    // The route's other match is served: it stays Accepted (the Gateway API has no condition
    // for a match another kind's route holds).
    assert_eq!(
        f.parent_conditions("newer"),
        ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"]
    );
    drop(f);

    w.stores.get_mut("ingresses").unwrap().remove(NS, "shop");
    let f = w.serve_on(http_port, (http_port, free_port()));
    for path in ["/app", "/app/x", "/exact", "/impl/y", "/gw"] {
        assert_eq!(f.to("shop.example", path), "infra-backend-v1", "{path}");
    }
    assert!(f.events.is_empty(), "{:?}", f.events);
}

/// Issue 24: the HTTPRoute is older: it keeps its matches on its port, and the Ingress is told,
/// naming the route; deleting the route hands the path back to the Ingress.
#[test]
fn an_older_http_route_keeps_its_match_the_ingress_is_told_and_gets_it_back_when_deleted() {
    let http_port = free_port();
    let mut w = shared_world(http_port);
    apply(
        &mut w.stores,
        "ingresses",
        shared_ingress(
            "shop",
            "2026-01-01T00:00:00Z",
            "shop.example",
            &[("/app", "Prefix"), ("/mine", "Prefix")],
            "infra-backend-v2",
        ),
    );
    w.route(route(
        "older",
        "2025-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["shop.example"], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/app"}}],
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.serve_on(http_port, (http_port, free_port()));
    assert_eq!(f.to("shop.example", "/app/x"), "infra-backend-v1");
    assert_eq!(f.to("shop.example", "/mine"), "infra-backend-v2");
    let told = f.events("Ingress", "shop", "RouteConflict");
    assert_eq!(
        told,
        [format!(
            "host shop.example path /app (Prefix) is served on port {http_port} by the older HTTPRoute infra/older: this path is not routed there"
        )],
        "{:?}",
        f.events
    );
    assert!(f.events("HTTPRoute", "older", "RouteConflict").is_empty());
    drop(f);

    w.stores.get_mut("httproutes").unwrap().remove(NS, "older");
    let f = w.serve_on(http_port, (http_port, free_port()));
    assert_eq!(f.to("shop.example", "/app/x"), "infra-backend-v2");
    assert!(f.events.is_empty(), "{:?}", f.events);
}

/// Issue 24: a narrower match is no conflict: an HTTPRoute match with a header (or method, or
/// query) condition on an Ingress's host and path takes only the requests it names; another
/// kind of path match (Exact against Prefix) is another route. Nobody is told.
#[test]
fn a_narrower_http_route_match_on_an_ingress_path_is_no_conflict() {
    let http_port = free_port();
    let mut w = shared_world(http_port);
    apply(
        &mut w.stores,
        "ingresses",
        shared_ingress(
            "shop",
            "2025-01-01T00:00:00Z",
            "shop.example",
            &[("/app", "Prefix")],
            "infra-backend-v2",
        ),
    );
    w.route(route(
        "canary",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "hostnames": ["shop.example"], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/app"},
                          "headers": [{"name": "x-canary", "value": "yes"}]},
                         {"path": {"type": "Exact", "value": "/app"}},
                         {"path": {"type": "RegularExpression", "value": "/app/v[0-9]+"}}],
             "backendRefs": to("infra-backend-v1")},
        ]}),
    ));
    let f = w.serve_on(http_port, (http_port, free_port()));
    assert_eq!(
        get(f.port, "shop.example", "/app/x", &[("x-canary", "yes")]).backend(),
        "infra-backend-v1"
    );
    assert_eq!(f.to("shop.example", "/app/x"), "infra-backend-v2");
    // Exact /app is the route's (tried before the Ingress maps), Prefix /app the Ingress's.
    assert_eq!(f.to("shop.example", "/app"), "infra-backend-v1");
    // A regular expression claims no Ingress path: tried before the Ingress maps.
    assert_eq!(f.to("shop.example", "/app/v2"), "infra-backend-v1");
    assert_eq!(f.to("shop.example", "/app/vx"), "infra-backend-v2");
    assert!(f.events.is_empty(), "{:?}", f.events);
}

/// `GET https://host:port/` through curl, the certificate not checked: the body, empty when
/// the handshake failed.
fn https_body(port: u16, host: &str) -> String {
    let out = Command::new("curl")
        .args(["-sk", "--max-time", "10", "--resolve"])
        .arg(format!("{host}:{port}:127.0.0.1"))
        .arg(format!("https://{host}:{port}/"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `GET https://host:port/` through curl with SNI = Host, the certificate not checked by curl:
/// the status (0 when the handshake failed), the body and the PEM of the certificates the
/// server sent.
fn https_get(port: u16, host: &str) -> (u16, String, String) {
    const MARK: &str = "\n--haptic-status--";
    let out = Command::new("curl")
        .args(["-sk", "--max-time", "10", "--resolve"])
        .arg(format!("{host}:{port}:127.0.0.1"))
        .arg("-w")
        .arg(format!("{MARK}%{{http_code}}\n%{{certs}}"))
        .arg(format!("https://{host}:{port}/"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, rest) = text.rsplit_once(MARK).unwrap_or((&text, ""));
    let (code, certs) = rest.split_once('\n').unwrap_or((rest, ""));
    (code.parse().unwrap_or(0), body.to_owned(), certs.to_owned())
}

/// A `kubernetes.io/tls` Secret `name` in [`NS`] holding a new self-signed certificate for
/// `names` (its SANs) and its key, applied to the stores: the certificate's PEM.
fn self_signed_secret(w: &mut World, name: &str, names: &[&str]) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .unwrap()
            .self_signed(&key)
            .unwrap();
    let b64 = |t: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(t)
    };
    apply(
        &mut w.stores,
        "secrets",
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"namespace": NS, "name": name}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": b64(&cert.pem()), "tls.key": b64(&key.serialize_pem())}}),
    );
    cert.pem()
}

/// HTTPRouteHTTPSListener: four HTTPS listeners on one port sharing a certificate for `*`,
/// `*.org` and `*.wildcard.org`; a route for example.org on the Gateway and a route without
/// hostnames bound to the listener `https-with-hostname` (second-example.org). Over TLS, with
/// SNI = Host and the certificate the Secret holds: example.org reaches v1, second-example.org
/// v2, and unknown-example.org, which the hostless listener takes and no route matches, 404.
#[test]
fn http_route_https_listener() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2"]);
    let cert = self_signed_secret(
        &mut w,
        "tls-validity-checks-certificate",
        &["*", "*.org", "*.wildcard.org"],
    );
    let port = free_port();
    let listener = |name: &str, hostname: Option<&str>| {
        let mut l = json!({"name": name, "port": port, "protocol": "HTTPS",
            "allowedRoutes": {"namespaces": {"from": "Same"}},
            "tls": {"certificateRefs": [{"group": "", "kind": "Secret",
                "name": "tls-validity-checks-certificate", "namespace": NS}]}});
        if let Some(h) = hostname {
            l["hostname"] = json!(h);
        }
        l
    };
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "same-namespace-with-https-listener",
            json!([
                listener("https", None),
                listener("https-with-hostname", Some("second-example.org")),
                listener("https-with-wildcard-hostname", Some("*.wildcard.org")),
                listener(
                    "https-with-hostname-matching-wildcard",
                    Some("fourth-example.wildcard.org")
                ),
            ]),
        ),
    );
    w.route(route(
        "httproute-https-test",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "same-namespace-with-https-listener"}],
               "hostnames": ["example.org"],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    w.route(route(
        "httproute-https-test-no-hostname",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "same-namespace-with-https-listener",
                               "sectionName": "https-with-hostname"}],
               "rules": [{"backendRefs": to("infra-backend-v2")}]}),
    ));
    let f = w.serve(port);
    for r in ["httproute-https-test", "httproute-https-test-no-hostname"] {
        assert_eq!(
            f.parent_conditions(r),
            ["Accepted=True/Accepted", "ResolvedRefs=True/ResolvedRefs"],
            "{r}"
        );
    }
    let listeners = f.status("Gateway", "same-namespace-with-https-listener", "listeners");
    assert_eq!(listeners.as_array().unwrap().len(), 4);
    for l in listeners.as_array().unwrap() {
        let got = conditions(&l["conditions"]);
        for want in [
            "Accepted=True/Accepted",
            "ResolvedRefs=True/ResolvedRefs",
            "Programmed=True/Programmed",
        ] {
            assert!(
                got.contains(&want.to_owned()),
                "{}: {want}: {got:?}",
                l["name"]
            );
        }
    }
    let squeeze = |pem: &str| pem.split_whitespace().collect::<String>();
    for (host, status, backend) in [
        ("example.org", 200, "infra-backend-v1"),
        ("unknown-example.org", 404, ""),
        ("second-example.org", 200, "infra-backend-v2"),
    ] {
        let (got, body, certs) = https_get(port, host);
        assert_eq!(got, status, "{host}: {body}");
        if status == 200 {
            assert!(
                body.starts_with(&format!("backend={backend} path=/\n")),
                "{host}: {body}"
            );
            assert!(
                body.to_lowercase().contains(&format!("host: {host}")),
                "{host}: {body}"
            );
        }
        assert!(
            squeeze(&certs).contains(&squeeze(&cert)),
            "{host}: the server's certificate is not the Secret's: {certs}"
        );
    }
}

/// The certificates the server sent, as PEM, to a client that sends no SNI (curl does not for
/// an IP address).
fn certs_without_sni(port: u16) -> String {
    let out = Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{certs}",
        ])
        .arg(format!("https://127.0.0.1:{port}/"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An HTTPS port with 40 certificates (40 listeners, a hostname and a Secret each): they are
/// lines of the crt-list `maps/gw-certs.list`, not a `crt` each on the bind line, which broke
/// past about 29 (HAProxy reads at most 64 words a line, and refused the whole set). The SNI
/// of the first, a middle and the last hostname gets that listener's certificate and its
/// route's backend; a client without SNI gets the port's first certificate. A second HTTPS
/// port of the Gateway keeps its own default: its first certificate, not the other port's.
#[test]
fn an_https_port_serves_forty_certificates_through_a_crt_list() {
    let mut w = world(&["infra-backend-v1", "infra-backend-v2", "infra-backend-v3"]);
    let (port, other) = (free_port(), free_port());
    let listener = |name: &str, port: u16, host: &str, secret: &str| {
        json!({"name": name, "port": port, "protocol": "HTTPS", "hostname": host,
            "allowedRoutes": {"namespaces": {"from": "Same"}},
            "tls": {"certificateRefs": [{"group": "", "kind": "Secret", "name": secret}]}})
    };
    let hosts: Vec<String> = (0..40).map(|i| format!("h{i:02}.example.org")).collect();
    let mut pems = Vec::new();
    let mut listeners = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        let secret = format!("certificate-{i:02}");
        pems.push(self_signed_secret(&mut w, &secret, &[host]));
        listeners.push(listener(&format!("https-{i:02}"), port, host, &secret));
    }
    let other_pem = self_signed_secret(&mut w, "certificate-other", &["other.example.org"]);
    listeners.push(listener(
        "other",
        other,
        "other.example.org",
        "certificate-other",
    ));
    // A certificate of both ports: one line of the crt-list.
    listeners.push(listener("other-shared", other, &hosts[5], "certificate-05"));
    apply(
        &mut w.stores,
        "gateways",
        gateway("many-certificates", Json::from(listeners)),
    );
    let routes = [
        (0, "infra-backend-v1"),
        (20, "infra-backend-v2"),
        (39, "infra-backend-v3"),
    ];
    for (i, backend) in routes {
        w.route(route(
            &format!("route-{i:02}"),
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [{"name": "many-certificates"}],
                   "hostnames": [hosts[i]],
                   "rules": [{"backendRefs": to(backend)}]}),
        ));
    }
    w.route(route(
        "route-other",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "many-certificates", "sectionName": "other"}],
               "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let (files, _) = w.render((free_port(), free_port()));
    let list = files.text("maps/gw-certs.list").unwrap();
    assert_eq!(list.lines().filter(|l| !l.is_empty()).count(), 41, "{list}");
    let f = w.serve(port);
    let listeners = f.status("Gateway", "many-certificates", "listeners");
    assert_eq!(listeners.as_array().unwrap().len(), 42);
    for l in listeners.as_array().unwrap() {
        let got = conditions(&l["conditions"]);
        assert!(
            got.contains(&"Programmed=True/Programmed".to_owned()),
            "{}: {got:?}",
            l["name"]
        );
    }
    let squeeze = |pem: &str| pem.split_whitespace().collect::<String>();
    let served = |certs: &str, pem: &str| squeeze(certs).contains(&squeeze(pem));
    for (i, backend) in routes {
        let (got, body, certs) = https_get(port, &hosts[i]);
        assert_eq!(got, 200, "{}: {body}", hosts[i]);
        assert!(
            body.starts_with(&format!("backend={backend} path=/\n")),
            "{}: {body}",
            hosts[i]
        );
        assert!(
            served(&certs, &pems[i]),
            "{}: not its listener's certificate: {certs}",
            hosts[i]
        );
    }
    assert!(
        served(&certs_without_sni(port), &pems[0]),
        "without SNI: the port's first certificate"
    );
    let (got, body, certs) = https_get(other, "other.example.org");
    assert_eq!(got, 200, "{body}");
    assert!(
        body.starts_with("backend=infra-backend-v1 path=/\n"),
        "{body}"
    );
    assert!(served(&certs, &other_pem), "{certs}");
    assert!(
        served(&certs_without_sni(other), &other_pem),
        "without SNI on the other port: its own first certificate"
    );
}

/// ingress-nginx's ssl-passthrough next to an HTTPS listener on the Ingress frontend's port:
/// the hosts the listener covers stay the Gateway's (terminated, routed by its HTTPRoute),
/// whatever an Ingress asks; the Ingress's other hosts are passed through.
#[test]
fn gateway_https_listener_keeps_its_hosts_from_ssl_passthrough() {
    let (http_port, https_port) = (free_port(), free_port());
    let mut w = world_in(
        stores_with_ports(Vec::new(), (http_port, https_port)),
        &["infra-backend-v1"],
    );
    // The passthrough backend: TLS, answering with the SNI it got.
    let tls = free_port();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("backend.pem"),
        format!(
            "{}{}",
            haptic_render::fixtures::TLS_CERT_PEM,
            haptic_render::fixtures::TLS_KEY_PEM
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("haproxy.cfg"),
        format!(
            "global\n    maxconn 100\n    default-path config\n\
             defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
             frontend tls\n    bind 127.0.0.1:{tls} ssl crt backend.pem\n\
             \x20   http-request return status 200 content-type text/plain lf-string \"passthrough sni=%[ssl_fc_sni]\"\n"
        ),
    )
    .unwrap();
    let _backend = start(dir, &[tls]);
    apply(
        &mut w.stores,
        "services",
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": NS, "name": "secure"},
            "spec": {"ports": [{"name": "https", "port": 443}]}}),
    );
    apply(
        &mut w.stores,
        "endpointslices",
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": NS, "name": "secure-1",
                "labels": {"kubernetes.io/service-name": "secure"}},
            "addressType": "IPv4",
            "ports": [{"name": "https", "port": tls}],
            "endpoints": [{"addresses": ["127.0.0.1"]}]}),
    );
    apply(
        &mut w.stores,
        "ingressclasses",
        haptic_render::fixtures::ingress_class("haptic", true),
    );
    let rule = |host: &str| {
        json!({"host": host, "http": {"paths": [{"path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": "secure", "port": {"number": 443}}}}]}})
    };
    apply(
        &mut w.stores,
        "ingresses",
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"namespace": NS, "name": "pass",
                "annotations": {"nginx.ingress.kubernetes.io/ssl-passthrough": "true"}},
            "spec": {"rules": [rule("gw.example"), rule("a.wild.example"), rule("pass.example")]}}),
    );
    // The listeners' certificate, for their hostnames.
    self_signed_secret(&mut w, "gw-cert", &["gw.example", "*.wild.example"]);
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "https", "port": https_port, "protocol": "HTTPS", "hostname": "gw.example",
                 "tls": {"certificateRefs": [{"name": "gw-cert"}]}},
                {"name": "wild", "port": https_port, "protocol": "HTTPS", "hostname": "*.wild.example",
                 "tls": {"certificateRefs": [{"name": "gw-cert"}]}},
            ]),
        ),
    );
    w.route(route(
        "simple",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": to("infra-backend-v1")}]}),
    ));
    let _f = w.serve_on(https_port, (http_port, https_port));
    assert_eq!(
        https_body(https_port, "pass.example"),
        "passthrough sni=pass.example"
    );
    for host in ["gw.example", "a.wild.example"] {
        let body = https_body(https_port, host);
        assert!(
            body.starts_with("backend=infra-backend-v1 "),
            "{host}: {body}"
        );
    }
}

/// The files of `b` that differ from `a`'s (both hold the same paths).
fn changed(a: &FileSet, b: &FileSet) -> Vec<String> {
    assert_eq!(
        a.files().keys().collect::<Vec<_>>(),
        b.files().keys().collect::<Vec<_>>()
    );
    a.iter()
        .filter(|(path, content)| b.get(path) != Some(*content))
        .map(|(path, _)| path.to_owned())
        .collect()
}

/// Matches without conditions whose rule has no filter and one backend are entries of the
/// gateway maps; the others stay lines of haproxy.cfg, and the spec's precedence holds between
/// the two: host first (an exact host before a wildcard before none, the most specific listener
/// only), then path (Exact, then the longest prefix), then the match with conditions before
/// the one without.
#[test]
fn plain_matches_in_the_maps_keep_the_spec_precedence_with_the_matches_of_haproxy_cfg() {
    let names = [
        "v-a", "v-b", "v-c", "v-d", "v-e", "v-f", "v-g", "v-h", "v-i",
    ];
    let mut w = world(&names);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([
                {"name": "any", "port": port, "protocol": "HTTP"},
                {"name": "wild", "port": port, "protocol": "HTTP", "hostname": "*.lis.example"},
                {"name": "exact", "port": port, "protocol": "HTTP", "hostname": "one.lis.example"},
            ]),
        ),
    );
    let header = json!([{"name": "x-b", "value": "1"}]);
    let prefix = |p: &str| json!({"path": {"type": "PathPrefix", "value": p}});
    let exact = |p: &str| json!({"path": {"type": "Exact", "value": p}});
    let with_header = |mut m: Json| {
        m["headers"] = header.clone();
        m
    };
    for (name, section, hostnames, matches, backend) in [
        // Host-less: A plain `/`, B `/foo` with a header, C plain Exact `/foo/bar`.
        ("a", "any", json!([]), json!([prefix("/")]), "v-a"),
        (
            "b",
            "any",
            json!([]),
            json!([with_header(prefix("/foo"))]),
            "v-b",
        ),
        ("c", "any", json!([]), json!([exact("/foo/bar")]), "v-c"),
        // A wildcard host D plain `/`, an exact host of it E `/foo` with a header, another
        // exact one F plain `/deep`, the wildcard again G `/foo` with a header.
        (
            "d",
            "any",
            json!(["*.wild.example"]),
            json!([prefix("/")]),
            "v-d",
        ),
        (
            "e",
            "any",
            json!(["x.wild.example"]),
            json!([with_header(prefix("/foo"))]),
            "v-e",
        ),
        (
            "f",
            "any",
            json!(["z.wild.example"]),
            json!([prefix("/deep")]),
            "v-f",
        ),
        (
            "g",
            "any",
            json!(["*.wild.example"]),
            json!([with_header(prefix("/foo"))]),
            "v-g",
        ),
        // The listeners *.lis.example (H plain `/`) and one.lis.example (I plain Exact `/only`).
        ("h", "wild", json!([]), json!([prefix("/")]), "v-h"),
        ("i", "exact", json!([]), json!([exact("/only")]), "v-i"),
    ] {
        w.route(route(
            name,
            "2026-01-01T00:00:00Z",
            json!({"parentRefs": [{"name": "gw", "sectionName": section}],
                "hostnames": hostnames,
                "rules": [{"matches": matches, "backendRefs": to(backend)}]}),
        ));
    }
    let (files, _) = w.render((free_port(), free_port()));
    let cfg = files.text("haproxy.cfg").unwrap();
    let exact_map = files.text("maps/gw-exact.map").unwrap();
    let prefix_map = files.text("maps/gw-prefix.map").unwrap();
    // The plain matches are map entries, keyed by port and listener hostname; the others are
    // lines of haproxy.cfg.
    for (map, line) in [
        (prefix_map, format!("{port}/*/*/ ")),
        (exact_map, format!("{port}/*/*/foo/bar ")),
        (prefix_map, format!("{port}/*/*.wild.example/ ")),
        (prefix_map, format!("{port}/*/z.wild.example/deep/ ")),
        (prefix_map, format!("{port}/*.lis.example/*.lis.example/ ")),
        (
            exact_map,
            format!("{port}/one.lis.example/one.lis.example/only "),
        ),
    ] {
        assert!(
            map.lines().any(|l| l.starts_with(&line)),
            "{line:?} in\n{map}"
        );
    }
    for plain in [
        "infra/a/", "infra/c/", "infra/d/", "infra/f/", "infra/h/", "infra/i/",
    ] {
        assert!(!cfg.contains(plain), "{plain} in haproxy.cfg");
    }
    for kept in ["infra/b/0", "infra/e/0", "infra/g/0"] {
        assert!(cfg.contains(kept), "{kept} not in haproxy.cfg");
    }

    let f = w.serve(port);
    let b = [("x-b", "1")];
    let on = |host: &str, path: &str, headers: &[(&str, &str)]| {
        get(f.port, host, path, headers).backend()
    };
    // Path: B's conditions beat A's plain match of the same host, A's shorter prefix loses to
    // B's; C's Exact path beats B's prefix.
    assert_eq!(on("example.com", "/foo", &b), "v-b");
    assert_eq!(on("example.com", "/foo/baz", &b), "v-b");
    assert_eq!(on("example.com", "/foo", &[]), "v-a");
    assert_eq!(on("example.com", "/foobar", &b), "v-a");
    assert_eq!(on("example.com", "/foo/bar", &b), "v-c");
    assert_eq!(on("example.com", "/foo/bar", &[]), "v-c");
    assert_eq!(on("example.com", "/foo/bar/x", &b), "v-b");
    // Host: the exact host E (haproxy.cfg) beats the wildcard D (map) and G (haproxy.cfg)...
    assert_eq!(on("x.wild.example", "/foo", &b), "v-e");
    assert_eq!(on("x.wild.example", "/other", &b), "v-d");
    // ... the wildcard G beats D's shorter path of the same host, and is tried on any host it
    // covers, however many labels...
    assert_eq!(on("y.wild.example", "/foo", &b), "v-g");
    assert_eq!(on("a.b.c.d.e.f.g.wild.example", "/foo", &b), "v-g");
    assert_eq!(on("a.b.c.d.e.f.g.wild.example", "/", &[]), "v-d");
    assert_eq!(on("y.wild.example", "/foo", &[]), "v-d");
    // ... and the exact host F (map) beats G (haproxy.cfg); a host-less route loses to any
    // host's.
    assert_eq!(on("z.wild.example", "/deep", &b), "v-f");
    assert_eq!(on("z.wild.example", "/foo", &b), "v-g");
    assert_eq!(on("wild.example", "/foo", &b), "v-b");
    // Listeners: one.lis.example gets the exact listener's routes only, then 404; the other
    // hosts of *.lis.example the wildcard listener's only.
    assert_eq!(on("one.lis.example", "/only", &[]), "v-i");
    assert_eq!(on("one.lis.example", "/other", &[]), "404");
    assert_eq!(on("one.lis.example", "/foo", &b), "404");
    assert_eq!(on("two.lis.example", "/only", &[]), "v-h");
    assert_eq!(on("two.lis.example", "/foo", &b), "v-h");
    assert_eq!(on("lis.example", "/foo", &b), "v-b");
}

/// The same host and path, one match without conditions: the older route's wins, whether it
/// is a map entry or a line of haproxy.cfg.
#[test]
fn of_two_unconditioned_matches_of_one_host_and_path_the_older_wins() {
    let mut w = world(&["v-old", "v-young", "v-other"]);
    // A plain route (map) older than one with a filter (haproxy.cfg), and the other way round.
    let filtered = |backend: &str| {
        json!({"matches": [{"path": {"type": "PathPrefix", "value": "/x"}}],
            "filters": [{"type": "RequestHeaderModifier",
                "requestHeaderModifier": {"set": [{"name": "x-f", "value": "1"}]}}],
            "backendRefs": to(backend)})
    };
    let plain = |backend: &str| {
        json!({"matches": [{"path": {"type": "PathPrefix", "value": "/x"}}],
            "backendRefs": to(backend)})
    };
    for (name, created, host, rule) in [
        (
            "p-old",
            "2025-01-01T00:00:00Z",
            "one.example",
            plain("v-old"),
        ),
        (
            "f-young",
            "2026-01-01T00:00:00Z",
            "one.example",
            filtered("v-young"),
        ),
        (
            "f-old",
            "2025-01-01T00:00:00Z",
            "two.example",
            filtered("v-old"),
        ),
        (
            "p-young",
            "2026-01-01T00:00:00Z",
            "two.example",
            plain("v-young"),
        ),
        (
            "other",
            "2026-01-01T00:00:00Z",
            "two.example",
            plain("v-other"),
        ),
    ] {
        let mut rule = rule;
        if name == "other" {
            rule["matches"][0]["path"]["value"] = json!("/y");
        }
        w.route(route(
            name,
            created,
            json!({"parentRefs": [{"name": "gw"}], "hostnames": [host], "rules": [rule]}),
        ));
    }
    let f = w.front();
    assert_eq!(f.to("one.example", "/x"), "v-old");
    assert_eq!(f.to("two.example", "/x"), "v-old");
    assert_eq!(f.to("two.example", "/y"), "v-other");
}

/// Adding, retargeting and removing a plain HTTPRoute (to a Service port another route already
/// routes to) changes the gateway maps only, never haproxy.cfg: the agent applies it through
/// the runtime API with no reload. The rendered maps route as they say.
#[test]
fn a_plain_route_added_retargeted_or_removed_changes_only_the_gateway_maps() {
    let mut w = world(&["v-a", "v-b"]);
    let port = free_port();
    apply(
        &mut w.stores,
        "gateways",
        gateway(
            "gw",
            json!([{"name": "http", "port": port, "protocol": "HTTP"}]),
        ),
    );
    // A route with a header match (haproxy.cfg) and a plain one (a map), both named after the
    // route added below in the order of names.
    w.route(route(
        "m-cond",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/c"},
                "headers": [{"name": "x-c", "value": "1"}]}], "backendRefs": to("v-a")}]}),
    ));
    w.route(route(
        "m-plain",
        "2026-01-01T00:00:00Z",
        json!({"parentRefs": [{"name": "gw"}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/p"}}],
                "backendRefs": to("v-b")}]}),
    ));
    let ports = (free_port(), free_port());
    let (before, _) = w.render(ports);
    let added = |backend: &str| {
        route(
            "a-added",
            "2026-02-01T00:00:00Z",
            json!({"parentRefs": [{"name": "gw"}], "hostnames": ["new.example"],
                "rules": [{"matches": [{"path": {"type": "Exact", "value": "/new"}}],
                    "backendRefs": to(backend)}]}),
        )
    };
    w.route(added("v-b"));
    let (with_route, _) = w.render(ports);
    assert_eq!(changed(&before, &with_route), ["maps/gw-exact.map"]);
    let f = w.serve(port);
    assert_eq!(f.to("new.example", "/new"), "v-b");
    assert_eq!(f.to("new.example", "/p"), "v-b");
    assert_eq!(
        get(port, "new.example", "/c", &[("x-c", "1")]).backend(),
        "v-a"
    );
    drop(f);

    w.route(added("v-a"));
    let (retargeted, _) = w.render(ports);
    assert_eq!(changed(&with_route, &retargeted), ["maps/gw-exact.map"]);
    let f = w.serve(port);
    assert_eq!(f.to("new.example", "/new"), "v-a");
    drop(f);

    w.stores
        .get_mut("httproutes")
        .unwrap()
        .remove(NS, "a-added");
    let (removed, _) = w.render(ports);
    assert_eq!(changed(&retargeted, &removed), ["maps/gw-exact.map"]);
    assert!(changed(&before, &removed).is_empty());
}
