//! Property fuzzing of what takes resource strings (untrusted input): the template functions
//! and tests, and the reference templates rendering an Ingress whose host, path and TLS Secret
//! name are hostile. Each property is "never panics, and untrusted text never reaches the config
//! as a token of its own". CI runs the case counts below; `PROPTEST_CASES=N` runs longer.

mod common;

use haptic_render::{
    Change, Renderer,
    functions::{
        b64decode, backend_name, is_config_token, is_hostname, is_http_path, is_ip_address,
        refusal, regex_escape, sanitize, ssl_file,
    },
    reference,
};
use proptest::prelude::*;
use serde_json::json;

/// `PROPTEST_CASES` from the environment, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// Text as a hostile resource may hold it: config syntax, whitespace and newlines, quotes,
/// escapes, control and multibyte characters, and plain name characters.
fn hostile() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-z0-9.-]{1,8}",
        Just("\n".to_owned()),
        Just("\r\n".to_owned()),
        Just(" ".to_owned()),
        Just("\t".to_owned()),
        Just("#".to_owned()),
        Just("\"".to_owned()),
        Just("'".to_owned()),
        Just("\\".to_owned()),
        Just("${HOME}".to_owned()),
        Just("%[env(HOME)]".to_owned()),
        Just("lua-load /x".to_owned()),
        Just("*.".to_owned()),
        Just("/".to_owned()),
        Just("é".to_owned()),
        Just("🦀".to_owned()),
        Just("\u{0}".to_owned()),
        any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(piece, 0..8).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), ..ProptestConfig::default() })]

    /// What the functions make of any text is safe as one config token, and the tests agree
    /// with it.
    #[test]
    fn functions_make_config_tokens_of_any_text(a in hostile(), b in hostile(), c in hostile()) {
        let name = sanitize(&a);
        prop_assert!(!name.is_empty() && is_config_token(&name), "{name:?}");
        prop_assert!(name.chars().all(|ch| ch.is_ascii_alphanumeric() || "._-".contains(ch)));
        prop_assert!(is_config_token(&backend_name(&a, &b, &c)));
        let file = ssl_file(&a, &b);
        prop_assert!(file.starts_with("ssl/") && is_config_token(&file), "{file:?}");
        prop_assert!(regex_escape(&a).chars().count() >= a.chars().count());
        if is_hostname(&a) {
            prop_assert!(is_config_token(&a), "a hostname is a token: {a:?}");
        }
        if is_http_path(&a) {
            prop_assert!(!a.contains('\n') && !a.contains(' ') && !a.contains('#'), "{a:?}");
        }
        if is_ip_address(&a) {
            prop_assert!(is_config_token(&a), "{a:?}");
        }
        let _ = b64decode(&a);
        // A refusal quotes the value: its newlines never start a line of their own.
        let said = refusal("ingresses", "shop", "web", "spec.rules[].host", &a, "is unsafe");
        prop_assert!(!said.contains('\n'), "{said:?}");
    }

    /// Base64 of any UTF-8 text decodes back to it.
    #[test]
    fn b64decode_reads_what_base64_wrote(text in any::<String>()) {
        use base64::Engine as _;
        let encoded = base64::engine::general_purpose::STANDARD.encode(&text);
        prop_assert_eq!(b64decode(&encoded).ok(), Some(text));
    }
}

proptest! {
    // A reference render is milliseconds in a debug build: fewer cases.
    #![proptest_config(ProptestConfig { cases: cases(48), ..ProptestConfig::default() })]

    /// The reference templates given an Ingress with a hostile host, path and TLS Secret name
    /// (over a fleet of one ordinary Ingress) render or refuse; never panic, and never write
    /// text that is not a config token where a token goes.
    #[test]
    fn the_reference_templates_keep_hostile_strings_out(
        host in hostile(),
        path in hostile(),
        secret in hostile(),
    ) {
        let stores = common::reference_stores(1);
        let renderer = Renderer::compile(&reference::template_set()).expect("compiles");
        let ingress = json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "metadata": {"namespace": "shop", "name": "hostile"},
            "spec": {
                "ingressClassName": "haproxy",
                "tls": [{"hosts": [host.clone()], "secretName": secret.clone()}],
                "rules": [{"host": host.clone(), "http": {"paths": [{
                    "path": path.clone(), "pathType": "Prefix",
                    "backend": {"service": {"name": "web", "port": {"number": 80}}},
                }]}}],
            },
        });
        // Under review (an overlay), the templates refuse the object or render it.
        if let Ok(overlay) = stores.overlay("ingresses", Change::Apply(&ingress))
            && let Ok(files) = renderer.render_overlay(&stores, &overlay)
        {
            assert_kept_out(&files, [&host, &path, &secret])?;
        }
        // Stored (a watch delivered it): the render goes on, without the hostile values.
        let mut stored = stores.clone();
        if stored
            .get_mut("ingresses")
            .expect("ingresses")
            .apply(&ingress)
            .is_err()
        {
            return Ok(());
        }
        let files = renderer.render(&stored);
        prop_assert!(files.is_ok(), "one object broke the whole render: {files:?}");
        if let Ok(files) = files {
            assert_kept_out(&files, [&host, &path, &secret])?;
        }
    }
}

/// No value that is not a config token (and long enough not to occur by chance) appears
/// verbatim in any file: the templates left it out or refused it.
fn assert_kept_out(
    files: &haptic_render::FileSet,
    values: [&String; 3],
) -> Result<(), TestCaseError> {
    for value in values {
        // A value that is not a token (and long enough not to occur by chance) appears
        // nowhere verbatim: the templates left it out or refused it.
        let distinctive = value.chars().count() >= 4
            && value.chars().any(|c| c.is_ascii_alphanumeric())
            && !is_config_token(value);
        if !distinctive {
            continue;
        }
        for (name, content) in files.iter() {
            let text = String::from_utf8_lossy(content);
            prop_assert!(
                !text.contains(value.as_str()),
                "{value:?} reached {name} verbatim"
            );
        }
    }
    Ok(())
}
