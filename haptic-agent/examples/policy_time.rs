//! How long the default config policy takes on the rendered 10k-Ingress reference set (the
//! check every apply runs before anything is written): 20 runs, p50 and the slowest.
//!
//! `cargo run --release -p haptic-agent --example policy_time`

fn main() {
    let mut stores = haptic_render::reference::stores().expect("stores");
    haptic_render::fixtures::generate(10_000)
        .load(&mut stores)
        .expect("fixtures");
    let rendered = haptic_render::Renderer::compile(&haptic_render::reference::template_set())
        .expect("compiles")
        .render(&stores)
        .expect("renders");
    let mut files = haptic_agent_client::FileSet::new();
    for (path, content) in rendered.iter() {
        files.insert(path, content.to_vec()).expect("path");
    }
    let policy = haptic_agent_client::Policy::default();
    let mut times = Vec::new();
    for _ in 0..20 {
        let started = std::time::Instant::now();
        let violations = policy.violations(&files);
        times.push(started.elapsed());
        assert!(
            violations.is_empty(),
            "{:?}",
            &violations[..violations.len().min(3)]
        );
    }
    times.sort();
    let cfg = files.get("haproxy.cfg").map_or(0, |c| c.len());
    println!(
        "{} files, {} bytes ({cfg} of haproxy.cfg): policy check p50 {:?}, slowest {:?}",
        files.len(),
        files.total_bytes(),
        times[10],
        times[19]
    );
}
