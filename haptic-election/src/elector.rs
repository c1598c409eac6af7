//! The elector: acquires, renews and releases the Lease, and reports every transition.

use std::{fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use futures::{FutureExt, Stream, StreamExt, future::BoxFuture};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, Client,
    api::{WatchEvent, WatchParams},
};
use tokio::{sync::watch, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{
    clock::{Clock, SharedClock, TokioClock},
    config::{ConfigError, ElectionConfig, JITTER_FACTOR},
    lock::{LeaseLock, LockError, Record, now_micros},
};

/// Why this replica stopped leading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The elector's cancellation token fired (shutdown); the Lease was released if configured.
    GracefulShutdown,
    /// No renew succeeded within RenewDeadline: the leader stepped down before any other replica
    /// could take the Lease.
    LeaseExpired,
    /// A renew found another holder on the Lease.
    LeaseTaken,
    /// The leader's own work gave the term up ([`Resign::resign`]); the Lease was released.
    Resigned,
}

impl StopReason {
    /// The reason as logs and metrics spell it: `graceful_shutdown`, `lease_expired`,
    /// `lease_taken`, `resigned`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GracefulShutdown => "graceful_shutdown",
            Self::LeaseExpired => "lease_expired",
            Self::LeaseTaken => "lease_taken",
            Self::Resigned => "resigned",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What this replica knows of the election, published on every change (see
/// [`LeaderElector::state`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ElectionState {
    /// The holder last observed on the Lease (this replica's identity while it leads); `None`
    /// when the Lease is vacant or not read yet.
    pub holder: Option<String>,
    /// Whether this replica leads now.
    pub is_leader: bool,
    /// When this replica's current term began (tokio clock).
    pub leader_since: Option<Instant>,
    /// When the last successful acquire or renew of this replica was sent (tokio clock).
    pub last_renew: Option<Instant>,
    /// Why the last term of this replica ended.
    pub last_stop: Option<StopReason>,
    /// How many terms this replica has started.
    pub terms: u64,
}

type StartedFn = Box<dyn Fn(CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;
type StoppedFn = Box<dyn Fn(StopReason) + Send + Sync>;
type NewLeaderFn = Box<dyn Fn(&str, bool) + Send + Sync>;

/// The transitions reported to the caller. All are optional.
#[derive(Default)]
pub struct Callbacks {
    started: Option<StartedFn>,
    stopped: Option<StoppedFn>,
    new_leader: Option<NewLeaderFn>,
}

impl fmt::Debug for Callbacks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Callbacks")
            .field("started", &self.started.is_some())
            .field("stopped", &self.stopped.is_some())
            .field("new_leader", &self.new_leader.is_some())
            .finish()
    }
}

impl Callbacks {
    /// No callbacks.
    pub fn new() -> Self {
        Self::default()
    }

    /// The work of a term: called when this replica starts leading, with a token that is
    /// cancelled when the term ends. The elector awaits the returned future (bounded by
    /// `work_stop_timeout`) before it releases the Lease or re-enters election.
    #[must_use]
    pub fn on_started_leading<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.started = Some(Box::new(move |token| f(token).boxed()));
        self
    }

    /// Called when a term ends, after its work has returned (or its wait timed out).
    #[must_use]
    pub fn on_stopped_leading(mut self, f: impl Fn(StopReason) + Send + Sync + 'static) -> Self {
        self.stopped = Some(Box::new(f));
        self
    }

    /// Called with the identity of every new holder observed, and whether it is this replica.
    #[must_use]
    pub fn on_new_leader(mut self, f: impl Fn(&str, bool) + Send + Sync + 'static) -> Self {
        self.new_leader = Some(Box::new(f));
        self
    }
}

/// Errors of the elector.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration breaks a rule.
    #[error("invalid election config: {0}")]
    Config(#[from] ConfigError),
    /// An API request failed (only from [`release_lease`]; the elector itself retries).
    #[error("lease request failed: {0}")]
    Request(String),
}

/// Result with the election [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A health check for a `/healthz` handler: fails when this replica believes it leads but its
/// last successful renew is older than LeaseDuration plus a tolerance (a leader stuck without
/// noticing). Cheap to clone.
#[derive(Clone)]
pub struct HealthCheck {
    state: watch::Receiver<ElectionState>,
    limit: Duration,
    enabled: bool,
}

