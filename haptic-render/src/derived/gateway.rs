//! The Gateway API view ([`super::Derivation::GatewayApi`]): GatewayClasses, Gateways,
//! HTTPRoutes and ReferenceGrants of `gateway.networking.k8s.io` joined with Services,
//! EndpointSlices, TLS Secrets, Namespaces and the HAProxy pods into what the gateway templates
//! read: one frontend per listener port with its matches in the order the spec gives them
//! precedence, the actions of each match, the backends the routes name, and the status of every
//! object of our classes (GatewayClass, Gateway, HTTPRoute parents).
//!
//! The resources are read as JSON, field by field, with the CRD defaults applied here (a real API
//! server applies them on write; a store may hold objects written without them): a parentRef's
//! group and kind, a backendRef's kind and weight, a rule's matches, a match's path, a header
//! match's type, a listener's `allowedRoutes.namespaces.from`.
//!
//! Precedence of matches on one port (the HTTPRoute spec's order, hostname first): an exact
//! hostname, then wildcard hostnames longest first, then no hostname; then an Exact path, then
//! the longest PathPrefix, then a RegularExpression path (implementation-specific: after the
//! Exact paths and prefixes of its host, not by length); a method match; more header matches;
//! more query parameter matches; the oldest route; the route first by `namespace/name`; the
//! first rule and match in list order. HAProxy tries the matches in that order and takes the
//! first that matches. Regular expressions are a conservative PCRE2 subset (`derived/pcre.rs`),
//! anchored.
//!
//! A match without method, header or query conditions whose path is Exact or a prefix, whose
//! rule has no filter and one
//! backendRef of positive weight that resolves is a map entry instead (`map_exact`,
//! `map_prefix`: `<port>/<listener hostname>/<host><path>` to `<rank> <backend>`), so adding,
//! removing or retargeting such a route changes map lines only. The frontend looks the maps up
//! first (the most specific listener covering the host, then the host levels in the spec's
//! order); a match that stays in `haproxy.cfg` keeps its place and yields to a map hit of a
//! strictly better rank (`rank`: host and path only; with the same host and path the match with
//! conditions is the more specific).
//!
//! On a listener sharing the Ingress frontend's port, those matches go before the Ingress
//! routes; one without method, header or query conditions that claims the same host and path
//! as a path of one of our Ingresses (the Ingress conflict rule's route key) is a conflict the
//! older object wins (`Resolved::with_ingresses`). What the Gateway API stores resolve to is
//! kept (`resolve`) while they do not change: an Ingress change decides only the conflicts
//! again, and reads no Ingress unless a match claims something. After a change of those
//! stores, each HTTPRoute that did not change keeps what it resolved to (`RouteOut`, kept
//! beside the route) while what it read is the same: its Services, its Namespace's labels and
//! what every route reads of the Gateways, grants and config; only the others are resolved
//! again, and the view is assembled from the kept and the new (the same rows, order, statuses
//! and events as a derivation from scratch: `tests/derived.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use serde_json::{Value as Json, json};
use tera::Value;

use super::{Extracts, Slot, origin, pcre, sanitize};
use crate::functions::{backend_name, is_config_token, is_hostname, is_wildcard_host, ssl_file};
use crate::store::{Source, Stored};

/// The `controllerName` of the GatewayClasses this view takes, unless the derivation names
/// another.
pub const DEFAULT_GATEWAY_CONTROLLER: &str = "haproxy-haptic.org/gateway-controller";

/// The Gateway API group.
pub const GROUP: &str = "gateway.networking.k8s.io";

/// The stores the view reads.
pub(super) struct Inputs<'a> {
    pub(super) classes: Source<'a>,
    pub(super) gateways: (&'a str, Source<'a>),
    pub(super) routes: (&'a str, Source<'a>),
    pub(super) grants: Source<'a>,
    pub(super) services: Source<'a>,
    pub(super) slices: Source<'a>,
    pub(super) secrets: Source<'a>,
    pub(super) namespaces: Source<'a>,
    pub(super) pods: Source<'a>,
}

/// The ports a listener may not take, or only with one protocol.
pub(super) struct Ports<'a> {
    /// What HAProxy's pods already serve besides routes.
    pub(super) reserved: &'a [u16],
    /// The Ingress frontend's ports.
    pub(super) ingress: super::IngressPorts,
}

impl Ports<'_> {
    /// Why a listener cannot have `port` with this protocol, if it cannot.
    fn unavailable(&self, port: i64, https: bool) -> Option<String> {
        let (http, tls) = (i64::from(self.ingress.http), i64::from(self.ingress.https));
        if self.reserved.iter().any(|&p| i64::from(p) == port) {
            Some(format!(
                "port {port} is reserved: HAProxy's pods serve something else on it"
            ))
        } else if (port == http && https) || (port == tls && !https) {
            let (theirs, ours) = if https {
                ("plain HTTP", "HTTPS")
            } else {
                ("HTTPS", "HTTP")
            };
            Some(format!(
                "port {port} is the Ingress frontend's {theirs} port: an {ours} listener cannot share it"
            ))
        } else {
            None
        }
    }
}

fn js(value: &Value) -> Json {
    serde_json::to_value(value).unwrap_or(Json::Null)
}

fn s<'a>(v: &'a Json, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Json::as_str)
        .unwrap_or_default()
}

fn arr<'a>(v: &'a Json, pointer: &str) -> &'a [Json] {
    v.pointer(pointer)
        .and_then(Json::as_array)
        .map_or(&[][..], Vec::as_slice)
}

fn generation(v: &Json) -> i64 {
    v.pointer("/metadata/generation")
        .and_then(Json::as_i64)
        .unwrap_or(0)
}

/// RFC 3339 (UTC, seconds) of a Unix time.
fn rfc3339(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// A condition as the API defines it. Its `lastTransitionTime` is the one `previous` (the
/// conditions the object shows now) holds for the same type and status, else now: a status
/// that does not change is declared exactly as it is, so it is never written again.
fn condition(
    previous: &[Json],
    kind: &str,
    ok: bool,
    reason: &str,
    message: &str,
    observed: i64,
) -> Json {
    let status = if ok { "True" } else { "False" };
    let since = previous
        .iter()
        .find(|c| s(c, "/type") == kind && s(c, "/status") == status)
        .and_then(|c| c.get("lastTransitionTime").cloned())
        .unwrap_or_else(|| Json::from(rfc3339(crate::certificate::now_unix())));
    json!({
        "lastTransitionTime": since,
        "message": message,
        "observedGeneration": observed,
        "reason": reason,
        "status": status,
        "type": kind,
    })
}

/// How a match names hosts: one host, a wildcard (its suffix with the dot, `.bar.com`), any.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Host {
    Exact(String),
    Wildcard(String),
    Any,
}

impl Host {
    fn parse(h: &str) -> Option<Self> {
        let h = h.to_ascii_lowercase();
        if h.is_empty() {
            Some(Self::Any)
        } else if let Some(rest) = h.strip_prefix('*') {
            is_wildcard_host(&h).then(|| Self::Wildcard(rest.to_owned()))
        } else {
            is_hostname(&h).then_some(Self::Exact(h))
        }
    }

    /// Whether every host `other` matches, this matches too.
    fn covers_host(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Any, _) => true,
            (_, Self::Any) => false,
            (Self::Exact(a), Self::Exact(b)) => a == b,
            (Self::Exact(_), Self::Wildcard(_)) => false,
            (Self::Wildcard(_), Self::Exact(h)) => self.covers(h),
            (Self::Wildcard(a), Self::Wildcard(b)) => b.ends_with(a.as_str()),
        }
    }

    fn covers(&self, host: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Exact(e) => e == host,
            Self::Wildcard(suffix) => host.ends_with(suffix.as_str()) && host.len() > suffix.len(),
        }
    }

    /// Sorts first for the most specific: exact, then wildcards longest first, then any.
    fn rank(&self) -> (u8, std::cmp::Reverse<usize>) {
        match self {
            Self::Exact(h) => (0, std::cmp::Reverse(h.len())),
            Self::Wildcard(s) => (1, std::cmp::Reverse(s.len())),
            Self::Any => (2, std::cmp::Reverse(0)),
        }
    }

    /// An ACL matching the SNI of a TLS ClientHello (lowercased) this host covers.
    fn sni_condition(&self) -> Value {
        Value::from(match self {
            Self::Exact(h) => format!("{{ req.ssl_sni,lower -m str {h} }}"),
            Self::Wildcard(s) => format!("{{ req.ssl_sni,lower -m end {s} }}"),
            Self::Any => "TRUE".to_owned(),
        })
    }

    /// The host as a map key writes it: the host, `*.` and the suffix, `*` for any.
    fn key(&self) -> String {
        match self {
            Self::Exact(h) => h.clone(),
            Self::Wildcard(s) => format!("*{s}"),
            Self::Any => "*".to_owned(),
        }
    }

    /// Whether the gateway maps can hold a match of this host: a wildcard's suffix has at most
    /// [`MAP_WILDCARD_LABELS`] labels (the frontend looks up that many suffixes).
    fn in_maps(&self) -> bool {
        match self {
            Self::Wildcard(s) => s.matches('.').count() <= MAP_WILDCARD_LABELS,
            Self::Exact(_) | Self::Any => true,
        }
    }

    fn condition(&self) -> String {
        match self {
            Self::Exact(h) => format!(" {{ var(txn.gwhost) -m str {h} }}"),
            Self::Wildcard(s) => format!(" {{ var(txn.gwhost) -m end {s} }}"),
            Self::Any => String::new(),
        }
    }
}

/// The most labels a wildcard's suffix may have for its matches to go to the gateway maps: the
/// frontend looks up the request host's last 1 ..= this many labels as wildcard keys, longest
/// first (`*.example.com` is 2). A match of a longer wildcard stays a line of `haproxy.cfg`.
pub const MAP_WILDCARD_LABELS: usize = 6;

/// The longest path (without a prefix's trailing slash) whose match goes to the gateway maps:
/// [`rank`] tells lengths apart up to it.
const MAP_PATH_LIMIT: usize = 4094;

/// The rank of a match's host and path in the spec's precedence, as a number: lower goes
/// first. The host (exact, then wildcards longest first, then none), then the path (Exact,
/// then the longest prefix, then a regular expression), each by its own class and length
/// only, so adding a match never renumbers another; it orders as `(Host::rank,
/// PathMatch::rank)` do, lengths beyond what it tells apart (a host over 255, a path over
/// [`MAP_PATH_LIMIT`] characters) counting as the longest. A map entry carries its rank
/// (`<rank> <backend>`); a match that stays in `haproxy.cfg` yields to a map hit of a
/// strictly lower rank.
fn rank(host: &Host, path: &PathMatch) -> u64 {
    let short = |len: usize, span: u64| span - 1 - (len as u64).min(span - 1);
    let host = match host {
        Host::Exact(h) => short(h.len(), 256),
        Host::Wildcard(s) => 256 + short(s.len(), 256),
        Host::Any => 512 + 255,
    };
    let path = match path {
        PathMatch::Exact(p) => short(p.len(), 4096),
        PathMatch::Prefix(p) => 4096 + short(p.len(), 4096),
        // After every Exact path and prefix of its host: the next host's first rank, which
        // no map entry has (a map entry's path is at most MAP_PATH_LIMIT long, so its rank is
        // never the first of its host). A map hit of the same or a better host goes first; of
        // a worse host, after.
        PathMatch::Regex(_) => 8192,
    };
    host * 8192 + path
}

/// The hostnames a route gets on a listener: the intersection of the listener's hostname (none:
/// any) with the route's (none: any); empty when they do not intersect.
fn intersect(listener: &Host, route: &[Host]) -> Vec<Host> {
    if route.is_empty() {
        return vec![listener.clone()];
    }
    let mut out = Vec::new();
    for r in route {
        let both = match (listener, r) {
            (Host::Any, r) => Some(r.clone()),
            (l, Host::Any) => Some(l.clone()),
            (Host::Exact(l), Host::Exact(r)) => (l == r).then(|| Host::Exact(l.clone())),
            (Host::Wildcard(_), Host::Exact(r)) => {
                listener.covers(r).then(|| Host::Exact(r.clone()))
            }
            (Host::Exact(l), Host::Wildcard(_)) => r.covers(l).then(|| Host::Exact(l.clone())),
            (Host::Wildcard(l), Host::Wildcard(rs)) => {
                if l.ends_with(rs.as_str()) {
                    Some(Host::Wildcard(l.clone()))
                } else if rs.ends_with(l.as_str()) {
                    Some(Host::Wildcard(rs.clone()))
                } else {
                    None
                }
            }
        };
        if let Some(h) = both
            && !out.contains(&h)
        {
            out.push(h);
        }
    }
    out
}

/// A text HAProxy can take inside single quotes: printable ASCII without a quote or backslash.
fn quotable(text: &str) -> bool {
    text.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'\'' && b != b'\\')
}

