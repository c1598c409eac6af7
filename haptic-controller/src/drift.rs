//! The drift-prevention monitor (leader only): every `driftPreventionInterval` it reads each
//! agent's `/v1/state` and reports a pod whose live checksum is not the one last deployed there,
//! so the scheduler re-applies it. (HAPTIC re-pushes blindly; our agents can say what is live.)

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use haptic_agent_client::{AgentClient, ClientConfig, Target};
use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use tracing::{debug, warn};

use crate::{
    channel::AgentChannel,
    events::{ControllerEvent, Kind, PodSet, TokenState},
};

/// The component: subscribe now, run the returned future.
pub fn component(
    channel: AgentChannel,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "drift-prevention",
        Filter::kinds([
            Kind::Deployed,
            Kind::PodSet,
            Kind::AgentToken,
            Kind::ConfigValidated,
        ]),
    );
    async move {
        let mut interval = Duration::from_secs(60);
        let mut client: Option<AgentClient> = None;
        let mut pods = Arc::new(PodSet::default());
        // The checksum each pod last confirmed live, from the deployer's reports.
        let mut expected: BTreeMap<String, String> = BTreeMap::new();
        let mut next = tokio::time::Instant::now() + interval;
        loop {
            tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    match &*event {
                        ControllerEvent::Deployed(report) => expected = report.live.clone(),
                        ControllerEvent::PodSet(set) => pods = set.clone(),
                        ControllerEvent::AgentToken(token) => {
                            client = match &**token {
                                TokenState::Present(token) => AgentClient::new(
                                    channel.client_config(
                                        ClientConfig::new(token.clone())
                                            .with_request_timeout(Duration::from_secs(10))
                                            .with_retries(1, Duration::from_millis(100)),
                                    ),
                                )
                                .ok(),
                                TokenState::Missing { .. } => None,
                            };
                        }
                        ControllerEvent::ConfigValidated(config)
                            if config.agent.drift_prevention_interval != interval =>
                        {
                            interval = config.agent.drift_prevention_interval;
                            next = tokio::time::Instant::now() + interval;
                        }
                        _ => {}
                    }
                }
                () = tokio::time::sleep_until(next) => {
                    next = tokio::time::Instant::now() + interval;
                    let Some(client) = &client else { continue };
                    for (name, pod) in &pods.pods {
                        let Some(want) = expected.get(name) else { continue };
                        let Ok(target) = Target::new(name.clone(), &pod.url) else { continue };
                        let state = tokio::select! {
                            () = ctx.token().cancelled() => return,
                            state = client.state(&target.url) => state,
                        };
                        match state {
                            Ok(state) if state.live_checksum.as_deref() == Some(want.as_str()) => {
                                debug!(pod = %name, "no drift");
                            }
                            Ok(state) => {
                                warn!(pod = %name, expected = %want, live = ?state.live_checksum, "drift: the pod's live set is not the one deployed");
                                ctx.bus().publish(ControllerEvent::DriftDetected {
                                    pod: name.as_str().into(),
                                    live: state.live_checksum,
                                });
                            }
                            Err(error) => warn!(pod = %name, %error, "drift check: reading the agent's state failed"),
                        }
                    }
                }
            }
        }
    }
}
