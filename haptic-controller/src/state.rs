//! The state cache every replica keeps hot: the running config and the stores its watchers
//! feed, so a new leader renders at once. One lock holds both, so a render always sees stores
//! built for the config whose templates it runs.
//!
//! The lock is tokio's (fair, and awaited): a watcher's write waits for a render in flight
//! without holding an async worker thread, and async readers queue behind it the same way, so
//! a long render (or a burst of webhook renders) never stalls the runtime that renews the
//! Lease. Renders read from blocking threads ([`StateCache::blocking_read`]).

use std::{collections::BTreeSet, sync::Arc};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use haptic_render::Stores;

use crate::config::ValidatedConfig;

/// The running config and its stores.
#[derive(Debug, Default)]
pub struct CacheState {
    /// The running config (none until the first valid one).
    pub config: Option<Arc<ValidatedConfig>>,
    /// The stores of its watched resources.
    pub stores: Stores,
    /// Stores whose first list has not finished.
    pub unsynced: BTreeSet<String>,
}

impl CacheState {
    /// A config is loaded and every store finished its first list.
    pub fn ready(&self) -> bool {
        self.config.is_some() && self.unsynced.is_empty()
    }
}

/// The shared state cache.
#[derive(Debug, Default)]
pub struct StateCache {
    inner: RwLock<CacheState>,
}

impl StateCache {
    /// An empty cache.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Reads the state from async code (briefly: no render under it).
    pub async fn read(&self) -> RwLockReadGuard<'_, CacheState> {
        self.inner.read().await
    }

    /// Reads the state from a blocking thread (a render holds this for its duration). Panics
    /// when called on an async worker thread: use [`StateCache::read`] there.
    pub fn blocking_read(&self) -> RwLockReadGuard<'_, CacheState> {
        self.inner.blocking_read()
    }

    /// Reads the state if nobody writes it now (for synchronous callbacks such as a metrics
    /// collection, which must not wait).
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, CacheState>> {
        self.inner.try_read().ok()
    }

    /// Changes the state (watch events, a new config); waits for renders in flight.
    pub async fn write(&self) -> RwLockWriteGuard<'_, CacheState> {
        self.inner.write().await
    }

    /// Whether a render can run.
    pub async fn ready(&self) -> bool {
        self.read().await.ready()
    }
}
