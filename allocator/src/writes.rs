//! What the leader writes: job statuses and host plans (compare-and-set on the revisions it
//! last read or wrote), queue statuses and events; and the re-reads of what another
//! replica wrote, when this one becomes the leader or a write conflicts.

use crate::service::View;
use converge_bus::{Bus, Rejects};
use converge_common::{
    Event, EventKind, HostId, HostPlan, JobId, JobStatus, QueueId, QueueStatus, subjects,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The entries read back from KV whose key parses (`parse`): the revision of each key's
/// latest entry (also of a delete marker or a value that does not decode, so that the next
/// compare-and-set write replaces it) and the decoded values, by key.
fn by_key<K: Ord + Clone, V>(
    loaded: converge_bus::Loaded<V>,
    parse: impl Fn(String) -> Option<K>,
) -> (BTreeMap<K, u64>, BTreeMap<K, V>) {
    let revisions = (loaded.revisions.into_iter())
        .filter_map(|(key, revision)| Some((parse(key)?, revision)))
        .collect();
    let values = (loaded.values.into_iter())
        .filter_map(|(key, (value, _))| Some((parse(key)?, value)))
        .collect();
    (revisions, values)
}

/// Reads the job statuses in KV into `view`: values, the revision of every key, and who
/// may report for each job.
pub(crate) async fn read_statuses(
    bus: &Bus,
    view: &mut View,
    rejects: &Rejects,
) -> Result<(), converge_bus::BusError> {
    let all = bus
        .load_all_entries::<JobStatus>(&bus.status, rejects)
        .await?;
    (view.status_revisions, view.statuses) = by_key(all, |k| JobId::new(k).ok());
    for s in view.statuses.values() {
        view.reporters.note(s);
    }
    Ok(())
}

/// Reads the plans in KV into `view`: values and the revision of every key.
pub(crate) async fn read_plans(
    bus: &Bus,
    view: &mut View,
    rejects: &Rejects,
) -> Result<(), converge_bus::BusError> {
    let all = bus
        .load_all_entries::<HostPlan>(&bus.plans, rejects)
        .await?;
    (view.plan_revisions, view.plans) = by_key(all, |k| HostId::new(k).ok());
    Ok(())
}

/// Re-reads the statuses and plans in KV (when this replica becomes the leader: the previous
/// leader wrote them; or another writer's was seen); a failed read keeps what was known.
pub(crate) async fn reload_written(bus: &Bus, view: &mut View, rejects: &Rejects) {
    if let Err(e) = read_statuses(bus, view, rejects).await {
        tracing::warn!("cannot re-read job statuses: {e}");
    }
    if let Err(e) = read_plans(bus, view, rejects).await {
        tracing::warn!("cannot re-read plans: {e}");
    }
}

/// Jobs whose plans carry a newer generation than their stored status (a leader that
/// crashed, or lost the lease, between writing a new generation's plans and its status),
/// each with the status to write: its generation past every planned one, the placement
/// unchanged. The plans derived from it then carry that fresh number: no generation
/// number is issued twice, with two different placements, and the agents never go back
/// to an older one. Pure.
fn unissued_generations(
    statuses: &BTreeMap<JobId, JobStatus>,
    plans: &BTreeMap<HostId, HostPlan>,
) -> Vec<JobStatus> {
    let mut planned: BTreeMap<&JobId, u64> = BTreeMap::new();
    for a in plans.values().flat_map(|p| &p.workers) {
        let g = planned.entry(&a.job).or_default();
        *g = (*g).max(a.generation);
    }
    planned
        .into_iter()
        .filter_map(|(job, generation)| {
            let status = statuses.get(job)?;
            (generation > status.generation).then(|| JobStatus {
                generation: generation + 1,
                ..status.clone()
            })
        })
        .collect()
}

/// Writes [`unissued_generations`] (a new leader, before its first step), so that its
/// steps continue from a generation no agent has seen.
pub(crate) async fn write_unissued_generations(bus: &Bus, view: &mut View) {
    for status in unissued_generations(&view.statuses, &view.plans) {
        let id = status.job.clone();
        let stored = view.statuses.get(&id).map_or(0, |s| s.generation);
        let expected = view.status_revisions.get(&id).copied();
        match bus
            .put_expecting(&bus.status, id.as_str(), &status, expected)
            .await
        {
            Ok(rev) => {
                tracing::warn!(
                    job = %id,
                    stored,
                    generation = status.generation,
                    "plans carry a generation the job's status does not (the previous leader stopped between the two writes): continuing from a new generation"
                );
                view.status_revisions.insert(id.clone(), rev);
                view.reporters.note(&status);
                view.statuses.insert(id, status);
            }
            Err(e) => tracing::warn!(job = %id, "status not written: {e}"),
        }
    }
}

/// A status without its write time, to tell real changes from re-computations.
pub(crate) fn same_status(a: &JobStatus, b: &JobStatus) -> bool {
    let mut b = b.clone();
    b.updated_at = a.updated_at;
    *a == b
}

/// A failed write that took this long timed out ([`write_changes`]).
const SLOW_WRITE: Duration = Duration::from_secs(1);

pub(crate) async fn write_changes(
    bus: &Bus,
    view: &mut View,
    statuses: BTreeMap<JobId, JobStatus>,
    plans: BTreeMap<HostId, HostPlan>,
    now: f64,
) {
    // Plans first for jobs that stop (so agents act), statuses after; both are level-
    // triggered, so a failed write is retried by the next step. After a write that failed
    // slowly (a timeout) the rest of its bucket waits for the next step too: on a NATS
    // cluster electing that bucket's leader each write would wait for its timeout, and hold
    // up the loop.
    for (host, plan) in plans {
        if view.plans.get(&host) == Some(&plan) {
            continue;
        }
        let started = Instant::now();
        let expected = view.plan_revisions.get(&host).copied();
        match bus
            .put_expecting(&bus.plans, host.as_str(), &plan, expected)
            .await
        {
            Ok(rev) => {
                metrics::counter!("converge_allocator_plan_writes_total").increment(1);
                tracing::info!(%host, workers = plan.workers.len(), revision = rev, "plan written");
                view.plan_revisions.insert(host.clone(), rev);
                view.plans.insert(host, plan);
            }
            Err(e @ converge_bus::BusError::Conflict { .. }) => {
                metrics::counter!("converge_allocator_write_conflicts_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "{e}: another allocator wrote it; re-reading before the next step");
                view.reread = true;
            }
            Err(e) if started.elapsed() >= SLOW_WRITE => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "plan not written: {e}; the others wait for the next step");
                break;
            }
            Err(e) => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "plan not written: {e}");
            }
        }
    }
    for (id, mut status) in statuses {
        if view
            .statuses
            .get(&id)
            .is_some_and(|old| same_status(old, &status))
        {
            continue;
        }
        status.updated_at = now;
        let started = Instant::now();
        let expected = view.status_revisions.get(&id).copied();
        match bus
            .put_expecting(&bus.status, id.as_str(), &status, expected)
            .await
        {
            Ok(rev) => {
                metrics::counter!("converge_allocator_status_writes_total").increment(1);
                view.status_revisions.insert(id.clone(), rev);
                view.statuses.insert(id, status);
            }
            Err(e @ converge_bus::BusError::Conflict { .. }) => {
                metrics::counter!("converge_allocator_write_conflicts_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "{e}: another allocator wrote it; re-reading before the next step");
                view.reread = true;
            }
            Err(e) if started.elapsed() >= SLOW_WRITE => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "status not written: {e}; the others wait for the next step");
                break;
            }
            Err(e) => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "status not written: {e}");
            }
        }
    }
}

