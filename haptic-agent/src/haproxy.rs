//! HAProxy as the agent drives it: `haproxy -c` on a staged set, and the master CLI (reload,
//! `show proc`) over the master socket, with the confirmation that a reload took.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::UnixStream,
    process::Command,
    sync::Semaphore,
    time::Instant,
};
use tracing::{debug, instrument};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The HAProxy binary could not be started.
    #[error("running {bin}")]
    Spawn {
        /// The binary.
        bin: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `haproxy -c` did not finish in time (it was killed).
    #[error("`haproxy -c` did not finish within {0:?}")]
    CheckTimeout(Duration),
    /// The master socket could not be reached or did not answer.
    #[error("master socket {socket}: {reason}")]
    MasterSocket {
        /// The socket path.
        socket: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// `show proc` answered something this module cannot read.
    #[error("unreadable `show proc` output: {0}")]
    ProcTable(String),
    /// A command never reached the master CLI: connecting or writing failed, or the slot
    /// stayed busy.
    #[error("master socket {socket}: command not sent: {reason}")]
    NotSent {
        /// The socket path.
        socket: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The user HAProxy should run as is unknown.
    #[error("unknown HAProxy user {0:?} (a name in /etc/passwd, or uid:gid)")]
    User(String),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Most of `haproxy -c`'s output kept, in bytes (half for stdout, half for stderr; the tail of
/// each, after a line saying how much was cut).
pub const CHECK_OUTPUT_CAP: usize = 64 << 10;

/// Reads `stream` to its end, keeping its last `cap` bytes (as text, cut at a line start,
/// after a note of how many bytes were left out).
async fn read_tail(stream: Option<impl tokio::io::AsyncRead + Unpin>, cap: usize) -> String {
    let Some(mut stream) = stream else {
        return String::new();
    };
    let mut kept = std::collections::VecDeque::with_capacity(cap.min(8192));
    let mut total = 0usize;
    let mut buf = [0u8; 8192];
    while let Ok(n) = stream.read(&mut buf).await {
        if n == 0 {
            break;
        }
        total += n;
        kept.extend(&buf[..n]);
        if kept.len() > cap {
            kept.drain(..kept.len() - cap);
        }
    }
    let bytes: Vec<u8> = kept.into_iter().collect();
    if total <= cap {
        return String::from_utf8_lossy(&bytes).into_owned();
    }
    let from = bytes.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
    format!(
        "[... {} bytes of output cut ...]\n{}",
        total - (bytes.len() - from),
        String::from_utf8_lossy(&bytes[from..])
    )
}

/// The outcome of `haproxy -c`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    /// Whether HAProxy found the configuration valid.
    pub valid: bool,
    /// HAProxy's own output (stdout then stderr).
    pub output: String,
}

/// One row of `show proc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    /// Process id.
    pub pid: u32,
    /// The `reloads` column: for the master, reloads since start; for a worker, how many
    /// reloads ago it was started (0 for the newest).
    pub reloads: u64,
}

/// The master CLI's `show proc`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcTable {
    /// The master process.
    pub master: Proc,
    /// Failed reloads since start (the `[failed: N]` column; HAProxy 2.5 and later).
    pub failed_reloads: Option<u64>,
    /// Current workers (old workers still draining are not listed).
    pub workers: Vec<Proc>,
}

impl ProcTable {
    /// Parses the text of `show proc`.
    pub fn parse(text: &str) -> Result<Self> {
        let mut master = None;
        let mut failed_reloads = None;
        let mut workers = Vec::new();
        let mut section = "master";
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(header) = line.strip_prefix('#') {
                let header = header.trim();
                if !header.starts_with('<') {
                    section = match header {
                        "workers" => "workers",
                        "old workers" => "old",
                        _ => "other",
                    };
                }
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(pid), Some(kind), Some(reloads)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let parse = |value: &str| {
                value
                    .parse::<u64>()
                    .map_err(|_| Error::ProcTable(format!("bad number {value:?} in {line:?}")))
            };
            let proc = Proc {
                pid: u32::try_from(parse(pid)?)
                    .map_err(|_| Error::ProcTable(format!("bad pid in {line:?}")))?,
                reloads: parse(reloads)?,
            };
            match (section, kind) {
                (_, "master") => {
                    master = Some(proc);
                    if let (Some("[failed:"), Some(count)) = (fields.next(), fields.next()) {
                        failed_reloads = Some(parse(count.trim_end_matches(']'))?);
                    }
                }
                ("workers", "worker") => workers.push(proc),
                _ => {}
            }
        }
        let master =
            master.ok_or_else(|| Error::ProcTable(format!("no master row in {text:?}")))?;
        Ok(Self {
            master,
            failed_reloads,
            workers,
        })
    }
}

