//! Transparent huge pages off for the agent's own memory, as the host has them for the
//! HAProxy it starts.
//!
//! mimalloc asks the kernel for huge pages (`madvise`), and the agent's applies at 10,000
//! Ingresses build and drop megabytes of short-lived buffers (the set a delta makes, the map
//! entries a runtime change compares): each fresh 2 MiB page was zeroed whole when first
//! touched, an eighth of the agents' CPU in a profile of `bench_controller` (the kernel's
//! `folio_zero_user` under mimalloc's page extension). Measured with `bench_controller 10000
//! --changes 30 --reload-changes 0 --endpoint-changes 5 --no-health-checks`, two runs each,
//! alternated (2026-12-03): the three agents' CPU a change 126 / 141 ms with them off, 150 /
//! 180 with them on; change to live p50 184 / 220 ms against 227 / 249.
//!
//! `PR_SET_THP_DISABLE` holds for a whole process and passes to its children, through
//! `exec` too. HAProxy's memory is the user's to tune (the host's THP mode applies to it as
//! if the agent were not there), so the HAProxy master is started with the flag cleared
//! ([`spawn`]): it is cleared for the instant of the fork, under a lock that every spawn of
//! the agent takes, and set again. An allocation another thread makes in that instant may
//! get a huge page: harmless.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::process::{Child, Command};

/// Whether [`turn_off`] turned huge pages off for this process.
static OFF: AtomicBool = AtomicBool::new(false);
/// Held while the flag is cleared for a spawn.
static SPAWNING: Mutex<()> = Mutex::new(());

/// Turns transparent huge pages off for this process (not for what [`spawn`] starts).
pub fn turn_off() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        rustix::thread::disable_transparent_huge_pages(true)?;
        OFF.store(true, Ordering::SeqCst);
    }
    Ok(())
}

/// Spawns `command` with transparent huge pages as the host has them, whatever
/// [`turn_off`] did for the agent.
pub fn spawn(command: &mut Command) -> std::io::Result<Child> {
    if !OFF.load(Ordering::SeqCst) {
        return command.spawn();
    }
    // A panic while holding the lock leaves nothing half done: the flag is set again below.
    let _spawning = SPAWNING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    #[cfg(target_os = "linux")]
    rustix::thread::disable_transparent_huge_pages(false)?;
    let child = command.spawn();
    #[cfg(target_os = "linux")]
    if let Err(error) = rustix::thread::disable_transparent_huge_pages(true) {
        tracing::warn!(%error, "could not turn transparent huge pages off again for the agent");
    }
    child
}
