//! Discovery documents, OpenAPI index, and CRD-registered resources.

use http::{Method, StatusCode};
use k8s_openapi::{
    api::coordination::v1::Lease,
    apimachinery::pkg::apis::meta::v1::{APIGroupList, APIResourceList, APIVersions},
};
use kube::{
    Api,
    api::{DynamicObject, PostParams},
    discovery::{Discovery, Scope, verbs},
};
use serde_json::json;

use crate::common::{get_json, raw, register_widgets, widget};

const CORE: [(&str, &str); 6] = [
    ("namespaces", "Namespace"),
    ("pods", "Pod"),
    ("services", "Service"),
    ("secrets", "Secret"),
    ("configmaps", "ConfigMap"),
    ("events", "Event"),
];

const GROUPS: [(&str, &str, &str); 4] = [
    ("coordination.k8s.io", "leases", "Lease"),
    ("discovery.k8s.io", "endpointslices", "EndpointSlice"),
    ("networking.k8s.io", "ingresses", "Ingress"),
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "CustomResourceDefinition",
    ),
];

fn resource<'a>(
    list: &'a APIResourceList,
    name: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResource {
    list.resources
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("{name} missing from {}", list.group_version))
}

async fn discovery_documents_list_every_builtin_group_version(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();

    let api: APIVersions = serde_json::from_value(get_json(&client, "/api").await).unwrap();
    assert_eq!(api.versions, ["v1"]);

    let core: APIResourceList = serde_json::from_value(get_json(&client, "/api/v1").await).unwrap();
    assert_eq!(core.group_version, "v1");
    for (plural, kind) in CORE {
        let r = resource(&core, plural);
        assert_eq!(r.kind, kind);
        assert_eq!(r.namespaced, plural != "namespaces", "{plural}");
        for verb in [
            "get", "list", "watch", "create", "update", "patch", "delete",
        ] {
            assert!(r.verbs.iter().any(|v| v == verb), "{plural} lacks {verb}");
        }
    }
    assert_eq!(
        resource(&core, "configmaps").short_names.as_deref(),
        Some(&["cm".to_owned()][..])
    );
    assert!(core.resources.iter().any(|r| r.name == "pods/status"));

    let groups: APIGroupList = serde_json::from_value(get_json(&client, "/apis").await).unwrap();
    for (group, plural, kind) in GROUPS {
        let entry = groups
            .groups
            .iter()
            .find(|g| g.name == group)
            .unwrap_or_else(|| panic!("{group} missing from /apis"));
        assert_eq!(
            entry.preferred_version.as_ref().unwrap().group_version,
            format!("{group}/v1")
        );
        let doc = get_json(&client, &format!("/apis/{group}")).await;
        assert_eq!(doc["kind"], "APIGroup");
        let list: APIResourceList =
            serde_json::from_value(get_json(&client, &format!("/apis/{group}/v1")).await).unwrap();
        assert_eq!(list.group_version, format!("{group}/v1"));
        assert_eq!(resource(&list, plural).kind, kind);
    }

    // kube's own discovery client reads the same documents.
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    for (group, plural, _) in GROUPS {
        let g = discovery.get(group).unwrap_or_else(|| panic!("{group}"));
        let (ar, caps) = g
            .recommended_resources()
            .into_iter()
            .find(|(ar, _)| ar.plural == plural)
            .unwrap_or_else(|| panic!("{plural}"));
        assert_eq!(ar.version, "v1");
        assert!(caps.supports_operation(verbs::WATCH));
    }
    let core = discovery.get("").unwrap();
    let (_, caps) = core
        .recommended_resources()
        .into_iter()
        .find(|(ar, _)| ar.plural == "namespaces")
        .unwrap();
    assert_eq!(caps.scope, Scope::Cluster);

    // An unknown group/version is a 404 Status, not an empty list.
    let missing = raw(&client, Method::GET, "/apis/nope.example.com/v1", None, "").await;
    assert_eq!(missing.code, StatusCode::NOT_FOUND);
    assert_eq!(missing.body["kind"], "Status");
    server.shutdown().await;
}

async fn crd_registers_a_discoverable_resource_with_status(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let ar = register_widgets(&server, true).await;

    let list: APIResourceList =
        serde_json::from_value(get_json(&client, "/apis/example.com/v1").await).unwrap();
    let widgets = resource(&list, "widgets");
    assert_eq!(widgets.kind, "Widget");
    assert!(widgets.namespaced);
    assert_eq!(widgets.short_names.as_deref(), Some(&["wd".to_owned()][..]));
    assert!(list.resources.iter().any(|r| r.name == "widgets/status"));

    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    let gvk = kube::core::GroupVersionKind::gvk("example.com", "v1", "Widget");
    let (found, caps) = discovery
        .resolve_gvk(&gvk)
        .expect("Discovery::run finds the CRD");
    assert_eq!(found.plural, "widgets");
    assert_eq!(caps.scope, Scope::Namespaced);
    assert!(
        caps.subresources
            .iter()
            .any(|(sub, _)| sub.plural == "widgets/status" || sub.plural == "status")
    );

    // It is served at its group/version/plural.
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &found);
    let created = api
        .create(&PostParams::default(), &widget("w1", json!({ "size": 1 })))
        .await
        .unwrap();
    assert_eq!(created.metadata.name.as_deref(), Some("w1"));
    assert_eq!(api.get("w1").await.unwrap().data["spec"]["size"], 1);
    assert_eq!(ar.plural, found.plural);

    // Deleting the CRD stops serving it.
    let crds = raw(
        &client,
        Method::DELETE,
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com",
        None,
        "",
    )
    .await;
    assert_eq!(crds.code, StatusCode::OK);
    // The real server removes a deleted CRD's resource asynchronously (after its finalizer
    // ran): await the 404, bounded.
    let deadline = tokio::time::Instant::now() + crate::common::BOUND;
    loop {
        let gone = raw(
            &client,
            Method::GET,
            "/apis/example.com/v1/namespaces/default/widgets",
            None,
            "",
        )
        .await;
        if gone.code == StatusCode::NOT_FOUND {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still served: {}",
            gone.code
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    server.shutdown().await;
}

async fn openapi_v3_declares_field_validation_for_every_group_version(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    register_widgets(&server, false).await;
    let index = get_json(&client, "/openapi/v3").await;
    for key in [
        "api/v1",
        "apis/coordination.k8s.io/v1",
        "apis/apiextensions.k8s.io/v1",
        "apis/example.com/v1",
    ] {
        let url = index["paths"][key]["serverRelativeURL"]
            .as_str()
            .unwrap_or_else(|| panic!("{key} missing from {index}"));
        let doc = get_json(&client, url).await;
        let patch_ops: Vec<_> = doc["paths"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(|p| p.get("patch"))
            .collect();
        assert!(!patch_ops.is_empty(), "{key}");
        for op in patch_ops {
            assert!(op["x-kubernetes-group-version-kind"]["kind"].is_string());
            assert!(
                op["parameters"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["name"] == "fieldValidation" && p["in"] == "query"),
                "{key}: {op}"
            );
        }
    }
    let _ = Api::<Lease>::default_namespaced(client);
    server.shutdown().await;
}

crate::on_both!(
    both: [
        crd_registers_a_discoverable_resource_with_status,
    ],
    stand_in_only: [
        discovery_documents_list_every_builtin_group_version,
        openapi_v3_declares_field_validation_for_every_group_version,
    ],
);
