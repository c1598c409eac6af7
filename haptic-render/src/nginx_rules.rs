//! The filter `nginx_rules`: the lines of a backend for the routes of Ingresses with
//! ingress-nginx annotations, from the policy row the snippet `nginx-backend` reads (`p`,
//! [`crate::nginx::Policy::row`]).
//!
//! The snippet asked the engine for each of the row's 30-odd fields, one `{% if p.<field> %}` at
//! a time; at 10,000 Ingresses a quarter of which carry annotations that was an eighth of a
//! full render. Here the row is read once, in one pass over its fields, and the lines are
//! written as the snippet wrote them, byte for byte (a property test renders both). The parts
//! that read Secrets (proxy-ssl-secret, auth-tls-secret: `refuse()`, Events, store reads) stay
//! in the snippet, between the two parts:
//!
//! - `part="head"`: the balance (upstream-hash-by: consistent hashing; load-balance ewma:
//!   leastconn; else roundrobin), the timeouts, the affinity cookie, the stick table of the
//!   limits, then the redirects (to HTTPS, app-root, permanent/temporal);
//! - `part="rules"`: the source lists (deny, then allow; `invalid` denies every client; more
//!   than 50 CIDRs are a named ACL over lines of 50), the rate and connection limits, basic
//!   authentication (`backend`: the backend's name, whose userlist is `<backend>_auth`), the
//!   body size, the path rewrite, Host, X-Forwarded-Prefix, CORS.
//!
//! Every value was validated when the row was made (CIDRs normalized, URLs, paths and names
//! one token, `%` escaped); what is written is what the row holds, as `{{ }}` writes it.
//!
//! ```
//! use haptic_render::nginx::{self, Policy};
//! use haptic_render::nginx_rules::{Part, rules};
//!
//! let mut policy = Policy::default();
//! policy.body_limit = Some(1024);
//! let row = policy.row();
//! assert_eq!(rules(&row, Some(Part::Head), "b"), "\n    balance roundrobin");
//! assert_eq!(
//!     rules(&row, Some(Part::Rules), "b"),
//!     "\n    http-request deny status 413 if { req.hdr_val(content-length) gt 1024 }",
//! );
//! # let _ = nginx::PREFIX;
//! ```

use std::fmt::Write as _;

use tera::{Kwargs, State, Tera, Value};

/// Which lines [`rules`] writes: those before the Secret-reading rules, or those after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Balance, timeouts, cookie, stick table, redirects.
    Head,
    /// Source lists, limits, basic authentication, body size, rewrite, headers, CORS.
    Rules,
}

/// Sources and origins on one line at most; more are a named ACL over lines of this many
/// (HAProxy reads at most 64 words a line).
const PER_LINE: usize = 50;

/// The fields of a policy row `rules` reads, found in one pass over the row.
#[derive(Default)]
struct Row<'a> {
    hash_by: Option<&'a Value>,
    hash_name: Option<&'a Value>,
    least_conn: Option<&'a Value>,
    connect_timeout: Option<&'a Value>,
    server_timeout: Option<&'a Value>,
    cookie: Option<&'a Value>,
    cookie_max_age: Option<&'a Value>,
    limit_requests: Option<&'a Value>,
    limit_connections: Option<&'a Value>,
    limit_exempt: Option<&'a Value>,
    force_ssl_redirect: Option<&'a Value>,
    app_root: Option<&'a Value>,
    redirect: Option<&'a Value>,
    redirect_code: Option<&'a Value>,
    deny: Option<&'a Value>,
    allow: Option<&'a Value>,
    auth_realm: Option<&'a Value>,
    body_limit: Option<&'a Value>,
    rewrite_path: Option<&'a Value>,
    rewrite_target: Option<&'a Value>,
    upstream_vhost: Option<&'a Value>,
    forwarded_prefix: Option<&'a Value>,
    cors: Option<&'a Value>,
}

