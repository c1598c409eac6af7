//! Server slots: a fixed number of `server` lines per backend, each endpoint in a slot of its
//! own, so that an endpoint change only changes what a slot holds (its address, port or
//! state), which the agent applies through HAProxy's runtime API without a reload.
//!
//! The assignment is a pure function of a backend's endpoints, so the same resources give
//! the same slots on every render, on every controller replica and after a leader change,
//! with nothing read back from HAProxy:
//!
//! - a backend has `slots` slots (the configured number, 10 by default), or the next
//!   multiple of it when it has more endpoints than that;
//! - each endpoint (`address:port`) prefers slot `fnv1a(endpoint) mod slots` and takes the
//!   first free slot from there (linear probing), endpoints taken in order of their
//!   preferred slot, then of their text;
//! - an endpoint that is not ready keeps its slot, `disabled`; an unused slot is `disabled`
//!   with the placeholder address [`PLACEHOLDER`].
//!
//! So an endpoint keeps its slot while it exists, unless it had been pushed along by a
//! collision and the endpoint it collided with goes away (or a new endpoint collides ahead
//! of it); it then moves within the backend, which is still a runtime change. When a
//! backend outgrows its slots, the slot count grows by a step and the slots are assigned
//! afresh: the new `server` lines are HAProxy's dynamic servers (`add server`), the others
//! change what they hold, all at run time (and the lines of a shrink are deleted).
//!
//! ```
//! use haptic_render::slots::{assign, Endpoint};
//!
//! let endpoints = [
//!     Endpoint { endpoint: "10.0.0.1:8080", ready: true },
//!     Endpoint { endpoint: "10.0.0.2:8080", ready: false },
//! ];
//! let slots = assign(&endpoints, 10);
//! assert_eq!(slots.len(), 10);
//! assert_eq!(slots.iter().filter(|s| s.enabled).count(), 1);
//! // The same endpoints, in another order: the same slots.
//! let reversed = [endpoints[1], endpoints[0]];
//! assert_eq!(assign(&reversed, 10), slots);
//! ```

use tera::{Kwargs, State, Tera, Value};

use crate::value::map_value;

/// Slots per backend when the template does not say (`extraContext.haproxy.server_slots`).
pub const DEFAULT_SLOTS: usize = 10;

/// The most slots a backend gets, whatever its endpoints: a bound on the config's size.
pub const MAX_SLOTS: usize = 10_000;

/// The address of a slot that holds no endpoint (always `disabled`).
pub const PLACEHOLDER: &str = "127.0.0.1:1";

/// One endpoint of a backend, as the slot assignment reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint<'a> {
    /// `address:port` (`[v6]:port` for IPv6), as a `server` line names it.
    pub endpoint: &'a str,
    /// Whether the endpoint takes traffic (`disabled` otherwise).
    pub ready: bool,
}

/// One slot of a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// 1-based slot number; the `server` line is named `s<slot>`.
    pub slot: usize,
    /// The endpoint it holds, or [`PLACEHOLDER`].
    pub endpoint: String,
    /// Whether the server takes traffic: it holds a ready endpoint.
    pub enabled: bool,
}

/// How many slots a backend with `endpoints` endpoints gets: `per_backend` (at least 1), or
/// the next multiple of it that holds them all, at most [`MAX_SLOTS`].
pub fn slot_count(endpoints: usize, per_backend: usize) -> usize {
    let step = per_backend.clamp(1, MAX_SLOTS);
    endpoints
        .div_ceil(step)
        .max(1)
        .saturating_mul(step)
        .min(MAX_SLOTS)
}

