//! Conversion of JSON resources into tera values with a fixed (sorted) key order.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash as _, Hasher as _};
use std::sync::Arc;

use serde_json::Value as Json;
use tera::value::{Key, ValueKind};

use crate::store::FieldPath;
use tera::{Map, Value};

/// Shares one allocation per distinct map key, and one value per distinct small subtree,
/// among the resources of a store.
///
/// Keys: templates find attributes by comparing key strings; when every `metadata` key of ten
/// thousand resources points at the same bytes, those comparisons stay in cache instead of
/// chasing ten thousand copies across the heap (measured: 10k-Ingress renders about twice as
/// fast). Capped, so that resources with unbounded key sets (ConfigMap data, annotations)
/// cannot grow it without limit; past the cap keys are allocated per resource as before.
///
/// Subtrees: a map or list that a second resource holds with the same contents (a Service's
/// `ports`, an endpoint's `conditions`, an EndpointSlice's `ports`, `ipFamilies`, a label set
/// of a Deployment's Pods) is the first one's value, not a copy: a tera map costs ~100 bytes
/// and ~70 more an entry. Only a subtree seen twice is kept for sharing (the first sighting
/// keeps a 64-bit digest, in a set cleared when it fills), equal means equal to the byte and
/// the kind (a float is not the integer it equals), and a resource's own top-level value is
/// never shared, so each resource keeps a value of its own. The subtrees kept for sharing are
/// capped too; those of resources gone since stay until the store is dropped (at most
/// [`Self::SUBTREE_CAP`] small values).
#[derive(Debug, Clone, Default)]
pub(crate) struct Interner {
    keys: HashSet<Arc<str>>,
    /// Subtrees seen once, by digest.
    seen: HashSet<u64>,
    /// Subtrees seen more than once, by digest: the value the next equal one shares.
    shared: HashMap<u64, Value>,
    /// Shares keys only, no subtrees ([`Interner::keys_only`]).
    keys_only: bool,
}

impl Interner {
    const CAP: usize = 16_384;
    /// The most first sightings remembered; then forgotten all at once.
    const SEEN_CAP: usize = 65_536;
    /// The most subtrees kept for sharing.
    const SUBTREE_CAP: usize = 16_384;
    /// The largest subtree (in JSON nodes) considered: larger ones are seldom equal, and
    /// comparing them costs more.
    const SUBTREE_NODES: usize = 64;

    /// An interner that shares keys but no subtrees: for values made when read, whose
    /// subtrees would stay in it after the values are gone.
    pub(crate) fn keys_only() -> Self {
        Self {
            keys_only: true,
            ..Self::default()
        }
    }

    fn key(&mut self, key: &str) -> Key<'static> {
        if let Some(shared) = self.keys.get(key) {
            return Key::String(Arc::clone(shared));
        }
        let shared: Arc<str> = Arc::from(key);
        if self.keys.len() < Self::CAP {
            self.keys.insert(Arc::clone(&shared));
        }
        Key::String(shared)
    }

    /// The value to keep for `json`, just converted to `value` (digest `digest`): an equal
    /// one kept before, or `value` itself.
    fn share(&mut self, json: &Json, value: Value, digest: u64) -> Value {
        if self.keys_only {
            return value;
        }
        if let Some(kept) = self.shared.get(&digest) {
            if same(kept, json) {
                return kept.clone();
            }
            return value;
        }
        if self.seen.remove(&digest) {
            if self.shared.len() < Self::SUBTREE_CAP {
                self.shared.insert(digest, value.clone());
            }
            return value;
        }
        if self.seen.len() >= Self::SEEN_CAP {
            self.seen.clear();
        }
        self.seen.insert(digest);
        value
    }
}

