//! `nvpool-control`: the control-plane daemon. Everything is in the library
//! (`nvpool_control::daemon`); this only turns its result into an exit code.

fn main() {
    std::process::exit(nvpool_control::daemon::main_exit_code());
}
