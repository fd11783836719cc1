//! The service loop: a simulated [`World`] (the cluster, its agents and their workers)
//! driven by the allocator's own scheduling step, [`converge_sched::schedule::step`], with
//! the allocator's state ([`Service`]: job specs, statuses, heartbeats, progress
//! histories, queue statuses, the fit cache) kept as the service keeps it.
//!
//! Each scheduling interval the loop
//! 1. advances the world by the interval ([`World::advance`]);
//! 2. hands the service what its agents and users sent ([`World::observe`]: new job
//!    specs, every host's heartbeat, the progress reports);
//! 3. runs the step with the policy ([`Service::step`] with `run_policy`), and has the
//!    world carry out its host plans ([`World::apply`]);
//! 4. observes the heartbeats again and runs a lifecycle step (no policy), as the service
//!    does on the agents' next heartbeats: a job whose old generation has exited everywhere
//!    starts its new one, and the world starts those workers.
//!
//! So a simulated job goes through the service's lifecycle (pending, restarting with
//! generation fencing, running, completed by its program's exit or by its stop criteria),
//! keeps its batch for a generation (the batch-per-generation rule), and is sized from the
//! service's own job views: curves fitted on its progress reports, step times and the
//! restart cost measured from them, gradient statistics of its reports, the work its spec
//! declares or the curve's estimate to its target loss, contention measured on step times.
//! A policy learns nothing else (no oracle). The loop adds no scheduling rule of its own.
//!
//! [`TraceWorld`] is the Pollux-trace world (`converge-sim simulate --loop service`).

use crate::apps::Application;
use crate::engine::{
    Cluster, IntervalRecord, SimConfig, SimError, SimResult, Tracked, WorkKnowledge,
    declared_samples_total, host_name,
};
use crate::workload::WorkloadJob;
use converge_common::{
    GpuSample, HostId, HostPlan, HostTelemetry, JobId, JobSpec, ProgressReport, RankPlacement,
    WorkerPhase, WorkerState,
};
use converge_sched::contention::ContentionSamples;
use converge_sched::policies::Policy;
use converge_sched::schedule::{Outcome, Settings, State};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// What the service reads from the bus in one observation.
#[derive(Debug, Default)]
pub struct Observed {
    /// Job specs submitted since the previous observation.
    pub specs: Vec<JobSpec>,
    /// Every host's heartbeat.
    pub hosts: Vec<HostTelemetry>,
    /// Progress reports since the previous observation, in order.
    pub reports: Vec<ProgressReport>,
}

/// A simulated cluster under the service: its agents carry out host plans and report
/// heartbeats and progress.
pub trait World {
    /// Runs the cluster from `now` for `seconds` under the plans last applied.
    fn advance(&mut self, now: f64, seconds: f64);
    /// What the service would read at `now` (appended to `into`).
    fn observe(&mut self, now: f64, into: &mut Observed);
    /// Carries out a step's outcome at `now`: each host's agent runs its plan (stops the
    /// workers it no longer lists, starts the new ones); a job the service ended stops.
    fn apply(&mut self, now: f64, outcome: &Outcome);
    /// Whether every job has ended.
    fn finished(&self) -> bool;
}

/// The allocator's state between steps ([`converge_sched::schedule::State`]), fed from
/// the world as the service feeds it from KV and the progress stream.
pub type Service = State;

/// Takes what was observed into `service`: a spec that does not validate is refused with
/// the reason (the job fails with it), as the service refuses it.
pub fn take(service: &mut Service, observed: Observed) {
    for spec in observed.specs {
        match spec.validate() {
            Ok(()) => {
                service.specs.insert(spec.id.clone(), spec);
            }
            Err(e) => {
                service.refused.insert(spec.id.clone(), e.to_string());
            }
        }
    }
    for t in observed.hosts {
        service.hosts.insert(t.host.clone(), t);
    }
    for r in observed.reports {
        service.histories.entry(r.job.clone()).or_default().add(&r);
    }
}

/// One interval of [`run`]: when it ended, the policy step's outcome, and its wall time
/// (seconds, fits included).
pub struct Interval<'a> {
    pub now: f64,
    pub decision: &'a Outcome,
    pub decision_s: f64,
}

