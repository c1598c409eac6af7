//! The HTTP client of the agent protocol: timeouts, bounded retries with jitter, typed errors
//! and a parallel fan-out with a concurrency bound.

use std::{sync::Arc, time::Duration};

use futures::{StreamExt as _, stream};
use reqwest::{StatusCode, Url, header};
use tokio::time::Instant;
use tracing::{debug, instrument, warn};

use crate::protocol::{
    APPLY_PATH, AgentState, ApplyRequest, ApplyResponse, DELTA_PATH, DeltaRequest, EncodedBody,
    ErrorBody, STATE_PATH, Timing, encode_apply, encode_delta,
};

/// Errors of the client. Refusals (`Fenced`, `Superseded`, `Invalid`, `RefusedByPolicy`, `RolledBack`,
/// `BaseMismatch`, `DeltasUnsupported`, `Unauthorized`, `Rejected`) are never retried; `Unavailable` and `Transport` are returned once the
/// retries are spent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agent's fence is above our epoch, or equal to it and held by another leader
    /// identity: another leader took over, or our epoch counter regressed. Hand `fence` to
    /// the epoch's `reclaim`.
    #[error("fenced: the agent accepted epoch {fence} (ours: {epoch}) from another leader")]
    Fenced {
        /// The agent's fence.
        fence: u64,
        /// The epoch we sent.
        epoch: u64,
    },
    /// A newer generation of the same epoch is live on the agent: this set is stale and was
    /// not applied. Not retried; the sender should push its newest set instead.
    #[error("superseded: generation {live_generation} is live, above ours ({generation})")]
    Superseded {
        /// The generation we sent.
        generation: u64,
        /// The generation live on the agent.
        live_generation: u64,
    },
    /// `haproxy -c` refused the set; the agent's live set is untouched.
    #[error("HAProxy refused the set: {check_output}")]
    Invalid {
        /// HAProxy's own output.
        check_output: String,
    },
    /// The agent's config policy refused the set (422 `refused_by_policy`): it would run a
    /// program or read a file outside the set. Nothing was written; not retried. The
    /// controller runs the same [`crate::policy::Policy::check`] before it sends a set.
    #[error("the agent's config policy refused the set: {}", violations.first().map(ToString::to_string).unwrap_or_default())]
    RefusedByPolicy {
        /// The violations the agent listed (at most `protocol::MAX_VIOLATIONS`).
        violations: Vec<crate::policy::Violation>,
        /// How many more it found.
        more: usize,
    },
    /// The set failed to load; the agent restored its last-known-good set.
    #[error("reload failed and was rolled back (live: {live_checksum:?}): {reason}")]
    RolledBack {
        /// The checksum live on the agent now.
        live_checksum: Option<String>,
        /// Why the load failed.
        reason: String,
    },
    /// A delta named a base that is not the agent's live set (412 `base_mismatch`): nothing
    /// was written; send the whole set.
    #[error("the agent does not hold the delta's base (live: {live_checksum:?})")]
    BaseMismatch {
        /// The checksum live on the agent.
        live_checksum: Option<String>,
    },
    /// The agent does not know the delta endpoint (404 or 405: an agent older than deltas):
    /// send it whole sets.
    #[error("the agent does not take deltas ({status})")]
    DeltasUnsupported {
        /// HTTP status.
        status: u16,
    },
    /// The agent refused our bearer token (401).
    #[error("the agent refused the bearer token")]
    Unauthorized,
    /// The agent refused the request as malformed or too large (4xx other than 401 and 409).
    #[error("the agent refused the request ({status}): {message}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// The agent's message.
        message: String,
    },
    /// The agent kept answering 503 (not ready, shutting down) until the retries ran out.
    #[error("the agent is unavailable after {attempts} attempts: {message}")]
    Unavailable {
        /// Attempts made.
        attempts: u32,
        /// The agent's last message.
        message: String,
    },
    /// Connecting, sending or receiving failed (timeouts included) on every attempt.
    #[error("transport failure after {attempts} attempts")]
    Transport {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: reqwest::Error,
    },
    /// The agent answered with a status or body this protocol does not define.
    #[error("unexpected answer ({status}): {body}")]
    Unexpected {
        /// HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The endpoint URL cannot be joined with the protocol paths.
    #[error("invalid agent URL {url}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The configuration is invalid.
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// The HTTP client could not be built (TLS set-up, CA bundle).
    #[error("building the HTTP client")]
    Build(#[source] reqwest::Error),
}

/// Result type of the client.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Client settings. Build with [`ClientConfig::new`]; every field is public.
#[derive(Clone)]
pub struct ClientConfig {
    /// Bearer token sent on every request. Must not be empty.
    pub token: String,
    /// Limit for one whole request, connect to last byte (default 480 s). It must exceed the
    /// agent's own bound on an apply, or the client gives up (and retries) while the agent is
    /// still working: with the agent's default limits that bound is 475 s (30 s behind another
    /// apply, 5 s of runtime API commands, `haproxy -c` 60 s,
    /// then a load and possibly a rollback load of up to 60 s reload + 60 s waiting for an
    /// unfinished reload + a supervised restart (10 s graceful stop, 60 s start) each;
    /// `AgentConfig::apply_time_limit`).
    /// A normal apply takes about a second.
    pub request_timeout: Duration,
    /// Limit for connecting (default 2 s).
    pub connect_timeout: Duration,
    /// Attempts per request, the first included (default 4). Only transport failures and 503
    /// are retried.
    pub max_attempts: u32,
    /// Backoff before the second attempt (default 100 ms); doubles each time, with jitter.
    pub backoff_initial: Duration,
    /// Backoff ceiling (default 2 s).
    pub backoff_max: Duration,
    /// Bodies whose JSON is larger than this are gzipped (default 64 KiB).
    pub compress_threshold: usize,
    /// Most applies in flight at once in [`AgentClient::fan_out`] (default 16).
    pub concurrency: usize,
    /// PEM CA bundle trusted for `https` agents; none means the platform's roots. Ignored
    /// when [`ClientConfig::tls`] is set.
    pub ca_pem: Option<Vec<u8>>,
    /// The whole TLS configuration of the agent channel (default none): mutual TLS with
    /// rotating files, from [`crate::tls::client_config`].
    pub tls: Option<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("token", &"<redacted>")
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_attempts", &self.max_attempts)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("compress_threshold", &self.compress_threshold)
            .field("concurrency", &self.concurrency)
            .field("ca_pem", &self.ca_pem.as_ref().map(Vec::len))
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl ClientConfig {
    /// Defaults (documented on each field) with `token`.
    pub fn new(token: impl Into<String>) -> Self {
        Self {
            token: token.into(),
            request_timeout: Duration::from_secs(480),
            connect_timeout: Duration::from_secs(2),
            max_attempts: 4,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            compress_threshold: 64 << 10,
            concurrency: 16,
            ca_pem: None,
            tls: None,
        }
    }

    /// Sets [`ClientConfig::request_timeout`].
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets [`ClientConfig::max_attempts`] and [`ClientConfig::backoff_initial`].
    #[must_use]
    pub fn with_retries(mut self, max_attempts: u32, backoff_initial: Duration) -> Self {
        self.max_attempts = max_attempts;
        self.backoff_initial = backoff_initial;
        self
    }

    /// Sets [`ClientConfig::concurrency`].
    #[must_use]
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Sets [`ClientConfig::ca_pem`].
    #[must_use]
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Sets [`ClientConfig::tls`].
    #[must_use]
    pub fn with_tls(mut self, tls: rustls::ClientConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Checks the rules: token not empty and a valid header value, at least one attempt,
    /// non-zero timeouts and concurrency, backoff_initial <= backoff_max.
    pub fn validate(&self) -> Result<()> {
        let rule = |text: &str| Err(Error::Config(text.to_owned()));
        if self.token.is_empty() {
            return rule("token must not be empty");
        }
        if header::HeaderValue::from_str(&format!("Bearer {}", self.token)).is_err() {
            return rule("token must be visible ASCII");
        }
        if self.max_attempts == 0 {
            return rule("max_attempts must be at least 1");
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return rule("timeouts must be above zero");
        }
        if self.concurrency == 0 {
            return rule("concurrency must be at least 1");
        }
        if self.backoff_initial > self.backoff_max {
            return rule("backoff_initial must not exceed backoff_max");
        }
        Ok(())
    }
}

/// One agent to apply to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// A name for results and logs (the pod name).
    pub name: String,
    /// The agent's base URL, e.g. `http://10.0.0.7:9090/`.
    pub url: Url,
}

impl Target {
    /// A target from a name and a base URL string.
    pub fn new(name: impl Into<String>, url: &str) -> Result<Self> {
        let url = Url::parse(url).map_err(|error| Error::Url {
            url: url.to_owned(),
            reason: error.to_string(),
        })?;
        Ok(Self {
            name: name.into(),
            url,
        })
    }
}

/// A successful apply, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Whether the set went live now or was already live.
    pub outcome: Outcome,
    /// Checksum of the set live on the agent.
    pub checksum: String,
    /// The agent's time per phase.
    pub timing: Timing,
    /// Whether the agent reloaded HAProxy (false: applied through the runtime API, or
    /// unchanged).
    pub reload: bool,
    /// Runtime API commands the agent ran for this apply.
    pub runtime_ops: u64,
    /// Wall time the client spent, retries included.
    pub elapsed: Duration,
    /// Attempts made.
    pub attempts: u32,
}

/// What a successful apply did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Written, checked, swapped in and reloaded.
    Applied,
    /// Already live; nothing done.
    Unchanged,
}

