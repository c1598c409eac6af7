//! The supervised mode: the agent starts HAProxy itself in master-worker mode
//! (`-W -S <socket> -C <data>/current -f <data>/current/haproxy.cfg`), forwards its log,
//! restarts it when it dies, and stops it on shutdown.

use std::{
    collections::VecDeque,
    path::PathBuf,
    process::Stdio,
    sync::{Arc, Mutex as StdMutex},
    time::Duration,
};

use rustix::process::{Pid, Signal, kill_process};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncRead, BufReader},
    sync::{Mutex, watch},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::haproxy::Haproxy;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// HAProxy could not be spawned.
    #[error("spawning {bin}")]
    Spawn {
        /// The binary.
        bin: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// HAProxy exited while starting.
    #[error("HAProxy failed to start: {0}")]
    Exited(String),
    /// HAProxy did not answer on its master socket with a worker in time.
    #[error("HAProxy did not come up within {0:?}")]
    Timeout(Duration),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The last lines HAProxy printed, numbered, so a caller can ask for what came after a mark.
#[derive(Debug, Default)]
pub struct LogTail {
    lines: VecDeque<(u64, String)>,
    next: u64,
}

impl LogTail {
    const KEEP: usize = 200;

    fn push(&mut self, line: String) {
        if self.lines.len() == Self::KEEP {
            self.lines.pop_front();
        }
        self.lines.push_back((self.next, line));
        self.next += 1;
    }

    /// A mark: lines printed from now on are after it.
    pub fn mark(&self) -> u64 {
        self.next
    }

    /// The alerts printed since `mark`, or all lines since it when there is no alert.
    pub fn since(&self, mark: u64) -> Option<String> {
        let recent: Vec<&str> = self
            .lines
            .iter()
            .filter(|(seq, _)| *seq >= mark)
            .map(|(_, line)| line.as_str())
            .collect();
        let alerts: Vec<&str> = recent
            .iter()
            .copied()
            .filter(|line| line.contains("[ALERT]"))
            .collect();
        let chosen = if alerts.is_empty() { recent } else { alerts };
        (!chosen.is_empty()).then(|| chosen.join("\n"))
    }
}

struct Running {
    pid: u32,
    stop: CancellationToken,
    exited: watch::Receiver<Option<String>>,
    task: JoinHandle<()>,
}

/// How long a stopping master gets to drain (SIGUSR1, HAProxy's soft stop: listeners are
/// released at once, connections in flight finish) before SIGTERM, and SIGKILL 5 s later.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Starts, watches and stops one HAProxy master process.
///
/// The master's pid and start time are recorded in a pidfile; a start first stops a master
/// the pidfile names that still runs (left by an agent killed with SIGKILL, which runs no
/// destructor), so that two masters never serve side by side (HAProxy binds with
/// `SO_REUSEPORT`, so the second would not even fail to bind).
#[derive(Clone)]
pub struct Supervisor {
    haproxy: Haproxy,
    current: PathBuf,
    pidfile: Option<PathBuf>,
    start_timeout: Duration,
    running: Arc<Mutex<Option<Running>>>,
    tail: Arc<StdMutex<LogTail>>,
    exits: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("haproxy", &self.haproxy)
            .field("current", &self.current)
            .finish()
    }
}