/// Drives `world` with `service` every `scheduling_interval_s` seconds until the world has finished
/// or `max_time_s` has passed (see the module docs); `record` sees every interval after its
/// decision has been applied. Returns the time the loop stopped at.
pub fn run<W: World>(
    world: &mut W,
    service: &mut Service,
    scheduling_interval_s: f64,
    max_time_s: f64,
    mut record: impl FnMut(&W, Interval<'_>),
) -> f64 {
    let mut now = 0.0;
    loop {
        world.advance(now, scheduling_interval_s);
        now += scheduling_interval_s;
        let mut seen = Observed::default();
        world.observe(now, &mut seen);
        take(service, seen);
        if world.finished() || now >= max_time_s {
            // The service takes in the last ends.
            let last = service.step(now, false);
            world.apply(now, &last);
            return now;
        }
        let started = Instant::now();
        let decision = service.step(now, true);
        let decision_s = started.elapsed().as_secs_f64();
        world.apply(now, &decision);
        // The agents' next heartbeats: jobs whose old generation has exited start.
        let mut seen = Observed::default();
        world.observe(now, &mut seen);
        take(service, seen);
        let settled = service.step(now, false);
        world.apply(now, &settled);
        record(
            world,
            Interval {
                now,
                decision: &decision,
                decision_s,
            },
        );
    }
}

/// Runs `world` to its end under `policy` with the service's default settings and
/// `placement` (heartbeats come every interval, so a host is lost after two without one);
/// returns the largest wall time of one decision, seconds.
pub(crate) fn run_under<W: World>(
    world: &mut W,
    policy: Arc<dyn Policy>,
    placement: converge_sched::placement::PlacementKind,
    scheduling_interval_s: f64,
    max_time_s: f64,
) -> f64 {
    let settings = Settings {
        placement,
        host_timeout_s: scheduling_interval_s * 2.0,
        policy,
        ..Settings::default()
    };
    let mut service = Service::new(settings);
    let mut max_decision_s: f64 = 0.0;
    run(
        world,
        &mut service,
        scheduling_interval_s,
        max_time_s,
        |_, interval| max_decision_s = max_decision_s.max(interval.decision_s),
    );
    max_decision_s
}

/// The Pollux-trace world: the workload's jobs on [`SimConfig`]'s cluster, each job's
/// progress, loss and step times from its application's measurements (the same physics as
/// [`crate::engine::simulate`]: [`crate::engine`]'s advance and placement).
pub struct TraceWorld<'a> {
    apps: &'a BTreeMap<String, Application>,
    cfg: &'a SimConfig,
    cluster: Cluster<'a>,
    /// Each job's spec, submitted once its time has come.
    specs: Vec<JobSpec>,
    submitted: Vec<bool>,
    /// Each job's running generation (0: none).
    generation: Vec<u64>,
    /// Optimizer steps done, over all generations (fractional).
    steps: Vec<f64>,
    /// When and from how many workers a job was stopped by the current apply (its restart
    /// then counts against those).
    stopped: Vec<Option<(f64, usize)>>,
    rng: ChaCha8Rng,
    noise: Normal<f64>,
    /// Normalized losses of the unfinished jobs at the latest observation.
    norm_losses: Vec<f64>,
}

impl<'a> TraceWorld<'a> {
    /// The world of `workload` on `cfg`'s cluster; `adaptive`: jobs whose application allows
    /// it declare a `[batch]` table (they adapt their batch under a goodput policy).
    pub fn new(
        apps: &'a BTreeMap<String, Application>,
        workload: &[WorkloadJob],
        cfg: &'a SimConfig,
        adaptive: bool,
    ) -> Result<Self, SimError> {
        if cfg.shadow_fraction > 0.0 || cfg.ignore_contention {
            return Err(SimError::NotInServiceLoop(
                if cfg.ignore_contention {
                    "--ignore-contention (the service measures contention itself)"
                } else {
                    "--shadow-fraction"
                }
                .into(),
            ));
        }
        let cluster = Cluster::new(apps, workload, cfg, adaptive)?;
        let specs = cluster
            .jobs
            .iter()
            .map(|t| job_spec(t, &apps[&t.job.app], cfg.work))
            .collect();
        let n = cluster.jobs.len();
        Ok(Self {
            apps,
            cfg,
            cluster,
            specs,
            submitted: vec![false; n],
            generation: vec![0; n],
            steps: vec![0.0; n],
            stopped: vec![None; n],
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            noise: Normal::new(0.0, cfg.loss_noise.max(0.0)).expect("finite noise"),
            norm_losses: Vec::new(),
        })
    }

