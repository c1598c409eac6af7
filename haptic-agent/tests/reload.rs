//! Reloads whose outcome the agent does not see in time, and sets HAProxy never loaded: the
//! agent keeps what HAProxy runs and what it reports live the same.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::*;
use haptic_agent::AgentConfig;
use haptic_agent_client::{
    FileSet, Outcome,
    policy::{Capability, Policy},
};

/// `files` with a Lua init that sleeps `seconds`: HAProxy's master takes that long to
/// re-execute on the set (`haproxy -c` does not run it). No CPU is burnt.
fn slow_to_load(files: &FileSet, seconds: u32) -> FileSet {
    let mut out = rewrite(files, "haproxy.cfg", |cfg| {
        cfg.replacen("global\n", "global\n  lua-load slow.lua\n", 1)
    });
    out.insert(
        "slow.lua",
        format!("core.register_init(function() os.execute(\"sleep {seconds}\") end)\n"),
    )
    .expect("valid path");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_slower_than_its_timeout_is_waited_for_before_the_next_apply() {
    let (a, b, c) = (
        Backend::start("a").await,
        Backend::start("b").await,
        Backend::start("c").await,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        // The slow set loads Lua from itself.
        .with_policy(Policy::default().with_capability(Capability::Lua));
    settings.reload_timeout = Duration::from_secs(2);
    let agent = TestAgent::start_exact(settings).await;
    let client = client();
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr), ("c", c.addr)];

    let first = request(1, "leader-1", 1, config(port, "a", &backends));
    client.apply(&agent.url, &first).await.expect("first apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");

    // HAProxy needs longer than the reload timeout to load this set; it does load it.
    let slow = request(
        5,
        "leader-5",
        1,
        slow_to_load(&config(port, "b", &backends), 4),
    );
    let report = client.apply(&agent.url, &slow).await.expect("slow apply");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(get_once(port).await, "backend b");

    // A higher epoch after it goes live, and stays: no late reload of the slow set follows.
    let next = request(6, "leader-6", 1, config(port, "c", &backends));
    let report = client.apply(&agent.url, &next).await.expect("next apply");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "backend c").await, "backend c");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(next.checksum.as_str()));
    let last = state.last_reload.expect("a reload");
    assert!(last.ok && last.checksum == next.checksum, "{last:?}");
    assert_eq!(
        haptic_agent::haproxy::Haproxy::new(haproxy_bin(), dir.path().join("master.sock"), None)
            .show_proc(Duration::from_secs(5))
            .await
            .expect("the master answers: no reload in progress")
            .master
            .reloads,
        2,
        "exactly the two reloads the agent confirmed"
    );
    assert_eq!(get_once(port).await, "backend c");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_swapped_in_but_never_loaded_is_restored_at_start_and_never_unchanged() {
    use haptic_agent::store::{CURRENT, LAST_KNOWN_GOOD, SetMeta, SetStore};

    let a = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client();
    let port = free_port();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let taken_port = taken.local_addr().expect("addr").port();
    let good = request(5, "leader-5", 1, config(port, "a", &[("a", a.addr)]));
    let agent = TestAgent::start(dir.path()).await;
    client.apply(&agent.url, &good).await.expect("good apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    agent.stop().await;

    // What an apply of a set that cannot load (it binds a taken port) does up to the swap;
    // the agent dies before the reload.
    let bad = request(5, "leader-5", 2, config(taken_port, "a", &[("a", a.addr)]));
    let store = SetStore::open(dir.path()).expect("store");
    let previous = store.link(CURRENT).expect("link");
    let (name, _) = store.stage(&bad.files, &bad.checksum).expect("stage");
    store
        .promote(
            &name,
            &SetMeta {
                checksum: bad.checksum.clone(),
                generation: 2,
                leader: "leader-5".into(),
                epoch: 5,
                files: Vec::new(),
            },
        )
        .expect("promote");
    store
        .set_link(LAST_KNOWN_GOOD, previous.as_deref())
        .expect("lkg");
    store.set_link(CURRENT, Some(&name)).expect("swap");

    // At start HAProxy cannot run the swapped-in set: last-known-good goes back in.
    let agent = TestAgent::start(dir.path()).await;
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(good.checksum.as_str()));

    // The leader retries the apply: it is loaded (and rolled back), never "unchanged".
    match client.apply(&agent.url, &bad).await {
        Err(haptic_agent_client::Error::RolledBack {
            live_checksum,
            reason,
        }) => {
            assert_eq!(live_checksum.as_deref(), Some(good.checksum.as_str()));
            assert!(reason.contains("bind"), "HAProxy's reason: {reason}");
        }
        other => panic!("expected RolledBack, got {other:?}"),
    }
    assert_eq!(get_once(port).await, "backend a");
    // The good set, confirmed loaded, is unchanged.
    let report = client.apply(&agent.url, &good).await.expect("good again");
    assert_eq!(report.outcome, Outcome::Unchanged);
    drop(taken);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervised_master_that_never_finishes_a_reload_is_restarted_and_the_set_rolled_back() {
    let a = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua));
    settings.reload_timeout = Duration::from_secs(1);
    settings.settle_timeout = Duration::from_secs(1);
    let agent = TestAgent::start_exact(settings).await;
    let client = client();
    let port = free_port();
    let first = request(1, "leader-1", 1, config(port, "a", &[("a", a.addr)]));
    client.apply(&agent.url, &first).await.expect("first apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");

    // Loading takes longer than the reload, the wait after it and a fresh start allow.
    let stuck = request(
        1,
        "leader-1",
        2,
        slow_to_load(&config(port, "none", &[("a", a.addr)]), 3),
    );
    match client.apply(&agent.url, &stuck).await {
        Err(haptic_agent_client::Error::RolledBack { live_checksum, .. }) => {
            assert_eq!(live_checksum.as_deref(), Some(first.checksum.as_str()));
        }
        other => panic!("expected RolledBack, got {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(first.checksum.as_str())
    );
    assert!(state.last_reload.expect("a reload").ok);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let next = request(1, "leader-1", 3, config(port, "none", &[("a", a.addr)]));
    client.apply(&agent.url, &next).await.expect("next apply");
    assert_eq!(await_body(port, "no route").await, "no route");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervised_master_that_exits_on_a_reload_is_noticed_at_once_and_rolled_back() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua));
    // Long enough that waiting for them would show.
    settings.reload_timeout = Duration::from_secs(30);
    settings.settle_timeout = Duration::from_secs(30);
    let agent = TestAgent::start_exact(settings).await;
    let client = client();
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr)];
    let first = request(1, "leader-1", 1, config(port, "a", &backends));
    client.apply(&agent.url, &first).await.expect("first apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");

    // Passes `haproxy -c` (no HAPROXY_MWORKER there); the re-executing master is killed
    // (an exit HAProxy cannot catch, unlike a Lua `os.exit`, which it counts as a failed
    // reload).
    let mut exits = rewrite(&config(port, "b", &backends), "haproxy.cfg", |cfg| {
        cfg.replacen("global\n", "global\n  lua-load exit.lua\n", 1)
    });
    exits
        .insert(
            "exit.lua",
            "if os.getenv(\"HAPROXY_MWORKER\") then os.execute(\"kill -9 $PPID\") end\n",
        )
        .expect("path");
    let started = tokio::time::Instant::now();
    let error = client
        .apply(&agent.url, &request(1, "leader-1", 2, exits))
        .await
        .expect_err("rolled back");
    let took = started.elapsed();
    assert!(
        matches!(&error, haptic_agent_client::Error::RolledBack { live_checksum: Some(live), .. } if *live == first.checksum),
        "{error:?}"
    );
    assert!(
        took < Duration::from_secs(20),
        "noticed at once, not after the reload timeout: {took:?}"
    );
    assert_eq!(await_body(port, "backend a").await, "backend a");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_behind_a_long_one_waits_at_most_the_lock_timeout() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua));
    settings.lock_timeout = Duration::from_millis(500);
    let agent = TestAgent::start_with(settings).await;
    let client = client();
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr)];
    let first = request(1, "leader-1", 1, config(port, "a", &backends));
    client.apply(&agent.url, &first).await.expect("first apply");

    // HAProxy takes 3 s to load this one; the apply holds the lock meanwhile.
    let slow = request(
        1,
        "leader-1",
        2,
        slow_to_load(&config(port, "b", &backends), 3),
    );
    let slow_apply = tokio::spawn({
        let (client, url) = (client.clone(), agent.url.clone());
        async move { client.apply(&url, &slow).await }
    });
    // Wait (bounded) until the slow set is swapped in: its reload, under the lock, has begun.
    // (Read by hand: opening a store would clear the staging directory in use.)
    let live_generation = || {
        let name = std::fs::read_link(dir.path().join("current")).ok()?;
        let name = name.file_name()?.to_str()?.to_owned();
        let meta = std::fs::read(dir.path().join("sets").join(format!("{name}.json"))).ok()?;
        serde_json::from_slice::<haptic_agent::store::SetMeta>(&meta)
            .ok()
            .map(|meta| meta.generation)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while live_generation() != Some(2) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slow set was never swapped in"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let in_flight =
        |metrics: &prometheus_parse::Scrape| value(metrics, "haptic_agent_applies_in_flight", &[]);
    assert_eq!(in_flight(&scrape(&agent.url).await), 1.0, "the slow apply");
    let once = haptic_agent_client::AgentClient::new(
        haptic_agent_client::ClientConfig::new(TOKEN).with_retries(1, Duration::from_millis(10)),
    )
    .expect("client");
    let behind = request(1, "leader-1", 3, config(port, "a", &backends));
    let started = tokio::time::Instant::now();
    let answer = once.apply(&agent.url, &behind).await;
    let waited = started.elapsed();
    match answer {
        Err(haptic_agent_client::Error::Unavailable { message, .. }) => {
            assert!(message.contains("another apply"), "{message}");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    slow_apply.await.expect("task").expect("the slow apply");
    assert_eq!(in_flight(&scrape(&agent.url).await), 0.0, "all answered");
    agent.stop().await;
}
