//! NVMe/TCP framing of the queue: the common-header check, ICReq/ICResp,
//! CapsuleCmd, R2T/H2CData, C2HData and the C2HTermReq that ends a
//! connection for a protocol violation.

use super::*;

impl Queue {
    /// Checks a common header as soon as its 8 bytes are in, before the rest
    /// of the PDU is read. Returns PLEN.
    pub fn check_header(&self, raw: &[u8]) -> Result<usize, Fatal> {
        let ch = CommonHeader::decode(raw)?;
        let hd = if ch.pdu_type.has_header_digest() {
            self.dg().hdgst_len()
        } else {
            0
        };
        // Room for a header digest and alignment padding (at most 128 bytes).
        let overhead = ch.hlen as usize + hd + 128 + self.dg().ddgst_len();
        let max = match (ch.pdu_type, self.ic.is_some()) {
            (PduType::IcReq, false) => wtcp::IC_PDU_LEN,
            (_, false) => return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "PDU before ICReq")),
            (PduType::IcReq, true) => {
                return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "second ICReq"))
            }
            (PduType::CapsuleCmd, true) => overhead + self.inline_max(),
            (PduType::H2CData, true) => overhead + limits::MAXH2CDATA_BYTES as usize,
            (PduType::H2CTermReq, true) => wtcp::TERM_HLEN + wtcp::TERM_DATA_MAX,
            (_, true) => {
                return Err(fatal(
                    fes::INVALID_HEADER_FIELD,
                    0,
                    "PDU type a host may not send",
                ))
            }
        };
        if ch.plen as usize > max {
            let code = if ch.pdu_type == PduType::H2CData {
                fes::R2T_LIMIT_EXCEEDED
            } else {
                fes::INVALID_HEADER_FIELD
            };
            return Err(fatal(code, 4, "PDU longer than allowed"));
        }
        Ok(ch.plen as usize)
    }

    /// Handles one complete PDU (`pdu.len()` == PLEN, header already checked).
    /// Err: the connection must end; the C2HTermReq is already queued.
    pub fn on_pdu(&mut self, pdu: &[u8], tx: &mut Tx, ex: &mut Exec<'_>) -> Result<(), Fatal> {
        let r = self.dispatch(pdu, tx, ex);
        if let Err(f) = r {
            self.terminate(f, pdu, tx);
        }
        r
    }

    /// Ends the connection for a protocol violation found in `pdu` (whose
    /// header is quoted in the C2HTermReq).
    pub fn fail(&mut self, f: Fatal, pdu: &[u8], tx: &mut Tx) {
        self.terminate(f, pdu, tx)
    }

    pub(super) fn terminate(&mut self, f: Fatal, pdu: &[u8], tx: &mut Tx) {
        peer_warn!(peer = %self.peer, fes = f.fes, fei = f.fei, why = f.why, "protocol violation: terminating the connection");
        if self.transport == Transport::Rdma {
            // No termination PDU on RDMA: the queue pair is disconnected.
            self.end();
            return;
        }
        let hlen = pdu
            .get(2)
            .map_or(8, |&h| h as usize)
            .clamp(8, wtcp::TERM_DATA_MAX)
            .min(pdu.len());
        let mut out = [0u8; wtcp::TERM_HLEN + wtcp::TERM_DATA_MAX];
        let n = TermReq {
            fes: f.fes,
            fei: f.fei,
        }
        .encode(PduType::C2HTermReq, &pdu[..hlen], &mut out);
        tx.put(&out[..n]);
        self.end();
    }

    pub(super) fn dispatch(
        &mut self,
        pdu: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let ch = CommonHeader::decode(pdu)?;
        match ch.pdu_type {
            PduType::IcReq => return self.on_icreq(pdu, tx),
            PduType::H2CTermReq => {
                let t = TermReq::decode(pdu).ok();
                peer_info!(peer = %self.peer, fes = t.map(|t| t.fes), "host terminated the connection");
                self.end();
                return Ok(());
            }
            _ => {}
        }
        self.check_digest_flags(&ch, pdu)?;
        match ch.pdu_type {
            PduType::CapsuleCmd => self.on_capsule(&ch, pdu, tx, ex),
            PduType::H2CData => self.on_h2c_data(&ch, pdu, tx, ex),
            _ => Err(fatal(fes::INVALID_HEADER_FIELD, 0, "unexpected PDU type")),
        }
    }

    pub(super) fn check_digest_flags(&self, ch: &CommonHeader, pdu: &[u8]) -> Result<(), Fatal> {
        let hflag = ch.flags & flags::HDGSTF != 0;
        if hflag != self.dg().header {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                1,
                "HDGSTF does not match the negotiated digest",
            ));
        }
        if self.dg().header && !wtcp::header_digest_ok(pdu, ch.hlen as usize) {
            return Err(fatal(fes::HEADER_DIGEST_ERROR, 0, "header digest mismatch"));
        }
        let has_data = ch.pdo != 0;
        let dflag = ch.flags & flags::DDGSTF != 0;
        if dflag != (self.dg().data && has_data) {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                1,
                "DDGSTF does not match the negotiated digest",
            ));
        }
        Ok(())
    }

    /// The data bytes of a PDU and whether their digest matched.
    pub(super) fn pdu_data<'p>(
        &self,
        ch: &CommonHeader,
        pdu: &'p [u8],
    ) -> Result<(&'p [u8], bool), Fatal> {
        let start = wtcp::data_offset(ch, self.dg());
        let end = pdu
            .len()
            .checked_sub(self.dg().ddgst_len())
            .filter(|&e| e >= start)
            .ok_or(fatal(
                fes::INVALID_HEADER_FIELD,
                3,
                "PDO past the end of the PDU",
            ))?;
        let data = &pdu[start..end];
        let ok =
            !self.dg().data || nvpool_wire::digest::crc32c(data).to_le_bytes() == pdu[end..end + 4];
        Ok((data, ok))
    }

    pub(super) fn on_icreq(&mut self, pdu: &[u8], tx: &mut Tx) -> Result<(), Fatal> {
        let req = IcReq::decode(pdu)?;
        if req.pfv != 0 {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                8,
                "unsupported PDU format version",
            ));
        }
        if req.hpda != 0 {
            // We never pad C2H data; a host that needs alignment is refused.
            return Err(fatal(
                fes::UNSUPPORTED_PARAMETER,
                10,
                "host PDU data alignment not supported",
            ));
        }
        self.ic = Some(req.digests);
        tx.put(
            &IcResp {
                pfv: 0,
                cpda: 0,
                digests: req.digests,
                maxh2cdata: limits::MAXH2CDATA_BYTES,
            }
            .encode(),
        );
        Ok(())
    }

    pub(super) fn on_capsule(
        &mut self,
        ch: &CommonHeader,
        pdu: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let sqe = Sqe::from_slice(&pdu[wtcp::CH_LEN..wtcp::CAPSULE_CMD_HLEN])
            .expect("header length checked");
        let icd = if ch.pdo == 0 {
            if pdu.len() != wtcp::CAPSULE_CMD_HLEN + self.dg().hdgst_len() {
                return Err(fatal(
                    fes::INVALID_HEADER_FIELD,
                    4,
                    "PLEN does not match a capsule without data",
                ));
            }
            None
        } else {
            Some(self.pdu_data(ch, pdu)?)
        };
        self.accept_command(sqe, icd, tx, ex)
    }

    pub(super) fn on_h2c_data(
        &mut self,
        ch: &CommonHeader,
        pdu: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let h = DataHeader::decode(ch, pdu, self.dg())?;
        if h.datal > limits::MAXH2CDATA_BYTES {
            return Err(fatal(
                fes::R2T_LIMIT_EXCEEDED,
                16,
                "H2CData longer than MAXH2CDATA",
            ));
        }
        let si = h.ttag as usize;
        let slot = self
            .slots
            .get(si)
            .filter(|s| s.state == SlotState::AwaitData)
            .ok_or(fatal(
                fes::INVALID_HEADER_FIELD,
                10,
                "H2CData for an unknown transfer tag",
            ))?;
        if slot.sqe.cid() != h.cccid {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                8,
                "H2CData CCCID does not match its transfer tag",
            ));
        }
        if h.datao as usize != slot.got || slot.got + h.datal as usize > slot.len {
            return Err(fatal(
                fes::DATA_OUT_OF_RANGE,
                12,
                "H2CData outside the requested range",
            ));
        }
        let (data, digest_ok) = self.pdu_data(ch, pdu)?;
        let slot = &mut self.slots[si];
        let got = slot.got;
        slot.buf.as_mut_slice(got + data.len())[got..].copy_from_slice(data);
        slot.got += data.len();
        if !digest_ok {
            slot.err = Some(Status::TRANSIENT_TRANSPORT_ERROR);
            peer_warn!(peer = %self.peer, qid = ?self.qid, cid = h.cccid, "data digest mismatch in H2CData");
        }
        if slot.got == slot.len {
            match slot.err {
                Some(st) => self.finish(si, Reply::status(st), tx, ex.now_ms),
                None => self.execute(si, tx, ex),
            }
        }
        Ok(())
    }
}

pub(super) fn put_c2h_data(tx: &mut Tx, dg: Digests, cid: u16, data: &[u8], slot: u16, extra: u8) {
    let mut hdr = [0u8; wtcp::DATA_HLEN + wtcp::DIGEST_LEN];
    let n = DataHeader {
        cccid: cid,
        ttag: 0,
        datao: 0,
        datal: data.len() as u32,
    }
    .encode(PduType::C2HData, extra, dg, &mut hdr);
    tx.put(&hdr[..n]);
    tx.put_slot(data, slot);
    if dg.data {
        tx.put(&nvpool_wire::digest::crc32c(data).to_le_bytes());
    }
}
