//! Resource watchers: one kube-runtime watcher per watched resource (its `ApiResource` found
//! through discovery), feeding the haptic-render store of the same name in the state cache.
//!
//! A new config keeps the watchers (and the stores) of the resources it watches as before, and
//! stops or starts the others, with no process restart. A relist (after 410 Expired or a
//! reconnect) updates the store in place and removes, when the list is complete, what the list
//! no longer holds, so a render never sees a half-emptied store.

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use futures::StreamExt;
use haptic_eventbus::{EventBus, Filter, Subscription};
use kube::{
    Client,
    api::{Api, ApiResource, DynamicObject},
    core::GroupVersion,
    discovery,
    runtime::{WatchStreamExt, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    config::{ValidatedConfig, WatchedStore},
    events::{ControllerEvent, Kind},
    state::StateCache,
    tasks::Child,
};

/// Builds the resource watchers' component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    cache: Arc<StateCache>,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let configs = bus.subscribe("resource-watchers", Filter::kind(Kind::ConfigValidated));
    run(client, cache, bus, configs, token)
}

struct Running {
    spec: WatchedStore,
    task: Child,
}

async fn run(
    client: Client,
    cache: Arc<StateCache>,
    bus: EventBus<ControllerEvent>,
    mut configs: Subscription<ControllerEvent>,
    token: CancellationToken,
) {
    let mut running: BTreeMap<String, Running> = BTreeMap::new();
    loop {
        let event = tokio::select! {
            () = token.cancelled() => break,
            event = configs.recv() => event,
        };
        let Some(event) = event else { break };
        let ControllerEvent::ConfigValidated(config) = &*event else {
            continue;
        };
        install(&client, &cache, &bus, &token, &mut running, config.clone()).await;
    }
    for (_, watcher) in running {
        watcher.task.stop().await;
    }
}

/// Makes the cache hold `config` and its stores, keeping unchanged watchers.
async fn install(
    client: &Client,
    cache: &Arc<StateCache>,
    bus: &EventBus<ControllerEvent>,
    token: &CancellationToken,
    running: &mut BTreeMap<String, Running>,
    config: Arc<ValidatedConfig>,
) {
    let wanted: BTreeMap<&str, &WatchedStore> =
        config.stores.iter().map(|s| (s.name.as_str(), s)).collect();
    let stale: Vec<String> = running
        .iter()
        .filter(|(name, r)| wanted.get(name.as_str()) != Some(&&r.spec))
        .map(|(name, _)| name.clone())
        .collect();
    for name in stale {
        if let Some(watcher) = running.remove(&name) {
            info!(store = %name, "stopping watcher (removed or changed in the config)");
            watcher.task.stop().await;
        }
    }
    {
        let mut state = cache.write().await;
        let mut old = std::mem::take(&mut state.stores).into_stores();
        let mut rebuilt = haptic_render::Stores::new();
        for spec in &config.stores {
            // Names and configs were checked by the config loader: these cannot fail.
            match old
                .remove(&spec.name)
                .filter(|_| running.contains_key(&spec.name))
            {
                Some(store) => {
                    let _ = rebuilt.insert(spec.name.clone(), store);
                }
                None => {
                    let _ = rebuilt.add(spec.name.clone(), spec.store.clone());
                }
            }
        }
        for (name, derivation) in &config.derivations {
            let _ = rebuilt.derive(name.clone(), derivation.clone());
        }
        // The stores whose resources the templates only read through derived views and
        // `get()` keep them as JSON (a Service or EndpointSlice: a fifth of the heap).
        let compact = config.renderer.compact_unread_stores(&mut rebuilt);
        debug!(stores = ?compact, "stores kept compact");
        state.stores = rebuilt;
        state.unsynced = config
            .stores
            .iter()
            .filter(|s| !running.contains_key(&s.name))
            .map(|s| s.name.clone())
            .collect();
        state.config = Some(config.clone());
    }
    for spec in &config.stores {
        if running.contains_key(&spec.name) {
            continue;
        }
        let task = Child::spawn(token, |t| {
            watch_store(client.clone(), cache.clone(), bus.clone(), spec.clone(), t)
        });
        running.insert(
            spec.name.clone(),
            Running {
                spec: spec.clone(),
                task,
            },
        );
    }
    bus.publish(ControllerEvent::StoresChanged { store: "*".into() });
}

/// How often an optional resource that is not served is looked for again.
const OPTIONAL_POLL: Duration = Duration::from_secs(2);

