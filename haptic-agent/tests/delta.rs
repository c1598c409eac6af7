//! Delta applies (`/v1/apply-delta`) against real agents with their own supervised HAProxy:
//! the same live set as a whole apply, `base_mismatch` when the agent does not hold the base
//! (nothing live, another set, a restart onto files that no longer verify), and every rule of
//! a whole apply (fence, generation, policy, `haproxy -c`, last-known-good).

mod common;

use std::path::Path;

use common::{
    Backend, Serving, TestAgent, await_body, config, free_port, get_once, listing, request, scrape,
    value,
};
use haptic_agent_client::{ApplyRequest, DeltaRequest, Error, FileSet, Outcome};

/// The delta that makes `target` of `base` (an applied request).
fn delta(base: &ApplyRequest, target: &ApplyRequest) -> DeltaRequest {
    DeltaRequest::between(&base.files, &base.checksum, target)
}

/// Every file of the live set (`<data>/current`) with its content, HAProxy's sockets left out.
fn live_files(data: &Path) -> Vec<(String, Vec<u8>)> {
    let current = data.join("current");
    let mut files: Vec<(String, Vec<u8>)> = listing(&current)
        .into_iter()
        .filter_map(|path| {
            let full = current.join(&path);
            full.metadata()
                .ok()
                .filter(std::fs::Metadata::is_file)
                .and_then(|_| std::fs::read(&full).ok())
                .map(|content| (path, content))
        })
        .collect();
    files.sort();
    files
}

/// `files` plus `path` with `content` (replaced when present).
fn with(files: &FileSet, path: &str, content: &str) -> FileSet {
    let mut out = files.clone();
    out.put(path, content.to_owned()).expect("valid path");
    out
}

/// `files` without `path`.
fn without(files: &FileSet, path: &str) -> FileSet {
    let mut out = files.clone();
    assert!(out.remove(path), "{path} in the set");
    out
}

#[tokio::test]
async fn a_delta_gives_the_same_live_set_and_files_as_a_whole_apply() {
    let serving = Serving::start(3).await;
    let b = Backend::start("b").await;
    let backends = [("a", serving.backend.addr), ("b", b.addr)];
    let port = serving.port;
    // The same first set on a second agent, which only ever gets whole sets.
    let other_dir = tempfile::tempdir().expect("tempdir");
    let other = TestAgent::start(other_dir.path()).await;
    let other_port = free_port();
    let rebased = |files: FileSet| {
        let text = String::from_utf8_lossy(files.get("haproxy.cfg").expect("cfg"))
            .replace(&format!(":{port}\n"), &format!(":{other_port}\n"));
        with(&files, "haproxy.cfg", &text)
    };
    let client = &serving.client;
    let first = serving.live.clone();
    client
        .apply(
            &other.url,
            &request(3, "leader-0", 1, rebased(first.files.clone())),
        )
        .await
        .expect("whole first set on the other agent");

    // 1. A new backend, a file added and one removed: the reload path.
    let second_files = with(
        &with(&config(port, "b", &backends), "maps/extra.map", "/x be_a\n"),
        "errors/unused.http",
        "HTTP/1.0 503\r\n\r\n",
    );
    let second = request(3, "leader-0", 2, second_files.clone());
    let sent = delta(&first, &second);
    assert!(sent.files.contains_key("haproxy.cfg") && sent.removed.is_empty());
    let report = client
        .apply_delta(&serving.agent.url, &sent)
        .await
        .expect("delta applied");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, true));
    assert_eq!(report.checksum, second.checksum);
    assert_eq!(await_body(port, "backend b").await, "backend b");

    // 2. Only a map entry changes (the runtime path) and a file goes.
    let third_files = without(
        &with(&second_files, "maps/routes.map", "/ be_a\n"),
        "errors/unused.http",
    );
    let third = request(3, "leader-0", 3, third_files.clone());
    let sent = delta(&second, &third);
    assert_eq!(sent.removed, ["errors/unused.http"]);
    assert_eq!(
        sent.changed().collect::<Vec<_>>(),
        ["maps/routes.map"],
        "only what changed travels"
    );
    let report = client
        .apply_delta(&serving.agent.url, &sent)
        .await
        .expect("second delta applied");
    assert_eq!(report.checksum, third.checksum);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    // 3. Only a map entry, no file added or removed: no reload.
    let fourth = request(
        3,
        "leader-0",
        4,
        with(&third_files, "maps/routes.map", "/ be_b\n"),
    );
    let report = client
        .apply_delta(&serving.agent.url, &delta(&third, &fourth))
        .await
        .expect("third delta applied");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, false));
    assert_eq!(await_body(port, "backend b").await, "backend b");

    // The same sets, whole, on the other agent.
    for (generation, files) in [(2, &second_files), (3, &third_files), (4, &fourth.files)] {
        client
            .apply(
                &other.url,
                &request(3, "leader-0", generation, rebased(files.clone())),
            )
            .await
            .expect("whole apply");
    }
    assert_eq!(await_body(other_port, "backend b").await, "backend b");

    // Same checksum as sent, and the very files the whole set has.
    let state = client.state(&serving.agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(fourth.checksum.as_str())
    );
    assert_eq!(state.generation, Some(4));
    assert_eq!(
        state.last_known_good_checksum.as_deref(),
        Some(third.checksum.as_str())
    );
    let other_state = client.state(&other.url).await.expect("state");
    assert_eq!(
        other_state.live_checksum,
        Some(request(3, "leader-0", 4, rebased(fourth.files.clone())).checksum)
    );
    let want: Vec<(String, Vec<u8>)> = fourth
        .files
        .iter()
        .map(|(path, content)| (path.to_owned(), content.to_vec()))
        .collect();
    assert_eq!(live_files(&serving.agent.data), want);
    let rebased_want: Vec<(String, Vec<u8>)> = rebased(fourth.files.clone())
        .iter()
        .map(|(path, content)| (path.to_owned(), content.to_vec()))
        .collect();
    assert_eq!(live_files(&other.data), rebased_want);

    assert_eq!(
        common::value(
            &common::scrape(&serving.agent.url).await,
            "haptic_agent_deltas_total",
            &[]
        ),
        3.0
    );
    // The same delta again: unchanged; the journal has every delta by its whole set.
    let report = client
        .apply_delta(&serving.agent.url, &delta(&third, &fourth))
        .await
        .expect("again");
    assert_eq!(report.outcome, Outcome::Unchanged);
    let journal = client
        .get_raw(&serving.agent.url, "/v1/journal")
        .await
        .expect("journal");
    let journal = String::from_utf8_lossy(&journal);
    for applied in [&second, &third, &fourth] {
        assert!(journal.contains(&applied.checksum), "{journal}");
    }
    other.stop().await;
    serving.agent.stop().await;
}

