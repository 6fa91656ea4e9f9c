//! A command-line parser that accepts what upstream's gflags-based binaries accept, so
//! existing scripts keep working: `--flag=value`, `--flag value`, `-flag=value`, dashes
//! or underscores in names, booleans as `true/false/1/0/yes/no/on/off` or a bare
//! `--flag` (and `--noflag`). Each flag may name an environment variable used when the
//! flag is absent: flag > environment > default.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use crate::units::{UnitError, parse_duration, parse_size};

/// Whether a flag takes a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlagKind {
    /// `--flag`, `--flag=true`, `--flag false`, `--noflag`.
    Bool,
    /// `--flag=value` or `--flag value`.
    Value,
}

/// Declaration of one flag.
#[derive(Clone, Copy, Debug)]
pub struct FlagSpec {
    /// Name with underscores, e.g. `global_segment_size`.
    pub name: &'static str,
    /// Bool or value.
    pub kind: FlagKind,
    /// Environment variable consulted when the flag is absent.
    pub env: Option<&'static str>,
    /// Default when neither flag nor variable is set.
    pub default: Option<&'static str>,
    /// One line of help.
    pub help: &'static str,
}

/// Where a flag's effective value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The command line.
    Flag,
    /// An environment variable.
    Env(&'static str),
    /// A configuration file.
    File,
    /// The built-in default.
    Default,
}

/// Why the command line or a value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// `--help` was given; the payload is the help text.
    #[error("{0}")]
    Help(String),
    /// A flag that does not exist.
    #[error("unknown flag --{0} (see --help for the list of flags)")]
    Unknown(String),
    /// A value flag at the end of the command line.
    #[error("flag --{0} needs a value, e.g. --{0}=VALUE")]
    MissingValue(String),
    /// An argument that is not a flag.
    #[error("unexpected argument {0:?}: every argument must be a --flag")]
    Positional(String),
    /// A value that does not parse.
    #[error("invalid value {value:?} for --{flag} (from {source_name}): {reason}")]
    BadValue {
        /// Flag name.
        flag: String,
        /// The rejected value.
        value: String,
        /// Where it came from, for the message.
        source_name: String,
        /// Why it was rejected.
        reason: String,
    },
}

/// Parsed command line plus environment, queried by flag name.
#[derive(Debug)]
pub struct ParsedFlags {
    specs: &'static [FlagSpec],
    given: HashMap<&'static str, String>,
    env: HashMap<&'static str, String>,
    file: HashMap<&'static str, String>,
}

/// Parses a boolean the way gflags does.
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "enable" | "y" | "t" => Some(true),
        "0" | "false" | "no" | "off" | "disable" | "n" | "f" => Some(false),
        _ => None,
    }
}

/// True for a log level name or a `target=level` filter list (what `--log_level`
/// accepts).
pub fn is_log_filter(text: &str) -> bool {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    !text.is_empty()
        && text.split(',').all(|part| {
            let level = part.rsplit_once('=').map_or(part, |(_, level)| level);
            LEVELS.contains(&level.trim().to_ascii_lowercase().as_str())
        })
}

fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

