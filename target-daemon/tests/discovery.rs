//! The discovery controller as `nvme discover` uses it: Connect to the
//! well-known NQN, Identify, then the log page header and entries read
//! with offsets. A host sees only the subsystems it may connect to.

mod common;

use common::*;
use nvpool_wire::identify::{cns, cntrltype};
use nvpool_wire::log::{self, adrfam, decode_discovery_header, subtype, trtype, DiscoveryEntry};
use nvpool_wire::{Status, DISCOVERY_NQN};

const DISCOVERY_LID: u8 = 0x70;

fn discovery_session(d: &Daemon, host: &str) -> Conn {
    let mut c = Conn::open_ic(d.addr, NO_DIGESTS);
    let r = c.admin_connect(DISCOVERY_NQN, host, 0);
    r.ok();
    c.enable();
    c
}

/// Reads the whole log the way libnvme does: header, entries, header again.
fn read_log(c: &mut Conn) -> (u64, Vec<DiscoveryEntry>) {
    let h = c.get_log_page(DISCOVERY_LID, 0, 0, 1024);
    h.ok();
    assert_eq!(h.data.len(), 1024);
    let (genctr, numrec) = decode_discovery_header(&h.data).expect("header");
    assert_eq!(u16::from_le_bytes([h.data[16], h.data[17]]), 0, "RECFMT");
    let mut entries = Vec::new();
    if numrec > 0 {
        let len = numrec * 1024;
        let e = c.get_log_page(DISCOVERY_LID, 0, 1024, len);
        e.ok();
        assert_eq!(e.data.len() as u64, len);
        for chunk in e.data.chunks(log::DISC_ENTRY_LEN) {
            entries.push(DiscoveryEntry::decode(chunk).expect("entry"));
        }
    }
    let again = c.get_log_page(DISCOVERY_LID, 0, 0, 1024);
    again.ok();
    assert_eq!(
        decode_discovery_header(&again.data).expect("header"),
        (genctr, numrec),
        "GENCTR must be stable"
    );
    (genctr, entries)
}

#[test]
fn discovery_log_lists_what_the_host_may_see() {
    let d = Daemon::start(&[
        subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)]),
        subsystem(OTHER_NQN, &[HOST_B], &[(1, RAM_SPEC)]),
    ]);
    let port = d.addr.port().to_string();
    let mut c = discovery_session(&d, HOST_A);

    let id = c.identify_controller();
    assert_eq!(id.cntrltype, cntrltype::DISCOVERY);
    assert_eq!(id.subnqn, DISCOVERY_NQN);
    assert_eq!(id.cntlid, c.cntlid);
    assert_ne!(id.sgls & 0x3, 0);
    // Only Identify Controller on a discovery controller.
    c.identify(cns::NAMESPACE, 1)
        .expect_status(Status::INVALID_FIELD);

    let (_, entries) = read_log(&mut c);
    assert!(
        entries
            .iter()
            .any(|e| e.subtype == subtype::CURRENT_DISCOVERY && e.subnqn == DISCOVERY_NQN),
        "the discovery subsystem describes itself: {entries:#?}"
    );
    let mine: Vec<_> = entries.iter().filter(|e| e.subnqn == SUBNQN).collect();
    assert_eq!(mine.len(), 1, "{entries:#?}");
    let e = mine[0];
    assert_eq!(e.subtype, subtype::NVM);
    assert_eq!(e.trtype, trtype::TCP);
    assert_eq!(e.adrfam, adrfam::IPV4);
    assert_eq!(e.trsvcid, port);
    assert_eq!(e.traddr, "127.0.0.1");
    assert_eq!(e.cntlid, 0xFFFF);
    assert_eq!(e.tsas, [0; 3]);
    assert!(
        !entries.iter().any(|e| e.subnqn == OTHER_NQN),
        "B's subsystem leaked to A: {entries:#?}"
    );
    assert_eq!(entries.len(), 2);

    // B sees its own subsystem and not A's.
    let mut b = discovery_session(&d, HOST_B);
    let (_, entries) = read_log(&mut b);
    assert!(entries
        .iter()
        .any(|e| e.subnqn == OTHER_NQN && e.subtype == subtype::NVM));
    assert!(!entries.iter().any(|e| e.subnqn == SUBNQN));

    // The entry is usable: connect where it points.
    let addr = format!("{}:{}", e.traddr, e.trsvcid)
        .parse()
        .expect("entry address");
    let (_a, mut q) = controller(addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
}

