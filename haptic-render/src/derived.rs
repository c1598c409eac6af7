//! Derived views: Kubernetes joins computed in Rust from the stores, after the stores they
//! read change, and shared by every render until then.
//!
//! An Ingress template needs joins that are the same in every controller: a Service port with
//! the endpoints its EndpointSlices give it, an Ingress path with the Service port it names, an
//! Ingress TLS entry with its Secret. Written in a template, each join walks every resource on every render through the
//! engine's interpreter (attribute lookups, loop steps, a `get` per path); here, what each
//! resource contributes is taken from it once, when first needed after it arrived, and a view
//! is recomputed from those small extracts only when a store it reads changed. The template is
//! left with one loop over ready-made rows (the reference set renders 10k Ingresses about three
//! times faster: see the crate README). The views hold no HAProxy policy: which rows to write,
//! and how, stays in the templates.
//!
//! A derived view is configured on [`Stores`](crate::Stores) with
//! [`Stores::derive`](crate::Stores::derive) and seen by templates as `derived.<name>`, a list
//! of rows (maps). Their fields:
//!
//! [`Derivation::ServiceBackends`]: a row per TCP Service port (Services sorted by namespace
//! and name, ports in spec order; a port without a numeric `port` is left out; with
//! `routedBy`, only the ports a path of an Ingress in that store resolves to).
//!
//! | field | value |
//! | --- | --- |
//! | `name` | `backend_name(namespace, service, port)`: `<namespace>_<service>_<port>`, sanitized |
//! | `namespace`, `service` | the Service's |
//! | `port`, `port_name` | the Service port's number and name (`""` when it has none) |
//! | `app_protocol` | the Service port's `appProtocol` (`""` when it has none) |
//! | `created` | the Service's `metadata.creationTimestamp` (`""` when absent): the order in which [`crate::pool`] assigns backends |
//! | `endpoints` | the endpoints of the Service's EndpointSlices (label `kubernetes.io/service-name`, same namespace) on the slice port with the same name, ready or not: slices by name, then port, then endpoint order; FQDN slices and endpoints without addresses are left out |
//! | `policy` | none; with `routedBy`, for the routes of Ingresses whose ingress-nginx annotations ask something of their requests, a copy of the port's row per policy, named `<backend>_nginx_<id>`, with the policy's row ([`crate::nginx::Policy::row`]) and the `origin` of the first such Ingress (an ingress-nginx canary's path whose main route has a policy, not a regex, nor of another namespace with a policy that reads Secrets, routes to the canary's port with the main's policy, and its `origin` is the main Ingress; with `service-upstream`, its `endpoints` are one row for the Service's cluster IP and port, named `cluster-ip_<ip>`, unless the Service is headless); the port's own row is then written only when a path without a policy (or the default backend) routes to it |
//!
//! An endpoint:
//!
//! | field | value |
//! | --- | --- |
//! | `name` | `sanitize(<slice name>)_sanitize(<address>)`: unique within the backend, stable across renders |
//! | `address` | the endpoint's first address |
//! | `port` | the slice port's number (the Pod's port) |
//! | `endpoint` | `address:port`, the address in brackets in an IPv6 slice |
//! | `ready` | `conditions.ready`; an absent condition counts as ready, as the API documents |
//! | `terminating` | `conditions.terminating` (absent: false) |
//! | `slice` | the EndpointSlice's name |
//!
//! Every row of the three row views also has `origin`: `[store, namespace, name]` of the
//! Service or Ingress it comes from, what the `from` filter takes (see [`crate::provenance`]).
//!
//! [`Derivation::IngressRoutes`]: a row per path of an Ingress rule whose backend is a Service
//! (Ingresses sorted by namespace and name, rules and paths in spec order; resource backends
//! are left out; with `exact`, only the paths whose `pathType` is, or is not, `Exact`).
//!
//! | field | value |
//! | --- | --- |
//! | `namespace`, `ingress` | the Ingress's |
//! | `host` | the rule's host as written, `""` for a rule without one (not checked; a rule whose host is not a string is left out) |
//! | `path`, `path_type` | as written, `""` when absent (not checked) |
//! | `service` | the Service the path names |
//! | `port` | the Service port it resolves to, by number or by name as the path asks; none when the Service or the port does not exist |
//! | `backend` | that Service port's backend name (as a backend row's `name`; `<backend>_nginx_<id>` when the Ingress's ingress-nginx annotations ask something of its requests); none when unresolved (an ExternalName Service included), so that a template decides what such a path gets |
//! | `conflict` | none; or, when an older Ingress claims the same route (host, path as the map writes it, Exact or not), its `namespace/name` |
//! | `external_name` | whether the Service is an ExternalName Service |
//! | `canary` | whether the Ingress is an ingress-nginx canary (`canary: "true"`): its paths claim no route (nor lose one) |
//!
//! [`Derivation::IngressTls`]: a row per TLS entry of an Ingress (Ingresses sorted by namespace
//! and name, entries in spec order).
//!
//! | field | value |
//! | --- | --- |
//! | `namespace`, `ingress` | the Ingress's |
//! | `secret` | the entry's `secretName` (`""` when absent) |
//! | `hosts` | the entry's hosts as written (not checked; `[]` when absent) |
//! | `file` | `ssl_file(namespace, secret)`: where a per-Secret certificate output writes it |
//! | `usable` | whether the Secret exists and holds a certificate HAProxy can serve ([`crate::certificate`]: the chain parses as X.509, the key parses and matches the leaf, the leaf has not expired) |
//! | `reason` | why not, in words (`""` when usable): what a Warning Event on the Ingress says |
//! | `conflicts` | `[{host, winner}]`: the entry's hosts an older Ingress names too (they are left out of `hosts`) |
//! | `ssl_redirect` | false when the Ingress has the annotation `haproxy-haptic.org/ssl-redirect: "false"` |
//!
//! [`Derivation::TlsCertificates`]: a **map** from `"<namespace>/<name>"` to a row per
//! `kubernetes.io/tls` Secret (other Secrets have no entry), the same verdict as `usable`
//! above, so that a per-Secret certificate output writes exactly the files the crt-list names.
//!
//! | field | value |
//! | --- | --- |
//! | `usable`, `reason` | as in an Ingress TLS row |
//! | `pem` | the chain, then the key, trimmed, each ending in a newline (`""` when unusable) |
//! | `namespace`, `secret`, `file` | the Secret's namespace and name; `ssl_file(namespace, name)` |
//!
//! A verdict is computed once per version of a Secret (a new version is checked again) at the
//! time of the first render that needs it: a certificate that expires while its Secret stays
//! unchanged is served until the Secret changes or the controller restarts.
//!
//! [`Derivation::Ingresses`]: a row per Ingress (sorted by namespace and name): `namespace`,
//! `name`, `ref` (what `set_status(object=)` and `record_event(object=)` read of it:
//! `apiVersion`, `kind`, `metadata.namespace`, `metadata.name`, `metadata.uid`) and, unless
//! `whole: false`, `object` (the resource). Without `object` no view keeps the Ingresses
//! whole, and their store can be compact ([`crate::Store::set_compact`]).
//!
//! [`Derivation::IngressAnnotations`]: a row per Ingress that carries
//! `nginx.ingress.kubernetes.io/*` annotations (sorted by namespace and name), judged by the
//! registry ([`crate::nginx`]): `refused`, the message of a `SnippetRefused` Event (`""` when
//! no snippet), `not_applied`, the message of an `AnnotationNotSupported` Event (`""` when
//! every one is supported or refused), `invalid`, the message of an `AnnotationInvalid` Event
//! (`""` when every value parses), `canary` (none; for a canary Ingress, its split as
//! [`crate::nginx::Canary::row`] with `paths`: `host`, `path`, `exact`, `service`,
//! `port_number` or `port_name`, `main_policy`: the policy id of the main route, the oldest
//! non-canary Ingress's path of the same host, path and kind, when its backend is a policy's
//! and it is not a regex, nor of another namespace with a policy that reads Secrets; else none), `www_redirects` (`[from, to]`
//! host pairs of `from-to-www-redirect`; `[]` without it), `namespace`, `ingress`, `origin`.
//!
//! [`Derivation::IngressDefaultBackends`]: a row per Ingress with a `spec.defaultBackend`, the
//! winner first (the oldest whose default backend is a Service), then the other Service backends
//! (oldest first), then resource backends: `backend` (resolved as a route's), `resource`,
//! `conflict` (the winner's `namespace/name`, for the other Service backends), `namespace`,
//! `ingress`, `service`, `port`, `external_name`.
//!
//! Every view that reads Ingresses takes an optional [`IngressClassFilter`] (`classes`): then
//! only the Ingresses of our classes count, as if the others did not exist. Conflicts are
//! decided by age: the oldest Ingress (`creationTimestamp`, then namespace, then name) keeps
//! what several claim, the same on every replica.

use std::collections::{BTreeMap, BTreeSet};

/// The views' hash maps, keyed by names the cluster chooses: hashed with ahash's keyed hasher
/// (keys random per process, as std's SipHash has them), about twice as fast: SipHash was over
/// a third of the refresh after one Ingress or Service event at 10,000 Ingresses. No output
/// depends on a map's order (std's is random per process too).
type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
/// The same for sets.
type HashSet<T> = std::collections::HashSet<T, ahash::RandomState>;
use std::sync::{Arc, Mutex, OnceLock, Weak};

pub mod gateway;
mod last;
mod pcre;
mod routes;
mod sparse;

use serde::{Deserialize, Serialize};
use tera::Value;
use tera::value::{Key, Map};

use crate::certificate::{Verdict, check_secret, now_unix};
use crate::functions::{self, backend_name, sanitize, ssl_file};
use crate::store::{Source, Store, Stored};

/// The controller name the reference configuration claims IngressClasses with
/// (`spec.controller`), unless an [`IngressClassFilter`] names another.
pub const DEFAULT_CONTROLLER: &str = "haproxy-haptic.org/ingress-controller";

fn default_controller() -> String {
    DEFAULT_CONTROLLER.to_owned()
}

/// Which Ingresses a view reads: the ones whose class is ours, by the Kubernetes rules.
///
/// An Ingress is ours when `spec.ingressClassName` names an IngressClass whose
/// `spec.controller` is [`controller`](Self::controller); or, without `ingressClassName`, when
/// the legacy annotation `kubernetes.io/ingress.class` names such an IngressClass; or, with
/// neither, when one of those IngressClasses is marked default
/// (`ingressclass.kubernetes.io/is-default-class: "true"`) or [`classless`](Self::classless)
/// is set. Everything else is left out of the view, as if it did not exist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IngressClassFilter {
    /// The store of networking.k8s.io/v1 IngressClasses.
    pub ingress_classes: String,
    /// The `spec.controller` of our IngressClasses; default [`DEFAULT_CONTROLLER`].
    #[serde(default = "default_controller")]
    pub controller: String,
    /// Whether an Ingress with no class at all (no `ingressClassName`, no annotation) is ours
    /// even when none of our IngressClasses is the default; default false.
    #[serde(default)]
    pub classless: bool,
}

impl IngressClassFilter {
    /// Our default controller name over the IngressClasses of `store`, class-less Ingresses
    /// not taken.
    pub fn new(store: impl Into<String>) -> Self {
        Self {
            ingress_classes: store.into(),
            controller: default_controller(),
            classless: false,
        }
    }

    /// Whether the Ingress `ingress` (as JSON, e.g. one under admission review) is ours with
    /// the IngressClasses `classes` holds.
    pub(crate) fn accepts_json(&self, classes: Source<'_>, ingress: &serde_json::Value) -> bool {
        let text = |pointer: &str| {
            ingress
                .pointer(pointer)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
        };
        let class = match (
            text("/spec/ingressClassName"),
            text("/metadata/annotations/kubernetes.io~1ingress.class"),
        ) {
            ("", "") => IngressClassRef::None,
            ("", legacy) => IngressClassRef::Annotation(legacy.to_owned()),
            (name, _) => IngressClassRef::Name(name.to_owned()),
        };
        Ours::new(Some(self), Some(classes)).accepts_class(&class)
    }
}

