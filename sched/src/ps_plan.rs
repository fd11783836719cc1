//! Parameter-server (PS) jobs: jointly choose the number of workers `w`, the number of PS
//! shards `p` and where each goes, so that workers co-located with shards skip the network
//! (design brief §5.3, parameter-server bullet).
//!
//! # Source
//!
//! Yu, Liu, Wu, Ji, Bentley, "Toward Efficient Online Scheduling for Distributed Machine
//! Learning Systems", IEEE TNSE 2021: PS jobs arrive online; the scheduler picks each job's
//! worker and PS counts and their placement (locality matters: a worker and a shard on the
//! same machine exchange no network traffic) through a mixed packing/covering integer program
//! solved as an LP relaxation followed by randomized rounding. OASiS (Bao et al., INFOCOM'18)
//! is its predecessor (primal-dual online admission with resource prices). The paper's full
//! text (its exact program, its rounding and its competitive ratio) is not at hand; this module
//! implements that *framing* on the step-time model below with an LP of our own (a
//! disjunctive, per-host convex-hull relaxation, explained under *Formulation*), and measures
//! the result against the LP bound and against exhaustive optima on small instances
//! (`converge-sim ps-bench`) instead of relying on the paper's guarantee.
//!
//! # Model (units: bytes, seconds, samples)
//!
//! A host `h` ([`PsHost`]) has `G_h` free GPUs, `C_h` free CPU slots and a NIC of `B_h`
//! bytes/s. `B_h` is the NIC's capacity for the sum of both directions (a host's bytes in and
//! out per step are added together and divided by `B_h`); a host whose `B_h` is not a
//! positive finite number is not used.
//!
//! A PS job ([`PsJob`]) has a model of `M` bytes, `t_c` seconds of compute per step on each
//! worker, `b` samples per worker per step, `g` GPUs per worker, `w ∈ [w_min, w_max]` workers
//! and `p ∈ [p_min, p_max]` PS shards. A worker takes `g` GPUs and no CPU slot; a shard takes
//! one CPU slot and no GPU. The model is split evenly over the shards (`M/p` bytes each).
//! Every step each worker pushes its gradient slice (`M/p` bytes) to every shard and pulls the
//! parameter slice (`M/p` bytes) back: **`2M/p` bytes per (worker, shard) pair per step**,
//! free when both are on the same host.
//!
//! With `x_h` workers and `y_h` shards on host `h` (`Σx_h = w`, `Σy_h = p`), the host's NIC
//! carries, per step, the traffic of its workers with the shards elsewhere and of its shards
//! with the workers elsewhere:
//!
//! ```text
//! D_h = (2M/p) · [ x_h·(p − y_h) + y_h·(w − x_h) ]          bytes per step
//!     = (2M/p) · [ x_h·(p − 2·y_h) + y_h·w ]
//! step time  S = t_c + max_h D_h / B_h                        seconds
//! throughput   = w·b / S                                      samples/s
//! ```
//!
//! Compute and communication do not overlap, every host's transfer runs in parallel, and the
//! busiest NIC sets the pace (a synchronous PS step waits for its slowest transfer). Packing
//! constraints: `g·x_h ≤ G_h`, `y_h ≤ C_h`.
//!
//! # Formulation (fixed `w` and `p`)
//!
//! For fixed `(w, p)` minimizing `S` is minimizing `T = max_h D_h/B_h`; the only non-linear
//! term is the co-location product `x_h·y_h`. Instead of McCormick envelopes on the product
//! (weak in the interior of the box), the LP uses the **disjunctive (convex-hull)
//! formulation** per host: `y_h` takes one of the values `k = 0..=Y_h` (`Y_h = min(C_h, p)`),
//! and `x_h` is split by that value. Variables: `s_{h,k} ∈ [0,1]` ("host `h` holds `k`
//! shards"), `x_{h,k} ≥ 0` ("workers on `h` when it holds `k` shards"), `T ≥ 0`:
//!
//! ```text
//! minimize T
//!   Σ_k s_{h,k} = 1                                     ∀h   (one shard count per host)
//!   L_h · s_{h,k} ≤ x_{h,k} ≤ X_h · s_{h,k}             ∀h,k (X_h = min(⌊G_h/g⌋, w): GPU packing)
//!   s_{h,k} = 0  for k < p − Σ_{h'≠h} Y_{h'}                   (shards the others cannot hold)
//!   Σ_{h,k} x_{h,k} = w,   Σ_{h,k} k·s_{h,k} = p             (covering: the job's demand)
//!   Σ_k (2M/p)/B_h · [ (p − 2k)·x_{h,k} + k·w·s_{h,k} ] ≤ T   ∀h  (NIC time, linear)
//! ```
//!
//! `L_h = max(0, w − Σ_{h'≠h} X_{h'})` is the number of workers host `h` must take because the
//! others cannot; these forced amounts are valid in every disjunct and close much of the gap
//! on nearly full clusters. When every `s_{h,·}` is 0/1 the NIC row is exactly `D_h/B_h`; the
//! CPU packing is in the range of `k`. Every integer placement is a feasible point (`s_{h,y_h} = 1`,
//! `x_{h,y_h} = x_h`), so **the LP optimum `T_LP(w,p)` is a lower bound** on the best integer
//! `T` for that `(w,p)`, and `t_c + T_LP` on its step time. Per host this is the convex hull of
//! `{(x, y, x·y)}` for integer `y` (tighter than McCormick); the relaxation still lets `x` be
//! fractional and lets hosts mix shard counts.
//!
//! # Rounding and completion
//!
//! The shard counts are the hard part; given them, each `D_h/B_h = a_h·x_h + c_h` is affine in
//! `x_h` and the best integer `x` is found **exactly**: the smallest candidate `T` (all values
//! `a_h·x + c_h`) for which each host's feasible interval `{x ∈ 0..=X_h : a_h x + c_h ≤ T}` is
//! non-empty and the intervals' bounds bracket `w`; the workers beyond the lower bounds go to
//! the hosts with the smallest slope `a_h` (least added traffic). This dominates rounding `x`.
//!
//! Randomized rounding of `y`: each host independently draws its shard count `k` with
//! probability `s_{h,k}` (the LP's distribution; `E[Σ y_h] = p`), from a `ChaCha8` stream
//! seeded by the caller's seed and `(w, p)`. **Repair**: while `Σy > p`, remove a shard from the
//! host most above its LP mean `ȳ_h = Σ_k k·s_{h,k}`; while `Σy < p`, add one to the host with
//! a free slot most below its mean (capacities are respected throughout, and a repair always
//! succeeds when `Σ_h Y_h ≥ p`). One more deterministic candidate is `⌊ȳ⌋` repaired the same
//! way. Of these `K + 1` candidates ([`PsOptions::roundings`] `= K`), the best few distinct
//! ones ([`PsOptions::local_search_starts`], 4 by default) are then improved by **shard
//! moves**: move one or more shards from one host to another with free CPU slots,
//! re-complete the workers exactly, keep the move if the step time drops, until no move helps
//! (multi-start local search from the LP's samples); the best result is kept. `ps-bench`
//! reports the plan with and without the moves.
//!
//! **Greedy** (the fallback, and a candidate of its own): fill hosts with the most free worker
//! slots first; then co-locate shards with the worker groups, one per group in order of group
//! size, round-robin, then on the hosts with the most free CPU slots. It is used when the LP
//! fails, and wins when it is strictly better than every rounding (method [`PsMethod::Greedy`]).
//!
//! # Choosing `w` and `p`
//!
//! Every `(w, p)` in the job's ranges that fits the free capacity is planned as above; the plan
//! maximizes throughput `w·b/S`. With [`PsJob::target_fraction`] `f < 1` it is the covering
//! variant: the fewest workers (then fewest shards) whose planned throughput reaches `f` times
//! the best planned throughput, which leaves GPUs for later arrivals. The LP bounds reported:
//! [`PsPlan::lp_bound_step_time_s`] `= t_c + min_p T_LP(w*, p)` at the chosen `w*` (a lower
//! bound on any placement's step time with `w*` workers) and [`PsPlan::lp_bound_throughput`]
//! `= max_{w,p} w·b/(t_c + T_LP(w,p))` (an upper bound on any placement's throughput). A
//! `(w,p)` whose LP fails contributes the trivial bound `T = 0`.
//!
//! # Online
//!
//! `converge_sim::ps_offline::place_ps_jobs_online` places arriving jobs one by one, as in Yu
//! et al.'s online setting: each job is planned on the capacity left by the earlier ones, which
//! is then reduced ([`commit_ps_plan`]) by its GPUs, CPU slots and its average NIC rate `D_h/S` on every host (bandwidth treated as a
//! reserved share, floored at [`MIN_RESIDUAL_NIC_FRACTION`] of the host's NIC). A job that does
//! not fit gets `None` (no queueing, no preemption, no resource prices).
//!
//! # Measured (`converge-sim ps-bench`, release build)
//!
//! On 1,000 seeded random small instances (2–4 hosts) the plan equals the exhaustive optimum
//! on 999 (worst 1.006×; over 8,000 instances of four seeds, at most 1.03×); the LP rounding
//! alone, without shard moves, misses it on ~0.5 % (worst 1.46×). Against the LP bound the
//! step time is within 1.25× on ~98 % of instances: the rest (up to ~2.7×) is the
//! relaxation's integrality gap, not the rounding (the exact optimum is as far from the
//! bound there), typically a shard that cannot sit with the workers (`p = 1`, or more shards
//! than the workers' hosts have CPU slots) and that the LP splits fractionally across hosts.
//!
//! Cost per job: one LP (`Σ_h 2(Y_h + 1)` variables) per `(w, p)` pair, plus the roundings
//! and moves, a fraction of a millisecond per pair on small clusters; pairs that cannot be
//! chosen are pruned (largest `w` first, against the LP's throughput bound). On 64 hosts a
//! fixed `(w, p) = (64, 8)` takes ~35 ms and the full ranges `w ≤ 64, p ≤ 8` ~7 s, so give
//! large jobs narrow ranges.
//!
//! # What is approximate
//!
//! The step-time model (no compute/communication overlap, no NIC contention between
//! directions, bandwidth sharing as reservations between jobs, no intra-host bus limit), the
//! randomized rounding (no approximation guarantee is proved here; quality is measured), and
//! the online policy (greedy per arrival, not the paper's primal-dual pricing). The LP bounds
//! and the exhaustive optimum (`converge_sim::ps_offline::optimal_ps_job`) are exact
//! statements about the model.
//!
//! Everything here is pure: no I/O, no clock, randomness only from the caller's seed (the LP
//! solver, `good_lp` with the pure-Rust `microlp` backend, runs without a time limit and is
//! deterministic). The offline research code (the exhaustive optimum, the online placement of
//! a job sequence, the seeded random instances) is in `converge_sim::ps_offline`; the bench
//! that prints and times it all is `converge-sim ps-bench`.

