//! Which store to open, as one string (`--store`, `migrate --from/--to`):
//!
//! | URL | store |
//! |---|---|
//! | `redb:DIR` | the embedded store, `DIR/control.redb` |
//! | `memory:` | an in-memory store (demos and tests; nothing survives) |
//! | `etcd://HOST[:PORT][,HOST[:PORT]…][/PREFIX]` | etcd, plain gRPC |
//! | `etcds://…` | the same over TLS |
//!
//! An etcd URL lists the endpoints the client may use (it fails over between
//! them; port 2379 when none is given) and the key prefix of this cluster,
//! `/nvpool` by default, so one etcd can hold several clusters. Parsing
//! needs no feature: a build without etcd still says what is wrong with a
//! URL before saying it cannot open it.

use crate::limits::{ETCD_ENDPOINTS_MAX, ETCD_PREFIX_BYTES_MAX};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// The prefix of an etcd URL that names none.
pub const ETCD_PREFIX_DEFAULT: &str = "/nvpool";
/// etcd's client port (IANA).
pub const ETCD_PORT_DEFAULT: u16 = 2379;

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Redb(PathBuf),
    Memory,
    Etcd(EtcdUrl),
}

/// Where an etcd store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    /// `etcds://`: TLS to every endpoint.
    pub tls: bool,
    /// `host:port`, in the order given; IPv6 hosts in brackets.
    pub endpoints: Vec<String>,
    /// `/nvpool`: starts with `/`, no trailing `/`.
    pub prefix: String,
}

/// Why a store URL does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("store URL {url:?}: {reason}")]
pub struct UrlError {
    url: String,
    reason: String,
}

impl EtcdUrl {
    /// The endpoints as the gRPC client takes them (`http://host:port`).
    pub fn endpoint_urls(&self) -> Vec<String> {
        let scheme = if self.tls { "https" } else { "http" };
        self.endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect()
    }

    /// `etcd at h1:2379,h2:2379` (errors name the store so).
    pub fn describe(&self) -> String {
        format!("etcd at {}", self.endpoints.join(","))
    }
}

impl fmt::Display for EtcdUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "etcds" } else { "etcd" };
        write!(f, "{scheme}://{}{}", self.endpoints.join(","), self.prefix)
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Redb(dir) => write!(f, "redb:{}", dir.display()),
            StoreUrl::Memory => f.write_str("memory:"),
            StoreUrl::Etcd(e) => e.fmt(f),
        }
    }
}

impl FromStr for StoreUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<StoreUrl, UrlError> {
        let fail = |reason: String| UrlError {
            url: s.to_owned(),
            reason,
        };
        if let Some(rest) = s.strip_prefix("etcd://") {
            return parse_etcd(rest, false).map(StoreUrl::Etcd).map_err(fail);
        }
        if let Some(rest) = s.strip_prefix("etcds://") {
            return parse_etcd(rest, true).map(StoreUrl::Etcd).map_err(fail);
        }
        if let Some(dir) = s.strip_prefix("redb:") {
            if dir.is_empty() {
                return Err(fail(
                    "redb: needs a directory (redb:/var/lib/nvpool-control)".into(),
                ));
            }
            return Ok(StoreUrl::Redb(PathBuf::from(dir)));
        }
        if let Some(rest) = s.strip_prefix("memory:") {
            if !rest.is_empty() {
                return Err(fail("memory: takes nothing after the colon".into()));
            }
            return Ok(StoreUrl::Memory);
        }
        Err(fail(
            "use redb:DIR, memory:, etcd://HOST:PORT[,HOST:PORT…][/PREFIX] or etcds://…".into(),
        ))
    }
}

