//! Per-row fragments: `render_each(rows=..., template=..., args=...)` renders a snippet once per
//! row and keeps each row's output, so that the next render reuses it while the row is the
//! same (render proportional to the change).
//!
//! A loop over ten thousand rows in a template re-runs the engine for every row on every
//! render, although after one watch event one or two rows differ. `render_each` runs the loop
//! in Rust instead: for each row it renders the snippet `template` with a context of its own
//! (`row`, `args` and the `extraContext` keys; `get` and `lookup` work, `resources` and
//! `derived` are not there), or takes the output that row gave last time. A fragment is a
//! function of:
//!
//! - the row: the same row *value* (derived views keep the rows of resources whose joins did
//!   not change, so an unchanged resource's row is the very same value; its identity is the
//!   key, and the cache holds the row so that identity cannot be reused by another value);
//! - `args` (compared by their text) and the template;
//! - what the snippet read with `get` / `lookup` (each read is recorded with the identity of
//!   what it found and checked again before a fragment is reused);
//! - `refuse()`: a fragment that called it is not reused in an overlay render (whose answer
//!   depends on the resource under review).
//!
//! What the snippet asked for (`record_event`, `set_status`) and the provenance marks it made
//! (`from`) are kept with its bytes and replayed where it is reused, so a render gives the same
//! bytes, [`Requests`] and provenance whether its fragments were rendered or reused
//! (`tests/incremental.rs` checks this against fresh renders over random changes).
//!
//! `render_each` must be written as `{{ render_each(...) }}` on its own, not piped through a
//! filter or captured: its provenance marks are placed where its output is written.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tera::{Context, Kwargs, State, Tera, Value};

use crate::functions::{DERIVED_VAR, GET_VAR, INDEX_VAR, REVIEW_VAR};
use crate::provenance;
use crate::requests::{self, KeyedStatus, Requests};

/// One read of a store by `get` / `lookup` inside a fragment, and what it found.
#[derive(Debug, Clone)]
pub(crate) struct Read {
    /// `GET_VAR`, `INDEX_VAR` or `DERIVED_VAR`.
    var: &'static str,
    store: String,
    key: String,
    /// What was found (kept, so that its identity stays its own); none when nothing was.
    found: Option<Value>,
    /// For a read of a derived view's entry: where the view was among the views, and the
    /// entry in the view, looked at first when the read is checked again (2,500 certificate
    /// files' reads hashed twice each cost half a millisecond of every render).
    places: Option<(usize, usize)>,
}

/// Hashes an [`identity`] (an address) with one multiplication: SipHash, the standard map's,
/// cost more than the rest of a row's bookkeeping; an address is not attacker-chosen.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        // Fibonacci hashing: the high bits, which the table uses, depend on every bit of n.
        self.0 = (self.0 ^ n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u64(&mut self, n: u64) {
        // As an address (a status key's hash, keyed already, is one word too).
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

#[cfg(test)]
thread_local! {
    /// Rows a call site's index put in on this thread, one by one (the tests count them).
    pub(crate) static INDEXED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How wide a call site's slack may grow ([`CallSite::slack`]) before its index is made
/// afresh: each lookup of a row not found in order probes this many places at most.
const MAX_SLACK: i64 = 16;

/// Row identities to places, hashed by [`AddressHasher`].
type IdentityMap = Places<u32>;

/// Row identities (addresses) to places, made for being copied from one render to the next
/// with a few rows put in: a shared base and the entries put in since. A copy shares the base
/// and copies the few entries; [`Places::seal`] folds them into a base of its own once they
/// are more than an eighth of it. At 10,000 rows a whole copy was a fresh 435 KiB block per
/// `render_each` call and `where_any` answer after one event, all of it page faults under
/// the Deployment's `MIMALLOC_PURGE_DELAY=0`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Places<V> {
    base: Arc<PlainPlaces<V>>,
    added: PlainPlaces<V>,
}

type PlainPlaces<V> = HashMap<usize, V, std::hash::BuildHasherDefault<AddressHasher>>;

impl<V: Copy> Places<V> {
    /// The place of `id` (the latest put in).
    pub(crate) fn get(&self, id: &usize) -> Option<&V> {
        self.added.get(id).or_else(|| self.base.get(id))
    }

    /// Puts `id` in at `place`.
    pub(crate) fn insert(&mut self, id: usize, place: V) {
        self.added.insert(id, place);
    }

    /// How many entries it holds (a row put in again over its base entry counts twice).
    pub(crate) fn len(&self) -> usize {
        self.base.len() + self.added.len()
    }

    /// Empty, with room for `capacity` entries put in.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            base: Arc::default(),
            added: PlainPlaces::with_capacity_and_hasher(capacity, Default::default()),
        }
    }

    /// Forgets every entry.
    pub(crate) fn clear(&mut self) {
        self.base = Arc::default();
        self.added.clear();
    }

    /// Folds the entries put in into the base once they are more than an eighth of it (a
    /// base of its own: moved when it had none, else copied), so that copies of this share
    /// the most and copy little.
    pub(crate) fn seal(&mut self) {
        if self.added.len() <= self.base.len() / 8 {
            return;
        }
        if self.base.is_empty() {
            self.base = Arc::new(std::mem::take(&mut self.added));
            return;
        }
        let base = Arc::make_mut(&mut self.base);
        base.extend(self.added.drain());
    }
}

/// The identity of a value shared by reference (a map or a list): the address of its
/// contents, the same for every clone of the value and not another value's while this one is
/// held. Scalars have none.
pub(crate) fn identity(value: &Value) -> Option<usize> {
    if let Some(map) = value.as_map() {
        return Some(std::ptr::from_ref(map) as usize);
    }
    value.as_array().map(|list| list.as_ptr() as usize)
}

/// Whether two values render the same in every template: equal contents of the same kinds,
/// maps in the same order (tera's own `==` takes `1` and `1.0` for equal, and maps as sets).
fn identical(a: &Value, b: &Value) -> bool {
    if let (Some(x), Some(y)) = (identity(a), identity(b))
        && x == y
    {
        return true;
    }
    if a.kind() != b.kind() {
        return false;
    }
    if let (Some(a), Some(b)) = (a.as_map(), b.as_map()) {
        return a.len() == b.len()
            && a.iter()
                .zip(b.iter())
                .all(|((ka, va), (kb, vb))| ka == kb && identical(va, vb));
    }
    if let (Some(a), Some(b)) = (a.as_array(), b.as_array()) {
        return a.len() == b.len() && a.iter().zip(b).all(|(x, y)| identical(x, y));
    }
    if let (Some(x), Some(y)) = (a.as_f64(), b.as_f64())
        && a.kind() == tera::value::ValueKind::F64
    {
        return x.to_bits() == y.to_bits();
    }
    a == b
}

fn same(a: Option<&Value>, b: Option<&Value>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => match (identity(a), identity(b)) {
            (Some(x), Some(y)) => x == y,
            (None, None) => identical(a, b),
            _ => false,
        },
        _ => false,
    }
}

/// The output of one `render_each` call (a call site: template and args), row by row, laid
/// out flat so that reusing a run of rows copies contiguous bytes: what the next call with the
/// same template and args reuses.
#[derive(Debug)]
pub(crate) struct CallSite {
    /// The rows list, kept (with every row in it) so that the identities of the list and of
    /// its rows are not reused by other values while this lives.
    rows: Value,
    /// The identity of the rows list itself (the whole call is reused when it is the same).
    list: Option<usize>,
    /// Row identity -> its place in `rows`, give or take [`CallSite::slack`] (rows without an
    /// identity are not indexed). The previous call's index, copied, with the rows put in
    /// that it does not find within the slack (a list that kept its order, a few rows added
    /// or taken out, changes a few entries, not every one after the change), so it may also
    /// name rows this call no longer has: [`CallSite::place_of`] checks the row found.
    index: IdentityMap,
    /// How far a row may be from its place in `index`: at least `slack.0` and at most
    /// `slack.1` places after it (a row added before others moves them one place on, and
    /// their entries are left as they were).
    slack: (i64, i64),
    /// Every row's bytes, one after the other, as the text value the call returned (the
    /// engine writes text, and each row's ends where a write ended, so the value is made
    /// without validating it again). The very value is returned again when the whole call is
    /// reused: the engine copies any text it is given into a value of its own, and a call's
    /// text is most of a big file (the pool's backends in `haproxy.cfg`: 7 MB at 10,000).
    text: Value,
    /// Row `i`'s bytes are `bytes[ends[i - 1]..ends[i]]`.
    ends: Vec<usize>,
    /// Provenance marks (offset in the call's output), with the row each belongs to, in
    /// order: shared as they are with every output that renders or reuses the call (10,000
    /// marks at 10,000 Services were copied into a second form per call before).
    marks: Arc<[(u32, usize, Value)]>,
    /// What rows asked for (few rows ask anything), by row, in order.
    requests: Vec<(u32, Requests)>,
    /// What rows read with `get` / `lookup`, by row, in order.
    reads: Vec<(u32, Read)>,
    /// Rows whose snippet called `refuse()`.
    refused: Vec<u32>,
    /// The render that last used it.
    used: AtomicU64,
}

impl CallSite {
    /// The place of the row whose identity is `id`.
    fn place_of(&self, id: usize) -> Option<u32> {
        let indexed = i64::from(*self.index.get(&id)?);
        let rows = self.rows.as_array()?;
        (self.slack.0..=self.slack.1).find_map(|shift| {
            let place = u32::try_from(indexed + shift).ok()?;
            // The call holds its rows, so an identity among them is that row's alone.
            (identity(rows.get(place as usize)?) == Some(id)).then_some(place)
        })
    }

    /// Every row's bytes, one after the other.
    fn bytes(&self) -> &str {
        self.text.as_str().unwrap_or_default()
    }

    fn span(&self, i: usize) -> std::ops::Range<usize> {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        start..self.ends[i]
    }

