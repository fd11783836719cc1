//! Synthetic inputs for timing one allocation decision at scale: the jobs of a busy cluster
//! (as [`PolicyJob`]s with fitted curves, throughputs and loss scales), its hosts and the
//! jobs' current placements, generated deterministically from a seed. Used by the `criterion`
//! benchmark `sim/benches/decision.rs`, by the `converge-sim bench-decision`
//! command and by `converge-sim report` (its scale section), so all three time the same inputs.
//!
//! # The generated cluster
//!
//! - `nodes` hosts `node-00000`, `node-00001`, … with GPUs `0..gpus_per_node` each.
//! - Jobs `job-000000`, …: 1, 2, 4 or 8 GPUs per worker (40 / 25 / 20 / 15 %); a minimum of
//!   1, 2 or 4 workers (60 / 25 / 15 %, at most 2 for 8-GPU workers); a maximum of up to 32
//!   GPUs' worth of workers above the minimum.
//! - About 70 % of the jobs are running, with a current allocation between their minimum and
//!   maximum, placed on the hosts (in random order, each job from a random host onward, lowest
//!   free GPUs first, a worker never split across hosts), so the free GPUs are scattered the
//!   way churn leaves them. A running job that does not fit becomes pending.
//! - Running jobs have a fitted curve (97 %), pending ones sometimes (40 %: preempted jobs);
//!   the curve families are `inv_quadratic`, `inv_linear` and `exp` (40 / 35 / 25 %), with an
//!   initial loss of 0.3 to 10, an asymptote at 2 to 40 % of it and a half-life of 10⁴ to 10⁷
//!   samples. Curves are built directly from these parameters, not fitted.
//! - Throughput per worker 30 to 3,000 samples/s (unknown for new pending jobs), progress up
//!   to four half-lives, loss scale = the observed loss range (0 = unknown for 3 %).
//!
//! - With `gpu_types` > 1, host `n` is of type `type-{n mod gpu_types}`; each job belongs
//!   to one of 16 model families (by its id) whose speed on type `t` is 1 to 4 times its
//!   speed on `type-0`; a job with a measured rate measured its current type (running; a
//!   random one when pending) and, for half of them, one more type (±5 % noise), so the
//!   decision projects the rest ([`crate::gpu_types`]).
//!
//! [`DecisionInputs::with_batches`] gives the same jobs throughput models (and, for
//! [`BenchBatches::Adaptive`], batch limits and gradient statistics), so that the decision
//! with batch-size choice is timed side by side with the same decision at fixed batches.
//!
//! The decision timed is what the service does in one step ([`crate::schedule`]):
//! [`quality_allocate`] with the default [`PolicyParams`], then the placement requests in
//! priority order (running jobs first, then by arrival, then id) and [`place`].

use std::collections::BTreeMap;

use converge_common::{HostId, JobId, RankPlacement};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::decide::{
    AdaptiveBatch, Allocation, BatchSize, ClusterState, JobView, decide, priority_order,
};
use crate::fit::{Curve, CurveFamily};
use crate::goodput::{BatchLimits, GradientStats};
use crate::placement::PlacementKind;
use crate::placement::{HostFree, PlacementRequest, place};
use crate::policies::{ClusterView, Quality};
use crate::policies::{Decision, PolicyJob, PolicyParams, quality_allocate};
use crate::throughput::ThroughputModel;

/// The clock of the timed decision, seconds: the end of the submission window (running jobs
/// were submitted in `[0, 900,000)`, pending ones in `[800,000, 1,000,000)`), so that jobs
/// have their ages and the restart budget lets old jobs resize.
pub const DECISION_TIME_S: f64 = 1_000_000.0;

/// Size and seed of a generated cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchConfig {
    /// Active jobs (running and pending).
    pub jobs: usize,
    /// Hosts.
    pub nodes: u32,
    /// GPUs per host.
    pub gpus_per_node: u32,
    /// GPU types (1: one type, no `gpu.type`). With several, host `n` carries type
    /// `type-{n mod gpu_types}` and every job measured speeds per type (see the module docs).
    pub gpu_types: u32,
    /// Seed of the generator; the same seed gives the same inputs.
    pub seed: u64,
}

