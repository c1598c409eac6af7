//! The apply journal: a bounded, durable record of every apply the agent answered (epoch,
//! leader, generation, checksum, outcome, wall-clock time), kept as JSON lines in
//! `<data-dir>/journal.jsonl` and served at `GET /v1/journal`.
//!
//! It is an audit trail, not part of the apply's safety: the fence file decides what is
//! accepted. So a journal that cannot be written (a full disk) never fails an apply; the entry
//! is kept in memory and counted as `unpersisted`. Fault campaigns (`cargo xtask chaos`) read it
//! to check that no stale apply ever went live.

use std::{
    collections::VecDeque,
    fs::{File, OpenOptions},
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{SystemTime, UNIX_EPOCH},
};

use haptic_agent_client::{ApplyRequest, ApplyResponse};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::agent::Error;

/// The path the journal is served at (bearer token, like `/v1/state`).
pub const JOURNAL_PATH: &str = "/v1/journal";

/// The file name of the journal in the data directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";

/// Entries kept (in memory and, after compaction, on disk). The file grows to at most twice
/// this many lines before it is rewritten with the newest `MAX_ENTRIES`.
pub const MAX_ENTRIES: usize = 4096;

/// One answered apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// Order of the entry in this journal, rising across agent restarts.
    pub seq: u64,
    /// When the apply was answered: milliseconds since the Unix epoch (wall clock).
    pub at_ms: u64,
    /// The request's fencing epoch.
    pub epoch: u64,
    /// The request's leader identity.
    pub leader: String,
    /// The request's generation.
    pub generation: u64,
    /// The request's checksum.
    pub checksum: String,
    /// `applied`, `unchanged`, `fenced`, `superseded`, `invalid`, `rolled_back`, or `error`
    /// (not ready, a failed write).
    pub outcome: String,
    /// Whether the request's set is live after this apply (`applied` or `unchanged`).
    pub live: bool,
    /// The fence the agent answered with when it refused the request (`fenced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    /// Why the apply failed, for `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For a delta (`/v1/apply-delta`), how many paths it added, changed or removed (0: the
    /// sender asked for the set the agent already held, as a new leader's first apply does);
    /// none for a whole set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_paths: Option<usize>,
    /// The agent's time for this apply, in microseconds: from the parsed request (before the
    /// policy) to the answer. With `at_ms` it says when the apply reached the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub took_us: Option<u64>,
}

/// What `GET /v1/journal` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalView {
    /// The newest entries, oldest first (at most [`MAX_ENTRIES`]).
    pub entries: Vec<JournalEntry>,
    /// Entries this process could not write to disk (a full disk, say); they are in
    /// `entries` but will not survive a restart.
    pub unpersisted: u64,
    /// Lines of the file that did not parse when it was loaded (a line torn by a crash).
    pub unreadable: u64,
}

/// Which entries `GET /v1/journal` answers with: the query parameters `after_seq` (entries
/// whose `seq` is greater) and `since_ms` (entries answered at or after this Unix time in ms),
/// both optional; with neither, every entry kept. A reader that polls (a dashboard, a bench
/// after every change) asks for what it has not seen, not the whole journal each time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Since {
    /// Only entries with a greater `seq`.
    pub after_seq: Option<u64>,
    /// Only entries with `at_ms` at or after this.
    pub since_ms: Option<u64>,
}

impl Since {
    /// Reads a URL query (`after_seq=12&since_ms=1765000000000`); an unknown parameter is
    /// ignored, a value that is not a whole number is an error naming the parameter.
    pub fn from_query(query: &str) -> Result<Self, String> {
        let mut since = Self::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let slot = match &*key {
                "after_seq" => &mut since.after_seq,
                "since_ms" => &mut since.since_ms,
                _ => continue,
            };
            *slot =
                Some(value.parse().map_err(|_| {
                    format!("query parameter {key}: {value:?} is not a whole number")
                })?);
        }
        Ok(since)
    }
}

/// The request fields an entry needs, taken before the request is consumed.
#[derive(Debug, Clone)]
pub struct Pending {
    epoch: u64,
    leader: String,
    generation: u64,
    checksum: String,
    delta_paths: Option<usize>,
}

impl Pending {
    /// The fields of `request` the journal keeps.
    pub fn of(request: &ApplyRequest) -> Self {
        Self {
            epoch: request.epoch,
            leader: request.leader.clone(),
            generation: request.generation,
            checksum: request.checksum.clone(),
            delta_paths: None,
        }
    }