impl<'a> Row<'a> {
    fn of(policy: &'a Value) -> Self {
        let mut row = Row::default();
        let Some(map) = policy.as_map() else {
            return row;
        };
        for (key, value) in map {
            let Some(key) = key.as_str() else { continue };
            let field = match key {
                "hash_by" => &mut row.hash_by,
                "hash_name" => &mut row.hash_name,
                "least_conn" => &mut row.least_conn,
                "connect_timeout" => &mut row.connect_timeout,
                "server_timeout" => &mut row.server_timeout,
                "cookie" => &mut row.cookie,
                "cookie_max_age" => &mut row.cookie_max_age,
                "limit_requests" => &mut row.limit_requests,
                "limit_connections" => &mut row.limit_connections,
                "limit_exempt" => &mut row.limit_exempt,
                "force_ssl_redirect" => &mut row.force_ssl_redirect,
                "app_root" => &mut row.app_root,
                "redirect" => &mut row.redirect,
                "redirect_code" => &mut row.redirect_code,
                "deny" => &mut row.deny,
                "allow" => &mut row.allow,
                "auth_realm" => &mut row.auth_realm,
                "body_limit" => &mut row.body_limit,
                "rewrite_path" => &mut row.rewrite_path,
                "rewrite_target" => &mut row.rewrite_target,
                "upstream_vhost" => &mut row.upstream_vhost,
                "forwarded_prefix" => &mut row.forwarded_prefix,
                "cors" => &mut row.cors,
                _ => continue,
            };
            *field = Some(value);
        }
        row
    }
}

/// `{% if v %}`: whether a field is there and truthy.
pub(crate) fn truthy(value: Option<&Value>) -> bool {
    value.is_some_and(Value::is_truthy)
}

/// `{{ v }}`: a field as the engine writes it (nothing for a missing one).
pub(crate) fn put(out: &mut String, value: Option<&Value>) {
    if let Some(value) = value {
        if let Some(text) = value.as_str() {
            out.push_str(text);
        } else if let Some(number) = value.as_i64() {
            // Without the formatting machinery (a port, a length, a weight on every line).
            push_integer(out, number);
        } else {
            let _ = write!(out, "{value}");
        }
    }
}

/// `number` in decimal, as `{{ }}` writes an integer.
pub(crate) fn push_integer(out: &mut String, number: i64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = number.unsigned_abs();
    loop {
        at -= 1;
        // A digit: `rest % 10` is below 10.
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if number < 0 {
        out.push('-');
    }
    for &digit in &digits[at..] {
        out.push(char::from(digit));
    }
}

/// `\n    <before><field><after>` when the field is truthy (the common shape of a rule).
fn line(out: &mut String, field: Option<&Value>, before: &str, after: &str) {
    if truthy(field) {
        out.push_str("\n    ");
        out.push_str(before);
        put(out, field);
        out.push_str(after);
    }
}

/// A field's text, when it is a string.
fn text(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str)
}

/// The elements of a list field (none for anything else).
fn items(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).unwrap_or_default()
}

/// A list as `{{ v | length }}` counts it.
fn length(value: Option<&Value>) -> usize {
    match value {
        Some(v) if v.as_array().is_some() => items(value).len(),
        Some(v) => v.as_str().map_or(0, |s| s.chars().count()),
        None => 0,
    }
}

/// `<line> <item> <item> ...` for every 50 items, each on a new line.
fn named_acl(out: &mut String, line: &str, values: &[Value]) {
    for (i, value) in values.iter().enumerate() {
        if i % PER_LINE == 0 {
            out.push_str("\n    ");
            out.push_str(line);
        }
        out.push(' ');
        put(out, Some(value));
    }
}

/// ` <item> <item> ...`.
fn inline(out: &mut String, values: &[Value]) {
    for value in values {
        out.push(' ');
        put(out, Some(value));
    }
}

/// The lines of `part` for the policy row `policy` of backend `backend`, each after a newline,
/// as the snippet `nginx-backend` wrote them (see the module docs).
pub fn rules(policy: &Value, part: Option<Part>, backend: &str) -> String {
    let p = Row::of(policy);
    let mut out = String::with_capacity(256);
    if part != Some(Part::Rules) {
        head(&mut out, &p);
    }
    if part != Some(Part::Head) {
        access(&mut out, &p, backend);
    }
    out
}

