//! The config policy on the agent: a set that would run a program or read the host is refused
//! (422 `refused_by_policy`) before anything is written or `haproxy -c` runs; the operator's
//! allow-list enables what a deployment needs; the reference configuration passes.

mod common;

use std::{net::SocketAddr, path::Path};

use common::*;
use haptic_agent::AgentConfig;
use haptic_agent_client::{
    Error, FileSet, Outcome,
    policy::{Capability, Policy},
};

/// `files` with `line` added to its `global` section.
fn with_global(files: &FileSet, line: &str) -> FileSet {
    rewrite(files, "haproxy.cfg", |cfg| {
        cfg.replacen("global\n", &format!("global\n  {line}\n"), 1)
    })
}

/// `files` with `line` added to its frontend, right after the `bind`.
fn with_frontend(files: &FileSet, line: &str) -> FileSet {
    rewrite(files, "haproxy.cfg", |cfg| {
        let at = cfg.find("  use_backend").expect("frontend");
        format!("{}  {line}\n{}", &cfg[..at], &cfg[at..])
    })
}

fn policy_refusal(error: Error) -> Vec<String> {
    match error {
        Error::RefusedByPolicy { violations, .. } => {
            violations.iter().map(ToString::to_string).collect()
        }
        other => panic!("expected RefusedByPolicy, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_would_run_lua_during_the_check_is_refused_before_it_runs() {
    let serving = Serving::start(1).await;
    let marker = serving.dir.path().join("lua-ran");
    let mut evil = with_global(&serving.set_routing_to("a"), "lua-load evil.lua");
    evil.insert(
        "evil.lua",
        format!("os.execute(\"touch {}\")\n", marker.display()),
    )
    .expect("path");
    let before = listing(&serving.agent.data);

    let error = serving
        .client
        .apply(&serving.agent.url, &request(2, "leader-2", 1, evil))
        .await
        .expect_err("refused");
    let violations = policy_refusal(error);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].starts_with("haproxy.cfg:2: lua-load: Lua is not allowed"),
        "{violations:?}"
    );
    assert!(!marker.exists(), "the Lua file ran");
    assert_eq!(
        listing(&serving.agent.data),
        before,
        "something was written"
    );
    let state = serving
        .client
        .state(&serving.agent.url)
        .await
        .expect("state");
    assert_eq!(
        state.fence,
        Some(1),
        "a refused set does not raise the fence"
    );
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(serving.live.checksum.as_str())
    );
    assert_eq!(get_once(serving.port).await, "backend a");
    assert_eq!(serving.agent.applies("refused_by_policy").await, 1);
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_files_programs_external_checks_and_secrets_are_refused_with_file_and_line() {
    let serving = Serving::start(1).await;
    let token_file = serving.dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("token");
    let base = serving.set_routing_to("a");
    let cases: Vec<(FileSet, &str)> = vec![
        (
            with_frontend(
                &base,
                &format!(
                    "http-request return status 200 content-type text/plain file {}",
                    token_file.display()
                ),
            ),
            "http-request file: ",
        ),
        (
            with_frontend(&base, "http-request return status 200 file ../../token"),
            "http-request file: ",
        ),
        (
            with_frontend(&base, "use_backend %[path,map(/etc/passwd)]"),
            "map: ",
        ),
        (with_frontend(&base, "acl x src -f /etc/hosts"), "-f: "),
        (
            with_frontend(
                &base,
                "http-request return status 200 content-type text/plain string \"${HAPTIC_AGENT_TOKEN}\"",
            ),
            "http-request: environment variable \"HAPTIC_AGENT_TOKEN\"",
        ),
        (
            with_global(&base, "insecure-fork-wanted"),
            "insecure-fork-wanted: ",
        ),
        (with_global(&base, "setenv A b"), "setenv: "),
        (
            with_global(&base, "stats socket /tmp/admin.sock"),
            "stats socket: ",
        ),
        (with_global(&base, "log /dev/log local0"), "log: "),
        (with_global(&base, "pidfile /tmp/haproxy.pid"), "pidfile: "),
    ];
    let before = listing(&serving.agent.data);
    for (files, want) in cases {
        let error = serving
            .client
            .apply(&serving.agent.url, &request(1, "leader-0", 2, files))
            .await
            .expect_err("refused");
        let violations = policy_refusal(error);
        assert!(
            violations.len() == 1 && violations[0].contains(want),
            "{want}: {violations:?}"
        );
        assert!(violations[0].starts_with("haproxy.cfg:"), "{violations:?}");
    }
    // A program section forks a shell whose child would outlive the agent.
    let program = rewrite(&base, "haproxy.cfg", |cfg| {
        format!("{cfg}program evil\n  command sh -c 'sleep 1000'\n")
    });
    let violations = policy_refusal(
        serving
            .client
            .apply(&serving.agent.url, &request(1, "leader-0", 3, program))
            .await
            .expect_err("refused"),
    );
    assert!(
        violations.len() == 1 && violations[0].contains(": program: "),
        "{violations:?}"
    );
    assert_eq!(
        listing(&serving.agent.data),
        before,
        "something was written"
    );
    assert_eq!(get_once(serving.port).await, "backend a");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_allow_list_enables_lua_from_the_set_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua));
    let agent = TestAgent::start_with(config).await;
    let client = client();
    let port = free_port();
    let cfg = format!(
        "global\n  nbthread 1\n  lua-load lua/hello.lua\n\
         defaults\n  mode http\n  timeout connect 2s\n  timeout client 10s\n  timeout server 10s\n\
         frontend fe\n  bind 127.0.0.1:{port}\n  http-request use-service lua.hello\n"
    );
    let lua = "core.register_service(\"hello\", \"http\", function(applet)\n\
               local body = \"hello from lua\"\n\
               applet:set_status(200)\n\
               applet:add_header(\"content-length\", string.len(body))\n\
               applet:start_response()\n\
               applet:send(body)\nend)\n";
    let files = FileSet::new()
        .with("haproxy.cfg", cfg.clone())
        .and_then(|set| set.with("lua/hello.lua", lua))
        .expect("set");
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 1, files))
        .await
        .expect("Lua from the set is allowed");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "hello from lua").await, "hello from lua");

    // Allowing Lua does not allow a Lua file outside the set.
    let outside = FileSet::new()
        .with(
            "haproxy.cfg",
            cfg.replace("lua/hello.lua", "/usr/share/haproxy/x.lua"),
        )
        .expect("set");
    let violations = policy_refusal(
        client
            .apply(&agent.url, &request(1, "leader-0", 2, outside))
            .await
            .expect_err("refused"),
    );
    assert!(
        violations[0].starts_with("haproxy.cfg:3: lua-load: \"/usr/share/haproxy/x.lua\""),
        "{violations:?}"
    );
    agent.stop().await;
}

