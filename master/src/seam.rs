//! [`MasterService`] as a [`Master`]: the in-process implementation of the master seam,
//! used by an embedded master's real client and by the RPC server of `mooncake_master`.
//! Every call answers at once (the futures are ready when made).

use std::future::ready;
use std::time::Duration;

use mooncake_core::error::CodeResult;
use mooncake_core::master_api::{
    ClientStatus, LeaseBudget, LeasedReplicas, Master, MasterFuture, MasterStats, OffloadWork,
    PutStarted, TaskInfo, TaskWork,
};
use mooncake_core::protocol::master_rpc::{MASTER_PROTOCOL_VERSION, MasterHello};
use mooncake_core::protocol::rpc::WriteMode;
use mooncake_core::tenant::Tenant;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

use crate::MasterService;

/// A future that is ready with `value`.
fn done<'a, T: Send + 'a>(value: T) -> MasterFuture<'a, T> {
    Box::pin(ready(value))
}

fn count(max: u32) -> usize {
    usize::try_from(max).unwrap_or(usize::MAX)
}

impl Master for MasterService {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        let lease = self.config().default_kv_lease_ttl;
        done(Ok(MasterHello {
            version: MASTER_PROTOCOL_VERSION,
            master_id: self.id(),
            lease_ttl_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            epoch: 0,
        }))
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn mount_segment(
        &self,
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
    ) -> MasterFuture<'_, CodeResult<SegmentId>> {
        done(MasterService::mount_segment(
            self, &name, capacity, client, &endpoint,
        ))
    }

    fn unmount_client(&self, client: u128) -> MasterFuture<'_, CodeResult<()>> {
        self.remove_client(client);
        done(Ok(()))
    }

    fn heartbeat(&self, client: u128) -> MasterFuture<'_, CodeResult<ClientStatus>> {
        done(Ok(MasterService::heartbeat(self, client)))
    }

    fn put_start(
        &self,
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> MasterFuture<'_, Vec<CodeResult<PutStarted>>> {
        let results = items
            .iter()
            .map(|(key, size)| match mode {
                WriteMode::Put => MasterService::put_start(self, key, *size, &config),
                WriteMode::Upsert => self.upsert_start(key, *size, &config),
            })
            .collect();
        done(results)
    }

    fn put_end(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        let results = items
            .iter()
            .map(|(key, id)| MasterService::put_end(self, key, *id))
            .collect();
        done(results)
    }

    fn put_commit(
        &self,
        items: Vec<(String, u64, String)>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        let results = items
            .iter()
            .map(|(reserved, id, key)| MasterService::put_commit(self, reserved, *id, key))
            .collect();
        done(results)
    }

    fn put_revoke(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        let results = items
            .iter()
            .map(|(key, id)| MasterService::put_revoke(self, key, *id))
            .collect();
        done(results)
    }

    fn get_replica_list(
        &self,
        keys: Vec<String>,
        lease: Option<Duration>,
    ) -> MasterFuture<'_, Vec<CodeResult<LeasedReplicas>>> {
        let results = keys
            .iter()
            .map(|key| self.get_replica_list_leased(key, lease))
            .collect();
        done(results)
    }

    fn exist(
        &self,
        keys: Vec<String>,
        mut budget: LeaseBudget,
    ) -> MasterFuture<'_, Vec<CodeResult<Option<u64>>>> {
        done(
            keys.iter()
                .map(|key| self.exist_within(key, &mut budget))
                .collect(),
        )
    }

    fn object_size(&self, key: String) -> MasterFuture<'_, CodeResult<u64>> {
        done(MasterService::object_size(self, &key))
    }

    fn replica_desc(
        &self,
        keys: Vec<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<Vec<ReplicaDescriptor>>>> {
        done(
            keys.iter()
                .map(|key| self.replica_descriptors(key))
                .collect(),
        )
    }

    fn remove(&self, keys: Vec<String>, force: bool) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        done(self.batch_remove(&keys, force))
    }

    fn clear_replicas(
        &self,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        done(self.batch_clear_replicas(&keys, segment.as_deref()))
    }

    fn remove_by_regex(
        &self,
        tenant: Tenant,
        pattern: String,
        force: bool,
    ) -> MasterFuture<'_, CodeResult<u64>> {
        done(self.remove_by_regex_of(&tenant, &pattern, force))
    }

    fn remove_all(&self, tenant: Tenant, force: bool) -> MasterFuture<'_, CodeResult<u64>> {
        done(Ok(self.remove_all_of(&tenant, force)))
    }

    fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>> {
        done(MasterService::create_copy_task(self, &key, &targets, id))
    }

    fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>> {
        done(MasterService::create_move_task(
            self, &key, &source, &target, id,
        ))
    }

    fn query_task(&self, id: u128) -> MasterFuture<'_, CodeResult<TaskInfo>> {
        done(MasterService::query_task(self, id))
    }

    fn fetch_tasks(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<Vec<TaskWork>>> {
        done(Ok(MasterService::fetch_tasks(self, client, count(max))))
    }

    fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> MasterFuture<'_, CodeResult<()>> {
        done(MasterService::finish_task(self, client, id, outcome))
    }

    fn enable_offload(&self, client: u128) -> MasterFuture<'_, CodeResult<()>> {
        done(MasterService::enable_offload(self, client))
    }

    fn offload_fetch(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<OffloadWork>> {
        done(MasterService::offload_fetch(self, client, count(max)))
    }

    fn offload_done(
        &self,
        client: u128,
        objects: Vec<(String, u64)>,
    ) -> MasterFuture<'_, CodeResult<()>> {
        done(MasterService::offload_done(self, client, &objects))
    }

    fn disk_evicted(&self, client: u128, keys: Vec<String>) -> MasterFuture<'_, CodeResult<()>> {
        MasterService::disk_evicted(self, client, &keys);
        done(Ok(()))
    }

    fn stats(&self) -> MasterFuture<'_, CodeResult<MasterStats>> {
        done(Ok(MasterService::stats(self)))
    }
}
