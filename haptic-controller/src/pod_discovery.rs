//! Pod discovery: the HAProxy pods in the controller's namespace that match `podSelector` and
//! can take a config (Running, with a pod IP, not terminating, the agent container ready),
//! published (sticky) as a [`PodSet`] whenever it changes.

use std::{collections::BTreeMap, sync::Arc};

use futures::StreamExt;
use haptic_eventbus::{EventBus, Filter};
use k8s_openapi::api::core::v1::Pod as KubePod;
use kube::{
    Client,
    api::Api,
    runtime::{WatchStreamExt, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    events::{ControllerEvent, Kind, Pod, PodSet},
    tasks::follow_config,
};

/// What decides which pods are eligible and how they are reached.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selection {
    selector: String,
    scheme: &'static str,
    port: u16,
    container: String,
}

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    namespace: String,
    scheme: &'static str,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let configs = bus.subscribe("pod-discovery", Filter::kind(Kind::ConfigValidated));
    follow_config(
        configs,
        token,
        move |config| Selection {
            selector: config.pod_selector.clone(),
            scheme,
            port: config.agent.port,
            container: config.agent.container_name.clone(),
        },
        move |wanted, t| {
            watch_pods(
                client.clone(),
                namespace.clone(),
                wanted.clone(),
                bus.clone(),
                t,
            )
        },
    )
}

async fn watch_pods(
    client: Client,
    namespace: String,
    selection: Selection,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) {
    let api: Api<KubePod> = Api::namespaced(client, &namespace);
    let stream =
        watcher(api, watcher::Config::default().labels(&selection.selector)).default_backoff();
    futures::pin_mut!(stream);
    let mut pods: BTreeMap<String, Pod> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, Pod>> = None;
    let mut published: Option<PodSet> = None;
    loop {
        let next = tokio::select! {
            () = token.cancelled() => return,
            next = stream.next() => next,
        };
        let Some(next) = next else { return };
        match next {
            Ok(watcher::Event::Init) => listing = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(pod)) => {
                if let (Some(listing), Some((name, Some(eligible)))) =
                    (&mut listing, judge(&pod, &selection))
                {
                    listing.insert(name, eligible);
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => pods = listing.take().unwrap_or_default(),
            Ok(watcher::Event::Apply(pod)) => match judge(&pod, &selection) {
                Some((name, Some(eligible))) => {
                    pods.insert(name, eligible);
                }
                Some((name, None)) => {
                    pods.remove(&name);
                }
                None => continue,
            },
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(name) = pod.metadata.name {
                    pods.remove(&name);
                }
            }
            Err(error) => {
                warn!(%error, "watching HAProxy pods failed; retrying");
                continue;
            }
        }
        if listing.is_some() {
            continue;
        }
        let set = PodSet { pods: pods.clone() };
        if published.as_ref() == Some(&set) {
            continue;
        }
        info!(pods = ?set.pods.keys().collect::<Vec<_>>(), "HAProxy pods changed");
        bus.publish(ControllerEvent::PodSet(Arc::new(set.clone())));
        published = Some(set);
    }
}

/// A pod's name, and the pod if it can take a config now.
fn judge(pod: &KubePod, selection: &Selection) -> Option<(String, Option<Pod>)> {
    let name = pod.metadata.name.clone()?;
    let status = pod.status.as_ref();
    let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
    let ip = status
        .and_then(|s| s.pod_ip.clone())
        .filter(|ip| !ip.is_empty());
    let terminating = pod.metadata.deletion_timestamp.is_some();
    let agent_ready = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == selection.container))
        .map(|c| c.ready)
        .unwrap_or_else(|| {
            // No container of that name: the pod's own Ready condition decides.
            status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
                .is_some_and(|c| c.status == "True")
        });
    let eligible = match ip {
        Some(ip) if running && !terminating && agent_ready => {
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip
            };
            Some(Pod {
                name: name.clone(),
                url: format!("{}://{host}:{}/", selection.scheme, selection.port),
            })
        }
        _ => None,
    };
    Some((name, eligible))
}
