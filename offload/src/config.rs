//! Settings of the SSD tier, from upstream's `MOONCAKE_OFFLOAD_*` environment variables
//! (same names, aliases and defaults), and the rules for the storage path.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use mooncake_core::units::parse_size;

/// Default name of the file-per-key directory, `MOONCAKE_OFFLOAD_FSDIR`.
pub const DEFAULT_FSDIR: &str = "file_per_key_dir";

/// The storage backend, `MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Many objects per bucket file, with a metadata file per bucket (the default).
    Bucket,
    /// One file per object in sharded directories.
    FilePerKey,
    /// One preallocated file.
    OffsetAllocator,
    /// A shared distributed KV store.
    DistributedKv,
}

impl BackendKind {
    /// The backend called `name` (its descriptor).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "bucket_storage_backend" => BackendKind::Bucket,
            "file_per_key_storage_backend" => BackendKind::FilePerKey,
            "offset_allocator_storage_backend" => BackendKind::OffsetAllocator,
            "distributed_kv_storage_backend" => BackendKind::DistributedKv,
            _ => return None,
        })
    }
}

/// Which buckets disk eviction takes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Never evict: writes fail once the disk quota is reached.
    None,
    /// Oldest bucket first.
    Fifo,
    /// Least recently read bucket first (never-read buckets before read ones).
    Lru,
}

/// A setting that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value:?}: {reason}")]
pub struct ConfigError {
    /// The environment variable.
    pub variable: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong and what to do.
    pub reason: String,
}

/// Settings of the SSD tier of one real client.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadConfig {
    /// `MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR` (`bucket_storage_backend`).
    pub backend: BackendKind,
    /// `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH` (`/data/file_storage`).
    pub path: PathBuf,
    /// `MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES` (1280 MiB): the staging buffer.
    pub local_buffer_size: u64,
    /// `MOONCAKE_OFFLOAD_SCANMETA_ITERATOR_KEYS_LIMIT` (20 000): keys per recovery batch.
    pub scan_keys_limit: u64,
    /// `MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT` (10 000 000).
    pub total_keys_limit: u64,
    /// `MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES` (2 TiB).
    pub total_size_limit: u64,
    /// `MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS` (10).
    pub heartbeat_interval: Duration,
    /// `MOONCAKE_OFFLOAD_CLIENT_BUFFER_GC_INTERVAL_SECONDS` (1).
    pub buffer_gc_interval: Duration,
    /// `MOONCAKE_OFFLOAD_CLIENT_BUFFER_GC_TTL_MS` (5000): a reader's hold on staged bytes.
    pub buffer_gc_ttl: Duration,
    /// `MOONCAKE_OFFLOAD_USE_URING` (false).
    pub use_uring: bool,
    /// `MOONCAKE_OFFLOAD_ENABLE_DISK_WATERMARK_EVICTION` (true).
    pub watermark_eviction: bool,
    /// `MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO` (0.90).
    pub high_watermark: f64,
    /// `MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO` (0.80).
    pub low_watermark: f64,
    /// `MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES` (256 MiB): bytes per bucket.
    pub bucket_size_limit: u64,
    /// `MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT` (500): objects per bucket.
    pub bucket_keys_limit: u64,
    /// `MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE` (0: 90% of the filesystem).
    pub bucket_max_total_size: u64,
    /// `MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY` (`fifo`).
    pub eviction_policy: EvictionPolicy,
    /// `MOONCAKE_OFFLOAD_FSDIR` (`file_per_key_dir`): the file-per-key directory.
    pub fsdir: String,
    /// `MOONCAKE_OFFLOAD_DKV_CLIENT` (`redis`): the distributed-KV client.
    pub dkv_client: DkvClientKind,
    /// `MOONCAKE_OFFLOAD_DKV_PLUGIN`: the plugin library (client `plugin`).
    pub dkv_plugin: Option<PathBuf>,
    /// `MOONCAKE_OFFLOAD_DKV_URL` (empty): the store's address (Redis URL, list of
    /// cluster nodes, or a plugin's configuration string).
    pub dkv_url: String,
    /// `MOONCAKE_OFFLOAD_DKV_TLS_CA_FILE`: CA certificates (PEM) trusted for
    /// `rediss://` instead of the system's.
    pub dkv_tls_ca_file: Option<PathBuf>,
    /// `MOONCAKE_OFFLOAD_DKV_NAMESPACE` (`mooncake`): prefix of every key in the store.
    pub dkv_namespace: String,
    /// Who owns the tier, set by the node (its segment name; not a variable): the
    /// distributed-KV backend keeps this node's keys under `<namespace>/<node>/`, so
    /// nodes sharing a store and a namespace never see each other's objects.
    pub node: String,
}

