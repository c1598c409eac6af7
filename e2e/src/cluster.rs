//! The kind cluster: created from `deploy/kind/cluster.yaml`, the images `deploy/` names built
//! and loaded under those very names, `deploy/` applied (the HAProxy Service then made the
//! NodePort the kind config publishes), a kube client on its kubeconfig; diagnostics and
//! deletion.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::{core::v1::Secret, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    api::{ListParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde::Deserialize;

use crate::{Options, cmd::Cmd};

/// The namespace `deploy/` installs into.
pub(crate) const NAMESPACE: &str = "haptic-system";

const MINUTE: Duration = Duration::from_secs(60);

/// A cluster that is up with HAPTIC installed.
pub(crate) struct Cluster {
    /// The kind cluster's name.
    pub(crate) name: String,
    /// Its kubeconfig (under `target/e2e/`; the user's own is never touched).
    pub(crate) kubeconfig: PathBuf,
    /// A client on it.
    pub(crate) client: Client,
    /// The agent image (the e2e's backends run its HAProxy).
    pub(crate) agent_image: String,
    /// The host port the HAProxy NodePort 30080 is published on (kind).
    pub(crate) http_port: u16,
    /// The local cluster: HAProxy is reached at a ready endpoint of its Service.
    pub(crate) local: bool,
    root: PathBuf,
}

/// An image `deploy/kustomization.yaml` names, and the Dockerfile that builds it.
#[derive(Debug)]
pub(crate) struct Image {
    /// `name:tag` as the kind cluster runs it.
    pub(crate) reference: String,
    /// `docker/<component>.Dockerfile`, relative to the root.
    pub(crate) dockerfile: String,
}

