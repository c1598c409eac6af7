//! The seeded fault schedule of one run: which faults, when, for how long, against what. The
//! same seed gives the same schedule (targets named by role, "the leader", are resolved when
//! the fault starts).

use std::{fmt, time::Duration};

use rand::{Rng as _, SeedableRng as _, rngs::StdRng};

use crate::fleet::{AGENTS, LEASE_DURATION, RENEW_DEADLINE, REPLICAS};

/// The kinds of fault a campaign injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Kind {
    /// One replica partitioned from the API (testkit `Fault::Partition`).
    Partition,
    /// Every client cut from the API for less than RenewDeadline.
    OutageShort,
    /// Every client cut from the API for longer than RenewDeadline.
    OutageLong,
    /// Answers to one replica (or all) held back (testkit `Fault::SlowResponse`).
    SlowApi,
    /// SIGSTOP of the leader for longer than LeaseDuration, then SIGCONT.
    StopLeader,
    /// kill -9 of a replica, restarted after a pause.
    KillReplica,
    /// kill -9 of an agent (its HAProxy stays), restarted after a pause.
    KillAgent,
    /// kill -9 of an agent's HAProxy master (the agent's supervisor restarts it).
    KillHaproxy,
    /// The Lease deleted through the API.
    DeleteLease,
    /// An agent's data directory (a small tmpfs) filled to the last byte for a while.
    DiskFull,
    /// One replica's election clock running fast (1.1x to 1.4x) for the whole run.
    ClockSkew,
}

impl Kind {
    /// Every kind, in report order.
    pub(crate) const ALL: [Kind; 11] = [
        Kind::Partition,
        Kind::OutageShort,
        Kind::OutageLong,
        Kind::SlowApi,
        Kind::StopLeader,
        Kind::KillReplica,
        Kind::KillAgent,
        Kind::KillHaproxy,
        Kind::DeleteLease,
        Kind::DiskFull,
        Kind::ClockSkew,
    ];

    /// The kinds scheduled during the fault phase (the clock skew is set at start).
    const TIMED: [Kind; 10] = [
        Kind::Partition,
        Kind::OutageShort,
        Kind::OutageLong,
        Kind::SlowApi,
        Kind::StopLeader,
        Kind::KillReplica,
        Kind::KillAgent,
        Kind::KillHaproxy,
        Kind::DeleteLease,
        Kind::DiskFull,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Partition => "partition",
            Kind::OutageShort => "outage<renew",
            Kind::OutageLong => "outage>renew",
            Kind::SlowApi => "slow-api",
            Kind::StopLeader => "sigstop-leader",
            Kind::KillReplica => "kill-replica",
            Kind::KillAgent => "kill-agent",
            Kind::KillHaproxy => "kill-haproxy",
            Kind::DeleteLease => "delete-lease",
            Kind::DiskFull => "disk-full",
            Kind::ClockSkew => "clock-skew",
        }
    }
}

/// What a fault acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The Lease holder when the fault starts (a random replica when there is none).
    Leader,
    /// Replica `i`.
    Replica(usize),
    /// Every replica.
    AllReplicas,
    /// Agent `i`.
    Agent(usize),
    /// The API server itself, or the Lease.
    Api,
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Planned {
    /// Start, from the beginning of the fault phase.
    pub(crate) at: Duration,
    pub(crate) kind: Kind,
    pub(crate) target: Target,
    /// How long it lasts (the pause before a restart, for kills).
    pub(crate) hold: Duration,
    /// The slowness of a `SlowApi`.
    pub(crate) delay: Duration,
    /// A seed for what the fault decides when it starts (a replica when there is no leader).
    pub(crate) seed: u64,
}

impl fmt::Display for Planned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "+{:.1}s {} {:?} for {:.1}s",
            self.at.as_secs_f64(),
            self.kind.name(),
            self.target,
            self.hold.as_secs_f64()
        )?;
        if self.kind == Kind::SlowApi {
            write!(f, " (answers {} ms late)", self.delay.as_millis())?;
        }
        Ok(())
    }
}

/// The schedule of one run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Schedule {
    pub(crate) seed: u64,
    /// The timed faults, by start.
    pub(crate) faults: Vec<Planned>,
    /// A replica whose election clock runs fast, and how fast.
    pub(crate) clock: Option<(usize, f64)>,
    /// The agent whose data directory is a tmpfs (the target of every disk-full fault).
    pub(crate) tmpfs_agent: Option<usize>,
    /// Seed of the writer's changes.
    pub(crate) writer_seed: u64,
}

