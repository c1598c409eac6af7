//! The checksum of a HAPTIC file set, in one place for the renderer (`haptic-render`'s
//! `FileSet`) and the agent protocol (`haptic-agent-client`'s). It has two forms, told apart
//! by their text ([`Form::of`]):
//!
//! - [`Form::V2`] (what [`hash`] gives; `v2-` and 64 lowercase hex digits): SHA-256 over one
//!   record per file, in byte order of its path, of the path's length as a big-endian u64, the
//!   path's UTF-8 bytes, the content's length as a big-endian u64 and the content's digest,
//!   itself built from chunks cut at line ends chosen by their bytes (module [`v2`]'s
//!   documentation has the rules). An edit hashes again the chunks it touches and the
//!   records: a new server line in the 7 MB `haproxy.cfg` of a 10,000-Ingress set is 16-64 KiB
//!   of SHA-256 and a 200 KB record stream.
//! - [`Form::V1`] (64 lowercase hex digits), which agents and controllers before the second
//!   form send and record: SHA-256 over, for each file in byte order of its path, the path's
//!   length as a big-endian u64, the path's UTF-8 bytes, the content's length as a big-endian
//!   u64 and the content. One stream: what can be kept of it is the hasher's state every
//!   [`CHECKPOINT`] bytes, so a set that starts with the same bytes as the one before is hashed
//!   from the last state before its first difference; but a file whose length changed is
//!   hashed from its start, with every file after it (at 10,000 Ingresses: 9 MB, 6-8 ms on
//!   this project's 2-vCPU machine, for a new server line in `haproxy.cfg`).
//!
//! Both forms of a set are the same whether hashed whole or from the set before
//! ([`hash_following`]).

use std::sync::Arc;

use sha2::{Digest, Sha256};

pub mod v2;

pub use v2::{Known, Same};

/// How often the first form keeps the hasher's state: every 64 KiB of the stream (about 190
/// states, 21 KB, for a 12 MB set).
pub const CHECKPOINT: u64 = 64 * 1024;

/// What the second form's text starts with.
pub const V2_PREFIX: &str = "v2-";

/// The form of a checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Form {
    /// One SHA-256 stream over the length-framed paths and contents: 64 lowercase hex digits.
    V1,
    /// SHA-256 over the paths and each file's chunked digest: [`V2_PREFIX`] and 64 lowercase
    /// hex digits.
    V2,
}

impl Form {
    /// The form a checksum's text is in; `None` when it is in neither.
    pub fn of(checksum: &str) -> Option<Form> {
        let hex64 = |s: &str| {
            s.len() == 64
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        match checksum.strip_prefix(V2_PREFIX) {
            Some(rest) if hex64(rest) => Some(Form::V2),
            Some(_) => None,
            None => hex64(checksum).then_some(Form::V1),
        }
    }

    /// The form's name (`v1`, `v2`).
    pub fn name(self) -> &'static str {
        match self {
            Form::V1 => "v1",
            Form::V2 => "v2",
        }
    }
}

/// What a checksum keeps to hash a later set from.
#[derive(Clone)]
enum Kept {
    /// [`Form::V1`]: the hasher's state at every [`CHECKPOINT`] of the stream (`states[i]`:
    /// after the first `(i + 1) * CHECKPOINT` bytes).
    Stream(Arc<Vec<Sha256>>),
    /// [`Form::V2`]: each file's digest and chunks, in path order.
    Files(Arc<Vec<Arc<v2::FileHash>>>),
}

/// A set's checksum and what it keeps to hash a later set from. Cheap to clone.
#[derive(Clone)]
pub struct Hashed {
    digest: [u8; 32],
    kept: Kept,
}

impl std::fmt::Debug for Hashed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hashed")
            .field("checksum", &self.hex())
            .field("checkpoints", &self.checkpoints())
            .finish()
    }
}

impl Hashed {
    /// The SHA-256 digest.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The checksum's form.
    pub fn form(&self) -> Form {
        match self.kept {
            Kept::Stream(_) => Form::V1,
            Kept::Files(_) => Form::V2,
        }
    }