#[derive(Deserialize)]
struct Kustomization {
    #[serde(default)]
    images: Vec<ImageEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImageEntry {
    new_name: String,
    new_tag: String,
}

/// The images `deploy/` runs (`<registry>/haptic-<component>:<tag>`), each built from
/// `docker/<component>.Dockerfile`. The e2e builds them under these names and loads them into
/// kind, where a tag other than `latest` is never pulled.
pub(crate) fn images(root: &Path) -> Result<Vec<Image>> {
    let path = root.join("deploy/kustomization.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let kustomization: Kustomization =
        serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    kustomization
        .images
        .into_iter()
        .map(|entry| {
            let last = entry.new_name.rsplit('/').next().unwrap_or_default();
            let Some(component) = last.strip_prefix("haptic-") else {
                bail!(
                    "{}: image {} is not haptic-<component>",
                    path.display(),
                    entry.new_name
                );
            };
            Ok(Image {
                reference: format!("{}:{}", entry.new_name, entry.new_tag),
                dockerfile: format!("docker/{component}.Dockerfile"),
            })
        })
        .collect()
}

/// The host port `deploy/kind/cluster.yaml` maps the node's `container_port` to.
fn host_port(root: &Path, container_port: u16) -> Result<u16> {
    #[derive(Deserialize)]
    struct Config {
        nodes: Vec<Node>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Node {
        #[serde(default)]
        extra_port_mappings: Vec<Mapping>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Mapping {
        container_port: u16,
        host_port: u16,
    }
    let path = root.join("deploy/kind/cluster.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config: Config =
        serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    config
        .nodes
        .iter()
        .flat_map(|node| &node.extra_port_mappings)
        .find(|m| m.container_port == container_port)
        .map(|m| m.host_port)
        .with_context(|| format!("{}: no mapping of port {container_port}", path.display()))
}

impl Cluster {
    /// A fresh cluster (one of the same name is deleted first), images built and loaded,
    /// HAPTIC applied and rolled out.
    pub(crate) async fn up(options: &Options) -> Result<Self> {
        let root = options.root.clone();
        let images = images(&root)?;
        let agent_image = images
            .iter()
            .find(|image| image.dockerfile.ends_with("/agent.Dockerfile"))
            .map(|image| image.reference.clone())
            .context("deploy/kustomization.yaml names no haptic-agent image")?;
        let http_port = host_port(&root, 30080)?;
        let dir = root.join("target/e2e");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let kubeconfig = dir.join(format!("{}.kubeconfig", options.name));

        let clusters = Cmd::new("kind", &["get", "clusters"], MINUTE)
            .output()
            .await?;
        if clusters.lines().any(|line| line.trim() == options.name) {
            eprintln!("e2e: deleting the existing kind cluster `{}`", options.name);
            Cmd::new(
                "kind",
                &[
                    "delete",
                    "cluster",
                    "--name",
                    &options.name,
                    "--kubeconfig",
                    &kubeconfig.to_string_lossy(),
                ],
                5 * MINUTE,
            )
            .show()
            .await?;
        }
        if !options.skip_build {
            for image in &images {
                Cmd::new(
                    "docker",
                    &[
                        "build",
                        "-f",
                        &image.dockerfile,
                        "-t",
                        &image.reference,
                        ".",
                    ],
                    60 * MINUTE,
                )
                .in_dir(&root)
                .show()
                .await?;
            }
        }
        Cmd::new(
            "kind",
            &[
                "create",
                "cluster",
                "--name",
                &options.name,
                "--config",
                "deploy/kind/cluster.yaml",
                "--kubeconfig",
                &kubeconfig.to_string_lossy(),
                "--wait",
                "180s",
            ],
            10 * MINUTE,
        )
        .in_dir(&root)
        .show()
        .await?;
        let mut load = vec!["load", "docker-image", "--name", &options.name];
        load.extend(images.iter().map(|image| image.reference.as_str()));
        Cmd::new("kind", &load, 15 * MINUTE).show().await?;

        let kc = Kubeconfig::read_from(&kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .context("using the kind kubeconfig")?;
        let client = Client::try_from(config).context("building the client")?;
        let cluster = Self {
            name: options.name.clone(),
            kubeconfig,
            client,
            agent_image,
            http_port,
            local: false,
            root,
        };
        cluster.install().await?;
        Ok(cluster)
    }

    /// The local cluster (`haptic-node`, already up and empty): `deploy/` applied as a user
    /// does. When this machine's open-file hard limit is below what `deploy/`'s maxconn needs
    /// (HAProxy refuses to start, `strict-limits`), an overlay in `target/` lowers maxconn, as
    /// deploy/README.md tells a user to, and says so.
    pub(crate) async fn local(options: &Options, kubeconfig: &Path) -> Result<Self> {
        let root = options.root.clone();
        let agent_image = images(&root)?
            .into_iter()
            .find(|image| image.dockerfile.ends_with("/agent.Dockerfile"))
            .map(|image| image.reference)
            .context("deploy/kustomization.yaml names no haptic-agent image")?;
        let kc = Kubeconfig::read_from(kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .context("using the local cluster's kubeconfig")?;
        let client = Client::try_from(config).context("building the client")?;
        let cluster = Self {
            name: "local".to_owned(),
            kubeconfig: kubeconfig.to_owned(),
            client,
            agent_image,
            http_port: 0,
            local: true,
            root,
        };
        let kustomization = match local_maxconn()? {
            None => "deploy/".to_owned(),
            Some(maxconn) => {
                let dir = cluster.root.join("target/local-cluster/e2e-overlay");
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                let overlay = format!(
                    "# written by haptic-e2e --local: deploy/ with maxconn lowered to this machine's nofile limit\n\
                     resources:\n  - ../../../deploy\n\
                     patches:\n  - target:\n      group: haproxy-haptic.org\n      kind: HAProxyTemplateConfig\n      name: haptic-config\n\
                     \x20   patch: |-\n      - op: replace\n        path: /spec/templatingSettings/extraContext/haproxy/maxconn\n        value: {maxconn}\n"
                );
                std::fs::write(dir.join("kustomization.yaml"), overlay)?;
                eprintln!(
                    "e2e: this machine's nofile hard limit is below what deploy/'s maxconn 10000 needs (20039 descriptors): \
                     applying deploy/ through an overlay with maxconn {maxconn} ({})",
                    dir.display()
                );
                dir.display().to_string()
            }
        };
        cluster.install_with(&kustomization, false).await?;
        Ok(cluster)
    }

    /// Where HAProxy's HTTP port answers: the kind port mapping, or (local) a ready endpoint
    /// of the `haproxy` Service's EndpointSlices, port `http`.
    pub(crate) async fn http_endpoint(&self) -> Result<(String, u16)> {
        if !self.local {
            return Ok(("127.0.0.1".to_owned(), self.http_port));
        }
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), NAMESPACE);
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=haproxy"))
            .await
            .context("listing the haproxy Service's EndpointSlices")?;
        for slice in list.items {
            let port = slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some("http"))
                .and_then(|p| p.port);
            let ready = slice
                .endpoints
                .iter()
                .find(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true));
            if let (Some(port), Some(endpoint)) = (port, ready)
                && let Some(address) = endpoint.addresses.first()
            {
                return Ok((address.clone(), u16::try_from(port)?));
            }
        }
        bail!("the haproxy Service has no ready endpoint")
    }

    /// `kubectl --kubeconfig <ours> <args>` from the root, bounded.
    pub(crate) fn kubectl(&self, args: &[&str], timeout: Duration) -> Cmd {
        let kubeconfig = self.kubeconfig.to_string_lossy().into_owned();
        let mut all = vec!["--kubeconfig", kubeconfig.as_str()];
        all.extend_from_slice(args);
        Cmd::new("kubectl", &all, timeout).in_dir(&self.root)
    }

    /// The CRD first (a custom resource in the same apply would find no mapping), the token
    /// Secret, then `deploy/`; the HAProxy Service becomes the NodePort (30080, 30443) that
    /// `deploy/kind/cluster.yaml` publishes; waits for both Deployments.
    async fn install(&self) -> Result<()> {
        self.install_with("deploy/", true).await
    }

    async fn install_with(&self, kustomization: &str, node_ports: bool) -> Result<()> {
        self.kubectl(&["apply", "-f", "deploy/crd.yaml"], MINUTE)
            .show()
            .await?;
        self.kubectl(
            &[
                "wait",
                "--for",
                "condition=Established",
                "crd/haproxytemplateconfigs.haproxy-haptic.org",
                "--timeout",
                "60s",
            ],
            90 * Duration::from_secs(1),
        )
        .show()
        .await?;
        self.kubectl(&["apply", "-f", "deploy/namespace.yaml"], MINUTE)
            .show()
            .await?;
        self.create_token().await?;
        // The agent channel's certificates: the controller's own CA (deploy/'s default).
        self.kubectl(&["apply", "-k", kustomization], 2 * MINUTE)
            .show()
            .await?;
        if node_ports {
            self.node_ports().await?;
        }
        for deployment in ["deployment/haptic-controller", "deployment/haproxy"] {
            self.kubectl(
                &[
                    "-n",
                    NAMESPACE,
                    "rollout",
                    "status",
                    deployment,
                    "--timeout",
                    "300s",
                ],
                6 * MINUTE,
            )
            .show()
            .await?;
        }
        Ok(())
    }

    async fn node_ports(&self) -> Result<()> {
        let node_ports = r#"{"spec":{"type":"NodePort","ports":[{"name":"http","port":80,"targetPort":"http","nodePort":30080},{"name":"https","port":443,"targetPort":"https","nodePort":30443}]}}"#;
        self.kubectl(
            &[
                "-n", NAMESPACE, "patch", "service", "haproxy", "--type", "merge", "-p", node_ports,
            ],
            MINUTE,
        )
        .show()
        .await?;
        Ok(())
    }

    /// The agent token Secret the controller and the agents share, as deploy/README.md says
    /// to create it: 32 random bytes, hex.
    async fn create_token(&self) -> Result<()> {
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .context("reading /dev/urandom")?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": { "name": "haptic-agent-token", "namespace": NAMESPACE },
            "type": "Opaque",
            "stringData": { "token": token },
        }))?;
        Api::<Secret>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &secret)
            .await
            .context("creating the agent token Secret")?;
        Ok(())
    }

    /// Prints what helps after a failure: pods, the Lease, the HTC status, recent logs.
    pub(crate) async fn diagnose(&self) {
        let requests: [&[&str]; 5] = [
            &[
                "get",
                "pods,leases,deployments",
                "-n",
                NAMESPACE,
                "-o",
                "wide",
            ],
            &["get", "pods,ingresses,services", "-n", "e2e", "-o", "wide"],
            &[
                "get",
                "haproxytemplateconfigs",
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={.items[*].status}",
            ],
            &[
                "logs",
                "-n",
                NAMESPACE,
                "-l",
                "app.kubernetes.io/name=haptic-controller",
                "--tail",
                "60",
                "--prefix",
            ],
            &[
                "logs",
                "-n",
                NAMESPACE,
                "-l",
                "app.kubernetes.io/name=haproxy",
                "--all-containers",
                "--tail",
                "30",
                "--prefix",
            ],
        ];
        for args in requests {
            match self.kubectl(args, Duration::from_secs(30)).output().await {
                Ok(out) => eprintln!("e2e: kubectl {}\n{out}", args.join(" ")),
                Err(error) => eprintln!("e2e: {error:#}"),
            }
        }
    }
}

