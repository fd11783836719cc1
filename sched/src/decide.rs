//! The decision: job views → policy → placement requests and costs → placements. The one
//! function ([`decide`]) that the service's scheduling step ([`crate::schedule::step`]), the
//! simulator and the decision benchmarks call, so that a figure measured in the simulator is
//! a figure of the code the service runs.
//!
//! What differs between callers is only what they *observe* (the service reads progress
//! reports and telemetry, the simulator its simulated cluster): each builds the same
//! [`JobView`]s and [`ClusterState`] from its observations. What a policy is given is decided
//! here, from the inputs the policy declares ([`PolicyInputs`]), never from its name.
//!
//! # Steps
//!
//! 1. Jobs in priority order: running jobs (a non-empty current placement) first, then
//!    pending ones, each by `submitted_at`, then id.
//! 2. Each job's [`PolicyJob`]: its bounds, progress and fitted curve; its throughput table
//!    (samples/s with 1, 2, … workers, each world size packed onto the fewest hosts, at the
//!    per-worker batch its [`BatchSize`] gives) from its fitted [`ThroughputModel`] when the
//!    policy declares `estimates`, or the caller's oracle when the policy declares `oracle`
//!    and the caller has one (the simulator does; the service never does). Under BCO
//!    placement, a multi-host world size that leaves a host partly used expects the
//!    contention measured so far ([`ClusterState::contention_per_shared_job`]): its table
//!    entry is divided by `1 + contention`.
//! 3. The policy decides the workers per job ([`Policy::allocate`]).
//! 4. Placement requests in the priority order, with each placed job's [`JobCost`] at its
//!    decided size (from its model; the sync term at least the measured contention times the
//!    compute term), and [`place_with`].

use std::collections::{BTreeMap, BTreeSet};

use converge_common::{
    HostId, JobId, PriorityClass, QueueId, QueueSpec, QueueStatus, RankPlacement, ShadowAlgorithm,
};

use crate::contention::JobCost;
use crate::fit::Curve;
use crate::goodput::{BatchLimits, BatchPlan, GoodputFn, GradientStats};
use crate::placement::{HostFree, PlacementKind, PlacementRequest, place_with};
pub use crate::policies::PolicyInputs;
use crate::policies::{
    ClusterView, Decision, GpuTypePool, HostDecision, JobTypes, Policy, PolicyJob, TypeTable,
};
use crate::queues::{self, Held, QueueDemand, Running, Share};
use crate::throughput::{ThroughputModel, packed_nodes};

/// Largest world size a throughput table is computed for (beyond it the table's last entry
/// stands, see [`crate::policies::quality::throughput`]).
pub const MAX_TABLE_WORKERS: u32 = 1024;

/// How a job's per-worker batch follows its world size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchSize {
    /// Every worker runs this many samples per step, whatever the world size (the reference
    /// trainer: weak scaling).
    PerWorker(f64),
    /// The job's total batch per step is fixed and split over its workers (the Pollux
    /// workloads' jobs).
    Total(f64),
}

impl BatchSize {
    /// Samples per worker per step with `workers` workers.
    pub fn per_worker(self, workers: u32) -> f64 {
        match self {
            BatchSize::PerWorker(b) => b,
            BatchSize::Total(b) => b / f64::from(workers.max(1)),
        }
    }
}

/// What only a simulator can know of a job: its true throughput and the work it has left.
#[derive(Debug, Clone, PartialEq)]
pub struct Oracle {
    /// Progress per second with `w` workers at index `w − 1`.
    pub throughput: Vec<f64>,
    /// Progress left, in the units of `throughput`.
    pub remaining_work: f64,
}

/// A job whose batch size the decision may choose ([`crate::goodput`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveBatch {
    pub limits: BatchLimits,
    /// Largest per-worker micro-batch on particular GPU types where it differs from
    /// `limits.max_per_worker` (a spec's `max_per_worker_by_gpu_type`: more memory holds a
    /// larger micro-batch). The plan of a job placed on such a type uses it; a placement on
    /// several types, the smallest of theirs. Empty: `limits` on every type.
    pub max_per_worker_by_type: BTreeMap<String, u32>,
    /// Its latest gradient statistics; `None` before any were reported (the job then runs
    /// [`BatchLimits::initial_plan`]).
    pub gradient: Option<GradientStats>,
}

/// Everything the decision knows of one active job, as the caller observed it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobView {
    pub id: JobId,
    /// GPUs per worker (a job with 0 never runs).
    pub gpus_per_worker: u32,
    /// Fewest workers it runs with (0 counts as 1).
    pub min_workers: u32,
    pub max_workers: u32,
    /// The size the user asked for: fixed-size policies (fifo, tiresias, sjf-bco) run the job
    /// at it.
    pub requested_workers: u32,
    /// Whether the spec sets `workers` itself ([`PolicyJob::workers_declared`]).
    pub workers_declared: bool,
    /// Arrival time, seconds (same clock as [`ClusterState::now`]).
    pub submitted_at: f64,
    /// Its ranks now; empty when pending. The length is the current world size.
    pub placement: Vec<RankPlacement>,
    /// Fitted loss curve (`None` before enough reports, or when the policy reads none).
    pub curve: Option<Curve>,
    /// Progress so far, samples.
    pub samples: f64,
    /// Observed loss range, the per-job normalization of loss gains (0 = unknown).
    pub loss_scale: f64,
    /// Measured samples per second per worker.
    pub samples_per_s_per_worker: Option<f64>,
    /// GPU-seconds of service received so far (Tiresias's attained service).
    pub attained_gpu_seconds: f64,
    /// Throughput model fitted on the job's observed step times.
    pub model: Option<ThroughputModel>,
    /// Per-worker batch at each world size, for the model's predictions.
    pub batch: BatchSize,
    /// Estimated samples left (from a target loss and the curve, or the declared work).
    pub remaining_work: Option<f64>,
    /// The truth, where the caller has it.
    pub oracle: Option<Oracle>,
    /// Restarts so far (allocation changes after the first start).
    pub restarts: u32,
    /// Seconds of progress one restart cost this job, measured from its own restarts (see
    /// [`PolicyJob::restart_cost_s`]); `None` before it has restarted.
    pub restart_cost_s: Option<f64>,
    /// Set when the job's batch size may follow its allocation (its program applies the
    /// plan's batch and reports gradient statistics); read by policies that declare
    /// `goodput`.
    pub adaptive: Option<AdaptiveBatch>,
    /// The hosts the job may run on (its spec's `[selector]` matched against the hosts'
    /// labels); `None`: any host. A job with a set gets GPUs of those hosts only: its
    /// `max_workers` is capped at the workers they can hold before the policy sizes it,
    /// and placement (or the policy's own per-host allocation) uses no other host.
    pub hosts: Option<BTreeSet<HostId>>,
    /// Its queue (its spec's `queue`, else [`converge_common::DEFAULT_QUEUE`]); read by
    /// [`decide_queued`] only.
    pub queue: QueueId,
    /// Its priority class within its queue; read by [`decide_queued`] only.
    pub priority: PriorityClass,
    /// When its current run started (same clock as `now`; `None` when pending or unknown):
    /// of the jobs a queue must preempt, the most recently started go first.
    pub started_at: Option<f64>,
    /// The shadow algorithm of an `arch = "shadow"` job (`None`: its step includes its
    /// synchronization). A shadow job's throughput table is compute-only, linear in the
    /// workers and, while the policy reads no curve of it, in ring-equivalent samples
    /// ([`crate::shadow::statistical_penalty`]); its placement cost is
    /// [`JobCost::background`]. See [`crate::shadow`].
    pub shadow: Option<ShadowAlgorithm>,
    /// The job's family for the GPU-type projection ([`crate::gpu_types`]): jobs of one
    /// family (one model: a job spec's `model` label) share their speed ratios between GPU
    /// types. `None`: ratios over every job.
    pub family: Option<String>,
    /// The job's measured speed on each GPU type it ran on, samples per second per GPU
    /// ([`crate::gpu_types`]); empty when it has not run or the cluster has one type.
    pub gpu_type_speeds: BTreeMap<String, f64>,
    /// Whether the job is exploratory ([`converge_common::JobSpec::is_exploratory`]): the
    /// default objective values it by its predicted loss reduction.
    pub exploratory: bool,
}

