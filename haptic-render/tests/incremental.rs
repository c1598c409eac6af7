//! A render proportional to the change gives what a fresh render gives: over random sequences of
//! store changes, a renderer kept from one render to the next (reusing `render_each` fragments
//! and derived rows) gives the same bytes, checksum, Requests (Events and status) and provenance
//! (the object of every line) as a renderer compiled afresh rendering the same stores. An
//! overlay render in between (the webhook's) changes nothing of this, and gives what a fresh
//! render of the stores with the change gives.

#![allow(clippy::unwrap_used)]

use haptic_render::{
    Change, FileSet, Provenance, Renderer, Requests, Stores, fixtures, functions::ssl_file,
    reference,
};
use proptest::prelude::*;
use serde_json::{Value as Json, json};

const N: usize = 10;

fn template_set() -> haptic_render::TemplateSet {
    let mut set = reference::template_set();
    // The HAProxy Service whose address becomes every Ingress's status.loadBalancer.
    set.extra_context
        .get_mut("haproxy")
        .unwrap()
        .as_object_mut()
        .unwrap()
        .insert("service".into(), json!("haptic-system/haproxy"));
    // The pool sized by a reserve kept in a ConfigMap ([`reserve`]).
    set.extra_context
        .get_mut("haproxy")
        .unwrap()
        .as_object_mut()
        .unwrap()
        .insert(
            "backend_pool_reserve".into(),
            json!("haptic-system/haptic-backend-pool"),
        );
    set
}

/// The backend pool's reserve, as the controller's leader keeps it.
static RESERVE: std::sync::LazyLock<[Json; 1]> = std::sync::LazyLock::new(|| {
    [json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"namespace": "haptic-system", "name": "haptic-backend-pool",
            "labels": {"haproxy-haptic.org/backend-pool": "true"}},
        "data": {"size": "64"}})]
});

fn haproxy_service(ip: &str) -> Json {
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "haptic-system", "name": "haproxy"},
        "spec": {"ports": [{"name": "http", "port": 80}]},
        "status": {"loadBalancer": {"ingress": [{"ip": ip}]}}})
}

