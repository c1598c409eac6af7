//! One object's bad input stays that object's: TLS Secrets that cannot be served are left out
//! with a Warning on the Ingress, and a line the real `haproxy -c` refuses is traced to the
//! object that produced it, so that a render without it passes.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{haproxy, haproxy_check, reference_stores, section};
use haptic_render::{FileSet, ObjectRef, Renderer, Stores, functions::ssl_file, reference};
use serde_json::{Value as Json, json};

fn b64(text: &str) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, text)
}

fn tls_secret(namespace: &str, name: &str, crt: &str, key: &str) -> Json {
    json!({"apiVersion": "v1", "kind": "Secret",
           "metadata": {"namespace": namespace, "name": name}, "type": "kubernetes.io/tls",
           "data": {"tls.crt": b64(crt), "tls.key": b64(key)}})
}

fn tls_ingress(namespace: &str, name: &str, host: &str, secret: &str) -> Json {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
           "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{name}")},
           "spec": {"tls": [{"secretName": secret, "hosts": [host]}],
                    "rules": [{"host": host, "http": {"paths": [{"path": "/", "pathType": "Prefix",
                        "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}})
}

/// A self-signed P-256 certificate for `host` and its key, valid between the two years.
fn generated(host: &str, years: (i32, i32)) -> (String, String) {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = rcgen::CertificateParams::new(vec![host.to_owned()]).unwrap();
    params.not_before = rcgen::date_time_ymd(years.0, 1, 1);
    params.not_after = rcgen::date_time_ymd(years.1, 1, 1);
    (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
}

fn renderer() -> Renderer {
    Renderer::compile(&reference::template_set()).unwrap()
}

#[test]
fn mismatched_and_expired_certificates_are_left_out_with_a_warning_on_the_ingress() {
    let mut stores = reference_stores(0);
    let (good_crt, good_key) = generated("good.a.example", (2020, 4000));
    let (mismatch_crt, _) = generated("mismatch.a.example", (2020, 4000));
    let (_, other_key) = generated("other.a.example", (2020, 4000));
    let (expired_crt, expired_key) = generated("expired.a.example", (2020, 2021));
    let secrets = stores.get_mut("secrets").unwrap();
    for secret in [
        tls_secret("a", "good", &good_crt, &good_key),
        tls_secret("a", "mismatch", &mismatch_crt, &other_key),
        tls_secret("a", "expired", &expired_crt, &expired_key),
    ] {
        secrets.apply(&secret).unwrap();
    }
    let ingresses = stores.get_mut("ingresses").unwrap();
    for (name, secret) in [
        ("good", "good"),
        ("mismatch", "mismatch"),
        ("expired", "expired"),
    ] {
        ingresses
            .apply(&tls_ingress(
                "a",
                name,
                &format!("{name}.a.example"),
                secret,
            ))
            .unwrap();
    }
    let (files, requests) = renderer().render_all(&stores).unwrap();
    haproxy_check(&files);
    let pems: Vec<&str> = files
        .iter()
        .map(|(p, _)| p)
        .filter(|p| p.starts_with("ssl/"))
        .collect();
    let good = ssl_file("a", "good");
    assert_eq!(pems, [good.as_str()]);
    assert_eq!(
        files.text("maps/certs.list"),
        Some(format!("\n{good} good.a.example\n").as_str())
    );
    let warnings: Vec<(&str, &str)> = requests
        .events
        .iter()
        .filter(|e| e.reason == "TLSSecretUnusable")
        .map(|e| (e.name.as_deref().unwrap(), e.message.as_str()))
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].0 == "expired"
            && warnings[0].1.contains("TLS Secret expired")
            && warnings[0].1.contains("expired at"),
        "{warnings:?}"
    );
    assert!(
        warnings[1].0 == "mismatch"
            && warnings[1]
                .1
                .contains("TLS Secret mismatch is left out: tls.key does not match"),
        "{warnings:?}"
    );
}

/// `haproxy -c` on a set; HAProxy's output when it refuses it.
fn refused(files: &FileSet) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    files.write_to(dir.path()).unwrap();
    let output = Command::new(haproxy())
        .arg("-c")
        .arg("-C")
        .arg(dir.path())
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .output()
        .unwrap();
    (!output.status.success()).then(|| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .replace(&format!("{}/", dir.path().display()), "")
    })
}

/// The set with one file's text changed.
fn edited(files: &FileSet, path: &str, edit: impl Fn(&str) -> String) -> FileSet {
    let mut all: std::collections::BTreeMap<String, Vec<u8>> = files
        .iter()
        .map(|(path, bytes)| (path.to_owned(), bytes.to_vec()))
        .collect();
    let text = files.text(path).unwrap();
    all.insert(path.to_owned(), edit(text).into_bytes());
    FileSet::new(all)
}

fn object(store: &str, namespace: &str, name: &str) -> ObjectRef {
    ObjectRef {
        store: store.into(),
        namespace: namespace.into(),
        name: name.into(),
    }
}

#[test]
fn a_line_haproxy_refuses_is_traced_to_its_object_and_the_set_without_it_passes() {
    let stores: Stores = reference_stores(8);
    let renderer = renderer();
    let (files, _, provenance) = renderer.render_traced(&stores).unwrap();
    haproxy_check(&files);

    // Map lines are their Ingress's; a backend's lines its Service's; a certificate file its
    // Secret's; the fixed parts of haproxy.cfg nobody's.
    let map = files.text("maps/routes-prefix.map").unwrap();
    let line = map
        .lines()
        .position(|l| l.starts_with("app-00005."))
        .unwrap();
    assert_eq!(
        provenance.object_at(&files, "maps/routes-prefix.map", line + 1),
        Some(object("ingresses", "team-05", "app-00005"))
    );
    let cfg = files.text("haproxy.cfg").unwrap();
    let server = cfg
        .lines()
        .position(|l| l == format!("backend {}", section(&files, "team-03_app-00003_9090")))
        .unwrap()
        + 3;
    assert_eq!(
        provenance.object_at(&files, "haproxy.cfg", server),
        Some(object("services", "team-03", "app-00003"))
    );
    assert_eq!(provenance.object_at(&files, "haproxy.cfg", 1), None);
    assert_eq!(
        provenance.file_object(&ssl_file("team-04", "app-00004-tls")),
        Some(&object("secrets", "team-04", "app-00004-tls"))
    );

    // A certificate file HAProxy cannot load (what a key or chain the check accepts but
    // OpenSSL refuses would do): HAProxy names the file, the file names its Secret.
    let pem = ssl_file("team-04", "app-00004-tls");
    let bad_pem = edited(&files, &pem, |t| t.replace("MI", "xx"));
    let output = refused(&bad_pem).expect("haproxy refuses a corrupt certificate");
    let blamed = provenance.attribute(&bad_pem, &output);
    assert_eq!(
        blamed.first().map(|(o, _)| o),
        Some(&object("secrets", "team-04", "app-00004-tls")),
        "{output}"
    );
    // A crt-list line HAProxy refuses: the Ingress that wrote it.
    let bad_list = edited(&files, "maps/certs.list", |t| {
        t.replacen(&pem, &format!("{pem} [no-such-option]"), 1)
    });
    let output = refused(&bad_list).expect("haproxy refuses an unknown crt-list option");
    let blamed = provenance.attribute(&bad_list, &output);
    assert_eq!(
        blamed.first().map(|(o, _)| o),
        Some(&object("ingresses", "team-04", "app-00004")),
        "{output}"
    );
    // A server line HAProxy refuses: the Service of the backend.
    let bad_cfg = edited(&files, "haproxy.cfg", |t| {
        t.replacen("\n    server ", "\n    server-nope ", 1)
    });
    let output = refused(&bad_cfg).expect("haproxy refuses an unknown keyword");
    let first_backend = bad_cfg.text("haproxy.cfg").unwrap();
    let owner = first_backend
        .split("\nbackend ")
        .nth(2)
        .and_then(|b| b.split('_').nth(1))
        .unwrap()
        .to_owned();
    let blamed = provenance.attribute(&bad_cfg, &output);
    assert_eq!(
        blamed.first().map(|(o, _)| o.name.clone()),
        Some(owner),
        "{output}"
    );

    // Rendered without the blamed objects, the set passes and keeps everything else.
    let without = stores.excluding(&[
        object("secrets", "team-04", "app-00004-tls"),
        object("ingresses", "team-05", "app-00005"),
    ]);
    let (files_without, _, _) = renderer.render_traced(&without).unwrap();
    haproxy_check(&files_without);
    assert!(files_without.text(&pem).is_none());
    let list = files_without.text("maps/certs.list").unwrap();
    assert!(!list.contains("team-04_app-00004-tls"), "{list}");
    assert!(list.contains("team-00_app-00000-tls"), "{list}");
    let map = files_without.text("maps/routes-prefix.map").unwrap();
    assert!(!map.contains("app-00005."), "{map}");
    assert!(map.contains("app-00006."), "{map}");
    // The stores themselves are as they were.
    let (again, _, _) = renderer.render_traced(&stores).unwrap();
    assert_eq!(again.checksum_hex(), files.checksum_hex());
}