use std::collections::HashSet;
use std::ops::RangeInclusive;

use good_lp::{Expression, ProblemVariables, Solution as _, SolverModel as _, microlp, variable};
use rand::{Rng as _, SeedableRng as _};
use rand_chacha::ChaCha8Rng;

/// Randomized roundings per `(w, p)` pair, besides the deterministic one.
pub const DEFAULT_ROUNDINGS: usize = 32;

/// Distinct roundings per `(w, p)` pair improved by local search (the best ones).
pub const DEFAULT_LOCAL_SEARCH_STARTS: usize = 4;

/// In [`commit_ps_plan`] (and so in `converge_sim::ps_offline::place_ps_jobs_online`), a
/// host's NIC bandwidth left to later jobs never drops below this fraction of its original
/// bandwidth (so step times stay finite).
pub const MIN_RESIDUAL_NIC_FRACTION: f64 = 0.05;

/// Relative tolerance of throughput comparisons.
const REL_EPS: f64 = 1e-12;

/// A host's free capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsHost {
    /// Free GPUs (workers take [`PsJob::gpus_per_worker`] each).
    pub free_gpus: u32,
    /// Free CPU slots (a PS shard takes one).
    pub free_cpu_slots: u32,
    /// NIC bandwidth for both directions together, bytes/s. A host whose bandwidth is not a
    /// positive finite number is not used.
    pub nic_bytes_per_s: f64,
}

impl PsHost {
    /// A host with `free_gpus` GPUs, `free_cpu_slots` CPU slots and a NIC of
    /// `nic_bytes_per_s` bytes/s.
    pub fn new(free_gpus: u32, free_cpu_slots: u32, nic_bytes_per_s: f64) -> Self {
        Self {
            free_gpus,
            free_cpu_slots,
            nic_bytes_per_s,
        }
    }

    fn usable(&self) -> bool {
        self.nic_bytes_per_s.is_finite() && self.nic_bytes_per_s > 0.0
    }
}

/// A parameter-server job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsJob {
    /// Model size `M`, bytes (split evenly over the shards).
    pub model_bytes: f64,
    /// Compute time per step on each worker, `t_c`, seconds (positive).
    pub compute_s: f64,
    /// Samples each worker processes per step, `b` (positive).
    pub samples_per_worker: f64,
    /// GPUs per worker, `g` (at least 1).
    pub gpus_per_worker: u32,
    /// Fewest workers (at least 1).
    pub min_workers: u32,
    /// Most workers.
    pub max_workers: u32,
    /// Fewest PS shards (at least 1).
    pub min_shards: u32,
    /// Most PS shards.
    pub max_shards: u32,
    /// In `(0, 1]`: take the fewest workers (then shards) whose throughput is at least this
    /// fraction of the best planned throughput; 1 maximizes throughput.
    pub target_fraction: f64,
}

impl PsJob {
    /// A job with one GPU per worker, one sample per worker per step and `target_fraction` 1.
    pub fn new(
        model_bytes: f64,
        compute_s: f64,
        workers: RangeInclusive<u32>,
        shards: RangeInclusive<u32>,
    ) -> Self {
        Self {
            model_bytes,
            compute_s,
            samples_per_worker: 1.0,
            gpus_per_worker: 1,
            min_workers: *workers.start(),
            max_workers: *workers.end(),
            min_shards: *shards.start(),
            max_shards: *shards.end(),
            target_fraction: 1.0,
        }
    }

    /// Whether the job's fields are in range (finite sizes, positive compute and batch, at
    /// least one GPU per worker, non-empty worker and shard ranges starting at 1 or more,
    /// `target_fraction` in `(0, 1]`). Public for the exhaustive search in
    /// `converge_sim::ps_offline`.
    pub fn is_valid(&self) -> bool {
        self.model_bytes.is_finite()
            && self.model_bytes >= 0.0
            && self.compute_s.is_finite()
            && self.compute_s > 0.0
            && self.samples_per_worker.is_finite()
            && self.samples_per_worker > 0.0
            && self.gpus_per_worker >= 1
            && self.min_workers >= 1
            && self.min_workers <= self.max_workers
            && self.min_shards >= 1
            && self.min_shards <= self.max_shards
            && self.target_fraction > 0.0
            && self.target_fraction <= 1.0
    }

