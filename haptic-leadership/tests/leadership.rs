//! The adapter against haptic-testkit over HTTP, two replicas, on tokio's paused clock.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use haptic_election::ElectionConfig;
use haptic_eventbus::{Event, EventBus, Filter, Subscription};
use haptic_leadership::{
    BecameLeader, LeaderElectionStarted, Leadership, LeadershipMetrics, LostLeadership,
    NewLeaderObserved, STOOD_DOWN,
};
use haptic_testkit::ApiServer;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Started(String),
    Leader(String, u64),
    Lost(String, String),
    Observed(String, bool),
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
            Ev::Started(_) => Kind::Started,
            Ev::Leader(..) => Kind::Leader,
            Ev::Lost(..) => Kind::Lost,
            Ev::Observed(..) => Kind::Observed,
        }
    }
}

impl From<LeaderElectionStarted> for Ev {
    fn from(e: LeaderElectionStarted) -> Self {
        Ev::Started(e.identity)
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
    fn from(e: NewLeaderObserved) -> Self {
        Ev::Observed(e.new_leader_identity, e.is_self)
    }
}

fn config(identity: &str) -> ElectionConfig {
    ElectionConfig::new(identity, "haptic-leader", "default")
        .with_durations(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .with_request_timeout(Duration::from_secs(2))
}

type Log = Arc<Mutex<Vec<String>>>;

/// Drains what a subscription holds now, without waiting.
fn drain(sub: &Mutex<Subscription<Ev>>) -> Vec<Ev> {
    let mut sub = sub.lock().expect("lock");
    std::iter::from_fn(|| sub.try_recv())
        .map(|e| (*e).clone())
        .collect()
}

struct Replica {
    name: String,
    token: CancellationToken,
    handle: JoinHandle<haptic_leadership::Result<()>>,
    /// Everything the replica's all-replica listener received, in order.
    heard: Arc<Mutex<Vec<Ev>>>,
    metrics: Arc<LeadershipMetrics>,
}

impl Replica {
    fn leads(&self) -> bool {
        self.metrics.is_leader()
    }

    fn heard(&self) -> Vec<Ev> {
        self.heard.lock().expect("lock").clone()
    }

    async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("stops")
            .expect("no panic")
            .expect("ran");
    }
}

/// Starts a replica whose listener checks, in each hook, that the event was already published
/// to it (logging "hook saw X first" or "hook ran before X"), and whose leader-only worker
/// writes a ConfigMap with its own client every 500 ms until cancelled, then takes 1 s more to
/// finish (and writes once more).
fn start(
    server: &ApiServer,
    config: ElectionConfig,
    log: Log,
    stand_down_once: Option<Arc<AtomicBool>>,
) -> Replica {
    let name = config.identity.clone();
    let bus = EventBus::<Ev>::new();
    let listener = Arc::new(Mutex::new(bus.subscribe("listener", Filter::all())));
    let heard: Arc<Mutex<Vec<Ev>>> = Arc::default();
    let record = {
        let (listener, heard) = (listener.clone(), heard.clone());
        move || {
            let new = drain(&listener);
            heard.lock().expect("lock").extend(new);
        }
    };
    let work_client = server.client_for(&format!("{name}-work")).expect("client");
    let (l1, l2, l3) = (log.clone(), log.clone(), log.clone());
    let (r1, r2, r3) = (record.clone(), record.clone(), record.clone());
    let (h1, h2, h3) = (heard.clone(), heard.clone(), heard.clone());
    let n1 = name.clone();
    let leadership = Leadership::new(server.client_for(&name).expect("client"), config, bus)
        .expect("config")
        .with_stop_timeout(Duration::from_secs(5))
        .on_new_leader(move |who, _| {
            r1();
            let seen = h1.lock().expect("lock").iter().any(|e| matches!(e, Ev::Observed(w, _) if w == who));
            l1.lock().expect("lock").push(format!("new-leader hook: published first = {seen}"));
        })
        .on_lost_leadership(move |reason| {
            r2();
            let seen = h2.lock().expect("lock").iter().any(|e| matches!(e, Ev::Lost(_, r) if r == reason));
            l2.lock().expect("lock").push(format!("lost hook: published first = {seen}"));
        })
        .leader_only("worker", move |ctx| {
            let mut mine = ctx.bus().subscribe_leader_only("worker", Filter::kind(Kind::Leader));
            let (log, record, heard, api) = (l3.clone(), r3.clone(), h3.clone(), Api::<ConfigMap>::namespaced(work_client.clone(), "default"));
            let stand_down = stand_down_once.clone();
            let who = n1.clone();
            async move {
                let first = mine.recv().await.map(|e| (*e).clone());
                // The side effect of the term: the all-replica listener must already have it.
                record();
                let listener_has_it = heard.lock().expect("lock").iter().any(|e| Some(e) == first.as_ref());
                log.lock().expect("lock").push(format!("worker {who} woke on {first:?}; listener had it = {listener_has_it}"));
                if let Some(flag) = stand_down
                    && !flag.swap(true, Ordering::SeqCst)
                {
                    ctx.stand_down("test asked");
                }
                let patch = Patch::Merge(serde_json::json!({ "data": { "writer": who, "epoch": ctx.epoch().to_string() } }));
                loop {
                    tokio::select! {
                        () = ctx.token().cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                    api.patch("work", &PatchParams::default(), &patch).await.expect("work write");
                }
                // Slow cleanup that still writes: it must finish before the Lease is released.
                tokio::time::sleep(Duration::from_secs(1)).await;
                api.patch("work", &PatchParams::default(), &patch).await.expect("final write");
                log.lock().expect("lock").push(format!("worker {who} done"));
            }
        });
    let metrics = leadership.metrics();
    let token = CancellationToken::new();
    let handle = tokio::spawn(leadership.run(token.clone()));
    // Keep draining the listener in the background, so `heard` is complete.
    let (bg_listener, bg_heard, bg_token) = (listener, heard.clone(), token.clone());
    tokio::spawn(async move {
        loop {
            let next = {
                let mut sub = bg_listener.lock().expect("lock");
                sub.try_recv()
            };
            match next {
                Some(e) => bg_heard.lock().expect("lock").push((*e).clone()),
                None if bg_token.is_cancelled() => break,
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    Replica {
        name,
        token,
        handle,
        heard,
        metrics,
    }
}

async fn server_with_configmap() -> ApiServer {
    let server = ApiServer::start().await.expect("server");
    let api: Api<ConfigMap> =
        Api::namespaced(server.client_for("setup").expect("client"), "default");
    let cm: ConfigMap =
        serde_json::from_value(serde_json::json!({ "metadata": { "name": "work" } })).expect("cm");
    api.create(&PostParams::default(), &cm)
        .await
        .expect("create");
    server
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

fn epochs(heard: &[Ev]) -> Vec<u64> {
    heard
        .iter()
        .filter_map(|e| {
            if let Ev::Leader(_, epoch) = e {
                Some(*epoch)
            } else {
                None
            }
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn events_precede_hooks_and_side_effects_and_leader_only_work_ends_before_release() {
    let server = server_with_configmap().await;
    let log: Log = Arc::default();
    let a = start(&server, config("pod-a"), log.clone(), None);
    until("pod-a leads", Duration::from_secs(10), || a.leads()).await;
    let b = start(&server, config("pod-b"), log.clone(), None);
    until("pod-b observes pod-a", Duration::from_secs(10), || {
        b.heard().contains(&Ev::Observed("pod-a".into(), false))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;

    // Every replica's listener got LeaderElectionStarted, and pod-a's its BecameLeader, epoch 1.
    assert_eq!(a.heard()[0], Ev::Started("pod-a".into()));
    assert!(a.heard().contains(&Ev::Leader("pod-a".into(), 1)));
    assert!(
        b.heard().iter().all(|e| !matches!(e, Ev::Leader(..))),
        "pod-b never led"
    );

    let a_name = a.name.clone();
    a.stop().await;
    until("pod-b leads", Duration::from_secs(5), || b.leads()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        epochs(&b.heard()) == vec![2],
        "the next term claims a higher epoch: {:?}",
        b.heard()
    );

    // No leader-only work of pod-a ran after pod-a released the Lease.
    let requests = server.requests();
    let release = requests
        .iter()
        .rev()
        .find(|r| r.client == a_name && r.verb == "update")
        .expect("release PUT");
    let work: Vec<_> = requests
        .iter()
        .filter(|r| r.client == "pod-a-work")
        .collect();
    assert!(work.len() >= 5, "pod-a's worker did write");
    assert!(
        work.iter().all(|r| r.seq < release.seq),
        "pod-a's leader-only work ran after the release"
    );

    let log = log.lock().expect("lock").clone();
    for line in &log {
        assert!(
            !line.contains("= false"),
            "an event came after its hook or side effect: {line}\n{log:#?}"
        );
    }
    assert!(
        log.iter()
            .any(|l| l.starts_with("worker pod-a woke on Some(Leader(\"pod-a\", 1))")),
        "{log:#?}"
    );
    assert!(
        log.iter()
            .any(|l| l.starts_with("worker pod-b woke on Some(Leader(\"pod-b\", 2))")),
        "{log:#?}"
    );
    assert!(log.iter().any(|l| l == "worker pod-a done"));
    assert!(log.iter().any(|l| l.starts_with("lost hook")));
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn stand_down_releases_and_the_next_term_claims_a_higher_epoch() {
    let server = server_with_configmap().await;
    let log: Log = Arc::default();
    let once = Arc::new(AtomicBool::new(false));
    let a = start(&server, config("pod-a"), log.clone(), Some(once.clone()));
    until("pod-a leads", Duration::from_secs(10), || a.leads()).await;
    let b = start(&server, config("pod-b"), log.clone(), Some(once.clone()));
    until(
        "a stand-down and a new term",
        Duration::from_secs(30),
        || epochs(&a.heard()).len() + epochs(&b.heard()).len() >= 2 && (a.leads() || b.leads()),
    )
    .await;
    assert!(
        a.heard()
            .contains(&Ev::Lost("pod-a".into(), "test asked".into())),
        "{:?}",
        a.heard()
    );
    let mut all = epochs(&a.heard());
    all.extend(epochs(&b.heard()));
    all.sort_unstable();
    assert_eq!(all[0], 1);
    assert!(
        all[1] > all[0],
        "the next term claims a higher epoch: {all:?}"
    );
    assert_ne!(STOOD_DOWN, "test asked");
    let log = log.lock().expect("lock").clone();
    assert!(
        log.iter().any(|l| l == "worker pod-a done"),
        "the stood-down term's work was awaited: {log:#?}"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn disabled_mode_publishes_became_leader_with_a_standalone_identity_and_no_api_calls() {
    let server = server_with_configmap().await;
    let log: Log = Arc::default();
    let solo = start(
        &server,
        config("standalone").with_enabled(false),
        log.clone(),
        None,
    );
    until("leads", Duration::from_secs(1), || solo.leads()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        solo.heard().contains(&Ev::Leader("standalone".into(), 0)),
        "{:?}",
        solo.heard()
    );
    assert!(
        server.requests().iter().all(|r| r.client != "standalone"),
        "no API calls for the election"
    );
    let metrics = solo.metrics.clone();
    solo.stop().await;
    assert!(!metrics.is_leader());
    assert_eq!(metrics.transitions(), 2);
    assert!(metrics.time_as_leader() >= Duration::from_secs(3));
    // Exported through an OpenTelemetry SDK and its Prometheus exporter, as a binary does.
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_units()
        .without_counter_suffixes()
        .without_target_info()
        .scope_info_enabled(false)
        .build()
        .expect("exporter");
    let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_reader(exporter)
        .build();
    metrics.register(&opentelemetry::metrics::MeterProvider::meter(
        &provider, "test",
    ));
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("encode");
    let scrape =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    let value = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name)
            .map(|s| s.value.clone())
            .unwrap_or_else(|| panic!("{name} missing from {text}"))
    };
    use prometheus_parse::Value;
    assert_eq!(value("haptic_leader_election_is_leader"), Value::Gauge(0.0));
    assert_eq!(
        value("haptic_leader_election_transitions_total"),
        Value::Counter(2.0)
    );
    assert!(
        matches!(value("haptic_leader_election_time_as_leader_seconds_total"), Value::Counter(s) if s >= 3.0),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_taken_lease_is_reported_as_lease_taken() {
    let server = server_with_configmap().await;
    let log: Log = Arc::default();
    let a = start(&server, config("pod-a"), log.clone(), None);
    until("pod-a leads", Duration::from_secs(10), || a.leads()).await;
    let api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(server.client_for("intruder").expect("client"), "default");
    let mut lease = api.get("haptic-leader").await.expect("lease");
    lease.spec.as_mut().expect("spec").holder_identity = Some("intruder".into());
    api.replace("haptic-leader", &PostParams::default(), &lease)
        .await
        .expect("overwrite");
    until("pod-a lost it", Duration::from_secs(10), || {
        a.heard()
            .contains(&Ev::Lost("pod-a".into(), "lease_taken".into()))
    })
    .await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_epoch_bump_resigns_the_term_and_dispatches_nothing() {
    let server = server_with_configmap().await;
    // A malformed epoch annotation: no term can claim an epoch.
    let api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(server.client_for("setup").expect("client"), "default");
    let lease = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "haptic-leader", "annotations": { "haptic.io/leader-epoch": "x" } },
        "spec": { "holderIdentity": "", "leaseDurationSeconds": 1 }
    }))
    .expect("lease");
    api.create(&PostParams::default(), &lease)
        .await
        .expect("create");
    let log: Log = Arc::default();
    let a = start(&server, config("pod-a"), log.clone(), None);
    let mut released_seen = false;
    let end = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < end {
        let holder = api
            .get("haptic-leader")
            .await
            .expect("lease")
            .spec
            .and_then(|s| s.holder_identity);
        released_seen |= holder.as_deref() == Some("");
        assert!(!a.leads(), "a term without an epoch must not lead");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(released_seen, "the resigned term released the Lease");
    assert!(
        epochs(&a.heard()).is_empty(),
        "no BecameLeader without an epoch: {:?}",
        a.heard()
    );
    let writes = server
        .requests()
        .iter()
        .filter(|r| r.client == "pod-a" && r.verb == "update")
        .count();
    assert!(
        writes <= 60,
        "pod-a wrote {writes} times in 30 s: resigning must pause, not spin"
    );
    assert!(
        log.lock()
            .expect("lock")
            .iter()
            .all(|l| !l.starts_with("worker")),
        "no leader-only work ran"
    );
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_malformed_epoch_is_recovered_above_the_floor_the_application_gives() {
    let server = server_with_configmap().await;
    let api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(server.client_for("setup").expect("client"), "default");
    let lease = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "haptic-leader", "annotations": { "haptic.io/leader-epoch": "-7" } },
        "spec": { "holderIdentity": "", "leaseDurationSeconds": 1 }
    }))
    .expect("lease");
    api.create(&PostParams::default(), &lease)
        .await
        .expect("create");
    let bus = EventBus::<Ev>::new();
    let mut events = bus.subscribe("listener", Filter::kind(Kind::Leader));
    // The agents report fence 41: the recovered epoch must be above it.
    let leadership = Leadership::new(
        server.client_for("pod-a").expect("client"),
        config("pod-a"),
        bus,
    )
    .expect("config")
    .with_epoch_floor(|| async { Some(41) });
    let token = CancellationToken::new();
    let run = tokio::spawn(leadership.run(token.clone()));
    let first = tokio::time::timeout(Duration::from_secs(10), events.recv())
        .await
        .expect("a term within 10 s")
        .expect("event");
    assert_eq!(*first, Ev::Leader("pod-a".into(), 42));
    let annotation = api
        .get("haptic-leader")
        .await
        .expect("lease")
        .metadata
        .annotations
        .and_then(|a| a.get("haptic.io/leader-epoch").cloned());
    assert_eq!(annotation.as_deref(), Some("42"));
    token.cancel();
    run.await.expect("no panic").expect("ran");
}