/// A header name, query parameter name or method HAProxy takes as one word: an HTTP token
/// without `'` or `#` (which would begin a comment and cut the line).
fn is_token(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!$%&*+-.^_`|~".contains(&b))
}

fn is_plain_path(path: &str) -> bool {
    path.starts_with('/') && is_config_token(path) && quotable(path) && !path.contains('%')
}

/// The path modifier of a URLRewrite or RequestRedirect filter.
#[derive(Debug, Clone)]
enum PathModifier {
    /// ReplaceFullPath: the path as given.
    Full(String),
    /// ReplacePrefixMatch: the replacement without its trailing slash (so `/` and the empty
    /// replacement are both empty): it takes the place of the matched prefix, which the path
    /// has up to a `/` or its end.
    Prefix(String),
}

impl PathModifier {
    /// A filter's `path` (none: `Ok(None)`), or why it is not supported. Paths are written
    /// into `haproxy.cfg` as given, so only plain ones (no `%`, quote, space or `#`) are taken;
    /// a prefix may also be replaced by nothing.
    fn parse(path: Option<&Json>) -> Result<Option<Self>, String> {
        let Some(path) = path.filter(|p| !p.is_null()) else {
            return Ok(None);
        };
        match s(path, "/type") {
            "ReplaceFullPath" if is_plain_path(s(path, "/replaceFullPath")) => {
                Ok(Some(Self::Full(s(path, "/replaceFullPath").to_owned())))
            }
            "ReplacePrefixMatch"
                if matches!(s(path, "/replacePrefixMatch"), "" | "/")
                    || is_plain_path(s(path, "/replacePrefixMatch")) =>
            {
                Ok(Some(Self::Prefix(
                    s(path, "/replacePrefixMatch")
                        .trim_end_matches('/')
                        .to_owned(),
                )))
            }
            t @ ("ReplaceFullPath" | "ReplacePrefixMatch") => {
                Err(format!("path {t}: only a plain path is supported"))
            }
            other => Err(format!("path type {other:?} is not supported")),
        }
    }

    /// What the template writes for a prefix replaced on a path whose first `len` bytes are
    /// the matched prefix: `with` followed by the rest of the path, or `exact` when there is
    /// no rest (never an empty path).
    fn prefix_row(&self, len: usize) -> Json {
        match self {
            Self::Full(_) => Json::Null,
            Self::Prefix(with) => json!({
                "len": len,
                "with": with,
                "exact": if with.is_empty() { "/" } else { with.as_str() },
            }),
        }
    }
}

/// A log-format string in single quotes: `%` doubled.
fn log_format(text: &str) -> String {
    format!("'{}'", text.replace('%', "%%"))
}

#[derive(Debug, Clone)]
enum PathMatch {
    Exact(String),
    /// Without its trailing slash; `/` is the empty prefix.
    Prefix(String),
    /// RegularExpression: a pattern [`pcre::check`] takes, matching the whole path.
    Regex(String),
}

impl PathMatch {
    /// Exact paths (longest first), then prefixes (longest first), then regular expressions
    /// (the spec leaves their order to the implementation: among themselves, by the rest of
    /// the spec's order, method, headers, queries, age and list order, not by length).
    fn rank(&self) -> (u8, std::cmp::Reverse<usize>) {
        match self {
            Self::Exact(p) => (0, std::cmp::Reverse(p.len())),
            Self::Prefix(p) => (1, std::cmp::Reverse(p.len())),
            Self::Regex(_) => (2, std::cmp::Reverse(0)),
        }
    }

    /// The path as a map key writes it: an Exact path as it is, a prefix with a `/` appended
    /// (looked up with `map_beg` on the request path with a `/` appended: segment-wise).
    fn key(&self) -> String {
        match self {
            Self::Exact(p) => p.clone(),
            Self::Prefix(p) => format!("{p}/"),
            // Never a map key ([`MatchRow::unconditioned`]).
            Self::Regex(re) => format!("~{re}"),
        }
    }

    fn condition(&self) -> String {
        match self {
            Self::Exact(p) => format!(" {{ path -m str {p} }}"),
            Self::Prefix(p) if p.is_empty() => String::new(),
            // The request path with a `/` appended begins with the prefix and a `/`: /foo
            // matches /foo and /foo/bar, not /foobar.
            Self::Prefix(p) => format!(" {{ var(txn.gwpath) -m beg {p}/ }}"),
            // The path as HAProxy's `path` fetches it (the query left out, not decoded), all
            // of it.
            Self::Regex(re) => format!(" {{ path -m reg {} }}", pcre::anchored(re)),
        }
    }
}

/// How a header or query parameter match compares the value.
#[derive(Debug, Clone)]
enum ValueMatch {
    /// Exact: a [`quotable`] value.
    Exact(String),
    /// RegularExpression: a pattern [`pcre::check`] takes, matching the whole value.
    Regex(String),
}

impl ValueMatch {
    /// The ACL of `fetch` (`req.hdr(<name>)`, `url_param(<name>)`).
    fn condition(&self, fetch: &str) -> String {
        match self {
            Self::Exact(v) => format!(" {{ {fetch} -m str '{v}' }}"),
            Self::Regex(re) => format!(" {{ {fetch} -m reg {} }}", pcre::anchored(re)),
        }
    }
}

/// A rule's match: path, method, headers and query parameters (name, value).
type RuleMatch = (
    PathMatch,
    Option<String>,
    Vec<(String, ValueMatch)>,
    Vec<(String, ValueMatch)>,
);

/// One match of a rule on one listener port, with what decides its precedence.
struct MatchRow {
    host: Host,
    /// The hostname of the listener the route is attached through.
    listener: Host,
    path: PathMatch,
    method: Option<String>,
    headers: Vec<(String, ValueMatch)>,
    queries: Vec<(String, ValueMatch)>,
    age: (String, String, String),
    /// [`MatchRow::rank_key`], made once.
    rank: u128,
    /// The creationTimestamp's digits as a number when it has the canonical form
    /// `YYYY-MM-DDThh:mm:ssZ` ([`canonical_time`]).
    created: Option<u64>,
    rule: usize,
    index: usize,
    action: usize,
    /// The backend of the rule, when it has no filter and one backendRef with a positive
    /// weight, which resolves: a match of it without conditions can be a map entry.
    backend: Option<String>,
    origin: (String, String),
}

impl MatchRow {
    /// Whether the match has no method, header or query parameter condition and its path is
    /// Exact or a prefix (a regular expression is a condition too): such a match can be a map
    /// entry, and claims its host and path against the Ingresses.
    fn unconditioned(&self) -> bool {
        self.method.is_none()
            && self.headers.is_empty()
            && self.queries.is_empty()
            && !matches!(self.path, PathMatch::Regex(_))
    }

    /// The spec's precedence up to the age, packed in one number that orders as the tuple
    /// (host rank, path rank, method, header count, query count) does: a sort of 20,000
    /// matches compares numbers, not enums and strings. Hostnames are at most 253 bytes, so
    /// their lengths fit 16 bits; paths and counts fit 32 (an object is at most a few MB).
    fn rank_key(&self) -> u128 {
        let reverse = |n: usize, bits: u32| -> u128 {
            let max = (1u128 << bits) - 1;
            max - u128::try_from(n).map_or(max, |n| n.min(max))
        };
        let (host_kind, host_len) = self.host.rank();
        let (path_kind, path_len) = self.path.rank();
        let mut key = u128::from(host_kind);
        key = (key << 16) | reverse(host_len.0, 16);
        key = (key << 2) | u128::from(path_kind);
        key = (key << 32) | reverse(path_len.0, 32);
        key = (key << 1) | u128::from(self.method.is_none());
        key = (key << 32) | reverse(self.headers.len(), 32);
        (key << 32) | reverse(self.queries.len(), 32)
    }

    /// The spec's order of two matches: [`MatchRow::rank_key`], then the age (the
    /// creationTimestamp, then namespace and name), then the rule's and the match's places.
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.rank
            .cmp(&other.rank)
            .then_with(|| match (self.created, other.created) {
                // The same order as the texts' (both of one fixed width, digits in place).
                (Some(a), Some(b)) => a.cmp(&b),
                _ => self.age.0.cmp(&other.age.0),
            })
            .then_with(|| self.age.1.cmp(&other.age.1))
            .then_with(|| self.age.2.cmp(&other.age.2))
            .then_with(|| self.rule.cmp(&other.rule))
            .then_with(|| self.index.cmp(&other.index))
    }

    /// The ACL terms of the match (each `{ ... }`), ANDed.
    fn terms(&self) -> Vec<String> {
        let mut c = vec![self.host.condition(), self.path.condition()];
        if let Some(m) = &self.method {
            c.push(format!(" {{ method {m} }}"));
        }
        for (name, value) in &self.headers {
            c.push(value.condition(&format!("req.hdr({name})")));
        }
        for (name, value) in &self.queries {
            c.push(value.condition(&format!("url_param({name})")));
        }
        c.into_iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.trim_start().to_owned())
            .collect()
    }
}

/// The digits of a creationTimestamp of the canonical form `YYYY-MM-DDThh:mm:ssZ` (what the
/// API server writes) as one number, which orders as the texts do; none for any other text.
fn canonical_time(text: &str) -> Option<u64> {
    let bytes = text.as_bytes();
    if bytes.len() != 20 {
        return None;
    }
    let mut number = 0u64;
    for (i, &b) in bytes.iter().enumerate() {
        let separator = match i {
            4 | 7 => Some(b'-'),
            10 => Some(b'T'),
            13 | 16 => Some(b':'),
            19 => Some(b'Z'),
            _ => None,
        };
        match separator {
            Some(expected) if b == expected => {}
            None if b.is_ascii_digit() => number = number * 10 + u64::from(b - b'0'),
            _ => return None,
        }
    }
    Some(number)
}

/// The most ACL terms (of at most 7 words each) one line of a match holds: HAProxy reads at
/// most 64 words a line, and the first line of a match has 13 words besides its terms
/// (snippet gateway-rules; a further line, 3 and the `||` between terms).
const TERMS_PER_LINE: usize = 7;

/// A match's terms as the template writes them: the first line's (` t1 t2 ...`), and for each
/// further line those of a chunk negated and ORed (` !t8 || !t9 ...`): the further lines
/// unset the mark the first one set when one of their terms does not hold, so the match holds
/// when all do, however many terms it has (16 header and 16 query parameter matches, listener
/// hostnames a more specific listener takes).
fn lines(terms: &[String]) -> (String, Vec<Value>) {
    let mut chunks = terms.chunks(TERMS_PER_LINE);
    let first = chunks
        .next()
        .unwrap_or_default()
        .iter()
        .map(|t| format!(" {t}"))
        .collect();
    let negate = |t: &String| {
        t.strip_prefix('!')
            .map_or_else(|| format!("!{t}"), str::to_owned)
    };
    let more = chunks
        .map(|c| {
            let negated: Vec<String> = c.iter().map(|t| format!(" {}", negate(t))).collect();
            Value::from(negated.join(" ||"))
        })
        .collect();
    (first, more)
}

/// What a rule does, once per listener port it is served on.
struct Action {
    /// `<port>/<namespace>/<name>/<rule>`: what `txn.gwm` holds when one of its matches is
    /// the first to match. It depends on the route alone, so adding or removing another route
    /// changes none of this one's lines.
    id: String,
    request_headers: Vec<Json>,
    response_headers: Vec<Json>,
    /// RequestRedirect: `{location, code, base, prefix}`: the location, or with a replaced
    /// prefix (`prefix`, as [`PathModifier::prefix_row`] writes it) the one of a path that is
    /// the prefix alone, `base` the scheme, host and port.
    redirect: Option<Json>,
    /// URLRewrite: `{host, path, prefix}` (host and a full path may be empty; `prefix`, a
    /// replaced prefix, as [`PathModifier::prefix_row`] writes it, or null).
    rewrite: Option<Json>,
    /// `(weight, backend)`; no backend: that share answers 500.
    shares: Vec<(i64, Option<String>)>,
    origin: (String, String),
}

