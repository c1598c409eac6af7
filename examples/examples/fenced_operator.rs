//! An operator that fences its own writes, written with haptic-election and haptic-epoch only
//! (no event bus, no haptic-leadership) around kube-runtime's `Controller`.
//!
//! The operator reconciles every ConfigMap labelled `example.haptic.io/managed=true` into a
//! derived ConfigMap `<name>-derived` (the values upper-cased). Only the leader runs the
//! `Controller`: it is started when this replica starts leading, with the term's token as its
//! graceful-shutdown trigger, and stops when the term ends.
//!
//! Every write carries the term's fencing epoch in the annotation `example.haptic.io/epoch`,
//! and the derived object is its own fence: a write goes through only as a compare-and-set on
//! the object's resourceVersion, and only if the object does not already carry a higher
//! epoch. A leader that lost its Lease without noticing (a GC pause, a frozen VM, a partition)
//! and wakes up mid-reconcile therefore cannot overwrite what its successor wrote.
//!
//! With no cluster, `--local` runs an in-process haptic-testkit API server and a scripted
//! scenario with two replicas: create ConfigMaps, see replica a's output at epoch 1, hand over
//! to replica b, see b's writes at epoch 2, then replay a's stale write and see it refused:
//!
//! ```sh
//! cargo run -p haptic-examples --example fenced_operator -- --local
//! ```
//!
//! Against the cluster of your kubeconfig, run one replica per terminal and Ctrl-C the leader:
//!
//! ```sh
//! cargo run -p haptic-examples --example fenced_operator -- --identity op-1
//! cargo run -p haptic-examples --example fenced_operator -- --identity op-2
//! kubectl create configmap app-1 --from-literal=greeting=hello
//! kubectl label configmap app-1 example.haptic.io/managed=true
//! kubectl get configmap app-1-derived -o yaml   # data, and the epoch of the term that wrote it
//! ```

use std::{
    collections::BTreeMap,
    pin::pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use haptic_election::{Callbacks, ElectionConfig, ElectionState, LeaderElector, Resign};
use haptic_epoch::EpochStore;
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ObjectMeta, PostParams},
    runtime::{
        Controller,
        controller::{self, Action},
        wait::await_condition,
        watcher,
    },
};
use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

/// Sources carry this label with the value `true`.
const MANAGED_LABEL: &str = "example.haptic.io/managed";
/// Derived ConfigMaps name their source in this label; the `Controller` watches them by it.
const DERIVED_FROM_LABEL: &str = "example.haptic.io/derived-from";
/// The epoch of the term that last wrote a derived ConfigMap: the fence on the receiving side.
const EPOCH_ANNOTATION: &str = "example.haptic.io/epoch";
/// The replica that last wrote a derived ConfigMap (for people reading it, not for the fence).
const WRITER_ANNOTATION: &str = "example.haptic.io/written-by";

/// A leader-elected operator that fences its writes with the Lease's epoch.
#[derive(Debug, Parser)]
struct Args {
    /// Start an in-process API server and run the two-replica scenario, then exit.
    #[arg(long)]
    local: bool,
    /// This replica's identity (in a cluster: the pod name). With --local the two replicas are
    /// IDENTITY-a and IDENTITY-b.
    #[arg(long, env = "POD_NAME", default_value = "fenced-operator")]
    identity: String,
    /// The Lease's name; it also holds the epoch (annotation `haptic.io/leader-epoch`).
    #[arg(long, default_value = "fenced-operator")]
    lease: String,
    /// The namespace of the Lease and of the ConfigMaps.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
}

// ---------------------------------------------------------------------------------------------
// The operator: a reconciler whose every write is fenced.
// ---------------------------------------------------------------------------------------------

/// What a reconcile needs: where to write, who writes, and the epoch of the current term.
struct Ctx {
    api: Api<ConfigMap>,
    identity: String,
    /// Atomic because a successful `reclaim` raises it while the controller runs.
    epoch: AtomicU64,
}

