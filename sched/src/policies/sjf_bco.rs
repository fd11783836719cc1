//! SJF-BCO online: smallest job first, gang at the requested size, non-preemptive, with
//! backfilling. The online half of SJF-BCO (Yu, Ji, Rajan, Liu, "On Scheduling
//! Ring-All-Reduce Learning Jobs in Multi-Tenant GPU Clusters with Communication
//! Contention", MobiHoc'22; design brief §5.3): this policy decides *which* jobs run (the
//! GPU counts); the *where*, balancing NIC contention against the overhead of spanning
//! servers, is [`crate::placement::place_bco`] (`PlacementKind::Bco`, the simulator's
//! `--placement bco`), which it is meant to run with. The offline algorithm, its κ search
//! and its comparison with exact optima are in the simulator (`converge_sim::makespan`).
//!
//! # Algorithm
//!
//! 1. **Non-preemptive.** Running jobs (`current_workers > 0`) keep their allocation, in
//!    arrival order, as long as it is valid (within `[min, max]`) and the GPUs allow (only a
//!    shrunk cluster stops one, the latest arrivals first). A running job that cannot keep
//!    its allocation goes back to the queue.
//! 2. **Smallest job first.** The other jobs are ordered by estimated size, smallest first,
//!    and each gets exactly `requested_workers` clamped into `[min, max]` (gang) if that
//!    many GPUs are free; a job that does not fit waits and later, larger jobs that fit
//!    still start (backfilling). A job that can never run gets 0.
//!
//! # Size
//!
//! The size of a job is its estimated remaining GPU-time, `GPUs × remaining time` in
//! GPU-seconds, at its requested size `w`: remaining time = `remaining_work /
//! throughput[w − 1]` (the table's last entry beyond its end), when the job has both and
//! they give a finite, non-negative time (a throughput that is not positive gives none).
//! Jobs with a size go first, by size; jobs without one (those without a fitted
//! throughput model yet, or, in the service, without a `target_loss`: the policy declares
//! `estimates`, [`crate::policies::PolicyInputs`]) follow, by requested GPUs (`requested
//! workers × gpus_per_worker`), the proxy for size that needs no estimate. Ties, in both groups, go by arrival (`submitted_at`, then
//! id). Attained service is deliberately not used: it measures what a job has had, not what
//! it still needs.
//!
//! Applying the decision and deciding again changes nothing: admitted jobs are kept, and the
//! jobs left waiting still do not fit.

use std::cmp::Ordering;

use crate::policies::{Decision, PolicyInputs, PolicyJob};

use super::{
    ClusterView, Policy, arrival_cmp, arrival_order, backfill, decision, gpus, keep_running,
    requested_size,
};

/// Smallest job first, gang at the requested size, non-preemptive, backfilling (see the
/// module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SjfBco;

impl SjfBco {
    /// The job's estimated remaining GPU-time at its requested size, in GPU-seconds, when
    /// its throughput table and remaining work give one (see the module documentation).
    pub fn estimated_gpu_seconds(job: &PolicyJob) -> Option<f64> {
        let size = requested_size(job)?;
        let remaining = job.remaining_work.filter(|r| r.is_finite() && *r >= 0.0)?;
        let table = job.throughput.as_deref().filter(|t| !t.is_empty())?;
        let rate = table[(size as usize).min(table.len()) - 1];
        if !(rate.is_finite() && rate > 0.0) {
            return None;
        }
        let gpu_seconds = gpus(job, size) as f64 * (remaining / rate);
        gpu_seconds.is_finite().then_some(gpu_seconds)
    }

    /// Queue order: jobs with an estimate by it, then the others by requested GPUs; ties by
    /// arrival.
    fn queue_cmp(a: &PolicyJob, b: &PolicyJob) -> Ordering {
        let requested = |j: &PolicyJob| requested_size(j).map_or(u64::MAX, |w| gpus(j, w));
        match (
            Self::estimated_gpu_seconds(a),
            Self::estimated_gpu_seconds(b),
        ) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => requested(a).cmp(&requested(b)),
        }
        .then_with(|| arrival_cmp(a, b))
    }
}

