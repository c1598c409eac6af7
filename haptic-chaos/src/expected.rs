//! What the agents must serve once the faults are over, worked out independently of the
//! controllers: the checksum of the set rendered from the final resources (listed from the API
//! and rendered with the same config and haptic-render, as the coordinator does), and the
//! backend each Ingress host must reach through HAProxy.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result, anyhow};
use haptic_controller::HAProxyTemplateConfigSpec;
use k8s_openapi::api::{discovery::v1::EndpointSlice, networking::v1::Ingress};
use kube::{
    Api,
    api::{DynamicObject, ListParams},
    core::GroupVersion,
    discovery,
};

use crate::fleet::{Fleet, NS};

/// The checksum of the set rendered from the resources in the API now.
pub(crate) async fn checksum(
    client: &kube::Client,
    spec: &HAProxyTemplateConfigSpec,
) -> Result<String> {
    let config = haptic_controller::config::validate(spec, 1, "1")
        .map_err(|errors| anyhow!("the run's config is invalid: {}", errors.join("; ")))?;
    let mut stores = config.empty_stores();
    for watched in &config.stores {
        let gv = GroupVersion::gv(&watched.group, &watched.version);
        // As the controller's watchers: an optional resource that is not served (its CRD
        // not installed) leaves its store empty; a watch of one namespace lists that one.
        let served = match discovery::pinned_group(client, &gv).await {
            Ok(group) => group
                .versioned_resources(&watched.version)
                .into_iter()
                .find(|(ar, _)| ar.plural == watched.plural)
                .map(|(ar, _)| ar),
            Err(_) if watched.optional => None,
            Err(error) => {
                return Err(error).with_context(|| format!("discovering {}", gv.api_version()));
            }
        };
        let ar = match served {
            Some(ar) => ar,
            None if watched.optional => continue,
            None => anyhow::bail!("{} serves no {}", gv.api_version(), watched.plural),
        };
        let api: Api<DynamicObject> = match &watched.namespace {
            Some(namespace) => Api::namespaced_with(client.clone(), namespace, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let mut params = ListParams::default();
        if let Some(labels) = &watched.label_selector {
            params = params.labels(labels);
        }
        if let Some(fields) = &watched.field_selector {
            params = params.fields(fields);
        }
        let list = api
            .list(&params)
            .await
            .with_context(|| format!("listing {}", watched.plural))?;
        let store = stores
            .get_mut(&watched.name)
            .with_context(|| format!("no store {}", watched.name))?;
        for object in list.items {
            let value = serde_json::to_value(&object)?;
            store
                .apply(&value)
                .map_err(|error| anyhow!("store {}: {error}", watched.name))?;
        }
    }
    let files = config
        .renderer
        .render(&stores)
        .map_err(|error| anyhow!("rendering the final resources: {error}"))?;
    Ok(haptic_agent_client::protocol::checksum(files.iter()))
}

/// Each Ingress host and the body its backend answers (`backend <name>`), from the API.
pub(crate) async fn routes(fleet: &Fleet) -> Result<BTreeMap<String, String>> {
    let ingresses: Api<Ingress> = Api::namespaced(fleet.client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(fleet.client.clone(), NS);
    let slices = slices.list(&ListParams::default()).await?.items;
    let mut routes = BTreeMap::new();
    for ingress in ingresses.list(&ListParams::default()).await?.items {
        let rule = ingress
            .spec
            .as_ref()
            .and_then(|s| s.rules.as_ref())
            .and_then(|r| r.first())
            .context("an ingress without a rule")?;
        let host = rule.host.clone().context("an ingress without a host")?;
        let service = rule
            .http
            .as_ref()
            .and_then(|h| h.paths.first())
            .and_then(|p| p.backend.service.as_ref())
            .map(|s| s.name.clone())
            .context("an ingress without a service backend")?;
        let port = slices
            .iter()
            .find(|s| {
                s.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("kubernetes.io/service-name"))
                    == Some(&service)
            })
            .and_then(|s| s.ports.as_ref()?.first()?.port)
            .with_context(|| format!("no endpoints for {service}"))?;
        let backend = fleet
            .backends
            .iter()
            .find(|(_, b)| i32::from(b.addr.port()) == port)
            .map(|(name, _)| *name)
            .with_context(|| format!("no backend on port {port}"))?;
        routes.insert(host, format!("backend {backend}"));
    }
    Ok(routes)
}
