//! The simulator's event loop: a discrete-time simulation of a GPU cluster running a
//! workload under one policy, in the Pollux simulator's order (advance every job by one
//! scheduling interval, then let the policy decide from what it could have observed, then
//! apply the changes, each costing the restart delay).
//!
//! Every decision is the service's own: [`converge_sched::decide::decide_queued`] (exactly
//! [`converge_sched::decide::decide`] when every job is in the default queue), with the job
//! views built from what the allocator service would observe (progress in samples through
//! a [`JobHistory`], so curves are fitted by the same [`FitCache`]; a noisy loss-like signal
//! from the measured validation curves; observed step times; attained service; the
//! contention measured on multi-node jobs). What a policy gets beyond that is what it
//! declares ([`converge_sched::policies::PolicyInputs`]); `optimus` declares the oracle
//! (the Pollux simulator's "Optimus+Oracle") and gets the true remaining work and throughput.
//! The queues' statuses (decayed usage) go from one decision to the next as the allocator
//! passes them through KV. No scheduling logic lives here.

use crate::apps::{Application, SimJob};
use crate::workload::WorkloadJob;
use converge_common::{
    HostId, JobId, PriorityClass, ProgressReport, QueueId, QueueSpec, QueueStatus, RankPlacement,
    ShadowAlgorithm,
};
use converge_sched::contention::ContentionSamples;
use converge_sched::decide::{
    AdaptiveBatch, Allocation, BatchSize, ClusterState, JobView, Oracle, QueueSetup, decide_queued,
};
use converge_sched::fit::FitConfig;
use converge_sched::fit_cache::{FitCache, ModelScope};
use converge_sched::goodput::{BatchLimits, GradientStats};
use converge_sched::history::JobHistory;
use converge_sched::placement::{HostFree, PlacementKind};
use converge_sched::policies::Policy;
use converge_sched::queues::{DEFAULT_USAGE_HALF_LIFE_S, default_queue};
use converge_sched::schedule::known_remaining_work;
use converge_sched::throughput::{StepObservation, ThroughputPrior};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::collections::BTreeMap;
use std::time::Instant;

/// Nodes of one GPU type in a cluster of several ([`SimConfig::gpu_groups`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGroup {
    /// The GPU type, as the traces name it (`aws`, `rtx`, `dgx-ext`, ...): its step times
    /// are the application's `placements-<type>.csv` and `scalability-<type>.csv`.
    pub gpu_type: String,
    pub nodes: u32,
    pub gpus_per_node: u32,
}

/// Simulation settings (defaults as in the Pollux simulator).
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Nodes of a cluster of one GPU type (the type of `placements.csv`); ignored when
    /// `gpu_groups` is not empty.
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// A cluster of several GPU types: its node groups, in host order (node `n000` first);
    /// empty: `nodes` × `gpus_per_node`. Each simulated host carries its type
    /// ([`HostFree::gpu_type`]), so placements use one type per job, and a job runs at the
    /// speed its type's measurements give.
    pub gpu_groups: Vec<NodeGroup>,
    /// Scheduling interval: how often the policy re-decides, seconds.
    pub scheduling_interval_s: f64,
    /// Time an allocation change costs a job, with no progress, seconds.
    pub restart_delay_s: f64,
    /// Goodput factor lost by a multi-node job sharing a node with another multi-node job
    /// (0 = no interference; Pollux's model).
    pub interference: f64,
    /// Relative standard deviation of the noise on the loss-like signal the policy sees.
    pub loss_noise: f64,
    pub seed: u64,
    /// Simulated time after which the run stops even if jobs remain, seconds.
    pub max_time_s: f64,
    /// How workers are put on nodes: first fit, or balancing contention and overhead (BCO).
    pub placement: PlacementKind,
    /// Keep every decision's inputs and result in [`SimResult::decisions`] (for tests that
    /// replay them through [`converge_sched::decide::decide`]; memory grows with the run).
    pub record_decisions: bool,
    /// Ablation: tell the decision that no contention was measured (as a cluster whose jobs
    /// never share a host would), whatever the simulated jobs show.
    pub ignore_contention: bool,
    /// Ablation: every job keeps its submitted batch size, even under a policy that adapts
    /// batch sizes (goodput).
    pub fixed_batch: bool,
    /// Ablation of the decision loop: a running job's batch changes only with a new
    /// placement (the service's batch-per-generation rule), not every interval.
    pub batch_per_generation: bool,
    /// The queues jobs are scheduled in ([`WorkloadJob::queue`]); empty: every job in the
    /// implicit default queue, which decides exactly as without queues.
    pub queues: BTreeMap<QueueId, QueueSpec>,
    /// Half-life of the queues' decayed usage, seconds (the allocator's `--usage-half-life`).
    pub usage_half_life_s: f64,
    /// Fraction of the jobs run as shadow variants (`arch = "shadow"`, [`SimJob::shadow`]),
    /// chosen by a seeded hash of each job's name ([`is_shadow`]); 0: none.
    pub shadow_fraction: f64,
    /// The shadow variants' algorithm (its measured statistical-efficiency penalty).
    pub shadow_algorithm: ShadowAlgorithm,
    /// What a policy that wants each job's remaining work is told
    /// ([`converge_sched::schedule::known_remaining_work`], as the service).
    pub work: WorkKnowledge,
    /// Which loop runs ([`SimLoop`]); [`simulate`] itself always runs the decision loop,
    /// [`crate::cli::run_policy`] dispatches on this.
    pub sim_loop: SimLoop,
}

