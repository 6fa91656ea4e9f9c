//! The optional client-side spin (`MOONCAKE_CLIENT_SPIN_US`): a call polls for its
//! answer for a short while before the rank's thread sleeps, so a quick answer is
//! picked up without the cost of waking a sleeping thread (tens of microseconds on a
//! virtual machine), at the price of a busy core while it waits.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

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

/// Runs `call` on the current (single-threaded) runtime, polling it and the runtime's
/// I/O without sleeping for up to `spin`, then waiting for it normally.
pub async fn spin_then_wait<F: Future>(call: F, spin: Duration) -> F::Output {
    let mut call = pin!(call);
    let until = Instant::now() + spin;
    loop {
        let polled = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        if let Poll::Ready(output) = polled {
            return output;
        }
        if Instant::now() >= until {
            return call.await;
        }
        // Lets the runtime poll its sockets without blocking, then polls `call` again.
        tokio::task::yield_now().await;
    }
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

    #[test]
    fn a_spinning_call_gets_an_answer_that_comes_during_or_after_the_spin() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        for (spin, delay) in [(200, 0), (200, 50), (50, 2_000), (0, 100)] {
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(delay));
                let _ = tx.send(delay);
            });
            let got = runtime.block_on(spin_then_wait(rx, Duration::from_micros(spin)));
            assert_eq!(got.ok(), Some(delay));
        }
    }

    #[test]
    fn socket_answers_are_seen_while_spinning() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut ours, theirs) = tokio::net::UnixStream::pair().expect("pair");
            let mut theirs = theirs.into_std().expect("std");
            theirs.set_nonblocking(false).expect("blocking");
            let peer = std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut byte = [0u8; 1];
                theirs.read_exact(&mut byte).expect("read");
                theirs.write_all(&[byte[0] + 1]).expect("write");
            });
            ours.write_all(&[41]).await.expect("write");
            let mut answer = [0u8; 1];
            let read = spin_then_wait(ours.read_exact(&mut answer), Duration::from_millis(1)).await;
            assert!(read.is_ok());
            assert_eq!(answer[0], 42);
            peer.join().expect("peer");
        });
    }
}
