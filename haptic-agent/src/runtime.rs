//! Hitless applies: a set that differs from the live one only in what HAProxy's runtime API
//! can change is applied to the running worker through the master socket, verified, and then
//! made live on disk, with no reload.
//!
//! What qualifies ([`plan`]):
//! - in `haproxy.cfg`, only `server` lines of `backend`/`listen` sections that keep their
//!   name and every parameter but the address (`ip:port`), `weight` and `disabled`/`enabled`
//!   (the server slots of `haptic-render`'s reference templates): `set server ... addr`,
//!   `weight`, `state ready|maint`; and `server` lines a section gains or loses, the rest of
//!   it the same (a backend's slots grown or shrunk by a step): `add server` (a new line's
//!   options all ones HAProxy's dynamic servers take, [`hitless::ADDABLE`]; then `enable
//!   health` and `state ready`) and `del server` (after `state maint`);
//! - files HAProxy loaded as maps (`show map` names them): the new entries replace the old
//!   in one transaction (`prepare map`, `add map @<version>` with payloads, `commit map`), or,
//!   for a map `haproxy.cfg` looks up only by key or longest prefix ([`order_free`]), a few
//!   entries one by one (`add map`, `set map`, `del map`);
//! - files HAProxy loaded as certificates (`show ssl cert`): `set ssl cert` with the new PEM,
//!   then `commit ssl cert`;
//! - files HAProxy loaded as crt-lists (`show ssl crt-list`), when every new line names its
//!   SNI filters and no filter twice (so that their order does not matter): the lines added
//!   (`add ssl crt-list`, their certificates loaded first with `new ssl cert`, from the set
//!   when it held them before) and dropped (`del ssl crt-list`, then `del ssl cert` of a
//!   certificate file the set no longer has);
//! - files added, changed or removed that HAProxy did not load and neither `haproxy.cfg`
//!   ([`unnamed`]) nor a changing crt-list line names (a TLS Secret's file no Ingress uses
//!   yet; a map the configuration does not use): written or removed on disk only.
//!
//! The order keeps a map entry from ever pointing at a backend whose servers belong to
//! something else (a pool of spare backends, `pool_<n>`, handed from one Service to another
//! through a map): of the backends whose servers change, those no live entry of a changed map
//! names are set first; then each changed map gets an intermediate version without the
//! entries that would point at a backend still to change (see `staged_map`; usually that
//! is the new version, and the only commit); then the servers of the backends live entries
//! name are set; then the maps get their new versions; certificates last. The agent knows no
//! file names: it only compares map values with the names of backends whose servers change.
//!
//! Every change is verified afterwards (`show servers state`, `show map` or `get map` per
//! changed key, `show ssl cert` with the new certificate's SHA-1 fingerprint, `show ssl
//! crt-list` naming the new lines' certificates). Anything else, a command that fails or a
//! change that does not verify is an [`Error`], and the agent takes its reload path, which
//! makes HAProxy load the whole set from disk whatever the runtime commands did.
//!
//! Commands go to the current worker by pid (`@!<pid>`), one master CLI connection per
//! batch of at most [`MAX_REQUEST`] bytes.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    time::Duration,
};

pub use haptic_agent_client::hitless::{
    ServerChange, ServerSpec, SlotChange, map_entries, order_free,
};
use haptic_agent_client::{
    FileSet,
    hitless::{self, unsafe_text},
    protocol::{MAIN_CONFIG, common_prefix, common_suffix},
};
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

/// What a runtime apply changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Server slots to change.
    pub servers: Vec<ServerChange>,
    /// Files other than `haproxy.cfg` whose contents changed (maps or certificates, told
    /// apart by what HAProxy loaded), with their new contents.
    pub files: Vec<(String, bytes::Bytes)>,
    /// The live contents of each of `files`, in the same order: a map's live entries decide
    /// the order of the apply (see `staged_map`). Any other length needs a reload.
    pub live_files: Vec<bytes::Bytes>,
    /// The files of `files` that `haproxy.cfg` looks up only by whole key or longest prefix
    /// ([`order_free`]): their entries' order does not matter, so a few changed entries go in
    /// one by one (`add map`, `set map`, `del map`) instead of a new version of the whole map.
    pub order_free: BTreeSet<String>,
    /// Files the new set adds, with their contents: certificates that a changed crt-list's
    /// new lines name (`new ssl cert`, `add ssl crt-list`), or the apply needs a reload.
    pub added: Vec<(String, bytes::Bytes)>,
    /// Files the new set no longer has: certificates that only a changed crt-list's dropped
    /// lines named (`del ssl crt-list`, `del ssl cert`), or the apply needs a reload.
    pub removed: Vec<String>,
    /// The files of `files`, `added` and `removed` that `haproxy.cfg` names neither by their
    /// path nor by their directory ([`unnamed`]): such a file that HAProxy did not load (as a
    /// map, certificate, crt-list, CA or CRL file) and no crt-list names is not HAProxy's (a
    /// certificate no Ingress uses yet, a map the configuration does not use), and is only
    /// written or removed on disk.
    pub unnamed: BTreeSet<String>,
    /// The new set, for the certificates a new crt-list line names that HAProxy has not
    /// loaded (a Secret's file written before an Ingress used it).
    pub new_set: FileSet,
}

impl Plan {
    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
            && self.files.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
    }
}

/// The server changes between two `haproxy.cfg` texts, or why they differ in more
/// ([`hitless::config_changes`]).
pub fn config_changes(live: &str, new: &str) -> Result<Vec<ServerChange>> {
    hitless::config_changes(live, new).map_err(Error::NeedsReload)
}

/// [`config_changes`] from the hunks that made `new` of `live` (a delta's; see
/// [`hitless::config_changes_from_hunks`]).
pub fn config_changes_from_hunks(
    live: &str,
    new: &str,
    hunks: &[haptic_agent_client::protocol::Hunk],
) -> Result<Vec<ServerChange>> {
    hitless::config_changes_from_hunks(live, new, hunks).map_err(Error::NeedsReload)
}

/// What would make `new` live from `live` at run time, or why it needs a reload.
pub fn plan(live: &FileSet, new: &FileSet) -> Result<Plan> {
    let mut plan = Plan {
        new_set: new.clone(),
        ..Plan::default()
    };
    for (path, _) in live.iter() {
        if new.get(path).is_none() {
            plan.removed.push(path.to_owned());
        }
    }
    for (path, content) in new.iter() {
        let Some(old) = live.get(path) else {
            plan.added.push((path.to_owned(), content.clone()));
            continue;
        };
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
            plan.live_files.push(old.clone());
        }
    }
    Ok(finish(plan, new))
}

/// What a delta says it changed, against the set whose checksum is `base`.
#[derive(Debug, Clone)]
pub struct Changed {
    /// The checksum of the set the delta was made against.
    pub base: String,
    /// The paths it added or rewrote.
    pub paths: BTreeSet<String>,
    /// The paths it removed.
    pub removed: BTreeSet<String>,
    /// The hunks that made the new `haproxy.cfg` of the base's, when it traveled as hunks.
    pub config_hunks: Option<Vec<haptic_agent_client::protocol::Hunk>>,
}

/// [`plan`], reading only what `changed` says changed when `live` is its base (its checksum
/// `live_checksum`): the other files are not compared, and `haproxy.cfg` is read at the lines
/// the hunks replace. At 10,000 Ingresses comparing the two sets (12 MB) and the two configs
/// line by line was most of the plan. Any other live set gets [`plan`].
pub fn plan_changed(
    live: &FileSet,
    live_checksum: &str,
    new: &FileSet,
    changed: &Changed,
) -> Result<Plan> {
    if live_checksum != changed.base {
        return plan(live, new);
    }
    let mut plan = Plan {
        new_set: new.clone(),
        ..Plan::default()
    };
    for path in &changed.removed {
        if live.get(path).is_none() || new.get(path).is_some() {
            return self::plan(live, new);
        }
        plan.removed.push(path.clone());
    }
    for path in &changed.paths {
        let Some(content) = new.get(path) else {
            return self::plan(live, new);
        };
        let Some(old) = live.get(path) else {
            plan.added.push((path.clone(), content.clone()));
            continue;
        };
        // A `haproxy.cfg` the delta patched differs where its hunks say: not compared whole
        // first (its common head, megabytes at 10,000 Ingresses, read once more an apply).
        let patched = path == MAIN_CONFIG && changed.config_hunks.is_some();
        if !patched && old == content {
            continue;
        }
        if path == MAIN_CONFIG {
            let text = |bytes| {
                std::str::from_utf8(bytes)
                    .map_err(|_| Error::NeedsReload("haproxy.cfg is not UTF-8".to_owned()))
            };
            plan.servers = match &changed.config_hunks {
                Some(hunks) => config_changes_from_hunks(text(old)?, text(content)?, hunks)?,
                None => config_changes(text(old)?, text(content)?)?,
            };
        } else {
            plan.files.push((path.clone(), content.clone()));
            plan.live_files.push(old.clone());
        }
    }
    Ok(finish(plan, new))
}

/// The parts of a plan that read the new `haproxy.cfg`: which changed maps are order-free,
/// which files it does not name.
fn finish(mut plan: Plan, new: &FileSet) -> Plan {
    if let Some(config) = new
        .iter()
        .find(|(path, _)| *path == MAIN_CONFIG)
        .and_then(|(_, bytes)| std::str::from_utf8(bytes).ok())
    {
        plan.order_free = plan
            .files
            .iter()
            .filter(|(path, _)| order_free(config, path))
            .map(|(path, _)| path.clone())
            .collect();
        plan.unnamed = plan
            .added
            .iter()
            .chain(&plan.files)
            .map(|(path, _)| path)
            .chain(&plan.removed)
            .filter(|path| unnamed(config, path))
            .cloned()
            .collect();
    }
    plan
}

/// Whether `haproxy.cfg` (`config`) names the file `path` neither in a word nor by its
/// directory after `crt` (`crt ssl/` loads every file of `ssl/`), outside comment lines.
pub fn unnamed(config: &str, path: &str) -> bool {
    let directory = path
        .rsplit_once('/')
        .map_or(".", |(directory, _)| directory);
    let names = |line: &str| {
        if line.trim_start().starts_with('#') {
            return false;
        }
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        words.iter().enumerate().any(|(at, word)| {
            word.contains(path)
                || (at > 0
                    && words[at - 1] == "crt"
                    && [directory, "."].contains(&word.trim_end_matches('/')))
        })
    };
    if path.is_empty() {
        // Paths are never empty (the protocol refuses them); a search for nothing finds
        // every byte, so read every line.
        return !config.lines().any(names);
    }
    // Only a line that holds the path or `crt` can name it: those lines are found by searching
    // the whole text for each (read line by line, a 7 MB haproxy.cfg at 10,000 Ingresses was
    // ~10 ms of a certificate rotation's plan, for a file no line names), each line read once.
    // A match of a whole UTF-8 needle begins on a character boundary.
    let bytes = config.as_bytes();
    let mut last_line = None;
    let mut mentions = memchr::memmem::find_iter(bytes, path.as_bytes())
        .chain(memchr::memmem::find_iter(bytes, b"crt"));
    !mentions.any(|at| {
        let start = memchr::memrchr(b'\n', &bytes[..at]).map_or(0, |newline| newline + 1);
        if last_line == Some(start) {
            return false;
        }
        last_line = Some(start);
        let end = memchr::memchr(b'\n', &bytes[at..]).map_or(bytes.len(), |newline| at + newline);
        let line = &config[start..end];
        names(line.strip_suffix('\r').unwrap_or(line))
    })
}