/// What the workload's jobs tell the service about their work, and so what a policy can know
/// of a job's work left (`converge-sim simulate --work`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WorkKnowledge {
    /// Every job declares its work (a spec's `work_samples`: the epochs to its completion
    /// epoch, as a user passing `--epochs` knows them); a policy is told what is left.
    #[default]
    Declared,
    /// No job declares its work; each has a target loss (its loss-like value at its
    /// completion epoch, what a user asking for that quality would write), and a policy is
    /// told the fitted curve's estimate of the samples to it, or nothing while there is no
    /// curve or it does not reach the target.
    TargetLoss,
}

/// Which loop a simulation runs (`converge-sim simulate --loop`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SimLoop {
    /// The decision loop ([`simulate`]): each interval the simulator builds the decision's
    /// job views itself and calls [`converge_sched::decide::decide_queued`]; allocations
    /// change at once, batch sizes every interval.
    #[default]
    Decision,
    /// The service loop ([`crate::world`]): the allocator's scheduling step drives a
    /// simulated cluster through host plans, heartbeats and progress reports, with the
    /// service's lifecycle, stop rules, batch-per-generation rule and measurements.
    Service,
}

impl SimLoop {
    /// The other loop (for comparing the two on the same workloads).
    pub fn other(self) -> Self {
        match self {
            SimLoop::Decision => SimLoop::Service,
            SimLoop::Service => SimLoop::Decision,
        }
    }

    /// Its `--loop` name: `decision` or `service`.
    pub fn name(self) -> &'static str {
        match self {
            SimLoop::Decision => "decision",
            SimLoop::Service => "service",
        }
    }
}

/// Whether job `name` runs as a shadow variant under `seed` and `fraction`: the 64-bit
/// FNV-1a hash of the seed's little-endian bytes and the name, over 2⁶⁴, below `fraction`.
pub fn is_shadow(name: &str, seed: u64, fraction: f64) -> bool {
    if fraction <= 0.0 {
        return false;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in seed.to_le_bytes().iter().chain(name.as_bytes()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash as f64 / 18_446_744_073_709_551_616.0) < fraction
}

impl SimConfig {
    /// Every node's GPU type (`None`: the type of `placements.csv`) and GPU count, in host
    /// order.
    pub fn layout(&self) -> Vec<(Option<&str>, u32)> {
        if self.gpu_groups.is_empty() {
            return vec![(None, self.gpus_per_node); self.nodes as usize];
        }
        self.gpu_groups
            .iter()
            .flat_map(|g| {
                std::iter::repeat_n(
                    (Some(g.gpu_type.as_str()), g.gpus_per_node),
                    g.nodes as usize,
                )
            })
            .collect()
    }

    /// GPUs in the cluster.
    pub fn total_gpus(&self) -> u32 {
        self.layout().iter().map(|(_, g)| g).sum()
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 16,
            gpus_per_node: 4,
            gpu_groups: Vec::new(),
            scheduling_interval_s: 60.0,
            restart_delay_s: 30.0,
            interference: 0.0,
            loss_noise: 0.02,
            seed: 1,
            max_time_s: 60.0 * 24.0 * 3600.0,
            placement: PlacementKind::FirstFit,
            record_decisions: false,
            ignore_contention: false,
            fixed_batch: false,
            batch_per_generation: false,
            queues: BTreeMap::new(),
            shadow_fraction: 0.0,
            shadow_algorithm: ShadowAlgorithm::Ma,
            work: WorkKnowledge::Declared,
            sim_loop: SimLoop::Decision,
            usage_half_life_s: DEFAULT_USAGE_HALF_LIFE_S,
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("job {job}: unknown application {app:?} (known: {known})")]
    UnknownApplication {
        job: String,
        app: String,
        known: String,
    },
    #[error("job name {0:?} is not a valid job id")]
    BadName(String),
    #[error("the cluster has no GPUs")]
    NoGpus,
    /// A node group's GPU type without step times for an application of the workload.
    #[error(
        "application {app} has no step times for GPU type {gpu_type:?} (load its \
         placements-{gpu_type}.csv and scalability-{gpu_type}.csv)"
    )]
    MissingGpuType { app: String, gpu_type: String },
    /// An option the service loop (`--loop service`) does not simulate.
    #[error("{0} is not available with --loop service")]
    NotInServiceLoop(String),
    #[error("queue name {0:?} is not a valid queue name")]
    BadQueue(String),
    /// Jobs name queues the run does not define: they would wait forever, as the service
    /// keeps a job whose queue does not exist waiting.
    #[error(
        "{jobs} job(s) are in queue(s) this run does not define: {missing} (defined: {defined}); \
         define them (`converge-sim queues --queues NAME=QUOTA`) or drop the workload's queue \
         column"
    )]
    MissingQueues {
        jobs: usize,
        missing: String,
        defined: String,
    },
}