/// A queue status stored at most this long ago is rewritten only when more than its usage
/// changed: the usage between two writes follows exactly from the stored one (the queue held
/// the same GPUs since), so skipping writes loses nothing; this bounds how stale the usage
/// `converge queue list` shows can get.
pub const QUEUE_STATUS_REFRESH_S: f64 = 60.0;

/// Whether `new` says more than `old` beyond the usage's natural growth and decay.
fn queue_status_changed(old: &QueueStatus, new: &QueueStatus) -> bool {
    let mut same = new.clone();
    same.usage_gpu_seconds = old.usage_gpu_seconds;
    same.updated_at = old.updated_at;
    same != *old || new.updated_at - old.updated_at >= QUEUE_STATUS_REFRESH_S
}

/// Writes the queue statuses that changed ([`queue_status_changed`]); leader only.
pub(crate) async fn write_queue_statuses(
    bus: &Bus,
    buckets: &converge_bus::QueueBuckets,
    view: &mut View,
    statuses: BTreeMap<QueueId, QueueStatus>,
) {
    for (name, status) in statuses {
        if view
            .queue_statuses
            .get(&name)
            .is_some_and(|old| !queue_status_changed(old, &status))
        {
            continue;
        }
        match bus.put(&buckets.status, name.as_str(), &status).await {
            Ok(_) => {
                view.queue_statuses.insert(name, status);
            }
            Err(e) => tracing::warn!(queue = %name, "queue status not written: {e}"),
        }
    }
}

