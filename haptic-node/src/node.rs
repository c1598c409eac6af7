//! The process kubelet's loop: registers the Node and keeps its Ready condition fresh, binds
//! every unscheduled Pod to itself (one node: no scheduler is needed to choose), and owns one
//! task per Pod bound here ([`crate::pod`]). A Pod gone from the API, or deleted, is stopped
//! and cleaned; SIGTERM stops every Pod and exits.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Binding, Node, Pod};
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info, warn};

use crate::{Flags, cluster::NODE_NAME, net, pod};

/// What every Pod task shares.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) client: kube::Client,
    pub(crate) state: PathBuf,
    pub(crate) bins: PathBuf,
    pub(crate) api_host: String,
    pub(crate) api_port: String,
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

async fn register(nodes: &Api<Node>) -> Result<()> {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": NODE_NAME, "labels": {
            "kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": std::env::consts::ARCH,
        }},
    }))?;
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => return Err(error).context("registering the Node"),
    }
    Ok(())
}

async fn heartbeat(nodes: &Api<Node>, kubelet_port: u16) -> Result<()> {
    let now = now();
    let ready = |type_: &str, status: &str, reason: &str| {
        json!({ "type": type_, "status": status, "reason": reason, "message": reason,
                "lastHeartbeatTime": now, "lastTransitionTime": now })
    };
    let status = json!({ "status": {
        "addresses": [
            { "type": "InternalIP", "address": net::BRIDGE_IP },
            { "type": "Hostname", "address": NODE_NAME },
        ],
        "daemonEndpoints": { "kubeletEndpoint": { "Port": kubelet_port } },
        "capacity": { "cpu": "8", "memory": "16Gi", "pods": "250" },
        "allocatable": { "cpu": "8", "memory": "16Gi", "pods": "250" },
        "conditions": [
            ready("Ready", "True", "ProcessKubeletReady"),
            ready("MemoryPressure", "False", "ProcessKubeletHasSufficientMemory"),
            ready("DiskPressure", "False", "ProcessKubeletHasNoDiskPressure"),
            ready("PIDPressure", "False", "ProcessKubeletHasSufficientPID"),
        ],
        "nodeInfo": {
            "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
            "osImage": "haptic process kubelet", "containerRuntimeVersion": "process://",
            "kubeletVersion": "v1.34.4", "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": std::env::consts::ARCH,
        },
    }});
    // Conditions are merged by type in a strategic merge patch: the timestamps move on.
    nodes
        .patch_status(
            NODE_NAME,
            &PatchParams::default(),
            &Patch::Strategic(status),
        )
        .await
        .context("updating the Node's status")?;
    Ok(())
}

