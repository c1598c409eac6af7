//! Views whose rows come from a few of the Ingresses: those with a default backend,
//! ingress-nginx annotations, ssl-passthrough (the TLS entries' view is kept per Ingress:
//! [`super::routes`]). After an event that touches none of
//! those Ingresses (before or after it) nor anything they join with, the rows are the ones
//! already computed, and the view is not computed again: at 10,000 Ingresses each such view
//! walked every Ingress after every Ingress or Service event (the default backends' view was
//! a tenth of the render after a Service event, for no row changed).
//!
//! A view whose member's rows read other Ingresses too (a canary's main route, a
//! passthrough's claims over every rule's host) is *entangled*: then every event computes it
//! again, as before. `tests/derived.rs` and `tests/incremental.rs` hold kept renders to fresh
//! ones over random events.

use std::sync::Arc;

use super::{DefaultBackendExtract, Derivation, HashSet, Ours, Source};
use crate::store::Store;

/// Which Ingresses a sparse view's rows came from, and what they joined with.
#[derive(Debug, Clone, Default)]
pub(super) struct Sparse {
    /// The generations of the view's inputs the rows are of.
    built_from: Vec<u64>,
    /// Our Ingresses that gave rows (namespace, name).
    members: HashSet<(String, String)>,
    /// The resources of the view's second store the members name (namespace, name): the
    /// Services of default backends.
    joined: HashSet<(String, String)>,
    /// A member's rows read other Ingresses too.
    entangled: bool,
}

/// Whether `derivation` is one of the sparse views.
pub(super) fn applies(derivation: &Derivation) -> bool {
    matches!(
        derivation,
        Derivation::IngressDefaultBackends { .. }
            | Derivation::IngressAnnotations { .. }
            | Derivation::IngressPassthrough { .. }
    )
}

/// What one Ingress is to a sparse view: `None` when it gives no row; else whether its rows
/// read other Ingresses, and what it joins with in the view's second store.
fn membership(
    derivation: &Derivation,
    namespace: &str,
    value: &crate::store::Stored,
    extracts: &Arc<super::Extracts>,
) -> Option<(bool, Vec<(String, String)>)> {
    let ingress = extracts.ingress(value);
    let named = |name: &str| (namespace.to_owned(), name.to_owned());
    match derivation {
        Derivation::IngressDefaultBackends { .. } => match ingress.default_backend.as_ref()? {
            DefaultBackendExtract::Service(target) => Some((false, vec![named(&target.service)])),
            DefaultBackendExtract::Resource => Some((false, Vec::new())),
        },
        Derivation::IngressAnnotations { .. } => {
            ingress.nginx.as_ref()?;
            Some((ingress.canary, Vec::new()))
        }
        Derivation::IngressPassthrough { .. } => {
            (!ingress.passthrough.is_empty()).then(|| (true, Vec::new()))
        }
        _ => None,
    }
}

impl Sparse {
    /// What the rows computed over `ingresses` (generations `from`) came from.
    pub(super) fn of(
        derivation: &Derivation,
        ingresses: Source<'_>,
        ours: &Ours<'_>,
        from: Vec<u64>,
    ) -> Self {
        let mut sparse = Self {
            built_from: from,
            ..Self::default()
        };
        for ((namespace, name), value, extracts) in ingresses.entries() {
            if !ours.accepts(extracts.ingress(value)) {
                continue;
            }
            if let Some((entangled, joined)) = membership(derivation, namespace, value, extracts) {
                sparse.entangled |= entangled;
                sparse.joined.extend(joined);
                sparse.members.insert((namespace.clone(), name.clone()));
            }
        }
        sparse
    }

    /// Whether the rows computed at `self.built_from` are still the view's at `from`: nothing
    /// but Ingresses that give no row (before and after) and resources of the second store
    /// no member names changed since. `stores` are the view's input stores, the Ingresses
    /// first (the IngressClasses, when it has them, last: a change of them is not skipped).
    pub(super) fn still(
        &self,
        derivation: &Derivation,
        stores: &[&Store],
        ours: &Ours<'_>,
        from: &[u64],
    ) -> bool {
        if self.entangled || self.built_from.len() != from.len() {
            return false;
        }
        let own = match derivation {
            Derivation::IngressAnnotations { .. } => 1,
            _ => 2,
        };
        if self.built_from.get(own..) != from.get(own..) {
            return false;
        }
        let (Some(ingresses), Some(&ingresses_from)) = (stores.first(), self.built_from.first())
        else {
            return false;
        };
        let Some(changed) = ingresses.changes_since(ingresses_from) else {
            return false;
        };
        for key in changed {
            if self.members.contains(key) {
                return false;
            }
            let joins = ingresses
                .get_entry(&key.0, &key.1)
                .filter(|(value, extracts)| ours.accepts(extracts.ingress(value)))
                .and_then(|(value, extracts)| membership(derivation, &key.0, value, extracts));
            if joins.is_some() {
                return false;
            }
        }
        if own == 2 {
            let (Some(second), Some(&second_from)) = (stores.get(1), self.built_from.get(1)) else {
                return false;
            };
            let Some(changed) = second.changes_since(second_from) else {
                return false;
            };
            if changed.into_iter().any(|key| self.joined.contains(key)) {
                return false;
            }
        }
        true
    }

    /// The rows are still those: they are now of `from`.
    pub(super) fn advance(&mut self, from: Vec<u64>) {
        self.built_from = from;
    }
}
