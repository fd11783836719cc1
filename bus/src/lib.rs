//! Small NATS helpers shared by Converge's binaries: connecting with retry, creating the
//! protocol's KV buckets and progress stream, typed KV reads/writes and publishes, and
//! counting rejected messages.
//!
//! Kept out of `converge-common` so that `common` stays free of async dependencies.

use async_nats::jetstream::{self, kv, stream};
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use converge_common::messages::{DecodeError, Message, decode, encode};
use converge_common::subjects;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

pub use async_nats;

/// Default NATS URL of every binary.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// How to reach NATS; flattened into each binary's command line.
#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated. `nats://user:password@host:port` works too.
    #[arg(long = "nats-url", env = "CONVERGE_NATS_URL", default_value = DEFAULT_NATS_URL)]
    pub url: String,
    /// NATS credentials file (JWT + nkey seed), if the server requires one.
    #[arg(long = "nats-creds", env = "CONVERGE_NATS_CREDS")]
    pub creds: Option<PathBuf>,
    /// Give up connecting after this long (e.g. `30s`); unset = keep retrying.
    #[arg(long = "nats-connect-timeout", env = "CONVERGE_NATS_CONNECT_TIMEOUT", value_parser = humantime_duration)]
    pub connect_timeout: Option<Duration>,
}

/// Parses a duration such as `500ms`, `10s` or `2m` (humantime syntax) for clap.
pub fn humantime_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (write e.g. 500ms, 10s or 2m)"))
}

/// Errors of the bus helpers, by operation.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error("cannot read credentials file {path}: {source}")]
    Credentials {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot create or open {what}: {message} (is JetStream enabled, `nats-server -js`, version 2.10 or later?)"
    )]
    Setup { what: String, message: String },
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
}

/// Connects to NATS as `name`, retrying with capped exponential backoff (0.1 s doubling up
/// to 5 s) until connected or `connect_timeout` passes. Reconnects after a later
/// disconnect are handled by the client.
pub async fn connect(args: &NatsArgs, name: &str) -> Result<async_nats::Client, BusError> {
    let attempt = || async {
        let mut opts = match &args.creds {
            Some(path) => async_nats::ConnectOptions::with_credentials_file(path.clone())
                .await
                .map_err(|source| BusError::Credentials {
                    path: path.clone(),
                    source,
                })?,
            None => async_nats::ConnectOptions::new(),
        };
        opts = opts
            .name(name)
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .event_callback(|event| async move {
                match event {
                    async_nats::Event::Disconnected => tracing::warn!("disconnected from NATS"),
                    async_nats::Event::Connected => tracing::info!("connected to NATS"),
                    other => tracing::debug!(event = %other, "NATS event"),
                }
            });
        opts.connect(args.url.as_str())
            .await
            .map_err(|source| BusError::Connect {
                url: args.url.clone(),
                source,
            })
    };
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times();
    if let Some(limit) = args.connect_timeout {
        backoff = backoff.with_total_delay(Some(limit));
    }
    attempt
        .retry(backoff)
        .when(|e| matches!(e, BusError::Connect { .. }))
        .notify(|e, after| tracing::warn!("{e}; retrying in {after:?}"))
        .await
}

/// Handles on the protocol's JetStream objects.
#[derive(Clone)]
pub struct Bus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    /// KV `converge-jobs`: job specs.
    pub jobs: kv::Store,
    /// KV `converge-job-status`: job statuses.
    pub status: kv::Store,
    /// KV `converge-plans`: host plans.
    pub plans: kv::Store,
    /// KV `converge-hosts`: latest telemetry per host (heartbeat).
    pub hosts: kv::Store,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus").finish_non_exhaustive()
    }
}

fn kv_config(bucket: &str) -> kv::Config {
    let (description, history, max_age) = match bucket {
        subjects::BUCKET_HOSTS => (
            "latest telemetry per host (heartbeat)",
            1,
            Duration::from_secs(24 * 3600),
        ),
        subjects::BUCKET_PLANS => ("desired workers per host", 5, Duration::ZERO),
        subjects::BUCKET_JOBS => ("job specs", 5, Duration::ZERO),
        _ => ("job statuses", 5, Duration::ZERO),
    };
    kv::Config {
        bucket: bucket.to_string(),
        description: description.to_string(),
        history,
        max_age,
        max_value_size: converge_common::MAX_MESSAGE_BYTES as i32,
        ..Default::default()
    }
}