    fn throughput(&self, workers: u32, step_time_s: f64) -> f64 {
        f64::from(workers) * self.samples_per_worker / step_time_s
    }
}

/// How a plan was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PsMethod {
    /// LP relaxation, randomized rounding of the shard counts, exact worker completion.
    Lp,
    /// The greedy placement (LP failed, or greedy was strictly better).
    Greedy,
    /// Exhaustive search (`converge_sim::ps_offline::optimal_ps_job`).
    Exact,
}

/// A placement of one PS job.
#[derive(Debug, Clone, PartialEq)]
pub struct PsPlan {
    /// `(host index, workers)` for every host with workers, by host index.
    pub workers_per_host: Vec<(usize, u32)>,
    /// `(host index, shards)` for every host with shards, by host index.
    pub shards_per_host: Vec<(usize, u32)>,
    /// Workers `w`.
    pub workers: u32,
    /// PS shards `p`.
    pub shards: u32,
    /// Step time of this placement, seconds.
    pub step_time_s: f64,
    /// Lower bound on the step time of any placement with `workers` workers (and shards in
    /// the job's range): `t_c + min_p T_LP(workers, p)`, seconds. Plans of
    /// [`greedy_ps_job`] and `converge_sim::ps_offline::optimal_ps_job` carry the trivial
    /// bound `t_c`.
    pub lp_bound_step_time_s: f64,
    /// Throughput of this placement, samples/s.
    pub throughput: f64,
    /// Upper bound on the throughput of any placement of the job, samples/s (LP plans; other
    /// plans carry the trivial bound `w_max·b/t_c` over the feasible pairs).
    pub lp_bound_throughput: f64,
    /// `(w, p)` pairs whose LP relaxation failed to solve (they used the greedy plan and the
    /// trivial bound).
    pub lp_failures: u32,
    /// How the chosen placement was found.
    pub method: PsMethod,
}

impl PsPlan {
    /// Workers on host `h` (0 when none).
    pub fn workers_on(&self, h: usize) -> u32 {
        self.workers_per_host
            .iter()
            .find(|&&(i, _)| i == h)
            .map_or(0, |&(_, n)| n)
    }

    /// Shards on host `h` (0 when none).
    pub fn shards_on(&self, h: usize) -> u32 {
        self.shards_per_host
            .iter()
            .find(|&&(i, _)| i == h)
            .map_or(0, |&(_, n)| n)
    }

    /// Seconds per sample, `S / (w·b)` (the inverse of the throughput).
    pub fn time_per_sample_s(&self) -> f64 {
        1.0 / self.throughput
    }
}

/// Tuning of [`plan_ps_job_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PsOptions {
    /// Randomized roundings per `(w, p)` pair (`K`), besides the deterministic one.
    pub roundings: usize,
    /// Improve the best this many distinct roundings by shard moves (module docs); 0 turns
    /// the local search off.
    pub local_search_starts: usize,
}

impl Default for PsOptions {
    fn default() -> Self {
        Self {
            roundings: DEFAULT_ROUNDINGS,
            local_search_starts: DEFAULT_LOCAL_SEARCH_STARTS,
        }
    }
}

/// Bytes through host `h`'s NIC per step, `D_h`, with `x` workers and `y` shards on it and `w`
/// workers and `p` shards in all.
pub fn nic_bytes_per_step(job: &PsJob, workers: u32, shards: u32, x: u32, y: u32) -> f64 {
    if (x == 0 && y == 0) || shards == 0 {
        return 0.0;
    }
    let (w, p, x, y) = (
        f64::from(workers),
        f64::from(shards),
        f64::from(x),
        f64::from(y),
    );
    2.0 * job.model_bytes / p * (x * (p - y) + y * (w - x))
}

/// Step time in seconds of the placement `workers[h]`, `shards[h]` (indexed like `hosts`):
/// `t_c + max_h D_h / B_h`. Infinite without a shard or when a used host has no usable NIC.
pub fn step_time_s(hosts: &[PsHost], job: &PsJob, workers: &[u32], shards: &[u32]) -> f64 {
    let w: u32 = workers.iter().sum();
    let p: u32 = shards.iter().sum();
    if p == 0 || w == 0 {
        return f64::INFINITY;
    }
    let mut comm = 0.0f64;
    for (h, host) in hosts.iter().enumerate() {
        let (x, y) = (workers[h], shards[h]);
        let bytes = nic_bytes_per_step(job, w, p, x, y);
        if bytes > 0.0 {
            if !host.usable() {
                return f64::INFINITY;
            }
            comm = comm.max(bytes / host.nic_bytes_per_s);
        }
    }
    job.compute_s + comm
}

/// Worker slots of each host for `job`, capped at `cap` (0 on a host without a usable NIC).
/// Public for the exhaustive search in `converge_sim::ps_offline`.
pub fn worker_slots(hosts: &[PsHost], job: &PsJob, cap: u32) -> Vec<u32> {
    hosts
        .iter()
        .map(|h| {
            if h.usable() {
                (h.free_gpus / job.gpus_per_worker).min(cap)
            } else {
                0
            }
        })
        .collect()
}

/// Shard slots of each host, capped at `cap` (0 on a host without a usable NIC). Public for
/// the exhaustive search in `converge_sim::ps_offline`.
pub fn shard_slots(hosts: &[PsHost], cap: u32) -> Vec<u32> {
    hosts
        .iter()
        .map(|h| {
            if h.usable() {
                h.free_cpu_slots.min(cap)
            } else {
                0
            }
        })
        .collect()
}

fn total(v: &[u32]) -> u64 {
    v.iter().map(|&n| u64::from(n)).sum()
}

/// The LP relaxation's solution for one `(w, p)`.
#[derive(Debug, Clone)]
struct LpRelaxation {
    /// `T_LP`, seconds.
    comm_s: f64,
    /// Per host: the probability `s_{h,k}` of `k` shards, `k = 0..=Y_h`.
    shard_dist: Vec<Vec<f64>>,
    /// Per host: `ȳ_h = Σ_k k·s_{h,k}`.
    mean_shards: Vec<f64>,
    /// Per host: `x̄_h = Σ_k x_{h,k}`.
    mean_workers: Vec<f64>,
}

