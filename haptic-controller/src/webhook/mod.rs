//! The admission webhook, served by every replica (a failover never blocks admission): HTTPS
//! (rustls on ring) at `POST /validate`, `admission.k8s.io/v1` AdmissionReviews.
//!
//! - A watched resource whose store has `enableValidationWebhook` (found from the request's
//!   group, version and resource, never from its kind's spelling): the change (CREATE, UPDATE,
//!   or DELETE: a removal can break a config too) is laid over the replica's stores without
//!   copying them ([`haptic_render::Stores::overlay`]), the config is rendered with it, the set
//!   goes through the agents' config policy and a strict `haproxy -c` (no `-dr`), and the
//!   config's validation tests must pass. A denial names the object and the cause: the
//!   template and line, the policy rule, or HAProxy's alert line. A failure the stores already
//!   had without the change (a broken object stored earlier) is not this object's: it is let
//!   through with a warning, so a fix is never refused for someone else's fault.
//! - The HAProxyTemplateConfig itself: its structure and templates (as the config loader
//!   checks them), its set rendered (against the stores when the watched resources are the
//!   running config's, else with none) through the policy and `haproxy -c`, and its validation
//!   tests.
//! - An Ingress that is not ours (its class belongs to another controller: every derived view
//!   reading its store leaves it out, [`haptic_render::Stores::is_ours`]) is allowed at once,
//!   without rendering. The ValidatingWebhookConfiguration's `matchConditions` keep most of
//!   them from being sent at all.
//! - An Ingress of ours carrying an ingress-nginx annotation ([`haptic_render::nginx`], the
//!   registry): a raw-config one (`*-snippet`) is denied, naming it and why (never rendered:
//!   CVE-2025-1974); the others are allowed with a warning naming each and its verdict (none
//!   is applied), after the checks above.
//! - A body that is not an AdmissionReview v1 with a request: 400. A review that has not
//!   finished within its budget, or that cannot be judged (no `haproxy` to run), is answered
//!   as the failure policy says: denied (`fail`) or allowed with a warning (`ignore`).
//!
//!
//! Bounded: at most `max_connections` connections (one more is closed at once; the listener is
//! haptic-serve's, the agent's), and at most `max_concurrent_reviews` reviews render and run
//! `haproxy -c` at once; the others queue, and the wait counts against their budget, so a burst
//! is answered by the failure policy past it rather than piling work up in the replica.
//!
//! The certificate and key are read from files and again when they change
//! ([`haptic_agent_client::tls`], the listener config the agents use too).

mod checked;
mod gateway;
pub mod selector;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
};
use serde_json::Value as Json;
use tokio::{net::TcpListener, sync::Semaphore, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::{
    config::{self, ValidatedConfig},
    crd::{self, HAProxyTemplateConfig},
    events::RenderedSet,
    render_gate::{self, CheckError},
    state::StateCache,
    validation::{self, Checker},
};
use haptic_render::{Change, FileSet, nginx};

/// The default budget of one review: below the ValidatingWebhookConfiguration's
/// `timeoutSeconds` (10 in `deploy/webhook/`), so the answer is ours, not the API server's.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(8);

/// How long a TLS handshake and a request's headers may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest review body read (an UPDATE carries the object twice).
const BODY_LIMIT: usize = 8 << 20;

/// What a review that cannot be judged in time (or at all) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Denied, saying why (default): nothing unchecked gets in.
    Fail,
    /// Allowed, with a warning saying it was not checked.
    Ignore,
}

/// The webhook's settings.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// Where it listens (default `0.0.0.0:9443`).
    pub addr: SocketAddr,
    /// The certificate chain (PEM), re-read when it changes.
    pub cert: PathBuf,
    /// The private key (PEM), re-read when it changes.
    pub key: PathBuf,
    /// The policy and `haproxy` binary the checks use (the agents' policy).
    pub checker: Checker,
    /// How long one review may take before the failure policy answers it.
    pub budget: Duration,
    /// What a review past its budget, or one that cannot be judged, gets.
    pub failure_policy: FailurePolicy,
    /// Most connections served at once (default [`DEFAULT_MAX_CONNECTIONS`]).
    pub max_connections: usize,
    /// Most reviews judged at once (default [`DEFAULT_MAX_CONCURRENT_REVIEWS`]); the others
    /// wait, and the wait counts against their budget.
    pub max_concurrent_reviews: usize,
}

