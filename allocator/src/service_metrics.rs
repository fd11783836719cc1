//! The allocator's metrics: their descriptions, the jobs by phase, the allocation changes
//! and finished jobs of each step, and the per-job series.

use converge_common::{Event, EventKind, JobId, JobStatus};
use std::collections::BTreeMap;

/// The labels of `converge_allocator_refused_messages`: why a message was refused (each
/// exported from the start, 0 until it happens).
pub(crate) const REFUSAL_KINDS: [&str; 7] = [
    "malformed",
    "wrong_version",
    "invalid",
    "too_large",
    "wrong_subject",
    "not_placed",
    "bad_key",
];

/// Describes the allocator's metrics (names, units, help) to the recorder.
pub(crate) fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        "converge_allocator_step_seconds",
        Unit::Seconds,
        "Time of one scheduling step (pure decision: fits, policy, placement, plans); label policy=true when allocations were re-decided"
    );
    describe_histogram!(
        "converge_allocator_ingest_lag_seconds",
        Unit::Seconds,
        "From the progress stream storing a report to the allocator applying it (after the start-up replay)"
    );
    describe_counter!(
        "converge_allocator_progress_reports_total",
        "Progress reports applied to the histories (the start-up replay included)"
    );
    describe_counter!(
        "converge_allocator_plan_writes_total",
        "Host plans written to KV (only changed plans are written)"
    );
    describe_counter!(
        "converge_allocator_write_conflicts_total",
        "Plan and status writes refused because another allocator changed the key since this one read it (compare-and-set), by bucket"
    );
    describe_counter!(
        "converge_allocator_refused_kept_total",
        "Refused progress messages left in the stream because the deletion queue was full (a flood faster than deletions); the stream's bounds evict them"
    );
    describe_counter!(
        "converge_allocator_refused_delete_failures_total",
        "Refused progress messages the leader tried and failed to delete from the stream (NATS errors); the stream's bounds evict them"
    );
    describe_counter!(
        "converge_allocator_write_failures_total",
        "Plan and status writes that failed (NATS errors and timeouts, not compare-and-set conflicts), by bucket; the next step writes them again"
    );
    describe_counter!(
        "converge_allocator_status_writes_total",
        "Job statuses written to KV (only changed statuses are written)"
    );
    describe_gauge!(
        "converge_allocator_input_queue",
        "Updates waiting in the allocator's input queue after a step"
    );
    describe_gauge!(
        "converge_allocator_hosts_live",
        "Hosts whose heartbeat is younger than the host timeout"
    );
    describe_gauge!(
        "converge_allocator_gpus_live",
        "GPUs of the live hosts, by GPU type (the hosts' gpu.type label); 0 once a type's last host is gone"
    );
    describe_gauge!("converge_allocator_jobs", "Jobs by phase");
    describe_counter!(
        "converge_allocator_allocation_changes_total",
        "Allocation changes decided (new generations and preemptions), by cause: started, grown, shrunk, preempted, moved, host_lost, batch, address"
    );
    describe_counter!(
        "converge_allocator_jobs_finished_total",
        "Jobs that reached a final phase, by phase"
    );
    describe_gauge!(
        "converge_allocator_refused_messages",
        "Messages refused since start, by kind: malformed, wrong_version, invalid, too_large (not decodable), wrong_subject (a progress report on another job's or host's subject), not_placed (a progress report from a host outside the job's placement)"
    );
}

pub(crate) fn record_job_phases(statuses: &BTreeMap<JobId, JobStatus>) {
    use converge_common::JobPhase;
    let mut counts: BTreeMap<&'static str, usize> = [
        JobPhase::Pending,
        JobPhase::Restarting,
        JobPhase::Running,
        JobPhase::Completed,
        JobPhase::Failed,
        JobPhase::Cancelled,
    ]
    .into_iter()
    .map(|p| (p.as_str(), 0))
    .collect();
    for s in statuses.values() {
        *counts.entry(s.phase.as_str()).or_default() += 1;
    }
    for (phase, n) in counts {
        metrics::gauge!("converge_allocator_jobs", "phase" => phase).set(n as f64);
    }
}

