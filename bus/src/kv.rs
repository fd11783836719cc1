//! Typed KV operations of the [`Bus`]: get, put (also compare-and-set), watching one key,
//! and loading a whole bucket.

use crate::{Bus, BusError, DenialKind, Rejects};
use async_nats::jetstream::{self, kv};
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use converge_common::{Message, decode, encode};
use futures::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

/// Prefix of the JetStream API subjects (no JetStream domain).
const JS_API: &str = "$JS.API";

impl Bus {
    /// Writes `msg` under `key`; returns the new revision.
    pub async fn put<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
        msg: &T,
    ) -> Result<u64, BusError> {
        let subject = format!("{}{key}", store.prefix);
        let put = async {
            store
                .put(key, Bytes::from(encode(msg)))
                .await
                .map_err(|e| BusError::Kv {
                    bucket: store.name.clone(),
                    key: key.to_string(),
                    message: e.to_string(),
                })
        };
        self.refusable(
            || format!("a write of KV {}/{key}", store.name),
            &subject,
            put,
        )
        .await
    }

    /// Writes `msg` under `key` only if the key is still as the writer last saw it:
    /// at revision `expected`, or absent (or deleted) for `None`. Returns the new revision;
    /// [`BusError::Conflict`] when another writer changed the key since (nothing written).
    /// The allocator writes plans and statuses this way, so that a replaced leader's late
    /// write cannot overwrite what the new leader wrote.
    pub async fn put_expecting<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
        msg: &T,
        expected: Option<u64>,
    ) -> Result<u64, BusError> {
        let subject = format!("{}{key}", store.prefix);
        let kv_error = |message: String| BusError::Kv {
            bucket: store.name.clone(),
            key: key.to_string(),
            message,
        };
        let conflict = || BusError::Conflict {
            bucket: store.name.clone(),
            key: key.to_string(),
            expected,
        };
        let value = Bytes::from(encode(msg));
        let put = async {
            match expected {
                Some(revision) => store.update(key, value, revision).await.map_err(|e| {
                    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                        conflict()
                    } else {
                        kv_error(e.to_string())
                    }
                }),
                None => store.create(key, value).await.map_err(|e| {
                    if e.kind() == kv::CreateErrorKind::AlreadyExists {
                        conflict()
                    } else {
                        kv_error(e.to_string())
                    }
                }),
            }
        };
        self.refusable(
            || format!("a write of KV {}/{key}", store.name),
            &subject,
            put,
        )
        .await
    }

    /// Reads and decodes `key`; `Ok(None)` if absent or deleted.
    pub async fn get<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
    ) -> Result<Option<(T, u64)>, BusError> {
        let Some(entry) = self.latest_entry(store, key).await? else {
            return Ok(None);
        };
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

    /// The latest entry of `key` as stored, whatever it holds: a value (decodable or not),
    /// a delete or a purge marker; `None` when the key has none. Errors as [`Bus::get`]'s,
    /// but for decoding.
    pub async fn latest_entry(
        &self,
        store: &kv::Store,
        key: &str,
    ) -> Result<Option<kv::Entry>, BusError> {
        let subject = format!(
            "{JS_API}.DIRECT.GET.{}.{}{key}",
            store.stream_name, store.prefix
        );
        let read = async {
            store.entry(key).await.map_err(|e| BusError::Kv {
                bucket: store.name.clone(),
                key: key.to_string(),
                message: e.to_string(),
            })
        };
        self.refusable(
            || format!("a read of KV {}/{key}", store.name),
            &subject,
            read,
        )
        .await
    }

    /// Follows one key of `store`: with `with_history` its current value first (if any),
    /// then every change (puts, deletes, purges) as a [`kv::Entry`].
    ///
    /// Unlike [`kv::Store::watch`], which creates its consumer through
    /// `$JS.API.CONSUMER.CREATE.<stream>` (a subject that does not name the key, so a
    /// permission cannot tell keys apart), this names the consumer, so the request goes to
    /// `$JS.API.CONSUMER.CREATE.<stream>.<name>.$KV.<bucket>.<key>`: an agent's NATS user
    /// may watch its own plan key and no other (the server checks that the filter in the
    /// subject is the consumer's filter). A refused watch is [`BusError::Denied`].
    pub async fn watch_key(
        &self,
        store: &kv::Store,
        key: &str,
        with_history: bool,
    ) -> Result<futures::stream::BoxStream<'static, Result<kv::Entry, BusError>>, BusError> {
        use jetstream::consumer::{DeliverPolicy, ReplayPolicy, push};
        let filter = format!("{}{key}", store.prefix);
        let inbox = self.client.new_inbox();
        let name = format!(
            "watch_{}",
            inbox.rsplit('.').next().unwrap_or("x").replace('-', "_")
        );
        let subject = format!(
            "{JS_API}.CONSUMER.CREATE.{}.{name}.{filter}",
            store.stream_name
        );
        let kv_err = |e: &dyn std::fmt::Display| BusError::Kv {
            bucket: store.name.clone(),
            key: key.to_string(),
            message: format!("watch: {e}"),
        };
        let create = async {
            let consumer = store
                .stream
                .create_consumer(push::OrderedConfig {
                    name: Some(name.clone()),
                    deliver_subject: inbox.clone(),
                    description: Some("converge key watch".to_string()),
                    filter_subject: filter.clone(),
                    replay_policy: ReplayPolicy::Instant,
                    deliver_policy: if with_history {
                        DeliverPolicy::LastPerSubject
                    } else {
                        DeliverPolicy::New
                    },
                    ..Default::default()
                })
                .await
                .map_err(|e| kv_err(&e))?;
            consumer.messages().await.map_err(|e| kv_err(&e))
        };
        let messages = self
            .denials
            .guard(
                |d| d.subject == subject || (d.subject == inbox && d.kind == DenialKind::Subscribe),
                create,
            )
            .await
            .map_err(|denial| BusError::Denied {
                action: format!("a watch of KV {}/{key}", store.name),
                denial,
            })??;
        let bucket = store.name.clone();
        let prefix = store.prefix.clone();
        let stream = messages.map(move |msg| {
            let err = |m: String| BusError::Kv {
                bucket: bucket.clone(),
                key: "*".into(),
                message: format!("watch: {m}"),
            };
            let msg = msg.map_err(|e| err(e.to_string()))?;
            let info = msg.info().map_err(|e| err(e.to_string()))?;
            let operation = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .and_then(|v| v.as_str().parse::<kv::Operation>().ok())
                .unwrap_or(kv::Operation::Put);
            let key = msg
                .subject
                .strip_prefix(prefix.as_str())
                .unwrap_or(msg.subject.as_str())
                .to_string();
            Ok(kv::Entry {
                bucket: bucket.clone(),
                key,
                value: msg.payload.clone(),
                revision: info.stream_sequence,
                delta: info.pending,
                created: info.published,
                operation,
                seen_current: info.pending == 0,
            })
        });
        Ok(stream.boxed())
    }

    /// Reads every live key of `store`, decoding each value (the key listing is tried up to
    /// [`KEYS_ATTEMPTS`] times, each bounded to [`KEYS_ATTEMPT`]). Values that fail to decode are
    /// counted in `rejects` and skipped.
    pub async fn load_all<T: Message>(
        &self,
        store: &kv::Store,
        rejects: &Rejects,
    ) -> Result<BTreeMap<String, (T, u64)>, BusError> {
        Ok(self.load_all_entries(store, rejects).await?.values)
    }

    /// [`Bus::load_all`], with the revision of every key's latest entry, whatever it holds
    /// (a value, one that does not decode, a delete marker): what a compare-and-set write
    /// of the key must expect to replace it.
    pub async fn load_all_entries<T: Message>(
        &self,
        store: &kv::Store,
        rejects: &Rejects,
    ) -> Result<Loaded<T>, BusError> {
        use futures::TryStreamExt;
        let kv_err = |e: &dyn std::fmt::Display| BusError::Kv {
            bucket: store.name.clone(),
            key: "*".into(),
            message: e.to_string(),
        };
        // The keys are the subjects the stream's info lists (its leader answers). Not
        // `kv::Store::keys`, which reads them through an ephemeral consumer: on a NATS
        // cluster that just lost a server, creating one waits for a new meta leader, and one
        // placed on the dead peer never answers (the CLI's listings timed out for over a
        // minute). A stream whose leader died answers once the others elect one (seconds),
        // hence the attempts, each bounded to KEYS_ATTEMPT.
        let list = || async {
            let listing = async {
                store
                    .stream
                    .info_with_subjects(format!("{}>", store.prefix))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_ok(|(subject, _)| {
                        subject
                            .strip_prefix(store.prefix.as_str())
                            .unwrap_or(&subject)
                            .to_string()
                    })
                    .try_collect::<Vec<String>>()
                    .await
                    .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(KEYS_ATTEMPT, listing).await {
                Ok(r) => r,
                Err(_) => Err(format!("listing keys timed out after {KEYS_ATTEMPT:?}")),
            }
        };
        let keys: Vec<String> = list
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_times(KEYS_ATTEMPTS - 1),
            )
            .await
            .map_err(|e| kv_err(&e))?;
        let mut out = Loaded {
            values: BTreeMap::new(),
            revisions: BTreeMap::new(),
        };
        for key in keys {
            let Some(entry) = self.latest_entry(store, &key).await? else {
                continue;
            };
            out.revisions.insert(key.clone(), entry.revision);
            if entry.operation != kv::Operation::Put {
                continue;
            }
            match decode::<T>(&entry.value) {
                Ok(v) => {
                    out.values.insert(key, (v, entry.revision));
                }
                Err(source) => rejects.record(&format!("kv:{}", store.name), &key, &source),
            }
        }
        Ok(out)
    }
}

/// What [`Bus::load_all_entries`] read: the decoded values with their revisions, and the
/// revision of every key's latest entry (also of the keys without a decodable value).
#[derive(Debug)]
pub struct Loaded<T> {
    pub values: BTreeMap<String, (T, u64)>,
    pub revisions: BTreeMap<String, u64>,
}

/// How long one attempt to list a bucket's keys may take ([`Bus::load_all`]).
pub const KEYS_ATTEMPT: Duration = Duration::from_secs(3);
/// Attempts to list a bucket's keys before [`Bus::load_all`] gives up (with the pauses
/// between them, over 20 s: a stream leader's election on a loaded machine).
pub const KEYS_ATTEMPTS: usize = 6;
