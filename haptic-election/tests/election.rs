//! Election behaviour against haptic-testkit over HTTP, several replicas per test, on tokio's
//! paused clock.

mod common;

use std::time::Duration;

use common::*;
use haptic_election::StopReason;

const S: fn(u64) -> Duration = Duration::from_secs;

#[tokio::test(start_paused = true)]
async fn single_replica_leads_and_writes_client_go_fields() {
    let server = haptic_testkit::ApiServer::start().await.expect("server");
    let a = Replica::start(&server, config("pod-a"));
    a.wait_for(S(10), "leader", |s| s.is_leader).await;
    let first = lease(&server)
        .await
        .expect("lease exists")
        .spec
        .expect("spec");
    assert_eq!(first.holder_identity.as_deref(), Some("pod-a"));
    assert_eq!(first.lease_duration_seconds, Some(15));
    assert_eq!(first.lease_transitions, Some(0));
    assert!(first.acquire_time.is_some());
    tokio::time::sleep(S(7)).await;
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
    server.shutdown().await;
}
