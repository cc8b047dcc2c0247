//! The one client side of nvpool's REST APIs (feature `client`): which
//! control-plane instance a request goes to, and when it may go to the
//! next one. The CLI and the agent (`nvpool_agent::client`) and the
//! target's registrar (`nvpool_target::register`) each send their calls
//! through [`Endpoints::send`]; none of them has a failover loop of its own.
//!
//! ```text
//!   send(call, attempt)
//!     └─ for each endpoint, from the last one that answered:
//!          attempt(base) ─┬─ an answer other than 503 ──► remember it, return the answer
//!                         ├─ 503 (busy, not the leader) ─► next
//!                         ├─ no connection (refused, no route,
//!                         │   DNS, TLS handshake) ───────► next
//!                         └─ broken after the request may
//!                             have gone (reset, timeout) ─► next if `Call::Idempotent`,
//!                                                           else stop: the error
//!     all tried: the last 503 answer if one came, else NoAnswer naming each endpoint
//! ```
//!
//! A 4xx (or any answer but 503) is final: the instance that answered
//! speaks for the whole control plane, since every instance serves the
//! same store. ARCHITECTURE C22 says which calls are idempotent.

use crate::rest::parse_endpoints;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Whether a request may be sent again to another instance after it may
/// already have reached one (the connection broke after it was written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Doing it twice is doing it once: GET, PUT, DELETE, and the POSTs
    /// that converge (a target's registration, its owner-lease renewal).
    Idempotent,
    /// A second copy could act again (`POST …/resync`, a rebalance that
    /// starts moves): tried elsewhere only when it surely never left.
    Once,
}

impl Call {
    /// By HTTP method: every POST is [`Call::Once`] unless the caller
    /// knows better.
    pub fn by_method(method: &str) -> Call {
        if method.eq_ignore_ascii_case("POST") {
            Call::Once
        } else {
            Call::Idempotent
        }
    }
}

/// A list of control-plane base URLs, instances of one control plane,
/// and which of them answered last (where the next request starts).
#[derive(Debug)]
pub struct Endpoints {
    bases: Vec<String>,
    preferred: AtomicUsize,
}

/// One endpoint that gave no usable answer.
#[derive(Debug)]
pub struct Failure {
    pub endpoint: String,
    pub error: ureq::Error,
}

/// No instance answered. `Display` names every endpoint tried with its
/// reason, and says when the rest were left alone because the request may
/// already have been received.
#[derive(Debug)]
pub struct NoAnswer {
    pub failures: Vec<Failure>,
    /// Endpoints not tried: the request was not [`Call::Idempotent`] and
    /// may have reached the last one tried.
    pub not_replayed: usize,
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.failures.as_slice() {
            [one] if self.not_replayed == 0 => write!(f, "{}", one.error)?,
            all => {
                for (i, x) in all.iter().enumerate() {
                    let sep = if i == 0 { "" } else { "; " };
                    write!(f, "{sep}{}: {}", x.endpoint, x.error)?;
                }
            }
        }
        if self.not_replayed > 0 {
            write!(
                f,
                " (the request may have arrived, so it was not sent to the {} other endpoint(s))",
                self.not_replayed
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for NoAnswer {}

impl Endpoints {
    /// `bases` as [`parse_endpoints`] gives them; at least one.
    pub fn new(bases: Vec<String>) -> Endpoints {
        assert!(!bases.is_empty(), "a client needs an endpoint");
        Endpoints {
            bases,
            preferred: AtomicUsize::new(0),
        }
    }

    /// A comma-separated list (see [`parse_endpoints`]).
    pub fn parse(list: &str) -> Result<Endpoints, String> {
        parse_endpoints(list).map(Endpoints::new)
    }

    pub fn bases(&self) -> &[String] {
        &self.bases
    }

    /// Where the next request goes first.
    pub fn current(&self) -> &str {
        &self.bases[self.preferred.load(Ordering::Relaxed) % self.bases.len()]
    }

    /// For messages: `URL`, or `any of URL, URL`.
    pub fn shown(&self) -> String {
        match self.bases.as_slice() {
            [one] => one.clone(),
            all => format!("any of {}", all.join(", ")),
        }
    }

    /// Sends one request through `attempt(base)`, failing over as the
    /// module docs draw. Returns the answer (any status; a 503 only when
    /// every instance was busy or unreachable and one said 503).
    pub fn send(
        &self,
        call: Call,
        mut attempt: impl FnMut(&str) -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<ureq::http::Response<ureq::Body>, NoAnswer> {
        let n = self.bases.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut failures = Vec::new();
        let mut busy = None;
        for k in 0..n {
            let i = (first + k) % n;
            let base = &self.bases[i];
            match attempt(base) {
                Ok(answer) if answer.status().as_u16() == 503 => busy = Some(answer),
                Ok(answer) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(answer);
                }
                Err(error) => {
                    let after = match Outcome::of(&error) {
                        Outcome::Final => Some(0),
                        Outcome::NotSent => None,
                        Outcome::MaybeSent if call == Call::Once => Some(n - k - 1),
                        Outcome::MaybeSent => None,
                    };
                    failures.push(Failure {
                        endpoint: base.clone(),
                        error,
                    });
                    if let Some(not_replayed) = after {
                        return Err(NoAnswer {
                            failures,
                            not_replayed,
                        });
                    }
                }
            }
        }
        match busy {
            Some(answer) => Ok(answer),
            None => Err(NoAnswer {
                failures,
                not_replayed: 0,
            }),
        }
    }
}

/// What a failed attempt says about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// No connection was made (or TLS failed before a byte of the
    /// request): no instance has seen it.
    NotSent,
    /// The connection broke or timed out after the request may have been
    /// written.
    MaybeSent,
    /// Not about the endpoint (a bad URL, a body that does not encode):
    /// every other would fail the same way.
    Final,
}

/// Whether a call failed in TLS (an untrusted or misnamed certificate, a
/// failed handshake): ureq reports the handshake's own errors as an I/O
/// error around rustls'.
pub fn is_tls(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) => true,
        ureq::Error::Io(io) => io.get_ref().is_some_and(|x| x.is::<rustls::Error>()),
        _ => false,
    }
}

