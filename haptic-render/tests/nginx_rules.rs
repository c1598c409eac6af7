//! The filter `nginx_rules` writes what the snippet `nginx-backend` wrote with a template
//! test per policy field (`tests/raw-templates/nginx-backend.tera`, the snippet before the
//! filter): the same `haproxy.cfg`, byte for byte, for Ingresses with any mix of the
//! annotations the policy carries, the long source lists, the invalid ones and the Secret-reading
//! ones (the snippet then calls the filter in two parts around its own rules).

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
            "nginx-backend".to_owned(),
            Template::new(include_str!("raw-templates/nginx-backend.tera")),
        );
        (
            Renderer::compile(&set).expect("reference set compiles"),
            Renderer::compile(&raw).expect("raw set compiles"),
        )
    })
}

fn cidrs(n: usize, base: u8) -> String {
    (0..n)
        .map(|i| format!("10.{base}.{}.0/24", i))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The annotations (without the prefix) of choice `i`, one group of related ones each.
fn group(i: usize) -> Vec<(&'static str, String)> {
    let a = |pairs: &[(&'static str, &str)]| -> Vec<(&'static str, String)> {
        pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
    };
    match i {
        0 => a(&[("upstream-hash-by", "$request_uri")]),
        1 => a(&[
            ("upstream-hash-by", "$remote_addr"),
            ("load-balance", "ewma"),
        ]),
        2 => a(&[("upstream-hash-by", "$http_x_user")]),
        3 => a(&[("upstream-hash-by", "$cookie_session")]),
        4 => a(&[("upstream-hash-by", "$arg_id")]),
        5 => a(&[("load-balance", "ewma")]),
        6 => a(&[
            ("proxy-connect-timeout", "5"),
            ("proxy-read-timeout", "120"),
        ]),
        7 => a(&[
            ("affinity", "cookie"),
            ("session-cookie-name", "route"),
            ("session-cookie-max-age", "3600"),
        ]),
        8 => a(&[("affinity", "cookie")]),
        9 => a(&[("limit-rps", "10"), ("limit-whitelist", "192.168.0.0/16")]),
        10 => vec![
            ("limit-connections", "5".to_owned()),
            ("limit-whitelist", cidrs(60, 1)),
        ],
        11 => a(&[("force-ssl-redirect", "true")]),
        12 => a(&[("app-root", "/app")]),
        13 => a(&[
            ("permanent-redirect", "https://example.com/new$request_uri"),
            ("permanent-redirect-code", "301"),
        ]),
        14 => a(&[("temporal-redirect", "https://example.com/tmp")]),
        15 => a(&[("denylist-source-range", "192.168.1.0/24, 10.9.0.0/16")]),
        16 => vec![("denylist-source-range", cidrs(75, 2))],
        17 => a(&[("whitelist-source-range", "not-a-cidr")]),
        18 => vec![("allowlist-source-range", cidrs(51, 3))],
        19 => a(&[("whitelist-source-range", "10.0.0.0/8")]),
        20 => a(&[
            ("auth-type", "basic"),
            ("auth-secret", "basic-auth"),
            ("auth-realm", "Private area"),
        ]),
        21 => a(&[("proxy-body-size", "8m")]),
        22 => a(&[("rewrite-target", "/$2"), ("use-regex", "true")]),
        23 => a(&[("upstream-vhost", "internal.example.com")]),
        24 => a(&[("x-forwarded-prefix", "/prefix")]),
        25 => a(&[
            ("enable-cors", "true"),
            (
                "cors-allow-origin",
                "https://a.example.com, https://b.example.com",
            ),
            ("cors-allow-credentials", "true"),
            ("cors-expose-headers", "X-Foo"),
            ("cors-max-age", "600"),
            ("cors-allow-methods", "GET, POST"),
        ]),
        26 => a(&[("enable-cors", "true"), ("cors-allow-credentials", "false")]),
        27 => a(&[
            ("backend-protocol", "HTTPS"),
            ("proxy-ssl-secret", "backend-tls"),
            ("proxy-ssl-verify", "on"),
        ]),
        28 => a(&[
            ("auth-tls-secret", "client-ca"),
            ("auth-tls-verify-client", "optional"),
        ]),
        _ => a(&[
            ("auth-tls-secret", "client-ca"),
            ("auth-tls-verify-client", "on"),
        ]),
    }
}

const GROUPS: usize = 30;

fn render(renderer: &Renderer, ingresses: &[Json], base: &fixtures::Fixtures) -> String {
    let mut stores = reference::stores().unwrap();
    let mut fixtures = base.clone();
    fixtures.ingresses = ingresses.to_vec();
    fixtures.load(&mut stores).unwrap();
    // The CA Secret of auth-tls-secret in every namespace (so its verification rules render);
    // proxy-ssl-secret's is missing (so its refusal renders).
    let b64 = |s: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(s)
    };
    for namespace in 0..20 {
        stores
            .get_mut("auth_secrets")
            .unwrap()
            .apply(&json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "namespace": format!("team-{namespace:02}"),
                    "name": "client-ca",
                    "labels": {reference::AUTH_SECRET_LABEL: "true"},
                },
                "type": "Opaque",
                "data": {"ca.crt": b64(fixtures::TLS_CERT_PEM)},
            }))
            .unwrap();
    }
    let files = renderer.render(&stores).unwrap();
    files.text("haproxy.cfg").unwrap().to_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn nginx_rules_writes_what_the_field_by_field_snippet_wrote(
        choices in prop::collection::vec(prop::collection::vec(0..GROUPS, 1..6), 1..5),
    ) {
        let base = fixtures::Params { annotated_every: 0, ..fixtures::Params::new(choices.len()) }
            .generate();
        let ingresses: Vec<Json> = base
            .ingresses
            .iter()
            .zip(&choices)
            .map(|(ingress, groups)| {
                let mut ingress = ingress.clone();
                let mut annotations = serde_json::Map::new();
                for &g in groups {
                    for (key, value) in group(g) {
                        annotations.insert(
                            format!("{}{key}", haptic_render::nginx::PREFIX),
                            Json::from(value),
                        );
                    }
                }
                ingress["metadata"]["annotations"] = json!(annotations);
                ingress
            })
            .collect();
        let (filter, raw) = renderers();
        let with_filter = render(filter, &ingresses, &base);
        prop_assert_eq!(&with_filter, &render(raw, &ingresses, &base));
        // Every Ingress has annotations the policy carries: the backends have rules.
        prop_assert!(with_filter.contains("\n    balance "));
    }
}

