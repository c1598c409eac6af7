//! Derived views against two oracles, under arbitrary sequences of watch events:
//!
//! - incremental: the stores that received the events (whose derived views reuse the rows of
//!   resources that did not change) render the same bytes as fresh stores loaded with the
//!   resulting resources;
//! - semantics: the reference set renders the same bytes as the same templates written the
//!   long way, walking the raw resources (`tests/raw-templates/`, the reference set's snippets
//!   before derived views existed).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use haptic_render::{FileSet, Renderer, Stores, Template, fixtures, reference};
use proptest::prelude::*;
use serde_json::{Value as Json, json};

fn renderer() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| Renderer::compile(&reference::template_set()).unwrap())
}

fn raw_renderer() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| {
        let mut set = reference::template_set();
        set.haproxy_config = Template::new(include_str!("raw-templates/haproxy.cfg.tera"));
        for (name, source) in [
            ("backends", include_str!("raw-templates/backends.tera")),
            (
                "route-entries",
                include_str!("raw-templates/route-entries.tera"),
            ),
            (
                "tls-entries",
                include_str!("raw-templates/tls-entries.tera"),
            ),
        ] {
            set.template_snippets
                .insert(name.into(), Template::new(source));
        }
        // The raw snippets loop over the resources themselves: the maps include them once (the
        // reference maps render their per-row snippets with render_each).
        for (map, source) in [
            (
                "routes-exact.map",
                "{%- set route_exact = true %}{% include \"route-entries\" %}\n",
            ),
            (
                "routes-prefix.map",
                "{%- set route_exact = false %}{% include \"route-entries\" %}\n",
            ),
            (
                "certs.list",
                "{%- include \"tls-entries\" %}\n{%- set gw_crt_shared = true %}{% include \"gateway-crt-list\" %}\n",
            ),
        ] {
            set.maps.insert(map.into(), Template::new(source));
        }
        Renderer::compile(&set).unwrap()
    })
}

const N: usize = 4;

/// The fixtures without ingress-nginx annotations: the raw templates predate them.
fn unannotated() -> fixtures::Fixtures {
    let mut params = fixtures::Params::new(N);
    params.annotated_every = 0;
    params.generate()
}

