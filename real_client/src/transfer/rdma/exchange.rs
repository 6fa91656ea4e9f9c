//! What two real clients exchange to connect an RDMA queue pair, over their
//! (authenticated) TCP transfer connection: [`Offer`] from the requester,
//! [`Acceptance`] from the peer whose segment it will read and write.
//!
//! ```text
//! offer      := "MCRO" | device u32 LE | endpoint (28) | 0 x28           (64 bytes)
//! acceptance := "MCRA" | endpoint (28) | rkey u32 LE | segment id u64 LE
//!               | segment address u64 LE | segment length u64 LE          (64 bytes)
//! endpoint   := qp_num u32 | psn u32 | lid u16 | gid index u8 | mtu u8 | gid (16)
//! ```

use mooncake_rdma::{Endpoint, PortAddress};

use crate::transfer::wire::CONNECT_LEN;

/// Bytes of an offer or an acceptance.
pub const LEN: usize = 64;
const _: () = assert!(LEN as u64 == CONNECT_LEN);
const OFFER_MAGIC: [u8; 4] = *b"MCRO";
const ACCEPTANCE_MAGIC: [u8; 4] = *b"MCRA";
/// Bytes of an encoded endpoint.
const ENDPOINT_LEN: usize = 28;

/// The requester's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// Which of the peer's devices to use (taken modulo their number), so that the
    /// requester's devices spread over the peer's.
    pub device: u32,
    /// The requester's queue pair.
    pub endpoint: Endpoint,
}

/// The peer's side: its queue pair and where its segment is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acceptance {
    /// The peer's queue pair.
    pub endpoint: Endpoint,
    /// The key of the peer's segment.
    pub rkey: u32,
    /// The segment's id at the master now.
    pub segment: u64,
    /// The segment's address in the peer.
    pub address: u64,
    /// The segment's length.
    pub len: u64,
}