#[derive(Clone, PartialEq)]
struct Listener {
    name: String,
    port: i64,
    https: bool,
    host: Host,
    /// Route kinds allowed; empty with `invalid_kinds`: none.
    invalid_kinds: bool,
    from: String,
    selector: Json,
    /// The accepted route of this listener, by problem; none: the listener is usable.
    problem: Option<(&'static str, &'static str, String)>,
    resolved: Option<(&'static str, String)>,
    certificates: Vec<String>,
    attached: i64,
}

struct Gateway {
    namespace: String,
    name: String,
    object: Json,
    listeners: Vec<Listener>,
}

/// Whether a ReferenceGrant in `to_namespace` lets a `from_kind` of `from_namespace` refer to
/// the `to_kind` (core group) named `to_name`.
fn granted(
    grants: &[Json],
    from_kind: &str,
    from_namespace: &str,
    to_namespace: &str,
    to_kind: &str,
    to_name: &str,
) -> bool {
    grants.iter().any(|g| {
        s(g, "/metadata/namespace") == to_namespace
            && arr(g, "/spec/from").iter().any(|f| {
                s(f, "/group") == GROUP
                    && s(f, "/kind") == from_kind
                    && s(f, "/namespace") == from_namespace
            })
            && arr(g, "/spec/to").iter().any(|t| {
                s(t, "/group").is_empty()
                    && s(t, "/kind") == to_kind
                    && (s(t, "/name").is_empty() || s(t, "/name") == to_name)
            })
    })
}

/// Whether a label selector (matchLabels, matchExpressions) selects `labels`.
fn selects(selector: &Json, labels: &Json) -> bool {
    let label = |k: &str| labels.get(k).and_then(Json::as_str);
    if let Some(m) = selector.get("matchLabels").and_then(Json::as_object)
        && !m.iter().all(|(k, v)| label(k) == v.as_str())
    {
        return false;
    }
    arr(selector, "/matchExpressions").iter().all(|e| {
        let key = s(e, "/key");
        let values: Vec<&str> = arr(e, "/values").iter().filter_map(Json::as_str).collect();
        match s(e, "/operator") {
            "In" => label(key).is_some_and(|v| values.contains(&v)),
            "NotIn" => label(key).is_none_or(|v| !values.contains(&v)),
            "Exists" => label(key).is_some(),
            "DoesNotExist" => label(key).is_none(),
            _ => false,
        }
    })
}

/// The view over the Gateway API stores, before the conflicts with Ingresses are decided.
pub(super) fn resolve(
    slot: Slot,
    inputs: &Inputs<'_>,
    ports: &Ports<'_>,
    controller: &str,
    previous: Option<&Resolved>,
) -> Resolved {
    let ports_config = ports;
    // Our classes.
    let mut classes = BTreeSet::new();
    // Template values: a route's is made once per version of the route (converting 10,000 of
    // them from JSON on every change cost more than the rest of the statuses).
    let mut statuses: Vec<Value> = Vec::new();
    for ((_, name), class, _) in inputs.classes.entries() {
        let class = class.json();
        if s(&class, "/spec/controllerName") != controller {
            continue;
        }
        classes.insert(name.clone());
        let previous = arr(&class, "/status/conditions");
        statuses.push(Value::from_serializable(&json!({
            "object": object_ref(&class),
            "field": "conditions",
            "value": [condition(previous, "Accepted", true, "Accepted", "accepted by haptic", generation(&class))],
        })));
    }
    let grants: Vec<Json> = inputs.grants.entries().map(|(_, g, _)| g.json()).collect();
    let namespace_labels: HashMap<String, Json> = inputs
        .namespaces
        .entries()
        .map(|((_, name), ns, _)| {
            let ns = ns.json();
            let mut labels = ns
                .pointer("/metadata/labels")
                .cloned()
                .unwrap_or_else(|| json!({}));
            // kube-apiserver sets this label on every namespace.
            if let Some(map) = labels.as_object_mut() {
                map.entry("kubernetes.io/metadata.name")
                    .or_insert_with(|| Json::from(name.as_str()));
            }
            (name.clone(), labels)
        })
        .collect();
    let mut addresses: Vec<(String, String)> = inputs
        .pods
        .entries()
        .filter_map(|((_, name), pod, _)| {
            let pod = pod.json();
            let ip = s(&pod, "/status/podIP");
            (!ip.is_empty()
                && s(&pod, "/status/phase") == "Running"
                && pod.pointer("/metadata/deletionTimestamp").is_none())
            .then(|| (name.clone(), ip.to_owned()))
        })
        .collect();
    addresses.sort();
    let addresses: Vec<Json> = addresses
        .iter()
        .map(|(_, ip)| json!({"type": "IPAddress", "value": ip}))
        .collect();

    // Gateways of our classes and their listeners.
    let mut refusals: Vec<Json> = Vec::new();
    let (gateway_store, route_store) = (inputs.gateways.0, inputs.routes.0);
    let mut gateways: Vec<Gateway> = Vec::new();
    for ((namespace, name), gw, _) in inputs.gateways.1.entries() {
        let gw = gw.json();
        if !classes.contains(s(&gw, "/spec/gatewayClassName")) {
            continue;
        }
        let mut listeners = Vec::new();
        for l in arr(&gw, "/spec/listeners") {
            let protocol = s(l, "/protocol");
            let port = l.get("port").and_then(Json::as_i64).unwrap_or(0);
            let host = Host::parse(s(l, "/hostname"));
            let mut listener = Listener {
                name: s(l, "/name").to_owned(),
                port,
                https: protocol == "HTTPS",
                // An invalid hostname (the CRD's pattern refuses it) never widens the listener
                // to every host: the listener takes no routes.
                host: host.clone().unwrap_or(Host::Any),
                invalid_kinds: false,
                from: match s(l, "/allowedRoutes/namespaces/from") {
                    "" => "Same".to_owned(),
                    f => f.to_owned(),
                },
                selector: l
                    .pointer("/allowedRoutes/namespaces/selector")
                    .cloned()
                    .unwrap_or(Json::Null),
                problem: None,
                resolved: None,
                certificates: Vec::new(),
                attached: 0,
            };
            if host.is_none() {
                let index = listeners.len();
                refuse(
                    &mut refusals,
                    (gateway_store, namespace.as_str(), name.as_str()),
                    format!("spec.listeners[{index}].hostname"),
                    s(l, "/hostname"),
                    "is not a hostname or a wildcard (`*.` and a hostname)",
                );
                listener.problem = Some((
                    "UnsupportedValue",
                    "Invalid",
                    format!("hostname {:?} is not a hostname", s(l, "/hostname")),
                ));
            } else if !(1..=65535).contains(&port) {
                refuse(
                    &mut refusals,
                    (gateway_store, namespace.as_str(), name.as_str()),
                    format!("spec.listeners[{}].port", listeners.len()),
                    &port.to_string(),
                    "is not a port (1-65535)",
                );
            }
            if listener.problem.is_none() && protocol != "HTTP" && protocol != "HTTPS" {
                listener.problem = Some((
                    "UnsupportedProtocol",
                    "Invalid",
                    format!("protocol {protocol} is not supported: HTTP and HTTPS are"),
                ));
            } else if listener.problem.is_none() && !(1..=65535).contains(&port) {
                listener.problem = Some(("PortUnavailable", "Invalid", format!("port {port}")));
            } else if listener.problem.is_none()
                && let Some(why) = ports.unavailable(port, listener.https)
            {
                // HAProxy would fail to load for every tenant (a port bound twice), or the
                // listener would be silently not served: neither is rendered.
                refuse(
                    &mut refusals,
                    (gateway_store, namespace.as_str(), name.as_str()),
                    format!("spec.listeners[{}].port", listeners.len()),
                    &port.to_string(),
                    &why,
                );
                listener.problem = Some(("PortUnavailable", "Invalid", why));
            }
            let kinds = arr(l, "/allowedRoutes/kinds");
            if !kinds.is_empty() {
                let valid = kinds
                    .iter()
                    .filter(|k| {
                        matches!(k.get("group").and_then(Json::as_str), None | Some(GROUP))
                            && s(k, "/kind") == "HTTPRoute"
                    })
                    .count();
                if valid < kinds.len() {
                    listener.resolved = Some((
                        "InvalidRouteKinds",
                        "only HTTPRoute (gateway.networking.k8s.io) is supported".to_owned(),
                    ));
                }
                listener.invalid_kinds = valid == 0;
            }
            if listener.https && listener.problem.is_none() {
                if !matches!(s(l, "/tls/mode"), "" | "Terminate") {
                    listener.problem = Some((
                        "UnsupportedValue",
                        "Invalid",
                        "tls.mode Passthrough is not supported on HTTPS listeners".to_owned(),
                    ));
                }
                let refs = arr(l, "/tls/certificateRefs");
                if refs.is_empty() {
                    listener.resolved = Some((
                        "InvalidCertificateRef",
                        "an HTTPS listener needs tls.certificateRefs".to_owned(),
                    ));
                }
                for r in refs {
                    let ns = match s(r, "/namespace") {
                        "" => namespace.as_str(),
                        n => n,
                    };
                    let secret = s(r, "/name");
                    let problem = if !s(r, "/group").is_empty()
                        || !matches!(s(r, "/kind"), "" | "Secret")
                    {
                        Some((
                            "InvalidCertificateRef",
                            format!(
                                "certificateRef {}/{} {secret}: only core Secrets are supported",
                                s(r, "/group"),
                                s(r, "/kind")
                            ),
                        ))
                    } else if ns != namespace
                        && !granted(&grants, "Gateway", namespace, ns, "Secret", secret)
                    {
                        Some((
                            "RefNotPermitted",
                            format!("Secret {ns}/{secret}: no ReferenceGrant in {ns} allows it"),
                        ))
                    } else {
                        match inputs.secrets.get_entry(ns, secret) {
                            None => Some((
                                "InvalidCertificateRef",
                                format!("Secret {ns}/{secret} does not exist"),
                            )),
                            Some((value, extracts)) => match extracts.certificate(value) {
                                Ok(_) => {
                                    listener.certificates.push(ssl_file(ns, secret));
                                    None
                                }
                                Err(why) => Some((
                                    "InvalidCertificateRef",
                                    format!("Secret {ns}/{secret}: {why}"),
                                )),
                            },
                        }
                    };
                    if let Some(p) = problem
                        && listener.resolved.is_none()
                    {
                        listener.resolved = Some(p);
                    }
                }
            }
            listeners.push(listener);
        }
        gateways.push(Gateway {
            namespace: namespace.clone(),
            name: name.clone(),
            object: gw,
            listeners,
        });
    }
    // A port serves one protocol: the first listener (oldest Gateway first) decides.
    let mut port_protocol: BTreeMap<i64, bool> = BTreeMap::new();
    {
        let mut order: Vec<usize> = (0..gateways.len()).collect();
        order.sort_by_key(|&i| {
            (
                s(&gateways[i].object, "/metadata/creationTimestamp").to_owned(),
                i,
            )
        });
        for i in order {
            for l in &mut gateways[i].listeners {
                if l.problem.is_some() {
                    continue;
                }
                let https = *port_protocol.entry(l.port).or_insert(l.https);
                if https != l.https {
                    l.problem = Some((
                        "ProtocolConflict",
                        "Conflicted",
                        format!("port {} already serves another protocol", l.port),
                    ));
                }
            }
        }
    }

    // What routes read of the Gateways, grants and config: while it stays the same, a route
    // that did not change, nor the Services and the Namespace it reads, keeps what it
    // resolved to (kept beside it, [`RouteOut`]); only the others are resolved again.
    let mut certificates: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for g in &gateways {
        for l in &g.listeners {
            if l.problem.is_none() && l.https && !l.certificates.is_empty() {
                let list = certificates.entry(l.port).or_default();
                for c in &l.certificates {
                    if !list.contains(c) {
                        list.push(c.clone());
                    }
                }
            }
        }
    }
    // Frontends: a port per listener port that has a usable listener.
    let mut frontend_ports: BTreeMap<i64, bool> = BTreeMap::new();
    // The hostnames of the usable listeners of each port, most specific first.
    let mut listener_hosts: BTreeMap<i64, Vec<Host>> = BTreeMap::new();
    for g in &gateways {
        for l in &g.listeners {
            if l.problem.is_none() && (!l.https || certificates.contains_key(&l.port)) {
                frontend_ports.insert(l.port, l.https);
                let hosts = listener_hosts.entry(l.port).or_default();
                if !hosts.contains(&l.host) {
                    hosts.push(l.host.clone());
                }
            }
        }
    }
    for hosts in listener_hosts.values_mut() {
        hosts.sort_by(|a, b| (a.rank(), a).cmp(&(b.rank(), b)));
    }
    let context = Context {
        controller: controller.to_owned(),
        route_store: route_store.to_owned(),
        ingress: (ports_config.ingress.http, ports_config.ingress.https),
        gateways: gateways
            .iter()
            .map(|g| (g.namespace.clone(), g.name.clone(), g.listeners.clone()))
            .collect(),
        grants,
        frontend_ports,
        listener_hosts,
    };
    let context = match previous {
        Some(previous) if *previous.context == context => Arc::clone(&previous.context),
        _ => Arc::new(context),
    };

    // Routes.
    let gateway_index: HashMap<(String, String), usize> = gateways
        .iter()
        .enumerate()
        .map(|(i, g)| ((g.namespace.clone(), g.name.clone()), i))
        .collect();
    let reads = RouteReads {
        context: &context,
        gateways: &gateways,
        gateway_index: &gateway_index,
        grants: &context.grants,
        namespace_labels: &namespace_labels,
        services: inputs.services,
        services_generation: inputs.services.generation(),
        controller,
        route_store,
    };
    let outs: Vec<Arc<RouteOut>> = inputs
        .routes
        .1
        .entries()
        .map(|(key, route, extracts)| {
            if let Some(kept) = extracts.gateway_route()
                && kept.still(&reads, &key.0)
            {
                return kept;
            }
            let out = Arc::new(route_out(&reads, key, route));
            // A render of an overlay keeps nothing: the stores' own routes stay theirs.
            if slot.keep {
                extracts.keep_gateway_route(Arc::clone(&out));
            }
            out
        })
        .collect();
    // The backends by name, the first row of each name (a stable sort of a list the routes'
    // store order mostly sorts already, then one of each: no tree walked per backend).
    let mut named: Vec<(&String, &Arc<Json>)> = Vec::new();
    for out in &outs {
        refusals.extend(out.refusals.iter().cloned());
        named.extend(out.backends.iter().map(|(name, row)| (name, row)));
        statuses.extend(out.status.iter().cloned());
        for &(gi, li) in &out.attached {
            if let Some(l) = gateways.get_mut(gi).and_then(|g| g.listeners.get_mut(li)) {
                l.attached += 1;
            }
        }
    }

    named.sort_by(|a, b| a.0.cmp(b.0));
    named.dedup_by(|later, first| later.0 == first.0);
    let backends: BTreeMap<String, Arc<Json>> = named
        .into_iter()
        .map(|(name, row)| (name.clone(), Arc::clone(row)))
        .collect();

    // Gateway status.
    for g in &gateways {
        let observed = generation(&g.object);
        let previous = arr(&g.object, "/status/conditions");
        let previous_listeners = arr(&g.object, "/status/listeners");
        let mut listeners = Vec::new();
        let mut all_valid = true;
        for l in &g.listeners {
            let prev = previous_listeners
                .iter()
                .find(|p| s(p, "/name") == l.name)
                .map_or(&[][..], |p| arr(p, "/conditions"));
            let mut conditions = Vec::new();
            let (acc_ok, acc_reason, acc_msg) = match &l.problem {
                Some((reason, _, message)) if *reason != "ProtocolConflict" => {
                    (false, *reason, message.clone())
                }
                _ => (true, "Accepted", "accepted by haptic".to_owned()),
            };
            conditions.push(condition(
                prev, "Accepted", acc_ok, acc_reason, &acc_msg, observed,
            ));
            let conflicted = matches!(&l.problem, Some(("ProtocolConflict", _, _)));
            conditions.push(condition(
                prev,
                "Conflicted",
                conflicted,
                if conflicted {
                    "ProtocolConflict"
                } else {
                    "NoConflicts"
                },
                if conflicted {
                    "another listener serves this port with another protocol"
                } else {
                    "no conflicts"
                },
                observed,
            ));
            let (rr_ok, rr_reason, rr_msg) = match &l.resolved {
                None => (true, "ResolvedRefs", "every reference resolves".to_owned()),
                Some((reason, message)) => (false, *reason, message.clone()),
            };
            conditions.push(condition(
                prev,
                "ResolvedRefs",
                rr_ok,
                rr_reason,
                &rr_msg,
                observed,
            ));
            let programmed = l.problem.is_none()
                && (!l.https || !l.certificates.is_empty())
                && l.resolved.is_none()
                && !addresses.is_empty();
            conditions.push(condition(
                prev,
                "Programmed",
                programmed,
                if programmed { "Programmed" } else { "Invalid" },
                if programmed {
                    "served by the HAProxy pods"
                } else {
                    "not served"
                },
                observed,
            ));
            all_valid &= programmed;
            let kinds = if l
                .problem
                .as_ref()
                .is_some_and(|p| p.0 == "UnsupportedProtocol")
                || l.invalid_kinds
            {
                json!([])
            } else {
                json!([{"group": GROUP, "kind": "HTTPRoute"}])
            };
            listeners.push(json!({
                "name": l.name,
                "supportedKinds": kinds,
                "attachedRoutes": l.attached,
                "conditions": conditions,
            }));
        }
        let programmed = !addresses.is_empty();
        let conditions = json!([
            condition(
                previous,
                "Accepted",
                true,
                if all_valid {
                    "Accepted"
                } else {
                    "ListenersNotValid"
                },
                if all_valid {
                    "accepted by haptic"
                } else {
                    "some listeners are not valid"
                },
                observed
            ),
            condition(
                previous,
                "Programmed",
                programmed,
                if programmed {
                    "Programmed"
                } else {
                    "AddressNotAssigned"
                },
                if programmed {
                    "served by the HAProxy pods"
                } else {
                    "no HAProxy pod is running"
                },
                observed
            ),
        ]);
        let object = object_ref(&g.object);
        statuses.push(Value::from_serializable(
            &json!({"object": object, "field": "addresses", "value": addresses}),
        ));
        statuses.push(Value::from_serializable(
            &json!({"object": object, "field": "conditions", "value": conditions}),
        ));
        statuses.push(Value::from_serializable(
            &json!({"object": object, "field": "listeners", "value": listeners}),
        ));
    }

    // Frontends: the matches of each port in the spec's precedence (a stable sort: among
    // equals, the order they were made in), with the actions they use.
    type PortRows<'a> = (Vec<&'a RouteMatch>, Vec<(&'a str, &'a Value)>);
    let mut by_port: BTreeMap<i64, PortRows<'_>> = BTreeMap::new();
    for out in &outs {
        for m in &out.matches {
            by_port.entry(m.port).or_default().0.push(m);
        }
        for (port, id, row) in &out.actions {
            by_port.entry(*port).or_default().1.push((id, row));
        }
    }
    let mut frontends: Vec<Frontend> = Vec::new();
    for (&port, &https) in &context.frontend_ports {
        let (rows, mut actions) = by_port.remove(&port).unwrap_or_default();
        let rows = sorted(rows);
        // The actions by id (the routes come in store order, which their ids mostly keep: a
        // sort of an almost sorted list compares little), each once: the same route and rule
        // through another listener of the port has the same lines (the first is kept).
        actions.sort_by(|a, b| a.0.cmp(b.0));
        actions.dedup_by(|later, first| later.0 == first.0);
        let hosts = context
            .listener_hosts
            .get(&port)
            .map_or(&[][..], Vec::as_slice);
        let certificates =
            Value::from_serializable(&certificates.get(&port).cloned().unwrap_or_default());
        // The listener hostnames of the port, most specific first: the first that covers the
        // request host picks the map entries looked up (`txn.gwlk`, the keys' beginning).
        let listeners: Vec<Value> = hosts
            .iter()
            .map(|h| {
                super::row([
                    ("key", Value::from(format!("{port}/{}/", h.key()))),
                    ("condition", Value::from(h.condition())),
                ])
            })
            .collect();
        let index: HashMap<&str, usize> = actions
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (*id, i))
            .collect();
        frontends.push(Frontend {
            port,
            https,
            certificates,
            action_of: rows
                .iter()
                .map(|m| {
                    index
                        .get(m.front.action.as_str())
                        .copied()
                        .unwrap_or(usize::MAX)
                })
                .collect(),
            matches: rows.iter().map(|m| Arc::clone(&m.front)).collect(),
            actions: actions.into_iter().map(|(_, row)| row.clone()).collect(),
            listeners: Value::from(listeners),
            // What the listeners' hostnames cover, as conditions on a TLS ClientHello's SNI:
            // an Ingress's ssl-passthrough does not take a host a Gateway's HTTPS listener on
            // the Ingress frontend's port covers.
            sni: Value::from(hosts.iter().map(Host::sni_condition).collect::<Vec<_>>()),
        });
    }

    // Backends: the endpoints of each Service port the routes name: the previous rows while
    // the routes name the same ports and no EndpointSlice changed (an HTTPRoute change).
    let slices_generation = inputs.slices.generation();
    let backend_rows = match previous {
        Some(previous)
            if previous.backends_from.0 == slices_generation
                && previous.backends_from.1 == backends =>
        {
            previous.backends.clone()
        }
        _ => Value::from(backend_rows(inputs.slices, &backends)),
    };

    let ports_of = |https: bool| -> Vec<i64> {
        frontends
            .iter()
            .filter(|f| f.https == https)
            .map(|f| f.port)
            .collect()
    };
    let (http_ports, https_ports) = (ports_of(false), ports_of(true));
    let claims = frontends
        .iter()
        .any(|f| f.matches.iter().any(|m| m.claim.is_some()));
    let mut resolved = Resolved {
        http_ports: Value::from_serializable(&http_ports),
        https_ports: Value::from_serializable(&https_ports),
        backends: backend_rows,
        backends_from: (slices_generation, backends),
        statuses: Value::from(statuses),
        refusals: Value::from_serializable(&refusals),
        frontends,
        claims,
        route_store: route_store.to_owned(),
        plain: Value::none(),
        context,
    };
    resolved.plain = resolved.value(None, Vec::new());
    resolved
}

