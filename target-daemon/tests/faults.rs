//! Backend faults seen from the host: EIO becomes the NVMe media status,
//! a failed write makes the namespace refuse further I/O, and namespaces
//! added with `put_namespace_backend` behave like configured ones.

mod common;

use common::*;
use nvpool_target::backend::{FaultBackend, FaultConfig, RamBackend};
use nvpool_wire::Status;
use std::sync::Arc;

fn faulty_daemon() -> (Daemon, Arc<FaultBackend>) {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let f = Arc::new(FaultBackend::new(Arc::new(RamBackend::new(4 << 20, 512))));
    d.target
        .put_namespace_backend(SUBNQN, 2, f.clone())
        .expect("fault namespace");
    (d, f)
}

#[test]
fn read_errors_are_media_errors_and_pass() {
    let (d, f) = faulty_daemon();
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(1, 4096);
    q.write(2, 8, &data, 512, false).ok();
    f.set(FaultConfig {
        fail_reads: true,
        only_at: Some(8 * 512),
        ..Default::default()
    });
    q.read(2, 8, 8, 512)
        .expect_status(Status::UNRECOVERED_READ_ERROR);
    // Other blocks, and other namespaces, still read.
    q.read_ok(2, 100, 8, 512);
    q.read_ok(1, 8, 8, 512);
    f.set(FaultConfig::default());
    assert_eq!(q.read_ok(2, 8, 8, 512), data);
}

#[test]
fn a_failed_write_fails_the_namespace_until_healed() {
    let (d, f) = faulty_daemon();
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    f.set(FaultConfig {
        fail_writes: true,
        ..Default::default()
    });
    q.write(2, 0, &pattern(2, 4096), 512, false)
        .expect_status(Status::WRITE_FAULT);
    f.set(FaultConfig::default());
    // Sticky: no pretending after a failed write.
    q.write(2, 64, &pattern(3, 4096), 512, false)
        .expect_status(Status::WRITE_FAULT);
    let r = q.read(2, 64, 8, 512);
    assert!(
        !r.status.is_success(),
        "reads of a failed backend must fail too"
    );
    let v = http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None).json();
    let ns2 = v["namespaces"]
        .as_array()
        .expect("namespaces")
        .iter()
        .find(|n| n["nsid"] == 2)
        .cloned();
    assert_eq!(ns2.map(|n| n["failed"].clone()), Some(true.into()), "{v}");
    // Namespace 1 is unaffected.
    q.write(1, 0, &pattern(4, 4096), 512, false).ok();
    f.heal();
    let data = pattern(5, 4096);
    q.write(2, 64, &data, 512, false).ok();
    assert_eq!(q.read_ok(2, 64, 8, 512), data);
}

#[test]
fn torn_write_reports_a_write_fault() {
    let (d, f) = faulty_daemon();
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let old = pattern(6, 8192);
    q.write(2, 0, &old, 512, false).ok();
    f.set(FaultConfig {
        torn_writes: true,
        ..Default::default()
    });
    q.write(2, 0, &pattern(7, 8192), 512, false)
        .expect_status(Status::WRITE_FAULT);
    f.heal();
    let got = q.read_ok(2, 0, 16, 512);
    assert_eq!(
        got[4096..],
        old[4096..],
        "the second half must not have been written"
    );
}

/// A namespace handed in by code stays when the subsystem's other settings
/// change (hosts, other namespaces).
#[test]
fn code_added_namespace_survives_other_changes() {
    let (d, _f) = faulty_daemon();
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(a.active_namespaces(0), vec![1, 2]);
    d.target.allow_host(SUBNQN, HOST_B).expect("allow B");
    assert!(
        d.target
            .subsystem(SUBNQN)
            .expect("subsystem")
            .namespaces
            .contains_key(&2),
        "allowing a host removed namespace 2 (added with put_namespace_backend)"
    );
    assert_eq!(a.active_namespaces(0), vec![1, 2]);
    q.read_ok(2, 0, 1, 512);
}
