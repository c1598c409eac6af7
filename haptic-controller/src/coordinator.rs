//! The coordinator (leader only): on a render trigger, renders the file set from the state
//! cache on a blocking thread and publishes it, or the render error. Triggers that arrive during
//! a render are coalesced into one more render after it.

use std::{
    sync::Arc,
    time::{Instant, SystemTime},
};

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use tracing::{Instrument as _, debug, error, info, info_span};

use crate::{
    events::{ControllerEvent, Kind, RenderFailure, RenderedSet},
    state::StateCache,
};

/// The component: subscribe now, run the returned future.
pub fn component(
    cache: Arc<StateCache>,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "coordinator",
        Filter::kinds([Kind::RenderTrigger, Kind::BecameLeader]),
    );
    async move {
        let mut term = SystemTime::now();
        let mut last_failure: Option<String> = None;
        loop {
            let event = tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => event,
            };
            let Some(event) = event else { return };
            let mut reason = match &*event {
                ControllerEvent::RenderTrigger { reason } => *reason,
                _ => "became_leader",
            };
            if let ControllerEvent::BecameLeader(became) = &*event {
                term = became.at;
            }
            // Coalesce whatever else is already queued: one render covers them all.
            let mut coalesced = 0u32;
            while let Some(more) = events.try_recv() {
                coalesced += 1;
                match &*more {
                    ControllerEvent::BecameLeader(became) => term = became.at,
                    ControllerEvent::RenderTrigger { reason: r } if reason == "change" => {
                        reason = r;
                    }
                    _ => {}
                }
            }
            // One span per reconcile chain: the gate's check and every pod's apply of this
            // render run in it (the set carries it), so its id ties their log lines together.
            let span = info_span!(
                "reconcile",
                correlation_id = %uuid::Uuid::new_v4().simple(),
                reason,
                coalesced
            );
            let cache = cache.clone();
            let rendered = tokio::task::spawn_blocking({
                let span = span.clone();
                move || span.in_scope(|| render(&cache, term, span.clone()))
            })
            .instrument(span.clone())
            .await;
            // No await follows in this iteration: the guard is dropped before the next one.
            let _entered = span.enter();
            match rendered {
                Ok(Some(Ok(set))) => {
                    last_failure = None;
                    debug!(checksum = %set.checksum, files = set.files.len(), took = ?set.render_time, "rendered");
                    ctx.bus().publish(ControllerEvent::Rendered(Arc::new(set)));
                }
                Ok(Some(Err(failure))) => {
                    if last_failure.as_deref() != Some(&failure.message) {
                        error!(message = %failure.message, "render failed; the last good config stays live");
                        last_failure = Some(failure.message.clone());
                    }
                    ctx.bus()
                        .publish(ControllerEvent::RenderFailed(Arc::new(failure)));
                }
                Ok(None) => info!(
                    "not rendering yet: waiting for the config and the first list of every store"
                ),
                Err(error) => error!(%error, "the render task panicked"),
            }
        }
    }
}

/// Renders from the cache; `None` while it is not ready.
fn render(
    cache: &StateCache,
    term: SystemTime,
    span: tracing::Span,
) -> Option<Result<RenderedSet, RenderFailure>> {
    let state = cache.blocking_read();
    if !state.ready() {
        return None;
    }
    let config = state.config.as_ref()?;
    let started = Instant::now();
    Some(match config.renderer.render_all(&state.stores) {
        Ok((files, requests)) => {
            let checksum = haptic_agent_client::protocol::checksum(files.iter());
            Ok(RenderedSet {
                files,
                checksum,
                config_generation: config.generation,
                term,
                render_time: started.elapsed(),
                requests,
                span,
            })
        }
        Err(error) => Err(RenderFailure {
            config_generation: config.generation,
            message: error.to_string(),
        }),
    })
}
