//! What templates ask the cluster to show, besides the files: Kubernetes Events
//! (`record_event(...)`) and status of watched objects (`set_status(...)`).
//!
//! Both functions render nothing. Each render collects what its templates asked for, in output
//! order, into a [`Requests`] ([`crate::Renderer::render_all`]): the same stores give the same
//! requests, whatever the number of render threads. Writing them is the controller's business
//! (its leader writes; a render never talks to the API).
//!
//! ```text
//! {% if not derived.serviceBackends[...] %}
//!   {{ record_event(object=ing, type="Warning", reason="ServiceNotFound",
//!                   message="no Service " ~ name) }}
//! {% endif %}
//! {{ set_status(object=ing, field="loadBalancer", value=haproxy_service.status.loadBalancer) }}
//! ```

use std::cell::RefCell;
use std::sync::Arc;

use serde::Serialize;
use tera::{Kwargs, State, Tera, Value};

/// An Event a template asked for with `record_event(object=, type=, reason=, message=)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct EventRequest {
    /// The object's `apiVersion`, when it has one.
    pub api_version: Option<String>,
    /// Its `kind`.
    pub kind: Option<String>,
    /// Its `metadata.namespace`.
    pub namespace: Option<String>,
    /// Its `metadata.name`.
    pub name: Option<String>,
    /// Its `metadata.uid`.
    pub uid: Option<String>,
    /// `Normal` or `Warning`.
    pub type_: String,
    /// A CamelCase reason.
    pub reason: String,
    /// The note.
    pub message: String,
}

/// Status a template declared for a watched object with
/// `set_status(object=, field=, value=)`: `status.<field>` should be `value`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusRequest {
    /// The object's `apiVersion`.
    pub api_version: String,
    /// Its `kind`.
    pub kind: String,
    /// Its `metadata.namespace` (none: cluster-scoped).
    pub namespace: Option<String>,
    /// Its `metadata.name`.
    pub name: String,
    /// The top-level field of `status` (`loadBalancer`).
    pub field: String,
    /// Its value (shared: a status a view keeps from render to render is converted once, and
    /// the requests of a render are cloned cheaply).
    #[serde(serialize_with = "shared_json")]
    pub value: Arc<serde_json::Value>,
}

fn shared_json<S: serde::Serializer>(
    value: &Arc<serde_json::Value>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    value.as_ref().serialize(serializer)
}

/// The state of the backend pool a render sized ([`crate::pool`]), told to the controller so
/// that its leader keeps the pool's reserve in the cluster: in a pause, it writes `wanted` to
/// `data.size` of the ConfigMap `at` when that is not what the render read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolState {
    /// Where the reserve is kept: `<namespace>/<name>` of a ConfigMap.
    pub at: String,
    /// The plain backends the pool holds.
    pub used: usize,
    /// Its size (backends declared).
    pub size: usize,
    /// The reserve the render read, if any (honoured or not).
    pub reserve: Option<usize>,
    /// The reserve the pool should have ([`crate::pool::Sizing::wanted`]).
    pub wanted: usize,
}

/// Everything one render's templates asked for, in output order.
#[derive(Clone, Default)]
pub struct Requests {
    /// The backend pool's state, when a template sized one with a reserve's place
    /// (`backend_pool(..., reserve_at=)`): the last one sized.
    pub pool: Option<PoolState>,
    /// Events, each once.
    pub events: Vec<EventRequest>,
    /// Status fields; a later request for the same object and field replaces an earlier one.
    /// Shared: a status a view keeps from render to render is built once and the requests of
    /// a render are cloned and merged without copying a string.
    pub statuses: Vec<Arc<StatusRequest>>,
    /// The [`key_hash`] of each of `statuses`, in the same order, as they were put: merging
    /// requests never hashes a string again. Trusted only while it is as long as `statuses`:
    /// a list grown or shrunk from outside is hashed again (a status replaced in place from
    /// outside keeps the old hash, and a later request for its field is then not found but
    /// added: replace none).
    hashes: Vec<u64>,
}

impl std::fmt::Debug for Requests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requests")
            .field("events", &self.events)
            .field("statuses", &self.statuses)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Requests {
    fn eq(&self, other: &Self) -> bool {
        self.events == other.events && self.statuses == other.statuses && self.pool == other.pool
    }
}

