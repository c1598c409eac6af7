//! Views of a row or a few per Ingress kept from one render to the next (`IngressRoutes`,
//! `IngressTls`, `Ingresses`): each of our Ingresses' rows, who claims each route or TLS host,
//! and which Ingresses name each Service or Secret, so that after a few events only the
//! Ingresses they touch get their rows again (at 10,000 Ingresses, computing both routes views
//! over every Ingress was about a third of the render after one Ingress event: the walk, the
//! claims of every path, a map of every Service; the TLS and Ingresses views another third of
//! what was left).
//!
//! What it gives is what [`super::ingress_routes`], [`super::ingress_tls`] and
//! [`super::ingress_rows`] compute over all of them (the webhook's overlay renders still do
//! that): the rows come from the same functions, the claims decide by the same age, and
//! `tests/derived.rs` and `tests/incremental.rs` hold renders kept over random changes to
//! fresh ones. A TLS view while one of our Ingresses asks for ssl-passthrough is not kept
//! (a passthrough's claims read every Ingress's hosts): it is computed over all of them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tera::Value;

use super::last::{self, LastList};
use super::{
    HashMap, OurIngress, Ours, PathExtract, Slot, ingress_row, route_key, route_kind, route_rows,
    tls_rows,
};
use crate::store::Store;

/// Which view: the routes (Exact paths, the others, or all), the TLS entries, or a row per
/// Ingress.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Routes(Option<bool>),
    Tls,
    /// Whether the rows hold the whole Ingress (`object`).
    Ingresses(bool),
}

/// The kind of a view kept per Ingress, if `derivation` is one.
pub(super) fn kind_of(derivation: &super::Derivation) -> Option<Kind> {
    match derivation {
        super::Derivation::IngressRoutes { exact, .. } => Some(Kind::Routes(*exact)),
        super::Derivation::IngressTls { .. } => Some(Kind::Tls),
        super::Derivation::Ingresses { whole, .. } => Some(Kind::Ingresses(*whole)),
        _ => None,
    }
}

impl Kind {
    /// How many of the view's inputs come before the IngressClasses: the Ingresses, and the
    /// store it joins (Services, Secrets).
    pub(super) fn own(self) -> usize {
        match self {
            Self::Ingresses(_) => 1,
            Self::Routes(_) | Self::Tls => 2,
        }
    }
}

/// More changes than this since the last render (a resync, a burst): computed afresh, which
/// is then cheaper than patching one by one.
const PATCH_LEN: usize = 64;

/// What two Ingresses collide on, owned: a route ([`route_key`]), or a TLS host
/// (`(false, host, "")`).
type RouteKey = (bool, String, String);

/// How old an Ingress is ([`super::Age`]), owned: oldest first in the order of the tuple.
type OwnedAge = (bool, String, String, String);

/// The kept state of one view.
#[derive(Debug, Clone)]
pub(super) struct KeptRows {
    kind: Kind,
    /// The generations of the view's inputs it is of.
    built_from: Vec<u64>,
    /// Our Ingresses by (namespace, name), each with its rows: the view is their rows in
    /// this order.
    parts: BTreeMap<(String, String), Part>,
    /// Each route (or TLS host) claimed, with the Ingresses claiming it, oldest first (each
    /// once).
    claims: HashMap<RouteKey, Vec<Arc<OwnedAge>>>,
    /// How many keys more than one Ingress claims: none, and no row has a conflict.
    contested: usize,
    /// (namespace, Service or Secret) -> the names of our Ingresses there that name it,
    /// sorted, each once (a list: mostly one name, where a set cost a B-tree node).
    users: HashMap<(String, String), Vec<String>>,
    /// The list [`Self::value_following`] gave last, and what changed since.
    last: Option<LastList>,
}

/// One of our Ingresses in the view.
#[derive(Debug, Clone)]
struct Part {
    age: Arc<OwnedAge>,
    /// The routes (or TLS hosts) it claims, once each (no route for a canary).
    keys: Vec<RouteKey>,
    /// The Services its paths (or the Secrets its TLS entries) name, once each.
    services: Vec<String>,
    rows: Vec<Value>,
}