impl Bus {
    /// Creates (or opens, if they exist) the four KV buckets and the progress stream.
    /// Idempotent: every process calls it on start, so start order does not matter.
    pub async fn open(client: async_nats::Client) -> Result<Self, BusError> {
        let js = jetstream::new(client.clone());
        let mut stores = Vec::new();
        for bucket in subjects::ALL_BUCKETS {
            let store = js
                .create_or_update_key_value(kv_config(bucket))
                .await
                .map_err(|e| BusError::Setup {
                    what: format!("KV bucket {bucket}"),
                    message: e.to_string(),
                })?;
            stores.push(store);
        }
        js.get_or_create_stream(stream::Config {
            name: subjects::PROGRESS_STREAM.to_string(),
            description: Some("training progress reports, one per worker progress line".into()),
            subjects: vec![subjects::PROGRESS_ALL.to_string()],
            max_messages_per_subject: subjects::PROGRESS_MAX_PER_JOB,
            max_age: Duration::from_secs(subjects::PROGRESS_MAX_AGE_S),
            max_message_size: converge_common::MAX_MESSAGE_BYTES as i32,
            ..Default::default()
        })
        .await
        .map_err(|e| BusError::Setup {
            what: format!("stream {}", subjects::PROGRESS_STREAM),
            message: e.to_string(),
        })?;
        let mut it = stores.into_iter();
        let mut next = || it.next().expect("four buckets");
        Ok(Self {
            jobs: next(),
            status: next(),
            plans: next(),
            hosts: next(),
            client,
            js,
        })
    }

    /// Writes `msg` under `key`; returns the new revision.
    pub async fn put<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
        msg: &T,
    ) -> Result<u64, BusError> {
        store
            .put(key, Bytes::from(encode(msg)))
            .await
            .map_err(|e| BusError::Kv {
                bucket: store.name.clone(),
                key: key.to_string(),
                message: e.to_string(),
            })
    }

    /// Reads and decodes `key`; `Ok(None)` if absent or deleted.
    pub async fn get<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
    ) -> Result<Option<(T, u64)>, BusError> {
        let entry = store.entry(key).await.map_err(|e| BusError::Kv {
            bucket: store.name.clone(),
            key: key.to_string(),
            message: e.to_string(),
        })?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let msg = decode(&entry.value).map_err(|source| BusError::Decode {
            bucket: store.name.clone(),
            key: key.to_string(),
            source,
        })?;
        Ok(Some((msg, entry.revision)))
    }

    /// Reads every live key of `store`, decoding each value. Values that fail to decode are
    /// counted in `rejects` and skipped.
    pub async fn load_all<T: Message>(
        &self,
        store: &kv::Store,
        rejects: &Rejects,
    ) -> Result<BTreeMap<String, (T, u64)>, BusError> {
        use futures::TryStreamExt;
        let kv_err = |e: &dyn std::fmt::Display| BusError::Kv {
            bucket: store.name.clone(),
            key: "*".into(),
            message: e.to_string(),
        };
        let keys: Vec<String> = store
            .keys()
            .await
            .map_err(|e| kv_err(&e))?
            .try_collect()
            .await
            .map_err(|e| kv_err(&e))?;
        let mut out = BTreeMap::new();
        for key in keys {
            match self.get::<T>(store, &key).await {
                Ok(Some(v)) => {
                    out.insert(key, v);
                }
                Ok(None) => {}
                Err(BusError::Decode { source, .. }) => {
                    rejects.record(&format!("kv:{}", store.name), &key, &source)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Publishes on a core subject (best effort: may be lost across a disconnect).
    pub async fn publish<T: Message>(&self, subject: String, msg: &T) -> Result<(), BusError> {
        self.client
            .publish(subject.clone(), Bytes::from(encode(msg)))
            .await
            .map_err(|e| BusError::Publish {
                subject,
                message: e.to_string(),
            })
    }

    /// Publishes to JetStream and waits for the server's acknowledgement.
    pub async fn publish_acked<T: Message>(
        &self,
        subject: String,
        msg: &T,
    ) -> Result<(), BusError> {
        let err = |e: &dyn std::fmt::Display| BusError::Publish {
            subject: subject.clone(),
            message: e.to_string(),
        };
        let ack = self
            .js
            .publish(subject.clone(), Bytes::from(encode(msg)))
            .await
            .map_err(|e| err(&e))?;
        ack.await.map_err(|e| err(&e))?;
        Ok(())
    }
}

/// Counts messages a process refused, by where they came from and why. Every refusal is
/// logged once at `warn`; the process keeps serving.
#[derive(Debug, Default)]
pub struct Rejects {
    counts: Mutex<BTreeMap<(String, &'static str), u64>>,
}

impl Rejects {
    /// Records one refused message from `source` (a subject or `kv:<bucket>`).
    pub fn record(&self, source: &str, key: &str, error: &DecodeError) {
        tracing::warn!(source, key, kind = error.kind(), "refused message: {error}");
        let mut counts = self.counts.lock().expect("not poisoned");
        *counts
            .entry((source.to_string(), error.kind()))
            .or_default() += 1;
    }

    /// Decodes `bytes`, recording a refusal on error.
    pub fn decode<T: Message>(&self, source: &str, key: &str, bytes: &[u8]) -> Option<T> {
        match decode(bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                self.record(source, key, &e);
                None
            }
        }
    }

    /// Total refusals so far.
    pub fn total(&self) -> u64 {
        self.counts.lock().expect("not poisoned").values().sum()
    }

    /// Refusals by (source, kind).
    pub fn snapshot(&self) -> BTreeMap<(String, &'static str), u64> {
        self.counts.lock().expect("not poisoned").clone()
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `default_filter`, e.g. `info`).
pub fn init_tracing(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Resolves on the next SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Current time as UNIX seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(humantime_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_duration("fast").unwrap_err().contains("10s"));
    }
}
