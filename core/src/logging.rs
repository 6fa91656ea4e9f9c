//! Logging for both binaries: our `--log_level` plus upstream's glog flags mapped onto
//! `tracing`.
//!
//! * `--v=N` (or `-v=N`): `N >= 1` logs at debug, `N >= 2` at trace.
//! * `--minloglevel=N`: 0 info, 1 warn, 2 error, 3 (fatal) nothing but errors.
//! * `--log_level` given explicitly wins over both; `RUST_LOG`, when valid, over all.
//! * `--log_dir=DIR`: also write `DIR/<program>.log.INFO.<pid>` (mode `--logfile_mode`)
//!   and point the link `DIR/<program>.INFO` at it. Without `--logtostderr` or
//!   `--alsologtostderr`, stderr then only gets messages at or above
//!   `--stderrthreshold` (default 2, errors), as with glog.
//! * `--logtostderr`: everything to stderr, no file.

use std::path::PathBuf;
use std::sync::Mutex;

use tracing::Level;
use tracing_subscriber::fmt::writer::MakeWriterExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::flags::{Accepts, Compat, FlagError, FlagSpec, ParsedFlags};

const NO_EMAIL: &str = "there is no e-mail logging; ship the log file or stderr instead";

/// Logging flags of both binaries: `--log_level` and upstream's glog flags.
pub static LOG_FLAGS: &[FlagSpec] = &[
    FlagSpec::value(
        "log_level",
        Some("info"),
        "error, warn, info, debug or trace, or a tracing filter (RUST_LOG overrides); wins over --v and --minloglevel",
    )
    .ours(),
    FlagSpec::value("v", Some("0"), "verbose logging: 1 = debug, 2 = trace"),
    FlagSpec::value("vmodule", Some(""), "per-module verbosity").compat(Compat::Refused(
        "use --log_level with tracing targets, e.g. --log_level=info,mooncake_core=debug",
    )),
    FlagSpec::value(
        "minloglevel",
        Some("0"),
        "least severity logged: 0 info, 1 warning, 2 error, 3 fatal (errors only)",
    ),
    FlagSpec::boolean("logtostderr", false, "log to stderr only, not to files"),
    FlagSpec::boolean("alsologtostderr", false, "with --log_dir, also log everything to stderr"),
    FlagSpec::value(
        "stderrthreshold",
        Some("2"),
        "with --log_dir, messages at or above this severity (0 info .. 3 fatal) also go to stderr",
    ),
    FlagSpec::boolean("colorlogtostderr", false, "color the severity on stderr")
        .compat(Compat::Differs("stderr is colored when it is a terminal unless this is given as false")),
    FlagSpec::value("log_dir", Some(""), "also write a log file into this directory").compat(
        Compat::Differs("the file is <program>.log.INFO.<pid> (link <program>.INFO) and holds every severity; without --log_dir nothing is written to files (glog would use /tmp)"),
    ),
    FlagSpec::value("logfile_mode", Some("436"), "permissions of the log file (decimal, 436 = 0664)"),
    FlagSpec::value("log_link", Some(""), "extra links to the log files").compat(Compat::Refused(
        "no extra links are made; use the <program>.INFO link in --log_dir",
    )),
    FlagSpec::boolean("log_prefix", true, "prefix lines with time and severity").compat(
        Compat::Refused("every line carries time, level and target"),
    ),
    FlagSpec::value("max_log_size", Some("1800"), "log file size in MB before rotation")
        .compat(Compat::NoEffect("the log file is not rotated; use logrotate (copytruncate)", Accepts::Any)),
    FlagSpec::value("logbuflevel", Some("0"), "buffer messages up to this severity")
        .compat(Compat::NoEffect("messages are written unbuffered", Accepts::Any)),
    FlagSpec::value("logbufsecs", Some("30"), "buffer messages for up to this many seconds")
        .compat(Compat::NoEffect("messages are written unbuffered", Accepts::Any)),
    FlagSpec::boolean("drop_log_memory", true, "drop written log pages from the page cache")
        .compat(Compat::NoEffect("the page cache is left to the kernel", Accepts::Any)),
    FlagSpec::boolean("stop_logging_if_full_disk", false, "stop writing files when the disk is full")
        .compat(Compat::NoEffect("a failed write to the log file is dropped; stderr continues", Accepts::Any)),
    FlagSpec::value("log_backtrace_at", Some(""), "emit a backtrace at file:line")
        .compat(Compat::Refused("there are no backtraces at log sites; set RUST_BACKTRACE=1 for panics")),
    FlagSpec::boolean("symbolize_stacktrace", true, "symbolize stack traces")
        .compat(Compat::NoEffect("panic backtraces follow RUST_BACKTRACE", Accepts::Any)),
    FlagSpec::value("alsologtoemail", Some(""), "e-mail log messages").compat(Compat::Refused(NO_EMAIL)),
    FlagSpec::value("logemaillevel", Some("999"), "e-mail messages at this severity")
        .compat(Compat::NoEffect(NO_EMAIL, Accepts::Any)),
    FlagSpec::value("logmailer", Some("/bin/mail"), "mailer for e-mail logging")
        .compat(Compat::NoEffect(NO_EMAIL, Accepts::Any)),
];

