//! The resources the server knows: built-in types, custom resources registered through CRDs,
//! and the discovery documents that describe them.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Where objects of one resource are stored: (group, plural). Every served version of a custom
/// resource shares one storage, as it does in the real server.
pub(crate) type StorageKey = (String, String);

/// What the server knows about one resource at one group/version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResourceInfo {
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) plural: String,
    pub(crate) singular: String,
    pub(crate) kind: String,
    pub(crate) namespaced: bool,
    /// Has a `status` subresource: the main endpoint ignores status, `/status` writes only it.
    pub(crate) status: bool,
    pub(crate) short_names: Vec<String>,
    /// PUT to a missing object creates it (Leases, Events).
    pub(crate) create_on_update: bool,
    /// PUT without `metadata.resourceVersion` is allowed (not for Leases).
    pub(crate) unconditional_update: bool,
    /// Served by a CustomResourceDefinition.
    pub(crate) custom: bool,
}

impl ResourceInfo {
    fn builtin(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        Self {
            group: group.to_owned(),
            version: version.to_owned(),
            plural: plural.to_owned(),
            singular: kind.to_lowercase(),
            kind: kind.to_owned(),
            namespaced,
            status: false,
            short_names: Vec::new(),
            create_on_update: false,
            unconditional_update: true,
            custom: false,
        }
    }

    fn with_status(mut self) -> Self {
        self.status = true;
        self
    }