/// A join computed from named stores.
// A config holds a handful of these, read once: the size of the largest (the Gateway API's
// store names) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "kind",
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    deny_unknown_fields
)]
pub enum Derivation {
    /// A row per Service port: its backend name and the endpoints of the Service's
    /// EndpointSlices (label `kubernetes.io/service-name`, same namespace) whose port has the
    /// Service port's name, in slice order (sorted by name), then port, then endpoint order.
    /// FQDN slices and endpoints without addresses are left out; an endpoint's first address
    /// is used. A Service port without a numeric `port`, and UDP and SCTP ports (of the
    /// Service and of the slices), are left out: backends speak TCP, and a UDP port may share
    /// a TCP port's number.
    ServiceBackends {
        /// The store of v1 Services.
        services: String,
        /// The store of discovery.k8s.io/v1 EndpointSlices.
        endpoint_slices: String,
        /// When set, a store of Ingresses: only the Service ports that a path of an Ingress
        /// there resolves to (as in [`Derivation::IngressRoutes`]), or the winning
        /// `spec.defaultBackend` (as in [`Derivation::IngressDefaultBackends`]), get a row. A
        /// controller watches every Service to resolve Ingress backends; without this, a
        /// cluster's thousands of Services nobody routes to would each become a backend.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        routed_by: Option<String>,
        /// With `routedBy`: only the Ingresses of our classes route.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A row per path of an Ingress rule whose backend is a Service, resolved against the
    /// Services' TCP ports: by port number or by port name, as the path asks (the first port
    /// that matches either, should a path give both). A path whose Service or
    /// Service port does not exist is still a row, with `backend` none, so that a template can
    /// decide what such a path gets. Resource backends are left out. When Ingresses claim the
    /// same route (host, path and kind of match), the oldest wins: the others' rows name it
    /// in `conflict`.
    IngressRoutes {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Services.
        services: String,
        /// When set, only the paths whose `pathType` is `Exact` (true) or is not (false): one
        /// view per kind of lookup, so that each map's template walks only its own rows.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exact: Option<bool>,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A row per TLS entry of an Ingress, with whether its Secret holds a usable certificate.
    /// When Ingresses name the same TLS host, the oldest keeps it.
    IngressTls {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Secrets.
        secrets: String,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A row per Ingress (of our classes, when `classes` is set), with a reference to it
    /// and (`whole`) the resource itself.
    Ingresses {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
        /// Whether each row holds the whole Ingress as `object` (default: yes). Off, a row has
        /// its `ref` alone (enough for `set_status` and `record_event`), and the Ingresses'
        /// store can be kept compact: at 10,000 Ingresses ~30 MB less heap.
        #[serde(default = "default_whole", skip_serializing_if = "is_true")]
        whole: bool,
    },
    /// A row per Ingress with a `spec.defaultBackend`, the winner first: the oldest Ingress
    /// whose default backend is a Service; then the other Service backends, oldest first,
    /// each naming the winner in `conflict`; then resource backends (unsupported).
    IngressDefaultBackends {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Services.
        services: String,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A row per Ingress (of our classes, when `classes` is set) that carries
    /// `nginx.ingress.kubernetes.io/*` annotations, with what is not applied of them
    /// ([`crate::nginx`]).
    IngressAnnotations {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A row per host of an Ingress (of our classes, when `classes` is set) with the
    /// ingress-nginx annotation `ssl-passthrough: "true"` ([`crate::nginx::passthrough`]): its
    /// TLS connections with that SNI go, not terminated, to `backend` (the TCP backend of the
    /// Service port of the host's path `/`, else of its first path; none when that Service
    /// or port does not exist). A passthrough takes every TLS connection to its host, so the
    /// host is the oldest claimant's among the Ingresses that route it (a rule or a
    /// server-alias; not canaries), name it in a TLS section or pass it through: a row whose
    /// host another Ingress won names it in `conflict`; [`Derivation::IngressTls`] moves a TLS
    /// host an older Ingress passes through to its `conflicts`. Hosts that are neither plain
    /// names nor `*.` wildcards are left out.
    IngressPassthrough {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Services.
        services: String,
        /// When set, only the Ingresses of our classes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
    /// A map from `"<namespace>/<name>"` to the verdict on each `kubernetes.io/tls` Secret,
    /// with its PEM when usable (see [`crate::certificate`]).
    TlsCertificates {
        /// The store of v1 Secrets.
        secrets: String,
    },
    /// The Gateway API ([`gateway`]): `{frontends, backends, statuses}` from the GatewayClasses
    /// whose `spec.controllerName` is `controllerName`, their Gateways, the HTTPRoutes attached
    /// to them and the ReferenceGrants that let routes and listeners refer across namespaces.
    GatewayApi {
        /// gateway.networking.k8s.io/v1 GatewayClasses.
        gateway_classes: String,
        /// gateway.networking.k8s.io/v1 Gateways.
        gateways: String,
        /// gateway.networking.k8s.io/v1 HTTPRoutes.
        http_routes: String,
        /// gateway.networking.k8s.io/v1beta1 ReferenceGrants.
        reference_grants: String,
        /// v1 Services.
        services: String,
        /// discovery.k8s.io/v1 EndpointSlices.
        endpoint_slices: String,
        /// v1 Secrets (listener certificates).
        secrets: String,
        /// v1 Namespaces (`allowedRoutes.namespaces.from: Selector`).
        namespaces: String,
        /// v1 Pods: the HAProxy pods, whose addresses are the Gateways' `status.addresses`.
        pods: String,
        /// The `controllerName` of our GatewayClasses; default
        /// [`gateway::DEFAULT_GATEWAY_CONTROLLER`].
        #[serde(default = "default_gateway_controller")]
        controller_name: String,
        /// Ports no listener may take: what HAProxy's pods already serve besides routes (the
        /// agent's API and probe ports, a stats or metrics frontend). A listener on one is not
        /// rendered and shows `Accepted: False`, reason `PortUnavailable`; the webhook denies
        /// it. Default none; the reference config lists the agent's 9090 and 9091
        /// (deploy/haproxy.yaml).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        reserved_ports: Vec<u16>,
        /// The Ingress frontend's ports (the reference templates' `extraContext.haproxy`
        /// `http_port` and `https_port`; keep them equal): a listener of the same protocol
        /// shares that frontend, one of the other protocol is `PortUnavailable`. Default 80
        /// and 443.
        #[serde(default)]
        ingress_ports: IngressPorts,
        /// When set, a store of Ingresses: an HTTPRoute match on the Ingress frontend's port
        /// and an Ingress path claiming the same host and path are a conflict the older one
        /// wins (see `docs/gateway-api.md`, "Conflicts with Ingresses").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ingresses: Option<String>,
        /// With `ingresses`: only the Ingresses of our classes claim routes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<IngressClassFilter>,
    },
}

/// The ports of the Ingress frontend ([`Derivation::GatewayApi`]'s `ingressPorts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressPorts {
    /// Plain HTTP (default 80).
    #[serde(default = "default_http_port")]
    pub http: u16,
    /// HTTPS (default 443).
    #[serde(default = "default_https_port")]
    pub https: u16,
}

impl Default for IngressPorts {
    fn default() -> Self {
        Self {
            http: default_http_port(),
            https: default_https_port(),
        }
    }
}

const fn default_http_port() -> u16 {
    80
}

const fn default_https_port() -> u16 {
    443
}

fn default_whole() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_true(value: &bool) -> bool {
    *value
}

fn default_gateway_controller() -> String {
    gateway::DEFAULT_GATEWAY_CONTROLLER.to_owned()
}

impl Derivation {
    /// The store whose resources this view's rows hold whole (the `Ingresses` view's
    /// `object`): a store better kept as template values than compact
    /// ([`crate::Store::set_compact`]), which would make each row's a copy.
    pub fn keeps_whole(&self) -> Option<&str> {
        match self {
            Self::Ingresses {
                ingresses,
                whole: true,
                ..
            } => Some(ingresses),
            _ => None,
        }
    }

    /// The stores this view reads, in a fixed order (the IngressClasses of `classes` last).
    pub fn inputs(&self) -> Vec<&str> {
        let mut inputs: Vec<&str> = match self {
            Self::ServiceBackends {
                services,
                endpoint_slices,
                routed_by,
                ..
            } => [Some(services), Some(endpoint_slices), routed_by.as_ref()]
                .into_iter()
                .flatten()
                .map(String::as_str)
                .collect(),
            Self::IngressRoutes {
                ingresses,
                services,
                ..
            }
            | Self::IngressDefaultBackends {
                ingresses,
                services,
                ..
            }
            | Self::IngressPassthrough {
                ingresses,
                services,
                ..
            } => vec![ingresses, services],
            Self::IngressTls {
                ingresses, secrets, ..
            } => vec![ingresses, secrets],
            Self::Ingresses { ingresses, .. } | Self::IngressAnnotations { ingresses, .. } => {
                vec![ingresses]
            }
            Self::TlsCertificates { secrets } => vec![secrets],
            Self::GatewayApi {
                gateway_classes,
                gateways,
                http_routes,
                reference_grants,
                services,
                endpoint_slices,
                secrets,
                namespaces,
                pods,
                ingresses,
                ..
            } => [
                gateway_classes,
                gateways,
                http_routes,
                reference_grants,
                services,
                endpoint_slices,
                secrets,
                namespaces,
                pods,
            ]
            .into_iter()
            .chain(ingresses)
            .map(String::as_str)
            .collect(),
        };
        if let Some(classes) = self.classes() {
            inputs.push(&classes.ingress_classes);
        }
        inputs
    }

    /// The class filter, where it applies (`ServiceBackends` without `routedBy` reads no
    /// Ingresses).
    pub fn classes(&self) -> Option<&IngressClassFilter> {
        match self {
            Self::ServiceBackends {
                routed_by: None, ..
            }
            | Self::GatewayApi {
                ingresses: None, ..
            }
            | Self::TlsCertificates { .. } => None,
            Self::GatewayApi { classes, .. }
            | Self::ServiceBackends { classes, .. }
            | Self::IngressRoutes { classes, .. }
            | Self::IngressTls { classes, .. }
            | Self::Ingresses { classes, .. }
            | Self::IngressAnnotations { classes, .. }
            | Self::IngressPassthrough { classes, .. }
            | Self::IngressDefaultBackends { classes, .. } => classes.as_ref(),
        }
    }

    /// The store of Ingresses this view reads, if any.
    pub fn ingresses(&self) -> Option<&str> {
        match self {
            Self::ServiceBackends { routed_by, .. }
            | Self::GatewayApi {
                ingresses: routed_by,
                ..
            } => routed_by.as_deref(),
            Self::TlsCertificates { .. } => None,
            Self::IngressRoutes { ingresses, .. }
            | Self::IngressTls { ingresses, .. }
            | Self::Ingresses { ingresses, .. }
            | Self::IngressAnnotations { ingresses, .. }
            | Self::IngressPassthrough { ingresses, .. }
            | Self::IngressDefaultBackends { ingresses, .. } => Some(ingresses),
        }
    }

    /// Which of a resource's row slots this view uses (one per kind of view).
    fn slot(&self) -> usize {
        match self {
            Self::ServiceBackends { .. } => 0,
            Self::IngressRoutes { .. } => 1,
            Self::IngressTls { .. } => 2,
            Self::Ingresses { .. } => 3,
            Self::IngressDefaultBackends { .. } => 4,
            Self::TlsCertificates { .. } => 5,
            Self::IngressAnnotations { .. } => 6,
            Self::GatewayApi { .. } => 7,
            // Its rows are few and not kept per resource (no slot of the extracts' rows).
            Self::IngressPassthrough { .. } => 8,
        }
    }
}

fn attr<'a>(value: &'a Value, key: &'static str) -> Option<&'a Value> {
    value.as_map()?.get(&Key::Str(key))
}

fn path<'a>(value: &'a Value, keys: &[&'static str]) -> Option<&'a Value> {
    keys.iter().try_fold(value, |v, k| attr(v, k))
}

fn text<'a>(value: &'a Value, keys: &[&'static str]) -> &'a str {
    path(value, keys)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn list<'a>(value: &'a Value, keys: &[&'static str]) -> &'a [Value] {
    path(value, keys)
        .and_then(Value::as_array)
        .unwrap_or_default()
}

/// A number as an integer, if it is one (JSON numbers arrive as u64 or i64).
fn integer(value: Option<&Value>) -> Option<i64> {
    let value = value?;
    value
        .as_i64()
        .or_else(|| value.as_u64().and_then(|u| i64::try_from(u).ok()))
}

const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Whether a Service or EndpointSlice port speaks TCP (`protocol` absent means TCP, as the
/// API defaults it). HAProxy backends connect over TCP; a UDP or SCTP port may share its
/// number with a TCP one (443/TCP and 443/UDP for HTTP/3, 53 for DNS), and must not become a
/// second backend of the same name.
fn is_tcp(port: &Value) -> bool {
    attr(port, "protocol").is_none_or(|p| p.as_str() == Some("TCP"))
}

/// What the derivations need of one resource, taken from it once (on first use after the
/// resource arrived) and kept beside it: a derived view is then recomputed from these small
/// extracts, not by walking every resource again.
///
/// One is kept beside each of the stores' resources (tens of thousands), and a resource is
/// read by one or two kinds of view: each extract is boxed, so an empty one costs a pointer
/// (the struct was 952 bytes a resource with them inline: 31 MB at 10,000 Ingresses with their
/// Services, EndpointSlices and 2,500 Secrets).
#[derive(Debug, Default)]
pub(crate) struct Extracts {
    service: OnceLock<Box<ServiceExtract>>,
    slice: OnceLock<Box<SliceExtract>>,
    ingress: OnceLock<Box<IngressExtract>>,
    tls: OnceLock<Box<[TlsExtract]>>,
    certificate: OnceLock<Box<Verdict>>,
    class: OnceLock<Box<IngressClassExtract>>,
    /// The rows this resource last contributed to a view, and what they were joined with, by
    /// kind of view ([`Derivation::slot`]'s index; kinds below [`Slot::KEPT`] only).
    rows: Mutex<Vec<(usize, Contribution)>>,
    /// An HTTPRoute: what the Gateway API view last resolved it to, and what it read
    /// ([`gateway::RouteOut`]); gone with this version of the route.
    gateway_route: Mutex<Option<Arc<gateway::RouteOut>>>,
}

/// An IngressClass: whether it is ours (by controller name) and marked default.
#[derive(Debug)]
struct IngressClassExtract {
    controller: String,
    default: bool,
}

/// An Ingress TLS entry.
#[derive(Debug)]
struct TlsExtract {
    secret: String,
    hosts: Value,
}

/// A Service's TCP ports (none for an ExternalName Service: it has no endpoints to route to).
#[derive(Debug)]
struct ServiceExtract {
    ports: Vec<PortExtract>,
    /// `spec.type` is `ExternalName`.
    external_name: bool,
    /// `spec.clusterIP`, when it is an IP address (not `None`: headless).
    cluster_ip: Option<String>,
    /// `metadata.creationTimestamp` (its rows' `created`).
    created: Value,
}

/// A Service port: name, number, backend name and `appProtocol` (`""` when absent).
#[derive(Debug)]
struct PortExtract {
    name: String,
    number: i64,
    backend: Value,
    app_protocol: Value,
}

/// An EndpointSlice: the Service it belongs to and, per port name, its endpoint rows.
#[derive(Debug)]
struct SliceExtract {
    service: String,
    ports: Vec<(String, Value)>,
}

/// An Ingress's paths with a Service backend, and what decides whether it is ours and how
/// old it is.
#[derive(Debug)]
struct IngressExtract {
    paths: Vec<PathExtract>,
    /// `spec.ingressClassName`, or (without it) the legacy annotation, or neither.
    class: IngressClassRef,
    /// `metadata.creationTimestamp` (RFC 3339 in UTC, so its text orders as its time).
    created: Option<String>,
    /// `spec.defaultBackend`.
    default_backend: Option<DefaultBackendExtract>,
    /// Not turned off by the annotation `haproxy-haptic.org/ssl-redirect: "false"`.
    ssl_redirect: bool,
    /// What is not applied of its ingress-nginx annotations ([`crate::nginx`]); none when it
    /// carries none.
    nginx: Option<NginxFindings>,
    /// An ingress-nginx canary (`canary: "true"`): its paths claim no route.
    canary: bool,
    /// ingress-nginx's `ssl-passthrough`: each host of its rules (plain names and `*.`
    /// wildcards, first seen first) and the index in `paths` of the path whose Service its
    /// TLS connections go to: the host's `/`, else its first path. Empty without it.
    passthrough: Vec<(Value, usize)>,
}

/// The messages of an Ingress's Events about its ingress-nginx annotations (none where there
/// is nothing to say).
#[derive(Debug)]
struct NginxFindings {
    /// The refused ones (snippets).
    refused: Option<String>,
    /// The ones not applied (not yet supported, unknown).
    not_applied: Option<String>,
    /// The ones whose values cannot be applied, and what is done instead.
    invalid: Option<String>,
    /// A canary's split ([`crate::nginx::Canary::row`]) with its `paths`; none otherwise.
    canary: Value,
    /// `from-to-www-redirect`: `[from, to]` host pairs ([`crate::nginx::www_redirects`]).
    www_redirects: Value,
}

/// The ingress-nginx annotations of an Ingress, judged by the registry, and the values that
/// cannot be applied; none when it carries none.
fn nginx_findings(
    annotations: &[(&str, &str)],
    invalid: &[crate::nginx::Invalid],
) -> Option<NginxFindings> {
    let found = crate::nginx::judge(annotations.iter().map(|(key, _)| *key));
    (!found.is_empty()).then(|| NginxFindings {
        refused: crate::nginx::refusal(&found),
        not_applied: crate::nginx::not_applied(&found),
        invalid: (!invalid.is_empty()).then(|| {
            let all: Vec<String> = invalid.iter().map(crate::nginx::Invalid::stored).collect();
            format!(
                "ingress-nginx annotations with values that cannot be applied: {}",
                all.join("; ")
            )
        }),
        canary: Value::none(),
        www_redirects: Value::from(Vec::<Value>::new()),
    })
}

/// A canary's row ([`crate::nginx::Canary::row`]) with `paths`: per path, `host`, `path`,
/// `exact`, `service`, the port it names (`port_number`, or `port_name`), and `main_policy`
/// (none here: the policy id of the main route, [`canary_mains`], is joined by the view).
fn canary_row(canary: &crate::nginx::Canary, paths: &[PathExtract]) -> Value {
    let paths: Vec<Value> = paths
        .iter()
        .map(|p| {
            row([
                ("host", p.host.clone()),
                ("path", p.path.clone()),
                ("exact", Value::from(p.exact)),
                ("service", Value::from(p.target.service.as_str())),
                (
                    "port_number",
                    p.target.want_number.map_or_else(Value::none, Value::from),
                ),
                ("port_name", Value::from(p.target.want_name.as_str())),
                // Set by the view ([`annotation_rows`]) when the main route has a policy.
                ("main_policy", Value::none()),
            ])
        })
        .collect();
    with_field(&canary.row(), "paths", Value::from(paths))
}

/// How an Ingress names its class.
#[derive(Debug, PartialEq, Eq)]
enum IngressClassRef {
    /// `spec.ingressClassName`.
    Name(String),
    /// The annotation `kubernetes.io/ingress.class`, without `ingressClassName`.
    Annotation(String),
    /// Neither.
    None,
}

/// An Ingress's `spec.defaultBackend`.
#[derive(Debug)]
enum DefaultBackendExtract {
    Service(ServiceRef),
    /// A resource backend (unsupported).
    Resource,
}

/// A Service port an Ingress backend names.
#[derive(Debug)]
struct ServiceRef {
    service: String,
    want_number: Option<i64>,
    want_name: String,
}

impl ServiceRef {
    fn of(backend: &Value) -> Self {
        Self {
            service: text(backend, &["name"]).to_owned(),
            want_number: integer(path(backend, &["port", "number"])).filter(|n| *n != 0),
            want_name: text(backend, &["port", "name"]).to_owned(),
        }
    }
}

/// The annotation a user sets to keep plain HTTP for the TLS hosts of one Ingress.
pub const SSL_REDIRECT_ANNOTATION: &str = "haproxy-haptic.org/ssl-redirect";
/// The legacy class annotation.
const CLASS_ANNOTATION: &str = "kubernetes.io/ingress.class";
/// The annotation that marks an IngressClass the default.
const DEFAULT_CLASS_ANNOTATION: &str = "ingressclass.kubernetes.io/is-default-class";

#[derive(Debug)]
struct PathExtract {
    /// Whether `pathType` is `Exact`.
    exact: bool,
    host: Value,
    path: Value,
    path_type: Value,
    target: ServiceRef,
    /// The path is a regular expression (`use-regex`, `rewrite-target`; not for Exact paths).
    regex: bool,
    /// The id and row of the ingress-nginx policy of this path's routes, when there is one
    /// ([`crate::nginx::Policy::for_path`]).
    policy: Option<(String, Value)>,
}

/// The value in `cell`, made by `make` and boxed the first time.
fn boxed<T>(cell: &OnceLock<Box<T>>, make: impl FnOnce() -> T) -> &T {
    cell.get_or_init(|| Box::new(make()))
}

impl Extracts {
    fn service(&self, namespace: &str, name: &str, svc: &Stored) -> &ServiceExtract {
        boxed(&self.service, || {
            let svc = &*svc.get();
            let external_name = text(svc, &["spec", "type"]) == "ExternalName";
            let ports = if external_name {
                Vec::new()
            } else {
                list(svc, &["spec", "ports"])
                    .iter()
                    .filter(|sp| is_tcp(sp))
                    .filter_map(|sp| {
                        let number = integer(attr(sp, "port"))?;
                        Some(PortExtract {
                            name: text(sp, &["name"]).to_owned(),
                            number,
                            backend: Value::from(backend_name(
                                namespace,
                                name,
                                &number.to_string(),
                            )),
                            app_protocol: Value::from(text(sp, &["appProtocol"])),
                        })
                    })
                    .collect()
            };
            ServiceExtract {
                ports,
                external_name,
                cluster_ip: Some(text(svc, &["spec", "clusterIP"]))
                    .filter(|ip| crate::functions::is_ip_address(ip))
                    .map(str::to_owned),
                created: Value::from(text(svc, &["metadata", "creationTimestamp"])),
            }
        })
    }

    fn ingress_class(&self, class: &Stored) -> &IngressClassExtract {
        boxed(&self.class, || {
            let class = &*class.get();
            IngressClassExtract {
                controller: text(class, &["spec", "controller"]).to_owned(),
                default: text(
                    class,
                    &["metadata", "annotations", DEFAULT_CLASS_ANNOTATION],
                ) == "true",
            }
        })
    }

    fn slice(&self, slice: &Stored) -> &SliceExtract {
        boxed(&self.slice, || {
            let slice = &*slice.get();
            let address_type = text(slice, &["addressType"]);
            let slice_name = text(slice, &["metadata", "name"]);
            let slice_id = sanitize(slice_name);
            let mut ports = Vec::new();
            // FQDN slices give no addresses a server line can use.
            if address_type != "FQDN" {
                for epp in list(slice, &["ports"]).iter().filter(|epp| is_tcp(epp)) {
                    let Some(port) = integer(attr(epp, "port")).filter(|p| *p != 0) else {
                        continue;
                    };
                    let rows: Vec<Value> = list(slice, &["endpoints"])
                        .iter()
                        .filter_map(|ep| {
                            endpoint_row(ep, port, address_type, slice_name, &slice_id)
                        })
                        .collect();
                    ports.push((text(epp, &["name"]).to_owned(), Value::from(rows)));
                }
            }
            SliceExtract {
                service: text(slice, &["metadata", "labels", SERVICE_NAME_LABEL]).to_owned(),
                ports,
            }
        })
    }

    fn tls(&self, ing: &Stored) -> &[TlsExtract] {
        self.tls.get_or_init(|| {
            list(&ing.get(), &["spec", "tls"])
                .iter()
                .map(|tls| TlsExtract {
                    secret: text(tls, &["secretName"]).to_owned(),
                    hosts: path(tls, &["hosts"])
                        .filter(|h| h.is_array())
                        .cloned()
                        .unwrap_or_else(|| Value::from(Vec::<Value>::new())),
                })
                .collect()
        })
    }

    /// The verdict on a Secret's certificate ([`crate::certificate::check_secret`]), once
    /// per version of the Secret.
    fn certificate(&self, secret: &Stored) -> &Verdict {
        boxed(&self.certificate, || {
            check_secret(&secret.get(), now_unix())
        })
    }

    fn ingress(&self, ing: &Stored) -> &IngressExtract {
        boxed(&self.ingress, || {
            let ing = &*ing.get();
            let mut paths = Vec::new();
            for rule in list(ing, &["spec", "rules"]) {
                // A rule without a host matches every host; one whose host is not a string
                // (refused by the API server) is left out rather than taken for that.
                let host = match attr(rule, "host") {
                    None => Value::from(""),
                    Some(host) if host.is_none() => Value::from(""),
                    Some(host) if host.as_str().is_some() => host.clone(),
                    Some(_) => continue,
                };
                for p in list(rule, &["http", "paths"]) {
                    let Some(backend) = path(p, &["backend", "service"]) else {
                        continue;
                    };
                    paths.push(PathExtract {
                        exact: text(p, &["pathType"]) == "Exact",
                        host: host.clone(),
                        path: Value::from(text(p, &["path"])),
                        path_type: Value::from(text(p, &["pathType"])),
                        target: ServiceRef::of(backend),
                        regex: false,
                        policy: None,
                    });
                }
            }
            let annotation = |name: &'static str| text(ing, &["metadata", "annotations", name]);
            let class = match (
                text(ing, &["spec", "ingressClassName"]),
                annotation(CLASS_ANNOTATION),
            ) {
                ("", "") => IngressClassRef::None,
                ("", legacy) => IngressClassRef::Annotation(legacy.to_owned()),
                (name, _) => IngressClassRef::Name(name.to_owned()),
            };
            let default_backend =
                path(ing, &["spec", "defaultBackend"]).map(|backend| {
                    match path(backend, &["service"]) {
                        Some(service) => DefaultBackendExtract::Service(ServiceRef::of(service)),
                        None => DefaultBackendExtract::Resource,
                    }
                });
            let created = text(ing, &["metadata", "creationTimestamp"]);
            let annotations: Vec<(&str, &str)> = path(ing, &["metadata", "annotations"])
                .and_then(Value::as_map)
                .map(|a| {
                    a.iter()
                        .filter_map(|(k, v)| Some((k.as_str()?, v.as_str()?)))
                        .collect()
                })
                .unwrap_or_default();
            let (policy, invalid) =
                crate::nginx::Policy::parse_in(text(ing, &["metadata", "namespace"]), &annotations);
            // ssl-passthrough: the rules' own hosts (not server-alias's), before the aliases.
            let mut passthrough: Vec<(Value, usize)> = Vec::new();
            if crate::nginx::passthrough(&annotations) {
                for (i, p) in paths.iter().enumerate() {
                    let Some(host) = p.host.as_str().filter(|h| {
                        crate::functions::is_hostname(h) || crate::functions::is_wildcard_host(h)
                    }) else {
                        continue;
                    };
                    let root = p.path.as_str() == Some("/");
                    match passthrough
                        .iter_mut()
                        .find(|(h, _)| h.as_str() == Some(host))
                    {
                        None => passthrough.push((p.host.clone(), i)),
                        Some((_, chosen)) => {
                            let chosen_root = paths
                                .get(*chosen)
                                .is_some_and(|c| c.path.as_str() == Some("/"));
                            if root && !chosen_root {
                                *chosen = i;
                            }
                        }
                    }
                }
            }
            // server-alias: every path of a rule with a host, for each alias too.
            if !policy.aliases.is_empty() {
                let aliased: Vec<PathExtract> = paths
                    .iter()
                    .filter(|p| p.host.as_str().is_some_and(|h| !h.is_empty()))
                    .flat_map(|p| {
                        policy.aliases.iter().map(move |alias| PathExtract {
                            exact: p.exact,
                            host: Value::from(alias.as_str()),
                            path: p.path.clone(),
                            path_type: p.path_type.clone(),
                            target: ServiceRef {
                                service: p.target.service.clone(),
                                want_number: p.target.want_number,
                                want_name: p.target.want_name.clone(),
                            },
                            regex: false,
                            policy: None,
                        })
                    })
                    .collect();
                paths.extend(aliased);
            }
            if policy.applies_per_route() || policy.use_regex {
                let (id, row) = (policy.id(), policy.row());
                for p in &mut paths {
                    p.regex = policy.use_regex && !p.exact;
                    if policy.applies_per_route() {
                        let path = p.path.as_str().unwrap_or_default();
                        p.policy = Some(policy.for_path(&id, &row, path));
                    }
                }
            }
            let mut nginx = nginx_findings(&annotations, &invalid);
            if let (Some(canary), Some(found)) = (&policy.canary, &mut nginx) {
                found.canary = canary_row(canary, &paths);
            }
            if let (true, Some(found)) = (policy.www_redirect, &mut nginx) {
                let hosts = paths.iter().filter_map(|p| p.host.as_str());
                found.www_redirects = Value::from(
                    crate::nginx::www_redirects(hosts)
                        .into_iter()
                        .map(|(from, to)| Value::from(vec![Value::from(from), Value::from(to)]))
                        .collect::<Vec<_>>(),
                );
            }
            IngressExtract {
                passthrough,
                canary: policy.canary.is_some(),
                paths,
                class,
                created: (!created.is_empty()).then(|| created.to_owned()),
                default_backend,
                ssl_redirect: annotation(SSL_REDIRECT_ANNOTATION) != "false" && policy.ssl_redirect,
                nginx,
            }
        })
    }
}

impl ServiceExtract {
    /// The port a backend asks for: the first with its number, or with its name.
    fn resolve(&self, target: &ServiceRef) -> Option<&PortExtract> {
        self.ports.iter().find(|port| {
            target.want_number == Some(port.number)
                || (!target.want_name.is_empty() && port.name == target.want_name)
        })
    }
}

/// The one endpoint of a backend of ingress-nginx's `service-upstream`: the Service's cluster
/// IP and port, always ready.
fn cluster_ip_row(ip: &str, port: i64) -> Value {
    let endpoint = if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    };
    row([
        ("name", Value::from(format!("cluster-ip_{}", sanitize(ip)))),
        ("endpoint", Value::from(endpoint)),
        ("ready", Value::from(true)),
        ("address", Value::from(ip)),
        ("port", Value::from(port)),
        ("terminating", Value::from(false)),
        ("slice", Value::from("")),
    ])
}

/// The row of one endpoint of a slice port; none without an address.
fn endpoint_row(
    ep: &Value,
    port: i64,
    address_type: &str,
    slice_name: &str,
    slice_id: &str,
) -> Option<Value> {
    // An address that is not an IP address (the API refuses them; a store takes what it is
    // given) would write whatever it holds into a `server` line: no row.
    let address = list(ep, &["addresses"])
        .first()
        .and_then(Value::as_str)
        .filter(|a| crate::functions::is_ip_address(a))?;
    let condition = |name: &'static str| path(ep, &["conditions", name]).and_then(Value::as_bool);
    let endpoint = if address_type == "IPv6" {
        format!("[{address}]:{port}")
    } else {
        format!("{address}:{port}")
    };
    Some(row([
        (
            "name",
            Value::from(format!("{slice_id}_{}", sanitize(address))),
        ),
        ("endpoint", Value::from(endpoint)),
        ("ready", Value::from(condition("ready") != Some(false))),
        ("address", Value::from(address)),
        ("port", Value::from(port)),
        (
            "terminating",
            Value::from(condition("terminating") == Some(true)),
        ),
        ("slice", Value::from(slice_name)),
    ]))
}

/// What a resource's rows were joined with: the extracts of the resources found (none where a
/// join found nothing). A `Weak` keeps its allocation, so its address cannot be reused and
/// pointer equality means "the same versions"; being weak, it keeps nothing alive, so joins
/// that point at each other (a store joined with itself, views chained both ways) form no
/// cycle. (A resource's own version needs no tracking: a new version has new, empty extracts.)
type Deps = Vec<Option<Weak<Extracts>>>;

/// The rows a resource contributed to a view, and what they were joined with.
type Contribution = (Deps, Vec<Value>);

/// Whether `joined` are the versions `deps` recorded (by address, without touching counts).
fn same_deps<'a>(deps: &Deps, joined: impl Iterator<Item = Option<&'a Arc<Extracts>>>) -> bool {
    let mut count = 0;
    for (i, now) in joined.enumerate() {
        count = i + 1;
        let same = match (deps.get(i), now) {
            (Some(Some(then)), Some(now)) => std::ptr::eq(then.as_ptr(), Arc::as_ptr(now)),
            (Some(None), None) => true,
            _ => false,
        };
        if !same {
            return false;
        }
    }
    count == deps.len()
}

impl Extracts {
    /// What the Gateway API view last resolved this HTTPRoute to, if it kept it.
    fn gateway_route(&self) -> Option<Arc<gateway::RouteOut>> {
        self.gateway_route
            .lock()
            .map_or(None, |kept| kept.as_ref().map(Arc::clone))
    }

    /// Keeps what the Gateway API view resolved this HTTPRoute to.
    fn keep_gateway_route(&self, out: Arc<gateway::RouteOut>) {
        if let Ok(mut kept) = self.gateway_route.lock() {
            *kept = Some(out);
        }
    }

    /// Appends this resource's rows for the view of kind `slot`: the ones it last contributed
    /// when they were joined with the same versions of the same resources (`joined`, none
    /// where a join found nothing), otherwise `compute()`'s (then kept for the next time).
    fn rows_into<'a>(
        &self,
        slot: Slot,
        joined: impl Iterator<Item = Option<&'a Arc<Extracts>>> + Clone,
        out: &mut Vec<Value>,
        compute: impl FnOnce() -> Vec<Value>,
    ) {
        self.rows_into_if(slot, joined, out, compute, |_| true);
    }

    /// As [`Extracts::rows_into`], appending only the rows whose index `keep` accepts.
    fn rows_into_if<'a>(
        &self,
        slot: Slot,
        joined: impl Iterator<Item = Option<&'a Arc<Extracts>>> + Clone,
        out: &mut Vec<Value>,
        compute: impl FnOnce() -> Vec<Value>,
        keep: impl Fn(usize) -> bool,
    ) {
        let kept = |rows: &[Value], out: &mut Vec<Value>| {
            out.extend(
                rows.iter()
                    .enumerate()
                    .filter(|(i, _)| keep(*i))
                    .map(|(_, row)| row.clone()),
            );
        };
        if slot.index >= Slot::KEPT {
            kept(&compute(), out);
            return;
        }
        let mut slots = self.rows.lock().unwrap_or_else(|poisoned| {
            let mut slots = poisoned.into_inner();
            slots.clear();
            slots
        });
        let at = slots.iter().position(|(index, _)| *index == slot.index);
        match at.map(|at| &slots[at].1) {
            Some((deps, rows)) if same_deps(deps, joined.clone()) => kept(rows, out),
            _ => {
                let rows = compute();
                kept(&rows, out);
                // A render of an overlay keeps nothing: the stores' own rows stay theirs.
                if slot.keep {
                    let deps = joined.map(|dep| dep.map(Arc::downgrade)).collect();
                    match at {
                        Some(at) => slots[at].1 = (deps, rows),
                        None => {
                            slots.reserve_exact(1);
                            slots.push((slot.index, (deps, rows)));
                        }
                    }
                }
            }
        }
    }
}

/// Where a view kind keeps its rows in each resource's extracts ([`Derivation::slot`]), and
/// whether rows computed now are kept there (not for an overlay's render).
#[derive(Debug, Clone, Copy)]
struct Slot {
    index: usize,
    keep: bool,
}

impl Slot {
    /// The kinds of view whose rows are kept in the extracts: those with a lower index.
    const KEPT: usize = 8;
}

/// Which Ingresses one computation of a view reads: all of them, or those of our classes (the
/// names of our IngressClasses and whether one of them is the default, read once per
/// computation: a cluster has a handful).
struct Ours<'a> {
    filter: Option<(&'a IngressClassFilter, Vec<&'a str>, bool)>,
}

impl<'a> Ours<'a> {
    fn new(filter: Option<&'a IngressClassFilter>, classes: Option<Source<'a>>) -> Self {
        let filter = filter.map(|filter| {
            let mut names = Vec::new();
            let mut default = false;
            for ((_, name), class, extracts) in classes.into_iter().flat_map(Source::entries) {
                let class = extracts.ingress_class(class);
                if class.controller == filter.controller {
                    names.push(name.as_str());
                    default |= class.default;
                }
            }
            (filter, names, default)
        });
        Self { filter }
    }

    fn accepts(&self, ing: &IngressExtract) -> bool {
        self.accepts_class(&ing.class)
    }

    fn accepts_class(&self, class: &IngressClassRef) -> bool {
        let Some((filter, names, default)) = &self.filter else {
            return true;
        };
        match class {
            IngressClassRef::Name(name) | IngressClassRef::Annotation(name) => {
                names.contains(&name.as_str())
            }
            IngressClassRef::None => *default || filter.classless,
        }
    }

    /// Our Ingresses of `ingresses`, in (namespace, name) order, with their extracts.
    fn of(&self, ingresses: Source<'a>) -> Vec<OurIngress<'a>> {
        ingresses
            .entries()
            .filter_map(|((namespace, name), ing, extracts)| {
                let ingress = extracts.ingress(ing);
                self.accepts(ingress).then_some(OurIngress {
                    namespace,
                    name,
                    value: ing,
                    extracts,
                    ingress,
                })
            })
            .collect()
    }
}

/// One of our Ingresses, as a view walks them.
struct OurIngress<'a> {
    namespace: &'a str,
    name: &'a str,
    value: &'a Stored,
    extracts: &'a Arc<Extracts>,
    ingress: &'a IngressExtract,
}

/// How a conflict is decided: the oldest Ingress (`creationTimestamp`; one without sorts
/// after every one with), then namespace, then name. The same on every replica, after every
/// failover: it reads nothing but the Ingresses.
type Age<'a> = (bool, &'a str, &'a str, &'a str);

impl<'a> OurIngress<'a> {
    fn age(&self) -> Age<'a> {
        let created = self.ingress.created.as_deref();
        (
            created.is_none(),
            created.unwrap_or_default(),
            self.namespace,
            self.name,
        )
    }
}

/// The `namespace/name` of the Ingress of an age.
fn owner(age: &Age<'_>) -> String {
    format!("{}/{}", age.2, age.3)
}

/// Who claims each key: the oldest claimant, and whether another Ingress claims it too.
struct Claims<'a, K> {
    by_key: HashMap<K, (Age<'a>, bool)>,
    contested: bool,
}

impl<'a, K: std::hash::Hash + Eq> Claims<'a, K> {
    fn with_capacity(n: usize) -> Self {
        Self {
            by_key: HashMap::with_capacity_and_hasher(n, Default::default()),
            contested: false,
        }
    }

    fn claim(&mut self, key: K, age: Age<'a>) {
        match self.by_key.entry(key) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((age, false));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (best, contested) = o.get_mut();
                if (best.2, best.3) != (age.2, age.3) {
                    *contested = true;
                    self.contested = true;
                    if age < *best {
                        *best = age;
                    }
                }
            }
        }
    }

    /// The winner of `key`, when an Ingress other than `me` won it from `me`.
    fn lost_to(&self, key: &K, me: &Age<'_>) -> Option<String> {
        if !self.contested {
            return None;
        }
        match self.by_key.get(key) {
            Some((best, true)) if (best.2, best.3) != (me.2, me.3) => Some(owner(best)),
            _ => None,
        }
    }
}

impl Claims<'_, &str> {
    /// The winner of a passthrough host from `me`: an older Ingress claiming the host itself
    /// or, for a wildcard (`*.foo.com`), one claiming a host it would take the TLS of
    /// (`bar.foo.com`: one label more).
    fn passthrough_lost_to(&self, host: &str, me: &Age<'_>) -> Option<String> {
        if let Some(winner) = self.lost_to(&host, me) {
            return Some(winner);
        }
        let rest = host.strip_prefix('*')?;
        self.by_key
            .iter()
            .filter(|(key, _)| {
                key.strip_suffix(rest)
                    .is_some_and(|label| !label.is_empty() && !label.contains(['.', '*']))
            })
            .map(|(_, (best, _))| best)
            .filter(|best| (best.2, best.3) != (me.2, me.3) && *best < me)
            .min()
            .map(owner)
    }
}

