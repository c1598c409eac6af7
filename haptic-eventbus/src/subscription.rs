//! Subscriptions: how one is asked for, its per-subscriber queue, and the receiving handle.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    /// At most `capacity` events wait (queued, or taken by the receiver in its current batch
    /// and not yet returned by `recv`); when that many wait, a new event is dropped for this
    /// subscriber only, counted in [`SubscriptionStats::dropped`] and logged (warn) at the 1st,
    /// 2nd, 4th, 8th, ... drop. A capacity of 0 is treated as 1.
    Lossy {
        /// The most events that wait in the queue.
        capacity: usize,
    },
}

/// The parameters of a subscription, as
/// [`EventBus::subscribe_with`](crate::EventBus::subscribe_with) takes them.
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
    /// Events taken from the bus in one batch and not yet handed out: the receiver takes the
    /// bus's lock once per batch rather than once per event.
    taken: VecDeque<Arc<E>>,
    inner: Arc<Inner<E>>,
}

impl<E: Event> Subscription<E> {
    pub(crate) fn new(shared: Arc<Shared<E>>, inner: Arc<Inner<E>>) -> Self {
        Subscription {
            shared,
            taken: VecDeque::new(),
            inner,
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
        let closed = self.inner.take_batch(&self.shared, &mut self.taken);
        match self.taken.pop_front() {
            Some(event) => {
                self.shared.set_taken(self.taken.len());
                Taken::Event(event)
            }
            None if closed => Taken::Closed,
            None => Taken::Empty,
        }
    }

    /// True once every handle of the bus is dropped: nothing more will arrive after the
    /// queued events.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
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
        self.inner.subscription_stats(&self.shared)
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
        self.inner.unsubscribe(&self.shared);
    }
}

/// What a subscription and the bus share outside the bus's lock: identity, filter, wake-up.
pub(crate) struct Shared<E: Event> {
    pub(crate) id: u64,
    /// Where its queue lives in the bus.
    pub(crate) slot: usize,
    pub(crate) name: Arc<str>,
    pub(crate) filter: Filter<E::Kind>,
    pub(crate) delivery: Delivery,
    pub(crate) leader_only: bool,
    /// How many events the receiver has taken in its current batch and not handed out yet.
    /// They still count as queued (for limits and statistics). Only the receiver writes it;
    /// a stale read can only be too high, never too low.
    taken: AtomicUsize,
    pub(crate) notify: Notify,
}

impl<E: Event> Shared<E> {
    pub(crate) fn new(id: u64, slot: usize, params: SubscribeParams<E::Kind>) -> Self {
        let delivery = match params.delivery {
            Delivery::Lossy { capacity } => Delivery::Lossy {
                capacity: capacity.max(1),
            },
            Delivery::Reliable => Delivery::Reliable,
        };
        Shared {
            id,
            slot,
            name: Arc::from(params.name),
            filter: params.filter,
            delivery,
            leader_only: params.leader_only,
            taken: AtomicUsize::new(0),
            notify: Notify::new(),
        }
    }

    fn set_taken(&self, len: usize) {
        self.taken.store(len, Ordering::Relaxed);
    }
}

/// A subscription's queue, kept under the bus's lock: the publisher already holds that lock,
/// so a delivery costs no lock of its own.
pub(crate) struct Queue<E: Event> {
    pub(crate) shared: Arc<Shared<E>>,
    items: VecDeque<Arc<E>>,
    high_water: usize,
    /// The queue length at which the next high-water warning is logged (reliable only).
    next_warn: usize,
    dropped: u64,
}

/// What became of one push into a subscriber's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    Queued,
    Dropped,
}

impl<E: Event> Queue<E> {
    pub(crate) fn new(shared: Arc<Shared<E>>, high_water_warn: usize) -> Self {
        Queue {
            shared,
            items: VecDeque::new(),
            high_water: 0,
            next_warn: high_water_warn.max(1),
            dropped: 0,
        }
    }

    /// Events waiting for the receiver: in the queue and in its current batch.
    fn queued(&self) -> usize {
        self.items.len() + self.shared.taken.load(Ordering::Relaxed)
    }

    /// Queues `event` without ever waiting; notes anything worth logging once the lock is
    /// released.
    pub(crate) fn push(&mut self, event: &Arc<E>, notes: &mut Vec<Note>) -> Pushed {
        if let Delivery::Lossy { capacity } = self.shared.delivery
            && self.queued() >= capacity
        {
            self.dropped += 1;
            if self.dropped.is_power_of_two() {
                notes.push(Note::Dropped {
                    subscriber: Arc::clone(&self.shared.name),
                    total: self.dropped,
                });
            }
            return Pushed::Dropped;
        }
        let was_empty = self.items.is_empty();
        self.items.push_back(Arc::clone(event));
        let queued = self.queued();
        if queued > self.high_water {
            self.high_water = queued;
            if self.shared.delivery == Delivery::Reliable && queued >= self.next_warn {
                self.next_warn = self.next_warn.saturating_mul(2);
                notes.push(Note::HighWater {
                    subscriber: Arc::clone(&self.shared.name),
                    queued,
                });
            }
        }
        // The receiver only waits when the queue (and its batch) is empty, so only the push
        // that ends the queue's emptiness needs to wake it; this keeps the common case free of
        // wake-ups.
        if was_empty {
            self.shared.notify.notify_one();
        }
        Pushed::Queued
    }

    /// Hands the queued events to the receiver: `batch` (empty) and the queue swap storage, so
    /// no allocation happens per batch. Called under the bus's lock, so a push sees the queue
    /// and batch lengths consistently.
    pub(crate) fn take_into(&mut self, batch: &mut VecDeque<Arc<E>>) {
        std::mem::swap(&mut self.items, batch);
        self.shared.set_taken(batch.len());
    }

    pub(crate) fn stats(&self) -> SubscriptionStats {
        SubscriptionStats {
            id: self.shared.id,
            name: self.shared.name.to_string(),
            delivery: self.shared.delivery,
            leader_only: self.shared.leader_only,
            queued: self.queued(),
            high_water: self.high_water,
            dropped: self.dropped,
        }
    }
}
