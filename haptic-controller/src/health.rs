//! The health server: `/healthz` (the process serves, its elector is healthy and no component
//! failed beyond repair) and `/readyz`
//! (a config is loaded and every store finished its first list; a follower is ready too: it
//! keeps the hot cache a failover needs), and `/metrics` when the binary gave an exporter.

use std::{
    net::SocketAddr,
    sync::{Arc, OnceLock},
};

use axum::{Router, extract::State, http::StatusCode, routing::get};
use haptic_election::HealthCheck;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::state::StateCache;

/// What the probes read.
#[derive(Debug, Default)]
pub struct Probes {
    /// The state cache.
    pub cache: Arc<StateCache>,
    /// The elector's check, once the elector exists.
    pub election: OnceLock<HealthCheck>,
    /// The components' supervision: unhealthy once a component failed in a way only a
    /// restart repairs.
    pub components: OnceLock<Arc<haptic_leadership::LeadershipMetrics>>,
    /// What `/metrics` serves (none: 404).
    pub metrics: Option<crate::metrics::Exposition>,
}

/// Binds `addr` and serves the probes until `token` fires. Returns the bound address (for
/// `:0`) once listening.
pub async fn serve(
    addr: SocketAddr,
    probes: Arc<Probes>,
    token: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    info!(addr = %bound, "health server listening");
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(probes);
    let handle = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { token.cancelled().await })
            .await;
    });
    Ok((bound, handle))
}

async fn healthz(State(probes): State<Arc<Probes>>) -> (StatusCode, String) {
    let components = probes.components.get().map(|c| c.health());
    match (probes.election.get().map(HealthCheck::check), components) {
        (Some(Err(why)), _) | (_, Some(Err(why))) => (StatusCode::SERVICE_UNAVAILABLE, why),
        _ => (StatusCode::OK, "ok".to_owned()),
    }
}

async fn metrics(State(probes): State<Arc<Probes>>) -> axum::response::Response {
    use axum::{http::header, response::IntoResponse};
    match probes
        .metrics
        .as_ref()
        .map(crate::metrics::Exposition::render)
    {
        Some(Ok(text)) => {
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
        }
        Some(Err(why)) => (StatusCode::INTERNAL_SERVER_ERROR, why).into_response(),
        None => (StatusCode::NOT_FOUND, "no metrics exporter in this process").into_response(),
    }
}

async fn readyz(State(probes): State<Arc<Probes>>) -> (StatusCode, String) {
    let state = probes.cache.read().await;
    if state.config.is_none() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "no valid config loaded yet".to_owned(),
        );
    }
    if !state.unsynced.is_empty() {
        let waiting: Vec<&str> = state.unsynced.iter().map(String::as_str).collect();
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("waiting for the first list of: {}", waiting.join(", ")),
        );
    }
    (StatusCode::OK, "ready".to_owned())
}
