//! Shared helpers for the election tests: replicas on one haptic-testkit server.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use haptic_election::{Callbacks, Clock, ElectionConfig, ElectionState, LeaderElector, StopReason};
use haptic_testkit::ApiServer;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::{sync::watch, task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

pub const LEASE: &str = "haptic-leader";
pub const NS: &str = "default";

/// Test durations: 15 s / 10 s / 2 s (kube-controller-manager's), 2 s request timeout.
pub fn config(identity: &str) -> ElectionConfig {
    ElectionConfig::new(identity, LEASE, NS)
        .with_durations(
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
        .with_request_timeout(Duration::from_secs(2))
}

/// What a replica's callbacks saw, in order, with the tokio time they ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Started,
    WorkEnded,
    Stopped(StopReason),
    NewLeader(String, bool),
}

pub struct Replica {
    pub name: String,
    pub token: CancellationToken,
    pub handle: JoinHandle<()>,
    pub state: watch::Receiver<ElectionState>,
    pub seen: Arc<Mutex<Vec<(Instant, Seen)>>>,
}

impl Replica {
    pub fn start(server: &ApiServer, config: ElectionConfig) -> Self {
        Self::start_with(server, config, None::<haptic_election::TokioClock>)
    }

    pub fn start_with(
        server: &ApiServer,
        config: ElectionConfig,
        clock: Option<impl Clock>,
    ) -> Self {
        let name = config.identity.clone();
        let client = server.client_for(&name).expect("client");
        let mut elector = LeaderElector::new(client, config).expect("valid config");
        if let Some(clock) = clock {
            elector = elector.with_clock(clock);
        }
        let state = elector.state();
        let seen: Arc<Mutex<Vec<(Instant, Seen)>>> = Arc::default();
        let (s1, s2, s3) = (seen.clone(), seen.clone(), seen.clone());
        let callbacks = Callbacks::new()
            .on_started_leading(move |term| {
                let seen = s1.clone();
                async move {
                    seen.lock()
                        .expect("lock")
                        .push((Instant::now(), Seen::Started));
                    term.cancelled().await;
                    seen.lock()
                        .expect("lock")
                        .push((Instant::now(), Seen::WorkEnded));
                }
            })
            .on_stopped_leading(move |reason| {
                s2.lock()
                    .expect("lock")
                    .push((Instant::now(), Seen::Stopped(reason)))
            })
            .on_new_leader(move |who, is_self| {
                s3.lock()
                    .expect("lock")
                    .push((Instant::now(), Seen::NewLeader(who.to_owned(), is_self)))
            });
        let token = CancellationToken::new();
        let handle = tokio::spawn(elector.run(token.clone(), callbacks));
        Self {
            name,
            token,
            handle,
            state,
            seen,
        }
    }

    pub fn is_leader(&self) -> bool {
        self.state.borrow().is_leader
    }

    pub fn seen(&self) -> Vec<(Instant, Seen)> {
        self.seen.lock().expect("lock").clone()
    }

    pub fn stops(&self) -> Vec<(Instant, StopReason)> {
        self.seen()
            .into_iter()
            .filter_map(|(at, s)| match s {
                Seen::Stopped(r) => Some((at, r)),
                _ => None,
            })
            .collect()
    }

    pub fn starts(&self) -> Vec<Instant> {
        self.seen()
            .into_iter()
            .filter_map(|(at, s)| (s == Seen::Started).then_some(at))
            .collect()
    }

    /// Awaits a state, bounded by `within` of (virtual) time.
    pub async fn wait_for(&self, within: Duration, what: &str, f: impl Fn(&ElectionState) -> bool) {
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

    pub async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("elector stops")
            .expect("no panic");
    }
}

pub async fn lease(server: &ApiServer) -> Option<Lease> {
    let api: Api<Lease> = Api::namespaced(server.client_for("observer").expect("client"), NS);
    api.get_opt(LEASE).await.expect("read lease")
}

pub async fn holder(server: &ApiServer) -> Option<String> {
    lease(server)
        .await
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

/// Awaits until exactly one replica leads; returns its index.
pub async fn one_leader(replicas: &[Replica], within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let leaders: Vec<usize> = (0..replicas.len())
            .filter(|i| replicas[*i].is_leader())
            .collect();
        if leaders.len() == 1 {
            return leaders[0];
        }
        assert!(
            Instant::now() < deadline,
            "no single leader within {within:?}: {leaders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts one replica per identity, with the test durations.
pub fn start_all(server: &ApiServer, identities: &[&str]) -> Vec<Replica> {
    identities
        .iter()
        .map(|id| Replica::start(server, config(id)))
        .collect()
}

/// Starts two replicas and waits until one leads; returns (leader, follower).
pub async fn elected_pair(
    server: &ApiServer,
    a: ElectionConfig,
    b: ElectionConfig,
) -> (Replica, Replica) {
    let mut replicas = vec![Replica::start(server, a), Replica::start(server, b)];
    let l = one_leader(&replicas, Duration::from_secs(10)).await;
    let leader = replicas.remove(l);
    let follower = replicas.remove(0);
    (leader, follower)
}

/// Stops every replica (each bounded).
pub async fn stop_all(replicas: Vec<Replica>) {
    for r in replicas {
        r.stop().await;
    }
}
