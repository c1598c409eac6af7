//! No silent stall, with real processes: a leader whose render gate panics gives its term up,
//! and the other replica leads and deploys; the panic is logged with its message and counted.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_leader_only_component_hands_the_lease_to_a_replica_that_deploys() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    let backend = Backend::start("a").await;
    cluster.service("web-a", backend.addr).await;
    cluster.ingress("shop", "shop.example", "/", "web-a").await;

    // The faulty replica leads first: its render gate panics in every term it starts.
    let faulty = Controller::start_with(
        &cluster,
        "controller-1",
        &[],
        &["--test-only-panic-in", "render-gate"],
    )
    .await;
    eventually(
        "controller-1's render gate panicked and its term ended",
        Duration::from_secs(30),
        || async {
            let logs = faulty.logs();
            (logs.contains("TEST ONLY: a panic injected into render-gate")
                && logs.contains("a leader-only component failed; standing down"))
            .then_some(())
        },
    )
    .await;
    let healthy = Controller::start(&cluster, "controller-2").await;

    // The healthy replica takes the Lease and the route goes live through it.
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let leader = cluster.leader().await;
    assert_eq!(leader.as_deref(), Some(healthy.name.as_str()));
    // The live set came from the healthy replica.
    agent.await_live_from(&healthy.name).await;

    // The failure is counted, and the faulty replica is still a healthy follower.
    let (status, page) = get(
        &format!("127.0.0.1:{}", faulty.health),
        "localhost",
        "/metrics",
    )
    .await
    .expect("/metrics");
    assert_eq!(status, 200);
    assert!(
        page.lines()
            .any(|l| l.starts_with("haptic_component_failures_total")
                && l.contains("component=\"render-gate\"")
                && l.contains("cause=\"panic\"")),
        "{page}"
    );
    assert_eq!(faulty.probe("/healthz").await, Some(200));
}
