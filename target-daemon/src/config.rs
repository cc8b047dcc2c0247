//! Target configuration: the TOML file an admin writes, and the state file
//! the daemon keeps so run-time changes survive a restart.
//!
//! At start the daemon loads `STATE_DIR/target.json` when it exists (the
//! last running configuration, written after every admin API change), then
//! applies the `--config` file on top: subsystems, namespaces and listeners
//! it names replace the saved ones of the same name. Anything added at run
//! time and not named in the file is kept.

use crate::backend::BackendSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:4420";
pub const DEFAULT_DISCOVERY_LISTEN: &str = "127.0.0.1:8009";
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:4480";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/nvpool-target";
const STATE_FILE: &str = "target.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where target.json and the target identity live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// Admin API address (HTTP, JSON). Loopback only unless you front it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_listen: Option<SocketAddr>,
    /// Reactor threads; default one per core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reactors: Option<usize>,
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    #[serde(default)]
    pub subsystems: Vec<SubsystemConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub addr: SocketAddr,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    pub nqn: String,
    /// Host NQNs allowed to connect.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Let any host connect (the ACL is then ignored).
    #[serde(default)]
    pub allow_any_host: bool,
    /// Serial number reported in Identify (default derived from the NQN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default)]
    pub namespaces: Vec<NamespaceConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    pub nsid: u32,
    /// `file:PATH[,offset=…][,length=…][,block_size=…]` or `ram:SIZE`.
    pub backend: String,
    /// Namespace UUID; derived from the target identity, NQN and NSID when
    /// absent, and saved, so it never changes across restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default)]
    pub read_only: bool,
}

