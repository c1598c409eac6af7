//! One tenant's bad object never stops another tenant's change, with real processes: a
//! controller, an agent with supervised HAProxy, objects in two namespaces created through the
//! API server, and HTTP requests through HAProxy.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::*;
use haptic_render::functions::ssl_file;
use k8s_openapi::api::{
    core::v1::{Secret, Service},
    discovery::v1::EndpointSlice,
    events::v1::Event,
    networking::v1::Ingress,
};
use kube::{Api, api::PostParams};
use serde_json::json;

const A: &str = "tenant-a";
const B: &str = "tenant-b";

async fn create<K>(cluster: &Cluster, namespace: &str, object: serde_json::Value)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    <K as kube::Resource>::DynamicType: Default,
{
    let what = object.to_string();
    let object: K = serde_json::from_value(object).expect("object");
    Api::<K>::namespaced(cluster.client.clone(), namespace)
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {what}: {e}"));
}

/// A Service `web` in `namespace` whose one endpoint is `backend`.
async fn service_in(cluster: &Cluster, namespace: &str, backend: SocketAddr) {
    create::<Service>(
        cluster,
        namespace,
        json!({"metadata": {"name": "web", "namespace": namespace},
               "spec": {"ports": [{"name": "http", "port": 80, "targetPort": backend.port(), "protocol": "TCP"}]}}),
    )
    .await;
    create::<EndpointSlice>(
        cluster,
        namespace,
        json!({"metadata": {"name": "web-1", "namespace": namespace, "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv4",
               "ports": [{"name": "http", "port": backend.port(), "protocol": "TCP"}],
               "endpoints": [{"addresses": [backend.ip().to_string()], "conditions": {"ready": true}}]}),
    )
    .await;
}

/// An Ingress routing `host` `/` to Service `web`, with TLS from `secret` when given.
async fn ingress_in(
    cluster: &Cluster,
    namespace: &str,
    name: &str,
    host: &str,
    secret: Option<&str>,
    annotations: serde_json::Value,
) {
    let tls = secret.map_or(json!([]), |s| json!([{"hosts": [host], "secretName": s}]));
    create::<Ingress>(
        cluster,
        namespace,
        json!({"metadata": {"name": name, "namespace": namespace, "annotations": annotations},
               "spec": {"ingressClassName": common::CLASS, "tls": tls, "rules": [{"host": host, "http": {"paths": [{"path": "/", "pathType": "Prefix",
                   "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}}),
    )
    .await;
}

/// A `kubernetes.io/tls` Secret holding `crt` and `key`.
async fn tls_secret_in(cluster: &Cluster, namespace: &str, name: &str, crt: &str, key: &str) {
    create::<Secret>(
        cluster,
        namespace,
        json!({"metadata": {"name": name, "namespace": namespace}, "type": "kubernetes.io/tls",
               "data": {"tls.crt": base64(crt), "tls.key": base64(key)}}),
    )
    .await;
}

/// A self-signed P-256 certificate for `host` (valid between the two years) and its key.
fn generated(host: &str, years: (i32, i32)) -> (String, String) {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = rcgen::CertificateParams::new(vec![host.to_owned()]).expect("params");
    params.not_before = rcgen::date_time_ymd(years.0, 1, 1);
    params.not_after = rcgen::date_time_ymd(years.1, 1, 1);
    let cert = params.self_signed(&key).expect("certificate");
    (cert.pem(), key.serialize_pem())
}

/// The first Event about the object `namespace/name` with `reason` whose note holds `note`.
async fn await_event_on(
    cluster: &Cluster,
    namespace: &str,
    name: &str,
    reason: &str,
    note: &str,
) -> Event {
    let api = Api::<Event>::all(cluster.client.clone());
    eventually(
        &format!("an Event {reason} on {namespace}/{name} saying {note:?}"),
        Duration::from_secs(30),
        || async {
            let events = api.list(&Default::default()).await.ok()?;
            events.items.into_iter().find(|e| {
                let regarding = e.regarding.as_ref();
                e.reason.as_deref() == Some(reason)
                    && regarding.and_then(|r| r.name.as_deref()) == Some(name)
                    && regarding.and_then(|r| r.namespace.as_deref()) == Some(namespace)
                    && e.note.as_deref().is_some_and(|n| n.contains(note))
            })
        },
    )
    .await
}

/// The reference config, with one test hook: an Ingress annotation
/// `haptic.test/crt-options` is copied into its crt-list line, as a template that trusts an
/// annotation would (HAProxy refuses an unknown option: what templates cannot check).
fn spec_with_crt_options(
    agent_port: u16,
    http_port: u16,
) -> haptic_controller::HAProxyTemplateConfigSpec {
    let mut spec = spec(agent_port, http_port);
    let snippet = &mut spec
        .template_snippets
        .get_mut("tls-entries")
        .expect("tls-entries snippet")
        .template;
    let patched = snippet.replacen(
        "{{ row.file }}",
        "{{ row.file }}{% set ing = [\"ingresses\", row.namespace, row.ingress] | get %}\
         {% if ing.metadata.annotations and ing.metadata.annotations[\"haptic.test/crt-options\"] %} \
         [{{ ing.metadata.annotations[\"haptic.test/crt-options\"] }}]{% endif %}",
        1,
    );
    assert_ne!(
        &patched, snippet,
        "the crt-list line is where the test expects it"
    );
    *snippet = patched;
    // The default certificate the controller generates in its namespace.
    spec.templating_settings
        .extra_context
        .get_mut("haproxy")
        .expect("tunables")["default_certificate"] = json!(format!(
        "{NS}/{}",
        haptic_controller::default_certificate::DEFAULT_SECRET
    ));
    spec
}

/// The subject and names of the certificate `addr` serves for `sni` (none: no SNI).
async fn served_subject(addr: &str, sni: Option<&str>) -> Option<String> {
    let der = served_certificate(addr, sni).await?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    let subject = cert.subject().to_string();
    let sans = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| format!("{:?}", san.value.general_names))
        .unwrap_or_default();
    Some(format!("{subject} {sans}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_bad_object_never_stops_another_tenants_change() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster
        .apply_htc(&spec_with_crt_options(agent_port, http_port))
        .await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    for namespace in [A, B] {
        let ns: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("namespace");
        Api::all(cluster.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("namespace created");
    }
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    service_in(&cluster, A, a.addr).await;
    service_in(&cluster, B, b.addr).await;
    let generate = [(
        "HAPTIC_DEFAULT_CERTIFICATE_SECRET",
        haptic_controller::default_certificate::DEFAULT_SECRET,
    )];
    let controller = Controller::start_with_env(&cluster, "controller-1", &generate).await;

    // Tenant A: a Secret whose key is another certificate's (PEM markers and all), and an
    // Ingress using it. Tenant B: a plain change. B's route goes live; A's Ingress is told why
    // its host has no certificate, and its route still works over HTTP.
    let (crt, _) = generated("a.example", (2020, 4000));
    let (_, other_key) = generated("other.example", (2020, 4000));
    tls_secret_in(&cluster, A, "a-tls", &crt, &other_key).await;
    ingress_in(&cluster, A, "a", "a.example", Some("a-tls"), json!({})).await;
    ingress_in(&cluster, B, "b", "b.example", None, json!({})).await;
    agent
        .await_route("b.example", "/", (200, "backend b"))
        .await;
    agent
        .await_route("a.example", "/", (200, "backend a"))
        .await;
    let warning = await_event_on(&cluster, A, "a", "TLSSecretUnusable", "a-tls").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert!(
        warning
            .note
            .as_deref()
            .is_some_and(|n| n.contains("does not match the certificate")),
        "{warning:?}"
    );
    let live = agent.data.join("current");
    assert!(!live.join(ssl_file(A, "a-tls")).exists());

    // An expired certificate is left out the same way.
    let (old_crt, old_key) = generated("old.example", (2020, 2021));
    tls_secret_in(&cluster, B, "old-tls", &old_crt, &old_key).await;
    ingress_in(
        &cluster,
        B,
        "old",
        "old.example",
        Some("old-tls"),
        json!({}),
    )
    .await;
    agent
        .await_route("old.example", "/", (200, "backend b"))
        .await;
    await_event_on(&cluster, B, "old", "TLSSecretUnusable", "expired at").await;
    assert!(!live.join(ssl_file(B, "old-tls")).exists());

    // Something templates cannot check: tenant A's Ingress carries a crt-list option HAProxy
    // refuses. The line is traced to that Ingress, which is left out and told why; tenant B's
    // change made meanwhile goes live, and so does the rest of A's set.
    let (good_crt, good_key) = generated("evil.example", (2020, 4000));
    tls_secret_in(&cluster, A, "evil-tls", &good_crt, &good_key).await;
    ingress_in(
        &cluster,
        A,
        "evil",
        "evil.example",
        Some("evil-tls"),
        json!({"haptic.test/crt-options": "no-such-option"}),
    )
    .await;
    ingress_in(&cluster, B, "b2", "b2.example", None, json!({})).await;
    agent
        .await_route("b2.example", "/", (200, "backend b"))
        .await;
    let refused = await_event_on(&cluster, A, "evil", "HAProxyRefused", "no-such-option").await;
    assert!(
        refused
            .note
            .as_deref()
            .is_some_and(|n| n.contains("maps/certs.list")),
        "{refused:?}"
    );
    assert_eq!(
        get(&agent.http_addr(), "evil.example", "/")
            .await
            .map(|r| r.0),
        Some(404),
        "the refused Ingress is left out"
    );
    agent
        .await_route("a.example", "/", (200, "backend a"))
        .await;
    // A later change of another tenant goes live too (the object stays left out, the gate
    // does not hold the set).
    ingress_in(&cluster, B, "b3", "b3.example", None, json!({})).await;
    agent
        .await_route("b3.example", "/", (200, "backend b"))
        .await;
    assert!(
        controller.logs().contains("rendering without it"),
        "the controller says what it left out"
    );

    // The default certificate, generated by the controller into a Secret of its namespace:
    // a client whose SNI matches no host, or that sends none, completes its handshake with it;
    // a client asking for a host with a certificate gets that one.
    let https = format!("{}:{}", agent.ip, http_port + 1);
    let default = |subject: &str| subject.contains("CN=haptic-default");
    for sni in [Some("unknown.example"), None] {
        eventually(
            &format!("the default certificate for SNI {sni:?}"),
            Duration::from_secs(30),
            || async { served_subject(&https, sni).await.filter(|s| default(s)) },
        )
        .await;
    }
    let (good_crt, good_key) = generated("good.example", (2020, 4000));
    tls_secret_in(&cluster, B, "good-tls", &good_crt, &good_key).await;
    ingress_in(
        &cluster,
        B,
        "good",
        "good.example",
        Some("good-tls"),
        json!({}),
    )
    .await;
    eventually(
        "good.example's own certificate for its SNI",
        Duration::from_secs(30),
        || async {
            served_subject(&https, Some("good.example"))
                .await
                .filter(|s| !default(s) && s.contains("good.example"))
        },
    )
    .await;
    // The refused Ingress is left out, certificate and all: its host gets the default.
    let evil = served_subject(&https, Some("evil.example"))
        .await
        .expect("a handshake for a left-out host");
    assert!(default(&evil), "{evil}");
    let stored = Api::<Secret>::namespaced(cluster.client.clone(), NS)
        .get(haptic_controller::default_certificate::DEFAULT_SECRET)
        .await
        .expect("the default certificate's Secret");
    assert_eq!(stored.type_.as_deref(), Some("kubernetes.io/tls"));
    // A second replica (and a restart) keeps the Secret there: it is never replaced.
    let second = Controller::start_with_env(&cluster, "controller-2", &generate).await;
    eventually(
        "the second replica found the default certificate",
        Duration::from_secs(20),
        || async {
            second
                .logs()
                .contains("the default certificate's Secret exists")
                .then_some(())
        },
    )
    .await;
    let again = Api::<Secret>::namespaced(cluster.client.clone(), NS)
        .get(haptic_controller::default_certificate::DEFAULT_SECRET)
        .await
        .expect("the default certificate's Secret");
    assert_eq!(
        again.metadata.resource_version,
        stored.metadata.resource_version
    );
    assert_eq!(again.data, stored.data);
}

/// A line of more than 64 words (more than HAProxy reads) written from one tenant's object:
/// the render gate refuses it before `haproxy -c`, traces it to that object, which is left out
/// and told why, and the other tenant's change goes live. The reference config with one test
/// hook: a Service annotation `haptic.test/acl` copied into an ACL of its backend, as a
/// template that trusts an annotation would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_line_over_64_words_leaves_only_its_object_out() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    let mut spec = spec(agent_port, http_port);
    let snippet = &mut spec
        .template_snippets
        .get_mut("backends")
        .expect("backends snippet")
        .template;
    let plain = "backend {{ row.name }}\n    balance roundrobin";
    let patched = snippet.replacen(
        plain,
        &format!(
            "{plain}{{% set svc = [\"services\", row.namespace, row.service] | get %}}\
             {{% if svc and svc.metadata.annotations and svc.metadata.annotations[\"haptic.test/acl\"] %}}\n    \
             acl haptic_test path {{{{ svc.metadata.annotations[\"haptic.test/acl\"] }}}}{{% endif %}}"
        ),
        1,
    );
    assert_ne!(
        &patched, snippet,
        "the backend is where the test expects it"
    );
    *snippet = patched;
    cluster.apply_htc(&spec).await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    for namespace in [A, B] {
        let ns: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("namespace");
        Api::all(cluster.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("namespace created");
    }
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    service_in(&cluster, B, b.addr).await;
    let _controller = Controller::start(&cluster, "controller-1").await;
    ingress_in(&cluster, B, "b", "b.example", None, json!({})).await;
    agent
        .await_route("b.example", "/", (200, "backend b"))
        .await;

    // Tenant A's Service writes a line of 65 words (3 + 62 patterns); tenant B's change made
    // meanwhile goes live.
    let patterns = |words: usize| {
        (3..words)
            .map(|i| format!("/p{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    create::<Service>(
        &cluster,
        A,
        json!({"metadata": {"name": "web", "namespace": A,
                            "annotations": {"haptic.test/acl": patterns(65)}},
               "spec": {"ports": [{"name": "http", "port": 80, "targetPort": a.addr.port(), "protocol": "TCP"}]}}),
    )
    .await;
    create::<EndpointSlice>(
        &cluster,
        A,
        json!({"metadata": {"name": "web-1", "namespace": A, "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv4",
               "ports": [{"name": "http", "port": a.addr.port(), "protocol": "TCP"}],
               "endpoints": [{"addresses": [a.addr.ip().to_string()], "conditions": {"ready": true}}]}),
    )
    .await;
    ingress_in(&cluster, A, "a", "a.example", None, json!({})).await;
    ingress_in(&cluster, B, "b2", "b2.example", None, json!({})).await;
    agent
        .await_route("b2.example", "/", (200, "backend b"))
        .await;
    let refused = await_event_on(&cluster, A, "web", "HAProxyRefused", "too many words").await;
    assert!(
        refused
            .note
            .as_deref()
            .is_some_and(|n| n.contains("HAProxy reads at most 64 words a line")),
        "{refused:?}"
    );
    // The Service is left out as if deleted: its Ingress's path has no backend.
    await_event_on(&cluster, A, "a", "BackendNotFound", "web").await;
    assert_ne!(
        get(&agent.http_addr(), "a.example", "/").await.map(|r| r.0),
        Some(200),
        "the refused Service is left out"
    );
    agent
        .await_route("b.example", "/", (200, "backend b"))
        .await;
}
