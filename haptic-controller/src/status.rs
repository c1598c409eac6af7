//! The status updater (leader only): writes the HTC's status (observedGeneration, validation
//! fields, conditions `Valid` and `Deployed`) when what it would say changes.
//!
//! Only a leader whose Lease is fresh by its own clock writes ([`LeaderContext::lease_is_fresh`]):
//! a leader frozen past its RenewDeadline wakes up unable to write before its elector has even
//! noticed. Writes are merge patches of the `status` subresource (no resourceVersion, so no
//! conflict with spec edits), retried with backoff on failure.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use kube::{
    Client,
    api::{Api, Patch, PatchParams},
};
use serde_json::json;
use tracing::{debug, warn};

use crate::{
    crd::{Condition, HAProxyTemplateConfig},
    events::{ConfigVerdict, ControllerEvent, DeploymentReport, Kind, PodOutcome, TokenState},
};

/// Changes closer together than this are written once.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// The component: subscribe now, run the returned future.
pub fn component(
    client: Client,
    name: String,
    namespace: String,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "status-updater",
        Filter::kinds([
            Kind::ConfigVerdict,
            Kind::GateVerdict,
            Kind::RenderFailed,
            Kind::Rendered,
            Kind::Deployed,
            Kind::AgentToken,
        ]),
    );
    async move {
        let api: Api<HAProxyTemplateConfig> = Api::namespaced(client, &namespace);
        let mut view = View::default();
        let mut written: Option<serde_json::Value> = None;
        let mut transitions: BTreeMap<String, (String, String)> = BTreeMap::new();
        let mut due: Option<tokio::time::Instant> = None;
        let mut backoff = Duration::from_millis(200);
        loop {
            let sleep = crate::tasks::until(due);
            tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => {
                    let Some(event) = event else { return };
                    view.absorb(&event);
                    if due.is_none() {
                        due = Some(tokio::time::Instant::now() + DEBOUNCE);
                    }
                }
                () = sleep => {
                    due = None;
                    let Some(status) = view.status(&mut transitions) else { continue };
                    if written.as_ref() == Some(&status) {
                        continue;
                    }
                    if !ctx.lease_is_fresh() {
                        debug!("not writing status: this replica's Lease is not fresh");
                        continue;
                    }
                    let patch = json!({ "status": status });
                    match api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                        Ok(_) => {
                            written = Some(status);
                            backoff = Duration::from_millis(200);
                        }
                        Err(error) => {
                            warn!(%error, htc = %name, retry_in = ?backoff, "writing the HTC status failed");
                            due = Some(tokio::time::Instant::now() + backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(30));
                        }
                    }
                }
            }
        }
    }
}

/// What the status says, gathered from the bus.
#[derive(Default)]
struct View {
    verdict: Option<Arc<ConfigVerdict>>,
    /// HAProxy's refusal of the latest checked render, if it refused it.
    gate_refusal: Option<String>,
    render_failure: Option<String>,
    deployed: Option<Arc<DeploymentReport>>,
    token_missing: Option<String>,
}

impl View {
    fn absorb(&mut self, event: &ControllerEvent) {
        match event {
            ControllerEvent::ConfigVerdict(v) => {
                if self
                    .verdict
                    .as_ref()
                    .is_some_and(|old| old.generation != v.generation)
                {
                    self.gate_refusal = None;
                    self.render_failure = None;
                }
                self.verdict = Some(v.clone());
            }
            ControllerEvent::GateVerdict(v) => self.gate_refusal = v.refused.clone(),
            ControllerEvent::RenderFailed(f) => self.render_failure = Some(f.message.clone()),
            ControllerEvent::Rendered(_) => self.render_failure = None,
            ControllerEvent::Deployed(d) => self.deployed = Some(d.clone()),
            ControllerEvent::AgentToken(t) => {
                self.token_missing = match &**t {
                    TokenState::Missing { reason } => Some(reason.clone()),
                    TokenState::Present(_) => None,
                }
            }
            _ => {}
        }
    }

