//! Shadow jobs (`arch = "shadow"`, ShadowSync: Zheng et al., "ShadowSync: Performing
//! Synchronization in the Background for Highly Scalable Distributed Training", arXiv
//! 2003.03477): what the scheduler does differently for a job whose workers never wait for
//! synchronization. docs/communication.md, "Shadow jobs in the scheduler".
//!
//! # Rules
//!
//! 1. **Step time is compute only.** A shadow worker's progress lines report a local step
//!    (`sync_s` 0), so its history's step times are compute-only and its throughput model,
//!    fitted on them, has no communication term worth reading. The decision reads only its
//!    compute term ([`ThroughputModel::compute_time_s`]): `w` workers run `w·b / compute(b)`
//!    samples per second on any placement ([`samples_per_s`]), linear in the workers.
//! 2. **Contention lowers its sync frequency, not its throughput.** Its [`JobCost`](crate::contention::JobCost) is
//!    [`JobCost::background`](crate::contention::JobCost::background): the same step on one server or many, at any contention or
//!    NIC factor. Its own step times therefore say nothing about contention, and the
//!    service's contention measurement leaves them out (`schedule.rs`,
//!    `measured_contention`).
//! 3. **Its traffic still loads the NICs.** A shadow thread synchronizes back to back, so
//!    a shadow job spanning hosts keeps their links busy. It is not counted as a
//!    multi-server job in BCO's contention (that count is for jobs whose step waits on the
//!    link): its traffic reaches other jobs through the NIC factor the agents measure
//!    ([`crate::contention::host_nic_background`] leaves it in the load, as it does for
//!    parameter-server jobs and other tenants).
//! 4. **Placement: the leftovers.** [`crate::placement::place_bco`] gives a shadow job the
//!    hosts with the fewest multi-server ring jobs first (its traffic would slow their
//!    syncs), then the smallest holes (so whole hosts stay free for ring jobs that would
//!    otherwise span hosts), then the busiest NICs (which ring jobs avoid): it spans hosts
//!    and crowded links at (almost) no cost to itself and keeps ring jobs packed.
//! 5. **Statistical efficiency.** Background synchronization costs some statistical
//!    efficiency: a shadow job needs [`statistical_penalty`] times the samples of
//!    synchronous training for the same loss. While the policy has no loss curve of the
//!    job, its throughput table is in ring-equivalent samples (divided by the penalty), so
//!    a shadow job's samples count for less than a ring job's; once the policy reads its
//!    curve, fitted on the job's own samples, the curve carries its efficiency and the table
//!    stays in those samples.
//!
//! Pure, like the rest of the crate.

use converge_common::ShadowAlgorithm;

use crate::throughput::ThroughputModel;

/// S-MA's statistical-efficiency penalty: samples to reach the synchronous ring's loss,
/// relative to the ring. Measured with `trainer/bench/shadow_quality.py` (W = 4 workers,
/// optdigits softmax, a9a logistic regression and an MNIST MLP, 3 seeds, a CPU-bound and an
/// emulated-accelerator regime; geometric mean of the normalized penalty at 50 % and 100 %
/// of the run over datasets and regimes): 1.02 (per dataset 0.96–1.11).
/// docs/communication.md, "Quality: loss against samples, statistical-efficiency penalty".
pub const PENALTY_MA: f64 = 1.02;
/// S-BMUF's penalty with the trainer's defaults (η = min(1 − 1/W, 0.5), ζ = 1 − η), same
/// measurement: 1.02 (per dataset 0.87–1.14).
pub const PENALTY_BMUF: f64 = 1.02;
/// S-EASGD's penalty with the default moving rate α = 0.9/W and the trainer's centre that
/// keeps pace with the workers' mean (`c += (s − last)/n` before the elastic step), same
/// measurement: 1.02 (a repeat 1.03; per dataset 0.95–1.12). The plain elastic step, which
/// spreads W workers' steps over W + 1 copies, measured 1.20–1.26.
pub const PENALTY_EASGD: f64 = 1.02;

/// Samples a shadow job of `algorithm` needs per sample of synchronous training for the
/// same loss (the measured constants above; ≥ 1).
pub fn statistical_penalty(algorithm: ShadowAlgorithm) -> f64 {
    match algorithm {
        ShadowAlgorithm::Ma => PENALTY_MA,
        ShadowAlgorithm::Bmuf => PENALTY_BMUF,
        ShadowAlgorithm::Easgd => PENALTY_EASGD,
    }
}

/// Samples per second of a shadow job with `workers` workers of per-worker batch
/// `local_batch` on any placement: `w·b / compute(b)` from the model's compute term (rule
/// 1). 0 for no workers or a batch that is not finite and positive.
pub fn samples_per_s(model: &ThroughputModel, workers: u32, local_batch: f64) -> f64 {
    let step = model.compute_time_s(local_batch);
    let rate = f64::from(workers) * local_batch / step;
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contention::JobCost;
    use crate::throughput::{StepObservation, ThroughputPrior};

    #[test]
    fn penalties_are_the_measured_ones_and_never_below_one() {
        assert_eq!(statistical_penalty(ShadowAlgorithm::Ma), 1.02);
        assert_eq!(statistical_penalty(ShadowAlgorithm::Bmuf), 1.02);
        assert_eq!(statistical_penalty(ShadowAlgorithm::Easgd), 1.02);
        assert!(
            ShadowAlgorithm::ALL
                .iter()
                .all(|&a| statistical_penalty(a) >= 1.0)
        );
    }

    /// A shadow job's step is its compute on any placement: spanning four servers under
    /// contention 3 on a busy NIC costs it nothing, where a ring job of the same compute
    /// pays its sync.
    #[test]
    fn a_background_cost_ignores_servers_contention_and_nics() {
        let shadow = JobCost::background(0.2);
        for (servers, contention, factor) in [(1, 1, 1.0), (2, 1, 1.0), (4, 3, 0.1)] {
            assert_eq!(
                shadow.step_time_with_nic_s(servers, contention, factor),
                0.2
            );
        }
        let ring = JobCost::new(0.2, 0.01, 0.1);
        assert!(ring.step_time_with_nic_s(4, 3, 0.1) > 3.0);
    }

    /// Compute-only observations (sync 0, as shadow workers report) on one and two
    /// servers: the throughput is linear in the workers, on any number of servers.
    #[test]
    fn throughput_is_linear_in_workers_from_compute_only_steps() {
        let obs: Vec<StepObservation> = [(1, 1), (2, 1), (4, 2)]
            .into_iter()
            .map(|(workers, nodes)| StepObservation {
                workers,
                nodes,
                local_batch: 32.0,
                step_time_s: 0.1,
                sync_time_s: Some(0.0),
            })
            .collect();
        let model = ThroughputModel::fit(&obs, &ThroughputPrior::default());
        let one = samples_per_s(&model, 1, 32.0);
        assert!((one - 320.0).abs() < 1.0, "{one}");
        for w in [2, 4, 8] {
            assert!((samples_per_s(&model, w, 32.0) - f64::from(w) * one).abs() < 1e-6);
        }
        assert_eq!(samples_per_s(&model, 0, 32.0), 0.0);
        assert_eq!(samples_per_s(&model, 2, f64::NAN), 0.0);
    }
}
