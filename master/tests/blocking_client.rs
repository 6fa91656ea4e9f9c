//! The blocking master client (used on applications' calling threads) against the
//! master's tarpc server.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{LeaseBudget, MasterRequest, MasterResponse};
use mooncake_core::protocol::blocking::BlockingClient;
use mooncake_core::protocol::master_rpc::{
    MASTER_PROTOCOL_VERSION, MasterRpcRequest, MasterRpcResponse,
};
use mooncake_master::running::RunningMaster;
use mooncake_master::{Clock, MasterConfig, MasterService};

type Client = BlockingClient<MasterRpcRequest, MasterRpcResponse>;

fn exist(client: &mut Client, key: &str) -> Vec<CodeResult<Option<u64>>> {
    let request = MasterRpcRequest::Call {
        request: MasterRequest::Exist {
            keys: vec![key.to_string()],
            budget: LeaseBudget(None),
        },
    };
    match client.call(request, Duration::from_secs(5)) {
        Ok(MasterRpcResponse::Call(MasterResponse::Exist(answer))) => answer,
        other => panic!("unexpected answer {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_blocking_client_is_served_by_the_tarpc_server() {
    let master = Arc::new(MasterService::new(MasterConfig::default(), Clock::System));
    let address = "127.0.0.1:0".parse().expect("address");
    let running = RunningMaster::start(master, address, None)
        .await
        .expect("master starts");
    let address = running.rpc_address.expect("served");
    tokio::task::spawn_blocking(move || {
        let stream = TcpStream::connect(address).expect("connect");
        let mut client = Client::new(stream).expect("client");
        let hello = MasterRpcRequest::Hello {
            version: MASTER_PROTOCOL_VERSION + 1,
        };
        match client.call(hello, Duration::from_secs(5)) {
            Ok(MasterRpcResponse::Hello(answer)) => {
                assert_eq!(answer, Err(ErrorCode::INVALID_VERSION));
            }
            other => panic!("unexpected answer {other:?}"),
        }
        // Consecutive calls on one connection each get their own answer.
        assert_eq!(exist(&mut client, "missing"), vec![Ok(None)]);
        assert_eq!(exist(&mut client, "missing too"), vec![Ok(None)]);
    })
    .await
    .expect("client thread");
    running.stop().await;
}