fn secs(rng: &mut StdRng, low: f64, high: f64) -> Duration {
    Duration::from_secs_f64(rng.random_range(low..high))
}

impl Schedule {
    /// The schedule for `seed`, with faults starting within `phase`.
    pub(crate) fn new(seed: u64, phase: Duration) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let count = rng.random_range(4..=7);
        let renew = RENEW_DEADLINE.as_secs_f64();
        let lease = LEASE_DURATION.as_secs_f64();
        let disk_agent = rng.random_range(0..AGENTS);
        let mut faults = Vec::new();
        for _ in 0..count {
            let kind = Kind::TIMED[rng.random_range(0..Kind::TIMED.len())];
            let replica = |rng: &mut StdRng| {
                if rng.random_bool(0.6) {
                    Target::Leader
                } else {
                    Target::Replica(rng.random_range(0..REPLICAS))
                }
            };
            let (target, hold) = match kind {
                Kind::Partition => (replica(&mut rng), secs(&mut rng, 1.0, 6.0)),
                Kind::OutageShort => (Target::Api, secs(&mut rng, 0.3, renew - 0.3)),
                Kind::OutageLong => (Target::Api, secs(&mut rng, renew + 0.5, renew + 3.0)),
                Kind::SlowApi => {
                    let target = if rng.random_bool(0.5) {
                        Target::AllReplicas
                    } else {
                        replica(&mut rng)
                    };
                    (target, secs(&mut rng, 2.0, 6.0))
                }
                Kind::StopLeader => (Target::Leader, secs(&mut rng, lease + 0.5, lease + 3.0)),
                Kind::KillReplica => (replica(&mut rng), secs(&mut rng, 0.3, 3.0)),
                Kind::KillAgent => (
                    Target::Agent(rng.random_range(0..AGENTS)),
                    secs(&mut rng, 0.2, 2.0),
                ),
                Kind::KillHaproxy => (Target::Agent(rng.random_range(0..AGENTS)), Duration::ZERO),
                Kind::DeleteLease => (Target::Api, Duration::ZERO),
                Kind::DiskFull => (Target::Agent(disk_agent), secs(&mut rng, 2.0, 6.0)),
                Kind::ClockSkew => (Target::Api, Duration::ZERO),
            };
            let latest = phase.saturating_sub(hold).as_secs_f64().max(0.1);
            let at = secs(&mut rng, 0.0, latest);
            let delay = Duration::from_millis(rng.random_range(100..1500));
            faults.push(Planned {
                at,
                kind,
                target,
                hold,
                delay,
                seed: rng.random(),
            });
        }
        faults.sort_by_key(|f| f.at);
        let clock = rng
            .random_bool(0.5)
            .then(|| (rng.random_range(0..REPLICAS), rng.random_range(1.1..=1.4)));
        let tmpfs_agent = faults
            .iter()
            .any(|f| f.kind == Kind::DiskFull)
            .then_some(disk_agent);
        Self {
            seed,
            faults,
            clock,
            tmpfs_agent,
            writer_seed: rng.random(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_schedule_and_faults_fit_the_phase() {
        let phase = Duration::from_secs(16);
        for seed in 0..200 {
            let a = Schedule::new(seed, phase);
            assert_eq!(a, Schedule::new(seed, phase));
            for fault in &a.faults {
                assert!(fault.at + fault.hold <= phase + Duration::from_millis(100));
            }
            if let Some((_, rate)) = a.clock {
                assert!((1.1..=1.4).contains(&rate));
            }
        }
        assert_ne!(Schedule::new(1, phase), Schedule::new(2, phase));
    }

    #[test]
    fn outages_straddle_the_renew_deadline_and_stops_outlast_the_lease() {
        let phase = Duration::from_secs(16);
        let faults: Vec<Planned> = (0..300)
            .flat_map(|seed| Schedule::new(seed, phase).faults)
            .collect();
        for kind in Kind::TIMED {
            assert!(
                faults.iter().any(|f| f.kind == kind),
                "{kind:?} never drawn"
            );
        }
        for fault in &faults {
            match fault.kind {
                Kind::OutageShort => assert!(fault.hold < RENEW_DEADLINE),
                Kind::OutageLong => assert!(fault.hold > RENEW_DEADLINE),
                Kind::StopLeader => assert!(fault.hold > LEASE_DURATION),
                _ => {}
            }
        }
    }
}
