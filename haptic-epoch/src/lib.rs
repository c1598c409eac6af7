//! A fencing epoch kept on the leader Lease.
//!
//! A Lease says who leads; it does not stop a leader that stalled (GC pause, partition) from
//! acting after its successor took over. Fencing does: every term claims a number strictly
//! higher than any earlier term's, every write the leader sends downstream carries it, and each
//! receiver keeps the highest number it has seen and refuses lower ones.
//!
//! The number lives in the annotation `haptic.io/leader-epoch` (a decimal u64) on the same Lease
//! the elector uses, so claiming it is a compare-and-swap on the Lease's resourceVersion:
//!
//! - [`EpochStore::bump`] claims the next epoch, only while the Lease names this holder,
//!   retrying on conflicts; a term dispatches nothing before its bump succeeded;
//! - [`EpochStore::leader_epoch`] is the epoch of this controller's current term, 0 for none;
//! - [`Term::reclaim`] answers a receiver that reports a fence above ours: if the Lease still
//!   names us and nobody else raised the epoch, the counter regressed (the Lease was deleted,
//!   recreated or restored from a backup) and we raise it above the receiver's fence; otherwise
//!   another leader exists ([`Error::ForeignLeader`]) and we must stop writing;
//! - [`Term::stand_down`] ends a term by releasing the Lease: only a fresh acquisition claims a
//!   fresh epoch.
//!
//! Why not `leaseTransitions`: identities are pod names, and a pod that re-acquires its own
//! Lease keeps the count, so two terms could share it.
//!
//! # Malformed annotations and the recovery rule
//!
//! An annotation that is not a decimal u64 (empty, negative, a fraction, an overflow) is never
//! read as some number: [`EpochStore::bump`] fails with [`Error::Malformed`] naming the value.
//! The recovery is [`EpochStore::bump_above`] with a floor the caller knows to be at least every
//! epoch any receiver accepted (the agents report their fences): it writes
//! `max(floor, last claimed here) + 1`, so the epoch never goes backwards.
//!
//! # Example
//!
//! ```
//! use haptic_epoch::EpochStore;
//! # use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
//! # use kube::api::{Api, PostParams};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = haptic_testkit::ApiServer::start().await?;
//! # let client = server.client_for("pod-a")?;
//! # let lease = Lease { metadata: kube::api::ObjectMeta { name: Some("leader".into()), ..Default::default() },
//! #     spec: Some(LeaseSpec { holder_identity: Some("pod-a".into()), ..Default::default() }) };
//! # Api::<Lease>::namespaced(client.clone(), "default").create(&PostParams::default(), &lease).await?;
//! // After the elector acquired the Lease "leader" as "pod-a":
//! let epochs = EpochStore::new(client, "default", "leader", "pod-a");
//! let term = epochs.bump().await?;
//! assert_eq!(term.epoch(), 1);
//! assert_eq!(epochs.leader_epoch(), 1);
//! // ... every apply carries term.epoch() ...
//! term.stand_down("example done").await?;
//! assert_eq!(epochs.leader_epoch(), 0);
//! # Ok(())
//! # }
//! ```

mod epoch;

pub use epoch::{EPOCH_ANNOTATION, EpochStore, Error, Malformed, Result, Term, parse_epoch};
