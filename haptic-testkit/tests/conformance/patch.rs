//! PATCH: JSON merge, JSON patch, strategic merge, server-side apply, and a resourceVersion
//! inside a patch as a precondition.

use http::{Method, StatusCode};
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{ConfigMap, Service},
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

use crate::common::{lease, raw, status};

async fn merge_json_and_strategic_patches(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let pp = PatchParams::default();
    let created = leases
        .create(&PostParams::default(), &lease("p", "a"))
        .await
        .unwrap();

    let merged = leases
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({ "spec": { "holderIdentity": "b", "leaseTransitions": 1 } })),
        )
        .await
        .unwrap();
    let spec = merged.spec.as_ref().unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(
        spec.lease_duration_seconds,
        Some(15),
        "untouched fields stay"
    );
    assert!(merged.metadata.resource_version > created.metadata.resource_version);
    let removed = leases
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({ "spec": { "leaseTransitions": null } })),
        )
        .await
        .unwrap();
    assert_eq!(
        removed.spec.unwrap().lease_transitions,
        None,
        "null removes a field"
    );

    let ops: json_patch::Patch = serde_json::from_value(json!([
        { "op": "test", "path": "/spec/holderIdentity", "value": "b" },
        { "op": "replace", "path": "/spec/holderIdentity", "value": "c" },
        { "op": "add", "path": "/metadata/labels", "value": { "k": "v" } },
    ]))
    .unwrap();
    let jp = leases
        .patch("p", &pp, &Patch::<()>::Json(ops))
        .await
        .unwrap();
    assert_eq!(jp.spec.unwrap().holder_identity.as_deref(), Some("c"));
    assert_eq!(jp.metadata.labels.unwrap()["k"], "v");
    let failing: json_patch::Patch = serde_json::from_value(
        json!([{ "op": "test", "path": "/spec/holderIdentity", "value": "zzz" }]),
    )
    .unwrap();
    let err = status(leases.patch("p", &pp, &Patch::<()>::Json(failing)).await);
    assert!(err.code == 422 || err.code == 409, "{err:?}");

    // Strategic merge: a Service's ports merge by key (`port`; the stand-in also by `name`,
    // and both agree here); `$patch: delete` removes one. (Pod containers cannot be added or
    // removed on a real server, so the list under test is a Service's.)
    let services: Api<Service> = Api::default_namespaced(client.clone());
    let service: Service = serde_json::from_value(json!({
        "metadata": { "name": "web", "labels": { "a": "1" } },
        "spec": { "ports": [
            { "name": "http", "port": 80, "targetPort": 8080 },
            { "name": "metrics", "port": 9090, "targetPort": 9090 },
        ] },
    }))
    .unwrap();
    services
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    let patched = services
        .patch(
            "web",
            &pp,
            &Patch::Strategic(json!({
                "metadata": { "labels": { "b": "2" } },
                "spec": { "ports": [
                    { "name": "http", "port": 80, "targetPort": 8081 },
                    { "name": "extra", "port": 7000, "targetPort": 7000 },
                ] },
            })),
        )
        .await
        .unwrap();
    let ports = |s: &Service| -> Vec<(String, i32, String)> {
        s.spec
            .as_ref()
            .unwrap()
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| {
                let target = match &p.target_port {
                    Some(IntOrString::Int(i)) => i.to_string(),
                    Some(IntOrString::String(s)) => s.clone(),
                    None => String::new(),
                };
                (p.name.clone().unwrap_or_default(), p.port, target)
            })
            .collect()
    };
    // The order differs: the real server puts the patch's items first (http, extra, metrics),
    // the stand-in appends new ones (http, metrics, extra). Compared as sets.
    let mut got = ports(&patched);
    got.sort();
    assert_eq!(
        got,
        [
            ("extra".into(), 7000, "7000".into()),
            ("http".into(), 80, "8081".into()),
            ("metrics".into(), 9090, "9090".into()),
        ]
    );
    let labels = patched.metadata.labels.clone().unwrap();
    assert_eq!((labels["a"].as_str(), labels["b"].as_str()), ("1", "2"));
    let deleted = services
        .patch(
            "web",
            &pp,
            &Patch::Strategic(
                json!({ "spec": { "ports": [{ "port": 9090, "$patch": "delete" }] } }),
            ),
        )
        .await
        .unwrap();
    let mut names: Vec<String> = ports(&deleted).into_iter().map(|p| p.0).collect();
    names.sort();
    assert_eq!(names, ["extra", "http"]);

    // An unknown patch content type is 415; a missing object is 404.
    let answer = raw(
        &client,
        Method::PATCH,
        "/apis/coordination.k8s.io/v1/namespaces/default/leases/p",
        Some("application/json"),
        "{}",
    )
    .await;
    assert_eq!(answer.code, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(answer.body["code"], 415);
    let err = status(leases.patch("missing", &pp, &Patch::Merge(json!({}))).await);
    assert_eq!(
        (err.code, err.message.as_str()),
        (404, r#"leases.coordination.k8s.io "missing" not found"#)
    );
    server.shutdown().await;
}

async fn server_side_apply_needs_a_field_manager_creates_and_merges(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let applied = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": "ssa" },
        "data": { "a": "1" },
    });
    // Without a field manager the real server refuses an apply patch.
    let answer = raw(
        &client,
        Method::PATCH,
        "/api/v1/namespaces/default/configmaps/ssa",
        Some("application/apply-patch+yaml"),
        serde_json::to_vec(&applied).unwrap(),
    )
    .await;
    assert_eq!(
        answer.code,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        answer.body
    );
    assert_eq!(answer.body["reason"], "Invalid");
    assert_eq!(answer.body["details"]["kind"], "PatchOptions");

    let ssa = PatchParams::apply("haptic-test");
    let created = cms
        .patch("ssa", &ssa, &Patch::Apply(&applied))
        .await
        .unwrap();
    assert_eq!(
        created.data.unwrap()["a"],
        "1",
        "apply creates a missing object"
    );
    let second = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": "ssa" },
        "data": { "b": "2" },
    });
    let merged = cms
        .patch("ssa", &ssa.clone().force(), &Patch::Apply(&second))
        .await
        .unwrap();
    let data = merged.data.unwrap();
    // A field its manager no longer applies is removed (field ownership), on both servers.
    assert_eq!(
        (data.get("a").map(String::as_str), data["b"].as_str()),
        (None, "2")
    );
    server.shutdown().await;
}

