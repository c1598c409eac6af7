//! What an operator sees, on real processes after a real deployment: the controller's and the
//! agent's `/metrics` (parsed with a Prometheus text-format parser), the alerts of `deploy/`
//! against the names the binaries export, `/debug/vars`, and the JSON logs with the reconcile
//! span; none of them shows the TLS private key or the agent token.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use common::*;
use haptic_render::functions::ssl_file;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use prometheus_parse::{Scrape, Value};
use serde_json::json;

/// A GET over plain HTTP/1.1: (status, body).
async fn fetch(addr: &str, path: &str) -> Option<(u16, String)> {
    get(addr, "localhost", path).await
}

fn parse(text: &str) -> Scrape {
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("the page parses")
}

/// Every exported name: histograms as their base name and their `_bucket`, `_sum`, `_count`.
fn names(scrape: &Scrape) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for s in &scrape.samples {
        names.insert(s.metric.clone());
        if matches!(s.value, Value::Histogram(_)) {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{}{suffix}", s.metric));
            }
        }
    }
    names
}

/// The kind of the first sample of `name`, and the sum of its samples' values (a histogram:
/// its count) whose labels include `labels`.
fn metric(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> (&'static str, f64) {
    let samples: Vec<_> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect();
    assert!(!samples.is_empty(), "{name}{labels:?} is not exported");
    let kind = match samples[0].value {
        Value::Counter(_) => "counter",
        Value::Gauge(_) => "gauge",
        Value::Histogram(_) => "histogram",
        Value::Summary(_) => "summary",
        Value::Untyped(_) => "untyped",
    };
    let total = samples
        .iter()
        .map(|s| match &s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(buckets) => buckets.iter().map(|b| b.count).fold(0.0, f64::max),
            Value::Summary(_) => 0.0,
        })
        .sum();
    (kind, total)
}

