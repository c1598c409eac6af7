//! TLS on the agent's listener: mutual TLS by default in the binary. The listener config is
//! the project's one ([`haptic_agent_client::tls::server_config`]): the certificate, its key and
//! the client CA bundle are read from PEM files and read again at the first handshake after
//! one changed (a rotated Secret), so the agent never needs a restart for them.

use std::path::PathBuf;

use haptic_agent_client::tls::{PairFiles, server_config};

pub use haptic_agent_client::tls::{Error, Result};

/// Where the listener's certificate chain, private key and client CA are (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA bundle a client certificate must be issued by (mutual TLS); none: no client
    /// certificate is asked for (the bearer token alone authenticates).
    pub client_ca: Option<PathBuf>,
}

/// A TLS acceptor serving `files`, read now (an error if they are unusable) and again whenever
/// they change.
pub fn acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor> {
    let pair = PairFiles {
        cert: files.cert.clone(),
        key: files.key.clone(),
    };
    let config = server_config(&pair, files.client_ca.as_deref())?;
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
}
