//! Typed KV following: a bucket's entries as [`KvChange`]s of parsed keys and decoded
//! values ([`KvDecoder`], [`follow_kv_typed`]), and [`KvStore`], the current values they
//! add up to (after kube-runtime's `watcher()` and `reflector::Store`).

use crate::{Rejects, follow_kv};
use async_nats::jetstream::kv;
use converge_common::{Message, decode};
use std::collections::BTreeMap;
use std::fmt::Display;
use std::str::FromStr;
use std::sync::Arc;

/// One change of a KV bucket, typed: keys parsed into `K`, values decoded into `V`.
#[derive(Debug, Clone, PartialEq)]
pub enum KvChange<K, V> {
    /// The key's value is now `V` (a put; also each current value when following starts).
    Put(K, V),
    /// The key was deleted or purged.
    Deleted(K),
    /// A put whose value is refused: it did not decode (counted in [`Rejects`] under
    /// `kv:<bucket>`) or the decoder's check refused it (logged). `reason` says which.
    Refused {
        /// The entry's key.
        key: K,
        /// Why the value is refused (the decode error or the check's message).
        reason: String,
    },
    /// An entry whose key does not parse into `K` (counted in [`Rejects`] under
    /// `kv:<bucket>`, kind `bad_key`): no value of it is used, nor is its deletion.
    BadKey {
        /// The key as stored.
        key: String,
        /// Why it does not parse.
        reason: String,
    },
    /// Every value the bucket held when following started has been delivered (sent once,
    /// at once for an empty bucket).
    CaughtUp,
}

/// A check of each decoded value against its key and entry: the value to use, possibly
/// changed, or why it is refused.
type Check<K, V> = dyn Fn(&K, V, &kv::Entry) -> Result<V, String> + Send + Sync;

/// Turns a bucket's entries into [`KvChange`]s: parses the key (`K: FromStr`), decodes a
/// put's value with [`converge_common::decode`] (a value that does not decode is recorded
/// in [`Rejects`] under source `kv:<bucket>`), then runs the optional check.
pub struct KvDecoder<K, V> {
    rejects: Arc<Rejects>,
    check: Option<Arc<Check<K, V>>>,
}

impl<K, V> Clone for KvDecoder<K, V> {
    fn clone(&self) -> Self {
        Self {
            rejects: self.rejects.clone(),
            check: self.check.clone(),
        }
    }
}

impl<K, V> KvDecoder<K, V>
where
    K: FromStr,
    K::Err: Display,
    V: Message,
{
    /// A decoder without a check, recording refusals in `rejects`.
    pub fn new(rejects: Arc<Rejects>) -> Self {
        Self {
            rejects,
            check: None,
        }
    }

    /// The same decoder with `check` run on every decoded value: given the key, the value
    /// and the entry (its revision, the server's time of storing it), it returns the value
    /// to use (possibly changed) or `Err(reason)`, which makes the entry
    /// [`KvChange::Refused`] (logged, not counted in [`Rejects`]).
    pub fn with_check(
        mut self,
        check: impl Fn(&K, V, &kv::Entry) -> Result<V, String> + Send + Sync + 'static,
    ) -> Self {
        self.check = Some(Arc::new(check));
        self
    }

    /// A decoder whose values name the key they are stored under (`name_of`, e.g. a job
    /// status's job): a value stored under another key is [`KvChange::Refused`].
    pub fn named(rejects: Arc<Rejects>, name_of: fn(&V) -> &K) -> Self
    where
        K: PartialEq + Display + 'static,
        V: 'static,
    {
        Self::new(rejects).with_check(move |key, value, _| {
            if name_of(&value) == key {
                Ok(value)
            } else {
                Err(format!("value of {} stored under {key}", name_of(&value)))
            }
        })
    }

    /// The change `entry` makes. Never [`KvChange::CaughtUp`].
    pub fn decode(&self, entry: &kv::Entry) -> KvChange<K, V> {
        let source = || format!("kv:{}", entry.bucket);
        let key = match entry.key.parse::<K>() {
            Ok(key) => key,
            Err(e) => {
                self.rejects.refuse(&source(), &entry.key, "bad_key", &e);
                return KvChange::BadKey {
                    key: entry.key.clone(),
                    reason: e.to_string(),
                };
            }
        };
        if entry.operation != kv::Operation::Put {
            return KvChange::Deleted(key);
        }
        let value = match decode::<V>(&entry.value) {
            Ok(value) => value,
            Err(e) => {
                self.rejects.record(&source(), &entry.key, &e);
                return KvChange::Refused {
                    key,
                    reason: e.to_string(),
                };
            }
        };
        let Some(check) = &self.check else {
            return KvChange::Put(key, value);
        };
        match check(&key, value, entry) {
            Ok(value) => KvChange::Put(key, value),
            Err(reason) => {
                tracing::warn!(bucket = %entry.bucket, key = %entry.key, "value refused: {reason}");
                KvChange::Refused { key, reason }
            }
        }
    }
}

