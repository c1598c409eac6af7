//! What the webhook tells about a Gateway or an HTTPRoute of ours besides its verdict.
//!
//! The Gateway API answers most problems of a schema-valid object with status, not with a
//! refusal: a route whose match is not supported gets `Accepted=False` (`UnsupportedValue`), a
//! listener whose Secret is missing `ResolvedRefs=False`, and the object is stored. The webhook
//! follows the API: such an object is allowed, and each condition its render declares that is
//! not healthy (a `False` one; `Conflicted=True`) comes back as an admission warning, which
//! `kubectl` prints at once, before the leader writes the status. Only what breaks the render,
//! the config policy or `haproxy -c` (so the change of every other tenant would be held) is
//! denied, by the checks every resource of ours goes through.

use std::sync::Arc;

use haptic_render::StatusRequest;
use serde_json::Value as Json;

/// The Gateway API group.
pub(super) const GROUP: &str = "gateway.networking.k8s.io";

/// `(kind, namespace, name, deleted)` of the reviewed object.
pub(super) type ObjectKey = (String, String, String, bool);

fn text<'a>(v: &'a Json, key: &str) -> &'a str {
    v.get(key).and_then(Json::as_str).unwrap_or_default()
}

/// The unhealthy conditions of a list, as `Type=Status (Reason): message`.
fn unhealthy(conditions: &Json) -> Vec<String> {
    let list = conditions.as_array().map_or(&[][..], Vec::as_slice);
    let bad = |c: &&Json| match text(c, "type") {
        "Conflicted" => text(c, "status") == "True",
        _ => text(c, "status") == "False",
    };
    let bad: Vec<&Json> = list.iter().filter(bad).collect();
    // A listener or route that is not accepted or not resolved is not programmed either:
    // saying so again adds nothing.
    let redundant = bad.len() > 1;
    bad.into_iter()
        .filter(|c| !(redundant && text(c, "type") == "Programmed"))
        .map(|c| {
            format!(
                "{}={} ({}): {}",
                text(c, "type"),
                text(c, "status"),
                text(c, "reason"),
                text(c, "message")
            )
        })
        .collect()
}

/// The warnings for the reviewed object: each unhealthy condition the render declares for it,
/// naming the object and where (a listener, a parent). None for a removal.
pub(super) fn warnings(
    what: &str,
    key: &ObjectKey,
    statuses: &[Arc<StatusRequest>],
) -> Vec<String> {
    let (kind, namespace, name, deleted) = key;
    if *deleted {
        return Vec::new();
    }
    let mut out = Vec::new();
    for st in statuses.iter().filter(|st| {
        st.kind == *kind && st.name == *name && st.namespace.as_deref().unwrap_or("") == namespace
    }) {
        match st.field.as_str() {
            "conditions" => {
                for c in unhealthy(&st.value) {
                    out.push(format!("{what}: {c}"));
                }
            }
            "listeners" => {
                for l in st.value.as_array().map_or(&[][..], Vec::as_slice) {
                    for c in unhealthy(&l["conditions"]) {
                        out.push(format!(
                            "{what}: spec.listeners[name={}]: {c}",
                            text(l, "name")
                        ));
                    }
                }
            }
            "parents" => {
                for p in st.value.as_array().map_or(&[][..], Vec::as_slice) {
                    let r = &p["parentRef"];
                    let mut parent = format!("{}/{}", text(r, "namespace"), text(r, "name"));
                    if !text(r, "sectionName").is_empty() {
                        parent = format!("{parent} sectionName {}", text(r, "sectionName"));
                    }
                    if let Some(port) = r.get("port").and_then(Json::as_i64) {
                        parent = format!("{parent} port {port}");
                    }
                    for c in unhealthy(&p["conditions"]) {
                        out.push(format!("{what}: parentRef Gateway {parent}: {c}"));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status(kind: &str, field: &str, value: Json) -> Arc<StatusRequest> {
        Arc::new(StatusRequest {
            api_version: format!("{GROUP}/v1"),
            kind: kind.to_owned(),
            namespace: Some("shop".to_owned()),
            name: "web".to_owned(),
            field: field.to_owned(),
            value: value.into(),
        })
    }

    fn cond(kind: &str, status: &str, reason: &str) -> Json {
        json!({"type": kind, "status": status, "reason": reason, "message": "why"})
    }

    #[test]
    fn unhealthy_conditions_of_the_object_become_warnings_naming_where() {
        let key = (
            "HTTPRoute".to_owned(),
            "shop".to_owned(),
            "web".to_owned(),
            false,
        );
        let statuses = [
            status(
                "HTTPRoute",
                "parents",
                json!([{"parentRef": {"namespace": "infra", "name": "gw", "sectionName": "http"},
                    "conditions": [cond("Accepted", "False", "UnsupportedValue"),
                                   cond("ResolvedRefs", "True", "ResolvedRefs")]}]),
            ),
            // Another object's status says nothing about this one.
            status(
                "Gateway",
                "conditions",
                json!([cond("Accepted", "False", "X")]),
            ),
        ];
        assert_eq!(
            warnings("HTTPRoute shop/web", &key, &statuses),
            [
                "HTTPRoute shop/web: parentRef Gateway infra/gw sectionName http: Accepted=False (UnsupportedValue): why"
            ]
        );
        let key = (
            "Gateway".to_owned(),
            "shop".to_owned(),
            "web".to_owned(),
            false,
        );
        let listeners = status(
            "Gateway",
            "listeners",
            json!([{"name": "https", "conditions": [
                cond("Accepted", "True", "Accepted"),
                cond("Conflicted", "False", "NoConflicts"),
                cond("ResolvedRefs", "False", "InvalidCertificateRef"),
                cond("Programmed", "False", "Invalid")]}]),
        );
        assert_eq!(
            warnings("Gateway shop/web", &key, std::slice::from_ref(&listeners)),
            [
                "Gateway shop/web: spec.listeners[name=https]: ResolvedRefs=False (InvalidCertificateRef): why"
            ]
        );
        let deleted = (
            "Gateway".to_owned(),
            "shop".to_owned(),
            "web".to_owned(),
            true,
        );
        assert!(warnings("Gateway shop/web", &deleted, &[listeners]).is_empty());
    }
}
