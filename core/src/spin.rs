//! The optional caller-side spin (`MOONCAKE_CLIENT_SPIN_US`): a call polls for its
//! answer for a short while before its thread sleeps, so a quick answer is picked up
//! without the cost of waking a sleeping thread (tens of microseconds on a virtual
//! machine), at the price of a busy core while it waits. A dummy spins on its calls to
//! the real client; an embedded real client on its calls to a remote master.

use std::time::Duration;

/// Environment variable: microseconds a call spins before it blocks (0 or unset: off).
pub const SPIN_ENV: &str = "MOONCAKE_CLIENT_SPIN_US";

/// The longest spin accepted: past a millisecond the answer is slow anyway and a core
/// would be burnt for nothing.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

/// A value of `MOONCAKE_CLIENT_SPIN_US` that is not a number of microseconds within
/// [`MAX_SPIN`].
#[derive(Debug, thiserror::Error)]
#[error(
    "{SPIN_ENV}={value:?} is not valid: give whole microseconds from 0 (off) to {max}, for example 50",
    max = MAX_SPIN.as_micros()
)]
pub struct SpinError {
    /// The value as found.
    pub value: String,
}

/// The spin `value` asks for (`None`: unset or empty, which is off).
pub fn parse_spin(value: Option<&str>) -> Result<Duration, SpinError> {
    let Some(text) = value.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(Duration::ZERO);
    };
    let invalid = || SpinError {
        value: text.to_string(),
    };
    let micros: u64 = text.parse().map_err(|_| invalid())?;
    let spin = Duration::from_micros(micros);
    if spin > MAX_SPIN {
        return Err(invalid());
    }
    Ok(spin)
}

/// The spin this process is configured with ([`SPIN_ENV`]).
pub fn spin_from_env() -> Result<Duration, SpinError> {
    parse_spin(std::env::var(SPIN_ENV).ok().as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_values_are_checked() {
        assert_eq!(parse_spin(None).ok(), Some(Duration::ZERO));
        assert_eq!(parse_spin(Some(" ")).ok(), Some(Duration::ZERO));
        assert_eq!(parse_spin(Some("0")).ok(), Some(Duration::ZERO));
        assert_eq!(
            parse_spin(Some(" 50 ")).ok(),
            Some(Duration::from_micros(50))
        );
        assert_eq!(parse_spin(Some("1000")).ok(), Some(MAX_SPIN));
        for bad in ["1001", "-5", "50us", "1.5", "99999999999999999999999"] {
            let error = parse_spin(Some(bad)).expect_err(bad).to_string();
            assert!(error.contains(SPIN_ENV) && error.contains(bad), "{error}");
        }
    }
}
