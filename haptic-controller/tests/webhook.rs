//! The admission webhook of the real controller binary, over HTTPS with a test CA: real
//! AdmissionReview JSON posted to `/validate` while the controller runs against the testkit
//! API server with the reference config and an Ingress in its stores.

mod common;

use std::{path::Path, time::Duration};

use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::{Value, json};

/// A CA, and a certificate for 127.0.0.1 and localhost signed by it: (CA, cert, key) PEM.
fn issue() -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("cert");
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// A client trusting `ca` only, on fresh connections.
fn client(ca: &str) -> reqwest::Client {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    reqwest::Client::builder()
        .tls_backend_rustls()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(ca.as_bytes()).expect("ca"))
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn post(client: &reqwest::Client, port: u16, body: Vec<u8>) -> (u16, Value) {
    let response = client
        .post(format!("https://localhost:{port}/validate"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the webhook answers");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// An AdmissionReview v1 as the API server sends it.
fn review(
    operation: &str,
    (group, version, resource, kind): (&str, &str, &str, &str),
    name: &str,
    object: Value,
    old: Value,
) -> Vec<u8> {
    let gvk = json!({"group": group, "version": version, "kind": kind});
    let gvr = json!({"group": group, "version": version, "resource": resource});
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("uid-{name}-{operation}"),
            "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "name": name, "namespace": NS, "operation": operation,
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
            "object": object, "oldObject": old, "dryRun": false,
        },
    }))
    .expect("json")
}

const INGRESS: (&str, &str, &str, &str) = ("networking.k8s.io", "v1", "ingresses", "Ingress");
const HTC_GVR: (&str, &str, &str, &str) = (
    "haproxy-haptic.org",
    "v1alpha1",
    "haproxytemplateconfigs",
    "HAProxyTemplateConfig",
);

fn ingress_json(name: &str, host: &str) -> Value {
    let mut ing = serde_json::to_value(ingress(name, host, "/", "web")).expect("json");
    ing["apiVersion"] = json!("networking.k8s.io/v1");
    ing["kind"] = json!("Ingress");
    ing
}

