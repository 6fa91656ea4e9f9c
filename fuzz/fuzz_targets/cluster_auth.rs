//! The cluster-authentication exchange, each message as its reader gets it from the
//! peer: a hello (server side), a challenge (client side), a proof (server side) and a
//! verdict (client side). None may panic, and no forged challenge or proof is accepted.
//!
//! Input: a channel byte, then the hello, the challenge, the proof and the verdict
//! (zeros where the input ends early).

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::protocol::auth::{
    CHALLENGE_LEN, Channel, ClientExchange, ClusterSecret, HELLO_LEN, PROOF_LEN, ServerExchange,
    read_verdict,
};

/// The next `N` bytes of `input`, zero-padded.
fn take<const N: usize>(input: &mut &[u8]) -> [u8; N] {
    let mut field = [0u8; N];
    let n = input.len().min(N);
    field[..n].copy_from_slice(&input[..n]);
    *input = &input[n..];
    field
}

fuzz_target!(|bytes: &[u8]| {
    let secret = ClusterSecret::from_bytes(b"the secret of the fuzzed cluster", "fuzz");
    let mut input = bytes;
    let channel = if take::<1>(&mut input)[0] & 1 == 0 {
        Channel::Master
    } else {
        Channel::Transfer
    };
    let hello = take::<HELLO_LEN>(&mut input);
    let challenge = take::<CHALLENGE_LEN>(&mut input);
    let proof = take::<PROOF_LEN>(&mut input);
    let verdict = take::<1>(&mut input)[0];

    if let Ok((server, _)) = ServerExchange::challenge(&secret, channel, &hello) {
        assert!(server.check(&secret, &proof).is_err(), "a forged proof");
    }
    let (client, _) = ClientExchange::start(channel).expect("a random nonce");
    assert!(
        client.answer(&secret, &challenge).is_err(),
        "a forged challenge"
    );
    assert_eq!(read_verdict(verdict).is_ok(), verdict == 0);
});
