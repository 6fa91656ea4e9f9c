//! A standby following its leader: it installs the leader's snapshot, then pulls and
//! applies the leader's changes as they happen (each pull acknowledges the previous
//! batch), starting over from a snapshot when the leader no longer keeps what it
//! needs.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::replication::SnapshotState;
use mooncake_core::protocol::auth::ClusterSecret;
use mooncake_core::protocol::master_client::RemoteMaster;

use super::etcd::LeaderView;
use super::node::HaNode;

/// How long one pull waits for a change before it returns empty.
const PULL_WAIT: Duration = Duration::from_millis(500);

/// Pause after a failed pull or snapshot before the next attempt.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Most parts a snapshot may have (8 MiB each: 8 GiB).
pub const MAX_SNAPSHOT_PARTS: u32 = 1024;

/// Follows `leader` until the task is dropped; `address` is this master's RPC address
/// (the leader lists it).
pub async fn follow(
    node: Arc<HaNode>,
    leader: LeaderView,
    secret: Option<Arc<ClusterSecret>>,
    address: String,
) {
    let me = node.master().id();
    let remote = RemoteMaster::new(leader.address.clone(), secret);
    loop {
        let (epoch, mut next) = match install_snapshot(&node, &remote, me).await {
            Ok(position) => position,
            Err(code) => {
                tracing::debug!(leader = %leader.address, error = code.name(), "snapshot not taken yet");
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        tracing::info!(leader = %leader.address, epoch, sequence = next, "standby installed the leader's snapshot");
        node.installed_snapshot();
        loop {
            match remote
                .ha_pull((me, address.clone()), epoch, next, PULL_WAIT)
                .await
            {
                Ok(batch) => {
                    let applied = batch.changes.len() as u64;
                    for change in batch.changes {
                        node.master().apply_change(change);
                    }
                    next += applied;
                    if batch.in_sync {
                        node.in_sync_with(epoch);
                    }
                    let counters = &node.counters;
                    counters
                        .changes_applied
                        .fetch_add(applied, Ordering::Relaxed);
                    counters
                        .standby_lag
                        .store(batch.head.saturating_sub(next), Ordering::Relaxed);
                }
                Err(ErrorCode::OPLOG_ENTRY_NOT_FOUND) => break,
                Err(code) => {
                    tracing::debug!(leader = %leader.address, error = code.name(), "pull failed");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
}

/// Fetches and installs a snapshot; answers its term and sequence number.
async fn install_snapshot(
    node: &HaNode,
    remote: &RemoteMaster,
    me: u128,
) -> CodeResult<(u64, u64)> {
    let first = remote.ha_snapshot(me, 0).await?;
    if first.parts == 0 || first.parts > MAX_SNAPSHOT_PARTS {
        tracing::error!(
            parts = first.parts,
            "the leader announced a snapshot of an impossible size"
        );
        return Err(ErrorCode::INVALID_PARAMS);
    }
    let mut bytes = first.bytes;
    for part in 1..first.parts {
        let next = remote.ha_snapshot(me, part).await?;
        if (next.epoch, next.sequence) != (first.epoch, first.sequence) {
            return Err(ErrorCode::INCOMPLETE_OPLOG_CATCH_UP);
        }
        bytes.extend_from_slice(&next.bytes);
    }
    let size = bytes.len() as u64;
    let state = tokio::task::spawn_blocking(move || decode_snapshot(&bytes))
        .await
        .map_err(|_| ErrorCode::INTERNAL_ERROR)??;
    node.master().install_snapshot(state).map_err(|error| {
        tracing::error!(%error, "the leader's snapshot does not install");
        ErrorCode::DESERIALIZE_FAIL
    })?;
    let counters = &node.counters;
    counters.last_snapshot_bytes.store(size, Ordering::Relaxed);
    counters.snapshots_installed.fetch_add(1, Ordering::Relaxed);
    Ok((first.epoch, first.sequence))
}

/// Decodes a snapshot's bytes (the leader's, checked: a bad one is refused).
pub fn decode_snapshot(bytes: &[u8]) -> CodeResult<SnapshotState> {
    postcard::from_bytes(bytes).map_err(|_| ErrorCode::DESERIALIZE_FAIL)
}

/// What the fuzz target and the property tests check: bytes from a leader, decoded as a
/// snapshot (mode byte even) or as changes (odd), install or apply into a fresh master
/// without a panic, and the master still answers.
pub fn check_foreign_replication_bytes(bytes: &[u8]) {
    let Some((&mode, rest)) = bytes.split_first() else {
        return;
    };
    let master = crate::MasterService::new(crate::MasterConfig::default(), crate::Clock::System);
    if mode % 2 == 0 {
        if let Ok(state) = decode_snapshot(rest) {
            let _ = master.install_snapshot(state);
        }
    } else if let Ok(changes) =
        postcard::from_bytes::<Vec<mooncake_core::master_api::replication::Change>>(rest)
    {
        for change in changes {
            master.apply_change(change);
        }
    }
    let _ = master.stats();
    let _ = master.maintenance();
}
