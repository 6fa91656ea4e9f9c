//! What high availability asks of etcd: the leader key (who leads, since which
//! revision), a lease that keeps it, and the list of standbys the leader counts as in
//! sync. Keys follow upstream: `mooncake-store/<cluster_id>/master_view` holds the
//! leader's `host:port` under the leader's lease, created only when absent; its create
//! revision is the leader's term (`epoch`).

use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, PutOptions,
    Txn, TxnOp, WatchOptions,
};

use super::etcd_tls::EtcdTls;

/// Deadline of one etcd request.
pub const ETCD_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Interval of HTTP/2 keep-alive pings on the etcd connection.
const ETCD_KEEP_ALIVE: Duration = Duration::from_secs(10);

/// Failpoint of the leader's lease renewals: when it fires a renewal fails as if etcd
/// did not answer in time (the leader stops serving before its lease can lapse, then
/// exits); `sleep(ms)` makes renewals slow instead.
pub const FAILPOINT_RENEW: &str = "ha.etcd.renew";

/// Why an etcd operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The request failed or timed out.
    #[error("etcd at {endpoints}: {source}")]
    Request {
        /// The endpoints tried.
        endpoints: String,
        /// What etcd-client said.
        source: etcd_client::Error,
    },
    /// The watch stream ended.
    #[error("etcd at {0}: the stream ended")]
    WatchEnded(String),
    /// etcd did not answer in time.
    #[error("etcd at {0}: no answer in time")]
    Timeout(String),
    /// etcd says the leader's lease no longer exists.
    #[error("etcd at {0}: the leader's lease expired")]
    LeaseGone(String),
}

/// The current leader as etcd records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderView {
    /// Where the leader's RPC server listens (`host:port`).
    pub address: String,
    /// The leader's term: the revision that created its key.
    pub epoch: u64,
}

/// The leader key of cluster `cluster_id` (upstream's layout).
pub fn leader_key(cluster_id: &str) -> String {
    format!("mooncake-store/{cluster_id}/master_view")
}

/// The key under which the leader lists standby `standby` as in sync.
fn in_sync_key(cluster_id: &str, standby: u128) -> String {
    format!("{}{standby:032x}", in_sync_prefix(cluster_id))
}

/// The key holding the term of the latest leader (absent until a first leader).
fn term_key(cluster_id: &str) -> String {
    format!("mooncake-store/{cluster_id}/term")
}

fn in_sync_prefix(cluster_id: &str) -> String {
    format!("mooncake-store/{cluster_id}/in_sync/")
}

/// A connection to an etcd cluster, scoped to one mooncake cluster id.
#[derive(Clone)]
pub struct Etcd {
    client: Client,
    endpoints: String,
    cluster_id: String,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.endpoints)
            .field("cluster_id", &self.cluster_id)
            .finish_non_exhaustive()
    }
}

/// The revision in an etcd answer as our epoch (revisions are positive).
fn as_epoch(revision: i64) -> u64 {
    u64::try_from(revision).unwrap_or(0)
}

