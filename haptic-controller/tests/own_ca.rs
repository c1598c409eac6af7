//! The agent channel with nothing configured: the controller generates a CA once, keeps it in
//! a Secret it owns, issues the agents' certificate into the Secret their pods mount, and
//! reaches them over mutual TLS with a client certificate of its own.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Secret;

fn key(secret: &Secret, key: &str) -> Option<Vec<u8>> {
    secret.data.as_ref()?.get(key).map(|b| b.0.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_own_ca_secures_the_channel() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    let backend = Backend::start("a").await;
    cluster.service("web-a", backend.addr).await;
    cluster.ingress("shop", "shop.example", "/", "web-a").await;

    let first = Controller::start_with_own_ca(&cluster, "controller-1").await;
    let secrets = cluster.api::<Secret>();
    let agents = eventually(
        "the controller issued the agents' Secret",
        Duration::from_secs(30),
        || async { secrets.get_opt("haptic-agent-tls").await.ok().flatten() },
    )
    .await;
    let ca = secrets
        .get("haptic-agent-ca")
        .await
        .expect("the CA's Secret");
    assert!(key(&ca, "ca.key").is_some(), "the CA keeps its key");
    assert!(
        key(&agents, "ca.key").is_none() && key(&agents, "tls.key").is_some(),
        "the agents' Secret holds their key and no CA key"
    );
    assert_eq!(key(&agents, "ca.crt"), key(&ca, "ca.crt"));
    // A second replica reads the same CA rather than making its own.
    let second = Controller::start_with_own_ca(&cluster, "controller-2").await;

    // The agent serves what its pod would mount from that Secret (the test PKI's file paths,
    // overwritten), requiring client certificates from the controller's CA.
    for (file, name) in [
        (&cluster.pki.agent_cert, "tls.crt"),
        (&cluster.pki.agent_key, "tls.key"),
        (&cluster.pki.ca, "ca.crt"),
    ] {
        std::fs::write(file, key(&agents, name).expect("a file of the Secret")).expect("write");
    }
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let after = secrets
        .get("haptic-agent-ca")
        .await
        .expect("the CA's Secret");
    assert_eq!(
        key(&after, "ca.crt"),
        key(&ca, "ca.crt"),
        "generated once: the second replica kept it"
    );
    let logs = first.logs() + &second.logs();
    assert!(
        logs.contains("the agent channel is mutual TLS from the controller's own CA"),
        "{logs}"
    );
    assert!(!logs.contains("BEGIN PRIVATE KEY"), "no key in the logs");
}
