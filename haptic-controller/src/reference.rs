//! The reference HAProxyTemplateConfig: haptic-render's reference Ingress templates, stores and
//! derived views as a spec, the config `deploy/` ships and the demo runs.

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use crate::crd::{
    CertificateSource, HAProxyTemplateConfig, HAProxyTemplateConfigSpec, PodSelector,
    TemplateSource, TemplatingSettings, ValidationTest, WatchedResource,
};

/// The resource each reference store watches: (store, apiVersion, plural).
const RESOURCES: [(&str, &str, &str); 13] = [
    ("ingresses", "networking.k8s.io/v1", "ingresses"),
    ("services", "v1", "services"),
    ("endpointslices", "discovery.k8s.io/v1", "endpointslices"),
    ("secrets", "v1", "secrets"),
    ("auth_secrets", "v1", "secrets"),
    ("ingressclasses", "networking.k8s.io/v1", "ingressclasses"),
    (
        "gatewayclasses",
        "gateway.networking.k8s.io/v1",
        "gatewayclasses",
    ),
    ("gateways", "gateway.networking.k8s.io/v1", "gateways"),
    ("httproutes", "gateway.networking.k8s.io/v1", "httproutes"),
    (
        "referencegrants",
        "gateway.networking.k8s.io/v1beta1",
        "referencegrants",
    ),
    ("namespaces", "v1", "namespaces"),
    ("haproxy_pods", "v1", "pods"),
    ("backend_pool", "v1", "configmaps"),
];

/// The label of the HAProxy pods in the reference spec (its `podSelector`).
const POD_LABEL: (&str, &str) = ("app.kubernetes.io/name", "haproxy");

/// The reference spec, for HAProxy pods labelled `app.kubernetes.io/name: haproxy`.
pub fn spec() -> HAProxyTemplateConfigSpec {
    let set = haptic_render::reference::template_set();
    let source = |t: &haptic_render::Template| TemplateSource {
        template: t.template.clone(),
    };
    let mut watched = BTreeMap::new();
    for (name, index) in haptic_render::reference::STORES {
        let Some((_, api_version, plural)) = RESOURCES.iter().find(|(n, _, _)| *n == name) else {
            continue;
        };
        watched.insert(
            name.to_owned(),
            WatchedResource {
                api_version: (*api_version).to_owned(),
                resources: (*plural).to_owned(),
                index_by: Some(index.iter().map(|s| (*s).to_owned()).collect()),
                // The HAProxy pods (Gateway status.addresses), in the controller's namespace
                // (`spec_in`), by the label of the podSelector.
                // The htpasswd Secrets of ingress-nginx's auth-secret: only those labelled so,
                // never the cluster's other Opaque Secrets (memory, and what a compromised
                // controller would hold).
                // The backend pool's reserve: the ConfigMap the leader keeps
                // ([`crate::pool_keeper`]), in the controller's namespace (`spec_in`).
                label_selector: match name {
                    "haproxy_pods" => Some(format!("{}={}", POD_LABEL.0, POD_LABEL.1)),
                    "backend_pool" => Some(format!("{}=true", crate::pool_keeper::LABEL)),
                    "auth_secrets" => Some(format!(
                        "{}=true",
                        haptic_render::reference::AUTH_SECRET_LABEL
                    )),
                    _ => None,
                },
                // Only TLS Secrets can hold Ingress certificates; the rest are never read.
                field_selector: (name == "secrets").then(|| "type=kubernetes.io/tls".to_owned()),
                // Ingresses, Gateways and HTTPRoutes are what users write by hand: the
                // webhook checks them before they reach the stores. (The templates leave broken
                // Services, slices and Secrets out, and those come from controllers and
                // cert-manager.)
                enable_validation_webhook: matches!(name, "ingresses" | "gateways" | "httproutes"),
                namespace: None,
                // The Gateway API CRDs are the user's to install: without them the Ingress
                // routing goes on.
                optional: api_version.starts_with("gateway.networking.k8s.io/"),
            },
        );
    }
    HAProxyTemplateConfigSpec {
        pod_selector: PodSelector {
            match_labels: BTreeMap::from([(POD_LABEL.0.to_owned(), POD_LABEL.1.to_owned())]),
        },
        controller: Default::default(),
        agent: Default::default(),
        templating_settings: TemplatingSettings {
            extra_context: set.extra_context.clone(),
        },
        watched_resources_ignore_fields: vec!["metadata.managedFields".to_owned()],
        watched_resources: watched,
        derived_views: haptic_render::reference::derivations()
            .into_iter()
            .filter_map(|(name, d)| Some((name.to_owned(), serde_json::to_value(d).ok()?)))
            .collect(),
        template_snippets: set
            .template_snippets
            .iter()
            .map(|(k, v)| (k.clone(), source(v)))
            .collect(),
        haproxy_config: source(&set.haproxy_config),
        maps: set
            .maps
            .iter()
            .map(|(k, v)| (k.clone(), source(v)))
            .collect(),
        files: BTreeMap::new(),
        ssl_certificates: set
            .ssl_certificates
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    CertificateSource {
                        template: v.template.clone(),
                        for_each: v.for_each.clone(),
                    },
                )
            })
            .collect(),
        status_templates: set
            .status_templates
            .iter()
            .map(|(k, v)| (k.clone(), source(v)))
            .collect(),
        validation_tests: tests(),
    }
}

