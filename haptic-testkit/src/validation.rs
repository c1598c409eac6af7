//! Object validation the real server performs for the resources the project uses: names,
//! Lease fields and MicroTime formatting.

use serde_json::Value;

use crate::{resources::ResourceInfo, status::ApiError};

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_label)
}

/// Validates an object name as the resource's strategy does (DNS-1123 label for namespaces and
/// services, subdomain otherwise). Returns a 422 cause.
pub(crate) fn name_cause(info: &ResourceInfo, name: &str) -> Option<(String, String)> {
    let label_only =
        info.group.is_empty() && (info.plural == "namespaces" || info.plural == "services");
    if label_only && !is_label(name) {
        return Some((
            "metadata.name".to_owned(),
            format!("Invalid value: \"{name}\": {LABEL_MSG}"),
        ));
    }
    if !label_only && !is_subdomain(name) {
        return Some((
            "metadata.name".to_owned(),
            format!("Invalid value: \"{name}\": {SUBDOMAIN_MSG}"),
        ));
    }
    None
}

/// A decode failure: the body could not be read as the resource's type (400 on the real server).
pub(crate) fn decode_error(info: &ResourceInfo, detail: &str) -> String {
    format!(
        "{} in version \"{}\" cannot be handled as a {}: {detail}",
        info.kind, info.version, info.kind
    )
}

/// Checks a MicroTime string: RFC 3339 with exactly six fractional digits, as Go's
/// `metav1.MicroTime` parses it (layout `2006-01-02T15:04:05.000000Z07:00`).
pub(crate) fn micro_time_ok(value: &str) -> bool {
    let b = value.as_bytes();
    let digits = |range: std::ops::Range<usize>| {
        b.get(range)
            .is_some_and(|s| s.iter().all(u8::is_ascii_digit))
    };
    let shape = b.len() >= 27
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..26);
    if !shape {
        return false;
    }
    let zone = &value[26..];
    let zone_ok = zone == "Z"
        || (zone.len() == 6
            && (zone.starts_with('+') || zone.starts_with('-'))
            && zone.as_bytes()[3] == b':'
            && digits(27..29)
            && digits(30..32));
    zone_ok && value.parse::<jiff::Timestamp>().is_ok()
}

/// Rewrites fields to the form the real server stores them in: a MicroTime is decoded and
/// encoded again, so it comes back in UTC with `Z` whatever offset it was sent with.
pub(crate) fn normalize(info: &ResourceInfo, object: &mut Value) {
    if info.group != "coordination.k8s.io" || info.plural != "leases" {
        return;
    }
    for field in ["acquireTime", "renewTime"] {
        let Some(time) = object["spec"][field].as_str() else {
            continue;
        };
        if let Ok(ts) = time.parse::<jiff::Timestamp>() {
            let utc = ts.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
            object["spec"][field] = Value::String(utc);
        }
    }
}

/// The object as the built-in type it should be, re-encoded; None for custom resources, CRDs
/// (whose schemas this server does not model) and bodies the type cannot decode (the store's
/// own checks answer those).
fn typed_round_trip(info: &ResourceInfo, object: &Value) -> Option<Value> {
    use k8s_openapi::api::{
        coordination::v1::Lease,
        core::v1::{ConfigMap, Event, Namespace, Pod, Secret, Service},
        discovery::v1::EndpointSlice,
        events::v1::Event as EventV1,
        networking::v1::{Ingress, IngressClass},
    };
    fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(v: &Value) -> Option<Value> {
        serde_json::from_value::<T>(v.clone())
            .ok()
            .and_then(|t| serde_json::to_value(t).ok())
    }
    if info.custom {
        return None;
    }
    let mut typed = object.clone();
    typed["apiVersion"] = Value::String(info.api_version());
    typed["kind"] = Value::String(info.kind.clone());
    match (info.group.as_str(), info.plural.as_str()) {
        ("", "namespaces") => round_trip::<Namespace>(&typed),
        ("", "pods") => round_trip::<Pod>(&typed),
        ("", "services") => round_trip::<Service>(&typed),
        ("", "secrets") => round_trip::<Secret>(&typed),
        ("", "configmaps") => round_trip::<ConfigMap>(&typed),
        ("", "events") => round_trip::<Event>(&typed),
        ("events.k8s.io", "events") => round_trip::<EventV1>(&typed),
        ("coordination.k8s.io", "leases") => round_trip::<Lease>(&typed),
        ("discovery.k8s.io", "endpointslices") => round_trip::<EndpointSlice>(&typed),
        ("networking.k8s.io", "ingresses") => round_trip::<Ingress>(&typed),
        ("networking.k8s.io", "ingressclasses") => round_trip::<IngressClass>(&typed),
        _ => None,
    }
}

