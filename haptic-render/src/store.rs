//! Stores of watched resources: a sorted list, lookup by namespace and name, and lookup by
//! configured index fields, all independent of the order in which watch events arrived.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, btree_map};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use tera::Value;
use tera::value::{Key, Map};

use crate::derived::{Derivation, DerivedView, Extracts};
use crate::value::{Interner, compact, map_value, to_tera};

/// What can go wrong while configuring a store or putting a resource into it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// An `indexBy` entry is not a field path this crate understands.
    #[error("index field `{path}` is not a valid field path: {reason}")]
    InvalidFieldPath {
        /// The path as configured.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `indexBy` is empty: a store needs at least one field to index by.
    #[error("store `{store}`: indexBy is empty; give at least one field")]
    EmptyIndex {
        /// The store's name.
        store: String,
    },
    /// A store name is not usable from a template.
    #[error(
        "store name `{0}` is not usable in templates: use letters, digits and `_`, not starting with a digit"
    )]
    InvalidStoreName(String),
    /// A derived view's name is not usable in templates.
    #[error(
        "derived view name `{0}` is not usable in templates: use letters, digits and `_`, not starting with a digit"
    )]
    InvalidDerivedName(String),
    /// A derived view with this name exists already.
    #[error("there is already a derived view named `{0}`")]
    DuplicateDerivedName(String),
    /// A derived view reads a store that does not exist.
    #[error("derived view `{view}` reads store `{store}`, which is not among the stores ({known})")]
    UnknownStore {
        /// The derived view.
        view: String,
        /// The store it names.
        store: String,
        /// The stores there are.
        known: String,
    },
    /// The resource is not a JSON object.
    #[error("resource is not a JSON object")]
    NotAnObject,
    /// The resource has no `metadata.name` string.
    #[error("resource has no metadata.name")]
    MissingName,
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a store indexes its resources (the `indexBy` of a watched resource in the CRD).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreConfig {
    /// Field paths whose values, joined with `/`, form the index key that `lookup` matches.
    ///
    /// A path is dot-separated; a key that itself contains dots or slashes goes in brackets and
    /// quotes: `metadata.labels["kubernetes.io/service-name"]`. A resource that lacks one of the
    /// fields is left out of the index (it is still listed and found by `get`).
    ///
    /// Default: `["metadata.namespace", "metadata.name"]`.
    #[serde(default = "StoreConfig::default_index_by")]
    pub index_by: Vec<String>,
    /// Field paths dropped from every resource as it arrives: templates never see them and
    /// the store does not hold them. Same path syntax as `index_by`.
    ///
    /// Default: `metadata.managedFields` and the
    /// `kubectl.kubernetes.io/last-applied-configuration` annotation, which together are often
    /// larger than the rest of a resource and mean nothing to HAProxy.
    #[serde(default = "StoreConfig::default_ignore_fields")]
    pub ignore_fields: Vec<String>,
}

impl StoreConfig {
    fn default_index_by() -> Vec<String> {
        vec!["metadata.namespace".into(), "metadata.name".into()]
    }

    fn default_ignore_fields() -> Vec<String> {
        vec![
            "metadata.managedFields".into(),
            r#"metadata.annotations["kubectl.kubernetes.io/last-applied-configuration"]"#.into(),
        ]
    }

    /// Checks that `index_by` is not empty and that every path parses; the error names the
    /// broken rule or path.
    pub fn validate(&self) -> Result<()> {
        if self.index_by.is_empty() {
            return Err(Error::EmptyIndex {
                store: String::new(),
            });
        }
        for path in self.index_by.iter().chain(&self.ignore_fields) {
            FieldPath::parse(path)?;
        }
        Ok(())
    }

    /// A config indexing by the given field paths.
    pub fn index_by<I, S>(fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            index_by: fields.into_iter().map(Into::into).collect(),
            ignore_fields: Self::default_ignore_fields(),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            index_by: Self::default_index_by(),
            ignore_fields: Self::default_ignore_fields(),
        }
    }
}

/// One segment-by-segment path into a JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldPath(pub(crate) Vec<String>);

impl FieldPath {
    /// Parses `a.b["c.d/e"].f`.
    pub(crate) fn parse(path: &str) -> Result<Self> {
        let invalid = |reason| Error::InvalidFieldPath {
            path: path.to_owned(),
            reason,
        };
        let mut segments = Vec::new();
        let mut rest = path;
        while !rest.is_empty() {
            if let Some(after) = rest.strip_prefix('[') {
                let quote = after
                    .chars()
                    .next()
                    .filter(|c| *c == '"' || *c == '\'')
                    .ok_or_else(|| invalid("a bracket must hold a quoted key"))?;
                let inner = &after[1..];
                let end = inner
                    .find(quote)
                    .ok_or_else(|| invalid("unterminated quoted key"))?;
                segments.push(inner[..end].to_owned());
                rest = inner[end + 1..]
                    .strip_prefix(']')
                    .ok_or_else(|| invalid("expected `]` after the quoted key"))?;
            } else {
                let end = rest.find(['.', '[']).unwrap_or(rest.len());
                if end == 0 {
                    return Err(invalid("empty segment"));
                }
                segments.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
            if let Some(after) = rest.strip_prefix('.') {
                if after.is_empty() || after.starts_with('.') {
                    return Err(invalid("empty segment"));
                }
                rest = after;
            } else if !rest.is_empty() && !rest.starts_with('[') {
                return Err(invalid("unexpected character after a quoted key"));
            }
        }
        if segments.is_empty() {
            return Err(invalid("empty path"));
        }
        Ok(Self(segments))
    }

    /// The value at this path, if every segment exists.
    pub(crate) fn resolve<'a>(&self, json: &'a Json) -> Option<&'a Json> {
        self.0.iter().try_fold(json, |value, key| value.get(key))
    }
}

