//! [`LeaderFollower`]: the master of a real client whose master address is
//! `etcd://…`. It reads the leader from etcd, watches the leader key, and sends each
//! call to the leader of the moment. A call that fails because the leader went away
//! (unreachable, or refusing as a standby or deposed leader) is sent again to the next
//! leader, until the failover deadline; after it the failure is answered. A call still
//! waiting when a new leader is named is abandoned and sent to the new one (the old
//! one refuses it anyway once its lease lapsed).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{
    LeaseBudget, Master, MasterExt, MasterFuture, MasterHello, MasterRequest, MasterResponse,
    PutStarted,
};
use mooncake_core::protocol::auth::ClusterSecret;
use mooncake_core::protocol::master_client::RemoteMaster;

use super::etcd::{Etcd, LeaderView};
use super::etcd_tls::EtcdTls;

/// How long a call keeps trying while no leader answers.
pub const DEFAULT_FAILOVER_WAIT: Duration = Duration::from_secs(10);

/// Pause between two tries at the same leader.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Pause before reconnecting to etcd after a failure.
const ETCD_RETRY: Duration = Duration::from_millis(300);

/// A re-read of the leader key even when the watch says nothing (a lost watch event
/// cannot keep a client on a stale leader for longer).
const RESYNC_PERIOD: Duration = Duration::from_secs(30);

/// The leader of the moment and a connection to it.
#[derive(Debug)]
struct Leader {
    view: LeaderView,
    master: RemoteMaster,
}

/// A master found through etcd and followed across failovers.
#[derive(Debug)]
pub struct LeaderFollower {
    leader: watch::Receiver<Option<Arc<Leader>>>,
    failover_wait: Duration,
    watcher: tokio::task::JoinHandle<()>,
}

impl Drop for LeaderFollower {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// True when `code` means the leader went away (try the next one).
fn leader_gone(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::RPC_FAIL
            | ErrorCode::RPC_TIMEOUT
            | ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS
            | ErrorCode::ETCD_OPERATION_ERROR
    )
}

/// An answer that may say the leader went away.
trait MaybeGone {
    /// True when every part of the answer failed with a code that means it.
    fn gone(&self) -> bool;
}

impl<T> MaybeGone for CodeResult<T> {
    fn gone(&self) -> bool {
        self.as_ref().err().is_some_and(|code| leader_gone(*code))
    }
}

impl MaybeGone for MasterResponse {
    fn gone(&self) -> bool {
        let (mut any, mut all) = (false, true);
        self.for_each_outcome(|outcome| {
            any = true;
            all &= outcome.err().is_some_and(leader_gone);
        });
        any && all
    }
}

impl LeaderFollower {
    /// Follows the leader of `cluster_id` in the etcd cluster at `endpoints` (over
    /// `tls` when given), proving
    /// membership with `secret`; a call keeps trying for `failover_wait` while no leader
    /// answers. Must run inside a tokio runtime.
    pub fn start(
        endpoints: Vec<String>,
        cluster_id: String,
        tls: Option<EtcdTls>,
        secret: Option<Arc<ClusterSecret>>,
        failover_wait: Duration,
    ) -> Self {
        let (publish, leader) = watch::channel(None);
        let etcd = (endpoints, cluster_id, tls);
        let watcher = tokio::spawn(watch_leader(etcd, secret, publish));
        LeaderFollower {
            leader,
            failover_wait,
            watcher,
        }
    }

    /// The leader's address and term, once known.
    pub fn leader(&self) -> Option<(String, u64)> {
        self.leader
            .borrow()
            .as_ref()
            .map(|l| (l.view.address.clone(), l.view.epoch))
    }

