//! The acceptance scenarios: election with two replicas, an Ingress routing a real request
//! through HAProxy, graceful and crash failover, and disabled election. Every wait is bounded
//! and every API call has its own timeout.

use std::{future::Future, time::Duration};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::{
    apps::v1::Deployment,
    coordination::v1::Lease,
    core::v1::{ConfigMap, Namespace, Pod, Service},
    networking::v1::Ingress,
};
use kube::{
    Api, Client,
    api::{
        ApiResource, DeleteParams, DynamicObject, ListParams, LogParams, Patch, PatchParams,
        PostParams,
    },
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::cluster::{Cluster, NAMESPACE};

const CONTROLLER: &str = "app.kubernetes.io/name=haptic-controller";
const LEASE: &str = "haptic-leader";
const CONFIG: &str = "haptic-config";
const APPS: &str = "e2e";
const HOST: &str = "e2e.haptic.test";
const CALL: Duration = Duration::from_secs(15);
const MINUTE: Duration = Duration::from_secs(60);

/// Runs every scenario in order; the first failure stops the run.
pub(crate) async fn run(cluster: &Cluster) -> Result<()> {
    let k = Kube::new(cluster);
    let mut passed = 0;
    let steps = [
        "two replicas: exactly one Lease holder, a controller pod that logs `leading`",
        "a real request through HAProxy, routed by an Ingress; status Valid, all pods live",
        "graceful failover: the leader pod deleted, the other leads and deploys a later change",
        "crash failover: the leader pod deleted with no grace, another leads and deploys",
        "disabled election, one replica: no Lease holder, still deploys",
    ];
    for (i, name) in steps.iter().enumerate() {
        eprintln!("e2e: scenario {}: {name}", i + 1);
        let result = match i {
            0 => election(&k).await,
            1 => ingress(&k).await,
            2 => failover(&k, None, "echo-2").await,
            3 => failover(&k, Some(0), "echo-1").await,
            _ => disabled(&k).await,
        };
        result.with_context(|| format!("scenario {}: {name}", i + 1))?;
        passed += 1;
        eprintln!("e2e: scenario {} passed", i + 1);
    }
    eprintln!("e2e: {passed}/{} scenarios passed", steps.len());
    Ok(())
}

/// The APIs the scenarios use.
struct Kube<'a> {
    cluster: &'a Cluster,
    client: Client,
    pods: Api<Pod>,
    leases: Api<Lease>,
    deployments: Api<Deployment>,
    configs: Api<DynamicObject>,
    ingresses: Api<Ingress>,
}

impl<'a> Kube<'a> {
    fn new(cluster: &'a Cluster) -> Self {
        let client = cluster.client.clone();
        let resource = ApiResource {
            group: "haproxy-haptic.org".to_owned(),
            version: "v1alpha1".to_owned(),
            api_version: "haproxy-haptic.org/v1alpha1".to_owned(),
            kind: "HAProxyTemplateConfig".to_owned(),
            plural: "haproxytemplateconfigs".to_owned(),
        };
        Self {
            cluster,
            pods: Api::namespaced(client.clone(), NAMESPACE),
            leases: Api::namespaced(client.clone(), NAMESPACE),
            deployments: Api::namespaced(client.clone(), NAMESPACE),
            configs: Api::namespaced_with(client.clone(), NAMESPACE, &resource),
            ingresses: Api::namespaced(client.clone(), APPS),
            client,
        }
    }

    /// Controller pods: (name, ready and not terminating) for every pod that exists.
    async fn controllers(&self) -> Result<Vec<(String, bool)>> {
        let list = call(self.pods.list(&ListParams::default().labels(CONTROLLER))).await?;
        Ok(list
            .items
            .into_iter()
            .map(|pod| {
                let ready = pod.metadata.deletion_timestamp.is_none()
                    && pod.status.as_ref().is_some_and(|status| {
                        status.phase.as_deref() == Some("Running")
                            && status
                                .conditions
                                .iter()
                                .flatten()
                                .any(|c| c.type_ == "Ready" && c.status == "True")
                    });
                (pod.metadata.name.unwrap_or_default(), ready)
            })
            .collect())
    }

