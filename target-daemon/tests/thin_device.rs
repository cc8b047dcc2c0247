//! A grain pool offered as a device (design/thin-snapshots.md T1): a blank
//! device is formatted at probe and one holding data refused; the trees the
//! control plane exports from it serve I/O, their usage goes into the
//! heartbeat, and the admin API releases a tree only once no namespace
//! serves it, after which its space is free and the tree reads as new.
//! Snapshot trees (T5) take the writes tagged up to their epoch, a sealed
//! epoch refuses older writes across a restart too, and a rollback (T6)
//! gives a live tree its snapshot's contents under its open namespace.

mod common;

use common::*;
use nvpool_api::admin::extent_spec;
use nvpool_api::rest::DeviceUsageBody;
use nvpool_target::backend::{thin, Backend};
use nvpool_target::register::{ControlPlaneUrl, DeviceOffer, RegisterError};
use nvpool_target::{AdminOptions, Registrar, RegistrationConfig, StartOptions, Target};
use nvpool_testkit::target::{self as tk, LOOPBACK};
use nvpool_wire::Status;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const GRAIN: u64 = 64 << 10;
const MIB: u64 = 1 << 20;

fn thin_device(path: &std::path::Path) -> String {
    format!("thin:{}", path.display())
}

fn probe(id: &str, backend: &str) -> Result<DeviceOffer, RegisterError> {
    DeviceOffer::probe(id, backend, BTreeMap::new())
}

/// The probe's error with its causes, as the daemon prints it.
fn refusal(id: &str, backend: &str) -> String {
    let e = probe(id, backend).unwrap_err();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

#[test]
fn a_blank_device_is_formatted_as_a_grain_pool_and_one_holding_data_is_refused() {
    let (_dir, path) = scratch_file(64 * MIB);
    let o = probe("p0", &thin_device(&path)).unwrap();
    let pool = o.pool().expect("a grain pool is held open").clone();
    let stats = pool.stats();
    assert_eq!(pool.grain_bytes(), GRAIN, "64 KiB grains by default");
    assert_eq!(stats.grains_allocated, 0);
    assert_eq!(o.capacity_bytes, stats.grains_total * GRAIN);
    assert!(
        o.capacity_bytes > 60 * MIB && o.capacity_bytes < 64 * MIB,
        "the data grains, without the metadata: {}",
        o.capacity_bytes
    );
    // Probed again (a restart): the same pool, not formatted again.
    drop((o, pool));
    let again = probe("p0", &format!("{},grain=64K", thin_device(&path))).unwrap();
    assert_eq!(again.capacity_bytes, stats.grains_total * GRAIN);
    let e = refusal("p0", &format!("{},grain=16K", thin_device(&path)));
    assert!(e.contains("formatted with 64K grains"), "{e}");

    let (_dir, small) = scratch_file(16 * MIB);
    let o = probe("p1", &format!("{},grain=16K", thin_device(&small))).unwrap();
    assert_eq!(o.pool().unwrap().grain_bytes(), 16 << 10);

    let (_dir, used) = scratch_file(16 * MIB);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&used)
        .unwrap()
        .write_all_at(b"a filesystem label", 1024)
        .unwrap();
    let text = refusal("p2", &thin_device(&used));
    assert!(
        text.contains("not a grain pool")
            && text.contains("not blank")
            && text.contains("will not format over data"),
        "{text}"
    );
    let mut label = [0u8; 18];
    std::fs::File::open(&used)
        .unwrap()
        .read_exact_at(&mut label, 1024)
        .unwrap();
    assert_eq!(&label, b"a filesystem label", "nothing was written");
}

/// A target serving its admin API with `devices` offered.
fn start(devices: Vec<DeviceOffer>) -> (tk::Serving, std::sync::Arc<Target>) {
    let target = Target::new(None).unwrap();
    target.put_subsystem(&subsystem(SUBNQN, &[], &[])).unwrap();
    let opts = StartOptions {
        admin: Some(AdminOptions {
            devices,
            ..tk::admin(LOOPBACK, test_tokens())
        }),
        ..tk::loopback()
    };
    (tk::start(&target, &opts), target)
}

