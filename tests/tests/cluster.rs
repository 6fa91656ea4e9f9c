//! Cluster tests: one real `mooncake_master`, several `mooncake_client`s on loopback,
//! dummies attached to different nodes.

use std::io::Write;
use std::time::Duration;

use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicaLocation, ReplicateConfig, TaskStatus};
use mooncake_integration_tests::{MasterProcess, RealClientProcess, eventually, http_get, sample};

fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(64 << 20, 8 << 20, Some(&node.address())).expect("setup_dummy")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| i.to_le_bytes()[0].wrapping_mul(7).wrapping_add(seed))
        .collect()
}

fn on(segment: &str) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segment: segment.to_string(),
        ..ReplicateConfig::default()
    }
}

/// Waits until the master lists `count` segments: a node serves its socket before its
/// segment is mounted, and a put preferring an unmounted segment lands elsewhere.
fn wait_mounted(client: &DummyClient, count: usize) {
    let mounted = eventually(Duration::from_secs(10), || {
        client
            .status()
            .is_ok_and(|s| s.master.segments.len() == count)
    });
    assert!(mounted, "the master does not list {count} segments");
}

fn segments_of(client: &DummyClient, key: &str) -> Vec<String> {
    client
        .get_replica_desc(key)
        .expect("descriptors")
        .iter()
        .filter(|r| matches!(r.location, ReplicaLocation::Memory { .. }))
        .map(|r| r.location.segment_name().to_string())
        .collect()
}

#[test]
fn objects_put_on_one_node_are_read_byte_exact_on_the_others() {
    let master = MasterProcess::start(&[]);
    let nodes: Vec<_> = (0..3)
        .map(|_| RealClientProcess::join(&master, "128MB", &[]))
        .collect();
    let dummies: Vec<_> = nodes.iter().map(dummy).collect();
    wait_mounted(&dummies[0], 3);
    for (i, size) in [4usize << 10, 1 << 20, 16 << 20].into_iter().enumerate() {
        let value = pattern(size, i.to_le_bytes()[0]);
        // Force the object onto node C's segment, write through A (A → C transfer).
        let key = format!("obj-{size}");
        dummies[0]
            .put(&key, &value, &on(&nodes[2].segment_name()))
            .expect("put via A");
        assert_eq!(
            segments_of(&dummies[1], &key),
            vec![nodes[2].segment_name()]
        );
        for reader in &dummies {
            assert!(
                reader.get(&key).expect("get") == value,
                "{size} bytes differ"
            );
        }
        // Zero-copy path: B reads from C straight into its pool.
        let dest = dummies[1].alloc_from_mem_pool(size as u64);
        assert_eq!(
            // SAFETY: the ranges are this client's pool memory or buffers registered with it,
            // alive for the call and touched by nothing else meanwhile (or deliberately
            // outside them, which the client refuses without touching).
            unsafe { dummies[1].get_into(&key, dest, size as u64) },
            Ok(size as u64)
        );
        // SAFETY: `dest` is a live pool block of `size` bytes owned by this test.
        let got = unsafe { std::slice::from_raw_parts(dest as *const u8, size) };
        assert!(got == value.as_slice());
        // And B writes zero-copy from its pool to A's segment.
        let copy = format!("copy-{size}");
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummies[1].put_from(&copy, dest, size as u64, &on(&nodes[0].segment_name())) }
            .expect("put_from to A");
        assert!(dummies[2].get(&copy).expect("get") == value);
        dummies[1].free_to_mem_pool(dest).expect("free");
    }
}

