//! Frame layout of the transfer protocol (see the module above).

use std::io::Read;

use mooncake_core::error::ErrorCode;
use mooncake_core::protocol::grant::{Access, GRANT_MAC_LEN, Grant, GrantedRange};

/// First bytes of every request (the second version: requests carry grants).
pub const MAGIC: [u8; 4] = *b"MCT2";
/// Bytes of a request header.
pub const REQUEST_LEN: usize = 72;

/// Flag: the request carries a grant.
const HAS_GRANT: u8 = 1;
/// Flag: the grant allows writing.
const GRANT_WRITES: u8 = 2;
/// Largest single transfer accepted (1 TiB).
pub const MAX_TRANSFER: u64 = 1 << 40;

/// Direction of a transfer, seen from the requester.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Segment bytes to the requester.
    Read = 1,
    /// Requester bytes into the segment.
    Write = 2,
    /// An object from the peer's SSD tier: the request's `len` bytes that follow the
    /// header are the (master's) key; the response's length is the value's, and the
    /// value follows it.
    ReadDisk = 3,
    /// Connects an RDMA queue pair: the request's `len` bytes that follow the header
    /// are the requester's side ([`CONNECT_LEN`] bytes, `rdma::exchange`); the answer
    /// carries ours. The connection then only holds the pair (closing it destroys
    /// the pair) and carries [`Op::RdmaKeepalive`]s.
    RdmaConnect = 4,
    /// Keeps a connection that holds an RDMA queue pair from timing out (no answer).
    RdmaKeepalive = 5,
}

/// Bytes of each side of an RDMA connection exchange.
pub const CONNECT_LEN: u64 = 64;

/// Longest key a [`Op::ReadDisk`] request may carry.
pub const MAX_DISK_KEY: u64 = 1 << 20;

/// One request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Direction.
    pub op: Op,
    /// Target segment id.
    pub segment: u64,
    /// Offset inside it.
    pub offset: u64,
    /// Bytes to move.
    pub len: u64,
    /// The master's grant for the replica this request reaches into (for
    /// [`Op::ReadDisk`], the grant's range is empty: it names the key).
    pub grant: Option<GrantedRange>,
}

/// Why a frame was rejected.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed.
    #[error("transfer connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// Bytes that are not a transfer frame.
    #[error("malformed transfer frame: {0}")]
    Malformed(&'static str),
}

impl Request {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut frame = [0u8; REQUEST_LEN];
        frame[..4].copy_from_slice(&MAGIC);
        frame[4] = self.op as u8;
        frame[8..16].copy_from_slice(&self.segment.to_le_bytes());
        frame[16..24].copy_from_slice(&self.offset.to_le_bytes());
        frame[24..32].copy_from_slice(&self.len.to_le_bytes());
        if let Some(granted) = &self.grant {
            frame[5] = HAS_GRANT
                | match granted.grant.access {
                    Access::Read => 0,
                    Access::Write => GRANT_WRITES,
                };
            frame[32..40].copy_from_slice(&granted.offset.to_le_bytes());
            frame[40..48].copy_from_slice(&granted.len.to_le_bytes());
            frame[48..56].copy_from_slice(&granted.grant.expires.to_le_bytes());
            frame[56..72].copy_from_slice(&granted.grant.mac);
        }
        frame
    }

    /// Decodes and checks a header.
    pub fn decode(frame: &[u8; REQUEST_LEN]) -> Result<Self, WireError> {
        if frame[..4] != MAGIC {
            return Err(WireError::Malformed("bad magic"));
        }
        let op = match frame[4] {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::ReadDisk,
            4 => Op::RdmaConnect,
            5 => Op::RdmaKeepalive,
            _ => return Err(WireError::Malformed("unknown operation")),
        };
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&frame[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let grant = match frame[5] {
            0 if frame[32..].iter().all(|b| *b == 0) => None,
            0 => return Err(WireError::Malformed("grant fields without a grant")),
            flags if flags & !(HAS_GRANT | GRANT_WRITES) == 0 && flags & HAS_GRANT != 0 => {
                let mut mac = [0u8; GRANT_MAC_LEN];
                mac.copy_from_slice(&frame[56..72]);
                Some(GrantedRange {
                    offset: word(32),
                    len: word(40),
                    grant: Grant {
                        access: if flags & GRANT_WRITES == 0 {
                            Access::Read
                        } else {
                            Access::Write
                        },
                        expires: word(48),
                        mac,
                    },
                })
            }
            _ => return Err(WireError::Malformed("unknown flags")),
        };
        let request = Request {
            op,
            segment: word(8),
            offset: word(16),
            len: word(24),
            grant,
        };
        if request.len > MAX_TRANSFER {
            return Err(WireError::Malformed("transfer larger than 1 TiB"));
        }
        if request.op == Op::ReadDisk && (request.len == 0 || request.len > MAX_DISK_KEY) {
            return Err(WireError::Malformed(
                "disk read key of 0 or more than 1 MiB",
            ));
        }
        if request.op == Op::RdmaConnect && request.len != CONNECT_LEN {
            return Err(WireError::Malformed(
                "RDMA connection exchange of the wrong size",
            ));
        }
        if request.op == Op::RdmaKeepalive && request.len != 0 {
            return Err(WireError::Malformed("keepalive with a payload"));
        }
        Ok(request)
    }

    /// True when the request's length is valid for its operation.
    pub fn len_fits(op: Op, len: u64) -> bool {
        len <= MAX_TRANSFER
            && match op {
                Op::ReadDisk => (1..=MAX_DISK_KEY).contains(&len),
                Op::RdmaConnect => len == CONNECT_LEN,
                Op::RdmaKeepalive => len == 0,
                Op::Read | Op::Write => true,
            }
    }

    /// Reads one header.
    pub fn read_from(stream: &mut impl Read) -> Result<Self, WireError> {
        let mut frame = [0u8; REQUEST_LEN];
        stream.read_exact(&mut frame)?;
        Self::decode(&frame)
    }
}