/// `rows` in the spec's order ([`MatchRow::order`]; a stable sort: among equals, the order
/// they were made in). The sort moves and compares keys held side by side (the rank, the
/// creationTimestamp's digits, the place), not pointers to matches spread over the heap:
/// sorting 20,000 matches through pointers was mostly waiting for memory. Only keys that tie
/// (or a timestamp of another form) compare the matches themselves.
fn sorted(rows: Vec<&RouteMatch>) -> Vec<&RouteMatch> {
    let mut keys: Vec<(u128, Option<u64>, usize)> = rows
        .iter()
        .enumerate()
        .map(|(i, m)| (m.row.rank, m.row.created, i))
        .collect();
    keys.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then_with(|| match (a.1, b.1) {
                (Some(x), Some(y)) => x.cmp(&y),
                _ => std::cmp::Ordering::Equal,
            })
            .then_with(|| rows[a.2].row.order(&rows[b.2].row))
    });
    keys.into_iter().map(|(_, _, i)| rows[i]).collect()
}

/// The backend rows of `backends` (by name), with the endpoints of their Services'
/// EndpointSlices on the named port.
fn backend_rows(slices: Source<'_>, backends: &BTreeMap<String, Arc<Json>>) -> Vec<Value> {
    // Only the slices of the Services routed to: a cluster's other slices are not walked
    // further than their label.
    let wanted: BTreeSet<(&str, &str)> = backends
        .values()
        .map(|b| (s(b, "/namespace"), s(b, "/service")))
        .collect();
    let mut by_service: HashMap<(&str, &str), Vec<&Arc<Extracts>>> = HashMap::new();
    for ((namespace, _), slice, extracts) in
        slices
            .entries()
            .take(if wanted.is_empty() { 0 } else { usize::MAX })
    {
        let service = extracts.slice(slice).service.as_str();
        if !service.is_empty() && wanted.contains(&(namespace.as_str(), service)) {
            by_service
                .entry((namespace.as_str(), service))
                .or_default()
                .push(extracts);
        }
    }
    backends
        .values()
        .map(|b| {
            let (ns, svc, port_name) = (s(b, "/namespace"), s(b, "/service"), s(b, "/port_name"));
            let mut endpoints: Vec<Value> = Vec::new();
            for e in by_service.get(&(ns, svc)).map_or(&[][..], Vec::as_slice) {
                if let Some(slice) = e.slice.get().map(|s| &**s) {
                    for (name, rows) in &slice.ports {
                        if name == port_name {
                            endpoints.extend(rows.as_array().unwrap_or_default().iter().cloned());
                        }
                    }
                }
            }
            super::row([
                ("name", Value::from(s(b, "/name"))),
                ("endpoints", Value::from(endpoints)),
                ("app_protocol", Value::from(s(b, "/app_protocol"))),
                ("namespace", Value::from(ns)),
                ("service", Value::from(svc)),
                ("origin", origin("services", ns, svc)),
            ])
        })
        .collect()
}

/// What one HTTPRoute resolves to, with what it read to get there: kept beside the route
/// ([`Extracts`]) and taken again by the next resolution while the route, what it read of the
/// Gateways, grants and config ([`Context`]), the Services it names and its Namespace's labels
/// are the same.
pub(crate) struct RouteOut {
    context: Arc<Context>,
    /// The Services looked up, `(namespace, name)`, and the version found (none: missing).
    services: Vec<ServiceRead>,
    /// A generation of the Services store at which `services` were found as they are (when it
    /// is still the store's, no Service changed: nothing to look up again).
    services_valid_at: AtomicU64,
    /// The labels of the route's Namespace as a listener's selector reads them.
    labels: Option<Json>,
    refusals: Vec<Json>,
    /// Backend name and row (the first of a name is kept).
    backends: Vec<(String, Arc<Json>)>,
    /// The `parents` status, as a template value.
    status: Option<Value>,
    /// `(gateway, listener)` indexes of each listener the route attached to.
    attached: Vec<(usize, usize)>,
    /// The matches, in the order they were made (a stable sort keeps it among equals).
    matches: Vec<RouteMatch>,
    /// `(port, id, row)` of each action some match of the route uses.
    actions: Vec<(i64, String, Value)>,
}

impl std::fmt::Debug for RouteOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteOut")
            .field("matches", &self.matches.len())
            .finish_non_exhaustive()
    }
}

/// A Service a route looked up, `(namespace, name)`, and the version it found (none: missing).
type ServiceRead = ((String, String), Option<Weak<Extracts>>);

/// A match of a route on a listener port: what orders it, and its frontend row.
struct RouteMatch {
    port: i64,
    row: MatchRow,
    front: Arc<FrontMatch>,
}

