//! The invariants, judged from what the run recorded: each agent's apply journal and the Lease
//! history the runner watched. Pure functions, so that the checks themselves are tested.

use std::collections::{BTreeMap, BTreeSet};

use haptic_agent::journal::JournalEntry;

/// Which identities claimed each epoch (the Lease's `haptic.io/leader-epoch` annotation took
/// that value while the Lease named them). After a Lease is deleted an epoch can be claimed
/// again, by another replica.
pub(crate) type Claims = BTreeMap<u64, BTreeSet<String>>;

/// Outcomes the agent gives only after the fence step passed: the epoch is at or below the
/// fence once they are answered.
fn passed_fence(outcome: &str) -> bool {
    matches!(
        outcome,
        "applied" | "unchanged" | "invalid" | "rolled_back" | "superseded"
    )
}

/// What one agent's journal says about invariants (1) and (2).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct JournalVerdict {
    /// Applies that went live below the fence (or at it from another leader): must be none.
    pub(crate) stale: Vec<String>,
    /// Live sets sent by a replica that did not hold the Lease at that epoch.
    pub(crate) foreign: Vec<String>,
    /// Applies that went live, and of those how many changed the set (`applied`).
    pub(crate) live: usize,
    pub(crate) applied: usize,
    /// Refusals the fence made (`fenced`): stale sends that were stopped.
    pub(crate) fenced: usize,
}

/// (1) accepted epochs never go down and nothing below the fence goes live; (2) every live set
/// was sent by the replica that claimed its epoch.
pub(crate) fn judge_journal(
    agent: &str,
    entries: &[JournalEntry],
    claims: &Claims,
) -> JournalVerdict {
    let mut verdict = JournalVerdict::default();
    // A lower bound of the agent's fence, and the identity that holds it.
    let mut fence: Option<(u64, String)> = None;
    let mut last_seq = 0;
    for entry in entries {
        if entry.seq <= last_seq {
            verdict.stale.push(format!(
                "{agent}: journal out of order (seq {} after {last_seq})",
                entry.seq
            ));
        }
        last_seq = entry.seq;
        if entry.outcome == "fenced" {
            verdict.fenced += 1;
            if let Some(f) = entry.fence
                && fence.as_ref().is_none_or(|(e, _)| f > *e)
            {
                // The holder of a fence learnt only from a refusal is unknown.
                fence = Some((f, String::new()));
            }
            continue;
        }
        if entry.live {
            verdict.live += 1;
            if entry.outcome == "applied" {
                verdict.applied += 1;
            }
            if let Some((epoch, holder)) = &fence {
                let below = entry.epoch < *epoch;
                let foreign_at_fence =
                    entry.epoch == *epoch && !holder.is_empty() && *holder != entry.leader;
                if below || foreign_at_fence {
                    verdict.stale.push(format!(
                        "{agent}: seq {} {} went live at epoch {} from {} with the fence at {epoch} (held by {})",
                        entry.seq,
                        short(&entry.checksum),
                        entry.epoch,
                        entry.leader,
                        if holder.is_empty() { "?" } else { holder },
                    ));
                }
            }
            let claimed = claims
                .get(&entry.epoch)
                .is_some_and(|holders| holders.contains(&entry.leader));
            if !claimed {
                verdict.foreign.push(format!(
                    "{agent}: seq {} {} went live at epoch {} from {}, which the Lease history shows claimed by {:?}",
                    entry.seq,
                    short(&entry.checksum),
                    entry.epoch,
                    entry.leader,
                    claims.get(&entry.epoch).map(|h| h.iter().collect::<Vec<_>>()).unwrap_or_default(),
                ));
            }
        }
        if passed_fence(&entry.outcome) && fence.as_ref().is_none_or(|(e, _)| entry.epoch > *e) {
            fence = Some((entry.epoch, entry.leader.clone()));
        }
    }
    verdict
}

pub(crate) fn short(checksum: &str) -> &str {
    checksum.get(..12).unwrap_or(checksum)
}

