//! The master's HTTP endpoints on `--metrics_port`, with upstream's response formats:
//!
//! | path | answer |
//! |---|---|
//! | `/metrics` | Prometheus text |
//! | `/metrics/summary` | one line: `role=leader, state=serving, service_ready=true, master={Mem Storage: ... }` |
//! | `/health` | `{"status":"ok","role":"leader","ha_state":"serving",...}` |
//! | `/get_all_segments` | each mounted segment's name on its own line (empty when none) |
//! | `/get_all_keys` | each readable key on its own line (`?tenant=` for another tenant) |
//! | `/query_key?key=K` | `{"success":true,"data":[replica, ...]}` or 404 `{"success":false,"error_code":-704,...}` |

use std::fmt::Write as _;
use std::sync::Arc;

use mooncake_core::error::ErrorCode;
use mooncake_core::http::{self, Request, Response, Router};
use mooncake_core::tenant::Tenant;
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation};

use super::MasterService;

/// Content type upstream gives its plain-text answers.
const TEXT: Option<&str> = Some("text/plain; version=0.0.4");

/// Content type of the JSON answers.
const JSON: Option<&str> = Some("application/json; charset=utf-8");

/// The router of the master's admin endpoints.
pub fn router(master: Arc<MasterService>) -> Router {
    Arc::new(move |request: Request| {
        let answer = (request.method == "GET")
            .then(|| route(&master, &request))
            .flatten();
        Box::pin(std::future::ready(answer))
    })
}

fn route(master: &MasterService, request: &Request) -> Option<Response> {
    Some(match request.path.as_str() {
        "/metrics" => {
            let text =
                http::stats_metrics("master", &master.stats()) + &master.rpc_metrics().render();
            Response::new(200, TEXT, text)
        }
        "/metrics/summary" => Response::new(200, TEXT, summary(master)),
        "/health" => Response::new(200, JSON, HEALTH),
        "/get_all_segments" => Response::new(200, TEXT, lines(segment_names(master))),
        "/get_all_keys" => match tenant(request) {
            Ok(tenant) => Response::new(200, TEXT, lines(keys_of(master, &tenant))),
            Err(response) => response,
        },
        "/query_key" => query_key(master, request),
        _ => return None,
    })
}

fn lines(items: Vec<String>) -> String {
    items.into_iter().fold(String::new(), |mut out, item| {
        out.push_str(&item);
        out.push('\n');
        out
    })
}

/// Upstream's answer for a serving leader, byte for byte.
const HEALTH: &str = r#"{"status":"ok","role":"leader","ha_state":"serving","service_ready":true,"leader_address":null,"view_version":null}"#;

/// Upstream's error body, fields in upstream's order.
fn error_body(code: ErrorCode) -> String {
    format!(
        r#"{{"success":false,"error_code":{},"error_message":"{}"}}"#,
        code.as_i32(),
        code.name()
    )
}

fn tenant(request: &Request) -> Result<Tenant, Response> {
    let name = request
        .param("tenant")
        .unwrap_or_else(|| mooncake_core::tenant::DEFAULT_TENANT.to_string());
    Tenant::new(&name).map_err(|_| Response::new(400, JSON, error_body(ErrorCode::INVALID_PARAMS)))
}

/// Names of the mounted segments, sorted.
fn segment_names(master: &MasterService) -> Vec<String> {
    let mut names: Vec<String> = master
        .stats()
        .segments
        .into_iter()
        .map(|s| s.name)
        .collect();
    names.sort();
    names
}

/// The readable keys of `tenant`, as the tenant wrote them, sorted.
fn keys_of(master: &MasterService, tenant: &Tenant) -> Vec<String> {
    let mut keys = Vec::new();
    for shard in master.shards.iter() {
        let shard = shard.lock();
        keys.extend(
            shard
                .iter()
                .filter(|(_, entry)| entry.is_readable())
                .filter_map(|(key, _)| tenant.unscope(key).map(str::to_string)),
        );
    }
    keys.sort();
    keys
}

