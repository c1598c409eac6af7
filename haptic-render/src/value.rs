//! Conversion of JSON resources into tera values with a fixed (sorted) key order.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value as Json;
use tera::value::Key;

use crate::store::FieldPath;
use tera::{Map, Value};

/// Shares one allocation per distinct map key among the resources of a store.
///
/// Templates find attributes by comparing key strings; when every `metadata` key of ten
/// thousand resources points at the same bytes, those comparisons stay in cache instead of
/// chasing ten thousand copies across the heap (measured: 10k-Ingress renders about twice as
/// fast). Capped, so that resources with unbounded key sets (ConfigMap data, annotations)
/// cannot grow it without limit; past the cap keys are allocated per resource as before.
#[derive(Debug, Clone, Default)]
pub(crate) struct Interner {
    keys: HashSet<Arc<str>>,
}

impl Interner {
    const CAP: usize = 16_384;

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
}

/// Converts a JSON value into a tera value whose maps iterate in sorted key order.
///
/// serde_json may or may not preserve insertion order depending on features enabled elsewhere
/// in the build, so the order is imposed here rather than inherited: the same object always
/// gives the same iteration order in a template, whatever order its keys arrived in.
///
/// Keys at the `ignore` paths are left out.
pub(crate) fn to_tera(json: &Json, interner: &mut Interner, ignore: &[FieldPath]) -> Value {
    let active: Vec<&[String]> = ignore.iter().map(|p| p.0.as_slice()).collect();
    convert(json, interner, &active)
}

/// `active` holds the rest of every ignore path that matched the keys on the way down.
fn convert(json: &Json, interner: &mut Interner, active: &[&[String]]) -> Value {
    match json {
        Json::Null => Value::none(),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(
            items
                .iter()
                .map(|item| convert(item, interner, active))
                .collect::<Vec<_>>(),
        ),
        Json::Object(object) => {
            let mut entries: Vec<(&String, &Json)> = object.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            let mut map = Map::with_capacity(entries.len());
            for (key, value) in entries {
                if active.is_empty() {
                    map.insert(interner.key(key), convert(value, interner, &[]));
                    continue;
                }
                let below: Vec<&[String]> = active
                    .iter()
                    .filter_map(|path| match path.split_first() {
                        Some((first, rest)) if first == key => Some(rest),
                        _ => None,
                    })
                    .collect();
                if below.iter().any(|rest| rest.is_empty()) {
                    continue;
                }
                map.insert(interner.key(key), convert(value, interner, &below));
            }
            Value::from(map)
        }
    }
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
    fn numbers_keep_their_kind() {
        assert_eq!(tera(&json!(-3)).as_i64(), Some(-3));
        assert_eq!(tera(&json!(7)).as_u64(), Some(7));
        assert_eq!(tera(&json!(0.5)).as_f64(), Some(0.5));
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