fn response(answer: &Value) -> (bool, String, Vec<String>) {
    let r = &answer["response"];
    let warnings = r["warnings"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    (
        r["allowed"].as_bool().expect("allowed"),
        r["status"]["message"].as_str().unwrap_or("").to_owned(),
        warnings,
    )
}

fn write_pair(dir: &Path, cert: &str, key: &str) {
    // As a Secret volume does: the new files appear at once.
    for (name, text) in [("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(name)).expect("rename");
    }
}

fn htc_json(spec: &haptic_controller::HAProxyTemplateConfigSpec) -> Value {
    json!({
        "apiVersion": "haproxy-haptic.org/v1alpha1",
        "kind": "HAProxyTemplateConfig",
        "metadata": {"name": HTC, "namespace": NS, "generation": 2},
        "spec": spec,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_judges_reviews_over_tls_and_follows_a_rotated_certificate() {
    let cluster = Cluster::start().await;
    let spec = spec(free_port(), free_port());
    cluster.apply_htc(&spec).await;
    cluster
        .service("web", "127.0.0.1:9".parse().expect("addr"))
        .await;
    cluster.ingress("web", "shop.example.com", "/", "web").await;

    let certs = cluster.dir.path().join("webhook");
    std::fs::create_dir_all(&certs).expect("mkdir");
    let (ca1, cert1, key1) = issue();
    write_pair(&certs, &cert1, &key1);
    let port = free_port();
    let (cert, key) = (certs.join("tls.crt"), certs.join("tls.key"));
    let env = [
        ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port}")),
        ("HAPTIC_WEBHOOK_CERT", cert.display().to_string()),
        ("HAPTIC_WEBHOOK_KEY", key.display().to_string()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let controller = Controller::start_with_env(&cluster, "c1", &env).await;
    eventually(
        "the controller is ready",
        Duration::from_secs(30),
        || async { (controller.probe("/readyz").await == Some(200)).then_some(()) },
    )
    .await;
    let trusting = client(&ca1);

    // A good Ingress is allowed.
    let good = ingress_json("blog", "blog.example.com");
    let (status, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "blog", good.clone(), Value::Null),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["response"]["uid"], "uid-blog-CREATE");
    let (allowed, message, _) = response(&answer);
    assert!(allowed, "{message}\n{}", controller.logs());

    // ingress-nginx annotations are never silently ignored: a snippet is denied, naming it
    // and why; the others are allowed with a warning naming each and its verdict.
    let mut snippet = ingress_json("legacy", "legacy.example.com");
    snippet["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/server-snippet": "location /x { return 200; }",
        "nginx.ingress.kubernetes.io/custom-http-errors": "404,503",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", snippet.clone(), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed, "{answer}");
    assert!(
        message.starts_with("Ingress default/legacy: nginx.ingress.kubernetes.io/server-snippet refused: raw NGINX config is never rendered (CVE-2025-1974"),
        "{message}"
    );
    assert_eq!(answer["response"]["status"]["code"], 403);
    let mut unsupported = ingress_json("legacy", "legacy.example.com");
    unsupported["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/custom-http-errors": "404,503",
        "nginx.ingress.kubernetes.io/no-such-thing": "on",
        "haproxy-haptic.org/ssl-redirect": "false",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", unsupported, Value::Null),
    )
    .await;
    let (allowed, message, warnings) = response(&answer);
    assert!(allowed, "{message}");
    assert_eq!(warnings.len(), 2, "{answer}");
    assert!(
        warnings[0].starts_with("Ingress default/legacy: nginx.ingress.kubernetes.io/custom-http-errors is not applied (not-yet-supported): the backend's error pages are returned as they are"),
        "{answer}"
    );
    assert_eq!(
        warnings[1],
        "Ingress default/legacy: nginx.ingress.kubernetes.io/no-such-thing is not applied (unknown): not an annotation HAPTIC knows (a typo, or one the registry does not list)",
        "{answer}"
    );
    // A value that cannot be applied is denied, naming the annotation and why; one applied
    // differently is allowed with a warning saying how; a supported one silently.
    let mut invalid = ingress_json("legacy", "legacy.example.com");
    invalid["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/whitelist-source-range": "10.0.0.0/8,10.1.2.3/40",
        "nginx.ingress.kubernetes.io/proxy-body-size": "8 MB",
        "nginx.ingress.kubernetes.io/force-ssl-redirect": "true",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", invalid, Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed, "{answer}");
    assert_eq!(
        message,
        "Ingress default/legacy: invalid ingress-nginx annotation values: nginx.ingress.kubernetes.io/whitelist-source-range: \"10.1.2.3/40\" has a prefix length that is not 0-32; nginx.ingress.kubernetes.io/proxy-body-size: \"8 MB\" is not a size (bytes, or a number with a k, m or g suffix)"
    );
    // basic auth from a Secret that does not exist: denied by the render, naming it.
    let mut auth = ingress_json("legacy", "legacy.example.com");
    auth["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/auth-type": "basic",
        "nginx.ingress.kubernetes.io/auth-secret": "no-such-secret",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", auth, Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed, "{answer}");
    assert!(
        message.contains("metadata.annotations[nginx.ingress.kubernetes.io/auth-secret] \"no-such-secret\" cannot be applied: Secret no-such-secret does not exist"),
        "{message}"
    );
    // Client certificates: a CA Secret that does not exist, one of another namespace, a
    // verification mode ingress-nginx does not know: denied, naming the annotation.
    for (annotations, want) in [
        (
            json!({"nginx.ingress.kubernetes.io/auth-tls-secret": "no-ca"}),
            "metadata.annotations[nginx.ingress.kubernetes.io/auth-tls-secret] \"no-ca\" cannot be applied: Secret no-ca does not exist",
        ),
        (
            json!({"nginx.ingress.kubernetes.io/auth-tls-secret": "other/ca"}),
            "nginx.ingress.kubernetes.io/auth-tls-secret: \"other/ca\" is not a Secret of the Ingress's own namespace",
        ),
        (
            json!({"nginx.ingress.kubernetes.io/auth-tls-secret": "ca",
                "nginx.ingress.kubernetes.io/auth-tls-verify-client": "maybe"}),
            "nginx.ingress.kubernetes.io/auth-tls-verify-client: \"maybe\" is not on, off, optional or optional_no_ca",
        ),
        (
            json!({"nginx.ingress.kubernetes.io/backend-protocol": "HTTPS",
                "nginx.ingress.kubernetes.io/proxy-ssl-secret": "no-ca",
                "nginx.ingress.kubernetes.io/proxy-ssl-verify": "on"}),
            "metadata.annotations[nginx.ingress.kubernetes.io/proxy-ssl-secret] \"no-ca\" cannot be applied: Secret no-ca does not exist",
        ),
        (
            json!({"nginx.ingress.kubernetes.io/proxy-ssl-secret": "ca",
                "nginx.ingress.kubernetes.io/proxy-ssl-verify": "yes"}),
            "nginx.ingress.kubernetes.io/proxy-ssl-verify: \"yes\" is not \"on\" or \"off\"",
        ),
    ] {
        let mut tls = ingress_json("legacy", "legacy.example.com");
        tls["metadata"]["annotations"] = annotations;
        let (_, answer) = post(
            &trusting,
            port,
            review("CREATE", INGRESS, "legacy", tls, Value::Null),
        )
        .await;
        let (allowed, message, _) = response(&answer);
        assert!(!allowed, "{answer}");
        assert!(message.contains(want), "{message}");
    }
    // An htpasswd Secret is read only when labelled haproxy-haptic.org/auth-secret: "true"
    // (the controller watches no other Opaque Secret): unlabelled, the Ingress is denied, the
    // message saying what to do; labelled, the controller's store sees it and it is admitted.
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = cluster.api();
    let htpasswd = |labelled: bool| -> k8s_openapi::api::core::v1::Secret {
        let labels = if labelled {
            json!({"haproxy-haptic.org/auth-secret": "true"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({"metadata": {"name": "htpasswd", "namespace": "default",
            "labels": labels}, "type": "Opaque",
            "data": {"auth": base64("alice:$2b$05$ERu7VgXqoHLTArkD/dYmMuZv5uAxu3YTSmWkbyjNItQuph9sdytmm\n")}}))
        .expect("secret")
    };
    secrets
        .create(&kube::api::PostParams::default(), &htpasswd(false))
        .await
        .expect("create the Secret");
    let mut auth = ingress_json("legacy", "legacy.example.com");
    auth["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/auth-type": "basic",
        "nginx.ingress.kubernetes.io/auth-secret": "htpasswd",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", auth.clone(), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed, "{answer}");
    assert!(
        message.contains("Secret htpasswd does not exist or is not labelled haproxy-haptic.org/auth-secret: \"true\""),
        "{message}"
    );
    let mut labelled = secrets.get("htpasswd").await.expect("get the Secret");
    labelled.metadata.labels = Some(
        [(
            "haproxy-haptic.org/auth-secret".to_owned(),
            "true".to_owned(),
        )]
        .into(),
    );
    secrets
        .replace("htpasswd", &kube::api::PostParams::default(), &labelled)
        .await
        .expect("label the Secret");
    eventually(
        "the labelled htpasswd Secret admits the Ingress",
        Duration::from_secs(30),
        || {
            let (trusting, auth) = (&trusting, auth.clone());
            async move {
                let (_, answer) = post(
                    trusting,
                    port,
                    review("CREATE", INGRESS, "legacy", auth, Value::Null),
                )
                .await;
                response(&answer).0.then_some(())
            }
        },
    )
    .await;
    let mut applied = ingress_json("legacy", "legacy.example.com");
    applied["metadata"]["annotations"] = json!({
        "nginx.ingress.kubernetes.io/whitelist-source-range": "10.0.0.0/8",
        "nginx.ingress.kubernetes.io/proxy-body-size": "8m",
    });
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", applied, Value::Null),
    )
    .await;
    let (allowed, message, warnings) = response(&answer);
    assert!(allowed, "{message}");
    assert_eq!(warnings.len(), 1, "{answer}");
    assert!(
        warnings[0].starts_with("Ingress default/legacy: nginx.ingress.kubernetes.io/proxy-body-size is applied, differently from ingress-nginx: a request whose Content-Length is over the size"),
        "{answer}"
    );
    // Another controller's Ingress may carry them: not ours, not judged.
    let mut theirs = snippet.clone();
    theirs["spec"]["ingressClassName"] = json!("nginx");
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "legacy", theirs, Value::Null),
    )
    .await;
    assert_eq!(
        response(&answer),
        (true, String::new(), Vec::new()),
        "{answer}"
    );
    // One stored anyway (here the API server calls no webhook) gets Warning Events.
    snippet["metadata"]["namespace"] = json!(NS);
    cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .create(
            &Default::default(),
            &serde_json::from_value(snippet).expect("ingress"),
        )
        .await
        .expect("ingress created");
    for (reason, note) in [
        (
            "SnippetRefused",
            "nginx.ingress.kubernetes.io/server-snippet refused: raw NGINX config is never rendered (CVE-2025-1974",
        ),
        (
            "AnnotationNotSupported",
            "ingress-nginx annotations not applied: nginx.ingress.kubernetes.io/custom-http-errors (not-yet-supported)",
        ),
    ] {
        let api = cluster.api::<k8s_openapi::api::events::v1::Event>();
        eventually(
            &format!("an Event {reason} on Ingress legacy saying {note:?}"),
            Duration::from_secs(20),
            || async {
                let events = api.list(&Default::default()).await.ok()?;
                events.items.into_iter().find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.type_.as_deref() == Some("Warning")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("legacy")
                        && e.note.as_deref().is_some_and(|n| n.starts_with(note))
                })
            },
        )
        .await;
    }

    // One that would add a directive is denied, naming it, the field, the template and line.
    let evil = ingress_json("evil", "evil.example.com\n    lua-load /etc/passwd");
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "evil", evil.clone(), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed, "{answer}");
    for part in [
        "Ingress default/evil",
        "template `route-entries` line",
        "ingresses default/evil: spec.rules[].host \"evil.example.com\\n    lua-load /etc/passwd\"",
        "refused",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert_eq!(answer["response"]["status"]["code"], 403);

    // The same Ingress of another controller's class is not ours: allowed at once, without
    // rendering (nothing of ours reads it); by the legacy annotation too.
    let mut theirs = evil.clone();
    theirs["spec"]["ingressClassName"] = json!("nginx");
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "evil", theirs, Value::Null),
    )
    .await;
    assert_eq!(
        response(&answer),
        (true, String::new(), Vec::new()),
        "{answer}"
    );
    let mut legacy = evil.clone();
    if let Some(spec) = legacy["spec"].as_object_mut() {
        spec.remove("ingressClassName");
    }
    legacy["metadata"]["annotations"] = json!({"kubernetes.io/ingress.class": "nginx"});
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "evil", legacy.clone(), Value::Null),
    )
    .await;
    assert!(response(&answer).0, "{answer}");
    // Naming our class by the annotation makes it ours again: judged, and denied.
    legacy["metadata"]["annotations"] = json!({"kubernetes.io/ingress.class": CLASS});
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", INGRESS, "evil", legacy, Value::Null),
    )
    .await;
    assert!(!response(&answer).0, "{answer}");

    // The store comes from group/version/resource, not from how the kind is spelled.
    let odd = ("networking.k8s.io", "v1", "ingresses", "ingress");
    let (_, answer) = post(
        &trusting,
        port,
        review("UPDATE", odd, "evil", evil.clone(), good.clone()),
    )
    .await;
    assert!(!response(&answer).0, "{answer}");
    // Resources whose store does not enable the webhook are not judged.
    let service = ("", "v1", "services", "Service");
    let (_, answer) = post(
        &trusting,
        port,
        review(
            "CREATE",
            service,
            "x",
            json!({"metadata": {"name": "x", "namespace": NS}, "spec": {"ports": [{"port": 1}]}}),
            Value::Null,
        ),
    )
    .await;
    assert!(response(&answer).0, "{answer}");
    // A removal is judged too: the config without the Ingress still renders and checks.
    let web = ingress_json("web", "shop.example.com");
    let (_, answer) = post(
        &trusting,
        port,
        review("DELETE", INGRESS, "web", Value::Null, web),
    )
    .await;
    assert!(response(&answer).0, "{answer}");

    // The HAProxyTemplateConfig itself: a template error, a config HAProxy refuses and a
    // failing validation test are denied; the running config is allowed.
    let (_, answer) = post(
        &trusting,
        port,
        review("UPDATE", HTC_GVR, HTC, htc_json(&spec), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(allowed, "{message}");
    let mut broken = spec.clone();
    broken
        .haproxy_config
        .template
        .push_str("\n{% for x in %}\n");
    let (_, answer) = post(
        &trusting,
        port,
        review("UPDATE", HTC_GVR, HTC, htc_json(&broken), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed);
    assert!(
        message
            .contains("HAProxyTemplateConfig default/haptic-config: template `haproxyConfig` line"),
        "{message}"
    );
    let mut refused = spec.clone();
    refused
        .haproxy_config
        .template
        .push_str("\n    no-such-keyword on\n");
    let (_, answer) = post(
        &trusting,
        port,
        review("UPDATE", HTC_GVR, HTC, htc_json(&refused), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed);
    assert!(
        message.contains("HAProxy refuses the config rendered with it: [ALERT]")
            && message.contains("no-such-keyword"),
        "{message}"
    );
    let mut failing = spec.clone();
    failing
        .validation_tests
        .get_mut("ipv6")
        .expect("reference test")
        .assertions
        .push(
            serde_json::from_value(json!({"type": "contains", "pattern": "no such line"}))
                .expect("assertion"),
        );
    let (_, answer) = post(
        &trusting,
        port,
        review("CREATE", HTC_GVR, HTC, htc_json(&failing), Value::Null),
    )
    .await;
    let (allowed, message, _) = response(&answer);
    assert!(!allowed);
    assert!(
        message.contains("validation tests fail: test ipv6: assertion #2 (contains on haproxy.cfg): pattern \"no such line\" matches nowhere"),
        "{message}"
    );

    // Malformed reviews: 400.
    for body in [
        b"{not json".to_vec(),
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": null})).expect("json"),
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})).expect("json"),
    ] {
        let (status, answer) = post(&trusting, port, body).await;
        assert_eq!(status, 400, "{answer}");
    }
    // Each answer is counted: haptic_webhook_requests_total{gvk,result}.
    let (_, page) = get(
        &format!("127.0.0.1:{}", controller.health),
        "localhost",
        "/metrics",
    )
    .await
    .expect("/metrics");
    let count = |gvk: &str, result: &str| -> f64 {
        page.lines()
            .filter(|l| {
                l.starts_with("haptic_webhook_requests_total{")
                    && l.contains(&format!("gvk=\"{gvk}\""))
                    && l.contains(&format!("result=\"{result}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(
        count("networking.k8s.io/v1/Ingress", "allowed") >= 1.0,
        "{page}"
    );
    assert!(
        count("networking.k8s.io/v1/Ingress", "denied") >= 1.0,
        "{page}"
    );
    assert_eq!(count("", "malformed"), 3.0, "{page}");

    // A rotated certificate is served from the next connection on, with no restart.
    let (ca2, cert2, key2) = issue();
    write_pair(&certs, &cert2, &key2);
    let (status, _) = post(
        &client(&ca2),
        port,
        review("CREATE", INGRESS, "blog", good.clone(), Value::Null),
    )
    .await;
    assert_eq!(status, 200);
    let stale = client(&ca1)
        .post(format!("https://localhost:{port}/validate"))
        .body(Vec::new())
        .send()
        .await;
    assert!(stale.is_err(), "the old CA no longer verifies: {stale:?}");

    // A review past its budget is answered by the failure policy (here: ignore), never left
    // hanging: haproxy -c alone takes longer than a 1 ms budget.
    let port2 = free_port();
    let env2 = [
        ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port2}")),
        ("HAPTIC_WEBHOOK_CERT", cert.display().to_string()),
        ("HAPTIC_WEBHOOK_KEY", key.display().to_string()),
        ("HAPTIC_WEBHOOK_BUDGET_MS", "1".to_owned()),
        ("HAPTIC_WEBHOOK_FAILURE_POLICY", "ignore".to_owned()),
    ];
    let env2: Vec<(&str, &str)> = env2.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let hurried = Controller::start_with_env(&cluster, "c2", &env2).await;
    eventually(
        "the second replica is ready",
        Duration::from_secs(30),
        || async { (hurried.probe("/readyz").await == Some(200)).then_some(()) },
    )
    .await;
    let (_, answer) = post(
        &client(&ca2),
        port2,
        review("CREATE", INGRESS, "blog", good, Value::Null),
    )
    .await;
    let (allowed, _, warnings) = response(&answer);
    assert!(allowed, "{answer}");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("did not finish within its budget of 1ms")
                && w.contains("failure policy: ignore")),
        "{warnings:?}"
    );
}

const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
const GATEWAY: (&str, &str, &str, &str) = (GATEWAY_GROUP, "v1", "gateways", "Gateway");
const HTTP_ROUTE: (&str, &str, &str, &str) = (GATEWAY_GROUP, "v1", "httproutes", "HTTPRoute");

/// A CustomResourceDefinition of the Gateway API group that keeps every field.
fn gateway_crd(plural: &str, kind: &str, version: &str, namespaced: bool) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{GATEWAY_GROUP}")},
        "spec": {
            "group": GATEWAY_GROUP,
            "names": {"plural": plural, "singular": kind.to_lowercase(), "kind": kind,
                      "listKind": format!("{kind}List")},
            "scope": if namespaced { "Namespaced" } else { "Cluster" },
            "versions": [{"name": version, "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    })
}

async fn create_object(
    cluster: &Cluster,
    (group, version, plural, kind): (&str, &str, &str, &str),
    namespaced: bool,
    value: Value,
) {
    use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(cluster.client.clone(), NS, &ar)
    } else {
        Api::all_with(cluster.client.clone(), &ar)
    };
    let object: DynamicObject = serde_json::from_value(value).expect("object");
    api.create(&PostParams::default(), &object)
        .await
        .expect("created");
}

fn gateway_json(name: &str, class: &str, listeners: Value) -> Value {
    json!({"apiVersion": format!("{GATEWAY_GROUP}/v1"), "kind": "Gateway",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"gatewayClassName": class, "listeners": listeners}})
}

fn route_json(name: &str, gateway: &str, hostname: &str, path: Value) -> Value {
    json!({"apiVersion": format!("{GATEWAY_GROUP}/v1"), "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"parentRefs": [{"name": gateway}], "hostnames": [hostname],
            "rules": [{"matches": [{"path": path}],
                       "backendRefs": [{"name": "web", "port": 80}]}]}})
}

/// Gateways and HTTPRoutes of our classes are judged as Ingresses are: what the CRD schema
/// refuses and the view would leave out is denied naming the object and field; what the API
/// answers with status (a match we do not support, a missing Secret) is allowed with a warning
/// naming the condition; those of another controller's class are allowed without rendering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_judges_gateways_and_http_routes_of_our_classes() {
    let cluster = Cluster::start().await;
    let spec = spec(free_port(), free_port());
    cluster.apply_htc(&spec).await;
    cluster
        .service("web", "127.0.0.1:9".parse().expect("addr"))
        .await;
    let crds = (
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
    );
    for (plural, kind, version, namespaced) in [
        ("gatewayclasses", "GatewayClass", "v1", false),
        ("gateways", "Gateway", "v1", true),
        ("httproutes", "HTTPRoute", "v1", true),
        ("referencegrants", "ReferenceGrant", "v1beta1", true),
    ] {
        create_object(
            &cluster,
            crds,
            false,
            gateway_crd(plural, kind, version, namespaced),
        )
        .await;
    }
    let class = (GATEWAY_GROUP, "v1", "gatewayclasses", "GatewayClass");
    for (name, controller) in [
        ("haptic", "haproxy-haptic.org/gateway-controller"),
        ("theirs", "example.com/other"),
    ] {
        create_object(
            &cluster,
            class,
            false,
            json!({"apiVersion": format!("{GATEWAY_GROUP}/v1"), "kind": "GatewayClass",
                "metadata": {"name": name}, "spec": {"controllerName": controller}}),
        )
        .await;
    }
    let listener = json!([{"name": "http", "protocol": "HTTP", "port": free_port()}]);
    create_object(
        &cluster,
        GATEWAY,
        true,
        gateway_json("gw", "haptic", listener.clone()),
    )
    .await;
    create_object(
        &cluster,
        GATEWAY,
        true,
        gateway_json("other", "theirs", listener.clone()),
    )
    .await;

    let certs = cluster.dir.path().join("webhook");
    std::fs::create_dir_all(&certs).expect("mkdir");
    let (ca, cert, key) = issue();
    write_pair(&certs, &cert, &key);
    let port = free_port();
    let env = [
        ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port}")),
        (
            "HAPTIC_WEBHOOK_CERT",
            certs.join("tls.crt").display().to_string(),
        ),
        (
            "HAPTIC_WEBHOOK_KEY",
            certs.join("tls.key").display().to_string(),
        ),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let controller = Controller::start_with_env(&cluster, "c1", &env).await;
    eventually(
        "the controller is ready",
        Duration::from_secs(30),
        || async { (controller.probe("/readyz").await == Some(200)).then_some(()) },
    )
    .await;
    let client = client(&ca);
    let judge = |resource, name: &str, object: Value| {
        let body = review("CREATE", resource, name, object, Value::Null);
        let client = client.clone();
        async move {
            let (status, answer) = post(&client, port, body).await;
            assert_eq!(status, 200, "{answer}");
            response(&answer)
        }
    };

    // A RegularExpression path the API takes and HAPTIC does not (unbalanced: HAProxy would not
    // compile it): allowed, and the warning says what the route's status will. (Eventually: the
    // Gateway API stores load after the CRDs.)
    let regex = route_json(
        "regex",
        "gw",
        "a.example",
        json!({"type": "RegularExpression", "value": "/a("}),
    );
    let warnings = eventually(
        "the webhook warns about an unsupported match",
        Duration::from_secs(30),
        || async {
            let (allowed, message, warnings) = judge(HTTP_ROUTE, "regex", regex.clone()).await;
            assert!(allowed, "{message}");
            (!warnings.is_empty()).then_some(warnings)
        },
    )
    .await;
    assert_eq!(
        warnings,
        [
            "HTTPRoute default/regex: parentRef Gateway default/gw: Accepted=False (UnsupportedValue): spec.rules[0].matches[0].path.value: RegularExpression \"/a(\" is not supported: '(' at 2 is not closed"
        ],
        "{}",
        controller.logs()
    );
    // A good route: allowed, nothing to say.
    let good = route_json(
        "good",
        "gw",
        "good.example",
        json!({"type": "PathPrefix", "value": "/"}),
    );
    assert_eq!(
        judge(HTTP_ROUTE, "good", good).await,
        (true, String::new(), Vec::new())
    );
    // A hostname the CRD's pattern refuses: denied, naming the object and the field.
    let bad = route_json(
        "bad",
        "gw",
        "bad host",
        json!({"type": "PathPrefix", "value": "/"}),
    );
    let (allowed, message, _) = judge(HTTP_ROUTE, "bad", bad).await;
    assert!(!allowed);
    for part in [
        "HTTPRoute default/bad",
        "spec.hostnames[0] \"bad host\" is not a hostname",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    // The same route attached to another controller's Gateway: not ours, not rendered.
    let theirs = route_json(
        "bad",
        "other",
        "bad host",
        json!({"type": "PathPrefix", "value": "/"}),
    );
    assert_eq!(
        judge(HTTP_ROUTE, "bad", theirs).await,
        (true, String::new(), Vec::new())
    );

    // A listener hostname that is not one: denied for our Gateway, allowed for theirs.
    let wide = json!([{"name": "http", "protocol": "HTTP", "port": free_port(), "hostname": "not a host"}]);
    let (allowed, message, _) = judge(
        GATEWAY,
        "wide",
        gateway_json("wide", "haptic", wide.clone()),
    )
    .await;
    assert!(!allowed);
    for part in [
        "Gateway default/wide",
        "spec.listeners[0].hostname \"not a host\"",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert_eq!(
        judge(GATEWAY, "wide", gateway_json("wide", "theirs", wide)).await,
        (true, String::new(), Vec::new())
    );
    // A listener on a port HAProxy's pods already serve (the agent's 9090 in the reference
    // config), or on the Ingress HTTP port with HTTPS: denied, naming the port; theirs allowed.
    for (listener, port, said) in [
        (
            json!({"name": "agent", "protocol": "HTTP", "port": 9090}),
            9090,
            "reserved",
        ),
        (
            json!({"name": "tls", "protocol": "HTTPS", "port": 80,
                "tls": {"certificateRefs": [{"name": "missing"}]}}),
            80,
            "the Ingress frontend's plain HTTP port",
        ),
    ] {
        let listeners =
            json!([{"name": "http", "protocol": "HTTP", "port": free_port()}, listener]);
        let (allowed, message, _) = judge(
            GATEWAY,
            "clash",
            gateway_json("clash", "haptic", listeners.clone()),
        )
        .await;
        assert!(!allowed);
        for part in [
            "Gateway default/clash".to_owned(),
            format!("spec.listeners[1].port \"{port}\""),
            said.to_owned(),
        ] {
            assert!(message.contains(&part), "{part:?} not in {message}");
        }
        assert_eq!(
            judge(GATEWAY, "clash", gateway_json("clash", "theirs", listeners)).await,
            (true, String::new(), Vec::new())
        );
    }
    // An HTTPS listener whose Secret does not exist: the API's answer is ResolvedRefs=False.
    let https = json!([{"name": "https", "protocol": "HTTPS", "port": free_port(),
        "tls": {"certificateRefs": [{"name": "missing"}]}}]);
    let (allowed, message, warnings) =
        judge(GATEWAY, "tls", gateway_json("tls", "haptic", https)).await;
    assert!(allowed, "{message}");
    assert!(
        warnings.iter().any(|w| w == "Gateway default/tls: spec.listeners[name=https]: ResolvedRefs=False (InvalidCertificateRef): Secret default/missing does not exist"),
        "{warnings:?}"
    );
}
