//! Target configuration: the TOML file an admin writes, and the state file
//! the daemon keeps so run-time changes survive a restart.
//!
//! At start the daemon loads `STATE_DIR/target.json` when it exists (the
//! last running configuration, written after every admin API change), then
//! applies the `--config` file on top: subsystems, namespaces and listeners
//! it names replace the saved ones of the same name. Anything added at run
//! time and not named in the file is kept.

use crate::backend::BackendSpec;
use nvpool_wire::dhchap::{CtrlPolicy, DhGroup, HashId, Keys, Secret};
pub use nvpool_wire::log::AnaState;
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
    /// `tcp` (the default) or `rdma`.
    #[serde(default, skip_serializing_if = "Transport::is_tcp")]
    pub transport: Transport,
}

/// The NVMe-oF transport of a listener (and of the associations made
/// through it): the initiator's, one definition for both sides.
pub use nvpool_initiator::Transport;

/// A listen address as the command line and the admin API take it:
/// `ADDR:PORT` or `tcp:ADDR:PORT` for NVMe/TCP, `rdma:ADDR:PORT` for
/// NVMe/RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Listen {
    pub transport: Transport,
    pub addr: SocketAddr,
}

impl std::str::FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Listen, String> {
        let (transport, rest) = match s.split_once(':') {
            Some(("tcp", r)) => (Transport::Tcp, r),
            Some(("rdma", r)) => (Transport::Rdma, r),
            _ => (Transport::Tcp, s),
        };
        let addr = rest
            .parse()
            .map_err(|_| format!("{s:?}: expected [tcp:|rdma:]ADDR:PORT"))?;
        Ok(Listen { transport, addr })
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.transport {
            Transport::Tcp => write!(f, "{}", self.addr),
            Transport::Rdma => write!(f, "rdma:{}", self.addr),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    pub nqn: String,
    /// Host NQNs allowed to connect.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Let any host connect (the ACL is then ignored).
    #[serde(default)]
    pub allow_any_host: bool,
    /// DH-HMAC-CHAP keys by host NQN: a host named here must authenticate
    /// every queue (NVMe in-band authentication) whether it is admitted by
    /// `allowed_hosts` or by `allow_any_host`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_keys: BTreeMap<String, DhchapKeys>,
    /// Serial number reported in Identify (default derived from the NQN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Model number reported in Identify (default "nvpool"); at most 40
    /// printable ASCII characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Asymmetric Namespace Access: this target is one path of a subsystem
    /// that several targets present (docs/ARCHITECTURE.md D15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ana: Option<AnaConfig>,
    #[serde(default)]
    pub namespaces: Vec<NamespaceConfig>,
}

/// The longest [`DhchapKeys::key_id`].
pub const KEY_ID_BYTES_MAX: usize = 64;

/// A host's DH-HMAC-CHAP keys, as the config and state files (mode 0600)
/// hold them and the admin API takes them: the secrets are never logged,
/// shown by Debug or returned by the admin API.
pub use nvpool_api::admin::{DhchapKeys, SecretText};

/// The controller's policy for a host with keys `k`: where the secrets and
/// `key_id` are checked.
pub fn policy(k: &DhchapKeys) -> Result<CtrlPolicy, ConfigError> {
    let secret = |t: &SecretText, which: &str| {
        t.expose()
            .parse::<Secret>()
            .map_err(|e| ConfigError::Invalid(format!("{which}: {e}")))
    };
    let hash = match &k.dhchap_hash {
        None => None,
        Some(h) => Some(HashId::from_name(h).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "dhchap_hash {h:?}: expected sha256, sha384 or sha512"
            ))
        })?),
    };
    let dhgroup = match &k.dhchap_dhgroup {
        None => DhGroup::Null,
        Some(g) => DhGroup::from_name(g).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "dhchap_dhgroup {g:?}: expected null or ffdhe2048, 3072, 4096, 6144, 8192"
            ))
        })?,
    };
    if let Some(id) = &k.key_id {
        if id.is_empty() || id.len() > KEY_ID_BYTES_MAX || !id.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(ConfigError::Invalid(format!(
                "key_id: 1..={KEY_ID_BYTES_MAX} visible ASCII characters"
            )));
        }
    }
    Ok(CtrlPolicy {
        keys: Keys {
            host: secret(&k.dhchap_key, "dhchap_key")?,
            ctrl: (k.dhchap_ctrl_key.as_ref())
                .map(|t| secret(t, "dhchap_ctrl_key"))
                .transpose()?,
        },
        hash,
        dhgroup,
    })
}

/// The ANA settings of a subsystem on this target: its one ANA group's
/// state here, and the CNTLIDs its controllers get here (disjoint from the
/// other targets' ranges: a host refuses a second controller with a CNTLID
/// it already has in the subsystem).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AnaConfig {
    /// `optimized`, `non-optimized`, `inaccessible`, `persistent-loss` or `change`.
    #[serde(with = "ana_state_name")]
    pub state: AnaState,
    pub cntlid_min: u16,
    pub cntlid_max: u16,
    /// A serving state (optimized, non-optimized) holds only while a lease
    /// the control plane renews is valid; without one the group reads as
    /// inaccessible.
    #[serde(default)]
    pub lease: bool,
}

/// Highest CNTLID a controller may have (FFF0h..FFFFh are reserved).
pub const CNTLID_MAX: u16 = 0xFFEF;
/// Identify MN is a 40-byte field.
pub const MODEL_LEN_MAX: usize = 40;