/// The reference set, rendered by `haptic-render` from its generated fixtures (HTTP and
/// HTTPS, maps, a crt-list and certificates), as the agent would receive it.
fn reference_set(ingresses: usize) -> FileSet {
    let mut stores = haptic_render::reference::stores().expect("reference stores");
    haptic_render::fixtures::generate(ingresses)
        .load(&mut stores)
        .expect("fixtures");
    let rendered = haptic_render::Renderer::compile(&haptic_render::reference::template_set())
        .expect("compiles")
        .render(&stores)
        .expect("renders");
    let mut files = FileSet::new();
    for (path, content) in rendered.iter() {
        files.insert(path, content.to_vec()).expect("valid path");
    }
    files
}

#[test]
fn the_reference_configuration_passes_the_default_policy() {
    let files = reference_set(20);
    let cfg = String::from_utf8_lossy(files.get("haproxy.cfg").expect("cfg")).into_owned();
    for expected in [
        "default-path config",
        "crt-list maps/certs.list",
        "log stdout",
    ] {
        assert!(cfg.contains(expected), "the reference uses {expected}");
    }
    let certs = files.get("maps/certs.list").expect("a crt-list");
    assert!(
        String::from_utf8_lossy(certs).contains("ssl/"),
        "the crt-list names certificates"
    );
    assert_eq!(
        Policy::default()
            .violations(&files)
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        Vec::<String>::new()
    );
    // A crt-list line pointing outside the set is caught in the list itself.
    let escaped = rewrite(&files, "maps/certs.list", |list| {
        format!("{list}\n/etc/ssl/private/node.pem evil.example\n")
    });
    let found = Policy::default().violations(&escaped);
    assert!(
        found.len() == 1 && found[0].file == "maps/certs.list",
        "{found:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_haproxy_writes_at_run_time_never_changes_the_live_set_and_files_are_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let serving = Serving::start(1).await;
    // HAProxy makes a unix socket and a pidfile inside the live set's directory.
    let files = with_global(
        &serving.set_routing_to("a"),
        "stats socket unix@admin.sock mode 600 level admin\n  pidfile haproxy.pid",
    );
    let next = request(1, "leader-0", 2, files);
    let report = serving
        .client
        .apply(&serving.agent.url, &next)
        .await
        .expect("applied");
    assert_eq!(report.outcome, Outcome::Applied);
    let current = serving.agent.data.join("current");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !(current.join("admin.sock").exists() && current.join("haproxy.pid").exists()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "HAProxy wrote its socket and pidfile: {:?}",
            listing(&current)
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let state = serving
        .client
        .state(&serving.agent.url)
        .await
        .expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(next.checksum.as_str()));
    let again = serving
        .client
        .apply(&serving.agent.url, &next)
        .await
        .expect("unchanged");
    assert_eq!(again.outcome, Outcome::Unchanged);

    // A set's files (private keys among them) are the agent's alone.
    let mode = |path: &Path| {
        std::fs::metadata(path)
            .expect("metadata")
            .permissions()
            .mode()
            & 0o777
    };
    let set_dir = std::fs::canonicalize(&current).expect("current");
    assert_eq!(mode(&set_dir), 0o700);
    assert_eq!(mode(&set_dir.join("maps")), 0o700);
    assert_eq!(mode(&set_dir.join("maps/routes.map")), 0o600);
    assert_eq!(mode(&set_dir.join("haproxy.cfg")), 0o600);
    assert_eq!(mode(&serving.agent.data.join("sets")), 0o700);
    assert_eq!(mode(&serving.agent.data.join("staging")), 0o700);
    serving.agent.stop().await;
}

/// The `Uid:` line of `/proc/<pid>/status`: real, effective, saved and filesystem uid.
fn uids(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .expect("Uid line")
        .split_whitespace()
        .map(|uid| uid.parse().expect("uid"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_and_its_check_run_as_the_unprivileged_user() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the agent cannot run HAProxy as another user; nothing to test");
        return;
    }
    let nobody = haptic_agent::haproxy::RunAs::resolve("nobody").expect("a nobody user");
    let backend = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    // Lua (allowed here) records who runs it: `haproxy -c`, then the master.
    let marks = tempfile::tempdir().expect("marks");
    std::fs::set_permissions(marks.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let marker = marks.path().join("uids");
    let config = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua))
        .with_haproxy_user(nobody);
    assert_eq!(config.master_socket, dir.path().join("run/master.sock"));
    let agent = TestAgent::start_with(config).await;
    let client = client();
    let port = free_port();
    let mut files = with_global(&config_routing(port, &backend), "lua-load who.lua");
    files
        .insert(
            "who.lua",
            format!("os.execute(\"id -u >> {}\")\n", marker.display()),
        )
        .expect("path");
    let report = client
        .apply(&agent.url, &request(1, "leader-0", 1, files))
        .await
        .expect("applied");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "backend a").await, "backend a");

    let seen = std::fs::read_to_string(&marker).expect("the Lua file ran");
    let seen: Vec<&str> = seen.lines().collect();
    assert!(seen.len() >= 2, "the check and the master: {seen:?}");
    assert!(seen.iter().all(|uid| *uid == "65534"), "{seen:?}");
    let state = client.state(&agent.url).await.expect("state");
    let master = state.haproxy_pid.expect("a master");
    assert!(uids(master).iter().all(|uid| *uid == nobody.uid));
    for worker in &state.worker_pids {
        assert!(uids(*worker).iter().all(|uid| *uid == nobody.uid));
    }
    // HAProxy's group can read the set and not change it.
    let set_dir = std::fs::canonicalize(dir.path().join("current")).expect("current");
    for (path, mode) in [
        (set_dir.clone(), 0o750),
        (set_dir.join("haproxy.cfg"), 0o640),
    ] {
        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(meta.permissions().mode() & 0o777, mode, "{path:?}");
        assert_eq!(meta.gid(), nobody.gid, "{path:?}");
        assert_eq!(meta.uid(), 0, "{path:?}");
    }
    agent.stop().await;
}

