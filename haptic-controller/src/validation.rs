//! Validation tests (`spec.validationTests`): each test loads its fixtures into empty stores of
//! the config, renders the set, and checks its assertions (`haproxy_valid`, `contains`,
//! `not_contains`, `equals`, `jsonpath`, `match_count`, `match_order`, `deterministic`) on a
//! target (`haproxy.cfg`, `map:<name>`, `file:<name>`, `cert:<name>`). Offline: no cluster;
//! `haproxy_valid` runs the agents' config policy and the real `haproxy -c`.
//!
//! Run by `haptic-controller validate` and by the admission webhook. Every failure names the
//! test, the assertion and what was found.

use std::{path::PathBuf, time::SystemTime};

use haptic_agent_client::policy::Policy;
use haptic_render::{FileSet, Stores};
use jsonpath_rust::JsonPath as _;
use regex::Regex;
use serde::Serialize;
use serde_json::{Value as Json, json};

use crate::{
    config::ValidatedConfig,
    crd::{Assertion, AssertionType, HAProxyTemplateConfigSpec, ValidationTest},
    events::RenderedSet,
    render_gate::{self, CheckError},
};

/// How `haproxy_valid` checks a set.
#[derive(Debug, Clone)]
pub struct Checker {
    /// The `haproxy` binary; none: `haproxy_valid` fails, saying no binary was given.
    pub haproxy: Option<PathBuf>,
    /// The agents' config policy.
    pub policy: Policy,
}

/// The outcome of one assertion.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct AssertionResult {
    /// Its place in the test's `assertions` (0-based).
    pub index: usize,
    /// Its type, as written (`contains`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its description.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The target it read (`haproxy.cfg`, `map:x`...), when it reads one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Whether it held.
    pub passed: bool,
    /// What was found, when it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The outcome of one test.
#[derive(Debug, Clone, Serialize)]
pub struct TestResult {
    /// The test's name.
    pub name: String,
    /// Its description.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Whether every assertion held.
    pub passed: bool,
    /// Why the test could not run its assertions (a fixture refused, the render failed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each assertion's outcome.
    pub assertions: Vec<AssertionResult>,
    /// The rendered set (for `--dump-rendered`).
    #[serde(skip)]
    pub rendered: Option<FileSet>,
}

impl TestResult {
    /// One line per failure: `test NAME: assertion #I (TYPE on TARGET): MESSAGE`.
    pub fn failures(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(error) = &self.error {
            lines.push(format!("test {}: {error}", self.name));
        }
        for a in self.assertions.iter().filter(|a| !a.passed) {
            let on = a
                .target
                .as_ref()
                .map(|t| format!(" on {t}"))
                .unwrap_or_default();
            let what = a
                .description
                .as_ref()
                .map(|d| format!(" \"{d}\""))
                .unwrap_or_default();
            lines.push(format!(
                "test {}: assertion #{} ({}{on}){what}: {}",
                self.name,
                a.index,
                a.kind,
                a.message.as_deref().unwrap_or("failed")
            ));
        }
        lines
    }
}

/// The outcome of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Every test run, by name.
    pub tests: Vec<TestResult>,
}

impl Report {
    /// Whether every test passed.
    pub fn passed(&self) -> bool {
        self.tests.iter().all(|t| t.passed)
    }

    /// Every failure, one line each (see [`TestResult::failures`]).
    pub fn failures(&self) -> Vec<String> {
        self.tests.iter().flat_map(TestResult::failures).collect()
    }
}

/// Why tests could not be run at all.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// `--test NAME` names no test.
    #[error("there is no validation test `{name}` (tests: {known})")]
    NoSuchTest {
        /// The name asked for.
        name: String,
        /// The tests there are.
        known: String,
    },
}

/// Checks the tests' structure (fixture stores, patterns, JSONPaths, expected values): one
/// line per problem, naming the test and assertion. The config loader runs it with the rest.
pub fn check_structure(spec: &HAProxyTemplateConfigSpec) -> Vec<String> {
    let mut errors = Vec::new();
    for (name, test) in &spec.validation_tests {
        let at = format!("validationTests.{name}");
        for store in test.fixtures.keys() {
            if !spec.watched_resources.contains_key(store) {
                errors.push(format!(
                    "{at}.fixtures.{store}: `{store}` is not a watched resource"
                ));
            }
        }
        for (store, objects) in &test.fixtures {
            for (index, fixture) in objects.iter().enumerate() {
                if fixture
                    .pointer("/metadata/name")
                    .and_then(Json::as_str)
                    .is_none()
                {
                    errors.push(format!(
                        "{at}.fixtures.{store}[{index}]: the resource has no metadata.name"
                    ));
                }
            }
        }
        if test.assertions.is_empty() {
            errors.push(format!(
                "{at}.assertions: a test needs at least one assertion"
            ));
        }
        for (i, a) in test.assertions.iter().enumerate() {
            let at = format!("{at}.assertions[{i}]");
            if let Err(why) = check_assertion(a) {
                errors.push(format!("{at} ({}): {why}", kind_name(a.type_)));
            }
        }
    }
    errors
}

