//! The filter `gateway_action` writes what the snippet `gateway-action` wrote with a template
//! test per field of the action row (`tests/raw-templates/gateway-action.tera`, the snippet
//! before the filter): the same `haproxy.cfg`, byte for byte, for HTTPRoutes with any mix of
//! header modifiers, URL rewrites, redirects (full path, replaced prefix, scheme, host, port,
//! code), backend shares (one, several, weight 0, a Service that does not exist, all weights
//! 0, none) and matches of one line or of more terms than a line holds, in a frontend of the
//! Gateway's own and in the Ingress frontend whose port a listener shares.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use haptic_render::{Renderer, Template, fixtures, reference};
use proptest::prelude::*;
use serde_json::{Value as Json, json};

fn renderers() -> &'static (Renderer, Renderer) {
    static RENDERERS: OnceLock<(Renderer, Renderer)> = OnceLock::new();
    RENDERERS.get_or_init(|| {
        let set = reference::template_set();
        let mut raw = set.clone();
        raw.template_snippets.insert(
            "gateway-action".to_owned(),
            Template::new(include_str!("raw-templates/gateway-action.tera")),
        );
        (
            Renderer::compile(&set).expect("reference set compiles"),
            Renderer::compile(&raw).expect("raw set compiles"),
        )
    })
}

/// The filters of choice `i`, one kind of action each.
fn filters(i: usize) -> Vec<Json> {
    let prefix = |with: &str| json!({"type": "ReplacePrefixMatch", "replacePrefixMatch": with});
    match i {
        0 => vec![
            json!({"type": "RequestHeaderModifier", "requestHeaderModifier": {
            "set": [{"name": "x-set", "value": "one"}],
            "add": [{"name": "x-add", "value": "two %d"}],
            "remove": ["x-gone"]}}),
        ],
        1 => vec![
            json!({"type": "ResponseHeaderModifier", "responseHeaderModifier": {
            "set": [{"name": "x-resp", "value": "three"}], "remove": ["server"]}}),
        ],
        2 => {
            vec![json!({"type": "URLRewrite", "urlRewrite": {"hostname": "rewritten.example.org"}})]
        }
        3 => vec![json!({"type": "URLRewrite", "urlRewrite": {
            "path": {"type": "ReplaceFullPath", "replaceFullPath": "/full"}}})],
        4 => vec![json!({"type": "URLRewrite", "urlRewrite": {"path": prefix("/new")}})],
        5 => vec![json!({"type": "URLRewrite", "urlRewrite": {
            "hostname": "both.example.org", "path": prefix("/")}})],
        6 => {
            vec![json!({"type": "RequestRedirect", "requestRedirect": {"hostname": "example.org"}})]
        }
        7 => vec![json!({"type": "RequestRedirect", "requestRedirect": {
            "scheme": "https", "hostname": "example.org", "port": 8443, "statusCode": 301}})],
        8 => vec![json!({"type": "RequestRedirect", "requestRedirect": {
            "path": {"type": "ReplaceFullPath", "replaceFullPath": "/moved"}}})],
        9 => vec![json!({"type": "RequestRedirect", "requestRedirect": {"path": prefix("/to")}})],
        10 => vec![json!({"type": "RequestRedirect", "requestRedirect": {"path": prefix("/")}})],
        _ => Vec::new(),
    }
}
const FILTERS: usize = 12;

/// The backendRefs of choice `i` (`web` and `other` exist, `missing` does not).
fn backends(i: usize, web: &str, other: &str) -> Json {
    match i {
        0 => json!([{"name": web, "port": 80}]),
        1 => {
            json!([{"name": web, "port": 80, "weight": 90}, {"name": other, "port": 80, "weight": 10}])
        }
        2 => {
            json!([{"name": web, "port": 80, "weight": 1}, {"name": other, "port": 80, "weight": 0}])
        }
        3 => json!([{"name": web, "port": 80, "weight": 0}]),
        4 => {
            json!([{"name": "missing", "port": 80, "weight": 3}, {"name": web, "port": 80, "weight": 1}])
        }
        5 => json!([{"name": "missing", "port": 80}]),
        _ => json!([]),
    }
}
const BACKENDS: usize = 7;

