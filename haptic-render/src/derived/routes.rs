//! An `IngressRoutes` view kept from one render to the next: each of our Ingresses' rows, who
//! claims each route, and which Ingresses name each Service, so that after a few Ingress or
//! Service events only the Ingresses they touch get their rows again (at 10,000 Ingresses,
//! computing both routes views over every Ingress was about a third of the render after one
//! Ingress event: the walk, the claims of every path, a map of every Service).
//!
//! What it gives is what [`super::ingress_routes`] computes over all of them (the webhook's
//! overlay renders still do that): the rows come from the same function, [`route_rows`], the
//! claims decide by the same age, and `tests/incremental.rs` holds renders kept over random
//! changes to fresh ones.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tera::Value;

use super::{HashMap, OurIngress, Ours, PathExtract, Slot, route_key, route_kind, route_rows};
use crate::store::Store;

/// More changes than this since the last render (a resync, a burst): computed afresh, which
/// is then cheaper than patching one by one.
const PATCH_LEN: usize = 64;

/// A route as two paths collide on it ([`route_key`]), owned.
type RouteKey = (bool, String, String);

/// How old an Ingress is ([`super::Age`]), owned: oldest first in the order of the tuple.
type OwnedAge = (bool, String, String, String);

/// The kept state of one `IngressRoutes` view.
#[derive(Debug, Clone, Default)]
pub(super) struct RoutesState {
    /// The generations of the Ingresses, the Services (and the IngressClasses) it is of.
    built_from: Vec<u64>,
    /// Our Ingresses by (namespace, name), each with its rows: the view is their rows in
    /// this order.
    parts: BTreeMap<(String, String), Part>,
    /// Each route claimed, with the Ingresses claiming it, oldest first (each once).
    claims: HashMap<RouteKey, Vec<Arc<OwnedAge>>>,
    /// How many routes more than one Ingress claims: none, and no row has a conflict.
    contested: usize,
    /// (namespace, Service) -> the names of our Ingresses there whose paths name it.
    users: HashMap<(String, String), BTreeSet<String>>,
}

/// One of our Ingresses in the view.
#[derive(Debug, Clone)]
struct Part {
    age: Arc<OwnedAge>,
    /// The routes it claims, once each (none for a canary).
    keys: Vec<RouteKey>,
    /// The Services its paths name, once each.
    services: Vec<String>,
    rows: Vec<Value>,
}

impl RoutesState {
    /// The view over every Ingress of `ingresses`.
    pub(super) fn build(
        slot: Slot,
        (store, ingresses): (&str, &Store),
        services: &Store,
        exact: Option<bool>,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> Self {
        let mut state = Self {
            built_from: from,
            ..Self::default()
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
                state.add(&ing, exact);
            }
        }
        let all: Vec<(String, String)> = state.parts.keys().cloned().collect();
        state.rows_again(slot, store, (ingresses, services), exact, all);
        state
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
        services: &Store,
        exact: Option<bool>,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> bool {
        let (Some(&ingresses_from), Some(&services_from)) =
            (self.built_from.first(), self.built_from.get(1))
        else {
            return false;
        };
        if self.built_from.get(2..) != from.get(2..) {
            return false;
        }
        let (Some(changed_ingresses), Some(changed_services)) = (
            ingresses.changes_since(ingresses_from),
            services.changes_since(services_from),
        ) else {
            return false;
        };
        if changed_ingresses.len() + changed_services.len() > PATCH_LEN {
            return false;
        }
        let mut again: BTreeSet<(String, String)> = BTreeSet::new();
        let mut touched: BTreeSet<RouteKey> = BTreeSet::new();
        let changed: BTreeSet<&(String, String)> = changed_ingresses.into_iter().collect();
        for key in changed {
            if let Some(before) = self.remove(key) {
                touched.extend(before.keys);
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
                touched.extend(self.add(&ing, exact).iter().cloned());
                again.insert(key.clone());
            }
        }
        for (namespace, service) in changed_services {
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
        self.rows_again(slot, store, (ingresses, services), exact, again);
        self.built_from = from;
        true
    }

    /// The view: every Ingress's rows, in (namespace, name) order.
    pub(super) fn value(&self) -> Value {
        let rows: Vec<Value> = self
            .parts
            .values()
            .flat_map(|part| part.rows.iter().cloned())
            .collect();
        Value::from(rows)
    }

    /// Adds one of our Ingresses (not in the view): its claims and the Services it names;
    /// its rows are computed later ([`Self::rows_again`]). Returns the routes it claims.
    fn add(&mut self, ing: &OurIngress<'_>, exact: Option<bool>) -> &[RouteKey] {
        let age = ing.age();
        let age = Arc::new((age.0, age.1.to_owned(), age.2.to_owned(), age.3.to_owned()));
        let mut keys: Vec<RouteKey> = if ing.ingress.canary {
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
        let mut services: Vec<String> = ing
            .ingress
            .paths
            .iter()
            .map(|p| p.target.service.clone())
            .collect();
        services.sort_unstable();
        services.dedup();
        for service in &services {
            self.users
                .entry((ing.namespace.to_owned(), service.clone()))
                .or_default()
                .insert(ing.name.to_owned());
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
                names.remove(&key.1);
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

    /// Computes the rows of the Ingresses `keys` (those still in the view) again.
    fn rows_again(
        &mut self,
        slot: Slot,
        store: &str,
        (ingresses, services): (&Store, &Store),
        exact: Option<bool>,
        keys: impl IntoIterator<Item = (String, String)>,
    ) {
        let lookup = |namespace: &str, service: &str| {
            services
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
            let lost = |p: &PathExtract| {
                let (exact, host, path) = route_key(p);
                self.lost_to((exact, host.to_owned(), path.to_owned()), &age)
            };
            let mut rows = Vec::with_capacity(part.rows.capacity().max(1));
            route_rows(
                slot,
                store,
                &ing,
                exact,
                &lookup,
                (self.contested > 0).then_some(&lost),
                &mut rows,
            );
            if let Some(part) = self.parts.get_mut(&key) {
                part.rows = rows;
            }
        }
    }
}
