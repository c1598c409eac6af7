//! CPU work nobody waits for, on a thread of its own at a lower CPU priority.
//!
//! The leader's latency-bound work (watch events, renders, deltas to the agents) and work that
//! only follows it (the published config objects, the render gate's scratch copy for a check
//! that runs at background priority) share its cores; the second kind runs here, 10 nicer
//! than the controller ([`NICENESS`]), on a thread started for it and ended with it: a thread
//! of tokio's blocking pool, once made nicer, could not be made as urgent again (an
//! unprivileged process cannot lower a niceness) and would run later blocking work nicer too.

/// How much nicer than the controller the work runs (Linux threads have their own niceness).
pub const NICENESS: i32 = 10;

/// The background work panicked (its message went to the panic hook, as every panic's does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("background work panicked")]
pub struct Panicked;

/// Runs `work` on a new thread named `name`, [`NICENESS`] nicer than the caller's, and
/// returns its result. The thread ends with the work: dropping the future leaves it to
/// finish and its result unread. A thread that cannot be made nicer runs the work as it is;
/// one that cannot be started gives [`Panicked`] (after a warning).
pub async fn run<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Panicked> {
    let (done, result) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            lower_this_thread();
            let _unread = done.send(work());
        });
    if let Err(error) = started {
        tracing::warn!(%error, thread = name, "could not start a background thread");
        return Err(Panicked);
    }
    result.await.map_err(|_| Panicked)
}

/// Makes the calling thread [`NICENESS`] nicer (at most 19).
fn lower_this_thread() {
    #[cfg(target_os = "linux")]
    {
        let thread = rustix::thread::gettid();
        let lowered = rustix::process::getpriority_process(Some(thread)).and_then(|own| {
            rustix::process::setpriority_process(Some(thread), (own + NICENESS).min(19))
        });
        if let Err(error) = lowered {
            tracing::debug!(%error, "could not lower a background thread's priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_nicer_than_its_caller_and_a_panic_is_an_error() {
        let niceness = || {
            rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("niceness")
        };
        let own = niceness();
        let theirs = run("test-background", niceness).await.expect("ran");
        assert_eq!(theirs, (own + NICENESS).min(19));
        assert_eq!(niceness(), own, "the caller's thread is left as it was");
        let panicked = run("test-background", || -> u8 { panic!("on purpose") }).await;
        assert_eq!(panicked, Err(Panicked));
    }
}