/// The cluster at decision time.
#[derive(Debug, Clone, Copy)]
pub struct ClusterState<'a> {
    /// Seconds, same clock as the jobs' `submitted_at`.
    pub now: f64,
    /// Every usable host with all its GPUs (placement keeps unchanged jobs where they are)
    /// and its NIC factor.
    pub hosts: &'a [HostFree],
    /// Measured slowdown of a multi-host job (extra step time as a fraction of its
    /// uncontended step time) per additional multi-host job sharing one of its NICs (0 when
    /// nothing was measured); see [`crate::contention::ContentionSamples`].
    pub contention_per_shared_job: f64,
}

/// What [`decide`] returns.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Allocation {
    /// Workers per job as the policy decided (every job appears; 0 = not running).
    pub workers: BTreeMap<JobId, u32>,
    /// Ranks per placed job (jobs left out get no GPUs; placement may place fewer workers
    /// than decided when the free GPUs are scattered).
    pub placements: BTreeMap<JobId, Vec<RankPlacement>>,
    /// The policy's views, in priority order (what it was given).
    pub views: Vec<PolicyJob>,
    /// The batch plan of each placed adaptive job, for the allocation it got (only under a
    /// policy that declares `goodput`).
    pub batches: BTreeMap<JobId, BatchPlan>,
    /// On a cluster of several GPU types, each job's speed per type, measured or projected
    /// ([`crate::gpu_types::project`]; jobs with none left out); empty on one type.
    pub gpu_type_speeds: BTreeMap<JobId, BTreeMap<String, crate::gpu_types::TypeSpeed>>,
}

impl Allocation {
    /// Whether the policy broke its contract: more GPUs than the hosts have, or a size
    /// outside a job's bounds.
    pub fn violates(&self, hosts: &[HostFree]) -> bool {
        let total: u64 = hosts.iter().map(|h| h.gpus.len() as u64).sum();
        let mut used = 0u64;
        for view in &self.views {
            let w = self.workers.get(&view.id).copied().unwrap_or(0);
            used += u64::from(w) * u64::from(view.gpus_per_worker);
            if w != 0 && !(view.min_workers.max(1)..=view.max_workers).contains(&w) {
                return true;
            }
        }
        used > total
    }
}

/// Indices of `jobs` in priority order, the order in which placement serves them: running
/// jobs (a non-empty current placement) first, then pending ones, each by `submitted_at`,
/// then id.
pub fn priority_order(jobs: &[JobView]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&jobs[a], &jobs[b]);
        a.placement
            .is_empty()
            .cmp(&b.placement.is_empty())
            .then(a.submitted_at.total_cmp(&b.submitted_at))
            .then_with(|| a.id.cmp(&b.id))
    });
    order
}

/// The job's throughput table (samples/s with 1..=max workers) from `rate(workers, nodes)`:
/// samples/s from its model at its batch rule, or goodput at the best batch; see the module
/// docs, step 2.
fn estimated_table(
    job: &JobView,
    rate: impl Fn(u32, u32) -> f64,
    gpus_per_node: u32,
    placement: PlacementKind,
    contention: f64,
) -> Vec<f64> {
    table_by_workers(
        job.max_workers.clamp(1, MAX_TABLE_WORKERS),
        job.gpus_per_worker,
        gpus_per_node,
        bco_discount(placement, contention),
        rate,
    )
}

/// The contention a throughput table discounts a partial multi-node placement by: BCO's
/// measured contention per shared job, 0 (none) under first fit.
fn bco_discount(placement: PlacementKind, contention: f64) -> f64 {
    if placement == PlacementKind::Bco && contention > 0.0 {
        contention
    } else {
        0.0
    }
}

/// Samples/s with 1..=`most` workers from `rate(workers, nodes)`, each count packed on the
/// fewest hosts of `gpus_per_node` GPUs; a count that spans hosts without filling them is
/// divided by `1 + contention` (placement would share its hosts).
pub(crate) fn table_by_workers(
    most: u32,
    gpus_per_worker: u32,
    gpus_per_node: u32,
    contention: f64,
    rate: impl Fn(u32, u32) -> f64,
) -> Vec<f64> {
    (1..=most.max(1))
        .map(|w| table_entry(w, gpus_per_worker, gpus_per_node, contention, &rate))
        .collect()
}

/// One entry of [`table_by_workers`]: the rate with `w` workers.
pub(crate) fn table_entry(
    w: u32,
    gpus_per_worker: u32,
    gpus_per_node: u32,
    contention: f64,
    rate: impl Fn(u32, u32) -> f64,
) -> f64 {
    let per_node = gpus_per_node.max(1);
    let nodes = packed_nodes(w, gpus_per_worker, per_node);
    let rate = rate(w, nodes);
    let gpus = u64::from(w) * u64::from(gpus_per_worker);
    let partial = nodes > 1 && !gpus.is_multiple_of(u64::from(per_node));
    if partial && contention > 0.0 {
        rate / (1.0 + contention)
    } else {
        rate
    }
}

/// A job's batch limits on the hosts `nodes` ([`AdaptiveBatch::max_per_worker_by_type`]):
/// the micro-batch of their GPU type where the job names one for it (the smallest over the
/// types of a placement that spans several, a type not named counting as
/// `limits.max_per_worker`), else `limits`. Limits that would not hold (a micro-batch below
/// the smallest per-worker batch, which a validated spec rules out) fall back to `limits`.
fn limits_on_hosts(
    adaptive: &AdaptiveBatch,
    nodes: &[&HostId],
    host_at: &BTreeMap<&HostId, usize>,
    hosts: &[HostFree],
) -> BatchLimits {
    let limits = adaptive.limits;
    if adaptive.max_per_worker_by_type.is_empty() {
        return limits;
    }
    let micro = nodes
        .iter()
        .map(|h| {
            host_at
                .get(h)
                .and_then(|&i| hosts[i].gpu_type.as_deref())
                .and_then(|t| adaptive.max_per_worker_by_type.get(t).copied())
                .unwrap_or(limits.max_per_worker)
        })
        .min()
        .unwrap_or(limits.max_per_worker);
    with_micro_batch(limits, micro)
}

