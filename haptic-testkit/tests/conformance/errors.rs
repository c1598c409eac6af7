//! Status errors: 404 naming, malformed and wrong-kind bodies, Lease validation, and no panic
//! or hang whatever the body.

use http::Method;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{ConfigMap, Pod},
};
use kube::{Api, api::PostParams};
use serde_json::json;

use crate::common::{assert_status, lease, raw, status};

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/default/leases";

async fn not_found_names_the_resource_as_the_real_server_does(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let err = status(pods.get("x").await);
    assert_eq!((err.code, err.reason.as_str()), (404, "NotFound"));
    assert_eq!(err.message, r#"pods "x" not found"#);
    let details = err.details.unwrap();
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("x", "", "pods")
    );

    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let err = status(leases.get("x").await);
    assert_eq!(err.message, r#"leases.coordination.k8s.io "x" not found"#);
    assert_eq!(err.details.unwrap().group, "coordination.k8s.io");

    // The raw body is a complete Status object.
    let answer = raw(&client, Method::GET, &format!("{LEASES}/x"), None, "").await;
    assert_status(&answer, 404, "NotFound");
    assert_eq!(answer.body["metadata"], json!({}));
    assert_eq!(answer.body["details"]["kind"], "leases");

    let answer = raw(&client, Method::GET, "/apis/nope/v1/things", None, "").await;
    assert_status(&answer, 404, "NotFound");
    server.shutdown().await;
}

async fn malformed_json_is_400_with_a_status(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    leases
        .create(&PostParams::default(), &lease("m", "a"))
        .await
        .unwrap();
    let json = Some("application/json");
    for (method, path, ct, body) in [
        (Method::POST, LEASES.to_owned(), json, "{not json"),
        (Method::POST, LEASES.to_owned(), json, ""),
        (Method::POST, LEASES.to_owned(), json, "[1, 2]"),
        (Method::PUT, format!("{LEASES}/m"), json, "{\"metadata\": "),
        (
            Method::PATCH,
            format!("{LEASES}/m"),
            Some("application/merge-patch+json"),
            "{oops",
        ),
        (
            Method::PATCH,
            format!("{LEASES}/m"),
            Some("application/merge-patch+json"),
            "\"a string\"",
        ),
        (
            Method::PATCH,
            format!("{LEASES}/m"),
            Some("application/json-patch+json"),
            "{\"op\": 1}",
        ),
        (
            Method::PATCH,
            format!("{LEASES}/m"),
            Some("application/strategic-merge-patch+json"),
            "}",
        ),
        (Method::DELETE, format!("{LEASES}/m"), json, "{nope"),
    ] {
        let answer = raw(&client, method.clone(), &path, ct, body).await;
        assert_status(&answer, 400, "BadRequest");
        let _ = (method, path);
    }
    assert!(
        leases.get("m").await.is_ok(),
        "nothing was changed or deleted"
    );
    server.shutdown().await;
}

async fn a_body_of_the_wrong_kind_or_type_is_refused(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let json = Some("application/json");
    // A ConfigMap posted to leases.
    let cm = json!({ "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "name": "c" } });
    let answer = raw(&client, Method::POST, LEASES, json, cm.to_string()).await;
    assert_status(&answer, 400, "BadRequest");
    // Right group, wrong version.
    let v2 = json!({ "apiVersion": "coordination.k8s.io/v2", "kind": "Lease", "metadata": { "name": "c" } });
    let answer = raw(&client, Method::POST, LEASES, json, v2.to_string()).await;
    assert_status(&answer, 400, "BadRequest");
    assert_eq!(
        answer.body["message"],
        "the API version in the data (coordination.k8s.io/v2) does not match the expected API version (coordination.k8s.io/v1)"
    );
    // Right group, wrong kind.
    let wrong = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Pod", "metadata": { "name": "c" } });
    let answer = raw(&client, Method::POST, LEASES, json, wrong.to_string()).await;
    assert_status(&answer, 400, "BadRequest");
    // Fields of the wrong JSON type cannot be decoded.
    for spec in [
        json!("text"),
        json!({ "leaseDurationSeconds": "ten" }),
        json!({ "holderIdentity": 5 }),
    ] {
        let body = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": "t" }, "spec": spec });
        let answer = raw(&client, Method::POST, LEASES, json, body.to_string()).await;
        assert_status(&answer, 400, "BadRequest");
    }
    let labels = json!({ "metadata": { "name": "l", "labels": { "a": 1 } } });
    let answer = raw(&client, Method::POST, LEASES, json, labels.to_string()).await;
    assert_status(&answer, 400, "BadRequest");
    // A name that is not a DNS subdomain is 422 Invalid.
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let mut bad = ConfigMap::default();
    bad.metadata.name = Some("Not_Valid".into());
    let err = status(cms.create(&PostParams::default(), &bad).await);
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(err.details.unwrap().causes[0].field, "metadata.name");
    // Name on the URL and in the body must agree.
    let answer = raw(
        &client,
        Method::PUT,
        &format!("{LEASES}/one"),
        json,
        json!({ "metadata": { "name": "two" } }).to_string(),
    )
    .await;
    assert_status(&answer, 400, "BadRequest");
    server.shutdown().await;
}

async fn lease_validation_matches_the_real_server(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    for duration in [0, -5] {
        let mut l = lease("v", "a");
        l.spec.as_mut().unwrap().lease_duration_seconds = Some(duration);
        let err = status(leases.create(&PostParams::default(), &l).await);
        assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
        assert_eq!(
            err.message,
            format!(
                r#"Lease.coordination.k8s.io "v" is invalid: spec.leaseDurationSeconds: Invalid value: {duration}: must be greater than 0"#
            )
        );
        let details = err.details.unwrap();
        assert_eq!(
            (details.kind.as_str(), details.group.as_str()),
            ("Lease", "coordination.k8s.io")
        );
        let cause = &details.causes[0];
        assert_eq!(
            (cause.field.as_str(), cause.reason.as_str()),
            ("spec.leaseDurationSeconds", "FieldValueInvalid")
        );
    }
    // Coordinated election fields: a known strategy, and a preferred holder only with one.
    let with_spec = |name: &str, spec: serde_json::Value| {
        json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": name }, "spec": spec })
            .to_string()
    };
    let answer = raw(
        &client,
        Method::POST,
        LEASES,
        Some("application/json"),
        with_spec("s1", json!({ "strategy": "Newest" })),
    )
    .await;
    assert_status(&answer, 422, "Invalid");
    assert_eq!(
        answer.body["details"]["causes"][0]["reason"],
        "FieldValueNotSupported"
    );
    assert_eq!(
        answer.body["message"],
        r#"Lease.coordination.k8s.io "s1" is invalid: spec.strategy: Unsupported value: "Newest": supported values: "OldestEmulationVersion""#
    );
    let answer = raw(
        &client,
        Method::POST,
        LEASES,
        Some("application/json"),
        with_spec("s2", json!({ "preferredHolder": "a" })),
    )
    .await;
    assert_status(&answer, 422, "Invalid");
    assert_eq!(
        answer.body["details"]["causes"][0]["reason"],
        "FieldValueForbidden"
    );
    for (name, spec) in [
        (
            "s3",
            json!({ "strategy": "OldestEmulationVersion", "preferredHolder": "a" }),
        ),
        ("s4", json!({ "strategy": "example.com/mine" })),
    ] {
        let answer = raw(
            &client,
            Method::POST,
            LEASES,
            Some("application/json"),
            with_spec(name, spec),
        )
        .await;
        assert_eq!(answer.code.as_u16(), 201, "{}", answer.body);
    }

    // Updates are validated too.
    let created = leases
        .create(&PostParams::default(), &lease("v", "a"))
        .await
        .unwrap();
    let mut l = created.clone();
    l.spec.as_mut().unwrap().lease_duration_seconds = Some(0);
    assert_eq!(
        status(leases.replace("v", &PostParams::default(), &l).await).code,
        422
    );

    // MicroTime: exactly six fractional digits, sent raw so no client formatting interferes.
    let post = |time: &str, name: &str| {
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": { "name": name },
            "spec": { "holderIdentity": "a", "acquireTime": time, "renewTime": time },
        })
        .to_string()
    };
    let json = Some("application/json");
    let ok = raw(
        &client,
        Method::POST,
        LEASES,
        json,
        post("2026-11-29T08:00:00.123456Z", "t1"),
    )
    .await;
    assert_eq!(ok.code.as_u16(), 201, "{}", ok.body);
    assert_eq!(ok.body["spec"]["renewTime"], "2026-11-29T08:00:00.123456Z");
    for (i, bad) in [
        "2026-11-29T08:00:00Z",
        "2026-11-29T08:00:00.123Z",
        "2026-11-29T08:00:00.1234567Z",
        "not a time",
    ]
    .into_iter()
    .enumerate()
    {
        let answer = raw(
            &client,
            Method::POST,
            LEASES,
            json,
            post(bad, &format!("bad{i}")),
        )
        .await;
        assert_status(&answer, 400, "BadRequest");
        assert!(
            answer.body["message"].as_str().unwrap().contains(bad),
            "{}",
            answer.body
        );
    }
    // kube's own MicroTime serialisation is accepted.
    let mut typed = lease("typed", "a");
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    );
    typed.spec.as_mut().unwrap().renew_time = Some(now);
    assert!(leases.create(&PostParams::default(), &typed).await.is_ok());
    server.shutdown().await;
}

