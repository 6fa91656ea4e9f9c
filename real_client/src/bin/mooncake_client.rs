//! `mooncake_client`: parses flags, sets up logging, and runs the real client until
//! SIGINT or SIGTERM. Bad configuration exits with code 2 and one line on stderr.

use std::process::ExitCode;

use mooncake_core::flags::FlagError;
use mooncake_real_client::{ConfigError, RealClientConfig, run};

fn main() -> ExitCode {
    let config = match RealClientConfig::from_args(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(ConfigError::Flag(FlagError::Help(text))) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("mooncake_client: {error}");
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
            eprintln!("mooncake_client: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(
        config,
        mooncake_core::process::shutdown_signal("mooncake_client"),
    )) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("mooncake_client: {error}");
            ExitCode::from(2)
        }
    }
}
