//! `distributed_kv_storage_backend` with real processes: the conformance suite against
//! real Redis servers (standalone and a three-node cluster), and a real master, real
//! clients and dummies offloading into Redis and into the C test plugin.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mooncake_dummy_client::{DummyClient, ErrorCode};
use mooncake_integration_tests::offload::{
    assert_gone, assert_reads_into_pool, assert_reads_through, comes_back, dummy, on_disk,
    only_on_disk, put_and_offload, put_past_memory, value,
};
use mooncake_integration_tests::redis::{RedisCluster, RedisServer};
use mooncake_integration_tests::{MasterProcess, RealClientProcess, eventually, unique_port};
use mooncake_offload::dkv::redis::RedisClient;
use mooncake_offload::dkv::{DkvClient, DkvError, conformance};

/// A namespace no other test (or run sharing the server) uses.
fn namespace(name: &str) -> String {
    format!("it-{name}-{}-{}", std::process::id(), unique_port())
}

#[test]
fn the_redis_client_passes_the_conformance_suite() {
    let server = RedisServer::shared_or_start();
    let client: Arc<dyn DkvClient> =
        Arc::new(RedisClient::open(&server.url(), None).expect("connect"));
    assert!(client.describe().starts_with("Redis redis://:***@"));
    conformance::check(client.as_ref(), &namespace("suite"));
    conformance::check_shared(&client, &namespace("shared"));
}

#[test]
fn a_tls_redis_passes_the_conformance_suite_trusting_the_ca_file() {
    let server = RedisServer::start_tls();
    let ca = std::path::Path::new(server.ca_file().expect("a TLS server"));
    let client = RedisClient::open(&server.url(), Some(ca)).expect("connect over TLS");
    assert!(client.describe().starts_with("Redis rediss://:***@"));
    conformance::check(&client, "suite-tls");
    // Without the CA the server's certificate is not trusted; plain text is refused.
    let untrusted = RedisClient::open(&server.url(), None).expect_err("untrusted");
    assert!(
        untrusted.to_string().contains("cannot reach the store"),
        "{untrusted}"
    );
    let plain = server.url().replacen("rediss://", "redis://", 1);
    assert!(RedisClient::open(&plain, None).is_err());
}

#[test]
fn a_redis_cluster_passes_the_conformance_suite_from_a_list_or_one_seed_node() {
    let cluster = RedisCluster::start();
    let listed = RedisClient::open(&cluster.urls(), None).expect("connect to the list");
    assert!(listed.describe().starts_with("Redis cluster "));
    conformance::check(&listed, "suite-listed");
    let seeded = RedisClient::open(&cluster.nodes[1].url(), None).expect("connect to a seed");
    assert!(seeded.describe().starts_with("Redis cluster "));
    conformance::check(&seeded, "suite-seeded");
    let shared: Arc<dyn DkvClient> = Arc::new(seeded);
    conformance::check_shared(&shared, "suite-shared");
    // Keys spread over the primaries, and a scan finds them on every one.
    let keys: Vec<Vec<u8>> = (0..60)
        .map(|i| format!("spread/{i}").into_bytes())
        .collect();
    let items: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_slice(), &b"v"[..])).collect();
    assert!(listed.batch_put(&items).iter().all(Result::is_ok));
    for node in &cluster.nodes {
        assert!(
            !node.keys("spread/").is_empty(),
            "node {} holds none",
            node.port
        );
    }
    let found = mooncake_offload::dkv::scan_all(&listed, b"spread/", 7).expect("scan");
    assert_eq!(found.len(), 60);
}

#[test]
fn a_redis_with_maxmemory_tells_its_capacity_and_refuses_values_when_full() {
    let server = RedisServer::start_with_settings(&[
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "noeviction",
    ]);
    let client = RedisClient::open(&server.url(), None).expect("connect");
    assert_eq!(client.capacity(), Some(4 << 20));
    let big = value(1, 512 << 10);
    let results: Vec<Result<(), DkvError>> = (0..16)
        .map(|i| {
            let key = format!("full/{i}");
            client.batch_put(&[(key.as_bytes(), &big)]).remove(0)
        })
        .collect();
    assert!(results[0].is_ok());
    assert!(results.contains(&Err(DkvError::Full)), "{results:?}");
}

/// Environment of a node offloading into Redis at `url` under `ns`.
fn redis_env<'a>(
    url: &'a str,
    ns: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        (
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR",
            "distributed_kv_storage_backend",
        ),
        ("MOONCAKE_OFFLOAD_DKV_CLIENT", "redis"),
        ("MOONCAKE_OFFLOAD_DKV_URL", url),
        ("MOONCAKE_OFFLOAD_DKV_NAMESPACE", ns),
        ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
    ];
    env.extend_from_slice(extra);
    env
}

/// A node with a 16 MB segment offloading into Redis.
fn redis_node(
    master: &MasterProcess,
    url: &str,
    ns: &str,
    extra: &[(&str, &str)],
) -> RealClientProcess {
    RealClientProcess::join_with_env(
        master,
        "16MB",
        &["--enable_offload=true"],
        &redis_env(url, ns, extra),
    )
}

