//! Writes the seed corpus of every fuzz target to `wire/fuzz/corpus/<target>/`.
//!
//! ```text
//! cargo run -p nvpool-wire --example gen_corpus
//! ```
//!
//! Run it after changing an encoder or a seed in `tests/support/seeds.rs`;
//! `tests/fuzz_corpus.rs` fails until the checked-in files match again.
//! Files already there that it did not write (inputs a fuzzer found) are
//! left alone.

use std::path::Path;

#[path = "../tests/support/seeds.rs"]
mod seeds;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let all = seeds::all();
    for seed in &all {
        let dir = root.join(seed.target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(seed.name), &seed.bytes)?;
    }
    let bytes: usize = all.iter().map(|s| s.bytes.len()).sum();
    println!(
        "wrote {} seeds ({bytes} bytes) under {}",
        all.len(),
        root.display()
    );
    Ok(())
}
