//! Behaviour of the bus as the issue lists it, through the public API only.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use haptic_eventbus::{
    Config, Event, EventBus, Filter, Outcome, RequestId, RequestParams, ResponseTo,
    SubscribeParams, request,
};
use tracing::Level;
use tracing_subscriber::layer::{Context, SubscriberExt};

#[derive(Debug, PartialEq, Eq)]
enum Ev {
    Num(u64),
    BecameLeader { epoch: u64 },
    Ping(u64),
    Pong(u64),
    Validate { request: RequestId },
    Validated { request: RequestId, by: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Num,
    BecameLeader,
    Ping,
    Pong,
    Validate,
    Validated,
}

impl Event for Ev {
    type Kind = Kind;

    fn kind(&self) -> Kind {
        match self {
            Ev::Num(_) => Kind::Num,
            Ev::BecameLeader { .. } => Kind::BecameLeader,
            Ev::Ping(_) => Kind::Ping,
            Ev::Pong(_) => Kind::Pong,
            Ev::Validate { .. } => Kind::Validate,
            Ev::Validated { .. } => Kind::Validated,
        }
    }

    fn response_to(&self) -> Option<ResponseTo<'_>> {
        match self {
            Ev::Validated { request, by } => Some(ResponseTo {
                request: *request,
                responder: by,
            }),
            _ => None,
        }
    }
}

fn num(event: Option<Arc<Ev>>) -> u64 {
    match event.as_deref() {
        Some(Ev::Num(n)) => *n,
        other => panic!("expected a Num event, got {other:?}"),
    }
}

/// Records every tracing event (level and rendered fields) on the current thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(Level, String)>>>);

impl Captured {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        // tracing caches one interest per callsite for the whole process, computed by the first
        // thread that reaches it. A test thread without a subscriber would cache `never` for the
        // bus's `warn!` (tracing-core 0.1.36, `Rebuilder::JustOne`), and this test's scoped
        // subscriber would then see nothing. A global default that takes everything, set once,
        // means no thread ever has "no subscriber".
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            // Nothing else in this binary sets one; a second setter would only keep its own.
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
        });
        let subscriber = tracing_subscriber::registry().with(self.clone());
        let guard = tracing::subscriber::set_default(subscriber);
        // A callsite a thread began registering before the global default existed may have been
        // listed after that rebuild with `never`: ask every listed callsite again.
        tracing::callsite::rebuild_interest_cache();
        guard
    }

    fn matching(&self, level: Level, needle: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, text)| *l == level && text.contains(needle))
            .map(|(_, text)| text.clone())
            .collect()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Captured {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        struct Fields(String);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={:?} ", field.name(), value));
            }
        }
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), fields.0));
    }
}

#[tokio::test]
async fn buffered_events_are_delivered_in_order_across_start() {
    let bus = EventBus::<Ev>::new();
    let mut early = bus.subscribe("early", Filter::kind(Kind::Num));
    for n in 1..=3 {
        assert_eq!(bus.publish(Ev::Num(n)), Outcome::Buffered);
    }
    // Subscribed before start but after those publishes: the buffer is delivered at start to
    // everyone present then.
    let mut before_start = bus.subscribe("before-start", Filter::all());
    for n in 4..=5 {
        assert_eq!(bus.publish(Ev::Num(n)), Outcome::Buffered);
    }
    assert!(
        early.try_recv().is_none(),
        "nothing is delivered before start"
    );
    assert_eq!(bus.stats().buffered, 5);

    assert_eq!(bus.start(), 5);
    assert_eq!(bus.start(), 0, "start is idempotent");
    for n in 6..=8 {
        assert_eq!(
            bus.publish(Ev::Num(n)),
            Outcome::Delivered { subscribers: 2 }
        );
    }
    for sub in [&mut early, &mut before_start] {
        let got: Vec<u64> = (0..8).map(|_| num(sub.try_recv())).collect();
        assert_eq!(got, (1..=8).collect::<Vec<_>>());
        assert!(sub.try_recv().is_none(), "each event once");
    }
}

