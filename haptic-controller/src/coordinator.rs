//! The coordinator (leader only): on a render trigger, renders the file set from the state
//! cache on a blocking thread and publishes it, or the render error. Triggers that arrive during
//! a render are coalesced into one more render after it.
//!
//! Blast radius of one object: when the render gate traces a line or file HAProxy refused to
//! the object that produced it ([`ControllerEvent::Exclude`]), the coordinator leaves that
//! object out of every render (a copy of the stores without it) until the object changes or
//! goes, asks for a Warning Event `HAProxyRefused` on it with HAProxy's words, and renders
//! again at once: the rest of the set goes live. At most [`MAX_EXCLUDED`] objects are left out
//! at a time; past that, a refused set is held as before.

use std::{
    sync::Arc,
    time::{Instant, SystemTime},
};

use haptic_render::{EventRequest, ObjectRef, Stores};

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use crate::{
    events::{ControllerEvent, Kind, RenderFailure, RenderedSet},
    state::StateCache,
};

/// How many objects may be left out of renders at once for HAProxy's refusals.
pub const MAX_EXCLUDED: usize = 16;

/// An object left out of renders, as it was when HAProxy refused what it produced.
#[derive(Debug, Clone)]
struct Excluded {
    object: ObjectRef,
    /// Its `metadata.resourceVersion` then: a new version is tried again.
    version: Option<serde_json::Value>,
    reason: String,
}

fn version_of(stores: &Stores, object: &ObjectRef) -> Option<Option<serde_json::Value>> {
    let store = stores.get(&object.store)?;
    if !store.contains(&object.namespace, &object.name) {
        return None;
    }
    Some(store.value_at(&object.namespace, &object.name, "metadata.resourceVersion"))
}

