//! The functions and filters templates get beyond tera's built-ins, as plain Rust functions
//! (reusable by other engines, such as the minijinja peer in the benchmarks) and their tera
//! registration.
//!
//! | name | kind | example | result |
//! | --- | --- | --- | --- |
//! | `sanitize` | filter | `{{ "shop/web:8080" \| sanitize }}` | `shop_web_8080` |
//! | `backend_name` | function | `{{ backend_name(namespace="shop", service="web", port=80) }}` | `shop_web_80` |
//! | `backend_name` | filter | `{{ ["shop", "web", 80] \| backend_name }}` | `shop_web_80` (same, faster: no keyword arguments) |
//! | `regex_escape` | filter | `{{ "/v1.0/(x)" \| regex_escape }}` | `/v1\.0/\(x\)` |
//! | `b64decode` | filter | `{{ "aGk=" \| b64decode }}`, `{{ x \| b64decode(default="") }}` | `hi`; bad input is an error, or `default` when given |
//! | `sort_by` | filter | `{% for s in items \| sort_by(field="spec.priority", reverse=true) %}` | items by priority, highest first, missing last |
//! | `group_by_field` | filter | `{% for g in slices \| group_by_field(field="metadata.namespace") %}{{ g.key }}: {{ g.items \| length }}{% endfor %}` | groups sorted by key |
//! | `htpasswd` | filter | `{% set h = text \| htpasswd %}` | `{users: [{user, hash}], error}`: the htpasswd lines whose hashes HAProxy can check ([`crate::nginx::htpasswd`]), and why others are left out |
//! | `nginx_client_ca` | filter | `{% set ca = ingress \| nginx_client_ca %}` | the Secret (of the Ingress's namespace) whose `ca.crt` verifies its clients (ingress-nginx's auth-tls-secret, [`crate::nginx::client_ca`]), or `""` |
//! | `http_path` | test | `{% if p.path is http_path %}` | true for `/`-rooted paths without whitespace, control characters or `#` |
//! | `hostname` | test | `{% if rule.host is hostname %}` | true for non-wildcard DNS names (lowercase letters, digits, `-`, `.`) |
//! | `wildcard_host` | test | `{% if rule.host is wildcard_host %}` | true for `*.` followed by such a name |
//! | `config_token` | test | `{% if r.host is not config_token %}` | false for text that would end a config, map or crt-list token: whitespace (newlines included), control characters, quotes, `\`, `#` |
//! | `ip_address` | test | `{% if ep.address is ip_address %}` | true for an IPv4 or IPv6 address |
//! | `refuse` | function | `{{ refuse(field="spec.rules[].host", value=r.host, store="ingresses", namespace=r.namespace, name=r.ingress) }}` | nothing in a normal render (the template leaves the value out); in a webhook's render of that very resource, an error naming it, the field and the value |
//! | `fail` | function | `{{ fail(message="ingress x has no rules") }}` | a render error naming the template and line |
//! | `get` | function | `{% set svc = get(store="services", namespace=ns, name=n) %}` | the resource or none |
//! | `get` | filter | `{% set svc = ["services", ns, n] \| get %}` | same as the function, faster |
//! | `lookup` | function | `{% for s in lookup(store="endpointslices", key=[ns, svc]) %}` | resources whose index key matches, sorted |
//! | `lookup` | filter | `{% for s in ["endpointslices", ns, svc] \| lookup %}` | same as the function, faster |
//!
//! Keyword arguments cost tera about half a microsecond each per call (it builds a map for
//! them), which adds up in loops over ten thousand resources: the filter forms of
//! `backend_name`, `get` and `lookup` take their arguments as one list instead, and the
//! reference templates use them in their inner loops.
//! | `ssl_file` | function | `{{ ssl_file(namespace="shop", name="web-tls") }}` | `ssl/10/shop_web-tls.pem` (a bucket, then the Secret's file) |

use std::cmp::Ordering;
use std::collections::BTreeMap;

use base64::Engine as _;
use tera::value::Key;
use tera::{Kwargs, State, Tera, Value};

use crate::value::map_value;

/// Context variable holding `store -> "namespace/name" -> resource`.
pub(crate) const GET_VAR: &str = "__haptic_get";
/// Context variable holding `store -> index key -> [resource]`.
pub(crate) const INDEX_VAR: &str = "__haptic_index";
/// Context variable holding the derived views by name (`derived.<name>` in templates).
pub(crate) const DERIVED_VAR: &str = "derived";
/// Context variable naming the resource under review (`{store, namespace, name}`) in a render
/// of an overlay; absent otherwise.
pub(crate) const REVIEW_VAR: &str = "__haptic_review";

