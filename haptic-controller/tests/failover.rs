//! Leadership with real processes: crash and graceful failover, a stale leader fenced by the
//! agents, disabled election, and a token Secret that appears after the controller started.

mod common;

use std::time::Duration;

use common::*;

struct Fleet {
    cluster: Cluster,
    spec: haptic_controller::HAProxyTemplateConfigSpec,
    agents: Vec<Agent>,
    _backends: (Backend, Backend),
}

async fn fleet(
    agents: u8,
    token: bool,
    tweak: impl FnOnce(&mut haptic_controller::HAProxyTemplateConfigSpec),
) -> Fleet {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    if token {
        cluster.create_token().await;
    }
    let mut spec = spec(agent_port, http_port);
    tweak(&mut spec);
    cluster.apply_htc(&spec).await;
    let mut started = Vec::new();
    for i in 1..=agents {
        started.push(Agent::start(&cluster, i, agent_port, http_port).await);
    }
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    cluster.service("web-a", a.addr).await;
    cluster.service("web-b", b.addr).await;
    cluster.ingress("shop", "shop.example", "/", "web-a").await;
    Fleet {
        cluster,
        spec,
        agents: started,
        _backends: (a, b),
    }
}

async fn await_leader(cluster: &Cluster, not: Option<&str>) -> String {
    eventually(
        "a (new) leader holds the Lease",
        Duration::from_secs(30),
        || async { cluster.leader().await.filter(|l| Some(l.as_str()) != not) },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_graceful_and_stale_leaders() {
    let f = fleet(2, true, |_| {}).await;
    let mut replicas = vec![
        Controller::start(&f.cluster, "controller-1").await,
        Controller::start(&f.cluster, "controller-2").await,
    ];
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }

    // kill -9 of the leader: the other leads and deploys a change made after the kill.
    let first = await_leader(&f.cluster, None).await;
    let index = replicas
        .iter()
        .position(|c| c.name == first)
        .expect("leader is ours");
    let mut dead = replicas.remove(index);
    dead.signal("KILL");
    dead.exited(Duration::from_secs(5)).await;
    f.cluster
        .ingress("shop", "shop.example", "/", "web-b")
        .await;
    let second = await_leader(&f.cluster, Some(&first)).await;
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend b"))
            .await;
    }
    // The dead one comes back as a follower.
    replicas.push(Controller::start(&f.cluster, &first).await);

    // SIGTERM of the leader: it releases the Lease on its way out and the other leads.
    let index = replicas
        .iter()
        .position(|c| c.name == second)
        .expect("leader is ours");
    let mut leaving = replicas.remove(index);
    leaving.signal("TERM");
    let exit = leaving.exited(Duration::from_secs(25)).await;
    assert!(
        exit.success(),
        "graceful exit: {exit:?}\n{}",
        leaving.logs()
    );
    assert!(leaving.logs().contains("releas"), "{}", leaving.logs());
    let third = await_leader(&f.cluster, Some(&second)).await;
    assert_eq!(third, first);
    f.cluster
        .ingress("shop", "shop.example", "/", "web-a")
        .await;
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }
    replicas.push(Controller::start(&f.cluster, &second).await);

    // A stale leader: SIGSTOP it past its LeaseDuration; the other replica takes over and
    // deploys; SIGCONT. Whatever it still sends is fenced, HAProxy keeps the new leader's set,
    // and it steps down without writing status.
    let stale_name = await_leader(&f.cluster, None).await;
    let stale = replicas
        .iter()
        .find(|c| c.name == stale_name)
        .expect("leader is ours");
    let epoch_before = f.cluster.lease_epoch().await.expect("epoch");
    // Stopped while idle: a status write the leader already checked its Lease for and had under
    // way when it stopped would go out when it resumes, and no check before a request can undo
    // that (the Kubernetes API has no fence for it). What is tested is that it starts none.
    publisher_done(&f).await;
    stale.signal("STOP");
    let successor = await_leader(&f.cluster, Some(&stale_name)).await;
    f.cluster
        .ingress("shop", "shop.example", "/", "web-b")
        .await;
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend b"))
            .await;
        let state = agent.await_live_from(&successor).await;
        assert!(state.fence.expect("fence") > epoch_before);
    }
    // A change only the stale leader's cache has not seen yet: it will render and send it.
    f.cluster
        .ingress("other", "other.example", "/", "web-a")
        .await;
    for agent in &f.agents {
        agent
            .await_route("other.example", "/", (200, "backend a"))
            .await;
    }
    f.cluster.server.reset_accounting();
    stale.signal("CONT");
    eventually(
        "the stale leader steps down",
        Duration::from_secs(20),
        || async {
            let logs = stale.logs();
            (logs.contains("term over") || logs.contains("stopping every write")).then_some(())
        },
    )
    .await;
    for agent in &f.agents {
        let state = agent.state().await.expect("agent state");
        assert_eq!(
            state.leader.as_deref(),
            Some(successor.as_str()),
            "the new leader's set stays live"
        );
        agent
            .await_route("shop.example", "/", (200, "backend b"))
            .await;
    }
    let status_writes: Vec<String> = f
        .cluster
        .server
        .requests()
        .into_iter()
        .filter(|r| r.client == stale_name && r.subresource == "status" && r.verb == "patch")
        .map(|r| format!("{} {}/{}", r.resource, r.namespace, r.name))
        .collect();
    assert!(
        status_writes.is_empty(),
        "the stale leader wrote no status: {status_writes:?}\n{}",
        stale.logs()
    );
    assert_eq!(
        f.cluster.leader().await.as_deref(),
        Some(successor.as_str())
    );
    drop(replicas);
}

