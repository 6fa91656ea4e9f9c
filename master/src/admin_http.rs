//! The master's HTTP endpoints on `--metrics_port`, with upstream's response formats:
//!
//! | path | answer |
//! |---|---|
//! | `/metrics` | Prometheus text |
//! | `/metrics/summary` | one line: `role=leader, state=serving, service_ready=true, master={Mem Storage: ... }` |
//! | `/health` | `{"status":"ok","role":"leader","ha_state":"serving",...}` (under high availability also the term, the leader followed, the standbys and the replication lag) |
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
use crate::ha::node::HaNode;

/// Content type upstream gives its plain-text answers.
const TEXT: Option<&str> = Some("text/plain; version=0.0.4");

/// Content type of the JSON answers.
const JSON: Option<&str> = Some("application/json; charset=utf-8");

/// The router of the master's admin endpoints.
pub fn router(master: Arc<MasterService>, ha: Option<Arc<HaNode>>) -> Router {
    Arc::new(move |request: Request| {
        let answer = (request.method == "GET")
            .then(|| route(&master, ha.as_deref(), &request))
            .flatten();
        Box::pin(std::future::ready(answer))
    })
}

fn route(master: &MasterService, ha: Option<&HaNode>, request: &Request) -> Option<Response> {
    Some(match request.path.as_str() {
        "/metrics" => {
            let mut text =
                http::stats_metrics("master", &master.stats()) + &master.rpc_metrics().render();
            text.push_str(&mooncake_core::keep_awake::metrics("master"));
            if let Some(node) = ha {
                text.push_str(&ha_metrics(node));
            }
            Response::new(200, TEXT, text)
        }
        "/metrics/summary" => Response::new(200, TEXT, summary(master)),
        "/health" => match ha {
            Some(node) => Response::new(200, JSON, ha_health(node)),
            None => Response::new(200, JSON, HEALTH),
        },
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

/// `/health` of a master under high availability: upstream's fields, then ours.
fn ha_health(node: &HaNode) -> String {
    let (role, epoch, following) = node.role();
    let leading = role == "leader";
    let leader = following.map_or_else(|| "null".to_string(), |a| format!("{a:?}"));
    let (lag, standbys) = match node.leading() {
        Ok(journal) => {
            let standbys = journal
                .standbys()
                .iter()
                .map(|(id, s)| {
                    format!(
                        r#"{{"id":"{id:032x}","address":{:?},"in_sync":{},"behind":{}}}"#,
                        s.address,
                        node.listed_in_sync(&journal, *id),
                        s.behind
                    )
                })
                .collect::<Vec<_>>()
                .join(",");
            (journal.lag(), standbys)
        }
        Err(_) => (
            node.counters
                .standby_lag
                .load(std::sync::atomic::Ordering::Relaxed),
            String::new(),
        ),
    };
    format!(
        r#"{{"status":"ok","role":"{role}","ha_state":"{}","service_ready":{leading},"leader_address":{leader},"view_version":{epoch},"replication_lag":{lag},"standbys":[{standbys}]}}"#,
        if leading { "serving" } else { "standby" },
    )
}

/// The `mooncake_master_ha_*` metrics.
fn ha_metrics(node: &HaNode) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let (role, epoch, _) = node.role();
    let counters = &node.counters;
    let (lag, in_sync) = match node.leading() {
        Ok(journal) => (
            journal.lag(),
            journal
                .standbys()
                .iter()
                .filter(|(id, _)| node.listed_in_sync(&journal, *id))
                .count() as u64,
        ),
        Err(_) => (counters.standby_lag.load(Relaxed), 0),
    };
    let mut out = String::new();
    for (name, help, value) in [
        (
            "leader",
            "1 while this master leads",
            u64::from(role == "leader"),
        ),
        ("epoch", "term of the leader (led or followed)", epoch),
        (
            "terms_led_total",
            "times this master became the leader",
            counters.terms_led.load(Relaxed),
        ),
        (
            "replication_lag_changes",
            "changes the slowest standby lacks (standby: that it lacked at its last pull)",
            lag,
        ),
        (
            "in_sync_standbys",
            "standbys whose acknowledgement writes wait for",
            in_sync,
        ),
        (
            "standbys_dropped_total",
            "standbys dropped from the in-sync set for not acknowledging in time",
            counters.standbys_dropped.load(Relaxed),
        ),
        (
            "snapshots_served_total",
            "snapshots taken for standbys",
            counters.snapshots_served.load(Relaxed),
        ),
        (
            "snapshots_installed_total",
            "leader snapshots installed while standing by",
            counters.snapshots_installed.load(Relaxed),
        ),
        (
            "last_snapshot_bytes",
            "size of the last snapshot taken or installed",
            counters.last_snapshot_bytes.load(Relaxed),
        ),
        (
            "changes_applied_total",
            "leader changes applied while standing by",
            counters.changes_applied.load(Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP mooncake_master_ha_{name} {help}");
        let _ = writeln!(out, "mooncake_master_ha_{name} {value}");
    }
    out
}

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
        route(master, None, &request).unwrap_or_else(Response::not_found)
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
                0,
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
