//! The `mooncake_client` command: what the binary and the Python package's
//! `mooncake_client` console script both run.

use mooncake_core::logging::LogSettings;
use mooncake_core::process::{Command, ConfigFailure, command_main};

use crate::{ConfigError, RealClientConfig, StartError, run};

/// Runs `mooncake_client` with `args` (without the program name) until SIGINT or
/// SIGTERM; returns the exit status (0, or 2 with one line on stderr).
pub fn main(args: impl IntoIterator<Item = String>) -> u8 {
    command_main::<ClientCommand>(args)
}

/// The real client's configuration, as a [`Command`].
struct ClientCommand(RealClientConfig);

impl Command for ClientCommand {
    const NAME: &'static str = "mooncake_client";
    type ConfigError = ConfigError;
    type Error = StartError;

    fn parse(args: Vec<String>) -> Result<Self, ConfigError> {
        RealClientConfig::from_command_line(args).map(Self)
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

    async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
        run(self.0, shutdown).await
    }
}

impl ConfigFailure for ConfigError {
    fn stdout_text(&self) -> Option<&str> {
        match self {
            ConfigError::Flag(flag) => flag.stdout_text(),
            _ => None,
        }
    }
}
