//! Wire types of the agent apply protocol (`/v1`), the file-set checksum and the path rules.
//!
//! The protocol is plain JSON over HTTP. An apply is `POST /v1/apply` with a [`WireApply`]
//! body, gzip-compressed (`Content-Encoding: gzip`) when it is larger than a threshold. File
//! contents travel as JSON strings when they are UTF-8 (HAProxy configurations and maps
//! nearly always are, and a JSON string costs about one byte a byte) and as base64 otherwise.
//! The agent answers with an [`ApplyResponse`], whose `result` tag and HTTP status say what
//! happened:
//!
//! | result        | status | meaning                                                        |
//! |---------------|--------|----------------------------------------------------------------|
//! | `applied`     | 200    | the set is live and HAProxy confirmed the reload               |
//! | `unchanged`   | 200    | the set was already live; nothing was written or reloaded      |
//! | `fenced`      | 409    | the epoch is below the agent's fence, or equal to it from another leader identity; nothing was written |
//! | `superseded`  | 409    | same epoch as the live set, older generation; nothing was written |
//! | `invalid`     | 422    | `haproxy -c` refused the set; the live set is untouched        |
//! | `refused_by_policy` | 422 | the set breaks the agent's config policy ([`crate::policy`]); nothing was written and `haproxy -c` did not run |
//! | `base_mismatch` | 412  | a delta ([`DeltaRequest`]) named a base that is not the agent's live set; nothing was written |
//! | `rolled_back` | 500    | the set passed the check but failed to load; last-known-good is live again |
//!
//! Other failures (401, 400, 413, 503) carry an [`ErrorBody`].

use std::{collections::BTreeMap, fmt, sync::Arc};

use base64::Engine as _;
use bytes::Bytes;
pub use haptic_checksum::Form;
use serde::{Deserialize, Serialize};

/// Path of the apply endpoint.
pub const APPLY_PATH: &str = "/v1/apply";
/// Path of the delta apply endpoint: a [`WireDelta`] body, the same answers as
/// [`APPLY_PATH`] plus `base_mismatch` (412). An agent that predates it answers 404.
pub const DELTA_PATH: &str = "/v1/apply-delta";
/// Path of the state endpoint.
pub const STATE_PATH: &str = "/v1/state";
/// The file every set must hold at its root: HAProxy's main configuration.
pub const MAIN_CONFIG: &str = "haproxy.cfg";
/// Longest relative path accepted, in bytes.
pub const MAX_PATH_LEN: usize = 1024;
/// Deepest directory nesting accepted (number of `/`-separated components).
pub const MAX_PATH_DEPTH: usize = 16;
/// Longest path component accepted, in bytes (Linux's `NAME_MAX`).
pub const MAX_COMPONENT_LEN: usize = 255;
/// Most files a set may hold (the reference set of 10,000 Ingresses with TLS on every fourth
/// has about 2,500): a set of millions of tiny files would exhaust the agent's inodes.
pub const MAX_FILES: usize = 20_000;
/// Longest leader identity accepted (a Kubernetes object name: a DNS subdomain).
pub const MAX_LEADER_LEN: usize = 253;
/// How far one apply may raise an agent's fence above its current value (2^32). An epoch
/// further above it is refused: a corrupt counter or a hostile sender could otherwise raise
/// the fence so high that no leader could ever apply again. A fresh agent (fence 0) accepts
/// any epoch up to this bound.
pub const MAX_FENCE_STEP: u64 = 1 << 32;
/// Most violations a `refused_by_policy` answer lists (the rest are counted in `more`).
pub const MAX_VIOLATIONS: usize = 100;

