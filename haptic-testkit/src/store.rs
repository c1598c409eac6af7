//! The object store: one global resourceVersion, the semantics of every write, and the bounded
//! event history watches start from.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use crate::{
    resources::{Registry, ResourceInfo, StorageKey, crd_resources},
    selectors::{FieldSelector, LabelSelector},
    status::ApiError,
    validation,
};

/// The type of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, kept in the history and broadcast to open watches.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) rv: u64,
    pub(crate) key: StorageKey,
    pub(crate) kind: EventType,
    pub(crate) object: Arc<Value>,
    /// The object before a modification, so a selector watch can turn a change that leaves
    /// the selection into DELETED, as the real server does.
    pub(crate) old: Option<Arc<Value>>,
}

/// Which part of an object a write targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sub {
    Main,
    Status,
}

/// How a PATCH body is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchKind {
    Merge,
    Json,
    Strategic,
    Apply,
}

/// What to match when listing or watching.
#[derive(Debug, Clone, Default)]
pub(crate) struct Selection {
    pub(crate) namespace: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
}

impl Selection {
    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| object["metadata"]["namespace"] == ns)
            && self.labels.matches(object)
            && self.fields.matches(object)
    }
}

/// Delete preconditions from a DeleteOptions body.
#[derive(Debug, Clone, Default)]
pub(crate) struct Preconditions {
    pub(crate) uid: Option<String>,
    pub(crate) resource_version: Option<String>,
}

type Objects = BTreeMap<(String, String), Value>;

/// How a new watch begins: the events it sends first, the resourceVersion it has reached once
/// they are sent, and the receiver of every later event.
#[derive(Debug)]
pub(crate) struct WatchStart {
    pub(crate) initial: Vec<Arc<Event>>,
    pub(crate) rv: u64,
    pub(crate) events: broadcast::Receiver<Arc<Event>>,
}

/// Per (field manager, whether it applied to the status subresource): the leaf paths (keys from
/// the object's root) its last server-side apply set.
type Owners = BTreeMap<(String, bool), Vec<Vec<String>>>;

/// Everything the server stores.
#[derive(Debug)]
pub(crate) struct Store {
    rv: u64,
    objects: HashMap<StorageKey, Objects>,
    history: VecDeque<Arc<Event>>,
    history_limit: usize,
    /// Events at or below this resourceVersion may have left the history.
    compacted: u64,
    pub(crate) registry: Registry,
    tx: broadcast::Sender<Arc<Event>>,
    /// Server-side apply's field ownership, per object: for each (manager, whether it applied
    /// to the status subresource), the leaf paths its last apply set.
    applied: HashMap<(StorageKey, (String, String)), Owners>,
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn rv_of(object: &Value) -> &str {
    object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
}

fn meta_mut(object: &mut Value) -> &mut Map<String, Value> {
    if !object["metadata"].is_object() {
        object["metadata"] = json!({});
    }
    match object.get_mut("metadata").and_then(Value::as_object_mut) {
        Some(meta) => meta,
        None => unreachable!("metadata was just made an object"),
    }
}

/// The part of an object whose change bumps `metadata.generation`.
fn generation_part(info: &ResourceInfo, object: &Value) -> Value {
    let mut part = object.clone();
    if let Some(map) = part.as_object_mut() {
        map.remove("metadata");
        map.remove("kind");
        map.remove("apiVersion");
        if info.status {
            map.remove("status");
        }
    }
    part
}

impl Store {
    pub(crate) fn new(history_limit: usize, watch_buffer: usize) -> Self {
        let mut store = Self {
            rv: 1,
            objects: HashMap::new(),
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted: 0,
            registry: Registry::builtin(),
            tx: broadcast::channel(watch_buffer.max(16)).0,
            applied: HashMap::new(),
        };
        let Some(ns_info) = store.registry.get("", "v1", "namespaces").cloned() else {
            return store;
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            // The real server always has these namespaces.
            let _ = store.create(&ns_info, None, json!({ "metadata": { "name": ns } }), false);
        }
        store
    }

