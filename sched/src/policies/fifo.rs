//! First-in first-out: jobs run in arrival order at the size they asked for, as the FIFO
//! baseline of Gavel's `FIFOPolicy` (Narayanan et al., "Heterogeneity-Aware Cluster Scheduling
//! Policies for Deep Learning Workloads", OSDI'20), and of Tiresias's and Optimus's
//! evaluations.
//!
//! # Algorithm
//!
//! 1. **Non-preemptive.** Running jobs (`current_workers > 0`) keep their allocation, in
//!    arrival order, as long as it is valid (0 or within `[min, max]`) and the GPUs allow
//!    (only a shrunk cluster stops one). A running job that cannot keep its allocation goes
//!    back to the queue at its arrival position.
//! 2. **Strict FIFO.** The other jobs, in arrival order (`submitted_at`, then id), get
//!    exactly `requested_workers` clamped into `[min, max]` if those GPUs are free. The first
//!    job that does not fit stops the queue: no later job starts before it (no backfilling).
//!    That is what Gavel's FIFO does ("no jobs being able to jump ahead in the queue"), and
//!    what a FIFO queue means in YARN's FIFO scheduler and Slurm without backfill; Tiresias,
//!    by contrast, lets smaller jobs through (see [`super::Tiresias`]).
//!
//! A job that could not fit even in the whole, empty cluster, or that can never run at all,
//! is passed over instead of blocking the queue forever (a real deployment refuses it at
//! submission).
//!
//! Applying the decision and deciding again changes nothing: the admitted jobs are kept and
//! the same job is at the head of the queue.

use crate::policies::{Decision, PolicyJob};

use super::{ClusterView, Policy, arrival_order, decision, gpus, keep_running, requested_size};

/// Strict, non-preemptive FIFO at the requested size (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fifo;

impl Policy for Fifo {
    fn resizes_running_jobs(&self) -> bool {
        false
    }
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let order = arrival_order(jobs);
        let total = u64::from(cluster.total_gpus);
        // 1. Running jobs keep their allocation.
        let (mut workers, mut free) = keep_running(jobs, &order, cluster.total_gpus);

        // 2. The queue, strictly in order.
        for &i in &order {
            let job = &jobs[i];
            if workers[i] > 0 {
                continue;
            }
            let Some(size) = requested_size(job) else {
                continue;
            };
            let need = gpus(job, size);
            if need > total {
                continue;
            }
            if need > free {
                break;
            }
            workers[i] = size;
            free -= need;
        }

        decision(jobs, &order, &workers)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job, pairs};
    use super::*;

    #[test]
    fn jobs_run_in_arrival_order_at_their_requested_size() {
        let jobs = [
            job("c", 3.0, 2, 8),
            job("a", 1.0, 3, 8),
            job("b", 2.0, 2, 8),
        ];
        let decision = Fifo.allocate(&cluster(6), &jobs);
        assert_eq!(pairs(&decision), [("a", 3), ("b", 2), ("c", 0)]);
    }

    #[test]
    fn requested_size_is_clamped_into_min_and_max() {
        let mut small = job("small", 0.0, 0, 4);
        small.min_workers = 2;
        let big = job("big", 1.0, 9, 3);
        let decision = Fifo.allocate(&cluster(16), &[small, big]);
        assert_eq!(pairs(&decision), [("big", 3), ("small", 2)]);
    }

    #[test]
    fn a_running_job_is_not_preempted_by_an_earlier_arrival() {
        let early = job("early", 0.0, 4, 4);
        let mut late = job("late", 5.0, 3, 4);
        late.current_workers = 3;
        let decision = Fifo.allocate(&cluster(4), &[early, late]);
        assert_eq!(pairs(&decision), [("early", 0), ("late", 3)]);
    }

    #[test]
    fn a_running_job_keeps_its_size_even_if_it_asked_for_another() {
        let mut running = job("running", 0.0, 4, 8);
        running.current_workers = 2;
        let decision = Fifo.allocate(&cluster(8), &[running]);
        assert_eq!(pairs(&decision), [("running", 2)]);
    }

    #[test]
    fn the_head_of_the_queue_blocks_later_jobs() {
        let mut running = job("running", 0.0, 4, 4);
        running.current_workers = 4;
        let head = job("head", 1.0, 4, 4);
        let small = job("small", 2.0, 1, 1);
        let decision = Fifo.allocate(&cluster(6), &[running, head, small]);
        // Two GPUs stay idle: "small" may not jump ahead of "head".
        assert_eq!(
            pairs(&decision),
            [("head", 0), ("running", 4), ("small", 0)]
        );
    }

    #[test]
    fn jobs_that_can_never_fit_do_not_block_the_queue() {
        let huge = job("huge", 0.0, 16, 16);
        let mut broken = job("broken", 1.0, 2, 2);
        broken.gpus_per_worker = 0;
        let next = job("next", 2.0, 2, 2);
        let decision = Fifo.allocate(&cluster(8), &[huge, broken, next]);
        assert_eq!(pairs(&decision), [("broken", 0), ("huge", 0), ("next", 2)]);
    }

    #[test]
    fn a_shrunk_cluster_stops_the_latest_running_job() {
        let mut first = job("first", 0.0, 2, 2);
        first.current_workers = 2;
        let mut second = job("second", 1.0, 2, 2);
        second.current_workers = 2;
        let decision = Fifo.allocate(&cluster(3), &[second, first]);
        assert_eq!(pairs(&decision), [("first", 2), ("second", 0)]);
    }
}
