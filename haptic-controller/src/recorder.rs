//! Kubernetes Events (leader only), written through kube-runtime's [`Recorder`]
//! (`events.k8s.io/v1`; a repeat of the same reason on the same object becomes a series, as
//! kube-runtime deduplicates them).
//!
//! | reason | type | regarding | when |
//! | --- | --- | --- | --- |
//! | `LeaderElection` | Normal | the Lease | `<identity> became leader` (client-go's wording) |
//! | `Valid` / `Invalid` | Normal / Warning | the HTC | a generation of the HTC is judged |
//! | `RenderFailed` | Warning | the HTC | a template failed to render |
//! | `HAProxyRefused` | Warning | the HTC | the render gate's `haproxy -c` (or the config policy) refused a set |
//! | `DeploymentFailed` | Warning | the Pod | an agent refused or could not take the set |
//! | `Fenced` | Warning | the Pod | an agent's fence is at or above this leader's epoch |
//! | template reasons | as asked | the object | a template called `record_event(...)`: once while a render asks for it, not again for every other object's change |
//!
//! Only the leader writes, and only while its Lease is fresh by its own clock. Publishing is
//! best effort: a failure is logged, never retried in a loop, and never holds up a deployment.
//! No certificate, key or token goes into a note: notes carry messages the controller wrote
//! (HAProxy's alert lines, the agents' answers), cut to the API's 1 KiB.

use std::{
    collections::{BTreeMap, HashSet},
    time::Duration,
};

use haptic_eventbus::Filter;
use haptic_leadership::LeaderContext;
use haptic_render::EventRequest;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client, Resource,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::{debug, warn};

use crate::{
    crd::HAProxyTemplateConfig,
    events::{ControllerEvent, Kind, PodOutcome},
};

/// The `reportingController` of every Event.
pub const REPORTING_CONTROLLER: &str = "haptic-controller";

/// The longest note the API takes.
const NOTE_MAX: usize = 1024;

/// How long one Event write may take before it is given up.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// What the Events are about.
#[derive(Debug, Clone)]
pub struct Subjects {
    /// The namespace of the controller, its HTC, Lease and pods.
    pub namespace: String,
    /// The HTC's name.
    pub config_name: String,
    /// The Lease's name.
    pub lease_name: String,
}

/// Builds the recorder every term of this replica shares (so a repeated Event becomes a
/// series across terms).
pub fn recorder(client: Client, identity: &str) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: Some(identity.to_owned()),
        },
    )
}

