//! The apply protocol against the real HAProxy: traffic through it, validation, fencing,
//! no-op applies, rollback, authentication and path rules.

mod common;

use std::time::Duration;

use common::*;
use haptic_agent_client::{Error, Outcome, protocol::APPLY_PATH};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_set_serves_traffic_and_a_second_set_reroutes_it() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr)];

    let first = request(1, "leader-0", 1, config(port, "a", &backends));
    let report = client.apply(&agent.url, &first).await.expect("first apply");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(report.checksum, first.checksum);
    assert_eq!(await_body(port, "backend a").await, "backend a");

    // The second set carries a large map: its body goes gzipped.
    let mut files = config(port, "b", &backends);
    let big: String = (0..20_000)
        .map(|i| format!("host-{i}.example.com be_b\n"))
        .collect();
    files.insert("maps/unused.map", big).expect("big map");
    let second = request(1, "leader-0", 2, files);
    let prepared = client.prepare(&second);
    assert!(prepared.json_len() > client.config().compress_threshold);
    assert!(
        prepared.wire_len() < prepared.json_len() / 4,
        "sent gzipped"
    );
    let report = client
        .apply_prepared(&agent.url, &prepared)
        .await
        .expect("second apply");
    assert_eq!(report.outcome, Outcome::Applied);
    // The server's new address goes through the runtime API; the map no line of the
    // configuration uses is HAProxy's to read nowhere, and is only written with the set.
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert_eq!(await_body(port, "backend b").await, "backend b");

    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(second.checksum.as_str())
    );
    assert_eq!(state.generation, Some(2));
    assert_eq!(state.leader.as_deref(), Some("leader-0"));
    assert_eq!(
        state.last_known_good_checksum.as_deref(),
        Some(first.checksum.as_str())
    );
    assert_eq!(state.fence, Some(1));
    assert!(state.haproxy_pid.is_some() && !state.worker_pids.is_empty());
    assert!(
        state
            .haproxy_version
            .unwrap_or_default()
            .contains("HAProxy")
    );
    assert!(state.last_reload.expect("a reload").ok);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_set_returns_haproxys_message_and_the_live_set_keeps_serving() {
    let serving = Serving::start(1).await;
    let Serving {
        dir,
        agent,
        client,
        port,
        live: good,
        ..
    } = &serving;
    let port = *port;
    let before = listing(&dir.path().join("sets"));

    let broken = rewrite(&good.files, "haproxy.cfg", |cfg| {
        format!("{cfg}  frobnicate-the-widget yes\n")
    });
    let bad = request(1, "leader-0", 2, broken);
    match client.apply(&agent.url, &bad).await {
        Err(Error::Invalid { check_output }) => {
            assert!(
                check_output.contains("frobnicate-the-widget"),
                "HAProxy's own message names the keyword: {check_output}"
            );
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(good.checksum.as_str()));
    assert_eq!(listing(&dir.path().join("sets")), before, "sets untouched");
    assert!(
        listing(&dir.path().join("staging")).is_empty(),
        "staging cleaned"
    );
    assert_eq!(get_once(port).await, "backend a");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_epoch_is_refused_with_the_fence_and_nothing_is_written() {
    let serving = Serving::start(5).await;
    let Serving {
        dir,
        agent,
        client,
        port,
        ..
    } = &serving;
    let before = listing(dir.path());
    let fence_before = std::fs::read(dir.path().join("fence")).expect("fence file");

    let stale = request(4, "leader-old", 9, serving.set_routing_to("none"));
    match client.apply(&agent.url, &stale).await {
        Err(Error::Fenced { fence, epoch }) => assert_eq!((fence, epoch), (5, 4)),
        other => panic!("expected Fenced, got {other:?}"),
    }
    assert_eq!(listing(dir.path()), before, "nothing written");
    assert_eq!(
        std::fs::read(dir.path().join("fence")).expect("fence file"),
        fence_before
    );
    assert_eq!(get_once(*port).await, "backend a");
    assert_eq!(agent.applies("fenced").await, 1);
    assert_eq!(agent.applies("applied").await, 1);
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leaders_applying_concurrently_only_the_higher_epoch_is_ever_live() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr)];
    // Distinct sets per leader and generation: the map line differs.
    let set = |leader: &str, generation: u64| {
        rewrite(&config(port, leader, &backends), "maps/routes.map", |_| {
            format!("/ be_{leader}\n/gen{generation} be_{leader}\n")
        })
    };
    let old: Vec<_> = (1..=4).map(|g| request(1, "old", g, set("a", g))).collect();
    let new: Vec<_> = (1..=4).map(|g| request(2, "new", g, set("b", g))).collect();
    let old_sums: Vec<String> = old.iter().map(|r| r.checksum.clone()).collect();
    let new_sums: Vec<String> = new.iter().map(|r| r.checksum.clone()).collect();

    let done = tokio_util::sync::CancellationToken::new();
    let observer = tokio::spawn({
        let (client, url, done) = (client.clone(), agent.url.clone(), done.clone());
        async move {
            let mut seen = Vec::new();
            while !done.is_cancelled() {
                if let Ok(state) = client.state(&url).await
                    && let Some(sum) = state.live_checksum
                    && seen.last() != Some(&sum)
                {
                    seen.push(sum);
                }
            }
            seen
        }
    });
    let run = |requests: Vec<haptic_agent_client::ApplyRequest>| {
        let (client, url) = (client.clone(), agent.url.clone());
        tokio::spawn(async move {
            let mut results = Vec::new();
            for request in requests {
                results.push(client.apply(&url, &request).await);
            }
            results
        })
    };
    let (old_results, new_results) = tokio::join!(run(old.clone()), run(new.clone()));
    let (old_results, new_results) = (old_results.expect("old"), new_results.expect("new"));
    // One more from the old leader, certainly after the new one's applies.
    let late = client.apply(&agent.url, &old[0]).await;
    done.cancel();
    let seen = observer.await.expect("observer");

    for result in &new_results {
        assert!(
            result.is_ok(),
            "the higher epoch is never refused: {result:?}"
        );
    }
    assert!(matches!(late, Err(Error::Fenced { fence: 2, epoch: 1 })));
    for result in &old_results {
        assert!(
            matches!(result, Ok(_) | Err(Error::Fenced { fence: 2, epoch: 1 })),
            "{result:?}"
        );
    }
    // Once a set of the higher epoch was live, no set of the lower one ever was again.
    if let Some(first_new) = seen.iter().position(|sum| new_sums.contains(sum)) {
        for sum in &seen[first_new..] {
            assert!(
                !old_sums.contains(sum),
                "a stale set went live after the new leader's"
            );
        }
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_ref(), new_sums.last());
    assert_eq!(state.fence, Some(2));
    assert_eq!(await_body(port, "backend b").await, "backend b");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_checksum_is_unchanged_and_does_not_reload() {
    let serving = Serving::start(3).await;
    let Serving {
        agent,
        client,
        live: set,
        ..
    } = &serving;
    let before = client.state(&agent.url).await.expect("state");

    let again = request(3, "leader-0", 2, set.files.clone());
    let report = client.apply(&agent.url, &again).await.expect("again");
    assert_eq!(report.outcome, Outcome::Unchanged);
    let after = client.state(&agent.url).await.expect("state");
    assert_eq!(
        after.worker_pids, before.worker_pids,
        "same worker: no reload"
    );
    assert_eq!(after.last_reload, before.last_reload);
    assert_eq!(
        after.generation,
        Some(2),
        "no set written, no reload; the generation high-water mark is raised"
    );

    let http = traffic_client();
    let metrics = scrape(&agent.url).await;
    let applies = |outcome| {
        value(
            &metrics,
            "haptic_agent_applies_total",
            &[("outcome", outcome)],
        )
    };
    assert_eq!((applies("unchanged"), applies("applied")), (1.0, 1.0));
    assert_eq!(value(&metrics, "haptic_agent_fence", &[]), 3.0);
    let reloads = metrics
        .samples
        .iter()
        .find(|s| s.metric == "haptic_agent_reload_duration_seconds")
        .map(|s| s.value.clone());
    match reloads {
        // The +Inf bucket is the count.
        Some(prometheus_parse::Value::Histogram(buckets)) => assert_eq!(
            buckets.iter().map(|b| b.count).fold(0.0, f64::max),
            1.0,
            "{buckets:?}"
        ),
        other => panic!("haptic_agent_reload_duration_seconds is no histogram: {other:?}"),
    }
    let health = http
        .get(agent.url.join("/healthz").expect("url"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_that_fails_to_load_is_rolled_back_to_last_known_good() {
    let serving = Serving::start(1).await;
    let Serving {
        agent,
        client,
        port,
        live: good,
        ..
    } = &serving;
    let port = *port;

    // `haproxy -c` does not bind, so a second bind on a taken port passes the check and
    // fails only when HAProxy loads the set.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let taken_port = taken.local_addr().expect("addr").port();
    let bad = request(
        1,
        "leader-0",
        2,
        rewrite(&good.files, "haproxy.cfg", |cfg| {
            cfg.replace(
                &format!("bind 127.0.0.1:{port}\n"),
                &format!("bind 127.0.0.1:{port}\n  bind 127.0.0.1:{taken_port}\n"),
            )
        }),
    );
    match client.apply(&agent.url, &bad).await {
        Err(Error::RolledBack {
            live_checksum,
            reason,
        }) => {
            assert_eq!(live_checksum.as_deref(), Some(good.checksum.as_str()));
            assert!(reason.contains("bind"), "HAProxy's reason: {reason}");
        }
        other => panic!("expected RolledBack, got {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(good.checksum.as_str()));
    let last = state.last_reload.expect("last reload");
    assert!(last.ok && last.checksum == good.checksum, "{last:?}");
    assert_eq!(get_once(port).await, "backend a");
    assert_eq!(agent.applies("rolled_back").await, 1);

    // And the agent still applies: the next good set goes live.
    let next = request(1, "leader-0", 3, serving.set_routing_to("none"));
    client.apply(&agent.url, &next).await.expect("next");
    assert_eq!(await_body(port, "no route").await, "no route");
    drop(taken);
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_are_400_and_tokens_are_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let http = traffic_client();
    let url = agent.url.join(APPLY_PATH).expect("url");
    let before = listing(dir.path());
    for path in ["../escape.cfg", "/etc/haptic-evil", "maps/../../x", "a//b"] {
        let body = serde_json::json!({
            "epoch": 99, "leader": "l", "generation": 1,
            "checksum": haptic_agent_client::protocol::checksum([
                (path, b"x".as_slice()), ("haproxy.cfg", b"global\n".as_slice()),
            ]),
            "files": [
                {"path": "haproxy.cfg", "text": "global\n"},
                {"path": path, "text": "x"},
            ],
        });
        let response = http
            .post(url.clone())
            .bearer_auth(TOKEN)
            .json_body(&body)
            .send()
            .await
            .expect("post");
        assert_eq!(response.status(), 400, "{path}");
        let text = response.text().await.expect("body");
        assert!(text.contains("refused"), "{text}");
    }
    assert_eq!(
        listing(dir.path()),
        before,
        "nothing written, fence not raised"
    );
    assert!(
        !dir.path()
            .parent()
            .expect("parent")
            .join("escape.cfg")
            .exists()
    );

    let state_url = agent.url.join("/v1/state").expect("url");
    let status = |response: reqwest::Response| response.status().as_u16();
    assert_eq!(
        status(http.get(state_url.clone()).send().await.expect("get")),
        401
    );
    assert_eq!(
        status(
            http.get(state_url.clone())
                .bearer_auth("wrong-token")
                .send()
                .await
                .expect("get")
        ),
        401
    );
    assert_eq!(
        status(
            http.post(url.clone())
                .body("{}")
                .send()
                .await
                .expect("post")
        ),
        401,
        "no body is read without a token"
    );
    assert_eq!(
        status(
            http.get(state_url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("get")
        ),
        200
    );
    assert!(matches!(
        haptic_agent_client::AgentClient::new(haptic_agent_client::ClientConfig::new("nope"))
            .expect("client")
            .state(&agent.url)
            .await,
        Err(Error::Unauthorized)
    ));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_is_413() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = haptic_agent::AgentConfig::new(dir.path(), TOKEN)
        .with_listen(([127, 0, 0, 1], 0).into())
        .with_haproxy_bin(haproxy_bin());
    config.max_body_bytes = 1024;
    config.max_inflated_bytes = 1024;
    let agent = TestAgent::start_with(config).await;
    let set = haptic_agent_client::FileSet::new()
        .with("haproxy.cfg", "x".repeat(4096))
        .expect("set");
    let client = haptic_agent_client::AgentClient::new(
        haptic_agent_client::ClientConfig::new(TOKEN).with_retries(1, Duration::ZERO),
    )
    .expect("client");
    match client.apply(&agent.url, &request(1, "l", 1, set)).await {
        Err(Error::Rejected { status: 413, .. }) => {}
        other => panic!("expected 413, got {other:?}"),
    }
    agent.stop().await;
}

/// `reqwest` is built without its `json` feature here; this adds the one call the tests use.
trait JsonBody {
    fn json_body(self, value: &serde_json::Value) -> Self;
}

impl JsonBody for reqwest::RequestBuilder {
    fn json_body(self, value: &serde_json::Value) -> Self {
        self.header("content-type", "application/json")
            .body(serde_json::to_vec(value).expect("json"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_set_that_fails_to_load_leaves_nothing_live_and_the_next_one_works() {
    let a = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let taken_port = taken.local_addr().expect("addr").port();
    let first = request(1, "leader-0", 1, config(taken_port, "a", &[("a", a.addr)]));
    match client.apply(&agent.url, &first).await {
        Err(Error::RolledBack {
            live_checksum: None,
            reason,
        }) => assert!(reason.contains("bind"), "HAProxy's reason: {reason}"),
        other => panic!("expected RolledBack with nothing live, got {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum, None);
    assert_eq!(state.haproxy_pid, None, "no HAProxy left running");
    assert!(listing(&dir.path().join("sets")).is_empty());

    let port = free_port();
    let next = request(1, "leader-0", 2, config(port, "a", &[("a", a.addr)]));
    client.apply(&agent.url, &next).await.expect("next");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    drop(taken);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_equal_epoch_from_another_leader_is_fenced_and_nothing_is_written() {
    let serving = Serving::start(3).await;
    let Serving {
        dir,
        agent,
        client,
        port,
        ..
    } = &serving;
    let port = *port;
    let before = listing(dir.path());
    let fence_path = dir.path().join("fence");
    let fence_before = std::fs::read(&fence_path).expect("fence file");

    let rival = request(3, "leader-rival", 2, serving.set_routing_to("none"));
    match client.apply(&agent.url, &rival).await {
        Err(Error::Fenced { fence, epoch }) => assert_eq!((fence, epoch), (3, 3)),
        other => panic!("expected Fenced, got {other:?}"),
    }
    assert_eq!(listing(dir.path()), before, "nothing written");
    assert_eq!(std::fs::read(&fence_path).expect("fence"), fence_before);
    assert_eq!(get_once(port).await, "backend a");

    // The holder goes on at its epoch.
    let next = request(3, "leader-0", 2, serving.set_routing_to("none"));
    let report = client.apply(&agent.url, &next).await.expect("holder");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "no route").await, "no route");

    // A fence file as older agents wrote it (the number alone) still loads; the first
    // identity that applies at that epoch holds it from then on.
    std::fs::write(&fence_path, "3\n").expect("old fence format");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.fence, Some(3));
    let report = client
        .apply(
            &agent.url,
            &request(3, "leader-0", 3, serving.set_routing_to("a")),
        )
        .await
        .expect("claims the old fence");
    assert_eq!(report.outcome, Outcome::Applied);
    assert!(matches!(
        client.apply(&agent.url, &rival).await,
        Err(Error::Fenced { fence: 3, epoch: 3 })
    ));
    assert_eq!(await_body(port, "backend a").await, "backend a");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_component_over_255_bytes_is_400_and_nothing_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let http = traffic_client();
    let url = agent.url.join(APPLY_PATH).expect("url");
    let before = listing(dir.path());
    let path = format!("maps/{}", "a".repeat(256));
    let body = serde_json::json!({
        "epoch": 1, "leader": "l", "generation": 1,
        "checksum": haptic_agent_client::protocol::checksum([
            ("haproxy.cfg", b"global\n".as_slice()), (path.as_str(), b"x".as_slice()),
        ]),
        "files": [
            {"path": "haproxy.cfg", "text": "global\n"},
            {"path": path, "text": "x"},
        ],
    });
    let response = http
        .post(url)
        .bearer_auth(TOKEN)
        .json_body(&body)
        .send()
        .await
        .expect("post");
    assert_eq!(response.status(), 400);
    let text = response.text().await.expect("body");
    assert!(text.contains("255"), "{text}");
    assert_eq!(listing(dir.path()), before, "nothing written");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_generation_of_the_live_epoch_is_superseded_and_nothing_is_written() {
    let serving = Serving::start(2).await;
    let Serving {
        dir,
        agent,
        client,
        port,
        ..
    } = &serving;
    let port = *port;
    let newer = request(2, "leader-0", 3, serving.set_routing_to("none"));
    client
        .apply(&agent.url, &newer)
        .await
        .expect("generation 3");
    assert_eq!(await_body(port, "no route").await, "no route");
    let before = listing(dir.path());

    // Generation 2 arrives late (a delayed request, a retry): it must not overwrite 3.
    let older = request(2, "leader-0", 2, serving.set_routing_to("a"));
    match client.apply(&agent.url, &older).await {
        Err(Error::Superseded {
            generation,
            live_generation,
        }) => assert_eq!((generation, live_generation), (2, 3)),
        other => panic!("expected Superseded, got {other:?}"),
    }
    assert_eq!(listing(dir.path()), before, "nothing written");
    assert_eq!(get_once(port).await, "no route");
    assert_eq!(agent.applies("superseded").await, 1);
    // A higher epoch starts its generations afresh.
    let next_term = request(3, "leader-1", 1, serving.set_routing_to("a"));
    client
        .apply(&agent.url, &next_term)
        .await
        .expect("next term");
    assert_eq!(await_body(port, "backend a").await, "backend a");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_readiness_probes_is_answered_from_the_cache() {
    let serving = Serving::start(1).await;
    let haproxy = serving.agent.agent.haproxy().clone();
    let http = traffic_client();
    let url = serving.agent.url.join("/readyz").expect("url");
    let before = haproxy.cli_connections();
    let started = tokio::time::Instant::now();
    // 64 at a time: more would meet the agent's connection cap (256), tested elsewhere.
    let probes: Vec<_> = futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
        futures::stream::iter((0..400).map(|_| {
            let (http, url) = (http.clone(), url.clone());
            async move { http.get(url).send().await.map(|r| r.status().as_u16()) }
        })),
        64,
    ))
    .await;
    let took = started.elapsed();
    assert!(
        probes.iter().all(|status| matches!(status, Ok(200))),
        "{probes:?}"
    );
    let made = haproxy.cli_connections() - before;
    // One probe per READY_TTL (1 s) at most, plus the one in flight when the run started.
    let bound = took.as_secs() + 2;
    assert!(
        made <= bound,
        "{made} master CLI connections for 400 probes in {took:?}"
    );
    let metrics = scrape(&serving.agent.url).await;
    assert!(
        value(&metrics, "haptic_agent_master_cli_connections_total", &[]) >= made as f64,
        "the counter follows the connections made"
    );
    // An apply still goes through while probes and state requests (the master CLI's other
    // slot) keep coming.
    let flood = tokio::spawn(async move {
        for _ in 0..200 {
            let _ = http.get(url.clone()).send().await;
        }
    });
    let states = tokio::spawn({
        let (client, url) = (serving.client.clone(), serving.agent.url.clone());
        async move {
            for _ in 0..50 {
                let _ = client.state(&url).await;
            }
        }
    });
    let next = request(1, "leader-0", 2, serving.set_routing_to("none"));
    let report = serving
        .client
        .apply(&serving.agent.url, &next)
        .await
        .expect("applied during the flood");
    assert_eq!(report.outcome, haptic_agent_client::Outcome::Applied);
    flood.abort();
    states.abort();
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_raises_the_generation_so_a_delayed_older_one_is_superseded() {
    let serving = Serving::start(1).await;
    let (url, client) = (&serving.agent.url, &serving.client);
    let a = serving.set_routing_to("none");
    let applied = client
        .apply(url, &request(1, "leader-0", 10, a.clone()))
        .await
        .expect("gen 10");
    assert_eq!(applied.outcome, Outcome::Applied);
    let unchanged = client
        .apply(url, &request(1, "leader-0", 12, a))
        .await
        .expect("gen 12");
    assert_eq!(unchanged.outcome, Outcome::Unchanged);
    // Gen 11, delayed, carries another set: it must not overwrite what gen 12 confirmed.
    let delayed = request(1, "leader-0", 11, serving.set_routing_to("a"));
    match client.apply(url, &delayed).await {
        Err(Error::Superseded {
            generation: 11,
            live_generation: 12,
        }) => {}
        other => panic!("expected Superseded, got {other:?}"),
    }
    let state = client.state(url).await.expect("state");
    assert_eq!(state.generation, Some(12));
    assert_eq!(get_once(serving.port).await, "no route");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_apply_raises_the_fence_by_at_most_two_to_the_32() {
    use haptic_agent_client::protocol::MAX_FENCE_STEP;
    let backend = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let client = client();
    let port = free_port();
    let files = config(port, "a", &[("a", backend.addr)]);

    // A fresh agent (fence 0) takes any epoch up to the bound, and nothing above it.
    let too_far = request(MAX_FENCE_STEP + 1, "leader-0", 1, files.clone());
    match client.apply(&agent.url, &too_far).await {
        Err(Error::Rejected {
            status: 400,
            message,
        }) => {
            assert!(
                message.contains("2^32 above the agent's fence 0"),
                "{message}"
            );
        }
        other => panic!("expected a 400, got {other:?}"),
    }
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.fence, Some(0), "the fence did not move");
    assert_eq!(state.live_checksum, None, "nothing went live");

    let at_bound = request(MAX_FENCE_STEP, "leader-0", 1, files.clone());
    client
        .apply(&agent.url, &at_bound)
        .await
        .expect("at the bound");
    let beyond = request(2 * MAX_FENCE_STEP + 1, "leader-1", 1, files.clone());
    assert!(matches!(
        client.apply(&agent.url, &beyond).await,
        Err(Error::Rejected { status: 400, .. })
    ));
    let next = request(2 * MAX_FENCE_STEP, "leader-1", 1, files);
    client
        .apply(&agent.url, &next)
        .await
        .expect("within the bound");
    assert_eq!(
        client.state(&agent.url).await.expect("state").fence,
        Some(2 * MAX_FENCE_STEP)
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_identity_that_is_not_a_pod_name_is_400() {
    let serving = Serving::start(1).await;
    let mut wire = serving.live.to_wire();
    wire.leader = format!("leader-0\n{}", "x".repeat(300));
    let response = traffic_client()
        .post(serving.agent.url.join(APPLY_PATH).expect("url"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&wire).expect("json"))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status().as_u16(), 400);
    let text = response.text().await.unwrap_or_default();
    assert!(text.contains("leader identity"), "{text}");
    assert_eq!(
        serving
            .client
            .state(&serving.agent.url)
            .await
            .expect("state")
            .fence,
        Some(1)
    );
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxys_check_output_is_capped_and_keeps_the_verdict() {
    let serving = Serving::start(1).await;
    // Two thousand notices of 200 bytes each (about 400 KiB of output), then an error.
    let noisy = rewrite(&serving.set_routing_to("a"), "haproxy.cfg", |cfg| {
        let notices: String = (0..2000)
            .map(|i| format!("  .notice \"{i:05} {}\"\n", "x".repeat(190)))
            .collect();
        format!("{cfg}{notices}  no-such-keyword-at-the-end\n")
    });
    let error = serving
        .client
        .apply(&serving.agent.url, &request(1, "leader-0", 2, noisy))
        .await
        .expect_err("invalid");
    let Error::Invalid { check_output } = error else {
        panic!("expected Invalid, got {error:?}");
    };
    assert!(
        check_output.len() <= haptic_agent::haproxy::CHECK_OUTPUT_CAP + 200,
        "{} bytes",
        check_output.len()
    );
    assert!(
        check_output.contains("bytes of output cut"),
        "{check_output}"
    );
    assert!(
        check_output.contains("no-such-keyword-at-the-end"),
        "the verdict is kept"
    );
    serving.agent.stop().await;
}

/// A runtime change reaches the worker that serves new connections, the newest generation's,
/// while the worker before a reload still drains a connection: the runtime commands address
/// the current worker (`@1`), never one of the old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_change_after_a_reload_reaches_the_new_worker_while_an_old_one_drains() {
    let serving = Serving::start(1).await;
    let b = Backend::start("b").await;
    let (client, url, port) = (&serving.client, &serving.agent.url, serving.port);
    // A request begun and never finished keeps the first worker draining after the reload.
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut held, b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("a partial request");
    let first = client.state(url).await.expect("state").worker_pids;

    // A new backend: a reload, and a new worker beside the draining one.
    let backends = [("a", serving.backend.addr), ("b", b.addr)];
    let reloaded = request(1, "leader-0", 2, config(port, "a", &backends));
    let report = client.apply(url, &reloaded).await.expect("reload");
    assert!(report.reload, "{report:?}");
    let workers = client.state(url).await.expect("state").worker_pids;
    let table = serving
        .agent
        .agent
        .haproxy()
        .command("show proc", Duration::from_secs(5))
        .await
        .expect("show proc");
    let old = table.split("# old workers").nth(1).unwrap_or_default();
    assert!(
        workers.iter().all(|pid| !first.contains(pid))
            && first.iter().all(|pid| old.contains(&pid.to_string())),
        "the old worker drains beside the new one: {first:?} then {workers:?}, {table}"
    );

    // Backend a's server moves to b's address: a runtime change, served by the new worker.
    let moved = [("a", b.addr), ("b", b.addr)];
    let runtime = request(1, "leader-0", 3, config(port, "a", &moved));
    let report = client.apply(url, &runtime).await.expect("runtime change");
    assert!(!report.reload && report.runtime_ops > 0, "{report:?}");
    assert_eq!(await_body(port, "backend b").await, "backend b");
    drop(held);
    serving.agent.stop().await;
}