/// Errors of this module: a malformed set or wire message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A path is not a plain relative path inside the set.
    #[error("path {path:?} refused: {rule}")]
    Path {
        /// The offending path.
        path: String,
        /// The rule it broke.
        rule: &'static str,
    },
    /// The same path appears twice, or a file path is also used as a directory.
    #[error("path {path:?} conflicts with another file of the set")]
    Conflict {
        /// The second of the two conflicting paths.
        path: String,
    },
    /// The set has no `haproxy.cfg` at its root.
    #[error("the set has no {MAIN_CONFIG} at its root")]
    NoMainConfig,
    /// The set holds more than [`MAX_FILES`] files.
    #[error("the set holds {count} files, more than {MAX_FILES}")]
    TooManyFiles {
        /// How many it holds.
        count: usize,
    },
    /// A file carries both or neither of `text` and `base64`, or invalid base64.
    #[error("file {path:?} has malformed content: {reason}")]
    Content {
        /// The file's path.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The checksum in the request does not match the files it carries.
    #[error("checksum mismatch: request says {claimed}, files hash to {actual}")]
    Checksum {
        /// The checksum the sender claimed.
        claimed: String,
        /// The checksum of the files received.
        actual: String,
    },
    /// The body is not valid JSON of the expected shape.
    #[error("malformed JSON body")]
    Json(#[source] serde_json::Error),
    /// The gzip body could not be inflated.
    #[error("malformed gzip body")]
    Gzip(#[source] std::io::Error),
    /// The leader identity is not a DNS subdomain of at most [`MAX_LEADER_LEN`] characters
    /// (a pod name is).
    #[error("leader identity {leader:?} refused: {rule}")]
    Leader {
        /// The identity, cut to 64 characters.
        leader: String,
        /// The rule it broke.
        rule: &'static str,
    },
    /// The inflated body is larger than the limit.
    #[error("body inflates past the limit of {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks that `path` is a plain relative path that stays inside the directory it is written
/// to: not empty, not absolute, no `..` or `.` component, no empty component, no backslash or
/// NUL, at most [`MAX_PATH_LEN`] bytes, [`MAX_PATH_DEPTH`] components and
/// [`MAX_COMPONENT_LEN`] bytes a component.
pub fn validate_path(path: &str) -> Result<()> {
    let refuse = |rule| {
        Err(Error::Path {
            path: path.to_owned(),
            rule,
        })
    };
    if path.is_empty() {
        return refuse("empty");
    }
    if path.len() > MAX_PATH_LEN {
        return refuse("too long");
    }
    if path.starts_with('/') {
        return refuse("absolute");
    }
    if path.contains('\\') || path.contains('\0') {
        return refuse("contains a backslash or NUL");
    }
    let mut depth = 0;
    for component in path.split('/') {
        depth += 1;
        match component {
            "" => return refuse("empty component"),
            "." | ".." => return refuse("contains a `.` or `..` component"),
            long if long.len() > MAX_COMPONENT_LEN => {
                return refuse("a component is longer than 255 bytes");
            }
            _ => {}
        }
    }
    if depth > MAX_PATH_DEPTH {
        return refuse("nested too deep");
    }
    Ok(())
}

/// Checks a leader identity: a pod name, that is a DNS subdomain (RFC 1123): 1 to
/// [`MAX_LEADER_LEN`] characters, lowercase letters, digits, `-` and `.`, starting and
/// ending with a letter or digit. The agent records and logs it; nothing else reaches it.
pub fn validate_leader(leader: &str) -> Result<()> {
    let refuse = |rule| {
        Err(Error::Leader {
            leader: leader.chars().take(64).collect(),
            rule,
        })
    };
    if leader.is_empty() {
        return refuse("empty");
    }
    if leader.len() > MAX_LEADER_LEN {
        return refuse("longer than 253 characters");
    }
    let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.';
    if !leader.bytes().all(allowed) {
        return refuse("only lowercase letters, digits, `-` and `.` are allowed");
    }
    let edge = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !edge(leader.bytes().next()) || !edge(leader.bytes().last()) {
        return refuse("must start and end with a letter or digit");
    }
    Ok(())
}

/// A whole HAProxy file set: relative paths (ordered) to contents.
///
/// Every path passed [`validate_path`], no path is both a file and a directory of another,
/// and [`MAIN_CONFIG`] is checked by [`FileSet::validate`] (a set under construction may
/// lack it).
#[derive(Clone, Default)]
pub struct FileSet {
    /// Shared between clones, copied on the first change of one (`Arc::make_mut`): the sets a
    /// leader holds per pod and an agent's apply (its plan, its staging, its stamps, the set
    /// it then holds) each took a copy of a 2,500-entry map, ~8 % of an agent's CPU.
    files: Arc<BTreeMap<String, Bytes>>,
    /// The checksum in each form ([`Form::V2`] first) once computed, with what it keeps to
    /// hash a later set from (a set made from this one by a delta hashes only what differs:
    /// [`FileSet::checksum_following`]); emptied by every change of the files.
    hashed: [std::sync::OnceLock<haptic_checksum::Hashed>; 2],
}

/// Where [`FileSet`] keeps its checksum in `form`.
fn slot(form: Form) -> usize {
    match form {
        Form::V2 => 0,
        Form::V1 => 1,
    }
}

impl PartialEq for FileSet {
    fn eq(&self, other: &Self) -> bool {
        self.files == other.files
    }
}

impl Eq for FileSet {}

impl fmt::Debug for FileSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileSet")
            .field("files", &self.files.len())
            .field("bytes", &self.total_bytes())
            .finish()
    }
}

impl FileSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a file, refusing a path that breaks [`validate_path`] or conflicts with a file
    /// already in the set (same path, or one is a directory prefix of the other).
    pub fn insert(&mut self, path: impl Into<String>, content: impl Into<Bytes>) -> Result<()> {
        let path = path.into();
        validate_path(&path)?;
        if self.files.contains_key(&path) || self.conflicts(&path) {
            return Err(Error::Conflict { path });
        }
        self.forget_checksums();
        Arc::make_mut(&mut self.files).insert(path, content.into());
        Ok(())
    }

    /// The set of `files`, each path checked as [`FileSet::insert`] checks it: what a leader
    /// makes of a render's map (2,500 and more files at 10,000 Ingresses) with no insert a
    /// file (each an allocation or two and a range read), twice a render.
    pub fn from_files(files: BTreeMap<String, Bytes>) -> Result<Self> {
        for path in files.keys() {
            validate_path(path)?;
            // A file "a" and a file "a/b": every such pair is found from "a/b", whose
            // directory "a" is a file of the set.
            if path
                .match_indices('/')
                .any(|(i, _)| files.contains_key(&path[..i]))
            {
                return Err(Error::Conflict { path: path.clone() });
            }
        }
        Ok(Self {
            files: Arc::new(files),
            hashed: Default::default(),
        })
    }

    /// Whether `path` would be a directory of an existing file or have a file as directory.
    fn conflicts(&self, path: &str) -> bool {
        // A file "a" and a file "a/b" cannot both exist on disk.
        let as_dir = format!("{path}/");
        let below = self
            .files
            .range(as_dir.clone()..)
            .next()
            .is_some_and(|(other, _)| other.starts_with(&as_dir));
        let above = path
            .match_indices('/')
            .any(|(i, _)| self.files.contains_key(&path[..i]));
        below || above
    }

    /// Writes `content` at `path`: replaces the file when the set holds it, else adds it as
    /// [`FileSet::insert`] does.
    pub fn put(&mut self, path: impl Into<String>, content: impl Into<Bytes>) -> Result<()> {
        let path = path.into();
        if !self.files.contains_key(&path) {
            return self.insert(path, content);
        }
        match Arc::make_mut(&mut self.files).get_mut(&path) {
            Some(existing) => {
                *existing = content.into();
                self.hashed
                    .iter_mut()
                    .for_each(|hashed| drop(hashed.take()));
                Ok(())
            }
            None => self.insert(path, content),
        }
    }

    /// Removes the file at `path`; whether the set held it.
    pub fn remove(&mut self, path: &str) -> bool {
        self.forget_checksums();
        self.files.contains_key(path) && Arc::make_mut(&mut self.files).remove(path).is_some()
    }

    /// Builder form of [`FileSet::insert`].
    pub fn with(mut self, path: impl Into<String>, content: impl Into<Bytes>) -> Result<Self> {
        self.insert(path, content)?;
        Ok(self)
    }

    /// Checks the set is complete and bounded: it holds [`MAIN_CONFIG`] at its root and at
    /// most [`MAX_FILES`] files.
    pub fn validate(&self) -> Result<()> {
        if self.files.len() > MAX_FILES {
            return Err(Error::TooManyFiles {
                count: self.files.len(),
            });
        }
        if self.files.contains_key(MAIN_CONFIG) {
            Ok(())
        } else {
            Err(Error::NoMainConfig)
        }
    }

    /// The content of `path`, if the set holds it.
    pub fn get(&self, path: &str) -> Option<&Bytes> {
        self.files.get(path)
    }

    /// The files in path order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Bytes)> {
        self.files
            .iter()
            .map(|(path, content)| (path.as_str(), content))
    }

    /// Number of files.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether the set holds no file.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Sum of the file sizes in bytes.
    pub fn total_bytes(&self) -> usize {
        self.files.values().map(Bytes::len).sum()
    }

    fn forget_checksums(&mut self) {
        self.hashed
            .iter_mut()
            .for_each(|hashed| drop(hashed.take()));
    }

    /// The set's checksum in the current form; see [`checksum`]. Computed once (kept until
    /// the files change).
    pub fn checksum(&self) -> String {
        self.checksum_as(Form::V2)
    }

    /// The set's checksum in `form` (the form a request's checksum is in:
    /// [`Form::of`]). Computed once (kept until the files change).
    pub fn checksum_as(&self, form: Form) -> String {
        self.hashed[slot(form)]
            .get_or_init(|| haptic_checksum::hash_as(form, self.pairs()))
            .hex()
    }

    /// The set's checksum in `form`, as [`FileSet::checksum_as`] gives it, hashed only from
    /// what differs from `base` when `base` knows its own in that form
    /// ([`haptic_checksum::hash_following`]; unchanged files that share `base`'s bytes are not
    /// even read): an agent's set after a delta that changed a few lines of a map.
    pub fn checksum_following(&self, form: Form, base: &FileSet) -> String {
        self.hashed[slot(form)]
            .get_or_init(|| match base.hashed[slot(form)].get() {
                Some(hashed) => haptic_checksum::hash_following(self.pairs(), base.pairs(), hashed),
                None => haptic_checksum::hash_as(form, self.pairs()),
            })
            .hex()
    }

    fn pairs(&self) -> impl Iterator<Item = (&str, &[u8])> + Clone {
        self.files
            .iter()
            .map(|(path, content)| (path.as_str(), content.as_ref()))
    }
}

/// The checksum of a file set in the current form ([`Form::V2`]: `v2-` and 64 lowercase hex
/// digits; the forms are [`haptic_checksum`]'s). It is `haptic-render`'s `FileSet` checksum,
/// so a rendered set's `checksum_hex()` can be sent as is. `files` must come in path order (a
/// [`FileSet`] iterates that way); the agent recomputes it from disk the same way.
pub fn checksum<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    haptic_checksum::hash(files).hex()
}

/// The checksum of a file set in `form` ([`checksum`] in the current form). An agent checks
/// and records a set's checksum in the form it was sent in: a controller older than the
/// second form sends and expects [`Form::V1`].
pub fn checksum_as<'a>(form: Form, files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    haptic_checksum::hash_as(form, files).hex()
}

/// One apply: who sends it, under which fencing epoch, and the whole set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyRequest {
    /// The sender's fencing epoch; the agent refuses it when below its fence, or equal to it
    /// when the fence is held by another `leader`.
    pub epoch: u64,
    /// The sender's identity (the leader's pod name): the agent records it with the fence, and
    /// only this identity may apply at that epoch.
    pub leader: String,
    /// The sender's generation counter for this set (monotonic within a term).
    pub generation: u64,
    /// [`FileSet::checksum`] of `files`.
    pub checksum: String,
    /// The whole set.
    pub files: FileSet,
}

