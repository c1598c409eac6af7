//! The main path with real processes: two controller replicas, agents with supervised HAProxy,
//! Ingresses created through the API server, and real HTTP requests through HAProxy.

mod common;

use std::time::Duration;

use common::*;
use haptic_render::functions::ssl_file;

/// One cluster for the checks of the main path, in order: each check waits for its own state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_to_haproxy_on_every_pod() {
    let cluster = Cluster::start().await;
    let (agent_port, http_port) = (free_port(), free_port());
    cluster.create_token().await;
    cluster.apply_htc(&lb_spec(agent_port, http_port)).await;
    let agents = [
        Agent::start(&cluster, 1, agent_port, http_port).await,
        Agent::start(&cluster, 2, agent_port, http_port).await,
    ];
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    cluster.service("web-a", a.addr).await;
    cluster.service("web-b", b.addr).await;
    // The HAProxy Service, with a load-balancer address: every Ingress's status gets it.
    let lb_api = cluster.api::<k8s_openapi::api::core::v1::Service>();
    let lb: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "haproxy", "namespace": NS},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }))
    .expect("service");
    lb_api
        .create(&Default::default(), &lb)
        .await
        .expect("create the LB service");
    lb_api
        .patch_status(
            "haproxy",
            &Default::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}
            })),
        )
        .await
        .expect("LB address");
    let c1 = Controller::start(&cluster, "controller-1").await;
    let c2 = Controller::start(&cluster, "controller-2").await;

    // An Ingress created through the API routes on both pods.
    cluster.ingress("shop", "shop.example", "/", "web-a").await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }
    // Its path and backend change: routing follows.
    cluster
        .ingress("shop", "shop.example", "/v2", "web-b")
        .await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/v2/cart", (200, "backend b"))
            .await;
        agent
            .await_route("shop.example", "/", (404, "no route"))
            .await;
    }
    // Deleted: the route is gone.
    cluster.delete_ingress("shop").await;
    for agent in &agents {
        agent
            .await_route("shop.example", "/v2", (404, "no route"))
            .await;
    }

    // The leader wrote the status: Valid, and Deployed on both pods.
    let status = eventually(
        "status Valid and Deployed 2/2",
        Duration::from_secs(20),
        || async {
            let status = cluster.htc_status().await?;
            let deployed = status["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "Deployed")?;
            (status["validationStatus"] == "Valid"
                && deployed["status"] == "True"
                && deployed["message"].as_str()?.starts_with("2/2 pods run"))
            .then_some(status)
        },
    )
    .await;
    assert_eq!(status["observedGeneration"], 1, "{status}");
    let leader = cluster.leader().await.expect("a leader");
    assert!(leader == c1.name || leader == c2.name);
    // Events, written by the leader through kube-runtime's recorder: the election, on the
    // Lease, in client-go's words; the verdict, on the HTC.
    await_event(
        &cluster,
        "Lease",
        "LeaderElection",
        &format!("{leader} became leader"),
    )
    .await;
    let valid = await_event(
        &cluster,
        "HAProxyTemplateConfig",
        "Valid",
        "generation 1 is valid",
    )
    .await;
    assert_eq!(
        valid.reporting_controller.as_deref(),
        Some("haptic-controller")
    );
    assert_eq!(valid.reporting_instance.as_deref(), Some(leader.as_str()));
    // The templates' declared status: the Ingress carries the HAProxy Service's address,
    // written by server-side apply with the field manager `haptic`.
    let ingresses = cluster.api::<k8s_openapi::api::networking::v1::Ingress>();
    cluster.ingress("lb", "lb.example", "/", "web-a").await;
    let lb_ing = eventually(
        "Ingress status from the LB Service",
        Duration::from_secs(20),
        || async {
            let ing = ingresses.get("lb").await.ok()?;
            let ip = ing
                .status
                .as_ref()?
                .load_balancer
                .as_ref()?
                .ingress
                .as_ref()?
                .first()?
                .ip
                .clone()?;
            (ip == "192.0.2.10").then_some(ing)
        },
    )
    .await;
    let written_at = lb_ing.metadata.resource_version.clone();
    // A path to a Service that does not exist: the reference templates ask for a Warning on
    // the Ingress, and the path is not routed.
    cluster
        .ingress("orphan", "orphan.example", "/", "no-such-service")
        .await;
    let orphan = await_event(&cluster, "Ingress", "BackendNotFound", "no-such-service").await;
    assert_eq!(orphan.type_.as_deref(), Some("Warning"));
    assert_eq!(
        orphan.regarding.as_ref().and_then(|r| r.name.as_deref()),
        Some("orphan")
    );
    // Renders since then declared the same status for `lb`: it was not written again.
    let orphan_status = eventually(
        "the orphan's status written",
        Duration::from_secs(20),
        || async {
            let ing = ingresses.get("orphan").await.ok()?;
            ing.status?.load_balancer?.ingress?.first()?.ip.clone()
        },
    )
    .await;
    assert_eq!(orphan_status, "192.0.2.10");
    let lb_writes = cluster
        .server
        .requests()
        .iter()
        .filter(|r| {
            r.verb == "patch"
                && r.resource == "ingresses.networking.k8s.io"
                && r.subresource == "status"
                && r.name == "lb"
        })
        .count();
    assert_eq!(lb_writes, 1, "unchanged status is not rewritten");
    assert_eq!(
        ingresses
            .get("lb")
            .await
            .expect("lb")
            .metadata
            .resource_version,
        written_at
    );
    cluster.delete_ingress("orphan").await;
    cluster.delete_ingress("lb").await;
    for c in [&c1, &c2] {
        assert!(
            !c.logs().contains(TOKEN),
            "{} logged the agent token",
            c.name
        );
    }
    for c in [&c1, &c2] {
        assert_eq!(c.probe("/readyz").await, Some(200), "{} ready", c.name);
        assert_eq!(c.probe("/healthz").await, Some(200), "{} healthy", c.name);
    }

    published_configs(&cluster, &agents).await;

    // Sets after the first went to the pods as deltas against the set each ran.
    let metrics = agents[0].fetch("/metrics").await.expect("agent metrics");
    let deltas = metrics
        .lines()
        .find_map(|line| line.strip_prefix("haptic_agent_deltas_total "))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no haptic_agent_deltas_total in {metrics}"));
    assert!(deltas >= 1.0, "{deltas} deltas");

    // A third pod started later gets the current set, with no change to render.
    cluster.ingress("shop", "shop.example", "/", "web-a").await;
    agents[0]
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    let third = Agent::start(&cluster, 3, agent_port, http_port).await;
    third
        .await_route("shop.example", "/", (200, "backend a"))
        .await;

    // A file changed by hand in a pod's live set is put back by drift prevention.
    let live = agents[0]
        .data
        .join("current")
        .join("maps")
        .join("routes-prefix.map");
    let good = std::fs::read_to_string(&live).expect("live map");
    std::fs::write(
        &live,
        format!("{good}tampered.example/ default_default-backend\n"),
    )
    .expect("tamper");
    eventually(
        "drift prevention restores the live map",
        Duration::from_secs(20),
        || async {
            let now =
                std::fs::read_to_string(agents[0].data.join("current/maps/routes-prefix.map"))
                    .ok()?;
            (now == good).then_some(())
        },
    )
    .await;
    agents[0]
        .await_route("shop.example", "/", (200, "backend a"))
        .await;

    // A template that does not compile: Invalid, naming the template and line; HAProxy serves on.
    let before = checksums(vec![&agents[0], &agents[1], &third]).await;
    let mut broken = lb_spec(agent_port, http_port);
    broken
        .maps
        .get_mut("routes-exact.map")
        .expect("map")
        .template
        .push_str("\n{% if %}\n");
    cluster.apply_htc(&broken).await;
    let status = await_status(&cluster, 2, "Invalid").await;
    let errors = status["validationErrors"].to_string();
    assert!(
        errors.contains("maps.routes-exact.map") && errors.contains("line"),
        "{status}"
    );
    let invalid = await_event(
        &cluster,
        "HAProxyTemplateConfig",
        "Invalid",
        "maps.routes-exact.map",
    )
    .await;
    assert_eq!(invalid.type_.as_deref(), Some("Warning"));
    for agent in [&agents[0], &agents[1], &third] {
        agent
            .await_route("shop.example", "/", (200, "backend a"))
            .await;
    }

    // A config that renders but that HAProxy refuses: Invalid with HAProxy's words, no pod's
    // live set changes, and later renders are held until one passes.
    let mut refused = lb_spec(agent_port, http_port);
    refused
        .haproxy_config
        .template
        .push_str("\nbackend refused\n    no-such-keyword-here\n");
    cluster.apply_htc(&refused).await;
    let status = await_status(&cluster, 3, "Invalid").await;
    assert!(
        status["validationMessage"]
            .as_str()
            .unwrap_or("")
            .contains("no-such-keyword-here"),
        "{status}"
    );
    await_event(
        &cluster,
        "HAProxyTemplateConfig",
        "HAProxyRefused",
        "no-such-keyword-here",
    )
    .await;
    cluster.ingress("held", "held.example", "/", "web-b").await;
    // An absence cannot be awaited: give a render and a deployment ample time to happen.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        checksums(vec![&agents[0], &agents[1], &third]).await,
        before,
        "no live set changed"
    );
    assert_eq!(
        get(&agents[0].http_addr(), "held.example", "/")
            .await
            .map(|r| r.0),
        Some(404)
    );
    // Fixed: the held change goes out.
    cluster.apply_htc(&lb_spec(agent_port, http_port)).await;
    await_status(&cluster, 4, "Valid").await;
    for agent in [&agents[0], &agents[1], &third] {
        agent
            .await_route("held.example", "/", (200, "backend b"))
            .await;
    }

    // A set the config policy refuses (Lua from the host) is reported and never leaves the
    // controller: no agent even sees it.
    let serving = checksums(vec![&agents[0], &agents[1], &third]).await;
    let mut lua = lb_spec(agent_port, http_port);
    lua.haproxy_config.template = lua.haproxy_config.template.replacen(
        "global\n",
        "global\n    lua-load /etc/haptic-evil.lua\n",
        1,
    );
    cluster.apply_htc(&lua).await;
    let status = await_status(&cluster, 5, "Invalid").await;
    let message = status["validationMessage"].as_str().unwrap_or("");
    assert!(
        message.contains("config policy") && message.contains("lua-load"),
        "{status}"
    );
    cluster.ingress("lua", "lua.example", "/", "web-a").await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    for agent in [&agents[0], &agents[1], &third] {
        let log = std::fs::read_to_string(cluster.dir.path().join(&agent.name).join("agent.log"))
            .unwrap_or_default();
        assert!(
            !log.contains("haptic-evil"),
            "{} saw the refused set:\n{log}",
            agent.name
        );
    }
    assert_eq!(
        checksums(vec![&agents[0], &agents[1], &third]).await,
        serving,
        "no live set changed"
    );
    fenced_and_failing(&cluster, &agents[0], third, http_port).await;
    drop((c1, c2, agents));
}