/// The SHA-1 fingerprint (uppercase hex, as `show ssl cert` prints it) of the first
/// certificate of a PEM file.
pub fn fingerprint(pem: &[u8]) -> Option<String> {
    let first = CertificateDer::pem_slice_iter(pem).next()?.ok()?;
    Some(hex::encode_upper(Sha1::digest(first.as_ref())))
}

/// A changed file HAProxy loaded as a certificate.
struct Cert<'a> {
    path: &'a str,
    pem: String,
    fingerprint: String,
}

/// A changed file HAProxy loaded as a map: its live entries and its new ones.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MapChange<'a> {
    path: &'a str,
    old: Vec<(&'a str, &'a str)>,
    new: Vec<(&'a str, &'a str)>,
}

/// One step of a runtime apply.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step<'a> {
    /// Set these servers, then verify them.
    Servers(Vec<&'a ServerChange>),
    /// Commit this version of a map, then verify it.
    Map {
        path: &'a str,
        entries: Vec<(&'a str, &'a str)>,
    },
    /// Change these entries of a map one by one, then verify them.
    Entries {
        path: &'a str,
        delta: Vec<EntryChange<'a>>,
    },
}

/// The backends whose servers change and that a live entry of a changed map names (by
/// value): their servers may belong to something else after the change, so no map entry
/// may point at them while they change unless it did before and still does.
fn held_backends<'a>(servers: &'a [ServerChange], maps: &[MapChange<'_>]) -> BTreeSet<&'a str> {
    if servers.is_empty() {
        return BTreeSet::new();
    }
    // The few backends that change, looked up for each live entry (thousands).
    let changing: HashSet<&str> = servers
        .iter()
        .map(|change| change.backend.as_str())
        .collect();
    let named: HashSet<&str> = maps
        .iter()
        .flat_map(|map| map.old.iter().map(|&(_, value)| value))
        .filter(|value| changing.contains(value))
        .collect();
    servers
        .iter()
        .map(|change| change.backend.as_str())
        .filter(|backend| named.contains(backend))
        .collect()
}

/// The version of a map to commit before the servers of the `held` backends change, or
/// `None` when that is the new version itself (one commit, the usual case).
///
/// Key by key, in the new order and then the live keys the new version drops: an entry
/// that keeps its value stays; else the new value, unless it names a held backend (whose
/// servers are not yet the ones the entry means); else the live value, unless that names a
/// held backend (whose servers are about to become something else's); else the key is left
/// out until the new version. Nothing held: no intermediate, since no server changes
/// between the two commits.
fn staged_map<'a>(
    held: &BTreeSet<&str>,
    old: &[(&'a str, &'a str)],
    new: &[(&'a str, &'a str)],
) -> Option<Vec<(&'a str, &'a str)>> {
    if held.is_empty() {
        return None;
    }
    // A repeated key matches its first entry, as in HAProxy's lookups.
    let mut live: BTreeMap<&str, &str> = BTreeMap::new();
    for &(key, value) in old {
        live.entry(key).or_insert(value);
    }
    let wanted: BTreeSet<&str> = new.iter().map(|&(key, _)| key).collect();
    let free = |value: &str| !held.contains(value);
    let mut staged = Vec::with_capacity(new.len());
    for &(key, value) in new {
        match live.get(key) {
            Some(&was) if was == value => staged.push((key, value)),
            _ if free(value) => staged.push((key, value)),
            Some(&was) if free(was) => staged.push((key, was)),
            _ => {}
        }
    }
    staged.extend(
        old.iter()
            .filter(|&&(key, value)| !wanted.contains(key) && free(value)),
    );
    (staged != new).then_some(staged)
}

/// The steps of a runtime apply, in order: the servers of backends no live map entry names;
/// each map's intermediate version (or its new one); the servers of the held backends
/// ([`held_backends`]); the new versions of maps that had an intermediate one.
fn schedule<'a>(servers: &'a [ServerChange], maps: Vec<MapChange<'a>>) -> Vec<Step<'a>> {
    let held = held_backends(servers, &maps);
    let (later, first): (Vec<&ServerChange>, Vec<&ServerChange>) = servers
        .iter()
        .partition(|change| held.contains(change.backend.as_str()));
    let mut steps = Vec::new();
    if !first.is_empty() {
        steps.push(Step::Servers(first));
    }
    let mut last = Vec::new();
    for map in maps {
        let path = map.path;
        match staged_map(&held, &map.old, &map.new) {
            Some(staged) => {
                steps.push(Step::Map {
                    path,
                    entries: staged,
                });
                last.push(Step::Map {
                    path,
                    entries: map.new,
                });
            }
            None => steps.push(Step::Map {
                path,
                entries: map.new,
            }),
        }
    }
    if !later.is_empty() {
        steps.push(Step::Servers(later));
    }
    steps.extend(last);
    steps
}