/// Percentile `p` (0..=100) of `values`, nearest rank; none for an empty list.
pub(crate) fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The longest stretch (ms) in which every probe failed, outside the excused windows.
/// `probes` are (time, ok) in time order; a failure inside a window (a killed HAProxy or
/// agent, and the time it needs to come back) is not counted.
pub(crate) fn longest_outage(probes: &[(u64, bool)], excused: &[(u64, u64)]) -> u64 {
    let mut longest = 0;
    let mut since: Option<u64> = None;
    for &(at, ok) in probes {
        let excuse = excused.iter().any(|&(from, to)| at >= from && at <= to);
        if ok || excuse {
            since = None;
            continue;
        }
        let start = *since.get_or_insert(at);
        longest = longest.max(at - start);
    }
    longest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, epoch: u64, leader: &str, outcome: &str) -> JournalEntry {
        JournalEntry {
            seq,
            at_ms: seq,
            epoch,
            leader: leader.into(),
            generation: seq,
            checksum: format!("{seq:064}"),
            outcome: outcome.into(),
            live: matches!(outcome, "applied" | "unchanged"),
            fence: None,
            error: None,
            delta_paths: None,
            took_us: None,
        }
    }

    fn claims() -> Claims {
        Claims::from([
            (1, BTreeSet::from(["c1".to_owned()])),
            (2, BTreeSet::from(["c2".to_owned()])),
            (3, BTreeSet::from(["c1".to_owned()])),
        ])
    }

    #[test]
    fn a_clean_history_passes() {
        let mut fenced = entry(4, 1, "c1", "fenced");
        fenced.fence = Some(2);
        let entries = [
            entry(1, 1, "c1", "applied"),
            entry(2, 1, "c1", "unchanged"),
            entry(3, 2, "c2", "applied"),
            fenced,
            entry(5, 2, "c2", "invalid"),
            entry(6, 3, "c1", "applied"),
        ];
        let verdict = judge_journal("a", &entries, &claims());
        assert_eq!(verdict.stale, Vec::<String>::new());
        assert_eq!(verdict.foreign, Vec::<String>::new());
        assert_eq!((verdict.live, verdict.applied, verdict.fenced), (4, 3, 1));
    }

    #[test]
    fn a_stale_epoch_going_live_is_caught() {
        let entries = [entry(1, 2, "c2", "applied"), entry(2, 1, "c1", "applied")];
        let verdict = judge_journal("a", &entries, &claims());
        assert_eq!(verdict.stale.len(), 1, "{verdict:?}");
        assert!(verdict.stale[0].contains("epoch 1 from c1 with the fence at 2"));
    }

    #[test]
    fn the_fence_a_refusal_reported_or_a_failed_check_raised_counts() {
        let mut fenced = entry(2, 1, "c1", "fenced");
        fenced.fence = Some(3);
        let after_refusal = [
            entry(1, 1, "c1", "applied"),
            fenced,
            entry(3, 2, "c2", "applied"),
        ];
        assert_eq!(judge_journal("a", &after_refusal, &claims()).stale.len(), 1);
        let after_invalid = [entry(1, 3, "c1", "invalid"), entry(2, 2, "c2", "unchanged")];
        assert_eq!(judge_journal("a", &after_invalid, &claims()).stale.len(), 1);
    }

    #[test]
    fn another_identity_at_the_fence_epoch_and_an_unclaimed_epoch_are_caught() {
        let entries = [entry(1, 2, "c2", "applied"), entry(2, 2, "c3", "applied")];
        let verdict = judge_journal("a", &entries, &claims());
        assert_eq!(verdict.stale.len(), 1, "{verdict:?}");
        assert_eq!(verdict.foreign.len(), 1, "{verdict:?}");
        assert!(verdict.foreign[0].contains("from c3"));
        let unclaimed = [entry(1, 9, "c1", "applied")];
        assert_eq!(judge_journal("a", &unclaimed, &claims()).foreign.len(), 1);
    }

    #[test]
    fn percentiles_and_outages() {
        let values = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&values, 50.0), Some(3.0));
        assert_eq!(percentile(&values, 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
        let probes = [
            (0, true),
            (100, false),
            (200, false),
            (300, false),
            (400, true),
            (500, false),
        ];
        assert_eq!(longest_outage(&probes, &[]), 200);
        assert_eq!(longest_outage(&probes, &[(150, 250)]), 0);
    }
}
