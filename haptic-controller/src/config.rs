//! The config loader's rules: an HAProxyTemplateConfig spec checked whole (structure, durations
//! and their ordering, store and index paths, derived views, every template compiled) into a
//! [`ValidatedConfig`], or every problem found, each naming its field, template or line.
//!
//! The template rules are haptic-render's own ([`TemplateSet`], [`Renderer::compile`]); this
//! module maps the CRD onto them and does not restate them.

use std::{collections::BTreeMap, fmt, sync::Arc, time::Duration};

use haptic_election::ElectionConfig;
use haptic_render::{
    CertificateTemplate, Derivation, FileTemplate, Renderer, StoreConfig, Stores, Template,
    TemplateSet,
};

use crate::{crd::HAProxyTemplateConfigSpec, duration};

/// One watched resource, ready for a watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedStore {
    /// The store's name (`resources.<name>` in templates).
    pub name: String,
    /// API group (`""` for the core group).
    pub group: String,
    /// API version.
    pub version: String,
    /// Plural resource name.
    pub plural: String,
    /// Server-side label selector.
    pub label_selector: Option<String>,
    /// Server-side field selector.
    pub field_selector: Option<String>,
    /// Index and ignore fields of its store.
    pub store: StoreConfig,
    /// The one namespace watched (none: all).
    pub namespace: Option<String>,
    /// Whether the resource may not be served (its store then stays empty and synced).
    pub optional: bool,
}

/// Leader election as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionSettings {
    /// Whether replicas elect.
    pub enabled: bool,
    /// The Lease's name.
    pub lease_name: String,
    /// LeaseDuration.
    pub lease_duration: Duration,
    /// RenewDeadline.
    pub renew_deadline: Duration,
    /// RetryPeriod.
    pub retry_period: Duration,
}

impl ElectionSettings {
    /// The elector's config for this replica.
    pub fn election_config(&self, identity: &str, namespace: &str) -> ElectionConfig {
        ElectionConfig::new(identity, &self.lease_name, namespace)
            .with_durations(self.lease_duration, self.renew_deadline, self.retry_period)
            .with_enabled(self.enabled)
    }
}

/// Agent settings as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSettings {
    /// The agent port on every pod.
    pub port: u16,
    /// Secret name of the bearer token.
    pub token_secret: String,
    /// Key of the token in the Secret.
    pub token_key: String,
    /// The agent container's name.
    pub container_name: String,
    /// Least time between deployments.
    pub min_deployment_interval: Duration,
    /// Interval of the drift-prevention check.
    pub drift_prevention_interval: Duration,
    /// Watchdog for one deployment.
    pub deployment_timeout: Duration,
    /// Pods applied to at once (0: all).
    pub max_parallel: usize,
}

/// A config that passed every check, with its templates compiled.
pub struct ValidatedConfig {
    /// `metadata.generation` of the HTC.
    pub generation: i64,
    /// `metadata.resourceVersion` of the HTC.
    pub resource_version: String,
    /// The spec as read.
    pub spec: HAProxyTemplateConfigSpec,
    /// The compiled templates.
    pub renderer: Arc<Renderer>,
    /// Watched resources, by store name.
    pub stores: Vec<WatchedStore>,
    /// Derived views, by name.
    pub derivations: Vec<(String, Derivation)>,
    /// Leader election.
    pub election: ElectionSettings,
    /// Agents.
    pub agent: AgentSettings,
    /// `podSelector.matchLabels` as a label selector string.
    pub pod_selector: String,
}

