//! Tiresias: discretized two-dimensional least-attained-service (Gu et al., "Tiresias: A GPU
//! Cluster Manager for Distributed Deep Learning", NSDI'19), as the Pollux simulator's
//! `TiresiasPolicy` runs it (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for
//! Goodput-Optimized Deep Learning", OSDI'21; `petuum/adaptdl`, `simulator/tiresias.py`).
//!
//! # Algorithm
//!
//! 1. **Two queues.** A job whose attained service is below the threshold (16 GPU-hours,
//!    [`TIRESIAS_QUEUE_THRESHOLD_GPU_SECONDS`]) is in queue 0, otherwise in queue 1. The
//!    attained service is [`PolicyJob::attained_gpu_seconds`]; Pollux computes it as executed
//!    time × requested replicas (one GPU each), which is what a gang job that always runs at
//!    its requested size accumulates in GPU-seconds. A NaN counts as no service.
//! 2. **Order.** Queue 0 before queue 1; within a queue by arrival (`submitted_at`, then id).
//!    Pollux keeps queue 0 in arrival order and queue 1 in demotion order; since demotion
//!    needs state we do not keep, arrival order stands in for it in queue 1 (documented
//!    approximation: two jobs demoted in the opposite order of their arrival swap places).
//! 3. **Gang admission.** In that order, each job runs with exactly `requested_workers`
//!    (clamped into `[min, max]`) if that many GPUs are still free, else it waits; later jobs
//!    are still tried (Pollux iterates over every queued job and runs each that fits). A job
//!    that can never run gets 0.
//!
//! Running jobs have no precedence: a job demoted to queue 1 loses its GPUs to newcomers in
//! queue 0 (preemption is implicit in the order). Pollux disables Tiresias's starvation
//! promotion (`_solve_starvation = 0`), and so does this policy: a demoted job is never
//! promoted back. Since attained service only grows, the queue follows from the attained
//! service alone and the policy needs no state.

use crate::policies::{Decision, PolicyJob};

use super::{ClusterView, Policy, arrival_order, backfill, decision};

/// The attained service, in GPU-seconds, from which a job is in the second queue: 16 GPU-hours,
/// as in the Pollux simulator.
pub const TIRESIAS_QUEUE_THRESHOLD_GPU_SECONDS: f64 = 3600.0 * 16.0;

/// Two-queue discretized least-attained-service with gang admission (see the module
/// documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tiresias {
    /// Attained service, in GPU-seconds, at and above which a job is in queue 1.
    pub queue_threshold_gpu_seconds: f64,
}

impl Default for Tiresias {
    fn default() -> Self {
        Self {
            queue_threshold_gpu_seconds: TIRESIAS_QUEUE_THRESHOLD_GPU_SECONDS,
        }
    }
}

impl Tiresias {
    /// The queue of `job`: 0 below the threshold, 1 at or above it.
    pub fn queue(&self, job: &PolicyJob) -> u8 {
        u8::from(job.attained_gpu_seconds >= self.queue_threshold_gpu_seconds)
    }
}

impl Policy for Tiresias {
    fn resizes_running_jobs(&self) -> bool {
        false
    }
    fn name(&self) -> &'static str {
        "tiresias"
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let order = arrival_order(jobs);
        // A stable sort keeps arrival order within each queue.
        let mut priority = order.clone();
        priority.sort_by_key(|&i| self.queue(&jobs[i]));

        let mut free = u64::from(cluster.total_gpus);
        let mut workers = vec![0u32; jobs.len()];
        backfill(jobs, priority, &mut workers, &mut free);

        decision(jobs, &order, &workers)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job, pairs};
    use super::*;

    const HOUR: f64 = 3600.0;

    #[test]
    fn a_job_past_sixteen_gpu_hours_yields_to_a_newcomer() {
        let mut veteran = job("veteran", 0.0, 4, 4);
        veteran.current_workers = 4;
        veteran.attained_gpu_seconds = 16.0 * HOUR;
        let newcomer = job("newcomer", 100.0, 4, 4);
        let jobs = [veteran.clone(), newcomer.clone()];
        let decision = Tiresias::default().allocate(&cluster(4), &jobs);
        assert_eq!(pairs(&decision), [("newcomer", 4), ("veteran", 0)]);

        // Just below the threshold the veteran is in queue 0 and keeps its arrival priority.
        veteran.attained_gpu_seconds = 16.0 * HOUR - 1.0;
        let decision = Tiresias::default().allocate(&cluster(4), &[veteran, newcomer]);
        assert_eq!(pairs(&decision), [("newcomer", 0), ("veteran", 4)]);
    }

    #[test]
    fn within_a_queue_jobs_go_by_arrival() {
        let mut old = job("old", 0.0, 3, 3);
        old.attained_gpu_seconds = 20.0 * HOUR;
        let mut older = job("older", -1.0, 3, 3);
        older.attained_gpu_seconds = 100.0 * HOUR;
        let mut young = job("young", 5.0, 3, 3);
        young.attained_gpu_seconds = HOUR;
        let decision = Tiresias::default().allocate(&cluster(6), &[old, older, young]);
        // Queue 0: young; queue 1 by arrival: older, then old (no room left).
        assert_eq!(pairs(&decision), [("old", 0), ("older", 3), ("young", 3)]);
    }

    #[test]
    fn jobs_run_at_their_requested_size_or_wait() {
        let mut elastic = job("elastic", 0.0, 6, 8);
        elastic.min_workers = 2;
        let decision = Tiresias::default().allocate(&cluster(5), &[elastic.clone()]);
        // Gang: 6 workers do not fit in 5 GPUs, and Tiresias never shrinks a job to fit.
        assert_eq!(pairs(&decision), [("elastic", 0)]);
        let decision = Tiresias::default().allocate(&cluster(8), &[elastic]);
        assert_eq!(pairs(&decision), [("elastic", 6)]);
    }

    #[test]
    fn later_jobs_that_fit_run_past_one_that_does_not() {
        let big = job("big", 0.0, 8, 8);
        let small = job("small", 1.0, 2, 2);
        let mut wide = job("wide", 2.0, 2, 2);
        wide.gpus_per_worker = 2;
        let decision = Tiresias::default().allocate(&cluster(6), &[big, small, wide]);
        assert_eq!(pairs(&decision), [("big", 0), ("small", 2), ("wide", 2)]);
    }

    #[test]
    fn the_threshold_is_configurable() {
        let mut a = job("a", 0.0, 2, 2);
        a.attained_gpu_seconds = 10.0;
        let b = job("b", 1.0, 2, 2);
        let policy = Tiresias {
            queue_threshold_gpu_seconds: 10.0,
        };
        let decision = policy.allocate(&cluster(2), &[a, b]);
        assert_eq!(pairs(&decision), [("a", 0), ("b", 2)]);
    }
}
