//! TLS of the agent channel and of every HTTPS listener of the project: rustls on `ring`, every
//! certificate, key and CA bundle read from PEM files and read again at the first handshake
//! after a file changed (a rotated Secret volume), so neither side needs a restart.
//!
//! - [`server_config`]: a listener's config (the agent's API, the controller's webhook): the
//!   rotating certificate and, for mutual TLS, a client certificate required and verified
//!   against a rotating CA bundle.
//! - [`client_config`]: the controller's side: the agent's serving certificate verified against
//!   a rotating CA bundle (for the pod IP the URL names, or for one DNS name every agent
//!   certificate carries), and the controller's own rotating client certificate presented.
//!
//! A file set caught half-rotated (a new key, the old certificate; an unreadable bundle) is not
//! used: the previous version stays in use and the files are tried again at the next handshake.

use std::{
    fmt,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
    client::{
        ResolvesClientCert, WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    },
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject as _},
    server::{
        ClientHello, ResolvesServerCert, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
    sign::CertifiedKey,
};
use tracing::{info, warn};

/// Why a certificate, key or CA bundle could not be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("reading {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable certificate, key or CA.
    #[error("{}: {reason}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A DNS name to verify agents by is not a valid name.
    #[error("{0:?} is not a valid DNS name to verify agent certificates by")]
    ServerName(String),
    /// rustls refused the key, the CA bundle or the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[source] rustls::Error),
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A certificate chain (leaf first) and its private key (PKCS#8, PKCS#1 or SEC1), in PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Pem {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Reads and checks a pair: a chain, a key, and the key belonging to the leaf.
pub fn load_pair(files: &PairFiles) -> Result<Arc<CertifiedKey>> {
    let chain = CertificateDer::pem_slice_iter(&read(&files.cert)?)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(&files.cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(&files.cert, "holds no PEM certificate"));
    }
    let private = PrivateKeyDer::from_pem_slice(&read(&files.key)?)
        .map_err(|e| bad(&files.key, e.to_string()))?;
    let signer = ring::sign::any_supported_type(&private).map_err(Error::Rustls)?;
    let pair = CertifiedKey::new(chain, signer);
    pair.keys_match().map_err(|e| {
        bad(
            &files.key,
            format!("does not belong to the certificate: {e}"),
        )
    })?;
    Ok(Arc::new(pair))
}

/// Reads a CA bundle: at least one certificate, each a valid trust anchor.
pub fn load_roots(path: &Path) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&read(path)?) {
        let cert = cert.map_err(|e| bad(path, e.to_string()))?;
        roots
            .add(cert)
            .map_err(|e| bad(path, format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad(path, "holds no PEM certificate"));
    }
    Ok(Arc::new(roots))
}

/// What identifies a version of some files: for each, its inode, modification time and length.
/// A Secret volume swaps a `..data` symlink, which changes all three.
type Version = Option<Vec<(u64, SystemTime, u64)>>;

fn version(paths: &[PathBuf]) -> Version {
    paths
        .iter()
        .map(|path| {
            let meta = std::fs::metadata(path).ok()?;
            Some((meta.ino(), meta.modified().ok()?, meta.len()))
        })
        .collect()
}

/// A value built from files, built again at the first use after they changed.
struct Reloading<T> {
    what: &'static str,
    paths: Vec<PathBuf>,
    build: Box<dyn Fn() -> Result<T> + Send + Sync>,
    current: Mutex<(Version, T)>,
}

impl<T: Clone> Reloading<T> {
    fn new(
        what: &'static str,
        paths: Vec<PathBuf>,
        build: impl Fn() -> Result<T> + Send + Sync + 'static,
    ) -> Result<Self> {
        let seen = version(&paths);
        let value = build()?;
        Ok(Self {
            what,
            paths,
            build: Box::new(build),
            current: Mutex::new((seen, value)),
        })
    }

    /// The value in use; rebuilt first when the files changed (two or three `stat`s: cheap
    /// next to a handshake).
    fn get(&self) -> T {
        let now = version(&self.paths);
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now.is_some() && now != current.0 {
            match (self.build)() {
                Ok(value) => {
                    info!(what = self.what, file = %self.paths[0].display(), "TLS files changed; now in use");
                    *current = (now, value);
                }
                // Half rotated: keep the previous version; the next handshake tries again.
                Err(error) => {
                    warn!(what = self.what, %error, "TLS files changed but do not load; keeping the previous version")
                }
            }
        }
        current.1.clone()
    }
}

