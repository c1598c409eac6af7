//! The second form of the set checksum: SHA-256 over one record per file, in byte order of
//! its path, of the path's length as a big-endian u64, the path's UTF-8 bytes, the content's
//! length as a big-endian u64 and the content's 32-byte digest ([`file_digest`]).
//!
//! A file's digest is built from chunks whose ends depend only on the bytes around them
//! (line ends chosen by a hash of their line, [`chunk_end`]), so an edit anywhere in a file,
//! one that changes its length included, changes only the chunks it touches: the chunks
//! before it are kept, and those after it are found again by their starts, shifted by what
//! the edit added or removed. A new server line in a 7 MB `haproxy.cfg` is a chunk or two
//! (16-64 KiB) hashed again and a 200 KB record stream, where the first form hashes every
//! byte from the start of `haproxy.cfg` to the end of the set.

use std::sync::Arc;

use sha2::{Digest, Sha256};

/// A chunk is at least this long, unless the file ends first.
pub const MIN_CHUNK: usize = 16 * 1024;
/// A chunk is at most this long: cut here when no line end was chosen before.
pub const MAX_CHUNK: usize = 64 * 1024;
/// A line end at least [`MIN_CHUNK`] past the chunk's start ends the chunk when the hash of
/// its line ([`line_hash`]) has these bits clear (one line in 32).
const CUT_MASK: u64 = 31;
/// Starts the digest of a file of more than one chunk: its chunks' digests follow.
const CHUNKS_PREFIX: &[u8] = b"HAPTIC file chunks\n";

/// One chunk of a file: where it ends (exclusive) and the SHA-256 of its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunk {
    end: usize,
    digest: [u8; 32],
}

/// A file's digest and its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FileHash {
    digest: [u8; 32],
    chunks: Vec<Chunk>,
}

impl FileHash {
    /// The file's digest.
    pub(crate) fn digest(&self) -> &[u8; 32] {
        &self.digest
    }
}