/// Solves the disjunctive LP relaxation (module docs) for fixed `w`, `p`; `xs`, `ys` are the
/// worker and shard slots, already capped at `w` and `p`.
fn solve_lp(
    hosts: &[PsHost],
    job: &PsJob,
    w: u32,
    p: u32,
    xs: &[u32],
    ys: &[u32],
) -> Option<LpRelaxation> {
    let mut vars = ProblemVariables::new();
    let t = vars.add(variable().min(0.0));
    // What each host must hold because the others cannot: L_h = w − Σ_{h'≠h} X_{h'} workers
    // and p − Σ_{h'≠h} Y_{h'} shards (valid in every disjunct).
    let (sum_x, sum_y) = (total(xs), total(ys));
    let min_x: Vec<u32> = xs
        .iter()
        .map(|&n| u64::from(w).saturating_sub(sum_x - u64::from(n)) as u32)
        .collect();
    let min_y: Vec<u32> = ys
        .iter()
        .map(|&n| u64::from(p).saturating_sub(sum_y - u64::from(n)) as u32)
        .collect();
    // Per host: (k, s_{h,k}, x_{h,k}) for k = 0..=Y_h; none for hosts with no slot at all.
    let mut per_host = Vec::with_capacity(hosts.len());
    for h in 0..hosts.len() {
        let mut ks = Vec::new();
        if xs[h] > 0 || ys[h] > 0 {
            for k in 0..=ys[h] {
                let most = if k < min_y[h] { 0.0 } else { 1.0 };
                let s = vars.add(variable().min(0.0).max(most));
                let x = vars.add(variable().min(0.0).max(f64::from(xs[h])));
                ks.push((k, s, x));
            }
        }
        per_host.push(ks);
    }
    let mut model = vars.minimise(t).using(microlp);
    let mut all_workers = Expression::with_capacity(hosts.len() * 4);
    let mut all_shards = Expression::with_capacity(hosts.len() * 4);
    let per_pair = 2.0 * job.model_bytes / f64::from(p);
    for (h, ks) in per_host.iter().enumerate() {
        if ks.is_empty() {
            continue;
        }
        let coef = per_pair / hosts[h].nic_bytes_per_s;
        let mut one = Expression::with_capacity(ks.len());
        let mut nic = Expression::with_capacity(2 * ks.len() + 1);
        for &(k, s, x) in ks {
            one.add_mul(1.0, s);
            let mut cap = Expression::with_capacity(2);
            cap.add_mul(1.0, x);
            cap.add_mul(-f64::from(xs[h]), s);
            model = model.with(cap.leq(0.0));
            if min_x[h] > 0 {
                let mut floor = Expression::with_capacity(2);
                floor.add_mul(1.0, x);
                floor.add_mul(-f64::from(min_x[h]), s);
                model = model.with(floor.geq(0.0));
            }
            all_workers.add_mul(1.0, x);
            all_shards.add_mul(f64::from(k), s);
            nic.add_mul(coef * (f64::from(p) - 2.0 * f64::from(k)), x);
            nic.add_mul(coef * f64::from(k) * f64::from(w), s);
        }
        nic.add_mul(-1.0, t);
        model = model.with(one.eq(1.0));
        model = model.with(nic.leq(0.0));
    }
    model = model.with(all_workers.eq(f64::from(w)));
    model = model.with(all_shards.eq(f64::from(p)));
    let solution = model.solve().ok()?;
    let comm_s = solution.value(t).max(0.0);
    if !comm_s.is_finite() {
        return None;
    }
    let mut shard_dist = Vec::with_capacity(hosts.len());
    let mut mean_shards = Vec::with_capacity(hosts.len());
    let mut mean_workers = Vec::with_capacity(hosts.len());
    for ks in &per_host {
        if ks.is_empty() {
            shard_dist.push(vec![1.0]);
            mean_shards.push(0.0);
            mean_workers.push(0.0);
            continue;
        }
        let dist: Vec<f64> = ks
            .iter()
            .map(|&(_, s, _)| solution.value(s).clamp(0.0, 1.0))
            .collect();
        mean_shards.push(
            ks.iter()
                .zip(&dist)
                .map(|(&(k, _, _), &q)| f64::from(k) * q)
                .sum(),
        );
        mean_workers.push(ks.iter().map(|&(_, _, x)| solution.value(x).max(0.0)).sum());
        shard_dist.push(dist);
    }
    Some(LpRelaxation {
        comm_s,
        shard_dist,
        mean_shards,
        mean_workers,
    })
}

/// Lower bound `T_LP(w, p)` (seconds of NIC time per step) from the LP relaxation, or `None`
/// when `(w, p)` does not fit the hosts or the LP fails. `t_c + T_LP` bounds the step time
/// of every placement of `w` workers and `p` shards from below.
pub fn lp_bound_comm_s(hosts: &[PsHost], job: &PsJob, w: u32, p: u32) -> Option<f64> {
    if !job.is_valid() || w == 0 || p == 0 {
        return None;
    }
    let xs = worker_slots(hosts, job, w);
    let ys = shard_slots(hosts, p);
    if total(&xs) < u64::from(w) || total(&ys) < u64::from(p) {
        return None;
    }
    solve_lp(hosts, job, w, p, &xs, &ys).map(|lp| lp.comm_s)
}

/// Host `h`'s NIC time as an affine function of its workers, `a_h·x + c_h` seconds, given
/// `y` shards on it.
fn host_affine(job: &PsJob, w: u32, p: u32, y: u32, nic: f64) -> (f64, f64) {
    let k = 2.0 * job.model_bytes / f64::from(p) / nic;
    (
        k * (f64::from(p) - 2.0 * f64::from(y)),
        k * f64::from(y) * f64::from(w),
    )
}

