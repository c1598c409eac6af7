//! The render gate (leader only): `haproxy -c` on each rendered set, off the reconcile path.
//!
//! The gate starts optimistic: a render goes on to the scheduler at once and is checked
//! meanwhile, because every agent validates a set before it swaps it in and keeps its
//! last-known-good set, so a bad set cannot go live either way. When a check refuses a set,
//! the refusal is reported once (status, log) and the gate closes: later renders are checked
//! first and go on only when one passes, which opens the gate again. A new leader starts
//! optimistic. A check in progress never holds a newer render: it goes on (gate open) as it
//! arrives, and the newest one waiting is checked when the running check ends (a check at
//! 10,000 Ingresses with 2,500 certificates takes seconds; the first change after a deployment
//! used to wait for the check of the deployed set); while the gate is open and the pods took
//! the last deployment, only after a rest as long as the last check took: in a stream of
//! changes at 10,000 the checks otherwise kept a core busy beside the changes. The check runs on a scratch copy laid out as the agent lays a set out (`-C` at
//! the set's directory), so relative map and certificate paths resolve the same, kept between
//! checks and updated to each set by writing only the files that changed ([`Scratch`]), and only after
//! the set passed the agents' own config policy ([`haptic_agent_client::policy`]: no Lua,
//! programs, external checks or files outside the set unless allowed), so a set the policy
//! refuses never runs `haproxy -c` here and never leaves the controller.
//!
//! A render that differs from the last set `haproxy -c` passed only in what the agents change
//! at run time with no check (server slots' addresses, weights and states; entries of maps
//! looked up by key or prefix: [`passes_as`]) passes as that one did, at once: no `haproxy -c`
//! runs for it, and a check of an older render in progress is dropped. A stream of new routes
//! on spare backends and endpoint changes then runs no check at all (at 10,000 Ingresses each
//! check is seconds of a core). A render that passes as a set waiting for a check (or in one)
//! waits in its place, not compared with the last pass: what that set differs in from the last
//! pass is still there (after the backend pool grew, the comparison with the set before the
//! growth read every moved backend section and failed, ~100 ms of a core a render, until the
//! grown set's check passed).
//!
//! A refusal is traced to the object that produced the refused line or file (the set's
//! provenance: a per-Secret certificate file, a map or crt-list line of an Ingress, a
//! backend of a Service); when one is found, the gate asks the coordinator to render again
//! without it ([`ControllerEvent::Exclude`]), and that render, checked like any other, opens
//! the gate. What still holds the whole set: a refused line no object produced (a template's
//! own text, such as a bad HAProxyTemplateConfig), a refusal HAProxy does not locate, and more
//! refused objects than the coordinator leaves out at once.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use haptic_agent_client::{
    policy::{MAX_LINE_WORDS, Policy, Roles},
    protocol::line_hunks,
};
use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use haptic_render::FileSet;
use tokio::process::Command;
use tracing::{Instrument as _, debug, error, info, warn};

use crate::events::{ControllerEvent, Exclusion, GateVerdict, Kind, PodOutcome, RenderedSet};

/// How long one `haproxy -c` may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(60);
/// While the gate is open, a check starts no sooner after the last one ended than that one
/// took, times this: during a stream of changes at 10,000 Ingresses the checks (seconds each)
/// otherwise ran back to back, a core busy for as long as changes came. A closed gate checks
/// at once (renders wait for a pass), and so does an open one once a pod failed an apply
/// (the check may be what finds the object to leave out).
const OPEN_REST_FACTOR: u32 = 1;
/// How much lower than the controller's own the CPU priority of a check nobody waits for is
/// (the gate open, no pod failing: [`Priority::Background`]): `haproxy -c` at 10,000 Ingresses
/// is seconds of a core, and on the leader's cores it competed with the renders of the
/// changes it was checking. A check the fleet waits for (the gate closed, or a pod failed an
/// apply) runs at the controller's priority: at nice 19 on busy cores one took 20 s where it
/// took 2, so a background check running when a pod fails is started again at full priority.
const BACKGROUND_NICENESS: i32 = 10;
/// How many lines over HAProxy's word limit a refusal names ([`long_lines`]).
const LONG_LINES_SHOWN: usize = 20;
/// How much of HAProxy's output a refusal keeps (the end, where the alerts are).
const OUTPUT_CAP: usize = 4096;

/// The gate's settings.
#[derive(Debug, Clone)]
pub struct GateSettings {
    /// The `haproxy` binary; none disables the check (the agents still validate).
    pub haproxy: Option<PathBuf>,
    /// The config policy, the same the agents apply (give it the agents' allow-list).
    pub policy: Policy,
}

