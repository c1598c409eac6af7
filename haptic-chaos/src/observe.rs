//! What runs beside the system during a run: the Lease watcher (history of holders and
//! epochs), the traffic prober (HAProxy keeps serving), the writer (Ingresses and endpoints
//! keep changing), and the shared timeline.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::StreamExt as _;
use k8s_openapi::api::{
    coordination::v1::Lease, discovery::v1::EndpointSlice, networking::v1::Ingress,
};
use kube::{
    Api,
    api::{DeleteParams, PostParams},
    runtime::{WatchStreamExt as _, watcher},
};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    check::Claims,
    fleet::{self, CANARY_HOST, Fleet, LEASE, NS},
};

/// Wall-clock milliseconds since the Unix epoch (the agents' journals use the same clock).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Events of a run, stamped with wall-clock ms.
#[derive(Debug, Clone, Default)]
pub(crate) struct Timeline(Arc<Mutex<Vec<(u64, String)>>>);

impl Timeline {
    pub(crate) fn push(&self, what: impl Into<String>) {
        lock(&self.0).push((now_ms(), what.into()));
    }

    /// An event that happened at `at` (wall ms), as another process recorded it.
    pub(crate) fn push_at(&self, at: u64, what: impl Into<String>) {
        lock(&self.0).push((at, what.into()));
    }

    pub(crate) fn entries(&self) -> Vec<(u64, String)> {
        lock(&self.0).clone()
    }
}

/// The Lease history as the runner saw it.
#[derive(Debug, Clone)]
pub(crate) struct LeaseWatch {
    pub(crate) claims: Arc<Mutex<Claims>>,
    pub(crate) holder: watch::Receiver<Option<String>>,
    /// The resourceVersion of the last Lease event seen (0 before any).
    pub(crate) seen: watch::Receiver<u64>,
}

impl LeaseWatch {
    /// Waits (at most `bound`) until the watch has seen the Lease as the API holds it now, so
    /// that no claim is missing when the journals are judged. False when it has not.
    pub(crate) async fn caught_up(&self, client: &kube::Client, bound: Duration) -> bool {
        let api: Api<Lease> = Api::namespaced(client.clone(), NS);
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let current = match api.get_opt(LEASE).await {
                // A deleted Lease: nothing newer to see.
                Ok(None) => return true,
                Ok(Some(lease)) => lease
                    .metadata
                    .resource_version
                    .and_then(|rv| rv.parse::<u64>().ok())
                    .unwrap_or(0),
                Err(_) => u64::MAX,
            };
            if *self.seen.borrow() >= current {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Retries a cut watch every 100 ms: the observer must not sit in a long backoff after an
/// outage while claims are made.
struct Quick;

impl Iterator for Quick {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_millis(100))
    }
}

impl kube::runtime::utils::Backoff for Quick {
    fn reset(&mut self) {}
}

/// Watches the Lease (as client `chaos-observer`, which no fault targets; only an API outage
/// cuts it, and then nobody can write) until `token` fires. Every change of the epoch
/// annotation is a claim of that epoch by the holder named in the same object.
pub(crate) fn watch_lease(
    system: &Fleet,
    timeline: Timeline,
    token: CancellationToken,
) -> anyhow::Result<(LeaseWatch, tokio::task::JoinHandle<()>)> {
    let client = system.server.client_for("chaos-observer")?;
    let api: Api<Lease> = Api::namespaced(client, NS);
    let claims = Arc::new(Mutex::new(Claims::new()));
    let (holder_tx, holder) = watch::channel(None);
    let (seen_tx, seen) = watch::channel(0u64);
    let task = tokio::spawn({
        let claims = claims.clone();
        async move {
            let config = watcher::Config::default().fields(&format!("metadata.name={LEASE}"));
            let stream = watcher(api, config).backoff(Quick);
            futures::pin_mut!(stream);
            let mut last: (Option<String>, Option<u64>) = (None, None);
            loop {
                let event = tokio::select! {
                    () = token.cancelled() => return,
                    event = stream.next() => event,
                };
                let Some(event) = event else { return };
                let (lease, deleted) = match event {
                    Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                        (lease, false)
                    }
                    Ok(watcher::Event::Delete(lease)) => (lease, true),
                    Ok(_) | Err(_) => continue,
                };
                if let Some(rv) = lease
                    .metadata
                    .resource_version
                    .as_deref()
                    .and_then(|rv| rv.parse::<u64>().ok())
                {
                    seen_tx.send_modify(|seen| *seen = (*seen).max(rv));
                }
                if deleted {
                    timeline.push("lease deleted (observed)");
                    last = (None, None);
                    let _ = holder_tx.send(None);
                    continue;
                }
                let name = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .filter(|h| !h.is_empty());
                let epoch = lease
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("haptic.io/leader-epoch"))
                    .and_then(|e| e.parse::<u64>().ok());
                if let (Some(holder), Some(e)) = (&name, epoch)
                    && epoch != last.1
                {
                    lock(&claims).entry(e).or_default().insert(holder.clone());
                    timeline.push(format!("lease: {holder} claims epoch {e}"));
                } else if name != last.0 {
                    timeline.push(format!(
                        "lease: holder {} at epoch {}",
                        name.as_deref().unwrap_or("(none)"),
                        epoch.map_or("-".to_owned(), |e| e.to_string())
                    ));
                }
                last = (name.clone(), epoch);
                let _ = holder_tx.send(name);
            }
        }
    });
    Ok((
        LeaseWatch {
            claims,
            holder,
            seen,
        },
        task,
    ))
}