/// Bytes that are not an offer or an acceptance.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed RDMA connection exchange: {0}")]
pub struct Malformed(&'static str);

fn encode_endpoint(endpoint: &Endpoint, out: &mut [u8]) {
    out[0..4].copy_from_slice(&endpoint.qp_num.to_le_bytes());
    out[4..8].copy_from_slice(&endpoint.psn.to_le_bytes());
    out[8..10].copy_from_slice(&endpoint.port.lid.to_le_bytes());
    out[10] = endpoint.port.gid_index;
    out[11] = endpoint.port.mtu;
    out[12..28].copy_from_slice(&endpoint.port.gid);
}

fn decode_endpoint(bytes: &[u8]) -> Result<Endpoint, Malformed> {
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let mtu = bytes[11];
    if !(1..=5).contains(&mtu) {
        return Err(Malformed("MTU outside 256..4096 bytes"));
    }
    let psn = word(4);
    if psn > 0x00ff_ffff {
        return Err(Malformed("packet sequence number over 24 bits"));
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&bytes[12..28]);
    Ok(Endpoint {
        qp_num: word(0),
        psn,
        port: PortAddress {
            lid: u16::from_le_bytes([bytes[8], bytes[9]]),
            gid,
            gid_index: bytes[10],
            mtu,
        },
    })
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

impl Offer {
    /// Encodes the offer.
    pub fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[..4].copy_from_slice(&OFFER_MAGIC);
        out[4..8].copy_from_slice(&self.device.to_le_bytes());
        encode_endpoint(&self.endpoint, &mut out[8..8 + ENDPOINT_LEN]);
        out
    }

    /// Decodes and checks an offer.
    pub fn decode(bytes: &[u8; LEN]) -> Result<Offer, Malformed> {
        if bytes[..4] != OFFER_MAGIC {
            return Err(Malformed("not an offer"));
        }
        if bytes[8 + ENDPOINT_LEN..].iter().any(|b| *b != 0) {
            return Err(Malformed("padding not zero"));
        }
        Ok(Offer {
            device: u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
            endpoint: decode_endpoint(&bytes[8..8 + ENDPOINT_LEN])?,
        })
    }
}

impl Acceptance {
    /// Encodes the acceptance.
    pub fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[..4].copy_from_slice(&ACCEPTANCE_MAGIC);
        encode_endpoint(&self.endpoint, &mut out[4..4 + ENDPOINT_LEN]);
        out[32..36].copy_from_slice(&self.rkey.to_le_bytes());
        out[36..44].copy_from_slice(&self.segment.to_le_bytes());
        out[44..52].copy_from_slice(&self.address.to_le_bytes());
        out[52..60].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes and checks an acceptance.
    pub fn decode(bytes: &[u8; LEN]) -> Result<Acceptance, Malformed> {
        if bytes[..4] != ACCEPTANCE_MAGIC {
            return Err(Malformed("not an acceptance"));
        }
        if bytes[60..].iter().any(|b| *b != 0) {
            return Err(Malformed("padding not zero"));
        }
        let acceptance = Acceptance {
            endpoint: decode_endpoint(&bytes[4..4 + ENDPOINT_LEN])?,
            rkey: u32::from_le_bytes([bytes[32], bytes[33], bytes[34], bytes[35]]),
            segment: u64_at(bytes, 36),
            address: u64_at(bytes, 44),
            len: u64_at(bytes, 52),
        };
        if acceptance.address.checked_add(acceptance.len).is_none() {
            return Err(Malformed("segment range past the end of the address space"));
        }
        Ok(acceptance)
    }
}

#[cfg(test)]
mod tests {
    //! Exchanges come from peers: no 64 bytes may panic their decoders, and what
    //! decodes is what was sent.

    use proptest::prelude::*;

    use super::*;

    fn endpoint() -> impl Strategy<Value = Endpoint> {
        (
            any::<u32>(),
            0..=0x00ff_ffffu32,
            any::<u16>(),
            any::<u8>(),
            1..=5u8,
            any::<[u8; 16]>(),
        )
            .prop_map(|(qp_num, psn, lid, gid_index, mtu, gid)| Endpoint {
                qp_num,
                psn,
                port: PortAddress {
                    lid,
                    gid,
                    gid_index,
                    mtu,
                },
            })
    }

    fn bytes() -> impl Strategy<Value = [u8; LEN]> {
        proptest::collection::vec(any::<u8>(), LEN).prop_map(|v| {
            let mut out = [0u8; LEN];
            out.copy_from_slice(&v);
            out
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn offers_round_trip(device in any::<u32>(), endpoint in endpoint()) {
            let offer = Offer { device, endpoint };
            prop_assert_eq!(Offer::decode(&offer.encode()), Ok(offer));
        }

        #[test]
        fn acceptances_round_trip(
            endpoint in endpoint(),
            rkey in any::<u32>(),
            segment in any::<u64>(),
            address in 0..u64::MAX / 2,
            len in 0..u64::MAX / 2,
        ) {
            let acceptance = Acceptance { endpoint, rkey, segment, address, len };
            prop_assert_eq!(Acceptance::decode(&acceptance.encode()), Ok(acceptance));
        }

        #[test]
        fn no_bytes_panic_the_decoders(mut bytes in bytes(), offer in any::<bool>()) {
            // Half get past the magic.
            bytes[..4].copy_from_slice(if offer { &OFFER_MAGIC } else { &ACCEPTANCE_MAGIC });
            if let Ok(decoded) = Offer::decode(&bytes) {
                prop_assert_eq!(decoded.encode(), bytes);
            }
            if let Ok(decoded) = Acceptance::decode(&bytes) {
                prop_assert_eq!(decoded.encode(), bytes);
            }
        }
    }

    #[test]
    fn refusals_say_why() {
        let mut bytes = [0u8; LEN];
        assert_eq!(Offer::decode(&bytes), Err(Malformed("not an offer")));
        bytes[..4].copy_from_slice(&OFFER_MAGIC);
        assert_eq!(
            Offer::decode(&bytes),
            Err(Malformed("MTU outside 256..4096 bytes"))
        );
    }
}
