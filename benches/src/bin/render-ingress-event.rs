//! What one watch event costs at scale, on one thread (`RENDER_EVENT_THREADS=N`: N, as the
//! controller renders on N cores): `render-ingress-event [INGRESSES] [STORE] [RUNS]` loads
//! `fixtures::generate(INGRESSES)`, renders once (the views built), then RUNS times changes
//! STORE's middle resource (`ingresses`, `services`, `endpointslices` or `secrets`: a label,
//! and for an EndpointSlice its first endpoint's readiness, as the `render_event` bench changes
//! them; `ingress-path`: an Ingress's first path, `/` to `/v2`; `service-protocol`: a Service's
//! first port's appProtocol, to h2c), back and forth, and renders; STORE `new` adds a new
//! Service, its EndpointSlice and an Ingress routing a new host to it each round (HAPTIC's
//! protocol: the render that takes a spare backend of the pool). It prints the median wall
//! clock, this thread's CPU time, the views' refresh and the checksum's part (hashed on from
//! where the set differs from the last, as the controller renders), the page faults (memory
//! the render touched afresh: with `MIMALLOC_PURGE_DELAY=0`, as deployed, the allocator gives
//! freed pages back at once and the next render faults them in again), and the checksum of the
//! last changed set (a change that should give the same bytes must print the same one).
//! The stores the templates only read through derived views are kept compact, as the
//! controller keeps them (`RENDER_EVENT_COMPACT=0`: none).
//!
//! The render runs in `changed_render`, never inlined: under
//! `valgrind --tool=callgrind --toggle-collect='*changed_render*'` the instruction count is
//! the events' alone (the load and the first render left out), steady whatever the load.

use std::time::{Duration, Instant};

