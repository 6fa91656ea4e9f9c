//! What both commands do around their library: flag parsing outcomes, logging setup,
//! the runtime, and waiting for SIGINT or SIGTERM ([`command_main`]).

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

/// A command's configuration error, which may be no error at all: a flag that prints
/// and exits (`--help`, `--version`) stops parsing the same way.
pub trait ConfigFailure: std::fmt::Display {
    /// The text to print on stdout (exit status 0) when a flag asked for it; `None`
    /// for a real error (its one-line reason goes to stderr, exit status 2).
    fn stdout_text(&self) -> Option<&str>;
}

/// Installs the logger of `settings`, then logs each upstream flag that was accepted
/// without effect (one line each, at startup).
pub fn init_command_logging(
    settings: &crate::logging::LogSettings,
    compat_notes: &[String],
) -> Result<(), String> {
    settings.init().map_err(|error| error.to_string())?;
    for note in compat_notes {
        tracing::info!("accepted for compatibility: {note}");
    }
    Ok(())
}

/// A long-running command (`mooncake_master`, `mooncake_client`): flags in, then serve
/// until SIGINT or SIGTERM. [`command_main`] does the rest, the same for both.
pub trait Command: Sized {
    /// The command's name, prefixed to every message on stderr.
    const NAME: &'static str;
    /// Why the flags gave nothing to run.
    type ConfigError: ConfigFailure;
    /// Why serving failed.
    type Error: std::fmt::Display;

    /// Parses the flags (without the program name).
    fn parse(args: Vec<String>) -> Result<Self, Self::ConfigError>;
    /// The logging settings, and the upstream flags accepted without effect (logged
    /// once at startup).
    fn logging(&self) -> (&crate::logging::LogSettings, &[String]);
    /// Runtime worker threads; 0 means one per core.
    fn worker_threads(&self) -> usize;
    /// How long the cores are kept awake after each request ([`crate::keep_awake`]);
    /// zero: not at all.
    fn keep_awake(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// Serves until `shutdown` completes.
    fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>>;
}

/// The whole `main` of a [`Command`]: parse `args` (without the program name), set up
/// logging and the runtime, serve until SIGINT or SIGTERM. Returns the exit status: 0
/// after `--help` or a clean stop, 2 with one line on stderr when the configuration is
/// bad or serving fails.
///
/// Used by the binaries and by the Python package's console scripts, which run it in
/// the interpreter's own process (so the command's pid is the server's).
pub fn command_main<C: Command>(args: impl IntoIterator<Item = String>) -> u8 {
    let status = run_command::<C>(args.into_iter().collect());
    // Embedded in another process (Python), stdout is not flushed at exit by Rust.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    status
}

fn run_command<C: Command>(args: Vec<String>) -> u8 {
    let name = C::NAME;
    let command = match C::parse(args) {
        Ok(command) => command,
        Err(error) => {
            if let Some(text) = error.stdout_text() {
                print!("{text}");
                return 0;
            }
            eprintln!("{name}: {error}");
            return 2;
        }
    };
    let (log, compat_notes) = command.logging();
    if let Err(reason) = init_command_logging(log, compat_notes) {
        eprintln!("{name}: {reason}");
        return 2;
    }
    crate::keep_awake::start(command.keep_awake());
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if command.worker_threads() > 0 {
        builder.worker_threads(command.worker_threads());
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{name}: cannot start the runtime: {error}");
            return 2;
        }
    };
    match runtime.block_on(command.serve(shutdown_signal(name))) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("{name}: {error}");
            2
        }
    }
}
