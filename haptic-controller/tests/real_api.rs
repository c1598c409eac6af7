//! The controller on both API servers (haptic-testkit's stand-in and a real kube-apiserver
//! with etcd from `cargo xtask envtest`), where the server's behaviour matters: RBAC (the
//! controller runs with a token of the ServiceAccount `deploy/rbac.yaml` binds, never as admin),
//! server-side apply with field ownership, admission webhooks the API server itself calls, CRD
//! schemas. Backends live in network namespaces of the test's own, because a real API server
//! refuses loopback addresses in EndpointSlices (helpers: `common/envtest.rs`).
//!
//! One real server serves the whole binary; the tests that run controllers take turns
//! (`SERIAL`), because a controller watches Ingresses in every namespace.

mod common;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use common::{envtest::*, eventually, free_port, workspace_bin};
use haptic_controller::{HAProxyTemplateConfig, HAProxyTemplateConfigSpec};
use haptic_testkit::{TestApi, on_both_servers};
use k8s_openapi::api::{core::v1::Service, networking::v1::Ingress};
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

on_both_servers! {
    /// The main path under deploy/'s RBAC: an Ingress in another namespace routes through
    /// both pods' HAProxy to a backend in a network namespace; the HTC's status and
    /// conditions; Events in the Ingress's namespace; Ingress status by server-side apply with
    /// field manager `haptic`, and what a second field manager meets; kill -9 failover.
    async fn pipeline_under_deploy_rbac(api: TestApi) {
        let _turn = SERIAL.lock().await;
        let real = api.is_real();
        let env = Env::start(api, "pipe").await;
        let (agent_port, http_port) = (free_port(), free_port());
        env.apply_htc(&lb_spec(&env, agent_port, http_port)).await;
        let agents = [
            Agent::start(&env, 11, agent_port, http_port).await,
            Agent::start(&env, 12, agent_port, http_port).await,
        ];
        let backend = NetnsBackend::start("a", env.dir.path()).await;
        env.service("web-a", &backend).await;
        // The HAProxy Service with a load-balancer address: each Ingress's status gets it.
        let lb: Service = serde_json::from_value(json!({
            "metadata": {"name": "haproxy", "namespace": env.ns},
            "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80}]},
        }))
        .expect("service");
        let services = env.api::<Service>(&env.ns);
        services.create(&PostParams::default(), &lb).await.expect("LB service");
        services
            .patch_status(
                "haproxy",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}})),
            )
            .await
            .expect("LB address");
        let c1 = Controller::start(&env, "controller-1", &[]).await;
        let c2 = Controller::start(&env, "controller-2", &[]).await;

        env.ingress("shop", "shop.example", "web-a").await;
        for agent in &agents {
            agent.await_route("shop.example", (200, "backend a")).await;
        }
        let status = eventually("status Valid and Deployed 2/2", Duration::from_secs(30), || async {
            let status = env.htc_status().await?;
            let deployed = status["conditions"].as_array()?.iter().find(|c| c["type"] == "Deployed")?;
            (status["validationStatus"] == "Valid"
                && deployed["status"] == "True"
                && deployed["message"].as_str()?.starts_with("2/2 pods run"))
            .then_some(status)
        })
        .await;
        assert_eq!(status["observedGeneration"], 1, "{status}");

        // The published config (server-side apply of a custom resource and its status, under
        // the Role): the set on both pods.
        let cfgs = env.api::<haptic_controller::published::HAProxyCfg>(&env.ns);
        eventually("the HAProxyCfg deployed to both pods", Duration::from_secs(20), || async {
            let cfg = cfgs.get(HTC).await.ok()?;
            let pods = &cfg.status.as_ref()?.deployed_to_pods;
            (pods.len() == 2 && pods.iter().all(|p| p.checksum == cfg.spec.set_checksum)).then_some(())
        })
        .await;

        // The backend pool's reserve: the leader writes its ConfigMap in the controller's
        // namespace by server-side apply, under the Role, in the pause after the deployment.
        let reserve = eventually("the backend pool's reserve kept", Duration::from_secs(30), || async {
            let held = env
                .api::<k8s_openapi::api::core::v1::ConfigMap>(&env.ns)
                .get_opt(haptic_controller::pool_keeper::DEFAULT_NAME)
                .await
                .ok()??;
            held.data?.get("size")?.parse::<usize>().ok()
        })
        .await;
        assert!(reserve > 0);

        // Ingress status, by server-side apply with field manager `haptic`.
        let ingresses = env.api::<Ingress>(&env.apps);
        let shop = eventually("the Ingress status from the LB Service", Duration::from_secs(20), || async {
            let ing = ingresses.get("shop").await.ok()?;
            let ip = ing.status.as_ref()?.load_balancer.as_ref()?.ingress.as_ref()?.first()?.ip.clone()?;
            (ip == "192.0.2.10").then_some(ing)
        })
        .await;
        let other_manager = json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
        });
        if real {
            let managers: Vec<(String, String, Option<String>)> = shop
                .metadata
                .managed_fields
                .unwrap_or_default()
                .into_iter()
                .map(|m| (m.manager.unwrap_or_default(), m.operation.unwrap_or_default(), m.subresource))
                .collect();
            assert!(
                managers.contains(&("haptic".into(), "Apply".into(), Some("status".into()))),
                "haptic applies the status: {managers:?}"
            );
            // A second manager that does not force meets haptic's ownership: a conflict.
            match ingresses
                .patch_status("shop", &PatchParams::apply("other-lb"), &Patch::Apply(&other_manager))
                .await
            {
                Err(kube::Error::Api(status)) => {
                    assert_eq!(status.code, 409, "{status:?}");
                    assert!(status.message.contains("haptic"), "{}", status.message);
                }
                other => panic!("expected a field-ownership conflict, got {other:?}"),
            }
        }
        // Forced, the second manager takes the field on either server (the stand-in ignores
        // ownership: its apply is a merge). haptic writes a field once a term, so the field
        // keeps the second manager's value until the next leader's first render.
        let taken = ingresses
            .patch_status("shop", &PatchParams::apply("other-lb").force(), &Patch::Apply(&other_manager))
            .await
            .expect("a forced apply by another manager");
        let ip = taken.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
        assert_eq!(ip.first().and_then(|i| i.ip.as_deref()), Some("203.0.113.7"));

        // A path to a Service that does not exist: a Warning Event in the Ingress's namespace,
        // which deploy/rbac.yaml must allow (a real server answers 403 otherwise).
        env.ingress("orphan", "orphan.example", "no-such-service").await;
        let orphan = env.event(&env.apps, "Ingress", "BackendNotFound").await;
        assert_eq!(orphan.type_.as_deref(), Some("Warning"));
        assert_eq!(orphan.regarding.as_ref().and_then(|r| r.name.as_deref()), Some("orphan"));
        // The election and verdict Events, in the controller's namespace.
        env.event(&env.ns, "Lease", "LeaderElection").await;
        env.event(&env.ns, "HAProxyTemplateConfig", "Valid").await;

        // kill -9 of the leader: the other replica takes over after the Lease expires, and a
        // change made meanwhile goes out; the new leader's first render re-asserts the status
        // the other manager had taken.
        let leader_lease: Api<k8s_openapi::api::coordination::v1::Lease> = env.api(&env.ns);
        let leader = leader_lease.get("haptic-leader").await.expect("Lease")
            .spec.and_then(|s| s.holder_identity).unwrap_or_default();
        let (mut dead, survivor) = if leader == c1.name { (c1, c2) } else { (c2, c1) };
        dead.kill9().await;
        env.api::<Ingress>(&env.apps).delete("orphan", &DeleteParams::default()).await.expect("delete");
        env.ingress("blog", "blog.example", "web-a").await;
        for agent in &agents {
            agent.await_route("blog.example", (200, "backend a")).await;
        }
        let holder = leader_lease.get("haptic-leader").await.expect("Lease")
            .spec.and_then(|s| s.holder_identity).unwrap_or_default();
        assert_eq!(holder, survivor.name);
        eventually("the new leader re-asserts the Ingress status", Duration::from_secs(20), || async {
            let ing = ingresses.get("shop").await.ok()?;
            let ip = ing.status?.load_balancer?.ingress?.first()?.ip.clone()?;
            (ip == "192.0.2.10").then_some(())
        })
        .await;

        // SIGTERM handover: a third replica follows; the leader, terminated, releases the
        // Lease, and the follower leads and deploys the next change.
        let third = Controller::start(&env, "controller-3", &[]).await;
        third.ready().await;
        survivor.terminate();
        env.ingress("news", "news.example", "web-a").await;
        for agent in &agents {
            agent.await_route("news.example", (200, "backend a")).await;
        }
        let holder = leader_lease.get("haptic-leader").await.expect("Lease")
            .spec.and_then(|s| s.holder_identity).unwrap_or_default();
        assert_eq!(holder, third.name);

        // Under deploy/'s RBAC, the API server never refused the controller anything.
        for c in [&dead, &survivor, &third] {
            let logs = c.logs();
            let refused = forbidden(&logs);
            assert!(refused.is_empty(), "{} was refused:\n{}", c.name, refused.join("\n"));
        }
        drop((third, survivor, dead, agents, backend));
    }
}