#[tokio::test]
async fn an_agent_without_the_base_answers_so_and_takes_the_whole_set() {
    let serving = Serving::start(2).await;
    let client = &serving.client;
    let first = serving.live.clone();
    let second = request(2, "leader-0", 2, serving.set_routing_to("none"));

    // Nothing live: base_mismatch, nothing written, then the whole set (on a port of its own).
    let fresh_dir = tempfile::tempdir().expect("tempdir");
    let fresh = TestAgent::start(fresh_dir.path()).await;
    let fresh_set = request(
        2,
        "leader-0",
        2,
        config(free_port(), "none", &[("a", serving.backend.addr)]),
    );
    let before = listing(fresh_dir.path());
    match client
        .apply_delta(&fresh.url, &delta(&first, &second))
        .await
    {
        Err(Error::BaseMismatch { live_checksum }) => assert_eq!(live_checksum, None),
        other => panic!("expected base_mismatch, got {other:?}"),
    }
    assert_eq!(listing(fresh_dir.path()), before, "nothing written");
    assert_eq!(fresh.applies("base_mismatch").await, 1);
    let journal = client
        .get_raw(&fresh.url, "/v1/journal")
        .await
        .expect("journal");
    assert!(
        !String::from_utf8_lossy(&journal).contains(&second.checksum),
        "a refused delta is not journaled"
    );
    let report = client
        .apply(&fresh.url, &fresh_set)
        .await
        .expect("whole set");
    assert_eq!(report.outcome, Outcome::Applied);
    fresh.stop().await;

    // Another set live: base_mismatch naming it, nothing written, the live set serves on.
    let third = request(2, "leader-0", 3, serving.set_routing_to("other"));
    let other_base = request(2, "leader-0", 3, serving.set_routing_to("elsewhere"));
    let before = listing(&serving.agent.data.join("sets"));
    match client
        .apply_delta(&serving.agent.url, &delta(&other_base, &third))
        .await
    {
        Err(Error::BaseMismatch { live_checksum }) => {
            assert_eq!(live_checksum.as_deref(), Some(first.checksum.as_str()));
        }
        other => panic!("expected base_mismatch, got {other:?}"),
    }
    assert_eq!(listing(&serving.agent.data.join("sets")), before);
    assert_eq!(get_once(serving.port).await, "backend a");

    // A restart: the live set is read from disk and verified, and is a base again.
    let data = serving.agent.data.clone();
    let Serving {
        agent,
        backend,
        port,
        dir: _dir,
        ..
    } = serving;
    agent.stop().await;
    let agent = TestAgent::start(&data).await;
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let report = client
        .apply_delta(&agent.url, &delta(&first, &second))
        .await
        .expect("delta after a restart");
    assert_eq!(report.checksum, second.checksum);
    assert_eq!(await_body(port, "no route").await, "no route");

    // A restart onto a live set whose files were changed on disk: they no longer hash to the
    // checksum the leader knows, so the delta is refused and the whole set repairs it.
    agent.stop().await;
    let map = std::fs::canonicalize(data.join("current"))
        .expect("current")
        .join("maps/routes.map");
    std::fs::write(&map, "/ be_tampered\n").expect("tamper");
    let agent = TestAgent::start(&data).await;
    let fourth = request(2, "leader-0", 4, serving_routes(port, &backend, "a"));
    match client
        .apply_delta(&agent.url, &delta(&second, &fourth))
        .await
    {
        Err(Error::BaseMismatch { live_checksum }) => {
            let live = live_checksum.expect("a live set");
            assert_ne!(live, second.checksum, "the checksum of what is on disk");
        }
        other => panic!("expected base_mismatch, got {other:?}"),
    }
    let report = client.apply(&agent.url, &fourth).await.expect("whole set");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(fourth.checksum.as_str())
    );
    agent.stop().await;
}

