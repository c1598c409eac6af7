//! Property fuzzing of what parses untrusted input: the config policy (every line of a set a
//! template rendered from watched resources) and the agent's request decoding (every body that
//! reaches its port). Each property is "never panics, and answers consistently". CI runs the
//! case counts below (a few seconds in a debug build); `PROPTEST_CASES=20000` runs longer.

use haptic_agent_client::policy::Policy;
use haptic_agent_client::protocol::{
    ApplyRequest, FileSet, decode_apply, encode_apply, line_hunks,
};
use proptest::prelude::*;

/// Cases per property in CI (a policy case is a few milliseconds in a debug build).
const POLICY_CASES: u32 = 256;
const DECODE_CASES: u32 = 512;

/// `PROPTEST_CASES` from the environment, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// Fragments that exercise every branch of HAProxy's quoting as the policy reads it: quotes,
/// escapes (also before multibyte characters, the panic this file was written for), `$`
/// expansions, comments, the converters and keywords that name files, and non-ASCII text.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\\".to_owned()),
        Just("\"".to_owned()),
        Just("'".to_owned()),
        Just("#".to_owned()),
        Just("$".to_owned()),
        Just("${".to_owned()),
        Just("}".to_owned()),
        Just("\\x".to_owned()),
        Just("(".to_owned()),
        Just(")".to_owned()),
        Just(",".to_owned()),
        Just(" ".to_owned()),
        Just("\t".to_owned()),
        Just("map(".to_owned()),
        Just("map_beg(".to_owned()),
        Just("env(".to_owned()),
        Just("set-map(".to_owned()),
        Just("%[req.hdr(host),lower,".to_owned()),
        Just("crt ".to_owned()),
        Just("crt-list ".to_owned()),
        Just("lua-load ".to_owned()),
        Just("filter spoe config ".to_owned()),
        Just("default-path origin ".to_owned()),
        Just("crt-base ".to_owned()),
        Just("/etc/".to_owned()),
        Just("../".to_owned()),
        Just("é".to_owned()),
        Just("日本".to_owned()),
        Just("🦀".to_owned()),
        "[a-z0-9./_-]{1,6}",
        any::<char>().prop_map(String::from),
    ]
}

/// A line of fragments under a plausible keyword.
fn line() -> impl Strategy<Value = String> {
    let keyword = prop_oneof![
        Just(""),
        Just("  use_backend "),
        Just("  http-request set-var(txn.x) "),
        Just("  bind :443 ssl "),
        Just("  server s 10.0.0.1:80 "),
        Just("  errorfile 503 "),
        Just("  acl a src -f "),
    ];
    (keyword, proptest::collection::vec(fragment(), 0..12))
        .prop_map(|(keyword, parts)| format!("{keyword}{}", parts.concat()))
}

/// A config: sections and lines, plus a crt-list and an SPOE file it may name.
fn config() -> impl Strategy<Value = (String, String)> {
    let section = prop_oneof![
        Just("global"),
        Just("defaults"),
        Just("frontend f"),
        Just("backend b"),
        Just("program p"),
        Just("ring r"),
    ];
    (
        proptest::collection::vec((section, proptest::collection::vec(line(), 0..6)), 1..4),
        proptest::collection::vec(line(), 0..4),
    )
        .prop_map(|(sections, list)| {
            let mut text = String::new();
            for (header, lines) in sections {
                text.push_str(header);
                text.push('\n');
                for line in lines {
                    text.push_str(&line);
                    text.push('\n');
                }
            }
            (text, list.join("\n"))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(POLICY_CASES), ..ProptestConfig::default() })]

    /// The policy never panics, whatever the lines, and a set it passes stays passed when the
    /// operator allows more (allowing cannot add a violation).
    #[test]
    fn the_policy_never_panics((main, list) in config()) {
        let files = FileSet::new()
            .with("haproxy.cfg", main)
            .and_then(|set| set.with("certs.lst", list.clone()))
            .and_then(|set| set.with("spoe.conf", list));
        let Ok(files) = files else { return Ok(()) };
        let strict = Policy::default().violations(&files);
        let lenient = Policy::default()
            .with_path_prefix("/")
            .with_env("HOME")
            .violations(&files);
        prop_assert!(lenient.len() <= strict.len(), "{lenient:?} vs {strict:?}");
        // The refusal text is built from every violation: it must render too.
        if let Err(error) = Policy::default().check(&files) {
            prop_assert!(!error.to_string().is_empty());
        }
    }
}

