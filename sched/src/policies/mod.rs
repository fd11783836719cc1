//! Every scheduling policy behind one trait, [`Policy`], so that the allocator service and the
//! trace-driven simulator run the same code and can swap policies by name ([`by_name`]).
//!
//! | name | policy | source |
//! |---|---|---|
//! | `fifo` | [`Fifo`]: strict first-in first-out, non-preemptive, requested size | Gavel's `FIFOPolicy` (Narayanan et al., OSDI'20) |
//! | `fair` | [`Fair`]: equal share, work-conserving water-filling | SLAQ's fair baseline (Zhang et al., SoCC'17) |
//! | `tiresias` | [`Tiresias`]: discretized 2D least-attained-service, gang | Gu et al., NSDI'19, as in the Pollux simulator |
//! | `optimus` | [`Optimus`]: greedy by remaining-time reduction with an oracle | Peng et al., EuroSys'18, Pollux's "Optimus+Oracle" |
//! | `quality` | [`Quality`]: the SLAQ quality policy of [`quality`] | Zhang et al., SoCC'17 |
//! | `sia` | [`Sia`]: one (GPU type, GPU count) per job by a MILP over normalized goodput | Jayaram Subramanya et al., SOSP'23 |
//! | `sjf-bco` | [`SjfBco`]: smallest estimated job first, gang, non-preemptive, backfilling (pair with BCO placement) | Yu, Ji, Rajan, Liu, MobiHoc'22 |
//!
//! Every policy is **pure**: the decision is a function of the [`ClusterView`] and the jobs
//! only (no I/O, no clock, no randomness), and does not depend on the order of the jobs
//! (every ordering is by `submitted_at`, then id). Ids are expected to be unique; if one
//! appears more than once only its first occurrence in arrival order counts.
//!
//! Every policy upholds the contract of [`Policy::allocate`]: every job appears in the
//! decision, each with 0 workers or between its minimum (`min_workers`, 0 counting as 1) and
//! `max_workers`, and the GPUs handed out (`workers × gpus_per_worker`) sum to at most
//! `total_gpus`. A job that can never run (`gpus_per_worker == 0`, or `max_workers` below its
//! minimum) gets 0 from every policy.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use converge_common::JobId;
use serde::{Deserialize, Serialize};

use crate::fit::Curve;
use crate::goodput::GoodputFn;

pub mod fair;
pub mod fifo;
pub mod optimus;
pub mod pollux;
pub mod quality;
pub mod sia;
pub mod sjf_bco;
pub mod tiresias;

pub use fair::Fair;
pub use fifo::Fifo;
pub use optimus::Optimus;
pub use pollux::Pollux;
pub use quality::{Objective, PolicyParams, Quality, quality_allocate};
pub use sia::Sia;
pub use sjf_bco::SjfBco;
pub use tiresias::{TIRESIAS_QUEUE_THRESHOLD_GPU_SECONDS, Tiresias};

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
    /// Whether the job's spec sets `workers` itself (else `requested_workers` is its
    /// default, `max_workers`): an exploratory job with no step time measured grows to it
    /// ([`quality`]'s trial growth rule), never to the default.
    pub workers_declared: bool,
    /// Service received so far, in GPU-seconds (Tiresias's attained service).
    pub attained_gpu_seconds: f64,
    /// Throughput with `w` workers at index `w − 1`, in progress units per second, when a
    /// model (or, in the simulator, an oracle) knows it; Optimus uses it.
    pub throughput: Option<Vec<f64>>,
    /// Work left, in the same progress units as `throughput` (Optimus's oracle).
    pub remaining_work: Option<f64>,
    /// Restarts so far (allocation changes after the first start).
    pub restarts: u32,
    /// Seconds of progress one restart costs this job (checkpoint, restart, rendezvous,
    /// until its first progress), measured from its own restarts; `None` before it has
    /// restarted (policies then assume their configured restart cost).
    pub restart_cost_s: Option<f64>,
    /// The job's goodput model, when its batch size adapts and the policy declares
    /// `goodput`: `throughput` then holds goodput (reference samples per second).
    pub goodput: Option<GoodputFn>,
    /// Workers per host now, as `(index into the hosts of`
    /// [`Policy::allocate_on_hosts`]`, workers)`; filled only for policies that declare
    /// `hosts`.
    pub current_hosts: Vec<(usize, u32)>,
    /// The hosts the job may use (its selector), as indices into the hosts of
    /// [`Policy::allocate_on_hosts`]; `None`: any host. Filled only for policies that
    /// declare `hosts` (the others get `max_workers` already capped at what these hosts
    /// hold, and placement keeps to them).
    pub eligible_hosts: Option<Vec<usize>>,
    /// Whether the job is exploratory (a sweep's trial without a target loss, or stop
    /// criteria without a target loss or declared work: `JobSpec::is_exploratory`); the default objective values it by
    /// its predicted loss reduction ([`Objective::Auto`]).
    pub exploratory: bool,
}

