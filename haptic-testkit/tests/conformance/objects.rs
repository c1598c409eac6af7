//! Object semantics: resourceVersion, metadata the server sets, GET/LIST with selectors, POST,
//! PUT (conflicts, Lease rules), DELETE preconditions and the status subresource.

use std::collections::BTreeMap;

use http::{Method, StatusCode};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::ConfigMap};
use kube::{
    Api,
    api::{DeleteParams, DynamicObject, ListParams, PostParams, Preconditions},
};
use serde_json::json;

use crate::common::{lease, raw, register_widgets, status, widget};

fn rv(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> u64 {
    meta.resource_version.as_deref().unwrap().parse().unwrap()
}

fn config_map(name: &str, ns: &str, labels: &[(&str, &str)]) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.to_owned());
    cm.metadata.namespace = Some(ns.to_owned());
    cm.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
    );
    cm
}

async fn resource_version_is_one_global_counter_across_resources(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let pp = PostParams::default();

    let start = server.resource_version().await;
    // The real server writes too (its own identity Lease in kube-system, every 10 s), so there
    // the counter is only seen to move forward; the stand-in's is exact.
    let real = server.is_real();
    let at = |got: u64, n: u64| {
        if real {
            assert!(got >= start + n, "{got} < {start} + {n}");
        } else {
            assert_eq!(got, start + n);
        }
    };
    let a = leases.create(&pp, &lease("a", "x")).await.unwrap();
    let b = cms
        .create(&pp, &config_map("b", "default", &[]))
        .await
        .unwrap();
    let mut c = leases.create(&pp, &lease("c", "x")).await.unwrap();
    at(rv(&a.metadata), 1);
    at(rv(&b.metadata), 2);
    at(rv(&c.metadata), 3);
    assert!(rv(&a.metadata) < rv(&b.metadata) && rv(&b.metadata) < rv(&c.metadata));
    c.spec.as_mut().unwrap().holder_identity = Some("y".into());
    let c2 = leases.replace("c", &pp, &c).await.unwrap();
    at(rv(&c2.metadata), 4);
    cms.delete("b", &DeleteParams::default()).await.unwrap();
    at(server.resource_version().await, 5);

    // Every list carries the global resourceVersion, whichever resource it lists.
    let list = cms.list(&ListParams::default()).await.unwrap();
    at(
        list.metadata
            .resource_version
            .as_deref()
            .unwrap()
            .parse()
            .unwrap(),
        5,
    );
    let list = leases.list(&ListParams::default()).await.unwrap();
    at(
        list.metadata
            .resource_version
            .as_deref()
            .unwrap()
            .parse()
            .unwrap(),
        5,
    );

    // A write that changes nothing is a no-op, as on the real server.
    let same = leases.replace("c", &pp, &c2).await.unwrap();
    assert_eq!(same.metadata.resource_version, c2.metadata.resource_version);
    if !real {
        assert_eq!(server.resource_version().await, start + 5);
    }
    server.shutdown().await;
}

