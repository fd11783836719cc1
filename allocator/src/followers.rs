//! The KV watchers: each follows one bucket (job specs, heartbeats, job statuses, queues,
//! queue statuses) and sends what changes to the main loop as an [`Input`].

use crate::progress::Progress;
use async_nats::jetstream::kv;
use converge_bus::Rejects;
use converge_common::{
    HostId, HostTelemetry, JobId, JobSpec, JobStatus, QueueId, QueueSpec, QueueStatus,
    codec::decode, subjects,
};
use std::sync::Arc;
use tokio::sync::mpsc;

/// An update for the main loop, from the KV watchers (here) and the progress follower
/// ([`crate::progress`]).
pub(crate) enum Input {
    Spec(JobId, Result<JobSpec, String>),
    SpecDeleted(JobId),
    Host(HostTelemetry),
    HostDeleted(HostId),
    /// A job status as stored (by this replica or another): where each generation runs.
    Status(Box<JobStatus>),
    StatusDeleted(JobId),
    Progress(Box<Progress>),
    /// A message of the progress stream that is no report (refused and counted by the
    /// follower as it read it): its sequence, for the leader to delete.
    Undecodable(u64),
    ProgressCaughtUp,
    Queue(QueueSpec),
    QueueDeleted(QueueId),
    /// A queue status as stored (by this replica or another): the usage to continue from.
    QueueStatus(Box<QueueStatus>),
    QueueStatusDeleted(QueueId),
}

/// Follows KV `converge-jobs`: current values first, then updates.
pub(crate) async fn watch_jobs(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_JOBS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let Ok(id) = JobId::new(entry.key.clone()) else {
                tracing::warn!(key = %entry.key, "job key is not a valid job id; ignored");
                return None;
            };
            if entry.operation != kv::Operation::Put {
                return Some(Input::SpecDeleted(id));
            }
            let spec = match decode::<JobSpec>(&entry.value) {
                Ok(spec) if spec.id == id => Ok(spec),
                Ok(spec) => Err(format!("spec id {} differs from its key {id}", spec.id)),
                Err(e) => {
                    rejects.record(&source, id.as_str(), &e);
                    Err(e.to_string())
                }
            };
            Some(Input::Spec(id, spec))
        },
        || None,
    )
    .await
}

/// Follows KV `converge-hosts` (heartbeats). A heartbeat's `time` becomes the time the
/// NATS server stored it ([`received_at`]): liveness is judged by when the heartbeat
/// arrived, never by the agent's clock (a clock behind by more than the host timeout would
/// mark an honest host lost, one ahead would keep a dead host live).
pub(crate) async fn watch_hosts(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_HOSTS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let id = HostId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::HostDeleted(id));
            }
            let mut t: HostTelemetry = rejects.decode(&source, id.as_str(), &entry.value)?;
            if t.host != id {
                return None;
            }
            let sent = t.time;
            t.time = received_at(&entry);
            if (t.time - sent).abs() > CLOCK_SKEW_WARNING_S {
                tracing::debug!(
                    host = %id,
                    skew_s = sent - t.time,
                    "heartbeat time differs from its arrival; liveness follows the arrival"
                );
            }
            Some(Input::Host(t))
        },
        || None,
    )
    .await
}

/// Skew between an agent's clock and the NATS server's worth a debug line.
const CLOCK_SKEW_WARNING_S: f64 = 5.0;

/// When the NATS server stored a KV entry, UNIX seconds (the server's clock: the same for
/// every agent, and kept across allocator restarts, unlike a local receipt time).
fn received_at(entry: &kv::Entry) -> f64 {
    entry.created.unix_timestamp_nanos() as f64 / 1e9
}

/// Follows KV `converge-job-status`: the placements of every job's generations, whoever
/// wrote them (the leader's own writes come back too and change nothing).
pub(crate) async fn watch_statuses(
    store: kv::Store,
    tx: mpsc::Sender<Input>,
    rejects: Arc<Rejects>,
) {
    let source = format!("kv:{}", subjects::BUCKET_JOB_STATUS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let id = JobId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::StatusDeleted(id));
            }
            let s: JobStatus = rejects.decode(&source, id.as_str(), &entry.value)?;
            (s.job == id).then(|| Input::Status(Box::new(s)))
        },
        || None,
    )
    .await
}

/// Follows KV `converge-queues`: current values first, then updates.
pub(crate) async fn watch_queues(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_QUEUES);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let name = QueueId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::QueueDeleted(name));
            }
            let spec: QueueSpec = rejects.decode(&source, name.as_str(), &entry.value)?;
            (spec.name == name).then_some(Input::Queue(spec))
        },
        || None,
    )
    .await
}

/// Follows KV `converge-queue-status` (the leader's own writes come back and change nothing).
pub(crate) async fn watch_queue_statuses(
    store: kv::Store,
    tx: mpsc::Sender<Input>,
    rejects: Arc<Rejects>,
) {
    let source = format!("kv:{}", subjects::BUCKET_QUEUE_STATUS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let name = QueueId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::QueueStatusDeleted(name));
            }
            let s: QueueStatus = rejects.decode(&source, name.as_str(), &entry.value)?;
            (s.queue == name).then(|| Input::QueueStatus(Box::new(s)))
        },
        || None,
    )
    .await
}