/// The string form of an index field's value: strings as they are, numbers and booleans in
/// their JSON form; anything else does not index.
fn index_part(value: &Json) -> Option<String> {
    match value {
        Json::String(s) => Some(s.clone()),
        Json::Number(n) => Some(n.to_string()),
        Json::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A resource's value as a store keeps it: the template value, converted once when it
/// arrives, or in a compact store ([`Store::set_compact`]) its JSON, made into a template
/// value each time it is read ([`Stored::get`]).
#[derive(Debug, Clone)]
pub(crate) struct Stored(Value);

impl Stored {
    /// The template value of the resource.
    pub(crate) fn get(&self) -> Cow<'_, Value> {
        crate::value::expand(&self.0)
    }

    /// The resource as JSON (parsed from what a compact store holds).
    pub(crate) fn json(&self) -> Json {
        match self.0.as_bytes() {
            Some(bytes) => serde_json::from_slice(bytes).unwrap_or(Json::Null),
            None => serde_json::to_value(&self.0).unwrap_or(Json::Null),
        }
    }

    /// What the store holds: the template value, or (compact) its JSON as bytes, which
    /// `get()` in a template expands ([`crate::value::expand`]). The same allocation until
    /// the resource changes: what a fragment's recorded read compares.
    pub(crate) fn raw(&self) -> &Value {
        &self.0
    }
}

/// A resource as a store keeps it: converted once, when it arrives.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    value: Stored,
    index_key: Option<String>,
    /// What derived views take from this resource, on first use.
    extracts: Arc<Extracts>,
}

/// What a template sees of a store, built once after each change and shared by renders.
///
/// The parts no template of a set reads are not built ([`Wants`]): at 10,000 resources,
/// rebuilding the list and the index after each event cost more than the rest of the view.
#[derive(Debug)]
pub(crate) struct StoreView {
    /// All resources, sorted by namespace then name (`resources.<store>`, and the items of a
    /// per-item output); none when not wanted.
    pub(crate) list: Option<Value>,
    /// namespace -> name -> resource (what `get` finds; in a compact store the resource's
    /// JSON as bytes, which `get` expands): after an event only the maps of
    /// the outer map and of the namespace changed are copied, not every resource's entry.
    pub(crate) by_name: Value,
    /// index key -> resources with that key, sorted by namespace then name (what `lookup`
    /// finds); none when not wanted.
    pub(crate) by_index: Option<Value>,
}

/// Which parts of a store's view a render reads besides `by_name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wants {
    /// The list of resources.
    pub(crate) list: bool,
    /// The index.
    pub(crate) index: bool,
}

impl Wants {
    /// Every part.
    pub(crate) const ALL: Self = Self {
        list: true,
        index: true,
    };

    /// Whether a view of parts `built` has these.
    fn met_by(self, view: &StoreView) -> bool {
        (!self.list || view.list.is_some()) && (!self.index || view.by_index.is_some())
    }
}

/// The resource `key` names in a view's map of `var` (`GET_VAR`: `namespace/name`, looked up
/// namespace first; `INDEX_VAR`: the index key).
pub(crate) fn find_in(map: &Value, by_name: bool, key: &str) -> Option<Value> {
    let map = map.as_map()?;
    if !by_name {
        return map.get(&Key::Str(key)).cloned();
    }
    let (namespace, name) = key.split_once('/')?;
    map.get(&Key::Str(namespace))?
        .as_map()?
        .get(&Key::Str(name))
        .cloned()
}

/// The watched resources of one kind, kept sorted by namespace and name.
///
/// A store is fed from watch events ([`Store::apply`], [`Store::remove`]); what a template sees
/// never depends on the order of those events, only on the set of resources.
#[derive(Debug, Clone)]
pub struct Store {
    config: StoreConfig,
    index: Vec<FieldPath>,
    ignore: Vec<FieldPath>,
    items: BTreeMap<(String, String), Entry>,
    view: OnceLock<Arc<StoreView>>,
    interner: Interner,
    /// Changes with every change of the contents, and is never the same for two different
    /// stores: what derived views compare to know they are stale.
    generation: u64,
    /// The last changes, oldest first: the generation each one left and the key it changed,
    /// for views that patch themselves ([`Store::changes_since`]).
    log: std::collections::VecDeque<Logged>,
    /// The last view built and the generation it is of, when a change since made it stale:
    /// the next view is this one patched ([`Store::patched_view`]).
    stale: Option<(u64, Arc<StoreView>)>,
    /// Resources are kept as JSON ([`Store::set_compact`]).
    compact: bool,
}

/// One change a store remembers: the generation it left, the key it changed, and the index
/// keys of the resource before and after.
#[derive(Debug, Clone)]
struct Logged {
    left: u64,
    key: (String, String),
    index_keys: [Option<String>; 2],
}

/// The most changes a store view is patched for; after more, it is built again.
const PATCH_LEN: usize = 16;

/// How many changes a store remembers for [`Store::changes_since`]: a view staler than that
/// is rebuilt.
const LOG_LEN: usize = 64;