/// A new leader's claim (the set it wants, as a delta of no paths against itself, at its new
/// epoch) is answered from memory while every file on disk still has the stamp it was written
/// with; a file changed on disk sends the agent back to the disk, and the claim repairs it.
#[tokio::test]
async fn a_claim_is_answered_from_memory_unless_a_file_changed_on_disk() {
    let serving = Serving::start(3).await;
    let client = &serving.client;
    let url = &serving.agent.url;
    let data = &serving.agent.data;
    let reads = || async { value(&scrape(url).await, "haptic_agent_live_set_reads_total", &[]) };
    let live_map = || {
        std::fs::canonicalize(data.join("current"))
            .expect("current")
            .join("maps/routes.map")
    };
    // A claim of the set the reload path wrote.
    let first = serving.live.clone();
    let before = reads().await;
    let claim = request(3, "leader-0", 2, first.files.clone());
    let report = client
        .apply_delta(url, &delta(&claim, &claim))
        .await
        .expect("claim");
    assert_eq!(report.outcome, Outcome::Unchanged);
    assert_eq!(reads().await, before, "answered from memory");
    // The live set as the runtime path writes it (its unchanged files linked from the set
    // before, which the reload path wrote).
    let routes = "/ be_a\n/x be_none\n";
    let second = request(
        3,
        "leader-0",
        3,
        with(&first.files, "maps/routes.map", routes),
    );
    let report = client
        .apply_delta(url, &delta(&first, &second))
        .await
        .expect("runtime delta");
    assert_eq!((report.outcome, report.reload), (Outcome::Applied, false));
    let before = reads().await;

    // 1. Nothing changed on disk: `unchanged`, the fence raised, nothing read from disk.
    let claim = request(4, "leader-1", 3, second.files.clone());
    let report = client
        .apply_delta(url, &delta(&claim, &claim))
        .await
        .expect("claim");
    assert_eq!(report.outcome, Outcome::Unchanged);
    assert_eq!(client.state(url).await.expect("state").fence, Some(4));
    assert_eq!(reads().await, before, "answered from memory");

    // 2. A file edited on disk (its size and time move): the claim reads the set again,
    //    finds the edit, and applies the set it claims over it.
    std::fs::write(live_map(), "/ be_none\n").expect("edit");
    let claim = request(5, "leader-2", 4, second.files.clone());
    let report = client
        .apply_delta(url, &delta(&claim, &claim))
        .await
        .expect("claim over an edit");
    assert_eq!(report.outcome, Outcome::Applied, "{report:?}");
    assert_eq!(reads().await, before + 1.0, "read from disk once");
    assert_eq!(std::fs::read_to_string(live_map()).expect("map"), routes);
    assert_eq!(await_body(serving.port, "backend a").await, "backend a");

    // 3. An edit that keeps the size and puts the time back leaves the stamps as they were;
    //    the drift check (`/v1/state`, which hashes the files on disk) finds it, and the agent
    //    drops the set from memory: the leader's claim then learns what is on disk
    //    (`base_mismatch`), and the whole set repairs it.
    let map = live_map();
    let stamp = std::fs::metadata(&map)
        .and_then(|m| m.modified())
        .expect("mtime");
    std::fs::write(&map, "/ be_a\n/x be_zzzz\n").expect("edit");
    std::fs::File::options()
        .write(true)
        .open(&map)
        .and_then(|file| file.set_modified(stamp))
        .expect("put the time back");
    let state = client.state(url).await.expect("state");
    assert_ne!(
        state.live_checksum.as_deref(),
        Some(claim.checksum.as_str())
    );
    let claim = request(6, "leader-3", 5, second.files.clone());
    match client.apply_delta(url, &delta(&claim, &claim)).await {
        Err(Error::BaseMismatch { live_checksum }) => {
            assert_eq!(live_checksum, state.live_checksum, "what is on disk");
        }
        other => panic!("expected base_mismatch, got {other:?}"),
    }
    assert_eq!(reads().await, before + 2.0);
    let report = client.apply(url, &claim).await.expect("whole set");
    assert_eq!(report.outcome, Outcome::Applied, "{report:?}");
    assert_eq!(std::fs::read_to_string(live_map()).expect("map"), routes);
    let state = client.state(url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(claim.checksum.as_str())
    );
    serving.agent.stop().await;
}

