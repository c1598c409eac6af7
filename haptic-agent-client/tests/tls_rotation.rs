//! The controller's side of the channel's TLS rotates without a restart: its client
//! certificate (what `ResolvesClientCert` hands rustls at each handshake) and the CA it verifies
//! agents with are read again when their files change; a half-rotated pair is not used.

use haptic_agent_client::tls::{PairFiles, RotatingPair, RotatingServerCa};
use haptic_testkit::TestCa;
use rustls::{
    client::danger::ServerCertVerifier as _,
    pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject as _},
};

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).expect("a PEM certificate")
}

#[test]
fn the_client_certificate_is_read_again_when_its_files_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = PairFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    let (first, second) = (
        TestCa::new("first").expect("ca"),
        TestCa::new("second").expect("ca"),
    );
    let (cert, key) = first.client("haptic-controller").expect("client");
    std::fs::write(&files.cert, &cert).expect("cert");
    std::fs::write(&files.key, &key).expect("key");
    let pair = RotatingPair::new(&files).expect("loads");
    assert_eq!(pair.current().cert[0], der(&cert));

    // Rotated in place, key first, as a Secret volume may show it for a moment.
    let (cert2, key2) = second.client("haptic-controller").expect("client");
    std::fs::write(&files.key, &key2).expect("key");
    assert_eq!(
        pair.current().cert[0],
        der(&cert),
        "a key without its certificate is not used: the old pair stays"
    );
    std::fs::write(&files.cert, &cert2).expect("cert");
    assert_eq!(
        pair.current().cert[0],
        der(&cert2),
        "the rotated pair is used"
    );
}

#[test]
fn the_agent_ca_is_read_again_and_the_agent_name_is_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca_file = dir.path().join("ca.crt");
    let (first, second) = (
        TestCa::new("first").expect("ca"),
        TestCa::new("second").expect("ca"),
    );
    std::fs::write(&ca_file, &first.pem).expect("ca");
    let by_name =
        RotatingServerCa::new(&ca_file, Some("haptic-agent.haptic-system.svc")).expect("loads");
    let by_ip = RotatingServerCa::new(&ca_file, None).expect("loads");
    let pod_ip = ServerName::try_from("10.0.0.7").expect("ip");
    let verify = |verifier: &RotatingServerCa, cert: &str| {
        verifier.verify_server_cert(&der(cert), &[], &pod_ip, &[], UnixTime::now())
    };

    let (named, _) = first
        .server(&["haptic-agent.haptic-system.svc".to_owned()])
        .expect("server");
    let (for_ip, _) = first.server(&["10.0.0.7".to_owned()]).expect("server");
    let (other_ip, _) = first.server(&["10.0.0.8".to_owned()]).expect("server");
    assert!(
        verify(&by_name, &named).is_ok(),
        "the DNS name every agent carries"
    );
    assert!(verify(&by_name, &for_ip).is_err(), "not the name asked for");
    assert!(verify(&by_ip, &for_ip).is_ok(), "the pod IP connected to");
    assert!(
        verify(&by_ip, &other_ip).is_err(),
        "another pod's certificate"
    );

    // The CA rotated: certificates of the new CA verify, the old CA's no longer.
    let (named2, _) = second
        .server(&["haptic-agent.haptic-system.svc".to_owned()])
        .expect("server");
    assert!(verify(&by_name, &named2).is_err());
    std::fs::write(&ca_file, &second.pem).expect("ca");
    assert!(verify(&by_name, &named2).is_ok(), "the rotated CA is used");
    assert!(verify(&by_name, &named).is_err(), "the old CA no longer is");
}