/// What a function given bad input reports.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The input is not valid standard base64.
    #[error("not valid base64: {0}")]
    Base64(String),
    /// The decoded bytes are not UTF-8 text.
    #[error("base64 decodes to bytes that are not UTF-8 text")]
    NotUtf8,
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Makes `input` safe as an HAProxy identifier (backend, server, ACL names): every character
/// other than ASCII letters, digits, `-`, `_` and `.` becomes `_`; an empty input becomes `_`.
///
/// ```
/// assert_eq!(haptic_render::functions::sanitize("shop/web:8080"), "shop_web_8080");
/// assert_eq!(haptic_render::functions::sanitize(""), "_");
/// ```
pub fn sanitize(input: &str) -> String {
    if input.is_empty() {
        return "_".to_owned();
    }
    input
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The backend name for a Service port: `<namespace>_<service>_<port>`, each part sanitized.
///
/// Kubernetes names never contain `_`, so distinct Service ports never share a backend name.
///
/// ```
/// assert_eq!(haptic_render::functions::backend_name("shop", "web", "80"), "shop_web_80");
/// ```
pub fn backend_name(namespace: &str, service: &str, port: &str) -> String {
    format!(
        "{}_{}_{}",
        sanitize(namespace),
        sanitize(service),
        sanitize(port)
    )
}

/// Escapes every regular-expression metacharacter so that `input` matches itself literally in
/// an HAProxy `-m reg` / `map_reg` pattern (PCRE and POSIX extended syntax alike).
///
/// ```
/// assert_eq!(haptic_render::functions::regex_escape("/v1.0/(x)"), r"/v1\.0/\(x\)");
/// ```
pub fn regex_escape(input: &str) -> String {
    let mut out = String::with_capacity(input.len() + 8);
    for c in input.chars() {
        if matches!(
            c,
            '\\' | '.'
                | '+'
                | '*'
                | '?'
                | '('
                | ')'
                | '|'
                | '['
                | ']'
                | '{'
                | '}'
                | '^'
                | '$'
                | '#'
                | '&'
                | '-'
                | '~'
        ) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Decodes standard base64 (as in a Secret's `data`) into UTF-8 text.
///
/// ```
/// assert_eq!(haptic_render::functions::b64decode("aGk=").unwrap(), "hi");
/// assert!(haptic_render::functions::b64decode("not base64!").is_err());
/// ```
pub fn b64decode(input: &str) -> Result<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(input.trim())
        .map_err(|e| Error::Base64(e.to_string()))?;
    String::from_utf8(bytes).map_err(|_| Error::NotUtf8)
}

/// The Secret of an Ingress's namespace whose `ca.crt` verifies its clients
/// ([`crate::nginx::client_ca`] of its `metadata.namespace` and `metadata.annotations`), or `""`.
pub fn nginx_client_ca(ingress: &Value) -> String {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
    let metadata = ingress.as_map().and_then(|m| m.get(&Key::Str("metadata")));
    let field = |name: &'static str| metadata.and_then(|m| m.as_map()?.get(&Key::Str(name)));
    let namespace = text(field("namespace"));
    let Some(annotations) = field("annotations").and_then(Value::as_map) else {
        return String::new();
    };
    let pairs: Vec<(String, String)> = annotations
        .iter()
        .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())))
        .collect();
    let pairs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    crate::nginx::client_ca(&namespace, &pairs)
}

/// How many directories the per-Secret certificates are spread over ([`ssl_file`]).
pub const SSL_BUCKETS: u64 = 64;

/// The path, inside a rendered file set, of the certificate rendered for the Secret
/// `namespace/name` by a per-item `sslCertificates` entry (see [`crate::set::CertificateTemplate`]):
/// `ssl/<bucket>/<namespace>_<name>.pem`, where the bucket (`00` to `3f`) is a hash of the
/// file's name. An agent keeps a large directory of a set as a tree that sets share while it
/// is unchanged; a certificate rotation among 2,500 in one directory made each agent link a
/// new tree of 2,500 files, and in [`SSL_BUCKETS`] directories it links a new tree of ~40
/// (the 63 others linked as they were). A template names the file with `ssl_file()` (or a
/// crt-list line); `crt ssl/` would load no certificate (HAProxy loads the files of that
/// directory, not of its subdirectories).
///
/// ```
/// assert_eq!(haptic_render::functions::ssl_file("shop", "web-tls"), "ssl/10/shop_web-tls.pem");
/// ```
pub fn ssl_file(namespace: &str, name: &str) -> String {
    ssl_item_file(&format!("{}_{}", sanitize(namespace), sanitize(name)))
}

/// The path of a per-item certificate file whose name, without `.pem`, is `file`
/// (`<namespace>_<name>`, sanitized): [`ssl_file`]'s bucket and name.
///
/// ```
/// assert_eq!(haptic_render::functions::ssl_item_file("shop_web-tls"), "ssl/10/shop_web-tls.pem");
/// ```
pub fn ssl_item_file(file: &str) -> String {
    let bucket = crate::slots::fnv1a(file) % SSL_BUCKETS;
    format!("ssl/{bucket:02x}/{file}.pem")
}

/// Whether `path` is safe to use as an HTTP path in a map file or ACL: it starts with `/` and
/// holds no whitespace, control character or `#` (which would end the key or start a comment).
///
/// ```
/// assert!(haptic_render::functions::is_http_path("/api/v1"));
/// assert!(!haptic_render::functions::is_http_path("api"));
/// assert!(!haptic_render::functions::is_http_path("/a b"));
/// ```
pub fn is_http_path(path: &str) -> bool {
    path.starts_with('/')
        && !path
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '#')
}

