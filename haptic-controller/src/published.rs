//! Published configs (leader only): the set the render gate let through, written back to the
//! cluster as HAPTIC shapes it, so `kubectl get haproxycfg` shows what the fleet runs.
//!
//! | kind (short name) | holds | named |
//! | --- | --- | --- |
//! | `HAProxyCfg` (`hpcfg`) | `haproxy.cfg` | the HTC's name |
//! | `HAProxyMapFile` (`hpmap`) | each `maps/*` file that is not a crt-list | `<htc>-<file>` |
//! | `HAProxyCRTListFile` (`hpcrtl`) | each file `haproxy.cfg` names after `crt-list` | `<htc>-<file>` |
//! | `HAProxyGeneralFile` (`hpfile`) | every other file (`files.*`) | `<htc>-<path>` |
//!
//! Every object carries `checksum: sha256:<hex>` of its content, the labels
//! `app.kubernetes.io/managed-by: haptic-controller` and `haproxy-haptic.org/config: <htc>`, and
//! an owner reference: the HAProxyCfg is owned by the HTC, the others by the HAProxyCfg (a
//! deleted HTC takes them all). Content above [`COMPRESS_ABOVE`] bytes is zstd-compressed and
//! base64-encoded, with `compressed: true`. `status.deployedToPods[]` lists each pod with the
//! set checksum it runs and since when.
//!
//! Certificates and keys never go into a CR: files under `ssl/`, `.pem`/`.key` files and any
//! file holding a PEM private key are listed in the HAProxyCfg's
//! `status.auxiliaryFiles.sslCertificates` by path and checksum only.
//!
//! Nothing is written when nothing changed: each object is compared by checksum with what this
//! term wrote, and on a new term with what the cluster holds. Of several sets in a row only
//! the newest is published, once no newer set came for half a second (`QUIET`; ten seconds
//! after the first at the latest, `LATEST`), and a publication rests three times as long as
//! the last one took before the next (`REST_FACTOR`): the published objects follow the fleet,
//! not each set, and are not built and written in the middle of a stream of changes.
//! Writes are server-side applies with field manager [`FIELD_MANAGER`]; only a leader whose
//! Lease is fresh writes; a failed write is retried with backoff; an object too large for the
//! API even compressed is skipped with a warning.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    time::{Duration, SystemTime},
};

use base64::Engine as _;
use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{
    Client, CustomResource, CustomResourceExt, Resource,
    api::{Api, DeleteParams, ListParams, Patch, PatchParams},
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::json;
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use crate::{
    crd::HAProxyTemplateConfig,
    events::{ControllerEvent, DeploymentReport, Kind, PodOutcome, RenderedSet},
};

/// The field manager of every published object.
pub const FIELD_MANAGER: &str = "haptic";
/// After a publication that took `t` (the set's objects built, compressed and written), the
/// next starts no sooner than `t` times this later: at 10,000 Ingresses building them is
/// ~100 ms of a core (a 7 MB `haproxy.cfg` compressed), and during a stream of changes it ran
/// for every set, beside the changes. The newest set is the one published.
const REST_FACTOR: u32 = 3;
/// A set is published once no newer one came for this long (a stream of changes is
/// published when it pauses), and [`LATEST`] after it came at the latest. Building and
/// writing a 7 MB `haproxy.cfg` is a burst of work on both sides: the controller compresses
/// it, the API server decodes, applies and stores a megabyte; published in the middle of a
/// stream of changes (a quarter of the time, by [`REST_FACTOR`] alone), it delayed the
/// change that came meanwhile by 40-90 ms on a 2-core node (one change in five of a stream
/// of endpoint changes at 10,000 Ingresses, `bench_controller`).
const QUIET: Duration = Duration::from_millis(500);
/// The longest a set waits to be published while newer ones keep coming.
const LATEST: Duration = Duration::from_secs(10);
/// Content larger than this is published zstd-compressed and base64-encoded.
pub const COMPRESS_ABOVE: usize = 1024 * 1024;
/// An object whose content is still larger than this once compressed is not published (the
/// API server's request limit is about 1.5 MiB).
pub const PUBLISH_MAX: usize = 1400 * 1024;
/// The label naming the HTC a published object belongs to.
pub const CONFIG_LABEL: &str = "haproxy-haptic.org/config";
const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "haptic-controller");