    /// GPUs held by running jobs.
    fn allocated(&self) -> u32 {
        self.cluster
            .jobs
            .iter()
            .filter(|t| t.job.completed_at.is_none())
            .flat_map(|t| &t.placement)
            .map(|p| p.gpus.len() as u32)
            .sum()
    }

    fn active(&self, now: f64) -> usize {
        self.cluster
            .jobs
            .iter()
            .filter(|t| t.job.submitted_at <= now && t.job.completed_at.is_none())
            .count()
    }

    /// Hosts of the cluster (`n000`, `n001`, …).
    pub(crate) fn nodes(&self) -> usize {
        self.cluster.layout.len()
    }

    /// The run's result (`wall_s` from `started`).
    pub(crate) fn result(
        self,
        policy: &str,
        intervals: Vec<IntervalRecord>,
        started: Instant,
    ) -> SimResult {
        let finished = self.finished();
        SimResult {
            policy: policy.to_string(),
            jobs: self
                .cluster
                .jobs
                .into_iter()
                .map(Tracked::outcome)
                .collect(),
            intervals,
            finished,
            wall_s: started.elapsed().as_secs_f64(),
            policy_violations: 0,
            decisions: Vec::new(),
            preemptions: Vec::new(),
            work_estimates: Vec::new(),
        }
    }
}

/// The spec a workload job is submitted with: its size bounds (one GPU per worker), its
/// model label, queue and priority, a `[batch]` table when it adapts, and its work as
/// [`WorkKnowledge`] says (declared samples, or its target loss).
fn job_spec(t: &Tracked, app: &Application, work: WorkKnowledge) -> JobSpec {
    let mut spec = JobSpec::from_toml(&format!("id = \"{}\"\ncommand = [\"simulated\"]\n", t.id))
        .expect("a minimal spec parses");
    spec.max_workers = Some(t.max_workers);
    spec.workers = Some(t.job.requested_replicas.clamp(1, t.max_workers));
    spec.labels.insert(
        converge_sched::schedule::MODEL_LABEL.to_string(),
        t.job.app.clone(),
    );
    spec.queue = (t.queue != converge_sched::queues::default_queue()).then(|| t.queue.clone());
    spec.priority = t.priority;
    spec.submitted_at = t.job.submitted_at;
    // An adaptive job's limits; any other job trains with its submitted total batch, split
    // over its workers (as the Pollux workloads' jobs), which its `[batch]` table tells the
    // service (reference = max_total).
    spec.batch = Some(match t.limits {
        Some(_) => converge_common::BatchSpec {
            reference: app.init_batch_size,
            max_total: app.max_batch_size,
            min_per_worker: app.min_local_bsz,
            max_per_worker: Some(app.max_local_bsz),
            max_per_worker_by_gpu_type: app.max_local_bsz_by_type(),
        },
        None => converge_common::BatchSpec {
            reference: t.job.target_batch_size,
            max_total: t.job.target_batch_size,
            min_per_worker: 1,
            max_per_worker: Some(app.max_local_bsz.max(1)),
            max_per_worker_by_gpu_type: app.max_local_bsz_by_type(),
        },
    });
    match work {
        WorkKnowledge::Declared => {
            spec.work_samples = Some(declared_samples_total(&t.job, app).round().max(1.0) as u64)
        }
        WorkKnowledge::TargetLoss => spec.target_loss = Some(t.final_loss),
    }
    spec
}

