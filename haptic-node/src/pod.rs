//! One Pod as local processes: its volumes as directories of the state, a network namespace
//! of its own on the bridge, each container a process started by
//! `ip netns exec NS unshare --mount -- sh -c 'mount --bind VOLUME PATH...; exec setpriv ... CMD'`
//! (so every container sees its volumes at the paths the manifest names, in a mount namespace
//! of its own, as the manifest's user), readiness and liveness probes, restarts, the Pod's
//! status, and the stop on delete (SIGTERM, the grace period, SIGKILL, the namespace deleted).
//!
//! Images: only those of this project are known (`haptic-controller`, `haptic-agent`, by the
//! last path segment of the repository); their entrypoints are the workspace's binaries, and a
//! `command` naming another absolute path (`/usr/sbin/haproxy`, `/bin/sh`) runs that file of
//! the host: the image's filesystem is the host's. Any other image leaves the Pod Pending with
//! `ErrImagePull` and a message naming the known ones.

use std::{
    collections::{BTreeMap, HashSet},
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::{
    authentication::v1::TokenRequest,
    core::v1::{ConfigMap, Container, Pod, Probe, Secret, ServiceAccount},
};
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use tokio::{io::AsyncReadExt as _, io::AsyncWriteExt as _, process::Child, sync::watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{net, node::Shared};

/// Pod numbers (the last octet) in use, and the last one handed out.
static NUMBERS: Mutex<Option<(HashSet<u8>, u8)>> = Mutex::new(None);

/// The next free number after the last one given: an address is not reused at once, while
/// EndpointSlices may still name the Pod that had it.
fn allocate() -> Option<u8> {
    let mut guard = NUMBERS.lock().ok()?;
    let (used, last) = guard.get_or_insert_with(|| (HashSet::new(), 254));
    let n = (1..=253u16)
        .map(|step| 2 + ((u16::from(*last) - 2 + step) % 253) as u8)
        .find(|n| !used.contains(n))?;
    used.insert(n);
    *last = n;
    Some(n)
}

fn release(n: u8) {
    if let Ok(mut guard) = NUMBERS.lock()
        && let Some((used, _)) = guard.as_mut()
    {
        used.remove(&n);
    }
}

/// Whether the Pod has run to its end (nothing to start).
pub(crate) fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Kills the processes a Pod's directory records and deletes its namespace (`down` after a
/// crash, and the end of every Pod).
pub(crate) fn cleanup_dir(dir: &Path) {
    if let Ok(netns) = fs::read_to_string(dir.join("netns")) {
        net::delete_netns(netns.trim());
    }
    let _ = fs::remove_dir_all(dir);
}

/// Known images: the program a container runs when its `command` is empty, and the default
/// arguments (the Dockerfiles' ENTRYPOINT and CMD).
fn image_entry(bins: &Path, image: &str) -> Option<(PathBuf, Vec<String>)> {
    let repository = image.split('@').next().unwrap_or(image);
    let last = repository.rsplit('/').next().unwrap_or(repository);
    let name = last.split(':').next().unwrap_or(last);
    match name {
        "haptic-controller" => Some((bins.join("haptic-controller"), vec!["run".to_owned()])),
        "haptic-agent" => Some((bins.join("haptic-agent"), Vec::new())),
        // The Gateway API conformance suite's backend (gcr.io/k8s-staging-gateway-api/echo-basic),
        // built from the suite's Go module by `cargo xtask conformance`, which links it here.
        "echo-basic" => Some((bins.join("echo-basic"), Vec::new())),
        _ => None,
    }
}

/// `$(VAR)` references in a command or argument, as the kubelet expands them.
fn expand(text: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find(')') {
            Some(end) if env.contains_key(&after[..end]) => {
                out.push_str(&env[&after[..end]]);
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str("$(");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn field(pod: &Pod, path: &str, ip: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let label = |map: &Option<BTreeMap<String, String>>, key: &str| {
        map.as_ref().and_then(|m| m.get(key).cloned())
    };
    let bracket = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix("']"))
            .map(str::to_owned)
    };
    match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" | "status.podIPs" => Some(ip.to_owned()),
        "status.hostIP" | "status.hostIPs" => Some(net::BRIDGE_IP.to_owned()),
        _ => {
            if let Some(key) = bracket("metadata.labels['") {
                label(&meta.labels, &key)
            } else if let Some(key) = bracket("metadata.annotations['") {
                label(&meta.annotations, &key)
            } else {
                None
            }
        }
    }
}

/// How often a running Pod's Secret, ConfigMap and downward-API files are written again (the
/// kubelet's sync: a rotated Secret reaches the Pod without a restart).
const VOLUME_SYNC: Duration = Duration::from_secs(10);

/// The shortest `expirationSeconds` of the Pod's projected tokens (the API's default 3607).
fn token_ttl(pod: &Pod) -> Option<Duration> {
    pod.spec
        .as_ref()?
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.projected.as_ref())
        .flat_map(|p| p.sources.iter().flatten())
        .filter_map(|s| s.service_account_token.as_ref())
        .map(|t| Duration::from_secs(t.expiration_seconds.unwrap_or(3607).max(600) as u64))
        .min()
}

/// The volumes' directories, filled. `Err` with a message while something they need is
/// missing (a Secret not created yet): the Pod stays `ContainerCreating`. `resync`: a running
/// Pod's files written again (emptyDirs left alone); `tokens`: ServiceAccount tokens
/// requested again too. Each file is replaced by a rename: a reader sees the old or the new.
async fn prepare_volumes(
    shared: &Shared,
    pod: &Pod,
    dir: &Path,
    resync: bool,
    tokens: bool,
) -> Result<()> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let spec = pod.spec.as_ref().context("the Pod has no spec")?;
    let security = spec.security_context.as_ref();
    let uid = security.and_then(|s| s.run_as_user).unwrap_or(0);
    let gid = security
        .and_then(|s| s.fs_group.or(s.run_as_group))
        .unwrap_or(0);
    let client = shared.client.clone();
    let write = |root: &Path, rel: &str, bytes: &[u8]| -> Result<()> {
        let path = root.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let staged = path.with_file_name(format!("..{name}.tmp"));
        fs::write(&staged, bytes).with_context(|| format!("writing {}", staged.display()))?;
        fs::set_permissions(&staged, fs::Permissions::from_mode(0o644))?;
        fs::rename(&staged, &path).with_context(|| format!("replacing {}", path.display()))?;
        Ok(())
    };
    for volume in spec.volumes.iter().flatten() {
        if resync && volume.empty_dir.is_some() {
            continue;
        }
        let root = dir.join("volumes").join(&volume.name);
        fs::create_dir_all(&root)?;
        fs::set_permissions(&root, fs::Permissions::from_mode(0o755))?;
        let what = format!("volume {}", volume.name);
        if volume.empty_dir.is_some() {
            fs::set_permissions(&root, fs::Permissions::from_mode(0o777))?;
            std::os::unix::fs::chown(&root, Some(uid as u32), Some(gid as u32))?;
        } else if let Some(source) = &volume.config_map {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let cm = api
                .get_opt(&source.name)
                .await?
                .with_context(|| format!("{what}: ConfigMap {ns}/{} not found", source.name))?;
            let data = cm.data.unwrap_or_default();
            let items: Vec<(String, String)> = match &source.items {
                Some(items) => items
                    .iter()
                    .map(|i| (i.key.clone(), i.path.clone()))
                    .collect(),
                None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
            };
            for (key, path) in items {
                let value = data.get(&key).with_context(|| {
                    format!("{what}: ConfigMap {} has no key {key}", source.name)
                })?;
                write(&root, &path, value.as_bytes())?;
            }
        } else if let Some(source) = &volume.secret {
            let name = source.secret_name.clone().unwrap_or_default();
            let api: Api<Secret> = Api::namespaced(client.clone(), &ns);
            let secret = api
                .get_opt(&name)
                .await?
                .with_context(|| format!("{what}: Secret {ns}/{name} not found"))?;
            let data = secret.data.unwrap_or_default();
            let items: Vec<(String, String)> = match &source.items {
                Some(items) => items
                    .iter()
                    .map(|i| (i.key.clone(), i.path.clone()))
                    .collect(),
                None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
            };
            for (key, path) in items {
                let value = data
                    .get(&key)
                    .with_context(|| format!("{what}: Secret {name} has no key {key}"))?;
                write(&root, &path, &value.0)?;
            }
        } else if let Some(projected) = &volume.projected {
            for source in projected.sources.iter().flatten() {
                if let Some(token) = &source.service_account_token
                    && tokens
                {
                    let account = spec
                        .service_account_name
                        .clone()
                        .unwrap_or_else(|| "default".to_owned());
                    let request: TokenRequest = serde_json::from_value(json!({
                        "spec": {
                            "audiences": token.audience.iter().collect::<Vec<_>>(),
                            "expirationSeconds": token.expiration_seconds.unwrap_or(3607),
                            "boundObjectRef": { "apiVersion": "v1", "kind": "Pod",
                                "name": pod.metadata.name, "uid": pod.metadata.uid },
                        }
                    }))?;
                    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
                    let answer = api
                        .create_token_request(&account, &PostParams::default(), &request)
                        .await
                        .with_context(|| format!("{what}: a token for ServiceAccount {account}"))?;
                    let value = answer.status.map(|s| s.token).unwrap_or_default();
                    write(&root, &token.path, value.as_bytes())?;
                }
                if let Some(source) = &source.config_map {
                    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
                    let cm = api.get_opt(&source.name).await?.with_context(|| {
                        format!("{what}: ConfigMap {ns}/{} not found", source.name)
                    })?;
                    let data = cm.data.unwrap_or_default();
                    for item in source.items.iter().flatten() {
                        if let Some(value) = data.get(&item.key) {
                            write(&root, &item.path, value.as_bytes())?;
                        }
                    }
                }
                if let Some(source) = &source.downward_api {
                    for item in source.items.iter().flatten() {
                        if let Some(f) = &item.field_ref {
                            let value = field(pod, &f.field_path, "").unwrap_or_default();
                            write(&root, &item.path, value.as_bytes())?;
                        }
                    }
                }
                if let Some(source) = &source.secret {
                    let api: Api<Secret> = Api::namespaced(client.clone(), &ns);
                    let secret = api.get_opt(&source.name).await?.with_context(|| {
                        format!("{what}: Secret {ns}/{} not found", source.name)
                    })?;
                    let data = secret.data.unwrap_or_default();
                    for item in source.items.iter().flatten() {
                        if let Some(value) = data.get(&item.key) {
                            write(&root, &item.path, &value.0)?;
                        }
                    }
                }
            }
        } else if let Some(source) = &volume.downward_api {
            for item in source.items.iter().flatten() {
                if let Some(f) = &item.field_ref {
                    let value = field(pod, &f.field_path, "").unwrap_or_default();
                    write(&root, &item.path, value.as_bytes())?;
                }
            }
        } else {
            bail!(
                "{what}: only emptyDir, configMap, secret, projected and downwardAPI volumes are supported by the process kubelet"
            );
        }
    }
    Ok(())
}

