//! Discovery through the initiator: the log lists exactly the subsystems
//! the asking host may use, on the listener it asked.

mod common;

use common::*;
use nvpool_initiator::discover::discover;
use nvpool_initiator::hostnqn::parse_uuid;
use nvpool_wire::log::{subtype, trtype, DiscoveryEntry};
use std::collections::BTreeSet;
use std::time::Duration;

fn ask(t: &Tgt, host: &str) -> Vec<DiscoveryEntry> {
    let id = parse_uuid(host.rsplit_once(":uuid:").expect("uuid").1).expect("uuid");
    discover(t.addr, host, id, Duration::from_secs(5)).expect("discover")
}

fn nvm_subsystems(entries: &[DiscoveryEntry]) -> BTreeSet<String> {
    entries
        .iter()
        .filter(|e| e.subtype == subtype::NVM)
        .map(|e| e.subnqn.clone())
        .collect()
}

#[test]
fn lists_exactly_what_the_host_may_see() {
    let t = Tgt::start(&[
        subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)]),
        subsystem(OTHER_NQN, &[], &[(1, "ram:1M")]),
        subsystem(THIRD_NQN, &[HOST_B], &[(1, "ram:1M")]),
    ]);

    let a = ask(&t, HOST_A);
    assert_eq!(
        nvm_subsystems(&a),
        BTreeSet::from([SUBNQN.to_owned(), OTHER_NQN.to_owned()]),
        "host A: {a:#?}"
    );
    let b = ask(&t, HOST_B);
    assert_eq!(
        nvm_subsystems(&b),
        BTreeSet::from([OTHER_NQN.to_owned(), THIRD_NQN.to_owned()]),
        "host B: {b:#?}"
    );
    let stranger = "nqn.2014-08.org.nvmexpress:uuid:cccccccc-1111-4000-8000-00000000000c";
    assert_eq!(
        nvm_subsystems(&ask(&t, stranger)),
        BTreeSet::from([OTHER_NQN.to_owned()]),
        "a host in no ACL sees only the open subsystem"
    );

    // Every record names this listener, over TCP, with no duplicates; the
    // discovery subsystem itself is listed too.
    for e in &a {
        assert_eq!(e.trtype, trtype::TCP, "{e:?}");
        assert_eq!(e.traddr, "127.0.0.1", "{e:?}");
        assert_eq!(e.trsvcid, t.addr.port().to_string(), "{e:?}");
    }
    assert_eq!(
        a.iter()
            .filter(|e| e.subtype == subtype::CURRENT_DISCOVERY)
            .map(|e| e.subnqn.as_str())
            .collect::<Vec<_>>(),
        vec![nvpool_wire::DISCOVERY_NQN],
        "one current discovery record: {a:#?}"
    );
    assert_eq!(a.len(), 3, "{a:#?}");

    // Changing the ACL changes the next answer.
    t.target.allow_host(THIRD_NQN, HOST_A).expect("allow host");
    t.target.remove_subsystem(OTHER_NQN).expect("remove");
    assert_eq!(
        nvm_subsystems(&ask(&t, HOST_A)),
        BTreeSet::from([SUBNQN.to_owned(), THIRD_NQN.to_owned()])
    );
    // Discovery leaves no controller behind.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        t.target.controllers().iter().all(|c| !c.discovery),
        "discovery controllers are shut down after reading the log"
    );
}

#[test]
fn discovery_of_a_target_with_nothing_to_offer() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[HOST_B], &[(1, RAM_SPEC)])]);
    let a = ask(&t, HOST_A);
    assert!(nvm_subsystems(&a).is_empty(), "{a:#?}");
}

#[test]
fn discovery_of_nothing_listening_fails() {
    let t = Tgt::start(&[]);
    let addr = t.addr;
    t.stop();
    let id = parse_uuid("aaaaaaaa-1111-4000-8000-00000000000a").expect("uuid");
    let e = discover(addr, HOST_A, id, Duration::from_secs(2)).expect_err("nothing there");
    assert!(e.is_transport(), "{e:?}");
}
