//! One run: start the fleet, wait for the first deployment, run the writer, the prober and
//! the seeded faults, lift them, measure convergence, then judge every invariant.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::Write as _,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use anyhow::{Result, bail};
use haptic_testkit::Fault;
use k8s_openapi::api::{coordination::v1::Lease, networking::v1::Ingress};
use kube::api::{Api, DeleteParams, PostParams};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use rustix::process::Signal;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    check::{self, JournalVerdict},
    expected,
    fleet::{self, Fleet, LEASE, NS, REPLICAS},
    observe::{self, LeaseWatch, Timeline, now_ms},
    schedule::{Kind, Planned, Schedule, Target},
};

/// How a run is shaped.
#[derive(Debug, Clone)]
pub(crate) struct RunOptions {
    /// How long faults are started for (each ends within it).
    pub(crate) phase: Duration,
    /// Bound on convergence after the last fault is lifted.
    pub(crate) settle: Duration,
    /// Where the run's directory goes.
    pub(crate) base: PathBuf,
    /// Keep the directory of a run that passed too.
    pub(crate) keep: bool,
}

/// What one run found.
#[derive(Debug, Default)]
pub(crate) struct RunReport {
    pub(crate) seed: u64,
    pub(crate) violations: Vec<String>,
    /// Faults actually injected, by kind.
    pub(crate) injected: BTreeMap<Kind, usize>,
    /// Faults skipped, and why.
    pub(crate) skipped: Vec<String>,
    pub(crate) stale: usize,
    pub(crate) foreign: usize,
    pub(crate) fenced: usize,
    pub(crate) live: usize,
    pub(crate) applied: usize,
    pub(crate) writes: u32,
    pub(crate) epochs: usize,
    /// Seconds from the last fault lifted to every agent serving the final set.
    pub(crate) convergence: Option<f64>,
    pub(crate) timeline: Vec<(u64, String)>,
    pub(crate) started_ms: u64,
    pub(crate) dir: PathBuf,
}

/// The faults in force per client, so that lifting one re-injects the others.
#[derive(Default)]
struct Book {
    faults: Mutex<HashMap<String, Vec<(u64, Fault)>>>,
    outage_until: Mutex<Option<Instant>>,
}

impl Book {
    fn add(&self, fleet: &Fleet, client: &str, id: u64, fault: Fault) {
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        faults
            .entry(client.to_owned())
            .or_default()
            .push((id, fault.clone()));
        fleet.server.inject(client, fault);
    }

    fn remove(&self, fleet: &Fleet, client: &str, id: u64) {
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        let list = faults.entry(client.to_owned()).or_default();
        list.retain(|(i, _)| *i != id);
        fleet.server.lift(client);
        for (_, fault) in list.iter() {
            fleet.server.inject(client, fault.clone());
        }
    }

    /// Overlapping outages end with the latest of them.
    fn outage(&self, fleet: &Fleet, hold: Duration) {
        let mut until = self.outage_until.lock().unwrap_or_else(|e| e.into_inner());
        let end = Instant::now() + hold;
        let end = until.map_or(end, |u| u.max(end));
        *until = Some(end);
        fleet
            .server
            .outage(end.saturating_duration_since(Instant::now()));
    }
}

struct Ctx<'a> {
    fleet: &'a Fleet,
    book: Book,
    lease: LeaseWatch,
    timeline: Timeline,
    injected: Mutex<BTreeMap<Kind, usize>>,
    skipped: Mutex<Vec<String>>,
    /// Windows (wall ms) in which an agent's HAProxy may be down: it, or its agent, was killed.
    excused: Mutex<Vec<Vec<(u64, u64)>>>,
}