/// FNV-1a (64-bit) of a line: chooses which line ends end a chunk.
fn line_hash(line: &[u8]) -> u64 {
    line.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Where the chunk of `bytes` that starts at `from` ends: the first line end (just past a
/// `\n`) at least [`MIN_CHUNK`] after `from` whose line (from its start, or from `from`)
/// hashes with [`CUT_MASK`]'s bits clear; else [`MAX_CHUNK`] after `from`; and never past the
/// file's end. It reads only `bytes[from..]`, so two files whose bytes from their own `from`
/// on are the same cut there alike.
pub(crate) fn chunk_end(bytes: &[u8], from: usize) -> usize {
    let len = bytes.len();
    let max = from.saturating_add(MAX_CHUNK).min(len);
    let first = from.saturating_add(MIN_CHUNK);
    if first >= len {
        return len;
    }
    // The line that holds byte `first - 1` starts after the last `\n` before it.
    let window = bytes.get(from..first - 1).unwrap_or_default();
    let mut line_start = memchr::memrchr(b'\n', window).map_or(from, |at| from + at + 1);
    let mut search = first - 1;
    while search < max {
        let Some(found) = bytes
            .get(search..max)
            .and_then(|rest| memchr::memchr(b'\n', rest))
        else {
            break;
        };
        let end = search + found + 1;
        if line_hash(bytes.get(line_start..end).unwrap_or_default()) & CUT_MASK == 0 {
            return end;
        }
        line_start = end;
        search = end;
    }
    max
}

fn sha(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The digest of a file made of `chunks`: that of its only chunk (the SHA-256 of its bytes);
/// of an empty file, the SHA-256 of nothing; else the SHA-256 of [`CHUNKS_PREFIX`] and its
/// chunks' digests in order.
fn digest_of(chunks: &[Chunk]) -> [u8; 32] {
    match chunks {
        [] => sha(b""),
        [only] => only.digest,
        many => {
            let mut hasher = Sha256::new();
            hasher.update(CHUNKS_PREFIX);
            for chunk in many {
                hasher.update(chunk.digest);
            }
            hasher.finalize().into()
        }
    }
}

/// What [`chunk_from`]'s `resume` found at a chunk's start.
enum Found {
    /// Nothing: the chunk is cut and hashed.
    Nothing,
    /// The chunks that follow from there to the file's end (appended): done.
    Rest,
    /// A chunk or more (appended): on from the last one's end.
    Some,
}

/// Chunks `bytes` from `at` (a chunk's start) to its end, appending to `chunks`; at each
/// chunk start, `resume` may append chunks it knows (the rest of the file's, or some).
fn chunk_from(
    bytes: &[u8],
    mut at: usize,
    chunks: &mut Vec<Chunk>,
    mut resume: impl FnMut(usize, &mut Vec<Chunk>) -> Found,
) {
    while at < bytes.len() {
        match resume(at, chunks) {
            Found::Rest => return,
            Found::Some => {
                let Some(last) = chunks.last() else { return };
                if last.end <= at {
                    // Nothing past `at`: never taken, but no endless loop either.
                    return;
                }
                at = last.end;
                continue;
            }
            Found::Nothing => {}
        }
        let end = chunk_end(bytes, at);
        #[cfg(test)]
        tests::HASHED.with(|hashed| hashed.set(hashed.get() + (end - at)));
        chunks.push(Chunk {
            end,
            digest: sha(bytes.get(at..end).unwrap_or_default()),
        });
        at = end;
    }
}

/// How many leading bytes of a chunk find the old chunks that may be the same
/// ([`OldChunks`]).
const PROBE: usize = 64;

/// The old file's chunks by the hash of their first [`PROBE`] bytes: a chunk of the new file
/// that starts as one of them does, and has its bytes, is that chunk (its ends depend only on
/// its own bytes, [`chunk_end`]), wherever the edits before it moved it to. So a file edited
/// in two places (a backend that leaves the pool's section for the others' in `haproxy.cfg`)
/// hashes what changed, and compares what moved, instead of hashing everything between.
struct OldChunks<'a> {
    old: &'a [u8],
    chunks: &'a [Chunk],
    by_start: std::collections::HashMap<u64, Vec<usize>>,
}

impl<'a> OldChunks<'a> {
    fn new(old: &'a [u8], chunks: &'a [Chunk]) -> Self {
        let mut by_start: std::collections::HashMap<u64, Vec<usize>> =
            std::collections::HashMap::with_capacity(chunks.len());
        for index in 0..chunks.len() {
            let start = Self::start(chunks, index);
            let head = old
                .get(start..(start + PROBE).min(old.len()))
                .unwrap_or_default();
            by_start.entry(line_hash(head)).or_default().push(index);
        }
        Self {
            old,
            chunks,
            by_start,
        }
    }

    fn start(chunks: &[Chunk], index: usize) -> usize {
        index
            .checked_sub(1)
            .and_then(|before| chunks.get(before))
            .map_or(0, |chunk| chunk.end)
    }

    /// The old chunk that `bytes` has at `at`, shifted there.
    fn find(&self, bytes: &[u8], at: usize) -> Option<Chunk> {
        let head = bytes.get(at..(at + PROBE).min(bytes.len()))?;
        self.by_start
            .get(&line_hash(head))?
            .iter()
            .find_map(|&index| {
                let chunk = self.chunks.get(index)?;
                let start = Self::start(self.chunks, index);
                let len = chunk.end.checked_sub(start)?;
                let end = at.checked_add(len)?;
                // A chunk cut by its file's end is the same only where this one ends too.
                if chunk.end == self.old.len() && end != bytes.len() {
                    return None;
                }
                (bytes.get(at..end)? == self.old.get(start..chunk.end)?).then_some(Chunk {
                    end,
                    digest: chunk.digest,
                })
            })
    }
}

/// The digest of a file, hashed whole.
pub(crate) fn file_hash(bytes: &[u8]) -> FileHash {
    let mut chunks = Vec::new();
    chunk_from(bytes, 0, &mut chunks, |_, _| Found::Nothing);
    FileHash {
        digest: digest_of(&chunks),
        chunks,
    }
}

/// The digest of a file, as [`file_hash`] gives it, from `old` (the file before, whose
/// digest is `hashed`): the chunks before the first byte that differs are kept, the chunks
/// after the last one are found again where they start (shifted by the change of length),
/// and only those in between are hashed.
#[cfg(test)]
pub(crate) fn file_hash_following(bytes: &[u8], old: &[u8], hashed: &FileHash) -> FileHash {
    file_hash_known(bytes, old, hashed, Same::default())
}

/// As [`file_hash_following`], with `known`: how many leading and trailing bytes `bytes`
/// and `old` are known to share (their writer knows; at most the true counts). They are not
/// read again: the comparison goes on from there.
pub(crate) fn file_hash_known(
    bytes: &[u8],
    old: &[u8],
    hashed: &FileHash,
    known: Same,
) -> FileHash {
    if std::ptr::eq(bytes, old) {
        return hashed.clone();
    }
    let shorter = bytes.len().min(old.len());
    let head = known.prefix.min(shorter);
    debug_assert_eq!(
        bytes.get(..head),
        old.get(..head),
        "a known prefix that differs"
    );
    // One pass over the shared prefix: it is the whole file when nothing differs (a full
    // comparison first, then the prefix's, read a 7 MB file's unchanged start twice).
    let prefix = head
        + same_prefix(
            bytes.get(head..).unwrap_or_default(),
            old.get(head..).unwrap_or_default(),
        );
    if prefix == bytes.len() && prefix == old.len() {
        return hashed.clone();
    }
    let room = shorter - prefix;
    let tail = known.suffix.min(room);
    debug_assert_eq!(
        bytes.get(bytes.len() - tail..),
        old.get(old.len() - tail..),
        "a known suffix that differs"
    );
    let suffix = (tail
        + same_suffix(
            bytes.get(..bytes.len() - tail).unwrap_or_default(),
            old.get(..old.len() - tail).unwrap_or_default(),
        ))
    .min(room);
    // A chunk that ends within the shared prefix, the file's last excepted (its end may be
    // the file's), is cut the same in both.
    let kept = hashed
        .chunks
        .partition_point(|chunk| chunk.end <= prefix && chunk.end < old.len());
    let mut chunks: Vec<Chunk> = hashed.chunks.get(..kept).unwrap_or_default().to_vec();
    let at = chunks.last().map_or(0, |chunk| chunk.end);
    // From where the shared suffix starts on, a chunk start that was one in the old file
    // (shifted) starts the very chunks that followed it there.
    let changed_end = bytes.len() - suffix;
    let grown = bytes.len() as i128 - old.len() as i128;
    // Between the shared prefix and suffix: chunks the old file has too, moved.
    let mut moved: Option<OldChunks<'_>> = None;
    chunk_from(bytes, at, &mut chunks, |at, chunks| {
        if at < changed_end {
            let old_chunks = moved.get_or_insert_with(|| OldChunks::new(old, &hashed.chunks));
            return match old_chunks.find(bytes, at) {
                Some(chunk) => {
                    chunks.push(chunk);
                    Found::Some
                }
                None => Found::Nothing,
            };
        }
        let Ok(old_at) = usize::try_from(at as i128 - grown) else {
            return Found::Nothing;
        };
        let next = if old_at == 0 {
            0
        } else {
            match hashed
                .chunks
                .binary_search_by_key(&old_at, |chunk| chunk.end)
            {
                Ok(index) => index + 1,
                Err(_) => return Found::Nothing,
            }
        };
        let shift = |end: usize| usize::try_from(end as i128 + grown).unwrap_or(end);
        chunks.extend(hashed.chunks.iter().skip(next).map(|chunk| Chunk {
            end: shift(chunk.end),
            digest: chunk.digest,
        }));
        Found::Rest
    });
    FileHash {
        digest: digest_of(&chunks),
        chunks,
    }
}

/// What a file (path, bytes, the bytes before) is known to share with the same file before.
pub type Known<'a> = dyn Fn(&str, &[u8], &[u8]) -> Same + 'a;

/// How many leading and trailing bytes a file and the same file before share, as far as the
/// one who made it knows (at most the true counts; none known by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Same {
    /// Leading bytes known the same.
    pub prefix: usize,
    /// Trailing bytes known the same.
    pub suffix: usize,
}

/// How many leading bytes `a` and `b` share (compared in 4 KiB blocks, then bytes).
fn same_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    let blocks = a
        .chunks(BLOCK)
        .zip(b.chunks(BLOCK))
        .take_while(|(x, y)| x == y)
        .count()
        * BLOCK;
    let rest = a
        .get(blocks..)
        .unwrap_or_default()
        .iter()
        .zip(b.get(blocks..).unwrap_or_default())
        .take_while(|(x, y)| x == y)
        .count();
    (blocks + rest).min(a.len()).min(b.len())
}

