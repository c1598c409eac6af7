//! The adapter: runs the elector, claims an epoch per term, publishes leader events on the
//! bus, and builds and tears down leader-only components around each term.

use std::{
    any::Any,
    fmt,
    future::Future,
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use futures::{FutureExt, future::BoxFuture};
use haptic_election::{
    Callbacks, ElectionConfig, ElectionState, HealthCheck, LeaderElector, Resign, StopReason,
};
use haptic_epoch::{EpochStore, Term};
use haptic_eventbus::EventBus;
use kube::Client;
use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::{
    events::{
        BecameLeader, LeaderElectionStarted, LeaderEvents, LostLeadership, NewLeaderObserved,
    },
    metrics::LeadershipMetrics,
};

/// Errors of the adapter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The election config breaks a rule.
    #[error(transparent)]
    Election(#[from] haptic_election::Error),
}

/// Result with the adapter [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The reason published when a term gives the Lease up itself.
pub const STOOD_DOWN: &str = "stood_down";

/// The reason published when a term ends because one of its leader-only components panicked
/// or returned while the term went on: the Lease is released, so a fresh term (on another
/// replica, or on this one after a RetryPeriod) builds every component again.
pub const COMPONENT_FAILED: &str = "component_failed";

type AllReplicaFn<E> =
    Box<dyn FnOnce(EventBus<E>, CancellationToken) -> BoxFuture<'static, ()> + Send>;
type LeaderOnlyFn<E> = Arc<dyn Fn(LeaderContext<E>) -> BoxFuture<'static, ()> + Send + Sync>;
type BecameFn = Arc<dyn Fn(u64) + Send + Sync>;
type LostFn = Arc<dyn Fn(&str) + Send + Sync>;
type NewLeaderFn = Arc<dyn Fn(&str, bool) + Send + Sync>;
type FloorFn = Arc<dyn Fn() -> BoxFuture<'static, Option<u64>> + Send + Sync>;

/// What a leader-only component gets: the bus, a token cancelled when the term ends, and the
/// term's fencing epoch.
pub struct LeaderContext<E: LeaderEvents> {
    bus: EventBus<E>,
    token: CancellationToken,
    identity: String,
    term: Arc<TermState>,
    state: watch::Receiver<ElectionState>,
    fresh_for: Option<Duration>,
}

impl<E: LeaderEvents> Clone for LeaderContext<E> {
    fn clone(&self) -> Self {
        Self {
            bus: self.bus.clone(),
            token: self.token.clone(),
            identity: self.identity.clone(),
            term: self.term.clone(),
            state: self.state.clone(),
            fresh_for: self.fresh_for,
        }
    }
}

impl<E: LeaderEvents> fmt::Debug for LeaderContext<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderContext")
            .field("identity", &self.identity)
            .field("epoch", &self.epoch())
            .finish()
    }
}

struct TermState {
    term: tokio::sync::Mutex<Option<Term>>,
    /// Whether the term claimed its epoch on the Lease (false in disabled mode).
    on_lease: bool,
    epoch: AtomicU64,
    stand_down: CancellationToken,
    stand_down_reason: Mutex<String>,
}

impl TermState {
    fn request_stand_down(&self, reason: &str) {
        let mut r = self
            .stand_down_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.is_empty() {
            *r = reason.to_owned();
        }
        self.stand_down.cancel();
    }
}

impl<E: LeaderEvents> LeaderContext<E> {
    /// The bus; subscribe with `subscribe_leader_only` in the component's builder, before it
    /// returns its future, to receive the `BecameLeader` that woke it.
    pub fn bus(&self) -> &EventBus<E> {
        &self.bus
    }

    /// Cancelled when the term ends; the component must return soon after.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The epoch every write of this term carries (it rises after a [`LeaderContext::reclaim`]).
    pub fn epoch(&self) -> u64 {
        self.term.epoch.load(Ordering::SeqCst)
    }

    /// A receiver refused our epoch with its fence `floor`: raise the epoch above it if the
    /// Lease still names us (the counter regressed). On [`haptic_epoch::Error::ForeignLeader`]
    /// the term stands down by itself; stop writing. In disabled mode (one replica, no Lease)
    /// the epoch is simply raised above `floor`.
    pub async fn reclaim(&self, floor: u64) -> Result<u64, haptic_epoch::Error> {
        let mut guard = self.term.term.lock().await;
        if !self.term.on_lease {
            // Disabled mode: one replica, no Lease to claim on. Receivers fenced by leaders of
            // an earlier, elected deployment would otherwise refuse this replica forever, so
            // its epoch follows them up.
            let raised = self.epoch().max(floor.saturating_add(1));
            self.term.epoch.store(raised, Ordering::SeqCst);
            return Ok(raised);
        }
        let Some(term) = guard.as_mut() else {
            // A term already standing down.
            return Ok(self.epoch());
        };
        match term.reclaim(floor).await {
            Ok(epoch) => {
                self.term.epoch.store(epoch, Ordering::SeqCst);
                Ok(epoch)
            }
            Err(error) => {
                if matches!(error, haptic_epoch::Error::ForeignLeader { .. }) {
                    self.term.request_stand_down(STOOD_DOWN);
                }
                Err(error)
            }
        }
    }

