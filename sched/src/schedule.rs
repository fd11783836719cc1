//! One scheduling step as a pure function: from job specs, job statuses, host telemetry and
//! progress histories at time `now`, compute the next job statuses, host plans and events.
//! The service calls it on every trigger and writes what changed; tests and the simulator
//! call it directly. No I/O, no clock (`now` is an argument).
//!
//! Lifecycle of a job: `pending` → (placed) → `restarting` → (no worker of an older
//! generation alive on any live host) → `running` → `completed` / `failed` / `cancelled`.
//! An allocation change bumps the job's generation and goes through `restarting` again, so
//! the old generation checkpoints and exits before the new one starts (generation fencing).

use crate::contention::{
    ContentionSamples, HostNic, JobCost, host_nic_background, ring_nic_bytes_per_s,
};
use crate::decide::{
    AdaptiveBatch, BatchSize, ClusterState, JobView, QueueSetup, decide_queued, priority_order,
};
use crate::fit::{Curve, FitConfig, samples_to_reach};
use crate::fit_cache::{FitCache, ModelScope};
use crate::goodput::{BatchLimits, BatchPlan, GradientStats};
use crate::history::JobHistory;
use crate::placement::{HostFree, PlacementKind, master_port};
use crate::policies::{Policy, PolicyParams, Quality};
use crate::ps_plan::{PsHost, PsJob, PsPlan, plan_ps_job};
use crate::stop::{self, StopInputs, predicted_final_loss};
use crate::throughput::{StepObservation, ThroughputModel, ThroughputPrior};
use converge_common::{
    AssignedBatch, BatchSpec, ChangeCause, EndReason, Event, EventKind, HostId, HostPlan,
    HostTelemetry, JobBatch, JobEnd, JobId, JobPhase, JobSpec, JobStatus, PROTOCOL_VERSION,
    QueueId, QueueSpec, QueueStatus, RankPlacement, SyncArch, WorkerAssignment, WorkerPhase,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Knobs of a scheduling step.
#[derive(Debug, Clone)]
pub struct Settings {
    /// A host whose latest telemetry is older than this (seconds) is lost: its GPUs leave
    /// the pool and its jobs are placed elsewhere.
    pub host_timeout_s: f64,
    /// Knobs of the quality policy; its horizon also sets how far ahead statuses predict.
    pub policy: PolicyParams,
    pub fit: FitConfig,
    /// Prior of the per-job throughput model (before a job has step times to fit).
    pub throughput_prior: ThroughputPrior,
    /// How workers are put on hosts (first fit, or BCO priced by each job's model).
    pub placement: PlacementKind,
    /// The policy that sizes jobs (default: `quality` with `policy`).
    pub scheduler: Arc<dyn Policy>,
    /// Parameter-server shards one host may run (all jobs together); each takes a CPU
    /// process and no GPU. Bounds the planner's shard placement ([`DEFAULT_PS_SHARDS_PER_HOST`]).
    pub ps_shards_per_host: u32,
    /// Most loss curves refitted in one step ([`DEFAULT_FIT_BUDGET`]); jobs whose refit is
    /// due beyond it keep their last curve until a later step, those with the most new
    /// points (then never fitted, then by id) first. Bounds a step's time when many jobs
    /// report at once.
    pub fit_budget: usize,
    /// Half-life of each queue's decayed usage, seconds, in the fair share of lent GPUs
    /// ([`crate::queues`]; default [`DEFAULT_USAGE_HALF_LIFE_S`], one hour). Not positive:
    /// usage is forgotten at once.
    pub usage_half_life_s: f64,
}

pub use crate::queues::DEFAULT_USAGE_HALF_LIFE_S;

/// Default of [`Settings::fit_budget`]: 100 refits (about 0.1–0.3 s on one core).
pub const DEFAULT_FIT_BUDGET: usize = 100;

/// Default of [`Settings::ps_shards_per_host`].
pub const DEFAULT_PS_SHARDS_PER_HOST: u32 = 4;

/// Model size assumed for a parameter-server job before its trainers report one (bytes):
/// 100 MB, about ResNet-50's parameters in f32.
pub const DEFAULT_PS_MODEL_BYTES: f64 = 100e6;

/// NIC speed assumed for a host whose agent reports no link speed (bytes per second in one
/// direction): 10 Gbit/s.
pub const DEFAULT_LINK_BYTES_PER_S: f64 = 1.25e9;

/// The planner takes the fewest shards whose planned throughput is at least this fraction
/// of the best plan's ([`PsJob::target_fraction`]): a shard is a process, not worth a
/// throughput gain under 5 %.
pub const PS_TARGET_FRACTION: f64 = 0.95;

impl Default for Settings {
    fn default() -> Self {
        let policy = PolicyParams::default();
        Self {
            host_timeout_s: 15.0,
            policy,
            fit: FitConfig::default(),
            throughput_prior: ThroughputPrior::default(),
            placement: PlacementKind::default(),
            scheduler: Arc::new(Quality { params: policy }),
            ps_shards_per_host: DEFAULT_PS_SHARDS_PER_HOST,
            fit_budget: DEFAULT_FIT_BUDGET,
            usage_half_life_s: DEFAULT_USAGE_HALF_LIFE_S,
        }
    }
}

/// Samples the job still needs, when it has a target loss and a fitted curve that reaches
/// it within a thousand times the samples done so far (at least 10⁹): the curve's prediction,
/// inverted. `None` otherwise (the policy then guesses, see [`crate::policies::quality::remaining_work`]).
fn remaining_samples(curve: Option<&Curve>, target_loss: Option<f64>, samples: f64) -> Option<f64> {
    let limit = (samples * 1000.0).max(1e9);
    let reach = samples_to_reach(curve?, target_loss?, samples, limit)?;
    Some((reach - samples).max(0.0))
}

/// The parameter-server shards of a running `arch = "ps"` job (none for other jobs): those
/// the planner placed ([`JobStatus::ps_placement`]), else (statuses written before the
/// planner, or when it found no plan) co-location: one per host its workers use, in rank
/// order of first appearance, at most `max_ps`, so that pushes and pulls stay on the host
/// (locality, after Yu et al., IEEE TNSE 2021). Shards take the ranks after the workers and
/// no GPU.
fn ps_shards(status: &JobStatus, spec: &JobSpec) -> Vec<RankPlacement> {
    if !spec.has_ps_shards() || status.world_size == 0 {
        return Vec::new();
    }
    if !status.ps_placement.is_empty() {
        return status.ps_placement.clone();
    }
    colocated_shards(status.world_size, &status.placement, spec)
}

/// One shard per host of `placement`, in rank order of first appearance, at most `max_ps`.
fn colocated_shards(
    world_size: u32,
    placement: &[RankPlacement],
    spec: &JobSpec,
) -> Vec<RankPlacement> {
    let mut hosts: Vec<&HostId> = Vec::new();
    let mut ranks: Vec<&RankPlacement> = placement.iter().collect();
    ranks.sort_by_key(|p| p.rank);
    for p in ranks {
        if !hosts.contains(&&p.host) {
            hosts.push(&p.host);
        }
    }
    hosts
        .into_iter()
        .take(spec.max_ps.unwrap_or(u32::MAX) as usize)
        .enumerate()
        .map(|(i, host)| RankPlacement {
            rank: world_size + i as u32,
            host: host.clone(),
            gpus: Vec::new(),
        })
        .collect()
}

/// Everything a step reads.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub now: f64,
    pub specs: &'a BTreeMap<JobId, JobSpec>,
    /// Specs that were refused, with the reason (the job fails with it).
    pub refused_specs: &'a BTreeMap<JobId, String>,
    pub statuses: &'a BTreeMap<JobId, JobStatus>,
    pub hosts: &'a BTreeMap<HostId, HostTelemetry>,
    pub histories: &'a BTreeMap<JobId, JobHistory>,
    /// The queues (KV `converge-queues`); the implicit default queue need not be listed.
    pub queues: &'a BTreeMap<QueueId, QueueSpec>,
    /// Each queue's status as the previous step left it (KV `converge-queue-status`): the
    /// decayed usage the fair share continues from.
    pub queue_statuses: &'a BTreeMap<QueueId, QueueStatus>,
}

/// What a step decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// The status of every known job.
    pub statuses: BTreeMap<JobId, JobStatus>,
    /// The plan of every known host (lost hosts get an empty plan, which fences their
    /// workers when they return).
    pub plans: BTreeMap<HostId, HostPlan>,
    pub events: Vec<Event>,
    /// Every queue's status after this step's decision (empty in steps that do not run the
    /// policy: the previous ones stand). The caller stores them and passes them back as
    /// [`Inputs::queue_statuses`].
    pub queue_statuses: BTreeMap<QueueId, QueueStatus>,
}

const SOURCE: &str = "allocator";

fn event(now: f64, kind: EventKind, message: String) -> Event {
    Event::new(now, SOURCE, kind, message)
}

/// Runs one step. With `run_policy` false only the lifecycle advances (completions,
/// failures, restarts finishing, progress); allocations change only when it is true (every
/// scheduling interval, on job submission and when hosts come or go). `cache` holds the
/// fits of earlier steps ([`FitCache`]); the step refits what is due, fits each job's curve
/// and each of its throughput models at most once, and forgets jobs that are no longer
/// active.
pub fn step(
    inp: Inputs<'_>,
    settings: &Settings,
    cache: &mut FitCache,
    run_policy: bool,
) -> Outcome {
    let now = inp.now;
    let mut out = Outcome::default();
    let live: BTreeMap<&HostId, &HostTelemetry> = inp
        .hosts
        .iter()
        .filter(|(_, t)| now - t.time <= settings.host_timeout_s)
        .collect();

    // Worker states reported by live hosts, by job.
    let mut reported: BTreeMap<&JobId, Vec<(&HostId, &converge_common::WorkerState)>> =
        BTreeMap::new();
    for (host, t) in &live {
        for w in &t.workers {
            reported.entry(&w.job).or_default().push((host, w));
        }
    }

    // 1. Statuses for new and refused jobs; lifecycle of the known ones.
    let mut curves: BTreeMap<JobId, Curve> = BTreeMap::new();
    // Each active job's throughput model on all its step observations (computed once per
    // step) and the per-worker batch it last ran with.
    let mut models: BTreeMap<JobId, (ThroughputModel, f64)> = BTreeMap::new();
    let mut type_speeds: BTreeMap<JobId, BTreeMap<String, f64>> = BTreeMap::new();
    // Whether the live hosts with GPUs carry several GPU types (then each generation's step
    // times count for its hosts' type), once per step.
    let several_gpu_types = {
        let mut types: Vec<Option<String>> = live
            .values()
            .filter(|t| !t.gpus.is_empty())
            .map(|t| converge_common::labels::host_gpu_type(&t.labels))
            .collect();
        types.sort_unstable();
        types.dedup();
        types.len() > 1
    };
    // Each active `[batch]` job's gradient statistics at its reference batch.
    let mut gradients: BTreeMap<JobId, GradientStats> = BTreeMap::new();
    let refit = refits(inp, cache, settings.fit_budget);
    for (id, spec) in inp.specs {
        let mut status = inp
            .statuses
            .get(id)
            .cloned()
            .unwrap_or_else(|| new_status(id, spec.submitted_at, now));
        if !inp.statuses.contains_key(id) {
            out.events.push(event(
                now,
                EventKind::JobSubmitted { job: id.clone() },
                format!(
                    "job {id} admitted: {} to {} workers of {} GPU(s)",
                    spec.min_workers,
                    spec.max_workers(),
                    spec.gpus_per_worker
                ),
            ));
        }
        let history = inp.histories.get(id);
        // Finished jobs keep the status they finished with; each job is fitted once a step.
        if !status.phase.is_terminal() {
            advance(
                &mut status,
                spec,
                history,
                reported.get(id),
                &live,
                now,
                &mut out.events,
            );
            let curve = history.and_then(|h| cache.curve(id, h, &settings.fit, refit.contains(id)));
            if !status.phase.is_terminal() {
                apply_stop_criteria(
                    &mut status,
                    spec,
                    history,
                    curve.as_ref(),
                    now,
                    &mut out.events,
                );
            }
            // A job that finished by itself this step gets its curve's prediction too.
            if let (Some(end), Some(c)) = (status.end.as_mut(), curve.as_ref())
                && end.predicted_loss.is_none()
            {
                end.predicted_loss = Some(predicted_final_loss(c));
            }
            let seen = history
                .map(JobHistory::step_observations)
                .unwrap_or_default();
            update_progress(
                &mut status,
                history,
                curve.as_ref(),
                settings.policy.horizon_s,
                (&seen, cache, &settings.throughput_prior),
            );
            if let Some(c) = curve {
                curves.insert(id.clone(), c);
            }
            if let (Some(b), Some(h)) = (&spec.batch, history)
                && let Some(g) = h.gradient_estimate(b.reference)
            {
                gradients.insert(id.clone(), g);
            }
            // The decision's model, only on steps that decide (lifecycle steps need none).
            if let Some((_, last)) = seen.last().filter(|_| run_policy) {
                // On a cluster of several GPU types, the model of the type the job runs on
                // (when its generations there have step times), else of all its steps.
                let by_type = history
                    .filter(|_| several_gpu_types)
                    .map(|h| observations_by_type(h, &seen, &live))
                    .unwrap_or_default();
                let current = status
                    .placement
                    .first()
                    .and_then(|r| live.get(&r.host))
                    .and_then(|t| converge_common::labels::host_gpu_type(&t.labels))
                    .and_then(|t| Some((by_type.get(&t)?, t)));
                let model = match current {
                    Some((on_type, t)) => {
                        cache.model_on_type(id, &t, on_type, &settings.throughput_prior)
                    }
                    None => {
                        let all: Vec<StepObservation> = seen.iter().map(|(_, o)| *o).collect();
                        cache.model(id, ModelScope::All, &all, &settings.throughput_prior)
                    }
                };
                models.insert(id.clone(), (model, last.local_batch));
                let speeds: BTreeMap<String, f64> = by_type
                    .iter()
                    .filter_map(|(t, on_type)| {
                        let model = cache.model_on_type(id, t, on_type, &settings.throughput_prior);
                        crate::gpu_types::speed(&model, last.local_batch).map(|v| (t.clone(), v))
                    })
                    .collect();
                if !speeds.is_empty() {
                    type_speeds.insert(id.clone(), speeds);
                }
            }
        }
        out.statuses.insert(id.clone(), status);
    }
    for (id, reason) in inp.refused_specs {
        if inp.specs.contains_key(id) {
            continue;
        }
        let mut status = inp
            .statuses
            .get(id)
            .cloned()
            .unwrap_or_else(|| new_status(id, now, now));
        if !status.phase.is_terminal() {
            finish(
                &mut status,
                JobPhase::Failed,
                format!("job spec refused: {reason}"),
                now,
                &mut out.events,
            );
        }
        out.statuses.insert(id.clone(), status);
    }
    // Statuses whose spec vanished (deleted from KV) are kept as they are.
    for (id, s) in inp.statuses {
        out.statuses.entry(id.clone()).or_insert_with(|| s.clone());
    }

    // 2. The policy: how many workers each active job gets, and where.
    if run_policy {
        let contention = measured_contention(&out.statuses, inp.specs);
        allocate(
            inp,
            settings,
            &live,
            Fits {
                curves: &curves,
                models: &models,
                type_speeds: &type_speeds,
                gradients: &gradients,
                contention,
            },
            &mut out,
        );
        note_unmatched_selectors(inp, &live, &mut out.statuses);
    }

    // 3. A job whose rank 0 host now answers at another address restarts as a new
    //    generation (its ranks would wait at the old address).
    follow_master_addr(inp.statuses, &mut out, &live, now);

    // 4. Restarting jobs whose previous generation has exited everywhere start.
    for status in out.statuses.values_mut() {
        if status.phase == JobPhase::Restarting
            && !older_generation_alive(status, reported.get(&status.job))
        {
            status.phase = JobPhase::Running;
            status.started_at.get_or_insert(now);
        }
    }

    // 5. Each `[batch]` job's batch as the statuses now stand.
    for status in out.statuses.values_mut() {
        if let Some(spec) = inp.specs.get(&status.job) {
            update_batch(
                status,
                spec,
                inp.histories.get(&status.job),
                gradients.get(&status.job),
            );
        }
    }

    // 6. Plans follow from the statuses.
    out.plans = plans(inp, &out.statuses, &live);
    cache.retain(|id| out.statuses.get(id).is_some_and(|s| !s.phase.is_terminal()));
    out
}