    /// Where the entries of the rows `rows` are in `list` (sorted by row): from where the
    /// run's first row's start ([`Self::row_range`], looked for first at `hint`) to the first
    /// entry of a row after the run.
    fn run_range<T>(
        list: &[T],
        row: impl Fn(&T) -> u32 + Copy,
        rows: &std::ops::Range<u32>,
        hint: usize,
    ) -> std::ops::Range<usize> {
        let from = Self::row_range(list, row, rows.start, hint).start;
        let to = from
            + list
                .get(from..)
                .unwrap_or_default()
                .partition_point(|e| row(e) < rows.end);
        from..to
    }

    /// Where row `i`'s entries are in `list` (sorted by row), looked for first at `hint`:
    /// where the previous row's ended, when the rows are walked in order (a list that kept its
    /// order reuses its rows one after the other), so that most rows need no search. Any hint
    /// gives the right range.
    fn row_range<T>(
        list: &[T],
        row: impl Fn(&T) -> u32,
        i: u32,
        hint: usize,
    ) -> std::ops::Range<usize> {
        let at_hint = hint <= list.len()
            && (hint == 0 || list.get(hint - 1).is_some_and(|e| row(e) < i))
            && list.get(hint).is_none_or(|e| row(e) >= i);
        let from = if at_hint {
            hint
        } else {
            list.partition_point(|e| row(e) < i)
        };
        let to = from
            + list
                .get(from..)
                .unwrap_or_default()
                .iter()
                .take_while(|e| row(e) == i)
                .count();
        from..to
    }

    /// The entries of `list` (sorted by row) that belong to row `i`.
    fn of_row<T>(list: &[(u32, T)], i: u32) -> &[(u32, T)] {
        let from = list.partition_point(|(row, _)| *row < i);
        let to = list.partition_point(|(row, _)| *row <= i);
        &list[from..to]
    }
}

/// How many calls with the same template and args are kept.
const MAX_CALLS_PER_KEY: usize = 8;

/// A call site's key: template and args text.
type SiteKey = (String, String);

/// The `render_each` outputs of one renderer, kept from one render to the next.
#[derive(Debug, Default)]
pub(crate) struct Fragments {
    /// The last few calls with each key (one template and args may be called on several
    /// lists in a render), most recently made first.
    sites: Mutex<HashMap<SiteKey, Vec<Arc<CallSite>>>>,
    /// Counts renders; a call site no render used for a while is dropped.
    epoch: AtomicU64,
    /// Fragments rendered and reused since the last [`Fragments::take_counts`].
    rendered: AtomicU64,
    reused: AtomicU64,
    /// Calls made, and reused whole (the very rows list of a kept call), since then.
    calls: AtomicU64,
    calls_reused: AtomicU64,
    /// Calls and outputs replaced, dropped after the render.
    pub(crate) graveyard: crate::graveyard::Graveyard,
    /// `set_status` values as JSON, by the identity of the template value (held, so that the
    /// identity stays its own), with the last render that used each: a status a view keeps
    /// from render to render (the Gateway API's, one per route) is converted once.
    json: Mutex<HashMap<usize, StatusJson>>,
    /// The bytes a row of each snippet gave on average in its last run of rows (a run's
    /// buffer is made that big at once).
    row_bytes: Mutex<HashMap<String, usize>>,
    /// `set_statuses` rows' requests, by the identity of the row (held, as for `json`), with
    /// the last render that passed each: a row a view keeps from render to render (one per
    /// HTTPRoute) is read, converted and hashed once.
    status_rows: Mutex<HashMap<usize, StatusRow, std::hash::BuildHasherDefault<AddressHasher>>>,
}

/// A `set_status` value held, its JSON, and the last render that passed it.
type StatusJson = (Value, Arc<serde_json::Value>, u64);

/// A `set_statuses` row held, its request, and the last render that passed it.
type StatusRow = (Value, KeyedStatus, u64);

impl Fragments {
    /// Starts a render: its number.
    pub(crate) fn begin(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The bytes a row of `template` gave on average in its last run (0: none yet).
    fn row_bytes(&self, template: &str) -> usize {
        self.row_bytes
            .lock()
            .ok()
            .and_then(|sizes| sizes.get(template).copied())
            .unwrap_or(0)
    }

    /// Notes what a row of `template` gave on average in a run just made.
    fn note_row_bytes(&self, template: &str, per_row: usize) {
        if let Ok(mut sizes) = self.row_bytes.lock() {
            match sizes.get_mut(template) {
                Some(size) => *size = per_row,
                None => {
                    sizes.insert(template.to_owned(), per_row);
                }
            }
        }
    }

    /// Fragments rendered, reused, calls made and calls reused whole, since the last call.
    pub(crate) fn take_counts(&self) -> (u64, u64, u64, u64) {
        (
            self.rendered.swap(0, Ordering::Relaxed),
            self.reused.swap(0, Ordering::Relaxed),
            self.calls.swap(0, Ordering::Relaxed),
            self.calls_reused.swap(0, Ordering::Relaxed),
        )
    }

    /// `value` as JSON, converted once for as long as renders keep passing the same value.
    fn json(&self, value: &Value, epoch: u64) -> Result<Arc<serde_json::Value>, String> {
        let Some(id) = identity(value) else {
            return convert(value);
        };
        if let Ok(mut cache) = self.json.lock()
            && let Some((_, json, used)) = cache.get_mut(&id)
        {
            *used = (*used).max(epoch);
            return Ok(Arc::clone(json));
        }
        let json = convert(value)?;
        if let Ok(mut cache) = self.json.lock() {
            cache.insert(id, (value.clone(), Arc::clone(&json), epoch));
        }
        Ok(json)
    }

    /// The request of each of `rows` (`set_statuses`), as `build` makes it or as it made it
    /// for the same row before; `epoch` is the render's.
    pub(crate) fn status_rows(
        &self,
        rows: &[Value],
        epoch: u64,
        mut build: impl FnMut(&Value) -> tera::TeraResult<KeyedStatus>,
    ) -> tera::TeraResult<Vec<KeyedStatus>> {
        let Ok(mut cache) = self.status_rows.lock() else {
            return rows.iter().map(build).collect();
        };
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            // A row without an identity is no map: `build` says what is wrong with it.
            let Some(id) = identity(row) else {
                out.push(build(row)?);
                continue;
            };
            if let Some((_, request, used)) = cache.get_mut(&id) {
                *used = (*used).max(epoch);
                out.push(request.clone());
                continue;
            }
            let request = build(row)?;
            cache.insert(id, (row.clone(), request.clone(), epoch));
            out.push(request);
        }
        Ok(out)
    }

    /// Ends render `epoch`: of each key's calls, keeps those this render made or used (the
    /// others were on lists that changed since), and drops keys no render used in a while;
    /// drops the JSON of status values and the requests of status rows this render did not
    /// pass.
    pub(crate) fn end(&self, epoch: u64) {
        if let Ok(mut cache) = self.json.lock() {
            cache.retain(|_, (_, _, used)| *used >= epoch);
        }
        if let Ok(mut cache) = self.status_rows.lock() {
            cache.retain(|_, (_, _, used)| *used >= epoch);
        }
        if let Ok(mut sites) = self.sites.lock() {
            let mut gone = Vec::new();
            for calls in sites.values_mut() {
                let used = |site: &Arc<CallSite>| site.used.load(Ordering::Relaxed) >= epoch;
                let keep = if calls.iter().any(used) {
                    calls.iter().map(used).collect::<Vec<_>>()
                } else {
                    calls
                        .iter()
                        .map(|site| site.used.load(Ordering::Relaxed) + 8 > epoch)
                        .collect()
                };
                if keep.iter().all(|k| *k) {
                    continue;
                }
                let (kept, dropped): (Vec<_>, Vec<_>) = std::mem::take(calls)
                    .into_iter()
                    .zip(keep)
                    .partition(|(_, keep)| *keep);
                *calls = kept.into_iter().map(|(site, _)| site).collect();
                gone.extend(dropped.into_iter().map(|(site, _)| site));
            }
            sites.retain(|_, calls| !calls.is_empty());
            if !gone.is_empty() {
                self.graveyard.bury(gone);
            }
        }
    }
}

/// A template value as JSON (none and undefined: null).
fn convert(value: &Value) -> Result<Arc<serde_json::Value>, String> {
    to_json(value).map(Arc::new)
}

/// `value` as JSON, as `serde_json::to_value` makes it, by a walk of the value rather than
/// serde's generic path (a twentieth less; most of the 15,000 instructions a route's status
/// costs are the JSON's own allocations and map inserts, which is why a kept row is not
/// converted again). What the walk does not know (big integers, bytes, a map with a key that
/// is not a string) goes through serde.
fn to_json(value: &Value) -> Result<serde_json::Value, String> {
    use tera::value::ValueKind;
    let through_serde = |value: &Value| serde_json::to_value(value).map_err(|e| e.to_string());
    Ok(match value.kind() {
        ValueKind::Undefined | ValueKind::None => serde_json::Value::Null,
        ValueKind::Bool => serde_json::Value::Bool(value.as_bool().unwrap_or_default()),
        ValueKind::String => serde_json::Value::String(value.as_str().unwrap_or_default().into()),
        ValueKind::U64 => match value.as_u64() {
            Some(n) => serde_json::Value::from(n),
            None => return through_serde(value),
        },
        ValueKind::I64 => match value.as_i64() {
            Some(n) => serde_json::Value::from(n),
            None => return through_serde(value),
        },
        // serde_json's own conversion: not finite, null.
        ValueKind::F64 => match value.as_f64() {
            Some(x) => serde_json::Value::from(x),
            None => return through_serde(value),
        },
        ValueKind::Array => serde_json::Value::Array(
            value
                .as_array()
                .unwrap_or_default()
                .iter()
                .map(to_json)
                .collect::<Result<_, _>>()?,
        ),
        ValueKind::Map => {
            let Some(map) = value.as_map() else {
                return through_serde(value);
            };
            if !map.keys().all(|k| k.as_str().is_some()) {
                return through_serde(value);
            }
            let mut out = serde_json::Map::new();
            // In the map's order, a later equal key replacing an earlier one, as serde does.
            for (key, item) in map {
                out.insert(key.as_str().unwrap_or_default().to_owned(), to_json(item)?);
            }
            serde_json::Value::Object(out)
        }
        _ => return through_serde(value),
    })
}