/// A rule with header matches (so that it stays in haproxy.cfg, its match and action rendered
/// by the snippets: one header, or nine, more terms than a line holds) and the filters and
/// backends chosen.
fn rule(filter: usize, backend: usize, web: &str, other: &str) -> Json {
    let headers: Vec<Json> = (0..if (filter + backend).is_multiple_of(2) {
        1
    } else {
        9
    })
        .map(|i| json!({"name": format!("x-case-{i}"), "value": "1"}))
        .collect();
    json!({
        "matches": [{"path": {"type": "PathPrefix", "value": "/p"}, "headers": headers}],
        "filters": filters(filter),
        "backendRefs": backends(backend, web, other),
    })
}

/// The gateway fixture with the first routes' rules replaced by `cases` (per route: a list of
/// (filter, backend) choices).
fn render(renderer: &Renderer, cases: &[Vec<(usize, usize)>]) -> String {
    let mut stores = reference::stores().unwrap();
    let mut i = 0;
    for (store, mut resource) in fixtures::gateway_api(cases.len().max(2)) {
        if store == "gateways" {
            // A second listener on the Ingress frontend's port (80): the routes' lines there
            // also require `{ dst_port 80 }` (the snippets' `args`).
            resource["spec"]["listeners"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "shared", "port": 80, "protocol": "HTTP",
                             "allowedRoutes": {"namespaces": {"from": "All"}}}));
        }
        if store == "httproutes" {
            let Some(case) = cases.get(i) else { continue };
            i += 1;
            let rules = resource["spec"]["rules"].as_array().unwrap();
            let web = rules[0]["backendRefs"][0]["name"]
                .as_str()
                .unwrap()
                .to_owned();
            let other = rules[0]["backendRefs"][1]["name"]
                .as_str()
                .unwrap()
                .to_owned();
            resource["spec"]["rules"] = case
                .iter()
                .map(|&(f, b)| rule(f, b, &web, &other))
                .collect();
        }
        stores.get_mut(store).unwrap().apply(&resource).unwrap();
    }
    let files = renderer.render(&stores).unwrap();
    files.text("haproxy.cfg").unwrap().to_owned()
}

#[test]
fn every_filter_and_backend_choice_renders_the_same_with_the_filter() {
    let cases: Vec<Vec<(usize, usize)>> = (0..FILTERS)
        .flat_map(|f| (0..BACKENDS).map(move |b| vec![(f, b)]))
        .collect();
    let (filter, raw) = renderers();
    let with_filter = render(filter, &cases);
    assert_eq!(with_filter, render(raw, &cases));
    // Every kind of line is there, so none was compared only as absent.
    for line in [
        "http-request add-header x-set 'one'",
        "http-request add-header x-add 'two %%d'",
        "http-request del-header x-gone",
        "http-response add-header x-resp 'three'",
        "http-response del-header server",
        "http-request set-header Host rewritten.example.org",
        "http-request set-path /full",
        "http-request set-var(txn.gwrest) path,bytes(2)",
        "http-request redirect location https://example.org:8443",
        "%[pathq,bytes(2)]",
        "?%[query] code 302",
        "http-request set-var(txn.gwshare) rand(100)",
        "{ var(txn.gwshare) -m int lt 90 }",
        "use_backend gateway-500 if { var(txn.gwm) -m str ",
        "http-request set-var(txn.gwc) bool(1) if !{ var(txn.gwm) -m found } { dst_port 80 }",
        "http-request unset-var(txn.gwc) if !{ req.hdr(x-case-",
        "if { var(txn.gwc) -m found }\n    http-request unset-var(txn.gwc)",
        "if !{ var(txn.gwm) -m found } { dst_port 80 } { var(txn.gwhost) -m str ",
        ") if !{ var(txn.gwm) -m found } { var(txn.gwhost) -m str ",
    ] {
        assert!(with_filter.contains(line), "no {line:?} in:\n{with_filter}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn gateway_action_writes_what_the_field_by_field_snippet_wrote(
        cases in prop::collection::vec(
            prop::collection::vec((0..FILTERS, 0..BACKENDS), 1..4), 1..6),
    ) {
        let (filter, raw) = renderers();
        let with_filter = render(filter, &cases);
        prop_assert_eq!(&with_filter, &render(raw, &cases));
        prop_assert!(with_filter.contains("if { var(txn.gwm) -m str "), "no action line");
    }
}
