//! The agent channel's certificates when none are configured: a CA the controller generates
//! once and keeps in a Secret it owns (`haptic-agent-ca`, the CA's certificate and key), the
//! agents' serving certificate issued from it into the Secret their pods mount
//! (`haptic-agent-tls`: `tls.crt`, `tls.key`, `ca.crt`, for `haptic-agent.<namespace>.svc`), and
//! this replica's client certificate, issued in memory at start and never stored.
//!
//! Every replica runs this at start: the first creates the Secrets, the others (an
//! `AlreadyExists` answer) read them. Who can read the CA's key: whoever may `get` Secrets in
//! the controller's namespace (the controller's ServiceAccount and cluster administrators); the
//! HAProxy pods mount only `haptic-agent-tls`, which holds no CA key.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tracing::{info, warn};

use crate::channel::MtlsFiles;

/// The Secret holding the generated CA (certificate and key).
pub const CA_SECRET: &str = "haptic-agent-ca";
/// The Secret the agents mount: their serving certificate and the CA.
pub const AGENT_SECRET: &str = "haptic-agent-tls";

/// Why the generated certificates could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API refused a read or a create.
    #[error("the Secret {name}")]
    Api {
        /// The Secret.
        name: &'static str,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The Secret exists without the keys it must hold.
    #[error("the Secret {name} has no {key}; delete it to let the controller make it again")]
    Missing {
        /// The Secret.
        name: &'static str,
        /// The key.
        key: &'static str,
    },
    /// A certificate could not be generated or the CA's key read.
    #[error("generating a certificate")]
    Generate(#[from] rcgen::Error),
    /// A file of this replica's client identity could not be written.
    #[error("writing {path}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The DNS name the agents' certificate carries and the controller verifies.
pub fn agent_name(namespace: &str) -> String {
    format!("haptic-agent.{namespace}.svc")
}

/// The CA's parameters: the same every time, so an issuer rebuilt from the stored key signs
/// certificates that chain to the stored CA certificate.
fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
        .distinguished_name
        .push(DnType::CommonName, "haptic-agent-ca");
    // The CA lives ten years; its stored certificate keeps the validity it was made with.
    let year = this_year();
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + 10, 1, 1);
    Ok(params)
}

/// The current year (UTC); validity starts at the beginning of the previous one (clock skew).
fn this_year() -> i32 {
    i32::from(
        jiff::Timestamp::now()
            .to_zoned(jiff::tz::TimeZone::UTC)
            .year(),
    )
}

fn leaf(
    names: Vec<String>,
    common_name: &str,
    purpose: ExtendedKeyUsagePurpose,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![purpose];
    // Two years: rotate by deleting the Secret (a new one is issued at the next start).
    let year = this_year();
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + 2, 1, 1);
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn secret<const N: usize>(name: &'static str, type_: &str, data: [(&str, &str); N]) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/managed-by".to_owned(),
                    "haptic-controller".to_owned(),
                ),
                ("app.kubernetes.io/part-of".to_owned(), "haptic".to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        type_: Some(type_.to_owned()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

fn text(secret: &Secret, name: &'static str, key: &'static str) -> Result<String, Error> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .ok_or(Error::Missing { name, key })
}

/// Creates `secret` unless it exists; returns what is stored (ours, or another replica's).
async fn create_or_read(
    api: &Api<Secret>,
    name: &'static str,
    make: impl FnOnce() -> Result<Secret, Error>,
) -> Result<Secret, Error> {
    if let Some(existing) = api
        .get_opt(name)
        .await
        .map_err(|source| Error::Api { name, source })?
    {
        return Ok(existing);
    }
    match api.create(&PostParams::default(), &make()?).await {
        Ok(created) => {
            info!(secret = name, "created the agent channel's Secret");
            Ok(created)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => api
            .get(name)
            .await
            .map_err(|source| Error::Api { name, source }),
        Err(source) => Err(Error::Api { name, source }),
    }
}

/// Makes sure both Secrets exist in `namespace`, issues this replica's client certificate, and
/// writes the files the channel reads into `dir`.
pub async fn ensure(client: Client, namespace: &str, dir: &Path) -> Result<MtlsFiles, Error> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let ca = create_or_read(&api, CA_SECRET, || {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(secret(
            CA_SECRET,
            "Opaque",
            [("ca.crt", &cert.pem()), ("ca.key", &key.serialize_pem())],
        ))
    })
    .await?;
    let ca_pem = text(&ca, CA_SECRET, "ca.crt")?;
    let ca_key = KeyPair::from_pem(&text(&ca, CA_SECRET, "ca.key")?)?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let name = agent_name(namespace);
    let agents = create_or_read(&api, AGENT_SECRET, || {
        let (cert, key) = leaf(
            vec![name.clone()],
            "haptic-agent",
            ExtendedKeyUsagePurpose::ServerAuth,
            &issuer,
        )?;
        Ok(secret(
            AGENT_SECRET,
            "kubernetes.io/tls",
            [("tls.crt", &cert), ("tls.key", &key), ("ca.crt", &ca_pem)],
        ))
    })
    .await?;
    if text(&agents, AGENT_SECRET, "ca.crt").ok().as_deref() != Some(ca_pem.as_str()) {
        warn!(
            secret = AGENT_SECRET,
            ca = CA_SECRET,
            "the agents' Secret was not issued by the controller's CA: the agents will refuse this controller; delete it to let the controller issue it, or configure --agent-ca and the client certificate"
        );
    }
    let (cert, key) = leaf(
        Vec::new(),
        "haptic-controller",
        ExtendedKeyUsagePurpose::ClientAuth,
        &issuer,
    )?;
    let write = |file: &str, content: &str| {
        let path = dir.join(file);
        std::fs::write(&path, content).map_err(|source| Error::Write {
            path: path.display().to_string(),
            source,
        })?;
        Ok::<_, Error>(path)
    };
    Ok(MtlsFiles {
        ca: write("ca.crt", &ca_pem)?,
        identity: haptic_agent_client::tls::PairFiles {
            cert: write("tls.crt", &cert)?,
            key: write("tls.key", &key)?,
        },
        server_name: Some(name),
    })
}
