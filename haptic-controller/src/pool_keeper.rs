//! The backend pool's reserve (leader only): the size of the pool of spare backends
//! ([`haptic_render::pool`]), kept in a ConfigMap so that every replica and a new leader size
//! the pool alike, grown ahead of need while the cluster is quiet.
//!
//! A pool sized by the Services alone grows when they cross a step: HAProxy 2.6 adds no
//! backend at run time, so that growth is a reload on the crossing change's path (~10 s at
//! 10,000 Services, the change waiting for it). So the templates size the pool by a reserve
//! (`backend_pool(..., reserve_from=<store>, reserve_at=<namespace>/<name>)`, the reference's
//! `extraContext.haproxy.backend_pool_reserve`) read from `data.size` of a ConfigMap, and tell
//! the controller the pool's state with each render ([`haptic_render::PoolState`]). When the
//! rendered sets pause ([`PAUSE`]) and the reserve read is not the one the pool should have
//! (the spares below three tenths of the backends, or half again more than
//! [`haptic_render::pool::ahead`]), the leader writes it: one reload, while nothing else
//! changes, and a burst of new Services (two fifths of those there) then takes spares the
//! running HAProxy has. A reserve the Services outgrow before the next pause is not honoured,
//! and the pool grows by steps again (a reload each, as without a reserve).
//!
//! The ConfigMap (`data.size`, label [`LABEL`]`: "true"`) is written by server-side apply
//! (field manager [`FIELD_MANAGER`]) only by a leader whose Lease is fresh, once per wanted
//! value and term; a failed write is retried with backoff. It is the controller's state, not
//! an input users write: a value edited by hand is honoured while it is sane
//! ([`haptic_render::pool::honoured`]) and replaced in the next pause if it is not what the
//! pool should have; deleting it makes the pool the Services' size again (a reload), and the
//! leader writes it again in the next pause. The leader writes its config's
//! `<namespace>/<name>` on it ([`OWNER_ANNOTATION`]) and leaves a ConfigMap that another config
//! keeps alone, with a warning naming both and the field to change.

use std::time::Duration;

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use haptic_render::PoolState;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Client,
    api::{Api, Patch, PatchParams},
};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::events::{ControllerEvent, Kind};

/// The label the reserve's ConfigMap carries (value `true`): the reference's `backend_pool`
/// store watches only ConfigMaps so labelled, in the controller's namespace.
pub const LABEL: &str = "haproxy-haptic.org/backend-pool";
/// The reference config's ConfigMap name (`extraContext.haproxy.backend_pool_reserve`:
/// `<namespace>/haptic-backend-pool`).
pub const DEFAULT_NAME: &str = "haptic-backend-pool";
/// The field manager of the writes.
pub const FIELD_MANAGER: &str = "haptic-backend-pool";
/// The annotation naming the HAProxyTemplateConfig (`<namespace>/<name>`) whose controller
/// keeps the ConfigMap. Two configs whose `backend_pool_reserve` names the same ConfigMap
/// (two controllers in one namespace, the second deployed from a copy of the first's config)
/// would otherwise overwrite each other's reserve in every pause, each write a reload of the
/// other's fleet: the keeper leaves a ConfigMap another config keeps alone, and says so.
pub const OWNER_ANNOTATION: &str = "haproxy-haptic.org/backend-pool-owner";

/// The config keeping `configmap`, when it is not `owner`: a ConfigMap with no owner (written
/// by hand, or by a controller older than the annotation) is anyone's to keep.
pub fn kept_by_another<'a>(configmap: &'a ConfigMap, owner: &str) -> Option<&'a str> {
    configmap
        .metadata
        .annotations
        .as_ref()?
        .get(OWNER_ANNOTATION)
        .map(String::as_str)
        .filter(|other| *other != owner)
}

/// How long the rendered sets must pause before the reserve is written: a growth is a reload
/// (seconds at 10,000 Services), not to be made in the middle of a stream of changes.
pub const PAUSE: Duration = Duration::from_secs(3);

