//! Leader election between allocator replicas: a lease in NATS KV (`converge-leader`, key
//! `allocator`, value [`LeaderLease`]). Only the replica holding the lease runs scheduling
//! steps and writes plans and job statuses; the others follow the same inputs and wait.
//!
//! - **Acquire:** a replica creates the key when it is absent (KV `create` fails if another
//!   replica created it first).
//! - **Renew:** the holder rewrites the lease every `ttl / 3` with a compare-and-set on the
//!   revision it last wrote (KV `update`); a failed compare-and-set means another replica
//!   took the lease, and the holder steps down at once.
//! - **Take over:** a replica that has seen the *same* revision for `ttl` on its own
//!   monotonic clock takes the lease with a compare-and-set on that revision. No wall clock
//!   is compared across replicas, so clock skew does not matter.
//! - **Hand back:** a replica that stops cleanly deletes the key (compare-and-set on its
//!   revision), so another takes over at its next poll.
//! - **Restart:** a replica that finds the lease held under its own id (it was killed and
//!   started again) renews it at once: decisions resume within one poll.
//!
//! A holder trusts its lease for `0.8·ttl` after its last successful write
//! ([`Leadership::is_valid`]): a replica frozen for longer (a paused container, a long GC)
//! stops writing before any other can have taken over. A standby takes over `ttl` after it
//! first saw the holder's last renewal, which the holder wrote up to `ttl / 3` before it
//! died, and polls every `ttl / 3`: handover takes between `2/3·ttl` and `4/3·ttl` after the
//! holder dies (`ttl` = `--lease-ttl`, 10 s by default: 6.7 to 13.3 s). Replica ids must be
//! unique (default: the host name).
//!
//! The decision ([`decide`]) is pure; [`spawn`] is the I/O around it.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use converge_bus::unix_now;
use converge_common::codec::{decode, encode};
use converge_common::{LeaderLease, PROTOCOL_VERSION, subjects};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Fraction of the TTL a holder trusts its lease after a successful write.
pub const TRUST_FRACTION: f64 = 0.8;

/// What a replica does at one poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// No lease: create it (term 1 or the next term after a deleted one).
    Create { term: u64 },
    /// The lease is ours: renew it on `revision`.
    Renew { revision: u64, term: u64 },
    /// The holder stopped renewing: take the lease on `revision` with the next term.
    TakeOver { revision: u64, term: u64 },
    /// Someone else holds a live lease.
    Follow { holder: String },
}

/// The pure decision of one poll. `current`: the lease and its KV revision, `None` when the
/// key is absent or deleted (`last_term` is then the last term seen, 0 if none);
/// `unchanged_for`: how long this replica has seen that revision.
pub fn decide(
    me: &str,
    current: Option<(&LeaderLease, u64)>,
    last_term: u64,
    unchanged_for: Duration,
    ttl: Duration,
) -> Action {
    match current {
        None => Action::Create {
            term: last_term + 1,
        },
        Some((lease, revision)) if lease.holder == me => Action::Renew {
            revision,
            term: lease.term,
        },
        Some((lease, revision)) if unchanged_for >= ttl => Action::TakeOver {
            revision,
            term: lease.term + 1,
        },
        Some((lease, _)) => Action::Follow {
            holder: lease.holder.clone(),
        },
    }
}

/// This replica's view of the leadership, published on a `watch` channel.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leadership {
    /// Term of the lease this replica holds (0 when it holds none).
    pub term: u64,
    /// Until when this replica may act as the leader (`None`: it is not the leader).
    pub valid_until: Option<Instant>,
    /// The holder it last saw (itself when leading), for logs.
    pub holder: Option<String>,
}

impl Leadership {
    /// Whether this replica may write plans and statuses now.
    pub fn is_valid(&self) -> bool {
        self.valid_until.is_some_and(|t| Instant::now() < t)
    }
}

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// This replica's id (unique among replicas).
    pub replica_id: String,
    /// Lease length.
    pub ttl: Duration,
    /// Replicas of the lease bucket (`--bus-replicas`, as the other buckets).
    pub replicas: usize,
}

fn kv_config(replicas: usize) -> kv::Config {
    kv::Config {
        bucket: subjects::BUCKET_LEADER.to_string(),
        description: "allocator leader lease".to_string(),
        history: 1,
        max_value_size: subjects::bucket_bounds(subjects::BUCKET_LEADER).max_value_bytes,
        max_bytes: subjects::bucket_bounds(subjects::BUCKET_LEADER).max_bytes,
        num_replicas: replicas,
        ..Default::default()
    }
}