/// The outcome of a reload through the master socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new worker runs the new configuration.
    Loaded {
        /// The new worker's pid.
        worker: u32,
    },
    /// The master could not load the configuration; the previous workers keep running.
    Failed {
        /// What HAProxy said, as far as the agent could learn it.
        reason: String,
    },
    /// The reload was sent but the master had not finished it by the deadline (or its socket
    /// failed): it may still load the set. Wait with [`Haproxy::await_reload`] from `before`.
    Unknown {
        /// Why the outcome is unknown.
        reason: String,
        /// `show proc` before the reload was sent.
        before: ProcTable,
    },
}

/// The unprivileged user (and group) HAProxy and `haproxy -c` run as, when the agent runs as
/// root: a set's Lua, if allowed, then runs without the agent's privileges, and HAProxy
/// cannot read the agent's token or change the sets it is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// User id.
    pub uid: u32,
    /// Group id (the user's primary group when resolved from a name).
    pub gid: u32,
}

impl RunAs {
    /// Resolves `spec`: a user name from `/etc/passwd`, or `uid:gid`.
    pub fn resolve(spec: &str) -> Result<Self> {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        Self::resolve_with(spec, &passwd)
    }

    /// Resolves `spec` against the text of a passwd file.
    pub fn resolve_with(spec: &str, passwd: &str) -> Result<Self> {
        let unknown = || Error::User(spec.to_owned());
        if let Some((uid, gid)) = spec.split_once(':') {
            return Ok(Self {
                uid: uid.trim().parse().map_err(|_| unknown())?,
                gid: gid.trim().parse().map_err(|_| unknown())?,
            });
        }
        passwd
            .lines()
            .map(|line| line.split(':').collect::<Vec<_>>())
            .find(|fields| fields.len() >= 4 && fields[0] == spec)
            .and_then(|fields| {
                Some(Self {
                    uid: fields[2].parse().ok()?,
                    gid: fields[3].parse().ok()?,
                })
            })
            .ok_or_else(unknown)
    }
}

/// The agent's connections to the master CLI: one at a time for the apply path (reloads,
/// their confirmation, supervised starts), and one at a time for everything else (`/v1/state`,
/// `/readyz`), so that no amount of probing takes the slot an apply needs.
#[derive(Debug)]
struct Slots {
    apply: Semaphore,
    other: Semaphore,
    /// Connections made, for the metrics and tests.
    connections: AtomicU64,
    /// Reloads sent and masters started: each may bring a new worker.
    workers: AtomicU64,
}

/// Paths to the HAProxy binary and its master socket, the user it runs as, and the bounded
/// use of its master CLI. Clones share the bound.
#[derive(Debug, Clone)]
pub struct Haproxy {
    /// The `haproxy` binary.
    pub bin: PathBuf,
    /// The master CLI socket (`-S`).
    pub master_socket: PathBuf,
    /// The user HAProxy runs as (none: the agent's own).
    pub run_as: Option<RunAs>,
    slots: Arc<Slots>,
}

/// Which slot of the master CLI a command takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The apply path: reloads, their confirmation, starts.
    Apply,
    /// Probes and state: never in the way of an apply.
    Other,
}

impl Haproxy {
    /// HAProxy at `bin`, with its master CLI at `master_socket`, run as `run_as`.
    pub fn new(bin: PathBuf, master_socket: PathBuf, run_as: Option<RunAs>) -> Self {
        Self {
            bin,
            master_socket,
            run_as,
            slots: Arc::new(Slots {
                apply: Semaphore::new(1),
                other: Semaphore::new(1),
                connections: AtomicU64::new(0),
                workers: AtomicU64::new(0),
            }),
        }
    }

    /// How many times a new worker may have started since this handle was made (reloads
    /// sent, masters started): a runtime apply keeps what a worker loaded only while this
    /// stays the same. A reload or restart by someone else is not counted (an HAProxy the
    /// agent does not supervise); a listing it made stale fails the next runtime apply,
    /// whose reload then counts.
    pub fn worker_changes(&self) -> u64 {
        self.slots.workers.load(Ordering::Relaxed)
    }