    /// The checksum as the protocol sends it: 64 lowercase hex digits, after [`V2_PREFIX`] in
    /// the second form.
    pub fn hex(&self) -> String {
        match self.kept {
            Kept::Stream(_) => hex::encode(self.digest),
            Kept::Files(_) => format!("{V2_PREFIX}{}", hex::encode(self.digest)),
        }
    }

    /// Each file's digest, in path order (second form; none for the first, which keeps no
    /// per-file digest). Two files with the same digest have the same bytes.
    pub fn file_digests(&self) -> Option<impl ExactSizeIterator<Item = &[u8; 32]>> {
        match &self.kept {
            Kept::Stream(_) => None,
            Kept::Files(files) => Some(files.iter().map(|file| file.digest())),
        }
    }

    /// How many states (first form) or file digests (second form) are kept.
    pub fn checkpoints(&self) -> usize {
        match &self.kept {
            Kept::Stream(states) => states.len(),
            Kept::Files(files) => files.len(),
        }
    }
}

impl From<v2::Files> for Hashed {
    fn from(files: v2::Files) -> Self {
        Hashed {
            digest: files.digest,
            kept: Kept::Files(files.files),
        }
    }
}

/// The checksum of `files` (in path order), in the second form, hashed whole.
pub fn hash<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Hashed {
    v2::hash(files).into()
}

/// The checksum of `files` (in path order) in `form`, hashed whole.
pub fn hash_as<'a>(form: Form, files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Hashed {
    match form {
        Form::V1 => hash_v1(files),
        Form::V2 => hash(files),
    }
}

/// The checksum of `files` (in path order), in the first form, hashed whole.
pub fn hash_v1<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Hashed {
    Feeder::new(Sha256::new(), 0, Vec::new()).all(files)
}

/// The checksum of `files` (in path order) in the form of `hashed`, as [`hash_as`] gives it,
/// hashed from `previous` (in path order), whose checksum `hashed` is: in the second form,
/// each file from the one under its path before (not read at all when both share their
/// bytes' address, such as shared `Bytes`; else only the chunks an edit touched); in the
/// first, from the last state `hashed` kept before the stream's first difference (contents
/// compared in 4 KiB blocks). `hashed` must be the checksum of `previous` (a wrong one gives
/// a wrong checksum).
pub fn hash_following<'a, 'b>(
    files: impl IntoIterator<Item = (&'a str, &'a [u8])> + Clone,
    previous: impl IntoIterator<Item = (&'b str, &'b [u8])>,
    hashed: &Hashed,
) -> Hashed {
    hash_following_known(files, previous, hashed, &|_, _, _| Same::default())
}

/// As [`hash_following`], told by `known(path, bytes, old)` how many leading and trailing
/// bytes a file shares with the same path's bytes before, as far as its maker knows (a
/// renderer that copied a run of 7 MB from its last output): those are not compared again.
/// Each count must be at most the true one (debug builds check it); more would give a wrong
/// checksum.
pub fn hash_following_known<'a, 'b>(
    files: impl IntoIterator<Item = (&'a str, &'a [u8])> + Clone,
    previous: impl IntoIterator<Item = (&'b str, &'b [u8])>,
    hashed: &Hashed,
    known: &Known<'_>,
) -> Hashed {
    let states = match &hashed.kept {
        Kept::Files(kept) => {
            let before = v2::Files {
                digest: hashed.digest,
                files: kept.clone(),
            };
            return v2::hash_following(files, previous, &before, known).into();
        }
        Kept::Stream(states) => states,
    };
    let same = same_start(files.clone(), previous);
    let kept = usize::try_from(same / CHECKPOINT)
        .unwrap_or(usize::MAX)
        .min(states.len());
    let Some(state) = kept.checked_sub(1).and_then(|at| states.get(at)) else {
        return hash_v1(files);
    };
    let mut resumed = Vec::with_capacity(states.len() + 1);
    resumed.extend(states.iter().take(kept).cloned());
    Feeder::new(state.clone(), kept as u64 * CHECKPOINT, resumed).all(files)
}

