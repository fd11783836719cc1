//! Following a KV bucket ([`follow_kv`]): a watch, backed by direct reads of newer entries
//! while the watch is quiet, missing or stalled (a NATS cluster that lost a server).

use crate::read_after;
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

/// Follows a KV bucket until `tx` closes: every key's current value first, then each
/// change, each entry turned into a message by `read` (`None`: nothing to send). Once the
/// values the bucket held when the follower started have been read (at once for a bucket
/// the server says is empty then; within [`KV_QUIET`] to [`KV_STALL`] after the watch's
/// creation for one emptied while the watch was made), `caught_up()` is sent, if it gives
/// a message. Entries reach `read` in increasing
/// revision per key (an entry no newer than the last one read for its key is skipped), but
/// `read` may see a key's entry again after a re-watch.
///
/// On a NATS cluster a watch's consumer lives on one server, and creating one needs
/// JetStream's meta leader: when a server dies, a watch can go silent (its consumer was on
/// that server, or on a replica that no longer catches up), and no new one can be created
/// while the surviving servers elect a meta leader (seconds; over ten on a loaded machine).
/// So whenever the watch has been quiet for [`KV_QUIET`], the follower reads the bucket's
/// newer entries itself, by revision, with direct gets (answered by any replica, no consumer
/// needed), and delivers them; a watch that leaves such an entry undelivered for
/// [`KV_STALL`] is re-created. While there is no watch (being created, bounded to
/// `KV_WATCH_CREATE`, or waiting to be tried again after a failure) the direct reads go
/// on every half [`KV_QUIET`]: creating a watch never holds them up.
pub async fn follow_kv<T>(
    store: kv::Store,
    tx: tokio::sync::mpsc::Sender<T>,
    mut read: impl FnMut(kv::Entry) -> Option<T>,
    caught_up: impl Fn() -> Option<T>,
) {
    type Creating = std::pin::Pin<Box<dyn Future<Output = Result<kv::Watch, String>> + Send>>;
    // A watch being created, bounded to KV_WATCH_CREATE.
    let create = |store: &kv::Store| -> Creating {
        let store = store.clone();
        Box::pin(async move {
            match tokio::time::timeout(KV_WATCH_CREATE, store.watch_with_history(">")).await {
                Ok(Ok(w)) => Ok(w),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("timed out after {KV_WATCH_CREATE:?}")),
            }
        })
    };
    let mut done = false;
    let signal = async |tx: &tokio::sync::mpsc::Sender<T>, done: &mut bool| {
        *done = true;
        match caught_up() {
            Some(m) => tx.send(m).await.is_ok(),
            None => true,
        }
    };
    // Empty now, as the server says (the stream info cached when the bucket was opened may
    // be out of date either way): caught up at once.
    if bucket_is_empty(&store).await && !signal(&tx, &mut done).await {
        return;
    }
    // The latest revision delivered per key, and over the bucket.
    let mut known: BTreeMap<String, u64> = BTreeMap::new();
    let mut latest = 0u64;
    // Delivers `entry` if it is newer than what its key had; false once `tx` is closed.
    let mut deliver =
        async |entry: kv::Entry, known: &mut BTreeMap<String, u64>, latest: &mut u64| -> bool {
            *latest = (*latest).max(entry.revision);
            let seen = known.entry(entry.key.clone()).or_default();
            if entry.revision <= *seen {
                return true;
            }
            *seen = entry.revision;
            match read(entry) {
                Some(m) => tx.send(m).await.is_ok(),
                None => true,
            }
        };
    let mut watch: Option<kv::Watch> = None;
    let mut creating: Option<Creating> = Some(create(&store));
    // Failed attempts in a row, and when to try again (0.5 to 5 s, growing with them).
    let mut failures = 0u32;
    let mut retry_at = tokio::time::Instant::now();
    let mut last_delivery = tokio::time::Instant::now();
    // A revision read directly that the watch had not delivered, and when.
    let mut missed: Option<(u64, tokio::time::Instant)> = None;
    // When the follower last asked whether the bucket is empty (before catching up).
    let mut last_empty_check: Option<tokio::time::Instant> = None;
    let mut tick = tokio::time::interval(KV_QUIET / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            created = async { creating.as_mut()?.await.into() }, if creating.is_some() => {
                creating = None;
                match created {
                    Some(Ok(w)) => {
                        if failures > 0 {
                            tracing::info!(bucket = %store.name, "watching again after {failures} failed attempt(s)");
                        }
                        failures = 0;
                        watch = Some(w);
                        last_delivery = tokio::time::Instant::now();
                        missed = None;
                    }
                    Some(Err(e)) => {
                        failures += 1;
                        tracing::warn!(bucket = %store.name, "cannot watch: {e} (attempt {failures}; reading directly meanwhile)");
                        retry_at = tokio::time::Instant::now()
                            + Duration::from_millis(500 * u64::from(failures.clamp(1, 10)));
                    }
                    None => {}
                }
            }
            entry = async { watch.as_mut()?.next().await }, if watch.is_some() => {
                match entry {
                    Some(Ok(entry)) => {
                        last_delivery = tokio::time::Instant::now();
                        if missed.is_some_and(|(rev, _)| entry.revision >= rev) {
                            missed = None;
                        }
                        let last_of_start = !done && entry.delta == 0;
                        if !deliver(entry, &mut known, &mut latest).await {
                            return;
                        }
                        if last_of_start && !signal(&tx, &mut done).await {
                            return;
                        }
                    }
                    end => {
                        match end {
                            Some(Err(e)) => tracing::warn!(bucket = %store.name, "watch error: {e}; watching again"),
                            _ => tracing::warn!(bucket = %store.name, "watch ended; watching again"),
                        }
                        watch = None;
                        creating = Some(create(&store));
                    }
                }
            }
            _ = tick.tick() => {
                if watch.is_none() && creating.is_none() && tokio::time::Instant::now() >= retry_at {
                    creating = Some(create(&store));
                }
                // A watch of a bucket that holds nothing delivers nothing, so no entry says
                // the values at start are all in. The emptiness seen when the bucket was
                // opened (above) may be out of date: values there then may have expired
                // or been purged since. So a watch quiet since its creation asks the server
                // (fresh stream information, bounded) whether the bucket is empty now.
                // At most once per KV_STALL (a request to the stream's leader); a watch
                // quiet for KV_STALL on a bucket that does hold values is stalled and is
                // created again.
                if !done
                    && watch.is_some()
                    && last_delivery.elapsed() >= KV_QUIET
                    && last_empty_check.is_none_or(|at| at.elapsed() >= KV_STALL)
                {
                    last_empty_check = Some(tokio::time::Instant::now());
                    if bucket_is_empty(&store).await {
                        if !signal(&tx, &mut done).await {
                            return;
                        }
                    } else if last_delivery.elapsed() >= KV_STALL {
                        tracing::warn!(
                            bucket = %store.name,
                            "watch stalled before delivering the bucket's values: watching again"
                        );
                        watch = None;
                        creating = Some(create(&store));
                    }
                }
                // Only once caught up (a watch's first values are the current ones), and
                // with a watch only once it has been quiet.
                if !done || (watch.is_some() && last_delivery.elapsed() < KV_QUIET) {
                    continue;
                }
                let before = latest;
                match read_newer(&store, latest).await {
                    Ok(entries) => {
                        tracing::debug!(bucket = %store.name, after = latest, "read directly: {} entries", entries.len());
                        for entry in entries {
                            if !deliver(entry, &mut known, &mut latest).await {
                                return;
                            }
                        }
                    }
                    Err(e) => tracing::debug!(bucket = %store.name, "direct read: {e}"),
                }
                if watch.is_some() {
                    if latest > before && missed.is_none() {
                        missed = Some((latest, tokio::time::Instant::now()));
                    }
                    if let Some((rev, since)) = missed
                        && since.elapsed() >= KV_STALL
                    {
                        tracing::warn!(
                            bucket = %store.name,
                            "watch stalled: revision {rev} was read directly, the watch \
                             delivered nothing for {:?} (its consumer's server may be \
                             gone); watching again",
                            last_delivery.elapsed()
                        );
                        watch = None;
                        missed = None;
                        creating = Some(create(&store));
                    }
                }
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// Whether the bucket's stream holds no message now, as its server says (not the stream
/// information cached when the bucket was opened); false when the server does not answer
/// within [`KV_WATCH_CREATE`].
async fn bucket_is_empty(store: &kv::Store) -> bool {
    matches!(
        tokio::time::timeout(KV_WATCH_CREATE, store.stream.get_info()).await,
        Ok(Ok(info)) if info.state.messages == 0
    )
}

/// The entries of `store` after revision `after` ([`read_after`] on the bucket's subjects,
/// 1000 at most, for 2 s at most).
async fn read_newer(store: &kv::Store, after: u64) -> Result<Vec<kv::Entry>, String> {
    let filter = format!("{}>", store.prefix);
    let messages = read_after(&store.stream, &filter, after, 1000, Duration::from_secs(2)).await?;
    Ok(messages
        .into_iter()
        .map(|msg| {
            let operation = msg
                .headers
                .get("KV-Operation")
                .and_then(|v| v.as_str().parse::<kv::Operation>().ok())
                .unwrap_or(kv::Operation::Put);
            let key = msg
                .subject
                .strip_prefix(store.prefix.as_str())
                .unwrap_or(msg.subject.as_str())
                .to_string();
            kv::Entry {
                bucket: store.name.clone(),
                key,
                value: msg.payload,
                revision: msg.sequence,
                delta: 0,
                created: msg.time,
                operation,
                seen_current: false,
            }
        })
        .collect())
}

/// How long a [`follow_kv`] watch may be quiet before the follower reads newer entries
/// directly (then every half of this while it stays quiet). The allocator's --host-timeout
/// (15 s) must cover a stream leader's election (4 to 9 s here, during which heartbeats
/// cannot be written) plus this and a read.
pub const KV_QUIET: Duration = Duration::from_secs(1);

/// How long a [`follow_kv`] watch may leave an entry read directly undelivered before it is
/// re-created (a watch is re-created with every key's current value: not at the first lag).
pub const KV_STALL: Duration = Duration::from_secs(3);

/// How long creating a [`follow_kv`] watch may take before it is abandoned and tried again
/// (the direct reads go on meanwhile).
const KV_WATCH_CREATE: Duration = Duration::from_secs(3);
