//! `mooncake_cli`: a dummy client on the command line, for people and scripts.
//!
//! Exit codes: 0 success; 1 the operation failed (or `exists` found nothing); 2 bad usage
//! or the real client could not be reached. Failures print one line on stderr.

use std::io::Write;
use std::process::ExitCode;

use mooncake_core::units::format_size;
use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicateConfig};

const USAGE: &str = "usage: mooncake_cli [--client ADDR] COMMAND
commands:
  put KEY VALUE | put KEY --file F   store a value (an existing key is kept)
  get KEY [--out F]                  print a value (or write it to F)
  exists KEY                         exit 0 if KEY exists, 1 if not
  size KEY                           print the size of KEY in bytes
  rm KEY [--force]                   remove KEY (--force ignores read leases)
  status                             show the real client's dummies, memory and objects
ADDR: host:port (the port of mooncake_client), unix:/path, /path or @name;
      defaults to $MOONCAKE_CLIENT, then 127.0.0.1:50052";

enum Failure {
    Usage(String),
    Failed(String),
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Failed(message)) => {
            eprintln!("mooncake_cli: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(message)) => {
            eprintln!("mooncake_cli: {message}");
            ExitCode::from(2)
        }
    }
}

fn code_failure(what: &str, code: ErrorCode) -> Failure {
    Failure::Failed(format!("{what}: {code}"))
}

fn take_option(args: &mut Vec<String>, name: &str) -> Result<Option<String>, Failure> {
    let Some(index) = args
        .iter()
        .position(|a| a == name || a.starts_with(&format!("{name}=")))
    else {
        return Ok(None);
    };
    let arg = args.remove(index);
    if let Some((_, value)) = arg.split_once('=') {
        return Ok(Some(value.to_string()));
    }
    if index < args.len() {
        Ok(Some(args.remove(index)))
    } else {
        Err(Failure::Usage(format!("{name} needs a value")))
    }
}

fn take_flag(args: &mut Vec<String>, name: &str) -> bool {
    let before = args.len();
    args.retain(|a| a != name);
    args.len() != before
}

fn run(mut args: Vec<String>) -> Result<(), Failure> {
    if args.is_empty() || args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return if args.is_empty() {
            Err(Failure::Usage("no command given".into()))
        } else {
            Ok(())
        };
    }
    let address = take_option(&mut args, "--client")?;
    let file = take_option(&mut args, "--file")?;
    let out = take_option(&mut args, "--out")?;
    let force = take_flag(&mut args, "--force");
    let mut words = args.into_iter();
    let command = words.next().unwrap_or_default();
    let key = words.next();
    let value = words.next();
    if let Some(extra) = words.next() {
        return Err(Failure::Usage(format!(
            "unexpected argument {extra:?}\n{USAGE}"
        )));
    }
    let need_key = || {
        key.clone()
            .ok_or_else(|| Failure::Usage(format!("{command} needs a KEY")))
    };
    let payload = match (command.as_str(), &value, &file) {
        ("put", Some(v), None) => Some(v.clone().into_bytes()),
        ("put", None, Some(f)) => {
            Some(std::fs::read(f).map_err(|e| Failure::Failed(format!("cannot read {f}: {e}")))?)
        }
        ("put", _, _) => return Err(Failure::Usage("put needs either VALUE or --file F".into())),
        _ => None,
    };
    let staging = payload.as_ref().map_or(0, Vec::len).max(16 << 20) as u64;
    let client = DummyClient::setup_dummy(1 << 20, staging, address.as_deref())
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let result = match command.as_str() {
        "put" => {
            let key = need_key()?;
            client
                .put(
                    &key,
                    payload.as_deref().unwrap_or_default(),
                    &ReplicateConfig::default(),
                )
                .map_err(|c| code_failure(&format!("put {key}"), c))
        }
        "get" => get(&client, &need_key()?, out.as_deref()),
        "exists" => {
            let key = need_key()?;
            match client.is_exist(&key) {
                Ok(true) => {
                    println!("true");
                    Ok(())
                }
                Ok(false) => Err(Failure::Failed(format!("{key} does not exist"))),
                Err(c) => Err(code_failure(&format!("exists {key}"), c)),
            }
        }
        "size" => {
            let key = need_key()?;
            let size = client
                .get_size(&key)
                .map_err(|c| code_failure(&format!("size {key}"), c))?;
            println!("{size}");
            Ok(())
        }
        "rm" => {
            let key = need_key()?;
            client
                .remove(&key, force)
                .map_err(|c| code_failure(&format!("rm {key}"), c))
        }
        "status" => status(&client),
        other => Err(Failure::Usage(format!(
            "unknown command {other:?}\n{USAGE}"
        ))),
    };
    client.close();
    result
}