async fn server_sets_uid_creation_timestamp_and_generation(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let created = leases
        .create(&PostParams::default(), &lease("l", "x"))
        .await
        .unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    assert_eq!(uid.len(), 36, "a UUID: {uid}");
    assert!(created.metadata.creation_timestamp.is_some());
    let got = leases.get("l").await.unwrap();
    assert_eq!(got.metadata.uid.as_deref(), Some(&*uid));
    assert_eq!(
        got.metadata.creation_timestamp,
        created.metadata.creation_timestamp
    );

    // uid and creationTimestamp from a client are ignored on create and kept on update.
    let mut forged = lease("f", "x");
    forged.metadata.uid = Some("forged".into());
    let f = leases
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();
    assert_ne!(f.metadata.uid.as_deref(), Some("forged"));
    // On update a uid in the body is a precondition; without one the stored uid is kept.
    let mut upd = got.clone();
    upd.metadata.uid = Some("other".into());
    upd.spec.as_mut().unwrap().holder_identity = Some("y".into());
    let err = status(leases.replace("l", &PostParams::default(), &upd).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.ends_with(&format!(
            "Precondition failed: UID in precondition: other, UID in object meta: {uid}"
        )),
        "{}",
        err.message
    );
    upd.metadata.uid = None;
    let upd = leases
        .replace("l", &PostParams::default(), &upd)
        .await
        .unwrap();
    assert_eq!(upd.metadata.uid.as_deref(), Some(&*uid));
    assert_eq!(
        upd.metadata.creation_timestamp,
        got.metadata.creation_timestamp
    );

    // Custom resources: generation 1 on create, bumped by spec changes only.
    let ar = register_widgets(&server, true).await;
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar);
    let w = widgets
        .create(&PostParams::default(), &widget("w", json!({ "size": 1 })))
        .await
        .unwrap();
    assert_eq!(w.metadata.generation, Some(1));
    let mut w2 = w.clone();
    w2.data["spec"]["size"] = json!(2);
    let w2 = widgets
        .replace("w", &PostParams::default(), &w2)
        .await
        .unwrap();
    assert_eq!(w2.metadata.generation, Some(2));
    let mut w3 = w2.clone();
    w3.metadata.labels = Some([("a".to_owned(), "b".to_owned())].into());
    let w3 = widgets
        .replace("w", &PostParams::default(), &w3)
        .await
        .unwrap();
    assert_eq!(
        w3.metadata.generation,
        Some(2),
        "metadata changes do not bump generation"
    );
    let mut w4 = w3.clone();
    w4.data["status"] = json!({ "ready": true });
    let w4 = widgets
        .replace_status("w", &PostParams::default(), &w4)
        .await
        .unwrap();
    assert_eq!(w4.data["status"]["ready"], true);
    assert_eq!(
        w4.metadata.generation,
        Some(2),
        "status changes do not bump generation"
    );
    assert!(rv(&w4.metadata) > rv(&w3.metadata));
    server.shutdown().await;
}

