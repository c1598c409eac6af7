//! The HAProxyTemplateConfig custom resource: the one object users write, with HAPTIC's field
//! names and defaults (an `agent` block replaces HAPTIC's `dataplane`), and its status.
//!
//! Durations are strings such as `30s` or `1m30s`; they are parsed and checked by
//! [`crate::config`], never silently defaulted when malformed.

use std::collections::BTreeMap;

use kube::{CustomResource, CustomResourceExt};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The API group of the resource.
pub const GROUP: &str = "haproxy-haptic.org";
/// The served version.
pub const VERSION: &str = "v1alpha1";

/// What a user asks for: which resources to watch, the templates that turn them into an HAProxy
/// configuration, which pods get it and how the controller paces and elects.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "haproxy-haptic.org",
    version = "v1alpha1",
    kind = "HAProxyTemplateConfig",
    plural = "haproxytemplateconfigs",
    shortname = "htplcfg",
    shortname = "haptpl",
    namespaced,
    status = "HAProxyTemplateConfigStatus",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.validationStatus"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyTemplateConfigSpec {
    /// The HAProxy pods (in the controller's namespace) that get the configuration.
    pub pod_selector: PodSelector,
    /// Controller settings: leader election.
    #[serde(default)]
    pub controller: ControllerSettings,
    /// How to reach and pace the agents beside the HAProxy pods.
    #[serde(default)]
    pub agent: AgentSettings,
    /// Settings of the template engine.
    #[serde(default)]
    pub templating_settings: TemplatingSettings,
    /// Field paths removed from every watched resource before it is stored (default:
    /// `metadata.managedFields`). A leading `$.` is accepted.
    #[serde(default = "default_ignore_fields")]
    pub watched_resources_ignore_fields: Vec<String>,
    /// The resources templates read, by store name (`resources.<name>` in templates).
    #[serde(default)]
    pub watched_resources: BTreeMap<String, WatchedResource>,
    /// Joins computed in Rust from the stores (`derived.<name>` in templates): each value is a
    /// haptic-render `Derivation`, e.g. `{kind: serviceBackends, services: services,
    /// endpointSlices: endpointslices, routedBy: ingresses}`.
    #[serde(default)]
    #[schemars(schema_with = "free_form_map")]
    pub derived_views: BTreeMap<String, serde_json::Value>,
    /// Snippets any template can `{% include %}`.
    #[serde(default)]
    pub template_snippets: BTreeMap<String, TemplateSource>,
    /// The main template, rendered to `haproxy.cfg`.
    pub haproxy_config: TemplateSource,
    /// Map files by file name, rendered to `maps/<name>`.
    #[serde(default)]
    pub maps: BTreeMap<String, TemplateSource>,
    /// General files by name, rendered to `path` (default: the name).
    #[serde(default)]
    pub files: BTreeMap<String, FileSource>,
    /// Certificates by name, rendered to `ssl/<name>.pem`, or one per resource of `forEach`.
    #[serde(default)]
    pub ssl_certificates: BTreeMap<String, CertificateSource>,
    /// Templates that write no file, by name: they ask the cluster to show Events and status
    /// (`record_event`, `set_status`) and refuse changes at admission (`refuse`); the text they
    /// render is dropped. Kept apart from `haproxyConfig`, they render again only when what
    /// they read changes, and a change only they read leaves `haproxy.cfg` as it was.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub status_templates: BTreeMap<String, TemplateSource>,
    /// Tests of the templates by name: fixtures (resources per store) rendered with this
    /// config, and assertions on the result. Run by `haptic-controller validate` and by the
    /// webhook, which denies a config whose tests fail.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub validation_tests: BTreeMap<String, ValidationTest>,
}

/// One validation test: the resources of each store, and what the rendered set must satisfy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValidationTest {
    /// What the test shows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Resources by store name (a key of `watchedResources`), as the API would return them.
    #[serde(default)]
    #[schemars(schema_with = "fixtures_schema")]
    pub fixtures: BTreeMap<String, Vec<serde_json::Value>>,
    /// What the rendered set must satisfy, checked in order; every failure is reported.
    pub assertions: Vec<Assertion>,
}

/// The kinds of assertion.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AssertionType {
    /// The set passes the agents' config policy and `haproxy -c`.
    HaproxyValid,
    /// `pattern` (a regular expression) matches somewhere in `target`.
    Contains,
    /// `pattern` matches nowhere in `target`.
    NotContains,
    /// `target` is exactly `expected` (leading and trailing whitespace aside).
    Equals,
    /// `jsonpath` over the template context (`resources`, `derived`, the extra context) gives
    /// `expected` (one result: that value; several: the list), or anything when `expected`
    /// is absent.
    Jsonpath,
    /// `pattern` matches `expected` times in `target`.
    MatchCount,
    /// `patterns` match in `target` in this order.
    MatchOrder,
    /// The fixtures loaded in the reverse order render the same bytes.
    Deterministic,
}

