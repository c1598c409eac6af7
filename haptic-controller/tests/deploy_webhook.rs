//! `deploy/webhook/` (and its cert-manager component) built with `kubectl kustomize` over
//! `deploy/`: the ValidatingWebhookConfiguration, the Service, the Deployment patch and the
//! certificate agree with each other, with the binary's flags and with the reference config.
//! And `deploy/components/agent-mtls`: the agent channel's certificates from cert-manager,
//! where the controller and the agents read them.

use std::{collections::BTreeSet, path::Path, process::Command};

use serde_json::Value;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// `deploy/` with both webhook components, as an overlay would list them.
fn built() -> Option<Vec<Value>> {
    built_with("[deploy/webhook, deploy/webhook/cert-manager]")
}

/// `deploy/` with `components` (a YAML list).
fn built_with(components: &str) -> Option<Vec<Value>> {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy"),
        &dir.path().join("deploy"),
    );
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        format!("resources: [deploy]\ncomponents: {components}\n"),
    )
    .expect("overlay");
    let output = match Command::new("kubectl")
        .arg("kustomize")
        .arg(dir.path())
        .output()
    {
        Ok(output) => output,
        Err(error) => {
            println!("note: kubectl not runnable ({error}); the components are not checked");
            return None;
        }
    };
    assert!(
        output.status.success(),
        "kubectl kustomize with {components} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&output.stdout)).expect("yaml");
    Some(docs.into_iter().filter(|d| !d.is_null()).collect())
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

#[test]
fn the_webhook_components_match_the_binary_and_the_reference_config() {
    let Some(docs) = built() else { return };
    let deployment = find(&docs, "Deployment", "haptic-controller");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let env = |name: &str| -> String {
        list(&container["env"])
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("no env {name}"))
            .to_owned()
    };
    // Every variable the patch sets is one `haptic-controller run` reads.
    let help = Command::new(env!("CARGO_BIN_EXE_haptic-controller"))
        .args(["run", "--help"])
        .output()
        .expect("run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for e in list(&container["env"]) {
        let name = e["name"].as_str().unwrap_or_default();
        if name.starts_with("HAPTIC_WEBHOOK") {
            assert!(
                help.contains(&format!("[env: {name}")),
                "the binary reads no {name}"
            );
        }
    }
    assert!(
        help.contains("[env: HAPTIC_WEBHOOK_ADDR=] [default: 0.0.0.0:9443]"),
        "{help}"
    );
    let port: u64 = env("HAPTIC_WEBHOOK_ADDR")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let webhook_port = list(&container["ports"])
        .iter()
        .find(|p| p["name"] == "webhook")
        .expect("the webhook port");
    assert_eq!(webhook_port["containerPort"], port);
    // Certificate and key from the mounted Secret.
    let mount = list(&container["volumeMounts"])
        .iter()
        .find(|m| m["name"] == "webhook-tls")
        .expect("mount");
    let dir = mount["mountPath"].as_str().expect("path");
    assert_eq!(env("HAPTIC_WEBHOOK_CERT"), format!("{dir}/tls.crt"));
    assert_eq!(env("HAPTIC_WEBHOOK_KEY"), format!("{dir}/tls.key"));
    let volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["name"] == "webhook-tls")
        .expect("volume");
    let secret = volume["secret"]["secretName"].as_str().expect("secret");

    let service = find(&docs, "Service", "haptic-webhook");
    assert_eq!(
        service["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "webhook");

    let budget_ms: u64 = env("HAPTIC_WEBHOOK_BUDGET_MS").parse().expect("budget");
    let vwc = find(&docs, "ValidatingWebhookConfiguration", "haptic-webhook");
    let webhooks = list(&vwc["webhooks"]);
    assert_eq!(webhooks.len(), 3);
    for hook in webhooks {
        assert_eq!(hook["sideEffects"], "None");
        assert_eq!(hook["admissionReviewVersions"], serde_json::json!(["v1"]));
        let timeout = hook["timeoutSeconds"].as_u64().expect("timeoutSeconds");
        assert!(
            timeout <= 30 && timeout * 1000 > budget_ms,
            "timeout {timeout}s vs budget {budget_ms}ms"
        );
        assert!(matches!(
            hook["failurePolicy"].as_str(),
            Some("Fail" | "Ignore")
        ));
        let svc = &hook["clientConfig"]["service"];
        assert_eq!(svc["name"], service["metadata"]["name"]);
        assert_eq!(svc["namespace"], service["metadata"]["namespace"]);
        assert_eq!(svc["port"], service["spec"]["ports"][0]["port"]);
        assert_eq!(svc["path"], "/validate");
    }
    let ns = deployment["metadata"]["namespace"].as_str().expect("ns");
    let selector = |hook: &Value| -> (String, Vec<String>) {
        let e = &hook["namespaceSelector"]["matchExpressions"][0];
        assert_eq!(e["key"], "kubernetes.io/metadata.name");
        (
            e["operator"].as_str().unwrap_or_default().to_owned(),
            list(&e["values"])
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
        )
    };
    let (op, values) = selector(&webhooks[0]);
    assert!(
        op == "NotIn" && values.contains(&ns.to_owned()),
        "the controller's namespace is left out"
    );
    let (op, values) = selector(&webhooks[1]);
    assert!(
        op == "In" && values == [ns.to_owned()],
        "the HTC lives in the controller's namespace"
    );
    // With no replica running, a fixed HTC can still be applied: every replica's loader
    // validates it anyway, so its rule fails open.
    assert_eq!(webhooks[1]["failurePolicy"], "Ignore", "the HTC's rule");
    assert!(
        list(&webhooks[1]["rules"])
            .iter()
            .all(|r| r["apiGroups"] == serde_json::json!(["haproxy-haptic.org"])),
        "the Ignore rule covers the HTC only"
    );
    // The resource rules are exactly the reference stores with enableValidationWebhook.
    let spec = haptic_controller::reference::spec();
    let wanted: BTreeSet<(String, String, String)> = spec
        .watched_resources
        .values()
        .filter(|w| w.enable_validation_webhook)
        .map(|w| {
            let (group, version) = w
                .api_version
                .rsplit_once('/')
                .unwrap_or(("", &w.api_version));
            (group.to_owned(), version.to_owned(), w.resources.clone())
        })
        .collect();
    assert!(!wanted.is_empty());
    let rules = |hook: &Value| -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for rule in list(&hook["rules"]) {
            let ops: Vec<&str> = list(&rule["operations"])
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert!(ops.contains(&"CREATE") && ops.contains(&"UPDATE"), "{rule}");
            for g in list(&rule["apiGroups"]) {
                for v in list(&rule["apiVersions"]) {
                    for r in list(&rule["resources"]) {
                        out.insert((
                            g.as_str().unwrap_or_default().to_owned(),
                            v.as_str().unwrap_or_default().to_owned(),
                            r.as_str().unwrap_or_default().to_owned(),
                        ));
                    }
                }
            }
        }
        out
    };
    // Ingresses in the first, Gateways and HTTPRoutes in the third (no match condition:
    // CEL cannot read GatewayClasses; the controller allows other classes' at once).
    let resources: BTreeSet<_> = rules(&webhooks[0])
        .into_iter()
        .chain(rules(&webhooks[2]))
        .collect();
    assert_eq!(resources, wanted);
    assert!(
        rules(&webhooks[2])
            .iter()
            .all(|(g, _, _)| g == "gateway.networking.k8s.io")
    );
    assert_eq!(webhooks[2]["failurePolicy"], "Fail", "the Gateway API rule");
    assert_eq!(selector(&webhooks[2]), selector(&webhooks[0]));
    assert!(list(&webhooks[2]["rules"][0]["operations"]).contains(&"DELETE".into()));
    assert!(list(&webhooks[0]["rules"][0]["operations"]).contains(&"DELETE".into()));
    // Other controllers' Ingresses are not sent: the match condition names the IngressClass
    // deploy/ ships, for ingressClassName and for the legacy annotation.
    let class = find(&docs, "IngressClass", "haproxy");
    assert_eq!(
        class["spec"]["controller"],
        haptic_render::derived::DEFAULT_CONTROLLER
    );
    let conditions = list(&webhooks[0]["matchConditions"]);
    assert_eq!(conditions.len(), 1, "{conditions:?}");
    let expression = conditions[0]["expression"].as_str().unwrap_or_default();
    for needle in [
        "ingressClassName in ['haproxy']",
        "['kubernetes.io/ingress.class'] in ['haproxy']",
        "oldObject",
    ] {
        assert!(expression.contains(needle), "{needle} in {expression}");
    }
    assert!(webhooks[1].get("matchConditions").is_none());
    assert_eq!(
        rules(&webhooks[1]),
        BTreeSet::from([(
            "haproxy-haptic.org".to_owned(),
            "v1alpha1".to_owned(),
            "haproxytemplateconfigs".to_owned()
        )])
    );

    // cert-manager: the Secret the pods mount, for the Service's name, CA injected.
    let cert = find(&docs, "Certificate", "haptic-webhook");
    assert_eq!(cert["spec"]["secretName"], secret);
    let dns = format!(
        "{}.{ns}.svc",
        service["metadata"]["name"].as_str().unwrap_or_default()
    );
    assert!(
        list(&cert["spec"]["dnsNames"]).contains(&Value::from(dns.clone())),
        "{dns}"
    );
    assert_eq!(
        vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{ns}/haptic-webhook")
    );
}

