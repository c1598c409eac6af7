//! `cargo xtask bench webhook`: the admission webhook's latency with real processes. The testkit
//! API server in this process holds N generated Ingresses (`haptic_render::fixtures`: with
//! their Services, EndpointSlices and, for a quarter of them, TLS Secrets) and the reference
//! config; one controller replica runs with the webhook on; this process posts AdmissionReviews
//! of new Ingresses over HTTPS and times each answer (render with the change laid over the
//! stores, policy, `haproxy -c`, the tests' memo), then prints p50 / p90 / p99 / max.
//!
//! Beside it, in this process, the render alone: the overlay render (the stores left as they
//! are) against a copy of the stores with the change applied, which is what an overlay avoids.
//!
//! Then a burst: `--concurrent N` (default 100) reviews sent at once, as a GitOps sync would:
//! their answer times, how many were judged and how many the failure policy answered (past the
//! budget, the queue's wait included), the replica's CPU time and RSS over the burst, and its
//! Lease renewals meanwhile (the longest gap between two, and whether it kept the Lease).
//!
//! Arguments: Ingress counts (default `1000`), then `--reviews N` (default 50), `--concurrent N`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use haptic_render::{Change, Renderer, fixtures, reference};
use k8s_openapi::api::{
    core::v1::{Secret, Service},
    discovery::v1::EndpointSlice,
    networking::v1::Ingress,
};
use kube::api::PostParams;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::{Value, json};

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index.min(samples.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The fixtures, all in the test namespace (the names stay unique).
fn resources(n: usize) -> Vec<(&'static str, Value)> {
    fixtures::generate(n)
        .resources()
        .map(|(store, r)| {
            let mut r = r.clone();
            // IngressClasses are cluster-scoped.
            if store != "ingressclasses" {
                r["metadata"]["namespace"] = json!(NS);
            }
            (store, r)
        })
        .collect()
}

async fn populate(cluster: &Cluster, n: usize) {
    let pp = PostParams::default();
    for (store, r) in resources(n) {
        match store {
            "ingresses" => drop(
                cluster
                    .api::<Ingress>()
                    .create(&pp, &serde_json::from_value(r).expect("ingress"))
                    .await
                    .expect("create"),
            ),
            "services" => drop(
                cluster
                    .api::<Service>()
                    .create(&pp, &serde_json::from_value(r).expect("service"))
                    .await
                    .expect("create"),
            ),
            "endpointslices" => drop(
                cluster
                    .api::<EndpointSlice>()
                    .create(&pp, &serde_json::from_value(r).expect("slice"))
                    .await
                    .expect("create"),
            ),
            // The fixtures' class (ours, and the default: the new Ingresses have no class).
            "ingressclasses" => drop(
                kube::Api::<k8s_openapi::api::networking::v1::IngressClass>::all(
                    cluster.client.clone(),
                )
                .create(&pp, &serde_json::from_value(r).expect("class"))
                .await
                .expect("create"),
            ),
            _ => drop(
                cluster
                    .api::<Secret>()
                    .create(&pp, &serde_json::from_value(r).expect("secret"))
                    .await
                    .expect("create"),
            ),
        }
    }
}

fn new_ingress(k: usize) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {"namespace": NS, "name": format!("bench-{k}")},
        "spec": {"rules": [{"host": format!("bench-{k}.example.com"), "http": {"paths": [
            {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "app-00001", "port": {"number": 80}}}},
        ]}}]},
    })
}

fn review(k: usize) -> Vec<u8> {
    let gvk = json!({"group": "networking.k8s.io", "version": "v1", "kind": "Ingress"});
    let gvr = json!({"group": "networking.k8s.io", "version": "v1", "resource": "ingresses"});
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": format!("u{k}"), "kind": gvk, "resource": gvr, "name": format!("bench-{k}"),
            "namespace": NS, "operation": "CREATE", "userInfo": {"username": "bench"},
            "object": new_ingress(k), "oldObject": null, "dryRun": false},
    }))
    .expect("json")
}

