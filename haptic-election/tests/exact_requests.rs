//! The exact requests of an acquisition and of renews, checked on a tower-test mock: a renew is
//! one PUT carrying the resourceVersion the last write returned, with no GET before it.

use std::time::Duration;

use bytes::Bytes;
use haptic_election::{Callbacks, ElectionConfig, LeaderElector};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::client::Body;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tower_test::mock;

type Handle = mock::Handle<Request<Body>, Response<Body>>;

async fn next(
    handle: &mut Handle,
) -> (
    Method,
    String,
    Option<Lease>,
    mock::SendResponse<Response<Body>>,
) {
    let (req, send) = tokio::time::timeout(Duration::from_secs(60), handle.next_request())
        .await
        .expect("a request within a minute")
        .expect("the client is alive");
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let bytes: Bytes = req.into_body().collect().await.expect("body").to_bytes();
    let lease = (!bytes.is_empty()).then(|| serde_json::from_slice(&bytes).expect("a Lease body"));
    (method, path, lease, send)
}

fn respond(send: mock::SendResponse<Response<Body>>, code: StatusCode, body: serde_json::Value) {
    let bytes = serde_json::to_vec(&body).expect("json");
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(bytes))
            .expect("response"),
    );
}

fn with_rv(mut lease: Lease, rv: &str) -> serde_json::Value {
    lease.metadata.resource_version = Some(rv.to_owned());
    let mut v = serde_json::to_value(&lease).expect("json");
    v["apiVersion"] = json!("coordination.k8s.io/v1");
    v["kind"] = json!("Lease");
    v
}

#[tokio::test(start_paused = true)]
async fn renew_is_one_put_with_the_cached_resource_version_and_no_get() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let config = ElectionConfig::new("pod-a", "haptic-leader", "default").with_durations(
        Duration::from_secs(15),
        Duration::from_secs(10),
        Duration::from_secs(2),
    );
    let elector = LeaderElector::new(client, config).expect("config");
    let token = CancellationToken::new();
    let run = tokio::spawn(elector.run(token.clone(), Callbacks::new()));
    let path = "/apis/coordination.k8s.io/v1/namespaces/default/leases/haptic-leader";

    // Acquisition: GET, 404, POST.
    let (method, p, _, send) = next(&mut handle).await;
    assert_eq!((method, p.as_str()), (Method::GET, path));
    respond(
        send,
        StatusCode::NOT_FOUND,
        json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "leases.coordination.k8s.io \"haptic-leader\" not found", "reason": "NotFound",
        "details": { "name": "haptic-leader", "group": "coordination.k8s.io", "kind": "leases" }, "code": 404 }),
    );
    let (method, p, body, send) = next(&mut handle).await;
    assert_eq!(
        (method, p.as_str()),
        (
            Method::POST,
            "/apis/coordination.k8s.io/v1/namespaces/default/leases"
        )
    );
    let created = body.expect("lease");
    let spec = created.spec.clone().expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("pod-a"));
    assert_eq!(spec.lease_duration_seconds, Some(15));
    assert_eq!(spec.lease_transitions, Some(0));
    assert!(spec.acquire_time.is_some() && spec.renew_time.is_some());
    respond(send, StatusCode::CREATED, with_rv(created, "100"));

    // Renews: each the next request, a PUT of the object the last write returned.
    let mut expected_rv = 100;
    for _ in 0..3 {
        let (method, p, body, send) = next(&mut handle).await;
        assert_eq!(
            (method, p.as_str()),
            (Method::PUT, path),
            "a renew is a PUT, with no GET before it"
        );
        let lease = body.expect("lease");
        assert_eq!(
            lease.metadata.resource_version.as_deref(),
            Some(expected_rv.to_string().as_str()),
            "the cached resourceVersion"
        );
        assert_eq!(
            lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref()),
            Some("pod-a")
        );
        expected_rv += 1;
        respond(
            send,
            StatusCode::OK,
            with_rv(lease, &expected_rv.to_string()),
        );
    }

    // Graceful stop with ReleaseOnCancel: one PUT, holder empty, leaseDurationSeconds 1.
    token.cancel();
    let (method, p, body, send) = next(&mut handle).await;
    assert_eq!((method, p.as_str()), (Method::PUT, path));
    let released = body.expect("lease");
    let spec = released.spec.clone().expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some(""));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    assert_eq!(
        released.metadata.resource_version.as_deref(),
        Some(expected_rv.to_string().as_str())
    );
    respond(send, StatusCode::OK, with_rv(released, "999"));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("stops")
        .expect("no panic");
}
