//! Kubernetes Lease leader election, compatible with client-go's lock and faster to fail over.
//!
//! One replica holds a `coordination.k8s.io/v1` Lease and leads; the others follow. The lock is
//! client-go's (GET, POST on 404, PUT with the resourceVersion last seen; the same spec fields,
//! so `kubectl get lease -o yaml` reads as for a Go controller), and beyond it:
//!
//! - followers **watch** the Lease and try to take it the moment it is released or its
//!   observed expiry passes, instead of up to a RetryPeriod later; when the watch breaks they
//!   poll until it is back (`poll_only` keeps client-go's polling, for comparison);
//! - the leader renews from the object its last write returned, with no GET;
//! - a lost Lease **re-enters election in place** (client-go's `Run` returns for good);
//! - `keep_lease_on_stop` and [`release_lease`] let a successor on the same replica resume
//!   without a vacancy; disabled mode leads at once with no API calls;
//! - a [`HealthCheck`] fails a leader whose last renew is too old.
//!
//! # The three durations
//!
//! See [`ElectionConfig`]: LeaseDuration (30 s) is how long followers wait after they last saw
//! the Lease change; RenewDeadline (20 s) is how long a leader retries failing renews before it
//! steps down; RetryPeriod (5 s) is the renew interval. Expiry is judged on each replica's own
//! monotonic clock from when it observed the change, never by comparing `renewTime` with a
//! local wall clock; so the ratio LeaseDuration / RenewDeadline (1.5) is the clock-rate skew
//! the election tolerates.
//!
//! # Stop reasons
//!
//! [`StopReason::GracefulShutdown`]: the token fired; [`StopReason::LeaseExpired`]: no renew
//! succeeded within RenewDeadline, so the leader stepped down before anyone else could take
//! the Lease; [`StopReason::LeaseTaken`]: a renew found another holder;
//! [`StopReason::Resigned`]: the leader's own work gave the term up through a [`Resign`]
//! handle (the Lease is released and this replica waits a RetryPeriod before competing again).
//!
//! # A Lease alone is not fencing
//!
//! A leader that stalls (GC pause, partition) may still act after its Lease expired. Writes to
//! other systems need a fencing token that a successor raises: see the `haptic-epoch` crate.
//!
//! # Example
//!
//! ```
//! use haptic_election::{Callbacks, ElectionConfig, LeaderElector};
//! use tokio_util::sync::CancellationToken;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = haptic_testkit::ApiServer::start().await?;
//! # let client = server.client_for("pod-a")?;
//! // client: a kube::Client, e.g. kube::Client::try_default().await?
//! let config = ElectionConfig::new("pod-a", "my-controller", "default");
//! let elector = LeaderElector::new(client, config)?;
//! let mut state = elector.state();
//! let token = CancellationToken::new();
//! let callbacks = Callbacks::new()
//!     .on_started_leading(|term| async move {
//!         // Lead until `term` is cancelled.
//!         term.cancelled().await;
//!     })
//!     .on_stopped_leading(|reason| eprintln!("stopped leading: {reason}"));
//! let running = tokio::spawn(elector.run(token.clone(), callbacks));
//! state.wait_for(|s| s.is_leader).await?;
//! token.cancel(); // releases the Lease after the work above returned
//! running.await?;
//! # Ok(())
//! # }
//! ```

mod clock;
mod config;
mod elector;
mod lock;

pub use clock::{Clock, SkewedClock, TokioClock};
pub use config::{ConfigError, ElectionConfig, JITTER_FACTOR};
pub use elector::{
    Callbacks, ElectionState, Error, HealthCheck, LeaderElector, Resign, Result, StopReason,
    release_lease,
};
