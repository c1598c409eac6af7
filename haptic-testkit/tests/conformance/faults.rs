//! Fault injection per client and globally, each lifted with one call, and request accounting.
//! Time is paused: latency, hangs and outages run on tokio's virtual clock.

use std::time::Duration;

use futures::StreamExt;
use haptic_testkit::{ApiServer, Fault};
use http::Method;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api,
    api::{PostParams, WatchEvent, WatchParams},
};
use tokio::time::Instant;

use crate::common::{BOUND, lease, no_retry_client, raw, status};

fn leases(client: kube::Client) -> Api<Lease> {
    Api::default_namespaced(client)
}

/// Whether a request failed at the transport (connection closed), not with an API answer.
fn is_transport_error<T: std::fmt::Debug>(result: &Result<T, kube::Error>) -> bool {
    matches!(result, Err(e) if !matches!(e, kube::Error::Api(_)))
}

#[tokio::test(start_paused = true)]
async fn latency_delays_only_the_faulted_client() {
    let server = ApiServer::start().await.unwrap();
    let slow = leases(server.client_for("slow").unwrap());
    let fast = leases(server.client_for("fast").unwrap());
    slow.create(&PostParams::default(), &lease("l", "a"))
        .await
        .unwrap();
    server.inject("slow", Fault::Latency(Duration::from_secs(3)));

    let started = Instant::now();
    fast.get("l").await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(3));
    let started = Instant::now();
    slow.get("l").await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // Latencies add up; lifting removes them all.
    server.inject("slow", Fault::Latency(Duration::from_secs(2)));
    let started = Instant::now();
    slow.get("l").await.unwrap();
    assert!(started.elapsed() >= Duration::from_secs(5));
    server.lift("slow");
    let started = Instant::now();
    slow.get("l").await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn slow_responses_take_effect_at_once_and_answer_late() {
    let server = ApiServer::start().await.unwrap();
    let slow = leases(server.client_for("slow").unwrap());
    let observer = leases(server.client_for("observer").unwrap());
    server.inject("slow", Fault::SlowResponse(Duration::from_secs(4)));
    let started = Instant::now();
    let create =
        tokio::spawn(async move { slow.create(&PostParams::default(), &lease("s", "a")).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        observer.get_opt("s").await.unwrap().is_some(),
        "the write took effect before its answer"
    );
    assert!(!create.is_finished(), "the answer is held back");
    create.await.unwrap().unwrap();
    assert!(started.elapsed() >= Duration::from_secs(4));
    server.lift("slow");
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn error_faults_answer_a_status_with_retry_after() {
    let server = ApiServer::start().await.unwrap();
    let flaky = no_retry_client(&server, "flaky");
    let healthy = leases(server.client_for("healthy").unwrap());
    healthy
        .create(&PostParams::default(), &lease("e", "a"))
        .await
        .unwrap();
    let path = "/apis/coordination.k8s.io/v1/namespaces/default/leases/e";
    for (code, reason) in [
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (429, "TooManyRequests"),
    ] {
        server.inject(
            "flaky",
            Fault::Error {
                code,
                retry_after: Some(7),
                times: None,
            },
        );
        let answer = raw(&flaky, Method::GET, path, None, "").await;
        assert_eq!(answer.code.as_u16(), code);
        assert_eq!(answer.headers.get("retry-after").unwrap(), "7");
        assert_eq!(answer.body["kind"], "Status");
        assert_eq!(answer.body["code"], code);
        assert_eq!(answer.body["reason"], reason);
        assert_eq!(answer.body["details"]["retryAfterSeconds"], 7);
        let err = status(leases(flaky.clone()).get("e").await);
        assert_eq!((err.code, err.reason.as_str()), (code, reason));
        // Watches are refused the same way.
        let err = status(
            leases(flaky.clone())
                .watch(&WatchParams::default().disable_bookmarks(), "0")
                .await
                .map(|_| ()),
        );
        assert_eq!(err.code, code);
        assert!(
            healthy.get("e").await.is_ok(),
            "other clients are unaffected"
        );
        server.lift("flaky");
        assert!(leases(flaky.clone()).get("e").await.is_ok());
    }

    // Latency delays error answers too.
    server.inject("flaky", Fault::Latency(Duration::from_secs(4)));
    server.inject(
        "flaky",
        Fault::Error {
            code: 500,
            retry_after: None,
            times: Some(1),
        },
    );
    let started = Instant::now();
    assert_eq!(status(leases(flaky.clone()).get("e").await).code, 500);
    assert!(started.elapsed() >= Duration::from_secs(4));
    server.lift("flaky");

    // `times` bounds the failures.
    server.inject(
        "flaky",
        Fault::Error {
            code: 500,
            retry_after: None,
            times: Some(2),
        },
    );
    let api = leases(flaky.clone());
    assert_eq!(status(api.get("e").await).code, 500);
    assert_eq!(status(api.get("e").await).code, 500);
    assert!(api.get("e").await.is_ok());

    // kube's default client retries 503 by itself: a single injected 503 is invisible to it.
    server.inject(
        "retrying",
        Fault::Error {
            code: 503,
            retry_after: Some(1),
            times: Some(1),
        },
    );
    assert!(
        leases(server.client_for("retrying").unwrap())
            .get("e")
            .await
            .is_ok()
    );
    let retried = server
        .requests()
        .iter()
        .filter(|r| r.client == "retrying")
        .map(|r| r.code)
        .collect::<Vec<_>>();
    assert_eq!(retried, [503, 200]);
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn dropped_connections_cut_requests_and_watches() {
    let server = ApiServer::start().await.unwrap();
    let victim = leases(server.client_for("victim").unwrap());
    let other = leases(server.client_for("other").unwrap());
    other
        .create(&PostParams::default(), &lease("d", "a"))
        .await
        .unwrap();
    let rv = server.resource_version().to_string();
    let mut watch = victim
        .watch(&WatchParams::default().disable_bookmarks(), &rv)
        .await
        .unwrap()
        .boxed();

    server.inject("victim", Fault::DropConnections);
    let result = tokio::time::timeout(BOUND, victim.get("d"))
        .await
        .expect("fails fast, no hang");
    assert!(is_transport_error(&result), "{result:?}");
    let cut = tokio::time::timeout(BOUND, watch.next())
        .await
        .expect("the watch is cut");
    assert!(matches!(cut, None | Some(Err(_))), "{cut:?}");
    assert!(other.get("d").await.is_ok());

    server.lift("victim");
    assert!(victim.get("d").await.is_ok());
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn hung_requests_hang_until_lifted_and_never_take_effect() {
    let server = ApiServer::start().await.unwrap();
    let hung = leases(server.client_for("hung").unwrap());
    let other = leases(server.client_for("other").unwrap());
    server.inject("hung", Fault::HangRequests);
    let waited = tokio::time::timeout(Duration::from_secs(120), hung.get("x")).await;
    assert!(waited.is_err(), "the request hangs");
    assert!(
        other
            .create(&PostParams::default(), &lease("o", "a"))
            .await
            .is_ok()
    );
    // Watches of the same client are not hung by this fault.
    let mut watch = hung
        .watch(&WatchParams::default().disable_bookmarks(), "0")
        .await
        .unwrap()
        .boxed();
    assert!(matches!(
        tokio::time::timeout(BOUND, watch.next()).await,
        Ok(Some(Ok(WatchEvent::Added(_))))
    ));

    let pending = tokio::spawn({
        let hung = hung.clone();
        async move {
            hung.create(&PostParams::default(), &lease("never", "a"))
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(!pending.is_finished());
    server.lift("hung");
    let result = tokio::time::timeout(BOUND, pending).await.unwrap().unwrap();
    assert!(is_transport_error(&result), "{result:?}");
    assert_eq!(
        status(other.get("never").await).code,
        404,
        "the hung write was lost"
    );
    assert!(hung.get("o").await.is_ok());
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn hung_watches_go_silent_and_resume_when_lifted() {
    let server = ApiServer::start().await.unwrap();
    let watcher = leases(server.client_for("watcher").unwrap());
    let writer = leases(server.client_for("writer").unwrap());
    let rv = server.resource_version().to_string();
    let params = WatchParams::default().disable_bookmarks().timeout(20);
    let mut open = watcher.watch(&params, &rv).await.unwrap().boxed();

    server.inject("watcher", Fault::HangWatches);
    writer
        .create(&PostParams::default(), &lease("h", "a"))
        .await
        .unwrap();
    // Silent past its own timeoutSeconds: a stalled connection does not deliver the end either.
    let silent = tokio::time::timeout(Duration::from_secs(60), open.next()).await;
    assert!(silent.is_err(), "the open watch is silent: {silent:?}");
    // A new watch is accepted and stays silent too; plain requests still work.
    let mut fresh = watcher
        .watch(&WatchParams::default().disable_bookmarks(), &rv)
        .await
        .unwrap()
        .boxed();
    assert!(
        tokio::time::timeout(Duration::from_secs(60), fresh.next())
            .await
            .is_err()
    );
    assert!(watcher.get("h").await.is_ok());

    server.lift("watcher");
    let resumed = tokio::time::timeout(BOUND, open.next()).await.unwrap();
    assert!(
        matches!(resumed, Some(Ok(WatchEvent::Added(ref l))) if l.metadata.name.as_deref() == Some("h")),
        "{resumed:?}"
    );
    let ended = tokio::time::timeout(BOUND, open.next()).await.unwrap();
    assert!(
        ended.is_none(),
        "then the end its timeout had reached: {ended:?}"
    );
    let resumed = tokio::time::timeout(BOUND, fresh.next()).await.unwrap();
    assert!(
        matches!(resumed, Some(Ok(WatchEvent::Added(_)))),
        "{resumed:?}"
    );
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn partition_isolates_one_client_only() {
    let server = ApiServer::start().await.unwrap();
    let a = leases(server.client_for("a").unwrap());
    let b = leases(server.client_for("b").unwrap());
    a.create(&PostParams::default(), &lease("p", "a"))
        .await
        .unwrap();
    let rv = server.resource_version().to_string();
    let mut a_watch = a
        .watch(&WatchParams::default().disable_bookmarks(), &rv)
        .await
        .unwrap()
        .boxed();
    let mut b_watch = b
        .watch(&WatchParams::default().disable_bookmarks(), &rv)
        .await
        .unwrap()
        .boxed();

    // A partition wins over an error answer injected before it: the request never arrives.
    server.inject(
        "a",
        Fault::Error {
            code: 500,
            retry_after: None,
            times: None,
        },
    );
    server.inject("a", Fault::Partition);
    assert!(
        tokio::time::timeout(Duration::from_secs(60), a.get("p"))
            .await
            .is_err()
    );
    assert!(
        tokio::time::timeout(
            Duration::from_secs(60),
            a.watch(&WatchParams::default().disable_bookmarks(), "0")
        )
        .await
        .is_err()
    );
    b.create(&PostParams::default(), &lease("q", "b"))
        .await
        .unwrap();
    let seen = tokio::time::timeout(BOUND, b_watch.next()).await.unwrap();
    assert!(
        matches!(seen, Some(Ok(WatchEvent::Added(_)))),
        "b is unaffected"
    );
    assert!(
        tokio::time::timeout(Duration::from_secs(60), a_watch.next())
            .await
            .is_err()
    );

    server.lift("a");
    assert!(a.get("q").await.is_ok());
    let seen = tokio::time::timeout(BOUND, a_watch.next()).await.unwrap();
    assert!(matches!(seen, Some(Ok(WatchEvent::Added(_)))), "{seen:?}");
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn global_outage_for_a_duration_and_lift_all() {
    let server = ApiServer::start().await.unwrap();
    let a = leases(server.client_for("a").unwrap());
    let b = leases(server.client_for("b").unwrap());
    a.create(&PostParams::default(), &lease("g", "a"))
        .await
        .unwrap();
    let mut watch = b
        .watch(
            &WatchParams::default().disable_bookmarks(),
            &server.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();

    server.outage(Duration::from_secs(30));
    for api in [&a, &b] {
        let result = tokio::time::timeout(BOUND, api.get("g"))
            .await
            .expect("fails fast");
        assert!(is_transport_error(&result), "{result:?}");
    }
    let cut = tokio::time::timeout(BOUND, watch.next())
        .await
        .expect("watches are cut");
    assert!(matches!(cut, None | Some(Err(_))), "{cut:?}");
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert!(a.get("g").await.is_ok(), "the outage ends by itself");

    server.outage(Duration::from_secs(3600));
    assert!(is_transport_error(&b.get("g").await));
    server.end_outage();
    assert!(b.get("g").await.is_ok(), "end_outage lifts it at once");

    server.outage(Duration::from_secs(3600));
    server.inject("a", Fault::HangRequests);
    server.inject(
        "b",
        Fault::Error {
            code: 500,
            retry_after: None,
            times: None,
        },
    );
    server.lift_all();
    assert!(a.get("g").await.is_ok());
    assert!(b.get("g").await.is_ok());
    server.shutdown().await;
}

#[tokio::test]
async fn request_accounting_per_client_verb_and_resource() {
    let server = ApiServer::start().await.unwrap();
    let a = leases(server.client_for("replica-a").unwrap());
    let b = leases(server.client_for("replica-b").unwrap());
    a.create(&PostParams::default(), &lease("acc", "a"))
        .await
        .unwrap();
    server.reset_accounting();
    assert!(server.requests().is_empty());

    let got = a.get("acc").await.unwrap();
    a.replace("acc", &PostParams::default(), &got)
        .await
        .unwrap();
    a.list(&Default::default()).await.unwrap();
    b.get("acc").await.unwrap();
    b.get("acc").await.unwrap();
    let _ = b.get("missing").await;
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::default_namespaced(server.client_for("replica-b").unwrap());
    cms.list(&Default::default()).await.unwrap();

    let counts = server.request_counts();
    let key = |c: &str, v: &str, r: &str| (c.to_owned(), v.to_owned(), r.to_owned());
    let lease = "leases.coordination.k8s.io";
    assert_eq!(counts[&key("replica-a", "get", lease)], 1);
    assert_eq!(counts[&key("replica-a", "update", lease)], 1);
    assert_eq!(counts[&key("replica-a", "list", lease)], 1);
    assert_eq!(counts[&key("replica-b", "get", lease)], 3);
    assert_eq!(counts[&key("replica-b", "list", "configmaps")], 1);
    assert_eq!(counts.values().sum::<u64>(), 7);

    let log = server.requests();
    assert!(log.windows(2).all(|w| w[0].seq < w[1].seq));
    let missing = log.iter().find(|r| r.name == "missing").unwrap();
    assert_eq!(
        (missing.client.as_str(), missing.verb.as_str(), missing.code),
        ("replica-b", "get", 404)
    );
    assert_eq!(
        (missing.namespace.as_str(), missing.resource.as_str()),
        ("default", lease)
    );

    // Unnamed clients are counted as anonymous.
    let anonymous =
        kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    leases(anonymous).list(&Default::default()).await.unwrap();
    assert_eq!(server.request_counts()[&key("anonymous", "list", lease)], 1);
    server.reset_accounting();
    assert!(server.request_counts().is_empty());
    server.shutdown().await;
}

#[tokio::test]
async fn kubeconfig_clients_are_told_apart_with_or_without_a_token() {
    let server = ApiServer::start().await.unwrap();
    // kube reads the kubeconfig's token and server path.
    let path = server.kubeconfig_for("daemon").unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let daemon = leases(kube::Client::try_from(config).unwrap());
    daemon.list(&Default::default()).await.unwrap();
    // client-go sends no token over plain HTTP: the path prefix alone names the client.
    let anonymous = kube::Client::try_from(kube::Config::new(
        format!("{}/clients/cli", server.url()).parse().unwrap(),
    ))
    .unwrap();
    leases(anonymous).list(&Default::default()).await.unwrap();
    let counts = server.request_counts();
    let lease = "leases.coordination.k8s.io".to_owned();
    assert_eq!(counts[&("daemon".into(), "list".into(), lease.clone())], 1);
    assert_eq!(counts[&("cli".into(), "list".into(), lease)], 1);
    // Faults address such a client by the same name.
    server.inject(
        "cli",
        Fault::Error {
            code: 500,
            retry_after: None,
            times: None,
        },
    );
    let cli = kube::Client::try_from(kube::Config::new(
        format!("{}/clients/cli", server.url()).parse().unwrap(),
    ))
    .unwrap();
    assert_eq!(status(leases(cli).get("x").await).code, 500);
    assert!(server.kubeconfig_for("has space").is_err());
    assert!(server.kubeconfig_for("a/b").is_err());
    server.shutdown().await;
}
