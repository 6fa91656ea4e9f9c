//! Queries, removal and copy/move tasks.

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::TaskInfo;
use mooncake_core::protocol::rpc::CONTROL_DEADLINE;
use mooncake_core::types::ReplicaDescriptor;

use crate::client::DummyClient;

fn owned<K: AsRef<str>>(keys: &[K]) -> Vec<String> {
    keys.iter().map(|k| k.as_ref().to_string()).collect()
}

fn first<T>(results: Vec<CodeResult<T>>) -> CodeResult<T> {
    results
        .into_iter()
        .next()
        .unwrap_or(Err(ErrorCode::RPC_FAIL))
}

impl DummyClient {
    /// Whether `key` exists (grants a read lease when it does, as upstream).
    pub fn is_exist(&self, key: &str) -> CodeResult<bool> {
        first(self.batch_is_exist(&[key]))
    }

    /// [`is_exist`](Self::is_exist) for many keys in one request.
    pub fn batch_is_exist<K: AsRef<str>>(&self, keys: &[K]) -> Vec<CodeResult<bool>> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.call_chunked(owned(keys), CONTROL_DEADLINE, |rpc, ctx, keys| async move {
            rpc.exist(ctx, keys).await
        })
    }

    /// Size of the object under `key`.
    pub fn get_size(&self, key: &str) -> CodeResult<u64> {
        let key = key.to_string();
        self.call(CONTROL_DEADLINE, |rpc, ctx| {
            let key = key.clone();
            async move { rpc.object_size(ctx, key).await }
        })?
    }

    /// Where the replicas of `key` are (no lease is granted).
    pub fn get_replica_desc(&self, key: &str) -> CodeResult<Vec<ReplicaDescriptor>> {
        first(self.batch_get_replica_desc(&[key]))
    }

    /// [`get_replica_desc`](Self::get_replica_desc) for many keys in one request.
    pub fn batch_get_replica_desc<K: AsRef<str>>(
        &self,
        keys: &[K],
    ) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.call_chunked(owned(keys), CONTROL_DEADLINE, |rpc, ctx, keys| async move {
            rpc.replica_desc(ctx, keys).await
        })
    }

    /// Removes `key`; under a read lease this is `OBJECT_HAS_LEASE` unless `force`.
    pub fn remove(&self, key: &str, force: bool) -> CodeResult<()> {
        first(self.batch_remove(&[key], force))
    }

    /// [`remove`](Self::remove) for many keys in one request.
    pub fn batch_remove<K: AsRef<str>>(&self, keys: &[K], force: bool) -> Vec<CodeResult<()>> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.call_chunked(owned(keys), CONTROL_DEADLINE, |rpc, ctx, keys| async move {
            rpc.remove(ctx, keys, force).await
        })
    }

    /// Clears the objects among `keys` that nobody read or wrote for one lease TTL
    /// (upstream's `batch_replica_clear`): their memory replicas on the segment named
    /// `segment` (the others keep serving them), or (`None`) the whole objects. One
    /// result per key: `OBJECT_HAS_LEASE` when it was used within the TTL,
    /// `OBJECT_NOT_FOUND` when it has nothing to clear.
    pub fn clear_replicas<K: AsRef<str>>(
        &self,
        keys: &[K],
        segment: Option<&str>,
    ) -> Vec<CodeResult<()>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let segment = segment.map(str::to_string);
        self.call_chunked(owned(keys), CONTROL_DEADLINE, move |rpc, ctx, keys| {
            let segment = segment.clone();
            async move { rpc.clear_replicas(ctx, keys, segment).await }
        })
    }

    /// Removes every object whose key matches the regular expression `pattern`
    /// (linear-time engine; an invalid or oversized pattern is `INVALID_PARAMS`);
    /// returns how many were removed.
    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> CodeResult<u64> {
        let pattern = pattern.to_string();
        self.call(CONTROL_DEADLINE, |rpc, ctx| {
            let pattern = pattern.clone();
            async move { rpc.remove_by_regex(ctx, pattern, force).await }
        })?
    }

    /// Removes every object; returns how many were removed.
    pub fn remove_all(&self, force: bool) -> CodeResult<u64> {
        self.call(CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.remove_all(ctx, force).await
        })?
    }

    /// Asks for replicas of `key` on each target segment; returns the task id. A target
    /// that is not mounted is `SEGMENT_NOT_FOUND` at once.
    pub fn create_copy_task(&self, key: &str, targets: &[String]) -> CodeResult<u128> {
        let (key, targets) = (key.to_string(), targets.to_vec());
        self.call(CONTROL_DEADLINE, |rpc, ctx| {
            let (key, targets) = (key.clone(), targets.clone());
            async move { rpc.create_copy_task(ctx, key, targets.into()).await }
        })?
    }

    /// Asks to move `key`'s replica from segment `source` to `target`; returns the task id.
    pub fn create_move_task(&self, key: &str, source: &str, target: &str) -> CodeResult<u128> {
        let (key, source, target) = (key.to_string(), source.to_string(), target.to_string());
        self.call(CONTROL_DEADLINE, |rpc, ctx| {
            let (key, source, target) = (key.clone(), source.clone(), target.clone());
            async move { rpc.create_move_task(ctx, key, source, target).await }
        })?
    }

    /// The state of a copy or move task.
    pub fn query_task(&self, id: u128) -> CodeResult<TaskInfo> {
        self.call(CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.query_task(ctx, id).await
        })?
    }
}
