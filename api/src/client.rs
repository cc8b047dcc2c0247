//! The one blocking client of nvpool's HTTP APIs (feature `client`): the
//! CLI and the agent call the control plane with it, the CLI calls the
//! agent over its Unix socket, a target registers and renews its leases,
//! and the control plane programs targets' admin APIs.
//!
//! ```text
//!   Client::{new, with_cacert, with_tls}  the control plane at --endpoint (a list fails over)
//!   Client::with_timeout                  any base URLs, TLS and timeout (registrar, target admin)
//!   Client::agent                         the agent at its Unix socket
//!     └─ every call: bearer token ─ Endpoints::send (failover, http.rs)
//!          ├─ 2xx ───────────► the body, as T ([`Client::get`] …) or raw
//!          ├─ other status ──► ClientError::Api, from the ErrorBody
//!          └─ no answer ─────► ClientError::Unreachable
//! ```
//!
//! JSON over HTTP/1.1 (ureq), https trusting `--cacert` (or the system
//! bundle, [`crate::tls::client_tls`]). A [`ClientError`]'s `Display` is
//! the one line a command prints: the server's own `message` for an API
//! error, or "cannot reach the control plane at URL" and why.

use crate::http::{Call, Endpoints, NoAnswer};
use crate::rest::{parse_endpoints, ErrorBody};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use ureq::http::{Method, Response};
use ureq::Body;

pub use crate::names::segment;

/// The control plane a fresh install listens on.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:4430";

/// One request, connect to last byte. An attach programs every target
/// holding an extent of the volume before it answers; a minute covers a
/// large volume on a slow network without leaving a dead connection
/// hanging forever.
pub const REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Connecting only: a server that does not accept within this is down or
/// firewalled, and the caller should hear so quickly (and try the next
/// endpoint).
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
/// Largest response body read (a full volume list with every extent of
/// many volumes fits).
pub const RESPONSE_BYTES_MAX: u64 = 256 << 20;
/// Largest error body read: a message and a few details.
const ERROR_BYTES_MAX: u64 = 1 << 20;

/// One call to the agent: serving a volume connects to its targets
/// (each connect bounded by the initiator's own timeouts), and a detach
/// flushes and tears a device down.
pub const AGENT_TIMEOUT_MS: u64 = 180_000;

/// For calls without a body: `None` of some `Serialize` type.
pub const NO_BODY: Option<&()> = None;

