//! The agent's settings: a plain struct with documented defaults and a `validate()`.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use haptic_agent_client::policy::Policy;

use crate::haproxy::RunAs;

/// Errors of this module: a broken rule, named.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting breaks a rule.
    #[error("invalid agent configuration: {0}")]
    Invalid(&'static str),
    /// The config policy's allow-lists are malformed.
    #[error("invalid agent configuration")]
    Policy(#[source] haptic_agent_client::PolicyError),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Agent settings. Build with [`AgentConfig::new`]; every field is public.
#[derive(Clone)]
pub struct AgentConfig {
    /// Address to serve the API on (default `0.0.0.0:9090`).
    pub listen: SocketAddr,
    /// The bearer token every `/v1` request must carry. Must not be empty.
    pub token: String,
    /// A file holding the token (default none): when set, it is read again whenever it
    /// changes (a rotated Secret), and its token replaces `token` from then on, with no
    /// restart. A change that leaves the file empty or unreadable keeps the previous token.
    pub token_file: Option<PathBuf>,
    /// The HAProxy binary (default `haproxy`, found on `PATH` or in `/usr/sbin`).
    pub haproxy_bin: PathBuf,
    /// The data directory (fence, sets, `current` symlink). Must be absolute.
    pub data_dir: PathBuf,
    /// HAProxy's master CLI socket (default `<data_dir>/master.sock`).
    pub master_socket: PathBuf,
    /// Start and supervise HAProxy in master-worker mode (default false: HAProxy is run by
    /// someone else with `-W -S <master_socket> -C <data_dir>/current -f <data_dir>/current/haproxy.cfg`).
    pub supervise: bool,
    /// Largest request body accepted on the wire (default 64 MiB).
    pub max_body_bytes: usize,
    /// Largest body accepted after gzip inflation (default 256 MiB).
    pub max_inflated_bytes: usize,
    /// Limit for `haproxy -c` (default 60 s).
    pub check_timeout: Duration,
    /// Limit for a reload and its confirmation, or a supervised start (default 60 s).
    pub reload_timeout: Duration,
    /// How much longer the agent waits, still holding the apply lock and reporting not
    /// ready, for a master that had not finished a reload within `reload_timeout` (default
    /// 60 s). In supervised mode a master that has not finished by then is restarted on the
    /// current set.
    pub settle_timeout: Duration,
    /// What a set may do (default [`Policy::default`], the strict one: no Lua, programs,
    /// external checks, environment directives, no file outside the set, only the
    /// environment variables `POD_IP`, `POD_NAME`, `POD_NAMESPACE`, `HOSTNAME`). Checked on
    /// every apply before anything is written or `haproxy -c` runs.
    pub policy: Policy,
    /// The user HAProxy and `haproxy -c` run as (default none: the agent's own). Set it when
    /// the agent runs as root. The data directory and the sets are then given this user's
    /// group, readable and not writable (0750 directories, 0640 files), and the master
    /// socket, by default, moves to `<data_dir>/run/master.sock` (a directory the user owns,
    /// since HAProxy creates the socket).
    pub haproxy_user: Option<RunAs>,
    /// Most connections served at once (default 256); one more is closed at once, so slow or
    /// idle clients cannot exhaust the agent's memory or file descriptors.
    pub max_connections: usize,
    /// Limit for a client to send a request's headers, also the idle limit of a kept-alive
    /// connection between requests (default 15 s): a connection that sends nothing is closed.
    pub header_read_timeout: Duration,
    /// Limit for receiving a whole request body once the headers are in and the token checked
    /// (default 120 s: 64 MiB at about 0.5 MiB/s); slower: 408.
    pub body_timeout: Duration,
    /// Longest an apply waits for another one in progress before it is answered 503
    /// (default 30 s).
    pub lock_timeout: Duration,
    /// Serve the API over TLS with this certificate and key, and with a client CA require a
    /// client certificate it issued (mutual TLS; default none: plain HTTP, which the binary
    /// allows only with `--insecure-plain-http`). The files are read again when they change.
    pub tls: Option<crate::tls::TlsFiles>,
    /// Also serve `/healthz`, `/readyz` and `/metrics` in plain HTTP on this address (default
    /// none): the kubelet's probes and Prometheus cannot present the client certificate the
    /// API's mutual TLS requires.
    pub probe_listen: Option<SocketAddr>,
    /// Apply a set that differs from the live one only in server addresses, ports, weights
    /// and states, map entries or certificate contents through HAProxy's runtime API, with
    /// no reload (default true; see [`crate::runtime`]). False: every change reloads.
    pub runtime_updates: bool,
    /// Limit for the runtime commands of one apply and their verification (default 5 s);
    /// past it the apply falls back to the reload.
    pub runtime_timeout: Duration,
    /// The meter the agent records on (default none: the global provider's `haptic-agent`
    /// meter when the agent opens, a no-op until the binary installs a provider).
    pub meter: Option<opentelemetry::metrics::Meter>,
    /// What `/metrics` serves: the binary's exporter (default none: `/metrics` answers 404).
    pub exposition: Option<crate::metrics::Exposition>,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("listen", &self.listen)
            .field("token", &"<redacted>")
            .field("token_file", &self.token_file)
            .field("haproxy_bin", &self.haproxy_bin)
            .field("data_dir", &self.data_dir)
            .field("master_socket", &self.master_socket)
            .field("supervise", &self.supervise)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_inflated_bytes", &self.max_inflated_bytes)
            .field("check_timeout", &self.check_timeout)
            .field("reload_timeout", &self.reload_timeout)
            .field("settle_timeout", &self.settle_timeout)
            .field("policy", &self.policy)
            .field("haproxy_user", &self.haproxy_user)
            .field("max_connections", &self.max_connections)
            .field("header_read_timeout", &self.header_read_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("lock_timeout", &self.lock_timeout)
            .field("tls", &self.tls)
            .field("probe_listen", &self.probe_listen)
            .field("runtime_updates", &self.runtime_updates)
            .field("runtime_timeout", &self.runtime_timeout)
            .field("meter", &self.meter)
            .field("exposition", &self.exposition)
            .finish()
    }
}

impl AgentConfig {
    /// Defaults (documented on each field) for `data_dir` and `token`.
    pub fn new(data_dir: impl Into<PathBuf>, token: impl Into<String>) -> Self {
        let data_dir = data_dir.into();
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            token: token.into(),
            token_file: None,
            haproxy_bin: PathBuf::from("haproxy"),
            master_socket: data_dir.join("master.sock"),
            data_dir,
            supervise: false,
            max_body_bytes: 64 << 20,
            max_inflated_bytes: 256 << 20,
            check_timeout: Duration::from_secs(60),
            reload_timeout: Duration::from_secs(60),
            settle_timeout: Duration::from_secs(60),
            policy: Policy::default(),
            haproxy_user: None,
            max_connections: 256,
            header_read_timeout: Duration::from_secs(15),
            body_timeout: Duration::from_secs(120),
            lock_timeout: Duration::from_secs(30),
            tls: None,
            probe_listen: None,
            runtime_updates: true,
            runtime_timeout: Duration::from_secs(5),
            meter: None,
            exposition: None,
        }
    }

    /// Sets [`AgentConfig::meter`] and [`AgentConfig::exposition`].
    #[must_use]
    pub fn with_metrics(
        mut self,
        meter: opentelemetry::metrics::Meter,
        exposition: crate::metrics::Exposition,
    ) -> Self {
        self.meter = Some(meter);
        self.exposition = Some(exposition);
        self
    }

    /// Sets [`AgentConfig::listen`].
    #[must_use]
    pub fn with_listen(mut self, listen: SocketAddr) -> Self {
        self.listen = listen;
        self
    }

    /// Sets [`AgentConfig::runtime_updates`].
    #[must_use]
    pub fn with_runtime_updates(mut self, runtime_updates: bool) -> Self {
        self.runtime_updates = runtime_updates;
        self
    }

    /// Sets [`AgentConfig::supervise`].
    #[must_use]
    pub fn with_supervise(mut self, supervise: bool) -> Self {
        self.supervise = supervise;
        self
    }

    /// Sets [`AgentConfig::policy`].
    #[must_use]
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`AgentConfig::haproxy_user`]; a master socket still at its default moves to
    /// `<data_dir>/run/master.sock`.
    #[must_use]
    pub fn with_haproxy_user(mut self, user: RunAs) -> Self {
        if self.master_socket == self.data_dir.join("master.sock") {
            self.master_socket = self.data_dir.join("run").join("master.sock");
        }
        self.haproxy_user = Some(user);
        self
    }

    /// Sets [`AgentConfig::haproxy_bin`].
    #[must_use]
    pub fn with_haproxy_bin(mut self, bin: impl Into<PathBuf>) -> Self {
        self.haproxy_bin = bin.into();
        self
    }

    /// The longest an apply can take with these limits, the client's timeout must exceed it:
    /// the wait for an apply in progress, `haproxy -c`, then loading the set and, when it
    /// fails, restoring the previous one, each load bounded by a reload, the wait for a reload
    /// that did not finish in time and a supervised restart, itself a graceful stop
    /// (`supervisor::STOP_GRACE` and 5 s more) and a start
    /// (`lock + runtime + check + 2 x (reload + settle + stop + reload)`; 475 s with the
    /// defaults: a runtime attempt that fails falls back to that reload path).
    /// Without a supervisor, an apply that first waits for an earlier unfinished reload can
    /// take one `reload_timeout` and one such load more.
    pub fn apply_time_limit(&self) -> Duration {
        let stop = crate::supervisor::STOP_GRACE + Duration::from_secs(5);
        let load = self.reload_timeout + self.settle_timeout + stop + self.reload_timeout;
        self.lock_timeout + self.runtime_timeout + self.check_timeout + load * 2
    }

    /// Checks the rules: a token, an absolute data directory, non-zero limits, and an
    /// inflation limit no smaller than the body limit.
    pub fn validate(&self) -> Result<()> {
        if self.token.trim().is_empty() {
            return Err(Error::Invalid("token must not be empty"));
        }
        if !self.data_dir.is_absolute() {
            return Err(Error::Invalid("data_dir must be absolute"));
        }
        if self.max_body_bytes == 0 || self.max_inflated_bytes < self.max_body_bytes {
            return Err(Error::Invalid(
                "max_body_bytes must be above zero and max_inflated_bytes at least as large",
            ));
        }
        if self.check_timeout.is_zero()
            || self.reload_timeout.is_zero()
            || self.settle_timeout.is_zero()
            || self.header_read_timeout.is_zero()
            || self.body_timeout.is_zero()
            || self.lock_timeout.is_zero()
        {
            return Err(Error::Invalid("timeouts must be above zero"));
        }
        if self.max_connections == 0 {
            return Err(Error::Invalid("max_connections must be at least 1"));
        }
        self.policy.validate().map_err(Error::Policy)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_named() {
        assert!(AgentConfig::new("/data", "t").validate().is_ok());
        let error = AgentConfig::new("relative", "t")
            .validate()
            .expect_err("relative");
        assert!(error.to_string().contains("absolute"));
        let error = AgentConfig::new("/data", " ")
            .validate()
            .expect_err("no token");
        assert!(error.to_string().contains("token"));
        assert_eq!(
            AgentConfig::new("/data", "t").master_socket,
            PathBuf::from("/data/master.sock")
        );
    }
}
