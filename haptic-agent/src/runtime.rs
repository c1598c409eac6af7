//! Hitless applies: a set that differs from the live one only in what HAProxy's runtime API
//! can change is applied to the running worker through the master socket, verified, and then
//! made live on disk, with no reload.
//!
//! What qualifies ([`plan`]): the same file paths, and
//! - in `haproxy.cfg`, only `server` lines of `backend`/`listen` sections that keep their
//!   name and every parameter but the address (`ip:port`), `weight` and `disabled`/`enabled`
//!   (the server slots of `haptic-render`'s reference templates): `set server ... addr`,
//!   `weight`, `state ready|maint`;
//! - files HAProxy loaded as maps (`show map` names them): the new entries replace the old
//!   in one transaction (`prepare map`, `add map @<version>` with payloads, `commit map`);
//! - files HAProxy loaded as certificates (`show ssl cert`): `set ssl cert` with the new PEM,
//!   then `commit ssl cert`.
//!
//! Every change is verified afterwards (`show servers state`, `show map`, `show ssl cert`
//! with the new certificate's SHA-1 fingerprint). Anything else, a command that fails or a
//! change that does not verify is an [`Error`], and the agent takes its reload path, which
//! makes HAProxy load the whole set from disk whatever the runtime commands did.
//!
//! Commands go to the current worker by pid (`@!<pid>`), one master CLI connection per
//! batch of at most [`MAX_REQUEST`] bytes.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use haptic_agent_client::{FileSet, protocol::MAIN_CONFIG};
use rustls::pki_types::{CertificateDer, pem::PemObject as _};
use sha1::{Digest as _, Sha1};
use tokio::time::Instant;
use tracing::debug;

use crate::haproxy::{self, Haproxy};

/// Errors of this module: why a set cannot be, or was not, applied without a reload.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The set differs from the live one in something the runtime API does not change.
    #[error("needs a reload: {0}")]
    NeedsReload(String),
    /// HAProxy refused a runtime command.
    #[error("runtime command `{command}` failed: {answer}")]
    Command {
        /// The command (without its payload).
        command: String,
        /// HAProxy's answer.
        answer: String,
    },
    /// A change did not verify: HAProxy does not hold what was sent.
    #[error("runtime change did not verify: {0}")]
    Verify(String),
    /// The master CLI could not be used.
    #[error(transparent)]
    Master(#[from] haproxy::Error),
    /// The runtime commands did not finish within the limit.
    #[error("runtime commands did not finish within {0:?}")]
    Timeout(Duration),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Largest master CLI request (commands and payload) sent on one connection. HAProxy's CLI
/// holds a command and its payload in one buffer (`tune.bufsize`, 16 KiB by default).
pub const MAX_REQUEST: usize = 8 << 10;

/// Largest certificate PEM sent through `set ssl cert` (a larger one takes the reload).
pub const MAX_CERT_PAYLOAD: usize = 12 << 10;

/// A `server` line's changeable part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSpec {
    /// Address and port.
    pub address: SocketAddr,
    /// `weight` (HAProxy's default 1).
    pub weight: u32,
    /// Not `disabled`.
    pub enabled: bool,
}

/// One server slot to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerChange {
    /// The backend (or `listen` section).
    pub backend: String,
    /// The server's name.
    pub server: String,
    /// As live.
    pub from: ServerSpec,
    /// As wanted.
    pub to: ServerSpec,
}

impl ServerChange {
    /// The commands that take the server from `from` to `to`: out of service first, in
    /// service last, so that it never takes traffic at a half-changed address.
    fn commands(&self) -> Vec<String> {
        let name = format!("{}/{}", self.backend, self.server);
        let mut commands = Vec::new();
        if self.from.enabled && !self.to.enabled {
            commands.push(format!("set server {name} state maint"));
        }
        if self.from.address != self.to.address {
            commands.push(format!(
                "set server {name} addr {} port {}",
                self.to.address.ip(),
                self.to.address.port()
            ));
        }
        if self.from.weight != self.to.weight {
            commands.push(format!("set server {name} weight {}", self.to.weight));
        }
        if !self.from.enabled && self.to.enabled {
            commands.push(format!("set server {name} state ready"));
        }
        commands
    }
}

