//! Election behaviour against haptic-testkit over HTTP, several replicas per test, on tokio's
//! paused clock (virtual time: the tests take milliseconds and assert no wall-clock times).

mod common;

use std::{future::Future, pin::Pin, time::Duration};

use common::*;
use haptic_election::{Clock, SkewedClock, StopReason, release_lease};
use haptic_testkit::{ApiServer, Fault};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, api::PostParams};
use tokio::time::Instant;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

async fn server() -> ApiServer {
    ApiServer::start().await.expect("test API server")
}

/// Samples for `period`: exactly one replica leads, and the Lease names it.
async fn assert_steady_single_leader(server: &ApiServer, replicas: &[Replica], period: Duration) {
    let end = Instant::now() + period;
    while Instant::now() < end {
        let leaders: Vec<&str> = replicas
            .iter()
            .filter(|r| r.is_leader())
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(
            leaders.len(),
            1,
            "exactly one leader at any moment, got {leaders:?}"
        );
        assert_eq!(
            holder(server).await.as_deref(),
            Some(leaders[0]),
            "the Lease names the leader"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn single_replica_leads_and_writes_client_go_fields() {
    let server = server().await;
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    let first = lease(&server)
        .await
        .expect("lease exists")
        .spec
        .expect("spec");
    assert_eq!(first.holder_identity.as_deref(), Some("pod-a"));
    assert_eq!(first.lease_duration_seconds, Some(15));
    assert_eq!(first.lease_transitions, Some(0));
    assert!(first.acquire_time.is_some());
    tokio::time::sleep(secs(7)).await;
    let later = lease(&server).await.expect("lease").spec.expect("spec");
    assert!(
        later.renew_time.expect("renew").0 > first.renew_time.expect("renew").0,
        "the leader renews"
    );
    assert_eq!(
        later.acquire_time, first.acquire_time,
        "a renew keeps acquireTime"
    );
    assert!(
        a.seen()
            .iter()
            .any(|(_, s)| *s == Seen::NewLeader("pod-a".into(), true)),
        "new leader is reported for self"
    );
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn one_two_and_three_replicas_have_exactly_one_leader() {
    for n in 1..=3 {
        let server = server().await;
        let replicas: Vec<Replica> = (0..n)
            .map(|i| Replica::start(&server, config(&format!("pod-{i}"))))
            .collect();
        one_leader(&replicas, secs(10)).await;
        assert_steady_single_leader(&server, &replicas, secs(60)).await;
        let leader = replicas
            .iter()
            .find(|r| r.is_leader())
            .map(|r| r.name.clone())
            .expect("leader");
        for r in &replicas {
            assert_eq!(
                r.state.borrow().holder.as_deref(),
                Some(leader.as_str()),
                "{} knows the leader",
                r.name
            );
            assert_eq!(
                r.starts().len(),
                usize::from(r.name == leader),
                "no other term started on {}",
                r.name
            );
        }
        stop_all(replicas).await;
    }
}

#[tokio::test(start_paused = true)]
async fn graceful_handoff_with_release_is_immediate_and_releases_after_work() {
    let server = server().await;
    let (leader, follower) = elected_pair(&server, config("pod-a"), config("pod-b")).await;
    tokio::time::sleep(secs(5)).await;
    let seen = leader.seen.clone();
    let leader_name = leader.name.clone();
    let stopped_at = Instant::now();
    leader.stop().await;
    follower
        .wait_for(secs(2), "leader after a release", |s| s.is_leader)
        .await;
    assert!(
        Instant::now() - stopped_at < secs(2),
        "the follower took over on the release, not after expiry"
    );
    // The release (a PUT from the old leader) came after its work had returned.
    let work_ended = seen
        .lock()
        .expect("lock")
        .iter()
        .find_map(|(at, s)| (*s == Seen::WorkEnded).then_some(*at))
        .expect("work ended");
    let last_put = server
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.client == leader_name && r.verb == "update")
        .expect("release PUT");
    assert!(
        last_put.arrived >= work_ended,
        "released only after the leader's work returned"
    );
    let events: Vec<Seen> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(_, s)| s.clone())
        .collect();
    let pos = |e: &Seen| events.iter().position(|x| x == e).expect("event");
    assert!(pos(&Seen::WorkEnded) < pos(&Seen::Stopped(StopReason::GracefulShutdown)));
    let spec = lease(&server).await.expect("lease").spec.expect("spec");
    assert_eq!(
        spec.holder_identity.as_deref(),
        Some(follower.name.as_str())
    );
    assert_eq!(
        spec.lease_transitions,
        Some(1),
        "a holder change increments leaseTransitions"
    );
    follower.stop().await;
}

#[tokio::test(start_paused = true)]
async fn graceful_handoff_without_release_waits_for_expiry() {
    let server = server().await;
    let (leader, follower) = elected_pair(
        &server,
        config("pod-a").with_release_on_cancel(false),
        config("pod-b").with_release_on_cancel(false),
    )
    .await;
    tokio::time::sleep(secs(3)).await;
    let stopped_at = Instant::now();
    let leader_name = leader.name.clone();
    leader.stop().await;
    assert_eq!(holder(&server).await, Some(leader_name), "not released");
    follower
        .wait_for(secs(20), "leader after expiry", |s| s.is_leader)
        .await;
    let waited = Instant::now() - stopped_at;
    // It waited out the Lease: 15 s from its last observed renew, which was at most one jittered
    // RetryPeriod (2.4 s) before the stop.
    assert!(
        waited >= secs(12),
        "took over after {waited:?}, before the Lease expired"
    );
    follower.stop().await;
}

#[tokio::test(start_paused = true)]
async fn crashed_leader_is_replaced_after_expiry() {
    let server = server().await;
    let (leader, follower) = elected_pair(&server, config("pod-a"), config("pod-b")).await;
    tokio::time::sleep(secs(4)).await;
    leader.handle.abort();
    let crashed_at = Instant::now();
    // The elector's task is gone; the work it started must not outlive it.
    tokio::time::timeout(secs(1), async {
        while !leader.seen().iter().any(|(_, s)| *s == Seen::WorkEnded) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the leader's work stopped with its elector");
    follower
        .wait_for(secs(20), "leader after the crash", |s| s.is_leader)
        .await;
    let waited = Instant::now() - crashed_at;
    assert!(
        waited >= secs(12) && waited <= secs(16),
        "failover after {waited:?}"
    );
    assert_eq!(
        holder(&server).await.as_deref(),
        Some(follower.name.as_str())
    );
    follower.stop().await;
}

#[tokio::test(start_paused = true)]
async fn partitioned_leader_steps_down_before_another_acquires_and_follows_when_healed() {
    let server = server().await;
    let (leader, follower) = elected_pair(&server, config("pod-a"), config("pod-b")).await;
    tokio::time::sleep(secs(3)).await;
    server.inject(&leader.name, Fault::Partition);
    let partitioned_at = Instant::now();
    leader
        .wait_for(secs(12), "stepped down", |s| !s.is_leader)
        .await;
    let stepped_down = Instant::now();
    assert!(
        stepped_down - partitioned_at <= secs(10),
        "stepped down within RenewDeadline"
    );
    assert_eq!(
        leader.stops().last().map(|(_, r)| *r),
        Some(StopReason::LeaseExpired)
    );
    follower.wait_for(secs(20), "leader", |s| s.is_leader).await;
    let took_over = follower.starts()[0];
    let stepped = leader.stops()[0].0;
    assert!(
        stepped < took_over,
        "the old leader stepped down ({stepped:?}) before the new one started ({took_over:?})"
    );
    server.lift(&leader.name);
    leader
        .wait_for(secs(15), "following the new leader", |s| {
            s.holder.as_deref() == Some(follower.name.as_str())
        })
        .await;
    tokio::time::sleep(secs(20)).await;
    assert!(!leader.is_leader() && follower.is_leader());
    assert_eq!(
        leader.starts().len(),
        1,
        "the healed replica did not take the Lease back"
    );
    leader.stop().await;
    follower.stop().await;
}

#[tokio::test(start_paused = true)]
async fn outage_shorter_than_renew_deadline_changes_nothing() {
    let server = server().await;
    let replicas = start_all(&server, &["pod-a", "pod-b"]);
    let l = one_leader(&replicas, secs(10)).await;
    tokio::time::sleep(secs(3)).await;
    server.outage(secs(6));
    tokio::time::sleep(secs(40)).await;
    assert!(
        replicas[l].is_leader(),
        "the leader kept the Lease through a short outage"
    );
    for r in &replicas {
        assert!(r.stops().is_empty(), "{} saw no transition", r.name);
        assert_eq!(r.starts().len(), usize::from(r.is_leader()));
    }
    stop_all(replicas).await;
}

#[tokio::test(start_paused = true)]
async fn outage_longer_than_renew_deadline_steps_down_then_reelects() {
    let server = server().await;
    let replicas = start_all(&server, &["pod-a", "pod-b"]);
    let l = one_leader(&replicas, secs(10)).await;
    tokio::time::sleep(secs(3)).await;
    server.outage(secs(25));
    replicas[l]
        .wait_for(secs(12), "stepped down", |s| !s.is_leader)
        .await;
    assert_eq!(replicas[l].stops()[0].1, StopReason::LeaseExpired);
    tokio::time::sleep(secs(25)).await;
    let new = one_leader(&replicas, secs(30)).await;
    assert_steady_single_leader(&server, &replicas, secs(20)).await;
    assert_eq!(
        holder(&server).await.as_deref(),
        Some(replicas[new].name.as_str())
    );
    stop_all(replicas).await;
}

#[tokio::test(start_paused = true)]
async fn a_fast_clock_never_takes_a_renewed_lease_nor_a_deposed_leaders_term() {
    let server = server().await;
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    // pod-b's clock runs 1.4x fast: below LeaseDuration / RenewDeadline = 1.5.
    let b = Replica::start_with(&server, config("pod-b"), Some(SkewedClock::new(1.4)));
    let c = Replica::start_with(
        &server,
        config("pod-c").with_poll_only(true),
        Some(SkewedClock::new(1.4)),
    );
    tokio::time::sleep(secs(120)).await;
    assert!(a.is_leader());
    assert!(
        b.starts().is_empty() && c.starts().is_empty(),
        "a fast clock took a Lease that was being renewed"
    );
    server.inject("pod-a", Fault::Partition);
    let b_or_c = [&b, &c];
    let deadline = Instant::now() + secs(30);
    while !b_or_c.iter().any(|r| r.is_leader()) {
        assert!(Instant::now() < deadline, "nobody took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stepped = a
        .stops()
        .first()
        .map(|(at, _)| *at)
        .expect("pod-a stepped down");
    let started = b_or_c
        .iter()
        .flat_map(|r| r.starts())
        .min()
        .expect("a new term");
    assert!(
        stepped < started,
        "a fast clock started a term ({started:?}) before the old leader stepped down ({stepped:?})"
    );
    server.lift("pod-a");
    for r in [a, b, c] {
        r.stop().await;
    }
}

#[tokio::test(start_paused = true)]
async fn disabled_mode_leads_at_once_without_api_calls() {
    let server = server().await;
    let r = Replica::start(&server, config("solo").with_enabled(false));
    r.wait_for(secs(1), "leader", |s| s.is_leader).await;
    tokio::time::sleep(secs(30)).await;
    assert_eq!(r.starts().len(), 1);
    assert!(
        server.requests().iter().all(|q| q.client != "solo"),
        "disabled mode made API calls"
    );
    let seen = r.seen.clone();
    r.stop().await;
    assert!(
        seen.lock()
            .expect("lock")
            .iter()
            .any(|(_, s)| *s == Seen::Stopped(StopReason::GracefulShutdown))
    );
}

#[tokio::test(start_paused = true)]
async fn a_taken_lease_steps_down_and_reenters_election_in_place() {
    let server = server().await;
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    // Another controller (or a human) overwrites the Lease.
    let api: Api<Lease> = Api::namespaced(server.client_for("intruder").expect("client"), NS);
    let mut l = api.get(LEASE).await.expect("lease");
    let spec = l.spec.as_mut().expect("spec");
    spec.holder_identity = Some("intruder".into());
    spec.lease_duration_seconds = Some(15);
    api.replace(LEASE, &PostParams::default(), &l)
        .await
        .expect("overwrite");
    a.wait_for(secs(5), "stepped down", |s| !s.is_leader).await;
    assert_eq!(a.stops()[0].1, StopReason::LeaseTaken);
    assert_eq!(a.state.borrow().holder.as_deref(), Some("intruder"));
    // The intruder never renews: after its term runs out, pod-a leads again, in the same run.
    a.wait_for(secs(25), "leader again", |s| s.is_leader && s.terms == 2)
        .await;
    assert!(!a.handle.is_finished());
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn keep_lease_on_stop_lets_a_successor_resume_without_vacancy_then_release_lease() {
    let server = server().await;
    let a = Replica::start(&server, config("pod-a").with_keep_lease_on_stop(true));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    let b = Replica::start(&server, config("pod-b"));
    b.wait_for(secs(5), "following", |s| {
        s.holder.as_deref() == Some("pod-a")
    })
    .await;
    a.stop().await;
    assert_eq!(
        holder(&server).await.as_deref(),
        Some("pod-a"),
        "kept on stop"
    );
    let a2 = Replica::start(&server, config("pod-a").with_keep_lease_on_stop(true));
    a2.wait_for(secs(1), "leader at once", |s| s.is_leader)
        .await;
    tokio::time::sleep(secs(30)).await;
    assert!(b.starts().is_empty(), "pod-b never saw a vacancy");
    assert_eq!(
        lease(&server)
            .await
            .expect("lease")
            .spec
            .expect("spec")
            .lease_transitions,
        Some(0)
    );
    a2.stop().await;
    let released = release_lease(
        server.client_for("pod-a").expect("client"),
        NS,
        LEASE,
        "pod-a",
        secs(2),
    )
    .await
    .expect("release");
    assert!(released);
    b.wait_for(secs(2), "leader after release_lease", |s| s.is_leader)
        .await;
    b.stop().await;
}

/// A clock that never advances and whose sleeps never end: an elector stuck in its loop.
struct FrozenClock(Instant);

impl Clock for FrozenClock {
    fn now(&self) -> Instant {
        self.0
    }
    fn sleep(&self, _: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(std::future::pending())
    }
}

#[tokio::test(start_paused = true)]
async fn health_check_fails_a_leader_that_stopped_renewing() {
    let server = server().await;
    let client = server.client_for("stuck").expect("client");
    let elector = haptic_election::LeaderElector::new(client, config("stuck"))
        .expect("config")
        .with_clock(FrozenClock(Instant::now()));
    let health = elector.health();
    let mut state = elector.state();
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(elector.run(token.clone(), haptic_election::Callbacks::new()));
    state.wait_for(|s| s.is_leader).await.expect("leads");
    assert_eq!(health.check(), Ok(()));
    tokio::time::sleep(secs(19)).await;
    assert_eq!(health.check(), Ok(()), "within LeaseDuration + tolerance");
    tokio::time::sleep(secs(2)).await;
    let err = health
        .check()
        .expect_err("stale leader must fail the health check");
    assert!(err.contains("has not renewed"), "{err}");
    token.cancel();
    let _ = tokio::time::timeout(secs(30), run).await;
}

#[tokio::test(start_paused = true)]
async fn api_errors_back_off_instead_of_spinning() {
    let server = server().await;
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    for code in [500, 503, 429] {
        server.inject(
            "pod-b",
            Fault::Error {
                code,
                retry_after: Some(1),
                times: None,
            },
        );
    }
    server.reset_accounting();
    let b = Replica::start(&server, config("pod-b"));
    tokio::time::sleep(secs(60)).await;
    let from_b = server
        .requests()
        .iter()
        .filter(|r| r.client == "pod-b")
        .count();
    assert!(from_b > 0, "pod-b kept trying");
    // Backoff grows from 200 ms to RetryPeriod (2 s); kube's own retry of 429/503 adds a few.
    assert!(
        from_b <= 150,
        "pod-b sent {from_b} requests in a minute of errors: it spins"
    );
    assert!(a.is_leader() && b.starts().is_empty());
    server.lift("pod-b");
    b.wait_for(secs(10), "following", |s| {
        s.holder.as_deref() == Some("pod-a")
    })
    .await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn steady_state_load_is_one_write_per_retry_period_and_followers_are_quiet() {
    let server = server().await;
    let replicas: Vec<Replica> = (0..3)
        .map(|i| Replica::start(&server, config(&format!("pod-{i}"))))
        .collect();
    let l = one_leader(&replicas, secs(10)).await;
    tokio::time::sleep(secs(10)).await;
    server.reset_accounting();
    tokio::time::sleep(secs(300)).await;
    let counts = server.request_counts();
    let count = |client: &str, verb: &str| {
        counts
            .get(&(
                client.to_owned(),
                verb.to_owned(),
                "leases.coordination.k8s.io".to_owned(),
            ))
            .copied()
            .unwrap_or(0)
    };
    let leader = &replicas[l].name;
    assert_eq!(
        count(leader, "get") + count(leader, "list") + count(leader, "watch"),
        0,
        "the leader reads nothing"
    );
    assert!(
        count(leader, "update") <= 150,
        "at most one write per RetryPeriod (2 s) in 300 s"
    );
    assert!(count(leader, "update") >= 100, "the leader kept renewing");
    for r in replicas.iter().filter(|r| &r.name != leader) {
        let total: u64 = counts
            .iter()
            .filter(|((c, _, _), _)| c == &r.name)
            .map(|(_, n)| n)
            .sum();
        assert!(
            total <= 10,
            "{} made {total} requests in 5 minutes (at most 2 a minute)",
            r.name
        );
    }
    stop_all(replicas).await;
}

#[tokio::test(start_paused = true)]
async fn a_slow_answer_to_the_acquiring_write_does_not_lengthen_the_first_deadline() {
    let server = server().await;
    let observer: Api<Lease> = Api::namespaced(server.client_for("observer").expect("client"), NS);
    let mut ghost: Lease = serde_json::from_value(serde_json::json!({
        "metadata": { "name": LEASE },
        "spec": { "holderIdentity": "ghost", "leaseDurationSeconds": 15 }
    }))
    .expect("lease");
    ghost = observer
        .create(&PostParams::default(), &ghost)
        .await
        .expect("create");
    // pod-b, whose clock runs 1.4x fast, follows the ghost by watch.
    let b = Replica::start_with(&server, config("pod-b"), Some(SkewedClock::new(1.4)));
    b.wait_for(secs(5), "following the ghost", |s| {
        s.holder.as_deref() == Some("ghost")
    })
    .await;
    // pod-b cannot write for now; pod-a's writes land at once but their answers come 1.5 s late.
    server.inject("pod-b", Fault::HangRequests);
    server.inject("pod-a", Fault::SlowResponse(Duration::from_millis(1500)));
    let spec = ghost.spec.as_mut().expect("spec");
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    observer
        .replace(LEASE, &PostParams::default(), &ghost)
        .await
        .expect("release");
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(secs(10), "leader", |s| s.is_leader).await;
    server.lift("pod-a");
    server.lift("pod-b");
    server.inject("pod-a", Fault::Partition);
    b.wait_for(secs(30), "leader", |s| s.is_leader).await;
    // When pod-b starts its term, pod-a must already have stepped down.
    let started = b.starts()[0];
    let stepped = a.stops().first().map(|(at, _)| *at);
    assert!(
        stepped.is_some_and(|at| at < started),
        "two leaders: pod-b started at {started:?}, pod-a stepped down at {stepped:?} (its first deadline ran from the late answer)"
    );
    server.lift("pod-a");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_deleted_lease_is_not_taken_before_its_holders_term_runs_out() {
    let server = server().await;
    let (leader, follower) = elected_pair(&server, config("pod-a"), config("pod-b")).await;
    tokio::time::sleep(secs(3)).await;
    let observer: Api<Lease> = Api::namespaced(server.client_for("observer").expect("client"), NS);
    observer
        .delete(LEASE, &kube::api::DeleteParams::default())
        .await
        .expect("delete");
    // The holder recreates it at its next renew and keeps leading; the follower never starts a
    // term while the holder's term is still running.
    let replicas = vec![leader, follower];
    // One jittered RetryPeriod later the holder has renewed, recreating the Lease.
    tokio::time::sleep(secs(3)).await;
    assert_steady_single_leader(&server, &replicas, secs(30)).await;
    let (leader, follower) = (&replicas[0], &replicas[1]);
    assert!(leader.is_leader() && leader.stops().is_empty());
    assert!(
        follower.starts().is_empty(),
        "the follower took a deleted Lease during the holder's term"
    );
    // With the holder gone too, the follower recreates it after the observed expiry.
    let mut replicas = replicas;
    let follower = replicas.pop().expect("follower");
    let leader = replicas.pop().expect("leader");
    leader.handle.abort();
    observer
        .delete(LEASE, &kube::api::DeleteParams::default())
        .await
        .expect("delete");
    follower.wait_for(secs(20), "leader", |s| s.is_leader).await;
    follower.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_resigning_leader_releases_and_another_replica_takes_over() {
    let server = server().await;
    let client = server.client_for("pod-a").expect("client");
    let elector = haptic_election::LeaderElector::new(client, config("pod-a")).expect("config");
    let resign = elector.resign_handle();
    let mut a_state = elector.state();
    let token = tokio_util::sync::CancellationToken::new();
    let once = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callbacks = haptic_election::Callbacks::new().on_started_leading(move |_term| {
        let (resign, once) = (resign.clone(), once.clone());
        async move {
            // The first term cannot do its work (say, no fencing epoch): it gives the term up.
            if !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
                resign.resign();
            }
        }
    });
    let run = tokio::spawn(elector.run(token.clone(), callbacks));
    a_state
        .wait_for(|s| s.terms == 1 && !s.is_leader)
        .await
        .expect("state");
    assert_eq!(a_state.borrow().last_stop, Some(StopReason::Resigned));
    let b = Replica::start(&server, config("pod-b"));
    b.wait_for(secs(5), "leader after the resignation", |s| s.is_leader)
        .await;
    assert_eq!(holder(&server).await.as_deref(), Some("pod-b"));
    tokio::time::sleep(secs(20)).await;
    assert_eq!(a_state.borrow().terms, 1, "the resigned replica follows");
    token.cancel();
    tokio::time::timeout(secs(30), run)
        .await
        .expect("stops")
        .expect("no panic");
    b.stop().await;
}