/// Whether `value` is `json` converted: the same kinds (an integer is not a float, a
/// non-negative integer is `U64`), the same strings, maps of the same keys in sorted order.
fn same(value: &Value, json: &Json) -> bool {
    match json {
        Json::Null => value.is_none(),
        Json::Bool(b) => value.kind() == ValueKind::Bool && value.as_bool() == Some(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                value.kind() == ValueKind::U64 && value.as_u64() == Some(u)
            } else if let Some(i) = n.as_i64() {
                value.kind() == ValueKind::I64 && value.as_i64() == Some(i)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                value.kind() == ValueKind::F64
                    && value.as_f64().map(f64::to_bits) == Some(f.to_bits())
            }
        }
        Json::String(s) => value.kind() == ValueKind::String && value.as_str() == Some(s),
        Json::Array(items) => value.as_array().is_some_and(|values| {
            values.len() == items.len() && values.iter().zip(items).all(|(v, j)| same(v, j))
        }),
        Json::Object(object) => value.as_map().is_some_and(|map| {
            map.len() == object.len()
                && map.iter().all(|(key, v)| {
                    key.as_str()
                        .and_then(|key| object.get(key))
                        .is_some_and(|j| same(v, j))
                })
        }),
    }
}

/// Converts a JSON value into a tera value whose maps iterate in sorted key order.
///
/// serde_json may or may not preserve insertion order depending on features enabled elsewhere
/// in the build, so the order is imposed here rather than inherited: the same object always
/// gives the same iteration order in a template, whatever order its keys arrived in.
///
/// Keys at the `ignore` paths are left out. Small subtrees equal to ones converted before
/// with the same `interner` are shared ([`Interner`]).
pub(crate) fn to_tera(json: &Json, interner: &mut Interner, ignore: &[FieldPath]) -> Value {
    let active: Vec<&[String]> = ignore.iter().map(|p| p.0.as_slice()).collect();
    convert(json, interner, &active, true).value
}

/// A converted subtree: its value, the digest of its contents, and its size in JSON nodes.
struct Converted {
    value: Value,
    digest: u64,
    nodes: usize,
}

/// `active` holds the rest of every ignore path that matched the keys on the way down; `root`
/// is the resource itself (never shared).
fn convert(json: &Json, interner: &mut Interner, active: &[&[String]], root: bool) -> Converted {
    let mut hasher = DefaultHasher::new();
    let (value, nodes) = match json {
        Json::Null => {
            0u8.hash(&mut hasher);
            (Value::none(), 1)
        }
        Json::Bool(b) => {
            (1u8, b).hash(&mut hasher);
            (Value::from(*b), 1)
        }
        Json::Number(n) => {
            let value = if let Some(u) = n.as_u64() {
                (2u8, u).hash(&mut hasher);
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                (3u8, i).hash(&mut hasher);
                Value::from(i)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                (4u8, f.to_bits()).hash(&mut hasher);
                Value::from(f)
            };
            (value, 1)
        }
        Json::String(s) => {
            (5u8, s).hash(&mut hasher);
            (Value::from(s.as_str()), 1)
        }
        Json::Array(items) => {
            (6u8, items.len()).hash(&mut hasher);
            let mut nodes: usize = 1;
            let values = items
                .iter()
                .map(|item| {
                    let item = convert(item, interner, active, false);
                    item.digest.hash(&mut hasher);
                    nodes = nodes.saturating_add(item.nodes);
                    item.value
                })
                .collect::<Vec<_>>();
            (Value::from(values), nodes)
        }
        Json::Object(object) => {
            let mut entries: Vec<(&String, &Json)> = object.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            (7u8, entries.len()).hash(&mut hasher);
            let mut map = Map::with_capacity(entries.len());
            let mut nodes: usize = 1;
            let mut ignored = false;
            for (key, value) in entries {
                let below: Vec<&[String]> = active
                    .iter()
                    .filter_map(|path| match path.split_first() {
                        Some((first, rest)) if first == key => Some(rest),
                        _ => None,
                    })
                    .collect();
                if below.iter().any(|rest| rest.is_empty()) {
                    ignored = true;
                    continue;
                }
                let value = convert(value, interner, &below, false);
                key.hash(&mut hasher);
                value.digest.hash(&mut hasher);
                nodes = nodes.saturating_add(value.nodes);
                map.insert(interner.key(key), value.value);
            }
            if ignored {
                // Not the JSON's contents: never compared with it.
                nodes = usize::MAX;
            }
            (Value::from(map), nodes)
        }
    };
    let digest = hasher.finish();
    let value = if !root
        && nodes <= Interner::SUBTREE_NODES
        && matches!(json, Json::Array(_) | Json::Object(_))
    {
        interner.share(json, value, digest)
    } else {
        value
    };
    Converted {
        value,
        digest,
        nodes,
    }
}