/// The rendered `haproxy.cfg` of an HTC.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "haproxy-haptic.org",
    version = "v1alpha1",
    kind = "HAProxyCfg",
    plural = "haproxycfgs",
    shortname = "hpcfg",
    namespaced,
    status = "PublishedStatus",
    printcolumn = r#"{"name":"Checksum","type":"string","jsonPath":".spec.setChecksum"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyCfgSpec {
    /// Where the file is, relative to the agent's live set directory.
    pub path: String,
    /// The content (zstd + base64 when `compressed`).
    pub content: String,
    /// `sha256:<hex>` of the uncompressed content.
    pub checksum: String,
    /// The checksum of the whole set (every file), as the agents report it.
    pub set_checksum: String,
    /// True when `content` is zstd-compressed and base64-encoded.
    #[serde(default)]
    pub compressed: bool,
}

/// A rendered map file.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "haproxy-haptic.org",
    version = "v1alpha1",
    kind = "HAProxyMapFile",
    plural = "haproxymapfiles",
    shortname = "hpmap",
    namespaced,
    status = "PublishedStatus",
    printcolumn = r#"{"name":"Map Name","type":"string","jsonPath":".spec.mapName"}"#,
    printcolumn = r#"{"name":"Path","type":"string","jsonPath":".spec.path"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyMapFileSpec {
    /// The key in the HTC's `maps`.
    pub map_name: String,
    /// Where the file is, relative to the agent's live set directory.
    pub path: String,
    /// The entries (zstd + base64 when `compressed`).
    pub entries: String,
    /// `sha256:<hex>` of the uncompressed entries.
    pub checksum: String,
    /// True when `entries` is zstd-compressed and base64-encoded.
    #[serde(default)]
    pub compressed: bool,
}

/// A rendered crt-list (certificate paths and their options; never a certificate).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "haproxy-haptic.org",
    version = "v1alpha1",
    kind = "HAProxyCRTListFile",
    plural = "haproxycrtlistfiles",
    shortname = "hpcrtl",
    namespaced,
    status = "PublishedStatus",
    printcolumn = r#"{"name":"Path","type":"string","jsonPath":".spec.path"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyCRTListFileSpec {
    /// The file's name.
    pub list_name: String,
    /// Where the file is, relative to the agent's live set directory.
    pub path: String,
    /// The entries (zstd + base64 when `compressed`).
    pub entries: String,
    /// `sha256:<hex>` of the uncompressed entries.
    pub checksum: String,
    /// True when `entries` is zstd-compressed and base64-encoded.
    #[serde(default)]
    pub compressed: bool,
}

/// Any other rendered file.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "haproxy-haptic.org",
    version = "v1alpha1",
    kind = "HAProxyGeneralFile",
    plural = "haproxygeneralfiles",
    shortname = "hpfile",
    namespaced,
    status = "PublishedStatus",
    printcolumn = r#"{"name":"Path","type":"string","jsonPath":".spec.path"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyGeneralFileSpec {
    /// The file's name.
    pub file_name: String,
    /// Where the file is, relative to the agent's live set directory.
    pub path: String,
    /// The content (zstd + base64 when `compressed`).
    pub content: String,
    /// `sha256:<hex>` of the uncompressed content.
    pub checksum: String,
    /// True when `content` is zstd-compressed and base64-encoded.
    #[serde(default)]
    pub compressed: bool,
}

/// Where a published file is live.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublishedStatus {
    /// The pods that run the set this file was published with: each pod's set checksum and
    /// since when it runs it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deployed_to_pods: Vec<PodDeployment>,
    /// HAProxyCfg only: the other published files, and the certificates by path and checksum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auxiliary_files: Option<AuxiliaryFiles>,
}

/// One pod's deployment.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodDeployment {
    /// The HAProxy pod.
    pub pod_name: String,
    /// `sha256:<hex>` of the set it runs.
    pub checksum: String,
    /// When the controller first saw it run that set (RFC 3339).
    pub deployed_at: String,
}

