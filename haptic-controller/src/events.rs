//! The controller's events on its bus: the leadership adapter's four, and what the components
//! tell each other. Config, token, pod set, config verdict and the last render are sticky: a
//! component built on `BecameLeader` receives their current value on subscribing.

use std::{collections::BTreeMap, sync::Arc, time::SystemTime};

use haptic_eventbus::Event;
use haptic_leadership::{BecameLeader, LeaderElectionStarted, LostLeadership, NewLeaderObserved};
use haptic_render::FileSet;

use crate::config::ValidatedConfig;

/// An event on the controller's bus.
#[derive(Debug, Clone)]
pub enum ControllerEvent {
    /// The elector started.
    ElectionStarted(LeaderElectionStarted),
    /// This replica leads, with an epoch.
    BecameLeader(BecameLeader),
    /// This replica's term ended.
    LostLeadership(LostLeadership),
    /// Someone (maybe this replica) leads.
    NewLeader(NewLeaderObserved),
    /// The running config changed (sticky).
    ConfigValidated(Arc<ValidatedConfig>),
    /// The latest verdict on the HTC, valid or not, for status (sticky).
    ConfigVerdict(Arc<ConfigVerdict>),
    /// The agents' bearer token (sticky).
    AgentToken(Arc<TokenState>),
    /// The HAProxy pods that get the config (sticky).
    PodSet(Arc<PodSet>),
    /// A store's contents changed (or all stores finished their first list).
    StoresChanged {
        /// The store, or `*` when the stores were rebuilt for a new config.
        store: Arc<str>,
    },
    /// Render now.
    RenderTrigger {
        /// Why: `change`, `became_leader`, `config`.
        reason: &'static str,
        /// When the reconciler saw the first store change this render covers (none for a
        /// trigger that is no change): `haptic_change_to_render_seconds` measures from it.
        since: Option<std::time::Instant>,
    },
    /// A render succeeded (sticky: the last good render).
    Rendered(Arc<RenderedSet>),
    /// A render failed.
    RenderFailed(Arc<RenderFailure>),
    /// The render gate's judgement of a set.
    GateVerdict(Arc<GateVerdict>),
    /// HAProxy refused a line or file one object produced: the coordinator renders again
    /// without it.
    Exclude(Arc<Exclusion>),
    /// A set the gate lets through to the scheduler.
    Deployable(Arc<RenderedSet>),
    /// The outcome of one deployment across the pods.
    Deployed(Arc<DeploymentReport>),
    /// An agent refused this term's epoch: its fence is at or above it (a stale leader noticed).
    Fenced(Arc<FencedRefusal>),
    /// A pod's live set is not the last one deployed there.
    DriftDetected {
        /// The pod.
        pod: Arc<str>,
        /// What it serves (none: nothing, or unknown).
        live: Option<String>,
    },
}

/// The kinds of [`ControllerEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Kind {
    ElectionStarted,
    BecameLeader,
    LostLeadership,
    NewLeader,
    ConfigValidated,
    ConfigVerdict,
    AgentToken,
    PodSet,
    StoresChanged,
    RenderTrigger,
    Rendered,
    RenderFailed,
    GateVerdict,
    Exclude,
    Deployable,
    Deployed,
    Fenced,
    DriftDetected,
}

/// The sticky kinds.
pub const STICKY: [Kind; 5] = [
    Kind::ConfigValidated,
    Kind::ConfigVerdict,
    Kind::AgentToken,
    Kind::PodSet,
    Kind::Rendered,
];

impl Event for ControllerEvent {
    type Kind = Kind;

    fn kind(&self) -> Kind {
        match self {
            Self::ElectionStarted(_) => Kind::ElectionStarted,
            Self::BecameLeader(_) => Kind::BecameLeader,
            Self::LostLeadership(_) => Kind::LostLeadership,
            Self::NewLeader(_) => Kind::NewLeader,
            Self::ConfigValidated(_) => Kind::ConfigValidated,
            Self::ConfigVerdict(_) => Kind::ConfigVerdict,
            Self::AgentToken(_) => Kind::AgentToken,
            Self::PodSet(_) => Kind::PodSet,
            Self::StoresChanged { .. } => Kind::StoresChanged,
            Self::RenderTrigger { .. } => Kind::RenderTrigger,
            Self::Rendered(_) => Kind::Rendered,
            Self::RenderFailed(_) => Kind::RenderFailed,
            Self::GateVerdict(_) => Kind::GateVerdict,
            Self::Exclude(_) => Kind::Exclude,
            Self::Deployable(_) => Kind::Deployable,
            Self::Deployed(_) => Kind::Deployed,
            Self::Fenced(_) => Kind::Fenced,
            Self::DriftDetected { .. } => Kind::DriftDetected,
        }
    }
}

