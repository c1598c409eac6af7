//! A small highly available worker on haptic-leadership: every replica watches a shared queue
//! of "jobs" (here, a counter it logs), and only the leader does the work, stamping each job
//! with its fencing epoch.
//!
//! With no cluster: `cargo run -p haptic-examples --example ha_worker -- --local` starts a
//! haptic-testkit API server in this process and two instances, `worker-a` and `worker-b`.
//! Ctrl-C stops the current leader (it releases the Lease after its work stopped, and the
//! other takes over at once); a second Ctrl-C stops the other and exits. `--run-for 20` stops
//! by itself after a handover, for a non-interactive demo.
//!
//! Against a cluster or a `cargo xtask apiserver`: run it twice with `--identity worker-a`
//! and `--identity worker-b` (the kubeconfig from `KUBECONFIG` or `--kubeconfig`), then Ctrl-C
//! the leader.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use clap::Parser;
use haptic_election::ElectionConfig;
use haptic_eventbus::{Event, EventBus, Filter};
use haptic_leadership::{
    BecameLeader, LeaderElectionStarted, Leadership, LostLeadership, NewLeaderObserved,
};
use tokio_util::sync::CancellationToken;
use tracing::info;

#[derive(Parser, Debug)]
#[command(about = "A highly available worker on haptic-leadership")]
struct Args {
    /// Start an in-process API server and two instances that hand over on Ctrl-C.
    #[arg(long)]
    local: bool,
    /// This instance's identity (without --local).
    #[arg(long, default_value = "worker-a")]
    identity: String,
    /// The Lease's name.
    #[arg(long, default_value = "ha-worker")]
    lease: String,
    /// The Lease's namespace.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// A kubeconfig to use instead of the default one (without --local).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// With --local: hand over after a third of this many seconds and exit after it.
    #[arg(long)]
    run_for: Option<u64>,
}

/// The application's own events: the four leader events and its work.
#[derive(Debug)]
enum AppEvent {
    Leader(LeaderEvent),
    Job(u64),
}

// The fields are read through `Debug`, in the log.
#[allow(dead_code)]
#[derive(Debug)]
enum LeaderEvent {
    Started,
    Became(u64),
    Lost(String),
    Observed(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Leader,
    Job,
}

impl Event for AppEvent {
    type Kind = Kind;
    fn kind(&self) -> Kind {
        match self {
            AppEvent::Leader(_) => Kind::Leader,
            AppEvent::Job(_) => Kind::Job,
        }
    }
}

impl From<LeaderElectionStarted> for AppEvent {
    fn from(_: LeaderElectionStarted) -> Self {
        AppEvent::Leader(LeaderEvent::Started)
    }
}
impl From<BecameLeader> for AppEvent {
    fn from(e: BecameLeader) -> Self {
        AppEvent::Leader(LeaderEvent::Became(e.epoch))
    }
}
impl From<LostLeadership> for AppEvent {
    fn from(e: LostLeadership) -> Self {
        AppEvent::Leader(LeaderEvent::Lost(e.reason))
    }
}
impl From<NewLeaderObserved> for AppEvent {
    fn from(e: NewLeaderObserved) -> Self {
        AppEvent::Leader(LeaderEvent::Observed(e.new_leader_identity))
    }
}

/// One instance: a job source on every replica, a worker on the leader only.
fn instance(
    client: kube::Client,
    identity: &str,
    lease: &str,
    namespace: &str,
) -> Result<Leadership<AppEvent>> {
    let config = ElectionConfig::new(identity, lease, namespace).with_durations(
        Duration::from_secs(15),
        Duration::from_secs(10),
        Duration::from_secs(2),
    );
    let bus = EventBus::<AppEvent>::new();
    let me = identity.to_owned();
    let me2 = identity.to_owned();
    Ok(Leadership::new(client, config, bus)?
        .all_replicas("jobs", move |bus, token| async move {
            let mut n = 0;
            loop {
                tokio::select! {
                    () = token.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                n += 1;
                bus.publish(AppEvent::Job(n));
            }
        })
        .all_replicas("log", move |bus, token| {
            let mut events = bus.subscribe("log", Filter::kind(Kind::Leader));
            async move {
                loop {
                    tokio::select! {
                        () = token.cancelled() => break,
                        event = events.recv() => match event.as_deref() {
                            Some(AppEvent::Leader(e)) => info!(instance = %me, event = ?e, "leader event"),
                            Some(_) => {}
                            None => break,
                        }
                    }
                }
            }
        })
        .leader_only("worker", move |ctx| {
            let mut jobs = ctx.bus().subscribe_leader_only("worker", Filter::kinds([Kind::Job, Kind::Leader]));
            let me = me2.clone();
            async move {
                loop {
                    tokio::select! {
                        () = ctx.token().cancelled() => break,
                        event = jobs.recv() => match event.as_deref() {
                            Some(AppEvent::Job(n)) => info!(instance = %me, job = n, epoch = ctx.epoch(), "working"),
                            Some(AppEvent::Leader(LeaderEvent::Became(epoch))) => info!(instance = %me, epoch, "worker started for this term"),
                            Some(_) => {}
                            None => break,
                        }
                    }
                }
                info!(instance = %me, "worker stopped");
            }
        }))
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    if !args.local {
        let client = match &args.kubeconfig {
            Some(path) => {
                let kubeconfig =
                    kube::config::Kubeconfig::read_from(path).context("reading the kubeconfig")?;
                let config =
                    kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
                kube::Client::try_from(config)?
            }
            None => kube::Client::try_default()
                .await
                .context("no kubeconfig (try --local)")?,
        };
        let token = CancellationToken::new();
        let run = tokio::spawn(
            instance(client, &args.identity, &args.lease, &args.namespace)?.run(token.clone()),
        );
        tokio::signal::ctrl_c().await?;
        info!("Ctrl-C: stopping leader-only work, then releasing the Lease");
        token.cancel();
        run.await??;
        return Ok(());
    }

    let server = haptic_testkit::ApiServer::start().await?;
    info!(url = %server.url(), "local API server started");
    let mut instances = Vec::new();
    for name in ["worker-a", "worker-b"] {
        let leadership = instance(server.client_for(name)?, name, &args.lease, &args.namespace)?;
        let metrics = leadership.metrics();
        let token = CancellationToken::new();
        let handle = tokio::spawn(leadership.run(token.clone()));
        instances.push((name, metrics, token, handle));
    }
    let handover = async {
        match args.run_for {
            Some(secs) => tokio::time::sleep(Duration::from_secs(secs / 3)).await,
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    handover.await;
    let leader = instances
        .iter()
        .position(|(_, m, _, _)| m.is_leader())
        .unwrap_or(0);
    let (name, _, token, handle) = instances.remove(leader);
    info!(instance = name, "handing over: stopping the leader");
    token.cancel();
    handle.await??;
    match args.run_for {
        Some(secs) => tokio::time::sleep(Duration::from_secs(secs - secs / 3)).await,
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    for (name, _, token, handle) in instances {
        info!(instance = name, "stopping");
        token.cancel();
        handle.await??;
    }
    server.shutdown().await;
    Ok(())
}