/// How many leading bytes of the checksum's stream two sets surely share: at most the true
/// count (a file whose path or length differs counts from its start; contents are compared
/// in blocks).
fn same_start<'a, 'b>(
    a: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    b: impl IntoIterator<Item = (&'b str, &'b [u8])>,
) -> u64 {
    const BLOCK: usize = 4096;
    let mut offset = 0u64;
    for ((path_a, bytes_a), (path_b, bytes_b)) in a.into_iter().zip(b) {
        if path_a != path_b || bytes_a.len() != bytes_b.len() {
            return offset;
        }
        offset += 16 + path_a.len() as u64;
        if std::ptr::eq(bytes_a, bytes_b) {
            offset += bytes_a.len() as u64;
            continue;
        }
        let same = bytes_a
            .chunks(BLOCK)
            .zip(bytes_b.chunks(BLOCK))
            .take_while(|(x, y)| x == y)
            .count()
            * BLOCK;
        if same < bytes_a.len() {
            return offset + same as u64;
        }
        offset += bytes_a.len() as u64;
    }
    offset
}

/// Feeds the checksum's stream to the hasher from `start` on, keeping a state at every
/// [`CHECKPOINT`].
struct Feeder {
    hasher: Sha256,
    /// Where in the stream the next byte fed is.
    offset: u64,
    /// The bytes before this are already in `hasher` (a multiple of [`CHECKPOINT`]).
    start: u64,
    states: Vec<Sha256>,
}

impl Feeder {
    fn new(hasher: Sha256, start: u64, states: Vec<Sha256>) -> Self {
        Self {
            hasher,
            offset: 0,
            start,
            states,
        }
    }

