//! A real kube-apiserver and etcd on loopback for tests (controller-runtime envtest's idea):
//! RBAC, a service-account issuer, an admin token, ServiceAccount tokens through the
//! TokenRequest API, all in a temporary directory that goes away with the server.
//!
//! The binaries come from `KUBEBUILDER_ASSETS` or from the cache `cargo xtask envtest` fills.
//! Both processes run under one supervising `sh` in a process group of their own, which holds
//! the read end of a pipe from the test process: when the test process ends, however it ends,
//! the pipe closes and the supervisor stops both servers and removes the directory. That is what
//! lets one server be shared by every test of a binary ([`RealApiServer::shared`]) although a
//! `static` is never dropped.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::{Namespace, ServiceAccount},
};
use kube::{
    Api,
    api::{ObjectMeta, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::json;

/// The Kubernetes release the assets are built from.
pub const KUBERNETES_VERSION: &str = "v1.34.4";
/// The etcd release beside it.
pub const ETCD_VERSION: &str = "v3.6.4";
/// The admin's user name (in group `system:masters`).
pub const ADMIN_USER: &str = "haptic-admin";
/// How long [`RealApiServer::start`] waits for `/readyz`.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How many times [`RealApiServer::start`] starts the servers when one exits early.
const START_ATTEMPTS: u32 = 3;
/// How long a drop waits for the supervisor to stop both servers before killing the group.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// Errors of the real API server fixture.
#[derive(Debug, thiserror::Error)]
pub enum RealError {
    /// kube-apiserver or etcd could not be found.
    #[error(
        "the real API server tier needs kube-apiserver and etcd ({0}): run `cargo xtask envtest` \
         (it builds them once per machine with Go and prints their directory), or set \
         KUBEBUILDER_ASSETS to a directory holding both"
    )]
    AssetsMissing(String),
    /// A file of the fixture could not be written or read.
    #[error("real API server fixture: {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key could not be generated.
    #[error("generating the fixture's certificates: {0}")]
    Certificate(#[source] rcgen::Error),
    /// etcd or kube-apiserver exited before it was ready, on every attempt (the logs' tails
    /// say why).
    #[error("the real API server exited {after:?} after its start ({attempts} attempts): {detail}")]
    Exited {
        /// How long the last attempt ran.
        after: Duration,
        /// How many times a start was tried, each on fresh ports.
        attempts: u32,
        /// The last probe error and the servers' last log lines.
        detail: String,
    },
    /// The servers did not become ready in time (the logs' tails say why).
    #[error("the real API server was not ready within {timeout:?}: {detail}")]
    NotReady {
        /// The bound.
        timeout: Duration,
        /// The last probe error and the servers' last log lines.
        detail: String,
    },
    /// A kubeconfig could not be loaded into a kube client.
    #[error("loading the kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The kubeconfig.
        path: PathBuf,
        /// What kube said.
        message: String,
    },
    /// A request to the real server failed.
    #[error("real API server: {what}: {source}")]
    Api {
        /// What was being done.
        what: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

/// Result with [`RealError`].
pub type RealResult<T> = std::result::Result<T, RealError>;

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> RealError {
    let path = path.to_owned();
    move |source| RealError::Io { what, path, source }
}

/// A directory holding `kube-apiserver` and `etcd`: `KUBEBUILDER_ASSETS` when it holds both,
/// else the cache `cargo xtask envtest` builds into
/// (`${XDG_CACHE_HOME:-$HOME/.cache}/haptic/envtest/k8s-VERSION-etcd-VERSION`).
pub fn assets_dir() -> RealResult<PathBuf> {
    let complete = |d: &Path| d.join("kube-apiserver").is_file() && d.join("etcd").is_file();
    let mut looked = Vec::new();
    if let Some(dir) = std::env::var_os("KUBEBUILDER_ASSETS").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        if complete(&dir) {
            return Ok(dir);
        }
        looked.push(format!("KUBEBUILDER_ASSETS={}", dir.display()));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        });
    if let Some(base) = base {
        let dir = base
            .join("haptic")
            .join("envtest")
            .join(format!("k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}"));
        if complete(&dir) {
            return Ok(dir);
        }
        looked.push(dir.display().to_string());
    }
    Err(RealError::AssetsMissing(format!(
        "looked in {}",
        looked.join(" and ")
    )))
}

