//! Helpers shared by the conformance tests: raw requests, Status extraction, fixtures.

use std::time::Duration;

use bytes::Bytes;
use haptic_testkit::ApiServer;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::core::Status;
use serde_json::{Value, json};

/// The bound on any single await that should complete promptly.
pub const BOUND: Duration = Duration::from_secs(10);

/// A raw answer: code, headers and the body parsed as JSON (Null when it is not JSON).
#[derive(Debug)]
pub struct Raw {
    pub code: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

/// Sends one raw request through a kube client and reads the whole answer.
pub async fn raw(
    client: &kube::Client,
    method: Method,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<Bytes>,
) -> Raw {
    let mut builder = Request::builder().method(method).uri(path);
    if let Some(ct) = content_type {
        builder = builder.header(http::header::CONTENT_TYPE, ct);
    }
    let request = builder
        .body(kube::client::Body::from(body.into().to_vec()))
        .expect("request");
    let response = tokio::time::timeout(BOUND, client.send(request))
        .await
        .expect("answered within the bound")
        .expect("sent");
    let (parts, body) = response.into_parts();
    let bytes = tokio::time::timeout(BOUND, body.collect())
        .await
        .expect("body within the bound")
        .expect("body")
        .to_bytes();
    Raw {
        code: parts.status,
        headers: parts.headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

/// GET a path and return the JSON body, asserting 200.
pub async fn get_json(client: &kube::Client, path: &str) -> Value {
    let answer = raw(client, Method::GET, path, None, Bytes::new()).await;
    assert_eq!(answer.code, StatusCode::OK, "GET {path}: {}", answer.body);
    answer.body
}

/// The Status of an API error, failing the test on any other outcome.
pub fn status<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// Asserts a raw answer is a Failure Status whose `code` matches the HTTP code and whose
/// reason is `reason`.
pub fn assert_status(answer: &Raw, code: u16, reason: &str) {
    assert_eq!(answer.code.as_u16(), code, "{}", answer.body);
    let body = &answer.body;
    assert_eq!(body["kind"], "Status", "{body}");
    assert_eq!(body["apiVersion"], "v1", "{body}");
    assert_eq!(body["status"], "Failure", "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["reason"], reason, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

/// A Lease with a holder and a duration.
pub fn lease(name: &str, holder: &str) -> Lease {
    let mut lease = Lease::default();
    lease.metadata.name = Some(name.to_owned());
    lease.spec = Some(LeaseSpec {
        holder_identity: Some(holder.to_owned()),
        lease_duration_seconds: Some(15),
        ..LeaseSpec::default()
    });
    lease
}

/// A CRD for `widgets.example.com` (namespaced, v1, optionally with a status subresource).
pub fn widget_crd(status: bool) -> Value {
    let mut version = json!({
        "name": "v1", "served": true, "storage": true,
        "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } },
    });
    if status {
        version["subresources"] = json!({ "status": {} });
    }
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.example.com" },
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"] },
            "versions": [version],
        },
    })
}

/// Registers the Widget CRD through the API and returns its ApiResource.
pub async fn register_widgets(server: &Server, status: bool) -> kube::core::ApiResource {
    let client = server.client().expect("client");
    let answer = raw(
        &client,
        Method::POST,
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        Some("application/json"),
        serde_json::to_vec(&widget_crd(status)).expect("json"),
    )
    .await;
    assert_eq!(answer.code, StatusCode::CREATED, "{}", answer.body);
    if server.is_real() {
        // The real server serves a CRD once it is Established.
        let path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com";
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            let crd = get_json(&client, path).await;
            let established = crd["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
            });
            if established {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the CRD was not Established: {crd}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let gvk = kube::core::GroupVersionKind::gvk("example.com", "v1", "Widget");
    kube::core::ApiResource::from_gvk_with_plural(&gvk, "widgets")
}

/// A Widget object.
pub fn widget(name: &str, spec: Value) -> kube::core::DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": { "name": name },
        "spec": spec,
    }))
    .expect("widget")
}

/// A kube Config for `name` with kube's default retry of 429/503/504 turned off, so a test
/// sees the code the server answered.
pub fn no_retry_client(server: &ApiServer, name: &str) -> kube::Client {
    let mut config = server.config_for(name).expect("config");
    config.default_retry = false;
    kube::Client::try_from(config).expect("client")
}

/// The server a conformance test runs on: the stand-in, or a real kube-apiserver of the
/// test's own (the differential check: the same body on both; `cargo xtask envtest`).
pub enum Server {
    Stand(ApiServer),
    Real(haptic_testkit::RealApiServer),
}

impl Server {
    pub async fn start(backend: haptic_testkit::Backend) -> Self {
        match backend {
            haptic_testkit::Backend::StandIn => Self::Stand(ApiServer::start().await.unwrap()),
            haptic_testkit::Backend::Real => Self::Real(
                haptic_testkit::RealApiServer::start()
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self, Self::Real(_))
    }

    pub fn client(&self) -> haptic_testkit::Result<kube::Client> {
        match self {
            Self::Stand(s) => s.client(),
            Self::Real(r) => Ok(r.admin_client_now().unwrap_or_else(|e| panic!("{e}"))),
        }
    }

    /// On the real server every name gets the admin: names only matter to the stand-in's
    /// fault injection and accounting.
    pub fn client_for(&self, name: &str) -> haptic_testkit::Result<kube::Client> {
        match self {
            Self::Stand(s) => s.client_for(name),
            Self::Real(_) => self.client(),
        }
    }

    /// The current global resourceVersion (on the real server: a list's, the etcd revision).
    pub async fn resource_version(&self) -> u64 {
        match self {
            Self::Stand(s) => s.resource_version(),
            Self::Real(_) => {
                let list = get_json(&self.client().unwrap(), "/api/v1/namespaces?limit=1").await;
                list["metadata"]["resourceVersion"]
                    .as_str()
                    .and_then(|rv| rv.parse().ok())
                    .expect("a list's resourceVersion")
            }
        }
    }

    pub async fn shutdown(self) {
        match self {
            Self::Stand(s) => s.shutdown().await,
            Self::Real(r) => drop(r),
        }
    }
}

/// Runs each `async fn NAME(backend: Backend)` of `both` as `stand_in::NAME` and
/// `real::NAME` (the differential check); those of `stand_in_only` only on the stand-in, for
/// the differences haptic-testkit's README lists.
#[macro_export]
macro_rules! on_both {
    (both: [$($name:ident),* $(,)?], stand_in_only: [$($only:ident),* $(,)?] $(,)?) => {
        mod stand_in {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(haptic_testkit::Backend::StandIn).await
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $only() {
                    super::$only(haptic_testkit::Backend::StandIn).await
                }
            )*
        }
        mod real {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(haptic_testkit::Backend::Real).await
                }
            )*
        }
    };
}