/// The request of each `set_statuses` row, as `build` makes it: through the running render's
/// cache of rows when there is one.
pub(crate) fn status_rows(
    rows: &[Value],
    build: impl FnMut(&Value) -> tera::TeraResult<KeyedStatus>,
) -> tera::TeraResult<Vec<KeyedStatus>> {
    match ACTIVE.with(|a| {
        a.borrow()
            .as_ref()
            .map(|a| (Arc::clone(&a.fragments), a.epoch))
    }) {
        Some((fragments, epoch)) => fragments.status_rows(rows, epoch, build),
        None => rows.iter().map(build).collect(),
    }
}

/// `value` as JSON for `set_status`: through the running render's cache when there is one.
pub(crate) fn status_json(value: &Value) -> Result<Arc<serde_json::Value>, String> {
    match ACTIVE.with(|a| {
        a.borrow()
            .as_ref()
            .map(|a| (Arc::clone(&a.fragments), a.epoch))
    }) {
        Some((fragments, epoch)) => fragments.json(value, epoch),
        None => convert(value),
    }
}

/// What `render_each` needs of the render running on this thread.
#[derive(Clone)]
pub(crate) struct Active {
    pub(crate) tera: Arc<Tera>,
    pub(crate) fragments: Arc<Fragments>,
    pub(crate) extra: Arc<Vec<(String, Value)>>,
    pub(crate) epoch: u64,
    /// Whether fragments rendered now are kept (not in an overlay render).
    pub(crate) keep: bool,
    /// Whether earlier fragments are reused.
    pub(crate) reuse: bool,
    /// The templates that have a runner ([`runner_source`]).
    pub(crate) runners: Arc<std::collections::HashSet<String>>,
    /// How many threads the render may use (a big run of rows is split over them).
    pub(crate) threads: usize,
    /// Rows per thread a run needs before it is split.
    pub(crate) split_rows: usize,
}

