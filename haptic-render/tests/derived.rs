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

/// The reference set without the pool of spare backends: the raw templates write each backend
/// under its own name.
fn unpooled() -> haptic_render::TemplateSet {
    let mut set = reference::template_set();
    if let Some(haproxy) = set.extra_context.get_mut("haproxy") {
        haproxy["backend_pool_step"] = json!(0);
    }
    set
}

fn unpooled_renderer() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| Renderer::compile(&unpooled()).unwrap())
}

fn raw_renderer() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| {
        let mut set = unpooled();
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
                // Claims Ingress 0's routes (it is older): a conflict that changes hands as
                // either of them changes or goes.
                7 => s["spec"]["rules"] = base("ingresses", 0)["spec"]["rules"].clone(),
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
        (0..N, 0u8..9).prop_map(|(i, v)| Event::Ingress(i, v)),
        (0u8..4).prop_map(Event::Secret),
    ]
}

fn fresh(model: &Model) -> Stores {
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

/// The stores and a model of them, as a map of resources by store and key.
type Model = BTreeMap<(&'static str, (String, String)), Json>;

/// Loads `fixtures` into the reference stores and renders once (so that the next renders
/// start from cached views), then makes each change `(store, resource, remove)` to the stores
/// and to a model of them, and calls `check` with the render after it and the model.
fn replay(
    fixtures: &fixtures::Fixtures,
    changes: impl IntoIterator<Item = (&'static str, Json, bool)>,
    mut check: impl FnMut(&FileSet, &Model),
) {
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let mut model = Model::new();
    for (store, resource) in fixtures.resources() {
        model.insert((store, key(resource)), resource.clone());
    }
    renderer().render(&stores).unwrap();
    for (store, resource, remove) in changes {
        let k = key(&resource);
        if remove {
            stores.get_mut(store).unwrap().remove(&k.0, &k.1);
            model.remove(&(store, k));
        } else {
            stores.get_mut(store).unwrap().apply(&resource).unwrap();
            model.insert((store, k), resource);
        }
        check(&renderer().render(&stores).unwrap(), &model);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn derived_views_match_fresh_stores_and_the_raw_templates_after_any_events(
        events in prop::collection::vec(arb_event(), 1..24),
    ) {
        replay(&unannotated(), events.iter().map(resolve), |incremental, model| {
            let fresh = fresh(model);
            assert_same(incremental, &renderer().render(&fresh).unwrap(), "incremental vs fresh");
            assert_same(
                &unpooled_renderer().render(&fresh).unwrap(),
                &raw_renderer().render(&fresh).unwrap(),
                "derived vs raw templates",
            );
        });
    }
}

// The Gateway API view keeps what each HTTPRoute resolved to while the route, what it reads of
// the Gateways, grants and config, its Services and its Namespace stay the same: after any
// sequence of changes it must be what a derivation from scratch gives (rows, order, statuses,
// events, refusals; the times of conditions aside, which a kept route keeps from when it was
// resolved), and render the same bytes.

const ROUTES: usize = 4;

fn gateway_base() -> &'static [(&'static str, Json)] {
    static F: OnceLock<Vec<(&'static str, Json)>> = OnceLock::new();
    F.get_or_init(|| fixtures::gateway_api(ROUTES))
}

fn route_base(i: usize) -> Json {
    gateway_base()
        .iter()
        .filter(|(store, _)| *store == "httproutes")
        .nth(i)
        .unwrap()
        .1
        .clone()
}

fn service_base(i: usize) -> Json {
    gateway_base()
        .iter()
        .filter(|(store, _)| *store == "services")
        .nth(i)
        .unwrap()
        .1
        .clone()
}

fn namespace_of(i: usize) -> String {
    route_base(i)["metadata"]["namespace"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[derive(Debug, Clone)]
enum GwEvent {
    /// A variant of generated HTTPRoute `i` (0: as generated).
    Route(usize, u8),
    RemoveRoute(usize),
    /// A variant of the Gateway (0: as generated).
    Gateway(u8),
    RemoveGateway,
    /// A variant of generated Service `i` (0: as generated).
    Service(usize, u8),
    RemoveService(usize),
    /// The ReferenceGrant letting routes of namespace 0 name Services of namespace 1.
    Grant(bool),
    /// The Namespace of route `i`, labelled `team: a` or not.
    Namespace(usize, bool),
    /// The GatewayClass, ours or another controller's.
    Class(bool),
}

fn gateway_variant(variant: u8) -> Json {
    let mut gw = gateway_base()
        .iter()
        .find(|(store, _)| *store == "gateways")
        .unwrap()
        .1
        .clone();
    let http = gw["spec"]["listeners"][0].clone();
    let listeners = match variant {
        0 => json!([http]),
        1 => json!([http, {"name": "wild", "port": 8080, "protocol": "HTTP",
            "hostname": "*.gw.example.com",
            "allowedRoutes": {"namespaces": {"from": "Selector",
                "selector": {"matchLabels": {"team": "a"}}}}}]),
        2 => json!([{"name": "http", "port": 8080, "protocol": "HTTP"}]),
        // A listener on the Ingress frontend's port: its matches claim Ingress routes.
        3 => json!([http, {"name": "shared", "port": 80, "protocol": "HTTP",
            "allowedRoutes": {"namespaces": {"from": "All"}}}]),
        4 => json!([http, {"name": "https", "port": 8443, "protocol": "HTTPS",
            "tls": {"certificateRefs": [{"name": "missing"}]},
            "allowedRoutes": {"namespaces": {"from": "All"}}}]),
        _ => json!([http, {"name": "agent", "port": 9090, "protocol": "HTTP",
            "allowedRoutes": {"namespaces": {"from": "All"}}}]),
    };
    gw["spec"]["listeners"] = listeners;
    gw["metadata"]["generation"] = json!(u64::from(variant) + 1);
    gw
}

fn route_variant(i: usize, variant: u8) -> Json {
    let mut r = route_base(i);
    let spec = &mut r["spec"];
    match variant {
        0 => {}
        1 => {
            spec["hostnames"]
                .as_array_mut()
                .unwrap()
                .push(json!(format!("more-{i}.gw.example.com")));
        }
        // A Service of namespace 1 (granted to namespace 0 only, by GwEvent::Grant).
        2 => {
            spec["rules"][0]["backendRefs"][0] = json!({"name": service_base(1)["metadata"]["name"],
                "namespace": namespace_of(1), "port": 80});
        }
        3 => spec["parentRefs"][0]["sectionName"] = json!("https"),
        // One match, one backend, no filter: a map entry.
        4 => {
            spec["rules"] = json!([{"matches": [{"path": {"type": "PathPrefix", "value": "/plain"}}],
                "backendRefs": [{"name": service_base(i)["metadata"]["name"], "port": 80}]}]);
        }
        5 => {
            spec["rules"][1]["matches"] = json!([{"path": {"type": "RegularExpression", "value": "/v[0-9]+/.*"},
                "method": "POST"}]);
        }
        6 => spec["hostnames"] = json!(["not a host"]),
        7 => spec["rules"][0]["backendRefs"][1]["name"] = json!("nope"),
        8 => {
            spec.as_object_mut().unwrap().remove("hostnames");
        }
        // Another Service's name, a match older routes share.
        _ => {
            spec["hostnames"] = json!(["shared.gw.example.com"]);
            spec["rules"][0]["backendRefs"] =
                json!([{"name": service_base((i + 1) % ROUTES)["metadata"]["name"], "port": 80}]);
            spec["rules"][0]["matches"] = json!([{"path": {"type": "Exact", "value": "/same"}}]);
        }
    }
    r["metadata"]["generation"] = json!(u64::from(variant) + 1);
    r
}

/// The (store, resource) an event applies, or `(store, namespace, name)` it removes.
fn gw_resolve(event: &GwEvent) -> (&'static str, Result<Json, (String, String)>) {
    match event {
        GwEvent::Route(i, v) => ("httproutes", Ok(route_variant(*i, *v))),
        GwEvent::RemoveRoute(i) => ("httproutes", Err(key(&route_base(*i)))),
        GwEvent::Gateway(v) => ("gateways", Ok(gateway_variant(*v))),
        GwEvent::RemoveGateway => ("gateways", Err(key(&gateway_variant(0)))),
        GwEvent::Service(i, v) => {
            let mut s = service_base(*i);
            if *v == 1 {
                s["spec"]["ports"][0]["port"] = json!(8080);
            }
            ("services", Ok(s))
        }
        GwEvent::RemoveService(i) => ("services", Err(key(&service_base(*i)))),
        GwEvent::Grant(present) => {
            let grant = json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
                "metadata": {"namespace": namespace_of(1), "name": "from-0"},
                "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": namespace_of(0)}],
                         "to": [{"group": "", "kind": "Service"}]}});
            if *present {
                ("referencegrants", Ok(grant))
            } else {
                ("referencegrants", Err(key(&grant)))
            }
        }
        GwEvent::Namespace(i, labelled) => {
            let labels = if *labelled {
                json!({"team": "a"})
            } else {
                json!({})
            };
            (
                "namespaces",
                Ok(json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": namespace_of(*i), "labels": labels}})),
            )
        }
        GwEvent::Class(ours) => {
            let mut class = gateway_base()
                .iter()
                .find(|(store, _)| *store == "gatewayclasses")
                .unwrap()
                .1
                .clone();
            if !ours {
                class["spec"]["controllerName"] = json!("example.com/other");
            }
            ("gatewayclasses", Ok(class))
        }
    }
}

fn arb_gw_event() -> impl Strategy<Value = GwEvent> {
    prop_oneof![
        4 => (0..ROUTES, 0u8..10).prop_map(|(i, v)| GwEvent::Route(i, v)),
        1 => (0..ROUTES).prop_map(GwEvent::RemoveRoute),
        2 => (0u8..6).prop_map(GwEvent::Gateway),
        1 => Just(GwEvent::RemoveGateway),
        2 => (0..ROUTES, 0u8..2).prop_map(|(i, v)| GwEvent::Service(i, v)),
        1 => (0..ROUTES).prop_map(GwEvent::RemoveService),
        1 => any::<bool>().prop_map(GwEvent::Grant),
        1 => (0..ROUTES, any::<bool>()).prop_map(|(i, l)| GwEvent::Namespace(i, l)),
        1 => any::<bool>().prop_map(GwEvent::Class),
    ]
}

/// The view with every condition's `lastTransitionTime` blanked.
fn without_times(mut view: Json) -> Json {
    fn walk(v: &mut Json) {
        match v {
            Json::Object(map) => {
                for (k, v) in map.iter_mut() {
                    if k == "lastTransitionTime" {
                        *v = json!("");
                    } else {
                        walk(v);
                    }
                }
            }
            Json::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut view);
    view
}

/// Applies `events` one by one to stores rendered after each, and compares each render and
/// the view with fresh stores holding the same resources, and with the change rendered as an
/// overlay before it was applied.
fn check_gateway_events(events: &[GwEvent]) {
    let mut stores = reference::stores().unwrap();
    let mut model: BTreeMap<(&'static str, (String, String)), Json> = BTreeMap::new();
    for (store, resource) in gateway_base() {
        stores.get_mut(store).unwrap().apply(resource).unwrap();
        model.insert((store, key(resource)), resource.clone());
    }
    renderer().render(&stores).unwrap();
    for event in events {
        let (store, change) = gw_resolve(event);
        // The change under review first (an overlay: what the admission webhook renders).
        let overlay = match &change {
            Ok(resource) => stores.overlay(store, haptic_render::Change::Apply(resource)),
            Err((namespace, name)) => {
                stores.overlay(store, haptic_render::Change::Remove { namespace, name })
            }
        }
        .unwrap();
        // Refused under review (a field the CRD's schema refuses): no set to compare.
        let reviewed = renderer().render_overlay(&stores, &overlay).ok();
        match change {
            Ok(resource) => {
                stores.get_mut(store).unwrap().apply(&resource).unwrap();
                model.insert((store, key(&resource)), resource);
            }
            Err((namespace, name)) => {
                stores.get_mut(store).unwrap().remove(&namespace, &name);
                model.remove(&(store, (namespace, name)));
            }
        }
        let incremental = renderer().render(&stores).unwrap();
        let fresh = fresh(&model);
        assert_same(
            &incremental,
            &renderer().render(&fresh).unwrap(),
            "kept routes vs fresh",
        );
        if let Some(reviewed) = &reviewed {
            assert_same(reviewed, &incremental, "overlay vs applied");
        }
        assert_eq!(
            without_times(stores.derived_json("gateway").unwrap()),
            without_times(fresh.derived_json("gateway").unwrap()),
            "the view after {:?}",
            event
        );
    }
}

#[test]
fn the_gateway_view_follows_each_thing_a_route_reads() {
    use GwEvent::*;
    check_gateway_events(&[
        Gateway(1),
        Namespace(0, true),
        Namespace(1, true),
        Namespace(0, false),
        Route(0, 2),
        Grant(true),
        Route(1, 4),
        Grant(false),
        Service(1, 1),
        RemoveService(1),
        Service(1, 0),
        Class(false),
        Class(true),
        Gateway(4),
        Route(1, 3),
        Gateway(3),
        Route(2, 9),
        Route(3, 9),
        RemoveRoute(2),
        Gateway(5),
        RemoveGateway,
        Gateway(0),
    ]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_gateway_view_keeping_unchanged_routes_equals_one_derived_afresh(
        events in prop::collection::vec(arb_gw_event(), 1..24),
    ) {
        check_gateway_events(&events);
    }
}

// The routed ports of the backends view (`routedBy`) are kept per Ingress and patched after an
// Ingress or Service event: after any sequence of events they must be what fresh stores give.
// The events reach what makes one Ingress's routed ports depend on other resources: Services
// created, renamed, renumbered and deleted under the paths that name them (by number and by
// name), ingress-nginx policies (a backend per policy), canaries beside a main Ingress with a
// policy, default backends (the oldest wins), ssl-passthrough, and IngressClasses (which
// Ingresses are ours). Two Ingresses share each namespace, so that one routes to the other's
// Service. Fresh stores are the oracle; the raw templates predate these annotations.

const ROUTED: usize = 4;

fn routed_fixtures() -> &'static fixtures::Fixtures {
    static F: OnceLock<fixtures::Fixtures> = OnceLock::new();
    F.get_or_init(|| {
        let mut params = fixtures::Params::new(ROUTED);
        params.namespaces = 2;
        params.annotated_every = 2;
        params.generate()
    })
}

#[derive(Debug, Clone)]
enum RoutedEvent {
    /// Generated resource `i` of a store, as generated.
    Base(&'static str, usize),
    /// Generated resource `i` of a store, removed.
    Remove(&'static str, usize),
    /// A changed version of generated Ingress `i`.
    Ingress(usize, u8),
    /// A changed version of generated Service `i`, or another Service beside it.
    Service(usize, u8),
    /// A canary Ingress on the first route of generated Ingress `i` (removed for variant 3).
    Canary(usize, u8),
    /// A changed version of the IngressClass (or another one).
    Class(u8),
}

fn routed_base(store: &str, i: usize) -> Json {
    let f = routed_fixtures();
    match store {
        "ingresses" => f.ingresses[i].clone(),
        _ => f.services[i].clone(),
    }
}

/// The name of the Service of the other generated Ingress in the namespace of Ingress `i`.
fn neighbour(i: usize) -> String {
    format!("app-{:05}", (i + 2) % ROUTED)
}

/// The (store, resource) an event applies, and whether it removes it.
fn routed_resolve(event: &RoutedEvent) -> (&'static str, Json, bool) {
    let nginx = |key: &str| format!("nginx.ingress.kubernetes.io/{key}");
    match event {
        RoutedEvent::Base(store, i) => (store, routed_base(store, *i), false),
        RoutedEvent::Remove(store, i) => (store, routed_base(store, *i), true),
        RoutedEvent::Ingress(i, variant) => {
            let mut s = routed_base("ingresses", *i);
            let first = &mut s["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"];
            match variant {
                0 => first["name"] = json!(neighbour(*i)),
                1 => first["port"] = json!({"name": "metrics"}),
                2 => first["name"] = json!("late"),
                3 => {
                    s["metadata"]["annotations"] =
                        json!({nginx("whitelist-source-range"): "10.0.0.0/8"});
                }
                4 => s["metadata"]["annotations"] = json!({}),
                5 => s["metadata"]["annotations"] = json!({nginx("proxy-body-size"): "1m"}),
                6 => {
                    s["spec"]["defaultBackend"] =
                        json!({"service": {"name": neighbour(*i), "port": {"number": 80}}});
                }
                7 => {
                    s["spec"] = json!({"ingressClassName": "haptic", "defaultBackend":
                        {"service": {"name": format!("app-{i:05}"), "port": {"name": "http"}}}});
                    s["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
                }
                8 => s["spec"]["ingressClassName"] = json!("other"),
                9 => {
                    s["spec"]
                        .as_object_mut()
                        .unwrap()
                        .remove("ingressClassName");
                }
                // No Exact path: the Exact routes view leaves the Ingress out.
                11 => {
                    let paths = &mut s["spec"]["rules"][0]["http"]["paths"];
                    let prefix: Vec<Json> = paths
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|p| p["pathType"] != "Exact")
                        .cloned()
                        .collect();
                    *paths = Json::Array(prefix);
                }
                // The Exact path on the neighbour's Service, the Prefix ones on its own.
                12 => {
                    for p in s["spec"]["rules"][0]["http"]["paths"]
                        .as_array_mut()
                        .unwrap()
                    {
                        if p["pathType"] == "Exact" {
                            p["backend"]["service"]["name"] = json!(neighbour(*i));
                        }
                    }
                }
                _ => s["metadata"]["annotations"] = json!({nginx("ssl-passthrough"): "true"}),
            }
            ("ingresses", s, false)
        }
        RoutedEvent::Service(i, variant) => {
            let mut s = routed_base("services", *i);
            match variant {
                0 => s["spec"]["ports"] = json!([{"name": "metrics", "port": 9090}]),
                1 => s["spec"]["ports"][0]["port"] = json!(8080),
                2 => s["spec"]["ports"] = json!([]),
                3 => s["metadata"]["name"] = json!("late"),
                4 => s["spec"]["ports"][0]["name"] = json!("web"),
                _ => s["spec"] = json!({"type": "ExternalName", "externalName": "example.com"}),
            }
            ("services", s, false)
        }
        RoutedEvent::Canary(i, variant) => {
            let main = routed_base("ingresses", *i);
            let service = match variant {
                0 => format!("app-{i:05}"),
                1 => neighbour(*i),
                _ => "late".to_owned(),
            };
            let canary = json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "Ingress",
                "metadata": {"namespace": main["metadata"]["namespace"],
                             "name": format!("canary-{i}"),
                             "annotations": {nginx("canary"): "true", nginx("canary-weight"): "10"}},
                "spec": {"ingressClassName": "haptic", "rules": [{
                    "host": main["spec"]["rules"][0]["host"],
                    "http": {"paths": [{"path": "/", "pathType": "Prefix",
                        "backend": {"service": {"name": service, "port": {"number": 80}}}}]}}]},
            });
            ("ingresses", canary, *variant == 3)
        }
        RoutedEvent::Class(variant) => {
            let mut class = routed_fixtures().ingress_classes[0].clone();
            match variant {
                0 => class["metadata"]["annotations"] = json!({}),
                1 => class["spec"]["controller"] = json!("example.com/another"),
                2 => return ("ingressclasses", class, true),
                3 => class = fixtures::ingress_class("other", false),
                _ => {}
            }
            ("ingressclasses", class, false)
        }
    }
}

fn arb_routed_event() -> impl Strategy<Value = RoutedEvent> {
    let store = prop::sample::select(vec!["ingresses", "services"]);
    prop_oneof![
        1 => (store.clone(), 0..ROUTED).prop_map(|(s, i)| RoutedEvent::Base(s, i)),
        1 => (store, 0..ROUTED).prop_map(|(s, i)| RoutedEvent::Remove(s, i)),
        3 => (0..ROUTED, 0u8..13).prop_map(|(i, v)| RoutedEvent::Ingress(i, v)),
        2 => (0..ROUTED, 0u8..6).prop_map(|(i, v)| RoutedEvent::Service(i, v)),
        1 => (0..ROUTED, 0u8..4).prop_map(|(i, v)| RoutedEvent::Canary(i, v)),
        1 => (0u8..5).prop_map(RoutedEvent::Class),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn routed_backends_match_fresh_stores_after_service_policy_canary_and_class_events(
        events in prop::collection::vec(arb_routed_event(), 1..24),
    ) {
        replay(routed_fixtures(), events.iter().map(routed_resolve), |incremental, model| {
            assert_same(incremental, &renderer().render(&fresh(model)).unwrap(), "incremental vs fresh");
        });
    }
}

/// The TLS view is kept per Ingress after the first render (`derived/routes.rs`): a host two
/// Ingresses name changes hands as they change or go, a Secret's change reaches the entries
/// that name it, and an Ingress asking for ssl-passthrough makes the view one computed over
/// every Ingress (and back). After each step the kept stores' views are those of fresh stores
/// with the same resources.
#[test]
fn tls_hosts_change_hands_as_their_ingresses_change() {
    let fixtures = fixtures::generate(8);
    let shared = |i: usize| {
        let mut ingress = fixtures.ingresses[i].clone();
        ingress["spec"]["tls"][0]["hosts"] =
            json!(["shared.example.com", format!("own-{i}.example.com")]);
        ingress
    };
    let (first, second) = (shared(0), shared(4));
    let mut passthrough = first.clone();
    passthrough["metadata"]["annotations"] =
        json!({"nginx.ingress.kubernetes.io/ssl-passthrough": "true"});
    // Its rule's host too: it passes that host's connections through, which the other's
    // conflict says.
    passthrough["spec"]["rules"][0]["host"] = json!("shared.example.com");
    let mut unusable = fixtures.secrets[0].clone();
    unusable["data"]["tls.crt"] = json!("aGVsbG8=");
    let steps: Vec<(&str, Json, bool)> = vec![
        ("ingresses", first.clone(), false),
        ("ingresses", second.clone(), false),
        ("ingresses", first.clone(), true),
        ("ingresses", first.clone(), false),
        ("secrets", unusable, false),
        ("secrets", fixtures.secrets[0].clone(), false),
        ("ingresses", passthrough, false),
        ("ingresses", first.clone(), false),
        ("ingresses", second, true),
    ];
    let mut stores = reference::stores().unwrap();
    fixtures.load(&mut stores).unwrap();
    let mut model = Model::new();
    for (store, resource) in fixtures.resources() {
        model.insert((store, key(resource)), resource.clone());
    }
    let views = ["tls", "ingresses", "routes_prefix", "routes_exact"];
    for view in views {
        assert!(stores.derived_json(view).is_some(), "{view}");
    }
    for (n, (store, resource, remove)) in steps.into_iter().enumerate() {
        let k = key(&resource);
        if remove {
            stores.get_mut(store).unwrap().remove(&k.0, &k.1);
            model.remove(&(store, k));
        } else {
            stores.get_mut(store).unwrap().apply(&resource).unwrap();
            model.insert((store, k), resource);
        }
        let fresh = fresh(&model);
        for view in views {
            assert_eq!(
                stores.derived_json(view),
                fresh.derived_json(view),
                "step {n}: {view}"
            );
        }
        let tls = stores.derived_json("tls").unwrap();
        let conflicts: usize = tls
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row["conflicts"].as_array().map_or(0, Vec::len))
            .sum();
        // Both name the host at steps 1, 3 to 7: the newer one loses it.
        let both = matches!(n, 1 | 3..=7);
        assert_eq!(conflicts > 0, both, "step {n}: {tls}");
    }
}
