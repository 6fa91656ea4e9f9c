//! Processes a benchmark section starts (masters, real clients), and connecting to them.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_dummy_client::DummyClient;

/// Processes started for the measurement, killed on drop.
#[derive(Default)]
pub struct Processes(pub Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP port free on loopback now.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// Starts `name` from this executable's directory with `args`.
pub fn spawn(name: &str, args: &[String]) -> Result<Child, String> {
    spawn_with_env(name, args, &[])
}

/// [`spawn`] with extra environment variables.
pub fn spawn_with_env(
    name: &str,
    args: &[String],
    env: &[(&str, String)],
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Command::new(exe.with_file_name(name))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))
}

/// Connects a dummy to the real client at `address`, retrying for 10 s.
pub fn wait_for(address: &str) -> Result<DummyClient, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match DummyClient::setup_dummy(64 << 20, 16 << 20, Some(address)) {
            Ok(client) => return Ok(client),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}