/// What one fragment being rendered on this thread read and did.
#[derive(Default)]
struct Frame {
    reads: Vec<Read>,
    refused: bool,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
    /// The fragments being rendered on this thread, innermost last.
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` (a render on this thread) with `active` as what `render_each` uses.
pub(crate) fn with_active<T>(active: Active, f: impl FnOnce() -> T) -> T {
    let previous = ACTIVE.with(|a| a.replace(Some(active)));
    let out = f();
    ACTIVE.with(|a| *a.borrow_mut() = previous);
    out
}

/// Records a `get` / `lookup` read for the fragments being rendered.
pub(crate) fn record_read(var: &'static str, store: &str, key: &str, found: Option<&Value>) {
    record_read_at(var, store, key, found, None);
}

/// As [`record_read`], with where the view and its entry were (a derived view's entry).
pub(crate) fn record_read_at(
    var: &'static str,
    store: &str,
    key: &str,
    found: Option<&Value>,
    places: Option<(usize, usize)>,
) {
    FRAMES.with(|frames| {
        if let Some(frame) = frames.borrow_mut().last_mut() {
            frame.reads.push(Read {
                var,
                store: store.to_owned(),
                key: key.to_owned(),
                found: found.cloned(),
                places,
            });
        }
    });
}

/// What the entry `read` names is in the derived views `views` now: looked for first where it
/// was (the same key there), else by its key.
fn derived_entry<'v>(views: &'v tera::value::Map, read: &Read) -> Option<&'v Value> {
    fn key_at<'m>(map: &'m tera::value::Map, at: Option<usize>, key: &str) -> Option<&'m Value> {
        let at = at
            .filter(|at| {
                map.get_index(*at)
                    .is_some_and(|(k, _)| k.as_str() == Some(key))
            })
            .or_else(|| map.get_index_of(&tera::value::Key::Str(key)))?;
        map.get_index(at).map(|(_, v)| v)
    }
    let view = key_at(views, read.places.map(|(view, _)| view), &read.store)?;
    key_at(
        view.as_map()?,
        read.places.map(|(_, entry)| entry),
        &read.key,
    )
}

/// Records that `refuse()` was called, for the fragments being rendered.
pub(crate) fn record_refuse() {
    FRAMES.with(|frames| {
        if let Some(frame) = frames.borrow_mut().last_mut() {
            frame.refused = true;
        }
    });
}

/// Whether `reads` find the same things in the render's stores (`stores`: the `GET_VAR` and
/// `INDEX_VAR` maps of this render, and for a per-item output its `DERIVED_VAR` views).
fn still_valid(reads: &[Read], stores: &[(&'static str, Option<Value>)]) -> bool {
    reads.iter().all(|read| {
        let maps = stores
            .iter()
            .find(|(var, _)| *var == read.var)
            .and_then(|(_, v)| v.as_ref())
            .and_then(Value::as_map);
        if read.var == DERIVED_VAR {
            return same(
                maps.and_then(|views| derived_entry(views, read)),
                read.found.as_ref(),
            );
        }
        let now = maps
            .and_then(|m| m.get(&tera::value::Key::Str(&read.store)))
            .and_then(|m| crate::store::find_in(m, read.var == GET_VAR, &read.key));
        same(now.as_ref(), read.found.as_ref())
    })
}

fn error(message: impl std::fmt::Display) -> tera::Error {
    tera::Error::message(message.to_string())
}

/// Where an engine error of a snippet points, as text (template, line, cause).
fn describe(e: &tera::Error, template: &str) -> String {
    let (template, line, cause) = crate::render::locate(e, template);
    match line {
        Some(line) => format!("template `{template}` line {line}: {cause}"),
        None => format!("template `{template}`: {cause}"),
    }
}

/// Replays a call's provenance marks (at `at`, where its output starts in the enclosing one)
/// and its rows' requests, in row order, as if its rows had just been rendered. Requests go one
/// row at a time through the thread's own index (`requests::replay`): merging them into one
/// `Requests` first rebuilt an index of everything so far per row, quadratic in rows with a status.
fn replay(site: &CallSite, at: usize) {
    provenance::replay(at, Arc::clone(&site.marks));
    for (_, requests) in &site.requests {
        requests::replay(requests);
    }
}

/// The function `render_each(rows=<list>, template=<snippet>, args=<any>)`.
fn render_each(kwargs: Kwargs, state: &State) -> tera::TeraResult<Value> {
    let rows_value: Value = kwargs.must_get("rows")?;
    let template: String = kwargs.must_get("template")?;
    let args: Value = kwargs.get::<Value>("args")?.unwrap_or_else(Value::none);
    // `from="<field>"`: each row's output is marked as the object its field names, as a
    // `{{ row.<field> | from }}` at the start of the snippet would, without a filter call per row.
    let from: Option<String> = kwargs.get::<String>("from")?;
    let Some(active) = ACTIVE.with(|a| a.borrow().clone()) else {
        return Err(error("render_each: no render is running"));
    };
    if rows_value.is_undefined() || rows_value.is_none() {
        return Ok(Value::from(""));
    }
    active.fragments.calls.fetch_add(1, Ordering::Relaxed);
    let Some(rows) = rows_value.as_array() else {
        return Err(error(format!(
            "render_each: `rows` must be a list, got {}",
            rows_value.name()
        )));
    };
    let review: Option<Value> = state.get(REVIEW_VAR)?;
    let stores: [(&'static str, Option<Value>); 2] = [
        (GET_VAR, state.get(GET_VAR)?),
        (INDEX_VAR, state.get(INDEX_VAR)?),
    ];
    let key: SiteKey = (
        template.clone(),
        match &from {
            Some(field) => format!("{args}\u{0}{field}"),
            None => args.to_string(),
        },
    );
    let candidates: Vec<Arc<CallSite>> = active
        .fragments
        .sites
        .lock()
        .ok()
        .and_then(|sites| sites.get(&key).cloned())
        .filter(|_| active.reuse)
        .unwrap_or_default();
    let list = identity(&rows_value);
    // The call made on the same list last time, else the most recent one.
    let previous = candidates
        .iter()
        .find(|site| site.list.is_some() && site.list == list)
        .or_else(|| candidates.first())
        .cloned();
    let at = provenance::written();

    // Row `i` of the previous call is reusable as it is: what it read finds the same, and it
    // did not call refuse() or this is no overlay render.
    let reusable = |site: &CallSite, i: u32| {
        let reads = CallSite::of_row(&site.reads, i);
        (review.is_none() || site.refused.binary_search(&i).is_err())
            && reads
                .iter()
                .all(|(_, read)| still_valid(std::slice::from_ref(read), &stores))
    };

    // The same rows list as last time: everything is reused, if every row still is.
    if let Some(site) = previous.as_deref()
        && site.list.is_some()
        && site.list == identity(&rows_value)
        && (review.is_none() || site.refused.is_empty())
        && site
            .reads
            .iter()
            .all(|(_, read)| still_valid(std::slice::from_ref(read), &stores))
    {
        site.used.store(active.epoch, Ordering::Relaxed);
        if let Some(site) = &previous {
            note_site(site);
        }
        active
            .fragments
            .reused
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        active
            .fragments
            .calls_reused
            .fetch_add(1, Ordering::Relaxed);
        note_enclosing(site.reads.iter().map(|(_, r)| r), !site.refused.is_empty());
        replay(site, at);
        let whole = site.bytes().len();
        let id = std::ptr::from_ref(site) as usize;
        note_text(&site.text, id, Some((id, whole)), Some((id, whole)));
        return Ok(site.text.clone());
    }

    // The snippet's own context: the row, args, extraContext, the stores for get/lookup.
    let mut context = Context::new();
    for (key, value) in active.extra.iter() {
        context.insert_value(key.clone(), value.clone());
    }
    for (var, value) in &stores {
        if let Some(value) = value {
            context.insert_value(*var, value.clone());
        }
    }
    if let Some(review) = &review {
        context.insert_value(REVIEW_VAR, review.clone());
    }
    context.insert_value("args", args.clone());

    // The previous call's index is copied, unless it names many rows gone (an index copied
    // over and over).
    let copied = previous
        .as_deref()
        .filter(|p| p.index.len() <= 2 * rows.len() && p.slack.1 - p.slack.0 <= MAX_SLACK);
    // Built in this thread's kept buffer: the text is copied into the call's value below, so
    // the buffer is free again at once, and kept it is not faulted in afresh by every render
    // (the Deployment's `MIMALLOC_PURGE_DELAY=0` hands a freed one back to the kernel).
    let mut bytes = TEXT_BUFFER.with(|buffer| std::mem::take(&mut *buffer.borrow_mut()));
    bytes.clear();
    bytes.reserve(
        previous
            .as_ref()
            .map_or(0, |p| p.bytes().len() + p.bytes().len() / 8),
    );
    let mut site = CallSite {
        rows: rows_value.clone(),
        list: identity(&rows_value),
        index: copied.map_or_else(
            || IdentityMap::with_capacity(rows.len()),
            |p| p.index.clone(),
        ),
        // The rows put in are where their entries say; the others widen it as they come.
        slack: (0, 0),
        text: Value::none(),
        ends: Vec::with_capacity(rows.len()),
        // As many as last time: a view's rows mark their objects, one or more a row.
        marks: Arc::from(Vec::new()),
        requests: Vec::new(),
        reads: Vec::new(),
        refused: Vec::new(),
        used: AtomicU64::new(active.epoch),
    };
    // As many as last time: a view's rows mark their objects, one or more a row.
    // Gathered in this thread's kept list, then moved into the call's own (a fresh block of
    // 10,000 marks less a call, as `TEXT_BUFFER` for its text).
    let mut marks = MARKS_BUFFER.with(|buffer| std::mem::take(&mut *buffer.borrow_mut()));
    marks.clear();
    marks.reserve(previous.as_ref().map_or(0, |p| p.marks.len()));
    let (mut rendered, mut reused) = (0u64, 0u64);
    // Where the next row would be in the previous call, if the lists line up.
    let mut next_previous: u32 = 0;
    // First what each row reuses, if anything; then the others, rendered in one run.
    let mut plan: Vec<Option<(&CallSite, u32)>> = Vec::with_capacity(rows.len());
    let mut missing: Vec<Value> = Vec::new();
    if u32::try_from(rows.len()).is_err() {
        return Err(error("render_each: too many rows"));
    }
    for (place, row) in (0u32..).zip(rows.iter()) {
        let id = identity(row);
        // Where the last call had it, when that is the row after the last one reused from
        // it (a list that kept its order), else wherever a kept call has it.
        let in_order = id.and_then(|id| {
            let p = previous.as_deref()?;
            let j = next_previous;
            let there = identity(p.rows.as_array()?.get(j as usize)?) == Some(id);
            (there && reusable(p, j)).then_some((p, j))
        });
        let same_row = in_order.or_else(|| {
            let id = id?;
            candidates.iter().find_map(|p| {
                let j = p.place_of(id)?;
                reusable(p, j).then_some((p.as_ref(), j))
            })
        });
        let before = same_row.or_else(|| {
            // A row rebuilt with the same contents (a view that copies rows, a contested
            // route): the row after the last one reused, in the call compared with, when it
            // is equal (lists keep their order, so that is where an equal row would be).
            let p = previous.as_deref()?;
            let j = next_previous;
            let same = identical(p.rows.as_array()?.get(j as usize)?, row);
            (same && reusable(p, j)).then_some((p, j))
        });
        let from_previous =
            before.filter(|(p, _)| previous.as_deref().is_some_and(|q| std::ptr::eq(*p, q)));
        if let Some((_, j)) = from_previous {
            next_previous = j + 1;
        }
        // A copied index finds the rows the previous call found (the very same row: not one
        // found equal; a row twice in a list may keep the other place, still its own, as
        // `place_of` checks), moved by as many places as each moved since: the slack widens
        // to take them in, and only the other rows are put in.
        let moved = same_row
            .filter(|(p, _)| copied.is_some_and(|q| std::ptr::eq(*p, q)))
            .map(|(_, j)| i64::from(place) - i64::from(j));
        match (id, moved, copied) {
            (Some(_), Some(moved), Some(q)) => {
                site.slack.0 = site.slack.0.min(q.slack.0 + moved);
                site.slack.1 = site.slack.1.max(q.slack.1 + moved);
            }
            (Some(id), _, _) => {
                #[cfg(test)]
                INDEXED.with(|indexed| indexed.set(indexed.get() + 1));
                site.index.insert(id, place);
            }
            (None, _, _) => {}
        }
        if before.is_none() {
            missing.push(row.clone());
        }
        plan.push(before);
    }
    // A slack grown too wide (rows moved by many places, unevenly) would make each lookup a
    // long probe: the index is made afresh.
    if site.slack.1 - site.slack.0 > MAX_SLACK {
        site.index.clear();
        for (place, row) in (0u32..).zip(rows.iter()) {
            if let Some(id) = identity(row) {
                site.index.insert(id, place);
            }
        }
        site.slack = (0, 0);
    }
    site.index.seal();
    // No row reused (a first render, or reuse off): the run's bytes are the call's, as they
    // are; they are not copied row by row.
    let all_fresh = missing.len() == rows.len();
    let (mut batch, mut fresh) = if missing.is_empty() {
        (String::new(), Vec::new().into_iter())
    } else {
        let (batch, outs) = render_rows(&active, &template, &context, missing, from.as_deref())?;
        let batch =
            String::from_utf8(batch).map_err(|_| error("render_each: a fragment is not UTF-8"))?;
        (batch, outs.into_iter())
    };
    let mut batch_start = 0;
    // The call whose first rows this one starts with, and how many bytes they are (the
    // bytes both start with); the call whose last rows it ends with, and theirs.
    let (mut head, mut tail): (Option<Shared>, Option<Shared>) = (None, None);
    // The call reused from last, and where its last reused run's marks, requests and reads
    // ended: the next run's start there when it follows in that call.
    let mut hints: (*const CallSite, usize, usize, usize) = (std::ptr::null(), 0, 0, 0);
    let mut i = 0;
    while let Some(before) = plan.get(i).copied() {
        let place = u32::try_from(i).map_err(|_| error("render_each: too many rows"))?;
        match before {
            Some((p, j)) => {
                // A run of rows kept from one call, one after the other there (a list that
                // kept its order reuses thousands in a row): copied as a run, bytes and all.
                let mut n = 1u32;
                while plan
                    .get(i + n as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|(q, k)| std::ptr::eq(q, p) && Some(k) == j.checked_add(n))
                {
                    n += 1;
                }
                let rows = j..j + n;
                reused += u64::from(n);
                let from = p.span(j as usize).start;
                let to = p.span((j + n - 1) as usize).end;
                let kept = p
                    .bytes()
                    .get(from..to)
                    .ok_or_else(|| error("render_each: a kept row's output is out of bounds"))?;
                let at_bytes = bytes.len();
                bytes.push_str(kept);
                let p_id = std::ptr::from_ref(p) as usize;
                if i == 0 && j == 0 {
                    head = Some((p_id, to));
                }
                tail = (i + n as usize == plan.len() && (j + n) as usize == p.ends.len())
                    .then(|| (p_id, to - from));
                let ends = p
                    .ends
                    .get(rows.start as usize..rows.end as usize)
                    .ok_or_else(|| error("render_each: a kept row's output is out of bounds"))?;
                site.ends
                    .extend(ends.iter().map(|end| at_bytes + (end - from)));
                if !std::ptr::eq(hints.0, p) {
                    hints = (p, 0, 0, 0);
                }
                // A row of the run, moved to its place here.
                let moved = |row: u32| row - j + place;
                let run = CallSite::run_range(&p.marks, |m| m.0, &rows, hints.1);
                hints.1 = run.end;
                // Its bytes moved from `from` there to `at_bytes` here.
                marks.extend(p.marks[run].iter().map(|(row, offset, value)| {
                    (moved(*row), at_bytes + (offset - from), value.clone())
                }));
                let requests = CallSite::run_range(&p.requests, |r| r.0, &rows, hints.2);
                hints.2 = requests.end;
                site.requests.extend(
                    p.requests[requests]
                        .iter()
                        .map(|(row, requests)| (moved(*row), requests.clone())),
                );
                let reads = CallSite::run_range(&p.reads, |r| r.0, &rows, hints.3);
                hints.3 = reads.end;
                site.reads.extend(
                    p.reads[reads]
                        .iter()
                        .map(|(row, read)| (moved(*row), read.clone())),
                );
                let refused = p.refused.partition_point(|r| *r < rows.start)
                    ..p.refused.partition_point(|r| *r < rows.end);
                site.refused
                    .extend(p.refused[refused].iter().map(|row| moved(*row)));
                i += n as usize;
            }
            None => {
                rendered += 1;
                tail = None;
                let out = fresh
                    .next()
                    .ok_or_else(|| error("render_each: a row was not rendered"))?;
                let row = batch
                    .get(batch_start..out.end)
                    .ok_or_else(|| error("render_each: a row's output is out of bounds"))?;
                // Where the row starts in the call's output.
                let row_at = if all_fresh { batch_start } else { bytes.len() };
                if !all_fresh {
                    bytes.push_str(row);
                }
                for (offset, value) in out.first.into_iter().chain(out.marks) {
                    marks.push((place, row_at + offset.saturating_sub(batch_start), value));
                }
                batch_start = out.end;
                if !out.requests.is_empty() {
                    site.requests.push((place, out.requests));
                }
                site.reads
                    .extend(out.reads.into_iter().map(|read| (place, read)));
                if out.refused {
                    site.refused.push(place);
                }
                site.ends
                    .push(if all_fresh { batch_start } else { bytes.len() });
                i += 1;
            }
        }
    }
    site.text = if all_fresh {
        text_of(std::mem::take(&mut batch))
    } else {
        Value::from(bytes.as_str())
    };
    if bytes.capacity() <= KEPT_TEXT_BUFFER {
        TEXT_BUFFER.with(|buffer| *buffer.borrow_mut() = bytes);
    }
    site.marks = marks.drain(..).collect();
    if marks.capacity() <= KEPT_MARKS {
        MARKS_BUFFER.with(|buffer| *buffer.borrow_mut() = marks);
    }
    active.fragments.reused.fetch_add(reused, Ordering::Relaxed);
    active
        .fragments
        .rendered
        .fetch_add(rendered, Ordering::Relaxed);
    note_enclosing(site.reads.iter().map(|(_, r)| r), !site.refused.is_empty());
    replay(&site, at);
    let text = site.text.clone();
    // An overlay render reuses what it can and keeps nothing of its own.
    if active.keep
        && let Ok(mut sites) = active.fragments.sites.lock()
    {
        let calls = sites.entry(key).or_default();
        // This call replaces the one on the same list (the others age out in `end`).
        let replaced = calls
            .iter()
            .position(|c| c.list.is_some() && c.list == site.list);
        if let Some(i) = replaced {
            // The call replaced (its rows list, marks and text): dropped after the render.
            active.fragments.graveyard.bury(calls.remove(i));
        }
        let site = Arc::new(site);
        note_site(&site);
        note_text(&text, Arc::as_ptr(&site) as usize, head, tail);
        calls.insert(0, site);
        let aged = calls.split_off(calls.len().min(MAX_CALLS_PER_KEY));
        if !aged.is_empty() {
            active.fragments.graveyard.bury(aged);
        }
    }
    active.fragments.graveyard.bury((candidates, previous));

    Ok(text)
}

/// The largest buffer a thread keeps for `render_each`'s texts ([`TEXT_BUFFER`]): a bigger
/// one (a run of 10,000 HTTPRoutes, some 15 MB) is not held between renders.
const KEPT_TEXT_BUFFER: usize = 8 << 20;

/// The most marks a thread keeps room for in [`MARKS_BUFFER`] (a few MiB).
const KEPT_MARKS: usize = 100_000;

thread_local! {
    /// The buffer `render_each` builds a call's text in on this thread, kept between calls
    /// (up to [`KEPT_TEXT_BUFFER`]).
    static TEXT_BUFFER: RefCell<String> = const { RefCell::new(String::new()) };
    /// The list `render_each` gathers a call's marks in on this thread, kept between calls
    /// (room for up to [`KEPT_MARKS`]).
    static MARKS_BUFFER: RefCell<Vec<(u32, usize, Value)>> = const { RefCell::new(Vec::new()) };
    /// The calls the single output rendering on this thread made, when it is kept.
    static SITES: RefCell<Option<Vec<Arc<CallSite>>>> = const { RefCell::new(None) };
    /// The large texts `render_each` returned on this thread while a [`Spanning`] writer
    /// renders, with what each is known to share with the calls it reused.
    static TEXTS: RefCell<Option<Vec<CallText>>> = const { RefCell::new(None) };
}

/// Texts shorter than this are not followed into the file (a comparison of them costs less
/// than following them).
const MIN_SPAN: usize = 4096;

/// A text `render_each` returned (its address and length), the call that keeps it (its
/// address: alive as long as a kept output holds it), and the calls it starts and ends as:
/// `(call, bytes)`: its first (last) `bytes` are that call's first (last) `bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallText {
    at: usize,
    len: usize,
    call: usize,
    head: Option<Shared>,
    tail: Option<Shared>,
}

/// A call (its address), and how many bytes another call's text shares with its text.
type Shared = (usize, usize);

/// Where a call's text went in a file: at `offset`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    offset: usize,
    text: CallText,
}