/// What a runtime apply changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Server slots to change.
    pub servers: Vec<ServerChange>,
    /// Files other than `haproxy.cfg` whose contents changed (maps or certificates, told
    /// apart by what HAProxy loaded), with their new contents.
    pub files: Vec<(String, bytes::Bytes)>,
}

impl Plan {
    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty() && self.files.is_empty()
    }
}

/// Section keywords of an HAProxy configuration.
const SECTIONS: [&str; 14] = [
    "global",
    "defaults",
    "frontend",
    "backend",
    "listen",
    "peers",
    "resolvers",
    "userlist",
    "mailers",
    "program",
    "http-errors",
    "ring",
    "cache",
    "fcgi-app",
];

/// Characters that make a line or an entry unsafe to change at run time: quoting and
/// escapes (the agent does not re-implement HAProxy's), comments, variables, and the CLI's
/// command separator.
fn unsafe_text(text: &str) -> bool {
    text.contains(['"', '\'', '\\', '#', '$', ';', '\r']) || text.chars().any(char::is_control)
}

/// A `server` line: name, changeable part, and every other token in order.
fn parse_server(line: &str) -> Option<(&str, ServerSpec, Vec<&str>)> {
    if unsafe_text(line) {
        return None;
    }
    let mut tokens = line.split_ascii_whitespace();
    if tokens.next()? != "server" {
        return None;
    }
    let name = tokens.next()?;
    let address: SocketAddr = tokens.next()?.parse().ok()?;
    let mut spec = ServerSpec {
        address,
        weight: 1,
        enabled: true,
    };
    let mut rest = Vec::new();
    while let Some(token) = tokens.next() {
        match token {
            "disabled" => spec.enabled = false,
            "enabled" => spec.enabled = true,
            "weight" => spec.weight = tokens.next()?.parse().ok().filter(|w| *w <= 256)?,
            other => rest.push(other),
        }
    }
    Some((name, spec, rest))
}

/// The server changes between two `haproxy.cfg` texts, or why they differ in more.
pub fn config_changes(live: &str, new: &str) -> Result<Vec<ServerChange>> {
    let (live_lines, new_lines): (Vec<&str>, Vec<&str>) =
        (live.split('\n').collect(), new.split('\n').collect());
    if live_lines.len() != new_lines.len() {
        return Err(Error::NeedsReload(format!(
            "haproxy.cfg has {} lines, the live one {}",
            new_lines.len(),
            live_lines.len()
        )));
    }
    let mut section: (&str, &str) = ("", "");
    let mut changes = Vec::new();
    for (number, (old, new)) in live_lines.iter().zip(&new_lines).enumerate() {
        let differs = || {
            Error::NeedsReload(format!(
                "haproxy.cfg line {} changed beyond a server's address, weight or state",
                number + 1
            ))
        };
        if old == new {
            let mut tokens = old.split_ascii_whitespace();
            if let Some(first) = tokens.next()
                && SECTIONS.contains(&first)
            {
                section = (first, tokens.next().unwrap_or(""));
            }
            continue;
        }
        if !matches!(section.0, "backend" | "listen") {
            return Err(differs());
        }
        let (Some((old_name, from, old_rest)), Some((new_name, to, new_rest))) =
            (parse_server(old), parse_server(new))
        else {
            return Err(differs());
        };
        if old_name != new_name || old_rest != new_rest || unsafe_text(section.1) {
            return Err(differs());
        }
        if from != to {
            changes.push(ServerChange {
                backend: section.1.to_owned(),
                server: new_name.to_owned(),
                from,
                to,
            });
        }
    }
    Ok(changes)
}

