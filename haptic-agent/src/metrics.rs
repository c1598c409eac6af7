//! The agent's metrics, rendered in the Prometheus text exposition format.

use std::{
    fmt::Write as _,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

/// Apply outcomes counted, in the order they are rendered.
const OUTCOMES: [&str; 9] = [
    "applied",
    "unchanged",
    "fenced",
    "superseded",
    "invalid",
    "refused_by_policy",
    "rolled_back",
    "rejected",
    "error",
];

/// Upper bounds (seconds) of the duration histograms.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, count) in BUCKETS.iter().zip(self.counts.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in BUCKETS.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Counters and histograms of one agent.
#[derive(Debug, Default)]
pub struct Metrics {
    applies: [AtomicU64; OUTCOMES.len()],
    fence: AtomicU64,
    generation: AtomicU64,
    reloads_avoided: AtomicU64,
    reload: Mutex<Histogram>,
    check: Mutex<Histogram>,
    apply: Mutex<Histogram>,
}

impl Metrics {
    /// Counts one apply with `outcome` (an [`ApplyResponse`](haptic_agent_client::ApplyResponse)
    /// outcome, `rejected` for 4xx, or `error`).
    pub fn count_apply(&self, outcome: &str) {
        let index = OUTCOMES
            .iter()
            .position(|known| *known == outcome)
            .unwrap_or(OUTCOMES.len() - 1);
        self.applies[index].fetch_add(1, Ordering::Relaxed);
    }

    /// The count of applies with `outcome`.
    pub fn applies(&self, outcome: &str) -> u64 {
        OUTCOMES
            .iter()
            .position(|known| *known == outcome)
            .map_or(0, |index| self.applies[index].load(Ordering::Relaxed))
    }

    /// Counts an apply made live through the runtime API, with no reload.
    pub fn count_reload_avoided(&self) {
        self.reloads_avoided.fetch_add(1, Ordering::Relaxed);
    }

    /// Applies made live with no reload so far.
    pub fn reloads_avoided(&self) -> u64 {
        self.reloads_avoided.load(Ordering::Relaxed)
    }

    /// Records the fence.
    pub fn set_fence(&self, fence: u64) {
        self.fence.store(fence, Ordering::Relaxed);
    }

    /// Records the generation live.
    pub fn set_generation(&self, generation: u64) {
        self.generation.store(generation, Ordering::Relaxed);
    }

    /// Records one reload (with its confirmation).
    pub fn observe_reload(&self, took: Duration) {
        if let Ok(mut histogram) = self.reload.lock() {
            histogram.observe(took.as_secs_f64());
        }
    }

    /// Records one `haproxy -c`.
    pub fn observe_check(&self, took: Duration) {
        if let Ok(mut histogram) = self.check.lock() {
            histogram.observe(took.as_secs_f64());
        }
    }

    /// Records one whole apply.
    pub fn observe_apply(&self, took: Duration) {
        if let Ok(mut histogram) = self.apply.lock() {
            histogram.observe(took.as_secs_f64());
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str(
            "# HELP haptic_agent_applies_total Applies by outcome.\n\
             # TYPE haptic_agent_applies_total counter\n",
        );
        for (outcome, count) in OUTCOMES.iter().zip(self.applies.iter()) {
            let _ = writeln!(
                out,
                "haptic_agent_applies_total{{outcome=\"{outcome}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP haptic_agent_fence The highest fencing epoch accepted.\n\
             # TYPE haptic_agent_fence gauge\nhaptic_agent_fence {}",
            self.fence.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP haptic_agent_live_generation Generation of the live set.\n\
             # TYPE haptic_agent_live_generation gauge\nhaptic_agent_live_generation {}",
            self.generation.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP haptic_agent_reloads_avoided_total Applies made live through the runtime API, with no reload.\n\
             # TYPE haptic_agent_reloads_avoided_total counter\nhaptic_agent_reloads_avoided_total {}",
            self.reloads_avoided()
        );
        let histograms = [
            (
                &self.reload,
                "haptic_agent_reload_duration_seconds",
                "HAProxy reloads through the master socket, confirmation included.",
            ),
            (
                &self.check,
                "haptic_agent_check_duration_seconds",
                "`haproxy -c` runs on staged sets.",
            ),
            (
                &self.apply,
                "haptic_agent_apply_duration_seconds",
                "Whole applies, fence to answer.",
            ),
        ];
        for (histogram, name, help) in histograms {
            if let Ok(histogram) = histogram.lock() {
                histogram.render(&mut out, name, help);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_cumulative_buckets() {
        let metrics = Metrics::default();
        metrics.count_apply("applied");
        metrics.count_apply("applied");
        metrics.count_apply("fenced");
        metrics.set_fence(9);
        metrics.observe_reload(Duration::from_millis(30));
        let text = metrics.render();
        assert!(text.contains("haptic_agent_applies_total{outcome=\"applied\"} 2\n"));
        assert!(text.contains("haptic_agent_applies_total{outcome=\"fenced\"} 1\n"));
        assert!(text.contains("haptic_agent_fence 9\n"));
        assert!(text.contains("haptic_agent_reload_duration_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(text.contains("haptic_agent_reload_duration_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("haptic_agent_reload_duration_seconds_count 1\n"));
    }
}
