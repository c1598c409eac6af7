//! Optional TLS on the agent's listener: rustls on `ring`, a certificate chain and key read
//! from PEM files and read again when either file changes (a rotated Secret), so the agent
//! never needs a restart for a new certificate.

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

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM certificate or key.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration")]
    Rustls(#[source] rustls::Error),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where the listener's certificate chain and private key are (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// The files' modification times and sizes: a change means a reload.
type Stamp = Option<(SystemTime, u64, SystemTime, u64)>;

fn stamp(files: &TlsFiles) -> Stamp {
    let cert = std::fs::metadata(&files.cert).ok()?;
    let key = std::fs::metadata(&files.key).ok()?;
    Some((
        cert.modified().ok()?,
        cert.len(),
        key.modified().ok()?,
        key.len(),
    ))
}

fn load(files: &TlsFiles) -> Result<Arc<CertifiedKey>> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| Error::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    let pem_error = |path: &Path, reason: String| Error::Pem {
        path: path.to_path_buf(),
        reason,
    };
    let cert_pem = read(&files.cert)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|error| pem_error(&files.cert, error.to_string()))?;
    if chain.is_empty() {
        return Err(pem_error(&files.cert, "no certificate".to_owned()));
    }
    let key_pem = read(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|error| pem_error(&files.key, error.to_string()))?;
    let signing = ring::sign::any_supported_type(&key).map_err(Error::Rustls)?;
    let certified = CertifiedKey::new(chain, signing);
    // A pair caught half-rotated (a new key, the old certificate) is not served.
    certified.keys_match().map_err(|error| {
        pem_error(
            &files.key,
            format!("the key does not match the certificate: {error}"),
        )
    })?;
    Ok(Arc::new(certified))
}

/// The certificate in use, read again when its files change.
struct Reloading {
    files: TlsFiles,
    current: Mutex<(Stamp, Arc<CertifiedKey>)>,
}

impl fmt::Debug for Reloading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloading")
            .field("files", &self.files)
            .finish()
    }
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // Two `stat`s a handshake: cheap next to the handshake itself, and a rotated
        // certificate is served from the next connection on.
        let now = stamp(&self.files);
        let mut current = self.current.lock().ok()?;
        if now.is_some() && now != current.0 {
            match load(&self.files) {
                Ok(key) => {
                    info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                    *current = (now, key);
                }
                // A half-written pair (the key renamed before the certificate): keep serving
                // the old one, and try again at the next handshake.
                Err(error) => {
                    warn!(%error, "reloading the TLS certificate failed; keeping the old one")
                }
            }
        }
        Some(current.1.clone())
    }
}

/// A TLS acceptor serving `files`, read now (an error if they are unusable) and again
/// whenever they change.
pub fn acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor> {
    let stamped = stamp(files);
    let key = load(files)?;
    let resolver = Arc::new(Reloading {
        files: files.clone(),
        current: Mutex::new((stamped, key)),
    });
    let mut config =
        rustls::ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(Error::Rustls)?
            .with_no_client_auth()
            .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