impl<T> fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloading")
            .field("what", &self.what)
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

/// A certificate and key served (by a listener) or presented (by a client), rotating with its
/// files.
#[derive(Debug)]
pub struct RotatingPair(Reloading<Arc<CertifiedKey>>);

impl RotatingPair {
    /// Loads the pair now: an error when it is unusable, so a bad mount fails at start.
    pub fn new(files: &PairFiles) -> Result<Self> {
        let owned = files.clone();
        Ok(Self(Reloading::new(
            "certificate",
            vec![files.cert.clone(), files.key.clone()],
            move || load_pair(&owned),
        )?))
    }

    /// The pair in use.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.0.get()
    }
}

impl ResolvesServerCert for RotatingPair {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl ResolvesClientCert for RotatingPair {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Requires a client certificate issued by the CA bundle in a file, read again when it changes.
#[derive(Debug)]
pub struct RotatingClientCa(Reloading<Arc<dyn ClientCertVerifier>>);

impl RotatingClientCa {
    /// Loads the bundle now.
    pub fn new(ca: &Path) -> Result<Self> {
        let path = ca.to_owned();
        Ok(Self(Reloading::new(
            "client CA",
            vec![ca.to_owned()],
            move || {
                WebPkiClientVerifier::builder_with_provider(load_roots(&path)?, provider())
                    .build()
                    .map_err(|e| bad(&path, e.to_string()))
            },
        )?))
    }
}

impl ClientCertVerifier for RotatingClientCa {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints would borrow from a bundle that may rotate; with none a client sends the
        // one certificate it has.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0
            .get()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.get().supported_verify_schemes()
    }
}

/// Verifies a server's certificate against the CA bundle in a file, read again when it changes;
/// for the name the client connects to (a pod IP), or for one fixed DNS name when given.
#[derive(Debug)]
pub struct RotatingServerCa {
    roots: Reloading<Arc<WebPkiServerVerifier>>,
    name: Option<ServerName<'static>>,
}

impl RotatingServerCa {
    /// Loads the bundle now. `name`: the DNS name every server certificate must carry,
    /// whatever address is connected to (none: the connected address or host itself).
    pub fn new(ca: &Path, name: Option<&str>) -> Result<Self> {
        let name = name
            .map(|n| {
                ServerName::try_from(n.to_owned()).map_err(|_| Error::ServerName(n.to_owned()))
            })
            .transpose()?;
        let path = ca.to_owned();
        let roots = Reloading::new("agent CA", vec![ca.to_owned()], move || {
            WebPkiServerVerifier::builder_with_provider(load_roots(&path)?, provider())
                .build()
                .map_err(|e| bad(&path, e.to_string()))
        })?;
        Ok(Self { roots, name })
    }
}

impl ServerCertVerifier for RotatingServerCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name = self.name.as_ref().unwrap_or(server_name);
        self.roots
            .get()
            .verify_server_cert(end_entity, intermediates, name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.get().supported_verify_schemes()
    }
}

/// A listener's config: TLS 1.2 and 1.3, HTTP/1.1, the rotating `pair`, and with `client_ca`
/// a client certificate required and verified against it (mutual TLS).
pub fn server_config(pair: &PairFiles, client_ca: Option<&Path>) -> Result<rustls::ServerConfig> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(Error::Rustls)?;
    let builder = match client_ca {
        Some(ca) => builder.with_client_cert_verifier(Arc::new(RotatingClientCa::new(ca)?)),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::new(RotatingPair::new(pair)?));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The controller's side of the agent channel: agents verified against `ca` (by `name` when
/// given, else by the address connected to), and `identity` presented when given.
pub fn client_config(
    ca: &Path,
    name: Option<&str>,
    identity: Option<&PairFiles>,
) -> Result<rustls::ClientConfig> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(Error::Rustls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(RotatingServerCa::new(ca, name)?));
    let mut config = match identity {
        Some(pair) => builder.with_client_cert_resolver(Arc::new(RotatingPair::new(pair)?)),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