/// The component: subscribe now, run the returned future.
pub fn component(
    settings: GateSettings,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut renders = ctx.bus().subscribe_leader_only(
        "render-gate",
        Filter::kinds([Kind::Rendered, Kind::BecameLeader]),
    );
    // Apart from the renders: the newest render wins there, and a report must not displace one.
    let mut deployed = ctx
        .bus()
        .subscribe_leader_only("render-gate-deployments", Filter::kinds([Kind::Deployed]));
    async move {
        // The term's stamp (`BecameLeader.at`); renders of earlier terms (the sticky last
        // render arrives first) are not this term's to deploy.
        let mut term = None;
        let mut open = true;
        let mut reported: Option<String> = None;
        // The last render that passed the config policy: the next is checked against it.
        let mut passed: Option<Arc<Passed>> = None;
        // The check in progress, and the newest render waiting for one. A render never waits
        // for the check of an earlier one (at 10,000 Ingresses with 2,500 certificates it takes
        // seconds): while the gate is open it goes on at once, and only the newest render
        // waiting is checked next.
        let mut checking: Option<(Arc<RenderedSet>, Check, tokio::time::Instant, Priority)> = None;
        let mut waiting: Option<Arc<RenderedSet>> = None;
        // The newest set that passed `haproxy -c` (or passed as one that did, `passes_as`).
        let mut last_pass: Option<Arc<RenderedSet>> = None;
        // A pod failed an apply since the last check at full priority ended.
        let mut urgent = false;
        // No check starts before this while the gate is open (`OPEN_REST_FACTOR`).
        let mut rest_until = tokio::time::Instant::now();
        // The scratch copy the checks run on, kept between them ([`Scratch`]).
        let scratch = Scratch::default();
        loop {
            let rested = !open || tokio::time::Instant::now() >= rest_until;
            if checking.is_none()
                && rested
                && let Some(set) = waiting.take()
            {
                let priority = if open && !urgent {
                    Priority::Background
                } else {
                    Priority::Interactive
                };
                let future = {
                    let (settings, set, scratch) = (settings.clone(), set.clone(), scratch.clone());
                    let span = set.span.clone();
                    Box::pin(async move {
                        check_at(&settings, &set, priority, Some(&scratch))
                            .instrument(span)
                            .await
                    })
                };
                checking = Some((set, future, tokio::time::Instant::now(), priority));
            }
            let resting = checking.is_none() && waiting.is_some() && open;
            let in_check = async {
                match checking.as_mut() {
                    Some((_, future, _, _)) => future.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = ctx.token().cancelled() => return,
                refused = in_check => {
                    let Some((set, _, started, priority)) = checking.take() else { continue };
                    if priority == Priority::Interactive {
                        urgent = false;
                    }
                    let now = tokio::time::Instant::now();
                    rest_until = now + (now - started) * OPEN_REST_FACTOR;
                    let passed = refused.is_none();
                    verdict(&ctx, &set, refused, &mut open, &mut reported);
                    if passed {
                        last_pass = Some(set);
                        // The render that waited for this check may need none.
                        if let Some(newer) = waiting.take()
                            && !inherit(&ctx, &mut last_pass, &newer, (&mut open, &mut reported)).await
                        {
                            waiting = Some(newer);
                        }
                    }
                }
                () = tokio::time::sleep_until(rest_until), if resting => {}
                report = deployed.recv() => {
                    let Some(report) = report else { return };
                    if let ControllerEvent::Deployed(report) = &*report
                        && report.pods.values().any(|outcome| matches!(outcome, PodOutcome::Failed(_)))
                    {
                        rest_until = tokio::time::Instant::now();
                        urgent = true;
                        // A check at background priority is stopped (its HAProxy killed) and
                        // its set checked again at full priority, unless a newer one waits.
                        if checking.as_ref().is_some_and(|(_, _, _, priority)| *priority == Priority::Background)
                            && let Some((set, _, _, _)) = checking.take()
                        {
                            waiting.get_or_insert(set);
                        }
                    }
                }
                event = renders.recv() => {
                    let Some(event) = event else { return };
                    if let Some(set) = admit(&ctx, &settings, event, &mut renders, (&mut term, &mut open, &mut reported, &mut passed)).await {
                        // A set waiting for a check, or in one, did not pass as the last pass:
                        // a render that passes as that set cannot either (what it differs in
                        // from the last pass is still there), and takes its place with no
                        // comparison with the last pass. After the backend pool grew (every
                        // backend section moved), that comparison failed after ~100 ms of a
                        // core, for every render until the grown set's check passed.
                        let pending = waiting.clone().or_else(|| checking.as_ref().map(|(set, ..)| set.clone()));
                        if let Some(pending) = pending
                            && like(&pending, &set).await
                        {
                            set.span.in_scope(|| debug!(checksum = %set.checksum, like = %pending.checksum, "differs from a set waiting for haproxy -c only in what passes as it; waits in its place"));
                            waiting = Some(set);
                        } else if inherit(&ctx, &mut last_pass, &set, (&mut open, &mut reported)).await {
                            // The newest render passed: the check of an older one, running or
                            // waiting, would only report on a set nobody deploys any more.
                            checking = None;
                            waiting = None;
                        } else {
                            waiting = Some(set);
                        }
                    }
                }
            }
        }
    }
}

/// Whether `set` differs from `pending` only in what passes as it ([`passes_as`], off the
/// async threads).
async fn like(pending: &Arc<RenderedSet>, set: &Arc<RenderedSet>) -> bool {
    let (pending, set) = (pending.clone(), set.clone());
    tokio::task::spawn_blocking(move || passes_as(&pending.files, &set.files))
        .await
        .unwrap_or(false)
}

/// Gives `set` the verdict of `last_pass` when it differs from it only in what passes as it
/// did ([`passes_as`], read off the async threads): a pass, with no `haproxy -c`. Returns
/// whether it did; `set` is then the last pass.
async fn inherit(
    ctx: &LeaderContext<ControllerEvent>,
    last_pass: &mut Option<Arc<RenderedSet>>,
    set: &Arc<RenderedSet>,
    (open, reported): (&mut bool, &mut Option<String>),
) -> bool {
    let Some(passed) = last_pass.clone() else {
        return false;
    };
    let compared = set.clone();
    let inherits = tokio::task::spawn_blocking(move || passes_as(&passed.files, &compared.files))
        .await
        .unwrap_or(false);
    if inherits {
        set.span.in_scope(|| debug!(checksum = %set.checksum, "differs from the last set haproxy -c passed only in server slots and map entries; passes as it did"));
        verdict(ctx, set, None, open, reported);
        *last_pass = Some(set.clone());
    }
    inherits
}

/// Whether `set` differs from `passed` (a set `haproxy -c` passed) only in what an agent
/// changes through HAProxy's runtime API with no check ([`haptic_agent_client::hitless`]),
/// none of which can make HAProxy refuse the files: in `haproxy.cfg`, `server` lines of
/// backends whose address (an IP and port), weight or state alone changed, each within
/// HAProxy's word limit; other files, maps that `haproxy.cfg` reads only through `map`,
/// `map_str` or `map_beg` (a string key, a string value: every line loads) and no crt-list
/// names. The same paths in both. Such a set passes as `passed` did: in a stream of new
/// routes on spare backends and endpoint changes at 10,000 Ingresses, `haproxy -c` (seconds
/// of a core with 2,500 certificates) otherwise ran beside every change.
pub fn passes_as(passed: &FileSet, set: &FileSet) -> bool {
    use haptic_agent_client::{hitless, policy, protocol::MAIN_CONFIG};
    if passed.len() != set.len() {
        return false;
    }
    let Some(config) = set
        .get(MAIN_CONFIG)
        .and_then(|config| std::str::from_utf8(config).ok())
    else {
        return false;
    };
    // The crt-lists `haproxy.cfg` names (`crt-list <path>`, on its `bind` lines): the lines
    // that mention one, found with memmem in the whole text (not by splitting its 200,000
    // lines at 10,000 Ingresses), each once.
    let mut mentions: Vec<&str> = memchr::memmem::find_iter(config.as_bytes(), "crt-list")
        .map(|at| {
            let start = memchr::memrchr(b'\n', &config.as_bytes()[..at]).map_or(0, |nl| nl + 1);
            let end =
                memchr::memchr(b'\n', &config.as_bytes()[at..]).map_or(config.len(), |nl| at + nl);
            config.get(start..end).unwrap_or_default()
        })
        .collect();
    mentions.dedup_by(|a, b| std::ptr::eq(*a, *b));
    let crt_lists: Vec<&[u8]> = mentions
        .into_iter()
        .flat_map(|line| {
            let words: Vec<&str> = line.split_ascii_whitespace().collect();
            words
                .windows(2)
                .filter(|pair| pair[0] == "crt-list")
                .map(|pair| pair[1])
                .collect::<Vec<_>>()
        })
        .filter_map(|path| set.get(path))
        .collect();
    set.iter().all(|(path, content)| {
        let Some(before) = passed.get(path) else {
            return false;
        };
        if shares(before, content) || (path != MAIN_CONFIG && before == content) {
            return true;
        }
        if path == MAIN_CONFIG {
            let Ok(old) = std::str::from_utf8(before) else {
                return false;
            };
            // Compared by its hunks (none: the same text), its common head read once.
            let hunks = line_hunks(old, config);
            return hitless::config_changes_from_hunks(old, config, &hunks).is_ok()
                && hunks
                    .iter()
                    .flat_map(|hunk| &hunk.insert)
                    .all(|line| policy::long_lines(line).is_empty());
        }
        std::str::from_utf8(content).is_ok()
            && hitless::order_free(config, path)
            && !crt_lists
                .iter()
                .any(|list| memchr::memmem::find(list, path.as_bytes()).is_some())
    })
}

/// A check in progress: HAProxy's refusal, or none.
type Check = std::pin::Pin<Box<dyn Future<Output = Option<String>> + Send>>;

/// Takes the newest render queued behind `event` (and the term of every `BecameLeader` on the
/// way), runs the config policy on it and, while the gate is open, passes it on to the
/// scheduler. Returns the render to check, or none (not this term's, or refused by the policy).
async fn admit(
    ctx: &LeaderContext<ControllerEvent>,
    settings: &GateSettings,
    mut event: Arc<ControllerEvent>,
    renders: &mut haptic_eventbus::Subscription<ControllerEvent>,
    (term, open, reported, passed): (
        &mut Option<std::time::SystemTime>,
        &mut bool,
        &mut Option<String>,
        &mut Option<Arc<Passed>>,
    ),
) -> Option<Arc<RenderedSet>> {
    if let ControllerEvent::BecameLeader(became) = &*event {
        *term = Some(became.at);
    }
    // Latest wins: a check is only worth running on the newest render. (The term is taken
    // from every BecameLeader on the way: a render queued right behind it must not be taken
    // for one of an earlier term.)
    while let Some(newer) = renders.try_recv() {
        if let ControllerEvent::BecameLeader(became) = &*newer {
            *term = Some(became.at);
        } else {
            event = newer;
        }
    }
    let set = match &*event {
        ControllerEvent::Rendered(set) if Some(set.term) == *term => set.clone(),
        _ => return None,
    };
    // The policy is certain: a set it refuses is never sent, gate open or not. It reads what
    // changed since the last set that passed (all of the first: ~46 ms at 10k Ingresses), off
    // the async threads; a panic in it refuses the set rather than ending the gate.
    let checked = tokio::task::spawn_blocking({
        let (policy, set, base) = (settings.policy.clone(), set.clone(), passed.clone());
        move || policy_check_since(&policy, base.as_deref(), &set)
    })
    .await
    .unwrap_or_else(|panic| Err(format!("the config policy check failed: {panic}")));
    let checked = checked.map(|now| *passed = Some(Arc::new(now)));
    if let Err(refusal) = checked {
        ctx.bus()
            .publish(ControllerEvent::GateVerdict(Arc::new(GateVerdict {
                checksum: set.checksum.clone(),
                config_generation: set.config_generation,
                refused: Some(refusal.clone()),
            })));
        if reported.as_deref() != Some(&refusal) {
            set.span.in_scope(|| error!(checksum = %set.checksum, %refusal, "the rendered config breaks the config policy; not deploying it"));
            *reported = Some(refusal);
        }
        *open = false;
        return None;
    }
    if *open {
        ctx.bus().publish(ControllerEvent::Deployable(set.clone()));
    }
    Some(set)
}

/// Reports `haproxy -c`'s verdict on `set`: a pass opens the gate (and passes the set on if
/// it was closed), a refusal closes it and asks for a render without the object it traces to.
fn verdict(
    ctx: &LeaderContext<ControllerEvent>,
    set: &Arc<RenderedSet>,
    refused: Option<String>,
    open: &mut bool,
    reported: &mut Option<String>,
) {
    ctx.bus()
        .publish(ControllerEvent::GateVerdict(Arc::new(GateVerdict {
            checksum: set.checksum.clone(),
            config_generation: set.config_generation,
            refused: refused.clone(),
        })));
    match refused {
        None => {
            if !*open {
                set.span.in_scope(|| info!(checksum = %set.checksum, "a render passed haproxy -c again; the gate is open"));
                ctx.bus().publish(ControllerEvent::Deployable(set.clone()));
            }
            *open = true;
            *reported = None;
        }
        Some(output) => {
            // Traced to one object: render again without it (HAProxy's line about it is the
            // reason its Event gives).
            if let Some((object, line)) = set
                .provenance
                .attribute(&set.files, &output)
                .into_iter()
                .next()
            {
                set.span.in_scope(|| warn!(checksum = %set.checksum, %object, alert = %line, "haproxy -c refused what one object produced; rendering without it"));
                ctx.bus()
                    .publish(ControllerEvent::Exclude(Arc::new(Exclusion {
                        object,
                        reason: alert_text(line).to_owned(),
                        checksum: set.checksum.clone(),
                    })));
            }
            if reported.as_deref() != Some(&output) {
                set.span.in_scope(|| error!(checksum = %set.checksum, output = %output, "haproxy -c refused the rendered config; holding later renders until one passes"));
                *reported = Some(output);
            }
            *open = false;
        }
    }
}

/// The agents' config policy on the rendered set; the error lists every violation.
pub fn policy_check(policy: &Policy, set: &RenderedSet) -> Result<(), String> {
    policy_check_since(policy, None, set).map(|_| ())
}

/// A set that passed the config policy, as the policy reads it: the base of the next check.
#[derive(Debug)]
pub struct Passed {
    files: haptic_agent_client::FileSet,
    roles: Roles,
}

/// [`policy_check`], reading only what changed since `passed` (the last set that passed):
/// the files added or rewritten, and of `haproxy.cfg` the lines that changed, each in its
/// section ([`Policy::violations_of_change`], as an agent checks a delta; a changed line that
/// opens a section or names a crt-list checks the whole set). At 10,000 Ingresses the whole
/// check read every line of a 7 MB `haproxy.cfg` on every render, ~46 ms on the way to every
/// agent. On a pass, returns the base of the next check.
pub fn policy_check_since(
    policy: &Policy,
    passed: Option<&Passed>,
    set: &RenderedSet,
) -> Result<Passed, String> {
    let config = haptic_agent_client::protocol::MAIN_CONFIG;
    let files = haptic_agent_client::FileSet::from_files(set.files.files().clone())
        .map_err(|error| format!("the set breaks the apply protocol: {error}"))?;
    let mut changed = Vec::new();
    for (path, content) in files.iter() {
        // The render shares the bytes of a file it rendered the same before: the set the last
        // check passed holds the very same `Bytes` (no read), or holds other bytes. Another
        // `haproxy.cfg` is compared by its hunks below (its common head read once, not twice).
        let same = passed
            .and_then(|passed| passed.files.get(path))
            .is_some_and(|before| shares(before, content) || (path != config && before == content));
        if !same {
            changed.push(path);
        }
    }
    let (violations, roles) = match passed {
        Some(passed) => {
            // Hunks only for a config that changed (two 7 MB texts split into lines else).
            let texts = passed
                .files
                .get(config)
                .zip(files.get(config))
                .filter(|_| changed.contains(&config))
                .and_then(|(old, new)| {
                    Some((
                        std::str::from_utf8(old).ok()?,
                        std::str::from_utf8(new).ok()?,
                    ))
                });
            let hunks = texts.map(|(old, new)| (old, line_hunks(old, new)));
            if hunks.as_ref().is_some_and(|(_, hunks)| hunks.is_empty()) {
                // The same text in other bytes.
                changed.retain(|path| *path != config);
            }
            policy.violations_of_change(
                &files,
                changed,
                &passed.roles,
                hunks
                    .as_ref()
                    .map(|(old, hunks)| (old.as_bytes(), hunks.as_slice())),
            )
        }
        None => policy.violations_and_roles(&files),
    };
    if violations.is_empty() {
        return Ok(Passed { files, roles });
    }
    let lines: Vec<String> = violations.iter().map(ToString::to_string).collect();
    Err(format!("config policy: {}", lines.join("; ")))
}

/// Whether two files are the same bytes in memory (one render's file shared by the next).
pub(crate) fn shares(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && std::ptr::eq(a.as_ptr(), b.as_ptr())
}

/// Runs the check; `None` when it passed (or cannot run), else HAProxy's output (or, for a
/// line HAProxy would refuse for its length, [`long_lines`]'s, which reads as HAProxy's).
pub async fn check(settings: &GateSettings, set: &RenderedSet) -> Option<String> {
    check_at(settings, set, Priority::Interactive, None).await
}

/// [`check`], `haproxy -c` running at `priority`, in `scratch` when given (else in a
/// directory of its own).
async fn check_at(
    settings: &GateSettings,
    set: &RenderedSet,
    priority: Priority,
    scratch: Option<&Scratch>,
) -> Option<String> {
    // Without a binary too: what the gate can see for itself it never lets through.
    if let Err(output) = long_lines(&set.files) {
        return Some(output);
    }
    let haproxy = settings.haproxy.as_ref()?;
    let checked = match scratch {
        Some(scratch) => scratch.check(haproxy, &set.files, priority).await,
        None => check_files_at(haproxy, &set.files, priority).await,
    };
    match checked {
        Ok(()) => None,
        Err(CheckError::Refused(output)) => Some(output),
        Err(CheckError::CannotRun(error)) => {
            warn!(%error, haproxy = %haproxy.display(), "the render gate cannot run haproxy -c; skipping the check");
            None
        }
    }
}

/// Why [`check_files`] did not pass a set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckError {
    /// HAProxy refused it (or did not finish in time): its output, the end where the alerts
    /// are, with the scratch directory taken out of paths.
    Refused(String),
    /// The check could not run (no scratch directory, no binary).
    CannotRun(String),
}

