//! The distributed-KV conformance suite run against the C plugin interface with the
//! in-repo test plugin (`tests/plugin/memory_plugin.c`, built by this test with the
//! system C compiler), the plugin loader's errors, and the backend over the plugin.

use std::path::{Path, PathBuf};
use std::process::Command;

use mooncake_offload::dkv::conformance::{check as conformance, value};
use mooncake_offload::dkv::plugin::{PluginClient, PluginError};
use mooncake_offload::dkv::{DkvClient, DkvError};

/// Compiles C `source` into a shared library named `name` in the test's scratch
/// directory; returns its path.
fn build_library(name: &str, source: &Path, extra: &[&str]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let out = dir.join(format!("lib{name}-{}.so", std::process::id()));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(source)
        .args(extra)
        .arg("-lpthread")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {compiler:?}: {e}"));
    assert!(status.success(), "building {name} failed");
    out
}

/// The test plugin, built once per test process.
fn test_plugin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/plugin/memory_plugin.c");
            build_library("memory_plugin", &source, &[])
        })
        .clone()
}

#[test]
fn the_test_plugin_passes_the_conformance_suite() {
    let client = PluginClient::open(&test_plugin(), "").expect("open");
    conformance(&client, "suite");
    assert_eq!(client.capacity(), None);
    assert!(client.describe().contains("memory_plugin"));
}

#[test]
fn the_plugin_is_shared_by_threads() {
    let client: std::sync::Arc<dyn DkvClient> =
        std::sync::Arc::new(PluginClient::open(&test_plugin(), "").expect("open"));
    mooncake_offload::dkv::conformance::check_shared(&client, "shared");
}

#[test]
fn a_store_with_a_capacity_reports_it_and_refuses_more() {
    let client = PluginClient::open(&test_plugin(), "capacity=1000").expect("open");
    assert_eq!(client.capacity(), Some(1000));
    let big = value(1, 900);
    assert_eq!(client.batch_put(&[(b"x", &big)]), vec![Ok(())]);
    assert_eq!(client.batch_put(&[(b"y", &big)]), vec![Err(DkvError::Full)]);
}

#[test]
fn loading_errors_name_the_variable_and_the_cause() {
    let missing = PluginClient::open(Path::new("/nonexistent/libnothing.so"), "");
    let error = missing.expect_err("no library").to_string();
    assert!(
        error.starts_with("MOONCAKE_OFFLOAD_DKV_PLUGIN=/nonexistent/libnothing.so"),
        "{error}"
    );

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let partial_source = dir.join("partial_plugin.c");
    std::fs::write(
        &partial_source,
        "#include <stdint.h>\nuint32_t mooncake_dkv_abi_version(void) { return 2; }\n",
    )
    .expect("write source");
    let partial = build_library("partial_plugin", &partial_source, &[]);
    assert!(matches!(
        PluginClient::open(&partial, ""),
        Err(PluginError::Symbol {
            symbol: "mooncake_dkv_init",
            ..
        })
    ));

    let future_source = dir.join("future_plugin.c");
    std::fs::write(
        &future_source,
        "#include <stdint.h>\nuint32_t mooncake_dkv_abi_version(void) { return 99; }\n",
    )
    .expect("write source");
    let future = build_library("future_plugin", &future_source, &[]);
    assert!(matches!(
        PluginClient::open(&future, ""),
        Err(PluginError::Version { found: 99, .. })
    ));

    assert!(matches!(
        PluginClient::open(&test_plugin(), "refuse"),
        Err(PluginError::Init { .. })
    ));
}

mod backend {
    use std::sync::Arc;

    use mooncake_offload::backend::{Limits, StorageBackend, StoreError};
    use mooncake_offload::config::EvictionPolicy;
    use mooncake_offload::dkv::DkvClient;
    use mooncake_offload::dkv::backend::{DkvStore, key_prefix};
    use mooncake_offload::dkv::plugin::PluginClient;

    use super::{test_plugin, value};

    fn client(config: &str) -> Arc<dyn DkvClient> {
        Arc::new(PluginClient::open(&test_plugin(), config).expect("open"))
    }

    fn open(client: &Arc<dyn DkvClient>, ns: &str, limits: Limits) -> DkvStore {
        DkvStore::open(
            Arc::clone(client),
            &key_prefix(ns, ""),
            limits,
            EvictionPolicy::Fifo,
        )
        .expect("open")
        .0
    }

    fn write(store: &mut DkvStore, key: &str, v: &[u8]) -> Vec<String> {
        let eviction = store.make_room(&[(key, v)]).expect("room");
        let evicted = eviction.keys.clone();
        store.finish_eviction(eviction);
        store.write_batch(&[(key, v)]).expect("write");
        evicted
    }

