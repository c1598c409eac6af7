//! Fault injection per client and globally, and the per-client request accounting.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Mutex,
    time::Duration,
};

use tokio::{sync::watch, time::Instant};

use crate::status::ApiError;

/// A fault a test injects for one client (see [`crate::ApiServer::inject`]).
///
/// Faults add up, whatever the order they were injected in: dropped connections come first,
/// then hangs, then error answers; latencies add up and delay error answers too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Every request (and the start of every watch) waits this long before it is served.
    Latency(Duration),
    /// Requests are answered with this HTTP code and a `Status` body as the real server forms
    /// it (500 InternalError, 503 ServiceUnavailable, 429 TooManyRequests, 504 Timeout).
    /// `retry_after` sets the `Retry-After` header; `times` limits how many requests fail
    /// (`None`: until lifted). Watches are refused the same way.
    Error {
        /// The HTTP status code.
        code: u16,
        /// Seconds for the `Retry-After` header and `details.retryAfterSeconds`.
        retry_after: Option<u64>,
        /// How many requests fail before the fault lifts itself; `None` for all.
        times: Option<u32>,
    },
    /// Every request's connection is closed without an answer, and open watches are cut.
    DropConnections,
    /// Non-watch requests are never answered: they hang until the client gives up; when the
    /// fault is lifted the connection is closed without the request taking effect.
    HangRequests,
    /// Watches are accepted and then deliver nothing, not even their end at `timeoutSeconds`;
    /// open watches go silent. Lifting the fault lets them deliver what they missed (as TCP
    /// would after a stall).
    HangWatches,
    /// Requests are served (a write takes effect at once) but each answer is held back this
    /// long: a slow network on the way back. Watches are not delayed.
    SlowResponse(Duration),
    /// A full partition of this client: every request, new watches included, hangs as in
    /// [`Fault::HangRequests`], and open watches go silent as in [`Fault::HangWatches`].
    Partition,
}

/// What to do with one request, decided from the faults in force when it arrives.
#[derive(Debug)]
pub(crate) enum Decision {
    Proceed(Option<Duration>),
    Fail(ApiError, Option<Duration>),
    Drop,
    Hang,
}

