//! Render benchmarks: compile time of the reference template set, full renders of 10, 100, 1k
//! and 10k Ingresses (time and output MB/s), peak memory of the 10k render, and the same
//! templates rendered by minijinja as a peer, side by side.
//!
//! Every render here is a full one (`with_reuse(false)`); `--bench render_event` measures the
//! render after one watch event, which reuses what did not change.
//!
//! `cargo bench -p haptic-benches --bench render` runs criterion, then prints a summary table
//! (medians of its own timed runs) with the ratios criterion does not compute.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use haptic_benches::measure::median;
use haptic_benches::peer::{PeerContext, PeerRenderer};
use haptic_render::fixtures::{self, Fixtures};
use haptic_render::{FileSet, Renderer, Stores, reference};

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZES: [usize; 4] = [10, 100, 1_000, 10_000];

struct Case {
    n: usize,
    fixtures: Fixtures,
    stores: Stores,
    peer: PeerContext,
    bytes: usize,
}

fn case(n: usize, renderer: &Renderer, peer: &PeerRenderer) -> Case {
    let fixtures = fixtures::generate(n);
    let mut stores = reference::stores().expect("reference stores");
    fixtures.load(&mut stores).expect("load fixtures");
    let set = reference::template_set();
    let context = PeerContext::new(&set, &fixtures, &stores);
    let tera: FileSet = renderer.render(&stores).expect("tera renders");
    let mini: FileSet = peer.render(&context).expect("minijinja renders");
    // The comparison only means something if both engines produce the same bytes.
    assert_eq!(
        tera.checksum(),
        mini.checksum(),
        "tera and minijinja disagree at n={n}"
    );
    Case {
        n,
        bytes: tera.total_bytes(),
        fixtures,
        stores,
        peer: context,
    }
}

/// Marks every store changed, so the next render rebuilds their views (sorted lists and
/// indexes) and every derived view: what a render after a watch event in each store costs.
fn touch_all(stores: &mut Stores, fixtures: &Fixtures) {
    let firsts = [
        ("ingresses", fixtures.ingresses.first()),
        ("services", fixtures.services.first()),
        ("endpointslices", fixtures.endpoint_slices.first()),
        ("secrets", fixtures.secrets.first()),
    ];
    for (store, first) in firsts {
        if let (Some(store), Some(first)) = (stores.get_mut(store), first) {
            store.apply(first).expect("re-apply");
        }
    }
}

fn mb_per_s(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / 1e6 / time.as_secs_f64()
}

fn ms(time: Duration) -> f64 {
    time.as_secs_f64() * 1e3
}

fn main() {
    let set = reference::template_set();
    // Full renders: nothing reused from the previous render (what a fresh renderer does; the
    // render after one event, which reuses, is the render_event bench).
    let renderer = Renderer::compile(&set)
        .expect("reference set compiles")
        .with_reuse(false);
    let peer = PeerRenderer::compile(&set).expect("minijinja compiles the reference set");
    let mut cases: Vec<Case> = SIZES.iter().map(|&n| case(n, &renderer, &peer)).collect();

    let mut criterion = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));

    let mut group = criterion.benchmark_group("compile");
    group.bench_function("tera", |b| {
        b.iter(|| Renderer::compile(&set).expect("compiles"))
    });
    group.bench_function("minijinja", |b| {
        b.iter(|| PeerRenderer::compile(&set).expect("compiles"))
    });
    group.finish();

    let mut group = criterion.benchmark_group("render");
    for case in &mut cases {
        group.throughput(Throughput::Bytes(case.bytes as u64));
        group.bench_with_input(
            BenchmarkId::new("tera", case.n),
            &case.stores,
            |b, stores| b.iter(|| renderer.render(stores).expect("renders")),
        );
        group.bench_with_input(
            BenchmarkId::new("tera-views-rebuilt", case.n),
            &case.n,
            |b, _| {
                b.iter_batched_ref(
                    || {
                        let mut stores = case.stores.clone();
                        touch_all(&mut stores, &case.fixtures);
                        stores
                    },
                    |stores| renderer.render(stores).expect("renders"),
                    criterion::BatchSize::LargeInput,
                )
            },
        );
        group.bench_with_input(
            BenchmarkId::new("minijinja", case.n),
            &case.peer,
            |b, context| b.iter(|| peer.render(context).expect("renders")),
        );
    }
    group.finish();
    criterion.final_summary();

    summary(&set, &renderer, &peer, &mut cases);
}