/// Per-job outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    pub name: String,
    pub application: String,
    pub submitted_at: f64,
    pub completed_at: Option<f64>,
    pub restarts: u32,
    /// Restarts that changed the job's goodput by at most 10 % (its true progress rate with
    /// the new worker count against the old, packed, at the time of the change): a job with
    /// any is *thrashing* by the goodput issue's rule (more restarts than decisions that
    /// changed its goodput by over 10 %).
    pub low_gain_restarts: u32,
    /// Seconds from submission until the job's normalized loss first fell to 10 % / 5 %.
    pub time_to_90: Option<f64>,
    pub time_to_95: Option<f64>,
    /// Its queue and priority class.
    pub queue: QueueId,
    pub priority: PriorityClass,
    /// The first decision that placed it (it makes progress a restart delay later).
    pub first_placed_at: Option<f64>,
    /// Times the queues preempted it whole (to serve a higher class of its queue, or to
    /// hand borrowed GPUs back).
    pub preemptions: u32,
    /// GPU-seconds it held on each GPU type of a mixed cluster (`--cluster`), restart delays
    /// included; empty on a cluster without types. A placement over several types splits
    /// its time by GPUs per type.
    pub gpu_seconds_by_type: BTreeMap<String, f64>,
    /// GPU-seconds it held in all, restart delays included.
    pub gpu_seconds: f64,
    /// The service loop only: the job's normalized loss (1 = where it started, 0 = where
    /// its completion epoch ends it) when the service's stop rules ended it before its
    /// completion epoch; `None` when its program finished (and always in the decision loop).
    pub stopped_at_loss: Option<f64>,
}

/// One scheduling interval.
#[derive(Debug, Clone, PartialEq)]
pub struct IntervalRecord {
    /// End of the interval, seconds.
    pub time: f64,
    /// Fraction of GPUs allocated to jobs.
    pub utilization: f64,
    /// Mean normalized loss (1 = where the job started, 0 = where it ends) over submitted,
    /// unfinished jobs; `None` when there are none.
    pub avg_normalized_loss: Option<f64>,
    /// Wall time of the policy and the placement for this interval, seconds.
    pub decision_s: f64,
    pub active_jobs: usize,
    /// Each queue's status after the interval's decision (GPUs held, borrowed, lent, fair
    /// share, decayed usage, running and pending jobs); empty after the last interval.
    pub queues: BTreeMap<QueueId, QueueStatus>,
}

/// One decision as the simulator asked for it: the inputs of [`converge_sched::decide::decide`] and what it returned.
#[derive(Debug, Clone)]
pub struct RecordedDecision {
    pub now: f64,
    pub hosts: Vec<HostFree>,
    pub contention_per_shared_job: f64,
    pub jobs: Vec<JobView>,
    pub allocation: Allocation,
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct SimResult {
    pub policy: String,
    pub jobs: Vec<JobOutcome>,
    pub intervals: Vec<IntervalRecord>,
    /// Whether every job completed before `max_time_s`.
    pub finished: bool,
    /// Wall time of the whole simulation, seconds (one thread).
    pub wall_s: f64,
    /// Intervals in which the policy asked for more GPUs than the cluster has, or gave a
    /// job a size outside its bounds (a policy bug; placement then drops the excess).
    pub policy_violations: u32,
    /// Every decision, when [`SimConfig::record_decisions`] is set.
    pub decisions: Vec<RecordedDecision>,
    /// Every whole-job preemption by the queues, in time order.
    pub preemptions: Vec<Preemption>,
    /// With `--work target-loss` in the decision loop, one per job view: how the work left
    /// that the policy was told compares with the truth ([`WorkEstimate`]). Empty otherwise.
    pub work_estimates: Vec<WorkEstimate>,
}

/// One job view's remaining-work estimate against the truth, with target losses only: the
/// fitted curve's samples to the target (`known_remaining_work`, as the service) against
/// the job's remaining work, the samples to its completion (what its JCT counts). The target
/// is the completion epoch's loss, which the measured run reaches at the latest one epoch
/// before completion, so an exact estimate of the samples to the target scores below 1
/// (0 in the job's last epoch). The truth is counted in statistical progress and converted
/// to samples at the job's ratio of samples to progress so far (backward-looking: larger
/// batches later progress less per sample).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkEstimate {
    /// Share of the job's work done, 0–1.
    pub done: f64,
    /// Estimate divided by the truth; `None` when the policy was told nothing (no fitted
    /// curve, or one that does not reach the target).
    pub ratio: Option<f64>,
}

/// A job the queues preempted whole ([`converge_sched::decide::QueuedAllocation::preempted`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Preemption {
    /// The decision's time, seconds.
    pub time: f64,
    pub job: JobId,
    /// Its workers, all stopped.
    pub workers: u32,
    pub reason: String,
}

pub(crate) struct Tracked {
    pub(crate) job: SimJob,
    pub(crate) id: JobId,
    pub(crate) max_workers: u32,
    pub(crate) placement: Vec<RankPlacement>,
    pub(crate) samples: f64,
    /// What the allocator would have of the job's progress reports (rank 0, one per
    /// interval while placed).
    pub(crate) history: JobHistory,
    pub(crate) reports: u64,
    pub(crate) start_loss: f64,
    pub(crate) final_loss: f64,
    pub(crate) time_to_90: Option<f64>,
    pub(crate) time_to_95: Option<f64>,
    /// Step times observed per configuration (workers, nodes, per-worker batch).
    pub(crate) steps: Vec<StepObservation>,
    /// The distinct step observations per GPU type (a placement on one type; on a cluster
    /// of several), as the service groups a generation's by its hosts' `gpu.type`.
    pub(crate) type_steps: BTreeMap<String, Vec<StepObservation>>,
    /// Batch limits when the job's batch size may adapt (its program applies the decided
    /// batch and reports gradient statistics).
    pub(crate) limits: Option<BatchLimits>,
    /// Its latest gradient statistics.
    pub(crate) gradient: Option<GradientStats>,
    /// See [`JobOutcome::low_gain_restarts`].
    pub(crate) low_gain_restarts: u32,
    pub(crate) queue: QueueId,
    pub(crate) priority: PriorityClass,
    /// When its current run was placed.
    pub(crate) started_at: Option<f64>,
    pub(crate) first_placed_at: Option<f64>,
    pub(crate) preemptions: u32,
    /// GPUs of the current placement per GPU type (types of `--cluster` only).
    pub(crate) gpus_by_type: Vec<(String, u32)>,
    /// See [`JobOutcome::gpu_seconds_by_type`].
    pub(crate) gpu_seconds_by_type: BTreeMap<String, f64>,
    /// See [`JobOutcome::stopped_at_loss`].
    pub(crate) stopped_at_loss: Option<f64>,
}