/// The key two routes collide on: the kind of match, the host, the path as the map writes it
/// (a Prefix path without its trailing slashes: `/foo` and `/foo/` are the same route).
fn route_key(p: &PathExtract) -> (bool, &str, &str) {
    let path = p.path.as_str().unwrap_or_default();
    let path = if p.exact {
        path
    } else {
        path.trim_end_matches('/')
    };
    (p.exact, p.host.as_str().unwrap_or_default(), path)
}

/// A regular expression matching a rule's host as the frontend lowercases it: any host for
/// none, one label for a wildcard's `*`, dots escaped. (Hosts that are neither plain names
/// nor wildcards are left out by the templates.)
fn host_pattern(host: &str) -> String {
    match host {
        "" => "[^/]*".to_owned(),
        _ => match host.strip_prefix("*.") {
            Some(rest) => format!("[^./]+\\.{}", rest.replace('.', "\\.")),
            None => host.replace('.', "\\."),
        },
    }
}

/// A copy of a row with one field set.
fn with_field(row: &Value, key: &'static str, value: Value) -> Value {
    let mut map = crate::value::map_with_room(row, 1);
    map.insert(Key::Str(key), value);
    Value::from(map)
}

/// The Service ports Ingress paths resolve to: namespace -> Service -> ports. Owned, so that
/// a view keeps it while only its slices change (the commonest event: Pods come and go), and
/// looked up by `&str` without allocating.
type Routed = HashMap<String, HashMap<String, Vec<RoutedPort>>>;

/// A Service port paths resolve to: whether a path without an ingress-nginx policy does (then
/// its own backend is written), and the backends of the policies of the others.
#[derive(Debug, Clone, PartialEq)]
struct RoutedPort {
    number: i64,
    plain: bool,
    /// `(name, policy row, origin of the first Ingress with it)`, one per policy.
    variants: Vec<(String, Value, Value)>,
}

/// The policy id of the TCP backends of ssl-passthrough: `<backend>_nginx_passthrough`.
const PASSTHROUGH: &str = "passthrough";

/// The backend of a Service port for the routes of Ingresses with an ingress-nginx policy
/// (`id`, [`crate::nginx::Policy::id`]): `<backend>_nginx_<id>`. A Service backend's name
/// ends in its port number, so it never takes this form.
fn variant_name(backend: &Value, id: &str) -> String {
    format!("{}_nginx_{id}", backend.as_str().unwrap_or_default())
}

/// The main route of each host + path + kind, for the canaries to join: the path of the
/// oldest non-canary Ingress that claims it (the winner of the route, as [`ingress_routes`]
/// decides; within one Ingress, its first such path).
struct CanaryMains<'o, 'a> {
    by_key: HashMap<(bool, &'a str, &'a str), (Age<'a>, &'o OurIngress<'a>, &'a PathExtract)>,
}

/// The main routes of [`CanaryMains`]; none when no Ingress of `ours` is a canary (the
/// common case costs a look at each Ingress).
fn canary_mains<'o, 'a>(ours: &'o [OurIngress<'a>]) -> Option<CanaryMains<'o, 'a>> {
    if !ours.iter().any(|ing| ing.ingress.canary) {
        return None;
    }
    let mut by_key: HashMap<_, (Age<'a>, &'o OurIngress<'a>, &'a PathExtract)> = HashMap::default();
    for ing in ours.iter().filter(|ing| !ing.ingress.canary) {
        let age = ing.age();
        for p in &ing.ingress.paths {
            match by_key.entry(route_key(p)) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert((age, ing, p));
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if age < o.get().0 {
                        o.insert((age, ing, p));
                    }
                }
            }
        }
    }
    Some(CanaryMains { by_key })
}

impl<'o, 'a> CanaryMains<'o, 'a> {
    /// For a path of a canary Ingress: the main route's Ingress and policy when its
    /// backend is a policy variant, so that the canary's requests go to a backend of the
    /// canary's Service port with the same policy (ingress-nginx applies the main Ingress's
    /// annotations to canary traffic). None for a path of another Ingress, for a main
    /// without a policy (the canary's own backend), for a regex main (routes-regex.map: the
    /// canary block looks the route up by its literal key, so it never matches), and for a
    /// main of another namespace whose policy reads Secrets (auth-secret, auth-tls-secret,
    /// proxy-ssl-secret: the templates read them from the backend's namespace, the canary's,
    /// so its backend would not have the main's).
    fn policy_for(
        &self,
        canary: &OurIngress<'a>,
        p: &'a PathExtract,
    ) -> Option<(&'o OurIngress<'a>, &'a (String, Value))> {
        if !canary.ingress.canary {
            return None;
        }
        let (_, main, main_path) = self.by_key.get(&route_key(p))?;
        let policy = main_path.policy.as_ref().filter(|_| !main_path.regex)?;
        let reads_secrets = || {
            ["auth_secret", "client_tls", "backend_tls"]
                .iter()
                .any(|key| attr(&policy.1, key).is_some_and(Value::is_truthy))
        };
        if main.namespace != canary.namespace && reads_secrets() {
            return None;
        }
        Some((main, policy))
    }
}

/// What a policy variant is made of: the (namespace, name) of the Ingress whose annotations
/// it applies (its rows' `origin`), and the policy's id and row.
type VariantOf<'p> = ((&'p str, &'p str), &'p (String, Value));

/// A policy's backend as a path routes to it: its name ([`variant_name`]), the policy's row
/// and the `origin` of the Ingress whose annotations it applies.
type Variant = (String, Value, Value);

/// At most this many changed Ingresses and Services are patched into the routed ports
/// ([`RoutedState::patch`]); after more, they are computed afresh.
const ROUTED_PATCH_LEN: usize = 64;

/// What one of our Ingresses adds to the routed ports, in the order [`routed_state`] adds it
/// (its paths, then the paths of its passthrough hosts), kept so that after an Ingress or
/// Service event only the Ingresses it touches are resolved again ([`RoutedState::patch`]).
#[derive(Debug, Clone, Default)]
struct RoutedShare {
    /// The Services its paths name (in its namespace), once each, resolved or not: a change
    /// of one of them resolves this Ingress again.
    names: Vec<String>,
    /// Per path that resolves: its Service (an index in `names`), the port number, and the
    /// policy backend it routes to (none: the port's own backend).
    ports: Vec<(usize, i64, Option<Variant>)>,
    /// Whether the routed ports depend on this Ingress together with others, so that only a
    /// computation over all of them is sure: a canary (it takes its main route's policy),
    /// an Ingress with a path on a canary's route (it may be that main), or one with a
    /// default backend (the oldest wins).
    entangled: bool,
}

/// The routed ports of a `routedBy` view, and what each Ingress contributed to them: after a
/// few Ingress or Service events, only the Ingresses they touch are resolved again, and only
/// the Services those route to are summed up again (at 10,000 Ingresses, computing them all
/// was about half of the refresh after one event).
#[derive(Debug, Clone, Default)]
struct RoutedState {
    /// The generations of the Ingresses, Services (and IngressClasses) they are of.
    built_from: Vec<u64>,
    routed: Routed,
    /// Our Ingresses' contributions: namespace -> name -> contribution. The Ingresses that
    /// name a Service are found among those of its namespace, where a path can name it (an
    /// index by Service cost more to build and drop, when all are computed afresh, than
    /// looking through one namespace after an event).
    contributions: HashMap<String, HashMap<String, RoutedShare>>,
    /// The default backend that routes (the first candidate, when it is a Service's): its
    /// namespace, the Service it names and the port number it resolves to.
    default: Option<(String, String, Option<i64>)>,
    /// The routes of the canaries' paths ([`CanaryRoutes`]): a change of an Ingress with a
    /// path on one of them may change a canary's policy.
    canary_routes: CanaryRoutes,
}

