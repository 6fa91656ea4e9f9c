//! A minimal HTTP/1.1 server for the metrics/admin endpoints and upstream's HTTP
//! metadata store.
//!
//! One request per connection (`connection: close`). Requests are bounded: 8 KiB of
//! request line and headers, [`MAX_BODY`] of body (larger: 413), 5 s to arrive; a
//! chunked body is refused (411), anything malformed gets 400; at most
//! [`MAX_CONNECTIONS`] connections are served at once (more are closed at once). A
//! connection that sends nothing (a bare TCP probe) is closed. Nothing a peer sends can
//! make it panic or grow without bound.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::master_api::MasterStats;

/// Longest request line plus headers.
pub const MAX_HEAD: usize = 8 * 1024;

/// Longest request body (a metadata value).
pub const MAX_BODY: usize = 1 << 20;

/// Connections served at once by one server; further ones are closed unanswered.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A parsed request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `PUT`, ...
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The raw query string (after `?`), possibly empty.
    pub query: String,
    /// The body (empty without `content-length`).
    pub body: Vec<u8>,
}

impl Request {
    /// The first value of query parameter `name`, percent-decoded (`%XX`; a `+` stays
    /// a `+`), or `None` when absent or not valid UTF-8 after decoding.
    pub fn param(&self, name: &str) -> Option<String> {
        self.query
            .split('&')
            .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
            .find(|(key, _)| *key == name)
            .and_then(|(_, value)| percent_decode(value))
    }
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&byte) = bytes.get(i) {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (byte, hex) {
            (b'%', Some(decoded)) => {
                out.push(decoded);
                i += 3;
            }
            _ => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// A response: status code, content type (none: no header) and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `content-type`, if any.
    pub content_type: Option<&'static str>,
    /// Body.
    pub body: Vec<u8>,
}

impl Response {
    /// A response with this body.
    pub fn new(status: u16, content_type: Option<&'static str>, body: impl Into<Vec<u8>>) -> Self {
        Response {
            status,
            content_type,
            body: body.into(),
        }
    }

    /// 404 with upstream's body.
    pub fn not_found() -> Self {
        Response::new(404, None, "404 Not Found")
    }
}

/// Answers a request (`None` for 404); may wait, e.g. for the master.
pub type Router =
    Arc<dyn Fn(Request) -> futures::future::BoxFuture<'static, Option<Response>> + Send + Sync>;

/// Serves `router` on `address` until the task is dropped or aborted; a port that
/// cannot be bound is logged and the task ends.
pub async fn serve(address: SocketAddr, router: Router) {
    match TcpListener::bind(address).await {
        Ok(listener) => serve_listener(listener, router).await,
        Err(error) => tracing::warn!(%address, %error, "metrics HTTP server not started"),
    }
}

/// Serves `router` on a bound listener until the task is dropped or aborted.
pub async fn serve_listener(listener: TcpListener, router: Router) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            continue; // dropped: closed unanswered
        };
        let router = Arc::clone(&router);
        tokio::spawn(async move {
            answer(stream, router).await;
            drop(slot);
        });
    }
}