/// Whether a map entry cannot go through `add map`: no value, or characters the runtime
/// API would not carry as they are.
fn unsendable(entries: &[(&str, &str)]) -> bool {
    entries
        .iter()
        .any(|(key, value)| value.is_empty() || unsafe_text(key) || unsafe_text(value))
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

    /// Sends `changes` (changing commands without payloads), then `asks` (commands that
    /// change nothing: the lookups that verify them), in order, batched into as few
    /// connections as [`MAX_REQUEST`] allows, and returns the answers laid end to end. A
    /// change and the lookups that verify it usually share one connection: each connection to
    /// the master CLI, relayed to the worker, costs 1-4 ms on a busy machine.
    async fn exchange(&mut self, changes: &[String], asks: &[String]) -> Result<String> {
        let mut answers = String::new();
        let mut batch = String::new();
        for (command, changing) in changes
            .iter()
            .map(|command| (command, true))
            .chain(asks.iter().map(|command| (command, false)))
        {
            if changing {
                self.ops += 1;
            }
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

/// What the current worker loaded, as its listings said, kept from one runtime apply to the
/// next: a worker's maps, crt-lists, CA and CRL files are those of its configuration, and its
/// certificates change only by the commands an apply sends (`new ssl cert`, `del ssl cert`).
/// So each listing is asked once per worker ([`Haproxy::worker_changes`] tells a new one)
/// rather than on every apply: a connection through the master CLI each, 1-7 ms on a busy
/// machine (`show ssl cert` lists every certificate, 2,500 here). Kept only by an apply that
/// succeeded: after any failure the next one asks again.
#[derive(Debug, Default)]
pub struct Listings(std::sync::Mutex<Option<Listed>>);

impl Listings {
    /// The listings kept for worker `worker` (none kept, or kept for another: nothing known).
    fn take(&self, worker: u64) -> Listed {
        let kept = self.0.lock().ok().and_then(|mut kept| kept.take());
        match kept {
            Some(kept) if kept.worker == worker => kept,
            _ => Listed {
                worker,
                ..Listed::default()
            },
        }
    }

    /// Keeps `listed` for the next apply.
    fn keep(&self, listed: Listed) {
        if let Ok(mut kept) = self.0.lock() {
            *kept = Some(listed);
        }
    }
}

/// The listings of one worker, as far as they were asked.
#[derive(Debug, Default)]
struct Listed {
    /// [`Haproxy::worker_changes`] when they were asked.
    worker: u64,
    /// `show map`: the map files.
    maps: Option<BTreeSet<String>>,
    /// The TLS listings.
    ssl: Option<SslListed>,
}

/// `show ssl cert`, `show ssl crt-list`, `show ssl ca-file` and `show ssl crl-file`.
#[derive(Debug, Default)]
struct SslListed {
    certs: BTreeSet<String>,
    crt_lists: BTreeSet<String>,
    others: BTreeSet<String>,
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

/// `show servers state [<backend>]`, the answers of one or more: (backend, server) ->
/// (address, port, admin state, user weight).
fn servers_state(answer: &str) -> BTreeMap<(&str, &str), (&str, &str, u32, &str)> {
    answer
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            if fields.len() < 19 {
                return None;
            }
            let admin = fields[6].parse().ok()?;
            Some((
                (fields[1], fields[3]),
                (fields[4], fields[18], admin, fields[7]),
            ))
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
pub async fn apply(
    haproxy: &Haproxy,
    plan: &Plan,
    limit: Duration,
    listings: &Listings,
) -> (u64, Result<()>) {
    let deadline = Instant::now() + limit;
    let mut worker = Worker {
        haproxy,
        prefix: String::new(),
        deadline,
        limit,
        ops: 0,
    };
    let result = tokio::time::timeout_at(deadline, run(&mut worker, plan, listings))
        .await
        .unwrap_or(Err(Error::Timeout(limit)));
    (worker.ops, result)
}

async fn run(worker: &mut Worker<'_>, plan: &Plan, listings: &Listings) -> Result<()> {
    // The current worker, by its relative number: `@1` is the worker of the newest
    // generation (HAProxy 2.6, checked with an old worker still draining), the one a runtime
    // apply changes, with no `show proc` asked first (one master-CLI connection fewer on every
    // runtime apply). Applies and reloads never overlap (the apply lock), so the worker is the
    // one that loaded the live set; an HAProxy that runs none answers the first command with
    // an error, and the reload path follows.
    worker.prefix = "@1".to_owned();

    // Classify and check every file before changing anything.
    let (mut maps, mut certs, mut lists) = (Vec::new(), Vec::new(), Vec::new());
    let (mut new_certs, mut gone_certs, mut inert_files) = (Vec::new(), Vec::new(), Vec::new());
    // Changed maps as texts (path, live, new): parsed whole only when a step needs them whole.
    let mut map_texts: Vec<(&str, &str, &str)> = Vec::new();
    // What the worker loaded: from the listings kept since an earlier apply to the same
    // worker, else asked now (and kept if this apply succeeds).
    let mut known = listings.take(worker.haproxy.worker_changes());
    let no_ssl = SslListed::default();
    if !plan.files.is_empty() || !plan.added.is_empty() || !plan.removed.is_empty() {
        if plan.live_files.len() != plan.files.len() {
            return Err(Error::NeedsReload(
                "the plan lacks the live contents of its files".to_owned(),
            ));
        }
        let listed = match known.maps.take() {
            Some(listed) => listed,
            None => {
                let answer = worker.ask("show map").await?;
                listed_maps(&answer)
                    .into_iter()
                    .map(str::to_owned)
                    .collect()
            }
        };
        // HAProxy loads maps from its configuration alone: a plan that changes only maps it
        // loaded needs no other listing (four connections to the master CLI fewer, a third of
        // a new route's runtime apply on a busy machine).
        let maps_only = plan.added.is_empty()
            && plan.removed.is_empty()
            && plan
                .files
                .iter()
                .all(|(path, _)| listed.contains(path.as_str()));
        if !maps_only && known.ssl.is_none() {
            let certs = worker.ask("show ssl cert").await?;
            let crt_lists = worker.ask("show ssl crt-list").await?;
            let others = format!(
                "{}\n{}",
                worker.ask("show ssl ca-file").await?,
                worker.ask("show ssl crl-file").await?
            );
            let owned = |names: Vec<&str>| names.into_iter().map(str::to_owned).collect();
            known.ssl = Some(SslListed {
                certs: owned(listed_certs(&certs)),
                crt_lists: owned(listed_certs(&crt_lists)),
                // CA and CRL files HAProxy loaded (`<file> - <n> certificate(s)`).
                others: owned(
                    listed_certs(&others)
                        .into_iter()
                        .filter_map(|line| line.split_ascii_whitespace().next())
                        .collect(),
                ),
            });
        }
        let ssl = match &known.ssl {
            Some(ssl) if !maps_only => ssl,
            _ => &no_ssl,
        };
        let (loaded, crt_lists, others) = (&ssl.certs, &ssl.crt_lists, &ssl.others);
        let inert =
            |path: &String| plan.unnamed.contains(path.as_str()) && !others.contains(path.as_str());
        for ((path, content), live) in plan.files.iter().zip(&plan.live_files) {
            let text = std::str::from_utf8(content)
                .map_err(|_| Error::NeedsReload(format!("{path} is not text")))?;
            if listed.contains(path.as_str()) {
                let live = std::str::from_utf8(live)
                    .map_err(|_| Error::NeedsReload(format!("the live {path} is not text")))?;
                map_texts.push((path, live, text));
            } else if loaded.contains(path.as_str()) {
                certs.push(cert_change(path, text)?);
            } else if crt_lists.contains(path.as_str()) {
                let live = std::str::from_utf8(live)
                    .map_err(|_| Error::NeedsReload(format!("the live {path} is not text")))?;
                lists.push(crt_list_change(path, live, text)?);
            } else if inert(path) {
                // Checked against the crt-lists below; else nothing HAProxy reads names it.
                inert_files.push(path.as_str());
            } else {
                return Err(Error::NeedsReload(format!(
                    "{path} changed and HAProxy loaded it neither as a map, a certificate nor \
                     a crt-list"
                )));
            }
        }
        known.maps = Some(listed);
        // Files added or removed: certificates that the crt-lists' new or dropped lines name.
        let named: BTreeSet<&str> = lists
            .iter()
            .flat_map(|list| list.added.iter().map(|line| crt_line_cert(line)))
            .collect();
        let dropped: BTreeSet<&str> = lists
            .iter()
            .flat_map(|list| list.removed.iter().map(|line| crt_line_cert(line)))
            .collect();
        let kept: BTreeSet<&str> = lists
            .iter()
            .flat_map(|list| list.certs.iter().copied())
            .collect();
        let added: BTreeSet<&str> = plan.added.iter().map(|(path, _)| path.as_str()).collect();
        let in_lists = |path: &str| {
            lists.iter().any(|list| {
                list.added.iter().chain(&list.removed).any(|line| {
                    line.split_ascii_whitespace()
                        .any(|word| word.contains(path))
                })
            })
        };
        if let Some(path) = inert_files.iter().find(|path| in_lists(path)) {
            return Err(Error::NeedsReload(format!(
                "{path} changed, and a crt-list line that changes names it"
            )));
        }
        for (path, content) in &plan.added {
            let text = std::str::from_utf8(content)
                .map_err(|_| Error::NeedsReload(format!("{path} is not text")))?;
            if !named.contains(path.as_str()) && inert(path) && !in_lists(path) {
                // Nothing HAProxy reads names it: written on disk only.
                continue;
            }
            if !named.contains(path.as_str()) || loaded.contains(path.as_str()) {
                return Err(Error::NeedsReload(format!(
                    "{path} was added, and no new crt-list line names it as its certificate"
                )));
            }
            new_certs.push(cert_change(path, text)?);
        }
        // A certificate of the set that HAProxy has not loaded yet (written when its Secret
        // came, before a line named it) is loaded as a new one.
        for cert in named
            .iter()
            .filter(|cert| !loaded.contains(**cert) && !added.contains(*cert))
        {
            let text = plan
                .new_set
                .get(cert)
                .and_then(|bytes| std::str::from_utf8(bytes).ok())
                .ok_or_else(|| {
                    Error::NeedsReload(format!(
                        "a new crt-list line names {cert}, which the set does not hold"
                    ))
                })?;
            new_certs.push(cert_change(cert, text)?);
        }
        for path in &plan.removed {
            if !dropped.contains(path.as_str())
                && !kept.contains(path.as_str())
                && !loaded.contains(path.as_str())
                && inert(path)
                && !in_lists(path)
            {
                // HAProxy never loaded it: removed on disk only.
                continue;
            }
            if !dropped.contains(path.as_str())
                || kept.contains(path.as_str())
                || !loaded.contains(path.as_str())
                || unsafe_text(path)
            {
                return Err(Error::NeedsReload(format!(
                    "{path} was removed, and not as the certificate of dropped crt-list lines only"
                )));
            }
            gone_certs.push(path.as_str());
        }
    }

    // A new route changes an entry or two of maps of thousands (two maps of 13,000 lines at
    // 10,000 Ingresses): reading them whole, four times over, was 6-8 ms of a new route's
    // runtime apply on a busy machine. An order-free map goes in entry by entry from the
    // lines that differ (`map_delta_of_texts`) when no backend is held (then its step is
    // its new version, after the servers); else, and for any other map, both versions are
    // read whole.
    let held = backends_named(&plan.servers, &map_texts);
    let mut by_entries = BTreeMap::new();
    for &(path, live, new) in &map_texts {
        if held.is_empty()
            && plan.order_free.contains(path)
            && let Some(delta) = map_delta_of_texts(live, new)
        {
            by_entries.insert(path, delta);
            continue;
        }
        let entries = map_entries(new);
        if unsendable(&entries) {
            return Err(Error::NeedsReload(format!(
                "map {path} has an entry without a value or with characters the runtime API \
                 would not carry as they are"
            )));
        }
        maps.push(MapChange {
            path,
            old: map_entries(live),
            new: entries,
        });
    }
    // What HAProxy holds of each changed map, as the steps change it.
    let mut held_maps: BTreeMap<&str, Vec<(&str, &str)>> =
        maps.iter().map(|map| (map.path, map.old.clone())).collect();
    let steps = if by_entries.is_empty() {
        schedule(&plan.servers, maps)
    } else {
        // No backend held: the servers, then each map once, in the plan's order (as
        // `schedule` orders them then).
        let mut whole = maps.into_iter();
        let mut steps = Vec::with_capacity(map_texts.len() + 1);
        if !plan.servers.is_empty() {
            steps.push(Step::Servers(plan.servers.iter().collect()));
        }
        for &(path, _, _) in &map_texts {
            match by_entries.remove(path) {
                Some(delta) => steps.push(Step::Entries { path, delta }),
                None => {
                    let map = whole
                        .next()
                        .ok_or_else(|| Error::NeedsReload(format!("map {path} was not read")))?;
                    steps.push(Step::Map {
                        path: map.path,
                        entries: map.new,
                    });
                }
            }
        }
        steps
    };
    // An intermediate version (a map's step before its last) may keep a live entry the new
    // one drops; the new versions were checked above.
    let intermediate = |at: usize, path: &str| {
        steps[at + 1..]
            .iter()
            .any(|later| matches!(later, Step::Map { path: p, .. } if *p == path))
    };
    if let Some(path) = steps.iter().enumerate().find_map(|(at, step)| match step {
        Step::Map { path, entries } if intermediate(at, path) && unsendable(entries) => Some(path),
        _ => None,
    }) {
        return Err(Error::NeedsReload(format!(
            "map {path} would keep a live entry the runtime API would not carry as it is"
        )));
    }
    // New TLS hosts first: HAProxy parses a crt-list line when it is added and may refuse it
    // (an option it does not know), and a refusal then leaves every route as it was (a new
    // certificate no line names serves nobody; the reload of the live set that follows a
    // failed attempt drops it). A new certificate is loaded before a line names it.
    for cert in &new_certs {
        let command = format!("new ssl cert {}", cert.path);
        let answer = worker.change(&command, None).await?;
        if !answer.contains("New empty certificate") {
            return Err(Error::Command {
                command,
                answer: answer.trim().to_owned(),
            });
        }
        update_cert(worker, cert.path, &cert.pem, &cert.fingerprint).await?;
    }
    for list in &lists {
        for line in &list.added {
            let command = format!("add ssl crt-list {}", list.path);
            let answer = worker.change(&command, Some(line)).await?;
            if !answer.contains("Success!") {
                return Err(Error::Command {
                    command,
                    answer: answer.trim().to_owned(),
                });
            }
        }
    }
    debug!(steps = steps.len(), "runtime steps planned");
    for step in &steps {
        match step {
            Step::Servers(changes) => {
                let commands: Vec<String> = changes
                    .iter()
                    .flat_map(|change| change.commands())
                    .collect();
                // The state of each backend changed, asked on the same connection after
                // the commands.
                let backends: BTreeSet<&str> = changes
                    .iter()
                    .map(|change| change.backend.as_str())
                    .collect();
                let states: Vec<String> = backends
                    .iter()
                    .map(|backend| format!("show servers state {backend}"))
                    .collect();
                let answers = worker.exchange(&commands, &states).await?;
                debug!(commands = commands.len(), "server commands sent");
                verify_servers(&answers, changes)?;
            }
            Step::Entries { path, delta } => update_map_entries(worker, path, delta).await?,
            Step::Map { path, entries } => {
                let from = held_maps.remove(path).unwrap_or_default();
                let delta = plan
                    .order_free
                    .contains(*path)
                    .then(|| map_delta(&from, entries))
                    .flatten();
                match delta {
                    Some(delta) => update_map_entries(worker, path, &delta).await?,
                    None => update_map(worker, path, entries).await?,
                }
                held_maps.insert(path, entries.clone());
            }
        }
    }
    // Rotated certificates are chosen by SNI, never decide which backend a request reaches,
    // so their place in the order cannot route one to another's servers: they go last, as
    // before the order above existed; a crt-list line is dropped before its certificate is.
    for cert in &certs {
        update_cert(worker, cert.path, &cert.pem, &cert.fingerprint).await?;
    }
    for list in &lists {
        for line in &list.removed {
            let command = format!("del ssl crt-list {} {}", list.path, crt_line_cert(line));
            let answer = worker.change(&command, None).await?;
            if !answer.contains("deleted") {
                return Err(Error::Command {
                    command,
                    answer: answer.trim().to_owned(),
                });
            }
        }
        verify_crt_list(worker, list).await?;
    }
    for path in &gone_certs {
        let command = format!("del ssl cert {path}");
        let answer = worker.change(&command, None).await?;
        if !answer.contains("deleted!") {
            return Err(Error::Command {
                command,
                answer: answer.trim().to_owned(),
            });
        }
    }
    if let Some(ssl) = &mut known.ssl {
        ssl.certs
            .extend(new_certs.iter().map(|cert| cert.path.to_owned()));
        for path in &gone_certs {
            ssl.certs.remove(*path);
        }
    }
    listings.keep(known);
    Ok(())
}

/// A changed certificate file's PEM (blank lines dropped) and fingerprint, or why the runtime
/// API cannot take it.
fn cert_change<'a>(path: &'a str, text: &str) -> Result<Cert<'a>> {
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
    Ok(Cert {
        path,
        pem,
        fingerprint,
    })
}

/// A changed crt-list: the lines it gains and the lines it loses, and the certificate of
/// each of its new lines.
#[derive(Debug, PartialEq, Eq)]
struct CrtListChange<'a> {
    path: &'a str,
    added: Vec<&'a str>,
    removed: Vec<&'a str>,
    certs: Vec<&'a str>,
}

/// The lines of a crt-list: trimmed, blank and `#` lines left out.
fn crt_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect()
}

/// A crt-list line's certificate: its first word.
fn crt_line_cert(line: &str) -> &str {
    line.split_ascii_whitespace().next().unwrap_or("")
}

/// A crt-list line's SNI filters: its words after the certificate and its `[options]`.
fn crt_line_filters(line: &str) -> Vec<&str> {
    let mut words = line.split_ascii_whitespace().skip(1).peekable();
    if words.peek().is_some_and(|word| word.starts_with('[')) {
        for word in words.by_ref() {
            if word.ends_with(']') {
                break;
            }
        }
    }
    words.collect()
}

/// What changes a crt-list from `live` to `new` line by line, or why it needs a reload. The
/// order of its lines matters to HAProxy only where two name the same SNI, or a line names
/// none (then its certificate's own names count): so every new line must give filters, no
/// filter twice. A certificate whose line changes (dropped and added) or that two live
/// lines name needs a reload too (`del ssl crt-list` names a line by its certificate).
fn crt_list_change<'a>(path: &'a str, live: &'a str, new: &'a str) -> Result<CrtListChange<'a>> {
    let reload = |why: String| Err(Error::NeedsReload(format!("crt-list {path}: {why}")));
    let (old, now) = (crt_lines(live), crt_lines(new));
    let mut filters = BTreeSet::new();
    for line in &now {
        if unsafe_text(line) {
            return reload(format!(
                "the line `{line}` has characters the CLI would not carry"
            ));
        }
        let named = crt_line_filters(line);
        if named.is_empty() {
            return reload(format!("the line `{line}` names no SNI filter"));
        }
        for filter in named {
            if !filters.insert(filter.to_ascii_lowercase()) {
                return reload(format!("two lines name {filter}"));
            }
        }
    }
    let mut left: Vec<&str> = now.clone();
    let mut removed = Vec::new();
    for line in &old {
        match left.iter().position(|l| l == line) {
            Some(at) => {
                left.remove(at);
            }
            None => removed.push(*line),
        }
    }
    let added = left;
    let gone: BTreeSet<&str> = removed.iter().map(|line| crt_line_cert(line)).collect();
    if let Some(line) = added.iter().find(|line| gone.contains(crt_line_cert(line))) {
        return reload(format!("the line of {} changes", crt_line_cert(line)));
    }
    if let Some(cert) = gone.iter().find(|cert| {
        old.iter()
            .filter(|line| crt_line_cert(line) == **cert)
            .count()
            > 1
    }) {
        return reload(format!("two live lines name {cert}"));
    }
    Ok(CrtListChange {
        path,
        added,
        removed,
        certs: now.iter().map(|line| crt_line_cert(line)).collect(),
    })
}