/// The component: subscribe now, run the returned future.
pub fn component(
    recorder: Recorder,
    subjects: Subjects,
    ctx: LeaderContext<ControllerEvent>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut events = ctx.bus().subscribe_leader_only(
        "event-recorder",
        Filter::kinds([
            Kind::BecameLeader,
            Kind::ConfigVerdict,
            Kind::RenderFailed,
            Kind::GateVerdict,
            Kind::Rendered,
            Kind::Deployed,
            Kind::Fenced,
        ]),
    );
    async move {
        let mut htc_uid: Option<String> = None;
        let mut last_verdict: Option<(i64, bool)> = None;
        let mut failing: BTreeMap<String, String> = BTreeMap::new();
        let mut requested = Requested::default();
        loop {
            let event = tokio::select! {
                () = ctx.token().cancelled() => return,
                event = events.recv() => match event {
                    Some(event) => event,
                    None => return,
                },
            };
            // Each Event, its object, and for a template's request what marks it recorded.
            let mut out: Vec<(Event, ObjectReference, Option<RequestKey>)> = Vec::new();
            let htc = |uid: &Option<String>| ObjectReference {
                api_version: Some(HAProxyTemplateConfig::api_version(&()).into_owned()),
                kind: Some(HAProxyTemplateConfig::kind(&()).into_owned()),
                name: Some(subjects.config_name.clone()),
                namespace: Some(subjects.namespace.clone()),
                uid: uid.clone(),
                ..ObjectReference::default()
            };
            let pod = |name: &str| ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name.to_owned()),
                namespace: Some(subjects.namespace.clone()),
                ..ObjectReference::default()
            };
            match &*event {
                ControllerEvent::BecameLeader(_) => out.push((
                    event_of(
                        EventType::Normal,
                        "LeaderElection",
                        "BecameLeader",
                        format!("{} became leader", ctx.identity()),
                    ),
                    ObjectReference {
                        api_version: Some("coordination.k8s.io/v1".into()),
                        kind: Some("Lease".into()),
                        name: Some(subjects.lease_name.clone()),
                        namespace: Some(subjects.namespace.clone()),
                        ..ObjectReference::default()
                    }, None)),
                ControllerEvent::ConfigVerdict(verdict) => {
                    if !verdict.uid.is_empty() {
                        htc_uid = Some(verdict.uid.clone());
                    }
                    let valid = verdict.errors.is_empty();
                    if last_verdict == Some((verdict.generation, valid)) {
                        continue;
                    }
                    last_verdict = Some((verdict.generation, valid));
                    let event = if valid {
                        event_of(
                            EventType::Normal,
                            "Valid",
                            "Validate",
                            format!("generation {} is valid", verdict.generation),
                        )
                    } else {
                        event_of(
                            EventType::Warning,
                            "Invalid",
                            "Validate",
                            format!(
                                "generation {} is invalid; the running config stays: {}",
                                verdict.generation,
                                verdict.errors.join("; ")
                            ),
                        )
                    };
                    out.push((event, htc(&htc_uid), None));
                }
                ControllerEvent::RenderFailed(failure) => out.push((
                    event_of(
                        EventType::Warning,
                        "RenderFailed",
                        "Render",
                        failure.message.clone(),
                    ),
                    htc(&htc_uid), None)),
                ControllerEvent::GateVerdict(verdict) => {
                    if let Some(refusal) = &verdict.refused {
                        out.push((
                            event_of(
                                EventType::Warning,
                                "HAProxyRefused",
                                "Validate",
                                format!(
                                    "the rendered set sha256:{} was not deployed: {refusal}",
                                    short(&verdict.checksum)
                                ),
                            ),
                            htc(&htc_uid), None));
                    }
                }
                // What the templates ask for and was not recorded yet: a change to one object
                // sends nothing again about the others.
                ControllerEvent::Rendered(set) => {
                    for (request, key) in requested.fresh(&set.requests.events) {
                        match request_event(request) {
                            Some((event, regarding)) => out.push((event, regarding, Some(key))),
                            None => debug!(
                                ?request,
                                "a template asked for an Event about an object with no name"
                            ),
                        }
                    }
                }
                ControllerEvent::Deployed(report) => {
                    for (name, outcome) in &report.pods {
                        match outcome {
                            PodOutcome::Failed(message) => {
                                if failing.get(name) == Some(message) {
                                    continue;
                                }
                                failing.insert(name.clone(), message.clone());
                                let mut event = event_of(
                                    EventType::Warning,
                                    "DeploymentFailed",
                                    "Deploy",
                                    format!(
                                        "sha256:{} is not live on {name}: {message}",
                                        short(&report.checksum)
                                    ),
                                );
                                event.secondary = Some(htc(&htc_uid));
                                out.push((event, pod(name), None));
                            }
                            PodOutcome::Live | PodOutcome::Pending => {
                                failing.remove(name);
                            }
                        }
                    }
                }
                ControllerEvent::Fenced(fenced) => out.push((
                    event_of(
                        EventType::Warning,
                        "Fenced",
                        "Deploy",
                        format!(
                            "the agent on {} refused epoch {}: its fence is {} (a newer leader wrote there); {}",
                            fenced.pod, fenced.epoch, fenced.fence, fenced.outcome
                        ),
                    ),
                    pod(&fenced.pod), None)),
                _ => {}
            }
            for (event, regarding, request) in out {
                if !ctx.lease_is_fresh() {
                    debug!(reason = %event.reason, "not writing an Event: this replica's Lease is not fresh");
                    continue;
                }
                let publish = recorder.publish(&event, &regarding);
                tokio::select! {
                    () = ctx.token().cancelled() => return,
                    result = tokio::time::timeout(PUBLISH_TIMEOUT, publish) => match result {
                        Ok(Ok(())) => {
                            debug!(reason = %event.reason, "event recorded");
                            if let Some(key) = request {
                                requested.recorded(key);
                            }
                        }
                        Ok(Err(error)) => warn!(%error, reason = %event.reason, "recording an Event failed"),
                        Err(_) => warn!(reason = %event.reason, "recording an Event timed out"),
                    },
                }
            }
        }
    }
}

