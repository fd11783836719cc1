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
//! 1. **Admission.** Jobs are taken in order — pending jobs that have never run and have
//!    waited `max_wait_s` since submission (the starvation guard; a preempted job does not
//!    count, or on an overloaded cluster every pending job would preempt another every
//!    decision), then running jobs (`current_workers > 0`), then
//!    other pending ones, each by `submitted_at`, then id. Under `loss` (SLAQ's objective),
//!    after the starvation guard, jobs are taken by the value per GPU of their minimum over
//!    the horizon instead (a running job's as if kept, a pending job's after its restart;
//!    step 2), so an arrival, valued at `new_job_gain` until its curve is fitted, displaces
//!    a running job whose curve has flattened: SLAQ's exploratory setting, where most
//!    of a job's loss reduction comes early. Running jobs without a fitted curve yet keep
//!    their place ahead of that ranking, and running jobs come first on equal value. Each gets its minimum (`min_workers`, at
//!    least 1) if that many GPUs are still free, else 0: a pending job that does not fit waits,
//!    and a running job that no longer fits (capacity shrank) is stopped.
//! 2. **Value** of `w` workers over the horizon ([`job_value`]): the job progresses at
//!    `X(w)` samples/s ([`throughput`]: the job's throughput table — in the service and the
//!    simulator, from its fitted [`crate::throughput::ThroughputModel`], in goodput when its
//!    batch size adapts — else `w·r` with `r` the measured throughput per worker, else the
//!    prior). Keeping `w == current_workers` is productive for the whole horizon; any change
//!    pays a restart and is productive for only a share `f` of it ([`JobTerms`]): under
//!    `loss`, `f = max(0, horizon_s − δ)/horizon_s`; under `jct` and `both`, the *restart
//!    budget* `f = max(age − restarts·δ/ρ, 0) / (age + δ/ρ)` (Pollux's restart penalty with
//!    each restart charged `1/ρ` times, `ρ = restart_budget`, default 0.1: a job spends at
//!    most about a tenth of its age restarting), where `δ` is the job's own measured restart
//!    cost ([`PolicyJob::restart_cost_s`]) or else `restart_cost_s`, and `age` the time
//!    since submission. What the progress is worth depends on the [`Objective`]:
//!    - `loss` (SLAQ): the predicted loss drop over those `X(w)·f·T` samples divided by the
//!      job's loss scale ([`normalized_gain`]); without a fitted curve,
//!      `new_job_gain·(1 − 0.5^w)·f`;
//!    - `jct` (completion-time-aware, after heSRPT: Berg, Vesilo, Harchol-Balter, "heSRPT:
//!      Parallel Scheduling to Minimize Mean Slowdown", SIGMETRICS 2020 / Performance
//!      2020): `weight·X(w)/X(1)·f`, the job's speedup times a weight from its rank by
//!      remaining time at one worker ([`remaining_work`]` / X(1)`) among the decision's `m`
//!      jobs ([`job_terms`]). heSRPT's optimum for speedups `k^p` gives the job of rank
//!      `k` (1 = longest) the share `θ_k = (k/m)^c − ((k−1)/m)^c`, `c = 1/(1−p)`; the weight
//!      `(m·θ_k)^(1/c)` makes maximizing `Σ weight·speedup` reproduce it (1 for an equal
//!      share). Shorter jobs get more, but every job gets some: unlike a rate `X/R`, a long
//!      job is not starved by many short ones. `p = speedup_exponent` (default 0.8);
//!    - `both` (the default): the sum of the two.
//!
//!    `V(0) = 0`. The restart share puts a bump at `w == current_workers`: that bump is the
//!    hysteresis — an allocation changes only when the predicted gain beats the restart.
//! 3. **Max-heap hand-out** (SLAQ). The remaining GPUs go, in steps, to the admitted job with
//!    the largest marginal value per GPU. Because the bump makes `V` non-concave, each job's
//!    step looks ahead: from `w` workers it is the `k ≥ 1` (`w + k ≤ max_workers`, `k` workers'
//!    GPUs free) maximizing `(V(w+k) − V(w)) / (k·gpus_per_worker)`, smallest `k` on ties.
//!    Under the `loss` objective, steps of jobs with a fitted curve come first; a job without
//!    one (fewer reports than the fit needs) gets GPUs beyond its minimum only when no fitted
//!    job can use them. Under `jct` and `both` every job competes on its value.
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
//! 5. **GPU types** (a cluster of several, [`Policy::allocate_on_types`]): steps 1–4 size
//!    the jobs as on one type; each sized job then gets one type by comparative advantage
//!    ([`super::assign_gpu_types`]): its value on type `t` is `g · ln(s_t · k_t)`, `g` its
//!    GPUs, `s_t` its speed there relative to the type its throughput model describes
//!    (measured or projected, [`crate::gpu_types`]; an unknown type counts as its slowest
//!    known) and `k_t` 1 for staying where it runs at the same size, else its restart share
//!    `f` (step 2). Maximizing the sum over GPUs of the log speed-up puts a type's GPUs on
//!    the jobs that gain most per GPU there relative to elsewhere (BERT on A100s, CIFAR-10
//!    on T4s), not on whichever job comes first. Then steps 1–4 run again once per type,
//!    on that type's GPUs, over the jobs it got, with their throughput scaled to it (a move
//!    counts as a restart), and the jobs still without a type compete for what is left
//!    (types with the most GPUs left first). A job moved to a faster type is sized at that
//!    speed, and the GPUs this saves go to waiting jobs. The assignment and the sizing per
//!    type then run once more, from the new sizes. On the Sia traces (64 GPUs of three
//!    types) the mean JCT went from 2,904 / 3,285 / 4,160 s (sizes of steps 1–4 kept) to
//!    2,882 / 3,183 / 4,071 s with one sizing per type and 2,813 / 3,117 / 4,012 s with two
//!    (Philly / Helios / newTrace; a third gained nothing; docs/heterogeneous.md). Each
//!    round costs about as much as steps 1–4 again (docs/scheduling.md).
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
//! - SLAQ's objective alone does not care when jobs finish: a long job's normalized gain
//!   over a short horizon is tiny, so arrivals shrink it and departures regrow it, and mean
//!   JCT suffers (docs/benchmarks.md). The `both` objective adds the completion term, and
//!   with it the restart budget in place of the horizon's restart share: over a 60 s
//!   horizon a 30 s restart halves any change, so a job alone in the tail of a workload
//!   never grows into the idle cluster.
//! - Throughput comes from a per-job model fitted on observed step times (design brief
//!   §5.2), not linear scaling.

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap};

use serde::{Deserialize, Serialize};

use converge_common::JobId;