/// `haproxy -c` on `files`, laid out in a scratch directory as an agent lays a set out (`-C`
/// at the set's directory, so relative map and certificate paths resolve the same). Strict:
/// no `-dr`, and a check that cannot run is an error, not a pass (what the webhook and
/// `haptic-controller validate` need; the gate itself is optimistic, see [`check`]).
pub async fn check_files(haproxy: &Path, files: &FileSet) -> Result<(), CheckError> {
    check_files_at(haproxy, files, Priority::Interactive).await
}

/// The CPU priority of a check's `haproxy -c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// The controller's own: someone waits for the verdict (a closed gate, a failed pod, the
    /// webhook, `validate`).
    Interactive,
    /// [`BACKGROUND_NICENESS`] lower: the verdict only confirms what already went on.
    Background,
}

/// Spawns `command` and, for [`Priority::Background`], lowers the child's CPU priority (from
/// the instant it started: a check lasts hundreds of ms to seconds). A priority that cannot be
/// lowered leaves the check as it is.
pub fn spawn_at(
    command: &mut Command,
    priority: Priority,
) -> std::io::Result<tokio::process::Child> {
    let child = command.spawn()?;
    #[cfg(target_os = "linux")]
    if priority == Priority::Background
        && let Some(pid) = child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(id.cast_signed()))
    {
        let lowered = rustix::process::getpriority_process(None).and_then(|own| {
            rustix::process::setpriority_process(Some(pid), (own + BACKGROUND_NICENESS).min(19))
        });
        if let Err(error) = lowered {
            warn!(%error, "could not lower the priority of a background haproxy -c");
        }
    }
    Ok(child)
}