/// A template value as a compact store keeps it: its JSON, as bytes (no value converted from
/// JSON is bytes, so bytes are always this).
pub(crate) fn compact(value: &Value) -> Value {
    match serde_json::to_vec(value) {
        Ok(json) => Value::bytes(json),
        // A value made from JSON always serializes; should one not, it is kept as it is.
        Err(_) => value.clone(),
    }
}

thread_local! {
    /// The keys of the values [`expand`] makes on this thread, shared (what templates
    /// compare attribute names with; [`Interner`]).
    static EXPANDED_KEYS: std::cell::RefCell<Interner> =
        std::cell::RefCell::new(Interner::keys_only());
}

/// The template value a store holds as `value`: itself, or, when it is a compact store's
/// JSON ([`compact`]), the value that JSON converts to (the value [`to_tera`] made before it
/// was compacted: keys sorted, numbers of the same kinds).
pub(crate) fn expand(value: &Value) -> std::borrow::Cow<'_, Value> {
    let Some(bytes) = value.as_bytes() else {
        return std::borrow::Cow::Borrowed(value);
    };
    #[cfg(test)]
    EXPANDED.with(|n| n.set(n.get() + 1));
    let json: Json = serde_json::from_slice(bytes).unwrap_or(Json::Null);
    let expanded = EXPANDED_KEYS.with(|interner| match interner.try_borrow_mut() {
        Ok(mut interner) => to_tera(&json, &mut interner, &[]),
        Err(_) => to_tera(&json, &mut Interner::keys_only(), &[]),
    });
    std::borrow::Cow::Owned(expanded)
}

