//! The config loader: watches the HAProxyTemplateConfig by name, validates each new version and
//! publishes the verdict (always) and the validated config (only when valid). An invalid
//! version never replaces the running config; a deleted HTC leaves it running too.

use std::{sync::Arc, time::SystemTime};

use futures::StreamExt;
use haptic_eventbus::EventBus;
use kube::{
    Client,
    api::Api,
    runtime::{WatchStreamExt, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::{
    config::{self, ElectionSettings},
    crd::HAProxyTemplateConfig,
    events::{ConfigVerdict, ControllerEvent},
};

/// The HTC's name and namespace.
#[derive(Debug, Clone)]
pub struct ConfigRef {
    /// Its name.
    pub name: String,
    /// Its namespace (the controller's).
    pub namespace: String,
}

fn stream(
    client: Client,
    at: &ConfigRef,
) -> impl futures::Stream<Item = Result<HAProxyTemplateConfig, watcher::Error>> + Send + use<> {
    let api: Api<HAProxyTemplateConfig> = Api::namespaced(client, &at.namespace);
    watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={}", at.name)),
    )
    .default_backoff()
    .applied_objects()
}

/// Waits until the HTC exists with election settings that parse, and returns them: the elector
/// needs them before anything else starts. Logs what it waits for.
pub async fn initial_election(
    client: Client,
    at: &ConfigRef,
    token: &CancellationToken,
) -> Option<ElectionSettings> {
    let objects = stream(client, at);
    futures::pin_mut!(objects);
    info!(name = %at.name, namespace = %at.namespace, "waiting for the HAProxyTemplateConfig");
    loop {
        let next = tokio::select! {
            () = token.cancelled() => return None,
            next = objects.next() => next?,
        };
        match next {
            Ok(htc) => match election_settings(&htc) {
                Ok(settings) => return Some(settings),
                Err(errors) => {
                    error!(errors = %errors.join("; "), "the HAProxyTemplateConfig's leader election settings are invalid; waiting for a fix");
                }
            },
            Err(error) => warn!(%error, "watching the HAProxyTemplateConfig failed; retrying"),
        }
    }
}

/// The election settings alone: they decide who leads, and so who may write the status that
/// reports the rest of the config's problems.
fn election_settings(htc: &HAProxyTemplateConfig) -> Result<ElectionSettings, Vec<String>> {
    let mut spec = htc.spec.clone();
    // Only the election fields matter here: blank out the rest's possible problems.
    spec.pod_selector
        .match_labels
        .insert("probe".to_owned(), "probe".to_owned());
    spec.agent = Default::default();
    spec.watched_resources.clear();
    spec.derived_views.clear();
    spec.template_snippets.clear();
    spec.maps.clear();
    spec.files.clear();
    spec.ssl_certificates.clear();
    spec.status_templates.clear();
    spec.validation_tests.clear();
    spec.haproxy_config.template = String::new();
    spec.templating_settings = Default::default();
    config::validate(&spec, 0, "").map(|c| c.election)
}

/// The config loader's component (it subscribes to nothing).
pub async fn component(
    client: Client,
    at: ConfigRef,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) {
    {
        let objects = stream(client, &at);
        futures::pin_mut!(objects);
        // (uid, generation) of the last version validated: a deleted and re-created HTC starts
        // at generation 1 again, with a new uid.
        let mut last: Option<(String, i64)> = None;
        let mut running_election: Option<ElectionSettings> = None;
        loop {
            let next = tokio::select! {
                () = token.cancelled() => return,
                next = objects.next() => next,
            };
            let Some(next) = next else { return };
            let htc = match next {
                Ok(htc) => htc,
                Err(error) => {
                    warn!(%error, "watching the HAProxyTemplateConfig failed; retrying");
                    continue;
                }
            };
            let generation = htc.metadata.generation.unwrap_or(0);
            let rv = htc.metadata.resource_version.clone().unwrap_or_default();
            let uid = htc.metadata.uid.clone().unwrap_or_default();
            // Status writes change the resourceVersion, not the generation: only a new spec is
            // validated again.
            if last
                .as_ref()
                .is_some_and(|(u, g)| *u == uid && *g == generation && generation != 0)
            {
                continue;
            }
            last = Some((uid.clone(), generation));
            let spec = htc.spec.clone();
            let verdict =
                tokio::task::spawn_blocking(move || config::validate(&spec, generation, &rv)).await;
            let verdict = match verdict {
                Ok(verdict) => verdict,
                Err(error) => Err(vec![format!("validation panicked: {error}")]),
            };
            match verdict {
                Ok(valid) => {
                    info!(generation, "config valid; applying it");
                    if let Some(before) = &running_election
                        && *before != valid.election
                    {
                        warn!(
                            "controller.leaderElection changed: it takes effect when the controller restarts"
                        );
                    }
                    running_election = Some(valid.election.clone());
                    bus.publish(ControllerEvent::ConfigVerdict(Arc::new(ConfigVerdict {
                        uid: uid.clone(),
                        generation,
                        errors: Vec::new(),
                        at: SystemTime::now(),
                    })));
                    bus.publish(ControllerEvent::ConfigValidated(Arc::new(valid)));
                }
                Err(errors) => {
                    error!(generation, errors = %errors.join("; "), "config invalid; the running config stays");
                    bus.publish(ControllerEvent::ConfigVerdict(Arc::new(ConfigVerdict {
                        uid,
                        generation,
                        errors,
                        at: SystemTime::now(),
                    })));
                }
            }
        }
    }
}