impl fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthCheck")
            .field("limit", &self.limit)
            .finish()
    }
}

impl HealthCheck {
    /// `Ok` when healthy; otherwise a message saying how stale the last renew is.
    pub fn check(&self) -> Result<(), String> {
        let state = self.state.borrow();
        if !self.enabled || !state.is_leader {
            return Ok(());
        }
        match state.last_renew {
            Some(at) if at.elapsed() <= self.limit => Ok(()),
            Some(at) => Err(format!(
                "leader has not renewed its Lease for {:?} (limit {:?})",
                at.elapsed(),
                self.limit
            )),
            None => Err("leader has never renewed its Lease".to_owned()),
        }
    }
}

/// A Lease elector. Build it, take [`LeaderElector::state`] and [`LeaderElector::health`], then
/// [`LeaderElector::run`] it until its token fires.
pub struct LeaderElector {
    config: ElectionConfig,
    lock: LeaseLock,
    clock: SharedClock,
    state: watch::Sender<ElectionState>,
    resign: Arc<watch::Sender<u64>>,
    rng: u64,
}

/// Lets the leader's own work give its term up (e.g. it cannot claim a fencing epoch): the
/// elector steps down with [`StopReason::Resigned`], releases the Lease, waits a RetryPeriod
/// so another replica can take it, and re-enters election. A request made while not leading
/// is ignored. Cheap to clone.
#[derive(Clone)]
pub struct Resign(Arc<watch::Sender<u64>>);

impl fmt::Debug for Resign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Resign")
    }
}

impl Resign {
    /// Asks the current term to end.
    pub fn resign(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }
}

impl fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderElector")
            .field("config", &self.config)
            .finish()
    }
}

/// What a follower knows of the Lease.
#[derive(Default)]
struct Observed {
    /// The latest Lease object seen (its resourceVersion is what a takeover PUTs with).
    lease: Option<Lease>,
    /// The record last seen to change, and when (on the elector's clock).
    record: Option<Record>,
    at: Option<Instant>,
    /// The holder last reported to `on_new_leader`.
    reported: Option<String>,
    /// Where a reopened watch resumes, when a bookmark is newer than `lease`.
    resume: Option<String>,
}

/// When a write was sent, on the elector's clock (for deadlines) and on tokio's (for state).
#[derive(Debug, Clone, Copy)]
struct Sent {
    clock: Instant,
    tokio: Instant,
}

impl Sent {
    fn now(elector: &LeaderElector) -> Self {
        Self {
            clock: elector.now(),
            tokio: Instant::now(),
        }
    }
}

/// The started-leading work of one term: its task and the token that ends it.
struct Work {
    /// Cancels the work if the term's future is dropped (the elector's task aborted).
    token: tokio_util::sync::DropGuard,
    handle: Option<tokio::task::JoinHandle<()>>,
}

impl Work {
    fn start(term: &CancellationToken, callbacks: &Callbacks) -> Self {
        let token = term.child_token();
        let handle = callbacks
            .started
            .as_ref()
            .map(|f| tokio::spawn(f(token.clone())));
        Self {
            token: token.drop_guard(),
            handle,
        }
    }

    /// Cancels the work and awaits it for at most `timeout`, then aborts it.
    async fn stop(self, timeout: Duration) {
        drop(self.token);
        let Some(mut handle) = self.handle else {
            return;
        };
        match tokio::time::timeout(timeout, &mut handle).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, "the leader's work ended with a panic"),
            Err(_) => {
                warn!(
                    ?timeout,
                    "the leader's work did not stop in time; aborting it"
                );
                handle.abort();
            }
        }
    }
}

type LeaseEvents = Pin<Box<dyn Stream<Item = Result<WatchEvent<Lease>, kube::Error>> + Send>>;

/// How long a follower's watch stays open before it is renewed (the server may close it
/// earlier); each renewal is one request.
const WATCH_TIMEOUT_SECS: u32 = 290;

impl LeaderElector {
    /// An elector for `config` using `client`. Refuses an invalid config.
    pub fn new(client: Client, config: ElectionConfig) -> Result<Self> {
        config.validate()?;
        let api: Api<Lease> = Api::namespaced(client, &config.lease_namespace);
        let seed = config
            .identity
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
        Ok(Self {
            lock: LeaseLock {
                api,
                name: config.lease_name.clone(),
            },
            config,
            clock: SharedClock(Arc::new(TokioClock)),
            state: watch::channel(ElectionState::default()).0,
            resign: Arc::new(watch::channel(0).0),
            rng: seed | 1,
        })
    }

