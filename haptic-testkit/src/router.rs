//! HTTP handling: client identity, faults, path and verb parsing, and dispatch to the store.

use std::{collections::HashMap, convert::Infallible, io, sync::Arc};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::{
    faults::{Decision, RequestRecord},
    openapi,
    resources::ResourceInfo,
    selectors::{FieldSelector, LabelSelector},
    server::Shared,
    status::ApiError,
    store::{PatchKind, Preconditions, Selection, Store, Sub},
    validation, watch,
};

/// The response body type: whole documents and watch streams alike.
pub(crate) type Body = BoxBody<Bytes, io::Error>;

/// The request must end without an answer: the connection is closed.
#[derive(Debug)]
pub(crate) struct DropConnection;

impl std::fmt::Display for DropConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by an injected fault")
    }
}

impl std::error::Error for DropConnection {}

/// The largest request body accepted, as kube-apiserver's 3 MiB limit.
const MAX_BODY: usize = 3 * 1024 * 1024;

pub(crate) fn full(body: Bytes) -> Body {
    Full::new(body).map_err(|e: Infallible| match e {}).boxed()
}

fn json_response(code: u16, value: &Value) -> Response<Body> {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = Response::new(full(Bytes::from(bytes)));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(err: &ApiError) -> Response<Body> {
    let mut resp = json_response(err.code, &err.body);
    if let Some(secs) = err.retry_after
        && let Ok(v) = HeaderValue::from_str(&secs.to_string())
    {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

/// Decodes a query string (`+` is a space, `%XX` a byte).
pub(crate) fn parse_query(query: Option<&str>) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k), percent_decode(v));
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a path addresses.
#[derive(Debug)]
enum Target {
    Document(Value),
    Resource {
        info: ResourceInfo,
        namespace: Option<String>,
        name: Option<String>,
        sub: Option<String>,
    },
    Missing,
}

fn resolve(store: &Store, path: &str, address: &str) -> Target {
    let segments: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let registry = &store.registry;
    let (group, version, rest) = match segments.as_slice() {
        ["api"] => return Target::Document(registry.api_versions(address)),
        ["apis"] => return Target::Document(registry.api_group_list()),
        ["version"] => {
            return Target::Document(json!({
                "major": "1", "minor": "34", "gitVersion": "v1.34.0-haptic-testkit",
                "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
                "platform": "linux/amd64",
            }));
        }
        ["healthz"] | ["livez"] | ["readyz"] => return Target::Document(json!("ok")),
        ["openapi", "v3"] => return Target::Document(openapi::index(registry)),
        ["openapi", "v3", rest @ ..] => {
            return openapi::document(registry, rest)
                .map(Target::Document)
                .unwrap_or(Target::Missing);
        }
        ["apis", group] => {
            return registry
                .api_group(group)
                .map(Target::Document)
                .unwrap_or(Target::Missing);
        }
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Target::Missing,
    };
    if rest.is_empty() {
        return registry
            .api_resource_list(group, version)
            .map(Target::Document)
            .unwrap_or(Target::Missing);
    }
    let lookup = |plural: &str| registry.get(group, version, plural).cloned();
    let owned = |s: &&str| (*s).to_owned();
    let namespaced_path =
        rest.len() >= 3 && rest[0] == "namespaces" && lookup(rest[2]).is_some_and(|i| i.namespaced);
    let (info, namespace, name, sub) = if namespaced_path {
        (
            lookup(rest[2]),
            Some(rest[1].to_owned()),
            rest.get(3).map(owned),
            rest.get(4).map(owned),
        )
    } else {
        (
            lookup(rest[0]),
            None,
            rest.get(1).map(owned),
            rest.get(2).map(owned),
        )
    };
    let Some(info) = info else {
        return Target::Missing;
    };
    if info.namespaced && namespace.is_none() && name.is_some() {
        return Target::Missing;
    }
    if rest.len() > if namespaced_path { 5 } else { 3 } {
        return Target::Missing;
    }
    if let Some(s) = &sub
        && (s != "status" || !info.status)
    {
        return Target::Missing;
    }
    Target::Resource {
        info,
        namespace,
        name,
        sub,
    }
}

/// The path prefix that names a client for programs that send no credentials over plain HTTP
/// (client-go, hence kubectl, reads a kubeconfig's user only for TLS servers).
pub(crate) const CLIENT_PREFIX: &str = "/clients/";

/// Splits `/clients/{name}/rest` into the client name and `/rest`.
fn split_client_prefix(path: &str) -> (Option<&str>, &str) {
    let Some(rest) = path.strip_prefix(CLIENT_PREFIX) else {
        return (None, path);
    };
    match rest.find('/') {
        Some(i) => (Some(&rest[..i]).filter(|n| !n.is_empty()), &rest[i..]),
        None => (Some(rest).filter(|n| !n.is_empty()), "/"),
    }
}

/// The client's name: its bearer token, else the path prefix, else `anonymous`.
fn client_of(req: &Request<Incoming>, from_path: Option<&str>) -> String {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .or_else(|| from_path.map(str::to_owned))
        .unwrap_or_else(|| "anonymous".to_owned())
}

fn verb_of(method: &Method, has_name: bool, watch: bool) -> &'static str {
    match (method, has_name) {
        (&Method::GET, _) if watch => "watch",
        (&Method::GET, true) => "get",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "delete",
        (&Method::DELETE, false) => "deletecollection",
        _ => "unknown",
    }
}