/// kubectl with `kubeconfig`: (success, stdout + stderr).
fn kubectl(kubeconfig: &Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("kubectl runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Writes `doc` as JSON (which kubectl reads as YAML) and returns its path.
fn manifest(dir: &Path, name: &str, doc: &Value) -> PathBuf {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, doc.to_string()).expect("manifest");
    path
}

/// A ValidatingWebhookConfiguration, deleted (by kubectl, synchronously) when dropped, so a
/// failing test leaves no webhook that refuses the next test's objects.
struct WebhookRegistration {
    name: String,
    kubeconfig: PathBuf,
}

impl Drop for WebhookRegistration {
    fn drop(&mut self) {
        let _ = kubectl(
            &self.kubeconfig,
            &[
                "delete",
                "validatingwebhookconfiguration",
                &self.name,
                "--wait=false",
            ],
        );
    }
}

/// deploy/webhook/validatingwebhook.yaml as shipped, registered by `url` on 127.0.0.1 with
/// the test CA (nothing is ever sent to a Service IP), the controller's namespace in place of
/// haptic-system, and, so the shared server's other namespaces are never judged, the
/// resources webhook further limited to the test's application namespace.
fn shipped_webhook(env: &Env, port: u16, ca_pem: &str) -> Value {
    let text = std::fs::read_to_string(root().join("deploy/webhook/validatingwebhook.yaml"))
        .expect("deploy/webhook/validatingwebhook.yaml");
    let mut doc: Value = serde_saphyr::from_str(&text).expect("webhook yaml parses");
    doc["metadata"]["name"] = json!(format!("haptic-webhook-{}", env.ns));
    for hook in doc["webhooks"].as_array_mut().expect("webhooks") {
        let path = hook["clientConfig"]["service"]["path"]
            .as_str()
            .unwrap_or("/validate")
            .to_owned();
        hook["clientConfig"] = json!({
            "url": format!("https://127.0.0.1:{port}{path}"),
            "caBundle": common::base64(ca_pem),
        });
        let resources = hook["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("resources."));
        let exprs = hook["namespaceSelector"]["matchExpressions"]
            .as_array_mut()
            .expect("selector");
        for expr in exprs.iter_mut() {
            if let Some(values) = expr["values"].as_array_mut() {
                for v in values.iter_mut() {
                    if v == "haptic-system" {
                        *v = json!(env.ns);
                    }
                }
            }
        }
        if resources {
            exprs.push(json!({"key": "kubernetes.io/metadata.name", "operator": "In", "values": [env.apps]}));
        }
    }
    doc
}

/// A CA and a serving certificate for 127.0.0.1 signed by it: (CA, cert, key) PEM.
fn webhook_certificate() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("cert");
    (ca.pem(), cert.pem(), key.serialize_pem())
}

fn htc_manifest(env: &Env, spec: &HAProxyTemplateConfigSpec) -> Value {
    htc_manifest_in(&env.ns, spec)
}

/// The admission webhook as the real API server calls it: registered from
/// deploy/webhook/validatingwebhook.yaml by `url`, a denial reaches `kubectl apply` with the
/// controller's words; then, with no controller serving, the HTC can still be applied (its
/// rule fails open) while an Ingress of ours is refused (fail-closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_api_server_calls_the_webhook_and_the_shipped_failure_policy_holds_without_it() {
    let _turn = SERIAL.lock().await;
    let api = TestApi::start(haptic_testkit::Backend::Real)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let env = Env::start(api, "hook").await;
    let admin = env.api.admin_kubeconfig().expect("kubeconfig");
    let (agent_port, http_port) = (free_port(), free_port());
    let spec = lb_spec(&env, agent_port, http_port);
    env.apply_htc(&spec).await;
    let (ca, cert, key) = webhook_certificate();
    let certs = env.dir.path().join("webhook");
    std::fs::create_dir_all(&certs).expect("mkdir");
    std::fs::write(certs.join("tls.crt"), cert).expect("cert");
    std::fs::write(certs.join("tls.key"), key).expect("key");
    let port = free_port();
    let mut controller = Controller::start(
        &env,
        "hook-1",
        &[
            ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port}")),
            (
                "HAPTIC_WEBHOOK_CERT",
                certs.join("tls.crt").display().to_string(),
            ),
            (
                "HAPTIC_WEBHOOK_KEY",
                certs.join("tls.key").display().to_string(),
            ),
        ],
    )
    .await;
    controller.ready().await;
    let registration = shipped_webhook(&env, port, &ca);
    let (ok, text) = kubectl(
        &admin,
        &[
            "apply",
            "-f",
            manifest(env.dir.path(), "vwc", &registration)
                .to_str()
                .expect("utf-8"),
        ],
    );
    assert!(ok, "{text}");
    let _registered = WebhookRegistration {
        name: registration["metadata"]["name"]
            .as_str()
            .expect("name")
            .to_owned(),
        kubeconfig: admin.clone(),
    };
    let ingress = |name: &str, path: &str| {
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"name": name, "namespace": env.apps},
            "spec": {"ingressClassName": common::CLASS, "rules": [{"host": format!("{name}.example"), "http": {"paths": [{
                "path": path, "pathType": "Prefix",
                "backend": {"service": {"name": "web", "port": {"number": 80}}},
            }]}}]},
        })
    };
    // A good Ingress passes (the API server may need a moment to see the new registration:
    // a good object passes either way, so this also waits for nothing).
    let good = manifest(env.dir.path(), "good", &ingress("good", "/"));
    let (ok, text) = kubectl(&admin, &["apply", "-f", good.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    // A path the API server accepts but the templates refuse (`#` starts a comment in
    // haproxy.cfg): the webhook denies it, and kubectl shows the controller's reason.
    let evil = manifest(env.dir.path(), "evil", &ingress("evil", "/promo#x"));
    let denial = eventually(
        "the webhook denies the Ingress",
        Duration::from_secs(20),
        || async {
            let (ok, text) = kubectl(&admin, &["apply", "-f", evil.to_str().expect("utf-8")]);
            (!ok && text.contains("denied the request")).then_some(text)
        },
    )
    .await;
    for part in [
        "resources.validate.haproxy-haptic.org",
        &format!("Ingress {}/evil", env.apps),
        "spec.rules[].http.paths[].path",
        "refused",
    ] {
        assert!(denial.contains(part), "{part:?} not in {denial}");
    }
    // The running HTC re-applied: allowed while the controller serves.
    let htc = manifest(env.dir.path(), "htc", &htc_manifest(&env, &spec));
    let (ok, text) = kubectl(
        &admin,
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            htc.to_str().expect("utf-8"),
        ],
    );
    assert!(ok, "{text}");

    // No controller serves the webhook any more.
    controller.kill9().await;
    let (ok, refused) = kubectl(
        &admin,
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            htc.to_str().expect("utf-8"),
        ],
    );
    let policy = registration["webhooks"][1]["failurePolicy"]
        .as_str()
        .unwrap_or("Fail");
    eprintln!(
        "no controller, failurePolicy {policy}: applying the HTC -> {}",
        refused.trim()
    );
    // The shipped HTC rule fails open: a cluster with no controller running can still take a
    // fixed HTC (every replica's loader validates it anyway).
    assert_eq!(policy, "Ignore", "deploy/webhook's HTC rule");
    assert!(
        ok,
        "with no controller serving, the HTC is still applied: {refused}"
    );
    let other = manifest(env.dir.path(), "other", &ingress("other", "/"));
    let (ok, text) = kubectl(&admin, &["apply", "-f", other.to_str().expect("utf-8")]);
    let policy = registration["webhooks"][0]["failurePolicy"]
        .as_str()
        .unwrap_or("Fail");
    eprintln!(
        "no controller, failurePolicy {policy}: applying an Ingress -> {}",
        text.trim()
    );
    // Ingresses of ours stay fail-closed: a change that could not be checked is refused.
    assert_eq!(policy, "Fail", "deploy/webhook's Ingress rule");
    assert!(
        !ok && text.contains("failed calling webhook"),
        "with no controller serving, an Ingress of ours is refused: {text}"
    );
    // Objects in the controller's own namespace other than the HTC are never judged, so the
    // controller can be repaired: its Deployment's Secret, for one.
    let (ok, text) = kubectl(
        &admin,
        &[
            "-n",
            &env.ns,
            "create",
            "secret",
            "generic",
            "repair",
            "--from-literal=a=b",
        ],
    );
    assert!(ok, "{text}");
}

