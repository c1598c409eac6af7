//! A pool of spare backends: a new Service port gets a backend HAProxy already has, so that
//! routing to it is a runtime change (server slots and map entries), not a reload.
//!
//! HAProxy 2.6 (Debian's) cannot add a `backend` at run time. So the reference templates
//! declare the plain backends (HTTP/1.1 in clear text, no ingress-nginx policy: most of them)
//! as `pool_<n>` sections, all alike (`balance roundrobin` and the server slots), plus spare
//! ones without servers; `maps/pool.map` sends each Service port's backend name
//! (`<namespace>_<service>_<port>`, what the route maps name) to its pool backend. A new
//! Service port takes a spare: it gets its slots (HAProxy's dynamic servers, `add server`)
//! holding the endpoints, and the map gets a line, both through the runtime API. A removed
//! one leaves its pool backend spare again (`del server`). A spare without servers costs
//! HAProxy ~10 KB, one with the 10 default slots ~67 KB (`haproxy` 2.6.12's RSS with 4,000
//! backends of each kind).
//!
//! The assignment is a pure function of the backends (their names and their Services'
//! `creationTimestamp`) and of one number kept in the cluster, the reserve, so every replica
//! and a new leader compute the same, with nothing read back from HAProxy or kept from one
//! render to the next (as [`crate::slots`] does for endpoints):
//!
//! - the pool has [`Sizing::size`] backends: the reserve (`data.size` of the ConfigMap
//!   `reserve_at=` names, in the store `reserve_from=` names) while it is [`honoured`] (more
//!   than the plain backends, at most four times [`ahead`]); otherwise [`size`]'s: the plain
//!   backends plus at least a [`granule`] of spares, rounded up to a multiple of it; the
//!   granule is the step (`extraContext.haproxy.backend_pool_step`, [`DEFAULT_STEP`]; 0 turns
//!   the pool off), doubled while it stays at most a quarter of the backends (so growths get
//!   rarer at scale and probing stays short);
//! - the reserve is the controller's: each render tells it the pool's state
//!   ([`crate::PoolState`]) and its leader writes [`Sizing::wanted`] when the rendered sets
//!   pause (`haptic-controller`'s `pool_keeper`): [`ahead`] (two fifths more than the plain
//!   backends) when the spares are fewer than three tenths of them or more than half again
//!   [`ahead`]'s; a growth is then one reload made while nothing else changes, and a burst of
//!   new Services takes spares the running HAProxy has;
//! - each backend prefers `pool_<fnv1a(name) mod size>` and takes the first free one from
//!   there (linear probing), backends taken oldest Service first (`creationTimestamp`, then
//!   name).
//!
//! So a new Service, the newest, takes a free backend and moves nobody; removing one may move
//! the backends that had probed past it (each still a runtime change: the agent sets a
//! backend's servers before a map entry names it, and takes an entry away before its backend
//! gets another Service's servers). When the pool's size changes (the reserve written, or the
//! plain backends crossing a step of [`size`] without one), every backend is assigned afresh
//! and the set needs one reload.
//!
//! ```
//! use haptic_render::pool::{assign, Member};
//!
//! let members = [
//!     Member { name: "shop_web_80", created: "2026-01-01T00:00:00Z" },
//!     Member { name: "shop_api_80", created: "2026-01-02T00:00:00Z" },
//! ];
//! let (size, slots) = assign(&members, 32);
//! assert_eq!(size, 64);
//! assert_ne!(slots[0], slots[1]);
//! // The same backends, listed in another order: the same assignment.
//! let (_, again) = assign(&[members[1], members[0]], 32);
//! assert_eq!((again[1], again[0]), (slots[0], slots[1]));
//! ```

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::{Arc, Mutex};

use tera::value::{Key, Map};
use tera::{Kwargs, State, Tera, Value};

use crate::fragments::{AddressHasher, identity};
use crate::slots::fnv1a;
use crate::value::map_value;

/// Maps keyed by a row's identity (an address, not chosen by anyone): one multiplication a
/// key, where the standard map's SipHash cost ~0.5 ms of a render that assigns 10,000
/// backends again.
type ByAddress<V> = HashMap<usize, V, BuildHasherDefault<AddressHasher>>;

/// Maps keyed by names the cluster chooses: ahash's keyed hasher (as the derived views').
type ByName<K, V> = HashMap<K, V, ahash::RandomState>;

/// The pool's step when the template does not say (`extraContext.haproxy.backend_pool_step`).
pub const DEFAULT_STEP: usize = 32;

/// The name of pool backend `index`.
pub fn backend_name(index: usize) -> String {
    format!("pool_{index}")
}

/// A backend as the assignment reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member<'a> {
    /// Its name (what the route maps name).
    pub name: &'a str,
    /// Its Service's `metadata.creationTimestamp` (RFC 3339, which sorts as time does).
    pub created: &'a str,
}

/// How many backends the pool has for `used` plain backends: `used` plus at least one
/// [`granule`] of spares, rounded up to a multiple of the granule; 0 when `step` is 0.
pub fn size(used: usize, step: usize) -> usize {
    if step == 0 {
        return 0;
    }
    let granule = granule(used, step);
    (used + granule).div_ceil(granule) * granule
}

/// The unit the pool grows by: `step`, doubled while it stays at most a quarter of `used`.
/// So a growth (a reload) comes once per `step` new backends in a small cluster, and once per
/// about a quarter more of them at scale (every 2,048 at 10,000), rather than every `step`,
/// and probing stays short (the pool is at least an eighth larger than what it holds). A
/// spare has no servers (~10 KB of a HAProxy worker): 2,048 to 4,096 of them at 10,000 cost a
/// worker less than the 1,024 to 2,048 spares of 10 slots each did before (~67 KB each), when
/// the granule stopped at an eighth.
pub fn granule(used: usize, step: usize) -> usize {
    let mut granule = step.max(1);
    while granule.saturating_mul(2) <= used / 4 {
        granule *= 2;
    }
    granule
}

/// The size a quiet cluster's pool is grown (or shrunk) to for `used` plain backends, ahead of
/// need: `used` plus two fifths of it (at least a [`granule`]), rounded up to a multiple of the
/// granule. At 10,000 backends 14,336: a burst of 4,000 new Services routed without a reload.
/// 0 when `step` is 0.
pub fn ahead(used: usize, step: usize) -> usize {
    if step == 0 {
        return 0;
    }
    let granule = granule(used, step);
    (used + (used * 2 / 5).max(granule)).div_ceil(granule) * granule
}

/// Whether a reserve (the size a leader chose in a pause, kept in the cluster) sizes a pool of
/// `used` plain backends: it leaves at least one spare and is at most four times [`ahead`] (a
/// value typed by hand cannot make a pool of millions).
pub fn honoured(reserve: usize, used: usize, step: usize) -> bool {
    step > 0 && reserve > used && reserve <= ahead(used, step).saturating_mul(4)
}

/// How the pool is sized: its step and the reserve read from the cluster, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// The step (0: no pool).
    pub step: usize,
    /// The reserve, when one is kept and [`honoured`] or not.
    pub reserve: Option<usize>,
}

impl Sizing {
    /// A step without a reserve: the pool is [`size`]'s.
    pub fn new(step: usize) -> Self {
        Self {
            step,
            reserve: None,
        }
    }

    /// The pool's size for `used` plain backends: the reserve while it is [`honoured`],
    /// otherwise [`size`]'s (a pure function of `used`, growing a granule at a time).
    pub fn size(&self, used: usize) -> usize {
        match self.reserve {
            Some(reserve) if honoured(reserve, used, self.step) => reserve,
            _ => size(used, self.step),
        }
    }

    /// The reserve a leader keeps in a pause for `used` plain backends: the size now while it
    /// leaves at least three tenths of `used` spare and is at most half again [`ahead`]'s (then
    /// writing it changes nothing rendered: it only pins the size), otherwise [`ahead`] (a
    /// growth or a shrink, one reload, done while nothing else changes). 0 when there is no
    /// pool.
    pub fn wanted(&self, used: usize) -> usize {
        if self.step == 0 {
            return 0;
        }
        let now = self.size(used);
        let ahead = ahead(used, self.step);
        if now - used < used * 3 / 10 || now > ahead + ahead / 2 {
            ahead
        } else {
            now
        }
    }
}

