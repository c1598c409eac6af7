//! A pool of spare backends end to end: routes map a host to a Service name
//! (`maps/hosts.map`), and `maps/pool.map` maps the Service name to one of the backends
//! `pool_0..pool_2`, whose server slots are placeholders until a Service takes one. Taking a
//! spare, handing a backend from one Service to another, and moving a Service to another
//! pool backend go through the runtime API with no reload, and real traffic through HAProxy
//! never reaches another Service's endpoints, nor misses a route that stays.

mod common;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use common::*;
use haptic_agent_client::{FileSet, Outcome};
use tokio::task::JoinHandle;

/// What `haptic-render` writes in a slot no endpoint holds (`slots::PLACEHOLDER`, disabled).
const PLACEHOLDER: &str = "127.0.0.1:1";

/// The set: `hosts` (host, Service name), `pool` (Service name, pool backend), and the
/// first slot of each of `pool_0..pool_2` (a second slot stays a placeholder throughout).
fn pool_set(
    port: u16,
    hosts: &[(&str, &str)],
    pool: &[(&str, &str)],
    slots: [Option<SocketAddr>; 3],
) -> FileSet {
    let mut cfg = format!(
        "global\n  nbthread 1\n  log stderr format raw local0 warning\n\
         defaults\n  mode http\n  timeout connect 2s\n  timeout client 10s\n  timeout server 10s\n\
         frontend fe\n  bind 127.0.0.1:{port}\n\
         \x20 http-request set-var(txn.backend) req.hdr(host),field(1,:),lower,map(maps/hosts.map)\n\
         \x20 http-request set-var(txn.pool) var(txn.backend),map(maps/pool.map) if {{ var(txn.backend) -m found }}\n\
         \x20 use_backend %[var(txn.pool)] if {{ var(txn.pool) -m found }}\n\
         \x20 default_backend be_none\n\
         backend be_none\n  http-request return status 404 content-type text/plain string \"no route\"\n"
    );
    for (n, slot) in slots.iter().enumerate() {
        let first = slot.map_or(format!("{PLACEHOLDER} disabled"), |addr| addr.to_string());
        cfg.push_str(&format!(
            "backend pool_{n}\n    server s1 {first}\n    server s2 {PLACEHOLDER} disabled\n"
        ));
    }
    let map = |entries: &[(&str, &str)]| -> String {
        entries.iter().map(|(k, v)| format!("{k} {v}\n")).collect()
    };
    FileSet::new()
        .with("haproxy.cfg", cfg)
        .and_then(|set| set.with("maps/hosts.map", map(hosts)))
        .and_then(|set| set.with("maps/pool.map", map(pool)))
        .expect("valid set")
}