impl Default for BenchConfig {
    /// The scale target: 10,000 jobs on 12,500 nodes × 8 GPUs (100,000 GPUs).
    fn default() -> Self {
        Self {
            jobs: 10_000,
            nodes: 12_500,
            gpus_per_node: 8,
            gpu_types: 1,
            seed: 1,
        }
    }
}

/// What the generated jobs' views carry about throughput and batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BenchBatches {
    /// No throughput model (the policy scales each job's measured per-worker rate linearly):
    /// the inputs of [`DecisionInputs::generate`].
    #[default]
    Unmodelled,
    /// A throughput model per job (so the decision builds a throughput table for each) at a
    /// fixed per-worker batch of 32.
    Fixed,
    /// The same models, plus batch limits and gradient statistics: the decision builds
    /// goodput tables (the best batch at every world size) and a batch plan per placed job.
    Adaptive,
}

impl BenchBatches {
    /// All three, in table order.
    pub const ALL: [BenchBatches; 3] = [Self::Unmodelled, Self::Fixed, Self::Adaptive];

    /// A short name for tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unmodelled => "no throughput model",
            Self::Fixed => "throughput models, fixed batch",
            Self::Adaptive => "throughput models, batch-size choice",
        }
    }
}

/// Everything one decision needs (see the module documentation).
#[derive(Debug, Clone)]
pub struct DecisionInputs {
    /// The jobs as the policy sees them.
    pub jobs: Vec<PolicyJob>,
    /// Current placement of each job (same index as `jobs`; empty when pending).
    pub current: Vec<Vec<RankPlacement>>,
    /// Every host with all its GPUs.
    pub hosts: Vec<HostFree>,
    /// GPUs in the cluster.
    pub total_gpus: u32,
    /// Settings of the quality policy.
    pub params: PolicyParams,
    /// Indices of `jobs` in placement priority order: running first, then by arrival, then id.
    pub priority: Vec<usize>,
    /// The jobs as [`decide`] sees them (no throughput model, as `jobs` has no tables).
    pub views: Vec<JobView>,
}

impl DecisionInputs {
    /// Generates the inputs for `cfg` (deterministic in `cfg`).
    pub fn generate(cfg: &BenchConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let mut jobs: Vec<PolicyJob> = (0..cfg.jobs).map(|i| random_job(i, &mut rng)).collect();

        let width = cfg.nodes.saturating_sub(1).to_string().len().max(5);
        let hosts: Vec<HostFree> = (0..cfg.nodes)
            .map(|n| {
                let host = HostFree::new(
                    HostId::new(format!("node-{n:0width$}")).expect("valid host id"),
                    (0..cfg.gpus_per_node).collect(),
                );
                if cfg.gpu_types > 1 {
                    host.with_gpu_type(format!("type-{}", n % cfg.gpu_types))
                } else {
                    host
                }
            })
            .collect();
        let current = place_running(&mut jobs, &hosts, cfg.gpus_per_node, &mut rng);
        // GPU types draw from their own stream, so that one type leaves the inputs as they
        // were.
        let mut type_rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x7479_7065_7321);
        let types = cfg.gpu_types.max(1) as usize;
        let type_index = |placement: &[RankPlacement]| {
            let host = &placement.first()?.host;
            let n = hosts.binary_search_by(|h| h.host.cmp(host)).ok()?;
            Some(n % types)
        };