async fn get_and_list_with_label_and_field_selectors(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let ns: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let mut other = k8s_openapi::api::core::v1::Namespace::default();
    other.metadata.name = Some("other".into());
    ns.create(&PostParams::default(), &other).await.unwrap();
    let pp = PostParams::default();
    let default: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let in_other: Api<ConfigMap> = Api::namespaced(client.clone(), "other");
    default
        .create(
            &pp,
            &config_map("web", "default", &[("app", "web"), ("tier", "front")]),
        )
        .await
        .unwrap();
    default
        .create(
            &pp,
            &config_map("db", "default", &[("app", "db"), ("tier", "back")]),
        )
        .await
        .unwrap();
    default
        .create(&pp, &config_map("plain", "default", &[]))
        .await
        .unwrap();
    in_other
        .create(&pp, &config_map("web", "other", &[("app", "web")]))
        .await
        .unwrap();

    assert_eq!(
        default.get("web").await.unwrap().metadata.labels.unwrap()["tier"],
        "front"
    );

    let names = |list: kube::core::ObjectList<ConfigMap>| -> Vec<String> {
        list.items
            .into_iter()
            .map(|c| {
                format!(
                    "{}/{}",
                    c.metadata.namespace.unwrap(),
                    c.metadata.name.unwrap()
                )
            })
            .collect()
    };
    let cases: [(&str, &[&str]); 9] = [
        ("app=web", &["default/web"]),
        ("app==db", &["default/db"]),
        ("app!=web", &["default/db", "default/plain"]),
        ("app in (web, db)", &["default/db", "default/web"]),
        ("tier notin (front)", &["default/db", "default/plain"]),
        ("app", &["default/db", "default/web"]),
        ("!app", &["default/plain"]),
        ("app=web,tier in (front,back)", &["default/web"]),
        ("app=none", &[]),
    ];
    for (selector, expected) in cases {
        let list = default
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert!(list.metadata.resource_version.is_some(), "{selector}");
        assert_eq!(names(list), expected, "labelSelector {selector}");
    }

    let all: Api<ConfigMap> = Api::all(client.clone());
    let list = all
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(names(list), ["default/web", "other/web"]);
    let list = all
        .list(&ListParams::default().fields("metadata.name=web"))
        .await
        .unwrap();
    assert_eq!(names(list), ["default/web", "other/web"]);
    let list = all
        .list(&ListParams::default().fields("metadata.namespace=other"))
        .await
        .unwrap();
    assert_eq!(names(list), ["other/web"]);
    let list = default
        .list(&ListParams::default().fields("metadata.name!=web,metadata.namespace==default"))
        .await
        .unwrap();
    assert_eq!(names(list), ["default/db", "default/plain"]);
    // A list's resourceVersion is the server's at the time of the list. The real server
    // writes too (its own identity Lease, every 10 s): there it lies between the counter just
    // before and just after; the stand-in's is exact.
    let before = server.resource_version().await;
    let list = all.list(&ListParams::default()).await.unwrap();
    let after = server.resource_version().await;
    let listed: u64 = list
        .metadata
        .resource_version
        .as_deref()
        .and_then(|rv| rv.parse().ok())
        .expect("a list's resourceVersion");
    if server.is_real() {
        assert!(
            (before..=after).contains(&listed),
            "{before} <= {listed} <= {after}"
        );
    } else {
        assert_eq!((listed, after), (before, before));
    }

    // Unsupported field selectors and malformed label selectors are 400 Status errors.
    let err = status(
        all.list(&ListParams::default().fields("spec.nodeName=x"))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    let err = status(all.list(&ListParams::default().labels("app in web")).await);
    assert_eq!(err.code, 400);
    server.shutdown().await;
}

async fn create_conflicts_and_generate_name(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let pp = PostParams::default();
    leases.create(&pp, &lease("taken", "x")).await.unwrap();
    let err = status(leases.create(&pp, &lease("taken", "y")).await);
    assert_eq!(err.code, 409);
    assert_eq!(err.reason, "AlreadyExists");
    assert_eq!(
        err.message,
        r#"leases.coordination.k8s.io "taken" already exists"#
    );
    let details = err.details.unwrap();
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("taken", "coordination.k8s.io", "leases")
    );

    let mut generated = lease("", "x");
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gen-".into());
    let a = leases.create(&pp, &generated).await.unwrap();
    let b = leases.create(&pp, &generated).await.unwrap();
    let (a, b) = (a.metadata.name.unwrap(), b.metadata.name.unwrap());
    assert!(a.starts_with("gen-") && a.len() == 9, "{a}");
    assert_ne!(a, b);
    assert!(leases.get(&a).await.is_ok());

    let mut nameless = lease("", "x");
    nameless.metadata.name = None;
    let err = status(leases.create(&pp, &nameless).await);
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));

    // A namespace that does not exist is a 404 naming it.
    let elsewhere: Api<Lease> = Api::namespaced(server.client().unwrap(), "missing");
    let err = status(elsewhere.create(&pp, &lease("l", "x")).await);
    assert_eq!(
        (err.code, err.message.as_str()),
        (404, r#"namespaces "missing" not found"#)
    );
    server.shutdown().await;
}