    /// Exactly `n` controller pods exist, all ready: their names.
    async fn wait_controllers(&self, n: usize) -> Result<Vec<String>> {
        wait_for(
            &format!("exactly {n} ready controller pods"),
            5 * MINUTE,
            || async {
                let pods = self.controllers().await?;
                Ok((pods.len() == n && pods.iter().all(|(_, ready)| *ready))
                    .then(|| pods.into_iter().map(|(name, _)| name).collect()))
            },
        )
        .await
    }

    /// The Lease's holder, if any.
    async fn holder(&self) -> Result<Option<String>> {
        let lease = call(self.leases.get_opt(LEASE)).await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }

    async fn logs(&self, pod: &str) -> Result<String> {
        let params = LogParams {
            container: Some("haptic-controller".to_owned()),
            ..LogParams::default()
        };
        call(self.pods.logs(pod, &params)).await
    }

    /// Waits until `pod` has logged that it leads.
    async fn wait_logged_leading(&self, pod: &str) -> Result<()> {
        let line = format!("leading identity={pod}");
        wait_for(&format!("{pod} logs `{line}`"), MINUTE, || async {
            Ok(self.logs(pod).await?.contains(&line).then_some(()))
        })
        .await
    }

    async fn scale(&self, deployment: &str, replicas: u32) -> Result<()> {
        let patch = json!({ "spec": { "replicas": replicas } });
        call(
            self.deployments
                .patch(deployment, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await?;
        Ok(())
    }

    /// Points the e2e Ingress at Service `backend`, creating it the first time.
    async fn route_to(&self, backend: &str) -> Result<()> {
        let ingress: Ingress = serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "metadata": { "name": "e2e", "namespace": APPS },
            "spec": {
                "ingressClassName": "haproxy",
                "rules": [{
                    "host": HOST,
                    "http": { "paths": [{
                        "path": "/",
                        "pathType": "Prefix",
                        "backend": { "service": { "name": backend, "port": { "number": 80 } } },
                    }]},
                }],
            },
        }))?;
        let params = PatchParams::apply("haptic-e2e").force();
        call(
            self.ingresses
                .patch("e2e", &params, &Patch::Apply(&ingress)),
        )
        .await?;
        Ok(())
    }

    /// Waits until a request for the e2e host through HAProxy (the kind port mapping, or on
    /// the local cluster a ready endpoint of the haproxy Service) is answered 200 by `backend`.
    async fn wait_served_by(&self, backend: &str, bound: Duration) -> Result<()> {
        wait_for(
            &format!("GET / (Host: {HOST}) through HAProxy answered by {backend}"),
            bound,
            || async {
                let (host, port) = self.cluster.http_endpoint().await?;
                let (status, body) = http_get(&host, port, HOST).await?;
                if status == 200 && body.trim() == backend {
                    return Ok(Some(()));
                }
                bail!("answered {status}: {}", body.trim())
            },
        )
        .await
    }

    async fn config_status(&self) -> Result<Value> {
        let htc = call(self.configs.get(CONFIG)).await?;
        Ok(htc.data.get("status").cloned().unwrap_or(Value::Null))
    }
}

async fn election(k: &Kube<'_>) -> Result<()> {
    let pods = k.wait_controllers(2).await?;
    let holder = wait_for(
        "a Lease holder that is a controller pod",
        2 * MINUTE,
        || async { Ok(k.holder().await?.filter(|h| pods.contains(h))) },
    )
    .await?;
    k.wait_logged_leading(&holder).await?;
    for pod in pods.iter().filter(|p| **p != holder) {
        let logs = k.logs(pod).await?;
        ensure!(
            !logs.contains(&format!("leading identity={pod}")),
            "follower {pod} logged that it leads while {holder} holds the Lease"
        );
    }
    let holders: Vec<String> = call(k.leases.list(&ListParams::default()))
        .await?
        .items
        .into_iter()
        .filter_map(|l| l.spec.and_then(|s| s.holder_identity))
        .filter(|h| pods.contains(h))
        .collect();
    ensure!(
        holders == [holder.clone()],
        "controller pods hold {holders:?}, expected exactly [{holder}]"
    );
    eprintln!("e2e: {holder} leads; {} follows", pods.len() - 1);
    Ok(())
}