/// The pool's size and each member's pool backend, in `members`' order (see the module docs).
/// A name listed twice gets one backend.
pub fn assign(members: &[Member<'_>], step: usize) -> (usize, Vec<usize>) {
    assign_sized(members, size(members.len(), step))
}

/// [`assign`] in a pool of `size` backends (at least as many as `members` hold names; 0: no
/// pool).
pub fn assign_sized(members: &[Member<'_>], size: usize) -> (usize, Vec<usize>) {
    let mut slots = vec![usize::MAX; members.len()];
    if size == 0 {
        return (0, slots);
    }
    let mut order: Vec<usize> = (0..members.len()).collect();
    // Members alike in both keys have the same name, so the same backend: their order
    // among themselves does not matter.
    order.sort_unstable_by(|&a, &b| {
        let (a, b) = (&members[a], &members[b]);
        (a.created, a.name).cmp(&(b.created, b.name))
    });
    let mut taken = vec![false; size];
    let mut by_name: ByName<&str, usize> =
        ByName::with_capacity_and_hasher(members.len(), ahash::RandomState::new());
    for i in order {
        let name = members[i].name;
        if let Some(&slot) = by_name.get(name) {
            slots[i] = slot;
            continue;
        }
        // Fewer members than backends: a free one is always found.
        #[allow(clippy::cast_possible_truncation)]
        let home = (fnv1a(name) % size as u64) as usize;
        let Some(slot) = (0..size)
            .map(|k| (home + k) % size)
            .find(|&slot| !taken[slot])
        else {
            break;
        };
        taken[slot] = true;
        slots[i] = slot;
        by_name.insert(name, slot);
    }
    (size, slots)
}

/// Whether a backend row is a plain one, which the pool takes: a map with no ingress-nginx
/// policy and no `appProtocol` (the pool's backends are all alike).
fn plain(row: &Value) -> bool {
    row.as_map().is_some()
        && !field(row, "policy").is_some_and(Value::is_truthy)
        && !field(row, "app_protocol").is_some_and(Value::is_truthy)
}

fn field<'a>(row: &'a Value, key: &'static str) -> Option<&'a Value> {
    row.as_map().and_then(|m| m.get(&Key::Str(key)))
}

fn text<'a>(row: &'a Value, key: &'static str) -> &'a str {
    field(row, key).and_then(Value::as_str).unwrap_or("")
}

/// What the last call computed, reused while its input is the same value.
///
/// Derived views keep the row of every resource that did not change as the very same value,
/// so most calls see the rows of the last one, in a new list: reading each row's fields
/// again (13,000 rows scattered in memory at 10,000 Services) cost 20 ms a render. So what
/// a row gives is kept by its identity, and a list of the same rows gives the last answer.
struct Memo {
    /// The rows list of the last call (held, so that identities stay its rows').
    input: Option<Value>,
    /// The step and the reserve it was sized with.
    sizing: Sizing,
    /// The identities of its rows, in order.
    ids: Vec<usize>,
    /// Per row identity: whether the pool takes it, its name and Service age, and (for a
    /// plain row) its pool backend and output row.
    known: ByAddress<Known>,
    /// The members of the last assignment (name, created), in row order, with the identity
    /// of their row.
    members: Vec<(usize, Arc<str>, Arc<str>)>,
    /// Their pool backends.
    slots: Vec<usize>,
    size: usize,
    /// Spare rows, by pool index.
    spares: HashMap<usize, Value>,
    /// Each member's name to its pool backend (a name listed twice: its last row's, as
    /// `names` has it), for the names a call asks for and to tell a name already taken.
    by_name: ByName<Arc<str>, usize>,
    /// `names` of every member, made when a call asks for all of them and kept until the
    /// members change: a map of 10,000 names rebuilt on every new route was ~0.7 ms of a
    /// render (the engine builds a map by hashing each key again).
    all_names: Option<Value>,
    map: Value,
    /// The output's `rows`, as the list value every call gives (the same list while nothing
    /// changed, which a `render_each` over it reuses whole); made when a call asks for it
    /// (`flat`), kept until the rows change: a list of 12,000 rows made again on every change
    /// was ~0.4 ms of an EndpointSlice's render, for templates that read `groups` alone.
    rows_value: Option<Value>,
    /// The output's rows (the value's own list), to patch a few of.
    rows: Vec<Value>,
    /// The output's `groups`: `rows` in runs (the rows before the pool, `b:<name>`, in runs
    /// their rows bound ([`before_runs`]), then the pool's, `p<k>`, in runs of [`GROUP`]
    /// backends), each with its id and the very list it was while its
    /// rows are the same rows.
    groups: Vec<(String, Value)>,
    /// The list of `groups`.
    groups_value: Value,
    /// Where the rows before the pool may end a group ([`before_runs`]).
    cuts: Cuts,
    /// Per row of the input, in order: its place in `rows`, if it has one (a pooled row's
    /// name listed before takes none), and its place in `members`, if it is one.
    places: Vec<(Option<usize>, Option<usize>)>,
    /// Emptied lists a splice builds the next `rows`, `places` and pool rows in
    /// ([`Memo::splice`]): the last splice's, kept with their room.
    spare_rows: Vec<Value>,
    spare_places: Vec<(Option<usize>, Option<usize>)>,
    spare_pool: Vec<Value>,
    /// Answers [`Memo::insert`] gave (the tests check that it is taken).
    inserted: u64,
    /// Answers [`Memo::splice`] gave (the tests check that it is taken), and the rounds it
    /// started over with another cluster.
    spliced: u64,
    spliced_wider: u64,
}

/// At most this many rows changed (the others the same values, in the same order) are
/// patched into the last answer ([`Memo::patch`]); more are computed afresh.
const PATCH_MAX: usize = 64;

/// The most rows in one of the output's `groups`. A template that renders each group with a
/// `render_each` call of its own (the reference's `haproxy.cfg`) renders and copies the
/// group that changed, ~380 KB at 512 backends, not the whole pool's 7 MB at 10,000.
pub const GROUP: usize = 512;

/// The rows before the pool (in the order of the backends) in groups whose bounds their own
/// rows set: a group ends after a row whose name hashes to 0 modulo [`GROUP`] (about
/// [`GROUP`] rows a group), or at twice that. A backend that leaves the pool for there (its
/// `appProtocol` set) or comes or goes makes a new list of its own group alone: runs cut by
/// place made every later group a new list (at 10,000 Services with 2,500 such backends,
/// half of them rendered again). Each group's id is its first row's name (`b:<name>`; a name
/// seen before gets `~<k>`), so a group keeps its call site while its first row stays.
///
/// `known` has the rows' names by their identity (reading each row's own map again, 2,500 of
/// them scattered in memory, was 1.5 ms of such a render).
fn before_runs<'a>(
    rows: &'a [Value],
    known: &ByAddress<Known>,
    cache: &mut Cuts,
) -> Vec<(String, &'a [Value])> {
    let name = |row: &'a Value| -> &str {
        identity(row)
            .and_then(|id| known.get(&id))
            .map_or_else(|| text(row, "name"), |k| &k.name)
    };
    // Whether a group may end after each row, from the last call's for the rows it had
    // before and after the run that changed (a lookup of each row's name cost ~0.4 ms of an
    // EndpointSlice's render at 2,500 such rows).
    let ids: Vec<usize> = rows.iter().map(|row| identity(row).unwrap_or(0)).collect();
    let head = ids
        .iter()
        .zip(&cache.ids)
        .take_while(|(now, was)| now == was && **now != 0)
        .count();
    let tail = ids[head..]
        .iter()
        .rev()
        .zip(cache.ids[head..].iter().rev())
        .take_while(|(now, was)| now == was && **now != 0)
        .count();
    #[allow(clippy::cast_possible_truncation)]
    let cut_at = |row: &'a Value| fnv1a(name(row)).is_multiple_of(GROUP as u64);
    let cuts: Vec<bool> = cache.cuts[..head]
        .iter()
        .copied()
        .chain(rows[head..rows.len() - tail].iter().map(cut_at))
        .chain(cache.cuts[cache.cuts.len() - tail..].iter().copied())
        .collect();
    let mut runs = Vec::with_capacity(rows.len() / GROUP + 1);
    let mut seen: ByName<String, ()> = ByName::default();
    let mut start = 0;
    for (at, &cut) in cuts.iter().enumerate() {
        let len = at + 1 - start;
        if cut || len >= 2 * GROUP || at + 1 == rows.len() {
            let run = &rows[start..=at];
            let first = name(&run[0]);
            let mut id = format!("b:{first}");
            let mut k = 1;
            while seen.contains_key(&id) {
                id = format!("b:{first}~{k}");
                k += 1;
            }
            seen.insert(id.clone(), ());
            runs.push((id, run));
            start = at + 1;
        }
    }
    *cache = Cuts { ids, cuts };
    runs
}

/// The rows before the pool at the last call (their identities), and whether a group may
/// end after each ([`before_runs`]).
#[derive(Default)]
struct Cuts {
    ids: Vec<usize>,
    cuts: Vec<bool>,
}

/// What one row gave the last call.
#[derive(Clone)]
struct Known {
    plain: bool,
    name: Arc<str>,
    created: Arc<str>,
    /// Its pool backend and its output row, once placed.
    placed: Option<(usize, Value)>,
}

impl Default for Memo {
    fn default() -> Self {
        Self {
            input: None,
            sizing: Sizing::new(0),
            ids: Vec::new(),
            known: ByAddress::default(),
            members: Vec::new(),
            slots: Vec::new(),
            size: 0,
            spares: HashMap::new(),
            by_name: ByName::default(),
            all_names: None,
            map: Value::from(""),
            rows_value: None,
            rows: Vec::new(),
            groups: Vec::new(),
            groups_value: Value::from(Vec::<Value>::new()),
            cuts: Cuts::default(),
            places: Vec::new(),
            spare_rows: Vec::new(),
            spare_places: Vec::new(),
            spare_pool: Vec::new(),
            inserted: 0,
            spliced: 0,
            spliced_wider: 0,
        }
    }
}

impl Memo {
    /// `rows` changed: the list value made again, and each group that holds other rows than
    /// it did (the rows before the pool and the pool's rows are grouped apart, so that a
    /// backend added before the pool moves no pool group).
    fn rows_changed(&mut self) {
        self.rows_value = None;
        let pooled_from = self.rows.len().saturating_sub(self.size);
        let (before, pooled) = self.rows.split_at(pooled_from);
        // Ids apart for the two parts: a pool group keeps its id (and so its call site in a
        // template that renders each group with a call of its own, `args=g.id`) however many
        // groups the rows before the pool take. The pool's rows are in runs by place (a
        // backend's place is fixed); the others by content ([`before_runs`]: a row added
        // there shifts every later row).
        let runs = before_runs(before, &self.known, &mut self.cuts)
            .into_iter()
            .chain(
                pooled
                    .chunks(GROUP)
                    .enumerate()
                    .map(|(k, run)| (format!("p{k}"), run)),
            );
        let same = |group: &Value, run: &[Value]| {
            group.as_array().is_some_and(|rows| {
                rows.len() == run.len()
                    && rows
                        .iter()
                        .zip(run)
                        .all(|(a, b)| identity(a).is_some() && identity(a) == identity(b))
            })
        };
        let last: HashMap<&str, &Value> = self
            .groups
            .iter()
            .map(|(id, rows)| (id.as_str(), rows))
            .collect();
        let groups: Vec<(String, Value)> = runs
            .map(|(id, run)| {
                let rows = match last.get(id.as_str()) {
                    Some(rows) if same(rows, run) => Value::clone(rows),
                    _ => Value::from(run),
                };
                (id, rows)
            })
            .collect();
        let listed: Vec<Value> = groups
            .iter()
            .map(|(id, rows)| map_value([("id", Value::from(id.as_str())), ("rows", rows.clone())]))
            .collect();
        self.groups_value = Value::from(listed);
        self.groups = groups;
    }

