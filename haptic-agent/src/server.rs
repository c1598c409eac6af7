//! The HTTP API: `/v1/apply`, `/v1/state` and `/v1/journal` behind the bearer token, and the open probes
//! `/healthz`, `/readyz` and `/metrics`.
//!
//! Connections are bounded so that nobody without the token can starve an apply: at most
//! `max_connections` at once (one more is closed at once), each closed when it takes longer
//! than `header_read_timeout` to send a request's headers or stays idle that long between
//! requests, and a request body (after the token was checked) must arrive within
//! `body_timeout`.

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, RawQuery, Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use haptic_agent_client::protocol::{
    APPLY_PATH, DELTA_PATH, ErrorBody, STATE_PATH, WireApply, WireDelta, decode_apply, decode_delta,
};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::agent::{self, Agent};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Serving failed.
    #[error("serving the agent API")]
    Serve(#[source] std::io::Error),
    /// The TLS certificate or key is unusable.
    #[error(transparent)]
    Tls(#[from] crate::tls::Error),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn json(status: StatusCode, body: &impl serde::Serialize) -> Response {
    // Serializing the protocol's plain structs cannot fail.
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    json(
        status,
        &ErrorBody {
            error: code.to_owned(),
            message: message.into(),
        },
    )
}

/// The router of `agent`'s API.
pub fn router(agent: Agent) -> Router {
    let token = Arc::new(Token::new(
        &agent.config().token,
        agent.config().token_file.clone(),
    ));
    let (limit, body_timeout) = (agent.config().max_body_bytes, agent.config().body_timeout);
    let protected = Router::new()
        .route(APPLY_PATH, post(apply))
        .route(DELTA_PATH, post(apply_delta))
        .route(STATE_PATH, get(state))
        .route(crate::journal::JOURNAL_PATH, get(journal))
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            read_body(limit, body_timeout, request, next)
        }))
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            authorize(token.expected(), request, next)
        }));
    probes().merge(protected).with_state(agent)
}

/// The open routes: `/healthz`, `/readyz`, `/metrics` (no token; nothing secret in them).
fn probes() -> Router<Agent> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

/// Serves the open routes in plain HTTP on `addr` until `shutdown`: the kubelet's probes and a
/// Prometheus scrape cannot present the client certificate the API's mutual TLS requires.
async fn serve_probes(
    agent: Agent,
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    info!(%addr, "probes and metrics listening (plain HTTP)");
    let app = probes().with_state(agent);
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    }))
}

/// The token's file version: inode, modification time, length.
type FileVersion = Option<(u64, std::time::SystemTime, u64)>;

fn file_version(path: &std::path::Path) -> FileVersion {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.ino(), meta.modified().ok()?, meta.len()))
}

/// The expected token's digest, read again from its file (when there is one) at the first
/// request after the file changed: a rotated token needs no restart.
struct Token {
    file: Option<std::path::PathBuf>,
    current: std::sync::Mutex<(FileVersion, [u8; 32])>,
}

impl Token {
    fn new(token: &str, file: Option<std::path::PathBuf>) -> Self {
        let seen = file.as_deref().and_then(file_version);
        Self {
            file,
            current: std::sync::Mutex::new((seen, Sha256::digest(token.trim().as_bytes()).into())),
        }
    }

    fn expected(&self) -> [u8; 32] {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(file) = &self.file else {
            return current.1;
        };
        let now = file_version(file);
        if now.is_some() && now != current.0 {
            match std::fs::read_to_string(file) {
                Ok(text) if !text.trim().is_empty() => {
                    info!(file = %file.display(), "the token file changed; the new token is in use");
                    *current = (now, Sha256::digest(text.trim().as_bytes()).into());
                }
                Ok(_) => {
                    warn!(file = %file.display(), "the token file changed but is empty; keeping the previous token")
                }
                Err(error) => {
                    warn!(file = %file.display(), %error, "the token file changed but cannot be read; keeping the previous token")
                }
            }
        }
        current.1
    }
}

/// Compares the bearer token in constant time: both sides are hashed first, so neither the
/// content nor the length of the expected token leaks through timing.
async fn authorize(expected: [u8; 32], request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes())
        // The scheme is case-insensitive (RFC 9110); the token is not.
        .and_then(|value| {
            (value.len() > 7 && value[..7].eq_ignore_ascii_case(b"bearer ")).then(|| &value[7..])
        })
        .map(|token| Sha256::digest(token.trim_ascii()));
    match presented {
        Some(digest) if bool::from(digest.as_slice().ct_eq(&expected)) => next.run(request).await,
        _ => error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required",
        ),
    }
}

/// Reads the whole body within `timeout` (408 otherwise) and at most `limit` bytes (413), so a
/// client that sends it slowly holds no apply slot and no handler.
async fn read_body(limit: usize, timeout: Duration, request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the body is larger than {limit} bytes"),
        );
    }
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Ok(Err(failure)) => {
            let too_large = std::error::Error::source(&failure)
                .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
            if too_large {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    format!("the body is larger than {limit} bytes"),
                )
            } else {
                error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    "the body could not be read",
                )
            }
        }
        Err(_) => error(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the body did not arrive within {timeout:?}"),
        ),
    }
}

/// What a body decodes to.
enum Decoded {
    Whole(haptic_agent_client::ApplyRequest),
    Delta(haptic_agent_client::DeltaRequest),
}

async fn apply(State(agent): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    handle(agent, headers, body, |body, gzip, limit| {
        decode_apply(body, gzip, limit)
            .and_then(WireApply::into_request)
            .map(Decoded::Whole)
    })
    .await
}