impl PolicyJob {
    /// A pending job `id` that nothing is known of yet: one 1-GPU worker, asked for and at
    /// most one, submitted at 0 s, no curve, measurement, model or history; not exploratory.
    /// Set the fields that matter with struct update syntax
    /// (`PolicyJob { max_workers: 4, ..PolicyJob::new(id) }`).
    pub fn new(id: JobId) -> Self {
        Self {
            id,
            gpus_per_worker: 1,
            min_workers: 1,
            max_workers: 1,
            current_workers: 0,
            submitted_at: 0.0,
            curve: None,
            samples: 0.0,
            loss_scale: 0.0,
            samples_per_s_per_worker: None,
            requested_workers: 1,
            workers_declared: false,
            attained_gpu_seconds: 0.0,
            throughput: None,
            remaining_work: None,
            restarts: 0,
            restart_cost_s: None,
            goodput: None,
            current_hosts: Vec::new(),
            eligible_hosts: None,
            exploratory: false,
        }
    }
}

/// The policy's decision: workers per job; every job appears, 0 = not admitted or pending.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Decision {
    pub workers: BTreeMap<JobId, u32>,
}

/// A decision that places too (Pollux's): workers per job and per host.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostDecision {
    /// Every job; 0 = not running.
    pub workers: BTreeMap<JobId, u32>,
    /// `(host index, workers)` per running job, hosts in index order, no zero counts.
    pub hosts: BTreeMap<JobId, Vec<(usize, u32)>>,
}

/// The GPUs of one type, for [`Policy::allocate_on_types`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTypePool {
    /// The type's name (the hosts' `gpu.type` label); `None`: hosts without one.
    pub name: Option<String>,
    /// GPUs of this type in the cluster.
    pub gpus: u32,
    /// Hosts with GPUs of this type.
    pub nodes: u32,
    /// GPUs of the largest such host.
    pub gpus_per_node: u32,
}

/// What a type-aware policy knows of one job's GPU types, indexed like the pools of
/// [`Policy::allocate_on_types`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JobTypes {
    /// The job's throughput on each type relative to what its throughput table and goodput
    /// model describe (1: that type; 2: twice as fast), from its measured or projected speeds
    /// ([`crate::gpu_types`]); `None` where not known.
    pub factors: Vec<Option<f64>>,
    /// The type it runs on now; `None` when pending.
    pub current: Option<usize>,
    /// GPUs of each type the job may use (all of them, unless its selector restricts it).
    pub eligible_gpus: Vec<u32>,
    /// The job's throughput table on each type (samples/s with 1, 2, … workers, as
    /// [`PolicyJob::throughput`]): its model with the compute time divided by the type's
    /// factor and the synchronization kept ([`crate::throughput::ThroughputModel::on_faster_gpu`]),
    /// at that type's GPUs per host and in the micro-batch the type holds; computed when first
    /// read ([`TypeTable::get`]). Empty, or `None` for a type, where not known: a policy then
    /// scales the job's table by the factor.
    pub tables: Vec<Option<TypeTable>>,
}

/// A job's throughput table on one GPU type ([`JobTypes::tables`]), computed on first use:
/// a decision on a cluster of several types builds one per job and type, and a policy reads
/// few of them (`quality` those of the type each job is assigned), so computing them all
/// would cost a batch-size search per job, type and count.
#[derive(Debug, Clone, PartialEq)]
pub struct TypeTable {
    /// The goodput the table is computed from; `None`: given as values
    /// ([`TypeTable::from_values`]).
    rate: Option<crate::goodput::GoodputFn>,
    most: u32,
    gpus_per_worker: u32,
    gpus_per_node: u32,
    contention: f64,
    table: std::cell::OnceCell<Vec<f64>>,
}

impl TypeTable {
    /// The table of `rate` (goodput at the best batch) for 1..=`most` workers of
    /// `gpus_per_worker` GPUs, packed on hosts of `gpus_per_node` GPUs, a partial multi-node
    /// count divided by `1 + contention`.
    pub fn new(
        rate: crate::goodput::GoodputFn,
        most: u32,
        gpus_per_worker: u32,
        gpus_per_node: u32,
        contention: f64,
    ) -> Self {
        Self {
            rate: Some(rate),
            most,
            gpus_per_worker,
            gpus_per_node,
            contention,
            table: std::cell::OnceCell::new(),
        }
    }

    /// A table given as its values (samples/s with 1, 2, … workers).
    pub fn from_values(values: Vec<f64>) -> Self {
        Self {
            rate: None,
            most: values.len() as u32,
            gpus_per_worker: 1,
            gpus_per_node: 1,
            contention: 0.0,
            table: values.into(),
        }
    }

    /// Samples/s with `w` workers (`None` beyond the table): read from the table once it is
    /// computed, else computed for `w` alone, so that a caller reading one count of many
    /// types' tables does not pay a whole table per type.
    pub fn at(&self, w: u32) -> Option<f64> {
        if w == 0 || w > self.most {
            return None;
        }
        if let Some(table) = self.table.get() {
            return table.get(w as usize - 1).copied();
        }
        let rate = self.rate.as_ref()?;
        Some(crate::decide::table_entry(
            w,
            self.gpus_per_worker,
            self.gpus_per_node,
            self.contention,
            |w, n| rate.best(w, n).map_or(0.0, |(_, v)| v),
        ))
    }