/// The default connection cap of the webhook's listener. The API server calls an HTTP/1.1
/// webhook with one connection per review in flight, so the cap is above the bursts a GitOps
/// sync sends (100 at once is answered in full); the review slots bound the work, the cap
/// bounds memory and descriptors.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// The default number of reviews judged at once: each renders the config and runs
/// `haproxy -c`, so more than the replica's cores only lengthens every one of them.
pub const DEFAULT_MAX_CONCURRENT_REVIEWS: usize = 2;

/// Errors of starting the webhook.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The certificate or key is unusable.
    #[error("the webhook certificate")]
    Tls(#[from] haptic_agent_client::tls::Error),
    /// The address could not be bound.
    #[error("binding the webhook on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What a review found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Let through (with warnings for the user, if any).
    Allowed(Vec<String>),
    /// Refused: the message names the object and the cause.
    Denied(String),
    /// Not judged (past the budget, no `haproxy`): the failure policy decides.
    Unjudged(String),
}

/// What the metric `haptic_webhook_requests_total{gvk,result}` counts for one review: the
/// request's group/version/kind and `allowed`, `denied`, `unjudged_allowed`,
/// `unjudged_denied` or `malformed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReviewOutcome {
    /// `group/version/Kind` (`v1/Secret` for the core group).
    pub gvk: String,
    /// How it was answered.
    pub result: &'static str,
}

/// Records each review's outcome: `haptic_webhook_requests_total{gvk,result}` and a debug line.
fn record(outcome: &ReviewOutcome) {
    crate::metrics::get().webhook_requests.add(
        1,
        &[
            opentelemetry::KeyValue::new("gvk", outcome.gvk.clone()),
            opentelemetry::KeyValue::new("result", outcome.result),
        ],
    );
    debug!(gvk = %outcome.gvk, result = outcome.result, "admission review answered");
}

/// The webhook's state: the replica's cache, its settings, and the last config whose
/// validation tests were run (they depend on the config alone: run once per version).
struct Webhook {
    cache: Arc<StateCache>,
    settings: WebhookSettings,
    tests: tokio::sync::Mutex<Option<(ConfigKey, Result<(), String>)>>,
    /// What `haproxy -c` accepted for the running config version ([`checked`]); read and
    /// written on blocking threads (it compares whole sets line by line).
    checked: Arc<std::sync::Mutex<Option<(ConfigKey, checked::Checked)>>>,
    /// One permit per review judged at once.
    slots: Semaphore,
}

type ConfigKey = (i64, String);

/// Starts the webhook: binds, loads the certificate (an error if either fails), and serves
/// until `token` fires; the task then stops accepting and lets reviews in flight finish
/// within the budget. Returns the bound address and the task.
pub async fn serve(
    settings: WebhookSettings,
    cache: Arc<StateCache>,
    token: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), Error> {
    let pair = haptic_agent_client::tls::PairFiles {
        cert: settings.cert.clone(),
        key: settings.key.clone(),
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(
        haptic_agent_client::tls::server_config(&pair, None)?,
    ));
    let listener = TcpListener::bind(settings.addr)
        .await
        .map_err(|source| Error::Bind {
            addr: settings.addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: settings.addr,
        source,
    })?;
    let limits = haptic_serve::Limits {
        max_connections: settings.max_connections,
        header_read_timeout: HANDSHAKE_TIMEOUT,
        drain: settings.budget + Duration::from_secs(1),
    };
    let hook = Arc::new(Webhook {
        slots: Semaphore::new(settings.max_concurrent_reviews.max(1)),
        cache,
        settings,
        tests: tokio::sync::Mutex::new(None),
        checked: Arc::new(std::sync::Mutex::new(None)),
    });
    let app = Router::new()
        .route("/validate", post(validate))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(hook);
    info!(%addr, "admission webhook listening (HTTPS, /validate)");
    let task = tokio::spawn(haptic_serve::serve(
        listener,
        Some(acceptor),
        app,
        limits,
        token,
    ));
    Ok((addr, task))
}

fn bad_request(message: String) -> Response {
    record(&ReviewOutcome {
        gvk: String::new(),
        result: "malformed",
    });
    (StatusCode::BAD_REQUEST, message).into_response()
}

