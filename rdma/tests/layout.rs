//! The hand-written ABI in `ffi.rs` against the installed rdma-core headers:
//! a C probe prints offsets and sizes, Rust compares them with its own.
//! Needs a C compiler and libibverbs-dev/librdmacm-dev (installed by
//! scripts/setup-deps); without them it says so, and fails under CI=true.

use nvpool_rdma::ffi::*;
use std::mem::{offset_of, size_of};
use std::process::Command;

const PROBE: &str = r#"
#include <stdio.h>
#include <stddef.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#define O(s, f) printf(#s "." #f " %zu\n", offsetof(struct s, f))
#define S(s) printf(#s " %zu\n", sizeof(struct s))
#define C(n) printf(#n " %d\n", (int)(n))
int main(void) {
    S(ibv_send_wr); O(ibv_send_wr, wr_id); O(ibv_send_wr, next); O(ibv_send_wr, sg_list);
    O(ibv_send_wr, num_sge); O(ibv_send_wr, opcode); O(ibv_send_wr, send_flags);
    O(ibv_send_wr, invalidate_rkey); O(ibv_send_wr, wr.rdma.remote_addr); O(ibv_send_wr, wr.rdma.rkey);
    S(ibv_recv_wr); O(ibv_recv_wr, sg_list); O(ibv_recv_wr, num_sge);
    S(ibv_sge); S(ibv_wc); O(ibv_wc, status); O(ibv_wc, opcode); O(ibv_wc, byte_len);
    O(ibv_wc, invalidated_rkey); O(ibv_wc, wc_flags);
    O(ibv_context, ops); O(ibv_context_ops, poll_cq); O(ibv_context_ops, req_notify_cq);
    O(ibv_context_ops, post_send); O(ibv_context_ops, post_recv);
    O(ibv_cq, context); O(ibv_qp, context); O(ibv_qp, qp_num); O(ibv_mr, lkey); O(ibv_mr, rkey);
    O(ibv_comp_channel, fd);
    S(ibv_qp_init_attr); O(ibv_qp_init_attr, cap); O(ibv_qp_init_attr, qp_type); O(ibv_qp_init_attr, sq_sig_all);
    S(ibv_device_attr); O(ibv_device_attr, max_qp_wr); O(ibv_device_attr, max_sge);
    O(ibv_device_attr, max_qp_rd_atom); O(ibv_device_attr, max_qp_init_rd_atom);
    O(rdma_cm_id, verbs); O(rdma_cm_id, channel); O(rdma_cm_id, context); O(rdma_cm_id, qp);
    O(rdma_cm_id, route.addr.src_addr); O(rdma_cm_id, route.addr.dst_addr);
    S(rdma_cm_event); O(rdma_cm_event, event); O(rdma_cm_event, status); O(rdma_cm_event, param);
    S(rdma_conn_param); O(rdma_conn_param, private_data_len); O(rdma_conn_param, responder_resources);
    O(rdma_conn_param, initiator_depth); O(rdma_conn_param, rnr_retry_count); O(rdma_conn_param, qp_num);
    O(rdma_event_channel, fd);
    C(IBV_QPT_RC); C(RDMA_PS_TCP); C(IBV_WR_RDMA_WRITE); C(IBV_WR_SEND); C(IBV_WR_RDMA_READ);
    C(IBV_WR_SEND_WITH_INV); C(IBV_SEND_SIGNALED); C(IBV_SEND_INLINE); C(IBV_WC_SUCCESS);
    C(IBV_WC_WR_FLUSH_ERR); C(IBV_WC_RECV); C(IBV_WC_WITH_INV); C(IBV_ACCESS_LOCAL_WRITE);
    C(IBV_ACCESS_REMOTE_WRITE); C(IBV_ACCESS_REMOTE_READ); C(RDMA_CM_EVENT_ADDR_RESOLVED);
    C(RDMA_CM_EVENT_ROUTE_RESOLVED); C(RDMA_CM_EVENT_CONNECT_REQUEST); C(RDMA_CM_EVENT_REJECTED);
    C(RDMA_CM_EVENT_ESTABLISHED); C(RDMA_CM_EVENT_DISCONNECTED); C(RDMA_CM_EVENT_DEVICE_REMOVAL);
    C(RDMA_CM_EVENT_TIMEWAIT_EXIT);
    return 0;
}
"#;

fn probe() -> Option<std::collections::HashMap<String, i64>> {
    let dir = tempfile_dir();
    let src = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&src, PROBE).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc).arg(&src).arg("-o").arg(&exe).output();
    match built {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr).into_owned();
            skip_or_fail(&format!(
                "C probe does not build (libibverbs-dev/librdmacm-dev missing?): {why}"
            ));
            return None;
        }
        Err(e) => {
            skip_or_fail(&format!("no C compiler ({cc}): {e}"));
            return None;
        }
    }
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    Some(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| {
                let (k, v) = l.rsplit_once(' ').unwrap();
                (k.to_owned(), v.parse().unwrap())
            })
            .collect(),
    )
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("nvpool-rdma-layout-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn skip_or_fail(why: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}");
    }
    eprintln!("not checking the RDMA ABI: {why}");
}

