//! The election benchmark (`cargo xtask bench election`): graceful handoff latency, crash
//! failover beyond LeaseDuration and steady-state API requests per replica, watch mode against
//! `poll_only` (client-go's behaviour) in the same run, printed as one table.
//!
//! Everything runs on real time (not tokio's paused clock) against in-process haptic-testkit
//! servers on 127.0.0.1, one server per scenario so their request accounting stays apart.
//! `RUST_LOG` raises the elector's logging (default: warnings only).

use std::{collections::BTreeMap, fmt::Write as _, time::Duration};

use anyhow::{Context, Result, bail, ensure};
use haptic_election::{Callbacks, ElectionConfig, ElectionState, LeaderElector};
use haptic_testkit::ApiServer;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;

const LEASE: &str = "bench-leader";
const NS: &str = "default";

/// Graceful handoffs per mode.
const HANDOFFS: usize = 25;
/// Crashes per mode.
const CRASHES: usize = 5;
/// Steady-state accounting window.
const WINDOW: Duration = Duration::from_secs(60);

/// Durations of one scenario: LeaseDuration / RenewDeadline / RetryPeriod in seconds.
#[derive(Clone, Copy)]
struct Durations(u64, u64, u64);

impl Durations {
    fn label(self) -> String {
        format!("{}/{}/{} s", self.0, self.1, self.2)
    }
}

/// kube-controller-manager's durations: the handoff and 15/10/2 steady state.
const FAST: Durations = Durations(15, 10, 2);
/// Short ones so that crashes do not make the run long.
const CRASH: Durations = Durations(4, 3, 1);
/// The crate's defaults.
const DEFAULT: Durations = Durations(30, 20, 5);

fn config(identity: &str, d: Durations, poll_only: bool) -> ElectionConfig {
    ElectionConfig::new(identity, LEASE, NS)
        .with_durations(
            Duration::from_secs(d.0),
            Duration::from_secs(d.1),
            Duration::from_secs(d.2),
        )
        .with_request_timeout(Duration::from_secs(d.2.min(2)))
        .with_release_on_cancel(true)
        .with_poll_only(poll_only)
}

/// Started-leading notices: which identity, and when its work began to run.
type Starts = mpsc::UnboundedSender<(String, Instant)>;

struct Replica {
    identity: String,
    token: CancellationToken,
    handle: JoinHandle<()>,
    state: watch::Receiver<ElectionState>,
}

impl Replica {
    fn start(server: &ApiServer, config: ElectionConfig, starts: &Starts) -> Result<Self> {
        let identity = config.identity.clone();
        let client = server.client_for(&identity)?;
        let elector = LeaderElector::new(client, config)?;
        let state = elector.state();
        let (tx, id) = (starts.clone(), identity.clone());
        let callbacks = Callbacks::new().on_started_leading(move |term| {
            let (tx, id) = (tx.clone(), id.clone());
            async move {
                // The moment the new leader's work runs: what a handoff is measured to.
                let _ = tx.send((id, Instant::now()));
                term.cancelled().await;
            }
        });
        let token = CancellationToken::new();
        let handle = tokio::spawn(elector.run(token.clone(), callbacks));
        Ok(Self {
            identity,
            token,
            handle,
            state,
        })
    }

    /// Awaits a state of this replica, bounded.
    async fn wait_for(&self, within: Duration, f: impl Fn(&ElectionState) -> bool) -> Result<()> {
        let mut state = self.state.clone();
        tokio::time::timeout(within, state.wait_for(|s| f(s)))
            .await
            .with_context(|| format!("{}: state not reached within {within:?}", self.identity))?
            .context("elector state channel closed")?;
        Ok(())
    }

    async fn stop(self) -> Result<()> {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(15), self.handle)
            .await
            .with_context(|| format!("{} did not stop", self.identity))??;
        Ok(())
    }
}

/// A small deterministic-enough generator for the pause before each event, so that the event
/// falls at a random phase of the renew and poll timers.
struct Phase(u64);

impl Phase {
    fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        Self(seed | 1)
    }

    /// Uniform in `[lo, hi)`.
    fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let unit = (self.0 >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo).mul_f64(unit)
    }
}

async fn next_start(
    rx: &mut mpsc::UnboundedReceiver<(String, Instant)>,
    within: Duration,
) -> Result<(String, Instant)> {
    tokio::time::timeout(within, rx.recv())
        .await
        .with_context(|| format!("no replica started leading within {within:?}"))?
        .context("start channel closed")
}

