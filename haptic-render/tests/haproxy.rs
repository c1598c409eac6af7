//! The reference template set rendered for generated and broken Ingresses, checked by the real
//! `haproxy -c`.

#![allow(clippy::unwrap_used)]

mod common;

use common::{haproxy_check, reference_stores, render_reference, section};
use haptic_render::functions::ssl_file;
use serde_json::json;

#[test]
fn ten_ingresses_render_a_config_haproxy_accepts() {
    let stores = reference_stores(10);
    let files = render_reference(&stores);
    haproxy_check(&files);

    let cfg = files.text("haproxy.cfg").expect("haproxy.cfg");
    // A backend per Service port an Ingress routes to: port 80 of the 10 Services, and port
    // 9090 of every 3rd (0, 3, 6, 9). Unrouted ports get none. The plain ones (10: the
    // Ingresses 1, 5 and 9 carry ingress-nginx annotations, whose backends have their own
    // names) are each one of the pool's (maps/pool.map names it), which has 64 (10 and a step
    // of 32 spares, rounded up to the step); plus the default backend.
    let pool = files.text("maps/pool.map").expect("maps/pool.map");
    assert_eq!(pool.lines().count(), 10, "{pool}");
    assert!(!pool.contains("team-01_app-00001_9090"), "{pool}");
    assert!(pool.contains("team-03_app-00003_9090 pool_"), "{pool}");
    assert_eq!(cfg.matches("\nbackend pool_").count(), 64, "{cfg}");
    assert_eq!(cfg.matches("\nbackend ").count(), 64 + 4 + 1, "{cfg}");
    // Every backend of a Service has 10 server slots (the default `server_slots`); a spare
    // has none (a Service that takes one gets its slots by `add server`). Three endpoints
    // per slice, the third not ready in every 5th slice (0 and 5): the ready ones are the
    // enabled servers; the rest of the slots are disabled.
    assert_eq!(cfg.matches("    server ").count(), (10 + 4) * 10, "{cfg}");
    let spare = cfg
        .split("\nbackend ")
        .filter(|section| section.starts_with("pool_"))
        .find(|section| !pool.contains(&format!(" {}\n", section.lines().next().unwrap_or(""))))
        .expect("a spare");
    assert_eq!(
        spare.lines().count(),
        2,
        "a spare is its header and balance: {spare}"
    );
    let enabled = cfg
        .lines()
        .filter(|l| l.starts_with("    server ") && !l.contains(" disabled"))
        .count();
    assert_eq!(enabled, (10 * 3 - 2) + (4 * 3 - 1), "{cfg}");
    let web = section(&files, "team-00_app-00000_80");
    assert!(web.starts_with("pool_"), "{web}");
    assert!(cfg.contains(&format!(
        "backend {web}\n    balance roundrobin\n    server s1 "
    )));
    assert!(cfg.contains(" 10.0.0.1:8080 check"), "{cfg}");
    assert!(cfg.contains(" 127.0.0.1:1 disabled check"), "{cfg}");
    // Ingresses 0, 4 and 8 have TLS: HTTPS is on.
    assert!(
        cfg.contains("ssl strict-sni crt-list maps/certs.list"),
        "{cfg}"
    );

    let exact = files.text("maps/routes-exact.map").expect("exact map");
    assert!(exact.contains("\napp-00003.team-03.example.com/healthz team-03_app-00003_80\n"));
    assert_eq!(
        exact.trim().lines().count(),
        10,
        "one Exact path per Ingress:\n{exact}"
    );
    let prefix = files.text("maps/routes-prefix.map").expect("prefix map");
    assert!(prefix.contains("\napp-00003.team-03.example.com/ team-03_app-00003_80\n"));
    // A Prefix path's trailing slash is normalized: `/metrics/` and `/metrics` are one key.
    assert!(prefix.contains("\napp-00003.team-03.example.com/metrics/ team-03_app-00003_9090\n"));
    // Ingress 0 has a rule without a host, keyed with `*`.
    assert!(
        prefix.contains("\n*/shared/app-00000/ team-00_app-00000_80\n"),
        "{prefix}"
    );

    let certs = files.text("maps/certs.list").expect("crt-list");
    assert_eq!(certs.trim().lines().count(), 3, "{certs}");
    assert!(certs.contains(&format!(
        "{} app-00004.team-04.example.com",
        ssl_file("team-04", "app-00004-tls")
    )));
    for n in ["00000", "00004", "00008"] {
        let ns = &n[3..];
        let path = ssl_file(&format!("team-{ns}"), &format!("app-{n}-tls"));
        let pem = files
            .text(&path)
            .unwrap_or_else(|| panic!("{path} missing"));
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----") && pem.contains("PRIVATE KEY"));
    }
    assert_eq!(
        files.iter().filter(|(p, _)| p.starts_with("ssl/")).count(),
        3
    );
}