#[test]
fn batches_read_from_another_node_are_byte_exact_and_fail_per_key() {
    let master = MasterProcess::start(&[]);
    let nodes: Vec<_> = (0..2)
        .map(|_| RealClientProcess::join(&master, "128MB", &[]))
        .collect();
    let writer = dummy(&nodes[0]);
    wait_mounted(&writer, 2);
    let (count, size) = (40usize, 4096usize);
    let keys: Vec<String> = (0..count).map(|i| format!("batch-{i}")).collect();
    let source = writer.alloc_from_mem_pool((count * size) as u64);
    let values: Vec<Vec<u8>> = (0..count)
        .map(|i| pattern(size, i.to_le_bytes()[0]))
        .collect();
    for (i, value) in values.iter().enumerate() {
        // SAFETY: `source` is a live pool block of `count * size` bytes of this test.
        let block = unsafe {
            std::slice::from_raw_parts_mut((source + (i * size) as u64) as *mut u8, size)
        };
        block.copy_from_slice(value);
    }
    let ptrs: Vec<u64> = (0..count).map(|i| source + (i * size) as u64).collect();
    let sizes = vec![size as u64; count];
    // Every object lives in node B's segment; a reader attached to node A pulls the
    // batch from B over TCP, pipelined, with one missing key among them.
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let puts =
        unsafe { writer.batch_put_from(&keys, &ptrs, &sizes, &on(&nodes[1].segment_name())) };
    assert!(puts.iter().all(Result::is_ok), "{puts:?}");
    let reader_on_a = dummy(&nodes[0]);
    let mut asked = keys.clone();
    asked[7] = "missing".to_string();
    let dest = reader_on_a.alloc_from_mem_pool((count * size) as u64);
    let dests: Vec<u64> = (0..count).map(|i| dest + (i * size) as u64).collect();
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let got = unsafe { reader_on_a.batch_get_into(&asked, &dests, &sizes) };
    for (i, outcome) in got.iter().enumerate() {
        if i == 7 {
            assert_eq!(*outcome, Err(ErrorCode::OBJECT_NOT_FOUND));
            continue;
        }
        assert_eq!(*outcome, Ok(size as u64), "item {i}");
        // SAFETY: as above, for the reader's block.
        let bytes = unsafe { std::slice::from_raw_parts(dests[i] as *const u8, size) };
        assert!(bytes == values[i].as_slice(), "item {i} differs");
    }
}

#[test]
fn replica_num_two_lands_on_two_segments() {
    let master = MasterProcess::start(&[]);
    let nodes: Vec<_> = (0..3)
        .map(|_| RealClientProcess::join(&master, "64MB", &[]))
        .collect();
    let client = dummy(&nodes[0]);
    wait_mounted(&client, 3);
    let config = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    for i in 0..10 {
        let key = format!("r2-{i}");
        client.put(&key, &pattern(1000, i), &config).expect("put");
        let mut segments = segments_of(&client, &key);
        segments.dedup();
        assert_eq!(segments.len(), 2, "{segments:?}");
    }
}

#[test]
fn a_dead_node_loses_its_objects_but_replicated_ones_survive() {
    let master = MasterProcess::start(&["--client_ttl=2"]);
    let a = RealClientProcess::join(&master, "64MB", &[]);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let mut c = RealClientProcess::join(&master, "64MB", &[]);
    let client = dummy(&a);
    wait_mounted(&client, 3);
    let single = pattern(100_000, 1);
    client
        .put("only-on-c", &single, &on(&c.segment_name()))
        .expect("put");
    assert_eq!(segments_of(&client, "only-on-c"), vec![c.segment_name()]);
    let replicated = pattern(100_000, 2);
    let two = ReplicateConfig {
        replica_num: 2,
        preferred_segments: vec![c.segment_name(), b.segment_name()],
        ..ReplicateConfig::default()
    };
    client.put("on-c-and-b", &replicated, &two).expect("put");
    assert_eq!(segments_of(&client, "on-c-and-b").len(), 2);

    c.kill9();
    // client_ttl (2 s), with room for a machine loaded by the other tests: the master
    // notices the silence at its next maintenance pass after the TTL.
    let mut last = None;
    let gone = eventually(Duration::from_secs(15), || {
        last = Some(client.is_exist("only-on-c"));
        last == Some(Ok(false))
    });
    assert!(
        gone,
        "the object whose only replica died is still listed (last is_exist: {last:?})"
    );
    assert_eq!(client.get("on-c-and-b").expect("replica on B"), replicated);
    assert_eq!(segments_of(&client, "on-c-and-b"), vec![b.segment_name()]);
    let reader_b = dummy(&b);
    assert_eq!(reader_b.get("on-c-and-b").expect("read via B"), replicated);
}

