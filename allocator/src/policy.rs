//! The quality policy: decides how many workers each job gets so that the predicted
//! normalized loss reduction over the next horizon is largest, after SLAQ's quality-driven
//! scheduling (Zhang, Stafman, Or, Freedman, "SLAQ: Quality-Driven Scheduling for Distributed
//! Machine Learning", SoCC'17) extended with a restart cost (design brief §5.3).
//!
//! A pure function of its inputs: no I/O, no clock, no randomness; the service and the
//! simulator call the same code.
//!
//! # Algorithm
//!
//! 1. **Admission.** Jobs are taken in order — running jobs (`current_workers > 0`) first, then
//!    pending ones, each by `submitted_at`, then id. Each gets its minimum (`min_workers`, at
//!    least 1) if that many GPUs are still free, else 0: a pending job that does not fit waits,
//!    and a running job that no longer fits (capacity shrank) is stopped.
//! 2. **Value** of `w` workers over the horizon ([`job_value`]): the job progresses at `w·r`
//!    samples/s (`r` = measured throughput per worker, or the prior) for `T` seconds, where
//!    `T = horizon_s` if `w == current_workers` and `max(0, horizon_s − restart_cost_s)`
//!    otherwise, since any change of allocation pays a restart. With a fitted curve the value
//!    is the predicted loss drop over those samples divided by the job's loss scale
//!    ([`normalized_gain`]); without one it is `new_job_gain·(1 − 0.5^w)·T/horizon_s`.
//!    `V(0) = 0`. The restart term puts a bump at `w == current_workers`: that bump is the
//!    hysteresis — an allocation changes only when the predicted gain beats the restart.
//! 3. **Max-heap hand-out** (SLAQ). The remaining GPUs go, in steps, to the admitted job with
//!    the largest marginal value per GPU. Because the bump makes `V` non-concave, each job's
//!    step looks ahead: from `w` workers it is the `k ≥ 1` (`w + k ≤ max_workers`, `k` workers'
//!    GPUs free) maximizing `(V(w+k) − V(w)) / (k·gpus_per_worker)`, smallest `k` on ties.
//!    Steps of jobs with a fitted curve come first; a job without one (fewer reports than
//!    the fit needs) gets GPUs beyond its minimum only when no fitted job can use them.
//!    Steps gaining at most `min_gain` per GPU are never taken; hand-out ends when no step
//!    is left or nothing fits. Heap entries
//!    are re-evaluated lazily: an entry whose step no longer fits the free GPUs is recomputed
//!    when popped (while it fits, it is still the job's best step, since fewer free GPUs only
//!    remove larger steps). Ties go to the earlier-submitted job, then the smaller id.
//! 4. **Keeping allocations.** A running job whose result differs from `current_workers`,
//!    although `V(result) ≤ V(current)`, gets its current allocation back if the GPUs allow:
//!    first the jobs this shrinks (freeing GPUs), then those it grows, each in admission order.
//!    So GPUs left over after the hand-out never cause a needless restart, and capacity is
//!    never exceeded.
//!
//! # Deviations from SLAQ
//!
//! - SLAQ reallocates Spark executors every few seconds at almost no cost; GPU jobs pay a
//!   restart (checkpoint, restart, rendezvous: the Pollux simulator charges 30 s), hence the
//!   horizon, the restart term in the value, the look-ahead and step 4.
//! - SLAQ normalizes a job's loss drop by the largest single drop it has shown; here the caller
//!   chooses the scale (`loss_scale`, e.g. the observed loss range).
//! - Jobs without a fitted curve are valued by the optimistic, concave `new_job_gain` shape
//!   but served after every job with a curve: SLAQ hands new jobs many resources at once,
//!   which here would resize every running job twice within seconds (once for the arrival,
//!   once when its curve appears), each resize paying a restart. A new job starts at its
//!   minimum, takes idle GPUs (work conservation), and competes on predicted gain as soon as
//!   its curve is fitted (a few seconds of reports).
//! - Admission is gang-style (a job runs with at least `min_workers` or not at all) and
//!   favours running jobs, so arrivals do not preempt running work.
//! - Throughput is assumed linear in workers (`w·r`) until a throughput model replaces it.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use converge_common::JobId;
use serde::{Deserialize, Serialize};

use crate::fit::{Curve, normalized_gain};