/// Makes `path` exist on the host (a mount point), recording every directory created in the
/// cluster's `created-dirs` so that `down` removes them.
fn mount_point(state: &Path, path: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut at = Some(path);
    while let Some(p) = at {
        if p.exists() {
            break;
        }
        missing.push(p.to_owned());
        at = p.parent();
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut record = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.join("created-dirs"))?;
    for p in missing.iter().rev() {
        use std::io::Write as _;
        writeln!(record, "{}", p.display())?;
        fs::create_dir(p).or_else(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        })?;
    }
    Ok(())
}

struct Running {
    name: String,
    image: String,
    child: Option<Child>,
    pid: u32,
    started_at: String,
    restarts: u32,
    ready: bool,
    last_exit: Option<(i32, String)>,
    next_start: Instant,
    probe_due: Instant,
    readiness_failures: i32,
    liveness_failures: i32,
}

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Starts one container (see the module doc).
async fn spawn(
    shared: &Shared,
    pod: &Pod,
    container: &Container,
    dir: &Path,
    netns: &str,
    ip: &str,
) -> Result<Child> {
    let spec = pod.spec.as_ref().context("no spec")?;
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let image = container.image.clone().unwrap_or_default();
    let (entry, default_args) =
        image_entry(&shared.bins, &image).with_context(|| format!("image {image} is not known"))?;
    let mut env = BTreeMap::new();
    env.insert("PATH".to_owned(), PATH.to_owned());
    env.insert("HOME".to_owned(), "/".to_owned());
    env.insert(
        "HOSTNAME".to_owned(),
        pod.metadata.name.clone().unwrap_or_default(),
    );
    env.insert(
        "KUBERNETES_SERVICE_HOST".to_owned(),
        shared.api_host.clone(),
    );
    env.insert(
        "KUBERNETES_SERVICE_PORT".to_owned(),
        shared.api_port.clone(),
    );
    env.insert(
        "KUBERNETES_SERVICE_PORT_HTTPS".to_owned(),
        shared.api_port.clone(),
    );
    env.insert(
        "KUBERNETES_PORT".to_owned(),
        format!("tcp://{}:{}", shared.api_host, shared.api_port),
    );
    for var in container.env.iter().flatten() {
        let value = if let Some(value) = &var.value {
            expand(value, &env)
        } else if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                field(pod, &f.field_path, ip).with_context(|| {
                    format!("env {}: field {} unsupported", var.name, f.field_path)
                })?
            } else if let Some(r) = &from.secret_key_ref {
                let api: Api<Secret> = Api::namespaced(shared.client.clone(), &ns);
                let secret = api.get_opt(&r.name).await?;
                match secret
                    .and_then(|s| s.data)
                    .and_then(|d| d.get(&r.key).cloned())
                {
                    Some(v) => String::from_utf8_lossy(&v.0).into_owned(),
                    None if r.optional == Some(true) => continue,
                    None => bail!(
                        "env {}: Secret {ns}/{} key {} not found",
                        var.name,
                        r.name,
                        r.key
                    ),
                }
            } else if let Some(r) = &from.config_map_key_ref {
                let api: Api<ConfigMap> = Api::namespaced(shared.client.clone(), &ns);
                let cm = api.get_opt(&r.name).await?;
                match cm.and_then(|c| c.data).and_then(|d| d.get(&r.key).cloned()) {
                    Some(v) => v,
                    None if r.optional == Some(true) => continue,
                    None => bail!(
                        "env {}: ConfigMap {ns}/{} key {} not found",
                        var.name,
                        r.name,
                        r.key
                    ),
                }
            } else {
                bail!("env {}: resourceFieldRef is not supported", var.name)
            }
        } else {
            String::new()
        };
        env.insert(var.name.clone(), value);
    }
    let map_program = |p: &str| -> String {
        // The Dockerfiles install the binaries here: the workspace's builds stand in.
        match p {
            "/usr/local/bin/haptic-controller" => shared.bins.join("haptic-controller"),
            "/usr/local/bin/haptic-agent" => shared.bins.join("haptic-agent"),
            other => PathBuf::from(other),
        }
        .display()
        .to_string()
    };
    let mut argv: Vec<String> = match &container.command {
        Some(command) if !command.is_empty() => {
            let mut v: Vec<String> = command.iter().map(|c| expand(c, &env)).collect();
            v[0] = map_program(&v[0]);
            v.extend(container.args.iter().flatten().map(|a| expand(a, &env)));
            v
        }
        _ => {
            let mut v = vec![entry.display().to_string()];
            match &container.args {
                Some(args) => v.extend(args.iter().map(|a| expand(a, &env))),
                None => v.extend(default_args),
            }
            v
        }
    };
    if argv.is_empty() {
        argv.push("/bin/true".to_owned());
    }
    let pod_security = spec.security_context.as_ref();
    let own = container.security_context.as_ref();
    let uid = own
        .and_then(|s| s.run_as_user)
        .or_else(|| pod_security.and_then(|s| s.run_as_user));
    let gid = own
        .and_then(|s| s.run_as_group)
        .or_else(|| pod_security.and_then(|s| s.run_as_group))
        .or(uid);
    let fs_group = pod_security.and_then(|s| s.fs_group);
    // A container runtime's open-file limit (containerd: 1048576): HAProxy sizes its maxconn
    // by it, and a non-root process cannot raise it after setpriv.
    let mut script = String::from("set -e\nulimit -n 1048576 2>/dev/null || true\n");
    for mount in container.volume_mounts.iter().flatten() {
        let source = dir.join("volumes").join(&mount.name);
        let target = Path::new(&mount.mount_path);
        mount_point(&shared.state, target)?;
        script.push_str(&format!(
            "mount --bind {} {}\n",
            quote(&source.display().to_string()),
            quote(&mount.mount_path)
        ));
        if mount.read_only == Some(true) {
            script.push_str(&format!(
                "mount -o remount,bind,ro {}\n",
                quote(&mount.mount_path)
            ));
        }
    }
    if let Some(wd) = &container.working_dir {
        script.push_str(&format!("cd {}\n", quote(wd)));
    }
    match (uid, gid) {
        (Some(u), g) if u != 0 => {
            let groups = fs_group
                .map(|g| format!("--groups={g}"))
                .unwrap_or_else(|| "--clear-groups".to_owned());
            script.push_str(&format!(
                "exec setpriv --reuid={u} --regid={} {groups} -- \"$@\"\n",
                g.unwrap_or(u)
            ));
        }
        _ => script.push_str("exec \"$@\"\n"),
    }
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{}.log", container.name)))?;
    let mut command = tokio::process::Command::new("/usr/sbin/ip");
    command
        .args([
            "netns",
            "exec",
            netns,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
        ])
        .args(["/bin/sh", "-c", &script, "sh"])
        .args(&argv)
        .env_clear()
        .envs(&env)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true);
    let child = command
        .spawn()
        .with_context(|| format!("starting container {}", container.name))?;
    if let Some(pid) = child.id() {
        fs::write(dir.join(format!("{}.pid", container.name)), pid.to_string())?;
    }
    info!(pod = ?pod.metadata.name, container = %container.name, argv = ?argv, "started");
    Ok(child)
}

