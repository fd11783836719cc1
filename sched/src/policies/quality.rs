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
//!    - `both`: the sum of the two;
//!    - `auto` (the default): `loss` for an exploratory job ([`PolicyJob::exploratory`]),
//!      `jct` for any other.
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
//!    is left or nothing fits. An exploratory job (a sweep's trial without a target loss, or a
//!    job with stop criteria but no target loss or declared work) is offered counts `n` above its
//!    reference `r` (the workers it runs with, at least its minimum) only where `X(r) > 0`
//!    and `X(n)/n ≥ min(trial_growth_efficiency, 1) · X(r)/r`, each count judged on its
//!    own: it grows where that does not raise its GPU-hours
//!    ([`PolicyParams::trial_growth_efficiency`]). Before its first step time is measured
//!    (no throughput table, [`PolicyJob::throughput`]) `X` is only the linear prior, so
//!    such a job keeps its reference, or the `workers` its spec sets if more: nothing is
//!    known to hold beyond them. Heap entries
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
//!    ([`super::assign_gpu_types`]): its value on type `t` is `c · g · ln(s_t · k_t)`, `c`
//!    its completion weight (step 2; 1 for a job valued by loss alone, `type_weight`), `g` its
//!    GPUs, `s_t` its speed there relative to the type its throughput model describes
//!    (its goodput from its own table on `t` over its goodput, at its size, where it has
//!    tables per type, [`super::JobTypes::tables`]: that counts the larger micro-batch a
//!    type holds; else its measured or projected compute speed, [`crate::gpu_types`]; an
//!    unknown type counts as its slowest known) and `k_t` 1 for staying where it runs with
//!    as many workers as it asks there,
//!    else its restart share `f` (step 2). Maximizing the sum over GPUs of the log
//!    speed-up puts a type's GPUs on the jobs that gain most per GPU there relative to
//!    elsewhere (BERT on A100s), not on whichever job comes first; the completion weight
//!    tips it towards the jobs with least time left (SRPT's rule, heSRPT's weights), so a
//!    long job with little weight tends to run on the slower types unless it gains much
//!    more there. The weight scales the restart share's term too: a long job moves more
//!    readily. A job asks a faster type for fewer GPUs:
//!    as many as give its size's throughput there if it scaled linearly, `⌈w / r⌉` with
//!    `r > 1` the speed ratio of that type to the one its size `w` is in, at least its
//!    minimum (`workers_on_type`), so that a job sized for slow GPUs can fit a small pool of
//!    fast ones; its value stays counted over the GPUs `g` it was sized for.
//!    Then steps 1–4 run again once per type,
//!    on that type's GPUs, over the jobs it got, with their throughput scaled to it (a move
//!    counts as a restart), and the jobs still without a type compete for what is left
//!    (types with the most GPUs left first). A job moved to a faster type is sized at that
//!    speed, and the GPUs this saves go to waiting jobs. The assignment and the sizing per
//!    type then run once more, from the new sizes. On the Sia traces (64 GPUs of three
//!    types) the mean JCT went from 2,904 / 3,285 / 4,160 s (sizes of steps 1–4 kept) to
//!    2,882 / 3,183 / 4,071 s with one sizing per type and 2,813 / 3,117 / 4,012 s with two
//!    (Philly / Helios / newTrace; a third gained nothing), and to 2,761 / 3,050 / 3,800 s
//!    with the fewer GPUs of faster types (docs/heterogeneous.md; those figures are from
//!    before each type ran its own micro-batch). With micro-batches per type, valuing a
//!    type by the job's own table there (rather than by its compute speed alone) and
//!    ordering the assignment by regret per GPU took the mean JCT from 2,534 / 2,945 /
//!    3,261 s to 2,534 / 2,898 / 3,173 s; the sizes asked of a faster type stay from the
//!    compute speed (from the own tables' goodput ratio they came to 2,604 / 2,953 /
//!    3,296 s: a ratio at equal workers overstates what fewer workers give). Weighting
//!    each job's log speed-up by its completion weight then took them to 2,450 / 2,865 /
//!    3,120 s (docs/heterogeneous.md). Each
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
//!   JCT suffers (docs/benchmarks.md). The default values every job that is not
//!   exploratory by the completion term (`jct`) instead, with the restart budget in place
//!   of the horizon's restart share: over a 60 s horizon a 30 s restart halves any change,
//!   so a job alone in the tail of a workload never grows into the idle cluster.
//! - Throughput comes from a per-job model fitted on observed step times (design brief
//!   §5.2), not linear scaling.

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap};

