//! `nvpool-target`: parse arguments, run the daemon, map errors to exit codes.

use clap::Parser;
use std::io::IsTerminal;

fn main() -> std::process::ExitCode {
    let cli = nvpool_target::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match nvpool_target::daemon::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool-target: {e:#}");
            std::process::ExitCode::from(nvpool_target::daemon::exit_code(&e))
        }
    }
}