/// What the policy knows about one job.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyJob {
    /// Unique among the jobs passed to [`quality_allocate`].
    pub id: JobId,
    /// GPUs each worker uses (a job with 0 is never admitted).
    pub gpus_per_worker: u32,
    /// Fewest workers the job runs with (0 counts as 1).
    pub min_workers: u32,
    /// Most workers the job runs with.
    pub max_workers: u32,
    /// Workers the job runs with now; 0 when not running (pending).
    pub current_workers: u32,
    /// Arrival time, in seconds (any epoch); orders admission, ties broken by id.
    pub submitted_at: f64,
    /// Fitted loss curve; `None` while there is not enough history.
    pub curve: Option<Curve>,
    /// Progress so far, in samples processed.
    pub samples: f64,
    /// The job's loss normalization, in loss units (e.g. its observed loss range); 0 if
    /// unknown, in which case gains are relative to the predicted loss.
    pub loss_scale: f64,
    /// Measured throughput per worker, in samples per second; `None` before any measurement.
    pub samples_per_s_per_worker: Option<f64>,
    /// Workers the user asked for (FIFO and Tiresias run a job at exactly this size).
    pub requested_workers: u32,
    /// Service received so far, in GPU-seconds (Tiresias's attained service).
    pub attained_gpu_seconds: f64,
    /// Throughput with `w` workers at index `w − 1`, in progress units per second, when a
    /// model (or, in the simulator, an oracle) knows it; Optimus uses it.
    pub throughput: Option<Vec<f64>>,
    /// Work left, in the same progress units as `throughput` (Optimus's oracle).
    pub remaining_work: Option<f64>,
}

/// Settings of the quality policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyParams {
    /// How far ahead gains are predicted, in seconds.
    pub horizon_s: f64,
    /// Seconds without progress a job pays when its allocation changes.
    pub restart_cost_s: f64,
    /// Throughput per worker assumed before a job has a measurement, in samples per second.
    pub prior_samples_per_s_per_worker: f64,
    /// Normalized gain assumed for a job without a fitted curve (shaped `1 − 0.5^w`).
    pub new_job_gain: f64,
    /// Marginal normalized gain per GPU at or below which no more GPUs are handed out.
    pub min_gain: f64,
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            horizon_s: 60.0,
            restart_cost_s: 30.0,
            prior_samples_per_s_per_worker: 100.0,
            new_job_gain: 1.0,
            min_gain: 1e-6,
        }
    }
}

/// The policy's decision: workers per job; every job appears, 0 = not admitted or pending.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Decision {
    pub workers: BTreeMap<JobId, u32>,
}

/// Predicted normalized gain of running `job` with `workers` workers over the horizon,
/// including the restart cost when `workers != job.current_workers` (see the module
/// documentation, step 2). Finite and non-negative; 0 for 0 workers.
pub fn job_value(job: &PolicyJob, workers: u32, params: &PolicyParams) -> f64 {
    if workers == 0 {
        return 0.0;
    }
    let horizon_s = params.horizon_s.max(0.0);
    let productive_s = if workers == job.current_workers {
        horizon_s
    } else {
        (horizon_s - params.restart_cost_s.max(0.0)).max(0.0)
    };
    let value = match &job.curve {
        Some(curve) => {
            let rate = job
                .samples_per_s_per_worker
                .filter(|r| r.is_finite() && *r > 0.0)
                .unwrap_or(params.prior_samples_per_s_per_worker.max(0.0));
            let end = job.samples + f64::from(workers) * rate * productive_s;
            normalized_gain(curve, job.samples, end, job.loss_scale)
        }
        None => {
            let productive_fraction = if horizon_s > 0.0 {
                productive_s / horizon_s
            } else {
                0.0
            };
            let shape = 1.0 - 0.5f64.powf(f64::from(workers));
            params.new_job_gain.max(0.0) * shape * productive_fraction
        }
    };
    if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, f64::MAX)
    }
}

