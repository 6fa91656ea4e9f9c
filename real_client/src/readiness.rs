//! The readiness port: a TCP listener on `127.0.0.1:<port>` (by default the instance
//! port, where upstream's `mooncake_client` listens) that start scripts and Kubernetes
//! `tcpSocket` / `httpGet` probes can wait for. It serves no RPC: `GET /health` is
//! answered `200 OK`, any other request `404`, and a bare connection that sends nothing
//! is closed. Dummies keep reaching the real client only through its Unix socket and
//! its uid checks. Bounded like every HTTP server here ([`mooncake_core::http`]).

use std::sync::Arc;

use mooncake_core::http::{Request, Response, Router};

/// The probe's answer: `OK` on `GET /health`, nothing else.
pub fn router() -> Router {
    Arc::new(|request: Request| {
        Box::pin(async move {
            (request.method == "GET" && request.path == "/health")
                .then(|| Response::new(200, Some("text/plain"), "OK\n"))
        })
    })
}

/// Binds `127.0.0.1:port`. A busy port that was asked for (`--readiness_port`) is an
/// error; the default one is only warned about (probes of it then fail).
pub async fn bind(port: u16, asked: bool) -> std::io::Result<Option<tokio::net::TcpListener>> {
    if port == 0 {
        return Ok(None);
    }
    match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
        Ok(listener) => Ok(Some(listener)),
        Err(error) if !asked => {
            tracing::warn!(
                port,
                %error,
                "readiness port 127.0.0.1:{port} is busy: TCP readiness probes will fail; choose another with --readiness_port (0: none)"
            );
            Ok(None)
        }
        Err(error) => Err(error),
    }
}
