#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nvpool_wire::fuzz::dhchap_controller(data));