fn check_assertion(a: &Assertion) -> Result<(), String> {
    let pattern = || {
        let p = a.pattern.as_deref().ok_or("needs `pattern`")?;
        Regex::new(p).map_err(|e| format!("pattern {p:?}: {e}"))
    };
    if let Some(target) = &a.target {
        let (kind, name) = target.split_once(':').unwrap_or(("", target));
        if matches!(kind, "map" | "file" | "cert") && name.is_empty() {
            return Err(format!("target {target:?} names no {kind}"));
        }
    }
    match a.type_ {
        AssertionType::HaproxyValid | AssertionType::Deterministic => Ok(()),
        AssertionType::Contains | AssertionType::NotContains => pattern().map(drop),
        AssertionType::MatchCount => {
            pattern()?;
            expected_count(a).map(drop)
        }
        AssertionType::Equals => match &a.expected {
            Some(Json::String(_)) => Ok(()),
            _ => Err("needs `expected` text".to_owned()),
        },
        AssertionType::MatchOrder => {
            if a.patterns.len() < 2 {
                return Err("needs at least two `patterns`".to_owned());
            }
            for p in &a.patterns {
                Regex::new(p).map_err(|e| format!("pattern {p:?}: {e}"))?;
            }
            Ok(())
        }
        AssertionType::Jsonpath => {
            let path = a.jsonpath.as_deref().ok_or("needs `jsonpath`")?;
            json!({})
                .query(path)
                .map(drop)
                .map_err(|e| format!("jsonpath {path:?}: {e}"))
        }
    }
}

fn expected_count(a: &Assertion) -> Result<usize, String> {
    match &a.expected {
        Some(Json::Number(n)) => n.as_u64().map(|n| n as usize),
        Some(Json::String(s)) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| "needs `expected`: a count such as 3".to_owned())
}

/// The type as written in the CRD.
fn kind_name(kind: AssertionType) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Runs the config's tests (only `only`, when given), in name order.
pub async fn run(
    config: &ValidatedConfig,
    only: Option<&str>,
    checker: &Checker,
) -> Result<Report, Error> {
    let tests = &config.spec.validation_tests;
    if let Some(name) = only
        && !tests.contains_key(name)
    {
        return Err(Error::NoSuchTest {
            name: name.to_owned(),
            known: tests.keys().cloned().collect::<Vec<_>>().join(", "),
        });
    }
    let mut results = Vec::new();
    for (name, test) in tests.iter().filter(|(n, _)| only.is_none_or(|o| o == *n)) {
        results.push(run_one(config, name, test, checker).await);
    }
    Ok(Report { tests: results })
}

/// Stores holding the fixtures, loaded in their order or the reverse.
fn load(config: &ValidatedConfig, test: &ValidationTest, reverse: bool) -> Result<Stores, String> {
    let mut stores = config.empty_stores();
    for (store, objects) in &test.fixtures {
        let target = stores
            .get_mut(store)
            .ok_or_else(|| format!("fixtures.{store}: `{store}` is not a watched resource"))?;
        let mut order: Vec<(usize, &Json)> = objects.iter().enumerate().collect();
        if reverse {
            order.reverse();
        }
        for (i, object) in order {
            target
                .apply(object)
                .map_err(|e| format!("fixtures.{store}[{i}]: {e}"))?;
        }
    }
    Ok(stores)
}

async fn run_one(
    config: &ValidatedConfig,
    name: &str,
    test: &ValidationTest,
    checker: &Checker,
) -> TestResult {
    let mut result = TestResult {
        name: name.to_owned(),
        description: test.description.clone(),
        passed: false,
        error: None,
        assertions: Vec::new(),
        rendered: None,
    };
    let rendered = load(config, test, false).and_then(|stores| {
        let files = config
            .renderer
            .render(&stores)
            .map_err(|e| format!("render failed: {e}"))?;
        Ok((stores, files))
    });
    let (stores, files) = match rendered {
        Ok(done) => done,
        Err(error) => {
            result.error = Some(error);
            return result;
        }
    };
    for (index, assertion) in test.assertions.iter().enumerate() {
        let target = reads_target(assertion.type_).then(|| {
            assertion
                .target
                .clone()
                .unwrap_or_else(|| "haproxy.cfg".to_owned())
        });
        let outcome = evaluate(
            config,
            test,
            assertion,
            target.as_deref(),
            &stores,
            &files,
            checker,
        )
        .await;
        result.assertions.push(AssertionResult {
            index,
            kind: kind_name(assertion.type_),
            description: assertion.description.clone(),
            target,
            passed: outcome.is_ok(),
            message: outcome.err(),
        });
    }
    result.passed = result.assertions.iter().all(|a| a.passed);
    result.rendered = Some(files);
    result
}