/// A valid apply body, and a way to damage it.
fn apply_body() -> impl Strategy<Value = (Vec<u8>, bool)> {
    (
        proptest::collection::vec(("[a-z]{1,8}(/[a-z]{1,8})?", any::<Vec<u8>>()), 0..4),
        any::<bool>(),
    )
        .prop_map(|(extra, gzip)| {
            let mut files = FileSet::new()
                .with("haproxy.cfg", "global\n")
                .unwrap_or_default();
            for (path, content) in extra {
                // A generated path may collide or be refused; the body then has fewer files.
                let _ = files.insert(format!("x/{path}"), content);
            }
            let body = ApplyRequest::new(3, "haptic-0", 1, files)
                .map(|request| encode_apply(&request.to_wire(), if gzip { 0 } else { usize::MAX }))
                .map(|body| body.bytes.to_vec())
                .unwrap_or_default();
            (body, gzip)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(DECODE_CASES), ..ProptestConfig::default() })]

    /// Arbitrary bytes, gzip or not, decode to an error or a request; never a panic, and never
    /// more than the limit inflated.
    #[test]
    fn decoding_arbitrary_bytes_never_panics(body in any::<Vec<u8>>(), gzip in any::<bool>()) {
        if let Ok(wire) = decode_apply(&body, gzip, 1 << 16) {
            let _ = wire.into_request();
        }
    }

    /// A valid body round-trips; the same body with one byte changed, cut short or cut
    /// anywhere decodes to an error or to a request whose checksum matches its files.
    #[test]
    fn damaged_bodies_are_refused_or_consistent(
        (body, gzip) in apply_body(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<bool>(),
    ) {
        let request = decode_apply(&body, gzip, 1 << 20).and_then(|wire| wire.into_request());
        prop_assert!(request.is_ok(), "{request:?}");
        if body.is_empty() {
            return Ok(());
        }
        let mut damaged = body.clone();
        let i = at.index(damaged.len());
        if cut {
            damaged.truncate(i);
        } else {
            damaged[i] = byte;
        }
        if let Ok(request) = decode_apply(&damaged, gzip, 1 << 20).and_then(|wire| wire.into_request()) {
            prop_assert_eq!(request.files.checksum(), request.checksum);
        }
    }
}

/// A line that rewrites one of a config: any [`line`], or one the policy judges by its section
/// (`daemon` and the file keywords only in `global`, `backing-file` only in a `ring`).
fn rewrite() -> impl Strategy<Value = String> {
    prop_oneof![
        line(),
        Just("  daemon".to_owned()),
        Just("  pidfile /run/x.pid".to_owned()),
        Just("  server-state-file ../state".to_owned()),
        Just("  backing-file /var/x".to_owned()),
    ]
}

/// A config of plain lines (that the policy passes) in sections.
fn plain_config() -> impl Strategy<Value = String> {
    let section = prop_oneof![
        Just("global"),
        Just("defaults"),
        Just("frontend f"),
        Just("backend b"),
        Just("program p"),
        Just("ring r"),
    ];
    let plain = "  (server s[0-9] 10\\.0\\.0\\.[0-9]:80|maxconn [0-9]{1,4}|timeout client [0-9]s)";
    proptest::collection::vec((section, proptest::collection::vec(plain, 0..6)), 1..6).prop_map(
        |sections| {
            let mut text = String::new();
            for (header, lines) in sections {
                text.push_str(header);
                text.push('\n');
                for line in lines {
                    text.push_str(&line);
                    text.push('\n');
                }
            }
            text
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(POLICY_CASES), ..ProptestConfig::default() })]

    /// A change checked by what it changed (`violations_of_change`, the lines the hunks
    /// inserted, each in its section) finds exactly what a whole check of the changed set
    /// finds, when the set before passed: whatever lines are rewritten, in whichever sections.
    #[test]
    fn a_change_finds_what_a_whole_check_finds(
        base in plain_config(),
        rewrites in proptest::collection::vec((any::<prop::sample::Index>(), rewrite()), 1..4),
    ) {
        let mut lines: Vec<String> = base.lines().map(str::to_owned).collect();
        for (at, line) in rewrites {
            let at = at.index(lines.len());
            lines[at] = line.replace('\n', " ");
        }
        let changed = lines.join("\n") + "\n";
        let set = |text: &str| FileSet::new().with("haproxy.cfg", text.to_owned());
        let (Ok(before), Ok(after)) = (set(&base), set(&changed)) else { return Ok(()) };
        let policy = Policy::default();
        let (violations, roles) = policy.violations_and_roles(&before);
        prop_assume!(violations.is_empty());
        let hunks = line_hunks(&base, &changed);
        let (of_change, _) = policy.violations_of_change(
            &after,
            ["haproxy.cfg"],
            &roles,
            Some((base.as_bytes(), hunks.as_slice())),
        );
        prop_assert_eq!(of_change, policy.violations(&after));
    }
}
