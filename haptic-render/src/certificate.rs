//! TLS Secrets: whether a `kubernetes.io/tls` Secret holds what HAProxy can serve.
//!
//! A Secret is usable when its `tls.crt` is a chain of PEM certificates that each parse as
//! X.509 (x509-parser), its `tls.key` is one PEM private key that parses (PKCS#8, PKCS#1 RSA
//! or SEC1 EC; RSA of 2048 bits or more, ECDSA P-256 or P-384, Ed25519: what rustls' ring
//! provider loads, a subset of what HAProxy's OpenSSL loads) and whose public key is the
//! leaf certificate's (the first of the chain), and the leaf has not expired. Nothing here
//! looks for text markers: a certificate whose base64 is valid but whose contents are not
//! is as unusable as one that is missing.
//!
//! [`check_secret`] gives the verdict with the reason in words (what a Warning Event on the
//! Ingress that names the Secret says); the derived views cache it per version of the Secret,
//! so a render at 10k Ingresses parses no certificate that did not change.

use rustls::pki_types::pem::{self, PemObject as _};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tera::Value;
use x509_parser::prelude::{FromDer as _, X509Certificate};
use x509_parser::x509::SubjectPublicKeyInfo;

use crate::functions::b64decode;

/// Why a Secret's certificate cannot be served: the words a Warning Event carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// The Secret is not of type `kubernetes.io/tls`.
    #[error("the Secret is of type {0:?}, not kubernetes.io/tls")]
    NotTls(String),
    /// A data field is missing.
    #[error("the Secret has no {0}")]
    Missing(&'static str),
    /// A data field is not base64 of UTF-8 text.
    #[error("{0} is not base64 of PEM text")]
    NotBase64(&'static str),
    /// `tls.crt` holds no PEM certificate.
    #[error("tls.crt holds no PEM certificate")]
    NoCertificate,
    /// A PEM block of `tls.crt` does not decode.
    #[error("tls.crt is not valid PEM: {0}")]
    BadPem(String),
    /// A certificate of the chain does not parse as X.509.
    #[error("certificate {index} of tls.crt does not parse as X.509: {cause}")]
    BadCertificate {
        /// 1-based place in the chain.
        index: usize,
        /// The parser's words.
        cause: String,
    },
    /// `tls.key` holds no private key that decodes.
    #[error("tls.key holds no PEM private key: {0}")]
    NoKey(String),
    /// The private key is of a type or size this check does not load.
    #[error(
        "tls.key is not an RSA (2048 bits or more), ECDSA P-256/P-384 or Ed25519 private key that parses"
    )]
    UnsupportedKey,
    /// The private key does not belong to the leaf certificate.
    #[error("tls.key does not match the certificate's public key")]
    KeyMismatch,
    /// The leaf certificate's not-after is in the past.
    #[error("the certificate expired at {0} (not after)")]
    Expired(String),
}

/// A usable certificate: the PEM HAProxy loads, and when it stops being usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usable {
    /// The chain, then the key, each as the Secret wrote it (trimmed), ending in a newline.
    pub pem: String,
    /// The leaf's not-after, in seconds since the Unix epoch.
    pub not_after: i64,
}

/// The verdict on a Secret, as [`check_secret`] gives it.
pub type Verdict = Result<Usable, Unusable>;

/// Seconds since the Unix epoch now (0 if the clock is before it).
pub fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Checks a Secret (as a template value) at `now` (seconds since the Unix epoch).
pub fn check_secret(secret: &Value, now: i64) -> Verdict {
    let kind = secret
        .get_from_path("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind != "kubernetes.io/tls" {
        return Err(Unusable::NotTls(kind.to_owned()));
    }
    let decoded = |key: &'static str| {
        let data = secret
            .get_from_path("data")
            .and_then(|d| d.as_map()?.get(&tera::value::Key::Str(key)).cloned())
            .ok_or(Unusable::Missing(key))?;
        let text = data.as_str().ok_or(Unusable::NotBase64(key))?;
        b64decode(text).map_err(|_| Unusable::NotBase64(key))
    };
    let crt = decoded("tls.crt")?;
    let key = decoded("tls.key")?;
    check_pem(&crt, &key, now)
}

