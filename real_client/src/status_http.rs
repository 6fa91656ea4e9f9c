//! The real client's HTTP endpoints (`--enable_http_server`): `/health`, `/metrics`
//! (Prometheus text: operation counters plus the master's view) and `/status` (JSON).

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_core::http::{self, Request, Response, Router};

use crate::state::ServerState;

/// Serves the endpoints until the task is aborted.
pub async fn serve(address: SocketAddr, state: Arc<ServerState>) {
    let router: Router = Arc::new(move |request: Request| {
        let state = Arc::clone(&state);
        Box::pin(async move {
            if request.method != "GET" {
                return None;
            }
            let answer = |status, content_type, body: String| {
                Some(Response::new(status, Some(content_type), body))
            };
            match request.path.as_str() {
                "/health" => {
                    if state.store.master().is_reachable().await {
                        answer(200, "text/plain", "ok\n".to_string())
                    } else {
                        answer(503, "text/plain", "master unreachable\n".to_string())
                    }
                }
                "/metrics" => {
                    let status = state.status().await;
                    let mut text = state.metrics.render();
                    text.push_str(&http::stats_metrics("client", &status.master));
                    text.push_str(&format!(
                        "# HELP mooncake_client_dummies Attached dummy clients.\n# TYPE mooncake_client_dummies gauge\nmooncake_client_dummies {}\n# HELP mooncake_client_mapped_bytes Dummy shared memory mapped.\n# TYPE mooncake_client_mapped_bytes gauge\nmooncake_client_mapped_bytes {}\n",
                        status.dummies.len(),
                        status.mapped_bytes
                    ));
                    text.push_str(&format!(
                        "# HELP mooncake_client_read_cache_hits_total Reads that copied with the replica list of an earlier read, without asking the master (--read_cache_ms).\n# TYPE mooncake_client_read_cache_hits_total counter\nmooncake_client_read_cache_hits_total {}\n",
                        status.read_cache_hits
                    ));
                    text.push_str(&format!(
                        "# HELP mooncake_client_reserved_puts_total Puts completed into space reserved ahead of their keys (one master round trip).\n# TYPE mooncake_client_reserved_puts_total counter\nmooncake_client_reserved_puts_total {}\n",
                        status.reserved_puts
                    ));
                    if let Some(taken) = &status.taken_over {
                        text.push_str(&format!(
                            "# HELP mooncake_client_takeover_seconds How long this process took to take its node over from the one it replaced (--takeover).\n# TYPE mooncake_client_takeover_seconds gauge\nmooncake_client_takeover_seconds {}\n# HELP mooncake_client_takeover_objects Objects of the embedded master taken over.\n# TYPE mooncake_client_takeover_objects gauge\nmooncake_client_takeover_objects {}\n# HELP mooncake_client_takeover_segment_bytes Bytes of segment taken over (the same memory).\n# TYPE mooncake_client_takeover_segment_bytes gauge\nmooncake_client_takeover_segment_bytes {}\n",
                            taken.took_ms as f64 / 1000.0,
                            taken.objects,
                            taken.segment_bytes
                        ));
                    }
                    if let Some(file) = &state.store.segment().file {
                        text.push_str(&segment_file_metrics(file));
                    }
                    text.push_str(&mooncake_core::keep_awake::metrics("client"));
                    if let Some(disk) = state.store.disk() {
                        let (objects, copies) = disk.offload_counters();
                        text.push_str(&format!(
                            "# HELP mooncake_client_offload_objects_total Objects this node wrote to its SSD tier.\n# TYPE mooncake_client_offload_objects_total counter\nmooncake_client_offload_objects_total {objects}\n# HELP mooncake_client_offload_copies_total Objects whose bytes were copied into a buffer of the SSD tier's backend to write them (0 when they go straight from the segment).\n# TYPE mooncake_client_offload_copies_total counter\nmooncake_client_offload_copies_total {copies}\n"
                        ));
                    }
                    answer(200, "text/plain; version=0.0.4", text)
                }
                "/status" => {
                    let status = state.status().await;
                    let json = serde_json::to_string_pretty(&status)
                        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
                    answer(200, "application/json", json)
                }
                _ => None,
            }
        })
    });
    http::serve(address, router).await;
}

/// The segment file's figures (`--segment_path`): what the journal holds, and what a
/// restart recovered.
fn segment_file_metrics(file: &crate::segment_file::SegmentFile) -> String {
    let mut text = format!(
        "# HELP mooncake_client_segment_journal_objects Objects the segment file's journal records as committed (served again after a restart).\n# TYPE mooncake_client_segment_journal_objects gauge\nmooncake_client_segment_journal_objects {}\n# HELP mooncake_client_segment_journal_unrecorded_total Commits the full journal could not record (not served again after a restart).\n# TYPE mooncake_client_segment_journal_unrecorded_total counter\nmooncake_client_segment_journal_unrecorded_total {}\n",
        file.journaled_objects(),
        file.unrecorded_commits()
    );
    if let Some(recovered) = file.recovered() {
        text.push_str(&format!(
            "# HELP mooncake_client_restart_recovered_objects Objects found whole in the segment file at startup.\n# TYPE mooncake_client_restart_recovered_objects gauge\nmooncake_client_restart_recovered_objects {}\n# HELP mooncake_client_restart_recovered_bytes Their bytes.\n# TYPE mooncake_client_restart_recovered_bytes gauge\nmooncake_client_restart_recovered_bytes {}\n# HELP mooncake_client_restart_dropped_objects Objects of the journal dropped at startup (bytes changed since their record, or refused by the master).\n# TYPE mooncake_client_restart_dropped_objects gauge\nmooncake_client_restart_dropped_objects {}\n# HELP mooncake_client_restart_recovery_seconds How long checking and reinstalling them took.\n# TYPE mooncake_client_restart_recovery_seconds gauge\nmooncake_client_restart_recovery_seconds {}\n",
            recovered.objects,
            recovered.bytes,
            recovered.damaged + recovered.refused,
            recovered.elapsed.as_secs_f64()
        ));
    }
    text
}
