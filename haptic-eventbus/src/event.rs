//! The contract between the application's event type and the bus: kinds, filters, responses.

use std::fmt::Debug;
use std::hash::Hash;

use crate::request::RequestId;

/// An event the bus can carry: usually the application's own `enum` of everything that happens.
///
/// The bus never clones an event: [`EventBus::publish`](crate::EventBus::publish) wraps it in
/// an [`Arc`](std::sync::Arc) once and every subscriber receives a clone of that `Arc`, so a
/// large event costs the same to fan out as a small one.
///
/// Subscriptions select events by [`Kind`](Event::Kind), a cheap `Copy` discriminant (usually
/// a field-less mirror of the event enum). [`kind`](Event::kind) and
/// [`response_to`](Event::response_to) must be pure and fast: the bus calls them once per
/// publish, before taking its lock. An event may be dropped, and `Kind`'s `Hash` and `Eq` run,
/// while the bus holds its lock, so those must not call back into the bus (plain data never
/// does).
///
/// # Example
///
/// ```
/// use haptic_eventbus::{Event, RequestId, ResponseTo};
///
/// #[derive(Debug)]
/// enum AppEvent {
///     PodsChanged { count: usize },
///     ValidateConfig { request: RequestId, config: String },
///     ConfigValidated { request: RequestId, validator: String, ok: bool },
/// }
///
/// #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
/// enum AppKind {
///     PodsChanged,
///     ValidateConfig,
///     ConfigValidated,
/// }
///
/// impl Event for AppEvent {
///     type Kind = AppKind;
///
///     fn kind(&self) -> AppKind {
///         match self {
///             AppEvent::PodsChanged { .. } => AppKind::PodsChanged,
///             AppEvent::ValidateConfig { .. } => AppKind::ValidateConfig,
///             AppEvent::ConfigValidated { .. } => AppKind::ConfigValidated,
///         }
///     }
///
///     fn response_to(&self) -> Option<ResponseTo<'_>> {
///         match self {
///             AppEvent::ConfigValidated { request, validator, .. } => {
///                 Some(ResponseTo { request: *request, responder: validator })
///             }
///             _ => None,
///         }
///     }
/// }
/// ```
pub trait Event: Send + Sync + 'static {
    /// The discriminant subscriptions filter on.
    type Kind: Copy + Eq + Hash + Debug + Send + Sync + 'static;

    /// This event's kind.
    fn kind(&self) -> Self::Kind;

    /// If this event answers a [`request`](crate::EventBus::request), which request and who
    /// answers it. The default says it answers nothing.
    ///
    /// A response is still an ordinary event: subscribers of its kind receive it as well.
    fn response_to(&self) -> Option<ResponseTo<'_>> {
        None
    }
}

/// What a response event says about itself: the request it answers and the responder's name.
///
/// The name is matched against [`RequestParams::expected_responders`](crate::RequestParams).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseTo<'a> {
    /// The id the bus gave the request (see [`EventBus::request`](crate::EventBus::request)).
    pub request: RequestId,
    /// Who answers; one answer per responder is kept.
    pub responder: &'a str,
}

/// Which kinds a subscription receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filter<K> {
    /// Every event.
    All,
    /// Only events of these kinds. An empty list receives nothing.
    Kinds(Vec<K>),
}

impl<K: Copy + Eq> Filter<K> {
    /// Every event.
    pub fn all() -> Self {
        Filter::All
    }

    /// Events of a single kind.
    pub fn kind(kind: K) -> Self {
        Filter::Kinds(vec![kind])
    }

    /// Events of any of these kinds; duplicates are ignored.
    pub fn kinds(kinds: impl IntoIterator<Item = K>) -> Self {
        let mut unique: Vec<K> = Vec::new();
        for kind in kinds {
            if !unique.contains(&kind) {
                unique.push(kind);
            }
        }
        Filter::Kinds(unique)
    }

    /// Whether an event of `kind` passes this filter.
    pub fn matches(&self, kind: K) -> bool {
        match self {
            Filter::All => true,
            Filter::Kinds(kinds) => kinds.contains(&kind),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Filter;

    #[test]
    fn kinds_deduplicates_and_matches() {
        let filter = Filter::kinds([1, 2, 1, 3]);
        assert_eq!(filter, Filter::Kinds(vec![1, 2, 3]));
        assert!(filter.matches(2));
        assert!(!filter.matches(4));
        assert!(Filter::<u8>::all().matches(9));
        assert!(!Filter::<u8>::Kinds(Vec::new()).matches(0));
    }
}
