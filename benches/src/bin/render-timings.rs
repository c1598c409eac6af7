//! Where a full render's time goes, output by output: `render-timings [INGRESSES] [RUNS]`
//! loads the reference fixtures, renders once to build the views, then renders RUNS times
//! (nothing reused, one thread, so each output's time is its own) and prints, per output, the
//! median time and its share, largest first. For finding what a template change cost; the
//! timed numbers of record come from `cargo bench -p haptic-benches --bench render`.
//! `RENDER_TIMINGS_BLANK=backends,nginx-frontend` blanks those snippets (their cost, by difference);
//! `RENDER_TIMINGS_REUSE=1` times renders that reuse everything (nothing changed);
//! `RENDER_TIMINGS_THREADS=2` renders on two threads (the wall clock is then the figure);
//! `RENDER_TIMINGS_FIXTURE=gateway` renders `fixtures::gateway_api(n)` (n HTTPRoutes) instead;
//! `RENDER_TIMINGS_DUMP=<dir>` writes the rendered files there (to compare two builds).

use haptic_benches::measure::thread_cpu;
use haptic_render::{Renderer, fixtures, reference};

use std::collections::BTreeMap;
use std::time::Duration;

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = match args.next() {
        Some(arg) => arg.parse()?,
        None => 10_000,
    };
    let runs: usize = match args.next() {
        Some(arg) => arg.parse()?,
        None => 5,
    };
    let mut set = reference::template_set();
    // RENDER_TIMINGS_BLANK=a,b: those snippets render nothing (what they cost, by difference).
    if let Ok(names) = std::env::var("RENDER_TIMINGS_BLANK") {
        for name in names.split(',').filter(|n| !n.is_empty()) {
            match set.template_snippets.get_mut(name) {
                Some(snippet) => snippet.template = String::new(),
                None => return Err(format!("no snippet {name}").into()),
            }
        }
    }
    // RENDER_TIMINGS_SNIPPET=name:path: snippet `name` from that file (to try a change).
    if let Ok(spec) = std::env::var("RENDER_TIMINGS_SNIPPET") {
        let (name, path) = spec
            .split_once(':')
            .ok_or("RENDER_TIMINGS_SNIPPET=name:path")?;
        let source = std::fs::read_to_string(path)?;
        match set.template_snippets.get_mut(name) {
            Some(snippet) => snippet.template = source,
            None => return Err(format!("no snippet {name}").into()),
        }
    }
    // RENDER_TIMINGS_REUSE=1: renders reuse what did not change (here: everything), as the
    // controller's renders after the first do; what a render with nothing to do costs.
    let reuse = std::env::var("RENDER_TIMINGS_REUSE").is_ok_and(|v| v == "1");
    // RENDER_TIMINGS_THREADS=n: render on n threads (default 1: each output's time its own).
    let threads: usize = match std::env::var("RENDER_TIMINGS_THREADS") {
        Ok(n) => n.parse()?,
        Err(_) => 1,
    };
    let renderer = Renderer::compile(&set)?
        .with_reuse(reuse)
        .with_threads(threads);
    let mut stores = reference::stores()?;
    // RENDER_TIMINGS_FIXTURE=gateway: `fixtures::gateway_api(n)` (one Gateway, n HTTPRoutes
    // and their Services) instead of n Ingresses.
    if std::env::var("RENDER_TIMINGS_FIXTURE").is_ok_and(|v| v == "gateway") {
        for (store, resource) in fixtures::gateway_api(n) {
            stores
                .get_mut(store)
                .ok_or_else(|| format!("no store {store}"))?
                .apply(&resource)?;
        }
    } else {
        fixtures::generate(n).load(&mut stores)?;
    }
    // The set's checksum: a template or engine change that should give the same bytes must
    // print the same one.
    let first = renderer.render(&stores)?;
    println!("checksum {}", first.checksum_hex());
    // RENDER_TIMINGS_DUMP=<dir>: the rendered files are written there (to compare two builds).
    if let Ok(dir) = std::env::var("RENDER_TIMINGS_DUMP") {
        first.write_to(std::path::Path::new(&dir))?;
    }
    drop(first);
    let mut per_output: BTreeMap<String, Vec<Duration>> = BTreeMap::new();
    let mut totals = Vec::new();
    let mut phases: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    let mut cpu = Vec::new();
    for _ in 0..runs.max(1) {
        let (started, on_cpu) = (std::time::Instant::now(), thread_cpu());
        drop(renderer.render(&stores)?);
        totals.push(started.elapsed());
        if let (Some(before), Some(after)) = (on_cpu, thread_cpu()) {
            cpu.push(after.saturating_sub(before));
        }
        let timings = renderer.last_timings();
        for (phase, time) in [
            ("(refresh)", timings.refresh),
            ("(context)", timings.context),
            ("(templates, wall clock)", timings.templates),
            ("(assemble)", timings.assemble),
            ("(checksum)", timings.checksum),
        ] {
            phases.entry(phase).or_default().push(time);
        }
        for (path, time) in timings.outputs {
            per_output.entry(path).or_default().push(time);
        }
    }
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2]
    };
    let total = median(&mut totals);
    let mut rows: Vec<(String, Duration)> = per_output
        .into_iter()
        .map(|(path, mut times)| (path, median(&mut times)))
        .collect();
    rows.sort_by_key(|row| std::cmp::Reverse(row.1));
    rows.extend(
        phases
            .into_iter()
            .map(|(phase, mut times)| (phase.to_owned(), median(&mut times))),
    );
    println!(
        "{n} Ingresses, {threads} thread(s), median of {runs}: {:.1} ms",
        total.as_secs_f64() * 1e3
    );
    if !cpu.is_empty() {
        // On a loaded machine the wall clock includes waiting for a core; this does not.
        println!(
            "  on this thread's CPU: {:.1} ms",
            median(&mut cpu).as_secs_f64() * 1e3
        );
    }
    for (path, time) in rows {
        println!(
            "{:>9.2} ms {:>5.1} %  {path}",
            time.as_secs_f64() * 1e3,
            100.0 * time.as_secs_f64() / total.as_secs_f64()
        );
    }
    // The process's memory: the stores, the views and what the renderer keeps, as a
    // controller replica holds them.
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for line in status
            .lines()
            .filter(|l| l.starts_with("VmHWM") || l.starts_with("VmRSS"))
        {
            println!(
                "  {}",
                line.split_whitespace().collect::<Vec<_>>().join(" ")
            );
        }
    }
    Ok(())
}