/// Source of [`Store::generation`] values: unique across every store of the process.
fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Store {
    /// An empty store with the given configuration (checked with [`StoreConfig::validate`]).
    pub fn new(config: StoreConfig) -> Result<Self> {
        config.validate()?;
        let parse = |paths: &[String]| {
            paths
                .iter()
                .map(|path| FieldPath::parse(path))
                .collect::<Result<Vec<_>>>()
        };
        let index = parse(&config.index_by)?;
        let ignore = parse(&config.ignore_fields)?;
        Ok(Self {
            config,
            index,
            ignore,
            items: BTreeMap::new(),
            view: OnceLock::new(),
            interner: Interner::default(),
            generation: next_generation(),
            log: std::collections::VecDeque::new(),
            stale: None,
            compact: false,
        })
    }

    /// Keeps each resource as its JSON (compact), made into a template value when read,
    /// rather than as a template value: for a store whose resources no template lists or
    /// looks up by index and no derived view keeps whole, which only derived views (once per
    /// version of a resource) and `get()` (one resource) read. A template value costs ~100
    /// bytes a map and ~80 an entry (tera's maps are hash maps): a Service or EndpointSlice
    /// as the API server gives it, 2-4 KB, is 0.5-1 KB of JSON. What templates and views see
    /// is the same either way. Switching converts what the store holds.
    pub fn set_compact(&mut self, compact: bool) {
        if self.compact == compact {
            return;
        }
        self.compact = compact;
        for entry in self.items.values_mut() {
            let value = entry.value.get().into_owned();
            entry.value = Stored(if compact {
                self::compact(&value)
            } else {
                value
            });
        }
        // The views hold what the entries held.
        self.view = OnceLock::new();
        self.stale = None;
        self.interner = Interner::default();
    }

    /// Whether resources are kept as JSON ([`Store::set_compact`]).
    pub fn is_compact(&self) -> bool {
        self.compact
    }

    /// The configuration this store was made with.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Adds a resource or replaces the one with the same namespace and name.
    ///
    /// Cluster-scoped resources (no `metadata.namespace`) are keyed with an empty namespace.
    pub fn apply(&mut self, resource: &Json) -> Result<()> {
        let mut interner = std::mem::take(&mut self.interner);
        let converted = self.convert(resource, &mut interner);
        self.interner = interner;
        let (key, entry) = converted?;
        let after = entry.index_key.clone();
        let before = self
            .items
            .insert(key.clone(), entry)
            .and_then(|e| e.index_key);
        self.changed(key, [before, after]);
        Ok(())
    }

    /// A resource as this store would keep it: its key and its converted entry.
    fn convert(
        &self,
        resource: &Json,
        interner: &mut Interner,
    ) -> Result<((String, String), Entry)> {
        if !resource.is_object() {
            return Err(Error::NotAnObject);
        }
        let metadata = resource.get("metadata");
        let name = metadata
            .and_then(|m| m.get("name"))
            .and_then(Json::as_str)
            .ok_or(Error::MissingName)?;
        let namespace = metadata
            .and_then(|m| m.get("namespace"))
            .and_then(Json::as_str)
            .unwrap_or("");
        let index_key = self
            .index
            .iter()
            .map(|path| path.resolve(resource).and_then(index_part))
            .collect::<Option<Vec<_>>>()
            .map(|parts| parts.join("/"));
        let value = if self.compact {
            // Shared subtrees would stay in the interner for nothing: the JSON is what stays.
            compact(&to_tera(resource, &mut Interner::default(), &self.ignore))
        } else {
            to_tera(resource, interner, &self.ignore)
        };
        let entry = Entry {
            value: Stored(value),
            index_key,
            extracts: Arc::default(),
        };
        Ok(((namespace.to_owned(), name.to_owned()), entry))
    }

    /// Removes a resource; returns whether it was there.
    pub fn remove(&mut self, namespace: &str, name: &str) -> bool {
        let key = (namespace.to_owned(), name.to_owned());
        let removed = self.items.remove(&key);
        let done = removed.is_some();
        if let Some(entry) = removed {
            self.changed(key, [entry.index_key, None]);
        }
        done
    }

    /// Whether a resource with this namespace and name is stored.
    pub fn contains(&self, namespace: &str, name: &str) -> bool {
        self.items
            .contains_key(&(namespace.to_owned(), name.to_owned()))
    }

    /// How many resources are stored.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// The namespace and name of every stored resource, sorted: what a watcher compares with a
    /// fresh list to remove the resources that disappeared while it was not watching.
    pub fn keys(&self) -> impl Iterator<Item = (&str, &str)> {
        self.items
            .keys()
            .map(|(ns, name)| (ns.as_str(), name.as_str()))
    }

    /// The resources as JSON, sorted by namespace then name, as templates see them (ignored
    /// fields dropped): for callers outside templates, such as a test's JSONPath.
    pub fn json(&self) -> Json {
        let list: Vec<Value> = self
            .items
            .values()
            .map(|e| e.value.get().into_owned())
            .collect();
        serde_json::to_value(Value::from(list)).unwrap_or(Json::Null)
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The value at a dotted `path` (`status.loadBalancer`) of a stored resource, as JSON
    /// (what the store kept of it: ignored fields are gone); `None` when the resource or the
    /// path is not there.
    pub fn value_at(&self, namespace: &str, name: &str, path: &str) -> Option<Json> {
        let entry = self.items.get(&(namespace.to_owned(), name.to_owned()))?;
        if let Some(bytes) = entry.value.raw().as_bytes() {
            // A compact store's JSON, read as JSON (no template value made of it).
            let json: Json = serde_json::from_slice(bytes).ok()?;
            let found = path.split('.').try_fold(&json, |at, part| match at {
                Json::Array(items) => items.get(part.parse::<usize>().ok()?),
                _ => at.get(part),
            })?;
            return (!found.is_null()).then(|| found.clone());
        }
        let whole = entry.value.get();
        let value = whole.get_from_path(path)?;
        if value.is_undefined() || value.is_none() {
            return None;
        }
        serde_json::to_value(value).ok()
    }

    fn changed(&mut self, key: (String, String), index_keys: [Option<String>; 2]) {
        if let Some(view) = self.view.take() {
            self.stale = Some((self.generation, view));
        }
        if self.log.len() == LOG_LEN {
            self.log.pop_front();
        }
        self.log.push_back(Logged {
            left: self.generation,
            key,
            index_keys,
        });
        self.generation = next_generation();
    }

    /// The changes since the store was at `generation`, oldest first.
    fn logged_since(&self, generation: u64) -> Option<impl Iterator<Item = &Logged>> {
        let start = if generation == self.generation {
            self.log.len()
        } else {
            self.log
                .iter()
                .position(|logged| logged.left == generation)?
        };
        Some(self.log.iter().skip(start))
    }

    /// The keys of the resources changed (applied or removed) since the store was at
    /// `generation`, oldest first, a key once per change; `None` when the store does not
    /// remember back that far (or never was at `generation`).
    pub(crate) fn changes_since(&self, generation: u64) -> Option<Vec<&(String, String)>> {
        Some(
            self.logged_since(generation)?
                .map(|logged| &logged.key)
                .collect(),
        )
    }

    /// The resource with this namespace and name, and its extracts.
    pub(crate) fn get_entry(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<(&Stored, &Arc<Extracts>)> {
        self.items
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|e| (&e.value, &e.extracts))
    }

    /// Changes with every change of the contents; never the same for two different stores.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The template view with (at least) the parts `wants` names, built on first use after
    /// a change and kept; a view kept without a part wanted now is built again for this
    /// caller alone (two renderers of different template sets on the same stores).
    pub(crate) fn view(&self, wants: Wants) -> Arc<StoreView> {
        let view = self.view.get_or_init(|| Arc::new(self.build_view(wants)));
        if wants.met_by(view) {
            Arc::clone(view)
        } else {
            Arc::new(build_view(|| self.items.iter(), Wants::ALL))
        }
    }

    fn build_view(&self, wants: Wants) -> StoreView {
        self.patched_view(wants)
            .unwrap_or_else(|| build_view(|| self.items.iter(), wants))
    }

    /// The last view built, patched for the few changes since (what a full build gives, in
    /// the same order; the resources that did not change are the same values), or `None`.
    fn patched_view(&self, wants: Wants) -> Option<StoreView> {
        let (generation, old) = self.stale.as_ref()?;
        let logged: Vec<&Logged> = self.logged_since(*generation)?.collect();
        if logged.len() > PATCH_LEN || (wants.index && old.by_index.is_none()) {
            return None;
        }
        // By namespace: the names changed there.
        let mut keys: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for l in &logged {
            keys.entry(&l.key.0).or_default().insert(&l.key.1);
        }
        let mut by_name = old.by_name.as_map()?.clone();
        for (namespace, names) in keys {
            let at = by_name.binary_search_by(|k, _| k.as_str().cmp(&Some(namespace)));
            let mut inner = match at {
                Ok(at) => by_name
                    .get_index(at)
                    .and_then(|(_, v)| v.as_map())
                    .cloned()
                    .unwrap_or_default(),
                Err(_) => Map::new(),
            };
            for name in names {
                let found = inner.binary_search_by(|k, _| k.as_str().cmp(&Some(name)));
                match (
                    self.items.get(&(namespace.to_owned(), name.to_owned())),
                    found,
                ) {
                    (None, Ok(i)) => {
                        inner.shift_remove_index(i);
                    }
                    (None, Err(_)) => {}
                    (Some(entry), Ok(i)) => {
                        if let Some((_, value)) = inner.get_index_mut(i) {
                            *value = entry.value.raw().clone();
                        }
                    }
                    (Some(entry), Err(i)) => {
                        inner.shift_insert(i, name.to_owned().into(), entry.value.raw().clone());
                    }
                }
            }
            match (inner.is_empty(), at) {
                (true, Ok(at)) => {
                    by_name.shift_remove_index(at);
                }
                (true, Err(_)) => {}
                (false, Ok(at)) => {
                    if let Some((_, value)) = by_name.get_index_mut(at) {
                        *value = Value::from(inner);
                    }
                }
                (false, Err(at)) => {
                    by_name.shift_insert(at, namespace.to_owned().into(), Value::from(inner));
                }
            }
        }
        let by_index = match (&old.by_index, wants.index) {
            (Some(old_index), true) => Some(self.patched_index(&logged, old_index)?),
            _ => None,
        };
        let list = wants.list.then(|| {
            let list: Vec<Value> = self
                .items
                .values()
                .map(|e| e.value.get().into_owned())
                .collect();
            Value::from(list)
        });
        Some(StoreView {
            list,
            by_name: Value::from(by_name),
            by_index,
        })
    }

    /// The index of a view, patched for the changes `logged`.
    fn patched_index(&self, logged: &[&Logged], old: &Value) -> Option<Value> {
        let touched: BTreeSet<&str> = logged
            .iter()
            .flat_map(|l| l.index_keys.iter().flatten())
            .map(String::as_str)
            .collect();
        if touched.is_empty() {
            return Some(old.clone());
        }
        let mut by_index = old.as_map()?.clone();
        let mut lists: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for entry in self.items.values() {
            if let Some(index) = entry.index_key.as_deref()
                && touched.contains(index)
            {
                lists
                    .entry(index)
                    .or_default()
                    .push(entry.value.get().into_owned());
            }
        }
        for index in touched {
            let found = by_index.binary_search_by(|k, _| k.as_str().cmp(&Some(index)));
            match (lists.remove(index), found) {
                (Some(list), Ok(at)) => {
                    if let Some((_, value)) = by_index.get_index_mut(at) {
                        *value = Value::from(list);
                    }
                }
                (Some(list), Err(at)) => {
                    by_index.shift_insert(at, index.to_owned().into(), Value::from(list));
                }
                (None, Ok(at)) => {
                    by_index.shift_remove_index(at);
                }
                (None, Err(_)) => {}
            }
        }
        Some(Value::from(by_index))
    }

    /// This store as a derivation input.
    pub(crate) fn source(&self) -> Source<'_> {
        Source {
            base: self,
            over: None,
        }
    }
}

