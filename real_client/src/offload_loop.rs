//! The loop that feeds this node's SSD tier: every heartbeat interval it fetches the
//! objects the master queued for the disk, reads them straight from this node's segment
//! (through the [`Store`], under a read lease) and writes them with the [`DiskTier`],
//! then tells the master what is on disk. It sits above both: the store reads from the
//! disk tier, and neither knows this loop.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use mooncake_core::error::{CodeResult, ErrorCode};

use crate::disk::DiskTier;
use crate::master_link::MasterLink;
use crate::store::Store;

/// Registers the tier with the master and reports every object on disk, in batches.
pub async fn register(disk: &DiskTier, master: &MasterLink, client: u128) -> CodeResult<()> {
    master.enable_offload(client).await?;
    let objects = disk.objects();
    let batch = usize::try_from(disk.config().scan_keys_limit)
        .unwrap_or(usize::MAX)
        .max(1);
    for (done, chunk) in objects.chunks(batch).enumerate() {
        master.offload_done(client, chunk.to_vec()).await?;
        tracing::info!(
            reported = done * batch + chunk.len(),
            total = objects.len(),
            "re-registering objects on disk"
        );
    }
    Ok(())
}

/// Writes what the master queues for this node, every heartbeat interval, until
/// `shutdown`; each round drains the queue. Objects go to disk straight from this
/// node's own segment, grouped into buckets by the bucket limits, under one read lease
/// per bucket: the backend's copy into its record is the only copy of their bytes. A
/// partial bucket is written at the end of each fetch (never held back).
pub async fn offload_loop(
    disk: Arc<DiskTier>,
    store: Arc<Store>,
    client: u128,
    mut shutdown: watch::Receiver<bool>,
) {
    let interval = disk.config().heartbeat_interval;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let master = store.master().unscoped();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = mooncake_core::process::stop_requested(&mut shutdown) => return,
        }
        if let Err(code) = offload_round(&disk, &store, &master, client).await {
            tracing::warn!(%code, "SSD tier round failed; retrying");
        }
    }
}

/// Drains this node's queue: fetches and writes batches until the master has no more.
async fn offload_round(
    disk: &DiskTier,
    store: &Store,
    master: &MasterLink,
    client: u128,
) -> CodeResult<()> {
    if let Err(code) = disk.evict_to_watermark(master, client).await {
        tracing::warn!(%code, "cannot tell the master about a watermark eviction");
    }
    let max = u32::try_from(disk.config().bucket_keys_limit)
        .unwrap_or(u32::MAX)
        .saturating_mul(4);
    while offload_batch(disk, store, master, client, max).await? >= max as usize {}
    Ok(())
}

/// Fetches up to `max` queued objects, writes them in buckets and reports them;
/// returns how many were fetched.
async fn offload_batch(
    disk: &DiskTier,
    store: &Store,
    master: &MasterLink,
    client: u128,
    max: u32,
) -> CodeResult<usize> {
    let work = match master.offload_fetch(client, max).await {
        Err(ErrorCode::SEGMENT_NOT_FOUND) => {
            // The master restarted (or forgot us): register again with everything on disk.
            return register(disk, master, client).await.map(|()| 0);
        }
        other => other?,
    };
    for key in &work.delete {
        disk.remove(key);
    }
    let fetched = work.store.len();
    let mut not_written = Vec::new();
    for bucket in disk.buckets(once_each(work.store)) {
        write_from_segment(disk, store, master, client, bucket, &mut not_written).await;
    }
    if !not_written.is_empty() {
        // Lets the master evict them from memory again.
        master.offload_done(client, not_written).await?;
    }
    Ok(fetched)
}

/// `items` with each key once, at its last place: an object written again before this
/// node fetched its queue is queued twice, and a batch naming a key twice is refused
/// whole (the write reads the master's current version either way).
fn once_each(items: Vec<(String, u64)>) -> Vec<(String, u64)> {
    let mut seen = std::collections::HashSet::new();
    let mut kept: Vec<(String, u64)> = items
        .into_iter()
        .rev()
        .filter(|(key, _)| seen.insert(key.clone()))
        .collect();
    kept.reverse();
    kept
}

/// Writes one bucket of `(key, size)` items straight from this node's segment: one
/// master round trip leases the whole bucket, then the backend copies each object into
/// its record. Objects that are gone or not in this node's segment, and the whole bucket
/// when the write fails, are added to `not_written`.
async fn write_from_segment(
    disk: &DiskTier,
    store: &Store,
    master: &MasterLink,
    client: u128,
    bucket: Vec<(String, u64)>,
    not_written: &mut Vec<(String, u64)>,
) {
    for (key, _) in &bucket {
        // The master's version replaces any older copy here.
        disk.remove(key);
    }
    let keys: Vec<&str> = bucket.iter().map(|(key, _)| key.as_str()).collect();
    let asked = Instant::now();
    let located = master.get_replica_lists(&keys).await;
    let mut objects = Vec::with_capacity(bucket.len());
    let mut lease_ends: Option<Instant> = None;
    for ((key, _), located) in bucket.into_iter().zip(located) {
        let own = located
            .ok()
            .and_then(|(replicas, lease)| Some((store.own_replica(&replicas)?, lease)));
        let Some((bytes, lease)) = own else {
            tracing::debug!(
                key,
                "object gone (or not in this node's segment) before it reached the disk"
            );
            not_written.push((key, 0));
            continue;
        };
        let ends = asked + lease;
        lease_ends = Some(lease_ends.map_or(ends, |earliest| earliest.min(ends)));
        objects.push((key, bytes));
    }
    let Some(lease_ends) = lease_ends else {
        return;
    };
    if let Err(code) = disk
        .write_bucket(master, client, &objects, lease_ends)
        .await
    {
        tracing::warn!(%code, objects = objects.len(), "cannot write a bucket to the SSD tier");
        not_written.extend(objects.into_iter().map(|(key, _)| (key, 0)));
    }
}

#[cfg(test)]
mod tests {
    use super::once_each;

    #[test]
    fn a_key_queued_twice_is_written_once_with_its_last_size() {
        let items = vec![("a".into(), 1), ("b".into(), 2), ("a".into(), 3)];
        assert_eq!(
            once_each(items),
            vec![("b".to_string(), 2), ("a".to_string(), 3)]
        );
    }
}
