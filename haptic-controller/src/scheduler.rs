//! The deployment scheduler and deployer (leader only).
//!
//! Each pod is its own pipeline, so one slow or failing pod never holds up the others: the
//! scheduler starts an apply of the latest deployable set on every pod whose live set (as the
//! last answer said) differs from it and has nothing in flight, at least
//! `minDeploymentInterval` after that pod's previous apply when that one reloaded HAProxy or
//! failed ([`Pacing`]; one the agent made through HAProxy's runtime API paces nothing: the
//! next change goes as soon as it is rendered). That gives every rule at once:
//! unchanged sets and pod sets are skipped (nothing differs), one pending slot with the latest
//! set winning (only the newest set is ever sent next), a pod that appears gets the last good
//! set with no re-render, and a failing pod is retried with backoff. Each apply runs under a
//! watchdog of `deploymentTimeout`.
//!
//! Every apply carries the term's epoch, this replica's identity and a generation that rises
//! with every new set (microseconds since the Unix epoch, or one more than the last: it keeps
//! rising across restarts, which matters in disabled mode where the epoch stays 0). A fenced
//! refusal above our epoch gets one `reclaim`; a second, or `ForeignLeader`, ends the term.
//!
//! Deltas: a pod whose live set (as its last answer said) is one of the sets this leader
//! still holds ([`HELD_SETS`]: those live on some pod, and the newest) gets only what changed
//! against it (`/v1/apply-delta`, encoded once per base). An agent that does not hold that
//! base answers `base_mismatch` with the checksum it holds: a delta against that one when this
//! leader holds it, else the whole set at once (no backoff). An agent older than deltas
//! answers 404 and gets only whole sets until its address changes (a new pod).
//!
//! A pod whose live set is unknown (a new leader's first apply, a new pod, drift) is first sent
//! the desired set as a delta of no paths against itself: an agent that already holds it (the
//! usual handoff, where both replicas rendered the same resources) raises its fence to this
//! term's epoch and answers `unchanged`, so a new leader's first apply re-sends nothing the
//! agents have (a few hundred bytes instead of the whole ~10 MB set at 10,000 Ingresses); one
//! that does not answers `base_mismatch` naming what it holds, which costs one round trip. The
//! fence rules are the same as for any apply: the agent records the epoch before it answers.
//!
//! Checksums: every set goes out with its checksum in `haptic-checksum`'s second form (`v2-`
//! and 64 hex digits: per-file chunked digests, which the render, and an agent rebuilding a
//! set from a delta, hash in proportion to the change). An agent older than that form refuses
//! it (400 naming the checksum, `refuses_the_second_form`); that pod gets whole sets with the
//! first form's checksum from then on, at once and with no backoff, until its address changes
//! (a new pod: the upgraded agent), and is up to date when it runs the first form of the
//! desired set.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, SystemTime},
};

use haptic_agent_client::{
    AgentClient, ApplyRequest, ClientConfig, DeltaRequest, Error as ClientError, FileSet, Form,
    Target,
    client::{ApplyReport, PreparedApply, PreparedDelta},
};
use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use tokio::{task::JoinSet, time::Instant};
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use crate::{
    channel::AgentChannel,
    config::AgentSettings,
    events::{
        ControllerEvent, DeploymentReport, FencedRefusal, Kind, PodOutcome, PodSet, RenderedSet,
        TokenState,
    },
};

/// How many sets the scheduler keeps as delta bases (the desired one first, then those live on
/// some pod). Each is the whole set (about 7 MB at 10,000 Ingresses).
pub const HELD_SETS: usize = 3;

/// Backoff of a failing pod: doubling from this...
const BACKOFF_INITIAL: Duration = Duration::from_millis(500);
/// ...up to this.
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The component: subscribe now, run the returned future.
pub fn component(
    channel: AgentChannel,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let events = ctx.bus().subscribe_leader_only(
        "deployer",
        Filter::kinds([
            Kind::BecameLeader,
            Kind::Deployable,
            Kind::PodSet,
            Kind::AgentToken,
            Kind::ConfigValidated,
            Kind::DriftDetected,
        ]),
    );
    async move {
        let mut scheduler = Scheduler::new(ctx, channel);
        scheduler.run(events).await;
    }
}