/// FNV-1a, 64 bits: a hash fixed by its definition (the standard library's is not
/// guaranteed across releases), so every replica and every version prefers the same slot.
pub(crate) fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Assigns `endpoints` to slots (see the module docs). An endpoint listed twice (in two
/// slices) takes one slot, ready if either listing is; endpoints beyond [`MAX_SLOTS`] are
/// left out.
pub fn assign(endpoints: &[Endpoint<'_>], per_backend: usize) -> Vec<Slot> {
    held_slots(endpoints, per_backend)
        .into_iter()
        .enumerate()
        .map(|(index, held)| Slot {
            slot: index + 1,
            endpoint: held.map_or(PLACEHOLDER, |e| e.endpoint).to_owned(),
            enabled: held.is_some_and(|e| e.ready),
        })
        .collect()
}

/// [`assign`] without a `String` per slot: what each slot holds, in slot order.
fn held_slots<'a>(endpoints: &[Endpoint<'a>], per_backend: usize) -> Vec<Option<Endpoint<'a>>> {
    let mut unique: Vec<Endpoint<'a>> = endpoints.to_vec();
    unique.sort_unstable_by(|a, b| a.endpoint.cmp(b.endpoint).then(b.ready.cmp(&a.ready)));
    // Sorted by text, a ready listing first: the first of equal endpoints says whether it is
    // ready in either listing.
    unique.dedup_by(|later, first| later.endpoint == first.endpoint);
    let count = slot_count(unique.len(), per_backend);
    unique.truncate(count);
    let modulus = u64::try_from(count).unwrap_or(u64::MAX);
    let mut preferred: Vec<(usize, Endpoint<'a>)> = unique
        .into_iter()
        .map(|e| {
            let slot = usize::try_from(fnv1a(e.endpoint) % modulus).unwrap_or(0);
            (slot, e)
        })
        .collect();
    preferred.sort_unstable_by(|(a, x), (b, y)| a.cmp(b).then(x.endpoint.cmp(y.endpoint)));
    let mut slots: Vec<Option<Endpoint<'a>>> = vec![None; count];
    for (first, endpoint) in preferred {
        // There are at least as many slots as endpoints: a free one exists.
        if let Some(free) = (0..count)
            .map(|i| (first + i) % count)
            .find(|&i| slots[i].is_none())
        {
            slots[free] = Some(endpoint);
        }
    }
    slots
}

/// The `server` lines of a backend's slots, one per slot, each on a line of its own after a
/// newline: `\n    server s<slot> <endpoint><options>[ disabled][ check][ cookie s<slot>]`.
/// What `{% for s in endpoints | server_slots(slots=n) %}` with such a line per slot writes,
/// without running the engine once per slot (at 10,000 Ingresses, 125,000 slots, that loop
/// was about a third of a full render's CPU). `options` goes on every line as it is (the template builds it from
/// checked values: `ssl verify none`, `proto h2`, ...).
pub fn server_lines(
    endpoints: &[Endpoint<'_>],
    per_backend: usize,
    options: &str,
    check: bool,
    cookie: bool,
) -> String {
    let slots = held_slots(endpoints, per_backend);
    let mut out = String::with_capacity(slots.len() * (48 + options.len()));
    for (index, held) in slots.iter().enumerate() {
        out.push_str("\n    server s");
        push_number(&mut out, index + 1);
        out.push(' ');
        out.push_str(held.map_or(PLACEHOLDER, |e| e.endpoint));
        out.push_str(options);
        if !held.is_some_and(|e| e.ready) {
            out.push_str(" disabled");
        }
        if check {
            out.push_str(" check");
        }
        if cookie {
            out.push_str(" cookie s");
            push_number(&mut out, index + 1);
        }
    }
    out
}

/// Appends `n` in decimal (without the formatting machinery: this runs per server line).
fn push_number(out: &mut String, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + u8::try_from(n % 10).unwrap_or(0);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend(digits[start..].iter().map(|&d| char::from(d)));
}

/// The endpoint rows of a template value: `endpoint` and `ready` (ready unless it says false).
/// Rows that are not maps or have no `endpoint` text are left out. The fields are found by a
/// scan of the row (a few keys: cheaper than hashing the name, this runs per backend).
fn endpoint_rows(rows: &[Value]) -> Vec<Endpoint<'_>> {
    rows.iter()
        .filter_map(|row| {
            let (mut endpoint, mut ready) = (None, true);
            for (key, value) in row.as_map()? {
                match key.as_str() {
                    Some("endpoint") => endpoint = value.as_str(),
                    Some("ready") => ready = value.as_bool().unwrap_or(true),
                    _ => {}
                }
            }
            Some(Endpoint {
                endpoint: endpoint?,
                ready,
            })
        })
        .collect()
}

/// What the config says of server slots (`extraContext.haproxy`): `server_slots` and
/// `health_checks`, found by a scan of that map, each `None` when it does not say.
fn configured(state: &State) -> (Option<Value>, Option<Value>) {
    let haproxy: Option<Value> = state.get("haproxy").ok().flatten();
    let (mut slots, mut checks) = (None, None);
    for (key, value) in haproxy
        .as_ref()
        .and_then(Value::as_map)
        .into_iter()
        .flatten()
    {
        match key.as_str() {
            Some("server_slots") => slots = Some(value.clone()),
            Some("health_checks") => checks = Some(value.clone()),
            _ => {}
        }
    }
    let said = |v: Option<Value>| v.filter(|v| !v.is_undefined() && !v.is_none());
    (said(slots), said(checks))
}