#[cfg(test)]
thread_local! {
    /// How many compact values [`expand`] converted on this thread (tests count them).
    pub(crate) static EXPANDED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A copy of `value`'s map (empty when it is none) with room for `more` entries: a clone
/// and then an insert of one new key doubled the entry list (a pooled backend row of 10
/// fields held room for 20: 5 MB at 10,000 Services).
pub(crate) fn map_with_room(value: &Value, more: usize) -> Map {
    let fields = value.as_map();
    let mut map = Map::with_capacity(fields.map_or(0, Map::len) + more);
    if let Some(fields) = fields {
        map.extend(fields.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    map
}

/// Whether two values are the same to a template: equal, and of the same kinds all the way
/// down (tera calls an integer equal to the float of its value, and two maps equal whatever
/// the order of their keys, which a loop over them shows), strings of the same safety.
pub(crate) fn identical(a: &Value, b: &Value) -> bool {
    if a.kind() != b.kind() {
        return false;
    }
    match a.kind() {
        ValueKind::Array => match (a.as_array(), b.as_array()) {
            (Some(x), Some(y)) => std::ptr::eq(x, y) || all_identical(x, y),
            _ => false,
        },
        ValueKind::Map => match (a.as_map(), b.as_map()) {
            (Some(x), Some(y)) => {
                std::ptr::eq(x, y)
                    || (x.len() == y.len()
                        && x.iter()
                            .zip(y)
                            .all(|((k, v), (l, w))| k == l && identical(v, w)))
            }
            _ => false,
        },
        ValueKind::String => a.as_str() == b.as_str() && a.is_safe() == b.is_safe(),
        _ => a == b,
    }
}

/// Whether two lists hold [`identical`] values, in the same order.
pub(crate) fn all_identical(a: &[Value], b: &[Value]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| identical(x, y))
}

/// Builds a tera map value from entries that are already in the wanted order.
pub(crate) fn map_value<I, K>(entries: I) -> Value
where
    I: IntoIterator<Item = (K, Value)>,
    K: Into<String>,
{
    let entries = entries.into_iter();
    let mut map = Map::with_capacity(entries.size_hint().0);
    for (key, value) in entries {
        map.insert(key.into().into(), value);
    }
    Value::from(map)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn maps_iterate_in_sorted_key_order() {
        let value = tera(&json!({"b": 1, "a": {"z": true, "c": null}, "c": [1, "x", 2.5]}));
        let map = value.as_map().expect("a map");
        let keys: Vec<String> = map.keys().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        let inner = map
            .values()
            .next()
            .and_then(|v| v.as_map())
            .expect("inner map");
        let keys: Vec<String> = inner.keys().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["c", "z"]);
    }

    fn tera(json: &Json) -> Value {
        to_tera(json, &mut Interner::default(), &[])
    }

    #[test]
    fn identical_values_are_equal_of_the_same_kinds_and_order() {
        let a = tera(&json!({"a": 1, "b": [1, {"c": "x"}]}));
        assert!(identical(&a, &tera(&json!({"a": 1, "b": [1, {"c": "x"}]}))));
        // tera's equality holds for each of these; a template tells them apart.
        let fields = a.as_map().unwrap();
        let reordered = map_value(
            fields
                .iter()
                .rev()
                .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone())),
        );
        for other in [
            tera(&json!({"a": 1.0, "b": [1, {"c": "x"}]})),
            reordered,
            tera(&json!({"a": 1, "b": [1.0, {"c": "x"}]})),
        ] {
            assert!(a == other, "tera calls them equal");
            assert!(!identical(&a, &other), "{other:?}");
        }
        assert!(!identical(
            &a,
            &tera(&json!({"a": 1, "b": [1, {"c": "y"}]}))
        ));
        let text = Value::from("some text that is long enough");
        assert!(!identical(&text, &text.clone().mark_safe()));
    }

    #[test]
    fn numbers_keep_their_kind() {
        assert_eq!(tera(&json!(-3)).as_i64(), Some(-3));
        assert_eq!(tera(&json!(7)).as_u64(), Some(7));
        assert_eq!(tera(&json!(0.5)).as_f64(), Some(0.5));
    }

    /// The map at `path` of `value`, as a pointer: the same for a shared subtree.
    fn map_at(value: &Value, path: &str) -> *const Map {
        value
            .get_from_path(path)
            .and_then(|v| v.as_map().map(|m| m as *const Map))
            .expect("a map")
    }

    #[test]
    fn an_equal_subtree_of_another_resource_is_shared_and_a_resource_keeps_its_own_value() {
        let mut interner = Interner::default();
        let resource = |name: &str| {
            json!({"metadata": {"name": name}, "spec": {"ports": [{"name": "http", "port": 80}]},
                   "conditions": {"ready": true}})
        };
        let values: Vec<Value> = ["a", "b", "c"]
            .iter()
            .map(|name| to_tera(&resource(name), &mut interner, &[]))
            .collect();
        // The first sighting is remembered, the second kept for sharing, the third shares it.
        assert!(std::ptr::eq(
            map_at(&values[1], "spec"),
            map_at(&values[2], "spec")
        ));
        assert!(std::ptr::eq(
            map_at(&values[1], "conditions"),
            map_at(&values[2], "conditions")
        ));
        assert!(!std::ptr::eq(
            map_at(&values[1], "metadata"),
            map_at(&values[2], "metadata")
        ));
        for (value, name) in values.iter().zip(["a", "b", "c"]) {
            assert_eq!(serde_json::to_value(value).unwrap(), resource(name));
        }
        // Two resources with the very same contents still get values of their own.
        let twin = to_tera(&resource("c"), &mut interner, &[]);
        assert!(!std::ptr::eq(
            twin.as_map().unwrap() as *const Map,
            values[2].as_map().unwrap() as *const Map
        ));
        assert!(std::ptr::eq(
            map_at(&twin, "spec"),
            map_at(&values[2], "spec")
        ));
    }

    #[test]
    fn a_subtree_shares_only_what_is_equal_to_the_byte_and_the_kind() {
        let mut interner = Interner::default();
        let integer = json!({"a": {"x": 1, "y": "s"}});
        let float = json!({"a": {"x": 1.0, "y": "s"}});
        let negative = json!({"a": {"x": -1, "y": "s"}});
        for json in [&integer, &integer, &float, &float, &negative, &integer] {
            let value = to_tera(json, &mut interner, &[]);
            let x = value.get_from_path("a.x").unwrap();
            let kind = match json["a"]["x"].as_f64() {
                _ if json["a"]["x"].is_u64() => ValueKind::U64,
                _ if json["a"]["x"].is_i64() => ValueKind::I64,
                _ => ValueKind::F64,
            };
            assert_eq!(x.kind(), kind, "{json}");
            assert_eq!(serde_json::to_value(&value).unwrap(), *json);
        }
    }

    #[test]
    fn a_digest_collision_shares_nothing_unequal() {
        // Digests are 64 bits: an equal digest is only a candidate, compared to the byte and
        // the kind before it is shared.
        let mut interner = Interner::default();
        let integer = json!({"x": 1});
        let kept = tera(&integer);
        let digest = 42;
        interner.share(&integer, kept.clone(), digest);
        interner.share(&integer, kept.clone(), digest);
        for other in [
            json!({"x": 1.0}),
            json!({"x": "1"}),
            json!({"x": 1, "y": null}),
            json!([1]),
        ] {
            let value = tera(&other);
            let kept_now = interner.share(&other, value.clone(), digest);
            assert_eq!(serde_json::to_value(&kept_now).unwrap(), other);
        }
        let again = interner.share(&integer, tera(&integer), digest);
        assert!(std::ptr::eq(
            again.as_map().unwrap() as *const Map,
            interner.shared[&digest].as_map().unwrap() as *const Map
        ));
        assert!(!same(&tera(&json!(1)), &json!(1.0)));
        assert!(!same(&tera(&json!(-1)), &json!(18446744073709551615u64)));
        assert!(same(
            &tera(&json!({"b": [1, -2, 0.5, null, true], "a": "s"})),
            &json!({"a": "s", "b": [1, -2, 0.5, null, true]})
        ));
    }

    #[test]
    fn a_subtree_with_ignored_fields_is_never_shared_with_one_without() {
        let ignore = [FieldPath::parse("metadata.managedFields").unwrap()];
        let mut interner = Interner::default();
        let with = json!({"spec": {"metadata": {"managedFields": [1], "name": "n"}}});
        let without = json!({"spec": {"metadata": {"name": "n"}}});
        for json in [&with, &with, &without, &without, &with] {
            let value = to_tera(json, &mut interner, &ignore);
            assert_eq!(
                serde_json::to_value(&value).unwrap(),
                *json,
                "only a top-level metadata.managedFields is ignored"
            );
        }
        let top = json!({"metadata": {"managedFields": [1], "name": "n"}, "x": {"k": 1}});
        for _ in 0..3 {
            let value = to_tera(&top, &mut interner, &ignore);
            assert_eq!(
                serde_json::to_value(&value).unwrap(),
                json!({"metadata": {"name": "n"}, "x": {"k": 1}})
            );
        }
        let plain = to_tera(
            &json!({"metadata": {"managedFields": [1], "name": "n"}}),
            &mut interner,
            &[],
        );
        assert_eq!(
            serde_json::to_value(&plain).unwrap(),
            json!({"metadata": {"managedFields": [1], "name": "n"}})
        );
    }

    #[test]
    fn equal_keys_share_one_allocation() {
        let mut interner = Interner::default();
        let a = to_tera(&json!({"metadata": 1}), &mut interner, &[]);
        let b = to_tera(&json!({"metadata": 2}), &mut interner, &[]);
        let key = |v: &Value| match v.as_map().and_then(|m| m.keys().next()).cloned() {
            Some(Key::String(s)) => s,
            other => panic!("{other:?}"),
        };
        assert!(Arc::ptr_eq(&key(&a), &key(&b)));
    }
}
