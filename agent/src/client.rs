//! The agent's calls to the control plane: the one client of nvpool's
//! APIs (`nvpool_api::client`, re-exported here for the agent's callers),
//! and [`Follower`], through which a served volume follows its copies.

pub use nvpool_api::client::*;
use nvpool_api::http::Call;
use nvpool_initiator::follow::ControlPlane;
use std::time::Duration;
use ureq::http::Method;

/// The control plane as the copy follower (`nvpool_initiator::follow`)
/// calls it, with the volume's token: reads with their own timeout (a
/// long-poll), PUTs.
#[derive(Debug, Clone)]
pub struct Follower(pub Client);

impl ControlPlane for Follower {
    fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
        self.0
            .raw(Call::Idempotent, Method::GET, path, NO_BODY, Some(timeout))
    }

    fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>), String> {
        self.0
            .raw(Call::Idempotent, Method::PUT, path, Some(body), None)
    }
}