async fn validate(State(hook): State<Arc<Webhook>>, body: Bytes) -> Response {
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(error) => return bad_request(format!("the body is not an AdmissionReview: {error}")),
    };
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return bad_request(format!(
            "expected an admission.k8s.io/v1 AdmissionReview, got {} {}",
            review.types.api_version, review.types.kind
        ));
    }
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(_) => return bad_request("the AdmissionReview has no request".to_owned()),
    };
    let budget = hook.settings.budget;
    let deadline = tokio::time::Instant::now() + budget;
    // The wait for a slot is part of the budget: past it the failure policy answers.
    let verdict = match tokio::time::timeout_at(deadline, hook.slots.acquire()).await {
        Ok(Ok(_slot)) => match tokio::time::timeout_at(deadline, hook.review(&request)).await {
            Ok(verdict) => verdict,
            Err(_) => Verdict::Unjudged(format!(
                "the review did not finish within its budget of {budget:?}"
            )),
        },
        Ok(Err(_)) | Err(_) => Verdict::Unjudged(format!(
            "the review waited for one of the {} review slots past its budget of {budget:?}",
            hook.settings.max_concurrent_reviews
        )),
    };
    let (response, outcome) = answer(&request, verdict, hook.settings.failure_policy);
    record(&outcome);
    let body = serde_json::to_vec(&response.into_review()).unwrap_or_default();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

/// The response for a verdict, and what the metric records.
pub fn answer<T: kube::Resource>(
    request: &AdmissionRequest<T>,
    verdict: Verdict,
    policy: FailurePolicy,
) -> (AdmissionResponse, ReviewOutcome) {
    let kind = &request.kind;
    let gvk = if kind.group.is_empty() {
        format!("{}/{}", kind.version, kind.kind)
    } else {
        format!("{}/{}/{}", kind.group, kind.version, kind.kind)
    };
    let mut response = AdmissionResponse::from(request);
    let warned = |mut response: AdmissionResponse, warnings: Vec<String>| {
        if !warnings.is_empty() {
            response.warnings = Some(warnings);
        }
        response
    };
    let (response, result) = match (verdict, policy) {
        (Verdict::Allowed(warnings), _) => (warned(response, warnings), "allowed"),
        (Verdict::Denied(message), _) => {
            response = response.deny(message);
            response.result.code = 403;
            response.result.reason = "Forbidden".to_owned();
            (response, "denied")
        }
        (Verdict::Unjudged(why), FailurePolicy::Fail) => {
            response = response.deny(format!(
                "haptic could not check this change: {why} (failure policy: fail)"
            ));
            response.result.code = 500;
            (response, "unjudged_denied")
        }
        (Verdict::Unjudged(why), FailurePolicy::Ignore) => (
            warned(
                response,
                vec![format!(
                    "haptic did not check this change: {why} (failure policy: ignore)"
                )],
            ),
            "unjudged_allowed",
        ),
    };
    (response, ReviewOutcome { gvk, result })
}

/// `Kind namespace/name` (or `Kind name`) of the request's object.
fn describe(request: &AdmissionRequest<DynamicObject>, object: &Json) -> String {
    let name = object
        .pointer("/metadata/name")
        .and_then(Json::as_str)
        .filter(|n| !n.is_empty())
        .unwrap_or(&request.name);
    match request.namespace.as_deref().filter(|n| !n.is_empty()) {
        Some(ns) => format!("{} {ns}/{name}", request.kind.kind),
        None => format!("{} {name}", request.kind.kind),
    }
}

impl Webhook {
    async fn review(&self, request: &AdmissionRequest<DynamicObject>) -> Verdict {
        if request
            .sub_resource
            .as_deref()
            .is_some_and(|s| !s.is_empty())
        {
            return Verdict::Allowed(Vec::new());
        }
        let object = match request.operation {
            Operation::Create | Operation::Update => request.object.as_ref(),
            Operation::Delete => request.old_object.as_ref(),
            Operation::Connect => return Verdict::Allowed(Vec::new()),
        };
        let Some(object) = object.and_then(|o| serde_json::to_value(o).ok()) else {
            return Verdict::Denied(format!(
                "{} {}: the review carries no object to check",
                request.kind.kind, request.name
            ));
        };
        let what = describe(request, &object);
        let resource = &request.resource;
        if resource.group == crd::GROUP && resource.resource == "haproxytemplateconfigs" {
            if request.operation == Operation::Delete {
                return Verdict::Allowed(Vec::new());
            }
            return self.review_config(&what, object).await;
        }
        self.review_resource(request, &what, object).await
    }