/// The result of one pod in a fan-out.
#[derive(Debug)]
pub struct PodResult {
    /// The pod.
    pub target: Target,
    /// What happened there.
    pub result: Result<ApplyReport>,
}

/// An apply encoded once, to send to many agents.
#[derive(Debug, Clone)]
pub struct PreparedApply {
    epoch: u64,
    body: EncodedBody,
}

impl PreparedApply {
    /// Size of the body on the wire.
    pub fn wire_len(&self) -> usize {
        self.body.bytes.len()
    }

    /// Size of the JSON before compression.
    pub fn json_len(&self) -> usize {
        self.body.json_len
    }
}

/// A delta encoded once, to send to every agent that holds its base.
#[derive(Debug, Clone)]
pub struct PreparedDelta {
    epoch: u64,
    base: String,
    body: EncodedBody,
}

impl PreparedDelta {
    /// Size of the body on the wire.
    pub fn wire_len(&self) -> usize {
        self.body.bytes.len()
    }

    /// Checksum of the set the delta applies to.
    pub fn base(&self) -> &str {
        &self.base
    }
}

/// The agent client. Cheap to clone; clones share the connection pool.
#[derive(Debug, Clone)]
pub struct AgentClient {
    http: reqwest::Client,
    config: Arc<ClientConfig>,
    auth: header::HeaderValue,
}