fn serving_routes(port: u16, backend: &Backend, route_to: &str) -> FileSet {
    config(port, route_to, &[("a", backend.addr)])
}

#[tokio::test]
async fn a_stale_delta_is_refused_like_a_whole_apply_and_writes_nothing() {
    let serving = Serving::start(5).await;
    let client = &serving.client;
    let first = serving.live.clone();
    let data = &serving.agent.data;
    let sets_before = listing(&data.join("sets"));
    let fence_before = std::fs::read(data.join("fence")).expect("fence");

    // A lower epoch, with the right base.
    let stale = request(4, "leader-0", 9, serving.set_routing_to("none"));
    match client
        .apply_delta(&serving.agent.url, &delta(&first, &stale))
        .await
    {
        Err(Error::Fenced { fence, epoch }) => assert_eq!((fence, epoch), (5, 4)),
        other => panic!("expected fenced, got {other:?}"),
    }
    // The same epoch from another leader identity.
    let foreign = request(5, "leader-1", 9, serving.set_routing_to("none"));
    match client
        .apply_delta(&serving.agent.url, &delta(&first, &foreign))
        .await
    {
        Err(Error::Fenced { fence, epoch }) => assert_eq!((fence, epoch), (5, 5)),
        other => panic!("expected fenced, got {other:?}"),
    }
    // An older generation of the live epoch.
    let second = request(5, "leader-0", 3, serving.set_routing_to("a2"));
    client
        .apply_delta(&serving.agent.url, &delta(&first, &second))
        .await
        .expect("generation 3");
    let sets_now = listing(&data.join("sets"));
    let older = request(5, "leader-0", 2, serving.set_routing_to("none"));
    match client
        .apply_delta(&serving.agent.url, &delta(&second, &older))
        .await
    {
        Err(Error::Superseded {
            generation,
            live_generation,
        }) => assert_eq!((generation, live_generation), (2, 3)),
        other => panic!("expected superseded, got {other:?}"),
    }
    assert_eq!(listing(&data.join("sets")), sets_now);
    assert_ne!(sets_now, sets_before);
    assert_eq!(
        std::fs::read(data.join("fence")).expect("fence"),
        fence_before
    );
    let state = client.state(&serving.agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(second.checksum.as_str())
    );
    assert_eq!(serving.agent.applies("fenced").await, 2);
    assert_eq!(serving.agent.applies("superseded").await, 1);
    serving.agent.stop().await;
}