impl Tracked {
    /// The job's true loss-like value and its normalized loss (1 = where it started, 0 =
    /// where it ends) at `now`, noting when it first fell to 10 % and 5 %; `None` once it has
    /// completed (its loss reduction is then complete at the completion time at the latest).
    pub(crate) fn observe_loss(&mut self, app: &Application, now: f64) -> Option<(f64, f64)> {
        let age = now - self.job.submitted_at;
        if let Some(done) = self.job.completed_at {
            self.time_to_90.get_or_insert(done - self.job.submitted_at);
            self.time_to_95.get_or_insert(done - self.job.submitted_at);
            return None;
        }
        let epoch = f64::from(self.job.epoch) + epoch_fraction(&self.job, app);
        let true_loss = app.loss_like(self.job.target_batch_size, epoch);
        let span = self.start_loss - self.final_loss;
        let normalized = if span.abs() > 1e-12 {
            ((true_loss - self.final_loss) / span).clamp(0.0, 1.0)
        } else {
            0.0
        };
        if normalized <= 0.10 {
            self.time_to_90.get_or_insert(age);
        }
        if normalized <= 0.05 {
            self.time_to_95.get_or_insert(age);
        }
        Some((true_loss, normalized))
    }
    /// Moves the job to placement `new` at `now` (empty: stops it), running `batch`
    /// (per-worker micro-batch, accumulation steps) when given; a non-empty placement costs
    /// the restart delay ([`SimJob::reallocate`]). `before`: the workers it ran with before
    /// the change (0: it was not running), for [`JobOutcome::low_gain_restarts`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn place(
        &mut self,
        app: &Application,
        new: Vec<RankPlacement>,
        batch: Option<(u32, u32)>,
        before: usize,
        layout: &[(Option<&str>, u32)],
        restart_delay_s: f64,
        now: f64,
    ) {
        let gpus_per_node = layout.iter().map(|(_, g)| *g).max().unwrap_or(1);
        if before > 0 && !new.is_empty() {
            let rate = |w: usize| {
                let w = u32::try_from(w).unwrap_or(u32::MAX);
                self.job.progress_rate(app, w, gpus_per_node)
            };
            let (before, after) = (rate(before), rate(new.len()));
            if before > 0.0 && (after / before - 1.0).abs() <= 0.1 {
                self.low_gain_restarts += 1;
            }
        }
        let mut by_type: BTreeMap<String, u32> = BTreeMap::new();
        for rank in &new {
            if let Some(gpu_type) = node_index(&rank.host)
                .and_then(|n| layout.get(n))
                .and_then(|(t, _)| *t)
            {
                *by_type.entry(gpu_type.to_string()).or_default() += rank.gpus.len() as u32;
            }
        }
        // The distinct types of the new placement, sorted (the map's keys).
        self.job.gpu_types = by_type.keys().cloned().collect();
        self.gpus_by_type = by_type.into_iter().collect();
        self.job
            .reallocate(app, per_node(&new, layout.len()), restart_delay_s, batch);
        self.started_at = (!new.is_empty()).then_some(now);
        if !new.is_empty() {
            self.first_placed_at.get_or_insert(now);
        }
        self.placement = new;
    }
    /// What the run reports of the job.
    pub(crate) fn outcome(self) -> JobOutcome {
        let t = self;
        JobOutcome {
            name: t.job.name.clone(),
            application: t.job.app.clone(),
            submitted_at: t.job.submitted_at,
            completed_at: t.job.completed_at,
            restarts: t.job.restarts,
            low_gain_restarts: t.low_gain_restarts,
            time_to_90: t.time_to_90,
            time_to_95: t.time_to_95,
            queue: t.queue,
            priority: t.priority,
            first_placed_at: t.first_placed_at,
            preemptions: t.preemptions,
            gpu_seconds_by_type: t.gpu_seconds_by_type,
            gpu_seconds: t.job.attained_gpu_seconds,
            stopped_at_loss: t.stopped_at_loss,
        }
    }
}

pub(crate) fn host_name(node: u32) -> HostId {
    HostId::new(format!("n{node:03}")).expect("valid host id")
}

/// The node index of a host named by [`host_name`].
pub(crate) fn node_index(host: &HostId) -> Option<usize> {
    host.as_str().strip_prefix('n')?.parse().ok()
}

/// GPUs per node, in node order, of a placement.
fn per_node(placement: &[RankPlacement], nodes: usize) -> Vec<u32> {
    let mut counts = vec![0u32; nodes];
    for p in placement {
        if let Some(n) = node_index(&p.host).filter(|&n| n < nodes) {
            counts[n] += p.gpus.len() as u32;
        }
    }
    counts.into_iter().filter(|&c| c > 0).collect()
}

