//! The reconciler: turns store changes into render triggers, leading edge with a coalescing
//! window that never resets.
//!
//! The first change after a quiet spell triggers at once; changes during the following window
//! are coalesced into one trigger at its end, and so on while changes keep coming. The window
//! is not extended by further changes, so a change waits at most one window for its trigger,
//! however busy the cluster. Default [`DEFAULT_WINDOW`] = 150 ms: a render at 10k Ingresses
//! takes 30-60 ms, so a burst (a rollout touching many EndpointSlices) costs a few renders a
//! second at most, while a lone change is not delayed at all (HAPTIC waits a 5 s refractory
//! period). `BecameLeader` triggers at once, so a new leader renders and deploys immediately.

use std::time::Duration;

use haptic_eventbus::{EventBus, Filter};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::events::{ControllerEvent, Kind};

/// The default coalescing window.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(150);

/// The component: subscribe now, run the returned future.
pub fn component(
    window: Duration,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = bus.subscribe(
        "reconciler",
        Filter::kinds([Kind::StoresChanged, Kind::BecameLeader]),
    );
    async move {
        // End of the current window; none while idle.
        let mut window_end: Option<Instant> = None;
        // When the first change not yet covered by a trigger was seen.
        let mut dirty: Option<std::time::Instant> = None;
        loop {
            let sleep = async {
                match window_end {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = token.cancelled() => return,
                () = sleep => {
                    if let Some(since) = dirty.take() {
                        bus.publish(ControllerEvent::RenderTrigger { reason: "change", since: Some(since) });
                        window_end = Some(Instant::now() + window);
                    } else {
                        window_end = None;
                    }
                }
                event = events.recv() => {
                    let Some(event) = event else { return };
                    if matches!(&*event, ControllerEvent::BecameLeader(_)) {
                        bus.publish(ControllerEvent::RenderTrigger { reason: "became_leader", since: None });
                        continue;
                    }
                    if window_end.is_some() {
                        dirty.get_or_insert_with(std::time::Instant::now);
                    } else {
                        bus.publish(ControllerEvent::RenderTrigger { reason: "change", since: Some(std::time::Instant::now()) });
                        window_end = Some(Instant::now() + window);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use haptic_eventbus::Config;

    fn bus() -> EventBus<ControllerEvent> {
        EventBus::with_config(Config::default())
    }

    #[tokio::test(start_paused = true)]
    async fn leading_edge_then_one_trigger_per_window_that_never_resets() {
        let bus = bus();
        let mut triggers = bus.subscribe("test", Filter::kind(Kind::RenderTrigger));
        let token = CancellationToken::new();
        let task = tokio::spawn(component(
            Duration::from_millis(100),
            bus.clone(),
            token.clone(),
        ));
        bus.start();
        let start = Instant::now();
        let change = || bus.publish(ControllerEvent::StoresChanged { store: "s".into() });
        // Trigger times are taken as they arrive.
        let collector = tokio::spawn(async move {
            let mut at = Vec::new();
            while let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(250), triggers.recv()).await
            {
                at.push(start.elapsed().as_millis());
            }
            at
        });
        change();
        // A change every 30 ms until 270 ms: the window is not pushed back by them.
        for _ in 0..9 {
            tokio::time::sleep(Duration::from_millis(30)).await;
            change();
        }
        let at = collector.await.expect("collector");
        assert_eq!(
            at,
            [0, 100, 200, 300],
            "at once, then one trigger at the end of each window"
        );
        token.cancel();
        task.await.expect("reconciler stops");
    }
}
