//! A child task with its own token: owned by the component that started it, stopped and
//! awaited (bounded) by it, aborted if it is dropped.

use std::time::Duration;

use haptic_eventbus::Subscription;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::{config::ValidatedConfig, events::ControllerEvent};

/// How long a component waits for a child task to return after cancelling it.
pub(crate) const CHILD_STOP: Duration = Duration::from_secs(2);

/// A spawned task and the token that stops it.
pub(crate) struct Child {
    token: CancellationToken,
    handle: Option<JoinHandle<()>>,
}

impl Child {
    /// Spawns `make(token)` with a child token of `parent`.
    pub(crate) fn spawn<F, Fut>(parent: &CancellationToken, make: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let token = parent.child_token();
        let handle = tokio::spawn(make(token.clone()));
        Self {
            token,
            handle: Some(handle),
        }
    }

    /// Cancels the task and waits for it, at most [`CHILD_STOP`] (then aborts it).
    pub(crate) async fn stop(mut self) {
        self.token.cancel();
        if let Some(handle) = self.handle.take() {
            let abort = handle.abort_handle();
            if tokio::time::timeout(CHILD_STOP, handle).await.is_err() {
                warn!("a child task did not stop in time; aborting it");
                abort.abort();
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.token.cancel();
        if let Some(handle) = &self.handle {
            handle.abort();
        }
    }
}

/// Runs one child task for the part of the running config it depends on (`key`), started
/// afresh by `start`, the old one stopped first, whenever that part changes; until `token`
/// fires or `configs` (a `ConfigValidated` subscription) closes.
pub(crate) async fn follow_config<K, F, Fut>(
    mut configs: Subscription<ControllerEvent>,
    token: CancellationToken,
    key: impl Fn(&ValidatedConfig) -> K,
    mut start: F,
) where
    K: PartialEq,
    F: FnMut(&K, CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut current: Option<(K, Child)> = None;
    loop {
        let event = tokio::select! {
            () = token.cancelled() => break,
            event = configs.recv() => event,
        };
        let Some(event) = event else { break };
        let ControllerEvent::ConfigValidated(config) = &*event else {
            continue;
        };
        let wanted = key(config);
        if current.as_ref().is_some_and(|(k, _)| *k == wanted) {
            continue;
        }
        if let Some((_, old)) = current.take() {
            old.stop().await;
        }
        let child = Child::spawn(&token, |t| start(&wanted, t));
        current = Some((wanted, child));
    }
    if let Some((_, old)) = current {
        old.stop().await;
    }
}

/// Sleeps until `at`, or forever when there is none: the timer arm of a `select!` loop.
pub(crate) async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