/// Refuses jobs whose queue is neither the default nor one of `queues`.
fn check_queues_defined(
    jobs: &[Tracked],
    queues: &BTreeMap<QueueId, QueueSpec>,
) -> Result<(), SimError> {
    let default = default_queue();
    let mut missing: BTreeMap<&QueueId, usize> = BTreeMap::new();
    for j in jobs {
        if j.queue != default && !queues.contains_key(&j.queue) {
            *missing.entry(&j.queue).or_default() += 1;
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut defined: Vec<String> = vec![default.to_string()];
    defined.extend(queues.keys().map(|q| q.to_string()));
    Err(SimError::MissingQueues {
        jobs: missing.values().sum(),
        missing: missing
            .iter()
            .map(|(q, n)| format!("{q} ({n} job(s))"))
            .collect::<Vec<_>>()
            .join(", "),
        defined: defined.join(", "),
    })
}

fn nodes_of(placement: &[RankPlacement]) -> Vec<&HostId> {
    let mut hosts: Vec<&HostId> = placement.iter().map(|p| &p.host).collect();
    hosts.sort();
    hosts.dedup();
    hosts
}

/// The simulated cluster before the first interval: its jobs (none placed), hosts and
/// node layout.
pub(crate) struct Cluster<'c> {
    pub(crate) jobs: Vec<Tracked>,
    pub(crate) hosts: Vec<HostFree>,
    pub(crate) layout: Vec<(Option<&'c str>, u32)>,
    /// Whether the nodes carry several GPU types.
    pub(crate) several_types: bool,
    /// The largest node's GPUs: the oracle's and the restart accounting's packing.
    pub(crate) gpus_per_node: u32,
    pub(crate) total_gpus: u32,
}

impl<'c> Cluster<'c> {
    /// The workload's jobs on `cfg`'s cluster; `adaptive`: jobs whose application allows it
    /// adapt their batch size (a policy that reads goodput).
    pub(crate) fn new(
        apps: &BTreeMap<String, Application>,
        workload: &[WorkloadJob],
        cfg: &'c SimConfig,
        adaptive: bool,
    ) -> Result<Self, SimError> {
        let layout = cfg.layout();
        let total_gpus = cfg.total_gpus();
        if total_gpus == 0 {
            return Err(SimError::NoGpus);
        }
        let several_types = {
            let mut types: Vec<_> = layout.iter().map(|(t, _)| *t).collect();
            types.sort_unstable();
            types.dedup();
            types.len() > 1
        };
        // The oracle's and the restart accounting's packing: the largest node.
        let gpus_per_node = layout.iter().map(|(_, g)| *g).max().unwrap_or(1);
        for w in workload {
            if let Some(app) = apps.get(&w.application)
                && let Some(gpu_type) = layout
                    .iter()
                    .filter_map(|(t, _)| *t)
                    .find(|t| !app.has_gpu_type(t))
            {
                return Err(SimError::MissingGpuType {
                    app: app.name.clone(),
                    gpu_type: gpu_type.to_string(),
                });
            }
        }
        let known = apps.keys().cloned().collect::<Vec<_>>().join(", ");
        let mut jobs = Vec::with_capacity(workload.len());
        for w in workload {
            let app = apps
                .get(&w.application)
                .ok_or_else(|| SimError::UnknownApplication {
                    job: w.name.clone(),
                    app: w.application.clone(),
                    known: known.clone(),
                })?;
            let id = JobId::new(w.name.clone()).map_err(|_| SimError::BadName(w.name.clone()))?;
            // Every application but ncf adapts its batch size under a goodput policy (the
            // Pollux artifact runs ncf at a fixed batch of 32,768 on one GPU).
            let limits = (!cfg.fixed_batch && w.application != "ncf")
                .then(|| {
                    BatchLimits::new(
                        app.init_batch_size,
                        app.max_batch_size,
                        app.min_local_bsz,
                        app.max_local_bsz,
                    )
                    .ok()
                })
                .flatten()
                .filter(|_| adaptive);
            let by_batch = (w.batch_size / app.min_local_bsz.max(1)).max(1);
            let max_workers = if w.application == "ncf" {
                1
            } else if let Some(l) = &limits {
                l.max_workers().min(total_gpus)
            } else {
                by_batch.max(w.num_replicas).min(total_gpus)
            };
            let start_loss = app.loss_like(w.batch_size, 0.0);
            let final_loss =
                app.loss_like(w.batch_size, f64::from(app.completion_epoch(w.batch_size)));
            jobs.push(Tracked {
                job: {
                    let mut job = SimJob::new(&w.name, app, w.time, w.num_replicas, w.batch_size);
                    job.shadow = is_shadow(&w.name, cfg.seed, cfg.shadow_fraction)
                        .then_some(cfg.shadow_algorithm);
                    job
                },
                id,
                max_workers,
                placement: Vec::new(),
                samples: 0.0,
                history: JobHistory::default(),
                reports: 0,
                start_loss,
                final_loss,
                time_to_90: None,
                time_to_95: None,
                steps: Vec::new(),
                type_steps: BTreeMap::new(),
                limits,
                gradient: None,
                low_gain_restarts: 0,
                queue: match &w.queue {
                    Some(q) => q.parse().map_err(|_| SimError::BadQueue(q.clone()))?,
                    None => default_queue(),
                },
                priority: w.priority,
                started_at: None,
                first_placed_at: None,
                preemptions: 0,
                gpus_by_type: Vec::new(),
                gpu_seconds_by_type: BTreeMap::new(),
                stopped_at_loss: None,
            });
        }
        check_queues_defined(&jobs, &cfg.queues)?;
        let hosts: Vec<HostFree> = layout
            .iter()
            .enumerate()
            .map(|(n, &(gpu_type, gpus))| HostFree {
                gpu_type: gpu_type.map(str::to_string),
                ..HostFree::new(host_name(n as u32), (0..gpus).collect())
            })
            .collect();
        Ok(Self {
            jobs,
            hosts,
            layout,
            several_types,
            gpus_per_node,
            total_gpus,
        })
    }
}

/// Runs `workload` under `policy`. Deterministic for a seed (decision times aside).
pub fn simulate(
    apps: &BTreeMap<String, Application>,
    workload: &[WorkloadJob],
    policy: &dyn Policy,
    cfg: &SimConfig,
) -> Result<SimResult, SimError> {
    let wall = Instant::now();
    let wants = policy.inputs();
    // The service fits every job's curve; here curves are fitted only where a policy uses
    // them, or where they are all it can know of a job's work left.
    let fit_curves = wants.curves
        || (cfg.work == WorkKnowledge::TargetLoss && (wants.estimates || wants.oracle));
    let Cluster {
        mut jobs,
        hosts,
        layout,
        several_types,
        gpus_per_node,
        total_gpus,
    } = Cluster::new(apps, workload, cfg, wants.goodput)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let noise = Normal::new(0.0, cfg.loss_noise.max(0.0)).expect("finite noise");
    let fit_cfg = FitConfig::default();
    let throughput_prior = ThroughputPrior::default();
    let mut fits = FitCache::new();
    let mut intervals = Vec::new();
    let mut decisions = Vec::new();
    // Contention measured on multi-node jobs sharing a node (what the agents' step times
    // would show).
    let mut contention_seen = ContentionSamples::default();
    let mut now = 0.0;
    let mut policy_violations = 0;
    // The queues' statuses, passed from one decision to the next as the allocator passes
    // them through KV `converge-queue-status`.
    let mut queue_statuses: BTreeMap<QueueId, QueueStatus> = BTreeMap::new();
    let mut preemptions = Vec::new();
    let mut work_estimates = Vec::new();

    loop {
        advance(
            &mut jobs,
            apps,
            cfg,
            now,
            cfg.scheduling_interval_s,
            &mut contention_seen,
        );
        now += cfg.scheduling_interval_s;

        // 2. What the allocator would observe: progress, a noisy loss-like signal, step times.
        let mut norm_losses = Vec::new();
        for t in jobs.iter_mut() {
            if t.job.submitted_at > now {
                continue;
            }
            let Some((true_loss, normalized)) = t.observe_loss(&apps[&t.job.app], now) else {
                continue;
            };
            norm_losses.push(normalized);
            if fit_curves && !t.placement.is_empty() {
                let observed = (true_loss * (1.0 + noise.sample(&mut rng))).max(0.0);
                t.reports += 1;
                t.history.add(&ProgressReport::new(
                    t.id.clone(),
                    u64::from(t.job.restarts),
                    0,
                    t.placement[0].host.clone(),
                    t.reports,
                    t.samples.round() as u64,
                    observed,
                    now,
                ));
            }
        }
        let active: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].job.submitted_at <= now && jobs[i].job.completed_at.is_none())
            .collect();
        let all_done = jobs.iter().all(|t| t.job.completed_at.is_some());
        if all_done || now >= cfg.max_time_s {
            intervals.push(IntervalRecord {
                time: now,
                utilization: 0.0,
                avg_normalized_loss: None,
                decision_s: 0.0,
                active_jobs: 0,
                queues: BTreeMap::new(),
            });
            break;
        }

        // 3. The decision, as the service takes it; placement keeps unchanged jobs where
        //    they are. Curve and model fits count as decision time: the service fits inside
        //    its scheduling step too.
        let started = Instant::now();
        let mut views = Vec::with_capacity(active.len());
        for &i in &active {
            let t = &mut jobs[i];
            let app = &apps[&t.job.app];
            let curve = if fit_curves {
                fits.curve(&t.id, &t.history, &fit_cfg, true)
            } else {
                None
            };
            if let Some(seen) = observe_step(&t.job, app) {
                if !t.steps.contains(&seen) {
                    t.steps.push(seen);
                }
                if let ([gpu_type], true) = (t.job.gpu_types.as_slice(), several_types) {
                    let on_type = t.type_steps.entry(gpu_type.clone()).or_default();
                    if !on_type.contains(&seen) {
                        on_type.push(seen);
                    }
                }
            }
            // Its speed on each type it ran on, at its latest per-worker batch.
            let local_batch = t.steps.last().map_or(0.0, |o| o.local_batch);
            let gpu_type_speeds: BTreeMap<String, f64> = t
                .type_steps
                .iter()
                .filter_map(|(gpu_type, seen)| {
                    let model = fits.model_on_type(&t.id, gpu_type, seen, &throughput_prior);
                    converge_sched::gpu_types::speed(&model, local_batch)
                        .map(|v| (gpu_type.clone(), v))
                })
                .collect();
            if let Some((sqr, var)) = t.job.grad_stats(app) {
                t.gradient = GradientStats::new(sqr, var).or(t.gradient);
            }
            // Every job gets a throughput model: BCO placement prices placements with it. On
            // a cluster of several types, a placed job's model is its current type's (as
            // the service's).
            let on_current_type = match t.job.gpu_types.as_slice() {
                [gpu_type] => t.type_steps.get(gpu_type).map(|seen| (gpu_type, seen)),
                _ => None,
            };
            let model = match on_current_type {
                Some((gpu_type, seen)) => {
                    Some(fits.model_on_type(&t.id, gpu_type, seen, &throughput_prior))
                }
                None => (!t.steps.is_empty())
                    .then(|| fits.model(&t.id, ModelScope::All, &t.steps, &throughput_prior)),
            };
            let workers: u32 = t.job.placement.iter().sum();
            let remaining_work = if wants.estimates || wants.oracle {
                known_remaining_work(
                    (cfg.work == WorkKnowledge::Declared)
                        .then(|| declared_samples_left(&t.job, app)),
                    curve.as_ref(),
                    Some(t.final_loss),
                    t.samples,
                )
            } else {
                None
            };
            if cfg.work == WorkKnowledge::TargetLoss && (wants.estimates || wants.oracle) {
                let total = declared_samples_total(&t.job, app);
                let left = declared_samples_left(&t.job, app);
                let done = total - left;
                let per_progress = if done > 0.0 && t.samples > 0.0 {
                    t.samples / done
                } else {
                    1.0
                };
                if total > 0.0 && left > 0.0 {
                    work_estimates.push(WorkEstimate {
                        done: (done / total).clamp(0.0, 1.0),
                        ratio: remaining_work.map(|r| r / (left * per_progress)),
                    });
                }
            }
            let curve = curve.filter(|_| wants.curves);
            views.push(JobView {
                id: t.id.clone(),
                gpus_per_worker: 1,
                min_workers: 1,
                max_workers: t.max_workers,
                requested_workers: t.job.requested_replicas.clamp(1, t.max_workers),
                workers_declared: true,
                submitted_at: t.job.submitted_at,
                placement: t.placement.clone(),
                curve,
                samples: t.samples,
                loss_scale: t.history.loss_scale(),
                samples_per_s_per_worker: t
                    .job
                    .observed_step(app)
                    .map(|(samples_per_s, _)| samples_per_s / f64::from(workers.max(1))),
                attained_gpu_seconds: t.job.attained_gpu_seconds,
                model,
                batch: BatchSize::Total(f64::from(t.job.target_batch_size)),
                remaining_work,
                restarts: t.job.restarts,
                // Every restart stalls a simulated job for the restart delay: what a job
                // that has restarted has measured.
                restart_cost_s: (t.job.restarts > 0).then_some(cfg.restart_delay_s),
                adaptive: t.limits.map(|limits| AdaptiveBatch {
                    limits,
                    max_per_worker_by_type: app.max_local_bsz_by_type(),
                    gradient: t.gradient,
                }),
                oracle: wants.oracle.then(|| Oracle {
                    throughput: (1..=t.max_workers)
                        .map(|w| t.job.progress_rate(app, w, gpus_per_node))
                        .collect(),
                    remaining_work: t.job.remaining_progress(app),
                }),
                hosts: None,
                queue: t.queue.clone(),
                priority: t.priority,
                started_at: t.started_at.filter(|_| !t.placement.is_empty()),
                shadow: t.job.shadow,
                // A workload names each job's model: the service's `model` label.
                family: Some(t.job.app.clone()),
                gpu_type_speeds,
                // Each job declares its work or a target loss (`WorkKnowledge`).
                exploratory: false,
            });
        }
        let cluster = ClusterState {
            now,
            hosts: &hosts,
            contention_per_shared_job: if cfg.ignore_contention {
                0.0
            } else {
                contention_seen.per_shared_job()
            },
        };
        let queued = decide_queued(
            &cluster,
            &views,
            policy,
            cfg.placement,
            &QueueSetup {
                specs: &cfg.queues,
                previous: &queue_statuses,
                half_life_s: cfg.usage_half_life_s,
            },
        );
        let decision_s = started.elapsed().as_secs_f64();
        queue_statuses = queued.statuses;
        for (id, why) in &queued.preempted {
            if let Some(t) = jobs.iter_mut().find(|t| &t.id == id) {
                t.preemptions += 1;
                preemptions.push(Preemption {
                    time: now,
                    job: id.clone(),
                    workers: t.placement.len() as u32,
                    reason: why.clone(),
                });
            }
        }
        let allocation = queued.allocation;
        if allocation.violates(&hosts) {
            policy_violations += 1;
        }
        let (placed, batches) = if cfg.record_decisions {
            let kept = (allocation.placements.clone(), allocation.batches.clone());
            decisions.push(RecordedDecision {
                now,
                hosts: hosts.clone(),
                contention_per_shared_job: cluster.contention_per_shared_job,
                jobs: views,
                allocation,
            });
            kept
        } else {
            (allocation.placements, allocation.batches)
        };

        // 4. Apply: every change of placement restarts the job.
        let mut allocated = 0u32;
        for &i in &active {
            let t = &mut jobs[i];
            let new = placed.get(&t.id).cloned().unwrap_or_default();
            allocated += new.iter().map(|p| p.gpus.len() as u32).sum::<u32>();
            let app = &apps[&t.job.app];
            let batch = batches
                .get(&t.id)
                .map(|plan| (plan.per_worker, plan.accum_steps));
            if new != t.placement {
                let before = t.placement.len();
                t.place(app, new, batch, before, &layout, cfg.restart_delay_s, now);
            } else if !cfg.batch_per_generation
                && batch.is_some()
                && batch != Some((t.job.atomic_bsz(), t.job.accum_steps()))
            {
                t.job.set_batch(app, batch);
            }
        }
        intervals.push(IntervalRecord {
            time: now,
            utilization: f64::from(allocated) / f64::from(total_gpus),
            avg_normalized_loss: (!norm_losses.is_empty())
                .then(|| norm_losses.iter().sum::<f64>() / norm_losses.len() as f64),
            decision_s,
            active_jobs: active.len(),
            queues: queue_statuses.clone(),
        });
    }

    let finished = jobs.iter().all(|t| t.job.completed_at.is_some());
    Ok(SimResult {
        policy: policy.name().to_string(),
        jobs: jobs.into_iter().map(Tracked::outcome).collect(),
        intervals,
        finished,
        wall_s: wall.elapsed().as_secs_f64(),
        policy_violations,
        decisions,
        preemptions,
        work_estimates,
    })
}