/// Encodes a response header.
pub fn encode_response(status: Result<u64, ErrorCode>) -> [u8; 16] {
    let mut frame = [0u8; 16];
    let (code, len) = match status {
        Ok(len) => (0i32, len),
        Err(code) => (code.as_i32(), 0),
    };
    frame[..4].copy_from_slice(&code.to_le_bytes());
    frame[8..16].copy_from_slice(&len.to_le_bytes());
    frame
}

/// Reads a response header: the length on success, the peer's error code otherwise.
pub fn read_response(stream: &mut impl Read) -> Result<Result<u64, ErrorCode>, WireError> {
    let mut frame = [0u8; 16];
    stream.read_exact(&mut frame)?;
    let mut code = [0u8; 4];
    code.copy_from_slice(&frame[..4]);
    let code = i32::from_le_bytes(code);
    let mut len = [0u8; 8];
    len.copy_from_slice(&frame[8..16]);
    if code == 0 {
        Ok(Ok(u64::from_le_bytes(len)))
    } else {
        Ok(Err(
            ErrorCode::from_i32(code).unwrap_or(ErrorCode::TRANSFER_FAIL)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip_and_rejections() {
        let request = Request {
            op: Op::Write,
            segment: 3,
            offset: 4096,
            len: 1 << 20,
            grant: Some(GrantedRange {
                offset: 0,
                len: 2 << 20,
                grant: Grant {
                    access: Access::Write,
                    expires: 77,
                    mac: [9; GRANT_MAC_LEN],
                },
            }),
        };
        assert_eq!(Request::decode(&request.encode()).expect("valid"), request);
        let ungranted = Request {
            grant: None,
            ..request
        };
        assert_eq!(
            Request::decode(&ungranted.encode()).expect("valid"),
            ungranted
        );
        let mut bad = ungranted.encode();
        bad[60] = 1;
        assert!(
            Request::decode(&bad).is_err(),
            "grant bytes without the flag"
        );
        let mut bad = request.encode();
        bad[5] |= 4;
        assert!(Request::decode(&bad).is_err(), "unknown flag");
        let mut bad = request.encode();
        bad[0] = b'X';
        assert!(Request::decode(&bad).is_err());
        let mut bad = request.encode();
        bad[4] = 9;
        assert!(Request::decode(&bad).is_err());
        let huge = Request {
            len: u64::MAX,
            ..request
        };
        assert!(Request::decode(&huge.encode()).is_err());
    }

    #[test]
    fn responses() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&encode_response(Err(ErrorCode::INVALID_PARAMS)));
        buf.extend_from_slice(&encode_response(Ok(7)));
        let mut reader = &buf[..];
        assert_eq!(
            read_response(&mut reader).expect("read"),
            Err(ErrorCode::INVALID_PARAMS)
        );
        assert_eq!(read_response(&mut reader).expect("read"), Ok(7));
    }

    mod foreign_bytes {
        //! Headers come from peers: no 32 or 16 bytes may panic their decoder, and what
        //! decodes is what was sent.

        use proptest::prelude::*;

        use super::*;

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                Just(Op::Read),
                Just(Op::Write),
                Just(Op::ReadDisk),
                Just(Op::RdmaConnect),
                Just(Op::RdmaKeepalive)
            ]
        }

        fn frame() -> impl Strategy<Value = [u8; REQUEST_LEN]> {
            proptest::collection::vec(any::<u8>(), REQUEST_LEN).prop_map(|bytes| {
                let mut frame = [0u8; REQUEST_LEN];
                frame.copy_from_slice(&bytes);
                frame
            })
        }

        fn granted() -> impl Strategy<Value = GrantedRange> {
            (
                any::<u64>(),
                any::<u64>(),
                any::<bool>(),
                any::<u64>(),
                any::<[u8; GRANT_MAC_LEN]>(),
            )
                .prop_map(|(offset, len, writes, expires, mac)| GrantedRange {
                    offset,
                    len,
                    grant: Grant {
                        access: if writes { Access::Write } else { Access::Read },
                        expires,
                        mac,
                    },
                })
        }

        /// A length anywhere, with the bounds of the decoder likely.
        fn len() -> impl Strategy<Value = u64> {
            prop_oneof![
                any::<u64>(),
                0..=MAX_DISK_KEY + 1,
                Just(CONNECT_LEN),
                MAX_TRANSFER - 1..=MAX_TRANSFER + 1,
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1000))]

            #[test]
            fn no_input_panics_the_transfer_request_decoder(
                mut frame in frame(),
                magic in any::<bool>(),
                op in 0..7u8,
            ) {
                // Half the frames get past the magic, and most then name an operation.
                if magic {
                    frame[..4].copy_from_slice(&MAGIC);
                    frame[4] = op;
                }
                if let Ok(request) = Request::decode(&frame) {
                    prop_assert!(Request::len_fits(request.op, request.len));
                    // The two bytes after the flags are padding, not read.
                    let mut sent = frame;
                    sent[6..8].fill(0);
                    prop_assert_eq!(request.encode(), sent);
                }
            }

            #[test]
            fn transfer_requests_within_bounds_round_trip(
                op in op(),
                segment in any::<u64>(),
                offset in any::<u64>(),
                len in len(),
                grant in proptest::option::of(granted()),
            ) {
                let request = Request { op, segment, offset, len, grant };
                let valid = Request::len_fits(op, len);
                let decoded = Request::decode(&request.encode());
                prop_assert_eq!(decoded.as_ref().ok(), valid.then_some(&request));
                let mut stream = &request.encode()[..];
                prop_assert_eq!(Request::read_from(&mut stream).ok(), valid.then_some(request));
            }

            #[test]
            fn no_input_panics_the_transfer_response_decoder(
                bytes in proptest::collection::vec(any::<u8>(), 0..40),
            ) {
                let mut stream = &bytes[..];
                match read_response(&mut stream) {
                    Err(WireError::Io(_)) => prop_assert!(bytes.len() < 16),
                    Err(WireError::Malformed(_)) => prop_assert!(false, "responses have no checks"),
                    Ok(status) => {
                        prop_assert!(bytes.len() >= 16);
                        prop_assert_eq!(stream.len(), bytes.len() - 16, "one header consumed");
                        if let Ok(len) = status {
                            prop_assert_eq!(&bytes[8..16], &len.to_le_bytes()[..]);
                        }
                    }
                }
            }

            #[test]
            fn transfer_responses_round_trip(
                len in any::<u64>(),
                code in proptest::sample::select(ErrorCode::ALL),
            ) {
                let mut stream = &encode_response(Ok(len))[..];
                prop_assert_eq!(read_response(&mut stream).ok(), Some(Ok(len)));
                let expected = if code == ErrorCode::OK { Ok(0) } else { Err(code) };
                let mut stream = &encode_response(Err(code))[..];
                prop_assert_eq!(read_response(&mut stream).ok(), Some(expected));
            }
        }
    }
}