impl Policy for SjfBco {
    fn resizes_running_jobs(&self) -> bool {
        false
    }
    fn name(&self) -> &'static str {
        "sjf-bco"
    }

    fn inputs(&self) -> PolicyInputs {
        PolicyInputs {
            estimates: true,
            ..PolicyInputs::default()
        }
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let order = arrival_order(jobs);
        // 1. Running jobs keep their allocation.
        let (mut workers, mut free) = keep_running(jobs, &order, cluster.total_gpus);

        // 2. The queue, smallest first, with backfilling.
        let mut queue: Vec<usize> = order.iter().copied().filter(|&i| workers[i] == 0).collect();
        queue.sort_by(|&a, &b| Self::queue_cmp(&jobs[a], &jobs[b]));
        backfill(jobs, queue, &mut workers, &mut free);

        decision(jobs, &order, &workers)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job, pairs};
    use super::*;

    #[test]
    fn smaller_requests_go_first_without_estimates() {
        let jobs = [
            job("big", 0.0, 6, 8),
            job("mid", 1.0, 3, 8),
            job("small", 2.0, 2, 8),
        ];
        let decision = SjfBco.allocate(&cluster(6), &jobs);
        // small (2) and mid (3) fit; big (6) waits although it arrived first.
        assert_eq!(pairs(&decision), [("big", 0), ("mid", 3), ("small", 2)]);
    }

    #[test]
    fn requested_gpus_count_gpus_per_worker_and_ties_go_by_arrival() {
        let mut wide = job("wide", 0.0, 2, 2);
        wide.gpus_per_worker = 2; // 4 GPUs
        let narrow = job("narrow", 1.0, 3, 3); // 3 GPUs
        let twin = job("twin", 0.5, 3, 3); // 3 GPUs, earlier
        let decision = SjfBco.allocate(&cluster(4), &[wide, narrow, twin]);
        assert_eq!(pairs(&decision), [("narrow", 0), ("twin", 3), ("wide", 0)]);
    }

    #[test]
    fn estimates_order_the_queue_when_present() {
        // "long" asks for fewer GPUs but has far more GPU-time left.
        let mut long = job("long", 0.0, 2, 4);
        long.throughput = Some(vec![1.0, 2.0, 3.0, 4.0]);
        long.remaining_work = Some(1000.0); // 2 GPUs × 500 s = 1000 GPU-s
        let mut short = job("short", 1.0, 4, 4);
        short.throughput = Some(vec![1.0, 2.0]); // beyond the table: the last entry
        short.remaining_work = Some(100.0); // 4 GPUs × 50 s = 200 GPU-s
        let unknown = job("unknown", -1.0, 1, 1);
        assert_eq!(SjfBco::estimated_gpu_seconds(&long), Some(1000.0));
        assert_eq!(SjfBco::estimated_gpu_seconds(&short), Some(200.0));
        assert_eq!(SjfBco::estimated_gpu_seconds(&unknown), None);
        let decision = SjfBco.allocate(&cluster(5), &[long, short, unknown]);
        // short (estimate) first, then long (estimate) does not fit, unknown backfills.
        assert_eq!(
            pairs(&decision),
            [("long", 0), ("short", 4), ("unknown", 1)]
        );
    }

    #[test]
    fn unusable_estimates_fall_back_to_requested_gpus() {
        let mut broken = job("broken", 0.0, 2, 2);
        broken.throughput = Some(vec![0.0, 0.0]);
        broken.remaining_work = Some(10.0);
        assert_eq!(SjfBco::estimated_gpu_seconds(&broken), None);
        broken.throughput = Some(vec![1.0, 1.0]);
        broken.remaining_work = Some(f64::NAN);
        assert_eq!(SjfBco::estimated_gpu_seconds(&broken), None);
        broken.remaining_work = Some(-1.0);
        assert_eq!(SjfBco::estimated_gpu_seconds(&broken), None);
        broken.throughput = Some(Vec::new());
        broken.remaining_work = Some(1.0);
        assert_eq!(SjfBco::estimated_gpu_seconds(&broken), None);
    }

    #[test]
    fn running_jobs_are_not_preempted_by_smaller_ones() {
        let mut running = job("running", 5.0, 4, 4);
        running.current_workers = 4;
        let small = job("small", 0.0, 1, 1);
        let decision = SjfBco.allocate(&cluster(4), &[running, small]);
        assert_eq!(pairs(&decision), [("running", 4), ("small", 0)]);
    }

    #[test]
    fn jobs_run_at_their_requested_size_or_wait() {
        let mut elastic = job("elastic", 0.0, 6, 8);
        elastic.min_workers = 2;
        let decision = SjfBco.allocate(&cluster(5), &[elastic.clone()]);
        assert_eq!(pairs(&decision), [("elastic", 0)]);
        let decision = SjfBco.allocate(&cluster(8), &[elastic]);
        assert_eq!(pairs(&decision), [("elastic", 6)]);
    }

    #[test]
    fn a_shrunk_cluster_stops_the_latest_running_job() {
        let mut first = job("first", 0.0, 2, 2);
        first.current_workers = 2;
        let mut second = job("second", 1.0, 2, 2);
        second.current_workers = 2;
        let decision = SjfBco.allocate(&cluster(3), &[second, first]);
        assert_eq!(pairs(&decision), [("first", 2), ("second", 0)]);
    }
}
