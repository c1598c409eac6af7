//! What one HTTPRoute change costs at scale, on one thread: `render-gateway-event [ROUTES]
//! [RUNS]` loads `fixtures::gateway_api(ROUTES)`, renders once (the views built), then RUNS
//! times renders a copy of the stores in which the first HTTPRoute changed (its generation and
//! a hostname, as the `render_gateway` bench changes it) and prints the median wall clock and
//! this thread's CPU time, the view's share ("derive") and the checksums of the full and the
//! last changed set (a change that should give the same bytes must print the same ones).
//!
//! The render runs in `changed_render`, never inlined: under
//! `valgrind --tool=callgrind --toggle-collect='*changed_render*'` the instruction count is
//! the change's alone (the load and the first render left out), steady whatever the load.

use std::time::{Duration, Instant};

use haptic_benches::measure::{middle, thread_cpu};
use haptic_render::{Renderer, Stores, fixtures, reference};
use serde_json::Value as Json;

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[inline(never)]
fn changed_render(
    renderer: &Renderer,
    stores: &Stores,
) -> Result<String, Box<dyn std::error::Error>> {
    Ok(renderer.render(stores)?.checksum_hex())
}

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
    let renderer = Renderer::compile(&reference::template_set())?.with_threads(1);
    let mut stores = reference::stores()?;
    let mut first = Json::Null;
    for (store, resource) in fixtures::gateway_api(n) {
        if store == "httproutes" && first.is_null() {
            first = resource.clone();
        }
        stores
            .get_mut(store)
            .ok_or_else(|| format!("no store {store}"))?
            .apply(&resource)?;
    }
    println!("checksum {}", renderer.render(&stores)?.checksum_hex());
    let (mut wall, mut cpu, mut derive) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = String::new();
    for round in 0..runs.max(1) {
        let mut route = first.clone();
        route["metadata"]["generation"] = Json::from(round + 2);
        if let Some(hosts) = route["spec"]["hostnames"].as_array_mut() {
            hosts.truncate(1);
            hosts.push(Json::from(format!("changed-{round}.gw.example.com")));
        }
        let mut changed = stores.clone();
        changed
            .get_mut("httproutes")
            .ok_or("no store httproutes")?
            .apply(&route)?;
        let (started, on_cpu) = (Instant::now(), thread_cpu());
        last = changed_render(&renderer, &changed)?;
        wall.push(started.elapsed());
        if let (Some(before), Some(after)) = (on_cpu, thread_cpu()) {
            cpu.push(after.saturating_sub(before));
        }
        derive.push(renderer.last_timings().refresh);
    }
    println!("checksum after the change {last}");
    let median = |times: Vec<Duration>| middle(times).as_secs_f64() * 1e3;
    println!(
        "{n} HTTPRoutes, one changed, median of {runs}: {:.1} ms wall, {:.1} ms on this thread's CPU, derive {:.1} ms",
        median(wall),
        median(cpu),
        median(derive)
    );
    Ok(())
}