/// The best integer worker counts (min over placements of `max_h a_h·x_h + c_h`) with
/// `Σ x_h = w` and `x_h ≤ slots_h`, exactly (module docs, *Rounding and completion*).
fn complete_workers(affine: &[(f64, f64)], slots: &[u32], w: u32) -> Option<Vec<u32>> {
    if total(slots) < u64::from(w) {
        return None;
    }
    let f = |h: usize, x: u32| affine[h].0 * f64::from(x) + affine[h].1;
    let mut candidates: Vec<f64> = (0..slots.len())
        .flat_map(|h| (0..=slots[h]).map(move |x| (h, x)))
        .map(|(h, x)| f(h, x))
        .collect();
    candidates.sort_by(f64::total_cmp);
    candidates.dedup();
    // Each host's interval {x : f(h, x) ≤ t}, or None when some host has none or the
    // intervals cannot hold w workers.
    let intervals = |t: f64| -> Option<Vec<(u32, u32)>> {
        let mut out = Vec::with_capacity(slots.len());
        let (mut lo_sum, mut hi_sum) = (0u64, 0u64);
        for (h, &slot) in slots.iter().enumerate() {
            let mut range: Option<(u32, u32)> = None;
            for x in 0..=slot {
                if f(h, x) <= t {
                    range = Some(range.map_or((x, x), |(lo, _)| (lo, x)));
                }
            }
            let (lo, hi) = range?;
            lo_sum += u64::from(lo);
            hi_sum += u64::from(hi);
            out.push((lo, hi));
        }
        (lo_sum <= u64::from(w) && u64::from(w) <= hi_sum).then_some(out)
    };
    // Feasibility is monotone in t; the largest candidate is feasible.
    let (mut lo, mut hi) = (0usize, candidates.len().checked_sub(1)?);
    intervals(candidates[hi])?;
    while lo < hi {
        let mid = (lo + hi) / 2;
        if intervals(candidates[mid]).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let bounds = intervals(candidates[lo])?;
    let mut x: Vec<u32> = bounds.iter().map(|&(l, _)| l).collect();
    let mut left = w - x.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by(|&a, &b| affine[a].0.total_cmp(&affine[b].0).then(a.cmp(&b)));
    for h in order {
        let add = left.min(bounds[h].1 - bounds[h].0);
        x[h] += add;
        left -= add;
    }
    (left == 0).then_some(x)
}

/// Makes `Σ y = p` within `0 ≤ y_h ≤ ys_h`, moving the hosts farthest from their LP means.
fn repair_shards(y: &mut [u32], lp: &LpRelaxation, ys: &[u32], p: u32) -> bool {
    let mut sum: u32 = y.iter().sum();
    while sum > p {
        let Some(h) = (0..y.len()).filter(|&h| y[h] > 0).max_by(|&a, &b| {
            let da = f64::from(y[a]) - lp.mean_shards[a];
            let db = f64::from(y[b]) - lp.mean_shards[b];
            da.total_cmp(&db).then(b.cmp(&a))
        }) else {
            return false;
        };
        y[h] -= 1;
        sum -= 1;
    }
    while sum < p {
        let Some(h) = (0..y.len()).filter(|&h| y[h] < ys[h]).max_by(|&a, &b| {
            let da = lp.mean_shards[a] - f64::from(y[a]);
            let db = lp.mean_shards[b] - f64::from(y[b]);
            da.total_cmp(&db)
                .then(lp.mean_workers[a].total_cmp(&lp.mean_workers[b]))
                .then(b.cmp(&a))
        }) else {
            return false;
        };
        y[h] += 1;
        sum += 1;
    }
    true
}

/// One randomized rounding: host `h` gets `k` shards with probability `s_{h,k}`.
fn sample_shards(lp: &LpRelaxation, rng: &mut ChaCha8Rng) -> Vec<u32> {
    lp.shard_dist
        .iter()
        .map(|dist| {
            let mass: f64 = dist.iter().sum();
            let u = rng.r#gen::<f64>() * mass;
            let mut acc = 0.0;
            let mut pick = 0usize;
            for (k, &q) in dist.iter().enumerate() {
                if q > 0.0 {
                    pick = k;
                }
                acc += q;
                if u < acc && q > 0.0 {
                    break;
                }
            }
            pick as u32
        })
        .collect()
}

/// The greedy placement for fixed `(w, p)`: workers on the hosts with the most worker slots
/// first, then shards co-located with the worker groups round-robin (largest group first),
/// then on the hosts with the most free CPU slots.
fn greedy_fixed(xs: &[u32], ys: &[u32], w: u32, p: u32) -> Option<(Vec<u32>, Vec<u32>)> {
    let n = xs.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| xs[b].cmp(&xs[a]).then(ys[b].cmp(&ys[a])).then(a.cmp(&b)));
    let mut x = vec![0u32; n];
    let mut left = w;
    for &h in &order {
        let add = left.min(xs[h]);
        x[h] = add;
        left -= add;
    }
    if left > 0 {
        return None;
    }
    let mut y = vec![0u32; n];
    let mut left = p;
    let mut groups: Vec<usize> = (0..n).filter(|&h| x[h] > 0).collect();
    groups.sort_by(|&a, &b| x[b].cmp(&x[a]).then(a.cmp(&b)));
    let mut others: Vec<usize> = (0..n).filter(|&h| x[h] == 0).collect();
    others.sort_by(|&a, &b| ys[b].cmp(&ys[a]).then(a.cmp(&b)));
    for set in [&groups, &others] {
        loop {
            let mut placed = false;
            for &h in set.iter() {
                if left > 0 && y[h] < ys[h] {
                    y[h] += 1;
                    left -= 1;
                    placed = true;
                }
            }
            if !placed || left == 0 {
                break;
            }
        }
    }
    (left == 0).then_some((x, y))
}

/// The outcome for one `(w, p)` pair: a placement with `w` workers and `p` shards. Public
/// (with [`feasible_pairs`], [`select`] and [`trivial_plan`]) so that other planners over the
/// same pairs, such as the exhaustive search in `converge_sim::ps_offline`, choose `(w, p)`
/// exactly as [`plan_ps_job`] does.
#[derive(Debug, Clone)]
pub struct PairResult {
    /// Workers `w`.
    pub w: u32,
    /// PS shards `p`.
    pub p: u32,
    /// Workers per host, indexed like the hosts.
    pub workers: Vec<u32>,
    /// Shards per host, indexed like the hosts.
    pub shards: Vec<u32>,
    /// Step time of this placement, seconds.
    pub step_time_s: f64,
    /// How the placement was found.
    pub method: PsMethod,
}

/// The `(w, p)` pairs of the job that fit the hosts' capacity, with the capped slots:
/// `(w, p, worker slots per host capped at w, shard slots per host capped at p)`; empty when
/// the job is invalid. Public for the exhaustive search in `converge_sim::ps_offline`.
pub fn feasible_pairs(hosts: &[PsHost], job: &PsJob) -> Vec<(u32, u32, Vec<u32>, Vec<u32>)> {
    let mut out = Vec::new();
    if !job.is_valid() {
        return out;
    }
    let all_x = worker_slots(hosts, job, job.max_workers);
    let all_y = shard_slots(hosts, job.max_shards);
    let max_w = job
        .max_workers
        .min(total(&all_x).min(u64::from(u32::MAX)) as u32);
    let max_p = job
        .max_shards
        .min(total(&all_y).min(u64::from(u32::MAX)) as u32);
    for w in job.min_workers..=max_w {
        let xs: Vec<u32> = all_x.iter().map(|&n| n.min(w)).collect();
        for p in job.min_shards..=max_p {
            let ys: Vec<u32> = all_y.iter().map(|&n| n.min(p)).collect();
            out.push((w, p, xs.clone(), ys));
        }
    }
    out
}

/// The best workers for the shard counts `y` ([`complete_workers`]) and the step time.
fn complete_and_time(
    hosts: &[PsHost],
    job: &PsJob,
    (w, p): (u32, u32),
    xs: &[u32],
    y: &[u32],
) -> Option<(Vec<u32>, f64)> {
    let affine: Vec<(f64, f64)> = hosts
        .iter()
        .zip(y)
        .map(|(host, &yh)| {
            if host.usable() {
                host_affine(job, w, p, yh, host.nic_bytes_per_s)
            } else {
                (0.0, 0.0)
            }
        })
        .collect();
    let x = complete_workers(&affine, xs, w)?;
    let step = step_time_s(hosts, job, &x, y);
    Some((x, step))
}

/// Local improvement of a rounded plan: move `m ≥ 1` shards from one host to another (within
/// the CPU slots), re-complete the workers exactly, keep the move if the step time drops;
/// repeat until no move helps (at most `4·p·hosts` moves).
fn move_shards(
    hosts: &[PsHost],
    job: &PsJob,
    (w, p): (u32, u32),
    xs: &[u32],
    ys: &[u32],
    start: (Vec<u32>, Vec<u32>, f64),
) -> (Vec<u32>, Vec<u32>, f64) {
    let (mut x, mut y, mut step) = start;
    let n = hosts.len();
    for _ in 0..4 * p as usize * n {
        let mut improved = false;
        'search: for from in 0..n {
            if y[from] == 0 {
                continue;
            }
            for to in 0..n {
                if to == from || y[to] >= ys[to] {
                    continue;
                }
                for m in 1..=y[from].min(ys[to] - y[to]) {
                    let mut moved = y.clone();
                    moved[from] -= m;
                    moved[to] += m;
                    if let Some((mx, ms)) = complete_and_time(hosts, job, (w, p), xs, &moved)
                        && ms < step * (1.0 - REL_EPS)
                    {
                        (x, y, step) = (mx, moved, ms);
                        improved = true;
                        break 'search;
                    }
                }
            }
        }
        if !improved {
            break;
        }
    }
    (x, y, step)
}

