//! The `mooncake_master` command: what the binary and the Python package's
//! `mooncake_master` console script both run.

use crate::process::{Command, NotRun, command_main};

use super::daemon::{DaemonConfigError, DaemonError, MasterDaemonConfig, run};

/// Runs `mooncake_master` with `args` (without the program name) until SIGINT or
/// SIGTERM; returns the exit status (0, or 2 with one line on stderr).
pub fn main(args: impl IntoIterator<Item = String>) -> u8 {
    command_main::<MasterCommand>(args)
}

/// The master's configuration, as a [`Command`].
struct MasterCommand(MasterDaemonConfig);

impl Command for MasterCommand {
    const NAME: &'static str = "mooncake_master";
    type Error = DaemonError;

    fn parse(args: Vec<String>) -> Result<Self, NotRun> {
        MasterDaemonConfig::from_args(args)
            .map(Self)
            .map_err(|error| {
                // `--help` (and the other flags that print and exit) is not an error.
                let text = match &error {
                    DaemonConfigError::Flag(flag) => flag.stdout_text(),
                    _ => None,
                };
                NotRun::from_error(text, &error)
            })
    }

    fn log_level(&self) -> &str {
        &self.0.log_level
    }

    fn init_logging(&self) -> Result<(), String> {
        crate::process::init_command_logging(&self.0.log, &self.0.compat_notes)
    }

    fn worker_threads(&self) -> usize {
        self.0.threads
    }

    async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
        run(self.0, random_id(), shutdown).await
    }
}

/// An identifier for this master run: the clock mixed with the pid, so that clients
/// notice a restarted master.
fn random_id() -> u128 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    nanos ^ (u128::from(std::process::id()) << 64)
}