impl Ctx {
    fn new(client: Client, namespace: &str, identity: &str, epoch: u64) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            identity: identity.to_owned(),
            epoch: AtomicU64::new(epoch),
        }
    }
}

/// Why a reconcile did not write.
#[derive(Debug, thiserror::Error)]
enum Error {
    /// The target already carries a later term's epoch: this replica is a stale leader.
    #[error("refused to write {target}: it carries epoch {theirs}, this term's epoch is {ours}")]
    Fenced {
        target: String,
        ours: u64,
        theirs: u64,
    },
    /// The target's epoch annotation is not a number. Overwriting it could undo a newer term's
    /// write, so the reconcile fails closed until a person looks.
    #[error("{target}: {source}")]
    Malformed {
        target: String,
        #[source]
        source: haptic_epoch::Malformed,
    },
    /// The target kept changing under every compare-and-set.
    #[error("{0} changed under each attempt to write it")]
    Conflicts(String),
    /// An API request failed.
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

/// The derived ConfigMap for `source`, stamped with the writer and its epoch.
fn derive(source: &ConfigMap, identity: &str, epoch: u64) -> ConfigMap {
    let data = source
        .data
        .iter()
        .flatten()
        .map(|(key, value)| (key.clone(), value.to_uppercase()))
        .collect();
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(format!("{}-derived", source.name_any())),
            namespace: source.namespace(),
            labels: Some(BTreeMap::from([(
                DERIVED_FROM_LABEL.to_owned(),
                source.name_any(),
            )])),
            annotations: Some(BTreeMap::from([
                (EPOCH_ANNOTATION.to_owned(), epoch.to_string()),
                (WRITER_ANNOTATION.to_owned(), identity.to_owned()),
            ])),
            // A real cluster garbage-collects the derived object with its source, and the
            // controller's `owns` watch maps changes of the derived object back to the source.
            owner_references: source.controller_owner_ref(&()).map(|owner| vec![owner]),
            ..ObjectMeta::default()
        },
        data: Some(data),
        ..ConfigMap::default()
    }
}

/// The epoch a ConfigMap was written at; 0 when it carries none.
fn epoch_of(object: &ConfigMap) -> Result<u64, Error> {
    // The same parser as the Lease's annotation: a decimal u64, nothing else.
    haptic_epoch::parse_epoch(
        object
            .annotations()
            .get(EPOCH_ANNOTATION)
            .map(String::as_str),
    )
    .map_err(|source| Error::Malformed {
        target: object.name_any(),
        source,
    })
}

/// Writes `desired` unless the target carries a higher epoch than `epoch`.
///
/// The check and the write are one step: the write is a compare-and-set on the resourceVersion
/// the check read, so if another term writes in between, ours fails with 409 and the next
/// round reads its epoch and refuses. Checking the epoch without the compare-and-set would leave
/// exactly that window open to a stale leader.
async fn fenced_write(
    api: &Api<ConfigMap>,
    desired: &ConfigMap,
    epoch: u64,
    identity: &str,
) -> Result<(), Error> {
    let target = desired.name_any();
    for _ in 0..5 {
        let written = match api.get_opt(&target).await? {
            Some(current) => {
                let theirs = epoch_of(&current)?;
                if theirs > epoch {
                    return Err(Error::Fenced {
                        target,
                        ours: epoch,
                        theirs,
                    });
                }
                // A successor writes even an unchanged object once: its epoch on the object is
                // what fences every earlier term out.
                if theirs == epoch && current.data == desired.data {
                    debug!(%target, epoch, "derived ConfigMap is up to date");
                    return Ok(());
                }
                let mut next = desired.clone();
                next.metadata.resource_version = current.resource_version();
                api.replace(&target, &PostParams::default(), &next).await
            }
            // Create fails with 409 AlreadyExists if another term created it first.
            None => api.create(&PostParams::default(), desired).await,
        };
        match written {
            Ok(_) => {
                info!(%target, epoch, writer = %identity, "wrote derived ConfigMap");
                return Ok(());
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                debug!(%target, "the target changed since it was read; reading it again");
            }
            Err(error) => return Err(error.into()),
        }
    }
    Err(Error::Conflicts(target))
}