/// Advances every placed job by `seconds` from `now` (Pollux's interference rule: a
/// multi-node job slows down when one of its nodes hosts another multi-node job), adding
/// the slowdowns the agents' step times would show to `contention_seen`.
pub(crate) fn advance(
    jobs: &mut [Tracked],
    apps: &BTreeMap<String, Application>,
    cfg: &SimConfig,
    now: f64,
    seconds: f64,
    contention_seen: &mut ContentionSamples,
) {
    let mut multi_node_jobs_per_node: BTreeMap<&HostId, u32> = BTreeMap::new();
    // Completed jobs keep their last placement in `Tracked` but hold no GPUs.
    for t in jobs.iter().filter(|t| t.job.completed_at.is_none()) {
        let nodes = nodes_of(&t.placement);
        if nodes.len() > 1 {
            for n in nodes {
                *multi_node_jobs_per_node.entry(n).or_default() += 1;
            }
        }
    }
    let mut interference = vec![0.0; jobs.len()];
    for (i, t) in jobs.iter().enumerate() {
        let nodes = nodes_of(&t.placement);
        let sharing = nodes
            .iter()
            .map(|n| multi_node_jobs_per_node.get(n).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        if nodes.len() > 1 && sharing > 1 {
            interference[i] = cfg.interference;
            // What the agents would measure: this job's steps are slower by
            // 1/(1 − f) − 1 while `sharing` multi-node jobs share one of its NICs.
            // A shadow job's step does not slow (its sync rounds do): no sample.
            if cfg.interference > 0.0 && t.job.completed_at.is_none() && t.job.shadow.is_none() {
                let slowdown = 1.0 / (1.0 - cfg.interference) - 1.0;
                contention_seen.add(slowdown, sharing);
            }
        }
    }
    for (t, f) in jobs.iter_mut().zip(&interference) {
        if t.job.submitted_at > now || t.job.completed_at.is_some() {
            continue;
        }
        let app = &apps[&t.job.app];
        let held_before = t.job.attained_gpu_seconds;
        t.samples += t.job.step(app, now, seconds, *f);
        let held = t.job.attained_gpu_seconds - held_before;
        let gpus: u32 = t.gpus_by_type.iter().map(|(_, g)| g).sum();
        if held > 0.0 && gpus > 0 {
            for (gpu_type, g) in &t.gpus_by_type {
                *t.gpu_seconds_by_type.entry(gpu_type.clone()).or_default() +=
                    held * f64::from(*g) / f64::from(gpus);
            }
        }
    }
}

/// What an agent observes of a placed job's step: workers, nodes spanned, the per-worker
/// micro-batch and the seconds of one forward/backward pass with its synchronization (no
/// interference; accumulation passes left out, as Pollux's profile records them); `None`
/// when not placed. No sync time: the applications' measured ones
/// ([`Application::throughput`]) are left out so the simulator's results stay those of the
/// step-only fit, which on these measurements is about as good
/// (`throughput::tests::pollux_sync_times_report`).
fn observe_step(job: &SimJob, app: &Application) -> Option<StepObservation> {
    if job.placement.is_empty() {
        return None;
    }
    let workers: u32 = job.placement.iter().sum();
    let nodes = job.placement.iter().filter(|&&g| g > 0).count() as u32;
    let (step_time_s, sync) =
        app.throughput_on(&job.gpu_types, &job.placement, f64::from(job.atomic_bsz()));
    // A shadow worker reports a local step, compute only, and sync_s 0.
    let (step_time_s, sync_time_s) = match job.shadow {
        Some(_) => ((step_time_s - sync).max(step_time_s * 1e-3), Some(0.0)),
        None => (step_time_s, None),
    };
    Some(StepObservation {
        workers,
        nodes,
        local_batch: f64::from(job.atomic_bsz()),
        step_time_s,
        sync_time_s,
    })
}

/// Work the job has left as its user declared it: the epochs to its completion epoch not yet
/// done, times the application's epoch size (samples in the first epoch at the initial batch
/// size, from the statistical progress of the measured runs). The simulator's stand-in for
/// a job spec's epoch budget and a trainer's dataset size.
fn declared_samples_left(job: &SimJob, app: &Application) -> f64 {
    let done = f64::from(job.epoch) + epoch_fraction(job, app);
    (declared_samples_total(job, app) - done * epoch_samples(app)).max(0.0)
}

/// Samples of one epoch at the application's initial batch size.
fn epoch_samples(app: &Application) -> f64 {
    app.progress(1) * f64::from(app.init_batch_size)
}

/// The work a job declares (a spec's `work_samples`): its epochs to its completion epoch
/// at its submitted batch size, each of [`epoch_samples`].
pub(crate) fn declared_samples_total(job: &SimJob, app: &Application) -> f64 {
    f64::from(app.completion_epoch(job.target_batch_size) + 1) * epoch_samples(app)
}

/// Fraction of the current epoch done, from statistical progress.
fn epoch_fraction(job: &SimJob, app: &Application) -> f64 {
    let start = app.progress(job.epoch);
    let end = app.progress(job.epoch + 1);
    if end > start {
        ((job.progress - start) / (end - start)).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests;