/// The `slots` argument of both filters: as given, else `haproxy.server_slots` of the
/// config, else [`DEFAULT_SLOTS`].
fn per_backend(
    kwargs: &Kwargs,
    configured: Option<&Value>,
    filter: &str,
) -> tera::TeraResult<usize> {
    let given: Option<i64> = kwargs.get("slots")?;
    let per_backend = match (given, configured) {
        (Some(n), _) => Some(n),
        (None, Some(value)) => Some(value.as_i64().ok_or_else(|| {
            tera::Error::message(format!(
                "{filter}: haproxy.server_slots must be a number, got {}",
                value.name()
            ))
        })?),
        (None, None) => None,
    };
    match per_backend {
        None => Ok(DEFAULT_SLOTS),
        Some(n) if n >= 1 => Ok(usize::try_from(n).unwrap_or(MAX_SLOTS)),
        Some(n) => Err(tera::Error::message(format!(
            "{filter}: `slots` must be at least 1, got {n}"
        ))),
    }
}

/// Registers the `server_slots` filter:
/// `{% for s in b.endpoints | server_slots(slots=haproxy.server_slots) %}` over rows with
/// `endpoint` and `ready` (the rows of `derived` backends), giving `{slot, name, endpoint,
/// enabled}` per slot. And the `server_lines` filter:
/// `{{ b.endpoints | server_lines(slots=n, options=" ssl verify none", check=true,
/// cookie=false) }}` writes those slots' `server` lines ([`server_lines`]). What is not given
/// is what the config says: `slots` is `extraContext.haproxy.server_slots` (else
/// [`DEFAULT_SLOTS`]), `check` is `haproxy.health_checks` (else true), `options` none,
/// `cookie` false. So the common call, `{{ b.endpoints | server_lines }}`, builds no
/// arguments map: tera builds one per call with arguments, and at 10,000 backends a render
/// that cost more than the lines.
pub(crate) fn register(tera: &mut Tera) {
    tera.register_filter(
        "server_slots",
        |rows: &[Value], kwargs: Kwargs, state: &State| -> tera::TeraResult<Vec<Value>> {
            let (slots, _) = configured(state);
            let per_backend = per_backend(&kwargs, slots.as_ref(), "server_slots")?;
            Ok(assign(&endpoint_rows(rows), per_backend)
                .into_iter()
                .map(|slot| {
                    map_value([
                        ("slot", Value::from(slot.slot)),
                        ("name", Value::from(format!("s{}", slot.slot))),
                        ("endpoint", Value::from(slot.endpoint)),
                        ("enabled", Value::from(slot.enabled)),
                    ])
                })
                .collect())
        },
    );
    tera.register_filter(
        "server_lines",
        |rows: &[Value], kwargs: Kwargs, state: &State| -> tera::TeraResult<String> {
            let (slots, checks) = configured(state);
            let per_backend = per_backend(&kwargs, slots.as_ref(), "server_lines")?;
            let options: Option<String> = kwargs.get("options")?;
            // Truthy as the template's `{% if %}` would read them (a missing cookie is none).
            let check: Option<Value> = kwargs.get("check")?;
            let cookie: Option<Value> = kwargs.get("cookie")?;
            Ok(server_lines(
                &endpoint_rows(rows),
                per_backend,
                options.as_deref().unwrap_or(""),
                check.or(checks).is_none_or(|v| v.is_truthy()),
                cookie.is_some_and(|v| v.is_truthy()),
            ))
        },
    );
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn endpoints(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("10.1.{}.{}:8080", i / 250, i % 250))
            .collect()
    }

    fn slot_of(slots: &[Slot], endpoint: &str) -> Option<usize> {
        slots
            .iter()
            .find(|s| s.endpoint == endpoint)
            .map(|s| s.slot)
    }

    #[test]
    fn the_filters_take_what_is_not_given_from_the_config() {
        let mut tera = Tera::new();
        register(&mut tera);
        let render = |haproxy: Option<Value>, source: &str| {
            let mut context = tera::Context::new();
            context.insert_value(
                "eps",
                Value::from(vec![map_value([
                    ("endpoint", Value::from("10.0.0.1:80")),
                    ("ready", Value::from(true)),
                ])]),
            );
            if let Some(haproxy) = haproxy {
                context.insert_value("haproxy", haproxy);
            }
            tera.render_str(source, &context, false)
        };
        let lines = "{{ eps | server_lines }}";
        // No config: 10 slots, checked.
        let plain = render(None, lines).unwrap();
        assert_eq!(plain.matches("\n    server s").count(), DEFAULT_SLOTS);
        assert_eq!(plain.matches(" check").count(), DEFAULT_SLOTS);
        // The config's slots and checks, unless the call says otherwise.
        let config = map_value([
            ("server_slots", Value::from(3)),
            ("health_checks", Value::from(false)),
        ]);
        let configured = render(Some(config.clone()), lines).unwrap();
        assert_eq!(configured.matches("\n    server s").count(), 3);
        assert!(!configured.contains(" check"), "{configured}");
        let given = render(
            Some(config.clone()),
            "{{ eps | server_lines(slots=2, check=true) }}",
        )
        .unwrap();
        assert_eq!(given.matches(" check").count(), 2);
        let slots = render(Some(config), "{{ eps | server_slots | length }}").unwrap();
        assert_eq!(slots, "3");
        let wrong = map_value([("server_slots", Value::from("ten"))]);
        let err = render(Some(wrong), lines).unwrap_err();
        assert!(
            format!("{err:?}").contains("haproxy.server_slots must be a number"),
            "{err:?}"
        );
    }

    #[test]
    fn server_lines_write_each_slot_as_the_loop_would() {
        let endpoints = [
            Endpoint {
                endpoint: "10.0.0.1:8080",
                ready: true,
            },
            Endpoint {
                endpoint: "10.0.0.2:8080",
                ready: false,
            },
        ];
        let slots = assign(&endpoints, 3);
        let expected: String = slots
            .iter()
            .map(|s| {
                format!(
                    "\n    server s{n} {e} ssl verify none{d} check cookie s{n}",
                    n = s.slot,
                    e = s.endpoint,
                    d = if s.enabled { "" } else { " disabled" }
                )
            })
            .collect();
        assert_eq!(
            server_lines(&endpoints, 3, " ssl verify none", true, true),
            expected
        );
        let plain = server_lines(&endpoints, 3, "", false, false);
        assert_eq!(plain.lines().filter(|l| !l.is_empty()).count(), 3);
        let first = slot_of(&slots, "10.0.0.1:8080").unwrap_or(0);
        assert!(
            plain
                .split('\n')
                .any(|l| l == format!("    server s{first} 10.0.0.1:8080")),
            "{plain}"
        );
        assert_eq!(plain.matches(" disabled").count(), 2, "{plain}");
        assert!(!plain.contains("check") && !plain.contains("cookie"));
    }

    #[test]
    fn slots_grow_in_steps_and_every_endpoint_has_one() {
        assert_eq!(slot_count(0, 10), 10);
        assert_eq!(slot_count(10, 10), 10);
        assert_eq!(slot_count(11, 10), 20);
        assert_eq!(slot_count(5, 0), 5);
        assert_eq!(slot_count(usize::MAX, 10), MAX_SLOTS);
        let names = endpoints(23);
        let input: Vec<Endpoint<'_>> = names
            .iter()
            .map(|e| Endpoint {
                endpoint: e,
                ready: true,
            })
            .collect();
        let slots = assign(&input, 10);
        assert_eq!(slots.len(), 30);
        for name in &names {
            assert!(slot_of(&slots, name).is_some(), "{name} has no slot");
        }
        let unused: Vec<&Slot> = slots.iter().filter(|s| s.endpoint == PLACEHOLDER).collect();
        assert_eq!(unused.len(), 7);
        assert!(unused.iter().all(|s| !s.enabled));
    }

    #[test]
    fn an_endpoint_keeps_its_slot_while_others_come_and_go_without_colliding() {
        let names = endpoints(40);
        let all: Vec<Endpoint<'_>> = names
            .iter()
            .map(|e| Endpoint {
                endpoint: e,
                ready: true,
            })
            .collect();
        // Within one slot count, removing an endpoint moves only endpoints that had probed
        // past its slot; in a sparse backend (3 of 10) that is rare, and the rest stay.
        let mut moved = 0;
        let mut kept = 0;
        for window in all.windows(4) {
            let before = assign(&window[..3], 10);
            let after = assign(&window[1..4], 10);
            for e in &window[1..3] {
                if slot_of(&before, e.endpoint) == slot_of(&after, e.endpoint) {
                    kept += 1;
                } else {
                    moved += 1;
                }
            }
        }
        assert!(kept > moved * 3, "kept {kept}, moved {moved}");
    }

    #[test]
    fn not_ready_endpoints_keep_their_slot_disabled_and_duplicates_take_one() {
        let ready = [
            Endpoint {
                endpoint: "10.0.0.1:80",
                ready: true,
            },
            Endpoint {
                endpoint: "10.0.0.2:80",
                ready: true,
            },
        ];
        let flipped = [
            Endpoint {
                endpoint: "10.0.0.1:80",
                ready: true,
            },
            Endpoint {
                endpoint: "10.0.0.2:80",
                ready: false,
            },
            Endpoint {
                endpoint: "10.0.0.2:80",
                ready: false,
            },
        ];
        let (a, b) = (assign(&ready, 10), assign(&flipped, 10));
        assert_eq!(slot_of(&a, "10.0.0.2:80"), slot_of(&b, "10.0.0.2:80"));
        assert_eq!(b.iter().filter(|s| s.endpoint == "10.0.0.2:80").count(), 1);
        assert!(!b.iter().any(|s| s.endpoint == "10.0.0.2:80" && s.enabled));
    }
}