impl ApplyRequest {
    /// A request for `files`, computing its checksum. Fails when the set has no
    /// [`MAIN_CONFIG`] or `leader` is not a pod name ([`validate_leader`]).
    pub fn new(
        epoch: u64,
        leader: impl Into<String>,
        generation: u64,
        files: FileSet,
    ) -> Result<Self> {
        files.validate()?;
        let leader = leader.into();
        validate_leader(&leader)?;
        Ok(Self {
            epoch,
            leader,
            generation,
            checksum: files.checksum(),
            files,
        })
    }

    /// [`ApplyRequest::new`] with the checksum of `files` already known, computed the same way
    /// ([`checksum`]; a rendered set's `checksum_hex()`): hashing a 10,000-Ingress set again
    /// is 7 ms. The agent recomputes it and refuses a set whose checksum is not its files'.
    pub fn with_checksum(
        epoch: u64,
        leader: impl Into<String>,
        generation: u64,
        files: FileSet,
        checksum: String,
    ) -> Result<Self> {
        files.validate()?;
        let leader = leader.into();
        validate_leader(&leader)?;
        Ok(Self {
            epoch,
            leader,
            generation,
            checksum,
            files,
        })
    }

    /// The JSON wire form.
    pub fn to_wire(&self) -> WireApply {
        let files = self
            .files
            .iter()
            .map(|(path, content)| WireFile::of(path, content))
            .collect();
        WireApply {
            epoch: self.epoch,
            leader: self.leader.clone(),
            generation: self.generation,
            checksum: self.checksum.clone(),
            files,
        }
    }
}

/// The JSON body of `POST /v1/apply`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireApply {
    /// See [`ApplyRequest::epoch`].
    pub epoch: u64,
    /// See [`ApplyRequest::leader`].
    pub leader: String,
    /// See [`ApplyRequest::generation`].
    pub generation: u64,
    /// See [`ApplyRequest::checksum`].
    pub checksum: String,
    /// The files, each with exactly one of `text` or `base64`.
    pub files: Vec<WireFile>,
}

/// One file on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireFile {
    /// Relative path inside the set.
    pub path: String,
    /// The content, when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The content in standard base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
}

impl WireFile {
    /// The file on the wire: text when it is UTF-8, base64 otherwise.
    pub fn of(path: &str, content: &[u8]) -> Self {
        match std::str::from_utf8(content) {
            Ok(text) => Self {
                path: path.to_owned(),
                text: Some(text.to_owned()),
                base64: None,
            },
            Err(_) => Self {
                path: path.to_owned(),
                text: None,
                base64: Some(base64::engine::general_purpose::STANDARD.encode(content)),
            },
        }
    }

    /// The path and the content, decoded.
    pub fn decode(self) -> Result<(String, Bytes)> {
        let content = match (self.text, self.base64) {
            (Some(text), None) => Bytes::from(text),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map(Bytes::from)
                .map_err(|error| Error::Content {
                    path: self.path.clone(),
                    reason: error.to_string(),
                })?,
            _ => {
                return Err(Error::Content {
                    path: self.path,
                    reason: "needs exactly one of `text` and `base64`".to_owned(),
                });
            }
        };
        Ok((self.path, content))
    }
}

impl WireApply {
    /// Decodes and checks the wire form: every path valid and unique, [`MAIN_CONFIG`] present,
    /// contents well-formed, and the checksum matching the files.
    pub fn into_request(self) -> Result<ApplyRequest> {
        validate_leader(&self.leader)?;
        let mut files = FileSet::new();
        for file in self.files {
            let (path, content) = file.decode()?;
            files.insert(path, content)?;
        }
        files.validate()?;
        let actual = files.checksum_as(Form::of(&self.checksum).unwrap_or(Form::V2));
        if actual != self.checksum {
            return Err(Error::Checksum {
                claimed: self.checksum,
                actual,
            });
        }
        Ok(ApplyRequest {
            epoch: self.epoch,
            leader: self.leader,
            generation: self.generation,
            checksum: actual,
            files,
        })
    }
}

/// A change to a set the agent already runs: the checksum of that set (`base`), the files
/// added or changed (whole, or as line hunks against the base's file), the files removed, and
/// the checksum of the whole set they make.
/// The agent makes the whole set from its live one and the delta, checks that it hashes to
/// `checksum`, and from there treats it exactly as an [`ApplyRequest`] of that set: fence,
/// generation, journal, `unchanged`, runtime or reload path, last-known-good. An agent whose
/// live set is not `base` answers [`ApplyResponse::BaseMismatch`] and writes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaRequest {
    /// See [`ApplyRequest::epoch`].
    pub epoch: u64,
    /// See [`ApplyRequest::leader`].
    pub leader: String,
    /// See [`ApplyRequest::generation`].
    pub generation: u64,
    /// Checksum of the set the delta applies to: the agent's live set must be it.
    pub base: String,
    /// Checksum of the whole set the delta makes of `base`.
    pub checksum: String,
    /// Files added or changed, with their whole content.
    pub files: BTreeMap<String, Bytes>,
    /// Text files of the base changed by a few lines: the hunks that make the new content of
    /// the base's (map entries, `server` lines of `haproxy.cfg`, crt-list lines).
    pub patches: BTreeMap<String, Vec<Hunk>>,
    /// Files removed.
    pub removed: Vec<String>,
}

/// Lines replaced in a text file: `remove` lines from line `at` (0-based, in the base file)
/// replaced by `insert` (each line with its `\n`, the last one without it when the file ends
/// without one). Hunks of a file come in line order and do not overlap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hunk {
    /// First line replaced, in the base file.
    pub at: usize,
    /// How many lines are replaced.
    pub remove: usize,
    /// The lines that take their place.
    #[serde(default)]
    pub insert: Vec<String>,
}

/// Files smaller than this travel whole: hunks would save nothing worth their work.
const PATCH_MIN_BYTES: usize = 4096;

/// The hunks that make `new` of `old`, compared line by line (lines end at `\n`): the common
/// head and tail are left out; between them, when both have as many lines, each run of
/// changed lines is a hunk (a `server` line or a map entry rewritten in place), else the
/// whole middle is one.
pub fn line_hunks(old: &str, new: &str) -> Vec<Hunk> {
    // The common head and tail are found on the bytes, with memcmp, and only the middle is
    // split into lines: a 7 MB `haproxy.cfg` at 10,000 Ingresses is some 300,000 lines, and
    // splitting both versions into lines to compare them took the leader 5-8 ms a change.
    let (a, b) = (old.as_bytes(), new.as_bytes());
    // The lines wholly in the common prefix (ending with their `\n` there) are the head; the
    // line holding the first difference differs (or one text ends in it and the other not).
    // Two equal texts are one whole prefix (no `a == b` first: it read the common head of
    // two 7 MB texts once more, and callers diff a text they know differs).
    let prefix = common_prefix(a, b);
    if prefix == a.len() && prefix == b.len() {
        return Vec::new();
    }
    let head_end = memchr::memrchr(b'\n', &a[..prefix]).map_or(0, |at| at + 1);
    // Counted with memchr: byte by byte, the head of a 7 MB text was ~1 ms, and the leader
    // makes the hunks of a changed `haproxy.cfg` three times a change (the gate's policy, its
    // runtime-only check, the delta).
    let head = memchr::memchr_iter(b'\n', &a[..head_end]).count();
    let (a_rest, b_rest) = (&a[head_end..], &b[head_end..]);
    // The tail: the lines of both rests that start in their common suffix, at a start of a
    // line in both (inside the suffix the byte before is the same in both; at its first
    // byte it must be checked in each).
    let suffix = common_suffix(a_rest, b_rest);
    let starts_line = |text: &[u8], at: usize| at == 0 || text[at - 1] == b'\n';
    let from = a_rest.len() - suffix;
    let tail_start = (from..a_rest.len()).find(|&at| {
        starts_line(a_rest, at)
            && (at > from || starts_line(b_rest, at + b_rest.len() - a_rest.len()))
    });
    let tail_bytes = tail_start.map_or(0, |at| a_rest.len() - at);
    let a_mid = &old[head_end..head_end + a_rest.len() - tail_bytes];
    let b_mid = &new[head_end..head_end + b_rest.len() - tail_bytes];
    let a_mid: Vec<&str> = a_mid.split_inclusive('\n').collect();
    let b_mid: Vec<&str> = b_mid.split_inclusive('\n').collect();
    let owned = |lines: &[&str]| lines.iter().map(|line| (*line).to_owned()).collect();
    if a_mid.len() != b_mid.len() {
        return vec![Hunk {
            at: head,
            remove: a_mid.len(),
            insert: owned(&b_mid),
        }];
    }
    let mut hunks: Vec<Hunk> = Vec::new();
    for (i, (x, y)) in a_mid.iter().zip(&b_mid).enumerate() {
        if x == y {
            continue;
        }
        let at = head + i;
        match hunks.last_mut() {
            Some(last) if last.at + last.remove == at => {
                last.remove += 1;
                last.insert.push((*y).to_owned());
            }
            _ => hunks.push(Hunk {
                at,
                remove: 1,
                insert: vec![(*y).to_owned()],
            }),
        }
    }
    hunks
}

