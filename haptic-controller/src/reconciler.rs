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
//!
//! The window is an upper bound: once the render a trigger started is done (`Rendered`), the
//! next trigger may come at once, while the renders of the last [`BUDGET_PERIOD`] took at most
//! half of it ([`RENDER_SHARE`]); past that, as soon as the cluster has had as long again as
//! that render took ([`REST_FACTOR`]). So a change that comes just after another (HAPTIC's
//! benchmark creates an Ingress just after its Service; `kubectl apply` of a manifest) waits
//! for the render in progress only, not for a rest or a whole window, and in a long burst
//! renders take at most about half of one core: at 10,000 Ingresses a 40 ms render then ends
//! the window 80 ms after its trigger, not 150; at 1,000 (4 ms), 8 ms after it. A replica that
//! does not render (a follower) keeps the whole window.

use std::time::Duration;

use haptic_eventbus::{EventBus, Filter};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::events::{ControllerEvent, Kind};

/// The default coalescing window.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(150);

/// After a render, once the renders of the last [`BUDGET_PERIOD`] took more than
/// [`RENDER_SHARE`] of it, the window lasts until the render's time times this has passed
/// again (never longer than the window itself).
pub const REST_FACTOR: u32 = 1;
/// The span over which the renders' share of time is counted.
pub const BUDGET_PERIOD: Duration = Duration::from_secs(1);
/// The share of [`BUDGET_PERIOD`] renders may take back to back (divisor: 2 is a half).
pub const RENDER_SHARE: u32 = 2;

/// The component: subscribe now, run the returned future.
pub fn component(
    window: Duration,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = bus.subscribe(
        "reconciler",
        Filter::kinds([Kind::StoresChanged, Kind::BecameLeader, Kind::Rendered]),
    );
    async move {
        // End of the current window; none while idle.
        let mut window_end: Option<Instant> = None;
        // When the last trigger was published.
        let mut triggered = Instant::now();
        // When the first change not yet covered by a trigger was seen.
        let mut dirty: Option<std::time::Instant> = None;
        // The renders that ended in the last `BUDGET_PERIOD`: when, and how long each took.
        let mut recent: std::collections::VecDeque<(Instant, Duration)> =
            std::collections::VecDeque::new();
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
                        triggered = Instant::now();
                        window_end = Some(triggered + window);
                    } else {
                        window_end = None;
                    }
                }
                event = events.recv() => {
                    let Some(event) = event else { return };
                    if let ControllerEvent::Rendered(set) = &*event {
                        let now = Instant::now();
                        recent.push_back((now, set.render_time));
                        while recent.front().is_some_and(|(at, _)| now.duration_since(*at) > BUDGET_PERIOD) {
                            recent.pop_front();
                        }
                        let spent: Duration = recent.iter().map(|(_, took)| *took).sum();
                        // A render that started after the last trigger ends its window early:
                        // at once within the budget, else after a rest as long as it took.
                        let rest = if spent <= BUDGET_PERIOD / RENDER_SHARE {
                            Duration::ZERO
                        } else {
                            set.render_time * REST_FACTOR
                        };
                        if let Some(end) = window_end
                            && now.checked_sub(set.render_time).is_some_and(|started| started >= triggered)
                        {
                            window_end = Some(end.min(now + rest));
                        }
                        continue;
                    }
                    if matches!(&*event, ControllerEvent::BecameLeader(_)) {
                        bus.publish(ControllerEvent::RenderTrigger { reason: "became_leader", since: None });
                        continue;
                    }
                    if window_end.is_some() {
                        dirty.get_or_insert_with(std::time::Instant::now);
                    } else {
                        bus.publish(ControllerEvent::RenderTrigger { reason: "change", since: Some(std::time::Instant::now()) });
                        triggered = Instant::now();
                        window_end = Some(triggered + window);
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

    fn rendered(took: u64) -> ControllerEvent {
        let files = haptic_render::FileSet::new(std::collections::BTreeMap::new());
        ControllerEvent::Rendered(std::sync::Arc::new(crate::events::RenderedSet {
            checksum: files.checksum_hex(),
            files,
            config_generation: 1,
            term: std::time::SystemTime::now(),
            span: tracing::Span::none(),
            provenance: Default::default(),
            render_time: Duration::from_millis(took),
            requests: Default::default(),
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn a_render_ends_its_window_at_once_within_the_budget() {
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
        let collector = tokio::spawn(async move {
            let mut at = Vec::new();
            while let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(300), triggers.recv()).await
            {
                at.push(start.elapsed().as_millis());
            }
            at
        });
        let change = || bus.publish(ControllerEvent::StoresChanged { store: "s".into() });
        let at = |ms: u64| tokio::time::sleep_until(start + Duration::from_millis(ms));
        // At 0 a trigger; its render (10 ms) is done at 10: the window ends then, and the
        // change at 5 is triggered at once.
        change();
        at(5).await;
        change();
        at(10).await;
        bus.publish(rendered(10));
        // That trigger's render (10 ms) is done at 30: the change at 25 is triggered then.
        at(25).await;
        change();
        at(30).await;
        bus.publish(rendered(10));
        // A render that started before the last trigger (at 30) says nothing of its window:
        // the change at 50 waits for the window's end, 130.
        at(45).await;
        bus.publish(rendered(20));
        at(50).await;
        change();
        let at = collector.await.expect("collector");
        assert_eq!(
            at,
            [0, 10, 30, 130],
            "a render ends its window; an older render does not"
        );
        token.cancel();
        task.await.expect("reconciler stops");
    }

    #[tokio::test(start_paused = true)]
    async fn past_half_a_second_of_renders_a_second_a_render_ends_its_window_after_as_long_again() {
        let bus = bus();
        let mut triggers = bus.subscribe("test", Filter::kind(Kind::RenderTrigger));
        let token = CancellationToken::new();
        let task = tokio::spawn(component(
            Duration::from_millis(1000),
            bus.clone(),
            token.clone(),
        ));
        bus.start();
        let start = Instant::now();
        let collector = tokio::spawn(async move {
            let mut at = Vec::new();
            while let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(1500), triggers.recv()).await
            {
                at.push(start.elapsed().as_millis());
            }
            at
        });
        let change = || bus.publish(ControllerEvent::StoresChanged { store: "s".into() });
        let at = |ms: u64| tokio::time::sleep_until(start + Duration::from_millis(ms));
        // Changes keep coming, each trigger's render takes 200 ms: the first two end their
        // windows at once (400 ms of renders), the third is past half a second (600 ms) and
        // ends its window 200 ms after it is done.
        change();
        at(10).await;
        change();
        at(200).await;
        bus.publish(rendered(200));
        at(210).await;
        change();
        at(400).await;
        bus.publish(rendered(200));
        at(410).await;
        change();
        at(600).await;
        bus.publish(rendered(200));
        at(610).await;
        change();
        let at = collector.await.expect("collector");
        assert_eq!(
            at,
            [0, 200, 400, 800],
            "the third render rests as long as it took"
        );
        token.cancel();
        task.await.expect("reconciler stops");
    }
}