/// [`check_files`], `haproxy -c` running at `priority`.
pub async fn check_files_at(
    haproxy: &Path,
    files: &FileSet,
    priority: Priority,
) -> Result<(), CheckError> {
    long_lines(files).map_err(CheckError::Refused)?;
    let scratch = tempfile::Builder::new()
        .prefix("haptic-gate-")
        .tempdir()
        .map_err(|error| CheckError::CannotRun(format!("creating a scratch directory: {error}")))?;
    let dir = scratch.path().join("set");
    let files = files.clone();
    let target = dir.clone();
    // Writing the copy (2,500 files at 10,000 Ingresses) is the controller's own CPU: for a
    // background check, on a nicer thread too.
    let write = move || files.write_to(&target);
    let written = match priority {
        Priority::Interactive => tokio::task::spawn_blocking(write)
            .await
            .map_err(|error| error.to_string()),
        Priority::Background => crate::background::run("haptic-gate-copy", write)
            .await
            .map_err(|error| error.to_string()),
    };
    match written {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            return Err(CheckError::Refused(format!(
                "writing the scratch copy failed: {error}"
            )));
        }
        Err(error) => {
            return Err(CheckError::CannotRun(format!(
                "writing the scratch copy panicked: {error}"
            )));
        }
    }
    run_check(haproxy, &dir, priority).await
}

