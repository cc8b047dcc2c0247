//! A relay on loopback between the host and one in-process target that
//! reads the NVMe/TCP commands going by: what each command carries (CDW2's
//! write epoch, say), which ones are still unanswered, and, on request,
//! writes held back (not passed on) until released while everything else
//! keeps flowing.

use nvpool_wire::sqe::{admin, nvm};
use nvpool_wire::tcp::{decode_capsule_resp, CommonHeader, PduType, CH_LEN};
use nvpool_wire::Sqe;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// A command of an I/O queue as the target was sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub opcode: u8,
    pub nsid: u32,
    /// CDW2.
    pub write_epoch: u32,
}

impl Seen {
    /// A Write, Write Zeroes or Dataset Management.
    pub fn is_mutation(&self) -> bool {
        [nvm::WRITE, nvm::WRITE_ZEROES, nvm::DATASET_MANAGEMENT].contains(&self.opcode)
    }
}

#[derive(Debug)]
pub struct Tap {
    /// Where the host connects instead of the target.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Every I/O queue command, in the order the host sent them.
    seen: Vec<Seen>,
    /// Mutations tagged below this are held.
    hold_below: u32,
    /// Held PDUs and the connection each goes to.
    held: Vec<(Arc<Mutex<TcpStream>>, Vec<u8>)>,
    /// I/O commands not answered yet: (connection, CID) → the command.
    unanswered: HashMap<(u64, u16), Seen>,
    connections: u64,
}

impl Tap {
    /// Relays every connection to `target`.
    pub fn start(target: SocketAddr) -> Tap {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind the tap");
        let addr = l.local_addr().expect("tap address");
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        std::thread::spawn(move || {
            for host in l.incoming() {
                let Ok(host) = host else { return };
                let Ok(up) = TcpStream::connect(target) else {
                    continue;
                };
                let id = {
                    let mut st = s.state.lock().unwrap();
                    st.connections += 1;
                    st.connections
                };
                let _ = host.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let (h2, u2) = (host.try_clone().unwrap(), up.try_clone().unwrap());
                let up = Arc::new(Mutex::new(up));
                let (s1, s2) = (s.clone(), s.clone());
                std::thread::spawn(move || s1.to_target(id, host, up));
                std::thread::spawn(move || s2.to_host(id, u2, h2));
            }
        });
        Tap { addr, shared }
    }

    /// The I/O queue commands seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.state.lock().unwrap().seen.clone()
    }

    /// Holds every mutation tagged below `epoch` from now on (0: none).
    pub fn hold_below(&self, epoch: u32) {
        self.shared.state.lock().unwrap().hold_below = epoch;
    }

    /// Commands held now.
    pub fn held(&self) -> usize {
        self.shared.state.lock().unwrap().held.len()
    }

    /// Stops holding and passes on what was held.
    pub fn release(&self) {
        let held = {
            let mut st = self.shared.state.lock().unwrap();
            st.hold_below = 0;
            std::mem::take(&mut st.held)
        };
        for (up, pdu) in held {
            let _ = up.lock().unwrap().write_all(&pdu);
        }
    }

    /// I/O commands sent (or held) and not answered yet.
    pub fn unanswered(&self) -> Vec<Seen> {
        let st = self.shared.state.lock().unwrap();
        st.unanswered.values().copied().collect()
    }
}

/// One whole PDU from `r`, or `None` at the end of the stream.
fn read_pdu(r: &mut TcpStream) -> Option<(PduType, Vec<u8>)> {
    let mut pdu = vec![0u8; CH_LEN];
    r.read_exact(&mut pdu).ok()?;
    let ch = CommonHeader::decode(&pdu).ok()?;
    pdu.resize(ch.plen as usize, 0);
    r.read_exact(&mut pdu[CH_LEN..]).ok()?;
    Some((ch.pdu_type, pdu))
}

impl Shared {
    fn to_target(&self, conn: u64, mut host: TcpStream, up: Arc<Mutex<TcpStream>>) {
        // An admin queue's commands are not recorded (their opcodes mean
        // something else); its Connect says which queue this is.
        let mut io_queue = false;
        while let Some((t, pdu)) = read_pdu(&mut host) {
            if t == PduType::CapsuleCmd {
                let sqe = Sqe::from_slice(&pdu[CH_LEN..]).expect("a capsule holds an SQE");
                if sqe.opcode() == admin::FABRICS {
                    if sqe.fctype() == 0x01 {
                        io_queue = sqe.cdw(10) >> 16 != 0;
                    }
                } else if io_queue {
                    let seen = Seen {
                        opcode: sqe.opcode(),
                        nsid: sqe.nsid(),
                        write_epoch: sqe.write_epoch(),
                    };
                    let mut st = self.state.lock().unwrap();
                    st.seen.push(seen);
                    st.unanswered.insert((conn, sqe.cid()), seen);
                    if seen.is_mutation() && seen.write_epoch < st.hold_below {
                        st.held.push((up.clone(), pdu));
                        continue;
                    }
                }
            }
            if up.lock().unwrap().write_all(&pdu).is_err() {
                return;
            }
        }
        let _ = up.lock().unwrap().shutdown(std::net::Shutdown::Both);
    }

    fn to_host(&self, conn: u64, mut up: TcpStream, mut host: TcpStream) {
        while let Some((t, pdu)) = read_pdu(&mut up) {
            if t == PduType::CapsuleResp {
                if let Ok(cqe) = decode_capsule_resp(&pdu) {
                    // Before the host can see the answer.
                    self.state
                        .lock()
                        .unwrap()
                        .unanswered
                        .remove(&(conn, cqe.cid));
                }
            }
            if host.write_all(&pdu).is_err() {
                return;
            }
        }
        let _ = host.shutdown(std::net::Shutdown::Both);
    }
}
