//! Measurements criterion does not make: a median time for the summary table. (Peak memory
//! is measured by the `render-peak-memory` binary, in its own process.)

use std::time::{Duration, Instant};

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
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
