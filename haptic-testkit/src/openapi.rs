//! Minimal OpenAPI v3 documents: enough for kubectl to see that the server validates fields
//! itself (`fieldValidation`), so `kubectl create -f` and `replace -f` work with validation on.

use serde_json::{Value, json};

use crate::resources::{Registry, ResourceInfo};

/// The `serverRelativeURL` hash. kubectl caches by it; the documents only change when a CRD
/// registers a group/version, which yields a new path, so a constant is enough.
const HASH: &str = "0000000000000000";

/// `api/v1` or `apis/{group}/{version}`: the index key of a group/version.
fn group_version_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// `/openapi/v3`: the index of per group/version documents.
pub(crate) fn index(registry: &Registry) -> Value {
    let mut paths = serde_json::Map::new();
    for (group, version) in registry.group_versions() {
        let key = group_version_path(&group, &version);
        paths.insert(
            key.clone(),
            json!({ "serverRelativeURL": format!("/openapi/v3/{key}?hash={HASH}") }),
        );
    }
    json!({ "paths": paths })
}

/// `/openapi/v3/{api/v1 | apis/group/version}`: the document of one group/version, or None.
pub(crate) fn document(registry: &Registry, segments: &[&str]) -> Option<Value> {
    let (group, version) = match segments {
        ["api", version] => ("", *version),
        ["apis", group, version] => (*group, *version),
        _ => return None,
    };
    let resources = registry.resources_at(group, version);
    if resources.is_empty() {
        return None;
    }
    let mut paths = serde_json::Map::new();
    for info in resources {
        let prefix = format!("/{}", group_version_path(group, version));
        let (collection, item) = if info.namespaced {
            (
                format!("{prefix}/namespaces/{{namespace}}/{}", info.plural),
                format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", info.plural),
            )
        } else {
            (
                format!("{prefix}/{}", info.plural),
                format!("{prefix}/{}/{{name}}", info.plural),
            )
        };
        paths.insert(
            collection,
            json!({
                "get": operation(info, "list", false),
                "post": operation(info, "post", true),
            }),
        );
        paths.insert(
            item,
            json!({
                "get": operation(info, "get", false),
                "put": operation(info, "put", true),
                "patch": operation(info, "patch", true),
                "delete": operation(info, "delete", false),
            }),
        );
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": { "title": "Kubernetes", "version": "v1.34.0-haptic-testkit" },
        "paths": paths,
        "components": { "schemas": {} },
    }))
}

/// One operation, tagged with the group/version/kind kubectl looks for; writes declare the
/// `fieldValidation` query parameter.
fn operation(info: &ResourceInfo, action: &str, write: bool) -> Value {
    let mut parameters = Vec::new();
    if write {
        for name in ["dryRun", "fieldManager", "fieldValidation"] {
            parameters.push(json!({
                "name": name,
                "in": "query",
                "schema": { "type": "string", "uniqueItems": true },
            }));
        }
    }
    json!({
        "operationId": format!("{action}{}", info.kind),
        "parameters": parameters,
        "responses": { "200": { "description": "OK" } },
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {
            "group": info.group,
            "version": info.version,
            "kind": info.kind,
        },
    })
}
