//! Election settings: identity, Lease, the three durations, and their validation.

use std::time::Duration;

/// Why a configuration was refused; each message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The identity is empty.
    #[error("identity must not be empty (set POD_NAME or ElectionConfig::identity)")]
    EmptyIdentity,
    /// The Lease name is empty.
    #[error("lease name must not be empty")]
    EmptyLeaseName,
    /// The Lease namespace is empty.
    #[error(
        "lease namespace must not be empty (set POD_NAMESPACE or ElectionConfig::lease_namespace)"
    )]
    EmptyNamespace,
    /// A duration is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// LeaseDuration is not longer than RenewDeadline.
    #[error(
        "lease_duration ({lease_duration:?}) must be greater than renew_deadline ({renew_deadline:?}): a leader must give up before others may take the Lease"
    )]
    LeaseDurationNotAboveRenewDeadline {
        /// The configured LeaseDuration.
        lease_duration: Duration,
        /// The configured RenewDeadline.
        renew_deadline: Duration,
    },
    /// RenewDeadline is not longer than RetryPeriod x 1.2.
    #[error(
        "renew_deadline ({renew_deadline:?}) must be greater than retry_period x 1.2 ({min:?}): the leader must get at least one jittered renew in before its deadline"
    )]
    RenewDeadlineNotAboveRetryPeriod {
        /// The configured RenewDeadline.
        renew_deadline: Duration,
        /// RetryPeriod x 1.2.
        min: Duration,
    },
    /// The LeaseDuration does not fit the Lease's `leaseDurationSeconds` (whole seconds, i32).
    #[error("lease_duration ({0:?}) must be a whole number of seconds between 1 and 2147483647")]
    LeaseDurationNotWholeSeconds(Duration),
    /// An environment variable needed by [`ElectionConfig::from_env`] is missing.
    #[error("environment variable {0} is not set")]
    MissingEnv(&'static str),
}

/// The jitter factor applied to RetryPeriod: waits are drawn from `[RetryPeriod, RetryPeriod x 1.2)`.
pub const JITTER_FACTOR: f64 = 1.2;

/// Settings of one elector. Plain data with public fields; [`ElectionConfig::validate`] checks them.
///
/// The three durations, and why the defaults are 30 s / 20 s / 5 s (twice
/// kube-controller-manager's 15 / 10 / 2):
///
/// - `lease_duration`: how long followers wait, on their own monotonic clocks, after they last
///   saw the Lease change before they may take it. It bounds crash failover. It is written to
///   the Lease as `leaseDurationSeconds`, and every replica uses the value it reads there.
/// - `renew_deadline`: how long the leader keeps retrying a failing renew before it steps down
///   (`lease_expired`). It must be below `lease_duration`, so the leader gives up before any
///   follower can take over; the ratio `lease_duration / renew_deadline` (1.5 by default) is the
///   clock-rate skew the election survives: a follower whose clock runs up to 1.5x fast still
///   waits longer than the leader's deadline.
/// - `retry_period`: the interval between the leader's renews, and between followers' polls
///   when their watch is down (or always, with `poll_only`). Waits are jittered up to x1.2, so
///   `renew_deadline` must exceed `retry_period x 1.2`.
///
/// 30 / 20 / 5 keeps the leader's load at 12 writes a minute and survives an API server that
/// stalls for 15 s, at the price of a 30 s crash failover (graceful handoffs are immediate:
/// followers watch the Lease).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionConfig {
    /// This replica's identity, written as `holderIdentity`. Usually the pod name.
    pub identity: String,
    /// The Lease's name.
    pub lease_name: String,
    /// The Lease's namespace.
    pub lease_namespace: String,
    /// Default 30 s. See the type's docs.
    pub lease_duration: Duration,
    /// Default 20 s. See the type's docs.
    pub renew_deadline: Duration,
    /// Default 5 s. See the type's docs.
    pub retry_period: Duration,
    /// Upper bound on one API request; a hung request is abandoned after it. Default 5 s; a
    /// renew's request is also cut at the renew deadline.
    pub request_timeout: Duration,
    /// On cancellation, after the leader's work has returned, release the Lease (holder empty,
    /// `leaseDurationSeconds: 1`) so a follower takes over at once. Default true.
    pub release_on_cancel: bool,
    /// On cancellation keep the Lease as it is, even with `release_on_cancel`, so a successor
    /// elector with the same identity on this replica resumes without a vacancy. Default false.
    pub keep_lease_on_stop: bool,
    /// False: no election; this replica leads at once and makes no API calls. Default true.
    pub enabled: bool,
    /// Followers poll every RetryPeriod instead of watching the Lease (client-go's behaviour,
    /// kept for comparison). Default false.
    pub poll_only: bool,
    /// How long a stepping-down leader waits for its started-leading work to return before it
    /// goes on (releasing the Lease or re-entering election). Default 10 s.
    pub work_stop_timeout: Duration,
    /// Added to `lease_duration` by the health check before it fails a leader whose last
    /// successful renew is too old. Default 5 s.
    pub health_tolerance: Duration,
}

