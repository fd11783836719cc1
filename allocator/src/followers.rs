//! The KV followers: each follows one bucket (job specs, heartbeats, job statuses, plans,
//! queues, queue statuses) with [`converge_bus::follow_kv_typed`] and sends its typed changes to
//! the main loop as an [`Input`]. The decoders here hold the allocator's rules of each
//! bucket: a value must name the key it is stored under, and a heartbeat's time is the
//! server's.

use crate::progress::Progress;
use async_nats::jetstream::kv;
use converge_bus::{Bus, KvChange, KvDecoder, QueueBuckets, Rejects, follow_kv, follow_kv_typed};
use converge_common::{
    HostId, HostPlan, HostTelemetry, JobId, JobSpec, JobStatus, QueueId, QueueSpec, QueueStatus,
};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// An update for the main loop, from the KV followers (here) and the progress follower
/// ([`crate::progress`]). A KV change that is no put or delete (a bad key, a refused value
/// other than a spec's, the end of the values at start) changes nothing.
pub(crate) enum Input {
    /// A job spec; `Refused` (undecodable, or its id not its key) makes the job refused.
    Spec(Box<KvChange<JobId, JobSpec>>),
    /// A heartbeat, its `time` the server's ([`hosts`]).
    Host(KvChange<HostId, HostTelemetry>),
    /// A job status as stored (by this replica or another): where each generation runs;
    /// with the entry's KV revision (0 for the end of the values at start).
    Status(Box<KvChange<JobId, JobStatus>>, u64),
    Progress(Box<Progress>),
    /// A message of the progress stream that is no report (refused and counted by the
    /// follower as it read it): its sequence, for the leader to delete.
    Undecodable(u64),
    ProgressCaughtUp,
    Queue(KvChange<QueueId, QueueSpec>),
    /// A queue status as stored (by this replica or another): the usage to continue from.
    QueueStatus(Box<KvChange<QueueId, QueueStatus>>),
    /// A host plan as stored (by this replica or another), with the entry's KV revision:
    /// while leading, an entry newer than the revision this replica last read or wrote of
    /// its key is another writer's, to write over ([`crate::service`]).
    Plan(Box<KvChange<HostId, HostPlan>>, u64),
}

/// Follows the six buckets, current values first, then updates, each into `tx`. Statuses
/// are followed whoever wrote them (the leader's own writes come back too and change
/// nothing): followers learn new generations' placements from them (the leader also from
/// its own steps), that is who may report progress. Statuses and plans that the leader did
/// not write itself tell it that another writer was there (a replaced leader's late write).
pub(crate) fn follow_buckets(
    tasks: &mut JoinSet<()>,
    bus: &Bus,
    queues: &QueueBuckets,
    tx: &mpsc::Sender<Input>,
    rejects: &Arc<Rejects>,
) {
    tasks.spawn(follow_kv_typed(
        bus.jobs.clone(),
        jobs(rejects),
        tx.clone(),
        |change| Input::Spec(Box::new(change)),
    ));
    tasks.spawn(follow_kv_typed(
        bus.hosts.clone(),
        hosts(rejects),
        tx.clone(),
        Input::Host,
    ));
    // Statuses and plans with their revisions (the leader tells its own writes from
    // another writer's by them).
    let statuses = KvDecoder::named(rejects.clone(), |s: &JobStatus| &s.job);
    tasks.spawn(follow_kv(
        bus.status.clone(),
        tx.clone(),
        move |entry| {
            Some(Input::Status(
                Box::new(statuses.decode(&entry)),
                entry.revision,
            ))
        },
        || Some(Input::Status(Box::new(KvChange::CaughtUp), 0)),
    ));
    let plans = KvDecoder::named(rejects.clone(), |p: &HostPlan| &p.host);
    tasks.spawn(follow_kv(
        bus.plans.clone(),
        tx.clone(),
        move |entry| Some(Input::Plan(Box::new(plans.decode(&entry)), entry.revision)),
        || Some(Input::Plan(Box::new(KvChange::CaughtUp), 0)),
    ));
    tasks.spawn(follow_kv_typed(
        queues.queues.clone(),
        KvDecoder::named(rejects.clone(), |q: &QueueSpec| &q.name),
        tx.clone(),
        Input::Queue,
    ));
    tasks.spawn(follow_kv_typed(
        queues.status.clone(),
        KvDecoder::named(rejects.clone(), |s: &QueueStatus| &s.queue),
        tx.clone(),
        |c| Input::QueueStatus(Box::new(c)),
    ));
}

/// KV `converge-jobs`: a spec whose id is not its key is refused, with the reason.
fn jobs(rejects: &Arc<Rejects>) -> KvDecoder<JobId, JobSpec> {
    KvDecoder::new(rejects.clone()).with_check(|id, spec: JobSpec, _| {
        if spec.id == *id {
            Ok(spec)
        } else {
            Err(format!("spec id {} differs from its key {id}", spec.id))
        }
    })
}