/// The template view of `(key, entry)` pairs given in (namespace, name) order, with the
/// parts `wants` names.
fn build_view<'a, I>(entries: impl Fn() -> I, wants: Wants) -> StoreView
where
    I: Iterator<Item = (&'a (String, String), &'a Entry)>,
{
    let list = wants.list.then(|| {
        let list: Vec<Value> = entries().map(|(_, e)| e.value.get().into_owned()).collect();
        Value::from(list)
    });
    let mut by_name = Map::new();
    let mut namespace: Option<(&str, Map)> = None;
    for ((ns, name), e) in entries() {
        match &mut namespace {
            Some((current, inner)) if *current == ns.as_str() => {
                inner.insert(name.clone().into(), e.value.raw().clone());
            }
            _ => {
                if let Some((done, inner)) = namespace.take() {
                    by_name.insert(done.to_owned().into(), Value::from(inner));
                }
                let mut inner = Map::new();
                inner.insert(name.clone().into(), e.value.raw().clone());
                namespace = Some((ns, inner));
            }
        }
    }
    if let Some((done, inner)) = namespace {
        by_name.insert(done.to_owned().into(), Value::from(inner));
    }
    let by_index = wants.index.then(|| {
        let mut index: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for (_, entry) in entries() {
            if let Some(key) = &entry.index_key {
                index
                    .entry(key)
                    .or_default()
                    .push(entry.value.get().into_owned());
            }
        }
        map_value(index.into_iter().map(|(k, v)| (k, Value::from(v))))
    });
    StoreView {
        list,
        by_name: Value::from(by_name),
        by_index,
    }
}