use super::{ClusterView, Decision, Policy, PolicyInputs, PolicyJob, gpus, minimum_workers};
use crate::fit::normalized_gain;

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
    /// What a job's allocation is worth (see [`Objective`]).
    pub objective: Objective,
    /// Starvation guard: a pending job that has never run and has waited this long (seconds
    /// since submission) is admitted before running jobs, which may stop one to make room.
    pub max_wait_s: f64,
    /// Restart budget `ρ` of the completion-aware objectives (`jct`, `both`): the share of
    /// its age a job may spend restarting. A change of allocation is worth
    /// `max(age − restarts·δ/ρ, 0) / (age + δ/ρ)` of its value (`δ` the job's restart cost),
    /// Pollux's restart penalty with every restart counted `1/ρ` times.
    pub restart_budget: f64,
    /// Speedup exponent `p` (`speedup(k) ≈ k^p`) behind the completion weights of the
    /// `jct` and `both` objectives (heSRPT, module docs); in `(0, 1)`.
    pub speedup_exponent: f64,
}

/// What the quality policy maximizes over the horizon, summed over jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// SLAQ's: the predicted loss reduction, normalized per job by its loss scale
    /// (cluster-wide loss reduction).
    Loss,
    /// Completion-time-aware: each job's speedup weighted by its heSRPT rank by remaining
    /// time (module docs, step 2), so that jobs closer to completion get more GPUs without
    /// starving long ones. A job whose remaining work is unknown is assumed to have as much
    /// left as it has done (at least one horizon at its current rate), the
    /// least-attained-service guess.
    Jct,
    /// The sum of both values above: the loss objective's normalized loss reduction plus the
    /// completion objective's weighted speedup (both dimensionless, per horizon). The
    /// default: in the simulator it has the lowest mean JCT of the three
    /// (docs/scheduling.md).
    #[default]
    Both,
}

impl Objective {
    /// The objective's name as the command line spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Loss => "loss",
            Objective::Jct => "jct",
            Objective::Both => "both",
        }
    }
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            horizon_s: 60.0,
            restart_cost_s: 30.0,
            prior_samples_per_s_per_worker: 100.0,
            new_job_gain: 1.0,
            min_gain: 1e-6,
            objective: Objective::default(),
            max_wait_s: 1800.0,
            restart_budget: 0.1,
            speedup_exponent: 0.8,
        }
    }
}

/// What a job's value depends on beyond the job itself (computed once per decision by
/// [`job_terms`]): its completion weight among the decision's jobs and what a change of its
/// allocation leaves of the horizon.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobTerms {
    /// heSRPT weight of the job's rank by remaining time (module docs, step 2): 1 for an
    /// equal share, more for jobs closer to completion. Dimensionless; unused by the `loss`
    /// objective.
    pub completion_weight: f64,
    /// Share of the horizon a changed allocation is productive, in `[0, 1]`: under `loss`,
    /// `max(0, horizon − δ)/horizon`; under `jct` and `both`, the restart budget's
    /// `max(age − restarts·δ/ρ, 0)/(age + δ/ρ)` (`δ` the job's restart cost).
    pub change_factor: f64,
}

/// The job's restart cost in seconds: its own measurement when the caller has one, else the
/// policy's `restart_cost_s`. Finite and ≥ 0.
pub fn restart_cost(job: &PolicyJob, params: &PolicyParams) -> f64 {
    job.restart_cost_s
        .filter(|c| c.is_finite() && *c >= 0.0)
        .unwrap_or(params.restart_cost_s)
        .max(0.0)
}

/// Every job's [`JobTerms`] at time `now` (same clock as `submitted_at`), in the order of
/// `jobs`. Completion weights rank the jobs by remaining time at one worker,
/// `t = remaining_work / throughput(1)`, longest first (`k = 1..m`; jobs with equal `t`
/// share their ranks' mean weight); with
/// `c = 1/(1 − p)` (`p` = `speedup_exponent`), job `k` gets `θ_k = (k/m)^c − ((k−1)/m)^c`
/// of the cluster in heSRPT's optimum, and its weight is `(m·θ_k)^(1/c)`, the weight under
/// which maximizing `Σ weight·speedup` yields that optimum for `speedup(x) = x^p`.
pub fn job_terms(jobs: &[&PolicyJob], now: f64, params: &PolicyParams) -> Vec<JobTerms> {
    let p = if params.speedup_exponent.is_finite() {
        params.speedup_exponent.clamp(0.01, 0.99)
    } else {
        0.8
    };
    let c = 1.0 / (1.0 - p);
    let mut by_time: Vec<(f64, usize)> = jobs
        .iter()
        .enumerate()
        .map(|(i, job)| {
            let one = throughput(job, 1, params).max(f64::MIN_POSITIVE);
            (remaining_work(job, params) / one, i)
        })
        .collect();
    by_time.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then_with(|| jobs[a.1].id.cmp(&jobs[b.1].id))
    });
    let m = by_time.len().max(1) as f64;
    let mut weights = vec![1.0; jobs.len()];
    let weight_of = |rank: usize| {
        let k = (rank + 1) as f64;
        let theta = (k / m).powf(c) - ((k - 1.0) / m).powf(c);
        (m * theta.max(0.0)).powf(1.0 / c)
    };
    // Jobs with equal remaining times share their ranks' mean weight: ties carry no order.
    let mut start = 0;
    while start < by_time.len() {
        let mut end = start + 1;
        while end < by_time.len() && by_time[end].0 == by_time[start].0 {
            end += 1;
        }
        let mean = (start..end).map(weight_of).sum::<f64>() / (end - start) as f64;
        for &(_, i) in &by_time[start..end] {
            weights[i] = mean;
        }
        start = end;
    }
    let horizon_s = params.horizon_s.max(0.0);
    jobs.iter()
        .zip(weights)
        .map(|(job, completion_weight)| {
            let delta = restart_cost(job, params);
            let change_factor = match params.objective {
                Objective::Loss if horizon_s > 0.0 => (horizon_s - delta).max(0.0) / horizon_s,
                Objective::Loss => 0.0,
                Objective::Jct | Objective::Both => {
                    let rho = if params.restart_budget.is_finite() {
                        params.restart_budget.max(1e-9)
                    } else {
                        1.0
                    };
                    let charged = delta / rho;
                    let age = (now - job.submitted_at).max(0.0);
                    if age + charged > 0.0 {
                        ((age - f64::from(job.restarts) * charged).max(0.0) / (age + charged))
                            .min(1.0)
                    } else {
                        1.0
                    }
                }
            };
            JobTerms {
                completion_weight,
                change_factor,
            }
        })
        .collect()
}

