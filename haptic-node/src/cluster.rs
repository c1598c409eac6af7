//! `up`, `down` and `status` of the local cluster. Everything it keeps is in the state
//! directory: certificates, etcd's data, logs, `pids/NAME` for each detached process, and the
//! process kubelet's `pods/` (netns names, pids). `down` needs nothing else, so it also cleans
//! up after a crashed `up`.

use std::{
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::{Api, config::KubeConfigOptions, config::Kubeconfig};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::json;

use crate::{Flags, net};

/// The processes `up` starts, in start order (`down` stops them in reverse).
const COMPONENTS: [&str; 4] = ["etcd", "kube-apiserver", "kube-controller-manager", "node"];
/// The node's name.
pub(crate) const NODE_NAME: &str = "haptic-node";
/// Set when `up` is interrupted (Ctrl-C, SIGTERM): it stops waiting and cleans up.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// How long `up` waits for a Ready node.
const UP_TIMEOUT: Duration = Duration::from_secs(120);

fn free_port(host: &str) -> Result<u16> {
    let listener = TcpListener::bind((host, 0)).with_context(|| format!("binding {host}:0"))?;
    Ok(listener.local_addr()?.port())
}

fn pid_alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Starts `program args` detached (a session of its own, stdin closed, output to
/// `DIR/logs/NAME.log`) and records its pid in `DIR/pids/NAME`.
fn spawn(state: &Path, name: &str, program: &Path, args: &[String]) -> Result<u32> {
    use std::os::unix::process::CommandExt as _;
    let log = fs::File::create(state.join("logs").join(format!("{name}.log")))
        .with_context(|| format!("creating the log of {name}"))?;
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let pid = child.id();
    fs::write(state.join("pids").join(name), pid.to_string())?;
    // The child is not waited for: `down` ends it by its pid. Dropping `Child` does not kill.
    drop(child);
    Ok(pid)
}

fn write_kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> Result<()> {
    let doc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{ "name": "haptic-local", "cluster": {
            "server": server, "certificate-authority": ca.display().to_string() }}],
        "users": [{ "name": "admin", "user": { "token": token } }],
        "contexts": [{ "name": "haptic-local", "context": { "cluster": "haptic-local", "user": "admin" } }],
        "current-context": "haptic-local",
    });
    fs::write(path, doc.to_string()).with_context(|| format!("writing {}", path.display()))
}

