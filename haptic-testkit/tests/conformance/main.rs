//! Conformance suite: drives the haptic-testkit API server with the real kube client, serde and
//! kube-runtime watcher, and checks each rule of the stand-in against kube-apiserver's behaviour
//! (see `KUBE-API-NOTES.md`).

#![allow(clippy::unwrap_used, missing_docs, unreachable_pub)]

mod common;
mod discovery;
mod errors;
mod faults;
mod objects;
mod patch;
mod standalone;
mod watch;