#[test]
fn eviction_makes_room_but_never_takes_hard_pinned_objects() {
    let master = MasterProcess::start(&["--eviction_high_watermark_ratio=0.8"]);
    let nodes: Vec<_> = (0..2)
        .map(|_| RealClientProcess::join(&master, "32MB", &[]))
        .collect();
    let client = dummy(&nodes[0]);
    wait_mounted(&client, 2);
    let pinned = ReplicateConfig {
        with_hard_pin: true,
        ..ReplicateConfig::default()
    };
    let value = pattern(1 << 20, 3);
    for i in 0..8 {
        client
            .put(&format!("pinned-{i}"), &value, &pinned)
            .expect("pinned put");
    }
    // 64 MiB of cluster memory; write 150 MiB of ordinary objects.
    for i in 0..150 {
        client
            .put(&format!("cache-{i}"), &value, &ReplicateConfig::default())
            .expect("eviction makes room");
    }
    // Ask for the newest object first: every is_exist counts as an access, so after the
    // sweep below the newest object would be the least recently used one, and a
    // background eviction pass may rightly take it.
    assert_eq!(
        client.is_exist("cache-149"),
        Ok(true),
        "the newest object was evicted before older ones"
    );
    for i in 0..8 {
        assert_eq!(
            client.is_exist(&format!("pinned-{i}")),
            Ok(true),
            "hard-pinned object {i} was evicted"
        );
    }
    let survivors = (0..150)
        .filter(|i| client.is_exist(&format!("cache-{i}")) == Ok(true))
        .count();
    assert!(survivors < 150, "nothing was evicted");
    assert!(client.status().expect("status").master.evicted_objects > 0);
}