/// Follows a KV bucket with [`follow_kv`] (watch, direct reads while it stalls) until `tx`
/// closes, sending `wrap(change)` for each entry's [`KvChange`] ([`KvDecoder::decode`]) and
/// `wrap(KvChange::CaughtUp)` once the bucket's values at start have been delivered.
///
/// `wrap` puts the change into the receiver's message type (e.g. an enum variant, several
/// followers sharing one channel). A key's changes arrive in revision order, but a key's
/// latest change may come again after a re-watch (applying it again changes nothing).
pub async fn follow_kv_typed<K, V, T>(
    store: kv::Store,
    decoder: KvDecoder<K, V>,
    tx: tokio::sync::mpsc::Sender<T>,
    wrap: impl Fn(KvChange<K, V>) -> T,
) where
    K: FromStr,
    K::Err: Display,
    V: Message,
{
    follow_kv(
        store,
        tx,
        |entry| Some(wrap(decoder.decode(&entry))),
        || Some(wrap(KvChange::CaughtUp)),
    )
    .await
}

/// The current values of a bucket, kept from its [`KvChange`]s ([`KvStore::apply`]), by
/// key. A refused value or a bad key changes nothing: the key keeps its last valid value
/// (if any), so a malformed write does not erase what was known.
#[derive(Debug, Clone)]
pub struct KvStore<K, V> {
    values: BTreeMap<K, V>,
    caught_up: bool,
}

impl<K, V> Default for KvStore<K, V> {
    fn default() -> Self {
        Self {
            values: BTreeMap::new(),
            caught_up: false,
        }
    }
}

impl<K: Ord, V> KvStore<K, V> {
    /// An empty store, not caught up.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one change (taken by value: values can be large, and are moved in).
    /// Returns whether the store's values changed by it (not comparing a put's value to
    /// the one it replaces).
    pub fn apply(&mut self, change: KvChange<K, V>) -> bool {
        match change {
            KvChange::Put(key, value) => {
                self.values.insert(key, value);
                true
            }
            KvChange::Deleted(key) => self.values.remove(&key).is_some(),
            KvChange::Refused { .. } | KvChange::BadKey { .. } => false,
            KvChange::CaughtUp => {
                self.caught_up = true;
                false
            }
        }
    }

    /// The current value of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.values.get(key)
    }

    /// Whether `key` has a current value.
    pub fn contains_key(&self, key: &K) -> bool {
        self.values.contains_key(key)
    }

    /// The current values, by key in order.
    pub fn iter(&self) -> std::collections::btree_map::Iter<'_, K, V> {
        self.values.iter()
    }

    /// The current values, in key order.
    pub fn values(&self) -> std::collections::btree_map::Values<'_, K, V> {
        self.values.values()
    }

    /// The number of keys with a current value.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no key has a current value.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Whether [`KvChange::CaughtUp`] has been applied: the store holds (at least) what
    /// the bucket held when following started.
    pub fn is_caught_up(&self) -> bool {
        self.caught_up
    }

    /// The current values as a map.
    pub fn as_map(&self) -> &BTreeMap<K, V> {
        &self.values
    }
}