fn tls_secret(name: &str, host: &str) -> (Secret, String) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec![host.to_owned()]).expect("certificate");
    let key = signing_key.serialize_pem();
    let secret = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": base64(cert.pem()), "tls.key": base64(&key)},
    }))
    .expect("secret");
    (secret, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_alerts_debug_state_and_json_logs_after_a_deploy() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    let agent = Agent::start_with_env(
        &cluster,
        1,
        agent_port,
        http_port,
        &[("HAPTIC_AGENT_LOG_FORMAT", "json")],
    )
    .await;
    let backend = Backend::start("a").await;
    cluster.service("web", backend.addr).await;
    let (secret, private_key) = tls_secret("shop-tls", "shop.example");
    cluster
        .api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await
        .expect("TLS secret");
    let mut ingress = ingress("shop", "shop.example", "/", "web");
    // Served over plain HTTP too (no redirect to HTTPS): the checks below route over HTTP.
    ingress.metadata.annotations = Some(
        [(
            "haproxy-haptic.org/ssl-redirect".to_owned(),
            "false".to_owned(),
        )]
        .into(),
    );
    ingress.spec.as_mut().expect("spec").tls = Some(vec![
        serde_json::from_value(json!({"hosts": ["shop.example"], "secretName": "shop-tls"}))
            .expect("tls"),
    ]);
    cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .create(&PostParams::default(), &ingress)
        .await
        .expect("ingress");
    let debug_port = free_port();
    let debug_addr = format!("127.0.0.1:{debug_port}");
    let controller = Controller::start_with_env(
        &cluster,
        "controller-1",
        &[("LOG_FORMAT", "json"), ("DEBUG_ADDR", &debug_addr)],
    )
    .await;
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let live = agent
        .state()
        .await
        .and_then(|s| s.live_checksum)
        .expect("a live set");
    // The key went out in the set (so the checks below that it shows nowhere else mean it).
    let mut key_body = secret_lines(&private_key);
    let pem = std::fs::read_to_string(
        agent
            .data
            .join("current")
            .join(ssl_file("default", "shop-tls")),
    )
    .expect("the certificate in the live set");
    assert!(key_body.iter().all(|line| pem.contains(line.as_str())));
    // And the key as the Secret's data holds it.
    key_body.push(base64(&private_key)[..48].to_owned());

    // The controller's page, once the leader saw the pod's answer.
    let health = format!("127.0.0.1:{}", controller.health);
    let page = eventually(
        "the controller counts the deployment and the gate's verdict",
        Duration::from_secs(20),
        || async {
            let (status, text) = fetch(&health, "/metrics").await?;
            let scrape = parse(&text);
            // The gate's `haproxy -c` runs beside the deployment and may answer after it.
            (status == 200
                && metric(&scrape, "haptic_deployment_total", &[]).1 >= 1.0
                && metric(&scrape, "haptic_validation_total", &[("stage", "render")]).1 >= 1.0)
                .then_some(text)
        },
    )
    .await;
    let scrape = parse(&page);
    let expected: BTreeMap<&str, &str> = BTreeMap::from([
        ("haptic_change_to_render_seconds", "histogram"),
        ("haptic_standby_renders_total", "counter"),
        ("haptic_reconciliation_duration_seconds", "histogram"),
        ("haptic_reconciliation_total", "counter"),
        ("haptic_reconciliation_errors_total", "counter"),
        ("haptic_deployment_duration_seconds", "histogram"),
        ("haptic_deployment_total", "counter"),
        ("haptic_deployment_errors_total", "counter"),
        ("haptic_validation_total", "counter"),
        ("haptic_validation_errors_total", "counter"),
        ("haptic_resource_count", "gauge"),
        ("haptic_events_published_total", "counter"),
        ("haptic_events_dropped_total", "counter"),
        ("haptic_leader_election_is_leader", "gauge"),
        ("haptic_leader_election_transitions_total", "counter"),
        (
            "haptic_leader_election_time_as_leader_seconds_total",
            "counter",
        ),
    ]);
    assert_eq!(
        expected.keys().copied().collect::<BTreeSet<_>>(),
        haptic_controller::metrics::NAMES.into_iter().collect(),
        "the documented list"
    );
    for (name, kind) in &expected {
        assert_eq!(metric(&scrape, name, &[]).0, *kind, "{name}\n{page}");
    }
    let moved = |name, labels: &[(&str, &str)]| metric(&scrape, name, labels).1;
    assert!(moved("haptic_reconciliation_total", &[]) >= 1.0, "{page}");
    assert!(moved("haptic_reconciliation_duration_seconds", &[]) >= 1.0);
    assert!(moved("haptic_deployment_duration_seconds", &[]) >= 1.0);
    assert!(moved("haptic_validation_total", &[("stage", "config")]) >= 1.0);
    assert!(moved("haptic_validation_total", &[("stage", "render")]) >= 1.0);
    assert!(moved("haptic_events_published_total", &[]) >= 10.0);
    assert_eq!(moved("haptic_leader_election_is_leader", &[]), 1.0);
    assert_eq!(moved("haptic_leader_election_transitions_total", &[]), 1.0);
    assert_eq!(moved("haptic_reconciliation_errors_total", &[]), 0.0);
    assert_eq!(moved("haptic_deployment_errors_total", &[]), 0.0);
    assert_eq!(moved("haptic_validation_errors_total", &[]), 0.0);
    for (store, count) in [("ingresses", 1.0), ("services", 1.0), ("secrets", 1.0)] {
        assert_eq!(
            moved("haptic_resource_count", &[("type", store)]),
            count,
            "{store}"
        );
    }
    let buckets: Vec<f64> = scrape
        .samples
        .iter()
        .find(|s| s.metric == "haptic_reconciliation_duration_seconds")
        .and_then(|s| match &s.value {
            Value::Histogram(b) => Some(b.iter().map(|b| b.less_than).collect()),
            _ => None,
        })
        .expect("buckets");
    assert_eq!(
        buckets,
        [
            0.01,
            0.025,
            0.05,
            0.1,
            0.25,
            0.5,
            1.0,
            2.5,
            5.0,
            10.0,
            f64::INFINITY
        ],
        "HAPTIC's buckets"
    );

    // The agent's page keeps its names.
    let agent_page = agent.fetch("/metrics").await.expect("agent /metrics");
    let agent_scrape = parse(&agent_page);
    for (name, kind) in [
        ("haptic_agent_applies_total", "counter"),
        ("haptic_agent_fence", "gauge"),
        ("haptic_agent_live_generation", "gauge"),
        ("haptic_agent_master_cli_connections_total", "counter"),
        ("haptic_agent_reload_duration_seconds", "histogram"),
        ("haptic_agent_check_duration_seconds", "histogram"),
        ("haptic_agent_apply_duration_seconds", "histogram"),
    ] {
        assert_eq!(metric(&agent_scrape, name, &[]).0, kind, "{name}");
    }
    assert!(
        metric(
            &agent_scrape,
            "haptic_agent_applies_total",
            &[("outcome", "applied")]
        )
        .1 >= 1.0
    );
    assert_eq!(metric(&agent_scrape, "haptic_agent_fence", &[]).1, 1.0);

    // Every metric an alert of deploy/ uses is exported by one of the binaries.
    let rules_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/components/prometheus-rules/prometheusrule.yaml"
    );
    let rules: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(rules_path).expect("prometheusrule.yaml"))
            .expect("PrometheusRule parses");
    let exported: BTreeSet<String> = names(&scrape)
        .union(&names(&agent_scrape))
        .cloned()
        .collect();
    let mut alerts = BTreeSet::new();
    for group in rules["spec"]["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let expr = rule["expr"].as_str().expect("expr");
            let used: Vec<String> = identifiers(expr)
                .into_iter()
                .filter(|w| w.starts_with("haptic_"))
                .collect();
            assert!(!used.is_empty(), "{expr} names no metric of ours");
            for name in used {
                assert!(
                    exported.contains(&name),
                    "alert {} uses {name}, which no binary exports",
                    rule["alert"]
                );
            }
            alerts.insert(rule["alert"].as_str().expect("alert").to_owned());
        }
    }
    assert_eq!(
        alerts,
        [
            "DeploymentFailures",
            "FrequentLeaderChanges",
            "MultipleLeaders",
            "NoLeader",
            "ReconciliationErrors"
        ]
        .map(String::from)
        .into_iter()
        .collect()
    );

    // /debug/vars: what it promises, and no secret.
    // (Once the observer took in the report that follows the pod's answer.)
    let (vars_text, vars) = eventually(
        "/debug/vars shows the pod's live checksum",
        Duration::from_secs(10),
        || async {
            let (status, text) = fetch(&debug_addr, "/debug/vars").await?;
            assert_eq!(status, 200, "{text}");
            let vars: serde_json::Value = serde_json::from_str(&text).expect("JSON");
            (vars["pods"][&agent.name]["liveChecksum"] == live.as_str()).then_some((text, vars))
        },
    )
    .await;
    assert_eq!(vars["leader"]["isLeader"], true, "{vars:#}");
    assert_eq!(vars["leader"]["identity"], "controller-1");
    assert_eq!(vars["leader"]["epoch"], 1);
    assert_eq!(vars["config"]["detail"]["generation"], 1);
    assert_eq!(vars["pods"][&agent.name]["liveChecksum"], live.as_str());
    assert_eq!(vars["lastRender"]["detail"]["checksum"], live.as_str());
    assert!(vars["lastRender"]["detail"]["bytes"].as_u64() > Some(0));
    assert!(
        vars["lastRender"]["detail"]["durationMs"]
            .as_f64()
            .is_some()
    );
    assert!(
        !vars["recentDeployments"]
            .as_array()
            .expect("list")
            .is_empty()
    );
    let events = vars["events"].as_array().expect("events");
    assert!(
        !events.is_empty() && events.len() <= 100,
        "{}",
        events.len()
    );
    assert_eq!(vars["agentToken"]["detail"]["present"], true);
    assert_no_secret("/debug/vars", &vars_text, &key_body);

    // The logs: every line of the controller's is one JSON object; one reconcile span ties
    // the render to the pod's answer; no log of the run shows a secret.
    let logs = controller.logs();
    let lines = json_lines(&logs);
    assert!(lines.len() > 10, "{logs}");
    let correlation = |line: &serde_json::Value| {
        line["spans"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == "reconcile")?["correlation_id"]
            .as_str()
            .map(str::to_owned)
    };
    let answered: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "apply answered: live")
        .collect();
    assert!(!answered.is_empty(), "a pod's answer is logged");
    let answer = answered[0];
    let id = correlation(answer).unwrap_or_else(|| panic!("no reconcile span: {answer}"));
    assert!(
        answer["spans"].as_array().is_some_and(|s| s
            .iter()
            .any(|s| s["name"] == "apply" && s["pod"] == agent.name.as_str())),
        "{answer}"
    );
    assert!(
        lines.iter().any(|l| l["fields"]["message"] == "rendered"
            && correlation(l).as_deref() == Some(id.as_str())),
        "the render of that chain is logged with its id {id}"
    );
    assert_no_secret("the controller's log", &logs, &key_body);
    let agent_log = std::fs::read_to_string(cluster.dir.path().join(&agent.name).join("agent.log"))
        .expect("agent log");
    assert_no_secret("the agent's log", &agent_log, &key_body);
    assert!(!json_lines(&agent_log).is_empty());
    drop(controller);
}

/// Every line of `log`, each of which must be one JSON object.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .filter(serde_json::Value::is_object)
                .unwrap_or_else(|| panic!("not a JSON object: {line}"))
        })
        .collect()
}

/// The base64 lines of a PEM body (no header line), each long enough to be the key alone.
fn secret_lines(pem: &str) -> Vec<String> {
    pem.lines()
        .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        .map(str::to_owned)
        .collect()
}

fn assert_no_secret(what: &str, text: &str, key_lines: &[String]) {
    assert!(!key_lines.is_empty());
    for line in key_lines {
        assert!(
            !text.contains(line.as_str()),
            "{what} shows the private key"
        );
    }
    assert!(!text.contains(TOKEN), "{what} shows the agent token");
    // Nor their base64 (a Secret's data as the API returns it).
    assert!(
        !text.contains(&base64(TOKEN)),
        "{what} shows the agent token's base64"
    );
}

/// The identifiers of a PromQL expression (metric, function and label names alike).
fn identifiers(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.chars().next().is_some_and(|c| c.is_ascii_alphabetic()))
        .map(str::to_owned)
        .collect()
}
