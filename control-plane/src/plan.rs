//! The connection plan: what a host needs to reach an attached volume.
//!
//! Attaching a volume to a host exports each of the volume's extents as one
//! namespace of that host's subsystem on the extent's target; the plan
//! lists where to connect for each. The control plane returns it from
//! `PUT /v1/volumes/{uuid}/attachments/{host_nqn}`, the CLI prints it and
//! the initiator's volume engine connects by it, so the types live in
//! `nvpool-layout` ([`plan`](nvpool_layout::plan)) and are re-exported here.

pub use nvpool_layout::plan::*;
