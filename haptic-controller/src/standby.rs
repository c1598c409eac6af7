//! The warm standby (every replica; renders only while this replica does not lead): on render
//! triggers, at most once per interval, it renders from the state cache as the coordinator
//! does and drops the result.
//!
//! Why: the render keeps what a render reuses current on this replica (the derived views in the
//! stores, the renderer's per-row fragments and per-item outputs). A replica that becomes
//! leader then renders only what changed since its last standby render, not the whole set
//! cold: at 10,000 Ingresses tens of milliseconds instead of about a second, and a graceful
//! handoff's first apply waits for that render. The price is the follower's CPU (one render
//! per interval while the cluster changes, none while it is quiet) and its memory (the views
//! and fragments the leader holds too). `--standby-render-interval-ms 0` turns it off.
//!
//! A render error is the leader's to report (it renders the same stores): here it is only
//! logged at debug level. A panic in the render is logged as an error and the standby goes on.

use std::{sync::Arc, time::Duration};

use haptic_eventbus::{EventBus, Filter, Subscription};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error};

use crate::{
    events::{ControllerEvent, Kind},
    state::StateCache,
};

/// The default interval between two standby renders.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// How a standby render ended.
#[derive(Debug)]
enum Warmed {
    /// Rendered (the set dropped), in this long.
    Rendered(Duration),
    /// The render failed; the leader reports it.
    Failed(String),
    /// Not ready: no config yet, or a store not listed.
    NotReady,
}

/// The component: subscribe now, run the returned future. `interval` None: off (the future
/// only waits for `token`).
pub fn component(
    cache: Arc<StateCache>,
    interval: Option<Duration>,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let events = interval.map(|interval| {
        let events = bus.subscribe(
            "warm-standby",
            Filter::kinds([
                Kind::RenderTrigger,
                Kind::BecameLeader,
                Kind::LostLeadership,
            ]),
        );
        (interval, events)
    });
    async move {
        match events {
            Some((interval, events)) => {
                run(interval, events, move || warm(&cache), token).await;
            }
            None => token.cancelled().await,
        }
    }
}

/// The standby's loop: `render` (on a blocking thread) at most once per `interval`, after a
/// trigger, while this replica does not lead.
async fn run<R>(
    interval: Duration,
    mut events: Subscription<ControllerEvent>,
    render: R,
    token: CancellationToken,
) where
    R: Fn() -> Warmed + Clone + Send + 'static,
{
    let mut leading = false;
    // A trigger not yet covered by a standby render.
    let mut dirty = false;
    let mut next = Instant::now();
    loop {
        let due = dirty && !leading;
        tokio::select! {
            () = token.cancelled() => return,
            event = events.recv() => {
                let Some(event) = event else { return };
                match &*event {
                    ControllerEvent::BecameLeader(_) => leading = true,
                    // The new leader's stores move on; so does this replica's standby.
                    ControllerEvent::LostLeadership(_) => {
                        leading = false;
                        dirty = true;
                    }
                    _ => dirty = true,
                }
            }
            () = tokio::time::sleep_until(next), if due => {
                dirty = false;
                let warmed = tokio::select! {
                    () = token.cancelled() => return,
                    warmed = tokio::task::spawn_blocking(render.clone()) => warmed,
                };
                next = Instant::now() + interval;
                match warmed {
                    Ok(Warmed::Rendered(took)) => {
                        crate::metrics::get().standby_render();
                        debug!(?took, "standby render");
                    }
                    Ok(Warmed::Failed(message)) => {
                        debug!(%message, "standby render failed (the leader reports it)");
                    }
                    // Tried again after the interval: the trigger that came before the
                    // stores were ready may be the last one for a while.
                    Ok(Warmed::NotReady) => {
                        dirty = true;
                        debug!("standby render: not ready yet");
                    }
                    Err(error) => error!(%error, "the standby render panicked"),
                }
            }
        }
    }
}

