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

/// A CA and a certificate for 127.0.0.1 and localhost signed by it: (CA PEM, cert PEM, key PEM).
fn issue() -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("server params")
        .signed_by(&key, &issuer)
        .expect("server cert");
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_serves_tls_itself_and_picks_up_a_rotated_certificate() {
    let root = tempfile::tempdir().expect("tempdir");
    let (ca1, cert1, key1) = issue();
    let (cert, key) = (root.path().join("tls.crt"), root.path().join("tls.key"));
    std::fs::write(&cert, &cert1).expect("cert");
    std::fs::write(&key, &key1).expect("key");
    let data = root.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    let mut config = haptic_agent::AgentConfig::new(&data, TOKEN)
        .with_listen(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin())
        .with_supervise(true);
    config.tls = Some(haptic_agent::tls::TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: None,
    });
    let agent = TestAgent::start_with(config).await;
    let mut https = agent.url.clone();
    https.set_scheme("https").expect("https");
    let trusting = |ca: &str| {
        AgentClient::new(
            ClientConfig::new(TOKEN)
                .with_ca_pem(ca.as_bytes().to_vec())
                .with_retries(1, Duration::from_millis(10)),
        )
        .expect("client")
    };

    let backend = Backend::start("a").await;
    let port = free_port();
    let set = request(1, "leader-0", 1, config_for(port, &backend));
    let report = trusting(&ca1)
        .apply(&https, &set)
        .await
        .expect("over https");
    assert_eq!(report.outcome, Outcome::Applied);
    // Plain HTTP is not served.
    assert!(client().state(&agent.url).await.is_err());

    // Rotated in place (as a mounted Secret is): the next connection gets the new one.
    let (ca2, cert2, key2) = issue();
    assert!(matches!(
        trusting(&ca2).state(&https).await,
        Err(Error::Transport { .. })
    ));
    std::fs::write(&key, &key2).expect("key");
    std::fs::write(&cert, &cert2).expect("cert");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match trusting(&ca2).state(&https).await {
            Ok(state) => {
                assert_eq!(state.live_checksum.as_deref(), Some(set.checksum.as_str()));
                break;
            }
            Err(error) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the rotated certificate was never served: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert!(
        trusting(&ca1).state(&https).await.is_err(),
        "the old CA no longer fits"
    );
    agent.stop().await;
}

fn config_for(port: u16, backend: &Backend) -> haptic_agent_client::FileSet {
    config(port, "a", &[("a", backend.addr)])
}

