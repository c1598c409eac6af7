//! The reference HAProxyTemplateConfig: haptic-render's reference Ingress templates, stores and
//! derived views as a spec, the config `deploy/` ships and the demo runs.

use std::collections::BTreeMap;

use crate::crd::{
    CertificateSource, HAProxyTemplateConfig, HAProxyTemplateConfigSpec, PodSelector,
    TemplateSource, TemplatingSettings, ValidationTest, WatchedResource,
};

/// The resource each reference store watches: (store, apiVersion, plural).
const RESOURCES: [(&str, &str, &str); 4] = [
    ("ingresses", "networking.k8s.io/v1", "ingresses"),
    ("services", "v1", "services"),
    ("endpointslices", "discovery.k8s.io/v1", "endpointslices"),
    ("secrets", "v1", "secrets"),
];

/// The reference spec, for HAProxy pods labelled `app.kubernetes.io/name: haproxy`.
pub fn spec() -> HAProxyTemplateConfigSpec {
    let set = haptic_render::reference::template_set();
    let source = |t: &haptic_render::Template| TemplateSource {
        template: t.template.clone(),
    };
    let mut watched = BTreeMap::new();
    for (name, index) in haptic_render::reference::STORES {
        let Some((_, api_version, plural)) = RESOURCES.iter().find(|(n, _, _)| *n == name) else {
            continue;
        };
        watched.insert(
            name.to_owned(),
            WatchedResource {
                api_version: (*api_version).to_owned(),
                resources: (*plural).to_owned(),
                index_by: Some(index.iter().map(|s| (*s).to_owned()).collect()),
                label_selector: None,
                // Only TLS Secrets can hold Ingress certificates; the rest are never read.
                field_selector: (name == "secrets").then(|| "type=kubernetes.io/tls".to_owned()),
                // An Ingress is what a user writes by hand: the webhook checks it before it
                // reaches the stores. (The templates leave broken Services, slices and Secrets
                // out, and those come from controllers and cert-manager.)
                enable_validation_webhook: name == "ingresses",
            },
        );
    }
    HAProxyTemplateConfigSpec {
        pod_selector: PodSelector {
            match_labels: BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "haproxy".to_owned(),
            )]),
        },
        controller: Default::default(),
        agent: Default::default(),
        templating_settings: TemplatingSettings {
            extra_context: set.extra_context.clone(),
        },
        watched_resources_ignore_fields: vec!["metadata.managedFields".to_owned()],
        watched_resources: watched,
        derived_views: haptic_render::reference::derivations()
            .into_iter()
            .filter_map(|(name, d)| Some((name.to_owned(), serde_json::to_value(d).ok()?)))
            .collect(),
        template_snippets: set
            .template_snippets
            .iter()
            .map(|(k, v)| (k.clone(), source(v)))
            .collect(),
        haproxy_config: source(&set.haproxy_config),
        maps: set
            .maps
            .iter()
            .map(|(k, v)| (k.clone(), source(v)))
            .collect(),
        files: BTreeMap::new(),
        ssl_certificates: set
            .ssl_certificates
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    CertificateSource {
                        template: v.template.clone(),
                        for_each: v.for_each.clone(),
                    },
                )
            })
            .collect(),
        validation_tests: tests(),
    }
}

/// The reference config's validation tests (what `haptic-controller validate` runs in CI on
/// `deploy/haptic-config.yaml`).
fn tests() -> BTreeMap<String, ValidationTest> {
    BTreeMap::new()
}

/// The reference config as an HAProxyTemplateConfig object in YAML, as `haptic-controller
/// reference-config` prints it and `deploy/` ships it.
pub fn yaml(name: &str, namespace: &str) -> Result<String, serde_saphyr::SerializeError> {
    let mut htc = HAProxyTemplateConfig::new(name, spec());
    htc.metadata.namespace = Some(namespace.to_owned());
    serde_saphyr::to_string(&htc)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_yaml_reads_back_as_the_same_spec() {
        let yaml = super::yaml("haptic-config", "haptic-system").expect("yaml");
        let back: crate::crd::HAProxyTemplateConfig =
            serde_saphyr::from_str(&yaml).expect("reads back");
        assert_eq!(back.spec, super::spec());
        assert_eq!(back.metadata.namespace.as_deref(), Some("haptic-system"));
    }
}
