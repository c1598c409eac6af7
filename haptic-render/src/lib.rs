//! haptic-render: tera templates -> an HAProxy file set (haproxy.cfg, maps, files,
//! certificates) and its sha256 checksum.
//!
//! A [`TemplateSet`] (shaped like the HAProxyTemplateConfig CRD) is compiled once into a
//! [`Renderer`]; each render reads the watched resources from [`Stores`] and returns a
//! [`FileSet`]. The same stores give the same bytes, whatever order their resources arrived in.
//!
//! ```
//! use haptic_render::{Renderer, Stores, StoreConfig, Template, TemplateSet};
//! use serde_json::json;
//!
//! let mut set = TemplateSet {
//!     haproxy_config: Template::new(
//!         "{% for s in resources.services %}backend {{ backend_name(namespace=s.metadata.namespace, \
//!          service=s.metadata.name, port=80) }}\n{% endfor %}",
//!     ),
//!     ..TemplateSet::default()
//! };
//! set.maps.insert("hosts.map".into(), Template::new("shop.example.com shop_web_80\n"));
//! let renderer = Renderer::compile(&set)?;
//!
//! let mut stores = Stores::new();
//! stores
//!     .add("services", StoreConfig::default())?
//!     .apply(&json!({"metadata": {"namespace": "shop", "name": "web"}}))?;
//!
//! let files = renderer.render(&stores)?;
//! assert_eq!(files.text("haproxy.cfg"), Some("backend shop_web_80\n"));
//! assert_eq!(files.len(), 2);
//! assert_eq!(files.checksum_hex().len(), 67); // `v2-` and 64 hex digits
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The Kubernetes joins every Ingress template needs (a Service port with its endpoints, an
//! Ingress path with its Service port, a TLS entry with its Secret) are [`derived`] views,
//! computed in Rust when the stores they read change and seen by templates as
//! `derived.<name>` ([`Stores::derive`]).
//!
//! The reference Ingress template set is [`reference::template_set`], with its stores and derived
//! views from [`reference::stores`]; [`fixtures`] generates Ingresses, Services, EndpointSlices
//! and Secrets for tests and benchmarks.

pub mod certificate;
pub mod derived;
pub mod fileset;
pub mod fixtures;
mod fragments;
pub mod functions;
pub mod gateway_action;
mod graveyard;
pub mod nginx;
pub mod nginx_rules;
pub mod pool;
pub mod provenance;
mod recycle;
pub mod reference;
pub mod render;
pub mod requests;
pub mod set;
pub mod slots;
pub mod store;
mod value;

pub use derived::Derivation;
pub use fileset::FileSet;
pub use provenance::{ObjectRef, Provenance};
pub use render::{Renderer, Timings};
pub use requests::{EventRequest, PoolState, Requests, StatusRequest};
pub use set::{CertificateTemplate, FileTemplate, Template, TemplateSet};
pub use store::{Change, Overlay, OverlayError, Store, StoreConfig, Stores};
