//! The epoch annotation, its parsing, the bump / reclaim protocol and terms.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};
use tracing::{debug, info, warn};

/// The annotation on the leader Lease that holds the epoch.
pub const EPOCH_ANNOTATION: &str = "haptic.io/leader-epoch";

/// Why an annotation value is not an epoch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {EPOCH_ANNOTATION}={value:?} is not an epoch: {reason}")]
pub struct Malformed {
    /// The value found.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Reads an annotation value: absent is 0 (no epoch claimed yet); otherwise it must be a
/// decimal u64 with no sign, spaces or leading zeros.
pub fn parse_epoch(value: Option<&str>) -> Result<u64, Malformed> {
    let Some(value) = value else { return Ok(0) };
    let bad = |reason| Malformed {
        value: value.to_owned(),
        reason,
    };
    if value.is_empty() {
        return Err(bad("it is empty"));
    }
    if value.starts_with('-') {
        return Err(bad("it is negative"));
    }
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("it is not a decimal integer"));
    }
    if value.len() > 1 && value.starts_with('0') {
        return Err(bad("it has leading zeros"));
    }
    value.parse::<u64>().map_err(|_| bad("it overflows u64"))
}

/// Errors of the epoch protocol.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Lease does not exist.
    #[error("lease {namespace}/{name} does not exist")]
    LeaseMissing {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// A bump was refused: the Lease names another holder (or none).
    #[error("lease is held by {holder:?}, not {identity:?}: only the holder may claim an epoch")]
    NotHolder {
        /// The holder on the Lease (empty when vacant).
        holder: String,
        /// This controller's identity.
        identity: String,
    },
    /// The annotation is malformed; see the crate docs for the recovery rule.
    #[error(transparent)]
    Malformed(#[from] Malformed),
    /// Another leader exists: it holds the Lease or raised the epoch past this term's.
    #[error("another leader exists: the lease names {holder:?} at epoch {epoch}; stop writing")]
    ForeignLeader {
        /// The holder on the Lease.
        holder: String,
        /// The epoch on the Lease.
        epoch: u64,
    },
    /// The epoch cannot grow any further.
    #[error("the epoch is at u64::MAX and cannot be raised")]
    Exhausted,
    /// The Lease kept changing under every attempt.
    #[error("the lease changed under each of {0} attempts")]
    TooManyConflicts(u32),
    /// A request did not finish in time.
    #[error("a lease request timed out after {0:?}")]
    Timeout(Duration),
    /// An API error.
    #[error("lease request failed: {0}")]
    Api(#[source] kube::Error),
}

/// Result with the epoch [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

struct Inner {
    api: Api<Lease>,
    namespace: String,
    name: String,
    identity: String,
    /// The epoch of the current term, 0 for none.
    current: AtomicU64,
    /// The highest epoch this controller ever claimed: a floor no later claim goes below.
    highest: AtomicU64,
    timeout: Duration,
    attempts: u32,
}

/// The epoch of one Lease, as claimed by one controller identity. Cheap to clone.
#[derive(Clone)]
pub struct EpochStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for EpochStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EpochStore")
            .field(
                "lease",
                &format!("{}/{}", self.inner.namespace, self.inner.name),
            )
            .field("identity", &self.inner.identity)
            .field("epoch", &self.leader_epoch())
            .finish()
    }
}