/// `show ssl crt-list <path>` names the certificates of the new lines, as many times each.
async fn verify_crt_list(worker: &Worker<'_>, list: &CrtListChange<'_>) -> Result<()> {
    let shown = worker
        .ask(&format!("show ssl crt-list {}", list.path))
        .await?;
    let mut shown: Vec<&str> = crt_lines(&shown).into_iter().map(crt_line_cert).collect();
    let mut want = list.certs.clone();
    shown.sort_unstable();
    want.sort_unstable();
    if shown != want {
        return Err(Error::Verify(format!(
            "crt-list {} holds {} lines after the change, {} expected, or other ones",
            list.path,
            shown.len(),
            want.len()
        )));
    }
    Ok(())
}

/// Checks each change against `answer`: what `show servers state` said of its backend (a
/// deleted server: not listed, or in maintenance when HAProxy refused to delete it while
/// connections were on it).
fn verify_servers(answer: &str, changes: &[&ServerChange]) -> Result<()> {
    let state = servers_state(answer);
    for change in changes {
        if change.change == SlotChange::Delete {
            let got = state.get(&(change.backend.as_str(), change.server.as_str()));
            if let Some(got) = got.filter(|&&(_, _, admin, _)| admin & ADMIN_FORCED_MAINT == 0) {
                return Err(Error::Verify(format!(
                    "server {}/{} is {got:?} after its deletion",
                    change.backend, change.server,
                )));
            }
            continue;
        }
        let want = change.to;
        let ip = want.address.ip().to_string();
        let port = want.address.port().to_string();
        let weight = want.weight.to_string();
        let got = state.get(&(change.backend.as_str(), change.server.as_str()));
        let ok = got.is_some_and(|&(a, p, admin, w)| {
            a == ip && p == port && w == weight && (admin & ADMIN_FORCED_MAINT == 0) == want.enabled
        });
        if !ok {
            return Err(Error::Verify(format!(
                "server {}/{} is {got:?} after the change, not {want:?}",
                change.backend, change.server,
            )));
        }
    }
    Ok(())
}

/// Most entries of a map changed one by one (`map_delta`); more go in as a new version.
pub const MAX_MAP_DELTA: usize = 256;

/// One entry of a map changed on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryChange<'a> {
    /// `add map`: a key the map lacks.
    Add(&'a str, &'a str),
    /// `set map`: a new value for a key the map has.
    Set(&'a str, &'a str),
    /// `del map`: a key the map loses.
    Del(&'a str),
}

/// The entry changes that take a map from `from` to `to`, when each lists every key once, no
/// value they send has a blank in it, and they are at most [`MAX_MAP_DELTA`]; `None`
/// otherwise (a new version of the whole map).
fn map_delta<'a>(
    from: &[(&'a str, &'a str)],
    to: &[(&'a str, &'a str)],
) -> Option<Vec<EntryChange<'a>>> {
    // An apply changes a few entries of maps of thousands (one per route at 10,000
    // Ingresses): the entries both list alike at the start and at the end are the same, and
    // only the window between is compared, key by key.
    let prefix = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    let suffix = from[prefix..]
        .iter()
        .rev()
        .zip(to[prefix..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let (old, new) = (
        &from[prefix..from.len() - suffix],
        &to[prefix..to.len() - suffix],
    );
    // Every key once in `from`; in `to`, whose other entries are `from`'s, every key of the
    // window once, and none that `from` lists outside it.
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(from.len());
    for (at, &(key, _)) in from.iter().enumerate() {
        if index.insert(key, at).is_some() {
            return None;
        }
    }
    let outside = |at: usize| at < prefix || at >= from.len() - suffix;
    let mut wanted: HashMap<&str, &str> = HashMap::with_capacity(new.len());
    for &(key, value) in new {
        if wanted.insert(key, value).is_some() || index.get(key).is_some_and(|&at| outside(at)) {
            return None;
        }
    }
    window_changes(old, new, &wanted, |key| index.contains_key(key))
}

/// Most lines outside the changed window that a key of the window may be found in (as a
/// substring) before [`map_delta_of_texts`] gives up and the maps are read whole.
const MAX_KEY_MENTIONS: usize = 64;

/// [`map_delta`] of two versions of a map read from their texts, parsing only the lines
/// between the bytes both begin with and the bytes both end with, cut at line ends: a new
/// route is a line or two of maps of thousands. The window's keys are looked for in the rest
/// of the live text: a key listed there too needs a new version (as a key listed twice does
/// in [`map_delta`]); a key listed twice outside the window is left as HAProxy holds it,
/// which [`map_delta`] would not (its lookups stay as they were: `del map` and `set map`
/// name only the window's keys, `add map` only keys the map lacks). `None` as for
/// [`map_delta`], when a change could not be sent as it is ([`unsafe_text`], no value), or
/// when a key of the window is a substring of over [`MAX_KEY_MENTIONS`] other lines.
fn map_delta_of_texts<'a>(live: &'a str, new: &'a str) -> Option<Vec<EntryChange<'a>>> {
    let (old_bytes, new_bytes) = (live.as_bytes(), new.as_bytes());
    // The common prefix, back to the start of its last line (the bytes before are whole
    // lines in both texts).
    let prefix = common_prefix(old_bytes, new_bytes);
    let start = memchr::memrchr(b'\n', &old_bytes[..prefix]).map_or(0, |newline| newline + 1);
    // The common suffix of what follows, on to a line start in both texts.
    let suffix = common_suffix(&old_bytes[start..], &new_bytes[start..]);
    let (mut old_end, mut new_end) = (old_bytes.len() - suffix, new_bytes.len() - suffix);
    let line_start = |bytes: &[u8], at: usize| at == start || bytes[at - 1] == b'\n';
    if !(line_start(old_bytes, old_end) && line_start(new_bytes, new_end)) {
        let skip =
            memchr::memchr(b'\n', &old_bytes[old_end..]).map_or(suffix, |newline| newline + 1);
        old_end += skip;
        new_end += skip;
    }
    let (old, new_entries) = (
        map_entries(&live[start..old_end]),
        map_entries(&new[start..new_end]),
    );
    let mut index: HashMap<&str, &str> = HashMap::with_capacity(old.len());
    for &(key, value) in &old {
        if index.insert(key, value).is_some() {
            return None;
        }
    }
    let mut wanted: HashMap<&str, &str> = HashMap::with_capacity(new_entries.len());
    for &(key, value) in &new_entries {
        if wanted.insert(key, value).is_some() {
            return None;
        }
    }
    let outside = [&live[..start], &live[old_end..]];
    for key in index.keys().chain(wanted.keys()) {
        if outside
            .iter()
            .map(|text| keyed_in(text, key))
            .any(|found| found != Some(false))
        {
            return None;
        }
    }
    window_changes(&old, &new_entries, &wanted, |key| index.contains_key(key))
}

/// The entry changes that take a map's window from `old` to `new` (`wanted`: `new` by key;
/// `listed`: whether the live map lists a key), each key of both once: dropped and set keys,
/// then added ones, each in key order. `None` past [`MAX_MAP_DELTA`], or when a change cannot
/// go as it is: `add map` and `set map` take the value as one word, and every key and value
/// goes on a command line (`del map`, `get map` too), where `;` would end the command and name
/// another key (a live entry that a reload loaded from its file was never checked).
fn window_changes<'a>(
    old: &[(&'a str, &'a str)],
    new: &[(&'a str, &'a str)],
    wanted: &HashMap<&'a str, &'a str>,
    listed: impl Fn(&str) -> bool,
) -> Option<Vec<EntryChange<'a>>> {
    let mut changes = Vec::new();
    for &(key, value) in old {
        match wanted.get(key) {
            None => changes.push(EntryChange::Del(key)),
            Some(&now) if now != value => changes.push(EntryChange::Set(key, now)),
            Some(_) => {}
        }
    }
    let mut added: Vec<EntryChange<'a>> = new
        .iter()
        .filter(|(key, _)| !listed(key))
        .map(|&(key, value)| EntryChange::Add(key, value))
        .collect();
    if changes.len() + added.len() > MAX_MAP_DELTA {
        return None;
    }
    if changes.iter().chain(&added).any(|change| match change {
        EntryChange::Add(key, value) | EntryChange::Set(key, value) => {
            value.is_empty()
                || value.contains(char::is_whitespace)
                || unsafe_text(key)
                || unsafe_text(value)
        }
        EntryChange::Del(key) => unsafe_text(key),
    }) {
        return None;
    }
    changes.sort_by_key(|change| change.key());
    added.sort_by_key(|change| change.key());
    changes.append(&mut added);
    Some(changes)
}