/// What would make `new` live from `live` at run time, or why it needs a reload.
pub fn plan(live: &FileSet, new: &FileSet) -> Result<Plan> {
    let paths = |set: &FileSet| {
        set.iter()
            .map(|(path, _)| path.to_owned())
            .collect::<Vec<_>>()
    };
    if paths(live) != paths(new) {
        return Err(Error::NeedsReload("files were added or removed".to_owned()));
    }
    let mut plan = Plan::default();
    for ((path, old), (_, content)) in live.iter().zip(new.iter()) {
        if old == content {
            continue;
        }
        if path == MAIN_CONFIG {
            let text = |bytes| {
                std::str::from_utf8(bytes)
                    .map_err(|_| Error::NeedsReload("haproxy.cfg is not UTF-8".to_owned()))
            };
            plan.servers = config_changes(text(old)?, text(content)?)?;
        } else {
            plan.files.push((path.to_owned(), content.clone()));
        }
    }
    Ok(plan)
}

/// The entries of a map file, as HAProxy reads one: leading blanks skipped, `#` lines and
/// blank lines left out, the key up to the first blank, the value the rest of the line
/// without its leading and trailing blanks.
pub fn map_entries(text: &str) -> Vec<(&str, &str)> {
    text.split(['\n', '\r'])
        .filter_map(|line| {
            let line = line.trim_start_matches(|c: char| c.is_ascii_whitespace());
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let (key, value) = line
                .split_once(|c: char| c.is_ascii_whitespace())
                .unwrap_or((line, ""));
            Some((key, value.trim_matches([' ', '\t'])))
        })
        .collect()
}

/// The SHA-1 fingerprint (uppercase hex, as `show ssl cert` prints it) of the first
/// certificate of a PEM file.
pub fn fingerprint(pem: &[u8]) -> Option<String> {
    let first = CertificateDer::pem_slice_iter(pem).next()?.ok()?;
    Some(hex::encode_upper(Sha1::digest(first.as_ref())))
}

/// One file changed at run time, classified by what HAProxy loaded.
enum FileKind<'a> {
    Map {
        path: &'a str,
        entries: Vec<(&'a str, &'a str)>,
    },
    Cert {
        path: &'a str,
        pem: String,
        fingerprint: String,
    },
}

/// The runtime API of one HAProxy worker, through the master socket.
struct Worker<'a> {
    haproxy: &'a Haproxy,
    prefix: String,
    deadline: Instant,
    limit: Duration,
    /// Changing commands sent.
    ops: u64,
}

impl Worker<'_> {
    /// Sends `request` (one or more commands, each already prefixed) and returns the answer.
    async fn send(&self, request: &str) -> Result<String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(self.limit));
        }
        Ok(self.haproxy.command(request, left).await?)
    }

    /// Sends one command to the worker.
    async fn ask(&self, command: &str) -> Result<String> {
        self.send(&format!("{} {command}", self.prefix)).await
    }

    /// Sends a changing command (with its payload, if any: lines, no blank one) and returns
    /// the answer.
    async fn change(&mut self, command: &str, payload: Option<&str>) -> Result<String> {
        self.ops += 1;
        match payload {
            None => self.ask(command).await,
            // The blank line that ends the payload is the newline `command` adds.
            Some(payload) => {
                self.send(&format!("{} {command} <<\n{payload}\n", self.prefix))
                    .await
            }
        }
    }

    /// Sends changing commands without payloads, batched, and returns their answers.
    async fn change_all(&mut self, commands: &[String]) -> Result<String> {
        let mut answers = String::new();
        let mut batch = String::new();
        for command in commands {
            self.ops += 1;
            batch.push_str(&self.prefix);
            batch.push(' ');
            batch.push_str(command);
            batch.push('\n');
            if batch.len() >= MAX_REQUEST {
                answers.push_str(&self.send(batch.trim_end()).await?);
                batch.clear();
            }
        }
        if !batch.is_empty() {
            answers.push_str(&self.send(batch.trim_end()).await?);
        }
        Ok(answers)
    }
}