/// Whether `host` is a plain DNS name usable as a map key and an SNI filter: 1 to 253
/// characters of lowercase ASCII letters, digits, `-` and `.`, with no empty label. Wildcard
/// hosts (`*.example.com`) are not plain names.
///
/// ```
/// assert!(haptic_render::functions::is_hostname("shop.example.com"));
/// assert!(!haptic_render::functions::is_hostname("*.example.com"));
/// assert!(!haptic_render::functions::is_hostname("Shop..example.com"));
/// ```
pub fn is_hostname(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

/// Whether `host` is a wildcard host as the Ingress API defines them: `*.` followed by a plain
/// DNS name ([`is_hostname`]). It matches a host with exactly one more label in front: `*.foo.com`
/// matches `bar.foo.com`, not `baz.bar.foo.com` nor `foo.com`.
///
/// ```
/// assert!(haptic_render::functions::is_wildcard_host("*.example.com"));
/// assert!(!haptic_render::functions::is_wildcard_host("*example.com"));
/// assert!(!haptic_render::functions::is_wildcard_host("a.*.example.com"));
/// assert!(!haptic_render::functions::is_wildcard_host("shop.example.com"));
/// ```
pub fn is_wildcard_host(host: &str) -> bool {
    host.strip_prefix("*.").is_some_and(is_hostname)
}

/// Whether `text` can stand as one token of an HAProxy config, map or crt-list line: no
/// whitespace (a newline would start a new directive or entry, a space a new argument), no
/// control character, no quote or backslash (they change how HAProxy splits a line), no `#`
/// (a comment).
///
/// ```
/// assert!(haptic_render::functions::is_config_token("*.shop.example.com"));
/// assert!(!haptic_render::functions::is_config_token("shop.example.com\n    lua-load /x"));
/// assert!(!haptic_render::functions::is_config_token("a#b"));
/// ```
pub fn is_config_token(text: &str) -> bool {
    !text
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '\\' | '#'))
}

/// Whether `text` is an IPv4 or IPv6 address.
///
/// ```
/// assert!(haptic_render::functions::is_ip_address("fd00::1"));
/// assert!(!haptic_render::functions::is_ip_address("10.0.0.1 backup"));
/// ```
pub fn is_ip_address(text: &str) -> bool {
    text.parse::<std::net::IpAddr>().is_ok()
}

/// What `refuse()` says: the resource, the field, the value (escaped) and why.
pub fn refusal(
    store: &str,
    namespace: &str,
    name: &str,
    field: &str,
    value: &str,
    reason: &str,
) -> String {
    let object = if namespace.is_empty() {
        name.to_owned()
    } else {
        format!("{namespace}/{name}")
    };
    format!(
        "{store} {object}: {field} {value:?} {reason}; refused, it would add to or break the HAProxy configuration"
    )
}

/// The default reason of `refuse()`.
const UNSAFE: &str = "holds whitespace, a control character, a quote, a backslash or `#`";

/// Compares two template values for sorting: numbers numerically, strings by bytes, missing
/// values after present ones; values of different kinds by kind name, so the order is total.
fn compare(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) => Ordering::Greater,
        (Some(_), None) => Ordering::Less,
        (Some(a), Some(b)) => match (a.as_f64(), b.as_f64(), a.as_str(), b.as_str()) {
            (Some(x), Some(y), _, _) => x.total_cmp(&y),
            (_, _, Some(x), Some(y)) => x.cmp(y),
            _ => a
                .name()
                .cmp(b.name())
                .then_with(|| a.to_string().cmp(&b.to_string())),
        },
    }
}

fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_undefined() && !v.is_none())
}

/// A value rendered as text, for use as a key.
fn key_text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), ToOwned::to_owned)
}

/// One answer of `where_any`, kept: its input list (held, so that its address, and the
/// addresses of its rows, cannot be another list's or row's while kept), its arguments, the
/// list it gave, and the verdict on each row by the row's address.
struct WhereAny {
    rows: Value,
    truthy: Vec<String>,
    falsy: Vec<String>,
    selected: Value,
    /// Each row's verdict, in the rows' order.
    verdicts: Vec<bool>,
    /// Rows' places by their address ([`crate::fragments::identity`]), give or take `slack`:
    /// the answer's on the same list before, copied, with the rows put in that it does not
    /// find within the slack (a list rebuilt in the same order, a few rows added or taken
    /// out, changes a few), so it may name rows gone: [`WhereAny::verdict_of`] checks the
    /// row there.
    places: Places,
    /// How far a row may be from its place in `places`: at least `slack.0` and at most
    /// `slack.1` places after it.
    slack: (i64, i64),
}

impl WhereAny {
    /// The verdict on the row whose identity is `id`, and its place.
    fn verdict_of(&self, id: usize) -> Option<(usize, bool)> {
        let indexed = i64::try_from(*self.places.get(&id)?).ok()?;
        (self.slack.0..=self.slack.1).find_map(|shift| {
            let place = usize::try_from(indexed + shift).ok()?;
            Some((place, self.verdict_at(place, id)?))
        })
    }

    /// The verdict on the row at `place`, when the row there is `id` (the answer holds its
    /// rows, so an identity among them is that row's alone).
    fn verdict_at(&self, place: usize, id: usize) -> Option<bool> {
        let row = self.rows.as_array()?.get(place)?;
        if crate::fragments::identity(row) != Some(id) {
            return None;
        }
        self.verdicts.get(place).copied()
    }
}

/// Rows' places by their address ([`crate::fragments::identity`]).
type Places = crate::fragments::Places<usize>;

/// The last answers of `where_any` (the reference set asks two per render).
static WHERE_ANY: std::sync::Mutex<Vec<WhereAny>> = std::sync::Mutex::new(Vec::new());

