//! The filter `gateway_action`: the lines of one HTTPRoute rule's action in a Gateway
//! frontend, from a row of `actions` of the Gateway API view (`derived.gateway`, a frontend's
//! `actions`), applied when `txn.gwm` names the action (`{ var(txn.gwm) -m str <id> }`).
//!
//! The snippet `gateway-action` wrote them with a template test per field of the row; at
//! 10,000 HTTPRoutes of two rules each that was 20,000 rows and over a third of a full render
//! (about 11,000 instructions a row: each `row.<field>` is a lookup, each `{% for %}` a loop
//! state). Here the row is read once, in one pass over its fields, and the lines are written as
//! the snippet wrote them, byte for byte (a test renders both: `tests/gateway_action.rs`
//! against `tests/raw-templates/gateway-action.tera`, the snippet before the filter). In order:
//!
//! - `request_headers`, then `response_headers`: `http-request` / `http-response` `<op>
//!   <name>[ <value>]` per entry (the RequestHeaderModifier and ResponseHeaderModifier
//!   filters);
//! - `rewrite` (URLRewrite): `set-header Host`, then a full path (`set-path`) or a replaced
//!   prefix: the first `len` bytes of the path (the matched prefix) become `with`; what follows
//!   (`txn.gwrest`) is a `/` and the rest, or nothing, and then the path is `exact`;
//! - `redirect` (RequestRedirect): with a replaced prefix, the location for a longer path and
//!   for the prefix alone with a query; then `location` with `code`;
//! - else the backends: one `use_backend` per share, a random draw over `total` when there are
//!   several (`upper`: the share's bound), `gateway-500` for a share without a backend, and for
//!   an action whose weights are all 0.
//!
//! Every value was validated when the row was made (names and values one token or quoted);
//! what is written is what the row holds, as `{{ }}` writes it.

use tera::{Kwargs, State, Tera, Value};

use crate::nginx_rules::{put, truthy};

/// The fields of an action row the filter reads, found in one pass over the row.
#[derive(Default)]
struct Row<'a> {
    id: Option<&'a Value>,
    request_headers: Option<&'a Value>,
    response_headers: Option<&'a Value>,
    rewrite: Option<&'a Value>,
    redirect: Option<&'a Value>,
    total: Option<&'a Value>,
    shares: Option<&'a Value>,
}

impl<'a> Row<'a> {
    fn of(row: &'a Value) -> Option<Self> {
        let map = row.as_map()?;
        let mut out = Row::default();
        for (key, value) in map {
            let field = match key.as_str() {
                Some("id") => &mut out.id,
                Some("request_headers") => &mut out.request_headers,
                Some("response_headers") => &mut out.response_headers,
                Some("rewrite") => &mut out.rewrite,
                Some("redirect") => &mut out.redirect,
                Some("total") => &mut out.total,
                Some("shares") => &mut out.shares,
                _ => continue,
            };
            *field = Some(value);
        }
        Some(out)
    }
}

/// A field of a map value (`v.<name>`), if both are there.
fn get<'a>(value: Option<&'a Value>, name: &str) -> Option<&'a Value> {
    value?
        .as_map()?
        .iter()
        .find_map(|(k, v)| (k.as_str() == Some(name)).then_some(v))
}

/// The items of a list value (none for anything else).
fn items(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).unwrap_or(&[])
}

