//! What a render no longer needs, dropped after the render returns, on a thread of the
//! renderer's own.
//!
//! After one event at 10,000 Ingresses the render replaces a few kept things that each hold
//! a list of 10,000 rows (a `render_each` call over the pool's backends, the single output it
//! went into); dropping one touches 10,000 reference counts, most of them not in any cache: a
//! seventh of such a render. They are buried instead, and handed to the renderer's dropper
//! thread when the render is done: the render's caller (the controller sending the set to its
//! agents) goes on meanwhile. The thread starts when first needed and is joined when the
//! renderer goes; at most [`QUEUE`] batches wait for it, and a batch that finds the queue
//! full (or no thread) is dropped where it is, so nothing piles up.

use std::sync::Mutex;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;

/// Batches (one a render) that may wait for the dropper thread.
const QUEUE: usize = 4;

/// One thing to drop later.
type Buried = Box<dyn Send>;

/// Things to drop later, and the thread that drops them.
#[derive(Default)]
pub(crate) struct Graveyard {
    buried: Mutex<Vec<Buried>>,
    dropper: Mutex<Option<Dropper>>,
}

#[derive(Debug)]
struct Dropper {
    queue: SyncSender<Vec<Buried>>,
    thread: JoinHandle<()>,
}

impl std::fmt::Debug for Graveyard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graveyard")
            .field("buried", &self.buried.lock().map(|b| b.len()).unwrap_or(0))
            .field("dropper", &self.dropper)
            .finish()
    }
}

impl Graveyard {
    /// Keeps `value` to drop after the render.
    pub(crate) fn bury<T: Send + 'static>(&self, value: T) {
        if let Ok(mut buried) = self.buried.lock() {
            buried.push(Box::new(value));
        }
    }

    /// Hands what was buried to the dropper thread (started now if it is not running); drops
    /// it here when the thread cannot take it.
    pub(crate) fn flush(&self) {
        let batch = match self.buried.lock() {
            Ok(mut buried) if !buried.is_empty() => std::mem::take(&mut *buried),
            _ => return,
        };
        let Ok(mut dropper) = self.dropper.lock() else {
            return;
        };
        if dropper.is_none() {
            let (queue, batches) = mpsc::sync_channel::<Vec<Buried>>(QUEUE);
            let thread = std::thread::Builder::new()
                .name("haptic-render-drop".into())
                .spawn(move || batches.into_iter().for_each(drop));
            if let Ok(thread) = thread {
                *dropper = Some(Dropper { queue, thread });
            }
        }
        let Some(running) = dropper.as_ref() else {
            drop(batch);
            return;
        };
        match running.queue.try_send(batch) {
            Ok(()) => {}
            // Behind by a few renders: this one's go here.
            Err(TrySendError::Full(batch)) => drop(batch),
            // The thread is gone (a drop panicked): said, and started again next time.
            Err(TrySendError::Disconnected(batch)) => {
                drop(batch);
                if let Some(Dropper { thread, .. }) = dropper.take()
                    && thread.join().is_err()
                {
                    tracing::error!("the renderer's dropper thread panicked while dropping values");
                }
            }
        }
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        let dropper = self.dropper.get_mut().map(Option::take).unwrap_or_default();
        if let Some(Dropper { queue, thread }) = dropper {
            // The thread ends when the queue closes, after the batches it holds.
            drop(queue);
            if thread.join().is_err() {
                tracing::error!("the renderer's dropper thread panicked while dropping values");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Everything buried is dropped once: by the thread after a flush, or when the graveyard
    /// goes (which waits for the thread), never before the flush.
    #[test]
    fn everything_buried_is_dropped_once_and_none_before_the_flush() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let graveyard = Graveyard::default();
        for round in 0..20 {
            for _ in 0..3 {
                graveyard.bury(Counted(Arc::clone(&dropped)));
            }
            assert!(dropped.load(Ordering::SeqCst) <= round * 3);
            graveyard.flush();
        }
        graveyard.bury(Counted(Arc::clone(&dropped)));
        drop(graveyard);
        assert_eq!(dropped.load(Ordering::SeqCst), 61);
    }

    struct Panics;

    impl Drop for Panics {
        fn drop(&mut self) {
            panic!("a drop that panics");
        }
    }

    /// A drop that panics ends the thread; what was buried after it is still dropped once
    /// (by a thread started again, or where it is), whenever the thread went.
    #[test]
    fn a_panicking_drop_loses_nothing_buried_after_it() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let graveyard = Graveyard::default();
        graveyard.bury(Panics);
        graveyard.flush();
        for _ in 0..10 {
            graveyard.bury(Counted(Arc::clone(&dropped)));
            graveyard.flush();
        }
        drop(graveyard);
        assert_eq!(dropped.load(Ordering::SeqCst), 10);
    }
}