/// kube-apiserver v1.34 and etcd v3.6 on loopback, with RBAC, for tests.
///
/// The admin (user [`ADMIN_USER`], group `system:masters`) authenticates with a static token;
/// any ServiceAccount gets a token through the TokenRequest API
/// ([`RealApiServer::service_account_kubeconfig`]), so a component can run with exactly the
/// permissions an RBAC manifest grants it. `--enable-aggregator-routing=true`, no Service IPs
/// are ever dialled: webhooks must be registered by `url`. No kube-controller-manager runs: no
/// namespace finalisation, no EndpointSlices from Services, no token Secrets.
#[derive(Debug)]
pub struct RealApiServer {
    dir: tempfile::TempDir,
    port: u16,
    supervisor: Option<Child>,
    stdin: Option<ChildStdin>,
    admin_kubeconfig: PathBuf,
    admin_token: String,
    ca_pem: String,
    ca_der: Vec<u8>,
    /// How long the start took, up to a ready `/readyz`.
    startup: Duration,
}

static SHARED: tokio::sync::OnceCell<RealApiServer> = tokio::sync::OnceCell::const_new();
static COUNTER: AtomicU64 = AtomicU64::new(0);

impl RealApiServer {
    /// One server for the whole test binary, started by the first caller. It stops when the
    /// process ends (its supervisor sees the pipe close). Tests sharing it keep to namespaces
    /// of their own ([`RealApiServer::create_namespace`]).
    pub async fn shared() -> RealResult<&'static RealApiServer> {
        SHARED.get_or_try_init(Self::start).await
    }

    /// Starts etcd and kube-apiserver and waits (bounded) until `/readyz` answers `ok`. When
    /// one of them exits first (a port another process took between [`crate::free_port`] and the
    /// bind is the usual reason), it starts again on fresh ports, [`START_ATTEMPTS`] times in
    /// all; a server that runs but is not ready by the deadline is not retried.
    pub async fn start() -> RealResult<Self> {
        let mut attempt = 1;
        loop {
            match Self::start_once().await {
                Err(RealError::Exited { after, detail, .. }) if attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, ?after, %detail, "real kube-apiserver exited early; starting again on fresh ports");
                    attempt += 1;
                }
                Err(RealError::Exited { after, detail, .. }) => {
                    return Err(RealError::Exited {
                        after,
                        attempts: attempt,
                        detail,
                    });
                }
                other => return other,
            }
        }
    }

    async fn start_once() -> RealResult<Self> {
        let started = Instant::now();
        let assets = assets_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("haptic-real-apiserver-")
            .tempdir()
            .map_err(io(
                "creating a temporary directory in",
                &std::env::temp_dir(),
            ))?;
        let root = dir.path();
        let write = |name: &str, text: &str| -> RealResult<PathBuf> {
            let path = root.join(name);
            std::fs::write(&path, text).map_err(io("writing", &path))?;
            Ok(path)
        };

        // Serving certificate for 127.0.0.1 and localhost, signed by a CA of the fixture's own.
        let ca_key = KeyPair::generate().map_err(RealError::Certificate)?;
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).map_err(RealError::Certificate)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params
            .self_signed(&ca_key)
            .map_err(RealError::Certificate)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let serving_key = KeyPair::generate().map_err(RealError::Certificate)?;
        let serving = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .map_err(RealError::Certificate)?
            .signed_by(&serving_key, &issuer)
            .map_err(RealError::Certificate)?;
        let ca_path = write("ca.crt", &ca.pem())?;
        let cert_path = write("apiserver.crt", &serving.pem())?;
        let key_path = write("apiserver.key", &serving_key.serialize_pem())?;
        // The service-account token signing key (ES256) and its public half.
        let sa_key = KeyPair::generate().map_err(RealError::Certificate)?;
        let sa_key_path = write("sa.key", &sa_key.serialize_pem())?;
        let sa_pub_path = write("sa.pub", &sa_key.public_key_pem())?;
        let admin_token = uuid::Uuid::new_v4().simple().to_string();
        let tokens_path = write(
            "tokens.csv",
            &format!("{admin_token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n"),
        )?;

        let (etcd_client, etcd_peer, port) =
            (crate::free_port(), crate::free_port(), crate::free_port());
        let etcd_dir = root.join("etcd");
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let etcd_args: Vec<String> = vec![
            format!("--data-dir={}", etcd_dir.display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            // Test data dies with the process: durability buys nothing and costs fsyncs.
            "--unsafe-no-fsync=true".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        let issuer_url = format!("https://127.0.0.1:{port}");
        let api_args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--advertise-address=127.0.0.1".to_owned(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", root.join("certs").display()),
            format!("--tls-cert-file={}", cert_path.display()),
            format!("--tls-private-key-file={}", key_path.display()),
            "--authorization-mode=RBAC".to_owned(),
            format!("--token-auth-file={}", tokens_path.display()),
            format!("--service-account-issuer={issuer_url}"),
            format!("--service-account-key-file={}", sa_pub_path.display()),
            format!(
                "--service-account-signing-key-file={}",
                sa_key_path.display()
            ),
            "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
            "--enable-aggregator-routing=true".to_owned(),
            // No controller-manager creates the `default` ServiceAccount of a namespace, which
            // this plugin would demand of every Pod.
            "--disable-admission-plugins=ServiceAccount".to_owned(),
            "--allow-privileged=true".to_owned(),
            "--v=0".to_owned(),
        ];
        let quote = |a: &str| format!("'{}'", a.replace('\'', r"'\''"));
        let join = |args: &[String]| args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ");
        // The supervisor: both servers in the background, then a read of stdin that returns
        // when the test process closes the pipe (drop, exit or kill -9), then a clean stop.
        let script = format!(
            "{etcd} {etcd_args} >{root}/etcd.log 2>&1 &\n\
             etcd_pid=$!\n\
             {api} {api_args} >{root}/kube-apiserver.log 2>&1 &\n\
             api_pid=$!\n\
             echo $etcd_pid $api_pid >{root}/pids\n\
             read -r _ignored\n\
             kill -TERM $api_pid 2>/dev/null; wait $api_pid\n\
             kill -TERM $etcd_pid 2>/dev/null; wait $etcd_pid\n\
             rm -rf {root}\n",
            etcd = quote(&assets.join("etcd").display().to_string()),
            api = quote(&assets.join("kube-apiserver").display().to_string()),
            etcd_args = join(&etcd_args),
            api_args = join(&api_args),
            root = quote(&root.display().to_string()),
        );
        let mut supervisor = {
            use std::os::unix::process::CommandExt as _;
            Command::new("sh")
                .arg("-c")
                .arg(script)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                // A group of its own, so a stuck stop can be ended by killing the group.
                .process_group(0)
                .spawn()
                .map_err(io("starting sh for", root))?
        };
        let stdin = supervisor.stdin.take();

        let admin_kubeconfig = root.join("admin.kubeconfig");
        write_kubeconfig(&admin_kubeconfig, port, &ca_path, ADMIN_USER, &admin_token)?;
        let mut server = Self {
            port,
            supervisor: Some(supervisor),
            stdin,
            admin_kubeconfig,
            admin_token,
            ca_pem: ca.pem(),
            ca_der: ca.der().to_vec(),
            startup: Duration::ZERO,
            dir,
        };
        server.wait_ready(started).await?;
        server.startup = started.elapsed();
        tracing::info!(port, startup = ?server.startup, "real kube-apiserver ready");
        Ok(server)
    }

    async fn wait_ready(&self, started: Instant) -> RealResult<()> {
        let client = self.admin_client().await?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let request = http::Request::get("/readyz").body(Vec::new());
            let last = match request {
                Ok(request) => match client.request_text(request).await {
                    Ok(text) if text.trim() == "ok" => return Ok(()),
                    Ok(text) => text,
                    Err(error) => error.to_string(),
                },
                Err(error) => error.to_string(),
            };
            let exited = self.exited();
            if Instant::now() >= deadline || exited {
                let detail = format!(
                    "{last}\n--- etcd.log (tail)\n{}\n--- kube-apiserver.log (tail)\n{}",
                    self.log_tail("etcd.log"),
                    self.log_tail("kube-apiserver.log"),
                );
                return Err(if exited {
                    RealError::Exited {
                        after: started.elapsed(),
                        attempts: 1,
                        detail,
                    }
                } else {
                    RealError::NotReady {
                        timeout: START_TIMEOUT,
                        detail,
                    }
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether etcd or kube-apiserver has exited (a zombie of the waiting supervisor, or
    /// gone): a bad flag or a taken port ends the wait at once instead of at the deadline.
    fn exited(&self) -> bool {
        let Ok(pids) = std::fs::read_to_string(self.dir.path().join("pids")) else {
            return false;
        };
        pids.split_whitespace().any(|pid| {
            match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                // The state follows the parenthesised command name.
                Ok(stat) => stat
                    .rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
                Err(_) => true,
            }
        })
    }

    /// The last lines of one of the servers' logs.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(25)..].join("\n")
    }

    /// How long the start took, from spawning etcd to a ready `/readyz`.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The base URL, `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The PEM of the CA that signed the server's certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The admin's kubeconfig (token auth, group `system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The admin's kube `Config` (bearer token, the fixture's CA), built without I/O.
    pub fn admin_config(&self) -> RealResult<kube::Config> {
        let uri: http::Uri =
            self.url()
                .parse()
                .map_err(|e: http::uri::InvalidUri| RealError::Kubeconfig {
                    path: self.admin_kubeconfig.clone(),
                    message: e.to_string(),
                })?;
        let mut config = kube::Config::new(uri);
        config.root_cert = Some(vec![self.ca_der.clone()]);
        let value =
            http::HeaderValue::from_str(&format!("Bearer {}", self.admin_token)).map_err(|e| {
                RealError::Kubeconfig {
                    path: self.admin_kubeconfig.clone(),
                    message: e.to_string(),
                }
            })?;
        config.headers.push((http::header::AUTHORIZATION, value));
        Ok(config)
    }

    /// A kube client as the admin, built without I/O (see [`RealApiServer::admin_config`]).
    pub fn admin_client_now(&self) -> RealResult<kube::Client> {
        kube::Client::try_from(self.admin_config()?).map_err(|e| RealError::Kubeconfig {
            path: self.admin_kubeconfig.clone(),
            message: e.to_string(),
        })
    }

    /// A kube client as the admin.
    pub async fn admin_client(&self) -> RealResult<kube::Client> {
        client_from(&self.admin_kubeconfig).await
    }

    /// Creates a namespace named `prefix-N` (N unique in this process) and returns its name.
    pub async fn create_namespace(&self, prefix: &str) -> RealResult<String> {
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let api: Api<Namespace> = Api::all(self.admin_client().await?);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        api.create(&PostParams::default(), &ns)
            .await
            .map_err(|source| RealError::Api {
                what: format!("creating namespace {name}"),
                source,
            })?;
        Ok(name)
    }

    /// A kubeconfig for ServiceAccount `namespace/name` (created when missing), with a token
    /// from the TokenRequest API valid for an hour. Written in the server's directory.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
    ) -> RealResult<PathBuf> {
        let admin = self.admin_client().await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(admin, namespace);
        let account = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            ..ServiceAccount::default()
        };
        match accounts.create(&PostParams::default(), &account).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(source) => {
                return Err(RealError::Api {
                    what: format!("creating ServiceAccount {namespace}/{name}"),
                    source,
                });
            }
        }
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(|source| RealError::Api {
                what: format!("requesting a token for ServiceAccount {namespace}/{name}"),
                source,
            })?;
        let token = answer.status.map(|s| s.token).unwrap_or_default();
        let path = self.dir.path().join(format!(
            "sa-{namespace}-{name}-{}.kubeconfig",
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let user = format!("system:serviceaccount:{namespace}:{name}");
        write_kubeconfig(
            &path,
            self.port,
            &self.dir.path().join("ca.crt"),
            &user,
            &token,
        )?;
        Ok(path)
    }

    /// A kube client as ServiceAccount `namespace/name` (see
    /// [`RealApiServer::service_account_kubeconfig`]).
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> RealResult<kube::Client> {
        client_from(&self.service_account_kubeconfig(namespace, name).await?).await
    }

    /// Stops both servers and removes the directory, waiting (bounded) for the supervisor.
    fn stop(&mut self) {
        // Closing the pipe is the supervisor's signal.
        drop(self.stdin.take());
        let Some(mut child) = self.supervisor.take() else {
            return;
        };
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => break,
            }
        }
        // Stuck: end the whole group (sh, etcd, kube-apiserver); the TempDir removes the rest.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .status();
        let _ = child.wait();
    }
}

impl Drop for RealApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn client_from(path: &Path) -> RealResult<kube::Client> {
    let text = std::fs::read_to_string(path).map_err(io("reading", path))?;
    let kubeconfig = Kubeconfig::from_yaml(&text).map_err(|e| RealError::Kubeconfig {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| RealError::Kubeconfig {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    kube::Client::try_from(config).map_err(|e| RealError::Kubeconfig {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

fn write_kubeconfig(path: &Path, port: u16, ca: &Path, user: &str, token: &str) -> RealResult<()> {
    // JSON is YAML: kubectl and kube both read it.
    let doc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "real", "cluster": {
            "server": format!("https://127.0.0.1:{port}"),
            "certificate-authority": ca.display().to_string(),
        }}],
        "users": [{ "name": user, "user": { "token": token } }],
        "contexts": [{ "name": "real", "context": { "cluster": "real", "user": user, "namespace": "default" } }],
        "current-context": "real",
        "preferences": {},
    });
    let mut file = std::fs::File::create(path).map_err(io("creating", path))?;
    file.write_all(doc.to_string().as_bytes())
        .map_err(io("writing", path))?;
    Ok(())
}