/// Predicted value of running `job` with `workers` workers over the horizon (module docs,
/// step 2), `terms` from [`job_terms`]: a changed allocation (`workers != current_workers`)
/// is productive for `change_factor` of the horizon. Dimensionless, finite and non-negative;
/// 0 for 0 workers.
pub fn job_value(job: &PolicyJob, workers: u32, params: &PolicyParams, terms: &JobTerms) -> f64 {
    let productive_fraction = if workers == job.current_workers {
        1.0
    } else {
        terms.change_factor.clamp(0.0, 1.0)
    };
    value_with(job, workers, params, terms, productive_fraction)
}

/// [`job_value`] with the productive share of the horizon given.
fn value_with(
    job: &PolicyJob,
    workers: u32,
    params: &PolicyParams,
    terms: &JobTerms,
    productive_fraction: f64,
) -> f64 {
    if workers == 0 {
        return 0.0;
    }
    let horizon_s = params.horizon_s.max(0.0);
    let productive_s = horizon_s * productive_fraction;
    let completion = || {
        let one = throughput(job, 1, params);
        let speedup = if one > 0.0 {
            throughput(job, workers, params) / one
        } else {
            0.0
        };
        terms.completion_weight * speedup * productive_fraction
    };
    let loss = || match &job.curve {
        Some(curve) => {
            let end = job.samples + throughput(job, workers, params) * productive_s;
            normalized_gain(curve, job.samples, end, job.loss_scale)
        }
        None => {
            let shape = 1.0 - 0.5f64.powf(f64::from(workers));
            params.new_job_gain.max(0.0) * shape * productive_fraction
        }
    };
    let value = match params.objective {
        Objective::Jct => completion(),
        Objective::Loss => loss(),
        Objective::Both => completion() + loss(),
    };
    if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, f64::MAX)
    }
}

/// The job's throughput with `workers ≥ 1` workers, in progress units (samples) per second:
/// from its throughput table when it has one (beyond the table's end, its last entry), else
/// linear in workers at the measured per-worker rate, else at the prior. Finite, ≥ 0.
pub fn throughput(job: &PolicyJob, workers: u32, params: &PolicyParams) -> f64 {
    let rate = match job.throughput.as_deref() {
        Some(table) if !table.is_empty() => table[(workers.max(1) as usize).min(table.len()) - 1],
        _ => {
            let per_worker = job
                .samples_per_s_per_worker
                .filter(|r| r.is_finite() && *r > 0.0)
                .unwrap_or(params.prior_samples_per_s_per_worker);
            f64::from(workers) * per_worker
        }
    };
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        0.0
    }
}

/// Work left for the [`Objective::Jct`] value, in the units of [`throughput`] × seconds:
/// `remaining_work` when known, else as much as the job has done (`samples`); at least one
/// horizon of work at the job's single-worker rate, and never 0. Does not depend on
/// `current_workers`, so that applying a decision does not change the next one.
pub fn remaining_work(job: &PolicyJob, params: &PolicyParams) -> f64 {
    let floor = throughput(job, 1, params) * params.horizon_s.max(1.0);
    let left = match job.remaining_work {
        Some(r) if r.is_finite() && r >= 0.0 => r,
        _ => job.samples,
    };
    let left = if left.is_finite() { left } else { f64::MAX };
    left.max(floor).max(f64::MIN_POSITIVE)
}

/// Decides how many workers each job gets on a cluster of `total_gpus` GPUs (see the module
/// documentation). The result does not depend on the order of `jobs`; if an id appears more
/// than once, only its first occurrence in admission order is considered.
pub fn quality_allocate(
    cluster: &ClusterView,
    jobs: &[PolicyJob],
    params: &PolicyParams,
) -> Decision {
    let (order, workers) = quality_sizes(cluster, jobs, params);
    Decision {
        workers: order
            .iter()
            .map(|&i| (jobs[i].id.clone(), workers[i]))
            .collect(),
    }
}

/// [`quality_allocate`] by index: the jobs considered (each id once, in admission order) and
/// the workers of each job, indexed like `jobs` (0 for a duplicate id).
fn quality_sizes(
    cluster: &ClusterView,
    jobs: &[PolicyJob],
    params: &PolicyParams,
) -> (Vec<usize>, Vec<u32>) {
    let total_gpus = cluster.total_gpus;
    // Only a job that never ran: a preempted job past the wait would preempt another at
    // once, and that one the next, every decision (on an overloaded cluster every pending
    // job is past the wait).
    let starving = |job: &PolicyJob| {
        job.current_workers == 0
            && job.attained_gpu_seconds <= 0.0
            && cluster.now - job.submitted_at >= params.max_wait_s
    };
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| {
        starving(&jobs[b])
            .cmp(&starving(&jobs[a]))
            .then_with(|| admission_order(&jobs[a], &jobs[b]))
    });
    let mut seen = BTreeSet::new();
    order.retain(|&i| seen.insert(&jobs[i].id));

    let mut workers = vec![0u32; jobs.len()];
    let mut free_gpus = u64::from(total_gpus);
    // Terms over the jobs considered (duplicates dropped); indexed like `jobs`.
    let considered: Vec<&PolicyJob> = order.iter().map(|&i| &jobs[i]).collect();
    let mut terms = vec![
        JobTerms {
            completion_weight: 0.0,
            change_factor: 0.0,
        };
        jobs.len()
    ];
    for (&i, t) in order
        .iter()
        .zip(job_terms(&considered, cluster.now, params))
    {
        terms[i] = t;
    }

    // 1. Admission. Under `loss` (SLAQ), jobs compete for their minimum on value: a job
    //    with more loss to lose over the horizon per GPU goes first, so a new job displaces
    //    a running one whose curve is flat (module docs, step 1).
    if params.objective == Objective::Loss {
        let value: Vec<f64> = (0..jobs.len())
            .map(|i| admission_value(&jobs[i], params, &terms[i]))
            .collect();
        // Running jobs without a fitted curve keep their place: nothing is known yet that
        // would make an arrival worth more.
        let unknown = |j: &PolicyJob| j.current_workers > 0 && j.curve.is_none();
        order.sort_by(|&a, &b| {
            starving(&jobs[b])
                .cmp(&starving(&jobs[a]))
                .then(unknown(&jobs[b]).cmp(&unknown(&jobs[a])))
                .then(value[b].total_cmp(&value[a]))
                .then_with(|| admission_order(&jobs[a], &jobs[b]))
        });
    }
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
        .filter_map(|&i| best_step(jobs, i, workers[i], free_gpus, params, threshold, &terms[i]))
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
                &terms[step.job],
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
            &terms[step.job],
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
                && job_value(job, workers[i], params, &terms[i])
                    <= job_value(job, current, params, &terms[i])
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

    (order, workers)
}