/// The maxconn the local run lowers `deploy/`'s 10000 to when this process's open-file hard
/// limit is below the 20039 descriptors HAProxy 2.6 asks for it (about 2 per connection plus
/// a few), or `None` when `deploy/` fits as written.
fn local_maxconn() -> Result<Option<u32>> {
    let limits =
        std::fs::read_to_string("/proc/self/limits").context("reading /proc/self/limits")?;
    let hard = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse::<u64>().ok());
    Ok(match hard {
        // "unlimited" or plenty.
        None => None,
        Some(hard) if hard >= 20_100 => None,
        Some(hard) => Some(u32::try_from((hard.saturating_sub(600) / 2 / 100) * 100)?),
    })
}

impl Cluster {
    /// Deletes the cluster; a failure is printed, not returned.
    pub(crate) async fn delete(&self) {
        if let Err(error) = Cmd::new(
            "kind",
            &[
                "delete",
                "cluster",
                "--name",
                &self.name,
                "--kubeconfig",
                &self.kubeconfig.to_string_lossy(),
            ],
            5 * MINUTE,
        )
        .show()
        .await
        {
            eprintln!("e2e: {error:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root")
            .to_path_buf()
    }

    #[test]
    fn every_image_deploy_names_has_a_dockerfile() {
        let root = root();
        let images = images(&root).expect("images");
        assert_eq!(images.len(), 2, "{images:?}");
        for image in &images {
            assert!(
                root.join(&image.dockerfile).is_file(),
                "{} for {}",
                image.dockerfile,
                image.reference
            );
        }
    }

    #[test]
    fn the_kind_config_publishes_the_http_node_port() {
        assert_eq!(host_port(&root(), 30080).expect("mapped"), 8080);
        assert!(host_port(&root(), 1).is_err());
    }
}