/// Decides how many workers each job gets on a cluster of `total_gpus` GPUs (see the module
/// documentation). The result does not depend on the order of `jobs`; if an id appears more
/// than once, only its first occurrence in admission order is considered.
pub fn quality_allocate(total_gpus: u32, jobs: &[PolicyJob], params: &PolicyParams) -> Decision {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| admission_order(&jobs[a], &jobs[b]));
    let mut seen = BTreeSet::new();
    order.retain(|&i| seen.insert(&jobs[i].id));

    let mut workers = vec![0u32; jobs.len()];
    let mut free_gpus = u64::from(total_gpus);

    // 1. Admission.
    for &i in &order {
        if let Some(min) = minimum_workers(&jobs[i]) {
            let need = gpus(&jobs[i], min);
            if need <= free_gpus {
                workers[i] = min;
                free_gpus -= need;
            }
        }
    }

    // 3. Max-heap hand-out of the values of step 2 (`job_value`), re-evaluating lazily the
    //    steps that no longer fit.
    let threshold = params.min_gain.max(0.0);
    let mut heap: BinaryHeap<Step<'_>> = order
        .iter()
        .filter(|&&i| workers[i] > 0)
        .filter_map(|&i| best_step(jobs, i, workers[i], free_gpus, params, threshold))
        .collect();
    while let Some(step) = heap.pop() {
        let job = &jobs[step.job];
        let need = gpus(job, step.workers_added);
        if need > free_gpus {
            heap.extend(best_step(
                jobs,
                step.job,
                workers[step.job],
                free_gpus,
                params,
                threshold,
            ));
            continue;
        }
        workers[step.job] += step.workers_added;
        free_gpus -= need;
        heap.extend(best_step(
            jobs,
            step.job,
            workers[step.job],
            free_gpus,
            params,
            threshold,
        ));
    }

    // 4. Give running jobs their current allocation back where changing it gains nothing.
    let mut keep: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| {
            let job = &jobs[i];
            let current = job.current_workers;
            current > 0
                && workers[i] != current
                && minimum_workers(job)
                    .is_some_and(|min| (min..=job.max_workers).contains(&current))
                && job_value(job, workers[i], params) <= job_value(job, current, params)
        })
        .collect();
    // Returns that free GPUs (current below the result) first, then those that need GPUs;
    // the sort is stable, so each group stays in admission order.
    keep.sort_by_key(|&i| jobs[i].current_workers > workers[i]);
    for i in keep {
        let job = &jobs[i];
        let available = free_gpus + gpus(job, workers[i]);
        let need = gpus(job, job.current_workers);
        if need <= available {
            workers[i] = job.current_workers;
            free_gpus = available - need;
        }
    }

    Decision {
        workers: order
            .iter()
            .map(|&i| (jobs[i].id.clone(), workers[i]))
            .collect(),
    }
}

/// Running jobs first, then by arrival, then by id.
fn admission_order(a: &PolicyJob, b: &PolicyJob) -> Ordering {
    (a.current_workers == 0)
        .cmp(&(b.current_workers == 0))
        .then(a.submitted_at.total_cmp(&b.submitted_at))
        .then_with(|| a.id.cmp(&b.id))
}

/// Workers the job is admitted with, or `None` if it can never run (no GPUs per worker, or
/// a maximum below its minimum).
fn minimum_workers(job: &PolicyJob) -> Option<u32> {
    let min = job.min_workers.max(1);
    (job.gpus_per_worker > 0 && min <= job.max_workers).then_some(min)
}

/// GPUs used by `workers` workers of `job`.
fn gpus(job: &PolicyJob, workers: u32) -> u64 {
    u64::from(workers) * u64::from(job.gpus_per_worker)
}

/// A candidate hand-out: give job `job` (index into the jobs) `workers_added` more workers.
#[derive(Debug)]
struct Step<'a> {
    /// Whether the job has a fitted curve: such steps come before any step of a job that
    /// has none, whatever the gains.
    fitted: bool,
    gain_per_gpu: f64,
    workers_added: u32,
    job: usize,
    submitted_at: f64,
    id: &'a JobId,
}

impl Ord for Step<'_> {
    /// Jobs with a fitted curve first, then larger gain per GPU, then earlier arrival, then
    /// smaller id.
    fn cmp(&self, other: &Self) -> Ordering {
        self.fitted
            .cmp(&other.fitted)
            .then(self.gain_per_gpu.total_cmp(&other.gain_per_gpu))
            .then(other.submitted_at.total_cmp(&self.submitted_at))
            .then_with(|| other.id.cmp(self.id))
    }
}

impl PartialOrd for Step<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Step<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Step<'_> {}

