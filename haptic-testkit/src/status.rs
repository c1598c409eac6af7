//! `Status` error bodies formed exactly as kube-apiserver forms them.

use serde_json::{Value, json};

use crate::resources::ResourceInfo;

/// An API error answer: the HTTP code and the `Status` object sent as the body.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) body: Value,
    /// `Retry-After` header value in seconds, for 429 and some 5xx answers.
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    fn new(code: u16, reason: &str, message: String, details: Option<Value>) -> Self {
        let mut body = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        });
        if let Some(details) = details {
            body["details"] = details;
        }
        Self {
            code,
            body,
            retry_after: None,
        }
    }

    fn details(info: &ResourceInfo, name: &str) -> Value {
        let mut d = json!({ "name": name, "kind": info.plural });
        if !info.group.is_empty() {
            d["group"] = json!(info.group);
        }
        d
    }

    /// 404 NotFound: `leases.coordination.k8s.io "x" not found`.
    pub(crate) fn not_found(info: &ResourceInfo, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", info.qualified()),
            Some(Self::details(info, name)),
        )
    }

    /// 409 AlreadyExists.
    pub(crate) fn already_exists(info: &ResourceInfo, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", info.qualified()),
            Some(Self::details(info, name)),
        )
    }

    /// 409 Conflict on a stale resourceVersion (the optimistic-lock message of the real server).
    pub(crate) fn conflict(info: &ResourceInfo, name: &str) -> Self {
        Self::conflict_because(
            info,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 409 Conflict with a given cause, e.g. a failed delete precondition.
    pub(crate) fn conflict_because(info: &ResourceInfo, name: &str, cause: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {cause}",
                info.qualified()
            ),
            Some(Self::details(info, name)),
        )
    }

    /// 409 Conflict for a failed DELETE precondition. The real server's delete path names the
    /// kind, not the resource (`Lease.coordination.k8s.io "x"`, details.kind `Lease`).
    pub(crate) fn delete_precondition_failed(info: &ResourceInfo, name: &str, cause: &str) -> Self {
        let mut details = Self::details(info, name);
        details["kind"] = json!(info.kind);
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {cause}",
                info.kind_qualified()
            ),
            Some(details),
        )
    }

    /// 422 Invalid with field causes: `(field, message)` pairs, message already prefixed with
    /// the Go error type text (e.g. `Invalid value: 0: must be greater than 0`).
    pub(crate) fn invalid(info: &ResourceInfo, name: &str, causes: &[(String, String)]) -> Self {
        let aggregate: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let joined = if aggregate.len() == 1 {
            aggregate[0].clone()
        } else {
            format!("[{}]", aggregate.join(", "))
        };
        let mut details = Self::details(info, name);
        details["kind"] = json!(info.kind);
        details["causes"] = causes
            .iter()
            .map(|(field, message)| {
                let reason = if message.starts_with("Required value") {
                    "FieldValueRequired"
                } else if message.starts_with("Unsupported value") {
                    "FieldValueNotSupported"
                } else if message.starts_with("Forbidden") {
                    "FieldValueForbidden"
                } else {
                    "FieldValueInvalid"
                };
                json!({ "reason": reason, "message": message, "field": field })
            })
            .collect();
        Self::new(
            422,
            "Invalid",
            format!("{} \"{name}\" is invalid: {joined}", info.kind_qualified()),
            Some(details),
        )
    }

    /// 422 Invalid for a PUT without `metadata.resourceVersion` on a resource that does not
    /// allow unconditional updates (Leases). The real server names the resource, not the kind.
    pub(crate) fn rv_required(info: &ResourceInfo, name: &str) -> Self {
        let field = "metadata.resourceVersion";
        // kube-apiserver 1.34's wording (older releases printed `0x0`).
        let message = "Invalid value: 0: must be specified for an update";
        let mut details = Self::details(info, name);
        details["causes"] =
            json!([{ "reason": "FieldValueInvalid", "message": message, "field": field }]);
        Self::new(
            422,
            "Invalid",
            format!(
                "{} \"{name}\" is invalid: {field}: {message}",
                info.qualified()
            ),
            Some(details),
        )
    }

    /// 422 Invalid for a resourceVersion that is not a number, as the storage layer reports it
    /// (the group and resource stand in the kind's place, and the name is empty).
    pub(crate) fn invalid_resource_version(
        info: &ResourceInfo,
        rv: &str,
        error: &std::num::ParseIntError,
    ) -> Self {
        let message = format!(
            "Invalid value: \"{rv}\": strconv.ParseUint: parsing \"{rv}\": {}",
            if matches!(error.kind(), std::num::IntErrorKind::PosOverflow) {
                "value out of range"
            } else {
                "invalid syntax"
            }
        );
        let mut details = json!({ "kind": info.plural, "causes": [
            { "reason": "FieldValueInvalid", "message": message, "field": "resourceVersion" },
        ] });
        if !info.group.is_empty() {
            details["group"] = json!(info.group);
        }
        Self::new(
            422,
            "Invalid",
            format!(
                "{} \"\" is invalid: resourceVersion: {message}",
                info.qualified()
            ),
            Some(details),
        )
    }

    /// 422 Invalid for a query option the request's options kind (`CreateOptions`,
    /// `PatchOptions`, ...) does not accept, as kube-apiserver validates them.
    pub(crate) fn invalid_option(options: &str, field: &str, reason: &str, detail: &str) -> Self {
        let details = json!({
            "group": "meta.k8s.io",
            "kind": options,
            "causes": [{ "reason": reason, "message": detail, "field": field }],
        });
        Self::new(
            422,
            "Invalid",
            format!("{options}.meta.k8s.io \"\" is invalid: {field}: {detail}"),
            Some(details),
        )
    }

    /// 400 BadRequest.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message.into(), None)
    }

    /// 405 MethodNotAllowed.
    pub(crate) fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({method})"),
            None,
        )
    }

    /// 404 for a path the server does not serve.
    pub(crate) fn path_not_found(path: &str) -> Self {
        let mut e = Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource".to_owned(),
            Some(
                json!({ "causes": [{ "reason": "UnexpectedServerResponse", "message": format!("404 page not found: {path}") }] }),
            ),
        );
        e.body["details"] = json!({});
        e
    }

    /// 415 UnsupportedMediaType for a PATCH content type the server does not know.
    pub(crate) fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {content_type:?})"
            ),
            None,
        )
    }

    /// 410 Expired: a watch or list from a resourceVersion older than the kept history.
    pub(crate) fn expired(rv: u64, oldest: u64) -> Self {
        Self::new(
            410,
            "Expired",
            format!("too old resource version: {rv} ({oldest})"),
            None,
        )
    }

    /// An injected server-side failure (500, 503, 429 ...).
    pub(crate) fn injected(code: u16, retry_after: Option<u64>) -> Self {
        let (reason, message) = match code {
            429 => (
                "TooManyRequests",
                "Too many requests, please try again later.".to_owned(),
            ),
            503 => (
                "ServiceUnavailable",
                "The server is currently unable to handle the request (injected fault)".to_owned(),
            ),
            504 => (
                "Timeout",
                "The server was unable to return a response in the time allotted (injected fault)"
                    .to_owned(),
            ),
            500 => (
                "InternalError",
                "Internal error occurred: injected fault".to_owned(),
            ),
            _ => ("InternalError", format!("injected fault with code {code}")),
        };
        let details = retry_after.map(|s| json!({ "retryAfterSeconds": s }));
        let mut e = Self::new(code, reason, message, details);
        e.retry_after = retry_after;
        e
    }
}
