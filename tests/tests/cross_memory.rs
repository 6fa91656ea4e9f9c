//! Registered ordinary memory in dummy mode: the real client copies it once, straight
//! between this process's heap and its segment (or, for another node, through its own
//! bounce buffer), and touches nothing the dummy did not declare.
//!
//! Every test here runs the real client as this process's user, so cross-memory copies
//! are permitted and the dummy's staging counter never moves. (The staging fallback,
//! with a real client that may not read this process, is tested in
//! `tests/python/test_zero_copy.py`.)

use std::time::Duration;

use mooncake_core::protocol::rpc::DummyInfo;
use mooncake_dummy_client::{
    DummyClient, ErrorCode, ReplicaLocation, ReplicateConfig, copied_through_staging_bytes,
};
use mooncake_integration_tests::{MasterProcess, RealClientProcess, eventually};

const MB: usize = 1 << 20;

/// A dummy with a 1 MiB staging buffer: every buffer below is larger.
fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(4 << 20, 1 << 20, Some(&node.address())).expect("setup_dummy")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i / 251).to_le_bytes()[0] ^ i.to_le_bytes()[0].wrapping_add(seed))
        .collect()
}

fn addr(buffer: &[u8]) -> u64 {
    buffer.as_ptr() as u64
}

fn len(bytes: usize) -> u64 {
    bytes as u64
}

/// This process's entry in the real client's status.
fn me(client: &DummyClient) -> DummyInfo {
    client
        .status()
        .expect("status")
        .dummies
        .into_iter()
        .find(|d| d.pid == std::process::id())
        .expect("this process is attached")
}

fn config() -> ReplicateConfig {
    ReplicateConfig::default()
}

#[test]
fn heap_memory_is_copied_once_by_the_real_client() {
    let real = RealClientProcess::start("128MB", &[]);
    let client = dummy(&real);
    let src = pattern(6 * MB, 1);
    let mut dst = vec![0u8; 6 * MB];
    let (s, d) = (addr(&src), dst.as_mut_ptr() as u64);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(s, len(6 * MB)) }.expect("register src");
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(d, len(6 * MB)) }.expect("register dst");
    let info = me(&client);
    assert!(info.cross_memory, "{info:?}");
    assert_eq!(info.declared_ranges, 2);
    let before = copied_through_staging_bytes();

    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.put_from("whole", s, len(6 * MB), &config()) }.expect("put_from");
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into("whole", d, len(6 * MB)) },
        Ok(len(6 * MB))
    );
    assert!(dst == src, "get_into differs");

    dst.fill(0);
    let keys = ["b0", "b1", "b2"];
    let at = |base: u64, i: usize| base + len(i * 2 * MB);
    let ptrs: Vec<u64> = (0..3).map(|i| at(s, i)).collect();
    let sizes = vec![len(2 * MB); 3];
    assert!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_put_from(&keys, &ptrs, &sizes, &config()) }
            .iter()
            .all(Result::is_ok)
    );
    let reversed: Vec<u64> = (0..3).map(|i| at(d, 2 - i)).collect();
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_get_into(&keys, &reversed, &sizes) },
        vec![Ok(len(2 * MB)); 3]
    );
    for i in 0..3 {
        let (from, to) = (i * 2 * MB, (2 - i) * 2 * MB);
        assert!(dst[to..to + 2 * MB] == src[from..from + 2 * MB], "key {i}");
    }

    dst.fill(0);
    let parts = [vec![s, s + len(3 * MB)]];
    let part_sizes = [vec![len(MB), len(2 * MB)]];
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_put_from_multi_buffers(&["multi"], &parts, &part_sizes, &config()) },
        vec![Ok(())]
    );
    let into = [vec![d, d + len(4 * MB)]];
    let into_sizes = [vec![len(MB + MB / 2), len(2 * MB)]];
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_get_into_multi_buffers(&["multi"], &into, &into_sizes, true) },
        vec![Ok(len(3 * MB))]
    );
    let expected = [&src[..MB], &src[3 * MB..5 * MB]].concat();
    assert!(dst[..MB + MB / 2] == expected[..MB + MB / 2]);
    assert!(dst[4 * MB..4 * MB + MB + MB / 2] == expected[MB + MB / 2..]);

    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let fragments = unsafe {
        client.get_into_ranges(
            &[d],
            &[vec!["whole".to_string()]],
            &vec![vec![vec![0, len(5 * MB)]]],
            &vec![vec![vec![len(MB), 7]]],
            &vec![vec![vec![len(2 * MB), 1000]]],
        )
    };
    assert_eq!(fragments, vec![vec![vec![Ok(len(2 * MB)), Ok(1000)]]]);
    assert!(dst[..2 * MB] == src[MB..3 * MB]);
    assert!(dst[5 * MB..5 * MB + 1000] == src[7..1007]);

    assert_eq!(
        copied_through_staging_bytes(),
        before,
        "nothing was copied through staging"
    );
}

