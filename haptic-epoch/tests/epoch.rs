//! The epoch protocol against haptic-testkit over HTTP.

use std::collections::BTreeMap;

use haptic_epoch::{EPOCH_ANNOTATION, EpochStore, Error};
use haptic_testkit::ApiServer;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::{
    Api,
    api::{DeleteParams, ObjectMeta, PostParams},
};
use proptest::prelude::*;

const NS: &str = "default";
const LEASE: &str = "haptic-leader";

fn api(server: &ApiServer) -> Api<Lease> {
    Api::namespaced(server.client_for("elector").expect("client"), NS)
}

/// Makes `holder` the Lease's holder, as an election would (creating the Lease if missing),
/// optionally setting the annotation to a raw value.
async fn hold(server: &ApiServer, holder: &str, annotation: Option<&str>) {
    let api = api(server);
    match api.get_opt(LEASE).await.expect("get") {
        Some(mut lease) => {
            lease
                .spec
                .get_or_insert_with(LeaseSpec::default)
                .holder_identity = Some(holder.to_owned());
            if let Some(value) = annotation {
                lease
                    .metadata
                    .annotations
                    .get_or_insert_with(BTreeMap::new)
                    .insert(EPOCH_ANNOTATION.into(), value.into());
            }
            api.replace(LEASE, &PostParams::default(), &lease)
                .await
                .expect("replace");
        }
        None => {
            let annotations =
                annotation.map(|v| BTreeMap::from([(EPOCH_ANNOTATION.to_owned(), v.to_owned())]));
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE.into()),
                    annotations,
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(holder.into()),
                    lease_duration_seconds: Some(15),
                    ..LeaseSpec::default()
                }),
            };
            api.create(&PostParams::default(), &lease)
                .await
                .expect("create");
        }
    }
}

async fn annotation(server: &ApiServer) -> Option<String> {
    api(server)
        .get(LEASE)
        .await
        .expect("get")
        .metadata
        .annotations
        .and_then(|a| a.get(EPOCH_ANNOTATION).cloned())
}

fn store(server: &ApiServer, identity: &str) -> EpochStore {
    EpochStore::new(
        server.client_for(identity).expect("client"),
        NS,
        LEASE,
        identity,
    )
}

#[tokio::test]
async fn concurrent_bumps_never_claim_the_same_epoch() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-a", None).await;
    // Two writers with the same identity (e.g. an old and a new process of one pod).
    let one = store(&server, "pod-a");
    let two = EpochStore::new(
        server.client_for("pod-a-second").expect("client"),
        NS,
        LEASE,
        "pod-a",
    );
    let run = |s: EpochStore| async move {
        let mut claimed = Vec::new();
        for _ in 0..15 {
            claimed.push(s.bump().await.expect("bump").epoch());
        }
        claimed
    };
    let (a, b) = tokio::join!(run(one), run(two));
    let mut all: Vec<u64> = a.iter().chain(b.iter()).copied().collect();
    all.sort_unstable();
    let before = all.len();
    all.dedup();
    assert_eq!(
        all.len(),
        before,
        "two writers claimed the same epoch: {a:?} {b:?}"
    );
    assert!(a.windows(2).all(|w| w[0] < w[1]) && b.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(
        annotation(&server).await,
        Some(all.last().expect("epochs").to_string())
    );
    let conflicts = server
        .requests()
        .iter()
        .filter(|r| r.verb == "update" && r.code == 409)
        .count();
    assert!(
        conflicts > 0,
        "the writers did race (the test exercised the retry)"
    );
}

#[tokio::test]
async fn bump_is_refused_when_the_lease_names_another_holder() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-b", Some("7")).await;
    let a = store(&server, "pod-a");
    match a.bump().await {
        Err(Error::NotHolder { holder, identity }) => {
            assert_eq!((holder.as_str(), identity.as_str()), ("pod-b", "pod-a"))
        }
        other => panic!("expected NotHolder, got {other:?}"),
    }
    assert_eq!(a.leader_epoch(), 0);
    assert_eq!(
        annotation(&server).await.as_deref(),
        Some("7"),
        "nothing written"
    );
    api(&server)
        .delete(LEASE, &DeleteParams::default())
        .await
        .expect("delete");
    assert!(matches!(a.bump().await, Err(Error::LeaseMissing { .. })));
}