/// An agent whose fence is above the leader's epoch (the epoch counter regressed: the same
/// identity wrote there at a higher epoch) refuses the leader, which reclaims above the fence,
/// says so in a `Fenced` Event, and puts its set back; a pod whose agent is gone gets a
/// `DeploymentFailed` Event.
async fn fenced_and_failing(cluster: &Cluster, agent: &Agent, gone: Agent, http_port: u16) {
    use haptic_agent_client::{ApplyRequest, FileSet, Target};
    let leader = cluster.leader().await.expect("a leader");
    let epoch = cluster.lease_epoch().await.expect("an epoch");
    let mut files = FileSet::new();
    files
        .insert(
            "haproxy.cfg",
            format!(
                "global\n\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n\nfrontend f\n    bind \"${{POD_IP}}:{http_port}\"\n    http-request return status 503\n"
            ),
        )
        .expect("file");
    let request = ApplyRequest::new(epoch + 5, &leader, u64::MAX / 2, files).expect("request");
    let client = agent.client();
    let target = Target::new(&agent.name, &agent.url()).expect("target");
    client
        .apply(&target.url, &request)
        .await
        .expect("the higher epoch is accepted");
    // Drift prevention sees the foreign set; the re-apply is fenced; the leader reclaims.
    let fenced = await_event(cluster, "Pod", "Fenced", "reclaimed").await;
    assert_eq!(
        fenced.regarding.as_ref().and_then(|r| r.name.as_deref()),
        Some(agent.name.as_str())
    );
    assert!(
        fenced
            .note
            .as_deref()
            .unwrap_or("")
            .contains(&format!("its fence is {}", epoch + 5)),
        "{fenced:?}"
    );
    agent
        .await_route("shop.example", "/", (200, "backend a"))
        .await;
    assert!(
        cluster.lease_epoch().await.expect("epoch") > epoch + 5,
        "reclaimed above the fence"
    );

    // A pod whose agent is gone.
    let name = gone.name.clone();
    drop(gone);
    cluster
        .ingress("after", "after.example", "/", "web-a")
        .await;
    let failed = await_event(cluster, "Pod", "DeploymentFailed", &name).await;
    assert_eq!(
        failed.regarding.as_ref().and_then(|r| r.name.as_deref()),
        Some(name.as_str())
    );
    assert_eq!(
        failed.related.as_ref().and_then(|r| r.kind.as_deref()),
        Some("HAProxyTemplateConfig")
    );
}