/// Finds the resource through discovery, retrying (with a log line) until it exists.
///
/// An optional resource that is not served is said once (info), its store marked synced (it
/// stays empty: renders go on without it), and looked for again every [`OPTIONAL_POLL`]
/// quietly, until its CRD is installed.
async fn resolve(
    client: &Client,
    cache: &StateCache,
    bus: &EventBus<ControllerEvent>,
    spec: &WatchedStore,
    token: &CancellationToken,
) -> Option<ApiResource> {
    let gv = GroupVersion::gv(&spec.group, &spec.version);
    let mut delay = Duration::from_millis(500);
    let mut said = false;
    loop {
        let found = match discovery::pinned_group(client, &gv).await {
            Ok(group) => group
                .versioned_resources(&spec.version)
                .into_iter()
                .find(|(ar, _)| ar.plural == spec.plural)
                .map(|(ar, _)| ar)
                .ok_or_else(|| {
                    format!("{} serves no resource `{}`", gv.api_version(), spec.plural)
                }),
            Err(error) => Err(error.to_string()),
        };
        match found {
            Ok(ar) => {
                if said {
                    info!(store = %spec.name, resource = %spec.plural, "an optional resource is served now: watching it");
                }
                return Some(ar);
            }
            Err(error) if spec.optional => {
                if !said {
                    said = true;
                    info!(store = %spec.name, %error, "an optional resource is not served (its CRD is not installed?): its store stays empty until it is");
                    let synced = cache.write().await.unsynced.remove(&spec.name);
                    if synced {
                        bus.publish(ControllerEvent::StoresChanged {
                            store: spec.name.as_str().into(),
                        });
                    }
                } else {
                    debug!(store = %spec.name, %error, "an optional resource is still not served");
                }
                delay = OPTIONAL_POLL;
            }
            Err(error) => {
                warn!(store = %spec.name, %error, retry_in = ?delay, "resource not found through discovery");
            }
        }
        tokio::select! {
            () = token.cancelled() => return None,
            () = tokio::time::sleep(delay) => {}
        }
        if !spec.optional {
            delay = (delay * 2).min(Duration::from_secs(30));
        }
    }
}

async fn watch_store(
    client: Client,
    cache: Arc<StateCache>,
    bus: EventBus<ControllerEvent>,
    spec: WatchedStore,
    token: CancellationToken,
) {
    let Some(ar) = resolve(&client, &cache, &bus, &spec, &token).await else {
        return;
    };
    let api: Api<DynamicObject> = match &spec.namespace {
        Some(namespace) => Api::namespaced_with(client, namespace, &ar),
        None => Api::all_with(client, &ar),
    };
    let mut config = watcher::Config::default();
    if let Some(labels) = &spec.label_selector {
        config = config.labels(labels);
    }
    if let Some(fields) = &spec.field_selector {
        config = config.fields(fields);
    }
    let name: Arc<str> = spec.name.as_str().into();
    let stream = watcher(api, config).default_backoff();
    futures::pin_mut!(stream);
    // Keys listed since the last `Init`, to remove what a relist no longer holds.
    let mut listed: Option<HashSet<(String, String)>> = None;
    loop {
        let next = tokio::select! {
            () = token.cancelled() => return,
            next = stream.next() => next,
        };
        let Some(next) = next else { return };
        let event = match next {
            Ok(event) => event,
            Err(error) => {
                warn!(store = %name, %error, "watch failed; retrying with backoff");
                continue;
            }
        };
        match event {
            watcher::Event::Init => listed = Some(HashSet::new()),
            watcher::Event::InitApply(object) => {
                if let Some(key) = apply(&cache, &name, &object, &ar).await
                    && let Some(listed) = &mut listed
                {
                    listed.insert(key);
                }
            }
            watcher::Event::InitDone => {
                let listed = listed.take().unwrap_or_default();
                let (removed, first) = {
                    let mut state = cache.write().await;
                    let removed = match state.stores.get_mut(&name) {
                        Some(store) => {
                            let gone: Vec<(String, String)> = store
                                .keys()
                                .filter(|(ns, n)| {
                                    !listed.contains(&((*ns).to_owned(), (*n).to_owned()))
                                })
                                .map(|(ns, n)| (ns.to_owned(), n.to_owned()))
                                .collect();
                            for (ns, n) in &gone {
                                store.remove(ns, n);
                            }
                            gone.len()
                        }
                        None => 0,
                    };
                    (removed, state.unsynced.remove(&*name))
                };
                info!(store = %name, objects = listed.len(), removed, first, "list complete");
                bus.publish(ControllerEvent::StoresChanged {
                    store: name.clone(),
                });
            }
            watcher::Event::Apply(object) => {
                if apply(&cache, &name, &object, &ar).await.is_some() {
                    bus.publish(ControllerEvent::StoresChanged {
                        store: name.clone(),
                    });
                }
            }
            watcher::Event::Delete(object) => {
                let ns = object.metadata.namespace.clone().unwrap_or_default();
                let n = object.metadata.name.clone().unwrap_or_default();
                let removed = cache
                    .write()
                    .await
                    .stores
                    .get_mut(&name)
                    .is_some_and(|store| store.remove(&ns, &n));
                if removed {
                    bus.publish(ControllerEvent::StoresChanged {
                        store: name.clone(),
                    });
                }
            }
        }
    }
}

/// Puts one object into its store; returns its key.
///
/// List items come without `apiVersion` and `kind`; the store's objects always carry them, so
/// that templates can name an object (`record_event`, `set_status`).
async fn apply(
    cache: &StateCache,
    store: &str,
    object: &DynamicObject,
    ar: &ApiResource,
) -> Option<(String, String)> {
    let mut value = match serde_json::to_value(object) {
        Ok(value) => value,
        Err(error) => {
            warn!(%store, %error, "a watched object does not serialize; skipped");
            return None;
        }
    };
    if let Some(map) = value.as_object_mut() {
        map.entry("apiVersion")
            .or_insert_with(|| ar.api_version.clone().into());
        map.entry("kind").or_insert_with(|| ar.kind.clone().into());
    }
    let key = (
        object.metadata.namespace.clone().unwrap_or_default(),
        object.metadata.name.clone()?,
    );
    let mut state = cache.write().await;
    let target = state.stores.get_mut(store)?;
    match target.apply(&value) {
        Ok(()) => Some(key),
        Err(error) => {
            warn!(%store, %error, object = %key.1, "a watched object was refused by its store");
            None
        }
    }
}
