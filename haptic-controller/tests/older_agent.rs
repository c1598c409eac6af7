//! A controller that sends the checksum's second form, in front of an agent older than it (a
//! rolling upgrade that reaches the controllers first): the real controller and a real agent
//! with its HAProxy, over plain HTTP, with a stand-in between them that answers what an agent
//! before the second form answered any apply whose checksum is in it (400, the words of its
//! decoding), and passes everything else on untouched. The pod must get whole sets with the
//! first form's checksum, route, count as up to date (no apply repeated for nothing), and keep
//! following changes.

mod common;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::State,
    http::{HeaderMap, Method, StatusCode, Uri},
    response::{IntoResponse, Response},
};
use common::*;

#[derive(Clone)]
struct Stand {
    agent: String,
    http: reqwest::Client,
    /// Applies refused for their second-form checksum, and applies passed on.
    refused: Arc<AtomicUsize>,
    passed: Arc<AtomicUsize>,
}

/// What an agent before the second form answers: its wire decoding checks the checksum (a
/// delta's `base` and `checksum` as 64 lowercase hex digits; a whole set's against its files'
/// first form), and its server answers 400 `bad_request` with the error's words.
async fn older_agent(
    State(stand): State<Stand>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let apply = uri.path().starts_with("/v1/apply");
    if apply {
        assert!(
            headers.get("content-encoding").is_none(),
            "this stand-in reads no compressed body; the test's sets are small"
        );
        let json: serde_json::Value = serde_json::from_slice(&body).expect("an apply is JSON");
        let checksum = json["checksum"].as_str().unwrap_or_default().to_owned();
        if checksum.starts_with("v2-") {
            stand.refused.fetch_add(1, Ordering::SeqCst);
            let message = format!(
                "checksum mismatch: request says {checksum}, files hash to not 64 lowercase hex digits"
            );
            let body = serde_json::json!({"error": "bad_request", "message": message});
            return (
                StatusCode::BAD_REQUEST,
                [("content-type", "application/json")],
                body.to_string(),
            )
                .into_response();
        }
        stand.passed.fetch_add(1, Ordering::SeqCst);
    }
    let mut request = stand.http.request(
        method,
        format!(
            "http://{}{}",
            stand.agent,
            uri.path_and_query().map_or("/", |p| p.as_str())
        ),
    );
    for name in ["authorization", "content-type", "content-encoding"] {
        if let Some(value) = headers.get(name) {
            request = request.header(name, value);
        }
    }
    match request.body(body).send().await {
        Ok(answer) => {
            let status = answer.status();
            let content_type = answer.headers().get("content-type").cloned();
            let bytes = answer.bytes().await.unwrap_or_default();
            let mut response = (status, bytes).into_response();
            if let Some(content_type) = content_type {
                response.headers_mut().insert("content-type", content_type);
            }
            response
        }
        Err(error) => (StatusCode::BAD_GATEWAY, error.to_string()).into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_older_than_the_second_form_gets_whole_first_form_sets() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&spec(agent_port, http_port)).await;
    // The real agent at 127.0.0.11; the pod, and the stand-in, at 127.0.0.2.
    let agent = Agent::start_plain_unregistered(&cluster, 10, agent_port, http_port).await;
    let pod_ip = "127.0.0.2";
    let stand = Stand {
        agent: agent.agent_addr(),
        http: reqwest::Client::new(),
        refused: Arc::default(),
        passed: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind(format!("{pod_ip}:{agent_port}"))
        .await
        .expect("the stand-in binds the pod's agent port");
    let app = axum::Router::new()
        .fallback(older_agent)
        .with_state(stand.clone());
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("stand-in serves");
    });
    register_pod(&cluster, "haproxy-old", pod_ip).await;
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    cluster.service("web-a", a.addr).await;
    cluster.service("web-b", b.addr).await;
    let controller = Controller::start_plain(&cluster, "controller-1").await;

    // Routes, through whole sets with the first form's checksum.
    cluster.ingress("shop", "shop.example", "/", "web-a").await;
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let live = eventually(
        "the agent runs a first-form set",
        Duration::from_secs(30),
        || async {
            let state = agent.client().state(&plain_url(&agent)).await.ok()?;
            state
                .live_checksum
                .filter(|c| c.len() == 64 && !c.starts_with("v2-"))
        },
    )
    .await;
    assert!(
        stand.refused.load(Ordering::SeqCst) >= 1,
        "a second-form apply was tried first"
    );
    assert!(
        controller.logs().contains("refused a second-form checksum"),
        "the fallback is logged"
    );

    // Up to date: the status says the pod runs the desired set (a pod counted as not running
    // it would be sent it again and again; the status's `Live` and the scheduler's dispatch
    // ask the same question).
    eventually("status Deployed 1/1", Duration::from_secs(30), || async {
        let status = cluster.htc_status().await?;
        let deployed = status["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Deployed")?
            .clone();
        (deployed["status"] == "True").then_some(())
    })
    .await;
    let (refused, passed) = (
        stand.refused.load(Ordering::SeqCst),
        stand.passed.load(Ordering::SeqCst),
    );
    let state = agent
        .client()
        .state(&plain_url(&agent))
        .await
        .expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(live.as_str()));

    // A change follows, again as a whole first-form set.
    cluster.ingress("shop", "shop.example", "/", "web-b").await;
    agent
        .await_route("shop.example", "/", (200, "backend b"))
        .await;
    assert_eq!(
        stand.refused.load(Ordering::SeqCst),
        refused,
        "never the second form again"
    );
    assert!(stand.passed.load(Ordering::SeqCst) > passed);
    let state = agent
        .client()
        .state(&plain_url(&agent))
        .await
        .expect("state");
    let now = state.live_checksum.expect("a live set");
    assert!(now.len() == 64 && now != live, "{now}");
    server.abort();
}

/// The agent's own URL over plain HTTP.
fn plain_url(agent: &Agent) -> reqwest::Url {
    reqwest::Url::parse(&format!("http://{}/", agent.agent_addr())).expect("url")
}