impl Requests {
    /// Appends `other`, keeping each event once and the last value of each status field.
    pub(crate) fn extend(&mut self, mut other: Self) {
        // Most merges are into nothing yet (a job's requests into its render's): a move.
        if self.is_empty() {
            *self = other;
            return;
        }
        if other.pool.is_some() {
            self.pool = other.pool.take();
        }
        // By a set, not by a scan per event: a render may ask for an Event per object.
        if !other.events.is_empty() {
            let mut seen: EventSet = self.events.iter().cloned().collect();
            for event in std::mem::take(&mut other.events) {
                put_event(&mut self.events, &mut seen, event);
            }
        }
        if other.statuses.is_empty() {
            return;
        }
        // By key, not by a scan per status: a render declares one status per object (10,000
        // HTTPRoutes: 10,000), and a scan each made the merge quadratic. The index is of the
        // hashes kept with the statuses: no string is hashed again.
        self.rehash();
        let mut index = StatusIndex::with_capacity(self.statuses.len() + other.statuses.len());
        for (place, hash) in self.hashes.iter().enumerate() {
            index.insert(*hash, place);
        }
        for (status, hash) in other.keyed() {
            self.put_status(&mut index, Arc::clone(status), hash);
        }
    }

    /// True when nothing was asked for.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty() && self.statuses.is_empty() && self.pool.is_none()
    }

    /// Makes `hashes` those of `statuses` again if `statuses` was changed from outside.
    fn rehash(&mut self) {
        if self.hashes.len() != self.statuses.len() {
            self.hashes = self.statuses.iter().map(|s| key_hash(s)).collect();
        }
    }

    /// Each of `statuses` with its hash: the one kept or, if `statuses` was changed from
    /// outside, computed.
    fn keyed(&self) -> impl Iterator<Item = (&Arc<StatusRequest>, u64)> {
        let kept = self.hashes.len() == self.statuses.len();
        self.statuses.iter().enumerate().map(move |(i, status)| {
            let hash = if kept {
                self.hashes[i]
            } else {
                key_hash(status)
            };
            (status, hash)
        })
    }

    /// Adds `status` (whose [`key_hash`] is `hash`), replacing an earlier request for the same
    /// field in its place; `index` is where each field is in `statuses`.
    fn put_status(&mut self, index: &mut StatusIndex, status: Arc<StatusRequest>, hash: u64) {
        match index.find(&self.statuses, &status, hash) {
            Some(place) => {
                self.statuses[place] = status;
                self.hashes[place] = hash;
            }
            None => {
                index.insert(hash, self.statuses.len());
                self.statuses.push(status);
                self.hashes.push(hash);
            }
        }
    }
}

/// The keys of [`key_hash`], drawn once per process: the fields hashed are the cluster's to
/// choose, and no one outside the process can aim for collisions without them.
static KEYS: std::sync::LazyLock<std::hash::RandomState> =
    std::sync::LazyLock::new(std::hash::RandomState::new);

/// The hash of what identifies a status field: (apiVersion, kind, namespace, name, field).
/// Computed once per request (a cached row's request keeps it from render to render).
fn key_hash(s: &StatusRequest) -> u64 {
    use std::hash::BuildHasher as _;
    KEYS.hash_one((&s.api_version, &s.kind, &s.namespace, &s.name, &s.field))
}

/// A status request with its [`key_hash`]: what a `set_statuses` row gives, kept from render to
/// render while the row is the same value.
#[derive(Debug, Clone)]
pub(crate) struct KeyedStatus {
    pub(crate) request: Arc<StatusRequest>,
    pub(crate) hash: u64,
}

impl KeyedStatus {
    fn new(request: StatusRequest) -> Self {
        let hash = key_hash(&request);
        Self {
            request: Arc::new(request),
            hash,
        }
    }
}

/// Where each status field (apiVersion, kind, namespace, name, field) is in a list of status
/// requests, by its [`key_hash`] (a key of five owned strings cost five allocations per
/// status, and a render declares one per route).
#[derive(Default)]
struct StatusIndex {
    /// The first place with each hash (the hashes are keyed already: one multiplication
    /// spreads them over the table).
    first: std::collections::HashMap<
        u64,
        usize,
        std::hash::BuildHasherDefault<crate::fragments::AddressHasher>,
    >,
    /// Further places with a hash already taken by another field (a collision).
    more: std::collections::HashMap<u64, Vec<usize>>,
}