/// How to log, from the flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSettings {
    /// Program name (names the log file).
    pub program: String,
    /// `tracing` filter (`RUST_LOG` overrides it when valid).
    pub filter: String,
    /// Directory of the log file, if any.
    pub log_dir: Option<PathBuf>,
    /// Least severe level copied to stderr (`None`: nothing) when a file is written.
    pub stderr_level: Option<Level>,
    /// Color on stderr (`None`: when it is a terminal).
    pub color: Option<bool>,
    /// Permissions of the log file.
    pub file_mode: u32,
}

/// Why the logging flags were rejected.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A flag or value did not parse.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// A value parsed but is not acceptable.
    #[error("invalid --{flag}: {reason}")]
    Invalid {
        /// Flag name.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// The log file could not be created.
    #[error("--log_dir: cannot create {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
}

fn glog_level(severity: i64) -> Option<Level> {
    match severity {
        i64::MIN..=0 => Some(Level::INFO),
        1 => Some(Level::WARN),
        2 | 3 => Some(Level::ERROR),
        _ => None,
    }
}

impl LogSettings {
    /// Reads [`LOG_FLAGS`] for `program`.
    pub fn from_flags(program: &str, flags: &ParsedFlags) -> Result<Self, LogError> {
        let filter = Self::filter(flags)?;
        let to_stderr_only = flags.bool("logtostderr")?;
        let dir = flags.string("log_dir").unwrap_or_default();
        let log_dir = (!dir.is_empty() && !to_stderr_only).then(|| PathBuf::from(dir));
        let threshold: i64 = flags.number("stderrthreshold")?.unwrap_or(2);
        let stderr_level = if flags.bool("alsologtostderr")? {
            Some(Level::TRACE)
        } else {
            glog_level(threshold.min(3))
        };
        let mode: u32 = flags.number("logfile_mode")?.unwrap_or(436);
        if mode > 0o777 {
            return Err(LogError::Invalid {
                flag: "logfile_mode",
                reason: format!("{mode} is not a file mode (decimal, at most 511 = 0777)"),
            });
        }
        Ok(LogSettings {
            program: program.to_string(),
            filter,
            log_dir,
            stderr_level,
            color: flags
                .is_set("colorlogtostderr")
                .then(|| flags.bool("colorlogtostderr"))
                .transpose()?,
            file_mode: mode,
        })
    }

    /// `--log_level` when given, else the level from `--minloglevel` and `--v`.
    fn filter(flags: &ParsedFlags) -> Result<String, LogError> {
        let level = flags.string("log_level").unwrap_or_else(|| "info".into());
        if !crate::flags::is_log_filter(&level) {
            return Err(LogError::Invalid {
                flag: "log_level",
                reason: format!("{level:?}: use error, warn, info, debug or trace"),
            });
        }
        if flags.is_set("log_level") {
            return Ok(level);
        }
        let min: i64 = flags.number("minloglevel")?.unwrap_or(0);
        let verbose: i64 = flags.number("v")?.unwrap_or(0);
        Ok(match (min, verbose) {
            (1, _) => "warn",
            (2.., _) => "error",
            (_, 2..) => "trace",
            (_, 1) => "debug",
            _ => "info",
        }
        .to_string())
    }

