//! The HAPTIC agent: it runs beside HAProxy and applies the file sets the leader pushes,
//! fenced, validated and atomic.
//!
//! - [`config`]: the agent's settings.
//! - [`fence`]: the durable fence (highest epoch accepted), write + fsync + rename.
//! - [`store`]: the data directory: staging, sets, `current` and `last-known-good` symlinks.
//! - [`haproxy`]: `haproxy -c`, the master CLI, reload with confirmation.
//! - [`supervisor`]: the mode that starts HAProxy itself (`-W -S <socket>`) and watches it.
//! - [`agent`]: the apply engine; one apply at a time, rollback on a failed load.
//! - [`runtime`]: hitless applies: server, map and certificate changes through HAProxy's
//!   runtime API, verified, with no reload.
//! - [`metrics`]: the instruments, recorded through the OpenTelemetry API (the binary serves them).
//! - [`journal`]: the bounded, durable record of the applies answered (`/v1/journal`).
//! - [`server`]: the HTTP API (`/v1/apply`, `/v1/state`, `/v1/journal`, `/healthz`, `/readyz`, `/metrics`).
//! - [`thp`]: transparent huge pages off for the agent's memory, not for HAProxy's.
//! - [`tls`]: the listener's TLS, mutual by default in the binary (a client certificate from
//!   `--client-ca` required); certificate, key and client CA read again when they change.
//!
//! The wire types live in `haptic-agent-client`.
//!
//! ```
//! use haptic_agent::{Agent, AgentConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let data = std::env::temp_dir().join(format!("haptic-agent-doc-{}", std::process::id()));
//! let agent = Agent::open(AgentConfig::new(&data, "secret-token")).await?;
//! // A fresh agent has no live set and fence 0; it is ready to take the first apply.
//! let state = agent.state().await;
//! assert_eq!(state.live_checksum, None);
//! assert_eq!(state.fence, Some(0));
//! assert!(agent.readiness().await.is_ok());
//! // haptic_agent::server::serve(agent, listener, shutdown, drain) serves the API.
//! # std::fs::remove_dir_all(&data)?;
//! # Ok(())
//! # }
//! ```

pub mod agent;
pub mod config;
pub mod fence;
pub mod haproxy;
pub mod journal;
pub mod metrics;
pub mod runtime;
pub mod server;
pub mod store;
pub mod supervisor;
pub mod thp;
pub mod tls;

pub use agent::Agent;
pub use config::AgentConfig;
pub use server::{router, serve};