fn port_of(
    container: &Container,
    port: &k8s_openapi::apimachinery::pkg::util::intstr::IntOrString,
) -> Option<u16> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    match port {
        IntOrString::Int(p) => u16::try_from(*p).ok(),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

/// One probe: `true` when it passed.
async fn probe(container: &Container, probe: &Probe, ip: &str) -> bool {
    let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1) as u64);
    let attempt = async {
        if let Some(get) = &probe.http_get {
            let port = port_of(container, &get.port)?;
            let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
            let path = get.path.clone().unwrap_or_else(|| "/".to_owned());
            let request = format!(
                "GET {path} HTTP/1.0\r\nHost: {ip}:{port}\r\nUser-Agent: kube-probe/1.34\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut head = vec![0u8; 64];
            let n = stream.read(&mut head).await.ok()?;
            let line = String::from_utf8_lossy(&head[..n]).into_owned();
            let code: u16 = line.split_whitespace().nth(1)?.parse().ok()?;
            (200..400).contains(&code).then_some(())
        } else if let Some(tcp) = &probe.tcp_socket {
            let port = port_of(container, &tcp.port)?;
            tokio::net::TcpStream::connect((ip, port))
                .await
                .ok()
                .map(|_| ())
        } else {
            // exec and gRPC probes are not run: they pass.
            Some(())
        }
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(())))
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status();
}