impl<'a, K, V> IntoIterator for &'a KvStore<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::collections::btree_map::Iter<'a, K, V>;
    fn into_iter(self) -> Self::IntoIter {
        self.values.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::{HostId, HostTelemetry, encode};

    fn entry(key: &str, value: &[u8], operation: kv::Operation) -> kv::Entry {
        kv::Entry {
            bucket: "converge-hosts".into(),
            key: key.into(),
            value: bytes::Bytes::copy_from_slice(value),
            revision: 7,
            delta: 0,
            created: time::OffsetDateTime::from_unix_timestamp(1_000).unwrap(),
            operation,
            seen_current: false,
        }
    }

    fn telemetry(host: &str, time: f64) -> HostTelemetry {
        HostTelemetry::new(host.parse().unwrap(), "127.0.0.1", time)
    }

    fn put(key: &str, t: &HostTelemetry) -> kv::Entry {
        entry(key, &encode(t), kv::Operation::Put)
    }

    /// The allocator's heartbeat rules: the host must be its key; the time becomes the
    /// server's.
    fn heartbeats(rejects: Arc<Rejects>) -> KvDecoder<HostId, HostTelemetry> {
        KvDecoder::new(rejects).with_check(|id: &HostId, mut t: HostTelemetry, e| {
            if t.host != *id {
                return Err(format!("host {} stored under {id}", t.host));
            }
            t.time = e.created.unix_timestamp() as f64;
            Ok(t)
        })
    }

    #[test]
    fn puts_deletes_and_purges_are_typed() {
        let rejects = Arc::new(Rejects::default());
        let d = heartbeats(rejects.clone());
        let h1: HostId = "h1".parse().unwrap();
        assert_eq!(
            d.decode(&put("h1", &telemetry("h1", 5.0))),
            KvChange::Put(h1.clone(), telemetry("h1", 1_000.0)),
            "the check's changed value is the one sent"
        );
        for op in [kv::Operation::Delete, kv::Operation::Purge] {
            assert_eq!(
                d.decode(&entry("h1", b"", op)),
                KvChange::Deleted(h1.clone())
            );
        }
        assert_eq!(rejects.total(), 0);
    }

    #[test]
    fn a_bad_key_is_counted_and_sent_as_such() {
        let rejects = Arc::new(Rejects::default());
        let d = heartbeats(rejects.clone());
        for op in [kv::Operation::Put, kv::Operation::Delete] {
            let change = d.decode(&entry("a.b", &encode(&telemetry("h1", 1.0)), op));
            assert!(
                matches!(&change, KvChange::BadKey { key, .. } if key == "a.b"),
                "{change:?}"
            );
        }
        assert_eq!(
            rejects.snapshot().into_iter().collect::<Vec<_>>(),
            [(("kv:converge-hosts".to_string(), "bad_key"), 2)]
        );
    }

    #[test]
    fn a_bad_value_is_refused_and_counted_under_its_bucket() {
        let rejects = Arc::new(Rejects::default());
        let d = heartbeats(rejects.clone());
        let change = d.decode(&entry("h1", b"{not json", kv::Operation::Put));
        assert!(
            matches!(&change, KvChange::Refused { key, .. } if key.as_str() == "h1"),
            "{change:?}"
        );
        let counts = rejects.snapshot();
        assert_eq!(counts.len(), 1);
        assert_eq!(counts.keys().next().unwrap().0, "kv:converge-hosts");
        assert_eq!(rejects.total(), 1);
    }

    #[test]
    fn a_value_the_check_refuses_is_refused_but_not_counted() {
        let rejects = Arc::new(Rejects::default());
        let d = heartbeats(rejects.clone());
        let change = d.decode(&put("h1", &telemetry("h2", 1.0)));
        assert_eq!(
            change,
            KvChange::Refused {
                key: "h1".parse().unwrap(),
                reason: "host h2 stored under h1".into()
            }
        );
        assert_eq!(rejects.total(), 0);
        // The same rule as `named`.
        let named = KvDecoder::named(rejects.clone(), |t: &HostTelemetry| &t.host);
        assert!(matches!(
            named.decode(&put("h1", &telemetry("h2", 1.0))),
            KvChange::Refused { reason, .. } if reason == "value of h2 stored under h1"
        ));
        assert!(matches!(
            named.decode(&put("h1", &telemetry("h1", 1.0))),
            KvChange::Put(..)
        ));
        assert_eq!(rejects.total(), 0);
        // Without a check, any decoded value is taken.
        let plain = KvDecoder::<HostId, HostTelemetry>::new(rejects);
        assert!(matches!(
            plain.decode(&put("h1", &telemetry("h2", 1.0))),
            KvChange::Put(..)
        ));
    }

    #[test]
    fn the_store_keeps_current_values() {
        let mut s = KvStore::<HostId, u32>::new();
        let (a, b): (HostId, HostId) = ("a".parse().unwrap(), "b".parse().unwrap());
        assert!(!s.is_caught_up() && s.is_empty());
        assert!(s.apply(KvChange::Put(b.clone(), 2)));
        assert!(s.apply(KvChange::Put(a.clone(), 1)));
        assert!(!s.apply(KvChange::CaughtUp));
        assert!(s.is_caught_up());
        assert!(s.apply(KvChange::Put(a.clone(), 10)));
        // A refused value or a bad key leaves the last valid value.
        assert!(!s.apply(KvChange::Refused {
            key: a.clone(),
            reason: "x".into()
        }));
        assert!(!s.apply(KvChange::BadKey {
            key: "a.b".into(),
            reason: "x".into()
        }));
        assert_eq!(s.get(&a), Some(&10));
        assert_eq!(
            s.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
            [("a", 10), ("b", 2)]
        );
        assert!(s.apply(KvChange::Deleted(b.clone())));
        assert!(!s.apply(KvChange::Deleted(b.clone())), "already gone");
        assert_eq!(s.len(), 1);
        assert!(!s.contains_key(&b));
        assert_eq!(s.values().copied().collect::<Vec<_>>(), [10]);
    }
}