/// Serves one request. `Err` closes the connection without an answer.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, DropConnection> {
    let arrived = Instant::now();
    let seq = shared.faults.next_seq();
    let (from_path, path) = split_client_prefix(req.uri().path());
    let client = client_of(&req, from_path);
    let path = path.to_owned();
    let query = parse_query(req.uri().query());
    let is_watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let target = resolve(&shared.lock_store(), &path, &shared.address);
    let mut record = RequestRecord {
        seq,
        client: client.clone(),
        verb: "discovery".to_owned(),
        resource: String::new(),
        subresource: String::new(),
        namespace: String::new(),
        name: String::new(),
        code: 0,
        arrived,
    };
    if let Target::Resource {
        info,
        namespace,
        name,
        sub,
    } = &target
    {
        record.verb = verb_of(req.method(), name.is_some(), is_watch).to_owned();
        record.resource = info.qualified();
        record.subresource = sub.clone().unwrap_or_default();
        record.namespace = namespace.clone().unwrap_or_default();
        record.name = name.clone().unwrap_or_default();
    }
    let is_watch = record.verb == "watch";
    let mut outcome = serve(&shared, req, target, query, &client, is_watch, &path).await;
    if outcome.is_ok()
        && !is_watch
        && let Some(delay) = shared.faults.response_delay(&client)
    {
        tokio::select! {
            () = shared.token.cancelled() => outcome = Err(DropConnection),
            () = tokio::time::sleep(delay) => {}
        }
    }
    record.code = match &outcome {
        Ok(resp) => resp.status().as_u16(),
        Err(DropConnection) => 0,
    };
    shared.faults.record(record);
    outcome
}