/// One change laid over [`Stores`] without copying them: a resource applied to one store, or
/// removed from it, seen by [`Renderer::render_overlay`](crate::Renderer::render_overlay) as
/// if the store held it, while the stores themselves are left as they are (what an admission
/// webhook needs: render the cluster as it would be after the change, and forget it).
#[derive(Debug)]
pub struct Overlay {
    pub(crate) store: String,
    pub(crate) key: (String, String),
    /// The converted resource; none for a removal.
    pub(crate) entry: Option<Entry>,
    pub(crate) generation: u64,
}

impl Overlay {
    /// The store the change is in.
    pub fn store(&self) -> &str {
        &self.store
    }

    /// The namespace and name of the resource changed.
    pub fn key(&self) -> (&str, &str) {
        (&self.key.0, &self.key.1)
    }

    /// Whether the change removes the resource.
    pub fn is_removal(&self) -> bool {
        self.entry.is_none()
    }
}

/// A store as a derivation or a render reads it: the store itself, or the store with an
/// [`Overlay`]'s change laid over it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source<'a> {
    base: &'a Store,
    over: Option<&'a Overlay>,
}

/// An entry as a [`Source`] lists it.
pub(crate) type EntryRef<'a> = (&'a (String, String), &'a Stored, &'a Arc<Extracts>);

impl<'a> Source<'a> {
    /// The `(key, entry)` pairs in (namespace, name) order, the overlay's change included.
    fn pairs(self) -> Box<dyn Iterator<Item = (&'a (String, String), &'a Entry)> + 'a> {
        match self.over {
            None => Box::new(self.base.items.iter()),
            Some(over) => {
                use std::ops::Bound::{Excluded, Unbounded};
                let before = self.base.items.range::<(String, String), _>(..&over.key);
                let after = self
                    .base
                    .items
                    .range::<(String, String), _>((Excluded(&over.key), Unbounded));
                Box::new(
                    before
                        .chain(over.entry.as_ref().map(|e| (&over.key, e)))
                        .chain(after),
                )
            }
        }
    }

    /// Resources as `((namespace, name), value, extracts)`, sorted by namespace then name.
    pub(crate) fn entries(self) -> impl Iterator<Item = EntryRef<'a>> + 'a {
        self.pairs().map(|(k, e)| (k, &e.value, &e.extracts))
    }

    /// The resource with this namespace and name, and its extracts.
    pub(crate) fn get_entry(
        self,
        namespace: &str,
        name: &str,
    ) -> Option<(&'a Stored, &'a Arc<Extracts>)> {
        if let Some(over) = self.over
            && over.key.0 == namespace
            && over.key.1 == name
        {
            return over.entry.as_ref().map(|e| (&e.value, &e.extracts));
        }
        self.base.get_entry(namespace, name)
    }

    /// How many resources there are.
    pub(crate) fn len(self) -> usize {
        match self.over {
            None => self.base.len(),
            Some(over) => {
                let had = self.base.items.contains_key(&over.key);
                self.base.len() + usize::from(over.entry.is_some()) - usize::from(had)
            }
        }
    }

    /// Changes with every change of the contents (an overlaid store has its own).
    pub(crate) fn generation(self) -> u64 {
        self.over.map_or(self.base.generation, |o| o.generation)
    }

    /// The template view: the store's own, or one built for the overlay (not kept).
    pub(crate) fn view(self, wants: Wants) -> Arc<StoreView> {
        match self.over {
            None => self.base.view(wants),
            Some(_) => Arc::new(build_view(|| self.pairs(), wants)),
        }
    }
}

/// The watched resources by name, and the views derived from them: what a render reads.
#[derive(Debug, Clone, Default)]
pub struct Stores {
    stores: BTreeMap<String, Store>,
    derived: BTreeMap<String, DerivedView>,
}

impl Stores {
    /// No stores.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) an empty store under `name` and returns it.
    ///
    /// Templates see it as `resources.<name>`, so the name must be an identifier.
    pub fn add(&mut self, name: impl Into<String>, config: StoreConfig) -> Result<&mut Store> {
        let name = name.into();
        if !is_identifier(&name) {
            return Err(Error::InvalidStoreName(name));
        }
        let store = Store::new(config).map_err(|e| match e {
            Error::EmptyIndex { .. } => Error::EmptyIndex {
                store: name.clone(),
            },
            other => other,
        })?;
        Ok(match self.stores.entry(name) {
            btree_map::Entry::Vacant(slot) => slot.insert(store),
            btree_map::Entry::Occupied(mut slot) => {
                slot.insert(store);
                slot.into_mut()
            }
        })
    }

