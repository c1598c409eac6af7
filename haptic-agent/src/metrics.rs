//! The agent's metrics, recorded through the OpenTelemetry API. The SDK and the Prometheus
//! exporter are the binary's: it installs them, hands the agent a [`Meter`] (or sets the global
//! provider) and an [`Exposition`] that renders the `/metrics` page. The names below are the
//! exported Prometheus names (the binary's exporter adds no unit or `_total` suffix).
//!
//! Adding a counter is one field and one line in [`Metrics::new`], as
//! `haptic_agent_reloads_avoided_total` is.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use opentelemetry::{
    KeyValue,
    metrics::{Counter, Gauge, Histogram, Meter, ObservableCounter},
};

/// Apply outcomes counted; anything else counts as `error`.
pub const OUTCOMES: [&str; 10] = [
    "applied",
    "unchanged",
    "fenced",
    "superseded",
    "invalid",
    "refused_by_policy",
    "base_mismatch",
    "rolled_back",
    "rejected",
    "error",
];

/// Upper bounds (seconds) of the duration histograms.
pub const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// `haptic_agent_applies_total{outcome}`.
pub const APPLIES_TOTAL: &str = "haptic_agent_applies_total";
/// `haptic_agent_fence`.
pub const FENCE: &str = "haptic_agent_fence";
/// `haptic_agent_live_generation`.
pub const LIVE_GENERATION: &str = "haptic_agent_live_generation";
/// `haptic_agent_master_cli_connections_total`.
pub const MASTER_CLI_CONNECTIONS_TOTAL: &str = "haptic_agent_master_cli_connections_total";
/// Applies made live through the runtime API, with no reload.
pub const RELOADS_AVOIDED_TOTAL: &str = "haptic_agent_reloads_avoided_total";
/// Deltas that built on the live set (a `base_mismatch` is counted among the applies).
pub const DELTAS_TOTAL: &str = "haptic_agent_deltas_total";
/// The live set read from disk and hashed whole (not held in memory, or not as on disk).
pub const LIVE_SET_READS_TOTAL: &str = "haptic_agent_live_set_reads_total";
/// Applies being worked on now (at most one past the fence at a time; others wait for it).
pub const APPLIES_IN_FLIGHT: &str = "haptic_agent_applies_in_flight";
/// `haptic_agent_reload_duration_seconds`.
pub const RELOAD_DURATION: &str = "haptic_agent_reload_duration_seconds";
/// `haptic_agent_check_duration_seconds`.
pub const CHECK_DURATION: &str = "haptic_agent_check_duration_seconds";
/// `haptic_agent_apply_duration_seconds`.
pub const APPLY_DURATION: &str = "haptic_agent_apply_duration_seconds";

/// Renders the metrics page in the Prometheus text format (the type both binaries share).
pub use haptic_serve::Exposition;

fn counter(meter: &Meter, name: &'static str, help: &'static str) -> Counter<u64> {
    meter.u64_counter(name).with_description(help).build()
}

fn gauge(meter: &Meter, name: &'static str, help: &'static str) -> Gauge<u64> {
    meter.u64_gauge(name).with_description(help).build()
}

fn seconds(meter: &Meter, name: &'static str, help: &'static str) -> Histogram<f64> {
    meter
        .f64_histogram(name)
        .with_description(help)
        .with_unit("s")
        .with_boundaries(BUCKETS.to_vec())
        .build()
}

/// The instruments of one agent.
#[derive(Debug)]
pub struct Metrics {
    applies: Counter<u64>,
    fence: Gauge<u64>,
    generation: Gauge<u64>,
    reload: Histogram<f64>,
    check: Histogram<f64>,
    apply: Histogram<f64>,
    reloads_avoided: Counter<u64>,
    deltas: Counter<u64>,
    live_set_reads: Counter<u64>,
    /// The same count, for `/v1/state`.
    reloads_avoided_count: AtomicU64,
    /// Applies in flight, read at each collection.
    in_flight: Arc<AtomicU64>,
    _in_flight_gauge: opentelemetry::metrics::ObservableGauge<u64>,
    // Kept so the callback lives as long as the agent.
    _cli_connections: Option<ObservableCounter<u64>>,
}