/// Opens (creating if needed) the lease bucket and starts polling it every `ttl / 3` until
/// `shutdown`; the receiver sees every change of [`Leadership`]. The task ends after handing
/// the lease back (await it before the process exits).
///
/// # Errors
/// The bucket cannot be created or opened (JetStream off, no permission).
pub async fn spawn(
    js: &jetstream::Context,
    cfg: LeaseConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<(watch::Receiver<Leadership>, tokio::task::JoinHandle<()>)> {
    let store = match js.get_key_value(subjects::BUCKET_LEADER).await {
        Ok(store)
            if store.stream.cached_info().config.num_replicas == cfg.replicas
                && store.stream.cached_info().config.max_bytes
                    == subjects::bucket_bounds(subjects::BUCKET_LEADER).max_bytes =>
        {
            store
        }
        // Missing, with other replicas or without its bound (older releases): created, or
        // changed in place.
        _ => js
            .create_or_update_key_value(kv_config(cfg.replicas))
            .await
            .or(js.get_key_value(subjects::BUCKET_LEADER).await)
            .map_err(|e| {
                anyhow::anyhow!("cannot open KV bucket {}: {e}", subjects::BUCKET_LEADER)
            })?,
    };
    let (tx, rx) = watch::channel(Leadership::default());
    let task = tokio::spawn(run(store, cfg, tx, shutdown));
    Ok((rx, task))
}

async fn run(
    store: kv::Store,
    cfg: LeaseConfig,
    tx: watch::Sender<Leadership>,
    shutdown: CancellationToken,
) {
    let poll = cfg.ttl / 3;
    let mut seen: Option<(u64, Instant)> = None;
    let mut last_term = 0;
    let mut written: Option<u64> = None;
    loop {
        let started = Instant::now();
        let state = poll_once(&store, &cfg, &mut seen, &mut last_term, started).await;
        written = match &state {
            Ok((_, Some(rev))) => Some(*rev),
            Ok((_, None)) => None,
            Err(_) => written,
        };
        match state {
            Ok((leadership, _)) => {
                tx.send_if_modified(|old| {
                    let changed_role = old.term != leadership.term || old.holder != leadership.holder;
                    if changed_role {
                        match (&leadership.valid_until, &leadership.holder) {
                            (Some(_), _) => tracing::info!(term = leadership.term, replica = %cfg.replica_id, "leading: this replica writes plans and statuses"),
                            (None, Some(h)) => tracing::info!(leader = %h, "following: another replica leads"),
                            (None, None) => {}
                        }
                    }
                    let changed = *old != leadership;
                    *old = leadership;
                    changed
                });
            }
            Err(e) => {
                // Keep the current state: its validity runs out by itself.
                tracing::warn!("leader lease: {e}");
            }
        }
        metrics::gauge!("converge_allocator_leader").set(if tx.borrow().is_valid() {
            1.0
        } else {
            0.0
        });
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(poll) => {}
        }
    }
    if let Some(revision) = written.filter(|_| tx.borrow().is_valid()) {
        tx.send_replace(Leadership::default());
        match store
            .delete_expect_revision(subjects::LEADER_KEY, Some(revision))
            .await
        {
            Ok(()) => tracing::info!("leader lease handed back"),
            Err(e) => tracing::warn!("leader lease not handed back: {e}"),
        }
    }
}