/// Re-reads the queue statuses in KV (when this replica becomes the leader).
pub(crate) async fn reload_queue_statuses(
    bus: &Bus,
    buckets: &converge_bus::QueueBuckets,
    view: &mut View,
    rejects: &Rejects,
) {
    match bus.load_all::<QueueStatus>(&buckets.status, rejects).await {
        Ok(all) => {
            view.queue_statuses = all
                .into_iter()
                .filter(|(k, (s, _))| s.queue.as_str() == k)
                .map(|(_, (s, _))| (s.queue.clone(), s))
                .collect();
        }
        Err(e) => tracing::warn!("cannot re-read queue statuses: {e}"),
    }
}

pub(crate) async fn publish_event(bus: &Bus, e: &Event) {
    let subject = match &e.kind {
        EventKind::JobSubmitted { job }
        | EventKind::AllocationChanged { job, .. }
        | EventKind::JobFinished { job, .. }
        | EventKind::WorkerStarted { job, .. }
        | EventKind::WorkerExited { job, .. }
        | EventKind::WorkerFailed { job, .. } => subjects::job_events(job),
        EventKind::HostLost { host } => subjects::host_events(host),
        EventKind::PlanApplied { .. } => return,
    };
    if let Err(err) = bus.publish(subject, e).await {
        tracing::debug!("event not published: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::status;
    use converge_common::{JobPhase, WorkerAssignment};

    #[test]
    fn a_queue_status_is_rewritten_when_more_than_its_usage_changed_or_once_a_minute() {
        let old = QueueStatus {
            protocol: converge_common::PROTOCOL_VERSION,
            queue: "team-a".parse().unwrap(),
            gpus_in_use: 4,
            borrowed_gpus: 0,
            lent_gpus: 0,
            fair_share_gpus: 4.0,
            usage_gpu_seconds: 100.0,
            half_life_s: 3600.0,
            running_jobs: 1,
            pending_jobs: 0,
            updated_at: 1000.0,
        };
        let later = QueueStatus {
            usage_gpu_seconds: 140.0,
            updated_at: 1010.0,
            ..old.clone()
        };
        assert!(!queue_status_changed(&old, &later));
        let grown = QueueStatus {
            gpus_in_use: 6,
            borrowed_gpus: 2,
            ..later.clone()
        };
        assert!(queue_status_changed(&old, &grown));
        let stale = QueueStatus {
            updated_at: 1000.0 + QUEUE_STATUS_REFRESH_S,
            ..later
        };
        assert!(queue_status_changed(&old, &stale));
    }

    #[test]
    fn a_planned_generation_without_its_status_is_never_issued_again() {
        let assignment = |job: &str, generation: u64| -> WorkerAssignment {
            serde_json::from_value(serde_json::json!({
                "job": job, "generation": generation, "rank": 0, "world_size": 1,
                "local_rank": 0, "local_world_size": 1, "gpus": [0],
                "master_addr": "127.0.0.1", "master_port": 20000, "command": ["t"],
                "env": {}, "max_restarts": 1
            }))
            .unwrap()
        };
        let plan = |host: &str, workers: Vec<WorkerAssignment>| HostPlan {
            protocol: converge_common::PROTOCOL_VERSION,
            host: HostId::new(host).unwrap(),
            workers,
        };
        // Job a: status at 3 (the helper's), plans at 4 on one host and 3 on another (the
        // crash came between the two plan writes); job b: plans and status agree.
        let statuses: BTreeMap<JobId, JobStatus> = ["a", "b"]
            .into_iter()
            .map(|j| (JobId::new(j).unwrap(), status(j, JobPhase::Running, None)))
            .collect();
        let plans: BTreeMap<HostId, HostPlan> = [
            plan("n1", vec![assignment("a", 4), assignment("b", 3)]),
            plan("n2", vec![assignment("a", 3)]),
        ]
        .into_iter()
        .map(|p| (p.host.clone(), p))
        .collect();
        let fixed = unissued_generations(&statuses, &plans);
        assert_eq!(fixed.len(), 1, "{fixed:?}");
        assert_eq!((fixed[0].job.as_str(), fixed[0].generation), ("a", 5));
        let unchanged = JobStatus {
            generation: 3,
            ..fixed[0].clone()
        };
        assert_eq!(
            unchanged,
            statuses[&JobId::new("a").unwrap()],
            "only the generation"
        );
        // A plan of a job without a status (deleted) changes nothing.
        let orphan: BTreeMap<HostId, HostPlan> = [(
            HostId::new("n3").unwrap(),
            plan("n3", vec![assignment("c", 9)]),
        )]
        .into();
        assert!(unissued_generations(&statuses, &orphan).is_empty());
    }
}
