//! Overlays: a change laid over the stores renders as if the stores held it, leaves the stores
//! as they were, and is where `refuse()` turns an untrusted value into a named error; a normal
//! render never writes such a value into the set.

mod common;

use haptic_render::{Change, FileSet, Renderer, Stores, fixtures, reference};
use serde_json::{Value as Json, json};

fn renderer() -> Renderer {
    Renderer::compile(&reference::template_set()).expect("reference set compiles")
}

/// The stores with 20 generated Ingresses, and the fixtures' Ingress `i`.
fn stores_and_ingress(i: usize) -> (Stores, Json) {
    let fx = fixtures::generate(20);
    let mut stores = reference::stores().expect("stores");
    fx.load(&mut stores).expect("load");
    (stores, fx.ingresses[i].clone())
}

fn applied(stores: &Stores, store: &str, resource: &Json) -> FileSet {
    let mut copy = stores.clone();
    copy.get_mut(store)
        .expect("store")
        .apply(resource)
        .expect("apply");
    renderer().render(&copy).expect("render")
}

#[test]
fn an_overlay_renders_as_the_change_applied_and_leaves_the_stores_alone() {
    let (stores, mut ingress) = stores_and_ingress(4);
    let renderer = renderer();
    let before = renderer.render(&stores).expect("render");

    // A changed Ingress (new host, TLS kept), a new one, a removed one, a changed Service.
    ingress["spec"]["rules"][0]["host"] = json!("changed.example.com");
    let mut new = ingress.clone();
    new["metadata"]["name"] = json!("brand-new");
    let fx = fixtures::generate(20);
    let mut service = fx.services[4].clone();
    service["spec"]["ports"] = json!([{"name": "metrics", "port": 9090, "protocol": "TCP"}]);
    for (store, resource) in [
        ("ingresses", &ingress),
        ("ingresses", &new),
        ("services", &service),
    ] {
        let overlay = stores
            .overlay(store, Change::Apply(resource))
            .expect("overlay");
        let over = renderer.render_overlay(&stores, &overlay).expect("render");
        assert_eq!(over, applied(&stores, store, resource), "{store}");
        assert_ne!(
            over.checksum(),
            before.checksum(),
            "{store}: the change shows"
        );
    }
    let removal = stores
        .overlay(
            "ingresses",
            Change::Remove {
                namespace: "team-04",
                name: "app-00004",
            },
        )
        .expect("overlay");
    let over = renderer.render_overlay(&stores, &removal).expect("render");
    let mut copy = stores.clone();
    assert!(
        copy.get_mut("ingresses")
            .expect("store")
            .remove("team-04", "app-00004")
    );
    assert_eq!(over, renderer.render(&copy).expect("render"));
    assert!(
        !over
            .text("maps/routes-prefix.map")
            .unwrap_or("")
            .contains("app-00004")
    );

    // The stores themselves never changed.
    assert_eq!(renderer.render(&stores).expect("render"), before);
    assert!(stores.overlay("nope", Change::Apply(&ingress)).is_err());
    assert!(
        stores
            .overlay("ingresses", Change::Apply(&json!({"metadata": {}})))
            .is_err()
    );
}

/// An injected line for each field the reference templates read from an Ingress.
const INJECTED: &str = "x\n    lua-load /etc/passwd";

fn with_field(ingress: &Json, field: &str) -> Json {
    let mut ing = ingress.clone();
    match field {
        "spec.rules[].host" => ing["spec"]["rules"][0]["host"] = json!(INJECTED),
        "spec.rules[].http.paths[].path" => {
            ing["spec"]["rules"][0]["http"]["paths"][0]["path"] = json!(format!("/{INJECTED}"))
        }
        "spec.tls[].secretName" => ing["spec"]["tls"][0]["secretName"] = json!(INJECTED),
        "spec.tls[].hosts[]" => ing["spec"]["tls"][0]["hosts"] = json!([INJECTED]),
        other => panic!("no such field {other}"),
    }
    ing
}

#[test]
fn untrusted_ingress_fields_are_refused_under_review_and_never_rendered() {
    // Ingress 4 has TLS (every 4th).
    let (stores, ingress) = stores_and_ingress(4);
    let renderer = renderer();
    for field in [
        "spec.rules[].host",
        "spec.rules[].http.paths[].path",
        "spec.tls[].secretName",
        "spec.tls[].hosts[]",
    ] {
        let bad = with_field(&ingress, field);
        let overlay = stores
            .overlay("ingresses", Change::Apply(&bad))
            .expect("overlay");
        let error = renderer
            .render_overlay(&stores, &overlay)
            .expect_err(field)
            .to_string();
        assert!(
            error.contains(&format!("ingresses team-04/app-00004: {field}"))
                && error.contains("lua-load")
                && error.contains("refused"),
            "{field}: {error}"
        );
        // Stored (a watch delivered it), it is left out, and blocks no other review.
        let mut copy = stores.clone();
        copy.get_mut("ingresses")
            .expect("store")
            .apply(&bad)
            .expect("apply");
        let files = renderer.render(&copy).expect("render");
        for (path, bytes) in files.iter() {
            assert!(
                !String::from_utf8_lossy(bytes).contains("lua-load"),
                "{field}: {path} carries the injected line"
            );
        }
        common::haproxy_check(&files);
        let other = stores_and_ingress(5).1;
        let overlay = copy
            .overlay("ingresses", Change::Apply(&other))
            .expect("overlay");
        renderer
            .render_overlay(&copy, &overlay)
            .expect("another Ingress is not refused for a stored bad one");
    }
}

#[test]
fn endpoint_addresses_that_are_not_ip_addresses_write_no_server() {
    let (mut stores, _) = stores_and_ingress(4);
    let fx = fixtures::generate(20);
    let mut slice = fx.endpoint_slices[4].clone();
    slice["endpoints"][0]["addresses"] = json!(["10.0.0.1 backup\n    lua-load /etc/passwd"]);
    stores
        .get_mut("endpointslices")
        .expect("store")
        .apply(&slice)
        .expect("apply");
    let files = renderer().render(&stores).expect("render");
    let cfg = files.text("haproxy.cfg").expect("haproxy.cfg");
    assert!(!cfg.contains("lua-load"), "{cfg}");
    common::haproxy_check(&files);
}