fn config_routing(port: u16, backend: &Backend) -> FileSet {
    config(port, "a", &[("a", backend.addr)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_set_that_breaks_the_policy_is_not_started_after_a_restart() {
    let backend = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let lua = AgentConfig::new(dir.path(), TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
        .with_policy(Policy::default().with_capability(Capability::Lua));
    let agent = TestAgent::start_with(lua.clone()).await;
    let client = client();
    let port = free_port();
    let plain = request(1, "leader-0", 1, config_routing(port, &backend));
    client.apply(&agent.url, &plain).await.expect("plain");
    let mut with_lua = with_global(
        &rewrite(&config_routing(port, &backend), "maps/routes.map", |_| {
            "/ be_none\n".to_owned()
        }),
        "lua-load empty.lua",
    );
    with_lua.insert("empty.lua", "-- nothing\n").expect("path");
    client
        .apply(&agent.url, &request(1, "leader-0", 2, with_lua))
        .await
        .expect("Lua allowed here");
    assert_eq!(await_body(port, "no route").await, "no route");
    agent.stop().await;

    // The same data directory under the strict default: the Lua set is not started, the
    // last-known-good one is.
    let strict = lua.with_policy(Policy::default());
    let agent = TestAgent::start_with(strict).await;
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(plain.checksum.as_str())
    );
    agent.stop().await;
}
