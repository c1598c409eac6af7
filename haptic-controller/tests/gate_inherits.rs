//! The render gate's inherited pass (`render_gate::passes_as`): a set that differs from one
//! `haproxy -c` passed only in server slots and entries of maps looked up by key or prefix
//! passes with no check of its own. Judged against the real `haproxy -c` on sets the reference
//! templates render: every set it lets pass, HAProxy passes too; what it does not cover (a
//! crt-list line, a regex map, a new backend, a hostname, a map a crt-list names) it leaves to
//! HAProxy.

mod common;

use haptic_controller::render_gate::{self, passes_as};
use haptic_render::{FileSet, Renderer, Stores, fixtures, reference};
use serde_json::{Value as Json, json};

const NS: &str = "shop";

fn render(renderer: &Renderer, stores: &Stores) -> FileSet {
    renderer.render(stores).expect("the reference set renders")
}

fn apply(stores: &mut Stores, store: &str, resource: &Json) {
    stores
        .get_mut(store)
        .expect("a store of the reference set")
        .apply(resource)
        .expect("the resource is taken");
}

async fn haproxy_passes(files: &FileSet) {
    if let Err(refusal) = render_gate::check_files(&common::haproxy_bin(), files).await {
        panic!("haproxy -c refused a set: {refusal:?}");
    }
}

/// A Service `name` with one ready endpoint at `address`, and an Ingress routing `host` to it.
fn new_route(stores: &mut Stores, name: &str, host: &str, address: &str) {
    apply(
        stores,
        "services",
        &json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": NS, "name": name},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
        }),
    );
    apply(
        stores,
        "endpointslices",
        &json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": NS, "name": format!("{name}-1"),
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [address], "conditions": {"ready": true}}],
        }),
    );
    apply(
        stores,
        "ingresses",
        &json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"namespace": NS, "name": name},
            "spec": {"ingressClassName": fixtures::FIXTURE_CLASS, "rules": [{"host": host, "http": {"paths": [
                {"path": "/", "pathType": "Prefix",
                 "backend": {"service": {"name": name, "port": {"number": 80}}}},
            ]}}]},
        }),
    );
}

/// `files` with `path` replaced by `edit` of its text.
fn edited(files: &FileSet, path: &str, edit: impl FnOnce(&str) -> String) -> FileSet {
    let mut all: std::collections::BTreeMap<String, Vec<u8>> = files
        .iter()
        .map(|(path, content)| (path.to_owned(), content.to_vec()))
        .collect();
    let text = String::from_utf8(all[path].clone()).expect("text");
    all.insert(path.to_owned(), edit(&text).into_bytes());
    FileSet::new(all)
}

