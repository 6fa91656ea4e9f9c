//! A command-line parser that accepts what upstream's gflags-based binaries accept, so
//! existing scripts keep working: `--flag=value`, `--flag value`, `-flag=value`, dashes
//! or underscores in names, booleans as `true/false/1/0/yes/no/on/off` or a bare
//! `--flag` (and `--noflag`), plus gflags' own flags (`--flagfile`, `--fromenv`,
//! `--tryfromenv`, `--undefok`, `--help*`, `--version`).
//!
//! One table per binary drives everything: parsing, `--help`, and the machine-readable
//! listing (`--list_flags_json`, [`listing`]). Each entry says how it relates to
//! upstream's flag of the same name ([`Compat`]): the same meaning, a different one,
//! accepted without effect (logged once at startup), or refused with a note saying what
//! to use instead. Precedence of a value: flag > environment variable > configuration
//! file > default.

use std::collections::{HashMap, HashSet};
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

/// Which values of a flag without effect are still accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepts {
    /// Every value.
    Any,
    /// Only these values (booleans and numbers compare by value); others are refused.
    Only(&'static [&'static str]),
}

/// How a flag relates to upstream's flag of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compat {
    /// Not an upstream flag: ours only.
    Ours,
    /// Upstream's flag with upstream's meaning.
    Same,
    /// Upstream's flag, implemented, with the difference noted.
    Differs(&'static str),
    /// Upstream's flag, accepted but without effect here (the note says why); values
    /// outside `Accepts` are refused with the note. Logged once at startup when given.
    NoEffect(&'static str, Accepts),
    /// Upstream's flag, refused unless given its default value; the note says what to
    /// use instead.
    Refused(&'static str),
}

impl Compat {
    /// `same`, `differs`, `refused` or `ours`, for the listing.
    pub fn status(self) -> &'static str {
        match self {
            Compat::Ours => "ours",
            Compat::Same => "same",
            Compat::Differs(_) | Compat::NoEffect(..) => "differs",
            Compat::Refused(_) => "refused",
        }
    }

    /// The note for the listing.
    pub fn note(self) -> String {
        match self {
            Compat::Ours | Compat::Same => String::new(),
            Compat::Differs(note) => note.to_string(),
            Compat::NoEffect(note, Accepts::Any) => format!("accepted, no effect: {note}"),
            Compat::NoEffect(note, Accepts::Only(values)) => format!(
                "accepted only as {}, no effect: {note}",
                values.join(" or ")
            ),
            Compat::Refused(note) => format!("refused unless left at its default: {note}"),
        }
    }
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
    /// Relation to upstream's flag of the same name.
    pub compat: Compat,
}

impl FlagSpec {
    /// A value flag with upstream's meaning.
    pub const fn value(
        name: &'static str,
        default: Option<&'static str>,
        help: &'static str,
    ) -> Self {
        FlagSpec {
            name,
            kind: FlagKind::Value,
            env: None,
            default,
            help,
            compat: Compat::Same,
        }
    }

    /// A boolean flag with upstream's meaning.
    pub const fn boolean(name: &'static str, default: bool, help: &'static str) -> Self {
        FlagSpec {
            name,
            kind: FlagKind::Bool,
            env: None,
            default: Some(if default { "true" } else { "false" }),
            help,
            compat: Compat::Same,
        }
    }

    /// The same flag, read from `var` when absent from the command line.
    pub const fn env(mut self, var: &'static str) -> Self {
        self.env = Some(var);
        self
    }

    /// The same flag with another relation to upstream.
    pub const fn compat(mut self, compat: Compat) -> Self {
        self.compat = compat;
        self
    }

    /// The same flag, marked as ours only.
    pub const fn ours(self) -> Self {
        self.compat(Compat::Ours)
    }
}

/// The flags of one binary: its tables, searched in order.
pub type FlagTable = &'static [&'static [FlagSpec]];

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
    /// `--version` was given; the payload is the version line.
    #[error("{0}")]
    Version(String),
    /// `--list_flags_json` was given; the payload is the JSON listing.
    #[error("{0}")]
    List(String),
    /// A flag that does not exist.
    #[error("unknown flag --{0} (see --help for the list of flags)")]
    Unknown(String),
    /// A value flag at the end of the command line.
    #[error("flag --{0} needs a value, e.g. --{0}=VALUE")]
    MissingValue(String),
    /// An argument that is not a flag.
    #[error("unexpected argument {0:?}: every argument must be a --flag")]
    Positional(String),
    /// An upstream flag given a value asking for something this build does not do.
    #[error("--{flag}={value} is not supported: {note}")]
    Refused {
        /// Flag name.
        flag: String,
        /// The refused value.
        value: String,
        /// Why, and what to use instead.
        note: String,
    },
    /// A `--flagfile` that cannot be read.
    #[error("--flagfile {path}: {reason}")]
    FlagFile {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// `--fromenv` named a flag whose `FLAGS_<name>` variable is not set.
    #[error("--fromenv: environment variable FLAGS_{0} is not set")]
    FromEnv(String),
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

impl FlagError {
    /// The text to print on stdout before exiting with code 0 (`--help`, `--version`,
    /// `--list_flags_json`), or `None` for a real error.
    pub fn stdout_text(&self) -> Option<&str> {
        match self {
            FlagError::Help(text) | FlagError::Version(text) | FlagError::List(text) => Some(text),
            _ => None,
        }
    }
}

/// gflags' own flags, understood by both binaries.
pub static GFLAGS: &[FlagSpec] = &[
    FlagSpec::value(
        "flagfile",
        Some(""),
        "read flags from this file, one per line",
    ),
    FlagSpec::value(
        "fromenv",
        Some(""),
        "comma-separated flags to read from FLAGS_<name> variables (each must be set)",
    ),
    FlagSpec::value(
        "tryfromenv",
        Some(""),
        "comma-separated flags to read from FLAGS_<name> variables when set",
    ),
    FlagSpec::value(
        "undefok",
        Some(""),
        "comma-separated unknown flag names to ignore (give them as --name=value)",
    ),
    FlagSpec::boolean("help", false, "print this help and exit"),
    FlagSpec::boolean("helpfull", false, "print this help and exit"),
    FlagSpec::boolean("helpshort", false, "print this help and exit"),
    FlagSpec::boolean("helppackage", false, "print this help and exit"),
    FlagSpec::boolean(
        "helpxml",
        false,
        "print this help (plain text, not XML) and exit",
    )
    .compat(Compat::Differs(
        "prints the plain-text help; --list_flags_json is the machine-readable listing",
    )),
    FlagSpec::value(
        "helpmatch",
        Some(""),
        "print the help of flags whose name contains this and exit",
    ),
    FlagSpec::value(
        "helpon",
        Some(""),
        "print the help of flags whose name contains this and exit",
    )
    .compat(Compat::Differs("matches flag names, not source modules")),
    FlagSpec::boolean("version", false, "print the version and exit"),
    FlagSpec::value(
        "tab_completion_columns",
        Some("80"),
        "bash completion width",
    )
    .compat(Compat::NoEffect(
        "there is no bash completion",
        Accepts::Any,
    )),
    FlagSpec::value(
        "tab_completion_word",
        Some(""),
        "bash completion of this word",
    )
    .compat(Compat::Refused("there is no bash completion; see --help")),
    FlagSpec::boolean(
        "list_flags_json",
        false,
        "print every flag as JSON (name, default, status against upstream, note) and exit",
    )
    .ours(),
];

/// Flags of upstream's allocator library, linked into both upstream binaries.
pub static ARENA_FLAGS: &[FlagSpec] = &[
    FlagSpec::value(
        "mmap_arena_pool_size",
        Some("8589934592"),
        "mmap arena size",
    )
    .compat(Compat::NoEffect(
        "there is no mmap arena allocator",
        Accepts::Any,
    )),
    FlagSpec::boolean("use_mmap_arena_allocator", false, "mmap arena allocator").compat(
        Compat::NoEffect("there is no mmap arena allocator", Accepts::Any),
    ),
];

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

fn find(table: FlagTable, name: &str) -> Option<&'static FlagSpec> {
    table.iter().flat_map(|t| t.iter()).find(|s| s.name == name)
}