impl World for TraceWorld<'_> {
    fn advance(&mut self, now: f64, seconds: f64) {
        let before: Vec<f64> = self.cluster.jobs.iter().map(|t| t.samples).collect();
        // The service measures contention from step times; the world's own tally is unused.
        let mut unused = ContentionSamples::default();
        crate::engine::advance(
            &mut self.cluster.jobs,
            self.apps,
            self.cfg,
            now,
            seconds,
            &mut unused,
        );
        for (i, t) in self.cluster.jobs.iter().enumerate() {
            let batch = t.job.batch_size();
            if batch > 0 {
                self.steps[i] += (t.samples - before[i]) / f64::from(batch);
            }
        }
    }

    fn observe(&mut self, now: f64, into: &mut Observed) {
        for (i, spec) in self.specs.iter().enumerate() {
            if !self.submitted[i] && spec.submitted_at <= now {
                self.submitted[i] = true;
                into.specs.push(spec.clone());
            }
        }
        self.norm_losses.clear();
        let mut workers: BTreeMap<HostId, Vec<WorkerState>> = BTreeMap::new();
        for (i, t) in self.cluster.jobs.iter_mut().enumerate() {
            if !self.submitted[i] || t.placement.is_empty() {
                if self.submitted[i]
                    && let Some((_, normalized)) = t.observe_loss(&self.apps[&t.job.app], now)
                {
                    self.norm_losses.push(normalized);
                }
                continue;
            }
            let done = t.job.completed_at.is_some();
            for (host, w) in worker_states(&t.id, self.generation[i], &t.placement, done) {
                workers.entry(host.clone()).or_default().push(w);
            }
            let app = &self.apps[&t.job.app];
            let Some((true_loss, normalized)) = t.observe_loss(app, now) else {
                continue;
            };
            self.norm_losses.push(normalized);
            // A generation still restarting has no progress to print yet.
            if t.job.restarting_for_s > 0.0 {
                continue;
            }
            let observed = (true_loss * (1.0 + self.noise.sample(&mut self.rng))).max(0.0);
            let mut r = ProgressReport::new(
                t.id.clone(),
                self.generation[i],
                0,
                t.placement[0].host.clone(),
                self.steps[i].floor() as u64,
                t.samples.round() as u64,
                observed,
                now,
            );
            r.workers = Some(t.placement.len() as u32);
            let mut hosts: Vec<&HostId> = t.placement.iter().map(|p| &p.host).collect();
            hosts.sort();
            hosts.dedup();
            r.hosts = Some(hosts.len() as u32);
            if t.limits.is_some()
                && let Some((sqr, var)) = t.job.grad_stats(app)
            {
                // The reports carry the per-sample variance; the application's figure is
                // that of a gradient over its reference batch.
                r.line.grad_sqr = Some(sqr);
                r.line.grad_var = Some(var * f64::from(app.init_batch_size));
            }
            into.reports.push(r);
        }
        for (n, &(gpu_type, gpus)) in self.cluster.layout.iter().enumerate() {
            let host = host_name(n as u32);
            let workers = workers.remove(&host).unwrap_or_default();
            into.hosts
                .push(heartbeat(n, host, gpu_type, gpus, workers, now));
        }
    }

    fn apply(&mut self, now: f64, outcome: &Outcome) {
        // Each job's new placement and batch, from the host plans, ranks in order.
        let mut planned: BTreeMap<&JobId, Planned> = BTreeMap::new();
        for plan in outcome.plans.values() {
            planned_workers(plan, &mut planned);
        }
        for (i, t) in self.cluster.jobs.iter_mut().enumerate() {
            if !self.submitted[i] || t.job.completed_at.is_some() {
                continue;
            }
            let app = &self.apps[&t.job.app];
            let ended = outcome
                .statuses
                .get(&t.id)
                .is_some_and(|s| s.phase.is_terminal());
            if ended {
                // The service ended it (its stop criteria): its workers stop now.
                t.stopped_at_loss = t.observe_loss(app, now).map(|(_, normalized)| normalized);
                t.job.completed_at = Some(now);
                let before = t.placement.len();
                t.place(
                    app,
                    Vec::new(),
                    None,
                    before,
                    &self.cluster.layout,
                    0.0,
                    now,
                );
                continue;
            }
            let (generation, mut ranks, batch) =
                planned
                    .remove(&t.id)
                    .unwrap_or((self.generation[i], Vec::new(), None));
            ranks.sort_by_key(|r| r.rank);
            if ranks.is_empty() {
                if !t.placement.is_empty() {
                    self.stopped[i] = Some((now, t.placement.len()));
                    t.place(app, Vec::new(), None, 0, &self.cluster.layout, 0.0, now);
                }
                continue;
            }
            if generation != self.generation[i] || ranks != t.placement {
                let before = match self.stopped[i].take() {
                    Some((at, n)) if at == now => n,
                    _ => t.placement.len(),
                };
                t.place(
                    app,
                    ranks,
                    batch,
                    before,
                    &self.cluster.layout,
                    self.cfg.restart_delay_s,
                    now,
                );
                self.generation[i] = generation;
            }
        }
    }

    fn finished(&self) -> bool {
        self.cluster
            .jobs
            .iter()
            .all(|t| t.job.completed_at.is_some())
    }
}

