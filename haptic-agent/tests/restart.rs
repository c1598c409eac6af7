//! The `haptic-agent` binary across restarts: flags and environment, the durable fence,
//! HAProxy started again on the live set, and a corrupt fence reported as not ready.

mod common;

use std::{
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use common::*;
use haptic_agent_client::{AgentClient, ClientConfig, Error};
use reqwest::Url;

/// The agent binary in its own process group, so that dropping the guard (also on a panic)
/// kills the agent and the HAProxy processes it started.
struct AgentProcess {
    child: Child,
    url: Url,
}

impl AgentProcess {
    fn start(data: &Path) -> Self {
        Self::start_in(data, Command::new(env!("CARGO_BIN_EXE_haptic-agent")))
    }

    /// The agent with files it writes limited to `kib` KiB (`ulimit -f`; SIGXFSZ ignored, so
    /// a write past it fails with EFBIG instead of killing the agent).
    fn start_with_file_limit(data: &Path, kib: u32) -> Self {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "trap '' XFSZ; ulimit -f {}; exec \"$0\" \"$@\"",
                kib * 2
            ))
            .arg(env!("CARGO_BIN_EXE_haptic-agent"));
        Self::start_in(data, command)
    }

    fn start_in(data: &Path, mut command: Command) -> Self {
        let token_file = data.parent().expect("parent").join("token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
        let port = free_port();
        let child = command
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--token-file")
            .arg(&token_file)
            .arg("--supervise")
            // What a restart does is the subject here, not the channel (tests/tls.rs).
            .arg("--insecure-plain-http")
            .env("HAPTIC_AGENT_DATA_DIR", data)
            .env("HAPTIC_AGENT_HAPROXY", haproxy_bin())
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("spawn haptic-agent");
        let url = Url::parse(&format!("http://127.0.0.1:{port}/")).expect("url");
        Self { child, url }
    }

    /// SIGTERM to the agent, and waits until it exits (bounded).
    async fn stop(mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().expect("try_wait").is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "agent did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let group = format!("-{}", self.child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = self.child.wait();
        }
    }
}