/// Rounds the LP relaxation `lp` of `(w, p)` (when it was solved), improves the best
/// roundings by shard moves, and keeps the better of that and the greedy plan.
fn plan_pair(
    hosts: &[PsHost],
    job: &PsJob,
    (w, p): (u32, u32),
    (xs, ys): (&[u32], &[u32]),
    lp: Option<LpRelaxation>,
    seed: u64,
    opts: &PsOptions,
) -> Option<PairResult> {
    let mut best: Option<(Vec<u32>, Vec<u32>, f64)> = None;
    if let Some(lp) = &lp {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream((u64::from(w) << 32) | u64::from(p));
        let mut tried: HashSet<Vec<u32>> = HashSet::new();
        let mut rounded: Vec<(Vec<u32>, Vec<u32>, f64)> = Vec::new();
        for r in 0..=opts.roundings {
            let mut y = if r == 0 {
                lp.mean_shards
                    .iter()
                    .zip(ys)
                    .map(|(&m, &cap)| ((m + 1e-9).floor().max(0.0) as u32).min(cap))
                    .collect()
            } else {
                sample_shards(lp, &mut rng)
            };
            if !repair_shards(&mut y, lp, ys, p) || !tried.insert(y.clone()) {
                continue;
            }
            if let Some((x, step)) = complete_and_time(hosts, job, (w, p), xs, &y) {
                rounded.push((x, y, step));
            }
        }
        // Local search from the best few distinct roundings (multi-start).
        rounded.sort_by(|a, b| a.2.total_cmp(&b.2));
        for (i, candidate) in rounded.into_iter().enumerate() {
            let candidate = if i < opts.local_search_starts {
                move_shards(hosts, job, (w, p), xs, ys, candidate)
            } else {
                candidate
            };
            if best.as_ref().is_none_or(|b| candidate.2 < b.2) {
                best = Some(candidate);
            }
        }
    }
    let greedy = greedy_fixed(xs, ys, w, p).map(|(x, y)| {
        let step = step_time_s(hosts, job, &x, &y);
        (x, y, step)
    });
    let (chosen, method) = match (best, greedy) {
        (Some(b), Some(g)) if g.2 < b.2 => (g, PsMethod::Greedy),
        (Some(b), _) => (b, PsMethod::Lp),
        (None, Some(g)) => (g, PsMethod::Greedy),
        (None, None) => return None,
    };
    Some(PairResult {
        w,
        p,
        workers: chosen.0,
        shards: chosen.1,
        step_time_s: chosen.2,
        method,
    })
}

/// Picks the pair by the job's objective: among the pairs whose throughput reaches
/// `target_fraction` of the best, the fewest workers, then the fewest shards, then the
/// highest throughput. `None` when no pair has a positive throughput. Public for the
/// exhaustive search in `converge_sim::ps_offline`.
pub fn select<'a>(job: &PsJob, results: &'a [PairResult]) -> Option<&'a PairResult> {
    let thr = |r: &PairResult| job.throughput(r.w, r.step_time_s);
    let best = results.iter().map(thr).fold(0.0f64, f64::max);
    if best <= 0.0 {
        return None;
    }
    let floor = job.target_fraction * best * (1.0 - REL_EPS);
    results.iter().filter(|r| thr(r) >= floor).min_by(|a, b| {
        a.w.cmp(&b.w)
            .then(a.p.cmp(&b.p))
            .then(thr(b).total_cmp(&thr(a)))
    })
}

fn to_plan(
    job: &PsJob,
    r: &PairResult,
    lp_bound_step_time_s: f64,
    lp_bound_throughput: f64,
    lp_failures: u32,
) -> PsPlan {
    let nonzero = |v: &[u32]| -> Vec<(usize, u32)> {
        v.iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0)
            .map(|(h, &n)| (h, n))
            .collect()
    };
    PsPlan {
        workers_per_host: nonzero(&r.workers),
        shards_per_host: nonzero(&r.shards),
        workers: r.w,
        shards: r.p,
        step_time_s: r.step_time_s,
        lp_bound_step_time_s,
        throughput: job.throughput(r.w, r.step_time_s),
        lp_bound_throughput,
        lp_failures,
        method: r.method,
    }
}

/// The plan of the chosen pair `r` of `results` with the trivial bounds (no network time),
/// for plans found without the LP, labelled `method`. Public for the exhaustive search in
/// `converge_sim::ps_offline`.
pub fn trivial_plan(
    job: &PsJob,
    results: &[PairResult],
    r: &PairResult,
    method: PsMethod,
) -> PsPlan {
    let best_w = results.iter().map(|r| r.w).max().unwrap_or(r.w);
    let mut plan = to_plan(
        job,
        r,
        job.compute_s,
        job.throughput(best_w, job.compute_s),
        0,
    );
    plan.method = method;
    plan
}

/// Plans one PS job on `hosts` (free capacity) with [`PsOptions::default`]: LP relaxation,
/// randomized rounding (seeded by `seed`) and the greedy fallback, over every `(w, p)` in
/// the job's ranges. `None` when the job is invalid or its minimum does not fit.
pub fn plan_ps_job(hosts: &[PsHost], job: &PsJob, seed: u64) -> Option<PsPlan> {
    plan_ps_job_with(hosts, job, seed, &PsOptions::default())
}

/// [`plan_ps_job`] with explicit options.
pub fn plan_ps_job_with(
    hosts: &[PsHost],
    job: &PsJob,
    seed: u64,
    opts: &PsOptions,
) -> Option<PsPlan> {
    plan_ps_job_impl(hosts, job, seed, opts, true)
}

fn plan_ps_job_impl(
    hosts: &[PsHost],
    job: &PsJob,
    seed: u64,
    opts: &PsOptions,
    prune: bool,
) -> Option<PsPlan> {
    // Largest w first, so that a good throughput is known early: a pair whose throughput
    // bound (w·b/t_c before its LP, w·b/(t_c + T_LP) after) is below the target fraction of
    // the best plan so far can be neither chosen nor the best, and is not rounded. This
    // pruning does not change the result.
    let mut pairs = feasible_pairs(hosts, job);
    pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut results: Vec<PairResult> = Vec::new();
    // (w, T_LP or None when the LP failed) of every pair whose LP was solved or tried.
    let mut bounds: Vec<(u32, Option<f64>)> = Vec::new();
    let mut best = 0.0f64;
    for (w, p, xs, ys) in pairs {
        let cut = if prune {
            job.target_fraction * best * (1.0 - 1e-9)
        } else {
            0.0
        };
        if job.throughput(w, job.compute_s) < cut {
            continue;
        }
        let lp = solve_lp(hosts, job, w, p, &xs, &ys);
        let lp_comm = lp.as_ref().map(|l| l.comm_s);
        bounds.push((w, lp_comm));
        if job.throughput(w, job.compute_s + lp_comm.unwrap_or(0.0)) < cut {
            continue;
        }
        if let Some(r) = plan_pair(hosts, job, (w, p), (&xs, &ys), lp, seed, opts) {
            best = best.max(job.throughput(r.w, r.step_time_s));
            results.push(r);
        }
    }
    let chosen = select(job, &results)?;
    let lp_bound_step_time_s = job.compute_s
        + bounds
            .iter()
            .filter(|b| b.0 == chosen.w)
            .map(|b| b.1.unwrap_or(0.0))
            .fold(f64::INFINITY, f64::min);
    let lp_bound_throughput = bounds
        .iter()
        .map(|b| job.throughput(b.0, job.compute_s + b.1.unwrap_or(0.0)))
        .fold(0.0, f64::max);
    let failures = bounds.iter().filter(|b| b.1.is_none()).count() as u32;
    Some(to_plan(
        job,
        chosen,
        lp_bound_step_time_s,
        lp_bound_throughput,
        failures,
    ))
}