/// Whether a drift report (a pod whose live checksum `reported` is not the one in the last
/// `Deployed` report) is drift to this scheduler, which knows more: the pod's own answers
/// (`known`, what it confirmed live) and whether an apply to it is in flight. The monitor's
/// expectation comes from `Deployed` reports, which wait for every pod's answer: a pod that
/// answered a newer set before the others is no drift, and neither is a pod an apply is
/// changing (what it answers settles what is live; the next check looks again). Before,
/// such reports made the pod's live set unknown mid-stream, and its next apply a claim.
fn is_drift(known: Option<&str>, in_flight: bool, reported: Option<&str>) -> bool {
    !in_flight && (reported.is_none() || known != reported)
}

struct Failure {
    checksum: String,
    attempts: u32,
    /// None: not retried for this checksum (the agent refused the set itself).
    retry_at: Option<Instant>,
    message: String,
}

struct Prepared {
    checksum: String,
    epoch: u64,
    request: Arc<ApplyRequest>,
    /// The whole set, encoded when a pod first needs it.
    whole: Option<Arc<PreparedApply>>,
    /// Deltas by base checksum, encoded when a pod first needs one.
    deltas: BTreeMap<String, Arc<PreparedDelta>>,
    /// The whole set with its checksum in the first form, and that checksum, encoded when a
    /// pod whose agent is older than the second form first needs it.
    whole_v1: Option<(Arc<PreparedApply>, String)>,
}

/// What one apply sends.
#[derive(Clone)]
enum Body {
    Whole(Arc<PreparedApply>),
    Delta(Arc<PreparedDelta>),
}

type Answer = (String, String, Result<ApplyReport, ClientError>);
/// An apply task's end: the answer, how long it took, and the apply's span.
type Finished = (
    String,
    String,
    Result<ApplyReport, ClientError>,
    Duration,
    tracing::Span,
);

struct Scheduler {
    ctx: LeaderContext<ControllerEvent>,
    /// How agents are reached (mutual TLS by default).
    channel: AgentChannel,
    term: Option<SystemTime>,
    desired: Option<Arc<RenderedSet>>,
    prepared: Option<Prepared>,
    pods: Arc<PodSet>,
    client: Option<AgentClient>,
    token: Option<Arc<TokenState>>,
    settings: Option<AgentSettings>,
    live: BTreeMap<String, String>,
    failed: BTreeMap<String, Failure>,
    pacing: Pacing,
    in_flight: BTreeSet<String>,
    tasks: JoinSet<Finished>,
    generation: u64,
    reclaimed_above: Option<u64>,
    targets: BTreeMap<String, Target>,
    /// Sets sent in this term, by checksum (newest first, at most [`HELD_SETS`]): the bases
    /// deltas are made against. The requests themselves, shared: a copy of a set's file list
    /// each change was 12,500 paths allocated again at 10,000 Ingresses.
    held: Vec<(String, Arc<ApplyRequest>)>,
    /// Pods that get the whole set next (their agent did not hold a delta's base).
    whole_next: BTreeSet<String>,
    /// Pods whose agent does not take deltas (older than them), with the URL it answered at.
    no_deltas: BTreeMap<String, String>,
    /// Pods whose agent refused the second form of the checksum (older than it), with the URL
    /// it answered at: they get whole sets with the first form's.
    v1_only: BTreeMap<String, String>,
    /// What a pod's agent said it holds when it refused a delta's base (`base_mismatch`): the
    /// next delta's base, when this leader holds that set.
    found: BTreeMap<String, String>,
}

impl Scheduler {
    fn new(ctx: LeaderContext<ControllerEvent>, channel: AgentChannel) -> Self {
        Self {
            ctx,
            channel,
            term: None,
            desired: None,
            prepared: None,
            pods: Arc::default(),
            client: None,
            token: None,
            settings: None,
            live: BTreeMap::new(),
            failed: BTreeMap::new(),
            pacing: Pacing::default(),
            in_flight: BTreeSet::new(),
            tasks: JoinSet::new(),
            generation: 0,
            reclaimed_above: None,
            targets: BTreeMap::new(),
            held: Vec::new(),
            whole_next: BTreeSet::new(),
            no_deltas: BTreeMap::new(),
            v1_only: BTreeMap::new(),
            found: BTreeMap::new(),
        }
    }

