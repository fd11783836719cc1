//! Fair share: every job gets the same number of GPUs, and what some cannot use goes to the
//! others (work-conserving). This is the "fair resource allocation" baseline of SLAQ (Zhang,
//! Stafman, Or, Freedman, "SLAQ: Quality-Driven Scheduling for Distributed Machine Learning",
//! SoCC'17), in whole workers: max-min fairness by progressive filling (water-filling).
//!
//! # Algorithm
//!
//! 1. **Admission** in arrival order (`submitted_at`, then id): each job gets its minimum
//!    (`min_workers`, 0 counting as 1) if that many GPUs are free, else 0 (gang admission;
//!    a job that does not fit waits while later, smaller ones may still be admitted).
//!    Running jobs have no precedence: fair share is preemptive.
//! 2. **Water-filling.** One worker at a time goes to the admitted job holding the fewest
//!    GPUs, ties to the earlier arrival (then the smaller id), as long as it is below its
//!    `max_workers` and one more worker's GPUs are free; a job that cannot take one more is
//!    done (free GPUs only decrease). Stops when no job can take more.
//!
//! So 8 GPUs among three 1-GPU-per-worker jobs go 3/3/2 in arrival order; a job capped at
//! its maximum leaves its share to the others; a job whose minimum is above the equal share
//! keeps its minimum. Shares are counted in GPUs, so a job with 2 GPUs per worker and one
//! with 1 end up with about as many GPUs each. The decision does not depend on the current
//! allocations.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::policies::{Decision, PolicyJob};

use super::{ClusterView, Policy, admit_minimums, arrival_order, decision, gpus};

/// Equal share, work-conserving, in whole workers (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fair;

impl Policy for Fair {
    fn name(&self) -> &'static str {
        "fair"
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let order = arrival_order(jobs);
        // 1. Admission at the minimum.
        let (mut workers, mut free) = admit_minimums(jobs, &order, cluster.total_gpus);

        // 2. Water-filling: smallest holding first, then arrival rank.
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = order
            .iter()
            .enumerate()
            .filter(|&(_, &i)| workers[i] > 0)
            .map(|(rank, &i)| Reverse((gpus(&jobs[i], workers[i]), rank)))
            .collect();
        while let Some(Reverse((_, rank))) = heap.pop() {
            let i = order[rank];
            let job = &jobs[i];
            let need = u64::from(job.gpus_per_worker);
            if workers[i] >= job.max_workers || need > free {
                continue;
            }
            workers[i] += 1;
            free -= need;
            heap.push(Reverse((gpus(job, workers[i]), rank)));
        }

        decision(jobs, &order, &workers)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job, pairs};
    use super::*;

    #[test]
    fn eight_gpus_split_three_three_two_in_arrival_order() {
        let jobs = [
            job("c", 2.0, 1, 8),
            job("a", 0.0, 1, 8),
            job("b", 1.0, 1, 8),
        ];
        let decision = Fair.allocate(&cluster(8), &jobs);
        assert_eq!(pairs(&decision), [("a", 3), ("b", 3), ("c", 2)]);
    }

    #[test]
    fn equal_arrivals_are_ordered_by_id() {
        let jobs = [job("y", 0.0, 1, 8), job("x", 0.0, 1, 8)];
        let decision = Fair.allocate(&cluster(3), &jobs);
        assert_eq!(pairs(&decision), [("x", 2), ("y", 1)]);
    }

    #[test]
    fn what_a_capped_job_cannot_use_goes_to_the_others() {
        let jobs = [
            job("capped", 0.0, 1, 1),
            job("b", 1.0, 1, 8),
            job("c", 2.0, 1, 8),
        ];
        let decision = Fair.allocate(&cluster(9), &jobs);
        assert_eq!(pairs(&decision), [("b", 4), ("c", 4), ("capped", 1)]);
        // More GPUs than everybody can use: every job at its maximum, the rest idle.
        let decision = Fair.allocate(&cluster(40), &jobs);
        assert_eq!(pairs(&decision), [("b", 8), ("c", 8), ("capped", 1)]);
    }

    #[test]
    fn shares_are_counted_in_gpus_and_handed_out_in_whole_workers() {
        let mut wide = job("wide", 0.0, 1, 8);
        wide.gpus_per_worker = 2;
        let narrow = job("narrow", 1.0, 1, 8);
        let decision = Fair.allocate(&cluster(9), &[wide, narrow]);
        // wide holds 2 then 4 GPUs, narrow 1 to 5; with 1 GPU left, wide's next worker no longer fits.
        assert_eq!(pairs(&decision), [("narrow", 5), ("wide", 2)]);
    }

    #[test]
    fn minimums_that_do_not_all_fit_are_admitted_in_arrival_order() {
        let mut first = job("first", 0.0, 1, 8);
        first.min_workers = 3;
        let mut second = job("second", 1.0, 1, 8);
        second.min_workers = 3;
        let third = job("third", 2.0, 1, 8);
        let decision = Fair.allocate(&cluster(5), &[third, second, first]);
        // "second" does not fit beside "first"; the later, smaller "third" does.
        assert_eq!(
            pairs(&decision),
            [("first", 3), ("second", 0), ("third", 2)]
        );
    }

    #[test]
    fn running_jobs_give_up_gpus_to_newcomers() {
        let mut running = job("running", 0.0, 1, 8);
        running.current_workers = 8;
        let newcomer = job("newcomer", 1.0, 1, 8);
        let decision = Fair.allocate(&cluster(8), &[running, newcomer]);
        assert_eq!(pairs(&decision), [("newcomer", 4), ("running", 4)]);
    }
}