/// The batch limits of a `[batch]` table (`None` if they do not hold, which a validated
/// spec rules out).
pub fn batch_limits(b: &BatchSpec) -> Option<BatchLimits> {
    BatchLimits::new(
        b.reference,
        b.max_total,
        b.min_per_worker,
        b.max_per_worker(),
    )
    .ok()
}

fn assigned(plan: BatchPlan, reference: u32) -> AssignedBatch {
    AssignedBatch {
        total: plan.total,
        per_worker: plan.per_worker,
        accum_steps: plan.accum_steps,
        reference,
    }
}

/// The batch of a `[batch]` job's new generation on `workers` workers: the decision's plan
/// when it chose one (an adaptive job under a policy that reads goodput), else the smallest
/// total the world size allows, `max(B₀, workers × min_per_worker)` (the reference batch:
/// what a job without gradient statistics keeps).
fn generation_batch(
    spec: &JobSpec,
    workers: u32,
    decided: Option<&BatchPlan>,
) -> Option<AssignedBatch> {
    let b = spec.batch.as_ref()?;
    if workers == 0 {
        return None;
    }
    let plan = match decided {
        Some(p) => *p,
        None => batch_limits(b)?.initial_plan(workers)?,
    };
    Some(assigned(plan, b.reference))
}

/// The total batch a running `[batch]` job restarts with although its placement stays: its
/// current generation's batch was chosen without gradient statistics and the decision now
/// plans another with them (`decided`). At most once per job: later batches change only
/// with the allocation (docs/scheduling.md, "Adaptive batch sizes in the live cluster").
fn first_statistics_batch(
    status: &JobStatus,
    spec: &JobSpec,
    decided: Option<&BatchPlan>,
) -> Option<u32> {
    let plan = decided?;
    let b = status.batch.as_ref()?;
    let current = b.plan?;
    let reference = spec.batch.as_ref()?.reference;
    (status.phase == JobPhase::Running
        && !b.planned_with_statistics
        && assigned(*plan, reference) != current)
        .then_some(plan.total)
}

/// Keeps a `[batch]` job's [`JobBatch`] up to date: adaptive once it has gradient
/// statistics, the current generation's plan (none without workers), the noise scale, the
/// plan's efficiency and the counts of used and ignored statistics (a finished job keeps
/// them as they were). Jobs without a `[batch]` table have none.
fn update_batch(
    status: &mut JobStatus,
    spec: &JobSpec,
    history: Option<&JobHistory>,
    gradient: Option<&GradientStats>,
) {
    let Some(b) = &spec.batch else {
        status.batch = None;
        return;
    };
    let batch = status.batch.get_or_insert(JobBatch::new(b.reference));
    batch.reference = b.reference;
    if status.world_size == 0 || status.phase.is_terminal() {
        batch.plan = None;
    }
    if status.phase.is_terminal() {
        // A finished job keeps what was known of it when it finished.
        return;
    }
    let reference = f64::from(b.reference);
    batch.adaptive = gradient.is_some();
    batch.noise_scale = gradient
        .map(|g| g.noise_scale(reference))
        .filter(|n| n.is_finite());
    batch.efficiency = gradient
        .zip(batch.plan)
        .map(|(g, p)| g.efficiency(reference, f64::from(p.total)));
    if let Some(h) = history {
        batch.gradient_reports = h.gradient_reports;
        batch.ignored_gradient_stats = h.ignored_gradient_stats;
    }
}

/// A job's new generation: frees its master port in `taken_ports`, bumps the generation and
/// takes a fresh port (`None` when the job has no workers). The one place a generation
/// changes, so old and new workers never meet (generation fencing; see the module docs).
fn bump_generation(status: &mut JobStatus, taken_ports: &mut BTreeSet<u16>) {
    if let Some(p) = status.master_port {
        taken_ports.remove(&p);
    }
    status.generation += 1;
    status.master_port = (status.world_size > 0).then(|| {
        let port = master_port(&status.job, status.generation, taken_ports);
        taken_ports.insert(port);
        port
    });
}

/// Contention measured on the running jobs ([`ContentionSamples`]): each running multi-host
/// job whose generation has an observed and an out-of-sample predicted step time
/// ([`JobStatus::step_time_s`], [`JobStatus::predicted_step_time_s`], the latter from the
/// model fitted on its earlier generations) and shares a host with other multi-host jobs adds
/// its slowdown, `observed / predicted − 1`.
///
/// Shadow jobs (`arch = "shadow"`) add no sample: their step time excludes synchronization,
/// so contention never shows in it ([`crate::shadow`], rule 2); they do not count in
/// `sharing` either (their traffic is in the NIC factor, rule 3).
fn measured_contention(
    statuses: &BTreeMap<JobId, JobStatus>,
    specs: &BTreeMap<JobId, JobSpec>,
) -> f64 {
    let shadow = |s: &JobStatus| {
        specs
            .get(&s.job)
            .is_some_and(|spec| spec.arch == SyncArch::Shadow)
    };
    let running = || {
        statuses
            .values()
            .filter(|s| s.phase == JobPhase::Running && !shadow(s))
    };
    let hosts_of = |s: &JobStatus| -> BTreeSet<HostId> {
        s.placement.iter().map(|p| p.host.clone()).collect()
    };
    let mut multi_host_jobs: BTreeMap<HostId, u32> = BTreeMap::new();
    for s in running() {
        let hosts = hosts_of(s);
        if hosts.len() > 1 {
            for h in hosts {
                *multi_host_jobs.entry(h).or_default() += 1;
            }
        }
    }
    let mut samples = ContentionSamples::default();
    for s in running() {
        let hosts = hosts_of(s);
        let (Some(step_s), Some(predicted)) = (s.step_time_s, s.predicted_step_time_s) else {
            continue;
        };
        if hosts.len() < 2 || predicted <= 0.0 {
            continue;
        }
        let sharing = hosts
            .iter()
            .map(|h| multi_host_jobs.get(h).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        samples.add(step_s / predicted - 1.0, sharing);
    }
    samples.per_shared_job()
}

/// Each host's NIC traffic, bytes/s each way, from the running multi-host ring jobs placed
/// on it ([`ring_nic_bytes_per_s`] of their observed step time and reported model size):
/// [`host_nic_background`] takes it off the load the host's agent measures, since placement
/// counts those jobs as contention already. Parameter-server jobs stay in the measured load.
fn ring_nic_traffic(
    statuses: &BTreeMap<JobId, JobStatus>,
    specs: &BTreeMap<JobId, JobSpec>,
    histories: &BTreeMap<JobId, JobHistory>,
) -> BTreeMap<HostId, f64> {
    let mut traffic: BTreeMap<HostId, f64> = BTreeMap::new();
    for s in statuses.values().filter(|s| s.phase == JobPhase::Running) {
        let hosts: BTreeSet<&HostId> = s.placement.iter().map(|p| &p.host).collect();
        let ring = specs
            .get(&s.job)
            .is_some_and(|spec| spec.arch == SyncArch::Ring);
        let bytes = histories.get(&s.job).and_then(JobHistory::model_bytes);
        let (true, Some(step_s), Some(bytes)) = (ring && hosts.len() > 1, s.step_time_s, bytes)
        else {
            continue;
        };
        let rate = ring_nic_bytes_per_s(s.world_size, bytes as f64, step_s);
        for h in hosts {
            *traffic.entry(h.clone()).or_default() += rate;
        }
    }
    traffic
}

/// The active jobs whose curve is refitted in this step: those with a refit due, most new
/// points first (never fitted first of all), then by id, at most `budget`.
fn refits<'a>(inp: Inputs<'a>, cache: &FitCache, budget: usize) -> BTreeSet<&'a JobId> {
    let mut due: Vec<(usize, &JobId)> = inp
        .specs
        .keys()
        .filter(|id| inp.statuses.get(*id).is_none_or(|s| !s.phase.is_terminal()))
        .filter_map(|id| Some((cache.refit_pending(id, inp.histories.get(id)?)?, id)))
        .collect();
    due.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    due.into_iter().take(budget).map(|(_, id)| id).collect()
}

/// Records rank 0's host address of every placed job, and moves a job to a new generation
/// (fresh `MASTER_PORT`, `restarting`) when the address changed since its generation was
/// placed: an agent restarted with a new IP.
fn follow_master_addr(
    before: &BTreeMap<JobId, JobStatus>,
    out: &mut Outcome,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    now: f64,
) {
    let mut taken_ports: BTreeSet<u16> = out
        .statuses
        .values()
        .filter(|s| !s.phase.is_terminal())
        .filter_map(|s| s.master_port)
        .collect();
    for status in out.statuses.values_mut() {
        if status.phase.is_terminal() || status.world_size == 0 {
            status.master_addr = None;
            continue;
        }
        let Some(addr) = status
            .placement
            .iter()
            .find(|p| p.rank == 0)
            .and_then(|p| live.get(&p.host))
            .map(|t| t.addr.clone())
        else {
            continue;
        };
        let same_generation = before
            .get(&status.job)
            .is_some_and(|b| b.generation == status.generation);
        match &status.master_addr {
            Some(old) if *old != addr && same_generation => {
                let old = old.clone();
                bump_generation(status, &mut taken_ports);
                status.phase = JobPhase::Restarting;
                let reason = format!(
                    "job {}: rank 0's host now answers at {addr} (was {old}); restarting as generation {}",
                    status.job, status.generation
                );
                let workers = status.world_size;
                status.record_allocation(now, workers, ChangeCause::Address, reason.clone());
                out.events.push(event(
                    now,
                    EventKind::AllocationChanged {
                        job: status.job.clone(),
                        generation: status.generation,
                        from_workers: status.world_size,
                        to_workers: status.world_size,
                    },
                    reason,
                ));
                status.master_addr = Some(addr);
            }
            _ => status.master_addr = Some(addr),
        }
    }
}

fn new_status(id: &JobId, submitted_at: f64, now: f64) -> JobStatus {
    JobStatus::pending(id.clone(), submitted_at, now)
}

fn finish(
    status: &mut JobStatus,
    phase: JobPhase,
    message: String,
    now: f64,
    events: &mut Vec<Event>,
) {
    status.phase = phase;
    status.finished_at = Some(now);
    status.world_size = 0;
    status.placement.clear();
    status.ps_placement.clear();
    status.master_port = None;
    events.push(event(
        now,
        EventKind::JobFinished {
            job: status.job.clone(),
            phase,
        },
        format!("job {} {}: {message}", status.job, phase.as_str()),
    ));
    status.message = Some(message);
}

/// Completion, failure, cancellation and host loss of one active job.
fn advance(
    status: &mut JobStatus,
    spec: &JobSpec,
    history: Option<&JobHistory>,
    reported: Option<&Vec<(&HostId, &converge_common::WorkerState)>>,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    now: f64,
    events: &mut Vec<Event>,
) {
    if spec.cancelled {
        finish(
            status,
            JobPhase::Cancelled,
            "cancelled by the user".into(),
            now,
            events,
        );
        return;
    }
    if status.phase != JobPhase::Running {
        return;
    }
    // Only what a host reports about ranks placed on it counts: a host cannot complete or
    // fail another host's ranks through its own heartbeat.
    let placed_here = |host: &HostId, rank: u32| {
        status
            .placement
            .iter()
            .chain(&status.ps_placement)
            .any(|p| p.rank == rank && p.host == *host)
    };
    let current: Vec<&(&HostId, &converge_common::WorkerState)> = reported
        .map(|v| {
            v.iter()
                .filter(|(host, w)| w.generation == status.generation && placed_here(host, w.rank))
                .collect()
        })
        .unwrap_or_default();
    if current
        .iter()
        .any(|(_, w)| w.rank == 0 && w.phase == WorkerPhase::Succeeded)
    {
        status.end = Some(job_end(EndReason::Finished, spec, history, None));
        finish(
            status,
            JobPhase::Completed,
            "rank 0 exited with code 0".into(),
            now,
            events,
        );
        return;
    }
    // A lost host comes before a failure: ranks fail when a peer's host vanishes, and the
    // job is placed again from its checkpoint rather than failed.
    if let Some(lost) = status
        .placement
        .iter()
        .chain(&status.ps_placement)
        .find(|p| !live.contains_key(&p.host))
    {
        let host = lost.host.clone();
        events.push(event(
            now,
            EventKind::HostLost { host: host.clone() },
            format!(
                "job {} lost host {host}; it will be placed again from its checkpoint",
                status.job
            ),
        ));

        let from = status.world_size;
        status.phase = JobPhase::Pending;
        status.world_size = 0;
        status.placement.clear();
        status.ps_placement.clear();
        status.master_port = None;
        status.message = Some(format!("host {host} stopped reporting"));
        status.record_allocation(now, from, ChangeCause::HostLost, format!(
                "job {}: host {host} stopped reporting; waiting to be placed again from its checkpoint",
                status.job
            ));
        return;
    }
    if let Some((host, w)) = current.iter().find(|(_, w)| w.phase == WorkerPhase::Failed) {
        let code = w
            .last_exit_code
            .map_or("a signal".to_string(), |c| format!("exit code {c}"));
        finish(
            status,
            JobPhase::Failed,
            format!(
                "rank {} on {host} failed ({code}) after {} restarts; see its log on that host",
                w.rank, w.restarts
            ),
            now,
            events,
        );
    }
}