#[test]
fn discovery_log_offsets_and_changes() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let mut c = discovery_session(&d, HOST_A);
    let (gen1, entries) = read_log(&mut c);
    assert_eq!(entries.len(), 2);

    // The second entry alone, by offset; then a dword-aligned piece of it.
    let whole = c.get_log_page(DISCOVERY_LID, 0, 1024, 2048);
    whole.ok();
    let second = c.get_log_page(DISCOVERY_LID, 0, 2048, 1024);
    second.ok();
    assert_eq!(second.data, whole.data[1024..]);
    let piece = c.get_log_page(DISCOVERY_LID, 0, 2048 + 256, 64);
    piece.ok();
    assert_eq!(piece.data, whole.data[1024 + 256..1024 + 320]);
    // Past the end: zero-filled; misaligned offset: invalid field.
    let tail = c.get_log_page(DISCOVERY_LID, 0, 2048, 4096);
    tail.ok();
    assert_eq!(tail.data[..1024], whole.data[1024..]);
    assert!(tail.data[1024..].iter().all(|&b| b == 0));
    c.get_log_page(DISCOVERY_LID, 0, 1026, 64)
        .expect_status(Status::INVALID_FIELD);

    // A new subsystem for this host: a new GENCTR and one more entry.
    d.target
        .put_subsystem(&subsystem(OTHER_NQN, &[HOST_A], &[(1, RAM_SPEC)]))
        .expect("add");
    let (gen2, entries) = read_log(&mut c);
    assert_ne!(gen1, gen2, "GENCTR must change with the contents");
    assert_eq!(entries.len(), 3);
    assert!(entries.iter().any(|e| e.subnqn == OTHER_NQN));
}

#[test]
fn discovery_controller_refuses_io_queues() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = discovery_session(&d, HOST_A);
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.io_connect(DISCOVERY_NQN, HOST_A, c.cntlid, 1, 31)
        .expect_status(Status::CONNECT_INVALID_PARAMETERS);
}

/// A wildcard listener added at run time is advertised with the address
/// the host reached (never 0.0.0.0), and removing it takes it out again.
#[test]
fn wildcard_listener_is_advertised_with_a_real_address() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let r = http(d.api, "PUT", "/v1/listeners/0.0.0.0:0", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let listeners: Vec<std::net::SocketAddr> =
        serde_json::from_str(&r.body).expect("listener list");
    let wild = *listeners
        .iter()
        .find(|a| a.ip().is_unspecified())
        .expect("wildcard listener");
    assert_ne!(wild.port(), 0);

    let mut c = discovery_session(&d, HOST_A);
    let (gen1, entries) = read_log(&mut c);
    let on_wild: Vec<_> = entries
        .iter()
        .filter(|e| e.trsvcid == wild.port().to_string())
        .collect();
    assert!(on_wild.iter().any(|e| e.subnqn == SUBNQN), "{entries:#?}");
    for e in &on_wild {
        assert_eq!(
            e.traddr, "127.0.0.1",
            "wildcard listener advertised as {}",
            e.traddr
        );
    }
    // The advertised address works.
    let addr = format!("127.0.0.1:{}", wild.port()).parse().expect("addr");
    let (_a, mut q) = controller(addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();

    let r = http(d.api, "DELETE", &format!("/v1/listeners/{wild}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    let (gen2, entries) = read_log(&mut c);
    assert_ne!(gen1, gen2);
    assert!(
        !entries.iter().any(|e| e.trsvcid == wild.port().to_string()),
        "{entries:#?}"
    );
}

/// NVMe/RDMA listeners go through the same endpoint as `rdma:ADDR:PORT`.
/// Where RDMA is unavailable (this host: no RDMA in the kernel) adding one
/// is refused with the reason and nothing changes; a malformed one is a 400.
#[test]
fn rdma_listeners_through_the_admin_api() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let before = http(d.api, "GET", "/v1/listeners", None);
    assert_eq!(before.status, 200, "{}", before.body);
    let r = http(d.api, "PUT", "/v1/listeners/rdma:127.0.0.1:4421", None);
    match nvpool_rdma::available() {
        Err(why) => {
            assert_eq!(r.status, 409, "{}", r.body);
            assert!(r.body.contains("RDMA is unavailable"), "{}", r.body);
            assert!(r.body.contains(&why), "the reason is given: {}", r.body);
            let after = http(d.api, "GET", "/v1/listeners", None);
            assert_eq!(after.body, before.body);
        }
        // RDMA CM cannot bind the loopback address to a device.
        Ok(()) => assert_eq!(r.status, 409, "{}", r.body),
    }
    let r = http(d.api, "PUT", "/v1/listeners/infiniband:127.0.0.1:1", None);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("[rdma:]ADDR:PORT"), "{}", r.body);
    let r = http(d.api, "DELETE", "/v1/listeners/rdma:127.0.0.1:4421", None);
    assert_eq!(r.status, 404, "{}", r.body);
}
