//! Supervised mode and fan-out against real agents: HAProxy is restarted when it dies, and
//! one apply fans out to several agents with one typed result per pod.

mod common;

use std::time::Duration;

use common::*;
use haptic_agent_client::{Error, Outcome, Target};
use rustix::process::{Pid, Signal, kill_process};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_haproxy_is_restarted_on_the_live_set() {
    let serving = Serving::start(1).await;
    let Serving {
        agent,
        client,
        port,
        ..
    } = &serving;
    let port = *port;
    let master = client
        .state(&agent.url)
        .await
        .expect("state")
        .haproxy_pid
        .expect("a master pid");

    let pid = Pid::from_raw(i32::try_from(master).expect("pid")).expect("non-zero pid");
    kill_process(pid, Signal::KILL).expect("kill the master");

    // The supervisor notices and starts a new master on the same live set.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let restarted = loop {
        let state = client.state(&agent.url).await.expect("state");
        if let Some(pid) = state.haproxy_pid
            && pid != master
            && !state.worker_pids.is_empty()
        {
            break pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "HAProxy was not restarted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(restarted, master);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    serving.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_reaches_every_agent_and_reports_a_fenced_pod() {
    let a = Backend::start("a").await;
    let dirs: Vec<_> = (0..3)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let mut agents = Vec::new();
    for dir in &dirs {
        agents.push(TestAgent::start(dir.path()).await);
    }
    let client = client();
    // The third pod already accepted epoch 9 from a newer leader.
    let newer = request(9, "newer", 1, config(free_port(), "a", &[("a", a.addr)]));
    client
        .apply(&agents[2].url, &newer)
        .await
        .expect("newer leader");

    // Every agent's HAProxy binds the same port, as pods would in their own networks;
    // HAProxy's listeners use SO_REUSEPORT.
    let port = free_port();
    let set = request(5, "stale", 1, config(port, "a", &[("a", a.addr)]));
    let targets: Vec<Target> = agents
        .iter()
        .enumerate()
        .map(|(i, agent)| Target {
            name: format!("pod-{i}"),
            url: agent.url.clone(),
        })
        .collect();
    let results = client.fan_out(&targets, &set).await;
    assert_eq!(results.len(), 3);
    for result in &results[..2] {
        let report = result.result.as_ref().expect("applied");
        assert_eq!(report.outcome, Outcome::Applied);
        assert_eq!(report.checksum, set.checksum);
    }
    assert_eq!(results[2].target.name, "pod-2");
    assert!(matches!(
        results[2].result,
        Err(Error::Fenced { fence: 9, epoch: 5 })
    ));
    let state = client.state(&agents[2].url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(newer.checksum.as_str())
    );
    assert_eq!(await_body(port, "backend a").await, "backend a");
    for agent in agents {
        agent.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_haproxy_lets_the_requests_in_flight_finish() {
    // A backend that takes a moment to answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let slow = listener.local_addr().expect("addr");
    let (entered_tx, entered) = tokio::sync::oneshot::channel::<()>();
    let entered_tx = std::sync::Arc::new(std::sync::Mutex::new(Some(entered_tx)));
    let app = axum::Router::new().fallback(move || {
        let entered_tx = entered_tx.clone();
        async move {
            if let Some(tx) = entered_tx.lock().ok().and_then(|mut tx| tx.take()) {
                let _ = tx.send(());
            }
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "slow answer"
        }
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = TestAgent::start(dir.path()).await;
    let port = free_port();
    client()
        .apply(
            &agent.url,
            &request(1, "leader-0", 1, config(port, "slow", &[("slow", slow)])),
        )
        .await
        .expect("applied");
    let in_flight = tokio::spawn(async move {
        traffic_client()
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .map(|response| response.status().as_u16())
    });
    tokio::time::timeout(Duration::from_secs(10), entered)
        .await
        .expect("the request reached the backend")
        .expect("entered");
    // SIGUSR1 first: the request in flight is answered before HAProxy exits.
    agent.agent.supervisor().expect("supervised").stop().await;
    let status = in_flight.await.expect("task");
    assert!(matches!(status, Ok(200)), "{status:?}");
    agent.stop().await;
}