/// The job's best look-ahead step from `current` workers with `free_gpus` GPUs free, or
/// `None` if no step fits or none gains more than `threshold` per GPU.
fn best_step<'a>(
    jobs: &'a [PolicyJob],
    index: usize,
    current: u32,
    free_gpus: u64,
    params: &PolicyParams,
    threshold: f64,
) -> Option<Step<'a>> {
    let job = &jobs[index];
    let by_gpus = free_gpus / u64::from(job.gpus_per_worker.max(1));
    let by_max = u64::from(job.max_workers.saturating_sub(current));
    let most = by_gpus.min(by_max) as u32;
    let base = job_value(job, current, params);
    let mut best: Option<(f64, u32)> = None;
    for added in 1..=most {
        let gain = job_value(job, current + added, params) - base;
        let per_gpu = gain / gpus(job, added) as f64;
        if best.is_none_or(|(b, _)| per_gpu > b) {
            best = Some((per_gpu, added));
        }
    }
    best.filter(|&(per_gpu, _)| per_gpu > threshold)
        .map(|(gain_per_gpu, workers_added)| Step {
            fitted: job.curve.is_some(),
            gain_per_gpu,
            workers_added,
            job: index,
            submitted_at: job.submitted_at,
            id: &job.id,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::CurveFamily;
    use proptest::prelude::*;

    fn id(name: &str) -> JobId {
        JobId::new(name).unwrap()
    }

    /// A pending job without history: 1 GPU per worker, 1 to `max_workers` workers.
    fn job(name: &str, max_workers: u32) -> PolicyJob {
        PolicyJob {
            id: id(name),
            gpus_per_worker: 1,
            min_workers: 1,
            max_workers,
            current_workers: 0,
            submitted_at: 0.0,
            curve: None,
            samples: 0.0,
            loss_scale: 0.0,
            samples_per_s_per_worker: None,
            requested_workers: max_workers,
            attained_gpu_seconds: 0.0,
            throughput: None,
            remaining_work: None,
        }
    }

    /// `0.33 + 0.36/(1 + k/2000)` in the inv_linear form: far from converged at `k = 0`.
    fn steep_curve() -> Curve {
        Curve {
            family: CurveFamily::InvLinear,
            params: vec![1.0 / (0.36 * 2000.0), 1.0 / 0.36, 0.33],
            rmse: 0.0,
            points: 100,
        }
    }

    /// A constant loss of 0.33: converged.
    fn flat_curve() -> Curve {
        Curve {
            family: CurveFamily::InvLinear,
            params: vec![0.0, 1e6, 0.33],
            rmse: 0.0,
            points: 100,
        }
    }

    fn with_curve(mut job: PolicyJob, curve: Curve) -> PolicyJob {
        job.curve = Some(curve);
        job.loss_scale = 0.36;
        job.samples_per_s_per_worker = Some(100.0);
        job
    }

    fn running(mut job: PolicyJob, workers: u32) -> PolicyJob {
        job.current_workers = workers;
        job
    }

    fn workers_of(decision: &Decision, name: &str) -> u32 {
        decision.workers[&id(name)]
    }

    /// Runs the policy `rounds` times, each round starting from the previous decision.
    fn settle(
        total_gpus: u32,
        jobs: &[PolicyJob],
        params: &PolicyParams,
        rounds: usize,
    ) -> Vec<Decision> {
        let mut jobs = jobs.to_vec();
        let mut decisions = Vec::new();
        for _ in 0..rounds {
            let decision = quality_allocate(total_gpus, &jobs, params);
            for job in &mut jobs {
                job.current_workers = decision.workers[&job.id];
            }
            decisions.push(decision);
        }
        decisions
    }

    #[test]
    fn value_is_zero_without_workers_and_pays_the_restart() {
        let params = PolicyParams::default();
        for j in [job("new", 8), with_curve(job("fitted", 8), steep_curve())] {
            assert_eq!(job_value(&j, 0, &params), 0.0);
            let moving = job_value(&j, 2, &params);
            let staying = job_value(&running(j.clone(), 2), 2, &params);
            assert!(moving > 0.0 && staying > moving, "{moving} {staying}");
        }
        // Without a curve the restart costs the fraction restart/horizon of the gain.
        let new = job("new", 8);
        assert!((job_value(&new, 1, &params) - 0.5 * 0.5).abs() < 1e-12);
        // With a curve the value is the normalized predicted drop over w·r·T samples.
        let fitted = running(with_curve(job("fitted", 8), steep_curve()), 2);
        let curve = steep_curve();
        let expected = (curve.predict(0.0) - curve.predict(2.0 * 100.0 * 60.0)) / 0.36;
        assert!((job_value(&fitted, 2, &params) - expected).abs() < 1e-12);
        // A restart as long as the horizon leaves nothing to gain by changing.
        let costly = PolicyParams {
            restart_cost_s: 60.0,
            ..params
        };
        assert_eq!(job_value(&fitted, 3, &costly), 0.0);
    }

    #[test]
    fn new_jobs_get_gpus_before_converged_ones() {
        let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
        let new = job("new", 8);
        let decision = quality_allocate(8, &[converged, new], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "converged"), 1);
        assert_eq!(workers_of(&decision, "new"), 7);
    }

    #[test]
    fn jobs_without_a_curve_get_only_what_fitted_jobs_leave() {
        let steep = running(with_curve(job("steep", 6), steep_curve()), 4);
        let new = job("new", 8);
        let free_restarts = PolicyParams {
            restart_cost_s: 0.0,
            ..PolicyParams::default()
        };
        let decision = quality_allocate(8, &[steep.clone(), new.clone()], &free_restarts);
        assert_eq!(workers_of(&decision, "new"), 2, "{decision:?}");
        assert_eq!(workers_of(&decision, "steep"), 6);
        // Alone, the new job takes every idle GPU (work conservation).
        let decision = quality_allocate(8, &[new], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "new"), 8);
    }

    #[test]
    fn converged_job_keeps_its_gpus_when_nobody_needs_them() {
        let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
        let decision = quality_allocate(8, &[converged], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "converged"), 4);
    }

    #[test]
    fn growth_must_beat_the_restart_cost() {
        // From 2 to 3 workers: 3·30 s of work instead of 2·60 s, so it is not worth it.
        let steady = running(with_curve(job("steady", 3), steep_curve()), 2);
        let params = PolicyParams::default();
        assert_eq!(
            workers_of(
                &quality_allocate(8, std::slice::from_ref(&steady), &params),
                "steady"
            ),
            2
        );
        // Without a restart cost the extra worker is taken.
        let free_restarts = PolicyParams {
            restart_cost_s: 0.0,
            ..params
        };
        assert_eq!(
            workers_of(
                &quality_allocate(8, std::slice::from_ref(&steady), &free_restarts),
                "steady"
            ),
            3
        );
        // A big jump does beat the restart: 8 workers for 30 s beat 2 for 60 s.
        let mut wide = steady;
        wide.max_workers = 8;
        assert_eq!(
            workers_of(&quality_allocate(8, &[wide], &params), "steady"),
            8
        );
    }

    #[test]
    fn running_jobs_are_admitted_first() {
        let mut old = running(job("old", 4), 4);
        old.min_workers = 4;
        old.submitted_at = 10.0;
        let early_pending = job("early", 4);
        let decision = quality_allocate(
            4,
            &[early_pending.clone(), old.clone()],
            &PolicyParams::default(),
        );
        assert_eq!(workers_of(&decision, "old"), 4);
        assert_eq!(workers_of(&decision, "early"), 0);
        // Capacity shrank below the running job's minimum: it is stopped, the other fits.
        let decision = quality_allocate(3, &[early_pending, old], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "old"), 0);
        assert_eq!(workers_of(&decision, "early"), 3);
    }

    #[test]
    fn jobs_that_can_never_run_get_nothing() {
        let mut no_gpus = job("no-gpus", 4);
        no_gpus.gpus_per_worker = 0;
        let mut inverted = job("inverted", 2);
        inverted.min_workers = 3;
        let decision = quality_allocate(16, &[no_gpus, inverted], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "no-gpus"), 0);
        assert_eq!(workers_of(&decision, "inverted"), 0);
    }

    #[test]
    fn gpus_go_in_whole_workers() {
        let mut wide = job("wide", 8);
        wide.gpus_per_worker = 3;
        let decision = quality_allocate(10, &[wide], &PolicyParams::default());
        assert_eq!(workers_of(&decision, "wide"), 3);
    }

    #[test]
    fn decisions_do_not_flap() {
        let mut pending_wide = with_curve(job("wide", 4), steep_curve());
        pending_wide.gpus_per_worker = 2;
        pending_wide.submitted_at = 3.0;
        let mut late_new = job("late-new", 4);
        late_new.submitted_at = 4.0;
        let jobs = [
            running(with_curve(job("steep", 8), steep_curve()), 2),
            running(with_curve(job("converged", 4), flat_curve()), 4),
            pending_wide,
            late_new,
        ];
        for total_gpus in [4, 8, 12, 16, 24] {
            let decisions = settle(total_gpus, &jobs, &PolicyParams::default(), 4);
            assert_eq!(decisions[1], decisions[0], "{total_gpus} GPUs");
            assert_eq!(decisions[3], decisions[0], "{total_gpus} GPUs");
        }
    }

    fn arbitrary_curve() -> impl Strategy<Value = Option<Curve>> {
        let curve = |family, params: Vec<f64>| {
            Some(Curve {
                family,
                params,
                rmse: 0.0,
                points: 10,
            })
        };
        prop_oneof![
            Just(None),
            (0.0..1e-2f64, 0.1..10.0f64, 0.0..1.0f64)
                .prop_map(move |(a, b, c)| curve(CurveFamily::InvLinear, vec![a, b, c])),
            (0.0..1e-6f64, 0.0..1e-2f64, 0.1..10.0f64, 0.0..1.0f64)
                .prop_map(move |(a, b, c, d)| curve(CurveFamily::InvQuadratic, vec![a, b, c, d])),
            (0.0..1e-3f64, 0.0..1.0f64, 0.0..5.0f64)
                .prop_map(move |(a, b, amplitude)| curve(CurveFamily::Exp, vec![a, b, amplitude])),
        ]
    }

    /// A job as the property tests see it; `current_workers` is made feasible by [`cluster`].
    fn arbitrary_job(index: usize) -> impl Strategy<Value = PolicyJob> {
        (
            (1u32..=4, 0u32..=4, 0u32..=8, 0u32..=8),
            0u32..6,
            arbitrary_curve(),
            (0.0..1e5f64, prop_oneof![Just(0.0), 0.01..2.0f64]),
            prop::option::of(0.0..500.0f64),
        )
            .prop_map(
                move |(
                    (gpus_per_worker, min, extra, current),
                    submitted,
                    curve,
                    (samples, loss_scale),
                    rate,
                )| {
                    PolicyJob {
                        id: JobId::new(format!("job-{index}")).unwrap(),
                        gpus_per_worker,
                        min_workers: min,
                        // Now and then a maximum below the minimum (an invalid job).
                        max_workers: if extra == 0 {
                            min.saturating_sub(1)
                        } else {
                            min + extra
                        },
                        current_workers: current,
                        submitted_at: f64::from(submitted),
                        curve,
                        samples,
                        loss_scale,
                        samples_per_s_per_worker: rate,
                        requested_workers: min + extra,
                        attained_gpu_seconds: 0.0,
                        throughput: None,
                        remaining_work: None,
                    }
                },
            )
    }

    /// Makes the jobs' current allocations valid and jointly within `total_gpus`.
    fn make_current_feasible(total_gpus: u32, jobs: &mut [PolicyJob]) {
        let mut free = u64::from(total_gpus);
        for job in jobs {
            let need = gpus(job, job.current_workers);
            let valid = minimum_workers(job)
                .is_some_and(|min| (min..=job.max_workers).contains(&job.current_workers));
            if valid && need <= free {
                free -= need;
            } else {
                job.current_workers = 0;
            }
        }
    }

    /// A cluster of 0..64 GPUs with 0..20 jobs whose current allocations fit.
    fn cluster() -> impl Strategy<Value = (u32, Vec<PolicyJob>)> {
        (0u32..64, 0usize..20).prop_flat_map(|(total_gpus, count)| {
            let jobs: Vec<_> = (0..count).map(arbitrary_job).collect();
            jobs.prop_map(move |mut jobs| {
                make_current_feasible(total_gpus, &mut jobs);
                (total_gpus, jobs)
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn decisions_respect_capacity_and_bounds(
            (total_gpus, jobs) in cluster(),
            restart_cost_s in prop_oneof![Just(30.0), 0.0..120.0f64],
        ) {
            let params = PolicyParams { restart_cost_s, ..PolicyParams::default() };
            let decision = quality_allocate(total_gpus, &jobs, &params);
            prop_assert_eq!(decision.workers.len(), jobs.len());
            let mut used = 0u64;
            for job in &jobs {
                let workers = decision.workers[&job.id];
                used += gpus(job, workers);
                prop_assert!(
                    workers == 0 || (job.min_workers.max(1) <= workers && workers <= job.max_workers),
                    "{} got {} workers", job.id, workers
                );
            }
            prop_assert!(used <= u64::from(total_gpus));
        }

        #[test]
        fn decisions_are_deterministic_and_ignore_input_order(
            (total_gpus, jobs, shuffled) in cluster().prop_flat_map(|(total_gpus, jobs)| {
                (Just(total_gpus), Just(jobs.clone()), Just(jobs).prop_shuffle())
            })
        ) {
            let params = PolicyParams::default();
            let decision = quality_allocate(total_gpus, &jobs, &params);
            prop_assert_eq!(&decision, &quality_allocate(total_gpus, &jobs, &params));
            prop_assert_eq!(&decision, &quality_allocate(total_gpus, &shuffled, &params));
        }

        #[test]
        fn applying_a_decision_and_deciding_again_changes_nothing(
            (total_gpus, jobs) in cluster(),
            restart_cost_s in 0.0..100.0f64,
        ) {
            let params = PolicyParams { restart_cost_s, ..PolicyParams::default() };
            let decisions = settle(total_gpus, &jobs, &params, 3);
            prop_assert_eq!(&decisions[1], &decisions[0]);
            prop_assert_eq!(&decisions[2], &decisions[0]);
        }

        #[test]
        fn a_restart_as_long_as_the_horizon_changes_nothing(
            (total_gpus, mut jobs) in cluster(),
            restart_cost_s in 60.0..1000.0f64,
        ) {
            jobs.retain(|j| j.current_workers > 0);
            let params = PolicyParams { restart_cost_s, ..PolicyParams::default() };
            let decision = quality_allocate(total_gpus, &jobs, &params);
            for job in &jobs {
                prop_assert_eq!(decision.workers[&job.id], job.current_workers, "{}", job.id);
            }
        }

        #[test]
        fn a_lone_steep_job_gets_its_maximum(
            gpus_per_worker in 1u32..=4,
            min_workers in 1u32..=4,
            extra in 0u32..=12,
            current in prop::option::of(0u32..=16),
            spare_gpus in 0u32..8,
            samples in 0.0..2000.0f64,
        ) {
            let max_workers = min_workers + extra;
            let mut steep = with_curve(job("steep", max_workers), steep_curve());
            steep.gpus_per_worker = gpus_per_worker;
            steep.min_workers = min_workers;
            steep.samples = samples;
            // A pending job, or a running one whose growth costs no restart (with a restart,
            // growing by little can rightly lose to staying: see growth_must_beat_the_restart_cost).
            steep.current_workers = current.map_or(0, |c| c.clamp(min_workers, max_workers));
            let restart_cost_s = if current.is_some() { 0.0 } else { 30.0 };
            let params = PolicyParams { restart_cost_s, ..PolicyParams::default() };
            let total_gpus = max_workers * gpus_per_worker + spare_gpus;
            let decision = quality_allocate(total_gpus, &[steep], &params);
            prop_assert_eq!(workers_of(&decision, "steep"), max_workers);
        }

        #[test]
        fn a_converged_job_stays_at_its_minimum_while_a_steep_one_wants_gpus(
            (flat_min, flat_extra, flat_current) in (1u32..=3, 0u32..=4, 0u32..=7),
            (steep_max, gpus_per_worker) in (1u32..=16, 1u32..=2),
            flat_first in any::<bool>(),
        ) {
            let mut flat = with_curve(job("flat", flat_min + flat_extra), flat_curve());
            flat.min_workers = flat_min;
            flat.current_workers = if flat_current == 0 { 0 } else { flat_current.clamp(flat_min, flat.max_workers) };
            flat.submitted_at = if flat_first { 0.0 } else { 1.0 };
            let mut steep = with_curve(job("steep", steep_max), steep_curve());
            steep.gpus_per_worker = gpus_per_worker;
            steep.submitted_at = if flat_first { 1.0 } else { 0.0 };
            // The steep job alone could use every GPU the flat one does not need at minimum.
            let total_gpus = flat_min + steep_max * gpus_per_worker;
            let decision = quality_allocate(total_gpus, &[flat, steep], &PolicyParams::default());
            prop_assert!(workers_of(&decision, "flat") <= flat_min, "{:?}", decision);
            prop_assert_eq!(workers_of(&decision, "steep"), steep_max);
        }
    }
}
