//! The reference template set: Ingresses, Services, EndpointSlices and TLS Secrets to an HAProxy
//! configuration. Its sources live in `haptic-render/templates/` and are compiled into the
//! crate; the controller uses this set when its config names no other.

use serde_json::json;

use crate::derived::{Derivation, IngressClassFilter};
use crate::set::{CertificateTemplate, Template, TemplateSet};
use crate::store::{self, StoreConfig, Stores};

/// The stores the reference set reads, with their index fields:
///
/// | store | resource | indexBy |
/// | --- | --- | --- |
/// | `ingresses` | networking.k8s.io/v1 Ingress | namespace, name |
/// | `services` | v1 Service | namespace, name |
/// | `endpointslices` | discovery.k8s.io/v1 EndpointSlice | namespace, label `kubernetes.io/service-name` |
/// | `secrets` | v1 Secret | namespace, name |
/// | `auth_secrets` | v1 Secret labelled [`AUTH_SECRET_LABEL`]`=true` (htpasswd for ingress-nginx's `auth-secret`) | namespace, name |
/// | `ingressclasses` | networking.k8s.io/v1 IngressClass (cluster-scoped) | name |
/// | `gatewayclasses` | gateway.networking.k8s.io/v1 GatewayClass (cluster-scoped) | name |
/// | `gateways` | gateway.networking.k8s.io/v1 Gateway | namespace, name |
/// | `httproutes` | gateway.networking.k8s.io/v1 HTTPRoute | namespace, name |
/// | `referencegrants` | gateway.networking.k8s.io/v1beta1 ReferenceGrant | namespace, name |
/// | `namespaces` | v1 Namespace (cluster-scoped) | name |
/// | `haproxy_pods` | v1 Pod: the HAProxy pods | namespace, name |
pub const STORES: [(&str, &[&str]); 13] = [
    ("ingresses", &["metadata.namespace", "metadata.name"]),
    ("services", &["metadata.namespace", "metadata.name"]),
    (
        "endpointslices",
        &[
            "metadata.namespace",
            r#"metadata.labels["kubernetes.io/service-name"]"#,
        ],
    ),
    ("secrets", &["metadata.namespace", "metadata.name"]),
    ("auth_secrets", &["metadata.namespace", "metadata.name"]),
    ("ingressclasses", &["metadata.name"]),
    ("gatewayclasses", &["metadata.name"]),
    ("gateways", &["metadata.namespace", "metadata.name"]),
    ("httproutes", &["metadata.namespace", "metadata.name"]),
    ("referencegrants", &["metadata.namespace", "metadata.name"]),
    ("namespaces", &["metadata.name"]),
    ("haproxy_pods", &["metadata.namespace", "metadata.name"]),
    ("backend_pool", &["metadata.namespace", "metadata.name"]),
];

/// The label that opts a Secret into the `auth_secrets` store (value `true`): the htpasswd
/// Secrets ingress-nginx's `auth-secret` names. The controller watches only Secrets so
/// labelled (the API server filters them), so it never holds an application's other Opaque
/// Secrets; a user labels the htpasswd Secret when moving the Ingress over.
pub const AUTH_SECRET_LABEL: &str = "haproxy-haptic.org/auth-secret";

/// Empty stores configured as the reference set expects them ([`STORES`]), with the derived
/// views its templates read:
///
/// | view | derivation |
/// | --- | --- |
/// | `derived.backends` | [`Derivation::ServiceBackends`] of `services` and `endpointslices`, for the Service ports `ingresses` route to |
/// | `derived.routes_exact`, `derived.routes_prefix` | [`Derivation::IngressRoutes`] of `ingresses` and `services`, Exact paths and the others |
/// | `derived.tls` | [`Derivation::IngressTls`] of `ingresses` and `secrets` |
/// | `derived.ingresses` | [`Derivation::Ingresses`]: our Ingresses |
/// | `derived.default_backends` | [`Derivation::IngressDefaultBackends`] of `ingresses` and `services` |
/// | `derived.nginx_annotations` | [`Derivation::IngressAnnotations`]: our Ingresses that carry ingress-nginx annotations (their Events) |
/// | `derived.passthrough` | [`Derivation::IngressPassthrough`] of `ingresses` and `services`: the hosts whose TLS ingress-nginx's `ssl-passthrough` passes through |
/// | `derived.certificates` | [`Derivation::TlsCertificates`] of `secrets` |
/// | `derived.gateway` | [`Derivation::GatewayApi`]: Gateways of our GatewayClasses and their HTTPRoutes, conflicts with `ingresses` decided |
///
/// Every view reads only our Ingresses ([`classes`]: IngressClasses of `ingressclasses` whose
/// controller is [`crate::derived::DEFAULT_CONTROLLER`]; class-less Ingresses only through a
/// default class).
pub fn stores() -> Result<Stores, store::Error> {
    let mut stores = Stores::new();
    for (name, index) in STORES {
        stores.add(name, StoreConfig::index_by(index.iter().copied()))?;
    }
    for (name, derivation) in derivations() {
        stores.derive(name, derivation)?;
    }
    Ok(stores)
}