    pub(crate) fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Drops the whole event history: watches from any earlier resourceVersion get 410.
    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    fn emit(&mut self, key: StorageKey, kind: EventType, object: Value, old: Option<Value>) {
        let event = Arc::new(Event {
            rv: self.rv,
            key,
            kind,
            object: Arc::new(object),
            old: old.map(Arc::new),
        });
        self.history.push_back(event.clone());
        while self.history.len() > self.history_limit {
            if let Some(evicted) = self.history.pop_front() {
                self.compacted = evicted.rv;
            }
        }
        // No receiver is fine: nobody watches.
        let _ = self.tx.send(event);
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Sets the served apiVersion (custom resources are stored once for all versions).
    pub(crate) fn present(info: &ResourceInfo, object: &Value) -> Value {
        let mut out = object.clone();
        out["apiVersion"] = json!(info.api_version());
        out["kind"] = json!(info.kind);
        out
    }

    /// The `PartialObjectMetadata` view of an object, for clients that ask for metadata only
    /// (`Accept: application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1`).
    pub(crate) fn partial(object: &Value) -> Value {
        json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object["metadata"],
        })
    }

    fn check_type(info: &ResourceInfo, object: &Value) -> Result<(), ApiError> {
        if let Some(api_version) = object.get("apiVersion").and_then(Value::as_str)
            && !api_version.is_empty()
            && api_version != info.api_version()
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({api_version}) does not match the expected API version ({})",
                info.api_version()
            )));
        }
        if let Some(kind) = object.get("kind").and_then(Value::as_str)
            && kind != info.kind
        {
            return Err(ApiError::bad_request(validation::decode_error(
                info,
                &format!("the object provided is of kind {kind}, not {}", info.kind),
            )));
        }
        validation::decode_check(info, object)
            .map_err(|detail| ApiError::bad_request(validation::decode_error(info, &detail)))
    }

    fn objects(&self, info: &ResourceInfo) -> Option<&Objects> {
        self.objects.get(&info.storage_key())
    }

    fn key(info: &ResourceInfo, ns: Option<&str>, name: &str) -> (String, String) {
        let ns = if info.namespaced {
            ns.unwrap_or_default()
        } else {
            ""
        };
        (ns.to_owned(), name.to_owned())
    }

    /// GET one object.
    pub(crate) fn get(
        &self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.objects(info)
            .and_then(|objs| objs.get(&Self::key(info, ns, name)))
            .map(|o| Self::present(info, o))
            .ok_or_else(|| ApiError::not_found(info, name))
    }

    /// LIST: matching objects in key order, and the list's resourceVersion.
    pub(crate) fn list(&self, info: &ResourceInfo, selection: &Selection) -> (Vec<Value>, u64) {
        let items = self
            .objects(info)
            .map(|objs| {
                objs.values()
                    .filter(|o| selection.matches(o))
                    .map(|o| Self::present(info, o))
                    .collect()
            })
            .unwrap_or_default();
        (items, self.rv)
    }

    fn validate(info: &ResourceInfo, name: &str, object: &Value) -> Result<(), ApiError> {
        Self::check_type(info, object)?;
        let mut causes = Vec::new();
        causes.extend(validation::name_cause(info, name));
        causes.extend(validation::field_causes(info, object));
        if causes.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(info, name, &causes))
        }
    }

    /// POST: creates an object.
    pub(crate) fn create(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        mut object: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        Self::check_type(info, &object)?;
        let meta = meta_mut(&mut object);
        let mut name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if name.is_empty() {
            let prefix = meta
                .get("generateName")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    info,
                    "",
                    &[(
                        "metadata.name".to_owned(),
                        "Required value: name or generateName is required".to_owned(),
                    )],
                ));
            }
            let suffix: String = uuid::Uuid::new_v4()
                .simple()
                .to_string()
                .chars()
                .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                .take(5)
                .collect();
            name = format!("{prefix}{suffix}");
            meta.insert("name".to_owned(), json!(name));
        }
        if info.namespaced {
            let ns = ns.unwrap_or_default();
            match meta.get("namespace").and_then(Value::as_str) {
                Some(body_ns) if !body_ns.is_empty() && body_ns != ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {
                    meta.insert("namespace".to_owned(), json!(ns));
                }
            }
        } else {
            meta.remove("namespace");
        }
        if self.objects_contains(info, ns, &name) {
            return Err(ApiError::already_exists(info, &name));
        }
        Self::validate(info, &name, &object)?;
        validation::normalize(info, &mut object);
        if info.namespaced {
            let ns = ns.unwrap_or_default();
            let exists = self
                .objects
                .get(&(String::new(), "namespaces".to_owned()))
                .is_some_and(|n| n.contains_key(&(String::new(), ns.to_owned())));
            if !exists {
                let Some(ns_info) = self.registry.get("", "v1", "namespaces") else {
                    return Err(ApiError::bad_request("namespaces are not served"));
                };
                return Err(ApiError::not_found(ns_info, ns));
            }
        }
        let crd = if info.group == "apiextensions.k8s.io"
            && info.plural == "customresourcedefinitions"
        {
            Some(crd_resources(&object).map_err(|causes| ApiError::invalid(info, &name, &causes))?)
        } else {
            None
        };
        if info.status
            && let Some(map) = object.as_object_mut()
        {
            map.remove("status");
        }
        if info.plural == "namespaces" && info.group.is_empty() {
            object["status"] = json!({ "phase": "Active" });
        }
        if let Some(versions) = &crd {
            let names = object["spec"]["names"].clone();
            object["status"] = json!({
                "acceptedNames": names,
                "storedVersions": versions.iter().map(|v| v.version.clone()).collect::<Vec<_>>(),
                "conditions": [
                    { "type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now_rfc3339() },
                    { "type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now_rfc3339() },
                ],
            });
        }
        let meta = meta_mut(&mut object);
        meta.insert("uid".to_owned(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("creationTimestamp".to_owned(), json!(now_rfc3339()));
        meta.remove("deletionTimestamp");
        meta.remove("selfLink");
        if info.tracks_generation() {
            meta.insert("generation".to_owned(), json!(1));
        } else {
            meta.remove("generation");
        }
        let mut object = Self::present(info, &object);
        if dry_run {
            meta_mut(&mut object).remove("resourceVersion");
            return Ok(object);
        }
        let rv = self.bump();
        meta_mut(&mut object).insert("resourceVersion".to_owned(), json!(rv.to_string()));
        self.objects
            .entry(info.storage_key())
            .or_default()
            .insert(Self::key(info, ns, &name), object.clone());
        self.emit(info.storage_key(), EventType::Added, object.clone(), None);
        if let Some(versions) = crd {
            self.registry.register_crd(versions);
        }
        Ok(object)
    }

    fn objects_contains(&self, info: &ResourceInfo, ns: Option<&str>, name: &str) -> bool {
        self.objects(info)
            .is_some_and(|objs| objs.contains_key(&Self::key(info, ns, name)))
    }

    /// PUT: replaces an object (or only its status). Returns the object and whether it was
    /// created (create-on-update).
    pub(crate) fn update(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        mut object: Value,
        sub: Sub,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        Self::check_type(info, &object)?;
        let body_name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if info.namespaced
            && let Some(body_ns) = object["metadata"]["namespace"].as_str()
            && !body_ns.is_empty()
            && Some(body_ns) != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let Some(existing) = self
            .objects(info)
            .and_then(|o| o.get(&Self::key(info, ns, name)))
            .cloned()
        else {
            if sub == Sub::Main && info.create_on_update {
                meta_mut(&mut object).remove("resourceVersion");
                return self.create(info, ns, object, dry_run).map(|o| (o, true));
            }
            return Err(ApiError::not_found(info, name));
        };
        // A uid in the body is a precondition (the real server's storage checks it first and
        // reports it as a storage error inside a Conflict).
        let existing_uid = existing["metadata"]["uid"].as_str().unwrap_or_default();
        if let Some(uid) = object["metadata"]["uid"].as_str()
            && !uid.is_empty()
            && uid != existing_uid
        {
            return Err(ApiError::conflict_because(
                info,
                name,
                &format!(
                    "StorageError: invalid object, Code: 4, Key: {}, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: UID in precondition: {uid}, UID in object meta: {existing_uid}",
                    info.storage_path(ns, name)
                ),
            ));
        }
        let body_rv = rv_of(&object).to_owned();
        if body_rv.is_empty() {
            if !info.unconditional_update {
                return Err(ApiError::rv_required(info, name));
            }
        } else if body_rv.parse::<u64>().is_err() {
            return Err(ApiError::bad_request(format!(
                "invalid resource version: \"{body_rv}\""
            )));
        } else if body_rv != rv_of(&existing) {
            return Err(ApiError::conflict(info, name));
        }
        let new = Self::merge_sub(info, &existing, object, sub);
        self.commit_update(info, ns, name, existing, new, dry_run)
            .map(|o| (o, false))
    }

    /// Takes the part of `incoming` that the subresource may change, the rest from `existing`.
    fn merge_sub(info: &ResourceInfo, existing: &Value, incoming: Value, sub: Sub) -> Value {
        match sub {
            Sub::Status => {
                // At the version of this request: a custom resource is stored once for all
                // its served versions, as kube-apiserver converts it.
                let mut new = Self::present(info, existing);
                new["status"] = incoming.get("status").cloned().unwrap_or(Value::Null);
                if new["status"].is_null()
                    && let Some(map) = new.as_object_mut()
                {
                    map.remove("status");
                }
                new
            }
            Sub::Main if info.status => {
                let mut new = incoming;
                match existing.get("status") {
                    Some(status) => new["status"] = status.clone(),
                    None => {
                        if let Some(map) = new.as_object_mut() {
                            map.remove("status");
                        }
                    }
                }
                new
            }
            Sub::Main => incoming,
        }
    }

    /// Validates and stores a new version of an existing object; a write that changes nothing
    /// is a no-op, as on the real server (no new resourceVersion, no event).
    fn commit_update(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        existing: Value,
        mut new: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        Self::validate(info, name, &new)?;
        validation::normalize(info, &mut new);
        let old_meta = existing["metadata"].clone();
        {
            let meta = meta_mut(&mut new);
            for field in [
                "uid",
                "creationTimestamp",
                "name",
                "namespace",
                "generation",
                "resourceVersion",
            ] {
                match old_meta.get(field) {
                    Some(v) => meta.insert(field.to_owned(), v.clone()),
                    None => meta.remove(field),
                };
            }
            meta.remove("selfLink");
        }
        if info.tracks_generation()
            && generation_part(info, &new) != generation_part(info, &existing)
        {
            let generation = old_meta["generation"].as_i64().unwrap_or(0) + 1;
            meta_mut(&mut new).insert("generation".to_owned(), json!(generation));
        }
        let mut new = Self::present(info, &new);
        let stored_existing = Self::present(info, &existing);
        if new == stored_existing || dry_run {
            return Ok(new);
        }
        if let Some(versions) = (info.group == "apiextensions.k8s.io"
            && info.plural == "customresourcedefinitions")
            .then(|| crd_resources(&new))
        {
            let versions = versions.map_err(|causes| ApiError::invalid(info, name, &causes))?;
            self.registry.register_crd(versions);
        }
        let rv = self.bump();
        meta_mut(&mut new).insert("resourceVersion".to_owned(), json!(rv.to_string()));
        self.objects
            .entry(info.storage_key())
            .or_default()
            .insert(Self::key(info, ns, name), new.clone());
        self.emit(
            info.storage_key(),
            EventType::Modified,
            new.clone(),
            Some(existing),
        );
        Ok(new)
    }

    /// PATCH: applies a patch to an object (or its status). A resourceVersion or uid inside the
    /// patch is a precondition. Server-side apply creates a missing object.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn patch(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        kind: PatchKind,
        patch: Value,
        sub: Sub,
        dry_run: bool,
        manager: Option<&str>,
    ) -> Result<(Value, bool), ApiError> {
        let owner = manager
            .filter(|_| kind == PatchKind::Apply)
            .map(|m| (m.to_owned(), sub == Sub::Status));
        let applied_paths = owner.as_ref().map(|_| applied_leaves(&patch, sub));
        let Some(existing) = self
            .objects(info)
            .and_then(|o| o.get(&Self::key(info, ns, name)))
            .cloned()
        else {
            if kind == PatchKind::Apply && sub == Sub::Main {
                let mut object = patch;
                if object["metadata"]["name"].as_str().unwrap_or_default() != name {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({}) does not match the name on the URL ({name})",
                        object["metadata"]["name"].as_str().unwrap_or_default()
                    )));
                }
                meta_mut(&mut object).remove("resourceVersion");
                let created = self.create(info, ns, object, dry_run)?;
                if let (Some(owner), Some(paths), false) = (owner, applied_paths, dry_run) {
                    self.applied
                        .entry((info.storage_key(), Self::key(info, ns, name)))
                        .or_default()
                        .insert(owner, paths);
                }
                return Ok((created, true));
            }
            return Err(ApiError::not_found(info, name));
        };
        // Patched at the version of this request (custom resources are served at every
        // version, whichever one created them).
        let mut patched = Self::present(info, &existing);
        match kind {
            PatchKind::Merge => json_patch::merge(&mut patched, &patch),
            PatchKind::Apply => {
                json_patch::merge(&mut patched, &patch);
                if let (Some(owner), Some(paths)) = (&owner, &applied_paths) {
                    self.drop_unapplied(info, ns, name, owner, paths, &mut patched);
                }
            }
            PatchKind::Strategic => strategic_merge(&mut patched, &patch),
            PatchKind::Json => {
                let ops: json_patch::Patch = serde_json::from_value(patch)
                    .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
                json_patch::patch(&mut patched, &ops).map_err(|e| {
                    ApiError::invalid(
                        info,
                        name,
                        &[(
                            "".to_owned(),
                            format!("Invalid value: the JSON patch could not be applied: {e}"),
                        )],
                    )
                })?;
            }
        }
        if !patched.is_object() {
            return Err(ApiError::bad_request("the patch did not produce an object"));
        }
        let patched_rv = rv_of(&patched);
        if !patched_rv.is_empty() && patched_rv != rv_of(&existing) {
            return Err(ApiError::conflict(info, name));
        }
        if let Some(uid) = patched["metadata"]["uid"].as_str()
            && Some(uid) != existing["metadata"]["uid"].as_str()
        {
            return Err(ApiError::conflict_because(
                info,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    existing["metadata"]["uid"].as_str().unwrap_or_default()
                ),
            ));
        }
        let new = Self::merge_sub(info, &existing, patched, sub);
        let updated = self.commit_update(info, ns, name, existing, new, dry_run)?;
        if let (Some(owner), Some(paths), false) = (owner, applied_paths, dry_run) {
            self.applied
                .entry((info.storage_key(), Self::key(info, ns, name)))
                .or_default()
                .insert(owner, paths);
        }
        Ok((updated, false))
    }

    /// Removes from `patched` the fields `owner`'s previous apply set and this one leaves out,
    /// unless another manager's apply set them too: what field ownership does on the real
    /// server (a manager that stops applying a field gives it up, and the field goes).
    fn drop_unapplied(
        &self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        owner: &(String, bool),
        paths: &[Vec<String>],
        patched: &mut Value,
    ) {
        let Some(managers) = self
            .applied
            .get(&(info.storage_key(), Self::key(info, ns, name)))
        else {
            return;
        };
        let Some(previous) = managers.get(owner) else {
            return;
        };
        let overlaps = |a: &[String], b: &[String]| a.starts_with(b) || b.starts_with(a);
        for path in previous {
            let still_applied = paths.iter().any(|p| overlaps(p, path));
            let owned_elsewhere = managers
                .iter()
                .filter(|(other, _)| *other != owner)
                .any(|(_, theirs)| theirs.iter().any(|p| overlaps(p, path)));
            if !still_applied && !owned_elsewhere {
                remove_path(patched, path);
            }
        }
    }

    /// DELETE: removes an object after checking preconditions; answers with its last state.
    pub(crate) fn delete(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        name: &str,
        pre: &Preconditions,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let key = Self::key(info, ns, name);
        let Some(existing) = self.objects(info).and_then(|o| o.get(&key)).cloned() else {
            return Err(ApiError::not_found(info, name));
        };
        if let Some(uid) = &pre.uid {
            let actual = existing["metadata"]["uid"].as_str().unwrap_or_default();
            if uid != actual {
                return Err(ApiError::delete_precondition_failed(
                    info,
                    name,
                    &format!(
                        "the UID in the precondition ({uid}) does not match the UID in record ({actual}). The object might have been deleted and then recreated"
                    ),
                ));
            }
        }
        if let Some(rv) = &pre.resource_version {
            let actual = rv_of(&existing);
            if rv != actual {
                return Err(ApiError::delete_precondition_failed(
                    info,
                    name,
                    &format!(
                        "the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record ({actual}). The object might have been modified"
                    ),
                ));
            }
        }
        if dry_run {
            return Ok(Self::present(info, &existing));
        }
        Ok(self.remove(info, key))
    }

    fn remove(&mut self, info: &ResourceInfo, key: (String, String)) -> Value {
        let storage = info.storage_key();
        let Some(mut object) = self.objects.get_mut(&storage).and_then(|o| o.remove(&key)) else {
            return Value::Null;
        };
        self.applied.remove(&(storage.clone(), key.clone()));
        let rv = self.bump();
        meta_mut(&mut object).insert("resourceVersion".to_owned(), json!(rv.to_string()));
        self.emit(storage, EventType::Deleted, object.clone(), None);
        if info.group == "apiextensions.k8s.io"
            && info.plural == "customresourcedefinitions"
            && let Ok(versions) = crd_resources(&object)
            && let Some(first) = versions.into_iter().next()
        {
            self.drop_all(&first);
            self.registry.unregister(&first.storage_key());
        }
        if info.group.is_empty() && info.plural == "namespaces" {
            // The namespace controller deletes everything inside; this server does it at once.
            let namespace = key.1;
            let keys: Vec<StorageKey> = self.objects.keys().cloned().collect();
            for storage in keys {
                let names: Vec<(String, String)> = self.objects[&storage]
                    .keys()
                    .filter(|(ns, _)| ns == &namespace)
                    .cloned()
                    .collect();
                for k in names {
                    if let Some(mut obj) = self.objects.get_mut(&storage).and_then(|o| o.remove(&k))
                    {
                        let rv = self.bump();
                        meta_mut(&mut obj)
                            .insert("resourceVersion".to_owned(), json!(rv.to_string()));
                        self.emit(storage.clone(), EventType::Deleted, obj, None);
                    }
                }
            }
        }
        Self::present(info, &object)
    }

    fn drop_all(&mut self, info: &ResourceInfo) {
        let keys: Vec<(String, String)> = self
            .objects(info)
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        for key in keys {
            self.remove(info, key);
        }
    }

    /// DELETE on a collection: removes every matching object.
    pub(crate) fn delete_collection(
        &mut self,
        info: &ResourceInfo,
        selection: &Selection,
    ) -> Vec<Value> {
        let keys: Vec<(String, String)> = self
            .objects(info)
            .map(|objs| {
                objs.iter()
                    .filter(|(_, o)| selection.matches(o))
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default();
        keys.into_iter().map(|k| self.remove(info, k)).collect()
    }

    /// Starts a watch: the events to send first and a receiver for later ones, taken under one
    /// lock so nothing falls between them. `from` is None or 0 for "current state first".
    pub(crate) fn watch_start(
        &self,
        info: &ResourceInfo,
        selection: &Selection,
        from: Option<u64>,
    ) -> Result<WatchStart, ApiError> {
        let key = info.storage_key();
        let initial = match from {
            None | Some(0) => self
                .objects(info)
                .map(|objs| {
                    objs.values()
                        .filter(|o| selection.matches(o))
                        .map(|o| {
                            Arc::new(Event {
                                rv: self.rv,
                                key: key.clone(),
                                kind: EventType::Added,
                                object: Arc::new(o.clone()),
                                old: None,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Some(rv) => {
                if rv < self.compacted {
                    return Err(ApiError::expired(rv, self.compacted + 1));
                }
                self.history
                    .iter()
                    .filter(|e| e.rv > rv && e.key == key)
                    .cloned()
                    .collect()
            }
        };
        // A watch that starts from the current state is at the store's resourceVersion even
        // when nothing matches (its first bookmark must not say "0").
        let rv = match from {
            None | Some(0) => self.rv,
            Some(rv) => rv,
        };
        Ok(WatchStart {
            initial,
            rv,
            events: self.tx.subscribe(),
        })
    }
}

/// Strategic merge patch for the simple cases the project uses: a JSON merge patch in which
/// lists of objects that carry a `name` are merged item by item on that key (containers,
/// ports, conditions by `type`), and `$patch: delete` removes such an item.
fn strategic_merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, pv) in p {
                if pv.is_null() {
                    t.remove(k);
                    continue;
                }
                match t.get_mut(k) {
                    Some(tv) => strategic_merge(tv, pv),
                    None => {
                        t.insert(k.clone(), pv.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(p)) if merge_key(p).is_some() && merge_key(t).is_some() => {
            let Some(key) = merge_key(p) else { return };
            for item in p {
                let id = item[key].clone();
                let pos = t.iter().position(|x| x[key] == id);
                let delete = item["$patch"] == "delete";
                match (pos, delete) {
                    (Some(i), true) => {
                        t.remove(i);
                    }
                    (Some(i), false) => strategic_merge(&mut t[i], item),
                    (None, false) => t.push(item.clone()),
                    (None, true) => {}
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn merge_key(items: &[Value]) -> Option<&'static str> {
    ["name", "type", "containerPort", "port", "ip"]
        .into_iter()
        .find(|k| !items.is_empty() && items.iter().all(|i| i.get(*k).is_some()))
}

/// The leaf paths an apply body sets, for field ownership: objects are walked into, lists and
/// scalars are leaves (lists are owned whole here: the real server merges lists of `listType:
/// map` by key). Identity fields are no one's to own; an apply to the status subresource owns
/// only `status`, one to the main resource everything else.
fn applied_leaves(patch: &Value, sub: Sub) -> Vec<Vec<String>> {
    fn walk(value: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match value {
            Value::Object(map) if !map.is_empty() => {
                for (key, child) in map {
                    path.push(key.clone());
                    walk(child, path, out);
                    path.pop();
                }
            }
            _ => out.push(path.clone()),
        }
    }
    let mut out = Vec::new();
    walk(patch, &mut Vec::new(), &mut out);
    out.retain(|path| {
        let first = path.first().map(String::as_str);
        let identity = matches!(first, Some("apiVersion" | "kind"))
            || (first == Some("metadata")
                && matches!(
                    path.get(1).map(String::as_str),
                    Some("name" | "namespace" | "resourceVersion" | "uid" | "generation")
                ));
        let status = first == Some("status");
        !identity && status == (sub == Sub::Status)
    });
    out
}

/// Removes the field at `path` (nothing when it is not there).
fn remove_path(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut at = value;
    for key in parents {
        match at.get_mut(key.as_str()) {
            Some(next) => at = next,
            None => return,
        }
    }
    if let Some(map) = at.as_object_mut() {
        map.remove(last.as_str());
    }
}