    #[cfg(test)]
    fn pool(
        &mut self,
        rows: &Value,
        step: usize,
        only: Option<&[String]>,
    ) -> tera::TeraResult<Value> {
        self.pool_with(rows, Sizing::new(step), only, true)
    }

    /// [`Memo::pool`], with the flat `rows` list in the answer or not (`flat`).
    fn pool_with(
        &mut self,
        rows: &Value,
        sizing: Sizing,
        only: Option<&[String]>,
        flat: bool,
    ) -> tera::TeraResult<Value> {
        self.rows_for(rows, sizing)?;
        Ok(self.answer(only, flat))
    }

    /// Brings the output's rows and the assignment up to date with `rows`.
    fn rows_for(&mut self, rows: &Value, sizing: Sizing) -> tera::TeraResult<()> {
        let list = rows.as_array().ok_or_else(|| {
            tera::Error::message(format!(
                "backend_pool: `rows` must be a list of backend rows, got {}",
                rows.name()
            ))
        })?;
        let ids: Vec<usize> = list.iter().map(|row| identity(row).unwrap_or(0)).collect();
        // The same rows (a view recomputed to the same rows, or the same list): the last answer.
        if self.input.is_some() && self.sizing == sizing && ids == self.ids {
            self.input = Some(rows.clone());
            return Ok(());
        }
        if self.patch(rows, list, &ids, sizing).is_some()
            || self.insert(rows, list, &ids, sizing).is_some()
            || self.splice(rows, list, &ids, sizing).is_some()
        {
            return Ok(());
        }
        let mut known: ByAddress<Known> =
            ByAddress::with_capacity_and_hasher(list.len(), Default::default());
        for (row, &id) in list.iter().zip(&ids) {
            let entry = self.known.remove(&id).unwrap_or_else(|| Known {
                plain: plain(row),
                name: Arc::from(text(row, "name")),
                created: Arc::from(text(row, "created")),
                placed: None,
            });
            known.insert(id, entry);
        }
        let plain_ids: Vec<usize> = if sizing.step == 0 {
            Vec::new()
        } else {
            ids.iter()
                .copied()
                .filter(|id| known.get(id).is_some_and(|k| k.plain))
                .collect()
        };
        let same_members = self.sizing == sizing
            && self.members.len() == plain_ids.len()
            && self
                .members
                .iter()
                .zip(&plain_ids)
                .all(|((was, name, created), id)| {
                    *was == *id
                        || known
                            .get(id)
                            .is_some_and(|k| k.name == *name && k.created == *created)
                });
        let members: Vec<(usize, Arc<str>, Arc<str>)> = plain_ids
            .iter()
            .filter_map(|id| {
                let k = known.get(id)?;
                Some((*id, Arc::clone(&k.name), Arc::clone(&k.created)))
            })
            .collect();
        if !same_members {
            let assigned: Vec<Member<'_>> = members
                .iter()
                .map(|(_, name, created)| Member { name, created })
                .collect();
            let (size, slots) = assign_sized(&assigned, sizing.size(assigned.len()));
            let mut by_name =
                ByName::with_capacity_and_hasher(assigned.len(), ahash::RandomState::new());
            let mut map = String::with_capacity(assigned.len() * 40);
            for ((_, name, _), slot) in members.iter().zip(&slots) {
                let pool = backend_name(*slot);
                map.push_str(name);
                map.push(' ');
                map.push_str(&pool);
                map.push('\n');
                by_name.insert(Arc::clone(name), *slot);
            }
            if size != self.size {
                self.spares.clear();
            }
            (self.size, self.slots) = (size, slots);
            self.by_name = by_name;
            self.all_names = None;
            self.map = Value::from(map);
        }
        self.members = members;
        // The rows: the other backends as they are, then the pool's in pool order; and where
        // each row of the input went.
        let mut places: Vec<(Option<usize>, Option<usize>)> = vec![(None, None); list.len()];
        let mut out: Vec<Value> = Vec::with_capacity(list.len());
        let mut member = 0;
        for ((row, id), place) in list.iter().zip(&ids).zip(&mut places) {
            if sizing.step == 0 || !known.get(id).is_some_and(|k| k.plain) {
                place.0 = Some(out.len());
                out.push(row.clone());
            } else {
                place.1 = Some(member);
                member += 1;
            }
        }
        let pooled_from = out.len();
        // The input row of each member (`members` are the plain rows, in input order).
        let member_rows: Vec<usize> = places
            .iter()
            .enumerate()
            .filter(|(_, (_, member))| member.is_some())
            .map(|(at, _)| at)
            .collect();
        let mut pool: Vec<Option<Value>> = vec![None; self.size];
        // The rows to copy under their pool name: a new row, or one that moved.
        let copies = self
            .members
            .iter()
            .zip(&self.slots)
            .any(|((id, _, _), slot)| {
                known
                    .get(id)
                    .is_none_or(|k| k.placed.as_ref().is_none_or(|(was, _)| was != slot))
            });
        let rows_by_id: ByAddress<&Value> = if copies {
            list.iter().zip(&ids).map(|(row, id)| (*id, row)).collect()
        } else {
            ByAddress::default()
        };
        for (m, ((id, _, _), &slot)) in self.members.iter().zip(&self.slots).enumerate() {
            let Some(place) = pool.get_mut(slot) else {
                continue;
            };
            if place.is_some() {
                // A name listed twice: its first row is the backend.
                continue;
            }
            if let Some(&at) = member_rows.get(m) {
                places[at].0 = Some(pooled_from + slot);
            }
            let Some(k) = known.get_mut(id) else {
                continue;
            };
            let value = match &k.placed {
                Some((was, value)) if *was == slot => value.clone(),
                _ => {
                    let Some(row) = rows_by_id.get(id) else {
                        continue;
                    };
                    let value = pooled(row, slot);
                    k.placed = Some((slot, value.clone()));
                    value
                }
            };
            *place = Some(value);
        }
        for (index, place) in pool.into_iter().enumerate() {
            out.push(match place {
                Some(value) => value,
                None => self
                    .spares
                    .entry(index)
                    .or_insert_with(|| spare(index))
                    .clone(),
            });
        }
        self.known = known;
        self.ids = ids;
        self.input = Some(rows.clone());
        self.sizing = sizing;
        self.places = places;
        self.rows = out;
        self.rows_changed();
        Ok(())
    }

    /// The answer for `self.rows` and the assignment, with `names` of the members `only`
    /// names (those of them that are members), or of every member.
    fn answer(&mut self, only: Option<&[String]>, flat: bool) -> Value {
        let names = match only {
            Some(only) => {
                let mut names = Map::with_capacity(only.len());
                for name in only {
                    if let Some(slot) = self.by_name.get(name.as_str()) {
                        names.insert(
                            Key::String(Arc::from(name.as_str())),
                            Value::from(backend_name(*slot)),
                        );
                    }
                }
                Value::from(names)
            }
            None => self
                .all_names
                .get_or_insert_with(|| {
                    // In member order, a name listed twice at its first place with its last
                    // row's backend, as a map built member by member has it.
                    let mut names = Map::with_capacity(self.members.len());
                    for ((_, name, _), slot) in self.members.iter().zip(&self.slots) {
                        names.insert(
                            Key::String(Arc::clone(name)),
                            Value::from(backend_name(*slot)),
                        );
                    }
                    Value::from(names)
                })
                .clone(),
        };
        let rows = flat.then(|| {
            self.rows_value
                .get_or_insert_with(|| Value::from(self.rows.as_slice()))
                .clone()
        });
        map_value(rows.map(|rows| ("rows", rows)).into_iter().chain([
            ("groups", self.groups_value.clone()),
            ("names", names),
            ("map", self.map.clone()),
            ("size", Value::from(self.size)),
            ("used", Value::from(self.members.len())),
        ]))
    }

    /// The last answer with a few rows replaced, when `list` (of identities `ids`) is the last
    /// input but for at most [`PATCH_MAX`] rows at the same places (an EndpointSlice event at
    /// 10,000 Services changes one), each of which the pool takes exactly as its predecessor
    /// (plain or not; when plain, the same name and age): then the assignment, the names and
    /// the map stay, and each changed row replaces its predecessor's output row. Recomputing
    /// the whole answer (maps and lists of every row's identity) was a sixth of such a render.
    /// `None` when that does not hold.
    fn patch(&mut self, rows: &Value, list: &[Value], ids: &[usize], sizing: Sizing) -> Option<()> {
        if self.input.is_none()
            || self.sizing != sizing
            || ids.len() != self.ids.len()
            || self.places.len() != ids.len()
        {
            return None;
        }
        let changed: Vec<usize> = (0..ids.len())
            .filter(|&at| ids[at] != self.ids[at])
            .collect();
        if changed.len() > PATCH_MAX {
            return None;
        }
        for &at in &changed {
            // A row without an identity (not a map) is not known apart from another.
            let (was, now) = (self.ids[at], ids[at]);
            let known = self.known.get(&was)?;
            let row = &list[at];
            let same = was != 0
                && now != 0
                && !self.known.contains_key(&now)
                && plain(row) == known.plain
                && (!known.plain
                    || (text(row, "name") == &*known.name
                        && text(row, "created") == &*known.created));
            if !same {
                return None;
            }
        }
        let pooled_from = self.rows.len() - self.size;
        for &at in &changed {
            let (was, now) = (self.ids[at], ids[at]);
            let row = &list[at];
            let mut known = self.known.remove(&was)?;
            known.placed = None;
            if !known.plain {
                known.name = Arc::from(text(row, "name"));
                known.created = Arc::from(text(row, "created"));
            }
            let (output, member) = self.places[at];
            if let Some(member) = member
                && let Some(entry) = self.members.get_mut(member)
            {
                entry.0 = now;
            }
            if let Some(place) = output {
                let value = match member {
                    Some(_) => {
                        let slot = place - pooled_from;
                        let value = pooled(row, slot);
                        known.placed = Some((slot, value.clone()));
                        value
                    }
                    None => row.clone(),
                };
                self.rows[place] = value;
            }
            self.known.insert(now, known);
            self.ids[at] = now;
        }
        self.input = Some(rows.clone());
        self.rows_changed();
        Some(())
    }
}