impl Ctx<'_> {
    fn count(&self, kind: Kind) {
        *self
            .injected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kind)
            .or_default() += 1;
    }

    fn excuse(&self, agent: usize, from: u64, to: u64) {
        if let Some(list) = self
            .excused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(agent)
        {
            list.push((from, to));
        }
    }

    fn replica(&self, target: Target, rng: &mut StdRng) -> usize {
        match target {
            Target::Replica(i) => i,
            _ => {
                let holder = self.lease.holder.borrow().clone();
                holder
                    .and_then(|h| self.fleet.controllers.iter().position(|c| c.name == h))
                    .unwrap_or_else(|| rng.random_range(0..REPLICAS))
            }
        }
    }

    /// Injects `fault`, holds it, lifts it.
    async fn inject(&self, id: u64, fault: &Planned) -> Result<()> {
        let fleet = self.fleet;
        let mut rng = StdRng::seed_from_u64(fault.seed);
        let t = &self.timeline;
        match fault.kind {
            Kind::Partition => {
                let i = self.replica(fault.target, &mut rng);
                let name = &fleet.controllers[i].name;
                t.push(format!("fault: partition {name} from the API"));
                self.count(fault.kind);
                self.book.add(fleet, name, id, Fault::Partition);
                tokio::time::sleep(fault.hold).await;
                self.book.remove(fleet, name, id);
                t.push(format!("lifted: partition of {name}"));
            }
            Kind::OutageShort | Kind::OutageLong => {
                t.push(format!(
                    "fault: API outage for {} ms",
                    fault.hold.as_millis()
                ));
                self.count(fault.kind);
                self.book.outage(fleet, fault.hold);
                tokio::time::sleep(fault.hold).await;
                t.push("lifted: API outage");
            }
            Kind::SlowApi => {
                let targets: Vec<usize> = match fault.target {
                    Target::AllReplicas => (0..REPLICAS).collect(),
                    other => vec![self.replica(other, &mut rng)],
                };
                let names: Vec<String> = targets
                    .iter()
                    .map(|&i| fleet.controllers[i].name.clone())
                    .collect();
                t.push(format!(
                    "fault: API answers {} ms late to {}",
                    fault.delay.as_millis(),
                    names.join(",")
                ));
                self.count(fault.kind);
                for name in &names {
                    self.book
                        .add(fleet, name, id, Fault::SlowResponse(fault.delay));
                }
                tokio::time::sleep(fault.hold).await;
                for name in &names {
                    self.book.remove(fleet, name, id);
                }
                t.push(format!("lifted: slow answers to {}", names.join(",")));
            }
            Kind::StopLeader => {
                let i = self.replica(fault.target, &mut rng);
                let slot = &fleet.controllers[i];
                let guard = slot.proc.lock().await;
                let Some(pid) = guard.as_ref().map(|p| p.pid) else {
                    self.skip(fault, "the replica is not running");
                    return Ok(());
                };
                // Half the time, freeze it in the middle of a deployment: a change it will
                // render and send, then the stop 100-600 ms later (reconcile window, render,
                // gate, fan-out). What it still sends on waking is what the fence must stop.
                if rng.random_bool(0.5) {
                    let n = id;
                    let name = format!("stop-{n}");
                    let created =
                        match fleet::ingress(&name, &format!("{name}.chaos.test"), "web-a") {
                            Ok(ingress) => Api::<Ingress>::namespaced(fleet.client.clone(), NS)
                                .create(&PostParams::default(), &ingress)
                                .await
                                .is_ok(),
                            Err(_) => false,
                        };
                    t.push(format!("write: create ingress {name} (created: {created}) to freeze the leader mid-deployment"));
                    tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
                }
                t.push(format!("fault: SIGSTOP {} (pid {pid})", slot.name));
                self.count(fault.kind);
                fleet::signal(pid, Signal::STOP);
                tokio::time::sleep(fault.hold).await;
                fleet::signal(pid, Signal::CONT);
                t.push(format!("lifted: SIGCONT {}", slot.name));
            }
            Kind::KillReplica => {
                let i = self.replica(fault.target, &mut rng);
                let slot = &fleet.controllers[i];
                let mut guard = slot.proc.lock().await;
                if let Some(proc) = guard.as_mut() {
                    t.push(format!("fault: kill -9 {} (pid {})", slot.name, proc.pid));
                    self.count(fault.kind);
                    proc.kill9().await;
                }
                tokio::time::sleep(fault.hold).await;
                *guard = Some(fleet.spawn_controller(i)?);
                t.push(format!("lifted: {} restarted", slot.name));
            }
            Kind::KillAgent => {
                let Target::Agent(i) = fault.target else {
                    bail!("kill-agent without an agent")
                };
                let slot = &fleet.agents[i];
                let mut guard = slot.proc.lock().await;
                let from = now_ms();
                if let Some(proc) = guard.as_mut() {
                    t.push(format!(
                        "fault: kill -9 agent {} (pid {})",
                        slot.name, proc.pid
                    ));
                    self.count(fault.kind);
                    proc.kill9().await;
                }
                tokio::time::sleep(fault.hold).await;
                *guard = Some(fleet.spawn_agent(i).await?);
                t.push(format!("lifted: agent {} restarted", slot.name));
                // The new agent stops the HAProxy its predecessor left and starts its own.
                self.excuse(i, from, now_ms() + 15_000);
            }
            Kind::KillHaproxy => {
                let Target::Agent(i) = fault.target else {
                    bail!("kill-haproxy without an agent")
                };
                let slot = &fleet.agents[i];
                let _guard = slot.proc.lock().await;
                match master_pid(&slot.data) {
                    Some(pid) => {
                        let from = now_ms();
                        t.push(format!(
                            "fault: kill -9 HAProxy master of {} (pid {pid})",
                            slot.name
                        ));
                        self.count(fault.kind);
                        fleet::signal(i32::try_from(pid).unwrap_or(0), Signal::KILL);
                        self.excuse(i, from, from + 15_000);
                    }
                    None => self.skip(fault, "no HAProxy master runs (no pidfile)"),
                }
            }
            Kind::DeleteLease => {
                t.push("fault: Lease deleted");
                self.count(fault.kind);
                let leases: Api<Lease> = Api::namespaced(fleet.client.clone(), NS);
                if let Err(error) = leases.delete(LEASE, &DeleteParams::default()).await {
                    t.push(format!("delete of the Lease failed: {error}"));
                }
            }
            Kind::DiskFull => {
                let Target::Agent(i) = fault.target else {
                    bail!("disk-full without an agent")
                };
                let slot = &fleet.agents[i];
                if !slot.tmpfs {
                    self.skip(fault, "no tmpfs could be mounted on this machine");
                    return Ok(());
                }
                let ballast = slot.data.join("chaos-ballast");
                let filled = fill(&ballast);
                t.push(format!(
                    "fault: data directory of {} full ({} bytes of ballast)",
                    slot.name, filled
                ));
                self.count(fault.kind);
                tokio::time::sleep(fault.hold).await;
                let _ = std::fs::remove_file(&ballast);
                t.push(format!("lifted: data directory of {} has room", slot.name));
            }
            Kind::ClockSkew => {}
        }
        Ok(())
    }

    fn skip(&self, fault: &Planned, why: &str) {
        self.timeline
            .push(format!("skipped: {} ({why})", fault.kind.name()));
        self.skipped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("{}: {why}", fault.kind.name()));
    }
}

