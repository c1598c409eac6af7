//! Where an endpoint change's delta spends its CPU before the runtime commands, on the rendered
//! 10k-Ingress reference set: the leader's diff and encoding, then the agent's decoding,
//! rebuilding the set (with its checksum), the policy of the change and the runtime plan.
//! 20 runs of each step, p50 and the slowest.
//!
//! `cargo run --release -p haptic-agent --example delta_time [first|middle|last]`: the server
//! line changed is the config's first (default), middle or last one (the set's checksum is
//! hashed on from where the change is). `HAPTIC_DELTA_GROW=1` makes the line one byte
//! longer, so that `haproxy.cfg` changes length.

use std::time::{Duration, Instant};

use haptic_agent_client::{
    ApplyRequest, DeltaRequest, FileSet, Policy,
    protocol::{MAIN_CONFIG, decode_delta, encode_delta},
};

fn time<T>(what: &str, mut step: impl FnMut() -> T) -> T {
    let mut times: Vec<Duration> = Vec::new();
    let mut out = None;
    for _ in 0..20 {
        let started = Instant::now();
        out = Some(step());
        times.push(started.elapsed());
    }
    times.sort();
    println!("{what}: p50 {:?}, slowest {:?}", times[10], times[19]);
    out.expect("ran")
}

fn main() {
    let mut stores = haptic_render::reference::stores().expect("stores");
    haptic_render::fixtures::generate(10_000)
        .load(&mut stores)
        .expect("fixtures");
    let rendered = haptic_render::Renderer::compile(&haptic_render::reference::template_set())
        .expect("compiles")
        .render(&stores)
        .expect("renders");
    let mut base = FileSet::new();
    for (path, content) in rendered.iter() {
        base.insert(path, content.to_vec()).expect("path");
    }
    // An endpoint change: one server line's address; the first server line of the config,
    // or (argument `middle`, `last`) the one in its middle or at its end.
    let cfg = String::from_utf8_lossy(base.get(MAIN_CONFIG).expect("cfg")).into_owned();
    let servers: Vec<&str> = cfg
        .lines()
        .filter(|line| line.trim_start().starts_with("server ") && line.contains(':'))
        .collect();
    let at = match std::env::args().nth(1).as_deref() {
        Some("middle") => servers.len() / 2,
        Some("last") => servers.len() - 1,
        _ => 0,
    };
    let line = *servers.get(at).expect("a server line");
    let address = line
        .split_ascii_whitespace()
        .nth(2)
        .expect("an address")
        .to_owned();
    // `HAPTIC_DELTA_GROW=1`: the new address one byte longer than the old (a spare slot
    // filled, a port of more digits), so that `haproxy.cfg`'s length changes.
    let new_address = match std::env::var_os("HAPTIC_DELTA_GROW") {
        Some(_) => format!("{address}0"),
        None => "10.99.99.99:8080".to_owned(),
    };
    let changed = cfg.replacen(line, &line.replacen(&address, &new_address, 1), 1);
    let mut target = base.clone();
    target.put(MAIN_CONFIG, changed).expect("put");
    let base_checksum = time("base checksum (the whole set)", || {
        haptic_agent_client::protocol::checksum(base.iter().map(|(p, c)| (p, c.as_ref())))
    });
    // The agent's live set knows its checksum, with the hasher's states along it.
    assert_eq!(base.checksum(), base_checksum);
    let request = ApplyRequest::new(1, "bench", 2, target).expect("request");
    println!(
        "{} files, {} bytes, haptic.cfg {} bytes",
        base.len(),
        base.total_bytes(),
        cfg.len()
    );
    let delta = time("leader: DeltaRequest::between", || {
        DeltaRequest::between(&base, &base_checksum, &request)
    });
    let body = time("leader: encode", || {
        encode_delta(&delta.to_wire(), 64 << 10)
    });
    println!(
        "delta: {} whole files, {} patched, body {} bytes",
        delta.files.len(),
        delta.patches.len(),
        body.bytes.len()
    );
    let decoded = time("agent: decode", || {
        decode_delta(&body.bytes, body.gzip, 64 << 20)
            .expect("decodes")
            .into_delta()
            .expect("valid")
    });
    let files = time("agent: apply_to (the set and its checksum)", || {
        decoded.apply_to(&base).expect("applies")
    });
    let policy = Policy::default();
    let (_, roles) = policy.violations_and_roles(&base);
    time("agent: policy of the change", || {
        let hunks = decoded.patches.get(MAIN_CONFIG).map(Vec::as_slice);
        let old = base.get(MAIN_CONFIG).map(AsRef::as_ref);
        policy.violations_of_change(&files, decoded.changed(), &roles, old.zip(hunks))
    });
    time("agent: policy of the whole set (before)", || {
        policy.violations(&files)
    });
    time("agent: runtime plan (the two sets compared)", || {
        haptic_agent::runtime::plan(&base, &files).expect("a runtime change")
    });
    let changed = haptic_agent::runtime::Changed {
        base: decoded.base.clone(),
        paths: decoded.changed().map(str::to_owned).collect(),
        removed: decoded.removed.iter().cloned().collect(),
        config_hunks: decoded.patches.get(MAIN_CONFIG).cloned(),
    };
    time("agent: runtime plan (from the delta's changes)", || {
        haptic_agent::runtime::plan_changed(&base, &base_checksum, &files, &changed)
            .expect("a runtime change")
    });
}
