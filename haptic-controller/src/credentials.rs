//! The credentials loader: the agents' bearer token from a Secret key in the controller's
//! namespace, published (sticky) on every change. A missing Secret or key is waited for, with a
//! log line and a `Missing` state the status shows, never a crash loop.

use std::sync::Arc;

use futures::StreamExt;
use haptic_eventbus::{EventBus, Filter};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Client,
    api::Api,
    runtime::{WatchStreamExt, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    events::{ControllerEvent, Kind, TokenState},
    tasks::follow_config,
};

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    namespace: String,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let configs = bus.subscribe("credentials-loader", Filter::kind(Kind::ConfigValidated));
    follow_config(
        configs,
        token,
        |config| {
            (
                config.agent.token_secret.clone(),
                config.agent.token_key.clone(),
            )
        },
        move |wanted, t| {
            watch_secret(
                client.clone(),
                namespace.clone(),
                wanted.clone(),
                bus.clone(),
                t,
            )
        },
    )
}

async fn watch_secret(
    client: Client,
    namespace: String,
    (name, key): (String, String),
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let stream = watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff();
    futures::pin_mut!(stream);
    let missing = |why: String| Arc::new(TokenState::Missing { reason: why });
    let mut last: Option<Arc<TokenState>> = None;
    let mut listed_any = false;
    loop {
        let next = tokio::select! {
            () = token.cancelled() => return,
            next = stream.next() => next,
        };
        let Some(next) = next else { return };
        let state = match next {
            Ok(watcher::Event::Init) => {
                listed_any = false;
                continue;
            }
            Ok(watcher::Event::InitApply(secret) | watcher::Event::Apply(secret)) => {
                listed_any = true;
                token_of(&secret, &namespace, &name, &key)
            }
            Ok(watcher::Event::InitDone) => {
                if listed_any {
                    continue;
                }
                missing(format!("Secret {namespace}/{name} does not exist"))
            }
            Ok(watcher::Event::Delete(_)) => {
                missing(format!("Secret {namespace}/{name} was deleted"))
            }
            Err(error) => {
                warn!(%error, secret = %name, "watching the agent token Secret failed; retrying");
                continue;
            }
        };
        if last.as_deref() == Some(&*state) {
            continue;
        }
        match &*state {
            TokenState::Missing { reason } => {
                warn!(%reason, "no agent token: deployments wait until it exists");
            }
            TokenState::Present(_) => info!(secret = %name, "agent token loaded"),
        }
        bus.publish(ControllerEvent::AgentToken(state.clone()));
        last = Some(state);
    }
}

fn token_of(secret: &Secret, namespace: &str, name: &str, key: &str) -> Arc<TokenState> {
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.clone().into_bytes())
        });
    let state = match value.map(String::from_utf8) {
        None => TokenState::Missing {
            reason: format!("Secret {namespace}/{name} has no key `{key}`"),
        },
        Some(Err(_)) => TokenState::Missing {
            reason: format!("Secret {namespace}/{name} key `{key}` is not UTF-8"),
        },
        Some(Ok(token)) if token.trim().is_empty() => TokenState::Missing {
            reason: format!("Secret {namespace}/{name} key `{key}` is empty"),
        },
        Some(Ok(token)) => TokenState::Present(token.trim().to_owned()),
    };
    Arc::new(state)
}