#[tokio::test]
async fn a_delta_that_fails_the_policy_or_the_check_leaves_the_last_known_good_set() {
    let serving = Serving::start(1).await;
    let client = &serving.client;
    let first = serving.live.clone();
    let data = &serving.agent.data;
    let sets_before = listing(&data.join("sets"));

    // Lua in haproxy.cfg: refused by the policy, before the fence or staging see it.
    let cfg = String::from_utf8_lossy(first.files.get("haproxy.cfg").expect("cfg"))
        .replace("global\n", "global\n  lua-load /tmp/evil.lua\n");
    let lua = request(2, "leader-0", 2, with(&first.files, "haproxy.cfg", &cfg));
    match client
        .apply_delta(&serving.agent.url, &delta(&first, &lua))
        .await
    {
        Err(Error::RefusedByPolicy { violations, .. }) => {
            assert!(
                violations[0]
                    .to_string()
                    .starts_with("haproxy.cfg:2: lua-load"),
                "{violations:?}"
            );
        }
        other => panic!("expected refused_by_policy, got {other:?}"),
    }
    let fence = client.state(&serving.agent.url).await.expect("state").fence;
    assert_eq!(fence, Some(1), "the fence is not raised by a refused delta");

    // A configuration HAProxy refuses: invalid, the live set untouched and serving.
    let cfg = String::from_utf8_lossy(first.files.get("haproxy.cfg").expect("cfg"))
        .replace("frontend fe\n", "frontend fe\n  no-such-keyword 1\n");
    let broken = request(2, "leader-0", 3, with(&first.files, "haproxy.cfg", &cfg));
    match client
        .apply_delta(&serving.agent.url, &delta(&first, &broken))
        .await
    {
        Err(Error::Invalid { check_output }) => {
            assert!(check_output.contains("no-such-keyword"), "{check_output}");
        }
        other => panic!("expected invalid, got {other:?}"),
    }
    assert_eq!(listing(&data.join("sets")), sets_before);
    assert_eq!(get_once(serving.port).await, "backend a");

    // A delta that does not make the set it claims: 400, nothing written.
    let second = request(2, "leader-0", 4, serving.set_routing_to("none"));
    let mut lying = delta(&first, &second);
    lying
        .files
        .insert("maps/routes.map".to_owned(), "/ be_other\n".into());
    match client.apply_delta(&serving.agent.url, &lying).await {
        Err(Error::Rejected { status, message }) => {
            assert_eq!(status, 400);
            assert!(message.contains("checksum"), "{message}");
        }
        other => panic!("expected 400, got {other:?}"),
    }
    assert_eq!(listing(&data.join("sets")), sets_before);

    // After all that, a good delta still builds on the live set.
    client
        .apply_delta(&serving.agent.url, &delta(&first, &second))
        .await
        .expect("a good delta");
    assert_eq!(await_body(serving.port, "no route").await, "no route");
    let state = client.state(&serving.agent.url).await.expect("state");
    assert_eq!(
        state.last_known_good_checksum.as_deref(),
        Some(first.checksum.as_str())
    );
    serving.agent.stop().await;
}

#[tokio::test]
async fn a_delta_that_fails_to_load_is_rolled_back_to_the_last_known_good_set() {
    let serving = Serving::start(1).await;
    let client = &serving.client;
    let first = serving.live.clone();
    // Passes `haproxy -c`, fails to load: a second bind on a port another socket holds.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_port = taken.local_addr().expect("addr").port();
    let cfg = String::from_utf8_lossy(first.files.get("haproxy.cfg").expect("cfg")).replace(
        "frontend fe\n",
        &format!("frontend fe\n  bind 127.0.0.1:{taken_port}\n"),
    );
    let unloadable = request(1, "leader-0", 2, with(&first.files, "haproxy.cfg", &cfg));
    match client
        .apply_delta(&serving.agent.url, &delta(&first, &unloadable))
        .await
    {
        Err(Error::RolledBack { live_checksum, .. }) => {
            assert_eq!(live_checksum.as_deref(), Some(first.checksum.as_str()));
        }
        other => panic!("expected rolled_back, got {other:?}"),
    }
    assert_eq!(await_body(serving.port, "backend a").await, "backend a");
    // The rolled-back-to set is the base again.
    let second = request(1, "leader-0", 3, serving.set_routing_to("none"));
    client
        .apply_delta(&serving.agent.url, &delta(&first, &second))
        .await
        .expect("a delta on last-known-good");
    assert_eq!(await_body(serving.port, "no route").await, "no route");
    drop(taken);
    serving.agent.stop().await;
}