/// Runs `haproxy -c` on the set laid out in `dir` (`-C dir -f dir/haproxy.cfg`) at `priority`.
async fn run_check(haproxy: &Path, dir: &Path, priority: Priority) -> Result<(), CheckError> {
    let mut command = Command::new(haproxy);
    command
        .arg("-c")
        .arg("-C")
        .arg(dir)
        .arg("-f")
        .arg(dir.join("haproxy.cfg"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let run = async { spawn_at(&mut command, priority)?.wait_with_output().await };
    match tokio::time::timeout(CHECK_TIMEOUT, run).await {
        Err(_) => Err(CheckError::Refused(format!(
            "haproxy -c did not finish within {CHECK_TIMEOUT:?}"
        ))),
        Ok(Err(error)) => Err(CheckError::CannotRun(format!(
            "running {}: {error}",
            haproxy.display()
        ))),
        Ok(Ok(output)) if output.status.success() => Ok(()),
        Ok(Ok(output)) => {
            let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&output.stderr));
            let text = text.replace(&format!("{}/", dir.display()), "");
            Err(CheckError::Refused(tail(text.trim(), OUTPUT_CAP)))
        }
    }
}

/// The render gate's scratch copy, kept between its checks: a check writes only the files
/// that differ from the copy the last one left, and removes those gone (at 10,000 Ingresses a
/// whole copy, 2,500 certificates and the maps, was ~1.5 s of a core a check, most of it the
/// file system creating files). A write that fails or never finished (its check dropped, a
/// panic) leaves no record of the copy, and the next check writes a whole one. One write at a
/// time: a write of a dropped check that still runs holds the copy until it ends.
#[derive(Clone, Default)]
pub struct Scratch(Arc<std::sync::Mutex<ScratchCopy>>);