impl StatusIndex {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            first: std::collections::HashMap::with_capacity_and_hasher(
                capacity,
                Default::default(),
            ),
            more: Default::default(),
        }
    }

    fn same(a: &StatusRequest, b: &StatusRequest) -> bool {
        a.name == b.name
            && a.field == b.field
            && a.namespace == b.namespace
            && a.kind == b.kind
            && a.api_version == b.api_version
    }

    /// The place of `s`'s field in `statuses`, if it is there.
    fn find(&self, statuses: &[Arc<StatusRequest>], s: &StatusRequest, hash: u64) -> Option<usize> {
        let at = |i: &usize| statuses.get(*i).is_some_and(|t| Self::same(t, s));
        if let Some(i) = self.first.get(&hash).filter(|i| at(i)) {
            return Some(*i);
        }
        self.more.get(&hash)?.iter().copied().find(|i| at(i))
    }

    fn insert(&mut self, hash: u64, place: usize) {
        match self.first.entry(hash) {
            std::collections::hash_map::Entry::Vacant(at) => {
                at.insert(place);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.more.entry(hash).or_default().push(place);
            }
        }
    }
}

/// The Events already in a list of event requests.
type EventSet = std::collections::HashSet<EventRequest>;

/// Adds `event` to `events` unless it is there already.
fn put_event(events: &mut Vec<EventRequest>, seen: &mut EventSet, event: EventRequest) {
    if !seen.contains(&event) {
        seen.insert(event.clone());
        events.push(event);
    }
}

thread_local! {
    /// What the template running on this thread asked for so far, where each status field is
    /// in it, and which Events it holds.
    static COLLECTED: RefCell<(Requests, StatusIndex, EventSet)> = RefCell::new(Default::default());
}

/// Runs `f` (one template render on this thread) and returns what its templates asked for.
///
/// Nests: a render inside a render (a fragment of `render_each`) collects its own requests,
/// and the enclosing render's are as they were when it returns.
pub(crate) fn collect<T>(f: impl FnOnce() -> T) -> (T, Requests) {
    let outer = COLLECTED.with(|c| c.take());
    let out = f();
    let (requests, _, _) = COLLECTED.with(|c| c.replace(outer));
    (out, requests)
}

/// Takes what was asked for so far on this thread (a row of a run of rows is done).
pub(crate) fn take() -> Requests {
    COLLECTED.with(|c| {
        // Most rows ask for nothing: then the (empty) set and index stay as they are.
        if c.borrow().0.is_empty() {
            return Requests::default();
        }
        c.take().0
    })
}

/// Adds requests made elsewhere (a reused fragment's), as if made here.
pub(crate) fn replay(requests: &Requests) {
    if requests.is_empty() {
        return;
    }
    COLLECTED.with(|c| {
        let (collected, index, seen) = &mut *c.borrow_mut();
        if requests.pool.is_some() {
            collected.pool.clone_from(&requests.pool);
        }
        // Through this thread's set and index: a replay per reused row must not rebuild them.
        for event in &requests.events {
            put_event(&mut collected.events, seen, event.clone());
        }
        for (status, hash) in requests.keyed() {
            collected.put_status(index, Arc::clone(status), hash);
        }
    });
}

/// Sets the pool's state in what this thread's template asked for (a later one replaces it).
pub(crate) fn put_pool(state: PoolState) {
    COLLECTED.with(|c| c.borrow_mut().0.pool = Some(state));
}

/// Adds `statuses` to what this thread's template asked for, in order.
fn put_statuses(statuses: impl ExactSizeIterator<Item = KeyedStatus>) {
    COLLECTED.with(|c| {
        let (collected, index, _) = &mut *c.borrow_mut();
        collected.statuses.reserve(statuses.len());
        collected.hashes.reserve(statuses.len());
        for KeyedStatus { request, hash } in statuses {
            collected.put_status(index, request, hash);
        }
    });
}

fn error(e: impl std::fmt::Display) -> tera::Error {
    tera::Error::message(e.to_string())
}

