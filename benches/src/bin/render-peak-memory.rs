//! Peak heap memory of one full render of the reference set, in its own process so that the
//! counting allocator does not slow down the timed benchmarks.
//!
//! `render-peak-memory [INGRESSES]` prints `key=value` lines: `ingresses`, `output_bytes`,
//! `stores_bytes` (heap held by the loaded stores), `views_bytes` (what the first render
//! added to them and keeps: sorted lists, indexes, derived views), `tera_render_peak_bytes` and
//! `minijinja_render_peak_bytes` (the most heap each render held at once above what was
//! allocated before it started, output included); then per store of the fixtures
//! `<store>_json_bytes` (its resources as compact JSON), `<store>_store_bytes` (the heap a
//! store of them alone holds as template values) and `<store>_compact_bytes` (the same store
//! compact, `Store::set_compact`). The stores of the render are made compact as the controller
//! makes them (`Renderer::compact_unread_stores`: the reference's Services and EndpointSlices);
//! `compact_stores` names them.

use haptic_benches::peer::{PeerContext, PeerRenderer};
use haptic_render::{Renderer, fixtures, reference};
use peak_alloc::PeakAlloc;

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(arg) => arg.parse()?,
        None => 10_000,
    };
    let set = reference::template_set();
    let renderer = Renderer::compile(&set)?;
    let peer = PeerRenderer::compile(&set)?;
    let fixtures = fixtures::generate(n);

    let before_stores = HEAP.current_usage();
    let mut stores = reference::stores()?;
    let compact = renderer.compact_unread_stores(&mut stores);
    fixtures.load(&mut stores)?;
    let stores_bytes = HEAP.current_usage().saturating_sub(before_stores);
    // Build the store views (sorted lists, indexes) and the derived views outside the measured
    // render, as the minijinja context is built outside its own; what they hold is reported.
    let before_views = HEAP.current_usage();
    drop(renderer.render(&stores)?);
    let views_bytes = HEAP.current_usage().saturating_sub(before_views);

    let before = HEAP.current_usage();
    HEAP.reset_peak_usage();
    let files = renderer.render(&stores)?;
    let tera_peak = HEAP.peak_usage().saturating_sub(before);
    let output_bytes = files.total_bytes();
    drop(files);

    let context = PeerContext::new(&set, &fixtures, &stores);
    let before = HEAP.current_usage();
    HEAP.reset_peak_usage();
    let files = peer.render(&context)?;
    let mini_peak = HEAP.peak_usage().saturating_sub(before);
    drop(files);

    println!("ingresses={n}");
    println!("compact_stores={}", compact.join(","));
    println!("output_bytes={output_bytes}");
    println!("stores_bytes={stores_bytes}");
    println!("views_bytes={views_bytes}");
    println!("tera_render_peak_bytes={tera_peak}");
    println!("minijinja_render_peak_bytes={mini_peak}");
    for (name, resources) in [
        ("ingresses", &fixtures.ingresses),
        ("services", &fixtures.services),
        ("endpointslices", &fixtures.endpoint_slices),
        ("secrets", &fixtures.secrets),
    ] {
        let json: usize = resources
            .iter()
            .map(|resource| serde_json::to_vec(resource).map_or(0, |bytes| bytes.len()))
            .sum();
        println!("{name}_json_bytes={json}");
        for (kind, compact) in [("store", false), ("compact", true)] {
            let mut alone = reference::stores()?;
            let before = HEAP.current_usage();
            if let Some(store) = alone.get_mut(name) {
                store.set_compact(compact);
                for resource in resources {
                    store.apply(resource)?;
                }
            }
            let held = HEAP.current_usage().saturating_sub(before);
            println!("{name}_{kind}_bytes={held}");
        }
    }
    Ok(())
}