async fn update_with_a_stale_resource_version_is_a_conflict(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let pp = PostParams::default();
    let first = leases.create(&pp, &lease("x", "a")).await.unwrap();
    let mut second = first.clone();
    second.spec.as_mut().unwrap().holder_identity = Some("b".into());
    leases.replace("x", &pp, &second).await.unwrap();
    let mut stale = first.clone();
    stale.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let err = status(leases.replace("x", &pp, &stale).await);
    assert_eq!(err.code, 409);
    assert_eq!(err.reason, "Conflict");
    assert_eq!(
        err.message,
        r#"Operation cannot be fulfilled on leases.coordination.k8s.io "x": the object has been modified; please apply your changes to the latest version and try again"#
    );
    let details = err.details.unwrap();
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("x", "coordination.k8s.io", "leases")
    );
    assert_eq!(
        leases
            .get("x")
            .await
            .unwrap()
            .spec
            .unwrap()
            .holder_identity
            .as_deref(),
        Some("b")
    );

    // Core group: no group suffix and no group in details.
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client().unwrap());
    let cm = cms
        .create(&pp, &config_map("c", "default", &[]))
        .await
        .unwrap();
    let mut newer = cm.clone();
    newer.data = Some([("k".to_owned(), "v".to_owned())].into());
    cms.replace("c", &pp, &newer).await.unwrap();
    let err = status(cms.replace("c", &pp, &cm).await);
    assert_eq!(
        err.message,
        r#"Operation cannot be fulfilled on configmaps "c": the object has been modified; please apply your changes to the latest version and try again"#
    );
    assert_eq!(err.details.unwrap().group, "");
    server.shutdown().await;
}

async fn lease_put_needs_a_resource_version_and_creates_a_missing_lease(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let pp = PostParams::default();
    leases.create(&pp, &lease("held", "a")).await.unwrap();
    let err = status(leases.replace("held", &pp, &lease("held", "b")).await);
    assert_eq!(err.code, 422);
    assert_eq!(err.reason, "Invalid");
    assert_eq!(
        err.message,
        r#"leases.coordination.k8s.io "held" is invalid: metadata.resourceVersion: Invalid value: 0: must be specified for an update"#
    );
    let cause = &err.details.unwrap().causes[0];
    assert_eq!(
        (cause.field.as_str(), cause.reason.as_str()),
        ("metadata.resourceVersion", "FieldValueInvalid")
    );

    // Create on update: a PUT to a missing Lease creates it, with 201.
    let body = serde_json::to_vec(&lease("fresh", "a")).unwrap();
    let answer = raw(
        &client,
        Method::PUT,
        "/apis/coordination.k8s.io/v1/namespaces/default/leases/fresh",
        Some("application/json"),
        body,
    )
    .await;
    assert_eq!(answer.code, StatusCode::CREATED, "{}", answer.body);
    assert!(answer.body["metadata"]["uid"].is_string());
    let created = leases
        .replace("other", &pp, &lease("other", "a"))
        .await
        .unwrap();
    assert!(created.metadata.resource_version.is_some());

    // Other resources allow unconditional update and do not create on update.
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let err = status(
        cms.replace("none", &pp, &config_map("none", "default", &[]))
            .await,
    );
    assert_eq!(
        (err.code, err.message.as_str()),
        (404, r#"configmaps "none" not found"#)
    );
    cms.create(&pp, &config_map("cm", "default", &[]))
        .await
        .unwrap();
    let mut unconditional = config_map("cm", "default", &[("x", "y")]);
    unconditional.metadata.resource_version = None;
    assert!(cms.replace("cm", &pp, &unconditional).await.is_ok());
    server.shutdown().await;
}

async fn delete_honours_uid_and_resource_version_preconditions(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let created = leases
        .create(&PostParams::default(), &lease("d", "a"))
        .await
        .unwrap();
    let with = |uid: Option<&str>, rv: Option<&str>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: uid.map(str::to_owned),
            resource_version: rv.map(str::to_owned),
        }),
        ..DeleteParams::default()
    };
    let err = status(leases.delete("d", &with(Some("wrong"), None)).await);
    let uid = created.metadata.uid.clone().unwrap();
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        err.message,
        format!(
            r#"Operation cannot be fulfilled on Lease.coordination.k8s.io "d": the UID in the precondition (wrong) does not match the UID in record ({uid}). The object might have been deleted and then recreated"#
        )
    );
    let details = err.details.unwrap();
    assert_eq!(
        (details.kind.as_str(), details.group.as_str()),
        ("Lease", "coordination.k8s.io")
    );
    let current = created.metadata.resource_version.clone().unwrap();
    let err = status(leases.delete("d", &with(None, Some("1"))).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        err.message,
        format!(
            r#"Operation cannot be fulfilled on Lease.coordination.k8s.io "d": the ResourceVersion in the precondition (1) does not match the ResourceVersion in record ({current}). The object might have been modified"#
        )
    );
    assert!(leases.get("d").await.is_ok());

    let rv_before = server.resource_version().await;
    let answer = leases
        .delete(
            "d",
            &with(
                created.metadata.uid.as_deref(),
                created.metadata.resource_version.as_deref(),
            ),
        )
        .await
        .unwrap();
    // Leases, like most built-in resources, answer a DELETE with a Success Status.
    let done = answer.right().expect("a Status");
    assert_eq!(
        done.status,
        Some(kube::core::response::StatusSummary::Success)
    );
    let details = done.details.unwrap();
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("d", "coordination.k8s.io", "leases")
    );
    assert_eq!(Some(details.uid), created.metadata.uid.clone());
    assert_eq!(
        server.resource_version().await,
        rv_before + 1,
        "a delete is a write"
    );
    let err = status(leases.get("d").await);
    assert_eq!(err.code, 404);
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::default_namespaced(server.client().unwrap());
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(
        json!({ "metadata": { "name": "p" }, "spec": { "containers": [{ "name": "c", "image": "c" }] } }),
    )
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let gone = pods.delete("p", &DeleteParams::default()).await.unwrap();
    assert_eq!(
        gone.left()
            .expect("pods return the deleted object")
            .metadata
            .name
            .as_deref(),
        Some("p")
    );
    let err = status(leases.delete("d", &DeleteParams::default()).await);
    assert_eq!(
        (err.code, err.message.as_str()),
        (404, r#"leases.coordination.k8s.io "d" not found"#)
    );
    server.shutdown().await;
}

