//! Property tests: renders are deterministic whatever order resources arrive in, and arbitrary
//! template sources and resources never make the renderer panic.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::OnceLock;

use haptic_render::render::Error;
use haptic_render::{Renderer, Stores, Template, TemplateSet, fixtures, reference};
use proptest::prelude::*;
use serde_json::{Value as Json, json};

fn reference_renderer() -> &'static Renderer {
    static RENDERER: OnceLock<Renderer> = OnceLock::new();
    RENDERER.get_or_init(|| {
        Renderer::compile(&reference::template_set()).expect("reference set compiles")
    })
}

/// Fixture resources as `(store, resource)` in generation order.
fn fixture_events() -> Vec<(&'static str, Json)> {
    fixtures::generate(12)
        .resources()
        .map(|(store, r)| (store, r.clone()))
        .collect()
}

fn baseline() -> &'static haptic_render::FileSet {
    static BASELINE: OnceLock<haptic_render::FileSet> = OnceLock::new();
    BASELINE.get_or_init(|| common::render_reference(&common::reference_stores(12)))
}

/// The baseline's Events, status and provenance: one thread, nothing split.
fn traced_baseline() -> &'static (
    haptic_render::FileSet,
    haptic_render::Requests,
    haptic_render::Provenance,
) {
    static BASELINE: OnceLock<(
        haptic_render::FileSet,
        haptic_render::Requests,
        haptic_render::Provenance,
    )> = OnceLock::new();
    BASELINE.get_or_init(|| {
        Renderer::compile(&reference::template_set())
            .expect("reference set compiles")
            .with_threads(1)
            .render_traced(&common::reference_stores(12))
            .unwrap_or_else(|e| panic!("reference set renders: {e}"))
    })
}

/// An engine panic is turned into an error by the renderer; these tests want to know it
/// happened, because it is a bug to fix or report, not a normal template error.
fn assert_no_engine_panic(result: &Result<impl Sized, Error>) {
    if let Err(e) = result {
        assert!(
            !e.to_string().contains("engine panicked"),
            "the template engine panicked: {e}"
        );
    }
}

/// Arbitrary JSON, biased towards the shapes templates walk (objects with metadata, lists).
fn arb_json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        any::<i64>().prop_map(Json::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Json::from),
        "[a-z/ .*\\n-]{0,8}".prop_map(Json::from),
        Just(json!("kubernetes.io/tls")),
        Just(json!("Prefix")),
        Just(json!("Exact")),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Json::from),
            prop::collection::btree_map(
                prop_oneof![
                    Just("spec".to_owned()),
                    Just("rules".to_owned()),
                    Just("http".to_owned()),
                    Just("paths".to_owned()),
                    Just("path".to_owned()),
                    Just("host".to_owned()),
                    Just("backend".to_owned()),
                    Just("service".to_owned()),
                    Just("port".to_owned()),
                    Just("ports".to_owned()),
                    Just("name".to_owned()),
                    Just("number".to_owned()),
                    Just("tls".to_owned()),
                    Just("secretName".to_owned()),
                    Just("endpoints".to_owned()),
                    Just("addresses".to_owned()),
                    Just("conditions".to_owned()),
                    Just("ready".to_owned()),
                    Just("data".to_owned()),
                    Just("type".to_owned()),
                    "[a-z.]{1,6}",
                ],
                inner,
                0..5,
            )
            .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