/// What the keeper writes, if anything, for the pool's `state`: the wanted reserve when the
/// render read another (or none) and this term has not written it already.
pub fn to_write(state: &PoolState, written: Option<(&str, usize)>) -> Option<usize> {
    let wanted = state.wanted;
    if wanted == 0 || state.reserve == Some(wanted) {
        return None;
    }
    if written == Some((state.at.as_str(), wanted)) {
        return None;
    }
    Some(wanted)
}

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    owner: String,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx
        .bus()
        .subscribe_leader_only("pool-keeper", Filter::kinds([Kind::Deployable]));
    async move {
        // The newest pool state, and when its set came.
        let mut latest: Option<(PoolState, tokio::time::Instant)> = None;
        // What this term wrote (where, and the value).
        let mut written: Option<(String, usize)> = None;
        let mut backoff = Duration::from_millis(500);
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let due = match (&latest, retry_at) {
                (Some((_, at)), retry) => Some(retry.unwrap_or(*at + PAUSE).max(*at + PAUSE)),
                (None, _) => None,
            };
            tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    if let ControllerEvent::Deployable(set) = &*event {
                        match &set.requests.pool {
                            Some(state) => {
                                latest = Some((state.clone(), tokio::time::Instant::now()));
                            }
                            None => latest = None,
                        }
                    }
                    continue;
                }
                () = crate::tasks::until(due) => {}
            }
            let Some((state, _)) = latest.take() else {
                continue;
            };
            let Some(size) = to_write(
                &state,
                written.as_ref().map(|(at, size)| (at.as_str(), *size)),
            ) else {
                retry_at = None;
                continue;
            };
            let Some((namespace, name)) = state.at.split_once('/') else {
                warn!(at = %state.at, "the backend pool's reserve_at is not <namespace>/<name>; not kept");
                written = Some((state.at.clone(), size));
                continue;
            };
            if !ctx.lease_is_fresh() {
                debug!("not keeping the backend pool's reserve: this replica's Lease is not fresh");
                retry_at = Some(tokio::time::Instant::now() + backoff);
                latest = Some((state, tokio::time::Instant::now()));
                continue;
            }
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
            let object = json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": {LABEL: "true"},
                    "annotations": {OWNER_ANNOTATION: owner}},
                "data": {"size": size.to_string()},
            });
            let (params, patch) = (
                PatchParams::apply(FIELD_MANAGER).force(),
                Patch::Apply(&object),
            );
            let write = async {
                if let Some(other) = api.get_opt(name).await?
                    && let Some(other) = kept_by_another(&other, &owner)
                {
                    return Ok(Some(other.to_owned()));
                }
                api.patch(name, &params, &patch).await.map(|_| None)
            };
            let result = tokio::select! {
                () = ctx.token().cancelled() => return,
                result = tokio::time::timeout(Duration::from_secs(10), write) => result,
            };
            match result {
                Ok(Ok(Some(other))) => {
                    warn!(
                        configmap = %state.at, kept_by = %other, config = %owner, reserve = size,
                        "the backend pool's reserve is kept by another HAProxyTemplateConfig; not written (give this config's extraContext.haproxy.backend_pool_reserve a ConfigMap of its own)"
                    );
                    // Not again for this value: said once, the pool sized by what is there.
                    written = Some((state.at.clone(), size));
                    backoff = Duration::from_millis(500);
                    retry_at = None;
                }
                Ok(Ok(None)) => {
                    info!(
                        configmap = %state.at, used = state.used, size = state.size,
                        was = ?state.reserve, reserve = size,
                        "the rendered sets paused: the backend pool's reserve set (a reload if the pool's size changes)"
                    );
                    written = Some((state.at.clone(), size));
                    backoff = Duration::from_millis(500);
                    retry_at = None;
                }
                Ok(Err(error)) => {
                    warn!(%error, configmap = %state.at, retry_in = ?backoff, "writing the backend pool's reserve failed");
                    retry_at = Some(tokio::time::Instant::now() + backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                    latest = Some((state, tokio::time::Instant::now()));
                }
                Err(_) => {
                    warn!(configmap = %state.at, retry_in = ?backoff, "writing the backend pool's reserve timed out");
                    retry_at = Some(tokio::time::Instant::now() + backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                    latest = Some((state, tokio::time::Instant::now()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(used: usize, size: usize, reserve: Option<usize>, wanted: usize) -> PoolState {
        PoolState {
            at: "haptic-system/haptic-backend-pool".into(),
            used,
            size,
            reserve,
            wanted,
        }
    }

    #[test]
    fn a_configmap_another_config_keeps_is_left_alone() {
        let configmap = |owner: Option<&str>| {
            let mut configmap = ConfigMap::default();
            if let Some(owner) = owner {
                configmap.metadata.annotations =
                    Some([(OWNER_ANNOTATION.to_owned(), owner.to_owned())].into());
            }
            configmap
        };
        let ours = "haptic-system/haptic-config";
        assert_eq!(kept_by_another(&configmap(None), ours), None);
        assert_eq!(kept_by_another(&configmap(Some(ours)), ours), None);
        assert_eq!(
            kept_by_another(&configmap(Some("haptic-system/internal")), ours),
            Some("haptic-system/internal")
        );
    }

    #[test]
    fn the_wanted_reserve_is_written_once_a_term_when_the_render_read_another() {
        // No reserve yet: written.
        assert_eq!(to_write(&state(10, 32, None, 64), None), Some(64));
        // The render read it: nothing to write.
        assert_eq!(to_write(&state(10, 64, Some(64), 64), None), None);
        // Another value (typed by hand): replaced.
        assert_eq!(to_write(&state(10, 64, Some(9), 64), None), Some(64));
        // Written this term, the render not reading it (a template that does not watch the
        // ConfigMap): not written again and again.
        let at = "haptic-system/haptic-backend-pool";
        assert_eq!(to_write(&state(10, 32, None, 64), Some((at, 64))), None);
        // A new wanted value is written.
        assert_eq!(to_write(&state(50, 32, None, 96), Some((at, 64))), Some(96));
        // No pool: nothing.
        assert_eq!(to_write(&state(0, 0, None, 0), None), None);
    }
}