/// True when `value` equals `wanted` for this flag: booleans and numbers by value,
/// anything else as trimmed text.
fn same_value(kind: FlagKind, value: &str, wanted: &str) -> bool {
    if kind == FlagKind::Bool {
        return parse_bool(value).is_some() && parse_bool(value) == parse_bool(wanted);
    }
    match (value.trim().parse::<f64>(), wanted.trim().parse::<f64>()) {
        (Ok(a), Ok(b)) => a == b,
        _ => value.trim() == wanted.trim(),
    }
}

/// Refuses a value that asks an upstream flag for something this build does not do.
fn check_compat(spec: &FlagSpec, value: &str) -> Result<(), FlagError> {
    let refuse = |note: &str| FlagError::Refused {
        flag: spec.name.to_string(),
        value: value.to_string(),
        note: note.to_string(),
    };
    match spec.compat {
        Compat::NoEffect(note, Accepts::Only(values))
            if !values.iter().any(|w| same_value(spec.kind, value, w)) =>
        {
            Err(refuse(note))
        }
        Compat::Refused(note)
            if !spec
                .default
                .is_some_and(|d| same_value(spec.kind, value, d)) =>
        {
            Err(refuse(note))
        }
        _ => Ok(()),
    }
}

/// Longest chain of `--flagfile` inside flag files.
const MAX_FLAGFILE_DEPTH: usize = 4;