#[derive(Debug, Default)]
struct ClientFaults {
    faults: Vec<Fault>,
}

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// Arrival order, global across clients.
    pub seq: u64,
    /// The client name (from the bearer token the testkit issued), `anonymous` without one.
    pub client: String,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`, or
    /// `discovery` for discovery and version documents.
    pub verb: String,
    /// The resource, qualified by group: `leases.coordination.k8s.io`, `pods`; empty for
    /// discovery.
    pub resource: String,
    /// The subresource (`status`), or empty.
    pub subresource: String,
    /// The namespace, or empty.
    pub namespace: String,
    /// The object name, or empty for collections.
    pub name: String,
    /// The HTTP status answered; 0 when the connection was dropped or the request hung.
    pub code: u16,
    /// When the request arrived (tokio clock: paused-time tests see virtual time).
    pub arrived: Instant,
}

#[derive(Debug)]
pub(crate) struct FaultTable {
    clients: Mutex<HashMap<String, ClientFaults>>,
    outage_until: Mutex<Option<Instant>>,
    /// Bumped on every change, so hung requests and open watches re-evaluate.
    changes: watch::Sender<u64>,
    log: Mutex<Vec<RequestRecord>>,
    seq: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-written in a way
    // that matters to a test harness; keep serving.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FaultTable {
    pub(crate) fn new() -> Self {
        Self {
            clients: Mutex::new(HashMap::new()),
            outage_until: Mutex::new(None),
            changes: watch::channel(0).0,
            log: Mutex::new(Vec::new()),
            seq: std::sync::atomic::AtomicU64::new(1),
        }
    }

    fn changed(&self) {
        self.changes.send_modify(|g| *g += 1);
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub(crate) fn inject(&self, client: &str, fault: Fault) {
        lock(&self.clients)
            .entry(client.to_owned())
            .or_default()
            .faults
            .push(fault);
        self.changed();
    }

    pub(crate) fn lift(&self, client: &str) {
        lock(&self.clients).remove(client);
        self.changed();
    }

    pub(crate) fn lift_all(&self) {
        lock(&self.clients).clear();
        *lock(&self.outage_until) = None;
        self.changed();
    }

    pub(crate) fn outage(&self, until: Option<Instant>) {
        *lock(&self.outage_until) = until;
        self.changed();
    }

    pub(crate) fn in_outage(&self) -> bool {
        lock(&self.outage_until).is_some_and(|until| Instant::now() < until)
    }

    /// The instant the current outage ends, if one is in force.
    pub(crate) fn outage_end(&self) -> Option<Instant> {
        lock(&self.outage_until).filter(|until| Instant::now() < *until)
    }

    /// Decides the fate of one request from `client`. Whatever the order faults were injected
    /// in, network faults come first (a dropped or hung request never reaches the server), then
    /// error answers; latencies add up and delay error answers too.
    pub(crate) fn decide(&self, client: &str, is_watch: bool) -> Decision {
        if self.in_outage() {
            return Decision::Drop;
        }
        let mut clients = lock(&self.clients);
        let Some(entry) = clients.get_mut(client) else {
            return Decision::Proceed(None);
        };
        let faults = &mut entry.faults;
        if faults.iter().any(|f| matches!(f, Fault::DropConnections)) {
            return Decision::Drop;
        }
        let hung = faults.iter().any(|f| match f {
            Fault::Partition => true,
            Fault::HangRequests => !is_watch,
            _ => false,
        });
        if hung {
            return Decision::Hang;
        }
        let latency = faults
            .iter()
            .filter_map(|f| match f {
                Fault::Latency(d) => Some(*d),
                _ => None,
            })
            .reduce(|a, b| a + b);
        let error = faults.iter_mut().find_map(|f| match f {
            Fault::Error {
                code,
                retry_after,
                times,
            } if times.is_none_or(|t| t > 0) => {
                if let Some(t) = times.as_mut() {
                    *t -= 1;
                }
                Some(ApiError::injected(*code, *retry_after))
            }
            _ => None,
        });
        faults.retain(|f| !matches!(f, Fault::Error { times: Some(0), .. }));
        match error {
            Some(error) => Decision::Fail(error, latency),
            None => Decision::Proceed(latency),
        }
    }

    /// How long the answer to a served request of `client` is held back.
    pub(crate) fn response_delay(&self, client: &str) -> Option<Duration> {
        lock(&self.clients).get(client).and_then(|c| {
            c.faults
                .iter()
                .filter_map(|f| match f {
                    Fault::SlowResponse(d) => Some(*d),
                    _ => None,
                })
                .reduce(|a, b| a + b)
        })
    }

    /// Whether a hung request of `client` must keep hanging.
    pub(crate) fn still_hung(&self, client: &str, is_watch: bool) -> bool {
        lock(&self.clients).get(client).is_some_and(|c| {
            c.faults.iter().any(|f| match f {
                Fault::Partition => true,
                Fault::HangRequests => !is_watch,
                Fault::HangWatches => is_watch,
                _ => false,
            })
        })
    }

    /// What an open watch of `client` must do now: deliver, go silent, or be cut.
    pub(crate) fn watch_state(&self, client: &str) -> WatchState {
        if self.in_outage() {
            return WatchState::Cut;
        }
        let clients = lock(&self.clients);
        let Some(c) = clients.get(client) else {
            return WatchState::Deliver;
        };
        if c.faults.iter().any(|f| matches!(f, Fault::DropConnections)) {
            WatchState::Cut
        } else if c
            .faults
            .iter()
            .any(|f| matches!(f, Fault::Partition | Fault::HangWatches))
        {
            WatchState::Silent
        } else {
            WatchState::Deliver
        }
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn record(&self, record: RequestRecord) {
        lock(&self.log).push(record);
    }

    pub(crate) fn requests(&self) -> Vec<RequestRecord> {
        let mut log = lock(&self.log).clone();
        log.sort_by_key(|r| r.seq);
        log
    }

    pub(crate) fn counts(&self) -> BTreeMap<(String, String, String), u64> {
        let mut counts = BTreeMap::new();
        for r in lock(&self.log).iter() {
            *counts
                .entry((r.client.clone(), r.verb.clone(), r.resource.clone()))
                .or_insert(0) += 1;
        }
        counts
    }

    pub(crate) fn reset_accounting(&self) {
        lock(&self.log).clear();
    }
}

/// What an open watch does under the faults in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WatchState {
    Deliver,
    Silent,
    Cut,
}