    /// Notes that a new worker may start (a reload is about to be sent, a master started).
    pub fn new_worker(&self) {
        self.slots.workers.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections made to the master CLI so far.
    pub fn cli_connections(&self) -> u64 {
        self.slots.connections.load(Ordering::Relaxed)
    }

    /// A command running the HAProxy binary as [`Haproxy::run_as`] (supplementary groups
    /// dropped).
    pub fn process(&self) -> Command {
        let mut command = Command::new(&self.bin);
        if let Some(run_as) = self.run_as {
            command.uid(run_as.uid).gid(run_as.gid);
        }
        command
    }

    /// `haproxy -v`'s first line; a binary that does not answer within `timeout` is killed.
    pub async fn version(&self, timeout: Duration) -> Result<String> {
        let output = self
            .process()
            .arg("-v")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(timeout, output)
            .await
            .map_err(|_| Error::Spawn {
                bin: self.bin.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("`haproxy -v` did not answer within {timeout:?}"),
                ),
            })?
            .map_err(|source| Error::Spawn {
                bin: self.bin.clone(),
                source,
            })?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned())
    }

    /// Runs `haproxy -c` on the set in `dir`, with `dir` as working directory (`-C`) so that
    /// relative map and certificate paths resolve inside it.
    #[instrument(skip(self))]
    pub async fn check(&self, dir: &Path, timeout: Duration) -> Result<CheckOutcome> {
        let mut child = self
            .process()
            .arg("-c")
            .arg("-C")
            .arg(dir)
            .arg("-f")
            .arg(dir.join(haptic_agent_client::protocol::MAIN_CONFIG))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Spawn {
                bin: self.bin.clone(),
                source,
            })?;
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        // A set can make HAProxy print without end (a warning per line of a huge file): keep
        // the tail of each stream, where the verdict is.
        let run = async {
            let (status, out, err) = tokio::join!(
                child.wait(),
                read_tail(stdout, CHECK_OUTPUT_CAP / 2),
                read_tail(stderr, CHECK_OUTPUT_CAP / 2)
            );
            (status, out, err)
        };
        let (status, out, err) = tokio::time::timeout(timeout, run)
            .await
            .map_err(|_| Error::CheckTimeout(timeout))?;
        let status = status.map_err(|source| Error::Spawn {
            bin: self.bin.clone(),
            source,
        })?;
        let mut text = out;
        text.push_str(&err);
        Ok(CheckOutcome {
            valid: status.success(),
            output: text,
        })
    }

    /// Sends one command to the master CLI on the apply slot and returns its whole answer.
    pub async fn command(&self, command: &str, timeout: Duration) -> Result<String> {
        self.command_on(Slot::Apply, command, timeout).await
    }

    /// Sends one command to the master CLI on `slot` (waiting for it, within `timeout`) and
    /// returns its whole answer. A connect or write that failed is [`Error::NotSent`]: the
    /// master never saw the command.
    pub async fn command_on(&self, slot: Slot, command: &str, timeout: Duration) -> Result<String> {
        let socket_error = |reason: String| Error::MasterSocket {
            socket: self.master_socket.clone(),
            reason,
        };
        let not_sent = |reason: String| Error::NotSent {
            socket: self.master_socket.clone(),
            reason,
        };
        let deadline = Instant::now() + timeout;
        let semaphore = match slot {
            Slot::Apply => &self.slots.apply,
            Slot::Other => &self.slots.other,
        };
        let _permit = tokio::time::timeout_at(deadline, semaphore.acquire())
            .await
            .map_err(|_| not_sent(format!("the master CLI stayed busy for {timeout:?}")))?
            .map_err(|_| not_sent("closed".to_owned()))?;
        self.slots.connections.fetch_add(1, Ordering::Relaxed);
        let send = async {
            let mut stream = UnixStream::connect(&self.master_socket).await?;
            stream.write_all(format!("{command}\n").as_bytes()).await?;
            // The master CLI answers once it sees the end of the request.
            stream.shutdown().await?;
            Ok::<_, std::io::Error>(stream)
        };
        let mut stream = tokio::time::timeout_at(deadline, send)
            .await
            .map_err(|_| not_sent(format!("`{command}` could not be sent in time")))?
            .map_err(|error| not_sent(error.to_string()))?;
        let receive = async {
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await?;
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&answer).into_owned())
        };
        tokio::time::timeout_at(deadline, receive)
            .await
            .map_err(|_| socket_error(format!("`{command}` timed out")))?
            .map_err(|error| socket_error(error.to_string()))
    }

    /// `show proc`, parsed, on the apply slot.
    pub async fn show_proc(&self, timeout: Duration) -> Result<ProcTable> {
        ProcTable::parse(&self.command("show proc", timeout).await?)
    }

    /// `show proc`, parsed, on the slot for probes and state.
    pub async fn show_proc_probe(&self, timeout: Duration) -> Result<ProcTable> {
        ProcTable::parse(&self.command_on(Slot::Other, "show proc", timeout).await?)
    }

    /// Asks the master to reload and waits (up to `timeout`) until it has finished: the
    /// master's reload counter moved. The reload took when no failed reload was counted and a
    /// new worker runs. `stderr_tail` supplies HAProxy's recent log lines for the failure
    /// reason, when the agent has them.
    ///
    /// `show proc` before the reload is retried until the deadline (a master still busy with
    /// an earlier reload refuses connections); when it never answers the reload is not sent
    /// and the outcome is `Failed`. Once the reload was sent, a master that has not finished
    /// by the deadline gives `Unknown`: it may still load the set, and the caller must wait
    /// for it ([`Haproxy::await_reload`]) before acting on the outcome.
    #[instrument(skip(self, stderr_tail))]
    pub async fn reload(
        &self,
        timeout: Duration,
        stderr_tail: impl Fn() -> Option<String>,
    ) -> Result<ReloadOutcome> {
        let deadline = Instant::now() + timeout;
        let step = Duration::from_secs(2).min(timeout);
        let before = loop {
            match self.show_proc(step).await {
                Ok(table) => break table,
                Err(error) if Instant::now() >= deadline => {
                    return Ok(ReloadOutcome::Failed {
                        reason: format!(
                            "the master did not answer `show proc` within {timeout:?}, so no reload was sent: {error}"
                        ),
                    });
                }
                Err(error) => debug!(%error, "master not answering yet"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        self.new_worker();
        // The master re-executes itself on `reload`; HAProxy 2.7+ answers `Success=0|1`,
        // 2.6 closes the connection. Either way the table below is the judge. A reload that
        // never reached the master (connect or write failed) is sent again.
        loop {
            match self.command("reload", step).await {
                Ok(answer) => debug!(answer, "reload sent"),
                Err(Error::NotSent { reason, .. }) if Instant::now() < deadline => {
                    debug!(%reason, "reload not sent; retrying");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(Error::NotSent { reason, .. }) => {
                    return Ok(ReloadOutcome::Failed {
                        reason: format!(
                            "the reload never reached the master within {timeout:?}: {reason}"
                        ),
                    });
                }
                Err(error) => debug!(%error, "reload sent; the master dropped the connection"),
            }
            break;
        }
        match self.await_reload(&before, deadline).await {
            Some(after) => Ok(judge(&before, &after, stderr_tail)),
            None => Ok(ReloadOutcome::Unknown {
                reason: format!("HAProxy did not finish the reload within {timeout:?}"),
                before,
            }),
        }
    }

    /// Polls `show proc` until the master's reload counter moved past `before`'s, or the
    /// deadline passes (none).
    pub async fn await_reload(&self, before: &ProcTable, deadline: Instant) -> Option<ProcTable> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            match self
                .show_proc(left.clamp(Duration::from_millis(100), Duration::from_secs(2)))
                .await
            {
                Ok(table) if table.master.reloads > before.master.reloads => return Some(table),
                Ok(_) => {}
                Err(error) => debug!(%error, "master busy reloading"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Judges a finished reload from the tables before and after it: it took when HAProxy counted
/// no failed reload and a new worker runs.
pub fn judge(
    before: &ProcTable,
    after: &ProcTable,
    stderr_tail: impl Fn() -> Option<String>,
) -> ReloadOutcome {
    let failed = match (before.failed_reloads, after.failed_reloads) {
        (Some(before), Some(after)) => after > before,
        _ => false,
    };
    let fresh = after
        .workers
        .iter()
        .find(|worker| worker.reloads == 0 && !before.workers.iter().any(|w| w.pid == worker.pid));
    match fresh {
        Some(worker) if !failed => ReloadOutcome::Loaded { worker: worker.pid },
        _ => ReloadOutcome::Failed {
            reason: stderr_tail().unwrap_or_else(|| {
                "HAProxy counted a failed reload; the previous workers keep running (see HAProxy's log)"
                    .to_owned()
            }),
        },
    }
}

/// Finds the HAProxy binary: `name` itself when it is a path, else on `PATH`, else in
/// `/usr/sbin` (Debian's place, often not on a non-root `PATH`).
pub fn find_binary(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 {
        return name.is_file().then(|| name.to_path_buf());
    }
    let from_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file());
    from_path.or_else(|| {
        let fallback = Path::new("/usr/sbin").join(name);
        fallback.is_file().then_some(fallback)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHOW_PROC_26: &str = "#<PID>          <type>          <reloads>       <uptime>        <version>      \n\
4636            master          2 [failed: 1]   0d00h12m43s     2.6.12-1+deb12u4\n\
# workers\n\
18973           worker          1               0d00h00m07s     2.6.12-1+deb12u4\n\
# old workers\n\
4639            worker          3               0d00h01m07s     2.6.12-1+deb12u4\n\
# programs\n\n";

    #[test]
    fn show_proc_of_haproxy_2_6_parses() {
        let table = ProcTable::parse(SHOW_PROC_26).expect("parses");
        assert_eq!(
            table.master,
            Proc {
                pid: 4636,
                reloads: 2
            }
        );
        assert_eq!(table.failed_reloads, Some(1));
        assert_eq!(
            table.workers,
            vec![Proc {
                pid: 18973,
                reloads: 1
            }]
        );
    }

    #[test]
    fn users_resolve_by_name_or_number() {
        let passwd =
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n";
        assert_eq!(
            RunAs::resolve_with("nobody", passwd).expect("nobody"),
            RunAs {
                uid: 65534,
                gid: 65534
            }
        );
        assert_eq!(
            RunAs::resolve_with("101:102", passwd).expect("numbers"),
            RunAs { uid: 101, gid: 102 }
        );
        assert!(RunAs::resolve_with("haproxy", passwd).is_err());
        assert!(RunAs::resolve_with("a:b", passwd).is_err());
    }

    /// A fake master CLI at `socket`: it answers `show proc` with one worker, and after a
    /// `reload` with the reload counted and a new worker.
    async fn fake_master(socket: PathBuf) {
        use tokio::net::UnixListener;
        let table = |reloads: u64, worker: u32| {
            format!(
                "#<PID> <type> <reloads> <uptime> <version>\n1 master {reloads} [failed: 0] 0d00h00m01s 2.6\n\
                 # workers\n{worker} worker 0 0d00h00m01s 2.6\n"
            )
        };
        async fn read_command(conn: &mut UnixStream) -> String {
            let mut command = Vec::new();
            let _ = conn.read_to_end(&mut command).await;
            String::from_utf8_lossy(&command).into_owned()
        }
        let listener = UnixListener::bind(&socket).expect("bind");
        let (mut conn, _) = listener.accept().await.expect("accept");
        read_command(&mut conn).await;
        // The socket goes away before the first answer: the next connect (the reload) fails.
        drop(listener);
        std::fs::remove_file(&socket).expect("remove");
        conn.write_all(table(0, 10).as_bytes())
            .await
            .expect("answer");
        drop(conn);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let listener = UnixListener::bind(&socket).expect("bind again");
        let mut reloaded = false;
        loop {
            let (mut conn, _) = listener.accept().await.expect("accept");
            if read_command(&mut conn).await.starts_with("reload") {
                reloaded = true;
            } else {
                let answer = if reloaded { table(1, 11) } else { table(0, 10) };
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        }
    }

    #[tokio::test]
    async fn a_reload_that_never_reached_the_master_is_sent_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("master.sock");
        let master = tokio::spawn(fake_master(socket.clone()));
        // Wait (bounded) for the fake master to listen.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "fake master did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let haproxy = Haproxy::new(PathBuf::from("haproxy"), socket, None);
        let outcome = haproxy
            .reload(Duration::from_secs(5), || None)
            .await
            .expect("reload");
        assert_eq!(outcome, ReloadOutcome::Loaded { worker: 11 });
        master.abort();
    }

    #[test]
    fn show_proc_without_master_is_an_error() {
        assert!(ProcTable::parse("# workers\n1 worker 0 x y\n").is_err());
    }
}