impl fmt::Debug for ValidatedConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValidatedConfig")
            .field("generation", &self.generation)
            .field("resource_version", &self.resource_version)
            .field(
                "stores",
                &self.stores.iter().map(|s| &s.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl ValidatedConfig {
    /// Empty stores (with the derived views) for this config.
    pub fn empty_stores(&self) -> Stores {
        let mut stores = Stores::new();
        for watched in &self.stores {
            // Checked by `validate`.
            let _ = stores.add(watched.name.clone(), watched.store.clone());
        }
        for (name, derivation) in &self.derivations {
            let _ = stores.derive(name.clone(), derivation.clone());
        }
        self.renderer.compact_unread_stores(&mut stores);
        stores
    }
}

/// Checks `spec` whole. `Err` holds every problem found, each a line naming what is wrong.
pub fn validate(
    spec: &HAProxyTemplateConfigSpec,
    generation: i64,
    resource_version: &str,
) -> Result<ValidatedConfig, Vec<String>> {
    let mut errors = Vec::new();

    if spec.pod_selector.match_labels.is_empty() {
        errors.push(
            "podSelector.matchLabels: must name at least one label of the HAProxy pods".to_owned(),
        );
    }
    let pod_selector = spec
        .pod_selector
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");

    let mut dur = |field: &str, value: &str| match duration::parse(field, value) {
        Ok(d) => Some(d),
        Err(error) => {
            errors.push(error.to_string());
            None
        }
    };
    let le = &spec.controller.leader_election;
    let lease_duration = dur(
        "controller.leaderElection.leaseDuration",
        &le.lease_duration,
    );
    let renew_deadline = dur(
        "controller.leaderElection.renewDeadline",
        &le.renew_deadline,
    );
    let retry_period = dur("controller.leaderElection.retryPeriod", &le.retry_period);
    let ag = &spec.agent;
    let min_interval = dur("agent.minDeploymentInterval", &ag.min_deployment_interval);
    let drift = dur(
        "agent.driftPreventionInterval",
        &ag.drift_prevention_interval,
    );
    let timeout = dur("agent.deploymentTimeout", &ag.deployment_timeout);

    let election = match (lease_duration, renew_deadline, retry_period) {
        (Some(lease_duration), Some(renew_deadline), Some(retry_period)) => {
            let settings = ElectionSettings {
                enabled: le.enabled,
                lease_name: le.lease_name.clone(),
                lease_duration,
                renew_deadline,
                retry_period,
            };
            // The identity and namespace are the replica's; any valid ones check the rules.
            if let Err(error) = settings.election_config("check", "check").validate() {
                errors.push(format!("controller.leaderElection: {error}"));
            }
            Some(settings)
        }
        _ => None,
    };
    if drift == Some(Duration::ZERO) {
        errors.push("agent.driftPreventionInterval: must be above 0".to_owned());
    }
    if timeout == Some(Duration::ZERO) {
        errors.push("agent.deploymentTimeout: must be above 0".to_owned());
    }
    if ag.port == 0 {
        errors.push("agent.port: must be a port number (1-65535)".to_owned());
    }
    if ag.token_secret_ref.name.is_empty() || ag.token_secret_ref.key.is_empty() {
        errors.push("agent.tokenSecretRef: name and key must not be empty".to_owned());
    }

    // Stores and derived views, checked by building empty ones.
    let ignore_fields: Vec<String> = spec
        .watched_resources_ignore_fields
        .iter()
        .map(|p| normalize_path(p))
        .collect();
    let mut stores = Vec::new();
    let mut probe = Stores::new();
    for (name, watched) in &spec.watched_resources {
        let field = format!("watchedResources.{name}");
        let (group, version) = match watched.api_version.rsplit_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (String::new(), watched.api_version.clone()),
        };
        if version.is_empty()
            || group.contains('/')
            || watched.api_version.trim() != watched.api_version
        {
            errors.push(format!(
                "{field}.apiVersion: {:?} is not `version` or `group/version`",
                watched.api_version
            ));
            continue;
        }
        if watched.resources.is_empty() || watched.resources.contains('/') {
            errors.push(format!(
                "{field}.resources: {:?} is not a plural resource name such as `ingresses`",
                watched.resources
            ));
            continue;
        }
        let mut store = match &watched.index_by {
            Some(index) => StoreConfig::index_by(index.iter().map(|p| normalize_path(p))),
            None => StoreConfig::default(),
        };
        store.ignore_fields.extend(ignore_fields.iter().cloned());
        store.ignore_fields.dedup();
        for (what, selector) in [
            ("labelSelector", &watched.label_selector),
            ("fieldSelector", &watched.field_selector),
        ] {
            if let Some(selector) = selector
                && let Err(why) = check_selector(selector)
            {
                errors.push(format!("{field}.{what}: {selector:?}: {why}"));
            }
        }
        if let Err(error) = probe.add(name.clone(), store.clone()) {
            errors.push(format!("{field}: {error}"));
            continue;
        }
        stores.push(WatchedStore {
            name: name.clone(),
            group,
            version,
            plural: watched.resources.clone(),
            label_selector: watched.label_selector.clone().filter(|s| !s.is_empty()),
            field_selector: watched.field_selector.clone().filter(|s| !s.is_empty()),
            store,
            namespace: watched.namespace.clone().filter(|s| !s.is_empty()),
            optional: watched.optional,
        });
    }
    let mut derivations = Vec::new();
    for (name, value) in &spec.derived_views {
        match serde_json::from_value::<Derivation>(value.clone()) {
            Ok(derivation) => match probe.derive(name.clone(), derivation.clone()) {
                Ok(()) => derivations.push((name.clone(), derivation)),
                Err(error) => errors.push(format!("derivedViews.{name}: {error}")),
            },
            Err(error) => errors.push(format!("derivedViews.{name}: {error}")),
        }
    }

    let set = template_set(spec);
    let renderer = match Renderer::compile(&set) {
        Ok(renderer) => Some(renderer),
        Err(error) => {
            errors.push(error.to_string());
            None
        }
    };
    for (name, cert) in &spec.ssl_certificates {
        if let Some(store) = &cert.for_each
            && !spec.watched_resources.contains_key(store)
        {
            errors.push(format!(
                "sslCertificates.{name}.forEach: `{store}` is not a watched resource"
            ));
        }
    }

    errors.extend(crate::validation::check_structure(spec));

    match (
        errors.is_empty(),
        renderer,
        election,
        min_interval,
        drift,
        timeout,
    ) {
        (true, Some(renderer), Some(election), Some(min), Some(drift), Some(timeout)) => {
            Ok(ValidatedConfig {
                generation,
                resource_version: resource_version.to_owned(),
                spec: spec.clone(),
                renderer: Arc::new(renderer),
                stores,
                derivations,
                election,
                agent: AgentSettings {
                    port: ag.port,
                    token_secret: ag.token_secret_ref.name.clone(),
                    token_key: ag.token_secret_ref.key.clone(),
                    container_name: ag.container_name.clone(),
                    min_deployment_interval: min,
                    drift_prevention_interval: drift,
                    deployment_timeout: timeout,
                    max_parallel: ag.max_parallel as usize,
                },
                pod_selector,
            })
        }
        _ => Err(errors),
    }
}

/// The spec's templates as haptic-render's template set.
pub fn template_set(spec: &HAProxyTemplateConfigSpec) -> TemplateSet {
    TemplateSet {
        haproxy_config: Template::new(spec.haproxy_config.template.clone()),
        maps: spec
            .maps
            .iter()
            .map(|(k, v)| (k.clone(), Template::new(v.template.clone())))
            .collect(),
        files: spec
            .files
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    FileTemplate {
                        path: v.path.clone().unwrap_or_else(|| k.clone()),
                        template: v.template.clone(),
                    },
                )
            })
            .collect(),
        ssl_certificates: spec
            .ssl_certificates
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    CertificateTemplate {
                        template: v.template.clone(),
                        for_each: v.for_each.clone(),
                    },
                )
            })
            .collect(),
        status_templates: spec
            .status_templates
            .iter()
            .map(|(k, v)| (k.clone(), Template::new(v.template.clone())))
            .collect(),
        template_snippets: spec
            .template_snippets
            .iter()
            .map(|(k, v)| (k.clone(), Template::new(v.template.clone())))
            .collect(),
        extra_context: spec
            .templating_settings
            .extra_context
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// Accepts JSONPath's `$.` (or a leading `.`) in front of haptic-render's field paths.
fn normalize_path(path: &str) -> String {
    path.strip_prefix("$.")
        .or_else(|| path.strip_prefix('.'))
        .unwrap_or(path)
        .to_owned()
}