/// KV `converge-hosts` (heartbeats): a heartbeat naming another host than its key is
/// refused (and ignored). A heartbeat's `time` becomes the time the NATS server stored it
/// ([`received_at`]): liveness is judged by when the heartbeat arrived, never by the
/// agent's clock (a clock behind by more than the host timeout would mark an honest host
/// lost, one ahead would keep a dead host live).
fn hosts(rejects: &Arc<Rejects>) -> KvDecoder<HostId, HostTelemetry> {
    KvDecoder::new(rejects.clone()).with_check(|id, mut t: HostTelemetry, entry| {
        if t.host != *id {
            return Err(format!("heartbeat of {} stored under {id}", t.host));
        }
        let sent = t.time;
        t.time = received_at(entry);
        if (t.time - sent).abs() > CLOCK_SKEW_WARNING_S {
            tracing::debug!(
                host = %id,
                skew_s = sent - t.time,
                "heartbeat time differs from its arrival; liveness follows the arrival"
            );
        }
        Ok(t)
    })
}

/// Skew between an agent's clock and the NATS server's worth a debug line.
const CLOCK_SKEW_WARNING_S: f64 = 5.0;

/// When the NATS server stored a KV entry, UNIX seconds (the server's clock: the same for
/// every agent, and kept across allocator restarts, unlike a local receipt time).
fn received_at(entry: &kv::Entry) -> f64 {
    entry.created.unix_timestamp_nanos() as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::encode;

    fn entry(bucket: &str, key: &str, value: &[u8], created_s: i64) -> kv::Entry {
        kv::Entry {
            bucket: bucket.into(),
            key: key.into(),
            value: value.to_vec().into(),
            revision: 1,
            delta: 0,
            created: time::OffsetDateTime::from_unix_timestamp(created_s).unwrap(),
            operation: kv::Operation::Put,
            seen_current: false,
        }
    }

    fn heartbeat(host: &str, time: f64) -> HostTelemetry {
        HostTelemetry::new(host.parse().unwrap(), "127.0.0.1", time)
    }

    #[test]
    fn a_spec_must_carry_its_key_and_an_undecodable_one_is_counted() {
        let rejects = Arc::new(Rejects::default());
        let d = jobs(&rejects);
        let spec = JobSpec::from_toml("id = \"a\"\ncommand = [\"true\"]\n").unwrap();
        let a: JobId = "a".parse().unwrap();
        let put = |key: &str, value: &[u8]| d.decode(&entry("converge-jobs", key, value, 9));
        assert_eq!(
            put("a", &encode(&spec)),
            KvChange::Put(a.clone(), spec.clone())
        );
        assert_eq!(
            put("b", &encode(&spec)),
            KvChange::Refused {
                key: "b".parse().unwrap(),
                reason: "spec id a differs from its key b".into()
            }
        );
        assert_eq!(
            rejects.total(),
            0,
            "a spec under another key is refused, not counted"
        );
        assert!(matches!(put("a", b"{"), KvChange::Refused { key, .. } if key == a));
        assert_eq!(
            rejects.snapshot().into_keys().collect::<Vec<_>>(),
            [("kv:converge-jobs".to_string(), "malformed")]
        );
    }

    #[test]
    fn a_heartbeat_takes_the_servers_time_and_must_name_its_host() {
        let rejects = Arc::new(Rejects::default());
        let d = hosts(&rejects);
        let h1: HostId = "h1".parse().unwrap();
        // An agent's clock an hour ahead: its heartbeat counts from when it was stored.
        let stored = entry(
            "converge-hosts",
            "h1",
            &encode(&heartbeat("h1", 4_600.0)),
            1_000,
        );
        assert_eq!(
            d.decode(&stored),
            KvChange::Put(h1.clone(), heartbeat("h1", 1_000.0))
        );
        let other = entry(
            "converge-hosts",
            "h1",
            &encode(&heartbeat("h2", 1.0)),
            1_000,
        );
        assert!(matches!(d.decode(&other), KvChange::Refused { key, .. } if key == h1));
        assert_eq!(rejects.total(), 0);
    }

    #[test]
    fn statuses_and_queues_must_name_their_key() {
        let rejects = Arc::new(Rejects::default());
        let d = KvDecoder::named(rejects.clone(), |s: &JobStatus| &s.job);
        let s = JobStatus::pending("a".parse().unwrap(), 1.0, 1.0);
        let at = |key: &str| d.decode(&entry("converge-job-status", key, &encode(&s), 1));
        assert!(matches!(at("a"), KvChange::Put(..)));
        assert!(matches!(at("b"), KvChange::Refused { .. }));
        let d = KvDecoder::named(rejects.clone(), |q: &QueueSpec| &q.name);
        let q = QueueSpec::implicit_default();
        let at = |key: &str| d.decode(&entry("converge-queues", key, &encode(&q), 1));
        assert!(matches!(at("default"), KvChange::Put(..)));
        assert!(matches!(at("team-a"), KvChange::Refused { .. }));
        assert_eq!(rejects.total(), 0);
    }
}