/// The greedy placement alone (the baseline), over every `(w, p)` in the job's ranges, with
/// the same choice of `(w, p)` as [`plan_ps_job`]; its bounds are the trivial ones.
pub fn greedy_ps_job(hosts: &[PsHost], job: &PsJob) -> Option<PsPlan> {
    search_pairs(hosts, job, PsMethod::Greedy, |w, p, xs, ys| {
        let (x, y) = greedy_fixed(xs, ys, w, p)?;
        let step = step_time_s(hosts, job, &x, &y);
        Some((x, y, step))
    })
}

/// The plan, with the trivial bounds ([`trivial_plan`]), of the `(w, p)` that [`select`]
/// picks among the feasible pairs ([`feasible_pairs`]) that `place` places:
/// `place(w, p, xs, ys)`, given the pair and its worker and shard slots per host, returns
/// the workers and shards per host and the step time, or `None`. The search of
/// [`greedy_ps_job`] and of the simulator's exhaustive optimum.
pub fn search_pairs(
    hosts: &[PsHost],
    job: &PsJob,
    method: PsMethod,
    place: impl Fn(u32, u32, &[u32], &[u32]) -> Option<(Vec<u32>, Vec<u32>, f64)>,
) -> Option<PsPlan> {
    let results: Vec<PairResult> = feasible_pairs(hosts, job)
        .into_iter()
        .filter_map(|(w, p, xs, ys)| {
            let (x, y, step) = place(w, p, &xs, &ys)?;
            Some(PairResult {
                w,
                p,
                workers: x,
                shards: y,
                step_time_s: step,
                method,
            })
        })
        .collect();
    let chosen = select(job, &results)?;
    Some(trivial_plan(job, &results, chosen, method))
}

/// Reduces `hosts` by `plan` (GPUs, CPU slots, and the plan's average NIC rate `D_h/S`,
/// floored at [`MIN_RESIDUAL_NIC_FRACTION`] of `original`'s bandwidth).
pub fn commit_ps_plan(hosts: &mut [PsHost], original: &[PsHost], job: &PsJob, plan: &PsPlan) {
    for (h, host) in hosts.iter_mut().enumerate() {
        let (x, y) = (plan.workers_on(h), plan.shards_on(h));
        if x == 0 && y == 0 {
            continue;
        }
        host.free_gpus = host.free_gpus.saturating_sub(x * job.gpus_per_worker);
        host.free_cpu_slots = host.free_cpu_slots.saturating_sub(y);
        let rate = nic_bytes_per_step(job, plan.workers, plan.shards, x, y) / plan.step_time_s;
        let floor = MIN_RESIDUAL_NIC_FRACTION * original[h].nic_bytes_per_s;
        host.nic_bytes_per_s = (host.nic_bytes_per_s - rate).max(floor);
    }
}

/// Fixtures of the planner's tests and `converge-sim ps-bench`: seeded random instances and
/// the check that a plan respects capacity and its step time (feature `benchgen`, as
/// [`crate::benchgen`]; never in the allocator).
#[cfg(any(test, feature = "benchgen"))]
pub mod fixtures {
    use super::{PsHost, PsJob, PsPlan, step_time_s};
    use rand::Rng;
    use rand_chacha::ChaCha8Rng;

    /// NIC speeds of random hosts (bytes/s): 10, 25 and 100 GbE.
    pub const RANDOM_NICS: [f64; 3] = [1.25e9, 3.125e9, 12.5e9];

    /// A random host of a small instance (see [`random_instance`]).
    pub fn random_host(rng: &mut ChaCha8Rng) -> PsHost {
        PsHost::new(
            rng.gen_range(2..=8),
            rng.gen_range(2..=4),
            RANDOM_NICS[rng.gen_range(0..RANDOM_NICS.len())],
        )
    }

    /// A random job within `worker_slots` workers, `cpu_slots` shards and `most` workers.
    pub fn random_job(rng: &mut ChaCha8Rng, worker_slots: u32, cpu_slots: u32, most: u32) -> PsJob {
        let max_w = rng.gen_range(1..=worker_slots.clamp(1, most));
        let max_p = rng.gen_range(1..=cpu_slots.clamp(1, 4));
        PsJob {
            model_bytes: rng.gen_range(1e7f64.ln()..2e9f64.ln()).exp(),
            compute_s: rng.gen_range(0.05..1.0),
            samples_per_worker: 32.0,
            gpus_per_worker: 1,
            min_workers: rng.gen_range(1..=max_w),
            max_workers: max_w,
            min_shards: rng.gen_range(1..=max_p),
            max_shards: max_p,
            target_fraction: 1.0,
        }
    }

    /// A random small instance: 2–4 hosts of 2–8 GPUs, 2–4 CPU slots and a 10/25/100 GbE
    /// NIC; a job of 10 MB–2 GB (log-uniform), 0.05–1 s of compute per step, 1 GPU per worker
    /// (2 in one job in five), up to 12 workers and 4 shards within capacity.
    pub fn random_instance(rng: &mut ChaCha8Rng) -> (Vec<PsHost>, PsJob) {
        let n = rng.gen_range(2..=4);
        let hosts: Vec<PsHost> = (0..n).map(|_| random_host(rng)).collect();
        let g = if rng.gen_bool(0.2) { 2 } else { 1 };
        let slots: u32 = hosts.iter().map(|h| h.free_gpus / g).sum();
        let cpus: u32 = hosts.iter().map(|h| h.free_cpu_slots).sum();
        let mut job = random_job(rng, slots, cpus, 12);
        job.gpus_per_worker = g;
        (hosts, job)
    }

    /// Two hosts of 2 GPUs and 1 CPU slot on 10 GbE around a CPU-only host (4 slots) behind
    /// 1 GbE, and a job of 4 workers and 2 shards (1 GB of parameters, 0.2 s of compute per
    /// step): the best plan puts one shard with each pair of workers (3.2 s of NIC time per
    /// step), not on the CPU host (32 s).
    pub fn colocation_instance() -> ([PsHost; 3], PsJob) {
        const GBE10: f64 = 1.25e9;
        let hosts = [
            PsHost::new(2, 1, GBE10),
            PsHost::new(0, 4, GBE10 / 10.0),
            PsHost::new(2, 1, GBE10),
        ];
        (hosts, PsJob::new(1e9, 0.2, 4..=4, 2..=2))
    }

