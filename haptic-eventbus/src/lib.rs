//! A typed, in-process async event bus, generic over the application's own event type.
//!
//! - [`EventBus<E>`](EventBus) carries any `E: `[`Event`]; subscriptions select events by
//!   [`Event::Kind`] through a [`Filter`], and receive them as `Arc<E>` (one allocation per
//!   publish, whatever the number of subscribers).
//! - Before [`start`](EventBus::start), and again after [`pause`](EventBus::pause), published
//!   events wait in a bounded buffer; `start` delivers them in order. This is what lets the
//!   components built on `BecameLeader` receive the very event that woke them.
//! - [`publish`](EventBus::publish) never blocks and never awaits. A subscription is reliable
//!   (never loses an event; its high-water mark is reported) or lossy (bounded; drops counted).
//! - Kinds can be sticky ([`Config::sticky_kinds`]): a new subscriber receives their latest
//!   event at once.
//! - [`request`](EventBus::request) publishes a request and gathers the answers
//!   ([`Event::response_to`]) with expected responders, a minimum and a timeout.
//!
//! No Kubernetes here: `haptic-leadership` wires leader election to a bus of this crate.
//!
//! # Example: the leadership contract
//!
//! ```
//! use haptic_eventbus::{Event, EventBus, Filter};
//!
//! #[derive(Debug, PartialEq)]
//! enum AppEvent {
//!     PodsChanged(usize),
//!     BecameLeader { epoch: u64 },
//! }
//!
//! #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
//! enum Kind {
//!     PodsChanged,
//!     BecameLeader,
//! }
//!
//! impl Event for AppEvent {
//!     type Kind = Kind;
//!     fn kind(&self) -> Kind {
//!         match self {
//!             AppEvent::PodsChanged(_) => Kind::PodsChanged,
//!             AppEvent::BecameLeader { .. } => Kind::BecameLeader,
//!         }
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let bus = EventBus::<AppEvent>::new();
//! // All-replica components subscribe before the bus starts.
//! let mut watcher = bus.subscribe("watcher", Filter::kind(Kind::PodsChanged));
//! bus.publish(AppEvent::PodsChanged(3)); // buffered until start
//! bus.start();
//! assert_eq!(*watcher.recv().await.unwrap(), AppEvent::PodsChanged(3));
//!
//! // On acquiring the Lease: pause, publish, build the leader-only components, start.
//! bus.pause();
//! bus.publish(AppEvent::BecameLeader { epoch: 7 });
//! let mut deployer = bus.subscribe_leader_only("deployer", Filter::all());
//! bus.start();
//! assert_eq!(*deployer.recv().await.unwrap(), AppEvent::BecameLeader { epoch: 7 });
//! assert!(deployer.try_recv().is_none()); // exactly once
//! # }
//! ```

mod bus;
mod event;
pub mod request;
mod subscription;

pub use bus::{BusStats, Config, EventBus, Outcome};
pub use event::{Event, Filter, ResponseTo};
pub use request::{Gathered, RequestId, RequestParams, Response};
pub use subscription::{Delivery, SubscribeParams, Subscription, SubscriptionStats};