        let views: Vec<JobView> = jobs
            .iter()
            .zip(&current)
            .map(|(job, placement)| JobView {
                id: job.id.clone(),
                gpus_per_worker: job.gpus_per_worker,
                min_workers: job.min_workers,
                max_workers: job.max_workers,
                requested_workers: job.requested_workers,
                workers_declared: job.workers_declared,
                submitted_at: job.submitted_at,
                placement: placement.clone(),
                curve: job.curve.clone(),
                samples: job.samples,
                loss_scale: job.loss_scale,
                samples_per_s_per_worker: job.samples_per_s_per_worker,
                attained_gpu_seconds: job.attained_gpu_seconds,
                model: None,
                batch: BatchSize::PerWorker(crate::throughput::DEFAULT_PRIOR_LOCAL_BATCH),
                remaining_work: job.remaining_work,
                oracle: None,
                restarts: 0,
                restart_cost_s: None,
                adaptive: None,
                hosts: None,
                queue: crate::queues::default_queue(),
                priority: converge_common::PriorityClass::Normal,
                started_at: None,
                shadow: None,
                family: (types > 1).then(|| format!("model-{}", family_of(&job.id))),
                gpu_type_speeds: if types > 1 {
                    measured_speeds(job, type_index(placement), types, &mut type_rng)
                } else {
                    BTreeMap::new()
                },

                exploratory: false,
            })
            .collect();
        let priority = priority_order(&views);
        Self {
            views,
            jobs,
            current,
            hosts,
            total_gpus: cfg.nodes.saturating_mul(cfg.gpus_per_node),
            params: PolicyParams::default(),
            priority,
        }
    }

    /// The same jobs with `mode`'s throughput and batch knowledge in their views
    /// ([`BenchBatches`]); deterministic in `seed`. Per job: a step time of
    /// `θ_c·b + θ_0 + θ_intra·r(w) + θ_inter·r(w) + θ_α·(n−1)` with the compute per sample
    /// from its per-worker rate (30 to 3,000 samples/s at a batch of 32), a reference batch of
    /// 32 to 512 samples, at most 16 times that in total, 8 to 256 per worker, and a gradient
    /// noise scale of 10² to 10⁴ samples.
    pub fn with_batches(&self, mode: BenchBatches, seed: u64) -> Self {
        let mut out = self.clone();
        if mode == BenchBatches::Unmodelled {
            return out;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6261_7463_6865_7321);
        for view in &mut out.views {
            let rate = view
                .samples_per_s_per_worker
                .unwrap_or_else(|| 10f64.powf(rng.gen_range(1.5..3.5)));
            let step = 32.0 / rate;
            view.model = Some(ThroughputModel::from_coefficients(
                [0.8 * step / 32.0, 0.2 * step, 0.05 * step, 0.3 * step, 0.01],
                10,
            ));
            view.batch = BatchSize::PerWorker(32.0);
            if mode == BenchBatches::Adaptive {
                let reference = 32 * (1u32 << rng.gen_range(0..=4));
                let limits = BatchLimits::new(reference, reference * 16, 8, 256)
                    .expect("valid generated limits");
                let noise = 10f64.powf(rng.gen_range(2.0..4.0));
                view.adaptive = Some(AdaptiveBatch {
                    limits,
                    max_per_worker_by_type: BTreeMap::new(),
                    gradient: GradientStats::new(f64::from(reference), noise),
                });
            }
        }
        out
    }

    /// The policy step of the decision.
    pub fn allocate(&self) -> Decision {
        quality_allocate(
            &ClusterView {
                total_gpus: self.total_gpus,
                gpus_per_node: self.hosts.first().map_or(0, |h| h.gpus.len() as u32),
                now: DECISION_TIME_S,
            },
            &self.jobs,
            &self.params,
        )
    }

    /// The placement requests for `decision`, in priority order.
    pub fn requests(&self, decision: &Decision) -> Vec<PlacementRequest> {
        self.priority
            .iter()
            .map(|&i| {
                let job = &self.jobs[i];
                PlacementRequest {
                    job: job.id.clone(),
                    workers: decision.workers.get(&job.id).copied().unwrap_or(0),
                    gpus_per_worker: job.gpus_per_worker,
                    min_workers: job.min_workers,
                    current: self.current[i].clone(),
                    hosts: None,
                    gpu_type_speeds: BTreeMap::new(),
                    gpu_type: None,
                }
            })
            .collect()
    }

    /// The placement step of the decision, for prepared requests.
    pub fn place(&self, requests: &[PlacementRequest]) -> BTreeMap<JobId, Vec<RankPlacement>> {
        place(&self.hosts, requests)
    }

    /// One whole decision as the service takes it: [`decide`] with the quality policy and
    /// first-fit placement (the same result as [`DecisionInputs::allocate`], then
    /// [`DecisionInputs::requests`] and [`DecisionInputs::place`]).
    pub fn decide(&self) -> Allocation {
        decide(
            &ClusterState {
                now: DECISION_TIME_S,
                hosts: &self.hosts,
                contention_per_shared_job: 0.0,
            },
            &self.views,
            &Quality {
                params: self.params,
            },
            PlacementKind::FirstFit,
        )
    }

    /// Jobs with a current allocation.
    pub fn running(&self) -> usize {
        self.jobs.iter().filter(|j| j.current_workers > 0).count()
    }

    /// GPUs held by the current allocations.
    pub fn gpus_in_use(&self) -> u64 {
        self.jobs
            .iter()
            .map(|j| u64::from(j.current_workers) * u64::from(j.gpus_per_worker))
            .sum()
    }
}

