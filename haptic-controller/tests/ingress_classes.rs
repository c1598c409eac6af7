//! Ingress classes and conflicts through the whole system: the controller binary on the
//! testkit API server with the reference config, an agent with its HAProxy, requests through
//! it. Two namespaces claim one host and path (the older Ingress serves, the other gets an
//! Event naming it, deleting the older hands the route over); an Ingress of another
//! controller's class is left alone (no route, no status, no Event) until it moves to ours.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::{
    core::v1::Service,
    discovery::v1::EndpointSlice,
    events::v1::Event,
    networking::v1::{Ingress, IngressClass},
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// The second tenant's namespace.
const OTHER: &str = "tenant-b";

/// An Ingress of `class` in `namespace` routing `host` / (Prefix) to `service` port `http`.
fn ingress_in(namespace: &str, name: &str, class: &str, host: &str, service: &str) -> Ingress {
    let mut ing = ingress(name, host, "/", service);
    ing.metadata.namespace = Some(namespace.to_owned());
    if let Some(spec) = ing.spec.as_mut() {
        spec.ingress_class_name = Some(class.to_owned());
    }
    ing
}

/// The first Event in `namespace` about the Ingress `name` with `reason`.
async fn await_ingress_event(
    cluster: &Cluster,
    namespace: &str,
    name: &str,
    reason: &str,
) -> Event {
    let api: Api<Event> = Api::namespaced(cluster.client.clone(), namespace);
    eventually(
        &format!("an Event {reason} on Ingress {namespace}/{name}"),
        Duration::from_secs(30),
        || async {
            let events = api.list(&Default::default()).await.ok()?;
            events.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_and_conflicts_through_the_controller() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    let mut spec = spec(agent_port, http_port);
    spec.templating_settings
        .extra_context
        .get_mut("haproxy")
        .expect("tunables")["service"] = json!(format!("{NS}/haproxy"));
    cluster.apply_htc(&spec).await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    cluster.service("web", a.addr).await;
    // The second tenant's namespace and Service, to backend b.
    let namespace: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": OTHER}})).expect("namespace");
    Api::all(cluster.client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("tenant-b");
    let services: Api<Service> = Api::namespaced(cluster.client.clone(), OTHER);
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": OTHER},
        "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
    }))
    .expect("service");
    services
        .create(&PostParams::default(), &service)
        .await
        .expect("service in tenant-b");
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": OTHER, "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": b.addr.port(), "protocol": "TCP"}],
        "endpoints": [{"addresses": [b.addr.ip().to_string()], "conditions": {"ready": true}}],
    }))
    .expect("slice");
    Api::<EndpointSlice>::namespaced(cluster.client.clone(), OTHER)
        .create(&PostParams::default(), &slice)
        .await
        .expect("slice in tenant-b");
    // Another controller's IngressClass.
    let nginx: IngressClass = serde_json::from_value(json!({
        "metadata": {"name": "nginx"}, "spec": {"controller": "k8s.io/ingress-nginx"},
    }))
    .expect("class");
    Api::<IngressClass>::all(cluster.client.clone())
        .create(&PostParams::default(), &nginx)
        .await
        .expect("nginx class");
    // The HAProxy Service with an address: our Ingresses' status gets it.
    let lb_api = cluster.api::<Service>();
    let lb: Service = serde_json::from_value(json!({
        "metadata": {"name": "haproxy", "namespace": NS},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }))
    .expect("service");
    lb_api
        .create(&PostParams::default(), &lb)
        .await
        .expect("LB service");
    lb_api
        .patch_status(
            "haproxy",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}})),
        )
        .await
        .expect("LB address");
    let _controller = Controller::start(&cluster, "controller-1").await;

    // The first tenant claims shared.example; the second claims it later: the first serves
    // (created first, or in the same second and first by namespace), the second is told.
    let ours = cluster.api::<Ingress>();
    let theirs_ns: Api<Ingress> = Api::namespaced(cluster.client.clone(), OTHER);
    ours.create(
        &PostParams::default(),
        &ingress_in(NS, "site", CLASS, "shared.example", "web"),
    )
    .await
    .expect("first claim");
    agent
        .await_route("shared.example", "/", (200, "backend a"))
        .await;
    theirs_ns
        .create(
            &PostParams::default(),
            &ingress_in(OTHER, "site", CLASS, "shared.example", "web"),
        )
        .await
        .expect("second claim");
    let event = await_ingress_event(&cluster, OTHER, "site", "RouteConflict").await;
    let note = event.note.unwrap_or_default();
    assert!(
        note.contains(&format!("older Ingress {NS}/site")),
        "the Event names the winner: {note}"
    );
    agent
        .await_route("shared.example", "/", (200, "backend a"))
        .await;

    // An Ingress of another class: no route, no status, no Event.
    ours.create(
        &PostParams::default(),
        &ingress_in(NS, "theirs", "nginx", "theirs.example", "web"),
    )
    .await
    .expect("nginx's Ingress");
    // Our Ingress gets its status once the leader has rendered with the nginx one stored.
    eventually("status on our Ingress", Duration::from_secs(30), || async {
        let ing = ours.get("site").await.ok()?;
        ing.status?.load_balancer?.ingress?.first()?.ip.clone()
    })
    .await;
    agent
        .await_route("theirs.example", "/", (404, "no route"))
        .await;
    let theirs = ours.get("theirs").await.expect("theirs");
    assert!(
        theirs
            .status
            .and_then(|s| s.load_balancer?.ingress)
            .is_none(),
        "no status on another class's Ingress"
    );
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), NS);
    let about_theirs = events
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("theirs"))
        .count();
    assert_eq!(about_theirs, 0, "no Event about another class's Ingress");

    // Deleting the winner hands the route over to the other tenant.
    ours.delete("site", &DeleteParams::default())
        .await
        .expect("delete the winner");
    agent
        .await_route("shared.example", "/", (200, "backend b"))
        .await;

    // Moving to our class gains the routes; moving away loses them.
    let class = |name: &str| Patch::Merge(json!({"spec": {"ingressClassName": name}}));
    ours.patch("theirs", &PatchParams::default(), &class(CLASS))
        .await
        .expect("to our class");
    agent
        .await_route("theirs.example", "/", (200, "backend a"))
        .await;
    ours.patch("theirs", &PatchParams::default(), &class("nginx"))
        .await
        .expect("back to nginx");
    agent
        .await_route("theirs.example", "/", (404, "no route"))
        .await;
}
