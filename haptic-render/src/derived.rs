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
//! | `endpoints` | the endpoints of the Service's EndpointSlices (label `kubernetes.io/service-name`, same namespace) on the slice port with the same name, ready or not: slices by name, then port, then endpoint order; FQDN slices and endpoints without addresses are left out |
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
//! | `backend` | that Service port's backend name (as a backend row's `name`); none when unresolved, so that a template decides what such a path gets |
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::{Deserialize, Serialize};
use tera::Value;
use tera::value::{Key, Map};

use crate::certificate::{Verdict, check_secret, now_unix};
use crate::functions::{backend_name, sanitize, ssl_file};
use crate::store::{Source, Store};

/// A join computed from named stores.
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
        /// there resolves to (as in [`Derivation::IngressRoutes`]) get a row. A controller
        /// watches every Service to resolve Ingress backends; without this, a cluster's
        /// thousands of Services nobody routes to would each become a backend.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        routed_by: Option<String>,
    },
    /// A row per path of an Ingress rule whose backend is a Service, resolved against the
    /// Services' TCP ports: by port number or by port name, as the path asks (the first port
    /// that matches either, should a path give both). A path whose Service or
    /// Service port does not exist is still a row, with `backend` none, so that a template can
    /// decide what such a path gets. Resource backends are left out.
    IngressRoutes {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Services.
        services: String,
        /// When set, only the paths whose `pathType` is `Exact` (true) or is not (false): one
        /// view per kind of lookup, so that each map's template walks only its own rows.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exact: Option<bool>,
    },
    /// A row per TLS entry of an Ingress, with whether its Secret holds a usable certificate.
    IngressTls {
        /// The store of networking.k8s.io/v1 Ingresses.
        ingresses: String,
        /// The store of v1 Secrets.
        secrets: String,
    },
    /// A map from `"<namespace>/<name>"` to the verdict on each `kubernetes.io/tls` Secret,
    /// with its PEM when usable (see [`crate::certificate`]).
    TlsCertificates {
        /// The store of v1 Secrets.
        secrets: String,
    },
}

impl Derivation {
    /// The stores this view reads, in a fixed order.
    pub fn inputs(&self) -> Vec<&str> {
        match self {
            Self::ServiceBackends {
                services,
                endpoint_slices,
                routed_by,
            } => [Some(services), Some(endpoint_slices), routed_by.as_ref()]
                .into_iter()
                .flatten()
                .map(String::as_str)
                .collect(),
            Self::IngressRoutes {
                ingresses,
                services,
                ..
            } => vec![ingresses, services],
            Self::IngressTls { ingresses, secrets } => vec![ingresses, secrets],
            Self::TlsCertificates { secrets } => vec![secrets],
        }
    }