async fn ingress(k: &Kube<'_>) -> Result<()> {
    create_backends(k).await?;
    k.route_to("echo-1").await?;
    k.wait_served_by("echo-1", 3 * MINUTE).await?;
    // The leader writes the status debounced: it may trail the first request by a moment.
    wait_for(
        "HTC status Valid and Deployed: AllPodsLive",
        MINUTE,
        || async {
            let status = k.config_status().await?;
            let deployed = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Deployed" && c["reason"] == "AllPodsLive");
            if status["validationStatus"] == "Valid" && deployed {
                return Ok(Some(()));
            }
            bail!("status {status}")
        },
    )
    .await?;
    Ok(())
}

/// Deletes the leader pod (`grace` 0: a crash, the Lease expires) and checks another
/// controller leads and deploys a change.
async fn failover(k: &Kube<'_>, grace: Option<u32>, next: &str) -> Result<()> {
    let pods = k.wait_controllers(2).await?;
    let old = k
        .holder()
        .await?
        .context("no Lease holder before the failover")?;
    ensure!(
        pods.contains(&old),
        "{old} holds the Lease but is not a controller pod"
    );
    let params = DeleteParams {
        grace_period_seconds: grace,
        ..DeleteParams::default()
    };
    call(k.pods.delete(&old, &params)).await?;
    // Graceful: the Lease is released and the follower, watching it, takes it at once. A crash:
    // LeaseDuration (30 s) after the last renewal.
    let bound = if grace == Some(0) { 2 * MINUTE } else { MINUTE };
    let new = wait_for("another controller pod holds the Lease", bound, || async {
        Ok(k.holder().await?.filter(|h| *h != old))
    })
    .await?;
    let now: Vec<String> = k.controllers().await?.into_iter().map(|(n, _)| n).collect();
    ensure!(
        now.contains(&new),
        "{new} holds the Lease but is not a controller pod"
    );
    if grace.is_none() {
        ensure!(
            pods.contains(&new),
            "the replacement pod {new} leads, not the follower that was running"
        );
    }
    k.wait_logged_leading(&new).await?;
    k.route_to(next).await?;
    k.wait_served_by(next, 2 * MINUTE).await?;
    eprintln!("e2e: {old} deleted, {new} leads and deployed the route to {next}");
    Ok(())
}

