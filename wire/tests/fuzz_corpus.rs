//! Replays the checked-in fuzz corpus, `fuzz/corpus/<target>/*`, through the
//! entry points of `nvpool_wire::fuzz` on stable, so every input a fuzzer
//! (or the seed generator) ever produced keeps passing `cargo test`.
//!
//! Also keeps the pieces of the fuzzing setup consistent: every target has
//! a non-empty corpus and a cargo-fuzz binary, the corpus still holds the
//! seeds `examples/gen_corpus.rs` writes, and no corpus belongs to a target
//! that no longer exists.

use std::any::Any;
use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use nvpool_wire::fuzz::{Target, TARGETS};

#[path = "support/seeds.rs"]
mod seeds;

/// Files up to this size are also replayed cut to every shorter length, so
/// each truncation point of each seed is exercised. The largest structures
/// are 4 KiB; fuzzer-found files beyond this are replayed whole only.
const PREFIX_REPLAY_MAX_BYTES: usize = 8 * 1024;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn target(name: &str) -> &'static Target {
    TARGETS
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"))
}

fn corpus_files(t: &Target) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("corpus").join(t.name);
    let entries = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus of target {} ({}): {e}", t.name, dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("reading a corpus directory").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "corpus of target {} ({}) is empty",
        t.name,
        dir.display()
    );
    files
}

fn panic_text(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(non-string panic)")
}

/// Runs every corpus file of `name`, and every prefix of the small ones.
fn replay(name: &str) {
    let t = target(name);
    for path in corpus_files(t) {
        let bytes = fs::read(&path).expect("reading a corpus file");
        let shortest = if bytes.len() <= PREFIX_REPLAY_MAX_BYTES {
            0
        } else {
            bytes.len()
        };
        for len in (shortest..=bytes.len()).rev() {
            let input = &bytes[..len];
            if let Err(p) = panic::catch_unwind(AssertUnwindSafe(|| (t.run)(input))) {
                panic!(
                    "fuzz target {name} failed on {} cut to {len} of {} bytes: {}",
                    path.display(),
                    bytes.len(),
                    panic_text(p.as_ref())
                );
            }
        }
    }
}

macro_rules! replay_tests {
    ($($name:ident),* $(,)?) => {
        mod replay {
            $(
                #[test]
                fn $name() {
                    super::replay(stringify!($name));
                }
            )*
        }
        const REPLAYED: &[&str] = &[$(stringify!($name)),*];
    };
}

replay_tests!(
    common_header,
    ic_req,
    ic_resp,
    term_req,
    data_header,
    r2t,
    capsule_resp,
    cqe,
    sqe,
    connect_cmd,
    connect_data,
    property_cmd,
    get_log_page,
    identify_controller,
    identify_namespace,
    active_ns_list,
    ns_descriptors,
    discovery_entry,
    discovery_header,
    error_entry,
    status,
    ana_log,
    rdma_cm_request,
    auth_message,
    dhchap_controller,
);

#[test]
fn every_target_is_replayed() {
    let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
    assert_eq!(names, REPLAYED);
}

#[test]
fn corpus_holds_every_generated_seed() {
    let all = seeds::all();
    for t in TARGETS {
        assert!(
            all.iter().any(|s| s.target == t.name),
            "no seeds for target {}",
            t.name
        );
    }
    for seed in &all {
        let path = fuzz_dir().join("corpus").join(seed.target).join(seed.name);
        let on_disk = fs::read(&path).unwrap_or_default();
        assert!(
            on_disk == seed.bytes,
            "{} is missing or stale: run `cargo run -p nvpool-wire --example gen_corpus`",
            path.display()
        );
    }
}

#[test]
fn every_corpus_directory_belongs_to_a_target() {
    for entry in fs::read_dir(fuzz_dir().join("corpus")).expect("fuzz/corpus") {
        let entry = entry.expect("reading fuzz/corpus");
        let name = entry
            .file_name()
            .into_string()
            .expect("corpus directory names are UTF-8");
        assert!(
            TARGETS.iter().any(|t| t.name == name),
            "fuzz/corpus/{name} has no target"
        );
    }
}

#[test]
fn cargo_fuzz_crate_has_a_binary_per_target() {
    let manifest = fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    assert_eq!(manifest.matches("[[bin]]").count(), TARGETS.len());
    assert!(
        manifest.lines().any(|l| l.trim() == "[workspace]"),
        "fuzz/ must be its own workspace"
    );
    for t in TARGETS {
        let bin = format!(
            "name = \"{}\"\npath = \"fuzz_targets/{}.rs\"",
            t.name, t.name
        );
        assert!(
            manifest.contains(&bin),
            "fuzz/Cargo.toml lacks the [[bin]] of {}",
            t.name
        );
        let src = fuzz_dir()
            .join("fuzz_targets")
            .join(format!("{}.rs", t.name));
        let src = fs::read_to_string(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        let call = format!("nvpool_wire::fuzz::{}(data)", t.name);
        assert!(
            src.contains(&call),
            "fuzz_targets/{}.rs does not call {call}",
            t.name
        );
    }
}