fn config(timeout: Duration, tls: ureq::tls::TlsConfig) -> ureq::config::Config {
    let connect = timeout.min(Duration::from_millis(CONNECT_TIMEOUT_MS));
    ureq::Agent::config_builder()
        .tls_config(tls)
        .timeout_global(Some(timeout))
        .timeout_connect(Some(connect))
        // Error statuses carry the JSON body we decode.
        .http_status_as_error(false)
        // Cluster-internal calls carrying a credential: never through an
        // environment proxy.
        .proxy(None)
        .user_agent(concat!("nvpool/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// A method nvpool sends, for messages.
fn name(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::PUT => "PUT",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        _ => "HTTP",
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--endpoint {url:?}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("{flag} {path}: cannot read the token")]
    TokenFile {
        flag: &'static str,
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
    /// The server answered with an error ([`ErrorBody`]).
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
    /// The API error kind (`not_found`, `unauthorized`…), if the server
    /// answered.
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

    /// The message with its cause, on one line (for callers that keep
    /// errors as text).
    pub fn line(&self) -> String {
        match std::error::Error::source(self) {
            Some(why) => format!("{self}: {why}"),
            None => self.to_string(),
        }
    }
}

/// Checks and normalises the endpoints: a comma-separated list of
/// `http[s]://HOST[:PORT][/PREFIX]`, each without a trailing slash (the
/// control plane's one check of base URLs, which the target applies to
/// its `--control-plane` too).
pub fn parse_endpoint(list: &str) -> Result<Vec<String>, ClientError> {
    parse_endpoints(list).map_err(|reason| ClientError::Endpoint {
        url: list.to_owned(),
        reason,
    })
}

/// Reads the bearer token of `--token-file`: see [`read_token_for`].
pub fn read_token(path: &Path) -> Result<String, ClientError> {
    read_token_for("--token-file", path)
}

/// Reads a bearer token from the file of option `flag`: its content,
/// whitespace around it trimmed, one word of printable ASCII (what every
/// nvpool server accepts as a token).
pub fn read_token_for(flag: &'static str, path: &Path) -> Result<String, ClientError> {
    let err = |source| ClientError::TokenFile {
        flag,
        path: path.to_owned(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(err)?;
    let t = text.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file must hold one token (printable ASCII without blanks)",
        )));
    }
    Ok(t.to_owned())
}

/// A server at its endpoints (or the agent at its socket). Clones share
/// which endpoint answered last. Its `Debug` shows no token.
#[derive(Clone)]
pub struct Client {
    endpoints: Arc<Endpoints>,
    token: Option<String>,
    agent: ureq::Agent,
    /// Who answers, for messages ("the control plane", "the nvpool
    /// agent"), and where (the URL, or the agent's socket).
    what: &'static str,
    shown: String,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoints", &self.endpoints)
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
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
        let tls = crate::tls::client_tls(cacert)?;
        Client::with_tls(endpoint, token, tls)
    }

    /// [`Client::new`] with TLS settings already loaded
    /// ([`crate::tls::client_tls`]): the agent loads its `--cacert` once
    /// at start and gives it to every volume's client.
    pub fn with_tls(
        endpoint: &str,
        token: Option<String>,
        tls: ureq::tls::TlsConfig,
    ) -> Result<Client, ClientError> {
        let timeout = Duration::from_millis(REQUEST_TIMEOUT_MS);
        Ok(Client::with_timeout(
            parse_endpoint(endpoint)?,
            token,
            tls,
            timeout,
            "the control plane",
        ))
    }

    /// A client of `bases` (as [`parse_endpoints`] gives them: instances
    /// of one server), each call bounded by `timeout`; `what` names the
    /// server in messages.
    pub fn with_timeout(
        bases: Vec<String>,
        token: Option<String>,
        tls: ureq::tls::TlsConfig,
        timeout: Duration,
        what: &'static str,
    ) -> Client {
        let endpoints = Endpoints::new(bases);
        Client {
            shown: endpoints.shown(),
            endpoints: Arc::new(endpoints),
            token,
            agent: config(timeout, tls).into(),
            what,
        }
    }

    /// The agent at its Unix socket `path`. Serving a volume connects to
    /// every target and may wait for a slow one, so calls get
    /// [`AGENT_TIMEOUT_MS`].
    pub fn agent(path: &Path) -> Client {
        let agent = ureq::Agent::with_parts(
            // A Unix socket: no TLS.
            config(
                Duration::from_millis(AGENT_TIMEOUT_MS),
                ureq::tls::TlsConfig::default(),
            ),
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

    /// Where the server is, for messages: `URL`, or `any of URL, URL`.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// One request through the endpoints, with the token: `json` is the
    /// body (a PUT or POST without one sends an empty body); `timeout`
    /// replaces the client's for this call.
    fn send(
        &self,
        call: Call,
        method: &Method,
        path: &str,
        json: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Response<Body>, NoAnswer> {
        self.endpoints.send(call, |base| {
            let url = format!("{base}{path}");
            if *method == Method::GET || *method == Method::DELETE {
                let r = match *method {
                    Method::GET => self.agent.get(url),
                    _ => self.agent.delete(url),
                };
                return self.prepare(r, timeout).call();
            }
            let r = match *method {
                Method::POST => self.agent.post(url),
                Method::PUT => self.agent.put(url),
                ref m => unreachable!("nvpool sends no {m} requests"),
            };
            let r = self.prepare(r, timeout);
            match json {
                Some(b) => r
                    .header("content-type", "application/json; charset=utf-8")
                    .send(b),
                None => r.send_empty(),
            }
        })
    }

    fn prepare<B>(
        &self,
        mut r: ureq::RequestBuilder<B>,
        timeout: Option<Duration>,
    ) -> ureq::RequestBuilder<B> {
        if let Some(t) = &self.token {
            r = r.header("Authorization", format!("Bearer {t}"));
        }
        match timeout {
            Some(t) => r.config().timeout_global(Some(t)).build(),
            None => r,
        }
    }

    fn encode<B: Serialize + ?Sized>(
        method: &Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<Option<Vec<u8>>, ClientError> {
        body.map(serde_json::to_vec)
            .transpose()
            .map_err(|e| ClientError::Protocol {
                method: name(method),
                path: path.to_owned(),
                reason: format!("the request body does not encode: {e}"),
            })
    }

    /// Any call; a 2xx answer, or the error it stands for. `call` says
    /// whether it may go to another endpoint after it may have arrived
    /// (by default by method, [`Call::by_method`]).
    pub fn request<B: Serialize + ?Sized>(
        &self,
        call: Call,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Option<Duration>,
    ) -> Result<Response<Body>, ClientError> {
        let json = Self::encode(&method, path, body)?;
        let r = self.send(call, &method, path, json.as_deref(), timeout);
        self.answer(r)
    }

    /// Any call, answered with its status and body (error statuses too,
    /// a body read up to [`RESPONSE_BYTES_MAX`]; one that cannot be read
    /// is empty); no answer is the error, in words. For callers that read
    /// answers themselves (the copy follower, the owner lease).
    pub fn raw<B: Serialize + ?Sized>(
        &self,
        call: Call,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Option<Duration>,
    ) -> Result<(u16, Vec<u8>), String> {
        let json = Self::encode(&method, path, body).map_err(|e| e.line())?;
        let mut resp = self
            .send(call, &method, path, json.as_deref(), timeout)
            .map_err(|source| self.unreachable(source).line())?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(RESPONSE_BYTES_MAX)
            .read_to_vec()
            .unwrap_or_default();
        Ok((status, body))
    }

    /// A 2xx response's body as `T`.
    pub fn decode<T: DeserializeOwned>(
        method: Method,
        path: &str,
        mut resp: Response<Body>,
    ) -> Result<T, ClientError> {
        resp.body_mut()
            .with_config()
            .limit(RESPONSE_BYTES_MAX)
            .read_json()
            .map_err(|e| ClientError::Protocol {
                method: name(&method),
                path: path.to_owned(),
                reason: e.to_string(),
            })
    }

    /// A call whose answer is JSON: the status (201 created, 200 existed)
    /// and the body.
    fn json<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(u16, T), ClientError> {
        let resp = self.request(
            Call::by_method(method.as_str()),
            method.clone(),
            path,
            body,
            None,
        )?;
        let status = resp.status().as_u16();
        Ok((status, Self::decode(method, path, resp)?))
    }

    /// A call answered without a body worth reading (204).
    fn empty<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(), ClientError> {
        let call = Call::by_method(method.as_str());
        let mut resp = self.request(call, method, path, body, None)?;
        // Drained, so the connection can be used again.
        let _ = resp.body_mut().read_to_vec();
        Ok(())
    }

    pub fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.json(Method::GET, path, NO_BODY).map(|(_, v)| v)
    }

    /// PUT with a JSON body; also returns the status (201 created, 200 existed).
    pub fn put<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(u16, T), ClientError> {
        self.json(Method::PUT, path, Some(body))
    }

    /// PUT without a body; also returns the status.
    pub fn put_empty<T: DeserializeOwned>(&self, path: &str) -> Result<(u16, T), ClientError> {
        self.json(Method::PUT, path, NO_BODY)
    }

    /// POST, sent again to another endpoint only when it never left
    /// ([`Call::Once`]).
    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        self.json(Method::POST, path, Some(body)).map(|(_, v)| v)
    }

    /// PUT with a JSON body, for calls answered without one (204).
    pub fn put_no_content<B: Serialize>(&self, path: &str, body: &B) -> Result<(), ClientError> {
        self.empty(Method::PUT, path, Some(body))
    }

    pub fn delete(&self, path: &str) -> Result<(), ClientError> {
        self.empty(Method::DELETE, path, NO_BODY)
    }

    /// DELETE, for calls that answer with what they removed.
    pub fn delete_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.json(Method::DELETE, path, NO_BODY).map(|(_, v)| v)
    }

    fn unreachable(&self, source: NoAnswer) -> ClientError {
        ClientError::Unreachable {
            what: self.what,
            url: self.shown.clone(),
            source,
        }
    }

    /// A 2xx response, or the error it stands for.
    fn answer(&self, r: Result<Response<Body>, NoAnswer>) -> Result<Response<Body>, ClientError> {
        let mut resp = r.map_err(|source| self.unreachable(source))?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(resp);
        }
        let body: ErrorBody = resp
            .body_mut()
            .with_config()
            .limit(ERROR_BYTES_MAX)
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

    #[test]
    fn a_token_file_holds_one_printable_word() {
        let dir = std::env::temp_dir().join(format!("nvpool-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t");
        std::fs::write(&f, "  s3cret-Token_0123456789\n").unwrap();
        assert_eq!(read_token(&f).unwrap(), "s3cret-Token_0123456789");
        for bad in ["", " \n", "two words", "tab\there", "caf\u{e9}-token"] {
            std::fs::write(&f, bad).unwrap();
            let e = read_token_for("--control-plane-token-file", &f).unwrap_err();
            assert!(
                e.to_string().starts_with("--control-plane-token-file "),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
