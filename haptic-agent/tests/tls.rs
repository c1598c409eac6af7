//! The client over https (rustls with ring): HAProxy terminates TLS with a certificate from a
//! test CA in front of a real agent; the client trusts that CA and nothing else.

mod common;

use std::{process::Stdio, time::Duration};

use common::*;
use haptic_agent_client::{AgentClient, ClientConfig, Error, Outcome};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_applies_over_https_trusting_only_the_given_ca() {
    let root = tempfile::tempdir().expect("tempdir");

    // A CA, and a certificate for 127.0.0.1 and localhost signed by it.
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().expect("server key");
    let server_cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("server params")
        .signed_by(&server_key, &issuer)
        .expect("server cert");
    let pem = root.path().join("server.pem");
    std::fs::write(
        &pem,
        format!("{}{}", server_cert.pem(), server_key.serialize_pem()),
    )
    .expect("write pem");

    let data = root.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    let agent = TestAgent::start(&data).await;
    let agent_addr = format!(
        "{}:{}",
        agent.url.host_str().expect("host"),
        agent.url.port().expect("port")
    );

    // HAProxy as the TLS terminator in front of the agent.
    let tls_port = free_port();
    let cfg = root.path().join("tls.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n  nbthread 1\ndefaults\n  mode http\n  timeout connect 2s\n  timeout client 30s\n  timeout server 30s\n\
             frontend tls\n  bind 127.0.0.1:{tls_port} ssl crt {pem}\n  default_backend agent\n\
             backend agent\n  server agent {agent_addr}\n",
            pem = pem.display()
        ),
    )
    .expect("write cfg");
    let mut terminator = Command::new(haproxy_bin())
        .arg("-db")
        .arg("-f")
        .arg(&cfg)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the TLS terminator");

    let https = reqwest::Url::parse(&format!("https://localhost:{tls_port}/")).expect("url");
    let trusting = AgentClient::new(
        ClientConfig::new(TOKEN)
            .with_ca_pem(ca_cert.pem())
            .with_retries(20, Duration::from_millis(50)),
    )
    .expect("client with CA");
    let port = free_port();
    let a = Backend::start("a").await;
    let set = request(1, "leader-tls", 1, config(port, "a", &[("a", a.addr)]));
    // Retries cover the moment HAProxy takes to bind.
    let report = trusting
        .apply(&https, &set)
        .await
        .expect("apply over https");
    assert_eq!(report.outcome, Outcome::Applied);
    assert_eq!(await_body(port, "backend a").await, "backend a");

    let untrusting = AgentClient::new(ClientConfig::new(TOKEN).with_retries(1, Duration::ZERO))
        .expect("client without CA");
    match untrusting.state(&https).await {
        Err(Error::Transport { source, .. }) => {
            let chain = format!("{source:?}");
            assert!(
                chain.contains("UnknownIssuer") || chain.contains("certificate"),
                "{chain}"
            );
        }
        other => panic!("a certificate from an unknown CA must be refused, got {other:?}"),
    }

    terminator.kill().await.expect("stop terminator");
    agent.stop().await;
}
