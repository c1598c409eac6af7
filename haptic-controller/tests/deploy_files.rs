//! `deploy/` and `docker/` against the project: the generated files are what the types
//! generate, the RBAC covers exactly what the shipped config watches, and every binary, flag,
//! port, path, user and image the manifests and Dockerfiles name exists and agrees across
//! files. The images cannot be built here; what can be checked without Docker is.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn read(path: &str) -> String {
    let full = root().join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

/// Every YAML document of `text`.
fn docs_of(text: &str, what: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .unwrap_or_else(|e| panic!("parsing {what}: {e}"))
        .into_iter()
        .filter(|doc| !doc.is_null())
        .collect()
}

fn docs(path: &str) -> Vec<Value> {
    docs_of(&read(path), path)
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn s(value: &Value) -> &str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value}"))
}

fn list(value: &Value) -> &[Value] {
    value
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_else(|| panic!("not a list: {value}"))
}

fn strings(value: &Value) -> Vec<String> {
    list(value).iter().map(|v| s(v).to_owned()).collect()
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    list(&pod["containers"])
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} missing from {args:?}"));
    args.get(i + 1)
        .unwrap_or_else(|| panic!("{flag} has no value"))
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {addr}"))
}

/// The shipped config (the generated reference).
fn htc() -> Value {
    docs("deploy/haptic-config.yaml").remove(0)
}

/// The config after the deployment's patch, from `kubectl kustomize deploy/` when kubectl is
/// on PATH; None (with a note) otherwise.
fn built() -> Option<Vec<Value>> {
    let output = match Command::new("kubectl")
        .args(["kustomize", "deploy/"])
        .current_dir(root())
        .output()
    {
        Ok(output) => output,
        Err(error) => {
            println!("note: kubectl not runnable ({error}); the kustomize build is not checked");
            return None;
        }
    };
    assert!(
        output.status.success(),
        "kubectl kustomize deploy/ failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(docs_of(
        &String::from_utf8_lossy(&output.stdout),
        "kubectl kustomize deploy/",
    ))
}

/// JSON6902 operations of the HTC patch: path -> value.
fn htc_patch() -> BTreeMap<String, Value> {
    let ops: Vec<Value> = serde_saphyr::from_str(&read("deploy/haptic-config-ports.yaml"))
        .expect("parsing deploy/haptic-config-ports.yaml");
    ops.into_iter()
        .map(|op| {
            assert_eq!(op["op"], "replace", "only replace operations: {op}");
            (s(&op["path"]).to_owned(), op["value"].clone())
        })
        .collect()
}

/// The HTC as deployed: the reference with the patch applied.
fn deployed_htc() -> Value {
    let mut htc = htc();
    for (path, value) in htc_patch() {
        let slot = htc
            .pointer_mut(&path)
            .unwrap_or_else(|| panic!("the patch path {path} is not in the reference config"));
        *slot = value;
    }
    htc
}

#[test]
fn the_committed_crd_is_what_the_types_generate() {
    let generated = haptic_controller::crd::crd_yaml().expect("crd yaml");
    assert!(
        read("deploy/crd.yaml") == generated,
        "deploy/crd.yaml is stale: run `cargo run -p haptic-controller -- crd > deploy/crd.yaml`"
    );
}

#[test]
fn the_sample_config_is_the_reference_config() {
    let generated =
        haptic_controller::reference::yaml("haptic-config", "haptic-system").expect("yaml");
    assert!(
        read("deploy/haptic-config.yaml") == generated,
        "deploy/haptic-config.yaml is stale: run `cargo run -p haptic-controller -- reference-config --namespace haptic-system > deploy/haptic-config.yaml`"
    );
}