impl RouteOut {
    /// Whether what the route read is still what it would read now.
    fn still(&self, reads: &RouteReads<'_>, namespace: &str) -> bool {
        if !(Arc::ptr_eq(&self.context, reads.context)
            && reads.namespace_labels.get(namespace) == self.labels.as_ref())
        {
            return false;
        }
        // After an HTTPRoute change no Service changed: 10,000 routes need no lookups.
        let now = reads.services_generation;
        if self.services_valid_at.load(Ordering::Relaxed) == now {
            return true;
        }
        let same = self.services.iter().all(|((ns, svc), then)| {
            match (then, reads.services.get_entry(ns, svc)) {
                (Some(then), Some((_, now))) => std::ptr::eq(then.as_ptr(), Arc::as_ptr(now)),
                (None, None) => true,
                _ => false,
            }
        });
        if same {
            self.services_valid_at.store(now, Ordering::Relaxed);
        }
        same
    }
}

/// What every route's resolution reads besides the route, its Services and its Namespace.
#[derive(PartialEq)]
struct Context {
    controller: String,
    route_store: String,
    ingress: (u16, u16),
    /// The Gateways of our classes (namespace, name) and their listeners before any route
    /// attached.
    gateways: Vec<(String, String, Vec<Listener>)>,
    grants: Vec<Json>,
    /// The listener ports served (HTTPS or not) and their listener hostnames.
    frontend_ports: BTreeMap<i64, bool>,
    listener_hosts: BTreeMap<i64, Vec<Host>>,
}

/// What [`route_out`] reads.
struct RouteReads<'a> {
    context: &'a Arc<Context>,
    gateways: &'a [Gateway],
    gateway_index: &'a HashMap<(String, String), usize>,
    grants: &'a [Json],
    namespace_labels: &'a HashMap<String, Json>,
    services: Source<'a>,
    /// `services`' generation.
    services_generation: u64,
    controller: &'a str,
    route_store: &'a str,
}

