//! `cargo xtask bench controller`: end-to-end numbers of the daemon with real processes (the
//! testkit API server in this process; two controller replicas and three agents with supervised
//! HAProxy as child processes), one table from one run.
//!
//! - change to live: an Ingress created through the API until a request through HAProxy on each
//!   of the 3 agents reaches its backend, p50 / p99 over 20 changes, with N Ingresses (with their
//!   Services and EndpointSlices) present;
//! - graceful handoff: SIGTERM to the leader until every agent has accepted the new leader's
//!   first apply; crash: kill -9 until the same, minus LeaseDuration;
//! - RSS of the leader and a follower; API requests per minute of each in steady state.
//!
//! Arguments: Ingress counts, default `100 1000`. Timings use the test config of
//! `tests/common` (LeaseDuration 3 s, minDeploymentInterval 100 ms).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::Ingress};
use kube::api::PostParams;
use serde_json::json;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index.min(samples.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn rss_mib(pid: i32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn populate(cluster: &Cluster, n: usize, backend: std::net::SocketAddr) {
    let services = cluster.api::<Service>();
    let slices = cluster.api::<EndpointSlice>();
    let ingresses = cluster.api::<Ingress>();
    let pp = PostParams::default();
    for i in 0..n {
        let name = format!("svc-{i}");
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
        }))
        .expect("service");
        services.create(&pp, &service).await.expect("service");
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": format!("{name}-1"), "namespace": NS, "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": backend.port(), "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": true}}],
        }))
        .expect("slice");
        slices.create(&pp, &slice).await.expect("slice");
        ingresses
            .create(
                &pp,
                &ingress(&format!("ing-{i}"), &format!("h{i}.example"), "/", &name),
            )
            .await
            .expect("ingress");
    }
}