    /// Which of a resource's row slots this view uses (one per kind of view).
    fn slot(&self) -> usize {
        match self {
            Self::ServiceBackends { .. } => 0,
            Self::IngressRoutes { .. } => 1,
            Self::IngressTls { .. } => 2,
            Self::TlsCertificates { .. } => 3,
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
#[derive(Debug, Default)]
pub(crate) struct Extracts {
    service: OnceLock<ServiceExtract>,
    slice: OnceLock<SliceExtract>,
    ingress: OnceLock<IngressExtract>,
    tls: OnceLock<Vec<TlsExtract>>,
    certificate: OnceLock<Verdict>,
    /// The rows this resource last contributed to a view, and what they were joined with, per
    /// kind of view ([`Derivation::slot`]).
    rows: Mutex<[Option<Contribution>; 4]>,
}

/// An Ingress TLS entry.
#[derive(Debug)]
struct TlsExtract {
    secret: String,
    hosts: Value,
}

/// A Service's ports: name, number and backend name.
#[derive(Debug)]
struct ServiceExtract {
    ports: Vec<(String, i64, Value)>,
}

/// An EndpointSlice: the Service it belongs to and, per port name, its endpoint rows.
#[derive(Debug)]
struct SliceExtract {
    service: String,
    ports: Vec<(String, Value)>,
}

/// An Ingress's paths with a Service backend.
#[derive(Debug)]
struct IngressExtract {
    paths: Vec<PathExtract>,
}

#[derive(Debug)]
struct PathExtract {
    /// Whether `pathType` is `Exact`.
    exact: bool,
    host: Value,
    path: Value,
    path_type: Value,
    service: String,
    want_number: Option<i64>,
    want_name: String,
}

impl Extracts {
    fn service(&self, namespace: &str, name: &str, svc: &Value) -> &ServiceExtract {
        self.service.get_or_init(|| ServiceExtract {
            ports: list(svc, &["spec", "ports"])
                .iter()
                .filter(|sp| is_tcp(sp))
                .filter_map(|sp| {
                    let port = integer(attr(sp, "port"))?;
                    let backend = backend_name(namespace, name, &port.to_string());
                    Some((text(sp, &["name"]).to_owned(), port, Value::from(backend)))
                })
                .collect(),
        })
    }

    fn slice(&self, slice: &Value) -> &SliceExtract {
        self.slice.get_or_init(|| {
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

    fn tls(&self, ing: &Value) -> &[TlsExtract] {
        self.tls.get_or_init(|| {
            list(ing, &["spec", "tls"])
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
    fn certificate(&self, secret: &Value) -> &Verdict {
        self.certificate
            .get_or_init(|| check_secret(secret, now_unix()))
    }

    fn ingress(&self, ing: &Value) -> &IngressExtract {
        self.ingress.get_or_init(|| {
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
                        service: text(backend, &["name"]).to_owned(),
                        want_number: integer(path(backend, &["port", "number"]))
                            .filter(|n| *n != 0),
                        want_name: text(backend, &["port", "name"]).to_owned(),
                    });
                }
            }
            IngressExtract { paths }
        })
    }
}

impl ServiceExtract {
    /// The port a path asks for: the first with its number, or with its name.
    fn resolve(&self, path: &PathExtract) -> Option<&(String, i64, Value)> {
        self.ports.iter().find(|(name, number, _)| {
            path.want_number == Some(*number)
                || (!path.want_name.is_empty() && *name == path.want_name)
        })
    }
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
        let mut slots = self.rows.lock().unwrap_or_else(|poisoned| {
            let mut slots = poisoned.into_inner();
            *slots = Default::default();
            slots
        });
        let Some(cached) = slots.get_mut(slot.index) else {
            kept(&compute(), out);
            return;
        };
        match &*cached {
            Some((deps, rows)) if same_deps(deps, joined.clone()) => kept(rows, out),
            _ => {
                let rows = compute();
                kept(&rows, out);
                // A render of an overlay keeps nothing: the stores' own rows stay theirs.
                if slot.keep {
                    let deps = joined.map(|dep| dep.map(Arc::downgrade)).collect();
                    *cached = Some((deps, rows));
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

/// The Service ports Ingress paths resolve to: namespace -> Service -> port numbers. Owned,
/// so that a view keeps it while only its slices change (the commonest event: Pods come and
/// go), and looked up by `&str` without allocating.
type Routed = HashMap<String, HashMap<String, Vec<i64>>>;

fn routed_ports(ingresses: Source<'_>, services: Source<'_>) -> Routed {
    let by_name = services_by_name(services);
    let mut routed = Routed::new();
    for ((namespace, _), ing, extracts) in ingresses.entries() {
        for p in &extracts.ingress(ing).paths {
            let resolved = by_name
                .get(&(namespace.as_str(), p.service.as_str()))
                .and_then(|(svc, _)| svc.resolve(p));
            if let Some((_, port, _)) = resolved {
                let ports = routed
                    .entry(namespace.clone())
                    .or_default()
                    .entry(p.service.clone())
                    .or_default();
                if !ports.contains(port) {
                    ports.push(*port);
                }
            }
        }
    }
    routed
}

fn is_routed(routed: &Routed, namespace: &str, service: &str, port: i64) -> bool {
    routed
        .get(namespace)
        .and_then(|services| services.get(service))
        .is_some_and(|ports| ports.contains(&port))
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
    let mut by_service: HashMap<(&str, &str), Vec<&Arc<Extracts>>> = HashMap::new();
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
        let ports = &extracts.service(namespace, service, svc).ports;
        // A row per port, in port order: row `i` is port `i`'s.
        let keep = |i: usize| match (&routed, ports.get(i)) {
            (None, _) => true,
            (Some(routed), Some((_, port, _))) => is_routed(routed, namespace, service, *port),
            (Some(_), None) => false,
        };
        extracts.rows_into_if(
            slot,
            slices.iter().map(|e| Some(*e)),
            &mut rows,
            || {
                let origin = origin(store, namespace, service);
                ports
                    .iter()
                    .map(|(port_name, port, backend)| {
                        let mut matching = slices
                            .iter()
                            // Extracted while grouping above.
                            .filter_map(|e| e.slice.get())
                            .flat_map(|slice| slice.ports.iter())
                            .filter(|(name, _)| name == port_name)
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
                            ("name", backend.clone()),
                            ("endpoints", endpoints),
                            ("namespace", Value::from(namespace.as_str())),
                            ("service", Value::from(service.as_str())),
                            ("port", Value::from(*port)),
                            ("port_name", Value::from(port_name.as_str())),
                            ("origin", origin.clone()),
                        ])
                    })
                    .collect()
            },
            keep,
        );
    }
    Value::from(rows)
}

fn ingress_routes(
    slot: Slot,
    (store, ingresses): (&str, Source<'_>),
    services: Source<'_>,
    exact: Option<bool>,
) -> Value {
    let by_name = services_by_name(services);
    let mut rows = Vec::with_capacity(ingresses.len() * 2);
    for ((namespace, ingress), ing, extracts) in ingresses.entries() {
        let paths = &extracts.ingress(ing).paths;
        let resolved: Vec<Option<(&ServiceExtract, &Arc<Extracts>)>> = paths
            .iter()
            .map(|p| {
                by_name
                    .get(&(namespace.as_str(), p.service.as_str()))
                    .copied()
            })
            .collect();
        let joined = resolved.iter().map(|r| r.map(|(_, e)| e));
        // The cached rows are every path's (views of either kind share them); row `i` is path
        // `i`'s.
        let keep =
            |i: usize| exact.is_none_or(|exact| paths.get(i).is_some_and(|p| p.exact == exact));
        extracts.rows_into_if(
            slot,
            joined,
            &mut rows,
            || {
                let origin = origin(store, namespace, ingress);
                paths
                    .iter()
                    .zip(&resolved)
                    .map(|(p, svc)| {
                        let port = svc.and_then(|(svc, _)| svc.resolve(p));
                        let (port, backend) = match port {
                            Some((_, number, backend)) => (Value::from(*number), backend.clone()),
                            None => (Value::none(), Value::none()),
                        };
                        row([
                            ("backend", backend),
                            ("path_type", p.path_type.clone()),
                            ("host", p.host.clone()),
                            ("path", p.path.clone()),
                            ("namespace", Value::from(namespace.as_str())),
                            ("ingress", Value::from(ingress.as_str())),
                            ("service", Value::from(p.service.as_str())),
                            ("port", port),
                            ("origin", origin.clone()),
                        ])
                    })
                    .collect()
            },
            keep,
        );
    }
    Value::from(rows)
}

fn ingress_tls(slot: Slot, (store, ingresses): (&str, Source<'_>), secrets: Source<'_>) -> Value {
    let mut rows = Vec::new();
    for ((namespace, ingress), ing, extracts) in ingresses.entries() {
        let entries = extracts.tls(ing);
        if entries.is_empty() {
            continue;
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
        extracts.rows_into(slot, joined, &mut rows, || {
            let origin = origin(store, namespace, ingress);
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
                        ("namespace", Value::from(namespace.as_str())),
                        ("ingress", Value::from(ingress.as_str())),
                        ("secret", Value::from(tls.secret.as_str())),
                        ("origin", origin.clone()),
                    ])
                })
                .collect()
        });
    }
    Value::from(rows)
}

fn tls_certificates(slot: Slot, secrets: Source<'_>) -> Value {
    let mut map = Map::new();
    let mut rows = Vec::with_capacity(1);
    for ((namespace, name), secret, extracts) in secrets.entries() {
        if text(secret, &["type"]) != "kubernetes.io/tls" {
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
    /// For `routedBy`: the routed ports, and the generations of the Ingresses and Services
    /// they were computed from.
    routed: Option<([u64; 2], Routed)>,
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
    pub(crate) fn value(&self, inputs: &[&Store]) -> Value {
        let inputs: Vec<Source<'_>> = inputs.iter().map(|s| s.source()).collect();
        let generations: Vec<u64> = inputs.iter().map(|s| s.generation()).collect();
        let mut state = self.lock();
        if state.built_from.as_ref() != Some(&generations) {
            let slot = Slot {
                index: self.derivation.slot(),
                keep: true,
            };
            let value = match (&self.derivation, &inputs[..]) {
                (Derivation::ServiceBackends { .. }, [services, slices, rest @ ..]) => {
                    let routed = match rest.first() {
                        None => None,
                        Some(ingresses) => {
                            let from = [ingresses.generation(), services.generation()];
                            if state
                                .routed
                                .as_ref()
                                .is_none_or(|(built, _)| *built != from)
                            {
                                state.routed = Some((from, routed_ports(*ingresses, *services)));
                            }
                            state.routed.as_ref().map(|(_, routed)| routed)
                        }
                    };
                    service_backends(
                        slot,
                        (store_of(&self.derivation), *services),
                        *slices,
                        routed,
                    )
                }
                _ => compute(&self.derivation, slot, &inputs),
            };
            state.value = value;
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
        compute(&self.derivation, slot, inputs)
    }
}

/// The store whose objects a view's rows come from (their `origin`).
fn store_of(derivation: &Derivation) -> &str {
    match derivation {
        Derivation::ServiceBackends { services, .. } => services,
        Derivation::IngressRoutes { ingresses, .. } | Derivation::IngressTls { ingresses, .. } => {
            ingresses
        }
        Derivation::TlsCertificates { secrets } => secrets,
    }
}

/// The rows of `derivation` over `inputs`, with the routed ports computed afresh.
fn compute(derivation: &Derivation, slot: Slot, inputs: &[Source<'_>]) -> Value {
    match (derivation, inputs) {
        (Derivation::ServiceBackends { .. }, [services, slices, rest @ ..]) => {
            let routed = rest
                .first()
                .map(|ingresses| routed_ports(*ingresses, *services));
            service_backends(
                slot,
                (store_of(derivation), *services),
                *slices,
                routed.as_ref(),
            )
        }
        (Derivation::IngressRoutes { exact, .. }, [ingresses, services]) => {
            ingress_routes(slot, (store_of(derivation), *ingresses), *services, *exact)
        }
        (Derivation::IngressTls { .. }, [ingresses, secrets]) => {
            ingress_tls(slot, (store_of(derivation), *ingresses), *secrets)
        }
        (Derivation::TlsCertificates { .. }, [secrets]) => tls_certificates(slot, *secrets),
        // `Stores` passes the stores `inputs()` names, so this does not happen.
        _ => Value::from(Vec::<Value>::new()),
    }
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

    use crate::store::{Error, StoreConfig, Stores};

    use super::Derivation;

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
                 "port_name": "http", "origin": ["services", "ns", "web"], "endpoints": [
                    {"name": "web-b_10.0.0.1", "address": "10.0.0.1", "port": 8080,
                     "endpoint": "10.0.0.1:8080", "ready": true, "terminating": false, "slice": "web-b"},
                    {"name": "web-b_10.0.0.2", "address": "10.0.0.2", "port": 8080,
                     "endpoint": "10.0.0.2:8080", "ready": false, "terminating": true, "slice": "web-b"},
                 ]},
                // No slice port named `admin`; the port without a number is left out.
                {"name": "ns_web_81", "namespace": "ns", "service": "web", "port": 81,
                 "port_name": "admin", "origin": ["services", "ns", "web"], "endpoints": []},
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
        assert_eq!(rows[0]["file"], "ssl/ns_good.pem");
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
    fn derive_checks_names_and_stores() {
        let mut s = stores();
        let d = Derivation::IngressRoutes {
            ingresses: "ingresses".into(),
            services: "svc".into(),
            exact: None,
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
    fn joins_pointing_at_each_other_keep_nothing_alive() {
        let mut s = Stores::new();
        s.add("x", StoreConfig::default()).unwrap();
        s.derive(
            "selfjoin",
            Derivation::IngressRoutes {
                ingresses: "x".into(),
                services: "x".into(),
                exact: None,
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
        let config = json!({
            "backends": {"kind": "serviceBackends", "services": "services",
                         "endpointSlices": "endpointslices", "routedBy": "ingresses"},
            "routes_exact": {"kind": "ingressRoutes", "ingresses": "ingresses",
                             "services": "services", "exact": true},
            "routes_prefix": {"kind": "ingressRoutes", "ingresses": "ingresses",
                              "services": "services", "exact": false},
            "tls": {"kind": "ingressTls", "ingresses": "ingresses", "secrets": "secrets"},
            "certificates": {"kind": "tlsCertificates", "secrets": "secrets"},
        });
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