fn reads_target(kind: AssertionType) -> bool {
    matches!(
        kind,
        AssertionType::Contains
            | AssertionType::NotContains
            | AssertionType::Equals
            | AssertionType::MatchCount
            | AssertionType::MatchOrder
    )
}

/// The path in the set a target names.
fn target_path(spec: &HAProxyTemplateConfigSpec, target: &str) -> String {
    match target.split_once(':') {
        Some(("map", name)) => format!("maps/{name}"),
        Some(("file", name)) => spec
            .files
            .get(name)
            .and_then(|f| f.path.clone())
            .unwrap_or_else(|| name.to_owned()),
        Some(("cert", name)) => {
            // A named certificate's file, or a per-resource one's (`<namespace>_<name>`, in
            // its bucket: `haptic_render::functions::ssl_file`).
            let name = name.trim_end_matches(".pem");
            if spec
                .ssl_certificates
                .get(name)
                .is_some_and(|cert| cert.for_each.is_none())
            {
                format!("ssl/{name}.pem")
            } else {
                haptic_render::functions::ssl_item_file(name)
            }
        }
        _ => target.to_owned(),
    }
}

/// 1-based line number of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

fn line_at(text: &str, line: usize) -> &str {
    text.lines()
        .nth(line.saturating_sub(1))
        .unwrap_or("")
        .trim()
}

async fn evaluate(
    config: &ValidatedConfig,
    test: &ValidationTest,
    a: &Assertion,
    target: Option<&str>,
    stores: &Stores,
    files: &FileSet,
    checker: &Checker,
) -> Result<(), String> {
    check_assertion(a)?;
    let text = match target {
        None => "",
        Some(target) => {
            let path = target_path(&config.spec, target);
            files.text(&path).ok_or_else(|| {
                let rendered: Vec<&str> = files.iter().map(|(p, _)| p).collect();
                format!(
                    "{target} ({path}) was not rendered (the set holds: {})",
                    rendered.join(", ")
                )
            })?
        }
    };
    let regex = |p: &str| Regex::new(p).map_err(|e| format!("pattern {p:?}: {e}"));
    match a.type_ {
        AssertionType::HaproxyValid => haproxy_valid(files, checker).await,
        AssertionType::Contains => {
            let p = a.pattern.as_deref().unwrap_or_default();
            if regex(p)?.is_match(text) {
                Ok(())
            } else {
                Err(format!(
                    "pattern {p:?} matches nowhere in {} lines",
                    text.lines().count()
                ))
            }
        }
        AssertionType::NotContains => {
            let p = a.pattern.as_deref().unwrap_or_default();
            match regex(p)?.find(text) {
                None => Ok(()),
                Some(m) => {
                    let line = line_of(text, m.start());
                    Err(format!(
                        "pattern {p:?} matches at line {line}: {:?}",
                        line_at(text, line)
                    ))
                }
            }
        }
        AssertionType::MatchCount => {
            let p = a.pattern.as_deref().unwrap_or_default();
            let want = expected_count(a)?;
            let found = regex(p)?.find_iter(text).count();
            if found == want {
                Ok(())
            } else {
                Err(format!(
                    "pattern {p:?} matches {found} times, expected {want}"
                ))
            }
        }
        AssertionType::MatchOrder => {
            let mut from = 0;
            let mut previous: Option<(&str, usize)> = None;
            for p in &a.patterns {
                match regex(p)?.find_at(text, from) {
                    Some(m) => {
                        previous = Some((p, line_of(text, m.start())));
                        from = m.end();
                    }
                    None => {
                        let anywhere = regex(p)?.find(text).map(|m| line_of(text, m.start()));
                        return Err(match (previous, anywhere) {
                            (Some((q, at)), Some(line)) => format!(
                                "pattern {p:?} (line {line}) does not come after {q:?} (line {at})"
                            ),
                            (_, None) => format!("pattern {p:?} matches nowhere"),
                            (None, Some(_)) => format!("pattern {p:?} matches nowhere"),
                        });
                    }
                }
            }
            Ok(())
        }
        AssertionType::Equals => {
            let want = a
                .expected
                .as_ref()
                .and_then(Json::as_str)
                .unwrap_or_default();
            if text.trim() == want.trim() {
                return Ok(());
            }
            let (got_lines, want_lines): (Vec<&str>, Vec<&str>) =
                (text.trim().lines().collect(), want.trim().lines().collect());
            let at = (0..got_lines.len().max(want_lines.len()))
                .find(|i| got_lines.get(*i) != want_lines.get(*i))
                .unwrap_or(0);
            Err(format!(
                "differs at line {}: expected {:?}, found {:?}",
                at + 1,
                want_lines.get(at).copied().unwrap_or("<end>"),
                got_lines.get(at).copied().unwrap_or("<end>")
            ))
        }
        AssertionType::Deterministic => {
            let again = load(config, test, true)?;
            let second = config
                .renderer
                .render(&again)
                .map_err(|e| format!("the second render failed: {e}"))?;
            if second == *files {
                return Ok(());
            }
            let differs = files
                .iter()
                .map(|(p, _)| p)
                .chain(second.iter().map(|(p, _)| p))
                .find(|p| files.get(p) != second.get(p))
                .unwrap_or("?");
            Err(format!(
                "the fixtures loaded in reverse order render a different {differs}"
            ))
        }
        AssertionType::Jsonpath => {
            let path = a.jsonpath.as_deref().unwrap_or_default();
            let context = context_json(config, stores);
            let found = context
                .query(path)
                .map_err(|e| format!("jsonpath {path:?}: {e}"))?;
            let value = match found.as_slice() {
                [] => None,
                [one] => Some((*one).clone()),
                many => Some(Json::Array(many.iter().map(|v| (*v).clone()).collect())),
            };
            match (&a.expected, value) {
                (None, Some(_)) => Ok(()),
                (_, None) => Err(format!("jsonpath {path:?} selects nothing")),
                (Some(want), Some(got)) if same(want, &got) => Ok(()),
                (Some(want), Some(got)) => {
                    Err(format!("jsonpath {path:?} gives {got}, expected {want}"))
                }
            }
        }
    }
}

