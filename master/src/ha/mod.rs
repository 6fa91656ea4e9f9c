//! High availability: masters elected through etcd, a leader that streams every
//! metadata change to hot standbys, and real clients that follow the leader.
//!
//! * [`etcd`]: the leader key (upstream's layout), the lease, the in-sync list;
//!   [`etcd_tls`]: TLS (and client certificates) for the etcd connection.
//! * [`crate::journal`] (below the service, which journals each change): the leader's
//!   ordered changes and the wait that makes a write's answer follow its replication
//!   to every in-sync standby.
//! * [`node`]: [`HaNode`](node::HaNode), the master as the RPC server sees it: it
//!   serves while it leads and its lease holds, refuses otherwise.
//! * [`standby`]: a standby installing snapshots and applying changes.
//! * [`supervisor`]: stand by, campaign, lead; a deposed leader exits.
//! * [`follow`]: [`LeaderFollower`](follow::LeaderFollower), the master of a real client
//!   whose master address is `etcd://…`.
//!
//! Without `--enable_ha` none of this runs: the master journals nothing (one atomic
//! load per change) and needs no etcd.

use std::time::Duration;

pub mod etcd;
pub mod etcd_tls;
pub mod follow;
pub mod node;
pub mod standby;
pub mod supervisor;
#[cfg(test)]
mod tests;

/// Default etcd lease of the leader: a dead leader is replaced this long after its
/// last renewal at most.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(2);

/// Default time a write waits for a standby's acknowledgement before that standby
/// leaves the in-sync set.
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_millis(500);

/// How a master takes part in high availability.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaSettings {
    /// etcd endpoints (`host:port`).
    pub etcd_endpoints: Vec<String>,
    /// TLS for the etcd connection (`None`: plain HTTP).
    pub etcd_tls: Option<etcd_tls::EtcdTls>,
    /// The cluster; the leader key is `mooncake-store/<cluster_id>/master_view`.
    pub cluster_id: String,
    /// The leader's etcd lease (whole seconds, at least 1).
    pub lease_ttl: Duration,
    /// How long a write waits for an in-sync standby's acknowledgement.
    pub sync_timeout: Duration,
    /// The RPC address published as the leader's (`host:port` real clients reach).
    pub advertised: String,
}