/// Puts `first-0..8` and 24 MiB more into a 16 MB segment, so the first objects leave
/// memory and live only in the store.
fn fill_past_memory(client: &DummyClient, node: &RealClientProcess) {
    put_past_memory(client, node);
    assert!(
        only_on_disk(client, "first-0"),
        "first-0 is still in memory"
    );
}

#[test]
fn objects_evicted_into_redis_are_read_through_any_node_and_survive_a_kill9_of_the_node() {
    let server = RedisServer::shared_or_start();
    let ns = namespace("evict");
    let url = server.url();
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let mut a = redis_node(&master, &url, &ns, &[]);
    let via_a = dummy(&a);
    fill_past_memory(&via_a, &a);
    assert!(server.keys(&format!("{ns}/")).len() >= 32);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let via_b = dummy(&b);
    for i in 0..8 {
        let key = format!("first-{i}");
        assert_reads_through(&[(&via_a, "A"), (&via_b, "B")], &key, i);
        assert_reads_into_pool(&via_b, &key, i);
    }

    // kill -9 of the node: it rebuilds its index by scanning Redis and registers the
    // objects with the master again.
    drop(via_a);
    a.restart();
    let via_a = dummy(&a);
    for i in 0..8 {
        assert!(
            comes_back(&via_a, &format!("first-{i}"), i),
            "first-{i} after a restart"
        );
        assert!(via_b.get(&format!("first-{i}")).expect("via B") == value(i, 1 << 20));
    }

    // Removal deletes the key in Redis.
    assert_eq!(via_b.remove("first-3", true), Ok(()));
    assert_gone(&via_a, "first-3", "removed");
    let gone = eventually(Duration::from_secs(5), || {
        server
            .keys(&format!("{ns}/{}/first-3", a.segment_name()))
            .is_empty()
    });
    assert!(gone, "the removed object's key is still in Redis");
    assert_eq!(
        server.keys(&format!("{ns}/{}/first-2", a.segment_name())),
        [format!("{ns}/{}/first-2", a.segment_name())],
        "keys live under <namespace>/<node>/"
    );
}

#[test]
fn disk_tier_eviction_deletes_the_keys_in_redis() {
    let server = RedisServer::shared_or_start();
    let ns = namespace("keys-limit");
    let url = server.url();
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = RealClientProcess::join_with_env(
        &master,
        "64MB",
        &["--enable_offload=true"],
        &redis_env(
            &url,
            &ns,
            &[
                ("MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT", "4"),
                // Only the limit evicts here, not the watermark ahead of it.
                ("MOONCAKE_OFFLOAD_ENABLE_DISK_WATERMARK_EVICTION", "false"),
            ],
        ),
    );
    let client = dummy(&node);
    for wave in 0..4 {
        put_and_offload(&client, &node, &format!("w{wave}-"), 2);
        let keys = server.keys(&format!("{ns}/"));
        assert!(keys.len() <= 4, "{} keys in Redis: {keys:?}", keys.len());
    }
    // The oldest waves left the tier (still in memory), and Redis.
    let at = |key: &str| format!("{ns}/{}/{key}", node.segment_name());
    assert_eq!(
        server.keys(&format!("{ns}/")),
        [at("w2-0"), at("w2-1"), at("w3-0"), at("w3-1")]
    );
    assert!(!on_disk(&client, "w0-0"));
    assert!(client.get("w0-0").expect("in memory") == value(0, 1 << 20));
}

#[test]
fn a_value_corrupted_in_redis_is_never_handed_out() {
    let server = RedisServer::shared_or_start();
    let ns = namespace("corrupt");
    let url = server.url();
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = redis_node(&master, &url, &ns, &[]);
    let client = dummy(&node);
    fill_past_memory(&client, &node);
    // One byte of first-1's payload changed behind the node's back.
    let key = format!("{ns}/{}/first-1", node.segment_name());
    assert_eq!(
        server.cli(&["SETRANGE", &key, "5000", "X"]).trim(),
        (24 + 7 + (1 << 20)).to_string()
    );
    let read = client.get("first-1");
    assert!(read.is_err(), "a corrupt value was handed out");
    assert_eq!(read.map(|_| ()), Err(ErrorCode::OBJECT_NOT_FOUND));
    // The others are fine.
    assert!(client.get("first-2").expect("first-2") == value(2, 1 << 20));
}

