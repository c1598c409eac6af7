//! The election on both API servers: haptic-testkit's stand-in and a real kube-apiserver with
//! etcd (`cargo xtask envtest`), one test body each, on the wall clock (a real server cannot
//! follow tokio's paused time). What the real server adds: its Lease validation, its 409s on a
//! stale resourceVersion, and its watch delivering the release.

use std::time::Duration;

use haptic_election::{Callbacks, ElectionConfig, ElectionState, LeaderElector, StopReason};
use haptic_testkit::{TestApi, on_both_servers};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, api::PostParams};
use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;

const LEASE: &str = "haptic-leader";

/// One elector, its state and its token.
struct Replica {
    name: String,
    token: CancellationToken,
    handle: JoinHandle<()>,
    state: watch::Receiver<ElectionState>,
}

impl Replica {
    async fn start(api: &TestApi, config: ElectionConfig) -> Self {
        let name = config.identity.clone();
        let client = api.admin_client().await.expect("client");
        let elector = LeaderElector::new(client, config).expect("valid config");
        let state = elector.state();
        let callbacks = Callbacks::new().on_started_leading(|term| async move {
            term.cancelled().await;
        });
        let token = CancellationToken::new();
        let handle = tokio::spawn(elector.run(token.clone(), callbacks));
        Self {
            name,
            token,
            handle,
            state,
        }
    }

    async fn wait_for(&self, within: Duration, what: &str, f: impl Fn(&ElectionState) -> bool) {
        let mut state = self.state.clone();
        tokio::time::timeout(within, state.wait_for(|s| f(s)))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{}: not {what} within {within:?}; state {:?}",
                    self.name,
                    *self.state.borrow()
                )
            })
            .expect("elector state channel closed");
    }

    fn is_leader(&self) -> bool {
        self.state.borrow().is_leader
    }

    async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("elector stops")
            .expect("no panic");
    }
}

/// Short wall-clock timings: 3 s / 2 s / 500 ms.
fn fast(identity: &str, ns: &str) -> ElectionConfig {
    ElectionConfig::new(identity, LEASE, ns)
        .with_durations(
            Duration::from_secs(3),
            Duration::from_secs(2),
            Duration::from_millis(500),
        )
        .with_request_timeout(Duration::from_secs(2))
}

/// Timings where only the watch can explain a takeover within a few seconds: a follower would
/// otherwise retry every 20 s and wait 60 s for expiry.
fn slow(identity: &str, ns: &str) -> ElectionConfig {
    ElectionConfig::new(identity, LEASE, ns)
        .with_durations(
            Duration::from_secs(60),
            Duration::from_secs(40),
            Duration::from_secs(20),
        )
        .with_request_timeout(Duration::from_secs(5))
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt(LEASE)
        .await
        .expect("read lease")
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

on_both_servers! {
    async fn a_release_is_taken_over_through_the_watch(api: TestApi) {
        let ns = api.namespace("election-release").await.expect("namespace");
        let leases: Api<Lease> = Api::namespaced(api.admin_client().await.expect("client"), &ns);
        let a = Replica::start(&api, slow("pod-a", &ns)).await;
        a.wait_for(Duration::from_secs(10), "leader", |s| s.is_leader).await;
        let b = Replica::start(&api, slow("pod-b", &ns)).await;
        b.wait_for(Duration::from_secs(10), "following pod-a", |s| {
            s.holder.as_deref() == Some("pod-a")
        })
        .await;
        assert!(!b.is_leader());
        // pod-a shuts down and releases; pod-b's next retry would be 20 s away, expiry 60 s.
        a.stop().await;
        b.wait_for(Duration::from_secs(8), "leader after the release", |s| s.is_leader).await;
        let lease = leases.get(LEASE).await.expect("lease");
        let spec = lease.spec.expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("pod-b"));
        assert_eq!(spec.lease_transitions, Some(1), "a holder change counts a transition");
        b.stop().await;
        // pod-b released on stop: the Lease names nobody.
        assert_eq!(holder(&leases).await, None);
    }
}

on_both_servers! {
    async fn racing_replicas_elect_exactly_one_and_a_taken_lease_steps_down(api: TestApi) {
        let ns = api.namespace("election-race").await.expect("namespace");
        let admin = api.admin_client().await.expect("client");
        let leases: Api<Lease> = Api::namespaced(admin, &ns);
        let mut replicas = Vec::new();
        for id in ["pod-a", "pod-b", "pod-c"] {
            replicas.push(Replica::start(&api, fast(id, &ns)).await);
        }
        // Three replicas race for the same Lease: creates and PUTs collide (409), one wins.
        let leader = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                let leaders: Vec<usize> =
                    (0..replicas.len()).filter(|i| replicas[*i].is_leader()).collect();
                if let [one] = leaders[..]
                    && holder(&leases).await.as_deref() == Some(replicas[one].name.as_str())
                {
                    return one;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("exactly one leader, named by the Lease");
        let leader = replicas.remove(leader);
        for follower in &replicas {
            assert!(!follower.is_leader(), "{} leads too", follower.name);
        }
        // Someone overwrites the Lease (a PUT with the current resourceVersion).
        let mut lease = leases.get(LEASE).await.expect("lease");
        let spec = lease.spec.as_mut().expect("spec");
        spec.holder_identity = Some("intruder".into());
        spec.lease_duration_seconds = Some(3);
        leases.replace(LEASE, &PostParams::default(), &lease).await.expect("overwrite");
        leader
            .wait_for(Duration::from_secs(5), "stepped down", |s| {
                s.last_stop == Some(StopReason::LeaseTaken)
            })
            .await;
        // A stale write is refused with 409 by either server.
        let stale = leases.replace(LEASE, &PostParams::default(), &lease).await;
        match stale {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 409, "{status:?}"),
            other => panic!("a PUT with a stale resourceVersion must be a 409, got {other:?}"),
        }
        // The intruder never renews: one of the replicas leads again after its term.
        replicas.push(leader);
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Some(h) = holder(&leases).await
                    && replicas.iter().any(|r| r.name == h && r.is_leader())
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("a replica leads again after the intruder's term");
        for r in replicas {
            r.stop().await;
        }
    }
}
