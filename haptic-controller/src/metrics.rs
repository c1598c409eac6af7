//! The controller's metrics, under HAPTIC's names and types, recorded through the OpenTelemetry
//! API only. The SDK and the Prometheus exporter are the binary's: it installs a global meter
//! provider before the daemon starts and hands the daemon an [`Exposition`] to serve on
//! `/metrics`. The names are the exported Prometheus names (the binary's exporter adds no unit
//! or `_total` suffix).
//!
//! The instruments are made once, on first use, on the global provider's `haptic-controller`
//! meter ([`get`]). Most are fed from the bus by [`Metrics::on_event`] (the observer sees every
//! event); the scheduler records deployments itself; [`observe`] registers the gauges and
//! counters read at each collection (store sizes, bus drops). Adding a counter is a field and
//! one line in [`Metrics::new`]: `webhook_requests: counter(meter, "haptic_webhook_requests_total", "...")`.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use haptic_eventbus::{BusStats, EventBus};
use opentelemetry::{
    KeyValue,
    metrics::{Counter, Histogram, Meter},
};

use crate::{events::ControllerEvent, state::StateCache};

/// Upper bounds (seconds) of the duration histograms: HAPTIC's 0.01 .. 10 s.
pub const BUCKETS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Every metric name the controller exports (the leadership adapter's three included).
pub const NAMES: [&str; 16] = [
    "haptic_change_to_render_seconds",
    "haptic_standby_renders_total",
    "haptic_reconciliation_duration_seconds",
    "haptic_reconciliation_total",
    "haptic_reconciliation_errors_total",
    "haptic_deployment_duration_seconds",
    "haptic_deployment_total",
    "haptic_deployment_errors_total",
    "haptic_validation_total",
    "haptic_validation_errors_total",
    "haptic_resource_count",
    "haptic_events_published_total",
    "haptic_events_dropped_total",
    haptic_leadership::metrics::IS_LEADER,
    haptic_leadership::metrics::TRANSITIONS_TOTAL,
    haptic_leadership::metrics::TIME_AS_LEADER_SECONDS_TOTAL,
];

/// Renders the metrics page in the Prometheus text format (the type both binaries share).
pub use haptic_serve::Exposition;

fn counter(meter: &Meter, name: &'static str, help: &'static str) -> Counter<u64> {
    meter.u64_counter(name).with_description(help).build()
}

fn seconds(meter: &Meter, name: &'static str, help: &'static str) -> Histogram<f64> {
    meter
        .f64_histogram(name)
        .with_description(help)
        .with_unit("s")
        .with_boundaries(BUCKETS.to_vec())
        .build()
}

/// The controller's instruments.
#[derive(Debug)]
pub struct Metrics {
    /// `haptic_change_to_render_seconds`: from a store change to the render that covers it.
    pub change_to_render: Histogram<f64>,
    /// `haptic_reconciliation_duration_seconds`: one render of the file set.
    pub reconciliation_duration: Histogram<f64>,
    /// `haptic_reconciliation_total`: renders, good or not.
    pub reconciliation_total: Counter<u64>,
    /// `haptic_reconciliation_errors_total`: renders that failed.
    pub reconciliation_errors: Counter<u64>,
    /// `haptic_deployment_duration_seconds`: one apply to one pod, sent to answered.
    pub deployment_duration: Histogram<f64>,
    /// `haptic_deployment_total`: applies answered (or timed out), per pod.
    pub deployment_total: Counter<u64>,
    /// `haptic_deployment_errors_total`: applies that failed.
    pub deployment_errors: Counter<u64>,
    /// `haptic_validation_total{stage}`: HTC validations (`config`) and render gate verdicts
    /// (`render`: the policy and `haproxy -c`).
    pub validation_total: Counter<u64>,
    /// `haptic_validation_errors_total{stage}`: those that refused.
    pub validation_errors: Counter<u64>,
    /// `haptic_events_published_total`: events on the bus.
    pub events_published: Counter<u64>,
    /// `haptic_webhook_requests_total{gvk,result}`: admission reviews answered.
    pub webhook_requests: Counter<u64>,
    /// `haptic_standby_renders_total`: renders of the warm standby (a replica not leading).
    pub standby_renders: Counter<u64>,
}

impl Metrics {
    /// The instruments on `meter`.
    pub fn new(meter: &Meter) -> Self {
        let metrics = Self {
            reconciliation_duration: seconds(
                meter,
                "haptic_reconciliation_duration_seconds",
                "Time to render the HAProxy file set.",
            ),
            change_to_render: seconds(
                meter,
                "haptic_change_to_render_seconds",
                "From a store change (a watch event applied) to the start of the render that covers it: the reconciler's window and a render in progress.",
            ),
            reconciliation_total: counter(meter, "haptic_reconciliation_total", "Renders."),
            reconciliation_errors: counter(
                meter,
                "haptic_reconciliation_errors_total",
                "Renders that failed.",
            ),
            deployment_duration: seconds(
                meter,
                "haptic_deployment_duration_seconds",
                "Time of one apply to one HAProxy pod's agent, sent to answered.",
            ),
            deployment_total: counter(meter, "haptic_deployment_total", "Applies, per pod."),
            deployment_errors: counter(
                meter,
                "haptic_deployment_errors_total",
                "Applies that failed.",
            ),
            validation_total: counter(
                meter,
                "haptic_validation_total",
                "Validations: of the HTC (stage=config) and of rendered sets (stage=render).",
            ),
            validation_errors: counter(
                meter,
                "haptic_validation_errors_total",
                "Validations that refused.",
            ),
            events_published: counter(
                meter,
                "haptic_events_published_total",
                "Events published on the controller's bus.",
            ),
            webhook_requests: counter(
                meter,
                "haptic_webhook_requests_total",
                "Admission reviews answered, by the object's group/version/kind and the answer.",
            ),
            standby_renders: counter(
                meter,
                "haptic_standby_renders_total",
                "Renders of the warm standby: a replica that does not lead keeping its renderer warm for a handoff (the set dropped).",
            ),
        };
        // Counters are on the page from the start, at 0 (an alert on their rate needs them).
        for counter in [
            &metrics.reconciliation_total,
            &metrics.reconciliation_errors,
            &metrics.deployment_total,
            &metrics.deployment_errors,
            &metrics.events_published,
            &metrics.standby_renders,
        ] {
            counter.add(0, &[]);
        }
        for stage in ["config", "render"] {
            let stage = [KeyValue::new("stage", stage)];
            metrics.validation_total.add(0, &stage);
            metrics.validation_errors.add(0, &stage);
        }
        metrics
    }

    /// Counts what `event` says happened; the observer calls it for every event on the bus.
    pub fn on_event(&self, event: &ControllerEvent) {
        self.events_published.add(1, &[]);
        match event {
            ControllerEvent::Rendered(set) => {
                self.reconciliation_total.add(1, &[]);
                self.reconciliation_duration
                    .record(set.render_time.as_secs_f64(), &[]);
            }
            ControllerEvent::RenderFailed(_) => {
                self.reconciliation_total.add(1, &[]);
                self.reconciliation_errors.add(1, &[]);
            }
            ControllerEvent::ConfigVerdict(verdict) => {
                self.validation("config", verdict.errors.is_empty());
            }
            ControllerEvent::GateVerdict(verdict) => {
                self.validation("render", verdict.refused.is_none());
            }
            _ => {}
        }
    }

    fn validation(&self, stage: &'static str, passed: bool) {
        let stage = [KeyValue::new("stage", stage)];
        self.validation_total.add(1, &stage);
        if !passed {
            self.validation_errors.add(1, &stage);
        }
    }

    /// Records the wait from a store change to the render that covers it.
    pub fn change_to_render(&self, waited: Duration) {
        self.change_to_render.record(waited.as_secs_f64(), &[]);
    }

    /// Counts one render of the warm standby.
    pub fn standby_render(&self) {
        self.standby_renders.add(1, &[]);
    }

    /// Records one apply's answer.
    pub fn deployment(&self, took: Duration, ok: bool) {
        self.deployment_total.add(1, &[]);
        self.deployment_duration.record(took.as_secs_f64(), &[]);
        if !ok {
            self.deployment_errors.add(1, &[]);
        }
    }
}

/// The process's instruments, made on first use on the global provider's `haptic-controller`
/// meter: install the provider before the daemon runs.
pub fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| Metrics::new(&opentelemetry::global::meter("haptic-controller")))
}

