//! How the controller reaches the agents: mutual TLS by default (the agent's serving
//! certificate verified against a CA bundle, for its pod IP or for one DNS name every agent
//! certificate carries; the controller's own client certificate presented), every file read
//! again when it changes; or plain HTTP, only when asked for by name.

use std::{path::PathBuf, sync::Arc};

use haptic_agent_client::{ClientConfig, tls::PairFiles};

/// Why the channel could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A certificate, key or CA file is unusable.
    #[error("the agent channel's TLS files")]
    Tls(#[from] haptic_agent_client::tls::Error),
}

/// Where the channel's files are (PEM; each read again when it changes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MtlsFiles {
    /// The CA bundle the agents' serving certificates are issued by.
    pub ca: PathBuf,
    /// The controller's client certificate and key (issued by the CA the agents trust).
    pub identity: PairFiles,
    /// The DNS name every agent certificate carries (e.g. `haptic-agent.haptic-system.svc`);
    /// none: each agent's certificate must name its pod IP.
    pub server_name: Option<String>,
}

/// The channel to the agents.
#[derive(Debug, Clone)]
pub enum AgentChannel {
    /// Mutual TLS, with the rustls configuration built once from [`MtlsFiles`] (it re-reads
    /// them itself).
    Mtls(Arc<rustls::ClientConfig>),
    /// Plain HTTP (`--agent-insecure-plain-http`): the token and every private key of the set
    /// cross the pod network in clear text.
    PlainHttp,
}

impl AgentChannel {
    /// Mutual TLS from `files`, loaded now: an error when one is unusable.
    pub fn mtls(files: &MtlsFiles) -> Result<Self, Error> {
        let config = haptic_agent_client::tls::client_config(
            &files.ca,
            files.server_name.as_deref(),
            Some(&files.identity),
        )?;
        Ok(Self::Mtls(Arc::new(config)))
    }

    /// The URL scheme agents are reached with.
    pub fn scheme(&self) -> &'static str {
        match self {
            Self::Mtls(_) => "https",
            Self::PlainHttp => "http",
        }
    }

    /// `config` with this channel's TLS.
    pub fn client_config(&self, config: ClientConfig) -> ClientConfig {
        match self {
            Self::Mtls(tls) => config.with_tls((**tls).clone()),
            Self::PlainHttp => config,
        }
    }
}