/// What identifies a template's Event request: its object and its content.
type RequestKey = ([Option<String>; 5], String, String, String);

fn request_key(request: &EventRequest) -> RequestKey {
    (
        [
            request.api_version.clone(),
            request.kind.clone(),
            request.namespace.clone(),
            request.name.clone(),
            request.uid.clone(),
        ],
        request.type_.clone(),
        request.reason.clone(),
        request.message.clone(),
    )
}

/// The template requests recorded this term and still asked for: a render sends only the
/// others. A request the templates stop asking for is forgotten, so asked again later it is
/// a new occurrence and is recorded again; one whose write failed stays unrecorded and is sent
/// with the next render.
#[derive(Debug, Default)]
struct Requested(HashSet<RequestKey>);

impl Requested {
    /// The requests of a render not recorded yet, with their keys.
    fn fresh<'a>(&mut self, requests: &'a [EventRequest]) -> Vec<(&'a EventRequest, RequestKey)> {
        let asked: Vec<(&EventRequest, RequestKey)> =
            requests.iter().map(|r| (r, request_key(r))).collect();
        let current: HashSet<&RequestKey> = asked.iter().map(|(_, k)| k).collect();
        self.0.retain(|k| current.contains(k));
        let mut seen = HashSet::new();
        asked
            .into_iter()
            .filter(|(_, k)| !self.0.contains(k) && seen.insert(k.clone()))
            .collect()
    }

    /// Marks a request recorded.
    fn recorded(&mut self, key: RequestKey) {
        self.0.insert(key);
    }
}

/// An Event with its note cut to what the API takes.
///
/// The action carries a digest of the note (`Render:1a2b3c4d`): kube-runtime's recorder makes
/// a repeat of the same type, action, reason and object a series of the first Event, keeping
/// that Event's note. Without the digest, a new message with the same reason on the same object
/// (a TLS Secret first missing, then expired; a deployment failing for another reason) would
/// only count up under the old, wrong note. The same note again is still one Event's series.
fn event_of(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    let note = cut(note, NOTE_MAX);
    Event {
        type_,
        reason: reason.to_owned(),
        action: format!("{action}:{:08x}", fnv1a32(&note)),
        note: Some(note),
        secondary: None,
    }
}