    /// Puts a store made elsewhere (for instance one kept from an earlier [`Stores`] whose
    /// watcher goes on) under `name`, replacing any there; returns the one replaced.
    pub fn insert(&mut self, name: impl Into<String>, store: Store) -> Result<Option<Store>> {
        let name = name.into();
        if !is_identifier(&name) {
            return Err(Error::InvalidStoreName(name));
        }
        Ok(self.stores.insert(name, store))
    }

    /// Takes the stores out, by name, dropping the derived views (they belong to a config):
    /// how a new config keeps the stores whose watched resource did not change.
    pub fn into_stores(self) -> BTreeMap<String, Store> {
        self.stores
    }

    /// The store with this name.
    pub fn get(&self, name: &str) -> Option<&Store> {
        self.stores.get(name)
    }

    /// The store with this name, to apply watch events to.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Store> {
        self.stores.get_mut(name)
    }

    /// The stores whose resources a derived view's rows hold whole
    /// ([`Derivation::keeps_whole`]).
    pub fn kept_whole(&self) -> BTreeSet<&str> {
        self.derived
            .values()
            .filter_map(|view| view.derivation().keeps_whole())
            .collect()
    }

    /// Lays `change` over the store `store` without copying anything: the resource is
    /// converted as the store would convert it (ignored fields dropped, index key computed),
    /// and [`Renderer::render_overlay`](crate::Renderer::render_overlay) renders these stores
    /// as if the store held it (or, for a removal, no longer held it).
    pub fn overlay(&self, store: &str, change: Change<'_>) -> Result<Overlay, OverlayError> {
        let base = self
            .stores
            .get(store)
            .ok_or_else(|| OverlayError::UnknownStore {
                store: store.to_owned(),
                known: self.stores.keys().cloned().collect::<Vec<_>>().join(", "),
            })?;
        let (key, entry) = match change {
            Change::Apply(resource) => {
                let (key, entry) = base.convert(resource, &mut Interner::default())?;
                (key, Some(entry))
            }
            Change::Remove { namespace, name } => ((namespace.to_owned(), name.to_owned()), None),
        };
        Ok(Overlay {
            store: store.to_owned(),
            key,
            entry,
            generation: next_generation(),
        })
    }

    /// The stores as derivation inputs, `overlay` laid over its store.
    pub(crate) fn source<'a>(
        &'a self,
        name: &str,
        overlay: Option<&'a Overlay>,
    ) -> Option<Source<'a>> {
        let base = self.stores.get(name)?;
        Some(Source {
            base,
            over: overlay.filter(|o| o.store == name),
        })
    }

    /// The template view of every store (sorted by name), `overlay` laid over its store.
    pub(crate) fn views<'a>(
        &'a self,
        overlay: Option<&'a Overlay>,
        wants: &dyn Fn(&str) -> Wants,
    ) -> Vec<(&'a str, Arc<StoreView>)> {
        self.stores
            .iter()
            .map(|(name, store)| {
                let source = Source {
                    base: store,
                    over: overlay.filter(|o| o.store == *name),
                };
                (name.as_str(), source.view(wants(name)))
            })
            .collect()
    }

    /// A copy of these stores without `objects` (those not held are ignored): what a render
    /// that leaves out objects HAProxy refused reads. The copy shares every resource and its
    /// extracts with these stores (a resource's value and joins are not copied), and its
    /// derived views reuse the rows of every resource whose joins found the same versions.
    pub fn excluding(&self, objects: &[crate::ObjectRef]) -> Stores {
        let mut copy = self.clone();
        for object in objects {
            if let Some(store) = copy.stores.get_mut(&object.store) {
                store.remove(&object.namespace, &object.name);
            }
        }
        copy
    }

    /// Store names and stores, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Store)> {
        self.stores.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Adds a derived view, seen by templates as `derived.<name>` (see [`crate::derived`]).
    ///
    /// The stores it reads must have been added first. It is computed on the first render after
    /// one of them changed, and shared by renders until then.
    pub fn derive(&mut self, name: impl Into<String>, derivation: Derivation) -> Result<()> {
        let name = name.into();
        if !is_identifier(&name) {
            return Err(Error::InvalidDerivedName(name));
        }
        if self.derived.contains_key(&name) {
            return Err(Error::DuplicateDerivedName(name));
        }
        for store in derivation.inputs() {
            if !self.stores.contains_key(store) {
                return Err(Error::UnknownStore {
                    view: name,
                    store: store.to_owned(),
                    known: self.stores.keys().cloned().collect::<Vec<_>>().join(", "),
                });
            }
        }
        self.derived.insert(name, DerivedView::new(derivation));
        Ok(())
    }

    /// Whether a resource of `store` is one the derived views read. False only for an
    /// Ingress that every view reading `store` as its Ingresses leaves out by class (an
    /// Ingress of another controller's class, see [`crate::derived::IngressClassFilter`]):
    /// nothing rendered can depend on it, so the admission webhook lets it through without
    /// rendering. Likewise a Gateway that is not of a GatewayClass of a Gateway API view's
    /// controller, and an HTTPRoute none of whose parentRefs names a Gateway of such a class
    /// (stored now, or in the overlay's change). True when no view filters `store`.
    pub fn is_ours(&self, store: &str, resource: &Json) -> bool {
        let mut filtered = false;
        for view in self.derived.values() {
            let derivation = view.derivation();
            if let Some(owned) = self.gateway_owns(derivation, store, resource) {
                if owned {
                    return true;
                }
                filtered = true;
                continue;
            }
            if derivation.ingresses() != Some(store) {
                continue;
            }
            let Some(filter) = derivation.classes() else {
                return true;
            };
            let Some(classes) = self.stores.get(&filter.ingress_classes) else {
                return true;
            };
            if filter.accepts_json(classes.source(), resource) {
                return true;
            }
            filtered = true;
        }
        !filtered
    }

    /// For a Gateway API view reading `store` as its Gateways or HTTPRoutes: whether the
    /// resource belongs to one of its classes ([`crate::derived::gateway`]).
    fn gateway_owns(
        &self,
        derivation: &crate::derived::Derivation,
        store: &str,
        resource: &Json,
    ) -> Option<bool> {
        let crate::derived::Derivation::GatewayApi {
            gateway_classes,
            gateways,
            http_routes,
            controller_name,
            ..
        } = derivation
        else {
            return None;
        };
        crate::derived::gateway::owns(
            (gateways, http_routes),
            store,
            resource,
            self.stores.get(gateway_classes)?.source(),
            self.stores.get(gateways)?.source(),
            controller_name,
        )
    }

    /// The rows of the derived view `name` as JSON (computed if stale), for callers outside
    /// templates; `None` when there is no such view. (Rows are maps of strings, numbers,
    /// booleans and lists: they always convert.)
    pub fn derived_json(&self, name: &str) -> Option<Json> {
        let view = self.derived.get(name)?;
        serde_json::to_value(view.value(&self.inputs(view)?)).ok()
    }

    /// The input stores of a derived view (they exist: `derive` checked, and stores are never
    /// removed).
    fn inputs(&self, view: &DerivedView) -> Option<Vec<&Store>> {
        view.derivation()
            .inputs()
            .into_iter()
            .map(|name| self.stores.get(name))
            .collect()
    }

    /// Rebuilds, on up to `workers` threads (this one included), every store view and every
    /// derived view that a change made stale: after a watch event, the changed store's view
    /// and the derived views that read it. The derived views go first: they are the longer
    /// jobs.
    pub(crate) fn refresh(&self, workers: usize, wants: &(dyn Fn(&str) -> Wants + Sync)) {
        enum Job<'a> {
            Derived(&'a DerivedView, Vec<&'a Store>),
            Store(&'a Store, Wants),
        }
        let derived = self.derived.values().filter_map(|view| {
            let inputs = self.inputs(view)?;
            (!view.is_fresh(&inputs)).then_some(Job::Derived(view, inputs))
        });
        let stores = self
            .stores
            .iter()
            .filter(|(_, store)| store.view.get().is_none())
            .map(|(name, store)| Job::Store(store, wants(name)));
        let jobs: Vec<Job<'_>> = derived.chain(stores).collect();
        // The jobs are independent of each other: the workers take them in turn.
        let next = AtomicUsize::new(0);
        let work = || {
            while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                match job {
                    Job::Derived(view, inputs) => drop(view.value(inputs)),
                    Job::Store(store, wants) => drop(store.view(*wants)),
                }
            }
        };
        let helpers = workers.min(jobs.len()).saturating_sub(1);
        std::thread::scope(|scope| {
            for _ in 0..helpers {
                scope.spawn(work);
            }
            work();
        });
    }

    /// Derived view names and their template values, sorted by name (each recomputed first if
    /// a store it reads changed since: [`Stores::refresh`] does that ahead, in parallel). With
    /// an `overlay`, the views that read its store are computed for it (reusing the rows of
    /// every resource whose joins found the same versions, and keeping nothing); the others
    /// are the stores' own.
    pub(crate) fn derived_values_over<'a>(
        &'a self,
        overlay: Option<&'a Overlay>,
    ) -> Vec<(&'a str, Value)> {
        self.derived
            .iter()
            .filter_map(|(name, view)| {
                let inputs = view.derivation().inputs();
                let value = match overlay {
                    Some(over) if inputs.contains(&over.store.as_str()) => {
                        let sources = inputs
                            .iter()
                            .map(|input| self.source(input, overlay))
                            .collect::<Option<Vec<_>>>()?;
                        view.compute_uncached(&sources)
                    }
                    _ => view.value(&self.inputs(view)?),
                };
                Some((name.as_str(), value))
            })
            .collect()
    }
}

