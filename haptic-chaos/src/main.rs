//! `haptic-chaos`: a seeded randomized fault campaign across the whole system (the testkit API
//! server, 3 controller replicas, 3 agents with supervised HAProxy, a writer), checking on
//! every run that no stale apply ever went live. `cargo xtask chaos` builds and runs it; see
//! the README.
//!
//! - [`fleet`]: the processes and objects of one run.
//! - [`schedule`]: the seeded fault schedule.
//! - [`observe`]: the Lease watcher, the traffic prober, the writer, the timeline.
//! - [`expected`]: the final set and routes, worked out independently of the controllers.
//! - [`check`]: the invariants, as pure functions.
//! - [`run`]: one run.

use std::{collections::BTreeMap, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context as _, Result};
use clap::Parser;
use tokio_util::sync::CancellationToken;

mod check;
mod expected;
mod fleet;
mod observe;
mod run;
mod schedule;

use schedule::Kind;

/// A seeded fault campaign: no stale apply ever goes live.
#[derive(Debug, Parser)]
#[command(name = "haptic-chaos")]
struct Args {
    /// Runs to make (seeds SEED, SEED+1, ...).
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// The first seed [default: from the clock]; `--seed S --runs 1` replays run S.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop starting runs once this many minutes have passed (a run in progress finishes).
    #[arg(long)]
    minutes: Option<f64>,
    /// Seconds of faults in each run (each fault ends within them).
    #[arg(long, default_value_t = 16)]
    fault_seconds: u64,
    /// Bound, in seconds, on convergence after the last fault is lifted.
    #[arg(long, default_value_t = 45)]
    settle_seconds: u64,
    /// Where runs put their files [default: a fresh directory under the temp dir].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the files of runs that passed (a failing run's are always kept).
    #[arg(long)]
    keep: bool,
    /// Print each seed's fault schedule and exit without running anything.
    #[arg(long)]
    plan: bool,
    /// Print the timeline of every run, not only of failing ones.
    #[arg(long)]
    verbose: bool,
    /// Also write the campaign's summary as a Markdown table to this file.
    #[arg(long)]
    summary: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("haptic-chaos: starting the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(campaign(args));
    runtime.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("haptic-chaos: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Default)]
struct Totals {
    runs: u64,
    failed: Vec<u64>,
    injected: BTreeMap<Kind, usize>,
    skipped: BTreeMap<String, usize>,
    stale: usize,
    foreign: usize,
    fenced: usize,
    live: usize,
    applied: usize,
    writes: u64,
    epochs: usize,
    convergence: Vec<f64>,
    first: u64,
    last: u64,
}

async fn campaign(args: Args) -> Result<bool> {
    let first = args.seed.unwrap_or_else(|| observe::now_ms() % 1_000_000);
    if args.plan {
        for seed in first..first + args.runs {
            let plan = schedule::Schedule::new(seed, Duration::from_secs(args.fault_seconds));
            println!("seed {seed}: clock {:?}", plan.clock);
            for fault in &plan.faults {
                println!("  {fault}");
            }
        }
        return Ok(true);
    }
    let base = match &args.dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("haptic-chaos-{}", std::process::id())),
    };
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let options = run::RunOptions {
        phase: Duration::from_secs(args.fault_seconds),
        settle: Duration::from_secs(args.settle_seconds),
        base: base.clone(),
        keep: args.keep,
    };
    let token = CancellationToken::new();
    tokio::spawn({
        let token = token.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("haptic-chaos: interrupted; stopping the run and cleaning up");
                token.cancel();
            }
        }
    });
    let started = std::time::Instant::now();
    let budget = args.minutes.map(|m| Duration::from_secs_f64(m * 60.0));
    println!(
        "haptic-chaos: {} run(s) from seed {first}, {} s of faults each{}; files in {}",
        args.runs,
        args.fault_seconds,
        budget.map_or(String::new(), |b| format!(
            ", at most {:.1} min",
            b.as_secs_f64() / 60.0
        )),
        base.display()
    );
    let mut totals = Totals {
        first,
        last: first,
        ..Totals::default()
    };
    let mut longest_run = Duration::ZERO;
    for n in 0..args.runs {
        if token.is_cancelled() {
            break;
        }
        if let Some(budget) = budget
            && started.elapsed() + longest_run > budget
        {
            println!("haptic-chaos: the time budget is used up after {n} run(s)");
            break;
        }
        let seed = first + n;
        let run_started = std::time::Instant::now();
        let report = run::run(seed, &options, &token).await?;
        longest_run = longest_run.max(run_started.elapsed());
        if token.is_cancelled() {
            break;
        }
        print_run(n + 1, &report, run_started.elapsed(), args.verbose);
        add(&mut totals, &report);
    }
    if token.is_cancelled() {
        let _ = std::fs::remove_dir(&base);
        anyhow::bail!("interrupted");
    }
    let summary = summary(&totals);
    println!("{summary}");
    if let Some(path) = &args.summary {
        std::fs::write(path, &summary).with_context(|| format!("writing {}", path.display()))?;
    }
    if totals.failed.is_empty() {
        // Only empty: a failing run's directory stays for a look.
        let _ = std::fs::remove_dir(&base);
    }
    Ok(totals.failed.is_empty() && totals.runs > 0)
}

