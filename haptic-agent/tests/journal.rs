//! The apply journal over HTTP: every answered apply is recorded (applied, unchanged, fenced,
//! invalid) with its epoch, leader, generation and checksum, behind the token, and it survives
//! a restart of the agent on the same data directory.

mod common;

use common::*;
use haptic_agent::journal::{JOURNAL_PATH, JournalView};

async fn fetch(url: &reqwest::Url, token: Option<&str>) -> reqwest::Response {
    let http = traffic_client();
    let mut request = http.get(url.join(JOURNAL_PATH).expect("journal url"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.expect("journal answered")
}

async fn query(url: &reqwest::Url, query: &str) -> reqwest::Response {
    let mut url = url.join(JOURNAL_PATH).expect("journal url");
    url.set_query(Some(query));
    traffic_client()
        .get(url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("journal answered")
}

async fn journal_query(url: &reqwest::Url, with: &str) -> JournalView {
    let response = query(url, with).await;
    assert_eq!(response.status(), 200);
    serde_json::from_slice(&response.bytes().await.expect("journal body")).expect("a JournalView")
}

async fn journal(url: &reqwest::Url) -> JournalView {
    let response = fetch(url, Some(TOKEN)).await;
    assert_eq!(response.status(), 200);
    let body = response.bytes().await.expect("journal body");
    serde_json::from_slice(&body).expect("a JournalView")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answered_apply_is_journaled_and_survives_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let backend = Backend::start("a").await;
    let port = free_port();
    let agent = TestAgent::start(&data).await;
    let client = client();
    let good = config(port, "a", &[("a", backend.addr)]);
    let checksum = good.checksum();

    client
        .apply(&agent.url, &request(5, "leader-a", 1, good.clone()))
        .await
        .expect("applied");
    client
        .apply(&agent.url, &request(5, "leader-a", 2, good.clone()))
        .await
        .expect("unchanged");
    let fenced = client
        .apply(&agent.url, &request(4, "leader-b", 9, good.clone()))
        .await;
    assert!(fenced.is_err(), "epoch 4 below fence 5 must be refused");
    let broken = rewrite(&good, "haproxy.cfg", |cfg| {
        format!("{cfg}\nnot-a-keyword\n")
    });
    let invalid = client
        .apply(&agent.url, &request(6, "leader-c", 1, broken.clone()))
        .await;
    assert!(invalid.is_err(), "a set haproxy -c refuses is not applied");

    assert_eq!(fetch(&agent.url, None).await.status(), 401);
    let view = journal(&agent.url).await;
    let got: Vec<_> = view
        .entries
        .iter()
        .map(|e| {
            (
                e.epoch,
                e.leader.as_str(),
                e.generation,
                e.outcome.as_str(),
                e.live,
                e.fence,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (5, "leader-a", 1, "applied", true, None),
            (5, "leader-a", 2, "unchanged", true, None),
            (4, "leader-b", 9, "fenced", false, Some(5)),
            (6, "leader-c", 1, "invalid", false, None),
        ]
    );
    assert_eq!(view.entries[0].checksum, checksum);
    assert_eq!(view.entries[3].checksum, broken.checksum());
    assert!(view.entries.windows(2).all(|w| w[0].seq < w[1].seq));
    assert!(view.entries.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));

    // A reader that polls asks for what it has not seen: entries after a seq, or answered at
    // or after a time; a value that is not a number is refused, naming the parameter.
    let seqs = |view: JournalView| view.entries.iter().map(|e| e.seq).collect::<Vec<_>>();
    let all = seqs(view.clone());
    assert_eq!(seqs(journal_query(&agent.url, "after_seq=0").await), all);
    assert_eq!(
        seqs(journal_query(&agent.url, &format!("after_seq={}", all[1])).await),
        all[2..]
    );
    assert_eq!(
        seqs(journal_query(&agent.url, &format!("after_seq={}", all[3])).await),
        [] as [u64; 0]
    );
    let third_at = view.entries[2].at_ms;
    let since = journal_query(&agent.url, &format!("since_ms={third_at}")).await;
    assert!(since.entries.iter().all(|e| e.at_ms >= third_at));
    assert_eq!(
        seqs(since),
        view.entries
            .iter()
            .filter(|e| e.at_ms >= third_at)
            .map(|e| e.seq)
            .collect::<Vec<_>>()
    );
    let both = journal_query(
        &agent.url,
        &format!("since_ms={}&after_seq={}", view.entries[0].at_ms, all[2]),
    )
    .await;
    assert_eq!(seqs(both), all[3..]);
    let refused = query(&agent.url, "after_seq=last").await;
    assert_eq!(refused.status(), 400);
    let body = refused.text().await.expect("error body");
    assert!(body.contains("after_seq"), "{body}");
    agent.stop().await;

    // The same data directory after a restart: the record is still there and goes on.
    let agent = TestAgent::start(&data).await;
    client
        .apply(&agent.url, &request(7, "leader-c", 1, good.clone()))
        .await
        .expect("applied after the restart");
    let view = journal(&agent.url).await;
    assert_eq!(view.entries.len(), 5);
    let last = view.entries.last().expect("entry");
    assert_eq!((last.seq, last.epoch, last.live), (5, 7, true));
    assert_eq!(view.unpersisted, 0);
    agent.stop().await;
}