impl AnaConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.cntlid_min == 0 || self.cntlid_min > self.cntlid_max || self.cntlid_max > CNTLID_MAX
        {
            return Err(ConfigError::Invalid(format!(
                "ana: CNTLID range {}..={} must satisfy 1 <= cntlid_min <= cntlid_max <= {CNTLID_MAX:#x}",
                self.cntlid_min, self.cntlid_max
            )));
        }
        Ok(())
    }
}

/// ANA states as the strings nvmet's configfs and nvme-cli use.
mod ana_state_name {
    use super::AnaState;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(s: &AnaState, ser: S) -> Result<S::Ok, S::Error> {
        ser.serialize_str(s.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<AnaState, D::Error> {
        let name = String::deserialize(de)?;
        AnaState::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown ANA state {name:?} (optimized, non-optimized, inaccessible, persistent-loss, change)"
            ))
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    pub nsid: u32,
    /// `file:PATH[,offset=…][,length=…][,block_size=…]` or `ram:SIZE`.
    pub backend: String,
    /// Namespace UUID; derived from the target identity, NQN and NSID when
    /// absent, and saved, so it never changes across restarts. When given,
    /// NGUID and EUI-64 are derived from it alone, so every target given
    /// the same UUID reports the same three identifiers (several paths of
    /// one namespace must).
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
            for (h, k) in &s.host_keys {
                validate_nqn(h)?;
                policy(k).map_err(|e| ConfigError::Invalid(format!("{}: host {h}: {e}", s.nqn)))?;
            }
            if let Some(m) = &s.model {
                if m.is_empty()
                    || m.len() > MODEL_LEN_MAX
                    || !m.bytes().all(|b| (0x20..0x7F).contains(&b))
                {
                    return Err(ConfigError::Invalid(format!(
                        "{}: model {m:?} must be 1..={MODEL_LEN_MAX} printable ASCII characters",
                        s.nqn
                    )));
                }
            }
            if let Some(a) = &s.ana {
                a.validate()
                    .map_err(|e| ConfigError::Invalid(format!("{}: {e}", s.nqn)))?;
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
        // Owner-only: the file holds hosts' DH-HMAC-CHAP secrets.
        let mut f = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(werr)?
        };
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

    #[test]
    fn listen_addresses_name_their_transport() {
        let l: Listen = "rdma:192.0.2.10:4420".parse().unwrap();
        assert_eq!((l.transport, l.addr.port()), (Transport::Rdma, 4420));
        assert_eq!(l.to_string(), "rdma:192.0.2.10:4420");
        let t: Listen = "tcp:[::1]:8009".parse().unwrap();
        assert_eq!(
            (t.transport, t.to_string()),
            (Transport::Tcp, "[::1]:8009".into())
        );
        let plain: Listen = "127.0.0.1:4420".parse().unwrap();
        assert_eq!(plain.transport, Transport::Tcp);
        for bad in ["rdma:", "rdma:10.0.0.1", "ib:10.0.0.1:4420", "4420"] {
            assert!(bad.parse::<Listen>().is_err(), "{bad}");
        }
        let cfg: Config = toml::from_str(
            "[[listeners]]\naddr = \"10.0.0.1:4420\"\ntransport = \"rdma\"\n[[listeners]]\naddr = \"10.0.0.1:4420\"\n",
        )
        .unwrap();
        assert_eq!(cfg.listeners[0].transport, Transport::Rdma);
        assert_eq!(cfg.listeners[1].transport, Transport::Tcp);
        assert!(toml::from_str::<Config>(
            "[[listeners]]\naddr = \"10.0.0.1:4420\"\ntransport = \"udp\"\n"
        )
        .is_err());
    }

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
    fn ana_settings_parse_and_are_checked() {
        let text = format!(
            "{SAMPLE}[subsystems.ana]\nstate = \"non-optimized\"\ncntlid_min = 1000\ncntlid_max = 1999\n"
        );
        let c: Config = toml::from_str(&text).unwrap();
        c.validate().unwrap();
        let a = c.subsystems[0].ana.unwrap();
        assert_eq!(a.state, AnaState::NonOptimized);
        assert_eq!((a.cntlid_min, a.cntlid_max, a.lease), (1000, 1999, false));
        let json = serde_json::to_value(a).unwrap();
        assert_eq!(json["state"], "non-optimized");
        assert_eq!(serde_json::from_value::<AnaConfig>(json).unwrap(), a);

        for (min, max) in [(0, 10), (20, 10), (1, 0xFFF0), (0xFFF0, 0xFFFF)] {
            let mut c = c.clone();
            c.subsystems[0].ana = Some(AnaConfig {
                cntlid_min: min,
                cntlid_max: max,
                ..a
            });
            assert!(c.validate().is_err(), "{min}..={max}");
        }
        let bad = text.replace("non-optimized", "standby");
        assert!(toml::from_str::<Config>(&bad).is_err());
        let mut c = c.clone();
        c.subsystems[0].model = Some("x".repeat(41));
        assert!(c.validate().is_err());
        c.subsystems[0].model = Some("nvpool pooled volume".into());
        c.validate().unwrap();
    }

    #[test]
    fn uuids() {
        let u = parse_uuid("01234567-89ab-cdef-0123-456789abcdef").unwrap();
        assert_eq!(format_uuid(&u), "01234567-89ab-cdef-0123-456789abcdef");
        assert!(parse_uuid("0123456789abcdef0123456789abcdef").is_none());
    }
}
