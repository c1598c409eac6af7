//! The status applier (leader only): writes the status that templates declare for watched
//! objects (`set_status(object=, field=, value=)`, [`haptic_render::requests`]) by
//! server-side apply of the object's `status` subresource, field manager [`FIELD_MANAGER`].
//!
//! A field is written only when the object in the store (the cluster as the watch last showed
//! it) does not already hold the declared value, and not again once written: unchanged status
//! is never rewritten, and a new leader, whose first render happens on `BecameLeader`, writes
//! at once whatever its predecessor had not. Followers do not render (a render of 10,000
//! Ingresses costs seconds of CPU), so instead of keeping patches computed by every replica,
//! the new leader compares with the cluster itself. A write that fails is retried with
//! backoff; only a leader whose Lease is fresh writes.

use std::{collections::HashMap, sync::Arc, time::Duration};

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use haptic_render::StatusRequest;
use kube::{
    Client,
    api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::{
    events::{ControllerEvent, Kind},
    state::StateCache,
};

/// The field manager of every status the templates declare.
pub const FIELD_MANAGER: &str = "haptic";

/// A retry of failed writes waits this long at first, doubling up to [`BACKOFF_MAX`].
const BACKOFF_INITIAL: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// One declared field: (apiVersion, kind, namespace, name, field).
type Key = (String, String, Option<String>, String, String);

fn key(request: &StatusRequest) -> Key {
    (
        request.api_version.clone(),
        request.kind.clone(),
        request.namespace.clone(),
        request.name.clone(),
        request.field.clone(),
    )
}

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    cache: Arc<StateCache>,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx
        .bus()
        .subscribe_leader_only("status-applier", Filter::kinds([Kind::Rendered]));
    async move {
        // What this term wrote (or found already there), by field.
        let mut written: HashMap<Key, Arc<serde_json::Value>> = HashMap::new();
        let mut declared: Vec<Arc<StatusRequest>> = Vec::new();
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut backoff = BACKOFF_INITIAL;
        loop {
            let retry = crate::tasks::until(retry_at);
            tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    if let ControllerEvent::Rendered(set) = &*event {
                        declared.clone_from(&set.requests.statuses);
                    }
                }
                () = retry => {}
            }
            retry_at = None;
            let pending = pending(&cache, &declared, &mut written).await;
            if pending.is_empty() {
                continue;
            }
            let mut by_object: HashMap<ObjectKey<'_>, Vec<&StatusRequest>> = HashMap::new();
            for request in &declared {
                by_object.entry(object(request)).or_default().push(request);
            }
            let mut failed = 0usize;
            for (request, ar) in pending_objects(pending) {
                if !ctx.lease_is_fresh() {
                    debug!("not writing template status: this replica's Lease is not fresh");
                    failed += 1;
                    break;
                }
                let api: Api<DynamicObject> = match &request.namespace {
                    Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
                    None => Api::all_with(client.clone(), &ar),
                };
                // Every field the templates declare for this object, in one apply: a
                // server-side apply removes the fields its manager owned and left out, so a
                // patch of one field would drop the others (a Gateway's `conditions` reverting
                // to the CRD's defaults when its `listeners` are written).
                let fields: &[&StatusRequest] =
                    by_object.get(&object(&request)).map_or(&[], Vec::as_slice);
                let mut status = serde_json::Map::new();
                for field in fields {
                    status.insert(field.field.clone(), (*field.value).clone());
                }
                let patch = json!({
                    "apiVersion": request.api_version,
                    "kind": request.kind,
                    "status": status,
                });
                let params = PatchParams::apply(FIELD_MANAGER).force();
                let patch = Patch::Apply(&patch);
                let write = api.patch_status(&request.name, &params, &patch);
                let result = tokio::select! {
                    () = ctx.token().cancelled() => return,
                    result = tokio::time::timeout(Duration::from_secs(10), write) => result,
                };
                match result {
                    Ok(Ok(_)) => {
                        let names: Vec<&str> = fields.iter().map(|f| f.field.as_str()).collect();
                        info!(kind = %request.kind, namespace = ?request.namespace, name = %request.name, fields = ?names, "template status written");
                        for field in fields {
                            written.insert(key(field), field.value.clone());
                        }
                    }
                    Ok(Err(kube::Error::Api(status))) if status.code == 404 => {
                        // Gone since the render: the next render no longer declares it.
                        debug!(name = %request.name, "the object of a template status is gone");
                    }
                    Ok(Err(error)) => {
                        warn!(%error, kind = %request.kind, name = %request.name, "writing template status failed; retrying");
                        failed += 1;
                    }
                    Err(_) => {
                        warn!(kind = %request.kind, name = %request.name, "writing template status timed out; retrying");
                        failed += 1;
                    }
                }
            }
            if failed > 0 {
                retry_at = Some(tokio::time::Instant::now() + backoff);
                backoff = (backoff * 2).min(BACKOFF_MAX);
            } else {
                backoff = BACKOFF_INITIAL;
            }
        }
    }
}

/// One object: (apiVersion, kind, namespace, name).
type ObjectKey<'a> = (&'a str, &'a str, Option<&'a str>, &'a str);

fn object(request: &StatusRequest) -> ObjectKey<'_> {
    (
        &request.api_version,
        &request.kind,
        request.namespace.as_deref(),
        &request.name,
    )
}

/// The pending fields, one (the first) per object: each object is written once, with all of
/// its declared fields.
fn pending_objects(
    pending: Vec<(Arc<StatusRequest>, ApiResource)>,
) -> Vec<(Arc<StatusRequest>, ApiResource)> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (request, ar) in pending {
        let first = seen.insert((
            request.api_version.clone(),
            request.kind.clone(),
            request.namespace.clone(),
            request.name.clone(),
        ));
        if first {
            out.push((request, ar));
        }
    }
    out
}

/// The declared fields that neither the store nor this term's writes already hold, each with
/// the API resource to write it through. Fields already in place are recorded as written.
async fn pending(
    cache: &StateCache,
    declared: &[Arc<StatusRequest>],
    written: &mut HashMap<Key, Arc<serde_json::Value>>,
) -> Vec<(Arc<StatusRequest>, ApiResource)> {
    let state = cache.read().await;
    let Some(config) = state.config.as_ref() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for request in declared {
        let k = key(request);
        if written.get(&k) == Some(&request.value) {
            continue;
        }
        let namespace = request.namespace.as_deref().unwrap_or("");
        // The store that holds this object: same group/version, same kind.
        let found = config.stores.iter().find_map(|watched| {
            let api_version = if watched.group.is_empty() {
                watched.version.clone()
            } else {
                format!("{}/{}", watched.group, watched.version)
            };
            if api_version != request.api_version {
                return None;
            }
            let store = state.stores.get(&watched.name)?;
            let kind = store.value_at(namespace, &request.name, "kind")?;
            (kind.as_str() == Some(request.kind.as_str())).then(|| {
                let current = store.value_at(
                    namespace,
                    &request.name,
                    &format!("status.{}", request.field),
                );
                let gvk = GroupVersionKind::gvk(&watched.group, &watched.version, &request.kind);
                (
                    current,
                    ApiResource::from_gvk_with_plural(&gvk, &watched.plural),
                )
            })
        });
        let Some((current, ar)) = found else {
            debug!(kind = %request.kind, name = %request.name, "a template declared status for an object no store holds");
            continue;
        };
        if current.as_ref() == Some(&*request.value) {
            written.insert(k, request.value.clone());
            continue;
        }
        out.push((Arc::clone(request), ar));
    }
    out
}