#[cfg(test)]
thread_local! {
    /// Rows `where_any` read on this thread (the tests count them).
    static WHERE_ANY_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Rows' places `where_any` wrote on this thread.
    static WHERE_ANY_PLACED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many answers of `where_any` are kept.
const WHERE_ANY_KEPT: usize = 8;

/// How wide an answer's slack may grow ([`WhereAny::slack`]) before its places are made
/// afresh: each lookup of a row not found in order probes this many places at most.
const WHERE_ANY_SLACK: i64 = 16;

fn tera_error(e: impl std::fmt::Display) -> tera::Error {
    tera::Error::message(e.to_string())
}

/// The crt-list entries of the Gateway API's HTTPS frontends (`derived.gateway.frontends`):
/// with `shared`, of the frontend on the Ingress frontend's HTTPS port (`https_port`), else of
/// every other HTTPS port; their `certificates` in order, each once (a certificate of two
/// ports is one line of a crt-list). The filter `gateway_certificates(https_port=, shared=)`.
pub fn gateway_certificates(frontends: &[Value], https_port: &Value, shared: bool) -> Vec<Value> {
    fn field<'a>(row: &'a Value, name: &str) -> Option<&'a Value> {
        row.as_map()?
            .iter()
            .find_map(|(k, v)| (k.as_str() == Some(name)).then_some(v))
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for f in frontends {
        let https = field(f, "https").is_some_and(Value::is_truthy);
        let on_shared = field(f, "port").is_some_and(|p| p == https_port);
        if !https || on_shared != shared {
            continue;
        }
        for c in field(f, "certificates")
            .and_then(Value::as_array)
            .unwrap_or_default()
        {
            if seen.insert(key_text(c)) {
                out.push(c.clone());
            }
        }
    }
    out
}

/// Looks `key` up in the per-store map held in the context variable `var`.
pub(crate) fn store_lookup(
    state: &State,
    var: &str,
    store: &str,
    key: &str,
) -> tera::TeraResult<Option<Value>> {
    let stores: Value = state
        .get(var)?
        .ok_or_else(|| tera_error("the render context has no stores"))?;
    let stores = stores
        .as_map()
        .ok_or_else(|| tera_error("the render context's stores are not a map"))?;
    let Some(entries) = stores.get(&Key::Str(store)) else {
        let known: Vec<String> = stores.keys().map(|k| k.to_string()).collect();
        return Err(tera_error(format!(
            "unknown store `{store}` (known: {})",
            known.join(", ")
        )));
    };
    let found = crate::store::find_in(entries, var == GET_VAR, key);
    // A fragment of `render_each` that read this is reused only while it finds the same
    // (what the store holds: a compact store's JSON is the same allocation until the resource
    // changes).
    let var = if var == GET_VAR { GET_VAR } else { INDEX_VAR };
    crate::fragments::record_read(var, store, key, found.as_ref());
    Ok(found.map(|found| crate::value::expand(&found).into_owned()))
}

/// The `key` argument of `lookup`: a string, or a list of parts joined with `/`.
fn lookup_key(key: &Value) -> tera::TeraResult<String> {
    if let Some(s) = key.as_str() {
        return Ok(s.to_owned());
    }
    if let Some(parts) = key.as_array() {
        return Ok(parts.iter().map(key_text).collect::<Vec<_>>().join("/"));
    }
    Err(tera_error(format!(
        "lookup: `key` must be a string or a list, got {}",
        key.name()
    )))
}

