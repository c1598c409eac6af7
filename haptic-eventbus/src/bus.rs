//! The bus: configuration, publication, buffering around start and pause, sticky kinds, requests.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::mpsc;
use tracing::{Instrument, debug, warn};

use crate::event::{Event, Filter};
use crate::request::{self, Gathered, RequestId, RequestParams, Response};
use crate::subscription::{
    Pushed, Queue, Shared, SubscribeParams, Subscription, SubscriptionStats,
};

/// The bus's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config<K> {
    /// The most events held while the bus is not running (before the first
    /// [`start`](EventBus::start) and during a [`pause`](EventBus::pause)). Further events are
    /// dropped, counted in [`BusStats::buffer_overflows`] and logged (error) at the 1st, 2nd,
    /// 4th, ... overflow. Default: 10 000.
    pub buffer_capacity: usize,
    /// Kinds whose latest delivered event the bus keeps and gives to each new subscriber of
    /// that kind at once. Default: none.
    pub sticky_kinds: Vec<K>,
    /// The queue length of a reliable subscription at which a warning is logged, and again at
    /// each doubling. Default: 10 000.
    pub high_water_warn: usize,
}

impl<K> Default for Config<K> {
    fn default() -> Self {
        Config {
            buffer_capacity: 10_000,
            sticky_kinds: Vec::new(),
            high_water_warn: 10_000,
        }
    }
}

impl<K> Config<K> {
    /// Sets [`buffer_capacity`](Config::buffer_capacity).
    #[must_use]
    pub fn with_buffer_capacity(mut self, capacity: usize) -> Self {
        self.buffer_capacity = capacity;
        self
    }

    /// Sets [`sticky_kinds`](Config::sticky_kinds).
    #[must_use]
    pub fn with_sticky_kinds(mut self, kinds: impl IntoIterator<Item = K>) -> Self {
        self.sticky_kinds = kinds.into_iter().collect();
        self
    }

    /// Sets [`high_water_warn`](Config::high_water_warn).
    #[must_use]
    pub fn with_high_water_warn(mut self, queued: usize) -> Self {
        self.high_water_warn = queued;
        self
    }
}

/// What [`EventBus::publish`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The bus is running; the event was queued for this many subscribers (lossy subscribers
    /// whose queue was full are not counted).
    Delivered {
        /// How many subscribers it was queued for.
        subscribers: usize,
    },
    /// The bus is not running; the event waits in the buffer for the next start.
    Buffered,
    /// The bus is not running and its buffer is full: the event was dropped.
    Overflowed,
}

/// A snapshot of the bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusStats {
    /// Whether events are delivered now (started and not paused).
    pub running: bool,
    /// Whether [`EventBus::start`] was ever called.
    pub started: bool,
    /// Events waiting in the buffer.
    pub buffered: usize,
    /// Events dropped because the buffer was full, since the bus was made.
    pub buffer_overflows: u64,
    /// Every live subscription, in the order they subscribed.
    pub subscribers: Vec<SubscriptionStats>,
}

/// A typed, in-process event bus over the application's event type `E`.
///
/// Cloning is cheap and every clone is the same bus. When the last clone is dropped, every
/// subscription receives its queued events and then `None`.
///
/// Lifecycle: events published before the first [`start`](EventBus::start) wait in a bounded
/// buffer and are delivered, in order, when it is called; [`pause`](EventBus::pause) buffers
/// again until the next `start`. This gives the leadership contract:
///
/// 1. `pause()`;
/// 2. `publish(BecameLeader)` (buffered);
/// 3. build the leader-only components, which
///    [`subscribe_leader_only`](EventBus::subscribe_leader_only);
/// 4. `start()`: every subscriber, the new ones included, receives `BecameLeader` exactly once.
///
/// Delivery order is one total order: every subscriber sees the events it receives in the order
/// they were published (for publishers on different threads, in the order their `publish`
/// calls took the bus's lock).
pub struct EventBus<E: Event> {
    handle: Arc<Handle<E>>,
}