/// A client of `agent_url` trusting `ca` for the agent, presenting `identity` (none: no client
/// certificate), with `token`.
fn mtls_client(
    dir: &std::path::Path,
    ca: &str,
    identity: Option<(String, String)>,
    token: &str,
) -> AgentClient {
    use haptic_agent_client::tls::{PairFiles, client_config};
    // Each client its own files: the pairs are read from disk like the controller's.
    let unique = uuid_like();
    let ca_file = dir.join(format!("trust-{unique}.crt"));
    std::fs::write(&ca_file, ca).expect("ca");
    let pair = identity.map(|(cert, key)| {
        let files = PairFiles {
            cert: dir.join(format!("client-{unique}.crt")),
            key: dir.join(format!("client-{unique}.key")),
        };
        std::fs::write(&files.cert, cert).expect("cert");
        std::fs::write(&files.key, key).expect("key");
        files
    });
    let tls = client_config(&ca_file, None, pair.as_ref()).expect("client TLS");
    AgentClient::new(
        ClientConfig::new(token)
            .with_retries(1, Duration::from_millis(10))
            .with_tls(tls),
    )
    .expect("client")
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::SeqCst).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_other_cas_and_picks_up_a_rotated_client_ca_and_token() {
    use haptic_testkit::TestCa;
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path();
    let (ours, theirs) = (
        TestCa::new("ours").expect("ca"),
        TestCa::new("theirs").expect("ca"),
    );
    let (cert, key) = ours.server(&["127.0.0.1".to_owned()]).expect("server");
    let files = haptic_agent::tls::TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        client_ca: Some(dir.join("client-ca.crt")),
    };
    std::fs::write(&files.cert, cert).expect("cert");
    std::fs::write(&files.key, key).expect("key");
    std::fs::write(files.client_ca.as_ref().expect("ca"), &ours.pem).expect("client ca");
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    let mut config = haptic_agent::AgentConfig::new(&data, TOKEN)
        .with_listen(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .with_haproxy_bin(haproxy_bin());
    config.tls = Some(files.clone());
    config.token_file = Some(token_file.clone());
    let probes = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    config.probe_listen = Some(probes);
    let agent = TestAgent::start_with(config).await;
    let mut https = agent.url.clone();
    https.set_scheme("https").expect("https");

    // The kubelet's probes need no certificate: on their own plain port, open routes only.
    let plain = reqwest::Client::builder()
        .tls_backend_preconfigured(
            haptic_agent_client::tls::client_config(
                files.client_ca.as_ref().expect("ca"),
                None,
                None,
            )
            .expect("tls"),
        )
        .build()
        .expect("plain client");
    // It binds as the server starts: await it (bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let healthz = loop {
        match plain.get(format!("http://{probes}/healthz")).send().await {
            Ok(answer) => break answer,
            Err(error) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "probe port: {error}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(healthz.status(), 200);
    let state = plain
        .get(format!("http://{probes}/v1/state"))
        .send()
        .await
        .expect("probe port answers");
    assert_eq!(state.status(), 404, "the API is not on the probe port");

    // Our client certificate and token: served.
    let controller = || {
        mtls_client(
            dir,
            &ours.pem,
            Some(ours.client("controller").expect("client")),
            TOKEN,
        )
    };
    controller()
        .state(&https)
        .await
        .expect("our client is served");
    // A client certificate from another CA, or none: refused in the handshake, before any
    // token is looked at (a transport failure, not a 401).
    let stranger = mtls_client(
        dir,
        &ours.pem,
        Some(theirs.client("controller").expect("client")),
        TOKEN,
    );
    assert!(
        matches!(stranger.state(&https).await, Err(Error::Transport { .. })),
        "a client certificate from another CA is refused"
    );
    let anonymous = mtls_client(dir, &ours.pem, None, TOKEN);
    assert!(matches!(
        anonymous.state(&https).await,
        Err(Error::Transport { .. })
    ));

    // The token rotated in its file: the new one is used from the next request, the old one
    // refused, no restart.
    let rotated = "rotated-token-9876543210";
    std::fs::write(&token_file, rotated).expect("token");
    let with_new = mtls_client(
        dir,
        &ours.pem,
        Some(ours.client("controller").expect("client")),
        rotated,
    );
    with_new
        .state(&https)
        .await
        .expect("the rotated token is accepted");
    assert!(matches!(
        controller().state(&https).await,
        Err(Error::Unauthorized)
    ));

    // The client CA rotated to another CA: its certificates are now the ones served.
    std::fs::write(files.client_ca.as_ref().expect("ca"), &theirs.pem).expect("client ca");
    let successor = mtls_client(
        dir,
        &ours.pem,
        Some(theirs.client("controller").expect("client")),
        rotated,
    );
    successor
        .state(&https)
        .await
        .expect("a certificate of the rotated CA is served");
    let old = mtls_client(
        dir,
        &ours.pem,
        Some(ours.client("controller").expect("client")),
        rotated,
    );
    assert!(matches!(
        old.state(&https).await,
        Err(Error::Transport { .. })
    ));
    agent.stop().await;
}

#[test]
fn the_binary_refuses_to_start_without_mutual_tls_unless_told_plain_http() {
    let root = tempfile::tempdir().expect("tempdir");
    let token = root.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_haptic-agent"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", free_port()))
        .arg("--token-file")
        .arg(&token)
        .arg("--data-dir")
        .arg(root.path().join("data"))
        .env("RUST_LOG", "error")
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--client-ca") && stderr.contains("--insecure-plain-http"),
        "{stderr}"
    );
}
