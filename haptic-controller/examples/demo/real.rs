//! `cargo xtask demo --real`: the demo on a real kube-apiserver with etcd (`cargo xtask envtest`)
//! instead of the stand-in. deploy/rbac.yaml's objects are applied and both controllers run
//! with the token of the ServiceAccount they bind; the demo's backends live in network
//! namespaces of its own (a real server refuses loopback EndpointSlice addresses), so it runs as
//! root. `--smoke` checks that both hosts route on both pods, that a new Ingress routes, that
//! killing the leader hands over and a later change still routes, and that the API server never
//! refused the controllers anything.

use std::{process::ExitCode, time::Duration};

use haptic_testkit::{Backend as Server, TestApi};

use crate::common::{
    envtest::{Agent, Controller, Env, NetnsBackend, forbidden},
    free_port, get,
};

const HOSTS: [(&str, &str); 2] = [("shop.demo.example", "shop"), ("blog.demo.example", "blog")];

struct RealDemo {
    env: Env,
    agents: Vec<Agent>,
    controllers: Vec<Controller>,
    _backends: Vec<NetnsBackend>,
}

async fn start() -> RealDemo {
    let api = TestApi::start(Server::Real)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let env = Env::start(api, "demo").await;
    let (agent_port, http_port) = (free_port(), free_port());
    // The HTC `deploy/` ships, made to run on loopback.
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/haptic-config.yaml");
    let text = std::fs::read_to_string(shipped).expect("deploy/haptic-config.yaml");
    let htc: haptic_controller::HAProxyTemplateConfig =
        serde_saphyr::from_str(&text).expect("deploy/haptic-config.yaml is an HTC");
    env.apply_htc(&crate::common::local(htc.spec, agent_port, http_port))
        .await;
    let mut agents = Vec::new();
    for i in 1..=2 {
        agents.push(Agent::start(&env, i, agent_port, http_port).await);
    }
    let mut backends = Vec::new();
    for (host, app) in HOSTS {
        let backend = NetnsBackend::start(app, env.dir.path()).await;
        env.service(app, &backend).await;
        env.ingress(app, host, app).await;
        backends.push(backend);
    }
    let controllers = vec![
        Controller::start(&env, "controller-1", &[]).await,
        Controller::start(&env, "controller-2", &[]).await,
    ];
    RealDemo {
        env,
        agents,
        controllers,
        _backends: backends,
    }
}

async fn leader(env: &Env) -> Option<String> {
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = env.api(&env.ns);
    leases
        .get_opt("haptic-leader")
        .await
        .ok()??
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

async fn within<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + bound;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn routes(agent: &Agent, host: &str, want: &str) -> bool {
    let addr = format!("{}:{}", agent.ip, agent.http_port);
    within(Duration::from_secs(30), || async {
        get(&addr, host, "/")
            .await
            .is_some_and(|(s, b)| s == 200 && b.contains(want))
    })
    .await
}

fn check(what: &str, ok: bool, failures: &mut Vec<String>) {
    println!("  [{}] {what}", if ok { "ok" } else { "FAILED" });
    if !ok {
        failures.push(what.to_owned());
    }
}

async fn smoke(demo: &mut RealDemo) -> Vec<String> {
    let mut failures = Vec::new();
    for agent in &demo.agents {
        for (host, app) in HOSTS {
            let ok = routes(agent, host, &format!("backend {app}")).await;
            check(
                &format!("{host} routes to {app} through {}", agent.name),
                ok,
                &mut failures,
            );
        }
    }
    demo.env.ingress("new", "new.demo.example", "shop").await;
    let ok = routes(&demo.agents[1], "new.demo.example", "backend shop").await;
    check("a newly applied Ingress routes", ok, &mut failures);
    let before = leader(&demo.env).await.unwrap_or_default();
    let handed = match demo.controllers.iter().position(|c| c.name == before) {
        Some(i) => {
            demo.controllers[i].kill9().await;
            within(Duration::from_secs(30), || async {
                leader(&demo.env).await.is_some_and(|l| l != before)
            })
            .await
        }
        None => false,
    };
    check(
        "killing the leader hands over to the other replica",
        handed,
        &mut failures,
    );
    demo.env
        .ingress("later", "later.demo.example", "blog")
        .await;
    let mut ok = true;
    for agent in &demo.agents {
        ok &= routes(agent, "later.demo.example", "backend blog").await;
    }
    check(
        "a change after the handover still routes",
        ok,
        &mut failures,
    );
    let refused: Vec<String> = demo
        .controllers
        .iter()
        .flat_map(|c| {
            forbidden(&c.logs())
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    check(
        "deploy/rbac.yaml's ServiceAccount was never refused (no 403)",
        refused.is_empty(),
        &mut failures,
    );
    failures
}

async fn interactive(demo: &RealDemo) {
    use tokio::signal::unix::{SignalKind, signal};
    let kubeconfig = demo.env.api.admin_kubeconfig().unwrap_or_default();
    println!(
        "HAPTIC on a real kube-apiserver v1.34 + etcd (no cluster nodes)\n\
         admin:   kubectl --kubeconfig {k} get ingresses,leases -A\n\
         the controllers' namespace: {ns} (ServiceAccount haptic-controller, deploy/rbac.yaml)\n\
         the app namespace:          {apps}",
        k = kubeconfig.display(),
        ns = demo.env.ns,
        apps = demo.env.apps,
    );
    for agent in &demo.agents {
        for (host, _) in HOSTS {
            println!(
                "try:     curl -H 'Host: {host}' http://{}:{}/",
                agent.ip, agent.http_port
            );
        }
    }
    println!("Ctrl-C stops everything.");
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Runs the real-server demo; `smoke` checks and exits.
pub(crate) async fn run(smoke_mode: bool) -> ExitCode {
    let mut demo = start().await;
    if !smoke_mode {
        interactive(&demo).await;
        return ExitCode::SUCCESS;
    }
    let failures = smoke(&mut demo).await;
    if failures.is_empty() {
        println!("demo smoke (real API server): all checks passed");
        ExitCode::SUCCESS
    } else {
        println!(
            "demo smoke (real API server): {} check(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
        for c in &demo.controllers {
            eprintln!("--- {} log (tail)\n{}", c.name, crate::tail(&c.logs(), 40));
        }
        ExitCode::FAILURE
    }
}
