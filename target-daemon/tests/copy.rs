//! Copy jobs between two in-process targets with file backends: the admin
//! API (`/v1/copies`), full and partial copies, hosts writing while a copy
//! runs, cancelling, the running-copier limit and bad input.
//!
//! Every test has a source target exporting an extent of one file (to hosts
//! and to the copier's host NQN) and a destination target exporting an
//! extent of another file to hosts through two subsystems; the copy job
//! refills the destination extent from the source.

mod common;

use common::*;
use nvpool_target::copier::CopyState;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// Each copied extent (four 1 MiB regions).
const EXTENT: u64 = 4 * MIB;
const REGION: u64 = MIB;
/// Where the extents sit in their files: different offsets on each side,
/// so a copy that ignored the offsets would be caught.
const SRC_OFF: u64 = MIB;
const DST_OFF: u64 = 2 * MIB;
const FILE_BYTES: u64 = 16 * MIB;
const BS: usize = 512;

const SRC_HOSTS: &str = "nqn.2026-11.io.nvpool:copytest-src-hosts";
const SRC_COPIER: &str = "nqn.2026-11.io.nvpool:copytest-src-copier";
const DST_A: &str = "nqn.2026-11.io.nvpool:copytest-dst-a";
const DST_B: &str = "nqn.2026-11.io.nvpool:copytest-dst-b";
const COPIER: &str = "nqn.2026-11.io.nvpool:copier:copytest";
/// NSID of the source extent in the copier's subsystem.
const SRC_NSID: u32 = 3;

/// A waiting test fails after this long instead of hanging.
const WAIT: Duration = Duration::from_secs(60);

struct Pair {
    /// Bytes of the copied extent.
    extent: u64,
    src: Daemon,
    dst: Daemon,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    src_path: PathBuf,
    dst_path: PathBuf,
}

fn extent_spec(path: &Path, off: u64, len: u64) -> String {
    format!("file:{},offset={off},length={len}", path.display())
}

/// Two targets: the source file filled with one pattern (its extent
/// exported to any host and to the copier), the destination file with
/// another (its extent at `DST_OFF` exported to HOST_A as NSID 1 and to
/// HOST_B as NSID 2, in two subsystems).
fn pair() -> Pair {
    pair_sized(EXTENT, EXTENT)
}

/// A pair copying `extent` bytes from a source namespace of `src_len`.
fn pair_sized(extent: u64, src_len: u64) -> Pair {
    let file_bytes = FILE_BYTES.max(DST_OFF + extent + MIB);
    let (sd, src_path) = scratch_file(file_bytes);
    let (dd, dst_path) = scratch_file(file_bytes);
    std::fs::write(&src_path, pattern(1, file_bytes as usize)).unwrap();
    std::fs::write(&dst_path, pattern(2, file_bytes as usize)).unwrap();
    let src_extent = extent_spec(&src_path, SRC_OFF, src_len);
    let dst_extent = extent_spec(&dst_path, DST_OFF, extent);
    let src = Daemon::start(&[
        subsystem(SRC_HOSTS, &[], &[(1, &src_extent)]),
        subsystem(SRC_COPIER, &[COPIER], &[(SRC_NSID, &src_extent)]),
    ]);
    let dst = Daemon::start(&[
        subsystem(DST_A, &[HOST_A], &[(1, &dst_extent)]),
        subsystem(DST_B, &[HOST_B], &[(2, &dst_extent)]),
    ]);
    Pair {
        extent,
        src,
        dst,
        _dirs: (sd, dd),
        src_path,
        dst_path,
    }
}

impl Pair {
    fn body(&self, dest: &str, rate: u64) -> Value {
        json!({
            "dest": dest,
            "source": {
                "addr": self.src.addr.to_string(),
                "subsystem_nqn": SRC_COPIER,
                "nsid": SRC_NSID,
                "host_nqn": COPIER,
            },
            "region_bytes": REGION,
            "rate_bytes_per_sec": rate,
        })
    }

    /// The request copying the source extent onto the destination extent.
    fn copy_body(&self, rate: u64) -> Value {
        self.body(&extent_spec(&self.dst_path, DST_OFF, self.extent), rate)
    }