/// The heartbeat of simulated host `n` (named `host`) at `now`: `gpus` GPUs of `gpu_type`
/// (`None`: an unnamed type, no type label), running `workers`; no NICs, no load.
pub(crate) fn heartbeat(
    n: usize,
    host: HostId,
    gpu_type: Option<&str>,
    gpus: u32,
    workers: Vec<WorkerState>,
    now: f64,
) -> HostTelemetry {
    let mut labels = BTreeMap::new();
    if let Some(t) = gpu_type {
        labels.insert(converge_common::labels::GPU_TYPE.to_string(), t.to_string());
    }
    let gpus = (0..gpus)
        .map(|index| {
            GpuSample::idle(
                index,
                format!("GPU-{host}-{index}"),
                gpu_type.unwrap_or("sim"),
                1,
            )
        })
        .collect();
    HostTelemetry {
        agent_version: "sim".into(),
        gpu_source: "sim".into(),
        gpus,
        workers,
        labels,
        ..HostTelemetry::new(host, format!("10.0.{}.{}", n / 250, n % 250 + 1), now)
    }
}

/// The workers of a job's `placement` as its agents report them: generation `generation`,
/// running, or exited with code 0 once `done`.
pub(crate) fn worker_states<'p>(
    job: &'p JobId,
    generation: u64,
    placement: &'p [RankPlacement],
    done: bool,
) -> impl Iterator<Item = (&'p HostId, WorkerState)> + 'p {
    placement.iter().enumerate().map(move |(rank, p)| {
        (
            &p.host,
            WorkerState {
                job: job.clone(),
                generation,
                rank: rank as u32,
                phase: if done {
                    WorkerPhase::Succeeded
                } else {
                    WorkerPhase::Running
                },
                pid: None,
                restarts: 0,
                last_exit_code: done.then_some(0),
                gpus: p.gpus.clone(),
            },
        )
    })
}

/// A job's planned generation, ranks, and batch (per-worker micro-batch, accumulation
/// steps).
pub(crate) type Planned = (u64, Vec<RankPlacement>, Option<(u32, u32)>);

/// Adds `plan`'s workers to each job's planned generation, ranks and batch.
pub(crate) fn planned_workers<'p>(plan: &'p HostPlan, planned: &mut BTreeMap<&'p JobId, Planned>) {
    for w in &plan.workers {
        let entry = planned
            .entry(&w.job)
            .or_insert_with(|| (w.generation, Vec::new(), None));
        entry.0 = w.generation;
        entry.1.push(RankPlacement {
            rank: w.rank,
            host: plan.host.clone(),
            gpus: w.gpus.clone(),
        });
        if let Some(b) = &w.batch {
            entry.2 = Some((b.per_worker, b.accum_steps));
        }
    }
}