/// Value per GPU of a job's minimum over the horizon, for admission under
/// [`Objective::Loss`]: a running job's as if kept (its restart is already paid), a pending
/// job's with the restart it would pay. 0 for a job that cannot run.
fn admission_value(job: &PolicyJob, params: &PolicyParams, terms: &JobTerms) -> f64 {
    let Some(min) = minimum_workers(job) else {
        return 0.0;
    };
    let fraction = if job.current_workers > 0 {
        1.0
    } else {
        terms.change_factor.clamp(0.0, 1.0)
    };
    value_with(job, min, params, terms, fraction) / gpus(job, min).max(1) as f64
}

/// Running jobs first, then by arrival, then by id.
fn admission_order(a: &PolicyJob, b: &PolicyJob) -> Ordering {
    (a.current_workers == 0)
        .cmp(&(b.current_workers == 0))
        .then(a.submitted_at.total_cmp(&b.submitted_at))
        .then_with(|| a.id.cmp(&b.id))
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
    terms: &JobTerms,
) -> Option<Step<'a>> {
    let job = &jobs[index];
    let by_gpus = free_gpus / u64::from(job.gpus_per_worker.max(1));
    let by_max = u64::from(job.max_workers.saturating_sub(current));
    let most = by_gpus.min(by_max) as u32;
    let base = job_value(job, current, params, terms);
    let mut best: Option<(f64, u32)> = None;
    // A job that is not running starts at its minimum (gang), or not at all.
    let first = if current == 0 {
        minimum_workers(job)?.max(1)
    } else {
        1
    };
    for added in first..=most {
        let gain = job_value(job, current + added, params, terms) - base;
        let per_gpu = gain / gpus(job, added) as f64;
        if best.is_none_or(|(b, _)| per_gpu > b) {
            best = Some((per_gpu, added));
        }
    }
    best.filter(|&(per_gpu, _)| per_gpu > threshold)
        .map(|(gain_per_gpu, workers_added)| Step {
            fitted: job.curve.is_some() || params.objective != Objective::Loss,
            gain_per_gpu,
            workers_added,
            job: index,
            submitted_at: job.submitted_at,
            id: &job.id,
        })
}

/// SLAQ's quality policy with the given settings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quality {
    /// Settings of the quality policy (horizon, restart cost, priors).
    pub params: PolicyParams,
}

impl Policy for Quality {
    fn name(&self) -> &'static str {
        "quality"
    }

    fn inputs(&self) -> PolicyInputs {
        PolicyInputs {
            curves: true,
            estimates: true,
            goodput: true,
            gpu_types: true,
            ..PolicyInputs::default()
        }
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        quality_allocate(cluster, jobs, &self.params)
    }

    fn allocate_on_types(
        &self,
        cluster: &ClusterView,
        pools: &[super::GpuTypePool],
        jobs: &[PolicyJob],
        types: &[super::JobTypes],
    ) -> Option<super::TypeDecision> {
        if types.len() != jobs.len() {
            return None;
        }
        // 1. Sizes as on one type, at the speeds of each job's table. Each id once:
        //    `quality_sizes` gives a duplicate 0 workers.
        let (considered, first) = quality_sizes(cluster, jobs, &self.params);
        let refs: Vec<&PolicyJob> = jobs.iter().collect();
        let terms = job_terms(&refs, cluster.now, &self.params);
        let arrival = super::arrival_order(jobs);
        // 2. One type per sized job, by comparative advantage.
        let assign = |sizes: &[u32]| -> Vec<Option<usize>> {
            let sized: Vec<(usize, u32)> = arrival
                .iter()
                .filter_map(|&i| (sizes[i] > 0).then_some((i, sizes[i])))
                .collect();
            let choice = super::assign_gpu_types(
                pools,
                &sized,
                |i, w| w * jobs[i].gpus_per_worker,
                |i, w, t| {
                    let job = &jobs[i];
                    let jt = &types[i];
                    let keep = if jt.current == Some(t) && job.current_workers == w {
                        1.0
                    } else if job.current_workers > 0 {
                        terms[i].change_factor
                    } else {
                        1.0
                    };
                    let eligible = jt.eligible_gpus.get(t).copied().unwrap_or(0);
                    (eligible >= w * job.gpus_per_worker).then(|| {
                        f64::from(w * job.gpus_per_worker)
                            * (type_factor(jt, t) * keep).max(1e-3).ln()
                    })
                },
            );
            let mut assigned = vec![None; jobs.len()];
            for ((i, _), t) in sized.iter().zip(choice) {
                assigned[*i] = t;
            }
            assigned
        };
        // 3. Sizes again within each type, at that type's speed.
        let (second, _) = size_within_types(
            cluster,
            pools,
            jobs,
            types,
            &assign(&first),
            &first,
            &considered,
            &self.params,
        );
        // 4. Steps 2 and 3 once more, from step 3's sizes: a job sized at its new type's
        //    speed may suit another type better. (A third round gained nothing more on the
        //    Sia traces.)
        let (workers, typed) = size_within_types(
            cluster,
            pools,
            jobs,
            types,
            &assign(&second),
            &second,
            &considered,
            &self.params,
        );
        Some(super::TypeDecision {
            workers: considered
                .iter()
                .map(|&i| (jobs[i].id.clone(), workers[i]))
                .collect(),
            types: considered
                .iter()
                .filter_map(|&i| Some((jobs[i].id.clone(), typed[i]?)))
                .collect(),
        })
    }
}

/// A job's speed on pool `t` relative to its throughput table: the measured or projected
/// factor, else its slowest known one (a type it has no figure for is assumed no faster),
/// else 1.
fn type_factor(jt: &super::JobTypes, t: usize) -> f64 {
    let slowest = jt
        .factors
        .iter()
        .flatten()
        .copied()
        .fold(f64::INFINITY, f64::min);
    jt.factors
        .get(t)
        .copied()
        .flatten()
        .unwrap_or(if slowest.is_finite() { slowest } else { 1.0 })
}

