//! The agent's own limits against clients without the token: a connection cap, a header
//! (and idle) deadline, a body deadline; and the Content-Encoding matched case-insensitively.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::*;
use haptic_agent::AgentConfig;
use haptic_agent_client::protocol::{APPLY_PATH, encode_apply};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

fn settings(dir: &std::path::Path) -> AgentConfig {
    AgentConfig::new(dir, TOKEN)
        .with_listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true)
}

fn addr(agent: &TestAgent) -> String {
    format!(
        "{}:{}",
        agent.url.host_str().expect("host"),
        agent.url.port().expect("port")
    )
}

/// Reads until the agent closes the connection (or `bound` passes: a panic); returns what
/// it sent.
async fn read_until_closed(stream: &mut TcpStream, bound: Duration) -> String {
    let mut seen = Vec::new();
    let read = tokio::time::timeout(bound, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the agent did not close the connection within {bound:?}"
    );
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_at_the_header_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = settings(dir.path());
    config.header_read_timeout = Duration::from_secs(1);
    let agent = TestAgent::start_with(config).await;

    let mut silent = TcpStream::connect(addr(&agent)).await.expect("connect");
    assert_eq!(
        read_until_closed(&mut silent, Duration::from_secs(10)).await,
        ""
    );

    // Half a request line, never finished.
    let mut slow = TcpStream::connect(addr(&agent)).await.expect("connect");
    slow.write_all(b"GET /healthz HT").await.expect("write");
    read_until_closed(&mut slow, Duration::from_secs(10)).await;

    // A kept-alive connection idle after its request.
    let mut idle = TcpStream::connect(addr(&agent)).await.expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        .await
        .expect("write");
    let answer = read_until_closed(&mut idle, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_and_applies_go_through_once_they_leave() {
    let backend = Backend::start("a").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = settings(dir.path());
    settings.max_connections = 4;
    let agent = TestAgent::start_with(settings).await;

    let mut hogs = Vec::new();
    for _ in 0..4 {
        hogs.push(TcpStream::connect(addr(&agent)).await.expect("connect"));
    }
    // Accepted after the four (in order): over the cap, closed without an answer.
    let mut over = TcpStream::connect(addr(&agent)).await.expect("connect");
    let _ = over
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        .await;
    assert_eq!(
        read_until_closed(&mut over, Duration::from_secs(5)).await,
        ""
    );

    drop(hogs);
    let port = free_port();
    let set = request(1, "leader-0", 1, config(port, "a", &[("a", backend.addr)]));
    let report = client().apply(&agent.url, &set).await.expect("applied");
    assert_eq!(report.outcome, haptic_agent_client::Outcome::Applied);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_is_408() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = settings(dir.path());
    config.body_timeout = Duration::from_secs(1);
    let agent = TestAgent::start_with(config).await;
    let mut stream = TcpStream::connect(addr(&agent)).await.expect("connect");
    stream
        .write_all(
            format!(
                "POST {APPLY_PATH} HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {TOKEN}\r\n\
                 Content-Type: application/json\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n{{\"epoch\""
            )
            .as_bytes(),
        )
        .await
        .expect("write");
    let answer = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_encoding_is_matched_case_insensitively() {
    let serving = Serving::start(1).await;
    let body = encode_apply(&serving.live.to_wire(), 0);
    assert!(body.gzip);
    let response = traffic_client()
        .post(serving.agent.url.join(APPLY_PATH).expect("url"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("content-encoding", "GZip")
        .body(body.bytes.clone())
        .send()
        .await
        .expect("sent");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"unchanged\""), "{text}");
    serving.agent.stop().await;
}