    async fn run(&mut self, mut events: haptic_eventbus::Subscription<ControllerEvent>) {
        loop {
            self.dispatch();
            let wake = self.next_wake();
            tokio::select! {
                () = self.ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    self.on_event(&event);
                }
                Some(joined) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                    match joined {
                        Ok((pod, checksum, result, took, span)) => {
                            // A delta whose base the agent lacks is no failed deployment:
                            // the whole set follows at once (a new pod's first contact).
                            let ok = matches!(
                                &result,
                                Ok(_)
                                    | Err(ClientError::BaseMismatch { .. }
                                        | ClientError::DeltasUnsupported { .. })
                            );
                            crate::metrics::get().deployment(took, ok);
                            if !self.on_answer((pod, checksum, result)).instrument(span).await {
                                return;
                            }
                        }
                        Err(error) => error!(%error, "an apply task panicked"),
                    }
                    self.report();
                }
                () = sleep_until(wake) => {}
            }
        }
    }

    fn on_event(&mut self, event: &ControllerEvent) {
        match event {
            ControllerEvent::BecameLeader(became) => self.term = Some(became.at),
            ControllerEvent::Deployable(set) if Some(set.term) == self.term => {
                self.desired = Some(set.clone());
                self.report();
            }
            ControllerEvent::PodSet(pods) => {
                self.pods = pods.clone();
                self.targets.retain(|name, _| pods.pods.contains_key(name));
                self.live.retain(|name, _| pods.pods.contains_key(name));
                self.failed.retain(|name, _| pods.pods.contains_key(name));
                self.whole_next.retain(|name| pods.pods.contains_key(name));
                self.found.retain(|name, _| pods.pods.contains_key(name));
                // A pod at a new address is a new agent: it may take deltas.
                self.no_deltas
                    .retain(|name, url| pods.pods.get(name).is_some_and(|pod| pod.url == *url));
                self.v1_only
                    .retain(|name, url| pods.pods.get(name).is_some_and(|pod| pod.url == *url));
                self.report();
            }
            ControllerEvent::AgentToken(token) => {
                if self.token.as_ref() == Some(token) {
                    return;
                }
                self.token = Some(token.clone());
                self.rebuild_client();
            }
            ControllerEvent::ConfigValidated(config) => {
                let changed = self.settings.as_ref() != Some(&config.agent);
                self.settings = Some(config.agent.clone());
                if changed {
                    self.rebuild_client();
                }
            }
            ControllerEvent::DriftDetected { pod, live } => {
                if !is_drift(
                    self.live.get(&**pod).map(String::as_str),
                    self.in_flight.contains(&**pod),
                    live.as_deref(),
                ) {
                    debug!(%pod, live = ?live, "drift report behind this scheduler's own answers; nothing to re-apply");
                    return;
                }
                info!(%pod, live = ?live, "drift: re-applying the last deployed set");
                self.live.remove(&**pod);
                self.found.remove(&**pod);
                self.failed.remove(&**pod);
            }
            _ => {}
        }
    }

    fn rebuild_client(&mut self) {
        self.prepared = None;
        self.failed.clear();
        let (Some(token), Some(settings)) = (&self.token, &self.settings) else {
            return;
        };
        self.client = match &**token {
            TokenState::Present(token) => {
                let config = self.channel.client_config(
                    ClientConfig::new(token.clone())
                        .with_request_timeout(settings.deployment_timeout)
                        .with_retries(2, Duration::from_millis(200)),
                );
                match AgentClient::new(config) {
                    Ok(client) => Some(client),
                    Err(error) => {
                        error!(%error, "cannot build the agent client; deployments wait");
                        None
                    }
                }
            }
            TokenState::Missing { reason } => {
                warn!(%reason, "no agent token: deployments wait for it");
                None
            }
        };
    }

    /// What `pod` gets for the desired set at the current epoch: a delta against its live
    /// set when this leader holds that set and the pod takes deltas (against the desired set
    /// itself, of no paths, when its live set is unknown), else the whole set. Each body is
    /// encoded once for every pod that gets it.
    fn body_for(&mut self, pod: &str) -> Option<Body> {
        self.prepared()?;
        let client = self.client.clone()?;
        if self.v1_only.contains_key(pod) {
            let prepared = self.prepared.as_mut()?;
            let (whole, _) = prepared.whole_v1.get_or_insert_with(|| {
                let request = &prepared.request;
                let checksum = request.files.checksum_as(Form::V1);
                let v1 = ApplyRequest {
                    checksum: checksum.clone(),
                    ..ApplyRequest::clone(request)
                };
                (Arc::new(client.prepare(&v1)), checksum)
            });
            return Some(Body::Whole(whole.clone()));
        }
        let takes_deltas = !self.whole_next.contains(pod) && !self.no_deltas.contains_key(pod);
        let known = self.live.get(pod).or_else(|| self.found.get(pod)).cloned();
        let prepared = self.prepared.as_mut()?;
        let base = takes_deltas.then(|| known.unwrap_or_else(|| prepared.checksum.clone()));
        if let Some(base) = base {
            if let Some(delta) = prepared.deltas.get(&base) {
                return Some(Body::Delta(delta.clone()));
            }
            if base == prepared.checksum {
                let request = &prepared.request;
                let claim = DeltaRequest {
                    epoch: request.epoch,
                    leader: request.leader.clone(),
                    generation: request.generation,
                    base: base.clone(),
                    checksum: request.checksum.clone(),
                    files: BTreeMap::new(),
                    patches: BTreeMap::new(),
                    removed: Vec::new(),
                };
                debug!(%pod, "the pod's live set is unknown: claiming it with the desired set, no paths");
                let delta = Arc::new(client.prepare_delta(&claim));
                prepared.deltas.insert(base, delta.clone());
                return Some(Body::Delta(delta));
            }
            if let Some((_, held)) = self.held.iter().find(|(checksum, _)| *checksum == base) {
                let delta = DeltaRequest::between(&held.files, &base, &prepared.request);
                debug!(%pod, %base, changed = delta.files.len(), removed = delta.removed.len(), "delta prepared");
                let delta = Arc::new(client.prepare_delta(&delta));
                prepared.deltas.insert(base, delta.clone());
                return Some(Body::Delta(delta));
            }
        }
        let whole = prepared
            .whole
            .get_or_insert_with(|| Arc::new(client.prepare(&prepared.request)));
        Some(Body::Whole(whole.clone()))
    }

    /// Keeps `request`'s files as a delta base, newest first, dropping sets no pod runs
    /// beyond [`HELD_SETS`].
    fn hold(&mut self, request: &Arc<ApplyRequest>) {
        let checksum = &request.checksum;
        self.held.retain(|(held, _)| held != checksum);
        self.held.insert(0, (checksum.clone(), Arc::clone(request)));
        let live: BTreeSet<&String> = self.live.values().collect();
        let mut kept = 0;
        self.held.retain(|(held, _)| {
            kept += 1;
            kept == 1 || (kept <= HELD_SETS && live.contains(held))
        });
    }

    /// The request for the desired set at the current epoch.
    fn prepared(&mut self) -> Option<Arc<ApplyRequest>> {
        let desired = self.desired.clone()?;
        self.client.as_ref()?;
        let epoch = self.ctx.epoch();
        if let Some(p) = &self.prepared
            && p.checksum == desired.checksum
            && p.epoch == epoch
        {
            return Some(p.request.clone());
        }
        // The render's files share the bytes of those it rendered the same before: the held
        // sets cost what changed between them, not 15 MB each at 10,000 Ingresses, and a
        // delta against one of them finds its unchanged files by address.
        let files = match FileSet::from_files(desired.files.files().clone()) {
            Ok(files) => files,
            Err(error) => {
                error!(%error, "the rendered set breaks the apply protocol's rules; not deploying it");
                self.desired = None;
                return None;
            }
        };
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        self.generation = now.max(self.generation + 1);
        // The render's checksum has the protocol's framing: not hashed again.
        let request = match ApplyRequest::with_checksum(
            epoch,
            self.ctx.identity(),
            self.generation,
            files,
            desired.checksum.clone(),
        ) {
            Ok(request) => request,
            Err(error) => {
                error!(%error, "the rendered set cannot be sent; not deploying it");
                self.desired = None;
                return None;
            }
        };
        let request = Arc::new(request);
        self.hold(&request);
        self.prepared = Some(Prepared {
            checksum: desired.checksum.clone(),
            epoch,
            request: request.clone(),
            whole: None,
            deltas: BTreeMap::new(),
            whole_v1: None,
        });
        Some(request)
    }

    /// Whether `pod`'s live set, as its agent last answered, is `desired`: its checksum, or
    /// (an agent older than the second form) the first form of it that was sent there.
    fn runs(&self, pod: &str, desired: &RenderedSet) -> bool {
        self.live.get(pod).is_some_and(|live| {
            *live == desired.checksum
                || self.prepared.as_ref().is_some_and(|prepared| {
                    prepared.checksum == desired.checksum
                        && prepared.whole_v1.as_ref().is_some_and(|(_, v1)| v1 == live)
                })
        })
    }

    fn target(&mut self, pod: &str) -> Option<Target> {
        let url = &self.pods.pods.get(pod)?.url;
        if let Some(t) = self.targets.get(pod).filter(|t| t.url.as_str() == url) {
            return Some(t.clone());
        }
        match Target::new(pod, url) {
            Ok(t) => {
                self.targets.insert(pod.to_owned(), t.clone());
                Some(t)
            }
            Err(error) => {
                warn!(%pod, %error, "the pod's agent URL is invalid");
                None
            }
        }
    }

    /// Starts an apply on every pod that needs one and may get one now.
    fn dispatch(&mut self) {
        let Some(desired) = self.desired.clone() else {
            return;
        };
        let Some(settings) = self.settings.clone() else {
            return;
        };
        // No freshness guard here on purpose: the agents' fence is what keeps a stale leader's
        // set from going live, and the tests exercise it through this very path.
        if self.client.is_none() {
            return;
        }
        let now = Instant::now();
        let pods: Vec<String> = self.pods.pods.keys().cloned().collect();
        for pod in pods {
            if settings.max_parallel > 0 && self.in_flight.len() >= settings.max_parallel {
                break;
            }
            if self.in_flight.contains(&pod) || self.runs(&pod, &desired) {
                continue;
            }
            if let Some(f) = self.failed.get(&pod)
                && f.checksum == desired.checksum
                && f.retry_at.is_none_or(|at| at > now)
            {
                continue;
            }
            if self
                .pacing
                .next(&pod, settings.min_deployment_interval)
                .is_some_and(|at| at > now)
            {
                continue;
            }
            let Some(body) = self.body_for(&pod) else {
                return;
            };
            let Some(target) = self.target(&pod) else {
                // An address that is no URL: retried later (the pod may be updated), not in a
                // tight loop.
                self.failed.insert(
                    pod.clone(),
                    Failure {
                        checksum: desired.checksum.clone(),
                        attempts: 1,
                        retry_at: Some(now + BACKOFF_MAX),
                        message: "the pod's agent URL is invalid".to_owned(),
                    },
                );
                continue;
            };
            let Some(client) = self.client.clone() else {
                return;
            };
            let checksum = desired.checksum.clone();
            let watchdog = settings.deployment_timeout;
            self.in_flight.insert(pod.clone());
            self.pacing.started(&pod, now);
            let span = info_span!(parent: &desired.span, "apply", %pod);
            let answer_span = span.clone();
            self.whole_next.remove(&pod);
            let apply = async move {
                let sent = async {
                    match &body {
                        Body::Whole(body) => client.apply_prepared(&target.url, body).await,
                        Body::Delta(delta) => client.apply_delta_prepared(&target.url, delta).await,
                    }
                };
                let result = match tokio::time::timeout(watchdog, sent).await {
                    Ok(result) => result,
                    Err(_) => Err(ClientError::Unavailable {
                        attempts: 1,
                        message: format!("deployment watchdog: no answer within {watchdog:?}"),
                    }),
                };
                (target.name, checksum, result, now.elapsed(), answer_span)
            };
            self.tasks.spawn(apply.instrument(span));
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        let desired = self.desired.as_ref()?;
        let settings = self.settings.as_ref()?;
        self.client.as_ref()?;
        self.pods
            .pods
            .keys()
            .filter(|p| !self.in_flight.contains(*p) && !self.runs(p, desired))
            .filter_map(|p| {
                let interval = self.pacing.next(p, settings.min_deployment_interval);
                let backoff = match self.failed.get(p) {
                    Some(f) if f.checksum == desired.checksum => Some(f.retry_at?),
                    _ => None,
                };
                Some(
                    interval
                        .into_iter()
                        .chain(backoff)
                        .max()
                        .unwrap_or_else(Instant::now),
                )
            })
            .min()
    }

    /// Handles one pod's answer; false when the term must end.
    async fn on_answer(&mut self, (pod, checksum, result): Answer) -> bool {
        self.in_flight.remove(&pod);
        let error = match result {
            Ok(report) => {
                debug!(%pod, checksum = %report.checksum, outcome = ?report.outcome, reload = report.reload, "apply answered: live");
                self.pacing.answered(&pod, report.reload);
                self.live.insert(pod.clone(), report.checksum);
                self.found.remove(&pod);
                self.failed.remove(&pod);
                return true;
            }
            Err(error) => error,
        };
        let (retry, message) = match &error {
            ClientError::BaseMismatch { live_checksum } => {
                // Not a failure: a delta against what the agent holds when this leader holds
                // it too (tried once), else the whole set, at once.
                self.live.remove(&pod);
                self.pacing.forget(&pod);
                let held = live_checksum.as_ref().filter(|live| {
                    self.found.get(&pod) != Some(*live)
                        && self.held.iter().any(|(checksum, _)| checksum == *live)
                });
                if let Some(live) = held {
                    debug!(%pod, %live, "the agent does not hold the delta's base but one this leader holds; a delta against it");
                    self.found.insert(pod.clone(), live.clone());
                } else {
                    debug!(%pod, ?live_checksum, "the agent does not hold the delta's base; sending the whole set");
                    self.found.remove(&pod);
                    self.whole_next.insert(pod.clone());
                }
                return true;
            }
            ClientError::Rejected { message, .. }
                if refuses_the_second_form(&checksum, &error)
                    && !self.v1_only.contains_key(&pod) =>
            {
                // Whole sets with the first form's checksum, at once, until the pod's address
                // changes (a new pod: the upgraded agent).
                info!(%pod, %message, "the agent refused a second-form checksum (an older agent): whole sets with first-form checksums from now on");
                if let Some(url) = self.pods.pods.get(&pod).map(|p| p.url.clone()) {
                    self.v1_only.insert(pod.clone(), url);
                }
                self.live.remove(&pod);
                self.found.remove(&pod);
                self.pacing.forget(&pod);
                return true;
            }
            ClientError::DeltasUnsupported { status } => {
                info!(%pod, status, "the agent takes no deltas (an older agent): whole sets from now on");
                if let Some(url) = self.pods.pods.get(&pod).map(|p| p.url.clone()) {
                    self.no_deltas.insert(pod.clone(), url);
                }
                self.pacing.forget(&pod);
                return true;
            }
            ClientError::Fenced { fence, epoch } => {
                let fenced = |outcome: String| {
                    ControllerEvent::Fenced(Arc::new(FencedRefusal {
                        pod: pod.to_string(),
                        fence: *fence,
                        epoch: *epoch,
                        outcome,
                    }))
                };
                if self.reclaimed_above.is_some_and(|f| f >= *fence) {
                    error!(%pod, fence, epoch, "fenced again after reclaiming: another leader; standing down");
                    self.ctx
                        .bus()
                        .publish(fenced("stood down: fenced again after reclaiming".into()));
                    self.ctx.stand_down(haptic_leadership::STOOD_DOWN);
                    return false;
                }
                self.reclaimed_above = Some(*fence);
                match self.ctx.reclaim(*fence).await {
                    Ok(new) => {
                        warn!(%pod, fence, new_epoch = new, "an agent holds a higher fence; reclaimed the epoch above it");
                        self.ctx
                            .bus()
                            .publish(fenced(format!("reclaimed: epoch raised to {new}")));
                        self.prepared = None;
                        self.pacing.forget(&pod);
                        return true;
                    }
                    Err(haptic_epoch::Error::ForeignLeader { .. }) => {
                        warn!(%pod, fence, "another replica leads: stopping every write of this term");
                        self.ctx
                            .bus()
                            .publish(fenced("stood down: another replica holds the Lease".into()));
                        return false;
                    }
                    Err(e) => {
                        let message = format!("fenced at {fence}; reclaiming failed: {e}");
                        self.ctx.bus().publish(fenced(message.clone()));
                        (true, message)
                    }
                }
            }
            ClientError::Invalid { check_output } => (
                false,
                format!("the agent's haproxy -c refused the set: {check_output}"),
            ),
            ClientError::RolledBack { reason, .. } => (
                false,
                format!("the set failed to load and was rolled back: {reason}"),
            ),
            ClientError::Superseded { .. } => {
                // A newer generation of this epoch is live there: send the set afresh.
                self.prepared = None;
                (true, error.to_string())
            }
            other => (true, other.to_string()),
        };
        warn!(%pod, %checksum, error = %message, retry, "apply failed");
        let attempts = self
            .failed
            .get(&pod)
            .filter(|f| f.checksum == checksum)
            .map_or(0, |f| f.attempts)
            + 1;
        let retry_at = retry.then(|| {
            Instant::now() + (BACKOFF_INITIAL * 2u32.saturating_pow(attempts - 1)).min(BACKOFF_MAX)
        });
        self.failed.insert(
            pod,
            Failure {
                checksum,
                attempts,
                retry_at,
                message,
            },
        );
        true
    }

    fn report(&self) {
        let Some(desired) = &self.desired else { return };
        let pods = self
            .pods
            .pods
            .keys()
            .map(|p| {
                let outcome = if self.runs(p, desired) {
                    PodOutcome::Live
                } else if let Some(f) = self
                    .failed
                    .get(p)
                    .filter(|f| f.checksum == desired.checksum)
                {
                    PodOutcome::Failed(f.message.clone())
                } else {
                    PodOutcome::Pending
                };
                (p.clone(), outcome)
            })
            .collect();
        self.ctx
            .bus()
            .publish(ControllerEvent::Deployed(Arc::new(DeploymentReport {
                checksum: desired.checksum.clone(),
                config_generation: desired.config_generation,
                pods,
                live: self.live.clone(),
            })));
    }
}

