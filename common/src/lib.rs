//! Converge's wire protocol, version 1: every message type, subject and KV bucket name, and
//! the validation every process applies to what it reads from the bus.
//!
//! This crate deliberately has no async dependency: it is plain data plus checks, so the
//! agent, the allocator, the CLI and the simulator share one definition of the protocol.

pub mod codec;
pub mod contract;
pub mod ids;
pub mod jobspec;
pub mod labels;
pub mod messages;
pub mod queues;
pub mod subjects;
pub mod sweep;

pub use codec::{DecodeError, MAX_MESSAGE_BYTES, Message, PROTOCOL_VERSION, decode, encode};
pub use ids::{HostId, IdError, JobId, QueueId};
pub use jobspec::{
    BatchSpec, EarlyStopRule, EarlyStopSpec, JobSpec, JobSpecError, PlateauSpec, ShadowAlgorithm,
    ShadowSpec, StopSpec, SyncArch,
};
pub use messages::*;
pub use queues::{DEFAULT_QUEUE, PriorityClass, QueueSpec, QueueStatus};
