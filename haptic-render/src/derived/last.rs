//! A view's list as it was last given, patched rather than gathered again: a view kept as
//! rows by key (an Ingress's routes, a Service's backends) gives after one event the list
//! it gave last with the changed keys' rows put in again, the rest copied as runs, and the
//! very same list when no key's rows changed (which the renders then reuse whole).

use std::collections::BTreeMap;

use tera::Value;

/// At most this many keys changed since the last list, or the list is gathered whole.
const PATCH_LEN: usize = 64;

/// The key of a view's rows: namespace and name.
type Key = (String, String);

/// The view's list as it was last given, and the row count then of each key whose rows
/// changed since (0: it was not in the view): the next list is this one with those keys'
/// rows put in again, so that after one event the list is copied, not gathered from 10,000
/// parts again (the walk over the parts' map was ~1 ms of a render at 10,000 Ingresses).
#[derive(Debug, Clone)]
pub(super) struct LastList {
    list: Value,
    before: BTreeMap<Key, usize>,
}

impl LastList {
    /// Notes that the rows of `key` are about to change, with how many it has now
    /// (`count`, asked the first time since the last list only).
    pub(super) fn note(last: &mut Option<Self>, key: &Key, count: impl FnOnce() -> usize) {
        if let Some(last) = last
            && !last.before.contains_key(key)
        {
            last.before.insert(key.clone(), count());
        }
    }

    /// The view over `parts` (each part's `rows`, in key order), from the list given last
    /// when few keys' rows changed since: the rows of the others are taken from that list
    /// as runs, in order. Keeps the list it gives in `last`.
    pub(super) fn follow<V>(
        last: &mut Option<Self>,
        parts: &BTreeMap<Key, V>,
        rows: impl Fn(&V) -> &[Value] + Copy,
    ) -> Value {
        let value = match last.take() {
            // No key's rows changed: the very list.
            Some(last) if last.before.is_empty() => last.list,
            Some(last) if last.before.len() <= PATCH_LEN => last
                .patched(parts, rows)
                .unwrap_or_else(|| gathered(parts, rows)),
            _ => gathered(parts, rows),
        };
        *last = Some(LastList {
            list: value.clone(),
            before: BTreeMap::new(),
        });
        value
    }

    /// The list given last with the changed keys' rows put in again; none when the counts
    /// do not add up (then it is gathered whole).
    fn patched<V>(
        &self,
        parts: &BTreeMap<Key, V>,
        rows_of: impl Fn(&V) -> &[Value],
    ) -> Option<Value> {
        let old = self.list.as_array()?;
        let grown: isize = self
            .before
            .iter()
            .map(|(key, before)| {
                parts.get(key).map_or(0, |part| rows_of(part).len()) as isize - *before as isize
            })
            .sum();
        let len = usize::try_from(old.len() as isize + grown).ok()?;
        let mut rows = Vec::with_capacity(len);
        // Where the next run starts in the old list (its length counted over the parts in
        // between, whose rows did not change).
        let mut old_at = 0usize;
        let mut from: Option<&Key> = None;
        for (key, before) in &self.before {
            let between = match from {
                None => parts.range(..key.clone()),
                Some(from) => parts.range((
                    std::ops::Bound::Excluded(from.clone()),
                    std::ops::Bound::Excluded(key.clone()),
                )),
            };
            let run: usize = between.map(|(_, part)| rows_of(part).len()).sum();
            rows.extend_from_slice(old.get(old_at..old_at + run)?);
            old_at += run + before;
            if let Some(part) = parts.get(key) {
                rows.extend_from_slice(rows_of(part));
            }
            from = Some(key);
        }
        rows.extend_from_slice(old.get(old_at..)?);
        (rows.len() == len).then(|| Value::from(rows))
    }
}

/// Every part's rows, in key order.
pub(super) fn gathered<V>(parts: &BTreeMap<Key, V>, rows: impl Fn(&V) -> &[Value]) -> Value {
    // Sized first: collected from the parts' rows, the list grew (and was copied) a dozen
    // times over at 20,000 rows.
    let mut list = Vec::with_capacity(parts.values().map(|part| rows(part).len()).sum());
    list.extend(parts.values().flat_map(|part| rows(part).iter().cloned()));
    Value::from(list)
}
