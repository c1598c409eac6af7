//! `haptic-controller migrate`, run as the built binary on a fixture of real-world-looking
//! ingress-nginx Ingresses: each nginx annotation with its verdict and what changes, exit 1
//! when something would behave differently, 0 when nothing does, 2 for an unreadable file;
//! `--output json`; `--from-cluster` through a kubeconfig (the testkit API server).

mod common;

use std::{path::Path, process::Command};

use common::*;
use serde_json::{Value, json};

fn migrate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_haptic-controller"))
        .arg("migrate")
        .args(args)
        .output()
        .expect("run haptic-controller migrate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/nginx-ingresses.yaml")
        .display()
        .to_string()
}

#[test]
fn the_report_names_each_annotation_and_exits_1() {
    let file = fixture();
    let (code, out, err) = migrate(&["-f", &file]);
    assert_eq!(code, 1, "{out}{err}");
    let want = format!(
        "Ingress shop/storefront ({file}):
  differs nginx.ingress.kubernetes.io/proxy-body-size: a request whose Content-Length is over the size (`8m`, `512k`, `1g` or bytes; `0`: no limit) gets 413; a chunked body without Content-Length is not limited, and without the annotation no limit applies (nginx's default was 1m)
  differs nginx.ingress.kubernetes.io/rewrite-target: as NGINX's `rewrite <path> <target> break`: when the path matches, the whole path is replaced by the target, `$1`...`$9` being the path's capture groups, the query string kept; the Ingress's non-Exact paths are matched as case-insensitive regular expressions (PCRE2) from the path's start, as NGINX's `~*` locations, after the host's Exact paths and before its Prefix paths; ingress-nginx made every path of the host a regex, HAPTIC only this Ingress's; a path with a backslash is refused, one HAProxy cannot compile fails the webhook's config check
  differs nginx.ingress.kubernetes.io/use-regex: `true`: the Ingress's non-Exact paths are matched as case-insensitive regular expressions (PCRE2) from the path's start, as NGINX's `~*` locations, after the host's Exact paths and before its Prefix paths; ingress-nginx made every path of the host a regex, HAPTIC only this Ingress's; a path with a backslash is refused, one HAProxy cannot compile fails the webhook's config check
  supported nginx.ingress.kubernetes.io/whitelist-source-range: the older name of allowlist-source-range (which wins when both are set): clients whose address is outside the comma-separated CIDRs (IPv4 or IPv6; a bare address is one host) get 403; on a stored Ingress, a list that does not parse denies every client (403)
Ingress monitoring/grafana ({file}):
  supported nginx.ingress.kubernetes.io/auth-realm: the realm of the 401 challenge (default `Authentication Required`)
  differs nginx.ingress.kubernetes.io/auth-secret: a Secret of the Ingress's own namespace (`name`, or `<own namespace>/name`; another namespace is refused) whose key `auth` holds htpasswd lines; bcrypt (`htpasswd -B`), SHA-256/512-crypt and MD5-crypt hashes are accepted, apr1 (htpasswd's default) and {{SHA}} are not (HAProxy checks passwords with crypt(3)): the webhook denies them; a stored Ingress keeps the users it can check, and with none (or no such Secret) every request gets 401; the Secret must carry the label `haproxy-haptic.org/auth-secret: \"true\"`: the controller watches only Secrets so labelled, never an application's other Secrets
  supported nginx.ingress.kubernetes.io/auth-type: `basic` (with `auth-secret`): a request without valid credentials gets 401; `digest` is refused
  refused nginx.ingress.kubernetes.io/configuration-snippet: raw NGINX config is never rendered (CVE-2025-1974: config injected from an Ingress ran in the controller); express the need with Ingress fields, or ask the platform team to add it to the HAProxyTemplateConfig
  => denied by the admission webhook: remove the snippet annotations first
Ingress web/docs ({file}): no ingress-nginx annotations: carried over as it is
3 Ingresses: 2 would behave differently (1 refused), 1 carried over as they are
"
    );
    assert_eq!(out, want);
}

