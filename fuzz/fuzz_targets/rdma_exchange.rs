//! The RDMA connection exchange as a peer sends it: an offer (server side) and an
//! acceptance (client side), 64 bytes each. What decodes encodes back to the bytes
//! received, and an accepted segment range never wraps the address space.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_real_client::transfer::rdma::exchange::{Acceptance, LEN, Offer};

fuzz_target!(|bytes: &[u8]| {
    let mut frame = [0u8; LEN];
    let n = bytes.len().min(LEN);
    frame[..n].copy_from_slice(&bytes[..n]);
    if let Ok(offer) = Offer::decode(&frame) {
        assert_eq!(offer.encode(), frame);
    }
    if let Ok(acceptance) = Acceptance::decode(&frame) {
        assert_eq!(acceptance.encode(), frame);
        assert!(acceptance.address.checked_add(acceptance.len).is_some());
    }
});
