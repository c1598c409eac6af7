//! Deterministic fixtures for tests and benchmarks: N Ingresses with their Services,
//! EndpointSlices (three endpoints each) and, for some, TLS Secrets; a quarter carry 3 to 5
//! ingress-nginx annotations.
//!
//! The same [`Params`] always give the same resources, byte for byte: no randomness, no clock.
//!
//! ```
//! let fixtures = haptic_render::fixtures::generate(8);
//! assert_eq!(fixtures.ingresses.len(), 8);
//! assert_eq!(fixtures.services.len(), 8);
//! assert_eq!(fixtures.endpoint_slices.len(), 8);
//! assert_eq!(fixtures.secrets.len(), 2); // every 4th Ingress has TLS
//! assert_eq!(fixtures, haptic_render::fixtures::generate(8));
//! ```

use base64::Engine as _;
use serde_json::{Value as Json, json};

use crate::store::{self, Stores};

/// A self-signed ECDSA P-256 certificate for `*.example.com`, valid until 2126. Test data only.
pub const TLS_CERT_PEM: &str = include_str!("../fixtures/tls.crt");
/// The private key of [`TLS_CERT_PEM`]. Test data only: it protects nothing.
pub const TLS_KEY_PEM: &str = include_str!("../fixtures/tls.key");

/// Loading fixtures into stores failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The stores lack one the fixtures need (see [`crate::reference::STORES`]).
    #[error("no store named `{0}`; make the stores with haptic_render::reference::stores()")]
    MissingStore(&'static str),
    /// A store refused a resource.
    #[error("store `{store}` refused a fixture")]
    Store {
        /// The store.
        store: &'static str,
        /// Why.
        #[source]
        source: store::Error,
    },
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// Number of Ingresses; each has its own Service and EndpointSlice.
    pub ingresses: usize,
    /// Namespaces the Ingresses spread over, round-robin. Default 20.
    pub namespaces: usize,
    /// Every n-th Ingress (from the first) has a TLS section and Secret; 0 for none. Default 4.
    pub tls_every: usize,
    /// In every n-th EndpointSlice the third endpoint is not ready; 0 for none. Default 5.
    pub not_ready_every: usize,
    /// Every n-th Ingress also has a rule without a host; 0 for none. Default 10.
    pub hostless_every: usize,
    /// Every n-th Ingress (from the second) carries ingress-nginx annotations HAPTIC applies:
    /// an allow-list, a body size and a read timeout, and every other one of them also
    /// force-ssl-redirect and x-forwarded-prefix (3 to 5); 0 for none. Default 4: a quarter.
    pub annotated_every: usize,
}

impl Params {
    /// Defaults for `ingresses` Ingresses.
    pub fn new(ingresses: usize) -> Self {
        Self {
            ingresses,
            namespaces: 20,
            tls_every: 4,
            not_ready_every: 5,
            hostless_every: 10,
            annotated_every: 4,
        }
    }