fn query_key(master: &MasterService, request: &Request) -> Response {
    let tenant = match tenant(request) {
        Ok(tenant) => tenant,
        Err(response) => return response,
    };
    let key = request.param("key").unwrap_or_default();
    let result = if key.is_empty() {
        Err(ErrorCode::OBJECT_NOT_FOUND)
    } else {
        master.replica_descriptors(&tenant.scope(&key))
    };
    match result {
        Ok(replicas) => {
            let data: Vec<String> = replicas.iter().map(replica_json).collect();
            let body = format!(r#"{{"success":true,"data":[{}]}}"#, data.join(","));
            Response::new(200, JSON, body)
        }
        Err(code) => {
            let status = if code == ErrorCode::OBJECT_NOT_FOUND {
                404
            } else {
                400
            };
            Response::new(status, JSON, error_body(code))
        }
    }
}

/// A replica in upstream's field names; `buffer_address_` is the offset inside the
/// segment (upstream gives a virtual address in its owner's process).
fn replica_json(replica: &ReplicaDescriptor) -> String {
    let quoted = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into());
    match &replica.location {
        ReplicaLocation::Memory {
            offset, endpoint, ..
        } => format!(
            r#"{{"size_":{},"buffer_address_":{offset},"protocol_":"tcp","transport_endpoint_":{}}}"#,
            replica.size,
            quoted(endpoint)
        ),
        ReplicaLocation::Disk { endpoint, .. } => format!(
            r#"{{"object_size_":{},"transport_endpoint_":{}}}"#,
            replica.size,
            quoted(endpoint)
        ),
    }
}

/// Bytes as upstream prints them (`4.89 KB`, `64.00 MB`).
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    #[expect(clippy::cast_precision_loss, reason = "a human-readable figure")]
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// The `/metrics/summary` line, in upstream's layout, with the figures this master has.
fn summary(master: &MasterService) -> String {
    let stats = master.stats();
    let (used, capacity) = stats
        .segments
        .iter()
        .fold((0u64, 0u64), |(u, c), s| (u + s.used, c + s.capacity));
    let now = master.clock.now();
    let soft_pinned: usize = master
        .shards
        .iter()
        .map(|s| s.lock().values().filter(|e| e.is_soft_pinned(now)).count())
        .sum();
    let mut out = format!(
        "role=leader, state=serving, service_ready=true, master={{Mem Storage: {} / {}",
        human(used),
        human(capacity)
    );
    if capacity > 0 {
        #[expect(clippy::cast_precision_loss, reason = "a percentage for humans")]
        let percent = used as f64 * 100.0 / capacity as f64;
        let _ = write!(out, " ({percent:.1}%)");
    }
    let _ = write!(
        out,
        " | SSD Storage: {} objects | Keys: {} (soft-pinned: {soft_pinned}) | Clients: {} | Segments: {} | Writes in progress: {} | Eviction: keys={}}}",
        stats.objects_on_disk,
        stats.objects,
        stats.clients,
        stats.segments.len(),
        stats.writes_in_progress,
        stats.evicted_objects
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Clock, MasterConfig};
    use mooncake_core::types::ReplicateConfig;

    fn get(master: &Arc<MasterService>, target: &str) -> Response {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let request = Request {
            method: "GET".into(),
            path: path.into(),
            query: query.into(),
            body: Vec::new(),
        };
        route(master, &request).unwrap_or_else(Response::not_found)
    }

    fn body(response: &Response) -> String {
        String::from_utf8_lossy(&response.body).into_owned()
    }

    #[test]
    fn formats() {
        let master = Arc::new(MasterService::new(MasterConfig::default(), Clock::System));
        assert_eq!(body(&get(&master, "/get_all_segments")), "");
        assert_eq!(body(&get(&master, "/get_all_keys")), "");
        let missing = get(&master, "/query_key?key=nope");
        assert_eq!(missing.status, 404);
        assert_eq!(
            body(&missing),
            r#"{"success":false,"error_code":-704,"error_message":"OBJECT_NOT_FOUND"}"#
        );
        master
            .mount_segment(
                "127.0.0.1:50052",
                1 << 20,
                crate::LOCAL_OWNER,
                "127.0.0.1:9",
            )
            .expect("mount");
        for key in ["a b", "k1"] {
            let started = master
                .put_start(key, 11, &ReplicateConfig::default())
                .expect("put");
            master.put_end(key, started.write_id).expect("end");
        }
        assert_eq!(
            body(&get(&master, "/get_all_segments")),
            "127.0.0.1:50052\n"
        );
        assert_eq!(body(&get(&master, "/get_all_keys")), "a b\nk1\n");
        let found = get(&master, "/query_key?key=a%20b");
        assert_eq!(found.status, 200, "{}", body(&found));
        let json: serde_json::Value = serde_json::from_slice(&found.body).expect("json");
        assert_eq!(json["success"], true);
        assert_eq!(json["data"][0]["size_"], 11);
        assert_eq!(json["data"][0]["transport_endpoint_"], "127.0.0.1:9");
        assert!(
            body(&get(&master, "/metrics/summary")).starts_with(
                "role=leader, state=serving, service_ready=true, master={Mem Storage: "
            )
        );
        assert_eq!(get(&master, "/health").status, 200);
        assert_eq!(get(&master, "/get_all_keys?tenant=bad%00").status, 400);
        assert_eq!(get(&master, "/nothing").status, 404);
    }
}