    /// The fields of `delta` the journal keeps (those of the whole set it makes).
    pub fn of_delta(delta: &haptic_agent_client::DeltaRequest) -> Self {
        Self {
            epoch: delta.epoch,
            leader: delta.leader.clone(),
            generation: delta.generation,
            checksum: delta.checksum.clone(),
            delta_paths: Some(delta.files.len() + delta.patches.len() + delta.removed.len()),
        }
    }
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    entries: VecDeque<JournalEntry>,
    next_seq: u64,
    lines_on_disk: usize,
    unpersisted: u64,
    unreadable: u64,
}

/// The journal; clones share it.
#[derive(Debug, Clone)]
pub struct Journal {
    inner: Arc<Mutex<Inner>>,
}

impl Journal {
    /// Opens (or starts) the journal at `<data_dir>/journal.jsonl`. An unreadable file is
    /// logged and the journal starts empty: the journal never keeps the agent from starting.
    pub fn open(data_dir: &Path) -> Self {
        let path = data_dir.join(JOURNAL_FILE);
        let mut entries = VecDeque::new();
        let (mut lines, mut unreadable) = (0, 0);
        match File::open(&path) {
            Ok(file) => {
                for line in BufReader::new(file).lines() {
                    let Ok(line) = line else {
                        unreadable += 1;
                        break;
                    };
                    lines += 1;
                    match serde_json::from_str::<JournalEntry>(&line) {
                        Ok(entry) => {
                            entries.push_back(entry);
                            if entries.len() > MAX_ENTRIES {
                                entries.pop_front();
                            }
                        }
                        Err(_) => unreadable += 1,
                    }
                }
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                warn!(%error, path = %path.display(), "the apply journal is unreadable; starting it afresh")
            }
        }
        let next_seq = entries.back().map_or(1, |e| e.seq + 1);
        Self {
            inner: Arc::new(Mutex::new(Inner {
                path,
                entries,
                next_seq,
                lines_on_disk: lines,
                unpersisted: 0,
                unreadable,
            })),
        }
    }

    /// Records the answer to `pending`: in memory at once, then appended to the file and
    /// fsynced (on a blocking thread). A failed write is logged and counted, never returned.
    ///
    /// A malformed request (`BadRequest`), a set the policy refuses and a delta whose base
    /// is not live are not recorded: they are refused before the fence, and their contract is
    /// that nothing at all is written.
    pub async fn record(
        &self,
        pending: Pending,
        result: &Result<ApplyResponse, Error>,
        took: Option<std::time::Duration>,
    ) {
        if matches!(
            result,
            Err(Error::BadRequest(_))
                | Ok(ApplyResponse::RefusedByPolicy { .. } | ApplyResponse::BaseMismatch { .. })
        ) {
            return;
        }
        let (outcome, live, fence, error) = match result {
            Ok(response) => (
                response.outcome().to_owned(),
                matches!(
                    response,
                    ApplyResponse::Applied { .. } | ApplyResponse::Unchanged { .. }
                ),
                match response {
                    ApplyResponse::Fenced { fence, .. } => Some(*fence),
                    _ => None,
                },
                None,
            ),
            Err(error) => ("error".to_owned(), false, None, Some(error.to_string())),
        };
        let journal = self.clone();
        let entry = JournalEntry {
            seq: 0,
            at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            epoch: pending.epoch,
            leader: pending.leader,
            generation: pending.generation,
            checksum: pending.checksum,
            outcome,
            live,
            fence,
            error,
            delta_paths: pending.delta_paths,
            took_us: took.map(|took| u64::try_from(took.as_micros()).unwrap_or(u64::MAX)),
        };
        // The lock is held across the write so that lines land in `seq` order.
        let _ = tokio::task::spawn_blocking(move || journal.append(entry)).await;
    }

    fn append(&self, mut entry: JournalEntry) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        entry.seq = inner.next_seq;
        inner.next_seq += 1;
        let written = write_line(&inner.path, &entry);
        inner.entries.push_back(entry);
        if inner.entries.len() > MAX_ENTRIES {
            inner.entries.pop_front();
        }
        match written {
            Ok(()) => inner.lines_on_disk += 1,
            Err(error) => {
                inner.unpersisted += 1;
                warn!(%error, path = %inner.path.display(), "the apply journal could not be written");
            }
        }
        if inner.lines_on_disk > 2 * MAX_ENTRIES {
            match compact(&inner.path, &inner.entries) {
                Ok(()) => inner.lines_on_disk = inner.entries.len(),
                Err(error) => warn!(%error, "compacting the apply journal failed"),
            }
        }
    }

    /// The entries kept, oldest first, and the counters.
    pub fn view(&self) -> JournalView {
        self.view_of(&Since::default())
    }

    /// The entries `since` selects (all of them for `Since::default()`), with the counters.
    pub fn view_of(&self, since: &Since) -> JournalView {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Entries are kept in `seq` order: those after `after_seq` are a suffix.
        let after = since.after_seq.map_or(0, |after| {
            inner.entries.len()
                - inner
                    .entries
                    .iter()
                    .rev()
                    .take_while(|e| e.seq > after)
                    .count()
        });
        JournalView {
            entries: inner
                .entries
                .iter()
                .skip(after)
                .filter(|e| since.since_ms.is_none_or(|ms| e.at_ms >= ms))
                .cloned()
                .collect(),
            unpersisted: inner.unpersisted,
            unreadable: inner.unreadable,
        }
    }
}

