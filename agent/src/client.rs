//! A blocking client of the control plane's REST API (`nvpool-control`).
//!
//! JSON over HTTP/1.1 (ureq), https trusting `--cacert` (or the system
//! bundle, [`nvpool_api::tls::client_tls`]). Every call carries the
//! bearer token when one is configured. The endpoint may be a
//! comma-separated list of control-plane instances: every call goes
//! through [`Endpoints::send`], the one failover rule of nvpool's clients
//! (a GET, PUT or DELETE is tried on the next instance whatever broke; a
//! POST only when it never left). Failures come
//! back as one [`ClientError`] whose `Display` is the one line the command
//! prints: the control plane's own `message` for an API error, or "cannot
//! reach the control plane at URL: …" when no HTTP answer arrived.
//!
//! It is also how a serving process follows its volume's copies: it
//! implements [`ControlPlane`] for `nvpool_initiator::follow`; and, over
//! the agent's Unix socket ([`Client::agent`]), how the CLI talks to the
//! agent.

use nvpool_api::http::{Call, Endpoints, NoAnswer};
use nvpool_api::rest::parse_endpoints;
use nvpool_initiator::follow::ControlPlane;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The control plane a fresh install listens on.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:4430";

/// One request, connect to last byte. An attach programs every target
/// holding an extent of the volume before it answers; a minute covers a
/// large volume on a slow network without leaving a dead connection
/// hanging forever.
pub const REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Connecting only: a control plane that does not accept within this is
/// down or firewalled, and the user should hear so quickly.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Largest response body read (a full volume list with every extent of
/// many volumes fits).
pub const RESPONSE_BYTES_MAX: u64 = 256 << 20;

/// One call to the agent: serving a volume connects to its targets
/// (each connect bounded by the initiator's own timeouts), and a detach
/// flushes and tears a device down.
pub const AGENT_TIMEOUT_MS: u64 = 180_000;