/// Waits until `/readyz` answers `want` (or 20 s pass); returns the last status.
async fn await_ready(url: &Url, want: u16) -> u16 {
    let http = traffic_client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last = 0;
    while tokio::time::Instant::now() < deadline {
        if let Ok(response) = http.get(url.join("/readyz").expect("url")).send().await {
            last = response.status().as_u16();
            if last == want {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_and_the_live_set_survive_an_agent_restart() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let client = client();
    let port = free_port();
    let set = request(7, "leader-7", 1, config(port, "a", &[("a", a.addr)]));

    let agent = AgentProcess::start(&data);
    assert_eq!(await_ready(&agent.url, 200).await, 200);
    client.apply(&agent.url, &set).await.expect("apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    agent.stop().await;
    assert!(
        get_once(port).await.starts_with("error"),
        "HAProxy stopped with the agent"
    );

    let agent = AgentProcess::start(&data);
    assert_eq!(await_ready(&agent.url, 200).await, 200);
    assert_eq!(
        await_body(port, "backend a").await,
        "backend a",
        "the live set is served again"
    );
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.fence, Some(7));
    assert_eq!(state.live_checksum.as_deref(), Some(set.checksum.as_str()));
    let stale = request(6, "leader-6", 1, config(port, "none", &[("a", a.addr)]));
    assert!(matches!(
        client.apply(&agent.url, &stale).await,
        Err(Error::Fenced { fence: 7, epoch: 6 })
    ));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_fence_file_means_not_ready_and_no_apply() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    std::fs::write(data.join("fence"), "12abc\n").expect("corrupt fence");

    let agent = AgentProcess::start(&data);
    assert_eq!(await_ready(&agent.url, 503).await, 503);
    let health = traffic_client()
        .get(agent.url.join("/healthz").expect("url"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200, "alive, just not ready");
    // The unauthenticated probe names no path and quotes no file content.
    let ready = traffic_client()
        .get(agent.url.join("/readyz").expect("url"))
        .send()
        .await
        .expect("readyz")
        .text()
        .await
        .expect("body");
    assert!(ready.contains("corrupt"), "{ready}");
    assert!(
        !ready.contains("12abc") && !ready.contains(&*root.path().to_string_lossy()),
        "{ready}"
    );

    let client =
        AgentClient::new(ClientConfig::new(TOKEN).with_retries(2, Duration::from_millis(10)))
            .expect("client");
    let set = request(100, "leader", 1, config(free_port(), "a", &[("a", a.addr)]));
    match client.apply(&agent.url, &set).await {
        Err(Error::Unavailable {
            attempts: 2,
            message,
        }) => {
            assert!(message.contains("corrupt"), "{message}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(
        std::fs::read_to_string(data.join("fence")).expect("fence"),
        "12abc\n",
        "the agent does not guess or overwrite"
    );
    assert!(listing(&data.join("sets")).is_empty());
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.fence, None);
    assert!(state.fence_error.expect("fence error").contains("corrupt"));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_staging_write_leaves_no_staging_directory() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let agent = AgentProcess::start_with_file_limit(&data, 64);
    assert_eq!(await_ready(&agent.url, 200).await, 200);

    // A map larger than the agent may write: staging fails half-way.
    let mut files = config(free_port(), "a", &[("a", a.addr)]);
    files
        .insert("maps/big.map", "x".repeat(256 << 10))
        .expect("big map");
    let client =
        AgentClient::new(ClientConfig::new(TOKEN).with_retries(1, Duration::from_millis(10)))
            .expect("client");
    match client
        .apply(&agent.url, &request(1, "leader", 1, files))
        .await
    {
        Err(Error::Unexpected { status: 500, body }) => {
            assert!(body.contains("big.map"), "{body}");
        }
        other => panic!("expected a 500, got {other:?}"),
    }
    assert!(
        listing(&data.join("staging")).is_empty(),
        "the half-written staging directory was removed"
    );
    assert!(listing(&data.join("sets")).is_empty());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_takes_its_policy_from_flags_and_environment() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let client = client();
    let port = free_port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_haptic-agent"));
    command
        .args(["--allow", "lua"])
        .env("HAPTIC_AGENT_ALLOW_ENV", "FLEET_COLOUR")
        .env("FLEET_COLOUR", "blue")
        .env("POD_IP", "127.0.0.1")
        .env("NODE_SECRET", "s3cr3t");
    let agent = AgentProcess::start_in(&data, command);
    assert_eq!(await_ready(&agent.url, 200).await, 200);

    // Every pod of a fleet gets the same configuration and binds to its own address; Lua
    // from the set is allowed by `--allow lua`, and FLEET_COLOUR by the environment.
    let files = rewrite(&config(port, "a", &[("a", a.addr)]), "haproxy.cfg", |cfg| {
        cfg.replace(
                &format!("bind 127.0.0.1:{port}"),
                &format!(
                    "bind \"${{POD_IP}}:{port}\"\n  http-response set-header x-colour \"${{FLEET_COLOUR}}\""
                ),
            )
            .replacen("global\n", "global\n  lua-load empty.lua\n", 1)
    });
    let mut files = files;
    files.insert("empty.lua", "-- nothing\n").expect("path");
    client
        .apply(&agent.url, &request(1, "leader-1", 1, files.clone()))
        .await
        .expect("applied");
    let response = traffic_client()
        .get(format!("http://127.0.0.1:{port}/"))
        .send()
        .await
        .expect("served on POD_IP");
    assert_eq!(
        response
            .headers()
            .get("x-colour")
            .and_then(|v| v.to_str().ok()),
        Some("blue")
    );

    // Any other variable of the agent's environment stays out of reach.
    let leaky = rewrite(&files, "haproxy.cfg", |cfg| {
        cfg.replace("${FLEET_COLOUR}", "${NODE_SECRET}")
    });
    match client
        .apply(&agent.url, &request(1, "leader-1", 2, leaky))
        .await
    {
        Err(Error::RefusedByPolicy { violations, .. }) => {
            assert!(
                violations[0].why.contains("\"NODE_SECRET\""),
                "{violations:?}"
            );
        }
        other => panic!("expected RefusedByPolicy, got {other:?}"),
    }
    agent.stop().await;
}

/// HAProxy masters running from `data` (their command line names its master socket; its
/// workers, forks with the same command line, have a master as parent), not counting zombies.
fn masters_of(data: &Path) -> Vec<u32> {
    let socket = data.join("master.sock").display().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rfind(')')
            .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
        let parent = stat.rfind(')').and_then(|i| {
            stat[i + 1..]
                .split_whitespace()
                .nth(1)
                .and_then(|ppid| ppid.parse::<u32>().ok())
        });
        if !zombie && args.iter().any(|a| a == "-W") && args.contains(&socket) {
            found.push((pid, parent.unwrap_or(0)));
        }
    }
    let pids: Vec<u32> = found.iter().map(|(pid, _)| *pid).collect();
    found
        .into_iter()
        .filter(|(_, parent)| !pids.contains(parent))
        .map(|(pid, _)| pid)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_with_sigkill_leaves_no_second_master_after_its_restart() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let client = client();
    let port = free_port();
    let set = request(1, "leader-1", 1, config(port, "a", &[("a", a.addr)]));

    let mut first = AgentProcess::start(&data);
    assert_eq!(await_ready(&first.url, 200).await, 200);
    client.apply(&first.url, &set).await.expect("apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let data = data.canonicalize().expect("data");
    let orphan = client
        .state(&first.url)
        .await
        .expect("state")
        .haproxy_pid
        .expect("a master");
    // SIGKILL to the agent alone: no destructor runs, its master keeps serving.
    Command::new("kill")
        .args(["-KILL", &first.child.id().to_string()])
        .status()
        .expect("kill -KILL");
    let _ = first.child.wait();
    assert_eq!(masters_of(&data), vec![orphan], "the orphan still runs");

    let second = AgentProcess::start(&data);
    assert_eq!(await_ready(&second.url, 200).await, 200);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let masters = masters_of(&data);
    assert_eq!(masters.len(), 1, "one master: {masters:?}");
    assert_ne!(masters[0], orphan, "the orphan was stopped");
    second.stop().await;
    drop(first);
}

/// `THP_enabled` of a process's `/proc/<pid>/status` (Linux 6.4 and later print it): whether
/// transparent huge pages may back its memory.
fn thp_enabled(pid: u32) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("THP_enabled:"))?;
    Some(line.split_whitespace().nth(1)? == "1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_pages_are_off_for_the_agent_and_as_the_host_has_them_for_haproxy() {
    let a = Backend::start("a").await;
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let port = free_port();
    let set = request(1, "leader-1", 1, config(port, "a", &[("a", a.addr)]));

    let agent = AgentProcess::start(&data);
    assert_eq!(await_ready(&agent.url, 200).await, 200);
    client().apply(&agent.url, &set).await.expect("apply");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let Some(ours) = thp_enabled(std::process::id()) else {
        eprintln!("this kernel does not say THP_enabled in /proc/<pid>/status: nothing to check");
        agent.stop().await;
        return;
    };
    let masters = masters_of(&data.canonicalize().expect("data"));
    assert_eq!(masters.len(), 1, "one master: {masters:?}");
    assert_eq!(
        thp_enabled(agent.child.id()),
        Some(false),
        "the agent's own"
    );
    assert_eq!(
        thp_enabled(masters[0]),
        Some(ours),
        "HAProxy's as this test process has it (the host's)"
    );
    agent.stop().await;
}