/// The `agent` command.
pub(crate) async fn run(flags: &Flags) -> Result<()> {
    let state = flags.path("state")?;
    let bins = flags.path("bins")?;
    let server = std::fs::read_to_string(state.join("server")).context("reading state/server")?;
    let (api_host, api_port) = server
        .trim()
        .split_once(' ')
        .context("state/server is `HOST PORT`")?;
    let client = crate::cluster::client(&state).await?;
    let shared = Shared {
        client: client.clone(),
        state: state.clone(),
        bins,
        api_host: api_host.to_owned(),
        api_port: api_port.to_owned(),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let (listener, kubelet_port, acceptor) = crate::kubelet::bind(&state).await?;
    register(&nodes).await?;
    heartbeat(&nodes, kubelet_port).await?;
    info!(node = NODE_NAME, kubelet_port, "registered");

    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    tracker.spawn(crate::kubelet::serve(
        state.clone(),
        listener,
        acceptor,
        token.clone(),
    ));
    {
        let token = token.clone();
        tracker.spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(term) => term,
                    Err(error) => {
                        warn!(%error, "no SIGTERM handler");
                        return;
                    }
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            info!("stopping every Pod");
            token.cancel();
        });
    }
    {
        let token = token.clone();
        let nodes = nodes.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
                if let Err(error) = heartbeat(&nodes, kubelet_port).await {
                    warn!(error = format!("{error:#}"), "heartbeat failed");
                }
            }
        });
    }

    let pods: Api<Pod> = Api::all(client.clone());
    let mut running: HashMap<String, (watch::Sender<Pod>, CancellationToken)> = HashMap::new();
    loop {
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                let mut seen = Vec::new();
                for p in list.items {
                    let Some(uid) = p.metadata.uid.clone() else {
                        continue;
                    };
                    let spec = p.spec.as_ref();
                    let node = spec.and_then(|s| s.node_name.clone());
                    if node.is_none() && p.metadata.deletion_timestamp.is_none() {
                        bind(&client, &p).await;
                        continue;
                    }
                    if node.as_deref() != Some(NODE_NAME) {
                        continue;
                    }
                    seen.push(uid.clone());
                    if let Some((sender, _)) = running.get(&uid) {
                        sender.send_replace(p);
                    } else if p.metadata.deletion_timestamp.is_some() {
                        // Nothing of it runs here (a restart of the kubelet): it can go.
                        forget(&client, &p).await;
                    } else if !pod::finished(&p) {
                        let (sender, receiver) = watch::channel(p);
                        let cancel = token.child_token();
                        tracker.spawn(pod::run(shared.clone(), receiver, cancel.clone()));
                        running.insert(uid, (sender, cancel));
                    }
                }
                // Gone from the API with no deletion seen (a force delete, grace 0): the
                // kubelet's answer is a kill, not a graceful stop.
                running.retain(|uid, (sender, _)| {
                    if !seen.contains(uid)
                        && sender.borrow().metadata.deletion_grace_period_seconds != Some(0)
                    {
                        sender.send_modify(|p| {
                            p.metadata.deletion_timestamp =
                                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                                    jiff::Timestamp::now(),
                                ));
                            p.metadata.deletion_grace_period_seconds = Some(0);
                        });
                    }
                    !sender.is_closed()
                });
            }
            Err(error) => warn!(%error, "listing Pods failed"),
        }
        tokio::select! {
            () = token.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(12), tracker.wait())
        .await
        .is_err()
    {
        warn!("some Pods did not stop in time; `down` cleans what is left");
    }
    Ok(())
}

async fn forget(client: &kube::Client, p: &Pod) {
    let (Some(name), Some(ns)) = (p.metadata.name.as_deref(), p.metadata.namespace.as_deref())
    else {
        return;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let params = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..kube::api::DeleteParams::default()
    };
    if let Err(error) = api.delete(name, &params).await {
        warn!(%error, pod = %format!("{ns}/{name}"), "final delete failed");
    }
}

async fn bind(client: &kube::Client, p: &Pod) {
    let (Some(name), Some(ns)) = (p.metadata.name.as_deref(), p.metadata.namespace.as_deref())
    else {
        return;
    };
    let binding: Binding = match serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": { "name": name, "namespace": ns },
        "target": { "apiVersion": "v1", "kind": "Node", "name": NODE_NAME },
    })) {
        Ok(b) => b,
        Err(error) => {
            warn!(%error, "building a Binding");
            return;
        }
    };
    let api: Api<Binding> = Api::namespaced(client.clone(), ns);
    let request = kube::core::Request::new(format!("/api/v1/namespaces/{ns}/pods"));
    let result = async {
        let body = serde_json::to_vec(&binding)?;
        let req = request.create_subresource("binding", name, &PostParams::default(), body)?;
        client.request::<serde_json::Value>(req).await?;
        anyhow::Ok(())
    }
    .await;
    drop(api);
    match result {
        Ok(()) => info!(pod = %format!("{ns}/{name}"), node = NODE_NAME, "bound"),
        Err(error) => {
            warn!(pod = %format!("{ns}/{name}"), error = format!("{error:#}"), "binding failed")
        }
    }
}