fn config(timeout_ms: u64, tls: ureq::tls::TlsConfig) -> ureq::config::Config {
    ureq::Agent::config_builder()
        .tls_config(tls)
        .timeout_global(Some(Duration::from_millis(timeout_ms)))
        .timeout_connect(Some(Duration::from_millis(CONNECT_TIMEOUT_MS)))
        // Error statuses carry the JSON body we print.
        .http_status_as_error(false)
        // The control plane is cluster-internal: never via an environment proxy.
        .proxy(None)
        .user_agent(concat!("nvpool/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--endpoint {url:?}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error(transparent)]
    Tls(#[from] nvpool_api::tls::TlsError),
    #[error("--token-file {path}: cannot read the token")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// No HTTP answer from any endpoint: refused, timed out, reset.
    #[error("cannot reach {what} at {url}")]
    Unreachable {
        what: &'static str,
        url: String,
        #[source]
        source: NoAnswer,
    },
    /// The control plane answered with an error (`{kind, message, details}`).
    #[error("{message}{hint}")]
    Api {
        status: u16,
        kind: String,
        message: String,
        details: serde_json::Value,
        /// What the user can do about it, when we know (starts with a space).
        hint: String,
    },
    /// An answer that is not what the API documents.
    #[error("unexpected answer to {method} {path}: {reason}")]
    Protocol {
        method: &'static str,
        path: String,
        reason: String,
    },
}

impl ClientError {
    /// The API error kind (`not_found`, `unauthorized`…), if the control
    /// plane answered.
    pub fn kind(&self) -> Option<&str> {
        match self {
            ClientError::Api { kind, .. } => Some(kind),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[derive(Debug, Default, serde::Deserialize)]
struct ErrorBody {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    details: serde_json::Value,
}

/// Checks and normalises the endpoints: a comma-separated list of
/// `http://HOST[:PORT][/PREFIX]`, each without a trailing slash (the
/// control plane's one check of base URLs, which the target applies to
/// its `--control-plane` too).
pub fn parse_endpoint(list: &str) -> Result<Vec<String>, ClientError> {
    parse_endpoints(list).map_err(|reason| ClientError::Endpoint {
        url: list.to_owned(),
        reason,
    })
}

/// Reads a bearer token: the file's content, whitespace trimmed.
pub fn read_token(path: &Path) -> Result<String, ClientError> {
    let err = |source| ClientError::TokenFile {
        path: path.to_owned(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(err)?;
    let t = text.trim();
    if t.is_empty() || t.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file must hold one token",
        )));
    }
    Ok(t.to_owned())
}

pub use nvpool_initiator::follow::segment;

/// The control plane at its endpoints (or the agent at its socket).
/// Clones share which endpoint answered last.
#[derive(Debug, Clone)]
pub struct Client {
    endpoints: Arc<Endpoints>,
    token: Option<String>,
    agent: ureq::Agent,
    /// Who answers, for messages: the control plane or the agent, and
    /// where (the URL, or the agent's socket).
    what: &'static str,
    shown: String,
}

impl Client {
    pub fn new(endpoint: &str, token: Option<String>) -> Result<Client, ClientError> {
        Client::with_cacert(endpoint, token, None)
    }

    /// [`Client::new`], trusting the CA certificates (PEM) in `cacert` for
    /// https endpoints instead of the system's.
    pub fn with_cacert(
        endpoint: &str,
        token: Option<String>,
        cacert: Option<&Path>,
    ) -> Result<Client, ClientError> {
        let tls = nvpool_api::tls::client_tls(cacert)?;
        Client::with_tls(endpoint, token, tls)
    }

    /// [`Client::new`] with TLS settings already loaded
    /// ([`nvpool_api::tls::client_tls`]): the agent loads its
    /// `--cacert` once at start and gives it to every volume's client.
    pub fn with_tls(
        endpoint: &str,
        token: Option<String>,
        tls: ureq::tls::TlsConfig,
    ) -> Result<Client, ClientError> {
        let endpoints = Endpoints::new(parse_endpoint(endpoint)?);
        let agent = config(REQUEST_TIMEOUT_MS, tls).into();
        Ok(Client {
            shown: endpoints.shown(),
            endpoints: Arc::new(endpoints),
            token,
            agent,
            what: "the control plane",
        })
    }

    /// The agent at its Unix socket `path`. Serving a volume connects to
    /// every target and may wait for a slow one, so calls get
    /// [`AGENT_TIMEOUT_MS`].
    pub fn agent(path: &Path) -> Client {
        let agent = ureq::Agent::with_parts(
            // A Unix socket: no TLS.
            config(AGENT_TIMEOUT_MS, ureq::tls::TlsConfig::default()),
            crate::unix::UnixConnector {
                path: path.to_owned(),
            },
            crate::unix::NoResolver,
        );
        Client {
            endpoints: Arc::new(Endpoints::new(vec!["http://agent".into()])),
            token: None,
            agent,
            what: "the nvpool agent",
            shown: path.display().to_string(),
        }
    }

    /// The endpoint the next call goes to first (the last that answered).
    pub fn endpoint(&self) -> &str {
        self.endpoints.current()
    }

    /// One request through the endpoints: `make(url)` builds and sends it.
    fn send(
        &self,
        call: Call,
        path: &str,
        make: impl Fn(String) -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<ureq::http::Response<ureq::Body>, NoAnswer> {
        self.endpoints
            .send(call, |base| make(format!("{base}{path}")))
    }

    pub fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.get(u)).call()
        });
        self.json("GET", path, r).map(|(_, v)| v)
    }

    /// PUT with a JSON body; also returns the status (201 created, 200 existed).
    pub fn put<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(u16, T), ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.put(u)).send_json(body)
        });
        self.json("PUT", path, r)
    }

    /// PUT without a body; also returns the status.
    pub fn put_empty<T: DeserializeOwned>(&self, path: &str) -> Result<(u16, T), ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.put(u)).send_empty()
        });
        self.json("PUT", path, r)
    }

    /// POST, sent again to another endpoint only when it never left
    /// ([`Call::Once`]).
    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let r = self.send(Call::Once, path, |u| {
            self.auth(self.agent.post(u)).send_json(body)
        });
        self.json("POST", path, r).map(|(_, v)| v)
    }

    /// PUT with a JSON body, for calls answered without one (204).
    pub fn put_no_content<B: Serialize>(&self, path: &str, body: &B) -> Result<(), ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.put(u)).send_json(body)
        });
        let mut resp = self.answer(r)?;
        let _ = resp.body_mut().read_to_vec();
        Ok(())
    }

    pub fn delete(&self, path: &str) -> Result<(), ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.delete(u)).call()
        });
        let mut resp = self.answer(r)?;
        let _ = resp.body_mut().read_to_vec();
        Ok(())
    }

    /// DELETE, for calls that answer with what they removed.
    pub fn delete_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.delete(u)).call()
        });
        self.json("DELETE", path, r).map(|(_, v)| v)
    }

    /// Any HTTP answer's status and body (read up to
    /// [`RESPONSE_BYTES_MAX`]; a body that cannot be read is empty, as
    /// error bodies are read here); no answer is the error, in words.
    fn raw(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, NoAnswer>,
    ) -> Result<(u16, Vec<u8>), String> {
        let mut resp = r.map_err(|source| {
            let e = ClientError::Unreachable {
                what: self.what,
                url: self.shown.clone(),
                source,
            };
            match std::error::Error::source(&e) {
                Some(why) => format!("{e}: {why}"),
                None => e.to_string(),
            }
        })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(RESPONSE_BYTES_MAX)
            .read_to_vec()
            .unwrap_or_default();
        Ok((status, body))
    }

    fn auth<B>(&self, r: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(t) => r.header("Authorization", format!("Bearer {t}")),
            None => r,
        }
    }

    /// A 2xx response, or the error it stands for.
    fn answer(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, NoAnswer>,
    ) -> Result<ureq::http::Response<ureq::Body>, ClientError> {
        let mut resp = r.map_err(|source| ClientError::Unreachable {
            what: self.what,
            url: self.shown.clone(),
            source,
        })?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(resp);
        }
        let body: ErrorBody = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_json()
            .unwrap_or_default();
        let hint = match status {
            401 if self.token.is_none() => {
                " (give a token with --token-file or NVPOOL_TOKEN_FILE)".to_owned()
            }
            _ => String::new(),
        };
        Err(ClientError::Api {
            status,
            kind: if body.kind.is_empty() {
                "http".into()
            } else {
                body.kind
            },
            message: if body.message.is_empty() {
                format!("{} answered HTTP {status}", self.what)
            } else {
                body.message
            },
            details: body.details,
            hint,
        })
    }

    fn json<T: DeserializeOwned>(
        &self,
        method: &'static str,
        path: &str,
        r: Result<ureq::http::Response<ureq::Body>, NoAnswer>,
    ) -> Result<(u16, T), ClientError> {
        let mut resp = self.answer(r)?;
        let status = resp.status().as_u16();
        let v = resp
            .body_mut()
            .with_config()
            .limit(RESPONSE_BYTES_MAX)
            .read_json()
            .map_err(|e| ClientError::Protocol {
                method,
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        Ok((status, v))
    }
}

/// The copy follower's calls, with the token: reads with their own
/// timeout (a long-poll), PUTs.
impl ControlPlane for Client {
    fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.get(u))
                .config()
                .timeout_global(Some(timeout))
                .build()
                .call()
        });
        self.raw(r)
    }

    fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>), String> {
        let r = self.send(Call::Idempotent, path, |u| {
            self.auth(self.agent.put(u)).send_json(body)
        });
        self.raw(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("http://cp:4430/").unwrap(),
            ["http://cp:4430"]
        );
        assert_eq!(
            parse_endpoint(" HTTP://cp ,http://cp2:1").unwrap(),
            ["http://cp", "http://cp2:1"]
        );
        for bad in ["cp:4430", "http://", "http://u@cp", "ftp://x", "http://a,"] {
            let e = parse_endpoint(bad).unwrap_err().to_string();
            assert!(e.starts_with("--endpoint "), "{e}");
        }
    }
}