    /// Whether this replica may still act as the leader right now, judged on its own monotonic
    /// clock: the term is not over and the last successful renew is younger than RenewDeadline
    /// (always true in disabled mode). A leader that was frozen (SIGSTOP, a long GC-like pause)
    /// past its deadline sees `false` at once on waking, before the elector has noticed; use it
    /// to guard writes that no fence protects, such as status updates.
    pub fn lease_is_fresh(&self) -> bool {
        if self.token.is_cancelled() {
            return false;
        }
        let Some(limit) = self.fresh_for else {
            return true;
        };
        let state = self.state.borrow();
        state.is_leader && state.last_renew.is_some_and(|at| at.elapsed() < limit)
    }

    /// Ends the term: leader-only components are cancelled and awaited, then the Lease is
    /// released, so only a fresh acquisition (with a fresh epoch) continues. Returns at once;
    /// the caller returns when its token is cancelled.
    pub fn stand_down(&self, reason: &str) {
        self.term.request_stand_down(reason);
    }
}

/// Optional user hooks, each run right after the matching event was published.
#[derive(Default, Clone)]
struct Hooks {
    became: Option<BecameFn>,
    lost: Option<LostFn>,
    new_leader: Option<NewLeaderFn>,
    epoch_floor: Option<FloorFn>,
}

/// Elector + epoch + bus, with a lifecycle registry of all-replica and leader-only components.
pub struct Leadership<E: LeaderEvents> {
    client: Client,
    config: ElectionConfig,
    elector: LeaderElector,
    bus: EventBus<E>,
    all_replica: Vec<(String, AllReplicaFn<E>)>,
    leader_only: Vec<(String, LeaderOnlyFn<E>)>,
    hooks: Hooks,
    metrics: Arc<LeadershipMetrics>,
    meter: Option<opentelemetry::metrics::Meter>,
    stop_timeout: Duration,
}