/// The table for the README: medians of our own runs, plus what criterion does not report.
fn summary(
    set: &haptic_render::TemplateSet,
    renderer: &Renderer,
    peer: &PeerRenderer,
    cases: &mut [Case],
) {
    let compile_tera = median(20, || Renderer::compile(set).expect("compiles"));
    let compile_mini = median(20, || PeerRenderer::compile(set).expect("compiles"));
    println!(
        "\n## render summary (medians; tera renders outputs on all cores, minijinja on one; \
         minijinja / tera > 1 means tera is faster)\n"
    );
    println!(
        "compile the reference set: tera {:.3} ms, minijinja {:.3} ms\n",
        ms(compile_tera),
        ms(compile_mini)
    );
    let single = Renderer::compile(set)
        .expect("compiles")
        .with_threads(1)
        .with_reuse(false);
    println!("load average before: {}", load_average());
    println!(
        "| Ingresses | output | tera | tera MB/s | tera, views rebuilt | tera, 1 thread | minijinja (1 thread) | minijinja / tera 1 thread |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut tera_times = Vec::new();
    for case in cases.iter_mut() {
        let runs = if case.n >= 10_000 { 9 } else { 21 };
        let tera = median(runs, || renderer.render(&case.stores).expect("renders"));
        let rebuilt = median(runs, || {
            touch_all(&mut case.stores, &case.fixtures);
            renderer.render(&case.stores).expect("renders")
        });
        let one = median(runs, || single.render(&case.stores).expect("renders"));
        let mini = median(runs, || peer.render(&case.peer).expect("renders"));
        tera_times.push((case.n, tera, one));
        println!(
            "| {} | {:.2} MB | {:.2} ms | {:.0} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} |",
            case.n,
            case.bytes as f64 / 1e6,
            ms(tera),
            mb_per_s(case.bytes, tera),
            ms(rebuilt),
            ms(one),
            ms(mini),
            mini.as_secs_f64() / one.as_secs_f64()
        );
    }
    let time_of = |n| {
        tera_times
            .iter()
            .find(|(m, _, _)| *m == n)
            .map(|(_, t, o)| (*t, *o))
    };
    if let (Some((t1k, o1k)), Some((t10k, o10k))) = (time_of(1_000), time_of(10_000)) {
        println!(
            "\n10k / 1k render time ratio, each size rendered back to back (the table): {:.2} on all \
             cores, {:.2} on one thread (linear is 10)",
            t10k.as_secs_f64() / t1k.as_secs_f64(),
            o10k.as_secs_f64() / o1k.as_secs_f64()
        );
        let small = cases.iter().position(|c| c.n == 1_000);
        let big = cases.iter().position(|c| c.n == 10_000);
        if let (Some(small), Some(big)) = (small, big) {
            let (a1k, a10k) = interleaved(renderer, &cases[small].stores, &cases[big].stores);
            let (b1k, b10k) = interleaved(&single, &cases[small].stores, &cases[big].stores);
            println!(
                "10k / 1k, the two sizes rendered alternately (neither finds its data left in the \
                 caches by its own previous render, as in a controller whose renders are seconds \
                 apart): 1k {:.2} ms, 10k {:.2} ms, ratio {:.2} on all cores; 1k {:.2} ms, 10k \
                 {:.2} ms, ratio {:.2} on one thread",
                ms(a1k),
                ms(a10k),
                a10k.as_secs_f64() / a1k.as_secs_f64(),
                ms(b1k),
                ms(b10k),
                b10k.as_secs_f64() / b1k.as_secs_f64()
            );
        }
    }
    println!("load average after: {}", load_average());
    if let Some(big) = cases.iter_mut().find(|c| c.n == 10_000) {
        println!(
            "\nrender of the {} set after one watch event (a resource re-applied) in one store, on all cores:",
            big.n
        );
        let firsts = [
            ("ingresses", big.fixtures.ingresses.first()),
            ("services", big.fixtures.services.first()),
            ("endpointslices", big.fixtures.endpoint_slices.first()),
            ("secrets", big.fixtures.secrets.first()),
        ];
        for (store, first) in firsts {
            let Some(first) = first else { continue };
            let time = median(9, || {
                if let Some(store) = big.stores.get_mut(store) {
                    store.apply(first).expect("re-apply");
                }
                renderer.render(&big.stores).expect("renders")
            });
            println!("- {store}: {:.2} ms", ms(time));
        }
        print_peak_memory(big.n);
        let load = median(3, || {
            let mut stores = reference::stores().expect("stores");
            big.fixtures.load(&mut stores).expect("load");
            stores
        });
        println!(
            "loading the 10k fixtures into stores ({} resources, JSON -> template values, once per watch event in the controller): {:.1} ms",
            big.fixtures.len(),
            ms(load)
        );
    }
}

/// Median render times of `small` and `big` rendered alternately, 31 times each.
///
/// A small set rendered back to back keeps its whole working set in the caches (1k Ingresses:
/// about 10 MB against a 32 MiB L3), which a 10k set (about 90 MB of rows) cannot; alternating
/// gives both sizes the same conditions, so their ratio shows how the cost grows.
fn interleaved(renderer: &Renderer, small: &Stores, big: &Stores) -> (Duration, Duration) {
    let mut times = (Vec::new(), Vec::new());
    let timed = |stores: &Stores| {
        let start = std::time::Instant::now();
        std::hint::black_box(renderer.render(stores).expect("renders"));
        start.elapsed()
    };
    for _ in 0..31 {
        times.0.push(timed(small));
        times.1.push(timed(big));
    }
    times.0.sort_unstable();
    times.1.sort_unstable();
    (times.0[times.0.len() / 2], times.1[times.1.len() / 2])
}

/// Runs the render-peak-memory binary (its own process, with a counting allocator) and prints
/// what it measured.
fn print_peak_memory(n: usize) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_render-peak-memory"))
        .arg(n.to_string())
        .output();
    let text = match output {
        Ok(output) if output.status.success() => {
            String::from_utf8_lossy(&output.stdout).into_owned()
        }
        Ok(output) => {
            println!(
                "peak memory: render-peak-memory failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            return;
        }
        Err(e) => {
            println!("peak memory: cannot run render-peak-memory: {e}");
            return;
        }
    };
    let value = |key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let mib = |bytes: f64| bytes / (1024.0 * 1024.0);
    println!(
        "peak heap of the {n}-Ingress render above what was allocated before it (output included): \
         tera {:.1} MiB, minijinja {:.1} MiB; the loaded stores hold {:.1} MiB, their views \
         (sorted lists, indexes, derived views) {:.1} MiB more; output {:.1} MB",
        mib(value("tera_render_peak_bytes")),
        mib(value("minijinja_render_peak_bytes")),
        mib(value("stores_bytes")),
        mib(value("views_bytes")),
        value("output_bytes") / 1e6,
    );
}

/// The machine's load averages, to read the table against: other work on the machine slows
/// every column.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}
