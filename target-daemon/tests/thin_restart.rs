//! A thin target killed and restarted under a host that rides the restart
//! out (design/thin-snapshots.md T3, T5): the host reissues only the
//! commands that were in flight, so a write the killed process had
//! completed must still be there once a Flush to the restarted process
//! succeeds. The grain pool's metadata changes live in memory until a
//! commit, while the data bytes sit in the page cache, which a SIGKILL
//! does not lose: an overwrite in place survives a kill on its own, a
//! write that changed the map (a new grain, or the copy of a grain a
//! snapshot shares) survives only if it was committed before it completed.
//!
//! Also, at the pool level, the sequence the ordering checker's failing
//! rounds went through: a write tagged E lands in a live tree and its
//! sealing snapshot (one new grain, two references), the process dies at
//! every step, the reopened pool takes the reissued write (tagged E) in
//! the live tree only, and the given-up snapshot is deleted: the live tree
//! holds every write whose commit happened and every reissued one, and
//! the space map checks out.

mod common;

use common::*;
use nvpool_target::backend::thin::{self, Device, Pool};
use std::process::{Child, Stdio};
use std::time::Duration;

const GRAIN: u64 = 64 << 10;
const BLOCK: usize = 4096;
/// Blocks of 4 KiB per grain.
const GRAIN_BLOCKS: u64 = GRAIN / BLOCK as u64;
const TREE: u64 = 1;
const TREE_BYTES: u64 = 64 << 20;
const PATIENCE: Duration = Duration::from_secs(20);

// ----- the real target process -----

/// `nvpool-target` serving tree [`TREE`] of the pool at `pool` as
/// namespace 1 of [`SUBNQN`] on `port`.
struct Target {
    child: Child,
    port: u16,
}

impl Target {
    fn start(pool: &std::path::Path, port: u16) -> Target {
        let spec = format!("thin:{},root={TREE},size={TREE_BYTES}", pool.display());
        let child = daemon_bin()
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", "off", "--no-io-uring", "--reactors", "1"])
            .args(["--export", &format!("{SUBNQN}={spec}"), "--allow-any-host"])
            .stderr(Stdio::null())
            .spawn()
            .expect("nvpool-target starts");
        let t = Target { child, port };
        wait_for("the target to listen", PATIENCE, || {
            std::net::TcpStream::connect(t.addr()).is_ok()
        });
        t
    }

    fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// SIGKILL: nothing of the process's memory survives, the page cache
    /// does.
    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Formats a pool, writes `grains` whole grains of tree [`TREE`] (grain g
/// holds `pattern(g, GRAIN)`) and, with `snapshot`, makes tree 2 share
/// them all (what a snapshot or a clone does); everything committed.
fn prepared_pool(grains: u64, snapshot: bool) -> (tempfile::TempDir, std::path::PathBuf) {
    let (dir, path) = scratch_file(64 << 20);
    let p = path.to_str().expect("a UTF-8 path");
    thin::format(p, GRAIN).expect("format");
    let b = thin::open(p, TREE, TREE_BYTES).expect("open the tree");
    use nvpool_target::backend::Backend;
    for g in 0..grains {
        b.write_at(&pattern(g, GRAIN as usize), g * GRAIN, false)
            .expect("write");
    }
    b.flush().expect("commit");
    if snapshot {
        b.pool().snapshot_trees(0, &[(TREE, 2)]).expect("snapshot");
    }
    drop(b);
    (dir, path)
}

/// Writes `data` at block `lba` through a target that is then SIGKILLed
/// right away (well inside the pool's commit tick, so only what the write
/// itself made durable is there), restarts it, flushes through the new
/// process and returns what block `lba` then reads.
fn write_kill_flush_read(path: &std::path::Path, lba: u64, data: &[u8]) -> Vec<u8> {
    let port = free_port();
    let t = Target::start(path, port);
    let (_a, mut q) = controller(t.addr(), NO_DIGESTS, SUBNQN, HOST_A);
    // A commit now, so the tick is ~100 ms away when the write lands.
    q.flush(1).ok();
    q.write(1, lba, data, BLOCK, false).ok();
    t.kill();
    let t = Target::start(path, port);
    let (_a, mut q) = controller(t.addr(), NO_DIGESTS, SUBNQN, HOST_A);
    // The host's reissued (or next) Flush: it succeeds, so every write that
    // completed before it must be durable.
    q.flush(1).ok();
    let got = q.read_ok(1, lba, (data.len() / BLOCK) as u32, BLOCK);
    drop(t);
    got
}

#[test]
fn an_overwrite_in_place_survives_a_kill() {
    let (_dir, path) = prepared_pool(2, false);
    let data = pattern(100, BLOCK);
    assert!(
        write_kill_flush_read(&path, GRAIN_BLOCKS + 3, &data) == data,
        "a grain the tree owns alone is overwritten in place"
    );
}

#[test]
fn a_completed_write_to_a_grain_a_snapshot_shares_survives_a_kill() {
    // The ordering checker's case: after a snapshot every grain is shared,
    // so the next write to it copies the grain (a map change).
    let (_dir, path) = prepared_pool(2, true);
    let data = pattern(101, BLOCK);
    assert!(
        write_kill_flush_read(&path, GRAIN_BLOCKS + 3, &data) == data,
        "the write completed, then a Flush succeeded: it must be there"
    );
}

#[test]
fn a_completed_write_to_a_new_grain_survives_a_kill() {
    let (_dir, path) = prepared_pool(1, false);
    let data = pattern(102, 2 * BLOCK);
    assert!(
        write_kill_flush_read(&path, 5 * GRAIN_BLOCKS, &data) == data,
        "the write completed, then a Flush succeeded: it must be there"
    );
}

#[test]
fn a_completed_deallocate_survives_a_kill() {
    let (_dir, path) = prepared_pool(2, false);
    let port = free_port();
    let t = Target::start(&path, port);
    let (_a, mut q) = controller(t.addr(), NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
    q.deallocate(1, &[(GRAIN_BLOCKS, GRAIN_BLOCKS as u32)]).ok();
    t.kill();
    let t = Target::start(&path, port);
    let (_a, mut q) = controller(t.addr(), NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
    let got = q.read_ok(1, GRAIN_BLOCKS, GRAIN_BLOCKS as u32, BLOCK);
    assert!(
        got.iter().all(|&b| b == 0),
        "a deallocated grain reads as zeroes after the restart, as the other copy's does"
    );
    assert!(
        q.read_ok(1, 0, GRAIN_BLOCKS as u32, BLOCK) == pattern(0, GRAIN as usize),
        "the grain beside it is as written"
    );
}

// ----- the pool itself, crashed at every step -----

/// A pool's device in memory. A process crash loses the pool's memory but
/// not the bytes written (the page cache): reopening on the same bytes is
/// the crash.
struct Mem(Vec<u8>);

impl Device for Mem {
    fn size(&self) -> u64 {
        self.0.len() as u64
    }
    fn read_at(&mut self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let o = off as usize;
        buf.copy_from_slice(&self.0[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> std::io::Result<()> {
        let o = off as usize;
        self.0[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn crash(p: Pool<Mem>) -> Pool<Mem> {
    let mut p = Pool::open(p.into_device()).expect("reopen");
    p.check().expect("consistent after the crash");
    p
}

fn read(p: &mut Pool<Mem>, root: u64, off: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    p.read(root, off, &mut buf).expect("read");
    buf
}

const LIVE: u64 = 3;
const SNAP: u64 = 7;
const EPOCH: u32 = 5;

/// Where the process dies in the snapshot round.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// After the tagged write, before any commit.
    BeforeCommit,
    /// After the tagged write was committed.
    AfterCommit,
    /// After the reissued write, before its commit.
    AfterReissue,
    /// After the snapshot's delete, before its commit.
    AfterDelete,
}

#[test]
fn a_snapshot_given_up_across_a_crash_leaves_the_live_tree_whole() {
    let old = pattern(1, GRAIN as usize);
    let new = pattern(2, BLOCK);
    for kill in [
        Kill::BeforeCommit,
        Kill::AfterCommit,
        Kill::AfterReissue,
        Kill::AfterDelete,
    ] {
        for off in [0, 3 * BLOCK as u64, GRAIN + 5 * BLOCK as u64] {
            let mut p = Pool::format(Mem(vec![0; 16 << 20]), GRAIN, None).expect("format");
            p.ensure_root(LIVE).expect("live tree");
            p.write(LIVE, 0, &old).expect("write");
            p.write(LIVE, GRAIN, &old).expect("write");
            p.commit().expect("commit");
            // POST …/snapshots: the trees, committed before the answer.
            p.begin_snapshots(EPOCH, &[(LIVE, SNAP)]).expect("snapshot");
            p.commit().expect("commit");
            let trees = p.route(LIVE, EPOCH).expect("route");
            assert_eq!(trees, vec![LIVE, SNAP], "a write tagged E lands in both");
            p.write_trees(&trees, off, &new).expect("tagged write");
            let mut want = [old.clone(), old.clone()].concat();
            let at = off as usize;
            want[at..at + BLOCK].copy_from_slice(&new);
            assert!(read(&mut p, LIVE, 0, 2 * GRAIN as usize) == want);
            assert!(read(&mut p, SNAP, off, BLOCK) == new);
            let committed = !matches!(kill, Kill::BeforeCommit);
            if committed {
                p.commit().expect("commit");
            }
            let mut p = crash(p);
            let expect_now = if committed {
                want.clone()
            } else {
                [old.clone(), old.clone()].concat()
            };
            assert!(
                read(&mut p, LIVE, 0, 2 * GRAIN as usize) == expect_now,
                "{kill:?} at {off}: the committed state"
            );
            // The restarted target forgot the sealing snapshot: the
            // reissued write (still tagged E) goes to the live tree only.
            let trees = p.route(LIVE, EPOCH).expect("route");
            assert_eq!(trees, vec![LIVE]);
            p.write_trees(&trees, off, &new).expect("reissued write");
            if matches!(kill, Kill::AfterReissue) {
                p = crash(p);
                p.write_trees(&[LIVE], off, &new).expect("reissued again");
            }
            // The control plane gives the snapshot up and releases it.
            p.delete_root(SNAP).expect("delete the snapshot");
            if matches!(kill, Kill::AfterDelete) {
                p = crash(p);
                assert!(read(&mut p, LIVE, 0, 2 * GRAIN as usize) == want);
                p.delete_root(SNAP).expect("delete again");
            }
            p.commit().expect("commit");
            p.check().expect("consistent");
            let mut p = crash(p);
            assert!(
                read(&mut p, LIVE, 0, 2 * GRAIN as usize) == want,
                "{kill:?} at {off}: the live tree holds every write"
            );
            assert_eq!(p.roots(), vec![LIVE]);
            assert_eq!(
                p.stats().grains_allocated,
                2,
                "{kill:?} at {off}: no grain leaked"
            );
        }
    }
}
