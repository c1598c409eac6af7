//! The agent as a library and its limits: `Agent::apply` holds a caller to the checksum rule,
//! a hanging HAProxy binary does not hang the agent, and the client waits longer than the
//! agent may work.

mod common;

use std::{os::unix::fs::PermissionsExt as _, time::Duration};

use common::*;
use haptic_agent::{Agent, AgentConfig, agent};
use haptic_agent_client::{ApplyRequest, ClientConfig, FileSet};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_refuses_a_checksum_that_is_not_the_sets_and_writes_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let agent = Agent::open(AgentConfig::new(&data, TOKEN).with_haproxy_bin(haproxy_bin()))
        .await
        .expect("open");
    let files = FileSet::new().with("haproxy.cfg", "global\n").expect("set");
    let before = listing(root.path());
    for checksum in [
        "../../escape".to_owned(),
        "éa".repeat(11),
        "A".repeat(64),
        "0".repeat(64),
        files.checksum().to_uppercase(),
    ] {
        let request = ApplyRequest {
            epoch: 1,
            leader: "l".into(),
            generation: 1,
            checksum: checksum.clone(),
            files: files.clone(),
        };
        match agent.apply(request).await {
            Err(agent::Error::BadRequest(_)) => {}
            other => panic!("{checksum:?}: expected BadRequest, got {other:?}"),
        }
    }
    assert_eq!(listing(root.path()), before, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_haproxy_binary_that_never_answers_does_not_hang_the_agent() {
    let root = tempfile::tempdir().expect("tempdir");
    let bin = root.path().join("haproxy");
    std::fs::write(&bin, "#!/bin/sh\nexec sleep 600\n").expect("script");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut config = AgentConfig::new(root.path().join("data"), TOKEN).with_haproxy_bin(&bin);
    config.check_timeout = Duration::from_secs(1);
    // Bounded so that a hang fails the test instead of stalling the suite.
    let agent = tokio::time::timeout(Duration::from_secs(60), Agent::open(config))
        .await
        .expect("opening does not wait for `haproxy -v` forever")
        .expect("opens");
    assert_eq!(agent.state().await.haproxy_version, None);
}

#[test]
fn the_client_waits_longer_than_the_agent_may_work_on_an_apply() {
    let agent = AgentConfig::new("/data", TOKEN);
    let client = ClientConfig::new(TOKEN);
    assert!(
        client.request_timeout > agent.apply_time_limit(),
        "{:?} <= {:?}",
        client.request_timeout,
        agent.apply_time_limit()
    );
    assert!(agent.apply_time_limit() >= agent.check_timeout + agent.reload_timeout);
}