/// The client of `distributed_kv_storage_backend`, `MOONCAKE_OFFLOAD_DKV_CLIENT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DkvClientKind {
    /// Redis or Valkey.
    Redis,
    /// A C plugin (`MOONCAKE_OFFLOAD_DKV_PLUGIN`).
    Plugin,
}

/// Reads settings through `lookup` (the environment in production).
struct Reader<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

impl Reader<'_> {
    /// The first of `names` that is set: the variable and its value.
    fn raw(&self, names: &[&'static str]) -> Option<(&'static str, String)> {
        names
            .iter()
            .find_map(|name| (self.lookup)(name).map(|value| (*name, value.trim().to_string())))
    }

    fn parsed<T>(
        &self,
        names: &[&'static str],
        default: T,
        what: &str,
        parse: impl Fn(&str) -> Option<T>,
    ) -> Result<T, ConfigError> {
        match self.raw(names) {
            None => Ok(default),
            Some((variable, value)) => parse(&value).ok_or_else(|| ConfigError {
                variable,
                reason: format!("expected {what}"),
                value,
            }),
        }
    }

    fn size(&self, names: &[&'static str], default: u64) -> Result<u64, ConfigError> {
        self.parsed(
            names,
            default,
            "a byte count such as 1073741824 or \"1 GiB\"",
            |v| parse_size(v).ok(),
        )
    }

    fn count(&self, names: &[&'static str], default: u64) -> Result<u64, ConfigError> {
        self.parsed(names, default, "a whole number", |v| v.parse().ok())
    }

    fn flag(&self, names: &[&'static str], default: bool) -> Result<bool, ConfigError> {
        self.parsed(
            names,
            default,
            "1/0, true/false, yes/no or on/off",
            |v| match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Some(true),
                "0" | "false" | "no" | "off" => Some(false),
                _ => None,
            },
        )
    }

    fn ratio(&self, names: &[&'static str], default: f64) -> Result<f64, ConfigError> {
        self.parsed(names, default, "a ratio in (0, 1]", |v| {
            v.parse::<f64>().ok().filter(|r| *r > 0.0 && *r <= 1.0)
        })
    }

    fn seconds(&self, names: &[&'static str], default: u64) -> Result<Duration, ConfigError> {
        self.parsed(names, default, "a positive number of seconds", |v| {
            v.parse::<u64>().ok().filter(|s| *s > 0)
        })
        .map(Duration::from_secs)
    }
}

impl OffloadConfig {
    /// Settings from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(&|name| std::env::var(name).ok())
    }

    /// Settings read through `lookup` (tests pass a map). Values are checked, the path
    /// is not (see [`validate_path`]).
    pub fn from_lookup(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let env = Reader { lookup };
        let backend = env.parsed(
            &["MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"],
            BackendKind::Bucket,
            "bucket_storage_backend, file_per_key_storage_backend, offset_allocator_storage_backend or distributed_kv_storage_backend",
            BackendKind::parse,
        )?;
        let eviction_policy = env.parsed(
            &[
                "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY",
                "MOONCAKE_BUCKET_EVICTION_POLICY",
            ],
            EvictionPolicy::Fifo,
            "fifo, lru or none",
            |v| match v.to_ascii_lowercase().as_str() {
                "fifo" => Some(EvictionPolicy::Fifo),
                "lru" => Some(EvictionPolicy::Lru),
                "none" => Some(EvictionPolicy::None),
                _ => None,
            },
        )?;
        let config = OffloadConfig {
            backend,
            path: env
                .raw(&["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"])
                .map_or_else(|| PathBuf::from("/data/file_storage"), |(_, v)| v.into()),
            local_buffer_size: env
                .size(&["MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"], 1280 << 20)?,
            scan_keys_limit: env.count(
                &[
                    "MOONCAKE_OFFLOAD_SCANMETA_ITERATOR_KEYS_LIMIT",
                    "MOONCAKE_SCANMETA_ITERATOR_KEYS_LIMIT",
                ],
                20_000,
            )?,
            total_keys_limit: env.count(&["MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT"], 10_000_000)?,
            total_size_limit: env.size(&["MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"], 2 << 40)?,
            heartbeat_interval: env
                .seconds(&["MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS"], 10)?,
            buffer_gc_interval: env
                .seconds(&["MOONCAKE_OFFLOAD_CLIENT_BUFFER_GC_INTERVAL_SECONDS"], 1)?,
            buffer_gc_ttl: Duration::from_millis(
                env.count(&["MOONCAKE_OFFLOAD_CLIENT_BUFFER_GC_TTL_MS"], 5000)?,
            ),
            use_uring: env.flag(&["MOONCAKE_OFFLOAD_USE_URING", "MOONCAKE_USE_URING"], false)?,
            watermark_eviction: env
                .flag(&["MOONCAKE_OFFLOAD_ENABLE_DISK_WATERMARK_EVICTION"], true)?,
            high_watermark: env.ratio(
                &[
                    "MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO",
                    "MOONCAKE_DISK_EVICTION_HIGH_WATERMARK_RATIO",
                ],
                0.90,
            )?,
            low_watermark: env.ratio(
                &[
                    "MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO",
                    "MOONCAKE_DISK_EVICTION_LOW_WATERMARK_RATIO",
                ],
                0.80,
            )?,
            bucket_size_limit: env
                .size(&["MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES"], 256 << 20)?,
            bucket_keys_limit: env.count(&["MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"], 500)?,
            bucket_max_total_size: env.size(
                &[
                    "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE",
                    "MOONCAKE_BUCKET_MAX_TOTAL_SIZE",
                ],
                0,
            )?,
            eviction_policy,
            fsdir: env
                .raw(&["MOONCAKE_OFFLOAD_FSDIR"])
                .map_or_else(|| DEFAULT_FSDIR.to_string(), |(_, v)| v),
            dkv_client: env.parsed(
                &["MOONCAKE_OFFLOAD_DKV_CLIENT"],
                DkvClientKind::Redis,
                "redis or plugin",
                |v| match v.to_ascii_lowercase().as_str() {
                    "redis" | "valkey" => Some(DkvClientKind::Redis),
                    "plugin" => Some(DkvClientKind::Plugin),
                    _ => None,
                },
            )?,
            dkv_plugin: env
                .raw(&["MOONCAKE_OFFLOAD_DKV_PLUGIN"])
                .filter(|(_, v)| !v.is_empty())
                .map(|(_, v)| v.into()),
            dkv_url: env
                .raw(&["MOONCAKE_OFFLOAD_DKV_URL"])
                .map_or_else(String::new, |(_, v)| v),
            dkv_tls_ca_file: env
                .raw(&["MOONCAKE_OFFLOAD_DKV_TLS_CA_FILE"])
                .filter(|(_, v)| !v.is_empty())
                .map(|(_, v)| v.into()),
            dkv_namespace: env.parsed(
                &["MOONCAKE_OFFLOAD_DKV_NAMESPACE"],
                "mooncake".to_string(),
                "a name of letters, digits, '-', '_' and '.' (1 to 64 characters)",
                |v| {
                    let fine = !v.is_empty()
                        && v.len() <= 64
                        && v.chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
                    fine.then(|| v.to_string())
                },
            )?,
            node: String::new(),
        };
        config.check_limits()?;
        Ok(config)
    }

    fn check_limits(&self) -> Result<(), ConfigError> {
        let positive = [
            ("MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT", self.total_keys_limit),
            (
                "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
                self.total_size_limit,
            ),
            (
                "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES",
                self.bucket_size_limit,
            ),
            ("MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT", self.bucket_keys_limit),
            (
                "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES",
                self.local_buffer_size,
            ),
            (
                "MOONCAKE_OFFLOAD_SCANMETA_ITERATOR_KEYS_LIMIT",
                self.scan_keys_limit,
            ),
        ];
        if let Some((variable, value)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError {
                variable,
                value: value.to_string(),
                reason: "must be above 0".into(),
            });
        }
        if self.low_watermark >= self.high_watermark {
            return Err(ConfigError {
                variable: "MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO",
                value: self.low_watermark.to_string(),
                reason: format!("must be below the high watermark ({})", self.high_watermark),
            });
        }
        Ok(())
    }
}

/// Checks the storage path: absolute, no `..`, an existing directory (not a symlink),
/// writable. Each violation is an error naming `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`.
pub fn validate_path(path: &Path) -> Result<(), ConfigError> {
    let fail = |reason: &str| ConfigError {
        variable: "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
        value: path.display().to_string(),
        reason: reason.to_string(),
    };
    if path.as_os_str().is_empty() {
        return Err(fail("is empty: set it to a directory on the SSD"));
    }
    if !path.is_absolute() {
        return Err(fail("must be an absolute path"));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(fail("must not contain '..'"));
    }
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| fail(&format!("cannot be read ({e}): create the directory first")))?;
    if meta.file_type().is_symlink() {
        return Err(fail("is a symbolic link: give the real directory"));
    }
    if !meta.is_dir() {
        return Err(fail("is not a directory"));
    }
    let probe = path.join(format!(".mooncake-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .map_err(|e| fail(&format!("is not writable by this process ({e})")))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<OffloadConfig, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        OffloadConfig::from_lookup(&move |name| map.get(name).cloned())
    }

    #[test]
    fn upstream_defaults() {
        let config = from(&[]).expect("defaults are valid");
        assert_eq!(config.backend, BackendKind::Bucket);
        assert_eq!(config.path, PathBuf::from("/data/file_storage"));
        assert_eq!(config.local_buffer_size, 1_342_177_280);
        assert_eq!(config.total_keys_limit, 10_000_000);
        assert_eq!(config.total_size_limit, 2_199_023_255_552);
        assert_eq!(config.bucket_size_limit, 268_435_456);
        assert_eq!(config.bucket_keys_limit, 500);
        assert_eq!(config.eviction_policy, EvictionPolicy::Fifo);
        assert_eq!(config.buffer_gc_ttl, Duration::from_millis(5000));
        assert!(!config.use_uring);
        assert_eq!(config.fsdir, "file_per_key_dir");
    }

    #[test]
    fn names_aliases_and_errors() {
        let config = from(&[
            ("MOONCAKE_USE_URING", "1"),
            ("MOONCAKE_BUCKET_EVICTION_POLICY", "lru"),
            (
                "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR",
                "file_per_key_storage_backend",
            ),
            ("MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES", "64 MiB"),
        ])
        .expect("valid");
        assert!(config.use_uring);
        assert_eq!(config.eviction_policy, EvictionPolicy::Lru);
        assert_eq!(config.backend, BackendKind::FilePerKey);
        assert_eq!(config.bucket_size_limit, 64 << 20);
        let error = from(&[("MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR", "tape")])
            .expect_err("unknown backend");
        assert_eq!(
            error.variable,
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"
        );
        assert!(error.to_string().contains("tape"), "{error}");
        for bad in [
            ("MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT", "0"),
            ("MOONCAKE_OFFLOAD_USE_URING", "maybe"),
            ("MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO", "1.5"),
            ("MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO", "0.95"),
        ] {
            let error = from(&[bad]).expect_err(bad.0);
            assert_eq!(error.variable, bad.0, "{error}");
        }
    }

    #[test]
    fn path_rules() {
        let dir = std::env::temp_dir().join(format!("mooncake-offload-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        assert_eq!(validate_path(&dir), Ok(()));
        let link = dir.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).expect("symlink");
        for bad in [
            PathBuf::new(),
            PathBuf::from("relative/dir"),
            dir.join("..").join("x"),
            dir.join("missing"),
            link.clone(),
        ] {
            let error = validate_path(&bad).expect_err(&bad.display().to_string());
            assert_eq!(error.variable, "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH");
        }
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
