//! In-band authentication (DH-HMAC-CHAP) of a queue.

use super::*;

impl Queue {
    /// Commands other than authentication may run: the host needs no
    /// authentication here, or this queue passed it.
    pub(super) fn auth_ok(&self) -> bool {
        self.auth.as_ref().is_none_or(CtrlAuth::authenticated)
    }

    /// Starts DH-HMAC-CHAP on a queue just connected when its host has
    /// keys; returns the AUTHREQ bits of the Connect response (ATR).
    pub(super) fn require_auth(&mut self, subsys: &Subsystem, hostnqn: &str) -> u32 {
        match subsys.host_keys.get(hostnqn) {
            Some(a) => {
                self.auth = Some(CtrlAuth::new(a.policy.clone(), hostnqn, &subsys.nqn));
                AUTHREQ_ATR
            }
            None => 0,
        }
    }

    /// Runs an Authentication Send or Receive (admitted: SECP, SPSP and
    /// length checked). A message the exchange rejects still completes
    /// the Send; the next Receive carries AUTH_Failure1.
    pub(super) fn authenticate(&mut self, si: usize) -> Reply {
        let Some(auth) = self.auth.as_mut() else {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        };
        let was = auth.authenticated();
        let slot = &mut self.slots[si];
        let reply = if slot.sqe.fctype() == fctype::AUTH_SEND {
            // A new exchange (a re-authentication of a live queue) checks
            // the host's keys as the subsystem holds them now, so that
            // rotated keys take effect without a reconnect.
            if let Some(ctrl) = &self.ctrl {
                if let Some(a) = ctrl.subsystem().host_keys.get(&ctrl.hostnqn) {
                    auth.renew_policy(a.policy.clone());
                }
            }
            auth.on_send(slot.buf.as_slice(slot.len));
            Reply::ok()
        } else {
            let mut random = zeroize::Zeroizing::new([0u8; RANDOM_BYTES]);
            if nvpool_rt::random::fill(&mut random[..]).is_err() {
                peer_error!(peer = %self.peer, "no random bytes for authentication");
                return Reply::status(Status::INTERNAL_ERROR);
            }
            let msg = auth.on_receive(&random);
            // Exactly AL bytes: the message, then zeros (the Linux host
            // always asks for 4096).
            let al = slot.len;
            let out = slot.buf.as_mut_slice(al);
            out.fill(0);
            let n = msg.len().min(al);
            out[..n].copy_from_slice(&msg[..n]);
            Reply::data(al)
        };
        let (now, failed) = (auth.authenticated(), auth.failed());
        let ctrl = self.ctrl.as_ref().map(|c| (c.cntlid, c.hostnqn.as_str()));
        if now && !was {
            peer_info!(peer = %self.peer, ctrl = ?ctrl, qid = ?self.qid, "queue authenticated (DH-HMAC-CHAP)");
        } else if failed && slot.sqe.fctype() == fctype::AUTH_RECEIVE {
            peer_warn!(peer = %self.peer, ctrl = ?ctrl, qid = ?self.qid, "DH-HMAC-CHAP authentication failed");
        }
        reply
    }
}

/// Connect response DW0 bit 17, ATR: the queue must authenticate.
pub const AUTHREQ_ATR: u32 = 1 << 17;

/// Authentication Send or Receive.
pub(super) fn is_auth_cmd(sqe: &Sqe) -> bool {
    sqe.opcode() == aop::FABRICS && matches!(sqe.fctype(), fctype::AUTH_SEND | fctype::AUTH_RECEIVE)
}