/// The component: subscribe now, run the returned future.
pub fn component(
    cache: Arc<StateCache>,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "coordinator",
        Filter::kinds([Kind::RenderTrigger, Kind::BecameLeader, Kind::Exclude]),
    );
    async move {
        let mut term = SystemTime::now();
        let mut last_failure: Option<String> = None;
        let mut excluded: Vec<Excluded> = Vec::new();
        // The last set rendered: the next render hashes its set on from where it differs.
        let mut last: Option<Arc<RenderedSet>> = None;
        loop {
            let event = tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => event,
            };
            let Some(event) = event else { return };
            let mut since = None;
            let mut reason = match &*event {
                ControllerEvent::RenderTrigger { reason, since: s } => {
                    since = *s;
                    *reason
                }
                ControllerEvent::Exclude(_) => "exclude",
                _ => "became_leader",
            };
            match &*event {
                ControllerEvent::BecameLeader(became) => term = became.at,
                ControllerEvent::Exclude(exclusion) => {
                    exclude(&cache, &mut excluded, exclusion).await;
                }
                _ => {}
            }
            // Coalesce whatever else is already queued: one render covers them all.
            let mut coalesced = 0u32;
            while let Some(more) = events.try_recv() {
                coalesced += 1;
                match &*more {
                    ControllerEvent::BecameLeader(became) => term = became.at,
                    ControllerEvent::RenderTrigger {
                        reason: r,
                        since: s,
                    } => {
                        if reason == "change" {
                            reason = r;
                        }
                        since = match (since, *s) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                    }
                    ControllerEvent::Exclude(exclusion) => {
                        exclude(&cache, &mut excluded, exclusion).await;
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
            if let Some(since) = since {
                crate::metrics::get().change_to_render(since.elapsed());
            }
            let cache = cache.clone();
            let leave_out = excluded.clone();
            let previous = last.clone();
            let rendered = tokio::task::spawn_blocking({
                let span = span.clone();
                move || {
                    span.in_scope(|| {
                        let previous = previous.as_ref().map(|set| &set.files);
                        render(&cache, term, span.clone(), leave_out, previous)
                    })
                }
            })
            .instrument(span.clone())
            .await;
            let rendered = rendered.map(|r| {
                r.map(|(result, still)| {
                    excluded = still;
                    result
                })
            });
            // No await follows in this iteration: the guard is dropped before the next one.
            let _entered = span.enter();
            match rendered {
                Ok(Some(Ok(set))) => {
                    last_failure = None;
                    debug!(checksum = %set.checksum, files = set.files.len(), took = ?set.render_time, "rendered");
                    let set = Arc::new(set);
                    last = Some(Arc::clone(&set));
                    ctx.bus().publish(ControllerEvent::Rendered(set));
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

/// Adds an object HAProxy refused to the objects left out (once; at most [`MAX_EXCLUDED`]).
async fn exclude(
    cache: &StateCache,
    excluded: &mut Vec<Excluded>,
    exclusion: &crate::events::Exclusion,
) {
    if excluded.iter().any(|e| e.object == exclusion.object) {
        return;
    }
    if excluded.len() >= MAX_EXCLUDED {
        error!(object = %exclusion.object, reason = %exclusion.reason, limit = MAX_EXCLUDED, "HAProxy refused what an object produced, but as many objects as allowed are left out already: holding the set");
        return;
    }
    let Some(version) = version_of(&cache.read().await.stores, &exclusion.object) else {
        return;
    };
    warn!(object = %exclusion.object, reason = %exclusion.reason, checksum = %exclusion.checksum, "HAProxy refused what this object produced: leaving it out of the config until it changes");
    excluded.push(Excluded {
        object: exclusion.object.clone(),
        version,
        reason: exclusion.reason.clone(),
    });
}

/// A Warning Event on an object left out, from the object as the store holds it.
fn excluded_event(stores: &Stores, excluded: &Excluded) -> Option<EventRequest> {
    let object = &excluded.object;
    let store = stores.get(&object.store)?;
    let field = |path: &str| {
        store
            .value_at(&object.namespace, &object.name, path)
            .and_then(|v| v.as_str().map(str::to_owned))
    };
    Some(EventRequest {
        api_version: field("apiVersion"),
        kind: field("kind"),
        namespace: Some(object.namespace.clone()).filter(|n| !n.is_empty()),
        name: Some(object.name.clone()),
        uid: field("metadata.uid"),
        type_: "Warning".to_owned(),
        reason: "HAProxyRefused".to_owned(),
        message: format!(
            "left out of the HAProxy config until it changes: haproxy -c refused what it produced: {}",
            excluded.reason
        ),
    })
}

/// Renders from the cache, leaving out the objects in `excluded` that are still the versions
/// HAProxy refused; `None` while it is not ready. Returns with the result the objects still
/// left out (those that changed or went are tried again).
fn render(
    cache: &StateCache,
    term: SystemTime,
    span: tracing::Span,
    mut excluded: Vec<Excluded>,
    previous: Option<&haptic_render::FileSet>,
) -> Option<(Result<RenderedSet, RenderFailure>, Vec<Excluded>)> {
    let state = cache.blocking_read();
    if !state.ready() {
        return None;
    }
    let config = state.config.as_ref()?;
    let started = Instant::now();
    excluded.retain(|e| {
        let same = version_of(&state.stores, &e.object).is_some_and(|v| v == e.version);
        if !same {
            info!(object = %e.object, "an object left out for HAProxy's refusal changed or went: trying it again");
        }
        same
    });
    let copy;
    let stores = if excluded.is_empty() {
        &state.stores
    } else {
        let objects: Vec<ObjectRef> = excluded.iter().map(|e| e.object.clone()).collect();
        copy = state.stores.excluding(&objects);
        &copy
    };
    let rendered = match previous {
        Some(previous) => config.renderer.render_traced_following(stores, previous),
        None => config.renderer.render_traced(stores),
    };
    let result = match rendered {
        Ok((files, mut requests, provenance)) => {
            requests.events.extend(
                excluded
                    .iter()
                    .filter_map(|e| excluded_event(&state.stores, e)),
            );
            // The render's own checksum: the protocol's framing (a scheduler test holds them
            // equal), not 15 MB hashed again at 10,000 Ingresses.
            let checksum = files.checksum_hex();
            Ok(RenderedSet {
                files,
                checksum,
                config_generation: config.generation,
                term,
                render_time: started.elapsed(),
                requests,
                span,
                provenance,
            })
        }
        Err(error) => Err(RenderFailure {
            config_generation: config.generation,
            message: error.to_string(),
        }),
    };
    Some((result, excluded))
}