    fn read(store: &mut DkvStore, key: &str) -> Result<Vec<u8>, StoreError> {
        let mut dest = vec![0u8; 1 << 20];
        let len = store.read_into(key, &mut dest)?;
        dest.truncate(usize::try_from(len).expect("small"));
        Ok(dest)
    }

    #[test]
    fn objects_round_trip_survive_a_restart_by_scan_and_namespaces_are_apart() {
        let shared = client("");
        let mut a = open(&shared, "cluster-a", Limits::bytes(1 << 30));
        let mut b = open(&shared, "cluster-b", Limits::bytes(1 << 30));
        write(&mut a, "t\u{1f}k1", &value(1, 5000));
        write(&mut a, "k2", &value(2, 70_000));
        write(&mut b, "k1", &value(3, 10));
        assert_eq!(read(&mut a, "t\u{1f}k1").expect("k1"), value(1, 5000));
        assert!(matches!(read(&mut b, "k2"), Err(StoreError::NotFound)));
        assert!(a.remove("k2"));
        drop(a);
        // A restarted node finds its objects by scanning its namespace.
        let (mut a, report) = DkvStore::open(
            Arc::clone(&shared),
            &key_prefix("cluster-a", ""),
            Limits::bytes(1 << 30),
            EvictionPolicy::Fifo,
        )
        .expect("reopen");
        assert_eq!((report.objects, report.corrupt_records), (1, 0));
        assert_eq!(
            read(&mut a, "t\u{1f}k1").expect("after restart"),
            value(1, 5000)
        );
        assert!(matches!(read(&mut a, "k2"), Err(StoreError::NotFound)));
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn nodes_sharing_a_namespace_see_only_their_own_objects() {
        let shared = client("");
        let node = |name: &str| {
            DkvStore::open(
                Arc::clone(&shared),
                &key_prefix("ns", name),
                Limits::bytes(1 << 30),
                EvictionPolicy::Fifo,
            )
            .expect("open")
        };
        let (mut a, _) = node("10.0.0.1:50052");
        write(&mut a, "k", &value(1, 100));
        let (mut b, report) = node("10.0.0.2:50052");
        assert_eq!(report.objects, 0, "B recovered A's object");
        write(&mut b, "k", &value(2, 100));
        assert!(b.remove("k"));
        assert_eq!(read(&mut a, "k").expect("A's copy"), value(1, 100));
        let (_, report) = node("10.0.0.1:50052");
        assert_eq!(report.objects, 1, "A recovers its own object");
    }

    #[test]
    fn foreign_values_are_detected_and_eviction_deletes_from_the_store() {
        let shared = client("");
        let mut store = open(
            &shared,
            "ns",
            Limits {
                bytes: 1 << 30,
                keys: 2,
            },
        );
        write(&mut store, "a", &value(1, 100));
        write(&mut store, "b", &value(2, 100));
        assert_eq!(write(&mut store, "c", &value(3, 100)), ["a"], "fifo");
        assert_eq!(
            shared.batch_exists(&[b"ns/a"]),
            vec![Ok(false)],
            "deleted in the store"
        );
        // Someone else's bytes under our key: never handed out as the object.
        let garbage = vec![7u8; 24 + 1 + 100];
        assert_eq!(shared.batch_put(&[(b"ns/b", &garbage)]), vec![Ok(())]);
        assert!(matches!(read(&mut store, "b"), Err(StoreError::Corrupt(_))));
        assert!(!store.contains("b"));
        // Recovery leaves out values too short to be records.
        assert_eq!(shared.batch_put(&[(b"ns/short", b"xy")]), vec![Ok(())]);
        let (_, report) = DkvStore::open(
            Arc::clone(&shared),
            &key_prefix("ns", ""),
            Limits::bytes(1 << 30),
            EvictionPolicy::Fifo,
        )
        .expect("reopen");
        assert_eq!(report.corrupt_records, 1);
    }

    #[test]
    fn a_partially_failed_batch_leaves_nothing_in_the_store() {
        // The store (shared with others) has room for two of the three records (125
        // bytes each): the batch fails and the two stored are deleted again.
        let shared = client("capacity=400");
        assert_eq!(shared.batch_put(&[(b"other/k", &[0u8; 150])]), vec![Ok(())]);
        let mut store = open(&shared, "ns", Limits::bytes(1 << 30));
        assert_eq!(
            store.limits().bytes,
            400,
            "the store's capacity caps the limit"
        );
        let v = value(1, 100);
        let batch = [
            ("x", v.as_slice()),
            ("y", v.as_slice()),
            ("z", v.as_slice()),
        ];
        assert!(store.write_batch(&batch).is_err());
        assert_eq!(store.len(), 0);
        assert_eq!(
            shared.batch_exists(&[b"ns/x", b"ns/y", b"ns/z"]),
            vec![Ok(false), Ok(false), Ok(false)]
        );
    }
}
