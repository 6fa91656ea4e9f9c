//! A minimal HTTP/1.1 server for `/metrics` (Prometheus text), `/health` and `/status`.
//!
//! Only `GET` of a fixed set of paths is served, one request per connection; anything
//! else gets 404 or 400. Requests are bounded (8 KiB of headers, 5 s to arrive).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::master::{MasterService, MasterStats};

/// A response: status code, content type, body.
pub type Response = (u16, &'static str, String);

/// Answers a path (`None` for 404); may wait, e.g. for the master.
pub type Router =
    Arc<dyn Fn(String) -> futures::future::BoxFuture<'static, Option<Response>> + Send + Sync>;

/// Serves `router` on `address` until the task is dropped or aborted.
pub async fn serve(address: SocketAddr, router: Router) {
    let listener = match TcpListener::bind(address).await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::warn!(%address, %error, "metrics HTTP server not started");
            return;
        }
    };
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let router = Arc::clone(&router);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut filled = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while filled < buf.len() {
                    let n = stream.read(&mut buf[filled..]).await?;
                    if n == 0 {
                        break;
                    }
                    filled += n;
                    if buf[..filled].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let request = String::from_utf8_lossy(&buf[..filled]);
            let mut parts = request.split_whitespace();
            let (status, content_type, body) = match (parts.next(), parts.next()) {
                (Some("GET"), Some(path)) => {
                    let path = path.split('?').next().unwrap_or(path);
                    router(path.to_string()).await.unwrap_or((
                        404,
                        "text/plain",
                        "not found\n".into(),
                    ))
                }
                _ => (400, "text/plain", "bad request\n".into()),
            };
            let reason = match status {
                200 => "OK",
                404 => "Not Found",
                503 => "Service Unavailable",
                _ => "Bad Request",
            };
            let head = format!(
                "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
        });
    }
}

/// Prometheus text for master statistics (`prefix` names the process: `master`, `client`).
pub fn stats_metrics(prefix: &str, stats: &MasterStats) -> String {
    let mut out = String::new();
    let (used, capacity) = stats
        .segments
        .iter()
        .fold((0u64, 0u64), |(u, c), s| (u + s.used, c + s.capacity));
    let mut gauge = |name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP mooncake_{prefix}_{name} {help}\n# TYPE mooncake_{prefix}_{name} gauge\nmooncake_{prefix}_{name} {value}"
        );
    };
    gauge("objects", "Readable objects.", stats.objects);
    gauge(
        "objects_on_disk",
        "Objects with a copy on a real client's SSD tier.",
        stats.objects_on_disk,
    );
    gauge(
        "writes_in_progress",
        "Writes started and not finished.",
        stats.writes_in_progress,
    );
    gauge("segments", "Mounted segments.", stats.segments.len() as u64);
    gauge(
        "clients",
        "Real clients heartbeating to this master.",
        stats.clients,
    );
    gauge("allocated_bytes", "Bytes allocated in all segments.", used);
    gauge("capacity_bytes", "Bytes of all segments.", capacity);
    let _ = writeln!(
        out,
        "# HELP mooncake_{prefix}_evicted_objects_total Objects evicted since start.\n# TYPE mooncake_{prefix}_evicted_objects_total counter\nmooncake_{prefix}_evicted_objects_total {}",
        stats.evicted_objects
    );
    let _ = writeln!(
        out,
        "# HELP mooncake_{prefix}_segment_used_bytes Bytes allocated per segment.\n# TYPE mooncake_{prefix}_segment_used_bytes gauge"
    );
    for s in &stats.segments {
        let _ = writeln!(
            out,
            "mooncake_{prefix}_segment_used_bytes{{segment=\"{}\"}} {}",
            s.name, s.used
        );
    }
    let _ = writeln!(
        out,
        "# HELP mooncake_{prefix}_segment_capacity_bytes Bytes per segment.\n# TYPE mooncake_{prefix}_segment_capacity_bytes gauge"
    );
    for s in &stats.segments {
        let _ = writeln!(
            out,
            "mooncake_{prefix}_segment_capacity_bytes{{segment=\"{}\"}} {}",
            s.name, s.capacity
        );
    }
    out
}

/// Serves the master's `/metrics` and `/health`.
pub async fn serve_master_metrics(address: SocketAddr, master: Arc<MasterService>) {
    let router: Router = Arc::new(move |path| {
        let answer = match path.as_str() {
            "/metrics" => Some((
                200,
                "text/plain; version=0.0.4",
                stats_metrics("master", &master.stats()) + &master.rpc_metrics().render(),
            )),
            "/health" => Some((200, "text/plain", "ok\n".to_string())),
            _ => None,
        };
        Box::pin(std::future::ready(answer))
    });
    serve(address, router).await;
}