fn get(client: &DummyClient, key: &str, out: Option<&str>) -> Result<(), Failure> {
    let bytes = client
        .get(key)
        .map_err(|c| code_failure(&format!("get {key}"), c))?;
    match out {
        Some(path) => std::fs::write(path, &bytes)
            .map_err(|e| Failure::Failed(format!("cannot write {path}: {e}"))),
        None => std::io::stdout()
            .write_all(&bytes)
            .and_then(|()| std::io::stdout().flush())
            .map_err(|e| Failure::Failed(format!("cannot write to stdout: {e}"))),
    }
}

fn status(client: &DummyClient) -> Result<(), Failure> {
    let report = client.status().map_err(|c| code_failure("status", c))?;
    println!(
        "real client  pid {} instance {:032x} up {}s",
        report.pid, report.instance_id, report.uptime_secs
    );
    println!(
        "segment      {} ({} resident of {})",
        report.segment_name,
        format_size(report.segment_resident_bytes),
        format_size(report.segment_bytes)
    );
    println!("master       {}", report.master_at);
    if let Some(ha) = &report.master.ha {
        println!("  leader {} (term {})", ha.leader, ha.epoch);
        for standby in &ha.standbys {
            let state = if standby.in_sync {
                "in sync".to_string()
            } else {
                format!("catching up, {} changes behind", standby.behind)
            };
            println!("  standby {}: {state}", standby.address);
        }
    }
    for segment in &report.master.segments {
        println!(
            "  segment {} {}: {} used of {}",
            segment.id,
            segment.name,
            format_size(segment.used),
            format_size(segment.capacity)
        );
    }
    println!(
        "objects      {} ({} writes in progress, {} on disk)",
        report.master.objects, report.master.writes_in_progress, report.master.objects_on_disk
    );
    println!(
        "dummies      {} attached, {} mapped, {} moved through staging or RPC messages",
        report.dummies.len(),
        format_size(report.mapped_bytes),
        format_size(report.staged_bytes)
    );
    println!(
        "reads        {} answered with the replica list of an earlier read (no master round trip)",
        report.read_cache_hits
    );
    println!(
        "puts         {} completed into space reserved ahead of their keys (one master round trip)",
        report.reserved_puts
    );
    if let Some(taken) = &report.taken_over {
        println!(
            "handover     took this node over from pid {} in {} ms: {} of segment, {} objects of the embedded master",
            taken.from_pid,
            taken.took_ms,
            format_size(taken.segment_bytes),
            taken.objects
        );
    }
    if report.device_handles > 0 || report.segment_pinned_bytes > 0 {
        println!(
            "gpu          {} dummy allocations open (CUDA IPC), {} of the segment pinned",
            report.device_handles,
            format_size(report.segment_pinned_bytes)
        );
    }
    for dummy in &report.dummies {
        let declared = match (dummy.declared_ranges, dummy.cross_memory) {
            (0, _) => String::new(),
            (n, true) => format!(", {n} declared buffers (copied once, cross-memory)"),
            (n, false) => format!(", {n} declared buffers (through its staging buffer)"),
        };
        let declared = match dummy.device_buffers {
            0 => declared,
            n => format!("{declared}, {n} GPU buffers"),
        };
        println!(
            "  pid {} uid {} {}: {} segments, {} mapped{declared}",
            dummy.pid,
            dummy.uid,
            dummy.name,
            dummy.segments,
            format_size(dummy.mapped_bytes)
        );
    }
    Ok(())
}
