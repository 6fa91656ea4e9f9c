//! The `mooncake_master` command: what the binary and the Python package's
//! `mooncake_master` console script both run.

use mooncake_core::logging::LogSettings;
use mooncake_core::process::{Command, ConfigFailure, command_main};

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
    type ConfigError = DaemonConfigError;
    type Error = DaemonError;

    fn parse(args: Vec<String>) -> Result<Self, DaemonConfigError> {
        MasterDaemonConfig::from_args(args).map(Self)
    }

    fn logging(&self) -> (&LogSettings, &[String]) {
        (&self.0.log, &self.0.compat_notes)
    }

    fn worker_threads(&self) -> usize {
        self.0.threads
    }

    fn keep_awake(&self) -> std::time::Duration {
        self.0.keep_awake
    }

    async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
        run(self.0, shutdown).await
    }
}

impl ConfigFailure for DaemonConfigError {
    fn stdout_text(&self) -> Option<&str> {
        match self {
            DaemonConfigError::Flag(flag) => flag.stdout_text(),
            _ => None,
        }
    }
}