/// One change to the stores.
#[derive(Debug, Clone)]
enum Step {
    /// Apply a variant of fixture resource `i` of a store.
    Apply(&'static str, usize, u8),
    /// Remove fixture resource `i` of a store.
    Remove(&'static str, usize),
    /// Lay the change over the stores and render the overlay (nothing is kept).
    Overlay(&'static str, usize, u8),
    /// Apply a variant without rendering: the next render sees two changes or more.
    Quiet(&'static str, usize, u8),
}

fn arb_step() -> impl Strategy<Value = Step> {
    let store = prop_oneof![
        Just("ingresses"),
        Just("services"),
        Just("endpointslices"),
        Just("secrets"),
        Just("ingressclasses"),
        Just("backend_pool"),
    ];
    (0..4u8, store, 0..N, 0..10u8).prop_map(|(kind, store, i, variant)| match kind {
        0 => Step::Remove(store, i),
        1 => Step::Overlay(store, i, variant),
        2 => Step::Quiet(store, i, variant),
        _ => Step::Apply(store, i, variant),
    })
}

/// Variant `v` of a fixture resource: as generated, or changed in a way the views see.
fn variant(store: &str, resource: &Json, v: u8, fixtures: &fixtures::Fixtures) -> Json {
    let mut r = resource.clone();
    match (store, v) {
        (_, 0) => {}
        ("ingresses", 1) => {
            // Claims the first Ingress's host and paths: a conflict one of them loses.
            let first = &fixtures.ingresses[0];
            r["spec"]["rules"][0]["host"] = first["spec"]["rules"][0]["host"].clone();
        }
        ("ingresses", 2) => {
            r["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] =
                json!("missing");
        }
        ("ingresses", 3) => {
            r["spec"]["tls"] = json!([{"hosts": ["x.example.com"], "secretName": "absent"}]);
        }
        ("ingresses", 4) => r["spec"]["ingressClassName"] = json!("other"),
        ("ingresses", 5) => r["spec"]["rules"][0]["host"] = json!("bad host"),
        ("ingresses", 6) => {
            r["metadata"]["annotations"] =
                json!({"nginx.ingress.kubernetes.io/configuration-snippet": "deny all;"});
        }
        ("ingresses", 7) => {
            // A policy of its own: its Service port gets a second backend.
            r["metadata"]["annotations"] =
                json!({"nginx.ingress.kubernetes.io/service-upstream": "true"});
        }
        ("ingresses", 8) => {
            r["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] =
                json!({"name": "absent"});
        }
        ("ingresses", 9) => {
            // ssl-passthrough: the HTTPS port gets its TCP frontend, the Service port a TCP
            // backend, the host a map line (or a conflict, with a TLS host or route of another).
            r["metadata"]["annotations"] =
                json!({"nginx.ingress.kubernetes.io/ssl-passthrough": "true"});
        }
        ("services", 1) => r["spec"]["ports"][0]["port"] = json!(81),
        ("services", 2) => {
            r["spec"] = json!({"type": "ExternalName", "externalName": "example.com"});
        }
        ("endpointslices", 1) => r["endpoints"][0]["conditions"]["ready"] = json!(false),
        ("endpointslices", 3) => {
            r["metadata"]["labels"]["kubernetes.io/service-name"] = json!("missing");
        }
        ("endpointslices", 4) => {
            // A second slice of the first Service (a new resource, in its namespace).
            let first = &fixtures.services[0]["metadata"];
            r["metadata"]["namespace"] = first["namespace"].clone();
            r["metadata"]["labels"]["kubernetes.io/service-name"] = first["name"].clone();
        }
        ("services", 4) => {
            // HTTP/2 to the endpoints: the port's backend leaves the pool for the named ones
            // (and joins it again when a later step puts the Service back).
            r["spec"]["ports"][0]["appProtocol"] = json!("kubernetes.io/h2c");
        }
        ("services", 3) => {
            r["spec"]["ports"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "metrics", "port": 9090}));
        }
        ("endpointslices", 2) => {
            r["endpoints"]
                .as_array_mut()
                .unwrap()
                .push(json!({"addresses": ["10.99.0.1"], "conditions": {"ready": true}}));
        }
        ("secrets", 1) => {
            // The key of another pair: a certificate whose key does not match.
            r["data"]["tls.key"] = json!("bm90IGEga2V5");
        }
        ("backend_pool", v) => {
            // Reserves honoured or not (below the backends, above four times what the pool
            // would be grown to, not a number).
            let sizes = ["64", "16", "40", "96", "1000", "x", "", "33", "48", "12"];
            r["data"]["size"] = json!(sizes[usize::from(v) % sizes.len()]);
        }
        ("ingressclasses", 1) => {
            r["metadata"]["annotations"] = json!({});
        }
        _ => {
            r["metadata"]["labels"] = json!({"variant": v.to_string()});
        }
    }
    r
}

fn resources<'a>(fixtures: &'a fixtures::Fixtures, store: &str) -> &'a [Json] {
    match store {
        "ingresses" => &fixtures.ingresses,
        "services" => &fixtures.services,
        "endpointslices" => &fixtures.endpoint_slices,
        "secrets" => &fixtures.secrets,
        "ingressclasses" => &fixtures.ingress_classes,
        "backend_pool" => &RESERVE[..],
        _ => &[],
    }
}

fn key(resource: &Json) -> (String, String) {
    let text = |k: &str| resource["metadata"][k].as_str().unwrap_or("").to_owned();
    (text("namespace"), text("name"))
}

/// The object of every line of every file.
fn lines(files: &FileSet, provenance: &Provenance) -> Vec<String> {
    let mut out = Vec::new();
    for (path, bytes) in files.iter() {
        let count = bytes.iter().filter(|b| **b == b'\n').count() + 1;
        for line in 1..=count {
            out.push(format!(
                "{path}:{line} {:?}",
                provenance.object_at(files, path, line)
            ));
        }
    }
    out
}

/// A fresh renderer's render of `stores`, each store kept as template values (none compact).
fn fresh(stores: &Stores) -> (FileSet, Requests, Provenance) {
    let mut plain = stores.clone();
    let names: Vec<String> = plain.iter().map(|(name, _)| name.to_owned()).collect();
    for name in names {
        plain.get_mut(&name).unwrap().set_compact(false);
    }
    Renderer::compile(&template_set())
        .unwrap()
        .render_traced(&plain)
        .unwrap()
}

fn same(
    what: &str,
    got: &(FileSet, Requests, Provenance),
    want: &(FileSet, Requests, Provenance),
) -> Result<(), TestCaseError> {
    for (path, bytes) in want.0.iter() {
        prop_assert_eq!(
            got.0.text(path),
            std::str::from_utf8(bytes).ok(),
            "{}: {} differs",
            what,
            path
        );
    }
    prop_assert_eq!(got.0.checksum(), want.0.checksum(), "{}: checksum", what);
    prop_assert_eq!(&got.1, &want.1, "{}: requests", what);
    prop_assert_eq!(
        lines(&got.0, &got.2),
        lines(&want.0, &want.2),
        "{}: provenance",
        what
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn incremental_renders_equal_fresh_renders(steps in prop::collection::vec(arb_step(), 1..12)) {
        let fixtures = fixtures::generate(N);
        let mut stores = reference::stores().unwrap();
        fixtures.load(&mut stores).unwrap();
        stores.get_mut("services").unwrap().apply(&haproxy_service("192.0.2.1")).unwrap();
        let kept = Renderer::compile(&template_set()).unwrap();
        // The kept renderer reads the stores no template lists and no view keeps whole
        // (all but the Secrets) as JSON; the fresh ones read them as
        // template values ([`fresh`]).
        prop_assert_eq!(
            kept.compact_unread_stores(&mut stores),
            ["backend_pool", "endpointslices", "gatewayclasses", "gateways", "haproxy_pods", "httproutes",
                "ingressclasses", "ingresses", "namespaces", "referencegrants", "services"]
        );
        same("first render", &kept.render_traced(&stores).unwrap(), &fresh(&stores))?;
        // Unchanged stores: every output is reused, with the Events and status it asked for
        // (the comparisons below are not of two full renders).
        same("again", &kept.render_traced(&stores).unwrap(), &fresh(&stores))?;
        prop_assert_eq!(kept.last_timings().fragments_rendered, 0);
        let (_, requests, _) = kept.render_traced(&stores).unwrap();
        prop_assert!(!requests.statuses.is_empty(), "the status is asked for");
        prop_assert!(kept.last_timings().outputs_reused > 0);
        // Each render hashes its set on from where it differs from the one before.
        let mut last = kept.render_traced(&stores).unwrap().0;
        for (n, step) in steps.iter().enumerate() {
            match step {
                Step::Apply(store, i, v) | Step::Overlay(store, i, v) | Step::Quiet(store, i, v) => {
                    let all = resources(&fixtures, store);
                    let Some(resource) = all.get(i % all.len().max(1)) else { continue };
                    let changed = variant(store, resource, *v, &fixtures);
                    if let Step::Overlay(..) = step {
                        let overlay = stores.overlay(store, Change::Apply(&changed)).unwrap();
                        let got = kept.render_overlay(&stores, &overlay);
                        let mut copy = stores.clone();
                        copy.get_mut(store).unwrap().apply(&changed).unwrap();
                        // The overlay's resource is under review: a refused field fails its
                        // render (and only its); otherwise it renders what the copy renders.
                        if let Ok(files) = got {
                            let want = fresh(&copy);
                            prop_assert_eq!(files.checksum(), want.0.checksum(), "step {}: overlay {:?}", n, step);
                        }
                    } else {
                        stores.get_mut(store).unwrap().apply(&changed).unwrap();
                    }
                }
                Step::Remove(store, i) => {
                    let all = resources(&fixtures, store);
                    let Some(resource) = all.get(i % all.len().max(1)) else { continue };
                    let (namespace, name) = key(resource);
                    stores.get_mut(store).unwrap().remove(&namespace, &name);
                }
            }
            if let Step::Quiet(..) = step {
                continue;
            }
            let got = kept.render_traced_following(&stores, &last).unwrap();
            same(&format!("step {n}: {step:?}"), &got, &fresh(&stores))?;
            last = got.0;
        }
        // The HAProxy Service's address moves: every Ingress's status follows.
        stores.get_mut("services").unwrap().apply(&haproxy_service("192.0.2.2")).unwrap();
        same("status", &kept.render_traced(&stores).unwrap(), &fresh(&stores))?;
    }
}

/// A Secret event renders that Secret's certificate file again, not every certificate's: each
/// reads its own entry of the `certificates` view (`derived_get`), which another Secret's event
/// leaves the very same value. The files are a fresh render's.
#[test]
fn a_secret_event_renders_that_secrets_certificate_alone() {
    let fixtures = fixtures::generate(40);
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let kept = Renderer::compile(&template_set()).unwrap();
    kept.compact_unread_stores(&mut stores);
    kept.render(&stores).unwrap();
    let first = kept.last_timings();
    let items = first.items_rendered + first.items_reused;
    assert!(items > 2, "{items} items");
    let secret = &fixtures.secrets[1];
    for v in 0..3 {
        let changed = variant("secrets", secret, v, &fixtures);
        stores.get_mut("secrets").unwrap().apply(&changed).unwrap();
        let files = kept.render(&stores).unwrap();
        let timings = kept.last_timings();
        assert_eq!(
            (timings.items_rendered, timings.items_reused),
            (1, items - 1),
            "variant {v}"
        );
        assert_eq!(files.checksum(), fresh(&stores).0.checksum(), "variant {v}");
    }
}

/// An event that changes nothing a per-item output reads (an endpoint's readiness, for the
/// certificates of the Secrets) reuses its runs of items whole, with every item counted as
/// reused, the very bytes, and a fresh render's files; a Secret's event then renders that
/// Secret's certificate and reuses the other items one by one.
#[test]
fn an_event_no_item_reads_reuses_the_items_whole() {
    // More Secrets than one run of items (a job's 128), so that several runs are reused.
    let fixtures = fixtures::generate(1_200);
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let kept = Renderer::compile(&template_set()).unwrap();
    kept.compact_unread_stores(&mut stores);
    let mut last = kept.render(&stores).unwrap();
    let first = kept.last_timings();
    let items = first.items_rendered + first.items_reused;
    assert!(items > 256, "{items} items");
    assert_eq!(first.item_chunks_reused, 0);
    let slice = &fixtures.endpoint_slices[7];
    for v in [1, 0, 1] {
        let changed = variant("endpointslices", slice, v, &fixtures);
        stores
            .get_mut("endpointslices")
            .unwrap()
            .apply(&changed)
            .unwrap();
        let files = kept.render(&stores).unwrap();
        let timings = kept.last_timings();
        assert_eq!(
            (timings.items_rendered, timings.items_reused),
            (0, items),
            "variant {v}"
        );
        assert!(timings.item_chunks_reused > 1, "{timings:?}");
        let fresh = fresh(&stores).0;
        assert_eq!(files.checksum(), fresh.checksum(), "variant {v}");
        for (path, bytes) in files.iter().filter(|(p, _)| p.starts_with("ssl/")) {
            let before = last.get(path).unwrap();
            assert_eq!(
                bytes.as_ptr(),
                before.as_ptr(),
                "{path}: not the very bytes"
            );
        }
        last = files;
    }
    let secret = &fixtures.secrets[3];
    stores
        .get_mut("secrets")
        .unwrap()
        .apply(&variant("secrets", secret, 1, &fixtures))
        .unwrap();
    let files = kept.render(&stores).unwrap();
    let timings = kept.last_timings();
    assert_eq!(
        (timings.items_rendered, timings.items_reused),
        (1, items - 1)
    );
    assert_eq!(files.checksum(), fresh(&stores).0.checksum());
}

/// After an event that changes one backend's servers, the render tells the checksum how much
/// of `haproxy.cfg` it knows the same as its last render (the pool's text copied from the last
/// call, where it was): most of the file is not compared again, and the checksum is a fresh
/// render's. Against a set it did not render (another renderer's), it tells nothing.
#[test]
fn the_checksum_is_told_what_the_render_knows_the_same() {
    let fixtures = fixtures::generate(1_000);
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let kept = Renderer::compile(&template_set()).unwrap();
    kept.compact_unread_stores(&mut stores);
    let mut last = kept.render(&stores).unwrap();
    let config = last.get("haproxy.cfg").unwrap().len() as u64;
    // An endpoint of three slices made not ready one after the other, then ready again.
    for (n, v) in [(500, 1), (501, 1), (502, 1), (500, 0)] {
        let slice = &fixtures.endpoint_slices[n];
        let changed = variant("endpointslices", slice, v, &fixtures);
        stores
            .get_mut("endpointslices")
            .unwrap()
            .apply(&changed)
            .unwrap();
        let (files, _, _) = kept.render_traced_following(&stores, &last).unwrap();
        let timings = kept.last_timings();
        assert!(
            timings.checksum_known > config / 2,
            "{} of {config} bytes known",
            timings.checksum_known
        );
        assert_eq!(files.checksum(), fresh(&stores).0.checksum(), "variant {v}");
        last = files;
    }
    let other = fresh(&stores).0;
    let slice = &fixtures.endpoint_slices[900];
    let changed = variant("endpointslices", slice, 1, &fixtures);
    stores
        .get_mut("endpointslices")
        .unwrap()
        .apply(&changed)
        .unwrap();
    let (files, _, _) = kept.render_traced_following(&stores, &other).unwrap();
    assert_eq!(kept.last_timings().checksum_known, 0);
    assert_eq!(files.checksum(), fresh(&stores).0.checksum());
}

/// A per-item output that reads an entry of a derived view with `derived_get` is rendered
/// again when that entry changes though its own item did not (a Service's file that shows
/// the certificate of the Secret of its name), and reused while the entry is the same.
#[test]
fn an_item_is_rendered_again_when_the_entry_it_read_changed() {
    let mut set = haptic_render::TemplateSet::default();
    set.ssl_certificates.insert(
        "services".into(),
        haptic_render::CertificateTemplate {
            template: "{% set c = derived_get(view=\"certificates\", key=item.metadata.namespace ~ \"/\" ~ item.metadata.name) %}\
                       {{ item.metadata.name }} {% if c %}{{ c.usable }} {{ c.reason }}{% else %}none{% endif %}"
                .into(),
            for_each: Some("services".into()),
        },
    );
    let service = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "a", "name": name}, "spec": {"ports": [{"port": 80}]}})
    };
    let mut stores = reference::stores().unwrap();
    for name in ["web", "api"] {
        stores
            .get_mut("services")
            .unwrap()
            .apply(&service(name))
            .unwrap();
    }
    stores
        .get_mut("secrets")
        .unwrap()
        .apply(&fixtures::tls_secret("a", "web"))
        .unwrap();
    let kept = Renderer::compile(&set).unwrap();
    let files = kept.render(&stores).unwrap();
    assert_eq!(files.text(&ssl_file("a", "web")), Some("web true "));
    assert_eq!(files.text(&ssl_file("a", "api")), Some("api none"));
    // The Secret's key no longer matches: the entry changes, the Service does not.
    let mut broken = fixtures::tls_secret("a", "web");
    broken["data"]["tls.key"] = json!("bm90IGEga2V5");
    stores.get_mut("secrets").unwrap().apply(&broken).unwrap();
    let files = kept.render(&stores).unwrap();
    let fresh = Renderer::compile(&set).unwrap().render(&stores).unwrap();
    assert_eq!(
        files.text(&ssl_file("a", "web")),
        fresh.text(&ssl_file("a", "web"))
    );
    assert!(
        files
            .text(&ssl_file("a", "web"))
            .is_some_and(|t| t.starts_with("web false ")),
        "{:?}",
        files.text(&ssl_file("a", "web"))
    );
    let timings = kept.last_timings();
    assert_eq!((timings.items_rendered, timings.items_reused), (1, 1));
    // A Secret that sorts before it moves its entry in the view, not its value: both files
    // are reused (the read finds the entry by its key where its place no longer holds it).
    stores
        .get_mut("secrets")
        .unwrap()
        .apply(&fixtures::tls_secret("a", "aaa"))
        .unwrap();
    let again = kept.render(&stores).unwrap();
    let timings = kept.last_timings();
    assert_eq!((timings.items_rendered, timings.items_reused), (0, 2));
    assert_eq!(
        again.text(&ssl_file("a", "web")),
        files.text(&ssl_file("a", "web"))
    );
}