/// `limits` with the largest per-worker micro-batch `micro`; `limits` where those would not
/// hold (a micro-batch below the smallest per-worker batch, which a validated spec rules
/// out).
fn with_micro_batch(limits: BatchLimits, micro: u32) -> BatchLimits {
    if micro == limits.max_per_worker {
        return limits;
    }
    BatchLimits::new(
        limits.reference,
        limits.max_total,
        limits.min_per_worker,
        micro,
    )
    .unwrap_or(limits)
}

/// A job's throughput table on each GPU type ([`JobTypes::tables`], computed when a policy
/// first reads it): its goodput with the compute time
/// divided by the type's factor and the synchronization kept
/// ([`ThroughputModel::on_faster_gpu`]), at the type's GPUs per host and in the micro-batches
/// the type holds ([`AdaptiveBatch::max_per_worker_by_type`]). `None` for a type without a
/// factor. Empty, so that policies scale the job's own table by the factor as before
/// micro-batches per type, for a job that names no micro-batch per type (a table per type
/// costs a batch-size search per job, type and count: with one for every job the decision
/// on 100,000 GPUs of four types took about 215 ms median against 176 ms), a job without
/// goodput (no model, or a policy that reads none), a shadow job or one with an oracle
/// (their tables are not a model's).
fn type_tables(
    job: &JobView,
    view: &PolicyJob,
    types: &JobTypes,
    pools: &[GpuTypePool],
    placement: PlacementKind,
    contention: f64,
) -> Vec<Option<TypeTable>> {
    let Some(adaptive) = job
        .adaptive
        .as_ref()
        .filter(|a| !a.max_per_worker_by_type.is_empty())
    else {
        return Vec::new();
    };
    // An adaptive job's goodput (what the type-aware policies read).
    let Some(g) = view
        .goodput
        .as_ref()
        .filter(|_| job.shadow.is_none() && job.oracle.is_none() && view.throughput.is_some())
    else {
        return Vec::new();
    };
    let most = job.max_workers.clamp(1, MAX_TABLE_WORKERS);
    let discount = bco_discount(placement, contention);
    pools
        .iter()
        .zip(&types.factors)
        .map(|(pool, factor)| {
            let f = (*factor)?;
            let rate = GoodputFn {
                model: g.model.on_faster_gpu(f),
                gradient: g.gradient,
                limits: type_limits(adaptive, pool.name.as_deref()),
            };
            Some(TypeTable::new(
                rate,
                most,
                job.gpus_per_worker,
                pool.gpus_per_node,
                discount,
            ))
        })
        .collect()
}

/// An adaptive job's batch limits on GPUs of type `gpu_type`
/// ([`AdaptiveBatch::max_per_worker_by_type`]; `None` or a type not listed: `limits`).
/// Limits that would not hold fall back to `limits`.
fn type_limits(adaptive: &AdaptiveBatch, gpu_type: Option<&str>) -> BatchLimits {
    match gpu_type.and_then(|t| adaptive.max_per_worker_by_type.get(t)) {
        Some(&micro) => with_micro_batch(adaptive.limits, micro),
        None => adaptive.limits,
    }
}

/// Ranks for a policy's per-host decision: a job whose workers per host are unchanged keeps
/// its ranks; the others take free GPUs on the hosts decided, in priority order, rank 0 on
/// the first of them.
fn realize(
    hosts: &[HostFree],
    order: &[&JobView],
    views: &[PolicyJob],
    decided: &HostDecision,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let index = host_index(hosts);
    let mut free: Vec<Vec<u32>> = hosts.iter().map(|h| h.gpus.clone()).collect();
    let mut out = BTreeMap::new();
    let mut later = Vec::new();
    for (job, view) in order.iter().zip(views) {
        let Some(want) = decided.hosts.get(&job.id) else {
            continue;
        };
        let allowed = |host: &HostId| job.hosts.as_ref().is_none_or(|set| set.contains(host));
        let keeps = *want == view.current_hosts
            && job.placement.iter().all(|r| {
                allowed(&r.host)
                    && index
                        .get(&r.host)
                        .is_some_and(|&i| r.gpus.iter().all(|g| free[i].contains(g)))
            });
        if keeps {
            for r in &job.placement {
                let i = index[&r.host];
                free[i].retain(|g| !r.gpus.contains(g));
            }
            out.insert(job.id.clone(), job.placement.clone());
        } else {
            later.push((job, want));
        }
    }
    for (job, want) in later {
        let gpw = job.gpus_per_worker.max(1) as usize;
        let mut ranks = Vec::new();
        for &(i, workers) in want {
            // A policy's host outside the job's selector gets none of its workers.
            if hosts
                .get(i)
                .is_some_and(|h| job.hosts.as_ref().is_some_and(|set| !set.contains(&h.host)))
            {
                continue;
            }
            let Some(gpus) = free.get_mut(i) else {
                continue;
            };
            for _ in 0..workers {
                if gpus.len() < gpw {
                    break;
                }
                let taken: Vec<u32> = gpus.drain(..gpw).collect();
                ranks.push(RankPlacement {
                    rank: ranks.len() as u32,
                    host: hosts[i].host.clone(),
                    gpus: taken,
                });
            }
        }
        if !ranks.is_empty() && ranks.len() as u32 >= job.min_workers.max(1) {
            out.insert(job.id.clone(), ranks);
        } else {
            for r in ranks {
                free[index[&r.host]].extend(r.gpus);
            }
        }
    }
    out
}

/// The most workers of `job` its eligible hosts can hold (all their GPUs, as if free);
/// `None` for a job that may run anywhere.
fn eligible_capacity(job: &JobView, hosts: &[HostFree]) -> Option<u32> {
    let allowed = job.hosts.as_ref()?;
    let per_worker = job.gpus_per_worker.max(1) as usize;
    let mut gpus: BTreeMap<&HostId, BTreeSet<u32>> = BTreeMap::new();
    for h in hosts.iter().filter(|h| allowed.contains(&h.host)) {
        gpus.entry(&h.host).or_default().extend(&h.gpus);
    }
    let workers: usize = gpus.values().map(|g| g.len() / per_worker).sum();
    Some(u32::try_from(workers).unwrap_or(u32::MAX))
}

/// Each host's index in `hosts` (the first, for a host listed twice).
fn host_index(hosts: &[HostFree]) -> BTreeMap<&HostId, usize> {
    let mut index = BTreeMap::new();
    for (i, h) in hosts.iter().enumerate() {
        index.entry(&h.host).or_insert(i);
    }
    index
}

/// Workers per host of a placement, as `(index into hosts, workers)` in host order.
fn per_host(index: &BTreeMap<&HostId, usize>, placement: &[RankPlacement]) -> Vec<(usize, u32)> {
    let mut counts: BTreeMap<usize, u32> = BTreeMap::new();
    for r in placement {
        if let Some(&i) = index.get(&r.host) {
            *counts.entry(i).or_default() += 1;
        }
    }
    counts.into_iter().collect()
}

/// The decision for `jobs` on `cluster` by `policy`, placed by `placement`. Pure and
/// deterministic: equal inputs give equal decisions, whatever the order of `jobs`.
pub fn decide(
    cluster: &ClusterState<'_>,
    jobs: &[JobView],
    policy: &dyn Policy,
    placement: PlacementKind,
) -> Allocation {
    let order: Vec<&JobView> = priority_order(jobs).into_iter().map(|i| &jobs[i]).collect();
    decide_in_order(cluster, &order, policy, placement, None)
}

