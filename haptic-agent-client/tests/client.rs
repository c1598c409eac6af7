//! The client's retry policy, typed errors, timeouts and fan-out bound, over real HTTP against
//! a small scripted server on loopback (the agent itself is exercised in haptic-agent's tests).

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    http::{HeaderMap, StatusCode},
    routing::post,
};
use haptic_agent_client::{
    AgentClient, ApplyRequest, ClientConfig, Error, FileSet, Outcome, Target,
    protocol::{ApplyResponse, Timing, decode_apply},
};
use tokio::net::TcpListener;

/// Answers `/v1/apply` with the scripted (status, body) pairs in turn (the last one repeats),
/// after `delay`, counting requests and the most in flight at once.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<Vec<(u16, String)>>>,
    requests: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
    bodies: Arc<Mutex<Vec<(bool, usize)>>>,
    delay: Duration,
}

impl Script {
    fn new(answers: Vec<(u16, String)>) -> Self {
        Self {
            answers: Arc::new(Mutex::new(answers)),
            ..Self::default()
        }
    }

    async fn serve(self) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route(
            "/v1/apply",
            post(move |headers: HeaderMap, body: Bytes| {
                let script = self.clone();
                async move {
                    script.requests.fetch_add(1, Ordering::SeqCst);
                    let now = script.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    script.max_in_flight.fetch_max(now, Ordering::SeqCst);
                    let gzip = headers
                        .get("content-encoding")
                        .is_some_and(|value| value == "gzip");
                    // The body must decode as the protocol says, or the answer is 400.
                    let decoded = decode_apply(&body, gzip, 64 << 20)
                        .and_then(|wire| wire.into_request())
                        .map(|request| request.files.len());
                    tokio::time::sleep(script.delay).await;
                    script.in_flight.fetch_sub(1, Ordering::SeqCst);
                    let Ok(files) = decoded else {
                        return (StatusCode::BAD_REQUEST, "undecodable".to_owned());
                    };
                    script.bodies.lock().expect("lock").push((gzip, files));
                    let mut answers = script.answers.lock().expect("lock");
                    let (status, body) = if answers.len() > 1 {
                        answers.remove(0)
                    } else {
                        answers[0].clone()
                    };
                    (StatusCode::from_u16(status).expect("status"), body)
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        addr
    }
}

fn applied(checksum: &str) -> (u16, String) {
    let body = ApplyResponse::Applied {
        checksum: checksum.to_owned(),
        generation: 1,
        timing: Timing::default(),
        reload: true,
        runtime_ops: 0,
    };
    (200, serde_json::to_string(&body).expect("json"))
}

fn request(size: usize) -> ApplyRequest {
    let files = FileSet::new()
        .with("haproxy.cfg", "global\n".repeat(size))
        .and_then(|set| set.with("certs/site.pem", vec![0xffu8, 0xfe, 0]))
        .expect("set");
    ApplyRequest::new(3, "leader-0", 1, files).expect("request")
}

fn client(attempts: u32) -> AgentClient {
    AgentClient::new(
        ClientConfig::new("token")
            .with_retries(attempts, Duration::from_millis(5))
            .with_request_timeout(Duration::from_secs(5)),
    )
    .expect("client")
}

fn url(addr: SocketAddr) -> reqwest::Url {
    reqwest::Url::parse(&format!("http://{addr}/")).expect("url")
}

#[tokio::test]
async fn a_503_is_retried_until_the_agent_answers() {
    let request = request(1);
    let script = Script::new(vec![
        (503, r#"{"error":"not_ready","message":"busy"}"#.to_owned()),
        (503, r#"{"error":"not_ready","message":"busy"}"#.to_owned()),
        applied(&request.checksum),
    ]);
    let addr = script.clone().serve().await;
    let report = client(4)
        .apply(&url(addr), &request)
        .await
        .expect("applied");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(report.attempts, 3);
    assert_eq!(script.requests.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_503_that_persists_ends_as_unavailable_after_the_attempts() {
    let script = Script::new(vec![(
        503,
        r#"{"error":"not_ready","message":"fence corrupt"}"#.to_owned(),
    )]);
    let addr = script.clone().serve().await;
    match client(3).apply(&url(addr), &request(1)).await {
        Err(Error::Unavailable { attempts, message }) => {
            assert_eq!(attempts, 3);
            assert_eq!(message, "fence corrupt");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(script.requests.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn refusals_are_never_retried_and_are_typed() {
    let fenced = ApplyResponse::Fenced { fence: 9, epoch: 3 };
    let superseded = ApplyResponse::Superseded {
        generation: 4,
        live_generation: 5,
        epoch: 3,
    };
    let invalid = ApplyResponse::Invalid {
        checksum: "x".into(),
        check_output: "[ALERT] unknown keyword".into(),
        timing: Timing::default(),
    };
    let refused = ApplyResponse::RefusedByPolicy {
        checksum: "x".into(),
        violations: vec![haptic_agent_client::Violation {
            file: "haproxy.cfg".into(),
            line: 2,
            keyword: "lua-load".into(),
            why: "Lua is not allowed".into(),
        }],
        more: 3,
    };
    let rolled_back = ApplyResponse::RolledBack {
        checksum: "x".into(),
        live_checksum: Some("old".into()),
        reason: "cannot bind".into(),
        timing: Timing::default(),
    };
    type Case = ((u16, String), fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        ((409, serde_json::to_string(&fenced).expect("json")), |e| {
            matches!(e, Error::Fenced { fence: 9, epoch: 3 })
        }),
        (
            (409, serde_json::to_string(&superseded).expect("json")),
            |e| {
                matches!(
                    e,
                    Error::Superseded {
                        generation: 4,
                        live_generation: 5
                    }
                )
            },
        ),
        (
            (422, serde_json::to_string(&invalid).expect("json")),
            |e| matches!(e, Error::Invalid { check_output } if check_output.contains("unknown keyword")),
        ),
        ((422, serde_json::to_string(&refused).expect("json")), |e| {
            matches!(e, Error::RefusedByPolicy { violations, more: 3 }
                    if violations[0].to_string() == "haproxy.cfg:2: lua-load: Lua is not allowed")
        }),
        (
            (500, serde_json::to_string(&rolled_back).expect("json")),
            |e| matches!(e, Error::RolledBack { live_checksum: Some(live), .. } if live == "old"),
        ),
        (
            (401, r#"{"error":"unauthorized","message":"no"}"#.to_owned()),
            |e| matches!(e, Error::Unauthorized),
        ),
        (
            (
                400,
                r#"{"error":"bad_request","message":"path refused"}"#.to_owned(),
            ),
            |e| matches!(e, Error::Rejected { status: 400, message } if message == "path refused"),
        ),
        ((500, "boom".to_owned()), |e| {
            matches!(e, Error::Unexpected { status: 500, .. })
        }),
    ];
    for (answer, check) in cases {
        let script = Script::new(vec![answer.clone()]);
        let addr = script.clone().serve().await;
        let error = client(4)
            .apply(&url(addr), &request(1))
            .await
            .expect_err("refused");
        assert!(check(&error), "{answer:?} gave {error:?}");
        assert_eq!(
            script.requests.load(Ordering::SeqCst),
            1,
            "{answer:?} was retried"
        );
    }
}

#[tokio::test]
async fn a_transport_failure_is_retried_then_reported() {
    // A port that was free a moment ago: connections are refused.
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr")
    };
    match client(3).apply(&url(addr), &request(1)).await {
        Err(Error::Transport { attempts, source }) => {
            assert_eq!(attempts, 3);
            assert!(source.is_connect(), "{source:?}");
        }
        other => panic!("expected Transport, got {other:?}"),
    }
}

#[tokio::test]
async fn every_request_times_out() {
    let request = request(1);
    let mut script = Script::new(vec![applied(&request.checksum)]);
    script.delay = Duration::from_secs(30);
    let addr = script.clone().serve().await;
    let client = AgentClient::new(
        ClientConfig::new("token")
            .with_retries(2, Duration::from_millis(5))
            .with_request_timeout(Duration::from_millis(200)),
    )
    .expect("client");
    match client.apply(&url(addr), &request).await {
        Err(Error::Transport {
            attempts: 2,
            source,
        }) => assert!(source.is_timeout()),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[tokio::test]
async fn large_bodies_are_gzipped_and_small_ones_are_not() {
    let (small, large) = (request(1), request(100_000));
    let script = Script::new(vec![applied(&small.checksum)]);
    let addr = script.clone().serve().await;
    let client = client(1);
    client.apply(&url(addr), &small).await.expect("small");
    let prepared = client.prepare(&large);
    assert!(
        prepared.wire_len() * 20 < prepared.json_len(),
        "repetitive text compresses"
    );
    client.apply(&url(addr), &large).await.expect("large");
    assert_eq!(
        *script.bodies.lock().expect("lock"),
        vec![(false, 2), (true, 2)]
    );
}

#[tokio::test]
async fn fan_out_bounds_concurrency_and_returns_one_result_per_pod_in_order() {
    let request = request(1);
    let mut script = Script::new(vec![applied(&request.checksum)]);
    script.delay = Duration::from_millis(200);
    let addr = script.clone().serve().await;
    let refused = Script::new(vec![(
        409,
        serde_json::to_string(&ApplyResponse::Fenced { fence: 4, epoch: 3 }).expect("json"),
    )]);
    let refused_addr = refused.serve().await;

    let mut targets: Vec<Target> = (0..12)
        .map(|i| Target::new(format!("pod-{i}"), &format!("http://{addr}/")).expect("target"))
        .collect();
    targets.insert(
        5,
        Target::new("pod-fenced", &format!("http://{refused_addr}/")).expect("target"),
    );
    let client = AgentClient::new(ClientConfig::new("token").with_concurrency(3)).expect("client");
    let results = client.fan_out(&targets, &request).await;

    assert_eq!(results.len(), targets.len());
    for (result, target) in results.iter().zip(&targets) {
        assert_eq!(&result.target, target);
        if target.name == "pod-fenced" {
            assert!(matches!(result.result, Err(Error::Fenced { fence: 4, .. })));
        } else {
            assert_eq!(
                result.result.as_ref().expect("applied").outcome,
                Outcome::Applied
            );
        }
    }
    let max = script.max_in_flight.load(Ordering::SeqCst);
    assert!(max <= 3, "at most 3 in flight, saw {max}");
    assert!(max >= 2, "applies overlap, saw {max}");
}

#[tokio::test]
async fn a_delta_to_an_agent_older_than_deltas_says_so_and_the_whole_set_goes() {
    // The script serves `/v1/apply` only, as an agent older than deltas does.
    let script = Script::new(vec![applied("whole")]);
    let addr = script.clone().serve().await;
    let base = request(1);
    let target = ApplyRequest::new(
        3,
        "leader-0",
        2,
        base.files
            .clone()
            .with("maps/new.map", "a b\n")
            .expect("set"),
    )
    .expect("request");
    let delta = haptic_agent_client::DeltaRequest::between(&base.files, &base.checksum, &target);
    match client(4).apply_delta(&url(addr), &delta).await {
        Err(Error::DeltasUnsupported { status }) => assert_eq!(status, 404),
        other => panic!("expected DeltasUnsupported, got {other:?}"),
    }
    assert_eq!(script.requests.load(Ordering::SeqCst), 0, "not retried");
    let report = client(4)
        .apply(&url(addr), &target)
        .await
        .expect("the whole set");
    assert_eq!(report.checksum, "whole");
}