/// The names listed by `show map` (`<id> (<name>) ...`) or `show ssl cert` (one a line).
fn listed_maps(answer: &str) -> Vec<&str> {
    answer
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (_, rest) = line.split_once(" (")?;
            Some(rest.split_once(')')?.0)
        })
        .collect()
}

fn listed_certs(answer: &str) -> Vec<&str> {
    answer
        .lines()
        .map(|line| line.trim().trim_start_matches('*'))
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect()
}

/// `show servers state <backend>`: server name -> (address, port, admin state, user weight).
fn servers_state(answer: &str) -> BTreeMap<&str, (&str, &str, u32, &str)> {
    answer
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            if fields.len() < 19 {
                return None;
            }
            let admin = fields[6].parse().ok()?;
            Some((fields[3], (fields[4], fields[18], admin, fields[7])))
        })
        .collect()
}

/// `show map <file>`: its entries in order (`<pointer> <key> <value>`).
fn shown_entries(answer: &str) -> Vec<(&str, &str)> {
    answer
        .lines()
        .filter_map(|line| {
            let (_, entry) = line.split_once(' ')?;
            Some(entry.split_once(' ').unwrap_or((entry, "")))
        })
        .collect()
}

/// HAProxy's admin state bit of a server forced into maintenance (`state maint`,
/// `disabled`).
const ADMIN_FORCED_MAINT: u32 = 0x01;

/// Applies `plan` to HAProxy's current worker and verifies it, within `limit`. Returns the
/// number of changing commands sent; on an error, that number is in `ops`.
pub async fn apply(haproxy: &Haproxy, plan: &Plan, limit: Duration) -> (u64, Result<()>) {
    let deadline = Instant::now() + limit;
    let mut worker = Worker {
        haproxy,
        prefix: String::new(),
        deadline,
        limit,
        ops: 0,
    };
    let result = tokio::time::timeout_at(deadline, run(&mut worker, plan))
        .await
        .unwrap_or(Err(Error::Timeout(limit)));
    (worker.ops, result)
}

async fn run(worker: &mut Worker<'_>, plan: &Plan) -> Result<()> {
    let table = worker
        .haproxy
        .show_proc(worker.deadline.saturating_duration_since(Instant::now()))
        .await?;
    let pid = table
        .workers
        .iter()
        .min_by_key(|w| w.reloads)
        .map(|w| w.pid)
        .ok_or_else(|| Error::NeedsReload("HAProxy runs no worker".to_owned()))?;
    worker.prefix = format!("@!{pid}");

    // Classify and check every file before changing anything.
    let mut kinds = Vec::new();
    if !plan.files.is_empty() {
        let maps = worker.ask("show map").await?;
        let certs = worker.ask("show ssl cert").await?;
        let (maps, certs) = (listed_maps(&maps), listed_certs(&certs));
        for (path, content) in &plan.files {
            let text = std::str::from_utf8(content)
                .map_err(|_| Error::NeedsReload(format!("{path} is not text")))?;
            if maps.contains(&path.as_str()) {
                let entries = map_entries(text);
                if entries
                    .iter()
                    .any(|(key, value)| value.is_empty() || unsafe_text(key) || unsafe_text(value))
                {
                    return Err(Error::NeedsReload(format!(
                        "map {path} has an entry without a value or with characters the \
                         runtime API would not carry as they are"
                    )));
                }
                kinds.push(FileKind::Map { path, entries });
            } else if certs.contains(&path.as_str()) {
                let pem: String = text
                    .lines()
                    .filter(|line| !line.trim().is_empty())
                    .map(|line| format!("{line}\n"))
                    .collect();
                let fingerprint = fingerprint(pem.as_bytes())
                    .ok_or_else(|| Error::NeedsReload(format!("{path} holds no certificate")))?;
                if pem.len() > MAX_CERT_PAYLOAD || unsafe_text(path) {
                    return Err(Error::NeedsReload(format!(
                        "{path} is over {MAX_CERT_PAYLOAD} bytes, more than the runtime API takes"
                    )));
                }
                kinds.push(FileKind::Cert {
                    path,
                    pem,
                    fingerprint,
                });
            } else {
                return Err(Error::NeedsReload(format!(
                    "{path} changed and HAProxy loaded it neither as a map nor as a certificate"
                )));
            }
        }
    }

    if !plan.servers.is_empty() {
        let commands: Vec<String> = plan
            .servers
            .iter()
            .flat_map(ServerChange::commands)
            .collect();
        let answers = worker.change_all(&commands).await?;
        debug!(commands = commands.len(), %answers, "server commands sent");
        verify_servers(worker, &plan.servers).await?;
    }
    for kind in &kinds {
        match kind {
            FileKind::Map { path, entries } => update_map(worker, path, entries).await?,
            FileKind::Cert {
                path,
                pem,
                fingerprint,
            } => update_cert(worker, path, pem, fingerprint).await?,
        }
    }
    Ok(())
}