#[tokio::test]
async fn sets_that_differ_in_server_slots_and_map_entries_pass_as_the_checked_one() {
    let renderer = Renderer::compile(&reference::template_set()).expect("compiles");
    let fixture = fixtures::generate(12);
    let mut stores = reference::stores().expect("stores");
    fixture.load(&mut stores).expect("fixtures load");
    let checked = render(&renderer, &stores);
    haproxy_passes(&checked).await;

    // An endpoint moved: one server slot's address.
    let mut slice = fixture.endpoint_slices[3].clone();
    slice["endpoints"][0]["addresses"] = json!(["10.200.0.7"]);
    apply(&mut stores, "endpointslices", &slice);
    let moved = render(&renderer, &stores);
    assert_ne!(moved.checksum_hex(), checked.checksum_hex());
    assert!(passes_as(&checked, &moved), "an endpoint change");
    haproxy_passes(&moved).await;

    // A new Service on a spare backend of the pool, routed by a new Ingress: map entries and
    // a server slot. Judged against the first set too (the changes add up).
    new_route(&mut stores, "fresh", "fresh.example", "10.200.0.8");
    let routed = render(&renderer, &stores);
    assert!(passes_as(&moved, &routed), "a new route on a spare backend");
    assert!(passes_as(&checked, &routed), "both changes at once");
    haproxy_passes(&routed).await;

    // Not covered: a new TLS host (a crt-list line and a certificate file).
    let mut tls = reference::stores().expect("stores");
    fixture.load(&mut tls).expect("fixtures load");
    let mut ingress = fixture.ingresses[1].clone();
    assert!(
        ingress["spec"]["tls"].is_null(),
        "the fixture's second Ingress has no TLS"
    );
    let host = ingress["spec"]["rules"][0]["host"].clone();
    ingress["spec"]["tls"] = json!([{"hosts": [host], "secretName": "extra-tls"}]);
    let namespace = ingress["metadata"]["namespace"]
        .as_str()
        .expect("namespace")
        .to_owned();
    apply(
        &mut tls,
        "secrets",
        &fixtures::tls_secret(&namespace, "extra-tls"),
    );
    apply(&mut tls, "ingresses", &ingress);
    let with_tls = render(&renderer, &tls);
    assert!(!passes_as(&checked, &with_tls), "a new TLS host");

    // Not covered: a regex path (a map HAProxy reads in file order, `map_reg`).
    let mut regex = reference::stores().expect("stores");
    fixture.load(&mut regex).expect("fixtures load");
    let mut ingress = fixture.ingresses[2].clone();
    ingress["metadata"]["annotations"] = json!({"nginx.ingress.kubernetes.io/use-regex": "true"});
    ingress["spec"]["rules"][0]["http"]["paths"][0]["path"] = json!("/api/v[0-9]+");
    ingress["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = json!("ImplementationSpecific");
    apply(&mut regex, "ingresses", &ingress);
    let with_regex = render(&renderer, &regex);
    assert_ne!(with_regex.checksum_hex(), checked.checksum_hex());
    assert!(!passes_as(&checked, &with_regex), "a regex path");

    // Not covered, in the files themselves: a server at a host name (HAProxy resolves it), a
    // line added to haproxy.cfg, a map that a crt-list names, a file added or removed.
    let hostname = edited(&moved, "haproxy.cfg", |text| {
        text.replacen("10.200.0.7:8080", "fresh.example:8080", 1)
    });
    assert_ne!(hostname.checksum_hex(), moved.checksum_hex());
    assert!(!passes_as(&checked, &hostname), "a server at a host name");
    let line = edited(&moved, "haproxy.cfg", |text| {
        text.replacen("    server ", "    http-request deny\n    server ", 1)
    });
    assert!(!passes_as(&checked, &line), "a line added");
    let named = edited(&routed, "maps/certs.list", |text| {
        format!("{text}maps/pool.map\n")
    });
    let named_before = edited(&checked, "maps/certs.list", |text| {
        format!("{text}maps/pool.map\n")
    });
    assert!(passes_as(&checked, &routed));
    assert!(!passes_as(&named_before, &named), "a map a crt-list names");
    let mut more: std::collections::BTreeMap<String, Vec<u8>> = moved
        .iter()
        .map(|(path, content)| (path.to_owned(), content.to_vec()))
        .collect();
    more.insert("maps/extra.map".to_owned(), b"a b\n".to_vec());
    assert!(!passes_as(&checked, &FileSet::new(more)), "a file added");
    let mut fewer: std::collections::BTreeMap<String, Vec<u8>> = moved
        .iter()
        .map(|(path, content)| (path.to_owned(), content.to_vec()))
        .collect();
    let certificate = fewer
        .keys()
        .find(|path| path.ends_with(".pem"))
        .expect("the fixture has certificates")
        .clone();
    fewer.remove(&certificate);
    assert!(!passes_as(&checked, &FileSet::new(fewer)), "a file removed");
}

/// The premise of the gate's shortcut (`render_gate`: a render that passes as a set waiting
/// for a check waits in its place, not compared with the last pass): a set that passes as one
/// that did not pass as the checked set does not pass as it either. Here after the backend
/// pool grew (its reserve raised: every pooled backend section moved), then a new route on a
/// spare of the grown pool; HAProxy passes each.
#[tokio::test]
async fn a_set_like_one_that_needs_a_check_needs_one_too() {
    let mut set = reference::template_set();
    set.extra_context
        .get_mut("haproxy")
        .and_then(Json::as_object_mut)
        .expect("the reference's haproxy context")
        .insert(
            "backend_pool_reserve".into(),
            json!("haptic-system/haptic-backend-pool"),
        );
    let renderer = Renderer::compile(&set).expect("compiles");
    let fixture = fixtures::generate(12);
    let mut stores = reference::stores().expect("stores");
    fixture.load(&mut stores).expect("fixtures load");
    let reserve = |size: usize| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"namespace": "haptic-system", "name": "haptic-backend-pool",
                "labels": {"haproxy-haptic.org/backend-pool": "true"}},
            "data": {"size": size.to_string()}})
    };
    let backends = |files: &FileSet| {
        files
            .text("haproxy.cfg")
            .expect("haproxy.cfg")
            .lines()
            .filter(|line| line.starts_with("backend pool_"))
            .count()
    };
    apply(&mut stores, "backend_pool", &reserve(48));
    let checked = render(&renderer, &stores);
    assert_eq!(backends(&checked), 48, "the reserve sizes the pool");
    haproxy_passes(&checked).await;

    apply(&mut stores, "backend_pool", &reserve(96));
    let grown = render(&renderer, &stores);
    assert_eq!(backends(&grown), 96, "the pool grew");
    assert!(!passes_as(&checked, &grown), "a grown pool needs a check");
    haproxy_passes(&grown).await;

    new_route(&mut stores, "fresh", "fresh.example", "10.200.0.8");
    let routed = render(&renderer, &stores);
    assert!(
        passes_as(&grown, &routed),
        "a new route on a spare of the grown pool"
    );
    assert!(
        !passes_as(&checked, &routed),
        "what the grown set differs in from the checked one is still there"
    );
    haproxy_passes(&routed).await;
}