#[test]
fn a_thousand_ingresses_render_a_config_haproxy_accepts() {
    let stores = reference_stores(1000);
    let files = render_reference(&stores);
    haproxy_check(&files);
    let cfg = files.text("haproxy.cfg").expect("haproxy.cfg");
    // Port 80 of every Service, port 9090 of every 3rd, the default backend; the plain ones
    // in the pool, with its spares.
    let pooled = files
        .text("maps/pool.map")
        .expect("maps/pool.map")
        .lines()
        .count();
    assert!(pooled > 900, "{pooled}");
    let pool = haptic_render::pool::size(pooled, haptic_render::pool::DEFAULT_STEP);
    assert_eq!(cfg.matches("\nbackend pool_").count(), pool);
    assert_eq!(
        cfg.matches("\nbackend ").count(),
        (1000 + 334 - pooled) + pool + 1
    );
    assert_eq!(
        files
            .text("maps/certs.list")
            .unwrap()
            .trim()
            .lines()
            .count(),
        250
    );
    // haproxy.cfg, eight maps (ssl-passthrough's and the two gateway maps empty; the pool's),
    // the crt-lists (the Gateway HTTPS ports' empty), a PEM per TLS Secret.
    assert_eq!(files.len(), 11 + 250);
    for map in [
        "maps/gw-exact.map",
        "maps/gw-prefix.map",
        "maps/gw-certs.list",
    ] {
        assert_eq!(files.text(map).map(str::trim), Some(""));
    }
}

#[test]
fn without_tls_there_is_no_https_bind() {
    let mut stores = haptic_render::reference::stores().unwrap();
    let mut params = haptic_render::fixtures::Params::new(3);
    params.tls_every = 0;
    params.generate().load(&mut stores).unwrap();
    let files = render_reference(&stores);
    haproxy_check(&files);
    assert!(!files.text("haproxy.cfg").unwrap().contains("ssl crt-list"));
    assert_eq!(files.text("maps/certs.list").map(str::trim), Some(""));
}