/// Two replicas; the first leads, the second follows once it has read the Lease.
async fn pair(
    server: &ApiServer,
    d: Durations,
    poll_only: bool,
    starts: &Starts,
    rx: &mut mpsc::UnboundedReceiver<(String, Instant)>,
) -> Result<(Replica, Replica)> {
    let leader = Replica::start(server, config("replica-a", d, poll_only), starts)?;
    next_start(rx, Duration::from_secs(10)).await?;
    let follower = Replica::start(server, config("replica-b", d, poll_only), starts)?;
    Ok((leader, follower))
}

/// Graceful handoffs: the leader's token is cancelled (release_on_cancel), measured until the
/// follower's started-leading work runs.
async fn handoffs(poll_only: bool, n: usize, phase: &mut Phase) -> Result<Vec<Duration>> {
    let server = ApiServer::start().await?;
    let (starts, mut rx) = mpsc::unbounded_channel();
    let (mut leader, mut follower) = pair(&server, FAST, poll_only, &starts, &mut rx).await?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let holder = leader.identity.clone();
        follower
            .wait_for(Duration::from_secs(10), |s| {
                s.holder.as_deref() == Some(&holder)
            })
            .await?;
        tokio::time::sleep(phase.between(Duration::from_millis(500), Duration::from_millis(2500)))
            .await;
        let cancelled = Instant::now();
        leader.token.cancel();
        let (who, at) = next_start(&mut rx, Duration::from_secs(10)).await?;
        ensure!(
            who == follower.identity,
            "{who} started leading, expected {}",
            follower.identity
        );
        samples.push(at - cancelled);
        let old = leader.identity.clone();
        leader.stop().await?;
        leader = follower;
        follower = Replica::start(&server, config(&old, FAST, poll_only), &starts)?;
    }
    leader.stop().await?;
    follower.stop().await?;
    Ok(samples)
}

/// One crash: the leader's task is aborted (no release).
struct Crash {
    /// From the server's arrival of the crashed leader's last write to the new leader's
    /// started-leading, minus LeaseDuration: what failover costs beyond the Lease itself.
    beyond_lease: Duration,
    /// From the abort to the new leader's started-leading.
    from_abort: Duration,
}

async fn crashes(poll_only: bool, n: usize, phase: &mut Phase) -> Result<Vec<Crash>> {
    let server = ApiServer::start().await?;
    let (starts, mut rx) = mpsc::unbounded_channel();
    let (mut leader, mut follower) = pair(&server, CRASH, poll_only, &starts, &mut rx).await?;
    let lease = Duration::from_secs(CRASH.0);
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let holder = leader.identity.clone();
        follower
            .wait_for(Duration::from_secs(10), |s| {
                s.holder.as_deref() == Some(&holder)
            })
            .await?;
        server.reset_accounting();
        tokio::time::sleep(phase.between(Duration::from_millis(1500), Duration::from_millis(3500)))
            .await;
        leader.handle.abort();
        let aborted = Instant::now();
        let _ = (&mut leader.handle).await;
        let (who, at) = next_start(&mut rx, lease + Duration::from_secs(10)).await?;
        ensure!(
            who == follower.identity,
            "{who} started leading, expected {}",
            follower.identity
        );
        let last_write = server
            .requests()
            .into_iter()
            .filter(|r| r.client == leader.identity && r.verb == "update" && r.code == 200)
            .map(|r| r.arrived)
            .max()
            .context("the crashed leader renewed at least once")?;
        let Some(beyond_lease) = (at - last_write).checked_sub(lease) else {
            bail!(
                "{who} took the Lease {:?} after the last renew, before LeaseDuration {lease:?}",
                at - last_write
            );
        };
        samples.push(Crash {
            beyond_lease,
            from_abort: at - aborted,
        });
        // Lets the orphaned work of the aborted elector end; the elector itself is gone.
        leader.token.cancel();
        let old = leader.identity.clone();
        leader = follower;
        follower = Replica::start(&server, config(&old, CRASH, poll_only), &starts)?;
    }
    leader.stop().await?;
    follower.stop().await?;
    Ok(samples)
}

/// Requests per minute of one replica in steady state.
#[derive(Debug, Default, Clone, Copy)]
struct Rate {
    reads: f64,
    writes: f64,
}