/// How [`decide_in_order`] sizes jobs: `None`, the policy on every job at once (its own
/// placement when it declares `hosts`); `Some`, this function of the policy's views.
type Sizing<'s> = Option<&'s mut dyn FnMut(&ClusterView, &[PolicyJob]) -> Decision>;

/// Each job's speed per GPU type of `hosts`, measured or projected
/// ([`crate::gpu_types::project`]), in the order of `jobs`; all empty when the hosts with
/// GPUs carry fewer than two types ([`crate::placement::gpu_types_of`]).
fn gpu_type_speeds(
    hosts: &[HostFree],
    jobs: &[&JobView],
) -> Vec<BTreeMap<String, crate::gpu_types::TypeSpeed>> {
    let all = crate::placement::gpu_types_of(hosts);
    if all.len() < 2 {
        return vec![BTreeMap::new(); jobs.len()];
    }
    let types: Vec<&str> = all.into_iter().flatten().collect();
    // Each type's nominal speed: the median over its hosts that report one.
    let mut reported: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for h in hosts {
        if let (Some(t), Some(s)) = (h.gpu_type.as_deref(), h.gpu_speed)
            && s.is_finite()
            && s > 0.0
            && !h.gpus.is_empty()
        {
            reported.entry(t).or_default().push(s);
        }
    }
    let nominal: BTreeMap<&str, f64> = reported
        .into_iter()
        .filter_map(|(t, v)| Some((t, crate::gpu_types::median(v)?)))
        .collect();
    let measured: Vec<crate::gpu_types::Measured<'_>> = jobs
        .iter()
        .map(|job| crate::gpu_types::Measured {
            family: job.family.as_deref(),
            speeds: &job.gpu_type_speeds,
        })
        .collect();
    crate::gpu_types::project(&measured, &types, &nominal)
}

/// The hosts with GPUs grouped by GPU type, for [`Policy::allocate_on_types`].
struct TypePools<'h> {
    pools: Vec<GpuTypePool>,
    /// Each host's pool (index into `pools`), `None` for a host without GPUs; indexed like
    /// the hosts.
    pool_of_host: Vec<Option<usize>>,
    /// Each host's index (its first listing).
    index: BTreeMap<&'h HostId, usize>,
}

impl<'h> TypePools<'h> {
    fn new(hosts: &'h [HostFree]) -> Self {
        let mut pools: Vec<GpuTypePool> = Vec::new();
        let mut pool_of_host = Vec::with_capacity(hosts.len());
        for h in hosts {
            if h.gpus.is_empty() {
                pool_of_host.push(None);
                continue;
            }
            let gpus = h.gpus.len() as u32;
            let i = match pools.iter().position(|p| p.name == h.gpu_type) {
                Some(i) => i,
                None => {
                    pools.push(GpuTypePool {
                        name: h.gpu_type.clone(),
                        gpus: 0,
                        nodes: 0,
                        gpus_per_node: 0,
                    });
                    pools.len() - 1
                }
            };
            let p = &mut pools[i];
            p.gpus += gpus;
            p.nodes += 1;
            p.gpus_per_node = p.gpus_per_node.max(gpus);
            pool_of_host.push(Some(i));
        }
        // Pools in name order (unlabelled first), whatever the order of the hosts: a
        // policy's ties between pools then fall the same way every decision.
        let mut order: Vec<usize> = (0..pools.len()).collect();
        order.sort_by(|&a, &b| pools[a].name.cmp(&pools[b].name));
        let mut rank = vec![0; pools.len()];
        for (new, &old) in order.iter().enumerate() {
            rank[old] = new;
        }
        let pools: Vec<GpuTypePool> = order.iter().map(|&i| pools[i].clone()).collect();
        for p in pool_of_host.iter_mut().flatten() {
            *p = rank[*p];
        }
        Self {
            pools,
            pool_of_host,
            index: host_index(hosts),
        }
    }

    /// The hosts of pool `t` (within `allowed`, a job's selector), for a pool of hosts
    /// without a type label, which [`PlacementRequest::gpu_type`] cannot name.
    fn hosts_of(
        &self,
        t: usize,
        allowed: Option<&BTreeSet<HostId>>,
        hosts: &[HostFree],
    ) -> BTreeSet<HostId> {
        self.pool_of_host
            .iter()
            .zip(hosts)
            .filter(|(p, h)| **p == Some(t) && allowed.is_none_or(|a| a.contains(&h.host)))
            .map(|(_, h)| h.host.clone())
            .collect()
    }

    /// What the policy knows of `job`'s types: each type's speed relative to the type its
    /// model describes (its current type's measured speed when it has one, else the
    /// geometric mean of its measured speeds: the model of a job that is not placed is
    /// fitted on all its observations), its current type, and its eligible GPUs per type.
    fn job_types(
        &self,
        job: &JobView,
        speeds: &BTreeMap<String, crate::gpu_types::TypeSpeed>,
        hosts: &[HostFree],
    ) -> JobTypes {
        let current = job
            .placement
            .first()
            .and_then(|r| self.index.get(&r.host))
            .and_then(|&i| self.pool_of_host[i]);
        let speed_of = |t: usize| {
            let name = self.pools[t].name.as_deref()?;
            speeds.get(name).map(|s| s.samples_per_s)
        };
        let measured: Vec<f64> = job
            .gpu_type_speeds
            .values()
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        let reference = current
            .and_then(|t| {
                let name = self.pools[t].name.as_deref()?;
                job.gpu_type_speeds.get(name).copied()
            })
            .filter(|v| v.is_finite() && *v > 0.0)
            .or_else(|| {
                (!measured.is_empty()).then(|| {
                    (measured.iter().map(|v| v.ln()).sum::<f64>() / measured.len() as f64).exp()
                })
            });
        let eligible = match &job.hosts {
            None => self.pools.iter().map(|p| p.gpus).collect(),
            Some(allowed) => {
                let mut eligible = vec![0u32; self.pools.len()];
                for &i in allowed.iter().filter_map(|h| self.index.get(h)) {
                    if let Some(p) = self.pool_of_host[i] {
                        eligible[p] += hosts[i].gpus.len() as u32;
                    }
                }
                eligible
            }
        };
        JobTypes {
            factors: (0..self.pools.len())
                .map(|t| Some(speed_of(t)? / reference?).filter(|f| f.is_finite() && *f > 0.0))
                .collect(),
            current,
            eligible_gpus: eligible,
            tables: Vec::new(),
        }
    }
}