async fn await_status(cluster: &Cluster, generation: i64, validation: &str) -> serde_json::Value {
    eventually(
        &format!("status {validation} for generation {generation}"),
        Duration::from_secs(20),
        || async {
            let status = cluster.htc_status().await?;
            (status["observedGeneration"] == generation && status["validationStatus"] == validation)
                .then_some(status)
        },
    )
    .await
}

/// The rendered set as published objects: what the pods run, the files beside it, the
/// certificate by path and checksum only; and no write of what did not change.
async fn published_configs(cluster: &Cluster, agents: &[Agent]) {
    use haptic_controller::published::{self, HAProxyCRTListFile, HAProxyCfg, HAProxyMapFile};
    let secret: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(haptic_render::fixtures::tls_secret(NS, "tls-cert"))
            .expect("secret");
    cluster
        .api::<k8s_openapi::api::core::v1::Secret>()
        .create(&Default::default(), &secret)
        .await
        .expect("TLS secret");
    let mut tls = ingress("tls", "tls.example", "/", "web-a");
    tls.spec.as_mut().expect("spec").tls =
        Some(vec![k8s_openapi::api::networking::v1::IngressTLS {
            hosts: Some(vec!["tls.example".into()]),
            secret_name: Some("tls-cert".into()),
        }]);
    cluster
        .api::<k8s_openapi::api::networking::v1::Ingress>()
        .create(&Default::default(), &tls)
        .await
        .expect("TLS ingress");
    for agent in agents {
        agent.await_route("tls.example", "/", (308, "")).await;
    }
    let live = agents[0]
        .state()
        .await
        .and_then(|s| s.live_checksum)
        .expect("live");
    let cfgs = cluster.api::<HAProxyCfg>();
    let cfg = eventually(
        "the HAProxyCfg of the live set, on both pods",
        Duration::from_secs(20),
        || async {
            let cfg = cfgs.get(HTC).await.ok()?;
            let pods = &cfg.status.as_ref()?.deployed_to_pods;
            (cfg.spec.set_checksum == format!("sha256:{live}")
                && pods.len() == 2
                && pods.iter().all(|p| p.checksum == format!("sha256:{live}")))
            .then_some(cfg)
        },
    )
    .await;
    let served = std::fs::read(agents[0].data.join("current/haproxy.cfg")).expect("live cfg");
    assert_eq!(
        published::decode(&cfg.spec.content, cfg.spec.compressed).expect("decodes"),
        served
    );
    assert_eq!(cfg.spec.checksum, published::checksum(&served));
    assert_eq!(
        cfg.metadata.owner_references.as_ref().expect("owner")[0].kind,
        "HAProxyTemplateConfig"
    );
    let aux = cfg
        .status
        .as_ref()
        .and_then(|s| s.auxiliary_files.clone())
        .expect("aux");
    assert!(
        aux.map_files.contains(&format!("{HTC}-routes-prefix.map")),
        "{aux:?}"
    );
    assert_eq!(aux.crt_list_files, [format!("{HTC}-certs.list")], "{aux:?}");
    let pem_path = ssl_file("default", "tls-cert");
    let pem = std::fs::read(agents[0].data.join("current").join(&pem_path)).expect("live pem");
    assert_eq!(
        aux.ssl_certificates
            .iter()
            .map(|c| (c.path.as_str(), c.checksum.clone()))
            .collect::<Vec<_>>(),
        [(pem_path.as_str(), published::checksum(&pem))]
    );
    let maps = cluster.api::<HAProxyMapFile>();
    let prefix = maps
        .get(&format!("{HTC}-routes-prefix.map"))
        .await
        .expect("map file");
    assert!(
        prefix.spec.entries.contains("tls.example/"),
        "{}",
        prefix.spec.entries
    );
    assert_eq!(
        prefix.metadata.owner_references.as_ref().expect("owner")[0].kind,
        "HAProxyCfg"
    );
    let list = cluster
        .api::<HAProxyCRTListFile>()
        .get(&format!("{HTC}-certs.list"))
        .await
        .expect("crt-list");
    assert!(
        list.spec.entries.contains(&pem_path),
        "{}",
        list.spec.entries
    );
    // No key anywhere in what was published.
    let key_line = haptic_render::fixtures::TLS_KEY_PEM
        .lines()
        .nth(1)
        .expect("a key line");
    for (kind, text) in [
        (
            "HAProxyCfg",
            serde_json::to_string(&cfgs.list(&Default::default()).await.expect("list").items),
        ),
        (
            "HAProxyMapFile",
            serde_json::to_string(&maps.list(&Default::default()).await.expect("list").items),
        ),
        (
            "HAProxyCRTListFile",
            serde_json::to_string(
                &cluster
                    .api::<HAProxyCRTListFile>()
                    .list(&Default::default())
                    .await
                    .expect("list")
                    .items,
            ),
        ),
        (
            "HAProxyGeneralFile",
            serde_json::to_string(
                &cluster
                    .api::<published::HAProxyGeneralFile>()
                    .list(&Default::default())
                    .await
                    .expect("list")
                    .items,
            ),
        ),
    ] {
        let text = text.expect("json");
        assert!(
            !text.contains("PRIVATE KEY") && !text.contains(key_line),
            "a {kind} holds the key"
        );
    }
    // A change to the prefix map only: the exact map is not written again.
    let exact_writes = || {
        cluster
            .server
            .requests()
            .iter()
            .filter(|r| {
                r.verb == "patch"
                    && r.resource == "haproxymapfiles.haproxy-haptic.org"
                    && r.subresource.is_empty()
                    && r.name == format!("{HTC}-routes-exact.map")
            })
            .count()
    };
    let before = exact_writes();
    cluster
        .ingress("tls", "tls.example", "/shop", "web-a")
        .await;
    eventually(
        "the prefix map republished",
        Duration::from_secs(20),
        || async {
            let map = maps.get(&format!("{HTC}-routes-prefix.map")).await.ok()?;
            map.spec.entries.contains("tls.example/shop/").then_some(())
        },
    )
    .await;
    assert_eq!(
        exact_writes(),
        before,
        "an unchanged file is not written again"
    );
    assert!(before >= 1);
    cluster.delete_ingress("tls").await;
}

/// The shared spec with the HAProxy Service named, so that Ingress status is declared.
fn lb_spec(agent_port: u16, http_port: u16) -> haptic_controller::HAProxyTemplateConfigSpec {
    let mut spec = spec(agent_port, http_port);
    spec.templating_settings
        .extra_context
        .get_mut("haproxy")
        .expect("tunables")["service"] = serde_json::json!(format!("{NS}/haproxy"));
    spec
}

/// The first Event (events.k8s.io/v1) about a `kind` with `reason` whose note contains `note`.
async fn await_event(
    cluster: &Cluster,
    kind: &str,
    reason: &str,
    note: &str,
) -> k8s_openapi::api::events::v1::Event {
    let api = cluster.api::<k8s_openapi::api::events::v1::Event>();
    eventually(
        &format!("an Event {reason} on a {kind} saying {note:?}"),
        Duration::from_secs(20),
        || async {
            let events = api.list(&Default::default()).await.ok()?;
            events.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some(kind)
                    && e.note.as_deref().is_some_and(|n| n.contains(note))
            })
        },
    )
    .await
}

async fn checksums(agents: Vec<&Agent>) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for agent in agents {
        out.push(agent.state().await.and_then(|s| s.live_checksum));
    }
    out
}
