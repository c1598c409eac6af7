//! A child task with its own token: owned by the component that started it, stopped and
//! awaited (bounded) by it, aborted if it is dropped.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

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
