//! The render after one watch event at 10,000 Ingresses (issue 26 item 4): an Ingress, a
//! Service, an EndpointSlice or a Secret changed (two versions applied in turn, so every
//! render follows a real change) and the whole set rendered again, with where the time went
//! (store and derived views refreshed, context, each output's templates, assembly, checksum).
//!
//! `cargo bench -p haptic-benches --bench render_event` (`-- <n>` for another size).

use haptic_benches::measure::{changed, middle};
use std::time::Duration;

use haptic_render::fixtures;
use haptic_render::{Change, Renderer, Stores, Timings, reference};

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn ms(time: Duration) -> f64 {
    time.as_secs_f64() * 1e3
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let renderer = Renderer::compile(&reference::template_set()).expect("reference set compiles");
    let fixtures = fixtures::generate(n);
    let mut stores: Stores = reference::stores().expect("reference stores");
    fixtures.load(&mut stores).expect("load fixtures");
    let full = renderer.render(&stores).expect("renders");
    // A full render from nothing: a renderer compiled afresh (no fragment kept) over stores
    // whose views are built.
    let cold: Vec<Duration> = (0..5)
        .map(|_| {
            let fresh = Renderer::compile(&reference::template_set()).expect("compiles");
            let start = std::time::Instant::now();
            std::hint::black_box(fresh.render(&stores).expect("renders"));
            start.elapsed()
        })
        .collect();
    let cold_single: Vec<Duration> = (0..3)
        .map(|_| {
            let fresh = Renderer::compile(&reference::template_set())
                .expect("compiles")
                .with_threads(1);
            let start = std::time::Instant::now();
            std::hint::black_box(fresh.render(&stores).expect("renders"));
            start.elapsed()
        })
        .collect();
    println!(
        "## render after one watch event, {n} Ingresses ({:.2} MB, {} files), load average before: {}",
        full.total_bytes() as f64 / 1e6,
        full.len(),
        load_average()
    );
    let runs = std::env::var("RENDER_EVENT_QUIET_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(9);
    let quiet: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            std::hint::black_box(renderer.render(&stores).expect("renders"));
            start.elapsed()
        })
        .collect();
    renderer.render(&stores).expect("renders");
    let no_reuse = Renderer::compile(&reference::template_set())
        .expect("compiles")
        .with_reuse(false);
    let off: Vec<Duration> = (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            std::hint::black_box(no_reuse.render(&stores).expect("renders"));
            start.elapsed()
        })
        .collect();
    println!(
        "- full render, nothing reused (a fresh renderer's first render): {:.2} ms on all cores (median of 5 renders with reuse off; the first render of fresh renderers: {:.2} ms, {:.2} ms on one thread); load {}",
        ms(middle(off)),
        ms(middle(cold)),
        ms(middle(cold_single)),
        load_average()
    );
    let t = renderer.last_timings();
    println!(
        "- no change: {:.2} ms (last: refresh {:.2}, templates {:.2} {:?}, checksum {:.2}; fragments rendered {} reused {})",
        ms(middle(quiet)),
        ms(t.refresh),
        ms(t.templates),
        t.outputs
            .iter()
            .take(7)
            .map(|(p, d)| format!("{p} {:.2}", ms(*d)))
            .collect::<Vec<_>>(),
        ms(t.checksum),
        t.fragments_rendered,
        t.fragments_reused
    );
    if runs > 9 {
        return;
    }
    let half = n / 2;
    // The webhook's render: an Ingress changed, laid over the stores (nothing kept).
    if let Some(ingress) = fixtures.ingresses.get(half) {
        let changed = changed("ingresses", ingress);
        let overlay = stores
            .overlay("ingresses", Change::Apply(&changed))
            .expect("overlay");
        let time = |renderer: &Renderer| {
            middle(
                (0..7)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        std::hint::black_box(
                            renderer.render_overlay(&stores, &overlay).expect("renders"),
                        );
                        start.elapsed()
                    })
                    .collect(),
            )
        };
        println!(
            "- overlay render of an Ingress change (the webhook's): {:.2} ms reusing, {:.2} ms with reuse off; load {}",
            ms(time(&renderer)),
            ms(time(&no_reuse)),
            load_average()
        );
    }
    let picks = [
        ("ingresses", fixtures.ingresses.get(half)),
        ("services", fixtures.services.get(half)),
        ("endpointslices", fixtures.endpoint_slices.get(half)),
        ("secrets", fixtures.secrets.get(half / 4)),
    ];
    for (store, resource) in picks {
        let Some(resource) = resource else { continue };
        let versions = [changed(store, resource), resource.clone()];
        let mut times = Vec::new();
        let mut phases: Vec<Timings> = Vec::new();
        for round in 0..15 {
            stores
                .get_mut(store)
                .expect("store")
                .apply(&versions[round % 2])
                .expect("apply");
            let start = std::time::Instant::now();
            std::hint::black_box(renderer.render(&stores).expect("renders"));
            times.push(start.elapsed());
            phases.push(renderer.last_timings());
        }
        let total = middle(times);
        let phase = |f: &dyn Fn(&Timings) -> Duration| middle(phases.iter().map(f).collect());
        let mut outputs: Vec<(String, Duration)> = Vec::new();
        if let Some(first) = phases.first() {
            for (i, (path, _)) in first.outputs.iter().enumerate() {
                outputs.push((path.clone(), phase(&|t: &Timings| t.outputs[i].1)));
            }
        }
        outputs.sort_by_key(|(_, t)| std::cmp::Reverse(*t));
        println!(
            "- {store}: {:.2} ms (refresh {:.2}, context {:.2}, templates {:.2} [{}], assemble {:.2}, checksum {:.2}; fragments rendered {}, reused {}); load {}",
            ms(total),
            ms(phase(&|t| t.refresh)),
            ms(phase(&|t| t.context)),
            ms(phase(&|t| t.templates)),
            outputs
                .iter()
                .take(4)
                .map(|(p, t)| format!("{p} {:.2}", ms(*t)))
                .collect::<Vec<_>>()
                .join(", "),
            ms(phase(&|t| t.assemble)),
            ms(phase(&|t| t.checksum)),
            phases.last().map_or(0, |t| t.fragments_rendered),
            phases.last().map_or(0, |t| t.fragments_reused),
            load_average(),
        );
    }
}