/// Shared by the clones of one [`EventBus`]; when the last is dropped the bus closes.
struct Handle<E: Event> {
    inner: Arc<Inner<E>>,
}

impl<E: Event> Drop for Handle<E> {
    fn drop(&mut self) {
        self.inner.close();
    }
}

impl<E: Event> Clone for EventBus<E> {
    fn clone(&self) -> Self {
        EventBus {
            handle: Arc::clone(&self.handle),
        }
    }
}

impl<E: Event> fmt::Debug for EventBus<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.handle.inner.lock();
        f.debug_struct("EventBus")
            .field("running", &state.running)
            .field("buffered", &state.buffer.len())
            .field("subscribers", &state.live)
            .finish_non_exhaustive()
    }
}

impl<E: Event> Default for EventBus<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Event> EventBus<E> {
    /// A bus with the default [`Config`], not started.
    pub fn new() -> Self {
        Self::with_config(Config::default())
    }

    /// A bus with `config`, not started.
    pub fn with_config(config: Config<E::Kind>) -> Self {
        let mut kinds = KindMap::default();
        for kind in config.sticky_kinds {
            kinds.insert(
                kind,
                KindEntry {
                    subs: Vec::new(),
                    sticky: true,
                    latest: None,
                },
            );
        }
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                running: false,
                started: false,
                buffer: VecDeque::new(),
                buffer_overflows: 0,
                kinds,
                all: Vec::new(),
                queues: Vec::new(),
                free_slots: Vec::new(),
                live: 0,
                closed: false,
                next_subscription: 0,
                sticky_seq: 0,
                pending: HashMap::new(),
            }),
            buffer_capacity: config.buffer_capacity,
            high_water_warn: config.high_water_warn,
            next_request: AtomicU64::new(1),
        });
        EventBus {
            handle: Arc::new(Handle { inner }),
        }
    }

    /// Publishes `event`. Never waits for a subscriber and never awaits: it queues the event
    /// for every matching subscriber (or in the buffer when the bus is not running) and returns.
    ///
    /// The only lock it takes is the bus's own, which every operation holds just for a
    /// bounded amount of work (here: one queue push per matching subscriber) and never across
    /// an await or the application's code; so it may be called from anywhere, including a
    /// subscriber's handler and synchronous code.
    ///
    /// It takes anything that converts into `E`: a library with its own event type `L` (such as
    /// haptic-leadership's) can publish into any bus whose `E: From<L>`.
    pub fn publish(&self, event: impl Into<E>) -> Outcome {
        // The application's code runs before the lock is taken.
        let event: E = event.into();
        let kind = event.kind();
        let response = event.response_to().map(|r| r.request);
        let event = Arc::new(event);
        let mut notes = Vec::new();
        let outcome = {
            let mut state = self.handle.inner.lock();
            if state.running {
                let subscribers = state.deliver(kind, response, &event, &mut notes);
                Outcome::Delivered { subscribers }
            } else if state.buffer.len() < self.handle.inner.buffer_capacity {
                state.buffer.push_back(Buffered {
                    kind,
                    response,
                    event,
                });
                Outcome::Buffered
            } else {
                state.buffer_overflows += 1;
                if state.buffer_overflows.is_power_of_two() {
                    notes.push(Note::Overflow {
                        total: state.buffer_overflows,
                        capacity: self.handle.inner.buffer_capacity,
                    });
                }
                Outcome::Overflowed
            }
        };
        emit(notes);
        outcome
    }

    /// Starts delivering: the buffered events go out first, in the order they were published,
    /// to every subscriber present now. Idempotent: on a running bus it does nothing. Returns
    /// how many buffered events were delivered.
    pub fn start(&self) -> usize {
        let mut notes = Vec::new();
        let flushed = {
            let mut state = self.handle.inner.lock();
            if state.running {
                return 0;
            }
            state.running = true;
            state.started = true;
            let buffer = std::mem::take(&mut state.buffer);
            let flushed = buffer.len();
            for item in buffer {
                state.deliver(item.kind, item.response, &item.event, &mut notes);
            }
            flushed
        };
        emit(notes);
        debug!(flushed, "event bus started");
        flushed
    }

    /// Stops delivering until the next [`start`](EventBus::start): events published meanwhile
    /// wait in the (bounded) buffer. Idempotent. Events already queued for subscribers stay
    /// receivable.
    pub fn pause(&self) {
        let was_running = std::mem::replace(&mut self.handle.inner.lock().running, false);
        if was_running {
            debug!("event bus paused");
        }
    }

    /// Whether events are delivered now (started and not paused).
    pub fn is_running(&self) -> bool {
        self.handle.inner.lock().running
    }

    /// A reliable subscription to `filter`. After the bus has started, this logs a
    /// late-subscriber warning: the subscriber has missed earlier events.
    pub fn subscribe(&self, name: impl Into<String>, filter: Filter<E::Kind>) -> Subscription<E> {
        self.subscribe_with(SubscribeParams::new(name, filter))
    }

    /// A reliable subscription for a leader-only component. These are built after the bus has
    /// started, during a [`pause`](EventBus::pause), so no late-subscriber warning is logged.
    pub fn subscribe_leader_only(
        &self,
        name: impl Into<String>,
        filter: Filter<E::Kind>,
    ) -> Subscription<E> {
        self.subscribe_with(SubscribeParams::new(name, filter).with_leader_only())
    }

    /// A subscription as `params` describe it (reliable or lossy, leader-only or not).
    ///
    /// The latest event of every sticky kind the filter matches is queued for it at once, in
    /// the order those events were published.
    pub fn subscribe_with(&self, params: SubscribeParams<E::Kind>) -> Subscription<E> {
        let mut notes = Vec::new();
        let (shared, late) = {
            let mut state = self.handle.inner.lock();
            let id = state.next_subscription;
            state.next_subscription += 1;
            let slot = state.free_slots.pop().unwrap_or(state.queues.len());
            let shared = Arc::new(Shared::new(id, slot, params));
            let mut queue = Queue::new(Arc::clone(&shared), self.handle.inner.high_water_warn);
            state.replay_sticky(&mut queue, &mut notes);
            state.add(queue);
            let late = state.started && !shared.leader_only;
            (shared, late)
        };
        if late {
            warn!(
                subscriber = %shared.name,
                id = shared.id,
                "late subscriber: subscribed after the bus started, missed earlier events"
            );
        }
        emit(notes);
        Subscription::new(shared, Arc::clone(&self.handle.inner))
    }

    /// How many subscriptions are live.
    pub fn subscriber_count(&self) -> usize {
        self.handle.inner.lock().live
    }

    /// A snapshot of the bus and every subscription.
    pub fn stats(&self) -> BusStats {
        let state = self.handle.inner.lock();
        let mut subscribers: Vec<SubscriptionStats> =
            state.queues.iter().flatten().map(Queue::stats).collect();
        subscribers.sort_by_key(|s| s.id);
        BusStats {
            running: state.running,
            started: state.started,
            buffered: state.buffer.len(),
            buffer_overflows: state.buffer_overflows,
            subscribers,
        }
    }

    /// Scatter-gather: publishes the event `make` builds from a fresh [`RequestId`], then
    /// gathers the events that answer it (see [`Event::response_to`]) as `params` say.
    ///
    /// Answers are collected from the moment before the request is published, so none is
    /// missed however fast it comes. If the bus is not running, the request waits in the buffer
    /// like any event and the timeout still runs. Dropping the future stops the gathering.
    ///
    /// # Errors
    ///
    /// [`request::Error::NotEnoughResponses`] when the timeout passes with fewer than
    /// `min_responses` answers.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use haptic_eventbus::{Event, EventBus, Filter, RequestId, RequestParams, ResponseTo};
    ///
    /// #[derive(Debug)]
    /// enum Ev {
    ///     Validate(RequestId),
    ///     Verdict { request: RequestId, by: &'static str, ok: bool },
    /// }
    ///
    /// #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    /// enum Kind { Validate, Verdict }
    ///
    /// impl Event for Ev {
    ///     type Kind = Kind;
    ///     fn kind(&self) -> Kind {
    ///         match self {
    ///             Ev::Validate(_) => Kind::Validate,
    ///             Ev::Verdict { .. } => Kind::Verdict,
    ///         }
    ///     }
    ///     fn response_to(&self) -> Option<ResponseTo<'_>> {
    ///         match self {
    ///             Ev::Verdict { request, by, .. } => {
    ///                 Some(ResponseTo { request: *request, responder: by })
    ///             }
    ///             _ => None,
    ///         }
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let bus = EventBus::<Ev>::new();
    /// let mut requests = bus.subscribe("haproxy-validator", Filter::kind(Kind::Validate));
    /// bus.start();
    /// let responder_bus = bus.clone();
    /// let responder = tokio::spawn(async move {
    ///     if let Some(event) = requests.recv().await {
    ///         if let Ev::Validate(request) = *event {
    ///             let by = "haproxy-validator";
    ///             responder_bus.publish(Ev::Verdict { request, by, ok: true });
    ///         }
    ///     }
    /// });
    ///
    /// let params = RequestParams::new(Duration::from_secs(5))
    ///     .with_expected_responders(["haproxy-validator", "template-validator"])
    ///     .with_min_responses(1);
    /// let gathered = bus.request(Ev::Validate, params).await.unwrap();
    /// assert_eq!(gathered.responses.len(), 1);
    /// assert_eq!(gathered.missing, ["template-validator"]);
    /// responder.await.unwrap();
    /// # }
    /// ```
    pub async fn request<F>(&self, make: F, params: RequestParams) -> request::Result<Gathered<E>>
    where
        F: FnOnce(RequestId) -> E,
    {
        let id = RequestId::new(
            self.handle
                .inner
                .next_request
                .fetch_add(1, Ordering::Relaxed),
        );
        let span = tracing::debug_span!("request", request = %id);
        self.gather(id, make(id), params).instrument(span).await
    }

    async fn gather(
        &self,
        id: RequestId,
        event: E,
        params: RequestParams,
    ) -> request::Result<Gathered<E>> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.handle.inner.lock().pending.insert(id, tx);
        let _pending = PendingGuard {
            inner: &self.handle.inner,
            id,
        };
        let deadline = tokio::time::Instant::now() + params.timeout;
        self.publish(event);

        let mut responses: Vec<Response<E>> = Vec::new();
        let mut timed_out = false;
        while !params.satisfied(&responses) {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(event)) => {
                    let Some(answer) = event.response_to() else {
                        continue;
                    };
                    let responder = answer.responder;
                    if responses.iter().any(|r| r.responder == responder) {
                        debug!(responder, "second answer ignored");
                        continue;
                    }
                    let responder = responder.to_owned();
                    responses.push(Response { responder, event });
                }
                // The sender lives in the pending map until the guard removes it.
                Ok(None) => break,
                Err(_elapsed) => {
                    timed_out = true;
                    break;
                }
            }
        }

        let missing: Vec<String> = params
            .expected_responders
            .iter()
            .filter(|name| !responses.iter().any(|r| &r.responder == *name))
            .cloned()
            .collect();
        if responses.len() < params.min_responses {
            return Err(request::Error::NotEnoughResponses {
                id,
                received: responses.len(),
                required: params.min_responses,
                timeout: params.timeout,
                missing,
            });
        }
        if !missing.is_empty() {
            debug!(?missing, "request ended without every expected responder");
        }
        Ok(Gathered {
            id,
            responses,
            missing,
            timed_out,
        })
    }
}