impl Supervisor {
    /// A supervisor for HAProxy running the set linked at `current`.
    pub fn new(haproxy: Haproxy, current: PathBuf, start_timeout: Duration) -> Self {
        Self {
            haproxy,
            current,
            pidfile: None,
            start_timeout,
            running: Arc::new(Mutex::new(None)),
            tail: Arc::new(StdMutex::new(LogTail::default())),
            exits: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Records the master's pid at `pidfile` (and stops a master it names at the next start).
    #[must_use]
    pub fn with_pidfile(mut self, pidfile: PathBuf) -> Self {
        self.pidfile = Some(pidfile);
        self
    }

    /// Stops a master left running by an earlier agent, as its pidfile names it: only when the
    /// process with that pid has the start time recorded (a pid reused since is left alone).
    async fn stop_orphan(&self) {
        let Some(pidfile) = &self.pidfile else { return };
        let Ok(text) = std::fs::read_to_string(pidfile) else {
            return;
        };
        let mut fields = text.split_whitespace();
        let (Some(pid), Some(started)) = (
            fields.next().and_then(|pid| pid.parse::<u32>().ok()),
            fields.next().and_then(|at| at.parse::<u64>().ok()),
        ) else {
            let _ = std::fs::remove_file(pidfile);
            return;
        };
        if process_start_time(pid) == Some(started) {
            warn!(
                pid,
                "a HAProxy master of an earlier agent still runs; stopping it"
            );
            stop_pid(pid).await;
        }
        let _ = std::fs::remove_file(pidfile);
    }

    fn record_pid(&self, pid: u32) {
        let Some(pidfile) = &self.pidfile else { return };
        let Some(started) = process_start_time(pid) else {
            return;
        };
        let tmp = pidfile.with_extension("tmp");
        let written = std::fs::write(&tmp, format!("{pid} {started}\n"))
            .and_then(|()| std::fs::rename(&tmp, pidfile));
        if let Err(error) = written {
            warn!(%error, "recording HAProxy's pid failed");
        }
    }

    /// A mark in HAProxy's log (see [`LogTail::mark`]).
    pub fn log_mark(&self) -> u64 {
        self.tail.lock().map(|tail| tail.mark()).unwrap_or(0)
    }

    /// What HAProxy printed since `mark` (alerts first).
    pub fn log_since(&self, mark: u64) -> Option<String> {
        self.tail.lock().ok().and_then(|tail| tail.since(mark))
    }

    /// Whether a master process is running.
    pub async fn is_running(&self) -> bool {
        let running = self.running.lock().await;
        running
            .as_ref()
            .is_some_and(|child| child.exited.borrow().is_none())
    }

    /// A watch of the running master's exit (`Some(status)` once it exited), or none when
    /// no master runs.
    pub async fn exit_watch(&self) -> Option<watch::Receiver<Option<String>>> {
        let running = self.running.lock().await;
        running
            .as_ref()
            .filter(|child| child.exited.borrow().is_none())
            .map(|child| child.exited.clone())
    }

    /// Starts HAProxy unless it runs, and waits until its master socket lists a worker (or
    /// the master exits, or the start timeout passes and it is stopped).
    pub async fn start(&self) -> Result<()> {
        let mut running = self.running.lock().await;
        if let Some(child) = running.as_ref()
            && child.exited.borrow().is_none()
        {
            return Ok(());
        }
        let mark = self.log_mark();
        // Before the socket goes: a master of an earlier agent would still serve beside ours.
        self.stop_orphan().await;
        let _ = std::fs::remove_file(&self.haproxy.master_socket);
        let mut command = self.haproxy.process();
        command
            .arg("-W")
            .arg("-S")
            .arg(&self.haproxy.master_socket)
            .arg("-C")
            .arg(&self.current)
            .arg("-f")
            .arg(
                self.current
                    .join(haptic_agent_client::protocol::MAIN_CONFIG),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // If the agent dies without stopping it, the runtime's drop still kills the
            // master, and its workers exit with it.
            .kill_on_drop(true);
        let mut child = crate::thp::spawn(&mut command).map_err(|source| Error::Spawn {
            bin: self.haproxy.bin.clone(),
            source,
        })?;
        self.haproxy.new_worker();
        let pid = child.id().unwrap_or_default();
        info!(pid, "HAProxy master started");
        self.record_pid(pid);
        if let Some(stdout) = child.stdout.take() {
            tokio::spawn(forward(stdout, self.tail.clone()));
        }
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(forward(stderr, self.tail.clone()));
        }
        let (exited_tx, exited) = watch::channel(None);
        let stop = CancellationToken::new();
        // Set once the master answered with a worker: only then is an exit worth a restart.
        let confirmed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            let exits = self.exits.clone();
            let confirmed = confirmed.clone();
            async move {
                let status = tokio::select! {
                    status = child.wait() => status,
                    () = stop.cancelled() => terminate(&mut child, pid).await,
                };
                let description = match status {
                    Ok(status) => status.to_string(),
                    Err(error) => error.to_string(),
                };
                let _ = exited_tx.send(Some(description));
                if confirmed.load(std::sync::atomic::Ordering::SeqCst) && !stop.is_cancelled() {
                    exits.notify_one();
                }
            }
        });
        let mut exited_rx = exited.clone();
        *running = Some(Running {
            pid,
            stop,
            exited,
            task,
        });
        // The lock stays held until the start is judged, so a concurrent caller (an apply and
        // the restart watcher) waits for this outcome instead of seeing a half-started master.
        let deadline = Instant::now() + self.start_timeout;
        loop {
            if let Some(status) = exited_rx.borrow_and_update().clone() {
                let log = self.log_since(mark).unwrap_or_default();
                return Err(Error::Exited(format!("{status}: {log}")));
            }
            if let Ok(table) = self.haproxy.show_proc(Duration::from_secs(1)).await
                && !table.workers.is_empty()
            {
                confirmed.store(true, std::sync::atomic::Ordering::SeqCst);
                return Ok(());
            }
            if Instant::now() >= deadline {
                if let Some(child) = running.take() {
                    child.stop.cancel();
                    let _ = child.task.await;
                }
                return Err(Error::Timeout(self.start_timeout));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops HAProxy gracefully: SIGUSR1 to the master (soft stop: its workers release the
    /// listeners and finish the connections in flight), SIGTERM after [`STOP_GRACE`], SIGKILL
    /// 5 s later.
    pub async fn stop(&self) {
        let taken = self.running.lock().await.take();
        if let Some(child) = taken {
            child.stop.cancel();
            let _ = child.task.await;
            if let Some(pidfile) = &self.pidfile {
                let _ = std::fs::remove_file(pidfile);
            }
            info!(pid = child.pid, "HAProxy master stopped");
        }
    }

    /// Kills HAProxy's master at once (SIGKILL; its workers exit with it), without waiting:
    /// for a process about to exit on a second signal.
    pub fn kill_now(&self) {
        if let Ok(running) = self.running.try_lock()
            && let Some(child) = running.as_ref()
            && let Some(pid) = i32::try_from(child.pid).ok().and_then(Pid::from_raw)
        {
            let _ = kill_process(pid, Signal::KILL);
        }
    }

    /// Restarts HAProxy whenever it exits on its own, with a growing pause, until `shutdown`
    /// is cancelled; then stops it. Run it as a task.
    pub async fn watch(self, shutdown: CancellationToken) {
        let mut pause = Duration::from_millis(200);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = self.exits.notified() => {}
            }
            if self.is_running().await || !self.current.exists() {
                continue;
            }
            warn!(?pause, "HAProxy exited; restarting");
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
            match self.start().await {
                Ok(()) => pause = Duration::from_millis(200),
                Err(error) => {
                    warn!(%error, "restarting HAProxy failed");
                    pause = (pause * 2).min(Duration::from_secs(30));
                }
            }
        }
        self.stop().await;
    }
}

async fn terminate(
    child: &mut tokio::process::Child,
    pid: u32,
) -> std::io::Result<std::process::ExitStatus> {
    let pid = i32::try_from(pid).ok().and_then(Pid::from_raw);
    for (signal, wait) in [
        (Signal::USR1, STOP_GRACE),
        (Signal::TERM, Duration::from_secs(5)),
    ] {
        if let Some(pid) = pid {
            let _ = kill_process(pid, signal);
        }
        if let Ok(status) = tokio::time::timeout(wait, child.wait()).await {
            return status;
        }
    }
    let _ = child.start_kill();
    child.wait().await
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot),
/// none when it does not run (a zombie does not count).
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields count after the last.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Stops a process that is not our child: SIGUSR1, SIGTERM after [`STOP_GRACE`], SIGKILL 5 s
/// later, each time waiting (bounded) until it is gone.
async fn stop_pid(pid: u32) {
    let Some(target) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return;
    };
    for (signal, wait) in [
        (Signal::USR1, STOP_GRACE),
        (Signal::TERM, Duration::from_secs(5)),
        (Signal::KILL, Duration::from_secs(5)),
    ] {
        let _ = kill_process(target, signal);
        let deadline = Instant::now() + wait;
        while process_start_time(pid).is_some() {
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if process_start_time(pid).is_none() {
            return;
        }
    }
}

async fn forward(stream: impl AsyncRead + Unpin, tail: Arc<StdMutex<LogTail>>) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.contains("[ALERT]") {
            warn!(target: "haproxy", %line, "HAProxy alert");
        } else {
            info!(target: "haproxy", %line, "HAProxy");
        }
        if let Ok(mut tail) = tail.lock() {
            tail.push(line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_tail_prefers_alerts_after_the_mark() {
        let mut tail = LogTail::default();
        tail.push("[ALERT] old".into());
        let mark = tail.mark();
        assert_eq!(tail.since(mark), None);
        tail.push("[NOTICE] reloading".into());
        assert_eq!(tail.since(mark).as_deref(), Some("[NOTICE] reloading"));
        tail.push("[ALERT] cannot bind".into());
        assert_eq!(tail.since(mark).as_deref(), Some("[ALERT] cannot bind"));
    }
}