    /// Installs the global logger (a second call keeps the first one).
    pub fn init(&self) -> Result<(), LogError> {
        let directives = if self.filter.contains("tarpc") {
            self.filter.clone()
        } else {
            // tarpc reports every peer that disconnects mid-stream as a warning;
            // routine for a store whose dummies come and go.
            format!("{},tarpc=error", self.filter)
        };
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .or_else(|_| tracing_subscriber::EnvFilter::try_new(&directives))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tarpc=error"));
        let file = self
            .log_dir
            .as_ref()
            .map(|dir| self.open_file(dir))
            .transpose()?;
        let color = self
            .color
            .unwrap_or_else(|| std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let stderr_level = if file.is_some() {
            self.stderr_level
        } else {
            Some(Level::TRACE)
        };
        let stderr = stderr_level.map(|level| {
            tracing_subscriber::fmt::layer()
                .with_ansi(color)
                .with_writer(std::io::stderr.with_max_level(level))
        });
        let file = file.map(|file| {
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(Mutex::new(file))
        });
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(stderr)
            .with(file)
            .try_init();
        Ok(())
    }

    fn open_file(&self, dir: &std::path::Path) -> Result<std::fs::File, LogError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let name = format!("{}.log.INFO.{}", self.program, std::process::id());
        let path = dir.join(&name);
        let error = |source| LogError::File {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(error)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(self.file_mode)
            .open(&path)
            .map_err(error)?;
        let link = dir.join(format!("{}.INFO", self.program));
        let _ = std::fs::remove_file(&link);
        let _ = std::os::unix::fs::symlink(&name, &link);
        Ok(file)
    }
}

/// Target of the records of evicted objects (level debug): one per object the master
/// evicts from memory and per object a real client's SSD tier evicts, with its `key`
/// and [`monotonic_us`] taken before the object left the index (no read saw it gone
/// earlier). `--log_level=info,mooncake::eviction=debug` turns them on.
pub const EVICTION_TARGET: &str = "mooncake::eviction";

/// The host's monotonic clock (`CLOCK_MONOTONIC`) in microseconds: one clock for every
/// process on the host, so records of different processes can be put in one order.
pub fn monotonic_us() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut now) };
    let micros = i128::from(now.tv_sec) * 1_000_000 + i128::from(now.tv_nsec) / 1_000;
    u64::try_from(micros).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::{GFLAGS, Program, parse};

    static TABLE: &[&[FlagSpec]] = &[LOG_FLAGS, GFLAGS];
    static PROGRAM: Program = Program {
        name: "t",
        about: "t",
        table: TABLE,
    };

    fn settings(args: &[&str]) -> Result<LogSettings, LogError> {
        let flags = parse(&PROGRAM, args.iter().map(|s| s.to_string()), |_| None)?;
        LogSettings::from_flags("t", &flags)
    }

    #[test]
    fn glog_flags_map_to_levels() {
        assert_eq!(settings(&[]).expect("ok").filter, "info");
        assert_eq!(
            settings(&["-v=1", "--logtostderr"]).expect("ok").filter,
            "debug"
        );
        assert_eq!(settings(&["--v", "2"]).expect("ok").filter, "trace");
        assert_eq!(
            settings(&["--minloglevel=2", "-v=1"]).expect("ok").filter,
            "error"
        );
        assert_eq!(settings(&["--minloglevel=1"]).expect("ok").filter, "warn");
        assert_eq!(
            settings(&["--log_level=warn", "-v=1"]).expect("ok").filter,
            "warn"
        );
        assert!(settings(&["--v=lots"]).is_err());
        assert!(settings(&["--vmodule=master=2"]).is_err());
        assert!(settings(&["--vmodule="]).is_ok());
    }

    #[test]
    fn log_dir_and_stderr() {
        let s = settings(&["--log_dir=/var/log/mc"]).expect("ok");
        assert_eq!(s.log_dir, Some(PathBuf::from("/var/log/mc")));
        assert_eq!(s.stderr_level, Some(Level::ERROR));
        let s = settings(&["--log_dir=/var/log/mc", "--alsologtostderr"]).expect("ok");
        assert_eq!(s.stderr_level, Some(Level::TRACE));
        let s = settings(&["--log_dir=/var/log/mc", "--stderrthreshold=0"]).expect("ok");
        assert_eq!(s.stderr_level, Some(Level::INFO));
        let s = settings(&["--log_dir=/var/log/mc", "--logtostderr"]).expect("ok");
        assert_eq!(s.log_dir, None);
        assert!(settings(&["--logfile_mode=4000"]).is_err());
    }
}