impl Memo {
    /// The last answer with one plain row added, when it is the newest member (its Service
    /// created after every other's, or at the same time with a later name), of a name no
    /// member has, and the pool keeps its size: the assignment takes members oldest first
    /// and each probes from its home for the first free backend, so every member keeps its
    /// backend and the new one takes the first free from its home (what [`assign`] gives).
    /// HAPTIC's protocol (a new Service, routed) is such a change; computing the answer afresh
    /// was ~5 ms a render at 10,000 Services. `None` when that does not hold.
    fn insert(
        &mut self,
        rows: &Value,
        list: &[Value],
        ids: &[usize],
        sizing: Sizing,
    ) -> Option<()> {
        if self.input.is_none()
            || sizing.step == 0
            || self.sizing != sizing
            || ids.len() != self.ids.len() + 1
            || self.places.len() != self.ids.len()
        {
            return None;
        }
        // The one row added: the lists agree before and after it.
        let at = ids
            .iter()
            .zip(&self.ids)
            .take_while(|(now, was)| now == was)
            .count();
        if ids[at + 1..] != self.ids[at..] {
            return None;
        }
        let (id, row) = (ids[at], &list[at]);
        let (name, created) = (text(row, "name"), text(row, "created"));
        // A name listed twice has one entry in `by_name` and a line per row in the map: the
        // places below count on neither.
        if id == 0
            || self.by_name.len() != self.members.len()
            || self.known.contains_key(&id)
            || !plain(row)
            || self.by_name.contains_key(name)
            || self
                .members
                .iter()
                .any(|(_, was_name, was_created)| (&**was_created, &**was_name) >= (created, name))
            || sizing.size(self.members.len() + 1) != self.size
        {
            return None;
        }
        let mut taken = vec![false; self.size];
        for &slot in &self.slots {
            *taken.get_mut(slot)? = true;
        }
        #[allow(clippy::cast_possible_truncation)]
        let home = (fnv1a(name) % self.size as u64) as usize;
        let slot = (0..self.size)
            .map(|k| (home + k) % self.size)
            .find(|&slot| !taken[slot])?;
        // Its place among the members (they are the plain rows, in row order).
        let member = self.places[..at]
            .iter()
            .filter(|(_, member)| member.is_some())
            .count();
        let pool = backend_name(slot);
        // The map's lines are the members', in order: the new one goes after `member` of them.
        let map = self.map.as_str()?;
        let line_at = match member.checked_sub(1) {
            None => 0,
            Some(before) => map.match_indices('\n').nth(before)?.0 + 1,
        };
        let mut text_map = String::with_capacity(map.len() + name.len() + pool.len() + 2);
        text_map.push_str(&map[..line_at]);
        text_map.push_str(name);
        text_map.push(' ');
        text_map.push_str(&pool);
        text_map.push('\n');
        text_map.push_str(&map[line_at..]);
        // The output: the other backends' rows as they were, the pool's by pool index.
        let place = self.rows.len() - self.size + slot;
        let value = pooled(row, slot);
        *self.rows.get_mut(place)? = value.clone();
        for (_, later) in &mut self.places[at..] {
            if let Some(index) = later {
                *index += 1;
            }
        }
        self.places.insert(at, (Some(place), Some(member)));
        let (name, created): (Arc<str>, Arc<str>) = (Arc::from(name), Arc::from(created));
        self.by_name.insert(Arc::clone(&name), slot);
        self.members
            .insert(member, (id, Arc::clone(&name), Arc::clone(&created)));
        self.slots.insert(member, slot);
        self.known.insert(
            id,
            Known {
                plain: true,
                name,
                created,
                placed: Some((slot, value)),
            },
        );
        self.all_names = None;
        self.map = Value::from(text_map);
        self.ids = ids.to_vec();
        self.input = Some(rows.clone());
        self.rows_changed();
        self.inserted += 1;
        Some(())
    }
}

/// Who a slot of the pool is taken by while [`Memo::splice`] places members again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taken {
    Free,
    /// A member that keeps its backend (its index in the last `members`).
    Kept(usize),
    /// A member placed again in this round.
    Placed,
}

/// What [`Memo::splice`] found: the run of rows changed (`before..old_end` of the last rows,
/// `before..new_end` of the new), the members that leave (`first_gone`, `gone` of them),
/// how many there are now, the run's new rows and which of them join, and each member placed
/// again with its backend.
struct Splice {
    before: usize,
    old_end: usize,
    new_end: usize,
    first_gone: usize,
    gone: usize,
    count: usize,
    fresh: Vec<(usize, Known)>,
    joining: Vec<usize>,
    placed: Vec<(Again, usize)>,
}

/// A member [`Memo::splice`] places again: one of the last members, or one of the new rows.
#[derive(Clone, Copy)]
enum Again {
    Old(usize),
    New(usize),
}

