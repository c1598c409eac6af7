//! The resource watchers against the testkit API server over HTTP, in process: server-side
//! selectors, a relist after 410 Expired that removes what disappeared meanwhile, and a config
//! change applied in place (an unchanged store kept without a relist, stores added and removed).

use std::{sync::Arc, time::Duration};

use haptic_controller::{
    HAProxyTemplateConfigSpec, config,
    events::{ControllerEvent, STICKY},
    state::StateCache,
    watchers,
};
use haptic_eventbus::{Config, EventBus};
use haptic_testkit::{ApiServer, Fault};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn spec(stores: serde_json::Value) -> Arc<config::ValidatedConfig> {
    let spec: HAProxyTemplateConfigSpec = serde_json::from_value(json!({
        "podSelector": {"matchLabels": {"app": "haproxy"}},
        "haproxyConfig": {"template": "global\n"},
        "watchedResources": stores,
    }))
    .expect("spec");
    Arc::new(config::validate(&spec, 1, "1").expect("valid"))
}

async fn service(api: &Api<Service>, name: &str, app: &str) {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "labels": {"app": app}},
        "spec": {"ports": [{"port": 80}]},
    }))
    .expect("service");
    api.create(&PostParams::default(), &svc)
        .await
        .expect("create");
}

/// Whether a render could run now (false while a watcher writes).
fn ready(cache: &StateCache) -> bool {
    cache.try_read().is_some_and(|state| state.ready())
}

fn names(cache: &StateCache, store: &str) -> Option<Vec<String>> {
    // Polled from async code: skipped (none) while a watcher writes.
    let state = cache.try_read()?;
    Some(
        state
            .stores
            .get(store)?
            .keys()
            .map(|(_, n)| n.to_owned())
            .collect(),
    )
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_follow_the_api_through_relists_and_config_changes() {
    let server = ApiServer::start().await.expect("server");
    let admin: Api<Service> =
        Api::namespaced(server.client_for("admin").expect("client"), "default");
    for (name, app) in [("a", "web"), ("b", "web"), ("c", "db")] {
        service(&admin, name, app).await;
    }
    let bus = EventBus::<ControllerEvent>::with_config(Config::default().with_sticky_kinds(STICKY));
    let cache = StateCache::new();
    let token = CancellationToken::new();
    let task = tokio::spawn(watchers::component(
        server.client_for("watcher").expect("client"),
        cache.clone(),
        bus.clone(),
        token.clone(),
    ));
    bus.start();

    // The first config: the render waits until every store has listed.
    let first = spec(json!({
        "services": {"apiVersion": "v1", "resources": "services", "labelSelector": "app=web"},
        "ingresses": {"apiVersion": "networking.k8s.io/v1", "resources": "ingresses"},
    }));
    assert!(!ready(&cache));
    bus.publish(ControllerEvent::ConfigValidated(first));
    eventually("both stores listed", || ready(&cache)).await;
    assert_eq!(
        names(&cache, "services"),
        Some(vec!["a".into(), "b".into()]),
        "label selector applied by the server"
    );

    // The watch is cut, b is deleted and d created while it is down, and the history is
    // compacted: the watcher's resume gets 410 and relists; b goes, d comes.
    server.inject("watcher", Fault::DropConnections);
    admin
        .delete("b", &DeleteParams::default())
        .await
        .expect("delete");
    service(&admin, "d", "web").await;
    server.compact();
    server.lift("watcher");
    eventually("the relist removed b and added d", || {
        names(&cache, "services") == Some(vec!["a".into(), "d".into()])
    })
    .await;

    // A new config in place: services unchanged (kept, no relist), ingresses dropped,
    // endpointslices added.
    server.reset_accounting();
    let second = spec(json!({
        "services": {"apiVersion": "v1", "resources": "services", "labelSelector": "app=web"},
        "endpointslices": {"apiVersion": "discovery.k8s.io/v1", "resources": "endpointslices"},
    }));
    bus.publish(ControllerEvent::ConfigValidated(second));
    eventually("the new store listed and the old one gone", || {
        ready(&cache)
            && names(&cache, "endpointslices").is_some()
            && names(&cache, "ingresses").is_none()
    })
    .await;
    assert_eq!(
        names(&cache, "services"),
        Some(vec!["a".into(), "d".into()])
    );
    let relists = server
        .requests()
        .into_iter()
        .filter(|r| r.client == "watcher" && r.resource == "services" && r.verb == "list")
        .count();
    assert_eq!(relists, 0, "the unchanged store was kept, not listed again");

    token.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("watchers stop within their bound")
        .expect("no panic");
}