/// How many trailing bytes `a` and `b` share.
fn same_suffix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    let blocks = a
        .rchunks(BLOCK)
        .zip(b.rchunks(BLOCK))
        .take_while(|(x, y)| x == y)
        .count()
        * BLOCK;
    let blocks = blocks.min(a.len()).min(b.len());
    let rest = a
        .get(..a.len() - blocks)
        .unwrap_or_default()
        .iter()
        .rev()
        .zip(b.get(..b.len() - blocks).unwrap_or_default().iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    blocks + rest
}

/// The set's files' digests, in path order: what a later set hashes from.
#[derive(Clone, Debug)]
pub(crate) struct Files {
    pub(crate) digest: [u8; 32],
    pub(crate) files: Arc<Vec<Arc<FileHash>>>,
}

/// The checksum of `files` (in path order) from each file's digest.
pub(crate) fn hash<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Files {
    let mut hashes = Vec::new();
    let mut set = Sha256::new();
    for (path, content) in files {
        let file = Arc::new(file_hash(content));
        record(&mut set, path, content, &file);
        hashes.push(file);
    }
    Files {
        digest: set.finalize().into(),
        files: Arc::new(hashes),
    }
}

/// The checksum of `files` (in path order), as [`hash`] gives it, from `previous` (in path
/// order) and its digests `hashed`: a file under the same path is hashed from the one before
/// ([`file_hash_following`]; not read at all when it shares its bytes' address).
pub(crate) fn hash_following<'a, 'b>(
    files: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    previous: impl IntoIterator<Item = (&'b str, &'b [u8])>,
    hashed: &Files,
    known: &Known<'_>,
) -> Files {
    let mut before = previous.into_iter().zip(hashed.files.iter()).peekable();
    let mut hashes = Vec::new();
    let mut set = Sha256::new();
    for (path, content) in files {
        while before
            .peek()
            .is_some_and(|((old_path, _), _)| *old_path < path)
        {
            before.next();
        }
        let file = match before.peek() {
            Some(((old_path, old), old_hash)) if *old_path == path => {
                if std::ptr::eq(*old, content) {
                    Arc::clone(old_hash)
                } else {
                    Arc::new(file_hash_known(
                        content,
                        old,
                        old_hash,
                        known(path, content, old),
                    ))
                }
            }
            _ => Arc::new(file_hash(content)),
        };
        record(&mut set, path, content, &file);
        hashes.push(file);
    }
    Files {
        digest: set.finalize().into(),
        files: Arc::new(hashes),
    }
}