async fn verify_servers(worker: &Worker<'_>, changes: &[ServerChange]) -> Result<()> {
    let mut by_backend: BTreeMap<&str, Vec<&ServerChange>> = BTreeMap::new();
    for change in changes {
        by_backend.entry(&change.backend).or_default().push(change);
    }
    for (backend, changes) in by_backend {
        let answer = worker.ask(&format!("show servers state {backend}")).await?;
        let state = servers_state(&answer);
        for change in changes {
            let want = change.to;
            let ip = want.address.ip().to_string();
            let port = want.address.port().to_string();
            let weight = want.weight.to_string();
            let ok = state
                .get(change.server.as_str())
                .is_some_and(|&(a, p, admin, w)| {
                    a == ip
                        && p == port
                        && w == weight
                        && (admin & ADMIN_FORCED_MAINT == 0) == want.enabled
                });
            if !ok {
                return Err(Error::Verify(format!(
                    "server {backend}/{} is {:?} after the change, not {want:?}",
                    change.server,
                    state.get(change.server.as_str())
                )));
            }
        }
    }
    Ok(())
}

async fn update_map(worker: &mut Worker<'_>, path: &str, entries: &[(&str, &str)]) -> Result<()> {
    let prepare = format!("prepare map {path}");
    let answer = worker.change(&prepare, None).await?;
    let version = answer
        .trim()
        .strip_prefix("New version created:")
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| Error::Command {
            command: prepare.clone(),
            answer: answer.trim().to_owned(),
        })?
        .to_owned();
    let add = format!("add map @{version} {path}");
    let mut payload = String::new();
    let send = async |worker: &mut Worker<'_>, payload: &str| -> Result<()> {
        let answer = worker.change(&add, Some(payload)).await?;
        if !answer.trim().is_empty() {
            return Err(Error::Command {
                command: add.clone(),
                answer: answer.trim().to_owned(),
            });
        }
        Ok(())
    };
    for (key, value) in entries {
        if !payload.is_empty() && payload.len() + key.len() + value.len() + 2 > MAX_REQUEST {
            send(worker, &payload).await?;
            payload.clear();
        }
        if !payload.is_empty() {
            payload.push('\n');
        }
        payload.push_str(key);
        payload.push(' ');
        payload.push_str(value);
    }
    if !payload.is_empty() {
        send(worker, &payload).await?;
    }
    let commit = format!("commit map @{version} {path}");
    let answer = worker.change(&commit, None).await?;
    if !answer.trim().is_empty() {
        return Err(Error::Command {
            command: commit,
            answer: answer.trim().to_owned(),
        });
    }
    let shown = worker.ask(&format!("show map {path}")).await?;
    let shown = shown_entries(&shown);
    if shown != entries {
        return Err(Error::Verify(format!(
            "map {path} holds {} entries after the commit, {} expected, or other ones",
            shown.len(),
            entries.len()
        )));
    }
    Ok(())
}

