//! A commit sent while the caller works (`MasterExt::put_commit_during`): to a remote master
//! from an application's thread the request travels while the work runs, so the key can
//! be readable before the work returns; an in-process master runs the work first.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::error::CodeResult;
use mooncake_core::master_api::{
    LeaseBudget, Master, MasterExt, MasterRequest, MasterResponse, RESERVED_PREFIX,
};
use mooncake_core::protocol::blocking::BlockingClient;
use mooncake_core::protocol::master_client::{RemoteMaster, as_caller_thread};
use mooncake_core::protocol::master_rpc::{MasterRpcRequest, MasterRpcResponse};
use mooncake_core::types::{ReplicateConfig, WriteMode};
use mooncake_master::running::RunningMaster;
use mooncake_master::{Clock, MasterConfig, MasterService};

type Observer = BlockingClient<MasterRpcRequest, MasterRpcResponse>;

/// Whether `key` is readable, asked over the observer's own connection.
fn readable(observer: &mut Observer, key: &str) -> bool {
    let request = MasterRpcRequest::Call {
        request: MasterRequest::Exist {
            keys: vec![key.to_string()],
            budget: LeaseBudget(None),
        },
    };
    match observer.call(request, Duration::from_secs(5)) {
        Ok(MasterRpcResponse::Call(MasterResponse::Exist(answer))) => {
            matches!(answer.as_slice(), [Ok(Some(_))])
        }
        other => panic!("unexpected answer {other:?}"),
    }
}

/// Mounts a segment and starts a write under a reserved name: `(name, write id)`.
async fn reserve(master: &dyn Master) -> (String, u64) {
    master
        .mount_segment(1, "node".into(), 16 << 20, "127.0.0.1:1".into(), 0)
        .await
        .expect("mounted");
    let name = format!("{RESERVED_PREFIX}test/1");
    let started = master
        .put_start(
            vec![(name.clone(), 4096)],
            ReplicateConfig::default(),
            WriteMode::Put,
        )
        .await;
    let [Ok(started)] = started.as_slice() else {
        panic!("reserved: {started:?}");
    };
    (name, started.write_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_from_a_callers_thread_travels_while_its_work_runs() {
    let service = Arc::new(MasterService::new(MasterConfig::default(), Clock::System));
    let running = RunningMaster::start(service, "127.0.0.1:0".parse().expect("address"), None)
        .await
        .expect("master starts");
    let address = running.rpc_address.expect("served");
    let remote = Arc::new(RemoteMaster::new(address.to_string(), None));
    let (name, write_id) = reserve(remote.as_ref()).await;
    let runtime = tokio::runtime::Handle::current();
    let (seen_during_work, answers) = tokio::task::spawn_blocking(move || {
        let mut observer =
            Observer::new(TcpStream::connect(address).expect("connect")).expect("observer");
        let mut seen = false;
        let work = Box::new(|| {
            // The key turns readable while this still runs.
            let until = Instant::now() + Duration::from_secs(5);
            while !seen && Instant::now() < until {
                seen = readable(&mut observer, "key");
            }
        });
        let items = vec![(name, write_id, "key".to_string())];
        let answers: Vec<CodeResult<()>> =
            as_caller_thread(|| runtime.block_on(remote.put_commit_during(items, work)));
        (seen, answers)
    })
    .await
    .expect("caller thread");
    assert_eq!(answers, vec![Ok(())]);
    assert!(seen_during_work, "the commit waited for the work");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn an_in_process_master_runs_the_work_before_the_commit() {
    let service = MasterService::new(MasterConfig::default(), Clock::System);
    let (name, write_id) = reserve(&service).await;
    let ran = std::sync::atomic::AtomicBool::new(false);
    let unseen_during_work = std::sync::atomic::AtomicBool::new(false);
    let work = Box::new(|| {
        ran.store(true, std::sync::atomic::Ordering::SeqCst);
        // Not committed yet: nothing to see under the key.
        let exists = service.exist("key") == Ok(true);
        unseen_during_work.store(!exists, std::sync::atomic::Ordering::SeqCst);
    });
    let answers = service
        .put_commit_during(vec![(name, write_id, "key".to_string())], work)
        .await;
    assert_eq!(answers, vec![Ok(())]);
    assert!(ran.into_inner(), "the work ran");
    assert!(
        unseen_during_work.into_inner(),
        "the key was readable before the work"
    );
}
