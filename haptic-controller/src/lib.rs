//! haptic-controller: the HAPTIC daemon. Every replica watches the HAProxyTemplateConfig and the
//! resources it names, keeping a hot cache; the replica holding the Lease renders the HAProxy
//! file set, checks it with `haproxy -c` off the reconcile path, and deploys it to the agent
//! beside every HAProxy pod under its fencing epoch, so a stale leader can never overwrite its
//! successor.
//!
//! One module per component, named as in the design (`CONTROLLER.md`): [`config_loader`],
//! [`credentials`], [`watchers`] (resource watchers), [`reconciler`], [`pod_discovery`],
//! [`state`] (state cache), [`health`], [`debug`] (the observer and `/debug/vars`),
//! [`metrics`], [`standby`] (the warm standby: renders while not leading); leader only: [`coordinator`], [`render_gate`],
//! [`scheduler`] (deployment scheduler and deployer), [`drift`], [`status`], [`pool_keeper`]
//! (the backend pool's reserve). [`daemon`] wires
//! them on a haptic-eventbus bus through haptic-leadership; [`crd`] is the custom resource.
//!
//! ```
//! use haptic_controller::{config, crd::HAProxyTemplateConfig, reference};
//! use kube::CustomResourceExt;
//!
//! // The reference Ingress config passes every check the config loader makes.
//! let valid = config::validate(&reference::spec(), 1, "1").expect("valid");
//! // Ingresses, Services, EndpointSlices, TLS Secrets, labelled htpasswd Secrets,
//! // IngressClasses, the HAProxy pods, the backend pool's reserve (a ConfigMap),
//! // Namespaces and the Gateway API kinds (optional: their CRDs are the user's).
//! assert_eq!(valid.stores.len(), 13);
//! assert_eq!(HAProxyTemplateConfig::crd_name(), "haproxytemplateconfigs.haproxy-haptic.org");
//! ```

pub mod agent_ca;
pub mod background;
pub mod channel;
pub mod config;
pub mod config_loader;
pub mod coordinator;
pub mod crd;
pub mod credentials;
pub mod daemon;
pub mod debug;
pub mod default_certificate;
pub mod drift;
pub mod duration;
pub mod events;
pub mod health;
pub mod metrics;
pub mod migrate;
pub mod pod_discovery;
pub mod pool_keeper;
pub mod published;
pub mod reconciler;
pub mod recorder;
pub mod reference;
pub mod render_gate;
pub mod scheduler;
pub mod standby;
pub mod state;
pub mod status;
pub mod status_applier;
mod tasks;
pub mod validation;
pub mod watchers;
pub mod webhook;

pub use crd::{HAProxyTemplateConfig, HAProxyTemplateConfigSpec, HAProxyTemplateConfigStatus};
pub use daemon::{Options, run};