#[tokio::test]
async fn buffer_overflow_is_counted_and_logged() {
    let log = Captured::default();
    let _guard = log.install();
    let bus = EventBus::<Ev>::with_config(Config::default().with_buffer_capacity(3));
    let mut sub = bus.subscribe("sub", Filter::all());
    let outcomes: Vec<Outcome> = (1..=7).map(|n| bus.publish(Ev::Num(n))).collect();
    assert_eq!(&outcomes[..3], &[Outcome::Buffered; 3]);
    assert_eq!(&outcomes[3..], &[Outcome::Overflowed; 4]);
    assert_eq!(bus.stats().buffer_overflows, 4);
    // Logged at the 1st, 2nd and 4th overflow, not at every one.
    assert_eq!(log.matching(Level::ERROR, "buffer full").len(), 3);

    bus.start();
    let got: Vec<u64> = std::iter::from_fn(|| sub.try_recv())
        .map(|e| num(Some(e)))
        .collect();
    assert_eq!(
        got,
        vec![1, 2, 3],
        "the oldest events are kept, the overflow dropped"
    );
}

/// The exact sequence haptic-leadership runs on acquiring the Lease.
#[tokio::test]
async fn pause_contract_delivers_the_waking_event_once_to_components_built_during_the_pause() {
    // BecameLeader sticky as well: replay must not make it arrive twice.
    let bus =
        EventBus::<Ev>::with_config(Config::default().with_sticky_kinds([Kind::BecameLeader]));
    let mut all_replicas = bus.subscribe("commentator", Filter::all());
    bus.start();
    bus.publish(Ev::Num(1));

    bus.pause();
    assert!(!bus.is_running());
    assert_eq!(
        bus.publish(Ev::BecameLeader { epoch: 7 }),
        Outcome::Buffered
    );
    let mut deployer =
        bus.subscribe_leader_only("deployer", Filter::kinds([Kind::BecameLeader, Kind::Num]));
    let mut scheduler = bus.subscribe_leader_only("scheduler", Filter::kind(Kind::BecameLeader));
    assert!(deployer.try_recv().is_none(), "nothing before start");
    bus.start();
    bus.publish(Ev::Num(2));

    for sub in [&mut deployer, &mut scheduler] {
        assert_eq!(
            sub.recv().await.as_deref(),
            Some(&Ev::BecameLeader { epoch: 7 })
        );
    }
    assert_eq!(num(deployer.try_recv()), 2, "events after start follow");
    assert!(deployer.try_recv().is_none(), "BecameLeader exactly once");
    assert!(scheduler.try_recv().is_none(), "BecameLeader exactly once");

    let seen: Vec<Arc<Ev>> = std::iter::from_fn(|| all_replicas.try_recv()).collect();
    let seen: Vec<&Ev> = seen.iter().map(|e| &**e).collect();
    assert_eq!(
        seen,
        vec![&Ev::Num(1), &Ev::BecameLeader { epoch: 7 }, &Ev::Num(2)]
    );
}

#[tokio::test]
async fn late_subscriber_is_warned_about_except_leader_only() {
    let log = Captured::default();
    let _guard = log.install();
    let bus = EventBus::<Ev>::new();
    let _on_time = bus.subscribe("on-time", Filter::all());
    bus.start();
    assert!(log.matching(Level::WARN, "late subscriber").is_empty());

    let _leader = bus.subscribe_leader_only("leader-component", Filter::all());
    bus.pause();
    let _leader_in_pause = bus.subscribe_leader_only("leader-in-pause", Filter::all());
    assert!(
        log.matching(Level::WARN, "late subscriber").is_empty(),
        "leader-only subscriptions are expected late"
    );

    bus.start();
    let _late = bus.subscribe("latecomer", Filter::kind(Kind::Num));
    let warnings = log.matching(Level::WARN, "late subscriber");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("latecomer"), "{warnings:?}");
}

#[tokio::test(start_paused = true)]
async fn slow_reliable_subscriber_loses_nothing_in_a_100k_burst() {
    const BURST: u64 = 100_000;
    let log = Captured::default();
    let _guard = log.install();
    let bus = EventBus::<Ev>::with_config(Config::default().with_high_water_warn(10_000));
    let mut slow = bus.subscribe("slow", Filter::kind(Kind::Num));
    bus.start();

    let consumer = tokio::spawn(async move {
        let mut expected = 0;
        while let Some(event) = slow.recv().await {
            assert_eq!(num(Some(event)), expected, "order and completeness");
            expected += 1;
            if expected % 1_000 == 0 {
                // Slow: it takes (virtual) time over its events.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if expected == BURST {
                return slow.stats();
            }
        }
        panic!("bus closed after {expected} events");
    });
    for n in 0..BURST {
        assert_eq!(
            bus.publish(Ev::Num(n)),
            Outcome::Delivered { subscribers: 1 }
        );
    }
    let stats = tokio::time::timeout(Duration::from_secs(600), consumer)
        .await
        .expect("the consumer drains the burst")
        .unwrap();
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.queued, 0);
    assert_eq!(
        stats.high_water, BURST as usize,
        "the whole burst waited at once"
    );
    // Reported at 10k, 20k, 40k and 80k.
    assert_eq!(log.matching(Level::WARN, "high-water").len(), 4);
}