/// Why a configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid TOML for nvpool-target: {message}")]
    Toml { path: PathBuf, message: String },
    #[error("{path} is corrupt: {message}")]
    State { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    pub fn from_toml_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Toml {
            path: path.into(),
            message: e.to_string(),
        })
    }

    /// Replaces listeners and subsystems of the same name with `other`'s.
    pub fn merge_from(&mut self, other: &Config) {
        for l in &other.listeners {
            if !self.listeners.contains(l) {
                self.listeners.push(l.clone());
            }
        }
        for s in &other.subsystems {
            match self.subsystems.iter_mut().find(|x| x.nqn == s.nqn) {
                Some(existing) => {
                    // Keep UUIDs the state file derived for namespaces the file leaves unnamed.
                    let mut s = s.clone();
                    for ns in &mut s.namespaces {
                        if ns.uuid.is_none() {
                            ns.uuid = existing
                                .namespaces
                                .iter()
                                .find(|o| o.nsid == ns.nsid && o.backend == ns.backend)
                                .and_then(|o| o.uuid.clone());
                        }
                    }
                    *existing = s;
                }
                None => self.subsystems.push(s.clone()),
            }
        }
        if other.admin_listen.is_some() {
            self.admin_listen = other.admin_listen;
        }
        if other.reactors.is_some() {
            self.reactors = other.reactors;
        }
        if other.state_dir.is_some() {
            self.state_dir.clone_from(&other.state_dir);
        }
    }

    /// Checks everything that can be checked without opening backends.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut seen = BTreeMap::new();
        for s in &self.subsystems {
            validate_nqn(&s.nqn)?;
            if s.nqn == nvpool_wire::DISCOVERY_NQN {
                return Err(ConfigError::Invalid("the discovery NQN is reserved".into()));
            }
            if seen.insert(s.nqn.as_str(), ()).is_some() {
                return Err(ConfigError::Invalid(format!(
                    "subsystem {} is configured twice",
                    s.nqn
                )));
            }
            for h in &s.allowed_hosts {
                validate_nqn(h)?;
            }
            let mut nsids = BTreeMap::new();
            for ns in &s.namespaces {
                validate_nsid(ns.nsid)?;
                if nsids.insert(ns.nsid, ()).is_some() {
                    return Err(ConfigError::Invalid(format!(
                        "{}: namespace {} is configured twice",
                        s.nqn, ns.nsid
                    )));
                }
                BackendSpec::parse(&ns.backend).map_err(|e| {
                    ConfigError::Invalid(format!("{}: namespace {}: {e}", s.nqn, ns.nsid))
                })?;
                if let Some(u) = &ns.uuid {
                    parse_uuid(u).ok_or_else(|| {
                        ConfigError::Invalid(format!(
                            "{}: namespace {}: bad uuid {u:?}",
                            s.nqn, ns.nsid
                        ))
                    })?;
                }
            }
        }
        Ok(())
    }

    pub fn state_path(state_dir: &Path) -> PathBuf {
        state_dir.join(STATE_FILE)
    }

    /// Loads the saved running configuration, if any.
    pub fn load_state(state_dir: &Path) -> Result<Option<Config>, ConfigError> {
        let path = Self::state_path(state_dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| ConfigError::State {
                    path,
                    message: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }

    /// Saves atomically: write a temporary file, fsync it, rename it over the
    /// old one, fsync the directory.
    pub fn save_state(&self, state_dir: &Path) -> Result<(), ConfigError> {
        use std::io::Write;
        let path = Self::state_path(state_dir);
        let tmp = state_dir.join(format!("{STATE_FILE}.tmp"));
        let werr = |source| ConfigError::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(werr)?;
        let mut f = std::fs::File::create(&tmp).map_err(werr)?;
        let body = serde_json::to_vec_pretty(self).expect("config serialises");
        f.write_all(&body)
            .and_then(|()| f.sync_all())
            .map_err(werr)?;
        std::fs::rename(&tmp, &path).map_err(werr)?;
        std::fs::File::open(state_dir)
            .and_then(|d| d.sync_all())
            .map_err(werr)?;
        Ok(())
    }
}

/// NQNs: 1..=223 bytes of UTF-8, no NUL, starting with "nqn.".
pub fn validate_nqn(nqn: &str) -> Result<(), ConfigError> {
    if nqn.is_empty()
        || nqn.len() > nvpool_wire::NQN_LEN_MAX
        || nqn.contains('\0')
        || !nqn.starts_with("nqn.")
    {
        return Err(ConfigError::Invalid(format!(
            "{nqn:?} is not a valid NQN (nqn.YYYY-MM.reverse.domain:name, at most 223 bytes)"
        )));
    }
    Ok(())
}

pub fn validate_nsid(nsid: u32) -> Result<(), ConfigError> {
    if nsid == 0 || nsid > crate::limits::NAMESPACES_PER_SUBSYS_MAX {
        return Err(ConfigError::Invalid(format!(
            "namespace id {nsid} is outside 1..={}",
            crate::limits::NAMESPACES_PER_SUBSYS_MAX
        )));
    }
    Ok(())
}

pub use nvpool_wire::nqn::{format_uuid, parse_uuid};

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
state_dir = "/tmp/x"
admin_listen = "127.0.0.1:4480"
[[listeners]]
addr = "127.0.0.1:4420"
[[subsystems]]
nqn = "nqn.2026-11.io.nvpool:test"
allowed_hosts = ["nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"]
[[subsystems.namespaces]]
nsid = 1
backend = "ram:16M"
"#;

    #[test]
    fn parses_and_validates() {
        let c: Config = toml::from_str(SAMPLE).unwrap();
        c.validate().unwrap();
        assert_eq!(c.subsystems[0].namespaces[0].nsid, 1);
        assert!(
            toml::from_str::<Config>("bogus = 1").is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn invalid_configs_are_refused() {
        let mut c: Config = toml::from_str(SAMPLE).unwrap();
        c.subsystems[0].namespaces[0].nsid = 0;
        assert!(c.validate().is_err());
        let mut c: Config = toml::from_str(SAMPLE).unwrap();
        c.subsystems[0].nqn = "bad".into();
        assert!(c.validate().is_err());
        let mut c: Config = toml::from_str(SAMPLE).unwrap();
        c.subsystems.push(c.subsystems[0].clone());
        assert!(c.validate().is_err());
    }

    #[test]
    fn state_round_trip_and_merge() {
        let dir = tempfile::tempdir().unwrap();
        let mut c: Config = toml::from_str(SAMPLE).unwrap();
        c.subsystems[0].namespaces[0].uuid = Some("01234567-89ab-cdef-0123-456789abcdef".into());
        c.save_state(dir.path()).unwrap();
        let back = Config::load_state(dir.path()).unwrap().unwrap();
        assert_eq!(back, c);
        let file: Config = toml::from_str(SAMPLE).unwrap();
        let mut merged = back.clone();
        merged.merge_from(&file);
        assert_eq!(merged.subsystems.len(), 1);
        assert_eq!(
            merged.subsystems[0].namespaces[0].uuid, c.subsystems[0].namespaces[0].uuid,
            "saved uuid survives"
        );
    }

    #[test]
    fn uuids() {
        let u = parse_uuid("01234567-89ab-cdef-0123-456789abcdef").unwrap();
        assert_eq!(format_uuid(&u), "01234567-89ab-cdef-0123-456789abcdef");
        assert!(parse_uuid("0123456789abcdef0123456789abcdef").is_none());
    }
}