use haptic_benches::measure::{changed, middle, minor_faults, rss_mib, thread_cpu};
use haptic_render::{FileSet, Renderer, Stores, fixtures, reference};

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// As the controller's coordinator renders: the set hashed on from where it differs from the
/// last one (`Renderer::render_traced_following`).
#[inline(never)]
fn changed_render(
    renderer: &Renderer,
    stores: &Stores,
    last: &FileSet,
) -> Result<FileSet, Box<dyn std::error::Error>> {
    Ok(renderer.render_traced_following(stores, last)?.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // As the controller runs (its `main.rs`: `no_transparent_huge_pages`).
    #[cfg(target_os = "linux")]
    rustix::thread::disable_transparent_huge_pages(true)?;
    let mut args = std::env::args().skip(1);
    let n: usize = match args.next() {
        Some(arg) => arg.parse()?,
        None => 10_000,
    };
    let store = args.next().unwrap_or_else(|| "ingresses".to_owned());
    let runs: usize = match args.next() {
        Some(arg) => arg.parse()?,
        None => 5,
    };
    // `RENDER_EVENT_THREADS=2`: as the controller renders on a 2-core node.
    let threads = std::env::var("RENDER_EVENT_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    let renderer = Renderer::compile(&reference::template_set())?.with_threads(threads);
    let fixture = fixtures::generate(n);
    let mut stores = reference::stores()?;
    // As the controller keeps them (`RENDER_EVENT_COMPACT=0`: every store as template values).
    if std::env::var("RENDER_EVENT_COMPACT").as_deref() != Ok("0") {
        renderer.compact_unread_stores(&mut stores);
    }
    fixture.load(&mut stores)?;
    let mut last = renderer.render(&stores)?;
    println!("checksum {}", last.checksum_hex());
    let rss_first = rss_mib();
    let half = n / 2;
    if store == "new" {
        let mut samples = Samples::default();
        for round in 0..runs.max(1) {
            // Zero-padded: each round's Service is the newest by name too (`new-10` sorts
            // before `new-9`), as a stream of new Services created one after another is.
            for (store, resource) in new_route(&format!("new-{round:05}")) {
                stores
                    .get_mut(store)
                    .ok_or_else(|| format!("no store {store}"))?
                    .apply(&resource)?;
            }
            last = samples.render(&renderer, &stores, &last)?;
        }
        println!("checksum after the last change {}", last.checksum_hex());
        print_phases(&samples.phases);
        print_rss(rss_first);
        println!(
            "{n} Ingresses, a new Service, EndpointSlice and Ingress a round, {}",
            samples.summary()
        );
        return Ok(());
    }
    // `ingress-path` and `service-protocol` change what routes: the Ingress's first path
    // (`/` becomes `/v2`: a route map's entry), the Service's first port's appProtocol (h2c:
    // its backend leaves the pool for a section of its own); a label alone changes no row.
    let (store, routing) = match store.as_str() {
        "ingress-path" => ("ingresses".to_owned(), true),
        "service-protocol" => ("services".to_owned(), true),
        _ => (store, false),
    };
    let resource = match store.as_str() {
        "ingresses" => fixture.ingresses.get(half),
        "services" => fixture.services.get(half),
        "endpointslices" => fixture.endpoint_slices.get(half),
        "secrets" => fixture.secrets.get(half / 4),
        other => return Err(format!("no such store: {other}").into()),
    }
    .ok_or("the fixture has no such resource")?;
    let mut other = changed(&store, resource);
    if routing && store == "ingresses" {
        other["spec"]["rules"][0]["http"]["paths"][0]["path"] = "/v2".into();
    } else if routing {
        other["spec"]["ports"][0]["appProtocol"] = "kubernetes.io/h2c".into();
    }
    let versions = [other, resource.clone()];
    let mut samples = Samples::default();
    for round in 0..runs.max(1) {
        stores
            .get_mut(&store)
            .ok_or_else(|| format!("no store {store}"))?
            .apply(&versions[round % 2])?;
        last = samples.render(&renderer, &stores, &last)?;
    }
    println!("checksum after the last change {}", last.checksum_hex());
    print_phases(&samples.phases);
    print_rss(rss_first);
    println!(
        "{n} Ingresses, one of {store} changed{}, {}",
        match (routing, store.as_str()) {
            (true, _) => " (routing)",
            (_, "endpointslices") => " (an endpoint's readiness)",
            _ => " (a label)",
        },
        samples.summary()
    );
    Ok(())
}

/// What each changed render took, in the order rendered.
#[derive(Default)]
struct Samples {
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
    faults: Vec<u64>,
    phases: Vec<haptic_render::Timings>,
}

impl Samples {
    /// Renders after a change (`changed_render`) and notes what that took.
    fn render(
        &mut self,
        renderer: &Renderer,
        stores: &Stores,
        last: &FileSet,
    ) -> Result<FileSet, Box<dyn std::error::Error>> {
        let (started, on_cpu, faulted) = (Instant::now(), thread_cpu(), minor_faults());
        let set = changed_render(renderer, stores, last)?;
        self.wall.push(started.elapsed());
        if let (Some(before), Some(after)) = (on_cpu, thread_cpu()) {
            self.cpu.push(after.saturating_sub(before));
        }
        if let (Some(before), Some(after)) = (faulted, minor_faults()) {
            self.faults.push(after.saturating_sub(before));
        }
        self.phases.push(renderer.last_timings());
        Ok(set)
    }

    /// The medians, as the last line prints them.
    fn summary(&self) -> String {
        let ms = |pick: &dyn Fn(&haptic_render::Timings) -> Duration| {
            middle(self.phases.iter().map(pick).collect()).as_secs_f64() * 1e3
        };
        let mut faults = self.faults.clone();
        faults.sort_unstable();
        format!(
            "median of {}: {:.1} ms wall, {:.1} ms on this thread's CPU, refresh {:.1} ms, checksum {:.1} ms, {} page faults",
            self.wall.len(),
            middle(self.wall.clone()).as_secs_f64() * 1e3,
            middle(self.cpu.clone()).as_secs_f64() * 1e3,
            ms(&|t| t.refresh),
            ms(&|t| t.checksum),
            faults.get(faults.len() / 2).copied().unwrap_or(0)
        )
    }
}

/// The process's resident memory after the first render and now, after the events (the
/// stores, the views, the renderer's kept fragments and the last set, and what the allocator
/// keeps of the renders in between).
fn print_rss(after_first: Option<f64>) {
    if let (Some(first), Some(now)) = (after_first, rss_mib()) {
        println!("rss after the first render {first:.0} MiB, after the events {now:.0} MiB");
    }
}

/// With `RENDER_EVENT_PHASES=1`: the median of each phase of the renders and of each output's
/// template run (outputs that took under 0.1 ms left out), in milliseconds.
fn print_phases(phases: &[haptic_render::Timings]) {
    if std::env::var_os("RENDER_EVENT_PHASES").is_none() {
        return;
    }
    let ms = |pick: &dyn Fn(&haptic_render::Timings) -> Duration| {
        middle(phases.iter().map(pick).collect()).as_secs_f64() * 1e3
    };
    println!(
        "phases (median ms): refresh {:.2}, context {:.2}, templates {:.2}, assemble {:.2}, checksum {:.2}",
        ms(&|t| t.refresh),
        ms(&|t| t.context),
        ms(&|t| t.templates),
        ms(&|t| t.assemble),
        ms(&|t| t.checksum)
    );
    let Some(first) = phases.first() else { return };
    for (i, (path, _)) in first.outputs.iter().enumerate() {
        let took = ms(&|t| t.outputs.get(i).map_or(Duration::ZERO, |(_, d)| *d));
        if took >= 0.1 {
            println!("  {path}: {took:.2}");
        }
    }
}

/// A new Service `name` (created after every fixture one), its EndpointSlice with one ready
/// endpoint, and an Ingress routing `<name>.example` to it.
fn new_route(name: &str) -> [(&'static str, serde_json::Value); 3] {
    let namespace = "fresh";
    [
        (
            "services",
            serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": namespace, "name": name,
                             "creationTimestamp": "2030-01-01T00:00:00Z"},
                "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
            }),
        ),
        (
            "endpointslices",
            serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": namespace, "name": format!("{name}-1"),
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["10.250.0.1"], "conditions": {"ready": true}}],
            }),
        ),
        (
            "ingresses",
            serde_json::json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                "metadata": {"namespace": namespace, "name": name},
                "spec": {"ingressClassName": fixtures::FIXTURE_CLASS, "rules": [{"host": format!("{name}.example"), "http": {"paths": [
                    {"path": "/", "pathType": "Prefix",
                     "backend": {"service": {"name": name, "port": {"number": 80}}}},
                ]}}]},
            }),
        ),
    ]
}