#[tokio::test]
async fn lossy_drops_are_counted_per_subscriber() {
    let bus = EventBus::<Ev>::new();
    let mut small = bus.subscribe_with(SubscribeParams::new("small", Filter::all()).with_lossy(10));
    let mut large =
        bus.subscribe_with(SubscribeParams::new("large", Filter::all()).with_lossy(1_000));
    bus.start();
    for n in 0..100 {
        bus.publish(Ev::Num(n));
    }
    assert_eq!(small.stats().dropped, 90);
    assert_eq!(large.stats().dropped, 0);
    let kept: Vec<u64> = std::iter::from_fn(|| small.try_recv())
        .map(|e| num(Some(e)))
        .collect();
    assert_eq!(kept, (0..10).collect::<Vec<_>>(), "the newest are dropped");
    assert_eq!(std::iter::from_fn(|| large.try_recv()).count(), 100);

    // Room again: delivery resumes, the count stays.
    assert_eq!(
        bus.publish(Ev::Num(100)),
        Outcome::Delivered { subscribers: 2 }
    );
    assert_eq!(num(small.try_recv()), 100);
    let stats = bus.stats();
    let dropped: Vec<(String, u64)> = stats
        .subscribers
        .iter()
        .map(|s| (s.name.clone(), s.dropped))
        .collect();
    assert_eq!(dropped, vec![("small".into(), 90), ("large".into(), 0)]);
}

#[tokio::test]
async fn lossy_capacity_counts_events_the_receiver_took_but_has_not_returned() {
    let bus = EventBus::<Ev>::new();
    let mut sub = bus.subscribe_with(SubscribeParams::new("sub", Filter::all()).with_lossy(4));
    bus.start();
    for n in 0..4 {
        bus.publish(Ev::Num(n));
    }
    assert_eq!(num(sub.try_recv()), 0);
    assert_eq!(sub.stats().queued, 3);
    // One free place: the first is queued, the second dropped.
    assert_eq!(
        bus.publish(Ev::Num(4)),
        Outcome::Delivered { subscribers: 1 }
    );
    assert_eq!(
        bus.publish(Ev::Num(5)),
        Outcome::Delivered { subscribers: 0 }
    );
    let stats = sub.stats();
    assert_eq!((stats.queued, stats.dropped, stats.high_water), (4, 1, 4));
    let rest: Vec<u64> = std::iter::from_fn(|| sub.try_recv())
        .map(|e| num(Some(e)))
        .collect();
    assert_eq!(rest, vec![1, 2, 3, 4]);
    assert_eq!(sub.stats().queued, 0);
}

#[tokio::test]
async fn sticky_kinds_replay_their_latest_event_to_new_subscribers() {
    let bus = EventBus::<Ev>::with_config(
        Config::default().with_sticky_kinds([Kind::BecameLeader, Kind::Pong]),
    );
    bus.start();
    bus.publish(Ev::BecameLeader { epoch: 1 });
    bus.publish(Ev::Pong(1));
    bus.publish(Ev::Num(1)); // not sticky
    bus.publish(Ev::BecameLeader { epoch: 2 });

    let mut leader_only = bus.subscribe_leader_only("leader", Filter::kind(Kind::BecameLeader));
    assert_eq!(
        leader_only.try_recv().as_deref(),
        Some(&Ev::BecameLeader { epoch: 2 }),
        "only the latest value, at once"
    );
    assert!(leader_only.try_recv().is_none());

    let mut everything = bus.subscribe_leader_only("all", Filter::all());
    let replay: Vec<Arc<Ev>> = std::iter::from_fn(|| everything.try_recv()).collect();
    let replay: Vec<&Ev> = replay.iter().map(|e| &**e).collect();
    assert_eq!(
        replay,
        vec![&Ev::Pong(1), &Ev::BecameLeader { epoch: 2 }],
        "latest of each sticky kind, in publication order, nothing else"
    );

    let mut unrelated = bus.subscribe_leader_only("nums", Filter::kind(Kind::Num));
    assert!(unrelated.try_recv().is_none());
}

async fn responder(bus: EventBus<Ev>, name: &'static str) {
    let mut requests = bus.subscribe_leader_only(name, Filter::kind(Kind::Validate));
    while let Some(event) = requests.recv().await {
        if let Ev::Validate { request } = *event {
            bus.publish(Ev::Validated {
                request,
                by: name.to_owned(),
            });
        }
    }
}