#[derive(Default)]
struct ScratchCopy {
    dir: Option<tempfile::TempDir>,
    /// The set the copy holds, when it holds one whole.
    written: Option<FileSet>,
}

impl Scratch {
    /// `haproxy -c` on `files` at `priority`, in the kept copy updated to them.
    pub async fn check(
        &self,
        haproxy: &Path,
        files: &FileSet,
        priority: Priority,
    ) -> Result<(), CheckError> {
        long_lines(files).map_err(CheckError::Refused)?;
        let (scratch, files) = (self.clone(), files.clone());
        // Writing is the controller's own CPU: for a background check, on a nicer thread too.
        let write = move || scratch.update(&files);
        let written = match priority {
            Priority::Interactive => tokio::task::spawn_blocking(write)
                .await
                .map_err(|error| error.to_string()),
            Priority::Background => crate::background::run("haptic-gate-copy", write)
                .await
                .map_err(|error| error.to_string()),
        };
        let dir = match written {
            Ok(Ok(dir)) => dir,
            Ok(Err(error)) => {
                return Err(CheckError::Refused(format!(
                    "writing the scratch copy failed: {error}"
                )));
            }
            Err(error) => {
                return Err(CheckError::CannotRun(format!(
                    "writing the scratch copy panicked: {error}"
                )));
            }
        };
        run_check(haproxy, &dir, priority).await
    }

    /// Updates the copy to `files` (blocking) and returns its directory.
    pub fn update(&self, files: &FileSet) -> Result<PathBuf, String> {
        // A write that panicked left `written` empty: the next one starts over.
        let mut copy = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if copy.dir.is_none() {
            let dir = tempfile::Builder::new()
                .prefix("haptic-gate-")
                .tempdir()
                .map_err(|error| format!("creating a scratch directory: {error}"))?;
            copy.dir = Some(dir);
        }
        let dir = copy
            .dir
            .as_ref()
            .map(|dir| dir.path().join("set"))
            .ok_or("no scratch directory")?;
        let updated = match copy.written.take() {
            Some(before) => update_copy(&dir, &before, files),
            None => Err(String::new()),
        };
        if updated.is_err() {
            // A whole copy, in an empty directory.
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(format!("clearing {}: {error}", dir.display())),
            }
            files.write_to(&dir).map_err(|error| error.to_string())?;
        }
        copy.written = Some(files.clone());
        Ok(dir)
    }
}

/// Makes the copy of `before` in `dir` one of `files`: the files that differ written, those
/// gone removed. An error leaves the copy in between.
fn update_copy(dir: &Path, before: &FileSet, files: &FileSet) -> Result<(), String> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |error: std::io::Error| format!("{path}: {error}")
    };
    for (path, content) in files.iter() {
        if before
            .get(path)
            .is_some_and(|old| shares(old, content) || old == content)
        {
            continue;
        }
        // The renderer's paths are relative, without `..` (`FileSet::write_to` refuses others).
        if path.is_empty()
            || Path::new(path).is_absolute()
            || path.split('/').any(|part| part.is_empty() || part == "..")
        {
            return Err(format!("unsafe path {path:?}"));
        }
        let target = dir.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        std::fs::write(&target, content).map_err(io(&target))?;
    }
    for (path, _) in before.iter() {
        if files.get(path).is_none() {
            let target = dir.join(path);
            std::fs::remove_file(&target).map_err(io(&target))?;
        }
    }
    Ok(())
}