async fn apply_delta(State(agent): State<Agent>, headers: HeaderMap, body: Bytes) -> Response {
    handle(agent, headers, body, |body, gzip, limit| {
        decode_delta(body, gzip, limit)
            .and_then(WireDelta::into_delta)
            .map(Decoded::Delta)
    })
    .await
}

async fn handle(
    agent: Agent,
    headers: HeaderMap,
    body: Bytes,
    decode: impl FnOnce(&[u8], bool, usize) -> haptic_agent_client::protocol::Result<Decoded>
    + Send
    + 'static,
) -> Response {
    // Content codings are case-insensitive (RFC 9110 8.4.1).
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .map(|value| value.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let gzip = match encoding.as_deref() {
        None | Some("identity") => false,
        Some("gzip" | "x-gzip") => true,
        Some(other) => {
            agent.metrics().count_apply("rejected");
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "bad_encoding",
                format!("unsupported Content-Encoding {other:?}"),
            );
        }
    };
    let limit = agent.config().max_inflated_bytes;
    // Inflating, parsing and hashing a large set is CPU work: keep it off the I/O threads,
    // and at most one per core at once.
    let Ok(_decoding) = agent.decode_slots().acquire().await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "shutting down",
        );
    };
    let decoded = tokio::task::spawn_blocking(move || decode(&body, gzip, limit)).await;
    let request = match decoded {
        Ok(Ok(request)) => request,
        Ok(Err(refusal)) => {
            agent.metrics().count_apply("rejected");
            let status = match refusal {
                haptic_agent_client::protocol::Error::TooLarge { .. } => {
                    StatusCode::PAYLOAD_TOO_LARGE
                }
                _ => StatusCode::BAD_REQUEST,
            };
            return error(status, "bad_request", refusal.to_string());
        }
        Err(join) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                join.to_string(),
            );
        }
    };
    let answer = match request {
        Decoded::Whole(request) => agent.apply(request).await,
        Decoded::Delta(delta) => agent.apply_delta(delta).await,
    };
    match answer {
        Ok(response) => json(
            StatusCode::from_u16(response.status()).unwrap_or(StatusCode::OK),
            &response,
        ),
        Err(agent::Error::NotReady(reason)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, "not_ready", reason)
        }
        Err(refusal @ agent::Error::BadRequest(_)) => {
            error(StatusCode::BAD_REQUEST, "bad_request", refusal.to_string())
        }
        Err(failure) => {
            warn!(error = %failure, "apply failed");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                failure.to_string(),
            )
        }
    }
}

async fn state(State(agent): State<Agent>) -> Response {
    json(StatusCode::OK, &agent.state().await)
}

async fn journal(State(agent): State<Agent>, RawQuery(query): RawQuery) -> Response {
    match crate::journal::Since::from_query(query.as_deref().unwrap_or_default()) {
        Ok(since) => json(StatusCode::OK, &agent.journal().view_of(&since)),
        Err(message) => error(StatusCode::BAD_REQUEST, "bad_query", message),
    }
}

async fn readyz(State(agent): State<Agent>) -> Response {
    match agent.readiness().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(agent): State<Agent>) -> Response {
    match agent.config().exposition.as_ref().map(|e| e.render()) {
        Some(Ok(text)) => {
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
        }
        Some(Err(why)) => error(StatusCode::INTERNAL_SERVER_ERROR, "metrics", why),
        None => error(
            StatusCode::NOT_FOUND,
            "no_metrics",
            "this agent was started without a metrics exporter",
        ),
    }
}

/// Serves `agent` on `listener` until `shutdown` is cancelled; in supervised mode starts
/// HAProxy on the live set first and stops it last. Requests in flight get `drain` to
/// finish after the shutdown begins.
pub async fn serve(
    agent: Agent,
    listener: TcpListener,
    shutdown: CancellationToken,
    drain: Duration,
) -> Result<()> {
    if let Err(error) = agent.start_haproxy_if_live().await {
        warn!(%error, "HAProxy not started");
    }
    // The watcher stops with the server, also when serving fails before any shutdown.
    let stop_watch = shutdown.child_token();
    let watcher = agent
        .supervisor()
        .cloned()
        .map(|supervisor| tokio::spawn(supervisor.watch(stop_watch.clone())));
    let tls = match agent
        .config()
        .tls
        .as_ref()
        .map(crate::tls::acceptor)
        .transpose()
    {
        Ok(tls) => tls,
        Err(error) => {
            stop_watch.cancel();
            if let Some(watcher) = watcher {
                let _ = watcher.await;
            }
            return Err(error.into());
        }
    };
    let probes = match agent.config().probe_listen {
        Some(addr) => match serve_probes(agent.clone(), addr, shutdown.clone()).await {
            Ok(task) => Some(task),
            Err(error) => {
                stop_watch.cancel();
                if let Some(watcher) = watcher {
                    let _ = watcher.await;
                }
                return Err(Error::Serve(error));
            }
        },
        None => None,
    };
    info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), "agent listening");
    let limits = haptic_serve::Limits {
        max_connections: agent.config().max_connections,
        header_read_timeout: agent.config().header_read_timeout,
        drain,
    };
    haptic_serve::serve(listener, tls, router(agent.clone()), limits, shutdown).await;
    if let Some(probes) = probes {
        let _ = tokio::time::timeout(Duration::from_secs(1), probes).await;
    }
    stop_watch.cancel();
    match watcher {
        Some(watcher) => {
            let _ = watcher.await;
        }
        None => {
            if let Some(supervisor) = agent.supervisor() {
                supervisor.stop().await;
            }
        }
    }
    Ok(())
}