fn find(specs: &'static [FlagSpec], name: &str) -> Option<&'static FlagSpec> {
    specs.iter().find(|s| s.name == name)
}

/// Parses `args` (without the program name) against `specs`, reading environment
/// variables through `env`.
pub fn parse(
    specs: &'static [FlagSpec],
    program: &str,
    about: &str,
    args: impl IntoIterator<Item = String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<ParsedFlags, FlagError> {
    let mut given = HashMap::new();
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        let Some(body) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
            return Err(FlagError::Positional(arg));
        };
        let (raw_name, inline_value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let name = normalize(raw_name);
        if name == "help" || name == "h" {
            return Err(FlagError::Help(help_text(specs, program, about)));
        }
        let (spec, value) = match find(specs, &name) {
            Some(spec) => {
                let value = match (spec.kind, inline_value) {
                    (_, Some(v)) => v,
                    (FlagKind::Bool, None) => match args.peek().map(|a| parse_bool(a)) {
                        Some(Some(_)) => args.next().unwrap_or_default(),
                        _ => "true".to_string(),
                    },
                    (FlagKind::Value, None) => args
                        .next()
                        .ok_or_else(|| FlagError::MissingValue(name.clone()))?,
                };
                (spec, value)
            }
            None => match name.strip_prefix("no").and_then(|n| find(specs, n)) {
                Some(spec) if spec.kind == FlagKind::Bool && inline_value.is_none() => {
                    (spec, "false".to_string())
                }
                _ => return Err(FlagError::Unknown(name)),
            },
        };
        given.insert(spec.name, value);
    }
    let env = specs
        .iter()
        .filter_map(|s| s.env.and_then(|var| env(var).map(|v| (s.name, v))))
        .collect();
    Ok(ParsedFlags {
        specs,
        given,
        env,
        file: HashMap::new(),
    })
}

/// The `--help` text for a set of flags.
pub fn help_text(specs: &[FlagSpec], program: &str, about: &str) -> String {
    let mut text = format!("{program}: {about}\n\nUsage: {program} [--flag=value ...]\n\nFlags:\n");
    for spec in specs {
        let _ = write!(text, "  --{}", spec.name);
        if spec.kind == FlagKind::Value {
            text.push_str("=VALUE");
        }
        let _ = write!(text, "\n      {}", spec.help);
        if let Some(default) = spec.default {
            let _ = write!(text, " [default: {default}]");
        }
        if let Some(env) = spec.env {
            let _ = write!(text, " [env: {env}]");
        }
        text.push('\n');
    }
    text
}

impl ParsedFlags {
    fn spec(&self, name: &str) -> &'static FlagSpec {
        find(self.specs, name).unwrap_or_else(|| panic!("flag --{name} is not declared"))
    }

    /// The effective value and where it came from, if any.
    pub fn raw(&self, name: &str) -> Option<(&str, Source)> {
        let spec = self.spec(name);
        if let Some(v) = self.given.get(spec.name) {
            return Some((v, Source::Flag));
        }
        if let Some(v) = self.file.get(spec.name) {
            return Some((v, Source::File));
        }
        if let (Some(v), Some(var)) = (self.env.get(spec.name), spec.env) {
            return Some((v, Source::Env(var)));
        }
        spec.default.map(|d| (d, Source::Default))
    }

    /// Adds values from a configuration file (`key → value`, keys named like the flags,
    /// `aliases` mapping other spellings to flag names); a flag given on the command
    /// line still wins. Unknown keys are an error.
    pub fn merge_file(
        &mut self,
        values: Vec<(String, String)>,
        aliases: &[(&str, &str)],
    ) -> Result<(), FlagError> {
        for (key, value) in values {
            let key = normalize(&key);
            let name = aliases
                .iter()
                .find(|(alias, _)| *alias == key)
                .map_or(key.as_str(), |(_, name)| name);
            let spec = find(self.specs, name)
                .ok_or_else(|| FlagError::Unknown(format!("{key} (in the configuration file)")))?;
            self.file.insert(spec.name, value);
        }
        Ok(())
    }

    /// Whether the flag was given on the command line.
    pub fn is_given(&self, name: &str) -> bool {
        self.given.contains_key(self.spec(name).name)
    }

    fn bad(&self, name: &str, value: &str, source: Source, reason: String) -> FlagError {
        let source_name = match source {
            Source::Flag => "the command line".to_string(),
            Source::Env(var) => format!("environment variable {var}"),
            Source::File => "the configuration file".to_string(),
            Source::Default => "the default".to_string(),
        };
        FlagError::BadValue {
            flag: name.to_string(),
            value: value.to_string(),
            source_name,
            reason,
        }
    }

    fn typed<T>(
        &self,
        name: &str,
        convert: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, FlagError> {
        match self.raw(name) {
            None => Ok(None),
            Some((value, source)) => convert(value)
                .map(Some)
                .map_err(|reason| self.bad(name, value, source, reason)),
        }
    }

    /// A string value.
    pub fn string(&self, name: &str) -> Option<String> {
        self.raw(name).map(|(v, _)| v.to_string())
    }

    /// A boolean value (absent means false).
    pub fn bool(&self, name: &str) -> Result<bool, FlagError> {
        self.typed(name, |v| {
            parse_bool(v).ok_or_else(|| "expected true/false, 1/0, yes/no or on/off".to_string())
        })
        .map(|v| v.unwrap_or(false))
    }

    /// A byte size such as `4 GB`.
    pub fn size(&self, name: &str) -> Result<Option<u64>, FlagError> {
        self.typed(name, |v| {
            parse_size(v).map_err(|e: UnitError| e.to_string())
        })
    }

    /// A duration such as `10s` (bare numbers are seconds, or milliseconds when
    /// `bare_is_millis`, as upstream's `*_ttl` flags).
    pub fn duration(
        &self,
        name: &str,
        bare_is_millis: bool,
    ) -> Result<Option<Duration>, FlagError> {
        self.typed(name, |v| {
            if bare_is_millis && let Ok(ms) = v.trim().parse::<u64>() {
                return Ok(Duration::from_millis(ms));
            }
            parse_duration(v).map_err(|e| e.to_string())
        })
    }

    /// A number of any primitive type (integer or float).
    pub fn number<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, FlagError> {
        self.typed(name, |v| {
            v.trim().parse::<T>().map_err(|_| {
                let kind = std::any::type_name::<T>();
                if kind.starts_with('f') {
                    "expected a number such as 0.05".to_string()
                } else {
                    format!("expected a whole number that fits in {kind}")
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static SPECS: &[FlagSpec] = &[
        FlagSpec {
            name: "port",
            kind: FlagKind::Value,
            env: None,
            default: Some("50052"),
            help: "port",
        },
        FlagSpec {
            name: "enable_offload",
            kind: FlagKind::Bool,
            env: Some("X_OFFLOAD"),
            default: None,
            help: "offload",
        },
        FlagSpec {
            name: "global_segment_size",
            kind: FlagKind::Value,
            env: Some("X_SIZE"),
            default: Some("4 GB"),
            help: "size",
        },
        FlagSpec {
            name: "ttl",
            kind: FlagKind::Value,
            env: None,
            default: Some("10000"),
            help: "ttl",
        },
    ];

    fn parse_args(args: &[&str], env: &[(&str, &str)]) -> Result<ParsedFlags, FlagError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse(
            SPECS,
            "t",
            "test",
            args.iter().map(|s| s.to_string()),
            |k| env.get(k).cloned(),
        )
    }

    #[test]
    fn gflags_syntax() {
        for args in [
            &["--port=1", "--enable-offload", "true"][..],
            &["-port=1", "--enable_offload=1"],
            &["--port", "1", "--enable-offload"],
        ] {
            let flags = parse_args(args, &[]).expect("parses");
            assert_eq!(flags.number::<u16>("port"), Ok(Some(1)), "{args:?}");
            assert_eq!(flags.bool("enable_offload"), Ok(true), "{args:?}");
        }
        let flags = parse_args(&["--noenable_offload"], &[("X_OFFLOAD", "1")]).expect("parses");
        assert_eq!(flags.bool("enable_offload"), Ok(false));
    }

    #[test]
    fn precedence_flag_env_default() {
        let flags = parse_args(&[], &[]).expect("parses");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(4 << 30)));
        let flags = parse_args(&[], &[("X_SIZE", "1GB")]).expect("parses");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(1 << 30)));
        let flags =
            parse_args(&["--global_segment_size=2GB"], &[("X_SIZE", "1GB")]).expect("parses");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(2 << 30)));
        assert_eq!(
            flags.duration("ttl", true),
            Ok(Some(Duration::from_secs(10)))
        );
    }

    #[test]
    fn errors_name_the_flag() {
        assert!(matches!(
            parse_args(&["--bogus=1"], &[]),
            Err(FlagError::Unknown(_))
        ));
        assert!(matches!(
            parse_args(&["--port"], &[]),
            Err(FlagError::MissingValue(_))
        ));
        assert!(matches!(
            parse_args(&["stray"], &[]),
            Err(FlagError::Positional(_))
        ));
        assert!(matches!(
            parse_args(&["--help"], &[]),
            Err(FlagError::Help(_))
        ));
        let flags = parse_args(&[], &[("X_SIZE", "lots")]).expect("parses");
        let error = flags
            .size("global_segment_size")
            .expect_err("bad size")
            .to_string();
        assert!(
            error.contains("global_segment_size") && error.contains("X_SIZE"),
            "{error}"
        );
    }
}
