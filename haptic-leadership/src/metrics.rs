//! Leadership metrics under HAPTIC's names: the adapter keeps them in atomics, and
//! [`LeadershipMetrics::register`] exports them through the OpenTelemetry API as observable
//! instruments read at each collection (the time as leader includes the current term). The SDK
//! and exporter are the application's; the names are the exported Prometheus names.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use opentelemetry::metrics::Meter;

// tokio's clock is the monotonic clock in production, and the paused clock in tests.
use tokio::time::Instant;

/// `haptic_leader_election_is_leader`: 1 while this replica leads.
pub const IS_LEADER: &str = "haptic_leader_election_is_leader";
/// `haptic_leader_election_transitions_total`: terms started and ended on this replica.
pub const TRANSITIONS_TOTAL: &str = "haptic_leader_election_transitions_total";
/// `haptic_leader_election_time_as_leader_seconds_total`: time this replica has led.
pub const TIME_AS_LEADER_SECONDS_TOTAL: &str =
    "haptic_leader_election_time_as_leader_seconds_total";

/// `haptic_component_failures_total{component, cause}`: supervised components that panicked
/// (`cause="panic"`) or returned while they should have run on (`cause="returned"`).
pub const COMPONENT_FAILURES_TOTAL: &str = "haptic_component_failures_total";

/// The metric hooks the adapter drives. Share it (`Arc`) with the metrics endpoint.
#[derive(Debug, Default)]
pub struct LeadershipMetrics {
    is_leader: AtomicBool,
    transitions: AtomicU64,
    led_micros: AtomicU64,
    since: Mutex<Option<Instant>>,
    /// Failures per (component, cause).
    failures: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Why this replica is unhealthy: an all-replica component (or, with election disabled,
    /// a leader-only one) failed, and only a restart of the process brings it back.
    unhealthy: Mutex<Option<String>>,
}

impl LeadershipMetrics {
    /// Zeroed metrics.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn became_leader(&self) {
        self.is_leader.store(true, Ordering::SeqCst);
        self.transitions.fetch_add(1, Ordering::SeqCst);
        *self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }

    pub(crate) fn lost_leadership(&self) {
        if !self.is_leader.swap(false, Ordering::SeqCst) {
            return;
        }
        self.transitions.fetch_add(1, Ordering::SeqCst);
        if let Some(since) = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            let micros = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.led_micros.fetch_add(micros, Ordering::SeqCst);
        }
    }

    pub(crate) fn component_failed(&self, component: &str, cause: &'static str) {
        *self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((component.to_owned(), cause))
            .or_default() += 1;
    }

    pub(crate) fn set_unhealthy(&self, why: String) {
        self.unhealthy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert(why);
    }

    /// How often `component` failed so far (panics and unexpected returns).
    pub fn component_failures(&self, component: &str) -> u64 {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|((name, _), _)| name == component)
            .map(|(_, n)| n)
            .sum()
    }

    /// `Err(why)` once a component failed in a way only a process restart repairs (an
    /// all-replica component, or a leader-only one with election disabled): serve it on
    /// `/healthz` so the kubelet restarts the replica.
    pub fn health(&self) -> Result<(), String> {
        match &*self
            .unhealthy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// Whether this replica leads.
    pub fn is_leader(&self) -> bool {
        self.is_leader.load(Ordering::SeqCst)
    }

    /// Transitions so far (each acquisition and each loss counts one).
    pub fn transitions(&self) -> u64 {
        self.transitions.load(Ordering::SeqCst)
    }

    /// Total time as leader, including the current term.
    pub fn time_as_leader(&self) -> Duration {
        let past = Duration::from_micros(self.led_micros.load(Ordering::SeqCst));
        let current = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map(|s| s.elapsed())
            .unwrap_or_default();
        past + current
    }

    /// Exports the three metrics on `meter` (HAPTIC's types: a gauge and two counters). Call
    /// it once per meter provider; the instruments live as long as the provider.
    pub fn register(self: &Arc<Self>, meter: &Meter) {
        let this = self.clone();
        meter
            .u64_observable_gauge(IS_LEADER)
            .with_description("Whether this replica holds the leader Lease (1) or not (0).")
            .with_callback(move |o| o.observe(u64::from(this.is_leader()), &[]))
            .build();
        let this = self.clone();
        meter
            .u64_observable_counter(TRANSITIONS_TOTAL)
            .with_description("Leadership transitions (acquisitions and losses) on this replica.")
            .with_callback(move |o| o.observe(this.transitions(), &[]))
            .build();
        let this = self.clone();
        meter
            .f64_observable_counter(TIME_AS_LEADER_SECONDS_TOTAL)
            .with_description("Seconds this replica has been the leader.")
            .with_unit("s")
            .with_callback(move |o| o.observe(this.time_as_leader().as_secs_f64(), &[]))
            .build();
        let this = self.clone();
        meter
            .u64_observable_counter(COMPONENT_FAILURES_TOTAL)
            .with_description(
                "Supervised components that panicked or returned while they should have run on.",
            )
            .with_callback(move |o| {
                let failures = this
                    .failures
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for ((component, cause), n) in failures.iter() {
                    o.observe(
                        *n,
                        &[
                            opentelemetry::KeyValue::new("component", component.clone()),
                            opentelemetry::KeyValue::new("cause", *cause),
                        ],
                    );
                }
            })
            .build();
    }
}