/// Routes ([`route_key`]) by host: the paths, and whether they are Exact. Looked up by
/// `&str`, without allocating a key for each path.
type CanaryRoutes = HashMap<String, Vec<(bool, String)>>;

/// Whether a path is on one of `routes`.
fn on_route(routes: &CanaryRoutes, p: &PathExtract) -> bool {
    let (exact, host, path) = route_key(p);
    routes
        .get(host)
        .is_some_and(|paths| paths.iter().any(|(e, p)| (*e, p.as_str()) == (exact, path)))
}

/// The ports of a Service in `routed`, made empty if it had none (without allocating the
/// keys when it has: most paths route to a port already seen).
fn ports_mut<'r>(
    routed: &'r mut Routed,
    namespace: &str,
    service: &str,
) -> Option<&'r mut Vec<RoutedPort>> {
    if !routed.contains_key(namespace) {
        routed.insert(namespace.to_owned(), HashMap::default());
    }
    let services = routed.get_mut(namespace)?;
    if !services.contains_key(service) {
        services.insert(service.to_owned(), Vec::new());
    }
    services.get_mut(service)
}

/// Adds a path's port to its Service's routed ports: a port number not seen yet goes last;
/// a path without a policy makes the port's own backend written; a policy's backend is added
/// once, with the row and origin of the first path that routes to it.
fn fold(ports: &mut Vec<RoutedPort>, number: i64, variant: Option<&Variant>) {
    let i = match ports.iter().position(|p| p.number == number) {
        Some(i) => i,
        None => {
            ports.push(RoutedPort {
                number,
                plain: false,
                variants: Vec::new(),
            });
            ports.len() - 1
        }
    };
    let Some(routed_port) = ports.get_mut(i) else {
        return;
    };
    match variant {
        None => routed_port.plain = true,
        Some(variant) => {
            if !routed_port.variants.iter().any(|(n, _, _)| *n == variant.0) {
                routed_port.variants.push(variant.clone());
            }
        }
    }
}

/// What `ing` adds to the routed ports ([`RoutedShare`]), its Services looked up with
/// `lookup` (namespace, name). `mains` is needed only for a canary (none: no Ingress is one).
fn contribution<'s, 'a>(
    store: &str,
    ing: &OurIngress<'a>,
    mains: Option<&CanaryMains<'_, 'a>>,
    canary_routes: &CanaryRoutes,
    lookup: &impl Fn(&str, &str) -> Option<&'s ServiceExtract>,
) -> RoutedShare {
    let near_canary = || {
        !canary_routes.is_empty() && ing.ingress.paths.iter().any(|p| on_route(canary_routes, p))
    };
    let mut made = RoutedShare {
        entangled: ing.ingress.canary || ing.ingress.default_backend.is_some() || near_canary(),
        ..RoutedShare::default()
    };
    // The origin of this Ingress's own policies, made once.
    let mut own_origin: Option<Value> = None;
    let mut add = |target: &ServiceRef, policy: Option<VariantOf<'_>>| {
        let service = match made.names.iter().position(|n| *n == target.service) {
            Some(i) => i,
            None => {
                made.names.push(target.service.clone());
                made.names.len() - 1
            }
        };
        let Some(port) = lookup(ing.namespace, &target.service).and_then(|s| s.resolve(target))
        else {
            return;
        };
        let variant = policy.map(|((namespace, name), (id, row))| {
            let origin = if (namespace, name) == (ing.namespace, ing.name) {
                own_origin
                    .get_or_insert_with(|| origin(store, namespace, name))
                    .clone()
            } else {
                origin(store, namespace, name)
            };
            (variant_name(&port.backend, id), row.clone(), origin)
        });
        made.ports.push((service, port.number, variant));
    };
    for p in &ing.ingress.paths {
        // A canary's path whose main route has a policy: the canary's port with that policy
        // (its rules are the main Ingress's, so its origin is the main Ingress).
        let policy = match mains.and_then(|m| m.policy_for(ing, p)) {
            Some((main, policy)) => Some(((main.namespace, main.name), policy)),
            None => p
                .policy
                .as_ref()
                .map(|policy| ((ing.namespace, ing.name), policy)),
        };
        add(&p.target, policy);
    }
    if !ing.ingress.passthrough.is_empty() {
        // Made only for an Ingress that asks for it: the row is built afresh each time.
        let passthrough = (
            PASSTHROUGH.to_owned(),
            crate::nginx::Policy::passthrough_row(),
        );
        for (_, i) in &ing.ingress.passthrough {
            if let Some(p) = ing.ingress.paths.get(*i) {
                add(&p.target, Some(((ing.namespace, ing.name), &passthrough)));
            }
        }
    }
    made
}

/// The routed ports over all our Ingresses of `ingresses`, with (when `keep`) what each
/// contributed, for [`RoutedState::patch`].
fn routed_state(
    (store, ingresses): (&str, Source<'_>),
    services: Source<'_>,
    ours: &Ours<'_>,
    keep: bool,
) -> RoutedState {
    let by_name = services_by_name(services);
    let lookup = |namespace: &str, name: &str| by_name.get(&(namespace, name)).map(|(s, _)| *s);
    let ours = ours.of(ingresses);
    let mains = canary_mains(&ours);
    let mut state = RoutedState::default();
    if mains.is_some() {
        for p in ours
            .iter()
            .filter(|ing| ing.ingress.canary)
            .flat_map(|ing| &ing.ingress.paths)
        {
            let (exact, host, path) = route_key(p);
            state
                .canary_routes
                .entry(host.to_owned())
                .or_default()
                .push((exact, path.to_owned()));
        }
    }
    for ing in &ours {
        let made = contribution(store, ing, mains.as_ref(), &state.canary_routes, &lookup);
        for (service, number, variant) in &made.ports {
            let ports = made
                .names
                .get(*service)
                .and_then(|service| ports_mut(&mut state.routed, ing.namespace, service));
            if let Some(ports) = ports {
                fold(ports, *number, variant.as_ref());
            }
        }
        if keep {
            if !state.contributions.contains_key(ing.namespace) {
                state
                    .contributions
                    .insert(ing.namespace.to_owned(), HashMap::default());
            }
            if let Some(names) = state.contributions.get_mut(ing.namespace) {
                names.insert(ing.name.to_owned(), made);
            }
        }
    }
    if let Some((ing, DefaultBackendExtract::Service(target))) =
        default_backend_candidates(&ours).first()
    {
        let number = lookup(ing.namespace, &target.service)
            .and_then(|s| s.resolve(target))
            .map(|port| port.number);
        if let Some(number) = number
            && let Some(ports) = ports_mut(&mut state.routed, ing.namespace, &target.service)
        {
            fold(ports, number, None);
        }
        state.default = Some((ing.namespace.to_owned(), target.service.clone(), number));
    }
    state
}

/// The routed ports over all our Ingresses of `ingresses`.
fn routed_ports(ingresses: (&str, Source<'_>), services: Source<'_>, ours: &Ours<'_>) -> Routed {
    routed_state(ingresses, services, ours, false).routed
}

/// The contribution kept for an Ingress.
fn kept<'c>(
    contributions: &'c HashMap<String, HashMap<String, RoutedShare>>,
    namespace: &str,
    name: &str,
) -> Option<&'c RoutedShare> {
    contributions
        .get(namespace)
        .and_then(|names| names.get(name))
}

impl RoutedState {
    /// Our Ingresses of `namespace` whose paths name `service` (resolved or not), in no order.
    fn users<'s>(
        &'s self,
        namespace: &str,
        service: &'s str,
    ) -> impl Iterator<Item = (&'s String, &'s RoutedShare)> + 's {
        self.contributions
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(move |(_, c)| c.names.iter().any(|name| name == service))
    }

    /// Brings the routed ports up to date with `ingresses` and `services` (generations
    /// `from`, the IngressClasses' unchanged) by resolving again only the Ingresses changed
    /// since and those whose paths name a Service changed since, then adding up again only
    /// the Services those route to (before or after), from every contribution to them in
    /// the order [`routed_state`] adds them: the same routed ports as computed afresh.
    ///
    /// Returns the Services whose routed ports changed; `None`, with nothing changed, when
    /// it cannot be sure: the stores do not remember their changes back that far, there are
    /// more than [`ROUTED_PATCH_LEN`], or one of the Ingresses to resolve again is entangled
    /// with others ([`RoutedShare::entangled`], before or after), or a changed Service is
    /// the default backend's.
    fn patch(
        &mut self,
        (store, ingresses): (&str, &Store),
        services: &Store,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> Option<BTreeSet<(String, String)>> {
        let (Some(&ingresses_from), Some(&services_from)) =
            (self.built_from.first(), self.built_from.get(1))
        else {
            return None;
        };
        let changed_ingresses = ingresses.changes_since(ingresses_from)?;
        let changed_services = services.changes_since(services_from)?;
        if changed_ingresses.len() + changed_services.len() > ROUTED_PATCH_LEN {
            return None;
        }
        // The Ingresses to resolve again: changed, or naming a changed Service.
        let mut again: BTreeSet<(String, String)> = BTreeSet::new();
        again.extend(changed_ingresses.into_iter().cloned());
        for (namespace, service) in changed_services {
            if self
                .default
                .as_ref()
                .is_some_and(|(n, s, _)| (n, s) == (namespace, service))
            {
                return None;
            }
            for (name, _) in self.users(namespace, service) {
                again.insert((namespace.clone(), name.clone()));
            }
        }
        let lookup = |namespace: &str, name: &str| {
            services
                .get_entry(namespace, name)
                .map(|(svc, extracts)| extracts.service(namespace, name, svc))
        };
        // Every check before any change: a `None` leaves the state as it was.
        let mut made = Vec::with_capacity(again.len());
        for (namespace, name) in &again {
            if kept(&self.contributions, namespace, name).is_some_and(|c| c.entangled) {
                return None;
            }
            let now = ingresses
                .get_entry(namespace, name)
                .and_then(|(value, extracts)| {
                    let ingress = extracts.ingress(value);
                    ours.accepts(ingress).then_some(OurIngress {
                        namespace,
                        name,
                        value,
                        extracts,
                        ingress,
                    })
                })
                // Not entangled: no canary, so no main route to join.
                .map(|ing| contribution(store, &ing, None, &self.canary_routes, &lookup));
            if now.as_ref().is_some_and(|c| c.entangled) {
                return None;
            }
            made.push(now);
        }
        // The Services whose ports a path of them resolved to, before or after.
        let mut touched: BTreeSet<(String, String)> = BTreeSet::new();
        for ((namespace, name), now) in again.into_iter().zip(made) {
            let before = self
                .contributions
                .get_mut(&namespace)
                .and_then(|names| names.remove(&name));
            for c in before.iter().chain(&now) {
                for (service, _, _) in &c.ports {
                    if let Some(service) = c.names.get(*service) {
                        touched.insert((namespace.clone(), service.clone()));
                    }
                }
            }
            if let Some(now) = now {
                self.contributions
                    .entry(namespace)
                    .or_default()
                    .insert(name, now);
            }
        }
        let mut dirty = BTreeSet::new();
        for (namespace, service) in touched {
            let mut ports = Vec::new();
            let mut users: Vec<(&String, &RoutedShare)> =
                self.users(&namespace, &service).collect();
            // In the order a computation over all of them meets them.
            users.sort_unstable_by_key(|(name, _)| *name);
            for (_, c) in users {
                for (_, number, variant) in c
                    .ports
                    .iter()
                    .filter(|(i, _, _)| c.names.get(*i) == Some(&service))
                {
                    fold(&mut ports, *number, variant.as_ref());
                }
            }
            if let Some((_, _, Some(number))) = self
                .default
                .as_ref()
                .filter(|(n, s, _)| (n, s) == (&namespace, &service))
            {
                fold(&mut ports, *number, None);
            }
            let before = self.routed.get(&namespace).and_then(|s| s.get(&service));
            if before.map_or(ports.is_empty(), |before| *before == ports) {
                continue;
            }
            if ports.is_empty() {
                if let Some(services) = self.routed.get_mut(&namespace) {
                    services.remove(&service);
                    if services.is_empty() {
                        self.routed.remove(&namespace);
                    }
                }
            } else {
                self.routed
                    .entry(namespace.clone())
                    .or_default()
                    .insert(service.clone(), ports);
            }
            dirty.insert((namespace, service));
        }
        self.built_from = from;
        Some(dirty)
    }
}

fn routed_port<'r>(
    routed: &'r Routed,
    namespace: &str,
    service: &str,
    port: i64,
) -> Option<&'r RoutedPort> {
    routed
        .get(namespace)
        .and_then(|services| services.get(service))
        .and_then(|ports| ports.iter().find(|p| p.number == port))
}

/// Each Service's extract (and extracts, for joins) by (namespace, name).
fn services_by_name(
    services: Source<'_>,
) -> HashMap<(&str, &str), (&ServiceExtract, &Arc<Extracts>)> {
    services
        .entries()
        .map(|((namespace, name), svc, extracts)| {
            (
                (namespace.as_str(), name.as_str()),
                (extracts.service(namespace, name, svc), extracts),
            )
        })
        .collect()
}

/// Where a row comes from, as the `from` filter takes it: `[store, namespace, name]`.
fn origin(store: &str, namespace: &str, name: &str) -> Value {
    Value::from(vec![
        Value::from(store),
        Value::from(namespace),
        Value::from(name),
    ])
}

fn service_backends(
    slot: Slot,
    (store, services): (&str, Source<'_>),
    slices: Source<'_>,
    routed: Option<&Routed>,
) -> Value {
    // The slices of each Service, in the store's (namespace, name) order.
    let mut by_service: HashMap<(&str, &str), Vec<&Arc<Extracts>>> = HashMap::default();
    for ((namespace, _), slice, extracts) in slices.entries() {
        let service = extracts.slice(slice).service.as_str();
        if !service.is_empty() {
            by_service
                .entry((namespace.as_str(), service))
                .or_default()
                .push(extracts);
        }
    }
    let mut rows = Vec::with_capacity(services.len() * 2);
    for ((namespace, service), svc, extracts) in services.entries() {
        let slices: &[&Arc<Extracts>] = by_service
            .get(&(namespace.as_str(), service.as_str()))
            .map_or(&[][..], Vec::as_slice);
        service_rows(
            slot,
            (store, namespace, service),
            (svc, extracts),
            slices,
            routed,
            &mut rows,
        );
    }
    Value::from(rows)
}

/// Appends the rows of one Service (`svc`, with its `extracts`) joined with its EndpointSlices
/// (whose slice extracts are made), in the order [`service_backends`] writes them.
fn service_rows(
    slot: Slot,
    (store, namespace, service): (&str, &str, &str),
    (svc, extracts): (&Stored, &Arc<Extracts>),
    slices: &[&Arc<Extracts>],
    routed: Option<&Routed>,
    rows: &mut Vec<Value>,
) {
    let extract = extracts.service(namespace, service, svc);
    let (ports, cluster_ip) = (&extract.ports, extract.cluster_ip.as_deref());
    // A row per port, in port order: row `i` is port `i`'s.
    let keep = |i: usize| match (&routed, ports.get(i)) {
        (None, _) => true,
        (Some(routed), Some(port)) => {
            routed_port(routed, namespace, service, port.number).is_some()
        }
        (Some(_), None) => false,
    };
    let first = rows.len();
    extracts.rows_into_if(
        slot,
        slices.iter().map(|e| Some(*e)),
        rows,
        || {
            let origin = origin(store, namespace, service);
            let created = extract.created.clone();
            ports
                .iter()
                .map(|port| {
                    let mut matching = slices
                        .iter()
                        // Extracted while grouping above.
                        .filter_map(|e| e.slice.get().map(|s| &**s))
                        .flat_map(|slice| slice.ports.iter())
                        .filter(|(name, _)| *name == port.name)
                        .map(|(_, endpoints)| endpoints);
                    // One slice per Service is the common case: share its rows as they are.
                    let endpoints = match (matching.next(), matching.next()) {
                        (None, _) => Value::from(Vec::<Value>::new()),
                        (Some(only), None) => only.clone(),
                        (Some(first), Some(second)) => {
                            let mut all: Vec<Value> = Vec::new();
                            for endpoints in [first, second].into_iter().chain(matching) {
                                all.extend(
                                    endpoints.as_array().unwrap_or_default().iter().cloned(),
                                );
                            }
                            Value::from(all)
                        }
                    };
                    row([
                        ("name", port.backend.clone()),
                        ("endpoints", endpoints),
                        ("app_protocol", port.app_protocol.clone()),
                        ("namespace", Value::from(namespace)),
                        ("service", Value::from(service)),
                        ("port", Value::from(port.number)),
                        ("port_name", Value::from(port.name.as_str())),
                        ("created", created.clone()),
                        ("origin", origin.clone()),
                        ("policy", Value::none()),
                    ])
                })
                .collect()
        },
        keep,
    );
    // The backends of ingress-nginx policies: a copy of the port's row each, under its
    // own name; the port's own row only when a path without a policy routes to it.
    let Some(routed) = routed else { return };
    let ported = |row: &Value| {
        attr(row, "port")
            .and_then(|p| integer(Some(p)))
            .and_then(|p| routed_port(routed, namespace, service, p))
    };
    let Some(added) = rows.get(first..) else {
        return;
    };
    if added
        .iter()
        .all(|row| ported(row).is_none_or(|p| p.plain && p.variants.is_empty()))
    {
        return;
    }
    let added: Vec<Value> = rows.drain(first..).collect();
    for base in added {
        let Some(port) = ported(&base) else { continue };
        if port.plain {
            rows.push(base.clone());
        }
        for (name, policy, origin) in &port.variants {
            let mut map = base.as_map().cloned().unwrap_or_default();
            // ingress-nginx's service-upstream: the Service's cluster IP, not its endpoints.
            if let (Some(ip), Some(true)) = (
                cluster_ip,
                attr(policy, "service_upstream").and_then(Value::as_bool),
            ) {
                map.insert(
                    Key::Str("endpoints"),
                    Value::from(vec![cluster_ip_row(ip, port.number)]),
                );
            }
            map.insert(Key::Str("name"), Value::from(name.as_str()));
            map.insert(Key::Str("policy"), policy.clone());
            map.insert(Key::Str("origin"), origin.clone());
            rows.push(Value::from(map));
        }
    }
}

/// Which value of a route would end a map key (the rule's `host`, else the path's `path`):
/// the template refuses the Ingress for it (`unsafe`, empty when neither).
fn unsafe_field(p: &PathExtract) -> &'static str {
    let not_token = |v: &Value| v.as_str().is_some_and(|t| !functions::is_config_token(t));
    if not_token(&p.host) {
        "host"
    } else if not_token(&p.path) {
        "path"
    } else {
        ""
    }
}

/// The key of a route's line in its map (`map_key`): the host (`*` for none) and the path
/// (Exact), or the path without its trailing `/`s and with one `/` (Prefix, looked up with
/// `map_beg` on the request's path with a `/` appended); none when the route writes no line
/// whatever the claims: no backend, a regex path (routes-regex.map) or a canary's path, a host
/// that is neither a plain name nor a wildcard, a path that is not a plain absolute path, or
/// a value that would end the key ([`unsafe_field`]).
fn map_key(p: &PathExtract, backend: &Value, canary: bool) -> Value {
    let host = match p.host.as_str() {
        _ if p.host.is_none() => "",
        Some(h) if h.is_empty() || functions::is_hostname(h) || functions::is_wildcard_host(h) => h,
        _ => return Value::none(),
    };
    let routable = backend.is_truthy()
        && !p.regex
        && !canary
        && unsafe_field(p).is_empty()
        && p.path.as_str().is_some_and(functions::is_http_path);
    let Some(path) = p.path.as_str().filter(|_| routable) else {
        return Value::none();
    };
    let host = if host.is_empty() { "*" } else { host };
    if p.exact {
        Value::from(format!("{host}{path}"))
    } else {
        Value::from(format!("{host}{}/", path.trim_end_matches('/')))
    }
}

