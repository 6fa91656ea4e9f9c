//! Human-friendly sizes (`"4 GB"`, `"4GiB"`, `"512MB"`, `"1024"`) and durations (`500`,
//! `"500ms"`, `"10s"`), as accepted by every flag, variable and config file.
//!
//! Decimal and binary prefixes are both accepted; like upstream, `KB`/`MB`/`GB`/`TB` mean
//! powers of 1024 (an operator writing "4 GB" for a segment means 4 GiB), while the
//! explicit binary forms `KiB`/`MiB`/`GiB`/`TiB` mean the same. A bare number is bytes
//! (sizes) or seconds (durations, as upstream's `*_sec` flags). Anything else is an error
//! naming the value, never a silent zero.

use std::time::Duration;

/// Why a size or duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// The text is not a number followed by a known unit.
    #[error(
        "cannot parse {text:?} as a size: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. \"4 GB\""
    )]
    BadSize {
        /// The rejected text.
        text: String,
    },
    /// The value does not fit in 64 bits.
    #[error("size {text:?} is too large (limit is 2^64-1 bytes)")]
    SizeOverflow {
        /// The rejected text.
        text: String,
    },
    /// The text is not a number followed by a known time unit.
    #[error(
        "cannot parse {text:?} as a duration: expected a number with an optional unit (ms, s, m, h; plain numbers are seconds), e.g. \"10s\""
    )]
    BadDuration {
        /// The rejected text.
        text: String,
    },
}

fn split_number(text: &str) -> Option<(f64, &str)> {
    let trimmed = text.trim();
    let end = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(end);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    Some((value, unit.trim()))
}

/// Parses a byte size such as `"4 GB"`, `"4GiB"`, `"512MB"` or `"1024"`.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::BadSize {
        text: text.to_string(),
    };
    let (value, unit) = split_number(text).ok_or_else(bad)?;
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    #[expect(
        clippy::cast_precision_loss,
        reason = "multipliers are exact powers of two"
    )]
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= 18_446_744_073_709_551_615.0 {
        return Err(UnitError::SizeOverflow {
            text: text.to_string(),
        });
    }
    if bytes.fract() != 0.0 {
        return Err(bad());
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "checked above: finite, non-negative, integral and below 2^64"
    )]
    Ok(bytes as u64)
}

/// Parses a duration such as `500` (seconds), `"500ms"`, `"10s"`, `"2m"` or `"1h"`.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let bad = || UnitError::BadDuration {
        text: text.to_string(),
    };
    let (value, unit) = split_number(text).ok_or_else(bad)?;
    let seconds = match unit.to_ascii_lowercase().as_str() {
        "" | "s" | "sec" | "secs" => value,
        "ms" => value / 1000.0,
        "us" => value / 1_000_000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

/// Formats a byte count for people: `4.00 GiB`, `512.00 MiB`, `100 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    #[expect(clippy::cast_precision_loss, reason = "display only")]
    let mut value = bytes as f64;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4 GB"), Ok(4 << 30));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size(" 16 kib "), Ok(16 << 10));
        assert_eq!(parse_size("1.5 GB"), Ok(3 << 29));
        for bad in ["", "GB", "4 XB", "-1", "4..0GB", "abc", "1e3", ".5GB"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(matches!(
            parse_size("99999999999 TB"),
            Err(UnitError::SizeOverflow { .. })
        ));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500"), Ok(Duration::from_secs(500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        for bad in ["", "ms", "10 parsecs", "-5s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn formatting() {
        assert_eq!(format_size(100), "100 B");
        assert_eq!(format_size(4 << 30), "4.00 GiB");
    }

    proptest::proptest! {
        #[test]
        fn plain_numbers_are_bytes(n in 0u64..(1u64 << 52)) {
            proptest::prop_assert_eq!(parse_size(&n.to_string()), Ok(n));
        }

        #[test]
        fn never_panics(text in ".{0,24}") {
            let _ = parse_size(&text);
            let _ = parse_duration(&text);
        }
    }
}
