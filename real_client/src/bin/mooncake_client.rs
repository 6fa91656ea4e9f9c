//! `mooncake_client`: parses flags, sets up logging, and runs the real client until
//! SIGINT or SIGTERM. Bad configuration exits with code 2 and one line on stderr.

/// mimalloc: the RPC path allocates and frees many small buffers per request (keys,
/// ranges, replica lists), where glibc's allocator spends a tenth of the real client's
/// time consolidating its free lists.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    mooncake_real_client::cli::main(std::env::args().skip(1)).into()
}