/// [`decide`] on jobs already in the order placement serves them.
fn decide_in_order(
    cluster: &ClusterState<'_>,
    order: &[&JobView],
    policy: &dyn Policy,
    placement: PlacementKind,
    sizing: Sizing<'_>,
) -> Allocation {
    let total_gpus: u32 = cluster.hosts.iter().map(|h| h.gpus.len() as u32).sum();
    let gpus_per_node = cluster
        .hosts
        .iter()
        .map(|h| h.gpus.len() as u32)
        .max()
        .unwrap_or(0);
    let contention = if cluster.contention_per_shared_job.is_finite() {
        cluster.contention_per_shared_job.max(0.0)
    } else {
        0.0
    };
    let wants = policy.inputs();
    let index = wants.hosts.then(|| host_index(cluster.hosts));
    let type_speeds = gpu_type_speeds(cluster.hosts, order);
    let goodput_of = |job: &JobView| -> Option<GoodputFn> {
        let adaptive = job.adaptive.as_ref().filter(|_| wants.goodput)?;
        Some(GoodputFn {
            model: job.model.clone()?,
            gradient: adaptive.gradient,
            limits: adaptive.limits,
        })
    };
    let views: Vec<PolicyJob> = order
        .iter()
        .map(|job| {
            let goodput = goodput_of(job);
            let oracle = job.oracle.as_ref().filter(|_| wants.oracle);
            let (throughput, remaining_work) = match oracle {
                Some(o) => (Some(o.throughput.clone()), Some(o.remaining_work)),
                // A shadow job: compute-only, the same on any placement (crate::shadow).
                None if (wants.estimates || wants.oracle) && job.shadow.is_some() => {
                    let penalty = match job.shadow {
                        Some(algo) if !(wants.curves && job.curve.is_some()) => {
                            crate::shadow::statistical_penalty(algo)
                        }
                        _ => 1.0,
                    };
                    (
                        job.model.as_ref().map(|m| {
                            let most = job.max_workers.clamp(1, MAX_TABLE_WORKERS);
                            (1..=most)
                                .map(|w| {
                                    crate::shadow::samples_per_s(m, w, job.batch.per_worker(w))
                                        / penalty
                                })
                                .collect()
                        }),
                        job.remaining_work,
                    )
                }
                None if wants.estimates || wants.oracle => (
                    match (&goodput, &job.model) {
                        (Some(g), _) => Some(estimated_table(
                            job,
                            |w, n| g.best(w, n).map_or(0.0, |(_, v)| v),
                            gpus_per_node,
                            placement,
                            contention,
                        )),
                        (None, Some(m)) => Some(estimated_table(
                            job,
                            |w, n| m.samples_per_s(w, n, job.batch.per_worker(w)),
                            gpus_per_node,
                            placement,
                            contention,
                        )),
                        (None, None) => None,
                    },
                    job.remaining_work,
                ),
                None => (None, None),
            };
            PolicyJob {
                id: job.id.clone(),
                gpus_per_worker: job.gpus_per_worker,
                min_workers: job.min_workers,
                // A selector job never gets more workers than its hosts hold (none, and
                // so 0 from every policy, when they cannot hold its minimum).
                max_workers: eligible_capacity(job, cluster.hosts)
                    .map_or(job.max_workers, |cap| job.max_workers.min(cap)),
                current_workers: job.placement.len() as u32,
                submitted_at: job.submitted_at,
                curve: if wants.curves {
                    job.curve.clone()
                } else {
                    None
                },
                samples: job.samples,
                loss_scale: job.loss_scale,
                samples_per_s_per_worker: job.samples_per_s_per_worker,
                requested_workers: job.requested_workers,
                workers_declared: job.workers_declared,
                attained_gpu_seconds: job.attained_gpu_seconds,
                throughput,
                remaining_work,
                restarts: job.restarts,
                restart_cost_s: job.restart_cost_s,
                goodput,
                exploratory: job.exploratory,
                current_hosts: if let Some(index) = &index {
                    per_host(index, &job.placement)
                } else {
                    Vec::new()
                },
                eligible_hosts: match (&index, &job.hosts) {
                    (Some(_), Some(allowed)) => Some(
                        cluster
                            .hosts
                            .iter()
                            .enumerate()
                            .filter(|(_, h)| allowed.contains(&h.host))
                            .map(|(i, _)| i)
                            .collect(),
                    ),
                    _ => None,
                },
            }
        })
        .collect();
    let view = ClusterView {
        total_gpus,
        gpus_per_node,
        now: cluster.now,
    };
    let host_gpus: Vec<u32> = cluster.hosts.iter().map(|h| h.gpus.len() as u32).collect();
    let on_hosts = if wants.hosts && sizing.is_none() {
        policy.allocate_on_hosts(&view, &host_gpus, &views)
    } else {
        None
    };
    // On a cluster of several GPU types a policy's own host-level allocation may span types:
    // only its worker counts are kept there, and `place_with` puts each job on one type
    // (a heterogeneity-unaware policy whose placements are then fixed to one type, as the
    // Sia paper runs Pollux on its mixed cluster).
    let one_gpu_type = crate::placement::gpu_types_of(cluster.hosts).len() < 2;
    // A policy that picks each job's GPU type itself (Sia's) does so on a mixed cluster;
    // placement then keeps each job to its type's hosts.
    let on_types = if wants.gpu_types && !one_gpu_type && sizing.is_none() && on_hosts.is_none() {
        let pools = TypePools::new(cluster.hosts);
        let job_types: Vec<JobTypes> = order
            .iter()
            .zip(&type_speeds)
            .zip(&views)
            .map(|((job, speeds), view)| {
                let mut types = pools.job_types(job, speeds, cluster.hosts);
                types.tables = type_tables(job, view, &types, &pools.pools, placement, contention);
                types
            })
            .collect();
        policy
            .allocate_on_types(&view, &pools.pools, &views, &job_types)
            .map(|decided| (decided, pools))
    } else {
        None
    };
    let (decided_workers, placements) =
        if let Some(decided) = on_hosts.as_ref().filter(|_| one_gpu_type) {
            let placements = realize(cluster.hosts, order, &views, decided);
            (decided.workers.clone(), placements)
        } else {
            let decided = match (on_hosts, sizing) {
                _ if on_types.is_some() => Decision {
                    workers: on_types
                        .as_ref()
                        .map(|(d, _)| d.workers.clone())
                        .unwrap_or_default(),
                },
                (Some(on_hosts), _) => Decision {
                    workers: on_hosts.workers,
                },
                (None, Some(size)) => size(&view, &views),
                (None, None) => policy.allocate(&view, &views),
            };
            let chosen = |job: &JobView| {
                let (decided, pools) = on_types.as_ref()?;
                let t = *decided.types.get(&job.id)?;
                (t < pools.pools.len()).then_some((pools, t))
            };
            let requests: Vec<PlacementRequest> = order
                .iter()
                .zip(&type_speeds)
                .map(|(job, speeds)| PlacementRequest {
                    job: job.id.clone(),
                    workers: decided.workers.get(&job.id).copied().unwrap_or(0),
                    gpus_per_worker: job.gpus_per_worker,
                    min_workers: job.min_workers,
                    current: job.placement.clone(),
                    // The pool a type-picking policy chose for the job, if it chose one.
                    hosts: match chosen(job) {
                        // Hosts without a type label: named by host, within its selector.
                        Some((pools, t)) if pools.pools[t].name.is_none() => {
                            Some(pools.hosts_of(t, job.hosts.as_ref(), cluster.hosts))
                        }
                        _ => job.hosts.clone(),
                    },
                    // Only a policy that declares GPU types places by them; a job the
                    // policy gave a type needs none.
                    gpu_type_speeds: speeds
                        .iter()
                        .filter(|_| wants.gpu_types && chosen(job).is_none())
                        .map(|(t, s)| (t.clone(), s.samples_per_s))
                        .collect(),
                    // The type a type-picking policy chose for the job: its hosts only.
                    gpu_type: chosen(job).and_then(|(pools, t)| pools.pools[t].name.clone()),
                })
                .collect();
            let costs: BTreeMap<JobId, JobCost> = match placement {
                PlacementKind::FirstFit => BTreeMap::new(),
                PlacementKind::Bco => order
                    .iter()
                    .filter_map(|job| {
                        let workers = decided.workers.get(&job.id).copied().unwrap_or(0);
                        if job.shadow.is_some() {
                            // Every shadow job, so that placement knows it (crate::shadow).
                            let compute = job
                                .model
                                .as_ref()
                                .map_or(JobCost::default().compute_s, |m| {
                                    m.compute_time_s(job.batch.per_worker(workers.max(1)))
                                });
                            return Some((job.id.clone(), JobCost::background(compute)));
                        }
                        let model = job.model.as_ref().filter(|_| workers > 0)?;
                        let mut cost =
                            JobCost::from_model(model, workers, job.batch.per_worker(workers));
                        cost.sync_s = cost.sync_s.max(contention * cost.compute_s);
                        Some((job.id.clone(), cost))
                    })
                    .collect(),
            };
            let placements = place_with(placement, cluster.hosts, &requests, &costs);
            (decided.workers, placements)
        };
    let mut batches = BTreeMap::new();
    let host_at = host_index(cluster.hosts);
    if wants.goodput {
        for (job, view) in order.iter().zip(&views) {
            let (Some(adaptive), Some(ranks)) = (&job.adaptive, placements.get(&job.id)) else {
                continue;
            };
            // Not placed (pending): no plan.
            if ranks.is_empty() {
                continue;
            }
            let workers = ranks.len() as u32;
            // Distinct hosts by linear scan: a job spans few.
            let mut nodes: Vec<&HostId> = Vec::new();
            for r in ranks {
                if !nodes.contains(&&r.host) {
                    nodes.push(&r.host);
                }
            }
            let limits = limits_on_hosts(adaptive, &nodes, &host_at, cluster.hosts);
            let plan = match &view.goodput {
                Some(g) if limits != g.limits => GoodputFn {
                    limits,
                    ..g.clone()
                }
                .best(workers, nodes.len() as u32)
                .map(|(p, _)| p),
                Some(g) => g.best(workers, nodes.len() as u32).map(|(p, _)| p),
                None => limits.initial_plan(workers),
            };
            if let Some(plan) = plan {
                batches.insert(job.id.clone(), plan);
            }
        }
    }
    Allocation {
        workers: decided_workers,
        placements,
        views,
        batches,
        gpu_type_speeds: order
            .iter()
            .zip(type_speeds)
            .filter(|(_, speeds)| !speeds.is_empty())
            .map(|(job, speeds)| (job.id.clone(), speeds))
            .collect(),
    }
}

