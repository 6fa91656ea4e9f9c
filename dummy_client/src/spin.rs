//! The optional client-side spin (`MOONCAKE_CLIENT_SPIN_US`): a call polls for its
//! answer for a short while before the rank's thread sleeps, so a quick answer is
//! picked up without the cost of waking a sleeping thread (tens of microseconds on a
//! virtual machine), at the price of a busy core while it waits.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

pub use mooncake_core::spin::{SpinError, spin_from_env};

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