impl RequestParams {
    /// Whether the answers gathered so far end the request early.
    fn satisfied<E>(&self, responses: &[Response<E>]) -> bool {
        if responses.len() < self.min_responses {
            return false;
        }
        if self.expected_responders.is_empty() {
            return self.min_responses > 0;
        }
        self.expected_responders
            .iter()
            .all(|name| responses.iter().any(|r| &r.responder == name))
    }
}

/// Removes a request's collector from the bus when the request ends or is dropped.
struct PendingGuard<'a, E: Event> {
    inner: &'a Inner<E>,
    id: RequestId,
}

impl<E: Event> Drop for PendingGuard<'_, E> {
    fn drop(&mut self) {
        self.inner.lock().pending.remove(&self.id);
    }
}

/// The bus proper, shared by every [`EventBus`] clone and every subscription.
pub(crate) struct Inner<E: Event> {
    state: Mutex<State<E>>,
    buffer_capacity: usize,
    high_water_warn: usize,
    next_request: AtomicU64,
}

impl<E: Event> Inner<E> {
    fn lock(&self) -> MutexGuard<'_, State<E>> {
        // The only application code that runs under this lock is `Kind`'s Hash and Eq and the
        // drop of events, none of which should panic; if one did, the state is still
        // consistent between statements, so carrying on is sound.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a dropped subscription out of every delivery list and frees its queue.
    pub(crate) fn unsubscribe(&self, shared: &Shared<E>) {
        let mut state = self.lock();
        let slot = shared.slot;
        match &shared.filter {
            Filter::All => state.all.retain(|s| *s != slot),
            Filter::Kinds(kinds) => {
                for kind in kinds {
                    if let Some(entry) = state.kinds.get_mut(kind) {
                        entry.subs.retain(|s| *s != slot);
                        if entry.subs.is_empty() && !entry.sticky {
                            state.kinds.remove(kind);
                        }
                    }
                }
            }
        }
        if let Some(queue) = state.queues.get_mut(slot).and_then(Option::take) {
            state.live -= 1;
            state.free_slots.push(slot);
            // Its events may hold the last references to them; drop them after the unlock.
            drop(state);
            drop(queue);
        }
    }

