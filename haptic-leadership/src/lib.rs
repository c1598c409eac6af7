//! The adapter between leader election and the typed event bus: elector + fencing epoch ->
//! leader events, and a lifecycle for components that run only on the leader.
//!
//! [`Leadership`] runs a [`haptic_election::LeaderElector`]; on each acquisition it claims a
//! fencing epoch with [`haptic_epoch::EpochStore::bump`] (on failure it stands down), then
//! follows the bus's leadership contract: `pause` -> publish [`BecameLeader`] -> build the
//! leader-only components (they `subscribe_leader_only`) -> `start`, so they receive the very
//! event that woke them. When the term ends it publishes [`LostLeadership`], cancels the
//! leader-only components and awaits them (bounded) before the elector releases the Lease.
//! [`LeaderElectionStarted`] and [`NewLeaderObserved`] are published too; each event goes out
//! before the matching user hook runs. Metrics use HAPTIC's names ([`metrics`]).
//!
//! Every component is supervised: a panic (or a return while it should run on) is logged with
//! its message and counted (`haptic_component_failures_total`). A failed leader-only component
//! ends the term ([`COMPONENT_FAILED`]): the Lease is released, and a fresh term, on another
//! replica or on this one after a RetryPeriod, builds every leader-only component again, so no
//! replica holds the Lease while deploying nothing. A failed all-replica component cannot be
//! rebuilt: the replica gives up its term and reports unhealthy
//! ([`LeadershipMetrics::health`], for `/healthz`), and the kubelet restarts it.
//!
//! The application's event enum only needs `From` each of the four events.
//!
//! # Example
//!
//! ```
//! use haptic_election::ElectionConfig;
//! use haptic_eventbus::{Event, EventBus, Filter};
//! use haptic_leadership::{BecameLeader, LeaderElectionStarted, Leadership, LostLeadership, NewLeaderObserved};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(Debug)]
//! enum AppEvent { Started, Leader(u64), Lost(String), Observed(String) }
//! #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
//! enum Kind { Started, Leader, Lost, Observed }
//! impl Event for AppEvent {
//!     type Kind = Kind;
//!     fn kind(&self) -> Kind {
//!         match self { AppEvent::Started => Kind::Started, AppEvent::Leader(_) => Kind::Leader,
//!                      AppEvent::Lost(_) => Kind::Lost, AppEvent::Observed(_) => Kind::Observed }
//!     }
//! }
//! impl From<LeaderElectionStarted> for AppEvent { fn from(_: LeaderElectionStarted) -> Self { AppEvent::Started } }
//! impl From<BecameLeader> for AppEvent { fn from(e: BecameLeader) -> Self { AppEvent::Leader(e.epoch) } }
//! impl From<LostLeadership> for AppEvent { fn from(e: LostLeadership) -> Self { AppEvent::Lost(e.reason) } }
//! impl From<NewLeaderObserved> for AppEvent { fn from(e: NewLeaderObserved) -> Self { AppEvent::Observed(e.new_leader_identity) } }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = haptic_testkit::ApiServer::start().await?;
//! # let client = server.client_for("pod-a")?;
//! let bus = EventBus::<AppEvent>::new();
//! let (tx, rx) = tokio::sync::oneshot::channel();
//! let tx = std::sync::Mutex::new(Some(tx));
//! let leadership = Leadership::new(client, ElectionConfig::new("pod-a", "my-controller", "default"), bus)?
//!     .leader_only("deployer", move |ctx| {
//!         // Subscribe here, before the bus restarts: the first event is BecameLeader.
//!         let mut events = ctx.bus().subscribe_leader_only("deployer", Filter::kind(Kind::Leader));
//!         let tx = tx.lock().unwrap().take();
//!         async move {
//!             if let (Some(event), Some(tx)) = (events.recv().await, tx) {
//!                 let _ = tx.send(format!("{event:?}"));
//!             }
//!             ctx.token().cancelled().await;
//!         }
//!     });
//! let token = CancellationToken::new();
//! let running = tokio::spawn(leadership.run(token.clone()));
//! assert_eq!(rx.await?, "Leader(1)"); // the first term claims epoch 1
//! token.cancel();
//! running.await??;
//! # Ok(())
//! # }
//! ```

mod adapter;
mod events;
pub mod metrics;

pub use adapter::{COMPONENT_FAILED, Error, LeaderContext, Leadership, Result, STOOD_DOWN};
pub use events::{
    BecameLeader, LeaderElectionStarted, LeaderEvents, LostLeadership, NewLeaderObserved,
};
pub use metrics::LeadershipMetrics;
