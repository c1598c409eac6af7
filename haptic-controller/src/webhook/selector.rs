//! Label and field selectors evaluated on an object, as the API server evaluates a watch's:
//! the webhook judges only objects its store would hold.
//!
//! Terms (comma-separated, all must hold): `k=v`, `k==v`, `k!=v`, `k` (exists), `!k` (does not
//! exist), `k in (a,b)`, `k notin (a,b)`. Label keys are looked up in `metadata.labels`; field
//! keys are dotted paths into the object (`metadata.name`, `type`, `spec.ingressClassName`).

use serde_json::Value as Json;

/// Where a selector's keys are looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// `metadata.labels`.
    Labels,
    /// Dotted field paths.
    Fields,
}

fn lookup<'a>(object: &'a Json, keys: Keys, key: &str) -> Option<String> {
    let value: &'a Json = match keys {
        Keys::Labels => object.pointer("/metadata/labels")?.get(key)?,
        Keys::Fields => key
            .split('.')
            .try_fold(object, |value, segment| value.get(segment))?,
    };
    match value {
        Json::String(s) => Some(s.clone()),
        Json::Null => None,
        other => Some(other.to_string()),
    }
}

/// Splits at commas outside parentheses.
fn terms(selector: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&selector[start..]);
    out
}

fn set_of(list: &str) -> Option<Vec<&str>> {
    let inner = list.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(str::trim).collect())
}

/// Whether `object` matches `selector` (an empty selector matches everything). A term this
/// module cannot read counts as a match: the webhook then judges the object rather than
/// letting a change through unjudged.
pub fn matches(object: &Json, keys: Keys, selector: &str) -> bool {
    terms(selector).into_iter().all(|term| {
        let term = term.trim();
        if term.is_empty() {
            return true;
        }
        if let Some((key, value)) = term.split_once("!=") {
            return lookup(object, keys, key.trim()).as_deref() != Some(value.trim());
        }
        if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            return lookup(object, keys, key.trim()).as_deref() == Some(value.trim());
        }
        let words: Vec<&str> = term.splitn(3, char::is_whitespace).collect();
        match words.as_slice() {
            [key, "in", rest] => set_of(rest).is_none_or(|set| {
                lookup(object, keys, key).is_some_and(|v| set.contains(&v.as_str()))
            }),
            [key, "notin", rest] => set_of(rest).is_none_or(|set| {
                lookup(object, keys, key).is_none_or(|v| !set.contains(&v.as_str()))
            }),
            [key] => match key.strip_prefix('!') {
                Some(key) => lookup(object, keys, key).is_none(),
                None => lookup(object, keys, key).is_some(),
            },
            _ => true,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn terms_match_as_the_api_server_does() {
        let secret = json!({"type": "kubernetes.io/tls", "metadata": {"name": "a", "labels": {"app": "web", "tier": "fe"}}});
        assert!(matches(&secret, Keys::Fields, "type=kubernetes.io/tls"));
        assert!(!matches(&secret, Keys::Fields, "type=Opaque"));
        assert!(matches(
            &secret,
            Keys::Fields,
            "metadata.name!=b,type==kubernetes.io/tls"
        ));
        assert!(matches(&secret, Keys::Labels, "app=web,tier in (fe, be)"));
        assert!(!matches(&secret, Keys::Labels, "tier notin (fe)"));
        assert!(matches(&secret, Keys::Labels, "app,!missing"));
        assert!(!matches(&secret, Keys::Labels, "missing"));
        assert!(matches(&secret, Keys::Labels, ""));
    }
}
