//! Transfer grants: the master's signed permission to move the bytes of one replica.
//!
//! With a cluster secret, every replica the master hands out carries a [`Grant`]: a MAC,
//! under the secret, of what may be done (read or write), where (a range of a segment,
//! or a key on a node's SSD tier) and until when. A transfer engine that authenticates
//! its peers serves a request only with a grant that covers it, so a cluster member can
//! reach the bytes of the objects the master gave it, not any byte of another node's
//! memory. Without a secret nothing is signed and nothing is checked (as upstream).
//!
//! Expiry is wall-clock time in seconds since the Unix epoch, as the master sees it;
//! servers accept [`CLOCK_SKEW`] of difference between the clocks.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::auth::ClusterSecret;

/// Bytes of a grant's MAC (a truncated HMAC-SHA256).
pub const GRANT_MAC_LEN: usize = 16;

/// Difference between the master's clock and a node's that grants tolerate.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// What a grant allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Access {
    /// Reading the bytes.
    Read,
    /// Writing them (a write in progress).
    Write,
}

/// The master's permission for transfers of one replica's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// What it allows.
    pub access: Access,
    /// Seconds since the Unix epoch after which it is refused.
    pub expires: u64,
    /// MAC of the above and of the replica's place, under the cluster secret.
    pub mac: [u8; GRANT_MAC_LEN],
}

/// What a grant covers besides its access and expiry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope<'a> {
    /// `len` bytes at `offset` of segment `segment`.
    Memory {
        /// Segment id.
        segment: u64,
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// The object stored under `key` on the SSD tier of the node whose segment is named
    /// `segment_name`.
    Disk {
        /// The node's segment name.
        segment_name: &'a str,
        /// The (master's) key.
        key: &'a str,
    },
}

/// Why a grant was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The request carried none.
    #[error("the request carries no grant from the master")]
    Missing,
    /// Its MAC does not match what it claims (another secret, or forged).
    #[error("the grant was not signed for this replica with the cluster secret")]
    Forged,
    /// It expired.
    #[error("the grant expired")]
    Expired,
    /// It allows reading, not writing.
    #[error("the grant allows reading only")]
    ReadOnly,
    /// The request reaches past the granted range.
    #[error("the request reaches outside the granted range")]
    OutOfRange,
}

/// Seconds since the Unix epoch now.
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// The bytes a grant's MAC covers.
fn message_parts<'a>(
    access: Access,
    expires: &'a [u8; 8],
    scope: &Scope<'a>,
    words: &'a mut [u8; 24],
) -> Vec<&'a [u8]> {
    let access: &'static [u8] = match access {
        Access::Read => b"r",
        Access::Write => b"w",
    };
    match *scope {
        Scope::Memory {
            segment,
            offset,
            len,
        } => {
            words[..8].copy_from_slice(&segment.to_le_bytes());
            words[8..16].copy_from_slice(&offset.to_le_bytes());
            words[16..].copy_from_slice(&len.to_le_bytes());
            let words: &'a [u8; 24] = words;
            vec![
                &b"mooncake-grant-v1 memory "[..],
                access,
                &expires[..],
                &words[..],
            ]
        }
        Scope::Disk { segment_name, key } => {
            words[..8].copy_from_slice(&(segment_name.len() as u64).to_le_bytes());
            let words: &'a [u8; 24] = words;
            vec![
                &b"mooncake-grant-v1 disk "[..],
                access,
                &expires[..],
                &words[..8],
                segment_name.as_bytes(),
                key.as_bytes(),
            ]
        }
    }
}

impl ClusterSecret {
    /// A grant of `access` to `scope` until `expires` (seconds since the Unix epoch).
    pub fn grant(&self, access: Access, scope: &Scope<'_>, expires: u64) -> Grant {
        let expiry = expires.to_le_bytes();
        let mut words = [0u8; 24];
        let tag = self.mac(&message_parts(access, &expiry, scope, &mut words));
        let mut mac = [0u8; GRANT_MAC_LEN];
        mac.copy_from_slice(&tag.as_ref()[..GRANT_MAC_LEN]);
        Grant {
            access,
            expires,
            mac,
        }
    }

    /// Checks that `grant` was signed for `scope` with this secret, has not expired at
    /// `now` (seconds, with [`CLOCK_SKEW`]) and allows `wanted`.
    pub fn check_grant(
        &self,
        grant: &Grant,
        scope: &Scope<'_>,
        wanted: Access,
        now: u64,
    ) -> Result<(), GrantError> {
        let expected = self.grant(grant.access, scope, grant.expires);
        // Both MACs are of our own making from here on; compare without early exit.
        let differs = expected
            .mac
            .iter()
            .zip(&grant.mac)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if differs != 0 {
            return Err(GrantError::Forged);
        }
        if grant.expires.saturating_add(CLOCK_SKEW.as_secs()) < now {
            return Err(GrantError::Expired);
        }
        if wanted == Access::Write && grant.access == Access::Read {
            return Err(GrantError::ReadOnly);
        }
        Ok(())
    }
}