/// Canary probes through each agent's HAProxy: (wall ms, answered by the canary backend).
pub(crate) type Probes = Arc<Mutex<Vec<Vec<(u64, bool)>>>>;

/// Probes every agent's HAProxy every 200 ms with the Ingress nobody changes, until `token`.
pub(crate) fn probe(
    system: &Fleet,
    token: CancellationToken,
) -> (Probes, tokio::task::JoinHandle<()>) {
    let addrs: Vec<String> = (0..system.agents.len())
        .map(|i| system.http_addr(i))
        .collect();
    let probes: Probes = Arc::new(Mutex::new(vec![Vec::new(); addrs.len()]));
    let task = tokio::spawn({
        let probes = probes.clone();
        async move {
            loop {
                let round = futures::future::join_all(addrs.iter().map(|addr| async move {
                    let at = now_ms();
                    let ok = fleet::http_get(addr, CANARY_HOST)
                        .await
                        .is_some_and(|(status, body)| status == 200 && body == "backend canary");
                    (at, ok)
                }));
                let results = tokio::select! {
                    () = token.cancelled() => return,
                    results = round => results,
                };
                {
                    let mut probes = lock(&probes);
                    for (i, result) in results.into_iter().enumerate() {
                        probes[i].push(result);
                    }
                }
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        }
    });
    (probes, task)
}

/// Keeps changing Ingresses and endpoints through the API (as client `chaos-writer`) every
/// 300-900 ms until `token`: which Service `shop` and `blog` route to, which backend Service
/// `web-c`'s endpoints point at, and extra Ingresses created and deleted. Returns how many
/// writes were made and how many failed (an API outage).
pub(crate) fn write(
    system: &Fleet,
    seed: u64,
    timeline: Timeline,
    token: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<(u32, u32)>> {
    let client = system.server.client_for("chaos-writer")?;
    let ingresses: Api<Ingress> = Api::namespaced(client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(client, NS);
    let backends: BTreeMap<&'static str, std::net::SocketAddr> =
        system.backends.iter().map(|(n, b)| (*n, b.addr)).collect();
    Ok(tokio::spawn(async move {
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut writes, mut failed) = (0, 0);
        let mut extras: Vec<u32> = Vec::new();
        let mut next_extra = 1;
        loop {
            let pause = Duration::from_millis(rng.random_range(300..900));
            tokio::select! {
                () = token.cancelled() => return (writes, failed),
                () = tokio::time::sleep(pause) => {}
            }
            let services = ["web-a", "web-b", "web-c"];
            let (what, result) = match rng.random_range(0..4) {
                0 | 1 => {
                    let (name, host) = if rng.random_bool(0.5) {
                        ("shop", "shop.chaos.test")
                    } else {
                        ("blog", "blog.chaos.test")
                    };
                    let service = services[rng.random_range(0..services.len())];
                    let result = match fleet::ingress(name, host, service) {
                        Ok(object) => replace(&ingresses, name, object).await,
                        Err(error) => Err(error),
                    };
                    (format!("write: ingress {name} -> {service}"), result)
                }
                2 => {
                    let to = if rng.random_bool(0.5) { "a" } else { "c" };
                    let result = match backends
                        .get(to)
                        .ok_or_else(|| anyhow::anyhow!("no backend {to}"))
                        .and_then(|addr| fleet::slice("web-c", *addr))
                    {
                        Ok(object) => replace(&slices, "web-c-1", object).await,
                        Err(error) => Err(error),
                    };
                    (format!("write: endpoints of web-c -> backend {to}"), result)
                }
                _ => {
                    if extras.len() < 3 && (extras.is_empty() || rng.random_bool(0.5)) {
                        let n = next_extra;
                        next_extra += 1;
                        let name = format!("extra-{n}");
                        let host = format!("extra-{n}.chaos.test");
                        let result = match fleet::ingress(&name, &host, "web-b") {
                            Ok(object) => ingresses
                                .create(&PostParams::default(), &object)
                                .await
                                .map(|_| ())
                                .map_err(anyhow::Error::from),
                            Err(error) => Err(error),
                        };
                        if result.is_ok() {
                            extras.push(n);
                        }
                        (format!("write: create ingress {name}"), result)
                    } else {
                        let n = extras.remove(rng.random_range(0..extras.len()));
                        let name = format!("extra-{n}");
                        let result = ingresses
                            .delete(&name, &DeleteParams::default())
                            .await
                            .map(|_| ())
                            .map_err(anyhow::Error::from);
                        if result.is_err() {
                            extras.push(n);
                        }
                        (format!("write: delete ingress {name}"), result)
                    }
                }
            };
            writes += 1;
            match result {
                Ok(()) => timeline.push(what),
                Err(error) => {
                    failed += 1;
                    timeline.push(format!("{what} failed: {error}"));
                }
            }
        }
    }))
}

/// GET then PUT with the resourceVersion read (a plain replace, as kubectl would).
async fn replace<K>(api: &Api<K>, name: &str, mut object: K) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let current = api.get(name).await?;
    object.meta_mut().resource_version = current.meta().resource_version.clone();
    api.replace(name, &PostParams::default(), &object).await?;
    Ok(())
}
