//! A real client's RPC requests as the master's serving codec decodes them (deadlines
//! clamped; `mooncake_core::protocol::fuzzing::serving_request`). The codec turns a
//! decoder panic into an error; under the fuzzer a panic aborts all the same, so a
//! panic it would hide is found.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::protocol::fuzzing::serving_request;
use mooncake_core::protocol::master_rpc::MasterRpcRequest;

fuzz_target!(|bytes: &[u8]| serving_request::<MasterRpcRequest>(bytes));
