//! The main path with real processes: two controller replicas, agents with supervised HAProxy,
//! Ingresses created through the API server, and real HTTP requests through HAProxy.

mod common;

use std::time::Duration;

use common::*;

/// One cluster for the checks of the main path, in order: each check waits for its own state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_to_haproxy_on_every_pod() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    let agents = [
        Agent::start(&cluster, 1, agent_port, http_port).await,
        Agent::start(&cluster, 2, agent_port, http_port).await,
    ];
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    cluster.service("web-a", a.addr).await;
    cluster.service("web-b", b.addr).await;
    let c1 = Controller::start(&cluster, "controller-1").await;
    let c2 = Controller::start(&cluster, "controller-2").await;

    // An Ingress created through the API routes on both pods.
    cluster.ingress("shop", "shop.example", "/", "web-a").await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }
    // Its path and backend change: routing follows.
    cluster
        .ingress("shop", "shop.example", "/v2", "web-b")
        .await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/v2/cart", (200, "backend b"))
            .await;
        agent
            .await_route("shop.example", "/", (404, "no route"))
            .await;
    }
    // Deleted: the route is gone.
    cluster.delete_ingress("shop").await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/v2", (404, "no route"))
            .await;
    }

    // The leader wrote the status: Valid, and Deployed on both pods.
    let status = eventually(
        "status Valid and Deployed 2/2",
        Duration::from_secs(20),
        || async {
            let status = cluster.htc_status().await?;
            let deployed = status["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "Deployed")?;
            (status["validationStatus"] == "Valid"
                && deployed["status"] == "True"
                && deployed["message"].as_str()?.starts_with("2/2 pods run"))
            .then_some(status)
        },
    )
    .await;
    assert_eq!(status["observedGeneration"], 1, "{status}");
    let leader = cluster.leader().await.expect("a leader");
    assert!(leader == c1.name || leader == c2.name);
    for c in [&c1, &c2] {
        assert_eq!(c.probe("/readyz").await, Some(200), "{} ready", c.name);
        assert_eq!(c.probe("/healthz").await, Some(200), "{} healthy", c.name);
    }
    drop((c1, c2, agents));
}