/// The queues a decision shares the cluster among (see [`crate::queues`]).
#[derive(Debug, Clone, Copy)]
pub struct QueueSetup<'a> {
    /// The queues that exist (KV `converge-queues`); the implicit default queue is added
    /// when absent ([`queues::with_default`]).
    pub specs: &'a BTreeMap<QueueId, QueueSpec>,
    /// Each queue's status after the previous decision: its decayed usage, the GPUs it held
    /// since and when ([`queues::decayed_usage`]).
    pub previous: &'a BTreeMap<QueueId, QueueStatus>,
    /// Half-life of the usage decay, seconds ([`queues::DEFAULT_USAGE_HALF_LIFE_S`]).
    pub half_life_s: f64,
}

/// What [`decide_queued`] returns.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct QueuedAllocation {
    pub allocation: Allocation,
    /// Every queue's status after this decision (the next decision's `previous`).
    pub statuses: BTreeMap<QueueId, QueueStatus>,
    /// Jobs whose queue does not exist: not scheduled (pending, or preempted if running).
    pub unknown_queue: BTreeMap<JobId, QueueId>,
    /// Running jobs the queues preempted whole (to give a higher class of their queue its
    /// GPUs, or to hand borrowed GPUs back to their quota's queue), with the reason.
    pub preempted: BTreeMap<JobId, String>,
}

/// The most workers the job may get: `max_workers`, capped by what its selector's hosts hold.
fn capped_max(job: &JobView, hosts: &[HostFree]) -> u32 {
    eligible_capacity(job, hosts).map_or(job.max_workers, |cap| job.max_workers.min(cap))
}

/// GPUs a job could use under `policy`: its largest size under a policy that resizes running
/// jobs, its requested size (at least its current one) under one that does not; 0 for a job
/// that can never run.
fn demand_gpus(job: &JobView, hosts: &[HostFree], resizes: bool) -> u64 {
    let max = capped_max(job, hosts);
    let min = job.min_workers.max(1);
    if job.gpus_per_worker == 0 || min > max {
        return 0;
    }
    let workers = if resizes {
        max
    } else {
        // At least what it runs with now: a running job's size is its floor.
        let current = job.placement.len() as u32;
        job.requested_workers
            .clamp(min, max)
            .max(if current <= max { current } else { 0 })
    };
    u64::from(workers) * u64::from(job.gpus_per_worker)
}

/// The order placement serves jobs in under queues: running jobs first (by `submitted_at`,
/// then id, as [`priority_order`]), then pending ones by class, highest first, then
/// `submitted_at`, then id.
fn queued_order<'a>(jobs: &[&'a JobView]) -> Vec<&'a JobView> {
    let mut order = jobs.to_vec();
    order.sort_by(|a, b| {
        let pending = a.placement.is_empty().cmp(&b.placement.is_empty());
        let class = if a.placement.is_empty() && b.placement.is_empty() {
            b.priority.cmp(&a.priority)
        } else {
            std::cmp::Ordering::Equal
        };
        pending
            .then(class)
            .then(a.submitted_at.total_cmp(&b.submitted_at))
            .then_with(|| a.id.cmp(&b.id))
    });
    order
}