    /// Moves the events queued for `shared` into `batch` (which is empty); true when the bus
    /// is closed.
    pub(crate) fn take_batch(&self, shared: &Shared<E>, batch: &mut VecDeque<Arc<E>>) -> bool {
        let mut state = self.lock();
        if let Some(Some(queue)) = state.queues.get_mut(shared.slot) {
            queue.take_into(batch);
        }
        state.closed
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub(crate) fn subscription_stats(&self, shared: &Shared<E>) -> SubscriptionStats {
        let state = self.lock();
        match state.queues.get(shared.slot) {
            Some(Some(queue)) => queue.stats(),
            // Unreachable while the subscription lives: its slot is freed only when it drops.
            _ => SubscriptionStats {
                id: shared.id,
                name: shared.name.to_string(),
                delivery: shared.delivery,
                leader_only: shared.leader_only,
                queued: 0,
                high_water: 0,
                dropped: 0,
            },
        }
    }

    /// Marks the bus closed (its last handle is gone) and wakes every receiver to see it.
    fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        for queue in state.queues.iter().flatten() {
            queue.shared.notify.notify_one();
        }
    }
}

struct State<E: Event> {
    running: bool,
    started: bool,
    buffer: VecDeque<Buffered<E>>,
    buffer_overflows: u64,
    /// Per kind: its subscribers, and its latest event when the kind is sticky.
    kinds: KindMap<E::Kind, KindEntry<E>>,
    /// Slots of the subscribers to every kind.
    all: Vec<usize>,
    /// Every subscription's queue, by slot; `None` for a free slot.
    queues: Vec<Option<Queue<E>>>,
    free_slots: Vec<usize>,
    live: usize,
    /// The last handle is gone: receivers end once their queue is drained.
    closed: bool,
    next_subscription: u64,
    sticky_seq: u64,
    pending: HashMap<RequestId, mpsc::UnboundedSender<Arc<E>>>,
}

