//! Executes the copy and move tasks the master assigns to this real client (the owner
//! of each task's source replica): fetch, copy the bytes from this node's segment to
//! the targets, report.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::state::ServerState;

/// How often the master is asked for new tasks.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Most tasks taken per poll.
const BATCH: u32 = 16;

/// Polls the master for tasks of `client` and executes them until `shutdown`.
pub async fn execute(state: Arc<ServerState>, client: u128, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = mooncake_core::process::stop_requested(&mut shutdown) => return,
        }
        let master = state.store.master();
        let Ok(work) = master.fetch_tasks(client, BATCH).await else {
            continue; // the master is unreachable: the heartbeat reports it
        };
        for task in work {
            let outcome = state.store.replicate(&task);
            match &outcome {
                Ok(()) => tracing::debug!(key = %task.key, kind = ?task.kind, "task done"),
                Err(code) => {
                    tracing::warn!(key = %task.key, kind = ?task.kind, %code, "task failed")
                }
            }
            let reported = master
                .finish_task(client, task.id, outcome.map_err(|code| code.as_i32()))
                .await;
            if let Err(code) = reported {
                // The master fails it after its processing timeout.
                tracing::warn!(key = %task.key, %code, "cannot report a task's outcome");
            }
        }
    }
}