/// One HTTPRoute resolved against the Gateways' listeners: its refusals, backends, status,
/// attachments, and its matches and actions as frontend rows.
fn route_out(reads: &RouteReads<'_>, key: &(String, String), route: &Stored) -> RouteOut {
    let (namespace, name) = (&key.0, &key.1);
    let controller = reads.controller;
    let mut out = RouteOut {
        context: Arc::clone(reads.context),
        services: Vec::new(),
        services_valid_at: AtomicU64::new(reads.services_generation),
        labels: reads.namespace_labels.get(namespace.as_str()).cloned(),
        refusals: Vec::new(),
        backends: Vec::new(),
        status: None,
        attached: Vec::new(),
        matches: Vec::new(),
        actions: Vec::new(),
    };
    let mut matches: Vec<(i64, MatchRow)> = Vec::new();
    let mut actions: Vec<(i64, Action)> = Vec::new();
    let route = route.json();
    let route_generation = generation(&route);
    let previous_parents = arr(&route, "/status/parents");
    let given_hosts = arr(&route, "/spec/hostnames");
    let route_hosts: Vec<Host> = given_hosts
        .iter()
        .filter_map(|h| h.as_str().and_then(Host::parse))
        .collect();
    for (i, h) in given_hosts.iter().enumerate() {
        let text = h.as_str().unwrap_or_default();
        if Host::parse(text).is_none_or(|h| h == Host::Any) {
            refuse(
                &mut out.refusals,
                (reads.route_store, namespace.as_str(), name.as_str()),
                format!("spec.hostnames[{i}]"),
                text,
                "is not a hostname or a wildcard (`*.` and a hostname)",
            );
        }
    }
    // Hostnames given, none usable: the route matches no listener, never every host.
    let no_usable_host = !given_hosts.is_empty() && route_hosts.is_empty();
    let age = (
        s(&route, "/metadata/creationTimestamp").to_owned(),
        namespace.clone(),
        name.clone(),
    );
    let created = canonical_time(&age.0);
    // Backends and filters, resolved once per route.
    let mut resolved: Option<(&'static str, String)> = None;
    let mut accepted_problem: Option<(&'static str, String)> = None;
    struct Rule {
        shares: Vec<(i64, Option<String>)>,
        request_headers: Vec<Json>,
        response_headers: Vec<Json>,
        redirect: Option<(Json, Option<i64>, Option<PathModifier>)>,
        rewrite: Option<Json>,
        /// The length of the rule's one PathPrefix match, for a ReplacePrefixMatch.
        prefix_len: usize,
        matches: Vec<RuleMatch>,
    }
    let mut rules = Vec::new();
    for (ri, rule) in arr(&route, "/spec/rules").iter().enumerate() {
        let mut shares = Vec::new();
        for b in arr(rule, "/backendRefs") {
            // Filters of one backendRef (extended) are not supported: refused, not ignored.
            if !arr(b, "/filters").is_empty() {
                accepted_problem.get_or_insert((
                    "UnsupportedValue",
                    format!("backendRef {}: filters are not supported", s(b, "/name")),
                ));
            }
            let weight = b.get("weight").and_then(Json::as_i64).unwrap_or(1);
            let group = s(b, "/group");
            let kind = match s(b, "/kind") {
                "" => "Service",
                k => k,
            };
            let target_ns = match s(b, "/namespace") {
                "" => namespace.as_str(),
                n => n,
            };
            let svc = s(b, "/name");
            let port = b.get("port").and_then(Json::as_i64);
            let backend = if !group.is_empty() || kind != "Service" {
                resolved.get_or_insert((
                    "InvalidKind",
                    format!("backendRef {group}/{kind} {svc}: only Services are supported"),
                ));
                None
            } else if target_ns != namespace
                && !granted(
                    reads.grants,
                    "HTTPRoute",
                    namespace,
                    target_ns,
                    "Service",
                    svc,
                )
            {
                resolved.get_or_insert((
                    "RefNotPermitted",
                    format!(
                        "Service {target_ns}/{svc}: no ReferenceGrant in {target_ns} allows it"
                    ),
                ));
                None
            } else {
                let entry = reads.services.get_entry(target_ns, svc);
                // Each Service once: checking a kept route looks each up again.
                if !out
                    .services
                    .iter()
                    .any(|((ns, name), _)| ns == target_ns && name == svc)
                {
                    out.services.push((
                        (target_ns.to_owned(), svc.to_owned()),
                        entry.map(|(_, e)| Arc::downgrade(e)),
                    ));
                }
                let found = entry.and_then(|(v, e)| {
                    let service = e.service(target_ns, svc, v);
                    let p = service.ports.iter().find(|p| Some(p.number) == port)?;
                    Some((p.name.clone(), p.number, js(&p.app_protocol)))
                });
                match found {
                    None => {
                        resolved.get_or_insert((
                            "BackendNotFound",
                            format!(
                                "Service {target_ns}/{svc} port {} does not exist",
                                port.map_or("(none)".to_owned(), |p| p.to_string())
                            ),
                        ));
                        None
                    }
                    Some((port_name, number, app_protocol)) => {
                        let backend =
                            format!("gw_{}", backend_name(target_ns, svc, &number.to_string()));
                        out.backends.push((backend.clone(), {
                            Arc::new(json!({
                                "name": backend,
                                "namespace": target_ns,
                                "service": svc,
                                "port_name": port_name,
                                "app_protocol": app_protocol,
                            }))
                        }));
                        Some(backend)
                    }
                }
            };
            shares.push((weight.max(0), backend));
        }
        let mut request_headers = Vec::new();
        let mut response_headers = Vec::new();
        let mut redirect = None;
        let mut rewrite = None;
        for f in arr(rule, "/filters") {
            match s(f, "/type") {
                t @ ("RequestHeaderModifier" | "ResponseHeaderModifier") => {
                    let key = if t == "RequestHeaderModifier" {
                        "/requestHeaderModifier"
                    } else {
                        "/responseHeaderModifier"
                    };
                    let out = if t == "RequestHeaderModifier" {
                        &mut request_headers
                    } else {
                        &mut response_headers
                    };
                    for name in arr(f, &format!("{key}/remove"))
                        .iter()
                        .filter_map(Json::as_str)
                    {
                        if is_token(name) {
                            out.push(json!({"op": "del-header", "name": name, "value": ""}));
                        } else {
                            accepted_problem.get_or_insert((
                                "UnsupportedValue",
                                format!("header name {name:?}"),
                            ));
                        }
                    }
                    for (op, list) in [("set-header", "set"), ("add-header", "add")] {
                        for h in arr(f, &format!("{key}/{list}")) {
                            let (hn, hv) = (s(h, "/name"), s(h, "/value"));
                            if is_token(hn) && quotable(hv) {
                                if op == "set-header" {
                                    out.push(json!({"op": "del-header", "name": hn, "value": ""}));
                                }
                                out.push(json!({"op": "add-header", "name": hn, "value": log_format(hv)}));
                            } else {
                                accepted_problem.get_or_insert((
                                    "UnsupportedValue",
                                    format!("header {hn:?}: {hv:?}"),
                                ));
                            }
                        }
                    }
                }
                "RequestRedirect" => {
                    let r = f.get("requestRedirect").cloned().unwrap_or(Json::Null);
                    let port = r.get("port").and_then(Json::as_i64);
                    let path = match PathModifier::parse(r.get("path")) {
                        Ok(path) => path,
                        Err(why) => {
                            accepted_problem.get_or_insert((
                                "UnsupportedValue",
                                format!("requestRedirect {why}"),
                            ));
                            None
                        }
                    };
                    let host = s(&r, "/hostname");
                    let scheme = s(&r, "/scheme");
                    if (!host.is_empty() && !is_hostname(host))
                        || !matches!(scheme, "" | "http" | "https")
                    {
                        accepted_problem.get_or_insert((
                            "UnsupportedValue",
                            "requestRedirect hostname or scheme".to_owned(),
                        ));
                    } else {
                        redirect = Some((r, port, path));
                    }
                }
                // The hostname and a path, full or the matched prefix replaced.
                "URLRewrite" => {
                    let host = s(f, "/urlRewrite/hostname");
                    match PathModifier::parse(f.pointer("/urlRewrite/path")) {
                        Ok(path) if host.is_empty() || is_hostname(host) => {
                            rewrite = Some((host.to_owned(), path));
                        }
                        Ok(_) => {
                            accepted_problem.get_or_insert((
                                "UnsupportedValue",
                                format!("urlRewrite hostname {host:?} is not a hostname"),
                            ));
                        }
                        Err(why) => {
                            accepted_problem
                                .get_or_insert(("UnsupportedValue", format!("urlRewrite {why}")));
                        }
                    }
                }
                other => {
                    accepted_problem.get_or_insert((
                        "UnsupportedValue",
                        format!("filter {other} is not supported"),
                    ));
                }
            }
        }
        let mut rule_matches = Vec::new();
        let given = arr(rule, "/matches");
        let default = [json!({})];
        for (mi, m) in if given.is_empty() {
            &default[..]
        } else {
            given
        }
        .iter()
        .enumerate()
        {
            let value = match s(m, "/path/value") {
                "" => "/",
                v => v,
            };
            // A regular expression is written into haproxy.cfg: only what the PCRE2
            // subset takes (one word, compiles).
            let regex = |field: String, value: &str| {
                pcre::check(value).map_err(|why| {
                    format!(
                        "spec.rules[{ri}].matches[{mi}].{field}: RegularExpression {value:?} is not supported: {why}"
                    )
                })
            };
            let path = match s(m, "/path/type") {
                "Exact" if is_plain_path(value) => PathMatch::Exact(value.to_owned()),
                "" | "PathPrefix" if is_plain_path(value) => {
                    PathMatch::Prefix(value.trim_end_matches('/').to_owned())
                }
                "RegularExpression" => match regex("path.value".to_owned(), value) {
                    Ok(()) => PathMatch::Regex(value.to_owned()),
                    Err(why) => {
                        accepted_problem.get_or_insert(("UnsupportedValue", why));
                        continue;
                    }
                },
                other => {
                    accepted_problem.get_or_insert((
                        "UnsupportedValue",
                        format!("path match {other} {value:?} is not supported"),
                    ));
                    continue;
                }
            };
            let method = match s(m, "/method") {
                "" => None,
                m if is_token(m) => Some(m.to_owned()),
                _ => continue,
            };
            let mut headers = Vec::new();
            let mut queries = Vec::new();
            let mut problem = None;
            for (list, out) in [("headers", &mut headers), ("queryParams", &mut queries)] {
                for (hi, h) in arr(m, &format!("/{list}")).iter().enumerate() {
                    let (hn, hv) = (s(h, "/name"), s(h, "/value"));
                    let value = match s(h, "/type") {
                        "" | "Exact" if is_token(hn) && quotable(hv) => {
                            Ok(ValueMatch::Exact(hv.to_owned()))
                        }
                        "RegularExpression" if is_token(hn) => {
                            regex(format!("{list}[{hi}].value"), hv)
                                .map(|()| ValueMatch::Regex(hv.to_owned()))
                        }
                        t => Err(format!(
                            "spec.rules[{ri}].matches[{mi}].{list}[{hi}]: {} name {hn:?} value {hv:?} is not supported",
                            if t.is_empty() { "Exact" } else { t }
                        )),
                    };
                    match value {
                        Ok(value) => out.push((hn.to_owned(), value)),
                        Err(why) => {
                            problem.get_or_insert(why);
                        }
                    }
                }
            }
            if let Some(why) = problem {
                accepted_problem.get_or_insert(("UnsupportedValue", why));
                continue;
            }
            rule_matches.push((path, method, headers, queries));
        }
        // ReplacePrefixMatch replaces the prefix of the rule's one PathPrefix match (the
        // CRD asks for exactly one; none given is the default `PathPrefix /`); with any
        // other matches the route is not accepted, as the API says.
        let replaces_prefix = [
            redirect.as_ref().and_then(|r| r.2.as_ref()),
            rewrite.as_ref().and_then(|r| r.1.as_ref()),
        ]
        .into_iter()
        .flatten()
        .any(|p| matches!(p, PathModifier::Prefix(_)));
        let prefix_len = match rule_matches.as_slice() {
            [(PathMatch::Prefix(p), ..)] if given.len() <= 1 => p.len(),
            _ => {
                if replaces_prefix {
                    accepted_problem.get_or_insert((
                        "UnsupportedValue",
                        "ReplacePrefixMatch needs exactly one PathPrefix match in its rule"
                            .to_owned(),
                    ));
                }
                0
            }
        };
        let rewrite = rewrite.map(|(host, path)| {
            json!({
                "host": host,
                "path": match &path {
                    Some(PathModifier::Full(p)) => p.as_str(),
                    _ => "",
                },
                "prefix": path.map_or(Json::Null, |p| p.prefix_row(prefix_len)),
            })
        });
        rules.push(Rule {
            shares,
            request_headers,
            response_headers,
            redirect,
            rewrite,
            prefix_len,
            matches: rule_matches,
        });
    }

    // Parents.
    let mut parents = Vec::new();
    for p in arr(&route, "/spec/parentRefs") {
        let group = p.get("group").and_then(Json::as_str).unwrap_or(GROUP);
        let kind = p.get("kind").and_then(Json::as_str).unwrap_or("Gateway");
        if group != GROUP || kind != "Gateway" {
            continue;
        }
        let gw_ns = match s(p, "/namespace") {
            "" => namespace.as_str(),
            n => n,
        };
        let Some(&gi) = reads
            .gateway_index
            .get(&(gw_ns.to_owned(), s(p, "/name").to_owned()))
        else {
            continue;
        };
        let section = s(p, "/sectionName");
        let port = p.get("port").and_then(Json::as_i64);
        let gateway = &reads.gateways[gi];
        let candidates: Vec<usize> = (0..gateway.listeners.len())
            .filter(|&i| {
                let l = &gateway.listeners[i];
                (section.is_empty() || l.name == section) && port.is_none_or(|p| p == l.port)
            })
            .collect();
        let allowed: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| {
                let l = &gateway.listeners[i];
                let ns_ok = match l.from.as_str() {
                    "All" => true,
                    "Selector" => reads
                        .namespace_labels
                        .get(namespace.as_str())
                        .is_some_and(|labels| selects(&l.selector, labels)),
                    _ => namespace == &gateway.namespace,
                };
                // A listener of a protocol we do not serve takes no routes.
                let served = !matches!(&l.problem, Some(("UnsupportedProtocol", _, _)));
                ns_ok && !l.invalid_kinds && served
            })
            .collect();
        let attached: Vec<(usize, Vec<Host>)> = allowed
            .iter()
            .filter_map(|&i| {
                let hosts = intersect(&gateway.listeners[i].host, &route_hosts);
                (!hosts.is_empty() && !no_usable_host).then_some((i, hosts))
            })
            .collect();
        let (accepted, reason, message) = if candidates.is_empty() {
            (
                false,
                "NoMatchingParent",
                "no listener matches sectionName and port".to_owned(),
            )
        } else if allowed.is_empty() {
            (
                false,
                "NotAllowedByListeners",
                "no listener allows this route's namespace and kind".to_owned(),
            )
        } else if attached.is_empty() {
            (
                false,
                "NoMatchingListenerHostname",
                "no listener hostname intersects the route's hostnames".to_owned(),
            )
        } else if let Some((reason, message)) = &accepted_problem {
            (false, *reason, message.clone())
        } else {
            (true, "Accepted", "accepted by haptic".to_owned())
        };
        let previous = previous_parents
            .iter()
            .find(|pp| {
                s(pp, "/controllerName") == controller
                    && s(pp, "/parentRef/name") == s(p, "/name")
                    && s(pp, "/parentRef/namespace") == gw_ns
                    && s(pp, "/parentRef/sectionName") == section
            })
            .map_or(&[][..], |pp| arr(pp, "/conditions"));
        let (rr_ok, rr_reason, rr_message) = match &resolved {
            None => (true, "ResolvedRefs", "every backendRef resolves".to_owned()),
            Some((reason, message)) => (false, *reason, message.clone()),
        };
        let mut parent_ref =
            json!({"group": GROUP, "kind": "Gateway", "namespace": gw_ns, "name": s(p, "/name")});
        if !section.is_empty() {
            parent_ref["sectionName"] = Json::from(section);
        }
        if let Some(port) = port {
            parent_ref["port"] = Json::from(port);
        }
        parents.push(json!({
            "parentRef": parent_ref,
            "controllerName": controller,
            "conditions": [
                condition(previous, "Accepted", accepted, reason, &message, route_generation),
                condition(previous, "ResolvedRefs", rr_ok, rr_reason, &rr_message, route_generation),
            ],
        }));
        if !accepted {
            continue;
        }
        for (li, hosts) in attached {
            let listener = &gateway.listeners[li];
            out.attached.push((gi, li));
            if listener.problem.is_some() || (listener.https && listener.certificates.is_empty()) {
                continue;
            }
            let listener_port = listener.port;
            let listener_host = listener.host.clone();
            let https = listener.https;
            for (ri, rule) in rules.iter().enumerate() {
                let redirect = rule.redirect.as_ref().map(|(r, port, path)| {
                    let scheme = match s(r, "/scheme") {
                        "" => {
                            if https {
                                "https"
                            } else {
                                "http"
                            }
                        }
                        sch => sch,
                    };
                    let host = match s(r, "/hostname") {
                        "" => "%[var(txn.gwhost)]".to_owned(),
                        h => h.to_owned(),
                    };
                    let port = match (port, s(r, "/scheme")) {
                        (Some(p), _) => Some(*p),
                        (None, "") => Some(listener_port),
                        (None, _) => None,
                    }
                    .filter(|p| !matches!((scheme, *p), ("http", 80) | ("https", 443)));
                    let port = port.map_or(String::new(), |p| format!(":{p}"));
                    let base = format!("{scheme}://{host}{port}");
                    // A replaced prefix: the location without a rest of the path (the
                    // template writes the others).
                    let (path, prefix) = match path {
                        None => ("%[pathq]".to_owned(), Json::Null),
                        Some(PathModifier::Full(p)) => (p.clone(), Json::Null),
                        Some(p @ PathModifier::Prefix(_)) => {
                            let prefix = p.prefix_row(rule.prefix_len);
                            (s(&prefix, "/exact").to_owned(), prefix)
                        }
                    };
                    json!({
                        "location": format!("{base}{path}"),
                        "base": base,
                        "prefix": prefix,
                        "code": r.get("statusCode").and_then(Json::as_i64).unwrap_or(302),
                    })
                });
                let action = actions.len();
                // One backend, no filter: a match without conditions is a map entry.
                let mut positive = rule.shares.iter().filter(|(w, _)| *w > 0);
                let backend = match (positive.next(), positive.next()) {
                    (Some((_, Some(b))), None)
                        if rule.request_headers.is_empty()
                            && rule.response_headers.is_empty()
                            && rule.redirect.is_none()
                            && rule.rewrite.is_none() =>
                    {
                        Some(b.clone())
                    }
                    _ => None,
                };
                actions.push((
                    listener_port,
                    Action {
                        id: format!(
                            "{listener_port}/{}/{}/{ri}",
                            sanitize(namespace),
                            sanitize(name)
                        ),
                        request_headers: rule.request_headers.clone(),
                        response_headers: rule.response_headers.clone(),
                        redirect,
                        rewrite: rule.rewrite.clone(),
                        shares: rule.shares.clone(),
                        origin: (namespace.clone(), name.clone()),
                    },
                ));
                for host in &hosts {
                    for (mi, (path, method, headers, queries)) in rule.matches.iter().enumerate() {
                        let mut row = MatchRow {
                            host: host.clone(),
                            listener: listener_host.clone(),
                            path: path.clone(),
                            method: method.clone(),
                            headers: headers.clone(),
                            queries: queries.clone(),
                            age: age.clone(),
                            rank: 0,
                            created,
                            rule: ri,
                            index: mi,
                            action,
                            backend: backend.clone(),
                            origin: (namespace.clone(), name.clone()),
                        };
                        row.rank = row.rank_key();
                        matches.push((listener_port, row));
                    }
                }
            }
        }
    }
    if !parents.is_empty() {
        // Parents other controllers wrote are kept as they are.
        let mut all: Vec<Json> = previous_parents
            .iter()
            .filter(|pp| s(pp, "/controllerName") != controller)
            .cloned()
            .collect();
        all.extend(parents);
        out.status = Some(Value::from_serializable(&json!({
            "object": object_ref(&route),
            "field": "parents",
            "value": all,
        })));
    }
    // The frontend rows, built once per version of the route (20,000 rows at 10,000 routes
    // cost as much to build as the rest of the view).
    let context: &Context = reads.context;
    let mut used = vec![false; actions.len()];
    for (port, m) in matches {
        let https = context
            .frontend_ports
            .get(&port)
            .copied()
            .unwrap_or_default();
        let shared = (port == i64::from(context.ingress.0) && !https)
            || (port == i64::from(context.ingress.1) && https);
        let hosts = context
            .listener_hosts
            .get(&port)
            .map_or(&[][..], Vec::as_slice);
        used[m.action] = true;
        let front = front_match(
            &m,
            &actions[m.action].1.id,
            hosts,
            shared,
            reads.route_store,
            port,
        );
        let front = Arc::new(front);
        out.matches.push(RouteMatch {
            port,
            row: m,
            front,
        });
    }
    for ((port, a), used) in actions.iter().zip(used) {
        if used {
            out.actions
                .push((*port, a.id.clone(), action_row(a, reads.route_store)));
        }
    }
    out
}

/// The frontend row of match `m` of port `port` (whose listener hostnames are `hosts`, most
/// specific first; `shared`: the Ingress frontend's port), its action `action`.
fn front_match(
    m: &MatchRow,
    action: &str,
    hosts: &[Host],
    shared: bool,
    route_store: &str,
    port: i64,
) -> FrontMatch {
    // A request is matched against the routes of the most specific listener whose hostname
    // matches its host only (the spec's listener precedence): a match of a listener also
    // requires that the host is none of the more specific listener hostnames of the port its
    // own covers. (A less specific listener's route never answers for a host a more specific
    // listener takes, even when none of that listener's routes matches.) The ACLs say it all:
    // no template line is needed.
    let not_theirs = hosts
        .iter()
        .filter(|h| *h != &m.listener && m.listener.covers_host(h))
        .map(|h| format!("!{}", h.condition().trim_start()));
    let rank = rank(&m.host, &m.path);
    // A map hit of a strictly better host and path goes first; with the same host and path,
    // this match (it has conditions, or it is the older) does.
    let mut terms = m.terms();
    terms.extend(not_theirs);
    terms.push(format!("!{{ var(txn.gwmaprank) -m int lt {rank} }}"));
    let (condition, more) = lines(&terms);
    let unconditioned = m.unconditioned();
    // On the Ingress frontend's own port, a match without method, header or query conditions
    // claims its host and path as an Ingress path does.
    let claim = (shared && unconditioned)
        .then(|| RouteClaim::of(m))
        .flatten();
    let exact = matches!(m.path, PathMatch::Exact(_));
    // The map key: the port and the listener's hostname (the frontend looks up the entries of
    // the most specific listener covering the request host only), then the host and the path.
    let key = format!(
        "{port}/{}/{}{}",
        m.listener.key(),
        m.host.key(),
        m.path.key()
    );
    let path_len = match &m.path {
        PathMatch::Exact(p) | PathMatch::Prefix(p) | PathMatch::Regex(p) => p.len(),
    };
    let entry = m
        .backend
        .as_ref()
        .filter(|_| unconditioned && m.host.in_maps() && path_len <= MAP_PATH_LIMIT)
        .map(|backend| {
            super::row([
                ("key", Value::from(key.as_str())),
                ("rank", Value::from(rank)),
                ("backend", Value::from(backend.as_str())),
                ("origin", origin(route_store, &m.origin.0, &m.origin.1)),
            ])
        });
    // Template values built directly (no JSON in between): 10,000 routes make 20,000 match
    // rows, and converting them from JSON cost as much as building them.
    FrontMatch {
        row: super::row([
            ("condition", Value::from(condition)),
            ("more", Value::from(more)),
            ("action", Value::from(action)),
            ("origin", origin(route_store, &m.origin.0, &m.origin.1)),
        ]),
        action: action.to_owned(),
        claim,
        same: unconditioned.then_some((exact, key)),
        entry: entry.map(|e| (exact, e)),
    }
}

/// The row of an action (`actions` of a frontend).
fn action_row(a: &Action, route_store: &str) -> Value {
    let total: i64 = a.shares.iter().map(|(w, _)| *w).sum();
    let mut upper = 0;
    let shares: Vec<Value> = a
        .shares
        .iter()
        .filter(|(w, _)| *w > 0)
        .map(|(w, b)| {
            upper += w;
            super::row([
                ("upper", Value::from(upper)),
                (
                    "backend",
                    b.as_deref().map_or_else(Value::none, Value::from),
                ),
            ])
        })
        .collect();
    let json_value = |v: &Option<Json>| {
        v.as_ref()
            .map_or_else(Value::none, Value::from_serializable)
    };
    super::row([
        ("id", Value::from(a.id.as_str())),
        (
            "request_headers",
            Value::from_serializable(&a.request_headers),
        ),
        (
            "response_headers",
            Value::from_serializable(&a.response_headers),
        ),
        ("redirect", json_value(&a.redirect)),
        ("rewrite", json_value(&a.rewrite)),
        ("total", Value::from(total)),
        ("shares", Value::from(shares)),
        ("origin", origin(route_store, &a.origin.0, &a.origin.1)),
    ])
}

/// A claim of an HTTPRoute match on the Ingress frontend's port: the host and path as an
/// Ingress path's route key writes them ([`super::route_key`]: `*.` wildcards, `""` for any
/// host, a prefix without its trailing slashes), and the route's age.
#[derive(Debug, Clone)]
struct RouteClaim {
    exact: bool,
    host: String,
    path: String,
    created: String,
    namespace: String,
    name: String,
}

impl RouteClaim {
    /// None for a regular expression: no Ingress path is one (an Ingress's path types are
    /// Exact and prefixes), so it claims nothing.
    fn of(m: &MatchRow) -> Option<Self> {
        let (exact, path) = match &m.path {
            PathMatch::Exact(p) => (true, p.clone()),
            PathMatch::Prefix(p) => (false, p.clone()),
            PathMatch::Regex(_) => return None,
        };
        let host = match &m.host {
            Host::Exact(h) => h.clone(),
            Host::Wildcard(suffix) => format!("*{suffix}"),
            Host::Any => String::new(),
        };
        Some(Self {
            exact,
            host,
            path,
            created: m.age.0.clone(),
            namespace: m.age.1.clone(),
            name: m.age.2.clone(),
        })
    }

    fn key(&self) -> (bool, &str, &str) {
        (self.exact, &self.host, &self.path)
    }

    /// Where it stands in a conflict with an Ingress: `creationTimestamp` (none: after every
    /// one), then kind (`HTTPRoute` before `Ingress`), namespace, name.
    fn rank(&self) -> (bool, &str, &str, &str, &str) {
        (
            self.created.is_empty(),
            &self.created,
            "HTTPRoute",
            &self.namespace,
            &self.name,
        )
    }

    /// `host <host> path <path> (<type>)`, as the Events name a route: the type as an
    /// Ingress (`Prefix`) or an HTTPRoute (`PathPrefix`) says it.
    fn describe(&self, ingress: bool) -> String {
        let host = if self.host.is_empty() {
            "*"
        } else {
            &self.host
        };
        let (path, kind) = match (self.exact, self.path.as_str()) {
            (true, p) => (p, "Exact"),
            (false, "") => ("/", if ingress { "Prefix" } else { "PathPrefix" }),
            (false, p) => (p, if ingress { "Prefix" } else { "PathPrefix" }),
        };
        format!("host {host} path {path} ({kind})")
    }
}

/// One match of a frontend: its row in `haproxy.cfg`, or its map entry.
struct FrontMatch {
    /// The row of `matches` (`condition`, `action`, `origin`).
    row: Value,
    /// Its action's id.
    action: String,
    /// On the Ingress frontend's port, the route it claims.
    claim: Option<RouteClaim>,
    /// Without conditions: the map key it answers (Exact or prefix, key). Of several matches
    /// without conditions with the same key, the first (the oldest route) takes every request
    /// the others would: only it is written.
    same: Option<(bool, String)>,
    /// The map entry (`key`, `rank`, `backend`, `origin`) that stands for it, when it has no
    /// conditions and its rule one backend and no filter: `(Exact, row)`.
    entry: Option<(bool, Value)>,
}

/// A frontend of the view: its matches (each with its action and, on the Ingress frontend's
/// port, its claim), its action rows by id, and its listener hostnames.
struct Frontend {
    port: i64,
    https: bool,
    certificates: Value,
    matches: Vec<Arc<FrontMatch>>,
    /// The index in `actions` of each match's action.
    action_of: Vec<usize>,
    /// The action rows, by id.
    actions: Vec<Value>,
    listeners: Value,
    sni: Value,
}

/// The map entries of the frontends, Exact paths and prefixes.
#[derive(Default)]
struct MapRows {
    exact: Vec<Value>,
    prefix: Vec<Value>,
}

impl Frontend {
    /// The row without the matches whose indexes `dropped` holds (nor the actions only they
    /// used); the map entries go to `maps`.
    fn row_without(&self, dropped: Option<&BTreeSet<usize>>, maps: &mut MapRows) -> Value {
        let mut seen: std::collections::HashSet<&(bool, String)> = std::collections::HashSet::new();
        let mut kept = Vec::new();
        let mut used = vec![false; self.actions.len()];
        for (i, m) in self.matches.iter().enumerate() {
            if dropped.is_some_and(|d| d.contains(&i)) {
                continue;
            }
            if let Some(same) = &m.same
                && !seen.insert(same)
            {
                continue;
            }
            match &m.entry {
                Some((true, entry)) => maps.exact.push(entry.clone()),
                Some((false, entry)) => maps.prefix.push(entry.clone()),
                None => {
                    kept.push(m.row.clone());
                    if let Some(used) = self.action_of.get(i).and_then(|&a| used.get_mut(a)) {
                        *used = true;
                    }
                }
            }
        }
        super::row([
            ("port", Value::from(self.port)),
            ("https", Value::from(self.https)),
            ("certificates", self.certificates.clone()),
            ("matches", Value::from(kept)),
            (
                "actions",
                Value::from(
                    self.actions
                        .iter()
                        .zip(used)
                        .filter(|(_, used)| *used)
                        .map(|(row, _)| row.clone())
                        .collect::<Vec<_>>(),
                ),
            ),
            ("listeners", self.listeners.clone()),
            ("sni", self.sni.clone()),
        ])
    }
}

/// What the view reads of the Gateway API stores, resolved: kept while they do not change, so
/// that an Ingress change only decides the conflicts between the two kinds again
/// ([`Resolved::with_ingresses`]).
pub(crate) struct Resolved {
    frontends: Vec<Frontend>,
    http_ports: Value,
    https_ports: Value,
    backends: Value,
    /// What the backend rows were made of: the EndpointSlices' generation and the backends
    /// the routes name.
    backends_from: (u64, BTreeMap<String, Arc<Json>>),
    statuses: Value,
    refusals: Value,
    /// Whether a match claims a route on the Ingress frontend's port.
    claims: bool,
    /// The name of the HTTPRoutes' store.
    route_store: String,
    /// The value when no Ingress claims what a route does.
    plain: Value,
    /// What the routes read of the Gateways, grants and config: the next resolution's routes
    /// keep what they resolved to while it stays the same.
    context: Arc<Context>,
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("frontends", &self.frontends.len())
            .field("claims", &self.claims)
            .finish_non_exhaustive()
    }
}