/// The process's CPU time (user + system) and its RSS and peak RSS in MiB, from /proc.
fn usage(pid: i32) -> (Duration, f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces): utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    // The kernel's USER_HZ is 100 on Linux.
    (
        Duration::from_millis(ticks * 10),
        kib("VmRSS:"),
        kib("VmHWM:"),
    )
}

/// `n` reviews at once; what they got, what the replica spent, and its Lease meanwhile.
async fn burst(
    cluster: &Cluster,
    controller: &Controller,
    client: &reqwest::Client,
    url: &str,
    n: usize,
) -> String {
    let pid = controller.pid();
    let (cpu_before, _, _) = usage(pid);
    let stop = tokio_util::sync::CancellationToken::new();
    // Poll the Lease every 100 ms: each change of renewTime is a renewal.
    let lease = {
        let (stop, api) = (
            stop.clone(),
            cluster.api::<k8s_openapi::api::coordination::v1::Lease>(),
        );
        tokio::spawn(async move {
            let (mut renewals, mut longest, mut holders) = (0u32, Duration::ZERO, Vec::new());
            let (mut last, mut since) = (None, Instant::now());
            while !stop.is_cancelled() {
                if let Ok(Some(lease)) = api.get_opt("haptic-leader").await {
                    let spec = lease.spec.unwrap_or_default();
                    let renew = spec.renew_time.map(|t| t.0);
                    if let Some(holder) = spec.holder_identity
                        && holders.last() != Some(&holder)
                    {
                        holders.push(holder);
                    }
                    if renew != last {
                        if last.is_some() {
                            renewals += 1;
                            longest = longest.max(since.elapsed());
                        }
                        last = renew;
                        since = Instant::now();
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            longest = longest.max(since.elapsed());
            (renewals, longest, holders)
        })
    };
    let started = Instant::now();
    let answers = futures::future::join_all((0..n).map(|k| async move {
        let sent = Instant::now();
        // Past the connection cap a connection is closed at once: the API server would answer
        // that review by the configuration's failurePolicy.
        let body = match client.post(url).body(review(100_000 + k)).send().await {
            Ok(answer) => answer.bytes().await.ok(),
            Err(_) => None,
        };
        let Some(body) = body else {
            return (
                sent.elapsed(),
                false,
                "closed at the connection cap".to_owned(),
            );
        };
        let answer: Value = serde_json::from_slice(&body).expect("json");
        let message = answer["response"]["status"]["message"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        (
            sent.elapsed(),
            answer["response"]["allowed"] == true,
            message,
        )
    }))
    .await;
    let wall = started.elapsed();
    let (cpu_after, rss, peak) = usage(pid);
    stop.cancel();
    let (renewals, longest, holders) = lease.await.expect("lease poller");
    let mut times: Vec<Duration> = answers.iter().map(|(t, _, _)| *t).collect();
    let judged = answers.iter().filter(|(_, allowed, _)| *allowed).count();
    let by_policy = answers
        .iter()
        .filter(|(_, _, m)| m.contains("failure policy"))
        .count();
    let capped = answers
        .iter()
        .filter(|(_, _, m)| m.contains("connection cap"))
        .count();
    format!(
        "{n} reviews at once: answered in p50 {} / p99 {} / max {} (all within {}); {judged} judged and allowed, {by_policy} answered by the failure policy past the budget, {capped} closed at the connection cap; \
         replica CPU {:.1} s over {:.1} s ({:.0}% of one core), RSS {rss:.0} MiB (peak {peak:.0} MiB); \
         Lease: {renewals} renewals, longest gap {} (RenewDeadline 2 s), holders {holders:?}",
        ms(percentile(&mut times, 0.5)),
        ms(percentile(&mut times, 0.99)),
        ms(percentile(&mut times, 1.0)),
        ms(wall),
        (cpu_after - cpu_before).as_secs_f64(),
        wall.as_secs_f64(),
        100.0 * (cpu_after - cpu_before).as_secs_f64() / wall.as_secs_f64(),
        ms(longest),
    )
}

/// In this process: the overlay render against a copy of the stores with the change applied.
fn render_row(n: usize) -> String {
    let renderer = Renderer::compile(&reference::template_set()).expect("compile");
    let mut stores = reference::stores().expect("stores");
    for (store, r) in resources(n) {
        stores
            .get_mut(store)
            .expect("store")
            .apply(&r)
            .expect("apply");
    }
    renderer.render(&stores).expect("warm-up render");
    let (mut overlay, mut copy) = (Vec::new(), Vec::new());
    for k in 0..20 {
        let ingress = new_ingress(k);
        let started = Instant::now();
        let over = stores
            .overlay("ingresses", Change::Apply(&ingress))
            .expect("overlay");
        renderer.render_overlay(&stores, &over).expect("render");
        overlay.push(started.elapsed());
        let started = Instant::now();
        let mut copied = stores.clone();
        copied
            .get_mut("ingresses")
            .expect("store")
            .apply(&ingress)
            .expect("apply");
        renderer.render(&copied).expect("render");
        copy.push(started.elapsed());
    }
    format!(
        "render with the change, {n} Ingresses, p50 of 20: overlay {} / copy + apply {}",
        ms(percentile(&mut overlay, 0.5)),
        ms(percentile(&mut copy, 0.5))
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut counts = Vec::new();
    let mut reviews = 50;
    let mut concurrent = 100;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--concurrent" {
            concurrent = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--concurrent N");
        } else if arg == "--reviews" {
            reviews = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--reviews N");
        } else {
            counts.push(arg.parse::<usize>().expect("an Ingress count"));
        }
    }
    if counts.is_empty() {
        counts.push(1000);
    }
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    println!("webhook bench ({profile} build), {reviews} reviews of a new Ingress each");
    for n in counts {
        let cluster = Cluster::start().await;
        cluster.apply_htc(&spec(free_port(), free_port())).await;
        populate(&cluster, n).await;

        let ca_key = KeyPair::generate().expect("key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("ca");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("cert");
        let (cert_file, key_file) = (
            cluster.dir.path().join("tls.crt"),
            cluster.dir.path().join("tls.key"),
        );
        std::fs::write(&cert_file, cert.pem()).expect("write");
        std::fs::write(&key_file, key.serialize_pem()).expect("write");
        let port = free_port();
        let env = [
            ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port}")),
            ("HAPTIC_WEBHOOK_CERT", cert_file.display().to_string()),
            ("HAPTIC_WEBHOOK_KEY", key_file.display().to_string()),
        ];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let controller = Controller::start_with_env(&cluster, "bench-1", &env).await;
        eventually(
            "the controller is ready",
            Duration::from_secs(120),
            || async { (controller.probe("/readyz").await == Some(200)).then_some(()) },
        )
        .await;

        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .tls_backend_rustls()
            .tls_certs_only(reqwest::Certificate::from_pem_bundle(ca.pem().as_bytes()).expect("ca"))
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client");
        let url = format!("https://localhost:{port}/validate");
        // The first review also runs the config's validation tests (memoized per config).
        let started = Instant::now();
        let first = client
            .post(&url)
            .body(review(usize::MAX))
            .send()
            .await
            .expect("review");
        let first_time = started.elapsed();
        assert_eq!(first.status(), 200);
        let mut samples = Vec::new();
        for k in 0..reviews {
            let started = Instant::now();
            let body = client
                .post(&url)
                .body(review(k))
                .send()
                .await
                .expect("review")
                .bytes()
                .await
                .expect("body");
            let answer: Value = serde_json::from_slice(&body).expect("json");
            samples.push(started.elapsed());
            assert_eq!(answer["response"]["allowed"], true, "{answer}");
        }
        println!(
            "{n} Ingresses: review p50 {} / p90 {} / p99 {} / max {} (first, with the validation tests: {})",
            ms(percentile(&mut samples, 0.5)),
            ms(percentile(&mut samples, 0.9)),
            ms(percentile(&mut samples, 0.99)),
            ms(percentile(&mut samples, 1.0)),
            ms(first_time)
        );
        println!(
            "{}",
            burst(&cluster, &controller, &client, &url, concurrent).await
        );
        println!("{}", render_row(n));
        drop(controller);
    }
}