#[test]
fn every_group_renders_the_same_with_the_filter() {
    // Each group alone, so that none is only ever seen mixed with others.
    let base = fixtures::Params {
        annotated_every: 0,
        ..fixtures::Params::new(GROUPS)
    }
    .generate();
    let ingresses: Vec<Json> = base
        .ingresses
        .iter()
        .enumerate()
        .map(|(i, ingress)| {
            let mut ingress = ingress.clone();
            let annotations: serde_json::Map<String, Json> = group(i)
                .into_iter()
                .map(|(k, v)| {
                    (
                        format!("{}{k}", haptic_render::nginx::PREFIX),
                        Json::from(v),
                    )
                })
                .collect();
            ingress["metadata"]["annotations"] = json!(annotations);
            ingress
        })
        .collect();
    let (filter, raw) = renderers();
    let with_filter = render(filter, &ingresses, &base);
    assert_eq!(with_filter, render(raw, &ingresses, &base));
    // What the groups ask for is there (so the comparison compares something).
    for expected in [
        "balance uri whole",
        "balance hdr(x-user)",
        "balance hash req.cook(session)",
        "balance url_param id",
        "balance leastconn",
        "hash-type consistent",
        "timeout connect 5s",
        "cookie route insert indirect nocache httponly maxlife 3600s",
        "acl nginx_limit_exempt src",
        "acl nginx_deny src",
        "acl nginx_allow src",
        "http-request deny status 403 unless { src 10.0.0.0/8 }",
        "http-request auth realm \"Private area\"",
        "http-request deny status 413 if",
        "http-request set-header Host internal.example.com",
        "X-Forwarded-Prefix \"/prefix\"",
        "acl cors_ok var(txn.cors_origin) -m reg",
        "acl cors_ok always_true",
        "Access-Control-Expose-Headers \"X-Foo\"",
        "http-request redirect scheme https code 308",
        "code 301",
        "http-request deny deny_status 503",
        "http-request set-header ssl-client-verify SUCCESS",
        "http-request deny deny_status 400 if { ssl_c_used } { ssl_c_verify gt 0 }",
    ] {
        assert!(
            with_filter.contains(expected),
            "haproxy.cfg lacks {expected:?}"
        );
    }
}