/// Runs `workload` under `policy` through the service's scheduling step ([`run`] over a
/// [`TraceWorld`]). Deterministic for a seed (decision times aside).
pub fn simulate_service(
    apps: &BTreeMap<String, Application>,
    workload: &[WorkloadJob],
    policy: Arc<dyn Policy>,
    cfg: &SimConfig,
) -> Result<SimResult, SimError> {
    let started = Instant::now();
    let mut world = TraceWorld::new(apps, workload, cfg, policy.inputs().goodput)?;
    let total_gpus = f64::from(world.cluster.total_gpus.max(1));
    let name = policy.name();
    let settings = Settings {
        placement: cfg.placement,
        usage_half_life_s: cfg.usage_half_life_s,
        // Heartbeats come every interval here.
        host_timeout_s: cfg.scheduling_interval_s * 2.0,
        policy,
        ..Settings::default()
    };
    let mut service = Service {
        queues: cfg.queues.clone(),
        ..Service::new(settings)
    };
    let mut records = Vec::new();
    let end = run(
        &mut world,
        &mut service,
        cfg.scheduling_interval_s,
        cfg.max_time_s,
        |world, interval| {
            records.push(IntervalRecord {
                time: interval.now,
                utilization: f64::from(world.allocated()) / total_gpus,
                avg_normalized_loss: (!world.norm_losses.is_empty()).then(|| {
                    world.norm_losses.iter().sum::<f64>() / world.norm_losses.len() as f64
                }),
                decision_s: interval.decision_s,
                active_jobs: world.active(interval.now),
                queues: interval.decision.queue_statuses.clone(),
            })
        },
    );
    records.push(IntervalRecord {
        time: end,
        utilization: 0.0,
        avg_normalized_loss: None,
        decision_s: 0.0,
        active_jobs: 0,
        queues: BTreeMap::new(),
    });
    Ok(world.result(name, records, started))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::simulate;
    use converge_common::{EndReason, JobPhase};
    use converge_sched::history::JobHistory;
    use converge_sched::policies::{PolicyParams, by_name};

    use crate::test_support::{apps, workload};

    fn policy(name: &str) -> Arc<dyn Policy> {
        by_name(name, PolicyParams::default()).unwrap().into()
    }

    /// Runs `world` to its end under `name`, returning the service as it ended.
    fn drive(world: &mut TraceWorld<'_>, name: &str, cfg: &SimConfig) -> Service {
        let settings = Settings {
            policy: policy(name),
            host_timeout_s: cfg.scheduling_interval_s * 2.0,
            ..Settings::default()
        };
        let mut service = Service::new(settings);
        run(
            world,
            &mut service,
            cfg.scheduling_interval_s,
            cfg.max_time_s,
            |_, _| {},
        );
        service
    }

    #[test]
    fn fifo_jobs_end_when_they_end_in_the_decision_loop() {
        // FIFO sizes no job by a model, so the two loops agree: the service loop's plans,
        // fencing and heartbeats add no delay of their own. What differs is how a job's
        // fixed total batch is split: by the service's plan (the micro-batch within GPU
        // memory, accumulation above it) here, by Pollux's `batch_config` in the decision
        // loop; on these jobs that moves an end by under 20 s.
        let jobs = workload(25);
        let cfg = SimConfig::default();
        let decided = simulate(apps(), &jobs, policy("fifo").as_ref(), &cfg).unwrap();
        let served = simulate_service(apps(), &jobs, policy("fifo"), &cfg).unwrap();
        assert!(served.finished);
        let mut split = 0;
        for (d, s) in decided.jobs.iter().zip(&served.jobs) {
            assert_eq!(
                (&d.name, d.restarts, d.first_placed_at),
                (&s.name, s.restarts, s.first_placed_at)
            );
            let (d_end, s_end) = (d.completed_at.unwrap(), s.completed_at.unwrap());
            assert!(
                (d_end - s_end).abs() < 20.0,
                "{}: {d_end} vs {s_end}",
                d.name
            );
            split += usize::from((d_end - s_end).abs() > 1.0);
        }
        // Only the jobs whose batch does not fit one GPU's memory (ncf) split differently.
        assert!(split <= jobs.iter().filter(|j| j.application == "ncf").count());
    }

    #[test]
    fn jobs_go_through_the_services_lifecycle_and_end_completed() {
        let jobs = workload(25);
        let cfg = SimConfig::default();
        let mut world = TraceWorld::new(apps(), &jobs, &cfg, true).unwrap();
        let service = drive(&mut world, "quality", &cfg);
        assert!(world.finished());
        assert_eq!(service.statuses.len(), jobs.len());
        for t in &world.cluster.jobs {
            let status = &service.statuses[&t.id];
            assert_eq!(status.phase, JobPhase::Completed, "{status:?}");
            // Each placement after the first was a new generation, fenced.
            assert!(
                status.generation > u64::from(t.job.restarts),
                "{}: generation {} after {} restarts",
                t.id,
                status.generation,
                t.job.restarts
            );
            // Adaptive jobs (all but ncf, as in the Pollux artifact) reported gradient
            // statistics to the service.
            let batch = status.batch.as_ref().expect("a [batch] job");
            assert_eq!(batch.gradient_reports > 0, t.limits.is_some(), "{status:?}");
        }
        // The service measured restart costs from the progress reports: about the world's
        // restart delay (the reports come once an interval).
        let measured: Vec<f64> = service
            .histories
            .values()
            .filter_map(JobHistory::restart_cost_s)
            .collect();
        assert!(!measured.is_empty());
        for cost in measured {
            assert!(
                (cost - cfg.restart_delay_s).abs() <= cfg.scheduling_interval_s,
                "{cost}"
            );
        }
    }

    #[test]
    fn a_job_that_reaches_its_target_loss_is_ended_by_the_service() {
        let jobs = workload(1);
        let cfg = SimConfig {
            work: WorkKnowledge::TargetLoss,
            loss_noise: 0.0,
            ..SimConfig::default()
        };
        let mut full = TraceWorld::new(apps(), &jobs, &cfg, false).unwrap();
        drive(&mut full, "fifo", &cfg);
        let ran_to_the_end = full.cluster.jobs[0].job.completed_at.unwrap();
        // The same job with a target its loss reaches half-way through its epochs.
        let mut world = TraceWorld::new(apps(), &jobs, &cfg, false).unwrap();
        let app = &apps()[&jobs[0].application];
        let half = f64::from(app.completion_epoch(jobs[0].batch_size)) / 2.0;
        world.specs[0].target_loss = Some(app.loss_like(jobs[0].batch_size, half));
        let service = drive(&mut world, "fifo", &cfg);
        let status = service.statuses.values().next().unwrap();
        assert_eq!(status.phase, JobPhase::Completed);
        assert_eq!(
            status.end.as_ref().map(|e| e.reason),
            Some(EndReason::TargetReached),
            "{status:?}"
        );
        let ended = world.cluster.jobs[0].job.completed_at.unwrap();
        assert!(ended < ran_to_the_end * 0.9, "{ended} vs {ran_to_the_end}");
        assert!(world.cluster.jobs[0].placement.is_empty());
    }

    #[test]
    fn a_refused_spec_fails_its_job_and_the_run_goes_on() {
        let jobs = workload(3);
        let cfg = SimConfig::default();
        let mut world = TraceWorld::new(apps(), &jobs, &cfg, false).unwrap();
        world.specs[1].work_samples = Some(0);
        let service = drive(&mut world, "fifo", &cfg);
        let bad = &service.statuses[&world.cluster.jobs[1].id];
        assert_eq!(bad.phase, JobPhase::Failed);
        assert!(
            bad.message
                .as_deref()
                .unwrap_or("")
                .contains("work_samples"),
            "{bad:?}"
        );
        assert_eq!(world.cluster.jobs[1].job.attained_gpu_seconds, 0.0);
        for t in [&world.cluster.jobs[0], &world.cluster.jobs[2]] {
            assert_eq!(service.statuses[&t.id].phase, JobPhase::Completed);
        }
    }

    #[test]
    fn runs_are_deterministic_for_a_seed_and_options_it_lacks_are_refused() {
        let jobs = workload(15);
        let cfg = SimConfig {
            seed: 3,
            ..SimConfig::default()
        };
        let a = simulate_service(apps(), &jobs, policy("quality"), &cfg).unwrap();
        let b = simulate_service(apps(), &jobs, policy("quality"), &cfg).unwrap();
        assert_eq!(a.jobs, b.jobs);
        for cfg in [
            SimConfig {
                ignore_contention: true,
                ..SimConfig::default()
            },
            SimConfig {
                shadow_fraction: 0.5,
                ..SimConfig::default()
            },
        ] {
            let err = simulate_service(apps(), &jobs, policy("quality"), &cfg).unwrap_err();
            assert!(err.to_string().contains("--loop service"), "{err}");
        }
    }
}
