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

/// The middle of `times` (zero for none).
pub fn middle(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// The CPU time this thread has used (`CLOCK_THREAD_CPUTIME_ID`), on Linux: on a loaded
/// machine the wall clock includes waiting for a core, this does not. (It read
/// `/proc/thread-self/schedstat` until 2026-12-06, which Linux brings up to date only when the
/// thread is switched out or at a scheduler tick: a render of a few ms on a thread that ran
/// throughout read a tick or more short, "1.4 ms of CPU" for 2.8 ms of wall clock.)
#[cfg(target_os = "linux")]
pub fn thread_cpu() -> Option<Duration> {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Some(Duration::new(
        u64::try_from(now.tv_sec).ok()?,
        u32::try_from(now.tv_nsec).ok()?,
    ))
}

/// Not measured off Linux.
#[cfg(not(target_os = "linux"))]
pub fn thread_cpu() -> Option<Duration> {
    None
}

/// The minor page faults this process has taken so far (`minflt` of `/proc/self/stat`), where
/// Linux says it: a render's faults are the memory it touched afresh (the allocator gave back
/// to the kernel what the render asks for again, `MIMALLOC_PURGE_DELAY=0` as deployed).
pub fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name (in parentheses, which may hold spaces): state, ppid, pgrp,
    // session, tty_nr, tpgid, flags, minflt.
    let (_, fields) = stat.rsplit_once(')')?;
    fields.split_whitespace().nth(7)?.parse().ok()
}

/// This process's resident memory now (`VmRSS` of `/proc/self/status`), in MiB, where Linux
/// says it.
pub fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The other version of `resource` of store `store`, as the event benches change it: a label
/// added (a change every view sees as a new version, though no rendered line depends on it),
/// and an EndpointSlice's first endpoint's readiness flipped (a change that is rendered).
pub fn changed(store: &str, resource: &serde_json::Value) -> serde_json::Value {
    let mut other = resource.clone();
    other["metadata"]["labels"]["haptic-bench"] = serde_json::Value::from("changed");
    if store == "endpointslices"
        && let Some(endpoint) = other["endpoints"].get_mut(0)
    {
        let ready = endpoint["conditions"]["ready"].as_bool().unwrap_or(true);
        endpoint["conditions"]["ready"] = serde_json::Value::from(!ready);
    }
    other
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
