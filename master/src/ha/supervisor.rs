//! The life of a master under high availability: stand by (following the leader
//! etcd names), campaign when the leader key goes away, lead until the lease cannot be
//! kept. A deposed leader does not go back to standing by with its old state: the
//! supervisor returns, and the process exits so that its supervisor restarts it as a
//! fresh standby.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use mooncake_core::protocol::auth::ClusterSecret;

use super::HaSettings;
use super::etcd::{EtcdError, Leadership};
use super::node::HaNode;
use super::standby;
use crate::journal::Journal;

/// Pause before retrying an etcd request that failed.
const ETCD_RETRY: Duration = Duration::from_millis(300);

/// Why a master stopped leading.
#[derive(Debug, thiserror::Error)]
pub enum HaError {
    /// The etcd lease could not be renewed: another master may lead now.
    #[error(
        "lost leadership of term {epoch}: {source}; exiting so that a supervisor restarts this master as a standby"
    )]
    LostLeadership {
        /// The term that ended.
        epoch: u64,
        /// What etcd said.
        source: EtcdError,
    },
}

/// What the supervisor needs besides the node.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// Settings.
    pub settings: HaSettings,
    /// The secret the standby proves to the leader.
    pub secret: Option<Arc<ClusterSecret>>,
}

/// Runs until `shutdown` (resigning when leading) or until leadership is lost.
pub async fn supervise(
    node: Arc<HaNode>,
    supervision: Supervision,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), HaError> {
    let leadership = tokio::select! {
        won = stand_by(&node, &supervision) => won,
        () = mooncake_core::process::stop_requested(&mut shutdown) => return Ok(()),
    };
    lead(&node, &supervision.settings, leadership, shutdown).await
}

/// Follows leaders until this master wins an election.
async fn stand_by(node: &Arc<HaNode>, supervision: &Supervision) -> Leadership {
    let settings = &supervision.settings;
    let etcd = node.etcd().clone();
    loop {
        let (view, revision) = match etcd.leader().await {
            Ok(answer) => answer,
            Err(error) => {
                tracing::warn!(%error, "cannot read the leader from etcd");
                tokio::time::sleep(ETCD_RETRY).await;
                continue;
            }
        };
        match view {
            Some(view) => {
                // A key with our own address is our previous instance's: wait for it to
                // expire, following nobody.
                let sync = (view.address != settings.advertised).then(|| {
                    node.follow(Some((view.address.clone(), view.epoch)));
                    tracing::info!(leader = %view.address, epoch = view.epoch, "standing by");
                    tokio::spawn(standby::follow(
                        Arc::clone(node),
                        view.clone(),
                        supervision.secret.clone(),
                        settings.advertised.clone(),
                    ))
                });
                let changed = etcd.leader_change(revision).await;
                if let Some(sync) = sync {
                    sync.abort();
                }
                if let Err(error) = changed {
                    tracing::warn!(%error, "lost the watch on the leader key");
                    tokio::time::sleep(ETCD_RETRY).await;
                }
            }
            None => {
                if let Some(leadership) = campaign(node, settings).await {
                    return leadership;
                }
            }
        }
    }
}

/// One campaign; `None` when another master won (or etcd failed). Only a master the
/// latest leader listed in sync (or any, in a cluster that never had a leader)
/// campaigns at once; another one first leaves some lease TTLs to better informed
/// masters ([`HaNode::takeover_delay_ttls`]), then takes over with what it has.
async fn campaign(node: &HaNode, settings: &HaSettings) -> Option<Leadership> {
    let etcd = node.etcd();
    let me = node.master().id();
    let delay_ttls = match etcd.last_term().await {
        Ok(None) => 0,
        Ok(Some(term)) => match etcd.is_in_sync(me, term).await {
            Ok(true) => 0,
            _ => node.takeover_delay_ttls(term),
        },
        Err(error) => {
            tracing::warn!(%error, "cannot read the last term from etcd");
            tokio::time::sleep(ETCD_RETRY).await;
            return None;
        }
    };
    if delay_ttls > 0 {
        let pause = settings.lease_ttl * delay_ttls;
        tracing::warn!(
            pause_ms = pause.as_millis(),
            "no leader, and this master was not in sync with the last one: leaving the election to better informed masters first"
        );
        tokio::time::sleep(pause).await;
        if !matches!(etcd.leader().await, Ok((None, _))) {
            return None;
        }
        tracing::warn!(
            "no better informed master took over: taking over with what this master has"
        );
    }
    match etcd
        .campaign(&settings.advertised, settings.lease_ttl)
        .await
    {
        Ok(won) => won,
        Err(error) => {
            tracing::warn!(%error, "campaign failed");
            tokio::time::sleep(ETCD_RETRY).await;
            None
        }
    }
}

/// Leads until `shutdown` (resigning) or until the lease cannot be kept.
async fn lead(
    node: &Arc<HaNode>,
    settings: &HaSettings,
    leadership: Leadership,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), HaError> {
    let etcd = node.etcd().clone();
    if let Err(error) = etcd.clear_in_sync().await {
        tracing::warn!(%error, "cannot clear the previous term's in-sync list");
    }
    if let Err(error) = etcd.record_term(leadership.epoch).await {
        tracing::warn!(%error, "cannot record the new term in etcd");
    }
    let journal = Arc::new(Journal::new(leadership.epoch, settings.sync_timeout));
    node.lead(journal, leadership.valid_until);
    tracing::info!(
        epoch = leadership.epoch,
        address = %settings.advertised,
        "leading"
    );
    let renewing = etcd.keep_leading(&leadership, settings.lease_ttl, |until| {
        node.renewed(until);
    });
    let maintaining = crate::server::maintain(Arc::clone(node.master()), shutdown.clone());
    tokio::select! {
        source = renewing => Err(HaError::LostLeadership { epoch: leadership.epoch, source }),
        () = maintaining => {
            etcd.resign(&leadership).await;
            Ok(())
        }
        () = mooncake_core::process::stop_requested(&mut shutdown) => {
            etcd.resign(&leadership).await;
            Ok(())
        }
    }
}
