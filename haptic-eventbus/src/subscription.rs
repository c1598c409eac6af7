//! Subscriptions: how one is asked for, its per-subscriber queue, and the receiving handle.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tokio::sync::Notify;

use crate::bus::{Inner, Note};
use crate::event::{Event, Filter};

/// How a subscription's queue behaves when its subscriber falls behind.
///
/// `publish` never waits for a subscriber either way; the choice is between memory and loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Every event is kept until received, however far the subscriber falls behind. The queue's
    /// high-water mark is reported in [`SubscriptionStats`] and logged (warn) each time it
    /// doubles past [`Config::high_water_warn`](crate::Config).
    Reliable,
    /// At most `capacity` events wait; when the queue is full the newest event is dropped for
    /// this subscriber only, counted in [`SubscriptionStats::dropped`] and logged (warn) at the
    /// 1st, 2nd, 4th, 8th, ... drop. A capacity of 0 is treated as 1.
    Lossy {
        /// The most events that wait in the queue.
        capacity: usize,
    },
}

/// The parameters of a subscription; [`EventBus::subscribe_with`](crate::EventBus) takes them.
///
/// [`EventBus::subscribe`](crate::EventBus::subscribe) and
/// [`EventBus::subscribe_leader_only`](crate::EventBus::subscribe_leader_only) are shorthands
/// for the reliable cases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeParams<K> {
    /// The subscriber's name, used in logs and statistics.
    pub name: String,
    /// Which kinds it receives.
    pub filter: Filter<K>,
    /// Reliable (the default) or lossy.
    pub delivery: Delivery,
    /// A leader-only component, built after the bus has started (during a
    /// [`pause`](crate::EventBus::pause)): subscribing late is expected, so no late-subscriber
    /// warning is logged. Default: `false`.
    pub leader_only: bool,
}

impl<K> SubscribeParams<K> {
    /// A reliable, all-replica subscription named `name` receiving `filter`.
    pub fn new(name: impl Into<String>, filter: Filter<K>) -> Self {
        SubscribeParams {
            name: name.into(),
            filter,
            delivery: Delivery::Reliable,
            leader_only: false,
        }
    }

    /// Makes the subscription lossy with at most `capacity` queued events.
    #[must_use]
    pub fn with_lossy(mut self, capacity: usize) -> Self {
        self.delivery = Delivery::Lossy { capacity };
        self
    }

    /// Marks the subscription leader-only (no late-subscriber warning).
    #[must_use]
    pub fn with_leader_only(mut self) -> Self {
        self.leader_only = true;
        self
    }
}

/// A snapshot of one subscription's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionStats {
    /// The bus-unique id of the subscription.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// Reliable or lossy.
    pub delivery: Delivery,
    /// Whether it was made leader-only.
    pub leader_only: bool,
    /// Events waiting to be received now.
    pub queued: usize,
    /// The most events that ever waited at once.
    pub high_water: usize,
    /// Events dropped because a lossy queue was full (always 0 when reliable).
    pub dropped: u64,
}

/// The receiving end of a subscription.
///
/// Dropping it unsubscribes: the bus stops delivering to it at once and
/// [`EventBus::subscriber_count`](crate::EventBus::subscriber_count) goes down.
pub struct Subscription<E: Event> {
    shared: Arc<Shared<E>>,
    /// Events taken from the shared queue in one batch and not yet handed out: the receiver
    /// takes the lock once per batch rather than once per event.
    taken: VecDeque<Arc<E>>,
    bus: Weak<Inner<E>>,
}

impl<E: Event> Subscription<E> {
    pub(crate) fn new(shared: Arc<Shared<E>>, bus: Weak<Inner<E>>) -> Self {
        Subscription {
            shared,
            taken: VecDeque::new(),
            bus,
        }
    }

    /// Waits for the next event. `None` once every handle of the bus is dropped and the queue
    /// is drained.
    ///
    /// Cancel safe: if the future is dropped before it completes, no event is lost.
    pub async fn recv(&mut self) -> Option<Arc<E>> {
        loop {
            match self.take() {
                Taken::Event(event) => return Some(event),
                Taken::Closed => return None,
                // A push that lands between the check above and this await stores a permit in
                // the Notify, so the wake-up cannot be missed.
                Taken::Empty => self.shared.notify.notified().await,
            }
        }
    }

    /// The next event if one is waiting, without waiting.
    pub fn try_recv(&mut self) -> Option<Arc<E>> {
        match self.take() {
            Taken::Event(event) => Some(event),
            Taken::Empty | Taken::Closed => None,
        }
    }

    fn take(&mut self) -> Taken<E> {
        if let Some(event) = self.taken.pop_front() {
            self.shared.set_taken(self.taken.len());
            return Taken::Event(event);
        }
        let mut queue = self.shared.lock();
        // The emptied batch buffer goes back as the queue's storage: no allocation per batch.
        std::mem::swap(&mut queue.items, &mut self.taken);
        match self.taken.pop_front() {
            Some(event) => {
                // Under the lock, so that a push sees queue and batch lengths consistently.
                self.shared.set_taken(self.taken.len());
                Taken::Event(event)
            }
            None if queue.closed => Taken::Closed,
            None => Taken::Empty,
        }
    }