impl Memo {
    /// The last answer with one run of rows replaced, added or dropped (at most
    /// [`PATCH_MAX`], each a row the last call did not have), when the pool keeps its size and
    /// no name is listed twice: a Service port whose `appProtocol` or policy changed leaves the
    /// pool or joins it again, a Service older than the newest comes or goes. Computing the
    /// answer afresh (each row's identity kept in a map of 10,000, every member assigned again)
    /// was ~5 ms of such a render at 10,000 Services.
    ///
    /// The members the change can move are placed again, the others keep their backends, and
    /// the result is [`assign`]'s: a member's probe from its home to its backend runs over
    /// backends taken before it, all in one cluster (a run of taken backends between free
    /// ones) of the last assignment. So members outside the clusters that hold a member that
    /// left, or the home of one that joined, probe over what they did and keep their backends;
    /// the members of those clusters and the new ones are placed again oldest first among the
    /// others' backends. Should one of them probe past its cluster's free end onto a backend
    /// another cluster keeps, that cluster is placed again too, and the round starts over.
    /// `None` when that does not hold.
    fn splice(
        &mut self,
        rows: &Value,
        list: &[Value],
        ids: &[usize],
        sizing: Sizing,
    ) -> Option<()> {
        if self.input.is_none()
            || sizing.step == 0
            || self.sizing != sizing
            || self.places.len() != self.ids.len()
            || self.by_name.len() != self.members.len()
            || self.members.len() != self.slots.len()
        {
            return None;
        }
        // The run that differs: rows before and after it are the last call's, in order.
        let before = ids
            .iter()
            .zip(&self.ids)
            .take_while(|(now, was)| now == was)
            .count();
        let after = ids[before..]
            .iter()
            .rev()
            .zip(self.ids[before..].iter().rev())
            .take_while(|(now, was)| now == was)
            .count();
        let (old_end, new_end) = (self.ids.len() - after, ids.len() - after);
        if (old_end - before) + (new_end - before) > PATCH_MAX {
            return None;
        }
        let mut fresh: Vec<(usize, Known)> = Vec::with_capacity(new_end - before);
        for (row, &id) in list[before..new_end].iter().zip(&ids[before..new_end]) {
            // A row the last call had elsewhere (rows reordered): computed afresh.
            if id == 0 || self.known.contains_key(&id) {
                return None;
            }
            fresh.push((
                id,
                Known {
                    plain: plain(row),
                    name: Arc::from(text(row, "name")),
                    created: Arc::from(text(row, "created")),
                    placed: None,
                },
            ));
        }
        // The last members: those before the run, in it (they leave), after it.
        let first_gone = self.places[..before]
            .iter()
            .filter(|(_, member)| member.is_some())
            .count();
        let gone = self.places[before..old_end]
            .iter()
            .filter(|(_, member)| member.is_some())
            .count();
        let joining: Vec<usize> = (0..fresh.len()).filter(|&k| fresh[k].1.plain).collect();
        let count = self.members.len() - gone + joining.len();
        if sizing.size(count) != self.size || count >= self.size {
            return None;
        }
        let size = self.size;
        let leaving = first_gone..first_gone + gone;
        // A name listed twice (with a member that stays, or among the new rows): computed
        // afresh, as `assign` gives such a name one backend.
        let mut names: ByName<&str, ()> = ByName::default();
        for &k in &joining {
            let name = &*fresh[k].1.name;
            let taken_by_stayer = self
                .by_name
                .get(name)
                .is_some_and(|_| !self.members[leaving.clone()].iter().any(|m| &*m.1 == name));
            if taken_by_stayer || names.insert(name, ()).is_some() {
                return None;
            }
        }
        let mut owner: Vec<Taken> = vec![Taken::Free; size];
        for (m, &slot) in self.slots.iter().enumerate() {
            *owner.get_mut(slot)? = Taken::Kept(m);
        }
        #[allow(clippy::cast_possible_truncation)]
        let home = |name: &str| (fnv1a(name) % size as u64) as usize;
        // The members placed again: those of the clusters touched, from the backend touched
        // on (a member before it in its cluster probed over backends before its own only).
        let mut again = vec![false; self.members.len()];
        let cluster = |owner: &[Taken], again: &mut [bool], slot: usize| {
            if owner[slot] == Taken::Free {
                return;
            }
            for k in 0..size {
                match owner[(slot + k) % size] {
                    Taken::Kept(m) => again[m] = true,
                    _ => break,
                }
            }
        };
        for m in leaving.clone() {
            cluster(&owner, &mut again, self.slots[m]);
        }
        for &k in &joining {
            cluster(&owner, &mut again, home(&fresh[k].1.name));
        }
        let placed: Vec<(Again, usize)> = loop {
            let mut order: Vec<Again> = (0..self.members.len())
                .filter(|m| again[*m] && !leaving.contains(m))
                .map(Again::Old)
                .chain(joining.iter().map(|&k| Again::New(k)))
                .collect();
            let key = |who: &Again| -> (&str, &str) {
                match *who {
                    Again::Old(m) => (&self.members[m].2, &self.members[m].1),
                    Again::New(k) => (&fresh[k].1.created, &fresh[k].1.name),
                }
            };
            order.sort_unstable_by(|a, b| key(a).cmp(&key(b)));
            let mut round = owner.clone();
            for (m, slot) in self.slots.iter().enumerate() {
                if again[m] || leaving.contains(&m) {
                    round[*slot] = Taken::Free;
                }
            }
            let mut placed = Vec::with_capacity(order.len());
            let mut past = None;
            'members: for who in order {
                let start = home(key(&who).1);
                for k in 0..size {
                    let slot = (start + k) % size;
                    match round[slot] {
                        Taken::Free => {
                            round[slot] = Taken::Placed;
                            placed.push((who, slot));
                            continue 'members;
                        }
                        Taken::Placed => {}
                        Taken::Kept(_) => {
                            past = Some(slot);
                            break 'members;
                        }
                    }
                }
                return None;
            }
            match past {
                None => break placed,
                Some(slot) => {
                    self.spliced_wider += 1;
                    cluster(&owner, &mut again, slot);
                }
            }
        };
        let change = Splice {
            before,
            old_end,
            new_end,
            first_gone,
            gone,
            count,
            fresh,
            joining,
            placed,
        };
        if self.apply_splice(rows, list, ids, change).is_none() {
            // Left half-written (nothing known leads here): the answer is computed afresh.
            *self = Self {
                inserted: self.inserted,
                spliced: self.spliced,
                spliced_wider: self.spliced_wider,
                ..Self::default()
            };
            return None;
        }
        self.spliced += 1;
        Some(())
    }

    /// [`Memo::splice`]'s change applied: the members and their backends, the output's rows,
    /// the map, the names. `None` (when something is not as the change says) leaves the memo
    /// half-written.
    fn apply_splice(
        &mut self,
        rows: &Value,
        list: &[Value],
        ids: &[usize],
        change: Splice,
    ) -> Option<()> {
        let Splice {
            before,
            old_end,
            new_end,
            first_gone,
            gone,
            count,
            mut fresh,
            joining,
            placed,
        } = change;
        let size = self.size;
        let leaving = first_gone..first_gone + gone;
        // The new members and backends, in row order.
        let mut new_slot: Vec<Option<usize>> = vec![None; fresh.len()];
        let mut moved: ByAddress<usize> = ByAddress::default();
        for &(who, slot) in &placed {
            match who {
                Again::Old(m) => {
                    if self.slots[m] != slot {
                        moved.insert(m, slot);
                    }
                }
                Again::New(k) => new_slot[k] = Some(slot),
            }
        }
        // The members and their backends, changed in place (copying 10,000 names was a
        // tenth of such a render).
        let old_count = self.members.len();
        let old_slots = self.slots.clone();
        let renumber = |m: usize| {
            if m < first_gone {
                m
            } else {
                m - gone + joining.len()
            }
        };
        let mut joined_slots = Vec::with_capacity(joining.len());
        for &k in &joining {
            joined_slots.push(new_slot[k]?);
        }
        let left: Vec<(usize, Arc<str>, Arc<str>)> = self
            .members
            .splice(
                leaving.clone(),
                joining.iter().map(|&k| {
                    let (id, known) = &fresh[k];
                    (*id, Arc::clone(&known.name), Arc::clone(&known.created))
                }),
            )
            .collect();
        self.slots.splice(leaving.clone(), joined_slots);
        for (&m, &slot) in &moved {
            *self.slots.get_mut(renumber(m))? = slot;
        }
        if self.members.len() != count || self.slots.len() != count {
            return None;
        }
        // The output's rows: the others' as they are, then the pool's by backend.
        let old_pooled_from = self.rows.len() - size;
        // Built in the lists the splice before let go (`spare_*`): at 10,000 rows each a
        // fresh block of 100-600 KiB otherwise, faulted in anew by every such render under
        // the Deployment's `MIMALLOC_PURGE_DELAY=0`.
        let mut out = std::mem::take(&mut self.spare_rows);
        out.clear();
        out.reserve(list.len() + size);
        let mut places = std::mem::take(&mut self.spare_places);
        places.clear();
        places.reserve(list.len());
        let mut member = 0;
        for (at, row) in list.iter().enumerate() {
            let plain_row = if at < before || at >= new_end {
                let was = if at < before {
                    at
                } else {
                    at - new_end + old_end
                };
                self.places[was].1.is_some()
            } else {
                fresh[at - before].1.plain
            };
            if plain_row {
                places.push((None, Some(member)));
                member += 1;
            } else {
                places.push((Some(out.len()), None));
                out.push(row.clone());
            }
        }
        let pooled_from = out.len();
        let mut pool = std::mem::take(&mut self.spare_pool);
        pool.clear();
        pool.extend(self.rows.drain(old_pooled_from..));
        // Vacated backends are spares, unless taken again below.
        for m in leaving.clone() {
            pool[old_slots[m]] = self
                .spares
                .entry(old_slots[m])
                .or_insert_with(|| spare(old_slots[m]))
                .clone();
        }
        for &m in moved.keys() {
            pool[old_slots[m]] = self
                .spares
                .entry(old_slots[m])
                .or_insert_with(|| spare(old_slots[m]))
                .clone();
        }
        for place in &mut places {
            if let Some(m) = place.1 {
                place.0 = Some(pooled_from + self.slots[m]);
            }
        }
        // Each member's new backend row: those that moved and those that joined.
        let mut member_rows: Vec<usize> = Vec::with_capacity(count);
        member_rows.extend(
            places
                .iter()
                .enumerate()
                .filter(|(_, (_, member))| member.is_some())
                .map(|(at, _)| at),
        );
        for (&old, &slot) in &moved {
            let new = if old < first_gone {
                old
            } else {
                old - gone + joining.len()
            };
            let at = *member_rows.get(new)?;
            let value = pooled(&list[at], slot);
            if let Some(known) = self.known.get_mut(&ids[at]) {
                known.placed = Some((slot, value.clone()));
            }
            pool[slot] = value;
        }
        for (k, (_, known)) in fresh.iter_mut().enumerate() {
            if let Some(slot) = new_slot[k] {
                let value = pooled(&list[before + k], slot);
                known.placed = Some((slot, value.clone()));
                pool[slot] = value;
            }
        }
        out.append(&mut pool);
        self.spare_pool = pool;
        for &id in &self.ids[before..old_end] {
            self.known.remove(&id);
        }
        // The map's lines are the members', in row order: the last text's, but for the
        // members that moved, left or joined.
        let text = self.map.as_str()?;
        let mut map = String::with_capacity(text.len() + 64 * joining.len());
        let line = |map: &mut String, name: &str, slot: usize| {
            use std::fmt::Write as _;
            let _ = writeln!(map, "{name} pool_{slot}");
        };
        let mut lines = text.split_inclusive('\n');
        for m in 0..=old_count {
            if m == first_gone {
                for &k in &joining {
                    line(&mut map, &fresh[k].1.name, new_slot[k]?);
                }
            }
            if m == old_count {
                break;
            }
            let was = lines.next()?;
            if leaving.contains(&m) {
                continue;
            }
            match moved.get(&m) {
                Some(&slot) => line(&mut map, &self.members.get(renumber(m))?.1, slot),
                None => map.push_str(was),
            }
        }
        let mut by_name = std::mem::take(&mut self.by_name);
        for (_, name, _) in &left {
            by_name.remove(&**name);
        }
        for (&m, &slot) in &moved {
            by_name.insert(Arc::clone(&self.members.get(renumber(m))?.1), slot);
        }
        for &k in &joining {
            by_name.insert(Arc::clone(&fresh[k].1.name), new_slot[k]?);
        }
        for (id, known) in fresh {
            self.known.insert(id, known);
        }
        self.by_name = by_name;
        self.map = Value::from(map);
        self.all_names = None;
        self.spare_places = std::mem::replace(&mut self.places, places);
        let mut old_rows = std::mem::replace(&mut self.rows, out);
        old_rows.clear();
        self.spare_rows = old_rows;
        self.ids.clear();
        self.ids.extend_from_slice(ids);
        self.input = Some(rows.clone());
        self.rows_changed();
        Some(())
    }
}

/// A pooled row: `row` named `pool_<slot>`, with `service_backend` its own name.
fn pooled(row: &Value, slot: usize) -> Value {
    let mut map = crate::value::map_with_room(row, 1);
    map.insert(
        Key::Str("service_backend"),
        map.get(&Key::Str("name"))
            .cloned()
            .unwrap_or_else(Value::none),
    );
    map.insert(Key::Str("name"), Value::from(backend_name(slot)));
    Value::from(map)
}

/// A spare pool backend's row: the fields of a backend row, with no endpoints (every slot
/// `disabled`), of no Service (`namespace`, `service`, `service_backend` empty, `port` 0) and
/// nobody's (`origin` empty).
fn spare(index: usize) -> Value {
    map_value([
        ("name", Value::from(backend_name(index))),
        ("endpoints", Value::from(Vec::<Value>::new())),
        ("app_protocol", Value::from("")),
        ("namespace", Value::from("")),
        ("service", Value::from("")),
        ("port", Value::from(0)),
        ("port_name", Value::from("")),
        ("created", Value::from("")),
        ("origin", Value::from(Vec::<Value>::new())),
        ("policy", Value::none()),
        ("service_backend", Value::from("")),
    ])
}