/// The Pod's task: see the module doc.
pub(crate) async fn run(shared: Shared, mut pods: watch::Receiver<Pod>, cancel: CancellationToken) {
    let pod = pods.borrow().clone();
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let dir = shared.state.join("pods").join(format!("{ns}_{name}_{uid}"));
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &ns);
    if let Err(error) = fs::create_dir_all(&dir) {
        warn!(%error, pod = %name, "no directory for the Pod");
        return;
    }
    let mut number = None;
    let outcome = lifecycle(&shared, &mut pods, &cancel, &api, &dir, &mut number).await;
    if let Err(error) = &outcome {
        warn!(pod = %format!("{ns}/{name}"), error = format!("{error:#}"), "Pod task ended");
    }
    cleanup_dir(&dir);
    if let Some(n) = number {
        release(n);
    }
    let deleting = pods.borrow().metadata.deletion_timestamp.is_some();
    if deleting {
        // The kubelet's last word: the object goes once its processes are gone.
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(error) => warn!(%error, pod = %name, "final delete failed"),
        }
    }
    info!(pod = %format!("{ns}/{name}"), "stopped and cleaned");
}

async fn patch_status(api: &Api<Pod>, name: &str, status: &Value, last: &mut Value) {
    if status == last {
        return;
    }
    match api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
    {
        Ok(_) => *last = status.clone(),
        Err(error) => warn!(%error, pod = %name, "status update failed"),
    }
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

async fn lifecycle(
    shared: &Shared,
    pods: &mut watch::Receiver<Pod>,
    cancel: &CancellationToken,
    api: &Api<Pod>,
    dir: &Path,
    number: &mut Option<u8>,
) -> Result<()> {
    let pod = pods.borrow().clone();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.clone().context("the Pod has no spec")?;
    let start_time = now();
    let mut last = Value::Null;
    let base = |phase: &str, ip: Option<&str>| {
        let mut s = json!({
            "phase": phase, "hostIP": net::BRIDGE_IP, "hostIPs": [{ "ip": net::BRIDGE_IP }],
            "startTime": start_time,
        });
        if let Some(ip) = ip {
            s["podIP"] = json!(ip);
            s["podIPs"] = json!([{ "ip": ip }]);
        }
        s
    };
    let cond = |type_: &str, ok: bool, reason: Option<&str>| {
        let mut c = json!({ "type": type_, "status": if ok { "True" } else { "False" }, "lastTransitionTime": start_time });
        if let Some(r) = reason {
            c["reason"] = json!(r);
        }
        c
    };
    let waiting = |c: &Container, reason: &str, message: &str| {
        json!({ "name": c.name, "image": c.image, "imageID": "", "ready": false, "restartCount": 0,
                "started": false, "state": { "waiting": { "reason": reason, "message": message } } })
    };
    let all: Vec<&Container> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .collect();

    // Images first: an unknown one is the Pod's clear failure.
    let unknown: Vec<String> = all
        .iter()
        .filter_map(|c| c.image.clone())
        .filter(|i| image_entry(&shared.bins, i).is_none())
        .collect();
    if !unknown.is_empty() {
        let message = format!(
            "image {} is not known to the process kubelet (it runs only haptic-controller and haptic-agent images, as the workspace's binaries)",
            unknown.join(", ")
        );
        let mut status = base("Pending", None);
        status["conditions"] = json!([
            cond("PodScheduled", true, None),
            cond("Ready", false, Some("ContainersNotReady"))
        ]);
        status["containerStatuses"] = Value::Array(
            spec.containers
                .iter()
                .map(|c| waiting(c, "ErrImagePull", &message))
                .collect(),
        );
        patch_status(api, &name, &status, &mut last).await;
        warn!(pod = %name, %message, "unknown image");
        wait_end(pods, cancel).await;
        return Ok(());
    }

    // Volumes (waiting for what they need), then the network.
    loop {
        match prepare_volumes(shared, &pod, dir, false, true).await {
            Ok(()) => break,
            Err(error) => {
                let message = format!("{error:#}");
                let mut status = base("Pending", None);
                status["conditions"] = json!([
                    cond("PodScheduled", true, None),
                    cond("Ready", false, Some("ContainersNotReady"))
                ]);
                status["containerStatuses"] = Value::Array(
                    spec.containers
                        .iter()
                        .map(|c| waiting(c, "ContainerCreating", &message))
                        .collect(),
                );
                patch_status(api, &name, &status, &mut last).await;
                if ended(pods, cancel, Duration::from_secs(1)).await {
                    return Ok(());
                }
            }
        }
    }
    let n = allocate().context("the Pod range 10.88.0.0/24 is full")?;
    *number = Some(n);
    fs::write(dir.join("netns"), format!("{}{n}", net::NETNS_PREFIX))?;
    let (netns, ip) = tokio::task::spawn_blocking(move || net::pod_netns(n)).await??;

    // Init containers, in order, each to success.
    for c in spec.init_containers.iter().flatten() {
        let mut backoff = Duration::from_secs(1);
        loop {
            let mut status = base("Pending", Some(&ip));
            status["conditions"] = json!([
                cond("PodScheduled", true, None),
                cond("Initialized", false, Some("ContainersNotInitialized")),
                cond("Ready", false, Some("ContainersNotReady"))
            ]);
            patch_status(api, &name, &status, &mut last).await;
            let mut child = spawn(shared, &pod, c, dir, &netns, &ip).await?;
            let code = tokio::select! {
                s = child.wait() => s?.code().unwrap_or(-1),
                () = wait_end(pods, cancel) => {
                    let _ = child.start_kill();
                    return Ok(());
                }
            };
            if code == 0 {
                break;
            }
            warn!(pod = %name, container = %c.name, code, "init container failed; again");
            if ended(pods, cancel, backoff).await {
                return Ok(());
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    }

    let mut containers: Vec<Running> = spec
        .containers
        .iter()
        .map(|c| Running {
            name: c.name.clone(),
            image: c.image.clone().unwrap_or_default(),
            child: None,
            pid: 0,
            started_at: String::new(),
            restarts: 0,
            ready: false,
            last_exit: None,
            next_start: Instant::now(),
            probe_due: Instant::now(),
            readiness_failures: 0,
            liveness_failures: 0,
        })
        .collect();
    let restart_always = spec.restart_policy.as_deref().unwrap_or("Always") != "Never";
    let mut ready_since: Option<String> = None;
    let ttl = token_ttl(&pod);
    let mut next_sync = Instant::now() + VOLUME_SYNC;
    // Like the kubelet: a new token at 80 % of the old one's life.
    let mut next_token = ttl.map(|t| Instant::now() + t * 4 / 5);
    loop {
        let now_i = Instant::now();
        if now_i >= next_sync {
            next_sync = now_i + VOLUME_SYNC;
            let tokens = next_token.is_some_and(|due| now_i >= due);
            match prepare_volumes(shared, &pod, dir, true, tokens).await {
                Ok(()) if tokens => next_token = ttl.map(|t| now_i + t * 4 / 5),
                Ok(()) => {}
                Err(error) => {
                    warn!(pod = %name, error = format!("{error:#}"), "volume sync failed; the files stay as they were");
                }
            }
        }
        for (rt, c) in containers.iter_mut().zip(&spec.containers) {
            // Exited: record, then restart with a back-off.
            if let Some(child) = rt.child.as_mut()
                && let Ok(Some(exit)) = child.try_wait()
            {
                let code = exit.code().unwrap_or(137);
                warn!(pod = %name, container = %rt.name, code, "container exited");
                rt.last_exit = Some((code, now()));
                rt.child = None;
                rt.ready = false;
                let delay = Duration::from_secs(1 << rt.restarts.min(4));
                rt.next_start = now_i + delay;
                rt.restarts += 1;
            }
            if rt.child.is_none() && now_i >= rt.next_start && (rt.pid == 0 || restart_always) {
                if rt.pid != 0 {
                    // `kubectl logs --previous` reads the last instance's.
                    let log = dir.join(format!("{}.log", rt.name));
                    let _ = fs::rename(&log, dir.join(format!("{}.log.prev", rt.name)));
                }
                match spawn(shared, &pod, c, dir, &netns, &ip).await {
                    Ok(child) => {
                        rt.pid = child.id().unwrap_or(0);
                        rt.child = Some(child);
                        rt.started_at = now();
                        let delay = c
                            .readiness_probe
                            .as_ref()
                            .and_then(|p| p.initial_delay_seconds)
                            .unwrap_or(0);
                        rt.probe_due = Instant::now() + Duration::from_secs(delay.max(0) as u64);
                        rt.readiness_failures = 0;
                        rt.liveness_failures = 0;
                    }
                    Err(error) => {
                        warn!(pod = %name, container = %rt.name, error = format!("{error:#}"), "start failed");
                        rt.next_start = now_i + Duration::from_secs(2);
                    }
                }
            }
            if rt.child.is_some() && Instant::now() >= rt.probe_due {
                let period = c
                    .readiness_probe
                    .as_ref()
                    .and_then(|p| p.period_seconds)
                    .unwrap_or(10)
                    .clamp(1, 10);
                // Until ready, probe every second (the kubelet's period would only slow the
                // rollout); then at the manifest's period.
                let next = if rt.ready { period as u64 } else { 1 };
                rt.probe_due = Instant::now() + Duration::from_secs(next);
                match &c.readiness_probe {
                    Some(p) => {
                        if probe(c, p, &ip).await {
                            rt.readiness_failures = 0;
                            rt.ready = true;
                        } else {
                            rt.readiness_failures += 1;
                            if rt.readiness_failures >= p.failure_threshold.unwrap_or(3)
                                || !rt.ready
                            {
                                rt.ready = false;
                            }
                        }
                    }
                    None => rt.ready = true,
                }
                if let Some(p) = &c.liveness_probe {
                    let started = rt.started_at.parse::<jiff::Timestamp>().ok();
                    let age = started
                        .map(|s| jiff::Timestamp::now().duration_since(s).as_secs())
                        .unwrap_or(0);
                    if age >= i64::from(p.initial_delay_seconds.unwrap_or(0)) {
                        if probe(c, p, &ip).await {
                            rt.liveness_failures = 0;
                        } else {
                            rt.liveness_failures += 1;
                            if rt.liveness_failures >= p.failure_threshold.unwrap_or(3) {
                                warn!(pod = %name, container = %rt.name, "liveness probe failed: restarting");
                                signal(rt.pid, "KILL");
                            }
                        }
                    }
                }
            }
        }
        let all_ready = containers.iter().all(|c| c.ready);
        let all_running = containers.iter().all(|c| c.child.is_some());
        if all_ready && ready_since.is_none() {
            ready_since = Some(now());
        } else if !all_ready {
            ready_since = None;
        }
        let transition = ready_since.clone().unwrap_or_else(|| start_time.clone());
        let ready_cond = |t: &str| json!({ "type": t, "status": if all_ready { "True" } else { "False" }, "lastTransitionTime": transition });
        let mut status = base(
            if all_running || restart_always {
                "Running"
            } else {
                "Failed"
            },
            Some(&ip),
        );
        status["conditions"] = json!([
            cond("PodReadyToStartContainers", true, None),
            cond("Initialized", true, None),
            ready_cond("ContainersReady"),
            ready_cond("Ready"),
            cond("PodScheduled", true, None),
        ]);
        status["containerStatuses"] = Value::Array(
            containers
                .iter()
                .map(|rt| {
                    let state = if rt.child.is_some() {
                        json!({ "running": { "startedAt": rt.started_at } })
                    } else {
                        json!({ "waiting": { "reason": "CrashLoopBackOff", "message": "restarting" } })
                    };
                    let last_state = match &rt.last_exit {
                        Some((code, at)) => json!({ "terminated": { "exitCode": code, "finishedAt": at, "reason": if *code == 0 { "Completed" } else { "Error" } } }),
                        None => json!({}),
                    };
                    json!({ "name": rt.name, "image": rt.image, "imageID": format!("process://{}", rt.image),
                            "containerID": format!("process://{}", rt.pid), "ready": rt.ready,
                            "started": rt.child.is_some(), "restartCount": rt.restarts,
                            "state": state, "lastState": last_state })
                })
                .collect(),
        );
        patch_status(api, &name, &status, &mut last).await;

        let deleting = pods.borrow().metadata.deletion_timestamp.is_some();
        if deleting || cancel.is_cancelled() {
            let grace = if deleting {
                pods.borrow()
                    .metadata
                    .deletion_grace_period_seconds
                    .or(spec.termination_grace_period_seconds)
                    .unwrap_or(30)
            } else {
                10
            };
            stop_all(&mut containers, Duration::from_secs(grace.max(0) as u64)).await;
            return Ok(());
        }
        tokio::select! {
            () = cancel.cancelled() => {}
            _ = pods.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// SIGTERM to every container (preStop hooks are not run: they would act on the host), then
/// SIGKILL at the end of the grace period.
async fn stop_all(containers: &mut [Running], grace: Duration) {
    for rt in containers.iter() {
        if rt.child.is_some() {
            signal(rt.pid, "TERM");
        }
    }
    let deadline = Instant::now() + grace;
    for rt in containers.iter_mut() {
        if let Some(child) = rt.child.as_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, child.wait()).await.is_err() {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
    }
}

/// Waits until the Pod is deleted or the kubelet stops.
async fn wait_end(pods: &mut watch::Receiver<Pod>, cancel: &CancellationToken) {
    loop {
        if pods.borrow().metadata.deletion_timestamp.is_some() || cancel.is_cancelled() {
            return;
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = pods.changed() => if changed.is_err() { return },
        }
    }
}

/// Waits `bound`; `true` when the Pod was deleted or the kubelet stops meanwhile.
async fn ended(
    pods: &mut watch::Receiver<Pod>,
    cancel: &CancellationToken,
    bound: Duration,
) -> bool {
    tokio::time::timeout(bound, wait_end(pods, cancel))
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_images_map_to_binaries() {
        let bins = Path::new("/b");
        assert_eq!(
            image_entry(bins, "ghcr.io/haptic-rs/haptic-controller:0.1.0"),
            Some((bins.join("haptic-controller"), vec!["run".to_owned()]))
        );
        assert_eq!(
            image_entry(bins, "haptic-agent"),
            Some((bins.join("haptic-agent"), Vec::new()))
        );
        assert_eq!(
            image_entry(
                bins,
                "gcr.io/k8s-staging-gateway-api/echo-basic:v20260204-monthly-2026.01-60-g28382302"
            ),
            Some((bins.join("echo-basic"), Vec::new()))
        );
        assert_eq!(image_entry(bins, "nginx:1.27"), None);
        assert_eq!(image_entry(bins, "docker.io/library/haptic-agentx"), None);
    }

    #[test]
    fn addresses_are_not_reused_at_once() {
        let first = allocate().expect("one");
        let second = allocate().expect("two");
        assert_ne!(first, second);
        release(first);
        let third = allocate().expect("three");
        assert_ne!(third, first, "a released address waits its turn");
        assert!((2..=254).contains(&third));
        release(second);
        release(third);
    }

    #[test]
    fn variables_expand_like_the_kubelet() {
        let env = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        assert_eq!(expand("x$(A)y$(B)z", &env), "x1y$(B)z");
        assert_eq!(expand("$(A", &env), "$(A");
    }
}