async fn status_subresource_writes_only_status_and_main_ignores_status(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let ar = register_widgets(&server, true).await;
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar);
    let pp = PostParams::default();

    let mut w = widget("s", json!({ "size": 1 }));
    w.data["status"] = json!({ "ready": true });
    let created = widgets.create(&pp, &w).await.unwrap();
    assert!(
        created.data.get("status").is_none(),
        "create ignores status: {:?}",
        created.data
    );

    let mut both = created.clone();
    both.data["spec"]["size"] = json!(2);
    both.data["status"] = json!({ "ready": true });
    let main = widgets.replace("s", &pp, &both).await.unwrap();
    assert_eq!(main.data["spec"]["size"], 2);
    assert!(
        main.data.get("status").is_none(),
        "main endpoint ignores status"
    );

    let mut both = main.clone();
    both.data["spec"]["size"] = json!(3);
    both.data["status"] = json!({ "ready": true });
    let sub = widgets.replace_status("s", &pp, &both).await.unwrap();
    assert_eq!(sub.data["status"]["ready"], true);
    assert_eq!(sub.data["spec"]["size"], 2, "/status ignores spec");

    let patched = widgets
        .patch_status(
            "s",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({ "status": { "ready": false }, "spec": { "size": 9 } }),
            ),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["status"]["ready"], false);
    assert_eq!(patched.data["spec"]["size"], 2);

    // A resource without a status subresource has no /status endpoint and keeps status.
    let plain = raw(
        &client,
        Method::GET,
        "/api/v1/namespaces/default/configmaps/x/status",
        None,
        "",
    )
    .await;
    assert_eq!(plain.code, StatusCode::NOT_FOUND);
    server.shutdown().await;
}

