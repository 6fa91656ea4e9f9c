//! Upstream drop-in: the binaries start with upstream's flag sets (every glog flag, a
//! configuration file with upstream's keys, `MOONCAKE_CONFIG_PATH`), refuse what they
//! cannot do with a message naming the flag, and serve the master's HTTP endpoints and
//! the HTTP metadata server in upstream's formats.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_integration_tests::{
    MasterProcess, RealClientProcess, binary, eventually, free_tcp_port, kill9,
};

/// Every glog flag upstream's binaries define, with values that keep logging on stderr.
const GLOG_FLAGS: &[&str] = &[
    "--logtostderr",
    "-v=1",
    "--vmodule=",
    "--minloglevel=0",
    "--stderrthreshold=2",
    "--alsologtostderr=false",
    "--colorlogtostderr=false",
    "--log_dir=",
    "--log_link=",
    "--log_prefix=true",
    "--logfile_mode=436",
    "--max_log_size=1800",
    "--logbuflevel=0",
    "--logbufsecs=30",
    "--drop_log_memory=true",
    "--stop_logging_if_full_disk=false",
    "--log_backtrace_at=",
    "--symbolize_stacktrace=true",
    "--alsologtoemail=",
    "--logemaillevel=999",
    "--logmailer=/bin/mail",
];

/// A private temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mc-compat-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process started by a test, killed on drop.
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        kill9(&mut self.0);
    }
}

/// One HTTP/1.1 request; returns (status, head, body).
fn http(port: u16, method: &str, target: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = format!(
        "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send");
    stream.write_all(body).expect("send body");
    read_response(&mut stream)
}

fn read_response(stream: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("read");
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response");
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, head, answer[split + 4..].to_vec())
}

fn get(port: u16, target: &str) -> (u16, String, String) {
    let (status, head, body) = http(port, "GET", target, b"");
    (status, head, String::from_utf8_lossy(&body).into_owned())
}

fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a binary that must exit at once; returns (exit code, stdout, stderr).
fn run_to_exit(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = Command::new(binary(name))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn upstream_start_commands_and_admin_endpoints() {
    let dir = TempDir::new("master-yaml");
    let config = dir.0.join("master.yaml");
    std::fs::write(
        &config,
        "# upstream conf/master.yaml keys\nclient_live_ttl_sec: 60\neviction_ratio: 0.1\neviction_high_watermark_ratio: 1.0\nmemory_allocator: offset\nenable_ha: false\nrpc_enable_tcp_no_delay: true\nmax_total_finished_tasks: 5000\n",
    )
    .expect("write config");
    let (metrics, metadata) = (free_tcp_port(), free_tcp_port());
    let mut flags = vec![
        "--rpc_interface=127.0.0.1".to_string(),
        "--enable_http_metadata_server=true".to_string(),
        "--http_metadata_server_host=127.0.0.1".to_string(),
        format!("--http_metadata_server_port={metadata}"),
        "--metrics_host=127.0.0.1".to_string(),
        format!("--metrics_port={metrics}"),
        format!("--config_path={}", config.display()),
    ];
    flags.extend(GLOG_FLAGS.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let master = MasterProcess::start(&flags);
    wait_for_port(metrics);
    wait_for_port(metadata);
    assert_eq!(get(metrics, "/get_all_segments").2, "", "no segment yet");
    let metadata_url = format!("--metadata_server=http://127.0.0.1:{metadata}/metadata");
    let client = RealClientProcess::join(
        &master,
        "64MB",
        &[
            &metadata_url,
            "--protocol",
            "tcp",
            "--local_buffer_size=16MB",
            "--device_names=",
            "--threads=1",
            "--tenant_id=default",
            "--start_offload_rpc_server=true",
            "--use_mmap_arena_allocator=false",
            "-v=1",
            "--logtostderr",
        ],
    );
    // SGLang's check_server: /get_all_segments is non-empty once a client mounted.
    assert!(eventually(Duration::from_secs(10), || {
        get(metrics, "/get_all_segments").2 == format!("{}\n", client.segment_name())
    }));
    check_admin_endpoints(metrics);
    check_metadata_server(metadata);
}

fn check_admin_endpoints(port: u16) {
    let (status, head, body) = get(port, "/health");
    assert_eq!(status, 200);
    assert!(head.contains("application/json"), "{head}");
    assert_eq!(
        body,
        r#"{"status":"ok","role":"leader","ha_state":"serving","service_ready":true,"leader_address":null,"view_version":null}"#
    );
    let (status, _, body) = get(port, "/query_key?key=absent");
    assert_eq!(status, 404);
    assert_eq!(
        body,
        r#"{"success":false,"error_code":-704,"error_message":"OBJECT_NOT_FOUND"}"#
    );
    assert_eq!(
        get(port, "/get_all_keys"),
        (200, get(port, "/get_all_keys").1, String::new())
    );
    let (status, _, body) = get(port, "/metrics/summary");
    assert_eq!(status, 200);
    assert!(
        body.starts_with("role=leader, state=serving, service_ready=true, master={Mem Storage: "),
        "{body}"
    );
    assert!(body.contains("Clients: 1"), "{body}");
    let (status, _, body) = get(port, "/metrics");
    assert_eq!(status, 200);
    assert!(body.contains("mooncake_master_segments 1"), "{body}");
    assert_eq!(get(port, "/nothing").0, 404);
    assert_eq!(http(port, "POST", "/health", b"").0, 404);
    check_bad_requests(port);
}

/// Garbage, oversized and truncated requests get an error and the server keeps serving.
fn check_bad_requests(port: u16) {
    for request in [
        &b"nonsense\r\n\r\n"[..],
        b"GET /health HTTP/1.1\r\nContent-Length: lots\r\n\r\n",
        b"PUT /metadata?key=a HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
        b"PUT /metadata?key=a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        &[0xff; 8192],
    ] {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.write_all(request).expect("send");
        let (status, _, _) = read_response(&mut stream);
        assert!((400..500).contains(&status), "{status}");
    }
    assert_eq!(get(port, "/health").0, 200);
}

fn check_metadata_server(port: u16) {
    assert_eq!(
        get(port, "/metadata?key=a"),
        (
            404,
            get(port, "/metadata?key=a").1,
            "metadata not found".into()
        )
    );
    assert_eq!(
        http(port, "PUT", "/metadata?key=a", b"{\"v\":1}").2,
        b"metadata updated"
    );
    let (status, head, body) = get(port, "/metadata?key=a");
    assert_eq!((status, body.as_str()), (200, "{\"v\":1}"));
    assert!(head.contains("application/json"), "{head}");
    assert_eq!(
        http(port, "PUT", "/metadata?key=mooncake/rpc_meta/x", b"1").0,
        200
    );
    assert_eq!(
        http(port, "PUT", "/metadata?key=mooncake/rpc_meta/x", b"2").0,
        400
    );
    assert_eq!(
        http(port, "DELETE", "/metadata?key=a", b"").2,
        b"metadata deleted"
    );
    assert_eq!(http(port, "DELETE", "/metadata?key=a", b"").0, 404);
    assert_eq!(get(port, "/metadata").2, "Missing key parameter");
}

#[test]
fn keys_show_up_in_query_key_and_get_all_keys() {
    let metrics = free_tcp_port();
    let master = MasterProcess::start(&[
        &format!("--metrics_port={metrics}"),
        "--metrics_host=127.0.0.1",
    ]);
    let client = RealClientProcess::join(&master, "64MB", &[]);
    let put = mooncake_integration_tests::cli(&client.address(), &["put", "compat key", "hello"]);
    assert!(put.status.success(), "{put:?}");
    assert_eq!(get(metrics, "/get_all_keys").2, "compat key\n");
    let (status, _, body) = get(metrics, "/query_key?key=compat%20key");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with(r#"{"success":true,"data":[{"size_":5,"buffer_address_":"#),
        "{body}"
    );
    assert!(
        body.contains(r#""protocol_":"tcp","transport_endpoint_":"127.0.0.1:"#),
        "{body}"
    );
}

#[test]
fn unknown_and_refused_flags() {
    for name in ["mooncake_master", "mooncake_client"] {
        let (code, _, stderr) = run_to_exit(name, &["--not_an_upstream_flag=1"], &[]);
        assert_eq!(code, 2, "{name}: {stderr}");
        assert!(
            stderr.contains("unknown flag --not_an_upstream_flag"),
            "{stderr}"
        );
        let (code, _, stderr) = run_to_exit(name, &["--vmodule=master=2"], &[]);
        assert_eq!(code, 2);
        assert!(
            stderr.contains("--vmodule=master=2 is not supported")
                && stderr.contains("--log_level"),
            "{stderr}"
        );
        let (code, stdout, _) = run_to_exit(
            name,
            &["--undefok=mystery", "--mystery=1", "--version"],
            &[],
        );
        assert_eq!(code, 0);
        assert!(stdout.starts_with(name), "{stdout}");
    }
    for (args, flag) in [
        (
            &["--enable_ha=true"][..],
            "--enable_ha needs --etcd_endpoints",
        ),
        (
            &["--rpc_enable_tcp_no_delay=false"],
            "TCP_NODELAY is always on",
        ),
        (
            &["--memory_allocator=jemalloc"],
            "--memory_allocator=jemalloc is not supported",
        ),
        (&["--rpc_interface=eth0"], "--rpc_interface"),
        (
            &["--enable_snapshot"],
            "--enable_snapshot=true is not supported",
        ),
    ] {
        let (code, _, stderr) = run_to_exit("mooncake_master", args, &[]);
        assert_eq!(code, 2, "{args:?}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
    let (code, _, stderr) = run_to_exit(
        "mooncake_client",
        &["--start_offload_rpc_server=false"],
        &[],
    );
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--start_offload_rpc_server=false is not supported"),
        "{stderr}"
    );
    let (code, _, stderr) = run_to_exit("mooncake_client", &["--protocol=rdma"], &[]);
    assert_eq!(code, 2);
    // What was looked for and the fix, whether this machine has RDMA devices or not.
    assert!(stderr.contains("--protocol"), "{stderr}");
    assert!(
        stderr.contains("/sys/class/infiniband") || stderr.contains("TCP only"),
        "{stderr}"
    );
    assert!(stderr.contains("--protocol tcp"), "{stderr}");
}

#[test]
fn log_dir_writes_a_file() {
    let dir = TempDir::new("log-dir");
    let port = free_tcp_port();
    let child = Command::new(binary("mooncake_master"))
        .args([
            format!("--rpc_port={port}"),
            "--rpc_address=127.0.0.1".into(),
            "--metrics_port=0".into(),
            format!("--log_dir={}", dir.0.display()),
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let _guard = Guard(Some(child));
    wait_for_port(port);
    let link = dir.0.join("mooncake_master.INFO");
    assert!(eventually(Duration::from_secs(10), || {
        std::fs::read_to_string(&link).is_ok_and(|text| text.contains("mooncake_master serving"))
    }));
}

#[test]
fn client_reads_mooncake_config_path() {
    let metrics = free_tcp_port();
    let master = MasterProcess::start(&[
        &format!("--metrics_port={metrics}"),
        "--metrics_host=127.0.0.1",
    ]);
    let dir = TempDir::new("client-json");
    let config = dir.0.join("mooncake.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": "{}", "global_segment_size": "32MB", "local_buffer_size": 1073741824, "protocol": "tcp", "device_name": ""}}"#,
            master.address()
        ),
    )
    .expect("write config");
    let path = config.display().to_string();
    let client = RealClientProcess::start_with_env("16MB", &[], &[("MOONCAKE_CONFIG_PATH", &path)]);
    assert!(eventually(Duration::from_secs(10), || {
        get(metrics, "/get_all_segments").2 == format!("{}\n", client.segment_name())
    }));
    std::fs::write(&config, r#"{"no_such_key": 1}"#).expect("rewrite");
    let (code, _, stderr) = run_to_exit("mooncake_client", &[], &[("MOONCAKE_CONFIG_PATH", &path)]);
    assert_eq!(code, 2);
    assert!(stderr.contains("no_such_key"), "{stderr}");
}

/// Every upstream flag of both binaries (their `--list_flags_json`) is in
/// docs/configuration.md.
#[test]
fn configuration_doc_lists_every_upstream_flag() {
    let doc_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
    let doc = std::fs::read_to_string(&doc_path).expect("docs/configuration.md");
    let mut missing = Vec::new();
    for name in ["mooncake_master", "mooncake_client"] {
        let (code, json, _) = run_to_exit(name, &["--list_flags_json"], &[]);
        assert_eq!(code, 0);
        let mut flag = None;
        for line in json.lines().map(str::trim) {
            if let Some(value) = line.strip_prefix("\"name\": \"") {
                flag = value.strip_suffix("\",").map(str::to_string);
            }
            if let (Some(status), Some(flag)) = (line.strip_prefix("\"status\": \""), &flag)
                && !status.starts_with("ours")
                && !doc.contains(&format!("`--{flag}`"))
            {
                missing.push(format!("{name} --{flag}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {missing:?}"
    );
}