/// Refuses, before HAProxy sees it, a set whose `haproxy.cfg` has a line of more words than
/// HAProxy reads ([`MAX_LINE_WORDS`]; it would refuse the whole configuration, and did, twice,
/// for lines a template wrote from a long list). The refusal reads as HAProxy's alerts do, an
/// `[ALERT]` line per long line naming `[haproxy.cfg:<line>]`, so the set's provenance traces
/// it to the object that wrote the line ([`verdict`] then leaves that object out) and the
/// webhook quotes it as it quotes HAProxy.
pub fn long_lines(files: &FileSet) -> Result<(), String> {
    let Some(config) = files.get(haptic_agent_client::protocol::MAIN_CONFIG) else {
        return Ok(());
    };
    let text = String::from_utf8_lossy(config);
    let long = haptic_agent_client::policy::long_lines(&text);
    if long.is_empty() {
        return Ok(());
    }
    let lines: Vec<&str> = text.split('\n').collect();
    let mut output: Vec<String> = long
        .iter()
        .take(LONG_LINES_SHOWN)
        .map(|l| {
            // The line's first words, enough to find it; without brackets or quotes, which
            // provenance would read as file names and line numbers.
            let start: String = lines
                .get(l.line - 1)
                .map(|t| {
                    t.split_ascii_whitespace()
                        .take(4)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default()
                .chars()
                .map(|c| {
                    if matches!(c, '[' | ']' | '\'') {
                        '?'
                    } else {
                        c
                    }
                })
                .collect();
            format!(
                "[ALERT]    (haptic) : config : parsing [{}:{}]: too many words ({}): HAProxy \
                 reads at most {MAX_LINE_WORDS} words a line: <{start} ...>",
                haptic_agent_client::protocol::MAIN_CONFIG,
                l.line,
                l.words,
            )
        })
        .collect();
    if long.len() > LONG_LINES_SHOWN {
        output.push(format!(
            "[ALERT]    (haptic) : config : and {} more such lines",
            long.len() - LONG_LINES_SHOWN
        ));
    }
    output.push(format!(
        "[ALERT]    (haptic) : config : Error(s) found in configuration file : {} (refused \
         before haproxy -c)",
        haptic_agent_client::protocol::MAIN_CONFIG
    ));
    Err(output.join("\n"))
}

/// An alert line without HAProxy's prefix (`[ALERT]    (pid) : config : `).
fn alert_text(line: &str) -> &str {
    line.split_once(" : config : ")
        .map_or(line, |(_, rest)| rest)
        .trim()
}

/// The first `[ALERT]` line of HAProxy's output (what a denial quotes), else its last line.
pub fn alert_line(output: &str) -> &str {
    output
        .lines()
        .find(|line| line.contains("[ALERT]"))
        .or_else(|| output.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or(output)
        .trim()
}

fn tail(text: &str, cap: usize) -> String {
    if text.len() <= cap {
        return text.to_owned();
    }
    let mut start = text.len() - cap;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The niceness of a child started with `spawn_at`: the child waits for a line on its
    /// stdin (written once the priority is set), then prints the niceness (field 19 of
    /// `/proc/<pid>/stat`) of a process it starts, which inherits its own.
    async fn niceness_of_a_child_at(priority: Priority) -> i32 {
        use tokio::io::AsyncWriteExt as _;
        let mut command = Command::new("sh");
        command
            .args(["-c", "read line; cut -d' ' -f19 /proc/self/stat"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let mut child = spawn_at(&mut command, priority).expect("sh starts");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"go\n").await.expect("write");
        drop(stdin);
        let output = child.wait_with_output().await.expect("sh ends");
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .expect("a niceness")
    }

    #[tokio::test]
    async fn a_background_check_runs_at_a_lower_cpu_priority_than_the_controller() {
        let own = rustix::process::getpriority_process(None).expect("own niceness");
        assert_eq!(niceness_of_a_child_at(Priority::Interactive).await, own);
        assert_eq!(
            niceness_of_a_child_at(Priority::Background).await,
            (own + BACKGROUND_NICENESS).min(19)
        );
    }

    /// Every file under `dir`, by path relative to it.
    fn read_copy(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, Vec<u8>>) {
            for entry in std::fs::read_dir(dir).expect("list") {
                let entry = entry.expect("entry");
                let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
                if entry.file_type().expect("type").is_dir() {
                    walk(&entry.path(), &format!("{name}/"), out);
                } else {
                    out.insert(name, std::fs::read(entry.path()).expect("read"));
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(dir, "", &mut out);
        out
    }

    fn files_of(files: &[(&str, &str)]) -> FileSet {
        FileSet::new(
            files
                .iter()
                .map(|(path, content)| ((*path).to_owned(), content.as_bytes().to_vec()))
                .collect::<BTreeMap<_, _>>(),
        )
    }

    fn as_map(files: &FileSet) -> BTreeMap<String, Vec<u8>> {
        files
            .iter()
            .map(|(path, content)| (path.to_owned(), content.to_vec()))
            .collect()
    }

    #[test]
    fn the_kept_scratch_copy_writes_what_changed_and_holds_each_set_exactly() {
        let scratch = Scratch::default();
        let first = files_of(&[
            ("haproxy.cfg", "global\n"),
            ("maps/hosts.map", "a web\n"),
            ("ssl/00/a.pem", "A"),
            ("ssl/01/b.pem", "B"),
        ]);
        let dir = scratch.update(&first).expect("a whole copy");
        assert_eq!(read_copy(&dir), as_map(&first));
        // Marked on disk: a file written again loses the mark.
        std::fs::write(dir.join("ssl/00/a.pem"), "marked").expect("mark");

        // One file changed, one gone, one in a new directory: only those are touched.
        let second = files_of(&[
            ("haproxy.cfg", "global\n    maxconn 10\n"),
            ("maps/hosts.map", "a web\n"),
            ("ssl/00/a.pem", "A"),
            ("ssl/3f/c.pem", "C"),
        ]);
        assert_eq!(scratch.update(&second).expect("updated"), dir);
        assert_eq!(
            std::fs::read(dir.join("ssl/00/a.pem")).expect("read"),
            b"marked",
            "an unchanged file is not written again"
        );
        std::fs::write(dir.join("ssl/00/a.pem"), "A").expect("unmark");
        assert_eq!(read_copy(&dir), as_map(&second));

        // A copy that cannot be updated in place (a file where a directory was): a whole one.
        let third = files_of(&[("haproxy.cfg", "global\n"), ("ssl", "a file now")]);
        assert_eq!(scratch.update(&third).expect("a whole copy again"), dir);
        assert_eq!(read_copy(&dir), as_map(&third));

        // A failed write leaves no record of the copy: the next update writes a whole one.
        let unsafe_set = files_of(&[("haproxy.cfg", "global\n"), ("../out", "x")]);
        assert!(
            scratch.update(&unsafe_set).is_err(),
            "an unsafe path is refused"
        );
        assert!(!dir.join("../out").exists());
        assert_eq!(scratch.update(&first).expect("a whole copy"), dir);
        assert_eq!(read_copy(&dir), as_map(&first));
    }

    fn set(config: &str, crt_list: &str) -> RenderedSet {
        let files: BTreeMap<String, Vec<u8>> = [
            ("haproxy.cfg", config),
            ("maps/certs.list", crt_list),
            ("maps/hosts.map", "a.test web\n"),
        ]
        .into_iter()
        .map(|(path, content)| (path.to_owned(), content.as_bytes().to_vec()))
        .collect();
        let files = haptic_render::FileSet::new(files);
        RenderedSet {
            checksum: files.checksum_hex(),
            files,
            config_generation: 1,
            term: std::time::SystemTime::now(),
            span: tracing::Span::none(),
            provenance: Default::default(),
            render_time: std::time::Duration::ZERO,
            requests: Default::default(),
        }
    }

    const CONFIG: &str = "global\n    maxconn 100\n\
        frontend https\n    bind :8443 ssl crt-list maps/certs.list\n    default_backend web\n\
        backend web\n    server s1 10.0.0.1:80\n    server s2 10.0.0.2:80\n";
    const LIST: &str = "certs/a.pem [alpn h2] a.test\n";

    /// The check against the last set that passed says what the whole check says: a change
    /// that breaks the policy in `haproxy.cfg` (in any section) or in a crt-list it names is
    /// refused, one that does not passes.
    #[test]
    fn a_check_since_the_last_pass_agrees_with_the_whole_check() {
        let policy = Policy::default();
        let base = policy_check_since(&policy, None, &set(CONFIG, LIST)).expect("the base passes");
        let cases = [
            // A server line rewritten in place.
            (
                CONFIG.replace("10.0.0.2:80", "10.0.0.3:80"),
                LIST.to_owned(),
                true,
            ),
            // Lua in `global`, a program in a section of its own, an external check.
            (
                CONFIG.replace("maxconn 100\n", "maxconn 100\n    lua-load /x.lua\n"),
                LIST.to_owned(),
                false,
            ),
            (
                format!("{CONFIG}program evil\n    command /bin/sh\n"),
                LIST.to_owned(),
                false,
            ),
            (
                CONFIG.replace("    server s1", "    option external-check\n    server s1"),
                LIST.to_owned(),
                false,
            ),
            // A crt-list line naming a file outside the set; one inside it.
            (
                CONFIG.to_owned(),
                format!("{LIST}/etc/ssl/private/x.pem b.test\n"),
                false,
            ),
            (
                CONFIG.to_owned(),
                format!("{LIST}certs/b.pem b.test\n"),
                true,
            ),
            // Nothing changed.
            (CONFIG.to_owned(), LIST.to_owned(), true),
        ];
        for (config, list, passes) in cases {
            let changed = set(&config, &list);
            let whole = policy_check(&policy, &changed);
            let since = policy_check_since(&policy, Some(&base), &changed);
            assert_eq!(
                whole.is_ok(),
                passes,
                "whole check of {config}{list}: {whole:?}"
            );
            assert_eq!(
                since.is_ok(),
                passes,
                "check since the base of {config}{list}: {since:?}"
            );
            if let (Err(whole), Err(since)) = (&whole, &since) {
                assert_eq!(whole, since);
            }
        }
    }
}