fn ingress_routes(
    slot: Slot,
    (store, ingresses): (&str, Source<'_>),
    services: Source<'_>,
    exact: Option<bool>,
    ours: &Ours<'_>,
) -> Value {
    let by_name = services_by_name(services);
    let ours = ours.of(ingresses);
    // Who claims each route: the oldest Ingress.
    let mut claims = Claims::with_capacity(ours.len() * 2);
    for ing in ours.iter().filter(|ing| !ing.ingress.canary) {
        let age = ing.age();
        for p in ing.ingress.paths.iter().filter(|p| route_kind(exact, p)) {
            claims.claim(route_key(p), age);
        }
    }
    let lookup = |namespace: &str, service: &str| by_name.get(&(namespace, service)).copied();
    let mut rows = Vec::with_capacity(ours.len() * 2);
    for ing in &ours {
        let age = ing.age();
        let lost = |p: &PathExtract| claims.lost_to(&route_key(p), &age);
        route_rows(
            slot,
            store,
            ing,
            exact,
            &lookup,
            claims.contested.then_some(&lost),
            &mut rows,
        );
    }
    Value::from(rows)
}

/// Whether a path is of the kind a routes view lists (`exact`: Exact paths, or the others;
/// none: all).
fn route_kind(exact: Option<bool>, p: &PathExtract) -> bool {
    exact.is_none_or(|exact| p.exact == exact)
}

/// The Ingress that won a path's route from the Ingress whose rows are written, if one did.
type LostTo<'a> = dyn Fn(&PathExtract) -> Option<String> + 'a;

/// Appends the rows of one of our Ingresses to a routes view: its paths of the view's kind,
/// each joined with the Service port it names (`lookup`), and marked with the Ingress that
/// won its route from this one (`lost`, when some route is contested at all).
fn route_rows<'s>(
    slot: Slot,
    store: &str,
    ing: &OurIngress<'_>,
    exact: Option<bool>,
    lookup: &impl Fn(&str, &str) -> Option<(&'s ServiceExtract, &'s Arc<Extracts>)>,
    lost: Option<&LostTo<'_>>,
    rows: &mut Vec<Value>,
) {
    let namespace = ing.namespace;
    let paths = &ing.ingress.paths;
    let resolved: Vec<Option<(&ServiceExtract, &Arc<Extracts>)>> = paths
        .iter()
        .map(|p| lookup(namespace, p.target.service.as_str()))
        .collect();
    let joined = resolved.iter().map(|r| r.map(|(_, e)| e));
    // The cached rows are every path's (views of either kind share them); row `i` is path
    // `i`'s.
    let keep = |i: usize| paths.get(i).is_some_and(|p| route_kind(exact, p));
    let first = rows.len();
    ing.extracts.rows_into_if(
        slot,
        joined,
        rows,
        || {
            let origin = origin(store, namespace, ing.name);
            paths
                .iter()
                .zip(&resolved)
                .map(|(p, svc)| {
                    let port = svc.and_then(|(svc, _)| svc.resolve(&p.target));
                    let (port, backend) = match (port, &p.policy) {
                        (Some(port), None) => (Value::from(port.number), port.backend.clone()),
                        (Some(port), Some((id, _))) => (
                            Value::from(port.number),
                            Value::from(variant_name(&port.backend, id)),
                        ),
                        (None, _) => (Value::none(), Value::none()),
                    };
                    let key = map_key(p, &backend, ing.ingress.canary);
                    row([
                        ("backend", backend),
                        ("path_type", p.path_type.clone()),
                        ("host", p.host.clone()),
                        ("path", p.path.clone()),
                        ("conflict", Value::none()),
                        ("namespace", Value::from(namespace)),
                        ("ingress", Value::from(ing.name)),
                        ("service", Value::from(p.target.service.as_str())),
                        ("port", port),
                        (
                            "external_name",
                            Value::from(svc.is_some_and(|(svc, _)| svc.external_name)),
                        ),
                        ("origin", origin.clone()),
                        ("regex", Value::from(p.regex)),
                        ("canary", Value::from(ing.ingress.canary)),
                        (
                            "host_pattern",
                            if p.regex {
                                Value::from(host_pattern(p.host.as_str().unwrap_or_default()))
                            } else {
                                Value::none()
                            },
                        ),
                        ("unsafe", Value::from(unsafe_field(p))),
                        ("map_key", key),
                    ])
                })
                .collect()
        },
        keep,
    );
    if let Some(lost) = lost.filter(|_| !ing.ingress.canary) {
        let kept = paths.iter().filter(|p| route_kind(exact, p));
        for (row, p) in rows
            .get_mut(first..)
            .unwrap_or_default()
            .iter_mut()
            .zip(kept)
        {
            if let Some(winner) = lost(p) {
                *row = with_field(row, "conflict", Value::from(winner));
            }
        }
    }
}

fn ingress_tls(
    slot: Slot,
    (store, ingresses): (&str, Source<'_>),
    secrets: Source<'_>,
    ours: &Ours<'_>,
) -> Value {
    let ours = ours.of(ingresses);
    let (claims, passing) = tls_host_claims(&ours);
    let mut rows = Vec::new();
    for ing in &ours {
        let age = ing.age();
        let lost = |host: &str| {
            let winner = claims.lost_to(&host, &age)?;
            let passthrough = passing.contains(&(host, winner.clone()));
            Some((winner, passthrough))
        };
        tls_rows(
            slot,
            store,
            ing,
            secrets,
            claims.contested.then_some(&lost),
            &mut rows,
        );
    }
    Value::from(rows)
}

/// The Ingress that won a TLS host from the Ingress whose rows are written, and whether it
/// passes the host's connections through, if one did.
type HostLostTo<'a> = dyn Fn(&str) -> Option<(String, bool)> + 'a;

/// Appends the TLS rows of one of our Ingresses: an entry each, joined with its Secret's
/// verdict, its hosts that another Ingress won (`lost`, when some host is contested at all)
/// moved to `conflicts`.
fn tls_rows(
    slot: Slot,
    store: &str,
    ing: &OurIngress<'_>,
    secrets: Source<'_>,
    lost: Option<&HostLostTo<'_>>,
    rows: &mut Vec<Value>,
) {
    let (namespace, ingress) = (ing.namespace, ing.name);
    let entries = ing.extracts.tls(ing.value);
    if entries.is_empty() {
        return;
    }
    let found: Vec<Option<(&Verdict, &Arc<Extracts>)>> = entries
        .iter()
        .map(|tls| {
            if tls.secret.is_empty() {
                return None;
            }
            let (secret, extracts) = secrets.get_entry(namespace, &tls.secret)?;
            Some((extracts.certificate(secret), extracts))
        })
        .collect();
    let joined = found.iter().map(|f| f.map(|(_, e)| e));
    let first = rows.len();
    ing.extracts.rows_into(slot, joined, rows, || {
        let origin = origin(store, namespace, ingress);
        // ingress-nginx's auth-tls-secret: the Secret whose CA verifies clients, or "".
        let client_ca = Value::from(functions::nginx_client_ca(&ing.value.get()));
        entries
            .iter()
            .zip(&found)
            .map(|(tls, found)| {
                let reason = match found {
                    _ if tls.secret.is_empty() => "the TLS entry names no Secret".to_owned(),
                    None => "the Secret does not exist".to_owned(),
                    Some((Ok(_), _)) => String::new(),
                    Some((Err(unusable), _)) => unusable.to_string(),
                };
                row([
                    ("usable", Value::from(reason.is_empty())),
                    ("reason", Value::from(reason)),
                    ("file", Value::from(ssl_file(namespace, &tls.secret))),
                    ("hosts", tls.hosts.clone()),
                    ("conflicts", Value::from(Vec::<Value>::new())),
                    ("ssl_redirect", Value::from(ing.ingress.ssl_redirect)),
                    ("namespace", Value::from(namespace)),
                    ("ingress", Value::from(ingress)),
                    ("secret", Value::from(tls.secret.as_str())),
                    ("origin", origin.clone()),
                    ("client_ca", client_ca.clone()),
                ])
            })
            .collect()
    });
    let Some(lost) = lost else { return };
    for (entry_row, tls) in rows
        .get_mut(first..)
        .unwrap_or_default()
        .iter_mut()
        .zip(entries)
    {
        let mut kept = Vec::new();
        let mut taken = Vec::new();
        for host in tls.hosts.as_array().unwrap_or_default() {
            match host.as_str().and_then(lost) {
                Some((winner, passthrough)) => taken.push(row([
                    ("host", host.clone()),
                    ("winner", Value::from(winner.as_str())),
                    ("passthrough", Value::from(passthrough)),
                ])),
                None => kept.push(host.clone()),
            }
        }
        if !taken.is_empty() {
            let changed = with_field(entry_row, "hosts", Value::from(kept));
            *entry_row = with_field(&changed, "conflicts", Value::from(taken));
        }
    }
}

/// Who claims each host for ssl-passthrough, when an Ingress asks for it: the oldest Ingress
/// that routes the host (a rule, or a server-alias; canaries do not claim), names it in a TLS
/// section, or passes it through. A passthrough takes every connection to the host that
/// carries its SNI, so it must not take a host another, older Ingress already serves (nor,
/// for a wildcard, a host one label under it: [`Claims::passthrough_lost_to`]). None when no
/// Ingress asks for passthrough.
fn passthrough_claims<'a>(ours: &[OurIngress<'a>]) -> Option<Claims<'a, &'a str>> {
    if ours.iter().all(|ing| ing.ingress.passthrough.is_empty()) {
        return None;
    }
    let mut claims = Claims::with_capacity(ours.len());
    for ing in ours {
        let age = ing.age();
        for tls in ing.extracts.tls(ing.value) {
            for host in tls.hosts.as_array().unwrap_or_default() {
                if let Some(host) = host.as_str().filter(|h| !h.is_empty()) {
                    claims.claim(host, age);
                }
            }
        }
        if !ing.ingress.canary {
            for p in &ing.ingress.paths {
                if let Some(host) = p.host.as_str().filter(|h| !h.is_empty()) {
                    claims.claim(host, age);
                }
            }
        }
        for (host, _) in &ing.ingress.passthrough {
            if let Some(host) = host.as_str() {
                claims.claim(host, age);
            }
        }
    }
    Some(claims)
}