/// Whether `error` is what an agent older than the checksum's second form answers an apply
/// whose checksum (`sent`) is in it: 400 naming the checksum (a whole set: "checksum
/// mismatch: request says v2-..., files hash to <first form>"; a delta: "... files hash to not
/// 64 lowercase hex digits"). An agent of the second form says so only of a checksum that is
/// not its files', which a first-form retry then settles the same way.
fn refuses_the_second_form(sent: &str, error: &ClientError) -> bool {
    matches!(error, ClientError::Rejected { status: 400, message } if message.contains("checksum"))
        && Form::of(sent) == Some(Form::V2)
}

/// When each pod may get its next apply. `minDeploymentInterval` exists to space HAProxy's
/// reloads (each one starts a worker, and the old one lingers while it drains its
/// connections), so it counts from the start of an apply that reloaded, or whose answer is
/// still out, or that failed (a failure has its backoff on top). An apply the agent made
/// through the runtime API (or found already live) paces nothing: the pod's next apply starts
/// as soon as there is a newer set. Applies to a pod still go one at a time, the newest set
/// only, so a stream of changes is batched by the time an apply takes, and two reloads of a
/// pod are always `minDeploymentInterval` apart: after the first, nothing starts sooner.
#[derive(Debug, Default)]
struct Pacing {
    /// The start of each pod's last apply that paces the next one.
    since: BTreeMap<String, Instant>,
}