#[tokio::test]
async fn reclaim_after_the_lease_was_deleted_and_recreated_raises_the_epoch_above_the_floor() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-a", None).await;
    let first = store(&server, "pod-a");
    let mut fence = 0;
    for _ in 0..5 {
        fence = fence.max(first.bump().await.expect("bump").epoch());
    }
    assert_eq!(fence, 5);
    // The Lease is deleted and recreated (or restored); the controller restarted (no memory).
    api(&server)
        .delete(LEASE, &DeleteParams::default())
        .await
        .expect("delete");
    hold(&server, "pod-a", None).await;
    let restarted = store(&server, "pod-a");
    let mut term = restarted.bump().await.expect("bump");
    assert_eq!(term.epoch(), 1, "the counter regressed");
    assert!(term.epoch() <= fence, "an agent would refuse it");
    let raised = term.reclaim(fence).await.expect("reclaim");
    assert!(raised > fence, "reclaimed {raised} above the fence {fence}");
    assert_eq!(term.epoch(), raised);
    assert_eq!(restarted.leader_epoch(), raised);
    assert_eq!(annotation(&server).await, Some(raised.to_string()));
    // The same controller never goes below what it claimed, even if the Lease is reset again.
    api(&server)
        .delete(LEASE, &DeleteParams::default())
        .await
        .expect("delete");
    hold(&server, "pod-a", None).await;
    assert!(restarted.bump().await.expect("bump").epoch() > raised);
}

#[tokio::test]
async fn reclaim_with_another_holder_or_a_higher_epoch_is_a_foreign_leader() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-a", None).await;
    let a = store(&server, "pod-a");
    let mut term = a.bump().await.expect("bump");
    hold(&server, "pod-b", None).await;
    let b = store(&server, "pod-b");
    let b_term = b.bump().await.expect("bump");
    match term.reclaim(b_term.epoch()).await {
        Err(Error::ForeignLeader { holder, epoch }) => {
            assert_eq!(holder, "pod-b");
            assert_eq!(epoch, b_term.epoch());
        }
        other => panic!("expected ForeignLeader, got {other:?}"),
    }
    assert_eq!(
        a.leader_epoch(),
        0,
        "the deposed term no longer claims an epoch"
    );
    assert_eq!(
        annotation(&server).await,
        Some(b_term.epoch().to_string()),
        "nothing written"
    );
    // Same holder name, but someone raised the epoch past ours: also foreign.
    hold(&server, "pod-a", Some("50")).await;
    let mut stale = a.bump_above(3).await.expect("bump");
    hold(&server, "pod-a", Some("99")).await;
    assert!(matches!(
        stale.reclaim(99).await,
        Err(Error::ForeignLeader { epoch: 99, .. })
    ));
}

#[tokio::test]
async fn malformed_annotations_are_named_never_read_as_a_number_and_recovered_upwards() {
    let server = ApiServer::start().await.expect("server");
    for (value, reason) in [
        ("abc", "not a decimal integer"),
        ("-3", "negative"),
        ("99999999999999999999999", "overflows u64"),
        ("", "empty"),
    ] {
        hold(&server, "pod-a", Some(value)).await;
        let a = store(&server, "pod-a");
        match a.bump().await {
            Err(Error::Malformed(m)) => {
                assert_eq!(m.value, value);
                let text = Error::Malformed(m).to_string();
                assert!(
                    text.contains(reason) && text.contains(EPOCH_ANNOTATION),
                    "{text}"
                );
            }
            other => panic!("{value:?}: expected Malformed, got {other:?}"),
        }
        assert_eq!(
            annotation(&server).await.as_deref(),
            Some(value),
            "a malformed value is left for the recovery"
        );
        // Recovery: above the highest fence the receivers report.
        let term = a.bump_above(41).await.expect("recovery");
        assert_eq!(term.epoch(), 42);
        assert_eq!(annotation(&server).await.as_deref(), Some("42"));
        api(&server)
            .delete(LEASE, &DeleteParams::default())
            .await
            .expect("delete");
    }
}