    /// Samples/s with 1, 2, … workers (computed on the first call).
    pub fn get(&self) -> &[f64] {
        self.table.get_or_init(|| {
            let Some(rate) = &self.rate else {
                return Vec::new();
            };
            crate::decide::table_by_workers(
                self.most,
                self.gpus_per_worker,
                self.gpus_per_node,
                self.contention,
                |w, n| rate.best(w, n).map_or(0.0, |(_, v)| v),
            )
        })
    }
}

/// A decision that picks each job's GPU type (Sia's): workers per job and the type of
/// each running job.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TypeDecision {
    /// Every job; 0 = not running.
    pub workers: BTreeMap<JobId, u32>,
    /// Index into the pools of [`Policy::allocate_on_types`] of each job with workers.
    pub types: BTreeMap<JobId, usize>,
}

/// What every policy sees of the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterView {
    /// GPUs the policy may hand out.
    pub total_gpus: u32,
    /// GPUs per node (placement is not the policies' business; none of the current policies
    /// uses it).
    pub gpus_per_node: u32,
    /// The time of the decision, in seconds, same clock as [`PolicyJob::submitted_at`].
    pub now: f64,
}

/// What a policy reads beyond every job's bounds, current size, arrival and progress. The
/// callers compute only what is asked for (a curve fit costs time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyInputs {
    /// Fitted loss curves and loss scales.
    pub curves: bool,
    /// Throughput tables from each job's fitted throughput model, and its estimated work
    /// left ([`crate::decide::JobView::remaining_work`]).
    pub estimates: bool,
    /// The true throughput and work left, where the caller knows them ([`crate::decide::Oracle`]; only the
    /// simulator does). Takes the place of the estimates for jobs that have an oracle.
    pub oracle: bool,
    /// Batch sizes that adapt: for a job that allows it
    /// ([`crate::decide::JobView::adaptive`]), `throughput` is goodput at the best batch for
    /// each world size and [`PolicyJob::goodput`] is set; the decision carries each placed
    /// adaptive job's batch plan ([`crate::decide::Allocation::batches`]).
    pub goodput: bool,
    /// The hosts: the policy places as well as sizes ([`Policy::allocate_on_hosts`]) and
    /// reads each job's [`PolicyJob::current_hosts`].
    pub hosts: bool,
    /// GPU types: on a cluster of several, the policy may pick each job's type itself
    /// ([`Policy::allocate_on_types`], from its measured or projected speeds,
    /// [`crate::gpu_types`]); if it does not, each job is placed on its fastest type with
    /// room. Without, on the type with the most free GPUs (a heterogeneity-unaware policy;
    /// its placements still use one type per job).
    pub gpu_types: bool,
}

/// A scheduling policy: decides how many workers each job gets.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The policy's name, one of [`POLICY_NAMES`].
    fn name(&self) -> &'static str;
    /// Workers per job (every job in `jobs` appears; 0 = not running). Must respect total
    /// GPUs (workers × gpus_per_worker summed ≤ total_gpus) and give each job 0 or between
    /// its min and max workers.
    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision;
    /// What the policy reads beyond bounds, sizes, arrival and progress; callers fill only
    /// that ([`crate::decide::decide`]). Default: nothing more.
    fn inputs(&self) -> PolicyInputs {
        PolicyInputs::default()
    }
    /// Whether the policy may give a running job another size than it has (elastic
    /// resizing). Queues ([`crate::decide::decide_queued`]) shrink such a job towards its
    /// minimum before they preempt it; a policy that runs jobs at their requested size
    /// (fifo, tiresias, sjf-bco) keeps a job at its size or preempts it whole. Default: true.
    fn resizes_running_jobs(&self) -> bool {
        true
    }
    /// For policies that declare `hosts`: workers per job and per host, on hosts of
    /// `host_gpus[i]` GPUs each (capacity and bounds as for [`Policy::allocate`]). `None`
    /// (the default) leaves placement to [`crate::placement`].
    fn allocate_on_hosts(
        &self,
        _cluster: &ClusterView,
        _host_gpus: &[u32],
        _jobs: &[PolicyJob],
    ) -> Option<HostDecision> {
        None
    }
    /// For policies that declare `gpu_types`, on a cluster of several GPU types: workers
    /// per job and the type each runs on, on `pools` (capacity and bounds as for
    /// [`Policy::allocate`], and per type at most its GPUs). `types` is indexed like `jobs`.
    /// `None` (the default) leaves the type to [`crate::placement`] (each job's fastest type
    /// with room).
    fn allocate_on_types(
        &self,
        _cluster: &ClusterView,
        _pools: &[GpuTypePool],
        _jobs: &[PolicyJob],
        _types: &[JobTypes],
    ) -> Option<TypeDecision> {
        None
    }
}

/// The names [`by_name`] accepts.
pub const POLICY_NAMES: [&str; 8] = [
    "fifo", "fair", "tiresias", "optimus", "quality", "sjf-bco", "pollux", "sia",
];

/// A policy name that [`by_name`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown policy {name:?}; valid policies: fifo, fair, tiresias, optimus, quality, sjf-bco, pollux, sia"
)]
pub struct UnknownPolicy {
    /// The name asked for.
    pub name: String,
}