struct KindEntry<E: Event> {
    /// Slots of its subscribers.
    subs: Vec<usize>,
    sticky: bool,
    /// The latest delivered event of a sticky kind, with its place in the order of delivery.
    latest: Option<(u64, Arc<E>)>,
}

struct Buffered<E: Event> {
    kind: E::Kind,
    response: Option<RequestId>,
    event: Arc<E>,
}

impl<E: Event> State<E> {
    fn deliver(
        &mut self,
        kind: E::Kind,
        response: Option<RequestId>,
        event: &Arc<E>,
        notes: &mut Vec<Note>,
    ) -> usize {
        let mut delivered = 0;
        if let Some(entry) = self.kinds.get_mut(&kind) {
            if entry.sticky {
                self.sticky_seq += 1;
                entry.latest = Some((self.sticky_seq, Arc::clone(event)));
            }
            for &slot in &entry.subs {
                delivered += push(&mut self.queues, slot, event, notes);
            }
        }
        for &slot in &self.all {
            delivered += push(&mut self.queues, slot, event, notes);
        }
        if let Some(id) = response
            && let Some(collector) = self.pending.get(&id)
        {
            // The request may have just ended; then nobody needs the answer.
            let _ = collector.send(Arc::clone(event));
        }
        delivered
    }

    fn replay_sticky(&self, queue: &mut Queue<E>, notes: &mut Vec<Note>) {
        let filter = &queue.shared.filter;
        let mut latest: Vec<&(u64, Arc<E>)> = self
            .kinds
            .iter()
            .filter(|(kind, _)| filter.matches(**kind))
            .filter_map(|(_, entry)| entry.latest.as_ref())
            .collect();
        latest.sort_by_key(|(seq, _)| *seq);
        for (_, event) in latest {
            queue.push(event, notes);
        }
    }

