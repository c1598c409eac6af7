//! Shared helpers for the integration tests: the real `haproxy -c`, and rendering the reference
//! set for fixtures.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

use haptic_render::{FileSet, Renderer, Stores, fixtures, reference};

/// The haproxy binary: on PATH, or Debian's /usr/sbin/haproxy. Fails the test when missing:
/// the project's `cargo xtask test` installs it, so a missing binary is a broken setup, not a
/// reason to skip.
pub fn haproxy() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("haproxy"))
            .find(|p| p.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from("/usr/sbin/haproxy")).filter(|p| p.is_file()))
        .expect(
            "haproxy not found on PATH nor at /usr/sbin/haproxy: install Debian's haproxy \
             package (`cargo xtask setup`, or `apt-get install haproxy`)",
        )
}

/// Writes the set to a fresh directory and runs `haproxy -c` on it; panics with HAProxy's
/// output when the check fails. Returns HAProxy's combined output.
pub fn haproxy_check(files: &FileSet) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    files.write_to(dir.path()).expect("write file set");
    check_dir(dir.path())
}

/// `haproxy -c -f <dir>/haproxy.cfg`, asserting success.
pub fn check_dir(dir: &Path) -> String {
    let output = Command::new(haproxy())
        .arg("-c")
        .arg("-f")
        .arg(dir.join("haproxy.cfg"))
        .current_dir("/")
        .output()
        .expect("run haproxy");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "haproxy -c failed ({}):\n{text}",
        output.status
    );
    text
}

/// The reference stores loaded with `n` generated Ingresses and their resources.
pub fn reference_stores(n: usize) -> Stores {
    let mut stores = reference::stores().expect("reference stores");
    fixtures::generate(n)
        .load(&mut stores)
        .expect("load fixtures");
    stores
}

/// Renders the reference set.
pub fn render_reference(stores: &Stores) -> FileSet {
    Renderer::compile(&reference::template_set())
        .expect("reference set compiles")
        .render(stores)
        .unwrap_or_else(|e| panic!("reference set renders: {e}"))
}

/// A port for a test's HAProxy to bind on 127.0.0.1: free when chosen, picked at random
/// below the kernel's ephemeral range (32768 and up), so that no outgoing connection of this
/// or another test can take it between now and HAProxy's bind (a port the OS hands out for
/// `bind(:0)` is in that range and can be reused by any client socket meanwhile).
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new();
    // A port handed out once is never handed out again by this process: the tests of a binary
    // run on threads of one process, and a port one test was given may be free for a moment
    // before its HAProxy binds it; HAProxy binds with SO_REUSEPORT, so a second HAProxy on the
    // same port would share its connections rather than fail.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for attempt in 0u32..1000 {
        let pick = random.hash_one((std::process::id(), attempt, std::time::Instant::now()));
        let port = 20_000 + u16::try_from(pick % 12_000).unwrap_or(0);
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    panic!("no free port between 20000 and 32000 on 127.0.0.1 after 1000 tries");
}

/// The `backend` section HAProxy serves a Service port's backend (`<namespace>_<service>_<port>`)
/// from: its pool backend when `maps/pool.map` names one, else the backend itself.
pub fn section(files: &FileSet, backend: &str) -> String {
    files
        .text("maps/pool.map")
        .unwrap_or_default()
        .lines()
        .find_map(|line| {
            let (name, pool) = line.split_once(' ')?;
            (name == backend).then(|| pool.to_owned())
        })
        .unwrap_or_else(|| backend.to_owned())
}