    fn short(mut self, names: &[&str]) -> Self {
        self.short_names = names.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// `leases.coordination.k8s.io`, or `pods` for the core group: how errors name a resource.
    pub(crate) fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Lease.coordination.k8s.io`, or `Pod` for the core group: how 422 errors name a kind.
    pub(crate) fn kind_qualified(&self) -> String {
        if self.group.is_empty() {
            self.kind.clone()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// `coordination.k8s.io/v1`, or `v1` for the core group.
    pub(crate) fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub(crate) fn storage_key(&self) -> StorageKey {
        (self.group.clone(), self.plural.clone())
    }

    /// The etcd key the real server stores an object under, as its storage errors show it.
    pub(crate) fn storage_path(&self, namespace: Option<&str>, name: &str) -> String {
        let mut path = "/registry/".to_owned();
        if self.custom {
            path.push_str(&self.group);
            path.push('/');
        }
        path.push_str(&self.plural);
        path.push('/');
        if let Some(ns) = namespace.filter(|_| self.namespaced) {
            path.push_str(ns);
            path.push('/');
        }
        path.push_str(name);
        path
    }

    /// Whether a DELETE answers with the deleted object. The real server does so for pods,
    /// services, namespaces, CRDs and custom resources (`ReturnDeletedObject` or a custom
    /// delete); for the rest it answers with a `Status` of `Success` naming the object.
    pub(crate) fn returns_deleted_object(&self) -> bool {
        self.custom
            || (self.group.is_empty()
                && matches!(self.plural.as_str(), "pods" | "services" | "namespaces"))
            || (self.group == "apiextensions.k8s.io" && self.plural == "customresourcedefinitions")
    }

    /// Whether the server keeps `metadata.generation` for this resource.
    pub(crate) fn tracks_generation(&self) -> bool {
        self.custom || self.status
    }

    fn discovery_entries(&self) -> Vec<Value> {
        let mut verbs = vec![
            "create", "delete", "get", "list", "patch", "update", "watch",
        ];
        if self.plural != "namespaces" {
            verbs.insert(1, "deletecollection");
        }
        let mut main = json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": verbs,
        });
        if !self.short_names.is_empty() {
            main["shortNames"] = json!(self.short_names);
        }
        let mut entries = vec![main];
        if self.status {
            entries.push(json!({
                "name": format!("{}/status", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        entries
    }
}

/// Every resource served, keyed by (group, version, plural).
#[derive(Debug, Clone)]
pub(crate) struct Registry {
    resources: BTreeMap<(String, String, String), ResourceInfo>,
}

impl Registry {
    /// The built-in resources the project uses.
    pub(crate) fn builtin() -> Self {
        let mut lease = ResourceInfo::builtin("coordination.k8s.io", "v1", "leases", "Lease", true);
        lease.create_on_update = true;
        lease.unconditional_update = false;
        let mut event = ResourceInfo::builtin("", "v1", "events", "Event", true).short(&["ev"]);
        event.create_on_update = true;
        let list = vec![
            ResourceInfo::builtin("", "v1", "namespaces", "Namespace", false)
                .with_status()
                .short(&["ns"]),
            ResourceInfo::builtin("", "v1", "pods", "Pod", true)
                .with_status()
                .short(&["po"]),
            ResourceInfo::builtin("", "v1", "services", "Service", true)
                .with_status()
                .short(&["svc"]),
            ResourceInfo::builtin("", "v1", "secrets", "Secret", true),
            ResourceInfo::builtin("", "v1", "configmaps", "ConfigMap", true).short(&["cm"]),
            event,
            // What kube-runtime's event Recorder writes.
            ResourceInfo::builtin("events.k8s.io", "v1", "events", "Event", true),
            lease,
            ResourceInfo::builtin(
                "discovery.k8s.io",
                "v1",
                "endpointslices",
                "EndpointSlice",
                true,
            ),
            ResourceInfo::builtin("networking.k8s.io", "v1", "ingresses", "Ingress", true)
                .with_status()
                .short(&["ing"]),
            ResourceInfo::builtin(
                "networking.k8s.io",
                "v1",
                "ingressclasses",
                "IngressClass",
                false,
            ),
            ResourceInfo::builtin(
                "apiextensions.k8s.io",
                "v1",
                "customresourcedefinitions",
                "CustomResourceDefinition",
                false,
            )
            .with_status()
            .short(&["crd", "crds"]),
        ];
        let mut registry = Self {
            resources: BTreeMap::new(),
        };
        for info in list {
            registry.insert(info);
        }
        registry
    }

    fn insert(&mut self, info: ResourceInfo) {
        self.resources.insert(
            (
                info.group.clone(),
                info.version.clone(),
                info.plural.clone(),
            ),
            info,
        );
    }

    pub(crate) fn get(&self, group: &str, version: &str, plural: &str) -> Option<&ResourceInfo> {
        self.resources
            .get(&(group.to_owned(), version.to_owned(), plural.to_owned()))
    }

    /// Whether any resource is served at this group/version.
    pub(crate) fn serves(&self, group: &str, version: &str) -> bool {
        self.resources
            .keys()
            .any(|(g, v, _)| g == group && v == version)
    }

    /// Every served (group, version), core first, in a stable order.
    pub(crate) fn group_versions(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (group, version, _) in self.resources.keys() {
            if !out.iter().any(|(g, v)| g == group && v == version) {
                out.push((group.clone(), version.clone()));
            }
        }
        out
    }

    /// The resources served at one group/version.
    pub(crate) fn resources_at(&self, group: &str, version: &str) -> Vec<&ResourceInfo> {
        self.resources
            .iter()
            .filter(|((g, v, _), _)| g == group && v == version)
            .map(|(_, info)| info)
            .collect()
    }

    /// Registers the served versions of a CRD (replacing what an earlier version of it served).
    pub(crate) fn register_crd(&mut self, infos: Vec<ResourceInfo>) {
        if let Some(first) = infos.first() {
            let key = first.storage_key();
            self.unregister(&key);
        }
        for info in infos {
            self.insert(info);
        }
    }

    /// Stops serving every version of a custom resource.
    pub(crate) fn unregister(&mut self, key: &StorageKey) {
        self.resources
            .retain(|(g, _, p), info| !(info.custom && g == &key.0 && p == &key.1));
    }

    /// `/api`: the core versions.
    pub(crate) fn api_versions(&self, server_address: &str) -> Value {
        json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": server_address }],
        })
    }

    /// `/apis`: every named group with its versions.
    pub(crate) fn api_group_list(&self) -> Value {
        let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (group, version, _) in self.resources.keys() {
            if group.is_empty() {
                continue;
            }
            let versions = groups.entry(group).or_default();
            if !versions.contains(&version.as_str()) {
                versions.push(version);
            }
        }
        let groups: Vec<Value> = groups
            .into_iter()
            .map(|(group, mut versions)| {
                // Kubernetes orders versions by stability: v1 before v1beta1 before v1alpha1.
                versions.sort_by_key(|v| version_priority(v));
                let entries: Vec<Value> = versions
                    .iter()
                    .map(|v| json!({ "groupVersion": format!("{group}/{v}"), "version": v }))
                    .collect();
                json!({ "name": group, "versions": entries, "preferredVersion": entries[0] })
            })
            .collect();
        json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
    }

    /// `/apis/{group}` for one group.
    pub(crate) fn api_group(&self, group: &str) -> Option<Value> {
        let list = self.api_group_list();
        let found = list["groups"]
            .as_array()?
            .iter()
            .find(|g| g["name"] == group)?
            .clone();
        let mut doc = found;
        doc["kind"] = json!("APIGroup");
        doc["apiVersion"] = json!("v1");
        Some(doc)
    }

    /// `/api/v1` or `/apis/{group}/{version}`: the resources served there.
    pub(crate) fn api_resource_list(&self, group: &str, version: &str) -> Option<Value> {
        if !self.serves(group, version) {
            return None;
        }
        let resources: Vec<Value> = self
            .resources
            .iter()
            .filter(|((g, v, _), _)| g == group && v == version)
            .flat_map(|(_, info)| info.discovery_entries())
            .collect();
        let group_version = if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        };
        Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        }))
    }
}

fn version_priority(version: &str) -> (u8, i64, i64) {
    // v<major>[(alpha|beta)<minor>]; GA first, then beta, then alpha, higher numbers first.
    let rest = version.strip_prefix('v').unwrap_or(version);
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let major: i64 = digits.parse().unwrap_or(0);
    let tail = &rest[digits.len()..];
    let (stage, minor) = if let Some(m) = tail.strip_prefix("beta") {
        (1, m.parse().unwrap_or(0))
    } else if let Some(m) = tail.strip_prefix("alpha") {
        (2, m.parse().unwrap_or(0))
    } else if tail.is_empty() {
        (0, 0)
    } else {
        (3, 0)
    };
    (stage, -major, -minor)
}

/// Reads the served versions of a CRD into resource infos, or names what is wrong with it as
/// `(field, message)` causes for a 422.
pub(crate) fn crd_resources(crd: &Value) -> Result<Vec<ResourceInfo>, Vec<(String, String)>> {
    let mut causes = Vec::new();
    let spec = &crd["spec"];
    let group = spec["group"].as_str().unwrap_or_default().to_owned();
    let names = &spec["names"];
    let plural = names["plural"].as_str().unwrap_or_default().to_owned();
    let kind = names["kind"].as_str().unwrap_or_default().to_owned();
    if group.is_empty() {
        causes.push(("spec.group".to_owned(), "Required value".to_owned()));
    }
    if plural.is_empty() {
        causes.push(("spec.names.plural".to_owned(), "Required value".to_owned()));
    }
    if kind.is_empty() {
        causes.push(("spec.names.kind".to_owned(), "Required value".to_owned()));
    }
    let name = crd["metadata"]["name"].as_str().unwrap_or_default();
    if !plural.is_empty() && !group.is_empty() && name != format!("{plural}.{group}") {
        causes.push((
            "metadata.name".to_owned(),
            format!("Invalid value: \"{name}\": must be spec.names.plural+\".\"+spec.group"),
        ));
    }
    let scope = spec["scope"].as_str().unwrap_or_default();
    if scope != "Namespaced" && scope != "Cluster" {
        causes.push((
            "spec.scope".to_owned(),
            format!(
                "Unsupported value: \"{scope}\": supported values: \"Cluster\", \"Namespaced\""
            ),
        ));
    }
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    if versions.is_empty() {
        causes.push((
            "spec.versions".to_owned(),
            "Invalid value: null: must have exactly one version marked as storage version"
                .to_owned(),
        ));
    }
    if !causes.is_empty() {
        return Err(causes);
    }
    let singular = names["singular"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| kind.to_lowercase());
    let short_names: Vec<String> = names["shortNames"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Ok(versions
        .iter()
        .filter(|v| v["served"].as_bool().unwrap_or(true))
        .filter_map(|v| {
            let version = v["name"].as_str()?.to_owned();
            Some(ResourceInfo {
                group: group.clone(),
                version,
                plural: plural.clone(),
                singular: singular.clone(),
                kind: kind.clone(),
                namespaced: scope == "Namespaced",
                status: v["subresources"]["status"].is_object(),
                short_names: short_names.clone(),
                create_on_update: false,
                unconditional_update: true,
                custom: true,
            })
        })
        .collect())
}
