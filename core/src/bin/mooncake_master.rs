//! `mooncake_master`: parses flags, sets up logging, and runs the standalone master
//! until SIGINT or SIGTERM. Bad configuration exits with code 2 and one line on stderr.

use std::process::ExitCode;

use mooncake_core::flags::FlagError;
use mooncake_core::master::daemon::{DaemonConfigError, MasterDaemonConfig, run};

fn main() -> ExitCode {
    let config = match MasterDaemonConfig::from_args(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(DaemonConfigError::Flag(FlagError::Help(text))) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("mooncake_master: {error}");
            return ExitCode::from(2);
        }
    };
    mooncake_core::process::init_logging(&config.log_level);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if config.threads > 0 {
        builder.worker_threads(config.threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("mooncake_master: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let master_id = random_id();
    match runtime.block_on(run(
        config,
        master_id,
        mooncake_core::process::shutdown_signal("mooncake_master"),
    )) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("mooncake_master: {error}");
            ExitCode::from(2)
        }
    }
}

fn random_id() -> u128 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    nanos ^ (u128::from(std::process::id()) << 64)
}