    /// Runs `call` against the leader, again against the next leader while the answer
    /// says the leader went away, until the failover deadline.
    async fn retry<T, F>(
        &self,
        refuse: impl Fn(ErrorCode) -> T,
        call: impl Fn(Arc<Leader>) -> F,
    ) -> T
    where
        T: MaybeGone,
        F: Future<Output = T>,
    {
        let deadline = Instant::now() + self.failover_wait;
        let mut leader = self.leader.clone();
        loop {
            let current = leader.borrow_and_update().clone();
            if let Some(current) = current {
                let answer = tokio::select! {
                    answer = call(current) => Some(answer),
                    _ = leader.changed() => None,
                };
                match answer {
                    Some(answer) if !answer.gone() || Instant::now() >= deadline => {
                        return answer;
                    }
                    Some(_) => {}
                    None => continue, // a new leader: try it at once
                }
            } else if Instant::now() >= deadline {
                return refuse(ErrorCode::RPC_FAIL);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left.min(RETRY_PAUSE * 4), leader.changed()).await;
            if Instant::now() < deadline {
                tokio::time::sleep(RETRY_PAUSE.min(left)).await;
            }
        }
    }
}

impl LeaderFollower {
    /// A `put_start` sent again after the leader went away may meet the write its
    /// first attempt started (that answer was lost with the leader): a key answered
    /// "exists" that is not readable is answered busy instead, so that a put is never
    /// acknowledged for an object nobody completes.
    async fn settle_retried_starts(&self, keys: &[String], answers: &mut [CodeResult<PutStarted>]) {
        let doubtful: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, answer)| matches!(answer, Err(ErrorCode::OBJECT_ALREADY_EXISTS)))
            .map(|(index, _)| index)
            .collect();
        if doubtful.is_empty() {
            return;
        }
        let probe = doubtful.iter().map(|&i| keys[i].clone()).collect();
        let readable = MasterExt::exist(self, probe, LeaseBudget(Some(0))).await;
        for (&index, found) in doubtful.iter().zip(readable) {
            if !matches!(found, Ok(Some(_))) {
                answers[index] = Err(ErrorCode::OBJECT_REPLICA_BUSY);
            }
        }
    }
}

impl LeaderFollower {
    /// A `put_commit` sent again after the leader went away may find that its first
    /// attempt completed (that answer was lost with the leader): the reservation is
    /// gone, `INVALID_WRITE`. A commit is a put, which never overwrites and succeeds when
    /// its key exists, so a key readable now is answered success.
    async fn settle_retried_commits(
        &self,
        items: &[(String, u64, String)],
        answers: &mut [CodeResult<()>],
    ) {
        let doubtful = doubtful_commits(answers);
        if doubtful.is_empty() {
            return;
        }
        let probe = doubtful.iter().map(|&i| items[i].2.clone()).collect();
        let found = MasterExt::exist(self, probe, LeaseBudget(Some(0))).await;
        let readable: Vec<bool> = found.iter().map(|f| matches!(f, Ok(Some(_)))).collect();
        settle_commits(answers, &doubtful, &readable);
    }
}

/// The commits answered `INVALID_WRITE` (their reservation is gone).
fn doubtful_commits(answers: &[CodeResult<()>]) -> Vec<usize> {
    answers
        .iter()
        .enumerate()
        .filter(|(_, answer)| matches!(answer, Err(ErrorCode::INVALID_WRITE)))
        .map(|(index, _)| index)
        .collect()
}

/// Answers success for each doubtful commit (by index) whose key is `readable` now.
fn settle_commits(answers: &mut [CodeResult<()>], doubtful: &[usize], readable: &[bool]) {
    for (&index, &found) in doubtful.iter().zip(readable) {
        if found && let Some(answer) = answers.get_mut(index) {
            *answer = Ok(());
        }
    }
}