/// Registers the instruments read at each collection on the global meter:
/// `haptic_resource_count{type}` (objects in each watched store, `type` the store name) and
/// `haptic_events_dropped_total` (events lost by lossy subscribers and by the pre-start buffer).
pub fn observe(cache: Arc<StateCache>, bus: EventBus<ControllerEvent>) {
    // The counters are made (at 0) now, not at the first event.
    get();
    let meter = opentelemetry::global::meter("haptic-controller");
    meter
        .u64_observable_gauge("haptic_resource_count")
        .with_description("Objects in each watched store.")
        .with_callback(move |observer| {
            // A collection must not wait: while a watcher writes, this one scrape skips it.
            let Some(state) = cache.try_read() else {
                return;
            };
            for (store, contents) in state.stores.iter() {
                observer.observe(
                    contents.len() as u64,
                    &[KeyValue::new("type", store.to_owned())],
                );
            }
        })
        .build();
    let drops = Mutex::new(DropCount::default());
    meter
        .u64_observable_counter("haptic_events_dropped_total")
        .with_description("Events dropped: lossy subscribers' full queues and buffer overflows.")
        .with_callback(move |observer| {
            let total = drops
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .update(&bus.stats());
            observer.observe(total, &[]);
        })
        .build();
}

/// The bus's drops as a counter. A subscription's drops vanish from the bus's stats when it
/// closes, so the count adds each live subscription's increase since the last look: it never
/// goes down.
#[derive(Debug, Default)]
struct DropCount {
    total: u64,
    per_subscription: BTreeMap<u64, u64>,
    overflows: u64,
}