impl Pacing {
    /// An apply to `pod` started `at`: it paces the next until its answer says otherwise.
    fn started(&mut self, pod: &str, at: Instant) {
        self.since.insert(pod.to_owned(), at);
    }

    /// The pod answered that its set is live, having reloaded HAProxy or not.
    fn answered(&mut self, pod: &str, reloaded: bool) {
        if !reloaded {
            self.since.remove(pod);
        }
    }

    /// The pod's next apply goes at once (an answer that is no failure of the set: a delta's
    /// base the agent lacked, an agent older than deltas, a fence reclaimed).
    fn forget(&mut self, pod: &str) {
        self.since.remove(pod);
    }

    /// The earliest the pod's next apply may start, when anything paces it.
    fn next(&self, pod: &str, interval: Duration) -> Option<Instant> {
        self.since.get(pod).map(|at| *at + interval)
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{ClientError, Pacing, is_drift, refuses_the_second_form};

    #[test]
    fn only_a_reload_or_an_unanswered_or_failed_apply_paces_the_next() {
        let interval = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut pacing = Pacing::default();
        assert_eq!(pacing.next("a", interval), None, "a pod never applied to");

        // In flight, then failed (no answer of a live set): paced from the start.
        pacing.started("a", t0);
        assert_eq!(pacing.next("a", interval), Some(t0 + interval));

        // Reloaded: paced from that apply's start.
        let t1 = t0 + Duration::from_secs(5);
        pacing.started("a", t1);
        pacing.answered("a", true);
        assert_eq!(pacing.next("a", interval), Some(t1 + interval));

        // Applied through the runtime API: the next goes at once.
        let t2 = t1 + Duration::from_secs(5);
        pacing.started("a", t2);
        assert_eq!(
            pacing.next("a", interval),
            Some(t2 + interval),
            "unanswered"
        );
        pacing.answered("a", false);
        assert_eq!(pacing.next("a", interval), None);

        // Pods are paced each on its own.
        pacing.started("b", t2);
        pacing.answered("b", true);
        assert_eq!(pacing.next("a", interval), None);
        assert_eq!(pacing.next("b", interval), Some(t2 + interval));
        pacing.forget("b");
        assert_eq!(pacing.next("b", interval), None);
    }

    /// The scheduler sends a render's own checksum as the protocol's: they must be one.
    #[test]
    fn an_older_agents_refusal_of_the_second_form_is_told_from_others() {
        let sent = format!("v2-{}", "a".repeat(64));
        let rejected = |status, message: &str| ClientError::Rejected {
            status,
            message: message.to_owned(),
        };
        // What an agent before the second form answered, word for word (its `WireApply` and
        // `WireDelta` decoding, through its server's `bad_request`).
        let whole = rejected(
            400,
            &format!(
                "checksum mismatch: request says {sent}, files hash to {}",
                "b".repeat(64)
            ),
        );
        let delta = rejected(
            400,
            &format!(
                "checksum mismatch: request says {sent}, files hash to not 64 lowercase hex digits"
            ),
        );
        assert!(refuses_the_second_form(&sent, &whole));
        assert!(refuses_the_second_form(&sent, &delta));
        // A first-form apply refused, another refusal, another status: no fallback.
        assert!(!refuses_the_second_form(&"a".repeat(64), &whole));
        assert!(!refuses_the_second_form(
            &sent,
            &rejected(400, "path \"../x\" refused")
        ));
        assert!(!refuses_the_second_form(&sent, &rejected(422, "checksum")));
        assert!(!refuses_the_second_form(&sent, &ClientError::Unauthorized));
    }

    #[test]
    fn a_rendered_sets_checksum_is_the_protocols() {
        let files: std::collections::BTreeMap<String, Vec<u8>> = [
            ("haproxy.cfg", "global\n"),
            ("maps/a.map", "k v\n"),
            ("ssl/c.pem", ""),
        ]
        .into_iter()
        .map(|(path, content)| (path.to_owned(), content.as_bytes().to_vec()))
        .collect();
        let rendered = haptic_render::FileSet::new(files);
        assert_eq!(
            rendered.checksum_hex(),
            haptic_agent_client::protocol::checksum(rendered.iter())
        );
    }

    #[test]
    fn a_pod_that_answered_newer_than_the_deployed_report_is_no_drift() {
        // The pod answered `b`; the last Deployed report still says `a`.
        assert!(!is_drift(Some("b"), false, Some("b")));
        // A file changed by hand: the live checksum is neither.
        assert!(is_drift(Some("b"), false, Some("c")));
        // An apply in flight settles what is live.
        assert!(!is_drift(Some("a"), true, Some("b")));
        // Nothing live, or nothing known of the pod: drift.
        assert!(is_drift(Some("a"), false, None));
        assert!(is_drift(None, false, Some("a")));
    }
}
