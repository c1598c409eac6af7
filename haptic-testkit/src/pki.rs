//! A throwaway PKI for the agent channel's mutual TLS in tests, the demo and the fault
//! campaign: a CA, one agent serving certificate (for the given pod IPs and a DNS name), and a
//! controller client certificate, written as PEM files.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};

/// The DNS name the test agents' certificate carries (for `--agent-server-name`).
pub const AGENT_DNS_NAME: &str = "haptic-agent.test";

/// Why the PKI could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// rcgen refused a parameter.
    #[error("generating a test certificate")]
    Generate(#[from] rcgen::Error),
    /// A file could not be written.
    #[error("writing {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The files of a test PKI (PEM).
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate: the agents' client CA and the controller's agent CA.
    pub ca: PathBuf,
    /// The agents' serving certificate and key.
    pub agent_cert: PathBuf,
    /// See [`TestPki::agent_cert`].
    pub agent_key: PathBuf,
    /// The controller's client certificate and key.
    pub controller_cert: PathBuf,
    /// See [`TestPki::controller_cert`].
    pub controller_key: PathBuf,
}

/// A CA certificate's PEM and the issuer that signs with it.
pub struct TestCa {
    /// The CA certificate (PEM).
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A fresh self-signed CA named `name`.
    pub fn new(name: &str) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key)?;
        Ok(Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A leaf for `names` (IP addresses become IP SANs) for `purpose`: (certificate, key) PEM.
    pub fn issue(
        &self,
        common_name: &str,
        names: &[String],
        purpose: ExtendedKeyUsagePurpose,
    ) -> Result<(String, String), PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A server certificate for `names`.
    pub fn server(&self, names: &[String]) -> Result<(String, String), PkiError> {
        self.issue("haptic-agent", names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> Result<(String, String), PkiError> {
        self.issue(name, &[], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

fn write(path: PathBuf, text: &str) -> Result<PathBuf, PkiError> {
    std::fs::write(&path, text).map_err(|source| PkiError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

impl TestPki {
    /// A CA, an agent certificate for `agent_ips` and [`AGENT_DNS_NAME`], and a controller
    /// client certificate, written into `dir`.
    pub fn generate(dir: &Path, agent_ips: &[&str]) -> Result<Self, PkiError> {
        let ca = TestCa::new("haptic test CA")?;
        let mut names: Vec<String> = agent_ips.iter().map(|ip| (*ip).to_owned()).collect();
        names.push(AGENT_DNS_NAME.to_owned());
        let (agent_cert, agent_key) = ca.server(&names)?;
        let (controller_cert, controller_key) = ca.client("haptic-controller")?;
        Ok(Self {
            ca: write(dir.join("ca.crt"), &ca.pem)?,
            agent_cert: write(dir.join("agent.crt"), &agent_cert)?,
            agent_key: write(dir.join("agent.key"), &agent_key)?,
            controller_cert: write(dir.join("controller.crt"), &controller_cert)?,
            controller_key: write(dir.join("controller.key"), &controller_key)?,
        })
    }

    /// The `haptic-agent` flags that serve mutual TLS with these files.
    pub fn agent_args(&self) -> Vec<OsString> {
        vec![
            "--tls-cert".into(),
            self.agent_cert.clone().into(),
            "--tls-key".into(),
            self.agent_key.clone().into(),
            "--client-ca".into(),
            self.ca.clone().into(),
        ]
    }

    /// The `haptic-controller run` flags that reach the agents over mutual TLS (verifying
    /// each agent by its pod IP).
    pub fn controller_args(&self) -> Vec<OsString> {
        vec![
            "--agent-ca".into(),
            self.ca.clone().into(),
            "--agent-client-cert".into(),
            self.controller_cert.clone().into(),
            "--agent-client-key".into(),
            self.controller_key.clone().into(),
        ]
    }
}