    async fn review_resource(
        &self,
        request: &AdmissionRequest<DynamicObject>,
        what: &str,
        object: Json,
    ) -> Verdict {
        let resource = &request.resource;
        let (config, store) = {
            let state = self.cache.read().await;
            let Some(config) = state.config.clone() else {
                return Verdict::Allowed(vec![
                    "haptic has no valid config loaded yet: nothing to check this against"
                        .to_owned(),
                ]);
            };
            let same = |s: &&config::WatchedStore| {
                s.group == resource.group && s.plural == resource.resource
            };
            let store = config
                .stores
                .iter()
                .filter(same)
                .find(|s| s.version == resource.version)
                .or_else(|| config.stores.iter().find(same))
                .cloned();
            let Some(store) = store else {
                return Verdict::Allowed(Vec::new());
            };
            let enabled = config
                .spec
                .watched_resources
                .get(&store.name)
                .is_some_and(|w| w.enable_validation_webhook);
            if !enabled {
                return Verdict::Allowed(Vec::new());
            }
            if !state.ready() {
                return Verdict::Allowed(vec![
                    "haptic's stores are still loading: this change was not checked".to_owned(),
                ]);
            }
            (config, store)
        };
        // Only what the store would hold is judged.
        let selected = store
            .label_selector
            .as_deref()
            .is_none_or(|s| selector::matches(&object, selector::Keys::Labels, s))
            && store
                .field_selector
                .as_deref()
                .is_none_or(|s| selector::matches(&object, selector::Keys::Fields, s));
        if !selected {
            return Verdict::Allowed(Vec::new());
        }
        // An Ingress of another controller's class: nothing rendered reads it.
        if !self.cache.read().await.stores.is_ours(&store.name, &object) {
            return Verdict::Allowed(Vec::new());
        }
        // Its ingress-nginx annotations: a snippet is refused, the others are not applied
        // (never silently: a warning names each). A removal is not judged by them.
        let nginx = if resource.resource == "ingresses" && request.operation != Operation::Delete {
            nginx::judge_object(&object)
        } else {
            Vec::new()
        };
        if let Some(refused) = nginx::refusal(&nginx) {
            return Verdict::Denied(format!("{what}: {refused}"));
        }
        // A value that cannot be applied (a CIDR, a size, a URL that does not parse) is denied,
        // naming the annotation: a stored one would be left out, or deny every client.
        if !nginx.is_empty() {
            let invalid = nginx::invalid_values(&object);
            if !invalid.is_empty() {
                let all: Vec<String> = invalid.iter().map(ToString::to_string).collect();
                return Verdict::Denied(format!(
                    "{what}: invalid ingress-nginx annotation values: {}",
                    all.join("; ")
                ));
            }
        }
        let warnings: Vec<String> = nginx
            .iter()
            .filter_map(|f| match f.verdict {
                nginx::Verdict::Refused | nginx::Verdict::Supported => None,
                nginx::Verdict::Differs => Some(format!(
                    "{what}: {} is applied, differently from ingress-nginx: {}",
                    f.annotation, f.note
                )),
                _ => Some(format!(
                    "{what}: {} is not applied ({}): {}",
                    f.annotation, f.verdict, f.note
                )),
            })
            .collect();
        match self
            .review_ours(request, what, object, &config, &store)
            .await
        {
            Verdict::Allowed(more) => Verdict::Allowed(warnings.into_iter().chain(more).collect()),
            other => other,
        }
    }