fn add(totals: &mut Totals, report: &run::RunReport) {
    totals.runs += 1;
    totals.last = report.seed;
    if !report.violations.is_empty() {
        totals.failed.push(report.seed);
    }
    for (kind, n) in &report.injected {
        *totals.injected.entry(*kind).or_default() += n;
    }
    for skipped in &report.skipped {
        *totals.skipped.entry(skipped.clone()).or_default() += 1;
    }
    totals.stale += report.stale;
    totals.foreign += report.foreign;
    totals.fenced += report.fenced;
    totals.live += report.live;
    totals.applied += report.applied;
    totals.writes += u64::from(report.writes);
    totals.epochs += report.epochs;
    totals.convergence.extend(report.convergence);
}

fn print_run(n: u64, report: &run::RunReport, took: Duration, verbose: bool) {
    let faults: Vec<String> = report
        .injected
        .iter()
        .map(|(k, v)| format!("{}x{v}", k.name()))
        .collect();
    let verdict = if report.violations.is_empty() {
        "ok"
    } else {
        "FAILED"
    };
    println!(
        "run {n} seed {}: {verdict} in {:.0} s; faults [{}]; {} writes, {} epochs, {} live applies ({} changed a set), {} fenced, {} stale; converged {}",
        report.seed,
        took.as_secs_f64(),
        faults.join(" "),
        report.writes,
        report.epochs,
        report.live,
        report.applied,
        report.fenced,
        report.stale,
        report.convergence.map_or("never".to_owned(), |c| format!(
            "{c:.1} s after the last fault"
        )),
    );
    if report.violations.is_empty() && !verbose {
        return;
    }
    if !report.violations.is_empty() {
        println!(
            "  seed {} FAILED (replay: cargo xtask chaos --seed {} --runs 1):",
            report.seed, report.seed
        );
    }
    for violation in &report.violations {
        println!("  violation: {violation}");
    }
    println!("  timeline (s from the run's start):");
    for (at, what) in &report.timeline {
        let offset = at.saturating_sub(report.started_ms) as f64 / 1000.0;
        println!("  {offset:>7.2} {what}");
    }
    println!("  logs and data: {}", report.dir.display());
}

fn summary(totals: &Totals) -> String {
    let p = |q| {
        check::percentile(&totals.convergence, q).map_or("-".to_owned(), |v| format!("{v:.1} s"))
    };
    let mut out = String::new();
    out.push_str(&format!(
        "\n| campaign | |\n| --- | --- |\n| runs | {} (seeds {}..={}) |\n| failed runs | {}{} |\n| stale applies accepted | {} |\n| live sets from a replica that did not claim the epoch | {} |\n| stale sends refused by the fence | {} |\n| live applies (changed a set) | {} ({}) |\n| writes to Ingresses and endpoints | {} |\n| epochs claimed | {} |\n| convergence after the last fault, p50 / p99 | {} / {} ({} runs converged) |\n",
        totals.runs,
        totals.first,
        totals.last,
        totals.failed.len(),
        if totals.failed.is_empty() {
            String::new()
        } else {
            format!(" (seeds {:?})", totals.failed)
        },
        totals.stale,
        totals.foreign,
        totals.fenced,
        totals.live,
        totals.applied,
        totals.writes,
        totals.epochs,
        p(50.0),
        p(99.0),
        totals.convergence.len(),
    ));
    out.push_str("\n| fault | injected |\n| --- | --- |\n");
    for kind in Kind::ALL {
        out.push_str(&format!(
            "| {} | {} |\n",
            kind.name(),
            totals.injected.get(&kind).copied().unwrap_or(0)
        ));
    }
    for (why, n) in &totals.skipped {
        out.push_str(&format!("| skipped: {why} | {n} |\n"));
    }
    out
}