/// Notes a call's text, when a [`Spanning`] writer renders on this thread and it is large.
fn note_text(text: &Value, call: usize, head: Option<Shared>, tail: Option<Shared>) {
    let Some(bytes) = text.as_str().filter(|t| t.len() >= MIN_SPAN) else {
        return;
    };
    TEXTS.with(|texts| {
        if let Some(texts) = texts.borrow_mut().as_mut() {
            texts.push(CallText {
                at: bytes.as_ptr() as usize,
                len: bytes.len(),
                call,
                head,
                tail,
            });
        }
    });
}

/// A writer for a single output's render: as [`provenance::Counting`], and notes where the
/// texts of `render_each` calls (the very values, by address) are written, so that what the
/// file shares with the last render of it is known without comparing it.
pub(crate) struct Spanning<'a> {
    pub(crate) bytes: &'a mut Vec<u8>,
    pub(crate) spans: &'a mut Vec<Span>,
}

impl std::io::Write for Spanning<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() >= MIN_SPAN {
            let found = TEXTS.with(|texts| {
                texts.borrow().as_ref().and_then(|texts| {
                    texts
                        .iter()
                        .find(|t| t.at == buf.as_ptr() as usize && t.len == buf.len())
                        .copied()
                })
            });
            if let Some(text) = found {
                self.spans.push(Span {
                    offset: self.bytes.len(),
                    text,
                });
            }
        }
        provenance::Counting(self.bytes).write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.write(buf).map(|_| ())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How many leading and trailing bytes `bytes` (written with `spans`) is known to share with
/// `old` (written with `old_spans`, by the last render of the same output): the bytes before
/// the first call's text (compared: a few KB), then that text's first bytes when it starts as
/// the call written at the same place in `old`; and from the end, the same. At most the true
/// counts.
pub(crate) fn known_same(
    bytes: &[u8],
    spans: &[Span],
    old: &[u8],
    old_spans: &[Span],
) -> haptic_checksum::Same {
    let find = |call: usize| old_spans.iter().find(|s| s.text.call == call);
    let mut prefix = 0;
    for span in spans {
        let Some((call, head)) = span.text.head else {
            break;
        };
        let Some(was) = find(call) else { break };
        let before = span.offset;
        if was.offset != before || bytes.get(prefix..before) != old.get(prefix..before) {
            break;
        }
        prefix = before + head;
        if head < span.text.len || head < was.text.len {
            break;
        }
    }
    let mut suffix = 0;
    for span in spans.iter().rev() {
        let Some((call, tail)) = span.text.tail else {
            break;
        };
        let Some(was) = find(call) else { break };
        let (end, old_end) = (span.offset + span.text.len, was.offset + was.text.len);
        let after = bytes.len().saturating_sub(end);
        if old.len().saturating_sub(old_end) != after
            || bytes.get(end..bytes.len() - suffix) != old.get(old_end..old.len() - suffix)
        {
            break;
        }
        suffix = after + tail;
        if tail < span.text.len || tail < was.text.len {
            break;
        }
    }
    haptic_checksum::Same { prefix, suffix }
}

/// Notes a call kept (made or reused whole) for the single output rendering, if any.
fn note_site(site: &Arc<CallSite>) {
    SITES.with(|sites| {
        if let Some(sites) = sites.borrow_mut().as_mut() {
            sites.push(Arc::clone(site));
        }
    });
}

/// The call's output as the template value it returns and keeps: one copy of its bytes (a
/// text value holds its own), made once; the engine would copy a returned `String` into a
/// value of its own on every call.
fn text_of(bytes: String) -> Value {
    Value::from(bytes)
}

/// Tells the fragment being rendered around this call (if any) what the rows read.
fn note_enclosing<'a>(reads: impl Iterator<Item = &'a Read>, refused: bool) {
    FRAMES.with(|frames| {
        if let Some(frame) = frames.borrow_mut().last_mut() {
            frame.reads.extend(reads.cloned());
            frame.refused |= refused;
        }
    });
}

/// What rendering one row gave besides its bytes.
struct RowOut {
    /// Where the row's bytes end in the run's output.
    end: usize,
    /// The row's own mark (`from`: its object, at its start), before `marks`: apart, so
    /// that marking a row allocates nothing.
    first: Option<(usize, Value)>,
    /// Marks, at offsets in the run's output.
    marks: Vec<(usize, Value)>,
    requests: Requests,
    reads: Vec<Read>,
    refused: bool,
}

thread_local! {
    /// The rows rendered so far by each run of rows on this thread (innermost last).
    static ROW_ENDS: RefCell<Vec<Vec<RowOut>>> = const { RefCell::new(Vec::new()) };
}

const RUNNER_PREFIX: &str = "__haptic_each.";

/// The engine name of the template that renders snippet `name` once per row of
/// `__haptic_rows`, calling `__haptic_row_end()` after each.
pub(crate) fn runner_name(name: &str) -> String {
    format!("{RUNNER_PREFIX}{name}")
}

/// The source of [`runner_name`]`(name)` for snippet `name` whose source is `source`, if
/// `name` can be written in it.
///
/// The snippet's source is the loop's body when that renders what an `include` of it would
/// ([`inlinable`]): a loop iteration starts with no variable of its own, as an included
/// template does, and the row's variables are the same. That saves the engine a template
/// lookup and a fresh state per row (a third of the cost of a row that writes nothing). Its
/// line numbers are the snippet's (the loop's opening tag holds no newline) and its errors
/// name the snippet ([`snippet_of_runner`]). Else the body includes the snippet.
pub(crate) fn runner_source(name: &str, source: &str) -> Option<String> {
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c))
    {
        return None;
    }
    let body = if inlinable(source) {
        source.to_owned()
    } else {
        format!("{{% include \"{name}\" %}}")
    };
    Some(format!(
        "{{%- for row in __haptic_rows %}}{body}{{{{ __haptic_row_end() }}}}{{% endfor -%}}"
    ))
}

