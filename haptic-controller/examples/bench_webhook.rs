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
//! Arguments: Ingress counts (default `1000`), then `--reviews N` (default 50).

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
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--reviews" {
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
        println!("{}", render_row(n));
        drop(controller);
    }
}