fn assert_error(r: &HttpResponse, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["kind"], kind, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

fn release(api: SocketAddr, device: &str, roots: &[u64]) -> HttpResponse {
    let body = serde_json::json!({ "roots": roots }).to_string();
    http(
        api,
        "POST",
        &format!("/v1/devices/{device}/release"),
        Some(&body),
    )
}

fn export(api: SocketAddr, spec: &str) {
    let body = serde_json::json!({ "backend": spec }).to_string();
    let r = http(
        api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/namespaces/1"),
        Some(&body),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_tree_serves_io_counts_in_the_heartbeat_and_is_released_once_unexported() {
    let (_dir, path) = scratch_file(64 * MIB);
    let (_fdir, plain) = scratch_file(8 * MIB);
    let pool_dev = probe("p0", &thin_device(&path)).unwrap();
    let plain_dev = probe("f0", &file_spec(&plain)).unwrap();
    assert!(plain_dev.pool().is_none());
    let pool = pool_dev.pool().unwrap().clone();
    let (serving, _target) = start(vec![pool_dev.clone(), plain_dev.clone()]);
    let api = serving.admin_addr();

    // The extent at 3 MiB of the pool's virtual space, 16 MiB long: tree 3.
    let spec = extent_spec(&pool_dev.backend, 3 * MIB, 16 * MIB);
    assert!(spec.ends_with(",root=3,size=16777216"), "{spec}");
    export(api, &spec);
    let (a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(5, 2 * GRAIN as usize);
    q.write(1, 0, &data, 4096, false).ok();
    q.flush(1).ok();
    assert_eq!(pool.used_bytes(), 2 * GRAIN, "two grains written");

    // What the registrar sends with every heartbeat.
    let url = ControlPlaneUrl::parse("http://127.0.0.1:9").unwrap();
    let mut cfg = RegistrationConfig::new(url, "t".into(), "t".into(), serving.addr, api);
    cfg.devices = vec![pool_dev.clone(), plain_dev.clone()];
    assert_eq!(
        cfg.heartbeat_body().devices,
        [DeviceUsageBody {
            id: "p0".into(),
            used_bytes: 2 * GRAIN
        }],
        "grain pools only"
    );

    let r = release(api, "p0", &[7, 3]);
    assert_error(&r, 409, "in_use");
    assert!(r.body.contains("tree 3"), "{}", r.body);
    assert_eq!(pool.used_bytes(), 2 * GRAIN, "nothing dropped");
    assert_eq!(q.read_ok(1, 0, 32, 4096), data);
    assert_error(&release(api, "f0", &[3]), 409, "not_grain_pool");
    assert_error(&release(api, "nope", &[3]), 404, "not_found");

    drop((a, q));
    let r = http(
        api,
        "DELETE",
        &format!("/v1/subsystems/{SUBNQN}/namespaces/1"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    // A command in flight may hold the namespace a moment longer.
    let mut answer = None;
    wait_for("the namespace to be closed", Duration::from_secs(5), || {
        let r = release(api, "p0", &[3, 99]);
        let done = r.status != 409;
        answer = Some(r);
        done
    });
    let r = answer.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), serde_json::json!({"roots": [3]}), "99 never was");
    assert_eq!(pool.used_bytes(), 0, "the tree's grains are free");
    let r = release(api, "p0", &[3]);
    assert_eq!(
        r.json(),
        serde_json::json!({"roots": []}),
        "released already"
    );

    // The same extent placed again is a new, empty tree.
    export(api, &spec);
    let (_a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert!(q.read_ok(1, 0, 32, 4096).iter().all(|&b| b == 0));
}

/// Requests a fake control plane received: request line and body.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// A control plane that answers every request `200 {}` and keeps what it
/// was sent, so a test sees the heartbeat's body as it went over the wire.
fn fake_control_plane() -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let keep = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let keep = keep.clone();
            std::thread::spawn(move || {
                let mut out = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut len = 0;
                    loop {
                        let mut h = String::new();
                        r.read_line(&mut h).unwrap();
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                len = v.trim().parse().unwrap();
                            }
                        }
                    }
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    let body = String::from_utf8(body).unwrap();
                    keep.lock()
                        .unwrap()
                        .push((line.trim_end().to_owned(), body));
                    out.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
                    )
                    .unwrap();
                }
            });
        }
    });
    (addr, seen)
}

