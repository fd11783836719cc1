//! The protocol's codec, at the bottom of `converge-common` (it imports no other module of
//! the crate): the version every message carries, the size limit, the [`Message`] trait and
//! [`decode`] / [`encode`]. Message types ([`crate::messages`], [`crate::queues`],
//! [`crate::jobspec`]) build on it.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Version carried by every message (`"protocol": 1`). A reader refuses any other value.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest message any Converge process accepts, in bytes (1 MiB, NATS's default `max_payload`).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// A message of protocol v1: it knows its version and can check its own content.
pub trait Message: Serialize + DeserializeOwned {
    /// The `protocol` field.
    fn protocol(&self) -> u32;
    /// Content checks beyond what the types enforce (finite numbers, consistent ranks...).
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Why a received message was refused. Readers count and log these; they are never fatal.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("unsupported protocol version {found} (this build speaks {PROTOCOL_VERSION})")]
    WrongVersion { found: u32 },
    #[error("invalid message: {0}")]
    Invalid(String),
}

impl DecodeError {
    /// A short label for metrics and logs: `too_large`, `malformed`, `wrong_version`, `invalid`.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::TooLarge(_) => "too_large",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::WrongVersion { .. } => "wrong_version",
            DecodeError::Invalid(_) => "invalid",
        }
    }
}

/// Decodes and checks a message read from the bus.
pub fn decode<T: Message>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge(bytes.len()));
    }
    // Check the version before the full shape, so a v2 message says "wrong version".
    #[derive(Deserialize)]
    struct Versioned {
        protocol: Option<u32>,
    }
    let v: Versioned = serde_json::from_slice(bytes)?;
    match v.protocol {
        Some(PROTOCOL_VERSION) => {}
        Some(found) => return Err(DecodeError::WrongVersion { found }),
        None => return Err(DecodeError::Invalid("missing field `protocol`".into())),
    }
    let msg: T = serde_json::from_slice(bytes)?;
    msg.validate().map_err(DecodeError::Invalid)?;
    Ok(msg)
}

/// Encodes a message as JSON.
pub fn encode<T: Message>(msg: &T) -> Vec<u8> {
    serde_json::to_vec(msg).expect("protocol types always serialize")
}

/// The `protocol` field's value when a message or spec omits it.
pub(crate) fn default_protocol() -> u32 {
    PROTOCOL_VERSION
}
