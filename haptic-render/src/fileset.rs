//! The rendered output: relative paths to bytes, in path order, with a sha256 checksum.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Writing a file set to disk failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Creating a directory or writing a file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file or directory that could not be written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A path is absolute or climbs out of the target directory.
    #[error("refusing to write `{0}`: not a relative path inside the target directory")]
    UnsafePath(String),
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A rendered file set: `haproxy.cfg`, `maps/...`, general files and `ssl/...`.
///
/// The checksum covers every path and its bytes, framed by their lengths, in path order: two
/// sets have the same checksum exactly when they hold the same files with the same bytes.
#[derive(Debug, Clone)]
pub struct FileSet {
    files: BTreeMap<String, Vec<u8>>,
    checksum: [u8; 32],
    /// The hasher's state every [`CHECKPOINT`] bytes of the hashed stream: a set that starts
    /// with the same bytes ([`FileSet::following`]) hashes only from where it differs.
    checkpoints: Checkpoints,
}

impl PartialEq for FileSet {
    fn eq(&self, other: &Self) -> bool {
        self.checksum == other.checksum && self.files == other.files
    }
}

impl Eq for FileSet {}

/// How often [`FileSet`] keeps the hasher's state: every 64 KiB of the stream (about 190
/// states, 21 KB, for a 12 MB set at 10,000 Ingresses).
const CHECKPOINT: u64 = 64 * 1024;

/// `states[i]`: the hasher after the first `(i + 1) * CHECKPOINT` bytes of the stream.
#[derive(Clone, Default)]
struct Checkpoints(Arc<Vec<Sha256>>);

impl std::fmt::Debug for Checkpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} checkpoints", self.0.len())
    }
}

/// Feeds the checksum's stream to the hasher from `start` on, keeping a state at every
/// [`CHECKPOINT`].
struct Feeder {
    hasher: Sha256,
    /// Where in the stream the next byte fed is.
    offset: u64,
    /// The bytes before this are already in `hasher` (a multiple of [`CHECKPOINT`]).
    start: u64,
    checkpoints: Vec<Sha256>,
}

impl Feeder {
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
                self.checkpoints.push(self.hasher.clone());
            }
        }
    }
}