/// An event that changes no row of any view (a label) leaves every view the very list it was:
/// a Service's label or an Ingress's renders nothing again (every single output is reused
/// whole, as after no event at all: the view of the Ingresses shows each one's `ref`, which a
/// label leaves as it was; an annotated Ingress's: the view of annotated Ingresses, computed
/// again, is the very list). One that changes a row renders the outputs that read its view
/// again, and that row's fragments. The files are a fresh render's each time.
#[test]
fn an_event_that_changes_no_row_renders_nothing_again() {
    let fixtures = fixtures::generate(40);
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let kept = Renderer::compile(&template_set()).unwrap();
    kept.compact_unread_stores(&mut stores);
    kept.render(&stores).unwrap();
    let mut last = kept.render(&stores).unwrap();
    let singles = kept.last_timings().outputs_reused;
    assert!(singles > 5, "{singles} outputs reused after no change");
    // Ingress 5 has ingress-nginx annotations, 4 has none: haproxy.cfg is the very bytes it
    // was, and what is asked of the cluster a fresh render's.
    for (store, resource, rendered) in [
        ("ingresses", &fixtures.ingresses[4], 0),
        ("ingresses", &fixtures.ingresses[5], 0),
        ("services", &fixtures.services[5], 0),
    ] {
        for v in 0..2 {
            let mut labelled = resource.clone();
            labelled["metadata"]["labels"] = json!({"team": format!("t{v}")});
            stores.get_mut(store).unwrap().apply(&labelled).unwrap();
            let (files, asked) = kept.render_all(&stores).unwrap();
            let (fresh_files, fresh_asked, _) = fresh(&stores);
            assert_eq!(files.checksum(), fresh_files.checksum(), "{store} {v}");
            assert_eq!(asked, fresh_asked, "{store} {v}");
            let t = kept.last_timings();
            assert_eq!(
                (t.fragments_rendered, t.outputs_reused, t.calls_reused),
                (0, singles - rendered, t.calls),
                "{store} {v}"
            );
            for path in ["haproxy.cfg", "maps/routes-prefix.map"] {
                assert_eq!(
                    files.get(path).unwrap().as_ptr(),
                    last.get(path).unwrap().as_ptr(),
                    "{store} {v}: {path} rendered again"
                );
            }
            last = files;
        }
    }
    // A Service whose port changes number: its backend's row, and its fragment, change.
    let mut moved = fixtures.services[5].clone();
    moved["spec"]["ports"][0]["port"] = json!(8081);
    stores.get_mut("services").unwrap().apply(&moved).unwrap();
    let files = kept.render(&stores).unwrap();
    assert_eq!(files.checksum(), fresh(&stores).0.checksum());
    let t = kept.last_timings();
    assert!(
        t.fragments_rendered > 0 && t.outputs_reused < singles,
        "{t:?}"
    );
    // An Ingress routed elsewhere: its route rows change.
    let mut rerouted = fixtures.ingresses[5].clone();
    rerouted["spec"]["rules"][0]["http"]["paths"][0]["path"] = json!("/elsewhere");
    stores
        .get_mut("ingresses")
        .unwrap()
        .apply(&rerouted)
        .unwrap();
    let files = kept.render(&stores).unwrap();
    assert_eq!(files.checksum(), fresh(&stores).0.checksum());
    let t = kept.last_timings();
    assert!(
        t.fragments_rendered > 0 && t.outputs_reused < singles - 1,
        "{t:?}"
    );
}