    fn api(&self, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
        let text = body.map(|b| b.to_string());
        http(self.dst.api, method, path, text.as_deref())
    }

    #[track_caller]
    fn arm(&self, id: &str, body: &Value) -> Value {
        let r = self.api("PUT", &format!("/v1/copies/{id}"), Some(body));
        assert_eq!(r.status, 200, "arm {id}: {}", r.body);
        r.json()
    }

    #[track_caller]
    fn start(&self, id: &str, regions: Value) -> Value {
        let r = self.api(
            "POST",
            &format!("/v1/copies/{id}/start"),
            Some(&json!({ "regions": regions })),
        );
        assert_eq!(r.status, 200, "start {id}: {}", r.body);
        r.json()
    }

    #[track_caller]
    fn get(&self, id: &str) -> Value {
        let r = self.api("GET", &format!("/v1/copies/{id}"), None);
        assert_eq!(r.status, 200, "get {id}: {}", r.body);
        r.json()
    }

    /// Polls until the job leaves `running`; returns its status.
    #[track_caller]
    fn wait_finished(&self, id: &str) -> Value {
        let until = Instant::now() + WAIT;
        loop {
            let s = self.get(id);
            if s["state"] != "running" {
                return s;
            }
            assert!(Instant::now() < until, "copy {id} still running: {s}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Bytes copied so far, read in-process (cheap enough to ask per write).
    fn copied(&self, id: &str) -> u64 {
        self.dst
            .target
            .copies()
            .status(id)
            .map_or(0, |s| s.bytes_copied)
    }
}

fn read_range(path: &Path, off: u64, len: u64) -> Vec<u8> {
    let all = std::fs::read(path).unwrap();
    all[off as usize..(off + len) as usize].to_vec()
}

/// Compares without printing megabytes: the first differing byte.
#[track_caller]
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} (block {}): got {:#04x}, want {:#04x}",
            i / BS,
            got[i],
            want[i]
        );
    }
}

#[test]
fn a_copy_fills_the_destination_extent_byte_for_byte() {
    let p = pair();
    let before = std::fs::read(&p.dst_path).unwrap();
    let armed = p.arm("full", &p.copy_body(0));
    assert_eq!(armed["state"], "armed");
    assert_eq!(armed["bytes_total"], EXTENT);
    assert_eq!(armed["regions_total"], 4);
    assert_eq!(armed["bytes_copied"], 0);
    assert!(armed["armed_ms"].as_u64().unwrap() > 0);
    assert_eq!(armed["started_ms"], Value::Null);
    let started = p.start("full", Value::Null);
    assert_eq!(started["state"], "running");
    assert!(started["started_ms"].as_u64().is_some());
    let s = p.wait_finished("full");
    assert_eq!(s["state"], "done", "{s}");
    assert_eq!(s["bytes_total"], EXTENT);
    assert_eq!(s["bytes_copied"], EXTENT);
    assert_eq!(s["regions_total"], 4);
    assert_eq!(s["regions_done"], 4);
    assert_eq!(s["error"], Value::Null);
    assert!(s["finished_ms"].as_u64().unwrap() >= s["started_ms"].as_u64().unwrap());
    let src = read_range(&p.src_path, SRC_OFF, EXTENT);
    let after = std::fs::read(&p.dst_path).unwrap();
    assert_same(
        &after[DST_OFF as usize..(DST_OFF + EXTENT) as usize],
        &src,
        "destination extent",
    );
    // Nothing outside the extent moved.
    assert_same(
        &after[..DST_OFF as usize],
        &before[..DST_OFF as usize],
        "before the extent",
    );
    assert_same(
        &after[(DST_OFF + EXTENT) as usize..],
        &before[(DST_OFF + EXTENT) as usize..],
        "after the extent",
    );
    // The list shows it; DELETE forgets it.
    let list = p.api("GET", "/v1/copies", None).json();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["id"], "full");
    assert_eq!(p.api("DELETE", "/v1/copies/full", None).status, 204);
    assert_eq!(p.api("GET", "/v1/copies/full", None).status, 404);
    assert!(p.dst.target.copies().guards.idle());
}