    fn add(&mut self, queue: Queue<E>) {
        let slot = queue.shared.slot;
        match &queue.shared.filter {
            Filter::All => self.all.push(slot),
            Filter::Kinds(kinds) => {
                for kind in kinds {
                    self.kinds
                        .entry(*kind)
                        .or_insert_with(|| KindEntry {
                            subs: Vec::new(),
                            sticky: false,
                            latest: None,
                        })
                        .subs
                        .push(slot);
                }
            }
        }
        if slot == self.queues.len() {
            self.queues.push(Some(queue));
        } else {
            self.queues[slot] = Some(queue);
        }
        self.live += 1;
    }
}

/// Pushes into the queue in `slot`; 1 if the event was queued, 0 if not.
fn push<E: Event>(
    queues: &mut [Option<Queue<E>>],
    slot: usize,
    event: &Arc<E>,
    notes: &mut Vec<Note>,
) -> usize {
    match queues.get_mut(slot) {
        Some(Some(queue)) => usize::from(queue.push(event, notes) == Pushed::Queued),
        _ => 0,
    }
}

/// The per-kind map, looked up on every publish.
type KindMap<K, V> = HashMap<K, V, BuildHasherDefault<KindHasher>>;

/// The Fx hash (one rotate, xor and multiply per word). Kinds are the application's own small
/// discriminants, never outside input, so flooding is no concern and SipHash's cost on the
/// publish path buys nothing.
#[derive(Debug, Default, Clone, Copy)]
struct KindHasher(u64);

impl KindHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for KindHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn write_isize(&mut self, n: isize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Something worth logging, noted under the lock and logged after it is released.
#[derive(Debug)]
pub(crate) enum Note {
    Overflow { total: u64, capacity: usize },
    HighWater { subscriber: Arc<str>, queued: usize },
    Dropped { subscriber: Arc<str>, total: u64 },
}

fn emit(notes: Vec<Note>) {
    for note in notes {
        match note {
            Note::Overflow { total, capacity } => tracing::error!(
                total,
                capacity,
                "event bus buffer full while not running: event dropped"
            ),
            Note::HighWater { subscriber, queued } => warn!(
                subscriber = %subscriber,
                queued,
                "reliable subscriber falling behind: queue reached a new high-water mark"
            ),
            Note::Dropped { subscriber, total } => warn!(
                subscriber = %subscriber,
                total,
                "lossy subscriber queue full: event dropped for it"
            ),
        }
    }
}