/// How many bytes `a` and `b` share from their start: whole blocks compared with memcmp,
/// then the block that differs byte by byte.
pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 1024;
    let len = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= len && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..len]
        .iter()
        .zip(&b[at..len])
        .take_while(|(x, y)| x == y)
        .count()
}

/// How many bytes `a` and `b` share at their end ([`common_prefix`] from the end).
pub fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 1024;
    let len = a.len().min(b.len());
    let (a, b) = (&a[a.len() - len..], &b[b.len() - len..]);
    let mut shared = 0;
    while shared + BLOCK <= len
        && a[len - shared - BLOCK..len - shared] == b[len - shared - BLOCK..len - shared]
    {
        shared += BLOCK;
    }
    shared
        + a[..len - shared]
            .iter()
            .rev()
            .zip(b[..len - shared].iter().rev())
            .take_while(|(x, y)| x == y)
            .count()
}

/// `base` with `hunks` applied; an error names what does not fit (`path` for the message).
pub fn apply_hunks(path: &str, base: &[u8], hunks: &[Hunk]) -> Result<Bytes> {
    let refuse = |reason: &str| Error::Content {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let text =
        std::str::from_utf8(base).map_err(|_| refuse("patched, but not UTF-8 in the base"))?;
    // The base is walked line by line once and copied between hunks in whole runs (not
    // collected into a list of its lines: 300,000 of them in a 7 MB `haproxy.cfg`).
    let mut lines = text.split_inclusive('\n');
    let (mut line, mut offset) = (0, 0);
    let mut advance_to = |to: usize, line: &mut usize, offset: &mut usize| {
        while *line < to {
            *offset += lines
                .next()
                .ok_or_else(|| refuse("hunks out of order or beyond the base file"))?
                .len();
            *line += 1;
        }
        Ok::<_, Error>(())
    };
    let mut out = String::with_capacity(text.len() + 64);
    let mut copied = 0;
    for hunk in hunks {
        let end = hunk
            .at
            .checked_add(hunk.remove)
            .filter(|_| hunk.at >= line)
            .ok_or_else(|| refuse("hunks out of order or beyond the base file"))?;
        advance_to(hunk.at, &mut line, &mut offset)?;
        out.push_str(&text[copied..offset]);
        advance_to(end, &mut line, &mut offset)?;
        hunk.insert
            .iter()
            .for_each(|inserted| out.push_str(inserted));
        copied = offset;
    }
    out.push_str(&text[copied..]);
    Ok(Bytes::from(out))
}

impl DeltaRequest {
    /// The delta that makes `target`'s set of `base` (whose checksum is `base_checksum`).
    /// A text file of both that changed by a few lines travels as hunks; other changed files
    /// whole.
    pub fn between(base: &FileSet, base_checksum: &str, target: &ApplyRequest) -> Self {
        let mut files = BTreeMap::new();
        let mut patches = BTreeMap::new();
        for (path, content) in target.files.iter() {
            let Some(old) = base.get(path) else {
                files.insert(path.to_owned(), content.clone());
                continue;
            };
            // The same `Bytes` (a render shares the files it rendered the same) is not read.
            let shared = old.len() == content.len() && std::ptr::eq(old.as_ptr(), content.as_ptr());
            if shared {
                continue;
            }
            // A text worth a patch is compared by its hunks (none: the same text), its common
            // head and tail read once; `==` first read the head of a 7 MB `haproxy.cfg` again.
            let texts = (content.len() >= PATCH_MIN_BYTES)
                .then(|| {
                    std::str::from_utf8(old)
                        .ok()
                        .zip(std::str::from_utf8(content).ok())
                })
                .flatten();
            if texts.is_none() && old == content {
                continue;
            }
            if let Some((old, new)) = texts {
                let hunks = line_hunks(old, new);
                if hunks.is_empty() {
                    continue;
                }
                let inserted: usize = hunks
                    .iter()
                    .flat_map(|hunk| &hunk.insert)
                    .map(String::len)
                    .sum();
                if inserted < new.len() / 2 {
                    patches.insert(path.to_owned(), hunks);
                    continue;
                }
            }
            files.insert(path.to_owned(), content.clone());
        }
        let removed = base
            .iter()
            .filter(|(path, _)| target.files.get(path).is_none())
            .map(|(path, _)| path.to_owned())
            .collect();
        Self {
            epoch: target.epoch,
            leader: target.leader.clone(),
            generation: target.generation,
            base: base_checksum.to_owned(),
            checksum: target.checksum.clone(),
            files,
            patches,
            removed,
        }
    }

    /// The paths the delta adds or changes.
    pub fn changed(&self) -> impl Iterator<Item = &str> {
        self.files
            .keys()
            .chain(self.patches.keys())
            .map(String::as_str)
    }

    /// The whole set the delta makes of `base`: checked as a whole set is (paths, conflicts,
    /// [`MAIN_CONFIG`], [`MAX_FILES`]) and against `checksum`. `base` must be the set whose
    /// checksum is [`DeltaRequest::base`]; the caller vouches for that.
    pub fn apply_to(&self, base: &FileSet) -> Result<FileSet> {
        let mut files = base.clone();
        for path in &self.removed {
            validate_path(path)?;
            if !files.remove(path) {
                return Err(Error::Content {
                    path: path.clone(),
                    reason: "removed by the delta, but not in the base set".to_owned(),
                });
            }
        }
        for (path, content) in &self.files {
            files.put(path.clone(), content.clone())?;
        }
        for (path, hunks) in &self.patches {
            let base_content = base.get(path).ok_or_else(|| Error::Content {
                path: path.clone(),
                reason: "patched by the delta, but not in the base set".to_owned(),
            })?;
            files.put(path.clone(), apply_hunks(path, base_content, hunks)?)?;
        }
        files.validate()?;
        let form = Form::of(&self.checksum).unwrap_or(Form::V2);
        let actual = files.checksum_following(form, base);
        if actual != self.checksum {
            return Err(Error::Checksum {
                claimed: self.checksum.clone(),
                actual,
            });
        }
        Ok(files)
    }

    /// The request for the whole set `files` (what [`DeltaRequest::apply_to`] returned).
    pub fn into_request(self, files: FileSet) -> ApplyRequest {
        ApplyRequest {
            epoch: self.epoch,
            leader: self.leader,
            generation: self.generation,
            checksum: self.checksum,
            files,
        }
    }

    /// The JSON wire form.
    pub fn to_wire(&self) -> WireDelta {
        WireDelta {
            epoch: self.epoch,
            leader: self.leader.clone(),
            generation: self.generation,
            base: self.base.clone(),
            checksum: self.checksum.clone(),
            files: self
                .files
                .iter()
                .map(|(path, content)| WireFile::of(path, content))
                .collect(),
            patches: self
                .patches
                .iter()
                .map(|(path, hunks)| WirePatch {
                    path: path.clone(),
                    hunks: hunks.clone(),
                })
                .collect(),
            removed: self.removed.clone(),
        }
    }
}

/// A patched file on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WirePatch {
    /// Relative path inside the set (and the base).
    pub path: String,
    /// The hunks, in line order.
    pub hunks: Vec<Hunk>,
}