/// Model families of the generated jobs on clusters of several GPU types.
const FAMILIES: u64 = 16;

/// A job's family, from its id (0..[`FAMILIES`]).
fn family_of(id: &JobId) -> u64 {
    id.as_str()
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
        % FAMILIES
}

/// Speed of family `f` on type `t` relative to type 0: 1 to 4, different per family, so
/// that families gain differently from each type.
fn type_factor(f: u64, t: usize) -> f64 {
    if t == 0 {
        1.0
    } else {
        1.0 + ((f * 7 + t as u64 * 5) % 13) as f64 / 4.0
    }
}

/// What a generated job measured per GPU type: on its current type (a running job) and, for
/// half of the jobs with a measured rate, on one other type; nothing for a job without a
/// rate.
fn measured_speeds(
    job: &PolicyJob,
    current: Option<usize>,
    types: usize,
    rng: &mut ChaCha8Rng,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(rate) = job.samples_per_s_per_worker else {
        return out;
    };
    let f = family_of(&job.id);
    let base = rate / type_factor(f, current.unwrap_or(0));
    let mut measured = vec![current.unwrap_or_else(|| rng.gen_range(0..types))];
    if rng.gen_bool(0.5) {
        measured.push(rng.gen_range(0..types));
    }
    for t in measured {
        let noise = rng.gen_range(0.95..1.05);
        out.insert(format!("type-{t}"), base * type_factor(f, t) * noise);
    }
    out
}

/// One job, not yet placed: `current_workers` is what it would like to run with now.
fn random_job(index: usize, rng: &mut ChaCha8Rng) -> PolicyJob {
    let gpus_per_worker = pick(rng, &[(1, 40), (2, 25), (4, 20), (8, 15)]);
    let min_workers =
        pick(rng, &[(1, 60), (2, 25), (4, 15)]).min(if gpus_per_worker == 8 { 2 } else { 4 });
    let max_workers = min_workers + rng.gen_range(0..=32 / gpus_per_worker);
    let running = rng.gen_bool(0.7);
    let current_workers = if running {
        rng.gen_range(min_workers..=max_workers)
    } else {
        0
    };
    let submitted_at = if running {
        rng.gen_range(0.0..900_000.0)
    } else {
        rng.gen_range(800_000.0..1_000_000.0)
    };
    let has_curve = rng.gen_bool(if running { 0.97 } else { 0.4 });
    let initial_loss = 10f64.powf(rng.gen_range(-0.5..1.0));
    let asymptote = initial_loss * rng.gen_range(0.02..0.4);
    let half_life = 10f64.powf(rng.gen_range(4.0..7.0));
    let rate = 10f64.powf(rng.gen_range(1.5..3.5));
    let (curve, samples, loss_scale, samples_per_s_per_worker) = if has_curve {
        let curve = random_curve(rng, initial_loss, asymptote, half_life);
        let samples = half_life * rng.gen_range(0.05..4.0);
        let observed = curve.predict(0.0) - curve.predict(samples);
        let loss_scale = if rng.gen_bool(0.03) {
            0.0
        } else {
            observed + initial_loss * rng.gen_range(0.0..0.1)
        };
        (Some(curve), samples, loss_scale, Some(rate))
    } else {
        let samples = half_life * rng.gen_range(0.0..0.05);
        let rate = (running || rng.gen_bool(0.5)).then_some(rate);
        (None, samples, 0.0, rate)
    };
    PolicyJob {
        gpus_per_worker,
        min_workers,
        max_workers,
        current_workers,
        submitted_at,
        curve,
        samples,
        loss_scale,
        samples_per_s_per_worker,
        requested_workers: max_workers,
        workers_declared: false,
        ..PolicyJob::new(JobId::new(format!("job-{index:06}")).expect("valid job id"))
    }
}