impl DropCount {
    fn update(&mut self, stats: &BusStats) -> u64 {
        let mut next = BTreeMap::new();
        for sub in &stats.subscribers {
            let before = self.per_subscription.get(&sub.id).copied().unwrap_or(0);
            self.total += sub.dropped.saturating_sub(before);
            next.insert(sub.id, sub.dropped);
        }
        self.total += stats.buffer_overflows.saturating_sub(self.overflows);
        self.overflows = stats.buffer_overflows;
        self.per_subscription = next;
        self.total
    }
}

#[cfg(test)]
mod tests {
    use haptic_eventbus::{Filter, SubscribeParams};

    use super::*;

    #[test]
    fn drops_are_counted_once_and_never_go_down_when_a_subscription_closes() {
        let bus = EventBus::<ControllerEvent>::new();
        bus.start();
        let lossy = bus.subscribe_with(SubscribeParams::new("slow", Filter::all()).with_lossy(1));
        for _ in 0..3 {
            bus.publish(ControllerEvent::StoresChanged { store: "s".into() });
        }
        let mut drops = DropCount::default();
        assert_eq!(
            drops.update(&bus.stats()),
            2,
            "a queue of one kept the first"
        );
        assert_eq!(drops.update(&bus.stats()), 2, "counted once");
        drop(lossy);
        assert_eq!(
            drops.update(&bus.stats()),
            2,
            "the closed subscription's drops stay"
        );
        let lossy = bus.subscribe_with(SubscribeParams::new("slow", Filter::all()).with_lossy(1));
        for _ in 0..2 {
            bus.publish(ControllerEvent::StoresChanged { store: "s".into() });
        }
        assert_eq!(drops.update(&bus.stats()), 3);
        drop(lossy);
    }
}