/// Whether `checksum` is a set checksum in either form ([`checksum_as`]): 64 lowercase hex
/// digits, after `v2-` in the second form.
pub fn is_checksum(checksum: &str) -> bool {
    Form::of(checksum).is_some()
}

/// The JSON body of `POST /v1/apply-delta`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireDelta {
    /// See [`ApplyRequest::epoch`].
    pub epoch: u64,
    /// See [`ApplyRequest::leader`].
    pub leader: String,
    /// See [`ApplyRequest::generation`].
    pub generation: u64,
    /// See [`DeltaRequest::base`].
    pub base: String,
    /// See [`DeltaRequest::checksum`].
    pub checksum: String,
    /// Files added or changed, each with exactly one of `text` or `base64`.
    #[serde(default)]
    pub files: Vec<WireFile>,
    /// Text files changed by hunks against the base's.
    #[serde(default)]
    pub patches: Vec<WirePatch>,
    /// Paths removed.
    #[serde(default)]
    pub removed: Vec<String>,
}

impl WireDelta {
    /// Decodes and checks the wire form: leader, both checksums well-formed, every path valid
    /// and named once, at most [`MAX_FILES`] of them. Whether it fits a base is the agent's to
    /// check ([`DeltaRequest::apply_to`]).
    pub fn into_delta(self) -> Result<DeltaRequest> {
        validate_leader(&self.leader)?;
        for claimed in [&self.base, &self.checksum] {
            if !is_checksum(claimed) {
                return Err(Error::Checksum {
                    claimed: claimed.chars().take(80).collect(),
                    actual:
                        "not a checksum (64 lowercase hex digits, after `v2-` in the second form)"
                            .to_owned(),
                });
            }
        }
        let count = self.files.len() + self.patches.len() + self.removed.len();
        if count > MAX_FILES {
            return Err(Error::TooManyFiles { count });
        }
        let mut files = BTreeMap::new();
        for file in self.files {
            let (path, content) = file.decode()?;
            validate_path(&path)?;
            if files.insert(path.clone(), content).is_some() {
                return Err(Error::Conflict { path });
            }
        }
        let mut patches = BTreeMap::new();
        for patch in self.patches {
            validate_path(&patch.path)?;
            if files.contains_key(&patch.path) {
                return Err(Error::Conflict { path: patch.path });
            }
            if patches.insert(patch.path.clone(), patch.hunks).is_some() {
                return Err(Error::Conflict { path: patch.path });
            }
        }
        for path in &self.removed {
            validate_path(path)?;
            if files.contains_key(path) || patches.contains_key(path) {
                return Err(Error::Conflict { path: path.clone() });
            }
        }
        let mut removed = self.removed;
        removed.sort();
        if let Some(pair) = removed.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(Error::Conflict {
                path: pair[0].clone(),
            });
        }
        Ok(DeltaRequest {
            epoch: self.epoch,
            leader: self.leader,
            generation: self.generation,
            base: self.base,
            checksum: self.checksum,
            files,
            patches,
            removed,
        })
    }
}

/// An encoded apply body, ready to send to any number of agents.
#[derive(Debug, Clone)]
pub struct EncodedBody {
    /// The bytes to send.
    pub bytes: Bytes,
    /// Whether `bytes` is gzip (send `Content-Encoding: gzip`).
    pub gzip: bool,
    /// Size of the JSON before compression.
    pub json_len: usize,
}

/// Serializes `apply` and gzips it (fast level) when the JSON is larger than `threshold`.
pub fn encode_apply(apply: &WireApply, threshold: usize) -> EncodedBody {
    encode_json(apply, threshold)
}

/// Serializes `delta` and gzips it (fast level) when the JSON is larger than `threshold`.
pub fn encode_delta(delta: &WireDelta, threshold: usize) -> EncodedBody {
    encode_json(delta, threshold)
}

fn encode_json(value: &impl Serialize, threshold: usize) -> EncodedBody {
    // Serializing plain structs of strings and integers cannot fail.
    let json = serde_json::to_vec(value).unwrap_or_default();
    let json_len = json.len();
    if json_len <= threshold {
        return EncodedBody {
            bytes: Bytes::from(json),
            gzip: false,
            json_len,
        };
    }
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(json_len / 4),
        flate2::Compression::fast(),
    );
    // Writing into a Vec cannot fail.
    let compressed = std::io::Write::write_all(&mut encoder, &json)
        .and_then(|()| encoder.finish())
        .unwrap_or_default();
    EncodedBody {
        bytes: Bytes::from(compressed),
        gzip: true,
        json_len,
    }
}

/// Inflates and parses an apply body, refusing one that inflates past `limit` bytes.
pub fn decode_apply(body: &[u8], gzip: bool, limit: usize) -> Result<WireApply> {
    decode_json(body, gzip, limit)
}

/// Inflates and parses a delta body, refusing one that inflates past `limit` bytes.
pub fn decode_delta(body: &[u8], gzip: bool, limit: usize) -> Result<WireDelta> {
    decode_json(body, gzip, limit)
}

fn decode_json<T: serde::de::DeserializeOwned>(body: &[u8], gzip: bool, limit: usize) -> Result<T> {
    if !gzip {
        return serde_json::from_slice(body).map_err(Error::Json);
    }
    let mut inflated = Vec::with_capacity(body.len().saturating_mul(4).min(limit));
    let decoder = flate2::read::GzDecoder::new(body);
    let read = std::io::Read::read_to_end(
        &mut std::io::Read::take(decoder, limit as u64 + 1),
        &mut inflated,
    )
    .map_err(Error::Gzip)?;
    if read > limit {
        return Err(Error::TooLarge { limit });
    }
    serde_json::from_slice(&inflated).map_err(Error::Json)
}

/// Time the agent spent on an apply, in microseconds per phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timing {
    /// From the start of the apply (after the body was parsed) to the answer.
    pub total_us: u64,
    /// Writing the set to staging and making it durable. The agent fsyncs while `haproxy -c`
    /// runs, and stages and fsyncs a runtime change's set while its commands go to HAProxy;
    /// only what the write adds after the check or the commands ended counts here.
    pub write_us: u64,
    /// Running `haproxy -c` on staging.
    pub check_us: u64,
    /// Swapping the set in, reloading and confirming the reload.
    pub reload_us: u64,
    /// Applying the change through HAProxy's runtime API and verifying it (a hitless apply,
    /// or a runtime attempt that failed before the reload).
    #[serde(default)]
    pub runtime_us: u64,
}

fn reloaded() -> bool {
    true
}

