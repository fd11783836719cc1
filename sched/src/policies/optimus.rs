//! Optimus: greedy hand-out of GPUs by the reduction of each job's estimated remaining time
//! (Peng et al., "Optimus: An Efficient Dynamic Resource Scheduler for Deep Learning
//! Clusters", EuroSys'18), with an oracle for the remaining work and the throughput, as the
//! Pollux simulator's "Optimus+Oracle" baseline (Qiao et al., OSDI'21; `petuum/adaptdl`,
//! `simulator/optimus.py`, `OptimusPolicy`).
//!
//! # Algorithm
//!
//! The estimated remaining time of a job with `w` workers is `T(w) = remaining_work /
//! throughput[w − 1]`.
//!
//! 1. **Admission** in arrival order (`submitted_at`, then id): each job gets its minimum
//!    (`min_workers`, 0 counting as 1; Pollux uses 1 replica) if that many GPUs are free,
//!    else 0. Running jobs have no precedence (Optimus re-decides everything each round).
//! 2. **Greedy.** Repeatedly, the job with the largest gain per GPU of one more worker,
//!    `(T(w) − T(w + 1)) / gpus_per_worker`, gets that worker, as long as it stays within
//!    `max_workers` and its GPUs are free; ties go to the earlier arrival (then the smaller
//!    id). A job whose next worker does not fit, or gains nothing (`≤ 0`), gets no more
//!    (as in Pollux, a job is not revisited once its marginal gain is not positive). Stops
//!    when no job can gain, so GPUs may stay idle.
//!
//! # The oracle and its substitutes
//!
//! - `throughput` (progress units per second with `w` workers at index `w − 1`) is the
//!   oracle's; Pollux's oracle predicts step time from the measured application profile.
//!   Beyond the end of the table, throughput stays at its last entry (so a job gains nothing
//!   from workers the table does not describe). A missing or empty table counts as linear
//!   scaling, `throughput[w − 1] = w`.
//! - `remaining_work` is the oracle's work left (Pollux: iterations to the target epoch). A
//!   missing or NaN value counts as 1 (Pollux also uses 1 for a job whose work is done);
//!   negative values count as 0 (no gain from more workers).
//! - A throughput that is NaN or not positive makes the remaining time infinite; a gain of
//!   `∞ − ∞` counts as 0.
//!
//! Jobs with an oracle and jobs with substitutes compete on the same scale, which only makes
//! sense when the units agree; in the simulator every job has an oracle.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::policies::{Decision, PolicyInputs, PolicyJob};

use super::{ClusterView, Policy, admit_minimums, arrival_order, decision};

/// Greedy by remaining-time reduction with an oracle (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Optimus;

impl Optimus {
    /// The job's estimated remaining time with `workers ≥ 1` workers, in seconds.
    pub fn remaining_time(job: &PolicyJob, workers: u32) -> f64 {
        let remaining = match job.remaining_work {
            Some(r) if !r.is_nan() => r.max(0.0),
            _ => 1.0,
        };
        if remaining == 0.0 {
            return 0.0;
        }
        let throughput = match job.throughput.as_deref() {
            Some(table) if !table.is_empty() => {
                let index = (workers.max(1) as usize).min(table.len()) - 1;
                table[index]
            }
            _ => f64::from(workers.max(1)),
        };
        if throughput > 0.0 {
            remaining / throughput
        } else {
            f64::INFINITY
        }
    }

    /// The reduction of remaining time per GPU from one more worker beyond `workers`; never
    /// NaN.
    pub fn gain_per_gpu(job: &PolicyJob, workers: u32) -> f64 {
        let gain = Self::remaining_time(job, workers) - Self::remaining_time(job, workers + 1);
        let per_gpu = gain / f64::from(job.gpus_per_worker.max(1));
        if per_gpu.is_nan() { 0.0 } else { per_gpu }
    }
}

/// A candidate: one more worker for the job at arrival rank `rank`.
#[derive(Debug, Clone, Copy)]
struct Step {
    gain_per_gpu: f64,
    rank: usize,
}

impl Ord for Step {
    /// Larger gain first, then earlier arrival.
    fn cmp(&self, other: &Self) -> Ordering {
        self.gain_per_gpu
            .total_cmp(&other.gain_per_gpu)
            .then(other.rank.cmp(&self.rank))
    }
}

impl PartialOrd for Step {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Step {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Step {}

impl Policy for Optimus {
    fn name(&self) -> &'static str {
        "optimus"
    }

    fn inputs(&self) -> PolicyInputs {
        PolicyInputs {
            estimates: true,
            oracle: true,
            ..PolicyInputs::default()
        }
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let order = arrival_order(jobs);
        // 1. Admission at the minimum.
        let (mut workers, mut free) = admit_minimums(jobs, &order, cluster.total_gpus);

        // 2. Greedy by gain per GPU; each job has at most one candidate in the heap.
        let next_step = |rank: usize, current: u32| {
            let job = &jobs[order[rank]];
            let gain_per_gpu = Optimus::gain_per_gpu(job, current);
            (current < job.max_workers && gain_per_gpu > 0.0).then_some(Step { gain_per_gpu, rank })
        };
        let mut heap: BinaryHeap<Step> = order
            .iter()
            .enumerate()
            .filter(|&(_, &i)| workers[i] > 0)
            .filter_map(|(rank, &i)| next_step(rank, workers[i]))
            .collect();
        while let Some(step) = heap.pop() {
            let i = order[step.rank];
            let need = u64::from(jobs[i].gpus_per_worker);
            if need > free {
                // Free GPUs only decrease: this job is done.
                continue;
            }
            workers[i] += 1;
            free -= need;
            heap.extend(next_step(step.rank, workers[i]));
        }

        decision(jobs, &order, &workers)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job, pairs};
    use super::*;