#[test]
fn a_cluster_full_of_pinned_data_refuses_with_no_available_handle() {
    let master = MasterProcess::start(&[]);
    let node = RealClientProcess::join(&master, "8MB", &[]);
    let client = dummy(&node);
    let pinned = ReplicateConfig {
        with_hard_pin: true,
        ..ReplicateConfig::default()
    };
    let value = pattern(1 << 20, 4);
    let mut stored = 0;
    while client.put(&format!("p{stored}"), &value, &pinned).is_ok() {
        stored += 1;
        assert!(stored < 64, "an 8 MB segment took 64 MB");
    }
    assert_eq!(
        client.put("one-more", &value, &ReplicateConfig::default()),
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    assert_eq!(ErrorCode::NO_AVAILABLE_HANDLE.as_i32(), -200);
}

#[test]
fn real_clients_remount_after_a_master_restart() {
    let mut master = MasterProcess::start(&[]);
    let a = RealClientProcess::join(&master, "32MB", &[]);
    let b = RealClientProcess::join(&master, "32MB", &[]);
    let client = dummy(&a);
    // A node serves its socket before its segment is mounted: restart the master only
    // once both are.
    assert!(eventually(Duration::from_secs(5), || {
        client.status().is_ok_and(|s| s.master.segments.len() == 2)
    }));
    client
        .put("before", b"x", &ReplicateConfig::default())
        .expect("put");
    master.restart();
    let remounted = eventually(Duration::from_secs(5), || {
        client.status().is_ok_and(|s| s.master.segments.len() == 2)
    });
    assert!(remounted, "real clients did not remount within 5 s");
    client
        .put("after", &pattern(4096, 5), &on(&b.segment_name()))
        .expect("put after restart");
    assert_eq!(dummy(&b).get("after").expect("get"), pattern(4096, 5));
}

#[test]
fn bad_input_to_the_master_is_refused_and_it_keeps_serving() {
    let master = MasterProcess::start(&[]);
    let node = RealClientProcess::join(&master, "32MB", &[]);
    let client = dummy(&node);
    let zero = ReplicateConfig {
        replica_num: 0,
        ..ReplicateConfig::default()
    };
    assert_eq!(client.put("k", b"v", &zero), Err(ErrorCode::INVALID_PARAMS));
    let long_pin = ReplicateConfig {
        soft_pin_action: mooncake_dummy_client::SoftPinAction::Enable,
        soft_pin_ttl_ms: Some(48 * 3600 * 1000),
        ..ReplicateConfig::default()
    };
    assert_eq!(
        client.put("k", b"v", &long_pin),
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        client.put("k", b"", &ReplicateConfig::default()),
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        client.put(&"k".repeat(5000), b"v", &ReplicateConfig::default()),
        Err(ErrorCode::INVALID_KEY)
    );
    assert_eq!(
        client.remove_by_regex("(unclosed", true),
        Err(ErrorCode::INVALID_PARAMS)
    );
    let nowhere = on("no-such-node:1");
    assert_eq!(
        client.put("placed", b"v", &nowhere),
        Ok(()),
        "an unknown preferred segment falls back to any segment"
    );
    assert_eq!(
        client.create_copy_task("placed", &["no-such-node:1".to_string()]),
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    );
    // Garbage on the master's port: that connection is dropped, the master serves on.
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", master.port)).expect("connect");
    let _ = raw.write_all(&[0, 0, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    let _ = raw.write_all(&[0xff; 64]);
    drop(raw);
    client
        .put("still-serving", b"v", &ReplicateConfig::default())
        .expect("master still serves");
    assert_eq!(client.get("still-serving").expect("get"), b"v");
}

fn finished(client: &DummyClient, id: u128) -> TaskStatus {
    let mut status = TaskStatus::Pending;
    eventually(Duration::from_secs(10), || {
        status = client.query_task(id).expect("task known").status;
        !matches!(status, TaskStatus::Pending | TaskStatus::Running)
    });
    status
}

#[test]
fn copy_and_move_tasks_are_executed_by_the_owning_node() {
    let master = MasterProcess::start(&["--client_ttl=2"]);
    let mut a = RealClientProcess::join(&master, "64MB", &[]);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let c = RealClientProcess::join(&master, "64MB", &[]);
    // Tasks are asked for through C; A owns the source and does the copying.
    let via_c = dummy(&c);
    wait_mounted(&via_c, 3);
    let copied = pattern(3 << 20, 3);
    via_c
        .put("copied", &copied, &on(&a.segment_name()))
        .expect("put");
    let id = via_c
        .create_copy_task("copied", &[b.segment_name(), c.segment_name()])
        .expect("copy task");
    assert_eq!(finished(&via_c, id), TaskStatus::Success);
    let mut holders = segments_of(&via_c, "copied");
    holders.sort();
    let mut expected = vec![a.segment_name(), b.segment_name(), c.segment_name()];
    expected.sort();
    assert_eq!(holders, expected);

    let moved = pattern(1 << 20, 4);
    via_c
        .put("moved", &moved, &on(&a.segment_name()))
        .expect("put");
    let id = via_c
        .create_move_task("moved", &a.segment_name(), &b.segment_name())
        .expect("move task");
    assert_eq!(finished(&via_c, id), TaskStatus::Success);
    assert_eq!(segments_of(&via_c, "moved"), vec![b.segment_name()]);

    // The copies are real: with A gone, both objects read byte-exact from B and C.
    a.kill9();
    let a_gone = eventually(Duration::from_secs(4), || {
        segments_of(&via_c, "copied").len() == 2
    });
    assert!(a_gone, "A's replica is still listed");
    assert_eq!(via_c.get("copied").expect("copy on C"), copied);
    assert_eq!(dummy(&b).get("copied").expect("copy on B"), copied);
    assert_eq!(dummy(&b).get("moved").expect("moved to B"), moved);
}

#[test]
fn tenants_have_separate_key_spaces() {
    let master = MasterProcess::start(&[]);
    let acme_node = RealClientProcess::join(&master, "64MB", &["--tenant_id=acme"]);
    let globex_node = RealClientProcess::join(&master, "64MB", &["--tenant_id=globex"]);
    let default_node = RealClientProcess::join(&master, "64MB", &[]);
    let (acme, globex, default) = (dummy(&acme_node), dummy(&globex_node), dummy(&default_node));
    let any = ReplicateConfig::default();
    acme.put("shared-name", b"acme's", &any).expect("put acme");
    assert_eq!(globex.is_exist("shared-name"), Ok(false));
    assert_eq!(default.is_exist("shared-name"), Ok(false));
    globex
        .put("shared-name", b"globex's", &any)
        .expect("put globex");
    default
        .put("shared-name", b"default's", &any)
        .expect("put default");
    assert_eq!(acme.get("shared-name").expect("get"), b"acme's");
    assert_eq!(globex.get("shared-name").expect("get"), b"globex's");
    assert_eq!(default.get("shared-name").expect("get"), b"default's");
    // Bulk removal sees only the caller's tenant; patterns match the caller's keys.
    assert_eq!(default.remove_by_regex("^shared-name$", true), Ok(1));
    assert_eq!(globex.remove_all(true), Ok(1));
    assert_eq!(acme.get("shared-name").expect("acme's survives"), b"acme's");
    // Tasks of another tenant are invisible.
    let id = acme
        .create_copy_task("shared-name", &[acme_node.segment_name()])
        .expect("task");
    assert!(acme.query_task(id).is_ok());
    assert_eq!(
        globex.query_task(id).map(|t| t.key),
        Err(ErrorCode::TASK_NOT_FOUND)
    );
    // The separator is reserved.
    assert_eq!(
        default.put("acme\u{1f}shared-name", b"x", &any),
        Err(ErrorCode::INVALID_KEY)
    );
}

#[test]
fn an_invalid_tenant_name_is_a_startup_error() {
    let status = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args(["--tenant_id=bad name", "--global_segment_size=16MB"])
        .output()
        .expect("run mooncake_client");
    assert!(!status.status.success());
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert!(stderr.contains("tenant_id"), "{stderr}");
}

/// `GET path` on `127.0.0.1:port`; the body.
#[test]
fn master_and_node_export_operation_metrics() {
    let metrics_port = mooncake_integration_tests::free_tcp_port();
    let master = MasterProcess::start(&[&format!("--metrics_port={metrics_port}")]);
    let http_port = mooncake_integration_tests::free_tcp_port();
    let node = RealClientProcess::join(
        &master,
        "64MB",
        &[
            "--enable_http_server=true",
            &format!("--http_port={http_port}"),
        ],
    );
    let client = dummy(&node);
    for i in 0..5 {
        client
            .put(
                &format!("m{i}"),
                &pattern(1000, i),
                &ReplicateConfig::default(),
            )
            .expect("put");
    }
    assert!(client.get("m0").is_ok());
    assert_eq!(
        client.get("missing").map(|_| ()),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );

    let text = http_get(metrics_port, "/metrics");
    assert!(sample(&text, "mooncake_master_requests_total{op=\"put_start\"}") >= 5.0);
    assert!(sample(&text, "mooncake_master_bytes_total{op=\"put_start\"}") >= 5000.0);
    assert!(
        sample(
            &text,
            "mooncake_master_errors_total{op=\"get_replica_list\",code=\"OBJECT_NOT_FOUND\"}"
        ) >= 1.0
    );
    assert!(
        sample(
            &text,
            "mooncake_master_latency_seconds_count{op=\"put_end\"}"
        ) >= 5.0
    );
    assert!(
        text.contains("mooncake_master_segment_capacity_bytes"),
        "{text}"
    );

    let text = http_get(http_port, "/metrics");
    assert!(sample(&text, "mooncake_client_requests_total{op=\"put\"}") >= 5.0);
    assert!(
        sample(
            &text,
            "mooncake_client_errors_total{op=\"get\",code=\"OBJECT_NOT_FOUND\"}"
        ) >= 1.0
    );
    assert_eq!(http_get(http_port, "/health").trim(), "ok");
    assert!(http_get(http_port, "/status").contains("\"segment_name\""));
}
