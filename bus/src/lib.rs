//! Small NATS helpers shared by Converge's binaries: connecting with retry (with user and
//! password, a credentials file or an nkey, optionally over TLS), creating or opening the
//! protocol's KV buckets and progress stream, typed KV reads/writes, watches and publishes,
//! permission violations turned into errors, and counting rejected messages.
//!
//! Kept out of `converge-common` so that `common` stays free of async dependencies.
//!
//! Modules, each re-exported here: `args` (the `--nats-*` flags), `error` ([`BusError`]),
//! `connect` (connecting with retry), `setup` (creating or opening the streams), `bus` (the
//! [`Bus`] handle), `kv` (typed KV operations), `publish`, `follow` ([`follow_kv`]), `typed`
//! (a bucket followed as typed changes: [`follow_kv_typed`], [`KvDecoder`], [`KvStore`]),
//! `direct` ([`read_after`]), `rejects` ([`Rejects`]), `process` (logging, signals, time),
//! `denials` (permission violations), `secure` (credentials and TLS); [`metrics`] is public.

mod args;
mod bus;
mod connect;
mod denials;
mod direct;
mod error;
mod follow;
mod kv;
pub mod metrics;
mod process;
mod publish;
pub use publish::{Delivered, PROGRESS_PATIENCE, ReportLost};
mod rejects;
mod secure;
mod setup;
mod typed;

pub use args::{DEFAULT_NATS_URL, NatsArgs, humantime_duration};
pub use async_nats;
pub use bus::{Bus, QueueBuckets};
pub use connect::{connect, connect_tracked};
pub use denials::{Denial, DenialKind, Denials};
pub use direct::read_after;
pub use error::BusError;
pub use follow::{KV_QUIET, KV_STALL, follow_kv};
pub use kv::{KEYS_ATTEMPT, KEYS_ATTEMPTS, Loaded};
pub use process::{init_test_tracing, init_tracing, shutdown_signal, unix_now};
pub use rejects::{LOG_BURST, LOG_PER_S, MAX_SOURCES, OTHER_SOURCES, Rejects};
pub use secure::{Secret, redact_url, url_user};
pub use setup::{Setup, kv_stream_config, progress_stream_config};
pub use typed::{KvChange, KvDecoder, KvStore, follow_kv_typed};