#[test]
fn the_agent_mtls_component_puts_the_certificates_where_both_sides_read_them() {
    let Some(docs) = built_with("[deploy/components/agent-mtls]") else {
        return;
    };
    let certificate = |secret: &str| {
        docs.iter()
            .find(|d| d["kind"] == "Certificate" && d["spec"]["secretName"] == secret)
            .unwrap_or_else(|| panic!("no Certificate into {secret}"))
    };
    let agents = certificate("haptic-agent-tls");
    let controller = certificate("haptic-controller-agent-tls");
    assert_eq!(agents["spec"]["usages"], serde_json::json!(["server auth"]));
    assert_eq!(
        controller["spec"]["usages"],
        serde_json::json!(["client auth"])
    );
    assert_eq!(
        agents["spec"]["issuerRef"], controller["spec"]["issuerRef"],
        "one CA"
    );

    // The controller reads its Secret where the patch mounts it, and verifies agents by the
    // name their certificate carries; every variable is one the binary reads.
    let deployment = find(&docs, "Deployment", "haptic-controller");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let env = |name: &str| -> String {
        list(&container["env"])
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("no env {name}"))
            .to_owned()
    };
    let help = Command::new(env!("CARGO_BIN_EXE_haptic-controller"))
        .args(["run", "--help"])
        .output()
        .expect("run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for name in [
        "HAPTIC_AGENT_CA",
        "HAPTIC_AGENT_CLIENT_CERT",
        "HAPTIC_AGENT_CLIENT_KEY",
        "HAPTIC_AGENT_SERVER_NAME",
    ] {
        assert!(
            help.contains(&format!("[env: {name}")),
            "the binary reads no {name}"
        );
    }
    assert_eq!(
        env("HAPTIC_AGENT_SERVER_NAME"),
        agents["spec"]["dnsNames"][0].as_str().expect("dnsName")
    );
    let volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["secret"]["secretName"] == "haptic-controller-agent-tls")
        .expect("the controller's Secret as a volume");
    let mount = list(&container["volumeMounts"])
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("mounted");
    let dir = mount["mountPath"].as_str().expect("path");
    assert_eq!(env("HAPTIC_AGENT_CA"), format!("{dir}/ca.crt"));
    assert_eq!(env("HAPTIC_AGENT_CLIENT_CERT"), format!("{dir}/tls.crt"));
    assert_eq!(env("HAPTIC_AGENT_CLIENT_KEY"), format!("{dir}/tls.key"));

    // The agents mount the other Secret (as in deploy/ without the component).
    let haproxy = find(&docs, "Deployment", "haproxy");
    assert!(
        list(&haproxy["spec"]["template"]["spec"]["volumes"])
            .iter()
            .any(|v| v["secret"]["secretName"] == "haptic-agent-tls"),
        "the agents mount haptic-agent-tls"
    );
}