#[test]
fn json_output_and_exit_codes() {
    let file = fixture();
    let (code, out, err) = migrate(&["-f", &file, "--output", "json"]);
    assert_eq!(code, 1, "{out}{err}");
    let report: Value = serde_json::from_str(&out).expect("JSON report");
    assert_eq!(report["behaves_differently"], true);
    let ingresses = report["ingresses"].as_array().expect("ingresses");
    let names: Vec<&Value> = ingresses.iter().map(|i| &i["name"]).collect();
    assert_eq!(
        names,
        [&json!("storefront"), &json!("grafana"), &json!("docs")]
    );
    let grafana = &ingresses[1];
    assert_eq!(grafana["refused"], true);
    assert_eq!(grafana["changes"], true);
    assert_eq!(
        grafana["annotations"][3],
        json!({
            "annotation": "nginx.ingress.kubernetes.io/configuration-snippet",
            "verdict": "refused",
            "note": "raw NGINX config is never rendered (CVE-2025-1974: config injected from an Ingress ran in the controller); express the need with Ingress fields, or ask the platform team to add it to the HAProxyTemplateConfig",
        })
    );
    assert_eq!(ingresses[2]["annotations"], json!([]));
    assert_eq!(ingresses[2]["changes"], false);

    // Nothing that changes: exit 0.
    let dir = tempfile::tempdir().expect("tempdir");
    let plain = dir.path().join("plain.yaml");
    std::fs::write(
        &plain,
        "kind: List\nitems:\n- apiVersion: networking.k8s.io/v1\n  kind: Ingress\n  metadata: {name: a, namespace: b, annotations: {cert-manager.io/cluster-issuer: x}}\n",
    )
    .expect("write");
    let (code, out, err) = migrate(&["-f", &plain.display().to_string()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.ends_with(
            "1 Ingresses: 0 would behave differently (0 refused), 1 carried over as they are\n"
        ),
        "{out}"
    );
    // Only supported annotations: carried over, exit 0. A value that does not parse: exit 1,
    // the webhook would deny it.
    let supported = dir.path().join("supported.yaml");
    let doc = |name: &str, range: &str| {
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: Ingress\nmetadata:\n  name: {name}\n  namespace: b\n  annotations:\n    nginx.ingress.kubernetes.io/allowlist-source-range: \"{range}\"\n    nginx.ingress.kubernetes.io/force-ssl-redirect: \"true\"\n"
        )
    };
    std::fs::write(&supported, doc("ok", "10.0.0.0/8, 192.168.1.1")).expect("write");
    let (code, out, err) = migrate(&["-f", &supported.display().to_string()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("  supported nginx.ingress.kubernetes.io/force-ssl-redirect: `true`: plain HTTP requests that route to this Ingress are redirected to HTTPS (308)"),
        "{out}"
    );
    std::fs::write(&supported, doc("bad", "10.0.0.0/33")).expect("write");
    let (code, out, err) = migrate(&["-f", &supported.display().to_string()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("  invalid nginx.ingress.kubernetes.io/allowlist-source-range: \"10.0.0.0/33\" has a prefix length that is not 0-32: every client is denied (403)\n  => denied by the admission webhook: fix the invalid values first\n"),
        "{out}"
    );
    // A file that cannot be read: exit 2, naming it.
    let missing = dir.path().join("missing.yaml").display().to_string();
    let (code, _, err) = migrate(&["-f", &missing]);
    assert_eq!(code, 2);
    assert!(err.contains(&format!("reading {missing}")), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_the_cluster_through_a_kubeconfig() {
    let cluster = Cluster::start().await;
    cluster
        .ingress("plain", "plain.example.com", "/", "web")
        .await;
    let mut legacy =
        serde_json::to_value(ingress("legacy", "legacy.example.com", "/", "web")).expect("json");
    legacy["metadata"]["annotations"] =
        json!({"nginx.ingress.kubernetes.io/ssl-redirect": "false"});
    cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .create(
            &Default::default(),
            &serde_json::from_value(legacy).expect("ingress"),
        )
        .await
        .expect("ingress created");
    let kubeconfig = cluster
        .server
        .kubeconfig_for("migrate")
        .expect("kubeconfig")
        .display()
        .to_string();
    let args: Vec<String> = [
        "--from-cluster",
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        NS,
    ]
    .map(str::to_owned)
    .to_vec();
    // The API server answers on this runtime: the process is waited for off it.
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        migrate(&args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .expect("migrate");
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        out,
        format!(
            "Ingress {NS}/legacy (cluster):
  differs nginx.ingress.kubernetes.io/ssl-redirect: `false` turns off the redirect to HTTPS for the hosts of this Ingress's TLS section, as `haproxy-haptic.org/ssl-redirect: \"false\"` does: per host, not per path (another Ingress's TLS section for the host redirects it); `true` is the default
Ingress {NS}/plain (cluster): no ingress-nginx annotations: carried over as it is
2 Ingresses: 1 would behave differently (0 refused), 1 carried over as they are
"
        )
    );
    // A cluster that cannot be reached: exit 2.
    let (code, _, err) = migrate(&["--from-cluster", "--kubeconfig", "/nonexistent"]);
    assert_eq!(code, 2);
    assert!(err.contains("reading kubeconfig /nonexistent"), "{err}");
}