/// The admin kube client from the state's kubeconfig.
pub(crate) async fn client(state: &Path) -> Result<kube::Client> {
    let path = state.join("admin.kubeconfig");
    let kc = Kubeconfig::read_from(&path).with_context(|| format!("reading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .context("loading the admin kubeconfig")?;
    kube::Client::try_from(config).context("building the kube client")
}

fn running(state: &Path) -> Vec<(String, u32)> {
    COMPONENTS
        .iter()
        .filter_map(|name| {
            let pid = read_pid(&state.join("pids").join(name))?;
            pid_alive(pid).then(|| ((*name).to_owned(), pid))
        })
        .collect()
}

/// `up`: see the crate doc.
pub(crate) fn up(flags: &Flags) -> Result<()> {
    let started = Instant::now();
    let state = flags.path("state")?;
    let assets = flags.path("assets")?;
    let bins = flags.path("bins")?;
    for binary in ["etcd", "kube-apiserver", "kube-controller-manager"] {
        if !assets.join(binary).is_file() {
            bail!(
                "{} has no {binary}: run `cargo xtask envtest` (it builds the three)",
                assets.display()
            );
        }
    }
    if state.exists() {
        if !running(&state).is_empty() {
            bail!(
                "a local cluster is already up ({}): `cargo xtask cluster down` first",
                state.display()
            );
        }
        eprintln!("haptic-node: cleaning the leftovers of an earlier run");
        down(&state)?;
    }
    for dir in ["pids", "logs", "pods", "etcd"] {
        fs::create_dir_all(state.join(dir))
            .with_context(|| format!("creating {}", state.join(dir).display()))?;
    }
    let result = start(&state, &assets, &bins);
    if let Err(error) = result {
        eprintln!(
            "haptic-node: `up` failed; logs in {}; cleaning up",
            state.join("logs").display()
        );
        for name in COMPONENTS {
            let log = state.join("logs").join(format!("{name}.log"));
            if let Ok(text) = fs::read_to_string(&log) {
                let lines: Vec<&str> = text.lines().collect();
                eprintln!(
                    "--- {name}.log (tail)\n{}",
                    lines[lines.len().saturating_sub(15)..].join("\n")
                );
            }
        }
        let _ = down(&state);
        return Err(error);
    }
    println!(
        "haptic-node: cluster up in {:.1}s (Node {NODE_NAME} Ready); export KUBECONFIG={}",
        started.elapsed().as_secs_f64(),
        state.join("admin.kubeconfig").display()
    );
    Ok(())
}

fn start(state: &Path, assets: &Path, bins: &Path) -> Result<()> {
    let write = |name: &str, text: &str| -> Result<PathBuf> {
        let path = state.join(name);
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    };
    // A Ctrl-C during `up` ends in `down`, not in detached leftovers.
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.spawn(async {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    net::bridge_up()?;
    fs::write(state.join("bridge"), net::BRIDGE)?;

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let serving_key = KeyPair::generate()?;
    let names: Vec<String> = [
        net::BRIDGE_IP,
        "127.0.0.1",
        "10.0.0.1",
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let serving = CertificateParams::new(names)?.signed_by(&serving_key, &issuer)?;
    let ca_path = write("ca.crt", &ca.pem())?;
    let cert_path = write("apiserver.crt", &serving.pem())?;
    let key_path = write("apiserver.key", &serving_key.serialize_pem())?;
    // The API server's client certificate for the kubelet endpoint (`kubectl logs`): the
    // process kubelet accepts no other client.
    let kubelet_client_key = KeyPair::generate()?;
    let mut kubelet_client = CertificateParams::new(Vec::<String>::new())?;
    kubelet_client
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
    kubelet_client.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let kubelet_client = kubelet_client.signed_by(&kubelet_client_key, &issuer)?;
    let kubelet_client_cert = write("kubelet-client.crt", &kubelet_client.pem())?;
    let kubelet_client_key = write("kubelet-client.key", &kubelet_client_key.serialize_pem())?;
    let sa_key = KeyPair::generate()?;
    let sa_key_path = write("sa.key", &sa_key.serialize_pem())?;
    let sa_pub_path = write("sa.pub", &sa_key.public_key_pem())?;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let tokens_path = write(
        "tokens.csv",
        &format!("{token},haptic-admin,haptic-admin,\"system:masters\"\n"),
    )?;

    let (etcd_client, etcd_peer) = (free_port("127.0.0.1")?, free_port("127.0.0.1")?);
    let port = free_port(net::BRIDGE_IP)?;
    let etcd_url = format!("http://127.0.0.1:{etcd_client}");
    let peer_url = format!("http://127.0.0.1:{etcd_peer}");
    spawn(
        state,
        "etcd",
        &assets.join("etcd"),
        &[
            format!("--data-dir={}", state.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            "--unsafe-no-fsync=true".to_owned(),
            "--log-level=warn".to_owned(),
        ],
    )?;
    let server = format!("https://{}:{port}", net::BRIDGE_IP);
    spawn(
        state,
        "kube-apiserver",
        &assets.join("kube-apiserver"),
        &[
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={}", net::BRIDGE_IP),
            format!("--advertise-address={}", net::BRIDGE_IP),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", state.join("certs").display()),
            format!("--tls-cert-file={}", cert_path.display()),
            format!("--tls-private-key-file={}", key_path.display()),
            "--authorization-mode=RBAC".to_owned(),
            format!("--token-auth-file={}", tokens_path.display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-account-key-file={}", sa_pub_path.display()),
            format!(
                "--service-account-signing-key-file={}",
                sa_key_path.display()
            ),
            "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
            "--allow-privileged=true".to_owned(),
            // `kubectl logs` through the process kubelet's endpoint on the bridge.
            "--kubelet-preferred-address-types=InternalIP".to_owned(),
            format!(
                "--kubelet-client-certificate={}",
                kubelet_client_cert.display()
            ),
            format!("--kubelet-client-key={}", kubelet_client_key.display()),
            "--v=0".to_owned(),
        ],
    )?;
    let kubeconfig = state.join("admin.kubeconfig");
    write_kubeconfig(&kubeconfig, &server, &ca_path, &token)?;
    fs::write(state.join("server"), format!("{} {port}", net::BRIDGE_IP))?;

    let deadline = Instant::now() + UP_TIMEOUT;
    runtime.block_on(async {
        let client = client(state).await?;
        wait(state, deadline, "kube-apiserver /readyz", || async {
            let request = http::Request::get("/readyz").body(Vec::new()).ok()?;
            let text = client.request_text(request).await.ok()?;
            (text.trim() == "ok").then_some(())
        })
        .await
    })?;
    spawn(
        state,
        "kube-controller-manager",
        &assets.join("kube-controller-manager"),
        &[
            format!("--kubeconfig={}", kubeconfig.display()),
            "--secure-port=0".to_owned(),
            "--leader-elect=false".to_owned(),
            format!(
                "--service-account-private-key-file={}",
                sa_key_path.display()
            ),
            format!("--root-ca-file={}", ca_path.display()),
            "--use-service-account-credentials=false".to_owned(),
            // Deployments, ReplicaSets, EndpointSlices, ServiceAccounts, namespaces, garbage
            // collection, node lifecycle: the defaults. No cloud, no node IPAM.
            "--controllers=*".to_owned(),
            "--v=0".to_owned(),
        ],
    )?;
    let node_bin = std::env::current_exe().context("locating haptic-node")?;
    spawn(
        state,
        "node",
        &node_bin,
        &[
            "agent".to_owned(),
            "--state".to_owned(),
            state.display().to_string(),
            "--bins".to_owned(),
            bins.display().to_string(),
        ],
    )?;
    runtime.block_on(async {
        let client = client(state).await?;
        let nodes: Api<Node> = Api::all(client.clone());
        wait(state, deadline, "Node haptic-node Ready", || async {
            let node = nodes.get(NODE_NAME).await.ok()?;
            let ready = node
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(())
        })
        .await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(client, "default");
        wait(
            state,
            deadline,
            "ServiceAccount default/default (kube-controller-manager)",
            || async { accounts.get("default").await.ok().map(|_| ()) },
        )
        .await
    })
}

/// Polls `probe` every 200 ms until it answers, a component exits, or `deadline`.
async fn wait<F, Fut>(state: &Path, deadline: Instant, what: &str, mut probe: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<()>>,
{
    loop {
        if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            bail!("interrupted while waiting for {what}");
        }
        if probe().await.is_some() {
            return Ok(());
        }
        for name in COMPONENTS {
            if let Some(pid) = read_pid(&state.join("pids").join(name))
                && !pid_alive(pid)
            {
                bail!("{name} exited while waiting for {what}");
            }
        }
        if Instant::now() >= deadline {
            bail!("no {what} within {UP_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn stop(pid: u32, bound: Duration) {
    if !pid_alive(pid) {
        return;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let deadline = Instant::now() + bound;
    while pid_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if pid_alive(pid) {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

/// `down`: see the crate doc. Idempotent.
pub(crate) fn down(state: &Path) -> Result<()> {
    // The process kubelet first: on SIGTERM it stops its Pods' processes and namespaces.
    if let Some(pid) = read_pid(&state.join("pids").join("node")) {
        stop(pid, Duration::from_secs(15));
    }
    // What it left (a crash): every Pod's processes and namespace, the mount points it made.
    if let Ok(entries) = fs::read_dir(state.join("pods")) {
        for entry in entries.flatten() {
            crate::pod::cleanup_dir(&entry.path());
        }
    }
    for netns in net::cluster_netns() {
        net::delete_netns(&netns);
    }
    for name in COMPONENTS.iter().rev() {
        if let Some(pid) = read_pid(&state.join("pids").join(name)) {
            stop(pid, Duration::from_secs(15));
        }
    }
    net::bridge_down();
    // The mount points the Pods needed on the host, deepest first.
    if let Ok(text) = fs::read_to_string(state.join("created-dirs")) {
        for dir in text.lines().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
    if state.exists() {
        fs::remove_dir_all(state).with_context(|| format!("removing {}", state.display()))?;
    }
    println!("haptic-node: cluster down; {} removed", state.display());
    Ok(())
}

/// `status`: see the crate doc.
pub(crate) fn status(state: &Path) -> Result<()> {
    if !state.exists() {
        println!("no local cluster ({} does not exist)", state.display());
        return Ok(());
    }
    for name in COMPONENTS {
        match read_pid(&state.join("pids").join(name)) {
            Some(pid) if pid_alive(pid) => println!("{name:<24} running (pid {pid})"),
            Some(pid) => println!("{name:<24} NOT running (pid {pid} gone)"),
            None => println!("{name:<24} never started"),
        }
    }
    println!("netns: {}", net::cluster_netns().join(" "));
    let kubeconfig = state.join("admin.kubeconfig");
    println!("KUBECONFIG={}", kubeconfig.display());
    let _ = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["get", "nodes,pods", "-A", "-o", "wide"])
        .status();
    Ok(())
}