/// The Gateway API through the shipped webhook configuration on the real API server, with the
/// standard CRDs of v1.5.1 as users install them (`$HAPTIC_GATEWAY_API_CRDS`, else this
/// project's copy of the release's `standard-install.yaml`): an HTTPRoute of ours whose match
/// we do not support is stored (the API answers it with status), and `kubectl` prints the
/// controller's warning naming the object, its parent and the condition; a Gateway of another
/// controller's class is allowed without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_api_server_sends_gateway_api_objects_to_the_shipped_webhook() {
    let _turn = SERIAL.lock().await;
    let crds = std::env::var("HAPTIC_GATEWAY_API_CRDS")
        .unwrap_or_else(|_| "/work/shared/gateway-api/standard-install-v1.5.1.yaml".to_owned());
    assert!(
        Path::new(&crds).exists(),
        "the Gateway API v1.5.1 standard CRDs: set HAPTIC_GATEWAY_API_CRDS to its standard-install.yaml ({crds} is missing)"
    );
    let api = TestApi::start(haptic_testkit::Backend::Real)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let env = Env::start(api, "gwhook").await;
    let admin = env.api.admin_kubeconfig().expect("kubeconfig");
    let (ok, text) = kubectl(&admin, &["apply", "--server-side", "-f", &crds]);
    assert!(ok, "{text}");
    let (ok, text) = kubectl(
        &admin,
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/gateways.gateway.networking.k8s.io",
            "crd/httproutes.gateway.networking.k8s.io",
            "crd/gatewayclasses.gateway.networking.k8s.io",
        ],
    );
    assert!(ok, "{text}");
    let group = "gateway.networking.k8s.io/v1";
    let classes = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": group, "kind": "GatewayClass", "metadata": {"name": "haptic-gwhook"},
         "spec": {"controllerName": "haproxy-haptic.org/gateway-controller"}},
        {"apiVersion": group, "kind": "GatewayClass", "metadata": {"name": "theirs-gwhook"},
         "spec": {"controllerName": "example.com/other"}},
    ]});
    let path = manifest(env.dir.path(), "classes", &classes);
    let (ok, text) = kubectl(&admin, &["apply", "-f", path.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    let gateway = |name: &str, class: &str| {
        json!({"apiVersion": group, "kind": "Gateway",
            "metadata": {"name": name, "namespace": env.apps},
            "spec": {"gatewayClassName": class, "listeners": [
                {"name": "http", "protocol": "HTTP", "port": free_port()}]}})
    };
    let path = manifest(env.dir.path(), "gw", &gateway("gw", "haptic-gwhook"));
    let (ok, text) = kubectl(&admin, &["apply", "-f", path.to_str().expect("utf-8")]);
    assert!(ok, "{text}");

    let (agent_port, http_port) = (free_port(), free_port());
    env.apply_htc(&lb_spec(&env, agent_port, http_port)).await;
    let (ca, cert, key) = webhook_certificate();
    let certs = env.dir.path().join("webhook");
    std::fs::create_dir_all(&certs).expect("mkdir");
    std::fs::write(certs.join("tls.crt"), cert).expect("cert");
    std::fs::write(certs.join("tls.key"), key).expect("key");
    let port = free_port();
    let controller = Controller::start(
        &env,
        "gwhook-1",
        &[
            ("HAPTIC_WEBHOOK_ADDR", format!("127.0.0.1:{port}")),
            (
                "HAPTIC_WEBHOOK_CERT",
                certs.join("tls.crt").display().to_string(),
            ),
            (
                "HAPTIC_WEBHOOK_KEY",
                certs.join("tls.key").display().to_string(),
            ),
        ],
    )
    .await;
    controller.ready().await;
    let registration = shipped_webhook(&env, port, &ca);
    let path = manifest(env.dir.path(), "vwc", &registration);
    let (ok, text) = kubectl(&admin, &["apply", "-f", path.to_str().expect("utf-8")]);
    assert!(ok, "{text}");
    let _registered = WebhookRegistration {
        name: registration["metadata"]["name"]
            .as_str()
            .expect("name")
            .to_owned(),
        kubeconfig: admin.clone(),
    };
    let route = |name: &str, value: &str| {
        json!({"apiVersion": group, "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": env.apps},
            "spec": {"parentRefs": [{"name": "gw"}], "hostnames": ["gw.example"],
                "rules": [{"matches": [{"path": {"type": "RegularExpression", "value": value}}],
                           "backendRefs": [{"name": "web", "port": 80}]}]}})
    };
    // Until the registration and the controller's Gateway API stores are in place, the route
    // goes through without a warning: each try is another route.
    let mut tries = 0;
    let warned = eventually(
        "kubectl prints the webhook's warning",
        Duration::from_secs(60),
        || {
            tries += 1;
            let name = format!("regex-{tries}");
            let path = manifest(env.dir.path(), &name, &route(&name, "/a("));
            let admin = admin.clone();
            async move {
                let (ok, text) = kubectl(&admin, &["apply", "-f", path.to_str().expect("utf-8")]);
                assert!(ok, "an unsupported match is stored, not refused: {text}");
                text.contains("Warning:").then_some((name, text))
            }
        },
    )
    .await;
    let (name, text) = warned;
    let want = format!(
        "HTTPRoute {apps}/{name}: parentRef Gateway {apps}/gw: Accepted=False (UnsupportedValue): spec.rules[0].matches[0].path.value: RegularExpression \"/a(\" is not supported: '(' at 2 is not closed",
        apps = env.apps
    );
    assert!(text.contains(&want), "{want:?} not in {text}");
    // Another controller's Gateway: allowed, nothing said.
    let path = manifest(
        env.dir.path(),
        "theirs",
        &gateway("theirs", "theirs-gwhook"),
    );
    let (ok, text) = kubectl(&admin, &["apply", "-f", path.to_str().expect("utf-8")]);
    assert!(ok && !text.contains("Warning"), "{text}");
    // Under deploy/'s RBAC: the controller was refused nothing (the Gateway API kinds included).
    assert!(
        forbidden(&controller.logs()).is_empty(),
        "{}",
        controller.logs()
    );
}

