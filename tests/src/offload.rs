//! Helpers of the SSD-tier tests: scratch directories, test values, dummies on a node,
//! and checks of where the master says an object lives.

use std::path::PathBuf;
use std::time::Duration;

use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicaLocation, ReplicateConfig};

use crate::{RealClientProcess, eventually};

/// A fresh directory, removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A directory named after `name`, this process and a counter.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "mooncake-offload-{name}-{}-{}",
            std::process::id(),
            crate::unique_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        TempDir(dir)
    }

    /// Its path.
    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 path")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A dummy (64 MiB pool, 8 MiB staging) of `node`.
pub fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(64 << 20, 8 << 20, Some(&node.address())).expect("setup_dummy")
}

/// `len` bytes that differ per `i` and position.
pub fn value(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)).to_le_bytes()[0])
        .collect()
}

/// True when the master lists a disk copy of `key`.
pub fn on_disk(client: &DummyClient, key: &str) -> bool {
    client.get_replica_desc(key).is_ok_and(|replicas| {
        replicas
            .iter()
            .any(|r| matches!(r.location, ReplicaLocation::Disk { .. }))
    })
}

/// True when every copy of `key` the master lists is on disk.
pub fn only_on_disk(client: &DummyClient, key: &str) -> bool {
    client.get_replica_desc(key).is_ok_and(|replicas| {
        replicas
            .iter()
            .all(|r| matches!(r.location, ReplicaLocation::Disk { .. }))
    })
}

/// Waits (10 s at most) until `key` reads back as `value(i, 1 MiB)`.
pub fn comes_back(client: &DummyClient, key: &str, i: usize) -> bool {
    eventually(Duration::from_secs(10), || {
        client.get(key).is_ok_and(|v| v == value(i, 1 << 20))
    })
}

/// Asserts that `key` reads as not found.
pub fn assert_gone(client: &DummyClient, key: &str, why: &str) {
    assert_eq!(
        client.get(key).map(|_| ()),
        Err(ErrorCode::OBJECT_NOT_FOUND),
        "{key}: {why}"
    );
}

/// Puts `count` objects of 1 MiB named `<prefix><i>` on `node` and waits until they
/// are all on its disk.
pub fn put_and_offload(client: &DummyClient, node: &RealClientProcess, prefix: &str, count: usize) {
    let config = ReplicateConfig {
        preferred_segment: node.segment_name(),
        ..ReplicateConfig::default()
    };
    for i in 0..count {
        client
            .put(&format!("{prefix}{i}"), &value(i, 1 << 20), &config)
            .expect("put");
    }
    let all = eventually(Duration::from_secs(10), || {
        (0..count).all(|i| on_disk(client, &format!("{prefix}{i}")))
    });
    let missing: Vec<usize> = (0..count)
        .filter(|i| !on_disk(client, &format!("{prefix}{i}")))
        .collect();
    assert!(all, "objects {prefix}{missing:?} did not reach the disk");
}

/// Puts `first-0..8` (1 MiB each) and then 24 MiB more, in waves the SSD tier keeps
/// up with, so the first objects leave memory and live only in the tier.
pub fn put_past_memory(client: &DummyClient, node: &RealClientProcess) {
    put_and_offload(client, node, "first-", 8);
    for wave in 0..6 {
        put_and_offload(client, node, &format!("more{wave}-"), 4);
    }
}

/// Asserts that one batched get of the objects `first-{i}` for each of `indices`
/// (1 MiB each, all on the node's disk), with a missing key among them, reads each
/// byte-exact into the client's pool, in the order given and in the reverse order (on
/// disk the second order is scattered: several readers), and answers
/// `OBJECT_NOT_FOUND` for the missing key alone.
pub fn assert_batch_reads_from_disk(client: &DummyClient, indices: &[usize]) {
    let mut orders = vec![indices.to_vec()];
    orders.push(indices.iter().rev().copied().collect());
    for order in orders {
        let mut keys: Vec<String> = order.iter().map(|i| format!("first-{i}")).collect();
        keys.insert(keys.len() / 2, "never-stored".to_string());
        let read = batch_get_into_pool(client, &keys);
        for (key, (result, got)) in keys.iter().zip(read) {
            if key == "never-stored" {
                assert_eq!(result, Err(ErrorCode::OBJECT_NOT_FOUND), "{key}");
                continue;
            }
            assert_eq!(result, Ok(1 << 20), "{key}");
            let i: usize = key["first-".len()..].parse().expect("index");
            assert!(got == value(i, 1 << 20), "{key}: wrong bytes in a batch");
        }
    }
}

/// One `batch_get_into` of `keys`, each into a 1 MiB block of the client's pool: each
/// key's result and the block's bytes afterwards (the pool blocks are freed).
pub fn batch_get_into_pool(
    client: &DummyClient,
    keys: &[String],
) -> Vec<(Result<u64, ErrorCode>, Vec<u8>)> {
    let dests: Vec<u64> = keys
        .iter()
        .map(|_| client.alloc_from_mem_pool(1 << 20))
        .collect();
    let sizes = vec![1u64 << 20; keys.len()];
    // SAFETY: each destination is a live pool block of 1 MiB owned by this caller and
    // touched by nothing else during the call.
    let results = unsafe { client.batch_get_into(keys, &dests, &sizes) };
    let read = results
        .into_iter()
        .zip(&dests)
        .map(|(result, dest)| {
            // SAFETY: `dest` is a live pool block of 1 MiB owned by this caller.
            let bytes = unsafe { std::slice::from_raw_parts(*dest as *const u8, 1 << 20) };
            (result, bytes.to_vec())
        })
        .collect();
    for dest in dests {
        client.free_to_mem_pool(dest).expect("free");
    }
    read
}

/// Asserts that `key` reads as `value(i, 1 MiB)` through each `(dummy, name)`.
pub fn assert_reads_through(readers: &[(&DummyClient, &str)], key: &str, i: usize) {
    for (reader, name) in readers {
        assert!(
            reader.get(key).expect(name) == value(i, 1 << 20),
            "{key} via {name}"
        );
    }
}

/// Asserts that `key` reads as `value(i, 1 MiB)` into a block of `client`'s pool, as an
/// engine reads (zero-copy).
pub fn assert_reads_into_pool(client: &DummyClient, key: &str, i: usize) {
    let dest = client.alloc_from_mem_pool(1 << 20);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    assert_eq!(unsafe { client.get_into(key, dest, 1 << 20) }, Ok(1 << 20));
    // SAFETY: `dest` is a live pool block of 1 MiB owned by this caller.
    let got = unsafe { std::slice::from_raw_parts(dest as *const u8, 1 << 20) };
    assert!(got == value(i, 1 << 20).as_slice(), "{key} into the pool");
    client.free_to_mem_pool(dest).expect("free");
}
