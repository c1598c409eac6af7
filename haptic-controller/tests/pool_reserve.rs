//! The backend pool's reserve with real processes (`pool_keeper`): the leader grows the pool
//! ahead of need when the rendered sets pause (a ConfigMap every replica reads), so that a
//! burst of new Services takes spares the running HAProxy has, with no reload; a new leader
//! sizes the pool alike (its first apply reloads nothing) and keeps the reserve in turn.

mod common;

use std::time::Duration;

use common::*;
use haptic_render::pool;
use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::json;

/// The pool's step here: small, so that a few Services cross the steps.
const STEP: usize = 2;
/// The Services before the burst, and those of the burst.
const BASE: usize = 20;
const BURST: usize = 7;

/// HAProxy reloads the agent made (its reload histogram's count).
async fn reloads(agent: &Agent) -> u64 {
    let text = agent.fetch("/metrics").await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("haptic_agent_reload_duration_seconds_count"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Whether the agent has no apply in flight.
async fn idle(agent: &Agent) -> bool {
    agent.fetch("/metrics").await.is_some_and(|page| {
        page.lines().any(|line| {
            line.strip_prefix("haptic_agent_applies_in_flight ")
                .is_some_and(|v| v.trim() == "0")
        })
    })
}

/// The pool backends in the agent's live `haproxy.cfg`.
fn live_pool(agent: &Agent) -> usize {
    std::fs::read_to_string(agent.data.join("current/haproxy.cfg"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("backend pool_"))
        .count()
}

/// The reserve the ConfigMap holds.
async fn reserve(cluster: &Cluster) -> Option<usize> {
    let held = cluster
        .api::<ConfigMap>()
        .get_opt("haptic-backend-pool")
        .await
        .ok()
        .flatten()?;
    held.data?.get("size")?.parse().ok()
}

/// Waits until the reserve's ConfigMap holds `size`, the agent's live config has a pool of
/// that size and no apply is in flight.
async fn await_pool(cluster: &Cluster, agent: &Agent, size: usize) {
    eventually(
        &format!("the reserve {size} written and live"),
        Duration::from_secs(60),
        || async {
            (reserve(cluster).await == Some(size) && live_pool(agent) == size && idle(agent).await)
                .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_cluster_grows_its_pool_ahead_so_that_a_burst_reloads_nothing() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    let mut spec = spec(agent_port, http_port);
    if let Some(haproxy) = spec
        .templating_settings
        .extra_context
        .get_mut("haproxy")
        .and_then(|v| v.as_object_mut())
    {
        haproxy.insert("backend_pool_step".into(), json!(STEP));
    }
    with_pool_reserve(&mut spec);
    cluster.apply_htc(&spec).await;
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    let backend = Backend::start("a").await;
    for k in 0..BASE {
        let name = format!("s{k}");
        cluster.service(&name, backend.addr).await;
        cluster
            .ingress(&name, &format!("s{k}.example"), "/", &name)
            .await;
    }
    let mut replicas = vec![
        Controller::start(&cluster, "controller-1").await,
        Controller::start(&cluster, "controller-2").await,
    ];
    agent
        .await_route(&format!("s{}.example", BASE - 1), "/", (200, "backend a"))
        .await;

    // The Services' own size leaves fewer spares than three tenths of them: in the pause
    // after the first deployment, the leader grows the pool ahead of need (one reload).
    let ahead = pool::ahead(BASE, STEP);
    assert!(ahead > pool::size(BASE, STEP), "the test needs a growth");
    await_pool(&cluster, &agent, ahead).await;
    let before = reloads(&agent).await;
    // Written under this config's name.
    let held = cluster
        .api::<ConfigMap>()
        .get(haptic_controller::pool_keeper::DEFAULT_NAME)
        .await
        .expect("the reserve");
    assert_eq!(
        held.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(haptic_controller::pool_keeper::OWNER_ANNOTATION)),
        Some(&format!("{NS}/{HTC}"))
    );

    // A burst that crosses the Services' own steps (each a reload without the reserve) but
    // stays within the reserve: every new Service routed, no reload.
    assert!(pool::size(BASE + BURST, STEP) != pool::size(BASE, STEP));
    assert!(BASE + BURST < ahead);
    for k in BASE..BASE + BURST {
        let name = format!("s{k}");
        cluster.service(&name, backend.addr).await;
        cluster
            .ingress(&name, &format!("s{k}.example"), "/", &name)
            .await;
        agent
            .await_route(&format!("s{k}.example"), "/", (200, "backend a"))
            .await;
    }
    eventually("the burst applied", Duration::from_secs(30), || async {
        idle(&agent).await.then_some(())
    })
    .await;
    // Read before the reserve: a reload counted while the reserve is still the one written
    // before the burst is not the keeper's growth after it (written before it reloads).
    let after = reloads(&agent).await;
    let reserve = reserve(&cluster).await;
    if reserve == Some(ahead) {
        assert_eq!(after, before, "a burst within the reserve");
    } else {
        // This machine took longer than the keeper's pause to apply the burst's last change:
        // the keeper grew the pool since (one reload at most).
        eprintln!("the reserve changed before the burst's reloads were read: {reserve:?}");
        assert!(after <= before + 1, "{after} reloads after {before}");
    }

    // The leader goes; the other sizes the pool by the same reserve: its first apply changes
    // nothing HAProxy runs. In its own pause it grows the pool again (fewer spares than three
    // tenths of the Services now), once.
    let leader = eventually("a leader", Duration::from_secs(30), || cluster.leader()).await;
    let at = replicas
        .iter()
        .position(|c| c.name == leader)
        .expect("the leader is ours");
    let mut leaving = replicas.remove(at);
    leaving.signal("TERM");
    leaving.exited(Duration::from_secs(25)).await;
    let next = eventually("a new leader", Duration::from_secs(30), || async {
        cluster.leader().await.filter(|l| *l != leader)
    })
    .await;
    agent.await_live_from(&next).await;
    let again = pool::ahead(BASE + BURST, STEP);
    assert!(again > ahead);
    await_pool(&cluster, &agent, again).await;
    // The new leader's first apply reloaded nothing: the one reload is the growth.
    assert_eq!(
        reloads(&agent).await,
        before + 1,
        "one growth, in the pause"
    );
    for k in 0..BASE + BURST {
        agent
            .await_route(&format!("s{k}.example"), "/", (200, "backend a"))
            .await;
    }
}

/// Two configs whose reserve is the same ConfigMap (a second controller in the namespace,
/// deployed from a copy of the first's config) would overwrite each other's reserve in every
/// pause, each write a reload of the other's fleet. The keeper writes its config's name on the
/// ConfigMap and leaves one another config keeps alone, saying which and what to change; its
/// own pool is sized by what is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_another_config_keeps_is_left_alone() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    let mut spec = spec(agent_port, http_port);
    if let Some(haproxy) = spec
        .templating_settings
        .extra_context
        .get_mut("haproxy")
        .and_then(|v| v.as_object_mut())
    {
        haproxy.insert("backend_pool_step".into(), json!(STEP));
    }
    with_pool_reserve(&mut spec);
    cluster.apply_htc(&spec).await;
    // Kept by another config, at a size that is not what this one's pool wants.
    let other = format!("{NS}/internal");
    let theirs = pool::size(BASE, STEP);
    assert_ne!(
        theirs,
        pool::ahead(BASE, STEP),
        "the test needs a reserve to fight over"
    );
    let configmap: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": haptic_controller::pool_keeper::DEFAULT_NAME, "namespace": NS,
            "labels": {haptic_controller::pool_keeper::LABEL: "true"},
            "annotations": {haptic_controller::pool_keeper::OWNER_ANNOTATION: other}},
        "data": {"size": theirs.to_string()},
    }))
    .expect("configmap");
    cluster
        .api::<ConfigMap>()
        .create(&Default::default(), &configmap)
        .await
        .expect("the other config's reserve");
    let agent = Agent::start(&cluster, 1, agent_port, http_port).await;
    let backend = Backend::start("a").await;
    for k in 0..BASE {
        let name = format!("s{k}");
        cluster.service(&name, backend.addr).await;
        cluster
            .ingress(&name, &format!("s{k}.example"), "/", &name)
            .await;
    }
    let controller = Controller::start(&cluster, "controller-1").await;
    agent
        .await_route(&format!("s{}.example", BASE - 1), "/", (200, "backend a"))
        .await;
    // In the pause after the first deployment the keeper would write its reserve: it says why
    // it does not.
    eventually(
        "the keeper leaves the ConfigMap",
        Duration::from_secs(60),
        || async {
            controller
                .logs()
                .lines()
                .any(|line| {
                    line.contains("kept by another HAProxyTemplateConfig")
                        && line.contains(&other)
                        && line.contains("backend_pool_reserve")
                })
                .then_some(())
        },
    )
    .await;
    let held = cluster
        .api::<ConfigMap>()
        .get(haptic_controller::pool_keeper::DEFAULT_NAME)
        .await
        .expect("the reserve");
    assert_eq!(
        reserve(&cluster).await,
        Some(theirs),
        "the other config's reserve overwritten"
    );
    assert_eq!(
        haptic_controller::pool_keeper::kept_by_another(&held, &format!("{NS}/{HTC}")),
        Some(other.as_str())
    );
    // This config's routes are served all the same.
    for k in 0..BASE {
        agent
            .await_route(&format!("s{k}.example"), "/", (200, "backend a"))
            .await;
    }
}
