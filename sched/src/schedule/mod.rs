//! One scheduling step as a pure function: from job specs, job statuses, host telemetry and
//! progress histories at time `now`, compute the next job statuses, host plans and events.
//! The service calls it on every trigger and writes what changed; tests and the simulator
//! call it directly. No I/O, no clock (`now` is an argument).
//!
//! Lifecycle of a job: `pending` → (placed) → `restarting` → (no worker of an older
//! generation alive on any live host) → `running` → `completed` / `failed` / `cancelled`.
//! An allocation change bumps the job's generation and goes through `restarting` again, so
//! the old generation checkpoints and exits before the new one starts (generation fencing).

mod allocate;
mod batch;
mod lifecycle;
mod observe;
mod plans;
mod ps;
#[cfg(test)]
mod tests;

use allocate::allocate;
pub use batch::batch_limits;
use batch::update_batch;
use lifecycle::{
    advance, apply_stop_criteria, apply_sweep_early_stops, finish, follow_master_addr, new_status,
    older_generation_alive, update_progress,
};
pub use observe::known_remaining_work;
use observe::{Fits, measured_contention, note_unmatched_selectors, observations_by_type, refits};
use plans::plans;

use crate::fit::{Curve, FitConfig};
use crate::fit_cache::{FitCache, ModelScope};
use crate::goodput::GradientStats;
use crate::history::JobHistory;
use crate::placement::PlacementKind;
use crate::policies::{Policy, PolicyParams, Quality};
use crate::stop::predicted_final_loss;
use crate::throughput::{StepObservation, ThroughputModel, ThroughputPrior};
use converge_common::{
    Event, EventKind, HostId, HostPlan, HostTelemetry, JobId, JobPhase, JobSpec, JobStatus,
    QueueId, QueueSpec, QueueStatus,
};
use std::collections::BTreeMap;
use std::sync::Arc;
/// Knobs of a scheduling step.
#[derive(Debug, Clone)]
pub struct Settings {
    /// A host whose latest telemetry is older than this (seconds) is lost: its GPUs leave
    /// the pool and its jobs are placed elsewhere.
    pub host_timeout_s: f64,
    /// Knobs of the policies (the quality policy's horizon, restart cost, …); the horizon
    /// also sets how far ahead statuses predict.
    pub policy_params: PolicyParams,
    pub fit: FitConfig,
    /// Prior of the per-job throughput model (before a job has step times to fit).
    pub throughput_prior: ThroughputPrior,
    /// How workers are put on hosts (first fit, or BCO priced by each job's model).
    pub placement: PlacementKind,
    /// The policy that sizes jobs (default: `quality` with `policy_params`).
    pub policy: Arc<dyn Policy>,
    /// Parameter-server shards one host may run (all jobs together); each takes a CPU
    /// process and no GPU. Bounds the planner's shard placement ([`DEFAULT_PS_SHARDS_PER_HOST`]).
    pub ps_shards_per_host: u32,
    /// Most loss curves refitted in one step ([`DEFAULT_FIT_BUDGET`]); jobs whose refit is
    /// due beyond it keep their last curve until a later step, those with the most new
    /// points (then never fitted, then by id) first. Bounds a step's time when many jobs
    /// report at once. The held-out curves of sweep trials (the `predicted` early stopping)
    /// have a budget of the same size of their own.
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
/// of the best plan's ([`crate::ps_plan::PsJob::target_fraction`]): a shard is a process, not worth a
/// throughput gain under 5 %.
pub const PS_TARGET_FRACTION: f64 = 0.95;

impl Default for Settings {
    fn default() -> Self {
        let policy_params = PolicyParams::default();
        Self {
            host_timeout_s: 15.0,
            policy_params,
            fit: FitConfig::default(),
            throughput_prior: ThroughputPrior::default(),
            placement: PlacementKind::default(),
            policy: Arc::new(Quality {
                params: policy_params,
            }),
            ps_shards_per_host: DEFAULT_PS_SHARDS_PER_HOST,
            fit_budget: DEFAULT_FIT_BUDGET,
            usage_half_life_s: DEFAULT_USAGE_HALF_LIFE_S,
        }
    }
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

/// The allocator's state between steps, as its KV buckets and progress stream hold it:
/// what [`step`] reads, and the statuses and queue statuses it last wrote. The simulator's
/// service loop (`converge-sim simulate --loop service`) and the step's tests drive steps
/// through it; the allocator service keeps the same maps, filled from KV.
#[derive(Debug, Clone, Default)]
pub struct State {
    pub settings: Settings,
    pub cache: FitCache,
    pub specs: BTreeMap<JobId, JobSpec>,
    /// Specs that were refused, with the reason ([`Inputs::refused_specs`]).
    pub refused: BTreeMap<JobId, String>,
    pub statuses: BTreeMap<JobId, JobStatus>,
    pub hosts: BTreeMap<HostId, HostTelemetry>,
    pub histories: BTreeMap<JobId, JobHistory>,
    pub queues: BTreeMap<QueueId, QueueSpec>,
    pub queue_statuses: BTreeMap<QueueId, QueueStatus>,
}

impl State {
    /// No job, host or queue yet.
    pub fn new(settings: Settings) -> Self {
        Self {
            settings,
            ..Self::default()
        }
    }

    /// One [`step`] at `now` on this state; keeps the statuses it returns and, when the
    /// policy ran, the queue statuses.
    pub fn step(&mut self, now: f64, run_policy: bool) -> Outcome {
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
        self.statuses.clone_from(&out.statuses);
        if run_policy {
            self.queue_statuses.clone_from(&out.queue_statuses);
        }
        out
    }
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
                settings.policy_params.horizon_s,
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
    // 1b. Each sweep's early stopping, across its trials as they now stand.
    apply_sweep_early_stops(
        inp.specs,
        inp.histories,
        &curves,
        cache,
        &settings.fit,
        settings.fit_budget,
        &mut out,
        now,
    );
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

/// The job-spec label naming a job's model (`labels = { model = "bert" }`): jobs with the same
/// value share their speed ratios between GPU types ([`crate::gpu_types`]).
pub const MODEL_LABEL: &str = "model";

/// The status message of a job whose queue does not exist.
pub fn unknown_queue_message(queue: &QueueId) -> String {
    format!("queue \"{queue}\" does not exist")
}