#[test]
fn ffi_layouts_match_the_system_headers() {
    let Some(c) = probe() else { return };
    let check = |k: &str, rust: usize| {
        assert_eq!(
            c[k], rust as i64,
            "{k}: C says {}, ffi.rs says {rust}",
            c[k]
        );
    };
    check("ibv_send_wr", size_of::<ibv_send_wr>());
    check("ibv_send_wr.wr_id", offset_of!(ibv_send_wr, wr_id));
    check("ibv_send_wr.next", offset_of!(ibv_send_wr, next));
    check("ibv_send_wr.sg_list", offset_of!(ibv_send_wr, sg_list));
    check("ibv_send_wr.num_sge", offset_of!(ibv_send_wr, num_sge));
    check("ibv_send_wr.opcode", offset_of!(ibv_send_wr, opcode));
    check(
        "ibv_send_wr.send_flags",
        offset_of!(ibv_send_wr, send_flags),
    );
    check(
        "ibv_send_wr.invalidate_rkey",
        offset_of!(ibv_send_wr, invalidate_rkey),
    );
    check(
        "ibv_send_wr.wr.rdma.remote_addr",
        offset_of!(ibv_send_wr, remote_addr),
    );
    check("ibv_send_wr.wr.rdma.rkey", offset_of!(ibv_send_wr, rkey));
    check("ibv_recv_wr", size_of::<ibv_recv_wr>());
    check("ibv_recv_wr.sg_list", offset_of!(ibv_recv_wr, sg_list));
    check("ibv_recv_wr.num_sge", offset_of!(ibv_recv_wr, num_sge));
    check("ibv_sge", size_of::<ibv_sge>());
    check("ibv_wc", size_of::<ibv_wc>());
    check("ibv_wc.status", offset_of!(ibv_wc, status));
    check("ibv_wc.opcode", offset_of!(ibv_wc, opcode));
    check("ibv_wc.byte_len", offset_of!(ibv_wc, byte_len));
    check(
        "ibv_wc.invalidated_rkey",
        offset_of!(ibv_wc, invalidated_rkey),
    );
    check("ibv_wc.wc_flags", offset_of!(ibv_wc, wc_flags));
    check("ibv_context.ops", offset_of!(ibv_context, ops));
    check(
        "ibv_context_ops.poll_cq",
        offset_of!(ibv_context_ops, poll_cq),
    );
    check(
        "ibv_context_ops.req_notify_cq",
        offset_of!(ibv_context_ops, req_notify_cq),
    );
    check(
        "ibv_context_ops.post_send",
        offset_of!(ibv_context_ops, post_send),
    );
    check(
        "ibv_context_ops.post_recv",
        offset_of!(ibv_context_ops, post_recv),
    );
    check("ibv_cq.context", offset_of!(ibv_cq, context));
    check("ibv_qp.context", offset_of!(ibv_qp, context));
    check("ibv_qp.qp_num", offset_of!(ibv_qp, qp_num));
    check("ibv_mr.lkey", offset_of!(ibv_mr, lkey));
    check("ibv_mr.rkey", offset_of!(ibv_mr, rkey));
    check("ibv_comp_channel.fd", offset_of!(ibv_comp_channel, fd));
    check("ibv_qp_init_attr", size_of::<ibv_qp_init_attr>());
    check("ibv_qp_init_attr.cap", offset_of!(ibv_qp_init_attr, cap));
    check(
        "ibv_qp_init_attr.qp_type",
        offset_of!(ibv_qp_init_attr, qp_type),
    );
    check(
        "ibv_qp_init_attr.sq_sig_all",
        offset_of!(ibv_qp_init_attr, sq_sig_all),
    );
    check("ibv_device_attr", size_of::<ibv_device_attr>());
    check(
        "ibv_device_attr.max_qp_wr",
        offset_of!(ibv_device_attr, max_qp_wr),
    );
    check(
        "ibv_device_attr.max_sge",
        offset_of!(ibv_device_attr, max_sge),
    );
    check(
        "ibv_device_attr.max_qp_rd_atom",
        offset_of!(ibv_device_attr, max_qp_rd_atom),
    );
    check(
        "ibv_device_attr.max_qp_init_rd_atom",
        offset_of!(ibv_device_attr, max_qp_init_rd_atom),
    );
    check("rdma_cm_id.verbs", offset_of!(rdma_cm_id, verbs));
    check("rdma_cm_id.channel", offset_of!(rdma_cm_id, channel));
    check("rdma_cm_id.context", offset_of!(rdma_cm_id, context));
    check("rdma_cm_id.qp", offset_of!(rdma_cm_id, qp));
    check(
        "rdma_cm_id.route.addr.src_addr",
        offset_of!(rdma_cm_id, src_addr),
    );
    check(
        "rdma_cm_id.route.addr.dst_addr",
        offset_of!(rdma_cm_id, dst_addr),
    );
    check("rdma_cm_event", size_of::<rdma_cm_event>());
    check("rdma_cm_event.event", offset_of!(rdma_cm_event, event));
    check("rdma_cm_event.status", offset_of!(rdma_cm_event, status));
    check("rdma_cm_event.param", offset_of!(rdma_cm_event, conn));
    check("rdma_conn_param", size_of::<rdma_conn_param>());
    check(
        "rdma_conn_param.private_data_len",
        offset_of!(rdma_conn_param, private_data_len),
    );
    check(
        "rdma_conn_param.responder_resources",
        offset_of!(rdma_conn_param, responder_resources),
    );
    check(
        "rdma_conn_param.initiator_depth",
        offset_of!(rdma_conn_param, initiator_depth),
    );
    check(
        "rdma_conn_param.rnr_retry_count",
        offset_of!(rdma_conn_param, rnr_retry_count),
    );
    check(
        "rdma_conn_param.qp_num",
        offset_of!(rdma_conn_param, qp_num),
    );
    check("rdma_event_channel.fd", offset_of!(rdma_event_channel, fd));
    let constant = |k: &str, v: i64| assert_eq!(c[k], v, "{k}");
    constant("IBV_QPT_RC", IBV_QPT_RC as i64);
    constant("RDMA_PS_TCP", RDMA_PS_TCP as i64);
    constant("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE as i64);
    constant("IBV_WR_SEND", IBV_WR_SEND as i64);
    constant("IBV_WR_RDMA_READ", IBV_WR_RDMA_READ as i64);
    constant("IBV_WR_SEND_WITH_INV", IBV_WR_SEND_WITH_INV as i64);
    constant("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED as i64);
    constant("IBV_SEND_INLINE", IBV_SEND_INLINE as i64);
    constant("IBV_WC_SUCCESS", IBV_WC_SUCCESS as i64);
    constant("IBV_WC_WR_FLUSH_ERR", IBV_WC_WR_FLUSH_ERR as i64);
    constant("IBV_WC_RECV", IBV_WC_RECV as i64);
    constant("IBV_WC_WITH_INV", IBV_WC_WITH_INV as i64);
    constant("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE as i64);
    constant("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE as i64);
    constant("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ as i64);
    constant(
        "RDMA_CM_EVENT_ADDR_RESOLVED",
        RDMA_CM_EVENT_ADDR_RESOLVED as i64,
    );
    constant(
        "RDMA_CM_EVENT_ROUTE_RESOLVED",
        RDMA_CM_EVENT_ROUTE_RESOLVED as i64,
    );
    constant(
        "RDMA_CM_EVENT_CONNECT_REQUEST",
        RDMA_CM_EVENT_CONNECT_REQUEST as i64,
    );
    constant("RDMA_CM_EVENT_REJECTED", RDMA_CM_EVENT_REJECTED as i64);
    constant(
        "RDMA_CM_EVENT_ESTABLISHED",
        RDMA_CM_EVENT_ESTABLISHED as i64,
    );
    constant(
        "RDMA_CM_EVENT_DISCONNECTED",
        RDMA_CM_EVENT_DISCONNECTED as i64,
    );
    constant(
        "RDMA_CM_EVENT_DEVICE_REMOVAL",
        RDMA_CM_EVENT_DEVICE_REMOVAL as i64,
    );
    constant(
        "RDMA_CM_EVENT_TIMEWAIT_EXIT",
        RDMA_CM_EVENT_TIMEWAIT_EXIT as i64,
    );
}

#[test]
fn without_rdma_in_the_kernel_availability_says_why() {
    // This host's kernel has no RDMA CM (the VM tests cover the real thing);
    // where it does, availability must simply succeed.
    match nvpool_rdma::available() {
        Ok(()) => assert!(std::path::Path::new("/dev/infiniband/rdma_cm").exists()),
        Err(why) => assert!(!why.is_empty()),
    }
}

#[test]
fn every_symbol_resolves_in_the_installed_libraries() {
    // Functions that are inline in the headers (rdma_get_local_addr, the
    // provider calls) must not be looked up: loading would fail here.
    match nvpool_rdma::ffi::lib() {
        Ok(_) => {}
        Err(why) if why.contains("not found") => skip_or_fail(why),
        Err(why) => panic!("the RDMA libraries load but lack a symbol: {why}"),
    }
}
