//! A Kubernetes API server stand-in over real HTTP, for tests and benchmarks.
//!
//! No cluster and no kube-apiserver binary run on the development machines, so every election,
//! fencing and failover claim of the project is measured against this server. It serves, on
//! 127.0.0.1 with a random port, the subset of the API the project uses, answering as
//! kube-apiserver does (see `KUBE-API-NOTES.md`): one global resourceVersion; GET, LIST with
//! label and field selectors, POST, PUT, PATCH (merge, JSON, a strategic-merge subset and an
//! approximation of server-side apply), DELETE with preconditions, `/status` subresources;
//! watches with bookmarks, timeouts and 410 Expired; `Status` errors formed as the real server
//! forms them; discovery documents; custom resources registered by creating a CRD.
//!
//! Each test client carries a bearer token naming it ([`ApiServer::client_for`]), so a test can
//! inject [`Fault`]s into one replica's traffic (latency, error answers, dropped connections,
//! hung requests or watches, a full partition) or cause a global [`ApiServer::outage`], and
//! read the per-client request accounting ([`ApiServer::request_counts`]).
//!
//! [`TestPki`] makes the throwaway CA and certificates of the agent channel's mutual TLS for
//! the tests, the demo and the fault campaign.
//!
//! # Example
//!
//! ```
//! use haptic_testkit::ApiServer;
//! use k8s_openapi::api::coordination::v1::Lease;
//! use kube::api::{Api, PostParams};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = ApiServer::start().await?;
//! let leases: Api<Lease> = Api::namespaced(server.client_for("replica-a")?, "default");
//! let mut lease = Lease::default();
//! lease.metadata.name = Some("example".into());
//! let created = leases.create(&PostParams::default(), &lease).await?;
//! assert!(created.metadata.resource_version.is_some());
//! assert_eq!(server.request_counts()[&("replica-a".into(), "create".into(), "leases.coordination.k8s.io".into())], 1);
//! server.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! Beside it, [`RealApiServer`] runs a real kube-apiserver v1.34 with etcd on loopback (RBAC,
//! ServiceAccount tokens; binaries from `cargo xtask envtest`), and [`TestApi`] lets one test
//! body run on either ([`Backend`]).
//!
//! What is approximated, by design: server-side apply is a JSON merge of the applied object
//! (no field ownership, `force` ignored); strategic merge patch merges lists of objects by
//! `name` (or `type`, `port`, ...) keys and honours `$patch: delete`; `limit`/`continue` paging
//! is not implemented (the whole list is one page, which the API allows) and lists are always
//! of the latest state; `fieldValidation` applies to POST and PUT of built-in types only; the
//! OpenAPI documents (served so kubectl validates on the server side) carry no schemas;
//! finalizers and graceful deletion are not modelled; deleting a namespace deletes its contents
//! at once. The crate's README lists the rest.

mod backend;
mod faults;
mod openapi;
pub mod pki;
mod ports;
pub mod real;
mod resources;
mod router;
mod selectors;
mod server;
mod status;
mod store;
mod validation;
mod watch;

pub use backend::{Backend, BackendError, TestApi};
pub use faults::{Fault, RequestRecord};
pub use pki::{TestCa, TestPki};
pub use ports::free_port;
pub use real::RealApiServer;
pub use server::{ApiServer, Error, Result, ServerOptions};