/// How many leading bytes of the checksum's stream two sets surely share (at most the true
/// count: a file whose path or length differs counts from its start; bytes are compared in
/// blocks).
fn same_start(a: &BTreeMap<String, Vec<u8>>, b: &BTreeMap<String, Vec<u8>>) -> u64 {
    const BLOCK: usize = 4096;
    let mut offset = 0u64;
    for ((path_a, bytes_a), (path_b, bytes_b)) in a.iter().zip(b) {
        if path_a != path_b || bytes_a.len() != bytes_b.len() {
            return offset;
        }
        offset += 16 + path_a.len() as u64;
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

impl FileSet {
    /// A file set from its files; computes the checksum.
    pub fn new(files: BTreeMap<String, Vec<u8>>) -> Self {
        Self::hashed(
            files,
            Feeder {
                hasher: Sha256::new(),
                offset: 0,
                start: 0,
                checkpoints: Vec::new(),
            },
        )
    }

    /// The same set as [`FileSet::new`] gives, checksum included, hashing only from about
    /// where its checksum's stream first differs from `previous`'s (the hasher's state kept
    /// there): a render that changed a line of the middle map hashes the rest of the set,
    /// not all of it; one that changed nothing, nothing but the last [`CHECKPOINT`].
    pub fn following(files: BTreeMap<String, Vec<u8>>, previous: &FileSet) -> Self {
        let same = same_start(&files, &previous.files);
        let states = &previous.checkpoints.0;
        let kept = usize::try_from(same / CHECKPOINT)
            .unwrap_or(usize::MAX)
            .min(states.len());
        let Some(last) = kept.checked_sub(1).and_then(|at| states.get(at)) else {
            return Self::new(files);
        };
        let start = kept as u64 * CHECKPOINT;
        let mut checkpoints = Vec::with_capacity(states.len() + 1);
        checkpoints.extend(states.iter().take(kept).cloned());
        Self::hashed(
            files,
            Feeder {
                hasher: last.clone(),
                offset: 0,
                start,
                checkpoints,
            },
        )
    }

    fn hashed(files: BTreeMap<String, Vec<u8>>, mut feeder: Feeder) -> Self {
        for (path, bytes) in &files {
            feeder.feed(&(path.len() as u64).to_be_bytes());
            feeder.feed(path.as_bytes());
            feeder.feed(&(bytes.len() as u64).to_be_bytes());
            feeder.feed(bytes);
        }
        Self {
            files,
            checksum: feeder.hasher.finalize().into(),
            checkpoints: Checkpoints(Arc::new(feeder.checkpoints)),
        }
    }

    /// The bytes of the file at `path`.
    pub fn get(&self, path: &str) -> Option<&[u8]> {
        self.files.get(path).map(Vec::as_slice)
    }

    /// The file at `path` as text, if it exists and is UTF-8.
    pub fn text(&self, path: &str) -> Option<&str> {
        self.get(path).and_then(|b| std::str::from_utf8(b).ok())
    }

    /// Paths and bytes, in path order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.files.iter().map(|(p, b)| (p.as_str(), b.as_slice()))
    }

    /// The files, in path order.
    pub fn files(&self) -> &BTreeMap<String, Vec<u8>> {
        &self.files
    }

    /// Number of files.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether there are no files.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Sum of the files' sizes in bytes.
    pub fn total_bytes(&self) -> usize {
        self.files.values().map(Vec::len).sum()
    }

    /// The sha256 checksum of the set.
    pub fn checksum(&self) -> &[u8; 32] {
        &self.checksum
    }

    /// The checksum as lowercase hex.
    pub fn checksum_hex(&self) -> String {
        hex::encode(self.checksum)
    }

    /// Writes every file under `dir`, creating directories as needed.
    ///
    /// Not atomic: the agent stages and swaps; this is for tools and tests. The renderer only
    /// produces relative paths without `..`; a set built by hand with anything else is refused
    /// before anything is written.
    pub fn write_to(&self, dir: &Path) -> Result<()> {
        let unsafe_path = self.files.keys().find(|path| {
            path.is_empty()
                || Path::new(path).is_absolute()
                || path.split(['/', '\\']).any(|s| s.is_empty() || s == "..")
        });
        if let Some(path) = unsafe_path {
            return Err(Error::UnsafePath(path.clone()));
        }
        for (path, bytes) in &self.files {
            let target = dir.join(path);
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|source| Error::Io {
                    path: parent.to_owned(),
                    source,
                })?;
            }
            std::fs::write(&target, bytes).map_err(|source| Error::Io {
                path: target.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn set(files: &[(&str, &str)]) -> FileSet {
        FileSet::new(
            files
                .iter()
                .map(|(p, c)| (p.to_string(), c.as_bytes().to_vec()))
                .collect(),
        )
    }

    #[test]
    fn checksum_depends_on_paths_and_bytes_with_framing() {
        let a = set(&[("a", "bc")]);
        assert_eq!(a.checksum(), set(&[("a", "bc")]).checksum());
        assert_ne!(a.checksum(), set(&[("ab", "c")]).checksum());
        assert_ne!(a.checksum(), set(&[("a", "bd")]).checksum());
        assert_ne!(a.checksum(), set(&[("a", "bc"), ("b", "")]).checksum());
        assert_eq!(a.checksum_hex().len(), 64);
        // sha256 of the empty input: an empty set hashes nothing.
        assert_eq!(
            set(&[]).checksum_hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    /// A set of `files` files of about `size` bytes each, of a few distinct lines (so that
    /// sets share long runs, as renders do).
    fn generated(files: usize, size: usize, seed: u64) -> BTreeMap<String, Vec<u8>> {
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A set hashed on from where it differs from the one before has the checksum (and
        /// the checkpoints) of the set hashed whole, after any edit: a byte changed, added or
        /// removed anywhere, a file added or removed; and so on over a chain of sets.
        #[test]
        fn a_checksum_resumed_is_the_checksum_of_the_whole(
            files in 1usize..6,
            size in 0usize..200_000,
            edits in proptest::collection::vec((0usize..8, 0usize..400_000, 0u8..4), 1..6),
        ) {
            let mut current = generated(files, size, 1);
            let mut previous = FileSet::new(current.clone());
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
                let whole = FileSet::new(current.clone());
                let resumed = FileSet::following(current.clone(), &previous);
                proptest::prop_assert_eq!(resumed.checksum_hex(), whole.checksum_hex());
                proptest::prop_assert_eq!(resumed.checkpoints.0.len(), whole.checkpoints.0.len());
                previous = resumed;
            }
        }
    }

    #[test]
    fn a_set_that_changed_late_is_hashed_from_late() {
        let files = generated(3, 300_000, 7);
        let before = FileSet::new(files.clone());
        let mut after = files.clone();
        if let Some(last) = after.get_mut("f002") {
            let end = last.len() - 10;
            last[end] ^= 1;
        }
        // The stream is the same up to the last file's end: 13 of 14 checkpoints are shared
        // (the very same states, not recomputed ones).
        let resumed = FileSet::following(after.clone(), &before);
        assert_eq!(resumed.checksum(), FileSet::new(after).checksum());
        assert_ne!(resumed.checksum(), before.checksum());
        assert_eq!(before.checkpoints.0.len(), 13);
        assert_eq!(same_start(&resumed.files, &before.files) / CHECKPOINT, 13);
        // Unchanged: the same checksum, from the last checkpoint on.
        let again = FileSet::following(files.clone(), &before);
        assert_eq!(again.checksum(), before.checksum());
        let stream: usize = files.iter().map(|(p, b)| 16 + p.len() + b.len()).sum();
        assert_eq!(same_start(&files, &before.files), stream as u64);
    }

    #[test]
    fn writes_nested_paths() {
        let dir = tempfile::tempdir().unwrap();
        let s = set(&[("haproxy.cfg", "global\n"), ("maps/host.map", "a b\n")]);
        s.write_to(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("maps/host.map")).unwrap(),
            "a b\n"
        );
        assert_eq!(s.total_bytes(), 11);
    }

    #[test]
    fn refuses_paths_outside_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["../x", "/etc/x", "a/../../x", "", "a//b"] {
            let err = set(&[("ok", "1"), (bad, "2")]).write_to(dir.path());
            assert!(matches!(err, Err(Error::UnsafePath(_))), "{bad:?}");
        }
        assert!(
            !dir.path().join("ok").exists(),
            "nothing is written when a path is refused"
        );
    }
}