#[test]
fn a_partial_copy_touches_only_the_selected_regions() {
    let p = pair();
    let before = read_range(&p.dst_path, DST_OFF, EXTENT);
    p.arm("partial", &p.copy_body(0));
    let started = p.start("partial", json!([3, 1, 3]));
    assert_eq!(started["bytes_total"], 2 * REGION);
    assert_eq!(started["regions_total"], 2);
    let s = p.wait_finished("partial");
    assert_eq!(s["state"], "done", "{s}");
    assert_eq!(s["bytes_copied"], 2 * REGION);
    assert_eq!(s["regions_done"], 2);
    let src = read_range(&p.src_path, SRC_OFF, EXTENT);
    let after = read_range(&p.dst_path, DST_OFF, EXTENT);
    for r in 0..4usize {
        let range = r * REGION as usize..(r + 1) * REGION as usize;
        let want = if r == 1 || r == 3 { &src } else { &before };
        assert_same(&after[range.clone()], &want[range], &format!("region {r}"));
    }
}

/// Where a host writer puts its mutations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Aim {
    /// Mostly just ahead of the copier's position (where a copier writing
    /// what it read earlier would overwrite them), a quarter anywhere;
    /// blocks are rewritten again and again.
    Churn,
    /// Each block once, in the chunk the copier works on now: a first write
    /// arriving while the copier holds that chunk's claim is only safe if it
    /// waits for the release.
    FirstWrites,
}

/// One host's writer: mirrors every mutation to the source extent and the
/// destination extent (both submitted, then both awaited), as a host does
/// for a copy in `Syncing` state. It owns the 4 KiB blocks `b` with
/// `b % writers == me`, so hosts never race each other on a block, and
/// leaves the second half of every 128 KiB chunk alone, so the copier has
/// to fill those from the source. Mutations are 4 KiB writes of distinct
/// data, and some Write Zeroes and deallocates.
struct Writer {
    me: u64,
    writers: u64,
    src: (Conn, Conn),
    dst: (Conn, Conn),
    dst_nsid: u32,
}

/// 4 KiB blocks per 128 KiB copier chunk; hosts write the first half.
const BLOCKS_PER_CHUNK: u64 = 32;

impl Writer {
    fn run(mut self, p: &Pair, id: &str, aim: Aim, stop: &AtomicBool, seed: u64) -> u64 {
        let blocks = p.extent / 4096;
        let mut written = std::collections::HashSet::new();
        let mut count = 0;
        let mut rng = nvpool_rt::random::Rng::new(seed);
        while !stop.load(Ordering::Acquire) {
            let r = rng.next_u64();
            let pos = p.copied(id) / 4096;
            let block = match aim {
                Aim::Churn if !r.is_multiple_of(4) => (pos + (r >> 8) % 160).min(blocks - 1),
                Aim::Churn => (r >> 8) % blocks,
                Aim::FirstWrites => {
                    let first = pos - pos % BLOCKS_PER_CHUNK;
                    let fresh = (first..first + BLOCKS_PER_CHUNK / 2)
                        .find(|b| b % self.writers == self.me && !written.contains(b));
                    match fresh {
                        Some(b) => b,
                        None => {
                            std::thread::yield_now();
                            continue;
                        }
                    }
                }
            };
            let block = block - block % self.writers + self.me;
            if block >= blocks || block % BLOCKS_PER_CHUNK >= BLOCKS_PER_CHUNK / 2 {
                continue;
            }
            written.insert(block);
            let lba = block * 8;
            let (s, d) = (&mut self.src.1, &mut self.dst.1);
            match (r >> 40) % 8 {
                0 => {
                    s.submit(write_zeroes_cmd(1, lba, 8));
                    d.submit(write_zeroes_cmd(self.dst_nsid, lba, 8));
                }
                1 => {
                    let ranges = dsm_ranges(&[(lba, 8)]);
                    s.submit_write(dsm_cmd(1, 1), ranges.clone(), true);
                    d.submit_write(dsm_cmd(self.dst_nsid, 1), ranges, true);
                }
                _ => {
                    let data = pattern(rng.next_u64(), 4096);
                    s.submit_write(write_cmd(1, lba, 8, false), data.clone(), true);
                    d.submit_write(write_cmd(self.dst_nsid, lba, 8, false), data, true);
                }
            }
            s.next_completion().ok();
            d.next_completion().ok();
            count += 1;
        }
        count
    }
}