    fn oracle(mut job: PolicyJob, throughput: &[f64], remaining_work: f64) -> PolicyJob {
        job.throughput = Some(throughput.to_vec());
        job.remaining_work = Some(remaining_work);
        job
    }

    #[test]
    fn the_extra_gpu_goes_to_the_job_whose_remaining_time_drops_most() {
        let a = oracle(job("a", 0.0, 1, 2), &[10.0, 20.0], 1000.0);
        let b = oracle(job("b", 1.0, 1, 2), &[10.0, 12.0], 6000.0);
        let decision = Optimus.allocate(&cluster(3), &[a.clone(), b.clone()]);
        // One spare GPU: a gains 100 − 50 = 50 s from it, b gains 600 − 500 = 100 s.
        assert_eq!(pairs(&decision), [("a", 1), ("b", 2)]);
        // With less work left, b's gain (20 s) falls below a's.
        let b = oracle(job("b", 1.0, 1, 2), &[10.0, 12.0], 1200.0);
        let decision = Optimus.allocate(&cluster(3), &[a, b]);
        assert_eq!(pairs(&decision), [("a", 2), ("b", 1)]);
    }

    #[test]
    fn equal_gains_go_to_the_earlier_arrival() {
        let late = oracle(job("late", 1.0, 1, 2), &[1.0, 2.0], 10.0);
        let early = oracle(job("early", 0.0, 1, 2), &[1.0, 2.0], 10.0);
        let decision = Optimus.allocate(&cluster(3), &[late, early]);
        assert_eq!(pairs(&decision), [("early", 2), ("late", 1)]);
    }

    #[test]
    fn every_job_gets_one_worker_in_arrival_order_before_any_grows() {
        let fast = oracle(job("fast", 2.0, 1, 8), &[1.0, 100.0, 200.0], 1e6);
        let a = oracle(job("a", 0.0, 1, 8), &[1.0, 1.0], 1.0);
        let b = oracle(job("b", 1.0, 1, 8), &[1.0, 1.0], 1.0);
        let decision = Optimus.allocate(&cluster(2), &[fast.clone(), a.clone(), b.clone()]);
        assert_eq!(pairs(&decision), [("a", 1), ("b", 1), ("fast", 0)]);
        let decision = Optimus.allocate(&cluster(6), &[fast, a, b]);
        // fast grows to 3 workers, where its table ends; flat jobs never grow.
        assert_eq!(pairs(&decision), [("a", 1), ("b", 1), ("fast", 3)]);
    }

    #[test]
    fn gains_are_per_gpu() {
        // Both gain 50 s from one more worker, but b's worker costs 2 GPUs.
        let a = oracle(job("a", 1.0, 1, 2), &[10.0, 20.0], 1000.0);
        let mut b = oracle(job("b", 0.0, 1, 2), &[10.0, 20.0], 1000.0);
        b.gpus_per_worker = 2;
        let decision = Optimus.allocate(&cluster(5), &[a, b]);
        assert_eq!(pairs(&decision), [("a", 2), ("b", 1)]);
    }

    #[test]
    fn without_an_oracle_scaling_is_linear_and_work_is_one() {
        let plain = job("plain", 0.0, 1, 4);
        assert_eq!(Optimus::remaining_time(&plain, 1), 1.0);
        assert_eq!(Optimus::remaining_time(&plain, 4), 0.25);
        assert!((Optimus::gain_per_gpu(&plain, 1) - 0.5).abs() < 1e-12);
        let decision = Optimus.allocate(&cluster(8), &[plain]);
        assert_eq!(pairs(&decision), [("plain", 4)]);
    }

    #[test]
    fn done_or_broken_jobs_gain_nothing() {
        let done = oracle(job("done", 0.0, 1, 4), &[1.0, 2.0, 3.0, 4.0], 0.0);
        assert_eq!(Optimus::gain_per_gpu(&done, 1), 0.0);
        let stalled = oracle(job("stalled", 0.0, 1, 4), &[0.0, 0.0], 5.0);
        assert_eq!(Optimus::gain_per_gpu(&stalled, 1), 0.0);
        let unstuck = oracle(job("unstuck", 0.0, 1, 4), &[0.0, 1.0], 5.0);
        assert_eq!(Optimus::gain_per_gpu(&unstuck, 1), f64::INFINITY);
        let decision = Optimus.allocate(&cluster(8), &[done, stalled, unstuck]);
        assert_eq!(
            pairs(&decision),
            [("done", 1), ("stalled", 1), ("unstuck", 2)]
        );
    }
}