/// kube-runtime's reconciler: one source ConfigMap in, its derived ConfigMap written.
async fn reconcile(source: Arc<ConfigMap>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let epoch = ctx.epoch.load(Ordering::SeqCst);
    let desired = derive(&source, &ctx.identity, epoch);
    fenced_write(&ctx.api, &desired, epoch, &ctx.identity).await?;
    // Watches already bring every change; the requeue only repairs a missed event.
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn error_policy(_source: Arc<ConfigMap>, error: &Error, _ctx: Arc<Ctx>) -> Action {
    match error {
        // The term's loop below reclaims first: if the term goes on at a raised epoch, this
        // retry goes through; if another leader exists, the controller is gone before it.
        Error::Fenced { .. } => Action::requeue(Duration::from_secs(1)),
        _ => Action::requeue(Duration::from_secs(5)),
    }
}

/// The leader-only work of one term: claim an epoch, then run the `Controller` until `term`
/// is cancelled (the elector ended the term) or the fence shows another leader exists.
async fn lead(term: CancellationToken, client: Client, config: ElectionConfig, resign: Resign) {
    let identity = config.identity.clone();
    let epochs = EpochStore::new(
        client.clone(),
        &config.lease_namespace,
        &config.lease_name,
        &identity,
    );
    // Nothing is written before the bump succeeded: without an epoch there is no fence.
    let mut epoch_term = match epochs.bump().await {
        Ok(epoch_term) => epoch_term,
        Err(error) => {
            warn!(%identity, %error, "could not claim an epoch; giving the term up");
            resign.resign();
            return;
        }
    };
    let epoch = epoch_term.epoch();
    info!(%identity, epoch, "started leading: claimed epoch, starting the controller");

    let ctx = Arc::new(Ctx::new(client, &config.lease_namespace, &identity, epoch));
    let sources = watcher::Config::default().labels(&format!("{MANAGED_LABEL}=true"));
    let derived = watcher::Config::default().labels(DERIVED_FROM_LABEL);
    let mut results = pin!(
        Controller::new(ctx.api.clone(), sources)
            .owns(ctx.api.clone(), derived)
            // On the term's end the controller starts no new reconcile, finishes the running
            // ones, and its stream ends; the elector releases the Lease only after that.
            .graceful_shutdown_on(term.cancelled_owned())
            .run(reconcile, error_policy, ctx.clone())
    );
    while let Some(result) = results.next().await {
        match result {
            Ok(_) => {}
            Err(controller::Error::ReconcilerFailed(Error::Fenced { theirs, .. }, _)) => {
                // A higher epoch than ours on a target: either another replica leads, or the
                // Lease's counter went backwards (deleted, restored) while we kept the Lease.
                // `reclaim` tells which, and raises the counter above `theirs` in the second case.
                match epoch_term.reclaim(theirs).await {
                    Ok(raised) => {
                        warn!(%identity, raised, "the Lease's epoch had regressed; continuing above the fence");
                        ctx.epoch.store(raised, Ordering::SeqCst);
                    }
                    // ForeignLeader, or no answer: either way this term cannot show it still
                    // owns the epoch, so it stops writing (fails closed) and gives the term up.
                    Err(error) => {
                        warn!(%identity, %error, "stopping the controller and giving the term up");
                        resign.resign();
                        break;
                    }
                }
            }
            Err(error) => {
                debug!(%identity, %error, "reconcile failed; retried by the error policy")
            }
        }
    }
    // Dropping `epoch_term` ends the term's claim; the elector releases the Lease.
    info!(%identity, epoch = ctx.epoch.load(Ordering::SeqCst), "controller stopped");
}

// ---------------------------------------------------------------------------------------------
// A replica: the elector, with the controller as its started-leading work.
// ---------------------------------------------------------------------------------------------

struct Replica {
    identity: String,
    token: CancellationToken,
    handle: JoinHandle<()>,
    state: watch::Receiver<ElectionState>,
}

impl Replica {
    fn start(client: Client, config: ElectionConfig) -> Result<Self> {
        let identity = config.identity.clone();
        let elector = LeaderElector::new(client.clone(), config.clone())?;
        let state = elector.state();
        let resign = elector.resign_handle();
        let callbacks = Callbacks::new()
            .on_started_leading(move |term| {
                lead(term, client.clone(), config.clone(), resign.clone())
            })
            .on_stopped_leading({
                let identity = identity.clone();
                move |reason| info!(%identity, %reason, "stopped leading")
            });
        let token = CancellationToken::new();
        let handle = tokio::spawn(
            elector
                .run(token.clone(), callbacks)
                .instrument(info_span!("replica", %identity)),
        );
        Ok(Self {
            identity,
            token,
            handle,
            state,
        })
    }

    async fn wait_until(&self, what: &str, done: impl Fn(&ElectionState) -> bool) -> Result<()> {
        let mut state = self.state.clone();
        tokio::time::timeout(Duration::from_secs(30), state.wait_for(|s| done(s)))
            .await
            .with_context(|| format!("{}: not {what} within 30 s", self.identity))??;
        Ok(())
    }

    /// Stops the replica as on SIGTERM: the controller stops, then the Lease is released.
    async fn stop(self) -> Result<()> {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .with_context(|| format!("{} did not stop", self.identity))?
            .context("the elector panicked")
    }
}

// ---------------------------------------------------------------------------------------------
// --local: the scripted scenario on an in-process API server.
// ---------------------------------------------------------------------------------------------

fn source(name: &str, greeting: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                MANAGED_LABEL.to_owned(),
                "true".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(
            "greeting".to_owned(),
            greeting.to_owned(),
        )])),
        ..ConfigMap::default()
    }
}

