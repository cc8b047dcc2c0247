//! Discovery: read a discovery controller's log of subsystems.

use crate::admin::{ConnectParams, Controller, Transport};
use crate::error::Error;
use nvpool_wire::log::{
    self, decode_discovery_header, DiscoveryEntry, DISC_ENTRY_LEN, DISC_HEADER_LEN,
};
use std::net::SocketAddr;
use std::time::Duration;

/// Reads the discovery log of the discovery controller at `addr` as host
/// `hostnqn`. Rereads when the generation counter changes mid-read, as
/// nvme-cli does.
pub fn discover(
    addr: SocketAddr,
    hostnqn: &str,
    hostid: [u8; 16],
    timeout: Duration,
) -> Result<Vec<DiscoveryEntry>, Error> {
    discover_over(Transport::Tcp, addr, hostnqn, hostid, timeout)
}

/// [`discover`] over `transport`.
pub fn discover_over(
    transport: Transport,
    addr: SocketAddr,
    hostnqn: &str,
    hostid: [u8; 16],
    timeout: Duration,
) -> Result<Vec<DiscoveryEntry>, Error> {
    let mut p = ConnectParams::new(addr, nvpool_wire::DISCOVERY_NQN);
    p.transport = transport;
    p.hostnqn = hostnqn.to_owned();
    p.hostid = hostid;
    p.kato = Duration::ZERO;
    p.io_queues = 0;
    p.connect_timeout = timeout;
    p.ctrl_loss_timeout = Duration::ZERO;
    let ctrl = Controller::connect(p)?;
    let r = read_log(&ctrl);
    ctrl.shutdown();
    r
}

fn read_log(ctrl: &Controller) -> Result<Vec<DiscoveryEntry>, Error> {
    for _ in 0..10 {
        let head = ctrl.log_page(log::lid::DISCOVERY, 0, 0, DISC_HEADER_LEN)?;
        let (gen, numrec) =
            decode_discovery_header(&head).map_err(|e| Error::Invalid(e.to_string()))?;
        if numrec > 4096 {
            return Err(Error::Invalid(format!(
                "discovery log claims {numrec} records"
            )));
        }
        let body = ctrl.log_page(
            log::lid::DISCOVERY,
            0,
            DISC_HEADER_LEN as u64,
            numrec as usize * DISC_ENTRY_LEN,
        )?;
        let again = ctrl.log_page(log::lid::DISCOVERY, 0, 0, DISC_HEADER_LEN)?;
        let (gen2, _) =
            decode_discovery_header(&again).map_err(|e| Error::Invalid(e.to_string()))?;
        if gen2 != gen {
            continue;
        }
        return body
            .chunks_exact(DISC_ENTRY_LEN)
            .map(|c| DiscoveryEntry::decode(c).map_err(|e| Error::Invalid(e.to_string())))
            .collect();
    }
    Err(Error::Invalid(
        "discovery log kept changing while being read".into(),
    ))
}