impl Outcome {
    fn of(e: &ureq::Error) -> Outcome {
        use std::io::ErrorKind as K;
        use ureq::{Error as E, Timeout as T};
        match e {
            E::HostNotFound | E::ConnectionFailed => Outcome::NotSent,
            // A failed handshake: the request was never sent.
            e if is_tls(e) => Outcome::NotSent,
            E::Timeout(T::Resolve | T::Connect) => Outcome::NotSent,
            E::Io(io) => match io.kind() {
                K::ConnectionRefused
                | K::AddrNotAvailable
                | K::HostUnreachable
                | K::NetworkUnreachable
                | K::NotFound => Outcome::NotSent,
                _ => Outcome::MaybeSent,
            },
            E::Timeout(_) | E::Protocol(_) | E::BodyStalled => Outcome::MaybeSent,
            _ => Outcome::Final,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into()
    }

    /// A port nothing listens on.
    fn dead() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    }

    /// Answers `n` requests with `status`, one connection each; `reset`
    /// instead drops the connection after reading the request.
    fn server(status: u16, n: usize, reset: bool) -> (String, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let t = std::thread::spawn(move || {
            for _ in 0..n {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                if reset {
                    continue;
                }
                let body = format!("{{\"status\":{status}}}");
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (url, t)
    }

    fn get(e: &Endpoints, call: Call) -> Result<u16, NoAnswer> {
        let a = agent();
        e.send(call, |b| a.get(format!("{b}/x")).call())
            .map(|r| r.status().as_u16())
    }

    #[test]
    fn a_dead_endpoint_is_skipped_and_the_live_one_remembered() {
        let (live, t) = server(200, 2, false);
        let e = Endpoints::new(vec![dead(), live.clone()]);
        assert_eq!(get(&e, Call::Once).unwrap(), 200);
        assert_eq!(e.current(), live);
        assert_eq!(get(&e, Call::Once).unwrap(), 200);
        t.join().unwrap();
    }

    #[test]
    fn a_4xx_is_final_and_a_503_is_not() {
        let (a, ta) = server(404, 1, false);
        let (b, tb) = server(200, 1, false);
        let e = Endpoints::new(vec![a.clone(), b.clone()]);
        assert_eq!(get(&e, Call::Idempotent).unwrap(), 404);
        ta.join().unwrap();

        let (c, tc) = server(503, 1, false);
        let e = Endpoints::new(vec![c, b.clone()]);
        assert_eq!(get(&e, Call::Once).unwrap(), 200);
        assert_eq!(e.current(), b);
        tb.join().unwrap();
        tc.join().unwrap();

        // Every instance busy: the 503 is the answer.
        let (d, td) = server(503, 1, false);
        let e = Endpoints::new(vec![d, dead()]);
        assert_eq!(get(&e, Call::Idempotent).unwrap(), 503);
        td.join().unwrap();
    }

    #[test]
    fn a_request_that_may_have_arrived_is_replayed_only_when_idempotent() {
        let (a, ta) = server(0, 1, true);
        let (b, tb) = server(200, 1, false);
        let e = Endpoints::new(vec![a.clone(), b.clone()]);
        let err = get(&e, Call::Once).unwrap_err();
        assert_eq!((err.failures.len(), err.not_replayed), (1, 1));
        assert!(err.to_string().contains("not sent to the 1 other"), "{err}");
        ta.join().unwrap();

        let (a, ta) = server(0, 1, true);
        let e = Endpoints::new(vec![a, b]);
        assert_eq!(get(&e, Call::Idempotent).unwrap(), 200);
        ta.join().unwrap();
        tb.join().unwrap();
    }

    #[test]
    fn all_dead_names_every_endpoint() {
        let (x, y) = (dead(), dead());
        let e = Endpoints::new(vec![x.clone(), y.clone()]);
        let err = get(&e, Call::Idempotent).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{x}: ")) && err.contains(&format!("; {y}: ")),
            "{err}"
        );
        assert_eq!(e.shown(), format!("any of {x}, {y}"));
    }

    #[test]
    fn methods() {
        assert_eq!(Call::by_method("post"), Call::Once);
        for m in ["GET", "PUT", "DELETE"] {
            assert_eq!(Call::by_method(m), Call::Idempotent);
        }
    }
}
