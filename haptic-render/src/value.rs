//! Conversion of JSON resources into tera values with a fixed (sorted) key order.

use serde_json::Value as Json;
use tera::{Map, Value};

/// Converts a JSON value into a tera value whose maps iterate in sorted key order.
///
/// serde_json may or may not preserve insertion order depending on features enabled elsewhere
/// in the build, so the order is imposed here rather than inherited: the same object always
/// gives the same iteration order in a template, whatever order its keys arrived in.
pub(crate) fn to_tera(json: &Json) -> Value {
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
        Json::Array(items) => Value::from(items.iter().map(to_tera).collect::<Vec<_>>()),
        Json::Object(object) => {
            let mut entries: Vec<(&String, &Json)> = object.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            let mut map = Map::with_capacity(entries.len());
            for (key, value) in entries {
                map.insert(key.clone().into(), to_tera(value));
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
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn maps_iterate_in_sorted_key_order() {
        let value = to_tera(&json!({"b": 1, "a": {"z": true, "c": null}, "c": [1, "x", 2.5]}));
        let map = value.as_map().expect("a map");
        let keys: Vec<String> = map.keys().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        let inner = map.values().next().and_then(|v| v.as_map()).expect("inner map");
        let keys: Vec<String> = inner.keys().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["c", "z"]);
    }

    #[test]
    fn numbers_keep_their_kind() {
        assert_eq!(to_tera(&json!(-3)).as_i64(), Some(-3));
        assert_eq!(to_tera(&json!(7)).as_u64(), Some(7));
        assert_eq!(to_tera(&json!(0.5)).as_f64(), Some(0.5));
    }
}
