//! The epoch protocol on both API servers: haptic-testkit's stand-in and a real kube-apiserver
//! with etcd (`cargo xtask envtest`), one test body each. What the real server adds: its own
//! resourceVersion and conflict semantics on Lease PUTs, and a Lease deleted and recreated by
//! etcd, not by a model of it.

use std::collections::BTreeMap;

use haptic_epoch::{EPOCH_ANNOTATION, EpochStore, Error};
use haptic_testkit::{TestApi, on_both_servers};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::{
    Api,
    api::{DeleteParams, ObjectMeta, PostParams},
};

const LEASE: &str = "haptic-leader";

/// Makes `holder` the Lease's holder, as an election would (creating it if missing).
async fn hold(api: &Api<Lease>, holder: &str) {
    match api.get_opt(LEASE).await.expect("get") {
        Some(mut lease) => {
            lease
                .spec
                .get_or_insert_with(LeaseSpec::default)
                .holder_identity = Some(holder.to_owned());
            api.replace(LEASE, &PostParams::default(), &lease)
                .await
                .expect("replace");
        }
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE.into()),
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

async fn annotation(api: &Api<Lease>) -> Option<String> {
    api.get(LEASE)
        .await
        .expect("get")
        .metadata
        .annotations
        .unwrap_or_else(BTreeMap::new)
        .get(EPOCH_ANNOTATION)
        .cloned()
}

/// The test's namespace, an admin Lease API in it, and an epoch store for `identity` that
/// writes with that identity's own client (a ServiceAccount token on the real server).
async fn setup(api: &TestApi, prefix: &str) -> (String, Api<Lease>) {
    let ns = api.namespace(prefix).await.expect("namespace");
    let admin = api.admin_client().await.expect("admin client");
    (ns.clone(), Api::namespaced(admin, &ns))
}

async fn store(api: &TestApi, ns: &str, identity: &str) -> EpochStore {
    // The store writes as an admin-equivalent identity here: RBAC for Leases is the
    // controller's concern, exercised by haptic-controller's real-server tests.
    let client = api.admin_client().await.expect("client");
    EpochStore::new(client, ns, LEASE, identity)
}

on_both_servers! {
    async fn concurrent_bumps_never_claim_the_same_epoch(api: TestApi) {
        let (ns, leases) = setup(&api, "epoch-race").await;
        hold(&leases, "pod-a").await;
        // Two writers with the same identity and two connections (an old and a new process).
        let one = store(&api, &ns, "pod-a").await;
        let two = store(&api, &ns, "pod-a").await;
        let run = |s: EpochStore| async move {
            let mut claimed = Vec::new();
            for _ in 0..10 {
                claimed.push(s.bump().await.expect("bump").epoch());
            }
            claimed
        };
        let (a, b) = tokio::join!(run(one), run(two));
        let mut all: Vec<u64> = a.iter().chain(b.iter()).copied().collect();
        all.sort_unstable();
        let before = all.len();
        all.dedup();
        assert_eq!(all.len(), before, "two writers claimed the same epoch: {a:?} {b:?}");
        assert!(a.windows(2).all(|w| w[0] < w[1]) && b.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(annotation(&leases).await, Some(all.last().expect("epochs").to_string()));
    }
}

on_both_servers! {
    async fn bump_is_refused_when_the_lease_names_another_holder(api: TestApi) {
        let (ns, leases) = setup(&api, "epoch-foreign").await;
        hold(&leases, "pod-b").await;
        let b = store(&api, &ns, "pod-b").await;
        assert_eq!(b.bump().await.expect("bump").epoch(), 1);
        let a = store(&api, &ns, "pod-a").await;
        match a.bump().await {
            Err(Error::NotHolder { holder, identity }) => {
                assert_eq!((holder.as_str(), identity.as_str()), ("pod-b", "pod-a"))
            }
            other => panic!("expected NotHolder, got {other:?}"),
        }
        assert_eq!(annotation(&leases).await.as_deref(), Some("1"), "nothing written");
        leases.delete(LEASE, &DeleteParams::default()).await.expect("delete");
        assert!(matches!(a.bump().await, Err(Error::LeaseMissing { .. })));
    }
}

on_both_servers! {
    async fn reclaim_after_the_lease_was_deleted_raises_the_epoch_above_the_floor(api: TestApi) {
        let (ns, leases) = setup(&api, "epoch-reclaim").await;
        hold(&leases, "pod-a").await;
        let first = store(&api, &ns, "pod-a").await;
        let mut fence = 0;
        for _ in 0..5 {
            fence = fence.max(first.bump().await.expect("bump").epoch());
        }
        assert_eq!(fence, 5);
        // The Lease is deleted and recreated; the controller restarted (no memory).
        leases.delete(LEASE, &DeleteParams::default()).await.expect("delete");
        hold(&leases, "pod-a").await;
        let restarted = store(&api, &ns, "pod-a").await;
        let mut term = restarted.bump().await.expect("bump");
        assert_eq!(term.epoch(), 1, "the counter regressed");
        let raised = term.reclaim(fence).await.expect("reclaim");
        assert!(raised > fence, "reclaimed {raised} above the fence {fence}");
        assert_eq!(restarted.leader_epoch(), raised);
        assert_eq!(annotation(&leases).await, Some(raised.to_string()));
        // Another holder now: a reclaim is a foreign leader, and nothing is written.
        hold(&leases, "pod-b").await;
        match term.reclaim(raised + 10).await {
            Err(Error::ForeignLeader { holder, .. }) => assert_eq!(holder, "pod-b"),
            other => panic!("expected ForeignLeader, got {other:?}"),
        }
        assert_eq!(annotation(&leases).await, Some(raised.to_string()));
    }
}