    fn all<'a>(mut self, files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Hashed {
        for (path, content) in files {
            self.feed(&(path.len() as u64).to_be_bytes());
            self.feed(path.as_bytes());
            self.feed(&(content.len() as u64).to_be_bytes());
            self.feed(content);
        }
        Hashed {
            digest: self.hasher.finalize().into(),
            kept: Kept::Stream(Arc::new(self.states)),
        }
    }

    fn feed(&mut self, mut data: &[u8]) {
        let end = self.offset + data.len() as u64;
        if end <= self.start {
            self.offset = end;
            return;
        }
        if self.offset < self.start {
            let skip = usize::try_from(self.start - self.offset).unwrap_or(usize::MAX);
            data = data.get(skip..).unwrap_or_default();
            self.offset = self.start;
        }
        while !data.is_empty() {
            let next = (self.offset / CHECKPOINT + 1) * CHECKPOINT;
            let take = usize::try_from(next - self.offset)
                .unwrap_or(usize::MAX)
                .min(data.len());
            let (now, rest) = data.split_at(take);
            self.hasher.update(now);
            self.offset += take as u64;
            data = rest;
            if self.offset == next {
                self.states.push(self.hasher.clone());
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    type Files = BTreeMap<String, Vec<u8>>;

    fn pairs(files: &Files) -> impl Iterator<Item = (&str, &[u8])> + Clone {
        files.iter().map(|(p, b)| (p.as_str(), b.as_slice()))
    }

    /// `files` files of about `size` bytes each, of a few distinct lines (so that sets share
    /// long runs, as renders do).
    fn generated(files: usize, size: usize, seed: u64) -> Files {
        (0..files)
            .map(|i| {
                let mut bytes = Vec::with_capacity(size);
                let mut n = seed.wrapping_add(i as u64);
                while bytes.len() < size {
                    n = n.wrapping_mul(6364136223846793005).wrapping_add(1);
                    bytes.extend_from_slice(format!("line {}\n", n % 7).as_bytes());
                }
                (format!("f{i:03}"), bytes)
            })
            .collect()
    }

    #[test]
    fn the_framing_is_the_documented_one() {
        // Computed independently: sha256 of u64be(len) path u64be(len) bytes, in path order.
        let mut stream = Vec::new();
        for (path, content) in [("a", &b"bc"[..]), ("d/e", b"")] {
            stream.extend((path.len() as u64).to_be_bytes());
            stream.extend(path.as_bytes());
            stream.extend((content.len() as u64).to_be_bytes());
            stream.extend(content);
        }
        let want = hex::encode(Sha256::digest(&stream));
        assert_eq!(hash_v1([("a", &b"bc"[..]), ("d/e", b"")]).hex(), want);
        assert_eq!(
            hash_v1([]).hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn the_second_form_is_the_documented_one() {
        // Computed independently: sha256 of u64be(len) path u64be(len) sha256(bytes), in path
        // order, for files of one chunk.
        let mut stream = Vec::new();
        for (path, content) in [("a", &b"bc"[..]), ("d/e", b"")] {
            stream.extend((path.len() as u64).to_be_bytes());
            stream.extend(path.as_bytes());
            stream.extend((content.len() as u64).to_be_bytes());
            stream.extend(Sha256::digest(content));
        }
        let want = format!("v2-{}", hex::encode(Sha256::digest(&stream)));
        let got = hash([("a", &b"bc"[..]), ("d/e", b"")]);
        assert_eq!(got.hex(), want);
        assert_eq!(got.form(), Form::V2);
        assert_eq!(Form::of(&want), Some(Form::V2));
        assert_eq!(Form::of(&want[3..]), Some(Form::V1));
        assert_eq!(Form::of(&want[..66]), None);
        assert_eq!(Form::of(&want.to_uppercase()), None);
        assert_eq!(Form::of(&format!("v3-{}", &want[3..])), None);
        // The two forms of one set differ.
        assert_ne!(hash_v1([("a", &b"bc"[..])]).digest(), got.digest());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A set hashed on from where it differs from the one before has the checksum (and
        /// the states) of the set hashed whole, after any edit: a byte changed, added or
        /// removed anywhere, a file added or removed; and so on over a chain of sets.
        #[test]
        fn a_checksum_resumed_is_the_checksum_of_the_whole(
            second in proptest::bool::ANY,
            files in 1usize..6,
            size in 0usize..200_000,
            edits in proptest::collection::vec((0usize..8, 0usize..400_000, 0u8..4), 1..6),
        ) {
            let form = if second { Form::V2 } else { Form::V1 };
            let mut current = generated(files, size, 1);
            let mut previous = (current.clone(), hash_as(form, pairs(&current)));
            for (file, at, kind) in edits {
                let key = format!("f{:03}", file % (files + 1));
                match kind {
                    0 => { current.remove(&key); }
                    _ => {
                        let bytes = current.entry(key).or_default();
                        let at = at.min(bytes.len());
                        match kind {
                            1 => bytes.insert(at, b'x'),
                            2 if at < bytes.len() => { bytes.remove(at); }
                            _ => match bytes.get_mut(at) {
                                Some(b) => *b ^= 1,
                                None => bytes.push(b'y'),
                            },
                        }
                    }
                }
                let whole = hash_as(form, pairs(&current));
                let resumed = hash_following(pairs(&current), pairs(&previous.0), &previous.1);
                proptest::prop_assert_eq!(resumed.hex(), whole.hex());
                proptest::prop_assert_eq!(resumed.checkpoints(), whole.checkpoints());
                previous = (current.clone(), resumed);
            }
        }
    }

    #[test]
    fn a_set_that_changed_late_is_hashed_from_late() {
        let files = generated(3, 300_000, 7);
        let before = hash_v1(pairs(&files));
        let mut after = files.clone();
        let last = after.get_mut("f002").unwrap();
        let end = last.len() - 10;
        last[end] ^= 1;
        // The stream is the same up to the last file's end: all 13 states are shared.
        let resumed = hash_following(pairs(&after), pairs(&files), &before);
        assert_eq!(resumed.hex(), hash_v1(pairs(&after)).hex());
        assert_ne!(resumed.hex(), before.hex());
        assert_eq!(before.checkpoints(), 13);
        assert_eq!(same_start(pairs(&after), pairs(&files)) / CHECKPOINT, 13);
        // Unchanged: the same checksum; the stream is the same to its end.
        let again = hash_following(pairs(&files), pairs(&files), &before);
        assert_eq!(again.hex(), before.hex());
        let stream: usize = files.iter().map(|(p, b)| 16 + p.len() + b.len()).sum();
        assert_eq!(same_start(pairs(&files), pairs(&files)), stream as u64);
    }
}
