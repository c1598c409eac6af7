//! Label selectors (equality- and set-based) and the field selectors the server supports.

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed `labelSelector`: all requirements must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

/// A parsed `fieldSelector`: `metadata.name` and `metadata.namespace`, with `=`, `==`, `!=`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

/// Splits on commas that are not inside parentheses.
fn split_top_level(input: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in input.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&input[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&input[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn valid_label_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 316
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

fn parse_set(key: &str, rest: &str, raw: &str) -> Result<Vec<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| {
            format!("unable to parse requirement: {raw}: expected a set like ({key} in (a,b))")
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parses the `labelSelector` query parameter.
    pub(crate) fn parse(input: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for raw in split_top_level(input) {
            let req = if let Some(key) = raw.strip_prefix('!') {
                Requirement::DoesNotExist(key.trim().to_owned())
            } else if let Some((k, v)) = raw.split_once("!=") {
                Requirement::NotEquals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = raw.split_once("==") {
                Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = raw.split_once('=') {
                Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, rest)) = raw.split_once(" notin ") {
                Requirement::NotIn(k.trim().to_owned(), parse_set(k, rest, raw)?)
            } else if let Some((k, rest)) = raw.split_once(" in ") {
                Requirement::In(k.trim().to_owned(), parse_set(k, rest, raw)?)
            } else {
                Requirement::Exists(raw.trim().to_owned())
            };
            let key = match &req {
                Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _)
                | Requirement::Exists(k)
                | Requirement::DoesNotExist(k) => k,
            };
            if !valid_label_key(key) {
                return Err(format!(
                    "unable to parse requirement: invalid label key \"{key}\""
                ));
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    /// Whether the object's labels satisfy every requirement.
    pub(crate) fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            Requirement::Equals(k, v) => label(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            Requirement::In(k, set) => label(k).is_some_and(|l| set.iter().any(|s| s == l)),
            Requirement::NotIn(k, set) => !label(k).is_some_and(|l| set.iter().any(|s| s == l)),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::DoesNotExist(k) => label(k).is_none(),
        })
    }
}

impl FieldSelector {
    /// Parses the `fieldSelector` query parameter; only the metadata fields every resource
    /// supports are accepted, as on the real server.
    pub(crate) fn parse(input: &str) -> Result<Self, String> {
        Self::parse_for(input, "")
    }

    /// Parses a `fieldSelector` for a resource (by plural): besides the metadata fields, the
    /// few fields the real server accepts for it (Secrets `type`; Pods `spec.nodeName` and
    /// `status.phase`).
    pub(crate) fn parse_for(input: &str, plural: &str) -> Result<Self, String> {
        let extra: &[&str] = match plural {
            "secrets" => &["type"],
            "pods" => &["spec.nodeName", "status.phase"],
            _ => &[],
        };
        let mut terms = Vec::new();
        for raw in split_top_level(input) {
            let (field, equal, value) = if let Some((k, v)) = raw.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = raw.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = raw.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{raw}'; can't understand '{raw}'"
                ));
            };
            let field = field.trim();
            if field != "metadata.name" && field != "metadata.namespace" && !extra.contains(&field)
            {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(Self(terms))
    }

    /// Whether the object satisfies every term.
    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let actual = field
                .split('.')
                .try_fold(object, |v, part| v.get(part))
                .and_then(Value::as_str)
                .unwrap_or_default();
            (actual == value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(labels: Value) -> Value {
        json!({ "metadata": { "name": "a", "namespace": "ns", "labels": labels } })
    }

    #[test]
    fn equality_and_sets() {
        let o = obj(json!({ "app": "web", "tier": "front" }));
        let yes = [
            "app=web",
            "app==web",
            "app!=db",
            "app in (web, db)",
            "tier notin (back)",
            "app",
            "!missing",
            "app=web,tier in (front)",
        ];
        for s in yes {
            assert!(
                LabelSelector::parse(s).expect(s).matches(&o),
                "{s} should match"
            );
        }
        let no = [
            "app=db",
            "app!=web",
            "app in (db)",
            "tier notin (front)",
            "missing",
            "!app",
            "app=web,tier=back",
        ];
        for s in no {
            assert!(
                !LabelSelector::parse(s).expect(s).matches(&o),
                "{s} should not match"
            );
        }
    }

    #[test]
    fn bad_selectors_are_refused() {
        assert!(LabelSelector::parse("app in web").is_err());
        assert!(LabelSelector::parse("a b=c").is_err());
        assert!(FieldSelector::parse("spec.nodeName=x").is_err());
        assert!(FieldSelector::parse("metadata.name").is_err());
    }

    #[test]
    fn resource_specific_field_selectors() {
        assert!(FieldSelector::parse_for("type=kubernetes.io/tls", "services").is_err());
        let tls = FieldSelector::parse_for("type=kubernetes.io/tls", "secrets").expect("parses");
        assert!(tls.matches(&json!({"metadata": {"name": "a"}, "type": "kubernetes.io/tls"})));
        assert!(!tls.matches(&json!({"metadata": {"name": "a"}, "type": "Opaque"})));
        let running = FieldSelector::parse_for("status.phase=Running", "pods").expect("parses");
        assert!(
            running.matches(&json!({"metadata": {"name": "a"}, "status": {"phase": "Running"}}))
        );
    }

    #[test]
    fn field_selectors() {
        let o = obj(json!({}));
        assert!(
            FieldSelector::parse("metadata.name=a")
                .expect("parse")
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("metadata.namespace!=other")
                .expect("parse")
                .matches(&o)
        );
        assert!(
            !FieldSelector::parse("metadata.name=b")
                .expect("parse")
                .matches(&o)
        );
    }
}