/// The agent's answer to an apply; the `result` field is the tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ApplyResponse {
    /// The set is live: written and swapped in, and HAProxy runs it. Either it was checked
    /// and HAProxy confirmed the reload (`reload: true`), or it differed from the live set
    /// only in what HAProxy's runtime API changes (server addresses and states, map entries,
    /// certificate contents), which the agent applied to the running worker and verified
    /// (`reload: false`, `runtime_ops` commands).
    Applied {
        /// Checksum of the set now live.
        checksum: String,
        /// Generation of the set now live.
        generation: u64,
        /// Time spent per phase.
        timing: Timing,
        /// Whether HAProxy was reloaded (an older agent, which always reloads, sends none).
        #[serde(default = "reloaded")]
        reload: bool,
        /// Runtime API commands run on the worker for this apply (0 when it reloaded, unless
        /// a runtime attempt failed first and the apply fell back to the reload).
        #[serde(default)]
        runtime_ops: u64,
    },
    /// The set was already live; nothing was written and HAProxy was not reloaded.
    Unchanged {
        /// Checksum of the set live.
        checksum: String,
        /// Generation recorded for the set live.
        generation: u64,
        /// Time spent.
        timing: Timing,
    },
    /// The epoch is below the agent's fence, or equal to it and the fence is held by another
    /// leader identity; nothing was written.
    Fenced {
        /// The agent's fence: the highest epoch it accepted.
        fence: u64,
        /// The epoch the request carried.
        epoch: u64,
    },
    /// The epoch equals the live set's and the generation is below the live set's: a newer
    /// set of the same leader is already live, so this one is stale; nothing was written.
    Superseded {
        /// The generation the request carried.
        generation: u64,
        /// The generation of the live set.
        live_generation: u64,
        /// The epoch of both.
        epoch: u64,
    },
    /// `haproxy -c` refused the set; the live set is untouched.
    Invalid {
        /// Checksum of the refused set.
        checksum: String,
        /// HAProxy's own output.
        check_output: String,
        /// Time spent.
        timing: Timing,
    },
    /// The set breaks the agent's config policy (see [`crate::policy`]): it would run a
    /// program or read a file outside the set. Nothing was written and `haproxy -c` did not
    /// run.
    RefusedByPolicy {
        /// Checksum of the refused set.
        checksum: String,
        /// The violations, at most [`MAX_VIOLATIONS`] of them.
        violations: Vec<crate::policy::Violation>,
        /// How many more violations were found and left out of `violations`.
        #[serde(default)]
        more: usize,
    },
    /// A delta's base is not the agent's live set (it was restarted and its set on disk no
    /// longer verifies, another set went live, or it never had that one): nothing was
    /// written and the fence was not touched. Send the whole set.
    BaseMismatch {
        /// The base the delta named.
        base: String,
        /// Checksum of the agent's live set (none when nothing is live).
        live_checksum: Option<String>,
    },
    /// The set passed the check but HAProxy failed to load it; the previous set was restored.
    RolledBack {
        /// Checksum of the set that failed to load.
        checksum: String,
        /// Checksum of the set live now (none if nothing could be restored).
        live_checksum: Option<String>,
        /// Why the load failed, as HAProxy or the agent reported it.
        reason: String,
        /// Time spent.
        timing: Timing,
    },
}

impl ApplyResponse {
    /// The HTTP status the agent sends with this response.
    pub fn status(&self) -> u16 {
        match self {
            Self::Applied { .. } | Self::Unchanged { .. } => 200,
            Self::Fenced { .. } | Self::Superseded { .. } => 409,
            Self::Invalid { .. } | Self::RefusedByPolicy { .. } => 422,
            Self::BaseMismatch { .. } => 412,
            Self::RolledBack { .. } => 500,
        }
    }

    /// The short name of the outcome (the `result` tag), as used in metrics labels.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Applied { .. } => "applied",
            Self::Unchanged { .. } => "unchanged",
            Self::Fenced { .. } => "fenced",
            Self::Superseded { .. } => "superseded",
            Self::Invalid { .. } => "invalid",
            Self::RefusedByPolicy { .. } => "refused_by_policy",
            Self::BaseMismatch { .. } => "base_mismatch",
            Self::RolledBack { .. } => "rolled_back",
        }
    }
}

/// The body of a response that is not an [`ApplyResponse`] (401, 400, 413, 503).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// A stable short code: `unauthorized`, `bad_request`, `too_large`, `not_ready`, ...
    pub error: String,
    /// A human-readable explanation.
    pub message: String,
}

/// The outcome of the last reload the agent attempted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadRecord {
    /// Whether HAProxy confirmed the reload.
    pub ok: bool,
    /// Checksum of the set the reload loaded (or tried to).
    pub checksum: String,
    /// What HAProxy or the agent said.
    pub message: String,
    /// How long the reload and its confirmation took.
    pub duration_us: u64,
    /// When it finished, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