/// Registers `backend_pool(rows=<backend rows>, step=<n>, reserve_from=<store>,
/// reserve_at=<namespace>/<name>)` (the reserve optional; `reserve=<n>` gives it directly): a
/// map with `rows` (the backends to
/// write: the rows the pool does not take as they are, then the pool's `size` backends in
/// order, a taken one as its row named `pool_<n>` with `service_backend` its own name, a
/// spare one without endpoints), `names` (each pooled backend's name to its pool backend's;
/// with `names=[<name>, ...]`, only those of the names given that are pooled),
/// `map` (the text of `maps/pool.map`: `<name> pool_<n>` lines), `size` and `used`. With `step`
/// 0 (or none given: [`DEFAULT_STEP`]), nothing is pooled. The answer also has `groups`
/// (`{id, rows}`: its rows in runs, [`Memo::rows_changed`]); with `flat=false` it has no
/// `rows` (a template that renders `groups` alone, as the reference does). Each renderer keeps
/// its last answer and reuses it while `rows` is the same value.
pub(crate) fn register(tera: &mut Tera) {
    let memo = Mutex::new(Memo::default());
    tera.register_function(
        "backend_pool",
        move |kwargs: Kwargs, state: &State| -> tera::TeraResult<Value> {
            let rows: Value = kwargs.must_get("rows")?;
            let step: Option<i64> = kwargs.get("step")?;
            let step = match step {
                None => DEFAULT_STEP,
                Some(n) => usize::try_from(n).map_err(|_| {
                    tera::Error::message(format!("backend_pool: `step` must be 0 or more, got {n}"))
                })?,
            };
            // `reserve=`: the size a leader kept in the cluster (a number, or the text of one:
            // a ConfigMap's `data`); anything else is no reserve (a value typed wrong by hand
            // must not stop every render: the leader writes a good one in the next pause).
            // `reserve_from=<store>` with `reserve_at=<namespace>/<name>`: the reserve is
            // `data.size` of that ConfigMap in that store (read as `get` reads, so that an
            // output that read it is rendered again when it changes).
            let reserve_at: Option<String> = kwargs.get("reserve_at")?;
            let reserve_at = reserve_at.filter(|at| !at.is_empty());
            let reserve_from: Option<String> = kwargs.get("reserve_from")?;
            let mut reserve: Option<Value> = kwargs.get("reserve")?;
            if let (Some(store), Some(at)) = (&reserve_from, &reserve_at) {
                reserve =
                    crate::functions::store_lookup(state, crate::functions::GET_VAR, store, at)?
                        .and_then(|held| {
                            let data = held.as_map()?.get(&Key::Str("data"))?.as_map()?;
                            data.get(&Key::Str("size")).cloned()
                        });
            }
            let reserve = reserve.as_ref().and_then(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .or_else(|| v.as_i64().and_then(|n| usize::try_from(n).ok()))
                    .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            });
            let sizing = Sizing { step, reserve };
            // A panic while computing (none is known) leaves a half-written memo: start over.
            let mut memo = memo.lock().unwrap_or_else(|poisoned| {
                let mut memo = poisoned.into_inner();
                *memo = Memo::default();
                memo
            });
            // `names=[...]`: only those names in `names` (a template that looks up one name
            // need not have a map of every member built on each change).
            let only: Option<Vec<String>> = kwargs.get("names")?;
            // `flat=false`: no `rows` (a template that renders `groups` need not have the
            // flat list made again on each change).
            let flat: Option<bool> = kwargs.get("flat")?;
            let answer = memo.pool_with(&rows, sizing, only.as_deref(), flat.unwrap_or(true))?;
            // Where the reserve is kept, told to the controller with the pool's state (its
            // leader writes the reserve there in a pause).
            if let Some(at) = reserve_at {
                let used = memo.members.len();
                crate::requests::put_pool(crate::requests::PoolState {
                    at,
                    used,
                    size: memo.size,
                    reserve,
                    wanted: sizing.wanted(used),
                });
            }
            Ok(answer)
        },
    );
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A backend row: `name`, `created`, `app_protocol` (`h2`: not plain) and `endpoints`.
    fn row(name: &str, created: u8, h2: bool, endpoints: u8) -> Value {
        map_value([
            ("name", Value::from(name)),
            (
                "created",
                Value::from(format!("2026-01-0{created}T00:00:00Z")),
            ),
            ("app_protocol", Value::from(if h2 { "h2" } else { "" })),
            ("endpoints", Value::from(i64::from(endpoints))),
            ("policy", Value::none()),
        ])
    }

    proptest::proptest! {
        /// Rows replaced in place (their endpoints, or their name, age or kind too), added or
        /// dropped: the kept answer, patched or computed again, is a fresh memo's.
        #[test]
        fn a_patched_answer_is_the_answer_computed_afresh(
            first in proptest::collection::vec((0u8..6, 1u8..3, proptest::bool::weighted(0.2)), 1..20),
            edits in proptest::collection::vec(
                proptest::collection::vec((0usize..24, 0u8..4, 0u8..6, 1u8..3, proptest::bool::weighted(0.2)), 1..4),
                1..8,
            ),
            step in 0usize..3,
        ) {
            let name = |n: u8| format!("ns_svc-{n}_80");
            let mut list: Vec<Value> = first
                .iter()
                .map(|&(n, created, h2)| row(&name(n), created, h2, 0))
                .collect();
            let mut memo = Memo::default();
            memo.pool(&Value::from(list.clone()), step, None).expect("pools");
            for (round, batch) in edits.into_iter().enumerate() {
                for (at, what, n, created, h2) in batch {
                    let endpoints = u8::try_from(round % 200).unwrap_or(0) + 1;
                    let at = at % (list.len() + 1);
                    match what {
                        // The same backend, its endpoints changed (the usual event).
                        0 | 1 if at < list.len() => {
                            let was = &list[at];
                            list[at] = row(
                                text(was, "name"),
                                text(was, "created").as_bytes()[9] - b'0',
                                !plain(was),
                                endpoints,
                            );
                        }
                        2 if at < list.len() => list[at] = row(&name(n), created, h2, endpoints),
                        3 if at < list.len() => {
                            list.remove(at);
                        }
                        _ => list.insert(at, row(&name(n), created, h2, endpoints)),
                    }
                }
                let rows = Value::from(list.clone());
                let kept = memo.pool(&rows, step, None).expect("pools");
                let fresh = Memo::default().pool(&rows, step, None).expect("pools");
                proptest::prop_assert_eq!(&kept, &fresh);
                proptest::prop_assert_eq!(in_order(&kept), in_order(&fresh));
                // A few names asked for: those of them pooled, as every name's map has them,
                // and the very same rows list.
                let only = [name(0), name(3), "absent".to_owned()];
                let some = memo.pool(&rows, step, Some(&only)).expect("pools");
                let part = |answer: &Value, key: &'static str| {
                    answer.as_map().and_then(|m| m.get(&Key::Str(key))).cloned()
                };
                let all = part(&fresh, "names").and_then(|n| n.into_map()).unwrap_or_default();
                let expected: Map = all
                    .into_iter()
                    .filter(|(key, _)| only.iter().any(|o| key.as_str() == Some(o.as_str())))
                    .collect();
                proptest::prop_assert_eq!(part(&some, "names"), Some(Value::from(expected)));
                let same_rows = match (part(&some, "rows"), part(&kept, "rows")) {
                    (Some(a), Some(b)) => identity(&a) == identity(&b),
                    _ => false,
                };
                proptest::prop_assert!(same_rows, "the rows list is shared between calls");
            }
        }
    }

    /// What an answer's `==` leaves out (tera compares maps regardless of order): the map's
    /// text and the names in order.
    fn in_order(answer: &Value) -> (Option<String>, Vec<String>) {
        let part = |key: &'static str| answer.as_map().and_then(|m| m.get(&Key::Str(key)));
        let names = part("names")
            .and_then(Value::as_map)
            .map(|names| names.keys().map(ToString::to_string).collect())
            .unwrap_or_default();
        (part("map").map(ToString::to_string), names)
    }

    /// The answer's `groups` are its rows in runs (the rows before the pool apart from the
    /// pool's), and one row's change makes a new list of its group alone: the other groups
    /// are the very lists they were (a `render_each` per group reuses them whole).
    #[test]
    fn one_rows_change_makes_one_new_group() {
        let mut list: Vec<Value> = (0..1_500u32)
            .map(|i| row_at(&format!("ns_svc-{i}_80"), i, i % 500 == 7))
            .collect();
        let mut memo = Memo::default();
        let part = |answer: &Value, key: &'static str| {
            answer
                .as_map()
                .and_then(|m| m.get(&Key::Str(key)))
                .cloned()
                .unwrap()
        };
        // Each group's id and rows.
        let groups_of = |answer: &Value| -> Vec<(String, Value)> {
            part(answer, "groups")
                .as_array()
                .unwrap()
                .iter()
                .map(|g| (part(g, "id").as_str().unwrap().to_owned(), part(g, "rows")))
                .collect()
        };
        let first = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
        let groups = groups_of(&first);
        let flat: Vec<Value> = groups
            .iter()
            .flat_map(|(_, rows)| rows.as_array().unwrap().to_vec())
            .collect();
        assert_eq!(flat.as_slice(), part(&first, "rows").as_array().unwrap());
        assert!(groups.len() > 3, "{} groups", groups.len());
        assert!(groups.iter().all(|(id, rows)| {
            let most = if id.starts_with('p') {
                GROUP
            } else {
                2 * GROUP
            };
            rows.as_array().unwrap().len() <= most
        }));
        // The three rows that are not plain are before the pool, in a group of their own.
        assert_eq!(groups[0].0, "b:ns_svc-7_80");
        assert_eq!(groups[0].1.as_array().unwrap().len(), 3);
        assert_eq!(groups[1].0, "p0");
        // One backend's endpoints change: one group is a new list, the others the very ones.
        let at = 900;
        let mut changed = list[at].as_map().unwrap().clone();
        changed.insert(Key::Str("endpoints"), Value::from(2));
        list[at] = Value::from(changed);
        let second = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
        let again = groups_of(&second);
        assert_eq!(again.len(), groups.len());
        let new: Vec<&str> = groups
            .iter()
            .zip(&again)
            .filter(|((_, a), (_, b))| identity(a) != identity(b))
            .map(|((id, _), _)| id.as_str())
            .collect();
        assert_eq!(new.len(), 1, "groups made again: {new:?}");
        let fresh = Memo::default()
            .pool(&Value::from(list.clone()), 32, None)
            .unwrap();
        assert_eq!(part(&second, "groups"), part(&fresh, "groups"));
        // The rows before the pool all become plain: their group goes, and every pool group
        // keeps its id and its very rows.
        for row in &mut list {
            if !plain(row) {
                *row = row_at(text(row, "name"), 1, false);
            }
        }
        let third = memo.pool(&Value::from(list), 32, None).unwrap();
        let third = groups_of(&third);
        assert!(third.iter().all(|(id, _)| id.starts_with('p')));
        let kept = third
            .iter()
            .filter(|(id, rows)| {
                again
                    .iter()
                    .any(|(was, old)| was == id && identity(old) == identity(rows))
            })
            .count();
        assert!(kept > 0, "no pool group kept its rows");
    }

    /// A plain backend row whose Service was created `second` seconds into 2026.
    fn row_at(name: &str, second: u32, h2: bool) -> Value {
        map_value([
            ("name", Value::from(name)),
            (
                "created",
                Value::from(format!(
                    "2026-01-01T{:02}:{:02}:{:02}Z",
                    second / 3600,
                    second / 60 % 60,
                    second % 60
                )),
            ),
            ("app_protocol", Value::from(if h2 { "h2" } else { "" })),
            ("endpoints", Value::from(1)),
            ("policy", Value::none()),
        ])
    }

    proptest::proptest! {
        /// New Services one after another (most the newest, some at the same second as the
        /// newest, some not plain, some dropped again), each row added anywhere in the list:
        /// the kept answer, with a new member placed by probing alone or computed again, is a
        /// fresh memo's.
        #[test]
        fn new_services_added_one_by_one_are_placed_as_a_fresh_assignment_places_them(
            first in 1usize..40,
            adds in proptest::collection::vec((0usize..64, 0u8..8), 1..40),
            step in 1usize..4,
            reserve in proptest::option::of(0usize..96),
        ) {
            let mut list: Vec<Value> = (0..first)
                .map(|i| row_at(&format!("ns_svc-{i}_80"), u32::try_from(i).unwrap_or(0), i % 7 == 3))
                .collect();
            let mut memo = Memo::default();
            // A reserve kept in the cluster (honoured while above the members, not once they
            // outgrow it), changed now and then.
            let mut sizing = Sizing { step, reserve };
            memo.pool_with(&Value::from(list.clone()), sizing, None, true).expect("pools");
            let mut second = u32::try_from(first).unwrap_or(0);
            for (k, (at, what)) in adds.into_iter().enumerate() {
                let at = at % (list.len() + 1);
                match what {
                    // Dropped again.
                    0 if !list.is_empty() => {
                        list.remove(at % list.len());
                    }
                    // Not plain.
                    1 => list.insert(at, row_at(&format!("ns_h2-{k}_80"), second + 1, true)),
                    // Created in the same second as the newest (the name breaks the tie).
                    2 => list.insert(at, row_at(&format!("ns_new-{k}_80"), second, false)),
                    // The leader writes another reserve.
                    4 => sizing.reserve = Some(list.len() + at),
                    // The newest.
                    _ => {
                        second += 1;
                        list.insert(at, row_at(&format!("ns_new-{k}_80"), second, false));
                    }
                }
                let rows = Value::from(list.clone());
                let kept = memo.pool_with(&rows, sizing, None, true).expect("pools");
                let fresh = Memo::default().pool_with(&rows, sizing, None, true).expect("pools");
                let plain = list.iter().filter(|row| plain(row)).count();
                proptest::prop_assert_eq!(
                    kept.as_map().and_then(|m| m.get(&Key::Str("size"))).and_then(Value::as_u64),
                    u64::try_from(sizing.size(plain)).ok()
                );
                proptest::prop_assert_eq!(&kept, &fresh);
                proptest::prop_assert_eq!(in_order(&kept), in_order(&fresh));
            }
        }
    }

    #[test]
    fn a_new_service_newer_than_every_other_is_placed_without_assigning_the_others_again() {
        let mut list: Vec<Value> = (0..40u32)
            .map(|i| row_at(&format!("ns_svc-{i:02}_80"), i, i % 9 == 0))
            .collect();
        let mut memo = Memo::default();
        memo.pool(&Value::from(list.clone()), 32, None)
            .expect("pools");
        list.insert(17, row_at("ns_fresh_80", 40, false));
        let kept = memo
            .pool(&Value::from(list.clone()), 32, None)
            .expect("pools");
        assert_eq!(memo.inserted, 1, "the insertion patch answered");
        assert_eq!(
            kept,
            Memo::default()
                .pool(&Value::from(list.clone()), 32, None)
                .expect("pools")
        );
        // Created in the same second as an older member, with a name before its: the order
        // of the assignment changes, and the answer is computed again.
        list.insert(3, row_at("ns_early_80", 39, false));
        let kept = memo
            .pool(&Value::from(list.clone()), 32, None)
            .expect("pools");
        assert_eq!(memo.inserted, 1, "computed again");
        assert_eq!(
            kept,
            Memo::default()
                .pool(&Value::from(list), 32, None)
                .expect("pools")
        );
    }

    /// A Service port leaving the pool (its appProtocol set) and joining it again, at 4,000
    /// backends: each answer is a fresh memo's, comes from the splice (not a whole
    /// assignment), and makes new lists of few groups (a `render_each` per group renders
    /// those alone): the group of the rows before the pool it leaves for or comes from, and
    /// the pool's groups of its cluster.
    #[test]
    fn a_backend_leaving_and_joining_the_pool_moves_only_its_cluster() {
        // Half the backends are not plain: ~2,000 rows before the pool, in several groups.
        let mut list: Vec<Value> = (0..4_000u32)
            .map(|i| row_at(&format!("ns_svc-{i}_80"), i, i % 2 == 1))
            .collect();
        let mut memo = Memo::default();
        let part = |answer: &Value, key: &'static str| {
            answer
                .as_map()
                .and_then(|m| m.get(&Key::Str(key)))
                .cloned()
                .unwrap()
        };
        let groups = |answer: &Value| -> Vec<usize> {
            part(answer, "groups")
                .as_array()
                .unwrap()
                .iter()
                .map(|g| identity(&part(g, "rows")).unwrap())
                .collect()
        };
        let mut last = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
        for (round, at) in [1_000usize, 1_000, 4, 3_998, 4, 3_998, 640]
            .into_iter()
            .enumerate()
        {
            let was = list[at].clone();
            list[at] = row_at(text(&was, "name"), u32::try_from(at).unwrap(), plain(&was));
            let kept = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
            let fresh = Memo::default()
                .pool(&Value::from(list.clone()), 32, None)
                .unwrap();
            assert_eq!(kept, fresh, "round {round}");
            assert_eq!(in_order(&kept), in_order(&fresh), "round {round}");
            assert_eq!(memo.spliced, round as u64 + 1, "round {round}: spliced");
            let (before, now) = (groups(&last), groups(&kept));
            let new = now.iter().filter(|g| !before.contains(g)).count();
            // The rows before the pool (the backend that left, or none), and the pool groups
            // of its cluster.
            assert!(
                new <= 3,
                "round {round}: {new} of {} groups are new lists",
                now.len()
            );
            last = kept;
        }
        // A Service older than every other goes, and comes back.
        let oldest = list.remove(0);
        let kept = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
        assert_eq!(
            kept,
            Memo::default()
                .pool(&Value::from(list.clone()), 32, None)
                .unwrap()
        );
        list.insert(0, oldest);
        let kept = memo.pool(&Value::from(list.clone()), 32, None).unwrap();
        assert_eq!(
            kept,
            Memo::default().pool(&Value::from(list), 32, None).unwrap()
        );
        assert_eq!(memo.spliced, 9);
    }

    /// Several backends joining a crowded pool at once, older than members they probe past:
    /// members of the next cluster are placed again too, and the answer is still a fresh
    /// memo's (the rounds that start over are taken: `spliced_wider`).
    #[test]
    fn backends_joining_together_place_the_next_cluster_again_when_they_reach_it() {
        let mut memo = Memo::default();
        let mut list: Vec<Value> = Vec::new();
        let mut next = 0u32;
        for round in 0..400u32 {
            // A pool of 208 backends, 186 to 189 of them taken (as full as it gets before
            // its next step).
            if round % 40 == 0 {
                list = (0..186u32)
                    .map(|i| row_at(&format!("ns_svc-{round}-{i}_80"), 100 + i, false))
                    .collect();
            }
            // Three old Services come back at once (older than most members), next to each
            // other in the rows (one run of rows changed).
            let at = (next as usize * 7919) % (list.len() + 1);
            for k in 0..3 {
                next += 1;
                list.insert(
                    at + k,
                    row_at(&format!("ns_back-{next}-{k}_80"), next % 50, false),
                );
            }
            let rows = Value::from(list.clone());
            let kept = memo.pool(&rows, 8, None).unwrap();
            let fresh = Memo::default().pool(&rows, 8, None).unwrap();
            assert_eq!(kept, fresh, "round {round}");
            assert_eq!(in_order(&kept), in_order(&fresh), "round {round}");
            // Three leave again.
            let at = (next as usize * 104_729) % (list.len() - 3);
            list.drain(at..at + 3);
            next += 1;
            let rows = Value::from(list.clone());
            let kept = memo.pool(&rows, 8, None).unwrap();
            assert_eq!(
                kept,
                Memo::default().pool(&rows, 8, None).unwrap(),
                "round {round}"
            );
        }
        assert!(memo.spliced > 100, "spliced {}", memo.spliced);
        assert!(
            memo.spliced_wider > 0,
            "no round started over with the next cluster"
        );
    }

    proptest::proptest! {
        /// Backends leaving the pool and joining it again, going and coming back, anywhere
        /// in the age order, a few at a time, in pools small enough to be crowded: the kept
        /// answer is a fresh memo's.
        #[test]
        fn backends_leaving_and_joining_a_crowded_pool_are_placed_as_afresh(
            first in 20usize..200,
            edits in proptest::collection::vec(
                proptest::collection::vec((0usize..400, 0u8..3, 0u32..400), 1..4),
                1..10,
            ),
            step in 1usize..16,
            slack in proptest::option::of(1usize..8),
        ) {
            let mut list: Vec<Value> = (0..first)
                .map(|i| {
                    let i = u32::try_from(i).unwrap_or(0);
                    row_at(&format!("ns_svc-{i}_80"), i / 3, i % 11 == 4)
                })
                .collect();
            let mut memo = Memo::default();
            // A reserve a few backends above the members: a pool more crowded still.
            let sizing = Sizing { step, reserve: slack.map(|slack| first + slack) };
            memo.pool_with(&Value::from(list.clone()), sizing, None, true).expect("pools");
            let mut made = 0u32;
            for batch in edits {
                for (at, what, second) in batch {
                    if list.is_empty() {
                        break;
                    }
                    let at = at % list.len();
                    match what {
                        // Leaves the pool or joins it again.
                        0 => {
                            let was = list[at].clone();
                            let second = text(&was, "created");
                            let second = second[11..13].parse::<u32>().unwrap_or(0) * 3600
                                + second[14..16].parse::<u32>().unwrap_or(0) * 60
                                + second[17..19].parse::<u32>().unwrap_or(0);
                            list[at] = row_at(text(&was, "name"), second, plain(&was));
                        }
                        1 => {
                            list.remove(at);
                        }
                        _ => {
                            made += 1;
                            list.insert(at, row_at(&format!("ns_made-{made}_80"), second, second % 5 == 0));
                        }
                    }
                }
                let rows = Value::from(list.clone());
                let kept = memo.pool_with(&rows, sizing, None, true).expect("pools");
                let fresh = Memo::default().pool_with(&rows, sizing, None, true).expect("pools");
                proptest::prop_assert_eq!(&kept, &fresh);
                proptest::prop_assert_eq!(in_order(&kept), in_order(&fresh));
            }
        }
    }

    #[test]
    fn an_endpoint_change_patches_the_answer_and_keeps_the_other_rows() {
        let list: Vec<Value> = (0..40u8)
            .map(|i| row(&format!("ns_svc-{i}_80"), 1, i % 9 == 0, 0))
            .collect();
        let mut memo = Memo::default();
        let before = memo
            .pool(&Value::from(list.clone()), 32, None)
            .expect("pools");
        let mut changed = list.clone();
        changed[7] = row("ns_svc-7_80", 1, false, 5);
        let after = memo
            .pool(&Value::from(changed.clone()), 32, None)
            .expect("pools");
        assert_eq!(
            after,
            Memo::default()
                .pool(&Value::from(changed), 32, None)
                .expect("pools")
        );
        let rows = |answer: &Value| {
            answer
                .as_map()
                .and_then(|m| m.get(&Key::Str("rows")))
                .and_then(Value::as_array)
                .map(<[Value]>::to_vec)
                .unwrap_or_default()
        };
        let (before, after) = (rows(&before), rows(&after));
        // One row differs, the others are the very same values (their fragments reused).
        let differ = before
            .iter()
            .zip(&after)
            .filter(|(a, b)| crate::fragments::identity(a) != crate::fragments::identity(b))
            .count();
        assert_eq!((before.len(), differ), (after.len(), 1));
    }

    fn members(names: &[String]) -> Vec<Member<'_>> {
        names
            .iter()
            .enumerate()
            .map(|(i, name)| Member {
                name,
                created: if i % 2 == 0 {
                    "2026-01-01T00:00:00Z"
                } else {
                    "2026-02-01T00:00:00Z"
                },
            })
            .collect()
    }

    fn names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("team-{}_svc-{i}_80", i % 7))
            .collect()
    }

    #[test]
    fn the_pool_keeps_a_step_of_spares_and_an_eighth_at_scale() {
        assert_eq!(size(0, 32), 32);
        assert_eq!(size(1, 32), 64);
        assert_eq!(size(32, 32), 64);
        assert_eq!(size(33, 32), 96);
        assert_eq!(granule(10_000, 32), 2_048);
        assert_eq!(size(10_000, 32), 12_288);
        assert_eq!(size(10_001, 32), 12_288);
        assert_eq!(size(10_240, 32), 12_288);
        assert_eq!(size(10_241, 32), 14_336);
        assert_eq!(size(10_000, 0), 0);
        let mut growths = 0;
        for used in 0..20_000 {
            let s = size(used, 32);
            assert!(
                s >= used + 32.max(used / 8) && s.is_multiple_of(32),
                "{used}: {s}"
            );
            if used > 0 && s != size(used - 1, 32) {
                growths += 1;
            }
        }
        // Every 32 up to 256, then 4 per doubling of the granule (64 from 256, 128 from
        // 512...) and one where it doubles: 40 in 20,000 where a fixed step would grow 625
        // times (64 when the granule stopped at an eighth).
        assert_eq!(growths, 40);
    }

    #[test]
    fn a_reserve_sizes_the_pool_while_it_is_sane_and_the_wanted_one_stays() {
        let none = Sizing::new(32);
        assert_eq!(none.size(10_000), size(10_000, 32));
        assert_eq!(ahead(10_000, 32), 14_336);
        // The Services' size leaves fewer spares than three tenths: grown ahead of need.
        assert_eq!(none.wanted(10_000), 14_336);
        let kept = Sizing {
            step: 32,
            reserve: Some(14_336),
        };
        // HAPTIC's protocol on 10,000: 3,000 new Services keep the size (no reload).
        for used in 10_000..=13_000 {
            assert_eq!(kept.size(used), 14_336);
        }
        assert_eq!(kept.wanted(10_000), 14_336);
        // After the burst, fewer spares than three tenths: the next pause grows it.
        assert_eq!(kept.wanted(13_000), ahead(13_000, 32));
        // Outgrown before a pause: the Services' size again, by steps.
        assert_eq!(kept.size(14_336), size(14_336, 32));
        // Most Services gone: the reserve still sizes the pool (no reload on their path),
        // and the next pause shrinks it.
        assert_eq!(kept.size(4_000), 14_336);
        assert_eq!(kept.wanted(4_000), ahead(4_000, 32));
        // A value typed wrong by hand does not make a pool of millions.
        let huge = Sizing {
            step: 32,
            reserve: Some(10_000_000),
        };
        assert_eq!(huge.size(10), size(10, 32));
        // No pool, no reserve.
        let off = Sizing {
            step: 0,
            reserve: Some(100),
        };
        assert_eq!((off.size(10), off.wanted(10)), (0, 0));
        // What a leader writes is what the pool then has, and what it wants again: written
        // once, not once per pause.
        for used in (0..40_000).step_by(37) {
            for reserve in [None, Some(used + 1), Some(used * 2), Some(used * 3 + 64)] {
                let wanted = Sizing { step: 32, reserve }.wanted(used);
                let then = Sizing {
                    step: 32,
                    reserve: Some(wanted),
                };
                assert!(wanted > used, "{used} {reserve:?}");
                assert_eq!(then.size(used), wanted, "{used} {reserve:?}");
                assert_eq!(then.wanted(used), wanted, "{used} {reserve:?}");
            }
        }
    }

    #[test]
    fn every_member_gets_a_backend_of_its_own_whatever_the_order() {
        let names = names(500);
        let members = members(&names);
        let (size, slots) = assign(&members, 32);
        let mut seen = std::collections::HashSet::new();
        assert!(slots.iter().all(|&s| s < size && seen.insert(s)));
        let mut reversed = members.clone();
        reversed.reverse();
        let (_, again) = assign(&reversed, 32);
        let again: Vec<usize> = again.into_iter().rev().collect();
        assert_eq!(again, slots);
    }

    #[test]
    fn a_new_service_moves_nobody_and_a_removal_moves_few() {
        // 410 and 411 backends need the same pool (480), and 409 too.
        let names = names(410);
        let members = members(&names);
        let (size, slots) = assign(&members, 32);
        // The newest Service: the others keep their backends (same size).
        let newest = "team-9_new_80".to_owned();
        let mut more = members.clone();
        more.push(Member {
            name: &newest,
            created: "2026-03-01T00:00:00Z",
        });
        let (size_more, with_new) = assign(&more, 32);
        assert_eq!(size_more, size);
        assert_eq!(with_new[..410], slots[..]);
        assert!(!slots.contains(&with_new[410]));
        // Removing one: most keep theirs.
        let mut fewer = members.clone();
        fewer.remove(17);
        let (size_fewer, without) = assign(&fewer, 32);
        assert_eq!(size_fewer, size);
        let kept: Vec<usize> = slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 17)
            .map(|(_, s)| *s)
            .collect();
        let moved = kept.iter().zip(&without).filter(|(a, b)| a != b).count();
        assert!(moved < 40, "{moved} of 409 moved");
    }

    #[test]
    fn a_name_listed_twice_gets_one_backend() {
        let names = [
            "a_b_80".to_owned(),
            "a_b_80".to_owned(),
            "a_c_80".to_owned(),
        ];
        let (_, slots) = assign(&members(&names), 32);
        assert_eq!(slots[0], slots[1]);
        assert_ne!(slots[0], slots[2]);
    }
}