    /// Generates the resources.
    pub fn generate(&self) -> Fixtures {
        let mut fixtures = Fixtures {
            ingress_classes: vec![ingress_class(FIXTURE_CLASS, true)],
            ..Fixtures::default()
        };
        for i in 0..self.ingresses {
            let namespace = format!("team-{:02}", i % self.namespaces.max(1));
            let name = format!("app-{i:05}");
            let host = format!("{name}.{namespace}.example.com");
            let every = |n: usize| n != 0 && i % n == 0;

            let mut paths = vec![
                path("/", "Prefix", &name, json!({"number": 80})),
                path("/healthz", "Exact", &name, json!({"name": "http"})),
            ];
            if i % 3 == 0 {
                paths.push(path("/metrics/", "Prefix", &name, json!({"number": 9090})));
            }
            let mut rules = vec![json!({"host": host, "http": {"paths": paths}})];
            if every(self.hostless_every) {
                rules.push(json!({"http": {"paths": [
                    path(&format!("/shared/{name}"), "Prefix", &name, json!({"name": "http"})),
                ]}}));
            }
            let mut spec = json!({"ingressClassName": FIXTURE_CLASS, "rules": rules});
            if every(self.tls_every) {
                let secret = format!("{name}-tls");
                spec["tls"] = json!([{"hosts": [host], "secretName": secret}]);
                fixtures.secrets.push(tls_secret(&namespace, &secret));
            }
            let mut ingress = json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "Ingress",
                "metadata": {"namespace": namespace, "name": name},
                "spec": spec,
            });
            if self.annotated_every != 0 && i % self.annotated_every == 1 % self.annotated_every {
                let mut annotations = serde_json::Map::new();
                let mut add = |key: &str, value: String| {
                    annotations.insert(format!("{}{key}", crate::nginx::PREFIX), Json::from(value));
                };
                add(
                    "whitelist-source-range",
                    "10.0.0.0/8, 192.168.0.0/16".to_owned(),
                );
                add("proxy-body-size", "8m".to_owned());
                add("proxy-read-timeout", "120".to_owned());
                if (i / self.annotated_every).is_multiple_of(2) {
                    add("force-ssl-redirect", "true".to_owned());
                    add("x-forwarded-prefix", format!("/{name}"));
                }
                ingress["metadata"]["annotations"] = Json::Object(annotations);
            }
            fixtures.ingresses.push(ingress);
            fixtures.services.push(json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"namespace": namespace, "name": name},
                "spec": {
                    "selector": {"app": name},
                    "ports": [
                        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                        {"name": "metrics", "port": 9090, "protocol": "TCP", "targetPort": 9090},
                    ],
                },
            }));
            let endpoints: Vec<Json> = (0..3)
                .map(|j| {
                    let k = i * 3 + j;
                    let ready = !(j == 2 && every(self.not_ready_every));
                    json!({
                        "addresses": [format!("10.{}.{}.{}", (k >> 16) & 255, (k >> 8) & 255, k & 255)],
                        "conditions": {"ready": ready, "serving": ready, "terminating": false},
                        "targetRef": {"kind": "Pod", "namespace": namespace, "name": format!("{name}-{j}")},
                    })
                })
                .collect();
            fixtures.endpoint_slices.push(json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "namespace": namespace,
                    "name": format!("{name}-{:05x}", (i as u64).wrapping_mul(2_654_435_761) & 0xfffff),
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [
                    {"name": "http", "port": 8080, "protocol": "TCP"},
                    {"name": "metrics", "port": 9090, "protocol": "TCP"},
                ],
                "endpoints": endpoints,
            }));
        }
        fixtures
    }
}

fn path(path: &str, path_type: &str, service: &str, port: Json) -> Json {
    json!({
        "path": path,
        "pathType": path_type,
        "backend": {"service": {"name": service, "port": port}},
    })
}

/// The IngressClass of the generated Ingresses: ours, and the default, so that an Ingress a
/// test adds without a class is ours too.
pub const FIXTURE_CLASS: &str = "haptic";

/// An IngressClass `name` whose controller is ours ([`crate::derived::DEFAULT_CONTROLLER`]),
/// marked default when `default`.
pub fn ingress_class(name: &str, default: bool) -> Json {
    let mut class = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IngressClass",
        "metadata": {"name": name},
        "spec": {"controller": crate::derived::DEFAULT_CONTROLLER},
    });
    if default {
        class["metadata"]["annotations"] =
            json!({"ingressclass.kubernetes.io/is-default-class": "true"});
    }
    class
}

/// A `kubernetes.io/tls` Secret holding [`TLS_CERT_PEM`] and [`TLS_KEY_PEM`].
pub fn tls_secret(namespace: &str, name: &str) -> Json {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"namespace": namespace, "name": name},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64(TLS_CERT_PEM), "tls.key": b64(TLS_KEY_PEM)},
    })
}

/// [`Params::new`]`(ingresses).generate()`.
pub fn generate(ingresses: usize) -> Fixtures {
    Params::new(ingresses).generate()
}

/// Generated resources, by kind, in generation order (Ingress 0 first).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fixtures {
    /// networking.k8s.io/v1 Ingresses.
    pub ingresses: Vec<Json>,
    /// v1 Services, one per Ingress.
    pub services: Vec<Json>,
    /// discovery.k8s.io/v1 EndpointSlices, one per Service, three endpoints each.
    pub endpoint_slices: Vec<Json>,
    /// kubernetes.io/tls Secrets, one per Ingress with TLS.
    pub secrets: Vec<Json>,
    /// networking.k8s.io/v1 IngressClasses: one, [`FIXTURE_CLASS`], ours and the default.
    pub ingress_classes: Vec<Json>,
}

