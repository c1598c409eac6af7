//! The webhook's certificate: a PEM chain and key from files (a mounted Secret), read at start
//! and again at the first handshake after either file changed (a cert-manager rotation), with
//! no restart. A pair that does not load (half written, key and certificate apart) is not
//! served: the previous one stays until the files settle.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use rustls::{
    crypto::ring,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use tracing::{info, warn};

/// Why the certificate could not be loaded.
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
    /// A file holds no usable certificate or key.
    #[error("{}: {reason}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the key or the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[source] rustls::Error),
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What identifies a version of the files: for each, its modification time and length. A
/// Secret volume swaps a `..data` symlink, which changes both targets' times.
type Version = Option<[(SystemTime, u64); 2]>;

fn version(cert: &Path, key: &Path) -> Version {
    let of = |path: &Path| {
        let meta = std::fs::metadata(path).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    };
    Some([of(cert)?, of(key)?])
}

/// Reads and checks the pair.
pub fn load(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })
    };
    let bad = |path: &Path, reason: String| Error::Pem {
        path: path.to_owned(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(cert, "holds no PEM certificate".to_owned()));
    }
    let private =
        PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| bad(key, e.to_string()))?;
    let signer = ring::sign::any_supported_type(&private).map_err(Error::Rustls)?;
    let pair = CertifiedKey::new(chain, signer);
    pair.keys_match()
        .map_err(|e| bad(key, format!("does not belong to the certificate: {e}")))?;
    Ok(Arc::new(pair))
}

/// Serves the pair in use, and swaps in the files' new version at the first handshake that
/// sees one.
pub struct Rotating {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<(Version, Arc<CertifiedKey>)>,
}

impl fmt::Debug for Rotating {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rotating")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Rotating {
    /// Loads the pair now: an error when it is unusable, so a bad mount fails at start.
    pub fn new(cert: &Path, key: &Path) -> Result<Self> {
        let seen = version(cert, key);
        let pair = load(cert, key)?;
        Ok(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            current: Mutex::new((seen, pair)),
        })
    }
}

impl ResolvesServerCert for Rotating {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let now = version(&self.cert, &self.key);
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now.is_some() && now != current.0 {
            match load(&self.cert, &self.key) {
                Ok(pair) => {
                    info!(cert = %self.cert.display(), "webhook certificate rotated");
                    *current = (now, pair);
                }
                Err(error) => {
                    warn!(%error, "the webhook certificate files changed but do not load; serving the previous pair")
                }
            }
        }
        Some(current.1.clone())
    }
}

/// The acceptor: TLS 1.2 and 1.3 on ring, HTTP/1.1, the rotating pair.
pub fn acceptor(cert: &Path, key: &Path) -> Result<tokio_rustls::TlsAcceptor> {
    let resolver = Arc::new(Rotating::new(cert, key)?);
    let mut config =
        rustls::ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(Error::Rustls)?
            .with_no_client_auth()
            .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
