//! The agent apply protocol of HAPTIC and its HTTP client.
//!
//! A leader pushes a whole HAProxy file set to the agent beside every HAProxy pod. Each apply
//! carries the leader's fencing epoch, identity, a generation and the set's checksum; the
//! agent refuses an epoch below its fence. [`protocol`] holds the wire types, the checksum
//! and the path rules both sides enforce; [`client`] holds the HTTP client (reqwest with
//! rustls on `ring`, bearer token, timeouts, retries of transport failures and 503 only,
//! typed errors, parallel fan-out); [`policy`] holds the config policy (no Lua, programs,
//! external checks or files outside the set unless the operator allows them) that the
//! controller's render gate and the agent both apply; [`tls`] holds the channel's mutual TLS
//! (rotating certificates, keys and CA bundles read from files) and the listener config every
//! HTTPS server of the project uses.
//!
//! ```
//! use haptic_agent_client::{AgentClient, ApplyRequest, ClientConfig, FileSet};
//!
//! let files = FileSet::new()
//!     .with("haproxy.cfg", "global\ndefaults\n  mode http\n")?
//!     .with("maps/hosts.map", "example.com be_example\n")?;
//! let request = ApplyRequest::new(7, "haptic-0", 1, files)?;
//! assert!(request.checksum.starts_with("v2-"));
//!
//! let client = AgentClient::new(ClientConfig::new("secret-token"))?;
//! let prepared = client.prepare(&request); // encoded once, sent to every pod
//! assert!(prepared.wire_len() > 0);
//! // client.fan_out(&targets, &request).await returns one result per pod.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod client;
pub mod hitless;
pub mod policy;
pub mod protocol;
pub mod tls;

pub use client::{AgentClient, ApplyReport, ClientConfig, Error, Outcome, PodResult, Target};
pub use policy::{Policy, PolicyError, Roles, Violation};
pub use protocol::{AgentState, ApplyRequest, ApplyResponse, DeltaRequest, FileSet, Form, Timing};
