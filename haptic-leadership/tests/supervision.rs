//! Supervision: a panicking component never leaves a leader that holds the Lease and does
//! nothing. Two replicas against haptic-testkit over HTTP, on tokio's paused clock.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use haptic_election::ElectionConfig;
use haptic_eventbus::{Event, EventBus, Filter};
use haptic_leadership::{
    BecameLeader, COMPONENT_FAILED, LeaderElectionStarted, Leadership, LeadershipMetrics,
    LostLeadership, NewLeaderObserved,
};
use haptic_testkit::ApiServer;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Started,
    Leader(String, u64),
    Lost(String, String),
    Observed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Started,
    Leader,
    Lost,
    Observed,
}

impl Event for Ev {
    type Kind = Kind;
    fn kind(&self) -> Kind {
        match self {
            Ev::Started => Kind::Started,
            Ev::Leader(..) => Kind::Leader,
            Ev::Lost(..) => Kind::Lost,
            Ev::Observed => Kind::Observed,
        }
    }
}

impl From<LeaderElectionStarted> for Ev {
    fn from(_: LeaderElectionStarted) -> Self {
        Ev::Started
    }
}
impl From<BecameLeader> for Ev {
    fn from(e: BecameLeader) -> Self {
        Ev::Leader(e.identity, e.epoch)
    }
}
impl From<LostLeadership> for Ev {
    fn from(e: LostLeadership) -> Self {
        Ev::Lost(e.identity, e.reason)
    }
}
impl From<NewLeaderObserved> for Ev {
    fn from(_: NewLeaderObserved) -> Self {
        Ev::Observed
    }
}

/// What every replica's components did, in order: `"<replica> deployed at epoch N"` lines,
/// and the lost-leadership reasons.
type Log = Arc<Mutex<Vec<String>>>;

struct Replica {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<haptic_leadership::Result<()>>,
    metrics: Arc<LeadershipMetrics>,
}

/// A replica whose leader-only "deployer" panics on its first term anywhere (`armed`), and
/// otherwise records that it deployed at its epoch and runs until cancelled.
fn start(
    server: &ApiServer,
    identity: &str,
    enabled: bool,
    armed: Arc<AtomicBool>,
    log: Log,
) -> Replica {
    let config = ElectionConfig::new(identity, "haptic-leader", "default")
        .with_durations(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .with_request_timeout(Duration::from_secs(2))
        .with_enabled(enabled);
    let who = identity.to_owned();
    let lost_log = log.clone();
    let lost_who = who.clone();
    let leadership = Leadership::new(
        server.client_for(identity).expect("client"),
        config,
        EventBus::<Ev>::new(),
    )
    .expect("config")
    .with_stop_timeout(Duration::from_secs(5))
    .on_lost_leadership(move |reason| {
        lost_log
            .lock()
            .expect("lock")
            .push(format!("{lost_who} lost: {reason}"));
    })
    .leader_only("deployer", move |ctx| {
        let mut woke = ctx
            .bus()
            .subscribe_leader_only("deployer", Filter::kind(Kind::Leader));
        let (armed, log, who) = (armed.clone(), log.clone(), who.clone());
        async move {
            let _ = woke.recv().await;
            if armed.swap(false, Ordering::SeqCst) {
                panic!("injected: the deployer hit an input it cannot handle");
            }
            log.lock()
                .expect("lock")
                .push(format!("{who} deployed at epoch {}", ctx.epoch()));
            ctx.token().cancelled().await;
        }
    });
    let metrics = leadership.metrics();
    let token = CancellationToken::new();
    let handle = tokio::spawn(leadership.run(token.clone()));
    Replica {
        token,
        handle,
        metrics,
    }
}

impl Replica {
    async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("stops")
            .expect("no panic escapes the adapter")
            .expect("ran");
    }
}

async fn until(what: &str, within: Duration, f: impl Fn() -> bool) {
    let end = tokio::time::Instant::now() + within;
    while !f() {
        assert!(
            tokio::time::Instant::now() < end,
            "not {what} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_leader_only_component_ends_the_term_and_a_fresh_term_deploys() {
    let server = ApiServer::start().await.expect("server");
    let log: Log = Arc::default();
    let armed = Arc::new(AtomicBool::new(true));
    let a = start(&server, "pod-a", true, armed.clone(), log.clone());
    until("pod-a's deployer panicked", Duration::from_secs(10), || {
        a.metrics.component_failures("deployer") == 1
    })
    .await;
    let b = start(&server, "pod-b", true, armed.clone(), log.clone());
    // The term that panicked is given up, and a fresh one (on either replica) deploys.
    until("a fresh term deploys", Duration::from_secs(30), || {
        log.lock()
            .expect("lock")
            .iter()
            .any(|l| l.contains("deployed at epoch"))
    })
    .await;
    let lines = log.lock().expect("lock").clone();
    assert_eq!(
        lines[0],
        format!("pod-a lost: {COMPONENT_FAILED}"),
        "{lines:#?}"
    );
    let deployed = lines
        .iter()
        .find(|l| l.contains("deployed"))
        .expect("a deploy line");
    assert!(
        deployed.ends_with("epoch 2"),
        "the next term claims epoch 2: {lines:#?}"
    );
    assert_eq!(a.metrics.component_failures("deployer"), 1);
    assert_eq!(b.metrics.component_failures("deployer"), 0);
    // A term rebuilt its components: the replica stays healthy.
    assert_eq!(a.metrics.health(), Ok(()));
    assert!(a.metrics.is_leader() || b.metrics.is_leader());
    a.stop().await;
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn with_election_disabled_a_failed_component_makes_the_replica_unhealthy() {
    let server = ApiServer::start().await.expect("server");
    let log: Log = Arc::default();
    let a = start(
        &server,
        "pod-a",
        false,
        Arc::new(AtomicBool::new(true)),
        log,
    );
    until("pod-a reports unhealthy", Duration::from_secs(10), || {
        a.metrics.health().is_err()
    })
    .await;
    let why = a.metrics.health().expect_err("unhealthy");
    assert!(
        why.contains("deployer") && why.contains("injected"),
        "{why}"
    );
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_panicking_all_replica_component_makes_the_replica_unhealthy_and_resign() {
    let server = ApiServer::start().await.expect("server");
    let config = ElectionConfig::new("pod-a", "haptic-leader", "default");
    let fire = Arc::new(tokio::sync::Notify::new());
    let trigger = fire.clone();
    let leadership = Leadership::new(
        server.client_for("pod-a").expect("client"),
        config,
        EventBus::<Ev>::new(),
    )
    .expect("config")
    .all_replicas("watchers", move |_bus, _token| async move {
        trigger.notified().await;
        panic!("injected: a watcher hit an input it cannot handle");
    });
    let metrics = leadership.metrics();
    let token = CancellationToken::new();
    let handle = tokio::spawn(leadership.run(token.clone()));
    until("pod-a leads", Duration::from_secs(10), || {
        metrics.is_leader()
    })
    .await;
    fire.notify_one();
    until("pod-a gives up its term", Duration::from_secs(10), || {
        !metrics.is_leader()
    })
    .await;
    let why = metrics.health().expect_err("unhealthy");
    assert!(
        why.contains("watchers") && why.contains("injected"),
        "{why}"
    );
    assert_eq!(metrics.component_failures("watchers"), 1);
    token.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("stops")
        .expect("no panic escapes the adapter")
        .expect("ran");
}