/// One assertion of a validation test.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Assertion {
    /// What is asserted.
    #[serde(rename = "type")]
    pub type_: AssertionType,
    /// What the assertion means, for the report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `haproxy.cfg` (default), `map:<name>`, `file:<name>`, `cert:<name>`, or a path of the
    /// rendered set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A regular expression (`contains`, `not_contains`, `match_count`); `(?m)` makes `^` and
    /// `$` match at line ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Regular expressions that must match in this order (`match_order`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patterns: Vec<String>,
    /// The expected text (`equals`), count (`match_count`) or value (`jsonpath`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub expected: Option<serde_json::Value>,
    /// A JSONPath (RFC 9535) over the template context (`jsonpath`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonpath: Option<String>,
}

fn fixtures_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "additionalProperties": {
            "type": "array",
            "items": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true
            }
        }
    })
}

fn any_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "x-kubernetes-preserve-unknown-fields": true
    })
}

fn default_ignore_fields() -> Vec<String> {
    vec!["metadata.managedFields".to_owned()]
}

fn free_form_map(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true
        }
    })
}

fn free_form_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Which pods get the configuration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodSelector {
    /// Labels every HAProxy pod carries; must not be empty.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// Controller settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControllerSettings {
    /// Leader election among the controller replicas.
    #[serde(default)]
    pub leader_election: LeaderElectionSettings,
}

/// Leader election settings; durations as strings like `30s`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct LeaderElectionSettings {
    /// Whether replicas elect a leader (default true). False: this replica leads at once, with
    /// no Lease; run one replica only.
    pub enabled: bool,
    /// The Lease's name, in the controller's namespace (default `haptic-leader`).
    pub lease_name: String,
    /// How long a Lease is valid after its last renew (default `30s`).
    pub lease_duration: String,
    /// How long a leader keeps trying to renew before it steps down (default `20s`).
    pub renew_deadline: String,
    /// How often candidates retry (default `5s`).
    pub retry_period: String,
}

impl Default for LeaderElectionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            lease_name: "haptic-leader".to_owned(),
            lease_duration: "30s".to_owned(),
            renew_deadline: "20s".to_owned(),
            retry_period: "5s".to_owned(),
        }
    }
}

/// How to reach and pace the agents.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct AgentSettings {
    /// The agent's port on each pod (default 9090, the agent's own default).
    pub port: u16,
    /// The Secret key holding the agents' bearer token (default `haptic-agent-token` / `token`,
    /// in the controller's namespace).
    pub token_secret_ref: SecretKeyRef,
    /// The agent container's name: a pod gets the configuration once it is ready (default
    /// `haptic-agent`; a pod without a container of that name counts when the pod is Ready).
    pub container_name: String,
    /// Least time from a pod's reload of HAProxy to its next deployment (default `2s`);
    /// deployments the agent makes through HAProxy's runtime API, with no reload, are not paced.
    pub min_deployment_interval: String,
    /// How often the leader compares each agent's live set with the last deployed one and
    /// re-applies where they differ (default `60s`).
    pub drift_prevention_interval: String,
    /// A deployment still running after this long is abandoned and retried (default `30s`).
    pub deployment_timeout: String,
    /// How many pods are applied to at once (default 0: all at once).
    pub max_parallel: u32,
}

impl Default for AgentSettings {
    fn default() -> Self {
        Self {
            port: 9090,
            token_secret_ref: SecretKeyRef::default(),
            container_name: "haptic-agent".to_owned(),
            min_deployment_interval: "2s".to_owned(),
            drift_prevention_interval: "60s".to_owned(),
            deployment_timeout: "30s".to_owned(),
            max_parallel: 0,
        }
    }
}

/// A key of a Secret in the controller's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct SecretKeyRef {
    /// The Secret's name.
    pub name: String,
    /// The key in its `data`.
    pub key: String,
}

impl Default for SecretKeyRef {
    fn default() -> Self {
        Self {
            name: "haptic-agent-token".to_owned(),
            key: "token".to_owned(),
        }
    }
}

/// Settings of the template engine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplatingSettings {
    /// Free JSON handed to every template as top-level variables.
    #[serde(default)]
    #[schemars(schema_with = "free_form_object")]
    pub extra_context: BTreeMap<String, serde_json::Value>,
}

