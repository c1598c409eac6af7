//! The render at 1,000 and 10,000 HTTPRoutes (Gateway API, `fixtures::gateway_api`): a render of
//! the reference set with nothing changed (criterion's `nothing-changed`: everything reused), the summary's
//! full render with nothing reused, and the render after one HTTPRoute changed (what a watch event
//! costs: the Gateway API view is derived again, the other views are kept).
//!
//! `cargo bench -p haptic-benches --bench render_gateway` runs criterion, then prints a summary
//! (medians of its own runs) with the machine's load average.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use haptic_benches::measure::median;
use haptic_render::{Renderer, Stores, fixtures, reference};
use serde_json::Value as Json;

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZES: [usize; 2] = [1_000, 10_000];

fn stores(n: usize) -> (Stores, Json) {
    let mut stores = reference::stores().expect("reference stores");
    let mut first = Json::Null;
    for (store, resource) in fixtures::gateway_api(n) {
        if store == "httproutes" && first.is_null() {
            first = resource.clone();
        }
        stores
            .get_mut(store)
            .expect("a reference store")
            .apply(&resource)
            .expect("applies");
    }
    (stores, first)
}

/// The route with its generation bumped and one more hostname: a change of its rules' hosts.
fn changed(route: &Json, round: u64) -> Json {
    let mut route = route.clone();
    route["metadata"]["generation"] = Json::from(round + 2);
    if let Some(hosts) = route["spec"]["hostnames"].as_array_mut() {
        hosts.truncate(1);
        hosts.push(Json::from(format!("changed-{round}.gw.example.com")));
    }
    route
}

fn main() {
    let set = reference::template_set();
    let renderer = Renderer::compile(&set).expect("reference set compiles");
    let cases: Vec<(usize, Stores, Json)> = SIZES
        .iter()
        .map(|&n| {
            let (stores, first) = stores(n);
            (n, stores, first)
        })
        .collect();
    let mut criterion = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let mut group = criterion.benchmark_group("render_gateway");
    for (n, stores, first) in &cases {
        group.bench_with_input(
            BenchmarkId::new("nothing-changed", n),
            stores,
            |b, stores| b.iter(|| renderer.render(stores).expect("renders")),
        );
        let mut round = 0;
        group.bench_with_input(BenchmarkId::new("one-route-changed", n), n, |b, _| {
            b.iter_batched_ref(
                || {
                    round += 1;
                    let mut stores = stores.clone();
                    stores
                        .get_mut("httproutes")
                        .expect("store")
                        .apply(&changed(first, round))
                        .expect("applies");
                    stores
                },
                |stores| renderer.render(stores).expect("renders"),
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();
    criterion.final_summary();

    println!();
    // A full render reuses nothing: a renderer with reuse off (what a new leader's first
    // render costs). The criterion group's `nothing-changed` renders with reuse on.
    let no_reuse = Renderer::compile(&set)
        .expect("reference set compiles")
        .with_reuse(false);
    println!(
        "| HTTPRoutes | full render, nothing reused (median) | nothing changed (everything reused) | after one HTTPRoute changed | haproxy.cfg |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for (n, stores, first) in &cases {
        let files = renderer.render(stores).expect("renders");
        let cfg = files.get("haproxy.cfg").map_or(0, <[u8]>::len);
        let fresh = median(5, || no_reuse.render(stores).expect("renders"));
        let full = median(9, || renderer.render(stores).expect("renders"));
        let mut round = 1_000;
        let runs = 9;
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            round += 1;
            let mut changed_stores = stores.clone();
            changed_stores
                .get_mut("httproutes")
                .expect("store")
                .apply(&changed(first, round))
                .expect("applies");
            let start = std::time::Instant::now();
            renderer.render(&changed_stores).expect("renders");
            times.push(start.elapsed());
        }
        times.sort();
        println!(
            "| {n} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} MB |",
            fresh.as_secs_f64() * 1e3,
            full.as_secs_f64() * 1e3,
            times[runs / 2].as_secs_f64() * 1e3,
            cfg as f64 / 1e6
        );
    }
    println!(
        "load average (1, 5, 15 min): {}",
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| "unknown".to_owned())
    );
}
