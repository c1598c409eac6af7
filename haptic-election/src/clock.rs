//! The local monotonic clock the elector judges expiry with, injectable to test clock skew.

use std::{fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::time::Instant;

/// A monotonic clock. Expiry is judged only with it: the time this replica last saw the Lease
/// change, plus the Lease's `leaseDurationSeconds`, against `now()`. The remote `renewTime` is
/// never compared with a local wall clock.
pub trait Clock: Send + Sync + 'static {
    /// The current instant on this clock.
    fn now(&self) -> Instant;
    /// Waits until this clock has advanced by `duration`.
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// tokio's clock (so paused-time tests drive it).
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// A clock that runs `rate` times as fast as tokio's (rate 1.4: 14 s pass on it while 10 s
/// pass on tokio's). For testing skew tolerance.
#[derive(Debug, Clone, Copy)]
pub struct SkewedClock {
    origin: Instant,
    rate: f64,
}

impl SkewedClock {
    /// A clock running at `rate` x tokio's speed from now on. `rate` must be positive.
    pub fn new(rate: f64) -> Self {
        let rate = if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            1.0
        };
        Self {
            origin: Instant::now(),
            rate,
        }
    }
}

impl Clock for SkewedClock {
    fn now(&self) -> Instant {
        let real = Instant::now().saturating_duration_since(self.origin);
        self.origin + real.mul_f64(self.rate)
    }

    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(tokio::time::sleep(duration.div_f64(self.rate)))
    }
}

/// A shared clock handle.
#[derive(Clone)]
pub(crate) struct SharedClock(pub(crate) Arc<dyn Clock>);

impl fmt::Debug for SharedClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedClock")
    }
}
