//! The rendered output: relative paths to bytes, in path order, with a sha256 checksum.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use haptic_checksum::Hashed;

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
/// The checksum (in [`haptic_checksum`]'s second form) covers every path, its length and its
/// bytes' digest, in path order: two sets have the same checksum exactly when they hold the
/// same files with the same bytes.
#[derive(Debug, Clone)]
pub struct FileSet {
    /// A file with the same bytes as in the set this one followed ([`FileSet::following`])
    /// shares that set's `Bytes`: whoever holds both (the render gate's base, the scheduler's
    /// delta bases) tells them apart by address, without reading them.
    files: BTreeMap<String, Bytes>,
    /// The checksum, and each file's chunked digest: a set made after this one
    /// ([`FileSet::following`]) hashes only the chunks that differ.
    hashed: Hashed,
}

impl PartialEq for FileSet {
    fn eq(&self, other: &Self) -> bool {
        self.hashed.digest() == other.hashed.digest() && self.files == other.files
    }
}

impl Eq for FileSet {}

fn pairs<B: AsRef<[u8]>>(
    files: &BTreeMap<String, B>,
) -> impl Iterator<Item = (&str, &[u8])> + Clone {
    files.iter().map(|(p, b)| (p.as_str(), b.as_ref()))
}

impl FileSet {
    /// A file set from its files; computes the checksum.
    pub fn new(files: BTreeMap<String, Vec<u8>>) -> Self {
        Self::of_shared(
            files
                .into_iter()
                .map(|(path, bytes)| (path, Bytes::from(bytes)))
                .collect(),
        )
    }

    /// A file set from files held as `Bytes` (kept, not copied); computes the checksum.
    pub fn of_shared(files: BTreeMap<String, Bytes>) -> Self {
        let hashed = haptic_checksum::hash(pairs(&files));
        Self { files, hashed }
    }

    /// The same set as [`FileSet::new`] gives, checksum included, hashing only the chunks
    /// of each file that differ from `previous`'s ([`haptic_checksum::hash_following`]): a
    /// render that added a server line to `haproxy.cfg` hashes a chunk or two of it, not the
    /// whole set.
    ///
    /// Files given as `Bytes` keep them: a file the render took from an earlier one (a
    /// per-item output reused) is the very `Bytes` the previous set holds, hashed and kept
    /// without being read.
    pub fn following<B: AsRef<[u8]> + Into<Bytes>>(
        files: BTreeMap<String, B>,
        previous: &FileSet,
    ) -> Self {
        Self::following_known(files, previous, &|_, _, _| haptic_checksum::Same::default())
    }

    /// As [`FileSet::following`], told by `known(path, bytes, old)` how many leading and
    /// trailing bytes a file is known to share with the previous set's file at that path (see
    /// [`haptic_checksum::hash_following_known`]: at most the true counts).
    pub(crate) fn following_known<B: AsRef<[u8]> + Into<Bytes>>(
        files: BTreeMap<String, B>,
        previous: &FileSet,
        known: &haptic_checksum::Known<'_>,
    ) -> Self {
        let hashed = haptic_checksum::hash_following_known(
            pairs(&files),
            pairs(&previous.files),
            &previous.hashed,
            known,
        );
        // A file whose digest is the one it had before takes the bytes it had before.
        let mut before = previous
            .files
            .iter()
            .zip(previous.hashed.file_digests().into_iter().flatten())
            .peekable();
        let digests = hashed.file_digests().into_iter().flatten();
        let files = files
            .into_iter()
            .zip(digests.map(Some).chain(std::iter::repeat(None)))
            .map(|((path, bytes), digest)| {
                while before.peek().is_some_and(|((old, _), _)| **old < path) {
                    before.next();
                }
                let kept = match (before.peek(), digest) {
                    (Some(((old, content), old_digest)), Some(digest))
                        if **old == path && *old_digest == digest =>
                    {
                        Some((*content).clone())
                    }
                    _ => None,
                };
                (path, kept.unwrap_or_else(|| bytes.into()))
            })
            .collect();
        Self { files, hashed }
    }

    /// The bytes of the file at `path`.
    pub fn get(&self, path: &str) -> Option<&[u8]> {
        self.files.get(path).map(Bytes::as_ref)
    }

    /// The file at `path` as text, if it exists and is UTF-8.
    pub fn text(&self, path: &str) -> Option<&str> {
        self.get(path).and_then(|b| std::str::from_utf8(b).ok())
    }

    /// Paths and bytes, in path order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.files.iter().map(|(p, b)| (p.as_str(), b.as_ref()))
    }

    /// Paths and bytes, in path order, as shared `Bytes`: a file unchanged since the set this
    /// one followed is the very `Bytes` that set holds.
    pub fn iter_shared(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.files.iter().map(|(p, b)| (p.as_str(), b))
    }

    /// The files, in path order.
    pub fn files(&self) -> &BTreeMap<String, Bytes> {
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
        self.files.values().map(Bytes::len).sum()
    }

    /// The sha256 checksum of the set.
    pub fn checksum(&self) -> &[u8; 32] {
        self.hashed.digest()
    }

    /// The checksum as lowercase hex.
    pub fn checksum_hex(&self) -> String {
        self.hashed.hex()
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
        // The second form: `v2-` and 64 hex digits.
        assert_eq!(a.checksum_hex().len(), 67);
        assert!(a.checksum_hex().starts_with("v2-"));
        // sha256 of the empty input: an empty set hashes nothing.
        assert_eq!(
            set(&[]).checksum_hex(),
            "v2-e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn a_set_following_another_has_the_checksum_of_the_whole() {
        let a = set(&[("a", "bc"), ("b", "de")]);
        let b = set(&[("a", "bc"), ("b", "dx")]);
        let owned = |set: &FileSet| {
            set.iter()
                .map(|(path, bytes)| (path.to_owned(), bytes.to_vec()))
                .collect::<BTreeMap<_, _>>()
        };
        let following = FileSet::following(owned(&b), &a);
        assert_eq!(following.checksum(), b.checksum());
        assert_eq!(following, b);
        // The file that did not change shares the bytes of the set before; the other not.
        let shared =
            |path: &str| std::ptr::eq(following.files()[path].as_ptr(), a.files()[path].as_ptr());
        assert!(shared("a"));
        assert!(!shared("b"));
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
