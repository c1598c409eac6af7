//! The state cache every replica keeps hot: the running config and the stores its watchers
//! feed, so a new leader renders at once. One lock holds both, so a render always sees stores
//! built for the config whose templates it runs.

use std::{
    collections::BTreeSet,
    sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard},
};

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

    /// Reads the state (a render holds this for its duration).
    pub fn read(&self) -> RwLockReadGuard<'_, CacheState> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Changes the state (watch events, a new config).
    pub fn write(&self) -> RwLockWriteGuard<'_, CacheState> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a render can run.
    pub fn ready(&self) -> bool {
        self.read().ready()
    }
}
