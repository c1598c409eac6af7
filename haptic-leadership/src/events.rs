//! The leader events the adapter publishes, each stamped with the wall-clock time it happened.

use std::time::SystemTime;

/// The elector started on this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElectionStarted {
    /// This replica's identity.
    pub identity: String,
    /// The Lease's name.
    pub lease_name: String,
    /// The Lease's namespace.
    pub lease_namespace: String,
    /// When it happened.
    pub at: SystemTime,
}

/// This replica acquired the Lease and claimed `epoch`; leader-only components are being built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BecameLeader {
    /// This replica's identity.
    pub identity: String,
    /// The fencing epoch every write of this term carries (0 in disabled mode: no fencing).
    pub epoch: u64,
    /// When it happened.
    pub at: SystemTime,
}

/// This replica's term ended; leader-only components are being stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostLeadership {
    /// This replica's identity.
    pub identity: String,
    /// `graceful_shutdown`, `lease_expired`, `lease_taken`, or `stood_down` (the term gave the
    /// Lease up itself, e.g. after a failed epoch bump or a foreign leader).
    pub reason: String,
    /// When it happened.
    pub at: SystemTime,
}

/// A new holder of the Lease was observed (also when it is this replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLeaderObserved {
    /// The new holder.
    pub new_leader_identity: String,
    /// Whether it is this replica.
    pub is_self: bool,
    /// When it happened.
    pub at: SystemTime,
}

/// An application event type the adapter can publish into.
pub trait LeaderEvents:
    haptic_eventbus::Event
    + From<LeaderElectionStarted>
    + From<BecameLeader>
    + From<LostLeadership>
    + From<NewLeaderObserved>
{
}

impl<E> LeaderEvents for E where
    E: haptic_eventbus::Event
        + From<LeaderElectionStarted>
        + From<BecameLeader>
        + From<LostLeadership>
        + From<NewLeaderObserved>
{
}