#[test]
fn with_redis_down_offloading_fails_cleanly_and_everything_resumes_when_it_returns() {
    let mut server = RedisServer::start_persistent();
    let ns = namespace("down");
    let url = server.url();
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = redis_node(&master, &url, &ns, &[]);
    let client = dummy(&node);
    fill_past_memory(&client, &node);

    server.kill9();
    // Objects only in Redis: an error, never wrong bytes.
    assert_eq!(
        client.get("first-0").map(|_| ()),
        Err(ErrorCode::TRANSFER_FAIL),
        "read of an object only in a stopped Redis"
    );
    // New objects stay in memory: their offload fails, the node carries on.
    for i in 0..2 {
        client
            .put(
                &format!("down-{i}"),
                &value(i, 1 << 20),
                &Default::default(),
            )
            .expect("put while Redis is down");
    }
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !on_disk(&client, "down-0"),
        "an offload to a stopped Redis was acknowledged"
    );
    assert!(client.get("down-1").expect("in memory") == value(1, 1 << 20));

    // Redis returns (with what it had): reads and offloading resume.
    server.restart();
    for i in 0..8 {
        assert!(
            comes_back(&client, &format!("first-{i}"), i),
            "first-{i} after Redis returned"
        );
    }
    put_and_offload(&client, &node, "after-", 4);
    assert!(client.get("after-3").expect("after") == value(3, 1 << 20));
}

/// The in-repo test plugin of the distributed-KV interface, built with the C compiler.
fn memory_plugin() -> PathBuf {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../offload/tests/plugin/memory_plugin.c");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("libmemory_plugin_it-{}.so", std::process::id()));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&source)
        .arg("-lpthread")
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "building the test plugin failed");
    out
}
#[test]
fn the_distributed_kv_backend_keeps_evicted_objects_readable_through_any_node() {
    let plugin = memory_plugin();
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let a = RealClientProcess::join_with_env(
        &master,
        "16MB",
        &["--enable_offload=true"],
        &[
            (
                "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR",
                "distributed_kv_storage_backend",
            ),
            ("MOONCAKE_OFFLOAD_DKV_CLIENT", "plugin"),
            (
                "MOONCAKE_OFFLOAD_DKV_PLUGIN",
                plugin.to_str().expect("utf-8"),
            ),
            ("MOONCAKE_OFFLOAD_DKV_NAMESPACE", "it-cluster"),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
        ],
    );
    let via_a = dummy(&a);
    fill_past_memory(&via_a, &a);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let via_b = dummy(&b);
    for i in 0..8 {
        let key = format!("first-{i}");
        assert_reads_through(&[(&via_a, "A"), (&via_b, "B")], &key, i);
    }
    assert_eq!(via_b.remove("first-0", true), Ok(()));
    assert_gone(&via_a, "first-0", "removed");
}

#[test]
fn a_bad_plugin_setting_stops_the_node_with_the_variable_named() {
    let stderr = refused_at_startup(&[
        ("MOONCAKE_OFFLOAD_DKV_CLIENT", "plugin"),
        ("MOONCAKE_OFFLOAD_DKV_PLUGIN", "/nonexistent/libstore.so"),
    ]);
    assert!(
        stderr.contains("MOONCAKE_OFFLOAD_DKV_PLUGIN=/nonexistent/libstore.so"),
        "{stderr}"
    );
}

/// Runs `mooncake_client` with the distributed-KV backend and `env`; expects it to stop
/// at startup with exit code 2; its standard error.
fn refused_at_startup(env: &[(&str, &str)]) -> String {
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let output = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args([
            format!("--port={}", unique_port()),
            format!("--master_server_address={}", master.address()),
            "--enable_offload=true".into(),
            "--global_segment_size=16MB".into(),
        ])
        .env(
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR",
            "distributed_kv_storage_backend",
        )
        .envs(env.iter().copied())
        .output()
        .expect("run mooncake_client");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    stderr
}

#[test]
fn bad_redis_settings_stop_the_node_with_the_variable_named() {
    let syntax = refused_at_startup(&[("MOONCAKE_OFFLOAD_DKV_URL", "localhost:6379")]);
    assert!(
        syntax.contains("MOONCAKE_OFFLOAD_DKV_URL: \"localhost:6379\" is not a Redis URL"),
        "{syntax}"
    );
    let empty = refused_at_startup(&[]);
    assert!(
        empty.contains("MOONCAKE_OFFLOAD_DKV_URL is empty"),
        "{empty}"
    );
    let port = mooncake_integration_tests::free_tcp_port();
    let nobody = format!("redis://:secret-pw@127.0.0.1:{port}/0");
    let unreachable = refused_at_startup(&[("MOONCAKE_OFFLOAD_DKV_URL", &nobody)]);
    assert!(
        unreachable.contains(&format!(
            "MOONCAKE_OFFLOAD_DKV_URL=redis://:***@127.0.0.1:{port}/0: cannot reach the store"
        )),
        "{unreachable}"
    );
    let server = RedisServer::shared_or_start();
    let wrong = format!("redis://:wrong-pw@127.0.0.1:{}/0", server.port);
    let refused = refused_at_startup(&[("MOONCAKE_OFFLOAD_DKV_URL", &wrong)]);
    assert!(refused.contains("cannot reach the store"), "{refused}");
    for stderr in [&unreachable, &refused] {
        assert!(
            !stderr.contains("secret-pw") && !stderr.contains("wrong-pw"),
            "{stderr}"
        );
    }
}