/// Runs a copy while two hosts (one through each destination subsystem)
/// mirror mutations to it: arm, hosts start mirroring, then start, as the
/// control plane orders it. Checks the destination ends equal to the
/// source; returns (mutations, units marked in the guard).
fn copy_under_writes(p: &Pair, id: &str, rate: u64, aim: Aim) -> (u64, u64) {
    p.arm(id, &p.copy_body(rate));
    let stop = AtomicBool::new(false);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("writer seed {seed}");
    let writers: Vec<Writer> = [(HOST_A, DST_A, 1), (HOST_B, DST_B, 2)]
        .into_iter()
        .enumerate()
        .map(|(i, (host, dst_nqn, dst_nsid))| Writer {
            me: i as u64,
            writers: 2,
            src: controller(p.src.addr, NO_DIGESTS, SRC_HOSTS, host),
            dst: controller(p.dst.addr, NO_DIGESTS, dst_nqn, host),
            dst_nsid,
        })
        .collect();
    let (finished, writes) = std::thread::scope(|sc| {
        let handles: Vec<_> = writers
            .into_iter()
            .enumerate()
            .map(|(i, w)| {
                let stop = &stop;
                sc.spawn(move || w.run(p, id, aim, stop, seed ^ (i as u64 + 1) << 32))
            })
            .collect();
        // Hosts are mirroring; now the copier may start.
        std::thread::sleep(Duration::from_millis(50));
        p.start(id, Value::Null);
        let s = p.wait_finished(id);
        // A little more writing after the copy, then the hosts drain.
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Release);
        let writes: u64 = handles.into_iter().map(|h| h.join().expect("writer")).sum();
        (s, writes)
    });
    assert_eq!(finished["state"], "done", "{finished}");
    assert_eq!(finished["bytes_copied"], p.extent);
    let src = read_range(&p.src_path, SRC_OFF, p.extent);
    let dst = read_range(&p.dst_path, DST_OFF, p.extent);
    assert_same(&dst, &src, "destination extent after concurrent writes");
    let marked = p.dst.target.copies().host_written_units(id).unwrap();
    println!("{writes} mirrored mutations, {marked} units marked");
    assert!(marked > 0, "host writes were not recorded in the guard");
    assert!(
        marked <= p.extent / 2 / BS as u64,
        "hosts only write the first half of each 128 KiB"
    );
    (writes, marked)
}

/// Hosts rewrite blocks all over the extent, most just ahead of the
/// copier, while a throttled copy runs: without the guard in the write
/// path, the copier puts chunks it read before a host write on top of it.
#[test]
fn hosts_writing_during_a_copy_lose_nothing() {
    let p = pair();
    // About 1.3 s at 3 MiB/s: long enough for thousands of host writes.
    let (writes, _) = copy_under_writes(&p, "busy", 3 * MIB, Aim::Churn);
    assert!(writes > 100, "hosts barely wrote ({writes})");
}

/// Unthrottled, hosts write each block once inside the chunk the copier is
/// copying: first writes that arrive during the copier's claim must be
/// held until it has written that chunk.
#[test]
fn first_writes_during_the_copiers_claim_land_after_it() {
    // Enough chunks for many claims to meet a first write.
    let p = pair_sized(64 * MIB, 64 * MIB);
    copy_under_writes(&p, "race", 0, Aim::FirstWrites);
}