impl EpochStore {
    /// The epoch on Lease `namespace/name` for the controller `identity` (the elector's
    /// identity). Requests time out after 5 s; a bump makes at most 16 attempts.
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            inner: Arc::new(Inner {
                api: Api::namespaced(client, namespace),
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                identity: identity.to_owned(),
                current: AtomicU64::new(0),
                highest: AtomicU64::new(0),
                timeout: Duration::from_secs(5),
                attempts: 16,
            }),
        }
    }

    /// The epoch of this controller's current term; 0 when it has none.
    pub fn leader_epoch(&self) -> u64 {
        self.inner.current.load(Ordering::SeqCst)
    }

    /// The identity epochs are claimed for.
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    async fn get(&self) -> Result<Lease> {
        let fut = self.inner.api.get_opt(&self.inner.name);
        match tokio::time::timeout(self.inner.timeout, fut).await {
            Err(_) => Err(Error::Timeout(self.inner.timeout)),
            Ok(Err(e)) => Err(Error::Api(e)),
            Ok(Ok(None)) => Err(Error::LeaseMissing {
                namespace: self.inner.namespace.clone(),
                name: self.inner.name.clone(),
            }),
            Ok(Ok(Some(lease))) => Ok(lease),
        }
    }

    /// PUT with the resourceVersion the object was read with; `Ok(None)` on a conflict.
    async fn put(&self, lease: &Lease) -> Result<Option<Lease>> {
        let params = PostParams::default();
        let fut = self.inner.api.replace(&self.inner.name, &params, lease);
        match tokio::time::timeout(self.inner.timeout, fut).await {
            Err(_) => Err(Error::Timeout(self.inner.timeout)),
            Ok(Err(kube::Error::Api(status))) if status.code == 409 => Ok(None),
            Ok(Err(e)) => Err(Error::Api(e)),
            Ok(Ok(lease)) => Ok(Some(lease)),
        }
    }

    fn holder(lease: &Lease) -> String {
        lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default()
    }

    fn epoch_of(lease: &Lease) -> Result<u64, Malformed> {
        parse_epoch(
            lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(EPOCH_ANNOTATION))
                .map(String::as_str),
        )
    }

    /// Writes `epoch` on `lease` if it still names this holder; `Ok(None)` on a conflict.
    async fn claim(&self, mut lease: Lease, epoch: u64) -> Result<Option<u64>> {
        lease.metadata.managed_fields = None;
        lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(EPOCH_ANNOTATION.to_owned(), epoch.to_string());
        let Some(_) = self.put(&lease).await? else {
            return Ok(None);
        };
        self.inner.current.store(epoch, Ordering::SeqCst);
        self.inner.highest.fetch_max(epoch, Ordering::SeqCst);
        info!(identity = %self.inner.identity, lease = %self.inner.name, epoch, "claimed epoch");
        Ok(Some(epoch))
    }

    fn check_holder(&self, lease: &Lease) -> Result<()> {
        let holder = Self::holder(lease);
        if holder != self.inner.identity {
            return Err(Error::NotHolder {
                holder,
                identity: self.inner.identity.clone(),
            });
        }
        Ok(())
    }

    /// Claims the next epoch: `max(annotation, highest claimed here) + 1`, written with the
    /// Lease's resourceVersion and retried on conflict, only while the Lease names this holder.
    pub async fn bump(&self) -> Result<Term> {
        self.bump_inner(None).await
    }

    /// The recovery from a malformed annotation (or any doubt): claims
    /// `max(floor, highest claimed here) + 1`, ignoring the annotation's value. `floor` must be
    /// at least every epoch any receiver accepted (e.g. the highest fence the agents report).
    pub async fn bump_above(&self, floor: u64) -> Result<Term> {
        self.bump_inner(Some(floor)).await
    }

    async fn bump_inner(&self, floor: Option<u64>) -> Result<Term> {
        for attempt in 1..=self.inner.attempts {
            match self.try_bump(floor).await {
                Ok(Some(epoch)) => {
                    return Ok(Term {
                        store: self.clone(),
                        epoch,
                    });
                }
                Ok(None) => {
                    debug!(attempt, lease = %self.inner.name, "epoch bump conflicted; retrying");
                }
                // A timeout, a dropped connection, a 5xx or 429: worth another try. A write that
                // landed although its answer was lost only makes the next claim one higher.
                Err(error) if error.is_transient() && attempt < self.inner.attempts => {
                    warn!(%error, attempt, lease = %self.inner.name, "epoch bump failed; retrying");
                }
                Err(error) => return Err(error),
            }
            conflict_pause(attempt).await;
        }
        Err(Error::TooManyConflicts(self.inner.attempts))
    }

    /// One read-modify-write; `Ok(None)` on a conflict.
    async fn try_bump(&self, floor: Option<u64>) -> Result<Option<u64>> {
        let lease = self.get().await?;
        self.check_holder(&lease)?;
        let base = match floor {
            // A malformed annotation is ignored here (that is the recovery); a well-formed
            // one still counts, so the epoch never goes backwards.
            Some(floor) => floor.max(Self::epoch_of(&lease).unwrap_or(0)),
            None => Self::epoch_of(&lease)?,
        };
        let next = base
            .max(self.inner.highest.load(Ordering::SeqCst))
            .checked_add(1)
            .ok_or(Error::Exhausted)?;
        self.claim(lease, next).await
    }
}

impl Error {
    /// Whether another attempt may succeed: timeouts, transport errors, 5xx and 429.
    fn is_transient(&self) -> bool {
        match self {
            Self::Timeout(_) => true,
            Self::Api(kube::Error::Api(status)) => status.code >= 500 || status.code == 429,
            Self::Api(_) => true,
            _ => false,
        }
    }
}