/// The lines of `text` (whole lines) in which `needle` occurs, each once, or `None` past
/// `limit` of them.
fn lines_with<'a>(text: &'a str, needle: &str, limit: usize) -> Option<Vec<&'a str>> {
    let bytes = text.as_bytes();
    let mut lines: Vec<&str> = Vec::new();
    let mut last_start = None;
    for at in memchr::memmem::find_iter(bytes, needle.as_bytes()) {
        let start = memchr::memrchr(b'\n', &bytes[..at]).map_or(0, |newline| newline + 1);
        if last_start == Some(start) {
            continue;
        }
        last_start = Some(start);
        if lines.len() == limit {
            return None;
        }
        let end = memchr::memchr(b'\n', &bytes[at..]).map_or(bytes.len(), |newline| at + newline);
        lines.push(&text[start..end]);
    }
    Some(lines)
}

/// Whether a map's text (whole lines) has an entry keyed `key` (`None`: too many lines
/// mention it to tell).
fn keyed_in(text: &str, key: &str) -> Option<bool> {
    let lines = lines_with(text, key, MAX_KEY_MENTIONS)?;
    Some(
        lines
            .iter()
            .any(|line| map_entries(line).iter().any(|&(k, _)| k == key)),
    )
}

/// [`held_backends`] from the maps' texts (path, live, new): the backends whose servers
/// change that an entry of a changed map's live text names, found by searching for each.
fn backends_named<'a>(
    servers: &'a [ServerChange],
    maps: &[(&str, &str, &str)],
) -> BTreeSet<&'a str> {
    servers
        .iter()
        .map(|change| change.backend.as_str())
        .filter(|backend| {
            // An empty name is found everywhere: held, so the maps are read whole.
            backend.is_empty()
                || maps.iter().any(|(_, live, _)| {
                    lines_with(live, backend, usize::MAX).is_some_and(|lines| {
                        lines
                            .iter()
                            .any(|line| map_entries(line).iter().any(|&(_, v)| v == *backend))
                    })
                })
        })
        .collect()
}

impl<'a> EntryChange<'a> {
    /// The key it changes.
    fn key(&self) -> &'a str {
        match *self {
            Self::Add(key, _) | Self::Set(key, _) | Self::Del(key) => key,
        }
    }
}

/// What `get map` answered: whether the lookup found an entry, and its key and value
/// (`type=str, case=sensitive, found=yes, idx=tree, key="k", value="v", type="str"`).
fn got_entry(answer: &str) -> Option<(&str, &str)> {
    let field = |name: &str| {
        let start = answer.find(&format!("{name}=\""))? + name.len() + 2;
        let len = answer[start..].find('"')?;
        Some(&answer[start..start + len])
    };
    answer
        .contains("found=yes")
        .then(|| field("key").zip(field("value")))
        .flatten()
}