#[tokio::test(start_paused = true)]
async fn scatter_gather_reports_a_missing_responder() {
    let bus = EventBus::<Ev>::new();
    bus.start();
    let responders =
        tokio::task::JoinSet::from_iter([responder(bus.clone(), "a"), responder(bus.clone(), "b")]);
    tokio::task::yield_now().await; // let them subscribe
    let mut observer = bus.subscribe_leader_only("observer", Filter::kind(Kind::Validated));

    let timeout = Duration::from_secs(2);
    let params = RequestParams::new(timeout).with_expected_responders(["a", "b", "c"]);

    let started = tokio::time::Instant::now();
    let gathered = bus
        .request(
            |request| Ev::Validate { request },
            params.clone().with_min_responses(2),
        )
        .await
        .unwrap();
    assert_eq!(started.elapsed(), timeout, "waited for c until the timeout");
    assert!(gathered.timed_out);
    assert_eq!(gathered.missing, vec!["c".to_owned()]);
    let mut by: Vec<&str> = gathered
        .responses
        .iter()
        .map(|r| r.responder.as_str())
        .collect();
    by.sort_unstable();
    assert_eq!(by, vec!["a", "b"]);
    assert_eq!(
        observer.try_recv().as_deref().map(Event::kind),
        Some(Kind::Validated),
        "responses are ordinary events too"
    );

    let err = bus
        .request(
            |request| Ev::Validate { request },
            params.clone().with_min_responses(3),
        )
        .await
        .unwrap_err();
    match err {
        request::Error::NotEnoughResponses {
            received,
            required,
            missing,
            ..
        } => {
            assert_eq!((received, required), (2, 3));
            assert_eq!(missing, vec!["c".to_owned()]);
        }
    }

    // With only present responders expected, the request ends as soon as they answered.
    let started = tokio::time::Instant::now();
    let gathered = bus
        .request(
            |request| Ev::Validate { request },
            RequestParams::new(timeout).with_expected_responders(["a", "b"]),
        )
        .await
        .unwrap();
    assert!(!gathered.timed_out);
    assert!(started.elapsed() < timeout);
    assert!(gathered.missing.is_empty());
    assert_eq!(gathered.responses.len(), 2);

    drop(bus);
    drop(observer);
    // The responders end when the last bus handle is gone... but each holds a clone, so shut
    // them down explicitly and bounded.
    let mut responders = responders;
    responders.abort_all();
    tokio::time::timeout(Duration::from_secs(1), async {
        while responders.join_next().await.is_some() {}
    })
    .await
    .unwrap();
}

#[test]
fn a_subscriber_that_publishes_from_its_handler_does_not_deadlock() {
    // Run on a separate thread so that a deadlock fails the test within a bound instead of
    // hanging it.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let result = runtime.block_on(async {
            let bus = EventBus::<Ev>::new();
            let mut pings = bus.subscribe("ponger", Filter::kind(Kind::Ping));
            // It also receives its own output: publishing into its own queue must not block.
            let mut own = bus.subscribe("ponger-self", Filter::kind(Kind::Pong));
            let mut pongs = bus.subscribe("observer", Filter::kind(Kind::Pong));
            bus.start();
            let handler_bus = bus.clone();
            let handler = tokio::spawn(async move {
                while let Some(event) = pings.recv().await {
                    if let Ev::Ping(n) = *event {
                        handler_bus.publish(Ev::Pong(n));
                        handler_bus.publish(Ev::Ping(n + 1)); // re-entrant: its own kind
                        if n == 1_000 {
                            break;
                        }
                    }
                }
            });
            bus.publish(Ev::Ping(0));
            let mut last = 0;
            while last < 1_000 {
                match pongs.recv().await.as_deref() {
                    Some(Ev::Pong(n)) => last = *n,
                    other => panic!("unexpected {other:?}"),
                }
            }
            handler.await.unwrap();
            std::iter::from_fn(|| own.try_recv()).count()
        });
        let _ = done_tx.send(result);
    });
    let own = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("publishing from a handler deadlocked");
    assert_eq!(own, 1_001);
}

