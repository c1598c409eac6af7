//! The default certificate (every replica, once at start): a self-signed certificate the
//! controller generates and keeps in a `kubernetes.io/tls` Secret of its own namespace, so
//! that a client whose SNI matches no host, or that sends none, completes its handshake with
//! it instead of being refused.
//!
//! Create-if-absent: every replica tries to create the Secret with a certificate it generated;
//! the first create wins, the others get `AlreadyExists` and keep the one there. So every
//! replica, and every restart, serves the same certificate; nothing is ever rewritten. The
//! templates reach it like any TLS Secret (the reference config watches `kubernetes.io/tls`
//! Secrets and names this one in `extraContext.haproxy.default_certificate`); a Secret of the
//! operator's own can be named there instead, and `--default-certificate-secret none` turns the
//! generation off.

use std::time::Duration;

use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

/// The Secret's name unless configured (`--default-certificate-secret`).
pub const DEFAULT_SECRET: &str = "haptic-default-certificate";

/// The certificate's common name.
pub const COMMON_NAME: &str = "haptic-default";

/// Why the default certificate could not be made or stored.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Generating the key or the certificate failed.
    #[error("generating the default certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// The API refused the Secret (other than because it exists).
    #[error("creating Secret {namespace}/{name}: {source}")]
    Create {
        /// The namespace.
        namespace: String,
        /// The Secret's name.
        name: String,
        /// The API's answer.
        #[source]
        source: kube::Error,
    },
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A self-signed P-256 certificate (CN [`COMMON_NAME`], ten years) and its key, as PEM.
pub fn generate() -> Result<(String, String)> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = rcgen::CertificateParams::new(vec![COMMON_NAME.to_owned()])?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, COMMON_NAME);
    let now = std::time::SystemTime::now();
    params.not_before = (now - Duration::from_secs(24 * 3600)).into();
    params.not_after = (now + Duration::from_secs(10 * 365 * 24 * 3600)).into();
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Creates the Secret `namespace/name` with a new certificate unless it exists. `Ok(true)`
/// when this call created it.
#[instrument(skip(client))]
pub async fn ensure(client: Client, namespace: &str, name: &str) -> Result<bool> {
    let (crt, key) = generate()?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(
                [
                    ("app.kubernetes.io/managed-by", "haptic-controller"),
                    ("app.kubernetes.io/part-of", "haptic"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(
            [
                ("tls.crt".to_owned(), ByteString(crt.into_bytes())),
                ("tls.key".to_owned(), ByteString(key.into_bytes())),
            ]
            .into(),
        ),
        ..Secret::default()
    };
    let api: Api<Secret> = Api::namespaced(client, namespace);
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(true),
        // Another replica (or an earlier start) made it: that one is the default.
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(source) => Err(Error::Create {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            source,
        }),
    }
}

/// The component: [`ensure`] until it succeeds (backing off from 1 s to 60 s between tries),
/// then nothing until `token` fires.
pub async fn component(client: Client, namespace: String, name: String, token: CancellationToken) {
    let mut backoff = Duration::from_secs(1);
    loop {
        let attempt = tokio::select! {
            () = token.cancelled() => return,
            attempt = ensure(client.clone(), &namespace, &name) => attempt,
        };
        match attempt {
            Ok(true) => {
                info!(%namespace, %name, "created the default certificate's Secret");
                break;
            }
            Ok(false) => {
                info!(%namespace, %name, "the default certificate's Secret exists; serving it");
                break;
            }
            Err(error) => {
                warn!(%error, retry_in = ?backoff, "the default certificate is not stored yet: clients without a matching SNI are refused until it is");
            }
        }
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(60));
    }
    token.cancelled().await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn the_generated_certificate_is_usable_and_named_haptic_default() {
        let (crt, key) = super::generate().unwrap();
        let usable = haptic_render::certificate::check_pem(
            &crt,
            &key,
            haptic_render::certificate::now_unix(),
        )
        .unwrap();
        assert!(usable.not_after > haptic_render::certificate::now_unix() + 9 * 365 * 24 * 3600);
        use rustls::pki_types::pem::PemObject as _;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(crt.as_bytes()).unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert_eq!(cert.subject().to_string(), "CN=haptic-default");
    }
}