/// `GET /v1/state`: what the agent holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentState {
    /// Checksum of the live set, recomputed from disk for this answer.
    pub live_checksum: Option<String>,
    /// Generation recorded with the live set.
    pub generation: Option<u64>,
    /// Leader that applied the live set.
    pub leader: Option<String>,
    /// The fence (highest epoch accepted); none when the fence file is unreadable.
    pub fence: Option<u64>,
    /// Why the fence file is unreadable, when it is.
    pub fence_error: Option<String>,
    /// Checksum of the last-known-good set kept for rollback.
    pub last_known_good_checksum: Option<String>,
    /// The last reload attempted.
    pub last_reload: Option<ReloadRecord>,
    /// Applies made live through HAProxy's runtime API with no reload, since the agent
    /// started.
    #[serde(default)]
    pub reloads_avoided: u64,
    /// HAProxy's version line.
    pub haproxy_version: Option<String>,
    /// PID of HAProxy's master process, when it answers on its master socket.
    pub haproxy_pid: Option<u32>,
    /// PIDs of the current HAProxy workers.
    pub worker_pids: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> FileSet {
        FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/hosts.map", "a.example be_a\n"))
            .and_then(|s| s.with("certs/a.pem", vec![0xffu8, 0, 1]))
            .expect("valid set")
    }

    #[test]
    fn paths_that_escape_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            "a//b",
            "a/",
            ".",
            "a\\b",
            "x\0",
            &"a".repeat(256),
            &format!("maps/{}", "é".repeat(128)),
        ] {
            assert!(validate_path(bad).is_err(), "{bad:?} should be refused");
        }
        for good in ["haproxy.cfg", "maps/a.map", ".hidden", "a..b/c"] {
            validate_path(good).expect(good);
        }
        validate_path(&format!("maps/{}", "a".repeat(255))).expect("255 bytes");
    }

    #[test]
    fn file_and_directory_conflicts_are_refused() {
        let mut files = FileSet::new();
        files.insert("a/b", "x").expect("first");
        assert!(matches!(
            files.insert("a", "y"),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            files.insert("a/b", "y"),
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            files.insert("a/b/c", "y"),
            Err(Error::Conflict { .. })
        ));
        files.insert("a.b", "y").expect("sibling with a dot");
        files.insert("a/c", "y").expect("sibling");
    }

    #[test]
    fn a_clone_changed_leaves_the_set_it_was_cloned_from_as_it_was() {
        let original = set();
        let checksum = original.checksum();
        let mut changed = original.clone();
        changed
            .put("haproxy.cfg", "global\n# changed\n")
            .expect("put");
        changed.insert("maps/new.map", "a b\n").expect("insert");
        let mut removed = original.clone();
        assert!(removed.remove("haproxy.cfg"));
        assert!(!removed.remove("haproxy.cfg"));
        assert_eq!(original, set());
        assert_eq!(original.checksum(), checksum);
        assert_ne!(changed.checksum(), checksum);
        assert_eq!(changed.len(), original.len() + 1);
        assert_eq!(removed.len(), original.len() - 1);
        assert!(original.get("maps/new.map").is_none());
    }

    #[test]
    fn a_set_made_of_a_map_is_checked_as_inserts_check_it() {
        let map = |paths: &[&str]| -> BTreeMap<String, Bytes> {
            paths
                .iter()
                .map(|path| ((*path).to_owned(), Bytes::from(path.to_string())))
                .collect()
        };
        let good = ["haproxy.cfg", "a.b", "a/c", "a/d/e", "maps/x.map"];
        let made = FileSet::from_files(map(&good)).expect("a good set");
        let mut inserted = FileSet::new();
        for path in good {
            inserted.insert(path, path).expect(path);
        }
        assert_eq!(made, inserted);
        assert_eq!(made.checksum(), inserted.checksum());
        // A file and a directory of the same name, wherever they sort; a bad path.
        for bad in [
            &["a", "a/b"][..],
            &["a/b", "a/b/c/d"],
            &["a", "a.b", "a/b"],
            &["haproxy.cfg", "../x"],
            &["haproxy.cfg", "a//b"],
        ] {
            let refused = FileSet::from_files(map(bad));
            assert!(
                matches!(refused, Err(Error::Conflict { .. } | Error::Path { .. })),
                "{bad:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn wire_round_trip_keeps_bytes_and_checksum() {
        let request = ApplyRequest::new(7, "leader-0", 3, set()).expect("request");
        for threshold in [0, usize::MAX] {
            let body = encode_apply(&request.to_wire(), threshold);
            assert_eq!(body.gzip, threshold == 0);
            let back = decode_apply(&body.bytes, body.gzip, 1 << 20)
                .expect("decode")
                .into_request()
                .expect("valid");
            assert_eq!(back, request);
        }
    }

    /// [`line_hunks`] as first written: both texts split into lines, compared line by line.
    fn line_hunks_of_all_lines(old: &str, new: &str) -> Vec<Hunk> {
        let a: Vec<&str> = old.split_inclusive('\n').collect();
        let b: Vec<&str> = new.split_inclusive('\n').collect();
        let head = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let tail = a[head..]
            .iter()
            .rev()
            .zip(b[head..].iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        let (a_mid, b_mid) = (&a[head..a.len() - tail], &b[head..b.len() - tail]);
        if a_mid.is_empty() && b_mid.is_empty() {
            return Vec::new();
        }
        let owned = |lines: &[&str]| lines.iter().map(|line| (*line).to_owned()).collect();
        if a_mid.len() != b_mid.len() {
            return vec![Hunk {
                at: head,
                remove: a_mid.len(),
                insert: owned(b_mid),
            }];
        }
        let mut hunks: Vec<Hunk> = Vec::new();
        for (i, (x, y)) in a_mid.iter().zip(b_mid).enumerate() {
            if x == y {
                continue;
            }
            let at = head + i;
            match hunks.last_mut() {
                Some(last) if last.at + last.remove == at => {
                    last.remove += 1;
                    last.insert.push((*y).to_owned());
                }
                _ => hunks.push(Hunk {
                    at,
                    remove: 1,
                    insert: vec![(*y).to_owned()],
                }),
            }
        }
        hunks
    }

    #[test]
    fn hunks_out_of_order_or_beyond_the_base_are_refused() {
        let base = b"a\nb\nc\n";
        let hunk = |at, remove| Hunk {
            at,
            remove,
            insert: vec!["x\n".to_owned()],
        };
        let ok = apply_hunks("f", base, &[hunk(0, 1), hunk(2, 1)]).expect("applies");
        assert_eq!(ok.as_ref(), b"x\nb\nx\n");
        assert_eq!(
            apply_hunks("f", base, &[hunk(3, 0)])
                .expect("appends")
                .as_ref(),
            b"a\nb\nc\nx\n"
        );
        for hunks in [
            vec![hunk(1, 1), hunk(0, 1)],
            vec![hunk(0, 2), hunk(1, 1)],
            vec![hunk(2, 2)],
            vec![hunk(4, 0)],
        ] {
            let refused = apply_hunks("f", base, &hunks).expect_err("refused");
            assert!(
                refused.to_string().contains("out of order or beyond"),
                "{hunks:?}: {refused}"
            );
        }
    }

    proptest::proptest! {
        /// Texts of a few distinct lines (so that runs repeat), the last one with or without
        /// its newline, and a few lines replaced, added or dropped anywhere.
        #[test]
        fn line_hunks_from_the_bytes_are_the_hunks_of_all_lines(
            lines in proptest::collection::vec(0u8..4, 0..12),
            edits in proptest::collection::vec((0usize..14, 0u8..5, 0u8..3), 0..4),
            old_end in proptest::bool::ANY,
            new_end in proptest::bool::ANY,
            width in 1usize..300,
        ) {
            // Long lines too, so that the texts span the comparison's 1 KiB blocks.
            let line = |n: u8| match n {
                0 => format!("{}\n", "a".repeat(width)),
                1 => "bb\n".to_owned(),
                2 => "a".to_owned(),
                3 => "\n".to_owned(),
                _ => format!("{}\n", "c".repeat(width)),
            };
            let text = |lines: &[u8], newline_at_end: bool| {
                let mut text: String = lines.iter().map(|&n| line(n)).collect();
                if !newline_at_end && text.ends_with('\n') {
                    text.pop();
                }
                text
            };
            let mut changed = lines.clone();
            for (at, n, what) in edits {
                let at = at.min(changed.len());
                match what {
                    0 if at < changed.len() => changed[at] = n,
                    1 if at < changed.len() => { changed.remove(at); }
                    _ => changed.insert(at, n),
                }
            }
            let (old, new) = (text(&lines, old_end), text(&changed, new_end));
            let hunks = line_hunks(&old, &new);
            proptest::prop_assert_eq!(&hunks, &line_hunks_of_all_lines(&old, &new));
            let rebuilt = apply_hunks("f", old.as_bytes(), &hunks).expect("applies");
            proptest::prop_assert_eq!(rebuilt.as_ref(), new.as_bytes());
        }
    }

    #[test]
    fn line_hunks_rebuild_the_new_text() {
        let old: String = (0..400)
            .map(|i| format!("server s{i} 10.0.0.{i}:80\n"))
            .collect();
        let cases = [
            old.replace("s7 10.0.0.7", "s7 10.0.0.99")
                .replace("s300 10.0.0.300", "s300 10.1.1.1"),
            old.replace("s7 10.0.0.7:80\n", ""),
            format!("{old}tail without newline"),
            format!("head\n{old}"),
            String::new(),
            old.clone(),
        ];
        for new in &cases {
            let hunks = line_hunks(&old, new);
            let rebuilt = apply_hunks("f", old.as_bytes(), &hunks).expect("applies");
            assert_eq!(std::str::from_utf8(&rebuilt).expect("utf-8"), new);
        }
        let two = line_hunks(&old, &cases[0]);
        assert_eq!(
            two.iter().map(|h| (h.at, h.remove)).collect::<Vec<_>>(),
            [(7, 1), (300, 1)],
            "changes in place are one hunk each"
        );
        let bad = [Hunk {
            at: 399,
            remove: 2,
            insert: Vec::new(),
        }];
        assert!(apply_hunks("f", old.as_bytes(), &bad).is_err());
    }

    #[test]
    fn a_delta_round_trips_and_makes_the_target_set() {
        let cfg: String = (0..400)
            .map(|i| format!("server s{i} 10.0.0.{i}:80\n"))
            .collect();
        let base = FileSet::new()
            .with("haproxy.cfg", cfg.clone())
            .and_then(|s| s.with("maps/a.map", "a be_a\n"))
            .and_then(|s| s.with("certs/a.pem", vec![0xffu8, 0, 1]))
            .expect("set");
        let target = FileSet::new()
            .with("haproxy.cfg", cfg.replace("s9 10.0.0.9", "s9 10.9.9.9"))
            .and_then(|s| s.with("maps/b.map", "b be_b\n"))
            .and_then(|s| s.with("certs/a.pem", vec![0xfeu8, 0, 1]))
            .expect("set");
        let request = ApplyRequest::new(3, "leader-0", 2, target.clone()).expect("request");
        let delta = DeltaRequest::between(&base, &base.checksum(), &request);
        assert_eq!(delta.removed, ["maps/a.map"]);
        assert_eq!(delta.patches.keys().collect::<Vec<_>>(), ["haproxy.cfg"]);
        assert_eq!(
            delta.files.keys().collect::<Vec<_>>(),
            ["certs/a.pem", "maps/b.map"]
        );
        let body = encode_delta(&delta.to_wire(), 0);
        let back = decode_delta(&body.bytes, true, 1 << 20)
            .expect("decode")
            .into_delta()
            .expect("valid");
        assert_eq!(back, delta);
        assert_eq!(back.apply_to(&base).expect("applies"), target);
        // Another base: the checksum does not come out.
        let other = base.clone().with("x", "y").expect("set");
        assert!(matches!(
            delta.apply_to(&other),
            Err(Error::Checksum { .. })
        ));
    }

    #[test]
    fn a_chain_of_deltas_gives_each_set_the_checksum_of_the_whole_set() {
        // A set of several checkpoints (64 KiB each): each applied set is the base of the
        // next delta, and hashes on from where it differs from its base.
        let cfg = |step: usize| -> String {
            (0..20_000)
                .map(|i| match i {
                    _ if i == 19_000 - step * 4_000 => format!("server s{i} 10.9.9.{step}:80\n"),
                    _ => format!("server s{i} 10.0.{}.{}:80\n", i / 256, i % 256),
                })
                .collect()
        };
        let set = |step: usize| {
            FileSet::new()
                .with("haproxy.cfg", cfg(step))
                .and_then(|s| s.with("maps/a.map", format!("a be_{step}\n")))
                .expect("set")
        };
        let mut base = set(0);
        for step in 1..5 {
            let target = set(step);
            let request = ApplyRequest::new(3, "leader-0", 2, target.clone()).expect("request");
            let delta = DeltaRequest::between(&base, &base.checksum(), &request);
            let got = delta
                .apply_to(&base)
                .expect("applies: the checksum comes out");
            assert_eq!(got, target);
            assert_eq!(got.checksum(), checksum(target.pairs()), "step {step}");
            base = got;
        }
    }

    #[test]
    fn tampered_content_fails_the_checksum() {
        let request = ApplyRequest::new(1, "l", 1, set()).expect("request");
        let mut wire = request.to_wire();
        let cfg = wire
            .files
            .iter_mut()
            .find(|file| file.path == MAIN_CONFIG)
            .expect("main config");
        cfg.text = Some("tampered".to_owned());
        assert!(matches!(wire.into_request(), Err(Error::Checksum { .. })));
    }

    #[test]
    fn gzip_bomb_is_cut_at_the_limit() {
        let request = ApplyRequest::new(
            1,
            "l",
            1,
            FileSet::new()
                .with("haproxy.cfg", vec![b'a'; 1 << 20])
                .expect("set"),
        )
        .expect("request");
        let body = encode_apply(&request.to_wire(), 0);
        assert!(body.bytes.len() < 64 << 10, "compresses well");
        assert!(matches!(
            decode_apply(&body.bytes, true, 64 << 10),
            Err(Error::TooLarge { .. })
        ));
    }

    #[test]
    fn checksum_has_the_documented_framing() {
        // Computed independently: sha256 of u64be(len) path u64be(len) bytes, in path order.
        let files = FileSet::new()
            .with("maps/hosts.map", "a.example be_a\n")
            .and_then(|s| s.with("haproxy.cfg", "global\n"))
            .expect("set");
        assert_eq!(
            files.checksum_as(Form::V1),
            "dc1031d2a755ad712a8a84e8c4e6b31de9900376d7136e510cffbc73cdcb2031"
        );
        assert_eq!(
            FileSet::new().checksum_as(Form::V1),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        // The second form: sha256 of u64be(len) path u64be(len) sha256(bytes), in path order
        // (files this small are one chunk).
        let mut stream = Vec::new();
        for (path, content) in [
            ("haproxy.cfg", "global\n"),
            ("maps/hosts.map", "a.example be_a\n"),
        ] {
            stream.extend((path.len() as u64).to_be_bytes());
            stream.extend(path.as_bytes());
            stream.extend((content.len() as u64).to_be_bytes());
            stream.extend(<sha2::Sha256 as sha2::Digest>::digest(content.as_bytes()));
        }
        let want = format!(
            "v2-{}",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&stream))
        );
        assert_eq!(files.checksum(), want);
        assert_eq!(checksum(files.iter().map(|(p, c)| (p, c.as_ref()))), want);
        // Each form of a set is kept apart.
        assert_eq!(files.checksum_as(Form::V2), want);
        assert_eq!(
            files.checksum_as(Form::V1),
            "dc1031d2a755ad712a8a84e8c4e6b31de9900376d7136e510cffbc73cdcb2031"
        );
    }

    #[test]
    fn checksum_separates_path_from_content() {
        let a = checksum([("ab", b"c".as_slice())]);
        let b = checksum([("a", b"bc".as_slice())]);
        assert_ne!(a, b);
        assert_eq!(a.len(), 67);
        assert!(is_checksum(&a));
        let a = checksum_as(Form::V1, [("ab", b"c".as_slice())]);
        let b = checksum_as(Form::V1, [("a", b"bc".as_slice())]);
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(is_checksum(&a));
    }

    #[test]
    fn leader_identities_are_pod_names() {
        for good in ["haptic-0", "a", "haptic.ns-1", &"a".repeat(253)] {
            validate_leader(good).expect(good);
        }
        for bad in [
            "",
            "Haptic-0",
            "-a",
            "a-",
            "a b",
            "a\nfake log line",
            "a_b",
            "é",
            &"a".repeat(254),
        ] {
            assert!(validate_leader(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(matches!(
            ApplyRequest::new(1, "Bad Leader", 1, set()),
            Err(Error::Leader { .. })
        ));
        let mut wire = ApplyRequest::new(1, "good", 1, set())
            .expect("request")
            .to_wire();
        wire.leader = "x".repeat(300);
        assert!(matches!(wire.into_request(), Err(Error::Leader { .. })));
    }

    #[test]
    fn a_set_of_too_many_files_is_refused() {
        let mut files = FileSet::new().with(MAIN_CONFIG, "global\n").expect("set");
        for i in 0..MAX_FILES {
            files.insert(format!("m/{i}"), "").expect("path");
        }
        assert!(matches!(
            ApplyRequest::new(1, "l", 1, files),
            Err(Error::TooManyFiles { count }) if count == MAX_FILES + 1
        ));
    }

    #[test]
    fn a_set_without_main_config_is_incomplete() {
        let files = FileSet::new().with("maps/x.map", "").expect("set");
        assert!(matches!(
            ApplyRequest::new(1, "l", 1, files),
            Err(Error::NoMainConfig)
        ));
    }

    #[test]
    fn an_applied_answer_of_an_older_agent_reads_as_a_reload() {
        let old = r#"{"result":"applied","checksum":"c","generation":3,"timing":{"total_us":1,"write_us":0,"check_us":0,"reload_us":0}}"#;
        match serde_json::from_str::<ApplyResponse>(old).expect("parses") {
            ApplyResponse::Applied {
                reload,
                runtime_ops,
                ..
            } => assert_eq!((reload, runtime_ops), (true, 0)),
            other => panic!("not applied: {other:?}"),
        }
        let new = ApplyResponse::Applied {
            checksum: "c".to_owned(),
            generation: 3,
            timing: Timing::default(),
            reload: false,
            runtime_ops: 7,
        };
        let text = serde_json::to_string(&new).expect("json");
        assert!(
            text.contains(r#""reload":false"#) && text.contains(r#""runtime_ops":7"#),
            "{text}"
        );
        assert_eq!(
            serde_json::from_str::<ApplyResponse>(&text).expect("parses"),
            new
        );
    }
}
