//! The accept loop: HTTP/1.1 connections under a cap, each with a deadline for its request head,
//! and a shutdown that stops accepting and lets running responses finish.
//!
//! axum's own `serve` sets no header deadline: a client that sends half a request line held its
//! connection (and a file handle) for ever, blocked shutdown, and 20,000 of them exhausted the
//! process's file limit, after which the store could not open its files. Here a connection beyond
//! the cap is answered 503 at once and closed, so the server never holds more than the cap; a head
//! not complete within the deadline ends its connection (hyper's `header_read_timeout`, which
//! also closes keep-alive connections idle that long); and an `accept` that fails for want of
//! file handles waits for some to free up instead of spinning.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// How connections are admitted.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections at most; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Seconds a client has to send a request's head (and an idle keep-alive connection lasts).
    pub header_timeout: Duration,
}

/// The body of the 503 a connection beyond the cap gets, OpenAI-shaped.
const BUSY: &str =
    r#"{"error":{"message":"the server has too many open connections; retry later","type":"server_error","param":null,"code":null}}"#;

/// Serves `router` on `listener` until `shutdown` resolves, then waits for the connections that
/// are still answering.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Closed when shutdown begins: each connection then finishes its current response and ends.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, _) = match accepted {
            Ok(a) => a,
            Err(e) if out_of_file_handles(&e) => {
                tracing::warn!(error = %e, "cannot accept a connection: the process has no file handle left; waiting for one to close");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            // Errors of one connection (reset before accept): nothing to do for the others.
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tokio::spawn(refuse_busy(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut stop = stop_rx.clone();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => log_connection_end(r),
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    log_connection_end(conn.await);
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a slot until it ends: all slots back means all connections ended.
    let _ = slots.acquire_many(limits.max_connections.max(1) as u32).await;
    Ok(())
}

/// A connection beyond the cap: a 503 written within a second, then closed.
async fn refuse_busy(mut stream: tokio::net::TcpStream) {
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{BUSY}",
        BUSY.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(response.as_bytes())).await;
    let _ = stream.shutdown().await;
}

fn log_connection_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        if e.is_timeout() {
            tracing::debug!("closed a connection whose request head did not arrive in time");
        } else {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    }
}

/// `EMFILE` (this process's limit) or `ENFILE` (the system's).
pub fn out_of_file_handles(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(23) | Some(24))
}