/// The entries of an agent's journal at epochs above `above`, oldest first.
async fn journal_above(agent: &Agent, above: u64) -> Vec<serde_json::Value> {
    let body = agent.fetch("/v1/journal").await.expect("journal");
    let journal: serde_json::Value = serde_json::from_str(&body).expect("journal JSON");
    journal["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter(|entry| entry["epoch"].as_u64().is_some_and(|epoch| epoch > above))
        .cloned()
        .collect()
}

/// A graceful handoff re-sends nothing the agents hold: the new leader's first apply to each is
/// a delta of no paths that raises the fence and answers `unchanged`, and its next change is a
/// delta against that set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_claims_the_agents_without_resending_their_set() {
    let f = fleet(2, true, |_| {}).await;
    let mut replicas = vec![
        Controller::start(&f.cluster, "controller-1").await,
        Controller::start(&f.cluster, "controller-2").await,
    ];
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }
    let first = await_leader(&f.cluster, None).await;
    // Both agents hold the leader's newest set (the first routed set may be followed by one
    // more render, e.g. for the pods found later).
    let live = eventually(
        "the agents hold the same set",
        Duration::from_secs(20),
        || async {
            let mut sums = Vec::new();
            for agent in &f.agents {
                sums.push(agent.state().await?.live_checksum?);
            }
            sums.windows(2)
                .all(|w| w[0] == w[1])
                .then(|| sums[0].clone())
        },
    )
    .await;
    let epoch = f.cluster.lease_epoch().await.expect("epoch");

    let index = replicas
        .iter()
        .position(|c| c.name == first)
        .expect("leader is ours");
    // The follower keeps its renderer warm (the warm standby) for the handoff.
    let follower = &replicas[1 - index];
    eventually(
        "the follower renders as a warm standby",
        Duration::from_secs(20),
        || async {
            let renders = follower
                .metric_value("haptic_standby_renders_total")
                .await?;
            (renders >= 1.0).then_some(())
        },
    )
    .await;
    let mut leaving = replicas.remove(index);
    leaving.signal("TERM");
    leaving.exited(Duration::from_secs(25)).await;
    let second = await_leader(&f.cluster, Some(&first)).await;
    for agent in &f.agents {
        let claim = eventually(
            "the new leader's first apply reaches the agent",
            Duration::from_secs(30),
            || async { journal_above(agent, epoch).await.into_iter().next() },
        )
        .await;
        assert_eq!(claim["leader"], second.as_str(), "{claim}");
        assert_eq!(claim["checksum"], live.as_str(), "the same set: {claim}");
        assert_eq!(claim["outcome"], "unchanged", "{claim}");
        assert_eq!(
            claim["delta_paths"],
            0,
            "a delta of no paths, not the whole set: {claim}\n{}",
            replicas[0].logs()
        );
        let state = agent.state().await.expect("agent state");
        assert!(
            state.fence.expect("fence") > epoch,
            "the fence holds the new epoch"
        );
        assert_eq!(state.leader.as_deref(), Some(second.as_str()));
    }

    // The next change is a delta against the set the new leader found.
    f.cluster
        .ingress("shop", "shop.example", "/", "web-b")
        .await;
    for agent in &f.agents {
        agent
            .await_route("shop.example", "/", (200, "backend b"))
            .await;
        // HAProxy may route the change a moment before the agent journals its answer.
        let (entries, change) = eventually(
            "the agent journals the change",
            Duration::from_secs(10),
            || async {
                let entries = journal_above(agent, epoch).await;
                let change = entries
                    .iter()
                    .find(|entry| entry["outcome"] == "applied")?
                    .clone();
                Some((entries, change))
            },
        )
        .await;
        assert!(
            change["delta_paths"]
                .as_u64()
                .is_some_and(|paths| paths > 0),
            "a delta: {change}"
        );
        assert!(
            entries.iter().all(|entry| !entry["delta_paths"].is_null()),
            "no whole set was sent in the new term: {entries:?}"
        );
    }
    drop(replicas);
}

