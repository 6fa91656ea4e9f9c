//! Heartbeats to a remote master, and remounting when it asks (it restarted).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use mooncake_core::master_api::ClientStatus;

use crate::state::ServerState;

/// Interval between heartbeats (well below the master's default `--client_ttl` of 10 s).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(1000);

/// Heartbeats until `shutdown`; on `NeedRemount` mounts the segment again; on
/// `Displaced` stops serving the segment (its name belongs to another instance now).
pub async fn heartbeat(
    state: Arc<ServerState>,
    client_id: u128,
    endpoint: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unreachable = false;
    let mut displaced = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = mooncake_core::process::stop_requested(&mut shutdown) => return,
        }
        let master = state.store.master();
        match master.heartbeat(client_id).await {
            Ok(ClientStatus::Ok) => {
                if unreachable {
                    tracing::info!("master reachable again");
                    unreachable = false;
                }
            }
            Ok(ClientStatus::Displaced) => {
                if !displaced {
                    displaced = true;
                    state.store.segment().id.store(0, Ordering::Release);
                    tracing::error!(
                        segment = %state.identity.segment_name,
                        "another mooncake_client mounted this node's segment name (this node restarted elsewhere, or two nodes share --host and --port): this instance no longer contributes memory; stop it, or give each node its own --host"
                    );
                }
            }
            Ok(ClientStatus::NeedRemount) if !state.store.segment().contributes => {}
            Ok(ClientStatus::NeedRemount) => {
                let segment = state.store.segment();
                let mounted = master.mount_segment(client_id, segment, &endpoint).await;
                match mounted {
                    Ok(id) => {
                        segment.id.store(id, Ordering::Release);
                        tracing::info!(segment = %state.identity.segment_name, id, "remounted the segment (the master restarted)");
                    }
                    Err(code) => tracing::warn!(%code, "remount failed; retrying"),
                }
            }
            Err(code) => {
                if !unreachable {
                    tracing::warn!(%code, "master unreachable; retrying every second");
                    unreachable = true;
                }
            }
        }
    }
}
