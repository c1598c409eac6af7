//! A leader-elected worker, written as an operator author would use haptic-election.
//!
//! With no cluster, `--local` starts an in-process haptic-testkit API server and runs two
//! instances in this process: instance 1 leads; after `--handover-after` seconds it is stopped
//! (as on SIGTERM), stops its work, releases the Lease, and instance 2 takes over at once. Then
//! the example exits by itself:
//!
//! ```sh
//! cargo run -p haptic-examples --example leader_election -- --local
//! cargo run -p haptic-examples --example leader_election -- --local --poll-only   # client-go's timing
//! ```
//!
//! Against the cluster of your kubeconfig, run one instance per terminal, each with its own
//! identity, and stop the leader with Ctrl-C to watch the other take over:
//!
//! ```sh
//! cargo run -p haptic-examples --example leader_election -- --identity me-1
//! cargo run -p haptic-examples --example leader_election -- --identity me-2
//! kubectl get lease leader-election-example -o yaml
//! ```

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use haptic_election::{Callbacks, ElectionConfig, HealthCheck, LeaderElector};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use tokio::{task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

/// Leader election over a Kubernetes Lease.
#[derive(Debug, Parser)]
struct Args {
    /// Start an in-process API server and run two instances that hand over, then exit.
    #[arg(long)]
    local: bool,
    /// This instance's identity (in a cluster: the pod name). With --local the two instances
    /// are IDENTITY-1 and IDENTITY-2.
    #[arg(long, env = "POD_NAME", default_value = "leader-election-example")]
    identity: String,
    /// The Lease's name.
    #[arg(long, default_value = "leader-election-example")]
    lease: String,
    /// The Lease's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// With --local: seconds instance 1 leads before it is stopped.
    #[arg(long, default_value_t = 5)]
    handover_after: u64,
    /// Followers poll every RetryPeriod, as client-go does, instead of watching the Lease.
    #[arg(long)]
    poll_only: bool,
}

/// One elected instance, running until its token fires.
struct Instance {
    identity: String,
    token: CancellationToken,
    handle: JoinHandle<()>,
    state: tokio::sync::watch::Receiver<haptic_election::ElectionState>,
}

impl Instance {
    /// Builds the elector, wires the callbacks an operator would, and runs it.
    fn start(client: Client, config: ElectionConfig) -> Result<Self> {
        let identity = config.identity.clone();
        let elector = LeaderElector::new(client, config)?;
        // Take the state and health check before `run` consumes the elector.
        let state = elector.state();
        let health = elector.health();
        let callbacks = Callbacks::new()
            .on_started_leading({
                let identity = identity.clone();
                move |term| leader_work(identity.clone(), term, health.clone())
            })
            .on_stopped_leading({
                let identity = identity.clone();
                move |reason| info!(%identity, %reason, "stopped leading")
            })
            .on_new_leader({
                let identity = identity.clone();
                move |leader, is_me| info!(%identity, %leader, is_me, "new leader observed")
            });
        let token = CancellationToken::new();
        let handle = tokio::spawn(
            elector
                .run(token.clone(), callbacks)
                .instrument(info_span!("election", %identity)),
        );
        Ok(Self {
            identity,
            token,
            handle,
            state,
        })
    }

    /// Stops the instance as on SIGTERM: its leader work returns, then the Lease is released.
    async fn stop(self) -> Result<()> {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .with_context(|| format!("{} did not stop", self.identity))?
            .context("the elector panicked")
    }
}

/// The leader-only work of a term: here a tick a second, until the term's token is cancelled.
/// A real controller would start its reconcilers here and stop them when `term` fires.
async fn leader_work(identity: String, term: CancellationToken, health: HealthCheck) {
    info!(%identity, "started leading: leader-only work begins");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            () = term.cancelled() => break,
            _ = tick.tick() => {
                ticks += 1;
                // What a /healthz handler would return.
                if let Err(problem) = health.check() {
                    warn!(%identity, %problem, "health check failing");
                }
            }
        }
    }
    info!(%identity, ticks, "leader-only work stopped");
}

fn config(args: &Args, identity: &str) -> ElectionConfig {
    // The defaults: LeaseDuration 30 s, RenewDeadline 20 s, RetryPeriod 5 s, release on cancel.
    ElectionConfig::new(identity, &args.lease, &args.namespace).with_poll_only(args.poll_only)
}

/// Two instances against an in-process API server; instance 1 hands over to instance 2.
async fn local(args: &Args) -> Result<()> {
    let server = haptic_testkit::ApiServer::start().await?;
    info!(url = %server.url(), "started an in-process API server (haptic-testkit)");
    let (id1, id2) = (
        format!("{}-1", args.identity),
        format!("{}-2", args.identity),
    );
    let first = Instance::start(server.client_for(&id1)?, config(args, &id1))?;
    let mut state = first.state.clone();
    tokio::time::timeout(Duration::from_secs(10), state.wait_for(|s| s.is_leader))
        .await
        .context("instance 1 did not lead within 10 s")??;
    let second = Instance::start(server.client_for(&id2)?, config(args, &id2))?;
    let mut state = second.state.clone();
    tokio::time::timeout(
        Duration::from_secs(10),
        state.wait_for(|s| s.holder.as_deref() == Some(id1.as_str())),
    )
    .await
    .context("instance 2 did not see the Lease")??;
    info!(
        seconds = args.handover_after,
        "instance 2 follows; instance 1 will be stopped after"
    );
    tokio::time::sleep(Duration::from_secs(args.handover_after)).await;

    info!(identity = %id1, "stopping instance 1, as on SIGTERM");
    let stopped = Instant::now();
    first.stop().await?;
    let within = Duration::from_secs(40);
    tokio::time::timeout(within, state.wait_for(|s| s.is_leader))
        .await
        .context("instance 2 did not take over")??;
    info!(
        identity = %id2,
        after_ms = stopped.elapsed().as_millis() as u64,
        "instance 2 took over after instance 1 was stopped"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leases: Api<Lease> = Api::namespaced(server.client_for("kubectl")?, &args.namespace);
    if let Some(spec) = leases.get(&args.lease).await?.spec {
        info!(
            holder = spec.holder_identity.as_deref().unwrap_or(""),
            lease_transitions = spec.lease_transitions.unwrap_or(0),
            lease_duration_seconds = spec.lease_duration_seconds.unwrap_or(0),
            "the Lease"
        );
    }
    second.stop().await?;
    info!("done");
    server.shutdown().await;
    Ok(())
}

/// One instance against the kubeconfig's cluster, until Ctrl-C.
async fn cluster(args: &Args) -> Result<()> {
    let client = Client::try_default()
        .await
        .context("no kubeconfig or in-cluster config (try --local)")?;
    let instance = Instance::start(client, config(args, &args.identity))?;
    info!(identity = %args.identity, lease = %args.lease, namespace = %args.namespace, "running; Ctrl-C stops and releases the Lease");
    tokio::signal::ctrl_c().await?;
    info!("Ctrl-C: stopping");
    instance.stop().await
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