/// `controller.leaderElection.enabled: false` with one replica. The controller reads the
/// election settings at start, so it restarts; and in disabled mode it writes at epoch 0,
/// below the fence the elected leaders raised on the agents, so the HAProxy pods restart
/// too (a fresh data directory, fence 0) before it starts.
async fn disabled(k: &Kube<'_>) -> Result<()> {
    let patch = json!({ "spec": { "controller": { "leaderElection": { "enabled": false } } } });
    call(
        k.configs
            .patch(CONFIG, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await?;
    k.scale("haptic-controller", 0).await?;
    k.wait_controllers(0).await?;
    let holder = k.holder().await?;
    ensure!(
        holder.is_none(),
        "the last leader did not release the Lease: {holder:?}"
    );
    k.cluster
        .kubectl(
            &["-n", NAMESPACE, "rollout", "restart", "deployment/haproxy"],
            MINUTE,
        )
        .show()
        .await?;
    k.cluster
        .kubectl(
            &[
                "-n",
                NAMESPACE,
                "rollout",
                "status",
                "deployment/haproxy",
                "--timeout",
                "300s",
            ],
            6 * MINUTE,
        )
        .show()
        .await?;
    k.scale("haptic-controller", 1).await?;
    let pod = k.wait_controllers(1).await?.remove(0);
    wait_for(
        &format!("{pod} logs that election is disabled"),
        MINUTE,
        || async {
            Ok(k.logs(&pod)
                .await?
                .contains("leader election disabled")
                .then_some(()))
        },
    )
    .await?;
    k.route_to("echo-2").await?;
    k.wait_served_by("echo-2", 2 * MINUTE).await?;
    let holder = k.holder().await?;
    ensure!(
        holder.is_none(),
        "disabled election, yet the Lease is held by {holder:?}"
    );
    eprintln!("e2e: {pod} deploys with election disabled and no Lease holder");
    Ok(())
}

/// Two backends in namespace e2e, `echo-1` and `echo-2`, each an HAProxy (from the agent
/// image already loaded into kind, so nothing is pulled) answering its own name.
async fn create_backends(k: &Kube<'_>) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(k.client.clone());
    let ns: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": APPS },
    }))?;
    call(namespaces.create(&PostParams::default(), &ns)).await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(k.client.clone(), APPS);
    let deployments: Api<Deployment> = Api::namespaced(k.client.clone(), APPS);
    let services: Api<Service> = Api::namespaced(k.client.clone(), APPS);
    for name in ["echo-1", "echo-2"] {
        let labels = json!({ "app.kubernetes.io/name": name });
        let config = format!(
            "global\n    log stdout format raw local0\ndefaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\nfrontend echo\n    bind :8080\n    http-request return status 200 content-type text/plain string \"{name}\"\n"
        );
        let cm: ConfigMap = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": name, "namespace": APPS },
            "data": { "haproxy.cfg": config },
        }))?;
        call(configmaps.create(&PostParams::default(), &cm)).await?;
        let deployment: Deployment = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": name, "namespace": APPS },
            "spec": {
                "replicas": 1,
                "selector": { "matchLabels": labels },
                "template": {
                    "metadata": { "labels": labels },
                    "spec": {
                        "securityContext": {
                            "runAsNonRoot": true, "runAsUser": 10001,
                            "seccompProfile": { "type": "RuntimeDefault" },
                        },
                        "containers": [{
                            "name": "echo",
                            "image": k.cluster.agent_image,
                            "command": ["/usr/sbin/haproxy", "-f", "/etc/echo/haproxy.cfg"],
                            "ports": [{ "name": "http", "containerPort": 8080 }],
                            "readinessProbe": { "tcpSocket": { "port": "http" }, "periodSeconds": 2 },
                            "securityContext": {
                                "allowPrivilegeEscalation": false,
                                "readOnlyRootFilesystem": true,
                                "capabilities": { "drop": ["ALL"] },
                            },
                            "volumeMounts": [{ "name": "config", "mountPath": "/etc/echo" }],
                        }],
                        "volumes": [{ "name": "config", "configMap": { "name": name } }],
                    },
                },
            },
        }))?;
        call(deployments.create(&PostParams::default(), &deployment)).await?;
        let service: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": name, "namespace": APPS },
            "spec": {
                "selector": labels,
                "ports": [{ "name": "http", "port": 80, "targetPort": "http" }],
            },
        }))?;
        call(services.create(&PostParams::default(), &service)).await?;
    }
    for name in ["echo-1", "echo-2"] {
        k.cluster
            .kubectl(
                &[
                    "-n",
                    APPS,
                    "rollout",
                    "status",
                    &format!("deployment/{name}"),
                    "--timeout",
                    "180s",
                ],
                4 * MINUTE,
            )
            .show()
            .await?;
    }
    Ok(())
}

/// One API call, bounded.
async fn call<T>(request: impl Future<Output = kube::Result<T>>) -> Result<T> {
    tokio::time::timeout(CALL, request)
        .await
        .with_context(|| format!("an API call took over {CALL:?}"))?
        .map_err(anyhow::Error::from)
}

/// Polls `probe` every second until it yields a value, for at most `bound`; the last error
/// is part of the failure.
async fn wait_for<T, F, Fut>(what: &str, bound: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + bound;
    let mut last = None;
    loop {
        match tokio::time::timeout(CALL, probe()).await {
            Ok(Ok(Some(value))) => return Ok(value),
            Ok(Ok(None)) => {}
            Ok(Err(error)) => last = Some(format!("{error:#}")),
            Err(_) => last = Some(format!("a probe took over {CALL:?}")),
        }
        if tokio::time::Instant::now() >= deadline {
            match last {
                Some(last) => bail!("{what}: not within {bound:?} (last: {last})"),
                None => bail!("{what}: not within {bound:?}"),
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `GET /` with `Host: host` on `address:port`: the status code and the body.
async fn http_get(address: &str, port: u16, host: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect((address, port))
        .await
        .with_context(|| format!("connecting to {address}:{port}"))?;
    let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no HTTP status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