async fn serve(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    target: Target,
    query: HashMap<String, String>,
    client: &str,
    is_watch: bool,
    path: &str,
) -> Result<Response<Body>, DropConnection> {
    match shared.faults.decide(client, is_watch) {
        Decision::Drop => return Err(DropConnection),
        Decision::Fail(err, latency) => {
            if let Some(latency) = latency {
                tokio::select! {
                    () = shared.token.cancelled() => return Err(DropConnection),
                    () = tokio::time::sleep(latency) => {}
                }
            }
            return Ok(error_response(&err));
        }
        Decision::Hang => {
            let mut changes = shared.faults.subscribe();
            loop {
                if !shared.faults.still_hung(client, is_watch) {
                    // The request was lost in the stall: it never takes effect.
                    return Err(DropConnection);
                }
                tokio::select! {
                    () = shared.token.cancelled() => return Err(DropConnection),
                    changed = changes.changed() => if changed.is_err() { return Err(DropConnection) },
                }
            }
        }
        Decision::Proceed(Some(latency)) => {
            tokio::select! {
                () = shared.token.cancelled() => return Err(DropConnection),
                () = tokio::time::sleep(latency) => {}
            }
        }
        Decision::Proceed(None) => {}
    }
    let (info, namespace, name, sub) = match target {
        Target::Document(doc) => {
            return Ok(if req.method() == Method::GET {
                json_response(200, &doc)
            } else {
                error_response(&ApiError::method_not_allowed(req.method().as_str()))
            });
        }
        Target::Missing => return Ok(error_response(&ApiError::path_not_found(path))),
        Target::Resource {
            info,
            namespace,
            name,
            sub,
        } => (info, namespace, name, sub),
    };
    let method = req.method().clone();
    // kube's metadata-only calls (and metadata watchers) ask for PartialObjectMetadata[List].
    let metadata_only = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| accept.contains("as=PartialObjectMetadata"));
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            let mut err =
                ApiError::bad_request(format!("Request entity too large: limit is {MAX_BODY}"));
            err.code = 413;
            err.body["code"] = json!(413);
            err.body["reason"] = json!("RequestEntityTooLarge");
            return Ok(error_response(&err));
        }
        Err(_) => return Err(DropConnection),
    };
    let dry_run = query.get("dryRun").is_some_and(|v| v == "All");
    let sub = if sub.is_some() {
        Sub::Status
    } else {
        Sub::Main
    };
    let ns = namespace.as_deref();
    let selection = match selection(&query, namespace.clone(), &info.plural) {
        Ok(s) => s,
        Err(e) => return Ok(error_response(&e)),
    };
    if is_watch {
        // The real server parses the resourceVersion before it starts streaming.
        if let Some(rv) = query.get("resourceVersion")
            && !rv.is_empty()
            && let Err(e) = rv.parse::<u64>()
        {
            return Ok(error_response(&ApiError::invalid_resource_version(
                &info, rv, &e,
            )));
        }
        if name.is_some() {
            // A watch on one object is a list watch with a name field selector.
            let mut s = selection;
            let by_name = format!("metadata.name={}", name.as_deref().unwrap_or_default());
            s.fields = match FieldSelector::parse(&by_name) {
                Ok(f) => f,
                Err(e) => return Ok(error_response(&ApiError::bad_request(e))),
            };
            return Ok(watch::start(
                shared.clone(),
                info,
                s,
                &query,
                client.to_owned(),
                metadata_only,
            ));
        }
        return Ok(watch::start(
            shared.clone(),
            info,
            selection,
            &query,
            client.to_owned(),
            metadata_only,
        ));
    }
    // Unset, the real server warns about unknown fields and drops them.
    let field_validation = query
        .get("fieldValidation")
        .cloned()
        .unwrap_or_else(|| "Warn".to_owned());
    let options = match method {
        Method::POST => "CreateOptions",
        Method::PUT => "UpdateOptions",
        Method::PATCH => "PatchOptions",
        _ => "",
    };
    if !options.is_empty()
        && !matches!(field_validation.as_str(), "" | "Strict" | "Warn" | "Ignore")
    {
        let detail = format!(
            "Unsupported value: \"{field_validation}\": supported values: \"\", \"Ignore\", \"Strict\", \"Warn\""
        );
        let error = ApiError::invalid_option(
            options,
            "fieldValidation",
            "FieldValueNotSupported",
            &detail,
        );
        return Ok(error_response(&error));
    }
    let mut warnings = Vec::new();
    let result: Result<(u16, Value), ApiError> = (|| match (method, name) {
        (Method::GET, Some(name)) => {
            let object = shared.lock_store().get(&info, ns, &name)?;
            Ok((
                200,
                if metadata_only {
                    Store::partial(&object)
                } else {
                    object
                },
            ))
        }
        (Method::GET, None) => {
            let (items, rv) = shared.lock_store().list(&info, &selection);
            if metadata_only {
                Ok((200, partial_list(items, rv)))
            } else {
                Ok((200, list_document(&info, items, rv)))
            }
        }
        (Method::POST, None) => {
            let object = parse_object(&info, &body)?;
            let object =
                validation::unknown_fields(&info, object, &field_validation, &mut warnings)?;
            shared
                .lock_store()
                .create(&info, ns, object, dry_run)
                .map(|o| (201, o))
        }
        (Method::PUT, Some(name)) => {
            let object = parse_object(&info, &body)?;
            let object =
                validation::unknown_fields(&info, object, &field_validation, &mut warnings)?;
            let (o, created) = shared
                .lock_store()
                .update(&info, ns, &name, object, sub, dry_run)?;
            Ok((if created { 201 } else { 200 }, o))
        }
        (Method::PATCH, Some(name)) => {
            let kind = match content_type.as_str() {
                "application/merge-patch+json" => PatchKind::Merge,
                "application/json-patch+json" => PatchKind::Json,
                "application/strategic-merge-patch+json" => PatchKind::Strategic,
                "application/apply-patch+yaml" | "application/apply-patch+json" => {
                    if query.get("fieldManager").is_none_or(String::is_empty) {
                        return Err(ApiError::invalid_option(
                            "PatchOptions",
                            "fieldManager",
                            "FieldValueRequired",
                            "Required value: is required for apply patch",
                        ));
                    }
                    PatchKind::Apply
                }
                other => return Err(ApiError::unsupported_media_type(other)),
            };
            let patch: Value = serde_json::from_slice(&body).map_err(|e| {
                ApiError::bad_request(format!(
                    "error decoding patch: {e} (only JSON patch bodies are supported)"
                ))
            })?;
            if kind != PatchKind::Json && !patch.is_object() {
                return Err(ApiError::bad_request(
                    "error decoding patch: the patch is not a JSON object",
                ));
            }
            let (o, created) = shared.lock_store().patch(
                &info,
                ns,
                &name,
                kind,
                patch,
                sub,
                dry_run,
                query.get("fieldManager").map(String::as_str),
            )?;
            Ok((if created { 201 } else { 200 }, o))
        }
        (Method::DELETE, Some(name)) => {
            let pre = preconditions(&body)?;
            let deleted = shared
                .lock_store()
                .delete(&info, ns, &name, &pre, dry_run)?;
            if info.returns_deleted_object() {
                Ok((200, deleted))
            } else {
                Ok((200, delete_success(&info, &deleted)))
            }
        }
        (Method::DELETE, None) => {
            let items = shared.lock_store().delete_collection(&info, &selection);
            let rv = shared.lock_store().resource_version();
            Ok((200, list_document(&info, items, rv)))
        }
        (m, _) => Err(ApiError::method_not_allowed(m.as_str())),
    })();
    let mut response = match result {
        Ok((code, value)) => json_response(code, &value),
        Err(err) => error_response(&err),
    };
    for warning in warnings {
        // The real server's form: `299 - "unknown field \"spec.foo\""`.
        let text = format!(
            "299 - {}",
            serde_json::to_string(&warning).unwrap_or_default()
        );
        if let Ok(value) = HeaderValue::from_str(&text) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    Ok(response)
}