impl From<LeaderElectionStarted> for ControllerEvent {
    fn from(e: LeaderElectionStarted) -> Self {
        Self::ElectionStarted(e)
    }
}
impl From<BecameLeader> for ControllerEvent {
    fn from(e: BecameLeader) -> Self {
        Self::BecameLeader(e)
    }
}
impl From<LostLeadership> for ControllerEvent {
    fn from(e: LostLeadership) -> Self {
        Self::LostLeadership(e)
    }
}
impl From<NewLeaderObserved> for ControllerEvent {
    fn from(e: NewLeaderObserved) -> Self {
        Self::NewLeader(e)
    }
}

/// The verdict on one version of the HTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigVerdict {
    /// The HTC's `metadata.uid` (Events and owner references name it).
    pub uid: String,
    /// Its `metadata.generation`.
    pub generation: i64,
    /// The problems found; empty when valid.
    pub errors: Vec<String>,
    /// When it was validated.
    pub at: SystemTime,
}

/// The agents' bearer token, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenState {
    /// The Secret or its key is missing; deployments wait.
    Missing {
        /// What is missing, for the log and status.
        reason: String,
    },
    /// The token.
    Present(String),
}

/// One HAProxy pod that gets the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Its name.
    pub name: String,
    /// The agent's base URL.
    pub url: String,
}

/// The pods that get the config, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSet {
    /// Eligible pods by name.
    pub pods: BTreeMap<String, Pod>,
}

/// A rendered file set.
#[derive(Debug)]
pub struct RenderedSet {
    /// The files.
    pub files: FileSet,
    /// Their checksum (hex).
    pub checksum: String,
    /// The config generation it was rendered with.
    pub config_generation: i64,
    /// The term (the `BecameLeader.at` of the term) it was rendered in.
    pub term: SystemTime,
    /// How long the render took.
    pub render_time: std::time::Duration,
    /// What the templates asked the cluster to show (Events, status).
    pub requests: haptic_render::Requests,
    /// The reconcile chain's span (`reconcile`, with its `correlation_id`): the render gate's
    /// check and each pod's apply run in it, from the trigger to each pod's answer.
    pub span: tracing::Span,
    /// Which object produced which file and line (what a refusal is traced back with).
    pub provenance: haptic_render::Provenance,
}

/// An object left out of renders because HAProxy refused what it produced.
#[derive(Debug, Clone)]
pub struct Exclusion {
    /// The object.
    pub object: haptic_render::ObjectRef,
    /// HAProxy's words about its line or file.
    pub reason: String,
    /// The checksum of the refused set.
    pub checksum: String,
}

/// A failed render.
#[derive(Debug, Clone)]
pub struct RenderFailure {
    /// The config generation.
    pub config_generation: i64,
    /// The renderer's message (template, line, cause).
    pub message: String,
}

/// The render gate's judgement.
#[derive(Debug, Clone)]
pub struct GateVerdict {
    /// The set's checksum.
    pub checksum: String,
    /// The config generation it was rendered with.
    pub config_generation: i64,
    /// `None`: `haproxy -c` accepted it, or a set it accepted that differs from it only in
    /// server slots and map entries (`render_gate::passes_as`); otherwise why it was refused.
    pub refused: Option<String>,
}

/// One pod's outcome in a deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodOutcome {
    /// The set is live there (applied now or already).
    Live,
    /// Not yet applied there (in flight, or waiting for the minimum interval).
    Pending,
    /// The pod refused or could not be reached; the message says why.
    Failed(String),
}

/// The state after a deployment.
#[derive(Debug, Clone)]
pub struct DeploymentReport {
    /// The checksum deployed.
    pub checksum: String,
    /// Config generation of the set.
    pub config_generation: i64,
    /// Each pod's outcome.
    pub pods: BTreeMap<String, PodOutcome>,
    /// Each pod's live checksum as the controller knows it.
    pub live: BTreeMap<String, String>,
}

/// An agent's fenced refusal of an apply, and what the leader did about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedRefusal {
    /// The pod whose agent refused.
    pub pod: String,
    /// The agent's fence.
    pub fence: u64,
    /// The epoch the apply carried.
    pub epoch: u64,
    /// What followed: `reclaimed` (the epoch was raised above the fence), `stood down`
    /// (fenced again after reclaiming, or another replica holds the Lease), or the error.
    pub outcome: String,
}
