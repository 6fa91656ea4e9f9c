//! `mooncake_master`: parses flags, sets up logging, and runs the standalone master
//! until SIGINT or SIGTERM. Bad configuration exits with code 2 and one line on stderr.

fn main() -> std::process::ExitCode {
    mooncake_master::command::main(std::env::args().skip(1)).into()
}