/// Changes a map entry by entry (`del map`, `set map`, `add map` on its current version),
/// then looks each changed key up (`get map`): an added or set key finds its own entry with
/// the new value, a deleted one finds no entry of its own.
async fn update_map_entries(
    worker: &mut Worker<'_>,
    path: &str,
    delta: &[EntryChange<'_>],
) -> Result<()> {
    if delta.is_empty() {
        return Ok(());
    }
    let commands: Vec<String> = delta
        .iter()
        .map(|change| match change {
            EntryChange::Add(key, value) => format!("add map {path} {key} {value}"),
            EntryChange::Set(key, value) => format!("set map {path} {key} {value}"),
            EntryChange::Del(key) => format!("del map {path} {key}"),
        })
        .collect();
    let lookups: Vec<String> = delta
        .iter()
        .map(|change| match change {
            EntryChange::Add(key, _) | EntryChange::Set(key, _) | EntryChange::Del(key) => {
                format!("get map {path} {key}")
            }
        })
        .collect();
    // The changes and the lookups after them share a connection: the changes answer nothing
    // when they succeed, each lookup one `type=...` line.
    let answers = worker.exchange(&commands, &lookups).await?;
    let refusals: Vec<&str> = answers
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("type="))
        .collect();
    if !refusals.is_empty() {
        return Err(Error::Command {
            command: format!("{} entry changes of map {path}", commands.len()),
            answer: refusals.join("\n"),
        });
    }
    let found: Vec<&str> = answers
        .lines()
        .filter(|line| line.starts_with("type="))
        .collect();
    if found.len() != delta.len() {
        return Err(Error::Verify(format!(
            "map {path}: {} answers to {} lookups after the entry changes",
            found.len(),
            delta.len()
        )));
    }
    for (change, answer) in delta.iter().zip(found) {
        let got = got_entry(answer);
        let ok = match change {
            EntryChange::Add(key, value) | EntryChange::Set(key, value) => {
                got == Some((*key, *value))
            }
            EntryChange::Del(key) => got.is_none_or(|(found, _)| found != *key),
        };
        if !ok {
            return Err(Error::Verify(format!(
                "map {path} after {change:?}: the lookup found {got:?}"
            )));
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
    use std::net::SocketAddr;

    /// A `haproxy.cfg` of 60 backends of 3 servers (over the size a delta patches rather than
    /// sends whole), with `server` rewriting each server line.
    fn big_config(server: &dyn Fn(usize, usize) -> String) -> String {
        let mut config = String::from(
            "global\n    maxconn 10\n\nfrontend http\n    bind :80\n    \
             use_backend %[req.hdr(host),map(maps/hosts.map)]\n",
        );
        for backend in 0..60 {
            config.push_str(&format!("\nbackend be_{backend}\n    balance roundrobin\n"));
            for slot in 0..3 {
                config.push_str(&format!("    {}\n", server(backend, slot)));
            }
        }
        config
    }

    fn server_line(backend: usize, slot: usize) -> String {
        format!("server s{slot} 10.0.{backend}.{slot}:80 check")
    }

    fn set(config: &str, files: &[(&str, &str)]) -> FileSet {
        let mut set = FileSet::new()
            .with(MAIN_CONFIG, config.to_owned())
            .expect("config");
        for (path, content) in files {
            set.insert(*path, content.to_string()).expect("file");
        }
        set
    }

    /// The plan from what a delta says changed (its paths, and the hunks of `haproxy.cfg`) is
    /// the plan from comparing the two sets, whatever the change; and a live set that is not
    /// the delta's base gets the plan from the two sets.
    #[test]
    fn a_plan_from_a_deltas_changes_is_the_plan_from_the_two_sets() {
        let files = [
            ("maps/hosts.map", "a.test be_0\n"),
            ("certs/a.pem", "pem a"),
        ];
        let live = set(&big_config(&server_line), &files);
        let moved = |to: &'static [(usize, usize)]| {
            move |backend: usize, s: usize| {
                if to.contains(&(backend, s)) {
                    format!("server s{s} 10.9.{backend}.{s}:8080 disabled check")
                } else {
                    server_line(backend, s)
                }
            }
        };
        let cases = [
            // One server; two in a row (one hunk of two lines); several in several backends.
            set(&big_config(&moved(&[(7, 1)])), &files),
            set(&big_config(&moved(&[(9, 0), (9, 1)])), &files),
            set(
                &big_config(&moved(&[(0, 0), (0, 2), (31, 1), (59, 2)])),
                &files,
            ),
            // A server renamed; a line out of a backend; a line more.
            set(
                &big_config(&server_line).replace("server s1 10.0.3.1:80", "server x1 10.0.3.1:80"),
                &files,
            ),
            set(
                &big_config(&server_line).replace("maxconn 10", "maxconn 11"),
                &files,
            ),
            set(
                &big_config(&server_line).replace(
                    "    balance roundrobin\n    server s0 10.0.5.0",
                    "    balance roundrobin\n    retries 3\n    server s0 10.0.5.0",
                ),
                &files,
            ),
            // Maps and certificates: a map entry more, a certificate added and one gone.
            set(
                &big_config(&moved(&[(4, 0)])),
                &[
                    ("maps/hosts.map", "a.test be_0\nb.test be_1\n"),
                    ("certs/a.pem", "pem a"),
                ],
            ),
            set(
                &big_config(&server_line),
                &[
                    ("maps/hosts.map", "a.test be_0\n"),
                    ("certs/b.pem", "pem b"),
                ],
            ),
            // Nothing.
            set(&big_config(&server_line), &files),
        ];
        let base = live.checksum();
        for (case, new) in cases.iter().enumerate() {
            let request = haptic_agent_client::ApplyRequest::new(1, "leader-0", 1, new.clone())
                .expect("request");
            let delta = haptic_agent_client::DeltaRequest::between(&live, &base, &request);
            if case < 2 {
                assert!(
                    delta.patches.contains_key(MAIN_CONFIG),
                    "case {case}: hunks"
                );
            }
            let changed = Changed {
                base: delta.base.clone(),
                paths: delta.changed().map(str::to_owned).collect(),
                removed: delta.removed.iter().cloned().collect(),
                config_hunks: delta.patches.get(MAIN_CONFIG).cloned(),
            };
            let outcome = |plan: Result<Plan>| plan.map_err(|error| error.to_string());
            let whole = outcome(plan(&live, new));
            assert_eq!(
                outcome(plan_changed(&live, &base, new, &changed)),
                whole,
                "case {case}"
            );
            // Another live set than the delta's base: the plan from the two sets.
            assert_eq!(
                outcome(plan_changed(&live, "another", new, &changed)),
                whole,
                "case {case}"
            );
            if case < 2 {
                assert!(
                    whole.is_ok_and(|plan| !plan.servers.is_empty()),
                    "case {case}"
                );
            }
        }
    }

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
        // A line gained (slots grown) is added in maintenance, checked, then put in service;
        // a line lost (shrunk) put in maintenance and deleted.
        let grown = format!("{LIVE}    server s3 [fd00::3]:80 weight 2 check\n");
        let tls = format!("{LIVE}    server s3 10.0.0.3:443 check ssl verify none alpn h2\n");
        assert_eq!(
            config_changes(LIVE, &tls).expect("runtime")[0].change,
            SlotChange::Add(vec![
                "check".into(),
                "ssl".into(),
                "verify".into(),
                "none".into(),
                "alpn".into(),
                "h2".into()
            ])
        );
        let changes = config_changes(LIVE, &grown).expect("runtime");
        assert_eq!(changes.len(), 1);
        assert_eq!(
            changes[0].commands(),
            [
                "add server be_a/s3 [fd00::3]:80 check weight 2",
                "set server be_a/s3 addr fd00::3 port 80",
                "set server be_a/s3 weight 2",
                "enable health be_a/s3",
                "set server be_a/s3 state ready"
            ]
        );
        let shrunk = LIVE.replace("    server s2 127.0.0.1:1 disabled check\n", "");
        let changes = config_changes(LIVE, &shrunk).expect("runtime");
        assert_eq!(
            changes
                .iter()
                .map(ServerChange::commands)
                .collect::<Vec<_>>(),
            [["set server be_a/s2 state maint", "del server be_a/s2"]]
        );
        // A line renamed is one deleted and one added.
        let renamed = LIVE.replace("s2 127.0.0.1:1", "s3 127.0.0.1:1");
        let changes = config_changes(LIVE, &renamed).expect("runtime");
        assert_eq!(
            changes
                .iter()
                .map(ServerChange::commands)
                .collect::<Vec<_>>(),
            [
                vec![
                    "add server be_a/s3 127.0.0.1:1 check",
                    "set server be_a/s3 addr 127.0.0.1 port 1",
                    "set server be_a/s3 weight 1",
                    "enable health be_a/s3"
                ],
                vec!["set server be_a/s2 state maint", "del server be_a/s2"]
            ]
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
            LIVE.replace("s1 10.0.0.1:80 check", "s1 10.0.0.1:80"),
            LIVE.replace("s1 10.0.0.1:80", "s1 web.example:80"),
            LIVE.replace("s1 10.0.0.1:80 check", "s1 10.0.0.2:80 check # x"),
            // A new line with an option `add server` refuses, or the name of a line the
            // section keeps (there twice: `haproxy -c` refuses such a config).
            format!("{LIVE}    server s3 127.0.0.1:1 disabled check cookie s3\n"),
            format!("{LIVE}    server s3 127.0.0.1:1 disabled check ssl\n"),
            format!("{LIVE}    server s1 10.0.0.5:80 check\n"),
            LIVE.replace(
                "    balance roundrobin\n",
                "    balance roundrobin\n    server s2 10.0.0.5:80 check\n",
            ),
            // A server line outside a backend.
            LIVE.replace("maxconn 10\n", "maxconn 10\n    server s9 10.0.0.9:80\n"),
        ] {
            assert!(
                matches!(config_changes(LIVE, &reload), Err(Error::NeedsReload(_))),
                "{reload}"
            );
        }
    }

    #[test]
    fn only_maps_looked_up_by_key_or_longest_prefix_change_entry_by_entry() {
        let config = "frontend f\n    http-request set-var(txn.a) path,map(maps/a.map)\n    \
            http-request set-var(txn.b) path,map_beg(maps/b.map) if { var(txn.a),map_str(maps/a.map) -m found }\n    \
            http-request set-var(txn.c) path,map_reg(maps/c.map)\n    \
            acl d path -f maps/d.map\n    http-request set-var(txn.e) path,map(maps/e.map,none),map_reg(maps/e.map)\n";
        assert!(order_free(config, "maps/a.map"));
        assert!(order_free(config, "maps/b.map"));
        // First match in file order, another kind of use, a use as both, no use at all.
        assert!(!order_free(config, "maps/c.map"));
        assert!(!order_free(config, "maps/d.map"));
        assert!(!order_free(config, "maps/e.map"));
        assert!(!order_free(config, "maps/f.map"));
        assert!(!order_free("x map_beg_int(maps/a.map)", "maps/a.map"));
        assert!(!order_free("x ,map(maps/a.map.old)", "maps/a.map"));
        assert!(order_free(
            "    # the pool (maps/a.map)\n    x ,map(maps/a.map)",
            "maps/a.map"
        ));
    }

    #[test]
    fn a_file_haproxy_cfg_names_by_path_or_by_its_directory_after_crt_is_named() {
        let config = "frontend f\n    # ssl/c.pem\n    bind :443 ssl strict-sni crt ssl/a.pem crt-list maps/certs.list\n";
        assert!(!unnamed(config, "ssl/a.pem"));
        assert!(unnamed(config, "ssl/b.pem"));
        assert!(unnamed(config, "ssl/c.pem"));
        assert!(!unnamed("    bind :443 ssl crt ssl/", "ssl/b.pem"));
        assert!(!unnamed("    bind :443 ssl crt .", "b.pem"));
        assert!(unnamed("    bind :443 ssl crt ssl/", "other/b.pem"));
    }

    /// [`unnamed`] as it read every line, before it searched the text for the lines that can
    /// name the file: the reference the search must agree with.
    fn unnamed_line_by_line(config: &str, path: &str) -> bool {
        let directory = path
            .rsplit_once('/')
            .map_or(".", |(directory, _)| directory);
        !config
            .lines()
            .filter(|line| !line.trim_start().starts_with('#'))
            .any(|line| {
                let words: Vec<&str> = line.split_ascii_whitespace().collect();
                words.iter().enumerate().any(|(at, word)| {
                    word.contains(path)
                        || (at > 0
                            && words[at - 1] == "crt"
                            && [directory, "."].contains(&word.trim_end_matches('/')))
                })
            })
    }

    proptest::proptest! {
        #[test]
        fn searching_for_the_lines_that_name_a_file_agrees_with_reading_every_line(
            lines in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::sample::select(vec![
                        "crt", "ssl/", "ssl", ".", "./", "ssl/a.pem", "ssl/a.pemx", "#",
                        "# crt", "bind", "crt-list", "maps/a.map", "map(maps/a.map)", "\r",
                        "a.pem", "xcrt", " ", "\t",
                    ]),
                    0..6,
                ),
                0..8,
            ),
            path in proptest::sample::select(vec!["ssl/a.pem", "a.pem", "maps/a.map", "ssl/b.pem", "crt"]),
        ) {
            let config: String = lines
                .iter()
                .map(|words| words.join(" "))
                .collect::<Vec<_>>()
                .join("\n");
            proptest::prop_assert_eq!(
                unnamed(&config, path),
                unnamed_line_by_line(&config, path),
                "config {:?}, path {}", config, path
            );
        }
    }

    #[test]
    fn crt_list_changes_are_lines_added_and_dropped_with_filters_on_each() {
        let live =
            "ssl/a.pem a.example\nssl/b.pem [ca-file ssl/ca.pem verify optional] b.example\n";
        let new = "ssl/b.pem [ca-file ssl/ca.pem verify optional] b.example\nssl/c.pem c.example *.c.example\n";
        let change = crt_list_change("maps/certs.list", live, new).expect("a line change");
        assert_eq!(change.added, ["ssl/c.pem c.example *.c.example"]);
        assert_eq!(change.removed, ["ssl/a.pem a.example"]);
        assert_eq!(change.certs, ["ssl/b.pem", "ssl/c.pem"]);
        assert_eq!(
            crt_line_filters("ssl/b.pem [ca-file ssl/ca.pem verify optional] b.example"),
            ["b.example"]
        );
        // The order would matter, or a line would have to be named by its line number.
        for new in [
            "ssl/a.pem a.example\nssl/c.pem\n",
            "ssl/a.pem a.example\nssl/c.pem A.example\n",
            "ssl/a.pem a.example x.example\n",
        ] {
            assert!(
                matches!(crt_list_change("l", live, new), Err(Error::NeedsReload(_))),
                "{new}"
            );
        }
        let twice = "ssl/a.pem a.example\nssl/a.pem x.example\n";
        assert!(matches!(
            crt_list_change("l", twice, "ssl/a.pem a.example\n"),
            Err(Error::NeedsReload(_))
        ));
    }

    #[test]
    fn a_map_delta_adds_sets_and_deletes_only_what_changed() {
        let from = [("a/", "x"), ("b/", "y"), ("c/", "z")];
        let to = [("b/", "y2"), ("a/", "x"), ("d/", "w")];
        assert_eq!(
            map_delta(&from, &to),
            Some(vec![
                EntryChange::Set("b/", "y2"),
                EntryChange::Del("c/"),
                EntryChange::Add("d/", "w"),
            ])
        );
        assert_eq!(map_delta(&from, &from), Some(vec![]));
        // A key listed twice: its lookups depend on the order, a new version instead.
        assert_eq!(map_delta(&[("a/", "x"), ("a/", "y")], &from), None);
        assert_eq!(map_delta(&from, &[("a/", "x"), ("a/", "y")]), None);
        // A value of two words (`<rank> <backend>`): a new version.
        assert_eq!(map_delta(&from, &[("a/", "1 x")]), None);
        // A dropped key the CLI would cut (`;` ends a command): a new version, without it.
        assert_eq!(
            map_delta(&[("a/x;del", "x"), ("b/", "y")], &[("b/", "y")]),
            None
        );
        assert_eq!(map_delta_of_texts("a/x;del x\nb/ y\n", "b/ y\n"), None);
        // Many changes: a new version.
        let keys: Vec<String> = (0..=MAX_MAP_DELTA).map(|i| format!("k{i}/")).collect();
        let many: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "v")).collect();
        assert_eq!(map_delta(&[], &many), None);
        assert!(map_delta(&[], &many[1..]).is_some());
    }

    /// [`map_delta`] as it was first written: both versions whole, as sorted maps.
    fn map_delta_of_the_whole_maps<'a>(
        from: &[(&'a str, &'a str)],
        to: &[(&'a str, &'a str)],
    ) -> Option<Vec<EntryChange<'a>>> {
        let old: BTreeMap<&str, &str> = from.iter().copied().collect();
        let new: BTreeMap<&str, &str> = to.iter().copied().collect();
        if old.len() != from.len() || new.len() != to.len() {
            return None;
        }
        let mut changes = Vec::new();
        for (&key, &value) in &old {
            match new.get(key) {
                None => changes.push(EntryChange::Del(key)),
                Some(&now) if now != value => changes.push(EntryChange::Set(key, now)),
                Some(_) => {}
            }
        }
        for (&key, &value) in &new {
            if !old.contains_key(key) {
                changes.push(EntryChange::Add(key, value));
            }
        }
        let blank = changes.iter().any(|change| {
            matches!(change, EntryChange::Add(_, value) | EntryChange::Set(_, value)
                if value.contains(' '))
        });
        (changes.len() <= MAX_MAP_DELTA && !blank).then_some(changes)
    }

    #[test]
    fn a_map_delta_from_the_changed_window_is_the_delta_of_the_whole_maps() {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(26);
        let keys: Vec<String> = (0..12).map(|i| format!("k{i}/")).collect();
        let values = ["a", "b", "c", "d e"];
        let mut some = 0;
        for _ in 0..20_000 {
            // A map of distinct keys (now and then one twice), and a few edits of it: an
            // entry dropped, added, given a new value, or moved.
            let mut from: Vec<(&str, &str)> = Vec::new();
            for key in &keys {
                if rng.random_bool(0.6) {
                    from.push((key, values[rng.random_range(0..3)]));
                }
            }
            if rng.random_bool(0.05) && !from.is_empty() {
                from.push(from[0]);
            }
            let mut to = from.clone();
            for _ in 0..rng.random_range(0..4) {
                let at = rng.random_range(0..=to.len());
                let key = keys[rng.random_range(0..keys.len())].as_str();
                let value = values[rng.random_range(0..values.len())];
                match rng.random_range(0..4) {
                    0 if at < to.len() => {
                        to.remove(at);
                    }
                    1 if at < to.len() => to[at].1 = value,
                    2 if at < to.len() => {
                        let entry = to.remove(at);
                        let to_at = rng.random_range(0..=to.len());
                        to.insert(to_at, entry);
                    }
                    _ => to.insert(at, (key, value)),
                }
            }
            let expected = map_delta_of_the_whole_maps(&from, &to);
            some += usize::from(expected.is_some());
            assert_eq!(map_delta(&from, &to), expected, "{from:?} -> {to:?}");
        }
        // Most cases give a delta: the comparison is not only of refusals.
        assert!(some > 10_000, "{some} deltas");
    }

    /// What HAProxy's lookups of an order-free map find: the first value of each key.
    fn lookups<'a>(entries: &[(&'a str, &'a str)]) -> BTreeMap<&'a str, &'a str> {
        let mut found = BTreeMap::new();
        for &(key, value) in entries {
            found.entry(key).or_insert(value);
        }
        found
    }

    #[test]
    fn a_map_delta_read_from_the_texts_is_the_delta_of_the_whole_maps() {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        let keys: Vec<String> = (0..12).map(|i| format!("k{i}/")).collect();
        let values = ["a", "b", "c", "d e", "", "a;b"];
        // A line as a map file may hold it: blanks around and between, a comment, a blank
        // line, a key without a value.
        let line = |rng: &mut rand::rngs::StdRng| -> String {
            let key = &keys[rng.random_range(0..keys.len())];
            let value = values[rng.random_range(0..values.len())];
            match rng.random_range(0..10) {
                0 => "# a comment".to_owned(),
                1 => String::new(),
                2 => format!("  {key}\t{value}  "),
                3 => format!("{key} {value}\r"),
                _ => format!("{key} {value}"),
            }
        };
        let (mut same, mut some, mut more) = (0, 0, 0);
        for _ in 0..40_000 {
            let mut from: Vec<String> = (0..rng.random_range(0..14))
                .map(|_| line(&mut rng))
                .collect();
            let mut to = from.clone();
            for _ in 0..rng.random_range(0..4) {
                let at = rng.random_range(0..=to.len());
                match rng.random_range(0..4) {
                    0 if at < to.len() => {
                        to.remove(at);
                    }
                    1 if at < to.len() => to[at].push('x'),
                    2 if at < to.len() => {
                        let moved = to.remove(at);
                        let to_at = rng.random_range(0..=to.len());
                        to.insert(to_at, moved);
                    }
                    _ => to.insert(at, line(&mut rng)),
                }
            }
            if rng.random_bool(0.5) {
                from.push(String::new());
                to.push(String::new());
            }
            let (live, new) = (from.join("\n"), to.join("\n"));
            let (old_entries, new_entries) = (map_entries(&live), map_entries(&new));
            let sendable = |delta: &[EntryChange<'_>]| {
                delta.iter().all(|change| match change {
                    EntryChange::Add(key, value) | EntryChange::Set(key, value) => {
                        !value.is_empty() && !unsafe_text(key) && !unsafe_text(value)
                    }
                    EntryChange::Del(key) => !unsafe_text(key),
                })
            };
            let whole = map_delta(&old_entries, &new_entries).filter(|delta| sendable(delta));
            let texts = map_delta_of_texts(&live, &new);
            // Where the whole maps give a delta that can be sent, the texts give the same.
            if let Some(whole) = &whole {
                assert_eq!(texts.as_ref(), Some(whole), "{live:?} -> {new:?}");
                same += 1;
            }
            // Whatever the texts give, HAProxy's map after it looks up as the new text.
            if let Some(delta) = &texts {
                assert!(sendable(delta), "{live:?} -> {new:?}: {delta:?}");
                let mut held = old_entries.clone();
                for change in delta {
                    match *change {
                        EntryChange::Del(key) => held.retain(|&(k, _)| k != key),
                        EntryChange::Set(key, value) => held
                            .iter_mut()
                            .filter(|(k, _)| *k == key)
                            .for_each(|entry| entry.1 = value),
                        EntryChange::Add(key, value) => held.push((key, value)),
                    }
                }
                assert_eq!(
                    lookups(&held),
                    lookups(&new_entries),
                    "{live:?} -> {new:?}: {delta:?}"
                );
                some += 1;
                more += usize::from(whole.is_none());
            }
        }
        // Not only refusals, and the texts take some the whole maps refuse (a key listed
        // twice outside what changed).
        assert!(
            same > 10_000 && some > same && more > 100,
            "{same} {some} {more}"
        );
    }

    #[test]
    fn backends_found_in_the_texts_are_the_backends_the_live_entries_name() {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(29);
        let names = [
            "pool_1", "pool_12", "pool_120", "be_1", "pool_1 x", "#pool_1",
        ];
        let mut held_some = 0;
        for _ in 0..5_000 {
            let text = |rng: &mut rand::rngs::StdRng| -> String {
                (0..rng.random_range(0..8))
                    .map(|_| {
                        let value = names[rng.random_range(0..names.len())];
                        match rng.random_range(0..6) {
                            0 => format!("# k {value}"),
                            1 => format!("{value} k"),
                            2 => format!("  k{}\t{value} \r", rng.random_range(0..3)),
                            _ => format!("k{} {value}", rng.random_range(0..3)),
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            let (a, b) = (text(&mut rng), text(&mut rng));
            let servers: Vec<ServerChange> = names[..4]
                .iter()
                .filter(|_| rng.random_bool(0.5))
                .map(|backend| slot(backend, "s1", None, Some("10.0.0.1:80")))
                .collect();
            let texts = [
                ("maps/a.map", a.as_str(), ""),
                ("maps/b.map", b.as_str(), ""),
            ];
            let maps = [
                MapChange {
                    path: "maps/a.map",
                    old: map_entries(&a),
                    new: Vec::new(),
                },
                MapChange {
                    path: "maps/b.map",
                    old: map_entries(&b),
                    new: Vec::new(),
                },
            ];
            let held = held_backends(&servers, &maps);
            held_some += usize::from(!held.is_empty());
            assert_eq!(backends_named(&servers, &texts), held, "{a:?} {b:?}");
        }
        assert!(held_some > 500, "{held_some}");
    }

    #[test]
    fn get_map_answers_are_read_as_haproxy_2_6_writes_them() {
        let found = "type=beg, case=sensitive, found=yes, idx=tree, key=\"a.example/\", value=\"svc_a\", type=\"str\"";
        assert_eq!(got_entry(found), Some(("a.example/", "svc_a")));
        assert_eq!(got_entry("type=str, case=sensitive, found=no"), None);
    }

    #[test]
    fn server_states_of_several_backends_in_one_answer_are_told_apart() {
        // What HAProxy 2.6.12 answered to `set server pool_1/s1 addr 127.0.0.9 port 9090`,
        // `show servers state pool_1` and `show servers state pool_2` on one connection
        // (pool_1/s1 `disabled`, both servers named `s1`).
        let header = "# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state \
                      srv_uweight srv_iweight srv_time_since_last_change srv_check_status \
                      srv_check_result srv_check_health srv_check_state srv_agent_state \
                      bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl \
                      srv_check_port srv_check_addr srv_agent_addr srv_agent_port";
        let answer = format!(
            "IP changed from '127.0.0.2' to '127.0.0.9', port changed from '8080' to '9090' by \
             'stats socket command'\n\n1\n{header}\n\
             2 pool_1 1 s1 127.0.0.9 0 5 1 1 1 1 0 0 8 0 0 0 - 9090 - 0 0 - - 0\n\n1\n{header}\n\
             3 pool_2 1 s1 127.0.0.3 2 0 1 1 1 1 0 2 0 0 0 0 - 8081 - 0 0 - - 0\n\n"
        );
        let spec = |address: &str, enabled| ServerSpec {
            address: address.parse().expect("address"),
            weight: 1,
            enabled,
        };
        let change = |backend: &str, to| ServerChange {
            backend: backend.to_owned(),
            server: "s1".to_owned(),
            from: spec("127.0.0.1:1", false),
            to,
            change: SlotChange::Set,
        };
        let moved = change("pool_1", spec("127.0.0.9:9090", false));
        let other = change("pool_2", spec("127.0.0.3:8081", true));
        verify_servers(&answer, &[&moved, &other]).expect("both as HAProxy holds them");
        // pool_1/s1 is in maintenance (admin state 5): wanted in service, it does not verify;
        // nor does pool_2's s1 wanted at pool_1's address (the same server name elsewhere).
        let ready = change("pool_1", spec("127.0.0.9:9090", true));
        assert!(matches!(
            verify_servers(&answer, &[&ready]),
            Err(Error::Verify(_))
        ));
        let wrong = change("pool_2", spec("127.0.0.9:9090", true));
        assert!(matches!(
            verify_servers(&answer, &[&wrong]),
            Err(Error::Verify(_))
        ));
        let absent = change("pool_3", spec("127.0.0.3:8081", true));
        assert!(matches!(
            verify_servers(&answer, &[&absent]),
            Err(Error::Verify(_))
        ));
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

    #[test]
    fn the_plan_carries_the_live_contents_of_the_files_it_changes() {
        let set = |pool: &str| {
            FileSet::new()
                .with(MAIN_CONFIG, LIVE)
                .and_then(|set| set.with("maps/hosts.map", "a.test svc-a\n"))
                .and_then(|set| set.with("maps/pool.map", pool.to_owned()))
                .expect("a set")
        };
        let plan = plan(&set("svc-a pool_0\n"), &set("svc-b pool_0\n")).expect("runtime");
        assert_eq!(plan.files.len(), 1);
        assert_eq!(plan.files[0].0, "maps/pool.map");
        assert_eq!(plan.live_files, [bytes::Bytes::from("svc-a pool_0\n")]);
    }

    /// Endpoint addresses and the Service that owns each (the placeholder: nobody).
    const OWNERS: [(&str, &str); 5] = [
        ("10.0.0.1:80", "svc-a"),
        ("10.0.0.11:80", "svc-a"),
        ("10.0.0.2:80", "svc-b"),
        ("10.0.0.3:80", "svc-k"),
        ("127.0.0.1:1", ""),
    ];

    fn owner(address: SocketAddr) -> &'static str {
        let address = address.to_string();
        OWNERS
            .iter()
            .find(|(a, _)| *a == address)
            .map_or("?", |(_, owner)| owner)
    }

    /// Slot `server` of `backend` from one endpoint to another (`None`: the disabled
    /// placeholder `haptic-render` writes).
    fn slot(backend: &str, server: &str, from: Option<&str>, to: Option<&str>) -> ServerChange {
        let spec = |address: Option<&str>| ServerSpec {
            address: address
                .unwrap_or("127.0.0.1:1")
                .parse()
                .expect("an address"),
            weight: 1,
            enabled: address.is_some(),
        };
        ServerChange {
            backend: backend.to_owned(),
            server: server.to_owned(),
            from: spec(from),
            to: spec(to),
            change: SlotChange::Set,
        }
    }

    fn pool_map<'a>(old: &[(&'a str, &'a str)], new: &[(&'a str, &'a str)]) -> MapChange<'a> {
        MapChange {
            path: "maps/pool.map",
            old: old.to_vec(),
            new: new.to_vec(),
        }
    }

    /// The order before this one: every server, then every map.
    fn todays_order<'a>(servers: &'a [ServerChange], maps: Vec<MapChange<'a>>) -> Vec<Step<'a>> {
        let mut steps = vec![Step::Servers(servers.iter().collect())];
        steps.extend(maps.into_iter().map(|map| Step::Map {
            path: map.path,
            entries: map.new,
        }));
        steps
    }

    /// Replays `steps` on a model of the worker (the servers the changes name, the maps)
    /// and checks after every step that no map entry points at a backend serving another
    /// key's endpoints (a map's key is the owner of the endpoints it means), and that each
    /// of `stays` is routed to its own endpoints; at the end, that the new state is reached.
    fn replay(
        servers: &[ServerChange],
        maps: &[MapChange<'_>],
        steps: &[Step<'_>],
        stays: &[&str],
    ) -> Result<(), String> {
        let mut slots: BTreeMap<(&str, &str), ServerSpec> = servers
            .iter()
            .map(|c| ((c.backend.as_str(), c.server.as_str()), c.from))
            .collect();
        let mut live: BTreeMap<&str, Vec<(&str, &str)>> =
            maps.iter().map(|m| (m.path, m.old.clone())).collect();
        for (n, step) in steps.iter().enumerate() {
            match step {
                Step::Servers(changes) => {
                    for change in changes {
                        slots.insert((&change.backend, &change.server), change.to);
                    }
                }
                Step::Map { path, entries } => {
                    live.insert(path, entries.clone());
                }
                Step::Entries { .. } => {
                    return Err(format!("step {n}: `schedule` reads maps whole"));
                }
            }
            let serving = |backend: &str| -> Vec<&str> {
                slots
                    .iter()
                    .filter(|((b, _), spec)| *b == backend && spec.enabled)
                    .map(|(_, spec)| owner(spec.address))
                    .collect()
            };
            for (key, backend) in live.values().flatten() {
                if let Some(other) = serving(backend).iter().find(|o| *o != key) {
                    return Err(format!(
                        "after step {n}, {key} -> {backend} is served by {other}'s endpoints"
                    ));
                }
            }
            for key in stays {
                let routed = live
                    .values()
                    .flatten()
                    .find(|(k, _)| k == key)
                    .is_some_and(|(_, backend)| !serving(backend).is_empty());
                if !routed {
                    return Err(format!("after step {n}, {key} is not served"));
                }
            }
        }
        for change in servers {
            assert_eq!(
                slots[&(change.backend.as_str(), change.server.as_str())],
                change.to
            );
        }
        for map in maps {
            assert_eq!(live[map.path], map.new, "{}", map.path);
        }
        Ok(())
    }

    #[test]
    fn a_pool_backend_handed_to_another_service_is_never_routed_to_by_the_wrong_one() {
        // svc-a leaves pool_17, svc-b takes it; svc-k on pool_3 is untouched.
        let servers = [slot(
            "pool_17",
            "s1",
            Some("10.0.0.1:80"),
            Some("10.0.0.2:80"),
        )];
        let maps = vec![pool_map(
            &[("svc-k", "pool_3"), ("svc-a", "pool_17")],
            &[("svc-k", "pool_3"), ("svc-b", "pool_17")],
        )];
        let held = held_backends(&servers, &maps);
        assert_eq!(held, BTreeSet::from(["pool_17"]));
        assert_eq!(
            staged_map(&held, &maps[0].old, &maps[0].new),
            Some(vec![("svc-k", "pool_3")]),
            "neither svc-a nor svc-b points at pool_17 while it changes hands"
        );
        let steps = schedule(&servers, maps.clone());
        assert_eq!(
            steps,
            [
                Step::Map {
                    path: "maps/pool.map",
                    entries: vec![("svc-k", "pool_3")]
                },
                Step::Servers(vec![&servers[0]]),
                Step::Map {
                    path: "maps/pool.map",
                    entries: maps[0].new.clone()
                },
            ]
        );
        assert_eq!(replay(&servers, &maps, &steps, &[]), Ok(()));
        // The order before: pool_17 gets svc-b's endpoints while svc-a still points at it.
        let leak = replay(&servers, &maps, &todays_order(&servers, maps.clone()), &[]);
        assert_eq!(
            leak,
            Err("after step 0, svc-a -> pool_17 is served by svc-b's endpoints".to_owned())
        );
    }

    #[test]
    fn a_service_moving_to_a_spare_backend_never_loses_service() {
        // svc-a moves from pool_17 to the spare pool_12, which is filled first.
        let servers = [
            slot("pool_17", "s1", Some("10.0.0.1:80"), None),
            slot("pool_12", "s1", None, Some("10.0.0.1:80")),
        ];
        let maps = vec![pool_map(&[("svc-a", "pool_17")], &[("svc-a", "pool_12")])];
        let steps = schedule(&servers, maps.clone());
        assert_eq!(
            steps,
            [
                Step::Servers(vec![&servers[1]]),
                Step::Map {
                    path: "maps/pool.map",
                    entries: vec![("svc-a", "pool_12")]
                },
                Step::Servers(vec![&servers[0]]),
            ],
            "one commit: the new map is safe as soon as pool_12 is set"
        );
        assert_eq!(replay(&servers, &maps, &steps, &["svc-a"]), Ok(()));
        assert_eq!(
            replay(
                &servers,
                &maps,
                &todays_order(&servers, maps.clone()),
                &["svc-a"]
            ),
            Err("after step 0, svc-a is not served".to_owned())
        );
    }

    #[test]
    fn endpoint_changes_and_new_services_on_spares_take_one_commit() {
        // An endpoint change of a used backend, no map change: the servers, as before.
        let servers = [slot(
            "pool_17",
            "s1",
            Some("10.0.0.1:80"),
            Some("10.0.0.11:80"),
        )];
        assert_eq!(
            schedule(&servers, Vec::new()),
            [Step::Servers(vec![&servers[0]])]
        );
        // The same, while svc-b takes the spare pool_1: pool_1 first, the new map in one
        // commit (svc-a keeps its entry), then pool_17.
        let servers = [
            servers[0].clone(),
            slot("pool_1", "s2", None, Some("10.0.0.2:80")),
        ];
        let maps = vec![pool_map(
            &[("svc-a", "pool_17")],
            &[("svc-a", "pool_17"), ("svc-b", "pool_1")],
        )];
        let steps = schedule(&servers, maps.clone());
        assert_eq!(
            steps,
            [
                Step::Servers(vec![&servers[1]]),
                Step::Map {
                    path: "maps/pool.map",
                    entries: maps[0].new.clone()
                },
                Step::Servers(vec![&servers[0]]),
            ]
        );
        assert_eq!(replay(&servers, &maps, &steps, &["svc-a"]), Ok(()));
        // A new route whose value names no backend (a host to a Service name): one commit.
        let hosts = MapChange {
            path: "maps/hosts.map",
            old: vec![("a.test", "svc-a")],
            new: vec![("a.test", "svc-a"), ("b.test", "svc-b")],
        };
        assert_eq!(
            schedule(&[], vec![hosts.clone()]),
            [Step::Map {
                path: "maps/hosts.map",
                entries: hosts.new.clone()
            }]
        );
        let held = BTreeSet::from(["pool_17"]);
        assert_eq!(staged_map(&held, &hosts.old, &hosts.new), None);
    }

    #[test]
    fn the_intermediate_map_keeps_what_is_safe_key_by_key() {
        let held = BTreeSet::from(["pool_1", "pool_2"]);
        let old = [
            ("k1", "pool_1"),
            ("k2", "pool_9"),
            ("k3", "pool_2"),
            ("k4", "pool_2"),
            ("k5", "pool_7"),
            ("k6", "pool_2"),
        ];
        let new = [
            ("k8", "svc"),
            ("k1", "pool_1"),
            ("k2", "pool_1"),
            ("k3", "pool_8"),
            ("k4", "pool_1"),
            ("k7", "pool_2"),
        ];
        assert_eq!(
            staged_map(&held, &old, &new),
            Some(vec![
                ("k8", "svc"),    // a new key to a free value
                ("k1", "pool_1"), // unchanged, even though pool_1 changes (its endpoints)
                ("k2", "pool_9"), // the new value is held: the live one until the end
                ("k3", "pool_8"), // the live value is held, the new one free
                // k4: both values held, left out; k7: a new key to a held value, left out
                ("k5", "pool_7"), // a key the new version drops, to a free value
                                  // k6: dropped, to a held value, left out
            ])
        );
        // Nothing held: no intermediate, the new version at once.
        assert_eq!(staged_map(&BTreeSet::new(), &old, &new), None);
        // Two services swap pools: both entries wait for the new version (no spare to keep
        // them served), and neither ever points at the other's endpoints.
        let servers = [
            slot("pool_1", "s1", Some("10.0.0.1:80"), Some("10.0.0.2:80")),
            slot("pool_2", "s1", Some("10.0.0.2:80"), Some("10.0.0.1:80")),
        ];
        let maps = vec![pool_map(
            &[("svc-a", "pool_1"), ("svc-b", "pool_2")],
            &[("svc-a", "pool_2"), ("svc-b", "pool_1")],
        )];
        let steps = schedule(&servers, maps.clone());
        assert_eq!(steps.len(), 3, "{steps:?}");
        assert_eq!(replay(&servers, &maps, &steps, &[]), Ok(()));
    }
}