async fn odd_requests_never_panic_or_hang(backend: haptic_testkit::Backend) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    leases
        .create(&PostParams::default(), &lease("o", "a"))
        .await
        .unwrap();
    let bodies = [
        "",
        "null",
        "0",
        "[]",
        "{}",
        "{\"metadata\": null}",
        "{\"metadata\": []}",
        "{\"spec\": null}",
        "{\"metadata\": {\"name\": 5}}",
        "{\"metadata\": {\"resourceVersion\": \"abc\", \"name\": \"o\"}}",
        "\u{0}\u{1}",
        "{\"kind\": [], \"apiVersion\": {}}",
        "[{\"op\": \"remove\", \"path\": \"/metadata\"}]",
        "[{\"op\": \"replace\", \"path\": \"\", \"value\": 1}]",
    ];
    let paths = [
        LEASES.to_owned(),
        format!("{LEASES}/o"),
        format!("{LEASES}/o/status"),
        "/api/v1/namespaces/default/pods/o/status".to_owned(),
        "/api/v1/namespaces".to_owned(),
        "/api/v1/namespaces/default".to_owned(),
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions".to_owned(),
        "/apis/coordination.k8s.io/v1/leases".to_owned(),
        "/api".to_owned(),
        "/apis/coordination.k8s.io/v1/namespaces/default/leases?labelSelector=%zz".to_owned(),
        "/apis/coordination.k8s.io/v1/namespaces/default/leases/o?watch=true&resourceVersion=x&timeoutSeconds=1".to_owned(),
    ];
    let content_types = [
        "application/json",
        "application/merge-patch+json",
        "application/json-patch+json",
        "application/strategic-merge-patch+json",
        "application/apply-patch+yaml",
        "text/plain",
    ];
    for path in &paths {
        for method in [
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::GET,
            Method::OPTIONS,
        ] {
            for body in bodies {
                for ct in content_types {
                    let answer = raw(&client, method.clone(), path, Some(ct), body).await;
                    let code = answer.code.as_u16();
                    assert!(
                        code < 500,
                        "{method} {path} {ct} {body:?}: {code} {}",
                        answer.body
                    );
                    if code >= 400 {
                        assert_eq!(
                            answer.body["kind"], "Status",
                            "{method} {path} {ct} {body:?}"
                        );
                        assert_eq!(answer.body["code"], code, "{method} {path} {ct} {body:?}");
                    }
                    if method != Method::PATCH {
                        break;
                    }
                }
                if method == Method::GET {
                    break;
                }
            }
        }
    }
    // The server is still healthy afterwards.
    assert!(server.client().unwrap().apiserver_version().await.is_ok());
    server.shutdown().await;
}