/// The class filter of every reference view: our IngressClasses are those of the
/// `ingressclasses` store whose `spec.controller` is [`crate::derived::DEFAULT_CONTROLLER`];
/// an Ingress without a class is ours only through a default class among them.
pub fn classes() -> IngressClassFilter {
    IngressClassFilter::new("ingressclasses")
}

/// The derived views of the reference set, by name.
pub fn derivations() -> [(&'static str, Derivation); 10] {
    let ingresses = || "ingresses".to_owned();
    let services = || "services".to_owned();
    [
        (
            "backends",
            Derivation::ServiceBackends {
                services: services(),
                endpoint_slices: "endpointslices".to_owned(),
                routed_by: Some(ingresses()),
                classes: Some(classes()),
            },
        ),
        (
            "default_backends",
            Derivation::IngressDefaultBackends {
                ingresses: ingresses(),
                services: services(),
                classes: Some(classes()),
            },
        ),
        (
            "ingresses",
            Derivation::Ingresses {
                ingresses: ingresses(),
                classes: Some(classes()),
                // The status asked for reads the row's `ref`: with no view holding the
                // Ingresses whole, their store is kept compact.
                whole: false,
            },
        ),
        (
            "nginx_annotations",
            Derivation::IngressAnnotations {
                ingresses: ingresses(),
                classes: Some(classes()),
            },
        ),
        (
            "passthrough",
            Derivation::IngressPassthrough {
                ingresses: ingresses(),
                services: services(),
                classes: Some(classes()),
            },
        ),
        (
            "routes_exact",
            Derivation::IngressRoutes {
                ingresses: ingresses(),
                services: services(),
                exact: Some(true),
                classes: Some(classes()),
            },
        ),
        (
            "routes_prefix",
            Derivation::IngressRoutes {
                ingresses: ingresses(),
                services: services(),
                exact: Some(false),
                classes: Some(classes()),
            },
        ),
        (
            "tls",
            Derivation::IngressTls {
                ingresses: ingresses(),
                secrets: "secrets".to_owned(),
                classes: Some(classes()),
            },
        ),
        (
            "certificates",
            Derivation::TlsCertificates {
                secrets: "secrets".to_owned(),
            },
        ),
        (
            "gateway",
            Derivation::GatewayApi {
                gateway_classes: "gatewayclasses".to_owned(),
                gateways: "gateways".to_owned(),
                http_routes: "httproutes".to_owned(),
                reference_grants: "referencegrants".to_owned(),
                services: services(),
                endpoint_slices: "endpointslices".to_owned(),
                secrets: "secrets".to_owned(),
                namespaces: "namespaces".to_owned(),
                pods: "haproxy_pods".to_owned(),
                controller_name: crate::derived::gateway::DEFAULT_GATEWAY_CONTROLLER.to_owned(),
                // The agent's API and probe ports (deploy/haproxy.yaml).
                reserved_ports: vec![9090, 9091],
                ingress_ports: crate::derived::IngressPorts::default(),
                // Conflicts with Ingress paths on the Ingress frontend's ports.
                ingresses: Some(ingresses()),
                classes: Some(classes()),
            },
        ),
    ]
}

fn template(source: &str) -> Template {
    Template::new(source)
}

/// The reference template set.
///
/// Outputs: `haproxy.cfg`; `maps/routes-exact.map`, `maps/routes-prefix.map` and
/// `maps/routes-regex.map` (routing; regex paths of ingress-nginx's use-regex and
/// rewrite-target); `maps/pool.map` (each plain backend's pool backend: [`crate::pool`]);
/// `maps/certs.list` (the HTTPS crt-list); `maps/ssl-redirect.map` (hosts redirected to HTTPS);
/// `maps/passthrough.map` (hosts whose TLS ingress-nginx's ssl-passthrough passes through, and
/// their TCP backends); `maps/gw-exact.map` and `maps/gw-prefix.map` (the HTTPRoute matches
/// without conditions whose rule has no filter and one backend: `<port>/<listener
/// hostname>/<host><path> <rank> <backend>`, see [`crate::derived::gateway`]);
/// `maps/gw-certs.list` (the crt-list of the HTTPS Gateway listeners on ports of their own);
/// `ssl/<bucket>/<namespace>_<secret>.pem` (`ssl_file()`) for every usable
/// TLS Secret, and for every labelled Secret with a `ca.crt` (ingress-nginx's auth-tls-secret).
///
/// `extraContext.haproxy` holds the tunables: `maxconn` (50000), `bind_address` (empty: every
/// address; `${POD_IP}` binds each pod to its own, HAProxy expanding the variable from its
/// environment), `http_port` (80),
/// `https_port` (443), `timeout_connect` (5s), `timeout_client` and `timeout_server` (50s),
/// `timeout_tunnel` (1h: WebSockets and upgraded streams), `ssl_redirect` (true: plain HTTP to
/// a host with a certificate line is redirected to HTTPS with 308; an Ingress opts out with the
/// annotation `haproxy-haptic.org/ssl-redirect: "false"`),
/// `stats_socket` (none: a path adds an admin `stats socket`), `route_debug` (false: true
/// answers requests carrying `x-haptic-route-debug` with the backend they would go to),
/// `server_slots` (10: `server` lines per backend, growing in steps of it; see
/// [`crate::slots`]), `backend_pool_step` (32: the pool of spare backends grows in steps of
/// it, so that a new Service is a runtime change; 0 turns the pool off: see [`crate::pool`]),
/// `backend_pool_reserve` (none: `"namespace/name"` of the ConfigMap in the `backend_pool`
/// store whose `data.size` sizes the pool, which the controller's leader writes in a pause so
/// that a burst of new Services finds spares: see [`crate::pool`]),
/// `health_checks` (true: `check` on every server slot; HAProxy reserves a
/// file descriptor for each checked server, disabled or not),
/// `service` (none: `"namespace/name"` of the HAProxy Service, whose load-balancer address
/// becomes every Ingress's `status.loadBalancer`), `default_certificate` (none:
/// `"namespace/name"` of a `kubernetes.io/tls` Secret served to clients whose SNI matches no
/// host or who send none; without a usable one, such clients are refused: `strict-sni`).
///
/// The templates also ask the cluster to show (the status template `cluster-view`, which
/// includes the snippet of that name and writes no file; [`crate::requests`]): a Warning Event
/// `BackendNotFound` on an Ingress path whose Service or port does not exist, and the Ingress
/// status above.
pub fn template_set() -> TemplateSet {
    let mut set = TemplateSet {
        haproxy_config: template(include_str!("../templates/haproxy.cfg.tera")),
        ..TemplateSet::default()
    };
    for (name, source) in [
        (
            "routes-exact.map",
            include_str!("../templates/maps/routes-exact.map.tera"),
        ),
        (
            "routes-prefix.map",
            include_str!("../templates/maps/routes-prefix.map.tera"),
        ),
        (
            "routes-regex.map",
            include_str!("../templates/maps/routes-regex.map.tera"),
        ),
        ("pool.map", include_str!("../templates/maps/pool.map.tera")),
        (
            "certs.list",
            include_str!("../templates/maps/certs.list.tera"),
        ),
        (
            "ssl-redirect.map",
            include_str!("../templates/maps/ssl-redirect.map.tera"),
        ),
        (
            "passthrough.map",
            include_str!("../templates/maps/passthrough.map.tera"),
        ),
        (
            "gw-exact.map",
            include_str!("../templates/maps/gw-exact.map.tera"),
        ),
        (
            "gw-prefix.map",
            include_str!("../templates/maps/gw-prefix.map.tera"),
        ),
        (
            "gw-certs.list",
            include_str!("../templates/maps/gw-certs.list.tera"),
        ),
    ] {
        set.maps.insert(name.to_owned(), template(source));
    }
    for (name, source) in [
        (
            "backends",
            include_str!("../templates/snippets/backends.tera"),
        ),
        (
            "route-entries",
            include_str!("../templates/snippets/route-entries.tera"),
        ),
        (
            "tls-entries",
            include_str!("../templates/snippets/tls-entries.tera"),
        ),
        (
            "tls-pem",
            include_str!("../templates/snippets/tls-pem.tera"),
        ),
        (
            "regex-entries",
            include_str!("../templates/snippets/regex-entries.tera"),
        ),
        (
            "redirect-entries",
            include_str!("../templates/snippets/redirect-entries.tera"),
        ),
        (
            "cluster-view-rows",
            include_str!("../templates/snippets/cluster-view-rows.tera"),
        ),
        (
            "cluster-view",
            include_str!("../templates/snippets/cluster-view.tera"),
        ),
        (
            "gateway",
            include_str!("../templates/snippets/gateway.tera"),
        ),
        (
            "gateway-rules",
            include_str!("../templates/snippets/gateway-rules.tera"),
        ),
        (
            "gateway-shared",
            include_str!("../templates/snippets/gateway-shared.tera"),
        ),
        (
            "gateway-lookup",
            include_str!("../templates/snippets/gateway-lookup.tera"),
        ),
        (
            "gateway-entries",
            include_str!("../templates/snippets/gateway-entries.tera"),
        ),
        (
            "gateway-match",
            include_str!("../templates/snippets/gateway-match.tera"),
        ),
        (
            "gateway-action",
            include_str!("../templates/snippets/gateway-action.tera"),
        ),
        (
            "gateway-backend",
            include_str!("../templates/snippets/gateway-backend.tera"),
        ),
        (
            "gateway-crt-list",
            include_str!("../templates/snippets/gateway-crt-list.tera"),
        ),
        (
            "nginx-backend",
            include_str!("../templates/snippets/nginx-backend.tera"),
        ),
        (
            "nginx-userlist",
            include_str!("../templates/snippets/nginx-userlist.tera"),
        ),
        (
            "nginx-frontend",
            include_str!("../templates/snippets/nginx-frontend.tera"),
        ),
        (
            "nginx-frontend-row",
            include_str!("../templates/snippets/nginx-frontend-row.tera"),
        ),
        (
            "passthrough",
            include_str!("../templates/snippets/passthrough.tera"),
        ),
    ] {
        set.template_snippets
            .insert(name.to_owned(), template(source));
    }
    // Apart from haproxy.cfg: an Ingress event that changes no route (a label, the status
    // the controller wrote) renders the cluster view again, not the 7 MB of haproxy.cfg.
    set.status_templates.insert(
        "cluster-view".to_owned(),
        template("{% include \"cluster-view\" %}"),
    );
    set.ssl_certificates.insert(
        "ingress-tls".to_owned(),
        CertificateTemplate {
            template: include_str!("../templates/ssl/ingress-tls.pem.tera").to_owned(),
            for_each: Some("secrets".to_owned()),
        },
    );
    set.ssl_certificates.insert(
        "ingress-client-ca".to_owned(),
        CertificateTemplate {
            template: include_str!("../templates/ssl/ingress-client-ca.pem.tera").to_owned(),
            for_each: Some("auth_secrets".to_owned()),
        },
    );
    set.extra_context.insert(
        "haproxy".to_owned(),
        json!({
            "maxconn": 50000,
            "bind_address": "",
            "http_port": 80,
            "https_port": 443,
            "timeout_connect": "5s",
            "timeout_client": "50s",
            "timeout_server": "50s",
            "timeout_tunnel": "1h",
            "ssl_redirect": true,
            "stats_socket": null,
            "route_debug": false,
            "default_certificate": null,
            "service": null,
            "server_slots": crate::slots::DEFAULT_SLOTS,
            "health_checks": true,
            "backend_pool_step": crate::pool::DEFAULT_STEP,
        }),
    );
    set
}