struct Steady {
    leader: Rate,
    /// The follower with the most requests.
    follower: Rate,
}

/// Three replicas; after they settle, the server's accounting over `window`.
async fn steady(d: Durations, poll_only: bool, window: Duration) -> Result<Steady> {
    let server = ApiServer::start().await?;
    let (starts, mut rx) = mpsc::unbounded_channel();
    let replicas = ["replica-a", "replica-b", "replica-c"]
        .into_iter()
        .map(|id| Replica::start(&server, config(id, d, poll_only), &starts))
        .collect::<Result<Vec<_>>>()?;
    let (leader, _) = next_start(&mut rx, Duration::from_secs(15)).await?;
    for r in &replicas {
        r.wait_for(Duration::from_secs(15), |s| {
            s.holder.as_deref() == Some(&leader)
        })
        .await?;
    }
    // Watches open right after the first read; a moment later everyone is in steady state.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let terms: Vec<u64> = replicas.iter().map(|r| r.state.borrow().terms).collect();
    server.reset_accounting();
    tokio::time::sleep(window).await;
    let counts = server.request_counts();
    let after: Vec<u64> = replicas.iter().map(|r| r.state.borrow().terms).collect();
    ensure!(
        terms == after && rx.try_recv().is_err(),
        "leadership changed during the steady-state window"
    );
    let mut rates: BTreeMap<String, Rate> = BTreeMap::new();
    let per_minute = 60.0 / window.as_secs_f64();
    for ((client, verb, _resource), count) in counts {
        let rate = rates.entry(client).or_default();
        match verb.as_str() {
            "get" | "list" | "watch" | "discovery" => rate.reads += count as f64 * per_minute,
            _ => rate.writes += count as f64 * per_minute,
        }
    }
    for r in replicas {
        r.stop().await?;
    }
    let leader_rate = rates.get(&leader).copied().unwrap_or_default();
    let follower = rates
        .iter()
        .filter(|(id, _)| **id != leader)
        .map(|(_, r)| *r)
        .max_by(|a, b| (a.reads + a.writes).total_cmp(&(b.reads + b.writes)))
        .unwrap_or_default();
    Ok(Steady {
        leader: leader_rate,
        follower,
    })
}

/// Nearest-rank percentile.
fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn ratio(watch: Duration, poll: Duration) -> String {
    format!("{:.0}x", poll.as_secs_f64() / watch.as_secs_f64().max(1e-6))
}

