//! `nvpool top`: the volumes this host's agent serves, refreshed like
//! `iostat -x`: requests and bandwidth per second, mean latency per
//! request kind, queue depth, and each path's state.

use crate::attach;
use nvpool_agent::api::VolumeStatsOut;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seconds between reports.
    #[arg(short, long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
    /// Reports to print, then exit (default: until interrupted).
    #[arg(short = 'n', long)]
    count: Option<u64>,
    /// Print the agent's counters once as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: give seconds between 0.1 and 3600")),
    }
}

/// One report's line for a volume: rates between two samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub name: String,
    pub device: String,
    pub r_s: f64,
    pub w_s: f64,
    pub rmb_s: f64,
    pub wmb_s: f64,
    /// Mean completion time, ms (0 without requests).
    pub r_await: f64,
    pub w_await: f64,
    pub in_flight: u64,
    pub state: String,
    pub paths: String,
}

/// The rates of `now` against `before` over `secs`.
pub fn line(before: Option<&VolumeStatsOut>, now: &VolumeStatsOut, secs: f64) -> Line {
    let d = |f: fn(&VolumeStatsOut) -> u64| f(now).saturating_sub(before.map_or(0, f));
    let (reads, writes) = (d(|v| v.reads), d(|v| v.writes));
    let per_s = |n: u64| n as f64 / secs;
    let await_ms = |ns: u64, n: u64| {
        if n == 0 {
            0.0
        } else {
            ns as f64 / n as f64 / 1e6
        }
    };
    let live = now.paths.iter().filter(|p| p.state == "live").count();
    Line {
        name: now.name.clone(),
        device: now
            .device
            .as_ref()
            .map_or_else(|| "-".into(), |d| d.display().to_string()),
        r_s: per_s(reads),
        w_s: per_s(writes),
        rmb_s: per_s(d(|v| v.read_bytes)) / 1e6,
        wmb_s: per_s(d(|v| v.write_bytes)) / 1e6,
        r_await: await_ms(d(|v| v.read_ns), reads),
        w_await: await_ms(d(|v| v.write_ns), writes),
        in_flight: now.in_flight,
        state: now.state.clone(),
        paths: format!("{live}/{} live", now.paths.len()),
    }
}

fn print_report(lines: &[Line]) {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header([
        "VOLUME", "DEVICE", "r/s", "w/s", "rMB/s", "wMB/s", "r_await", "w_await", "inflight",
        "STATE", "PATHS",
    ]);
    for l in lines {
        t.add_row([
            l.name.clone(),
            l.device.clone(),
            format!("{:.0}", l.r_s),
            format!("{:.0}", l.w_s),
            format!("{:.1}", l.rmb_s),
            format!("{:.1}", l.wmb_s),
            format!("{:.3}", l.r_await),
            format!("{:.3}", l.w_await),
            l.in_flight.to_string(),
            l.state.clone(),
            l.paths.clone(),
        ]);
    }
    println!("{t}\n");
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let Some(agent) = attach::running_agent() else {
        anyhow::bail!("no nvpool agent runs on this host (nothing is attached)");
    };
    let sample = || agent.get::<Vec<VolumeStatsOut>>("/v1/stats");
    if a.json {
        return crate::cluster::print_json(&serde_json::to_value(sample()?)?);
    }
    let interval = Duration::from_secs_f64(a.interval);
    let clear = std::io::stdout().is_terminal() && a.count.is_none();
    let mut before: BTreeMap<_, VolumeStatsOut> = BTreeMap::new();
    let mut at = Instant::now();
    // The first report covers the time since each volume was served, as
    // iostat's does since boot; the next ones each interval.
    let mut first = true;
    let mut printed = 0;
    loop {
        let now = sample()?;
        let secs = if first {
            1.0
        } else {
            at.elapsed().as_secs_f64().max(1e-3)
        };
        at = Instant::now();
        let lines: Vec<Line> = now
            .iter()
            .map(|v| line(before.get(&v.uuid).filter(|_| !first), v, secs))
            .collect();
        if clear {
            print!("\x1b[H\x1b[2J");
        }
        if first && !clear {
            // Totals since serving are not rates: say so.
            println!("since served (totals):");
        }
        print_report(&lines);
        let _ = std::io::stdout().flush();
        printed += 1;
        if a.count.is_some_and(|n| printed >= n) {
            return Ok(());
        }
        before = now.into_iter().map(|v| (v.uuid, v)).collect();
        first = false;
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_differences_over_the_interval() {
        let uuid = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42".parse().unwrap();
        let mut a = VolumeStatsOut::new(uuid, "v".into(), "serving");
        a.reads = 100;
        a.read_bytes = 100 * 4096;
        a.read_ns = 100 * 50_000;
        let mut b = a.clone();
        b.reads = 300;
        b.read_bytes = 300 * 4096;
        b.read_ns = 100 * 50_000 + 200 * 100_000;
        b.writes = 10;
        b.write_bytes = 10 << 20;
        b.write_ns = 10 * 2_000_000;
        let l = line(Some(&a), &b, 2.0);
        assert_eq!(l.r_s, 100.0);
        assert_eq!(l.w_s, 5.0);
        assert!((l.rmb_s - 200.0 * 4096.0 / 2.0 / 1e6).abs() < 1e-9);
        assert!((l.r_await - 0.1).abs() < 1e-9, "{}", l.r_await);
        assert!((l.w_await - 2.0).abs() < 1e-9);
        assert_eq!(l.device, "-");
        // A counter that went backwards (the volume was served anew) does
        // not make a negative rate.
        let l = line(Some(&b), &a, 1.0);
        assert_eq!(l.r_s, 0.0);
    }
}