    /// Whether `a` and `b` agree to a relative 10⁻⁷.
    pub fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-7 * a.abs().max(b.abs()).max(1e-9)
    }

    /// Panics unless `plan` gives `job` a worker and shard count within its bounds, within
    /// every host's free GPUs and CPU slots, with the step time [`step_time_s`] computes.
    pub fn check_capacity(hosts: &[PsHost], job: &PsJob, plan: &PsPlan) {
        let w: u32 = plan.workers_per_host.iter().map(|&(_, n)| n).sum();
        let p: u32 = plan.shards_per_host.iter().map(|&(_, n)| n).sum();
        assert_eq!(w, plan.workers);
        assert_eq!(p, plan.shards);
        assert!((job.min_workers..=job.max_workers).contains(&w));
        assert!((job.min_shards..=job.max_shards).contains(&p));
        for &(h, n) in &plan.workers_per_host {
            assert!(n * job.gpus_per_worker <= hosts[h].free_gpus, "GPUs on {h}");
        }
        for &(h, n) in &plan.shards_per_host {
            assert!(n <= hosts[h].free_cpu_slots, "CPU slots on {h}");
        }
        let x: Vec<u32> = (0..hosts.len()).map(|h| plan.workers_on(h)).collect();
        let y: Vec<u32> = (0..hosts.len()).map(|h| plan.shards_on(h)).collect();
        assert!(close(step_time_s(hosts, job, &x, &y), plan.step_time_s));
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{check_capacity, close, random_instance};
    use super::*;

    const GBE10: f64 = 1.25e9;

    #[test]
    fn traffic_formula() {
        let job = PsJob::new(1e9, 0.1, 4..=4, 2..=2);
        // 4 workers, 2 shards; host with 1 worker and 1 shard: the worker talks to the other
        // shard (2M/p), the shard to the 3 other workers (3·2M/p).
        let d = nic_bytes_per_step(&job, 4, 2, 1, 1);
        assert!(close(d, 4.0 * 2.0 * 1e9 / 2.0));
        assert_eq!(nic_bytes_per_step(&job, 4, 2, 0, 0), 0.0);
        // Everything on one host: no network.
        assert_eq!(nic_bytes_per_step(&job, 4, 2, 4, 2), 0.0);
    }

    #[test]
    fn colocation_is_chosen_when_clearly_optimal() {
        // Host 0 holds all 4 workers and has a CPU slot; host 1 has spare CPU slots only. A
        // 1 GB model over 10 GbE: a remote shard costs 4·2 GB / 1.25 GB/s = 6.4 s per step,
        // a local one nothing.
        let hosts = [PsHost::new(4, 1, GBE10), PsHost::new(0, 4, GBE10)];
        let job = PsJob::new(1e9, 0.2, 4..=4, 1..=1);
        let plan = plan_ps_job(&hosts, &job, 7).unwrap();
        assert_eq!(plan.workers_per_host, vec![(0, 4)]);
        assert_eq!(plan.shards_per_host, vec![(0, 1)]);
        assert!(close(plan.step_time_s, 0.2));
        assert!(close(plan.lp_bound_step_time_s, 0.2));
        assert_eq!(plan.method, PsMethod::Lp);
        check_capacity(&hosts, &job, &plan);

        // One shard with each pair of workers, not on the CPU host.
        let (hosts, job) = fixtures::colocation_instance();
        let plan = plan_ps_job(&hosts, &job, 7).unwrap();
        assert_eq!(plan.workers_per_host, vec![(0, 2), (2, 2)]);
        assert_eq!(plan.shards_per_host, vec![(0, 1), (2, 1)]);
        assert!(close(plan.step_time_s, 0.2 + 3.2));
        // That this is the exhaustive optimum is tested in `converge_sim::ps_offline`.
    }

    #[test]
    fn chooses_workers_by_throughput() {
        // Compute-bound job: more workers always help, so it takes them all.
        let hosts = [PsHost::new(4, 2, GBE10), PsHost::new(4, 2, GBE10)];
        let job = PsJob::new(1e6, 1.0, 1..=8, 1..=2);
        let plan = plan_ps_job(&hosts, &job, 1).unwrap();
        assert_eq!(plan.workers, 8);
        // With target 0.5 fewer workers do.
        let half = PsJob {
            target_fraction: 0.5,
            ..job
        };
        let plan_half = plan_ps_job(&hosts, &half, 1).unwrap();
        assert!(plan_half.workers < 8);
        assert!(plan_half.throughput >= 0.5 * plan.throughput * (1.0 - 1e-9));
    }

    #[test]
    fn invalid_or_unfit_jobs_are_refused() {
        let hosts = [PsHost::new(2, 1, GBE10)];
        assert!(plan_ps_job(&hosts, &PsJob::new(1e9, 0.1, 3..=4, 1..=1), 1).is_none());
        assert!(plan_ps_job(&hosts, &PsJob::new(1e9, 0.1, 1..=1, 2..=2), 1).is_none());
        assert!(plan_ps_job(&hosts, &PsJob::new(1e9, 0.0, 1..=1, 1..=1), 1).is_none());
        let reversed = PsJob {
            min_workers: 2,
            max_workers: 1,
            ..PsJob::new(1e9, 0.1, 1..=1, 1..=1)
        };
        assert!(plan_ps_job(&hosts, &reversed, 1).is_none());
        // A host without a usable NIC is not used.
        let hosts = [PsHost::new(8, 8, 0.0)];
        assert!(plan_ps_job(&hosts, &PsJob::new(1e9, 0.1, 1..=1, 1..=1), 1).is_none());
    }

    #[test]
    fn deterministic_for_a_seed() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for i in 0..10 {
            let (hosts, job) = random_instance(&mut rng);
            assert_eq!(plan_ps_job(&hosts, &job, i), plan_ps_job(&hosts, &job, i));
        }
    }

    #[test]
    fn pruning_does_not_change_the_plan() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for i in 0..40 {
            let (hosts, mut job) = random_instance(&mut rng);
            job.target_fraction = [1.0, 0.9, 0.6][i % 3];
            let opts = PsOptions::default();
            let pruned = plan_ps_job_impl(&hosts, &job, i as u64, &opts, true).unwrap();
            let full = plan_ps_job_impl(&hosts, &job, i as u64, &opts, false).unwrap();
            assert_eq!(pruned.workers, full.workers);
            assert_eq!(pruned.shards, full.shards);
            assert!(close(pruned.step_time_s, full.step_time_s));
            assert!(close(pruned.lp_bound_throughput, full.lp_bound_throughput));
            assert!(close(
                pruned.lp_bound_step_time_s,
                full.lp_bound_step_time_s
            ));
        }
    }

    #[test]
    fn worker_completion_is_exact() {
        // Against brute force on the affine functions.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for _ in 0..200 {
            let n = rng.gen_range(1..=4);
            let slots: Vec<u32> = (0..n).map(|_| rng.gen_range(0..=4)).collect();
            let affine: Vec<(f64, f64)> = (0..n)
                .map(|_| (rng.gen_range(-2.0..2.0), rng.gen_range(0.0..3.0)))
                .collect();
            let w = rng.gen_range(1..=6);
            let eval = |x: &[u32]| {
                x.iter()
                    .enumerate()
                    .map(|(h, &xh)| affine[h].0 * f64::from(xh) + affine[h].1)
                    .fold(f64::NEG_INFINITY, f64::max)
            };
            let mut best = f64::INFINITY;
            for x in compositions(&slots, w) {
                best = best.min(eval(&x));
            }
            match complete_workers(&affine, &slots, w) {
                Some(x) => {
                    assert_eq!(x.iter().sum::<u32>(), w);
                    assert!(x.iter().zip(&slots).all(|(a, b)| a <= b));
                    assert!(close(eval(&x), best), "{} vs {best}", eval(&x));
                }
                None => assert!(best.is_infinite()),
            }
        }
    }

    /// Every `v` with `v_h ≤ caps_h` and `Σ v = sum`, by brute force (the exhaustive
    /// search's enumerator is `converge_sim::ps_offline`'s).
    fn compositions(caps: &[u32], sum: u32) -> Vec<Vec<u32>> {
        let mut all = vec![Vec::new()];
        for &cap in caps {
            all = all
                .into_iter()
                .flat_map(|v: Vec<u32>| {
                    (0..=cap).map(move |n| {
                        let mut v = v.clone();
                        v.push(n);
                        v
                    })
                })
                .collect();
        }
        all.retain(|v| v.iter().sum::<u32>() == sum);
        all
    }
}
