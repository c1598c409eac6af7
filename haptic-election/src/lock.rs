//! The Lease lock: the API calls client-go's resourcelock makes, each bounded by a timeout.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{ObjectMeta, PostParams},
};

/// Why one Lease request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    /// 409 Conflict: the resourceVersion we sent is stale.
    #[error("conflict: the Lease changed since it was read")]
    Conflict,
    /// 409 AlreadyExists on create: another replica created it first.
    #[error("the Lease already exists")]
    AlreadyExists,
    /// The request did not finish within its timeout.
    #[error("request timed out after {0:?}")]
    Timeout(Duration),
    /// Any other API or transport error.
    #[error(transparent)]
    Api(#[from] kube::Error),
}

impl LockError {
    /// Whether the write was refused because our copy of the Lease is stale or gone (409, or
    /// 404 / 422 after the Lease was deleted and recreated): re-read rather than retry blindly.
    pub(crate) fn needs_reread(&self) -> bool {
        match self {
            Self::Conflict => true,
            Self::Api(kube::Error::Api(status)) => status.code == 404 || status.code == 422,
            _ => false,
        }
    }
}

/// The holder record kept in a Lease's spec.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Record {
    pub(crate) holder: String,
    pub(crate) duration_secs: i32,
    pub(crate) acquire: Option<Timestamp>,
    pub(crate) renew: Option<Timestamp>,
    pub(crate) transitions: i32,
}

impl Record {
    pub(crate) fn of(lease: &Lease) -> Self {
        let spec = lease.spec.clone().unwrap_or_default();
        Self {
            holder: spec.holder_identity.unwrap_or_default(),
            duration_secs: spec.lease_duration_seconds.unwrap_or_default(),
            acquire: spec.acquire_time.map(|t| t.0),
            renew: spec.renew_time.map(|t| t.0),
            transitions: spec.lease_transitions.unwrap_or_default(),
        }
    }

    pub(crate) fn apply_to(&self, lease: &mut Lease) {
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.holder.clone());
        spec.lease_duration_seconds = Some(self.duration_secs);
        spec.acquire_time = self.acquire.map(MicroTime);
        spec.renew_time = self.renew.map(MicroTime);
        spec.lease_transitions = Some(self.transitions);
    }
}

/// Wall-clock time truncated to microseconds, as a MicroTime holds it.
pub(crate) fn now_micros() -> Timestamp {
    let now = Timestamp::now();
    let micros = now.as_microsecond();
    Timestamp::from_microsecond(micros).unwrap_or(now)
}

fn classify(error: kube::Error) -> LockError {
    match &error {
        kube::Error::Api(status) if status.code == 409 && status.reason == "AlreadyExists" => {
            LockError::AlreadyExists
        }
        kube::Error::Api(status) if status.code == 409 => LockError::Conflict,
        _ => LockError::Api(error),
    }
}

/// The Lease API of one elector.
#[derive(Clone)]
pub(crate) struct LeaseLock {
    pub(crate) api: Api<Lease>,
    pub(crate) name: String,
}

impl LeaseLock {
    async fn bounded<T>(
        timeout: Duration,
        fut: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, LockError> {
        match tokio::time::timeout(timeout, fut).await {
            Ok(result) => result.map_err(classify),
            Err(_) => Err(LockError::Timeout(timeout)),
        }
    }

    /// GET; `None` when the Lease does not exist.
    pub(crate) async fn get(&self, timeout: Duration) -> Result<Option<Lease>, LockError> {
        Self::bounded(timeout, self.api.get_opt(&self.name)).await
    }

    /// POST a new Lease holding `record`.
    pub(crate) async fn create(
        &self,
        record: &Record,
        timeout: Duration,
    ) -> Result<Lease, LockError> {
        let mut lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec: None,
        };
        record.apply_to(&mut lease);
        Self::bounded(timeout, self.api.create(&PostParams::default(), &lease)).await
    }

    /// PUT `lease` (carrying the resourceVersion it was read with) with `record` in its spec.
    pub(crate) async fn update(
        &self,
        lease: &Lease,
        record: &Record,
        timeout: Duration,
    ) -> Result<Lease, LockError> {
        let mut next = lease.clone();
        next.metadata.managed_fields = None;
        record.apply_to(&mut next);
        Self::bounded(
            timeout,
            self.api.replace(&self.name, &PostParams::default(), &next),
        )
        .await
    }
}
