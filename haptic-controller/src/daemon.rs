//! The daemon: the components wired on the bus through haptic-leadership, in the order the
//! design asks (components subscribe, the bus starts, the elector starts last), and stopped in
//! the reverse order when the root token fires: leader-only work, then the Lease, then the rest.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use futures::{FutureExt as _, future::BoxFuture};
use haptic_eventbus::{Config as BusConfig, EventBus};
use haptic_leadership::{LeaderContext, Leadership};
use kube::Client;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::{
    config_loader::{self, ConfigRef},
    coordinator, credentials, drift,
    events::{ControllerEvent, STICKY},
    health::{self, Probes},
    pod_discovery, pool_keeper, published, reconciler, recorder,
    render_gate::{self, GateSettings},
    scheduler,
    state::StateCache,
    status, status_applier, watchers,
};

/// How long shutdown waits for each group of components (leader-only work, then all-replica
/// work) before aborting them. With the Lease release between them (one request, bounded by
/// the elector's request timeout), SIGTERM to exit takes at most about [`SHUTDOWN_BOUND`].
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The documented bound from SIGTERM to exit; the binary exits by itself once it passes.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(20);

/// Errors of the daemon.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The health or debug server could not bind.
    #[error("binding the health or debug server on {addr}")]
    Health {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The admission webhook could not start.
    #[error(transparent)]
    Webhook(#[from] crate::webhook::Error),
    /// The leadership adapter refused the election settings.
    #[error(transparent)]
    Leadership(#[from] haptic_leadership::Error),
}

/// What the daemon runs with.
#[derive(Debug, Clone)]
pub struct Options {
    /// The HTC to read.
    pub config: ConfigRef,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// Where the probes listen.
    pub health_addr: SocketAddr,
    /// The render gate's `haproxy` binary (none: no `haproxy -c`; the policy still applies).
    pub haproxy: Option<PathBuf>,
    /// The config policy the render gate applies (the agents' own).
    pub policy: haptic_agent_client::policy::Policy,
    /// How the agents are reached (mutual TLS unless plain HTTP was asked for).
    pub agent_channel: crate::channel::AgentChannel,
    /// The reconciler's coalescing window.
    pub reconcile_window: Duration,
    /// How often at most a replica that does not lead renders, to keep its renderer warm for
    /// a handoff ([`crate::standby`]; none: never).
    pub standby_render_interval: Option<Duration>,
    /// The admission webhook (none: off).
    pub webhook: Option<crate::webhook::WebhookSettings>,
    /// What `/metrics` on the health address serves (none: 404).
    pub metrics: Option<crate::metrics::Exposition>,
    /// Where `/debug/vars` listens (none: nowhere, the default).
    pub debug_addr: Option<SocketAddr>,
    /// The Secret (in the controller's namespace) holding the default certificate, created
    /// with a generated one when absent (none: not generated).
    pub default_certificate: Option<String>,
    /// TEST ONLY: the election judges expiry on a clock running this many times as fast as
    /// the real one (`--test-only-election-clock-rate`, for fault campaigns); `None` in
    /// production.
    pub election_clock_rate: Option<f64>,
    /// TEST ONLY: the leader-only component of this name panics as it starts
    /// (`--test-only-panic-in`); `None` in production.
    pub test_only_panic_in: Option<String>,
}

/// TEST ONLY: `build`, or, when `panic_in` names this component, a component that panics as
/// it starts (`--test-only-panic-in`): the supervision in haptic-leadership must end the term.
fn faulty<F, Fut>(
    name: &'static str,
    panic_in: &Option<String>,
    build: F,
) -> impl Fn(LeaderContext<ControllerEvent>) -> BoxFuture<'static, ()> + Send + Sync + 'static
where
    F: Fn(LeaderContext<ControllerEvent>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let armed = panic_in.as_deref() == Some(name);
    move |ctx| {
        if armed {
            async move { panic!("TEST ONLY: a panic injected into {name}") }.boxed()
        } else {
            build(ctx).boxed()
        }
    }
}

/// Runs the controller until `token` fires.
pub async fn run(client: Client, options: Options, token: CancellationToken) -> Result<(), Error> {
    let cache = StateCache::new();
    let probes = Arc::new(Probes {
        cache: cache.clone(),
        election: Default::default(),
        components: Default::default(),
        metrics: options.metrics.clone(),
    });
    let health_token = CancellationToken::new();
    let (_, health) = health::serve(options.health_addr, probes.clone(), health_token.clone())
        .await
        .map_err(|source| Error::Health {
            addr: options.health_addr,
            source,
        })?;

    // Every replica answers admission reviews, from the start: until a config is loaded it
    // lets changes through, saying so.
    let webhook = match options.webhook.clone() {
        Some(settings) => {
            let (_, task) = crate::webhook::serve(settings, cache.clone(), health_token.clone())
                .await
                .inspect_err(|_| health_token.cancel())?;
            Some(task)
        }
        None => None,
    };

    let Some(election) =
        config_loader::initial_election(client.clone(), &options.config, &token).await
    else {
        health_token.cancel();
        let _ = health.await;
        if let Some(webhook) = webhook {
            let _ = tokio::time::timeout(STOP_TIMEOUT, webhook).await;
        }
        return Ok(());
    };
    let election_config = election.election_config(&options.identity, &options.config.namespace);
    let bus =
        EventBus::<ControllerEvent>::with_config(BusConfig::default().with_sticky_kinds(STICKY));

    crate::metrics::observe(cache.clone(), bus.clone());
    let debug_state = crate::debug::DebugState::new(&options.identity);
    let debug = match options.debug_addr {
        Some(addr) => Some(
            crate::debug::serve(addr, debug_state.clone(), health_token.clone())
                .await
                .map_err(|source| Error::Health { addr, source })?
                .1,
        ),
        None => None,
    };

    let ns = options.config.namespace.clone();
    let subjects = recorder::Subjects {
        namespace: ns.clone(),
        config_name: options.config.name.clone(),
        lease_name: election_config.lease_name.clone(),
    };
    let events = recorder::recorder(client.clone(), &options.identity);
    let panic_in = options.test_only_panic_in.clone();
    let leadership = Leadership::new(client.clone(), election_config, bus)?
        .with_stop_timeout(STOP_TIMEOUT)
        .all_replicas("observer", move |bus, token| {
            crate::debug::component(debug_state.clone(), bus, token)
        })
        .all_replicas("config-loader", {
            let (client, at) = (client.clone(), options.config.clone());
            move |bus, token| config_loader::component(client, at, bus, token)
        })
        .all_replicas("resource-watchers", {
            let (client, cache) = (client.clone(), cache.clone());
            move |bus, token| watchers::component(client, cache, bus, token)
        })
        .all_replicas("credentials-loader", {
            let (client, ns) = (client.clone(), ns.clone());
            move |bus, token| credentials::component(client, ns, bus, token)
        })
        .all_replicas("pod-discovery", {
            let (client, ns) = (client.clone(), ns.clone());
            let scheme = options.agent_channel.scheme();
            move |bus, token| pod_discovery::component(client, ns, scheme, bus, token)
        })
        .all_replicas("default-certificate", {
            let (client, ns) = (client.clone(), ns.clone());
            let secret = options.default_certificate.clone();
            move |_, token| async move {
                match secret {
                    Some(name) => {
                        crate::default_certificate::component(client, ns, name, token).await;
                    }
                    None => token.cancelled().await,
                }
            }
        })
        .all_replicas("reconciler", {
            let window = options.reconcile_window;
            move |bus, token| reconciler::component(window, bus, token)
        })
        .all_replicas("warm-standby", {
            let cache = cache.clone();
            let interval = options.standby_render_interval;
            move |bus, token| crate::standby::component(cache.clone(), interval, bus, token)
        })
        .leader_only(
            "coordinator",
            faulty("coordinator", &panic_in, {
                let cache = cache.clone();
                move |ctx| coordinator::component(cache.clone(), ctx)
            }),
        )
        .leader_only(
            "render-gate",
            faulty("render-gate", &panic_in, {
                let settings = GateSettings {
                    haproxy: options.haproxy.clone(),
                    policy: options.policy.clone(),
                };
                move |ctx| render_gate::component(settings.clone(), ctx)
            }),
        )
        .leader_only(
            "deployer",
            faulty("deployer", &panic_in, {
                let channel = options.agent_channel.clone();
                move |ctx| scheduler::component(channel.clone(), ctx)
            }),
        )
        .leader_only(
            "drift-prevention",
            faulty("drift-prevention", &panic_in, {
                let channel = options.agent_channel.clone();
                move |ctx| drift::component(channel.clone(), ctx)
            }),
        )
        .leader_only(
            "status-updater",
            faulty("status-updater", &panic_in, {
                let (client, name, ns) = (client.clone(), options.config.name.clone(), ns.clone());
                move |ctx| status::component(client.clone(), name.clone(), ns.clone(), ctx)
            }),
        )
        .leader_only(
            "status-applier",
            faulty("status-applier", &panic_in, {
                let (client, cache) = (client.clone(), cache.clone());
                move |ctx| status_applier::component(client.clone(), cache.clone(), ctx)
            }),
        )
        .leader_only(
            "config-publisher",
            faulty("config-publisher", &panic_in, {
                let client = client.clone();
                let settings = published::Settings {
                    namespace: ns.clone(),
                    config_name: options.config.name.clone(),
                    compress_above: published::COMPRESS_ABOVE,
                };
                move |ctx| published::component(client.clone(), settings.clone(), ctx)
            }),
        )
        .leader_only(
            "pool-keeper",
            faulty("pool-keeper", &panic_in, {
                let client = client.clone();
                let owner = format!("{}/{}", options.config.namespace, options.config.name);
                move |ctx| pool_keeper::component(client.clone(), owner.clone(), ctx)
            }),
        )
        .leader_only(
            "event-recorder",
            faulty("event-recorder", &panic_in, move |ctx| {
                recorder::component(events.clone(), subjects.clone(), ctx)
            }),
        );
    let leadership = match options.election_clock_rate {
        Some(rate) => leadership.with_clock(haptic_election::SkewedClock::new(rate)),
        None => leadership,
    };
    let _ = probes.election.set(leadership.health());
    let _ = probes.components.set(leadership.metrics());
    info!(identity = %options.identity, "starting");
    let result = leadership.run(token).await;
    health_token.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), health).await;
    if let Some(webhook) = webhook {
        let _ = tokio::time::timeout(STOP_TIMEOUT, webhook).await;
    }
    if let Some(debug) = debug {
        let _ = tokio::time::timeout(Duration::from_secs(1), debug).await;
    }
    info!("stopped");
    result.map_err(Error::from)
}