/// A finished job's [`JobEnd`]: its latest loss, the loss its curve predicts it would reach,
/// and its GPU-hours.
fn job_end(
    reason: EndReason,
    spec: &JobSpec,
    history: Option<&JobHistory>,
    curve: Option<&Curve>,
) -> JobEnd {
    JobEnd {
        reason,
        loss: history.and_then(JobHistory::latest).map(|p| p.loss),
        predicted_loss: curve.map(predicted_final_loss),
        gpu_hours: history.map_or(0.0, |h| h.attained_gpu_seconds(spec.gpus_per_worker)) / 3600.0,
    }
}

/// Ends an active job whose stop criteria ([`crate::stop`]) hold, as `completed` with the
/// reason; fails one whose first loss already meets its target (an impossible goal for a
/// loss that falls).
fn apply_stop_criteria(
    status: &mut JobStatus,
    spec: &JobSpec,
    history: Option<&JobHistory>,
    curve: Option<&Curve>,
    now: f64,
    events: &mut Vec<Event>,
) {
    let Some(stop) = stop::criteria(spec) else {
        return;
    };
    if let (Some(target), Some(first)) =
        (stop.target_loss, history.and_then(JobHistory::first_loss))
        && let Some(reason) = stop::target_not_below_first_loss(target, first)
    {
        finish(status, JobPhase::Failed, reason, now, events);
        return;
    }
    let inputs = StopInputs {
        now,
        submitted_at: status.submitted_at,
        samples: status.samples.max(
            history
                .and_then(JobHistory::latest)
                .map_or(0, |p| p.samples),
        ) as f64,
        epoch_samples: history.and_then(JobHistory::epoch_samples),
        latest_loss: history.and_then(JobHistory::latest).map(|p| p.loss),
        curve,
        gpu_seconds: history.map_or(0.0, |h| h.attained_gpu_seconds(spec.gpus_per_worker)),
    };
    if let Some(verdict) = stop::stop_verdict(&stop, &inputs) {
        status.end = Some(job_end(verdict.reason, spec, history, curve));
        finish(status, JobPhase::Completed, verdict.message, now, events);
    }
}

fn older_generation_alive(
    status: &JobStatus,
    reported: Option<&Vec<(&HostId, &converge_common::WorkerState)>>,
) -> bool {
    reported.is_some_and(|v| {
        v.iter()
            .any(|(_, w)| w.generation < status.generation && w.phase.is_alive())
    })
}

/// Copies progress, the fitted curve and the prediction into the status.
fn update_progress(
    status: &mut JobStatus,
    history: Option<&JobHistory>,
    curve: Option<&Curve>,
    horizon_s: f64,
    fits: (&[(u64, StepObservation)], &mut FitCache, &ThroughputPrior),
) {
    let Some(h) = history else { return };
    if let Some(p) = h.latest() {
        status.step = p.step;
        status.samples = p.samples;
        status.loss = Some(p.loss);
    }
    status.first_loss = h.first_loss();
    status.eval_loss = h.last_eval_loss();
    status.samples_per_s = h.samples_per_s(status.generation);
    status.predicted_loss = curve.map(|c| {
        let rate = status.samples_per_s.unwrap_or(0.0);
        c.predict(status.samples as f64 + rate * horizon_s)
    });
    status.curve = curve.map(|c| c.to_wire());
    let (observed, predicted) = step_times(status, fits.0, fits.1, fits.2);
    status.step_time_s = observed;
    status.predicted_step_time_s = predicted;
}

/// Observed seconds per step of the status's generation, and what the throughput model
/// fitted on the earlier generations predicts for its world size and servers spanned.
fn step_times(
    status: &JobStatus,
    seen: &[(u64, StepObservation)],
    cache: &mut FitCache,
    prior: &ThroughputPrior,
) -> (Option<f64>, Option<f64>) {
    let current = seen
        .iter()
        .find(|(g, _)| *g == status.generation)
        .map(|(_, o)| *o);
    let earlier: Vec<StepObservation> = seen
        .iter()
        .filter(|(g, _)| *g < status.generation)
        .map(|(_, o)| *o)
        .collect();
    let predicted = (!earlier.is_empty() && status.world_size > 0).then(|| {
        let nodes = status
            .placement
            .iter()
            .map(|r| &r.host)
            .collect::<BTreeSet<_>>()
            .len()
            .max(1) as u32;
        let local_batch = current.map_or(earlier[earlier.len() - 1].local_batch, |c| c.local_batch);
        cache
            .model(&status.job, ModelScope::Earlier, &earlier, prior)
            .step_time_s(status.world_size, nodes, local_batch)
    });
    (current.map(|c| c.step_time_s), predicted)
}

/// A job's step observations per GPU type (the caller asks only on a cluster of several
/// types): each generation's observation counts for the type of its hosts that are still
/// live (their `gpu.type` labels; a generation whose live hosts carry several types, or
/// none, counts for none). The per-type models fitted on them give the job's speed on each
/// type ([`crate::gpu_types`], at the per-worker batch of its latest observation) and, for
/// the type it runs on, the decision's throughput model.
fn observations_by_type(
    history: &JobHistory,
    seen: &[(u64, StepObservation)],
    live: &BTreeMap<&HostId, &HostTelemetry>,
) -> BTreeMap<String, Vec<StepObservation>> {
    let mut by_type: BTreeMap<String, Vec<StepObservation>> = BTreeMap::new();
    for (generation, observation) in seen {
        let types: BTreeSet<String> = history
            .generation_hosts(*generation)
            .filter_map(|host| live.get(host))
            .filter_map(|t| converge_common::labels::host_gpu_type(&t.labels))
            .collect();
        if let (1, Some(t)) = (types.len(), types.first()) {
            by_type.entry(t.clone()).or_default().push(*observation);
        }
    }
    by_type
}

/// What the step fitted for [`allocate`].
struct Fits<'a> {
    curves: &'a BTreeMap<JobId, Curve>,
    /// Each active job's throughput model on all its generations, and the per-worker batch
    /// it last ran with.
    models: &'a BTreeMap<JobId, (ThroughputModel, f64)>,
    /// Each active job's measured speed per GPU type ([`observations_by_type`]).
    type_speeds: &'a BTreeMap<JobId, BTreeMap<String, f64>>,
    /// Each active `[batch]` job's gradient statistics (those with valid reports).
    gradients: &'a BTreeMap<JobId, GradientStats>,
    /// [`measured_contention`].
    contention: f64,
}

/// The live hosts the spec allows ([`JobSpec::allows_host`]: its `[selector]` and
/// `gpu_types`); `None` when it restricts nothing (any host will do).
fn eligible_hosts(
    spec: &JobSpec,
    live: &BTreeMap<&HostId, &HostTelemetry>,
) -> Option<BTreeSet<HostId>> {
    if !spec.restricts_hosts() {
        return None;
    }
    Some(
        live.iter()
            .filter(|(_, t)| spec.allows_host(&t.labels))
            .map(|(h, _)| (*h).clone())
            .collect(),
    )
}

/// The status message of a job no live host may run: what its selector and GPU types ask
/// for, and with GPU types, the types the live hosts have.
fn unmatched_selector_message(spec: &JobSpec, live: &BTreeMap<&HostId, &HostTelemetry>) -> String {
    let Some(types) = &spec.gpu_types else {
        return format!(
            "no live host matches selector {}",
            converge_common::labels::format(&spec.selector)
        );
    };
    let offered: BTreeSet<String> = live
        .values()
        .filter_map(|t| converge_common::labels::host_gpu_type(&t.labels))
        .collect();
    let offered = if offered.is_empty() {
        "none".to_string()
    } else {
        offered.into_iter().collect::<Vec<_>>().join(", ")
    };
    let selector = if spec.selector.is_empty() {
        String::new()
    } else {
        format!(
            " with selector {}",
            converge_common::labels::format(&spec.selector)
        )
    };
    format!(
        "no live host offers GPU type {}{selector} (live hosts' types: {offered})",
        types.join(" or ")
    )
}

/// Keeps the reason on pending jobs whose selector no live host matches (and takes it off
/// once one does).
fn note_unmatched_selectors(
    inp: Inputs<'_>,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    statuses: &mut BTreeMap<JobId, JobStatus>,
) {
    for status in statuses.values_mut() {
        if status.phase != JobPhase::Pending {
            continue;
        }
        let Some(spec) = inp.specs.get(&status.job) else {
            continue;
        };
        let unmatched = eligible_hosts(spec, live).is_some_and(|hosts| hosts.is_empty());
        if unmatched {
            status.message = Some(unmatched_selector_message(spec, live));
        } else if status.message.as_deref().is_some_and(|m| {
            m.starts_with("no live host matches selector ")
                || m.starts_with("no live host offers GPU type ")
        }) {
            status.message = None;
        }
    }
}

/// The job as [`decide`] sees it.
fn job_view(
    status: &JobStatus,
    spec: &JobSpec,
    history: Option<&JobHistory>,
    fits: &Fits<'_>,
    hosts: Option<BTreeSet<HostId>>,
) -> JobView {
    let per_worker = history.and_then(|h| {
        let (g, rate) = h.latest_rate()?;
        let workers = if g == status.generation {
            status.world_size
        } else {
            0
        };
        // Throughput of an older generation is per worker of that generation; its size is
        // not kept, so fall back to the current size when unknown.
        let w = if workers > 0 {
            workers
        } else {
            status.world_size.max(1)
        };
        Some(rate / f64::from(w))
    });
    let curve = fits.curves.get(&status.job).cloned();
    let model = fits.models.get(&status.job);
    let remaining_work =
        remaining_samples(curve.as_ref(), spec.target_loss(), status.samples as f64);
    JobView {
        id: status.job.clone(),
        gpus_per_worker: spec.gpus_per_worker,
        min_workers: spec.min_workers,
        max_workers: spec.max_workers(),
        requested_workers: spec.requested_workers(),
        submitted_at: status.submitted_at,
        placement: status.placement.clone(),
        curve,
        samples: status.samples as f64,
        loss_scale: history.map_or(0.0, JobHistory::loss_scale),
        samples_per_s_per_worker: per_worker,
        attained_gpu_seconds: history.map_or(0.0, |h| h.attained_gpu_seconds(spec.gpus_per_worker)),
        model: model.map(|(m, _)| m.clone()),
        batch: BatchSize::PerWorker(
            model.map_or(crate::throughput::DEFAULT_PRIOR_LOCAL_BATCH, |(_, b)| *b),
        ),
        remaining_work,
        oracle: None,
        // Generation 1 is the first start.
        restarts: u32::try_from(status.generation.saturating_sub(1)).unwrap_or(u32::MAX),
        restart_cost_s: history.and_then(JobHistory::restart_cost_s),
        // Adaptive only with a `[batch]` table and gradient statistics: a job whose program
        // reports none keeps its reference batch and is valued by throughput alone.
        adaptive: spec
            .batch
            .as_ref()
            .and_then(batch_limits)
            .zip(fits.gradients.get(&status.job))
            .map(|(limits, g)| AdaptiveBatch {
                limits,
                gradient: Some(*g),
            }),
        hosts,
        queue: spec
            .queue
            .clone()
            .unwrap_or_else(crate::queues::default_queue),
        priority: spec.priority,
        started_at: (!status.placement.is_empty())
            .then_some(status.started_at)
            .flatten(),
        shadow: spec.shadow_algorithm(),
        family: spec.labels.get(MODEL_LABEL).cloned(),
        gpu_type_speeds: fits
            .type_speeds
            .get(&status.job)
            .cloned()
            .unwrap_or_default(),
    }
}

/// The job-spec label naming a job's model (`labels = { model = "bert" }`): jobs with the same
/// value share their speed ratios between GPU types ([`crate::gpu_types`]).
pub const MODEL_LABEL: &str = "model";

/// The status message of a job whose queue does not exist.
pub fn unknown_queue_message(queue: &QueueId) -> String {
    format!("queue \"{queue}\" does not exist")
}