impl AgentClient {
    /// A client with `config`, using rustls with the `ring` provider for `https` agents.
    pub fn new(config: ClientConfig) -> Result<Self> {
        config.validate()?;
        // reqwest is built without a bundled crypto provider; make ring the process default
        // unless the application already chose one (installing twice is refused, harmlessly).
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let mut builder = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            // Below the agent's idle limit (15 s), so a pooled connection is not reused just as
            // the agent closes it.
            .pool_idle_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .tls_backend_rustls();
        if let Some(tls) = &config.tls {
            builder = builder.tls_backend_preconfigured(tls.clone());
        } else if let Some(pem) = &config.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(Error::Build)?;
            builder = builder.tls_certs_only(certs);
        }
        let http = builder.build().map_err(Error::Build)?;
        let mut auth = header::HeaderValue::from_str(&format!("Bearer {}", config.token))
            .map_err(|_| Error::Config("token must be visible ASCII".to_owned()))?;
        auth.set_sensitive(true);
        Ok(Self {
            http,
            config: Arc::new(config),
            auth,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Encodes `request` once (JSON, gzip above the threshold) for [`AgentClient::apply_prepared`].
    pub fn prepare(&self, request: &ApplyRequest) -> PreparedApply {
        PreparedApply {
            epoch: request.epoch,
            body: encode_apply(&request.to_wire(), self.config.compress_threshold),
        }
    }

    /// Encodes `delta` once for [`AgentClient::apply_delta_prepared`].
    pub fn prepare_delta(&self, delta: &DeltaRequest) -> PreparedDelta {
        PreparedDelta {
            epoch: delta.epoch,
            base: delta.base.clone(),
            body: encode_delta(&delta.to_wire(), self.config.compress_threshold),
        }
    }

    /// Applies `delta` to the agent at `base` (see [`AgentClient::apply_delta_prepared`]).
    pub async fn apply_delta(&self, base: &Url, delta: &DeltaRequest) -> Result<ApplyReport> {
        self.apply_delta_prepared(base, &self.prepare_delta(delta))
            .await
    }

    /// Applies a prepared delta to the agent at `base`: the answers of
    /// [`AgentClient::apply_prepared`], plus [`Error::BaseMismatch`] when the agent's live set
    /// is not the delta's base and [`Error::DeltasUnsupported`] from an agent older than
    /// deltas. After either, send the whole set.
    #[instrument(skip(self, prepared), fields(agent = %base, epoch = prepared.epoch, delta_base = %prepared.base))]
    pub async fn apply_delta_prepared(
        &self,
        base: &Url,
        prepared: &PreparedDelta,
    ) -> Result<ApplyReport> {
        let url = join(base, DELTA_PATH)?;
        self.post_apply(url, &prepared.body).await
    }

    /// Applies `request` to the agent at `base`.
    pub async fn apply(&self, base: &Url, request: &ApplyRequest) -> Result<ApplyReport> {
        self.apply_prepared(base, &self.prepare(request)).await
    }

    /// Applies a prepared request to the agent at `base`, retrying transport failures and 503.
    #[instrument(skip(self, prepared), fields(agent = %base, epoch = prepared.epoch))]
    pub async fn apply_prepared(
        &self,
        base: &Url,
        prepared: &PreparedApply,
    ) -> Result<ApplyReport> {
        let url = join(base, APPLY_PATH)?;
        self.post_apply(url, &prepared.body).await
    }

    /// Posts an apply or delta body to `url` and reads the answer.
    async fn post_apply(&self, url: Url, encoded: &EncodedBody) -> Result<ApplyReport> {
        let started = Instant::now();
        let (status, body, attempts) = self
            .send_with_retries(|| {
                let mut request = self
                    .http
                    .post(url.clone())
                    .header(header::AUTHORIZATION, self.auth.clone())
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(encoded.bytes.clone());
                if encoded.gzip {
                    request = request.header(header::CONTENT_ENCODING, "gzip");
                }
                request
            })
            .await?;
        let elapsed = started.elapsed();
        match serde_json::from_slice::<ApplyResponse>(&body) {
            Ok(ApplyResponse::Applied {
                checksum,
                timing,
                reload,
                runtime_ops,
                ..
            }) if status == StatusCode::OK => Ok(ApplyReport {
                outcome: Outcome::Applied,
                checksum,
                timing,
                reload,
                runtime_ops,
                elapsed,
                attempts,
            }),
            Ok(ApplyResponse::Unchanged {
                checksum, timing, ..
            }) if status == StatusCode::OK => Ok(ApplyReport {
                outcome: Outcome::Unchanged,
                checksum,
                timing,
                reload: false,
                runtime_ops: 0,
                elapsed,
                attempts,
            }),
            Ok(ApplyResponse::Fenced { fence, epoch }) => Err(Error::Fenced { fence, epoch }),
            Ok(ApplyResponse::Superseded {
                generation,
                live_generation,
                ..
            }) => Err(Error::Superseded {
                generation,
                live_generation,
            }),
            Ok(ApplyResponse::Invalid { check_output, .. }) => Err(Error::Invalid { check_output }),
            Ok(ApplyResponse::RefusedByPolicy {
                violations, more, ..
            }) => Err(Error::RefusedByPolicy { violations, more }),
            Ok(ApplyResponse::RolledBack {
                live_checksum,
                reason,
                ..
            }) => Err(Error::RolledBack {
                live_checksum,
                reason,
            }),
            Ok(ApplyResponse::BaseMismatch { live_checksum, .. }) => {
                Err(Error::BaseMismatch { live_checksum })
            }
            _ if url.path() == DELTA_PATH
                && matches!(
                    status,
                    StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED
                ) =>
            {
                Err(Error::DeltasUnsupported {
                    status: status.as_u16(),
                })
            }
            _ => Err(refusal(status, &body)),
        }
    }

    /// Reads the agent's state.
    #[instrument(skip(self), fields(agent = %base))]
    pub async fn state(&self, base: &Url) -> Result<AgentState> {
        let url = join(base, STATE_PATH)?;
        let (status, body, _) = self
            .send_with_retries(|| {
                self.http
                    .get(url.clone())
                    .header(header::AUTHORIZATION, self.auth.clone())
            })
            .await?;
        if status != StatusCode::OK {
            return Err(refusal(status, &body));
        }
        serde_json::from_slice(&body).map_err(|_| refusal(status, &body))
    }

    /// An authorized GET of another path of the agent's API (`/v1/journal`, `/metrics`): the
    /// body of a 200 answer, over the same channel (TLS, token, retries) as the apply.
    pub async fn get_raw(&self, base: &Url, path: &str) -> Result<bytes::Bytes> {
        let url = join(base, path)?;
        let (status, body, _) = self
            .send_with_retries(|| {
                self.http
                    .get(url.clone())
                    .header(header::AUTHORIZATION, self.auth.clone())
            })
            .await?;
        if status != StatusCode::OK {
            return Err(refusal(status, &body));
        }
        Ok(body)
    }

    /// Applies `request` to every target in parallel, at most
    /// [`ClientConfig::concurrency`] at once, and returns one result per target in the order
    /// given. The body is encoded once. Dropping the future cancels the applies in flight.
    #[instrument(skip_all, fields(targets = targets.len(), epoch = request.epoch))]
    pub async fn fan_out(&self, targets: &[Target], request: &ApplyRequest) -> Vec<PodResult> {
        let prepared = self.prepare(request);
        let prepared = &prepared;
        let mut results: Vec<(usize, PodResult)> = stream::iter(targets.iter().enumerate())
            .map(|(index, target)| async move {
                let result = self.apply_prepared(&target.url, prepared).await;
                if let Err(error) = &result {
                    warn!(pod = %target.name, %error, "apply failed");
                }
                (
                    index,
                    PodResult {
                        target: target.clone(),
                        result,
                    },
                )
            })
            .buffer_unordered(self.config.concurrency)
            .collect()
            .await;
        results.sort_by_key(|(index, _)| *index);
        results.into_iter().map(|(_, result)| result).collect()
    }

    /// Sends the request `build` makes until it gets an answer that is not 503, or the
    /// attempts run out. Returns the status, the body and the attempts made.
    async fn send_with_retries(
        &self,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<(StatusCode, bytes::Bytes, u32)> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let last = attempt >= self.config.max_attempts;
            let outcome = match build().send().await {
                Ok(response) => {
                    let status = response.status();
                    response.bytes().await.map(|body| (status, body))
                }
                Err(error) => Err(error),
            };
            match outcome {
                Ok((status, body)) if status != StatusCode::SERVICE_UNAVAILABLE => {
                    return Ok((status, body, attempt));
                }
                Ok((_, body)) if last => {
                    return Err(Error::Unavailable {
                        attempts: attempt,
                        message: error_message(&body),
                    });
                }
                Err(source) if last => {
                    return Err(Error::Transport {
                        attempts: attempt,
                        source,
                    });
                }
                Ok(_) => debug!(attempt, "agent unavailable (503); retrying"),
                Err(error) => debug!(attempt, %error, "transport failure; retrying"),
            }
            tokio::time::sleep(backoff(
                attempt,
                self.config.backoff_initial,
                self.config.backoff_max,
            ))
            .await;
        }
    }
}

/// The pause after failed attempt `attempt` (1-based): exponential from `initial`, capped at
/// `max`, with "equal jitter" (half fixed, half random) so that many clients that failed
/// together do not retry together.
fn backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let exp = initial.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let capped = exp.min(max);
    let half = capped / 2;
    let jitter = rand::random_range(0..=half.as_micros().max(1) as u64);
    half + Duration::from_micros(jitter)
}