/// JSON equality, with a string expected matching a number or boolean of the same text.
fn same(want: &Json, got: &Json) -> bool {
    want == got
        || match (want, got) {
            (Json::String(w), Json::Number(_) | Json::Bool(_)) => {
                w.as_str() == got.to_string().as_str()
            }
            _ => false,
        }
}

/// The template context as JSON: `resources` (each store's resources, sorted), `derived`
/// (each derived view's rows) and the extra context's keys.
fn context_json(config: &ValidatedConfig, stores: &Stores) -> Json {
    let mut context = serde_json::Map::new();
    for (key, value) in &config.spec.templating_settings.extra_context {
        context.insert(key.clone(), value.clone());
    }
    let resources: serde_json::Map<String, Json> = stores
        .iter()
        .map(|(name, store)| (name.to_owned(), store.json()))
        .collect();
    context.insert("resources".to_owned(), Json::Object(resources));
    let derived: serde_json::Map<String, Json> = config
        .derivations
        .iter()
        .filter_map(|(name, _)| Some((name.clone(), stores.derived_json(name)?)))
        .collect();
    context.insert("derived".to_owned(), Json::Object(derived));
    Json::Object(context)
}

/// `haproxy_valid`: the policy, then the strict `haproxy -c`.
async fn haproxy_valid(files: &FileSet, checker: &Checker) -> Result<(), String> {
    let set = RenderedSet {
        files: files.clone(),
        checksum: haptic_agent_client::protocol::checksum(files.iter()),
        config_generation: 0,
        term: SystemTime::now(),
        requests: Default::default(),
        render_time: Default::default(),
        span: tracing::Span::none(),
        provenance: Default::default(),
    };
    render_gate::policy_check(&checker.policy, &set)?;
    let haproxy = checker
        .haproxy
        .as_ref()
        .ok_or("no haproxy binary to check with (--haproxy)")?;
    match render_gate::check_files(haproxy, files).await {
        Ok(()) => Ok(()),
        Err(CheckError::Refused(output)) => Err(format!(
            "haproxy -c refused the set: {}",
            render_gate::alert_line(&output)
        )),
        Err(CheckError::CannotRun(error)) => Err(format!("haproxy -c could not run: {error}")),
    }
}

/// Writes each test's rendered set under `dir/<test>/`.
pub fn dump(report: &Report, dir: &std::path::Path) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    for test in &report.tests {
        if let Some(files) = &test.rendered {
            let at = dir.join(&test.name);
            files
                .write_to(&at)
                .map_err(|e| format!("writing {}: {e}", at.display()))?;
            written.push(at);
        }
    }
    Ok(written)
}