use serde::{Deserialize, Serialize};

use converge_common::JobId;

use super::{
    ClusterView, Decision, Policy, PolicyInputs, PolicyJob, gpus, minimum_workers, requested_size,
};
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
    /// How far an exploratory job ([`PolicyJob::exploratory`]: a sweep's trial without a
    /// target loss, or a job with stop criteria but no target loss or declared work) may grow beyond its reference
    /// workers (those it runs with; a pending job: its minimum): only to counts whose
    /// per-GPU throughput is at least this share of the reference's. A sweep is judged by
    /// the GPU-hours it takes to find its best trial, and a trial that grows at a speedup
    /// below linear spends more of them on the same curve (and restarts to do so). 1 (the
    /// default, and the most: larger values count as 1): growth that does not raise the
    /// trial's GPU-hours; 0 or below (or not a number): trials grow as any job. A reference
    /// throughput of 0 allows no growth. It limits growth
    /// only: counts up to the reference are offered as before. Other jobs are not
    /// affected. Measured in docs/scheduling.md ("Sweep early stopping").
    pub trial_growth_efficiency: f64,
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
    /// default's objective for jobs that are not exploratory until `jct` measured a lower
    /// mean JCT on 8 of 11 simulated sets (docs/scheduling.md, "The default objective for
    /// production jobs").
    Both,
    /// The default: each job's objective follows what it is. An exploratory job
    /// ([`PolicyJob::exploratory`]: a sweep's trial without a target loss, or a job with
    /// stop criteria but no target loss and no declared work) is valued by `loss` (its predicted loss
    /// reduction), any other by `jct` (its completion time); both values are dimensionless
    /// per horizon, so they share one hand-out. Admission is by value (as under `loss`) only
    /// when every job of the decision is exploratory, else in arrival order (as under
    /// `jct`). On a cluster of exploratory jobs only it decides as `loss`, on one without
    /// any as `jct`.
    #[default]
    Auto,
}

