//! WATCH: resume from a resourceVersion, synthetic ADDED, event types, bookmarks, timeouts,
//! 410 Expired after compaction, and the kube-runtime watcher relisting after it.

use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use haptic_testkit::{ApiServer, ServerOptions};
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::{Value, json};

use crate::common::{BOUND, lease};

/// Reads raw watch lines until `n` lines arrived or the stream ended.
async fn raw_watch_lines(client: &kube::Client, path: &str, n: usize) -> (Vec<Value>, bool) {
    let request = Request::builder()
        .method(Method::GET)
        .uri(path)
        .body(kube::client::Body::empty())
        .unwrap();
    let response = tokio::time::timeout(BOUND, client.send(request))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut buffer = Vec::new();
    let mut lines = Vec::new();
    loop {
        if lines.len() >= n {
            return (lines, false);
        }
        let Some(frame) = body.frame().await else {
            return (lines, true);
        };
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(pos) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=pos).collect();
            lines.push(serde_json::from_slice(&line).unwrap());
        }
    }
}

fn summary(events: &[WatchEvent<Lease>]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            WatchEvent::Added(l) => format!("ADDED {}", l.metadata.name.as_deref().unwrap()),
            WatchEvent::Modified(l) => format!("MODIFIED {}", l.metadata.name.as_deref().unwrap()),
            WatchEvent::Deleted(l) => format!("DELETED {}", l.metadata.name.as_deref().unwrap()),
            WatchEvent::Bookmark(b) => format!("BOOKMARK {}", b.metadata.resource_version),
            WatchEvent::Error(s) => format!("ERROR {}", s.code),
        })
        .collect()
}

async fn watch_from_a_resource_version_sends_only_later_changes(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let pp = PostParams::default();
    leases.create(&pp, &lease("before", "a")).await.unwrap();
    let from = server.resource_version().await.to_string();
    leases.create(&pp, &lease("after", "a")).await.unwrap();
    leases
        .patch(
            "before",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "holderIdentity": "b" } })),
        )
        .await
        .unwrap();
    leases
        .delete("after", &DeleteParams::default())
        .await
        .unwrap();
    // Writes to other resources are not part of a lease watch.
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client().unwrap());
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("noise".into());
    cms.create(&pp, &cm).await.unwrap();

    let stream = leases.watch(&WatchParams::default(), &from).await.unwrap();
    let events: Vec<_> = tokio::time::timeout(BOUND, stream.take(3).try_collect::<Vec<_>>())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        summary(&events),
        ["ADDED after", "MODIFIED before", "DELETED after"]
    );
    let rvs: Vec<u64> = events
        .iter()
        .map(|e| match e {
            WatchEvent::Added(l) | WatchEvent::Modified(l) | WatchEvent::Deleted(l) => l
                .metadata
                .resource_version
                .as_deref()
                .unwrap()
                .parse()
                .unwrap(),
            _ => 0,
        })
        .collect();
    assert!(rvs.windows(2).all(|w| w[0] < w[1]), "{rvs:?}");
    assert!(rvs[0] > from.parse::<u64>().unwrap());
    server.shutdown().await;
}