/// Whether a snippet renders the same as the body of the runner's loop as when included: no
/// tag that only the top level of a template may hold (`extends`, `block`, `macro`,
/// `import`), that would act on the runner's loop (`break`, `continue`) or that would outlive
/// the row (`set_global`). Any tag whose first word is one of them (a comment's text is not a
/// tag) makes it not inlinable.
pub(crate) fn inlinable(source: &str) -> bool {
    const TOP_LEVEL_ONLY: [&str; 7] = [
        "extends",
        "block",
        "macro",
        "import",
        "break",
        "continue",
        "set_global",
    ];
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        rest = &rest[at + 2..];
        let tag = rest.trim_start_matches(['-', '+']).trim_start();
        let word = tag
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default();
        if TOP_LEVEL_ONLY.contains(&word) {
            return false;
        }
    }
    true
}

/// The snippet whose runner template is `template`, if it is one.
pub(crate) fn snippet_of_runner(template: &str) -> Option<&str> {
    template.strip_prefix(RUNNER_PREFIX)
}

/// `__haptic_row_end()`: one row of a run is done; what it wrote, marked, asked and read is
/// its own.
fn row_end(_: Kwargs, _: &State) -> tera::TeraResult<String> {
    let end = provenance::written();
    let marks = provenance::take_marks();
    let requests = requests::take();
    let frame = FRAMES.with(|frames| {
        let mut frames = frames.borrow_mut();
        let frame = frames.pop().unwrap_or_default();
        frames.push(Frame::default());
        frame
    });
    ROW_ENDS.with(|ends| {
        if let Some(run) = ends.borrow_mut().last_mut() {
            run.push(RowOut {
                end,
                first: None,
                marks,
                requests,
                reads: frame.reads,
                refused: frame.refused,
            });
        }
    });
    Ok(String::new())
}

/// Renders snippet `template` for each of `rows` in one run of the engine (its runner
/// template), or one by one when it has none.
fn render_rows(
    active: &Active,
    template: &str,
    context: &Context,
    rows: Vec<Value>,
    from: Option<&str>,
) -> tera::TeraResult<(Vec<u8>, Vec<RowOut>)> {
    // The object of each row (`[]`, none, when the row has no such field).
    let objects: Option<Vec<Value>> = from.map(|field| {
        rows.iter()
            .map(|row| {
                row.as_map()
                    .and_then(|m| m.get(&tera::value::Key::Str(field)))
                    .cloned()
                    .unwrap_or_else(|| Value::from(Vec::<Value>::new()))
            })
            .collect()
    });
    let (bytes, mut outs) = render_rows_unmarked(active, template, context, rows)?;
    if let Some(objects) = objects {
        // Each row's mark at its start, before the marks its snippet made.
        let mut start = 0;
        for (object, out) in objects.into_iter().zip(&mut outs) {
            out.first = Some((start, object));
            start = out.end;
        }
    }
    Ok((bytes, outs))
}

/// [`render_rows`] without the `from` marks.
fn render_rows_unmarked(
    active: &Active,
    template: &str,
    context: &Context,
    rows: Vec<Value>,
) -> tera::TeraResult<(Vec<u8>, Vec<RowOut>)> {
    let count = rows.len();
    let runner = runner_name(template);
    let one_by_one = !active.runners.contains(template);
    if one_by_one {
        let mut bytes = Vec::new();
        let mut context = context.clone();
        let mut outs = Vec::with_capacity(count);
        for row in rows {
            context.insert_value("row", row);
            FRAMES.with(|frames| frames.borrow_mut().push(Frame::default()));
            let start = bytes.len();
            let ((rendered, requests), marks) = provenance::collect_from(start, || {
                requests::collect(|| {
                    active
                        .tera
                        .render_to(template, &context, provenance::Counting(&mut bytes))
                })
            });
            let frame = FRAMES
                .with(|frames| frames.borrow_mut().pop())
                .unwrap_or_default();
            rendered.map_err(|e| error(format!("render_each: {}", describe(&e, template))))?;
            outs.push(RowOut {
                end: bytes.len(),
                first: None,
                marks: marks.into_flat(),
                requests,
                reads: frame.reads,
                refused: frame.refused,
            });
        }
        return Ok((bytes, outs));
    }
    // A big run is split into parts rendered on threads of their own (each with its own
    // engine state, marks, requests and reads, as a run on this thread has), then laid end to
    // end: the bytes and what each row did are the same as one run's.
    let parts = active.threads.min(count / active.split_rows.max(1)).max(1);
    if parts == 1 {
        return run_part(active, &runner, context, rows, template);
    }
    let size = count.div_ceil(parts);
    let mut rows = rows.into_iter();
    let mut chunks: Vec<Vec<Value>> = (0..parts)
        .map(|_| rows.by_ref().take(size).collect())
        .collect();
    let first = std::mem::take(&mut chunks[0]);
    let results: Vec<tera::TeraResult<(Vec<u8>, Vec<RowOut>)>> = std::thread::scope(|scope| {
        let others: Vec<_> = chunks
            .into_iter()
            .skip(1)
            .map(|chunk| {
                let (active, runner, context) = (active.clone(), &runner, &context);
                scope.spawn(move || {
                    with_active(active.clone(), || {
                        run_part(&active, runner, context, chunk, template)
                    })
                })
            })
            .collect();
        let mut results = vec![run_part(active, &runner, context, first, template)];
        for other in others {
            results.push(other.join().unwrap_or_else(|panic| {
                Err(error(format!(
                    "render_each: template `{template}`: a render thread panicked: {}",
                    panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default()
                )))
            }));
        }
        results
    });
    let results = results.into_iter().collect::<tera::TeraResult<Vec<_>>>()?;
    let mut bytes = Vec::with_capacity(results.iter().map(|(part, _)| part.len()).sum());
    let mut outs = Vec::with_capacity(count);
    for (part, part_outs) in results {
        let start = bytes.len();
        bytes.extend_from_slice(&part);
        outs.extend(part_outs.into_iter().map(|mut out| {
            out.end += start;
            for (offset, _) in out.first.iter_mut().chain(&mut out.marks) {
                *offset += start;
            }
            out
        }));
    }
    Ok((bytes, outs))
}

/// Renders `rows` with `runner` in one run of the engine on this thread.
fn run_part(
    active: &Active,
    runner: &str,
    context: &Context,
    rows: Vec<Value>,
    template: &str,
) -> tera::TeraResult<(Vec<u8>, Vec<RowOut>)> {
    let count = rows.len();
    // As long as the last run of this snippet gave for as many rows: the buffer of a big run
    // (15 MB at 10,000 HTTPRoutes) is not grown, and copied, a dozen times over.
    let mut bytes = Vec::with_capacity(active.fragments.row_bytes(template).saturating_mul(count));
    let mut context = context.clone();
    context.insert_value("__haptic_rows", Value::from(rows));
    FRAMES.with(|frames| frames.borrow_mut().push(Frame::default()));
    ROW_ENDS.with(|ends| ends.borrow_mut().push(Vec::with_capacity(count)));
    let ((rendered, _), _) = provenance::collect_from(0, || {
        requests::collect(|| {
            active
                .tera
                .render_to(runner, &context, provenance::Counting(&mut bytes))
        })
    });
    FRAMES.with(|frames| frames.borrow_mut().pop());
    let outs = ROW_ENDS
        .with(|ends| ends.borrow_mut().pop())
        .unwrap_or_default();
    rendered.map_err(|e| error(format!("render_each: {}", describe(&e, template))))?;
    if outs.len() != count {
        return Err(error("render_each: a row ended without its mark"));
    }
    if let Some(per_row) = bytes.len().checked_div(count) {
        active.fragments.note_row_bytes(template, per_row);
    }
    Ok((bytes, outs))
}

/// Registers `render_each` (and the function its runners call).
pub(crate) fn register(tera: &mut Tera) {
    tera.register_function("render_each", render_each);
    tera.register_function("__haptic_row_end", row_end);
}

/// The top-level values a template (with the snippets it includes or imports) can read, found
/// in its source: `derived.<view>` and `resources.<store>`, as `("derived", view)` pairs.
/// `None` when it might read anything else of the context (the whole `derived` or `resources`
/// map, an internal variable, an include whose name is not a literal, inheritance): then
/// nothing is known and nothing is reused on its strength. Comments are not read.
pub(crate) fn template_reads(
    name: &str,
    sources: &[(String, &str)],
) -> Option<std::collections::BTreeSet<(&'static str, String)>> {
    let mut reads = std::collections::BTreeSet::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut pending = vec![name.to_owned()];
    while let Some(name) = pending.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let source = sources.iter().find(|(n, _)| *n == name)?.1;
        let text = without_comments(source);
        let words = words(&text);
        for (i, (word, at)) in words.iter().enumerate() {
            let after = &text[at + word.len()..];
            match *word {
                "derived" | "resources" => {
                    let kind = if *word == "derived" {
                        "derived"
                    } else {
                        "resources"
                    };
                    let field = after.strip_prefix('.')?;
                    let end = field
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(field.len());
                    if end == 0 {
                        return None;
                    }
                    reads.insert((kind, field[..end].to_owned()));
                }
                "include" | "import" => pending.push(literal(after)?.to_owned()),
                // `render_each(..., template="<snippet>")`: the snippet's reads are the
                // caller's; a snippet named by anything but a literal could read anything.
                "template" => {
                    if let Some(value) = after
                        .trim_start()
                        .strip_prefix('=')
                        .filter(|v| !v.starts_with('='))
                    {
                        pending.push(literal(value)?.to_owned());
                    }
                }
                "extends" | "__tera_context" => return None,
                w if w.starts_with("__haptic") => return None,
                _ => {}
            }
            let _ = i;
        }
    }
    Some(reads)
}