fn allocate(
    inp: Inputs<'_>,
    settings: &Settings,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    fits: Fits<'_>,
    out: &mut Outcome,
) {
    let now = inp.now;
    let active: Vec<(JobStatus, &JobSpec)> = out
        .statuses
        .values()
        .filter(|s| !s.phase.is_terminal())
        .filter_map(|s| inp.specs.get(&s.job).map(|spec| (s.clone(), spec)))
        .collect();
    let views: Vec<JobView> = active
        .iter()
        .map(|(s, spec)| {
            let hosts = eligible_hosts(spec, live);
            job_view(s, spec, inp.histories.get(&s.job), &fits, hosts)
        })
        .collect();
    let ours = ring_nic_traffic(&out.statuses, inp.specs, inp.histories);
    let nics: BTreeMap<&HostId, HostNic> = live
        .iter()
        .map(|(h, t)| {
            let scheduled = ours.get(*h).copied().unwrap_or(0.0);
            (*h, host_nic_background(&t.nics, scheduled))
        })
        .collect();
    let hosts: Vec<HostFree> = live
        .iter()
        .map(|(h, t)| HostFree {
            host: (*h).clone(),
            gpus: t.gpus.iter().map(|g| g.index).collect(),
            nic_factor: nics[h].factor,
            gpu_type: converge_common::labels::host_gpu_type(&t.labels),
            gpu_speed: converge_common::labels::host_gpu_speed(&t.labels),
        })
        .collect();
    let queued = decide_queued(
        &ClusterState {
            now,
            hosts: &hosts,
            contention_per_shared_job: fits.contention,
        },
        &views,
        settings.scheduler.as_ref(),
        settings.placement,
        &QueueSetup {
            specs: inp.queues,
            previous: inp.queue_statuses,
            half_life_s: settings.usage_half_life_s,
        },
    );
    out.queue_statuses = queued.statuses;
    let preempted = queued.preempted;
    let unknown_queue = queued.unknown_queue;
    let decision = queued.allocation;
    let mut placed = decision.placements;
    let batches = decision.batches;
    // Every active job's speed per GPU type, as the decision estimated it (empty on one
    // type), whether or not its placement changes.
    let mut type_speeds = decision.gpu_type_speeds;
    for view in &views {
        if let Some(status) = out.statuses.get_mut(&view.id) {
            status.gpu_type_speeds = type_speeds.remove(&view.id).unwrap_or_default();
        }
    }
    // Priority order, as the decision placed them.
    let mut slots: Vec<Option<(JobStatus, &JobSpec)>> = active.into_iter().map(Some).collect();
    let active: Vec<(JobStatus, &JobSpec)> = priority_order(&views)
        .into_iter()
        .filter_map(|i| slots[i].take())
        .collect();
    let shards = plan_ps_jobs(
        &PsContext {
            settings,
            live,
            nics: &nics,
            histories: inp.histories,
            models: fits.models,
        },
        &active,
        &mut placed,
    );

    let mut taken_ports: BTreeSet<u16> = out
        .statuses
        .values()
        .filter(|s| !s.phase.is_terminal())
        .filter_map(|s| s.master_port)
        .collect();
    for (s, spec) in &active {
        let new_placement = placed.get(&s.job).cloned().unwrap_or_default();
        let new_shards = shards.get(&s.job).cloned().unwrap_or_default();
        let decided = batches.get(&s.job);
        let rebatch = first_statistics_batch(s, spec, decided);
        if new_placement == s.placement && new_shards == s.ps_placement && rebatch.is_none() {
            if let Some(queue) = unknown_queue.get(&s.job) {
                let status = out
                    .statuses
                    .get_mut(&s.job)
                    .expect("active jobs have statuses");
                status.message = Some(unknown_queue_message(queue));
            }
            continue;
        }
        let status = out
            .statuses
            .get_mut(&s.job)
            .expect("active jobs have statuses");
        let from = status.world_size;
        let moved = new_placement != status.placement;
        status.world_size = new_placement.len() as u32;
        status.placement = new_placement;
        status.ps_placement = new_shards;
        // A batch changes only with a new generation (the workers read it when they start).
        let batch = generation_batch(spec, status.world_size, decided);
        let old_total = status.batch.as_ref().and_then(|b| b.plan).map(|p| p.total);
        if let Some(plan) = batch {
            let b = status
                .batch
                .get_or_insert_with(|| JobBatch::new(plan.reference));
            b.plan = Some(plan);
            b.planned_with_statistics = decided.is_some();
        } else if let Some(b) = status.batch.as_mut() {
            b.plan = None;
        }
        bump_generation(status, &mut taken_ports);
        if status.world_size == 0 {
            status.phase = JobPhase::Pending;
            status.message = Some(match (unknown_queue.get(&s.job), preempted.get(&s.job)) {
                (Some(queue), _) => unknown_queue_message(queue),
                (None, Some(why)) => format!("{why}; waiting for GPUs"),
                (None, None) => "preempted: waiting for GPUs".into(),
            });
        } else {
            status.phase = JobPhase::Restarting;
            status.message = None;
        }
        let to = status.world_size;
        let policy = settings.scheduler.name();
        let (cause, reason) = match (rebatch, old_total) {
            (Some(total), Some(old)) if from == to && !moved => (
                ChangeCause::Batch,
                format!(
                    "job {}: batch {old} -> {total} samples per step with its first gradient statistics, {from} workers (generation {})",
                    status.job, status.generation
                ),
            ),
            _ => {
                let cause = if to == 0 {
                    ChangeCause::Preempted
                } else if from == 0 {
                    ChangeCause::Started
                } else if to > from {
                    ChangeCause::Grown
                } else if to < from {
                    ChangeCause::Shrunk
                } else {
                    ChangeCause::Moved
                };
                let why = match cause {
                    ChangeCause::Preempted => {
                        match (unknown_queue.get(&status.job), preempted.get(&status.job)) {
                            (Some(queue), _) => unknown_queue_message(queue),
                            (None, Some(why)) => why.clone(),
                            (None, None) => format!(
                                "preempted by the {policy} policy (its GPUs went to other jobs)"
                            ),
                        }
                    }
                    ChangeCause::Moved => "placement moved its workers".to_string(),
                    _ => format!("{} by the {policy} policy", cause.as_str()),
                };
                (
                    cause,
                    format!(
                        "job {}: {from} -> {to} workers (generation {}): {why}",
                        status.job, status.generation
                    ),
                )
            }
        };
        status.record_allocation(now, from, cause, reason.clone());
        out.events.push(event(
            now,
            EventKind::AllocationChanged {
                job: status.job.clone(),
                generation: status.generation,
                from_workers: from,
                to_workers: to,
            },
            reason,
        ));
    }
}

/// What [`plan_ps_jobs`] reads besides the placements.
struct PsContext<'a> {
    settings: &'a Settings,
    live: &'a BTreeMap<&'a HostId, &'a HostTelemetry>,
    nics: &'a BTreeMap<&'a HostId, HostNic>,
    histories: &'a BTreeMap<JobId, JobHistory>,
    models: &'a BTreeMap<JobId, (ThroughputModel, f64)>,
}

/// Shards of every active `arch = "ps"` job, and the workers of those being (re)placed, by
/// the LP planner of [`crate::ps_plan`] (Yu et al., IEEE TNSE 2021; design brief §5.2).
///
/// A PS job whose workers keep their placement keeps its shards. A PS job that the
/// placement moved or resized (and got workers) is planned again, in priority order: with
/// the worker count the policy gave it fixed, the planner chooses how many shards
/// (1..=`max_ps`, default up to one per worker) and where the workers and shards go, on
/// each live host's GPUs not used by other jobs, the shard slots left
/// ([`Settings::ps_shards_per_host`]) and its NIC (link speed × NIC factor, both
/// directions; [`DEFAULT_LINK_BYTES_PER_S`] when unknown). The job's step is priced with its
/// reported model size ([`DEFAULT_PS_MODEL_BYTES`] before one) and the compute time of its
/// throughput model (1 s before one). The plan's workers replace the placement's (same
/// count; GPUs lowest first on each host, ranks in host order); the placement's own ranks
/// stay when the plan uses the same hosts with the same counts. With no plan (no shard slot
/// free), the shards are co-located with the workers as before the planner.
fn plan_ps_jobs(
    cx: &PsContext<'_>,
    active: &[(JobStatus, &JobSpec)],
    placed: &mut BTreeMap<JobId, Vec<RankPlacement>>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let mut shards: BTreeMap<JobId, Vec<RankPlacement>> = BTreeMap::new();
    let mut replan: Vec<(&JobStatus, &JobSpec)> = Vec::new();
    for (s, spec) in active {
        // S-EASGD shadow jobs keep their central copy on shards planned the same way (the
        // planner's price of a step stands for their sync round: a faster round, more
        // rounds per second).
        if !spec.has_ps_shards() {
            continue;
        }
        let ranks = placed.get(&s.job).map_or(&[][..], Vec::as_slice);
        if ranks.is_empty() {
            continue;
        }
        if ranks == s.placement.as_slice() {
            shards.insert(s.job.clone(), s.ps_placement.clone());
        } else {
            replan.push((s, spec));
        }
    }
    let hosts: Vec<&HostId> = cx.live.keys().copied().collect();
    for (s, spec) in replan {
        let mine = placed.get(&s.job).cloned().unwrap_or_default();
        let mut used: BTreeMap<&HostId, BTreeSet<u32>> = BTreeMap::new();
        for (job, ranks) in placed.iter() {
            if *job != s.job {
                for r in ranks {
                    used.entry(&r.host).or_default().extend(&r.gpus);
                }
            }
        }
        let mut slots_used: BTreeMap<&HostId, u32> = BTreeMap::new();
        for (job, list) in &shards {
            if *job != s.job {
                for r in list {
                    *slots_used.entry(&r.host).or_default() += 1;
                }
            }
        }
        // A selector job's workers and shards stay on the hosts it matches.
        let allowed = eligible_hosts(spec, cx.live);
        let allows = |h: &HostId| allowed.as_ref().is_none_or(|set| set.contains(h));
        let free: Vec<Vec<u32>> = hosts
            .iter()
            .map(|h| {
                if !allows(h) {
                    return Vec::new();
                }
                let taken = used.get(h);
                cx.live[h]
                    .gpus
                    .iter()
                    .map(|g| g.index)
                    .filter(|g| taken.is_none_or(|t| !t.contains(g)))
                    .collect()
            })
            .collect();
        let ps_hosts: Vec<PsHost> = hosts
            .iter()
            .zip(&free)
            .map(|(h, gpus)| {
                let nic = cx.nics[h];
                PsHost::new(
                    gpus.len() as u32,
                    if allows(h) {
                        cx.settings
                            .ps_shards_per_host
                            .saturating_sub(slots_used.get(h).copied().unwrap_or(0))
                    } else {
                        0
                    },
                    2.0 * nic.link_bytes_per_s.unwrap_or(DEFAULT_LINK_BYTES_PER_S) * nic.factor,
                )
            })
            .collect();
        let workers = mine.len() as u32;
        let model = cx.models.get(&s.job);
        let job = PsJob {
            model_bytes: cx
                .histories
                .get(&s.job)
                .and_then(JobHistory::model_bytes)
                .map_or(DEFAULT_PS_MODEL_BYTES, |b| b as f64),
            compute_s: model.map_or(JobCost::default().compute_s, |(m, b)| {
                JobCost::from_model(m, workers, *b).compute_s
            }),
            samples_per_worker: model.map_or(1.0, |(_, b)| *b),
            gpus_per_worker: spec.gpus_per_worker,
            min_workers: workers,
            max_workers: workers,
            min_shards: 1,
            max_shards: spec.max_ps.unwrap_or(workers).max(1),
            target_fraction: PS_TARGET_FRACTION,
        };
        let plan = plan_ps_job(&ps_hosts, &job, s.generation + 1);
        let (ranks, list) = match plan {
            Some(plan) => ps_ranks(&plan, &hosts, &free, &mine, spec.gpus_per_worker),
            None => {
                let list = colocated_shards(workers, &mine, spec);
                (mine, list)
            }
        };
        placed.insert(s.job.clone(), ranks);
        shards.insert(s.job.clone(), list);
    }
    shards
}

/// Worker ranks and shard ranks of a PS plan (host indices into `hosts`; `free[h]` the
/// GPUs free for the job on host `h`, increasing). Keeps `placed` (the placement's ranks)
/// when the plan puts the same number of workers on the same hosts.
fn ps_ranks(
    plan: &PsPlan,
    hosts: &[&HostId],
    free: &[Vec<u32>],
    placed: &[RankPlacement],
    gpus_per_worker: u32,
) -> (Vec<RankPlacement>, Vec<RankPlacement>) {
    let mut counts: BTreeMap<&HostId, u32> = BTreeMap::new();
    for r in placed {
        *counts.entry(&r.host).or_default() += 1;
    }
    let planned: BTreeMap<&HostId, u32> = plan
        .workers_per_host
        .iter()
        .map(|&(h, n)| (hosts[h], n))
        .collect();
    let workers = if planned == counts {
        placed.to_vec()
    } else {
        let per = gpus_per_worker as usize;
        let mut ranks = Vec::with_capacity(plan.workers as usize);
        for &(h, n) in &plan.workers_per_host {
            for chunk in free[h].chunks_exact(per).take(n as usize) {
                ranks.push(RankPlacement {
                    rank: ranks.len() as u32,
                    host: hosts[h].clone(),
                    gpus: chunk.to_vec(),
                });
            }
        }
        ranks
    };
    let world_size = workers.len() as u32;
    let shards = plan
        .shards_per_host
        .iter()
        .flat_map(|&(h, n)| std::iter::repeat_n(hosts[h], n as usize))
        .enumerate()
        .map(|(i, host)| RankPlacement {
            rank: world_size + i as u32,
            host: host.clone(),
            gpus: Vec::new(),
        })
        .collect();
    (workers, shards)
}