fn head(out: &mut String, p: &Row<'_>) {
    let least_conn = truthy(p.least_conn);
    let hashed = truthy(p.hash_by);
    out.push_str("\n    balance ");
    // With a name: the text before it, and after it.
    let (before, named, after) = match text(p.hash_by).filter(|_| hashed) {
        Some("request_uri") => ("uri whole", false, ""),
        Some("uri") => ("uri", false, ""),
        Some("remote_addr") => ("source", false, ""),
        Some("header") => ("hdr(", true, ")"),
        Some("cookie") => ("hash req.cook(", true, ")"),
        Some("arg") => ("url_param ", true, ""),
        _ if least_conn => ("leastconn", false, ""),
        _ => ("roundrobin", false, ""),
    };
    out.push_str(before);
    if named {
        put(out, p.hash_name);
    }
    out.push_str(after);
    if hashed {
        out.push_str("\n    hash-type consistent");
    }
    line(out, p.connect_timeout, "timeout connect ", "s");
    line(out, p.server_timeout, "timeout server ", "s");
    if truthy(p.cookie) {
        out.push_str("\n    cookie ");
        put(out, p.cookie);
        out.push_str(" insert indirect nocache httponly");
        if truthy(p.cookie_max_age) {
            out.push_str(" maxlife ");
            put(out, p.cookie_max_age);
            out.push_str("s attr Max-Age=");
            put(out, p.cookie_max_age);
        }
    }
    if truthy(p.limit_requests) || truthy(p.limit_connections) {
        out.push_str(
            "\n    stick-table type ipv6 size 100k expire 60s store http_req_rate(1s),conn_cur",
        );
    }
    if truthy(p.force_ssl_redirect) {
        out.push_str("\n    http-request redirect scheme https code 308 if !{ ssl_fc }");
    }
    line(
        out,
        p.app_root,
        "http-request redirect location ",
        " code 302 if { path / }",
    );
    if truthy(p.redirect) {
        out.push_str("\n    http-request redirect location \"");
        put(out, p.redirect);
        out.push_str("\" code ");
        put(out, p.redirect_code);
    }
}

/// A source list (`deny` or `allow`): `invalid` denies every client; a list denies or admits
/// its sources, on the rule's line or, past 50, as the named ACL `acl`.
fn sources(out: &mut String, list: Option<&Value>, acl: &str, condition: &str) {
    if text(list) == Some("invalid") {
        out.push_str("\n    http-request deny status 403");
    } else if truthy(list) {
        if length(list) > PER_LINE {
            named_acl(out, &format!("acl {acl} src"), items(list));
            out.push_str("\n    http-request deny status 403 ");
            out.push_str(condition);
            out.push(' ');
            out.push_str(acl);
        } else {
            out.push_str("\n    http-request deny status 403 ");
            out.push_str(condition);
            out.push_str(" { src");
            inline(out, items(list));
            out.push_str(" }");
        }
    }
}

fn access(out: &mut String, p: &Row<'_>, backend: &str) {
    sources(out, p.deny, "nginx_deny", "if");
    sources(out, p.allow, "nginx_allow", "unless");
    if truthy(p.limit_requests) || truthy(p.limit_connections) {
        if length(p.limit_exempt) > PER_LINE {
            named_acl(out, "acl nginx_limit_exempt src", items(p.limit_exempt));
            out.push_str("\n    http-request track-sc0 src unless nginx_limit_exempt");
        } else {
            out.push_str("\n    http-request track-sc0 src");
            if truthy(p.limit_exempt) {
                out.push_str(" unless { src");
                inline(out, items(p.limit_exempt));
                out.push_str(" }");
            }
        }
        line(
            out,
            p.limit_requests,
            "http-request deny deny_status 503 if { sc_http_req_rate(0) gt ",
            " }",
        );
        line(
            out,
            p.limit_connections,
            "http-request deny deny_status 503 if { sc_conn_cur(0) gt ",
            " }",
        );
    }
    if truthy(p.auth_realm) {
        out.push_str("\n    http-request auth realm \"");
        put(out, p.auth_realm);
        out.push_str("\" unless { http_auth(");
        out.push_str(backend);
        out.push_str("_auth) }");
    }
    line(
        out,
        p.body_limit,
        "http-request deny status 413 if { req.hdr_val(content-length) gt ",
        " }",
    );
    if truthy(p.rewrite_path) {
        out.push_str("\n    http-request replace-path (?i)^");
        put(out, p.rewrite_path);
        out.push(' ');
        put(out, p.rewrite_target);
    }
    line(out, p.upstream_vhost, "http-request set-header Host ", "");
    line(
        out,
        p.forwarded_prefix,
        "http-request set-header X-Forwarded-Prefix \"",
        "\"",
    );
    if truthy(p.cors) {
        cors(out, p.cors);
    }
}

