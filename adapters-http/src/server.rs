//! Serving a router with the bounds a public listener needs, which `axum::serve` does not set.
//!
//! `axum::serve` runs hyper without a timer: a client that sends half a request header keeps its connection
//! (and its file descriptor) for ever, and nothing bounds how many connections are open. Hundreds of such
//! clients exhaust the descriptors, and with them new database connections. Here:
//!
//! - **header-read timeout** (hyper's, with a timer): a request head not complete within it closes the
//!   connection; it also bounds how long a keep-alive connection may sit idle waiting for its next request;
//! - **body-read timeout** (`tower_http`'s `RequestBodyTimeoutLayer`): a body not read within it fails the
//!   request before anything runs (the idempotency layer reads the whole body before it claims a key, so
//!   nothing is stored and the key stays free);
//! - **connection limit**: at most `max_connections` at once; further clients wait in the listen backlog;
//! - **graceful shutdown**: on cancel the listener closes and open connections finish their requests.
//!
//! - **request timeout**: a request not answered within it gets `503` (`outcome-unknown`) and its handler
//!   is dropped: its transaction rolls back unless its COMMIT was already under way, so the outcome is
//!   unknown and the client retries with the same `Idempotency-Key` (replayed if it committed). This is
//!   the bound on a request whose database connection was black-holed mid-statement (a failover without
//!   RST): without it the request, and its pool slot, would wait for the kernel (~15 min).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Most bytes of a request head (and of the connection's read buffer): a legitimate head — an API key, an
/// `Idempotency-Key` of at most 255 characters, a `traceparent`, the usual headers — is far below it.
/// hyper's default (~400 KB) let each unauthenticated connection buffer that much for the whole header
/// timeout: 300 connections took the service from 28 to 140 MiB (issue 38.5).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header fields of a request.
pub const MAX_HEADERS: usize = 64;

/// The bounds of a listener.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Longest time to receive a request head (and longest idle time of a keep-alive connection).
    pub header_read_timeout: Duration,
    /// Longest wait for the first byte of a new connection (at most the header timeout): a socket that
    /// opens and sends nothing holds a connection slot only this long.
    pub first_byte_timeout: Duration,
    /// Longest time to receive a request body.
    pub body_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest time from a complete request head to the response.
    pub request_timeout: Duration,
}

impl Default for ServerLimits {
    /// 3 s for a first byte, 10 s for a head and for a body, 30 s for a response, 1,024 connections.
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(3),
            body_read_timeout: Duration::from_secs(10),
            max_connections: 1024,
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` is cancelled, then lets open connections
/// finish (the caller bounds how long it waits for that).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let router = router
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(limits.body_read_timeout))
        .layer(axum::middleware::from_fn_with_state(limits.request_timeout, answer_within));
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // out of descriptors and the like: wait a moment rather than spin
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (watcher, router) = (graceful.watcher(), router.clone());
        let first_byte = limits.first_byte_timeout.min(limits.header_read_timeout);
        tokio::spawn(async move {
            // a socket that sends nothing is closed after the first-byte bound, not the whole head's
            let mut first = [0u8; 1];
            if !matches!(tokio::time::timeout(first_byte, stream.peek(&mut first)).await, Ok(Ok(1..))) {
                drop(permit);
                return;
            }
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(MAX_HEAD_BYTES)
                .max_headers(MAX_HEADERS)
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers `503 outcome-unknown` when the rest of the stack has not answered within `limit` (the handler
/// is dropped: see the module docs).
async fn answer_within(
    axum::extract::State(limit): axum::extract::State<Duration>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(limit = ?limit, "request not answered in time: dropped (rolled back unless its commit was under way)");
            crate::problem::Problem::new(
                crate::problem::ProblemKind::OutcomeUnknown,
                http::StatusCode::SERVICE_UNAVAILABLE,
            )
            .detail(format!(
                "the request was not answered within {} ms; retry with the same Idempotency-Key",
                limit.as_millis()
            ))
            .into_response()
        }
    }
}