/// `minDeploymentInterval` spaces the applies that follow a reload (`Pacing` in
/// `src/scheduler.rs`), not those that follow an apply HAProxy took without one: a new
/// leader's first apply answers `unchanged`, and its next change goes out at once, not an
/// interval later, through real agents answering `reload: false`. With the rule the interval
/// had before (at least the interval between any two deployments of a pod) the change waited
/// the whole 8 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interval_follows_reloads_not_an_unchanged_claim() {
    const INTERVAL_MS: u64 = 8_000;
    let f = fleet(1, true, |spec| {
        spec.agent.min_deployment_interval = format!("{INTERVAL_MS}ms");
    })
    .await;
    let mut replicas = vec![
        Controller::start(&f.cluster, "controller-1").await,
        Controller::start(&f.cluster, "controller-2").await,
    ];
    let agent = &f.agents[0];
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let first = await_leader(&f.cluster, None).await;
    let epoch = f.cluster.lease_epoch().await.expect("epoch");
    let index = replicas
        .iter()
        .position(|c| c.name == first)
        .expect("leader is ours");
    let follower = &replicas[1 - index];
    eventually(
        "the follower renders as a warm standby",
        Duration::from_secs(20),
        || async {
            let renders = follower
                .metric_value("haptic_standby_renders_total")
                .await?;
            (renders >= 1.0).then_some(())
        },
    )
    .await;
    let mut leaving = replicas.remove(index);
    leaving.signal("TERM");
    leaving.exited(Duration::from_secs(25)).await;
    let second = await_leader(&f.cluster, Some(&first)).await;
    let claim = eventually(
        "the new leader's first apply reaches the agent",
        Duration::from_secs(30),
        || async { journal_above(agent, epoch).await.into_iter().next() },
    )
    .await;
    assert_eq!(claim["leader"], second.as_str(), "{claim}");
    assert_eq!(
        claim["outcome"], "unchanged",
        "the precondition: the new leader found the set it renders\n{claim}"
    );

    f.cluster
        .ingress("shop", "shop.example", "/", "web-b")
        .await;
    agent
        .await_route("shop.example", "/", (200, "backend b"))
        .await;
    let change = eventually(
        "the agent journals the change",
        Duration::from_secs(10),
        || async {
            journal_above(agent, epoch)
                .await
                .into_iter()
                .find(|entry| entry["outcome"] == "applied")
        },
    )
    .await;
    let (claimed, changed) = (
        claim["at_ms"].as_u64().expect("at_ms"),
        change["at_ms"].as_u64().expect("at_ms"),
    );
    // Half the interval: the change is the new leader's next apply (a render and a runtime
    // apply, milliseconds here); held by the interval it would come 8 s after the claim.
    assert!(
        changed.saturating_sub(claimed) < INTERVAL_MS / 2,
        "the change was applied {} ms after the unchanged claim: held by the interval\n\
         claim {claim}\nchange {change}\n{}",
        changed.saturating_sub(claimed),
        replicas[0].logs()
    );
    drop(replicas);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_election_deploys_without_a_lease() {
    // A fleet an elected leader served first: its agents are fenced above epoch 0.
    let f = fleet(1, true, |_| {}).await;
    let mut elected = Controller::start(&f.cluster, "controller-1").await;
    f.agents[0]
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let fence = f.agents[0]
        .state()
        .await
        .and_then(|s| s.fence)
        .expect("fence");
    assert!(fence >= 1);
    elected.signal("TERM");
    elected.exited(Duration::from_secs(25)).await;

    // Election off, a replica of another name: it leads at once, raises its epoch above the
    // agents' fence, and deploys, with no Lease request at all.
    let mut spec = f.spec.clone();
    spec.controller.leader_election.enabled = false;
    f.cluster.apply_htc(&spec).await;
    let only = Controller::start(&f.cluster, "standalone-7").await;
    f.cluster
        .ingress("shop", "shop.example", "/", "web-b")
        .await;
    f.agents[0]
        .await_route("shop.example", "/", (200, "backend b"))
        .await;
    let state = f.agents[0].await_live_from("standalone-7").await;
    assert!(state.fence.expect("fence") > fence);
    let leases = f
        .cluster
        .server
        .requests()
        .into_iter()
        .filter(|r| r.client == only.name && r.resource.starts_with("leases"))
        .count();
    assert_eq!(leases, 0, "no Lease request at all");
    drop(only);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_secret_created_later_is_waited_for() {
    let f = fleet(1, false, |_| {}).await;
    let controller = Controller::start(&f.cluster, "controller-1").await;
    let status = eventually(
        "status says the token is missing",
        Duration::from_secs(20),
        || async {
            let status = f.cluster.htc_status().await?;
            let deployed = status["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "Deployed")?
                .clone();
            (deployed["reason"] == "TokenMissing").then_some(deployed)
        },
    )
    .await;
    assert!(
        status["message"]
            .as_str()
            .unwrap_or("")
            .contains("haptic-agent-token"),
        "{status}"
    );
    assert!(
        controller.logs().contains("no agent token"),
        "{}",
        controller.logs()
    );
    f.cluster.create_token().await;
    f.agents[0]
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    drop(controller);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_a_second_signal() {
    let f = fleet(1, true, |_| {}).await;
    // No HTC of that name: alive, not ready.
    let mut waiting =
        Controller::start_with_env(&f.cluster, "controller-9", &[("CONFIG_NAME", "absent")]).await;
    eventually("healthz answers", Duration::from_secs(10), || async {
        (waiting.probe("/healthz").await == Some(200)).then_some(())
    })
    .await;
    assert_eq!(waiting.probe("/readyz").await, Some(503));
    waiting.signal("TERM");
    assert!(waiting.exited(Duration::from_secs(10)).await.success());

    // A leader cut off from the API server cannot release its Lease: the first SIGTERM waits
    // on that, the second exits at once.
    let mut leader = Controller::start(&f.cluster, "controller-1").await;
    f.agents[0]
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    assert_eq!(leader.probe("/readyz").await, Some(200));
    f.cluster
        .server
        .inject("controller-1", haptic_testkit::Fault::Partition);
    leader.signal("TERM");
    eventually(
        "the first signal starts the drain",
        Duration::from_secs(10),
        || async { leader.logs().contains("shutting down").then_some(()) },
    )
    .await;
    leader.signal("TERM");
    let status = leader.exited(Duration::from_secs(5)).await;
    assert_eq!(
        status.code(),
        Some(130),
        "the second signal exits at once: {status:?}"
    );
}

/// Waits until every published object's status shows the live set on every pod: the leader's
/// publisher has written all it had to write for that set.
async fn publisher_done(f: &Fleet) {
    use haptic_controller::published::{
        HAProxyCRTListFile, HAProxyCfg, HAProxyGeneralFile, HAProxyMapFile, PublishedStatus,
    };
    let live = f.agents[0]
        .state()
        .await
        .and_then(|s| s.live_checksum)
        .expect("live");
    let live = format!("sha256:{live}");
    let pods = f.agents.len();
    let done = |status: Option<&PublishedStatus>| {
        status.is_some_and(|s| {
            s.deployed_to_pods.len() == pods
                && s.deployed_to_pods.iter().all(|p| p.checksum == live)
        })
    };
    eventually(
        "every published object's status shows the live set on every pod",
        Duration::from_secs(20),
        || async {
            let params = Default::default();
            let cfgs = f.cluster.api::<HAProxyCfg>().list(&params).await.ok()?;
            let maps = f.cluster.api::<HAProxyMapFile>().list(&params).await.ok()?;
            let lists = f
                .cluster
                .api::<HAProxyCRTListFile>()
                .list(&params)
                .await
                .ok()?;
            let files = f
                .cluster
                .api::<HAProxyGeneralFile>()
                .list(&params)
                .await
                .ok()?;
            (!cfgs.items.is_empty()
                && cfgs.items.iter().all(|o| done(o.status.as_ref()))
                && maps.items.iter().all(|o| done(o.status.as_ref()))
                && lists.items.iter().all(|o| done(o.status.as_ref()))
                && files.items.iter().all(|o| done(o.status.as_ref())))
            .then_some(())
        },
    )
    .await;
}