async fn watch_without_or_from_zero_starts_with_synthetic_added(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let pp = PostParams::default();
    leases.create(&pp, &lease("one", "a")).await.unwrap();
    leases.create(&pp, &lease("two", "a")).await.unwrap();
    for from in ["0", ""] {
        let path = if from.is_empty() {
            "/apis/coordination.k8s.io/v1/namespaces/default/leases?watch=true".to_owned()
        } else {
            format!(
                "/apis/coordination.k8s.io/v1/namespaces/default/leases?watch=true&resourceVersion={from}"
            )
        };
        let (lines, _) = raw_watch_lines(&client, &path, 2).await;
        let kinds: Vec<String> = lines
            .iter()
            .map(|l| {
                format!(
                    "{} {}",
                    l["type"].as_str().unwrap(),
                    l["object"]["metadata"]["name"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(
            kinds,
            ["ADDED one", "ADDED two"],
            "resourceVersion {from:?}"
        );
        // Watch events carry full objects, with kind and apiVersion.
        assert_eq!(lines[0]["object"]["kind"], "Lease");
        assert_eq!(lines[0]["object"]["apiVersion"], "coordination.k8s.io/v1");
    }
    // The synthetic events are followed by live ones.
    let mut stream = leases
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    for _ in 0..2 {
        assert!(matches!(
            stream.next().await,
            Some(Ok(WatchEvent::Added(_)))
        ));
    }
    leases.create(&pp, &lease("three", "a")).await.unwrap();
    // A BOOKMARK may come at any time (the real server sends one soon after the initial
    // events); the next change is what matters.
    let next = tokio::time::timeout(BOUND, async {
        loop {
            match stream.next().await {
                Some(Ok(WatchEvent::Bookmark(_))) => continue,
                other => return other,
            }
        }
    })
    .await
    .unwrap()
    .unwrap()
    .unwrap();
    assert_eq!(summary(&[next]), ["ADDED three"]);
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn bookmarks_have_only_kind_api_version_and_resource_version() {
    let server = ApiServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_secs(5),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    // An empty collection: the bookmark must still carry the current resourceVersion.
    let rv = server.resource_version();
    let (lines, _) = raw_watch_lines(
        &client,
        "/apis/coordination.k8s.io/v1/namespaces/default/leases?watch=true&allowWatchBookmarks=true",
        1,
    )
    .await;
    let bookmark = &lines[0];
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(
        bookmark["object"],
        json!({ "kind": "Lease", "apiVersion": "coordination.k8s.io/v1", "metadata": { "resourceVersion": rv.to_string() } })
    );

    // Through kube: ADDED, MODIFIED, DELETED and BOOKMARK, in order.
    let from = server.resource_version().to_string();
    let mut stream = leases
        .watch(&WatchParams::default(), &from)
        .await
        .unwrap()
        .boxed();
    let pp = PostParams::default();
    leases.create(&pp, &lease("b", "a")).await.unwrap();
    leases
        .patch(
            "b",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "holderIdentity": "z" } })),
        )
        .await
        .unwrap();
    leases.delete("b", &DeleteParams::default()).await.unwrap();
    // Bookmarks may come between the changes (time is virtual); the changes come in order and
    // a bookmark at the latest resourceVersion follows them.
    let last = server.resource_version();
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.extend(summary(&[event]));
        if seen.last() == Some(&format!("BOOKMARK {last}")) {
            break;
        }
    }
    let changes: Vec<&String> = seen.iter().filter(|s| !s.starts_with("BOOKMARK")).collect();
    assert_eq!(changes, ["ADDED b", "MODIFIED b", "DELETED b"], "{seen:?}");

    // Without allowWatchBookmarks nothing is sent on a quiet watch.
    let quiet = leases
        .watch(
            &WatchParams::default().disable_bookmarks(),
            &last.to_string(),
        )
        .await
        .unwrap();
    let nothing = tokio::time::timeout(Duration::from_secs(30), quiet.boxed().next()).await;
    assert!(nothing.is_err(), "no bookmark without allowWatchBookmarks");
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn timeout_seconds_closes_the_stream() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().unwrap();
    let started = tokio::time::Instant::now();
    let (lines, ended) = tokio::time::timeout(
        Duration::from_secs(600),
        raw_watch_lines(
            &client,
            "/apis/coordination.k8s.io/v1/namespaces/default/leases?watch=true&resourceVersion=1&timeoutSeconds=7",
            usize::MAX,
        ),
    )
    .await
    .expect("the server closes the watch");
    assert!(ended && lines.is_empty());
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(7) && elapsed < Duration::from_secs(60),
        "{elapsed:?}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn too_old_resource_version_is_410_expired_as_an_error_event() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let old = server.resource_version().to_string();
    leases
        .create(&PostParams::default(), &lease("x", "a"))
        .await
        .unwrap();
    server.compact();
    let stream = leases.watch(&WatchParams::default(), &old).await.unwrap();
    let events: Vec<_> = tokio::time::timeout(BOUND, stream.try_collect::<Vec<_>>())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(events.len(), 1, "one ERROR event, then the stream ends");
    let WatchEvent::Error(err) = &events[0] else {
        panic!("{:?}", events[0])
    };
    assert_eq!((err.code, err.reason.as_str()), (410, "Expired"));
    assert!(
        err.message.starts_with("too old resource version:"),
        "{}",
        err.message
    );

    // The current resourceVersion is still a valid starting point.
    let now = server.resource_version().to_string();
    let mut stream = leases
        .watch(&WatchParams::default(), &now)
        .await
        .unwrap()
        .boxed();
    leases
        .create(&PostParams::default(), &lease("y", "a"))
        .await
        .unwrap();
    let next = tokio::time::timeout(BOUND, stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(summary(&[next]), ["ADDED y"]);

    // A history bound works the same way without an explicit compaction.
    let small = ApiServer::start_with(ServerOptions {
        history_limit: 2,
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let leases: Api<Lease> = Api::default_namespaced(small.client().unwrap());
    let old = small.resource_version().to_string();
    for name in ["a", "b", "c"] {
        leases
            .create(&PostParams::default(), &lease(name, "h"))
            .await
            .unwrap();
    }
    let events: Vec<_> = leases
        .watch(&WatchParams::default(), &old)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert!(
        matches!(&events[..], [WatchEvent::Error(e)] if e.code == 410),
        "{events:?}"
    );
    small.shutdown().await;
    server.shutdown().await;
}

#[tokio::test]
async fn runtime_watcher_relists_after_410() {
    let server = ApiServer::start().await.unwrap();
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let writer: Api<Lease> = Api::default_namespaced(server.client_for("writer").unwrap());
    writer
        .create(&PostParams::default(), &lease("first", "a"))
        .await
        .unwrap();
    let mut events = watcher(leases, watcher::Config::default()).boxed();
    let mut next = async || {
        tokio::time::timeout(BOUND, events.next())
            .await
            .unwrap()
            .unwrap()
    };
    assert!(matches!(next().await, Ok(watcher::Event::Init)));
    assert!(
        matches!(next().await, Ok(watcher::Event::InitApply(l)) if l.metadata.name.as_deref() == Some("first"))
    );
    assert!(matches!(next().await, Ok(watcher::Event::InitDone)));
    // The watcher has listed and not yet watched: its resourceVersion goes out of history.
    writer
        .create(&PostParams::default(), &lease("second", "a"))
        .await
        .unwrap();
    server.compact();
    match next().await {
        Err(watcher::Error::WatchError(status)) => assert_eq!(status.code, 410),
        other => panic!("expected the 410 ERROR event, got {other:?}"),
    }
    assert!(
        matches!(next().await, Ok(watcher::Event::Init)),
        "the watcher relists"
    );
    let mut names = Vec::new();
    loop {
        match next().await {
            Ok(watcher::Event::InitApply(l)) => names.push(l.metadata.name.unwrap()),
            Ok(watcher::Event::InitDone) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(names, ["first", "second"]);
    // And then follows live changes.
    writer
        .create(&PostParams::default(), &lease("third", "a"))
        .await
        .unwrap();
    assert!(
        matches!(next().await, Ok(watcher::Event::Apply(l)) if l.metadata.name.as_deref() == Some("third"))
    );
    let lists = server
        .requests()
        .iter()
        .filter(|r| r.client == "test" && r.verb == "list")
        .count();
    assert_eq!(lists, 2);
    let _ = Bytes::new();
    server.shutdown().await;
}

async fn runtime_watcher_applies_objects(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let stream = watcher(leases.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    leases
        .create(&PostParams::default(), &lease("w", "a"))
        .await
        .unwrap();
    let first = tokio::time::timeout(BOUND, stream.into_future())
        .await
        .unwrap()
        .0
        .unwrap()
        .unwrap();
    assert_eq!(first.metadata.name.as_deref(), Some("w"));
    server.shutdown().await;
}

async fn a_resource_version_that_is_not_a_number_is_refused_before_streaming(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let answer = crate::common::raw(
        &client,
        Method::GET,
        "/apis/coordination.k8s.io/v1/namespaces/default/leases?watch=true&resourceVersion=abc",
        None,
        "",
    )
    .await;
    crate::common::assert_status(&answer, 422, "Invalid");
    assert_eq!(
        answer.body["message"],
        r#"leases.coordination.k8s.io "" is invalid: resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax"#
    );
    server.shutdown().await;
}

async fn selector_watches_turn_leaving_and_entering_into_deleted_and_added(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let mut labelled = lease("sel", "a");
    labelled.metadata.labels = Some([("role".to_owned(), "leader".to_owned())].into());
    leases
        .create(&PostParams::default(), &labelled)
        .await
        .unwrap();
    leases
        .create(&PostParams::default(), &lease("other", "a"))
        .await
        .unwrap();
    let from = server.resource_version().await.to_string();
    let mut stream = leases
        .watch(
            &WatchParams::default()
                .labels("role=leader")
                .disable_bookmarks(),
            &from,
        )
        .await
        .unwrap()
        .boxed();
    let relabel =
        |value: Option<&str>| Patch::Merge(json!({ "metadata": { "labels": { "role": value } } }));
    let pp = PatchParams::default();
    leases
        .patch(
            "other",
            &pp,
            &Patch::Merge(json!({ "spec": { "holderIdentity": "x" } })),
        )
        .await
        .unwrap();
    leases.patch("sel", &pp, &relabel(None)).await.unwrap();
    leases
        .patch("sel", &pp, &relabel(Some("leader")))
        .await
        .unwrap();
    leases
        .patch(
            "sel",
            &pp,
            &Patch::Merge(json!({ "spec": { "holderIdentity": "b" } })),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let event = tokio::time::timeout(BOUND, stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.extend(summary(&[event]));
    }
    assert_eq!(seen, ["DELETED sel", "ADDED sel", "MODIFIED sel"]);
    server.shutdown().await;
}

#[tokio::test]
async fn runtime_watcher_streaming_list_gets_initial_events_and_their_end() {
    let server = ApiServer::start().await.unwrap();
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    leases
        .create(&PostParams::default(), &lease("s1", "a"))
        .await
        .unwrap();
    leases
        .create(&PostParams::default(), &lease("s2", "a"))
        .await
        .unwrap();
    let mut events = watcher(leases.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout(BOUND, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::Init => seen.push("Init".to_owned()),
            watcher::Event::InitApply(l) => seen.push(l.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(seen, ["Init", "s1", "s2"]);
    leases
        .create(&PostParams::default(), &lease("s3", "a"))
        .await
        .unwrap();
    let next = tokio::time::timeout(BOUND, events.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(next, watcher::Event::Apply(l) if l.metadata.name.as_deref() == Some("s3")));
    assert!(
        server.requests().iter().all(|r| r.verb != "list"),
        "no list call in streaming mode"
    );
    server.shutdown().await;
}

crate::on_both!(
    both: [
        watch_from_a_resource_version_sends_only_later_changes,
        watch_without_or_from_zero_starts_with_synthetic_added,
        runtime_watcher_applies_objects,
        selector_watches_turn_leaving_and_entering_into_deleted_and_added,
    ],
    stand_in_only: [
        a_resource_version_that_is_not_a_number_is_refused_before_streaming,
    ],
);