/// FNV-1a, 32 bits: a digest fixed by its definition, so every replica and version gives an
/// Event the same action (a new leader continues the series of the same note).
fn fnv1a32(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// The Event a template asked for, about the object it named.
fn request_event(request: &EventRequest) -> Option<(Event, ObjectReference)> {
    let name = request.name.clone().filter(|n| !n.is_empty())?;
    let type_ = if request.type_ == "Warning" {
        EventType::Warning
    } else {
        EventType::Normal
    };
    Some((
        event_of(type_, &request.reason, "Render", request.message.clone()),
        ObjectReference {
            api_version: request.api_version.clone(),
            kind: request.kind.clone(),
            name: Some(name),
            namespace: request.namespace.clone(),
            uid: request.uid.clone(),
            ..ObjectReference::default()
        },
    ))
}

/// The first 12 hex digits of a checksum.
fn short(checksum: &str) -> &str {
    checksum.get(..12).unwrap_or(checksum)
}

/// `text` cut to at most `max` bytes on a character boundary, marked when cut.
fn cut(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_note_is_a_new_event_and_the_same_note_the_same() {
        let missing = event_of(
            EventType::Warning,
            "TLSSecretUnusable",
            "Render",
            "missing".into(),
        );
        let expired = event_of(
            EventType::Warning,
            "TLSSecretUnusable",
            "Render",
            "expired".into(),
        );
        let again = event_of(
            EventType::Warning,
            "TLSSecretUnusable",
            "Render",
            "expired".into(),
        );
        assert_ne!(missing.action, expired.action);
        assert_eq!(expired.action, again.action);
        assert!(expired.action.starts_with("Render:") && expired.action.len() == 15);
        assert_eq!(expired.note.as_deref(), Some("expired"));
    }

    #[test]
    fn template_events_are_sent_once_while_they_are_asked_for() {
        let ask = |name: &str| EventRequest {
            api_version: Some("networking.k8s.io/v1".into()),
            kind: Some("Ingress".into()),
            namespace: Some("shop".into()),
            name: Some(name.into()),
            uid: None,
            type_: "Warning".into(),
            reason: "Unsafe".into(),
            message: format!("{name} is unsafe"),
        };
        let names = |fresh: Vec<(&EventRequest, RequestKey)>, requested: &mut Requested| {
            fresh
                .into_iter()
                .map(|(r, k)| {
                    requested.recorded(k);
                    r.name.clone().unwrap_or_default()
                })
                .collect::<Vec<_>>()
        };
        let mut requested = Requested::default();
        let (a, b, c) = (ask("a"), ask("b"), ask("c"));
        let first = [a.clone(), b.clone(), a.clone()];
        assert_eq!(names(requested.fresh(&first), &mut requested), ["a", "b"]);
        // One more object asks: only its Event goes out, not the others' again.
        let second = [a.clone(), b.clone(), c.clone()];
        assert_eq!(names(requested.fresh(&second), &mut requested), ["c"]);
        // A render with the same requests sends nothing.
        assert!(requested.fresh(&second).is_empty());
        // `a` stops asking, then asks again: a new occurrence.
        assert!(names(requested.fresh(&[b.clone(), c.clone()]), &mut requested).is_empty());
        assert_eq!(names(requested.fresh(&second), &mut requested), ["a"]);
        // A request whose write failed (not marked recorded) is sent with the next render.
        let d = ask("d");
        let third = [a, b, c, d];
        assert_eq!(requested.fresh(&third).len(), 1);
        assert_eq!(names(requested.fresh(&third), &mut requested), ["d"]);
    }

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        let text = "é".repeat(600);
        let cut = cut(text, NOTE_MAX);
        assert!(cut.len() <= NOTE_MAX, "{}", cut.len());
        assert!(cut.ends_with("..."));
        assert_eq!(super::cut("short".into(), NOTE_MAX), "short");
    }

    #[test]
    fn a_template_request_names_its_object() {
        let request = EventRequest {
            api_version: Some("networking.k8s.io/v1".into()),
            kind: Some("Ingress".into()),
            namespace: Some("shop".into()),
            name: Some("web".into()),
            uid: None,
            type_: "Warning".into(),
            reason: "ServiceNotFound".into(),
            message: "no Service shop/missing".into(),
        };
        let (event, regarding) = request_event(&request).expect("an event");
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, "ServiceNotFound");
        assert_eq!(regarding.kind.as_deref(), Some("Ingress"));
        assert_eq!(regarding.name.as_deref(), Some("web"));
        let nameless = EventRequest {
            name: None,
            ..request
        };
        assert!(request_event(&nameless).is_none());
    }
}