/// Counts the step's allocation changes by cause (the status's record of the change; from
/// the worker counts when the record is missing) and its finished jobs by phase.
pub(crate) fn record_changes(events: &[Event], statuses: &BTreeMap<JobId, JobStatus>) {
    for e in events {
        match &e.kind {
            EventKind::AllocationChanged {
                job,
                generation,
                from_workers,
                to_workers,
            } => {
                let recorded = statuses.get(job).and_then(|s| {
                    s.allocations
                        .iter()
                        .rev()
                        .find(|a| a.generation == *generation)
                        .map(|a| a.cause.as_str())
                });
                let cause = recorded.unwrap_or(match (*from_workers, *to_workers) {
                    (0, _) => "started",
                    (_, 0) => "preempted",
                    (f, t) if t > f => "grown",
                    (f, t) if t < f => "shrunk",
                    _ => "moved",
                });
                metrics::counter!("converge_allocator_allocation_changes_total", "cause" => cause)
                    .increment(1);
            }
            EventKind::JobFinished { phase, .. } => {
                metrics::counter!("converge_allocator_jobs_finished_total", "phase" => phase.as_str())
                    .increment(1);
            }
            _ => {}
        }
    }
}

/// Per-job series of the jobs still pending, restarting or running, label `job_id` only
/// (not `job`: Prometheus gives every scraped series its target's `job` label, and would
/// rename ours to `exported_job`):
/// a finished job (or a deleted one) has no series from the next step on, so the number of
/// series follows the number of active jobs, not every job ever submitted. Missing figures
/// (no loss reported yet, no fitted curve) have no series.
pub(crate) fn job_families(
    statuses: &BTreeMap<JobId, JobStatus>,
) -> converge_bus::metrics::Snapshot {
    use converge_bus::metrics::Family;
    use converge_common::JobPhase;
    let mut loss = Family::gauge(
        "converge_job_loss",
        "Latest training loss rank 0 reported, per active job",
    );
    let mut predicted = Family::gauge(
        "converge_job_predicted_loss",
        "Loss the fitted curve predicts one horizon ahead at the current allocation",
    );
    let mut workers = Family::gauge(
        "converge_job_workers",
        "Workers of the job's current generation (0 while pending)",
    );
    let mut throughput = Family::gauge(
        "converge_job_samples_per_second",
        "Observed throughput of the current allocation, samples per second",
    );
    let mut generation = Family::gauge(
        "converge_job_generation",
        "The job's current generation (+1 on every allocation change)",
    );
    for s in statuses.values() {
        if !matches!(
            s.phase,
            JobPhase::Pending | JobPhase::Restarting | JobPhase::Running
        ) {
            continue;
        }
        let job = || vec![("job_id", s.job.to_string())];
        loss.push_some(job(), s.loss);
        predicted.push_some(job(), s.predicted_loss);
        workers.push(job(), f64::from(s.world_size));
        throughput.push_some(job(), s.samples_per_s);
        generation.push(job(), s.generation as f64);
    }
    vec![loss, predicted, workers, throughput, generation]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::status;
    use converge_common::JobPhase;

    #[test]
    fn only_active_jobs_carry_series_and_missing_figures_have_none() {
        let mut statuses: BTreeMap<JobId, JobStatus> = BTreeMap::new();
        for (id, phase, loss) in [
            ("run", JobPhase::Running, Some(0.5)),
            ("wait", JobPhase::Pending, None),
            ("done", JobPhase::Completed, Some(0.1)),
            ("bad", JobPhase::Failed, Some(0.2)),
            ("gone", JobPhase::Cancelled, Some(0.3)),
        ] {
            statuses.insert(id.parse().unwrap(), status(id, phase, loss));
        }
        statuses
            .get_mut(&"run".parse().unwrap())
            .unwrap()
            .predicted_loss = Some(0.4);
        statuses
            .get_mut(&"run".parse().unwrap())
            .unwrap()
            .samples_per_s = Some(250.0);
        let text = converge_bus::metrics::render_snapshots([&job_families(&statuses)]);
        for line in [
            r#"converge_job_loss{job_id="run"} 0.5"#,
            r#"converge_job_predicted_loss{job_id="run"} 0.4"#,
            r#"converge_job_samples_per_second{job_id="run"} 250"#,
            r#"converge_job_workers{job_id="run"} 2"#,
            r#"converge_job_workers{job_id="wait"} 2"#,
            r#"converge_job_generation{job_id="run"} 3"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
        assert!(!text.contains(r#"converge_job_loss{job="wait"}"#), "{text}");
        for finished in ["done", "bad", "gone"] {
            assert!(!text.contains(&format!("job=\"{finished}\"")), "{text}");
        }
        // The job finishes: its series are gone from the next snapshot.
        statuses.get_mut(&"run".parse().unwrap()).unwrap().phase = JobPhase::Completed;
        let text = converge_bus::metrics::render_snapshots([&job_families(&statuses)]);
        assert!(!text.contains(r#"job="run""#), "{text}");
    }
}
