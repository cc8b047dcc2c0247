//! This host's DH-HMAC-CHAP keys, for the agent's volumes (targets the
//! control plane gave the host's keys make it authenticate) and the CLI
//! commands that connect to a controller directly (`nvpool bench`).
//!
//! Secrets come from a file or from the environment, never from an
//! argument value: `ps` shows a process's arguments to every user.
//!
//! ```text
//!   --dhchap-secret-file PATH       or  NVPOOL_DHCHAP_SECRET=DHHC-1:…
//!   --dhchap-ctrl-secret-file PATH  or  NVPOOL_DHCHAP_CTRL_SECRET=DHHC-1:…
//! ```

use anyhow::{bail, Context};
use nvpool_wire::dhchap::{Keys, Secret};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zeroize::Zeroizing;

/// The host's secret, when no file is named.
pub const SECRET_ENV: &str = "NVPOOL_DHCHAP_SECRET";
/// The controller's secret (bidirectional), when no file is named.
pub const CTRL_SECRET_ENV: &str = "NVPOOL_DHCHAP_CTRL_SECRET";

#[derive(Debug, Clone, Default, clap::Args)]
pub struct DhchapArgs {
    /// File holding this host's DH-HMAC-CHAP secret (DHHC-1:XX:…:), used
    /// when the controller asks for in-band authentication. Default: the
    /// NVPOOL_DHCHAP_SECRET environment variable.
    #[arg(long, value_name = "PATH")]
    pub dhchap_secret_file: Option<PathBuf>,
    /// File holding the controller's secret: the host then authenticates
    /// the controller too and refuses one that answers wrongly. Default:
    /// NVPOOL_DHCHAP_CTRL_SECRET.
    #[arg(long, value_name = "PATH")]
    pub dhchap_ctrl_secret_file: Option<PathBuf>,
}

/// A secret's text from `file` or else `env`, checked (`DHHC-1:…`) and
/// trimmed; errors never quote it.
fn read_text(
    file: Option<&Path>,
    env: &str,
    what: &str,
) -> anyhow::Result<Option<(Zeroizing<String>, Secret)>> {
    let text = match file {
        Some(p) => Zeroizing::new(
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        ),
        None => match std::env::var(env) {
            Ok(v) => Zeroizing::new(v),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(_) => bail!("{env} is not valid UTF-8"),
        },
    };
    let text = Zeroizing::new(text.trim().to_owned());
    let secret = text
        .parse::<Secret>()
        .with_context(|| format!("the {what} secret"))?;
    Ok(Some((text, secret)))
}

fn read_secret(file: Option<&Path>, env: &str, what: &str) -> anyhow::Result<Option<Secret>> {
    Ok(read_text(file, env, what)?.map(|(_, s)| s))
}

impl DhchapArgs {
    /// The keys to offer, if any. A controller secret without a host
    /// secret is refused.
    pub fn keys(&self) -> anyhow::Result<Option<Arc<Keys>>> {
        let host = read_secret(self.dhchap_secret_file.as_deref(), SECRET_ENV, "host")?;
        let ctrl = read_secret(
            self.dhchap_ctrl_secret_file.as_deref(),
            CTRL_SECRET_ENV,
            "controller",
        )?;
        match (host, ctrl) {
            (Some(host), ctrl) => Ok(Some(Arc::new(Keys { host, ctrl }))),
            (None, Some(_)) => bail!("a controller secret needs a host secret too"),
            (None, None) => Ok(None),
        }
    }

    /// The secrets as `DHHC-1:…` text (checked), for handing them to the
    /// control plane: the host's (required) and the controller's.
    pub fn texts(&self) -> anyhow::Result<(Zeroizing<String>, Option<Zeroizing<String>>)> {
        let host = read_text(self.dhchap_secret_file.as_deref(), SECRET_ENV, "host")?;
        let ctrl = read_text(
            self.dhchap_ctrl_secret_file.as_deref(),
            CTRL_SECRET_ENV,
            "controller",
        )?;
        match host {
            Some((h, _)) => Ok((h, ctrl.map(|(c, _)| c))),
            None => bail!(
                "no host secret: give --dhchap-secret-file or set {SECRET_ENV} \
                 (`nvme gen-dhchap-key` makes one)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_from_files_and_bad_ones_are_not_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let good = Secret::new(&[9; 32], None).unwrap();
        let host = dir.path().join("host");
        std::fs::write(&host, format!("{}\n", good.to_dhhc())).unwrap();
        let a = DhchapArgs {
            dhchap_secret_file: Some(host.clone()),
            dhchap_ctrl_secret_file: None,
        };
        let k = a.keys().unwrap().unwrap();
        assert_eq!(k.host, good);
        assert!(k.ctrl.is_none());

        let bad = dir.path().join("bad");
        std::fs::write(&bad, "DHHC-1:01:bm90LWEta2V5:").unwrap();
        let a = DhchapArgs {
            dhchap_secret_file: Some(host),
            dhchap_ctrl_secret_file: Some(bad),
        };
        let e = format!("{:#}", a.keys().unwrap_err());
        assert!(e.contains("controller") && !e.contains("bm90"), "{e}");

        let a = DhchapArgs {
            dhchap_secret_file: None,
            dhchap_ctrl_secret_file: Some(dir.path().join("missing")),
        };
        assert!(a.keys().is_err());
    }
}