#[test]
fn delete_stops_a_running_copy() {
    let p = pair();
    // 256 KiB/s: the whole extent would take 16 s.
    p.arm("del", &p.copy_body(256 << 10));
    p.start("del", Value::Null);
    let until = Instant::now() + WAIT;
    while p.copied("del") == 0 {
        assert!(Instant::now() < until, "copy never progressed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.api("DELETE", "/v1/copies/del", None).status, 204);
    assert_eq!(p.api("GET", "/v1/copies/del", None).status, 404);
    assert!(p.dst.target.copies().guards.idle(), "guard disarmed");
    // Once DELETE answered, the copier writes nothing more, and its
    // thread ends.
    let frozen = read_range(&p.dst_path, DST_OFF, EXTENT);
    let until = Instant::now() + WAIT;
    while copier_threads().contains(&"copy-del".to_string()) {
        assert!(Instant::now() < until, "copier thread still alive");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_same(
        &read_range(&p.dst_path, DST_OFF, EXTENT),
        &frozen,
        "destination after DELETE",
    );
    let src = read_range(&p.src_path, SRC_OFF, EXTENT);
    assert_ne!(frozen, src, "the copy was stopped before it finished");
    // The id is free again.
    p.arm("del", &p.copy_body(0));
}

/// Thread names of this process (Linux cuts them at 15 bytes).
fn copier_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| n.starts_with("copy-"))
        .collect()
}

#[test]
fn at_most_two_copiers_run_and_a_waiting_job_starts_when_one_ends() {
    let p = pair();
    // Three destination extents in the destination file, all slow.
    let ids = ["run1", "run2", "run3"];
    for (i, id) in ids.iter().enumerate() {
        let off = DST_OFF + i as u64 * EXTENT;
        p.arm(
            id,
            &p.body(&extent_spec(&p.dst_path, off, EXTENT), 512 << 10),
        );
    }
    for id in ids {
        assert_eq!(p.start(id, Value::Null)["state"], "running");
    }
    let until = Instant::now() + WAIT;
    while p.copied("run1") == 0 || p.copied("run2") == 0 {
        assert!(
            Instant::now() < until,
            "the first two copies never progressed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The third waits with nothing copied while both others still run.
    let third = p.get("run3");
    assert_eq!(third["state"], "running");
    assert_eq!(third["bytes_copied"], 0);
    assert_eq!(p.get("run1")["state"], "running");
    assert_eq!(p.get("run2")["state"], "running");
    // A slot frees: the third starts.
    assert_eq!(p.api("DELETE", "/v1/copies/run1", None).status, 204);
    while p.copied("run3") == 0 {
        assert!(Instant::now() < until, "the waiting copy never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    for id in ["run2", "run3"] {
        assert_eq!(
            p.api("DELETE", &format!("/v1/copies/{id}"), None).status,
            204
        );
    }
}

#[test]
fn source_failures_fail_the_job_with_a_message() {
    // The source namespace is smaller than the destination extent.
    let p = pair_sized(EXTENT, 2 * MIB);
    p.arm("short", &p.copy_body(0));
    p.start("short", Value::Null);
    let s = p.wait_finished("short");
    assert_eq!(s["state"], "failed", "{s}");
    let e = s["error"].as_str().unwrap();
    assert!(e.contains("source namespace") && e.contains("bytes"), "{e}");
    assert!(s["finished_ms"].as_u64().is_some());
    // A failed job keeps its guard until DELETE.
    assert!(!p.dst.target.copies().guards.idle());
    assert_eq!(p.api("DELETE", "/v1/copies/short", None).status, 204);

    // Nobody listens at the source address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut body = p.copy_body(0);
    body["source"]["addr"] = json!(addr.to_string());
    p.arm("nosrc", &body);
    p.start("nosrc", Value::Null);
    let s = p.wait_finished("nosrc");
    assert_eq!(s["state"], "failed", "{s}");
    assert!(
        s["error"].as_str().unwrap().contains(&addr.to_string()),
        "{s}"
    );
    // The copier may not read a source that does not export to it.
    let mut body = p.copy_body(0);
    body["source"]["host_nqn"] = json!("nqn.2026-11.io.nvpool:copier:someone-else");
    p.api("DELETE", "/v1/copies/nosrc", None);
    p.arm("denied", &body);
    p.start("denied", Value::Null);
    assert_eq!(p.wait_finished("denied")["state"], "failed");
}

#[track_caller]
fn expect_error(r: &HttpResponse, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert!(v["kind"].is_string(), "{v}");
    let m = v["message"].as_str().unwrap();
    assert!(m.contains(needle), "{m:?} should mention {needle:?}");
}

#[test]
fn bad_requests_get_clear_errors() {
    let p = pair();
    let put =
        |id: &str, body: &str| http(p.dst.api, "PUT", &format!("/v1/copies/{id}"), Some(body));
    // Malformed bodies.
    expect_error(&put("x", "{not json"), 400, "");
    expect_error(&put("x", "[]"), 400, "");
    let mut extra = p.copy_body(0);
    extra["surprise"] = json!(1);
    expect_error(&put("x", &extra.to_string()), 400, "surprise");
    let mut missing = p.copy_body(0);
    missing.as_object_mut().unwrap().remove("dest");
    expect_error(&put("x", &missing.to_string()), 400, "dest");
    // Bad destinations.
    let with_dest = |d: &str| {
        let mut b = p.copy_body(0);
        b["dest"] = json!(d);
        b.to_string()
    };
    expect_error(&put("x", &with_dest("ram:16M")), 400, "file:");
    expect_error(&put("x", &with_dest("tape:/dev/st0")), 400, "dest");
    expect_error(
        &put("x", &with_dest("file:/nonexistent/disk.img")),
        422,
        "nonexistent",
    );
    let beyond = extent_spec(&p.dst_path, FILE_BYTES - MIB, 4 * MIB);
    expect_error(&put("x", &with_dest(&beyond)), 422, "past the end");
    // Bad source and region size.
    let mut b = p.copy_body(0);
    b["source"]["addr"] = json!("somewhere");
    expect_error(&put("x", &b.to_string()), 400, "source.addr");
    let mut b = p.copy_body(0);
    b["region_bytes"] = json!(1000);
    expect_error(&put("x", &b.to_string()), 400, "region_bytes");
    let mut b = p.copy_body(0);
    b["source"]["nsid"] = json!(0);
    expect_error(&put("x", &b.to_string()), 400, "nsid");
    // A bad id.
    expect_error(&put("a%20b", &p.copy_body(0).to_string()), 400, "copy id");
    assert!(p
        .api("GET", "/v1/copies", None)
        .json()
        .as_array()
        .unwrap()
        .is_empty());

    // Unknown ids.
    expect_error(&p.api("GET", "/v1/copies/nope", None), 404, "nope");
    expect_error(&p.api("DELETE", "/v1/copies/nope", None), 404, "nope");
    let start_nope = p.api(
        "POST",
        "/v1/copies/nope/start",
        Some(&json!({"regions": null})),
    );
    expect_error(&start_nope, 404, "nope");

    // Re-arming: the same body is the same job, another body a conflict.
    let body = p.copy_body(0);
    let first = p.arm("j", &body);
    assert_eq!(p.arm("j", &body), first);
    let mut other = body.clone();
    other["rate_bytes_per_sec"] = json!(1);
    expect_error(&put("j", &other.to_string()), 409, "another request");
    // Another job over the same destination bytes.
    expect_error(&put("k", &body.to_string()), 409, "overlaps");

    // Bad starts.
    let start = |id: &str, b: &str| {
        http(
            p.dst.api,
            "POST",
            &format!("/v1/copies/{id}/start"),
            Some(b),
        )
    };
    expect_error(&start("j", "{\"regions\": [4]}"), 400, "region 4");
    expect_error(&start("j", "{\"regions\": \"all\"}"), 400, "");
    expect_error(&start("j", "{\"regions\": [-1]}"), 400, "");
    assert_eq!(
        p.get("j")["state"],
        "armed",
        "refused starts change nothing"
    );
    assert_eq!(start("j", "{\"regions\": [0]}").status, 200);
    expect_error(&start("j", "{\"regions\": [0]}"), 409, "only an armed job");
    let s = p.wait_finished("j");
    assert_eq!(s["state"], "done");
    expect_error(&start("j", "{\"regions\": null}"), 409, "done");
    assert_eq!(p.api("DELETE", "/v1/copies/j", None).status, 204);
    // A DELETE of a job that was never started.
    p.arm("k", &body);
    assert_eq!(p.api("DELETE", "/v1/copies/k", None).status, 204);
    assert!(p.dst.target.copies().guards.idle());
}

/// State names on the wire are the ones the control plane expects.
#[test]
fn states_serialise_as_the_api_documents() {
    for (s, name) in [
        (CopyState::Armed, "armed"),
        (CopyState::Running, "running"),
        (CopyState::Done, "done"),
        (CopyState::Failed, "failed"),
        (CopyState::Cancelled, "cancelled"),
    ] {
        assert_eq!(serde_json::to_value(s).unwrap(), json!(name));
    }
}