/// CORS (enable-cors): the origin a request names, if it is allowed (any, for `*`), gets the
/// headers; a preflight (OPTIONS) from it is answered 204 here.
fn cors(out: &mut String, cors: Option<&Value>) {
    let field = |name: &str| {
        cors.and_then(Value::as_map)?
            .iter()
            .find_map(|(k, v)| (k.as_str() == Some(name)).then_some(v))
    };
    let (origins, credentials) = (field("origins"), truthy(field("credentials")));
    let (methods, headers, expose, max_age) = (
        field("methods"),
        field("headers"),
        field("expose"),
        field("max_age"),
    );
    out.push_str("\n    http-request set-var(txn.cors_origin) req.hdr(origin)");
    let acao = if truthy(origins) {
        named_acl(
            out,
            "acl cors_ok var(txn.cors_origin) -m reg",
            items(origins),
        );
        "%[var(txn.cors_origin)]"
    } else {
        out.push_str("\n    acl cors_ok always_true");
        "*"
    };
    out.push_str("\n    http-request return status 204 hdr Access-Control-Allow-Origin \"");
    out.push_str(acao);
    out.push('"');
    if credentials {
        out.push_str(" hdr Access-Control-Allow-Credentials true");
    }
    out.push_str(" hdr Access-Control-Allow-Methods \"");
    put(out, methods);
    out.push_str("\" hdr Access-Control-Allow-Headers \"");
    put(out, headers);
    out.push('"');
    if truthy(expose) {
        out.push_str(" hdr Access-Control-Expose-Headers \"");
        put(out, expose);
        out.push('"');
    }
    out.push_str(" hdr Access-Control-Max-Age ");
    put(out, max_age);
    out.push_str(" if METH_OPTIONS cors_ok");
    out.push_str("\n    http-response set-header Access-Control-Allow-Origin \"");
    out.push_str(acao);
    out.push_str("\" if cors_ok");
    if credentials {
        out.push_str(
            "\n    http-response set-header Access-Control-Allow-Credentials true if cors_ok",
        );
    }
    out.push_str("\n    http-response set-header Access-Control-Allow-Methods \"");
    put(out, methods);
    out.push_str("\" if cors_ok");
    out.push_str("\n    http-response set-header Access-Control-Allow-Headers \"");
    put(out, headers);
    out.push_str("\" if cors_ok");
    line(
        out,
        expose,
        "http-response set-header Access-Control-Expose-Headers \"",
        "\" if cors_ok",
    );
    out.push_str("\n    http-response set-header Access-Control-Max-Age ");
    put(out, max_age);
    out.push_str(" if cors_ok");
}

/// The `policy` and `name` of a backend row, found in one pass over it.
fn policy_and_name(backend: &Value) -> (Option<&Value>, &str) {
    let (mut policy, mut name) = (None, "");
    for (key, value) in backend.as_map().into_iter().flatten() {
        match key.as_str() {
            Some("policy") => policy = Some(value),
            Some("name") => name = value.as_str().unwrap_or_default(),
            _ => {}
        }
    }
    (policy, name)
}

/// [`rules`] of a backend row (its `policy` and `name`, as the filter `nginx_rules` reads
/// them); `None` when the row has no `policy` map.
pub fn backend_rules(backend: &Value, part: Option<Part>) -> Option<String> {
    let (policy, name) = policy_and_name(backend);
    let policy = policy.filter(|p| p.as_map().is_some())?;
    Some(rules(policy, part, name))
}

/// Registers the filter `nginx_rules` over a backend row `b` (its `policy` and `name`):
/// `{{ b | nginx_rules }}` writes every line ([`rules`]), `part="head"` or `part="rules"` one
/// part. Without an argument the call builds no arguments map: it runs once per annotated
/// backend.
pub(crate) fn register(tera: &mut Tera) {
    tera.register_filter(
        "nginx_rules",
        |backend: &Value, kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let part = match kwargs.get::<&str>("part")? {
                None => None,
                Some("head") => Some(Part::Head),
                Some("rules") => Some(Part::Rules),
                Some(other) => {
                    return Err(tera::Error::message(format!(
                        "nginx_rules: `part` must be \"head\" or \"rules\", got {other:?}"
                    )));
                }
            };
            backend_rules(backend, part).ok_or_else(|| {
                tera::Error::message(
                    "nginx_rules: the value must be a backend row with a `policy` map",
                )
            })
        },
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn integers_are_written_as_the_engine_writes_them() {
        for number in [0, 7, 10, -1, -10, 1_234_567, i64::MAX, i64::MIN] {
            let mut out = String::from("x");
            super::push_integer(&mut out, number);
            assert_eq!(out, format!("x{}", tera::Value::from(number)));
        }
    }
}