/// Longest flag file read.
const MAX_FLAGFILE_BYTES: u64 = 1 << 20;

/// Replaces each `--flagfile=PATH` (or `--flagfile PATH`) by the flags in that file:
/// one per line, `#` comments and blank lines skipped.
fn expand_flagfiles(args: Vec<String>, depth: usize) -> Result<Vec<String>, FlagError> {
    let mut out = Vec::with_capacity(args.len());
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let body = arg.trim_start_matches('-');
        let path = match body.split_once('=') {
            Some((name, path)) if normalize(name) == "flagfile" => path.to_string(),
            None if normalize(body) == "flagfile" && arg.starts_with('-') => args
                .next()
                .ok_or_else(|| FlagError::MissingValue("flagfile".into()))?,
            _ => {
                out.push(arg);
                continue;
            }
        };
        if path.is_empty() {
            continue;
        }
        if depth >= MAX_FLAGFILE_DEPTH {
            return Err(FlagError::FlagFile {
                path,
                reason: format!("more than {MAX_FLAGFILE_DEPTH} nested --flagfile"),
            });
        }
        out.extend(expand_flagfiles(read_flagfile(&path)?, depth + 1)?);
    }
    Ok(out)
}

fn read_flagfile(path: &str) -> Result<Vec<String>, FlagError> {
    let bad = |reason: String| FlagError::FlagFile {
        path: path.to_string(),
        reason,
    };
    let size = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if size > MAX_FLAGFILE_BYTES {
        return Err(bad(format!("larger than {MAX_FLAGFILE_BYTES} bytes")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect())
}

/// The comma-separated names given to `--<flag>` anywhere in `args`.
fn list_flag(args: &[String], flag: &str) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.trim_start_matches('-').split_once('='))
        .filter(|(name, _)| normalize(name) == flag)
        .flat_map(|(_, list)| list.split(','))
        .map(|n| normalize(n.trim()))
        .filter(|n| !n.is_empty())
        .collect()
}

/// What [`parse`] is parsing for: the binary's name, its one-line description and its
/// flags.
#[derive(Clone, Copy, Debug)]
pub struct Program {
    /// Binary name, e.g. `mooncake_master`.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Its flags.
    pub table: FlagTable,
}

/// Parsed command line plus environment, queried by flag name.
#[derive(Debug)]
pub struct ParsedFlags {
    table: FlagTable,
    given: HashMap<&'static str, String>,
    env: HashMap<&'static str, String>,
    file: HashMap<&'static str, String>,
    ignored: Vec<String>,
}