#[test]
fn the_heartbeat_reports_each_grain_pools_used_bytes() {
    let (_dir, path) = scratch_file(32 * MIB);
    let (_fdir, plain) = scratch_file(8 * MIB);
    let pool_dev = probe("p0", &thin_device(&path)).unwrap();
    let tree = thin::open(path.to_str().unwrap(), 1, 16 * MIB).unwrap();
    tree.write_at(&pattern(1, 3 * GRAIN as usize), 0, true)
        .unwrap();
    let (cp, seen) = fake_control_plane();
    let url = ControlPlaneUrl::parse(&format!("http://{cp}")).unwrap();
    let a: SocketAddr = "127.0.0.1:4420".parse().unwrap();
    let mut cfg = RegistrationConfig::new(url, "t-hb".into(), "t-hb".into(), a, a);
    cfg.devices = vec![pool_dev, probe("f0", &file_spec(&plain)).unwrap()];
    cfg.heartbeat_interval = Duration::from_millis(50);
    let r = Registrar::start(cfg).unwrap();
    let heartbeat = || {
        seen.lock()
            .unwrap()
            .iter()
            .find(|(line, _)| line.starts_with("PUT /v1/targets/t-hb/heartbeat "))
            .map(|(_, body)| body.clone())
    };
    wait_for("a heartbeat", Duration::from_secs(10), || {
        heartbeat().is_some()
    });
    r.stop();
    let body: serde_json::Value = serde_json::from_str(&heartbeat().unwrap()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"devices": [{"id": "p0", "used_bytes": 3 * GRAIN}]}),
        "grain pools only, their allocated grains"
    );
}

fn post(api: SocketAddr, device: &str, what: &str, body: &serde_json::Value) -> HttpResponse {
    let body = body.to_string();
    http(
        api,
        "POST",
        &format!("/v1/devices/{device}/{what}"),
        Some(&body),
    )
}

/// A Write of 4 KiB blocks at `slba` of namespace 1 with the write epoch
/// `epoch` in CDW2, as nvpool's engines send it.
fn write_tagged(q: &mut Conn, epoch: u32, slba: u64, data: &[u8]) -> Completion {
    let mut sqe = write_cmd(1, slba, (data.len() / 4096) as u32, false);
    sqe.set_write_epoch(epoch);
    q.exec_write(sqe, data.to_vec(), false)
}