/// (apiGroup, resource) -> verbs, of every rule of a Role or ClusterRole.
fn rules(role: &Value) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut out: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for rule in list(&role["rules"]) {
        assert!(
            rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
            "unexpected rule shape {rule}"
        );
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                assert!(group != "*" && resource != "*", "wildcard in {rule}");
                let verbs = strings(&rule["verbs"]);
                assert!(!verbs.iter().any(|v| v == "*"), "wildcard verb in {rule}");
                out.entry((group.clone(), resource))
                    .or_default()
                    .extend(verbs);
            }
        }
    }
    out
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn the_cluster_role_covers_exactly_the_watched_resources() {
    let rbac = docs("deploy/rbac.yaml");
    let htc = htc();
    let watched: BTreeMap<(String, String), BTreeSet<String>> = htc["spec"]["watchedResources"]
        .as_object()
        .expect("watchedResources")
        .values()
        // A store watched in one namespace (the HAProxy pods, the pool reserve) is the Role's.
        .filter(|w| w["namespace"].is_null())
        .map(|w| {
            let api_version = s(&w["apiVersion"]);
            let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
            (
                (group.to_owned(), s(&w["resources"]).to_owned()),
                set(&["get", "list", "watch"]),
            )
        })
        .collect();
    let mut expected = watched;
    // The one write: the status the reference templates declare for Ingresses.
    expected.insert(
        (
            "networking.k8s.io".to_owned(),
            "ingresses/status".to_owned(),
        ),
        set(&["patch"]),
    );
    // And the Gateway API status the gateway library declares.
    for resource in ["gatewayclasses", "gateways", "httproutes"] {
        expected.insert(
            (
                "gateway.networking.k8s.io".to_owned(),
                format!("{resource}/status"),
            ),
            set(&["patch"]),
        );
    }
    // Events about Ingresses (conflicts, missing backends): an Event lives in the namespace of
    // the object it regards, so creating one needs the right there, in every namespace.
    for group in ["", "events.k8s.io"] {
        expected.insert(
            (group.to_owned(), "events".to_owned()),
            set(&["create", "patch"]),
        );
    }
    let cluster_role = find(&rbac, "ClusterRole", "haptic-controller");
    assert_eq!(
        rules(cluster_role),
        expected,
        "the ClusterRole must grant get/list/watch on exactly the watched resources, patch of Ingress status, and Events"
    );

    let namespace = s(&htc["metadata"]["namespace"]);
    let role = find(&rbac, "Role", "haptic-controller");
    assert_eq!(role["metadata"]["namespace"], namespace);
    let expected: BTreeMap<(String, String), BTreeSet<String>> = [
        (
            ("coordination.k8s.io", "leases"),
            &["get", "list", "watch", "create", "update"][..],
        ),
        (("", "events"), &["create", "patch"]),
        (("events.k8s.io", "events"), &["create", "patch"]),
        (
            ("haproxy-haptic.org", "haproxytemplateconfigs"),
            &["get", "list", "watch"],
        ),
        (
            ("haproxy-haptic.org", "haproxytemplateconfigs/status"),
            &["update", "patch"],
        ),
        // pod discovery, and the reference store of the HAProxy pods (watched here only)
        (("", "pods"), &["get", "list", "watch"]),
        // the agent token (read), the default certificate and the agent channel's CA (created
        // once when absent)
        (("", "secrets"), &["get", "list", "watch", "create"]),
        // the backend pool's reserve: the reference store `backend_pool` (watched here only)
        // and the leader's server-side apply of it (`pool_keeper`)
        (
            ("", "configmaps"),
            &["get", "list", "watch", "create", "patch"],
        ),
        (
            ("haproxy-haptic.org", "haproxycfgs"),
            &["get", "list", "create", "patch", "delete"],
        ),
        (
            ("haproxy-haptic.org", "haproxymapfiles"),
            &["get", "list", "create", "patch", "delete"],
        ),
        (
            ("haproxy-haptic.org", "haproxycrtlistfiles"),
            &["get", "list", "create", "patch", "delete"],
        ),
        (
            ("haproxy-haptic.org", "haproxygeneralfiles"),
            &["get", "list", "create", "patch", "delete"],
        ),
        (("haproxy-haptic.org", "haproxycfgs/status"), &["patch"]),
        (("haproxy-haptic.org", "haproxymapfiles/status"), &["patch"]),
        (
            ("haproxy-haptic.org", "haproxycrtlistfiles/status"),
            &["patch"],
        ),
        (
            ("haproxy-haptic.org", "haproxygeneralfiles/status"),
            &["patch"],
        ),
    ]
    .into_iter()
    .map(|((g, r), verbs)| ((g.to_owned(), r.to_owned()), set(verbs)))
    .collect();
    assert_eq!(rules(role), expected, "the Role's rules");

    // Both bound to the controller's ServiceAccount, the one its Deployment runs as.
    let sa = find(&rbac, "ServiceAccount", "haptic-controller");
    assert_eq!(sa["metadata"]["namespace"], namespace);
    for (kind, role_kind) in [
        ("ClusterRoleBinding", "ClusterRole"),
        ("RoleBinding", "Role"),
    ] {
        let binding = find(&rbac, kind, "haptic-controller");
        assert_eq!(binding["roleRef"]["kind"], role_kind);
        assert_eq!(binding["roleRef"]["name"], "haptic-controller");
        let subjects = list(&binding["subjects"]);
        assert_eq!(subjects.len(), 1, "{kind} binds one subject");
        assert_eq!(subjects[0]["kind"], "ServiceAccount");
        assert_eq!(subjects[0]["name"], "haptic-controller");
        assert_eq!(subjects[0]["namespace"], namespace);
    }
    let controller = docs("deploy/controller.yaml");
    let deployment = find(&controller, "Deployment", "haptic-controller");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["serviceAccountName"],
        "haptic-controller"
    );
}