/// The string at `path` (`metadata.name`) in `object`, if there is one there.
fn text(object: &Value, path: &str) -> Option<String> {
    let mut at = object;
    for part in path.split('.') {
        at = attr(at, part)?;
    }
    at.as_str().map(ToOwned::to_owned)
}

/// The field `name` of a map: a scan of a small map, as tera's own attribute look-up does (its
/// path look-up hashes every part; a status is read from four paths of an object).
fn attr<'v>(value: &'v Value, name: &'v str) -> Option<&'v Value> {
    let map = value.as_map()?;
    if map.len() <= 12 {
        return map
            .iter()
            .find_map(|(k, v)| (k.as_str() == Some(name)).then_some(v));
    }
    map.get(&tera::value::Key::Str(name))
}

/// Registers `record_event`, `set_status` and `set_statuses`.
pub(crate) fn register(tera: &mut Tera) {
    tera.register_function(
        "record_event",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let object: Value = kwargs.must_get("object")?;
            let type_: String = kwargs.get::<String>("type")?.unwrap_or_else(|| "Normal".into());
            let reason: String = kwargs.must_get("reason")?;
            let message: String = kwargs.must_get("message")?;
            if type_ != "Normal" && type_ != "Warning" {
                return Err(error(format!(
                    "record_event: type must be Normal or Warning, not {type_:?}"
                )));
            }
            if reason.is_empty()
                || reason.len() > 128
                || !reason.chars().all(|c| c.is_ascii_alphanumeric())
                || !reason.starts_with(|c: char| c.is_ascii_uppercase())
            {
                return Err(error(format!(
                    "record_event: reason must be a CamelCase word of at most 128 letters and digits, not {reason:?}"
                )));
            }
            let request = EventRequest {
                api_version: text(&object, "apiVersion"),
                kind: text(&object, "kind"),
                namespace: text(&object, "metadata.namespace"),
                name: text(&object, "metadata.name"),
                uid: text(&object, "metadata.uid"),
                type_,
                reason,
                message,
            };
            if request.name.is_none() {
                return Err(error("record_event: the object has no metadata.name"));
            }
            COLLECTED.with(|c| {
                let (requests, _, seen) = &mut *c.borrow_mut();
                put_event(&mut requests.events, seen, request);
            });
            Ok(String::new())
        },
    );
    tera.register_function(
        "set_status",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let object: Value = kwargs.must_get("object")?;
            let field: String = kwargs.must_get("field")?;
            let value: Value = kwargs.must_get("value")?;
            let request = status_request("set_status", &object, field, &value)?;
            put_statuses(std::iter::once(KeyedStatus::new(request)));
            Ok(String::new())
        },
    );
    tera.register_function(
        "set_statuses",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let rows: Value = kwargs.must_get("rows")?;
            let Some(rows) = rows.as_array() else {
                return Err(error(format!(
                    "set_statuses: `rows` must be a list of {{object, field, value}}, got {}",
                    rows.name()
                )));
            };
            // A row the last render passed too (the same value: a view keeps the row of an
            // unchanged object) asks what it asked then: its request is not built again.
            let requests = crate::fragments::status_rows(rows, status_row)?;
            put_statuses(requests.into_iter());
            Ok(String::new())
        },
    );
}

/// The request one `set_statuses` row `{object, field, value}` makes.
fn status_row(row: &Value) -> tera::TeraResult<KeyedStatus> {
    let get = |name: &str| {
        row.as_map().and_then(|m| {
            m.iter()
                .find_map(|(k, v)| (k.as_str() == Some(name)).then_some(v))
        })
    };
    let (Some(object), Some(field), Some(value)) = (get("object"), get("field"), get("value"))
    else {
        return Err(error(
            "set_statuses: every row needs `object`, `field` and `value`",
        ));
    };
    let field = field.as_str().unwrap_or_default().to_owned();
    status_request("set_statuses", object, field, value).map(KeyedStatus::new)
}