/// Registers this module's functions and filters on a tera instance.
pub(crate) fn register(tera: &mut Tera) {
    tera.register_filter("sanitize", |s: &str, _: Kwargs, _: &State| sanitize(s));
    tera.register_filter("regex_escape", |s: &str, _: Kwargs, _: &State| {
        regex_escape(s)
    });
    tera.register_filter(
        "b64decode",
        |s: &str, kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            match (b64decode(s), kwargs.get::<&str>("default")?) {
                (Ok(text), _) => Ok(text),
                (Err(_), Some(default)) => Ok(default.to_owned()),
                (Err(e), None) => Err(tera_error(format!("b64decode: {e}"))),
            }
        },
    );
    tera.register_filter("nginx_client_ca", |ingress: Value, _: Kwargs, _: &State| {
        nginx_client_ca(&ingress)
    });
    tera.register_filter("htpasswd", |s: &str, _: Kwargs, _: &State| {
        let (users, error) = crate::nginx::htpasswd(s);
        let mut map = tera::value::Map::new();
        map.insert(
            tera::value::Key::Str("users"),
            Value::from(
                users
                    .into_iter()
                    .map(|(user, hash)| {
                        let mut row = tera::value::Map::new();
                        row.insert(tera::value::Key::Str("user"), Value::from(user));
                        row.insert(tera::value::Key::Str("hash"), Value::from(hash));
                        Value::from(row)
                    })
                    .collect::<Vec<_>>(),
            ),
        );
        map.insert(tera::value::Key::Str("error"), Value::from(error));
        Value::from(map)
    });
    tera.register_test("http_path", |v: &Value, _: Kwargs, _: &State| {
        v.as_str().is_some_and(is_http_path)
    });
    tera.register_test("hostname", |v: &Value, _: Kwargs, _: &State| {
        v.as_str().is_some_and(is_hostname)
    });
    tera.register_test("wildcard_host", |v: &Value, _: Kwargs, _: &State| {
        v.as_str().is_some_and(is_wildcard_host)
    });
    tera.register_test("config_token", |v: &Value, _: Kwargs, _: &State| {
        v.as_str().is_none_or(is_config_token)
    });
    tera.register_test("ip_address", |v: &Value, _: Kwargs, _: &State| {
        v.as_str().is_some_and(is_ip_address)
    });
    tera.register_function(
        "refuse",
        |kwargs: Kwargs, state: &State| -> tera::TeraResult<String> {
            let store: &str = kwargs.must_get("store")?;
            let namespace: &str = kwargs.get("namespace")?.unwrap_or("");
            let name: &str = kwargs.must_get("name")?;
            let field: &str = kwargs.must_get("field")?;
            let value: Value = kwargs.must_get("value")?;
            let reason: &str = kwargs.get("reason")?.unwrap_or(UNSAFE);
            crate::fragments::record_refuse();
            // Only the resource under review is refused: one already stored, which a watch
            // delivered, is left out by the template as before and blocks nobody.
            let Some(review) = state.get::<Value>(REVIEW_VAR)? else {
                return Ok(String::new());
            };
            let is = |key: &str, want: &str| {
                review.get_from_path(key).and_then(Value::as_str) == Some(want)
            };
            if is("store", store) && is("namespace", namespace) && is("name", name) {
                return Err(tera_error(refusal(
                    store,
                    namespace,
                    name,
                    field,
                    &key_text(&value),
                    reason,
                )));
            }
            Ok(String::new())
        },
    );
    // `pick(keys=[...])`: a map with only those keys, or a list of such maps. Copying an
    // object of one API type into a field of another keeps only the fields the target declares
    // (server-side apply refuses any other, e.g. a Service's `ipMode` in an Ingress's status).
    tera.register_filter(
        "pick",
        |value: Value, kwargs: Kwargs, _: &State| -> tera::TeraResult<Value> {
            let keys: Vec<String> = kwargs.must_get("keys")?;
            let pick_one = |item: &Value| -> tera::TeraResult<Value> {
                let map = item.as_map().ok_or_else(|| {
                    tera_error(format!("pick: expected a map, got {}", item.name()))
                })?;
                Ok(map_value(keys.iter().filter_map(|k| {
                    map.get(&Key::Str(k)).map(|v| (k.clone(), v.clone()))
                })))
            };
            match value.as_array() {
                Some(items) => Ok(Value::from(
                    items
                        .iter()
                        .map(pick_one)
                        .collect::<tera::TeraResult<Vec<_>>>()?,
                )),
                None => pick_one(&value),
            }
        },
    );
    // `rows | where_any(truthy=["conflict"], falsy=["backend"])`: the rows (maps) where at
    // least one `truthy` field is truthy or one `falsy` field is falsy (missing counts as
    // falsy), in order; the very same row values. A pass in Rust instead of a template loop
    // that tests every row (the Events of the few route rows with a problem among 20,000).
    // The same rows list (a view that did not change) gives the very same list back, so a
    // `render_each` over it reuses it whole, as it would the view's own list.
    tera.register_filter(
        "gateway_certificates",
        |frontends: &[Value], kwargs: Kwargs, _: &State| -> tera::TeraResult<Vec<Value>> {
            let https_port: Value = kwargs.get("https_port")?.unwrap_or_else(Value::none);
            let shared: bool = kwargs.get("shared")?.unwrap_or(false);
            Ok(gateway_certificates(frontends, &https_port, shared))
        },
    );
    tera.register_filter(
        "where_any",
        |value: Value, kwargs: Kwargs, _: &State| -> tera::TeraResult<Value> {
            let truthy: Vec<String> = kwargs.get("truthy")?.unwrap_or_default();
            let falsy: Vec<String> = kwargs.get("falsy")?.unwrap_or_default();
            let items = value.as_array().ok_or_else(|| {
                tera_error(format!("where_any: expected a list, got {}", value.name()))
            })?;
            let same = |kept: &WhereAny| {
                kept.rows.as_array().is_some_and(|k| std::ptr::eq(k, items))
                    && kept.truthy == truthy
                    && kept.falsy == falsy
            };
            if let Ok(kept) = WHERE_ANY.lock()
                && let Some(hit) = kept.iter().find(|k| same(k))
            {
                return Ok(hit.selected.clone());
            }
            let field = |map: &tera::value::Map, key: &str| {
                map.get(&Key::Str(key)).is_some_and(Value::is_truthy)
            };
            // A list rebuilt after a change holds mostly the same rows (the same values, at
            // the same addresses): their verdicts are the last answer's, for the same
            // arguments, without reading the rows again (a read of each of 20,000 rows' maps
            // cost about 0.6 µs a row, mostly waiting for memory).
            // The kept answers are held (under the lock) while the list is read, so that the
            // rows whose verdicts they know stay alive and keep their addresses.
            let mut kept = WHERE_ANY
                .lock()
                .map_err(|_| tera_error("where_any: a render thread panicked while filtering"))?;
            let earlier: Vec<&WhereAny> = kept
                .iter()
                .filter(|k| k.truthy == truthy && k.falsy == falsy)
                .collect();
            // The answer on this list before (the same arguments are asked of several lists):
            // the one that has one of the first rows (wherever: a row added before them moves
            // them). It is read in order (the next row is usually the one after the last
            // found there) and its places copied (unless they name many rows gone, or its
            // slack grew wide), with those of the rows it does not find put in.
            let base = items.iter().take(4).find_map(|item| {
                let id = crate::fragments::identity(item)?;
                earlier
                    .iter()
                    .copied()
                    .find(|answer| answer.verdict_of(id).is_some())
            });
            let copied = base.filter(|base| {
                base.places.len() <= 2 * items.len()
                    && base.slack.1 - base.slack.0 <= WHERE_ANY_SLACK
            });
            let mut places = copied.map_or_else(
                || Places::with_capacity(items.len()),
                |base| base.places.clone(),
            );
            // The rows put in are where their places say; the others widen it as they come.
            let mut slack: (i64, i64) = (0, 0);
            let mut next = 0;
            let mut verdicts = Vec::with_capacity(items.len());
            let mut selected = Vec::new();
            for (place, item) in items.iter().enumerate() {
                let id = crate::fragments::identity(item);
                // Where the base has this very row, when it does.
                let mut in_base = None;
                let known = id.and_then(|id| {
                    if let Some(verdict) = base.and_then(|base| base.verdict_at(next, id)) {
                        in_base = Some(next);
                        next += 1;
                        return Some(verdict);
                    }
                    earlier.iter().find_map(|answer| {
                        let (at, verdict) = answer.verdict_of(id)?;
                        if base.is_some_and(|base| std::ptr::eq(base, *answer)) {
                            next = at + 1;
                            in_base = Some(at);
                        }
                        Some(verdict)
                    })
                });
                // A row the copied places find, moved since: the slack takes it in.
                match (id, in_base, copied) {
                    (Some(_), Some(at), Some(copied)) => {
                        let moved = i64::try_from(place).unwrap_or(i64::MAX)
                            - i64::try_from(at).unwrap_or(i64::MAX);
                        slack.0 = slack.0.min(copied.slack.0 + moved);
                        slack.1 = slack.1.max(copied.slack.1 + moved);
                    }
                    (Some(id), _, _) => {
                        #[cfg(test)]
                        WHERE_ANY_PLACED.with(|placed| placed.set(placed.get() + 1));
                        places.insert(id, place);
                    }
                    (None, _, _) => {}
                }
                let verdict = match (known, item.as_map()) {
                    (Some(verdict), _) => verdict,
                    (None, Some(map)) => {
                        #[cfg(test)]
                        WHERE_ANY_READS.with(|reads| reads.set(reads.get() + 1));
                        truthy.iter().any(|k| field(map, k)) || falsy.iter().any(|k| !field(map, k))
                    }
                    (None, None) => {
                        return Err(tera_error(format!(
                            "where_any: expected maps, got {}",
                            item.name()
                        )));
                    }
                };
                verdicts.push(verdict);
                if verdict {
                    selected.push(item.clone());
                }
            }
            // A slack grown too wide (rows moved by many places, unevenly): made afresh.
            if slack.1 - slack.0 > WHERE_ANY_SLACK {
                places.clear();
                for (place, item) in items.iter().enumerate() {
                    if let Some(id) = crate::fragments::identity(item) {
                        places.insert(id, place);
                    }
                }
                slack = (0, 0);
            }
            places.seal();
            let selected = Value::from(selected);
            kept.insert(
                0,
                WhereAny {
                    rows: value.clone(),
                    truthy,
                    falsy,
                    selected: selected.clone(),
                    verdicts,
                    places,
                    slack,
                },
            );
            kept.truncate(WHERE_ANY_KEPT);
            Ok(selected)
        },
    );
    tera.register_filter(
        "sort_by",
        |items: &[Value], kwargs: Kwargs, _: &State| -> tera::TeraResult<Vec<Value>> {
            let field: &str = kwargs.must_get("field")?;
            let reverse: bool = kwargs.get("reverse")?.unwrap_or(false);
            let mut decorated: Vec<(Option<&Value>, &Value)> = items
                .iter()
                .map(|v| (present(v.get_from_path(field)), v))
                .collect();
            decorated.sort_by(|(a, _), (b, _)| match (a, b) {
                // Missing values go last in both directions.
                (Some(_), Some(_)) if reverse => compare(*b, *a),
                _ => compare(*a, *b),
            });
            Ok(decorated.into_iter().map(|(_, v)| v.clone()).collect())
        },
    );
    tera.register_filter(
        "group_by_field",
        |items: &[Value], kwargs: Kwargs, _: &State| -> tera::TeraResult<Vec<Value>> {
            let field: &str = kwargs.must_get("field")?;
            let mut groups: BTreeMap<String, Vec<Value>> = BTreeMap::new();
            for item in items {
                if let Some(key) = present(item.get_from_path(field)) {
                    groups.entry(key_text(key)).or_default().push(item.clone());
                }
            }
            Ok(groups
                .into_iter()
                .map(|(key, items)| {
                    map_value([("key", Value::from(key)), ("items", Value::from(items))])
                })
                .collect())
        },
    );
    tera.register_function(
        "backend_name",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let namespace: Value = kwargs.must_get("namespace")?;
            let service: Value = kwargs.must_get("service")?;
            let port: Value = kwargs.must_get("port")?;
            Ok(backend_name(
                &key_text(&namespace),
                &key_text(&service),
                &key_text(&port),
            ))
        },
    );
    tera.register_filter(
        "backend_name",
        |parts: &[Value], _: Kwargs, _: &State| -> tera::TeraResult<String> {
            match parts {
                [namespace, service, port] => Ok(backend_name(
                    &key_text(namespace),
                    &key_text(service),
                    &key_text(port),
                )),
                _ => Err(tera_error(format!(
                    "backend_name: expected [namespace, service, port], got {} values",
                    parts.len()
                ))),
            }
        },
    );
    tera.register_filter(
        "get",
        |parts: &[Value], _: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let [store, namespace, name] = parts else {
                return Err(tera_error(format!(
                    "get: expected [store, namespace, name], got {} values",
                    parts.len()
                )));
            };
            let key = format!("{}/{}", key_text(namespace), key_text(name));
            Ok(store_lookup(state, GET_VAR, &key_text(store), &key)?.unwrap_or_else(Value::none))
        },
    );
    tera.register_filter(
        "lookup",
        |parts: &[Value], _: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let Some((store, key)) = parts.split_first() else {
                return Err(tera_error(
                    "lookup: expected [store, key parts...], got nothing",
                ));
            };
            let key = key.iter().map(key_text).collect::<Vec<_>>().join("/");
            Ok(store_lookup(state, INDEX_VAR, &key_text(store), &key)?
                .unwrap_or_else(|| Value::from(Vec::<Value>::new())))
        },
    );
    tera.register_function(
        "ssl_file",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<String> {
            let namespace: &str = kwargs.must_get("namespace")?;
            let name: &str = kwargs.must_get("name")?;
            Ok(ssl_file(namespace, name))
        },
    );
    tera.register_function(
        "fail",
        |kwargs: Kwargs, _: &State| -> tera::TeraResult<bool> {
            let message: Value = kwargs.must_get("message")?;
            Err(tera_error(format!(
                "template failed: {}",
                key_text(&message)
            )))
        },
    );
    tera.register_function(
        "get",
        |kwargs: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let store: &str = kwargs.must_get("store")?;
            let namespace: &str = kwargs.get("namespace")?.unwrap_or("");
            let name: &str = kwargs.must_get("name")?;
            let key = format!("{namespace}/{name}");
            Ok(store_lookup(state, GET_VAR, store, &key)?.unwrap_or_else(Value::none))
        },
    );
    tera.register_function(
        "lookup",
        |kwargs: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let store: &str = kwargs.must_get("store")?;
            let key = lookup_key(&kwargs.must_get::<Value>("key")?)?;
            Ok(store_lookup(state, INDEX_VAR, store, &key)?
                .unwrap_or_else(|| Value::from(Vec::<Value>::new())))
        },
    );
    tera.register_function(
        "derived_get",
        |kwargs: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let view: &str = kwargs.must_get("view")?;
            let key = lookup_key(&kwargs.must_get::<Value>("key")?)?;
            Ok(derived_lookup(state, view, &key)?.unwrap_or_else(Value::none))
        },
    );
}