fn join(base: &Url, path: &str) -> Result<Url> {
    base.join(path).map_err(|error| Error::Url {
        url: base.to_string(),
        reason: error.to_string(),
    })
}

fn error_message(body: &[u8]) -> String {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(error) => error.message,
        Err(_) => String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    }
}

/// Maps an answer that is not a success into the error it means.
fn refusal(status: StatusCode, body: &[u8]) -> Error {
    match status.as_u16() {
        401 => Error::Unauthorized,
        code @ (400..=408 | 410..=499) => Error::Rejected {
            status: code,
            message: error_message(body),
        },
        code => Error::Unexpected {
            status: code,
            body: error_message(body),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 1..40 {
            let pause = backoff(attempt, initial, max);
            let ceiling = initial.saturating_mul(1 << (attempt - 1).min(16)).min(max);
            assert!(
                pause >= ceiling / 2 && pause <= ceiling,
                "{attempt}: {pause:?}"
            );
        }
        let distinct: std::collections::HashSet<_> =
            (0..20).map(|_| backoff(5, initial, max)).collect();
        assert!(distinct.len() > 1, "jitter varies the pause");
    }

    #[test]
    fn config_rules_are_named() {
        let error = ClientConfig::new("").validate().expect_err("empty token");
        assert!(error.to_string().contains("token"));
        let error = ClientConfig::new("t")
            .with_retries(0, Duration::from_millis(1))
            .validate()
            .expect_err("no attempts");
        assert!(error.to_string().contains("max_attempts"));
        ClientConfig::new("t")
            .validate()
            .expect("defaults are valid");
    }

    #[test]
    fn refusals_map_to_typed_errors() {
        assert!(matches!(
            refusal(StatusCode::UNAUTHORIZED, b""),
            Error::Unauthorized
        ));
        let body = br#"{"error":"bad_request","message":"path refused"}"#;
        match refusal(StatusCode::BAD_REQUEST, body) {
            Error::Rejected { status, message } => {
                assert_eq!(status, 400);
                assert_eq!(message, "path refused");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
