//! `cargo xtask bench agent`: one apply of a 10k-Ingress set on one agent (p50/p99), and a
//! fan-out of a 10-Ingress set to 50 agents, each with its own HAProxy on loopback.
//!
//! Everything is real: agents in this process serve HTTP on loopback and supervise their own
//! HAProxy master-worker processes; the client is `haptic-agent-client`. Prints one table.
//! `-- large` runs only the 10k-Ingress part (repeated measurements take a minute less);
//! `-- hitless` only the hitless part (endpoint changes and certificate rotations through
//! the runtime API and, for comparison, the reload path; `support/hitless.rs`).

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use haptic_agent::{Agent, AgentConfig};
use haptic_agent_client::{AgentClient, ApplyRequest, ClientConfig, FileSet, Outcome, Target};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;

#[path = "support/hitless.rs"]
mod hitless;

const TOKEN: &str = "bench-token";
const LARGE_INGRESSES: usize = 10_000;
const LARGE_APPLIES: usize = 21;
const SMALL_INGRESSES: usize = 10;
const AGENTS: usize = 50;
const FANOUT_ROUNDS: usize = 5;
const CONCURRENCY: usize = 16;

/// A set shaped like what the renderer makes for `ingresses` Ingresses: one backend with
/// three servers per Ingress, host and path maps, a default backend. `variant` changes a
/// comment and a map line, so every variant has its own checksum and forces a real apply.
fn ingress_set(ingresses: usize, port: u16, variant: usize) -> Result<FileSet> {
    let mut cfg = String::with_capacity(ingresses * 320);
    cfg.push_str(&format!(
        "# variant {variant}\n\
         global\n  nbthread 1\n  maxconn 4000\n  log stderr format raw local0 err\n\
         defaults\n  mode http\n  option httplog\n  option forwardfor\n  option http-server-close\n\
         \x20 timeout connect 5s\n  timeout client 50s\n  timeout server 50s\n\
         frontend http\n  bind 127.0.0.1:{port}\n\
         \x20 http-request set-var(txn.host) req.hdr(host),field(1,:),lower\n\
         \x20 use_backend %[var(txn.host),concat(,txn.path),map_beg(maps/paths.map)] if {{ var(txn.host),map(maps/hosts.map) -m found }}\n\
         \x20 default_backend default_backend\n\
         backend default_backend\n  http-request return status 404 content-type text/plain string \"no route\"\n"
    ));
    let mut hosts = String::with_capacity(ingresses * 48);
    let mut paths = String::with_capacity(ingresses * 64);
    for i in 0..ingresses {
        let (namespace, name) = (format!("ns-{}", i % 97), format!("app-{i}"));
        let backend = format!("{namespace}_{name}_http");
        cfg.push_str(&format!(
            "backend {backend}\n  balance roundrobin\n  option httpchk GET /healthz\n\
             \x20 http-request set-header X-Forwarded-Proto http\n\
             \x20 default-server inter 5s fall 3 rise 2\n"
        ));
        for server in 0..3 {
            // Servers on loopback addresses, no health checks: no traffic leaves the host.
            let octet = 1 + (i * 3 + server) % 250;
            cfg.push_str(&format!(
                "  server srv{server} 127.0.{}.{octet}:{} weight 100\n",
                (i / 250) % 250,
                8000 + server
            ));
        }
        hosts.push_str(&format!("{name}.{namespace}.example.com 1\n"));
        paths.push_str(&format!("{name}.{namespace}.example.com/ {backend}\n"));
    }
    paths.push_str(&format!("variant-{variant}.example.com/ default_backend\n"));
    Ok(FileSet::new()
        .with("haproxy.cfg", cfg)?
        .with("maps/hosts.map", hosts)?
        .with("maps/paths.map", paths)?)
}

struct BenchAgent {
    url: reqwest::Url,
    port: u16,
    _data: tempfile::TempDir,
}