/// Template fragments: tera syntax, our functions and filters, and noise.
fn arb_template() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("{{ ".to_owned()),
        Just(" }}".to_owned()),
        Just("{% ".to_owned()),
        Just(" %}".to_owned()),
        Just("{%- ".to_owned()),
        Just(" -%}".to_owned()),
        Just("{# ".to_owned()),
        Just(" #}".to_owned()),
        Just("if ".to_owned()),
        Just("elif ".to_owned()),
        Just("else".to_owned()),
        Just("endif".to_owned()),
        Just("for x in ".to_owned()),
        Just("endfor".to_owned()),
        Just("set y = ".to_owned()),
        Just("include \"s\"".to_owned()),
        Just("resources.ingresses".to_owned()),
        Just("resources.services".to_owned()),
        Just("x.metadata.name".to_owned()),
        Just("x".to_owned()),
        Just("y".to_owned()),
        Just(" | sanitize".to_owned()),
        Just(" | regex_escape".to_owned()),
        Just(" | b64decode".to_owned()),
        Just(" | length".to_owned()),
        Just(" | sort_by(field=\"metadata.name\")".to_owned()),
        Just(" | group_by_field(field=\"metadata.namespace\")".to_owned()),
        Just("get(store=\"services\", namespace=\"team-01\", name=x)".to_owned()),
        Just("lookup(store=\"endpointslices\", key=[x, y])".to_owned()),
        Just("backend_name(namespace=x, service=y, port=80)".to_owned()),
        Just("fail(message=x)".to_owned()),
        Just("ssl_file(namespace=x, name=y)".to_owned()),
        Just(" is http_path".to_owned()),
        Just(" is hostname".to_owned()),
        Just(" ~ ".to_owned()),
        Just(" and ".to_owned()),
        Just(" == ".to_owned()),
        Just("[".to_owned()),
        Just("]".to_owned()),
        Just("(".to_owned()),
        Just(")".to_owned()),
        Just("\"".to_owned()),
        Just("\n".to_owned()),
        "[ -~]{0,6}",
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(token, 0..40).prop_map(|tokens| tokens.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Applying the same resources in any order, with some applied twice, renders the same
    /// bytes and checksum as applying them in generation order, on any number of threads, with
    /// `render_each` runs split over them or not (the same Events, status and provenance too),
    /// and again on a second render.
    #[test]
    fn render_is_independent_of_event_order(
        events in Just(fixture_events()).prop_shuffle(),
        repeats in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        threads in 1usize..5,
        split in prop::sample::select(vec![1usize, 7, 1024]),
    ) {
        let mut stores = reference::stores().unwrap();
        for (store, resource) in &events {
            stores.get_mut(store).unwrap().apply(resource).unwrap();
        }
        for index in repeats {
            let (store, resource) = index.get(&events);
            stores.get_mut(store).unwrap().apply(resource).unwrap();
        }
        let renderer = Renderer::compile(&reference::template_set())
            .unwrap()
            .with_threads(threads)
            .with_split_rows(split);
        let (files, requests, provenance) = renderer.render_traced(&stores).unwrap();
        prop_assert_eq!(files.checksum(), baseline().checksum());
        prop_assert_eq!(files.files(), baseline().files());
        let (base_files, base_requests, base_provenance) = traced_baseline();
        prop_assert_eq!(&requests, base_requests);
        for (path, bytes) in files.files() {
            prop_assert_eq!(provenance.file_object(path), base_provenance.file_object(path));
            let lines = bytes.iter().filter(|b| **b == b'\n').count() + 1;
            for line in 1..=lines {
                prop_assert_eq!(
                    provenance.object_at(&files, path, line),
                    base_provenance.object_at(base_files, path, line),
                    "{} line {}", path, line
                );
            }
        }
        // A second render starts its outputs in another order (longest of the first first).
        let again = renderer.render(&stores).unwrap();
        prop_assert_eq!(again.files(), files.files());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any template source compiles or fails with an error naming a template; whatever
    /// compiles renders or fails with an error. Nothing panics.
    #[test]
    fn arbitrary_templates_never_panic(main in arb_template(), snippet in arb_template()) {
        let mut set = TemplateSet {
            haproxy_config: Template::new(main),
            ..TemplateSet::default()
        };
        set.template_snippets.insert("s".into(), Template::new(snippet));
        let compiled = Renderer::compile(&set);
        assert_no_engine_panic(&compiled);
        match compiled {
            Ok(renderer) => {
                let rendered = renderer.render(&common::reference_stores(3));
                assert_no_engine_panic(&rendered);
            }
            Err(Error::Compile { template, .. }) => {
                prop_assert!(template == "haproxyConfig" || template == "s" || template == "template set");
            }
            Err(other) => prop_assert!(false, "unexpected error kind: {}", other),
        }
    }

    /// The reference set given arbitrary resources renders or fails with a render error;
    /// nothing panics.
    #[test]
    fn arbitrary_resources_never_panic(
        resources in prop::collection::vec(
            (prop::sample::select(vec!["ingresses", "services", "endpointslices", "secrets"]),
             arb_json(), "[a-c]{1,2}", "[a-c]{1,2}"),
            0..12,
        ),
    ) {
        let mut stores: Stores = common::reference_stores(2);
        for (store, mut body, namespace, name) in resources {
            if let Some(object) = body.as_object_mut() {
                object.insert("metadata".into(), json!({"namespace": namespace, "name": name,
                    "labels": {"kubernetes.io/service-name": name}}));
            }
            // Non-objects are refused by the store, as they must be.
            let _ = stores.get_mut(store).unwrap().apply(&body);
        }
        let rendered = reference_renderer().render(&stores);
        assert_no_engine_panic(&rendered);
    }
}