#[test]
fn a_snapshot_takes_the_writes_tagged_up_to_its_epoch_until_sealed_then_refuses_them() {
    let (_dir, path) = scratch_file(64 * MIB);
    let (_fdir, plain) = scratch_file(8 * MIB);
    let pool_dev = probe("p0", &thin_device(&path)).unwrap();
    let (serving, _target) = start(vec![
        pool_dev.clone(),
        probe("f0", &file_spec(&plain)).unwrap(),
    ]);
    let api = serving.admin_addr();
    // The live tree: the extent at 3 MiB, tree 3.
    export(api, &extent_spec(&pool_dev.backend, 3 * MIB, 16 * MIB));
    let (_a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let block = |seed: u64| pattern(seed, 4096);
    for (slba, tag) in [(0, 1), (1, 2), (2, 3), (3, 4)] {
        write_tagged(&mut q, 1, slba, &block(tag)).ok();
    }

    let begin = serde_json::json!({"epoch": 1, "trees": [{"live": 3, "snapshot": 1000}]});
    let r = post(api, "p0", "snapshots", &begin);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), begin, "the request echoed");
    let r = post(api, "p0", "snapshots", &begin);
    assert_eq!(r.status, 200, "a retry while it seals: {}", r.body);

    // Tagged up to the cut: both trees; above it: the live tree only.
    write_tagged(&mut q, 1, 1, &block(12)).ok();
    write_tagged(&mut q, 2, 2, &block(13)).ok();
    let mut zeroes = write_zeroes_cmd(1, 3, 1);
    zeroes.set_write_epoch(1);
    q.exec(zeroes).ok();

    let seal = serde_json::json!({"snapshots": [1000]});
    let r = post(api, "p0", "seal", &seal);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), seal);
    assert_eq!(post(api, "p0", "seal", &seal).status, 200, "a retry");

    // Sealed: only a fenced writer still sends epoch 1.
    write_tagged(&mut q, 1, 0, &block(21)).expect_status(Status::RESERVATION_CONFLICT);
    let mut dsm = dsm_cmd(1, 1);
    dsm.set_write_epoch(1);
    q.exec_write(dsm, dsm_ranges(&[(0, 1)]), false)
        .expect_status(Status::RESERVATION_CONFLICT);
    write_tagged(&mut q, 0, 0, &block(22)).ok();
    write_tagged(&mut q, 2, 1, &block(23)).ok();
    assert_eq!(
        q.read_ok(1, 0, 4, 4096),
        [block(22), block(23), block(13), vec![0; 4096]].concat()
    );

    // Refusals, with the error body of every route.
    let tree = |epoch: u32, live: u64, snapshot: u64| serde_json::json!({"epoch": epoch, "trees": [{"live": live, "snapshot": snapshot}]});
    let snapshots = |body| post(api, "p0", "snapshots", &body);
    assert_error(&snapshots(tree(2, 3, 1000)), 409, "tree_exists");
    assert_error(&snapshots(tree(2, 3, 3)), 409, "tree_exists");
    assert_error(&snapshots(tree(0, 77, 1001)), 404, "unknown_tree");
    assert_error(&snapshots(tree(1, 3, 1001)), 409, "epoch_sealed");
    assert_error(&snapshots(tree(2, 3, 1 << 32)), 400, "invalid");
    assert_error(
        &snapshots(serde_json::json!({"epoch": 2, "trees": [{"live": 3}]})),
        400,
        "invalid",
    );
    assert_error(
        &post(api, "f0", "snapshots", &tree(2, 3, 1001)),
        409,
        "not_grain_pool",
    );
    assert_error(
        &post(api, "nope", "snapshots", &tree(2, 3, 1001)),
        404,
        "not_found",
    );
    let seal = |ids: &[u64]| serde_json::json!({ "snapshots": ids });
    assert_error(&post(api, "p0", "seal", &seal(&[1001])), 409, "not_sealing");
    assert_error(
        &post(api, "f0", "seal", &seal(&[1000])),
        409,
        "not_grain_pool",
    );
    assert_error(&post(api, "nope", "seal", &seal(&[1000])), 404, "not_found");

    // Releasing a sealing snapshot forgets its boundary.
    assert_eq!(snapshots(tree(5, 3, 1002)).status, 200);
    let r = release(api, "p0", &[1002]);
    assert_eq!(r.json(), serde_json::json!({"roots": [1002]}), "{}", r.body);
    assert_error(&post(api, "p0", "seal", &seal(&[1002])), 409, "not_sealing");
    write_tagged(&mut q, 5, 0, &block(24)).ok();

    // A clone of the snapshot: complete at once.
    assert_eq!(snapshots(tree(0, 1000, 2000)).status, 200);
    assert_error(&snapshots(tree(0, 1000, 2000)), 409, "tree_exists");

    // The snapshot and the clone, exported, read what was cut.
    let want = [block(1), block(12), block(3), vec![0; 4096]].concat();
    for (nsid, root) in [(2, 1000), (3, 2000)] {
        let spec = format!("{},root={root},size={}", pool_dev.backend, 16 * MIB);
        let body = serde_json::json!({ "backend": spec }).to_string();
        let path = format!("/v1/subsystems/{SUBNQN}/namespaces/{nsid}");
        let r = http(api, "PUT", &path, Some(&body));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let (_a2, mut q2) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(q2.read_ok(2, 0, 4, 4096), want, "the snapshot");
    assert_eq!(q2.read_ok(3, 0, 4, 4096), want, "the clone");
}

