//! Opens the storage backend the configuration names: the one place that knows every
//! backend (the contract in [`backend`](crate::backend) knows none).

use std::path::{Component, Path};
use std::sync::Arc;

use crate::backend::{Limits, RecoveryReport, StorageBackend, StoreError};
use crate::config::{BackendKind, OffloadConfig};
use crate::io::IoEngine;

/// Opens the backend named in `config` in its storage path (which must exist) under
/// `limits`, doing its I/O through `io`, and rebuilds its index from disk.
pub fn open_backend(
    config: &OffloadConfig,
    limits: Limits,
    io: Arc<IoEngine>,
) -> Result<(Box<dyn StorageBackend>, RecoveryReport), StoreError> {
    let (dir, policy) = (config.path.as_path(), config.eviction_policy);
    match config.backend {
        BackendKind::Bucket => {
            let (store, report) = crate::bucket::BucketStore::open_with(dir, limits, policy, io)?;
            Ok((Box::new(store), report))
        }
        BackendKind::FilePerKey => {
            let fsdir = Path::new(&config.fsdir);
            let single = fsdir.components().count() == 1
                && matches!(fsdir.components().next(), Some(Component::Normal(_)));
            if !single {
                return Err(StoreError::Invalid(format!(
                    "MOONCAKE_OFFLOAD_FSDIR={:?} must be one directory name (no '/', no '..')",
                    config.fsdir
                )));
            }
            let (store, report) = crate::file_per_key::FilePerKeyStore::open_in(
                &dir.join(fsdir),
                limits,
                policy,
                io,
            )?;
            Ok((Box::new(store), report))
        }
        BackendKind::OffsetAllocator => {
            let (store, report) =
                crate::offset_allocator::OffsetAllocatorStore::open(dir, limits, policy, io)?;
            Ok((Box::new(store), report))
        }
        BackendKind::DistributedKv => {
            let client = open_dkv_client(config)?;
            let prefix = crate::dkv::backend::key_prefix(&config.dkv_namespace, &config.node);
            tracing::info!(
                store = client.describe(),
                prefix,
                "SSD tier on a distributed KV store"
            );
            let (store, report) =
                crate::dkv::backend::DkvStore::open(client, &prefix, limits, policy)?;
            Ok((Box::new(store), report))
        }
    }
}

/// The distributed-KV client named by `MOONCAKE_OFFLOAD_DKV_CLIENT`.
fn open_dkv_client(config: &OffloadConfig) -> Result<Arc<dyn crate::dkv::DkvClient>, StoreError> {
    match config.dkv_client {
        crate::config::DkvClientKind::Plugin => {
            let path = config.dkv_plugin.as_ref().ok_or_else(|| {
                StoreError::Setup(
                    "MOONCAKE_OFFLOAD_DKV_CLIENT=plugin needs MOONCAKE_OFFLOAD_DKV_PLUGIN=/path/to/lib.so"
                        .into(),
                )
            })?;
            crate::dkv::plugin::PluginClient::open(path, &config.dkv_url)
                .map(|client| Arc::new(client) as Arc<dyn crate::dkv::DkvClient>)
                .map_err(|error| StoreError::Setup(error.to_string()))
        }
        crate::config::DkvClientKind::Redis => {
            crate::dkv::redis::RedisClient::open(&config.dkv_url, config.dkv_tls_ca_file.as_deref())
                .map(|client| Arc::new(client) as Arc<dyn crate::dkv::DkvClient>)
                .map_err(|error| StoreError::Setup(error.to_string()))
        }
    }
}