fn record(set: &mut Sha256, path: &str, content: &[u8], file: &FileHash) {
    set.update((path.len() as u64).to_be_bytes());
    set.update(path.as_bytes());
    set.update((content.len() as u64).to_be_bytes());
    set.update(file.digest);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// About `size` bytes of config-like lines.
    fn lines(size: usize, seed: u64) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(size + 64);
        let mut n = seed;
        while bytes.len() < size {
            n = n
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bytes.extend_from_slice(
                format!(
                    "    server s{} 10.0.{}.{}:80\n",
                    n % 7,
                    (n >> 8) % 256,
                    n >> 56
                )
                .as_bytes(),
            );
        }
        bytes
    }

    /// Chunks of `bytes` computed the slow way: every rule of [`chunk_end`] checked byte by
    /// byte.
    fn chunks_by_rule(bytes: &[u8]) -> Vec<usize> {
        let mut ends = Vec::new();
        let mut from = 0;
        while from < bytes.len() {
            let mut end = (from + MAX_CHUNK).min(bytes.len());
            let mut line_start = from;
            for i in from..end {
                if bytes[i] == b'\n' {
                    let line_end = i + 1;
                    if line_end - from >= MIN_CHUNK
                        && line_hash(&bytes[line_start..line_end]) & CUT_MASK == 0
                    {
                        end = line_end;
                        break;
                    }
                    line_start = line_end;
                }
            }
            if from + MIN_CHUNK >= bytes.len() {
                end = bytes.len();
            }
            ends.push(end);
            from = end;
        }
        ends
    }

    #[test]
    fn chunks_end_where_the_rules_say() {
        for (size, seed) in [
            (0, 1),
            (100, 2),
            (MIN_CHUNK, 3),
            (300_000, 4),
            (1_000_000, 5),
        ] {
            let bytes = lines(size, seed);
            let ends: Vec<usize> = file_hash(&bytes).chunks.iter().map(|c| c.end).collect();
            assert_eq!(ends, chunks_by_rule(&bytes), "size {size}");
        }
        // No line end at all: cut every MAX_CHUNK.
        let flat = vec![b'x'; 3 * MAX_CHUNK + 5];
        let ends: Vec<usize> = file_hash(&flat).chunks.iter().map(|c| c.end).collect();
        assert_eq!(
            ends,
            vec![MAX_CHUNK, 2 * MAX_CHUNK, 3 * MAX_CHUNK, 3 * MAX_CHUNK + 5]
        );
        assert_eq!(ends, chunks_by_rule(&flat));
    }

    #[test]
    fn a_file_digest_is_the_documented_one() {
        // One chunk: the SHA-256 of the bytes; none: of nothing.
        assert_eq!(file_hash(b"abc\n").digest, sha(b"abc\n"));
        assert_eq!(file_hash(b"").digest, sha(b""));
        // More: of the prefix and the chunks' digests.
        let bytes = lines(200_000, 9);
        let ends = chunks_by_rule(&bytes);
        assert!(ends.len() > 3);
        let mut stream = CHUNKS_PREFIX.to_vec();
        let mut from = 0;
        for end in ends {
            stream.extend(sha(&bytes[from..end]));
            from = end;
        }
        assert_eq!(file_hash(&bytes).digest, sha(&stream));
    }

    thread_local! {
        /// Bytes [`chunk_from`] hashed on this thread.
        pub(super) static HASHED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// A large file edited in two places far apart (a line grown near its start, another
    /// near its end): the chunks between, moved by the first edit, are found and compared,
    /// not hashed again.
    #[test]
    fn a_file_edited_in_two_places_hashes_the_chunks_of_the_edits() {
        let bytes = lines(4_000_000, 5);
        let before = file_hash(&bytes);
        let mut after = bytes.clone();
        for at in [after.len() * 3 / 4, after.len() / 4] {
            let at = at + after[at..].iter().position(|b| *b == b'\n').unwrap();
            after.splice(at..at, b" weight 2 backup".iter().copied());
        }
        let whole = file_hash(&after);
        HASHED.with(|hashed| hashed.set(0));
        let resumed = file_hash_following(&after, &bytes, &before);
        assert_eq!(resumed, whole);
        let hashed = HASHED.with(std::cell::Cell::get);
        assert!(
            hashed <= 4 * MAX_CHUNK,
            "{hashed} bytes hashed again of {}",
            after.len()
        );
    }

    #[test]
    fn a_line_grown_in_a_large_file_hashes_a_chunk_or_two() {
        let bytes = lines(4_000_000, 11);
        let before = file_hash(&bytes);
        let mut after = bytes.clone();
        let at = after.len() / 2;
        let at = at + after[at..].iter().position(|b| *b == b'\n').unwrap();
        after.splice(at..at, b" weight 2".iter().copied());
        let whole = file_hash(&after);
        let resumed = file_hash_following(&after, &bytes, &before);
        assert_eq!(resumed, whole);
        let fresh = whole
            .chunks
            .iter()
            .filter(|c| !before.chunks.iter().any(|b| b.digest == c.digest))
            .count();
        assert!(fresh <= 2, "{fresh} chunks differ");
        assert!(whole.chunks.len() > 60);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// A file hashed from the one before has the digest and chunks of the file hashed
        /// whole, after any chain of edits: bytes inserted, removed or changed anywhere,
        /// lines or runs without line ends, at the start, the middle or the end.
        #[test]
        fn a_file_hashed_from_the_one_before_is_hashed_as_whole(
            size in 0usize..400_000,
            seed in 0u64..1000,
            edits in proptest::collection::vec(
                (0usize..500_000, 0usize..3, 0usize..5, 0usize..2_000), 1..6),
            second in proptest::collection::vec(proptest::option::of(0usize..500_000), 6),
        ) {
            let mut current = lines(size, seed);
            let mut hashed = file_hash(&current);
            for (step, (at, kind, what, len)) in edits.into_iter().enumerate() {
                let mut next = current.clone();
                // Sometimes a second place edited at once (a line grown there).
                if let Some(other) = second.get(step).copied().flatten() {
                    let other = other.min(next.len());
                    next.splice(other..other, b" weight 3".iter().copied());
                }
                let at = at.min(next.len());
                let text: Vec<u8> = match what {
                    0 => b"\n".to_vec(),
                    1 => vec![b'z'; len],
                    2 => lines(len, seed + at as u64),
                    3 => vec![b'\n'; len % 40],
                    _ => b" weight 1".to_vec(),
                };
                match kind {
                    0 => { next.splice(at..at, text); }
                    1 => { let end = (at + len).min(next.len()); next.drain(at..end); }
                    _ => {
                        let end = (at + text.len()).min(next.len());
                        next.splice(at..end, text);
                    }
                }
                let whole = file_hash(&next);
                let resumed = file_hash_following(&next, &current, &hashed);
                proptest::prop_assert_eq!(&resumed, &whole);
                // Told part or all of what the two share (at most the truth), the same.
                let prefix = same_prefix(&next, &current);
                let shorter = next.len().min(current.len());
                let suffix = same_suffix(&next, &current).min(shorter - prefix);
                for known in [
                    Same { prefix, suffix },
                    Same { prefix: prefix / 2, suffix: suffix / 3 },
                    Same { prefix: 0, suffix },
                ] {
                    let told = file_hash_known(&next, &current, &hashed, known);
                    proptest::prop_assert_eq!(&told, &whole, "{:?}", known);
                }
                current = next;
                hashed = resumed;
            }
        }
    }
}