fn write_line(path: &Path, entry: &JournalEntry) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let mut file = OpenOptions::new().create(true).append(true).open(path)?;
    file.write_all(&line)?;
    file.sync_data()
}

/// Rewrites the file with `entries` only: a temporary file, fsynced, renamed over it.
fn compact(path: &Path, entries: &VecDeque<JournalEntry>) -> std::io::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    let mut file = File::create(&tmp)?;
    for entry in entries {
        let mut line = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
        line.push(b'\n');
        file.write_all(&line)?;
    }
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(epoch: u64, generation: u64) -> Pending {
        Pending {
            epoch,
            leader: "controller-1".into(),
            generation,
            checksum: "c".repeat(64),
            delta_paths: None,
        }
    }

    fn applied(generation: u64) -> Result<ApplyResponse, Error> {
        Ok(ApplyResponse::Applied {
            checksum: "c".repeat(64),
            generation,
            timing: Default::default(),
            reload: true,
            runtime_ops: 0,
        })
    }

    #[tokio::test]
    async fn entries_survive_a_restart_and_a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let journal = Journal::open(dir.path());
        journal.record(pending(3, 1), &applied(1), None).await;
        journal
            .record(
                pending(2, 9),
                &Ok(ApplyResponse::Fenced { fence: 3, epoch: 2 }),
                None,
            )
            .await;
        journal
            .record(pending(3, 2), &Err(Error::NotReady("busy".into())), None)
            .await;
        journal
            .record(
                pending(3, 3),
                &Err(Error::BadRequest("bad checksum".into())),
                None,
            )
            .await;
        // A crash in the middle of a line.
        let path = dir.path().join(JOURNAL_FILE);
        let mut file = OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("journal");
        file.write_all(b"{\"seq\":4,\"at").expect("torn line");

        let reopened = Journal::open(dir.path()).view();
        assert_eq!(reopened.unreadable, 1);
        let got: Vec<_> = reopened
            .entries
            .iter()
            .map(|e| (e.seq, e.epoch, e.outcome.as_str(), e.live, e.fence))
            .collect();
        assert_eq!(
            got,
            [
                (1, 3, "applied", true, None),
                (2, 2, "fenced", false, Some(3)),
                (3, 3, "error", false, None),
            ]
        );
        assert_eq!(
            reopened.entries[2].error.as_deref(),
            Some("not ready: busy")
        );
        // Numbering goes on after the restart.
        let journal = Journal::open(dir.path());
        journal.record(pending(4, 1), &applied(1), None).await;
        assert_eq!(journal.view().entries.last().map(|e| e.seq), Some(4));
    }

    #[tokio::test]
    async fn the_file_is_bounded_and_keeps_the_newest_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let journal = Journal::open(dir.path());
        let total = 2 * MAX_ENTRIES + 10;
        for generation in 1..=total as u64 {
            journal.append(JournalEntry {
                seq: 0,
                at_ms: 0,
                epoch: 1,
                leader: "l".into(),
                generation,
                checksum: String::new(),
                outcome: "applied".into(),
                live: true,
                fence: None,
                error: None,
                delta_paths: None,
                took_us: None,
            });
        }
        let lines = std::fs::read_to_string(dir.path().join(JOURNAL_FILE))
            .expect("journal")
            .lines()
            .count();
        assert!(lines <= 2 * MAX_ENTRIES, "{lines} lines on disk");
        let view = Journal::open(dir.path()).view();
        assert_eq!(view.entries.len(), MAX_ENTRIES);
        assert_eq!(
            view.entries.last().map(|e| e.generation),
            Some(total as u64)
        );
        assert_eq!(view.unpersisted, 0);
    }

    #[tokio::test]
    async fn a_journal_that_cannot_be_written_keeps_the_entry_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A directory where the file should be: every append fails.
        std::fs::create_dir(dir.path().join(JOURNAL_FILE)).expect("blocker");
        let journal = Journal::open(dir.path());
        journal.record(pending(1, 1), &applied(1), None).await;
        let view = journal.view();
        assert_eq!(view.unpersisted, 1);
        assert_eq!(view.entries.len(), 1);
    }
}
