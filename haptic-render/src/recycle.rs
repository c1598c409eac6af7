//! The buffers of the large files a render writes whole, handed back to the renderer when the
//! last set holding a file lets it go, and written again by the next render of that output.
//!
//! At 10,000 Ingresses an EndpointSlice event rewrites `haproxy.cfg` (7 MB) and a routes
//! change a map of about a megabyte. A fresh buffer for each is memory the kernel hands the
//! process afresh, page by page: with the Deployment's `MIMALLOC_PURGE_DELAY=0` the allocator
//! gives a freed block of that size back at once, and the next render faults in its 4 KiB
//! pages again (2,000 faults, some 5 ms of an 8 ms render on the benchmark's VM). Here each
//! single output keeps at most one spare buffer: the one its file had in a set that is gone.
//! A file's bytes are a [`Bytes`] whose owner gives the buffer back on drop; the render takes
//! it, clears it and writes the file in it, its pages already there. What this keeps is what
//! the render would have allocated anyway: at most one more copy of each large output, and
//! only while the renderer lives (a buffer let go after it is freed as usual).

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// Files smaller than this are not recycled: the allocator keeps pages of small blocks.
pub(crate) const MIN_RECYCLED: usize = 64 << 10;

/// One spare buffer per single output (by index), each taken by that output's next render.
#[derive(Debug, Default)]
pub(crate) struct Recycler {
    spares: Mutex<Vec<Option<Vec<u8>>>>,
}

impl Recycler {
    /// A cleared buffer for output `index`, whose last file was `size` bytes: its spare when
    /// that holds `size` bytes (a file that grew a little more grows it), else a new one of
    /// `size` and an eighth.
    pub(crate) fn take(&self, index: usize, size: usize) -> Vec<u8> {
        let spare = self
            .spares
            .lock()
            .ok()
            .and_then(|mut spares| spares.get_mut(index).and_then(Option::take));
        match spare {
            Some(mut buffer) if buffer.capacity() >= size => {
                buffer.clear();
                buffer
            }
            _ => Vec::with_capacity(size + size / 8),
        }
    }

    /// `bytes` as a file's bytes: a large buffer comes back as output `index`'s spare when the
    /// last holder drops it.
    pub(crate) fn wrap(self: &Arc<Self>, index: usize, bytes: Vec<u8>) -> Bytes {
        if bytes.capacity() < MIN_RECYCLED {
            return Bytes::from(bytes);
        }
        Bytes::from_owner(Recycled {
            bytes,
            home: Arc::downgrade(self),
            index,
        })
    }

    /// Keeps `buffer` as output `index`'s spare, unless it has one already.
    fn give_back(&self, index: usize, buffer: Vec<u8>) {
        let Ok(mut spares) = self.spares.lock() else {
            return;
        };
        if spares.len() <= index {
            spares.resize_with(index + 1, || None);
        }
        if spares[index].is_none() {
            spares[index] = Some(buffer);
        }
    }

    /// The bytes the spare buffers hold (their capacity).
    #[cfg(test)]
    fn spare_bytes(&self) -> usize {
        self.spares
            .lock()
            .map(|spares| spares.iter().flatten().map(Vec::capacity).sum())
            .unwrap_or(0)
    }
}

/// A file's buffer, given back to its renderer's [`Recycler`] when dropped.
struct Recycled {
    bytes: Vec<u8>,
    home: Weak<Recycler>,
    index: usize,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(home) = self.home.upgrade() {
            home.give_back(self.index, std::mem::take(&mut self.bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_buffer_comes_back_when_its_last_holder_drops_it() {
        let recycler = Arc::new(Recycler::default());
        let mut buffer = recycler.take(3, MIN_RECYCLED);
        buffer.extend_from_slice(b"global\n");
        let address = buffer.as_ptr();
        let bytes = recycler.wrap(3, buffer);
        assert_eq!(&bytes[..], b"global\n");
        let held = bytes.clone();
        drop(bytes);
        assert_eq!(recycler.spare_bytes(), 0, "a holder is left");
        drop(held);
        assert!(recycler.spare_bytes() >= MIN_RECYCLED);
        // Another output's render does not get it; this one's does, cleared.
        let other = recycler.take(2, MIN_RECYCLED);
        assert_ne!(other.as_ptr(), address);
        let again = recycler.take(3, MIN_RECYCLED);
        assert_eq!(again.as_ptr(), address);
        assert!(again.is_empty());
        assert_eq!(recycler.spare_bytes(), 0);
    }

    #[test]
    fn a_spare_too_small_is_not_used_and_small_files_are_not_kept() {
        let recycler = Arc::new(Recycler::default());
        drop(recycler.wrap(0, Vec::with_capacity(MIN_RECYCLED)));
        assert!(
            recycler.take(0, 2 * MIN_RECYCLED).capacity() >= 2 * MIN_RECYCLED + MIN_RECYCLED / 4
        );
        assert_eq!(recycler.spare_bytes(), 0, "the small spare was dropped");
        drop(recycler.wrap(1, b"small".to_vec()));
        assert_eq!(recycler.spare_bytes(), 0);
    }

    #[test]
    fn one_spare_an_output_and_none_once_the_renderer_is_gone() {
        let recycler = Arc::new(Recycler::default());
        let first = recycler.wrap(0, Vec::with_capacity(MIN_RECYCLED));
        let second = recycler.wrap(0, Vec::with_capacity(MIN_RECYCLED));
        drop(first);
        drop(second);
        assert_eq!(recycler.spare_bytes(), MIN_RECYCLED);
        let late = recycler.wrap(1, Vec::with_capacity(MIN_RECYCLED));
        drop(recycler);
        // Nothing to give it back to: freed as any buffer.
        drop(late);
    }
}