impl Objective {
    /// The objective's name as the command line spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Loss => "loss",
            Objective::Jct => "jct",
            Objective::Both => "both",
            Objective::Auto => "auto",
        }
    }

    /// The objective `job` is valued by: [`Objective::Auto`]'s choice for it, else `self`.
    pub fn for_job(self, job: &PolicyJob) -> Objective {
        match self {
            Objective::Auto if job.exploratory => Objective::Loss,
            Objective::Auto => Objective::Jct,
            other => other,
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
            trial_growth_efficiency: 1.0,
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
            let change_factor = match params.objective.for_job(job) {
                Objective::Loss if horizon_s > 0.0 => (horizon_s - delta).max(0.0) / horizon_s,
                Objective::Loss => 0.0,
                Objective::Jct | Objective::Both | Objective::Auto => {
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
    // `for_job` never returns `Auto`; its arm follows `for_job`'s choice for such jobs.
    let value = match params.objective.for_job(job) {
        Objective::Jct | Objective::Auto => completion(),
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
    if jobs
        .iter()
        .all(|j| params.objective.for_job(j) == Objective::Loss)
    {
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
        // A step that no longer fits is passed over; either way the job's next best step
        // goes back on the heap.
        if need <= free_gpus {
            workers[step.job] += step.workers_added;
            free_gpus -= need;
        }
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
    let limit = trial_growth_limit(job, params);
    for added in first..=most {
        let to = current + added;
        let below_floor = |(reference, floor): (u32, f64)| {
            to > reference && throughput(job, to, params) / f64::from(to) < floor
        };
        if limit.is_some_and(below_floor) {
            continue;
        }
        let gain = job_value(job, current + added, params, terms) - base;
        let per_gpu = gain / gpus(job, added) as f64;
        if best.is_none_or(|(b, _)| per_gpu > b) {
            best = Some((per_gpu, added));
        }
    }
    best.filter(|&(per_gpu, _)| per_gpu > threshold)
        .map(|(gain_per_gpu, workers_added)| Step {
            fitted: job.curve.is_some() || params.objective.for_job(job) != Objective::Loss,
            gain_per_gpu,
            workers_added,
            job: index,
            submitted_at: job.submitted_at,
            id: &job.id,
        })
}

/// How far an exploratory job may grow ([`PolicyParams::trial_growth_efficiency`]): its
/// reference workers (the ones it runs with, else, pending or below its minimum, its
/// minimum) and the per-GPU throughput a count above them must keep (infinite: no growth).
/// Nothing is known to hold, so no growth, when the reference's throughput is 0 or when no
/// step time has been measured yet (no throughput table: [`throughput`] is only the linear
/// prior); the unmeasured job's reference is then at least the size its spec asks for
/// (`workers`, when set: [`PolicyJob::workers_declared`]), so that it still starts as
/// asked. Measured in the simulator, a trial that grew on the prior onto two hosts ran at
/// 1.16× its one-GPU rate on four GPUs (docs/scheduling.md, "Sweep early stopping").
/// `None` when the rule does not apply: not exploratory, the rule off (`≤ 0` or NaN), or a
/// job without a valid minimum.
fn trial_growth_limit(job: &PolicyJob, params: &PolicyParams) -> Option<(u32, f64)> {
    let efficiency = params.trial_growth_efficiency;
    if !job.exploratory || efficiency.is_nan() || efficiency <= 0.0 {
        return None;
    }
    let min = minimum_workers(job)?.max(1);
    let reference = job.current_workers.max(min);
    if job.throughput.as_deref().is_none_or(<[f64]>::is_empty) {
        let asked = if job.workers_declared {
            requested_size(job).unwrap_or(min)
        } else {
            min
        };
        return Some((reference.max(asked), f64::INFINITY));
    }
    let rate = throughput(job, reference, params);
    if rate <= 0.0 {
        return Some((reference, f64::INFINITY));
    }
    // Less a rounding margin: linear throughput stays linear.
    let floor = efficiency.min(1.0) * rate / f64::from(reference) * (1.0 - 1e-9);
    Some((reference, floor))
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
        let weights: Vec<f64> = jobs
            .iter()
            .zip(&terms)
            .map(|(job, terms)| type_weight(job, terms, &self.params))
            .collect();
        let arrival = super::arrival_order(jobs);
        // 2. One type per sized job, by comparative advantage. `sizes[i]` is in workers of
        //    type `from[i]` (`None`: at the speed of the job's throughput table). Returns
        //    each job's type and the workers it asks of it.
        let assign = |sizes: &[u32], from: &[Option<usize>]| -> (Vec<Option<usize>>, Vec<u32>) {
            let sized: Vec<(usize, u32)> = arrival
                .iter()
                .filter_map(|&i| (sizes[i] > 0).then_some((i, sizes[i])))
                .collect();
            let on =
                |i: usize, w: u32, t: usize| workers_on_type(&jobs[i], &types[i], w, from[i], t);
            let choice = super::assign_gpu_types(
                pools,
                &sized,
                |i, w, t| on(i, w, t) * jobs[i].gpus_per_worker,
                |i, sized_workers, t| {
                    let job = &jobs[i];
                    let jt = &types[i];
                    let w = on(i, sized_workers, t);
                    let keep = if jt.current == Some(t) && job.current_workers == w {
                        1.0
                    } else if job.current_workers > 0 {
                        terms[i].change_factor
                    } else {
                        1.0
                    };
                    let eligible = jt.eligible_gpus.get(t).copied().unwrap_or(0);
                    (eligible >= w * job.gpus_per_worker).then(|| {
                        weights[i]
                            * f64::from(sized_workers * job.gpus_per_worker)
                            * (speed_on(job, jt, sized_workers, from[i], t) * keep)
                                .max(1e-3)
                                .ln()
                    })
                },
            );
            let mut assigned = vec![None; jobs.len()];
            let mut asked = vec![0; jobs.len()];
            for ((i, w), t) in sized.iter().zip(choice) {
                assigned[*i] = t;
                if let Some(t) = t {
                    asked[*i] = on(*i, *w, t);
                }
            }
            (assigned, asked)
        };
        // 3. Sizes again within each type, at that type's speed.
        let (assigned, asked) = assign(&first, &vec![None; jobs.len()]);
        let (second, typed) = size_within_types(
            cluster,
            pools,
            jobs,
            types,
            &assigned,
            &asked,
            &considered,
            &self.params,
        );
        // 4. Steps 2 and 3 once more, from step 3's sizes (in workers of each job's new
        //    type): a job sized at its new type's speed may suit another type better. (A
        //    third round gained nothing more on the Sia traces.)
        let (assigned, asked) = assign(&second, &typed);
        let (workers, typed) = size_within_types(
            cluster,
            pools,
            jobs,
            types,
            &assigned,
            &asked,
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

/// Weight of a job's log speed-up in the type assignment (module docs, step 5): its
/// completion weight ([`JobTerms::completion_weight`], heSRPT's rank by remaining time)
/// where its value counts completion time ([`Objective::Jct`], [`Objective::Both`]), so that
/// a fast type's GPUs go first to the jobs whose speed-up shortens the mean JCT most; 1 for
/// a job valued by loss reduction alone. Finite and non-negative.
fn type_weight(job: &PolicyJob, terms: &JobTerms, params: &PolicyParams) -> f64 {
    match params.objective.for_job(job) {
        Objective::Loss => 1.0,
        Objective::Jct | Objective::Both | Objective::Auto => {
            let w = terms.completion_weight;
            if w.is_finite() { w.max(0.0) } else { 1.0 }
        }
    }
}

/// Workers a job sized at `workers` of type `from` (`None`: at the speed of its throughput
/// table) asks of pool `t` in the type assignment: on a type faster than `from` by a
/// measured or projected ratio `r = s_t / s_from` ([`type_factor`]), as many as give the same
/// throughput if it scaled linearly, `⌈workers / r⌉`, at least its minimum; else `workers`
/// (never more: a slower type is not asked for extra GPUs, and a type without a figure for
/// the job is not assumed faster). A job sized for slow GPUs then fits a small pool of fast
/// ones (12 RTX GPUs' worth of BERT is 3 A100s), and the sizing per type (step 3) then sizes
/// it there.
fn workers_on_type(
    job: &PolicyJob,
    jt: &super::JobTypes,
    workers: u32,
    from: Option<usize>,
    t: usize,
) -> u32 {
    let Some(speed) = jt.factors.get(t).copied().flatten() else {
        return workers;
    };
    let ratio = speed / from.map_or(1.0, |f| type_factor(jt, f));
    if ratio.is_finite() && ratio > 1.0 {
        let min = minimum_workers(job).unwrap_or(1).min(workers);
        ((f64::from(workers) / ratio).ceil() as u32).clamp(min, workers)
    } else {
        workers
    }
}

/// A job's goodput on pool `t` over its goodput on type `from` (`None`: its throughput
/// table), both with `workers` workers, from its own tables per type
/// ([`super::JobTypes::tables`]: each type's compute speed and micro-batch); `None` where
/// either is missing.
fn own_ratio(
    job: &PolicyJob,
    jt: &super::JobTypes,
    workers: u32,
    from: Option<usize>,
    t: usize,
) -> Option<f64> {
    let table = |u: usize| jt.tables.get(u)?.as_ref()?.at(workers);
    let base = match from {
        Some(f) => table(f)?,
        None => *job
            .throughput
            .as_ref()?
            .get(workers.checked_sub(1)? as usize)?,
    };
    let r = table(t)? / base;
    (r.is_finite() && r > 0.0).then_some(r)
}

/// A job's speed on pool `t` relative to type `from` (`None`: its throughput table) at
/// `workers` workers: [`own_ratio`] where it has tables, else the ratio of the factors.
fn speed_on(
    job: &PolicyJob,
    jt: &super::JobTypes,
    workers: u32,
    from: Option<usize>,
    t: usize,
) -> f64 {
    own_ratio(job, jt, workers, from, t)
        .unwrap_or_else(|| type_factor(jt, t) / from.map_or(1.0, |f| type_factor(jt, f)))
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
/// compete in every pool they may use, pools with the most GPUs left after the workers
/// step 2 asked of them (`asked`, indexed like `jobs`) first, and take the first that admits
/// them.
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
    asked: &[u32],
    considered: &[usize],
    params: &PolicyParams,
) -> (Vec<u32>, Vec<Option<usize>>) {
    let mut workers = vec![0u32; jobs.len()];
    let mut typed: Vec<Option<usize>> = vec![None; jobs.len()];
    let mut used = vec![0u64; pools.len()];
    for (i, t) in assigned.iter().enumerate() {
        if let Some(t) = *t {
            used[t] += u64::from(asked[i]) * u64::from(jobs[i].gpus_per_worker);
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
                // The job's own table on the type (its model at the type's compute speed and
                // micro-batch, synchronization kept), else its table scaled by the factor.
                match types[i].tables.get(t).and_then(Option::as_ref) {
                    Some(own) => job.throughput = Some(own.get().to_vec()),
                    None => {
                        if let Some(table) = job.throughput.as_mut() {
                            table.iter_mut().for_each(|x| *x *= f);
                        }
                    }
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
mod tests;

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