/// One GET through HAProxy with Host `host`: `(status, body)`, or the error.
async fn get(http: &reqwest::Client, port: u16, host: &str) -> Result<(u16, String), String> {
    let response = http
        .get(format!("http://127.0.0.1:{port}/"))
        .header("host", host)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response.text().await.map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// Requests for `host` in a loop (a fresh connection each) until stopped; every answer that
/// is not one of `allowed` is kept.
struct Watch {
    stop: Arc<AtomicBool>,
    seen: Arc<AtomicU64>,
    task: JoinHandle<Vec<String>>,
}

impl Watch {
    /// Starts the loop and returns once it has had a few answers.
    async fn start(port: u16, host: &'static str, allowed: &'static [(u16, &str)]) -> Self {
        let (stop, seen) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let task = tokio::spawn({
            let (stop, seen) = (stop.clone(), seen.clone());
            async move {
                let http = traffic_client();
                let mut unexpected = Vec::new();
                // Bounded: at most 20,000 requests.
                for _ in 0..20_000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let got = get(&http, port, host).await;
                    let fine = got.as_ref().is_ok_and(|(status, body)| {
                        allowed.iter().any(|(s, b)| s == status && b == body)
                    });
                    if !fine {
                        unexpected.push(format!("{host}: {got:?}"));
                    }
                    seen.fetch_add(1, Ordering::Relaxed);
                }
                unexpected
            }
        });
        let watch = Self { stop, seen, task };
        watch.await_requests(5).await;
        watch
    }

    /// Waits (bounded) until `more` further answers came in.
    async fn await_requests(&self, more: u64) {
        let target = self.seen.load(Ordering::Relaxed) + more;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.seen.load(Ordering::Relaxed) < target {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the request loop stalled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Lets a few more requests run against the new state, stops, and returns what was not
    /// allowed.
    async fn finish(self) -> Vec<String> {
        self.await_requests(5).await;
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("request loop")
    }
}

const NO_ROUTE: (u16, &str) = (404, "no route");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_take_hand_over_and_move_pool_backends_with_no_reload_and_no_leak() {
    let (k, a, b) = (
        Backend::start("k").await,
        Backend::start("a").await,
        Backend::start("b").await,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let port = free_port();
    let http = traffic_client();

    // Service k on pool_2; pool_0 and pool_1 are spares.
    let first = pool_set(
        port,
        &[("k.test", "svc-k")],
        &[("svc-k", "pool_2")],
        [None, None, Some(k.addr)],
    );
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 1, first))
        .await
        .expect("first apply");
    assert!(report.reload, "the first set starts HAProxy");
    let served = |host: &'static str| {
        let http = http.clone();
        async move { get(&http, port, host).await }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while served("k.test").await != Ok((200, "backend k".to_owned())) {
        assert!(tokio::time::Instant::now() < deadline, "k.test not served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let workers = client.state(&agent.url).await.expect("state").worker_pids;
    let keep = Watch::start(port, "k.test", &[(200, "backend k")]).await;

    // (a) A new Service a takes the spare pool_0.
    let second = pool_set(
        port,
        &[("k.test", "svc-k"), ("a.test", "svc-a")],
        &[("svc-k", "pool_2"), ("svc-a", "pool_0")],
        [Some(a.addr), None, Some(k.addr)],
    );
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 2, second))
        .await
        .expect("a takes a spare");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, false));
    assert_eq!(served("a.test").await, Ok((200, "backend a".to_owned())));

    // (b) Service a goes, and b takes its pool_0 in the same apply: a.test never reaches b.
    let watch = Watch::start(port, "a.test", &[(200, "backend a"), NO_ROUTE]).await;
    let third = pool_set(
        port,
        &[("k.test", "svc-k"), ("b.test", "svc-b")],
        &[("svc-k", "pool_2"), ("svc-b", "pool_0")],
        [Some(b.addr), None, Some(k.addr)],
    );
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 3, third))
        .await
        .expect("b takes a's backend");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, false));
    assert_eq!(served("a.test").await, Ok((404, "no route".to_owned())));
    assert_eq!(served("b.test").await, Ok((200, "backend b".to_owned())));
    let unexpected = watch.finish().await;
    assert!(
        unexpected.is_empty(),
        "a.test while b took pool_0: {unexpected:?}"
    );

    // (c) Service b moves to the spare pool_1 (pool_0 back to placeholders): b.test is
    // served by b throughout.
    let watch = Watch::start(port, "b.test", &[(200, "backend b")]).await;
    let fourth = pool_set(
        port,
        &[("k.test", "svc-k"), ("b.test", "svc-b")],
        &[("svc-k", "pool_2"), ("svc-b", "pool_1")],
        [None, Some(b.addr), Some(k.addr)],
    );
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 4, fourth))
        .await
        .expect("b moves to pool_1");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, false));
    assert_eq!(served("b.test").await, Ok((200, "backend b".to_owned())));
    let unexpected = watch.finish().await;
    assert!(
        unexpected.is_empty(),
        "b.test while it moved: {unexpected:?}"
    );

    // Service k, untouched, was served all along, by the same worker.
    let unexpected = keep.finish().await;
    assert!(unexpected.is_empty(), "k.test: {unexpected:?}");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.worker_pids, workers, "HAProxy reloaded");
    assert_eq!(state.reloads_avoided, 3);
    agent.stop().await;
}