#[tokio::test]
async fn a_dropped_subscription_is_removed() {
    let bus = EventBus::<Ev>::with_config(Config::default().with_sticky_kinds([Kind::Num]));
    let kept = bus.subscribe("kept", Filter::kind(Kind::Num));
    let dropped_kind = bus.subscribe("dropped-kind", Filter::kinds([Kind::Num, Kind::Ping]));
    let dropped_all = bus.subscribe("dropped-all", Filter::all());
    bus.start();
    assert_eq!(bus.subscriber_count(), 3);
    assert_eq!(
        bus.publish(Ev::Num(1)),
        Outcome::Delivered { subscribers: 3 }
    );

    drop(dropped_kind);
    assert_eq!(bus.subscriber_count(), 2);
    drop(dropped_all);
    assert_eq!(bus.subscriber_count(), 1);
    assert_eq!(
        bus.publish(Ev::Num(2)),
        Outcome::Delivered { subscribers: 1 }
    );
    assert_eq!(
        bus.publish(Ev::Ping(1)),
        Outcome::Delivered { subscribers: 0 }
    );
    let names: Vec<String> = bus
        .stats()
        .subscribers
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["kept".to_owned()]);
    assert_eq!(kept.stats().queued, 2);
}

#[tokio::test]
async fn subscriptions_end_when_the_bus_is_gone() {
    let bus = EventBus::<Ev>::new();
    let mut sub = bus.subscribe("sub", Filter::all());
    bus.start();
    bus.publish(Ev::Num(1));
    let waiter = tokio::spawn(async move {
        let first = sub.recv().await;
        let end = sub.recv().await;
        (first, end, sub.is_closed())
    });
    tokio::task::yield_now().await;
    drop(bus);
    let (first, end, closed) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(num(first), 1, "queued events are still received");
    assert!(end.is_none());
    assert!(closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishers_give_every_subscriber_the_same_complete_order() {
    const PUBLISHERS: u64 = 4;
    const EACH: u64 = 10_000;
    let bus = EventBus::<Ev>::new();
    let receivers: Vec<_> = (0..3)
        .map(|i| {
            let mut sub = bus.subscribe(format!("sub-{i}"), Filter::kind(Kind::Num));
            tokio::spawn(async move {
                let mut seen = Vec::with_capacity((PUBLISHERS * EACH) as usize);
                while seen.len() < (PUBLISHERS * EACH) as usize {
                    match sub.recv().await {
                        Some(event) => seen.push(num(Some(event))),
                        None => break,
                    }
                }
                seen
            })
        })
        .collect();
    bus.start();
    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let bus = bus.clone();
            tokio::spawn(async move {
                for i in 0..EACH {
                    bus.publish(Ev::Num(p * 1_000_000 + i));
                    if i % 100 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for publisher in publishers {
        publisher.await.unwrap();
    }
    let mut sequences = Vec::new();
    for receiver in receivers {
        let seen = tokio::time::timeout(Duration::from_secs(60), receiver)
            .await
            .expect("every subscriber receives every event")
            .unwrap();
        assert_eq!(seen.len(), (PUBLISHERS * EACH) as usize);
        for p in 0..PUBLISHERS {
            let own: Vec<u64> = seen
                .iter()
                .copied()
                .filter(|n| n / 1_000_000 == p)
                .collect();
            assert_eq!(
                own,
                (0..EACH).map(|i| p * 1_000_000 + i).collect::<Vec<_>>()
            );
        }
        sequences.push(seen);
    }
    assert!(
        sequences.windows(2).all(|w| w[0] == w[1]),
        "one total order for all subscribers"
    );
}

#[tokio::test(start_paused = true)]
async fn recv_is_cancel_safe() {
    let bus = EventBus::<Ev>::new();
    let mut sub = bus.subscribe("sub", Filter::all());
    bus.start();
    for round in 0..3 {
        // A recv abandoned on timeout must not swallow the wake-up or the next event.
        let waited = tokio::time::timeout(Duration::from_millis(10), sub.recv()).await;
        assert!(waited.is_err(), "nothing was published yet");
        bus.publish(Ev::Num(round));
        let got = tokio::time::timeout(Duration::from_millis(10), sub.recv()).await;
        assert_eq!(num(got.unwrap()), round);
    }
}

#[tokio::test]
async fn publish_takes_anything_that_converts_into_the_event() {
    struct Epoch(u64);
    impl From<Epoch> for Ev {
        fn from(epoch: Epoch) -> Ev {
            Ev::BecameLeader { epoch: epoch.0 }
        }
    }
    let bus = EventBus::<Ev>::new();
    let mut sub = bus.subscribe("sub", Filter::kind(Kind::BecameLeader));
    bus.start();
    assert_eq!(bus.publish(Epoch(3)), Outcome::Delivered { subscribers: 1 });
    assert_eq!(
        sub.try_recv().as_deref(),
        Some(&Ev::BecameLeader { epoch: 3 })
    );
}