/// Our Ingresses, as the view reads them to decide conflicts: their store's name, the store
/// and which of them are ours.
pub(super) struct IngressSide<'a> {
    pub(super) store: &'a str,
    pub(super) ingresses: Source<'a>,
    pub(super) ours: super::Ours<'a>,
}

impl Resolved {
    /// The view's value: `dropped` holds, per frontend, the indexes of the matches left out.
    fn value(
        &self,
        dropped: Option<&BTreeMap<usize, BTreeSet<usize>>>,
        events: Vec<Value>,
    ) -> Value {
        let mut maps = MapRows::default();
        let frontends: Vec<Value> = self
            .frontends
            .iter()
            .enumerate()
            .map(|(i, f)| f.row_without(dropped.and_then(|d| d.get(&i)), &mut maps))
            .collect();
        super::row([
            ("frontends", Value::from(frontends)),
            ("map_exact", Value::from(maps.exact)),
            ("map_prefix", Value::from(maps.prefix)),
            (
                "wildcard_labels",
                Value::from(
                    (1..=MAP_WILDCARD_LABELS)
                        .rev()
                        .map(Value::from)
                        .collect::<Vec<_>>(),
                ),
            ),
            ("http_ports", self.http_ports.clone()),
            ("https_ports", self.https_ports.clone()),
            ("backends", self.backends.clone()),
            ("statuses", self.statuses.clone()),
            ("refusals", self.refusals.clone()),
            ("events", Value::from(events)),
        ])
    }

    /// The view's value with the conflicts between HTTPRoute matches on the Ingress frontend's
    /// port and Ingress paths decided (`ingresses`: none when the view reads no Ingresses).
    ///
    /// A match without method, header or query conditions claims its host and path as an
    /// Ingress path does ([`super::route_key`]: Exact with Exact, PathPrefix with Prefix and
    /// ImplementationSpecific); when the oldest of our Ingresses claiming the same is older
    /// (`creationTimestamp`, then kind, `HTTPRoute` first, then namespace and name), the match
    /// is left out and the route gets a Warning Event `RouteConflict` naming the Ingress;
    /// otherwise the route keeps it (its rules go before the Ingress maps on its port) and the
    /// Ingress gets the Event naming the oldest such route. No Ingress is read unless a match
    /// claims something.
    pub(super) fn with_ingresses(&self, ingresses: Option<&IngressSide<'_>>) -> Value {
        let Some(side) = ingresses.filter(|_| self.claims) else {
            return self.plain.clone();
        };
        let wanted: std::collections::HashSet<(bool, &str, &str)> = self
            .frontends
            .iter()
            .flat_map(|f| f.matches.iter())
            .filter_map(|m| m.claim.as_ref().map(RouteClaim::key))
            .collect();
        let ours = side.ours.of(side.ingresses);
        let mut claims = super::Claims::with_capacity(wanted.len());
        for ing in ours.iter().filter(|ing| !ing.ingress.canary) {
            let age = ing.age();
            for p in &ing.ingress.paths {
                let key = super::route_key(p);
                if wanted.contains(&key) {
                    claims.claim(key, age);
                }
            }
        }
        if claims.by_key.is_empty() {
            return self.plain.clone();
        }
        let mut dropped: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        let mut events = Vec::new();
        // Per port and route key: the oldest route older than the oldest Ingress claiming it.
        let mut won: BTreeMap<(i64, (bool, &str, &str)), &RouteClaim> = BTreeMap::new();
        for (fi, f) in self.frontends.iter().enumerate() {
            for (mi, m) in f.matches.iter().enumerate() {
                let Some(claim) = &m.claim else { continue };
                let Some((ingress, _)) = claims.by_key.get(&claim.key()) else {
                    continue;
                };
                let ingress_rank = (ingress.0, ingress.1, "Ingress", ingress.2, ingress.3);
                if ingress_rank < claim.rank() {
                    dropped.entry(fi).or_default().insert(mi);
                    events.push(super::row([
                        ("store", Value::from(self.route_store.as_str())),
                        ("namespace", Value::from(claim.namespace.as_str())),
                        ("name", Value::from(claim.name.as_str())),
                        ("reason", Value::from("RouteConflict")),
                        (
                            "message",
                            Value::from(format!(
                                "{} on port {} is served by the older Ingress {}: this match is not routed there",
                                claim.describe(false),
                                f.port,
                                super::owner(ingress)
                            )),
                        ),
                    ]));
                } else {
                    let oldest = won.entry((f.port, claim.key())).or_insert(claim);
                    if claim.rank() < oldest.rank() {
                        *oldest = claim;
                    }
                }
            }
        }
        for ((port, key), route) in &won {
            let Some((ingress, _)) = claims.by_key.get(key) else {
                continue;
            };
            events.push(super::row([
                ("store", Value::from(side.store)),
                ("namespace", Value::from(ingress.2)),
                ("name", Value::from(ingress.3)),
                ("reason", Value::from("RouteConflict")),
                (
                    "message",
                    Value::from(format!(
                        "{} is served on port {port} by the older HTTPRoute {}/{}: this path is not routed there",
                        route.describe(true),
                        route.namespace,
                        route.name
                    )),
                ),
            ]));
        }
        self.value(Some(&dropped), events)
    }
}