/// Parses `args` (without the program name) against `program`'s flags, reading
/// environment variables through `env`.
pub fn parse(
    program: &Program,
    args: impl IntoIterator<Item = String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<ParsedFlags, FlagError> {
    let args = expand_flagfiles(args.into_iter().collect(), 0)?;
    let undefok: HashSet<String> = list_flag(&args, "undefok").into_iter().collect();
    let mut flags = ParsedFlags {
        table: program.table,
        given: HashMap::new(),
        env: HashMap::new(),
        file: HashMap::new(),
        ignored: Vec::new(),
    };
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        let Some((name, value)) = next_flag(program.table, &arg, &mut args, &undefok)? else {
            flags.ignored.push(arg);
            continue;
        };
        special_flag(program, name, &value)?;
        flags.given.insert(name, value);
    }
    flags.read_from_env(&env)?;
    flags.env = program
        .table
        .iter()
        .flat_map(|t| t.iter())
        .filter_map(|s| s.env.and_then(|var| env(var).map(|v| (s.name, v))))
        .collect();
    for (name, value) in &flags.given {
        if let Some(spec) = find(program.table, name) {
            check_compat(spec, value)?;
        }
    }
    Ok(flags)
}

/// One flag and its value from `arg` (taking the next argument when needed); `None`
/// for an unknown flag listed in `--undefok`.
fn next_flag(
    table: FlagTable,
    arg: &str,
    rest: &mut std::iter::Peekable<std::vec::IntoIter<String>>,
    undefok: &HashSet<String>,
) -> Result<Option<(&'static str, String)>, FlagError> {
    let Some(body) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
        return Err(FlagError::Positional(arg.to_string()));
    };
    let (raw_name, inline_value) = match body.split_once('=') {
        Some((n, v)) => (n, Some(v.to_string())),
        None => (body, None),
    };
    let name = normalize(raw_name);
    let name = if name == "h" {
        "help".to_string()
    } else {
        name
    };
    if let Some(spec) = find(table, &name) {
        let value = match (spec.kind, inline_value) {
            (_, Some(v)) => v,
            (FlagKind::Bool, None) => match rest.peek().map(|a| parse_bool(a)) {
                Some(Some(_)) => rest.next().unwrap_or_default(),
                _ => "true".to_string(),
            },
            (FlagKind::Value, None) => rest
                .next()
                .ok_or_else(|| FlagError::MissingValue(name.clone()))?,
        };
        return Ok(Some((spec.name, value)));
    }
    match name.strip_prefix("no").and_then(|n| find(table, n)) {
        Some(spec) if spec.kind == FlagKind::Bool && inline_value.is_none() => {
            Ok(Some((spec.name, "false".to_string())))
        }
        _ if undefok.contains(&name)
            || name.strip_prefix("no").is_some_and(|n| undefok.contains(n)) =>
        {
            Ok(None)
        }
        _ => Err(FlagError::Unknown(name)),
    }
}

/// Acts on the flags that print something and exit.
fn special_flag(program: &Program, name: &str, value: &str) -> Result<(), FlagError> {
    let on = || parse_bool(value).unwrap_or(false);
    match name {
        "help" | "helpfull" | "helpshort" | "helppackage" | "helpxml" if on() => {
            Err(FlagError::Help(help_text(program, "")))
        }
        "helpmatch" | "helpon" if !value.is_empty() => {
            Err(FlagError::Help(help_text(program, value)))
        }
        "version" if on() => Err(FlagError::Version(format!(
            "{} {}\n",
            program.name,
            env!("CARGO_PKG_VERSION")
        ))),
        "list_flags_json" if on() => Err(FlagError::List(listing_json(program.table) + "\n")),
        _ => Ok(()),
    }
}

