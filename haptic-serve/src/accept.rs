//! The accept loop: at most `max_connections` connections served at once (one more is closed
//! at once), each given `header_read_timeout` for its TLS handshake and for every request's
//! headers (also the idle limit of a kept-alive connection), served by hyper's HTTP/1.1; on
//! shutdown it stops accepting, asks each connection to finish its request, and waits at most
//! `drain`.

use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, warn};

/// The listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most connections served at once (default 256); one more is closed at once.
    pub max_connections: usize,
    /// Limit for the TLS handshake, for a request's headers, and for the idle time between
    /// requests of a kept-alive connection (default 15 s).
    pub header_read_timeout: Duration,
    /// How long requests in flight may take to finish after the shutdown (default 30 s).
    pub drain: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_read_timeout: Duration::from_secs(15),
            drain: Duration::from_secs(30),
        }
    }
}

/// Accepts connections on `listener` until `shutdown`, serving `app` over TLS when `tls` is
/// given, within `limits`; returns once the connections in flight finished (or the drain
/// period ran out).
pub async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, for instance: back off rather than spin.
                    warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(%peer, "connection cap reached; closing the new connection");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let (shutdown, tls) = (shutdown.clone(), tls.clone());
        let deadline = limits.header_read_timeout;
        connections.spawn(async move {
            let _slot = slot;
            let served = match tls {
                None => serve_connection(stream, service, deadline, shutdown).await,
                Some(tls) => match tokio::time::timeout(deadline, tls.accept(stream)).await {
                    Ok(Ok(stream)) => serve_connection(stream, service, deadline, shutdown).await,
                    Ok(Err(error)) => {
                        debug!(%peer, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            if let Err(error) = served {
                debug!(%peer, %error, "connection ended");
            }
        });
    }
    connections.close();
    if tokio::time::timeout(limits.drain, connections.wait())
        .await
        .is_err()
    {
        warn!(drain = ?limits.drain, "requests still in flight after the drain period; closing");
    }
}

/// Serves one connection with hyper until it ends, or gracefully once `shutdown` fires.
async fn serve_connection<S>(
    stream: S,
    service: hyper_util::service::TowerToHyperService<Router>,
    header_read_timeout: Duration,
    shutdown: CancellationToken,
) -> Result<(), hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        served = connection.as_mut() => served,
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn the_connection_cap_closes_the_next_connection_and_shutdown_drains() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let shutdown = CancellationToken::new();
        let limits = Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(5),
            drain: Duration::from_secs(5),
        };
        let server = tokio::spawn(serve(listener, None, app, limits, shutdown.clone()));
        // The first connection holds the only slot (it has sent nothing yet).
        let held = tokio::net::TcpStream::connect(addr).await.expect("first");
        // Give the loop the first before the second: await its slot being taken (bounded).
        let mut second = loop {
            let mut probe = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let mut byte = [0u8; 1];
            // A closed connection reads EOF at once; an accepted one would wait for a request.
            match tokio::time::timeout(Duration::from_millis(200), probe.read(&mut byte)).await {
                Ok(Ok(0)) => break probe,
                _ => tokio::task::yield_now().await,
            }
        };
        let mut byte = [0u8; 1];
        assert_eq!(
            second.read(&mut byte).await.expect("read"),
            0,
            "closed at once"
        );
        // The held connection is served.
        let mut held = held;
        held.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut answer = String::new();
        held.read_to_string(&mut answer).await.expect("read");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("drains")
            .expect("no panic");
    }
}