impl Metrics {
    /// The instruments on `meter`; `cli_connections` (read at each collection) backs
    /// `haptic_agent_master_cli_connections_total`.
    pub fn new(meter: &Meter, cli_connections: Option<Arc<dyn Fn() -> u64 + Send + Sync>>) -> Self {
        let in_flight = Arc::new(AtomicU64::new(0));
        let read = in_flight.clone();
        let metrics = Self {
            _in_flight_gauge: meter
                .u64_observable_gauge(APPLIES_IN_FLIGHT)
                .with_description(
                    "Applies being worked on now (one past the fence at a time, the rest waiting for it).",
                )
                .with_callback(move |observer| observer.observe(read.load(Ordering::Relaxed), &[]))
                .build(),
            in_flight,
            applies: counter(meter, APPLIES_TOTAL, "Applies by outcome."),
            fence: gauge(meter, FENCE, "The highest fencing epoch accepted."),
            generation: gauge(meter, LIVE_GENERATION, "Generation of the live set."),
            reload: seconds(
                meter,
                RELOAD_DURATION,
                "HAProxy reloads through the master socket, confirmation included.",
            ),
            check: seconds(meter, CHECK_DURATION, "`haproxy -c` runs on staged sets."),
            apply: seconds(meter, APPLY_DURATION, "Whole applies, fence to answer."),
            reloads_avoided: counter(
                meter,
                RELOADS_AVOIDED_TOTAL,
                "Applies made live through the runtime API, with no reload.",
            ),
            deltas: counter(
                meter,
                DELTAS_TOTAL,
                "Deltas that built on the live set: what changed, not the whole set.",
            ),
            live_set_reads: counter(
                meter,
                LIVE_SET_READS_TOTAL,
                "The live set read from disk and hashed whole: at start, after a rollback to a \
                 set memory no longer held, or when its files on disk were not as written.",
            ),
            reloads_avoided_count: AtomicU64::new(0),
            _cli_connections: cli_connections.map(|read| {
                meter
                    .u64_observable_counter(MASTER_CLI_CONNECTIONS_TOTAL)
                    .with_description("Connections made to HAProxy's master CLI.")
                    .with_callback(move |observer| observer.observe(read(), &[]))
                    .build()
            }),
        };
        // Every outcome is on the page from the start, at 0, as before.
        for outcome in OUTCOMES {
            metrics.applies.add(0, &[KeyValue::new("outcome", outcome)]);
        }
        metrics.reloads_avoided.add(0, &[]);
        metrics.deltas.add(0, &[]);
        metrics.live_set_reads.add(0, &[]);
        metrics
    }

    /// An apply starts: counted in flight until the guard drops.
    pub fn apply_started(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.in_flight.clone())
    }

    /// Counts a read of the whole live set from disk.
    pub fn count_live_set_read(&self) {
        self.live_set_reads.add(1, &[]);
    }

    /// Counts a delta that built on the live set.
    pub fn count_delta(&self) {
        self.deltas.add(1, &[]);
    }

    /// Counts one apply with `outcome` (an [`ApplyResponse`](haptic_agent_client::ApplyResponse)
    /// outcome, `rejected` for 4xx, or `error`).
    pub fn count_apply(&self, outcome: &str) {
        let outcome = OUTCOMES
            .iter()
            .find(|known| **known == outcome)
            .copied()
            .unwrap_or("error");
        self.applies.add(1, &[KeyValue::new("outcome", outcome)]);
    }

    /// Records the fence.
    pub fn set_fence(&self, fence: u64) {
        self.fence.record(fence, &[]);
    }

    /// Records the generation live.
    pub fn set_generation(&self, generation: u64) {
        self.generation.record(generation, &[]);
    }

    /// Records one reload (with its confirmation).
    pub fn observe_reload(&self, took: Duration) {
        self.reload.record(took.as_secs_f64(), &[]);
    }

    /// Records one `haproxy -c`.
    pub fn observe_check(&self, took: Duration) {
        self.check.record(took.as_secs_f64(), &[]);
    }

    /// Records one whole apply.
    pub fn observe_apply(&self, took: Duration) {
        self.apply.record(took.as_secs_f64(), &[]);
    }

    /// Counts one apply made live through the runtime API, with no reload.
    pub fn count_reload_avoided(&self) {
        self.reloads_avoided.add(1, &[]);
        self.reloads_avoided_count.fetch_add(1, Ordering::Relaxed);
    }

    /// How many applies went live with no reload since the agent started.
    pub fn reloads_avoided(&self) -> u64 {
        self.reloads_avoided_count.load(Ordering::Relaxed)
    }
}

impl Default for Metrics {
    /// On the global meter provider's `haptic-agent` meter (a no-op until the binary installs
    /// one), without the master CLI counter.
    fn default() -> Self {
        Self::new(&opentelemetry::global::meter("haptic-agent"), None)
    }
}

/// An apply in flight ([`Metrics::apply_started`]); dropping it ends it.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicU64>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