fn selection(
    query: &HashMap<String, String>,
    namespace: Option<String>,
    plural: &str,
) -> Result<Selection, ApiError> {
    let labels = match query.get("labelSelector") {
        Some(s) => LabelSelector::parse(s).map_err(ApiError::bad_request)?,
        None => LabelSelector::default(),
    };
    let fields = match query.get("fieldSelector") {
        Some(s) => FieldSelector::parse_for(s, plural).map_err(ApiError::bad_request)?,
        None => FieldSelector::default(),
    };
    Ok(Selection {
        namespace,
        labels,
        fields,
    })
}

/// The `Status` a DELETE answers with for resources that do not return the deleted object.
fn delete_success(info: &ResourceInfo, deleted: &Value) -> Value {
    let mut details = json!({
        "name": deleted["metadata"]["name"],
        "kind": info.plural,
        "uid": deleted["metadata"]["uid"],
    });
    if !info.group.is_empty() {
        details["group"] = json!(info.group);
    }
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    })
}

/// A `PartialObjectMetadataList` of the given objects.
fn partial_list(items: Vec<Value>, rv: u64) -> Value {
    json!({
        "kind": "PartialObjectMetadataList",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": { "resourceVersion": rv.to_string() },
        "items": items.iter().map(Store::partial).collect::<Vec<_>>(),
    })
}

fn list_document(info: &ResourceInfo, items: Vec<Value>, rv: u64) -> Value {
    let items: Vec<Value> = items
        .into_iter()
        .map(|mut item| {
            // Typed lists of built-in resources omit each item's kind and apiVersion.
            if !info.custom
                && let Some(map) = item.as_object_mut()
            {
                map.remove("kind");
                map.remove("apiVersion");
            }
            item
        })
        .collect();
    json!({
        "kind": format!("{}List", info.kind),
        "apiVersion": info.api_version(),
        "metadata": { "resourceVersion": rv.to_string() },
        "items": items,
    })
}

fn parse_object(info: &ResourceInfo, body: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): couldn't get version/kind; json parse error: the body is not a JSON object",
            info.kind
        ))),
        Err(e) => Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): couldn't get version/kind; json parse error: {e}",
            info.kind
        ))),
    }
}

fn preconditions(body: &[u8]) -> Result<Preconditions, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Preconditions::default());
    }
    let options: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding DeleteOptions: {e}")))?;
    let pre = &options["preconditions"];
    Ok(Preconditions {
        uid: pre["uid"].as_str().map(str::to_owned),
        resource_version: pre["resourceVersion"].as_str().map(str::to_owned),
    })
}
