//! Measurements criterion does not make: peak resident memory of one call, and a median time
//! for the summary table.

use std::time::{Duration, Instant};

/// A field of /proc/self/status in KiB (`VmRSS`, `VmHWM`), on Linux.
fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Peak memory of one call, from the kernel's resident-set high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakMemory {
    /// Resident set before the call, KiB.
    pub before_kib: u64,
    /// Highest resident set during the call, KiB.
    pub peak_kib: u64,
}

impl PeakMemory {
    /// How far the call raised the resident set above where it started, KiB.
    pub fn growth_kib(&self) -> u64 {
        self.peak_kib.saturating_sub(self.before_kib)
    }
}

/// Runs `f` once and reports the resident-set high-water mark during it: the mark is reset
/// first (`/proc/self/clear_refs`, Linux 4.0+). `None` where that is not available.
pub fn peak_memory<T>(f: impl FnOnce() -> T) -> (T, Option<PeakMemory>) {
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = status_kib("VmRSS");
    let out = f();
    let peak = status_kib("VmHWM");
    let memory = match (reset, before, peak) {
        (true, Some(before_kib), Some(peak_kib)) => Some(PeakMemory {
            before_kib,
            peak_kib,
        }),
        _ => None,
    };
    (out, memory)
}

/// The median duration of `runs` calls of `f` (at least one), after one warm-up call.
pub fn median<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    std::hint::black_box(f());
    let mut times: Vec<Duration> = (0..runs.max(1))
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_memory_sees_a_large_allocation() {
        let (len, memory) = peak_memory(|| {
            let v = vec![1u8; 64 << 20];
            std::hint::black_box(&v);
            v.len()
        });
        assert_eq!(len, 64 << 20);
        if let Some(m) = memory {
            assert!(m.growth_kib() >= 60 << 10, "{m:?}");
        }
    }

    #[test]
    fn median_takes_the_middle_run() {
        let mut n = 0u64;
        let d = median(5, || {
            n += 1;
            n
        });
        assert!(d < Duration::from_secs(1));
        assert_eq!(n, 6, "one warm-up and five timed runs");
    }
}