/// The files published beside an HAProxyCfg.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuxiliaryFiles {
    /// HAProxyMapFile names.
    #[serde(default)]
    pub map_files: Vec<String>,
    /// HAProxyCRTListFile names.
    #[serde(default)]
    pub crt_list_files: Vec<String>,
    /// HAProxyGeneralFile names.
    #[serde(default)]
    pub general_files: Vec<String>,
    /// Certificates and keys: path and checksum only.
    #[serde(default)]
    pub ssl_certificates: Vec<CertificateFile>,
}

/// A certificate file, never its content.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct CertificateFile {
    /// Its path in the set.
    pub path: String,
    /// `sha256:<hex>` of its content.
    pub checksum: String,
}

/// The CRDs of the published kinds.
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    vec![
        HAProxyCfg::crd(),
        HAProxyMapFile::crd(),
        HAProxyCRTListFile::crd(),
        HAProxyGeneralFile::crd(),
    ]
}

/// What a file of the set becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// `haproxy.cfg`.
    Main,
    /// A map file.
    Map,
    /// A crt-list.
    CrtList,
    /// Any other file.
    General,
    /// A certificate or key: never published.
    Certificate,
}

/// Sorts a file of the set; `crt_lists` are the paths `haproxy.cfg` names after `crt-list`.
pub fn classify(path: &str, content: &[u8], crt_lists: &BTreeSet<String>) -> Class {
    let holds_key = memchr::memmem::find(content, b"PRIVATE KEY-----").is_some();
    if path == "haproxy.cfg" {
        Class::Main
    } else if holds_key
        || path.starts_with("ssl/")
        || path.ends_with(".pem")
        || path.ends_with(".key")
        || path.ends_with(".crt")
    {
        Class::Certificate
    } else if crt_lists.contains(path) {
        Class::CrtList
    } else if path.starts_with("maps/") {
        Class::Map
    } else {
        Class::General
    }
}

/// The paths `haproxy.cfg` names after `crt-list` (quotes removed).
pub fn crt_lists(config: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in config.lines() {
        let mut words = line.split_whitespace();
        while let Some(word) = words.next() {
            if word == "crt-list"
                && let Some(path) = words.next()
            {
                out.insert(path.trim_matches('"').to_owned());
            }
        }
    }
    out
}

/// `sha256:<hex>` of `content`.
pub fn checksum(content: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(content)))
}

/// The published form of a file's content: as text, or zstd + base64 above `threshold`
/// (`true`). `None` when it is larger than [`PUBLISH_MAX`] even compressed.
pub fn encode(content: &[u8], threshold: usize) -> Option<(String, bool)> {
    if content.len() <= threshold
        && let Ok(text) = std::str::from_utf8(content)
    {
        return Some((text.to_owned(), false));
    }
    let compressed =
        ruzstd::encoding::compress_to_vec(content, ruzstd::encoding::CompressionLevel::Fastest);
    let encoded = base64::engine::general_purpose::STANDARD.encode(compressed);
    (encoded.len() <= PUBLISH_MAX).then_some((encoded, true))
}

/// Decodes what [`encode`] made (for readers and tests).
pub fn decode(text: &str, compressed: bool) -> Result<Vec<u8>, String> {
    if !compressed {
        return Ok(text.as_bytes().to_vec());
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("base64: {e}"))?;
    let mut decoder = ruzstd::decoding::StreamingDecoder::new(bytes.as_slice())
        .map_err(|e| format!("zstd: {e}"))?;
    let mut out = Vec::new();
    std::io::copy(&mut decoder, &mut out).map_err(|e| format!("zstd: {e}"))?;
    out.flush().map_err(|e| e.to_string())?;
    Ok(out)
}