async fn answer(mut stream: TcpStream, router: Router) {
    let response = match tokio::time::timeout(READ_TIMEOUT, read_request(&mut stream)).await {
        Ok(Ok(request)) => router(request).await.unwrap_or_else(Response::not_found),
        Ok(Err(ReadError::Answer(response))) => response,
        Ok(Err(ReadError::Nothing)) | Err(_) => return,
    };
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        response.status,
        reason(response.status)
    );
    if let Some(content_type) = response.content_type {
        let _ = write!(head, "content-type: {content_type}\r\n");
    }
    let _ = write!(
        head,
        "content-length: {}\r\nconnection: close\r\n\r\n",
        response.body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(&response.body).await;
    let _ = stream.shutdown().await;
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Payload Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

fn bad(status: u16, text: &str) -> Response {
    Response::new(status, Some("text/plain"), format!("{text}\n"))
}

/// Why no request was read.
enum ReadError {
    /// The peer closed without sending a byte.
    Nothing,
    /// The response to send instead.
    Answer(Response),
}

impl From<Response> for ReadError {
    fn from(response: Response) -> Self {
        ReadError::Answer(response)
    }
}

/// Reads one request; an error says what to answer instead, if anything.
async fn read_request(stream: &mut TcpStream) -> Result<Request, ReadError> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut filled = 0;
    let head_end = loop {
        if let Some(end) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        if filled == buf.len() {
            return Err(bad(400, "request headers too large").into());
        }
        let n = stream
            .read(&mut buf[filled..])
            .await
            .map_err(|_| bad(400, "bad request"))?;
        if n == 0 && filled == 0 {
            return Err(ReadError::Nothing);
        }
        if n == 0 {
            return Err(bad(400, "bad request").into());
        }
        filled += n;
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad(400, "bad request"))?;
    let mut request = parse_head(head)?;
    let length = content_length(head)?;
    if header(head, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
        let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await;
    }
    let mut body = buf.get(head_end + 4..filled).unwrap_or_default().to_vec();
    body.truncate(length);
    let start = body.len();
    body.resize(length, 0);
    stream
        .read_exact(&mut body[start..])
        .await
        .map_err(|_| bad(400, "body shorter than content-length"))?;
    request.body = body;
    Ok(request)
}

fn parse_head(head: &str) -> Result<Request, Response> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad(400, "bad request"));
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(bad(400, "bad request"));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    Ok(Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        body: Vec::new(),
    })
}

/// The value of header `name` (case-insensitive), trimmed.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

fn content_length(head: &str) -> Result<usize, Response> {
    if header(head, "transfer-encoding").is_some() {
        return Err(bad(
            411,
            "chunked bodies are not accepted; send content-length",
        ));
    }
    let Some(value) = header(head, "content-length") else {
        return Ok(0);
    };
    let length: usize = value.parse().map_err(|_| bad(400, "bad content-length"))?;
    if length > MAX_BODY {
        return Err(bad(413, &format!("body larger than {MAX_BODY} bytes")));
    }
    Ok(length)
}

/// `text` as a Prometheus label value: backslash, double quote and line feed escaped
/// (a segment name comes from a node and must not break or forge lines of the output).
fn label_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
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
    gauge(
        "reserved_writes",
        "Space real clients reserved ahead of their keys (writes started under a reserved name).",
        stats.reserved_writes,
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
        "# HELP mooncake_{prefix}_maintenance_rounds_total Maintenance passes (eviction, expiry, timeouts) run since start.\n# TYPE mooncake_{prefix}_maintenance_rounds_total counter\nmooncake_{prefix}_maintenance_rounds_total {}",
        stats.maintenance_rounds
    );
    let _ = writeln!(
        out,
        "# HELP mooncake_{prefix}_segment_used_bytes Bytes allocated per segment.\n# TYPE mooncake_{prefix}_segment_used_bytes gauge"
    );
    for s in &stats.segments {
        let _ = writeln!(
            out,
            "mooncake_{prefix}_segment_used_bytes{{segment=\"{}\"}} {}",
            label_value(&s.name),
            s.used
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
            label_value(&s.name),
            s.capacity
        );
    }
    out
}

#[cfg(test)]
mod label_tests {
    use super::*;
    use crate::master_api::SegmentUsage;

    #[test]
    fn segment_names_cannot_break_or_forge_metric_lines() {
        let stats = MasterStats {
            segments: vec![SegmentUsage {
                id: 1,
                name: "evil\"} 1\nmooncake_master_capacity_bytes 0\n\\".into(),
                capacity: 10,
                used: 5,
                endpoint: String::new(),
            }],
            ..MasterStats::default()
        };
        let text = stats_metrics("master", &stats);
        assert!(
            text.contains(
                "mooncake_master_segment_used_bytes{segment=\"evil\\\"} 1\\nmooncake_master_capacity_bytes 0\\n\\\\\"} 5\n"
            ),
            "{text}"
        );
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("mooncake_master_capacity_bytes "))
                .count(),
            1,
            "no forged line"
        );
    }
}
