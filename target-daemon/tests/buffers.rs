//! The reactors' buffer budget (D18): with a budget of a couple of large
//! buffers, many connections writing and reading 128 KiB at once all
//! finish with the right data (commands wait for buffers, nobody
//! deadlocks), and once idle nothing is lent any more.

mod common;

use common::*;
use nvpool_target::limits::{MDTS_BYTES, POOL_BUF_BYTES};
use nvpool_target::Target;
use std::time::{Duration, Instant};

/// Queues writing and reading at once, across both reactors.
const QUEUES: u16 = 6;
/// Commands each queue keeps in flight.
const DEPTH: usize = 8;
/// Rounds of DEPTH writes then DEPTH reads per queue.
const ROUNDS: u64 = 3;
const BLOCKS: u32 = (MDTS_BYTES / 512) as u32;

fn lba(queue: u16, round: u64, i: usize) -> u64 {
    ((u64::from(queue - 1) * ROUNDS + round) * DEPTH as u64 + i as u64) * u64::from(BLOCKS)
}

fn seed(queue: u16, round: u64, i: usize) -> u64 {
    lba(queue, round, i) ^ 0xB0F
}

/// One queue's work: rounds of DEPTH large writes in flight at once, then
/// DEPTH reads of what they wrote, each checked.
fn run_queue(mut q: Conn, queue: u16) {
    for round in 0..ROUNDS {
        let mut cids = Vec::new();
        for i in 0..DEPTH {
            let data = pattern(seed(queue, round, i), MDTS_BYTES);
            cids.push(q.submit_write(
                write_cmd(1, lba(queue, round, i), BLOCKS, false),
                data,
                false,
            ));
        }
        for _ in 0..DEPTH {
            let c = q.next_completion();
            c.ok();
            assert!(cids.contains(&c.cid));
        }
        let mut reads = std::collections::HashMap::new();
        for i in 0..DEPTH {
            let cid = q.submit(read_cmd(1, lba(queue, round, i), BLOCKS, 512));
            reads.insert(cid, i);
        }
        for _ in 0..DEPTH {
            let c = q.next_completion();
            c.ok();
            let i = reads.remove(&c.cid).expect("a read of this round");
            assert!(
                c.data == pattern(seed(queue, round, i), MDTS_BYTES),
                "queue {queue} round {round} command {i}: wrong data"
            );
        }
    }
}

#[test]
fn many_large_transfers_under_a_small_budget_all_finish_with_their_data() {
    let target = Target::new(None).unwrap();
    // Two buffers per reactor; QUEUES × DEPTH large commands want 48.
    let budget = 2 * POOL_BUF_BYTES;
    target.set_reactor_buffer_budget(budget).unwrap();
    let ram = format!(
        "ram:{}",
        u64::from(QUEUES) * ROUNDS * DEPTH as u64 * MDTS_BYTES as u64
    );
    let d = Daemon::start_with(target, &[subsystem(SUBNQN, &[], &[(1, &ram)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    a.set_queue_count(QUEUES);
    let queues: Vec<Conn> = (1..=QUEUES)
        .map(|qid| io_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A, a.cntlid, qid))
        .collect();
    let threads: Vec<_> = queues
        .into_iter()
        .zip(1..)
        .map(|(q, n)| std::thread::spawn(move || run_queue(q, n)))
        .collect();
    for t in threads {
        t.join().expect("a queue failed");
    }

    let figures = d.target.buffer_figures();
    assert_eq!(figures.len(), 2, "one entry per reactor: {figures:?}");
    for f in &figures {
        assert_eq!(f.budget_bytes, budget);
        assert!(f.allocated_bytes <= budget, "{f:?}");
    }
    assert!(
        figures.iter().map(|f| f.waits_total).sum::<u64>() > 0,
        "commands had to wait for buffers: {figures:?}"
    );
    // The last buffers come back once the last responses are sent.
    let deadline = Instant::now() + IO_TIMEOUT;
    while d
        .target
        .buffer_figures()
        .iter()
        .any(|f| f.lent_bytes > 0 || f.waiting > 0)
    {
        assert!(
            Instant::now() < deadline,
            "buffers still lent when idle: {:?}",
            d.target.buffer_figures()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The admin API shows the same figures.
    let v = http(d.api, "GET", "/v1/target", None).json();
    let r = v["reactor_buffers"].as_array().expect("reactor_buffers");
    assert_eq!(r.len(), 2, "{v}");
    assert!(
        r.iter()
            .all(|f| f["lent_bytes"] == 0 && f["budget_bytes"] == budget),
        "{v}"
    );
}

#[test]
fn a_budget_below_one_buffer_is_refused() {
    let target = Target::new(None).unwrap();
    assert!(target
        .set_reactor_buffer_budget(POOL_BUF_BYTES - 1)
        .is_err());
    assert!(target.set_reactor_buffer_budget(POOL_BUF_BYTES).is_ok());
}