async fn all_route(agents: &[Agent], host: &str) {
    for agent in agents {
        let addr = agent.http_addr();
        loop {
            if let Some((200, body)) = get(&addr, host, "/").await
                && body.contains("backend a")
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The agent's journal entries answered since `since_ms`: (ms after it, outcome).
async fn journal_since(agent: &Agent, since_ms: u64) -> Vec<(u64, String)> {
    let Some(body) = agent.fetch("/v1/journal").await else {
        return Vec::new();
    };
    let Ok(journal) = serde_json::from_str::<serde_json::Value>(&body) else {
        return Vec::new();
    };
    journal["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let at = entry["at_ms"].as_u64()?;
            (at >= since_ms).then(|| {
                (
                    at - since_ms,
                    entry["outcome"].as_str().unwrap_or("?").to_owned(),
                )
            })
        })
        .collect()
}

/// Until every agent's fence is above `epoch`: the new leader's first apply reached it (an
/// apply raises the fence before anything else, also when its set is already live).
async fn all_accept(agents: &[Agent], epoch: u64) {
    for agent in agents {
        while agent
            .state()
            .await
            .and_then(|s| s.fence)
            .is_none_or(|f| f <= epoch)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// What the off-path render gate saves each change: the `haproxy -c` of the rendered set,
/// which runs beside the deployment instead of before it.
async fn gate_row(n: usize) -> String {
    let config = haptic_controller::config::validate(&haptic_controller::reference::spec(), 1, "1")
        .expect("reference config");
    let mut stores = config.empty_stores();
    haptic_render::fixtures::generate(n)
        .load(&mut stores)
        .expect("fixtures");
    let started = Instant::now();
    let files = config.renderer.render(&stores).expect("render");
    let render_time = started.elapsed();
    let set = haptic_controller::events::RenderedSet {
        checksum: haptic_agent_client::protocol::checksum(files.iter()),
        files,
        config_generation: 1,
        term: std::time::SystemTime::now(),
        span: tracing::Span::none(),
        provenance: Default::default(),
        render_time,
        requests: Default::default(),
    };
    let settings = haptic_controller::render_gate::GateSettings {
        haproxy: Some(haproxy_bin()),
        policy: Default::default(),
    };
    let mut checks = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        haptic_controller::render_gate::policy_check(&settings.policy, &set).expect("policy");
        let refused = haptic_controller::render_gate::check(&settings, &set).await;
        assert!(refused.is_none(), "the reference set passes: {refused:?}");
        checks.push(started.elapsed());
    }
    let check = percentile(&mut checks, 0.5);
    format!(
        "| {n} Ingresses: render / policy + `haproxy -c` kept off the path (saved per change) | {} / {} | |",
        ms(render_time),
        ms(check)
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![100, 1000]
    } else {
        sizes
    };
    let mut rows = Vec::new();
    for &n in &sizes {
        rows.push(gate_row(n).await);
    }
    for &n in &sizes {
        let cluster = Cluster::start().await;
        let (agent_port, http_port) = (free_port(), free_port());
        cluster.create_token().await;
        cluster.apply_htc(&spec(agent_port, http_port)).await;
        let a = Backend::start("a").await;
        cluster.service("web-a", a.addr).await;
        let setup = Instant::now();
        populate(&cluster, n, a.addr).await;
        let mut agents = Vec::new();
        for i in 1..=3 {
            agents.push(Agent::start(&cluster, i, agent_port, http_port).await);
        }
        let mut replicas = vec![
            Controller::start(&cluster, "controller-1").await,
            Controller::start(&cluster, "controller-2").await,
        ];
        all_route(&agents, &format!("h{}.example", n - 1)).await;
        eprintln!(
            "{n} Ingresses: set up and first deployment in {:?}",
            setup.elapsed()
        );

        let mut samples = Vec::new();
        for i in 0..20 {
            let start = Instant::now();
            let start_ms = unix_ms();
            cluster
                .ingress(
                    &format!("new-{i}"),
                    &format!("new{i}.example"),
                    "/",
                    "web-a",
                )
                .await;
            let mut routed = Vec::new();
            for agent in &agents {
                all_route(std::slice::from_ref(agent), &format!("new{i}.example")).await;
                routed.push(start.elapsed());
            }
            samples.push(start.elapsed());
            // Where each change's time went: when each agent routed it, and what each agent's
            // journal recorded since the Ingress was created (answered at, outcome).
            let mut applies = Vec::new();
            for agent in &agents {
                applies.push(journal_since(agent, start_ms).await);
            }
            eprintln!(
                "change {i}: {} (routed per agent at {:?}); agent applies since (ms after create, outcome): {applies:?}",
                ms(start.elapsed()),
                routed.iter().map(|d| d.as_millis()).collect::<Vec<_>>()
            );
            // Past minDeploymentInterval, so each change measures the pipeline, not the pacing.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let p50 = percentile(&mut samples, 0.5);
        let p99 = percentile(&mut samples, 0.99);
        rows.push(format!(
            "| change to live, {n} Ingresses, p50 / p99 | {} / {} | p99 <= 1 s at 1,000 |",
            ms(p50),
            ms(p99)
        ));

        // Steady state: RSS and API requests per minute.
        let leader = cluster.leader().await.expect("leader");
        let (lead, follow) = if replicas[0].name == leader {
            (0, 1)
        } else {
            (1, 0)
        };
        cluster.server.reset_accounting();
        tokio::time::sleep(Duration::from_secs(20)).await;
        let count = |who: &str| {
            cluster
                .server
                .requests()
                .iter()
                .filter(|r| r.client == who)
                .count()
                * 3
        };
        rows.push(format!(
            "| {n} Ingresses: RSS leader / follower | {:.0} / {:.0} MiB | <= 256 MiB at 10,000 |",
            rss_mib(replicas[lead].pid()),
            rss_mib(replicas[follow].pid())
        ));
        rows.push(format!(
            "| {n} Ingresses: API requests per minute, leader / follower | {} / {} | |",
            count(&replicas[lead].name),
            count(&replicas[follow].name)
        ));

        if Some(&n) == sizes.last() {
            // Graceful handoff: SIGTERM until every agent accepted the new leader.
            let epoch = cluster.lease_epoch().await.expect("epoch");
            let mut leaving = replicas.remove(lead);
            let start = Instant::now();
            leaving.signal("TERM");
            all_accept(&agents, epoch).await;
            let handoff = start.elapsed();
            leaving.exited(Duration::from_secs(25)).await;
            rows.push(format!("| graceful handoff (SIGTERM to the new leader's apply on 3 agents), {n} Ingresses | {} | <= 1 s |", ms(handoff)));
            replicas.push(Controller::start(&cluster, &leaving.name).await);
            // Let the restarted replica sync before the crash.
            tokio::time::sleep(Duration::from_secs(3)).await;

            // Crash: kill -9 until every agent accepted the new leader, measured from the moment
            // the Lease expired (its last renewTime + LeaseDuration: the soonest anyone may take
            // over), and from the kill.
            let leader = cluster.leader().await.expect("leader");
            let index = replicas
                .iter()
                .position(|c| c.name == leader)
                .expect("ours");
            let epoch = cluster.lease_epoch().await.expect("epoch");
            let start = Instant::now();
            replicas[index].signal("KILL");
            let killed_at = std::time::SystemTime::now();
            let renewed = cluster.lease_renew_time().await.expect("renewTime");
            all_accept(&agents, epoch).await;
            let from_kill = start.elapsed();
            let expiry = renewed + Duration::from_secs(3);
            let after_expiry = std::time::SystemTime::now()
                .duration_since(expiry.max(killed_at))
                .unwrap_or_default();
            rows.push(format!(
                "| crash: kill -9 to the new leader's apply on 3 agents, after the Lease expired (from the kill; LeaseDuration 3 s), {n} Ingresses | {} ({}) | <= 1 s |",
                ms(after_expiry),
                ms(from_kill)
            ));
        }
        drop((replicas, agents));
    }
    println!("| what | result | target |");
    println!("| --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
}