    /// The render, policy, `haproxy -c` and validation tests of a change to a resource of ours.
    async fn review_ours(
        &self,
        request: &AdmissionRequest<DynamicObject>,
        what: &str,
        object: Json,
        config: &ValidatedConfig,
        store: &config::WatchedStore,
    ) -> Verdict {
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Json::as_str)
            .or(request.namespace.as_deref())
            .unwrap_or("")
            .to_owned();
        let name = object
            .pointer("/metadata/name")
            .and_then(Json::as_str)
            .unwrap_or(&request.name)
            .to_owned();
        let mut object = object;
        // A namespaced object created without one in its body gets the request's.
        if let Some(meta) = object.get_mut("metadata").and_then(Json::as_object_mut)
            && !namespace.is_empty()
        {
            meta.entry("namespace")
                .or_insert_with(|| Json::from(namespace.clone()));
        }
        let delete = request.operation == Operation::Delete;
        let object_key = (
            request.kind.kind.clone(),
            namespace.clone(),
            name.clone(),
            delete,
        );
        let cache = self.cache.clone();
        let store_name = store.name.clone();
        let generation = config.generation;
        let rendered = tokio::task::spawn_blocking(move || {
            let state = cache.blocking_read();
            let Some(running) = state.config.as_ref().filter(|c| c.generation == generation) else {
                return Err(Verdict::Unjudged(
                    "the config changed during the review".to_owned(),
                ));
            };
            let change = if delete {
                Change::Remove {
                    namespace: &namespace,
                    name: &name,
                }
            } else {
                Change::Apply(&object)
            };
            let overlay = state
                .stores
                .overlay(&store_name, change)
                .map_err(|e| Verdict::Denied(e.to_string()))?;
            match running.renderer.render_overlay_all(&state.stores, &overlay) {
                Ok(rendered) => Ok(rendered),
                Err(error) => {
                    let error = error.to_string();
                    // The same failure without the change is not this change's.
                    match running.renderer.render(&state.stores) {
                        Err(before) if before.to_string() == error => {
                            Err(Verdict::Allowed(vec![format!(
                                "the config fails to render already, without this change: {error}"
                            )]))
                        }
                        _ => Err(Verdict::Denied(format!(
                            "the config does not render with it: {error}"
                        ))),
                    }
                }
            }
        })
        .await;
        let (files, requests) = match rendered {
            Ok(Ok(rendered)) => rendered,
            Ok(Err(Verdict::Denied(why))) => return Verdict::Denied(format!("{what}: {why}")),
            Ok(Err(other)) => return other,
            Err(error) => return Verdict::Unjudged(format!("the render panicked: {error}")),
        };
        if let Some(verdict) = self.check_set(what, &files, Some(config)).await {
            return verdict;
        }
        match self.config_tests(config).await {
            // What the Gateway API answers with status rather than a refusal is reported.
            Ok(()) if request.resource.group == gateway::GROUP => {
                Verdict::Allowed(gateway::warnings(what, &object_key, &requests.statuses))
            }
            Ok(()) => Verdict::Allowed(Vec::new()),
            Err(failures) => Verdict::Denied(format!(
                "{what}: the config's validation tests fail: {failures}"
            )),
        }
    }

    /// The policy and `haproxy -c` on a set; `None` when it passes. With the running config
    /// (a resource's review), what passed before for it is not checked again ([`checked`]),
    /// and a refusal that the stores' own set (without the change) gets too is let through
    /// with a warning.
    async fn check_set(
        &self,
        what: &str,
        files: &FileSet,
        running: Option<&ValidatedConfig>,
    ) -> Option<Verdict> {
        let checker = &self.settings.checker;
        // The policy reads the files only.
        let set = RenderedSet {
            files: files.clone(),
            checksum: String::new(),
            config_generation: 0,
            term: SystemTime::now(),
            render_time: Duration::ZERO,
            requests: Default::default(),
            span: tracing::Span::none(),
            provenance: Default::default(),
        };
        // It reads every line: off the async threads, like the render (a panic refuses).
        let policy = checker.policy.clone();
        let checked = tokio::task::spawn_blocking(move || render_gate::policy_check(&policy, &set))
            .await
            .unwrap_or_else(|panic| Err(format!("the config policy check failed: {panic}")));
        if let Err(refusal) = checked {
            return Some(Verdict::Denied(format!(
                "{what}: the config rendered with it breaks the config policy: {refusal}"
            )));
        }
        let Some(haproxy) = checker.haproxy.as_ref() else {
            return Some(Verdict::Unjudged(
                "no haproxy binary to check with".to_owned(),
            ));
        };
        let key = running.map(|c| (c.generation, c.resource_version.clone()));
        // Comparing the set with what passed reads every crt-list line: a blocking thread's
        // work, not an async one's (a burst of reviews would starve the Lease renewals).
        let reduced = match key.clone() {
            None => None,
            Some(key) => {
                let (memo, files) = (self.checked.clone(), files.clone());
                tokio::task::spawn_blocking(move || {
                    let memo = memo
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    memo.as_ref()
                        .filter(|(seen, _)| *seen == key)
                        .and_then(|(_, checked)| checked.reduce(&files))
                })
                .await
                .unwrap_or(None)
            }
        };
        let mut outcome =
            render_gate::check_files(haproxy, reduced.as_ref().unwrap_or(files)).await;
        // A reduced set refused is checked whole before anything is denied.
        if reduced.is_some() && matches!(outcome, Err(CheckError::Refused(_))) {
            outcome = render_gate::check_files(haproxy, files).await;
        }
        match outcome {
            Ok(()) => {
                if let Some(key) = key {
                    let (memo, files) = (self.checked.clone(), files.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        let mut memo = memo
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        if memo.as_ref().is_none_or(|(seen, _)| *seen != key) {
                            *memo = Some((key, checked::Checked::default()));
                        }
                        if let Some((_, checked)) = memo.as_mut() {
                            checked.record(&files);
                        }
                    })
                    .await;
                }
                None
            }
            Err(CheckError::CannotRun(error)) => Some(Verdict::Unjudged(error)),
            Err(CheckError::Refused(output)) => {
                let alert = render_gate::alert_line(&output).to_owned();
                if running.is_some() && self.stores_refused_too(haproxy, &alert).await {
                    return Some(Verdict::Allowed(vec![format!(
                        "HAProxy refuses the config already, without this change: {alert}"
                    )]));
                }
                Some(Verdict::Denied(format!(
                    "{what}: HAProxy refuses the config rendered with it: {alert}"
                )))
            }
        }
    }

    /// Whether the stores' own set, without the change, gets the same alert.
    async fn stores_refused_too(&self, haproxy: &std::path::Path, alert: &str) -> bool {
        let cache = self.cache.clone();
        let before = tokio::task::spawn_blocking(move || {
            let state = cache.blocking_read();
            state
                .config
                .as_ref()
                .map(|c| c.renderer.render(&state.stores))
        })
        .await;
        let Ok(Some(Ok(files))) = before else {
            return false;
        };
        matches!(
            render_gate::check_files(haproxy, &files).await,
            Err(CheckError::Refused(output)) if render_gate::alert_line(&output) == alert
        )
    }

    /// The config's validation tests, run once per config version.
    async fn config_tests(&self, config: &ValidatedConfig) -> Result<(), String> {
        if config.spec.validation_tests.is_empty() {
            return Ok(());
        }
        let key = (config.generation, config.resource_version.clone());
        let mut memo = self.tests.lock().await;
        if let Some((seen, result)) = &*memo
            && *seen == key
        {
            return result.clone();
        }
        let result = run_tests(config, &self.settings.checker).await;
        *memo = Some((key, result.clone()));
        result
    }

    async fn review_config(&self, what: &str, object: Json) -> Verdict {
        let htc: HAProxyTemplateConfig = match serde_json::from_value(object) {
            Ok(htc) => htc,
            Err(error) => return Verdict::Denied(format!("{what}: {error}")),
        };
        let generation = htc.metadata.generation.unwrap_or(0);
        let rv = htc.metadata.resource_version.clone().unwrap_or_default();
        let cache = self.cache.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let config = config::validate(&htc.spec, generation, &rv)?;
            // Rendered against the replica's stores when they are the ones this config
            // watches (same stores and derived views), else with empty stores.
            let state = cache.blocking_read();
            let same_stores = state.config.as_ref().is_some_and(|running| {
                running.stores == config.stores && running.derivations == config.derivations
            });
            let rendered = if same_stores && state.ready() {
                config.renderer.render(&state.stores)
            } else {
                config.renderer.render(&config.empty_stores())
            };
            drop(state);
            let files = rendered.map_err(|e| vec![e.to_string()])?;
            Ok::<_, Vec<String>>((config, files))
        })
        .await;
        let (config, files) = match checked {
            Ok(Ok(done)) => done,
            Ok(Err(errors)) => return Verdict::Denied(format!("{what}: {}", errors.join("; "))),
            Err(error) => return Verdict::Unjudged(format!("the check panicked: {error}")),
        };
        if let Some(verdict) = self.check_set(what, &files, None).await {
            return verdict;
        }
        match run_tests(&config, &self.settings.checker).await {
            Ok(()) => Verdict::Allowed(Vec::new()),
            Err(failures) => Verdict::Denied(format!("{what}: validation tests fail: {failures}")),
        }
    }
}

