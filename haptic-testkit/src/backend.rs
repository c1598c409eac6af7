//! One test body, two API servers: [`TestApi`] hands a test its admin client, a namespace of
//! its own and ServiceAccount identities on either the stand-in or the real kube-apiserver.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api,
    api::{ObjectMeta, PostParams},
};

use crate::{
    ApiServer,
    real::{RealApiServer, RealError},
};

/// Which API server a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// haptic-testkit's stand-in (milliseconds to start, fault injection, accounting).
    StandIn,
    /// kube-apiserver + etcd (RBAC, server-side apply, admission, CRD schemas); one per test
    /// binary, shared.
    Real,
}

/// Errors of [`TestApi`].
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The stand-in failed.
    #[error(transparent)]
    StandIn(#[from] crate::Error),
    /// The real server failed (or its binaries are missing).
    #[error(transparent)]
    Real(#[from] RealError),
    /// A request failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being done.
        what: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

/// An API server for one test: the stand-in (owned by the test) or the shared real server.
#[derive(Debug)]
pub enum TestApi {
    /// The stand-in, started for this test.
    StandIn(ApiServer),
    /// The real server of this test binary.
    Real(&'static RealApiServer),
}

impl TestApi {
    /// Starts the stand-in, or joins (starting it first if needed) the binary's real server.
    /// On the real backend, missing binaries are an error that says to run
    /// `cargo xtask envtest`: the tier fails, it is never skipped silently.
    pub async fn start(backend: Backend) -> Result<Self, BackendError> {
        Ok(match backend {
            Backend::StandIn => Self::StandIn(ApiServer::start().await?),
            Backend::Real => Self::Real(RealApiServer::shared().await?),
        })
    }

    /// Which backend this is.
    pub fn backend(&self) -> Backend {
        match self {
            Self::StandIn(_) => Backend::StandIn,
            Self::Real(_) => Backend::Real,
        }
    }

    /// Whether this is the real server.
    pub fn is_real(&self) -> bool {
        self.backend() == Backend::Real
    }

    /// The stand-in, for fault injection and accounting (None on the real server).
    pub fn stand_in(&self) -> Option<&ApiServer> {
        match self {
            Self::StandIn(server) => Some(server),
            Self::Real(_) => None,
        }
    }

    /// A client with every permission (the stand-in checks none; on the real server, a user in
    /// `system:masters`).
    pub async fn admin_client(&self) -> Result<kube::Client, BackendError> {
        Ok(match self {
            Self::StandIn(server) => server.client_for("admin")?,
            Self::Real(server) => server.admin_client().await?,
        })
    }

    /// The admin's kubeconfig, for kubectl and child processes.
    pub fn admin_kubeconfig(&self) -> Result<PathBuf, BackendError> {
        Ok(match self {
            Self::StandIn(server) => server.kubeconfig_for("admin")?,
            Self::Real(server) => server.admin_kubeconfig().to_owned(),
        })
    }

    /// A client acting as ServiceAccount `namespace/name`: on the real server with a token from
    /// the TokenRequest API (so RBAC applies), on the stand-in a client named `name`.
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<kube::Client, BackendError> {
        Ok(match self {
            Self::StandIn(server) => server.client_for(name)?,
            Self::Real(server) => server.service_account_client(namespace, name).await?,
        })
    }

    /// A kubeconfig for ServiceAccount `namespace/name` (see
    /// [`TestApi::service_account_client`]).
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<PathBuf, BackendError> {
        Ok(match self {
            Self::StandIn(server) => server.kubeconfig_for(name)?,
            Self::Real(server) => server.service_account_kubeconfig(namespace, name).await?,
        })
    }

    /// A fresh namespace for this test (`prefix-…`; the real server is shared, so a test keeps
    /// to namespaces of its own).
    pub async fn namespace(&self, prefix: &str) -> Result<String, BackendError> {
        match self {
            Self::Real(server) => Ok(server.create_namespace(prefix).await?),
            Self::StandIn(_) => {
                let api: Api<Namespace> = Api::all(self.admin_client().await?);
                let ns = Namespace {
                    metadata: ObjectMeta {
                        name: Some(prefix.to_owned()),
                        ..ObjectMeta::default()
                    },
                    ..Namespace::default()
                };
                api.create(&PostParams::default(), &ns)
                    .await
                    .map_err(|source| BackendError::Api {
                        what: format!("creating namespace {prefix}"),
                        source,
                    })?;
                Ok(prefix.to_owned())
            }
        }
    }
}

/// One test body, two tests: `NAME::stand_in` and `NAME::real`, each on a multi-threaded
/// tokio runtime, each handing the body a [`TestApi`] of its backend. The real one fails (never
/// skips) when `cargo xtask envtest` has not been run.
///
/// ```ignore
/// haptic_testkit::on_both_servers! {
///     async fn leases_conflict(api: TestApi) {
///         let ns = api.namespace("conflict").await.expect("namespace");
///         // ...
///     }
/// }
/// ```
#[macro_export]
macro_rules! on_both_servers {
    ($(#[$meta:meta])* async fn $name:ident($api:ident : TestApi) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn body($api: $crate::TestApi) $body

            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stand_in() {
                let api = $crate::TestApi::start($crate::Backend::StandIn)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                body(api).await;
            }

            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn real() {
                let api = $crate::TestApi::start($crate::Backend::Real)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                body(api).await;
            }
        }
    };
}