impl KeptRows {
    /// The view over every Ingress of `ingresses`; `None` for a TLS view while one of our
    /// Ingresses asks for ssl-passthrough (found by a look at each Ingress's extract before
    /// anything is built: such a view is computed over every Ingress on each render).
    pub(super) fn build(
        kind: Kind,
        slot: Slot,
        (store, ingresses): (&str, &Store),
        joined: Option<&Store>,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> Option<Self> {
        let passthrough = matches!(kind, Kind::Tls)
            && ingresses.source().entries().any(|(_, value, extracts)| {
                let ingress = extracts.ingress(value);
                ours.accepts(ingress) && entangled(kind, ingress)
            });
        if passthrough {
            return None;
        }
        let mut state = Self {
            kind,
            built_from: from,
            parts: BTreeMap::new(),
            claims: HashMap::default(),
            contested: 0,
            users: HashMap::default(),
            last: None,
        };
        for ((namespace, name), value, extracts) in ingresses.source().entries() {
            let ingress = extracts.ingress(value);
            if ours.accepts(ingress) {
                let ing = OurIngress {
                    namespace,
                    name,
                    value,
                    extracts,
                    ingress,
                };
                state.add(&ing);
            }
        }
        let all: Vec<(String, String)> = state.parts.keys().cloned().collect();
        state.rows_again(slot, store, (ingresses, joined), all, BTreeMap::new());
        Some(state)
    }

    /// Brings the view up to date with `ingresses` and `services` (generations `from`):
    /// the Ingresses changed since get their claims again; those changed, those naming a
    /// Service changed since and those claiming a route whose claimants changed get their
    /// rows again. `false`, with nothing changed, when it cannot: the IngressClasses
    /// changed, or the stores do not remember back that far, or there are more than
    /// [`PATCH_LEN`] changes.
    pub(super) fn patch(
        &mut self,
        slot: Slot,
        (store, ingresses): (&str, &Store),
        joined: Option<&Store>,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> bool {
        let own = self.kind.own();
        let Some(&ingresses_from) = self.built_from.first() else {
            return false;
        };
        if self.built_from.len() != from.len() || self.built_from.get(own..) != from.get(own..) {
            return false;
        }
        let Some(changed_ingresses) = ingresses.changes_since(ingresses_from) else {
            return false;
        };
        let changed_joined = match (own, joined, self.built_from.get(1)) {
            (1, _, _) => Vec::new(),
            (_, Some(joined), Some(&joined_from)) => match joined.changes_since(joined_from) {
                Some(changed) => changed,
                None => return false,
            },
            _ => return false,
        };
        if changed_ingresses.len() + changed_joined.len() > PATCH_LEN {
            return false;
        }
        let changed: BTreeSet<&(String, String)> = changed_ingresses.into_iter().collect();
        // Every check before any change: `false` leaves the state as it was.
        let now_entangled = changed.iter().any(|key| {
            ingresses
                .get_entry(&key.0, &key.1)
                .is_some_and(|(value, extracts)| {
                    let ingress = extracts.ingress(value);
                    ours.accepts(ingress) && entangled(self.kind, ingress)
                })
        });
        if now_entangled {
            return false;
        }
        let mut again: BTreeSet<(String, String)> = BTreeSet::new();
        let mut touched: BTreeSet<RouteKey> = BTreeSet::new();
        // The rows of the changed Ingresses before: rows computed again that are equal stay
        // the very values, and the list is not patched for them.
        let mut had: BTreeMap<(String, String), Vec<Value>> = BTreeMap::new();
        for key in changed {
            if let Some(before) = self.remove(key) {
                touched.extend(before.keys);
                had.insert(key.clone(), before.rows);
            }
            let now = ingresses
                .get_entry(&key.0, &key.1)
                .and_then(|(value, extracts)| {
                    let ingress = extracts.ingress(value);
                    ours.accepts(ingress).then_some(OurIngress {
                        namespace: &key.0,
                        name: &key.1,
                        value,
                        extracts,
                        ingress,
                    })
                });
            if let Some(ing) = now {
                touched.extend(self.add(&ing).iter().cloned());
                again.insert(key.clone());
            }
        }
        for (namespace, service) in changed_joined {
            let users = self.users.get(&(namespace.clone(), service.clone()));
            for name in users.into_iter().flatten() {
                again.insert((namespace.clone(), name.clone()));
            }
        }
        // A route whose claimants changed may change hands: all who claim it now.
        for key in &touched {
            for age in self.claims.get(key).into_iter().flatten() {
                again.insert((age.2.clone(), age.3.clone()));
            }
        }
        // Those no longer in the view.
        for (key, rows) in &had {
            if !self.parts.contains_key(key) {
                LastList::note(&mut self.last, key, || rows.len());
            }
        }
        self.rows_again(slot, store, (ingresses, joined), again, had);
        self.built_from = from;
        true
    }

    /// The view, as [`Self::value`] gives it, from the list given last when few Ingresses'
    /// rows changed since ([`LastList::follow`]).
    pub(super) fn value_following(&mut self) -> Value {
        LastList::follow(&mut self.last, &self.parts, |part| &part.rows)
    }

    /// The view: every Ingress's rows, in (namespace, name) order.
    pub(super) fn value(&self) -> Value {
        last::gathered(&self.parts, |part| &part.rows)
    }

    /// Adds one of our Ingresses (not in the view): its claims and what it names of the
    /// joined store; its rows are computed later ([`Self::rows_again`]). Returns the keys it
    /// claims. An Ingress the view has no row of (no path of a routes view's kind, no TLS
    /// entry) is left out: it claims nothing there, and what its rows would be joined with
    /// cannot change that (at 10,000 Ingresses with Prefix paths only, the Exact routes view
    /// held 10,000 empty parts).
    fn add(&mut self, ing: &OurIngress<'_>) -> &[RouteKey] {
        let empty = match self.kind {
            Kind::Routes(exact) => !ing.ingress.paths.iter().any(|p| route_kind(exact, p)),
            Kind::Tls => ing.extracts.tls(ing.value).is_empty(),
            Kind::Ingresses(_) => false,
        };
        if empty {
            return &[];
        }
        let age = ing.age();
        let age = Arc::new((age.0, age.1.to_owned(), age.2.to_owned(), age.3.to_owned()));
        let (mut keys, mut services): (Vec<RouteKey>, Vec<String>) = match self.kind {
            Kind::Routes(exact) => {
                let keys = if ing.ingress.canary {
                    Vec::new()
                } else {
                    ing.ingress
                        .paths
                        .iter()
                        .filter(|p| route_kind(exact, p))
                        .map(|p| {
                            let (exact, host, path) = route_key(p);
                            (exact, host.to_owned(), path.to_owned())
                        })
                        .collect()
                };
                // The Services of the view's paths only: a row is its path's, joined with
                // its path's Service alone.
                let services = ing
                    .ingress
                    .paths
                    .iter()
                    .filter(|p| route_kind(exact, p))
                    .map(|p| p.target.service.clone())
                    .collect();
                (keys, services)
            }
            Kind::Tls => {
                let entries = ing.extracts.tls(ing.value);
                let keys = entries
                    .iter()
                    .flat_map(|tls| tls.hosts.as_array().unwrap_or_default())
                    .filter_map(|host| host.as_str().filter(|h| !h.is_empty()))
                    .map(|host| (false, host.to_owned(), String::new()))
                    .collect();
                let secrets = entries
                    .iter()
                    .filter(|tls| !tls.secret.is_empty())
                    .map(|tls| tls.secret.clone())
                    .collect();
                (keys, secrets)
            }
            Kind::Ingresses(_) => (Vec::new(), Vec::new()),
        };
        keys.sort_unstable();
        keys.dedup();
        for key in &keys {
            let claimants = self.claims.entry(key.clone()).or_default();
            let at = claimants.partition_point(|other| **other < *age);
            claimants.insert(at, Arc::clone(&age));
            if claimants.len() == 2 {
                self.contested += 1;
            }
        }
        services.sort_unstable();
        services.dedup();
        for service in &services {
            let names = self
                .users
                .entry((ing.namespace.to_owned(), service.clone()))
                .or_default();
            if let Err(at) = names.binary_search_by(|name| name.as_str().cmp(ing.name)) {
                names.insert(at, ing.name.to_owned());
            }
        }
        let key = (ing.namespace.to_owned(), ing.name.to_owned());
        let part = Part {
            age,
            keys,
            services,
            rows: Vec::new(),
        };
        match self.parts.entry(key) {
            std::collections::btree_map::Entry::Vacant(slot) => &slot.insert(part).keys,
            std::collections::btree_map::Entry::Occupied(mut slot) => {
                slot.insert(part);
                &slot.into_mut().keys
            }
        }
    }

    /// Takes an Ingress out of the view, with its claims and its names of Services.
    fn remove(&mut self, key: &(String, String)) -> Option<Part> {
        let part = self.parts.remove(key)?;
        for route in &part.keys {
            if let Some(claimants) = self.claims.get_mut(route) {
                if claimants.len() == 2 {
                    self.contested -= 1;
                }
                claimants.retain(|age| !Arc::ptr_eq(age, &part.age));
                if claimants.is_empty() {
                    self.claims.remove(route);
                }
            }
        }
        for service in &part.services {
            let at = (key.0.clone(), service.clone());
            if let Some(names) = self.users.get_mut(&at) {
                names.retain(|name| *name != key.1);
                if names.is_empty() {
                    self.users.remove(&at);
                }
            }
        }
        Some(part)
    }

    /// The Ingress that won `route` from the Ingress of age `me`, when one did.
    fn lost_to(&self, route: RouteKey, me: &OwnedAge) -> Option<String> {
        let claimants = self.claims.get(&route)?;
        let best = claimants.first().filter(|_| claimants.len() > 1)?;
        ((best.2.as_str(), best.3.as_str()) != (me.2.as_str(), me.3.as_str()))
            .then(|| format!("{}/{}", best.2, best.3))
    }

    /// Computes the rows of the Ingresses `keys` (those still in the view) again. Rows equal
    /// to those the Ingress had (in `had`, else in the view) stay the very values; others
    /// are noted as changed for [`Self::value_following`].
    fn rows_again(
        &mut self,
        slot: Slot,
        store: &str,
        (ingresses, joined): (&Store, Option<&Store>),
        keys: impl IntoIterator<Item = (String, String)>,
        mut had: BTreeMap<(String, String), Vec<Value>>,
    ) {
        let lookup = |namespace: &str, service: &str| {
            joined?
                .get_entry(namespace, service)
                .map(|(svc, extracts)| (extracts.service(namespace, service, svc), extracts))
        };
        for key in keys {
            let Some(part) = self.parts.get(&key) else {
                continue;
            };
            let Some((value, extracts)) = ingresses.get_entry(&key.0, &key.1) else {
                continue;
            };
            let ing = OurIngress {
                namespace: &key.0,
                name: &key.1,
                value,
                extracts,
                ingress: extracts.ingress(value),
            };
            let age = Arc::clone(&part.age);
            let mut rows = Vec::with_capacity(part.rows.capacity().max(1));
            match self.kind {
                Kind::Routes(exact) => {
                    let lost = |p: &PathExtract| {
                        let (exact, host, path) = route_key(p);
                        self.lost_to((exact, host.to_owned(), path.to_owned()), &age)
                    };
                    route_rows(
                        slot,
                        store,
                        &ing,
                        exact,
                        &lookup,
                        (self.contested > 0).then_some(&lost),
                        &mut rows,
                    );
                }
                Kind::Tls => {
                    // No passthrough here (the view is not kept then): no winner passes
                    // the host through.
                    let lost = |host: &str| {
                        self.lost_to((false, host.to_owned(), String::new()), &age)
                            .map(|winner| (winner, false))
                    };
                    if let Some(secrets) = joined {
                        tls_rows(
                            slot,
                            store,
                            &ing,
                            secrets.source(),
                            (self.contested > 0).then_some(&lost),
                            &mut rows,
                        );
                    }
                }
                Kind::Ingresses(whole) => ingress_row(slot, &ing, whole, &mut rows),
            }
            if let Some(part) = self.parts.get_mut(&key) {
                let before = had
                    .remove(&key)
                    .unwrap_or_else(|| std::mem::take(&mut part.rows));
                if crate::value::all_identical(&before, &rows) {
                    part.rows = before;
                } else {
                    LastList::note(&mut self.last, &key, || before.len());
                    part.rows = rows;
                }
            }
        }
    }
}

/// Whether one of our Ingresses makes the view one to compute over all Ingresses: a TLS
/// view's Ingress with ssl-passthrough.
fn entangled(kind: Kind, ingress: &super::IngressExtract) -> bool {
    matches!(kind, Kind::Tls) && !ingress.passthrough.is_empty()
}