fn assert_restricted(container: &Value) {
    let sc = &container["securityContext"];
    let name = &container["name"];
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
    assert!(
        container["resources"]["requests"].is_object()
            && container["resources"]["limits"]["memory"].is_string(),
        "{name} has requests and a memory limit"
    );
}

fn assert_restricted_pod(pod: &Value, uid: u64) {
    let sc = &pod["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["runAsUser"], uid);
    assert_eq!(sc["runAsGroup"], uid);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    for c in list(&pod["containers"])
        .iter()
        .chain(pod["initContainers"].as_array().into_iter().flatten())
    {
        assert_restricted(c);
    }
}

/// The `USER uid:gid` of a Dockerfile's final stage.
fn dockerfile_user(dockerfile: &str) -> u64 {
    let text = read(dockerfile);
    let user = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .unwrap_or_else(|| panic!("{dockerfile} sets no USER"));
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    assert_eq!(uid, gid, "{dockerfile}: one id for user and group");
    uid.parse().expect("a numeric USER")
}

#[test]
fn the_controller_deployment_matches_the_binary() {
    let manifests = docs("deploy/controller.yaml");
    let htc = htc();
    let deployment = find(&manifests, "Deployment", "haptic-controller");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!(
        deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        labels["app.kubernetes.io/name"]
    );
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    assert!(
        grace > haptic_controller::daemon::SHUTDOWN_BOUND.as_secs(),
        "terminationGracePeriodSeconds {grace} must exceed the shutdown bound"
    );
    assert_restricted_pod(pod, dockerfile_user("docker/controller.Dockerfile"));
    let anti = &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        [0]["podAffinityTerm"];
    assert_eq!(anti["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(
        anti["labelSelector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );

    let c = container(pod, "haptic-controller");
    assert_eq!(strings(&c["args"]), ["run"]);
    let env: BTreeMap<&str, &Value> = list(&c["env"]).iter().map(|e| (s(&e["name"]), e)).collect();
    assert_eq!(
        env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert_eq!(env["CONFIG_NAME"]["value"], htc["metadata"]["name"]);
    // Every variable the manifest sets is one the binary reads (RUST_LOG: the log filter;
    // MIMALLOC_PURGE_DELAY: its allocator's, read when the process starts).
    let help = Command::new(env!("CARGO_BIN_EXE_haptic-controller"))
        .args(["run", "--help"])
        .env_remove("KUBECONFIG")
        .output()
        .expect("haptic-controller run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for name in env
        .keys()
        .filter(|n| !["RUST_LOG", "MIMALLOC_PURGE_DELAY"].contains(*n))
    {
        assert!(
            help.contains(&format!("[env: {name}")),
            "haptic-controller reads no {name}"
        );
    }
    let health_addr = s(&env["HEALTH_ADDR"]["value"]);
    assert!(
        help.contains(&format!("[env: HEALTH_ADDR=] [default: {health_addr}]")),
        "HEALTH_ADDR {health_addr} is the binary's default"
    );
    let port = port_of(health_addr);
    let ports = list(&c["ports"]);
    assert_eq!(ports[0]["containerPort"], port);
    let port_name = &ports[0]["name"];
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(&c["livenessProbe"]["httpGet"]["port"], port_name);
    assert_eq!(&c["readinessProbe"]["httpGet"]["port"], port_name);
    assert_eq!(c["resources"]["requests"]["memory"], "64Mi");
    assert_eq!(c["resources"]["requests"]["cpu"], "50m");
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    // The render gate's scratch copies under a read-only root.
    let tmp = list(&c["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"] == "/tmp")
        .expect("/tmp mounted");
    let volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["name"] == tmp["name"])
        .expect("the /tmp volume");
    assert!(volume["emptyDir"].is_object());

    let pdb = find(&manifests, "PodDisruptionBudget", "haptic-controller");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"]);
    let service = find(&manifests, "Service", "haptic-controller");
    assert_eq!(
        service["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(service["spec"]["ports"][0]["targetPort"], *port_name);
}

/// The long flags of `haptic-agent` (`--token-file` for the field `token_file`) and their
/// defaults, read from its source.
fn agent_flags() -> BTreeMap<String, Option<String>> {
    let source = read("haptic-agent/src/main.rs");
    let mut flags = BTreeMap::new();
    let mut pending: Option<Option<String>> = None;
    for line in source.lines().map(str::trim) {
        if line.starts_with("#[arg(long") {
            let default = line
                .split_once("default_value = \"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(value, _)| value.to_owned());
            pending = Some(default);
        } else if let Some(default) = pending.take()
            && let Some((field, _)) = line.split_once(':')
        {
            flags.insert(format!("--{}", field.trim().replace('_', "-")), default);
        }
    }
    assert!(
        flags.contains_key("--token-file"),
        "parsed no flags: {flags:?}"
    );
    flags
}

#[test]
fn the_haproxy_pods_match_the_agent_and_the_config() {
    let manifests = docs("deploy/haproxy.yaml");
    let htc = deployed_htc();
    let spec = &htc["spec"];
    let deployment = find(&manifests, "Deployment", "haproxy");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_restricted_pod(pod, dockerfile_user("docker/agent.Dockerfile"));
    assert_eq!(
        pod["securityContext"]["fsGroup"],
        pod["securityContext"]["runAsGroup"]
    );

    // The controller finds these pods by the HTC's podSelector.
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (key, value) in spec["podSelector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(&labels[key], value, "pod label {key}");
    }

    // The agent: the container the controller waits for, on the port it pushes to.
    let agent = container(pod, s(&spec["agent"]["containerName"]));
    let args = strings(&agent["args"]);
    let flags = agent_flags();
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        assert!(flags.contains_key(arg), "haptic-agent has no flag {arg}");
    }
    let agent_port = spec["agent"]["port"].as_u64().expect("agent.port");
    let listen = flag(&args, "--listen");
    assert_eq!(port_of(listen), agent_port);
    assert_eq!(
        flags["--listen"].as_deref(),
        Some(listen),
        "--listen as the default"
    );
    let agent_ports = list(&agent["ports"]);
    assert_eq!(agent_ports[0]["containerPort"], agent_port);
    // The probes: on the plain probe port (--probe-listen), the API being mutual TLS.
    let probe_port = port_of(flag(&args, "--probe-listen"));
    let probes = agent_ports
        .iter()
        .find(|p| p["containerPort"] == probe_port)
        .expect("the probe port declared");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(agent[probe]["httpGet"]["port"], probes["name"]);
    }
    // Mutual TLS: every file from the agent's TLS Secret, mounted where the flags point.
    let tls_volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["secret"]["secretName"] == "haptic-agent-tls")
        .expect("a volume of the agent TLS Secret");
    let tls_mount = list(&agent["volumeMounts"])
        .iter()
        .find(|m| m["name"] == tls_volume["name"])
        .expect("the TLS volume mounted in the agent");
    for (flag_name, key) in [
        ("--tls-cert", "tls.crt"),
        ("--tls-key", "tls.key"),
        ("--client-ca", "ca.crt"),
    ] {
        let item = list(&tls_volume["secret"]["items"])
            .iter()
            .find(|i| i["key"] == key)
            .unwrap_or_else(|| panic!("{key} in the TLS volume"));
        assert_eq!(
            flag(&args, flag_name),
            format!("{}/{}", s(&tls_mount["mountPath"]), s(&item["path"]))
        );
    }
    assert_eq!(agent["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/readyz");

    // The token: the Secret the controller reads, mounted where --token-file points.
    let token_file = flag(&args, "--token-file");
    let secret_ref = &spec["agent"]["tokenSecretRef"];
    let token_volume = list(&pod["volumes"])
        .iter()
        .find(|v| v["secret"]["secretName"] == secret_ref["name"])
        .expect("a volume of the agent token Secret");
    let item = &token_volume["secret"]["items"][0];
    assert_eq!(item["key"], secret_ref["key"]);
    let mount = list(&agent["volumeMounts"])
        .iter()
        .find(|m| m["name"] == token_volume["name"])
        .expect("the token volume mounted in the agent");
    assert_eq!(
        token_file,
        format!("{}/{}", s(&mount["mountPath"]), s(&item["path"]))
    );

    // HAProxy: started as the agent's supervisor would, on the agent's data directory and
    // master socket, with the haproxy binary the agent runs.
    let data_dir = flag(&args, "--data-dir");
    let socket = flag(&args, "--master-socket");
    assert_eq!(
        socket,
        format!("{data_dir}/master.sock"),
        "the agent's default socket"
    );
    let haproxy = container(pod, "haproxy");
    let command = strings(&haproxy["command"]);
    assert_eq!(command[0], flag(&args, "--haproxy"));
    assert_eq!(
        command[1..],
        [
            "-W".to_owned(),
            "-S".to_owned(),
            socket.to_owned(),
            "-C".to_owned(),
            format!("{data_dir}/current"),
            "-f".to_owned(),
            format!("{data_dir}/current/haproxy.cfg"),
        ]
    );
    assert_eq!(
        haproxy["image"], agent["image"],
        "one HAProxy version in the pod"
    );
    let data_volume = |c: &Value| {
        list(&c["volumeMounts"])
            .iter()
            .find(|m| m["mountPath"] == data_dir)
            .map(|m| s(&m["name"]).to_owned())
            .unwrap_or_else(|| panic!("{} does not mount {data_dir}", c["name"]))
    };
    assert_eq!(
        data_volume(haproxy),
        data_volume(agent),
        "one data directory"
    );
    let bootstrap = list(&pod["initContainers"])
        .iter()
        .find(|c| c["name"] == "bootstrap")
        .expect("the bootstrap init container");
    assert_eq!(data_volume(bootstrap), data_volume(agent));
    assert_eq!(bootstrap["image"], agent["image"]);

    // HAProxy's ports: the deployed config's, the bootstrap config's, the Service's targets.
    let http_port = spec["templatingSettings"]["extraContext"]["haproxy"]["http_port"].clone();
    let https_port = spec["templatingSettings"]["extraContext"]["haproxy"]["https_port"].clone();
    let haproxy_ports: BTreeMap<&str, &Value> = list(&haproxy["ports"])
        .iter()
        .map(|p| (s(&p["name"]), &p["containerPort"]))
        .collect();
    assert_eq!(haproxy_ports["http"], &http_port);
    assert_eq!(haproxy_ports["https"], &https_port);
    assert!(
        http_port.as_u64().is_some_and(|p| p >= 1024),
        "non-root HAProxy binds no port below 1024"
    );
    let bootstrap_cfg = find(&manifests, "ConfigMap", "haproxy-bootstrap");
    assert!(
        s(&bootstrap_cfg["data"]["haproxy.cfg"]).contains(&format!("bind :{http_port}\n")),
        "the bootstrap config binds the http port"
    );
    let service = find(&manifests, "Service", "haproxy");
    let service_ports: BTreeMap<&str, (&Value, &Value)> = list(&service["spec"]["ports"])
        .iter()
        .map(|p| (s(&p["name"]), (&p["port"], &p["targetPort"])))
        .collect();
    assert_eq!(service_ports["http"].0, 80);
    assert_eq!(service_ports["https"].0, 443);
    for name in ["http", "https"] {
        assert_eq!(s(service_ports[name].1), name);
    }
    assert_eq!(
        service["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"]
    );

    // Only controller pods reach the agent's port; HAProxy's ports are open.
    let policy = find(&manifests, "NetworkPolicy", "haproxy");
    assert_eq!(
        policy["spec"]["podSelector"],
        deployment["spec"]["selector"]
    );
    let controller = docs("deploy/controller.yaml");
    let controller_labels =
        &find(&controller, "Deployment", "haptic-controller")["spec"]["selector"]["matchLabels"];
    let rules = list(&policy["spec"]["ingress"]);
    let agent_rule: Vec<&Value> = rules
        .iter()
        .filter(|r| list(&r["ports"]).iter().any(|p| p["port"] == agent_port))
        .collect();
    assert_eq!(agent_rule.len(), 1, "one rule opens the agent port");
    assert_eq!(list(&agent_rule[0]["ports"]).len(), 1, "and only it");
    let from = list(&agent_rule[0]["from"]);
    assert_eq!(from.len(), 1);
    assert_eq!(&from[0]["podSelector"]["matchLabels"], controller_labels);
    assert!(
        from[0].get("namespaceSelector").is_none(),
        "controller pods of this namespace"
    );
    let open: BTreeSet<u64> = rules
        .iter()
        .filter(|r| r.get("from").is_none())
        .flat_map(|r| list(&r["ports"]))
        .filter_map(|p| p["port"].as_u64())
        .collect();
    assert_eq!(
        open,
        [http_port.as_u64(), https_port.as_u64(), Some(probe_port)]
            .into_iter()
            .flatten()
            .collect(),
        "open to all: HAProxy's ports and the agent's probe port only"
    );

    let ingress_class = find(&docs("deploy/ingressclass.yaml"), "IngressClass", "haproxy").clone();
    assert!(ingress_class["spec"]["controller"].is_string());
}

/// (image name in the manifests, its newName:newTag) of deploy/kustomization.yaml.
fn images() -> BTreeMap<String, String> {
    let kustomization = docs("deploy/kustomization.yaml").remove(0);
    list(&kustomization["images"])
        .iter()
        .map(|i| {
            (
                s(&i["name"]).to_owned(),
                format!("{}:{}", s(&i["newName"]), s(&i["newTag"])),
            )
        })
        .collect()
}

/// `FROM` lines of a Dockerfile: (image, stage name).
fn stages(text: &str) -> Vec<(String, Option<String>)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .map(|rest| {
            let mut words = rest.split_whitespace();
            let image = words.next().expect("FROM image").to_owned();
            let name = match (words.next(), words.next()) {
                (Some(as_), Some(name)) if as_.eq_ignore_ascii_case("as") => Some(name.to_owned()),
                _ => None,
            };
            (image, name)
        })
        .collect()
}

#[test]
fn the_images_are_the_ones_the_dockerfiles_build() {
    let images = images();
    let mut used: BTreeMap<String, Vec<(String, Value)>> = BTreeMap::new();
    for file in ["deploy/controller.yaml", "deploy/haproxy.yaml"] {
        for doc in docs(file).iter().filter(|d| d["kind"] == "Deployment") {
            let pod = &doc["spec"]["template"]["spec"];
            for c in list(&pod["containers"])
                .iter()
                .chain(pod["initContainers"].as_array().into_iter().flatten())
            {
                used.entry(s(&c["image"]).to_owned())
                    .or_default()
                    .push((file.to_owned(), c.clone()));
            }
        }
    }
    assert_eq!(
        used.keys().collect::<BTreeSet<_>>(),
        images.keys().collect::<BTreeSet<_>>(),
        "the manifests use exactly the images deploy/kustomization.yaml sets"
    );
    let rust_version = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("rust-version")
        .to_owned();
    let version = |v: &str| -> Vec<u32> { v.split('.').filter_map(|p| p.parse().ok()).collect() };
    let mut finals = BTreeSet::new();
    for (name, reference) in &images {
        // haptic-<component>, built from docker/<component>.Dockerfile, is the workspace
        // package and binary haptic-<component>.
        let component = name.strip_prefix("haptic-").expect("haptic-<component>");
        assert!(
            reference.contains(&format!("/{name}:")),
            "{name} -> {reference}"
        );
        let dockerfile = format!("docker/{component}.Dockerfile");
        let text = read(&dockerfile);
        assert!(
            root().join(name).join("src/main.rs").is_file(),
            "{name} is a workspace binary"
        );
        assert!(
            read(&format!("{name}/Cargo.toml")).contains(&format!("name = \"{name}\"")),
            "package {name}"
        );
        assert!(
            text.contains(&format!(
                "cargo build --release --locked -p {name} --bin {name}"
            )),
            "{dockerfile} builds {name}"
        );
        let binary = format!("/usr/local/bin/{name}");
        assert!(
            text.contains(&format!("{name} /out/{name}")),
            "{dockerfile} copies the binary out"
        );
        assert!(text.contains(&format!("COPY --from=build /out/{name} {binary}\n")));
        assert!(text.contains(&format!("ENTRYPOINT [\"{binary}\"]")));

        let stages = stages(&text);
        assert_eq!(
            stages.len(),
            2,
            "{dockerfile}: a builder stage and a final one"
        );
        let (builder, stage) = &stages[0];
        assert_eq!(stage.as_deref(), Some("build"));
        let tag = builder
            .strip_prefix("rust:")
            .and_then(|t| t.split('-').next())
            .expect("FROM rust:<version>");
        assert!(
            version(tag) >= version(&rust_version),
            "{builder} is older than rust-version {rust_version}"
        );
        let (final_base, _) = &stages[1];
        assert!(
            !final_base.starts_with("rust"),
            "{dockerfile}: the final stage has no toolchain"
        );
        finals.insert(final_base.clone());
        let final_stage = text
            .split_once(&format!("FROM {final_base}"))
            .expect("final")
            .1;
        for tool in ["cargo", "rustc", "gcc", "build-essential", "make"] {
            assert!(
                !final_stage
                    .split(|c: char| c.is_whitespace())
                    .any(|w| w == tool),
                "{dockerfile}: {tool} in the final stage"
            );
        }
        let installs: Vec<&str> = final_stage
            .lines()
            .map(str::trim)
            .filter(|l| l.contains("apt-get install"))
            .collect();
        assert_eq!(
            installs,
            ["&& apt-get install -y --no-install-recommends haproxy \\"],
            "{dockerfile}: the fleet's HAProxy (the Debian package), nothing else"
        );

        // Every container of this image runs as the image's user, a command the image has,
        // and listens only on ports the image exposes.
        let uid = dockerfile_user(&dockerfile);
        let exposed: BTreeSet<u64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("EXPOSE "))
            .flat_map(|l| l.split_whitespace().filter_map(|p| p.parse().ok()))
            .collect();
        for (file, c) in &used[name] {
            let pod_uid = find(
                &docs(file),
                "Deployment",
                if component == "controller" {
                    "haptic-controller"
                } else {
                    "haproxy"
                },
            )["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
                .as_u64();
            assert_eq!(
                pod_uid,
                Some(uid),
                "{file}: runAsUser is {dockerfile}'s USER"
            );
            if let Some(command) = c["command"].as_array() {
                let program = s(&command[0]);
                assert!(
                    [binary.as_str(), "/usr/sbin/haproxy", "/bin/sh"].contains(&program),
                    "{file}: {program} is not in {name}'s image"
                );
            }
            for port in c["ports"].as_array().into_iter().flatten() {
                let port = port["containerPort"].as_u64().expect("containerPort");
                assert!(
                    exposed.contains(&port),
                    "{dockerfile} does not EXPOSE {port}"
                );
            }
        }
        // The build context is the root; the Dockerfile's own ignore file keeps target/ out.
        let ignore = read(&format!("{dockerfile}.dockerignore"));
        assert!(ignore.lines().any(|l| l == "target/"));
    }
    assert_eq!(
        finals.len(),
        1,
        "one base (one HAProxy version) for every image: {finals:?}"
    );
    assert!(
        root().join("Cargo.lock").is_file(),
        "--locked needs Cargo.lock"
    );
}

#[test]
fn the_kustomization_lists_every_manifest_and_builds() {
    let kustomization = docs("deploy/kustomization.yaml").remove(0);
    let resources: BTreeSet<String> = strings(&kustomization["resources"]).into_iter().collect();
    let patch = "haptic-config-ports.yaml";
    assert_eq!(kustomization["patches"][0]["path"], patch);
    let files: BTreeSet<String> = std::fs::read_dir(root().join("deploy"))
        .expect("deploy/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml" && n != patch)
        .collect();
    assert_eq!(resources, files, "every manifest in deploy/ is a resource");

    let Some(built) = built() else { return };
    let mut expected = deployed_htc();
    let htc = find(&built, "HAProxyTemplateConfig", "haptic-config").clone();
    // kustomize may add nothing but the patch: same spec as the reference with it applied.
    assert_eq!(htc["spec"], expected["spec"], "the patched HTC");
    assert_eq!(
        htc["spec"]["templatingSettings"]["extraContext"]["haproxy"]["http_port"],
        8080
    );
    assert_eq!(
        htc["spec"]["templatingSettings"]["extraContext"]["haproxy"]["https_port"],
        8443
    );
    assert_eq!(
        htc["spec"]["templatingSettings"]["extraContext"]["haproxy"]["maxconn"],
        10000
    );
    expected = htc.clone();
    assert_eq!(expected["metadata"]["namespace"], "haptic-system");
    let images = images();
    for doc in built.iter().filter(|d| d["kind"] == "Deployment") {
        for c in list(&doc["spec"]["template"]["spec"]["containers"]) {
            assert!(
                images.values().any(|i| c["image"] == *i),
                "{} runs {}",
                c["name"],
                c["image"]
            );
        }
    }
    let kinds: BTreeSet<&str> = built.iter().map(|d| s(&d["kind"])).collect();
    for kind in [
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ConfigMap",
        "NetworkPolicy",
        "IngressClass",
        "HAProxyTemplateConfig",
    ] {
        assert!(
            kinds.contains(kind),
            "kubectl kustomize deploy/ has no {kind}"
        );
    }
    for doc in &built {
        let namespaced = !matches!(
            s(&doc["kind"]),
            "Namespace"
                | "CustomResourceDefinition"
                | "ClusterRole"
                | "ClusterRoleBinding"
                | "IngressClass"
        );
        if namespaced {
            assert_eq!(
                doc["metadata"]["namespace"], "haptic-system",
                "{}",
                doc["metadata"]["name"]
            );
        }
    }
}

#[test]
fn the_kind_config_publishes_the_node_ports_the_e2e_sets() {
    let config = docs("deploy/kind/cluster.yaml").remove(0);
    let mapped: BTreeSet<u64> = list(&config["nodes"])
        .iter()
        .flat_map(|n| n["extraPortMappings"].as_array().into_iter().flatten())
        .filter_map(|m| m["containerPort"].as_u64())
        .collect();
    assert_eq!(mapped, BTreeSet::from([30080, 30443]));
    let e2e = read("e2e/src/cluster.rs");
    for port in mapped {
        assert!(
            e2e.contains(&format!("\"nodePort\":{port}")),
            "the e2e sets nodePort {port}"
        );
    }
}

#[test]
fn the_bootstrap_config_passes_haproxy_check() {
    let haproxy = ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "HAProxy is needed: `sudo apt-get install -y haproxy` (cargo xtask test installs it)",
        );
    let manifests = docs("deploy/haproxy.yaml");
    let config = s(&find(&manifests, "ConfigMap", "haproxy-bootstrap")["data"]["haproxy.cfg"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("haproxy.cfg");
    std::fs::write(&path, config).expect("write");
    let output = Command::new(haproxy)
        .arg("-c")
        .arg("-f")
        .arg(&path)
        .output()
        .expect("haproxy -c");
    assert!(
        output.status.success(),
        "the bootstrap config: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The config as deployed (the reference with the patch) is one the controller accepts, and
/// its render passes the agents' default policy and `haproxy -c`, binding the HAProxy
/// container's port.
#[test]
fn the_deployed_config_validates_renders_and_passes_haproxy_check() {
    use haptic_controller::{crd::HAProxyTemplateConfig, events::RenderedSet, render_gate};

    let htc: HAProxyTemplateConfig =
        serde_json::from_value(deployed_htc()).expect("the deployed HTC reads as the CRD's type");
    let config = haptic_controller::config::validate(&htc.spec, 1, "1")
        .unwrap_or_else(|errors| panic!("the controller refuses it: {}", errors.join("; ")));
    let files = config
        .renderer
        .render(&config.empty_stores())
        .expect("renders with empty stores");
    let cfg = String::from_utf8_lossy(files.get("haproxy.cfg").expect("haproxy.cfg")).into_owned();
    assert!(cfg.contains("    maxconn 10000\n"), "{cfg}");
    let manifests = docs("deploy/haproxy.yaml");
    let pod = &find(&manifests, "Deployment", "haproxy")["spec"]["template"]["spec"];
    let http = list(&container(pod, "haproxy")["ports"])
        .iter()
        .find(|p| p["name"] == "http")
        .map(|p| p["containerPort"].clone())
        .expect("http port");
    assert!(cfg.contains(&format!("bind \":{http}\"")), "{cfg}");

    let set = RenderedSet {
        checksum: files.checksum_hex(),
        files,
        config_generation: 1,
        term: std::time::SystemTime::now(),
        span: tracing::Span::none(),
        provenance: Default::default(),
        render_time: std::time::Duration::ZERO,
        requests: Default::default(),
    };
    render_gate::policy_check(&haptic_agent_client::policy::Policy::default(), &set)
        .expect("the agents' default policy");
    let haproxy = ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "HAProxy is needed: `sudo apt-get install -y haproxy` (cargo xtask test installs it)",
        );
    let dir = tempfile::tempdir().expect("tempdir");
    set.files.write_to(dir.path()).expect("write the set");
    let output = Command::new(haproxy)
        .arg("-c")
        .arg("-C")
        .arg(dir.path())
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .output()
        .expect("haproxy -c");
    assert!(
        output.status.success(),
        "haproxy -c: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every manifest reads as its Kubernetes type (a misspelt field's type, a string for a
/// number, a list for a map).
#[test]
fn every_manifest_reads_as_its_kubernetes_type() {
    use k8s_openapi::{
        api::{
            apps::v1::Deployment,
            core::v1::{ConfigMap, Namespace, Service, ServiceAccount},
            networking::v1::{IngressClass, NetworkPolicy},
            policy::v1::PodDisruptionBudget,
            rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
        },
        apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    };
    use serde::de::DeserializeOwned;

    fn typed<T: DeserializeOwned>(doc: &Value) {
        if let Err(error) = serde_json::from_value::<T>(doc.clone()) {
            panic!("{} {}: {error}", doc["kind"], doc["metadata"]["name"]);
        }
    }
    let mut seen = 0;
    for file in [
        "deploy/namespace.yaml",
        "deploy/crd.yaml",
        "deploy/rbac.yaml",
        "deploy/controller.yaml",
        "deploy/haproxy.yaml",
        "deploy/ingressclass.yaml",
        "deploy/haptic-config.yaml",
    ] {
        for doc in docs(file) {
            seen += 1;
            match s(&doc["kind"]) {
                "Namespace" => typed::<Namespace>(&doc),
                "CustomResourceDefinition" => typed::<CustomResourceDefinition>(&doc),
                "ServiceAccount" => typed::<ServiceAccount>(&doc),
                "ClusterRole" => typed::<ClusterRole>(&doc),
                "ClusterRoleBinding" => typed::<ClusterRoleBinding>(&doc),
                "Role" => typed::<Role>(&doc),
                "RoleBinding" => typed::<RoleBinding>(&doc),
                "Deployment" => typed::<Deployment>(&doc),
                "PodDisruptionBudget" => typed::<PodDisruptionBudget>(&doc),
                "Service" => typed::<Service>(&doc),
                "ConfigMap" => typed::<ConfigMap>(&doc),
                "NetworkPolicy" => typed::<NetworkPolicy>(&doc),
                "IngressClass" => typed::<IngressClass>(&doc),
                "HAProxyTemplateConfig" => {
                    typed::<haptic_controller::crd::HAProxyTemplateConfig>(&doc)
                }
                other => panic!("{file}: no type for {other}"),
            }
        }
    }
    // crd.yaml holds five CRDs: the HTC and the four published kinds; rbac.yaml seven objects.
    assert_eq!(seen, 21, "documents in deploy/");
}