/// Step 3 of [`Quality::allocate_on_types`]: [`quality_allocate`] once per GPU type, on that
/// type's GPUs, over the jobs given the type (`assigned`) with their throughput scaled to
/// it ([`type_factor`]). A job moving from another type counts as pending there (the move
/// restarts it). The jobs that step 2 left without a type (not sized, or no type had room)
/// compete in every pool they may use, pools with the most GPUs left after step 1's sizes
/// first, and take the first that admits them.
///
/// Why: step 1 sizes a job at its current type's speed. A job moved to a type three times
/// as fast needs fewer GPUs for the same completion time, and a type's GPUs go further
/// when the jobs on it are sized against one another; the GPUs a faster type saves go to
/// jobs that were waiting.
#[allow(clippy::too_many_arguments)]
fn size_within_types(
    cluster: &ClusterView,
    pools: &[super::GpuTypePool],
    jobs: &[PolicyJob],
    types: &[super::JobTypes],
    assigned: &[Option<usize>],
    sizes: &[u32],
    considered: &[usize],
    params: &PolicyParams,
) -> (Vec<u32>, Vec<Option<usize>>) {
    let mut workers = vec![0u32; jobs.len()];
    let mut typed: Vec<Option<usize>> = vec![None; jobs.len()];
    let mut used = vec![0u64; pools.len()];
    for (i, t) in assigned.iter().enumerate() {
        if let Some(t) = *t {
            used[t] += u64::from(sizes[i]) * u64::from(jobs[i].gpus_per_worker);
        }
    }
    let mut pool_order: Vec<usize> = (0..pools.len()).collect();
    pool_order
        .sort_by_key(|&t| std::cmp::Reverse(u64::from(pools[t].gpus).saturating_sub(used[t])));
    // Each id once, as in step 1.
    let mut placed = vec![true; jobs.len()];
    for &i in considered {
        placed[i] = false;
    }
    for t in pool_order {
        let members: Vec<usize> = (0..jobs.len())
            .filter(|&i| !placed[i])
            .filter(|&i| {
                let eligible = types[i].eligible_gpus.get(t).copied().unwrap_or(0) > 0;
                assigned[i] == Some(t) || (assigned[i].is_none() && eligible)
            })
            .collect();
        let scaled: Vec<PolicyJob> = members
            .iter()
            .map(|&i| {
                let f = type_factor(&types[i], t);
                let mut job = jobs[i].clone();
                if let Some(table) = job.throughput.as_mut() {
                    table.iter_mut().for_each(|x| *x *= f);
                }
                job.samples_per_s_per_worker = job.samples_per_s_per_worker.map(|r| r * f);
                let eligible = types[i].eligible_gpus.get(t).copied().unwrap_or(0);
                job.max_workers = job.max_workers.min(eligible / job.gpus_per_worker.max(1));
                if types[i].current != Some(t) {
                    job.current_workers = 0;
                }
                job
            })
            .collect();
        let view = ClusterView {
            total_gpus: pools[t].gpus,
            gpus_per_node: pools[t].gpus_per_node,
            now: cluster.now,
        };
        // The members' ids are distinct: their workers come back indexed like them.
        let (_, sized) = quality_sizes(&view, &scaled, params);
        for (&i, &w) in members.iter().zip(&sized) {
            if w > 0 {
                placed[i] = true;
                workers[i] = w;
                typed[i] = Some(t);
            }
        }
    }
    (workers, typed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::{Curve, CurveFamily};
    use proptest::prelude::*;

    /// `job_value` of a job decided alone at time 0.
    fn value_alone(job: &PolicyJob, workers: u32, params: &PolicyParams) -> f64 {
        job_value(job, workers, params, &job_terms(&[job], 0.0, params)[0])
    }

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
            restarts: 0,
            restart_cost_s: None,
            goodput: None,
            current_hosts: Vec::new(),
            eligible_hosts: None,
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

    /// SLAQ's objective (most tests below are about it).
    fn slaq() -> PolicyParams {
        PolicyParams {
            objective: Objective::Loss,
            ..PolicyParams::default()
        }
    }

    /// A cluster of `total_gpus` GPUs at time 0.
    fn view(total_gpus: u32) -> ClusterView {
        ClusterView {
            total_gpus,
            gpus_per_node: 8,
            now: 0.0,
        }
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
            let decision = quality_allocate(&view(total_gpus), &jobs, params);
            for job in &mut jobs {
                job.current_workers = decision.workers[&job.id];
            }
            decisions.push(decision);
        }
        decisions
    }

    #[test]
    fn value_is_zero_without_workers_and_pays_the_restart() {
        let params = slaq();
        for j in [job("new", 8), with_curve(job("fitted", 8), steep_curve())] {
            assert_eq!(value_alone(&j, 0, &params), 0.0);
            let moving = value_alone(&j, 2, &params);
            let staying = value_alone(&running(j.clone(), 2), 2, &params);
            assert!(moving > 0.0 && staying > moving, "{moving} {staying}");
        }
        // Without a curve the restart costs the fraction restart/horizon of the gain.
        let new = job("new", 8);
        assert!((value_alone(&new, 1, &params) - 0.5 * 0.5).abs() < 1e-12);
        // With a curve the value is the normalized predicted drop over w·r·T samples.
        let fitted = running(with_curve(job("fitted", 8), steep_curve()), 2);
        let curve = steep_curve();
        let expected = (curve.predict(0.0) - curve.predict(2.0 * 100.0 * 60.0)) / 0.36;
        assert!((value_alone(&fitted, 2, &params) - expected).abs() < 1e-12);
        // A restart as long as the horizon leaves nothing to gain by changing.
        let costly = PolicyParams {
            restart_cost_s: 60.0,
            ..params
        };
        assert_eq!(value_alone(&fitted, 3, &costly), 0.0);
    }

    #[test]
    fn new_jobs_get_gpus_before_converged_ones() {
        let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
        let new = job("new", 8);
        let decision = quality_allocate(&view(8), &[converged, new], &slaq());
        assert_eq!(workers_of(&decision, "converged"), 1);
        assert_eq!(workers_of(&decision, "new"), 7);
    }

    #[test]
    fn jobs_without_a_curve_get_only_what_fitted_jobs_leave() {
        let steep = running(with_curve(job("steep", 6), steep_curve()), 4);
        let new = job("new", 8);
        let free_restarts = PolicyParams {
            restart_cost_s: 0.0,
            ..slaq()
        };
        let decision = quality_allocate(&view(8), &[steep.clone(), new.clone()], &free_restarts);
        assert_eq!(workers_of(&decision, "new"), 2, "{decision:?}");
        assert_eq!(workers_of(&decision, "steep"), 6);
        // Alone, the new job takes every idle GPU (work conservation).
        let decision = quality_allocate(&view(8), &[new], &slaq());
        assert_eq!(workers_of(&decision, "new"), 8);
    }

    #[test]
    fn converged_job_keeps_its_gpus_when_nobody_needs_them() {
        let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
        let decision = quality_allocate(&view(8), &[converged], &slaq());
        assert_eq!(workers_of(&decision, "converged"), 4);
    }

    #[test]
    fn growth_must_beat_the_restart_cost() {
        // From 2 to 3 workers: 3·30 s of work instead of 2·60 s, so it is not worth it.
        let steady = running(with_curve(job("steady", 3), steep_curve()), 2);
        let params = slaq();
        assert_eq!(
            workers_of(
                &quality_allocate(&view(8), std::slice::from_ref(&steady), &params),
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
                &quality_allocate(&view(8), std::slice::from_ref(&steady), &free_restarts),
                "steady"
            ),
            3
        );
        // A big jump does beat the restart: 8 workers for 30 s beat 2 for 60 s.
        let mut wide = steady;
        wide.max_workers = 8;
        assert_eq!(
            workers_of(&quality_allocate(&view(8), &[wide], &params), "steady"),
            8
        );
    }

    #[test]
    fn running_jobs_are_admitted_first() {
        let mut old = running(job("old", 4), 4);
        old.min_workers = 4;
        old.submitted_at = 10.0;
        let early_pending = job("early", 4);
        let decision = quality_allocate(&view(4), &[early_pending.clone(), old.clone()], &slaq());
        assert_eq!(workers_of(&decision, "old"), 4);
        assert_eq!(workers_of(&decision, "early"), 0);
        // Capacity shrank below the running job's minimum: it is stopped, the other fits.
        let decision = quality_allocate(&view(3), &[early_pending, old], &slaq());
        assert_eq!(workers_of(&decision, "old"), 0);
        assert_eq!(workers_of(&decision, "early"), 3);
    }

    #[test]
    fn under_loss_an_arrival_displaces_a_running_job_whose_curve_is_flat() {
        // `flat` runs on the only GPU and its curve predicts almost nothing more.
        let flat_curve = Curve {
            family: CurveFamily::InvLinear,
            params: vec![1e-6, 1e-3, 0.1],
            rmse: 0.0,
            points: 50,
        };
        let mut flat = running(with_curve(job("flat", 1), flat_curve), 1);
        flat.samples = 1e9;
        flat.loss_scale = 1.0;
        let arrival = job("new", 1);
        let decision = quality_allocate(&view(1), &[flat.clone(), arrival.clone()], &slaq());
        assert_eq!(workers_of(&decision, "new"), 1);
        assert_eq!(workers_of(&decision, "flat"), 0);
        // Deciding again on the applied decision changes nothing.
        let (mut flat, mut arrival) = (flat, arrival);
        flat.current_workers = 0;
        arrival.current_workers = 1;
        let again = quality_allocate(&view(1), &[flat.clone(), arrival.clone()], &slaq());
        assert_eq!(workers_of(&again, "new"), 1);
        // Under `both`, running jobs keep their place.
        let both = PolicyParams::default();
        flat.current_workers = 1;
        arrival.current_workers = 0;
        let decision = quality_allocate(&view(1), &[flat, arrival], &both);
        assert_eq!(workers_of(&decision, "flat"), 1);
    }

    #[test]
    fn jobs_that_can_never_run_get_nothing() {
        let mut no_gpus = job("no-gpus", 4);
        no_gpus.gpus_per_worker = 0;
        let mut inverted = job("inverted", 2);
        inverted.min_workers = 3;
        let decision = quality_allocate(&view(16), &[no_gpus, inverted], &slaq());
        assert_eq!(workers_of(&decision, "no-gpus"), 0);
        assert_eq!(workers_of(&decision, "inverted"), 0);
    }

    #[test]
    fn gpus_go_in_whole_workers() {
        let mut wide = job("wide", 8);
        wide.gpus_per_worker = 3;
        let decision = quality_allocate(&view(10), &[wide], &slaq());
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
            let decisions = settle(total_gpus, &jobs, &slaq(), 4);
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
            (
                prop::option::of(prop::collection::vec(
                    prop_oneof![Just(0.0), Just(f64::NAN), 0.0..1e4f64],
                    0..10,
                )),
                prop::option::of(prop_oneof![Just(f64::NAN), Just(-1.0), 0.0..1e7f64]),
            ),
        )
            .prop_map(
                move |(
                    (gpus_per_worker, min, extra, current),
                    submitted,
                    curve,
                    (samples, loss_scale),
                    rate,
                    (throughput, remaining_work),
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
                        throughput,
                        remaining_work,
                        restarts: 0,
                        restart_cost_s: None,
                        goodput: None,
                        current_hosts: Vec::new(),
                        eligible_hosts: None,
                    }
                },
            )
    }

    /// A running job of `max` 1-GPU workers with a throughput table and known remaining work.
    fn sized(name: &str, max: u32, table: &[f64], remaining: f64) -> PolicyJob {
        let mut j = job(name, max);
        j.throughput = Some(table.to_vec());
        j.remaining_work = Some(remaining);
        j
    }

    #[test]
    fn completion_objective_favours_the_job_closest_to_done() {
        let params = PolicyParams {
            objective: Objective::Jct,
            restart_cost_s: 0.0,
            ..slaq()
        };
        let linear = [100.0, 200.0, 300.0, 400.0];
        let short = sized("short", 4, &linear, 1e5);
        let long = sized("long", 4, &linear, 1e7);
        // 5 GPUs: each gets one, the short job the rest (shortest remaining first).
        let decision = quality_allocate(&view(5), &[long.clone(), short.clone()], &params);
        assert_eq!(workers_of(&decision, "short"), 4);
        assert_eq!(workers_of(&decision, "long"), 1);
        // A job that does not scale gets no extra GPU even if it is the shortest.
        let flat = sized("flat", 4, &[100.0, 100.0, 100.0, 100.0], 1e5);
        let decision = quality_allocate(&view(5), &[long, flat], &params);
        assert_eq!(workers_of(&decision, "flat"), 1);
        assert_eq!(workers_of(&decision, "long"), 4);
    }

    #[test]
    fn completion_weights_follow_hesrpt_ranks() {
        let params = PolicyParams {
            objective: Objective::Jct,
            ..PolicyParams::default()
        };
        let linear = [100.0, 200.0, 300.0, 400.0];
        let jobs: Vec<PolicyJob> = [1e7, 1e5, 1e6, 1e4]
            .iter()
            .enumerate()
            .map(|(i, &work)| sized(&format!("j{i}"), 4, &linear, work))
            .collect();
        let refs: Vec<&PolicyJob> = jobs.iter().collect();
        let terms = job_terms(&refs, 0.0, &params);
        let w: Vec<f64> = terms.iter().map(|t| t.completion_weight).collect();
        // Less remaining time, more weight: j3 (1e4) > j1 (1e5) > j2 (1e6) > j0 (1e7).
        assert!(w[3] > w[1] && w[1] > w[2] && w[2] > w[0], "{w:?}");
        // The weights are heSRPT's shares: Σ weight^c / m = Σ θ = 1.
        let c = 1.0 / (1.0 - params.speedup_exponent);
        let sum: f64 = w.iter().map(|x| x.powf(c)).sum::<f64>() / w.len() as f64;
        assert!((sum - 1.0).abs() < 1e-9, "{sum}");
        // One job alone has an equal share: weight 1.
        assert!((job_terms(&refs[..1], 0.0, &params)[0].completion_weight - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_restart_budget_limits_restarts_to_a_share_of_age() {
        let params = PolicyParams::default();
        let charged = params.restart_cost_s / params.restart_budget;
        let mut j = running(sized("j", 8, &[100.0, 200.0, 300.0, 400.0], 1e7), 2);
        let factor = |j: &PolicyJob, now: f64| job_terms(&[j], now, &params)[0].change_factor;
        // Young: changing is worth little; old: nearly all of it.
        assert_eq!(factor(&j, 0.0), 0.0);
        assert!((factor(&j, 1e5) - 1e5 / (1e5 + charged)).abs() < 1e-12);
        // Every restart is charged δ/ρ of age: past the budget, nothing.
        j.restarts = 10;
        assert_eq!(factor(&j, 10.0 * charged), 0.0);
        // A job's own measured restart cost replaces the configured one.
        j.restarts = 1;
        j.restart_cost_s = Some(0.0);
        assert!((factor(&j, 100.0) - 1.0).abs() < 1e-12);
        // Past its budget a running job keeps its size even though growing would pay.
        let mut busy = running(sized("busy", 4, &[100.0, 200.0, 300.0, 400.0], 1e7), 1);
        busy.restarts = 3;
        let cluster = ClusterView {
            now: 3.0 * charged,
            ..view(4)
        };
        assert_eq!(
            workers_of(
                &quality_allocate(&cluster, &[busy.clone()], &params),
                "busy"
            ),
            1
        );
        busy.restarts = 0;
        assert_eq!(
            workers_of(&quality_allocate(&cluster, &[busy], &params), "busy"),
            4
        );
    }

    #[test]
    fn the_throughput_table_replaces_linear_scaling() {
        let params = PolicyParams {
            objective: Objective::Jct,
            ..slaq()
        };
        let j = sized("j", 8, &[100.0, 150.0], 1e6);
        assert_eq!(throughput(&j, 1, &params), 100.0);
        assert_eq!(throughput(&j, 2, &params), 150.0);
        // Beyond the table, its last entry.
        assert_eq!(throughput(&j, 8, &params), 150.0);
        let broken = sized("broken", 8, &[f64::NAN, -5.0], 1e6);
        assert_eq!(throughput(&broken, 1, &params), 0.0);
        assert_eq!(throughput(&broken, 2, &params), 0.0);
        // Without a table: linear at the measured rate, else the prior.
        let mut plain = job("plain", 8);
        assert_eq!(throughput(&plain, 3, &params), 300.0);
        plain.samples_per_s_per_worker = Some(7.0);
        assert_eq!(throughput(&plain, 3, &params), 21.0);
    }

    #[test]
    fn unknown_remaining_work_is_guessed_from_the_work_done() {
        let params = PolicyParams {
            objective: Objective::Jct,
            ..slaq()
        };
        let mut j = job("j", 4);
        j.samples = 1e6;
        assert_eq!(remaining_work(&j, &params), 1e6);
        // At least one horizon at one worker's rate (100 samples/s × 60 s).
        j.samples = 10.0;
        assert_eq!(remaining_work(&j, &params), 6000.0);
        j.remaining_work = Some(f64::NAN);
        assert_eq!(remaining_work(&j, &params), 6000.0);
        j.remaining_work = Some(5e5);
        assert_eq!(remaining_work(&j, &params), 5e5);
    }

    #[test]
    fn both_adds_the_two_values() {
        // At its current size, where no restart factor applies.
        let fitted = running(with_curve(job("fitted", 8), steep_curve()), 2);
        let value = |objective| {
            value_alone(
                &fitted,
                2,
                &PolicyParams {
                    objective,
                    ..slaq()
                },
            )
        };
        let (loss, jct, both) = (
            value(Objective::Loss),
            value(Objective::Jct),
            value(Objective::Both),
        );
        assert!(loss > 0.0 && jct > 0.0);
        assert!((both - (loss + jct)).abs() < 1e-12);
    }

    #[test]
    fn a_job_waiting_past_max_wait_is_admitted_before_running_ones() {
        let params = PolicyParams {
            max_wait_s: 600.0,
            ..PolicyParams::default()
        };
        let mut old = running(job("old", 4), 4);
        old.min_workers = 4;
        let mut waiting = job("waiting", 4);
        waiting.min_workers = 4;
        waiting.submitted_at = 100.0;
        let at = |now| ClusterView { now, ..view(4) };
        let decision = quality_allocate(&at(500.0), &[old.clone(), waiting.clone()], &params);
        assert_eq!(workers_of(&decision, "old"), 4);
        assert_eq!(workers_of(&decision, "waiting"), 0);
        let decision = quality_allocate(&at(700.0), &[old.clone(), waiting.clone()], &params);
        assert_eq!(workers_of(&decision, "old"), 0);
        assert_eq!(workers_of(&decision, "waiting"), 4);
        // A job that ran before (preempted) waits for its turn: no preemption chain.
        let preempted = PolicyJob {
            attained_gpu_seconds: 60.0,
            ..waiting
        };
        let decision = quality_allocate(&at(700.0), &[old, preempted], &params);
        assert_eq!(workers_of(&decision, "old"), 4);
        assert_eq!(workers_of(&decision, "waiting"), 0);
    }

    fn objectives() -> impl Strategy<Value = Objective> {
        prop_oneof![
            Just(Objective::Loss),
            Just(Objective::Jct),
            Just(Objective::Both)
        ]
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

    /// [`cluster`] with every throughput table replaced by one a throughput model gives:
    /// increasing and concave in workers (Amdahl's law, `r·k / (1 + s·(k − 1))`, `r` the
    /// one-worker rate, `s` the serial share). The greedy hand-out is exact for such
    /// diminishing returns; on arbitrary tables (nothing until the seventh worker, then
    /// much) no greedy is, and applying its decision can make a better one visible.
    fn realistic_cluster() -> impl Strategy<Value = (u32, Vec<PolicyJob>)> {
        (
            cluster(),
            prop::collection::vec((1.0..1e4f64, 0.0..1.0f64), 20),
        )
            .prop_map(|((total_gpus, mut jobs), shapes)| {
                for (job, (rate, serial)) in jobs.iter_mut().zip(shapes) {
                    if let Some(table) = &mut job.throughput {
                        *table = (1..=table.len())
                            .map(|k| rate * k as f64 / (1.0 + serial * (k as f64 - 1.0)))
                            .collect();
                    }
                }
                (total_gpus, jobs)
            })
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

        /// On several GPU types, whatever the jobs, their speeds and where they run: no
        /// type hands out more GPUs than it has, every job with workers has a type it may
        /// use with room for them, and sizes stay within each job's bounds.
        #[test]
        fn on_several_types_no_type_is_oversubscribed(
            specs in proptest::collection::vec(
                (1u32..=8, 0u32..=8, 0usize..3, proptest::collection::vec(0.2f64..8.0, 3),
                 proptest::option::of(0usize..3), 1u32..=2),
                1..14,
            ),
            gpus in proptest::collection::vec(1u32..=16, 3),
        ) {
            let pools: Vec<crate::policies::GpuTypePool> = gpus
                .iter()
                .enumerate()
                .map(|(k, &g)| crate::policies::GpuTypePool {
                    name: Some(format!("t{k}")),
                    gpus: g,
                    nodes: 1,
                    gpus_per_node: g,
                })
                .collect();
            let mut jobs = Vec::new();
            let mut types = Vec::new();
            for (n, (max, current, on, factors, limited, per_worker)) in specs.iter().enumerate() {
                let mut j = job(&format!("j{n}"), *max);
                j.gpus_per_worker = *per_worker;
                j.throughput = Some((1..=*max).map(|w| f64::from(w).sqrt() * 100.0).collect());
                j.remaining_work = Some(1e5 * (n + 1) as f64);
                j.submitted_at = n as f64;
                let runs = *current > 0 && current * per_worker <= gpus[*on];
                if runs {
                    j.current_workers = (*current).min(*max);
                    j.attained_gpu_seconds = 100.0;
                }
                jobs.push(j);
                types.push(crate::policies::JobTypes {
                    factors: factors.iter().map(|&f| Some(f)).collect(),
                    current: runs.then_some(*on),
                    eligible_gpus: gpus
                        .iter()
                        .enumerate()
                        .map(|(k, &g)| if Some(k) == *limited { 0 } else { g })
                        .collect(),
                });
            }
            let cluster = ClusterView {
                total_gpus: gpus.iter().sum(),
                gpus_per_node: 16,
                now: 1000.0,
            };
            let policy = Quality::default();
            let d = policy.allocate_on_types(&cluster, &pools, &jobs, &types).unwrap();
            let mut used = [0u32; 3];
            for (i, j) in jobs.iter().enumerate() {
                let w = d.workers[&j.id];
                match d.types.get(&j.id) {
                    Some(&t) => {
                        prop_assert!(w >= 1 && w <= j.max_workers, "{}: {w}", j.id);
                        prop_assert!(types[i].eligible_gpus[t] >= w * j.gpus_per_worker);
                        used[t] += w * j.gpus_per_worker;
                    }
                    None => prop_assert_eq!(w, 0, "{} has workers but no type", j.id),
                }
            }
            for t in 0..3 {
                prop_assert!(used[t] <= gpus[t], "type {t}: {} of {}", used[t], gpus[t]);
            }
        }

        #[test]
        fn decisions_respect_capacity_and_bounds(
            (total_gpus, jobs) in cluster(),
            restart_cost_s in prop_oneof![Just(30.0), 0.0..120.0f64],
            objective in objectives(),
            now in prop_oneof![Just(0.0), 0.0..1e4f64],
        ) {
            let params = PolicyParams { restart_cost_s, objective, max_wait_s: 100.0, ..slaq() };
            let cluster = ClusterView { now, ..view(total_gpus) };
            let decision = quality_allocate(&cluster, &jobs, &params);
            for job in &jobs {
                let v = value_alone(job, decision.workers[&job.id], &params);
                prop_assert!(v.is_finite() && v >= 0.0, "{} valued {}", job.id, v);
            }
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
            }),
            objective in objectives(),
        ) {
            let params = PolicyParams { objective, ..slaq() };
            let decision = quality_allocate(&view(total_gpus), &jobs, &params);
            prop_assert_eq!(&decision, &quality_allocate(&view(total_gpus), &jobs, &params));
            prop_assert_eq!(&decision, &quality_allocate(&view(total_gpus), &shuffled, &params));
        }

        #[test]
        fn applying_a_decision_and_deciding_again_changes_nothing(
            (total_gpus, jobs) in realistic_cluster(),
            restart_cost_s in 0.0..100.0f64,
            objective in objectives(),
        ) {
            let params = PolicyParams { restart_cost_s, objective, ..slaq() };
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
            let params = PolicyParams { restart_cost_s, ..slaq() };
            let decision = quality_allocate(&view(total_gpus), &jobs, &params);
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
            let params = PolicyParams { restart_cost_s, ..slaq() };
            let total_gpus = max_workers * gpus_per_worker + spare_gpus;
            let decision = quality_allocate(&view(total_gpus), &[steep], &params);
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
            let decision = quality_allocate(&view(total_gpus), &[flat, steep], &slaq());
            prop_assert!(workers_of(&decision, "flat") <= flat_min, "{:?}", decision);
            prop_assert_eq!(workers_of(&decision, "steep"), steep_max);
        }
    }
}

#[cfg(test)]
mod adapter_tests {
    use super::*;
    use crate::policies::test_support::{cluster, job};

    #[test]
    fn the_adapter_decides_as_quality_allocate_with_its_params() {
        let mut running = job("running", 0.0, 1, 8);
        running.current_workers = 2;
        let jobs = [running, job("new", 1.0, 1, 8), job("later", 2.0, 1, 3)];
        for restart_cost_s in [0.0, 30.0, 90.0] {
            let params = PolicyParams {
                restart_cost_s,
                ..PolicyParams::default()
            };
            for total_gpus in [0, 3, 8, 13] {
                let policy = Quality { params };
                assert_eq!(
                    policy.allocate(&cluster(total_gpus), &jobs),
                    quality_allocate(&cluster(total_gpus), &jobs, &params),
                );
            }
        }
        // The params reach the policy: a restart that would take more than the restart budget
        // of the job's age (1,000 s) freezes a running job.
        let frozen = Quality {
            params: PolicyParams {
                restart_cost_s: 600.0,
                ..PolicyParams::default()
            },
        };
        let decision = frozen.allocate(&cluster(8), &jobs[..1]);
        assert_eq!(decision.workers.values().copied().collect::<Vec<_>>(), [2]);
        let free = Quality {
            params: PolicyParams {
                restart_cost_s: 0.0,
                ..PolicyParams::default()
            },
        };
        let decision = free.allocate(&cluster(8), &jobs[..1]);
        assert_eq!(decision.workers.values().copied().collect::<Vec<_>>(), [8]);
    }
}