/// A change for [`Stores::overlay`].
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// The resource as it would be stored (created or replaced).
    Apply(&'a Json),
    /// The resource with this namespace and name removed.
    Remove {
        /// Its namespace (empty when cluster-scoped).
        namespace: &'a str,
        /// Its name.
        name: &'a str,
    },
}

/// Why [`Stores::overlay`] refused a change.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OverlayError {
    /// There is no store of that name.
    #[error("there is no store `{store}` (known: {known})")]
    UnknownStore {
        /// The store named.
        store: String,
        /// The stores there are.
        known: String,
    },
    /// The resource cannot be stored.
    #[error(transparent)]
    Resource(#[from] Error),
}

/// Whether `name` can be written as `resources.<name>` in a template.
pub(crate) fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.join("."))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn field_paths_parse_dots_and_quoted_keys() {
        let path = FieldPath::parse(r#"metadata.labels["kubernetes.io/service-name"]"#).unwrap();
        assert_eq!(path.0, ["metadata", "labels", "kubernetes.io/service-name"]);
        let path = FieldPath::parse("a['b.c'].d").unwrap();
        assert_eq!(path.0, ["a", "b.c", "d"]);
        for bad in ["", "a..b", ".a", "a.", "a[b]", "a['b'", "a['b']c", "a['b"] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn apply_requires_a_named_object() {
        let mut store = Store::new(StoreConfig::default()).unwrap();
        assert_eq!(store.apply(&json!([1])), Err(Error::NotAnObject));
        assert_eq!(
            store.apply(&json!({"metadata": {}})),
            Err(Error::MissingName)
        );
        store.apply(&json!({"metadata": {"name": "n"}})).unwrap();
        assert!(store.contains("", "n"));
    }

    #[test]
    fn a_patched_view_is_the_view_built_afresh_in_content_and_order() {
        let config = StoreConfig::index_by([
            "metadata.namespace",
            r#"metadata.labels["kubernetes.io/service-name"]"#,
        ]);
        let slice = |ns: usize, name: usize, svc: usize, v: usize| {
            json!({"metadata": {"namespace": format!("n{ns}"), "name": format!("s{name}"),
                "labels": {"kubernetes.io/service-name": format!("web{svc}")},
                "annotations": {"v": v.to_string()}}})
        };
        let keys = |v: &Value| -> Vec<String> {
            v.as_map()
                .unwrap()
                .keys()
                .map(|k| k.as_str().unwrap().to_owned())
                .collect()
        };
        let mut store = Store::new(config).unwrap();
        for i in 0..20 {
            store.apply(&slice(i % 3, i, i % 4, 0)).unwrap();
        }
        // A fixed pseudo-random walk of changes, viewed after one, two or three of them.
        let mut x: usize = 7;
        for step in 0..300 {
            for _ in 0..=(step % 3) {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345) % (1 << 31);
                let (ns, name, svc) = (x % 4, (x >> 3) % 25, (x >> 8) % 5);
                let kind = (x >> 12) % 4;
                if kind == 0 {
                    store.remove(&format!("n{ns}"), &format!("s{name}"));
                } else if kind == 1 {
                    store
                        .apply(&json!({"metadata": {"namespace": format!("n{ns}"), "name": format!("s{name}")}}))
                        .unwrap();
                } else {
                    store.apply(&slice(ns, name, svc, step)).unwrap();
                }
            }
            // Mostly the names alone (what the reference templates read), now and then
            // every part (built afresh when the view kept lacks one, patched after).
            let wants = if step % 7 < 2 {
                Wants::ALL
            } else {
                Wants {
                    list: false,
                    index: false,
                }
            };
            let patched = store.view(wants);
            let fresh = build_view(|| store.items.iter(), Wants::ALL);
            if wants.list {
                assert_eq!(patched.list, fresh.list, "step {step}: list");
            }
            assert_eq!(patched.by_name, fresh.by_name, "step {step}: by_name");
            assert_eq!(keys(&patched.by_name), keys(&fresh.by_name), "step {step}");
            for (namespace, names) in fresh.by_name.as_map().unwrap() {
                let patched_names = patched.by_name.as_map().unwrap().get(namespace).unwrap();
                assert_eq!(keys(patched_names), keys(names), "step {step}: {namespace}");
            }
            if wants.index {
                let (patched, fresh) = (patched.by_index.as_ref(), fresh.by_index.as_ref());
                assert_eq!(patched, fresh, "step {step}: by_index");
                assert_eq!(keys(patched.unwrap()), keys(fresh.unwrap()), "step {step}");
            }
        }
    }

    #[test]
    fn view_is_sorted_and_indexed_whatever_the_arrival_order() {
        let config = StoreConfig::index_by([
            "metadata.namespace",
            r#"metadata.labels["kubernetes.io/service-name"]"#,
        ]);
        let slice = |ns: &str, name: &str, svc: &str| {
            json!({"metadata": {"namespace": ns, "name": name,
                "labels": {"kubernetes.io/service-name": svc}}})
        };
        let mut store = Store::new(config).unwrap();
        store.apply(&slice("b", "s2", "web")).unwrap();
        store.apply(&slice("a", "s9", "web")).unwrap();
        store.apply(&slice("a", "s1", "web")).unwrap();
        store
            .apply(&json!({"metadata": {"namespace": "a", "name": "unlabelled"}}))
            .unwrap();
        let view = store.view(Wants::ALL);
        let names: Vec<String> = view
            .list
            .as_ref()
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.get_from_path("metadata.name").unwrap().to_string())
            .collect();
        assert_eq!(names, ["s1", "s9", "unlabelled", "s2"]);
        let a_web = view.by_index.as_ref().unwrap().as_map().unwrap();
        let hits = a_web
            .get(&tera::value::Key::Str("a/web"))
            .and_then(Value::as_array)
            .unwrap();
        assert_eq!(hits.len(), 2);
        assert_eq!(a_web.len(), 2, "the unlabelled slice is not indexed");
        assert!(store.remove("a", "s1"));
        assert!(!store.remove("a", "s1"));
        assert_eq!(store.view(Wants::ALL).list.as_ref().unwrap().len(), Some(3));
    }

    #[test]
    fn ignored_fields_are_dropped_on_arrival() {
        let mut store = Store::new(StoreConfig::default()).unwrap();
        store
            .apply(
                &json!({"metadata": {"name": "n", "managedFields": [{"manager": "kubectl"}],
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}",
                    "keep": "me"}}, "spec": {"managedFields": "not metadata"}}),
            )
            .unwrap();
        let item = store
            .view(Wants::ALL)
            .list
            .as_ref()
            .unwrap()
            .as_array()
            .unwrap()[0]
            .clone();
        assert!(item.get_from_path("metadata.managedFields").is_none());
        let annotations = item.get_from_path("metadata.annotations").unwrap();
        assert_eq!(
            annotations.as_map().unwrap().len(),
            1,
            "only `keep` is left"
        );
        assert!(item.get_from_path("spec.managedFields").is_some());
        let bad = StoreConfig {
            ignore_fields: vec!["a..b".into()],
            ..StoreConfig::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidFieldPath { .. })
        ));
    }

    #[test]
    fn store_names_must_be_identifiers() {
        let mut stores = Stores::new();
        assert!(
            stores
                .add("endpoint-slices", StoreConfig::default())
                .is_err()
        );
        let empty = StoreConfig {
            index_by: vec![],
            ..StoreConfig::default()
        };
        assert!(matches!(
            stores.add("svc", empty),
            Err(Error::EmptyIndex { store }) if store == "svc"
        ));
        assert!(stores.add("endpointslices", StoreConfig::default()).is_ok());
    }
}
