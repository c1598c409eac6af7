//! The cluster's network: one bridge holding the first address of a private /24, and one
//! network namespace per Pod joined to it by a veth pair. The range exists only on the bridge
//! and in those namespaces: no default route is set in a Pod, nothing is forwarded beyond.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// The bridge's name.
pub(crate) const BRIDGE: &str = "hptc0";
/// The first three octets of the Pod range; the bridge is `.1`.
pub(crate) const PREFIX: &str = "10.88.0";
/// The bridge's address: the API server listens here, and Pods reach it on-link.
pub(crate) const BRIDGE_IP: &str = "10.88.0.1";
/// Every network namespace of the cluster starts with this (`down` sweeps them).
pub(crate) const NETNS_PREFIX: &str = "hptc-";

/// Runs `ip ARGS`, failing with its standard error.
pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {} (the local cluster needs root for bridges and network namespaces)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Creates the bridge with its address (a leftover one is reused).
pub(crate) fn bridge_up() -> Result<()> {
    if ip(&["link", "show", BRIDGE]).is_err() {
        ip(&["link", "add", BRIDGE, "type", "bridge"])?;
    }
    let _ = ip(&["addr", "add", &format!("{BRIDGE_IP}/24"), "dev", BRIDGE]);
    ip(&["link", "set", BRIDGE, "up"])
}

/// Removes the bridge (no error when it is gone).
pub(crate) fn bridge_down() {
    let _ = ip(&["link", "del", BRIDGE]);
}

/// A Pod's namespace `hptc-N` at `10.88.0.N`, its veth's host end on the bridge.
pub(crate) fn pod_netns(n: u8) -> Result<(String, String)> {
    let netns = format!("{NETNS_PREFIX}{n}");
    let ip_addr = format!("{PREFIX}.{n}");
    let (host_if, peer_if) = (format!("hptc{n}h"), format!("hptc{n}p"));
    // A leftover of a crashed run under the same number goes first.
    let _ = ip(&["netns", "del", &netns]);
    let _ = ip(&["link", "del", &host_if]);
    ip(&["netns", "add", &netns])?;
    let setup = || -> Result<()> {
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
        ])?;
        ip(&["link", "set", &peer_if, "netns", &netns])?;
        ip(&["link", "set", &host_if, "master", BRIDGE])?;
        ip(&["link", "set", &host_if, "up"])?;
        let exec = |args: &[&str]| {
            let mut all = vec!["netns", "exec", netns.as_str(), "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        exec(&["addr", "add", &format!("{ip_addr}/24"), "dev", &peer_if])?;
        exec(&["link", "set", &peer_if, "up"])?;
        exec(&["link", "set", "lo", "up"])?;
        // As container runtimes do (Docker, containerd, CRI-O): any port is bindable in the
        // Pod's own namespace, so a non-root HAProxy serves a Gateway listener on 80 or 443.
        sysctl_in(&netns, "net.ipv4.ip_unprivileged_port_start=0")
    };
    if let Err(error) = setup() {
        delete_netns(&netns);
        return Err(error);
    }
    Ok((netns, ip_addr))
}

/// `sysctl -w SETTING` inside the namespace `netns`.
fn sysctl_in(netns: &str, setting: &str) -> Result<()> {
    let status = Command::new("ip")
        .args(["netns", "exec", netns, "sysctl", "-q", "-w", setting])
        .status()
        .with_context(|| format!("running sysctl {setting} in {netns}"))?;
    if !status.success() {
        bail!("sysctl -w {setting} in {netns} failed ({status})");
    }
    Ok(())
}

/// Kills every process left in the namespace, then deletes it (the veth pair goes with it).
pub(crate) fn delete_netns(netns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    let _ = ip(&["netns", "del", netns]);
}

/// Every network namespace of the cluster's prefix.
pub(crate) fn cluster_netns() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(NETNS_PREFIX))
        .map(str::to_owned)
        .collect()
}