/// `derived_get(view=<name>, key=<key>)`: the entry `key` of the derived view `view` (a map,
/// such as `certificates`), none when it has none. What `derived.<view>[key]` gives, but the
/// read is recorded: a per-item output (a certificate's PEM) that read one entry is reused
/// while that entry is the same value, where one that reads `derived.<view>` is rendered again
/// whenever any entry changed (every one of 2,500 certificates after one Secret event).
fn derived_lookup(state: &State, view: &str, key: &str) -> tera::TeraResult<Option<Value>> {
    let derived: Value = state.get(DERIVED_VAR)?.ok_or_else(|| {
        tera_error(
            "derived_get: no derived views here (a snippet of render_each has none: pass \
             what it needs in `args`)",
        )
    })?;
    let views = derived
        .as_map()
        .ok_or_else(|| tera_error("the render context's derived views are not a map"))?;
    let Some((view_at, _, entries)) = views.get_full(&Key::Str(view)) else {
        let known: Vec<String> = views.keys().map(|k| k.to_string()).collect();
        return Err(tera_error(format!(
            "derived_get: unknown view `{view}` (known: {})",
            known.join(", ")
        )));
    };
    let Some(entries) = entries.as_map() else {
        return Err(tera_error(format!(
            "derived_get: the view `{view}` is a {}, not a map",
            entries.name()
        )));
    };
    let (found, places) = match entries.get_full(&Key::Str(key)) {
        Some((at, _, entry)) => (Some(entry.clone()), Some((view_at, at))),
        None => (None, None),
    };
    crate::fragments::record_read_at(DERIVED_VAR, view, key, found.as_ref(), places);
    Ok(found)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn where_any_on_a_rebuilt_list_reads_only_new_rows_and_reads_them_right() {
        let mut tera = Tera::new();
        register(&mut tera);
        let row =
            |name: &str, x: bool| map_value([("n", Value::from(name)), ("x", Value::from(x))]);
        let render = |rows: &[Value]| {
            let mut context = tera::Context::new();
            context.insert_value("rows", Value::from(rows.to_vec()));
            tera.render_str(
                "{% for r in rows | where_any(truthy=[\"x\"]) %}{{ r.n }} {% endfor %}",
                &context,
                false,
            )
            .unwrap()
        };
        let (a, b) = (row("a", false), row("b", true));
        assert_eq!(render(&[a.clone(), b.clone()]), "b ");
        // The same rows (the same values) with a new one between them: the known verdicts
        // are kept, the new row is read.
        assert_eq!(render(&[a.clone(), row("c", true), b.clone()]), "c b ");
        // A row rebuilt with other contents is another value: read again.
        assert_eq!(render(&[row("a", true), b.clone()]), "a b ");
        assert_eq!(render(&[b.clone(), a.clone()]), "b ");
        // Two lists asked with the same arguments in turn (the reference's exact and prefix
        // routes), each rebuilt around the same rows: each answer read from its own list's,
        // a row moved or dropped read right.
        let (p, q) = (row("p", false), row("q", true));
        assert_eq!(render(&[p.clone(), q.clone(), a.clone()]), "q ");
        assert_eq!(render(&[a.clone(), b.clone(), row("d", true)]), "b d ");
        assert_eq!(render(&[q.clone(), p.clone()]), "q ");
        assert_eq!(render(&[b.clone(), row("e", false), a.clone()]), "b ");
        assert_eq!(render(&[p, row("r", true), q]), "r q ");
        assert_eq!(render(&[a, b]), "b ");
    }

    /// Rows added at the front and in the middle of a list, one a render, past the slack's
    /// limit: each answer reads the new row alone, and is right.
    #[test]
    fn where_any_reads_only_the_rows_added_wherever_they_go() {
        let mut tera = Tera::new();
        register(&mut tera);
        let row =
            |name: String, x: bool| map_value([("n", Value::from(name)), ("x", Value::from(x))]);
        let mut rows: Vec<Value> = (0..8).map(|i| row(format!("r{i}"), i % 2 == 0)).collect();
        let render = |rows: &[Value]| {
            let mut context = tera::Context::new();
            context.insert_value("rows", Value::from(rows.to_vec()));
            let before = WHERE_ANY_READS.with(std::cell::Cell::get);
            let out = tera
                .render_str(
                    "{% for r in rows | where_any(truthy=[\"x\", \"y\"]) %}{{ r.n }} {% endfor %}",
                    &context,
                    false,
                )
                .unwrap();
            (out, WHERE_ANY_READS.with(std::cell::Cell::get) - before)
        };
        let expected = |rows: &[Value]| -> String {
            rows.iter()
                .filter(|r| r.get_from_path("x").is_some_and(Value::is_truthy))
                .map(|r| format!("{} ", r.get_from_path("n").and_then(Value::as_str).unwrap()))
                .collect()
        };
        assert_eq!(render(&rows), (expected(&rows), 8));
        // Each answer puts in the new row's place alone, but when its slack grew too wide
        // (every 17 rows added in the middle): then all of them (about 40 each time). Every
        // row after the new one, as before, would be ~600 over the 40 answers.
        let placed = WHERE_ANY_PLACED.with(std::cell::Cell::get);
        for i in 0..40 {
            let at = if i % 3 == 0 { 0 } else { rows.len() / 2 };
            rows.insert(at, row(format!("new{i}"), i % 2 == 1));
            assert_eq!(render(&rows), (expected(&rows), 1), "after {i}");
        }
        let placed = WHERE_ANY_PLACED.with(std::cell::Cell::get) - placed;
        assert!(placed < 40 + 2 * 48, "{placed} places written");
        // Rows taken out: nothing to read.
        rows.remove(3);
        rows.remove(20);
        assert_eq!(render(&rows), (expected(&rows), 0));
    }

    #[test]
    fn sanitize_keeps_identifier_characters_only() {
        assert_eq!(sanitize("a-b_c.d"), "a-b_c.d");
        assert_eq!(sanitize("ns/name:80 x"), "ns_name_80_x");
        assert_eq!(sanitize("é"), "_");
        assert_eq!(sanitize(""), "_");
    }

    #[test]
    fn backend_names_are_distinct_per_service_port() {
        assert_eq!(backend_name("a", "b", "80"), "a_b_80");
        assert_ne!(backend_name("a", "b", "80"), backend_name("a", "b", "http"));
        assert_eq!(backend_name("a b", "c/d", "http"), "a_b_c_d_http");
    }

    #[test]
    fn regex_escape_escapes_metacharacters_only() {
        assert_eq!(regex_escape("abc/def"), "abc/def");
        assert_eq!(regex_escape("a.b*c?"), r"a\.b\*c\?");
        assert_eq!(regex_escape(r"^[x]{2}$|\"), r"\^\[x\]\{2\}\$\|\\");
    }

    #[test]
    fn b64decode_rejects_bad_input() {
        assert_eq!(b64decode("aGVsbG8=").unwrap(), "hello");
        assert_eq!(b64decode(" aGVsbG8=\n").unwrap(), "hello");
        assert!(matches!(b64decode("%%%"), Err(Error::Base64(_))));
        assert_eq!(b64decode("/w=="), Err(Error::NotUtf8));
    }

    #[test]
    fn path_and_host_checks_reject_what_would_break_a_map_file() {
        assert!(is_http_path("/"));
        for bad in ["", "x/", "/a\tb", "/a\nb", "/#x", "/a b"] {
            assert!(!is_http_path(bad), "{bad:?}");
        }
        assert!(is_hostname("a-1.example.com"));
        for bad in ["", "A.com", "a..b", ".a", "a.", "*.a.com", "a b", "a_b.com"] {
            assert!(!is_hostname(bad), "{bad:?}");
        }
        assert!(!is_hostname(&"a".repeat(64)));
    }

    #[test]
    fn ssl_file_is_under_ssl() {
        assert_eq!(ssl_file("a", "b"), "ssl/11/a_b.pem");
    }
}