/// Who claims each TLS host: the oldest of the Ingresses that name it in a TLS section or
/// pass its TLS connections through (a passthrough that won its host, [`passthrough_claims`]);
/// and the (host, `namespace/name`) of each such passthrough, to tell what a winner does
/// with the host. Without passthrough, the TLS sections alone.
fn tls_host_claims<'a>(
    ours: &[OurIngress<'a>],
) -> (Claims<'a, &'a str>, HashSet<(&'a str, String)>) {
    let mut claims = Claims::with_capacity(ours.len() / 2);
    for ing in ours {
        let age = ing.age();
        for tls in ing.extracts.tls(ing.value) {
            for host in tls.hosts.as_array().unwrap_or_default() {
                if let Some(host) = host.as_str().filter(|h| !h.is_empty()) {
                    claims.claim(host, age);
                }
            }
        }
    }
    let mut passing = HashSet::default();
    if let Some(passthrough) = passthrough_claims(ours) {
        for ing in ours {
            let age = ing.age();
            for (host, _) in &ing.ingress.passthrough {
                if let Some(host) = host
                    .as_str()
                    .filter(|h| passthrough.passthrough_lost_to(h, &age).is_none())
                {
                    claims.claim(host, age);
                    passing.insert((host, owner(&age)));
                }
            }
        }
    }
    (claims, passing)
}

/// The rows of [`Derivation::IngressPassthrough`]: a row per passthrough host of each of our
/// Ingresses that asks for it, in Ingress order.
fn passthrough_rows(
    (store, ingresses): (&str, Source<'_>),
    services: Source<'_>,
    ours: &Ours<'_>,
) -> Value {
    // Most clusters have none: a look at each Ingress's extract, without collecting ours.
    let any = ingresses
        .entries()
        .any(|(_, ing, extracts)| !extracts.ingress(ing).passthrough.is_empty());
    let ours = if any { ours.of(ingresses) } else { Vec::new() };
    let Some(claims) = passthrough_claims(&ours) else {
        return Value::from(Vec::<Value>::new());
    };
    let mut rows = Vec::new();
    for ing in ours
        .iter()
        .filter(|ing| !ing.ingress.passthrough.is_empty())
    {
        let (namespace, age) = (ing.namespace, ing.age());
        for (host, i) in &ing.ingress.passthrough {
            let Some(p) = ing.ingress.paths.get(*i) else {
                continue;
            };
            let service = p.target.service.as_str();
            let port = services
                .get_entry(namespace, service)
                .map(|(svc, extracts)| extracts.service(namespace, service, svc))
                .and_then(|svc| svc.resolve(&p.target));
            let conflict = host
                .as_str()
                .and_then(|h| claims.passthrough_lost_to(h, &age))
                .map_or_else(Value::none, Value::from);
            rows.push(row([
                ("host", host.clone()),
                (
                    "backend",
                    port.map_or_else(Value::none, |port| {
                        Value::from(variant_name(&port.backend, PASSTHROUGH))
                    }),
                ),
                ("conflict", conflict),
                ("namespace", Value::from(namespace)),
                ("ingress", Value::from(ing.name)),
                ("service", Value::from(service)),
                ("path", p.path.clone()),
                ("origin", origin(store, namespace, ing.name)),
            ]));
        }
    }
    Value::from(rows)
}

fn ingress_rows(slot: Slot, ingresses: Source<'_>, ours: &Ours<'_>, whole: bool) -> Value {
    let ours = ours.of(ingresses);
    let mut rows = Vec::with_capacity(ours.len());
    for ing in &ours {
        ingress_row(slot, ing, whole, &mut rows);
    }
    Value::from(rows)
}

/// Appends the row of one of our Ingresses to the `Ingresses` view (with the whole Ingress
/// when `whole`).
fn ingress_row(slot: Slot, ing: &OurIngress<'_>, whole: bool, rows: &mut Vec<Value>) {
    ing.extracts.rows_into(slot, std::iter::empty(), rows, || {
        let value = ing.value.get();
        let reference = object_ref(&value);
        let row = if whole {
            row([
                ("namespace", Value::from(ing.namespace)),
                ("name", Value::from(ing.name)),
                ("ref", reference),
                ("object", value.into_owned()),
            ])
        } else {
            row([
                ("namespace", Value::from(ing.namespace)),
                ("name", Value::from(ing.name)),
                ("ref", reference),
            ])
        };
        vec![row]
    });
}

/// What `set_status(object=)` and `record_event(object=)` read of a resource: `apiVersion`,
/// `kind` and `metadata`'s `namespace`, `name` and `uid` (those it has).
fn object_ref(object: &Value) -> Value {
    let mut metadata = Map::with_capacity(3);
    for key in ["namespace", "name", "uid"] {
        if let Some(value) = path(object, &["metadata", key]).filter(|v| !v.is_none()) {
            metadata.insert(Key::Str(key), value.clone());
        }
    }
    let mut map = Map::with_capacity(3);
    for key in ["apiVersion", "kind"] {
        if let Some(value) = attr(object, key).filter(|v| !v.is_none()) {
            map.insert(Key::Str(key), value.clone());
        }
    }
    map.insert(Key::Str("metadata"), Value::from(metadata));
    Value::from(map)
}

/// A row per Ingress that carries ingress-nginx annotations: what is not applied of them.
fn annotation_rows(slot: Slot, (store, ingresses): (&str, Source<'_>), ours: &Ours<'_>) -> Value {
    let ours = ours.of(ingresses);
    let mains = canary_mains(&ours);
    let mut rows = Vec::new();
    for ing in &ours {
        let Some(found) = &ing.ingress.nginx else {
            continue;
        };
        let text = |message: &Option<String>| Value::from(message.as_deref().unwrap_or_default());
        let first = rows.len();
        ing.extracts
            .rows_into(slot, std::iter::empty(), &mut rows, || {
                vec![row([
                    ("refused", text(&found.refused)),
                    ("not_applied", text(&found.not_applied)),
                    ("invalid", text(&found.invalid)),
                    ("canary", found.canary.clone()),
                    ("www_redirects", found.www_redirects.clone()),
                    ("namespace", Value::from(ing.namespace)),
                    ("ingress", Value::from(ing.name)),
                    ("origin", origin(store, ing.namespace, ing.name)),
                ])]
            });
        // A canary's paths whose main route has a policy get its id (`main_policy`): the
        // cached row is the Ingress's own, the join is made again on each build, and a row
        // without such a path stays the very same value.
        let Some(mains) = &mains else { continue };
        let ids: Vec<Option<&str>> = ing
            .ingress
            .paths
            .iter()
            .map(|p| mains.policy_for(ing, p).map(|(_, (id, _))| id.as_str()))
            .collect();
        if ids.iter().all(Option::is_none) {
            continue;
        }
        for annotation_row in rows.get_mut(first..).unwrap_or_default() {
            let Some(canary) = attr(annotation_row, "canary").filter(|c| !c.is_none()) else {
                continue;
            };
            let paths: Vec<Value> = list(canary, &["paths"])
                .iter()
                .zip(&ids)
                .map(|(path_row, id)| match id {
                    Some(id) => with_field(path_row, "main_policy", Value::from(*id)),
                    None => path_row.clone(),
                })
                .collect();
            let canary = with_field(canary, "paths", Value::from(paths));
            *annotation_row = with_field(annotation_row, "canary", canary);
        }
    }
    Value::from(rows)
}

/// Our Ingresses with a `spec.defaultBackend`: Service backends oldest first (the first is
/// the winner), then resource backends oldest first.
fn default_backend_candidates<'a, 'b>(
    ours: &'b [OurIngress<'a>],
) -> Vec<(&'b OurIngress<'a>, &'a DefaultBackendExtract)> {
    let mut candidates: Vec<_> = ours
        .iter()
        .filter_map(|ing| Some((ing, ing.ingress.default_backend.as_ref()?)))
        .collect();
    candidates.sort_by_key(|(ing, backend)| {
        (
            matches!(backend, DefaultBackendExtract::Resource),
            ing.age(),
        )
    });
    candidates
}

fn default_backends(ingresses: Source<'_>, services: Source<'_>, ours: &Ours<'_>) -> Value {
    let ours = ours.of(ingresses);
    let candidates = default_backend_candidates(&ours);
    let winner = candidates
        .first()
        .filter(|(_, backend)| matches!(backend, DefaultBackendExtract::Service(_)))
        .map(|(ing, _)| Value::from(owner(&ing.age())));
    let rows: Vec<Value> = candidates
        .iter()
        .enumerate()
        .map(|(i, (ing, backend))| {
            let (namespace, ingress) = (Value::from(ing.namespace), Value::from(ing.name));
            match backend {
                DefaultBackendExtract::Service(target) => {
                    let svc = services.get_entry(ing.namespace, &target.service).map(
                        |(svc, extracts)| extracts.service(ing.namespace, &target.service, svc),
                    );
                    let port = svc.and_then(|svc| svc.resolve(target));
                    let conflict = match (i, &winner) {
                        (0, _) | (_, None) => Value::none(),
                        (_, Some(winner)) => winner.clone(),
                    };
                    row([
                        (
                            "backend",
                            port.map_or_else(Value::none, |p| p.backend.clone()),
                        ),
                        ("resource", Value::from(false)),
                        ("conflict", conflict),
                        ("namespace", namespace),
                        ("ingress", ingress),
                        ("service", Value::from(target.service.as_str())),
                        (
                            "port",
                            port.map_or_else(Value::none, |p| Value::from(p.number)),
                        ),
                        (
                            "external_name",
                            Value::from(svc.is_some_and(|svc| svc.external_name)),
                        ),
                    ])
                }
                DefaultBackendExtract::Resource => row([
                    ("backend", Value::none()),
                    ("resource", Value::from(true)),
                    ("conflict", Value::none()),
                    ("namespace", namespace),
                    ("ingress", ingress),
                    ("service", Value::from("")),
                    ("port", Value::none()),
                    ("external_name", Value::from(false)),
                ]),
            }
        })
        .collect();
    Value::from(rows)
}

fn tls_certificates(slot: Slot, secrets: Source<'_>) -> Value {
    let mut map = Map::new();
    let mut rows = Vec::with_capacity(1);
    for ((namespace, name), secret, extracts) in secrets.entries() {
        // (The certificates' Secrets are listed by a per-item output: not a compact store,
        // so this reads the value the store holds.)
        if text(&secret.get(), &["type"]) != "kubernetes.io/tls" {
            continue;
        }
        rows.clear();
        extracts.rows_into(slot, std::iter::empty(), &mut rows, || {
            let (usable, reason, pem) = match extracts.certificate(secret) {
                Ok(ok) => (true, String::new(), ok.pem.clone()),
                Err(unusable) => (false, unusable.to_string(), String::new()),
            };
            vec![row([
                ("usable", Value::from(usable)),
                ("reason", Value::from(reason)),
                ("pem", Value::from(pem)),
                ("file", Value::from(ssl_file(namespace, name))),
                ("namespace", Value::from(namespace.as_str())),
                ("secret", Value::from(name.as_str())),
            ])]
        });
        if let Some(row) = rows.pop() {
            map.insert(Key::from(format!("{namespace}/{name}")), row);
        }
    }
    Value::from(map)
}

/// A derived view with its last rows, recomputed when a store it reads changed.
#[derive(Debug)]
pub(crate) struct DerivedView {
    derivation: Derivation,
    state: Mutex<ViewState>,
}

#[derive(Debug, Clone)]
struct ViewState {
    /// The input stores' generations the value was computed from.
    built_from: Option<Vec<u64>>,
    value: Value,
    /// For `routedBy`: the routed ports, and what they were computed from; shared with the
    /// copies of [`crate::Stores::excluding`] until one of them patches its own.
    routed: Option<Arc<RoutedState>>,
    /// For `ServiceBackends`: the rows of each Service, patched after a change.
    backends: Option<Backends>,
    /// For `GatewayApi`: what its own stores (not the Ingresses) resolved to, and their
    /// generations: an Ingress change decides the conflicts with Ingresses again, nothing else.
    gateway: Option<(Vec<u64>, Arc<gateway::Resolved>)>,
    /// For `IngressRoutes`, `IngressTls` and `Ingresses`: each Ingress's rows and the claims,
    /// patched after a change ([`routes::KeptRows`]); shared with the copies of
    /// [`crate::Stores::excluding`] until one of them patches.
    routes: Option<Arc<routes::KeptRows>>,
    /// For the views of a few Ingresses ([`sparse::applies`]): which Ingresses gave rows and
    /// what they joined with, so that an event touching none of them keeps the rows.
    sparse: Option<sparse::Sparse>,
}

/// The rows of a `ServiceBackends` view per Service, and which EndpointSlices join to which
/// Service: after an event only the Services it touches are joined again (the others keep
/// their rows, the very same values).
#[derive(Debug, Clone, Default)]
struct Backends {
    /// The generations of the Service and EndpointSlice stores the rows are for.
    built_from: (u64, u64),
    /// `(namespace, service)` -> its rows, in the store's order.
    rows: BTreeMap<(String, String), Vec<Value>>,
    /// `(namespace, slice)` -> the Service it names.
    slice_service: HashMap<(String, String), String>,
    /// `(namespace, service)` -> the names of its slices.
    service_slices: HashMap<(String, String), BTreeSet<String>>,
    /// The list [`Self::value_following`] gave last, and the Services whose rows changed since.
    last: Option<last::LastList>,
}

impl Backends {
    fn link(&mut self, (namespace, slice): &(String, String), service: &str) {
        self.slice_service
            .insert((namespace.clone(), slice.clone()), service.to_owned());
        self.service_slices
            .entry((namespace.clone(), service.to_owned()))
            .or_default()
            .insert(slice.clone());
    }

    /// The rows over `services` and `slices`, every Service joined.
    fn build(
        slot: Slot,
        (store, services): (&str, &Store),
        slices: &Store,
        routed: Option<&Routed>,
    ) -> Self {
        let mut built = Backends {
            built_from: (services.generation(), slices.generation()),
            ..Backends::default()
        };
        let mut by_service: HashMap<(&str, &str), Vec<&Arc<Extracts>>> = HashMap::default();
        for (key, slice, extracts) in slices.source().entries() {
            let service = extracts.slice(slice).service.as_str();
            if !service.is_empty() {
                built.link(key, service);
                by_service
                    .entry((key.0.as_str(), service))
                    .or_default()
                    .push(extracts);
            }
        }
        for (key, svc, extracts) in services.source().entries() {
            let joined = by_service
                .get(&(key.0.as_str(), key.1.as_str()))
                .map_or(&[][..], Vec::as_slice);
            let mut rows = Vec::new();
            service_rows(
                slot,
                (store, &key.0, &key.1),
                (svc, extracts),
                joined,
                routed,
                &mut rows,
            );
            built.rows.insert(key.clone(), rows);
        }
        built
    }

    /// Joins again the Services changed since the rows were built, those whose slices
    /// changed, and `dirty` (whose routed ports changed); `false` (nothing done) when the
    /// stores do not remember their changes back that far.
    fn patch(
        &mut self,
        slot: Slot,
        (store, services): (&str, &Store),
        slices: &Store,
        routed: Option<&Routed>,
        mut dirty: BTreeSet<(String, String)>,
    ) -> bool {
        let (Some(changed_services), Some(changed_slices)) = (
            services.changes_since(self.built_from.0),
            slices.changes_since(self.built_from.1),
        ) else {
            return false;
        };
        for key in changed_slices {
            if let Some(before) = self.slice_service.remove(key) {
                let owner = (key.0.clone(), before);
                if let Some(names) = self.service_slices.get_mut(&owner) {
                    names.remove(&key.1);
                    if names.is_empty() {
                        self.service_slices.remove(&owner);
                    }
                }
                dirty.insert(owner);
            }
            if let Some((slice, extracts)) = slices.get_entry(&key.0, &key.1) {
                let service = extracts.slice(slice).service.as_str();
                if !service.is_empty() {
                    self.link(key, service);
                    dirty.insert((key.0.clone(), service.to_owned()));
                }
            }
        }
        dirty.extend(changed_services.into_iter().cloned());
        for key in dirty {
            let Some((svc, extracts)) = services.get_entry(&key.0, &key.1) else {
                if let Some(gone) = self.rows.get(&key) {
                    let count = gone.len();
                    last::LastList::note(&mut self.last, &key, || count);
                    self.rows.remove(&key);
                }
                continue;
            };
            let joined: Vec<&Arc<Extracts>> = self
                .service_slices
                .get(&key)
                .into_iter()
                .flatten()
                .filter_map(|name| slices.get_entry(&key.0, name))
                .map(|(slice, extracts)| {
                    extracts.slice(slice);
                    extracts
                })
                .collect();
            let mut rows = Vec::new();
            service_rows(
                slot,
                (store, &key.0, &key.1),
                (svc, extracts),
                &joined,
                routed,
                &mut rows,
            );
            // Rows equal to those it had (a label, a slice that is not its) stay the very
            // values: the list, and the renders of it, are then reused whole.
            match self.rows.get(&key) {
                Some(had) if crate::value::all_identical(had, &rows) => {}
                had => {
                    let count = had.map_or(0, Vec::len);
                    last::LastList::note(&mut self.last, &key, || count);
                    self.rows.insert(key, rows);
                }
            }
        }
        self.built_from = (services.generation(), slices.generation());
        true
    }

    /// Every Service's rows, in (namespace, name) order: the list given last when no
    /// Service's rows changed since, else that list patched ([`last::LastList::follow`]).
    fn value_following(&mut self) -> Value {
        last::LastList::follow(&mut self.last, &self.rows, Vec::as_slice)
    }
}

/// The Services whose routed ports differ between `before` and `after`.
fn routed_changes(before: &Routed, after: &Routed) -> BTreeSet<(String, String)> {
    let mut changed = BTreeSet::new();
    for (one, other) in [(before, after), (after, before)] {
        for (namespace, services) in one {
            for (service, ports) in services {
                let there = other.get(namespace).and_then(|s| s.get(service));
                if there != Some(ports) {
                    changed.insert((namespace.clone(), service.clone()));
                }
            }
        }
    }
    changed
}

impl Clone for DerivedView {
    fn clone(&self) -> Self {
        Self {
            derivation: self.derivation.clone(),
            state: Mutex::new(self.lock().clone()),
        }
    }
}

impl DerivedView {
    pub(crate) fn new(derivation: Derivation) -> Self {
        Self {
            derivation,
            state: Mutex::new(ViewState {
                built_from: None,
                value: Value::none(),
                routed: None,
                backends: None,
                gateway: None,
                routes: None,
                sparse: None,
            }),
        }
    }

    pub(crate) fn derivation(&self) -> &Derivation {
        &self.derivation
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ViewState> {
        // A panic while computing (none is known) leaves the state of a computation that did
        // not finish: start again from nothing rather than trust it.
        self.state.lock().unwrap_or_else(|poisoned| {
            let mut state = poisoned.into_inner();
            state.built_from = None;
            state.routed = None;
            state.backends = None;
            state.gateway = None;
            state.routes = None;
            state.sparse = None;
            state
        })
    }

    /// Whether the value is up to date with these input stores.
    pub(crate) fn is_fresh(&self, inputs: &[&Store]) -> bool {
        let generations: Vec<u64> = inputs.iter().map(|s| s.generation()).collect();
        self.lock().built_from.as_ref() == Some(&generations)
    }

    /// The rows as the template value `derived.<name>`, recomputed first if an input store
    /// changed since (reusing the rows of every resource that did not change and whose joins
    /// found the same resources).
    pub(crate) fn value(&self, stores: &[&Store]) -> Value {
        let inputs: Vec<Source<'_>> = stores.iter().map(|s| s.source()).collect();
        let generations: Vec<u64> = inputs.iter().map(|s| s.generation()).collect();
        let mut state = self.lock();
        if state.built_from.as_ref() != Some(&generations) {
            let slot = Slot {
                index: self.derivation.slot(),
                keep: true,
            };
            let value = match (
                split_classes(&self.derivation, &inputs),
                stores.first().zip(stores.get(1)),
            ) {
                (
                    (Derivation::ServiceBackends { .. }, [services, _, rest @ ..], classes),
                    Some((service_store, slice_store)),
                ) => {
                    // The Services whose routed ports changed; none for "all of them".
                    let mut dirty = Some(BTreeSet::new());
                    if let (Some(ingresses), Some(ingress_store)) = (rest.first(), stores.get(2)) {
                        let from: Vec<u64> = [Some(*ingresses), Some(*services), classes]
                            .into_iter()
                            .flatten()
                            .map(|s| s.generation())
                            .collect();
                        if state
                            .routed
                            .as_ref()
                            .is_none_or(|routed| routed.built_from != from)
                        {
                            let ours = Ours::new(self.derivation.classes(), classes);
                            let store = self.derivation.ingresses().unwrap_or_default();
                            // A few Ingress or Service events: patched, when it is sure.
                            let patched = match state.routed.as_mut() {
                                Some(routed) if routed.built_from.get(2..) == from.get(2..) => {
                                    Arc::make_mut(routed).patch(
                                        (store, ingress_store),
                                        service_store,
                                        &ours,
                                        from.clone(),
                                    )
                                }
                                _ => None,
                            };
                            dirty = match patched {
                                Some(changed) => Some(changed),
                                None => {
                                    let mut now =
                                        routed_state((store, *ingresses), *services, &ours, true);
                                    now.built_from = from;
                                    let changed = state
                                        .routed
                                        .as_ref()
                                        .map(|before| routed_changes(&before.routed, &now.routed));
                                    state.routed = Some(Arc::new(now));
                                    changed
                                }
                            };
                        }
                    }
                    // Set only with `routedBy`.
                    let ViewState {
                        routed, backends, ..
                    } = &mut *state;
                    let routed = routed.as_ref().map(|routed| &routed.routed);
                    let store = (store_of(&self.derivation), *service_store);
                    let patched = match (backends.as_mut(), dirty) {
                        (Some(backends), Some(dirty)) => {
                            backends.patch(slot, store, slice_store, routed, dirty)
                        }
                        _ => false,
                    };
                    if !patched {
                        *backends = Some(Backends::build(slot, store, slice_store, routed));
                    }
                    backends
                        .as_mut()
                        .map_or_else(Value::none, Backends::value_following)
                }
                ((derivation, _, classes), _) if routes::kind_of(derivation).is_some() => {
                    let ours = Ours::new(derivation.classes(), classes);
                    let kind = routes::kind_of(derivation);
                    let joined = stores.get(1).filter(|_| kind.is_some_and(|k| k.own() == 2));
                    let kept = match (kind, stores.first()) {
                        (Some(kind), Some(ingress_store)) => {
                            let store = (store_of(derivation), *ingress_store);
                            let patched = state.routes.as_mut().is_some_and(|kept| {
                                Arc::make_mut(kept).patch(
                                    slot,
                                    store,
                                    joined.copied(),
                                    &ours,
                                    generations.clone(),
                                )
                            });
                            if !patched {
                                state.routes = routes::KeptRows::build(
                                    kind,
                                    slot,
                                    store,
                                    joined.copied(),
                                    &ours,
                                    generations.clone(),
                                )
                                .map(Arc::new);
                            }
                            // Unshared after a patch or a build: it keeps the list it gives.
                            state.routes.as_mut().map(|kept| match Arc::get_mut(kept) {
                                Some(kept) => kept.value_following(),
                                None => kept.value(),
                            })
                        }
                        _ => None,
                    };
                    // Not kept (a TLS view with passthrough): over every Ingress.
                    kept.unwrap_or_else(|| compute(&self.derivation, slot, &inputs))
                }
                ((derivation, own, classes), _)
                    if matches!(derivation, Derivation::GatewayApi { .. }) =>
                {
                    let ours = Ours::new(derivation.classes(), classes);
                    match gateway_inputs(derivation, own, ours) {
                        Some((inputs, ports, controller, side)) => {
                            // The Gateway API stores come first; the Ingresses after them.
                            let from: Vec<u64> =
                                own.iter().take(9).map(|s| s.generation()).collect();
                            let resolved = match &state.gateway {
                                Some((built, resolved)) if *built == from => Arc::clone(resolved),
                                _ => {
                                    let previous = state.gateway.as_ref().map(|(_, r)| &**r);
                                    let resolved = Arc::new(gateway::resolve(
                                        slot, &inputs, &ports, controller, previous,
                                    ));
                                    state.gateway = Some((from, Arc::clone(&resolved)));
                                    resolved
                                }
                            };
                            resolved.with_ingresses(side.as_ref())
                        }
                        None => Value::from(Vec::<Value>::new()),
                    }
                }
                ((derivation, own, classes), _) if sparse::applies(derivation) => {
                    let ours = Ours::new(derivation.classes(), classes);
                    match state.sparse.as_mut() {
                        Some(kept) if kept.still(derivation, stores, &ours, &generations) => {
                            kept.advance(generations.clone());
                            state.value.clone()
                        }
                        _ => {
                            let value = compute(&self.derivation, slot, &inputs);
                            state.sparse = own.first().map(|ingresses| {
                                sparse::Sparse::of(
                                    derivation,
                                    *ingresses,
                                    &ours,
                                    generations.clone(),
                                )
                            });
                            value
                        }
                    }
                }
                _ => compute(&self.derivation, slot, &inputs),
            };
            // Rows computed again the same (a label of an Ingress a view shows) stay the
            // very list: the renders of it are then reused whole.
            if !crate::value::identical(&state.value, &value) {
                state.value = value;
            }
            state.built_from = Some(generations);
        }
        state.value.clone()
    }

    /// The rows for `inputs` (an overlay laid over one of them), computed now and kept nowhere:
    /// the view's own value and the resources' kept rows are left as they are, and reused
    /// where a resource's joins found the same versions.
    pub(crate) fn compute_uncached(&self, inputs: &[Source<'_>]) -> Value {
        let slot = Slot {
            index: self.derivation.slot(),
            keep: false,
        };
        // An Ingress under review: the Gateway API stores resolve as they did (when they did).
        if let (derivation @ Derivation::GatewayApi { .. }, own, classes) =
            split_classes(&self.derivation, inputs)
        {
            let from: Vec<u64> = own.iter().take(9).map(|s| s.generation()).collect();
            let kept = self
                .lock()
                .gateway
                .as_ref()
                .map(|(built, resolved)| (*built == from, Arc::clone(resolved)));
            let ours = Ours::new(derivation.classes(), classes);
            if let Some((inputs, ports, controller, side)) = gateway_inputs(derivation, own, ours) {
                return match kept {
                    Some((true, resolved)) => resolved.with_ingresses(side.as_ref()),
                    // An HTTPRoute or Gateway under review: the routes that did not change
                    // keep what they resolved to.
                    kept => gateway::resolve(
                        slot,
                        &inputs,
                        &ports,
                        controller,
                        kept.as_ref().map(|(_, r)| &**r),
                    )
                    .with_ingresses(side.as_ref()),
                };
            }
        }
        compute(&self.derivation, slot, inputs)
    }
}

/// The inputs of a derivation, with the IngressClasses of its class filter split off.
fn split_classes<'d, 's, 'a>(
    derivation: &'d Derivation,
    inputs: &'s [Source<'a>],
) -> (&'d Derivation, &'s [Source<'a>], Option<Source<'a>>) {
    match (derivation.classes(), inputs.split_last()) {
        (Some(_), Some((classes, rest))) => (derivation, rest, Some(*classes)),
        _ => (derivation, inputs, None),
    }
}

/// The store whose objects a view's rows come from (their `origin`).
fn store_of(derivation: &Derivation) -> &str {
    match derivation {
        Derivation::ServiceBackends { services, .. } => services,
        Derivation::IngressRoutes { ingresses, .. }
        | Derivation::IngressTls { ingresses, .. }
        | Derivation::Ingresses { ingresses, .. }
        | Derivation::IngressAnnotations { ingresses, .. }
        | Derivation::IngressPassthrough { ingresses, .. }
        | Derivation::IngressDefaultBackends { ingresses, .. } => ingresses,
        Derivation::TlsCertificates { secrets } => secrets,
        Derivation::GatewayApi { http_routes, .. } => http_routes,
    }
}

/// The rows of `derivation` over `inputs`, with the routed ports computed afresh.
fn compute(derivation: &Derivation, slot: Slot, inputs: &[Source<'_>]) -> Value {
    let (derivation, inputs, classes) = split_classes(derivation, inputs);
    let ours = Ours::new(derivation.classes(), classes);
    match (derivation, inputs) {
        (Derivation::ServiceBackends { .. }, [services, slices, rest @ ..]) => {
            let routed = rest.first().map(|ingresses| {
                routed_ports(
                    (derivation.ingresses().unwrap_or_default(), *ingresses),
                    *services,
                    &ours,
                )
            });
            service_backends(
                slot,
                (store_of(derivation), *services),
                *slices,
                routed.as_ref(),
            )
        }
        (Derivation::IngressRoutes { exact, .. }, [ingresses, services]) => ingress_routes(
            slot,
            (store_of(derivation), *ingresses),
            *services,
            *exact,
            &ours,
        ),
        (Derivation::IngressTls { .. }, [ingresses, secrets]) => {
            ingress_tls(slot, (store_of(derivation), *ingresses), *secrets, &ours)
        }
        (Derivation::Ingresses { whole, .. }, [ingresses]) => {
            ingress_rows(slot, *ingresses, &ours, *whole)
        }
        (Derivation::IngressAnnotations { .. }, [ingresses]) => {
            annotation_rows(slot, (store_of(derivation), *ingresses), &ours)
        }
        (Derivation::IngressDefaultBackends { .. }, [ingresses, services]) => {
            default_backends(*ingresses, *services, &ours)
        }
        (Derivation::IngressPassthrough { .. }, [ingresses, services]) => {
            passthrough_rows((store_of(derivation), *ingresses), *services, &ours)
        }
        (Derivation::TlsCertificates { .. }, [secrets]) => tls_certificates(slot, *secrets),
        (Derivation::GatewayApi { .. }, inputs) => {
            let Some((resolved, side)) = gateway_parts(derivation, slot, inputs, ours) else {
                return Value::from(Vec::<Value>::new());
            };
            resolved.with_ingresses(side.as_ref())
        }
        // `Stores` passes the stores `inputs()` names, so this does not happen.
        _ => Value::from(Vec::<Value>::new()),
    }
}

/// What the Gateway API view reads, from its inputs (the IngressClasses split off): its own
/// stores, its ports, its controller name, and the Ingresses it decides conflicts with (when
/// it reads some).
fn gateway_inputs<'a>(
    derivation: &'a Derivation,
    inputs: &[Source<'a>],
    ours: Ours<'a>,
) -> Option<(
    gateway::Inputs<'a>,
    gateway::Ports<'a>,
    &'a str,
    Option<gateway::IngressSide<'a>>,
)> {
    let Derivation::GatewayApi {
        controller_name,
        gateways: gateway_store,
        http_routes: route_store,
        reserved_ports,
        ingress_ports,
        ingresses: ingress_store,
        ..
    } = derivation
    else {
        return None;
    };
    let [
        classes,
        gateways,
        routes,
        grants,
        services,
        slices,
        secrets,
        namespaces,
        pods,
        rest @ ..,
    ] = inputs
    else {
        return None;
    };
    let side = ingress_store
        .as_deref()
        .zip(rest.first())
        .map(|(store, ingresses)| gateway::IngressSide {
            store,
            ingresses: *ingresses,
            ours,
        });
    Some((
        gateway::Inputs {
            classes: *classes,
            gateways: (gateway_store, *gateways),
            routes: (route_store, *routes),
            grants: *grants,
            services: *services,
            slices: *slices,
            secrets: *secrets,
            namespaces: *namespaces,
            pods: *pods,
        },
        gateway::Ports {
            reserved: reserved_ports,
            ingress: *ingress_ports,
        },
        controller_name,
        side,
    ))
}

/// The Gateway API view over `inputs` (its IngressClasses split off), resolved afresh.
fn gateway_parts<'a>(
    derivation: &'a Derivation,
    slot: Slot,
    inputs: &[Source<'a>],
    ours: Ours<'a>,
) -> Option<(gateway::Resolved, Option<gateway::IngressSide<'a>>)> {
    let (inputs, ports, controller, side) = gateway_inputs(derivation, inputs, ours)?;
    Some((
        gateway::resolve(slot, &inputs, &ports, controller, None),
        side,
    ))
}

/// Builds a map whose keys are static strings (no allocation per key), in the given order.
///
/// The engine finds an attribute of a small map by scanning its entries in order, so each
/// row puts the fields the reference templates read first: fewer cache lines per lookup.
fn row<const N: usize>(fields: [(&'static str, Value); N]) -> Value {
    let mut map = Map::with_capacity(N);
    for (key, value) in fields {
        map.insert(Key::Str(key), value);
    }
    Value::from(map)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use base64::Engine as _;
    use serde_json::{Value as Json, json};

    use crate::store::{Error, Store, StoreConfig, Stores};

    use super::{BTreeSet, Derivation, Ours, RoutedState, routed_state};

    fn stores() -> Stores {
        let mut stores = Stores::new();
        for name in ["ingresses", "services", "endpointslices"] {
            stores.add(name, StoreConfig::default()).unwrap();
        }
        stores
            .derive(
                "backends",
                Derivation::ServiceBackends {
                    services: "services".into(),
                    endpoint_slices: "endpointslices".into(),
                    routed_by: None,
                    classes: None,
                },
            )
            .unwrap();
        stores
            .derive(
                "routes",
                Derivation::IngressRoutes {
                    ingresses: "ingresses".into(),
                    services: "services".into(),
                    exact: None,
                    classes: None,
                },
            )
            .unwrap();
        stores
    }

    fn apply(stores: &mut Stores, store: &str, resource: Json) {
        stores.get_mut(store).unwrap().apply(&resource).unwrap();
    }

    fn service(stores: &mut Stores, name: &str, ports: Json) {
        let resource =
            json!({"metadata": {"namespace": "ns", "name": name}, "spec": {"ports": ports}});
        apply(stores, "services", resource);
    }

    fn slice(stores: &mut Stores, name: &str, service: &str, extra: Json) {
        let mut resource = json!({
            "metadata": {"namespace": "ns", "name": name,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.2", "10.0.0.9"], "conditions": {"ready": false, "terminating": true}},
                {"addresses": []},
            ],
        });
        if let (Some(target), Some(extra)) = (resource.as_object_mut(), extra.as_object()) {
            target.extend(extra.clone());
        }
        apply(stores, "endpointslices", resource);
    }

    fn derived(stores: &Stores, name: &str) -> Json {
        stores.derived_json(name).unwrap()
    }

    #[test]
    fn a_backend_row_per_service_port_with_the_endpoints_of_its_named_slice_port() {
        let mut s = stores();
        service(
            &mut s,
            "web",
            json!([{"name": "http", "port": 80}, {"name": "admin", "port": 81}, {"name": "x"}]),
        );
        slice(&mut s, "web-b", "web", json!({}));
        slice(&mut s, "other", "api", json!({}));
        let rows = derived(&s, "backends");
        assert_eq!(
            rows,
            json!([
                {"name": "ns_web_80", "namespace": "ns", "service": "web", "port": 80,
                 "port_name": "http", "app_protocol": "", "created": "", "origin": ["services", "ns", "web"], "policy": null, "endpoints": [
                    {"name": "web-b_10.0.0.1", "address": "10.0.0.1", "port": 8080,
                     "endpoint": "10.0.0.1:8080", "ready": true, "terminating": false, "slice": "web-b"},
                    {"name": "web-b_10.0.0.2", "address": "10.0.0.2", "port": 8080,
                     "endpoint": "10.0.0.2:8080", "ready": false, "terminating": true, "slice": "web-b"},
                 ]},
                // No slice port named `admin`; the port without a number is left out.
                {"name": "ns_web_81", "namespace": "ns", "service": "web", "port": 81,
                 "port_name": "admin", "app_protocol": "", "created": "", "origin": ["services", "ns", "web"], "policy": null, "endpoints": []},
            ])
        );
    }

    #[test]
    fn slices_concatenate_by_name_ipv6_is_bracketed_and_fqdn_left_out() {
        let mut s = stores();
        service(&mut s, "web", json!([{"name": "http", "port": 80}]));
        slice(
            &mut s,
            "web-b",
            "web",
            json!({"endpoints": [{"addresses": ["10.0.0.3"]}]}),
        );
        slice(
            &mut s,
            "web-a",
            "web",
            json!({"addressType": "IPv6", "endpoints": [{"addresses": ["fd00::1"]}]}),
        );
        slice(
            &mut s,
            "web-c",
            "web",
            json!({"addressType": "FQDN", "endpoints": [{"addresses": ["x.example.com"]}]}),
        );
        let rows = derived(&s, "backends");
        let endpoints: Vec<&str> = rows[0]["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["endpoint"].as_str().unwrap())
            .collect();
        assert_eq!(endpoints, ["[fd00::1]:8080", "10.0.0.3:8080"]);
        assert_eq!(rows[0]["endpoints"][0]["name"], "web-a_fd00__1");
    }

    #[test]
    fn routes_resolve_ports_by_number_or_name_and_keep_unresolved_paths() {
        let mut s = stores();
        service(
            &mut s,
            "web",
            json!([{"name": "http", "port": 80}, {"name": "metrics", "port": 9090}]),
        );
        apply(
            &mut s,
            "ingresses",
            json!({
                "metadata": {"namespace": "ns", "name": "shop"},
                "spec": {"rules": [
                    {"host": "shop.example.com", "http": {"paths": [
                        {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}},
                        {"path": "/m", "pathType": "Exact", "backend": {"service": {"name": "web", "port": {"name": "metrics"}}}},
                        {"path": "/gone", "pathType": "Prefix", "backend": {"service": {"name": "gone", "port": {"number": 80}}}},
                        {"path": "/noport", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 81}}}},
                        {"path": "/res", "pathType": "Prefix", "backend": {"resource": {"kind": "Bucket", "name": "b"}}},
                    ]}},
                    {"http": {"paths": [{"path": "/any", "backend": {"service": {"name": "web", "port": {"name": "http"}}}}]}},
                ]},
            }),
        );
        let rows = derived(&s, "routes");
        let summary: Vec<(String, String, String, Json)> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let text = |k: &str| r[k].as_str().unwrap().to_owned();
                (
                    text("host"),
                    text("path"),
                    text("path_type"),
                    r["backend"].clone(),
                )
            })
            .collect();
        let row =
            |h: &str, p: &str, t: &str, b: Json| (h.to_owned(), p.to_owned(), t.to_owned(), b);
        assert_eq!(
            summary,
            [
                row("shop.example.com", "/", "Prefix", json!("ns_web_80")),
                row("shop.example.com", "/m", "Exact", json!("ns_web_9090")),
                row("shop.example.com", "/gone", "Prefix", Json::Null),
                row("shop.example.com", "/noport", "Prefix", Json::Null),
                row("", "/any", "", json!("ns_web_80")),
            ]
        );
        assert_eq!(rows[1]["port"], 9090);
        assert_eq!(rows[2]["port"], Json::Null);
        assert_eq!(
            (rows[0]["namespace"].as_str(), rows[0]["ingress"].as_str()),
            (Some("ns"), Some("shop"))
        );
        assert_eq!(rows[2]["service"], "gone");

        // Views of Exact paths and of the others split the same rows.
        for (name, exact) in [("exact", true), ("others", false)] {
            let view = Derivation::IngressRoutes {
                ingresses: "ingresses".into(),
                services: "services".into(),
                exact: Some(exact),
                classes: None,
            };
            s.derive(name, view).unwrap();
        }
        let paths = |name: &str| -> Vec<String> {
            derived(&s, name)
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["path"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(paths("exact"), ["/m"]);
        assert_eq!(paths("others"), ["/", "/gone", "/noport", "/any"]);
    }

    #[test]
    fn views_follow_changes_of_every_store_they_read() {
        let mut s = stores();
        service(&mut s, "web", json!([{"name": "http", "port": 80}]));
        apply(
            &mut s,
            "ingresses",
            json!({
                "metadata": {"namespace": "ns", "name": "shop"},
                "spec": {"rules": [{"http": {"paths": [
                    {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "api", "port": {"number": 80}}}},
                ]}}]},
            }),
        );
        slice(&mut s, "web-a", "web", json!({}));
        assert_eq!(derived(&s, "routes")[0]["backend"], Json::Null);
        assert_eq!(
            derived(&s, "backends")[0]["endpoints"]
                .as_array()
                .unwrap()
                .len(),
            2
        );

        // The Service the path names appears: the Ingress's row resolves.
        service(&mut s, "api", json!([{"name": "http", "port": 80}]));
        assert_eq!(derived(&s, "routes")[0]["backend"], "ns_api_80");
        // A slice changes: only that Service's endpoints change.
        slice(
            &mut s,
            "web-a",
            "web",
            json!({"endpoints": [{"addresses": ["10.1.1.1"]}]}),
        );
        let backends = derived(&s, "backends");
        assert_eq!(backends[0]["endpoints"], json!([]), "api has no slices");
        assert_eq!(backends[1]["endpoints"][0]["address"], "10.1.1.1");
        // The Service loses its port, then is deleted.
        service(&mut s, "api", json!([{"name": "http", "port": 8000}]));
        assert_eq!(derived(&s, "routes")[0]["backend"], Json::Null);
        service(&mut s, "api", json!([{"name": "http", "port": 80}]));
        assert_eq!(derived(&s, "routes")[0]["backend"], "ns_api_80");
        assert!(s.get_mut("services").unwrap().remove("ns", "api"));
        assert_eq!(derived(&s, "routes")[0]["backend"], Json::Null);
        // A slice is removed.
        assert!(s.get_mut("endpointslices").unwrap().remove("ns", "web-a"));
        assert_eq!(derived(&s, "backends")[0]["endpoints"], json!([]));
    }

    #[test]
    fn tls_rows_say_whether_the_secret_holds_a_usable_certificate() {
        let mut s = stores();
        s.add("secrets", StoreConfig::default()).unwrap();
        s.derive(
            "tls",
            Derivation::IngressTls {
                ingresses: "ingresses".into(),
                secrets: "secrets".into(),
                classes: None,
            },
        )
        .unwrap();
        s.derive(
            "certificates",
            Derivation::TlsCertificates {
                secrets: "secrets".into(),
            },
        )
        .unwrap();
        let tls = |name: &str, kind: &str, crt: &str| {
            let b64 = |t: &str| base64::engine::general_purpose::STANDARD.encode(t);
            json!({"metadata": {"namespace": "ns", "name": name}, "type": kind,
                   "data": {"tls.crt": b64(crt), "tls.key": b64(include_str!("../fixtures/tls.key"))}})
        };
        let cert = include_str!("../fixtures/tls.crt");
        apply(&mut s, "secrets", tls("good", "kubernetes.io/tls", cert));
        apply(&mut s, "secrets", tls("opaque", "Opaque", cert));
        apply(
            &mut s,
            "secrets",
            tls("nopem", "kubernetes.io/tls", "hello"),
        );
        apply(
            &mut s,
            "ingresses",
            json!({
                "metadata": {"namespace": "ns", "name": "shop"},
                "spec": {"tls": [
                    {"secretName": "good", "hosts": ["a.example.com", "*.b.example.com"]},
                    {"secretName": "opaque"}, {"secretName": "nopem"}, {"secretName": "missing"}, {},
                ]},
            }),
        );
        let rows = derived(&s, "tls");
        let summary: Vec<(&str, bool)> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["secret"].as_str().unwrap(),
                    r["usable"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("good", true),
                ("opaque", false),
                ("nopem", false),
                ("missing", false),
                ("", false)
            ]
        );
        assert_eq!(rows[0]["file"], "ssl/2a/ns_good.pem");
        assert_eq!(
            rows[0]["hosts"],
            json!(["a.example.com", "*.b.example.com"])
        );
        assert_eq!(rows[1]["hosts"], json!([]));
        let reasons: Vec<&str> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["reason"].as_str().unwrap())
            .collect();
        assert_eq!(
            reasons,
            [
                "",
                "the Secret is of type \"Opaque\", not kubernetes.io/tls",
                "tls.crt holds no PEM certificate",
                "the Secret does not exist",
                "the TLS entry names no Secret"
            ]
        );
        // The certificate view: kubernetes.io/tls Secrets by namespace/name, the PEM of the
        // usable ones only.
        let certificates = derived(&s, "certificates");
        let keys: Vec<&String> = certificates.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["ns/good", "ns/nopem"]);
        assert!(
            certificates["ns/good"]["pem"]
                .as_str()
                .unwrap()
                .starts_with("-----BEGIN CERTIFICATE-----")
        );
        assert_eq!(certificates["ns/nopem"]["pem"], "");
        assert_eq!(certificates["ns/nopem"]["usable"], false);
        // The Secret is fixed: the rows follow.
        apply(&mut s, "secrets", tls("nopem", "kubernetes.io/tls", cert));
        assert_eq!(derived(&s, "tls")[2]["usable"], true);
        assert_eq!(derived(&s, "certificates")["ns/nopem"]["usable"], true);
    }

    #[test]
    fn routed_by_keeps_only_the_service_ports_ingress_paths_resolve_to() {
        let mut s = stores();
        s.derive(
            "routed",
            Derivation::ServiceBackends {
                services: "services".into(),
                endpoint_slices: "endpointslices".into(),
                routed_by: Some("ingresses".into()),
                classes: None,
            },
        )
        .unwrap();
        let ports = json!([{"name": "http", "port": 80}, {"name": "metrics", "port": 9090}]);
        service(&mut s, "web", ports.clone());
        service(&mut s, "unused", ports);
        let names = |s: &Stores| -> Vec<String> {
            derived(s, "routed")
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["name"].as_str().unwrap().to_owned())
                .collect()
        };
        assert!(names(&s).is_empty(), "no Ingress routes anywhere yet");
        let ingress = |paths: Json| {
            json!({"metadata": {"namespace": "ns", "name": "shop"},
                   "spec": {"rules": [{"http": {"paths": paths}}]}})
        };
        apply(
            &mut s,
            "ingresses",
            ingress(json!([
                {"path": "/", "backend": {"service": {"name": "web", "port": {"name": "metrics"}}}},
                {"path": "/x", "backend": {"service": {"name": "web", "port": {"number": 81}}}},
                {"path": "/y", "backend": {"service": {"name": "gone", "port": {"number": 80}}}},
            ])),
        );
        assert_eq!(names(&s), ["ns_web_9090"]);
        // The Ingress changes: its paths resolve to web:80 and web:9090; the unfiltered view
        // still has all four ports.
        apply(
            &mut s,
            "ingresses",
            ingress(json!([
                {"path": "/", "backend": {"service": {"name": "web", "port": {"number": 80}}}},
                {"path": "/m", "backend": {"service": {"name": "web", "port": {"name": "metrics"}}}},
            ])),
        );
        assert_eq!(names(&s), ["ns_web_80", "ns_web_9090"]);
        assert_eq!(derived(&s, "backends").as_array().unwrap().len(), 4);
        // The Service loses the port the path names.
        service(&mut s, "web", json!([{"name": "http", "port": 80}]));
        assert_eq!(names(&s), ["ns_web_80"]);
    }

    #[test]
    fn routed_ports_patched_after_an_ingress_or_service_event_are_those_computed_afresh() {
        let mut s = stores();
        service(
            &mut s,
            "web",
            json!([{"name": "http", "port": 80}, {"name": "m", "port": 9090}]),
        );
        service(&mut s, "api", json!([{"name": "http", "port": 8080}]));
        let ingress = |name: &str, service: &str, port: Json, annotations: Json| {
            json!({"metadata": {"namespace": "ns", "name": name, "annotations": annotations},
                   "spec": {"rules": [{"host": format!("{name}.example.com"), "http": {"paths": [
                       {"path": "/", "pathType": "Prefix",
                        "backend": {"service": {"name": service, "port": port}}}]}}]}})
        };
        let policy = json!({"nginx.ingress.kubernetes.io/whitelist-source-range": "10.0.0.0/8"});
        apply(
            &mut s,
            "ingresses",
            ingress("a", "web", json!({"number": 9090}), policy.clone()),
        );
        apply(
            &mut s,
            "ingresses",
            ingress("b", "web", json!({"name": "http"}), json!({})),
        );
        apply(
            &mut s,
            "ingresses",
            ingress("c", "api", json!({"number": 8080}), policy),
        );
        let all = Ours::new(None, None);
        fn two(s: &Stores) -> (&Store, &Store) {
            (s.get("ingresses").unwrap(), s.get("services").unwrap())
        }
        let fresh = |s: &Stores| {
            let (ingresses, services) = two(s);
            let mut state = routed_state(
                ("ingresses", ingresses.source()),
                services.source(),
                &all,
                true,
            );
            state.built_from = vec![ingresses.generation(), services.generation()];
            state
        };
        let patch = |kept: &mut RoutedState, s: &Stores| {
            let (ingresses, services) = two(s);
            let from = vec![ingresses.generation(), services.generation()];
            kept.patch(("ingresses", ingresses), services, &all, from)
        };
        let dirty = |services: &[&str]| -> BTreeSet<(String, String)> {
            services
                .iter()
                .map(|s| ("ns".to_owned(), (*s).to_owned()))
                .collect()
        };
        let mut kept = fresh(&s);
        // A Service event: the port a path names by name is renumbered.
        service(
            &mut s,
            "web",
            json!([{"name": "http", "port": 81}, {"name": "m", "port": 9090}]),
        );
        assert_eq!(patch(&mut kept, &s), Some(dirty(&["web"])));
        assert_eq!(kept.routed, fresh(&s).routed);
        // An Ingress event: a path moves to another Service.
        apply(
            &mut s,
            "ingresses",
            ingress("b", "api", json!({"name": "http"}), json!({})),
        );
        assert_eq!(patch(&mut kept, &s), Some(dirty(&["api", "web"])));
        assert_eq!(kept.routed, fresh(&s).routed);
        // A Service a path names appears; one no path resolves to changes nothing.
        apply(
            &mut s,
            "ingresses",
            ingress("d", "late", json!({"number": 80}), json!({})),
        );
        service(&mut s, "late", json!([{"port": 80}]));
        service(&mut s, "unused", json!([{"port": 80}]));
        assert_eq!(patch(&mut kept, &s), Some(dirty(&["late"])));
        assert_eq!(kept.routed, fresh(&s).routed);
        // A default backend: one Ingress's ports depend on others', so not patched, and the
        // routed ports are left as they were.
        let before = kept.routed.clone();
        let mut e = ingress("e", "web", json!({"number": 9090}), json!({}));
        e["spec"]["defaultBackend"] = json!({"service": {"name": "api", "port": {"number": 8080}}});
        apply(&mut s, "ingresses", e);
        assert_eq!(patch(&mut kept, &s), None);
        assert_eq!(kept.routed, before);
    }

    #[test]
    fn a_canary_behind_a_policy_gets_a_backend_with_the_main_routes_policy() {
        let mut s = stores();
        s.derive(
            "routed",
            Derivation::ServiceBackends {
                services: "services".into(),
                endpoint_slices: "endpointslices".into(),
                routed_by: Some("ingresses".into()),
                classes: None,
            },
        )
        .unwrap();
        s.derive(
            "nginx",
            Derivation::IngressAnnotations {
                ingresses: "ingresses".into(),
                classes: None,
            },
        )
        .unwrap();
        for name in ["web", "next"] {
            service(&mut s, name, json!([{"name": "http", "port": 80}]));
        }
        let ingress = |name: &str, service: &str, annotations: Json| {
            json!({"metadata": {"namespace": "ns", "name": name, "annotations": annotations,
                    "creationTimestamp": "2026-01-01T00:00:00Z"},
                   "spec": {"rules": [{"host": "shop.example.com", "http": {"paths": [
                       {"path": "/", "pathType": "Prefix",
                        "backend": {"service": {"name": service, "port": {"number": 80}}}}]}}]}})
        };
        let canary = json!({"nginx.ingress.kubernetes.io/canary": "true",
                            "nginx.ingress.kubernetes.io/canary-weight": "10"});
        apply(&mut s, "ingresses", ingress("canary", "next", canary));
        apply(
            &mut s,
            "ingresses",
            ingress(
                "main",
                "web",
                json!({"nginx.ingress.kubernetes.io/whitelist-source-range": "10.0.0.0/8"}),
            ),
        );
        let rows = derived(&s, "routed");
        let names: Vec<&str> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        let id = names[1].strip_prefix("ns_web_80_nginx_").unwrap();
        assert_eq!(names, [format!("ns_next_80_nginx_{id}").as_str(), names[1]]);
        // The canary's backend has the main's policy and names the main Ingress.
        assert_eq!(rows[0]["policy"], rows[1]["policy"]);
        assert_eq!(rows[0]["origin"], json!(["ingresses", "ns", "main"]));
        assert_eq!(rows[0]["service"], "next");
        let canary_path = |s: &Stores| derived(s, "nginx")[0]["canary"]["paths"][0].clone();
        assert_eq!(canary_path(&s)["main_policy"], id);
        // The main loses its policy: both plain again.
        apply(&mut s, "ingresses", ingress("main", "web", json!({})));
        let rows = derived(&s, "routed");
        let names: Vec<&str> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["ns_next_80", "ns_web_80"]);
        assert_eq!(canary_path(&s)["main_policy"], Json::Null);
    }

    #[test]
    fn derive_checks_names_and_stores() {
        let mut s = stores();
        let d = Derivation::IngressRoutes {
            ingresses: "ingresses".into(),
            services: "svc".into(),
            exact: None,
            classes: None,
        };
        let err = s.derive("more", d.clone()).unwrap_err();
        assert!(
            matches!(&err, Error::UnknownStore { store, .. } if store == "svc"),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("endpointslices, ingresses, services"),
            "{err}"
        );
        let ok = Derivation::IngressRoutes {
            ingresses: "ingresses".into(),
            services: "services".into(),
            exact: None,
            classes: None,
        };
        for bad in ["a-b", "1x", ""] {
            assert!(
                matches!(s.derive(bad, ok.clone()), Err(Error::InvalidDerivedName(_))),
                "{bad:?}"
            );
        }
        let err = s.derive("routes", ok.clone()).unwrap_err();
        assert!(
            matches!(&err, Error::DuplicateDerivedName(n) if n == "routes"),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("already a derived view named `routes`"),
            "{err}"
        );
        assert!(s.derived_json("nothing").is_none());
    }

    #[test]
    fn views_of_one_kind_over_different_stores_and_a_store_joined_with_itself_stay_apart() {
        let mut s = Stores::new();
        for name in ["x", "y"] {
            s.add(name, StoreConfig::default()).unwrap();
        }
        let routes = |services: &str| Derivation::IngressRoutes {
            ingresses: "x".into(),
            services: services.into(),
            exact: None,
            classes: None,
        };
        s.derive("selfjoin", routes("x")).unwrap();
        s.derive("other", routes("y")).unwrap();
        // One resource that is both an Ingress pointing at Service `a` and that Service.
        apply(
            &mut s,
            "x",
            json!({"metadata": {"namespace": "ns", "name": "a"},
            "spec": {"ports": [{"port": 80}], "rules": [{"http": {"paths": [
                {"path": "/", "backend": {"service": {"name": "a", "port": {"number": 80}}}}]}}]}}),
        );
        for _ in 0..2 {
            assert_eq!(derived(&s, "selfjoin")[0]["backend"], "ns_a_80");
            assert_eq!(
                derived(&s, "other")[0]["backend"],
                Json::Null,
                "no Service `a` in y"
            );
        }
        apply(
            &mut s,
            "y",
            json!({"metadata": {"namespace": "ns", "name": "a"},
            "spec": {"ports": [{"port": 80}]}}),
        );
        assert_eq!(derived(&s, "other")[0]["backend"], "ns_a_80");
        assert_eq!(derived(&s, "selfjoin")[0]["backend"], "ns_a_80");
    }

    #[test]
    fn ingress_nginx_annotations_get_a_row_per_annotated_ingress() {
        let mut s = Stores::new();
        s.add("ingresses", StoreConfig::default()).unwrap();
        s.derive(
            "nginx",
            Derivation::IngressAnnotations {
                ingresses: "ingresses".into(),
                classes: None,
            },
        )
        .unwrap();
        let ing = |name: &str, annotations: Json| json!({"metadata": {"namespace": "ns", "name": name, "annotations": annotations}});
        apply(
            &mut s,
            "ingresses",
            ing("plain", json!({"cert-manager.io/issuer": "x"})),
        );
        apply(
            &mut s,
            "ingresses",
            ing(
                "legacy",
                json!({
                    "nginx.ingress.kubernetes.io/server-snippet": "return 200;",
                    "nginx.ingress.kubernetes.io/custom-http-errors": "404,503",
                    "nginx.ingress.kubernetes.io/proxy-body-size": "10 parsecs",
                }),
            ),
        );
        let rows = derived(&s, "nginx");
        assert_eq!(rows.as_array().unwrap().len(), 1, "{rows}");
        let row = &rows[0];
        assert_eq!(row["ingress"], "legacy");
        assert!(
            row["refused"]
                .as_str()
                .unwrap()
                .starts_with("nginx.ingress.kubernetes.io/server-snippet refused: raw NGINX config is never rendered"),
            "{row}"
        );
        assert_eq!(
            row["not_applied"],
            "ingress-nginx annotations not applied: nginx.ingress.kubernetes.io/custom-http-errors (not-yet-supported) (see docs/nginx-annotations.md)"
        );
        assert_eq!(
            row["invalid"],
            "ingress-nginx annotations with values that cannot be applied: nginx.ingress.kubernetes.io/proxy-body-size: \"10 parsecs\" is not a size (bytes, or a number with a k, m or g suffix): no limit applies"
        );
        assert_eq!(row["origin"], json!(["ingresses", "ns", "legacy"]));
        // A new version is judged again: without its nginx annotations it has no row.
        apply(&mut s, "ingresses", ing("legacy", json!({})));
        assert_eq!(derived(&s, "nginx"), json!([]));
    }

    #[test]
    fn joins_pointing_at_each_other_keep_nothing_alive() {
        let mut s = Stores::new();
        s.add("x", StoreConfig::default()).unwrap();
        s.derive(
            "selfjoin",
            Derivation::IngressRoutes {
                ingresses: "x".into(),
                services: "x".into(),
                exact: None,
                classes: None,
            },
        )
        .unwrap();
        // `a` routes to `b` and `b` to `a`: each one's rows are joined with the other.
        for (name, to) in [("a", "b"), ("b", "a")] {
            apply(
                &mut s,
                "x",
                json!({"metadata": {"namespace": "ns", "name": name},
                "spec": {"ports": [{"port": 80}], "rules": [{"http": {"paths": [
                    {"path": "/", "backend": {"service": {"name": to, "port": {"number": 80}}}}]}}]}}),
            );
        }
        assert_eq!(derived(&s, "selfjoin").as_array().unwrap().len(), 2);
        let extracts: Vec<std::sync::Weak<super::Extracts>> = s
            .get("x")
            .unwrap()
            .source()
            .entries()
            .map(|(_, _, e)| std::sync::Arc::downgrade(e))
            .collect();
        drop(s);
        assert!(
            extracts.iter().all(|e| e.upgrade().is_none()),
            "extracts outlived their stores"
        );
    }

    #[test]
    fn a_rule_whose_host_is_not_a_string_is_left_out() {
        let mut s = stores();
        service(&mut s, "web", json!([{"name": "http", "port": 80}]));
        let path = json!({"path": "/", "pathType": "Prefix",
                          "backend": {"service": {"name": "web", "port": {"number": 80}}}});
        apply(
            &mut s,
            "ingresses",
            json!({"metadata": {"namespace": "ns", "name": "shop"},
            "spec": {"rules": [{"host": ["evil.example.com"], "http": {"paths": [path]}},
                               {"host": null, "http": {"paths": [path]}}]}}),
        );
        let rows = derived(&s, "routes");
        assert_eq!(rows.as_array().unwrap().len(), 1, "{rows}");
        assert_eq!(rows[0]["host"], "", "a null host is a rule without one");
    }

    #[test]
    fn udp_ports_sharing_a_tcp_port_number_are_left_out() {
        let mut s = stores();
        service(
            &mut s,
            "web",
            json!([{"name": "h3", "port": 443, "protocol": "UDP"},
                                       {"name": "https", "port": 443, "protocol": "TCP"}]),
        );
        slice(
            &mut s,
            "web-a",
            "web",
            json!({"ports": [
            {"name": "h3", "port": 8443, "protocol": "UDP"}, {"name": "https", "port": 8443}]}),
        );
        let backends = derived(&s, "backends");
        assert_eq!(backends.as_array().unwrap().len(), 1, "{backends}");
        assert_eq!(backends[0]["port_name"], "https");
        assert_eq!(backends[0]["endpoints"][0]["endpoint"], "10.0.0.1:8443");
    }

    fn class_stores(classless: bool) -> Stores {
        let mut stores = Stores::new();
        for name in ["ingresses", "services", "ingressclasses"] {
            stores.add(name, StoreConfig::default()).unwrap();
        }
        let mut classes = super::IngressClassFilter::new("ingressclasses");
        classes.classless = classless;
        stores
            .derive(
                "ours",
                Derivation::Ingresses {
                    ingresses: "ingresses".into(),
                    classes: Some(classes.clone()),
                    whole: true,
                },
            )
            .unwrap();
        stores
            .derive(
                "routes",
                Derivation::IngressRoutes {
                    ingresses: "ingresses".into(),
                    services: "services".into(),
                    exact: None,
                    classes: Some(classes),
                },
            )
            .unwrap();
        stores
    }

    fn names(stores: &Stores) -> Vec<String> {
        derived(stores, "ours")
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn ingresses_are_ours_by_class_name_legacy_annotation_default_class_or_setting() {
        let ing = |name: &str, class: Option<&str>, legacy: Option<&str>| {
            let mut ing = json!({"metadata": {"namespace": "ns", "name": name}, "spec": {}});
            if let Some(class) = class {
                ing["spec"]["ingressClassName"] = json!(class);
            }
            if let Some(legacy) = legacy {
                ing["metadata"]["annotations"] = json!({"kubernetes.io/ingress.class": legacy});
            }
            ing
        };
        let all = [
            ing("by-name", Some("ours"), None),
            ing("by-name-over-annotation", Some("ours"), Some("theirs")),
            ing("theirs-over-annotation", Some("theirs"), Some("ours")),
            ing("legacy", None, Some("ours")),
            ing("legacy-theirs", None, Some("theirs")),
            ing("unknown-class", Some("gone"), None),
            ing("classless", None, None),
        ];
        let class = |name: &str, controller: &str, default: bool| {
            let mut c = crate::fixtures::ingress_class(name, default);
            c["spec"]["controller"] = json!(controller);
            c
        };
        for classless in [false, true] {
            let mut s = class_stores(classless);
            for i in &all {
                apply(&mut s, "ingresses", i.clone());
            }
            apply(
                &mut s,
                "ingressclasses",
                class("ours", super::DEFAULT_CONTROLLER, false),
            );
            apply(
                &mut s,
                "ingressclasses",
                class("theirs", "k8s.io/ingress-nginx", true),
            );
            let mut want = vec!["by-name", "by-name-over-annotation", "legacy"];
            if classless {
                want.insert(2, "classless");
            }
            assert_eq!(names(&s), want, "classless: {classless}");
            for i in &all {
                let name = i["metadata"]["name"].as_str().unwrap();
                assert_eq!(s.is_ours("ingresses", i), want.contains(&name), "{name}");
            }
            // Our class becomes the default (theirs stops being one): class-less is ours.
            apply(
                &mut s,
                "ingressclasses",
                class("ours", super::DEFAULT_CONTROLLER, true),
            );
            apply(
                &mut s,
                "ingressclasses",
                class("theirs", "k8s.io/ingress-nginx", false),
            );
            assert!(names(&s).contains(&"classless".to_owned()));
            // Our class goes: nothing named or annotated with it is ours any more.
            s.get_mut("ingressclasses").unwrap().remove("", "ours");
            let left = if classless { vec!["classless"] } else { vec![] };
            assert_eq!(names(&s), left);
        }
        // A store no view filters: everything is ours.
        let s = stores();
        assert!(s.is_ours("ingresses", &ing("x", Some("theirs"), None)));
    }

    #[test]
    fn the_oldest_ingress_keeps_a_contested_route_whatever_its_name() {
        let mut s = class_stores(true);
        let ing = |ns: &str, created: Option<&str>, paths: Json| {
            let mut ing = json!({"metadata": {"namespace": ns, "name": "site"},
                "spec": {"rules": [{"host": "h.example", "http": {"paths": paths}}]}});
            if let Some(created) = created {
                ing["metadata"]["creationTimestamp"] = json!(created);
            }
            ing
        };
        let p = |path: &str, kind: &str| {
            json!({"path": path, "pathType": kind,
                "backend": {"service": {"name": "web", "port": {"number": 80}}}})
        };
        // `/a/` and `/a` Prefix are one route; Exact `/a` is another.
        apply(
            &mut s,
            "ingresses",
            ing("a", None, json!([p("/a/", "Prefix"), p("/a", "Exact")])),
        );
        apply(
            &mut s,
            "ingresses",
            ing(
                "b",
                Some("2026-02-01T00:00:00Z"),
                json!([p("/a", "Prefix")]),
            ),
        );
        apply(
            &mut s,
            "ingresses",
            ing(
                "c",
                Some("2026-01-01T00:00:00Z"),
                json!([p("/a", "Prefix"), p("/a", "Prefix")]),
            ),
        );
        let rows = derived(&s, "routes");
        let conflicts: Vec<(&str, &str, &Json)> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["namespace"].as_str().unwrap(),
                    r["path_type"].as_str().unwrap(),
                    &r["conflict"],
                )
            })
            .collect();
        assert_eq!(
            conflicts,
            [
                // Without a creationTimestamp: after every one with one.
                ("a", "Prefix", &json!("c/site")),
                ("a", "Exact", &Json::Null),
                ("b", "Prefix", &json!("c/site")),
                // Its own duplicate is no conflict.
                ("c", "Prefix", &Json::Null),
                ("c", "Prefix", &Json::Null),
            ]
        );
        // The winner gone: the next oldest (by time) takes over.
        s.get_mut("ingresses").unwrap().remove("c", "site");
        let rows = derived(&s, "routes");
        assert_eq!(rows[0]["conflict"], "b/site");
        assert_eq!(rows[2]["conflict"], Json::Null);
    }

    #[test]
    fn derivations_refuse_unknown_fields() {
        let err = serde_json::from_value::<Derivation>(json!({
            "kind": "serviceBackends", "services": "s", "endpointSlices": "e", "routedBY": "i"
        }))
        .unwrap_err();
        assert!(err.to_string().contains("routedBY"), "{err}");
    }

    #[test]
    fn derivations_read_from_camel_case_config() {
        let d: Derivation = serde_json::from_value(json!({
            "kind": "serviceBackends", "services": "s", "endpointSlices": "e"
        }))
        .unwrap();
        assert_eq!(d.inputs(), ["s", "e"]);
        // The reference views in the shape the README shows, and back.
        let classes = json!({"ingressClasses": "ingressclasses",
            "controller": "haproxy-haptic.org/ingress-controller", "classless": false});
        let config = json!({
            "backends": {"kind": "serviceBackends", "services": "services",
                         "endpointSlices": "endpointslices", "routedBy": "ingresses",
                         "classes": classes},
            "default_backends": {"kind": "ingressDefaultBackends", "ingresses": "ingresses",
                                 "services": "services", "classes": classes},
            "ingresses": {"kind": "ingresses", "ingresses": "ingresses", "classes": classes, "whole": false},
            "nginx_annotations": {"kind": "ingressAnnotations", "ingresses": "ingresses",
                                  "classes": classes},
            "passthrough": {"kind": "ingressPassthrough", "ingresses": "ingresses",
                            "services": "services", "classes": classes},
            "routes_exact": {"kind": "ingressRoutes", "ingresses": "ingresses",
                             "services": "services", "exact": true, "classes": classes},
            "routes_prefix": {"kind": "ingressRoutes", "ingresses": "ingresses",
                              "services": "services", "exact": false, "classes": classes},
            "tls": {"kind": "ingressTls", "ingresses": "ingresses", "secrets": "secrets",
                    "classes": classes},
            "certificates": {"kind": "tlsCertificates", "secrets": "secrets"},
            "gateway": {"kind": "gatewayApi", "gatewayClasses": "gatewayclasses",
                        "gateways": "gateways", "httpRoutes": "httproutes",
                        "referenceGrants": "referencegrants", "services": "services",
                        "endpointSlices": "endpointslices", "secrets": "secrets",
                        "namespaces": "namespaces", "pods": "haproxy_pods",
                        "controllerName": "haproxy-haptic.org/gateway-controller",
                        "reservedPorts": [9090, 9091],
                        "ingressPorts": {"http": 80, "https": 443},
                        "ingresses": "ingresses", "classes": classes},
        });
        // The controller name and `classless` have defaults.
        let short: Derivation = serde_json::from_value(json!({"kind": "ingresses",
            "ingresses": "ingresses", "classes": {"ingressClasses": "ingressclasses"}}))
        .unwrap();
        assert_eq!(short.classes(), Some(&crate::reference::classes()));
        // Rows hold the whole Ingress unless told not to.
        assert_eq!(short.keeps_whole(), Some("ingresses"));
        for (name, derivation) in crate::reference::derivations() {
            let parsed: Derivation = serde_json::from_value(config[name].clone()).unwrap();
            assert_eq!(parsed, derivation, "{name}");
            assert_eq!(
                serde_json::to_value(&derivation).unwrap(),
                config[name],
                "{name}"
            );
        }
    }
}
