//! `haptic-controller validate`, run as the built binary: the config `deploy/` ships passes;
//! a failing test exits 1 naming the test, the assertion and what was found; JSON output;
//! `--test`; `--dump-rendered`; an invalid config is reported with its template and line.

use std::{path::Path, process::Command};

use serde_json::{Value, json};

fn validate(file: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_haptic-controller"))
        .arg("validate")
        .arg("-f")
        .arg(file)
        .args(args)
        .env_remove("HAPTIC_HAPROXY")
        .output()
        .expect("run haptic-controller validate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A small HTC: one store, a template listing its Services, and the given tests.
fn htc(template: &str, tests: Value) -> Value {
    json!({
        "apiVersion": "haproxy-haptic.org/v1alpha1",
        "kind": "HAProxyTemplateConfig",
        "metadata": {"name": "t", "namespace": "haptic-system"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "haproxy"}},
            "watchedResources": {"services": {"apiVersion": "v1", "resources": "services"}},
            "haproxyConfig": {"template": template},
            "maps": {"hosts.map": {"template": "{% for s in resources.services %}{{ s.metadata.name }}.example.com {{ s.metadata.name }}\n{% endfor %}"}},
            "validationTests": tests,
        }
    })
}

const TEMPLATE: &str = "global\n    log stdout format raw local0\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n{% for s in resources.services %}backend {{ s.metadata.name }}\n    server s1 127.0.0.1:{{ s.spec.ports[0].port }}\n{% endfor %}";

fn services() -> Value {
    json!({"services": [
        {"metadata": {"namespace": "a", "name": "web"}, "spec": {"ports": [{"port": 80}]}},
        {"metadata": {"namespace": "a", "name": "api"}, "spec": {"ports": [{"port": 81}]}},
    ]})
}

fn write(dir: &Path, name: &str, doc: &Value) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(doc).expect("json")).expect("write");
    path
}

#[test]
fn the_shipped_config_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let (code, out, err) = validate(&root.join("deploy/haptic-config.yaml"), &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("7/7 tests passed"), "{out}");
    assert!(
        out.contains("PASS ingress-classes-conflicts-wildcards ("),
        "{out}"
    );
    assert!(out.contains("PASS tls ("), "{out}");
    assert!(out.contains("PASS ssl-passthrough ("), "{out}");
}

#[test]
fn failures_exit_1_naming_test_assertion_and_what_was_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tests = json!({
        "good": {
            "fixtures": services(),
            "assertions": [
                {"type": "contains", "pattern": "(?m)^backend web$"},
                {"type": "match_order", "patterns": ["backend api", "backend web"]},
                {"type": "equals", "target": "map:hosts.map", "expected": "api.example.com api\nweb.example.com web"},
                {"type": "jsonpath", "jsonpath": "$.resources.services[1].spec.ports[0].port", "expected": 80},
                {"type": "deterministic"},
            ],
        },
        "bad": {
            "fixtures": services(),
            "assertions": [
                {"type": "match_count", "pattern": "(?m)^backend ", "expected": 3, "description": "three backends"},
                {"type": "not_contains", "pattern": "127\\.0\\.0\\.1:81"},
                {"type": "match_order", "patterns": ["backend web", "backend api"]},
                {"type": "contains", "target": "map:missing.map", "pattern": "x"},
                {"type": "jsonpath", "jsonpath": "$.resources.services[0].metadata.name", "expected": "web"},
            ],
        },
        "refused": {
            "description": "a port HAProxy refuses",
            "fixtures": {"services": [{"metadata": {"namespace": "a", "name": "web"}, "spec": {"ports": [{"port": 70000}]}}]},
            "assertions": [{"type": "haproxy_valid"}],
        },
    });
    let file = write(dir.path(), "htc.json", &htc(TEMPLATE, tests));

    let (code, out, err) = validate(&file, &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("PASS good (5 assertions)"), "{out}");
    for expected in [
        "test bad: assertion #0 (match_count on haproxy.cfg) \"three backends\": pattern \"(?m)^backend \" matches 2 times, expected 3",
        "test bad: assertion #1 (not_contains on haproxy.cfg): pattern \"127\\\\.0\\\\.0\\\\.1:81\" matches at line",
        "test bad: assertion #2 (match_order on haproxy.cfg): pattern \"backend api\" (line",
        "test bad: assertion #3 (contains on map:missing.map): map:missing.map (maps/missing.map) was not rendered",
        "test bad: assertion #4 (jsonpath): jsonpath \"$.resources.services[0].metadata.name\" gives \"api\", expected \"web\"",
        "test refused: assertion #0 (haproxy_valid): haproxy -c refused the set: [ALERT]",
        "[haproxy.cfg:9] : 'server web/s1' : invalid port '70000'",
        "1/3 tests passed",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in:\n{out}");
    }

    // JSON: the same, machine-readable.
    let (code, out, _) = validate(&file, &["--output", "json", "--test", "bad"]);
    assert_eq!(code, 1);
    let report: Value = serde_json::from_str(&out).expect("json report");
    let tests = report["tests"].as_array().expect("tests");
    assert_eq!(tests.len(), 1, "only --test bad");
    assert_eq!(tests[0]["name"], "bad");
    assert_eq!(tests[0]["passed"], false);
    assert_eq!(tests[0]["assertions"][0]["type"], "match_count");
    assert_eq!(tests[0]["assertions"][0]["passed"], false);
    assert!(
        tests[0]["assertions"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("matches 2 times, expected 3")),
        "{out}"
    );

    // One passing test alone exits 0, and its rendered set can be dumped.
    let dump = dir.path().join("dump");
    let (code, out, err) = validate(
        &file,
        &[
            "--test",
            "good",
            "--dump-rendered",
            dump.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let cfg = std::fs::read_to_string(dump.join("good/haproxy.cfg")).expect("dumped");
    assert!(cfg.contains("backend api"), "{cfg}");
    assert!(dump.join("good/maps/hosts.map").is_file());

    let (code, _, err) = validate(&file, &["--test", "nope"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("there is no validation test `nope` (tests: bad, good, refused)"),
        "{err}"
    );
}

#[test]
fn an_invalid_config_or_test_is_reported_before_any_test_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tests = json!({
        "t": {
            "fixtures": {"ingresses": []},
            "assertions": [{"type": "contains", "pattern": "("}, {"type": "match_count", "pattern": "x"}],
        },
    });
    let file = write(
        dir.path(),
        "htc.json",
        &htc("global\n{% for s in resources.services %}\n", tests),
    );
    let (code, out, err) = validate(&file, &[]);
    assert_eq!(code, 1, "{out}{err}");
    for expected in [
        "template `haproxyConfig` line 3",
        "validationTests.t.fixtures.ingresses: `ingresses` is not a watched resource",
        "validationTests.t.assertions[0] (contains): pattern \"(\"",
        "validationTests.t.assertions[1] (match_count): needs `expected`",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
}