/// A DNS-subdomain object name for `<htc>-<path>`.
pub fn object_name(htc: &str, path: &str) -> String {
    let base = path.strip_prefix("maps/").unwrap_or(path);
    let mut name: String = format!("{htc}-{base}")
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    name.truncate(253);
    name.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// What the cluster holds of the published objects: (kind, name) -> (checksum, uid).
type Held = BTreeMap<(String, String), (String, Option<String>)>;

/// One object to publish.
#[derive(Debug, Clone)]
struct Desired {
    kind: &'static str,
    name: String,
    checksum: String,
    spec: serde_json::Value,
}

/// What a set publishes: the HAProxyCfg first, then the other files; and the certificates.
fn desired(htc: &str, set: &RenderedSet, threshold: usize) -> (Vec<Desired>, Vec<CertificateFile>) {
    let config = set.files.text("haproxy.cfg").unwrap_or_default();
    let lists = crt_lists(config);
    let mut out = Vec::new();
    let mut certificates = Vec::new();
    for (path, content) in set.files.iter() {
        let sum = checksum(content);
        let class = classify(path, content, &lists);
        if class == Class::Certificate {
            certificates.push(CertificateFile {
                path: path.to_owned(),
                checksum: sum,
            });
            continue;
        }
        let Some((text, compressed)) = encode(content, threshold) else {
            warn!(%path, bytes = content.len(), "a rendered file is too large to publish, even compressed; skipped");
            continue;
        };
        let file = path.rsplit('/').next().unwrap_or(path).to_owned();
        let (kind, name, spec) = match class {
            Class::Main => (
                "HAProxyCfg",
                htc.to_owned(),
                json!({"path": path, "content": text, "checksum": sum,
                       "setChecksum": format!("sha256:{}", set.checksum), "compressed": compressed}),
            ),
            Class::Map => (
                "HAProxyMapFile",
                object_name(htc, path),
                json!({"mapName": file, "path": path, "entries": text, "checksum": sum, "compressed": compressed}),
            ),
            Class::CrtList => (
                "HAProxyCRTListFile",
                object_name(htc, path),
                json!({"listName": file, "path": path, "entries": text, "checksum": sum, "compressed": compressed}),
            ),
            Class::General | Class::Certificate => (
                "HAProxyGeneralFile",
                object_name(htc, path),
                json!({"fileName": file, "path": path, "content": text, "checksum": sum, "compressed": compressed}),
            ),
        };
        out.push(Desired {
            kind,
            name,
            checksum: sum,
            spec,
        });
    }
    // The HAProxyCfg first: the others name it as their owner.
    out.sort_by_key(|d| d.kind != "HAProxyCfg");
    (out, certificates)
}

/// The published objects of an HTC, as the API holds them.
struct Apis {
    cfg: Api<HAProxyCfg>,
    map: Api<HAProxyMapFile>,
    crtl: Api<HAProxyCRTListFile>,
    file: Api<HAProxyGeneralFile>,
}

impl Apis {
    fn new(client: &Client, namespace: &str) -> Self {
        Self {
            cfg: Api::namespaced(client.clone(), namespace),
            map: Api::namespaced(client.clone(), namespace),
            crtl: Api::namespaced(client.clone(), namespace),
            file: Api::namespaced(client.clone(), namespace),
        }
    }

    /// Applies one object's spec (and metadata); answers its uid.
    async fn apply(
        &self,
        kind: &str,
        name: &str,
        body: &serde_json::Value,
    ) -> Result<Option<String>, kube::Error> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let patch = Patch::Apply(body);
        Ok(match kind {
            "HAProxyCfg" => self.cfg.patch(name, &params, &patch).await?.metadata.uid,
            "HAProxyMapFile" => self.map.patch(name, &params, &patch).await?.metadata.uid,
            "HAProxyCRTListFile" => self.crtl.patch(name, &params, &patch).await?.metadata.uid,
            _ => self.file.patch(name, &params, &patch).await?.metadata.uid,
        })
    }

    /// Merges `status` into one object's status.
    async fn status(
        &self,
        kind: &str,
        name: &str,
        status: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        let patch = Patch::Merge(json!({ "status": status }));
        let params = PatchParams::default();
        match kind {
            "HAProxyCfg" => self.cfg.patch_status(name, &params, &patch).await.map(drop),
            "HAProxyMapFile" => self.map.patch_status(name, &params, &patch).await.map(drop),
            "HAProxyCRTListFile" => self
                .crtl
                .patch_status(name, &params, &patch)
                .await
                .map(drop),
            _ => self
                .file
                .patch_status(name, &params, &patch)
                .await
                .map(drop),
        }
    }

    /// The spec checksum and uid of every published object of `htc`, by (kind, name).
    async fn existing(&self, htc: &str) -> Result<Held, kube::Error> {
        let params = ListParams::default().labels(&format!("{CONFIG_LABEL}={htc}"));
        let mut out = BTreeMap::new();
        async fn list<K>(
            api: &Api<K>,
            params: &ListParams,
            sum: impl Fn(&K) -> String,
            out: &mut Held,
        ) -> Result<(), kube::Error>
        where
            K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
        {
            for object in api.list(params).await?.items {
                let meta = object.meta();
                out.insert(
                    (
                        K::kind(&()).into_owned(),
                        meta.name.clone().unwrap_or_default(),
                    ),
                    (sum(&object), meta.uid.clone()),
                );
            }
            Ok(())
        }
        list(
            &self.cfg,
            &params,
            |o| o.spec.checksum.clone() + &o.spec.set_checksum,
            &mut out,
        )
        .await?;
        list(&self.map, &params, |o| o.spec.checksum.clone(), &mut out).await?;
        list(&self.crtl, &params, |o| o.spec.checksum.clone(), &mut out).await?;
        list(&self.file, &params, |o| o.spec.checksum.clone(), &mut out).await?;
        Ok(out)
    }

    async fn delete(&self, kind: &str, name: &str) -> Result<(), kube::Error> {
        let params = DeleteParams::default();
        let result = match kind {
            "HAProxyCfg" => self.cfg.delete(name, &params).await.map(drop),
            "HAProxyMapFile" => self.map.delete(name, &params).await.map(drop),
            "HAProxyCRTListFile" => self.crtl.delete(name, &params).await.map(drop),
            _ => self.file.delete(name, &params).await.map(drop),
        };
        match result {
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            other => other,
        }
    }
}