/// A curve of a random family starting at `initial_loss`, tending to `asymptote`, having
/// removed half of the removable loss after `half_life` samples.
fn random_curve(rng: &mut ChaCha8Rng, initial_loss: f64, asymptote: f64, half_life: f64) -> Curve {
    let removable = initial_loss - asymptote;
    let (family, params) = match pick(rng, &[(0, 40), (1, 35), (2, 25)]) {
        0 => {
            // 1/(a·k² + b·k + c) + d: the denominator doubles at the half-life.
            let c = 1.0 / removable;
            let linear_share = rng.gen_range(0.2..1.0);
            let b = c * linear_share / half_life;
            let a = c * (1.0 - linear_share) / (half_life * half_life);
            (CurveFamily::InvQuadratic, vec![a, b, c, asymptote])
        }
        1 => {
            let b = 1.0 / removable;
            (CurveFamily::InvLinear, vec![b / half_life, b, asymptote])
        }
        _ => (
            CurveFamily::Exp,
            vec![std::f64::consts::LN_2 / half_life, asymptote, removable],
        ),
    };
    Curve {
        family,
        params,
        rmse: removable * 0.01,
        points: 100,
    }
}

/// A value drawn with the given integer weights.
fn pick(rng: &mut ChaCha8Rng, weighted: &[(u32, u32)]) -> u32 {
    let total: u32 = weighted.iter().map(|(_, w)| w).sum();
    let mut draw = rng.gen_range(0..total);
    for &(value, weight) in weighted {
        if draw < weight {
            return value;
        }
        draw -= weight;
    }
    weighted[weighted.len() - 1].0
}