/// Collects the paths (`spec.containers[0].foo`) present in `sent` but not in `typed`.
fn collect_unknown(sent: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (sent, typed) {
        (Value::Object(sent), Value::Object(typed)) => {
            for (key, value) in sent {
                if value.is_null() {
                    continue;
                }
                let here = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match typed.get(key) {
                    None => out.push(here),
                    Some(known) => collect_unknown(value, known, &here, out),
                }
            }
        }
        (Value::Array(sent), Value::Array(typed)) => {
            for (i, (value, known)) in sent.iter().zip(typed).enumerate() {
                collect_unknown(value, known, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Removes the field at a path `collect_unknown` produced.
fn remove_path(object: &mut Value, path: &str) {
    let mut target = object;
    let mut parts = path.split('.').peekable();
    while let Some(part) = parts.next() {
        let (key, indices) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if parts.peek().is_none() && indices.is_empty() {
            if let Some(map) = target.as_object_mut() {
                map.remove(key);
            }
            return;
        }
        let Some(next) = target.get_mut(key) else {
            return;
        };
        target = next;
        for index in indices
            .split(['[', ']'])
            .filter(|s| !s.is_empty())
            .filter_map(|s| s.parse::<usize>().ok())
        {
            let Some(next) = target.get_mut(index) else {
                return;
            };
            target = next;
        }
    }
}

/// Field validation of a POST or PUT body for built-in types, by the `fieldValidation`
/// directive: `Strict` refuses unknown fields (400), `Warn` (the default) and `Ignore` drop
/// them, `Warn` adding a warning each.
pub(crate) fn unknown_fields(
    info: &ResourceInfo,
    mut object: Value,
    directive: &str,
    warnings: &mut Vec<String>,
) -> Result<Value, ApiError> {
    if !matches!(directive, "Strict" | "Warn" | "Ignore") {
        return Err(ApiError::bad_request(format!(
            "fieldValidation: Invalid value: \"{directive}\": must be one of Ignore, Warn, or Strict"
        )));
    }
    let Some(typed) = typed_round_trip(info, &object) else {
        return Ok(object);
    };
    let mut unknown = Vec::new();
    collect_unknown(&object, &typed, "", &mut unknown);
    if unknown.is_empty() {
        return Ok(object);
    }
    let listed: Vec<String> = unknown
        .iter()
        .map(|p| format!("unknown field \"{p}\""))
        .collect();
    match directive {
        "Strict" => Err(ApiError::bad_request(decode_error(
            info,
            &format!("strict decoding error: {}", listed.join(", ")),
        ))),
        _ => {
            if directive == "Warn" {
                warnings.extend(listed);
            }
            for path in &unknown {
                remove_path(&mut object, path);
            }
            Ok(object)
        }
    }
}

/// Type-level checks (a 400 decode error on the real server) for fields of known types.
pub(crate) fn decode_check(info: &ResourceInfo, object: &Value) -> Result<(), String> {
    if info.group == "coordination.k8s.io" && info.plural == "leases" {
        let spec = &object["spec"];
        if !spec.is_null() && !spec.is_object() {
            return Err(
                "json: cannot unmarshal into Go struct field Lease.spec of type v1.LeaseSpec"
                    .to_owned(),
            );
        }
        for field in ["acquireTime", "renewTime"] {
            match &spec[field] {
                Value::Null => {}
                Value::String(s) if micro_time_ok(s) => {}
                Value::String(s) => {
                    return Err(format!(
                        "parsing time \"{s}\" as \"2006-01-02T15:04:05.000000Z07:00\": cannot parse as RFC 3339 with microseconds (field spec.{field})"
                    ));
                }
                other => {
                    return Err(format!(
                        "json: cannot unmarshal {other} into Go struct field LeaseSpec.spec.{field} of type string"
                    ));
                }
            }
        }
        for field in ["leaseDurationSeconds", "leaseTransitions"] {
            match &spec[field] {
                Value::Null => {}
                Value::Number(n) if n.as_i64().is_some_and(|v| i32::try_from(v).is_ok()) => {}
                other => {
                    return Err(format!(
                        "json: cannot unmarshal {other} into Go struct field LeaseSpec.spec.{field} of type int32"
                    ));
                }
            }
        }
        for field in ["holderIdentity", "strategy", "preferredHolder"] {
            if !matches!(spec[field], Value::Null | Value::String(_)) {
                return Err(format!(
                    "json: cannot unmarshal into Go struct field LeaseSpec.spec.{field} of type string"
                ));
            }
        }
    }
    let meta = &object["metadata"];
    if !meta.is_null() && !meta.is_object() {
        return Err(
            "json: cannot unmarshal into Go struct field .metadata of type v1.ObjectMeta"
                .to_owned(),
        );
    }
    for field in ["labels", "annotations"] {
        match &meta[field] {
            Value::Null => {}
            Value::Object(map) if map.values().all(Value::is_string) => {}
            _ => {
                return Err(format!(
                    "json: cannot unmarshal into Go struct field ObjectMeta.metadata.{field} of type map[string]string"
                ));
            }
        }
    }
    Ok(())
}

/// Field validation (422 on the real server) for known types.
pub(crate) fn field_causes(info: &ResourceInfo, object: &Value) -> Vec<(String, String)> {
    let mut causes = Vec::new();
    if info.group == "coordination.k8s.io" && info.plural == "leases" {
        let spec = &object["spec"];
        if let Some(d) = spec["leaseDurationSeconds"].as_i64()
            && d <= 0
        {
            causes.push((
                "spec.leaseDurationSeconds".to_owned(),
                format!("Invalid value: {d}: must be greater than 0"),
            ));
        }
        if let Some(t) = spec["leaseTransitions"].as_i64()
            && t < 0
        {
            causes.push((
                "spec.leaseTransitions".to_owned(),
                format!("Invalid value: {t}: must be greater than or equal to 0"),
            ));
        }
        // Coordinated leader election: a Kubernetes strategy, or a custom `prefix/name` one.
        let strategy = spec["strategy"].as_str();
        if let Some(strategy) = strategy
            && !strategy.contains('/')
            && strategy != "OldestEmulationVersion"
        {
            causes.push((
                "spec.strategy".to_owned(),
                format!(
                    "Unsupported value: \"{strategy}\": supported values: \"OldestEmulationVersion\""
                ),
            ));
        }
        if spec["preferredHolder"]
            .as_str()
            .is_some_and(|h| !h.is_empty())
            && strategy.is_none_or(str::is_empty)
        {
            causes.push((
                "spec.preferredHolder".to_owned(),
                "Forbidden: may only be specified if `strategy` is defined".to_owned(),
            ));
        }
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_needs_six_digits() {
        assert!(micro_time_ok("2026-11-29T08:00:00.123456Z"));
        assert!(micro_time_ok("2026-11-29T08:00:00.123456+01:00"));
        assert!(!micro_time_ok("2026-11-29T08:00:00Z"));
        assert!(!micro_time_ok("2026-11-29T08:00:00.123Z"));
        assert!(!micro_time_ok("2026-11-29T08:00:00.1234567Z"));
        assert!(!micro_time_ok("2026-13-29T08:00:00.123456Z"));
        assert!(!micro_time_ok("yesterday"));
    }

    #[test]
    fn micro_time_is_stored_in_utc() {
        let info = crate::resources::Registry::builtin()
            .get("coordination.k8s.io", "v1", "leases")
            .cloned()
            .expect("leases");
        let mut lease = serde_json::json!({ "spec": {
            "renewTime": "2026-11-29T08:00:00.123456+01:00",
            "acquireTime": "2026-11-29T08:00:00.000001Z",
        } });
        normalize(&info, &mut lease);
        assert_eq!(lease["spec"]["renewTime"], "2026-11-29T07:00:00.123456Z");
        assert_eq!(lease["spec"]["acquireTime"], "2026-11-29T08:00:00.000001Z");
    }

    #[test]
    fn names() {
        assert!(is_subdomain("a.b-c"));
        assert!(!is_subdomain("A"));
        assert!(!is_subdomain("-a"));
        assert!(is_label("abc-1"));
        assert!(!is_label("a.b"));
    }
}