/// One good Ingress and many broken ones: the config still passes `haproxy -c`, the good one
/// is routed and none of the broken parts reach a map.
#[test]
fn broken_ingresses_never_produce_an_invalid_config() {
    let mut stores = reference_stores(2);
    let ingress = |name: &str, spec: serde_json::Value| json!({"metadata": {"namespace": "broken", "name": name}, "spec": spec});
    let rule = |host: &str, path: &str, path_type: &str, service: &str, port: serde_json::Value| {
        json!({"host": host, "http": {"paths": [{"path": path, "pathType": path_type,
            "backend": {"service": {"name": service, "port": port}}}]}})
    };
    let broken = [
        // The Service does not exist.
        ingress(
            "missing-svc",
            json!({"rules": [rule("a.broken.example.com", "/", "Prefix", "nope", json!({"number": 80}))]}),
        ),
        // Paths that would break a map file or are not absolute.
        ingress(
            "bad-path-1",
            json!({"rules": [rule("b.broken.example.com", "no-slash", "Prefix", "web", json!({"number": 80}))]}),
        ),
        ingress(
            "bad-path-2",
            json!({"rules": [rule("c.broken.example.com", "/with space", "Exact", "web", json!({"number": 80}))]}),
        ),
        ingress(
            "bad-path-3",
            json!({"rules": [rule("d.broken.example.com", "/a\nb", "Exact", "web", json!({"number": 80}))]}),
        ),
        // A port the Service does not have, by number and by name.
        ingress(
            "bad-port-1",
            json!({"rules": [rule("e.broken.example.com", "/", "Prefix", "web", json!({"number": 81}))]}),
        ),
        ingress(
            "bad-port-2",
            json!({"rules": [rule("f.broken.example.com", "/", "Prefix", "web", json!({"name": "grpc"}))]}),
        ),
        // A wildcard host (supported), and hosts that are not plain names.
        ingress(
            "bad-host-1",
            json!({"rules": [rule("*.wild.example.com", "/", "Prefix", "web", json!({"number": 80}))]}),
        ),
        ingress(
            "bad-host-2",
            json!({"rules": [rule("UPPER.example.com x", "/", "Prefix", "web", json!({"number": 80}))]}),
        ),
        // No rules, empty rules, a rule without http, a resource backend.
        ingress("no-rules", json!({})),
        ingress("empty-rules", json!({"rules": []})),
        ingress(
            "no-http",
            json!({"rules": [{"host": "g.broken.example.com"}]}),
        ),
        ingress(
            "resource-backend",
            json!({"rules": [{"host": "h.broken.example.com", "http": {"paths": [
            {"path": "/", "pathType": "Prefix", "backend": {"resource": {"kind": "Bucket", "name": "b"}}}]}}]}),
        ),
        // TLS naming a missing Secret, a Secret of the wrong type, one with bad base64 and one
        // whose data is not PEM.
        ingress(
            "tls-missing",
            json!({"tls": [{"hosts": ["i.broken.example.com"], "secretName": "absent"}]}),
        ),
        ingress("tls-opaque", json!({"tls": [{"secretName": "opaque"}]})),
        ingress("tls-bad-b64", json!({"tls": [{"secretName": "bad-b64"}]})),
        ingress("tls-not-pem", json!({"tls": [{"secretName": "not-pem"}]})),
        // A host that is not a string (the API server refuses it): left out, not "any host".
        ingress(
            "host-not-string",
            json!({"rules": [{"host": ["evil.example.com"], "http": {"paths": [{"path": "/evil",
                "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}),
        ),
        // Not broken: HTTPS and HTTP/3 on one number (443/TCP, 443/UDP), routed by number and
        // by either name: one backend, of the TCP port.
        ingress(
            "quic-by-number",
            json!({"rules": [rule("q1.broken.example.com", "/", "Prefix", "quic", json!({"number": 443}))]}),
        ),
        ingress(
            "quic-by-name",
            json!({"rules": [rule("q2.broken.example.com", "/", "Prefix", "quic", json!({"name": "https"}))]}),
        ),
        ingress(
            "quic-by-udp-name",
            json!({"rules": [rule("q3.broken.example.com", "/", "Prefix", "quic", json!({"name": "h3"}))]}),
        ),
    ];
    let ingresses = stores.get_mut("ingresses").unwrap();
    for resource in &broken {
        ingresses.apply(resource).unwrap();
    }
    ingresses
        .apply(&ingress("good", json!({"rules": [rule("good.broken.example.com", "/", "Prefix", "web", json!({"number": 80}))]})))
        .unwrap();
    stores
        .get_mut("services")
        .unwrap()
        .apply(&json!({"metadata": {"namespace": "broken", "name": "web"},
            "spec": {"ports": [{"name": "http", "port": 80}]}}))
        .unwrap();
    stores
        .get_mut("services")
        .unwrap()
        .apply(&json!({"metadata": {"namespace": "broken", "name": "quic"},
            "spec": {"ports": [{"name": "h3", "port": 443, "protocol": "UDP"},
                               {"name": "https", "port": 443, "protocol": "TCP"}]}}))
        .unwrap();
    let slices = stores.get_mut("endpointslices").unwrap();
    // A slice without endpoints, one of FQDNs and one whose endpoints lack addresses.
    for (name, body) in [
        (
            "web-a",
            json!({"addressType": "IPv4", "ports": [{"name": "http", "port": 8080}]}),
        ),
        (
            "web-b",
            json!({"addressType": "FQDN", "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": ["db.example.com"]}]}),
        ),
        (
            "web-c",
            json!({"addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"conditions": {"ready": true}}, {"addresses": ["10.9.9.9"]}]}),
        ),
        (
            "quic-a",
            json!({"addressType": "IPv4", "ports": [{"name": "h3", "port": 8443, "protocol": "UDP"},
                {"name": "https", "port": 8443, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.8.8.8"]}]}),
        ),
        // Not broken: IPv6 endpoints are written in brackets.
        (
            "web-d",
            json!({"addressType": "IPv6", "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": ["fd00::1"], "conditions": {"ready": true}}]}),
        ),
    ] {
        let mut slice = body;
        let service = if name.starts_with("quic") {
            "quic"
        } else {
            "web"
        };
        slice["metadata"] = json!({"namespace": "broken", "name": name,
            "labels": {"kubernetes.io/service-name": service}});
        slices.apply(&slice).unwrap();
    }
    let secrets = stores.get_mut("secrets").unwrap();
    secrets
        .apply(
            &json!({"metadata": {"namespace": "broken", "name": "opaque"}, "type": "Opaque",
            "data": {"tls.crt": "eA==", "tls.key": "eA=="}}),
        )
        .unwrap();
    secrets
        .apply(&json!({"metadata": {"namespace": "broken", "name": "bad-b64"}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": "%%%", "tls.key": "%%%"}}))
        .unwrap();
    secrets
        .apply(&json!({"metadata": {"namespace": "broken", "name": "not-pem"}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": "aGVsbG8=", "tls.key": "aGVsbG8="}}))
        .unwrap();

    let files = render_reference(&stores);
    haproxy_check(&files);

    let maps: String = files
        .iter()
        .filter(|(p, _)| p.starts_with("maps/"))
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert!(
        maps.contains("good.broken.example.com/ broken_web_80\n"),
        "{maps}"
    );
    for host in ["a", "b", "c", "d", "e", "f", "h"] {
        let line_start = format!("\n{host}.broken.example.com");
        assert!(
            !maps.contains(&line_start),
            "{host}.broken reached a map:\n{maps}"
        );
    }
    // A wildcard host is supported: its rule is written as it is.
    assert!(
        maps.contains("*.wild.example.com/ broken_web_80\n"),
        "{maps}"
    );
    for absent in ["UPPER", "with space", "no-slash", "/broken_"] {
        assert!(!maps.contains(absent), "`{absent}` reached a map:\n{maps}");
    }
    assert!(!files.iter().any(|(p, _)| p.contains("/broken_")));
    let cfg = files.text("haproxy.cfg").unwrap();
    let web = cfg
        .split(&format!("backend {}\n", section(&files, "broken_web_80")))
        .nth(1)
        .expect("web backend");
    let web = web.split("\nbackend ").next().unwrap_or_default();
    let enabled: Vec<&str> = web
        .lines()
        .filter(|l| l.contains("server ") && !l.contains(" disabled"))
        .collect();
    assert_eq!(enabled.len(), 2, "10.9.9.9 and fd00::1 only:\n{web}");
    assert!(
        enabled.iter().any(|l| l.ends_with(" 10.9.9.9:8080 check")),
        "{web}"
    );
    assert!(
        enabled.iter().any(|l| l.ends_with(" [fd00::1]:8080 check")),
        "{web}"
    );
    // 443/TCP and 443/UDP: one backend, with the TCP slice port's endpoint; routed by number
    // and by the TCP name, not by the UDP name.
    let quic = format!("backend {}\n", section(&files, "broken_quic_443"));
    assert_eq!(cfg.matches(&quic).count(), 1, "{cfg}");
    assert!(cfg.contains(" 10.8.8.8:8443 check"), "{cfg}");
    assert!(
        maps.contains("q1.broken.example.com/ broken_quic_443\n"),
        "{maps}"
    );
    assert!(
        maps.contains("q2.broken.example.com/ broken_quic_443\n"),
        "{maps}"
    );
    assert!(!maps.contains("q3.broken"), "{maps}");
    // The rule whose host is not a string wrote nothing, under no host.
    assert!(!maps.contains("/evil"), "{maps}");
}