/// One watched resource type.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WatchedResource {
    /// `v1`, `networking.k8s.io/v1`, ...
    pub api_version: String,
    /// The resource's plural name, e.g. `ingresses`; resolved through discovery.
    pub resources: String,
    /// Field paths whose values form the key templates `lookup` by (default namespace, name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_by: Option<Vec<String>>,
    /// A label selector (`app=web,tier!=cache`), applied by the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_selector: Option<String>,
    /// A field selector (`metadata.namespace!=kube-system`), applied by the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_selector: Option<String>,
    /// Whether the admission webhook checks creates, updates and deletes of these resources
    /// (the config rendered with the change, `haproxy -c`, the validation tests) and denies
    /// those that would break the config (default false). The webhook's
    /// ValidatingWebhookConfiguration must send them (`deploy/webhook/`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub enable_validation_webhook: bool,
    /// Watch only this namespace (default: every namespace). A namespaced watch needs only a
    /// Role there, not a ClusterRole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The resource may not be served (default false): while the API server does not serve it
    /// (its CRD is not installed), the store stays empty and counts as synced, so renders go on
    /// without it; the controller says so once and starts watching when it appears.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
}

/// A template's source.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct TemplateSource {
    /// The template (tera syntax).
    pub template: String,
}

/// A general file's template and where it goes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct FileSource {
    /// The template.
    pub template: String,
    /// Relative path in the file set (default: the entry's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// A certificate's template.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CertificateSource {
    /// The template; it renders PEM (chain and key).
    pub template: String,
    /// Render once per resource of this store (to `ssl/<bucket>/<namespace>_<name>.pem`, the
    /// path `ssl_file()` gives: 64 buckets, `00` to `3f`, by a hash of the name); a blank
    /// output writes no file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<String>,
}

/// What the controller reports about the config.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HAProxyTemplateConfigStatus {
    /// The `metadata.generation` this status is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Valid`, `Invalid` or `Unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_status: Option<String>,
    /// One line about the validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_message: Option<String>,
    /// Every problem found, each naming the field, template or line.
    #[serde(default)]
    pub validation_errors: Vec<String>,
    /// When the config was last validated (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_validated: Option<String>,
    /// Standard conditions: `Valid`, `Deployed`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// A standard `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Valid` or `Deployed`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// A CamelCase reason.
    pub reason: String,
    /// A human-readable message.
    pub message: String,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
    /// The generation the condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The CustomResourceDefinition as YAML, as `haptic-controller crd` prints it and `deploy/`
/// ships it.
pub fn crd_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::new();
    for crd in all_crds() {
        if !out.is_empty() {
            out.push_str("---\n");
        }
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}

/// Every CRD the controller uses: the HAProxyTemplateConfig users write, and the kinds it
/// publishes the rendered config as ([`crate::published`]).
pub fn all_crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    let mut crds = vec![HAProxyTemplateConfig::crd()];
    crds.extend(crate::published::crds());
    crds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crd_names_group_kind_and_short_names() {
        let crd = HAProxyTemplateConfig::crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("haproxytemplateconfigs.haproxy-haptic.org")
        );
        let names = &crd.spec.names;
        assert_eq!(names.kind, "HAProxyTemplateConfig");
        assert_eq!(
            names.short_names.as_deref(),
            Some(&["htplcfg".to_owned(), "haptpl".to_owned()][..])
        );
        let version = &crd.spec.versions[0];
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
        let yaml = crd_yaml().expect("serializes");
        assert!(
            yaml.contains("x-kubernetes-preserve-unknown-fields: true"),
            "{yaml}"
        );
    }

    #[test]
    fn defaults_are_haptics() {
        let spec: HAProxyTemplateConfigSpec = serde_json::from_value(serde_json::json!({
            "podSelector": {"matchLabels": {"app": "haproxy"}},
            "haproxyConfig": {"template": "global\n"},
        }))
        .expect("minimal spec parses");
        let le = &spec.controller.leader_election;
        assert!(le.enabled);
        assert_eq!(
            (
                le.lease_name.as_str(),
                le.lease_duration.as_str(),
                le.renew_deadline.as_str(),
                le.retry_period.as_str()
            ),
            ("haptic-leader", "30s", "20s", "5s")
        );
        let agent = &spec.agent;
        assert_eq!(
            (
                agent.port,
                agent.min_deployment_interval.as_str(),
                agent.drift_prevention_interval.as_str(),
                agent.deployment_timeout.as_str(),
                agent.max_parallel
            ),
            (9090, "2s", "60s", "30s", 0)
        );
        assert_eq!(
            spec.watched_resources_ignore_fields,
            ["metadata.managedFields"]
        );
    }
}
