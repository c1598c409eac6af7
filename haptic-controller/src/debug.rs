//! The observer (all replicas) and the opt-in debug server.
//!
//! The observer subscribes to every event on the bus: it feeds the metrics that the bus tells
//! ([`crate::metrics::Metrics::on_event`]) and keeps the debug state that `/debug/vars` serves
//! on `--debug-addr` (off by default): the config version, leader and epoch, the pod set with
//! each pod's live checksum, the last render (size, checksum, duration), recent deployments and
//! the last [`EVENTS_KEPT`] bus events. Only what a summary names is kept: never a file's
//! content (the rendered set holds private keys), never the agent token.

use std::{
    collections::{BTreeMap, VecDeque},
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    extract::State,
    http::header,
    response::{IntoResponse, Response},
    routing::get,
};
use haptic_eventbus::{EventBus, Filter};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::events::{ControllerEvent, PodOutcome, TokenState};

/// How many bus events `/debug/vars` keeps.
pub const EVENTS_KEPT: usize = 100;
/// How many deployment reports it keeps.
pub const DEPLOYMENTS_KEPT: usize = 20;

/// The state `/debug/vars` serves.
#[derive(Debug, Default)]
pub struct DebugState {
    inner: Mutex<Snapshot>,
}

#[derive(Debug, Default)]
struct Snapshot {
    identity: String,
    config: Value,
    verdict: Value,
    leader: Option<String>,
    is_leader: bool,
    epoch: Option<u64>,
    token: Value,
    pods: BTreeMap<String, String>,
    live: BTreeMap<String, String>,
    last_render: Value,
    last_render_failure: Value,
    deployments: VecDeque<Value>,
    events: VecDeque<Value>,
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

impl DebugState {
    /// Empty state for replica `identity`.
    pub fn new(identity: &str) -> Arc<Self> {
        let state = Self::default();
        state.lock().identity = identity.to_owned();
        Arc::new(state)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes in one bus event.
    pub fn record(&self, event: &ControllerEvent) {
        let summary = summarize(event);
        let mut s = self.lock();
        match event {
            ControllerEvent::BecameLeader(e) => {
                s.is_leader = true;
                s.epoch = Some(e.epoch);
                s.leader = Some(e.identity.clone());
            }
            ControllerEvent::LostLeadership(_) => {
                s.is_leader = false;
                s.live.clear();
            }
            ControllerEvent::NewLeader(e) => s.leader = Some(e.new_leader_identity.clone()),
            ControllerEvent::ConfigValidated(_)
            | ControllerEvent::ConfigVerdict(_)
            | ControllerEvent::AgentToken(_) => {
                let key = match event {
                    ControllerEvent::ConfigValidated(_) => &mut s.config,
                    ControllerEvent::ConfigVerdict(_) => &mut s.verdict,
                    _ => &mut s.token,
                };
                *key = summary.clone();
            }
            ControllerEvent::PodSet(pods) => {
                s.pods = pods
                    .pods
                    .iter()
                    .map(|(name, pod)| (name.clone(), pod.url.clone()))
                    .collect();
            }
            ControllerEvent::Rendered(_) => {
                s.last_render = summary.clone();
                s.last_render_failure = Value::Null;
            }
            ControllerEvent::RenderFailed(_) => s.last_render_failure = summary.clone(),
            ControllerEvent::Deployed(report) => {
                s.live = report.live.clone();
                if s.deployments.len() == DEPLOYMENTS_KEPT {
                    s.deployments.pop_front();
                }
                s.deployments.push_back(summary.clone());
            }
            _ => {}
        }
        if s.events.len() == EVENTS_KEPT {
            s.events.pop_front();
        }
        s.events.push_back(summary);
    }

    /// The whole state as JSON.
    pub fn vars(&self) -> Value {
        let s = self.lock();
        let pods: BTreeMap<&String, Value> = s
            .pods
            .iter()
            .map(|(name, url)| (name, json!({"url": url, "liveChecksum": s.live.get(name)})))
            .collect();
        json!({
            "identity": s.identity,
            "config": s.config,
            "configVerdict": s.verdict,
            "leader": {"identity": s.leader, "isLeader": s.is_leader, "epoch": s.epoch},
            "agentToken": s.token,
            "pods": pods,
            "lastRender": s.last_render,
            "lastRenderFailure": s.last_render_failure,
            "recentDeployments": s.deployments,
            "events": s.events,
        })
    }
}

/// One event as `/debug/vars` shows it: its kind, when it was seen, and what it names.
fn summarize(event: &ControllerEvent) -> Value {
    let (kind, detail) = match event {
        ControllerEvent::ElectionStarted(e) => (
            "ElectionStarted",
            json!({"identity": e.identity, "lease": format!("{}/{}", e.lease_namespace, e.lease_name)}),
        ),
        ControllerEvent::BecameLeader(e) => (
            "BecameLeader",
            json!({"identity": e.identity, "epoch": e.epoch}),
        ),
        ControllerEvent::LostLeadership(e) => (
            "LostLeadership",
            json!({"identity": e.identity, "reason": e.reason}),
        ),
        ControllerEvent::NewLeader(e) => (
            "NewLeader",
            json!({"identity": e.new_leader_identity, "isSelf": e.is_self}),
        ),
        ControllerEvent::ConfigValidated(c) => (
            "ConfigValidated",
            json!({"generation": c.generation, "resourceVersion": c.resource_version,
                   "stores": c.stores.len()}),
        ),
        ControllerEvent::ConfigVerdict(v) => (
            "ConfigVerdict",
            json!({"generation": v.generation, "valid": v.errors.is_empty(), "errors": v.errors}),
        ),
        // Whether there is a token, never the token.
        ControllerEvent::AgentToken(t) => (
            "AgentToken",
            match &**t {
                TokenState::Present(_) => json!({"present": true}),
                TokenState::Missing { reason } => json!({"present": false, "reason": reason}),
            },
        ),
        ControllerEvent::PodSet(p) => {
            ("PodSet", json!({"pods": p.pods.keys().collect::<Vec<_>>()}))
        }
        ControllerEvent::StoresChanged { store } => ("StoresChanged", json!({"store": &**store})),
        ControllerEvent::RenderTrigger { reason, .. } => {
            ("RenderTrigger", json!({"reason": reason}))
        }
        // Paths and sizes, never the content: the set holds the certificates' private keys.
        ControllerEvent::Rendered(set) => (
            "Rendered",
            json!({
                "checksum": set.checksum,
                "configGeneration": set.config_generation,
                "files": set.files.len(),
                "bytes": set.files.iter().map(|(_, c)| c.len()).sum::<usize>(),
                "durationMs": set.render_time.as_secs_f64() * 1000.0,
            }),
        ),
        ControllerEvent::RenderFailed(f) => (
            "RenderFailed",
            json!({"configGeneration": f.config_generation, "message": f.message}),
        ),
        ControllerEvent::GateVerdict(v) => (
            "GateVerdict",
            json!({"checksum": v.checksum, "passed": v.refused.is_none(), "refused": v.refused}),
        ),
        ControllerEvent::Exclude(x) => (
            "Exclude",
            json!({"object": x.object.to_string(), "reason": x.reason, "checksum": x.checksum}),
        ),
        ControllerEvent::Deployable(set) => ("Deployable", json!({"checksum": set.checksum})),
        ControllerEvent::Fenced(f) => (
            "Fenced",
            json!({"pod": f.pod, "fence": f.fence, "epoch": f.epoch, "outcome": f.outcome}),
        ),
        ControllerEvent::Deployed(r) => (
            "Deployed",
            json!({
                "checksum": r.checksum,
                "configGeneration": r.config_generation,
                "pods": r.pods.iter().map(|(pod, outcome)| (pod.clone(), match outcome {
                    PodOutcome::Live => json!("live"),
                    PodOutcome::Pending => json!("pending"),
                    PodOutcome::Failed(why) => json!({"failed": why}),
                })).collect::<BTreeMap<_, _>>(),
            }),
        ),
        ControllerEvent::DriftDetected { pod, live } => {
            ("DriftDetected", json!({"pod": &**pod, "live": live}))
        }
    };
    json!({"kind": kind, "at": now(), "detail": detail})
}

/// The observer: every event into the metrics and the debug state. Subscribe now, run the
/// returned future (an all-replica component).
pub fn component(
    state: Arc<DebugState>,
    bus: EventBus<ControllerEvent>,
    token: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    // Reliable: the counts must see every event; the work per event is small.
    let mut events = bus.subscribe("observer", Filter::all());
    async move {
        let metrics = crate::metrics::get();
        loop {
            let event = tokio::select! {
                () = token.cancelled() => return,
                event = events.recv() => event,
            };
            let Some(event) = event else { return };
            metrics.on_event(&event);
            state.record(&event);
        }
    }
}

/// Binds `addr` and serves `/debug/vars` until `token` fires. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<DebugState>,
    token: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    info!(addr = %bound, "debug server listening (/debug/vars)");
    let app = Router::new()
        .route("/debug/vars", get(vars))
        .with_state(state);
    let handle = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { token.cancelled().await })
            .await;
    });
    Ok((bound, handle))
}