/// The decision with queues (docs/scheduling.md, "Queues, fair share and priorities"):
///
/// 1. Jobs whose queue does not exist are left out ([`QueuedAllocation::unknown_queue`]).
/// 2. Each queue's budget for this step ([`queues::shares`]): its quota while its jobs need
///    it, plus its fair share of the GPUs others leave idle, by weight and decayed usage.
/// 3. When one queue has every job, all of one class, and its budget is the whole cluster
///    (a cluster without queues: everything in the implicit default queue), this is exactly
///    [`decide`].
/// 4. Otherwise each queue, in name order, sizes its classes highest first, each on what
///    the higher classes left of the queue's budget: the running jobs of the class whose
///    floors (minimum size under a policy that resizes running jobs, current size under one
///    that does not) no longer fit are preempted whole, most recently started first and no
///    more than needed ([`queues::victims`]); the policy ([`Policy::allocate`]) sizes the
///    others and the class's pending jobs within what is left, so an elastic job may be
///    shrunk rather than preempted. A class takes from lower classes' running jobs only
///    what its jobs ask for (requested sizes, or what they hold); beyond that only GPUs
///    nobody holds. GPUs the budgets leave unused then go to the groups that can still use
///    them (each queue up to its quota plus borrowing limit, highest class first; first a
///    part in proportion to each queue's fair share, then what is left in queue name order;
///    its preempted jobs are candidates again). Placement then places
///    every job, running ones first, pending ones highest class first. A policy that places jobs itself (Pollux) sizes
///    through [`Policy::allocate`] here and [`crate::placement`] places.
/// 5. Each queue's new [`QueueStatus`]: GPUs held, borrowed and lent, fair share, usage.
pub fn decide_queued(
    cluster: &ClusterState<'_>,
    jobs: &[JobView],
    policy: &dyn Policy,
    placement: PlacementKind,
    setup: &QueueSetup<'_>,
) -> QueuedAllocation {
    let specs = queues::with_default(setup.specs);
    let total_gpus: u32 = cluster.hosts.iter().map(|h| h.gpus.len() as u32).sum();
    let resizes = policy.resizes_running_jobs();
    let mut unknown_queue = BTreeMap::new();
    let mut known: Vec<&JobView> = Vec::new();
    for job in jobs {
        if specs.contains_key(&job.queue) {
            known.push(job);
        } else {
            unknown_queue.insert(job.id.clone(), job.queue.clone());
        }
    }
    let names: Vec<&QueueId> = specs.keys().collect();
    let demands: Vec<QueueDemand> = specs
        .values()
        .map(|spec| {
            let demand = known
                .iter()
                .filter(|j| j.queue == spec.name)
                .map(|j| demand_gpus(j, cluster.hosts, resizes))
                .sum();
            let usage = queues::decayed_usage(
                setup.previous.get(&spec.name),
                cluster.now,
                setup.half_life_s,
            );
            QueueDemand::new(spec, demand, usage)
        })
        .collect();
    let shares = queues::shares(&demands, total_gpus, setup.half_life_s);
    let budget: BTreeMap<&QueueId, Share> =
        names.iter().copied().zip(shares.iter().copied()).collect();
    let with_jobs: BTreeSet<&QueueId> = known.iter().map(|j| &j.queue).collect();
    let classes: BTreeSet<PriorityClass> = known.iter().map(|j| j.priority).collect();
    let mut preempted = BTreeMap::new();
    let allocation = match with_jobs.iter().next() {
        None => {
            let none: Vec<&JobView> = Vec::new();
            decide_in_order(cluster, &none, policy, placement, None)
        }
        Some(only)
            if with_jobs.len() == 1
                && classes.len() <= 1
                && specs[*only].max_gpus() >= total_gpus =>
        {
            let kept: Vec<JobView> = known.iter().map(|j| (*j).clone()).collect();
            decide(cluster, &kept, policy, placement)
        }
        Some(_) => {
            let order = queued_order(&known);
            let most: BTreeMap<&QueueId, u32> =
                specs.iter().map(|(n, s)| (n, s.max_gpus())).collect();
            let by_id: BTreeMap<&JobId, &JobView> = known.iter().map(|j| (&j.id, *j)).collect();
            let mut size = |view: &ClusterView, jobs: &[PolicyJob]| -> Decision {
                size_by_queue(
                    view,
                    jobs,
                    &by_id,
                    (&budget, &most),
                    policy,
                    resizes,
                    &mut preempted,
                )
            };
            decide_in_order(cluster, &order, policy, placement, Some(&mut size))
        }
    };
    // Each queue's holdings after the decision.
    let mut held: BTreeMap<&QueueId, Held> = BTreeMap::new();
    for job in &known {
        let h = held.entry(&job.queue).or_default();
        match allocation.placements.get(&job.id).filter(|r| !r.is_empty()) {
            Some(ranks) => {
                h.gpus += ranks.iter().map(|r| r.gpus.len() as u32).sum::<u32>();
                h.running_jobs += 1;
            }
            None => h.pending_jobs += 1,
        }
    }
    let held: Vec<Held> = names
        .iter()
        .map(|n| held.get(n).copied().unwrap_or_default())
        .collect();
    let statuses = queues::statuses(
        &demands,
        &shares,
        &held,
        total_gpus,
        cluster.now,
        setup.half_life_s,
    )
    .into_iter()
    .map(|s| (s.queue.clone(), s))
    .collect();
    QueuedAllocation {
        allocation,
        statuses,
        unknown_queue,
        preempted,
    }
}