impl Fixtures {
    /// Every resource with the name of the reference store it belongs in.
    pub fn resources(&self) -> impl Iterator<Item = (&'static str, &Json)> {
        self.ingresses
            .iter()
            .map(|r| ("ingresses", r))
            .chain(self.services.iter().map(|r| ("services", r)))
            .chain(self.endpoint_slices.iter().map(|r| ("endpointslices", r)))
            .chain(self.secrets.iter().map(|r| ("secrets", r)))
            .chain(self.ingress_classes.iter().map(|r| ("ingressclasses", r)))
    }

    /// Applies every resource to its store (made by [`crate::reference::stores`]).
    pub fn load(&self, stores: &mut Stores) -> Result<()> {
        for (store, resource) in self.resources() {
            stores
                .get_mut(store)
                .ok_or(Error::MissingStore(store))?
                .apply(resource)
                .map_err(|source| Error::Store { store, source })?;
        }
        Ok(())
    }

    /// Total number of resources.
    pub fn len(&self) -> usize {
        self.ingresses.len()
            + self.services.len()
            + self.endpoint_slices.len()
            + self.secrets.len()
            + self.ingress_classes.len()
    }

    /// Whether there are no resources.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Gateway API fixtures for the render benchmark: our GatewayClass (`haptic`,
/// [`crate::derived::gateway::DEFAULT_GATEWAY_CONTROLLER`]), one Gateway `infra/gw` with an
/// HTTP listener on port 8080 that takes routes from all namespaces, and `routes` HTTPRoutes
/// attached to it, each with its own hostname, a PathPrefix `/` rule with two weighted
/// backends and an Exact `/healthz` rule with a header match and a request header filter. The
/// Services and EndpointSlices they name are the Ingress fixtures' (`generate(routes)`), which
/// come with them; the Ingresses do not. Deterministic, as the rest.
///
/// ```
/// let resources = haptic_render::fixtures::gateway_api(4);
/// let routes = resources.iter().filter(|(store, _)| *store == "httproutes").count();
/// assert_eq!(routes, 4);
/// ```
pub fn gateway_api(routes: usize) -> Vec<(&'static str, Json)> {
    let group = crate::derived::gateway::GROUP;
    let base = generate(routes);
    let mut out = vec![
        (
            "gatewayclasses",
            json!({"apiVersion": format!("{group}/v1"), "kind": "GatewayClass",
                "metadata": {"name": "haptic", "generation": 1},
                "spec": {"controllerName": crate::derived::gateway::DEFAULT_GATEWAY_CONTROLLER}}),
        ),
        (
            "gateways",
            json!({"apiVersion": format!("{group}/v1"), "kind": "Gateway",
                "metadata": {"namespace": "infra", "name": "gw", "generation": 1,
                    "creationTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"gatewayClassName": "haptic", "listeners": [
                    {"name": "http", "port": 8080, "protocol": "HTTP",
                     "allowedRoutes": {"namespaces": {"from": "All"}}}]}}),
        ),
    ];
    for (i, service) in base.services.iter().enumerate() {
        let namespace = service["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default();
        let name = service["metadata"]["name"].as_str().unwrap_or_default();
        // The 10 % share: a Service 20 on, in the same namespace (they are dealt round-robin
        // over 20), so no ReferenceGrant is needed.
        let other = base.services[(i + 20) % base.services.len()]["metadata"]["name"]
            .as_str()
            .unwrap_or_default();
        out.push((
            "httproutes",
            json!({"apiVersion": format!("{group}/v1"), "kind": "HTTPRoute",
                "metadata": {"namespace": namespace, "name": name, "generation": 1,
                    "creationTimestamp": format!("2026-01-01T{:02}:{:02}:{:02}Z", i / 3600 % 24, i / 60 % 60, i % 60)},
                "spec": {
                    "parentRefs": [{"name": "gw", "namespace": "infra"}],
                    "hostnames": [format!("{name}.{namespace}.gw.example.com")],
                    "rules": [
                        {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                         "backendRefs": [{"name": name, "port": 80, "weight": 90},
                                         {"name": other, "port": 80, "weight": 10}]},
                        {"matches": [{"path": {"type": "Exact", "value": "/healthz"},
                                      "headers": [{"name": "x-probe", "value": "1"}]}],
                         "filters": [{"type": "RequestHeaderModifier",
                                      "requestHeaderModifier": {"set": [{"name": "x-route", "value": name}]}}],
                         "backendRefs": [{"name": name, "port": 80}]},
                    ],
                }}),
        ));
    }
    out.extend(base.services.into_iter().map(|s| ("services", s)));
    out.extend(
        base.endpoint_slices
            .into_iter()
            .map(|s| ("endpointslices", s)),
    );
    out
}