impl Etcd {
    /// Connects to `endpoints` (`host:port` each; `http://` is added when missing,
    /// `https://` with `tls`).
    pub async fn connect(
        endpoints: &[String],
        cluster_id: &str,
        tls: Option<&EtcdTls>,
    ) -> Result<Self, EtcdError> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let urls: Vec<String> = endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("{scheme}://{e}")
                }
            })
            .collect();
        let joined = endpoints.join(",");
        // HTTP/2 pings no more often than etcd accepts (`--grpc-keepalive-min-time`,
        // 5 s by default): more frequent ones make it close the connection.
        let options = ConnectOptions::new()
            .with_timeout(ETCD_REQUEST_TIMEOUT)
            .with_connect_timeout(ETCD_REQUEST_TIMEOUT)
            .with_keep_alive(ETCD_KEEP_ALIVE, ETCD_REQUEST_TIMEOUT);
        let options = match tls {
            Some(tls) => options.with_tls(tls.options()),
            None => options,
        };
        let client = Client::connect(urls, Some(options))
            .await
            .map_err(|source| EtcdError::Request {
                endpoints: joined.clone(),
                source,
            })?;
        Ok(Etcd {
            client,
            endpoints: joined,
            cluster_id: cluster_id.to_string(),
        })
    }

    fn failed(&self, source: etcd_client::Error) -> EtcdError {
        EtcdError::Request {
            endpoints: self.endpoints.clone(),
            source,
        }
    }

    /// The endpoints, for messages.
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// The leader now, if any, and the revision the answer was read at.
    pub async fn leader(&self) -> Result<(Option<LeaderView>, i64), EtcdError> {
        let mut client = self.client.clone();
        let answer = client
            .get(leader_key(&self.cluster_id), None)
            .await
            .map_err(|e| self.failed(e))?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let view = answer.kvs().first().map(|kv| LeaderView {
            address: String::from_utf8_lossy(kv.value()).into_owned(),
            epoch: as_epoch(kv.create_revision()),
        });
        Ok((view, revision))
    }

    /// Waits until the leader key changes after `revision` (a new leader, or none);
    /// answers the leader then.
    pub async fn leader_change(&self, revision: i64) -> Result<Option<LeaderView>, EtcdError> {
        let mut client = self.client.clone();
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let mut stream = client
            .watch(leader_key(&self.cluster_id), Some(options))
            .await
            .map_err(|e| self.failed(e))?;
        loop {
            let Some(answer) = stream.message().await.map_err(|e| self.failed(e))? else {
                return Err(EtcdError::WatchEnded(self.endpoints.clone()));
            };
            if answer.canceled() {
                return Err(EtcdError::WatchEnded(self.endpoints.clone()));
            }
            if let Some(event) = answer.events().last() {
                return Ok(match (event.event_type(), event.kv()) {
                    (EventType::Put, Some(kv)) => Some(LeaderView {
                        address: String::from_utf8_lossy(kv.value()).into_owned(),
                        epoch: as_epoch(kv.create_revision()),
                    }),
                    _ => None,
                });
            }
        }
    }

    /// Tries once to become the leader: grants a lease of `ttl` and creates the leader
    /// key with `address` under it, only if no leader key exists. Answers the
    /// leadership (`None`: another master leads).
    pub async fn campaign(
        &self,
        address: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, EtcdError> {
        let mut client = self.client.clone();
        let granted_at = Instant::now();
        let ttl_secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = client
            .lease_grant(ttl_secs, None)
            .await
            .map_err(|e| self.failed(e))?
            .id();
        let key = leader_key(&self.cluster_id);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                address,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let answer = client.txn(txn).await.map_err(|e| self.failed(e))?;
        if !answer.succeeded() {
            let _ = client.lease_revoke(lease).await;
            return Ok(None);
        }
        Ok(Some(Leadership {
            lease,
            epoch: as_epoch(answer.header().map_or(0, |h| h.revision())),
            valid_until: granted_at + ttl,
        }))
    }

    /// Keeps `leadership`'s lease alive until it cannot: every third of `ttl`, renews
    /// it and calls `renewed` with the instant it now surely lasts until. A failed
    /// renewal is retried (on a new stream) while the lease may still hold; returns
    /// when etcd says the lease is gone or when it lapsed without a renewal.
    pub async fn keep_leading(
        &self,
        leadership: &Leadership,
        ttl: Duration,
        renewed: impl Fn(Instant),
    ) -> EtcdError {
        let mut valid_until = leadership.valid_until;
        let period = ttl / 3;
        loop {
            let error = self
                .renew_until_failure(leadership.lease, ttl, period, &mut valid_until, &renewed)
                .await;
            match error {
                Some(error) if Instant::now() + period / 2 < valid_until => {
                    tracing::warn!(%error, "lease renewal failed; retrying while the lease holds");
                    tokio::time::sleep(period / 4).await;
                }
                Some(error) => return error,
                None => return EtcdError::LeaseGone(self.endpoints.clone()),
            }
        }
    }

    /// Renews on one keep-alive stream until it fails (`Some`) or etcd says the lease
    /// is gone (`None`).
    async fn renew_until_failure(
        &self,
        lease: i64,
        ttl: Duration,
        period: Duration,
        valid_until: &mut Instant,
        renewed: &impl Fn(Instant),
    ) -> Option<EtcdError> {
        let mut client = self.client.clone();
        let (mut keeper, mut stream) = match client.lease_keep_alive(lease).await {
            Ok(pair) => pair,
            Err(error) => return Some(self.failed(error)),
        };
        loop {
            let sent = Instant::now();
            if mooncake_core::failpoint::hit(FAILPOINT_RENEW).is_some() {
                return Some(EtcdError::Timeout(self.endpoints.clone()));
            }
            if let Err(error) = keeper.keep_alive().await {
                return Some(self.failed(error));
            }
            match tokio::time::timeout(period, stream.message()).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                    *valid_until = sent + ttl;
                    renewed(*valid_until);
                }
                Ok(Ok(Some(_))) => return None,
                Ok(Ok(None)) => return Some(EtcdError::WatchEnded(self.endpoints.clone())),
                Ok(Err(error)) => return Some(self.failed(error)),
                Err(_) => {
                    return Some(EtcdError::Timeout(self.endpoints.clone()));
                }
            }
            tokio::time::sleep(period.saturating_sub(sent.elapsed())).await;
        }
    }

    /// Gives leadership up at once (clean shutdown): the leader key goes with the lease.
    pub async fn resign(&self, leadership: &Leadership) {
        let mut client = self.client.clone();
        let _ = client.lease_revoke(leadership.lease).await;
    }

    /// Records `epoch` as the term of the latest leader.
    pub async fn record_term(&self, epoch: u64) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        client
            .put(term_key(&self.cluster_id), epoch.to_string(), None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// The term of the latest leader (`None`: the cluster never had one).
    pub async fn last_term(&self) -> Result<Option<u64>, EtcdError> {
        let mut client = self.client.clone();
        let answer = client
            .get(term_key(&self.cluster_id), None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(answer
            .kvs()
            .first()
            .and_then(|kv| String::from_utf8_lossy(kv.value()).parse().ok()))
    }

    /// Lists `standby` as in sync with the leader of term `epoch`.
    pub async fn mark_in_sync(&self, standby: u128, epoch: u64) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        client
            .put(
                in_sync_key(&self.cluster_id, standby),
                epoch.to_string(),
                None,
            )
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// Takes `standby` off the in-sync list.
    pub async fn mark_out_of_sync(&self, standby: u128) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        client
            .delete(in_sync_key(&self.cluster_id, standby), None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// True when the leader of term `epoch` lists `standby` as in sync.
    pub async fn is_in_sync(&self, standby: u128, epoch: u64) -> Result<bool, EtcdError> {
        let mut client = self.client.clone();
        let answer = client
            .get(in_sync_key(&self.cluster_id, standby), None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(answer
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == epoch.to_string().as_bytes()))
    }

    /// Clears the in-sync list (a new leader starts its own).
    pub async fn clear_in_sync(&self) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        client
            .delete(
                in_sync_prefix(&self.cluster_id),
                Some(DeleteOptions::new().with_prefix()),
            )
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// The standbys listed in sync (for status reports).
    pub async fn in_sync_standbys(&self) -> Result<Vec<String>, EtcdError> {
        let mut client = self.client.clone();
        let prefix = in_sync_prefix(&self.cluster_id);
        let answer = client
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.failed(e))?;
        Ok(answer
            .kvs()
            .iter()
            .map(|kv| {
                String::from_utf8_lossy(kv.key())
                    .trim_start_matches(prefix.as_str())
                    .to_string()
            })
            .collect())
    }
}

/// A won election: the lease that holds the leader key, and the term.
#[derive(Clone, Copy, Debug)]
pub struct Leadership {
    /// The etcd lease.
    pub lease: i64,
    /// The term: the revision that created the leader key.
    pub epoch: u64,
    /// Until when the lease surely holds (counted from before it was granted).
    pub valid_until: Instant,
}
