//! [`BusError`]: the errors of the bus helpers, by operation.

use crate::Denial;
use converge_common::DecodeError;
use std::path::PathBuf;

/// Errors of the bus helpers, by operation.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// `url` has its password replaced by `***`.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    /// The server refused the credentials, or the TLS handshake failed: retrying would not
    /// help.
    #[error("NATS at {url} refused the connection ({auth}): {source}; {hint}")]
    Refused {
        url: String,
        auth: String,
        hint: &'static str,
        source: async_nats::ConnectError,
    },
    #[error("cannot read {what} {path}: {source}")]
    File {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("NATS settings: {0}")]
    Config(String),
    #[error(
        "cannot create or open {what}: {message} (is JetStream enabled, `nats-server -js`, version 2.10 or later?)"
    )]
    Setup { what: String, message: String },
    #[error(
        "{what} is missing and this NATS user may not create it ({denial}): start the \
         allocator first, or give this user stream-create rights"
    )]
    Missing { what: String, denial: Denial },
    /// The server refused the operation: the user's permissions do not allow it.
    #[error("NATS refused {action}: {denial} (see docs/security.md for each role's permissions)")]
    Denied { action: String, denial: Denial },
    #[error("KV {bucket}/{key}: {message}")]
    Kv {
        bucket: String,
        key: String,
        message: String,
    },
    #[error("KV {bucket}/{key} holds a value this build refuses: {source}")]
    Decode {
        bucket: String,
        key: String,
        source: DecodeError,
    },
    #[error("publish to {subject}: {message}")]
    Publish { subject: String, message: String },
    /// A compare-and-set write found the key changed since the writer read it (another
    /// writer got there first); nothing was written.
    #[error(
        "KV {bucket}/{key} changed since revision {expected:?} was read (another writer); not written"
    )]
    Conflict {
        bucket: String,
        key: String,
        /// The revision the writer expected; `None`: it expected no value.
        expected: Option<u64>,
    },
}

impl BusError {
    /// Whether the server refused the operation for lack of permissions.
    pub fn is_denied(&self) -> bool {
        matches!(self, Self::Denied { .. } | Self::Missing { .. })
    }
}