impl<E: LeaderEvents> fmt::Debug for Leadership<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("config", &self.config)
            .field(
                "all_replica",
                &self.all_replica.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "leader_only",
                &self.leader_only.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

struct Shared<E: LeaderEvents> {
    bus: EventBus<E>,
    identity: String,
    epochs: Option<EpochStore>,
    leader_only: Vec<(String, LeaderOnlyFn<E>)>,
    hooks: Hooks,
    metrics: Arc<LeadershipMetrics>,
    stop_timeout: Duration,
    state: watch::Receiver<ElectionState>,
    resign: Resign,
    fresh_for: Option<Duration>,
}

impl<E: LeaderEvents> Leadership<E> {
    /// An adapter for `config` publishing into `bus`. Refuses an invalid config.
    pub fn new(client: Client, config: ElectionConfig, bus: EventBus<E>) -> Result<Self> {
        config.validate().map_err(haptic_election::Error::from)?;
        let elector = LeaderElector::new(client.clone(), config.clone())?;
        Ok(Self {
            client,
            config,
            elector,
            bus,
            all_replica: Vec::new(),
            leader_only: Vec::new(),
            hooks: Hooks::default(),
            metrics: Arc::new(LeadershipMetrics::new()),
            meter: None,
            stop_timeout: Duration::from_secs(10),
        })
    }

    /// The meter [`run`](Self::run) exports the metrics on (default: the global provider's
    /// `haptic-leadership` meter, a no-op until the application installs a provider).
    #[must_use]
    pub fn with_meter(mut self, meter: opentelemetry::metrics::Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The election state, updated on every transition (for probes and debug state).
    pub fn election_state(&self) -> watch::Receiver<ElectionState> {
        self.elector.state()
    }

    /// The elector's health check, for a `/healthz` handler.
    pub fn health(&self) -> HealthCheck {
        self.elector.health()
    }

    /// The metrics this adapter drives.
    pub fn metrics(&self) -> Arc<LeadershipMetrics> {
        self.metrics.clone()
    }

    /// Judges Lease expiry and the renew deadline on `clock` instead of tokio's (for tests of
    /// clock-rate skew: [`haptic_election::SkewedClock`]).
    #[must_use]
    pub fn with_clock(mut self, clock: impl haptic_election::Clock) -> Self {
        self.elector = self.elector.with_clock(clock);
        self
    }

    /// How long a term's end waits for leader-only components (and shutdown for all-replica
    /// ones) before aborting them. Default 10 s; keep it below the elector's
    /// `work_stop_timeout`.
    #[must_use]
    pub fn with_stop_timeout(mut self, timeout: Duration) -> Self {
        self.stop_timeout = timeout;
        self
    }

    /// Registers a component that runs on every replica from start to shutdown. `build` runs
    /// before the bus starts (subscribe there, not in the returned future).
    #[must_use]
    pub fn all_replicas<F, Fut>(mut self, name: &str, build: F) -> Self
    where
        F: FnOnce(EventBus<E>, CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.all_replica.push((
            name.to_owned(),
            Box::new(move |bus, token| build(bus, token).boxed()),
        ));
        self
    }

    /// Registers a component built afresh for every term, after `BecameLeader` is published and
    /// before the bus restarts (subscribe with `subscribe_leader_only` in `build`, not in the
    /// returned future). Its token is cancelled when the term ends, and it is awaited, with a
    /// bound, before the Lease is released.
    #[must_use]
    pub fn leader_only<F, Fut>(mut self, name: &str, build: F) -> Self
    where
        F: Fn(LeaderContext<E>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.leader_only
            .push((name.to_owned(), Arc::new(move |ctx| build(ctx).boxed())));
        self
    }

    /// A hook run after `BecameLeader` is published (before leader-only components are built).
    #[must_use]
    pub fn on_became_leader(mut self, f: impl Fn(u64) + Send + Sync + 'static) -> Self {
        self.hooks.became = Some(Arc::new(f));
        self
    }

    /// A hook run after `LostLeadership` is published (before leader-only components stop).
    #[must_use]
    pub fn on_lost_leadership(mut self, f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.hooks.lost = Some(Arc::new(f));
        self
    }

    /// How to recover from a malformed epoch annotation: `floor` returns the highest epoch any
    /// receiver has accepted (e.g. the agents' fences), and the term claims one above it with
    /// `EpochStore::bump_above`, so the epoch never goes backwards. Without it (or when it
    /// returns `None`) a term that finds the annotation malformed resigns, and nobody leads
    /// until the annotation is repaired.
    #[must_use]
    pub fn with_epoch_floor<F, Fut>(mut self, floor: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<u64>> + Send + 'static,
    {
        self.hooks.epoch_floor = Some(Arc::new(move || floor().boxed()));
        self
    }

    /// A hook run after `NewLeaderObserved` is published.
    #[must_use]
    pub fn on_new_leader(mut self, f: impl Fn(&str, bool) + Send + Sync + 'static) -> Self {
        self.hooks.new_leader = Some(Arc::new(f));
        self
    }

    /// Runs until `token` fires: publishes `LeaderElectionStarted`, builds the all-replica
    /// components, starts the bus, and runs the election. On shutdown leader-only work stops
    /// first, then the Lease is released (with `release_on_cancel`), then all-replica
    /// components are awaited (bounded).
    pub async fn run(self, token: CancellationToken) -> Result<()> {
        let meter = self
            .meter
            .clone()
            .unwrap_or_else(|| opentelemetry::global::meter("haptic-leadership"));
        self.metrics.register(&meter);
        let elector = self.elector;
        let identity = self.config.identity.clone();
        let epochs = self.config.enabled.then(|| {
            EpochStore::new(
                self.client.clone(),
                &self.config.lease_namespace,
                &self.config.lease_name,
                &identity,
            )
        });
        let shared = Arc::new(Shared {
            bus: self.bus.clone(),
            identity: identity.clone(),
            epochs,
            leader_only: self.leader_only,
            hooks: self.hooks,
            metrics: self.metrics.clone(),
            // Leader-only work must be awaited before the elector gives up waiting for the term.
            stop_timeout: self
                .stop_timeout
                .min(self.config.work_stop_timeout.mul_f64(0.9)),
            state: elector.state(),
            resign: elector.resign_handle(),
            fresh_for: self.config.enabled.then_some(self.config.renew_deadline),
        });
        self.bus.publish(LeaderElectionStarted {
            identity: identity.clone(),
            lease_name: self.config.lease_name.clone(),
            lease_namespace: self.config.lease_namespace.clone(),
            at: SystemTime::now(),
        });
        // Not a child of `token`: all-replica components keep running (and hear LostLeadership)
        // until the elector has stopped leader-only work and released the Lease.
        let components_token = CancellationToken::new();
        // If `run` is dropped, the components are told to stop all the same.
        let _stop_components_on_drop = components_token.clone().drop_guard();
        let mut all_replica = Vec::new();
        for (name, build) in self.all_replica {
            let bus = self.bus.clone();
            let token = components_token.clone();
            let built = std::panic::catch_unwind(AssertUnwindSafe(|| build(bus, token.clone())));
            let (metrics, resign) = (self.metrics.clone(), elector.resign_handle());
            let component = name.clone();
            // An all-replica component cannot be rebuilt (it subscribed before the bus
            // started): its failure makes the replica unhealthy, so the kubelet restarts it,
            // and gives up a term it may hold, so a healthy replica deploys meanwhile.
            let handle = tokio::spawn(async move {
                let ended = match built {
                    Ok(work) => supervised(work, || token.is_cancelled()).await,
                    Err(payload) => Some((PANIC, panic_message(&*payload))),
                };
                if let Some((cause, message)) = ended {
                    error!(%component, cause, %message, "an all-replica component failed; this replica reports unhealthy and gives up leadership");
                    metrics.component_failed(&component, cause);
                    metrics.set_unhealthy(format!(
                        "component {component} failed ({cause}): {message}"
                    ));
                    resign.resign();
                }
            });
            all_replica.push(Component { name, handle });
        }
        self.bus.start();

        let on_new = shared.clone();
        let on_start = shared.clone();
        let callbacks = Callbacks::new()
            .on_new_leader(move |who, is_self| {
                on_new.bus.publish(NewLeaderObserved {
                    new_leader_identity: who.to_owned(),
                    is_self,
                    at: SystemTime::now(),
                });
                if let Some(hook) = &on_new.hooks.new_leader {
                    hook(who, is_self);
                }
            })
            .on_started_leading(move |term_token| run_term(on_start.clone(), term_token))
            .on_stopped_leading(|reason| info!(%reason, "term over"));
        elector.run(token.clone(), callbacks).await;
        components_token.cancel();
        await_bounded(all_replica, self.stop_timeout).await;
        Ok(())
    }
}

/// A component's task, aborted if its owner is dropped before awaiting it.
struct Component {
    name: String,
    handle: JoinHandle<()>,
}

impl Drop for Component {
    fn drop(&mut self) {
        // A no-op for a task that has finished.
        self.handle.abort();
    }
}

async fn await_bounded(tasks: Vec<Component>, bound: Duration) {
    let deadline = tokio::time::Instant::now() + bound;
    for mut component in tasks {
        let name = component.name.clone();
        let handle = &mut component.handle;
        match tokio::time::timeout_at(deadline, handle).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(component = %name, %error, "component ended with a panic"),
            Err(_) => {
                // Dropping `component` aborts it.
                warn!(component = %name, timeout = ?bound, "component did not stop in time; aborting it");
            }
        }
    }
}

/// A supervised component ended on a panic.
const PANIC: &str = "panic";
/// A supervised component returned while `stopping` said it should run on.
const RETURNED: &str = "returned";

/// Runs `work`, catching a panic: `None` when it returned once `stopping()` held, else the
/// cause ([`PANIC`] or [`RETURNED`]) and the panic's message.
async fn supervised(
    work: BoxFuture<'static, ()>,
    stopping: impl Fn() -> bool,
) -> Option<(&'static str, String)> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(()) if stopping() => None,
        Ok(()) => Some((RETURNED, "returned while it should have run on".to_owned())),
        Err(payload) => Some((PANIC, panic_message(&*payload))),
    }
}

/// The text a panic was raised with.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a text message".to_owned())
}

