//! The one kubelet API the process kubelet serves: `GET /containerLogs/NS/POD/CONTAINER`
//! (`tailLines`, `previous`), over HTTPS with a certificate of its own, on the bridge address.
//! kube-apiserver proxies `kubectl logs` here (it reaches the Node by its InternalIP and, given
//! no kubelet CA, does not verify the certificate, as on a kubeadm cluster). Only a client
//! certificate from the cluster's CA is served (the API server's `kubelet-client`): a Pod on
//! the bridge reads no other Pod's logs. `follow` answers what is there and ends.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject as _};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::net;

/// Binds the bridge address on a port the OS picks; returns the listener, its port and the
/// TLS acceptor (a self-signed certificate for the bridge address).
pub(crate) async fn bind(state: &std::path::Path) -> Result<(TcpListener, u16, TlsAcceptor)> {
    let listener = TcpListener::bind((net::BRIDGE_IP, 0))
        .await
        .context("binding the kubelet port")?;
    let port = listener.local_addr()?.port();
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec![net::BRIDGE_IP.to_owned()])?.self_signed(&key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(state.join("ca.crt"))? {
        roots.add(ca?)?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    Ok((listener, port, TlsAcceptor::from(Arc::new(config))))
}

/// Serves until `token` is cancelled.
pub(crate) async fn serve(
    state: PathBuf,
    listener: TcpListener,
    acceptor: TlsAcceptor,
    token: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = token.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else { continue };
        let (acceptor, state) = (acceptor.clone(), state.clone());
        // Each connection is short and bounded; the listener's loop owns none of them.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), async move {
                let mut tls = acceptor.accept(stream).await?;
                let mut head = Vec::new();
                let mut buf = [0u8; 2048];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
                    let n = tls.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    head.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let target = text.split_whitespace().nth(1).unwrap_or("/").to_owned();
                debug!(%target, "kubelet request");
                let (status, body) = answer(&state, &target);
                let response = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                tls.write_all(response.as_bytes()).await?;
                tls.write_all(&body).await?;
                tls.shutdown().await?;
                anyhow::Ok(())
            })
            .await;
        });
    }
}

fn answer(state: &std::path::Path, target: &str) -> (&'static str, Vec<u8>) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let ["containerLogs", ns, pod, container] = parts.as_slice() else {
        return (
            "404 Not Found",
            b"the process kubelet serves /containerLogs only\n".to_vec(),
        );
    };
    let param = |name: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    let prefix = format!("{ns}_{pod}_");
    let dir = std::fs::read_dir(state.join("pods"))
        .ok()
        .and_then(|entries| {
            entries
                .flatten()
                .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .map(|e| e.path())
        });
    let Some(dir) = dir else {
        return (
            "404 Not Found",
            format!("pod {ns}/{pod} is not running here\n").into_bytes(),
        );
    };
    let name = if param("previous").as_deref() == Some("true") {
        format!("{container}.log.prev")
    } else {
        format!("{container}.log")
    };
    let Ok(bytes) = std::fs::read(dir.join(&name)) else {
        return (
            "404 Not Found",
            format!("no log for container {container} of {ns}/{pod}\n").into_bytes(),
        );
    };
    match param("tailLines").and_then(|n| n.parse::<usize>().ok()) {
        Some(n) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let mut tail = lines[lines.len().saturating_sub(n)..].join("\n");
            tail.push('\n');
            ("200 OK", tail.into_bytes())
        }
        None => ("200 OK", bytes),
    }
}