/// The reference config's validation tests (what `haptic-controller validate` runs in CI on
/// `deploy/haptic-config.yaml`): host and path routing by path type, TLS, a missing Service or
/// port, not-ready endpoints, IPv6, ingress-nginx's ssl-passthrough.
fn tests() -> BTreeMap<String, ValidationTest> {
    let service = |name: &str, ports: Json| {
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": name}, "spec": {"ports": ports}})
    };
    let http = json!([{"name": "http", "port": 80, "protocol": "TCP"}]);
    let slice = |name: &str, service: &str, family: &str, endpoints: Json| {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "shop", "name": name,
                "labels": {"kubernetes.io/service-name": service}},
            "addressType": family,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints})
    };
    let ready = |address: &str| json!({"addresses": [address], "conditions": {"ready": true}});
    let path = |path: &str, kind: &str, service: &str, port: Json| {
        json!({"path": path, "pathType": kind,
            "backend": {"service": {"name": service, "port": port}}})
    };
    // Ingresses of the class deploy/ships (`haproxy`, ours).
    let ingress = |name: &str, spec: Json| {
        let mut spec = spec;
        spec["ingressClassName"] = json!("haproxy");
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"namespace": "shop", "name": name}, "spec": spec})
    };
    let classes = json!([
        haptic_render::fixtures::ingress_class("haproxy", false),
        {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass",
         "metadata": {"name": "nginx"}, "spec": {"controller": "k8s.io/ingress-nginx"}},
    ]);
    let aged = |ingress: Json, namespace: &str, created: &str| {
        let mut ingress = ingress;
        ingress["metadata"]["namespace"] = json!(namespace);
        ingress["metadata"]["creationTimestamp"] = json!(created);
        ingress
    };
    let web = || {
        (
            service("web", http.clone()),
            slice(
                "web-1",
                "web",
                "IPv4",
                json!([ready("10.0.0.1"), ready("10.0.0.2")]),
            ),
        )
    };
    let mut vault = ingress(
        "vault",
        json!({"rules": [{"host": "vault.example.com", "http": {"paths": [
            path("/", "Prefix", "secure", json!({"number": 443}))]}}]}),
    );
    vault["metadata"]["annotations"] =
        json!({"nginx.ingress.kubernetes.io/ssl-passthrough": "true"});
    let tests = json!({
        "ssl-passthrough": {
            "description": "an Ingress with ingress-nginx's ssl-passthrough: a TCP frontend owns the HTTPS port and sends the TLS of its host, by SNI, to a TCP backend of the Service; other TLS goes to the terminating bind behind it, with the client's address",
            "fixtures": {
                "ingressclasses": classes,
                "services": [web().0, service("secure", json!([{"name": "http", "port": 443, "protocol": "TCP"}]))],
                "endpointslices": [web().1, slice("secure-1", "secure", "IPv4", json!([ready("10.0.2.1")]))],
                "secrets": [haptic_render::fixtures::tls_secret("shop", "web-tls")],
                "ingresses": [
                    vault,
                    ingress("web", json!({
                        "tls": [{"hosts": ["shop.example.com"], "secretName": "web-tls"}],
                        "rules": [{"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}],
                    })),
                ],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "equals", "target": "map:passthrough.map", "expected": "vault.example.com shop_secure_443_nginx_passthrough"},
                {"type": "contains", "pattern": "(?m)^frontend https-passthrough\n    mode tcp$"},
                {"type": "contains", "pattern": "(?m)^    bind \"abns@haptic-https-[^\"]*-\\d+\" accept-proxy ssl ",
                    "description": "the TLS bind listens behind the TCP frontend, reading the PROXY header"},
                {"type": "contains", "pattern": "(?m)^backend shop_secure_443_nginx_passthrough\n    mode tcp\n    balance roundrobin$"},
                {"type": "match_count", "pattern": "(?m)^    server s\\d+ 10\\.0\\.2\\.1:8080 check$", "expected": 2,
                    "description": "the TCP backend has the Service port's server slots, as its HTTP backend (plain HTTP to the host)"},
                {"type": "equals", "target": "map:certs.list", "expected": "ssl/10/shop_web-tls.pem shop.example.com"},
            ],
        },
        "routing-by-host-and-path-type": {
            "description": "Exact and Prefix paths of a host, and a rule without a host, route to their Service ports",
            "fixtures": {
                "ingressclasses": classes,
                "services": [web().0, service("api", json!([{"name": "http", "port": 8080, "protocol": "TCP"}]))],
                "endpointslices": [web().1, slice("api-1", "api", "IPv4", json!([ready("10.0.1.1")]))],
                "ingresses": [ingress("web", json!({"rules": [
                    {"host": "shop.example.com", "http": {"paths": [
                        path("/", "Prefix", "web", json!({"number": 80})),
                        path("/healthz", "Exact", "web", json!({"name": "http"})),
                        path("/api/", "Prefix", "api", json!({"number": 8080})),
                    ]}},
                    {"http": {"paths": [path("/shared", "ImplementationSpecific", "web", json!({"number": 80}))]}},
                ]}))],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "equals", "target": "map:routes-exact.map", "expected": "shop.example.com/healthz shop_web_80",
                    "description": "an Exact path is a whole key of the exact map"},
                {"type": "contains", "target": "map:routes-prefix.map", "pattern": "(?m)^shop\\.example\\.com/api/ shop_api_8080$",
                    "description": "a Prefix path ends with one slash"},
                {"type": "contains", "target": "map:routes-prefix.map", "pattern": "(?m)^shop\\.example\\.com/ shop_web_80$"},
                {"type": "contains", "target": "map:routes-prefix.map", "pattern": "(?m)^\\*/shared/ shop_web_80$",
                    "description": "a rule without a host matches any host"},
                {"type": "equals", "target": "map:pool.map", "expected": "shop_api_8080 pool_59\nshop_web_80 pool_1",
                    "description": "each Service port's backend is one of the pool's, the same on every replica"},
                {"type": "match_order", "patterns": ["(?m)^backend default-backend$", "(?m)^backend pool_1$", "(?m)^backend pool_59$"]},
                {"type": "match_count", "pattern": "(?m)^backend pool_\\d+$", "expected": 64,
                    "description": "2 backends and a step of 32 spares, rounded up to the step"},
                {"type": "match_count", "pattern": "(?m)^    server s\\d+ 10\\.\\S+ check$", "expected": 3,
                    "description": "a server per ready endpoint"},
                {"type": "match_count", "pattern": "(?m)^    server ", "expected": 20,
                    "description": "ten server slots per backend of a Service, none on a spare"},
                {"type": "jsonpath", "jsonpath": "$.derived.routes_exact[0].backend", "expected": "shop_web_80"},
                {"type": "deterministic"},
            ],
        },
        "tls": {
            "description": "an Ingress TLS entry with a usable Secret gets an HTTPS bind, a crt-list line and its PEM; one without gets nothing",
            "fixtures": {
                "ingressclasses": classes,
                "services": [web().0],
                "endpointslices": [web().1],
                "secrets": [haptic_render::fixtures::tls_secret("shop", "web-tls")],
                "ingresses": [
                    ingress("web", json!({
                        "tls": [{"hosts": ["shop.example.com"], "secretName": "web-tls"}],
                        "rules": [{"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}],
                    })),
                    ingress("blog", json!({
                        "tls": [{"hosts": ["blog.example.com"], "secretName": "missing-tls"}],
                        "rules": [{"host": "blog.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}],
                    })),
                ],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "contains", "pattern": "ssl strict-sni crt-list maps/certs.list"},
                {"type": "equals", "target": "map:certs.list", "expected": "ssl/10/shop_web-tls.pem shop.example.com"},
                {"type": "contains", "target": "cert:shop_web-tls", "pattern": "-----BEGIN CERTIFICATE-----"},
                {"type": "not_contains", "target": "map:certs.list", "pattern": "missing-tls"},
            ],
        },
        "missing-service-or-port": {
            "description": "paths to a Service that does not exist, or to a port it does not have, write no route and no backend",
            "fixtures": {
                "ingressclasses": classes,
                "services": [web().0],
                "endpointslices": [web().1],
                "ingresses": [ingress("web", json!({"rules": [{"host": "shop.example.com", "http": {"paths": [
                    path("/ghost", "Prefix", "ghost", json!({"number": 80})),
                    path("/wrong-port", "Prefix", "web", json!({"number": 81})),
                    path("/wrong-name", "Exact", "web", json!({"name": "grpc"})),
                ]}}]}))],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "equals", "target": "map:routes-prefix.map", "expected": ""},
                {"type": "equals", "target": "map:routes-exact.map", "expected": ""},
                {"type": "equals", "target": "map:pool.map", "expected": ""},
                {"type": "match_count", "pattern": "(?m)^backend ", "expected": 33,
                    "description": "only the default backend and the pool's 32 spares"},
                {"type": "match_count", "pattern": "(?m)^    server ", "expected": 0,
                    "description": "a spare has no server (a Service that takes one gets its slots at run time)"},
            ],
        },
        "not-ready-endpoints": {
            "description": "an endpoint whose conditions say ready: false is a disabled server; one without conditions takes traffic",
            "fixtures": {
                "ingressclasses": classes,
                "ingressclasses": classes,
                "services": [web().0],
                "endpointslices": [slice("web-1", "web", "IPv4", json!([
                    ready("10.0.0.1"),
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                    {"addresses": ["10.0.0.3"]},
                ]))],
                "ingresses": [ingress("web", json!({"rules": [{"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}]}))],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "match_count", "pattern": "(?m)^    server \\S+ 10\\.0\\.0\\.\\d+:8080 check$", "expected": 2,
                    "description": "ready endpoints take traffic"},
                {"type": "contains", "pattern": "(?m)^    server \\S+ 10\\.0\\.0\\.2:8080 disabled check$",
                    "description": "a not-ready endpoint keeps its slot, disabled"},
                {"type": "contains", "pattern": "(?m)^    server \\S+ 10\\.0\\.0\\.3:8080 check$"},
            ],
        },
        "ingress-classes-conflicts-wildcards": {
            "description": "only Ingresses of our class route; the oldest Ingress wins a host and path claimed twice; a wildcard host is written as it is; the oldest defaultBackend is the default",
            "fixtures": {
                "ingressclasses": classes,
                "services": [web().0, service("api", http.clone())],
                "endpointslices": [web().1, slice("api-1", "api", "IPv4", json!([ready("10.0.1.1")]))],
                "ingresses": [
                    aged(ingress("old", json!({"defaultBackend": {"service": {"name": "web", "port": {"number": 80}}},
                        "rules": [{"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}]})),
                        "shop", "2026-01-01T00:00:00Z"),
                    aged(ingress("new", json!({"defaultBackend": {"service": {"name": "api", "port": {"number": 80}}},
                        "rules": [
                            {"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "api", json!({"number": 80}))]}},
                            {"host": "*.shop.example.com", "http": {"paths": [path("/", "Prefix", "api", json!({"number": 80}))]}},
                        ]})),
                        "shop", "2026-02-01T00:00:00Z"),
                    {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                     "metadata": {"namespace": "shop", "name": "theirs"},
                     "spec": {"ingressClassName": "nginx", "rules": [{"host": "nginx.example.com",
                        "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}]}},
                ],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "equals", "target": "map:routes-prefix.map",
                    "expected": "*.shop.example.com/ shop_api_80\nshop.example.com/ shop_web_80",
                    "description": "the older Ingress keeps shop.example.com/; the wildcard rule is written; the nginx Ingress is not ours"},
                {"type": "contains", "target": "map:pool.map", "pattern": "(?m)^shop_web_80 pool_1$"},
                {"type": "contains", "pattern": "(?m)^    default_backend pool_1$",
                    "description": "the older defaultBackend (shop_web_80, in the pool)"},
                {"type": "jsonpath", "jsonpath": "$.derived.routes_prefix[0].conflict", "expected": "shop/old"},
            ],
        },
        "ipv6": {
            "description": "IPv6 endpoints are bracketed in server lines",
            "fixtures": {
                "ingressclasses": classes,
                "ingressclasses": classes,
                "services": [web().0],
                "endpointslices": [slice("web-1", "web", "IPv6", json!([ready("fd00::1")]))],
                "ingresses": [ingress("web", json!({"rules": [{"host": "shop.example.com", "http": {"paths": [path("/", "Prefix", "web", json!({"number": 80}))]}}]}))],
            },
            "assertions": [
                {"type": "haproxy_valid"},
                {"type": "contains", "pattern": "(?m)^    server \\S+ \\[fd00::1\\]:8080 check$"},
            ],
        },
    });
    serde_json::from_value(tests).unwrap_or_default()
}

/// The reference spec for a controller in `namespace`: [`spec`] watching the HAProxy pods
/// there, with the default certificate
/// the controller generates there (`extraContext.haproxy.default_certificate`:
/// `<namespace>/haptic-default-certificate`).
pub fn spec_in(namespace: &str) -> HAProxyTemplateConfigSpec {
    let mut spec = spec();
    for store in ["haproxy_pods", "backend_pool"] {
        if let Some(watched) = spec.watched_resources.get_mut(store) {
            watched.namespace = Some(namespace.to_owned());
        }
    }
    if let Some(haproxy) = spec
        .templating_settings
        .extra_context
        .get_mut("haproxy")
        .and_then(|v| v.as_object_mut())
    {
        haproxy.insert(
            "default_certificate".to_owned(),
            serde_json::Value::from(format!(
                "{namespace}/{}",
                crate::default_certificate::DEFAULT_SECRET
            )),
        );
        haproxy.insert(
            "backend_pool_reserve".to_owned(),
            serde_json::Value::from(format!("{namespace}/{}", crate::pool_keeper::DEFAULT_NAME)),
        );
    }
    spec
}

/// The reference config as an HAProxyTemplateConfig object in YAML, as `haptic-controller
/// reference-config` prints it and `deploy/` ships it.
pub fn yaml(name: &str, namespace: &str) -> Result<String, serde_saphyr::SerializeError> {
    let mut htc = HAProxyTemplateConfig::new(name, spec_in(namespace));
    htc.metadata.namespace = Some(namespace.to_owned());
    serde_saphyr::to_string(&htc)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_reference_tests_parse_and_cover_what_it_supports() {
        let tests = super::tests();
        for name in [
            "routing-by-host-and-path-type",
            "tls",
            "missing-service-or-port",
            "not-ready-endpoints",
            "ingress-classes-conflicts-wildcards",
            "ipv6",
            "ssl-passthrough",
        ] {
            assert!(tests.contains_key(name), "{name}");
        }
    }

    #[test]
    fn the_yaml_reads_back_as_the_same_spec() {
        let yaml = super::yaml("haptic-config", "haptic-system").expect("yaml");
        let back: crate::crd::HAProxyTemplateConfig =
            serde_saphyr::from_str(&yaml).expect("reads back");
        assert_eq!(back.spec, super::spec_in("haptic-system"));
        assert_eq!(back.metadata.namespace.as_deref(), Some("haptic-system"));
    }
}