/// One render from the cache, its output dropped.
fn warm(cache: &StateCache) -> Warmed {
    let state = cache.blocking_read();
    let Some(config) = state.config.as_ref().filter(|_| state.ready()) else {
        return Warmed::NotReady;
    };
    let started = std::time::Instant::now();
    match config.renderer.render_traced(&state.stores) {
        Ok(_) => Warmed::Rendered(started.elapsed()),
        Err(error) => Warmed::Failed(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use haptic_eventbus::Config;
    use haptic_leadership::{BecameLeader, LostLeadership};

    use super::*;

    const INTERVAL: Duration = Duration::from_secs(1);

    /// The standby's loop on a bus of its own, rendering with a counter.
    struct Standby {
        bus: EventBus<ControllerEvent>,
        renders: Arc<AtomicUsize>,
        token: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    impl Standby {
        fn start(outcome: fn() -> Warmed) -> Self {
            let bus = EventBus::with_config(Config::default());
            let events = bus.subscribe(
                "warm-standby",
                Filter::kinds([
                    Kind::RenderTrigger,
                    Kind::BecameLeader,
                    Kind::LostLeadership,
                ]),
            );
            bus.start();
            let renders = Arc::new(AtomicUsize::new(0));
            let token = CancellationToken::new();
            let counted = renders.clone();
            let render = move || {
                counted.fetch_add(1, Ordering::SeqCst);
                outcome()
            };
            let task = tokio::spawn(run(INTERVAL, events, render, token.clone()));
            Self {
                bus,
                renders,
                token,
                task,
            }
        }

        fn trigger(&self) {
            self.bus.publish(ControllerEvent::RenderTrigger {
                reason: "change",
                since: None,
            });
        }

        /// Renders so far, after `wait` of (paused) time.
        async fn renders_after(&self, wait: Duration) -> usize {
            tokio::time::sleep(wait).await;
            self.renders.load(Ordering::SeqCst)
        }

        async fn stop(self) {
            self.token.cancel();
            self.task.await.expect("the standby stops");
        }
    }

    fn rendered() -> Warmed {
        Warmed::Rendered(Duration::from_millis(1))
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_renders_once_per_interval_while_changes_come_and_never_while_it_leads() {
        let standby = Standby::start(rendered);
        // Quiet: no render.
        assert_eq!(standby.renders_after(INTERVAL * 3).await, 0);
        // A trigger: a render at once.
        standby.trigger();
        assert_eq!(standby.renders_after(Duration::from_millis(10)).await, 1);
        // Triggers every 100 ms for 2.5 s: one render per interval, not one per trigger.
        for _ in 0..25 {
            standby.trigger();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(standby.renders_after(INTERVAL * 2).await, 4);
        // Leading: triggers render nothing here (the coordinator renders).
        standby
            .bus
            .publish(ControllerEvent::BecameLeader(BecameLeader {
                identity: "me".into(),
                epoch: 1,
                at: std::time::SystemTime::now(),
            }));
        for _ in 0..5 {
            standby.trigger();
            tokio::time::sleep(INTERVAL).await;
        }
        assert_eq!(standby.renders_after(INTERVAL * 2).await, 4);
        // The term ends: the standby renders again, at once.
        standby
            .bus
            .publish(ControllerEvent::LostLeadership(LostLeadership {
                identity: "me".into(),
                reason: "lease_taken".into(),
                at: std::time::SystemTime::now(),
            }));
        assert_eq!(standby.renders_after(Duration::from_millis(10)).await, 5);
        standby.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_not_ready_tries_again_each_interval_without_a_new_trigger() {
        let standby = Standby::start(|| Warmed::NotReady);
        standby.trigger();
        assert_eq!(standby.renders_after(Duration::from_millis(10)).await, 1);
        assert_eq!(standby.renders_after(INTERVAL * 3).await, 4);
        standby.stop().await;
    }
}
