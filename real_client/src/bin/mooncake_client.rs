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
    init_logging(&config.log_level);
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
    match runtime.block_on(run(config, shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("mooncake_client: {error}");
            ExitCode::from(2)
        }
    }
}

fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("mooncake_client: cannot install signal handlers; stop it with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}
