//! What the nvpool crates' integration tests share, written once:
//!
//! - [`target`]: an nvpool-target running inside the test process on
//!   loopback ports, and the subsystems it serves;
//! - [`control`] (feature `control`): a control plane inside the test
//!   process and the registration a target sends it;
//! - [`certs`] (feature `certs`): a throwaway CA and server certificate;
//! - [`wait_for`] and [`wait_exit`]: bounded waits that fails the test saying what it was
//!   waiting for, instead of hanging;
//! - [`pattern`] and [`fill`]: deterministic test data from a seed;
//! - [`scratch_file`], [`file_spec`], [`free_port`]: what a daemon under test
//!   is given to serve and listen on;
//! - [`sim`]: the generic core of the seeded deterministic simulations
//!   (event queue, draws, network delay, seed loop and replay).
//!
//! Tests that run the daemons' binaries find them with
//! `env!("CARGO_BIN_EXE_…")` in their own package; this crate spawns no
//! binaries.

#[cfg(feature = "certs")]
pub mod certs;
#[cfg(feature = "control")]
pub mod control;
pub mod sim;
pub mod target;

use nvpool_layout::mapping::Geometry;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The first pause between two checks of [`wait_for`]; it doubles up to
/// [`WAIT_POLL_MAX`], so quick conditions are seen quickly and slow ones
/// (an HTTP round trip per check) are not polled in a tight loop.
pub const WAIT_POLL_MIN: Duration = Duration::from_millis(10);
/// The longest pause between two checks of [`wait_for`].
pub const WAIT_POLL_MAX: Duration = Duration::from_millis(100);

/// Checks `f` until it holds; fails the test, naming `what`, when it still
/// does not after `within`.
#[track_caller]
pub fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    let mut pause = nvpool_rt::Backoff::new(WAIT_POLL_MIN, WAIT_POLL_MAX);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(pause.step());
    }
}

/// Waits for `child` to exit and returns how it did; fails the test, naming
/// `what`, when it still runs after `within`.
#[track_caller]
pub fn wait_exit(what: &str, child: &mut Child, within: Duration) -> ExitStatus {
    let mut status = None;
    wait_for(what, within, || {
        status = child.try_wait().expect("the child's status");
        status.is_some()
    });
    status.expect("it exited")
}

/// Where a test puts one extent of a volume: on target `target` (an index),
/// as its `nsid`-th extent there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub target: usize,
    pub nsid: u32,
    pub row: u32,
    pub member: u32,
    pub copy: u8,
}

/// Places every extent (row, member, copy) of a volume of geometry `g` on
/// target (row + member × copies + copy) mod `targets`, so the extents of a
/// row sit on distinct targets when there are enough of them; each target
/// numbers its extents from 1 in plan order.
pub fn place(g: &Geometry, targets: usize) -> Vec<Placed> {
    let mut count = vec![0u32; targets];
    let mut placed = Vec::new();
    for row in 0..g.rows() {
        for member in 0..g.width {
            for copy in 0..g.copies {
                let target =
                    (row as usize + member as usize * usize::from(g.copies) + copy as usize)
                        % targets;
                count[target] += 1;
                placed.push(Placed {
                    target,
                    nsid: count[target],
                    row,
                    member,
                    copy,
                });
            }
        }
    }
    placed
}

/// A zero-filled sparse file of `size` bytes in a new directory under
/// `parent` (a test passes `env!("CARGO_TARGET_TMPDIR")`: the build disk, not
/// tmpfs, so the file backend can use O_DIRECT and io_uring on it). The file
/// goes with the directory when that is dropped.
pub fn scratch_file(parent: impl AsRef<Path>, size: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(parent).expect("tempdir");
    let path = dir.path().join("disk.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(size))
        .expect("create scratch file");
    (dir, path)
}

/// `file:PATH`: the backend spec of a file device.
pub fn file_spec(path: &Path) -> String {
    format!("file:{}", path.display())
}

/// A loopback port nothing listens on right now (for a daemon the test
/// starts as a process to take).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// `len` bytes of deterministic test data from `seed`: see [`fill`].
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    fill(seed, &mut buf);
    buf
}

/// Fills `buf` with the test data of `seed` ([`nvpool_rt::random::Rng`],
/// eight bytes a step): different seeds give different bytes, none of them
/// a run of zeroes, and a shorter buffer gets a prefix of a longer one's.
pub fn fill(seed: u64, buf: &mut [u8]) {
    nvpool_rt::random::Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).fill(buf);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_deterministic_and_differ_by_seed() {
        assert_eq!(pattern(3, 4096), pattern(3, 4096));
        assert_ne!(pattern(3, 4096), pattern(4, 4096));
        assert_ne!(pattern(0, 4096), vec![0; 4096]);
        assert_eq!(pattern(9, 100), pattern(9, 4096)[..100]);
    }

    #[test]
    fn wait_for_returns_once_the_condition_holds() {
        let mut n = 0;
        wait_for("three checks", Duration::from_secs(5), || {
            n += 1;
            n == 3
        });
        assert_eq!(n, 3);
    }

    #[test]
    #[should_panic(expected = "waiting for never")]
    fn wait_for_fails_naming_what_it_waited_for() {
        wait_for("never", Duration::from_millis(30), || false);
    }
}