/// Records that the admission webhook refuses an object for a field: a value the CRD's schema
/// refuses (a real API server never stores it; a store may hold it from elsewhere), which the
/// view leaves out rather than reads otherwise than it says. The template's `refuse(...)`
/// denies it under review only; one already stored is left out and blocks nobody.
fn refuse(
    refusals: &mut Vec<Json>,
    (store, namespace, name): (&str, &str, &str),
    field: String,
    value: &str,
    reason: &str,
) {
    refusals.push(json!({
        "store": store, "namespace": namespace, "name": name,
        "field": field, "value": value, "reason": reason,
    }));
}

/// Whether a Gateway or HTTPRoute is one the view reads: a Gateway of one of our classes
/// (`spec.gatewayClassName` names a GatewayClass whose `controllerName` is `controller`), an
/// HTTPRoute with a parentRef naming such a Gateway. `None` when `store` is neither the view's
/// Gateways nor its HTTPRoutes. Anything else cannot change what is rendered: the admission
/// webhook lets it through without rendering.
pub(crate) fn owns(
    (gateway_store, route_store): (&str, &str),
    store: &str,
    object: &Json,
    classes: Source<'_>,
    gateways: Source<'_>,
    controller: &str,
) -> Option<bool> {
    let ours_class = |class: &str| {
        !class.is_empty()
            && classes
                .get_entry("", class)
                .is_some_and(|(c, _)| s(&c.json(), "/spec/controllerName") == controller)
    };
    if store == gateway_store {
        return Some(ours_class(s(object, "/spec/gatewayClassName")));
    }
    if store != route_store {
        return None;
    }
    let namespace = s(object, "/metadata/namespace");
    Some(arr(object, "/spec/parentRefs").iter().any(|p| {
        let group = p.get("group").and_then(Json::as_str).unwrap_or(GROUP);
        let kind = p.get("kind").and_then(Json::as_str).unwrap_or("Gateway");
        let gw_ns = match s(p, "/namespace") {
            "" => namespace,
            n => n,
        };
        group == GROUP
            && kind == "Gateway"
            && gateways
                .get_entry(gw_ns, s(p, "/name"))
                .is_some_and(|(g, _)| ours_class(s(&g.json(), "/spec/gatewayClassName")))
    }))
}

/// What `set_status` needs of an object.
fn object_ref(object: &Json) -> Json {
    let mut meta = json!({"name": s(object, "/metadata/name")});
    if let Some(ns) = object.pointer("/metadata/namespace").and_then(Json::as_str) {
        meta["namespace"] = Json::from(ns);
    }
    json!({
        "apiVersion": s(object, "/apiVersion"),
        "kind": s(object, "/kind"),
        "metadata": meta,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value as Json, json};

    use super::{Host, intersect, rfc3339};

    #[test]
    #[allow(clippy::unwrap_used)]
    fn conflicts_with_ingresses_go_to_the_older_and_a_tie_to_the_http_route() {
        let mut stores = crate::reference::stores().unwrap();
        let mut apply = |store: &str, resource: Json| {
            stores.get_mut(store).unwrap().apply(&resource).unwrap();
        };
        apply(
            "ingressclasses",
            crate::fixtures::ingress_class("haptic", true),
        );
        apply(
            "gatewayclasses",
            json!({"metadata": {"name": "haptic"},
                "spec": {"controllerName": super::DEFAULT_GATEWAY_CONTROLLER}}),
        );
        apply(
            "gateways",
            json!({"metadata": {"namespace": "ns", "name": "gw"},
                "spec": {"gatewayClassName": "haptic",
                    "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"},
                        {"name": "https", "port": 443, "protocol": "HTTPS",
                         "tls": {"certificateRefs": [{"name": "cert"}]}}]}}),
        );
        apply("secrets", crate::fixtures::tls_secret("ns", "cert"));
        apply(
            "services",
            json!({"metadata": {"namespace": "ns", "name": "web"},
            "spec": {"ports": [{"port": 80}]}}),
        );
        let t = "2026-01-01T00:00:00Z";
        let ingress = |name: &str, host: &str, path: &str, kind: &str| {
            json!({"metadata": {"namespace": "ns", "name": name, "creationTimestamp": t},
                "spec": {"rules": [{"host": host, "http": {"paths": [{"path": path, "pathType": kind,
                    "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}})
        };
        apply(
            "ingresses",
            ingress("wild", "*.shop.example", "/", "Prefix"),
        );
        apply("ingresses", ingress("any", "", "/x", "Exact"));
        let route = |name: &str, created: &str, spec: Json| {
            json!({"metadata": {"namespace": "ns", "name": name, "creationTimestamp": created},
                "spec": spec})
        };
        // The same time: the kind decides, HTTPRoute first.
        apply(
            "httproutes",
            route(
                "tie",
                t,
                json!({"parentRefs": [{"name": "gw"}], "hostnames": ["*.shop.example"],
                "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]}),
            ),
        );
        // Younger than the host-less Ingress path: its match is left out.
        apply(
            "httproutes",
            route(
                "young",
                "2026-06-01T00:00:00Z",
                json!({"parentRefs": [{"name": "gw"}],
                "rules": [{"matches": [{"path": {"type": "Exact", "value": "/x"}}],
                    "backendRefs": [{"name": "web", "port": 80}]}]}),
            ),
        );
        let view = stores.derived_json("gateway").unwrap();
        let events: Vec<(String, String)> = view["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    format!(
                        "{}/{}",
                        e["store"].as_str().unwrap(),
                        e["name"].as_str().unwrap()
                    ),
                    e["message"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        // On both ports of the Ingress frontend, each on its own.
        let mut expected = Vec::new();
        for port in [80, 443] {
            expected.push((
                "httproutes/young".to_owned(),
                format!("host * path /x (Exact) on port {port} is served by the older Ingress ns/any: this match is not routed there"),
            ));
        }
        for port in [80, 443] {
            expected.push((
                "ingresses/wild".to_owned(),
                format!("host *.shop.example path / (Prefix) is served on port {port} by the older HTTPRoute ns/tie: this path is not routed there"),
            ));
        }
        assert_eq!(events, expected);
        // The tie's match stays, the young one's is gone, on both ports: both are plain (one
        // backend, no filter, no condition), so map entries, and no line of haproxy.cfg.
        let keys = |view: &Json, map: &str| -> Vec<String> {
            view[map]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| format!("{} {} {}", e["key"], e["rank"], e["backend"]).replace('"', ""))
                .collect()
        };
        let any_exact_x = super::rank(&Host::Any, &super::PathMatch::Exact("/x".into()));
        let wild_root = super::rank(
            &Host::Wildcard(".shop.example".into()),
            &super::PathMatch::Prefix(String::new()),
        );
        assert_eq!(
            keys(&view, "map_prefix"),
            [
                format!("80/*/*.shop.example/ {wild_root} gw_ns_web_80"),
                format!("443/*/*.shop.example/ {wild_root} gw_ns_web_80")
            ]
        );
        assert!(keys(&view, "map_exact").is_empty());
        for f in 0..2 {
            assert_eq!(view["frontends"][f]["matches"], json!([]));
            assert_eq!(view["frontends"][f]["actions"], json!([]));
        }

        // Without the Ingresses, no conflict: both matches.
        for name in ["wild", "any"] {
            stores.get_mut("ingresses").unwrap().remove("ns", name);
        }
        let view = stores.derived_json("gateway").unwrap();
        assert_eq!(view["events"], json!([]));
        assert_eq!(keys(&view, "map_prefix").len(), 2);
        assert_eq!(
            keys(&view, "map_exact"),
            [
                format!("80/*/*/x {any_exact_x} gw_ns_web_80"),
                format!("443/*/*/x {any_exact_x} gw_ns_web_80")
            ]
        );
    }

    #[test]
    fn ranks_order_as_the_spec_orders_host_and_path() {
        use super::{PathMatch, rank};
        let h = |s: &str| Host::parse(s).unwrap_or(Host::Any);
        // Most specific first.
        let order = [
            rank(&h("a.example.com"), &PathMatch::Prefix(String::new())),
            rank(&h("a.example.com"), &PathMatch::Regex("/.*".into())),
            rank(&h("*.b.example.com"), &PathMatch::Exact("/".into())),
            rank(&h("*.example.com"), &PathMatch::Exact("/long/path".into())),
            rank(&h("*.example.com"), &PathMatch::Exact("/".into())),
            rank(&h("*.example.com"), &PathMatch::Prefix("/long".into())),
            rank(&h("*.example.com"), &PathMatch::Prefix(String::new())),
            rank(&h("*.example.com"), &PathMatch::Regex("/.*".into())),
            rank(&Host::Any, &PathMatch::Exact("/x".into())),
            rank(&Host::Any, &PathMatch::Prefix("/foo".into())),
            rank(&Host::Any, &PathMatch::Prefix(String::new())),
            rank(&Host::Any, &PathMatch::Regex("/.*".into())),
        ];
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        // A regular expression comes after every path a map entry of its host can have, and
        // before every one of a less specific host (a host one character shorter: the next
        // host rank).
        let regex = rank(&h("a.example.com"), &PathMatch::Regex("/x".into()));
        let shorter = h("xexample.com");
        assert!(
            rank(
                &shorter,
                &PathMatch::Exact("/".repeat(super::MAP_PATH_LIMIT))
            ) > regex
        );
        // The same class and length: the same rank (a request matches one of them only).
        assert_eq!(
            rank(&h("a.com"), &PathMatch::Prefix("/ab".into())),
            rank(&h("b.com"), &PathMatch::Prefix("/cd".into()))
        );
    }

    #[test]
    fn matches_sort_as_the_spec_tuple_orders_them() {
        use super::{MatchRow, PathMatch, ValueMatch, canonical_time};
        let h = |s: &str| Host::parse(s).unwrap_or(Host::Any);
        let hosts = [
            h("a.example.com"),
            h("ab.example.com"),
            h("*.example.com"),
            Host::Any,
        ];
        let paths = [
            PathMatch::Exact("/x".into()),
            PathMatch::Exact("/long".into()),
            PathMatch::Prefix(String::new()),
            PathMatch::Prefix("/ab".into()),
            PathMatch::Regex("/.*".into()),
        ];
        let ages = [
            "2026-01-01T00:00:00Z",
            "2026-01-01T00:00:01Z",
            "2025-12-31T23:59:59Z",
            "",
            "2026-01-01T00:00:00.5Z",
        ];
        let header = |n: usize| vec![("x".to_owned(), ValueMatch::Exact("1".into())); n];
        let mut rows = Vec::new();
        for (i, host) in hosts.iter().enumerate() {
            for path in &paths {
                for age in ages {
                    for (method, headers, queries) in [
                        (None, 0, 0),
                        (Some("GET".to_owned()), 0, 0),
                        (None, 2, 0),
                        (None, 0, 1),
                    ] {
                        let mut row = MatchRow {
                            host: host.clone(),
                            listener: Host::Any,
                            path: path.clone(),
                            method,
                            headers: header(headers),
                            queries: header(queries),
                            age: (age.to_owned(), format!("ns-{}", i % 2), "r".to_owned()),
                            rank: 0,
                            created: canonical_time(age),
                            rule: i % 3,
                            index: 0,
                            action: 0,
                            backend: None,
                            origin: (String::new(), String::new()),
                        };
                        row.rank = row.rank_key();
                        rows.push(row);
                    }
                }
            }
        }
        // The spec's order written out as a tuple, compared field by field.
        let tuple = |m: &MatchRow| {
            (
                m.host.rank(),
                m.path.rank(),
                m.method.is_none(),
                std::cmp::Reverse(m.headers.len()),
                std::cmp::Reverse(m.queries.len()),
                m.age.clone(),
                m.rule,
                m.index,
            )
        };
        for a in &rows {
            for b in &rows {
                assert_eq!(
                    a.order(b),
                    tuple(a).cmp(&tuple(b)),
                    "{:?} {:?}",
                    a.age,
                    b.age
                );
            }
        }
        assert_eq!(
            canonical_time("2026-01-02T03:04:05Z"),
            Some(20_260_102_030_405)
        );
        assert_eq!(canonical_time("2026-01-02 03:04:05Z"), None);
        assert_eq!(canonical_time("2026-01-02T03:04:0xZ"), None);
    }

    #[test]
    fn rfc3339_formats_unix_times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_764_650_000), "2025-12-02T04:33:20Z");
    }

    #[test]
    fn hostnames_intersect_as_the_spec_says() {
        let h = |s: &str| Host::parse(s).unwrap_or(Host::Any);
        assert_eq!(
            intersect(&h("*.wildcard.io"), &[h("foo.bar.wildcard.io")]),
            vec![h("foo.bar.wildcard.io")]
        );
        assert_eq!(
            intersect(&h("very.specific.com"), &[h("*.specific.com")]),
            vec![h("very.specific.com")]
        );
        assert!(intersect(&h("very.specific.com"), &[h("other.com")]).is_empty());
        assert_eq!(intersect(&h(""), &[]), vec![Host::Any]);
        assert_eq!(
            intersect(&h("*.anotherwildcard.io"), &[h("*.anotherwildcard.io")]),
            vec![h("*.anotherwildcard.io")]
        );
    }
}