/// One poll: reads the lease, decides, writes. Returns the new leadership and, when this
/// replica wrote the lease, the revision it wrote.
async fn poll_once(
    store: &kv::Store,
    cfg: &LeaseConfig,
    seen: &mut Option<(u64, Instant)>,
    last_term: &mut u64,
    started: Instant,
) -> anyhow::Result<(Leadership, Option<u64>)> {
    let entry = store.entry(subjects::LEADER_KEY).await?;
    let current: Option<(LeaderLease, u64)> = match entry {
        Some(e) if e.operation == kv::Operation::Put => match decode::<LeaderLease>(&e.value) {
            Ok(lease) => Some((lease, e.revision)),
            Err(err) => {
                // An unreadable lease is treated as one nobody renews: taken over after ttl.
                tracing::warn!("leader lease unreadable ({err}); treating it as stale");
                Some((
                    LeaderLease {
                        protocol: PROTOCOL_VERSION,
                        holder: String::new(),
                        term: *last_term,
                        ttl_s: cfg.ttl.as_secs_f64(),
                        renewed_at: 0.0,
                    },
                    e.revision,
                ))
            }
        },
        _ => None,
    };
    let revision = current.as_ref().map(|(_, r)| *r);
    match (revision, *seen) {
        (Some(r), Some((s, _))) if r == s => {}
        (Some(r), _) => *seen = Some((r, Instant::now())),
        (None, _) => *seen = None,
    }
    if let Some((lease, _)) = &current {
        *last_term = (*last_term).max(lease.term);
    }
    let unchanged_for = seen.map_or(Duration::ZERO, |(_, since)| since.elapsed());
    let action = decide(
        &cfg.replica_id,
        current.as_ref().map(|(l, r)| (l, *r)),
        *last_term,
        unchanged_for,
        cfg.ttl,
    );
    let lease = |term: u64| LeaderLease {
        protocol: PROTOCOL_VERSION,
        holder: cfg.replica_id.clone(),
        term,
        ttl_s: cfg.ttl.as_secs_f64(),
        renewed_at: unix_now(),
    };
    // A renewal NATS refuses (e.g. while the lease bucket elects a new stream leader after
    // a server died) is not a lost lease: nobody else can have taken it before it expires,
    // so the current leadership is kept and its validity runs out by itself (an `Err`).
    if let Action::Renew { revision, term } = &action {
        let rev = store
            .update(
                subjects::LEADER_KEY,
                Bytes::from(encode(&lease(*term))),
                *revision,
            )
            .await
            .map_err(|e| anyhow::anyhow!("cannot renew the lease (kept until it expires): {e}"))?;
        *seen = Some((rev, Instant::now()));
        *last_term = *term;
        return Ok((
            Leadership {
                term: *term,
                valid_until: Some(started + cfg.ttl.mul_f64(TRUST_FRACTION)),
                holder: Some(cfg.replica_id.clone()),
            },
            Some(rev),
        ));
    }
    let written = match &action {
        Action::Create { term } => store
            .create(subjects::LEADER_KEY, Bytes::from(encode(&lease(*term))))
            .await
            .ok()
            .map(|rev| (rev, *term)),
        Action::Renew { .. } => unreachable!("renewed above"),
        Action::TakeOver { revision, term } => store
            .update(
                subjects::LEADER_KEY,
                Bytes::from(encode(&lease(*term))),
                *revision,
            )
            .await
            .ok()
            .map(|rev| (rev, *term)),
        Action::Follow { .. } => None,
    };
    Ok(match written {
        Some((rev, term)) => {
            *seen = Some((rev, Instant::now()));
            *last_term = term;
            (
                Leadership {
                    term,
                    valid_until: Some(started + cfg.ttl.mul_f64(TRUST_FRACTION)),
                    holder: Some(cfg.replica_id.clone()),
                },
                Some(rev),
            )
        }
        None => (
            Leadership {
                term: 0,
                valid_until: None,
                holder: current.map(|(l, _)| l.holder),
            },
            None,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, term: u64) -> LeaderLease {
        LeaderLease {
            protocol: PROTOCOL_VERSION,
            holder: holder.into(),
            term,
            ttl_s: 10.0,
            renewed_at: 0.0,
        }
    }

    #[test]
    fn decisions() {
        let ttl = Duration::from_secs(10);
        let fresh = Duration::from_secs(3);
        let stale = Duration::from_secs(10);
        assert_eq!(decide("a", None, 0, fresh, ttl), Action::Create { term: 1 });
        assert_eq!(decide("a", None, 4, fresh, ttl), Action::Create { term: 5 });
        let held = lease("a", 2);
        assert_eq!(
            decide("a", Some((&held, 7)), 2, stale, ttl),
            Action::Renew {
                revision: 7,
                term: 2
            }
        );
        assert_eq!(
            decide("b", Some((&held, 7)), 2, fresh, ttl),
            Action::Follow { holder: "a".into() }
        );
        assert_eq!(
            decide("b", Some((&held, 7)), 2, stale, ttl),
            Action::TakeOver {
                revision: 7,
                term: 3
            }
        );
    }
}
