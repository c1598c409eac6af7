//! The apply engine: fence, no-op check, staging, `haproxy -c`, atomic swap, reload with
//! confirmation, and rollback to the last-known-good set. One apply at a time.

use std::{
    path::Path,
    sync::{Arc, Mutex as StdMutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use haptic_agent_client::{
    AgentState, ApplyRequest, ApplyResponse, DeltaRequest, FileSet, Form, Roles, Timing,
    protocol::{MAIN_CONFIG, MAX_FENCE_STEP, MAX_VIOLATIONS, ReloadRecord},
};
use tokio::{sync::Mutex, time::Instant};
use tracing::{info, instrument, warn};

use crate::{
    config::AgentConfig,
    fence::{Fence, FenceFile},
    haproxy::{self, Haproxy, ProcTable, ReloadOutcome, RunAs},
    metrics::Metrics,
    runtime,
    store::{CURRENT, LAST_KNOWN_GOOD, SetMeta, SetStore, Stamps},
    supervisor::Supervisor,
};

/// Errors of this module: why an apply was not carried out, beyond the protocol's outcomes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::Error),
    /// The agent cannot apply safely now (corrupt fence file); it reports not ready.
    #[error("not ready: {0}")]
    NotReady(String),
    /// The data directory could not be read or written.
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    /// The fence could not be recorded.
    #[error(transparent)]
    Fence(#[from] crate::fence::Error),
    /// HAProxy could not be run.
    #[error(transparent)]
    Haproxy(#[from] haproxy::Error),
    /// A blocking task panicked or was cancelled.
    #[error("internal task failed: {0}")]
    Task(String),
    /// The request is malformed (its checksum is in neither form, or does not
    /// match its files); nothing was written.
    #[error("bad request: {0}")]
    BadRequest(String),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Default)]
struct Status {
    last_reload: Option<ReloadRecord>,
    haproxy_version: Option<String>,
}

struct Shared {
    config: AgentConfig,
    store: SetStore,
    fence: FenceFile,
    haproxy: Haproxy,
    supervisor: Option<Supervisor>,
    metrics: Metrics,
    journal: crate::journal::Journal,
    apply_lock: Mutex<()>,
    status: StdMutex<Status>,
    /// Set while a reload whose outcome was not seen in time may still be going on in
    /// HAProxy (`show proc` from before it): the agent is not ready and takes no apply.
    unsettled: StdMutex<Option<ProcTable>>,
    /// Checksum of the set HAProxy was last confirmed to have loaded (by this process: none
    /// after a restart until a load is confirmed). `unchanged` needs it to match.
    loaded: StdMutex<Option<String>>,
    /// What HAProxy's current worker loaded, as runtime applies listed it.
    listings: runtime::Listings,
    /// The live set and the one before it, in memory (newest first, at most [`HELD_SETS`]):
    /// an apply compares with and builds on the live set without reading it from disk.
    held: StdMutex<Vec<Arc<HeldSet>>>,
    /// The last readiness probe and when it ran.
    ready: Mutex<Option<(Instant, Result<(), String>)>>,
    /// Bodies being inflated and parsed at once: one per core, so that concurrent gzip
    /// bodies cannot take every blocking thread and all memory at once.
    decode: tokio::sync::Semaphore,
    /// The removal of sets no longer kept, left running after a runtime apply's answer (on
    /// a set with 2,500 files of its own it took up to a second here). Owned by the agent:
    /// the next apply that writes a set waits for it first, so the two never race.
    cleanup: StdMutex<Option<tokio::task::JoinHandle<()>>>,
}

/// How many complete sets the agent keeps in memory: the live one and last-known-good.
const HELD_SETS: usize = 2;

/// A complete set the agent holds in memory. A complete set's files are never modified, so
/// its name (unique per write) stands for its content. Read from disk once (at start, or after
/// a rollback to a set no longer held), or kept from the apply that wrote it.
#[derive(Debug)]
struct HeldSet {
    /// Its name in the store.
    name: String,
    /// The checksum of its files (as verified: sent and checked, or recomputed from disk).
    checksum: String,
    files: FileSet,
    /// The roles `haproxy.cfg` gives its files, when the set passes the policy: a delta may
    /// build on it then, and is checked by what it changes. None: not a base for deltas.
    roles: Option<Roles>,
    /// Its files' stamps on disk, taken when the agent wrote, linked or read them: what lets
    /// an apply of this very set (a new leader's claim) vouch for the files on disk without
    /// reading them again. None when they could not be taken: the set is read instead.
    stamps: Option<Stamps>,
}

/// How long a readiness probe's answer is served from the cache.
pub const READY_TTL: Duration = Duration::from_secs(1);

/// How a runtime attempt ended.
enum Runtime {
    /// Applied with no reload: the answer.
    Applied(ApplyResponse),
    /// Not a runtime change; nothing was sent to HAProxy.
    Skipped,
    /// Runtime commands were sent and failed or did not verify: the reload path must run.
    Failed {
        /// Changing commands sent.
        ops: u64,
        /// Time spent on them.
        took: Duration,
    },
}

/// Where the runtime path's write of the set went, in microseconds (logged with its answer).
/// Staging and its fsyncs run beside the runtime commands; the rest after them.
#[derive(Debug, Default)]
struct WritePhases {
    /// The staging directory: changed files written, the others hard-linked.
    stage_us: u64,
    /// The fsyncs of the changed files and of the directories.
    sync_us: u64,
    /// The rename into `sets/` and the metadata written.
    promote_us: u64,
    /// `last-known-good` and `current` swapped.
    links_us: u64,
    /// The new set's stamps.
    stamps_us: u64,
}

/// A set just made `current`, to be loaded.
struct Swapped {
    checksum: String,
    generation: u64,
    /// The set's name in the store.
    name: String,
    /// The set to restore when it fails to load.
    previous: Option<String>,
}

/// The agent: cheap to clone, clones share everything.
#[derive(Clone)]
pub struct Agent {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("config", &self.shared.config)
            .finish()
    }
}

async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| Error::Task(error.to_string()))
}

/// The checksum names files on disk: it must be exactly what [`FileSet::checksum`] produces.
///
/// [`FileSet::checksum`]: haptic_agent_client::FileSet::checksum
fn check_request(request: ApplyRequest) -> Result<ApplyRequest> {
    let Some(form) = Form::of(&request.checksum) else {
        return Err(Error::BadRequest(format!(
            "checksum {:?} is not 64 lowercase hex digits (after `v2-` in the second form)",
            request.checksum.chars().take(80).collect::<String>()
        )));
    };
    request
        .files
        .validate()
        .map_err(|error| Error::BadRequest(error.to_string()))?;
    haptic_agent_client::protocol::validate_leader(&request.leader)
        .map_err(|error| Error::BadRequest(error.to_string()))?;
    let actual = request.files.checksum_as(form);
    if actual != request.checksum {
        return Err(Error::BadRequest(format!(
            "checksum mismatch: request says {}, files hash to {actual}",
            request.checksum
        )));
    }
    Ok(request)
}