async fn start_agent(
    haproxy: &PathBuf,
    shutdown: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<BenchAgent> {
    let data = tempfile::tempdir()?;
    let config = AgentConfig::new(data.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy)
        .with_supervise(true);
    let agent = Agent::open(config).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = reqwest::Url::parse(&format!("http://{}/", listener.local_addr()?))?;
    let shutdown = shutdown.clone();
    tasks.push(tokio::spawn(async move {
        if let Err(error) =
            haptic_agent::serve(agent, listener, shutdown, Duration::from_secs(10)).await
        {
            eprintln!("agent: {error}");
        }
    }));
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    Ok(BenchAgent {
        url,
        port,
        _data: data,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(duration: Duration) -> String {
    format!("{:.0} ms", duration.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() -> Result<()> {
    // `RUST_LOG=haptic_agent=info` shows the agents' own account of each apply (its phases).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let haproxy = haptic_agent::haproxy::find_binary(std::path::Path::new("haproxy"))
        .context("HAProxy not found on PATH or in /usr/sbin: run `cargo xtask setup`")?;
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    let client = AgentClient::new(
        ClientConfig::new(TOKEN)
            .with_request_timeout(Duration::from_secs(120))
            .with_concurrency(CONCURRENCY),
    )?;
    let only_large = std::env::args().skip(1).any(|arg| arg == "large");
    let only_hitless = std::env::args().skip(1).any(|arg| arg == "hitless");
    let result = if only_hitless {
        let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        hitless::rows(&haproxy, &client).await.map(|rows| {
            let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
            println!(
                "| measurement | result | target |\n|---|---|---|\n{rows}\n\
                 load average before: {load_before}load average after: {load_after}"
            );
        })
    } else {
        run(&haproxy, &shutdown, &mut tasks, &client, only_large).await
    };
    shutdown.cancel();
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    result
}

async fn run(
    haproxy: &PathBuf,
    shutdown: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
    client: &AgentClient,
    only_large: bool,
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    // One agent, the 10k-Ingress set. The first apply starts HAProxy; the others reload it.
    let agent = start_agent(haproxy, shutdown, tasks).await?;
    let mut round_trips = Vec::new();
    let mut checks = Vec::new();
    let mut reloads = Vec::new();
    let mut writes = Vec::new();
    let mut agent_own = Vec::new();
    let mut wire = (0, 0, 0);
    for variant in 0..LARGE_APPLIES {
        let files = ingress_set(LARGE_INGRESSES, agent.port, variant)?;
        let request = ApplyRequest::new(1, "bench", variant as u64 + 1, files)?;
        let prepared = client.prepare(&request);
        wire = (
            request.files.total_bytes(),
            prepared.json_len(),
            prepared.wire_len(),
        );
        let started = Instant::now();
        let report = client.apply_prepared(&agent.url, &prepared).await?;
        let took = started.elapsed();
        if report.outcome != Outcome::Applied {
            bail!("apply {variant} was {:?}", report.outcome);
        }
        if variant > 0 {
            round_trips.push(took);
            checks.push(Duration::from_micros(report.timing.check_us));
            reloads.push(Duration::from_micros(report.timing.reload_us));
            writes.push(Duration::from_micros(report.timing.write_us));
            // Everything but HAProxy's two parses: decoding, checksums, fence, writing,
            // swapping, the HTTP exchange.
            let haproxy = report.timing.check_us + report.timing.reload_us;
            agent_own.push(took.saturating_sub(Duration::from_micros(haproxy)));
        }
    }
    for series in [
        &mut round_trips,
        &mut checks,
        &mut reloads,
        &mut writes,
        &mut agent_own,
    ] {
        series.sort();
    }
    let large_rows = format!(
        "| 10k-Ingress apply, round trip (validate + swap + reload), p50 / p99 of {n} | {p50} / {p99} | <= 1000 ms |\n\
         | of which `haproxy -c`, p50 / p99 | {c50} / {c99} | |\n\
         | of which swap + reload + confirm, p50 / p99 | {r50} / {r99} | |\n\
         | of which writing staging (the fsync overlaps the check), p50 / p99 | {w50} / {w99} | |\n\
         | round trip minus check and reload (HTTP, decode, checksums, fence, write), p50 / p99 | {o50} / {o99} | |\n\
         | 10k-Ingress set: files / JSON / on the wire (gzip) | {files:.1} MB / {json:.1} MB / {gz:.2} MB | |\n",
        n = round_trips.len(),
        p50 = ms(percentile(&round_trips, 0.5)),
        p99 = ms(percentile(&round_trips, 0.99)),
        c50 = ms(percentile(&checks, 0.5)),
        c99 = ms(percentile(&checks, 0.99)),
        r50 = ms(percentile(&reloads, 0.5)),
        r99 = ms(percentile(&reloads, 0.99)),
        w50 = ms(percentile(&writes, 0.5)),
        w99 = ms(percentile(&writes, 0.99)),
        o50 = ms(percentile(&agent_own, 0.5)),
        o99 = ms(percentile(&agent_own, 0.99)),
        files = wire.0 as f64 / 1e6,
        json = wire.1 as f64 / 1e6,
        gz = wire.2 as f64 / 1e6,
    );
    if only_large {
        let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "| measurement | result | target |\n|---|---|---|\n{large_rows}\n\
             load average before: {load_before}load average after: {load_after}"
        );
        return Ok(());
    }

    // 50 agents, each with its own HAProxy, the 10-Ingress set.
    let mut agents = Vec::with_capacity(AGENTS);
    for _ in 0..AGENTS {
        agents.push(start_agent(haproxy, shutdown, tasks).await?);
    }
    let targets: Vec<Target> = agents
        .iter()
        .enumerate()
        .map(|(i, agent)| Target {
            name: format!("agent-{i}"),
            url: agent.url.clone(),
        })
        .collect();
    // One set for all, as a leader sends it: every HAProxy binds the same loopback port,
    // which HAProxy opens with SO_REUSEPORT (as in a pod, each would have its own network).
    let shared_port = agents[0].port;
    let serial = AgentClient::new(ClientConfig {
        concurrency: 1,
        ..client.config().clone()
    })?;
    let mut rounds = Vec::new();
    let mut serial_rounds = Vec::new();
    for round in 0..=FANOUT_ROUNDS * 2 {
        let files = ingress_set(SMALL_INGRESSES, shared_port, round)?;
        let request = ApplyRequest::new(1, "bench", round as u64 + 1, files)?;
        // Odd rounds go one agent at a time: their sum of apply times is the uncontended
        // cost, the honest numerator for "total <= sum / (cores x 0.7)".
        let one_by_one = round % 2 == 1;
        let started = Instant::now();
        let results = if one_by_one {
            serial.fan_out(&targets, &request).await
        } else {
            client.fan_out(&targets, &request).await
        };
        let total = started.elapsed();
        let mut own = Duration::ZERO;
        for result in &results {
            let report = result
                .result
                .as_ref()
                .map_err(|error| anyhow::anyhow!("{}: {error}", result.target.name))?;
            own += Duration::from_micros(report.timing.total_us);
        }
        // Round 0 starts the 50 HAProxy processes; the measured rounds are reloads.
        match (round, one_by_one) {
            (0, _) => {}
            (_, true) => serial_rounds.push((total, own)),
            (_, false) => rounds.push((total, own)),
        }
    }
    rounds.sort_by_key(|(total, _)| *total);
    serial_rounds.sort_by_key(|(total, _)| *total);
    let (total, own) = rounds[rounds.len() / 2];
    let (serial_total, serial_own) = serial_rounds[serial_rounds.len() / 2];
    let floor = serial_own.as_secs_f64() / cores as f64;
    let target = serial_own.as_secs_f64() / (cores as f64 * 0.7);
    // The fan-out's 50 HAProxy processes stop before the hitless part starts its own.
    drop(agents);
    shutdown.cancel();
    for task in tasks.drain(..) {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    let hitless_rows = hitless::rows(haproxy, client).await?;
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    println!(
        "| measurement | result | target |\n|---|---|---|\n\
         {large_rows}\
         | fan-out of the 10-Ingress set to {AGENTS} agents (concurrency {CONCURRENCY}), total (median of {rounds}) | {total} | <= {target_ms} |\n\
         | sum of the {AGENTS} agents' own apply times, same round (contended) | {own} | |\n\
         | one agent at a time: total / sum of own apply times (uncontended, median of {rounds}) | {serial_total} / {serial_own} | |\n\
         | floor = uncontended sum / cores ({cores} cores); parallel total / floor | {floor_ms} ; {ratio:.2}x | <= 1.43x |\n\
         {hitless_rows}\
         \nload average before: {load_before}load average after: {load_after}",
        rounds = rounds.len(),
        total = ms(total),
        target_ms = ms(Duration::from_secs_f64(target)),
        own = ms(own),
        serial_total = ms(serial_total),
        serial_own = ms(serial_own),
        load_before = load_before,
        load_after = load_after,
        floor_ms = ms(Duration::from_secs_f64(floor)),
        ratio = total.as_secs_f64() / floor,
    );
    Ok(())
}