async fn concurrent_writers_see_exactly_one_winner(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let clients: Vec<Api<Lease>> = (0..8)
        .map(|i| Api::default_namespaced(server.client_for(&format!("r{i}")).unwrap()))
        .collect();
    // Racing creates: one 201, the rest 409 AlreadyExists.
    let creates =
        futures::future::join_all(clients.iter().enumerate().map(|(i, api)| async move {
            api.create(&PostParams::default(), &lease("race", &format!("r{i}")))
                .await
        }))
        .await;
    assert_eq!(creates.iter().filter(|r| r.is_ok()).count(), 1);
    for result in creates.into_iter().filter(Result::is_err) {
        assert_eq!(status(result).reason, "AlreadyExists");
    }
    // Racing updates from the same resourceVersion: one wins, the rest 409 Conflict. (Each
    // update changes the object: one that did not would be a no-op success, as on the real
    // server, leaving the resourceVersion for another writer.)
    let base = clients[0].get("race").await.unwrap();
    let updates = futures::future::join_all(clients.iter().enumerate().map(|(i, api)| {
        let mut mine = base.clone();
        mine.spec.as_mut().unwrap().holder_identity = Some(format!("u{i}"));
        async move { api.replace("race", &PostParams::default(), &mine).await }
    }))
    .await;
    let winners: Vec<&Lease> = updates.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1);
    let stored = clients[0].get("race").await.unwrap();
    assert_eq!(stored.spec, winners[0].spec);
    for result in updates.into_iter().filter(Result::is_err) {
        assert_eq!(status(result).reason, "Conflict");
    }
    server.shutdown().await;
}

async fn lease_micro_times_come_back_in_utc(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let body = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": "tz" },
        "spec": { "renewTime": "2026-11-29T09:00:00.500000+01:00" },
    });
    let answer = raw(
        &client,
        Method::POST,
        "/apis/coordination.k8s.io/v1/namespaces/default/leases",
        Some("application/json"),
        body.to_string(),
    )
    .await;
    assert_eq!(answer.code, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(
        answer.body["spec"]["renewTime"],
        "2026-11-29T08:00:00.500000Z"
    );
    server.shutdown().await;
}

async fn metadata_only_requests_work_with_kube(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let leases: Api<Lease> = Api::default_namespaced(server.client().unwrap());
    let created = leases
        .create(&PostParams::default(), &lease("meta", "a"))
        .await
        .unwrap();
    // The server answers with PartialObjectMetadata, as the real one does.
    let got = leases.get_metadata("meta").await.unwrap();
    assert_eq!(got.metadata.uid, created.metadata.uid);
    assert_eq!(got.types.as_ref().unwrap().kind, "PartialObjectMetadata");
    assert_eq!(got.types.as_ref().unwrap().api_version, "meta.k8s.io/v1");
    let list = leases.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.types.kind, "PartialObjectMetadataList");
    assert!(list.metadata.resource_version.is_some());
    let stream = leases
        .watch_metadata(&kube::api::WatchParams::default(), "0")
        .await
        .unwrap();
    futures::pin_mut!(stream);
    let first = futures::StreamExt::next(&mut stream)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(first, kube::api::WatchEvent::Added(m)
            if m.metadata.name.as_deref() == Some("meta")
                && m.types.as_ref().is_some_and(|t| t.kind == "PartialObjectMetadata")));
    server.shutdown().await;
}

crate::on_both!(
    both: [
        resource_version_is_one_global_counter_across_resources,
        server_sets_uid_creation_timestamp_and_generation,
        get_and_list_with_label_and_field_selectors,
        create_conflicts_and_generate_name,
        update_with_a_stale_resource_version_is_a_conflict,
        lease_put_needs_a_resource_version_and_creates_a_missing_lease,
        delete_honours_uid_and_resource_version_preconditions,
        status_subresource_writes_only_status_and_main_ignores_status,
        concurrent_writers_see_exactly_one_winner,
        lease_micro_times_come_back_in_utc,
        metadata_only_requests_work_with_kube,
    ],
    stand_in_only: [
    ],
);