/// The CRDs `haptic-controller crd` prints, as the real API server takes them: structural
/// schemas accepted and Established, `kubectl explain` reading them, and a value of the wrong
/// type refused by the server's own schema validation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crds_are_accepted_explained_and_enforced_by_the_real_server() {
    let api = TestApi::start(haptic_testkit::Backend::Real)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = api.admin_client().await.expect("admin");
    let kubeconfig = api.admin_kubeconfig().expect("kubeconfig");
    // Exactly what the CLI prints, applied with kubectl.
    let out = std::process::Command::new(workspace_bin("haptic-controller"))
        .arg("crd")
        .output()
        .expect("haptic-controller crd");
    assert!(out.status.success());
    let dir = tempfile::tempdir().expect("tempdir");
    let crds = dir.path().join("crds.yaml");
    std::fs::write(&crds, &out.stdout).expect("write");
    let (ok, text) = kubectl(
        &kubeconfig,
        &[
            "apply",
            "--server-side",
            "-f",
            crds.to_str().expect("utf-8"),
        ],
    );
    assert!(ok, "{text}");
    install_crds(&admin).await;
    let (ok, text) = eventually("kubectl explain", Duration::from_secs(20), || async {
        let (ok, text) = kubectl(
            &kubeconfig,
            &[
                "explain",
                "haproxytemplateconfigs.spec.podSelector",
                "--api-version=haproxy-haptic.org/v1alpha1",
            ],
        );
        ok.then_some((ok, text))
    })
    .await;
    assert!(
        ok && text.contains("matchLabels") && text.contains("HAProxyTemplateConfig"),
        "{text}"
    );
    let (ok, text) = kubectl(
        &kubeconfig,
        &[
            "explain",
            "haproxycfgs",
            "--api-version=haproxy-haptic.org/v1alpha1",
        ],
    );
    assert!(ok, "{text}");

    let ns = api.namespace("crd").await.expect("ns");
    let htcs: Api<kube::api::DynamicObject> = Api::namespaced_with(
        admin,
        &ns,
        &kube::api::ApiResource::erase::<HAProxyTemplateConfig>(&()),
    );
    let mut bad = htc_manifest_in(&ns, &common::spec(free_port(), free_port()));
    bad["spec"]["agent"]["port"] = json!("not-a-port");
    let bad: kube::api::DynamicObject = serde_json::from_value(bad).expect("object");
    match htcs.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(
                status.message.contains("spec.agent.port"),
                "{}",
                status.message
            );
        }
        other => panic!("a string port must be refused by the CRD schema, got {other:?}"),
    }
}

fn htc_manifest_in(ns: &str, spec: &HAProxyTemplateConfigSpec) -> Value {
    json!({
        "apiVersion": "haproxy-haptic.org/v1alpha1",
        "kind": "HAProxyTemplateConfig",
        "metadata": {"name": HTC, "namespace": ns},
        "spec": spec,
    })
}