/// Every test of the config; the failures joined.
async fn run_tests(config: &ValidatedConfig, checker: &Checker) -> Result<(), String> {
    match validation::run(config, None, checker).await {
        Ok(report) if report.passed() => Ok(()),
        Ok(report) => Err(report.failures().join("; ")),
        Err(error) => Err(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request() -> AdmissionRequest<DynamicObject> {
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": {"group": "networking.k8s.io", "version": "v1", "kind": "Ingress"},
                "resource": {"group": "networking.k8s.io", "version": "v1", "resource": "ingresses"},
                "name": "web", "namespace": "shop", "operation": "CREATE",
                "userInfo": {"username": "u"},
                "object": {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "web", "namespace": "shop"}},
            },
        }))
        .expect("review");
        review.try_into().expect("request")
    }

    /// A review that waits for a slot past its budget is answered by the failure policy, and
    /// the wait counted: it is not judged late.
    #[tokio::test(start_paused = true)]
    async fn a_review_queued_past_its_budget_gets_the_failure_policy() {
        let hook = Arc::new(Webhook {
            cache: StateCache::new(),
            settings: WebhookSettings {
                addr: SocketAddr::from(([127, 0, 0, 1], 0)),
                cert: PathBuf::new(),
                key: PathBuf::new(),
                checker: Checker {
                    haproxy: None,
                    policy: Default::default(),
                },
                budget: Duration::from_secs(2),
                failure_policy: FailurePolicy::Fail,
                max_connections: 4,
                max_concurrent_reviews: 1,
            },
            tests: tokio::sync::Mutex::new(None),
            checked: Arc::new(std::sync::Mutex::new(None)),
            slots: Semaphore::new(1),
        });
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": {"group": "networking.k8s.io", "version": "v1", "kind": "Ingress"},
                "resource": {"group": "networking.k8s.io", "version": "v1", "resource": "ingresses"},
                "name": "web", "namespace": "shop", "operation": "CREATE",
                "userInfo": {"username": "u"},
                "object": {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "web", "namespace": "shop"}},
            },
        }))
        .expect("body");
        // Every slot is taken (a long review in flight).
        let held = hook.slots.acquire().await.expect("slot");
        let response = validate(State(hook.clone()), Bytes::from(body.clone())).await;
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let review: Json = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(review["response"]["allowed"], false, "{review}");
        let message = review["response"]["status"]["message"]
            .as_str()
            .expect("message");
        assert!(
            message.contains("waited for one of the 1 review slots past its budget")
                && message.contains("(failure policy: fail)"),
            "{message}"
        );
        // With the slot free, the same review is judged (no config loaded yet: let through).
        drop(held);
        let response = validate(State(hook), Bytes::from(body)).await;
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let review: Json = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(review["response"]["allowed"], true, "{review}");
    }

    #[test]
    fn verdicts_map_to_answers_and_outcomes_by_the_failure_policy() {
        let req = request();
        let (r, o) = answer(
            &req,
            Verdict::Denied("Ingress shop/web: no".into()),
            FailurePolicy::Ignore,
        );
        assert!(!r.allowed);
        assert_eq!(
            (r.result.code, r.result.message.as_str()),
            (403, "Ingress shop/web: no")
        );
        assert_eq!(
            (o.gvk.as_str(), o.result),
            ("networking.k8s.io/v1/Ingress", "denied")
        );
        let (r, o) = answer(
            &req,
            Verdict::Unjudged("past the budget".into()),
            FailurePolicy::Fail,
        );
        assert!(!r.allowed);
        assert!(
            r.result
                .message
                .contains("past the budget (failure policy: fail)")
        );
        assert_eq!(o.result, "unjudged_denied");
        let (r, o) = answer(
            &req,
            Verdict::Unjudged("past the budget".into()),
            FailurePolicy::Ignore,
        );
        assert!(r.allowed);
        assert!(
            r.warnings
                .is_some_and(|w| w[0].contains("(failure policy: ignore)"))
        );
        assert_eq!(o.result, "unjudged_allowed");
        let (r, o) = answer(&req, Verdict::Allowed(Vec::new()), FailurePolicy::Fail);
        assert!(r.allowed && r.warnings.is_none());
        assert_eq!((r.uid.as_str(), o.result), ("u1", "allowed"));
    }
}