fn rate(r: Rate) -> String {
    format!("{:.1} r / {:.1} w", r.reads, r.writes)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let began = Instant::now();
    let mut phase = Phase::new();

    eprintln!("graceful handoffs: {HANDOFFS} per mode, {}", FAST.label());
    let handoff_watch = handoffs(false, HANDOFFS, &mut phase).await?;
    let handoff_poll = handoffs(true, HANDOFFS, &mut phase).await?;
    eprintln!("crash failovers: {CRASHES} per mode, {}", CRASH.label());
    let crash_watch = crashes(false, CRASHES, &mut phase).await?;
    let crash_poll = crashes(true, CRASHES, &mut phase).await?;
    eprintln!(
        "steady state: 3 replicas, {} s window, four scenarios at once",
        WINDOW.as_secs()
    );
    let (fast_watch, fast_poll, default_watch, default_poll) = tokio::try_join!(
        steady(FAST, false, WINDOW),
        steady(FAST, true, WINDOW),
        steady(DEFAULT, false, WINDOW),
        steady(DEFAULT, true, WINDOW),
    )?;

    let (hw50, hw99) = (
        percentile(&handoff_watch, 0.5),
        percentile(&handoff_watch, 0.99),
    );
    let (hp50, hp99) = (
        percentile(&handoff_poll, 0.5),
        percentile(&handoff_poll, 0.99),
    );
    let beyond = |c: &[Crash]| c.iter().map(|c| c.beyond_lease).collect::<Vec<_>>();
    let abort = |c: &[Crash]| c.iter().map(|c| c.from_abort).collect::<Vec<_>>();
    let (cw, cp) = (beyond(&crash_watch), beyond(&crash_poll));
    let (cw50, cwmax) = (percentile(&cw, 0.5), percentile(&cw, 1.0));
    let (cp50, cpmax) = (percentile(&cp, 0.5), percentile(&cp, 1.0));

    let mut rows: Vec<[String; 4]> = vec![[
        "measurement".into(),
        "watch (default)".into(),
        "poll_only (client-go)".into(),
        "poll_only / watch".into(),
    ]];
    rows.push([
        format!("graceful handoff p50 (n={HANDOFFS}, {})", FAST.label()),
        ms(hw50),
        ms(hp50),
        ratio(hw50, hp50),
    ]);
    rows.push([
        format!("graceful handoff p99 (n={HANDOFFS}, {})", FAST.label()),
        ms(hw99),
        ms(hp99),
        ratio(hw99, hp99),
    ]);
    rows.push([
        format!(
            "crash failover - LeaseDuration, p50 (n={CRASHES}, {})",
            CRASH.label()
        ),
        ms(cw50),
        ms(cp50),
        ratio(cw50, cp50),
    ]);
    rows.push([
        format!(
            "crash failover - LeaseDuration, max (n={CRASHES}, {})",
            CRASH.label()
        ),
        ms(cwmax),
        ms(cpmax),
        ratio(cwmax, cpmax),
    ]);
    rows.push([
        "crash: abort -> new leader, p50".into(),
        ms(percentile(&abort(&crash_watch), 0.5)),
        ms(percentile(&abort(&crash_poll), 0.5)),
        String::new(),
    ]);
    for (d, w, p) in [
        (FAST, &fast_watch, &fast_poll),
        (DEFAULT, &default_watch, &default_poll),
    ] {
        rows.push([
            format!("requests/min, leader ({})", d.label()),
            rate(w.leader),
            rate(p.leader),
            String::new(),
        ]);
        rows.push([
            format!("requests/min, busiest follower ({})", d.label()),
            rate(w.follower),
            rate(p.follower),
            String::new(),
        ]);
    }
    let widths: Vec<usize> = (0..4)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut table = String::new();
    for (n, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(table, "| {} |", cells.join(" | "));
        if n == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(table, "|-{}-|", rule.join("-|-"));
        }
    }
    println!();
    println!("{table}");
    println!(
        "r = reads (get/list/watch), w = writes, per replica per minute over {} s of steady state with 3 replicas.",
        WINDOW.as_secs()
    );
    println!(
        "Watch-mode followers hold one watch open (reopened every 290 s: ~0.2 requests/min, outside a 60 s window)."
    );
    println!(
        "Crash failover - LeaseDuration: from the crashed leader's last renew reaching the server to the new leader's started-leading, minus LeaseDuration."
    );
    println!();
    let fast_rp_writes = 60.0 / FAST.2 as f64;
    let default_rp_writes = 60.0 / DEFAULT.2 as f64;
    let leader_ok = |s: &Steady, per_rp: f64| s.leader.reads == 0.0 && s.leader.writes <= per_rp;
    let follower_ok = |s: &Steady| s.follower.reads + s.follower.writes <= 2.0;
    println!(
        "target: watch handoff p99 < 100 ms: {}",
        verdict(hw99 < Duration::from_millis(100))
    );
    println!(
        "target: watch handoff p99 >= 20x better than poll_only: {} ({})",
        verdict(hp99.as_secs_f64() >= 20.0 * hw99.as_secs_f64()),
        ratio(hw99, hp99)
    );
    println!(
        "target: watch crash failover - LeaseDuration <= 100 ms (max): {}",
        verdict(cwmax <= Duration::from_millis(100))
    );
    println!(
        "target: leader <= 1 write per RetryPeriod, 0 reads (watch, both durations): {}",
        verdict(
            leader_ok(&fast_watch, fast_rp_writes) && leader_ok(&default_watch, default_rp_writes)
        )
    );
    println!(
        "target: each follower <= 2 requests/min (watch, both durations): {}",
        verdict(follower_ok(&fast_watch) && follower_ok(&default_watch))
    );
    println!(
        "run took {:.0} s; handoff samples (ms) watch {:?} poll_only {:?}",
        began.elapsed().as_secs_f64(),
        handoff_watch
            .iter()
            .map(|d| (d.as_secs_f64() * 1e4).round() / 10.0)
            .collect::<Vec<_>>(),
        handoff_poll
            .iter()
            .map(|d| (d.as_secs_f64() * 1e3).round())
            .collect::<Vec<_>>(),
    );
    Ok(())
}