/// Publishes the leader etcd names, following the leader key, until aborted.
async fn watch_leader(
    (endpoints, cluster_id, tls): (Vec<String>, String, Option<EtcdTls>),
    secret: Option<Arc<ClusterSecret>>,
    publish: watch::Sender<Option<Arc<Leader>>>,
) {
    let show = |view: Option<LeaderView>| {
        let same = publish
            .borrow()
            .as_ref()
            .map(|l| &l.view)
            .zip(view.as_ref())
            .is_some_and(|(old, new)| old == new);
        if same {
            return;
        }
        match &view {
            Some(view) => {
                tracing::info!(leader = %view.address, epoch = view.epoch, "following the master leader");
            }
            None => tracing::warn!("no master leader in etcd; calls wait for one"),
        }
        publish.send_replace(view.map(|view| {
            Arc::new(Leader {
                master: RemoteMaster::new(view.address.clone(), secret.clone()),
                view,
            })
        }));
    };
    loop {
        let etcd = match Etcd::connect(&endpoints, &cluster_id, tls.as_ref()).await {
            Ok(etcd) => etcd,
            Err(error) => {
                tracing::warn!(%error, "cannot reach etcd to find the master leader");
                tokio::time::sleep(ETCD_RETRY).await;
                continue;
            }
        };
        loop {
            let (view, revision) = match etcd.leader().await {
                Ok(answer) => answer,
                Err(error) => {
                    tracing::warn!(%error, "cannot read the master leader from etcd");
                    break;
                }
            };
            show(view);
            match tokio::time::timeout(RESYNC_PERIOD, etcd.leader_change(revision)).await {
                Ok(Ok(view)) => show(view),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "lost the watch on the master leader");
                    break;
                }
                Err(_) => {} // periodic re-read
            }
        }
        tokio::time::sleep(ETCD_RETRY).await;
    }
}

impl LeaderFollower {
    /// A call sent more than once may have been applied by a leader that went away
    /// before answering: settles the answers that could be wrong for that reason.
    async fn settle_retried(&self, request: &MasterRequest, response: &mut MasterResponse) {
        match (request, response) {
            (MasterRequest::PutStart { items, .. }, MasterResponse::PutStart(answers)) => {
                let keys: Vec<String> = items.iter().map(|(key, _)| key.clone()).collect();
                self.settle_retried_starts(&keys, answers).await;
            }
            (MasterRequest::PutCommit { items }, MasterResponse::PutCommit(answers)) => {
                self.settle_retried_commits(items, answers).await;
            }
            _ => {}
        }
    }
}

impl Master for LeaderFollower {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        Box::pin(self.retry(Err, |l: Arc<Leader>| async move { l.master.hello().await }))
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn call(&self, request: MasterRequest) -> MasterFuture<'_, MasterResponse> {
        self.call_during(request, Box::new(|| {}))
    }

    fn call_during<'a>(
        &'a self,
        request: MasterRequest,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> MasterFuture<'a, MasterResponse> {
        let shape = request.shape();
        // The first attempt that runs takes the work; a retry only sends the request.
        let work = parking_lot::Mutex::new(Some(work));
        Box::pin(async move {
            let attempts = AtomicU32::new(0);
            let mut response = self
                .retry(
                    |code| shape.failed(code),
                    |l: Arc<Leader>| {
                        let request = request.clone();
                        let (work, attempts) = (&work, &attempts);
                        async move {
                            attempts.fetch_add(1, Ordering::Relaxed);
                            let taken = work.lock().take();
                            match taken {
                                Some(work) => l.master.call_during(request, work).await,
                                None => l.master.call(request).await,
                            }
                        }
                    },
                )
                .await;
            if let Some(work) = work.lock().take() {
                work();
            }
            if attempts.load(Ordering::Relaxed) > 1 {
                self.settle_retried(&request, &mut response).await;
            }
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retried_commit_whose_key_is_readable_succeeded() {
        let mut answers = vec![
            Ok(()),
            Err(ErrorCode::INVALID_WRITE),
            Err(ErrorCode::INVALID_WRITE),
            Err(ErrorCode::OBJECT_ALREADY_EXISTS),
            Err(ErrorCode::RPC_FAIL),
        ];
        let doubtful = doubtful_commits(&answers);
        assert_eq!(doubtful, vec![1, 2]);
        // The first one's key is readable (its first attempt completed), the second's
        // is not (its reservation was lost): only the first becomes a success.
        settle_commits(&mut answers, &doubtful, &[true, false]);
        assert_eq!(
            answers,
            vec![
                Ok(()),
                Ok(()),
                Err(ErrorCode::INVALID_WRITE),
                Err(ErrorCode::OBJECT_ALREADY_EXISTS),
                Err(ErrorCode::RPC_FAIL),
            ]
        );
    }
}