/// Places the running jobs (in random order, each from a random host onward) and returns
/// their placements; a job that does not fit whole is made pending.
fn place_running(
    jobs: &mut [PolicyJob],
    hosts: &[HostFree],
    gpus_per_node: u32,
    rng: &mut ChaCha8Rng,
) -> Vec<Vec<RankPlacement>> {
    let mut current = vec![Vec::new(); jobs.len()];
    let mut used = vec![vec![false; gpus_per_node as usize]; hosts.len()];
    let mut order: Vec<usize> = (0..jobs.len())
        .filter(|&i| jobs[i].current_workers > 0)
        .collect();
    order.shuffle(rng);
    for i in order {
        let job = &mut jobs[i];
        let per_worker = job.gpus_per_worker as usize;
        let mut ranks: Vec<RankPlacement> = Vec::new();
        if !hosts.is_empty() {
            let start = rng.gen_range(0..hosts.len());
            for offset in 0..hosts.len() {
                let h = (start + offset) % hosts.len();
                while ranks.len() < job.current_workers as usize {
                    let free: Vec<u32> = (0..gpus_per_node)
                        .filter(|&g| !used[h][g as usize])
                        .take(per_worker)
                        .collect();
                    if free.len() < per_worker {
                        break;
                    }
                    for &g in &free {
                        used[h][g as usize] = true;
                    }
                    ranks.push(RankPlacement {
                        rank: ranks.len() as u32,
                        host: hosts[h].host.clone(),
                        gpus: free,
                    });
                }
                if ranks.len() == job.current_workers as usize {
                    break;
                }
            }
        }
        if ranks.len() < job.current_workers as usize {
            for rank in &ranks {
                let h = hosts
                    .iter()
                    .position(|host| host.host == rank.host)
                    .expect("placed on a listed host");
                for &g in &rank.gpus {
                    used[h][g as usize] = false;
                }
            }
            job.current_workers = 0;
            ranks.clear();
        }
        current[i] = ranks;
    }
    current
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn small() -> BenchConfig {
        BenchConfig {
            jobs: 300,
            nodes: 300,
            gpus_per_node: 8,
            gpu_types: 1,
            seed: 7,
        }
    }

    #[test]
    fn inputs_are_deterministic_in_the_seed() {
        let a = DecisionInputs::generate(&small());
        let b = DecisionInputs::generate(&small());
        assert_eq!(a.jobs, b.jobs);
        assert_eq!(a.current, b.current);
        let c = DecisionInputs::generate(&BenchConfig { seed: 8, ..small() });
        assert_ne!(a.jobs, c.jobs);
    }

    #[test]
    fn current_placements_match_the_current_allocations_and_fit() {
        let inputs = DecisionInputs::generate(&small());
        let running = inputs.running() as f64 / inputs.jobs.len() as f64;
        assert!((0.6..0.8).contains(&running), "{running}");
        let mut used = BTreeSet::new();
        for (job, ranks) in inputs.jobs.iter().zip(&inputs.current) {
            assert_eq!(ranks.len() as u32, job.current_workers, "{}", job.id);
            assert!(
                job.current_workers == 0
                    || (job.min_workers..=job.max_workers).contains(&job.current_workers)
            );
            for (index, rank) in ranks.iter().enumerate() {
                assert_eq!(rank.rank as usize, index);
                assert_eq!(rank.gpus.len() as u32, job.gpus_per_worker);
                for &gpu in &rank.gpus {
                    assert!(gpu < 8);
                    assert!(used.insert((rank.host.clone(), gpu)), "GPU given twice");
                }
            }
        }
        assert_eq!(used.len() as u64, inputs.gpus_in_use());
    }

    #[test]
    fn running_jobs_that_keep_their_size_keep_their_placement() {
        let inputs = DecisionInputs::generate(&small());
        let allocation = inputs.decide();
        let (decision, placed) = (allocation.workers, allocation.placements);
        let mut kept = 0;
        for (job, current) in inputs.jobs.iter().zip(&inputs.current) {
            if job.current_workers > 0 && decision[&job.id] == job.current_workers {
                assert_eq!(&placed[&job.id], current, "{}", job.id);
                kept += 1;
            }
        }
        assert!(kept > 0);
    }

    #[test]
    fn decide_is_the_policy_then_the_placement() {
        for seed in [1, 2, 3] {
            let inputs = DecisionInputs::generate(&BenchConfig { seed, ..small() });
            let decision = inputs.allocate();
            let placed = inputs.place(&inputs.requests(&decision));
            let allocation = inputs.decide();
            assert_eq!(allocation.workers, decision.workers);
            assert_eq!(allocation.placements, placed);
        }
    }

    #[test]
    fn curves_start_at_the_initial_loss_and_decrease() {
        let inputs = DecisionInputs::generate(&small());
        let curves: Vec<&Curve> = inputs
            .jobs
            .iter()
            .filter_map(|j| j.curve.as_ref())
            .collect();
        for family in CurveFamily::ALL {
            assert!(curves.iter().any(|c| c.family == family), "{family:?}");
        }
        for curve in curves {
            let losses: Vec<f64> = [0.0, 1e4, 1e5, 1e6, 1e7, 1e9]
                .iter()
                .map(|&k| curve.predict(k))
                .collect();
            assert!(losses.windows(2).all(|w| w[1] <= w[0]), "{curve:?}");
            assert!(losses[0] > losses[5], "{curve:?}");
        }
    }
}