    /// True once the bus is gone: nothing more will arrive after the queued events.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// This subscription's bus-unique id.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// This subscription's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// A snapshot of its queue: queued events, high-water mark, drops.
    pub fn stats(&self) -> SubscriptionStats {
        self.shared.stats()
    }
}

enum Taken<E> {
    Event(Arc<E>),
    Empty,
    Closed,
}

impl<E: Event> fmt::Debug for Subscription<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.shared.id)
            .field("name", &self.shared.name)
            .field("delivery", &self.shared.delivery)
            .finish_non_exhaustive()
    }
}

impl<E: Event> Drop for Subscription<E> {
    fn drop(&mut self) {
        self.shared.lock().close();
        if let Some(bus) = self.bus.upgrade() {
            bus.unsubscribe(&self.shared);
        }
    }
}

/// The state a subscription shares with the bus: its queue and the wake-up for its receiver.
pub(crate) struct Shared<E: Event> {
    pub(crate) id: u64,
    pub(crate) name: Arc<str>,
    pub(crate) filter: Filter<E::Kind>,
    pub(crate) delivery: Delivery,
    pub(crate) leader_only: bool,
    queue: Mutex<Queue<E>>,
    /// How many events the receiver has taken in its current batch and not handed out yet.
    /// They still count as queued (for limits and statistics). Only the receiver writes it; a
    /// stale read can only be too high, never too low.
    taken: AtomicUsize,
    notify: Notify,
}

struct Queue<E> {
    items: VecDeque<Arc<E>>,
    high_water: usize,
    /// The queue length at which the next high-water warning is logged (reliable only).
    next_warn: usize,
    dropped: u64,
    closed: bool,
}

impl<E> Queue<E> {
    fn close(&mut self) {
        self.closed = true;
    }
}

/// What became of one push into a subscriber's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    Queued,
    Dropped,
    Closed,
}

impl<E: Event> Shared<E> {
    pub(crate) fn new(id: u64, params: SubscribeParams<E::Kind>, high_water_warn: usize) -> Self {
        let delivery = match params.delivery {
            Delivery::Lossy { capacity } => Delivery::Lossy {
                capacity: capacity.max(1),
            },
            Delivery::Reliable => Delivery::Reliable,
        };
        Shared {
            id,
            name: Arc::from(params.name),
            filter: params.filter,
            delivery,
            leader_only: params.leader_only,
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                high_water: 0,
                next_warn: high_water_warn.max(1),
                dropped: 0,
                closed: false,
            }),
            taken: AtomicUsize::new(0),
            notify: Notify::new(),
        }
    }

    fn set_taken(&self, len: usize) {
        self.taken.store(len, Ordering::Relaxed);
    }

    /// Events waiting for the receiver: in the queue and in its current batch.
    fn queued(&self, queue: &Queue<E>) -> usize {
        queue.items.len() + self.taken.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Queue<E>> {
        // Nothing panics while holding this lock; if something did, the queue is still sound.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `event` without ever waiting; notes anything worth logging once locks are released.
    pub(crate) fn push(&self, event: &Arc<E>, notes: &mut Vec<Note>) -> Pushed {
        let mut queue = self.lock();
        if queue.closed {
            return Pushed::Closed;
        }
        if let Delivery::Lossy { capacity } = self.delivery
            && self.queued(&queue) >= capacity
        {
            queue.dropped += 1;
            if queue.dropped.is_power_of_two() {
                notes.push(Note::Dropped {
                    subscriber: self.name.clone(),
                    total: queue.dropped,
                });
            }
            return Pushed::Dropped;
        }
        let was_empty = queue.items.is_empty();
        queue.items.push_back(Arc::clone(event));
        let len = self.queued(&queue);
        if len > queue.high_water {
            queue.high_water = len;
            if self.delivery == Delivery::Reliable && len >= queue.next_warn {
                queue.next_warn = queue.next_warn.saturating_mul(2);
                notes.push(Note::HighWater {
                    subscriber: self.name.clone(),
                    queued: len,
                });
            }
        }
        drop(queue);
        // The receiver only waits when the queue (and its batch) is empty, so only the push that
        // ends the queue's emptiness needs to wake it; this keeps the common case free of
        // wake-ups.
        if was_empty {
            self.notify.notify_one();
        }
        Pushed::Queued
    }

    /// Marks the queue closed (the bus is gone) and wakes the receiver so it sees it.
    pub(crate) fn close(&self) {
        self.lock().close();
        self.notify.notify_one();
    }

    pub(crate) fn stats(&self) -> SubscriptionStats {
        let queue = self.lock();
        SubscriptionStats {
            id: self.id,
            name: self.name.to_string(),
            delivery: self.delivery,
            leader_only: self.leader_only,
            queued: self.queued(&queue),
            high_water: queue.high_water,
            dropped: queue.dropped,
        }
    }
}