/// What the publisher runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The namespace of the HTC (and of the published objects).
    pub namespace: String,
    /// The HTC's name.
    pub config_name: String,
    /// Content above this many bytes is compressed (default [`COMPRESS_ABOVE`]).
    pub compress_above: usize,
}

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    settings: Settings,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "config-publisher",
        Filter::kinds([Kind::ConfigVerdict, Kind::Deployable, Kind::Deployed]),
    );
    async move {
        let apis = Apis::new(&client, &settings.namespace);
        let htc = settings.config_name.clone();
        let mut state = Publisher::default();
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut backoff = Duration::from_millis(500);
        // The newest set not yet published, when the first set not yet published came and
        // when the newest did, and when the next publication may start.
        let mut pending: Option<std::sync::Arc<RenderedSet>> = None;
        let mut waiting: Option<(tokio::time::Instant, tokio::time::Instant)> = None;
        let mut rest_until = tokio::time::Instant::now();
        loop {
            let retry = crate::tasks::until(retry_at);
            tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    match &*event {
                        ControllerEvent::ConfigVerdict(v) if !v.uid.is_empty() => {
                            state.htc_uid = Some(v.uid.clone());
                        }
                        // Built when it is published: of several sets in a row only the
                        // last is.
                        ControllerEvent::Deployable(set) => {
                            pending = Some(set.clone());
                            let now = tokio::time::Instant::now();
                            waiting = Some((waiting.map_or(now, |(first, _)| first), now));
                        }
                        ControllerEvent::Deployed(report) => state.observe(report),
                        _ => continue,
                    }
                }
                () = retry => {}
            }
            retry_at = None;
            // A stream of changes publishes when it pauses (`QUIET`, `LATEST` at the latest)
            // and at most a quarter of the time (`REST_FACTOR`), the newest set then.
            let due = publish_at(pending.is_some().then_some(waiting).flatten(), rest_until);
            if tokio::time::Instant::now() < due {
                retry_at = Some(due);
                continue;
            }
            let started = tokio::time::Instant::now();
            if let Some(set) = pending.take() {
                waiting = None;
                // Checksums and compression of a multi-megabyte set (~100 ms of a core at
                // 10,000 Ingresses): off the runtime, and nicer than the renders and deltas
                // of the changes it follows.
                let (set, name, threshold) = (set, htc.clone(), settings.compress_above);
                let checksum = format!("sha256:{}", set.checksum);
                let built = crate::background::run("haptic-publish", move || {
                    desired(&name, &set, threshold)
                });
                let built = tokio::select! {
                    () = ctx.token().cancelled() => return,
                    built = built => built,
                };
                match built {
                    Ok((objects, certificates)) => {
                        state.desired = objects;
                        state.certificates = certificates;
                        state.set_checksum = checksum;
                    }
                    Err(_) => warn!("preparing the published objects panicked; not published"),
                }
            }
            if !ctx.lease_is_fresh() {
                debug!("not publishing: this replica's Lease is not fresh");
                retry_at = Some(tokio::time::Instant::now() + backoff);
                continue;
            }
            // Freshness is checked again before every write inside: a replica stopped
            // mid-sync (SIGSTOP, a long GC-like pause) must not finish it once its successor holds the Lease.
            let fresh = || ctx.lease_is_fresh();
            let write = state.sync(&apis, &htc, &fresh);
            let result = tokio::select! {
                () = ctx.token().cancelled() => return,
                result = tokio::time::timeout(Duration::from_secs(30), write) => result,
            };
            let took = started.elapsed();
            rest_until = tokio::time::Instant::now() + took * REST_FACTOR;
            match result {
                Ok(Ok(Synced::Done)) => backoff = Duration::from_millis(500),
                Ok(Ok(Synced::NotFresh)) => {
                    debug!("stopped publishing: this replica's Lease is no longer fresh");
                    retry_at = Some(tokio::time::Instant::now() + backoff);
                }
                Ok(Err(error)) => {
                    warn!(%error, retry_in = ?backoff, "publishing the config failed");
                    retry_at = Some(tokio::time::Instant::now() + backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                Err(_) => {
                    warn!(retry_in = ?backoff, "publishing the config timed out");
                    retry_at = Some(tokio::time::Instant::now() + backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
    }
}

/// When the next publication may start: at the end of the rest after the last one, and, with
/// a set waiting (when the first set not yet published came, and when the newest did), not
/// before the sets paused for [`QUIET`], unless the first has waited [`LATEST`].
fn publish_at(
    waiting: Option<(tokio::time::Instant, tokio::time::Instant)>,
    rest_until: tokio::time::Instant,
) -> tokio::time::Instant {
    match waiting {
        Some((first, newest)) => rest_until.max((newest + QUIET).min(first + LATEST)),
        None => rest_until,
    }
}

/// How a [`Publisher::sync`] ended without an error.
#[derive(Debug, PartialEq, Eq)]
enum Synced {
    /// The cluster holds what the set says.
    Done,
    /// The Lease stopped being fresh before a write: the rest was not written.
    NotFresh,
}

/// The publisher's view of this term.
#[derive(Default)]
struct Publisher {
    htc_uid: Option<String>,
    desired: Vec<Desired>,
    certificates: Vec<CertificateFile>,
    set_checksum: String,
    /// What the cluster holds, by (kind, name): checksum and uid. `None` until listed this term.
    published: Option<Held>,
    /// Each pod's set checksum and since when, from the deployments.
    pods: BTreeMap<String, (String, SystemTime)>,
    /// The status last written, by (kind, name).
    statuses: BTreeMap<(String, String), serde_json::Value>,
}

impl Publisher {
    fn observe(&mut self, report: &DeploymentReport) {
        for (pod, outcome) in &report.pods {
            if *outcome == PodOutcome::Live
                && let Some(live) = report.live.get(pod)
            {
                let live = format!("sha256:{live}");
                if self.pods.get(pod).is_none_or(|(sum, _)| *sum != live) {
                    self.pods.insert(pod.clone(), (live, SystemTime::now()));
                }
            }
        }
        self.pods.retain(|pod, _| report.pods.contains_key(pod));
    }

    /// Writes what differs from the cluster: specs, then statuses; deletes stale objects.
    /// `fresh` is asked before each write; once it says no, nothing more is written.
    async fn sync(
        &mut self,
        apis: &Apis,
        htc: &str,
        fresh: &(dyn Fn() -> bool + Sync),
    ) -> Result<Synced, kube::Error> {
        if self.desired.is_empty() {
            return Ok(Synced::Done);
        }
        let Some(htc_uid) = self.htc_uid.clone() else {
            return Ok(Synced::Done);
        };
        if self.published.is_none() {
            self.published = Some(apis.existing(htc).await?);
        }
        let published = self.published.get_or_insert_with(BTreeMap::new);
        let mut cfg_uid = published
            .get(&("HAProxyCfg".to_owned(), htc.to_owned()))
            .and_then(|(_, uid)| uid.clone());
        for object in &self.desired {
            let key = (object.kind.to_owned(), object.name.clone());
            let sum = if object.kind == "HAProxyCfg" {
                object.checksum.clone() + &self.set_checksum
            } else {
                object.checksum.clone()
            };
            if published.get(&key).is_some_and(|(have, _)| *have == sum) {
                continue;
            }
            let owner = if object.kind == "HAProxyCfg" {
                OwnerReference {
                    api_version: HAProxyTemplateConfig::api_version(&()).into_owned(),
                    kind: HAProxyTemplateConfig::kind(&()).into_owned(),
                    name: htc.to_owned(),
                    uid: htc_uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }
            } else {
                let Some(uid) = cfg_uid.clone() else {
                    // Its owner failed to publish: next time.
                    continue;
                };
                OwnerReference {
                    api_version: HAProxyCfg::api_version(&()).into_owned(),
                    kind: HAProxyCfg::kind(&()).into_owned(),
                    name: htc.to_owned(),
                    uid,
                    controller: Some(true),
                    block_owner_deletion: None,
                }
            };
            let body = json!({
                "apiVersion": "haproxy-haptic.org/v1alpha1",
                "kind": object.kind,
                "metadata": {
                    "name": object.name,
                    "labels": {CONFIG_LABEL: htc, MANAGED_BY.0: MANAGED_BY.1},
                    "ownerReferences": [owner],
                },
                "spec": object.spec,
            });
            if !fresh() {
                return Ok(Synced::NotFresh);
            }
            let uid = apis.apply(object.kind, &object.name, &body).await?;
            info!(kind = object.kind, name = %object.name, checksum = %object.checksum, "published");
            if object.kind == "HAProxyCfg" {
                cfg_uid.clone_from(&uid);
            }
            published.insert(key, (sum, uid));
        }
        // Files the set no longer has.
        let wanted: BTreeSet<(String, String)> = self
            .desired
            .iter()
            .map(|d| (d.kind.to_owned(), d.name.clone()))
            .collect();
        let stale: Vec<(String, String)> = published
            .keys()
            .filter(|k| !wanted.contains(*k))
            .cloned()
            .collect();
        for (kind, name) in stale {
            if !fresh() {
                return Ok(Synced::NotFresh);
            }
            apis.delete(&kind, &name).await?;
            info!(%kind, %name, "unpublished a file the set no longer has");
            published.remove(&(kind, name));
        }
        // Status: which pods run the set these files came from.
        let deployed: Vec<PodDeployment> = self
            .pods
            .iter()
            .map(|(pod, (sum, at))| PodDeployment {
                pod_name: pod.clone(),
                checksum: sum.clone(),
                deployed_at: jiff::Timestamp::try_from(*at)
                    .map(|t| t.to_string())
                    .unwrap_or_default(),
            })
            .collect();
        let mut aux = AuxiliaryFiles {
            ssl_certificates: self.certificates.clone(),
            ..AuxiliaryFiles::default()
        };
        for d in &self.desired {
            match d.kind {
                "HAProxyMapFile" => aux.map_files.push(d.name.clone()),
                "HAProxyCRTListFile" => aux.crt_list_files.push(d.name.clone()),
                "HAProxyGeneralFile" => aux.general_files.push(d.name.clone()),
                _ => {}
            }
        }
        for d in &self.desired {
            let key = (d.kind.to_owned(), d.name.clone());
            if !published.contains_key(&key) {
                continue;
            }
            let on_this_set: Vec<&PodDeployment> = deployed
                .iter()
                .filter(|p| p.checksum == self.set_checksum)
                .collect();
            let status = if d.kind == "HAProxyCfg" {
                json!({"deployedToPods": deployed, "auxiliaryFiles": aux})
            } else {
                json!({"deployedToPods": on_this_set})
            };
            if self.statuses.get(&key) == Some(&status) {
                continue;
            }
            if !fresh() {
                return Ok(Synced::NotFresh);
            }
            apis.status(d.kind, &d.name, &status).await?;
            self.statuses.insert(key, status);
        }
        Ok(Synced::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_sorted_and_keys_never_published() {
        let cfg = "frontend https\n    bind :443 ssl crt-list \"maps/certs.list\"\n";
        let lists = crt_lists(cfg);
        assert_eq!(lists, BTreeSet::from(["maps/certs.list".to_owned()]));
        assert_eq!(classify("haproxy.cfg", b"", &lists), Class::Main);
        assert_eq!(
            classify("maps/certs.list", b"ssl/a.pem\n", &lists),
            Class::CrtList
        );
        assert_eq!(classify("maps/hosts.map", b"a b\n", &lists), Class::Map);
        assert_eq!(classify("ssl/a.pem", b"", &lists), Class::Certificate);
        assert_eq!(
            classify("errors/503.http", b"HTTP/1.0 503\n", &lists),
            Class::General
        );
        // A key in a general file is still a key.
        assert_eq!(
            classify("files/x.txt", b"-----BEGIN PRIVATE KEY-----\nabc\n", &lists),
            Class::Certificate
        );
        assert_eq!(
            classify("files/y", b"-----BEGIN EC PRIVATE KEY-----\n", &lists),
            Class::Certificate
        );
    }

    #[test]
    fn large_content_round_trips_through_zstd_and_base64() {
        let small = b"a b\n".repeat(10);
        assert_eq!(
            encode(&small, COMPRESS_ABOVE),
            Some((String::from_utf8(small.clone()).unwrap_or_default(), false))
        );
        let big: Vec<u8> = (0..50_000u32)
            .flat_map(|i| format!("host{i}.example/ backend_{}\n", i % 97).into_bytes())
            .collect();
        assert!(big.len() > COMPRESS_ABOVE);
        let (text, compressed) = encode(&big, COMPRESS_ABOVE).expect("fits compressed");
        assert!(compressed);
        assert!(
            text.len() < big.len() / 3,
            "{} of {}",
            text.len(),
            big.len()
        );
        assert_eq!(decode(&text, true).expect("decodes"), big);
    }

    /// A stream of sets is published when it pauses, or once its first set has waited
    /// `LATEST`; never during the rest after a publication.
    #[test]
    fn a_stream_of_sets_is_published_when_it_pauses() {
        let start = tokio::time::Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // Nothing waiting: the rest alone.
        assert_eq!(publish_at(None, at(300)), at(300));
        // One set: half a second after it.
        assert_eq!(publish_at(Some((at(0), at(0))), start), at(500));
        // Sets every 150 ms since 0: half a second after the newest.
        assert_eq!(publish_at(Some((at(0), at(4_950))), start), at(5_450));
        // ...but ten seconds after the first at the latest.
        assert_eq!(publish_at(Some((at(0), at(9_900))), start), at(10_000));
        // A rest longer than that still holds.
        assert_eq!(publish_at(Some((at(0), at(0))), at(800)), at(800));
    }

    #[test]
    fn object_names_are_dns_subdomains() {
        assert_eq!(
            object_name("haptic-config", "maps/routes-exact.map"),
            "haptic-config-routes-exact.map"
        );
        assert_eq!(
            object_name("cfg", "files/Errors/503_Page.http"),
            "cfg-files-errors-503-page.http"
        );
        assert!(object_name("c", &"x".repeat(400)).len() <= 253);
    }
}