    /// Uses another clock to judge expiry (for skew tests).
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = SharedClock(Arc::new(clock));
        self
    }

    /// The election state, updated on every transition: await `changed()` instead of polling.
    pub fn state(&self) -> watch::Receiver<ElectionState> {
        self.state.subscribe()
    }

    /// A handle the leader's work can use to give its term up.
    pub fn resign_handle(&self) -> Resign {
        Resign(self.resign.clone())
    }

    /// A health check for this elector.
    pub fn health(&self) -> HealthCheck {
        HealthCheck {
            state: self.state.subscribe(),
            limit: self.config.lease_duration + self.config.health_tolerance,
            enabled: self.config.enabled,
        }
    }

    /// The config in use.
    pub fn config(&self) -> &ElectionConfig {
        &self.config
    }

    fn now(&self) -> Instant {
        self.clock.0.now()
    }

    fn next_random(&mut self) -> f64 {
        // xorshift64*: jitter needs spread, not cryptographic quality.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `base` stretched by a random factor in `[1, JITTER_FACTOR)`.
    fn jitter(&mut self, base: Duration) -> Duration {
        base.mul_f64(1.0 + (JITTER_FACTOR - 1.0) * self.next_random())
    }

    /// A follower's polling interval: client-go's `JitterUntil(RetryPeriod, 1.2)`, i.e. in
    /// `[RetryPeriod, 2.2 x RetryPeriod)`, with `poll_only`; while a broken watch is being
    /// re-established, `[RetryPeriod, 1.2 x RetryPeriod)`.
    fn poll_interval(&mut self) -> Duration {
        let base = self.config.retry_period;
        if self.config.poll_only {
            base.mul_f64(1.0 + JITTER_FACTOR * self.next_random())
        } else {
            self.jitter(base)
        }
    }

    fn backoff(&mut self, failures: u32) -> Duration {
        let base = Duration::from_millis(200).saturating_mul(1 << failures.min(6));
        self.jitter(base.min(self.config.retry_period))
    }

    /// Runs the election until `token` fires. Never returns early on API errors: it retries
    /// with backoff. A lost Lease re-enters election in place.
    pub async fn run(mut self, token: CancellationToken, callbacks: Callbacks) {
        if !self.config.enabled {
            self.run_disabled(token, &callbacks).await;
            return;
        }
        info!(identity = %self.config.identity, lease = %self.config.lease_name, namespace = %self.config.lease_namespace, "starting leader election");
        let mut observed = Observed::default();
        loop {
            let Some((lease, sent)) = self.acquire(&token, &callbacks, &mut observed).await else {
                return;
            };
            let reason = self
                .lead(&token, &callbacks, lease, sent, &mut observed)
                .await;
            if reason == StopReason::GracefulShutdown {
                return;
            }
            if reason == StopReason::Resigned {
                // Give the other replicas a RetryPeriod to take the released Lease.
                let pause = self.jitter(self.config.retry_period);
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
            }
            info!(identity = %self.config.identity, %reason, "re-entering election");
        }
    }

    async fn run_disabled(&mut self, token: CancellationToken, callbacks: &Callbacks) {
        info!(identity = %self.config.identity, "leader election disabled: leading at once");
        let now = Instant::now();
        self.state.send_modify(|s| {
            s.holder = Some(self.config.identity.clone());
            s.is_leader = true;
            s.leader_since = Some(now);
            s.last_renew = Some(now);
            s.terms += 1;
        });
        if let Some(f) = &callbacks.new_leader {
            f(&self.config.identity, true);
        }
        let work = Work::start(&token, callbacks);
        token.cancelled().await;
        work.stop(self.config.work_stop_timeout).await;
        self.state.send_modify(|s| {
            s.is_leader = false;
            s.last_stop = Some(StopReason::GracefulShutdown);
        });
        if let Some(f) = &callbacks.stopped {
            f(StopReason::GracefulShutdown);
        }
    }

    /// Records a Lease seen from the API; returns whether its holder record changed.
    fn observe(&self, observed: &mut Observed, lease: Lease, callbacks: &Callbacks) -> bool {
        let record = Record::of(&lease);
        let changed = observed.record.as_ref() != Some(&record);
        if changed {
            observed.at = Some(self.now());
            let holder = (!record.holder.is_empty()).then(|| record.holder.clone());
            if holder.is_some() && holder != observed.reported {
                let name = holder.clone().unwrap_or_default();
                let is_self = name == self.config.identity;
                debug!(identity = %self.config.identity, leader = %name, "new leader observed");
                observed.reported = holder.clone();
                if let Some(f) = &callbacks.new_leader {
                    f(&name, is_self);
                }
            }
            self.state.send_if_modified(|s| {
                let modified = s.holder != holder;
                s.holder = holder;
                modified
            });
            observed.record = Some(record);
        }
        observed.lease = Some(lease);
        observed.resume = None;
        changed
    }

    fn forget(&self, observed: &mut Observed) {
        observed.lease = None;
        observed.record = None;
        observed.at = None;
        self.state.send_if_modified(|s| s.holder.take().is_some());
    }

    /// When the observed holder's term runs out on this replica's clock; `None` when the Lease
    /// may be taken now (vacant, released, or held by this identity).
    fn expiry(&self, observed: &Observed) -> Option<Instant> {
        let record = observed.record.as_ref()?;
        if record.holder.is_empty() || record.holder == self.config.identity {
            return None;
        }
        let secs = if record.duration_secs > 0 {
            u64::try_from(record.duration_secs).unwrap_or(1)
        } else {
            self.config.lease_duration.as_secs()
        };
        Some(observed.at? + Duration::from_secs(secs))
    }

    fn takeover_record(&self, observed: &Observed) -> Record {
        let now = now_micros();
        let old = observed.record.clone().unwrap_or_default();
        let mut record = Record {
            holder: self.config.identity.clone(),
            duration_secs: self.config.lease_duration_seconds(),
            acquire: Some(now),
            renew: Some(now),
            transitions: old.transitions,
        };
        if old.holder == self.config.identity {
            record.acquire = old.acquire.or(Some(now));
        } else if observed.lease.is_some() {
            record.transitions = old.transitions.saturating_add(1);
        }
        record
    }

    async fn open_watch(&self, observed: &Observed) -> Result<LeaseEvents, LockError> {
        let rv = observed
            .resume
            .clone()
            .or_else(|| {
                observed
                    .lease
                    .as_ref()
                    .and_then(|l| l.metadata.resource_version.clone())
            })
            .unwrap_or_else(|| "0".to_owned());
        let params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.config.lease_name))
            .timeout(WATCH_TIMEOUT_SECS);
        let api = self.lock.api.clone();
        let opened = tokio::time::timeout(self.config.request_timeout, async move {
            api.watch(&params, &rv)
                .await
                .map(|s| Box::pin(s) as LeaseEvents)
        })
        .await;
        match opened {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(LockError::Api(e)),
            Err(_) => Err(LockError::Timeout(self.config.request_timeout)),
        }
    }

    /// Follows until this replica holds the Lease (returns the Lease its write returned), or
    /// `None` when cancelled.
    async fn acquire(
        &mut self,
        token: &CancellationToken,
        callbacks: &Callbacks,
        observed: &mut Observed,
    ) -> Option<(Lease, Sent)> {
        let timeout = self.config.request_timeout;
        let mut need_get = observed.lease.is_none();
        let mut failures = 0u32;
        let mut watch: Option<LeaseEvents> = None;
        let mut watch_failures = 0u32;
        let mut watch_retry_at = Instant::now();
        let mut poll_at = Instant::now() + self.poll_interval();
        loop {
            if token.is_cancelled() {
                return None;
            }
            if need_get {
                match self.lock.get(timeout).await {
                    Ok(Some(lease)) => {
                        self.observe(observed, lease, callbacks);
                        need_get = false;
                        failures = 0;
                    }
                    Ok(None) if self.expiry(observed).is_some_and(|at| self.now() < at) => {
                        // Deleted while another replica held it: wait out that term first.
                        observed.lease = None;
                        need_get = false;
                    }
                    Ok(None) => {
                        self.forget(observed);
                        let record = self.takeover_record(observed);
                        let sent = Sent::now(self);
                        match self.lock.create(&record, timeout).await {
                            Ok(lease) => return Some((lease, sent)),
                            Err(LockError::AlreadyExists) => {
                                debug!(lease = %self.config.lease_name, "another replica created the Lease first");
                                continue;
                            }
                            Err(error) => {
                                failures += 1;
                                warn!(%error, lease = %self.config.lease_name, identity = %self.config.identity, "creating the Lease failed");
                            }
                        }
                    }
                    Err(error) => {
                        failures += 1;
                        warn!(%error, lease = %self.config.lease_name, identity = %self.config.identity, failures, "reading the Lease failed");
                    }
                }
            }
            if !need_get
                && observed.lease.is_none()
                && observed.record.is_some()
                && self.expiry(observed).is_none_or(|at| self.now() >= at)
            {
                // The Lease was deleted and its last holder's term has run out: create it.
                need_get = true;
                continue;
            }
            if !need_get
                && observed.lease.is_some()
                && self.expiry(observed).is_none_or(|at| self.now() >= at)
            {
                let record = self.takeover_record(observed);
                let Some(current) = observed.lease.clone() else {
                    continue;
                };
                let sent = Sent::now(self);
                match self.lock.update(&current, &record, timeout).await {
                    Ok(lease) => return Some((lease, sent)),
                    Err(LockError::Conflict) => {
                        debug!(lease = %self.config.lease_name, "lost the race for the Lease; re-reading");
                        need_get = true;
                        continue;
                    }
                    Err(error) => {
                        failures += 1;
                        need_get = true;
                        warn!(%error, lease = %self.config.lease_name, identity = %self.config.identity, "acquiring the Lease failed");
                    }
                }
            }
            // Open (or reopen) the watch when it is down and due.
            if !self.config.poll_only
                && watch.is_none()
                && Instant::now() >= watch_retry_at
                && !need_get
            {
                match self.open_watch(observed).await {
                    Ok(stream) => {
                        watch = Some(stream);
                        watch_failures = 0;
                    }
                    Err(error) => {
                        watch_failures += 1;
                        watch_retry_at = Instant::now() + self.backoff(watch_failures);
                        warn!(%error, lease = %self.config.lease_name, identity = %self.config.identity, "watching the Lease failed; polling until it is back");
                    }
                }
            }
            let retry_after_failure = (failures > 0 && need_get).then(|| self.backoff(failures));
            let polling = self.config.poll_only || watch.is_none();
            let expiry = self.expiry(observed);
            let clock = self.clock.0.clone();
            // client-go's followers look at expiry only when they poll; so does poll_only.
            // While a re-read is pending, the retry timer drives the loop, not the expiry.
            let until_expiry = expiry
                .filter(|_| !self.config.poll_only && !need_get)
                .map(|at| at.saturating_duration_since(clock.now()));
            let expiry_sleep = async move {
                match until_expiry {
                    Some(d) => clock.sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            let retry_sleep = async move {
                match retry_after_failure {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            let reopen_at =
                (watch.is_none() && !self.config.poll_only && !need_get).then_some(watch_retry_at);
            let watch_reopen = async move {
                match reopen_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending::<()>().await,
                }
            };
            let next_event = async {
                match watch.as_mut() {
                    Some(stream) => stream.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = token.cancelled() => return None,
                () = expiry_sleep => {}
                () = retry_sleep => {}
                () = tokio::time::sleep_until(poll_at), if polling => {
                    poll_at = Instant::now() + self.poll_interval();
                    need_get = true;
                }
                () = watch_reopen => {}
                event = next_event => match event {
                    Some(Ok(WatchEvent::Added(lease) | WatchEvent::Modified(lease))) => {
                        self.observe(observed, lease, callbacks);
                    }
                    Some(Ok(WatchEvent::Deleted(_))) => {
                        // Deleting the Lease does not end its holder's term: that replica may
                        // act until its observed expiry (and will recreate the Lease on its next
                        // renew). Only a vacant, own or expired record is recreated at once.
                        debug!(lease = %self.config.lease_name, "the Lease was deleted");
                        observed.lease = None;
                        observed.resume = None;
                        need_get = self.expiry(observed).is_none_or(|at| self.now() >= at);
                    }
                    Some(Ok(WatchEvent::Bookmark(bookmark))) => {
                        // A fresher resume point for the watch; the Lease's own
                        // resourceVersion (what a takeover PUTs with) is unchanged.
                        observed.resume = Some(bookmark.metadata.resource_version);
                    }
                    Some(Ok(WatchEvent::Error(status))) => {
                        // 410 Expired is routine (history compacted); anything else is worth a look.
                        if status.code == 410 {
                            debug!(code = status.code, message = %status.message, "Lease watch expired; re-reading");
                        } else {
                            warn!(code = status.code, reason = %status.reason, message = %status.message, "Lease watch ended with an error; re-reading");
                        }
                        watch = None;
                        need_get = true;
                    }
                    Some(Err(error)) => {
                        warn!(%error, lease = %self.config.lease_name, "Lease watch broke; polling until it is back");
                        watch = None;
                        watch_failures += 1;
                        watch_retry_at = Instant::now() + self.backoff(watch_failures);
                        poll_at = Instant::now() + self.poll_interval();
                    }
                    None => {
                        // A normal end (the server's timeout): reopen from where it stopped.
                        watch = None;
                        watch_retry_at = Instant::now();
                    }
                },
            }
        }
    }

    /// Leads until the term ends; returns why.
    async fn lead(
        &mut self,
        token: &CancellationToken,
        callbacks: &Callbacks,
        lease: Lease,
        sent: Sent,
        observed: &mut Observed,
    ) -> StopReason {
        let identity = self.config.identity.clone();
        // The term, and its renew deadline, count from when the acquiring write was sent: a slow
        // answer or a slow callback must not lengthen the first deadline.
        let started = sent.tokio;
        info!(%identity, lease = %self.config.lease_name, "started leading");
        self.observe(observed, lease.clone(), callbacks);
        self.state.send_modify(|s| {
            s.holder = Some(identity.clone());
            s.is_leader = true;
            s.leader_since = Some(started);
            s.last_renew = Some(started);
            s.terms += 1;
        });
        // Subscribed before the work starts, so a resignation it makes at once is seen; a
        // request made before this term does not end it.
        let mut resign = self.resign.subscribe();
        resign.borrow_and_update();
        let work = Work::start(token, callbacks);
        let mut cached = lease;
        let reason = self
            .renew_loop(token, &mut cached, sent.clock, resign)
            .await;
        info!(%identity, %reason, "stepping down: stopping the leader's work");
        self.state.send_modify(|s| {
            s.is_leader = false;
            s.last_stop = Some(reason);
            if reason != StopReason::LeaseTaken {
                s.holder = None;
            }
        });
        work.stop(self.config.work_stop_timeout).await;
        let release_on_shutdown = reason == StopReason::GracefulShutdown
            && self.config.release_on_cancel
            && !self.config.keep_lease_on_stop;
        if release_on_shutdown || reason == StopReason::Resigned {
            self.release(&cached).await;
        }
        // Whatever happened, the next follower phase starts from a fresh read.
        observed.lease = None;
        observed.record = None;
        observed.reported = None;
        if let Some(f) = &callbacks.stopped {
            f(reason);
        }
        reason
    }

    /// Renews until the term ends. The renew deadline runs from the send time of the last
    /// successful write (the acquisition, then each renew): followers saw that write no earlier
    /// than it was sent, so stepping down at `last success + RenewDeadline` is before any of them
    /// can judge the Lease expired at `observed + LeaseDuration`, even on a clock running up to
    /// LeaseDuration / RenewDeadline times as fast.
    async fn renew_loop(
        &mut self,
        token: &CancellationToken,
        cached: &mut Lease,
        acquired: Instant,
        mut resign: watch::Receiver<u64>,
    ) -> StopReason {
        let mut last_success = acquired;
        let mut failures = 0u32;
        let mut immediate = false;
        loop {
            let deadline = last_success + self.config.renew_deadline;
            let wait = if immediate {
                Duration::ZERO
            } else if failures > 0 {
                self.backoff(failures)
            } else {
                self.jitter(self.config.retry_period)
            };
            immediate = false;
            let wait = wait.min(deadline.saturating_duration_since(self.now()));
            let clock = self.clock.0.clone();
            tokio::select! {
                () = token.cancelled() => return StopReason::GracefulShutdown,
                changed = resign.changed() => if changed.is_ok() { return StopReason::Resigned },
                () = clock.sleep(wait) => {}
            }
            let sent = self.now();
            if sent >= deadline {
                warn!(identity = %self.config.identity, deadline = ?self.config.renew_deadline, failures, "no renew succeeded within the renew deadline; stepping down");
                return StopReason::LeaseExpired;
            }
            let timeout = self
                .config
                .request_timeout
                .min(deadline.saturating_duration_since(sent));
            let mut record = Record::of(cached);
            record.holder = self.config.identity.clone();
            record.duration_secs = self.config.lease_duration_seconds();
            record.renew = Some(now_micros());
            let sent_at = Instant::now();
            // Not raced with the token: the request is bounded by its timeout, and a renew that
            // succeeded must update the cache, or the release would carry a stale version.
            let result = self.lock.update(cached, &record, timeout).await;
            match result {
                Ok(lease) => {
                    *cached = lease;
                    last_success = sent;
                    failures = 0;
                    self.state.send_modify(|s| s.last_renew = Some(sent_at));
                    continue;
                }
                Err(error) if error.needs_reread() => {
                    // Something else wrote the Lease (another holder, or an annotation such as
                    // the fencing epoch), or it was deleted and recreated under us (our cached
                    // object no longer fits: 404 or 422): read it and decide.
                    debug!(%error, identity = %self.config.identity, "renew refused; re-reading the Lease");
                    let timeout = self
                        .config
                        .request_timeout
                        .min(deadline.saturating_duration_since(self.now()));
                    match self.lock.get(timeout).await {
                        Ok(Some(lease)) => {
                            let holder = Record::of(&lease).holder;
                            if holder != self.config.identity {
                                warn!(identity = %self.config.identity, new_holder = %holder, "the Lease was taken by another replica");
                                self.state.send_modify(|s| {
                                    s.holder = (!holder.is_empty()).then_some(holder)
                                });
                                return StopReason::LeaseTaken;
                            }
                            *cached = lease;
                            immediate = true;
                        }
                        Ok(None) => {
                            // Deleted under us: a PUT creates it again (create-on-update).
                            cached.metadata.resource_version = None;
                            cached.metadata.uid = None;
                            immediate = true;
                        }
                        Err(error) => {
                            failures += 1;
                            warn!(%error, identity = %self.config.identity, "reading the Lease after a conflict failed");
                        }
                    }
                }
                Err(error) => {
                    failures += 1;
                    warn!(%error, identity = %self.config.identity, lease = %self.config.lease_name, failures, "renewing the Lease failed");
                }
            }
        }
    }

    /// Writes holder empty and `leaseDurationSeconds: 1`, so a follower takes over at once.
    async fn release(&self, cached: &Lease) {
        match release_from(
            &self.lock,
            cached,
            &self.config.identity,
            self.config.request_timeout,
        )
        .await
        {
            Ok(true) => {
                info!(identity = %self.config.identity, lease = %self.config.lease_name, "released the Lease")
            }
            Ok(false) => {
                debug!(identity = %self.config.identity, "the Lease had another holder; nothing to release")
            }
            Err(error) => {
                warn!(%error, identity = %self.config.identity, "releasing the Lease failed; followers take it when it expires")
            }
        }
    }
}

async fn release_from(
    lock: &LeaseLock,
    cached: &Lease,
    identity: &str,
    timeout: Duration,
) -> Result<bool, LockError> {
    let mut current = cached.clone();
    for _ in 0..3 {
        let old = Record::of(&current);
        if old.holder != identity {
            return Ok(false);
        }
        let now = now_micros();
        let record = Record {
            holder: String::new(),
            duration_secs: 1,
            acquire: Some(now),
            renew: Some(now),
            transitions: old.transitions,
        };
        match lock.update(&current, &record, timeout).await {
            Ok(_) => return Ok(true),
            Err(LockError::Conflict) => match lock.get(timeout).await? {
                Some(lease) => current = lease,
                None => return Ok(false),
            },
            Err(error) => return Err(error),
        }
    }
    Err(LockError::Conflict)
}

/// Releases a Lease this identity holds (holder empty, `leaseDurationSeconds: 1`), e.g. after an
/// elector ran with `keep_lease_on_stop` and no successor will resume it. Returns whether it
/// was held by `identity` and released.
pub async fn release_lease(
    client: Client,
    namespace: &str,
    name: &str,
    identity: &str,
    timeout: Duration,
) -> Result<bool> {
    let lock = LeaseLock {
        api: Api::namespaced(client, namespace),
        name: name.to_owned(),
    };
    let Some(lease) = lock
        .get(timeout)
        .await
        .map_err(|e| Error::Request(e.to_string()))?
    else {
        return Ok(false);
    };
    release_from(&lock, &lease, identity, timeout)
        .await
        .map_err(|e| Error::Request(e.to_string()))
}