/// A light syntax check of a label or field selector: comma-separated terms, each a key with
/// an operator (`=`, `==`, `!=`, `in (...)`, `notin (...)`) or a bare key / `!key`.
fn check_selector(selector: &str) -> Result<(), &'static str> {
    if selector.contains(['\n', '\r', '\0']) {
        return Err("contains a line break or NUL");
    }
    let mut depth = 0i32;
    let mut term = String::new();
    let mut terms = Vec::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut term));
                continue;
            }
            _ => {}
        }
        if depth < 0 {
            return Err("unbalanced parentheses");
        }
        term.push(c);
    }
    if depth != 0 {
        return Err("unbalanced parentheses");
    }
    terms.push(term);
    for term in terms {
        let term = term.trim();
        if term.is_empty() {
            return Err("has an empty term");
        }
        let key = term
            .split(|c: char| c == '=' || c == '!' || c.is_whitespace())
            .find(|s| !s.is_empty())
            .unwrap_or("");
        if key.is_empty() {
            return Err("a term has no key");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(extra: serde_json::Value) -> HAProxyTemplateConfigSpec {
        let mut base = json!({
            "podSelector": {"matchLabels": {"app": "haproxy"}},
            "haproxyConfig": {"template": "global\n"},
            "watchedResources": {
                "ingresses": {"apiVersion": "networking.k8s.io/v1", "resources": "ingresses"},
                "services": {"apiVersion": "v1", "resources": "services"},
            },
        });
        if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        serde_json::from_value(base).expect("spec parses")
    }

    #[test]
    fn a_good_spec_validates_with_its_stores() {
        let config = validate(&spec(json!({})), 3, "17").expect("valid");
        assert_eq!(config.generation, 3);
        let names: Vec<_> = config
            .stores
            .iter()
            .map(|s| (s.name.as_str(), s.group.as_str(), s.version.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("ingresses", "networking.k8s.io", "v1"),
                ("services", "", "v1")
            ]
        );
        assert!(
            config.stores[0]
                .store
                .ignore_fields
                .contains(&"metadata.managedFields".to_owned())
        );
        assert_eq!(config.pod_selector, "app=haproxy");
        assert_eq!(config.agent.min_deployment_interval, Duration::from_secs(2));
    }

    #[test]
    fn every_problem_is_reported_with_its_field() {
        let errors = validate(
            &spec(json!({
                "podSelector": {"matchLabels": {}},
                "controller": {"leaderElection": {"leaseDuration": "10s", "renewDeadline": "20s"}},
                "agent": {"deploymentTimeout": "30x"},
                "haproxyConfig": {"template": "global\n{% if %}\n"},
                "derivedViews": {"backends": {"kind": "serviceBackends", "services": "services", "endpointSlices": "nope"}},
            })),
            1,
            "1",
        )
        .expect_err("invalid");
        let all = errors.join("\n");
        assert!(all.contains("podSelector.matchLabels"), "{all}");
        assert!(all.contains("agent.deploymentTimeout: \"30x\""), "{all}");
        assert!(all.contains("controller.leaderElection:"), "{all}");
        assert!(all.contains("derivedViews.backends"), "{all}");
        assert!(all.contains("template `haproxyConfig` line 2"), "{all}");
    }

    #[test]
    fn bad_index_paths_and_selectors_are_named() {
        let errors = validate(
            &spec(json!({
                "watchedResources": {
                    "ingresses": {"apiVersion": "networking.k8s.io/v1", "resources": "ingresses", "indexBy": ["metadata..name"], "labelSelector": "a=b,,c"},
                },
            })),
            1,
            "1",
        )
        .expect_err("invalid");
        let all = errors.join("\n");
        assert!(
            all.contains("watchedResources.ingresses: index field `metadata..name`"),
            "{all}"
        );
        assert!(
            all.contains("watchedResources.ingresses.labelSelector"),
            "{all}"
        );
    }

    #[test]
    fn the_reference_set_validates() {
        validate(&crate::reference::spec(), 1, "1").expect("the reference set is valid");
    }
}