/// A grant for `len` bytes at `offset` of a segment, as a transfer request carries it:
/// the granted range may be larger than the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantedRange {
    /// First byte of the granted range.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The grant.
    pub grant: Grant,
}

impl GrantedRange {
    /// Checks a request for `len` bytes at `offset` of `segment` against this grant.
    pub fn check(
        &self,
        secret: &ClusterSecret,
        segment: u64,
        offset: u64,
        len: u64,
        wanted: Access,
    ) -> Result<(), GrantError> {
        let scope = Scope::Memory {
            segment,
            offset: self.offset,
            len: self.len,
        };
        secret.check_grant(&self.grant, &scope, wanted, now_secs())?;
        let end = offset.checked_add(len).ok_or(GrantError::OutOfRange)?;
        let granted_end = self
            .offset
            .checked_add(self.len)
            .ok_or(GrantError::OutOfRange)?;
        if offset < self.offset || end > granted_end {
            return Err(GrantError::OutOfRange);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(byte: u8) -> ClusterSecret {
        ClusterSecret::from_bytes(&[byte; 32], "test")
    }

    const RANGE: Scope<'static> = Scope::Memory {
        segment: 3,
        offset: 4096,
        len: 8192,
    };

    #[test]
    fn a_grant_covers_what_it_was_signed_for_and_nothing_else() {
        let key = secret(1);
        let now = now_secs();
        let grant = key.grant(Access::Read, &RANGE, now + 10);
        assert_eq!(key.check_grant(&grant, &RANGE, Access::Read, now), Ok(()));
        assert_eq!(
            key.check_grant(&grant, &RANGE, Access::Write, now),
            Err(GrantError::ReadOnly)
        );
        let other_range = Scope::Memory {
            segment: 3,
            offset: 0,
            len: 8192,
        };
        assert_eq!(
            key.check_grant(&grant, &other_range, Access::Read, now),
            Err(GrantError::Forged)
        );
        assert_eq!(
            secret(2).check_grant(&grant, &RANGE, Access::Read, now),
            Err(GrantError::Forged)
        );
        let mut widened = grant;
        widened.access = Access::Write;
        assert_eq!(
            key.check_grant(&widened, &RANGE, Access::Write, now),
            Err(GrantError::Forged)
        );
        let mut extended = grant;
        extended.expires += 3600;
        assert_eq!(
            key.check_grant(&extended, &RANGE, Access::Read, now),
            Err(GrantError::Forged)
        );
    }

    #[test]
    fn grants_expire_after_the_clock_skew() {
        let key = secret(1);
        let grant = key.grant(Access::Write, &RANGE, 1000);
        let skew = CLOCK_SKEW.as_secs();
        assert_eq!(
            key.check_grant(&grant, &RANGE, Access::Write, 1000 + skew),
            Ok(())
        );
        assert_eq!(
            key.check_grant(&grant, &RANGE, Access::Write, 1001 + skew),
            Err(GrantError::Expired)
        );
    }

    #[test]
    fn a_request_must_lie_inside_the_granted_range() {
        let key = secret(1);
        let granted = GrantedRange {
            offset: 4096,
            len: 8192,
            grant: key.grant(Access::Write, &RANGE, now_secs() + 10),
        };
        assert_eq!(granted.check(&key, 3, 4096, 8192, Access::Write), Ok(()));
        assert_eq!(granted.check(&key, 3, 8192, 4096, Access::Read), Ok(()));
        assert_eq!(
            granted.check(&key, 3, 0, 4096, Access::Read),
            Err(GrantError::OutOfRange)
        );
        assert_eq!(
            granted.check(&key, 3, 8192, 8192, Access::Read),
            Err(GrantError::OutOfRange)
        );
        assert_eq!(
            granted.check(&key, 3, u64::MAX, 2, Access::Read),
            Err(GrantError::OutOfRange)
        );
        assert_eq!(
            granted.check(&key, 4, 4096, 8192, Access::Read),
            Err(GrantError::Forged)
        );
    }

    #[test]
    fn disk_grants_name_the_node_and_the_key() {
        let key = secret(1);
        let scope = Scope::Disk {
            segment_name: "node-a:1",
            key: "k",
        };
        let grant = key.grant(Access::Read, &scope, now_secs() + 10);
        assert_eq!(
            key.check_grant(&grant, &scope, Access::Read, now_secs()),
            Ok(())
        );
        for other in [
            Scope::Disk {
                segment_name: "node-a:1",
                key: "k2",
            },
            Scope::Disk {
                segment_name: "node-a:",
                key: "1k",
            },
        ] {
            assert_eq!(
                key.check_grant(&grant, &other, Access::Read, now_secs()),
                Err(GrantError::Forged)
            );
        }
    }
}
