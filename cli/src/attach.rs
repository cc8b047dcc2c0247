//! The host side of `nvpool volume attach` and `detach`: the CLI asks the
//! control plane to export the volume to this host, then asks this host's
//! agent (`nvpool-agent`, started here if it is not running) to serve it.
//!
//! ```text
//! nvpool volume attach NAME
//!   ├─ PUT attachment on the control plane (targets export the extents)
//!   ├─ the agent's socket answers? else start `nvpool agent` (own session,
//!   │  log in RUN_DIR/agent.log) and wait for it
//!   ├─ PUT /v1/volumes/UUID on the agent: it connects (controllers shared
//!   │  with its other volumes), presents the device, answers with it
//!   └─ print the device
//! nvpool volume detach NAME
//!   ├─ DELETE /v1/volumes/UUID on the agent (refused while mounted unless
//!   │  --force): it flushes and tears the device down
//!   └─ DELETE the attachment on the control plane
//! ```

use crate::client::Client;
use anyhow::{bail, Context};
pub use nvpool_agent::api::Frontend;
use nvpool_agent::api::{AttachBody, Attached, VolumeOut};
pub use nvpool_agent::serve::mounted_at;
use nvpool_agent::state;
use nvpool_layout::Uuid;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long the CLI waits for an agent it started to answer.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(20);

/// Resolves `auto` and checks that the chosen front-end can work here.
pub fn frontend_choice(f: Frontend) -> anyhow::Result<Frontend> {
    if f == Frontend::Nvme {
        crate::nvmef::available()?;
        return Ok(Frontend::Nvme);
    }
    nvpool_agent::serve::frontend_choice(f)
}

/// This host's agent, if it is running (never starts one).
pub fn running_agent() -> Option<Client> {
    let sock = state::socket_path();
    if !sock.exists() {
        return None;
    }
    let c = Client::agent(&sock);
    c.get::<Vec<VolumeOut>>("/v1/volumes").ok().map(|_| c)
}

/// This host's agent, started in its own session if it is not running.
pub fn agent() -> anyhow::Result<Client> {
    if let Some(c) = running_agent() {
        return Ok(c);
    }
    let run = state::run_dir();
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    let log = state::log_path();
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("opening {}", log.display()))?;
    let exe = std::env::current_exe().context("locating the nvpool executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["--log", "info", "agent", "--run-dir"])
        .arg(&run)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log_file);
    // SAFETY: setsid is async-signal-safe and touches nothing of the
    // parent; it detaches the agent from the caller's terminal and
    // process group, so the caller's Ctrl-C does not reach it.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the nvpool agent")?;
    let deadline = Instant::now() + AGENT_START_TIMEOUT;
    loop {
        if let Some(c) = running_agent() {
            // The agent outlives us; nobody waits for it.
            drop(child);
            return Ok(c);
        }
        if let Ok(Some(status)) = child.try_wait() {
            // Another agent may have won the race to start: use it.
            if let Some(c) = running_agent() {
                return Ok(c);
            }
            bail!("the nvpool agent exited ({status}): {}", last_line(&log));
        }
        if Instant::now() > deadline {
            bail!(
                "the nvpool agent did not answer within {:?} (log: {})",
                AGENT_START_TIMEOUT,
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text.lines().last().unwrap_or("no output").to_owned();
    format!("{line} (log: {})", log.display())
}

/// Asks the agent to serve `uuid` (attached to `host` on the control plane
/// at `endpoint`) through `frontend`.
pub fn serve(
    endpoint: &str,
    token_file: Option<&Path>,
    uuid: &Uuid,
    host: &str,
    frontend: Frontend,
    progress: bool,
) -> anyhow::Result<Attached> {
    let agent = agent()?;
    if progress {
        eprintln!("serving it through {}…", frontend.name());
    }
    // The agent reads the token file itself, later too: give it a path
    // that does not depend on our working directory.
    let token_file = match token_file {
        Some(p) => Some(std::path::absolute(p).context("locating the token file")?),
        None => None,
    };
    let body = AttachBody {
        host_nqn: host.to_owned(),
        frontend,
        endpoint: endpoint.to_owned(),
        token_file,
    };
    let (_, a): (u16, Attached) = agent.put(&format!("/v1/volumes/{uuid}"), &body)?;
    Ok(a)
}

/// Asks the agent to stop serving `uuid` (flush, tear the device down).
/// `None`: this host did not serve it.
pub fn stop(uuid: &Uuid, force: bool) -> anyhow::Result<Option<VolumeOut>> {
    // A volume served before a crash is served again by a new agent,
    // which also clears what the dead one left: start it to detach.
    let wanted = state::load_wanted().unwrap_or_default();
    let ours = wanted.iter().any(|w| w.uuid == *uuid);
    let agent = match running_agent() {
        Some(a) => a,
        None if ours => agent()?,
        None => return Ok(None),
    };
    let q = if force { "?force=true" } else { "" };
    match agent.delete_json::<VolumeOut>(&format!("/v1/volumes/{uuid}{q}")) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.status() == Some(404) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The volumes this host's agent serves (none when it is not running).
pub fn local_volumes() -> Vec<VolumeOut> {
    running_agent()
        .and_then(|c| c.get::<Vec<VolumeOut>>("/v1/volumes").ok())
        .unwrap_or_default()
}