/// The HAProxy master an agent supervises, from the pidfile it keeps (`<pid> <start time>`).
fn master_pid(data: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(data.join("haproxy-master.pid")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Writes zeros to `path` until the file system is full; returns the bytes written.
fn fill(path: &Path) -> u64 {
    let Ok(mut file) = std::fs::File::create(path) else {
        return 0;
    };
    let chunk = vec![0u8; 64 << 10];
    let mut written = 0;
    while written < fleet::TMPFS_BYTES * 2 {
        match file.write(&chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => written += n as u64,
        }
    }
    // The last partial page.
    while file.write(&[0u8; 512]).is_ok_and(|n| n > 0) {
        written += 512;
    }
    written
}

/// Polls `check` every 250 ms up to `bound`.
async fn until<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether every agent serves `checksum` and routes every host in `routes` as expected.
async fn converged(fleet: &Fleet, checksum: &str, routes: &BTreeMap<String, String>) -> bool {
    for i in 0..fleet.agents.len() {
        let live = fleet.agent_state(i).await.and_then(|s| s.live_checksum);
        if live.as_deref() != Some(checksum) {
            return false;
        }
        for (host, body) in routes {
            let got = fleet::http_get(&fleet.http_addr(i), host).await;
            if got.as_ref().map(|(s, b)| (*s, b.as_str())) != Some((200, body.as_str())) {
                return false;
            }
        }
    }
    true
}

/// Runs seed `seed` and judges it. Stops (and cleans up) when `token` fires.
pub(crate) async fn run(
    seed: u64,
    options: &RunOptions,
    token: &CancellationToken,
) -> Result<RunReport> {
    let schedule = Schedule::new(seed, options.phase);
    let dir = options.base.join(format!("seed-{seed}"));
    let mut fleet = Fleet::prepare(&dir, schedule.tmpfs_agent).await?;
    if let Some((i, rate)) = schedule.clock {
        fleet.controllers[i].clock_rate = Some(rate);
    }
    let mut report = RunReport {
        seed,
        dir: dir.clone(),
        started_ms: now_ms(),
        ..RunReport::default()
    };
    let timeline = Timeline::default();
    let result = tokio::select! {
        result = body(&fleet, &schedule, options, &mut report, &timeline) => result,
        () = token.cancelled() => Err(anyhow::anyhow!("interrupted")),
    };
    fleet.stop().await;
    let mut entries = timeline.entries();
    entries.sort_by_key(|(at, _)| *at);
    report.timeline = entries;
    if let Err(error) = result {
        report
            .violations
            .push(format!("the run could not complete: {error:#}"));
    }
    // Interrupted (Ctrl-C): nothing was judged, nothing is kept.
    if token.is_cancelled() || (report.violations.is_empty() && !options.keep) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(report)
}

async fn body(
    fleet: &Fleet,
    schedule: &Schedule,
    options: &RunOptions,
    report: &mut RunReport,
    timeline: &Timeline,
) -> Result<()> {
    for planned in &schedule.faults {
        timeline.push(format!("planned: {planned}"));
    }
    let stop = CancellationToken::new();
    let _stop_guard = stop.clone().drop_guard();
    for i in 0..fleet.agents.len() {
        let proc = fleet.spawn_agent(i).await?;
        *fleet.agents[i].proc.lock().await = Some(proc);
        fleet.register_pod(i).await?;
    }
    let (lease, lease_task) = observe::watch_lease(fleet, timeline.clone(), stop.child_token())?;
    for i in 0..REPLICAS {
        let proc = fleet.spawn_controller(i)?;
        *fleet.controllers[i].proc.lock().await = Some(proc);
        if let Some(rate) = fleet.controllers[i].clock_rate {
            timeline.push(format!(
                "fault: {} runs its election clock at {rate:.2}x",
                fleet.controllers[i].name
            ));
        }
    }
    let ctx = Ctx {
        fleet,
        book: Book::default(),
        lease,
        timeline: timeline.clone(),
        injected: Mutex::new(BTreeMap::new()),
        skipped: Mutex::new(Vec::new()),
        excused: Mutex::new(vec![Vec::new(); fleet.agents.len()]),
    };
    if schedule.clock.is_some() {
        ctx.count(Kind::ClockSkew);
    }

    // The first deployment: every agent serves the canary.
    let first = until(Duration::from_secs(90), || async {
        for i in 0..fleet.agents.len() {
            let got = fleet::http_get(&fleet.http_addr(i), fleet::CANARY_HOST).await;
            if got.is_none_or(|(s, _)| s != 200) {
                return false;
            }
        }
        true
    })
    .await;
    if !first {
        bail!("the first deployment did not reach every agent within 90 s");
    }
    timeline.push("first deployment everywhere; faults begin");

    let (probes, probe_task) = observe::probe(fleet, stop.child_token());
    let writer_token = stop.child_token();
    let writer = observe::write(
        fleet,
        schedule.writer_seed,
        timeline.clone(),
        writer_token.clone(),
    )?;

    let phase_start = Instant::now();
    let faults = schedule.faults.iter().enumerate().map(|(id, planned)| {
        let ctx = &ctx;
        async move {
            tokio::time::sleep_until(phase_start + planned.at).await;
            if let Err(error) = ctx.inject(id as u64, planned).await {
                ctx.timeline
                    .push(format!("fault {} failed: {error:#}", planned.kind.name()));
            }
        }
    });
    futures::future::join_all(faults).await;
    tokio::time::sleep_until(phase_start + options.phase).await;
    writer_token.cancel();
    let (writes, _failed) = writer.await.unwrap_or_default();
    report.writes = writes;
    fleet.server.lift_all();
    let lifted = Instant::now();
    timeline.push("every fault lifted; the writer stopped");

    // (3) convergence on the set rendered from the final resources.
    let checksum = expected::checksum(&fleet.client, &fleet.spec).await?;
    let routes = expected::routes(fleet).await?;
    timeline.push(format!(
        "expected: checksum {} routes {routes:?}",
        check::short(&checksum)
    ));
    let done = until(options.settle, || converged(fleet, &checksum, &routes)).await;
    if done {
        report.convergence = Some(lifted.elapsed().as_secs_f64());
        timeline.push("converged");
    } else {
        let mut live = Vec::new();
        for i in 0..fleet.agents.len() {
            live.push(
                fleet
                    .agent_state(i)
                    .await
                    .and_then(|s| s.live_checksum)
                    .map_or("none".to_owned(), |c| check::short(&c).to_owned()),
            );
        }
        report.violations.push(format!(
            "no convergence within {:?} after the last fault: agents serve {live:?}, expected {}",
            options.settle,
            check::short(&checksum)
        ));
    }
    if !ctx
        .lease
        .caught_up(&fleet.client, Duration::from_secs(10))
        .await
    {
        report
            .violations
            .push("the Lease watch did not catch up with the API within 10 s".to_owned());
    }
    stop.cancel();
    let _ = probe_task.await;
    let _ = lease_task.await;

    // (1) and (2) from the journals and the Lease history.
    let claims = ctx
        .lease
        .claims
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    report.epochs = claims.len();
    for i in 0..fleet.agents.len() {
        let name = &fleet.agents[i].name;
        let view = match fleet.journal(i).await {
            Ok(view) => view,
            Err(error) => {
                report
                    .violations
                    .push(format!("{name}: journal unavailable: {error:#}"));
                continue;
            }
        };
        if view.unpersisted > 0 {
            timeline.push(format!(
                "{name}: {} journal entries could not be written (full disk)",
                view.unpersisted
            ));
        }
        for entry in &view.entries {
            if entry.live || entry.outcome == "fenced" {
                timeline.push_at(
                    entry.at_ms,
                    format!(
                        "{name}: {} epoch {} gen {} from {} {}",
                        entry.outcome,
                        entry.epoch,
                        entry.generation,
                        entry.leader,
                        check::short(&entry.checksum)
                    ),
                );
            }
        }
        let verdict: JournalVerdict = check::judge_journal(name, &view.entries, &claims);
        report.stale += verdict.stale.len();
        report.foreign += verdict.foreign.len();
        report.fenced += verdict.fenced;
        report.live += verdict.live;
        report.applied += verdict.applied;
        report.violations.extend(verdict.stale);
        report.violations.extend(verdict.foreign);

        // (4) last-known-good kept.
        let distinct: BTreeSet<&str> = view
            .entries
            .iter()
            .filter(|e| e.outcome == "applied")
            .map(|e| e.checksum.as_str())
            .collect();
        let state = fleet.agent_state(i).await;
        if distinct.len() >= 2
            && state
                .as_ref()
                .is_none_or(|s| s.last_known_good_checksum.is_none())
        {
            report
                .violations
                .push(format!("{name}: lost its last-known-good set"));
        }
    }

    // (4) HAProxy kept serving except while it (or its agent) was killed.
    let probes = probes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let excused = ctx
        .excused
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for (i, series) in probes.iter().enumerate() {
        let longest = check::longest_outage(series, &excused[i]);
        if longest >= SERVING_GAP_MS {
            report.violations.push(format!(
                "{}: HAProxy did not serve the canary for {longest} ms outside any kill",
                fleet.agents[i].name
            ));
        }
    }

    // (4) no panic anywhere.
    let mut logs: Vec<PathBuf> = fleet.controllers.iter().map(|c| c.log.clone()).collect();
    logs.extend(fleet.agents.iter().map(|a| a.dir.join("agent.log")));
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("panicked at")) {
            report
                .violations
                .push(format!("a panic in {}: {line}", log.display()));
        }
    }

    report.injected = ctx.injected.into_inner().unwrap_or_else(|e| e.into_inner());
    report.skipped = ctx.skipped.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(())
}

/// A failing stretch of canary probes at least this long, outside a kill, breaks (4).
pub(crate) const SERVING_GAP_MS: u64 = 1000;
