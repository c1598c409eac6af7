//! A line of more words than HAProxy reads (64) is refused by the render gate before HAProxy
//! sees it, traced to the object that wrote it, and only that object is left out: the
//! reference set with a test hook (a Service annotation copied into an ACL of its backend, as
//! a template that trusts an annotation would), judged against the real `haproxy -c`.

use std::{path::PathBuf, process::Command};

use haptic_agent_client::policy::{MAX_LINE_WORDS, Policy};
use haptic_controller::{
    events::RenderedSet,
    render_gate::{self, CheckError, GateSettings},
};
use haptic_render::{FileSet, ObjectRef, Renderer, fixtures, reference};
use serde_json::json;

const HOOK: &str = "haptic.test/acl";

fn haproxy() -> PathBuf {
    ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "HAProxy is needed: `sudo apt-get install -y haproxy` (cargo xtask test installs it)",
        )
}

/// The reference set, whose backends carry `acl haptic_test path <the annotation>` for a
/// Service annotated `haptic.test/acl`.
fn renderer() -> Renderer {
    let mut set = reference::template_set();
    let snippet = &mut set
        .template_snippets
        .get_mut("backends")
        .expect("backends snippet")
        .template;
    let plain = "backend {{ row.name }}\n    balance roundrobin";
    let patched = snippet.replacen(
        plain,
        &format!(
            "{plain}{{% set svc = [\"services\", row.namespace, row.service] | get %}}\
             {{% if svc and svc.metadata.annotations and svc.metadata.annotations[\"{HOOK}\"] %}}\n    \
             acl haptic_test path {{{{ svc.metadata.annotations[\"{HOOK}\"] }}}}{{% endif %}}"
        ),
        1,
    );
    assert_ne!(
        &patched, snippet,
        "the backend is where the test expects it"
    );
    *snippet = patched;
    Renderer::compile(&set).expect("the patched set compiles")
}

/// `haproxy -c` itself on the set (no check of ours first): HAProxy's output when it refuses.
fn haproxy_refuses(files: &FileSet) -> Option<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    files.write_to(dir.path()).expect("write the set");
    let output = Command::new(haproxy())
        .arg("-c")
        .arg("-C")
        .arg(dir.path())
        .arg("-f")
        .arg(dir.path().join("haproxy.cfg"))
        .output()
        .expect("haproxy runs");
    (!output.status.success()).then(|| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .replace(&format!("{}/", dir.path().display()), "")
    })
}

fn rendered(files: FileSet, provenance: haptic_render::Provenance) -> RenderedSet {
    RenderedSet {
        checksum: files.checksum_hex(),
        files,
        config_generation: 1,
        term: std::time::SystemTime::now(),
        span: tracing::Span::none(),
        provenance,
        render_time: std::time::Duration::ZERO,
        requests: Default::default(),
    }
}

