//! `nvpool`: parse arguments, run the command, map errors to exit codes
//! (1 for failures, 2 for usage errors, each a one-line message).

fn main() -> std::process::ExitCode {
    nvpool_cli::main()
}
