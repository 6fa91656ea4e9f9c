//! What both binaries do around their library: logging setup and waiting for SIGINT or
//! SIGTERM.

/// Logs to stderr with `RUST_LOG` if set, else `level` (validated by the caller).
pub fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Completes on the first SIGINT or SIGTERM (never, if the handlers cannot be
/// installed: the process is then stopped with SIGKILL).
pub async fn shutdown_signal(program: &str) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("{program}: cannot install signal handlers; stop it with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}
