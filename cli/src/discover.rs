//! `nvpool discover`.

use crate::Format;
use comfy_table::Table;
use nvpool_wire::log::{adrfam, subtype, trtype, DiscoveryEntry};
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Transport.
    #[arg(short = 't', long = "transport", value_enum, default_value_t = crate::TransportArg::Tcp)]
    pub transport: crate::TransportArg,
    /// Discovery controller address.
    #[arg(short = 'a', long = "traddr")]
    pub addr: String,
    /// Discovery controller port (default 8009 for tcp, 4420 for rdma).
    #[arg(short = 's', long = "trsvcid")]
    pub port: Option<u16>,
    /// Host NQN (default /etc/nvme/hostnqn, else a generated one).
    #[arg(short = 'q', long)]
    pub hostnqn: Option<String>,
    #[arg(short = 'o', long = "output-format", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let transport = nvpool_initiator::Transport::from(a.transport);
    let addr = crate::resolve(&a.addr, a.port.unwrap_or(transport.discovery_port()))?;
    let (mut hostnqn, mut hostid) = nvpool_initiator::hostnqn::host_identity();
    if let Some(h) = a.hostnqn {
        hostid = h
            .rsplit_once(":uuid:")
            .and_then(|(_, u)| nvpool_initiator::hostnqn::parse_uuid(u))
            .unwrap_or(hostid);
        hostnqn = h;
    }
    let entries = nvpool_initiator::discover::discover_over(
        transport,
        addr,
        &hostnqn,
        hostid,
        Duration::from_secs(10),
    )?;
    match a.output {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "records": entries.iter().map(json).collect::<Vec<_>>() })
            )?
        ),
        Format::Table => {
            let mut t = Table::new();
            t.load_preset(comfy_table::presets::NOTHING);
            t.set_header([
                "#",
                "type",
                "subsystem",
                "transport",
                "address",
                "port",
                "treq",
            ]);
            for (i, e) in entries.iter().enumerate() {
                t.add_row([
                    i.to_string(),
                    subtype_name(e.subtype).into(),
                    e.subnqn.clone(),
                    trtype_name(e.trtype).into(),
                    e.traddr.clone(),
                    e.trsvcid.clone(),
                    treq(e.treq),
                ]);
            }
            println!(
                "Discovery log from {addr} ({transport}): {} records",
                entries.len()
            );
            println!("{t}");
        }
    }
    Ok(())
}

fn subtype_name(s: u8) -> &'static str {
    match s {
        subtype::REFERRAL => "referral",
        subtype::NVM => "nvme subsystem",
        subtype::CURRENT_DISCOVERY => "current discovery subsystem",
        _ => "unknown",
    }
}

fn trtype_name(t: u8) -> &'static str {
    match t {
        trtype::TCP => "tcp",
        trtype::RDMA => "rdma",
        _ => "other",
    }
}

fn treq(t: u8) -> String {
    let sec = match t & 3 {
        1 => "secure channel required",
        2 => "not required",
        _ => "not specified",
    };
    if t & 4 != 0 {
        format!("{sec}, sq flow control disable supported")
    } else {
        sec.into()
    }
}

fn json(e: &DiscoveryEntry) -> serde_json::Value {
    serde_json::json!({
        "trtype": trtype_name(e.trtype),
        "adrfam": if e.adrfam == adrfam::IPV6 { "ipv6" } else { "ipv4" },
        "subtype": subtype_name(e.subtype),
        "treq": treq(e.treq),
        "portid": e.portid,
        "trsvcid": e.trsvcid,
        "subnqn": e.subnqn,
        "traddr": e.traddr,
        "cntlid": e.cntlid,
        "asqsz": e.asqsz,
    })
}