/// The lines of an action row (`\n    ` before each), as the snippet `gateway-action` wrote
/// them; `None` when the row is not a map.
pub fn action_lines(row: &Value) -> Option<String> {
    let r = Row::of(row)?;
    let mut out = String::with_capacity(512);
    // ` if { var(txn.gwm) -m str <id> }`, the end of every line's condition's first term.
    let mut when = String::with_capacity(48);
    when.push_str(" if { var(txn.gwm) -m str ");
    put(&mut when, r.id);
    when.push_str(" }");
    for (list, verb) in [
        (r.request_headers, "http-request "),
        (r.response_headers, "http-response "),
    ] {
        for h in items(list) {
            out.push_str("\n    ");
            out.push_str(verb);
            put(&mut out, get(Some(h), "op"));
            out.push(' ');
            put(&mut out, get(Some(h), "name"));
            let value = get(Some(h), "value");
            if truthy(value) {
                out.push(' ');
                put(&mut out, value);
            }
            out.push_str(&when);
        }
    }
    if truthy(r.rewrite) {
        let host = get(r.rewrite, "host");
        if truthy(host) {
            out.push_str("\n    http-request set-header Host ");
            put(&mut out, host);
            out.push_str(&when);
        }
        let path = get(r.rewrite, "path");
        let prefix = get(r.rewrite, "prefix");
        if truthy(path) {
            out.push_str("\n    http-request set-path ");
            put(&mut out, path);
            out.push_str(&when);
        } else if truthy(prefix) {
            let len = get(prefix, "len");
            out.push_str("\n    http-request set-var(txn.gwrest) path,bytes(");
            put(&mut out, len);
            out.push(')');
            out.push_str(&when);
            out.push_str(" !{ path -m len ");
            put(&mut out, len);
            out.push_str(" }\n    http-request set-path ");
            put(&mut out, get(prefix, "exact"));
            out.push_str(&when);
            out.push_str(" !{ var(txn.gwrest) -m found }\n    http-request set-path ");
            put(&mut out, get(prefix, "with"));
            out.push_str("%[var(txn.gwrest)]");
            out.push_str(&when);
            out.push_str(" { var(txn.gwrest) -m found }");
        }
    }
    if truthy(r.redirect) {
        let code = get(r.redirect, "code");
        let prefix = get(r.redirect, "prefix");
        if truthy(prefix) {
            let (base, len) = (get(r.redirect, "base"), get(prefix, "len"));
            out.push_str("\n    http-request redirect location ");
            put(&mut out, base);
            put(&mut out, get(prefix, "with"));
            out.push_str("%[pathq,bytes(");
            put(&mut out, len);
            out.push_str(")] code ");
            put(&mut out, code);
            out.push_str(&when);
            out.push_str(" !{ path -m len ");
            put(&mut out, len);
            out.push_str(" }\n    http-request redirect location ");
            put(&mut out, base);
            put(&mut out, get(prefix, "exact"));
            out.push_str("?%[query] code ");
            put(&mut out, code);
            out.push_str(&when);
            out.push_str(" { query -m found } !{ query -m len 0 }");
        }
        out.push_str("\n    http-request redirect location ");
        put(&mut out, get(r.redirect, "location"));
        out.push_str(" code ");
        put(&mut out, code);
        out.push_str(&when);
    } else if r
        .total
        .and_then(|t| {
            t.as_i64()
                .map(|i| i > 0)
                .or_else(|| t.as_f64().map(|f| f > 0.0))
        })
        .unwrap_or(false)
    {
        let shares = items(r.shares);
        let backend = |out: &mut String, share: &Value| {
            out.push_str("\n    use_backend ");
            let backend = get(Some(share), "backend");
            if truthy(backend) {
                put(out, backend);
            } else {
                out.push_str("gateway-500");
            }
            out.push_str(&when);
        };
        if shares.len() > 1 {
            out.push_str("\n    http-request set-var(txn.gwshare) rand(");
            put(&mut out, r.total);
            out.push(')');
            out.push_str(&when);
            for share in shares {
                backend(&mut out, share);
                out.push_str(" { var(txn.gwshare) -m int lt ");
                put(&mut out, get(Some(share), "upper"));
                out.push_str(" }");
            }
        } else {
            for share in shares {
                backend(&mut out, share);
            }
        }
    } else {
        out.push_str("\n    use_backend gateway-500");
        out.push_str(&when);
    }
    Some(out)
}

/// Registers the filter `gateway_action` over an action row: `{{ row | gateway_action }}`
/// writes its lines ([`action_lines`]).
pub(crate) fn register(tera: &mut Tera) {
    tera.register_filter(
        "gateway_action",
        |row: &Value, _: Kwargs, _: &State| -> tera::TeraResult<String> {
            action_lines(row).ok_or_else(|| {
                tera::Error::message(
                    "gateway_action: the value must be an action row (a map: id, request_headers, \
                     response_headers, rewrite, redirect, total, shares) of derived.gateway",
                )
            })
        },
    );
}