impl ElectionConfig {
    /// A config with the defaults for the given identity and Lease.
    pub fn new(
        identity: impl Into<String>,
        lease_name: impl Into<String>,
        lease_namespace: impl Into<String>,
    ) -> Self {
        Self {
            identity: identity.into(),
            lease_name: lease_name.into(),
            lease_namespace: lease_namespace.into(),
            lease_duration: Duration::from_secs(30),
            renew_deadline: Duration::from_secs(20),
            retry_period: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            release_on_cancel: true,
            keep_lease_on_stop: false,
            enabled: true,
            poll_only: false,
            work_stop_timeout: Duration::from_secs(10),
            health_tolerance: Duration::from_secs(5),
        }
    }

    /// A config for `lease_name` with the identity from `POD_NAME` and the namespace from
    /// `POD_NAMESPACE` (set them with the downward API).
    pub fn from_env(lease_name: impl Into<String>) -> Result<Self, ConfigError> {
        let identity =
            std::env::var("POD_NAME").map_err(|_| ConfigError::MissingEnv("POD_NAME"))?;
        let namespace =
            std::env::var("POD_NAMESPACE").map_err(|_| ConfigError::MissingEnv("POD_NAMESPACE"))?;
        let config = Self::new(identity, lease_name, namespace);
        config.validate()?;
        Ok(config)
    }

    /// Sets the three durations.
    #[must_use]
    pub fn with_durations(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry_period;
        self
    }

    /// Sets the per-request timeout.
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets `release_on_cancel`.
    #[must_use]
    pub fn with_release_on_cancel(mut self, release: bool) -> Self {
        self.release_on_cancel = release;
        self
    }

    /// Sets `keep_lease_on_stop`.
    #[must_use]
    pub fn with_keep_lease_on_stop(mut self, keep: bool) -> Self {
        self.keep_lease_on_stop = keep;
        self
    }

    /// Sets `enabled`.
    #[must_use]
    pub fn with_enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Sets `poll_only`.
    #[must_use]
    pub fn with_poll_only(mut self, poll_only: bool) -> Self {
        self.poll_only = poll_only;
        self
    }

    /// Checks the rules: identity, Lease name and namespace not empty; every duration above
    /// zero; `lease_duration > renew_deadline > retry_period x 1.2`; `lease_duration` in whole
    /// seconds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.identity.trim().is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        if !self.enabled {
            return Ok(());
        }
        if self.lease_name.trim().is_empty() {
            return Err(ConfigError::EmptyLeaseName);
        }
        if self.lease_namespace.trim().is_empty() {
            return Err(ConfigError::EmptyNamespace);
        }
        for (name, value) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
            ("request_timeout", self.request_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(ConfigError::LeaseDurationNotAboveRenewDeadline {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        let min = self.retry_period.mul_f64(JITTER_FACTOR);
        if self.renew_deadline <= min {
            return Err(ConfigError::RenewDeadlineNotAboveRetryPeriod {
                renew_deadline: self.renew_deadline,
                min,
            });
        }
        if self.lease_duration.subsec_nanos() != 0
            || i32::try_from(self.lease_duration.as_secs()).is_err()
        {
            return Err(ConfigError::LeaseDurationNotWholeSeconds(
                self.lease_duration,
            ));
        }
        Ok(())
    }

    /// `leaseDurationSeconds` as written to the Lease.
    pub(crate) fn lease_duration_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ElectionConfig {
        ElectionConfig::new("pod-a", "lease", "default")
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(base().validate(), Ok(()));
    }

    #[test]
    fn each_rule_is_named() {
        let s = Duration::from_secs;
        let cases: Vec<(ElectionConfig, &str)> = vec![
            (
                ElectionConfig {
                    identity: " ".into(),
                    ..base()
                },
                "identity must not be empty",
            ),
            (
                ElectionConfig {
                    lease_name: String::new(),
                    ..base()
                },
                "lease name must not be empty",
            ),
            (
                ElectionConfig {
                    lease_namespace: String::new(),
                    ..base()
                },
                "lease namespace must not be empty",
            ),
            (
                base().with_durations(s(0), s(20), s(5)),
                "lease_duration must be greater than zero",
            ),
            (
                base().with_durations(s(30), s(0), s(5)),
                "renew_deadline must be greater than zero",
            ),
            (
                base().with_durations(s(30), s(20), s(0)),
                "retry_period must be greater than zero",
            ),
            (
                base().with_durations(s(20), s(20), s(5)),
                "must be greater than renew_deadline",
            ),
            (
                base().with_durations(s(30), s(6), s(5)),
                "must be greater than retry_period x 1.2",
            ),
            (
                base().with_durations(Duration::from_millis(30_500), s(20), s(5)),
                "whole number of seconds",
            ),
        ];
        for (config, rule) in cases {
            let err = config.validate().expect_err(rule).to_string();
            assert!(err.contains(rule), "{err:?} should name {rule:?}");
        }
    }

    #[test]
    fn disabled_needs_only_an_identity() {
        let config = ElectionConfig {
            lease_name: String::new(),
            ..base()
        }
        .with_enabled(false);
        assert_eq!(config.validate(), Ok(()));
    }
}
