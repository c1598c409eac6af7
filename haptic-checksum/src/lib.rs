//! The checksum of a HAPTIC file set, in one place for the renderer (`haptic-render`'s
//! `FileSet`) and the agent protocol (`haptic-agent-client`'s): SHA-256 over, for each file in
//! byte order of its path, the path's length as a big-endian u64, the path's UTF-8 bytes, the
//! content's length as a big-endian u64 and the content.
//!
//! SHA-256 is one stream: nothing of it can be kept for the files that did not change. What
//! can be kept is the hasher's state every [`CHECKPOINT`] bytes of the stream ([`Hashed`]): a
//! set that starts with the same bytes as the one before ([`hash_following`]) is hashed from
//! the last state before its first difference, and gets the very checksum a hash of the whole
//! set gives. At 10,000 Ingresses the set is about 12 MB, 6-8 ms of SHA-256 on this
//! project's 2-vCPU machine; a render after an Ingress event differs from the set before
//! near the end of its maps, and hashes about 1 MB of it.

use std::sync::Arc;

use sha2::{Digest, Sha256};

/// How often the hasher's state is kept: every 64 KiB of the stream (about 190 states, 21 KB,
/// for a 12 MB set).
pub const CHECKPOINT: u64 = 64 * 1024;

/// A set's checksum and the hasher's state at every [`CHECKPOINT`] of its stream
/// (`states[i]`: after the first `(i + 1) * CHECKPOINT` bytes). Cheap to clone.
#[derive(Clone)]
pub struct Hashed {
    digest: [u8; 32],
    states: Arc<Vec<Sha256>>,
}

impl std::fmt::Debug for Hashed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hashed")
            .field("digest", &self.hex())
            .field("checkpoints", &self.states.len())
            .finish()
    }
}

impl Hashed {
    /// The SHA-256 digest.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The digest as 64 lowercase hex digits (the form the protocol sends).
    pub fn hex(&self) -> String {
        hex::encode(self.digest)
    }

    /// How many states are kept.
    pub fn checkpoints(&self) -> usize {
        self.states.len()
    }
}

/// The checksum of `files` (in path order), hashed whole.
pub fn hash<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Hashed {
    Feeder::new(Sha256::new(), 0, Vec::new()).all(files)
}

/// The checksum of `files` (in path order), as [`hash`] gives it, hashed only from about where
/// its stream first differs from that of `previous` (in path order), whose checksum is
/// `hashed`: from the last state `hashed` kept before that point. Contents are compared in
/// 4 KiB blocks (two slices at the same address, such as shared `Bytes`, without reading
/// them). `hashed` must be the checksum of `previous` (a wrong one gives a wrong checksum).
pub fn hash_following<'a, 'b>(
    files: impl IntoIterator<Item = (&'a str, &'a [u8])> + Clone,
    previous: impl IntoIterator<Item = (&'b str, &'b [u8])>,
    hashed: &Hashed,
) -> Hashed {
    let same = same_start(files.clone(), previous);
    let kept = usize::try_from(same / CHECKPOINT)
        .unwrap_or(usize::MAX)
        .min(hashed.states.len());
    let Some(state) = kept.checked_sub(1).and_then(|at| hashed.states.get(at)) else {
        return hash(files);
    };
    let mut states = Vec::with_capacity(hashed.states.len() + 1);
    states.extend(hashed.states.iter().take(kept).cloned());
    Feeder::new(state.clone(), kept as u64 * CHECKPOINT, states).all(files)
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
            states: Arc::new(self.states),
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
        assert_eq!(hash([("a", &b"bc"[..]), ("d/e", b"")]).hex(), want);
        assert_eq!(
            hash([]).hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A set hashed on from where it differs from the one before has the checksum (and
        /// the states) of the set hashed whole, after any edit: a byte changed, added or
        /// removed anywhere, a file added or removed; and so on over a chain of sets.
        #[test]
        fn a_checksum_resumed_is_the_checksum_of_the_whole(
            files in 1usize..6,
            size in 0usize..200_000,
            edits in proptest::collection::vec((0usize..8, 0usize..400_000, 0u8..4), 1..6),
        ) {
            let mut current = generated(files, size, 1);
            let mut previous = (current.clone(), hash(pairs(&current)));
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
                let whole = hash(pairs(&current));
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
        let before = hash(pairs(&files));
        let mut after = files.clone();
        let last = after.get_mut("f002").unwrap();
        let end = last.len() - 10;
        last[end] ^= 1;
        // The stream is the same up to the last file's end: all 13 states are shared.
        let resumed = hash_following(pairs(&after), pairs(&files), &before);
        assert_eq!(resumed.hex(), hash(pairs(&after)).hex());
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
