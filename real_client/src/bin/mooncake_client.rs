//! `mooncake_client`: parses flags, sets up logging, and runs the real client until
//! SIGINT or SIGTERM. Bad configuration exits with code 2 and one line on stderr.

fn main() -> std::process::ExitCode {
    mooncake_real_client::cli::main(std::env::args().skip(1)).into()
}