fn parse_etcd(rest: &str, tls: bool) -> Result<EtcdUrl, String> {
    let (hosts, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ETCD_PREFIX_DEFAULT),
    };
    if hosts.is_empty() {
        return Err("no endpoint (etcd://127.0.0.1:2379)".into());
    }
    let endpoints = hosts
        .split(',')
        .map(parse_endpoint)
        .collect::<Result<Vec<_>, _>>()?;
    if endpoints.len() > ETCD_ENDPOINTS_MAX {
        return Err(format!(
            "{} endpoints, at most {ETCD_ENDPOINTS_MAX}",
            endpoints.len()
        ));
    }
    validate_prefix(prefix)?;
    Ok(EtcdUrl {
        tls,
        endpoints,
        prefix: prefix.to_owned(),
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port` → `host:port`.
fn parse_endpoint(e: &str) -> Result<String, String> {
    let (host, port) = if let Some(v6) = e.strip_prefix('[') {
        let (addr, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("endpoint {e:?}: no ']' after an IPv6 address"))?;
        addr.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("endpoint {e:?}: {addr:?} is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("endpoint {e:?}: expected ':PORT' after ']'"))?,
            ),
        };
        (&e[..addr.len() + 2], port)
    } else {
        match e.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (e, None),
        }
    };
    let host_ok = !host.is_empty()
        && (host.starts_with('[')
            || host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-'));
    if !host_ok {
        return Err(format!(
            "endpoint {e:?}: {host:?} is not a host name or address"
        ));
    }
    let port = match port {
        None => ETCD_PORT_DEFAULT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("endpoint {e:?}: {p:?} is not a port")),
        },
    };
    Ok(format!("{host}:{port}"))
}

/// `/seg[/seg…]`, segments of `[A-Za-z0-9._-]`, neither `.` nor `..`.
fn validate_prefix(p: &str) -> Result<(), String> {
    if p.len() > ETCD_PREFIX_BYTES_MAX {
        return Err(format!(
            "prefix is {} bytes, at most {ETCD_PREFIX_BYTES_MAX}",
            p.len()
        ));
    }
    let segments = p
        .strip_prefix('/')
        .ok_or_else(|| format!("prefix {p:?} must start with '/'"))?;
    for seg in segments.split('/') {
        let ok = !seg.is_empty()
            && seg != "."
            && seg != ".."
            && seg
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !ok {
            return Err(format!(
                "prefix {p:?}: each '/'-separated part must be letters, digits, '.', '_' or '-' \
                 (and not empty)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(s: &str) -> EtcdUrl {
        match s.parse::<StoreUrl>().unwrap() {
            StoreUrl::Etcd(e) => e,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn store_urls() {
        assert_eq!(
            "redb:/var/lib/x".parse::<StoreUrl>().unwrap(),
            StoreUrl::Redb("/var/lib/x".into())
        );
        assert_eq!("memory:".parse::<StoreUrl>().unwrap(), StoreUrl::Memory);
        let e = etcd("etcd://10.0.0.1:2379,10.0.0.2:2380/prod/nvpool-1");
        assert_eq!(e.endpoints, ["10.0.0.1:2379", "10.0.0.2:2380"]);
        assert_eq!(e.prefix, "/prod/nvpool-1");
        assert!(!e.tls);
        assert_eq!(
            e.to_string(),
            "etcd://10.0.0.1:2379,10.0.0.2:2380/prod/nvpool-1"
        );
        assert_eq!(
            e.endpoint_urls(),
            ["http://10.0.0.1:2379", "http://10.0.0.2:2380"]
        );
        assert_eq!(e.describe(), "etcd at 10.0.0.1:2379,10.0.0.2:2380");
        let e = etcd("etcds://etcd-a,[::1]:12379,[fe80::1]");
        assert!(e.tls);
        assert_eq!(
            e.endpoints,
            ["etcd-a:2379", "[::1]:12379", "[fe80::1]:2379"]
        );
        assert_eq!(e.prefix, ETCD_PREFIX_DEFAULT);
        assert_eq!(e.endpoint_urls()[1], "https://[::1]:12379");
        for bad in [
            "",
            "redb:",
            "memory:x",
            "mysql://h",
            "etcd://",
            "etcd:///nvpool",
            "etcd://h:0",
            "etcd://h:99999",
            "etcd://h:x",
            "etcd://h,,g",
            "etcd://h/",
            "etcd://h/a//b",
            "etcd://h/a/",
            "etcd://h/../x",
            "etcd://h/a b",
            "etcd://h@x",
            "etcd://[::1",
            "etcd://[nope]:1",
            "etcd://[::1]x",
        ] {
            let e = bad.parse::<StoreUrl>().expect_err(bad);
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
            assert!(!e.to_string().contains('\n'), "one line: {e}");
        }
        let many = (0..=ETCD_ENDPOINTS_MAX)
            .map(|i| format!("h{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(format!("etcd://{many}").parse::<StoreUrl>().is_err());
        let long = format!("etcd://h/{}", "a".repeat(ETCD_PREFIX_BYTES_MAX));
        assert!(long.parse::<StoreUrl>().is_err());
    }
}
