//! Runs each example's `--local` mode as a child process and checks what it prints.
//!
//! Cargo gives tests no `CARGO_BIN_EXE_*` for examples, but `cargo test -p haptic-examples`
//! builds them next to this test's executable: `target/<profile>/deps/run_examples-*` here,
//! `target/<profile>/examples/<name>` there.

use std::{path::PathBuf, process::Stdio, time::Duration};

use tokio::process::Command;

/// Far above the few seconds each run takes, for a loaded 2-core machine.
const TIMEOUT: Duration = Duration::from_secs(120);

fn example_path(name: &str) -> PathBuf {
    let test_exe = std::env::current_exe().expect("the test knows its own path");
    let profile_dir = test_exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable lives in target/<profile>/deps");
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "example binary {} is missing: run `cargo test -p haptic-examples` (which builds the \
         examples) or `cargo build -p haptic-examples --examples` first",
        path.display()
    );
    path
}

/// Runs an example with `args`, expects success within [`TIMEOUT`], and returns its output
/// (stdout then stderr) without colour codes, one string per line.
async fn run(name: &str, args: &[&str]) -> Vec<String> {
    let child = Command::new(example_path(name))
        .args(args)
        // The assertions read the default log format at info level, whatever the caller set.
        .env("RUST_LOG", "info,haptic_testkit=warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start example {name}: {error}"));
    let output = tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("example {name} did not finish within {TIMEOUT:?}"))
        .unwrap_or_else(|error| panic!("example {name}: {error}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<String> = text.lines().map(strip_ansi).collect();
    assert!(
        output.status.success(),
        "example {name} {args:?} failed with {}:\n{}",
        output.status,
        lines.join("\n")
    );
    lines
}

/// Removes terminal escape sequences (`ESC [ ... letter`), in case colour is on anyway.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The index of the first line at or after `from` that contains every one of `parts`; panics
/// with the whole output otherwise.
fn find(lines: &[String], from: usize, parts: &[&str]) -> usize {
    lines
        .iter()
        .enumerate()
        .skip(from)
        .find(|(_, line)| parts.iter().all(|part| line.contains(part)))
        .map(|(index, _)| index)
        .unwrap_or_else(|| {
            panic!(
                "no line after line {from} contains all of {parts:?}; the output:\n{}",
                lines.join("\n")
            )
        })
}

#[tokio::test]
async fn leader_election_local_hands_over_from_instance_1_to_2() {
    let lines = run("leader_election", &["--local", "--handover-after", "1"]).await;
    let first = find(
        &lines,
        0,
        &["started leading", "identity=leader-election-example-1"],
    );
    let stop = find(&lines, first, &["stopping instance 1"]);
    // The elector logs this before the work stops and the Lease is released, so before the
    // successor can start ("stopped leading" comes after the release and may come later).
    let released = find(
        &lines,
        stop,
        &[
            "stepping down",
            "identity=leader-election-example-1",
            "reason=graceful_shutdown",
        ],
    );
    find(
        &lines,
        released,
        &["started leading", "identity=leader-election-example-2"],
    );
    find(&lines, released, &["instance 2 took over"]);
    find(&lines, released, &["done"]);
}

#[tokio::test]
async fn ha_worker_local_hands_over_to_a_higher_epoch() {
    // Hands over after a third of --run-for, exits after the rest.
    let lines = run("ha_worker", &["--local", "--run-for", "3"]).await;
    let first = find(&lines, 0, &["worker started for this term", "epoch=1"]);
    let handover = find(&lines, first, &["handing over: stopping the leader"]);
    find(
        &lines,
        handover,
        &["worker started for this term", "epoch=2"],
    );
}

#[tokio::test]
async fn fenced_operator_local_refuses_the_stale_leaders_write() {
    let lines = run("fenced_operator", &["--local"]).await;
    let a = "fenced-operator-a";
    let b = "fenced-operator-b";

    let led = find(
        &lines,
        0,
        &["started leading", "claimed epoch", "epoch=1", a],
    );
    assert!(
        !lines[..led]
            .iter()
            .any(|line| line.contains("wrote derived ConfigMap")),
        "a write came before the epoch was claimed:\n{}",
        lines.join("\n")
    );
    let wrote = find(
        &lines,
        led,
        &["wrote derived ConfigMap", "epoch=1", &format!("writer={a}")],
    );

    // The handover: a's controller stops (before its elector releases the Lease), then b
    // claims a higher epoch.
    let handover = find(&lines, wrote, &["step 2: hand over"]);
    let stopped = find(&lines, handover, &["controller stopped", a]);
    let successor = find(
        &lines,
        stopped,
        &["started leading", "claimed epoch", "epoch=2", b],
    );
    // The successor's writes carry its epoch, on old objects and new ones alike.
    for target in [
        "app-1-derived",
        "app-2-derived",
        "app-3-derived",
        "app-4-derived",
    ] {
        find(
            &lines,
            successor,
            &[
                "wrote derived ConfigMap",
                &format!("target={target}"),
                "epoch=2",
                &format!("writer={b}"),
            ],
        );
    }
    let edited = find(
        &lines,
        successor,
        &["derived ConfigMap", "app-2-derived", "epoch=2", "SALUT"],
    );

    // The stale write of a's first term is refused, and the object keeps b's write.
    let refused = find(
        &lines,
        edited,
        &[
            "stale write refused",
            "app-2-derived",
            "it carries epoch 2",
            "epoch is 1",
        ],
    );
    assert!(
        !lines[successor..]
            .iter()
            .any(|line| line.contains("wrote derived ConfigMap") && line.contains(a)),
        "replica a wrote after the handover:\n{}",
        lines.join("\n")
    );
    find(
        &lines,
        refused,
        &[
            "derived ConfigMap",
            "app-2-derived",
            "epoch=2",
            &format!("written_by={b}"),
            "SALUT",
        ],
    );
    find(&lines, refused, &["done", "epoch=2"]);
}