/// The `--help` text; with a non-empty `matching`, only flags whose name contains it.
pub fn help_text(program: &Program, matching: &str) -> String {
    let name = program.name;
    let mut text = format!(
        "{name}: {}\n\nUsage: {name} [--flag=value ...]\n\nFlags (status against upstream's flag of the same name in brackets):\n",
        program.about
    );
    let specs = program.table.iter().flat_map(|t| t.iter());
    for spec in specs.filter(|s| s.name.contains(matching)) {
        let _ = write!(text, "  --{}", spec.name);
        if spec.kind == FlagKind::Value {
            text.push_str("=VALUE");
        }
        let _ = write!(text, "\n      {}", spec.help);
        if let Some(default) = spec.default.filter(|d| !d.is_empty()) {
            let _ = write!(text, " [default: {default}]");
        }
        if let Some(env) = spec.env {
            let _ = write!(text, " [env: {env}]");
        }
        if !matches!(spec.compat, Compat::Same | Compat::Ours) {
            let _ = write!(text, " [{}: {}]", spec.compat.status(), spec.compat.note());
        }
        text.push('\n');
    }
    text
}

/// One row of the machine-readable flag listing.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FlagInfo {
    /// Flag name (underscores).
    pub name: &'static str,
    /// `bool` or `value`.
    pub kind: &'static str,
    /// Default, if any.
    pub default: Option<&'static str>,
    /// Environment variable, if any.
    pub env: Option<&'static str>,
    /// `same`, `differs`, `refused` (upstream flags) or `ours`.
    pub status: &'static str,
    /// What differs, or what to use instead.
    pub note: String,
    /// One line of help.
    pub help: &'static str,
}

/// Every flag of a binary with its status against upstream.
pub fn listing(table: FlagTable) -> Vec<FlagInfo> {
    table
        .iter()
        .flat_map(|t| t.iter())
        .map(|s| FlagInfo {
            name: s.name,
            kind: match s.kind {
                FlagKind::Bool => "bool",
                FlagKind::Value => "value",
            },
            default: s.default,
            env: s.env,
            status: s.compat.status(),
            note: s.compat.note(),
            help: s.help,
        })
        .collect()
}

/// [`listing`] as a JSON array.
pub fn listing_json(table: FlagTable) -> String {
    serde_json::to_string_pretty(&listing(table)).unwrap_or_else(|_| "[]".to_string())
}

/// Flags every upstream binary has from its shared libraries (gflags' own flags, glog's
/// logging flags, the mmap arena allocator): part of both binaries' upstream lists.
pub const UPSTREAM_COMMON_FLAGS: &[&str] = &[
    "mmap_arena_pool_size",
    "use_mmap_arena_allocator",
    "flagfile",
    "fromenv",
    "tryfromenv",
    "undefok",
    "tab_completion_columns",
    "tab_completion_word",
    "help",
    "helpfull",
    "helpmatch",
    "helpon",
    "helppackage",
    "helpshort",
    "helpxml",
    "version",
    "alsologtoemail",
    "alsologtostderr",
    "colorlogtostderr",
    "drop_log_memory",
    "log_backtrace_at",
    "log_dir",
    "log_link",
    "log_prefix",
    "logbuflevel",
    "logbufsecs",
    "logemaillevel",
    "logfile_mode",
    "logmailer",
    "logtostderr",
    "max_log_size",
    "minloglevel",
    "stderrthreshold",
    "stop_logging_if_full_disk",
    "symbolize_stacktrace",
    "v",
    "vmodule",
];

/// Differences between a flag table and the flag names of upstream's binary: upstream
/// names not declared, or declared as ours; declared upstream flags upstream lacks.
/// Empty when the table covers upstream exactly (a unit test of each binary).
pub fn upstream_gaps(table: FlagTable, upstream: &[&str]) -> Vec<String> {
    let mut gaps: Vec<String> = upstream
        .iter()
        .filter(|name| find(table, name).is_none_or(|s| s.compat == Compat::Ours))
        .map(|name| format!("upstream flag --{name} is not declared as upstream's"))
        .collect();
    gaps.extend(
        table
            .iter()
            .flat_map(|t| t.iter())
            .filter(|s| s.compat != Compat::Ours && !upstream.contains(&s.name))
            .map(|s| {
                format!(
                    "--{} is marked as upstream's but upstream has no such flag",
                    s.name
                )
            }),
    );
    gaps
}

