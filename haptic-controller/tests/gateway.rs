//! Gateway API through the whole system: the controller binary on the testkit API server with
//! the reference config, an agent with its HAProxy, requests through it. The controller starts
//! on a cluster without the Gateway API CRDs (Ingresses route; the gateway stores count as
//! synced), the CRDs arrive later, and a GatewayClass of ours, its Gateway and an HTTPRoute
//! then route through HAProxy and get their status, written by the leader once.

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value as Json, json};

const GROUP: &str = "gateway.networking.k8s.io";

/// A CustomResourceDefinition that keeps every field, with a status subresource.
fn crd(plural: &str, kind: &str, version: &str, namespaced: bool) -> Json {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {"plural": plural, "singular": kind.to_lowercase(), "kind": kind,
                      "listKind": format!("{kind}List")},
            "scope": if namespaced { "Namespaced" } else { "Cluster" },
            "versions": [{"name": version, "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    })
}

fn api(
    cluster: &Cluster,
    version: &str,
    kind: &str,
    plural: &str,
    namespaced: bool,
) -> Api<DynamicObject> {
    let group = if kind == "CustomResourceDefinition" {
        "apiextensions.k8s.io"
    } else {
        GROUP
    };
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    if namespaced {
        Api::namespaced_with(cluster.client.clone(), NS, &ar)
    } else {
        Api::all_with(cluster.client.clone(), &ar)
    }
}

async fn create(api: &Api<DynamicObject>, value: Json) {
    let object: DynamicObject = serde_json::from_value(value).expect("object");
    api.create(&PostParams::default(), &object)
        .await
        .expect("created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_api_crds_installed_later_then_an_http_route_routes_with_status() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    let web = Backend::start("web").await;
    cluster.service("web", web.addr).await;
    cluster.ingress("shop", "shop.example", "/", "web").await;
    let _controller = Controller::start(&cluster, "controller-1").await;
    // No Gateway API CRDs: the Ingress routes all the same.
    eventually(
        "the Ingress routes without the Gateway API",
        Duration::from_secs(30),
        || async {
            get(&agent.http_addr(), "shop.example", "/")
                .await
                .filter(|(status, body)| *status == 200 && body.contains("backend web"))
        },
    )
    .await;

    // The CRDs arrive.
    let crds = api(
        &cluster,
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
    );
    for (plural, kind, version, namespaced) in [
        ("gatewayclasses", "GatewayClass", "v1", false),
        ("gateways", "Gateway", "v1", true),
        ("httproutes", "HTTPRoute", "v1", true),
        ("referencegrants", "ReferenceGrant", "v1beta1", true),
    ] {
        create(&crds, crd(plural, kind, version, namespaced)).await;
    }
    let listener_port = free_port();
    create(
        &api(&cluster, "v1", "GatewayClass", "gatewayclasses", false),
        json!({"apiVersion": format!("{GROUP}/v1"), "kind": "GatewayClass",
            "metadata": {"name": "haptic"},
            "spec": {"controllerName": "haproxy-haptic.org/gateway-controller"}}),
    )
    .await;
    // Another controller's class: left alone, no status.
    create(
        &api(&cluster, "v1", "GatewayClass", "gatewayclasses", false),
        json!({"apiVersion": format!("{GROUP}/v1"), "kind": "GatewayClass",
            "metadata": {"name": "theirs"}, "spec": {"controllerName": "example.com/other"}}),
    )
    .await;
    let gateways = api(&cluster, "v1", "Gateway", "gateways", true);
    create(
        &gateways,
        json!({"apiVersion": format!("{GROUP}/v1"), "kind": "Gateway",
            "metadata": {"name": "gw", "namespace": NS},
            "spec": {"gatewayClassName": "haptic", "listeners": [
                {"name": "http", "protocol": "HTTP", "port": listener_port}]}}),
    )
    .await;
    let routes = api(&cluster, "v1", "HTTPRoute", "httproutes", true);
    create(
        &routes,
        json!({"apiVersion": format!("{GROUP}/v1"), "kind": "HTTPRoute",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"parentRefs": [{"name": "gw"}], "hostnames": ["gw.example"],
                "rules": [{"matches": [{"path": {"type": "Exact", "value": "/one"}}],
                           "backendRefs": [{"name": "web", "port": 80}]}]}}),
    )
    .await;

    let listener = format!("{}:{listener_port}", agent.ip);
    eventually(
        "the HTTPRoute routes on the listener's port",
        Duration::from_secs(60),
        || async {
            get(&listener, "gw.example", "/one")
                .await
                .filter(|(status, body)| *status == 200 && body.contains("backend web"))
        },
    )
    .await;
    let (status, _) = get(&listener, "gw.example", "/two")
        .await
        .expect("an answer");
    assert_eq!(status, 404, "a path no rule matches");

    let parents = eventually(
        "the HTTPRoute's parent status",
        Duration::from_secs(30),
        || async {
            let route = routes.get("web").await.ok()?;
            let parents = route.data["status"]["parents"].as_array()?.clone();
            let accepted = parents.first()?["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Accepted" && c["status"] == "True");
            accepted.then_some(parents)
        },
    )
    .await;
    assert_eq!(parents.len(), 1);
    assert_eq!(
        parents[0]["controllerName"],
        "haproxy-haptic.org/gateway-controller"
    );
    assert_eq!(parents[0]["parentRef"]["name"], "gw");
    let gateway = eventually(
        "the Gateway's addresses",
        Duration::from_secs(30),
        || async {
            let gw = gateways.get("gw").await.ok()?;
            gw.data["status"]["addresses"]
                .as_array()
                .filter(|a| !a.is_empty())?;
            Some(gw)
        },
    )
    .await;
    assert_eq!(
        gateway.data["status"]["addresses"],
        json!([{"type": "IPAddress", "value": agent.ip}])
    );
    assert_eq!(gateway.data["status"]["listeners"][0]["attachedRoutes"], 1);
    let theirs = api(&cluster, "v1", "GatewayClass", "gatewayclasses", false)
        .get("theirs")
        .await
        .expect("their class");
    assert!(
        theirs.data["status"].is_null(),
        "another controller's class gets no status"
    );
}