/// `{"trees": [{"live": L, "snapshot": S}, …]}`, the body of `…/rollback`.
fn rollback_body(trees: &[(u64, u64)]) -> serde_json::Value {
    let trees: Vec<_> = trees
        .iter()
        .map(|&(live, snapshot)| serde_json::json!({"live": live, "snapshot": snapshot}))
        .collect();
    serde_json::json!({ "trees": trees })
}

#[test]
fn a_rollback_gives_the_live_tree_the_snapshots_contents_under_its_open_namespace() {
    let (_dir, path) = scratch_file(64 * MIB);
    let (_fdir, plain) = scratch_file(8 * MIB);
    let pool_dev = probe("p0", &thin_device(&path)).unwrap();
    let pool = pool_dev.pool().unwrap().clone();
    let (serving, _target) = start(vec![
        pool_dev.clone(),
        probe("f0", &file_spec(&plain)).unwrap(),
    ]);
    let api = serving.admin_addr();
    export(api, &extent_spec(&pool_dev.backend, 3 * MIB, 16 * MIB));
    let (_a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let a = pattern(1, 4 * 4096);
    let b = pattern(2, 4 * 4096);

    // A, a snapshot of it at epoch 1, then B over it at epoch 2.
    write_tagged(&mut q, 1, 0, &a).ok();
    let begin = serde_json::json!({"epoch": 1, "trees": [{"live": 3, "snapshot": 1000}]});
    assert_eq!(post(api, "p0", "snapshots", &begin).status, 200);
    let seal = serde_json::json!({"snapshots": [1000]});
    assert_eq!(post(api, "p0", "seal", &seal).status, 200);
    assert_eq!(pool.used_bytes(), GRAIN, "one grain, both trees");
    write_tagged(&mut q, 2, 0, &b).ok();
    q.flush(1).ok();
    assert_eq!(q.read_ok(1, 0, 4, 4096), b);
    assert_eq!(pool.used_bytes(), 2 * GRAIN, "the live tree's own copy");

    // Refusals change nothing.
    let rollback = |trees: &[(u64, u64)]| post(api, "p0", "rollback", &rollback_body(trees));
    assert_error(&rollback(&[(3, 1000), (4, 999)]), 404, "unknown_tree");
    assert_error(&rollback(&[(3, 1000), (1 << 32, 1000)]), 400, "invalid");
    assert_error(
        &post(
            api,
            "p0",
            "rollback",
            &serde_json::json!({"trees": [{"live": 3}]}),
        ),
        400,
        "invalid",
    );
    assert_error(
        &post(api, "f0", "rollback", &rollback_body(&[(3, 1000)])),
        409,
        "not_grain_pool",
    );
    assert_error(
        &post(api, "nope", "rollback", &rollback_body(&[(3, 1000)])),
        404,
        "not_found",
    );
    let sealing = serde_json::json!({"epoch": 5, "trees": [{"live": 3, "snapshot": 1001}]});
    assert_eq!(post(api, "p0", "snapshots", &sealing).status, 200);
    assert_error(&rollback(&[(3, 1000)]), 409, "sealing");
    assert_eq!(release(api, "p0", &[1001]).status, 200, "given up");
    assert_eq!(q.read_ok(1, 0, 4, 4096), b, "nothing rolled back");
    assert_eq!(pool.used_bytes(), 2 * GRAIN);

    // The namespace stays open across the rollback and reads A from the
    // next command on; the live tree's own grain is free again.
    let body = rollback_body(&[(3, 1000), (9, 1000)]);
    let r = post(api, "p0", "rollback", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), body, "the request echoed");
    assert_eq!(q.read_ok(1, 0, 4, 4096), a);
    assert_eq!(pool.used_bytes(), GRAIN, "committed: its grain is free");
    let r = post(api, "p0", "rollback", &body);
    assert_eq!(r.status, 200, "a retry: {}", r.body);
    assert_eq!(q.read_ok(1, 0, 4, 4096), a);
    assert_eq!(pool.used_bytes(), GRAIN);

    // The floor stays; writes after it go to the live tree only.
    write_tagged(&mut q, 1, 0, &b[..4096]).expect_status(Status::RESERVATION_CONFLICT);
    write_tagged(&mut q, 2, 1, &b[..4096]).ok();
    assert_eq!(
        q.read_ok(1, 0, 4, 4096),
        [&a[..4096], &b[..4096], &a[2 * 4096..]].concat()
    );
    let spec = format!("{},root=1000,size={}", pool_dev.backend, 16 * MIB);
    let body = serde_json::json!({ "backend": spec }).to_string();
    let r = http(
        api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/namespaces/2"),
        Some(&body),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let (_a2, mut q2) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(q2.read_ok(2, 0, 4, 4096), a, "the snapshot is unchanged");
    // The live tree the request named and the pool did not hold was made.
    let r = release(api, "p0", &[9]);
    assert_eq!(r.json(), serde_json::json!({"roots": [9]}), "{}", r.body);
}

#[test]
fn the_sealed_floor_survives_a_restart_of_the_target() {
    let (_dir, path) = scratch_file(64 * MIB);
    let spec = {
        let pool_dev = probe("p0", &thin_device(&path)).unwrap();
        let weak = Arc::downgrade(pool_dev.pool().unwrap());
        let (serving, target) = start(vec![pool_dev.clone()]);
        let api = serving.admin_addr();
        let spec = extent_spec(&pool_dev.backend, 3 * MIB, 16 * MIB);
        export(api, &spec);
        let (a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
        write_tagged(&mut q, 1, 0, &pattern(1, 4096)).ok();
        let begin = serde_json::json!({"epoch": 2, "trees": [{"live": 3, "snapshot": 1000}]});
        assert_eq!(post(api, "p0", "snapshots", &begin).status, 200);
        let seal = serde_json::json!({"snapshots": [1000]});
        assert_eq!(post(api, "p0", "seal", &seal).status, 200);
        // Still sealing at the restart.
        let begin = serde_json::json!({"epoch": 4, "trees": [{"live": 3, "snapshot": 1001}]});
        assert_eq!(post(api, "p0", "snapshots", &begin).status, 200);
        write_tagged(&mut q, 2, 0, &pattern(2, 4096)).expect_status(Status::RESERVATION_CONFLICT);
        drop((a, q, serving, target, pool_dev));
        // The pool is closed, so the next probe opens it from the device.
        wait_for("the grain pool to close", Duration::from_secs(5), || {
            weak.upgrade().is_none()
        });
        spec
    };

    let pool_dev = probe("p0", &thin_device(&path)).unwrap();
    let (serving, _target) = start(vec![pool_dev.clone()]);
    let api = serving.admin_addr();
    export(api, &spec);
    let (_a, mut q) = controller(serving.addr, NO_DIGESTS, SUBNQN, HOST_A);
    // A stale engine's writes at or below the sealed epoch, refused.
    for tag in [1, 2] {
        write_tagged(&mut q, tag, 0, &pattern(3, 4096)).expect_status(Status::RESERVATION_CONFLICT);
    }
    write_tagged(&mut q, 3, 1, &pattern(4, 4096)).ok();
    write_tagged(&mut q, 0, 2, &pattern(5, 4096)).ok();
    assert_eq!(
        q.read_ok(1, 0, 3, 4096),
        [pattern(1, 4096), pattern(4, 4096), pattern(5, 4096)].concat()
    );
    let begin = serde_json::json!({"epoch": 2, "trees": [{"live": 3, "snapshot": 1002}]});
    assert_error(&post(api, "p0", "snapshots", &begin), 409, "epoch_sealed");
    // What was sealing is forgotten: the control plane gives it up.
    let seal = serde_json::json!({"snapshots": [1001]});
    assert_error(&post(api, "p0", "seal", &seal), 409, "not_sealing");
}
