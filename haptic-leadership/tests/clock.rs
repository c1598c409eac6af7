//! `Leadership::with_clock`: the elector judges its renew deadline on the clock it is given.
//! A leader cut from the API steps down after RenewDeadline on its own clock, so one whose
//! clock runs twice as fast steps down in about half the real time (tokio's paused clock).

use std::time::Duration;

use haptic_election::{ElectionConfig, SkewedClock};
use haptic_eventbus::{Event, EventBus};
use haptic_leadership::{
    BecameLeader, LeaderElectionStarted, Leadership, LostLeadership, NewLeaderObserved,
};
use haptic_testkit::{ApiServer, Fault};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
struct Ev;

impl Event for Ev {
    type Kind = ();
    fn kind(&self) {}
}
impl From<LeaderElectionStarted> for Ev {
    fn from(_: LeaderElectionStarted) -> Self {
        Ev
    }
}
impl From<BecameLeader> for Ev {
    fn from(_: BecameLeader) -> Self {
        Ev
    }
}
impl From<LostLeadership> for Ev {
    fn from(_: LostLeadership) -> Self {
        Ev
    }
}
impl From<NewLeaderObserved> for Ev {
    fn from(_: NewLeaderObserved) -> Self {
        Ev
    }
}

/// Virtual seconds from partitioning the leader until it no longer leads.
async fn time_to_step_down(rate: Option<f64>) -> f64 {
    let server = ApiServer::start().await.expect("server");
    let config = ElectionConfig::new("pod-a", "haptic-leader", "default")
        .with_durations(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .with_request_timeout(Duration::from_secs(2));
    let mut leadership = Leadership::new(
        server.client_for("pod-a").expect("client"),
        config,
        EventBus::<Ev>::new(),
    )
    .expect("config");
    if let Some(rate) = rate {
        leadership = leadership.with_clock(SkewedClock::new(rate));
    }
    let metrics = leadership.metrics();
    let token = CancellationToken::new();
    let run = tokio::spawn(leadership.run(token.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !metrics.is_leader() {
        assert!(Instant::now() < deadline, "pod-a never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Past a few renews, then cut it off.
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.inject("pod-a", Fault::Partition);
    let cut = Instant::now();
    while metrics.is_leader() {
        assert!(
            cut.elapsed() < Duration::from_secs(60),
            "pod-a never stepped down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = cut.elapsed().as_secs_f64();
    server.lift("pod-a");
    token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), run).await;
    took
}

#[tokio::test(start_paused = true)]
async fn a_fast_clock_makes_a_cut_off_leader_step_down_sooner() {
    // The last renew was at most a RetryPeriod (2 s) before the cut: a real clock steps down
    // 8 to 10 s after it; twice as fast, 4 to 5 s (plus polling).
    let real = time_to_step_down(None).await;
    assert!((7.9..=11.0).contains(&real), "real clock: {real} s");
    let fast = time_to_step_down(Some(2.0)).await;
    assert!((3.9..=6.0).contains(&fast), "2x clock: {fast} s");
}