/// The policy called `name` (one of [`POLICY_NAMES`], exact spelling) with its default
/// settings; `quality` are the settings of the quality policy.
pub fn by_name(name: &str, quality: PolicyParams) -> Result<Box<dyn Policy>, UnknownPolicy> {
    Ok(match name {
        "fifo" => Box::new(Fifo),
        "fair" => Box::new(Fair),
        "tiresias" => Box::new(Tiresias::default()),
        "optimus" => Box::new(Optimus),
        "quality" => Box::new(Quality { params: quality }),
        "sjf-bco" => Box::new(SjfBco),
        "pollux" => Box::new(Pollux::default()),
        "sia" => Box::new(Sia::default()),
        _ => {
            return Err(UnknownPolicy {
                name: name.to_owned(),
            });
        }
    })
}

/// Assigns each sized job (`(index, workers)`) one GPU type of `pools` so that the sum of
/// `value(index, workers, pool)` is large (`None`: the job cannot use that pool), per pool
/// at most its GPUs (`gpus_of(index, workers, pool)` each: a job may need fewer GPUs of a
/// faster type). Returns each sized job's pool, `None` when none had room.
///
/// 1. **Greedy**: jobs by regret per GPU (their best value minus their second best, divided
///    by the GPUs they take on their best pool: a multiple-choice knapsack's greedy by
///    density; a job with one usable pool first), each to its best pool with room, else to
///    its next best. By regret alone a large job that gains a little per GPU took a small
///    fast pool before several small jobs that gain more per GPU there; on the Sia traces
///    ordering by regret per GPU took `quality`'s mean JCT from 2,945 / 3,261 s to 2,898 /
///    3,179 s on Helios / newTrace (Philly 2,534 s, unchanged).
/// 2. **Exchanges**: for every pair of pools and every pair of sizes (GPUs on the first,
///    GPUs on the second), the jobs of those sizes on either pool are re-split between the
///    two, the same number on each, by the difference
///    of their values there (largest difference on the first pool). Capacity is unchanged
///    and, for two pools, this is the best split of those jobs; repeated over all pairs
///    until nothing changes (at most four rounds).
///
/// `O(rounds · pools² · jobs · log jobs)`: for the exact optimum a MILP (multiple-choice
/// knapsack) took minutes on 500 jobs with `microlp`.
pub fn assign_gpu_types(
    pools: &[GpuTypePool],
    sized: &[(usize, u32)],
    gpus_of: impl Fn(usize, u32, usize) -> u32,
    value: impl Fn(usize, u32, usize) -> Option<f64>,
) -> Vec<Option<usize>> {
    let n = sized.len();
    // values[k][t]: job k's value on pool t (None: unusable).
    let values: Vec<Vec<Option<f64>>> = sized
        .iter()
        .map(|&(i, w)| {
            (0..pools.len())
                .map(|t| value(i, w, t).filter(|v| v.is_finite()))
                .collect()
        })
        .collect();
    // size[k][t]: job k's GPUs on pool t.
    let size: Vec<Vec<u32>> = sized
        .iter()
        .map(|&(i, w)| (0..pools.len()).map(|t| gpus_of(i, w, t)).collect())
        .collect();
    let largest = |k: usize| size[k].iter().copied().max().unwrap_or(0);
    let regret = |k: usize| {
        let mut vs: Vec<f64> = values[k].iter().flatten().copied().collect();
        vs.sort_by(|a, b| b.total_cmp(a));
        match vs.as_slice() {
            [] => f64::NEG_INFINITY,
            [_] => f64::INFINITY,
            [a, b, ..] => a - b,
        }
    };
    // Regret per GPU the job takes on its best pool: a pool's GPUs go first to the jobs
    // that lose most per GPU without them (a multiple-choice knapsack's greedy by density).
    let best_size = |k: usize| {
        values[k]
            .iter()
            .enumerate()
            .filter_map(|(t, v)| Some((t, (*v)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
            .map_or(1, |(t, _)| size[k][t].max(1))
    };
    let regrets: Vec<f64> = (0..n)
        .map(|k| regret(k) / f64::from(best_size(k)))
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        regrets[b]
            .total_cmp(&regrets[a])
            .then(largest(b).cmp(&largest(a)))
            .then(a.cmp(&b))
    });
    let mut left: Vec<u32> = pools.iter().map(|p| p.gpus).collect();
    let mut out = vec![None; n];
    for k in order {
        let mut opts: Vec<(usize, f64)> = values[k]
            .iter()
            .enumerate()
            .filter_map(|(t, v)| Some((t, (*v)?)))
            .collect();
        opts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(&(t, _)) = opts.iter().find(|&&(t, _)| left[t] >= size[k][t]) {
            left[t] -= size[k][t];
            out[k] = Some(t);
        }
    }
    // Exchanges between pairs of pools, per pair of sizes (on the one, on the other).
    for _round in 0..4 {
        let mut changed = false;
        for t in 0..pools.len() {
            for u in t + 1..pools.len() {
                let mut by_size: std::collections::BTreeMap<(u32, u32), Vec<usize>> =
                    std::collections::BTreeMap::new();
                for k in 0..n {
                    if (out[k] == Some(t) || out[k] == Some(u))
                        && values[k][t].is_some()
                        && values[k][u].is_some()
                    {
                        by_size.entry((size[k][t], size[k][u])).or_default().push(k);
                    }
                }
                for jobs in by_size.values_mut() {
                    let on_t = jobs.iter().filter(|&&k| out[k] == Some(t)).count();
                    let diff = |k: usize| values[k][t].unwrap_or(0.0) - values[k][u].unwrap_or(0.0);
                    jobs.sort_by(|&a, &b| diff(b).total_cmp(&diff(a)).then(a.cmp(&b)));
                    let value_on = |k: usize, p: usize| values[k][p].unwrap_or(0.0);
                    let before: f64 = jobs.iter().map(|&k| value_on(k, out[k].unwrap_or(t))).sum();
                    let after: f64 = jobs
                        .iter()
                        .enumerate()
                        .map(|(rank, &k)| value_on(k, if rank < on_t { t } else { u }))
                        .sum();
                    // Only a strict gain re-splits (ties keep every job where it is).
                    if after > before + 1e-9 * before.abs().max(1.0) {
                        for (rank, &k) in jobs.iter().enumerate() {
                            out[k] = Some(if rank < on_t { t } else { u });
                        }
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    out
}

/// Arrival order: by `submitted_at`, then id.
fn arrival_cmp(a: &PolicyJob, b: &PolicyJob) -> Ordering {
    a.submitted_at
        .total_cmp(&b.submitted_at)
        .then_with(|| a.id.cmp(&b.id))
}

/// Indices of `jobs` in arrival order, keeping only the first occurrence of each id.
fn arrival_order(jobs: &[PolicyJob]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| arrival_cmp(&jobs[a], &jobs[b]));
    let mut seen = BTreeSet::new();
    order.retain(|&i| seen.insert(&jobs[i].id));
    order
}

/// The fewest workers the job runs with, or `None` if it can never run (no GPUs per worker,
/// or a maximum below its minimum). Same rule as the quality policy.
fn minimum_workers(job: &PolicyJob) -> Option<u32> {
    let min = job.min_workers.max(1);
    (job.gpus_per_worker > 0 && min <= job.max_workers).then_some(min)
}

/// `requested_workers` clamped into the job's `[minimum, max_workers]`, or `None` if it can
/// never run.
fn requested_size(job: &PolicyJob) -> Option<u32> {
    minimum_workers(job).map(|min| job.requested_workers.clamp(min, job.max_workers))
}

/// GPUs used by `workers` workers of `job`.
fn gpus(job: &PolicyJob, workers: u32) -> u64 {
    u64::from(workers) * u64::from(job.gpus_per_worker)
}

/// The decision for the jobs in `order` (every distinct id), `workers` indexed like `jobs`.
/// Admits jobs in `order` at their minimum while the GPUs last (a job that does not fit
/// waits, later ones may still fit). Returns the workers per job and the GPUs left.
fn admit_minimums(jobs: &[PolicyJob], order: &[usize], total_gpus: u32) -> (Vec<u32>, u64) {
    let mut free = u64::from(total_gpus);
    let mut workers = vec![0u32; jobs.len()];
    for &i in order {
        if let Some(min) = minimum_workers(&jobs[i]) {
            let need = gpus(&jobs[i], min);
            if need <= free {
                workers[i] = min;
                free -= need;
            }
        }
    }
    (workers, free)
}

/// Gives each running job in `order` its current allocation back while the GPUs last (a
/// current size outside the job's bounds does not count). Returns the workers per job
/// (indexed like `jobs`) and the GPUs left. The first step of the non-preemptive policies.
fn keep_running(jobs: &[PolicyJob], order: &[usize], total_gpus: u32) -> (Vec<u32>, u64) {
    let mut free = u64::from(total_gpus);
    let mut workers = vec![0u32; jobs.len()];
    for &i in order {
        let job = &jobs[i];
        let current = job.current_workers;
        let valid = current > 0
            && minimum_workers(job).is_some_and(|min| (min..=job.max_workers).contains(&current));
        if valid && gpus(job, current) <= free {
            workers[i] = current;
            free -= gpus(job, current);
        }
    }
    (workers, free)
}

/// Gives each job of `queue` in turn its requested size where that fits in the `free`
/// GPUs, which it takes; a job that does not fit is passed over (backfilling). The
/// admission step of SJF-BCO and Tiresias.
fn backfill(
    jobs: &[PolicyJob],
    queue: impl IntoIterator<Item = usize>,
    workers: &mut [u32],
    free: &mut u64,
) {
    for i in queue {
        let Some(size) = requested_size(&jobs[i]) else {
            continue;
        };
        let need = gpus(&jobs[i], size);
        if need <= *free {
            workers[i] = size;
            *free -= need;
        }
    }
}

fn decision(jobs: &[PolicyJob], order: &[usize], workers: &[u32]) -> Decision {
    Decision {
        workers: order
            .iter()
            .map(|&i| (jobs[i].id.clone(), workers[i]))
            .collect(),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use converge_common::JobId;

    use super::*;

    /// A pending 1-GPU-per-worker job of 1 to `max_workers` workers asking for `requested`.
    pub fn job(name: &str, submitted_at: f64, requested: u32, max_workers: u32) -> PolicyJob {
        PolicyJob {
            max_workers,
            submitted_at,
            requested_workers: requested,
            ..PolicyJob::new(JobId::new(name).unwrap())
        }
    }

    pub fn cluster(total_gpus: u32) -> ClusterView {
        ClusterView {
            total_gpus,
            gpus_per_node: 8,
            now: 1000.0,
        }
    }

    /// Makes the jobs' current allocations valid and jointly within `total_gpus`.
    pub fn make_current_feasible(total_gpus: u32, jobs: &mut [PolicyJob]) {
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

    /// The decision as `(name, workers)` pairs in id order.
    pub fn pairs(decision: &Decision) -> Vec<(&str, u32)> {
        decision
            .workers
            .iter()
            .map(|(id, w)| (id.as_str(), *w))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use converge_common::JobId;
    use proptest::prelude::*;

    use super::test_support::{cluster, job, make_current_feasible};
    use super::*;

    fn pools(gpus: &[u32]) -> Vec<GpuTypePool> {
        gpus.iter()
            .enumerate()
            .map(|(i, &g)| GpuTypePool {
                name: Some(format!("t{i}")),
                gpus: g,
                nodes: 1,
                gpus_per_node: g,
            })
            .collect()
    }

    /// Each job goes where it gains most relative to the others (comparative advantage), not
    /// where it is fastest: both jobs are fastest on pool 1, which holds one of them; the one
    /// that gains more there (4x against 1.2x) gets it.
    #[test]
    fn gpu_types_go_by_comparative_advantage() {
        let pools = pools(&[1, 1]);
        let speed = [[1.0f64, 4.0], [1.0, 1.2]];
        let out = assign_gpu_types(
            &pools,
            &[(0, 1), (1, 1)],
            |_, w, _| w,
            |i, _, t| Some(speed[i][t].ln()),
        );
        assert_eq!(out, [Some(1), Some(0)]);
        // The same whatever the order of the jobs.
        let out = assign_gpu_types(
            &pools,
            &[(1, 1), (0, 1)],
            |_, w, _| w,
            |i, _, t| Some(speed[i][t].ln()),
        );
        assert_eq!(out, [Some(0), Some(1)]);
    }

    proptest! {
        /// On two pools with jobs of one size, the split is the best one for the number of
        /// jobs it puts on each pool (the exchanges' guarantee), checked against every split.
        #[test]
        fn gpu_type_exchanges_give_the_best_split_of_two_pools(
            values in proptest::collection::vec((0.0f64..5.0, 0.0f64..5.0), 1..8),
            caps in (0u32..5, 0u32..5),
        ) {
            let pools = pools(&[caps.0, caps.1]);
            let sized: Vec<(usize, u32)> = (0..values.len()).map(|i| (i, 1)).collect();
            let value = |i: usize, t: usize| if t == 0 { values[i].0 } else { values[i].1 };
            let out = assign_gpu_types(&pools, &sized, |_, w, _| w, |i, _, t| Some(value(i, t)));
            let on = |t: usize| out.iter().filter(|p| **p == Some(t)).count();
            prop_assert!(on(0) <= caps.0 as usize && on(1) <= caps.1 as usize);
            let ours: f64 = out.iter().enumerate().filter_map(|(k, t)| Some(value(k, (*t)?))).sum();
            // Every split of the placed jobs with the same counts per pool.
            let placed: Vec<usize> = (0..out.len()).filter(|&k| out[k].is_some()).collect();
            let mut best = f64::NEG_INFINITY;
            for mask in 0u32..(1 << placed.len()) {
                if mask.count_ones() as usize != on(0) {
                    continue;
                }
                let v: f64 = placed
                    .iter()
                    .enumerate()
                    .map(|(b, &k)| value(k, if mask & (1 << b) != 0 { 0 } else { 1 }))
                    .sum();
                best = best.max(v);
            }
            prop_assert!(ours >= best - 1e-9, "{out:?}: {ours} < {best}");
            // As many jobs placed as fit.
            prop_assert_eq!(placed.len(), values.len().min((caps.0 + caps.1) as usize));
        }
    }

    /// A pool's GPUs go first to the jobs that lose most per GPU without them: job 0 gains 4
    /// on the fast pool's two GPUs, jobs 1 and 2 gain 3 each on one GPU there. By regret
    /// alone job 0 went first and took both (4 in all); per GPU, jobs 1 and 2 take them (6).
    #[test]
    fn a_fast_pools_gpus_go_to_the_jobs_that_gain_most_per_gpu_there() {
        let pools = pools(&[8, 2]);
        let sized = [(0, 4), (1, 1), (2, 1)];
        let gpus = |i: usize, w: u32, t: usize| if t == 1 && i == 0 { 2 } else { w };
        let out = assign_gpu_types(&pools, &sized, gpus, |i, _, t| {
            Some([[0.0, 4.0], [0.0, 3.0], [0.0, 3.0]][i][t])
        });
        assert_eq!(out, [Some(0), Some(1), Some(1)]);
    }

    /// A job may need fewer GPUs of one pool than of another: capacity counts its GPUs on
    /// the pool it gets. Two 4-GPU jobs fit a pool of 2 GPUs (one GPU each there) and one
    /// of 4; exchanges only re-split jobs with the same sizes on both pools.
    #[test]
    fn gpu_type_assignment_counts_each_pools_own_size() {
        let pools = pools(&[4, 2]);
        let sized = [(0, 4), (1, 4), (2, 4)];
        let gpus = |_: usize, w: u32, t: usize| if t == 1 { w / 4 } else { w };
        let out = assign_gpu_types(&pools, &sized, gpus, |_, _, t| Some([0.0, 1.0][t]));
        let mut used = [0u32; 2];
        for (k, t) in out.iter().enumerate() {
            if let Some(t) = *t {
                used[t] += gpus(k, sized[k].1, t);
            }
        }
        assert_eq!(used, [4, 2], "{out:?}");
        assert_eq!(out.iter().filter(|t| **t == Some(1)).count(), 2, "{out:?}");
    }

    /// Exchanges re-split only jobs with the same sizes on both pools: job 1 gains more on
    /// pool 1 but needs 2 GPUs there, and pool 1 has 1; swapping it with job 0 (1 GPU
    /// there) would oversubscribe it.
    #[test]
    fn gpu_type_exchanges_keep_each_pools_own_sizes() {
        let pools = pools(&[8, 1]);
        let sized = [(0, 4), (1, 4)];
        let gpus = |i: usize, w: u32, t: usize| if t == 1 { [1, 2][i] } else { w };
        let out = assign_gpu_types(&pools, &sized, gpus, |i, _, t| {
            Some([[0.0, 1.0], [0.0, 10.0]][i][t])
        });
        assert_eq!(out, [Some(1), Some(0)]);
    }

    proptest! {
        /// With random sizes per pool and random values, no pool holds more than its GPUs.
        #[test]
        fn gpu_type_assignment_with_sizes_per_pool_never_oversubscribes(
            jobs in proptest::collection::vec(
                (proptest::collection::vec(1u32..6, 3), proptest::collection::vec(-2.0f64..3.0, 3)),
                1..12,
            ),
            caps in proptest::collection::vec(0u32..12, 3),
        ) {
            let pools = pools(&caps);
            let sized: Vec<(usize, u32)> = (0..jobs.len()).map(|i| (i, 1)).collect();
            let out = assign_gpu_types(
                &pools,
                &sized,
                |i, _, t| jobs[i].0[t],
                |i, _, t| Some(jobs[i].1[t]),
            );
            let mut used = [0u32; 3];
            for (k, t) in out.iter().enumerate() {
                if let Some(t) = *t {
                    used[t] += jobs[k].0[t];
                }
            }
            for t in 0..3 {
                prop_assert!(used[t] <= caps[t], "pool {t}: {} of {} ({out:?})", used[t], caps[t]);
            }
        }
    }

    /// A job with no usable pool, or no pool with room, gets none; the others still fit.
    #[test]
    fn gpu_type_assignment_never_oversubscribes_a_pool() {
        let pools = pools(&[4, 2]);
        let sized = [(0, 4), (1, 2), (2, 2), (3, 1)];
        let out = assign_gpu_types(
            &pools,
            &sized,
            |_, w, _| w,
            |i, _, t| (i != 3).then_some(if t == 1 { 1.0 } else { 0.0 }),
        );
        let mut used = [0u32; 2];
        for (k, t) in out.iter().enumerate() {
            if let Some(t) = t {
                used[*t] += sized[k].1;
            }
        }
        assert!(used[0] <= 4 && used[1] <= 2, "{out:?}");
        assert_eq!(out[3], None);
        assert_eq!(out.iter().flatten().count(), 2, "{out:?}");
    }

    #[test]
    fn every_name_builds_its_policy() {
        for name in POLICY_NAMES {
            let policy = by_name(name, PolicyParams::default()).unwrap();
            assert_eq!(policy.name(), name);
        }
    }

    #[test]
    fn unknown_names_are_refused_with_the_valid_ones() {
        let err = by_name("lottery", PolicyParams::default()).unwrap_err();
        assert_eq!(err.name, "lottery");
        let message = err.to_string();
        assert!(message.contains("lottery"), "{message}");
        for name in POLICY_NAMES {
            assert!(message.contains(name), "{message} lacks {name}");
        }
        assert!(by_name("FIFO", PolicyParams::default()).is_err());
    }

    #[test]
    fn every_policy_lists_every_job_even_with_no_gpus() {
        let jobs = [job("a", 0.0, 2, 4), job("b", 1.0, 1, 1)];
        for name in POLICY_NAMES {
            let decision = by_name(name, PolicyParams::default())
                .unwrap()
                .allocate(&cluster(0), &jobs);
            assert_eq!(decision.workers.len(), 2, "{name}");
            assert!(decision.workers.values().all(|&w| w == 0), "{name}");
        }
    }

    #[test]
    fn duplicate_ids_count_once() {
        let jobs = [job("a", 0.0, 2, 2), job("a", 1.0, 3, 3)];
        for name in POLICY_NAMES {
            let decision = by_name(name, PolicyParams::default())
                .unwrap()
                .allocate(&cluster(8), &jobs);
            assert_eq!(decision.workers.len(), 1, "{name}");
            assert!(decision.workers.values().all(|&w| w <= 2), "{name}");
        }
    }

    /// A monotone non-decreasing throughput table of `len` entries.
    fn throughput_table(len: usize) -> impl Strategy<Value = Vec<f64>> {
        (0.1..100.0f64, prop::collection::vec(0.0..50.0f64, len)).prop_map(|(first, steps)| {
            let mut table = Vec::with_capacity(steps.len());
            let mut current = first;
            for (i, step) in steps.into_iter().enumerate() {
                if i > 0 {
                    current += step;
                }
                table.push(current);
            }
            table
        })
    }

    /// A job as the property tests see it; `current_workers` is made feasible by
    /// [`arbitrary_cluster`].
    fn arbitrary_job(index: usize) -> impl Strategy<Value = PolicyJob> {
        (
            (1u32..=4, 0u32..=4, 0u32..=8, 0u32..=8, 0u32..=10),
            0u32..6,
            prop_oneof![Just(0.0), 0.0..2.0 * TIRESIAS_QUEUE_THRESHOLD_GPU_SECONDS],
            prop::option::of((0usize..14).prop_flat_map(throughput_table)),
            prop::option::of(prop_oneof![Just(0.0), 0.0..1e6f64]),
        )
            .prop_map(
                move |(
                    (gpus_per_worker, min, extra, current, requested),
                    submitted,
                    attained_gpu_seconds,
                    throughput,
                    remaining_work,
                )| PolicyJob {
                    gpus_per_worker,
                    min_workers: min,
                    // Now and then a maximum below the minimum (a job that can never run).
                    max_workers: if extra == 0 {
                        min.saturating_sub(1)
                    } else {
                        min + extra
                    },
                    current_workers: current,
                    submitted_at: f64::from(submitted),
                    requested_workers: requested,
                    attained_gpu_seconds,
                    throughput,
                    remaining_work,
                    ..PolicyJob::new(JobId::new(format!("job-{index}")).unwrap())
                },
            )
    }

    /// A cluster of 0..64 GPUs with 0..30 jobs whose current allocations fit.
    fn arbitrary_cluster() -> impl Strategy<Value = (ClusterView, Vec<PolicyJob>)> {
        (0u32..64, 0usize..30).prop_flat_map(|(total_gpus, count)| {
            let jobs: Vec<_> = (0..count).map(arbitrary_job).collect();
            jobs.prop_map(move |mut jobs| {
                make_current_feasible(total_gpus, &mut jobs);
                (cluster(total_gpus), jobs)
            })
        })
    }

    /// Every policy; Pollux with a short search (its cost grows with population ×
    /// generations × jobs × hosts, and the properties hold for any search length).
    fn all_policies() -> Vec<Box<dyn Policy>> {
        POLICY_NAMES
            .iter()
            .map(|&name| match name {
                "pollux" => Box::new(Pollux {
                    population: 8,
                    generations: 4,
                    ..Pollux::default()
                }) as Box<dyn Policy>,
                _ => by_name(name, PolicyParams::default()).unwrap(),
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn every_policy_respects_capacity_and_bounds((view, jobs) in arbitrary_cluster()) {
            for policy in all_policies() {
                let decision = policy.allocate(&view, &jobs);
                prop_assert_eq!(decision.workers.len(), jobs.len(), "{}", policy.name());
                let mut used = 0u64;
                for job in &jobs {
                    let workers = decision.workers[&job.id];
                    used += gpus(job, workers);
                    prop_assert!(
                        workers == 0
                            || (job.min_workers.max(1) <= workers && workers <= job.max_workers),
                        "{}: {} got {} workers", policy.name(), job.id, workers
                    );
                }
                prop_assert!(used <= u64::from(view.total_gpus), "{}: {} GPUs used", policy.name(), used);
            }
        }

        #[test]
        fn every_policy_is_deterministic_and_ignores_input_order(
            (view, jobs, shuffled) in arbitrary_cluster().prop_flat_map(|(view, jobs)| {
                (Just(view), Just(jobs.clone()), Just(jobs).prop_shuffle())
            })
        ) {
            for policy in all_policies() {
                let decision = policy.allocate(&view, &jobs);
                prop_assert_eq!(&decision, &policy.allocate(&view, &jobs), "{}", policy.name());
                prop_assert_eq!(&decision, &policy.allocate(&view, &shuffled), "{}", policy.name());
            }
        }

        #[test]
        fn applying_a_decision_and_deciding_again_changes_nothing(
            (view, jobs) in arbitrary_cluster()
        ) {
            // Not Sia: like its artifact it charges a restart only to a running job, so a
            // job it stopped is worth more in the next decision.
            for policy in all_policies().into_iter().filter(|p| p.name() != "sia") {
                let first = policy.allocate(&view, &jobs);
                let mut applied = jobs.clone();
                for job in &mut applied {
                    job.current_workers = first.workers[&job.id];
                }
                prop_assert_eq!(&first, &policy.allocate(&view, &applied), "{}", policy.name());
            }
        }
    }
}
