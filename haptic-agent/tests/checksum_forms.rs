//! The two forms of the set checksum against a real agent and HAProxy: a controller older than
//! the second form sends and expects the first (64 hex digits); a newer one sends the second
//! (`v2-` and 64 hex digits). The agent checks and records each set's checksum in the form
//! it came in, verifies it in that form from disk after a restart, and takes a delta whose
//! base is in one form and whose result is in the other (a rolling upgrade of the
//! controllers, either way).

mod common;

use common::{Backend, TestAgent, await_body, client, config, free_port};
use haptic_agent_client::{ApplyRequest, DeltaRequest, Error, FileSet, Form, Outcome};

fn request_as(form: Form, generation: u64, files: FileSet) -> ApplyRequest {
    let checksum = files.checksum_as(form);
    ApplyRequest::with_checksum(1, "leader-0", generation, files, checksum).expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_forms_are_checked_recorded_and_verified_in_their_own_form() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let backends = [("a", a.addr), ("b", b.addr)];
    let client = client();

    // 1. An older controller's whole set: the first form.
    let agent = TestAgent::start(dir.path()).await;
    let first = request_as(Form::V1, 1, config(port, "a", &backends));
    assert_eq!(Form::of(&first.checksum), Some(Form::V1));
    let report = client.apply(&agent.url, &first).await.expect("v1 apply");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(report.checksum, first.checksum);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(first.checksum.as_str())
    );

    // A checksum of the right form that is not the files' is refused, in either form.
    for form in [Form::V1, Form::V2] {
        let files = config(port, "b", &backends);
        let wrong = config(port, "a", &backends).checksum_as(form);
        let forged = ApplyRequest::with_checksum(1, "leader-0", 2, files, wrong).expect("request");
        match client.apply(&agent.url, &forged).await {
            Err(Error::Rejected {
                status: 400,
                message,
            }) => {
                assert!(message.contains("checksum mismatch"), "{message}")
            }
            other => panic!("a wrong {form:?} checksum: {other:?}"),
        }
    }

    // 2. A newer controller's delta against it: base in the first form, result in the second.
    let second = request_as(Form::V2, 2, config(port, "b", &backends));
    let delta = DeltaRequest::between(&first.files, &first.checksum, &second);
    let report = client
        .apply_delta(&agent.url, &delta)
        .await
        .expect("v2 delta on a v1 base");
    assert_eq!(report.checksum, second.checksum);
    assert_eq!(await_body(port, "backend b").await, "backend b");
    agent.stop().await;

    // 3. Restarted: the live set verified from disk in the second form, and a base.
    let agent = TestAgent::start(dir.path()).await;
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(second.checksum.as_str())
    );
    assert_eq!(
        state.last_known_good_checksum.as_deref(),
        Some(first.checksum.as_str())
    );

    // 4. An older controller again (a rollback): a first-form delta on the second-form base.
    let third = request_as(Form::V1, 3, config(port, "a", &backends));
    let delta = DeltaRequest::between(&second.files, &second.checksum, &third);
    let report = client
        .apply_delta(&agent.url, &delta)
        .await
        .expect("v1 delta on a v2 base");
    assert_eq!(report.checksum, third.checksum);
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "backend a").await, "backend a");
    agent.stop().await;

    // 5. Restarted: verified in the first form, as recorded; and the same set in the other
    // form is another checksum, so it is applied (through the runtime API, nothing to do),
    // not answered `unchanged` under a name it was not sent with.
    let agent = TestAgent::start(dir.path()).await;
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(
        state.live_checksum.as_deref(),
        Some(third.checksum.as_str())
    );
    let same = request_as(Form::V2, 4, third.files.clone());
    let report = client.apply(&agent.url, &same).await.expect("same set, v2");
    assert_eq!(report.checksum, same.checksum);
    assert!(!report.reload, "{report:?}");
    let state = client.state(&agent.url).await.expect("state");
    assert_eq!(state.live_checksum.as_deref(), Some(same.checksum.as_str()));
    assert_eq!(await_body(port, "backend a").await, "backend a");
    agent.stop().await;
}
