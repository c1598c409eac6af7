//! The server: listener, connection tasks, shutdown, clients and kubeconfigs for tests, and
//! the fault and accounting controls.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use http::{HeaderName, HeaderValue};
use hyper::{server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    faults::{Fault, FaultTable, RequestRecord},
    router,
    store::Store,
};

/// Errors of the test server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listener could not be bound or read.
    #[error("the test API server could not listen: {0}")]
    Listen(#[source] std::io::Error),
    /// A kubeconfig could not be written.
    #[error("writing kubeconfig {path}: {source}")]
    Kubeconfig {
        /// Where it was to be written.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A kube client could not be built.
    #[error("building a kube client: {0}")]
    Client(#[source] kube::Error),
    /// A client name that cannot be used as a bearer token (or, in a kubeconfig, a URL path
    /// segment).
    #[error("client name {0:?} cannot be used as a bearer token")]
    ClientName(String),
}

/// Result with the testkit [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Server settings. The defaults suit tests.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// How many events the history keeps; a watch from a resourceVersion older than the
    /// history gets 410 Expired. Default 1000.
    pub history_limit: usize,
    /// Events an open watch may fall behind before it is closed with 410 Expired. Default 4096.
    pub watch_buffer: usize,
    /// Interval between BOOKMARK events on watches that allow them. Default 10 s (the real
    /// server sends one about every minute; shorter keeps resume points fresh in tests).
    pub bookmark_interval: Duration,
    /// Upper bound on a watch's duration, whatever `timeoutSeconds` asks. Default 30 min.
    pub max_watch_timeout: Duration,
    /// How long [`ApiServer::shutdown`] waits for open connections. Default 2 s.
    pub shutdown_grace: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            history_limit: 1000,
            watch_buffer: 4096,
            bookmark_interval: Duration::from_secs(10),
            max_watch_timeout: Duration::from_secs(1800),
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

/// State shared by the connection tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    store: Mutex<Store>,
    pub(crate) faults: FaultTable,
    pub(crate) options: ServerOptions,
    pub(crate) token: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) address: String,
}

impl Shared {
    pub(crate) fn lock_store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A Kubernetes API server stand-in on 127.0.0.1 with a random port.
///
/// Runs on the tokio runtime that started it (so paused-time tests see one clock). Dropping it
/// stops it; [`ApiServer::shutdown`] stops it and waits, with a bound, for its tasks.
#[derive(Debug)]
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    kubeconfigs: tempfile::TempDir,
}

