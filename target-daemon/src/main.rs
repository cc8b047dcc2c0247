//! `nvpool-target`: parse arguments, run the daemon, map errors to exit codes.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = nvpool_target::Cli::parse();
    nvpool_rt::log::to_stderr(&cli.log, "info");
    match nvpool_target::daemon::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool-target: {e:#}");
            std::process::ExitCode::from(nvpool_target::daemon::exit_code(&e))
        }
    }
}