/// The `/p<i>` patterns that make the ACL line `words` words long.
fn patterns(words: usize) -> String {
    (3..words)
        .map(|i| format!("/p{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Where the `backend` section of the Service whose backend names start with `prefix` begins:
/// `\nbackend <its pool backend>\n` when `maps/pool.map` names one, else `\nbackend <prefix>`.
fn section(files: &FileSet, prefix: &str) -> String {
    files
        .text("maps/pool.map")
        .unwrap_or_default()
        .lines()
        .find_map(|line| {
            let (name, pool) = line.split_once(' ')?;
            name.starts_with(prefix)
                .then(|| format!("\nbackend {pool}\n"))
        })
        .unwrap_or_else(|| format!("\nbackend {prefix}"))
}

fn the_line(files: &FileSet, service: &str) -> Option<(usize, usize)> {
    let cfg = files.text("haproxy.cfg").expect("haproxy.cfg");
    let backend = cfg.find(&section(files, service))?;
    let at = backend + cfg[backend..].find("\n    acl haptic_test ")? + 1;
    let number = cfg[..at].matches('\n').count() + 1;
    let words = cfg[at..].lines().next()?.split_whitespace().count();
    Some((number, words))
}

#[tokio::test]
async fn a_line_over_64_words_leaves_only_its_object_out() {
    // Without ingress-nginx annotations: their backends are written by another branch.
    let mut params = fixtures::Params::new(6);
    params.annotated_every = 0;
    let mut fixtures = params.generate();
    let names: Vec<(String, String)> = fixtures
        .services
        .iter()
        .map(|s| {
            let m = &s["metadata"];
            (
                m["namespace"].as_str().expect("namespace").to_owned(),
                m["name"].as_str().expect("name").to_owned(),
            )
        })
        .collect();
    let name = |i: usize| names[i].clone();
    let (long_ns, long_name) = name(1);
    let (edge_ns, edge_name) = name(4);
    fixtures.services[1]["metadata"]["annotations"] = json!({HOOK: patterns(MAX_LINE_WORDS + 1)});
    fixtures.services[4]["metadata"]["annotations"] = json!({HOOK: patterns(MAX_LINE_WORDS)});
    let mut stores = reference::stores().expect("reference stores");
    fixtures.load(&mut stores).expect("fixtures load");
    let renderer = renderer();
    let (files, _, provenance) = renderer.render_traced(&stores).expect("renders");
    let backend = |ns: &str, name: &str| format!("{ns}_{name}_");
    let (long_line, words) =
        the_line(&files, &backend(&long_ns, &long_name)).expect("the long ACL line");
    assert_eq!(words, MAX_LINE_WORDS + 1);
    let (_, edge_words) =
        the_line(&files, &backend(&edge_ns, &edge_name)).expect("the 64-word ACL line");
    assert_eq!(edge_words, MAX_LINE_WORDS);

    // HAProxy refuses the 65-word line, and only it.
    let real = haproxy_refuses(&files).expect("haproxy -c refuses 65 words");
    assert!(
        real.contains(&format!("[haproxy.cfg:{long_line}]: too many words")),
        "{real}"
    );
    assert_eq!(real.matches("too many words").count(), 1, "{real}");

    // The gate refuses it before HAProxy (also with no binary to run), naming the line and
    // its words, in HAProxy's words, so that provenance blames the Service.
    let set = rendered(files.clone(), provenance);
    render_gate::policy_check(&Policy::default(), &set).expect("the policy has no word limit");
    let settings = GateSettings {
        haproxy: None,
        policy: Policy::default(),
    };
    let ours = render_gate::check(&settings, &set)
        .await
        .expect("the gate refuses the set");
    assert!(
        ours.contains(&format!(
            "[haproxy.cfg:{long_line}]: too many words ({}): HAProxy reads at most 64 words a line",
            MAX_LINE_WORDS + 1
        )),
        "{ours}"
    );
    let blamed: Vec<ObjectRef> = set
        .provenance
        .attribute(&set.files, &ours)
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    let long = ObjectRef {
        store: "services".into(),
        namespace: long_ns.clone(),
        name: long_name.clone(),
    };
    assert_eq!(blamed, std::slice::from_ref(&long), "{ours}");
    match render_gate::check_files(&haproxy(), &files).await {
        Err(CheckError::Refused(output)) => assert_eq!(output, ours),
        other => panic!("check_files: {other:?}"),
    }

    // Rendered without it, the set passes (ours and HAProxy's), the 64-word line and every
    // other backend still there.
    let without = stores.excluding(std::slice::from_ref(&long));
    let (kept, _, provenance) = renderer.render_traced(&without).expect("renders");
    assert_eq!(the_line(&kept, &backend(&long_ns, &long_name)), None);
    assert_eq!(
        the_line(&kept, &backend(&edge_ns, &edge_name)).map(|(_, w)| w),
        Some(MAX_LINE_WORDS)
    );
    let kept_set = rendered(kept.clone(), provenance);
    assert_eq!(render_gate::check(&settings, &kept_set).await, None);
    render_gate::check_files(&haproxy(), &kept)
        .await
        .expect("passes haproxy -c");
    assert_eq!(haproxy_refuses(&kept), None);
    let cfg = kept.text("haproxy.cfg").expect("haproxy.cfg");
    for i in [0, 2, 3, 4, 5] {
        let (ns, name) = name(i);
        assert!(
            cfg.contains(&section(&kept, &backend(&ns, &name))),
            "{ns}/{name}"
        );
    }
}