impl ApiServer {
    /// Starts a server with default options.
    pub async fn start() -> Result<Self> {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts a server with the given options.
    pub async fn start_with(options: ServerOptions) -> Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(Error::Listen)?;
        let addr = listener.local_addr().map_err(Error::Listen)?;
        let kubeconfigs = tempfile::Builder::new()
            .prefix("haptic-testkit-")
            .tempdir()
            .map_err(|source| Error::Kubeconfig {
                path: std::env::temp_dir(),
                source,
            })?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(options.history_limit, options.watch_buffer)),
            faults: FaultTable::new(),
            options,
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
            address: addr.to_string(),
        });
        let accept_shared = shared.clone();
        shared.tracker.spawn(accept_loop(listener, accept_shared));
        tracing::debug!(%addr, "haptic-testkit API server listening");
        Ok(Self {
            addr,
            shared,
            kubeconfigs,
        })
    }

    /// The socket address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL, e.g. `http://127.0.0.1:34567`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client that identifies itself as `test`.
    pub fn client(&self) -> Result<kube::Client> {
        self.client_for("test")
    }

    /// A kube client that identifies itself as `name` (a bearer token the server reads), so
    /// faults and accounting can address it alone.
    pub fn client_for(&self, name: &str) -> Result<kube::Client> {
        kube::Client::try_from(self.config_for(name)?).map_err(Error::Client)
    }

    /// The kube `Config` behind [`ApiServer::client_for`], for callers that adjust timeouts or
    /// retries before building their client.
    pub fn config_for(&self, name: &str) -> Result<kube::Config> {
        let uri: http::Uri = self
            .url()
            .parse()
            .map_err(|_| Error::ClientName(name.to_owned()))?;
        let mut config = kube::Config::new(uri);
        let value = HeaderValue::from_str(&format!("Bearer {name}"))
            .map_err(|_| Error::ClientName(name.to_owned()))?;
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(Error::ClientName(name.to_owned()));
        }
        config
            .headers
            .push((HeaderName::from_static("authorization"), value));
        Ok(config)
    }

    /// Writes a kubeconfig for client `name` (in a directory removed with the server) and
    /// returns its path, for child processes such as `kubectl` or the daemon.
    ///
    /// The server URL in it ends in `/clients/{name}` and the user's token is `name`: kube
    /// sends the token, but client-go (kubectl) sends no credentials to a plain-HTTP server, so
    /// the path prefix is how the server tells such a client apart. Names must then be URL-safe
    /// (ASCII letters, digits, `-`, `_`, `.`).
    pub fn kubeconfig_for(&self, name: &str) -> Result<PathBuf> {
        let path = self.kubeconfigs.path().join(format!("{name}.kubeconfig"));
        self.write_kubeconfig(name, &path)?;
        Ok(path)
    }

    /// Writes a kubeconfig for client `name` at `path`.
    pub fn write_kubeconfig(&self, name: &str, path: &Path) -> Result<()> {
        let url_safe = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if name.is_empty() || !url_safe {
            return Err(Error::ClientName(name.to_owned()));
        }
        let server = format!("{}{}{name}", self.url(), router::CLIENT_PREFIX);
        // JSON is valid YAML, and kubectl and kube read it as such.
        let doc = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "haptic-testkit", "cluster": { "server": server } }],
            "users": [{ "name": name, "user": { "token": name } }],
            "contexts": [{ "name": "haptic-testkit", "context": { "cluster": "haptic-testkit", "user": name, "namespace": "default" } }],
            "current-context": "haptic-testkit",
            "preferences": {},
        });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        std::fs::write(path, text).map_err(|source| Error::Kubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// Injects a fault for one client; faults add up until lifted.
    pub fn inject(&self, client: &str, fault: Fault) {
        tracing::debug!(client, ?fault, "injecting fault");
        self.shared.faults.inject(client, fault);
    }

    /// Lifts every fault of one client.
    pub fn lift(&self, client: &str) {
        self.shared.faults.lift(client);
    }

    /// Lifts every fault of every client and ends any outage.
    pub fn lift_all(&self) {
        self.shared.faults.lift_all();
    }

    /// A global outage: for `duration`, every request of every client has its connection
    /// closed and open watches are cut. It ends by itself, or early with [`ApiServer::end_outage`].
    pub fn outage(&self, duration: Duration) {
        let until = tokio::time::Instant::now() + duration;
        self.shared.faults.outage(Some(until));
        // Wake hung requests and watches again when it ends, so they see the change.
        let shared = self.shared.clone();
        self.shared.tracker.spawn(async move {
            tokio::select! {
                () = shared.token.cancelled() => {}
                () = tokio::time::sleep_until(until) => {
                    if shared.faults.outage_end().is_none() {
                        shared.faults.outage(None);
                    }
                }
            }
        });
    }

    /// Ends an outage early.
    pub fn end_outage(&self) {
        self.shared.faults.outage(None);
    }

    /// Every request served so far, in arrival order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.faults.requests()
    }

    /// Request counts keyed by (client, verb, resource).
    pub fn request_counts(&self) -> BTreeMap<(String, String, String), u64> {
        self.shared.faults.counts()
    }

    /// Forgets the request log (e.g. after a warm-up phase).
    pub fn reset_accounting(&self) {
        self.shared.faults.reset_accounting();
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock_store().resource_version()
    }

    /// Drops the event history, so any watch from an earlier resourceVersion gets 410 Expired
    /// (as after an etcd compaction).
    pub fn compact(&self) {
        self.shared.lock_store().compact();
    }

    /// Stops accepting, closes watches and waits (bounded by `shutdown_grace`) for every task.
    pub async fn shutdown(self) {
        self.shared.token.cancel();
        self.shared.tracker.close();
        let grace = self.shared.options.shutdown_grace;
        if tokio::time::timeout(grace, self.shared.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("haptic-testkit server tasks did not finish within the grace period");
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shared.token.cancel();
        self.shared.tracker.close();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, _) = tokio::select! {
            () = shared.token.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let conn_shared = shared.clone();
        shared.tracker.spawn(async move {
            let service_shared = conn_shared.clone();
            let service = service_fn(move |req| router::handle(service_shared.clone(), req));
            let conn = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(error) = result {
                        tracing::trace!(%error, "connection ended");
                    }
                }
                () = conn_shared.token.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(conn_shared.options.shutdown_grace, conn).await;
                }
            }
        });
    }
}