#[derive(Debug, Clone)]
enum Event {
    /// The generated resource `i` of a store, as generated.
    Base(&'static str, usize),
    /// The resource `i` of a store, removed.
    Remove(&'static str, usize),
    /// A changed version of generated slice `i`.
    Slice(usize, u8),
    /// A changed version of generated Service `i`.
    Service(usize, u8),
    /// A changed version of generated Ingress `i`.
    Ingress(usize, u8),
    /// A changed version of the TLS Secret of generated Ingress 0.
    Secret(u8),
}

fn base(store: &str, i: usize) -> Json {
    static F: OnceLock<fixtures::Fixtures> = OnceLock::new();
    let f = F.get_or_init(unannotated);
    match store {
        "ingresses" => f.ingresses[i].clone(),
        "services" => f.services[i].clone(),
        // Generated Ingress 0 is the one with TLS (every 4th).
        "secrets" => f.secrets[i % f.secrets.len()].clone(),
        _ => f.endpoint_slices[i].clone(),
    }
}

/// The (store, resource) an event applies; `None` for a removal.
fn resolve(event: &Event) -> (&'static str, Json, bool) {
    match event {
        Event::Base(store, i) => (store, base(store, *i), false),
        Event::Remove(store, i) => (store, base(store, *i), true),
        Event::Slice(i, variant) => {
            let mut s = base("endpointslices", *i);
            match variant {
                0 => {
                    for ep in s["endpoints"].as_array_mut().unwrap() {
                        ep["conditions"]["ready"] = json!(false);
                    }
                }
                1 => {
                    s["addressType"] = json!("IPv6");
                    s["endpoints"] = json!([{"addresses": [format!("fd00::{i}")]}]);
                }
                2 => s["endpoints"] = json!([]),
                3 => s["ports"][0]["name"] = json!("web"),
                4 => s["addressType"] = json!("FQDN"),
                5 => {
                    s["ports"] = json!([
                        {"name": "h3", "port": 8443, "protocol": "UDP"},
                        {"name": "http", "port": 8080, "protocol": "TCP"},
                    ]);
                }
                _ => {
                    // A second slice of the same Service.
                    let name = format!("{}-extra", s["metadata"]["name"].as_str().unwrap());
                    s["metadata"]["name"] = json!(name);
                    s["endpoints"] = json!([{"addresses": [format!("10.9.9.{i}")]}]);
                }
            }
            ("endpointslices", s, false)
        }
        Event::Service(i, variant) => {
            let mut s = base("services", *i);
            match variant {
                0 => s["spec"]["ports"] = json!([{"name": "metrics", "port": 9090}]),
                1 => s["spec"]["ports"][0]["port"] = json!(8080),
                // HTTP/3 beside HTTPS: a UDP port with the number (and a name) of a TCP one.
                2 => {
                    s["spec"]["ports"] = json!([
                        {"name": "h3", "port": 80, "protocol": "UDP"},
                        {"name": "http", "port": 80, "protocol": "TCP"},
                        {"name": "metrics", "port": 9090},
                    ]);
                }
                _ => s["spec"]["ports"] = json!([]),
            }
            ("services", s, false)
        }
        Event::Ingress(i, variant) => {
            let mut s = base("ingresses", *i);
            let first = &mut s["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"];
            match variant {
                0 => first["name"] = json!(format!("app-{:05}", (*i + 1) % N)),
                1 => first["port"] = json!({"name": "metrics"}),
                6 => first["port"] = json!({"name": "h3"}),
                2 => first["name"] = json!("nope"),
                3 => s["spec"]["rules"][0]["host"] = json!("*.wild.example.com"),
                4 => {
                    s["spec"]["tls"] = json!([
                        {"secretName": "app-00000-tls", "hosts": ["Bad_Host", format!("h{i}.example.com")]},
                        {"secretName": "missing"},
                        {"hosts": ["x.example.com"]},
                    ]);
                }
                _ => s["spec"] = json!({}),
            }
            ("ingresses", s, false)
        }
        Event::Secret(variant) => {
            let mut s = base("secrets", 0);
            match variant {
                0 => s["type"] = json!("Opaque"),
                1 => s["data"]["tls.key"] = json!("not base64!"),
                2 => s["data"]["tls.crt"] = json!("aGVsbG8="),
                _ => {
                    // Same certificate under another name in another namespace.
                    s["metadata"]["namespace"] = json!("team-01");
                }
            }
            ("secrets", s, false)
        }
    }
}

fn key(resource: &Json) -> (String, String) {
    let meta = |k: &str| {
        resource["metadata"][k]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    (meta("namespace"), meta("name"))
}

fn arb_event() -> impl Strategy<Value = Event> {
    let store = prop::sample::select(vec!["ingresses", "services", "endpointslices", "secrets"]);
    prop_oneof![
        (store.clone(), 0..N).prop_map(|(s, i)| Event::Base(s, i)),
        (store, 0..N).prop_map(|(s, i)| Event::Remove(s, i)),
        (0..N, 0u8..7).prop_map(|(i, v)| Event::Slice(i, v)),
        (0..N, 0u8..4).prop_map(|(i, v)| Event::Service(i, v)),
        (0..N, 0u8..7).prop_map(|(i, v)| Event::Ingress(i, v)),
        (0u8..4).prop_map(Event::Secret),
    ]
}

fn fresh(model: &BTreeMap<(&'static str, (String, String)), Json>) -> Stores {
    let mut stores = reference::stores().unwrap();
    for ((store, _), resource) in model {
        stores.get_mut(store).unwrap().apply(resource).unwrap();
    }
    stores
}

fn assert_same(a: &FileSet, b: &FileSet, what: &str) {
    for (path, bytes) in a.iter() {
        assert_eq!(
            Some(String::from_utf8_lossy(bytes)),
            b.files().get(path).map(|b| String::from_utf8_lossy(b)),
            "{what}: {path} differs"
        );
    }
    assert_eq!(a.checksum(), b.checksum(), "{what}: the file sets differ");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn derived_views_match_fresh_stores_and_the_raw_templates_after_any_events(
        events in prop::collection::vec(arb_event(), 1..24),
    ) {
        let mut stores = reference::stores().unwrap();
        unannotated().load(&mut stores).unwrap();
        let mut model: BTreeMap<(&'static str, (String, String)), Json> = BTreeMap::new();
        for (store, resource) in unannotated().resources() {
            model.insert((store, key(resource)), resource.clone());
        }
        // A first render, so that the next ones start from cached views.
        renderer().render(&stores).unwrap();
        for event in &events {
            let (store, resource, remove) = resolve(event);
            let k = key(&resource);
            if remove {
                stores.get_mut(store).unwrap().remove(&k.0, &k.1);
                model.remove(&(store, k));
            } else {
                stores.get_mut(store).unwrap().apply(&resource).unwrap();
                model.insert((store, k), resource);
            }
            let incremental = renderer().render(&stores).unwrap();
            let fresh = fresh(&model);
            assert_same(&incremental, &renderer().render(&fresh).unwrap(), "incremental vs fresh");
            assert_same(&incremental, &raw_renderer().render(&fresh).unwrap(), "derived vs raw templates");
        }
    }
}