async fn update_cert(
    worker: &mut Worker<'_>,
    path: &str,
    pem: &str,
    fingerprint: &str,
) -> Result<()> {
    let set = format!("set ssl cert {path}");
    let answer = worker.change(&set, Some(pem.trim_end())).await?;
    if !answer.contains("Transaction") || answer.contains("rror") {
        let _ = worker.ask(&format!("abort ssl cert {path}")).await;
        return Err(Error::Command {
            command: set,
            answer: answer.trim().to_owned(),
        });
    }
    let commit = format!("commit ssl cert {path}");
    let answer = worker.change(&commit, None).await?;
    if !answer.contains("Success!") {
        let _ = worker.ask(&format!("abort ssl cert {path}")).await;
        return Err(Error::Command {
            command: commit,
            answer: answer.trim().to_owned(),
        });
    }
    let shown = worker.ask(&format!("show ssl cert {path}")).await?;
    let served = shown
        .lines()
        .find_map(|line| line.strip_prefix("SHA1 FingerPrint:"))
        .map(str::trim);
    if served != Some(fingerprint) {
        return Err(Error::Verify(format!(
            "certificate {path} has fingerprint {served:?} after the commit, not {fingerprint}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIVE: &str = "global\n    maxconn 10\n\nbackend be_a\n    balance roundrobin\n    \
        server s1 10.0.0.1:80 check\n    server s2 127.0.0.1:1 disabled check\n";

    #[test]
    fn server_slot_changes_are_planned_and_anything_else_needs_a_reload() {
        let new = LIVE
            .replace("s1 10.0.0.1:80 check", "s1 10.0.0.9:8080 disabled check")
            .replace(
                "s2 127.0.0.1:1 disabled check",
                "s2 [fd00::2]:81 weight 5 check",
            );
        let changes = config_changes(LIVE, &new).expect("runtime");
        assert_eq!(changes.len(), 2);
        assert_eq!(
            changes[0].commands(),
            [
                "set server be_a/s1 state maint",
                "set server be_a/s1 addr 10.0.0.9 port 8080"
            ]
        );
        assert_eq!(
            changes[1].commands(),
            [
                "set server be_a/s2 addr fd00::2 port 81",
                "set server be_a/s2 weight 5",
                "set server be_a/s2 state ready"
            ]
        );
        for reload in [
            LIVE.replace("maxconn 10", "maxconn 11"),
            LIVE.replace("s2 127.0.0.1:1", "s3 127.0.0.1:1"),
            LIVE.replace("s1 10.0.0.1:80 check", "s1 10.0.0.1:80"),
            LIVE.replace("s1 10.0.0.1:80", "s1 web.example:80"),
            LIVE.replace("s1 10.0.0.1:80 check", "s1 10.0.0.2:80 check # x"),
            format!("{LIVE}    server s3 127.0.0.1:1 disabled check\n"),
        ] {
            assert!(
                matches!(config_changes(LIVE, &reload), Err(Error::NeedsReload(_))),
                "{reload}"
            );
        }
    }

    #[test]
    fn map_files_read_as_haproxy_reads_them() {
        let text = "# routes\n\n  a.example/ be_a \nb.example/\tbe_b x\r\nlonely\n";
        assert_eq!(
            map_entries(text),
            [
                ("a.example/", "be_a"),
                ("b.example/", "be_b x"),
                ("lonely", "")
            ]
        );
        let shown = "0x55a0 a.example/ be_a\n0x55a1 b.example/ be_b x\n\n";
        assert_eq!(
            shown_entries(shown),
            [("a.example/", "be_a"), ("b.example/", "be_b x")]
        );
        let list = "# id (file) description\n0 (maps/hosts.map) pattern loaded from file 'maps/hosts.map' used by map\n";
        assert_eq!(listed_maps(list), ["maps/hosts.map"]);
        assert_eq!(
            listed_certs("# filename\nssl/a.pem\n*ssl/b.pem\n"),
            ["ssl/a.pem", "ssl/b.pem"]
        );
    }
}