async fn field_validation_strict_refuses_and_warn_drops_unknown_fields(
    backend: haptic_testkit::Backend,
) {
    let server = crate::common::Server::start(backend).await;
    let client = server.client().unwrap();
    let path = "/api/v1/namespaces/default/configmaps";
    let body = |name: &str| {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": name, "bogus": 1 },
            "data": { "k": "v" },
            "spec": { "x": 1 },
        })
        .to_string()
    };
    let json = Some("application/json");
    let strict = raw(
        &client,
        Method::POST,
        &format!("{path}?fieldValidation=Strict"),
        json,
        body("s"),
    )
    .await;
    assert_status(&strict, 400, "BadRequest");
    assert_eq!(
        strict.body["message"],
        r#"ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: unknown field "metadata.bogus", unknown field "spec""#
    );

    let warned = raw(&client, Method::POST, path, json, body("w")).await;
    assert_eq!(warned.code.as_u16(), 201, "{}", warned.body);
    let warnings: Vec<&str> = warned
        .headers
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(
        warnings,
        [
            r#"299 - "unknown field \"metadata.bogus\"""#,
            r#"299 - "unknown field \"spec\"""#
        ]
    );
    assert!(warned.body.get("spec").is_none() && warned.body["metadata"].get("bogus").is_none());
    assert_eq!(warned.body["data"]["k"], "v");

    let ignored = raw(
        &client,
        Method::POST,
        &format!("{path}?fieldValidation=Ignore"),
        json,
        body("i"),
    )
    .await;
    assert_eq!(ignored.code.as_u16(), 201);
    assert!(ignored.headers.get("warning").is_none());
    assert!(ignored.body.get("spec").is_none());

    // Nested paths, as in a container list; PUT is checked the same way.
    let pod = json!({ "metadata": { "name": "p" }, "spec": { "containers": [{ "name": "c", "image": "i", "imagePolicy": "x" }] } });
    let answer = raw(
        &client,
        Method::POST,
        "/api/v1/namespaces/default/pods?fieldValidation=Strict",
        json,
        pod.to_string(),
    )
    .await;
    assert_status(&answer, 400, "BadRequest");
    assert!(
        answer.body["message"]
            .as_str()
            .unwrap()
            .ends_with(r#"unknown field "spec.containers[0].imagePolicy""#),
        "{}",
        answer.body
    );
    let mut current = raw(&client, Method::GET, &format!("{path}/w"), None, "")
        .await
        .body;
    current["extra"] = json!(true);
    let answer = raw(
        &client,
        Method::PUT,
        &format!("{path}/w?fieldValidation=Strict"),
        json,
        current.to_string(),
    )
    .await;
    assert_status(&answer, 400, "BadRequest");
    let answer = raw(
        &client,
        Method::POST,
        &format!("{path}?fieldValidation=Loose"),
        json,
        body("l"),
    )
    .await;
    // An unknown directive is an invalid option (seen on kube-apiserver 1.34).
    assert_status(&answer, 422, "Invalid");
    assert_eq!(
        answer.body["details"]["causes"][0]["field"], "fieldValidation",
        "{}",
        answer.body
    );
    server.shutdown().await;
}

crate::on_both!(
    both: [
        field_validation_strict_refuses_and_warn_drops_unknown_fields,
    ],
    stand_in_only: [
        not_found_names_the_resource_as_the_real_server_does,
        malformed_json_is_400_with_a_status,
        a_body_of_the_wrong_kind_or_type_is_refused,
        lease_validation_matches_the_real_server,
        odd_requests_never_panic_or_hang,
    ],
);