async fn vars(State(state): State<Arc<DebugState>>) -> Response {
    // Plain JSON values: serializing them cannot fail.
    let body = serde_json::to_string_pretty(&state.vars()).unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Pod, PodSet};

    #[test]
    fn keeps_the_last_hundred_events_and_never_the_token() {
        let state = DebugState::new("replica-a");
        state.record(&ControllerEvent::AgentToken(Arc::new(TokenState::Present(
            "s3cret-token-value".to_owned(),
        ))));
        state.record(&ControllerEvent::PodSet(Arc::new(PodSet {
            pods: BTreeMap::from([(
                "p1".to_owned(),
                Pod {
                    name: "p1".to_owned(),
                    url: "http://10.0.0.1:9090/".to_owned(),
                },
            )]),
        })));
        for _ in 0..EVENTS_KEPT + 5 {
            state.record(&ControllerEvent::StoresChanged { store: "s".into() });
        }
        let vars = state.vars();
        let text = vars.to_string();
        assert!(!text.contains("s3cret-token-value"), "{text}");
        assert_eq!(vars["agentToken"]["detail"]["present"], true);
        assert_eq!(vars["identity"], "replica-a");
        assert_eq!(vars["pods"]["p1"]["url"], "http://10.0.0.1:9090/");
        let events = vars["events"].as_array().expect("events");
        assert_eq!(events.len(), EVENTS_KEPT);
        assert!(events.iter().all(|e| e["kind"] == "StoresChanged"));
    }
}