impl ParsedFlags {
    fn spec(&self, name: &str) -> &'static FlagSpec {
        find(self.table, name).unwrap_or_else(|| panic!("flag --{name} is not declared"))
    }

    /// Applies `--fromenv` / `--tryfromenv`: `FLAGS_<name>` for each listed flag not
    /// already on the command line.
    fn read_from_env(&mut self, env: &impl Fn(&str) -> Option<String>) -> Result<(), FlagError> {
        for (list, required) in [("fromenv", true), ("tryfromenv", false)] {
            let Some(names) = self.given.get(list).cloned() else {
                continue;
            };
            for name in names.split(',').map(|n| normalize(n.trim())) {
                if name.is_empty() {
                    continue;
                }
                let spec =
                    find(self.table, &name).ok_or_else(|| FlagError::Unknown(name.clone()))?;
                match env(&format!("FLAGS_{name}")) {
                    Some(value) => {
                        self.given.entry(spec.name).or_insert(value);
                    }
                    None if required => return Err(FlagError::FromEnv(name)),
                    None => {}
                }
            }
        }
        Ok(())
    }

    /// The effective value and where it came from, if any.
    pub fn raw(&self, name: &str) -> Option<(&str, Source)> {
        let spec = self.spec(name);
        if let Some(v) = self.given.get(spec.name) {
            return Some((v, Source::Flag));
        }
        if let (Some(v), Some(var)) = (self.env.get(spec.name), spec.env) {
            return Some((v, Source::Env(var)));
        }
        if let Some(v) = self.file.get(spec.name) {
            return Some((v, Source::File));
        }
        spec.default.map(|d| (d, Source::Default))
    }

    /// Adds values from a configuration file (`key → value`, keys named like the flags,
    /// `aliases` mapping other spellings to flag names); a flag given on the command
    /// line or its environment variable still wins. Unknown keys are an error, and
    /// values are checked against upstream's meaning like flags.
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
            let spec = find(self.table, name)
                .ok_or_else(|| FlagError::Unknown(format!("{key} (in the configuration file)")))?;
            check_compat(spec, &value)?;
            self.file.insert(spec.name, value);
        }
        Ok(())
    }

    /// Whether the flag was given on the command line.
    pub fn is_given(&self, name: &str) -> bool {
        self.given.contains_key(self.spec(name).name)
    }

    /// Whether the flag was set on the command line, in the environment or in the
    /// configuration file (not left at its default).
    pub fn is_set(&self, name: &str) -> bool {
        !matches!(self.raw(name), None | Some((_, Source::Default)))
    }

    /// One line per upstream flag that was set but has no effect here, for the startup
    /// log ("accepted for compatibility: ..."), plus the unknown flags skipped because
    /// of `--undefok`.
    pub fn compat_notes(&self) -> Vec<String> {
        let mut notes: Vec<String> = self
            .table
            .iter()
            .flat_map(|t| t.iter())
            .filter(|s| matches!(s.compat, Compat::NoEffect(..)) && self.is_set(s.name))
            .filter_map(|s| {
                let (value, _) = self.raw(s.name)?;
                let Compat::NoEffect(note, _) = s.compat else {
                    return None;
                };
                Some(format!("--{}={value} ({note})", s.name))
            })
            .collect();
        notes.sort();
        notes.extend(
            self.ignored
                .iter()
                .map(|a| format!("{a} (unknown, listed in --undefok)")),
        );
        notes
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

    /// A value converted by `convert`, its error reported as a bad value of the flag.
    pub(crate) fn typed<T>(
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
        FlagSpec::value("port", Some("50052"), "port").ours(),
        FlagSpec::boolean("enable_offload", false, "offload").env("X_OFFLOAD"),
        FlagSpec::value("global_segment_size", Some("4 GB"), "size").env("X_SIZE"),
        FlagSpec::value("ttl", Some("10000"), "ttl"),
        FlagSpec::boolean("tcp_no_delay", true, "nodelay")
            .compat(Compat::NoEffect("always on", Accepts::Only(&["true"]))),
        FlagSpec::boolean("enable_ha", false, "ha").compat(Compat::Refused("use one master")),
        FlagSpec::value("threads_hint", Some("16"), "hint")
            .compat(Compat::NoEffect("sized by the runtime", Accepts::Any)),
    ];
    static TABLE: &[&[FlagSpec]] = &[SPECS, GFLAGS];
    static PROGRAM: Program = Program {
        name: "t",
        about: "test",
        table: TABLE,
    };

    fn parse_args(args: &[&str], env: &[(&str, &str)]) -> Result<ParsedFlags, FlagError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse(&PROGRAM, args.iter().map(|s| s.to_string()), |k| {
            env.get(k).cloned()
        })
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
    fn precedence_flag_env_file_default() {
        let flags = parse_args(&[], &[]).expect("parses");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(4 << 30)));
        let mut flags = parse_args(&[], &[("X_SIZE", "1GB")]).expect("parses");
        flags
            .merge_file(vec![("global_segment_size".into(), "3GB".into())], &[])
            .expect("file");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(1 << 30)));
        let mut flags = parse_args(&[], &[]).expect("parses");
        flags
            .merge_file(vec![("global-segment-size".into(), "3GB".into())], &[])
            .expect("file");
        assert_eq!(flags.size("global_segment_size"), Ok(Some(3 << 30)));
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
        for help in [
            "--help",
            "-h",
            "--helpfull",
            "--helpshort",
            "--helpmatch=port",
        ] {
            assert!(
                matches!(parse_args(&[help], &[]), Err(FlagError::Help(_))),
                "{help}"
            );
        }
        assert!(matches!(
            parse_args(&["--version"], &[]),
            Err(FlagError::Version(_))
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

    #[test]
    fn compatibility_values() {
        let flags = parse_args(
            &["--tcp_no_delay=1", "--enable_ha=false", "--threads_hint=4"],
            &[],
        )
        .expect("compatible values are accepted");
        let notes = flags.compat_notes();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes.iter().any(|n| n.contains("--threads_hint=4")),
            "{notes:?}"
        );
        let error = parse_args(&["--tcp_no_delay=false"], &[]).expect_err("refused");
        assert!(
            error.to_string().contains("--tcp_no_delay=false")
                && error.to_string().contains("always on"),
            "{error}"
        );
        let error = parse_args(&["--enable_ha"], &[]).expect_err("refused");
        assert!(error.to_string().contains("use one master"), "{error}");
        let mut flags = parse_args(&[], &[]).expect("parses");
        assert!(
            flags
                .merge_file(vec![("enable_ha".into(), "true".into())], &[])
                .is_err()
        );
        assert!(flags.compat_notes().is_empty());
    }

    #[test]
    fn gflags_builtins() {
        let dir = std::env::temp_dir().join(format!("flags-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("flags");
        std::fs::write(&file, "# comment\n--port=7\n\n--enable_offload\n").expect("write");
        let flagfile = format!("--flagfile={}", file.display());
        let flags = parse_args(&[&flagfile, "--ttl=5"], &[]).expect("flagfile");
        assert_eq!(flags.number::<u16>("port"), Ok(Some(7)));
        assert_eq!(flags.bool("enable_offload"), Ok(true));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(
            parse_args(&["--flagfile=/nonexistent/flags"], &[]),
            Err(FlagError::FlagFile { .. })
        ));
        let flags = parse_args(
            &["--fromenv=port", "--tryfromenv=ttl"],
            &[("FLAGS_port", "9")],
        )
        .expect("fromenv");
        assert_eq!(flags.number::<u16>("port"), Ok(Some(9)));
        assert!(matches!(
            parse_args(&["--fromenv=ttl"], &[]),
            Err(FlagError::FromEnv(_))
        ));
        let flags = parse_args(&["--undefok=mystery", "--mystery=1"], &[]).expect("undefok");
        assert_eq!(flags.compat_notes().len(), 1);
        let json = match parse_args(&["--list_flags_json"], &[]) {
            Err(FlagError::List(json)) => json,
            other => panic!("{other:?}"),
        };
        let rows: serde_json::Value = serde_json::from_str(&json).expect("json");
        assert!(rows.as_array().is_some_and(|r| {
            r.iter()
                .any(|r| r["name"] == "enable_ha" && r["status"] == "refused")
        }));
    }
}