/// Sizes the jobs queue by queue and class by class within each queue's budget (step 4 of
/// [`decide_queued`]); the decision lists every job of `jobs`.
fn size_by_queue(
    view: &ClusterView,
    jobs: &[PolicyJob],
    by_id: &BTreeMap<&JobId, &JobView>,
    (budget, most): (&BTreeMap<&QueueId, Share>, &BTreeMap<&QueueId, u32>),
    policy: &dyn Policy,
    resizes: bool,
    preempted: &mut BTreeMap<JobId, String>,
) -> Decision {
    let mut decision = Decision::default();
    let mut groups: BTreeMap<(&QueueId, std::cmp::Reverse<PriorityClass>), Vec<&PolicyJob>> =
        BTreeMap::new();
    for job in jobs {
        let Some(v) = by_id.get(&job.id) else {
            decision.workers.insert(job.id.clone(), 0);
            continue;
        };
        groups
            .entry((&v.queue, std::cmp::Reverse(v.priority)))
            .or_default()
            .push(job);
    }
    let floor = |job: &PolicyJob| -> u64 {
        let valid = job.current_workers > 0
            && job.gpus_per_worker > 0
            && job.min_workers.max(1) <= job.max_workers
            && job.current_workers <= job.max_workers;
        if !valid {
            return 0;
        }
        let workers = if resizes {
            job.min_workers.max(1)
        } else {
            job.current_workers
        };
        u64::from(workers) * u64::from(job.gpus_per_worker)
    };
    let mut remaining: BTreeMap<&QueueId, u64> = BTreeMap::new();
    let mut queue_used: BTreeMap<&QueueId, u64> = BTreeMap::new();
    let mut sized_groups: Vec<(&QueueId, Vec<PolicyJob>, Vec<PolicyJob>, u64)> = Vec::new();
    for ((queue, class), members) in &groups {
        let share = budget.get(queue).copied();
        let full = u64::from(share.map_or(0, |s| s.budget));
        let left = *remaining.entry(queue).or_insert(full);
        let running: Vec<Running> = members
            .iter()
            .filter(|j| j.current_workers > 0)
            .map(|j| Running {
                id: j.id.clone(),
                floor_gpus: floor(j),
                started_at: by_id.get(&j.id).and_then(|v| v.started_at),
            })
            .collect();
        let out = queues::victims(&running, left);
        if !out.is_empty() {
            // Reclaim when the queue's running jobs no longer fit its whole budget; else a
            // higher class of the queue took the GPUs.
            let queue_floor: u64 = groups
                .iter()
                .filter(|((q, _), _)| q == queue)
                .flat_map(|(_, m)| m.iter())
                .map(|j| floor(j))
                .sum();
            let reason = if queue_floor > full {
                format!(
                    "preempted: queue {queue} is over its fair share of {:.1} GPUs; its borrowed GPUs went back to the queues that lent them",
                    share.map_or(0.0, |s| s.fair_share)
                )
            } else {
                format!("preempted by higher-priority jobs of queue {queue}")
            };
            for id in &out {
                preempted.insert(id.clone(), reason.clone());
            }
        }
        let kept: Vec<PolicyJob> = members
            .iter()
            .filter(|j| !out.contains(&j.id))
            .map(|j| (*j).clone())
            .collect();
        // A class takes from the lower classes' running jobs only what its jobs ask for (their
        // requested sizes, or what they hold now); beyond that only GPUs nobody holds.
        let lower_held: u64 = groups
            .range((*queue, std::cmp::Reverse(class.0))..)
            .filter(|((q, c), _)| q == queue && c.0 < class.0)
            .flat_map(|(_, m)| m.iter())
            .map(|j| gpus(j, j.current_workers))
            .sum();
        let asked: u64 = kept
            .iter()
            .map(|j| {
                let min = j.min_workers.max(1);
                let requested = if min <= j.max_workers {
                    j.requested_workers.clamp(min, j.max_workers)
                } else {
                    0
                };
                gpus(j, requested.max(j.current_workers.min(j.max_workers)))
            })
            .sum();
        let allowed = left.min(left.saturating_sub(lower_held).max(asked));
        let group_view = ClusterView {
            total_gpus: u32::try_from(allowed).unwrap_or(u32::MAX),
            ..*view
        };
        let sized = policy.allocate(&group_view, &kept);
        let mut used = 0u64;
        for job in &kept {
            let w = sized.workers.get(&job.id).copied().unwrap_or(0);
            used += gpus(job, w);
            decision.workers.insert(job.id.clone(), w);
        }
        for id in &out {
            decision.workers.insert(id.clone(), 0);
        }
        remaining.insert(queue, left.saturating_sub(used));
        *queue_used.entry(queue).or_default() += used;
        let victims: Vec<PolicyJob> = members
            .iter()
            .filter(|j| out.contains(&j.id))
            .map(|j| (*j).clone())
            .collect();
        sized_groups.push((*queue, kept, victims, used));
    }
    // Work conservation: GPUs the budgets left unused (a gang that did not fit, a queue
    // that cannot use its whole share) go to the groups that can still use them, each queue
    // up to its quota plus borrowing limit, highest class first within a queue; the group's
    // preempted jobs are candidates again (a job is not preempted for GPUs that would stay
    // idle). First pass: each queue that can grow is offered a part in proportion to its
    // fair share (so the split follows weights and past use, not names); second pass: what
    // the first could not place (a gang larger than its part), in queue name order.
    let mut spare = Spare {
        left: u64::from(view.total_gpus).saturating_sub(queue_used.values().sum()),
        used: queue_used,
        most,
    };
    // Rounds of offers while some queue grows: a queue that could not use a non-zero offer
    // (its next gang is larger) leaves the later rounds. Each round places GPUs or makes a
    // queue leave, so the rounds end.
    let mut stuck: BTreeSet<&QueueId> = BTreeSet::new();
    loop {
        let mut growing: BTreeMap<&QueueId, (u64, f64, u64)> = BTreeMap::new();
        for (queue, kept, victims, _) in &sized_groups {
            let room = spare.room(queue);
            if room > 0 && !stuck.contains(queue) && !(kept.is_empty() && victims.is_empty()) {
                let fair = budget.get(queue).map_or(0.0, |s| s.fair_share);
                growing.insert(queue, (spare.used_by(queue), fair, room));
            }
        }
        if spare.left == 0 || growing.is_empty() {
            break;
        }
        let used: Vec<u64> = growing.values().map(|g| g.0).collect();
        let fair: Vec<f64> = growing.values().map(|g| g.1).collect();
        let rooms: Vec<u64> = growing.values().map(|g| g.2).collect();
        let offers = queues::leftover_offers(&used, &fair, &rooms, spare.left);
        let offers: BTreeMap<&QueueId, u64> = growing.keys().copied().zip(offers).collect();
        let grown = grow_groups(
            view,
            policy,
            &mut sized_groups,
            Some(&offers),
            &mut spare,
            &mut decision,
            preempted,
        );
        let mut newly_stuck = false;
        for (q, offer) in &offers {
            if *offer > 0 && !grown.contains_key(q) {
                newly_stuck |= stuck.insert(q);
            }
        }
        if grown.is_empty() && !newly_stuck {
            break;
        }
    }
    // What no offer placed, in queue name order.
    grow_groups(
        view,
        policy,
        &mut sized_groups,
        None,
        &mut spare,
        &mut decision,
        preempted,
    );
    decision
}

/// A queue's group of one class: the queue, its kept jobs, its preempted jobs, GPUs used.
type SizedGroup<'a> = (&'a QueueId, Vec<PolicyJob>, Vec<PolicyJob>, u64);

/// What work conservation hands out: GPUs nobody was given, each queue's GPUs in use and
/// the most each queue may hold (quota plus borrowing limit).
struct Spare<'a, 'm> {
    left: u64,
    used: BTreeMap<&'a QueueId, u64>,
    most: &'m BTreeMap<&'m QueueId, u32>,
}

impl Spare<'_, '_> {
    fn used_by(&self, queue: &QueueId) -> u64 {
        self.used.get(queue).copied().unwrap_or(0)
    }

    /// GPUs `queue` may still take.
    fn room(&self, queue: &QueueId) -> u64 {
        u64::from(self.most.get(queue).copied().unwrap_or(0)).saturating_sub(self.used_by(queue))
    }
}

/// One pass of work conservation over the groups, in order: each group may grow by what
/// its queue is offered (`offers`; `None`: anything left), within its queue's room. A
/// group's preempted jobs become candidates again. Returns the GPUs each queue grew by
/// (queues that did not grow are absent).
fn grow_groups<'a>(
    view: &ClusterView,
    policy: &dyn Policy,
    groups: &mut [SizedGroup<'a>],
    offers: Option<&BTreeMap<&'a QueueId, u64>>,
    spare: &mut Spare<'a, '_>,
    decision: &mut Decision,
    preempted: &mut BTreeMap<JobId, String>,
) -> BTreeMap<&'a QueueId, u64> {
    let mut grown: BTreeMap<&'a QueueId, u64> = BTreeMap::new();
    for (queue, kept, victims, used) in groups.iter_mut() {
        if spare.left == 0 {
            break;
        }
        kept.append(victims);
        let cap = match offers {
            Some(o) => o
                .get(*queue)
                .copied()
                .unwrap_or(0)
                .saturating_sub(grown.get(*queue).copied().unwrap_or(0)),
            None => spare.left,
        };
        let extra = spare.left.min(spare.room(queue)).min(cap);
        if extra == 0 || kept.is_empty() {
            continue;
        }
        let group_view = ClusterView {
            total_gpus: u32::try_from(*used + extra).unwrap_or(u32::MAX),
            ..*view
        };
        let sized = policy.allocate(&group_view, kept);
        let again: u64 = kept
            .iter()
            .map(|j| gpus(j, sized.workers.get(&j.id).copied().unwrap_or(0)))
            .sum();
        if again > *used {
            for job in kept.iter() {
                let w = sized.workers.get(&job.id).copied().unwrap_or(0);
                if w > 0 {
                    preempted.remove(&job.id);
                }
                decision.workers.insert(job.id.clone(), w);
            }
            let more = again - *used;
            spare.left -= more;
            *spare.used.entry(*queue).or_default() += more;
            *grown.entry(*queue).or_default() += more;
            *used = again;
        }
    }
    grown
}

/// GPUs of `workers` workers of `job`.
fn gpus(job: &PolicyJob, workers: u32) -> u64 {
    u64::from(workers) * u64::from(job.gpus_per_worker)
}

#[cfg(test)]
mod tests;