/// The quoted text `text` starts with (after blanks); none when it starts with no quote.
fn literal(text: &str) -> Option<&str> {
    let text = text.trim_start();
    let quote = text.chars().next().filter(|c| *c == '"' || *c == '\'')?;
    let rest = &text[1..];
    Some(&rest[..rest.find(quote)?])
}

/// `source` without `{# ... #}` comments.
fn without_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{#") {
        out.push_str(&rest[..start]);
        match rest[start..].find("#}") {
            Some(end) => rest = &rest[start + end + 2..],
            None => return out,
        }
    }
    out.push_str(rest);
    out
}

/// The identifier-like words of `text` with their byte offsets (a dot before a word makes it
/// an attribute, not a variable: `x.derived` is not `derived`).
fn words(text: &str) -> Vec<(&str, usize)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            if start == 0 || bytes[start - 1] != b'.' {
                out.push((&text[start..i], start));
            }
        } else {
            i += 1;
        }
    }
    out
}

/// What one item of a per-item output rendered, and what it depended on.
#[derive(Debug)]
pub(crate) struct ItemOutput {
    /// The item, kept so that its identity is not reused while this lives.
    item: Value,
    /// The values the template can read (see [`template_reads`]), as they were.
    inputs: Vec<Value>,
    /// The bytes (blank: no file), shared with the file sets made of them.
    pub(crate) bytes: bytes::Bytes,
    /// Where they go, and the item's namespace and name; none when they are blank (taken
    /// from the item once, not again on every render that reuses them).
    pub(crate) file: Option<ItemFile>,
    pub(crate) requests: Requests,
    reads: Vec<Read>,
    refused: bool,
    used: AtomicU64,
}

/// Where a per-item output's bytes go: its path and the item's namespace and name.
#[derive(Debug, Clone)]
pub(crate) struct ItemFile {
    pub(crate) path: String,
    /// The item (its store, namespace and name), as the file's provenance names it.
    pub(crate) object: Arc<crate::provenance::ObjectRef>,
}

/// The outputs of per-item templates, by output and item identity, kept between renders.
#[derive(Debug, Default)]
pub(crate) struct Items {
    entries: Mutex<HashMap<(usize, usize), Arc<ItemOutput>>>,
    /// The chunks of the last render, by output and chunk (see [`ItemsChunk`]).
    chunks: Mutex<HashMap<(usize, usize), Arc<ItemsChunk>>>,
    /// Items rendered and reused since the last [`Items::take_counts`].
    rendered: AtomicU64,
    reused: AtomicU64,
    chunks_reused: AtomicU64,
}