#[test]
fn only_declared_ranges_are_read_or_written() {
    let real = RealClientProcess::start("64MB", &[]);
    let client = dummy(&real);
    let mut heap = pattern(MB, 2);
    let base = heap.as_mut_ptr() as u64;
    let inner = base + 4096;
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(inner, 65536) }.expect("register");
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.put_from("inside", inner, 65536, &config()) }
        .expect("inside the declared range");
    for (start, size) in [(inner + 61440, 8192), (base, 4096), (inner - 1, 2)] {
        assert_eq!(
            // SAFETY: the ranges are this client's pool memory or buffers registered with it,
            // alive for the call and touched by nothing else meanwhile (or deliberately
            // outside them, which the client refuses without touching).
            unsafe { client.put_from("outside", start, size, &config()) },
            Err(ErrorCode::INVALID_PARAMS),
            "{:#x}+{size} reaches past the declared range",
            start - base
        );
    }
    let untouched = heap[4096 + 65536..4096 + 2 * 65536].to_vec();
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into("inside", inner + 65536, 65536) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert!(heap[4096 + 65536..4096 + 2 * 65536] == untouched[..]);

    client.unregister_buffer(inner).expect("unregister");
    assert_eq!(me(&client).declared_ranges, 0, "the declaration is gone");
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.put_from("after", inner, 65536, &config()) },
        Err(ErrorCode::INVALID_PARAMS),
        "an unregistered buffer is never read"
    );
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into("inside", inner, 65536) },
        Err(ErrorCode::INVALID_PARAMS),
        "nor written"
    );
}

#[test]
fn declarations_are_sent_again_after_a_real_client_restart() {
    let mut real = RealClientProcess::start("64MB", &[]);
    let client = dummy(&real);
    let src = pattern(2 * MB, 3);
    let mut dst = vec![0u8; 2 * MB];
    let d = dst.as_mut_ptr() as u64;
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(addr(&src), len(2 * MB)) }.expect("src");
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(d, len(2 * MB)) }.expect("dst");
    let first = client.instance_id();
    real.restart();
    assert!(
        eventually(Duration::from_secs(5), || client.is_exist("x").is_ok()),
        "the dummy did not reconnect"
    );
    assert_ne!(client.instance_id(), first);
    let info = me(&client);
    assert_eq!(info.declared_ranges, 2, "{info:?}");
    assert!(info.cross_memory);
    let before = copied_through_staging_bytes();
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.put_from("again", addr(&src), len(2 * MB), &config()) }.expect("put_from");
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into("again", d, len(2 * MB)) },
        Ok(len(2 * MB))
    );
    assert!(dst == src);
    assert_eq!(copied_through_staging_bytes(), before);
}

fn on(segment: &str) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segment: segment.to_string(),
        ..ReplicateConfig::default()
    }
}

fn segments_of(client: &DummyClient, key: &str) -> Vec<String> {
    let mut names: Vec<String> = client
        .get_replica_desc(key)
        .expect("descriptors")
        .iter()
        .filter(|r| matches!(r.location, ReplicaLocation::Memory { .. }))
        .map(|r| r.location.segment_name().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn heap_memory_reaches_other_nodes_through_the_real_clients_bounce_buffer() {
    let master = MasterProcess::start(&[]);
    let a = RealClientProcess::join(&master, "64MB", &[]);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let client = dummy(&a);
    let src = pattern(3 * MB, 4);
    let mut dst = vec![0u8; 3 * MB];
    let d = dst.as_mut_ptr() as u64;
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(addr(&src), len(3 * MB)) }.expect("src");
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(d, len(3 * MB)) }.expect("dst");
    let before = copied_through_staging_bytes();

    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.put_from("on-b", addr(&src), len(3 * MB), &on(&b.segment_name())) }
        .expect("put_from to node B");
    assert_eq!(segments_of(&client, "on-b"), vec![b.segment_name()]);
    let into = [vec![d, d + len(MB)]];
    let sizes = [vec![len(MB), len(2 * MB)]];
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_get_into_multi_buffers(&["on-b"], &into, &sizes, false) },
        vec![Ok(len(3 * MB))]
    );
    assert!(dst == src, "read back from node B");

    dst.fill(0);
    let both = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    let parts = [vec![addr(&src), addr(&src) + len(2 * MB)]];
    let part_sizes = [vec![len(2 * MB), len(MB)]];
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.batch_put_from_multi_buffers(&["on-both"], &parts, &part_sizes, &both) },
        vec![Ok(())]
    );
    let mut expected = vec![a.segment_name(), b.segment_name()];
    expected.sort();
    assert_eq!(segments_of(&client, "on-both"), expected);
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into("on-both", d, len(3 * MB)) },
        Ok(len(3 * MB))
    );
    assert!(dst == src);
    assert_eq!(copied_through_staging_bytes(), before);
}
