//! [`MasterService`] as a [`Master`]: the in-process implementation of the master seam,
//! used by an embedded master's real client and by the RPC server of `mooncake_master`.
//! [`MasterService::handle`] is the one dispatch of every call; it answers at once.

use std::future::ready;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{
    MASTER_PROTOCOL_VERSION, Master, MasterFuture, MasterHello, MasterRequest, MasterResponse,
};
use mooncake_core::tenant::Tenant;
use mooncake_core::types::WriteMode;

use crate::MasterService;

fn count(max: u32) -> usize {
    usize::try_from(max).unwrap_or(usize::MAX)
}

/// The tenant a request names, `INVALID_PARAMS` when the name is not a valid one.
fn tenant(name: &str) -> CodeResult<Tenant> {
    Tenant::new(name).map_err(|_| ErrorCode::INVALID_PARAMS)
}

impl MasterService {
    /// Answers one master call.
    pub fn handle(&self, request: MasterRequest) -> MasterResponse {
        use MasterRequest as Q;
        use MasterResponse as A;
        match request {
            Q::MountSegment {
                client,
                name,
                capacity,
                endpoint,
                generation,
            } => {
                A::MountSegment(self.mount_segment(&name, capacity, client, &endpoint, generation))
            }
            Q::UnmountClient { client } => {
                self.remove_client(client);
                A::UnmountClient(Ok(()))
            }
            Q::Heartbeat { client } => A::Heartbeat(Ok(self.heartbeat(client))),
            Q::PutStart {
                items,
                config,
                mode,
            } => A::PutStart(
                items
                    .iter()
                    .map(|(key, size)| match mode {
                        WriteMode::Put => self.put_start(key, *size, &config),
                        WriteMode::Upsert => self.upsert_start(key, *size, &config),
                    })
                    .collect(),
            ),
            Q::PutEnd { items } => A::PutEnd(
                items
                    .iter()
                    .map(|(key, id)| self.put_end(key, *id))
                    .collect(),
            ),
            Q::PutRevoke { items } => A::PutRevoke(
                items
                    .iter()
                    .map(|(key, id)| self.put_revoke(key, *id))
                    .collect(),
            ),
            Q::PutCommit { items } => A::PutCommit(
                items
                    .iter()
                    .map(|(reserved, id, key)| self.put_commit(reserved, *id, key))
                    .collect(),
            ),
            Q::GetReplicaList { keys, lease } => A::GetReplicaList(
                keys.iter()
                    .map(|key| self.get_replica_list_leased(key, lease))
                    .collect(),
            ),
            Q::Exist { keys, mut budget } => A::Exist(
                keys.iter()
                    .map(|key| self.exist_within(key, &mut budget))
                    .collect(),
            ),
            Q::ObjectSize { key } => A::ObjectSize(self.object_size(&key)),
            Q::ReplicaDesc { keys } => A::ReplicaDesc(
                keys.iter()
                    .map(|key| self.replica_descriptors(key))
                    .collect(),
            ),
            Q::Remove { keys, force } => A::Remove(self.batch_remove(&keys, force)),
            Q::ClearReplicas { keys, segment } => {
                A::ClearReplicas(self.batch_clear_replicas(&keys, segment.as_deref()))
            }
            Q::RemoveByRegex {
                tenant: name,
                pattern,
                force,
            } => A::RemoveByRegex(
                tenant(&name).and_then(|t| self.remove_by_regex_of(&t, &pattern, force)),
            ),
            Q::RemoveAll {
                tenant: name,
                force,
            } => A::RemoveAll(tenant(&name).map(|t| self.remove_all_of(&t, force))),
            Q::CreateCopyTask { key, targets, id } => {
                A::CreateCopyTask(self.create_copy_task(&key, &targets, id))
            }
            Q::CreateMoveTask {
                key,
                source,
                target,
                id,
            } => A::CreateMoveTask(self.create_move_task(&key, &source, &target, id)),
            Q::QueryTask { id } => A::QueryTask(self.query_task(id)),
            Q::FetchTasks { client, max } => {
                A::FetchTasks(Ok(self.fetch_tasks(client, count(max))))
            }
            Q::FinishTask {
                client,
                id,
                outcome,
            } => A::FinishTask(self.finish_task(client, id, outcome)),
            Q::EnableOffload { client } => A::EnableOffload(self.enable_offload(client)),
            Q::OffloadFetch { client, max } => {
                A::OffloadFetch(self.offload_fetch(client, count(max)))
            }
            Q::OffloadDone { client, objects } => {
                A::OffloadDone(self.offload_done(client, &objects))
            }
            Q::DiskEvicted { client, keys } => {
                self.disk_evicted(client, &keys);
                A::DiskEvicted(Ok(()))
            }
            Q::Stats {} => A::Stats(Ok(self.stats())),
            Q::Ping {} => A::Ping(Ok(())),
        }
    }
}

impl Master for MasterService {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        let lease = self.config().default_kv_lease_ttl;
        Box::pin(ready(Ok(MasterHello {
            version: MASTER_PROTOCOL_VERSION,
            master_id: self.id(),
            lease_ttl_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            epoch: 0,
        })))
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn call(&self, request: MasterRequest) -> MasterFuture<'_, MasterResponse> {
        Box::pin(ready(self.handle(request)))
    }
}