    fn status(
        &self,
        transitions: &mut BTreeMap<String, (String, String)>,
    ) -> Option<serde_json::Value> {
        let verdict = self.verdict.as_ref()?;
        let now = jiff::Timestamp::now().to_string();
        let last_validated = jiff::Timestamp::try_from(verdict.at)
            .map(|t| t.to_string())
            .unwrap_or_else(|_| now.clone());
        let (valid, reason, message, errors) = if !verdict.errors.is_empty() {
            (
                false,
                "ValidationFailed",
                format!("{} problem(s): {}", verdict.errors.len(), verdict.errors[0]),
                verdict.errors.clone(),
            )
        } else if let Some(failure) = &self.render_failure {
            (
                false,
                "RenderFailed",
                failure.clone(),
                vec![failure.clone()],
            )
        } else if let Some(output) = &self.gate_refusal {
            (
                false,
                "HAProxyRefused",
                format!("haproxy -c refused the rendered config: {output}"),
                vec![output.clone()],
            )
        } else {
            (true, "Valid", "the config is valid".to_owned(), Vec::new())
        };
        let (deployed, d_reason, d_message) = match (&self.token_missing, &self.deployed) {
            (Some(reason), _) => (
                false,
                "TokenMissing",
                format!("waiting for the agent token: {reason}"),
            ),
            (None, None) => (false, "Pending", "nothing deployed yet".to_owned()),
            (None, Some(report)) => describe(report),
        };
        let mut conditions = Vec::new();
        for (kind, ok, reason, message) in [
            ("Valid", valid, reason, message.clone()),
            ("Deployed", deployed, d_reason, d_message),
        ] {
            let status = if ok { "True" } else { "False" }.to_owned();
            let entry = transitions
                .entry(kind.to_owned())
                .or_insert_with(|| (status.clone(), now.clone()));
            if entry.0 != status {
                *entry = (status.clone(), now.clone());
            }
            conditions.push(Condition {
                type_: kind.to_owned(),
                status,
                reason: reason.to_owned(),
                message,
                last_transition_time: entry.1.clone(),
                observed_generation: Some(verdict.generation),
            });
        }
        Some(json!({
            "observedGeneration": verdict.generation,
            "validationStatus": if valid { "Valid" } else { "Invalid" },
            "validationMessage": message,
            "validationErrors": errors,
            "lastValidated": last_validated,
            "conditions": conditions,
        }))
    }
}

/// `Deployed`: true when every pod runs the latest set; the message counts pods per checksum.
fn describe(report: &DeploymentReport) -> (bool, &'static str, String) {
    let total = report.pods.len();
    if total == 0 {
        return (
            false,
            "NoPods",
            "no HAProxy pod matches podSelector".to_owned(),
        );
    }
    let mut by_checksum: BTreeMap<String, usize> = BTreeMap::new();
    let mut failed = Vec::new();
    for (pod, outcome) in &report.pods {
        let checksum = report.live.get(pod).map_or("none", String::as_str);
        *by_checksum.entry(short(checksum)).or_default() += 1;
        if let PodOutcome::Failed(why) = outcome {
            failed.push(format!("{pod}: {why}"));
        }
    }
    let live = report
        .pods
        .values()
        .filter(|o| **o == PodOutcome::Live)
        .count();
    let mut message = format!(
        "{live}/{total} pods run {}; {}",
        short(&report.checksum),
        by_checksum
            .iter()
            .map(|(c, n)| format!("{n} on {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !failed.is_empty() {
        message.push_str("; failing: ");
        message.push_str(&failed.join("; "));
    }
    let reason = if live == total {
        "AllPodsLive"
    } else if failed.is_empty() {
        "InProgress"
    } else {
        "PodsFailing"
    };
    (live == total, reason, message)
}

fn short(checksum: &str) -> String {
    if checksum == "none" {
        return "none".to_owned();
    }
    format!("sha256:{}", checksum.chars().take(12).collect::<String>())
}
