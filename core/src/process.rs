//! What both binaries do around their library: logging setup and waiting for SIGINT or
//! SIGTERM.

/// Logs to stderr with `RUST_LOG` if set, else `level` (validated by the caller).
pub fn init_logging(level: &str) {
    // tarpc reports every peer that disconnects mid-stream as a warning; for a store
    // whose dummies come and go that is routine, so only its errors are shown unless
    // the filter names it.
    let directives = if level.contains("tarpc") {
        level.to_string()
    } else {
        format!("{level},tarpc=error")
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&directives))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tarpc=error"));
    // A second call (a second embedded setup in one process) keeps the first logger.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
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

/// Completes once `stop` holds `true`, including when it was set before this call (or
/// before the receiver was created), and when every sender is gone.
pub async fn stop_requested(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}