impl Drop for Term {
    /// A term that ends (dropped, stood down, or deposed) no longer claims its epoch:
    /// [`EpochStore::leader_epoch`] reads 0 again, unless a newer term has claimed one since.
    fn drop(&mut self) {
        let _ = self.store.inner.current.compare_exchange(
            self.epoch,
            0,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }
}

/// A short, growing, jittered pause after a conflict, so two writers in lockstep drift apart.
async fn conflict_pause(attempt: u32) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let jitter = Duration::from_micros(u64::from(nanos % 10_000));
    tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt.min(20))) + jitter).await;
}

/// One term: the epoch it claimed, and the way to end it.
#[derive(Debug)]
#[must_use = "a term must be stood down to release the Lease"]
pub struct Term {
    store: EpochStore,
    epoch: u64,
}

impl Term {
    /// The epoch every write of this term carries.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A receiver reported a fence `floor` at or above this term's epoch. If the Lease still
    /// names this holder and its epoch is not above this term's (nobody else bumped it), the
    /// counter regressed: raise it to `floor + 1` (at least) and continue with that epoch.
    /// Otherwise another leader exists: [`Error::ForeignLeader`], and the caller stops writing.
    pub async fn reclaim(&mut self, floor: u64) -> Result<u64> {
        let store = &self.store;
        for _ in 0..store.inner.attempts {
            let lease = store.get().await?;
            let holder = EpochStore::holder(&lease);
            // A malformed annotation cannot be "above ours": it was not written by a leader.
            let on_lease = EpochStore::epoch_of(&lease).unwrap_or(0);
            if holder != store.inner.identity || on_lease > self.epoch {
                warn!(identity = %store.inner.identity, %holder, epoch = on_lease, ours = self.epoch, "a foreign leader exists");
                store.inner.current.store(0, Ordering::SeqCst);
                return Err(Error::ForeignLeader {
                    holder,
                    epoch: on_lease,
                });
            }
            let next = floor
                .max(self.epoch)
                .max(store.inner.highest.load(Ordering::SeqCst))
                .checked_add(1)
                .ok_or(Error::Exhausted)?;
            let Some(epoch) = store.claim(lease, next).await? else {
                conflict_pause(1).await;
                continue;
            };
            warn!(identity = %store.inner.identity, from = self.epoch, to = next, floor, "epoch regressed on the Lease; reclaimed above the receivers' fence");
            self.epoch = epoch;
            return Ok(epoch);
        }
        Err(Error::TooManyConflicts(store.inner.attempts))
    }

    /// Ends the term and releases the Lease (holder empty, `leaseDurationSeconds: 1`), so only
    /// a fresh acquisition, with a fresh bump, continues. The elector then sees the Lease
    /// taken at its next renew and re-enters election.
    pub async fn stand_down(self, reason: &str) -> Result<()> {
        let store = &self.store;
        store.inner.current.store(0, Ordering::SeqCst);
        info!(identity = %store.inner.identity, epoch = self.epoch, reason, "standing down");
        for _ in 0..store.inner.attempts {
            let mut lease = store.get().await?;
            if EpochStore::holder(&lease) != store.inner.identity {
                return Ok(());
            }
            let now = MicroTime(
                Timestamp::from_microsecond(Timestamp::now().as_microsecond())
                    .unwrap_or_else(|_| Timestamp::now()),
            );
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            spec.holder_identity = Some(String::new());
            spec.lease_duration_seconds = Some(1);
            spec.acquire_time = Some(now.clone());
            spec.renew_time = Some(now);
            lease.metadata.managed_fields = None;
            if store.put(&lease).await?.is_some() {
                return Ok(());
            }
        }
        Err(Error::TooManyConflicts(store.inner.attempts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_decimal_u64() {
        assert_eq!(parse_epoch(None), Ok(0));
        assert_eq!(parse_epoch(Some("0")), Ok(0));
        assert_eq!(parse_epoch(Some("42")), Ok(42));
        assert_eq!(parse_epoch(Some("18446744073709551615")), Ok(u64::MAX));
        for (value, reason) in [
            ("", "it is empty"),
            ("-1", "it is negative"),
            ("1.5", "it is not a decimal integer"),
            (" 7", "it is not a decimal integer"),
            ("+7", "it is not a decimal integer"),
            ("0x10", "it is not a decimal integer"),
            ("007", "it has leading zeros"),
            ("18446744073709551616", "it overflows u64"),
        ] {
            let err = parse_epoch(Some(value)).expect_err(value);
            assert_eq!(err.reason, reason, "{value:?}");
            assert!(err.to_string().contains(EPOCH_ANNOTATION) && err.to_string().contains(value));
        }
    }
}