/// Checks a PEM chain and a PEM key at `now` (seconds since the Unix epoch).
pub fn check_pem(crt: &str, key: &str, now: i64) -> Verdict {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(crt.as_bytes())
        .collect::<Result<_, pem::Error>>()
        .map_err(|e| Unusable::BadPem(e.to_string()))?;
    if chain.is_empty() {
        return Err(Unusable::NoCertificate);
    }
    let mut leaf: Option<X509Certificate<'_>> = None;
    for (i, der) in chain.iter().enumerate() {
        let (_, cert) =
            X509Certificate::from_der(der.as_ref()).map_err(|e| Unusable::BadCertificate {
                index: i + 1,
                cause: e.to_string(),
            })?;
        if i == 0 {
            leaf = Some(cert);
        }
    }
    let leaf = leaf.ok_or(Unusable::NoCertificate)?;
    let private = PrivateKeyDer::from_pem_slice(key.as_bytes())
        .map_err(|e| Unusable::NoKey(e.to_string()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&private)
        .map_err(|_| Unusable::UnsupportedKey)?;
    let spki = signing.public_key().ok_or(Unusable::UnsupportedKey)?;
    let (_, key_spki) =
        SubjectPublicKeyInfo::from_der(spki.as_ref()).map_err(|_| Unusable::UnsupportedKey)?;
    // Same algorithm and the same key bits: the parameters' encoding (an RSA key's NULL, an
    // EC key's named curve) is not compared, the key itself is.
    let cert_spki = leaf.public_key();
    if cert_spki.algorithm.algorithm != key_spki.algorithm.algorithm
        || cert_spki.subject_public_key.data != key_spki.subject_public_key.data
    {
        return Err(Unusable::KeyMismatch);
    }
    let not_after = leaf.validity().not_after;
    if not_after.timestamp() < now {
        return Err(Unusable::Expired(not_after.to_string()));
    }
    Ok(Usable {
        pem: format!("{}\n{}\n", crt.trim(), key.trim()),
        not_after: not_after.timestamp(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // An EC P-256 pair (the fixtures' certificate) and RSA 2048 pairs: ring cannot generate
    // RSA keys, so those are test data made with openssl (`fixtures/rsa*`).
    const FIXTURE_CRT: &str = include_str!("../fixtures/tls.crt");
    const FIXTURE_KEY: &str = include_str!("../fixtures/tls.key");
    const RSA_CRT: &str = include_str!("../fixtures/rsa.crt");
    const RSA_KEY: &str = include_str!("../fixtures/rsa.key");
    const RSA_OTHER_KEY: &str = include_str!("../fixtures/rsa-other.key");

    fn self_signed(alg: &'static rcgen::SignatureAlgorithm) -> (String, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["a.example.com".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key)
    }

    fn now() -> i64 {
        now_unix()
    }

    #[test]
    fn matching_keys_are_usable_for_rsa_ec_and_ed25519() {
        // RSA and EC P-256 (PKCS#8 test data), EC P-256 and P-384 and Ed25519 (generated).
        let usable = check_pem(FIXTURE_CRT, FIXTURE_KEY, now()).unwrap();
        assert!(usable.pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(usable.pem.ends_with("-----END PRIVATE KEY-----\n"));
        check_pem(RSA_CRT, RSA_KEY, now()).unwrap();
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
            &rcgen::PKCS_ED25519,
        ] {
            let (crt, key) = self_signed(alg);
            check_pem(&crt, &key.serialize_pem(), now()).unwrap();
        }
    }

    #[test]
    fn a_key_of_another_certificate_is_a_mismatch_across_types() {
        let (ec_crt, ec_key) = self_signed(&rcgen::PKCS_ECDSA_P256_SHA256);
        let (_, other_ec) = self_signed(&rcgen::PKCS_ECDSA_P256_SHA256);
        let cases = [
            // EC certificate, another EC key of the same curve.
            (ec_crt.as_str(), other_ec.serialize_pem()),
            // EC certificate, the RSA fixture's key.
            (ec_crt.as_str(), FIXTURE_KEY.to_owned()),
            // RSA certificate, an EC key.
            (RSA_CRT, ec_key.serialize_pem()),
            // RSA certificate, another RSA key.
            (RSA_CRT, RSA_OTHER_KEY.to_owned()),
            // EC certificate, an RSA key.
            (FIXTURE_CRT, RSA_KEY.to_owned()),
        ];
        for (crt, key) in cases {
            assert_eq!(check_pem(crt, &key, now()), Err(Unusable::KeyMismatch));
        }
    }

    #[test]
    fn sec1_and_pkcs1_keys_load() {
        // SEC1 (`EC PRIVATE KEY`) as OpenSSL writes it, from the generated PKCS#8 key.
        let (crt, key) = self_signed(&rcgen::PKCS_ECDSA_P256_SHA256);
        let pkcs8 = key.serialize_der();
        // PKCS#8 is SEQUENCE { version, algorithm, OCTET STRING { the SEC1 ECPrivateKey } }.
        let (_, parsed) = x509_parser::der_parser::parse_der(&pkcs8).unwrap();
        let sec1 = parsed.as_sequence().unwrap()[2].as_slice().unwrap();
        let pem = format!(
            "-----BEGIN EC PRIVATE KEY-----\n{}\n-----END EC PRIVATE KEY-----\n",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, sec1)
        );
        check_pem(&crt, &pem, now()).unwrap();
        // PKCS#1 (`RSA PRIVATE KEY`), the same way from the PKCS#8 RSA key.
        let der = PrivateKeyDer::from_pem_slice(RSA_KEY.as_bytes()).unwrap();
        let (_, parsed) = x509_parser::der_parser::parse_der(der.secret_der()).unwrap();
        let pkcs1 = parsed.as_sequence().unwrap()[2].as_slice().unwrap();
        let pem = format!(
            "-----BEGIN RSA PRIVATE KEY-----\n{}\n-----END RSA PRIVATE KEY-----\n",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, pkcs1)
        );
        check_pem(RSA_CRT, &pem, now()).unwrap();
    }

    #[test]
    fn broken_input_says_what_is_wrong() {
        type Case<'a> = (&'a str, &'a str, fn(&Unusable) -> bool);
        let cases: [Case<'_>; 5] = [
            ("hello", FIXTURE_KEY, |u| *u == Unusable::NoCertificate),
            (
                "-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n",
                FIXTURE_KEY,
                |u| matches!(u, Unusable::BadCertificate { index: 1, .. }),
            ),
            (FIXTURE_CRT, "nothing", |u| matches!(u, Unusable::NoKey(_))),
            (
                FIXTURE_CRT,
                "-----BEGIN PRIVATE KEY-----\naGVsbG8=\n-----END PRIVATE KEY-----\n",
                |u| *u == Unusable::UnsupportedKey,
            ),
            (
                &format!(
                    "{FIXTURE_CRT}\n-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n"
                ),
                FIXTURE_KEY,
                |u| matches!(u, Unusable::BadCertificate { index: 2, .. }),
            ),
        ];
        for (crt, key, want) in cases {
            let got = check_pem(crt, key, now()).unwrap_err();
            assert!(want(&got), "{got}");
        }
    }

    #[test]
    fn an_expired_leaf_is_unusable() {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["old.example.com".into()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let crt = params.self_signed(&key).unwrap().pem();
        let got = check_pem(&crt, &key.serialize_pem(), now()).unwrap_err();
        assert!(
            matches!(&got, Unusable::Expired(at) if at.contains("2021")),
            "{got}"
        );
        // The same pair checked at a time before it expired is usable.
        check_pem(&crt, &key.serialize_pem(), 1_600_000_000).unwrap();
    }

    #[test]
    fn secrets_are_checked_by_type_and_fields() {
        let b64 = |s: &str| base64::Engine::encode(&base64::engine::general_purpose::STANDARD, s);
        let secret = |kind: &str, data: serde_json::Value| {
            Value::from_serializable(&serde_json::json!({"type": kind, "data": data}))
        };
        let good = secret(
            "kubernetes.io/tls",
            serde_json::json!({"tls.crt": b64(FIXTURE_CRT), "tls.key": b64(FIXTURE_KEY)}),
        );
        assert!(check_secret(&good, now()).is_ok());
        let opaque = secret("Opaque", serde_json::json!({}));
        assert_eq!(
            check_secret(&opaque, now()),
            Err(Unusable::NotTls("Opaque".into()))
        );
        let no_key = secret(
            "kubernetes.io/tls",
            serde_json::json!({"tls.crt": b64(FIXTURE_CRT)}),
        );
        assert_eq!(
            check_secret(&no_key, now()),
            Err(Unusable::Missing("tls.key"))
        );
        let bad = secret(
            "kubernetes.io/tls",
            serde_json::json!({"tls.crt": "%%%", "tls.key": b64(FIXTURE_KEY)}),
        );
        assert_eq!(
            check_secret(&bad, now()),
            Err(Unusable::NotBase64("tls.crt"))
        );
    }
}