/// Host plans from job statuses: every `running` job's ranks on their hosts.
fn plans(
    inp: Inputs<'_>,
    statuses: &BTreeMap<JobId, JobStatus>,
    live: &BTreeMap<&HostId, &HostTelemetry>,
) -> BTreeMap<HostId, HostPlan> {
    let mut plans: BTreeMap<HostId, HostPlan> = inp
        .hosts
        .keys()
        .map(|h| {
            (
                h.clone(),
                HostPlan {
                    protocol: PROTOCOL_VERSION,
                    host: h.clone(),
                    workers: Vec::new(),
                },
            )
        })
        .collect();
    for status in statuses.values() {
        if status.phase != JobPhase::Running {
            continue;
        }
        let (Some(spec), Some(port)) = (inp.specs.get(&status.job), status.master_port) else {
            continue;
        };
        let Some(rank0) = status.placement.iter().find(|p| p.rank == 0) else {
            continue;
        };
        let Some(master_addr) = live.get(&rank0.host).map(|t| t.addr.clone()) else {
            continue;
        };
        let shards = ps_shards(status, spec);
        let num_ps = shards.len() as u32;
        let worker_hosts = status
            .placement
            .iter()
            .map(|p| &p.host)
            .collect::<BTreeSet<_>>()
            .len() as u32;
        let world_size = status.world_size + num_ps;
        let mut by_host: BTreeMap<&HostId, Vec<&RankPlacement>> = BTreeMap::new();
        for p in status.placement.iter().chain(&shards) {
            by_host.entry(&p.host).or_default().push(p);
        }
        // Hosts in order of the lowest rank each runs: torchrun's node rank.
        let mut node_order: Vec<(u32, &HostId)> = by_host
            .iter()
            .map(|(h, ranks)| (ranks.iter().map(|p| p.rank).min().unwrap_or(0), *h))
            .collect();
        node_order.sort();
        let node_rank = |h: &HostId| {
            node_order
                .iter()
                .position(|(_, x)| *x == h)
                .map(|i| i as u32)
        };
        for (host, ranks) in by_host {
            let node_rank = node_rank(host);
            let plan = plans.entry(host.clone()).or_insert_with(|| HostPlan {
                protocol: PROTOCOL_VERSION,
                host: host.clone(),
                workers: Vec::new(),
            });
            for (local_rank, p) in ranks.iter().enumerate() {
                plan.workers.push(WorkerAssignment {
                    job: status.job.clone(),
                    generation: status.generation,
                    rank: p.rank,
                    world_size,
                    local_rank: local_rank as u32,
                    local_world_size: ranks.len() as u32,
                    gpus: p.gpus.clone(),
                    master_addr: master_addr.clone(),
                    master_port: port,
                    command: spec.command.clone(),
                    env: spec.env.clone(),
                    max_restarts: spec.max_restarts,
                    num_ps,
                    hosts: worker_hosts,
                    batch: status.batch.as_ref().and_then(|b| b.plan),
                    node_rank,
                    shadow: spec.shadow.filter(|_| spec.arch == SyncArch::Shadow),
                });
            }
        }
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::{GpuSample, MAX_ALLOCATION_CHANGES, WorkerState};

    fn job(id: &str, min: u32, max: u32, submitted_at: f64) -> JobSpec {
        let mut spec = JobSpec::from_toml(&format!(
            "id = \"{id}\"\ncommand = [\"train\"]\nmin_workers = {min}\nmax_workers = {max}\n"
        ))
        .unwrap();
        spec.submitted_at = submitted_at;
        spec
    }

    fn host(id: &str, gpus: u32, time: f64, workers: Vec<WorkerState>) -> HostTelemetry {
        HostTelemetry {
            protocol: PROTOCOL_VERSION,
            host: HostId::new(id).unwrap(),
            addr: format!("10.0.0.{}", id.len()),
            time,
            agent_version: "test".into(),
            gpu_source: "fake".into(),
            gpus: (0..gpus)
                .map(|index| GpuSample {
                    index,
                    uuid: format!("GPU-{id}-{index}"),
                    name: "fake".into(),
                    memory_total_bytes: 1,
                    memory_used_bytes: 0,
                    utilization_pct: 0.0,
                    power_mw: None,
                    sm_clock_mhz: None,
                })
                .collect(),
            nics: vec![],
            cpu_pct: 0.0,
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            workers,
            malformed_progress_lines: 0,
            ignored_gradient_stats: 0,
            skipped_progress_reports: 0,
            labels: BTreeMap::new(),
        }
    }

    /// A progress report of `job`'s `rank` on `host` (no optional fields).
    #[allow(clippy::too_many_arguments)]
    fn progress(
        job: &str,
        generation: u64,
        rank: u32,
        host: &str,
        step: u64,
        samples: u64,
        loss: f64,
        time: f64,
    ) -> converge_common::ProgressReport {
        let (job, host) = (JobId::new(job).unwrap(), HostId::new(host).unwrap());
        converge_common::ProgressReport::new(job, generation, rank, host, step, samples, loss, time)
    }

    fn worker(job: &str, generation: u64, rank: u32, phase: WorkerPhase) -> WorkerState {
        WorkerState {
            job: JobId::new(job).unwrap(),
            generation,
            rank,
            phase,
            pid: Some(100 + rank),
            restarts: 0,
            last_exit_code: None,
            gpus: vec![rank],
        }
    }

    /// The cluster state a test drives through steps.
    #[derive(Debug, Clone, Default)]
    struct World {
        specs: BTreeMap<JobId, JobSpec>,
        refused: BTreeMap<JobId, String>,
        statuses: BTreeMap<JobId, JobStatus>,
        hosts: BTreeMap<HostId, HostTelemetry>,
        histories: BTreeMap<JobId, JobHistory>,
        settings: Settings,
        cache: FitCache,
        queues: BTreeMap<QueueId, QueueSpec>,
        queue_statuses: BTreeMap<QueueId, QueueStatus>,
    }

    impl World {
        fn add_host(&mut self, t: HostTelemetry) {
            self.hosts.insert(t.host.clone(), t);
        }
        fn step(&mut self, now: f64, run_policy: bool) -> Outcome {
            let out = step(
                Inputs {
                    now,
                    specs: &self.specs,
                    refused_specs: &self.refused,
                    statuses: &self.statuses,
                    hosts: &self.hosts,
                    histories: &self.histories,
                    queues: &self.queues,
                    queue_statuses: &self.queue_statuses,
                },
                &self.settings,
                &mut self.cache,
                run_policy,
            );
            self.statuses = out.statuses.clone();
            if run_policy {
                self.queue_statuses = out.queue_statuses.clone();
            }
            out
        }
        fn status(&self, id: &str) -> &JobStatus {
            &self.statuses[&JobId::new(id).unwrap()]
        }
    }

    #[test]
    fn a_job_is_placed_runs_and_completes() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 2, 2, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.add_host(host("h2", 1, 10.0, vec![]));
        let out = w.step(10.0, true);
        let s = w.status("a");
        // Nothing of an older generation runs, so the job starts in the same step.
        assert_eq!(
            (s.phase, s.generation, s.world_size),
            (JobPhase::Running, 1, 2)
        );
        let plan1 = &out.plans[&HostId::new("h1").unwrap()];
        let plan2 = &out.plans[&HostId::new("h2").unwrap()];
        assert_eq!((plan1.workers.len(), plan2.workers.len()), (1, 1));
        let rank0_host = &s.placement[0].host;
        let master = &out.plans[rank0_host].workers[0].master_addr;
        assert!(
            out.plans
                .values()
                .all(|p| &p.workers[0].master_addr == master)
        );
        assert_eq!(plan1.workers[0].master_port, s.master_port.unwrap());
        // torchrun's node rank: 0 on rank 0's host, 1 on the other.
        assert_eq!(out.plans[rank0_host].workers[0].node_rank, Some(0));
        assert!(
            out.plans
                .values()
                .all(|p| p.workers[0].node_rank == Some(u32::from(p.workers[0].rank != 0)))
        );
        // The status keeps the change and why, for the dashboard's timeline.
        let started = &s.allocations[..];
        assert_eq!(started.len(), 1, "{started:?}");
        assert_eq!(
            (
                started[0].cause,
                started[0].generation,
                started[0].from_workers
            ),
            (ChangeCause::Started, 1, 0)
        );
        assert_eq!((started[0].workers, started[0].hosts), (2, 2));
        assert!(started[0].reason.contains("quality policy"), "{started:?}");

        // Rank 0 exits 0: the job completes and leaves every plan.
        let h = rank0_host.clone();
        w.add_host(host(
            h.as_str(),
            1,
            11.0,
            vec![worker("a", 1, 0, WorkerPhase::Succeeded)],
        ));
        let other = if h.as_str() == "h1" { "h2" } else { "h1" };
        w.add_host(host(
            other,
            1,
            11.0,
            vec![worker("a", 1, 1, WorkerPhase::Running)],
        ));
        let out = w.step(11.0, false);
        assert_eq!(w.status("a").phase, JobPhase::Completed);
        assert!(out.plans.values().all(|p| p.workers.is_empty()));
        assert!(out.events.iter().any(|e| matches!(
            e.kind,
            EventKind::JobFinished {
                phase: JobPhase::Completed,
                ..
            }
        )));
    }

    #[test]
    fn a_new_address_of_rank_0s_host_restarts_the_job() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        let out = w.step(10.0, true);
        let s = w.status("a").clone();
        assert_eq!(s.master_addr.as_deref(), Some("10.0.0.2"));
        assert_eq!(
            out.plans[&HostId::new("h1").unwrap()].workers[0].master_addr,
            "10.0.0.2"
        );
        // Same address: nothing changes.
        w.add_host(host(
            "h1",
            1,
            11.0,
            vec![worker("a", 1, 0, WorkerPhase::Running)],
        ));
        w.step(11.0, true);
        assert_eq!(w.status("a").generation, s.generation);
        // The agent comes back under another address.
        let mut t = host("h1", 1, 12.0, vec![worker("a", 1, 0, WorkerPhase::Running)]);
        t.addr = "10.0.0.99".into();
        w.add_host(t);
        let out = w.step(12.0, false);
        let moved = w.status("a");
        assert_eq!(moved.generation, s.generation + 1);
        assert_eq!(moved.phase, JobPhase::Restarting);
        assert_eq!(moved.master_addr.as_deref(), Some("10.0.0.99"));
        assert_ne!(moved.master_port, s.master_port);
        assert!(out.events.iter().any(|e| e.message.contains("10.0.0.99")));
        let last = moved.allocations.last().unwrap();
        assert_eq!(
            (last.cause, last.generation),
            (ChangeCause::Address, moved.generation)
        );
        assert_eq!(moved.allocations.len(), 2);
    }

    #[test]
    fn a_lost_host_and_the_cap_show_in_the_allocation_history() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.add_host(host("h2", 1, 10.0, vec![]));
        w.step(10.0, true);
        let first = w.status("a").placement[0].host.clone();
        let other = if first.as_str() == "h1" { "h2" } else { "h1" };
        // The job's host goes silent past the host timeout; the other one stays live.
        w.add_host(host(other, 1, 40.0, vec![]));
        w.step(40.0, true);
        let s = w.status("a");
        assert_eq!(s.placement[0].host.as_str(), other);
        // Taken off the lost host (generation 1 ends), then placed again (generation 2).
        let causes: Vec<_> = s
            .allocations
            .iter()
            .map(|c| (c.cause, c.generation, c.workers))
            .collect();
        assert_eq!(
            causes,
            [
                (ChangeCause::Started, 1, 1),
                (ChangeCause::HostLost, 1, 0),
                (ChangeCause::Started, 2, 1)
            ]
        );
        let lost = &s.allocations[1];
        assert!(lost.reason.contains(first.as_str()), "{}", lost.reason);

        let mut s = s.clone();
        for g in 0..(MAX_ALLOCATION_CHANGES as u64 + 5) {
            s.generation = 100 + g;
            s.record_allocation(50.0, 1, ChangeCause::Moved, "moved".into());
        }
        assert_eq!(s.allocations.len(), MAX_ALLOCATION_CHANGES);
        assert_eq!(
            s.allocations.last().unwrap().generation,
            100 + MAX_ALLOCATION_CHANGES as u64 + 4
        );
    }

    #[test]
    fn refits_beyond_the_budget_wait_for_a_later_step() {
        let mut w = World::default();
        w.settings.fit_budget = 1;
        let loss = |k: u64| 2.0 / (1.0 + k as f64 / 300.0) + 0.2;
        for id in ["a", "b"] {
            w.specs.insert(JobId::new(id).unwrap(), job(id, 1, 1, 1.0));
            let h = w.histories.entry(JobId::new(id).unwrap()).or_default();
            for i in 1..=30u64 {
                h.add(&progress(id, 1, 0, "h1", i, i * 10, loss(i * 10), i as f64));
            }
        }
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.step(10.0, false);
        // One fit per step: "a" (first by id among equals) now, "b" at the next step.
        assert!(w.status("a").curve.is_some());
        assert!(w.status("b").curve.is_none());
        w.step(10.5, false);
        assert!(w.status("b").curve.is_some());
        let id = JobId::new("a").unwrap();
        assert_eq!(w.cache.refit_pending(&id, &w.histories[&id]), None);
    }

    #[test]
    fn a_failure_beside_a_lost_host_reschedules_instead_of_failing() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 2, 2, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.add_host(host("h2", 1, 10.0, vec![]));
        w.step(10.0, true);
        let s = w.status("a").clone();
        assert_eq!(s.world_size, 2);
        // h2 goes silent; h1's rank fails because its ring peer vanished.
        let on_h1 = s
            .placement
            .iter()
            .find(|p| p.host.as_str() == "h1")
            .unwrap();
        w.add_host(host(
            "h1",
            1,
            30.0,
            vec![worker("a", 1, on_h1.rank, WorkerPhase::Failed)],
        ));
        w.step(30.0, false);
        let s = w.status("a");
        assert_eq!(s.phase, JobPhase::Pending, "{s:?}");
        assert!(s.message.as_deref().unwrap_or("").contains("h2"));
    }

    #[test]
    fn a_host_cannot_finish_ranks_placed_elsewhere() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.add_host(host("h2", 0, 10.0, vec![]));
        w.step(10.0, true);
        assert_eq!(w.status("a").placement[0].host.as_str(), "h1");
        // h2 runs nothing of the job but claims its rank 0 succeeded, then failed.
        for phase in [WorkerPhase::Succeeded, WorkerPhase::Failed] {
            w.add_host(host("h2", 0, 11.0, vec![worker("a", 1, 0, phase)]));
            w.add_host(host(
                "h1",
                1,
                11.0,
                vec![worker("a", 1, 0, WorkerPhase::Running)],
            ));
            w.step(11.0, false);
            assert_eq!(w.status("a").phase, JobPhase::Running, "{phase:?}");
        }
        // The host the rank is placed on is believed.
        w.add_host(host(
            "h1",
            1,
            12.0,
            vec![worker("a", 1, 0, WorkerPhase::Succeeded)],
        ));
        w.step(12.0, false);
        assert_eq!(w.status("a").phase, JobPhase::Completed);
    }

    /// Step time of a PS job's status under the planner's model (default model size and
    /// compute, default link speed on every host).
    fn ps_step_time(s: &JobStatus, hosts: &[&str]) -> f64 {
        let count = |list: &[RankPlacement], h: &str| {
            list.iter().filter(|r| r.host.as_str() == h).count() as u32
        };
        let ps_hosts: Vec<PsHost> = hosts
            .iter()
            .map(|_| PsHost::new(8, 8, 2.0 * DEFAULT_LINK_BYTES_PER_S))
            .collect();
        let workers: Vec<u32> = hosts.iter().map(|h| count(&s.placement, h)).collect();
        let shards: Vec<u32> = hosts.iter().map(|h| count(&s.ps_placement, h)).collect();
        let job = PsJob::new(
            DEFAULT_PS_MODEL_BYTES,
            JobCost::default().compute_s,
            s.world_size..=s.world_size,
            1..=s.world_size,
        );
        crate::ps_plan::step_time_s(&ps_hosts, &job, &workers, &shards)
    }

    #[test]
    fn parameter_server_jobs_get_planned_shards() {
        for max_ps in [None, Some(1), Some(2)] {
            let mut w = World::default();
            let mut spec = job("ps", 3, 3, 1.0);
            spec.arch = SyncArch::Ps;
            spec.max_ps = max_ps;
            w.specs.insert(JobId::new("ps").unwrap(), spec);
            w.add_host(host("h1", 2, 10.0, vec![]));
            w.add_host(host("h2", 2, 10.0, vec![]));
            let out = w.step(10.0, true);
            let s = w.status("ps").clone();
            converge_common::messages::Message::validate(&s).unwrap();
            assert_eq!((s.phase, s.world_size), (JobPhase::Running, 3));
            let shards = s.ps_placement.len();
            assert!(
                shards >= 1 && shards <= max_ps.unwrap_or(3) as usize,
                "{max_ps:?}"
            );
            let all: Vec<&WorkerAssignment> = out.plans.values().flat_map(|p| &p.workers).collect();
            assert_eq!(all.len(), 3 + shards, "{max_ps:?}");
            for a in &all {
                assert_eq!((a.world_size, a.num_ps), (3 + shards as u32, shards as u32));
            }
            // The shards in the plans are the status's, ranks after the workers, no GPUs.
            for shard in &s.ps_placement {
                let a = out.plans[&shard.host]
                    .workers
                    .iter()
                    .find(|a| a.rank == shard.rank)
                    .unwrap();
                assert!(a.gpus.is_empty());
            }
            for p in out.plans.values() {
                converge_common::messages::Message::validate(p).unwrap();
            }
            // The plan is at least as fast as co-locating a shard with each worker host
            // (the fallback) under the planner's own model.
            let mut colocated = s.clone();
            colocated.ps_placement = colocated_shards(3, &s.placement, &w.specs[&s.job]);
            assert!(
                ps_step_time(&s, &["h1", "h2"]) <= ps_step_time(&colocated, &["h1", "h2"]) + 1e-9,
                "{max_ps:?}: {:?}",
                s.ps_placement
            );
            // Nothing new: nothing moves.
            w.step(11.0, true);
            assert_eq!(w.status("ps"), &s);
        }
    }

    #[test]
    fn parameter_server_shards_stay_with_workers_on_one_host_and_fall_back_without_slots() {
        // Two workers fit on h1: the planner keeps every byte on h1 (shards there too).
        let mut w = World::default();
        let mut spec = job("ps", 2, 2, 1.0);
        spec.arch = SyncArch::Ps;
        w.specs.insert(JobId::new("ps").unwrap(), spec.clone());
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.add_host(host("h2", 2, 10.0, vec![]));
        w.step(10.0, true);
        let s = w.status("ps");
        let worker_hosts: BTreeSet<&HostId> = s.placement.iter().map(|r| &r.host).collect();
        assert_eq!(worker_hosts.len(), 1);
        assert!(!s.ps_placement.is_empty());
        assert!(
            s.ps_placement
                .iter()
                .all(|r| worker_hosts.contains(&r.host))
        );

        // No shard slot anywhere: no plan, one shard per worker host (co-location).
        let mut w = World::default();
        w.settings.ps_shards_per_host = 0;
        let mut spec = job("ps", 3, 3, 1.0);
        spec.arch = SyncArch::Ps;
        w.specs.insert(JobId::new("ps").unwrap(), spec);
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.add_host(host("h2", 2, 10.0, vec![]));
        w.step(10.0, true);
        let s = w.status("ps");
        let shard_hosts: Vec<&str> = s.ps_placement.iter().map(|r| r.host.as_str()).collect();
        assert_eq!(shard_hosts, ["h1", "h2"]);
    }

    #[test]
    fn a_lost_shard_host_sends_the_job_back_to_pending() {
        let mut w = World::default();
        let mut a = job("a", 2, 2, 1.0);
        a.arch = SyncArch::Ps;
        w.specs.insert(JobId::new("a").unwrap(), a);
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.add_host(host("h3", 0, 10.0, vec![]));
        w.step(10.0, true);
        // The job runs on h1 with its shard moved to h3, which holds none of its workers.
        let id = JobId::new("a").unwrap();
        let s = w.statuses.get_mut(&id).unwrap();
        assert_eq!((s.phase, s.world_size), (JobPhase::Running, 2));
        s.ps_placement = vec![RankPlacement {
            rank: 2,
            host: HostId::new("h3").unwrap(),
            gpus: vec![],
        }];
        w.hosts.remove(&HostId::new("h3").unwrap());
        let out = w.step(11.0, false);
        let s = w.status("a");
        assert_eq!((s.phase, s.world_size), (JobPhase::Pending, 0));
        assert!(s.placement.is_empty() && s.ps_placement.is_empty());
        assert!(out.events.iter().any(|e| matches!(
            &e.kind,
            EventKind::HostLost { host } if host.as_str() == "h3"
        )));
    }

    #[test]
    fn a_resize_waits_for_the_old_generation_to_exit() {
        let mut w = World::default();
        // Free restarts, so that growing from 1 to 2 workers pays off.
        w.settings.policy.restart_cost_s = 0.0;
        w.settings.scheduler = Arc::new(Quality {
            params: w.settings.policy,
        });
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 2, 1.0));
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.step(10.0, true);
        assert_eq!(w.status("a").world_size, 1);
        // A second host joins while generation 1 runs on h1.
        w.add_host(host(
            "h1",
            1,
            20.0,
            vec![worker("a", 1, 0, WorkerPhase::Running)],
        ));
        w.add_host(host("h2", 1, 20.0, vec![]));
        let out = w.step(20.0, true);
        let s = w.status("a");
        assert_eq!(
            (s.phase, s.generation, s.world_size),
            (JobPhase::Restarting, 2, 2)
        );
        assert!(
            out.plans.values().all(|p| p.workers.is_empty()),
            "old generation must stop first"
        );
        // Still stopping: no change.
        w.add_host(host(
            "h1",
            1,
            21.0,
            vec![worker("a", 1, 0, WorkerPhase::Stopping)],
        ));
        w.step(21.0, false);
        assert_eq!(w.status("a").phase, JobPhase::Restarting);
        // Gone: the new generation is planned on both hosts.
        w.add_host(host("h1", 1, 22.0, vec![]));
        let out = w.step(22.0, false);
        assert_eq!(w.status("a").phase, JobPhase::Running);
        let planned: usize = out.plans.values().map(|p| p.workers.len()).sum();
        assert_eq!(planned, 2);
        assert!(
            out.plans
                .values()
                .flat_map(|p| &p.workers)
                .all(|x| x.generation == 2)
        );
    }

    #[test]
    fn failures_lost_hosts_cancellations_and_refused_specs() {
        let mut w = World::default();
        for id in ["crash", "lost", "gone"] {
            w.specs.insert(JobId::new(id).unwrap(), job(id, 1, 1, 1.0));
        }
        w.refused
            .insert(JobId::new("bad").unwrap(), "`command` is empty".into());
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.add_host(host("h2", 1, 10.0, vec![]));
        w.step(10.0, true);
        assert_eq!(w.status("bad").phase, JobPhase::Failed);
        assert!(
            w.status("bad")
                .message
                .as_ref()
                .unwrap()
                .contains("command")
        );
        let on = |id: &str, w: &World| w.status(id).placement[0].host.to_string();
        let crash_host = on("crash", &w);
        let lost_host = on("lost", &w);

        // The crashing job's worker failed for good; the other job's host stops reporting.
        let mut failed = worker("crash", 1, 0, WorkerPhase::Failed);
        failed.last_exit_code = Some(3);
        failed.restarts = 3;
        for h in ["h1", "h2"] {
            let t = if h == lost_host { 10.0 } else { 40.0 };
            let ws = if h == crash_host {
                vec![failed.clone()]
            } else {
                vec![]
            };
            w.add_host(host(h, if h == "h1" { 2 } else { 1 }, t, ws));
        }
        let mut spec = job("gone", 1, 1, 1.0);
        spec.cancelled = true;
        w.specs.insert(JobId::new("gone").unwrap(), spec);
        w.step(40.0, true);
        let crash = w.status("crash");
        assert_eq!(crash.phase, JobPhase::Failed);
        assert!(
            crash.message.as_ref().unwrap().contains("exit code 3"),
            "{crash:?}"
        );
        assert_eq!(w.status("gone").phase, JobPhase::Cancelled);
        let lost = w.status("lost");
        // First-fit put "crash" and "gone" on h1 and "lost" on h2; "lost" is placed again on
        // the live host, in a new generation.
        assert_ne!(lost_host, crash_host);
        assert!(
            lost.placement.iter().all(|p| p.host.as_str() != lost_host),
            "{lost:?}"
        );
        assert_eq!((lost.generation, lost.world_size), (2, 1));
        // Finished jobs keep their status on later steps.
        let before = w.statuses.clone();
        w.step(41.0, true);
        for id in ["crash", "gone", "bad"] {
            assert_eq!(w.status(id), &before[&JobId::new(id).unwrap()]);
        }
    }

    #[test]
    fn statuses_show_observed_and_predicted_step_times() {
        let id = JobId::new("s").unwrap();
        // 32 samples per worker per step: 64 per step with 2 workers, 128 with 4.
        let report = |generation: u64, rank: u32, host: &str, step: u64, time: f64| {
            let per_step = if generation == 1 { 64 } else { 128 };
            progress(
                id.as_str(),
                generation,
                rank,
                host,
                step,
                step * per_step,
                1.0,
                time,
            )
        };
        let mut h = JobHistory::default();
        // Generation 1: 2 ranks on h1, 0.1 s per step.
        h.add(&report(1, 0, "h1", 0, 0.0));
        h.add(&report(1, 1, "h1", 0, 0.0));
        h.add(&report(1, 0, "h1", 100, 10.0));
        let mut status = new_status(&id, 0.0, 0.0);
        status.generation = 1;
        status.world_size = 2;
        let prior = ThroughputPrior::default();
        let mut cache = FitCache::new();
        // Only one generation: observed, nothing to predict from.
        let (observed, predicted) = step_times(&status, &h.step_observations(), &mut cache, &prior);
        assert!((observed.unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(predicted, None);
        // Generation 2: 4 ranks on h1 and h2, 0.2 s per step.
        for (rank, host) in [(0, "h1"), (1, "h1"), (2, "h2"), (3, "h2")] {
            h.add(&report(2, rank, host, 100, 20.0));
        }
        h.add(&report(2, 0, "h1", 150, 30.0));
        status.generation = 2;
        status.world_size = 4;
        status.placement = ["h1", "h1", "h2", "h2"]
            .iter()
            .enumerate()
            .map(|(rank, host)| RankPlacement {
                rank: rank as u32,
                host: HostId::new(*host).unwrap(),
                gpus: vec![rank as u32 % 2],
            })
            .collect();
        let (observed, predicted) = step_times(&status, &h.step_observations(), &mut cache, &prior);
        assert!((observed.unwrap() - 0.2).abs() < 1e-12);
        // Predicted from generation 1 alone: slower than 2 ranks on one host (the prior's
        // sync terms), finite.
        let predicted = predicted.unwrap();
        assert!(predicted.is_finite() && predicted > 0.1, "{predicted}");
    }

    #[test]
    fn batch_jobs_adapt_with_statistics_and_keep_their_reference_without() {
        let mut w = World::default();
        let batch =
            "[batch]\nreference = 32\nmax_total = 1024\nmin_per_worker = 8\nmax_per_worker = 128\n";
        for (id, table) in [("ad", batch), ("fx", batch), ("plain", "")] {
            let mut spec = JobSpec::from_toml(&format!(
                "id = \"{id}\"\ncommand = [\"train\"]\nmin_workers = 1\nmax_workers = 2\n{table}"
            ))
            .unwrap();
            spec.submitted_at = 1.0;
            w.specs.insert(spec.id.clone(), spec);
        }
        w.add_host(host("h1", 6, 10.0, vec![]));
        let out = w.step(10.0, true);
        // First generation: no statistics yet, so every `[batch]` job runs the smallest total
        // its world size allows (32, or 8 per worker above 4 workers), the plan carries it.
        for id in ["ad", "fx"] {
            let s = w.status(id);
            let b = s.batch.as_ref().unwrap();
            assert!(!b.adaptive, "{id}");
            let plan = b.plan.unwrap();
            assert_eq!((plan.total, plan.reference), (32, 32), "{id}");
            plan.check(s.world_size).unwrap();
            for a in out.plans[&HostId::new("h1").unwrap()]
                .workers
                .iter()
                .filter(|a| a.job.as_str() == id)
            {
                assert_eq!(a.batch, Some(plan));
            }
        }
        assert_eq!(w.status("plain").batch, None);
        assert!(
            out.plans[&HostId::new("h1").unwrap()]
                .workers
                .iter()
                .filter(|a| a.job.as_str() == "plain")
                .all(|a| a.batch.is_none())
        );
        // Generation 1 runs: "ad" reports statistics with a large noise scale (10⁵
        // samples), "fx" only bad ones.
        for id in ["ad", "fx"] {
            let generation = w.status(id).generation;
            let workers = w.status(id).world_size;
            let mut h = JobHistory::default();
            for i in 0..20u64 {
                let mut r = progress(
                    id,
                    generation,
                    0,
                    "h1",
                    i * 10,
                    i * 320,
                    1.0 / (1.0 + i as f64),
                    10.0 + i as f64,
                );
                r.workers = Some(workers);
                r.hosts = Some(1);
                if id == "ad" {
                    (r.grad_sqr, r.grad_var) = (Some(1e-3), Some(100.0));
                } else {
                    (r.grad_sqr, r.grad_var) = (Some(f64::NAN), Some(-1.0));
                }
                h.add(&r);
            }
            w.histories.insert(JobId::new(id).unwrap(), h);
        }
        w.add_host(host("h1", 6, 31.0, vec![]));
        w.step(31.0, false);
        let ad = w.status("ad").batch.clone().unwrap();
        assert!(ad.adaptive);
        assert!((ad.noise_scale.unwrap() - 1e5).abs() < 1.0, "{ad:?}");
        assert_eq!(ad.gradient_reports, 20);
        // The batch does not change without a new generation.
        assert_eq!(ad.plan.unwrap().total, 32);
        let fx = w.status("fx").batch.clone().unwrap();
        assert!(!fx.adaptive);
        assert_eq!((fx.ignored_gradient_stats, fx.gradient_reports), (20, 0));
        // The next decision restarts "ad" once, on its placement, with a goodput batch.
        let (gen_ad, gen_fx) = (w.status("ad").generation, w.status("fx").generation);
        w.add_host(host("h1", 6, 32.0, vec![]));
        let out = w.step(32.0, true);
        let s = w.status("ad");
        assert_eq!(s.generation, gen_ad + 1);
        let b = s.batch.as_ref().unwrap();
        assert!(
            b.planned_with_statistics && b.plan.unwrap().total > 32,
            "{b:?}"
        );
        assert!(
            out.events
                .iter()
                .any(|e| e.message.contains("with its first gradient statistics")),
            "{:?}",
            out.events
        );
        assert_eq!(w.status("fx").generation, gen_fx, "fx has no statistics");
        // Once is enough: the next decision keeps it.
        w.add_host(host("h1", 6, 33.0, vec![]));
        w.step(33.0, true);
        assert_eq!(w.status("ad").generation, gen_ad + 1);
        // h1 is lost, h2 (8 GPUs) appears: every job is placed again as a new generation.
        w.add_host(host("h2", 8, 100.0, vec![]));
        w.step(100.0, true);
        let s = w.status("ad");
        assert!(s.world_size > 0 && s.placement.iter().all(|p| p.host.as_str() == "h2"));
        let plan = s.batch.as_ref().unwrap().plan.unwrap();
        plan.check(s.world_size).unwrap();
        // Almost no efficiency lost to larger batches: the goodput plan is above the
        // reference, within the limits.
        assert!(
            plan.total > 32 && plan.total <= 1024 && plan.per_worker <= 128,
            "{plan:?}"
        );
        let eff = s.batch.as_ref().unwrap().efficiency.unwrap();
        assert!(eff > 0.9 && eff <= 1.0, "{eff}");
        let s = w.status("fx");
        let plan = s.batch.as_ref().unwrap().plan.unwrap();
        assert_eq!(
            plan.total,
            32.max(8 * s.world_size),
            "fx keeps its reference"
        );
        assert_eq!(w.status("plain").batch, None);
    }

    #[test]
    fn reaching_the_target_loss_completes_the_job() {
        let mut w = World::default();
        let mut spec = job("t", 1, 1, 1.0);
        spec.target_loss = Some(0.4);
        let id = JobId::new("t").unwrap();
        w.specs.insert(id.clone(), spec);
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.step(10.0, true);
        let report = |samples: u64, loss: f64| {
            progress(
                "t",
                1,
                0,
                "h1",
                samples / 32,
                samples,
                loss,
                10.0 + samples as f64 / 1000.0,
            )
        };
        let history = w.histories.entry(id.clone()).or_default();
        history.add(&report(320, 0.7));
        history.add(&report(640, 0.5));
        w.step(11.0, false);
        assert_eq!(w.status("t").phase, JobPhase::Running);
        assert_eq!(w.status("t").first_loss, Some(0.7));
        w.histories.get_mut(&id).unwrap().add(&report(960, 0.39));
        let out = w.step(12.0, false);
        let s = w.status("t");
        assert_eq!(s.phase, JobPhase::Completed);
        assert!(
            s.message.as_ref().unwrap().contains("target loss 0.4"),
            "{s:?}"
        );
        assert_eq!((s.samples, s.loss), (960, Some(0.39)));
        assert!(out.plans.values().all(|p| p.workers.is_empty()));
    }

    #[test]
    fn stop_criteria_end_jobs_with_their_reason() {
        // Plateau: a curve that flattens ends the job as converged, with its end figures.
        let mut w = World::default();
        let mut spec = job("p", 1, 1, 1.0);
        spec.stop = Some(converge_common::StopSpec {
            plateau: Some(converge_common::PlateauSpec {
                min_improvement: 0.01,
                window_epochs: 2.0,
            }),
            ..Default::default()
        });
        let id = JobId::new("p").unwrap();
        w.specs.insert(id.clone(), spec);
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.step(10.0, true);
        let mut ended_at = None;
        for i in 1..=60u64 {
            let samples = i * 320;
            let mut r = progress(
                "p",
                1,
                0,
                "h1",
                i * 10,
                samples,
                1.0 / (1.0 + samples as f64 / 500.0) + 0.2,
                10.0 + i as f64,
            );
            // 1,000 samples per epoch.
            r.epoch = Some(samples as f64 / 1000.0);
            w.histories.entry(id.clone()).or_default().add(&r);
            w.add_host(host("h1", 1, 10.0 + i as f64, vec![]));
            w.step(10.0 + i as f64, false);
            if w.status("p").phase.is_terminal() {
                ended_at = Some(i);
                break;
            }
        }
        let s = w.status("p");
        assert_eq!(s.phase, JobPhase::Completed, "{s:?}");
        assert!(ended_at.unwrap() > 7, "not before two epochs have run");
        let end = s.end.as_ref().unwrap();
        assert_eq!(end.reason, EndReason::Converged);
        assert!(end.loss.is_some() && end.gpu_hours > 0.0, "{end:?}");
        let predicted = end.predicted_loss.unwrap();
        assert!((predicted - 0.2).abs() < 0.05, "{predicted}");
        assert!(s.message.as_ref().unwrap().contains("converged"));

        // Deadline: ends a job even while it waits for GPUs (no host here).
        let mut w = World::default();
        let mut spec = job("d", 1, 1, 1.0);
        spec.stop = Some(converge_common::StopSpec {
            deadline_s: Some(30.0),
            ..Default::default()
        });
        w.specs.insert(JobId::new("d").unwrap(), spec);
        w.step(20.0, true);
        assert_eq!(w.status("d").phase, JobPhase::Pending);
        w.step(31.0, true);
        let s = w.status("d");
        assert_eq!(s.phase, JobPhase::Completed);
        assert_eq!(s.end.as_ref().unwrap().reason, EndReason::Deadline);

        // A target at or above the first loss is refused once that loss is known.
        let mut w = World::default();
        let mut spec = job("t", 1, 1, 1.0);
        spec.target_loss = Some(0.9);
        let id = JobId::new("t").unwrap();
        w.specs.insert(id.clone(), spec);
        w.add_host(host("h1", 1, 10.0, vec![]));
        w.step(10.0, true);
        w.histories
            .entry(id)
            .or_default()
            .add(&progress("t", 1, 0, "h1", 10, 320, 0.8, 11.0));
        w.step(11.0, false);
        let s = w.status("t");
        assert_eq!(s.phase, JobPhase::Failed);
        assert!(
            s.message
                .as_ref()
                .unwrap()
                .contains("not below the job's first loss")
        );
        assert!(s.end.is_none());
    }

    /// The policy and placement pairs the host-restriction tests run under.
    const RESTRICTED_CASES: [(&str, PlacementKind); 5] = [
        ("quality", PlacementKind::FirstFit),
        ("quality", PlacementKind::Bco),
        ("pollux", PlacementKind::FirstFit),
        ("fifo", PlacementKind::Bco),
        ("fair", PlacementKind::FirstFit),
    ];

    /// An empty world scheduling with `policy` and `placement`.
    fn world_with(policy: &str, placement: PlacementKind) -> World {
        let mut w = World::default();
        w.settings.scheduler =
            Arc::from(crate::policies::by_name(policy, w.settings.policy).unwrap());
        w.settings.placement = placement;
        w
    }

    /// The hosts of a job's placement.
    fn hosts_of(s: &JobStatus) -> BTreeSet<String> {
        s.placement.iter().map(|p| p.host.to_string()).collect()
    }

    #[test]
    fn selector_jobs_run_only_on_matching_hosts_or_wait_with_the_reason() {
        let labelled = |id: &str, gpus: u32, time: f64, zone: &str| {
            let mut t = host(id, gpus, time, vec![]);
            t.labels.insert("zone".into(), zone.into());
            t.labels.insert("gpu.count".into(), gpus.to_string());
            t
        };
        for (policy, placement) in RESTRICTED_CASES {
            let what = format!("{policy} with {placement:?}");
            let mut w = world_with(policy, placement);
            w.add_host(labelled("h1", 4, 10.0, "a"));
            w.add_host(labelled("h2", 4, 10.0, "b"));
            let mut picky = job("picky", 1, 8, 1.0);
            picky.selector.insert("zone".into(), "b".into());
            let mut waiting = job("waiting", 1, 2, 2.0);
            waiting.selector.insert("zone".into(), "c".into());
            waiting.selector.insert("gpu.count".into(), "2".into());
            for spec in [picky, waiting, job("free", 1, 2, 3.0)] {
                w.specs.insert(spec.id.clone(), spec);
            }
            w.step(10.0, true);
            let picky = w.status("picky");
            assert!(picky.world_size >= 1, "{what}: {picky:?}");
            assert!(picky.world_size <= 4, "{what}: {picky:?}");
            assert_eq!(
                hosts_of(picky),
                BTreeSet::from(["h2".to_string()]),
                "{what}"
            );
            let waiting = w.status("waiting");
            assert_eq!(
                (waiting.phase, waiting.world_size),
                (JobPhase::Pending, 0),
                "{what}"
            );
            assert_eq!(
                waiting.message.as_deref(),
                Some("no live host matches selector gpu.count=2,zone=c"),
                "{what}"
            );
            assert!(w.status("free").world_size >= 1, "{what}");

            // A matching host appears: the waiting job goes there, and the reason goes.
            w.add_host(labelled("h3", 2, 11.0, "c"));
            w.step(11.0, true);
            let waiting = w.status("waiting");
            assert!(waiting.world_size >= 1, "{what}: {waiting:?}");
            assert_eq!(
                hosts_of(waiting),
                BTreeSet::from(["h3".to_string()]),
                "{what}"
            );
            assert_eq!(waiting.message, None, "{what}");
            assert_eq!(
                hosts_of(w.status("picky")),
                BTreeSet::from(["h2".to_string()])
            );

            // Its host is relabelled: the running job is taken off it and waits again.
            w.add_host(labelled("h3", 2, 12.0, "d"));
            w.step(12.0, true);
            let waiting = w.status("waiting");
            assert_eq!(
                (waiting.phase, waiting.world_size),
                (JobPhase::Pending, 0),
                "{what}"
            );
            assert!(
                waiting
                    .message
                    .as_deref()
                    .unwrap()
                    .starts_with("no live host matches"),
                "{what}: {waiting:?}"
            );
        }
    }

    #[test]
    fn each_generations_step_times_count_for_its_hosts_gpu_type() {
        let typed = |id: &str, kind: &str| {
            let mut t = host(id, 2, 10.0, vec![]);
            t.labels.insert("gpu.type".into(), kind.into());
            t
        };
        let live_hosts = [
            typed("t4-1", "t4"),
            typed("a100-1", "a100"),
            typed("a100-2", "a100"),
        ];
        let live: BTreeMap<&HostId, &HostTelemetry> =
            live_hosts.iter().map(|t| (&t.host, t)).collect();
        // One worker, 32 samples per step: 1 s per step on t4 (generation 1), 0.25 s on
        // a100 (generation 2); generation 3 spans t4 and a100 and counts for neither.
        let mut h = JobHistory::default();
        // Steps and samples go on from one generation to the next (a resume from the last
        // checkpoint).
        for (generation, host, step_s, t0) in [(1, "t4-1", 1.0, 0.0), (2, "a100-1", 0.25, 100.0)] {
            let base = 40 * (generation - 1);
            for i in 0..5u64 {
                let time = t0 + step_s * 10.0 * i as f64;
                let step = base + 10 * i;
                h.add(&progress(
                    "j",
                    generation,
                    0,
                    host,
                    step,
                    32 * step,
                    1.0,
                    time,
                ));
            }
        }
        for (rank, host) in [(0, "t4-1"), (1, "a100-2")] {
            for i in 0..5u64 {
                let time = 200.0 + 5.0 * i as f64;
                let step = 80 + 10 * i;
                h.add(&progress(
                    "j",
                    3,
                    rank,
                    host,
                    step,
                    2560 + 640 * i,
                    1.0,
                    time,
                ));
            }
        }
        let seen = h.step_observations();
        assert_eq!(seen.len(), 3, "{seen:?}");
        let mut cache = FitCache::new();
        let prior = crate::throughput::ThroughputPrior::default();
        let id = JobId::new("j").unwrap();
        let speeds: BTreeMap<String, f64> = observations_by_type(&h, &seen, &live)
            .iter()
            .filter_map(|(t, on_type)| {
                let model = cache.model_on_type(&id, t, on_type, &prior);
                Some((t.clone(), crate::gpu_types::speed(&model, 32.0)?))
            })
            .collect();
        assert_eq!(
            speeds.keys().collect::<Vec<_>>(),
            ["a100", "t4"],
            "{speeds:?}"
        );
        // Compute-only single-worker steps: the speeds are 32 samples per step time.
        let ratio = speeds["a100"] / speeds["t4"];
        assert!((ratio - 4.0).abs() < 0.4, "{speeds:?}");

        // Only the t4 host still live: generation 3 counts for t4 now (its live hosts carry
        // one type), generation 2 for none.
        let one: BTreeMap<&HostId, &HostTelemetry> =
            live_hosts[..1].iter().map(|t| (&t.host, t)).collect();
        let by_type = observations_by_type(&h, &seen, &one);
        assert_eq!(by_type.keys().collect::<Vec<_>>(), ["t4"]);
        assert_eq!(by_type["t4"].len(), 2);
    }

    #[test]
    fn gpu_type_jobs_run_only_on_their_types_or_wait_with_the_reason() {
        let typed = |id: &str, gpus: u32, time: f64, kind: &str| {
            let mut t = host(id, gpus, time, vec![]);
            t.labels.insert("gpu.type".into(), kind.into());
            t
        };
        for (policy, placement) in RESTRICTED_CASES {
            let what = format!("{policy} with {placement:?}");
            let mut w = world_with(policy, placement);
            w.add_host(typed("t4-1", 4, 10.0, "t4"));
            w.add_host(typed("a100-1", 4, 10.0, "a100"));
            let mut fast = job("fast", 1, 8, 1.0);
            fast.gpu_types = Some(vec!["a100".into(), "h100".into()]);
            let mut newest = job("newest", 1, 2, 2.0);
            newest.gpu_types = Some(vec!["h100".into()]);
            for spec in [fast, newest, job("any", 1, 2, 3.0)] {
                w.specs.insert(spec.id.clone(), spec);
            }
            w.step(10.0, true);
            let fast = w.status("fast");
            assert!(fast.world_size >= 1, "{what}: {fast:?}");
            assert_eq!(
                hosts_of(fast),
                BTreeSet::from(["a100-1".to_string()]),
                "{what}"
            );
            let newest = w.status("newest");
            assert_eq!(
                (newest.phase, newest.world_size),
                (JobPhase::Pending, 0),
                "{what}"
            );
            assert_eq!(
                newest.message.as_deref(),
                Some("no live host offers GPU type h100 (live hosts' types: a100, t4)"),
                "{what}"
            );
            assert!(w.status("any").world_size >= 1, "{what}");

            // An H100 host joins: the waiting job goes there and the reason goes.
            w.add_host(typed("h100-1", 2, 11.0, "h100"));
            w.step(11.0, true);
            let newest = w.status("newest");
            assert!(newest.world_size >= 1, "{what}: {newest:?}");
            assert_eq!(
                hosts_of(newest),
                BTreeSet::from(["h100-1".to_string()]),
                "{what}"
            );
            assert_eq!(newest.message, None, "{what}");
            assert!(
                hosts_of(w.status("fast")).iter().all(|h| h != "t4-1"),
                "{what}: never on a T4"
            );
        }
    }

    #[test]
    fn selector_parameter_server_jobs_keep_workers_and_shards_on_matching_hosts() {
        let mut w = World::default();
        for (id, zone) in [("h1", "a"), ("h2", "b"), ("h3", "b")] {
            let mut t = host(id, 2, 10.0, vec![]);
            t.labels.insert("zone".into(), zone.into());
            w.add_host(t);
        }
        let mut spec = JobSpec::from_toml(
            "id = \"ps\"\ncommand = [\"t\"]\narch = \"ps\"\nmin_workers = 2\nmax_workers = 4\n[selector]\nzone = \"b\"\n",
        )
        .unwrap();
        spec.submitted_at = 1.0;
        w.specs.insert(spec.id.clone(), spec);
        w.step(10.0, true);
        let s = w.status("ps");
        assert!(s.world_size >= 2, "{s:?}");
        assert!(
            s.placement
                .iter()
                .chain(&s.ps_placement)
                .all(|p| p.host.as_str() != "h1"),
            "{s:?}"
        );
    }

    #[test]
    fn the_service_runs_any_policy() {
        let mut w = World::default();
        w.settings.scheduler =
            Arc::from(crate::policies::by_name("fair", w.settings.policy).unwrap());
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 4, 1.0));
        w.specs
            .insert(JobId::new("b").unwrap(), job("b", 1, 4, 2.0));
        w.add_host(host("h1", 4, 10.0, vec![]));
        w.step(10.0, true);
        assert_eq!((w.status("a").world_size, w.status("b").world_size), (2, 2));
    }

    #[test]
    fn tiresias_in_the_service_sees_attained_service_and_requested_sizes() {
        let mut w = World::default();
        w.settings.scheduler =
            Arc::from(crate::policies::by_name("tiresias", w.settings.policy).unwrap());
        // `veteran` arrived first but has had 17 GPU-hours (2 workers, 8.5 h apart reports);
        // `fresh` has had none. One host of 2 GPUs: least attained service goes first.
        let mut veteran = job("veteran", 1, 2, 1.0);
        veteran.workers = Some(2);
        let mut fresh = job("fresh", 1, 4, 2.0);
        fresh.workers = Some(2);
        w.specs.insert(JobId::new("veteran").unwrap(), veteran);
        w.specs.insert(JobId::new("fresh").unwrap(), fresh);
        let mut h = JobHistory::default();
        for (samples, time) in [(100, 0.0), (200, 8.5 * 3600.0)] {
            let mut r = progress("veteran", 1, 0, "h1", samples / 10, samples, 1.0, time);
            r.workers = Some(2);
            h.add(&r);
        }
        assert_eq!(h.attained_gpu_seconds(1), 17.0 * 3600.0);
        w.histories.insert(JobId::new("veteran").unwrap(), h);
        w.add_host(host("h1", 2, 40_000.0, vec![]));
        w.step(40_000.0, true);
        // `fresh` runs at the 2 workers it asked for (not its maximum of 4), `veteran` waits.
        assert_eq!(w.status("fresh").world_size, 2);
        assert_eq!(w.status("veteran").world_size, 0);
    }

    #[test]
    fn own_multi_host_rings_are_taken_off_the_measured_nic_load() {
        let ring = |id: &str, hosts: &[&str], step_s: f64| {
            let job = JobId::new(id).unwrap();
            let mut s = new_status(&job, 0.0, 0.0);
            s.phase = JobPhase::Running;
            s.placement = hosts
                .iter()
                .enumerate()
                .map(|(rank, h)| RankPlacement {
                    rank: rank as u32,
                    host: HostId::new(*h).unwrap(),
                    gpus: vec![rank as u32],
                })
                .collect();
            s.world_size = hosts.len() as u32;
            s.step_time_s = Some(step_s);
            (job, s)
        };
        let statuses: BTreeMap<JobId, JobStatus> = [
            // 4 ranks on h1 and h2, 10 MB every 0.2 s: 1.5 · 10 MB / 0.2 s = 75 MB/s each.
            ring("a", &["h1", "h1", "h2", "h2"], 0.2),
            // 2 ranks on h2 and h3, 10 MB every 0.1 s: 100 MB/s.
            ring("b", &["h2", "h3"], 0.1),
            // One host: no NIC traffic.
            ring("c", &["h4", "h4"], 0.1),
            // No model size reported yet: not counted.
            ring("d", &["h4", "h5"], 0.1),
        ]
        .into_iter()
        .collect();
        let specs: BTreeMap<JobId, JobSpec> = ["a", "b", "c", "d"]
            .iter()
            .map(|id| (JobId::new(*id).unwrap(), job(id, 1, 4, 0.0)))
            .collect();
        let mut histories: BTreeMap<JobId, JobHistory> = BTreeMap::new();
        for id in ["a", "b", "c"] {
            let mut r = progress(id, 1, 0, "h1", 10, 100, 1.0, 1.0);
            r.model_bytes = Some(10_000_000);
            histories
                .entry(JobId::new(id).unwrap())
                .or_default()
                .add(&r);
        }
        let traffic = ring_nic_traffic(&statuses, &specs, &histories);
        let at = |h: &str| traffic.get(&HostId::new(h).unwrap()).copied();
        assert!((at("h1").unwrap() - 75e6).abs() < 1.0, "{traffic:?}");
        assert!((at("h2").unwrap() - 175e6).abs() < 1.0, "{traffic:?}");
        assert!((at("h3").unwrap() - 100e6).abs() < 1.0, "{traffic:?}");
        assert_eq!((at("h4"), at("h5")), (None, None));
        // A parameter-server job's traffic stays in the measured load.
        let mut ps = specs.clone();
        ps.get_mut(&JobId::new("b").unwrap()).unwrap().arch = SyncArch::Ps;
        let traffic = ring_nic_traffic(&statuses, &ps, &histories);
        assert_eq!(traffic.get(&HostId::new("h3").unwrap()), None);
    }

    #[test]
    fn contention_is_measured_on_multi_host_jobs_that_share_a_host() {
        let running = |id: &str, hosts: &[&str], observed: f64, predicted: f64| {
            let job = JobId::new(id).unwrap();
            let mut s = new_status(&job, 0.0, 0.0);
            s.phase = JobPhase::Running;
            s.generation = 2;
            s.placement = hosts
                .iter()
                .enumerate()
                .map(|(rank, h)| RankPlacement {
                    rank: rank as u32,
                    host: HostId::new(*h).unwrap(),
                    gpus: vec![rank as u32],
                })
                .collect();
            s.world_size = hosts.len() as u32;
            s.step_time_s = Some(observed);
            s.predicted_step_time_s = Some(predicted);
            (job, s)
        };
        let none = BTreeMap::new();
        // Two rings share h2, each twice as slow as predicted: slowdown 1 per shared job.
        let mut statuses: BTreeMap<JobId, JobStatus> = [
            running("a", &["h1", "h2"], 2.0, 1.0),
            running("b", &["h2", "h3"], 0.6, 0.3),
        ]
        .into_iter()
        .collect();
        assert!((measured_contention(&statuses, &none) - 1.0).abs() < 1e-12);
        // A single-host job and a ring alone on its hosts add nothing.
        statuses.extend([
            running("c", &["h4", "h4"], 9.0, 1.0),
            running("d", &["h5", "h6"], 9.0, 1.0),
        ]);
        assert!((measured_contention(&statuses, &none) - 1.0).abs() < 1e-12);
        // Faster than predicted counts against the mean; the mean never goes below 0.
        let (id, faster) = running("e", &["h1", "h3"], 0.5, 1.0);
        statuses.insert(id, faster);
        // h1: a, e; h2: a, b; h3: b, e → sharing 2 each: (1 + 1 − 0.5) / 3.
        assert!((measured_contention(&statuses, &none) - 0.5).abs() < 1e-12);
        let calm: BTreeMap<JobId, JobStatus> = [
            running("a", &["h1", "h2"], 0.5, 1.0),
            running("b", &["h2", "h3"], 0.5, 1.0),
        ]
        .into_iter()
        .collect();
        assert_eq!(measured_contention(&calm, &none), 0.0);
        assert_eq!(measured_contention(&BTreeMap::new(), &none), 0.0);
    }

    /// A shadow job's step time excludes synchronization: a shadow job sharing hosts with
    /// a slowed ring neither adds its own (unslowed) step as a sample nor counts as a
    /// sharer.
    #[test]
    fn shadow_jobs_are_left_out_of_measured_contention() {
        let running = |id: &str, hosts: &[&str], observed: f64, predicted: f64| {
            let job = JobId::new(id).unwrap();
            let mut s = new_status(&job, 0.0, 0.0);
            s.phase = JobPhase::Running;
            s.placement = hosts
                .iter()
                .enumerate()
                .map(|(rank, h)| RankPlacement {
                    rank: rank as u32,
                    host: HostId::new(*h).unwrap(),
                    gpus: vec![rank as u32],
                })
                .collect();
            s.world_size = hosts.len() as u32;
            s.step_time_s = Some(observed);
            s.predicted_step_time_s = Some(predicted);
            (job, s)
        };
        let statuses: BTreeMap<JobId, JobStatus> = [
            running("a", &["h1", "h2"], 2.0, 1.0),
            running("b", &["h2", "h3"], 2.0, 1.0),
            running("s", &["h1", "h3"], 0.1, 0.1),
        ]
        .into_iter()
        .collect();
        let mut specs: BTreeMap<JobId, JobSpec> = ["a", "b", "s"]
            .into_iter()
            .map(|id| (JobId::new(id).unwrap(), job(id, 1, 2, 0.0)))
            .collect();
        // As ring jobs: s's unslowed step pulls the mean down to (1 + 1 + 0) / 3.
        assert!((measured_contention(&statuses, &specs) - 2.0 / 3.0).abs() < 1e-12);
        let s = specs.get_mut(&JobId::new("s").unwrap()).unwrap();
        s.arch = SyncArch::Shadow;
        s.shadow = Some(converge_common::ShadowSpec {
            algorithm: converge_common::ShadowAlgorithm::Ma,
            block_momentum: None,
            block_lr: None,
            block_nesterov: false,
            elastic_alpha: None,
            hogwild_threads: None,
        });
        assert!((measured_contention(&statuses, &specs) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn bco_placement_puts_a_job_that_fits_on_one_host_there() {
        // `small` (2 GPUs) goes first on h1; `wide` (2 workers × 2 GPUs) then fits on h2
        // alone. First fit fills h1's 2 free GPUs first and spans both hosts; BCO does not.
        for (placement, spanned) in [(PlacementKind::FirstFit, 2), (PlacementKind::Bco, 1)] {
            let mut w = World::default();
            w.settings.placement = placement;
            w.settings.scheduler =
                Arc::from(crate::policies::by_name("fifo", w.settings.policy).unwrap());
            let mut small = job("small", 1, 1, 1.0);
            small.gpus_per_worker = 2;
            let mut wide = job("wide", 2, 2, 2.0);
            wide.gpus_per_worker = 2;
            w.specs.insert(JobId::new("small").unwrap(), small);
            w.specs.insert(JobId::new("wide").unwrap(), wide);
            w.add_host(host("h1", 4, 10.0, vec![]));
            w.add_host(host("h2", 4, 10.0, vec![]));
            w.step(10.0, true);
            let s = w.status("wide");
            assert_eq!(s.world_size, 2, "{placement:?}");
            let hosts: BTreeSet<_> = s.placement.iter().map(|r| &r.host).collect();
            assert_eq!(hosts.len(), spanned, "{placement:?}: {:?}", s.placement);
        }
    }

    #[test]
    fn bco_keeps_a_spanning_ring_off_hosts_whose_nics_the_agents_report_busy() {
        // Four hosts of 2 GPUs on 1 Gbit/s links; `wide` (2 workers × 2 GPUs) must span two
        // of them. The agents on h1 and h2 report their NICs 90 % busy with traffic
        // Converge did not schedule: BCO puts the ring on h3 and h4, first fit on h1 and h2
        // (id order). With quiet NICs BCO has no reason to leave h1 and h2.
        let busy_nic = |rate: f64| converge_common::NicSample {
            name: "eth0".into(),
            rx_bytes_per_s: rate,
            tx_bytes_per_s: rate,
            link_speed_bps: Some(1_000_000_000),
        };
        let hosts_of_wide = |placement: PlacementKind, busy: f64| {
            let mut w = World::default();
            w.settings.placement = placement;
            w.settings.scheduler =
                Arc::from(crate::policies::by_name("fifo", w.settings.policy).unwrap());
            let mut wide = job("wide", 2, 2, 1.0);
            wide.gpus_per_worker = 2;
            w.specs.insert(JobId::new("wide").unwrap(), wide);
            for h in ["h1", "h2", "h3", "h4"] {
                let mut t = host(h, 2, 10.0, vec![]);
                let load = if h == "h1" || h == "h2" { busy } else { 0.0 };
                t.nics = vec![busy_nic(load)];
                w.add_host(t);
            }
            w.step(10.0, true);
            let s = w.status("wide");
            assert_eq!(s.world_size, 2, "{placement:?}");
            s.placement
                .iter()
                .map(|r| r.host.to_string())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
        };
        let ninety_percent = 0.9 * 125e6;
        assert_eq!(
            hosts_of_wide(PlacementKind::Bco, ninety_percent),
            ["h3", "h4"]
        );
        assert_eq!(
            hosts_of_wide(PlacementKind::FirstFit, ninety_percent),
            ["h1", "h2"]
        );
        assert_eq!(hosts_of_wide(PlacementKind::Bco, 0.0), ["h1", "h2"]);
    }

    #[test]
    fn stepping_twice_without_news_changes_nothing() {
        let mut w = World::default();
        w.specs
            .insert(JobId::new("a").unwrap(), job("a", 1, 4, 1.0));
        w.specs
            .insert(JobId::new("b").unwrap(), job("b", 1, 4, 2.0));
        w.add_host(host("h1", 4, 10.0, vec![]));
        let first = w.step(10.0, true);
        let statuses = w.statuses.clone();
        let second = w.step(10.5, true);
        assert_eq!(w.statuses, statuses);
        assert_eq!(first.plans, second.plans);
        let used: usize = second
            .plans
            .values()
            .flat_map(|p| &p.workers)
            .map(|x| x.gpus.len())
            .sum();
        assert!(used <= 4);
    }

    mod equal_inputs {
        use super::*;
        use proptest::prelude::*;

        /// A cluster of 1–3 hosts and 1–5 jobs, each job with 0–40 rank-0 reports of a
        /// noisy decreasing loss over two generations, stepped three times.
        fn arbitrary_world() -> impl Strategy<Value = (World, Vec<f64>)> {
            (
                prop::collection::vec(1u32..=4, 1..=3),
                prop::collection::vec((1u32..=2, 0u32..=3, 0usize..=40, 0.0..0.2f64), 1..=5),
                any::<bool>(),
            )
                .prop_map(|(hosts, jobs, bco)| {
                    let mut w = World::default();
                    if bco {
                        w.settings.placement = PlacementKind::Bco;
                    }
                    for (i, gpus) in hosts.iter().enumerate() {
                        w.add_host(host(&format!("h{i}"), *gpus, 100.0, vec![]));
                    }
                    for (j, (min, extra, points, noise)) in jobs.into_iter().enumerate() {
                        let name = format!("j{j}");
                        let id = JobId::new(&name).unwrap();
                        w.specs
                            .insert(id.clone(), job(&name, min, min + extra, j as f64));
                        let mut h = JobHistory::default();
                        for k in 0..points {
                            let generation = if k < points / 2 { 1 } else { 2 };
                            let samples = (k as u64 + 1) * 64;
                            let wiggle = if k % 2 == 0 { noise } else { -noise };
                            let loss = 2.0 / (1.0 + samples as f64 / 500.0) + 0.1 + wiggle * 0.1;
                            let time = 10.0 + k as f64;
                            h.add(&progress(
                                &name,
                                generation,
                                0,
                                "h0",
                                k as u64 * 2,
                                samples,
                                loss,
                                time,
                            ));
                        }
                        w.histories.insert(id, h);
                    }
                    (w, vec![60.0, 61.0, 90.0])
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            /// The cache is part of a step's input and output: equal inputs with equal caches
            /// give equal outcomes and leave equal caches, step after step.
            #[test]
            fn equal_inputs_and_caches_give_equal_outcomes((world, times) in arbitrary_world()) {
                let mut a = world;
                let mut b = a.clone();
                for now in times {
                    let first = a.step(now, true);
                    let second = b.step(now, true);
                    prop_assert_eq!(first, second);
                    prop_assert_eq!(&a.cache, &b.cache);
                }
                // And a cache cloned mid-way gives the same next step as the original.
                let mut c = b.cache.clone();
                fn inputs(w: &World) -> Inputs<'_> {
                    Inputs {
                        now: 120.0,
                        specs: &w.specs,
                        refused_specs: &w.refused,
                        statuses: &w.statuses,
                        hosts: &w.hosts,
                        histories: &w.histories,
                        queues: &w.queues,
                        queue_statuses: &w.queue_statuses,
                    }
                }
                let out_c = step(inputs(&b), &b.settings, &mut c, true);
                let mut cache_a = a.cache.clone();
                let out_a = step(inputs(&a), &a.settings, &mut cache_a, true);
                prop_assert_eq!(out_a, out_c);
            }
        }
    }
}