/// The request `set_status(object=, field=, value=)` makes (`function` names the caller in
/// errors).
fn status_request(
    function: &str,
    object: &Value,
    field: String,
    value: &Value,
) -> tera::TeraResult<StatusRequest> {
    if field.is_empty() || field.contains('.') || field.contains('/') {
        return Err(error(format!(
            "{function}: field must name one top-level field of status, not {field:?}"
        )));
    }
    let (Some(api_version), Some(kind), Some(name)) = (
        text(object, "apiVersion"),
        text(object, "kind"),
        text(object, "metadata.name"),
    ) else {
        return Err(error(format!(
            "{function}: the object needs apiVersion, kind and metadata.name (a watched object, as listed)"
        )));
    };
    let value = crate::fragments::status_json(value).map_err(error)?;
    Ok(StatusRequest {
        api_version,
        kind,
        namespace: text(object, "metadata.namespace"),
        name,
        field,
        value,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;
    use tera::Value;

    use crate::{Renderer, reference};

    fn ingress(name: &str, service: &str) -> serde_json::Value {
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"namespace": "shop", "name": name, "uid": format!("uid-{name}")},
            "spec": {"rules": [{"host": format!("{name}.example"), "http": {"paths": [
                {"path": "/", "pathType": "Prefix",
                 "backend": {"service": {"name": service, "port": {"number": 80}}}}]}}]}
        })
    }

    #[test]
    fn the_reference_set_asks_for_events_and_ingress_status_the_same_on_any_threads() {
        let mut set = reference::template_set();
        set.extra_context.get_mut("haproxy").unwrap()["service"] = json!("haptic/haproxy");
        let mut stores = reference::stores().unwrap();
        // Class-less Ingresses, ours through the default class.
        stores
            .get_mut("ingressclasses")
            .unwrap()
            .apply(&crate::fixtures::ingress_class("haptic", true))
            .unwrap();
        let ingresses = stores.get_mut("ingresses").unwrap();
        ingresses.apply(&ingress("good", "web")).unwrap();
        ingresses.apply(&ingress("broken", "missing")).unwrap();
        let services = stores.get_mut("services").unwrap();
        services
            .apply(&json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "shop", "name": "web"},
                "spec": {"ports": [{"name": "http", "port": 80}]}}))
            .unwrap();
        // No load-balancer address yet: no status asked for.
        let renderer = Renderer::compile(&set).unwrap();
        let (_, asked) = renderer.render_all(&stores).unwrap();
        assert!(asked.statuses.is_empty(), "{asked:?}");
        assert_eq!(asked.events.len(), 1, "{asked:?}");
        let event = &asked.events[0];
        assert_eq!(
            (
                event.kind.as_deref(),
                event.name.as_deref(),
                event.uid.as_deref()
            ),
            (Some("Ingress"), Some("broken"), Some("uid-broken"))
        );
        assert_eq!(
            (event.type_.as_str(), event.reason.as_str()),
            ("Warning", "BackendNotFound")
        );
        assert!(event.message.contains("missing"), "{}", event.message);

        let lb = json!({"ingress": [{"ip": "192.0.2.10"}]});
        stores
            .get_mut("services")
            .unwrap()
            .apply(&json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "haptic", "name": "haproxy"},
                "spec": {"ports": [{"name": "http", "port": 80}]},
                "status": {"loadBalancer": lb}}))
            .unwrap();
        let one = Renderer::compile(&set).unwrap().with_threads(1);
        let four = Renderer::compile(&set).unwrap().with_threads(4);
        let (files, asked) = one.render_all(&stores).unwrap();
        let (files4, asked4) = four.render_all(&stores).unwrap();
        assert_eq!(files.checksum_hex(), files4.checksum_hex());
        assert_eq!(asked, asked4);
        let names: Vec<&str> = asked.statuses.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["broken", "good"]);
        for status in &asked.statuses {
            assert_eq!(
                (status.kind.as_str(), status.field.as_str(), &*status.value),
                ("Ingress", "loadBalancer", &lb)
            );
        }
        // Nothing of it is in the files.
        assert!(!files.text("haproxy.cfg").unwrap().contains("192.0.2.10"));
    }

    /// A status template asks what it asks and writes no file (its text is dropped); it is
    /// rendered again when what it reads changes, and a change only it reads leaves
    /// `haproxy.cfg` the very bytes it was.
    #[test]
    fn a_status_template_asks_and_writes_nothing() {
        let set = crate::TemplateSet {
            haproxy_config: crate::Template::new(
                "{% for s in resources.services %}backend {{ s.metadata.name }}\n{% endfor %}",
            ),
            status_templates: [(
                "events".to_owned(),
                crate::Template::new(
                    "dropped text {% for i in resources.ingresses %}{{ record_event(object=i, type=\"Normal\", reason=\"Seen\", message=\"seen\") }}{% endfor %}",
                ),
            )]
            .into(),
            ..crate::TemplateSet::default()
        };
        let mut stores = reference::stores().unwrap();
        stores
            .get_mut("services")
            .unwrap()
            .apply(&json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "shop", "name": "web"},
                "spec": {"ports": [{"port": 80}]}}))
            .unwrap();
        stores
            .get_mut("ingresses")
            .unwrap()
            .apply(&ingress("one", "web"))
            .unwrap();
        let renderer = Renderer::compile(&set).unwrap();
        let (files, asked) = renderer.render_all(&stores).unwrap();
        let paths: Vec<&str> = files.iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["haproxy.cfg"]);
        assert_eq!(files.text("haproxy.cfg"), Some("backend web\n"));
        assert_eq!(asked.events.len(), 1, "{asked:?}");
        stores
            .get_mut("ingresses")
            .unwrap()
            .apply(&ingress("two", "web"))
            .unwrap();
        let (again, asked) = renderer.render_all(&stores).unwrap();
        assert_eq!(asked.events.len(), 2, "{asked:?}");
        assert_eq!(
            again.get("haproxy.cfg").unwrap().as_ptr(),
            files.get("haproxy.cfg").unwrap().as_ptr()
        );
        assert_eq!(renderer.last_timings().outputs_reused, 1);
    }

    #[test]
    fn set_statuses_asks_what_a_set_status_per_row_asks() {
        let requests = |main: &str| {
            let mut set = crate::TemplateSet {
                haproxy_config: crate::Template::new(main),
                ..crate::TemplateSet::default()
            };
            let object = |name: &str| json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "a", "name": name}});
            set.extra_context.insert(
                "rows".into(),
                json!([
                    {"object": object("x"), "field": "loadBalancer", "value": {"ingress": [{"ip": "192.0.2.1"}]}},
                    {"object": object("y"), "field": "conditions", "value": [{"type": "Ready"}]},
                    {"object": object("x"), "field": "loadBalancer", "value": {"ingress": []}},
                ]),
            );
            Renderer::compile(&set)
                .unwrap()
                .render_all(&crate::Stores::new())
                .unwrap()
                .1
        };
        let one_call = requests("{{ set_statuses(rows=rows) }}");
        assert_eq!(
            one_call,
            requests(
                "{% for r in rows %}{{ set_status(object=r.object, field=r.field, value=r.value) }}{% endfor %}"
            )
        );
        // The last value of a field wins, in its first place.
        assert_eq!(one_call.statuses.len(), 2);
        assert_eq!(*one_call.statuses[0].value, json!({"ingress": []}));
    }

    /// A renderer whose main template is `main`, with `rows` in its extra context.
    fn with_rows(main: &str, rows: serde_json::Value) -> Renderer {
        let mut set = crate::TemplateSet {
            haproxy_config: crate::Template::new(main),
            ..crate::TemplateSet::default()
        };
        set.extra_context.insert("rows".into(), rows);
        Renderer::compile(&set).unwrap()
    }

    fn service(name: &str) -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "a", "name": name}})
    }

    fn row(name: &str, ip: &str) -> serde_json::Value {
        json!({"object": service(name), "field": "loadBalancer", "value": {"ingress": [{"ip": ip}]}})
    }

    #[test]
    fn a_second_render_reuses_the_requests_of_the_same_rows() {
        let rows = json!([
            row("x", "192.0.2.1"),
            row("y", "192.0.2.2"),
            row("x", "192.0.2.3")
        ]);
        let renderer = with_rows("{{ set_statuses(rows=rows) }}", rows);
        let stores = crate::Stores::new();
        let (_, first) = renderer.render_all(&stores).unwrap();
        let (_, second) = renderer.render_all(&stores).unwrap();
        assert_eq!(first, second);
        assert_eq!(second.statuses.len(), 2);
        assert_eq!(
            *second.statuses[0].value,
            json!({"ingress": [{"ip": "192.0.2.3"}]})
        );
        // Not built again: the very requests of the first render.
        for (a, b) in first.statuses.iter().zip(&second.statuses) {
            assert!(Arc::ptr_eq(a, b), "{b:?} was built again");
        }
    }

    #[test]
    fn a_changed_row_asks_for_its_new_value() {
        let fragments = crate::fragments::Fragments::default();
        let value = |v: serde_json::Value| Value::from_serializable(&v);
        let (x, y) = (value(row("x", "192.0.2.1")), value(row("y", "192.0.2.2")));
        let epoch = fragments.begin();
        let first = fragments
            .status_rows(&[x.clone(), y.clone()], epoch, super::status_row)
            .unwrap();
        fragments.end(epoch);
        // y changed: a new value, where x is the same one.
        let y = value(row("y", "192.0.2.9"));
        let epoch = fragments.begin();
        let second = fragments
            .status_rows(&[x.clone(), y.clone()], epoch, super::status_row)
            .unwrap();
        fragments.end(epoch);
        assert!(Arc::ptr_eq(&first[0].request, &second[0].request));
        assert_eq!(second[1].request.name, "y");
        assert_eq!(
            *second[1].request.value,
            json!({"ingress": [{"ip": "192.0.2.9"}]})
        );
        assert_eq!(first[1].hash, second[1].hash, "the same field");
        // A bad row is an error whether or not the good ones were seen before.
        let bad = value(json!({"object": service("z"), "field": "a.b", "value": 1}));
        let epoch = fragments.begin();
        let error = fragments
            .status_rows(&[x, bad], epoch, super::status_row)
            .unwrap_err()
            .to_string();
        assert!(error.contains("set_statuses: field must name"), "{error}");
    }

    #[test]
    fn merging_keeps_each_field_once_in_its_first_place() {
        let renderer = with_rows(
            "{{ set_statuses(rows=rows) }}",
            json!([row("x", "192.0.2.1"), row("y", "192.0.2.2")]),
        );
        let (_, mut asked) = renderer.render_all(&crate::Stores::new()).unwrap();
        let later = with_rows(
            "{{ set_statuses(rows=rows) }}",
            json!([row("z", "192.0.2.5"), row("x", "192.0.2.3")]),
        );
        let (_, mut more) = later.render_all(&crate::Stores::new()).unwrap();
        // Lists changed from outside (the controller may) are hashed again.
        let outside = Arc::new(super::StatusRequest {
            name: "w".into(),
            ..(*more.statuses[0]).clone()
        });
        more.statuses.push(Arc::clone(&outside));
        asked.statuses.push(outside);
        asked.extend(more);
        let names: Vec<&str> = asked.statuses.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["x", "y", "w", "z"]);
        assert_eq!(
            *asked.statuses[0].value,
            json!({"ingress": [{"ip": "192.0.2.3"}]})
        );
        // Into nothing: the same requests.
        let mut empty = super::Requests::default();
        empty.extend(asked.clone());
        assert_eq!(empty, asked);
    }

    #[test]
    fn bad_requests_are_render_errors_naming_the_function() {
        let compile = |main: &str| {
            let mut set = crate::TemplateSet {
                haproxy_config: crate::Template::new(main),
                ..crate::TemplateSet::default()
            };
            set.extra_context
                .insert("obj".into(), json!({"metadata": {"name": "x"}}));
            Renderer::compile(&set).unwrap()
        };
        let stores = crate::Stores::new();
        for (template, needle) in [
            (
                r#"{{ record_event(object=obj, type="Loud", reason="R", message="m") }}"#,
                "type must be Normal or Warning",
            ),
            (
                r#"{{ record_event(object=obj, reason="not camel", message="m") }}"#,
                "reason must be a CamelCase word",
            ),
            (
                r#"{{ set_status(object=obj, field="a.b", value=1) }}"#,
                "set_status: field",
            ),
            (
                r#"{{ set_statuses(rows=[{"object": obj, "field": "ok"}]) }}"#,
                "set_statuses: every row needs",
            ),
            (
                r#"{{ set_statuses(rows=1) }}"#,
                "set_statuses: `rows` must be a list",
            ),
        ] {
            let error = compile(template)
                .render_all(&stores)
                .unwrap_err()
                .to_string();
            assert!(error.contains(needle), "{template}: {error}");
        }
    }
}
