//! Loopback ports for test servers that bind them a moment after they are chosen (HAProxy,
//! agents, etcd, kube-apiserver).
//!
//! A port from `bind(127.0.0.1:0)` comes from the kernel's ephemeral range, the range it
//! also gives outgoing connections their source ports from: released before the server
//! binds it, it could be taken meanwhile by another test's connection or another `bind(0)`
//! (a test failed once with `Address already in use` so). [`free_port`] hands out ports
//! below that range instead, where the kernel gives nothing on its own: each one at most once
//! in a process (the tests of a binary run on its threads), checked free when handed out,
//! from a window that depends on the process id (test binaries that run at once rarely meet).
//! Each port comes with the [`RESERVED`] - 1 ports after it, free and handed to no one else:
//! test configurations put HTTPS at the HTTP port + 1 (handing out neighbours made one test's
//! HTTPS port another's HTTP port).

use std::{
    net::TcpListener,
    sync::atomic::{AtomicU32, Ordering},
};

/// The lowest port handed out (above the well-known and most registered services' ports).
const LOWEST: u32 = 10_000;

/// How many consecutive ports each [`free_port`] reserves, from the one it returns.
pub(crate) const RESERVED: u16 = 4;

/// The first port of the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`),
/// 32768 when it cannot be read.
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A free TCP port on 127.0.0.1 that no outgoing connection or `bind(0)` can be given before
/// the server that asked for it binds it, never the same twice in this process; so are the
/// [`RESERVED`] - 1 ports after it.
///
/// # Panics
///
/// When no port is free below the ephemeral range (or, when that range starts too low to
/// leave room, none from `bind(0)`): no test server could start either.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = ephemeral_start().min(u32::from(u16::MAX) + 1);
    if high < LOWEST + 1_000 {
        // No room below the ephemeral range: the kernel's choice, as before.
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .expect("a free loopback port");
    }
    let blocks = (high - LOWEST) / u32::from(RESERVED);
    let start = std::process::id().wrapping_mul(7_919) % blocks;
    for _ in 0..blocks {
        let next = NEXT.fetch_add(1, Ordering::Relaxed);
        let first = LOWEST + (start.wrapping_add(next) % blocks) * u32::from(RESERVED);
        let Ok(first) = u16::try_from(first) else {
            continue;
        };
        // Free on every address (a server of another process on 127.0.0.2 holds it too).
        let free = (first..first.saturating_add(RESERVED))
            .all(|port| TcpListener::bind(("0.0.0.0", port)).is_ok());
        if free {
            return first;
        }
    }
    panic!("no {RESERVED} free loopback ports in a row below {high}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_free_and_never_given_twice() {
        let high = ephemeral_start();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        // Every port with the ones reserved after it: none handed out twice.
        let mut all: Vec<u16> = ports
            .iter()
            .flat_map(|port| *port..port + RESERVED)
            .collect();
        all.sort_unstable();
        let count = all.len();
        all.dedup();
        assert_eq!(
            all.len(),
            count,
            "a port handed out twice, or next to another"
        );
        for port in ports {
            if high >= LOWEST + 1_000 {
                assert!(
                    u32::from(port) >= LOWEST && u32::from(port) < high,
                    "{port}"
                );
            }
            TcpListener::bind(("127.0.0.1", port)).expect("free when handed out");
            TcpListener::bind(("127.0.0.1", port + 1)).expect("its neighbour too");
        }
    }
}