#[tokio::test]
async fn stand_down_releases_and_the_next_term_claims_a_higher_epoch() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-a", None).await;
    let a = store(&server, "pod-a");
    let term = a.bump().await.expect("bump");
    let first = term.epoch();
    term.stand_down("test").await.expect("stand down");
    let spec = api(&server)
        .get(LEASE)
        .await
        .expect("get")
        .spec
        .expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some(""));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    assert_eq!(a.leader_epoch(), 0);
    assert!(
        matches!(a.bump().await, Err(Error::NotHolder { .. })),
        "no epoch without a fresh acquisition"
    );
    hold(&server, "pod-b", None).await;
    let b = store(&server, "pod-b");
    let b_term = b.bump().await.expect("bump");
    assert!(b_term.epoch() > first);
    assert_eq!(b.leader_epoch(), b_term.epoch());
    drop(b_term);
    assert_eq!(
        b.leader_epoch(),
        0,
        "a dropped (deposed) term claims nothing"
    );
    // bump_above never goes below a well-formed annotation.
    hold(&server, "pod-a", Some("10")).await;
    assert_eq!(a.bump_above(3).await.expect("bump").epoch(), 11);
}

/// One step of the property test's history.
#[derive(Debug, Clone)]
enum Step {
    /// A controller (0..3, each a restartable process) acquires the Lease and starts a term.
    Term { controller: usize, restarted: bool },
    /// The Lease is deleted (recreated by the next term's election).
    Delete,
    /// The Lease is restored from a snapshot taken earlier.
    Restore(usize),
    /// A snapshot of the Lease is taken (for later restores).
    Snapshot,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0usize..3, any::<bool>()).prop_map(|(controller, restarted)| Step::Term { controller, restarted }),
        1 => Just(Step::Delete),
        1 => (0usize..4).prop_map(Step::Restore),
        1 => Just(Step::Snapshot),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the sequence of terms, deletions and restores, the epochs a fence (keeping the
    /// maximum, as an agent does) accepts are strictly increasing, and every term gets one.
    #[test]
    fn accepted_epochs_strictly_increase(steps in proptest::collection::vec(step(), 1..14)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let server = ApiServer::start().await.expect("server");
            let names = ["pod-a", "pod-b", "pod-c"];
            let mut stores: Vec<EpochStore> = names.iter().map(|n| store(&server, n)).collect();
            let mut fence = 0u64;
            let mut accepted = Vec::new();
            let mut snapshots: Vec<Lease> = Vec::new();
            for step in steps {
                match step {
                    Step::Term { controller, restarted } => {
                        if restarted {
                            stores[controller] = store(&server, names[controller]);
                        }
                        hold(&server, names[controller], None).await;
                        let mut term = stores[controller].bump().await.expect("bump");
                        if term.epoch() <= fence {
                            // The agent refuses with its fence; the leader reclaims.
                            term.reclaim(fence).await.expect("reclaim");
                        }
                        assert!(term.epoch() > fence, "epoch {} not above fence {fence}", term.epoch());
                        fence = term.epoch();
                        accepted.push(term.epoch());
                        term.stand_down("next").await.expect("stand down");
                    }
                    Step::Delete => {
                        let _ = api(&server).delete(LEASE, &DeleteParams::default()).await;
                    }
                    Step::Snapshot => {
                        if let Some(lease) = api(&server).get_opt(LEASE).await.expect("get") {
                            snapshots.push(lease);
                        }
                    }
                    Step::Restore(i) => {
                        if let Some(snap) = snapshots.get(i % snapshots.len().max(1)).cloned() {
                            let _ = api(&server).delete(LEASE, &DeleteParams::default()).await;
                            let mut lease = snap;
                            lease.metadata.resource_version = None;
                            lease.metadata.uid = None;
                            lease.metadata.creation_timestamp = None;
                            api(&server).create(&PostParams::default(), &lease).await.expect("restore");
                        }
                    }
                }
            }
            assert!(accepted.windows(2).all(|w| w[0] < w[1]), "accepted epochs {accepted:?}");
        });
    }
}

#[tokio::test]
async fn bump_retries_transient_errors() {
    let server = ApiServer::start().await.expect("server");
    hold(&server, "pod-a", None).await;
    let a = store(&server, "pod-a");
    server.inject(
        "pod-a",
        haptic_testkit::Fault::Error {
            code: 500,
            retry_after: None,
            times: Some(2),
        },
    );
    assert_eq!(a.bump().await.expect("bump after two 500s").epoch(), 1);
    server.inject(
        "pod-a",
        haptic_testkit::Fault::Error {
            code: 403,
            retry_after: None,
            times: Some(1),
        },
    );
    assert!(
        matches!(a.bump().await, Err(Error::Api(_))),
        "a 403 is not retried"
    );
}