/// The pool's size is the reserve kept in the ConfigMap the templates name while it is sane,
/// the Services' own otherwise; each render tells the pool's state (what the controller's
/// leader keeps the reserve by), and a change of the ConfigMap alone renders the pool again.
#[test]
fn a_reserve_kept_in_a_configmap_sizes_the_pool() {
    let fixtures = fixtures::generate(N);
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let kept = Renderer::compile(&template_set()).unwrap();
    kept.compact_unread_stores(&mut stores);
    let pools = |files: &FileSet| {
        files
            .text("haproxy.cfg")
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("backend pool_"))
            .count()
    };
    let (files, requests, _) = kept.render_traced(&stores).unwrap();
    let state = requests.pool.clone().expect("the pool's state is told");
    assert_eq!(state.at, "haptic-system/haptic-backend-pool");
    assert!(state.used > 0);
    assert_eq!(state.size, haptic_render::pool::size(state.used, 32));
    assert_eq!(state.reserve, None);
    assert_eq!(state.wanted, haptic_render::pool::ahead(state.used, 32));
    assert_eq!(pools(&files), state.size);
    for (size, honoured) in [("200", true), ("1", false), ("not a number", false)] {
        let mut reserve = RESERVE[0].clone();
        reserve["data"]["size"] = json!(size);
        stores
            .get_mut("backend_pool")
            .unwrap()
            .apply(&reserve)
            .unwrap();
        let got = kept.render_traced(&stores).unwrap();
        let state = got.1.pool.clone().unwrap();
        let want = if honoured {
            200
        } else {
            haptic_render::pool::size(state.used, 32)
        };
        assert_eq!((state.size, pools(&got.0)), (want, want), "reserve {size}");
        assert_eq!(state.reserve, size.parse().ok(), "reserve {size}");
        assert_eq!(
            got.0.text("maps/pool.map"),
            fresh(&stores).0.text("maps/pool.map"),
            "reserve {size}"
        );
        assert_eq!(
            got.0.checksum(),
            fresh(&stores).0.checksum(),
            "reserve {size}"
        );
    }
}