/// Bumps the epoch; on a malformed annotation, recovers above the application's floor if it
/// gave one.
async fn claim_epoch(epochs: &EpochStore, hooks: &Hooks) -> haptic_epoch::Result<Term> {
    match epochs.bump().await {
        Err(haptic_epoch::Error::Malformed(malformed)) => {
            let floor = match &hooks.epoch_floor {
                Some(floor) => floor().await,
                None => None,
            };
            match floor {
                Some(floor) => {
                    warn!(%malformed, floor, "recovering from a malformed epoch annotation above the receivers' fence");
                    epochs.bump_above(floor).await
                }
                None => Err(haptic_epoch::Error::Malformed(malformed)),
            }
        }
        other => other,
    }
}

/// One term, from acquisition to the end of its leader-only work.
async fn run_term<E: LeaderEvents>(shared: Arc<Shared<E>>, term_token: CancellationToken) {
    let terms_at_start = shared.state.borrow().terms;
    // A term dispatches nothing before its bump succeeded.
    let term = match &shared.epochs {
        None => None,
        Some(epochs) => match claim_epoch(epochs, &shared.hooks).await {
            Ok(term) => Some(term),
            Err(error) => {
                let hint = match error {
                    haptic_epoch::Error::Malformed(_) => {
                        "repair the annotation, or recover with EpochStore::bump_above(highest fence the agents report)"
                    }
                    _ => "another replica (or this one, after a RetryPeriod) will try again",
                };
                error!(%error, identity = %shared.identity, hint, "claiming an epoch failed; resigning the term");
                // The elector releases the Lease with the object it holds and pauses before
                // competing again.
                shared.resign.resign();
                return;
            }
        },
    };
    if term_token.is_cancelled() {
        // The term ended while the epoch was being claimed: nothing was published, nothing is.
        return;
    }
    let epoch = term.as_ref().map_or(0, Term::epoch);
    let state = Arc::new(TermState {
        on_lease: term.is_some(),
        term: tokio::sync::Mutex::new(term),
        epoch: AtomicU64::new(epoch),
        stand_down: CancellationToken::new(),
        stand_down_reason: Mutex::new(String::new()),
    });
    let components_token = term_token.child_token();
    let ctx = LeaderContext {
        bus: shared.bus.clone(),
        token: components_token.clone(),
        identity: shared.identity.clone(),
        term: state.clone(),
        state: shared.state.clone(),
        fresh_for: shared.fresh_for,
    };

    // The leadership contract: pause -> publish -> build (they subscribe) -> start.
    shared.bus.pause();
    shared.metrics.became_leader();
    shared.bus.publish(BecameLeader {
        identity: shared.identity.clone(),
        epoch,
        at: SystemTime::now(),
    });
    if let Some(hook) = &shared.hooks.became {
        hook(epoch);
    }
    let mut tasks = Vec::new();
    for (name, build) in &shared.leader_only {
        let built = std::panic::catch_unwind(AssertUnwindSafe(|| build(ctx.clone())));
        let (shared, state, token) = (shared.clone(), state.clone(), components_token.clone());
        let component = name.clone();
        let handle = tokio::spawn(async move {
            let ended = match built {
                Ok(work) => {
                    supervised(work, || {
                        token.is_cancelled() || state.stand_down.is_cancelled()
                    })
                    .await
                }
                Err(payload) => Some((PANIC, panic_message(&*payload))),
            };
            let Some((cause, message)) = ended else {
                return;
            };
            shared.metrics.component_failed(&component, cause);
            if state.on_lease {
                error!(%component, cause, %message, "a leader-only component failed; standing down so that a fresh term rebuilds it");
            } else {
                // Election disabled: no other replica and no fresh term; only a restart helps.
                error!(%component, cause, %message, "a leader-only component failed with election disabled; this replica reports unhealthy");
                shared
                    .metrics
                    .set_unhealthy(format!("component {component} failed ({cause}): {message}"));
            }
            state.request_stand_down(COMPONENT_FAILED);
        });
        tasks.push(Component {
            name: name.clone(),
            handle,
        });
    }
    shared.bus.start();
    info!(identity = %shared.identity, epoch, components = tasks.len(), "leading");

    let stood_down = tokio::select! {
        () = term_token.cancelled() => false,
        () = state.stand_down.cancelled() => true,
    };
    let reason = if stood_down {
        state
            .stand_down_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    } else {
        let s = shared.state.borrow();
        match s.last_stop {
            // The elector records why (and still counts this term) before it cancels the term;
            // a root cancellation reaches the term's token first, while it still leads.
            Some(reason) if !s.is_leader && s.terms == terms_at_start => reason.as_str().to_owned(),
            _ => StopReason::GracefulShutdown.as_str().to_owned(),
        }
    };
    shared.bus.publish(LostLeadership {
        identity: shared.identity.clone(),
        reason: reason.clone(),
        at: SystemTime::now(),
    });
    shared.metrics.lost_leadership();
    if let Some(hook) = &shared.hooks.lost {
        hook(&reason);
    }
    components_token.cancel();
    await_bounded(tasks, shared.stop_timeout).await;
    if stood_down {
        // Only now, with the leader-only work stopped, the elector releases the Lease; the term
        // (and its epoch) ends here.
        drop(state.term.lock().await.take());
        shared.resign.resign();
    }
}
