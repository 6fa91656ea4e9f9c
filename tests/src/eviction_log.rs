//! The eviction records of processes started with `--log_dir` and
//! `--log_level=...,mooncake::eviction=debug` (`mooncake_core::logging::EVICTION_TARGET`):
//! which object left memory or an SSD tier, and when, on the host's monotonic clock.
//! The chaos test turns them into the history's eviction events.

use std::path::Path;

/// One evicted object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictionRecord {
    /// Its key.
    pub key: String,
    /// `CLOCK_MONOTONIC` in µs, taken before it left the index.
    pub monotonic_us: u64,
}

/// Every eviction record in the log files (`*.log.INFO.*`) of `dir`, in file order.
pub fn read_dir(dir: &Path) -> Vec<EvictionRecord> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().contains(".log.INFO."))
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .flat_map(|text| text.lines().filter_map(parse_line).collect::<Vec<_>>())
        .collect()
}

/// The record in one log line, if it is one: `... DEBUG mooncake::eviction: evicted
/// from memory key="k" monotonic_us=123`.
pub fn parse_line(line: &str) -> Option<EvictionRecord> {
    let (_, fields) = line.split_once(" mooncake::eviction: ")?;
    let key = quoted(fields.split_once("key=\"")?.1)?;
    let digits: String = fields
        .split_once("monotonic_us=")?
        .1
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some(EvictionRecord {
        key,
        monotonic_us: digits.parse().ok()?,
    })
}

/// The string a Rust debug-quoted string starts with (after its opening quote), up to
/// the closing quote, with `\"` and `\\` unescaped.
fn quoted(text: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => out.push(chars.next()?),
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_line_gives_its_key_and_time() {
        let line = "2026-12-06T23:20:29.488300Z DEBUG mooncake::eviction: evicted from memory \
                    key=\"chaos/k\\\"3\" monotonic_us=123456";
        assert_eq!(
            parse_line(line),
            Some(EvictionRecord {
                key: "chaos/k\"3".into(),
                monotonic_us: 123_456
            })
        );
    }

    #[test]
    fn other_lines_are_no_records() {
        assert_eq!(
            parse_line("2026 WARN mooncake_master: key=\"k\" monotonic_us=1"),
            None
        );
        assert_eq!(parse_line("2026 DEBUG mooncake::eviction: key=\"k\""), None);
    }
}