async fn server_side_apply_removes_only_what_no_manager_applies(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client().unwrap());
    let body = |data: serde_json::Value| {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "owners" },
            "data": data,
        })
    };
    let a = PatchParams::apply("manager-a");
    let b = PatchParams::apply("manager-b");
    cms.patch(
        "owners",
        &a,
        &Patch::Apply(body(json!({ "a": "1", "shared": "s" }))),
    )
    .await
    .unwrap();
    cms.patch(
        "owners",
        &b,
        &Patch::Apply(body(json!({ "b": "2", "shared": "s" }))),
    )
    .await
    .unwrap();
    // A gives up `a` (nobody else set it: removed) and `shared` (B set it too: kept).
    let after = cms
        .patch("owners", &a, &Patch::Apply(body(json!({ "a2": "3" }))))
        .await
        .unwrap();
    let data = after.data.unwrap_or_default();
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    assert_eq!(keys, ["a2", "b", "shared"]);
    // A plain merge patch from A's manager name is not an apply: it removes nothing.
    let merged = cms
        .patch(
            "owners",
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": { "m": "4" } })),
        )
        .await
        .unwrap();
    assert_eq!(merged.data.unwrap_or_default().len(), 4);
    server.shutdown().await;
}

async fn resource_version_inside_a_patch_is_a_precondition(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let created = leases
        .create(&PostParams::default(), &lease("rv", "a"))
        .await
        .unwrap();
    let old_rv = created.metadata.resource_version.clone().unwrap();
    let pp = PatchParams::default();
    let ok = leases
        .patch(
            "rv",
            &pp,
            &Patch::Merge(json!({ "metadata": { "resourceVersion": old_rv }, "spec": { "holderIdentity": "b" } })),
        )
        .await
        .unwrap();
    assert_eq!(ok.spec.unwrap().holder_identity.as_deref(), Some("b"));
    for patch in [
        Patch::Merge(
            json!({ "metadata": { "resourceVersion": old_rv }, "spec": { "holderIdentity": "c" } }),
        ),
        Patch::Strategic(
            json!({ "metadata": { "resourceVersion": old_rv }, "spec": { "holderIdentity": "c" } }),
        ),
    ] {
        let err = status(leases.patch("rv", &pp, &patch).await);
        assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
        assert_eq!(
            err.message,
            r#"Operation cannot be fulfilled on leases.coordination.k8s.io "rv": the object has been modified; please apply your changes to the latest version and try again"#
        );
    }
    // JSON patch: an op that sets the resourceVersion sets a precondition too.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        { "op": "replace", "path": "/metadata/resourceVersion", "value": old_rv },
        { "op": "replace", "path": "/spec/holderIdentity", "value": "c" },
    ]))
    .unwrap();
    let err = status(leases.patch("rv", &pp, &Patch::<()>::Json(ops)).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    let apply = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": { "name": "rv", "resourceVersion": old_rv },
        "spec": { "holderIdentity": "c" },
    });
    let err = status(
        leases
            .patch("rv", &PatchParams::apply("t"), &Patch::Apply(&apply))
            .await,
    );
    assert_eq!(err.code, 409);
    assert_eq!(
        leases
            .get("rv")
            .await
            .unwrap()
            .spec
            .unwrap()
            .holder_identity
            .as_deref(),
        Some("b")
    );
    server.shutdown().await;
}

crate::on_both!(
    both: [
        merge_json_and_strategic_patches,
        server_side_apply_needs_a_field_manager_creates_and_merges,
        server_side_apply_removes_only_what_no_manager_applies,
        resource_version_inside_a_patch_is_a_precondition,
    ],
    stand_in_only: [
    ],
);