/// Waits (on a watch, not by polling) until `name` exists, was written at `epoch` and holds
/// `greeting`, then logs it.
async fn show_derived(api: &Api<ConfigMap>, name: &str, epoch: u64, greeting: &str) -> Result<()> {
    let wanted = greeting.to_uppercase();
    let matches = move |object: Option<&ConfigMap>| {
        object.is_some_and(|object| {
            epoch_of(object).ok() == Some(epoch)
                && object.data.as_ref().and_then(|d| d.get("greeting")) == Some(&wanted)
        })
    };
    let object = tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(api.clone(), name, matches),
    )
    .await
    .with_context(|| format!("{name} was not written at epoch {epoch} within 30 s"))??
    .with_context(|| format!("{name} was deleted"))?;
    let annotations = object.annotations();
    info!(
        name,
        epoch = %annotations.get(EPOCH_ANNOTATION).map_or("", String::as_str),
        written_by = %annotations.get(WRITER_ANNOTATION).map_or("", String::as_str),
        data = ?object.data.clone().unwrap_or_default(),
        "derived ConfigMap"
    );
    Ok(())
}

async fn local(args: &Args) -> Result<()> {
    let server = haptic_testkit::ApiServer::start().await?;
    info!(url = %server.url(), "started an in-process API server (haptic-testkit)");
    let ns = args.namespace.as_str();
    let user: Api<ConfigMap> = Api::namespaced(server.client_for("user")?, ns);
    let (a, b) = (
        format!("{}-a", args.identity),
        format!("{}-b", args.identity),
    );
    // Short durations keep the scenario at a few seconds; the handover below is a graceful
    // release anyway, which a follower that watches the Lease takes at once.
    let config = |identity: &str| {
        ElectionConfig::new(identity, &args.lease, ns).with_durations(
            Duration::from_secs(5),
            Duration::from_secs(3),
            Duration::from_secs(1),
        )
    };

    let first = Replica::start(server.client_for(&a)?, config(&a))?;
    first.wait_until("leading", |s| s.is_leader).await?;
    let second = Replica::start(server.client_for(&b)?, config(&b))?;
    second
        .wait_until("following", |s| s.holder.as_deref() == Some(a.as_str()))
        .await?;

    info!("step 1: create three managed ConfigMaps and an unmanaged one; replica a derives them");
    for (name, greeting) in [("app-1", "hello"), ("app-2", "bonjour"), ("app-3", "hallo")] {
        user.create(&PostParams::default(), &source(name, greeting))
            .await?;
    }
    let mut notes = source("notes", "not managed");
    notes.metadata.labels = None;
    user.create(&PostParams::default(), &notes).await?;
    show_derived(&user, "app-1-derived", 1, "hello").await?;
    show_derived(&user, "app-2-derived", 1, "bonjour").await?;
    show_derived(&user, "app-3-derived", 1, "hallo").await?;
    // What replica a's reconciler saw of app-2, kept for the stale write in step 4.
    let app2_as_a_saw_it = user.get("app-2").await?;

    info!(identity = %a, "step 2: hand over: replica a is stopped as on SIGTERM");
    first.stop().await?;
    second.wait_until("leading", |s| s.is_leader).await?;
    info!("replica b leads; its controller rewrites every derived ConfigMap at its epoch");
    show_derived(&user, "app-1-derived", 2, "hello").await?;
    show_derived(&user, "app-2-derived", 2, "bonjour").await?;
    show_derived(&user, "app-3-derived", 2, "hallo").await?;

    info!("step 3: edit app-2 and create app-4; the successor's writes carry epoch 2");
    let mut app2 = user.get("app-2").await?;
    app2.data = Some(BTreeMap::from([(
        "greeting".to_owned(),
        "salut".to_owned(),
    )]));
    user.replace("app-2", &PostParams::default(), &app2).await?;
    user.create(&PostParams::default(), &source("app-4", "ciao"))
        .await?;
    show_derived(&user, "app-2-derived", 2, "salut").await?;
    show_derived(&user, "app-4-derived", 2, "ciao").await?;

    info!(
        identity = %a,
        "step 4: a stale leader: replica a's reconcile of app-2 from its term at epoch 1, \
         as if a had frozen mid-reconcile (GC pause, partition) and woken after the handover"
    );
    let stale = Arc::new(Ctx::new(server.client_for(&a)?, ns, &a, 1));
    match reconcile(Arc::new(app2_as_a_saw_it), stale).await {
        Err(error @ Error::Fenced { .. }) => {
            info!(%error, "stale write refused: without the fence it would have put BONJOUR back");
        }
        Ok(_) => bail!("the stale write was not refused"),
        Err(error) => return Err(error.into()),
    }
    show_derived(&user, "app-2-derived", 2, "salut").await?;

    second.stop().await?;
    let leases: Api<Lease> = Api::namespaced(server.client_for("user")?, ns);
    let lease = leases.get(&args.lease).await?;
    info!(
        lease = %args.lease,
        epoch = %lease.annotations().get(haptic_epoch::EPOCH_ANNOTATION).map_or("", String::as_str),
        holder = %lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).unwrap_or(""),
        "done: the Lease after both replicas stopped"
    );
    server.shutdown().await;
    Ok(())
}

/// One replica against the kubeconfig's cluster, until Ctrl-C.
async fn cluster(args: &Args) -> Result<()> {
    let client = Client::try_default()
        .await
        .context("no kubeconfig or in-cluster config (try --local)")?;
    let config = ElectionConfig::new(&args.identity, &args.lease, &args.namespace);
    let replica = Replica::start(client, config)?;
    info!(identity = %args.identity, lease = %args.lease, namespace = %args.namespace, "running; Ctrl-C stops and releases the Lease");
    tokio::signal::ctrl_c().await?;
    info!("Ctrl-C: stopping");
    replica.stop().await
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,haptic_testkit=warn")),
        )
        .init();
    let args = Args::parse();
    if args.local {
        local(&args).await
    } else {
        cluster(&args).await
    }
}
