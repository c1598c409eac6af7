//! What the project's HTTP listeners share: the accept loop ([`serve`]) the agent's API and the
//! controller's admission webhook run (a connection cap, deadlines for the TLS handshake, the
//! request headers and idle keep-alive, a graceful drain), and the Prometheus exposition both
//! binaries serve on `/metrics` ([`Exposition`], [`prometheus_exporter`]).
//!
//! TLS configuration is not here: the listeners take a `tokio_rustls::TlsAcceptor` built from
//! `haptic_agent_client::tls::server_config` (rotating certificates, mutual TLS), so this crate
//! needs no TLS policy of its own.
//!
//! ```no_run
//! use std::time::Duration;
//! use haptic_serve::{Limits, serve};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run() -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let app = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
//! let shutdown = CancellationToken::new();
//! serve(listener, None, app, Limits::default(), shutdown).await;
//! # Ok(())
//! # }
//! ```

mod accept;
mod exposition;

pub use accept::{Limits, serve};
pub use exposition::{ExporterError, Exposition, prometheus_exporter};