impl Items {
    /// Counts an item rendered (`false`) or reused (`true`).
    pub(crate) fn count(&self, reused: bool) {
        let counter = if reused { &self.reused } else { &self.rendered };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Items rendered and reused, and chunks reused whole, since the last call.
    pub(crate) fn take_counts(&self) -> (u64, u64, u64) {
        (
            self.rendered.swap(0, Ordering::Relaxed),
            self.reused.swap(0, Ordering::Relaxed),
            self.chunks_reused.swap(0, Ordering::Relaxed),
        )
    }

    /// What output `index` gave for `item` last time, if it still holds: the same item, the
    /// same `inputs`, the same results of its get/lookup/derived_get reads (`stores`: this
    /// render's `GET_VAR`, `INDEX_VAR` and `DERIVED_VAR` maps), and no `refuse()` in an
    /// overlay render.
    pub(crate) fn reuse(
        &self,
        index: usize,
        item: &Value,
        inputs: &[Value],
        stores: &[(&'static str, Option<Value>)],
        review: bool,
        epoch: u64,
    ) -> Option<Arc<ItemOutput>> {
        let id = identity(item)?;
        let entries = self.entries.lock().ok()?;
        let entry = entries.get(&(index, id))?;
        let same_inputs = entry.inputs.len() == inputs.len()
            && entry
                .inputs
                .iter()
                .zip(inputs)
                .all(|(a, b)| same(Some(a), Some(b)));
        let usable = identical(&entry.item, item)
            && same_inputs
            && (!review || !entry.refused)
            && still_valid(&entry.reads, stores);
        usable.then(|| {
            entry.used.store(epoch, Ordering::Relaxed);
            Arc::clone(entry)
        })
    }

    /// Keeps what output `index` gave for `item`, and returns it (none: an item without an
    /// identity, which is not kept).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn keep(
        &self,
        index: usize,
        item: &Value,
        inputs: Vec<Value>,
        (bytes, file): (bytes::Bytes, Option<ItemFile>),
        requests: Requests,
        (reads, refused): (Vec<Read>, bool),
        epoch: u64,
    ) -> Option<Arc<ItemOutput>> {
        let id = identity(item)?;
        let output = Arc::new(ItemOutput {
            item: item.clone(),
            inputs,
            bytes,
            file,
            requests,
            reads,
            refused,
            used: AtomicU64::new(epoch),
        });
        let mut entries = self.entries.lock().ok()?;
        entries.insert((index, id), Arc::clone(&output));
        Some(output)
    }

    /// What chunk `chunk` of output `index` gave last time, whole, if every item of it still
    /// would give the same: the very items in the same order, the same `inputs`, and each
    /// store or view any of them read the very value it was (so that every read finds what
    /// it found). An event that changed nothing those items read (an EndpointSlice's, for the
    /// certificates of 2,500 Secrets) then costs a comparison of addresses per item, not a
    /// check of each item's reads.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reuse_chunk(
        &self,
        index: usize,
        chunk: usize,
        items: &[Value],
        inputs: &[Value],
        stores: &[(&'static str, Option<Value>)],
        review: bool,
        epoch: u64,
    ) -> Option<Arc<ItemsChunk>> {
        let kept = Arc::clone(self.chunks.lock().ok()?.get(&(index, chunk))?);
        let usable = kept.items.len() == items.len()
            && kept
                .items
                .iter()
                .zip(items)
                .all(|(a, b)| same(Some(a), Some(b)))
            && kept.inputs.len() == inputs.len()
            && kept
                .inputs
                .iter()
                .zip(inputs)
                .all(|(a, b)| same(Some(a), Some(b)))
            && (!review || !kept.refused)
            && kept
                .sources
                .iter()
                .all(|(var, name, was)| same(source(stores, var, name).as_ref(), was.as_ref()));
        if !usable {
            return None;
        }
        kept.used.store(epoch, Ordering::Relaxed);
        for output in &kept.outputs {
            output.used.store(epoch, Ordering::Relaxed);
        }
        self.reused
            .fetch_add(kept.outputs.len() as u64, Ordering::Relaxed);
        self.chunks_reused.fetch_add(1, Ordering::Relaxed);
        Some(kept)
    }

    /// Keeps chunk `chunk` of output `index` whole: `outputs`, one per item of `items` in
    /// order, each reused or kept by this render.
    pub(crate) fn keep_chunk(
        &self,
        (index, chunk): (usize, usize),
        items: &[Value],
        inputs: &[Value],
        outputs: Vec<Arc<ItemOutput>>,
        stores: &[(&'static str, Option<Value>)],
        epoch: u64,
    ) {
        let mut read: Vec<(&'static str, &str)> = outputs
            .iter()
            .flat_map(|output| output.reads.iter())
            .map(|read| (read.var, read.store.as_str()))
            .collect();
        read.sort_unstable();
        read.dedup();
        let sources = read
            .into_iter()
            .map(|(var, name)| (var, name.to_owned(), source(stores, var, name)))
            .collect();
        let kept = Arc::new(ItemsChunk {
            items: items.to_vec(),
            inputs: inputs.to_vec(),
            sources,
            refused: outputs.iter().any(|output| output.refused),
            outputs,
            used: AtomicU64::new(epoch),
        });
        if let Ok(mut chunks) = self.chunks.lock() {
            chunks.insert((index, chunk), kept);
        }
    }

    /// Drops what render `epoch` did not use.
    pub(crate) fn end(&self, epoch: u64) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|_, e| e.used.load(Ordering::Relaxed) >= epoch);
        }
        if let Ok(mut chunks) = self.chunks.lock() {
            chunks.retain(|_, c| c.used.load(Ordering::Relaxed) >= epoch);
        }
    }
}

/// A run of items of a per-item output (a render job's), as the last render gave it: reused
/// whole by [`Items::reuse_chunk`].
#[derive(Debug)]
pub(crate) struct ItemsChunk {
    /// The items, kept so that their identities are not reused while this lives.
    items: Vec<Value>,
    inputs: Vec<Value>,
    /// Each store (`GET_VAR`, `INDEX_VAR`: a store's map) or view (`DERIVED_VAR`) that an
    /// item's read looked in, as it was: kept, so that its identity stays its own.
    sources: Vec<(&'static str, String, Option<Value>)>,
    /// Whether an item's render called `refuse()`.
    refused: bool,
    /// Each item's output, in the items' order.
    pub(crate) outputs: Vec<Arc<ItemOutput>>,
    used: AtomicU64,
}

/// The store or view that a read of `var` (`GET_VAR`, `INDEX_VAR` or `DERIVED_VAR`) in
/// `name` looks in, in this render's `stores`.
fn source(stores: &[(&'static str, Option<Value>)], var: &str, name: &str) -> Option<Value> {
    stores
        .iter()
        .find(|(v, _)| *v == var)
        .and_then(|(_, maps)| maps.as_ref())
        .and_then(Value::as_map)
        .and_then(|maps| maps.get(&tera::value::Key::Str(name)))
        .cloned()
}

/// What a single output rendered, and what it depended on: as an [`ItemOutput`], without an
/// item, and with its provenance and the `render_each` calls it made.
#[derive(Debug)]
pub(crate) struct SingleOutput {
    /// The values the template can read (see [`template_reads`]), as they were.
    inputs: Vec<Value>,
    /// The bytes, shared with the file sets made of them.
    pub(crate) bytes: bytes::Bytes,
    pub(crate) marks: crate::provenance::Marks,
    pub(crate) requests: Requests,
    reads: Vec<Read>,
    refused: bool,
    /// The calls it made, kept (from aging out) as long as the output is reused: the next
    /// render of it reuses their rows.
    sites: Vec<Arc<CallSite>>,
    /// Where the large texts of those calls are in `bytes`.
    pub(crate) spans: Vec<Span>,
}

/// The single outputs (not per item) of the last render, by output, with what they read.
#[derive(Debug, Default)]
pub(crate) struct Singles {
    entries: Mutex<HashMap<usize, Arc<SingleOutput>>>,
    /// Outputs reused since the last [`Singles::take_count`].
    reused: AtomicU64,
}

impl Singles {
    /// What output `index` gave last time, if it still holds: the same `inputs`, the same
    /// results of its reads (`stores`: this render's `GET_VAR`, `INDEX_VAR` and
    /// `DERIVED_VAR` maps), and no `refuse()` in an overlay render.
    pub(crate) fn reuse(
        &self,
        index: usize,
        inputs: &[Value],
        stores: &[(&'static str, Option<Value>)],
        review: bool,
        epoch: u64,
    ) -> Option<Arc<SingleOutput>> {
        let entries = self.entries.lock().ok()?;
        let entry = entries.get(&index)?;
        let usable = entry.inputs.len() == inputs.len()
            && entry
                .inputs
                .iter()
                .zip(inputs)
                .all(|(a, b)| same(Some(a), Some(b)))
            && (!review || !entry.refused)
            && still_valid(&entry.reads, stores);
        usable.then(|| {
            for site in &entry.sites {
                site.used.store(epoch, Ordering::Relaxed);
            }
            self.reused.fetch_add(1, Ordering::Relaxed);
            Arc::clone(entry)
        })
    }

    /// Keeps what output `index` gave; returns what it gave before.
    pub(crate) fn keep(
        &self,
        index: usize,
        inputs: Vec<Value>,
        (bytes, marks, requests): (bytes::Bytes, crate::provenance::Marks, Requests),
        ((reads, refused), sites): Tracked,
        spans: Vec<Span>,
    ) -> Option<Arc<SingleOutput>> {
        self.entries.lock().ok()?.insert(
            index,
            Arc::new(SingleOutput {
                inputs,
                bytes,
                marks,
                requests,
                reads,
                refused,
                sites,
                spans,
            }),
        )
    }

    /// Forgets what output `index` gave (rendered again and not kept); returns it.
    pub(crate) fn forget(&self, index: usize) -> Option<Arc<SingleOutput>> {
        self.entries.lock().ok()?.remove(&index)
    }

    /// Outputs reused since the last call.
    pub(crate) fn take_count(&self) -> u64 {
        self.reused.swap(0, Ordering::Relaxed)
    }
}

/// What a single output read with get/lookup/derived_get, whether it called `refuse()`, and
/// the `render_each` calls it made.
pub(crate) type Tracked = ((Vec<Read>, bool), Vec<Arc<CallSite>>);

/// Runs `f` (a single output's render) recording what [`tracking`] records and the
/// `render_each` calls it made.
///
/// The texts of the calls are followed into the output too (a [`Spanning`] writer finds
/// them).
pub(crate) fn tracking_calls<T>(f: impl FnOnce() -> T) -> (T, Tracked) {
    let outer = SITES.with(|sites| sites.replace(Some(Vec::new())));
    let outer_texts = TEXTS.with(|texts| texts.replace(Some(Vec::new())));
    let (out, reads) = tracking(f);
    TEXTS.with(|texts| texts.replace(outer_texts));
    let sites = SITES.with(|sites| sites.replace(outer)).unwrap_or_default();
    (out, (reads, sites))
}

/// Runs `f` (one item's render) recording what it reads with get/lookup and whether it calls
/// `refuse()`.
pub(crate) fn tracking<T>(f: impl FnOnce() -> T) -> (T, (Vec<Read>, bool)) {
    FRAMES.with(|frames| frames.borrow_mut().push(Frame::default()));
    let out = f();
    let frame = FRAMES
        .with(|frames| frames.borrow_mut().pop())
        .unwrap_or_default();
    (out, (frame.reads, frame.refused))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;
    use tera::Value;

    use super::CallSite;

    /// A copy of a sealed index shares its base; rows put in after are the copy's alone, and
    /// are folded into a base of its own once they are more than an eighth of it.
    #[test]
    fn places_copied_share_their_base_until_many_rows_are_put_in() {
        let mut first = super::Places::<u32>::with_capacity(80);
        for id in 0..80 {
            first.insert(id * 8, u32::try_from(id).unwrap());
        }
        first.seal();
        assert_eq!(first.added.len(), 0, "a fresh index is its base");
        let mut second = first.clone();
        second.insert(8, 100);
        second.insert(7, 101);
        second.seal();
        assert!(std::sync::Arc::ptr_eq(&first.base, &second.base));
        assert_eq!(second.get(&8), Some(&100));
        assert_eq!(first.get(&8), Some(&1));
        assert_eq!(second.get(&7), Some(&101));
        assert_eq!(first.get(&7), None);
        assert_eq!(second.len(), 82);
        for id in 0..10 {
            second.insert(id * 8 + 1, 200);
        }
        second.seal();
        assert!(!std::sync::Arc::ptr_eq(&first.base, &second.base));
        assert_eq!(second.added.len(), 0);
        assert_eq!(second.get(&8), Some(&100));
        assert_eq!(second.get(&9), Some(&200));
        assert_eq!(first.get(&9), None);
        second.clear();
        assert_eq!(second.len(), 0);
        assert_eq!(second.get(&0), None);
    }

    /// What a template can read includes what the snippets it renders rows with read; a
    /// snippet named by a variable could read anything.
    #[test]
    fn a_templates_reads_follow_the_snippets_it_renders_rows_with() {
        let sources = |main: &str| {
            vec![
                ("main".to_owned(), main.to_owned()),
                (
                    "snip".to_owned(),
                    "{{ derived.y | length }}{% include \"inc\" %}".to_owned(),
                ),
                ("inc".to_owned(), "{{ resources.z }}".to_owned()),
            ]
        };
        let reads = |main: &str| {
            let owned = sources(main);
            let borrowed: Vec<(String, &str)> =
                owned.iter().map(|(n, s)| (n.clone(), s.as_str())).collect();
            super::template_reads("main", &borrowed).map(|r| {
                r.into_iter()
                    .map(|(k, v)| format!("{k}.{v}"))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            reads("{{ render_each(rows=derived.x, template=\"snip\") }} server-template s 1-3"),
            Some(vec![
                "derived.x".into(),
                "derived.y".into(),
                "resources.z".into()
            ])
        );
        assert_eq!(
            reads("{% set t = \"snip\" %}{{ render_each(rows=derived.x, template=t) }}"),
            None
        );
        assert_eq!(reads("{% if template == \"x\" %}{% endif %}"), Some(vec![]));
    }

    /// A row's entries are found at any hint, right or wrong, as a search finds them.
    #[test]
    fn a_rows_range_is_the_same_whatever_the_hint() {
        // Rows 0, 2 (three entries), 3, 7; none for 1, 4, 5, 6, 8.
        let list: Vec<(u32, char)> =
            vec![(0, 'a'), (2, 'b'), (2, 'c'), (2, 'd'), (3, 'e'), (7, 'f')];
        for i in 0..9u32 {
            let from = list.partition_point(|e| e.0 < i);
            let to = list.partition_point(|e| e.0 <= i);
            for hint in 0..list.len() + 3 {
                assert_eq!(
                    CallSite::row_range(&list, |e| e.0, i, hint),
                    from..to,
                    "row {i}, hint {hint}"
                );
            }
        }
        assert_eq!(
            CallSite::row_range(&[] as &[(u32, ())], |e| e.0, 4, 0),
            0..0
        );
    }

    /// The walk gives what serde gives, for every kind a status value can hold.
    #[test]
    fn status_json_by_the_walk_is_what_serde_makes() {
        let values = [
            json!(null),
            json!(true),
            json!(0),
            json!(-17),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(1.5),
            json!(-0.0),
            json!(1e300),
            json!(0.1),
            json!(""),
            json!("héllo ✓ 🚀 \u{0} \"quoted\""),
            json!([]),
            json!({}),
            json!([[], {}, [1, 2.5, "x"], {"a": []}]),
            json!({"z": 1, "a": {"nested": {"deeper": [true, false, null]}}, "m": "x"}),
            json!({"parents": [{"parentRef": {"name": "gw", "port": 80},
                "conditions": [{"type": "Accepted", "status": "True",
                    "observedGeneration": 3, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}),
        ];
        for value in values {
            let value = Value::from_serializable(&value);
            let serde = serde_json::to_value(&value).unwrap();
            assert_eq!(*super::convert(&value).unwrap(), serde, "{value}");
        }
        // Values made in a template, not read from JSON: undefined, big integers, bytes, and
        // maps with keys that are not strings.
        let mut map = tera::value::Map::new();
        map.insert(
            tera::value::Key::U64(1),
            Value::from(u128::from(u64::MAX) + 1),
        );
        map.insert(tera::value::Key::Bool(true), Value::bytes(vec![1u8, 2]));
        map.insert("1".into(), Value::from(-5i128));
        let odd = [
            Value::from(map),
            Value::from(i128::MIN),
            Value::from(7u128),
            Value::from(f64::NAN),
            Value::from(f64::INFINITY),
            Value::from(vec![Value::undefined(), Value::none()]),
        ];
        for value in odd {
            let serde = serde_json::to_value(&value).map_err(|e| e.to_string());
            assert_eq!(
                super::convert(&value).map(|j| (*j).clone()),
                serde,
                "{value}"
            );
        }
        assert_eq!(*super::convert(&Value::undefined()).unwrap(), json!(null));
    }
}