/// Creates `dir` (0700) for HAProxy's master socket, owned by the user HAProxy runs as.
fn prepare_socket_dir(dir: &Path, user: RunAs) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let failed = |source: std::io::Error| crate::store::Error::Io {
        action: "preparing the master socket directory",
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(failed)?;
    std::os::unix::fs::chown(dir, Some(user.uid), Some(user.gid)).map_err(failed)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(failed)?;
    Ok(())
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

impl Agent {
    /// Opens the data directory (creating it), finds HAProxy, and reads the fence. A corrupt
    /// fence does not fail this: the agent starts and reports not ready.
    pub async fn open(mut config: AgentConfig) -> Result<Self> {
        config.validate()?;
        if let Some(found) = haproxy::find_binary(&config.haproxy_bin) {
            config.haproxy_bin = found;
        }
        let root = config.data_dir.clone();
        let run_as = config.haproxy_user;
        let socket_dir = config.master_socket.parent().map(Path::to_path_buf);
        let store = blocking(move || -> Result<SetStore> {
            let store = SetStore::open_shared(&root, run_as.map(|user| user.gid))?;
            // HAProxy creates its master socket: as another user, in a directory it owns.
            if let (Some(user), Some(dir)) = (run_as, socket_dir)
                && dir.starts_with(&root)
                && dir != root
            {
                prepare_socket_dir(&dir, user)?;
            }
            Ok(store)
        })
        .await??;
        let fence = FenceFile::new(config.data_dir.join("fence"));
        let haproxy = Haproxy::new(
            config.haproxy_bin.clone(),
            config.master_socket.clone(),
            config.haproxy_user,
        );
        let supervisor = config.supervise.then(|| {
            Supervisor::new(haproxy.clone(), store.current_path(), config.reload_timeout)
                .with_pidfile(config.data_dir.join("haproxy-master.pid"))
        });
        let meter = config
            .meter
            .clone()
            .unwrap_or_else(|| opentelemetry::global::meter("haptic-agent"));
        let metrics = Metrics::new(&meter, {
            let haproxy = haproxy.clone();
            Some(Arc::new(move || haproxy.cli_connections()))
        });
        match fence.load() {
            Ok(value) => metrics.set_fence(value),
            Err(error) => warn!(%error, "fence unreadable; refusing applies until it is repaired"),
        }
        let version = haproxy
            .version(config.check_timeout.min(Duration::from_secs(10)))
            .await
            .ok();
        let agent = Self {
            shared: Arc::new(Shared {
                journal: crate::journal::Journal::open(&config.data_dir),
                config,
                store,
                fence,
                haproxy,
                supervisor,
                metrics,
                apply_lock: Mutex::new(()),
                status: StdMutex::new(Status {
                    last_reload: None,
                    haproxy_version: version,
                }),
                unsettled: StdMutex::new(None),
                loaded: StdMutex::new(None),
                listings: runtime::Listings::default(),
                held: StdMutex::new(Vec::new()),
                cleanup: StdMutex::new(None),
                ready: Mutex::new(None),
                decode: tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(1, usize::from),
                ),
            }),
        };
        if let Some(meta) = agent.live_meta() {
            agent.shared.metrics.set_generation(meta.generation);
        }
        // The live set, into memory: verified against disk (its checksum recomputed from the
        // files and compared with the one recorded) and against the policy, once.
        match agent.live_set().await {
            Ok(Some(live)) => info!(
                set = %live.name,
                checksum = %live.checksum,
                files = live.files.len(),
                delta_base = live.roles.is_some(),
                "live set held in memory"
            ),
            Ok(None) => {}
            Err(error) => {
                warn!(%error, "the live set could not be read; the next apply sends it whole")
            }
        }
        Ok(agent)
    }

    /// The set held in memory under `name`, if any.
    fn held(&self, name: &str) -> Option<Arc<HeldSet>> {
        let held = self.shared.held.lock().ok()?;
        held.iter().find(|set| set.name == name).cloned()
    }

    /// Keeps `set` in memory as the newest, dropping the oldest beyond [`HELD_SETS`].
    fn hold(&self, set: HeldSet) -> Arc<HeldSet> {
        let set = Arc::new(set);
        if let Ok(mut held) = self.shared.held.lock() {
            held.retain(|other| other.name != set.name);
            held.insert(0, set.clone());
            held.truncate(HELD_SETS);
        }
        set
    }

    /// Removes the sets other than `keep` after the answer ([`Shared::cleanup`]).
    fn clean_up_later(&self, keep: Vec<String>) {
        let store = self.shared.store.clone();
        let task = tokio::task::spawn_blocking(move || {
            let keep: Vec<&str> = keep.iter().map(String::as_str).collect();
            if let Err(error) = store.retain(&keep) {
                warn!(%error, "removing old sets failed");
            }
        });
        if let Ok(mut cleanup) = self.shared.cleanup.lock() {
            // The one before, if any, was waited for by this apply's write.
            *cleanup = Some(task);
        }
    }

    /// Waits for a removal of old sets still running, before a set is written.
    async fn cleaned_up(&self) {
        let pending = self
            .shared
            .cleanup
            .lock()
            .ok()
            .and_then(|mut cleanup| cleanup.take());
        if let Some(task) = pending
            && let Err(error) = task.await
        {
            warn!(%error, "removing old sets panicked");
        }
    }

    /// Drops set `name` from memory: the next use reads it from disk.
    fn forget(&self, name: &str) {
        if let Ok(mut held) = self.shared.held.lock() {
            held.retain(|set| set.name != name);
        }
    }

    /// The live set read from disk again (and held so), whatever memory held.
    async fn live_set_from_disk(&self) -> Result<Option<Arc<HeldSet>>> {
        if let Some(name) = self.shared.store.link(CURRENT)? {
            self.forget(&name);
        }
        self.live_set().await
    }

    /// Whether held set `set` is on disk as memory holds it: every file's stamp checked, and
    /// only a file whose stamp moved read and compared (a few milliseconds for 2,500 files,
    /// against reading and hashing all of them). False without stamps.
    async fn on_disk_as_held(&self, set: &Arc<HeldSet>) -> Result<bool> {
        if set.stamps.is_none() {
            return Ok(false);
        }
        let store = self.shared.store.clone();
        let set = set.clone();
        blocking(move || {
            set.stamps
                .as_ref()
                .is_some_and(|stamps| store.matches(&set.name, &set.files, stamps))
        })
        .await
    }

    /// The live set (`current`), from memory, or read from disk (and verified: its checksum
    /// is recomputed from its files, and the policy checks it) when memory does not hold it.
    async fn live_set(&self) -> Result<Option<Arc<HeldSet>>> {
        let Some(name) = self.shared.store.link(CURRENT)? else {
            return Ok(None);
        };
        if let Some(held) = self.held(&name) {
            return Ok(Some(held));
        }
        let store = self.shared.store.clone();
        let policy = self.shared.config.policy.clone();
        let read_name = name.clone();
        self.shared.metrics.count_live_set_read();
        let set = blocking(move || -> Result<HeldSet> {
            let (files, stamps) = store.read_set_stamped(&read_name)?;
            let checksum = files.checksum_as(store.checksum_form(&read_name));
            let recorded = store.meta(&read_name).map(|meta| meta.checksum);
            if recorded.as_deref() != Some(checksum.as_str()) {
                warn!(set = %read_name, ?recorded, on_disk = %checksum, "the live set's files do not hash to the checksum recorded for it");
            }
            let (violations, roles) = policy.violations_and_roles(&files);
            if let Some(first) = violations.first() {
                warn!(set = %read_name, %first, "the live set breaks the config policy; it is no base for deltas");
            }
            Ok(HeldSet {
                name: read_name,
                checksum,
                files,
                roles: violations.is_empty().then_some(roles),
                stamps: Some(stamps),
            })
        })
        .await??;
        Ok(Some(self.hold(set)))
    }

    /// The settings in use.
    pub fn config(&self) -> &AgentConfig {
        &self.shared.config
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The bound on bodies decoded at once (one per core).
    pub(crate) fn decode_slots(&self) -> &tokio::sync::Semaphore {
        &self.shared.decode
    }

    /// The record of the applies answered.
    pub fn journal(&self) -> &crate::journal::Journal {
        &self.shared.journal
    }

    /// HAProxy as the agent drives it (its master CLI use among others).
    pub fn haproxy(&self) -> &Haproxy {
        &self.shared.haproxy
    }

    /// The supervisor, in supervised mode.
    pub fn supervisor(&self) -> Option<&Supervisor> {
        self.shared.supervisor.as_ref()
    }

    fn live_meta(&self) -> Option<SetMeta> {
        let name = self.shared.store.link(CURRENT).ok()??;
        self.shared.store.meta(&name)
    }

    /// Applies a whole set. Runs to completion even when the caller stops waiting (the work
    /// happens in its own task), so a dropped connection never leaves a half-done swap.
    ///
    /// The request's checksum must be in either form and match its files (as the
    /// HTTP API checks; a library caller is held to the same rule): otherwise
    /// [`Error::BadRequest`] and nothing is written.
    pub async fn apply(&self, request: ApplyRequest) -> Result<ApplyResponse> {
        let pending = crate::journal::Pending::of(&request);
        let agent = self.clone();
        let started = Instant::now();
        let result = tokio::spawn(async move {
            let _in_flight = agent.shared.metrics.apply_started();
            let policy = agent.shared.config.policy.clone();
            let (request, (violations, roles)) = blocking(move || {
                check_request(request).map(|request| {
                    let checked = policy.violations_and_roles(&request.files);
                    (request, checked)
                })
            })
            .await??;
            // A set that breaks the policy is refused before the fence, staging or
            // `haproxy -c` see it: a Lua file runs during the check already.
            if !violations.is_empty() {
                info!(
                    checksum = %request.checksum,
                    violations = violations.len(),
                    first = %violations[0],
                    "refused by the config policy"
                );
                let more = violations.len().saturating_sub(MAX_VIOLATIONS);
                let mut violations = violations;
                violations.truncate(MAX_VIOLATIONS);
                return Ok(ApplyResponse::RefusedByPolicy {
                    checksum: request.checksum,
                    violations,
                    more,
                });
            }
            agent.apply_serialized(request, roles).await
        })
        .await
        .map_err(|error| Error::Task(error.to_string()))
        .and_then(|result| result);
        self.answered(pending, &result, started).await;
        result
    }

    /// Applies a delta: the whole set it makes of the live set, as [`Agent::apply`] would
    /// apply that set, with the policy checking only what the delta changes. When the live
    /// set is not the delta's base (or is none, or broke the policy when it was read from
    /// disk), answers `base_mismatch` and writes nothing, unless the live set is already the
    /// one the delta makes (a delta sent again): that is applied as the whole set. A delta that does not make a set
    /// hashing to its checksum is [`Error::BadRequest`]; nothing is written.
    pub async fn apply_delta(&self, delta: DeltaRequest) -> Result<ApplyResponse> {
        let pending = crate::journal::Pending::of_delta(&delta);
        let agent = self.clone();
        let started = Instant::now();
        let result = tokio::spawn(async move {
            let _in_flight = agent.shared.metrics.apply_started();
            haptic_agent_client::protocol::validate_leader(&delta.leader)
                .map_err(|error| Error::BadRequest(error.to_string()))?;
            let live = agent.live_set().await?;
            let base = match live {
                // A delta re-sent after it was applied (a retry whose first answer was lost),
                // or a new leader's first apply of the set it found live (no paths: it claims
                // the agent with its epoch and re-sends nothing), names the set live now: that
                // set, whose fence and generation rules follow.
                Some(live) if live.checksum == delta.checksum && live.roles.is_some() => {
                    agent.shared.metrics.count_delta();
                    let roles = live.roles.clone().unwrap_or_default();
                    let request = delta.into_request(live.files.clone());
                    return agent.apply_serialized(request, roles).await;
                }
                Some(live) if live.checksum == delta.base && live.roles.is_some() => live,
                other => {
                    info!(base = %delta.base, live = ?other.as_ref().map(|live| &live.checksum), "delta refused: its base is not the live set");
                    return Ok(ApplyResponse::BaseMismatch {
                        base: delta.base,
                        live_checksum: other.map(|live| live.checksum.clone()),
                    });
                }
            };
            agent.shared.metrics.count_delta();
            let policy = agent.shared.config.policy.clone();
            let (request, (violations, roles), changed) = blocking(move || -> Result<_> {
                let files = delta
                    .apply_to(&base.files)
                    .map_err(|error| Error::BadRequest(error.to_string()))?;
                let config_hunks = delta.patches.get(MAIN_CONFIG).and_then(|hunks| {
                    let old = base.files.get(MAIN_CONFIG)?;
                    Some((old.as_ref(), hunks.as_slice()))
                });
                let checked = policy.violations_of_change(
                    &files,
                    delta.changed(),
                    base.roles.as_ref().unwrap_or(&Roles::default()),
                    config_hunks,
                );
                // What the delta changed, for the runtime plan (which reads only that).
                let changed = runtime::Changed {
                    base: delta.base.clone(),
                    paths: delta.changed().map(str::to_owned).collect(),
                    removed: delta.removed.iter().cloned().collect(),
                    config_hunks: delta.patches.get(MAIN_CONFIG).cloned(),
                };
                Ok((delta.into_request(files), checked, changed))
            })
            .await??;
            if !violations.is_empty() {
                info!(
                    checksum = %request.checksum,
                    violations = violations.len(),
                    first = %violations[0],
                    "delta refused by the config policy"
                );
                let more = violations.len().saturating_sub(MAX_VIOLATIONS);
                let mut violations = violations;
                violations.truncate(MAX_VIOLATIONS);
                return Ok(ApplyResponse::RefusedByPolicy {
                    checksum: request.checksum,
                    violations,
                    more,
                });
            }
            agent
                .apply_serialized_changed(request, roles, Some(changed))
                .await
        })
        .await
        .map_err(|error| Error::Task(error.to_string()))
        .and_then(|result| result);
        self.answered(pending, &result, started).await;
        result
    }

    /// Journal, readiness and metrics after an apply was answered.
    async fn answered(
        &self,
        pending: crate::journal::Pending,
        result: &Result<ApplyResponse>,
        started: Instant,
    ) {
        self.shared
            .journal
            .record(pending, result, Some(started.elapsed()))
            .await;
        self.forget_readiness().await;
        let metrics = &self.shared.metrics;
        metrics.observe_apply(started.elapsed());
        match result {
            Ok(response) => metrics.count_apply(response.outcome()),
            Err(_) => metrics.count_apply("error"),
        }
    }

    async fn apply_serialized(&self, request: ApplyRequest, roles: Roles) -> Result<ApplyResponse> {
        self.apply_serialized_changed(request, roles, None).await
    }

    /// [`Agent::apply_serialized`], with what a delta changed (`changed`) for the runtime plan.
    // The leader is a validated pod name; `?` escapes it in the log all the same.
    #[instrument(skip_all, fields(epoch = request.epoch, leader = ?request.leader, generation = request.generation, checksum = %request.checksum))]
    async fn apply_serialized_changed(
        &self,
        request: ApplyRequest,
        roles: Roles,
        changed: Option<runtime::Changed>,
    ) -> Result<ApplyResponse> {
        let shared = &self.shared;
        // While an apply waits for HAProxy to finish a reload whose outcome is unknown, others
        // are answered 503 at once rather than queued behind it.
        let _one_at_a_time = if self.unsettled().is_some() {
            shared.apply_lock.try_lock().map_err(|_| {
                Error::NotReady("HAProxy is still finishing a reload; retry later".to_owned())
            })?
        } else {
            // Behind another apply (a second leader's, a retry) for at most `lock_timeout`:
            // the whole apply stays within `apply_time_limit`, and the client retries a 503.
            tokio::time::timeout(shared.config.lock_timeout, shared.apply_lock.lock())
                .await
                .map_err(|_| {
                    Error::NotReady(format!(
                        "another apply has been in progress for over {:?}; retry later",
                        shared.config.lock_timeout
                    ))
                })?
        };
        let started = Instant::now();
        if let Some(before) = self.unsettled() {
            self.resettle(&before).await?;
        }

        // The fence first: a lower epoch, or the same epoch from another leader identity, is
        // refused before anything is written; a higher one (or the first identity seen at
        // this epoch) is durable before the agent acts on it.
        let fence = shared.fence.clone();
        let current = blocking(move || fence.load_fence())
            .await?
            .map_err(|error| Error::NotReady(error.to_string()))?;
        let foreign = request.epoch == current.epoch
            && current
                .leader
                .as_ref()
                .is_some_and(|holder| *holder != request.leader);
        if request.epoch < current.epoch || foreign {
            info!(fence = current.epoch, holder = ?current.leader, "refused: epoch below the fence, or held by another leader");
            return Ok(ApplyResponse::Fenced {
                fence: current.epoch,
                epoch: request.epoch,
            });
        }
        if request.epoch - current.epoch > MAX_FENCE_STEP {
            warn!(
                fence = current.epoch,
                "refused: epoch too far above the fence"
            );
            return Err(Error::BadRequest(format!(
                "epoch {} is more than 2^32 above the agent's fence {}: one apply may raise the \
                 fence by at most {MAX_FENCE_STEP} (a corrupt epoch counter or a hostile sender \
                 would otherwise lock every leader out for good)",
                request.epoch, current.epoch
            )));
        }
        if request.epoch > current.epoch || current.leader.is_none() {
            let fence = shared.fence.clone();
            let record = Fence {
                epoch: request.epoch,
                leader: Some(request.leader.clone()),
            };
            blocking(move || fence.store_fence(&record)).await??;
            shared.metrics.set_fence(request.epoch);
            info!(from = current.epoch, to = request.epoch, "fence raised");
        }

        // Within one epoch, generations only move forward: an older one than the live set's is
        // stale (a delayed or re-sent request) and must not overwrite it.
        if let Some(live) = self.live_meta()
            && live.epoch == request.epoch
            && request.generation < live.generation
        {
            info!(
                live_generation = live.generation,
                "refused: an older generation than the live set's"
            );
            return Ok(ApplyResponse::Superseded {
                generation: request.generation,
                live_generation: live.generation,
                epoch: request.epoch,
            });
        }

        // The live set: its checksum, and its files for a runtime apply (from memory; read
        // from disk and verified only when memory does not hold it).
        let mut held = self.live_set().await?;
        if let Some(set) = held
            .as_ref()
            .filter(|held| held.checksum == request.checksum)
            && !self.on_disk_as_held(set).await?
        {
            // `unchanged` only for files that are on disk as they were written: re-sending the
            // set is how the leader repairs a set changed on disk (drift). Files whose stamps
            // still match are as written; when one is not (or a stamp is missing), the live
            // set is read and hashed again, and the request compared with what is on disk.
            held = self.live_set_from_disk().await?;
        }
        let live = held.map(|held| (held.name.clone(), held.checksum.clone(), held.files.clone()));
        let running = match &shared.supervisor {
            Some(supervisor) => supervisor.is_running().await,
            None => true,
        };
        if let Some((name, checksum, _)) = &live
            && *checksum == request.checksum
        {
            if running && self.loaded().as_deref() == Some(checksum.as_str()) {
                let generation = self.raise_generation(name, &request).await?;
                return Ok(ApplyResponse::Unchanged {
                    checksum: checksum.clone(),
                    generation,
                    timing: Timing {
                        total_us: micros(started.elapsed()),
                        ..Timing::default()
                    },
                });
            }
            // The set is `current` on disk, but HAProxy was never confirmed to run it (a
            // crash between the swap and the reload, a failed start): load it now, with the
            // same rollback as a new set.
            info!("the requested set is current on disk but not confirmed loaded; loading it");
            let previous = shared
                .store
                .link(LAST_KNOWN_GOOD)?
                .filter(|previous| previous != name);
            let swapped = Swapped {
                checksum: request.checksum,
                generation: request.generation,
                name: name.clone(),
                previous,
            };
            return self
                .finish_load(swapped, Timing::default(), started, Instant::now())
                .await;
        }
        // Hitless: a set that differs from the live one (confirmed loaded, so HAProxy runs
        // exactly it) only in what the runtime API changes is applied to the running worker.
        // Anything else, or a runtime change that fails, takes the reload path below, which
        // loads the whole set from disk whatever the runtime commands did.
        let mut runtime = None;
        if let Some((name, checksum, files)) = &live
            && shared.config.runtime_updates
            && running
            && self.loaded().as_deref() == Some(checksum.as_str())
        {
            let changed = changed.map(|changed| (checksum.clone(), changed));
            match self
                .apply_at_runtime(name, files, &request, &roles, started, changed)
                .await?
            {
                Runtime::Applied(response) => return Ok(response),
                Runtime::Skipped => {}
                Runtime::Failed { ops, took } => runtime = Some((ops, took, checksum.clone())),
            }
        }
        let previous = live.map(|(name, _, _)| name);
        let result = self
            .apply_by_reload(request, roles, previous, started)
            .await;
        let Some((ops, took, live_checksum)) = runtime else {
            return result;
        };
        match result {
            Ok(ApplyResponse::Applied {
                checksum,
                generation,
                mut timing,
                reload,
                ..
            }) => {
                timing.runtime_us = micros(took);
                Ok(ApplyResponse::Applied {
                    checksum,
                    generation,
                    timing,
                    reload,
                    runtime_ops: ops,
                })
            }
            // A rollback reloaded the live set: the runtime changes are gone with the old worker.
            rolled_back @ Ok(ApplyResponse::RolledBack { .. }) => rolled_back,
            other => {
                // Refused or failed before any reload: the worker still holds the runtime
                // changes of the failed attempt, so the live set is loaded again.
                warn!(
                    "the runtime attempt changed HAProxy and the set did not load; reloading the live set"
                );
                if let ReloadOutcome::Failed { reason } | ReloadOutcome::Unknown { reason, .. } =
                    self.load_settled(&live_checksum).await
                {
                    warn!(%reason, "reloading the live set after a failed runtime attempt failed");
                }
                other
            }
        }
    }

    /// Applies `request` through HAProxy's runtime API when it differs from the live set
    /// (`live_name`, holding `live`) only in what that API changes, verifies it, and makes it
    /// the live set on disk as a reloaded apply does (staged, fsynced, promoted, `current`
    /// swapped, the previous set kept as last-known-good), with no `haproxy -c` and no reload.
    async fn apply_at_runtime(
        &self,
        live_name: &str,
        live: &FileSet,
        request: &ApplyRequest,
        roles: &Roles,
        started: Instant,
        changed: Option<(String, runtime::Changed)>,
    ) -> Result<Runtime> {
        let shared = &self.shared;
        let phase = Instant::now();
        let (old, new) = (live.clone(), request.files.clone());
        let planned = blocking(move || {
            let plan = match changed {
                Some((live_checksum, changed)) => {
                    runtime::plan_changed(&old, &live_checksum, &new, &changed)
                }
                None => runtime::plan(&old, &new),
            };
            // The very files under the checksum's other form (a controller of the other
            // form now leads): nothing for HAProxy, the set recorded under its new name.
            plan.map(|plan| {
                let same_files = plan.is_empty() && old == new;
                (plan, same_files)
            })
        });
        let plan = match planned.await? {
            Ok((plan, same_files)) if !plan.is_empty() || same_files => plan,
            Ok(_) => return Ok(Runtime::Skipped),
            Err(error) => {
                info!(%error, "not a runtime change");
                return Ok(Runtime::Skipped);
            }
        };
        // The new set is staged and fsynced while the runtime commands go to HAProxy (the
        // staging directory is nobody's until promoted, and the fsync waits on the disk while
        // the commands wait on HAProxy): the answer then waits for the longer of the two, not
        // their sum. Files the plan did not change are linked from the live set.
        let store = shared.store.clone();
        let changed: std::collections::BTreeSet<String> = plan
            .files
            .iter()
            .chain(&plan.added)
            .map(|(path, _)| path.clone())
            .chain((!plan.servers.is_empty()).then(|| MAIN_CONFIG.to_owned()))
            .collect();
        self.cleaned_up().await;
        let staging = {
            let store = store.clone();
            let files = request.files.clone();
            let checksum = request.checksum.clone();
            let base = live_name.to_owned();
            let base_files = live.clone();
            let changed = changed.clone();
            blocking(move || -> Result<(String, WritePhases)> {
                let mut phases = WritePhases::default();
                let phase = Instant::now();
                let linked = |path: &str| !changed.contains(path);
                let staged = store.write_staged_reusing(
                    &files,
                    &checksum,
                    Some((&base, &base_files)),
                    linked,
                )?;
                phases.stage_us = micros(phase.elapsed());
                let phase = Instant::now();
                if let Err(error) = store.sync_staged_reusing(&staged, linked) {
                    let _ = store.discard_staged(&staged.name);
                    return Err(error.into());
                }
                phases.sync_us = micros(phase.elapsed());
                Ok((staged.name, phases))
            })
        };
        let commands = async {
            let applied = runtime::apply(
                &shared.haproxy,
                &plan,
                shared.config.runtime_timeout,
                &shared.listings,
            )
            .await;
            (applied, phase.elapsed())
        };
        let (((ops, applied), took), staged) = tokio::join!(commands, staging);
        let staged = staged.and_then(|staged| staged);
        let write = Instant::now();
        if applied.is_err()
            && let Ok((name, _)) = &staged
        {
            // The reload path stages the set on its own.
            let (store, name) = (store.clone(), name.clone());
            if let Ok(Err(error)) = blocking(move || store.discard_staged(&name)).await {
                warn!(%error, "removing the set staged beside a runtime change that did not apply");
            }
        }
        match applied {
            Ok(()) => {}
            Err(error @ runtime::Error::NeedsReload(_)) if ops == 0 => {
                info!(%error, "not a runtime change");
                return Ok(Runtime::Skipped);
            }
            Err(error) => {
                warn!(%error, ops, "the runtime change failed; reloading instead");
                return Ok(Runtime::Failed { ops, took });
            }
        }

        // HAProxy runs the new set, and it is staged and durable: make it the live one on
        // disk before the answer.
        let files = request.files.clone();
        let meta = SetMeta {
            checksum: request.checksum.clone(),
            generation: request.generation,
            leader: request.leader.clone(),
            epoch: request.epoch,
            files: request
                .files
                .iter()
                .map(|(path, _)| path.to_owned())
                .collect(),
        };
        let previous = live_name.to_owned();
        let base_stamps = self.held(live_name).and_then(|held| held.stamps.clone());
        let written = match staged {
            Ok((name, staged_phases)) => {
                blocking(move || -> Result<(String, Option<Stamps>, WritePhases)> {
                    let mut phases = staged_phases;
                    let mut phase = Instant::now();
                    let mut lap = |into: &mut u64| {
                        *into = micros(phase.elapsed());
                        phase = Instant::now();
                    };
                    let linked = |path: &str| !changed.contains(path);
                    store.promote(&name, &meta)?;
                    lap(&mut phases.promote_us);
                    store
                        .set_links(&[(LAST_KNOWN_GOOD, Some(&previous)), (CURRENT, Some(&name))])?;
                    lap(&mut phases.links_us);
                    // A linked file is the base's file (the same inode): its stamp carries
                    // over, so only the files written now are looked at.
                    let stamps = base_stamps.and_then(|base| {
                        let mut stamps = Stamps::new();
                        let mut written = Vec::new();
                        for (path, _) in files.iter() {
                            match base.get(path).filter(|_| linked(path)) {
                                Some(stamp) => {
                                    stamps.insert(path.to_owned(), *stamp);
                                }
                                None => written.push(path),
                            }
                        }
                        stamps.extend(store.stamps(&name, written).ok()?);
                        Some(stamps)
                    });
                    lap(&mut phases.stamps_us);
                    Ok((name, stamps, phases))
                })
                .await
                .and_then(|written| written)
            }
            Err(error) => Err(error),
        };
        let (name, stamps, phases) = match written {
            Ok(written) => written,
            Err(error) => {
                // HAProxy runs what the disk does not hold: load the live set again.
                warn!(%error, "writing the set after its runtime change failed; reloading the live set");
                let live_checksum = match self.held(live_name) {
                    Some(held) => held.checksum.clone(),
                    None => live.checksum_as(self.shared.store.checksum_form(live_name)),
                };
                let _ = self.load_settled(&live_checksum).await;
                return Err(error);
            }
        };
        // The set before the last-known-good one is removed after the answer.
        self.clean_up_later(vec![name.clone(), live_name.to_owned()]);
        self.hold(HeldSet {
            name,
            checksum: request.checksum.clone(),
            files: request.files.clone(),
            roles: Some(roles.clone()),
            stamps,
        });
        if let Ok(mut loaded) = shared.loaded.lock() {
            *loaded = Some(request.checksum.clone());
        }
        shared.metrics.count_reload_avoided();
        shared.metrics.set_generation(request.generation);
        let timing = Timing {
            total_us: micros(started.elapsed()),
            write_us: micros(write.elapsed()),
            runtime_us: micros(took),
            ..Timing::default()
        };
        info!(
            ops,
            servers = plan.servers.len(),
            files = plan.files.len(),
            added = plan.added.len(),
            removed = plan.removed.len(),
            ?timing,
            ?phases,
            "applied through the runtime API, no reload"
        );
        Ok(Runtime::Applied(ApplyResponse::Applied {
            checksum: request.checksum.clone(),
            generation: request.generation,
            timing,
            reload: false,
            runtime_ops: ops,
        }))
    }

    /// The reload path: stage, `haproxy -c`, swap, reload (with rollback).
    async fn apply_by_reload(
        &self,
        request: ApplyRequest,
        roles: Roles,
        previous: Option<String>,
        started: Instant,
    ) -> Result<ApplyResponse> {
        let shared = &self.shared;
        let mut timing = Timing::default();
        let phase = Instant::now();
        let store = shared.store.clone();
        let checksum = request.checksum.clone();
        let paths: Vec<String> = request
            .files
            .iter()
            .map(|(path, _)| path.to_owned())
            .collect();
        let files = request.files.clone();
        // The files the live set holds as they are (a pool's growth rewrites the config and
        // the maps, not the 2,500 certificates) are hard-linked from it, its trees shared, as
        // a runtime apply links them: writing a whole copy took ~2 s at 10,000, and removing
        // the live set once it is no longer kept, an unlink of every file (a few hundred ms
        // that the apply after next waited for). Only from a live set whose files are on disk
        // as memory holds them (their stamps checked); otherwise the set is written whole.
        let base = match previous.as_deref().and_then(|live| self.held(live)) {
            Some(held) if self.on_disk_as_held(&held).await? => Some(held),
            _ => None,
        };
        self.cleaned_up().await;
        let (staged, linked) = blocking(move || {
            // Linked from the live set (and skipped by the fsync: durable already).
            let linked: std::collections::BTreeSet<String> = match &base {
                Some(base) => files
                    .iter()
                    .filter(|(path, content)| base.files.get(path) == Some(*content))
                    .map(|(path, _)| path.to_owned())
                    .collect(),
                None => Default::default(),
            };
            let staged = store.write_staged_reusing(
                &files,
                &checksum,
                base.as_ref().map(|base| (base.name.as_str(), &base.files)),
                |path| linked.contains(path),
            )?;
            Ok::<_, Error>((staged, linked))
        })
        .await??;
        let name = staged.name.clone();
        let written = phase.elapsed();

        // `haproxy -c` reads the files from the page cache; making them durable (one fsync per
        // file and directory written) only has to be done before the swap, so it runs
        // meanwhile.
        let store = shared.store.clone();
        let sync_staged = staged.clone();
        let sync =
            blocking(move || store.sync_staged_reusing(&sync_staged, |path| linked.contains(path)));
        let staged = staged.dir;
        let check_phase = Instant::now();
        let check = async {
            let check = shared
                .haproxy
                .check(&staged, shared.config.check_timeout)
                .await;
            (check, check_phase.elapsed())
        };
        let (synced, (check, checked)) = tokio::join!(sync, check);
        // Only the wait for the fsync beyond the check counts as writing.
        timing.write_us = micros(written + check_phase.elapsed().saturating_sub(checked));
        timing.check_us = micros(checked);
        shared.metrics.observe_check(checked);
        if let Err(error) = synced.and_then(|synced| synced.map_err(Error::from)) {
            let _ = shared.store.discard_staged(&name);
            return Err(error);
        }
        let check = match check {
            Ok(check) => check,
            Err(haproxy::Error::CheckTimeout(limit)) => haproxy::CheckOutcome {
                valid: false,
                output: format!("`haproxy -c` did not finish within {limit:?}"),
            },
            Err(error) => {
                let _ = shared.store.discard_staged(&name);
                return Err(error.into());
            }
        };
        if !check.valid {
            shared.store.discard_staged(&name)?;
            info!("refused: haproxy -c failed");
            timing.total_us = micros(started.elapsed());
            return Ok(ApplyResponse::Invalid {
                checksum: request.checksum,
                check_output: check.output,
                timing,
            });
        }

        let phase = Instant::now();
        let meta = SetMeta {
            checksum: request.checksum.clone(),
            generation: request.generation,
            leader: request.leader.clone(),
            epoch: request.epoch,
            files: paths,
        };
        let store = shared.store.clone();
        let (swap_name, swap_previous) = (name.clone(), previous.clone());
        let stamps = blocking(move || -> Result<Option<Stamps>> {
            store.promote(&swap_name, &meta)?;
            match &swap_previous {
                Some(previous) => store.set_links(&[
                    (LAST_KNOWN_GOOD, Some(previous)),
                    (CURRENT, Some(&swap_name)),
                ])?,
                None => store.set_link(CURRENT, Some(&swap_name))?,
            }
            Ok(store
                .stamps(&swap_name, meta.files.iter().map(String::as_str))
                .ok())
        })
        .await??;
        // `current` now: held whether it loads or not (a rollback points `current` back at
        // `previous`, which memory holds too, or reads from disk).
        self.hold(HeldSet {
            name: name.clone(),
            checksum: request.checksum.clone(),
            files: request.files,
            roles: Some(roles),
            stamps,
        });

        let swapped = Swapped {
            checksum: request.checksum,
            generation: request.generation,
            name,
            previous,
        };
        self.finish_load(swapped, timing, started, phase).await
    }

    /// Loads `current` (set `name`, holding `request`'s files) and answers: applied, or
    /// rolled back to `previous` when HAProxy fails to load it.
    async fn finish_load(
        &self,
        swapped: Swapped,
        mut timing: Timing,
        started: Instant,
        phase: Instant,
    ) -> Result<ApplyResponse> {
        let shared = &self.shared;
        let Swapped {
            checksum,
            generation,
            name,
            previous,
        } = swapped;
        // Sets older than `previous` are never loaded again (a rollback restores `previous`),
        // so they are removed while HAProxy loads the new set rather than after it.
        self.cleaned_up().await;
        let store = shared.store.clone();
        let keep: Vec<String> = [Some(name.clone()), previous.clone()]
            .into_iter()
            .flatten()
            .collect();
        let cleanup = blocking(move || {
            let keep: Vec<&str> = keep.iter().map(String::as_str).collect();
            store.retain(&keep)
        });
        let (outcome, cleaned) = tokio::join!(self.load_settled(&checksum), cleanup);
        match cleaned {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, "removing old sets failed"),
            Err(error) => warn!(%error, "removing old sets failed"),
        }
        match outcome {
            ReloadOutcome::Loaded { worker } => {
                timing.reload_us = micros(phase.elapsed());
                timing.total_us = micros(started.elapsed());
                info!(worker, ?timing, "applied");
                shared.metrics.set_generation(generation);
                Ok(ApplyResponse::Applied {
                    checksum,
                    generation,
                    timing,
                    reload: true,
                    runtime_ops: 0,
                })
            }
            ReloadOutcome::Failed { reason } => {
                warn!(%reason, "load failed; restoring last-known-good");
                let live_checksum = self.roll_back(previous.as_deref()).await?;
                timing.reload_us = micros(phase.elapsed());
                timing.total_us = micros(started.elapsed());
                Ok(ApplyResponse::RolledBack {
                    checksum,
                    live_checksum,
                    reason,
                    timing,
                })
            }
            ReloadOutcome::Unknown { reason, .. } => {
                warn!(%reason, "HAProxy has not finished the reload; the agent waits for it");
                Err(Error::NotReady(format!(
                    "HAProxy has not finished loading the set ({reason}); the agent takes no apply until it has"
                )))
            }
        }
    }

    /// An `unchanged` at a newer (epoch, generation) than the live set's raises the live
    /// set's high-water mark to it, so that a delayed older generation of the same epoch is
    /// still `superseded` (gen 10 applied, gen 12 unchanged: gen 11 must not go live).
    /// Returns the generation now recorded.
    async fn raise_generation(&self, name: &str, request: &ApplyRequest) -> Result<u64> {
        let Some(mut meta) = self.shared.store.meta(name) else {
            return Ok(request.generation);
        };
        if (request.epoch, request.generation) <= (meta.epoch, meta.generation) {
            return Ok(meta.generation);
        }
        meta.epoch = request.epoch;
        meta.generation = request.generation;
        meta.leader = request.leader.clone();
        let store = self.shared.store.clone();
        let set = name.to_owned();
        let recorded = meta.clone();
        blocking(move || store.write_meta(&set, &recorded)).await??;
        self.shared.metrics.set_generation(meta.generation);
        info!(
            generation = meta.generation,
            "unchanged at a newer generation: high-water mark raised"
        );
        Ok(meta.generation)
    }

    fn loaded(&self) -> Option<String> {
        self.shared
            .loaded
            .lock()
            .ok()
            .and_then(|loaded| loaded.clone())
    }

    fn unsettled(&self) -> Option<ProcTable> {
        self.shared
            .unsettled
            .lock()
            .ok()
            .and_then(|unsettled| unsettled.clone())
    }

    fn set_unsettled(&self, value: Option<ProcTable>) {
        if let Ok(mut unsettled) = self.shared.unsettled.lock() {
            *unsettled = value;
        }
    }

    /// With the apply lock held: waits (bounded) for a reload an earlier apply gave up on to
    /// finish, then makes HAProxy load whatever `current` is. Not ready while it has not.
    async fn resettle(&self, before: &ProcTable) -> Result<()> {
        let shared = &self.shared;
        let deadline = Instant::now() + shared.config.reload_timeout;
        if shared
            .haproxy
            .await_reload(before, deadline)
            .await
            .is_none()
        {
            return Err(Error::NotReady(
                "HAProxy has still not finished an earlier reload".to_owned(),
            ));
        }
        self.set_unsettled(None);
        let Some(name) = shared.store.link(CURRENT)? else {
            return Ok(());
        };
        let checksum = shared
            .store
            .meta(&name)
            .map(|meta| meta.checksum)
            .unwrap_or_default();
        match self.load_settled(&checksum).await {
            ReloadOutcome::Loaded { .. } => Ok(()),
            ReloadOutcome::Failed { reason } => {
                warn!(%reason, "loading the current set after a late reload failed; restoring last-known-good");
                let previous = shared.store.link(LAST_KNOWN_GOOD)?;
                self.roll_back(previous.as_deref()).await?;
                Ok(())
            }
            ReloadOutcome::Unknown { reason, .. } => Err(Error::NotReady(reason)),
        }
    }

    /// [`Agent::load`], and when its outcome is unknown (the reload was sent but HAProxy had
    /// not finished it in time) waits for HAProxy to finish it, up to `settle_timeout`; in
    /// supervised mode a master that does not finish is restarted on `current`. The caller
    /// holds the apply lock throughout, and the agent reports not ready meanwhile, so no
    /// other set is swapped in while HAProxy may still be loading this one. `Unknown` comes
    /// back only without a supervisor, when HAProxy never finished.
    async fn load_settled(&self, checksum: &str) -> ReloadOutcome {
        let shared = &self.shared;
        let supervisor = shared.supervisor.as_ref();
        let mark = supervisor.map_or(0, Supervisor::log_mark);
        let started = Instant::now();
        let outcome = self.load(checksum).await;
        let ReloadOutcome::Unknown { reason, before } = outcome else {
            return outcome;
        };
        warn!(%reason, "reload outcome unknown; waiting for HAProxy to finish it");
        self.set_unsettled(Some(before.clone()));
        let deadline = Instant::now() + shared.config.settle_timeout;
        // Unknown below: still not finished by the deadline.
        let settled = async {
            match shared.haproxy.await_reload(&before, deadline).await {
                Some(after) => haproxy::judge(&before, &after, || {
                    supervisor.and_then(|supervisor| supervisor.log_since(mark))
                }),
                None => ReloadOutcome::Unknown {
                    reason: String::new(),
                    before: before.clone(),
                },
            }
        };
        let outcome = match self.unless_master_exits(settled, mark).await {
            ReloadOutcome::Unknown { .. } => match supervisor {
                Some(supervisor) => {
                    warn!("HAProxy did not finish the reload; restarting it on the current set");
                    supervisor.stop().await;
                    match supervisor.start().await {
                        Ok(()) => ReloadOutcome::Loaded { worker: 0 },
                        Err(error) => ReloadOutcome::Failed {
                            reason: error.to_string(),
                        },
                    }
                }
                None => ReloadOutcome::Unknown {
                    reason: format!(
                        "HAProxy did not finish the reload within {:?}",
                        shared.config.reload_timeout + shared.config.settle_timeout
                    ),
                    before,
                },
            },
            finished => finished,
        };
        if !matches!(outcome, ReloadOutcome::Unknown { .. }) {
            self.set_unsettled(None);
        }
        self.record(checksum, &outcome, started.elapsed());
        outcome
    }

    /// Points `current` back at `previous` (or removes it when there is none), reloads, and
    /// removes every other set. Returns the checksum live afterwards.
    async fn roll_back(&self, previous: Option<&str>) -> Result<Option<String>> {
        let shared = &self.shared;
        shared.store.set_link(CURRENT, previous)?;
        let keep: Vec<&str> = previous.into_iter().collect();
        let live = match previous {
            Some(previous) => {
                let checksum = shared.store.meta(previous).map(|meta| meta.checksum);
                match self
                    .load_settled(checksum.as_deref().unwrap_or_default())
                    .await
                {
                    ReloadOutcome::Loaded { .. } => checksum,
                    ReloadOutcome::Failed { reason } | ReloadOutcome::Unknown { reason, .. } => {
                        warn!(%reason, "restoring last-known-good failed too");
                        None
                    }
                }
            }
            None => {
                // Nothing to restore: a supervised HAProxy that never loaded stays stopped.
                if let Some(supervisor) = &shared.supervisor {
                    supervisor.stop().await;
                }
                None
            }
        };
        if let Err(error) = shared.store.retain(&keep) {
            warn!(%error, "removing the failed set failed");
        }
        Ok(live)
    }

    /// Makes HAProxy run the set `current` points to: a reload through the master socket,
    /// or in supervised mode a start when HAProxy is not running. Records the outcome.
    async fn load(&self, checksum: &str) -> ReloadOutcome {
        let shared = &self.shared;
        let started = Instant::now();
        let supervisor = shared.supervisor.as_ref();
        let mark = supervisor.map_or(0, Supervisor::log_mark);
        let outcome = match supervisor {
            Some(supervisor) if !supervisor.is_running().await => match supervisor.start().await {
                Ok(()) => ReloadOutcome::Loaded { worker: 0 },
                Err(error) => ReloadOutcome::Failed {
                    reason: error.to_string(),
                },
            },
            _ => {
                let reload = async {
                    shared
                        .haproxy
                        .reload(shared.config.reload_timeout, || {
                            supervisor.and_then(|supervisor| supervisor.log_since(mark))
                        })
                        .await
                        .unwrap_or_else(|error| ReloadOutcome::Failed {
                            reason: error.to_string(),
                        })
                };
                self.unless_master_exits(reload, mark).await
            }
        };
        // An unknown outcome is recorded once it is known (`load_settled`).
        if !matches!(outcome, ReloadOutcome::Unknown { .. }) {
            self.record(checksum, &outcome, started.elapsed());
        }
        outcome
    }

    /// `reload`, unless the supervised master exits first: then the load failed at once (a
    /// master that exits on a reload is gone, and its workers with it), and the rollback
    /// starts without waiting for the reload timeout.
    async fn unless_master_exits(
        &self,
        reload: impl std::future::Future<Output = ReloadOutcome>,
        mark: u64,
    ) -> ReloadOutcome {
        let Some(supervisor) = &self.shared.supervisor else {
            return reload.await;
        };
        let Some(mut exited) = supervisor.exit_watch().await else {
            return reload.await;
        };
        tokio::select! {
            outcome = reload => outcome,
            status = async {
                let status = exited.wait_for(Option::is_some).await.ok().and_then(|s| s.clone());
                status.unwrap_or_default()
            } => {
                let log = supervisor.log_since(mark).unwrap_or_default();
                warn!(%status, "HAProxy's master exited during the reload");
                ReloadOutcome::Failed {
                    reason: format!("HAProxy's master exited during the reload ({status}): {log}"),
                }
            }
        }
    }

    /// Records a reload's outcome (state and metrics).
    fn record(&self, checksum: &str, outcome: &ReloadOutcome, took: Duration) {
        let shared = &self.shared;
        if let Ok(mut loaded) = shared.loaded.lock() {
            *loaded = matches!(outcome, ReloadOutcome::Loaded { .. }).then(|| checksum.to_owned());
        }
        shared.metrics.observe_reload(took);
        let record = ReloadRecord {
            ok: matches!(outcome, ReloadOutcome::Loaded { .. }),
            checksum: checksum.to_owned(),
            message: match outcome {
                ReloadOutcome::Loaded { worker } => format!("loaded (worker {worker})"),
                ReloadOutcome::Failed { reason } | ReloadOutcome::Unknown { reason, .. } => {
                    reason.clone()
                }
            },
            duration_us: micros(took),
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        if let Ok(mut status) = shared.status.lock() {
            status.last_reload = Some(record);
        }
    }

    /// Starts HAProxy in supervised mode when a set is live (after a restart of the agent).
    pub async fn start_haproxy_if_live(&self) -> Result<()> {
        let Some(supervisor) = &self.shared.supervisor else {
            return Ok(());
        };
        let _one_at_a_time = self.shared.apply_lock.lock().await;
        let Some(mut name) = self.shared.store.link(CURRENT)? else {
            return Ok(());
        };
        // A set made live before the policy was (an older agent, a stricter policy now) is
        // code all the same: one that breaks the policy is not started.
        if let Some(why) = self.policy_refusal(&name).await {
            let previous = match self.shared.store.link(LAST_KNOWN_GOOD)? {
                Some(previous) if previous != name => match self.policy_refusal(&previous).await {
                    None => Some(previous),
                    Some(also) => {
                        warn!(set = %previous, why = %also, "last-known-good breaks the config policy too");
                        None
                    }
                },
                _ => None,
            };
            warn!(set = %name, %why, ?previous, "the live set breaks the config policy; not starting it");
            self.shared.store.set_link(CURRENT, previous.as_deref())?;
            if let Some(meta) = previous.as_deref().and_then(|p| self.shared.store.meta(p)) {
                self.shared.metrics.set_generation(meta.generation);
            }
            match previous {
                Some(previous) => name = previous,
                None => return Ok(()),
            }
        }
        let store = self.shared.store.clone();
        let on_disk = {
            let name = name.clone();
            blocking(move || store.checksum_on_disk(&name)).await?
        };
        let started = Instant::now();
        let outcome = match supervisor.start().await {
            Ok(()) => ReloadOutcome::Loaded { worker: 0 },
            Err(error) => ReloadOutcome::Failed {
                reason: error.to_string(),
            },
        };
        // A set whose files no longer hash to its checksum is not recorded as loaded.
        let checksum = on_disk.unwrap_or_default();
        self.record(&checksum, &outcome, started.elapsed());
        if let ReloadOutcome::Failed { reason } = outcome {
            // `current` may be a set swapped in by an apply that never confirmed its reload.
            let previous = self
                .shared
                .store
                .link(LAST_KNOWN_GOOD)?
                .filter(|previous| *previous != name);
            warn!(%reason, ?previous, "starting HAProxy on the live set failed; restoring last-known-good");
            let live = self.roll_back(previous.as_deref()).await?;
            if let Some(meta) = self.live_meta() {
                self.shared.metrics.set_generation(meta.generation);
            }
            info!(?live, "after the failed start");
        }
        Ok(())
    }

    /// The first violation of the config policy in set `name` as it is on disk, if any (a
    /// set that cannot be read counts as one).
    async fn policy_refusal(&self, name: &str) -> Option<String> {
        let store = self.shared.store.clone();
        let policy = self.shared.config.policy.clone();
        let name = name.to_owned();
        let checked =
            blocking(move || store.read_set(&name).map(|files| policy.violations(&files))).await;
        match checked {
            Ok(Ok(violations)) => violations.first().map(ToString::to_string),
            Ok(Err(error)) => Some(error.to_string()),
            Err(error) => Some(error.to_string()),
        }
    }

    /// Why the agent is not ready, if it is not: the fence file is unreadable, or a set is
    /// live but HAProxy's master socket lists no worker.
    ///
    /// Answered from a cache refreshed at most once a [`READY_TTL`], by one caller at a time
    /// on the master CLI's probe slot: a flood of probes makes at most one master CLI
    /// connection a second and never takes the slot an apply needs. The reason names no
    /// path and quotes no file content (the probe is unauthenticated); the log has the
    /// details.
    pub async fn readiness(&self) -> Result<(), String> {
        if self.unsettled().is_some() {
            return Err("HAProxy is still finishing a reload".to_owned());
        }
        let mut cache = self.shared.ready.lock().await;
        if let Some((at, result)) = &*cache
            && at.elapsed() < READY_TTL
        {
            return result.clone();
        }
        let result = self.probe_readiness().await;
        *cache = Some((Instant::now(), result.clone()));
        result
    }

    /// Forgets the cached readiness (after an apply changed what is live).
    async fn forget_readiness(&self) {
        *self.shared.ready.lock().await = None;
    }

    async fn probe_readiness(&self) -> Result<(), String> {
        let fence = self.shared.fence.clone();
        let loaded = blocking(move || fence.load()).await;
        match loaded {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                warn!(%error, "not ready: fence unreadable");
                return Err("the fence file is unreadable or corrupt".to_owned());
            }
            Err(error) => return Err(error.to_string()),
        }
        let live = self.shared.store.link(CURRENT).map_err(|error| {
            warn!(%error, "not ready: the live set link is unreadable");
            "the live set link is unreadable".to_owned()
        })?;
        if live.is_some() {
            let table = self
                .shared
                .haproxy
                .show_proc_probe(Duration::from_secs(2))
                .await
                .map_err(|error| {
                    warn!(%error, "not ready: HAProxy's master CLI does not answer");
                    "HAProxy's master CLI does not answer".to_owned()
                })?;
            if table.workers.is_empty() {
                return Err("HAProxy runs no worker".to_owned());
            }
        }
        Ok(())
    }

    /// What the agent holds, with the live checksum recomputed from disk.
    pub async fn state(&self) -> AgentState {
        let shared = &self.shared;
        let store = shared.store.clone();
        let fence = shared.fence.clone();
        let disk = blocking(move || {
            // A swap between reading the link and the files is retried once.
            let live = (0..2).find_map(|_| {
                let name = store.link(CURRENT).ok()??;
                let checksum = store.checksum_on_disk(&name).ok()?;
                let meta = store.meta(&name);
                Some((name, checksum, meta))
            });
            let lkg = store
                .link(LAST_KNOWN_GOOD)
                .ok()
                .flatten()
                .and_then(|name| store.meta(&name))
                .map(|meta| meta.checksum);
            (live, lkg, fence.load())
        })
        .await;
        let mut state = AgentState::default();
        if let Ok((live, lkg, fence)) = disk {
            if let Some((name, checksum, meta)) = live {
                // The files on disk are not the set memory holds under that name (changed
                // without moving their stamps): memory is dropped, so the next apply reads
                // the set from disk and the leader's re-send after this drift repairs it.
                if self
                    .held(&name)
                    .is_some_and(|held| held.checksum != checksum)
                {
                    warn!(set = %name, on_disk = %checksum, "the live set's files on disk are not the ones written; it is read again before the next apply");
                    self.forget(&name);
                }
                state.live_checksum = Some(checksum);
                state.generation = meta.as_ref().map(|meta| meta.generation);
                state.leader = meta.map(|meta| meta.leader);
            }
            state.last_known_good_checksum = lkg;
            match fence {
                Ok(value) => state.fence = Some(value),
                Err(error) => state.fence_error = Some(error.to_string()),
            }
        }
        if let Ok(status) = shared.status.lock() {
            state.last_reload = status.last_reload.clone();
            state.reloads_avoided = shared.metrics.reloads_avoided();
            state.haproxy_version = status.haproxy_version.clone();
        }
        if let Ok(table) = shared.haproxy.show_proc_probe(Duration::from_secs(1)).await {
            state.haproxy_pid = Some(table.master.pid);
            state.worker_pids = table.workers.iter().map(|worker| worker.pid).collect();
        }
        state
    }
}
