//! `haptic-controller migrate`: what moving Ingresses from ingress-nginx to HAPTIC changes,
//! per Ingress and per `nginx.ingress.kubernetes.io/*` annotation, from the registry
//! ([`haptic_render::nginx`]) that the webhook and the Events read too.

use serde::Serialize;
use serde_json::Value as Json;

use haptic_render::nginx::{self, Finding, Verdict};

/// One Ingress of the input and what happens to its ingress-nginx annotations.
#[derive(Debug, Clone, Serialize)]
pub struct IngressReport {
    /// Where it was read from (a file name).
    pub source: String,
    /// `metadata.namespace` (`""` when the document has none).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// Its ingress-nginx annotations, sorted, each with its verdict and note.
    pub annotations: Vec<Finding>,
    /// Its annotations whose values cannot be applied (the webhook denies it for them).
    pub invalid: Vec<nginx::Invalid>,
    /// Whether the webhook denies it (a snippet, an invalid value).
    pub refused: bool,
    /// Whether it would behave differently under HAPTIC (an annotation is not applied, is
    /// refused, or is applied differently).
    pub changes: bool,
}

/// The report over every Ingress read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The Ingresses, in input order.
    pub ingresses: Vec<IngressReport>,
    /// Whether any Ingress would behave differently (the exit status 1).
    pub behaves_differently: bool,
}

impl Report {
    /// Adds the Ingresses among `docs` (documents of a YAML stream; a `List`'s items too);
    /// other kinds are skipped.
    pub fn add(&mut self, source: &str, docs: &[Json]) {
        for doc in docs {
            if doc["kind"] == "List" {
                let items = doc["items"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                self.add(source, items);
                continue;
            }
            if doc["kind"] != "Ingress" {
                continue;
            }
            let text = |pointer: &str| {
                doc.pointer(pointer)
                    .and_then(Json::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            let annotations = nginx::judge_object(doc);
            let invalid = nginx::invalid_values(doc);
            let refused =
                annotations.iter().any(|f| f.verdict == Verdict::Refused) || !invalid.is_empty();
            let changes = refused || annotations.iter().any(|f| f.verdict != Verdict::Supported);
            self.behaves_differently |= changes;
            self.ingresses.push(IngressReport {
                source: source.to_owned(),
                namespace: text("/metadata/namespace"),
                name: text("/metadata/name"),
                annotations,
                invalid,
                refused,
                changes,
            });
        }
    }

    /// The report for people: per Ingress, each annotation with its verdict and what changes,
    /// then a summary line.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for ing in &self.ingresses {
            let namespace = if ing.namespace.is_empty() {
                "(no namespace)"
            } else {
                &ing.namespace
            };
            out.push_str(&format!(
                "Ingress {namespace}/{} ({}):",
                ing.name, ing.source
            ));
            if ing.annotations.is_empty() {
                out.push_str(" no ingress-nginx annotations: carried over as it is\n");
                continue;
            }
            out.push('\n');
            for f in &ing.annotations {
                out.push_str(&format!("  {} {}: {}\n", f.verdict, f.annotation, f.note));
            }
            for i in &ing.invalid {
                out.push_str(&format!("  invalid {}\n", i.stored()));
            }
            let snippets = ing
                .annotations
                .iter()
                .any(|f| f.verdict == Verdict::Refused);
            match (snippets, !ing.invalid.is_empty()) {
                (true, false) => out.push_str(
                    "  => denied by the admission webhook: remove the snippet annotations first\n",
                ),
                (false, true) => out.push_str(
                    "  => denied by the admission webhook: fix the invalid values first\n",
                ),
                (true, true) => out.push_str(
                    "  => denied by the admission webhook: remove the snippet annotations and fix the invalid values first\n",
                ),
                (false, false) => {}
            }
        }
        let changed = self.ingresses.iter().filter(|i| i.changes).count();
        let refused = self.ingresses.iter().filter(|i| i.refused).count();
        out.push_str(&format!(
            "{} Ingresses: {changed} would behave differently ({refused} refused), {} carried over as they are\n",
            self.ingresses.len(),
            self.ingresses.len() - changed,
        ));
        out
    }
}
