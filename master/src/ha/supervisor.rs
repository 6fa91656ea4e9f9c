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
use super::journal::Journal;
use super::node::HaNode;
use super::standby;

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
    // The term of the last leader followed (0: none seen yet).
    let mut followed = 0u64;
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
                if view.address != settings.advertised {
                    followed = view.epoch;
                    node.follow(Some((view.address.clone(), view.epoch)));
                    tracing::info!(leader = %view.address, epoch = view.epoch, "standing by");
                }
                let sync = (view.address != settings.advertised).then(|| {
                    tokio::spawn(standby::follow(
                        Arc::clone(node),
                        view.clone(),
                        supervision.secret.clone(),
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
                if let Some(leadership) = campaign(node, settings, followed).await {
                    return leadership;
                }
            }
        }
    }
}

/// One campaign, after a pause when this standby may lack the last leader's latest
/// changes; `None` when another master won (or etcd failed).
async fn campaign(node: &HaNode, settings: &HaSettings, followed: u64) -> Option<Leadership> {
    let etcd = node.etcd();
    if followed != 0 {
        let me = node.master().id();
        let in_sync = etcd.is_in_sync(me, followed).await.unwrap_or(false);
        if !in_sync {
            let pause = settings.lease_ttl * 2;
            tracing::warn!(
                epoch = followed,
                pause_ms = pause.as_millis(),
                "the leader is gone and this standby was not in sync with it: leaving the election to an in-sync standby first"
            );
            tokio::time::sleep(pause).await;
            if !matches!(etcd.leader().await, Ok((None, _))) {
                return None;
            }
            tracing::warn!("no in-sync standby took over: taking over with what this standby has");
        }
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
