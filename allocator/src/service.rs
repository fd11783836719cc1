//! The allocator service: the I/O shell around [`converge_sched::schedule::step`]. It rebuilds its
//! view (job specs and statuses, host telemetry, progress histories) from NATS on start,
//! follows updates, runs a step on every trigger and writes only the statuses and plans
//! that changed. It keeps no local state: kill it at any time and start it anywhere.

use crate::reporters::Reporters;
use async_nats::jetstream::{self, kv};
use converge_bus::{Bus, NatsArgs, Rejects, humantime_duration, unix_now};
use converge_common::{
    Event, EventKind, HostId, HostPlan, HostTelemetry, JobId, JobSpec, JobStatus, ProgressReport,
    QueueId, QueueSpec, QueueStatus, messages::decode, subjects,
};
use converge_sched::fit_cache::FitCache;
use converge_sched::history::JobHistory;
use converge_sched::placement::PlacementKind;
use converge_sched::policies::{Objective, PolicyParams};
use converge_sched::schedule::{Inputs, Settings, step};
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Command line and environment of `converge-allocator`.
#[derive(Debug, Clone, clap::Args)]
pub struct AllocatorConfig {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Scheduling interval: how often the policy re-decides allocations (it also runs when a
    /// job is submitted or finishes and when hosts come or go). SLAQ uses 10 s. `--epoch`
    /// is the old name, accepted for one release (`CONVERGE_EPOCH` is refused with a message
    /// naming the new variable).
    #[arg(
        long,
        visible_alias = "epoch",
        env = "CONVERGE_SCHEDULING_INTERVAL",
        default_value = "10s",
        value_parser = humantime_duration
    )]
    pub scheduling_interval: Duration,
    /// How far ahead the policy predicts each job's loss reduction.
    #[arg(long, env = "CONVERGE_HORIZON", default_value = "60s", value_parser = humantime_duration)]
    pub horizon: Duration,
    /// Time a job loses when its allocation changes (checkpoint, restart, rendezvous). A
    /// running job is resized only if the predicted gain over the horizon, with this much
    /// less time to make it, beats keeping its allocation. 0 disables the hysteresis.
    #[arg(long, env = "CONVERGE_RESTART_COST", default_value = "30s", value_parser = humantime_duration)]
    pub restart_cost: Duration,
    /// A host whose heartbeat is older than this is lost; its jobs are placed elsewhere.
    #[arg(long, env = "CONVERGE_HOST_TIMEOUT", default_value = "15s", value_parser = humantime_duration)]
    pub host_timeout: Duration,
    /// Policy that sizes jobs: quality (the default), fair, fifo, tiresias, optimus or sjf-bco. The
    /// service does not track attained service, so tiresias keeps every job in its first
    /// queue; optimus uses the throughput model and, for a job with a target loss, the
    /// samples its curve predicts to reach it.
    #[arg(long, env = "CONVERGE_POLICY", default_value = "quality", value_parser = parse_policy)]
    pub policy: String,
    /// What the quality policy maximizes over the horizon: `both` (the sum of the two
    /// others, the default), `jct` (each job's speedup weighted by its rank by remaining time, which favours
    /// jobs close to completion) or `loss` (SLAQ's normalized loss reduction). A job's
    /// remaining work is known when it has a `target_loss` its fitted curve reaches; else it
    /// is guessed as the work it has done so far.
    #[arg(long, env = "CONVERGE_OBJECTIVE", value_enum, default_value_t = Objective::default())]
    pub objective: Objective,
    /// Placement: `first-fit` (hosts in id order) or `bco` (balance contention between
    /// multi-host jobs on shared NICs against the overhead of spanning hosts, priced by each
    /// job's throughput model; the default: in the simulator it lowers the quality policy's
    /// mean JCT, by 28 % under Pollux's interference; see docs/scheduling.md).
    #[arg(long, env = "CONVERGE_PLACEMENT", value_enum, default_value_t = PlacementKind::Bco)]
    pub placement: PlacementKind,
    /// Starvation guard: a job that has never run and is pending this long since submission
    /// is admitted ahead of running jobs (which may stop one at its minimum to make room); a
    /// preempted job waits for its turn.
    #[arg(long, env = "CONVERGE_MAX_WAIT", default_value = "30m", value_parser = humantime_duration)]
    pub max_wait: Duration,
    /// Parameter-server shards one host may run, all jobs together (each is a CPU process
    /// without a GPU). The planner of `arch = "ps"` jobs places shards within this bound;
    /// with 0 it finds no plan and puts one shard next to each worker host.
    #[arg(long, env = "CONVERGE_PS_SHARDS_PER_HOST", default_value_t = converge_sched::schedule::DEFAULT_PS_SHARDS_PER_HOST)]
    pub ps_shards_per_host: u32,
    /// Serve Prometheus metrics at `http://<addr>/metrics` (e.g. `0.0.0.0:9464`): step
    /// (decision) time, progress ingest lag, reports ingested, writes, jobs by phase, live
    /// hosts, refused messages, leadership and the process's memory. Off when unset.
    #[arg(long, env = "CONVERGE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Most loss curves refitted in one scheduling step; the others keep their last fit
    /// until a later step. Bounds the step (decision) time when many jobs report at once.
    #[arg(long, env = "CONVERGE_FIT_BUDGET", default_value_t = converge_sched::schedule::DEFAULT_FIT_BUDGET)]
    pub fit_budget: usize,
    /// This replica's id for the leader lease (unique among replicas; default: the host
    /// name). Run several replicas with the same NATS for failover: only the lease holder
    /// schedules and writes.
    #[arg(long, env = "CONVERGE_REPLICA_ID", default_value_t = default_replica_id())]
    pub replica_id: String,
    /// Leader lease length: a replica takes over when the leader has not renewed for this
    /// long (renewals every third of it). Handover after a leader dies takes between ⅔ and
    /// 1⅓ of it; a leader that stops cleanly hands over within a third of it.
    #[arg(long, env = "CONVERGE_LEASE_TTL", default_value = "10s", value_parser = humantime_duration)]
    pub lease_ttl: Duration,
    /// Half-life of each queue's decayed GPU usage in the fair share of lent GPUs: a queue
    /// that borrowed heavily gets less of what is lent for about this long. Not 0 (that
    /// would forget usage at once; see docs/scheduling.md, "Queues, fair share and
    /// priorities").
    #[arg(long, env = "CONVERGE_USAGE_HALF_LIFE", default_value = "1h", value_parser = parse_half_life)]
    pub usage_half_life: Duration,
}

fn parse_half_life(s: &str) -> Result<Duration, String> {
    let d = humantime_duration(s)?;
    if d.is_zero() {
        return Err("the usage half-life must be above 0 (e.g. 1h)".into());
    }
    Ok(d)
}

/// The host name, or `allocator` when it cannot be read.
pub fn default_replica_id() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "allocator".into())
}

fn parse_policy(s: &str) -> Result<String, String> {
    converge_sched::policies::by_name(s, PolicyParams::default())
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

impl AllocatorConfig {
    /// The pure step's settings from the command line.
    pub fn settings(&self) -> Settings {
        let policy = PolicyParams {
            horizon_s: self.horizon.as_secs_f64(),
            restart_cost_s: self.restart_cost.as_secs_f64(),
            objective: self.objective,
            max_wait_s: self.max_wait.as_secs_f64(),
            ..PolicyParams::default()
        };
        let scheduler = converge_sched::policies::by_name(&self.policy, policy)
            .map(std::sync::Arc::from)
            .unwrap_or_else(|_| Settings::default().scheduler);
        Settings {
            host_timeout_s: self.host_timeout.as_secs_f64(),
            placement: self.placement,
            policy,
            scheduler,
            ps_shards_per_host: self.ps_shards_per_host,
            fit_budget: self.fit_budget,
            usage_half_life_s: self.usage_half_life.as_secs_f64(),
            ..Settings::default()
        }
    }
}

/// Shortest time between two steps: bursts of updates are folded into one step.
pub const STEP_SPACING: Duration = Duration::from_millis(200);
/// How often the lifecycle (completions, restarts, host timeouts) is checked without updates.
pub const LIFECYCLE_TICK: Duration = Duration::from_secs(1);

enum Input {
    Spec(JobId, Result<JobSpec, String>),
    SpecDeleted(JobId),
    Host(HostTelemetry),
    HostDeleted(HostId),
    /// A job status as stored (by this replica or another): where each generation runs.
    Status(Box<JobStatus>),
    StatusDeleted(JobId),
    Progress(Box<Progress>),
    /// A message of the progress stream that is no report (refused and counted by the
    /// follower as it read it): its sequence, for the leader to delete.
    Undecodable(u64),
    ProgressCaughtUp,
    Queue(QueueSpec),
    QueueDeleted(QueueId),
    /// A queue status as stored (by this replica or another): the usage to continue from.
    QueueStatus(Box<QueueStatus>),
    QueueStatusDeleted(QueueId),
}

/// A decoded progress report as read from the stream, not yet checked against the job's
/// placement ([`Reporters::check`]).
struct Progress {
    report: ProgressReport,
    subject: String,
    /// Its sequence in the stream (0 when unknown).
    seq: u64,
    /// When the stream stored it (UNIX seconds, the server's clock).
    stored_at: Option<f64>,
    /// It was in the stream when the allocator started (the history's replay).
    replay: bool,
}

/// The allocator's view, rebuilt from NATS.
#[derive(Debug, Default)]
struct View {
    specs: BTreeMap<JobId, JobSpec>,
    refused: BTreeMap<JobId, String>,
    statuses: BTreeMap<JobId, JobStatus>,
    hosts: BTreeMap<HostId, HostTelemetry>,
    histories: BTreeMap<JobId, JobHistory>,
    /// The fits of earlier steps (curves, throughput models): derived from the histories,
    /// rebuilt after a restart by the first step's refits.
    fits: FitCache,
    /// The plans as stored in KV (to write only what changes).
    plans: BTreeMap<HostId, HostPlan>,
    /// The KV revision of each plan and status as this replica last read or wrote it:
    /// writes are compare-and-set on it ([`Bus::put_expecting`]), so a write based on an
    /// outdated view (a replaced leader's late write) fails instead of overwriting.
    plan_revisions: BTreeMap<HostId, u64>,
    status_revisions: BTreeMap<JobId, u64>,
    /// A compare-and-set write failed: re-read plans and statuses before the next step.
    reread: bool,
    /// The hosts of each job's current and previous generation: who may report progress.
    reporters: Reporters,
    /// The queues (KV `converge-queues`).
    queues: BTreeMap<QueueId, QueueSpec>,
    /// Each queue's status as last stored (KV `converge-queue-status`): the decayed usage
    /// the next step continues from.
    queue_statuses: BTreeMap<QueueId, QueueStatus>,
    /// Shadow jobs' latest sync figures, from the progress reports (for their statuses).
    shadow: crate::shadow::ShadowFigures,
}

/// Runs the allocator until `shutdown` is cancelled.
pub async fn run(cfg: AllocatorConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    if let Some(addr) = cfg.metrics_addr {
        converge_bus::metrics::serve(addr, shutdown.clone()).await?;
    }
    describe_metrics();
    // Per-job series, rebuilt after every step (only the leader's are exported).
    let job_series = converge_bus::metrics::SnapshotGuard(format!("allocator/{}", cfg.replica_id));
    // The allocator owns the buckets and the stream: it creates and updates them.
    // SIGTERM or Ctrl-C while NATS cannot be reached (yet) stops the allocator at once.
    let bus = tokio::select! {
        bus = Bus::connect(
            &cfg.nats,
            "converge-allocator",
            converge_bus::Setup::CreateOrUpdate,
        ) => bus?,
        () = shutdown.cancelled() => {
            tracing::info!("stopped before NATS could be reached");
            return Ok(());
        }
    };
    let rejects = Arc::new(Rejects::default());
    let settings = cfg.settings();
    let lease_stop = CancellationToken::new();
    let (mut leadership, lease_task) = crate::lease::spawn(
        &bus.js,
        crate::lease::LeaseConfig {
            replica_id: cfg.replica_id.clone(),
            ttl: cfg.lease_ttl,
            replicas: bus.replicas,
        },
        lease_stop.clone(),
    )
    .await?;
    // If this future is dropped (aborted), the lease stops being renewed with it.
    let _lease_guard = AbortOnDrop(lease_task.abort_handle());

    // Rebuild the view from NATS.
    let mut view = View::default();
    for (key, (status, revision)) in bus.load_all::<JobStatus>(&bus.status, &rejects).await? {
        if let Ok(id) = JobId::new(key) {
            view.reporters.note(&status);
            view.status_revisions.insert(id.clone(), revision);
            view.statuses.insert(id, status);
        }
    }
    for (key, (plan, revision)) in bus.load_all::<HostPlan>(&bus.plans, &rejects).await? {
        if let Ok(id) = HostId::new(key) {
            view.plan_revisions.insert(id.clone(), revision);
            view.plans.insert(id, plan);
        }
    }
    let queue_buckets = bus.open_queues(converge_bus::Setup::CreateOrUpdate).await?;
    for (key, (spec, _)) in bus
        .load_all::<QueueSpec>(&queue_buckets.queues, &rejects)
        .await?
    {
        if spec.name.as_str() == key {
            view.queues.insert(spec.name.clone(), spec);
        }
    }
    for (key, (status, _)) in bus
        .load_all::<QueueStatus>(&queue_buckets.status, &rejects)
        .await?
    {
        if status.queue.as_str() == key {
            view.queue_statuses.insert(status.queue.clone(), status);
        }
    }
    // Specs and heartbeats go ahead of progress reports: under a flood of reports, a host
    // must not look lost because its heartbeat waits behind them.
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<Input>(16_384);
    let (tx, mut rx) = mpsc::channel::<Input>(65_536);
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(watch_jobs(
        bus.jobs.clone(),
        ctl_tx.clone(),
        rejects.clone(),
    ));
    tasks.spawn(watch_hosts(
        bus.hosts.clone(),
        ctl_tx.clone(),
        rejects.clone(),
    ));
    // Followers learn new generations' placements from here (the leader also from its own
    // steps): who may report progress.
    tasks.spawn(watch_statuses(
        bus.status.clone(),
        ctl_tx.clone(),
        rejects.clone(),
    ));
    tasks.spawn(watch_queues(
        queue_buckets.queues.clone(),
        ctl_tx.clone(),
        rejects.clone(),
    ));
    tasks.spawn(watch_queue_statuses(
        queue_buckets.status.clone(),
        ctl_tx.clone(),
        rejects.clone(),
    ));
    // Reports the leader refused for good are deleted from the stream (bounded queue; a
    // report not deleted is refused again when read again).
    let (refused_tx, refused_rx) = mpsc::channel::<u64>(1_024);
    tasks.spawn(delete_refused(bus.js.clone(), refused_rx));
    tasks.spawn(follow_progress(
        bus.client.clone(),
        bus.js.clone(),
        tx.clone(),
        rejects.clone(),
    ));
    drop(tx);
    drop(ctl_tx);
    tracing::info!(
        statuses = view.statuses.len(),
        plans = view.plans.len(),
        scheduling_interval = ?cfg.scheduling_interval,
        restart_cost = ?cfg.restart_cost,
        horizon = ?cfg.horizon,
        "allocator started; reading specs, hosts and progress history"
    );

    let mut scheduling = tokio::time::interval(cfg.scheduling_interval);
    scheduling.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(LIFECYCLE_TICK);
    let mut caught_up = false;
    let mut policy_due = true;
    let mut lifecycle_due = true;
    // Live hosts with their GPUs and GPU type: a change makes the policy run.
    let mut last_live: BTreeSet<(HostId, usize, Option<String>)> = BTreeSet::new();
    let mut last_gpu_types: BTreeMap<String, usize> = BTreeMap::new();
    let mut last_step = Instant::now() - STEP_SPACING;
    let mut leading = false;

    loop {
        let spacing = STEP_SPACING.saturating_sub(last_step.elapsed());
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            input = ctl_rx.recv(), if !ctl_rx.is_closed() || !ctl_rx.is_empty() => {
                let Some(input) = input else { continue };
                apply(&mut view, input, &mut policy_due, &mut lifecycle_due, caught_up);
            }
            changed = leadership.changed() => {
                if changed.is_err() { break; }
                let now_leading = leadership.borrow_and_update().is_valid();
                if now_leading && !leading {
                    // Another replica may have written since this one last read.
                    reload_written(&bus, &mut view, &rejects).await;
                    write_unissued_generations(&bus, &mut view).await;
                    reload_queue_statuses(&bus, &queue_buckets, &mut view, &rejects).await;
                    policy_due = true;
                    // The reads above can take seconds (a NATS cluster electing leaders):
                    // apply what the followers delivered meanwhile before any step, or the
                    // step would judge hosts by telemetry older than the host timeout.
                    for _ in 0..rx.len() {
                        let Ok(input) = rx.try_recv() else { break };
                        let due = (&mut policy_due, &mut lifecycle_due);
                        if let Some(seq) = take(&mut view, input, &rejects, due, &mut caught_up) {
                            queue_deletion(&refused_tx, seq);
                        }
                    }
                }
                leading = now_leading;
            }
            input = rx.recv() => {
                let Some(input) = input else { break };
                let due = (&mut policy_due, &mut lifecycle_due);
                if let Some(seq) = take(&mut view, input, &rejects, due, &mut caught_up)
                    && leadership.borrow().is_valid()
                {
                    queue_deletion(&refused_tx, seq);
                }
            }
            _ = scheduling.tick() => policy_due = true,
            _ = tick.tick() => lifecycle_due = true,
            _ = tokio::time::sleep(spacing), if (policy_due || lifecycle_due) && !spacing.is_zero() => {}
        }
        if !caught_up || !(policy_due || lifecycle_due) || last_step.elapsed() < STEP_SPACING {
            continue;
        }
        if !leadership.borrow().is_valid() {
            // Followers keep their view current and wait; a leader whose lease ran out
            // stops writing until it renews.
            leading = false;
            converge_bus::metrics::remove_snapshot(&job_series.0);
            continue;
        }
        let now = unix_now();
        let live: BTreeSet<(HostId, usize, Option<String>)> = view
            .hosts
            .values()
            .filter(|t| now - t.time <= settings.host_timeout_s)
            .map(|t| {
                let kind = converge_common::labels::host_gpu_type(&t.labels);
                (t.host.clone(), t.gpus.len(), kind)
            })
            .collect();
        if live != last_live {
            let by_type = converge_common::labels::gpus_by_type(
                view.hosts
                    .values()
                    .filter(|t| now - t.time <= settings.host_timeout_s),
            );
            tracing::info!(
                hosts = live.len(),
                gpus = live.iter().map(|(_, n, _)| n).sum::<usize>(),
                gpus_by_type = %by_type
                    .iter()
                    .map(|(t, n)| format!("{t} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                "cluster changed"
            );
            for kind in last_gpu_types.keys().filter(|k| !by_type.contains_key(*k)) {
                metrics::gauge!("converge_allocator_gpus_live", "gpu_type" => kind.clone())
                    .set(0.0);
            }
            for (kind, n) in &by_type {
                metrics::gauge!("converge_allocator_gpus_live", "gpu_type" => kind.clone())
                    .set(*n as f64);
            }
            last_gpu_types = by_type;
            last_live = live;
            policy_due = true;
        }
        let run_policy = policy_due;
        let started = Instant::now();
        let mut outcome = step(
            Inputs {
                now,
                specs: &view.specs,
                refused_specs: &view.refused,
                statuses: &view.statuses,
                hosts: &view.hosts,
                histories: &view.histories,
                queues: &view.queues,
                queue_statuses: &view.queue_statuses,
            },
            &settings,
            &mut view.fits,
            run_policy,
        );
        let decision_time = started.elapsed();
        last_step = Instant::now();
        policy_due = false;
        lifecycle_due = false;
        metrics::histogram!("converge_allocator_step_seconds", "policy" => if run_policy { "true" } else { "false" })
            .record(decision_time.as_secs_f64());
        metrics::gauge!("converge_allocator_input_queue").set(rx.len() as f64);
        metrics::gauge!("converge_allocator_hosts_live").set(last_live.len() as f64);
        let mut refused = rejects.by_kind();
        for kind in REFUSAL_KINDS {
            refused.entry(kind).or_insert(0);
        }
        for (kind, n) in refused {
            metrics::gauge!("converge_allocator_refused_messages", "kind" => kind).set(n as f64);
        }
        for status in outcome.statuses.values_mut() {
            view.shadow.stamp(status);
        }
        record_job_phases(&outcome.statuses);
        record_changes(&outcome.events, &outcome.statuses);
        converge_bus::metrics::set_snapshot(&job_series.0, job_families(&outcome.statuses));
        for status in outcome.statuses.values() {
            // Before the plans are written: the new generation's workers report at once.
            view.reporters.note(status);
        }
        if run_policy {
            tracing::debug!(?decision_time, jobs = outcome.statuses.len(), "policy step");
        }
        for e in &outcome.events {
            tracing::info!(event = %e.message, "event");
            if matches!(e.kind, EventKind::JobFinished { .. }) {
                // Freed GPUs go to the others now, not at the next scheduling interval.
                policy_due = true;
            }
            publish_event(&bus, e).await;
        }
        if leadership.borrow().is_valid() {
            write_changes(&bus, &mut view, outcome.statuses, outcome.plans, now).await;
            if std::mem::take(&mut view.reread) {
                reload_written(&bus, &mut view, &rejects).await;
                policy_due = true;
            }
            write_queue_statuses(&bus, &queue_buckets, &mut view, outcome.queue_statuses).await;
        }
    }
    lease_stop.cancel();
    if tokio::time::timeout(Duration::from_secs(2), lease_task)
        .await
        .is_err()
    {
        tracing::warn!("leader lease not handed back within 2 s");
    }
    tasks.abort_all();
    let _ = bus.client.flush().await;
    tracing::info!(refused_messages = rejects.total(), "allocator stopped");
    Ok(())
}

/// The labels of `converge_allocator_refused_messages`: why a message was refused (each
/// exported from the start, 0 until it happens).
const REFUSAL_KINDS: [&str; 6] = [
    "malformed",
    "wrong_version",
    "invalid",
    "too_large",
    "wrong_subject",
    "not_placed",
];

/// Describes the allocator's metrics (names, units, help) to the recorder.
fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        "converge_allocator_step_seconds",
        Unit::Seconds,
        "Time of one scheduling step (pure decision: fits, policy, placement, plans); label policy=true when allocations were re-decided"
    );
    describe_histogram!(
        "converge_allocator_ingest_lag_seconds",
        Unit::Seconds,
        "From the progress stream storing a report to the allocator applying it (after the start-up replay)"
    );
    describe_counter!(
        "converge_allocator_progress_reports_total",
        "Progress reports applied to the histories (the start-up replay included)"
    );
    describe_counter!(
        "converge_allocator_plan_writes_total",
        "Host plans written to KV (only changed plans are written)"
    );
    describe_counter!(
        "converge_allocator_write_conflicts_total",
        "Plan and status writes refused because another allocator changed the key since this one read it (compare-and-set), by bucket"
    );
    describe_counter!(
        "converge_allocator_refused_kept_total",
        "Refused progress messages left in the stream because the deletion queue was full (a flood faster than deletions); the stream's bounds evict them"
    );
    describe_counter!(
        "converge_allocator_write_failures_total",
        "Plan and status writes that failed (NATS errors and timeouts, not compare-and-set conflicts), by bucket; the next step writes them again"
    );
    describe_counter!(
        "converge_allocator_status_writes_total",
        "Job statuses written to KV (only changed statuses are written)"
    );
    describe_gauge!(
        "converge_allocator_input_queue",
        "Updates waiting in the allocator's input queue after a step"
    );
    describe_gauge!(
        "converge_allocator_hosts_live",
        "Hosts whose heartbeat is younger than the host timeout"
    );
    describe_gauge!(
        "converge_allocator_gpus_live",
        "GPUs of the live hosts, by GPU type (the hosts' gpu.type label); 0 once a type's last host is gone"
    );
    describe_gauge!("converge_allocator_jobs", "Jobs by phase");
    describe_counter!(
        "converge_allocator_allocation_changes_total",
        "Allocation changes decided (new generations and preemptions), by cause: started, grown, shrunk, preempted, moved, host_lost, batch, address"
    );
    describe_counter!(
        "converge_allocator_jobs_finished_total",
        "Jobs that reached a final phase, by phase"
    );
    describe_gauge!(
        "converge_allocator_refused_messages",
        "Messages refused since start, by kind: malformed, wrong_version, invalid, too_large (not decodable), wrong_subject (a progress report on another job's or host's subject), not_placed (a progress report from a host outside the job's placement)"
    );
}

fn record_job_phases(statuses: &BTreeMap<JobId, JobStatus>) {
    use converge_common::JobPhase;
    let mut counts: BTreeMap<&'static str, usize> = [
        JobPhase::Pending,
        JobPhase::Restarting,
        JobPhase::Running,
        JobPhase::Completed,
        JobPhase::Failed,
        JobPhase::Cancelled,
    ]
    .into_iter()
    .map(|p| (p.as_str(), 0))
    .collect();
    for s in statuses.values() {
        *counts.entry(s.phase.as_str()).or_default() += 1;
    }
    for (phase, n) in counts {
        metrics::gauge!("converge_allocator_jobs", "phase" => phase).set(n as f64);
    }
}

/// Counts the step's allocation changes by cause (the status's record of the change; from
/// the worker counts when the record is missing) and its finished jobs by phase.
fn record_changes(events: &[Event], statuses: &BTreeMap<JobId, JobStatus>) {
    for e in events {
        match &e.kind {
            EventKind::AllocationChanged {
                job,
                generation,
                from_workers,
                to_workers,
            } => {
                let recorded = statuses.get(job).and_then(|s| {
                    s.allocations
                        .iter()
                        .rev()
                        .find(|a| a.generation == *generation)
                        .map(|a| a.cause.as_str())
                });
                let cause = recorded.unwrap_or(match (*from_workers, *to_workers) {
                    (0, _) => "started",
                    (_, 0) => "preempted",
                    (f, t) if t > f => "grown",
                    (f, t) if t < f => "shrunk",
                    _ => "moved",
                });
                metrics::counter!("converge_allocator_allocation_changes_total", "cause" => cause)
                    .increment(1);
            }
            EventKind::JobFinished { phase, .. } => {
                metrics::counter!("converge_allocator_jobs_finished_total", "phase" => phase.as_str())
                    .increment(1);
            }
            _ => {}
        }
    }
}

/// Per-job series of the jobs still pending, restarting or running, label `job_id` only
/// (not `job`: Prometheus gives every scraped series its target's `job` label, and would
/// rename ours to `exported_job`):
/// a finished job (or a deleted one) has no series from the next step on, so the number of
/// series follows the number of active jobs, not every job ever submitted. Missing figures
/// (no loss reported yet, no fitted curve) have no series.
fn job_families(statuses: &BTreeMap<JobId, JobStatus>) -> converge_bus::metrics::Snapshot {
    use converge_bus::metrics::Family;
    use converge_common::JobPhase;
    let mut loss = Family::gauge(
        "converge_job_loss",
        "Latest training loss rank 0 reported, per active job",
    );
    let mut predicted = Family::gauge(
        "converge_job_predicted_loss",
        "Loss the fitted curve predicts one horizon ahead at the current allocation",
    );
    let mut workers = Family::gauge(
        "converge_job_workers",
        "Workers of the job's current generation (0 while pending)",
    );
    let mut throughput = Family::gauge(
        "converge_job_samples_per_second",
        "Observed throughput of the current allocation, samples per second",
    );
    let mut generation = Family::gauge(
        "converge_job_generation",
        "The job's current generation (+1 on every allocation change)",
    );
    for s in statuses.values() {
        if !matches!(
            s.phase,
            JobPhase::Pending | JobPhase::Restarting | JobPhase::Running
        ) {
            continue;
        }
        let job = || vec![("job_id", s.job.to_string())];
        loss.push_some(job(), s.loss);
        predicted.push_some(job(), s.predicted_loss);
        workers.push(job(), f64::from(s.world_size));
        throughput.push_some(job(), s.samples_per_s);
        generation.push(job(), s.generation as f64);
    }
    vec![loss, predicted, workers, throughput, generation]
}

/// Applies one update to the view and says what it makes due.
/// Takes one input from the followers into the view: the progress history's end, a
/// report (its stream sequence returned when refused for good, for the leader to delete),
/// or anything else ([`apply`]).
fn take(
    view: &mut View,
    input: Input,
    rejects: &Rejects,
    (policy_due, lifecycle_due): (&mut bool, &mut bool),
    caught_up: &mut bool,
) -> Option<u64> {
    match input {
        Input::ProgressCaughtUp => {
            *caught_up = true;
            tracing::info!(jobs = view.histories.len(), "progress history rebuilt");
            None
        }
        Input::Progress(p) => ingest(view, p, rejects, lifecycle_due, *caught_up),
        Input::Undecodable(seq) => Some(seq),
        input => {
            apply(view, input, policy_due, lifecycle_due, *caught_up);
            None
        }
    }
}

fn apply(
    view: &mut View,
    input: Input,
    policy_due: &mut bool,
    lifecycle_due: &mut bool,
    caught_up: bool,
) {
    match input {
        Input::Spec(id, Ok(spec)) => {
            if view.specs.get(&id) != Some(&spec) {
                *policy_due = true;
            }
            view.refused.remove(&id);
            view.specs.insert(id, spec);
        }
        Input::Spec(id, Err(reason)) => {
            view.specs.remove(&id);
            view.refused.insert(id, reason);
            *lifecycle_due = true;
        }
        Input::SpecDeleted(id) => {
            view.specs.remove(&id);
            view.refused.remove(&id);
            *policy_due = true;
        }
        Input::Host(t) => {
            view.hosts.insert(t.host.clone(), t);
            *lifecycle_due = true;
        }
        Input::HostDeleted(h) => {
            view.hosts.remove(&h);
            *policy_due = true;
        }
        Input::Status(status) => view.reporters.note(&status),
        Input::StatusDeleted(job) => view.reporters.forget(&job),
        Input::Progress(p) => {
            metrics::counter!("converge_allocator_progress_reports_total").increment(1);
            if caught_up && let Some(at) = p.stored_at {
                metrics::histogram!("converge_allocator_ingest_lag_seconds")
                    .record((unix_now() - at).max(0.0));
            }
            let r = &p.report;
            view.histories.entry(r.job.clone()).or_default().add(r);
            view.shadow.note(r);
            *lifecycle_due = true;
        }
        Input::ProgressCaughtUp | Input::Undecodable(_) => {}
        Input::Queue(spec) => {
            if view.queues.get(&spec.name) != Some(&spec) {
                *policy_due = true;
            }
            view.queues.insert(spec.name.clone(), spec);
        }
        Input::QueueDeleted(name) => {
            if view.queues.remove(&name).is_some() {
                *policy_due = true;
            }
        }
        Input::QueueStatus(status) => {
            view.queue_statuses.insert(status.queue.clone(), *status);
        }
        Input::QueueStatusDeleted(name) => {
            view.queue_statuses.remove(&name);
        }
    }
}

/// A progress report from the stream: applied to its job's history if its host may report
/// for the job ([`Reporters::check`]), else counted in `rejects`. Returns the stream
/// sequence of a report refused for good, which the leader deletes from the stream.
fn ingest(
    view: &mut View,
    p: Box<Progress>,
    rejects: &Rejects,
    lifecycle_due: &mut bool,
    caught_up: bool,
) -> Option<u64> {
    match view.reporters.check(&p.subject, &p.report, p.replay) {
        Ok(()) => {
            let mut policy_due = false;
            apply(
                view,
                Input::Progress(p),
                &mut policy_due,
                lifecycle_due,
                caught_up,
            );
            None
        }
        Err(refusal) => {
            rejects.refuse(&p.subject, "", refusal.kind, &refusal.reason);
            (refusal.certain && p.seq != 0).then_some(p.seq)
        }
    }
}

/// Re-reads the statuses and plans in KV (when this replica becomes the leader: the previous
/// leader wrote them).
async fn reload_written(bus: &Bus, view: &mut View, rejects: &Rejects) {
    match bus.load_all::<JobStatus>(&bus.status, rejects).await {
        Ok(all) => {
            let all: Vec<(JobId, JobStatus, u64)> = all
                .into_iter()
                .filter_map(|(k, (s, rev))| Some((JobId::new(k).ok()?, s, rev)))
                .collect();
            view.status_revisions = all.iter().map(|(k, _, rev)| (k.clone(), *rev)).collect();
            view.statuses = all.into_iter().map(|(k, s, _)| (k, s)).collect();
            for s in view.statuses.values() {
                view.reporters.note(s);
            }
        }
        Err(e) => tracing::warn!("cannot re-read job statuses: {e}"),
    }
    match bus.load_all::<HostPlan>(&bus.plans, rejects).await {
        Ok(all) => {
            let all: Vec<(HostId, HostPlan, u64)> = all
                .into_iter()
                .filter_map(|(k, (p, rev))| Some((HostId::new(k).ok()?, p, rev)))
                .collect();
            view.plan_revisions = all.iter().map(|(k, _, rev)| (k.clone(), *rev)).collect();
            view.plans = all.into_iter().map(|(k, p, _)| (k, p)).collect();
        }
        Err(e) => tracing::warn!("cannot re-read plans: {e}"),
    }
}

/// Jobs whose plans carry a newer generation than their stored status (a leader that
/// crashed, or lost the lease, between writing a new generation's plans and its status),
/// each with the status to write: its generation past every planned one, the placement
/// unchanged. The plans derived from it then carry that fresh number: no generation
/// number is issued twice, with two different placements, and the agents never go back
/// to an older one. Pure.
fn unissued_generations(
    statuses: &BTreeMap<JobId, JobStatus>,
    plans: &BTreeMap<HostId, HostPlan>,
) -> Vec<JobStatus> {
    let mut planned: BTreeMap<&JobId, u64> = BTreeMap::new();
    for a in plans.values().flat_map(|p| &p.workers) {
        let g = planned.entry(&a.job).or_default();
        *g = (*g).max(a.generation);
    }
    planned
        .into_iter()
        .filter_map(|(job, generation)| {
            let status = statuses.get(job)?;
            (generation > status.generation).then(|| JobStatus {
                generation: generation + 1,
                ..status.clone()
            })
        })
        .collect()
}

/// Writes [`unissued_generations`] (a new leader, before its first step), so that its
/// steps continue from a generation no agent has seen.
async fn write_unissued_generations(bus: &Bus, view: &mut View) {
    for status in unissued_generations(&view.statuses, &view.plans) {
        let id = status.job.clone();
        let stored = view.statuses.get(&id).map_or(0, |s| s.generation);
        let expected = view.status_revisions.get(&id).copied();
        match bus
            .put_expecting(&bus.status, id.as_str(), &status, expected)
            .await
        {
            Ok(rev) => {
                tracing::warn!(
                    job = %id,
                    stored,
                    generation = status.generation,
                    "plans carry a generation the job's status does not (the previous leader stopped between the two writes): continuing from a new generation"
                );
                view.status_revisions.insert(id.clone(), rev);
                view.reporters.note(&status);
                view.statuses.insert(id, status);
            }
            Err(e) => tracing::warn!(job = %id, "status not written: {e}"),
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A status without its write time, to tell real changes from re-computations.
fn same_status(a: &JobStatus, b: &JobStatus) -> bool {
    let mut b = b.clone();
    b.updated_at = a.updated_at;
    *a == b
}

/// A failed write that took this long timed out ([`write_changes`]).
const SLOW_WRITE: Duration = Duration::from_secs(1);

async fn write_changes(
    bus: &Bus,
    view: &mut View,
    statuses: BTreeMap<JobId, JobStatus>,
    plans: BTreeMap<HostId, HostPlan>,
    now: f64,
) {
    // Plans first for jobs that stop (so agents act), statuses after; both are level-
    // triggered, so a failed write is retried by the next step. After a write that failed
    // slowly (a timeout) the rest of its bucket waits for the next step too: on a NATS
    // cluster electing that bucket's leader each write would wait for its timeout, and hold
    // up the loop.
    for (host, plan) in plans {
        if view.plans.get(&host) == Some(&plan) {
            continue;
        }
        let started = Instant::now();
        let expected = view.plan_revisions.get(&host).copied();
        match bus
            .put_expecting(&bus.plans, host.as_str(), &plan, expected)
            .await
        {
            Ok(rev) => {
                metrics::counter!("converge_allocator_plan_writes_total").increment(1);
                tracing::info!(%host, workers = plan.workers.len(), revision = rev, "plan written");
                view.plan_revisions.insert(host.clone(), rev);
                view.plans.insert(host, plan);
            }
            Err(e @ converge_bus::BusError::Conflict { .. }) => {
                metrics::counter!("converge_allocator_write_conflicts_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "{e}: another allocator wrote it; re-reading before the next step");
                view.reread = true;
            }
            Err(e) if started.elapsed() >= SLOW_WRITE => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "plan not written: {e}; the others wait for the next step");
                break;
            }
            Err(e) => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "plans")
                    .increment(1);
                tracing::warn!(%host, "plan not written: {e}");
            }
        }
    }
    for (id, mut status) in statuses {
        if view
            .statuses
            .get(&id)
            .is_some_and(|old| same_status(old, &status))
        {
            continue;
        }
        status.updated_at = now;
        let started = Instant::now();
        let expected = view.status_revisions.get(&id).copied();
        match bus
            .put_expecting(&bus.status, id.as_str(), &status, expected)
            .await
        {
            Ok(rev) => {
                metrics::counter!("converge_allocator_status_writes_total").increment(1);
                view.status_revisions.insert(id.clone(), rev);
                view.statuses.insert(id, status);
            }
            Err(e @ converge_bus::BusError::Conflict { .. }) => {
                metrics::counter!("converge_allocator_write_conflicts_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "{e}: another allocator wrote it; re-reading before the next step");
                view.reread = true;
            }
            Err(e) if started.elapsed() >= SLOW_WRITE => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "status not written: {e}; the others wait for the next step");
                break;
            }
            Err(e) => {
                metrics::counter!("converge_allocator_write_failures_total", "bucket" => "status")
                    .increment(1);
                tracing::warn!(job = %id, "status not written: {e}");
            }
        }
    }
}

/// A queue status stored at most this long ago is rewritten only when more than its usage
/// changed: the usage between two writes follows exactly from the stored one (the queue held
/// the same GPUs since), so skipping writes loses nothing; this bounds how stale the usage
/// `converge queue list` shows can get.
pub const QUEUE_STATUS_REFRESH_S: f64 = 60.0;

/// Whether `new` says more than `old` beyond the usage's natural growth and decay.
fn queue_status_changed(old: &QueueStatus, new: &QueueStatus) -> bool {
    let mut same = new.clone();
    same.usage_gpu_seconds = old.usage_gpu_seconds;
    same.updated_at = old.updated_at;
    same != *old || new.updated_at - old.updated_at >= QUEUE_STATUS_REFRESH_S
}

/// Writes the queue statuses that changed ([`queue_status_changed`]); leader only.
async fn write_queue_statuses(
    bus: &Bus,
    buckets: &converge_bus::QueueBuckets,
    view: &mut View,
    statuses: BTreeMap<QueueId, QueueStatus>,
) {
    for (name, status) in statuses {
        if view
            .queue_statuses
            .get(&name)
            .is_some_and(|old| !queue_status_changed(old, &status))
        {
            continue;
        }
        match bus.put(&buckets.status, name.as_str(), &status).await {
            Ok(_) => {
                view.queue_statuses.insert(name, status);
            }
            Err(e) => tracing::warn!(queue = %name, "queue status not written: {e}"),
        }
    }
}

/// Re-reads the queue statuses in KV (when this replica becomes the leader).
async fn reload_queue_statuses(
    bus: &Bus,
    buckets: &converge_bus::QueueBuckets,
    view: &mut View,
    rejects: &Rejects,
) {
    match bus.load_all::<QueueStatus>(&buckets.status, rejects).await {
        Ok(all) => {
            view.queue_statuses = all
                .into_iter()
                .filter(|(k, (s, _))| s.queue.as_str() == k)
                .map(|(_, (s, _))| (s.queue.clone(), s))
                .collect();
        }
        Err(e) => tracing::warn!("cannot re-read queue statuses: {e}"),
    }
}

/// Follows KV `converge-queues`: current values first, then updates.
async fn watch_queues(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_QUEUES);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let name = QueueId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::QueueDeleted(name));
            }
            let spec: QueueSpec = rejects.decode(&source, name.as_str(), &entry.value)?;
            (spec.name == name).then_some(Input::Queue(spec))
        },
        || None,
    )
    .await
}

/// Follows KV `converge-queue-status` (the leader's own writes come back and change nothing).
async fn watch_queue_statuses(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_QUEUE_STATUS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let name = QueueId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::QueueStatusDeleted(name));
            }
            let s: QueueStatus = rejects.decode(&source, name.as_str(), &entry.value)?;
            (s.queue == name).then(|| Input::QueueStatus(Box::new(s)))
        },
        || None,
    )
    .await
}

async fn publish_event(bus: &Bus, e: &Event) {
    let subject = match &e.kind {
        EventKind::JobSubmitted { job }
        | EventKind::AllocationChanged { job, .. }
        | EventKind::JobFinished { job, .. }
        | EventKind::WorkerStarted { job, .. }
        | EventKind::WorkerExited { job, .. }
        | EventKind::WorkerFailed { job, .. } => subjects::job_events(job),
        EventKind::HostLost { host } => subjects::host_events(host),
        EventKind::PlanApplied { .. } => return,
    };
    if let Err(err) = bus.publish(subject, e).await {
        tracing::debug!("event not published: {err}");
    }
}

/// Follows KV `converge-jobs`: current values first, then updates.
async fn watch_jobs(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_JOBS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let Ok(id) = JobId::new(entry.key.clone()) else {
                tracing::warn!(key = %entry.key, "job key is not a valid job id; ignored");
                return None;
            };
            if entry.operation != kv::Operation::Put {
                return Some(Input::SpecDeleted(id));
            }
            let spec = match decode::<JobSpec>(&entry.value) {
                Ok(spec) if spec.id == id => Ok(spec),
                Ok(spec) => Err(format!("spec id {} differs from its key {id}", spec.id)),
                Err(e) => {
                    rejects.record(&source, id.as_str(), &e);
                    Err(e.to_string())
                }
            };
            Some(Input::Spec(id, spec))
        },
        || None,
    )
    .await
}

/// Follows KV `converge-hosts` (heartbeats). A heartbeat's `time` becomes the time the
/// NATS server stored it ([`received_at`]): liveness is judged by when the heartbeat
/// arrived, never by the agent's clock (a clock behind by more than the host timeout would
/// mark an honest host lost, one ahead would keep a dead host live).
async fn watch_hosts(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_HOSTS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let id = HostId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::HostDeleted(id));
            }
            let mut t: HostTelemetry = rejects.decode(&source, id.as_str(), &entry.value)?;
            if t.host != id {
                return None;
            }
            let sent = t.time;
            t.time = received_at(&entry);
            if (t.time - sent).abs() > CLOCK_SKEW_WARNING_S {
                tracing::debug!(
                    host = %id,
                    skew_s = sent - t.time,
                    "heartbeat time differs from its arrival; liveness follows the arrival"
                );
            }
            Some(Input::Host(t))
        },
        || None,
    )
    .await
}

/// Skew between an agent's clock and the NATS server's worth a debug line.
const CLOCK_SKEW_WARNING_S: f64 = 5.0;

/// When the NATS server stored a KV entry, UNIX seconds (the server's clock: the same for
/// every agent, and kept across allocator restarts, unlike a local receipt time).
fn received_at(entry: &kv::Entry) -> f64 {
    entry.created.unix_timestamp_nanos() as f64 / 1e9
}

/// Follows KV `converge-job-status`: the placements of every job's generations, whoever
/// wrote them (the leader's own writes come back too and change nothing).
async fn watch_statuses(store: kv::Store, tx: mpsc::Sender<Input>, rejects: Arc<Rejects>) {
    let source = format!("kv:{}", subjects::BUCKET_JOB_STATUS);
    converge_bus::follow_kv(
        store,
        tx,
        |entry| {
            let id = JobId::new(entry.key.clone()).ok()?;
            if entry.operation != kv::Operation::Put {
                return Some(Input::StatusDeleted(id));
            }
            let s: JobStatus = rejects.decode(&source, id.as_str(), &entry.value)?;
            (s.job == id).then(|| Input::Status(Box::new(s)))
        },
        || None,
    )
    .await
}

/// Deletes the progress reports the leader refused for good ([`crate::reporters::Refusal`]'s
/// `certain`) from the stream, so that no later replay and no reader of the stream sees them.
/// Hands a refused report's sequence to [`delete_refused`]; when its queue is full (a flood
/// faster than deletions), the report stays in the stream until its bounds evict it, and
/// that is counted (`converge_allocator_refused_kept_total`).
fn queue_deletion(refused_tx: &mpsc::Sender<u64>, seq: u64) {
    if refused_tx.try_send(seq).is_err() {
        metrics::counter!("converge_allocator_refused_kept_total").increment(1);
    }
}

async fn delete_refused(js: jetstream::Context, mut rx: mpsc::Receiver<u64>) {
    let mut stream = None;
    while let Some(seq) = rx.recv().await {
        if stream.is_none() {
            stream = js.get_stream(subjects::PROGRESS_STREAM).await.ok();
        }
        let Some(s) = &stream else { continue };
        match s.delete_message(seq).await {
            Ok(_) => tracing::debug!(seq, "refused progress report deleted from the stream"),
            Err(e) => tracing::debug!(seq, "refused progress report not deleted: {e}"),
        }
    }
}

/// Reads the progress stream from its start (the histories), signals when it has caught up
/// with what was there at start, then follows new reports. After an error, or when the
/// client reconnects to NATS (a restarted server has lost the consumer, which the client
/// would only notice after 15 s without heartbeats), it goes on from the report after the
/// last one it read; until a consumer works again (creating one needs JetStream's meta
/// leader, which a cluster that lost a server may be electing), it reads the new reports
/// directly ([`converge_bus::read_after`]).
async fn follow_progress(
    client: async_nats::Client,
    js: jetstream::Context,
    tx: mpsc::Sender<Input>,
    rejects: Arc<Rejects>,
) {
    let mut at = ProgressPosition::default();
    let mut failures = 0u32;
    loop {
        match follow_progress_once(&client, &js, &tx, &rejects, &mut at).await {
            Ok(()) => {
                failures = 0;
                tracing::info!(after = at.last_seq, "progress stream: following again")
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(
                    "progress stream: {e}; following again after report {} (attempt {failures})",
                    at.last_seq
                )
            }
        }
        if tx.is_closed() {
            return;
        }
        // The pause before the next attempt, reading directly meanwhile.
        let pause = Duration::from_millis(500 * u64::from(failures.clamp(1, 6)));
        if read_directly_during(tokio::time::sleep(pause), &tx, &rejects, &mut at)
            .await
            .is_none()
        {
            return;
        }
    }
}

/// Runs `work` to its end while reading new reports directly every half
/// [`PROGRESS_QUIET`] (once caught up with the stream's start and the stream is known): a
/// consumer being created (bounded, but seconds while a cluster elects its meta leader) or
/// a pause between attempts holds up no report. `None` once `tx` is closed.
async fn read_directly_during<F: Future>(
    work: F,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(PROGRESS_QUIET / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            out = &mut work => return Some(out),
            _ = tick.tick() => {
                if !at.caught_up {
                    continue;
                }
                let Some(stream) = at.stream.clone() else { continue };
                if let Err(e) = forward_direct(&stream, tx, rejects, at).await {
                    if tx.is_closed() {
                        return None;
                    }
                    tracing::debug!("progress stream: {e}");
                }
            }
        }
    }
}

/// Where [`follow_progress`] is in the progress stream.
#[derive(Default)]
struct ProgressPosition {
    /// The stream, once looked up (a lookup needs its leader; reading directly does not).
    stream: Option<jetstream::stream::Stream>,
    /// The last report read (0: none).
    last_seq: u64,
    /// Whether the reports that were in the stream at the first start have been read.
    caught_up: bool,
    /// The stream's last report when the current consumer was created.
    last_at_start: u64,
}

/// Sends the report stored as `seq` (unless already read) and moves `at` past it; sends
/// [`Input::ProgressCaughtUp`] once, with the last report that was in the stream at start.
async fn forward_report(
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
    (subject, payload, seq, stored_at): (&str, &[u8], u64, Option<f64>),
) -> anyhow::Result<()> {
    if seq != 0 && seq <= at.last_seq {
        return Ok(()); // already read (before a reconnect, or directly)
    }
    if let Some(report) = rejects.decode::<ProgressReport>(subject, "", payload) {
        // Checked against the job's placement by the receiver (`Reporters::check`).
        let progress = Progress {
            report,
            subject: subject.to_string(),
            seq,
            stored_at,
            replay: !at.caught_up,
        };
        tx.send(Input::Progress(Box::new(progress))).await?;
    } else if seq != 0 {
        // Malformed, another protocol version, too large: deleted by the leader too, so a
        // flood of garbage neither stays in the stream nor is replayed after a restart.
        tx.send(Input::Undecodable(seq)).await?;
    }
    at.last_seq = at.last_seq.max(seq);
    if !at.caught_up && seq >= at.last_at_start {
        tx.send(Input::ProgressCaughtUp).await?;
        at.caught_up = true;
    }
    Ok(())
}

/// Reads the reports after `at.last_seq` directly (any replica answers; no consumer) and
/// forwards them; returns how many.
async fn forward_direct(
    stream: &jetstream::stream::Stream,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> anyhow::Result<usize> {
    let messages = converge_bus::read_after(
        stream,
        subjects::PROGRESS_ALL,
        at.last_seq,
        1000,
        PROGRESS_QUIET,
    )
    .await
    .map_err(|e| anyhow::anyhow!("direct read: {e}"))?;
    let n = messages.len();
    for msg in messages {
        let stored_at = msg.time.unix_timestamp_nanos() as f64 / 1e9;
        let report = (
            msg.subject.as_str(),
            &msg.payload[..],
            msg.sequence,
            Some(stored_at),
        );
        forward_report(tx, rejects, at, report).await?;
    }
    Ok(n)
}

/// How long the progress consumer may be quiet before newer reports are read directly
/// (then every 500 ms while it stays quiet; also the bound on each direct read).
const PROGRESS_QUIET: Duration = Duration::from_secs(1);

/// How long the progress consumer may leave a report read directly undelivered before
/// [`follow_progress_once`] re-creates it; creating it is bounded to twice this.
const PROGRESS_STALL: Duration = Duration::from_secs(3);

/// Follows the progress stream from `at.last_seq + 1` until the consumer ends or the client
/// reconnects (`Ok`) or stalls (`Err`), updating `at`.
async fn follow_progress_once(
    client: &async_nats::Client,
    js: &jetstream::Context,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> anyhow::Result<()> {
    let deliver_policy = if at.last_seq == 0 {
        jetstream::consumer::DeliverPolicy::All
    } else {
        jetstream::consumer::DeliverPolicy::ByStartSequence {
            start_sequence: at.last_seq + 1,
        }
    };
    // Bounded: on a cluster electing its meta leader, creating a consumer can hang for as
    // long as the election (and longer when it lands on a dead server).
    let setup = async {
        let mut stream = js.get_stream(subjects::PROGRESS_STREAM).await?;
        let last_at_start = stream.info().await?.state.last_sequence;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: subjects::PROGRESS_ALL.to_string(),
                deliver_policy,
                ..Default::default()
            })
            .await?;
        let messages = consumer.messages().await?;
        anyhow::Ok((stream, last_at_start, messages))
    };
    // (Reports are read directly meanwhile, from the last one read: the consumer's first
    // deliveries of those are skipped.)
    let bounded = tokio::time::timeout(PROGRESS_STALL * 2, setup);
    let (stream, last_at_start, mut messages) = read_directly_during(bounded, tx, rejects, at)
        .await
        .ok_or_else(|| anyhow::anyhow!("the allocator's loop has stopped"))?
        .map_err(|_| {
            anyhow::anyhow!(
                "creating its consumer timed out after {:?}",
                PROGRESS_STALL * 2
            )
        })??;
    at.stream = Some(stream.clone());
    if !at.caught_up {
        at.last_at_start = last_at_start;
        if last_at_start <= at.last_seq {
            tx.send(Input::ProgressCaughtUp).await?;
            at.caught_up = true;
        }
    }
    let mut state_tick = tokio::time::interval(Duration::from_millis(500));
    let mut was_connected = true;
    // On a NATS cluster the consumer lives on one server, which may die while this client
    // stays connected to another (or end up on a replica that no longer catches up): when
    // it is quiet for PROGRESS_QUIET, newer reports are read directly, and when it still
    // has not delivered one of those PROGRESS_STALL later, it is re-created (from the next
    // report). Before the first catch-up (a replay) it is re-created after 3 stall periods.
    let mut last_delivery = tokio::time::Instant::now();
    let mut missed: Option<(u64, tokio::time::Instant)> = None;
    loop {
        let msg = tokio::select! {
            msg = messages.next() => match msg {
                Some(m) => m,
                None => return Ok(()),
            },
            _ = state_tick.tick() => {
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                if connected && !was_connected {
                    return Ok(());
                }
                was_connected = connected;
                if !connected || last_delivery.elapsed() < PROGRESS_QUIET {
                    continue;
                }
                if !at.caught_up {
                    if last_delivery.elapsed() >= PROGRESS_STALL * 3 {
                        anyhow::bail!(
                            "consumer stalled while replaying: nothing arrived for {:?} after \
                             report {} (the stream held {} at start)",
                            last_delivery.elapsed(),
                            at.last_seq,
                            at.last_at_start
                        );
                    }
                    continue;
                }
                let before = at.last_seq;
                if let Err(e) = forward_direct(&stream, tx, rejects, at).await {
                    if tx.is_closed() {
                        return Err(e);
                    }
                    tracing::debug!("progress stream: {e}");
                }
                if at.last_seq > before && missed.is_none() {
                    missed = Some((at.last_seq, tokio::time::Instant::now()));
                }
                if let Some((seq, since)) = missed
                    && since.elapsed() >= PROGRESS_STALL
                {
                    anyhow::bail!(
                        "consumer stalled: report {seq} was read directly, the consumer \
                         delivered nothing for {:?} (its server may be gone)",
                        last_delivery.elapsed()
                    );
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("progress consumer: {e}");
                continue;
            }
        };
        last_delivery = tokio::time::Instant::now();
        let info = msg.info().ok();
        let seq = info.as_ref().map_or(0, |i| i.stream_sequence);
        let stored_at = info.map(|i| i.published.unix_timestamp_nanos() as f64 / 1e9);
        if missed.is_some_and(|(s, _)| seq >= s) {
            missed = None;
        }
        forward_report(
            tx,
            rejects,
            at,
            (msg.subject.as_str(), &msg.payload[..], seq, stored_at),
        )
        .await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::{JobPhase, WorkerAssignment};

    #[test]
    fn a_queue_status_is_rewritten_when_more_than_its_usage_changed_or_once_a_minute() {
        let old = QueueStatus {
            protocol: converge_common::PROTOCOL_VERSION,
            queue: "team-a".parse().unwrap(),
            gpus_in_use: 4,
            borrowed_gpus: 0,
            lent_gpus: 0,
            fair_share_gpus: 4.0,
            usage_gpu_seconds: 100.0,
            half_life_s: 3600.0,
            running_jobs: 1,
            pending_jobs: 0,
            updated_at: 1000.0,
        };
        let later = QueueStatus {
            usage_gpu_seconds: 140.0,
            updated_at: 1010.0,
            ..old.clone()
        };
        assert!(!queue_status_changed(&old, &later));
        let grown = QueueStatus {
            gpus_in_use: 6,
            borrowed_gpus: 2,
            ..later.clone()
        };
        assert!(queue_status_changed(&old, &grown));
        let stale = QueueStatus {
            updated_at: 1000.0 + QUEUE_STATUS_REFRESH_S,
            ..later
        };
        assert!(queue_status_changed(&old, &stale));
    }

    #[test]
    fn the_usage_half_life_defaults_to_an_hour_and_refuses_zero() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            cfg: AllocatorConfig,
        }
        let cli = Cli::try_parse_from(["converge-allocator"]).unwrap();
        assert_eq!(cli.cfg.usage_half_life, Duration::from_secs(3600));
        assert_eq!(cli.cfg.settings().usage_half_life_s, 3600.0);
        let cli = Cli::try_parse_from(["converge-allocator", "--usage-half-life", "20m"]).unwrap();
        assert_eq!(cli.cfg.settings().usage_half_life_s, 1200.0);
        assert!(Cli::try_parse_from(["converge-allocator", "--usage-half-life", "0s"]).is_err());
    }

    #[test]
    fn a_planned_generation_without_its_status_is_never_issued_again() {
        let assignment = |job: &str, generation: u64| -> WorkerAssignment {
            serde_json::from_value(serde_json::json!({
                "job": job, "generation": generation, "rank": 0, "world_size": 1,
                "local_rank": 0, "local_world_size": 1, "gpus": [0],
                "master_addr": "127.0.0.1", "master_port": 20000, "command": ["t"],
                "env": {}, "max_restarts": 1
            }))
            .unwrap()
        };
        let plan = |host: &str, workers: Vec<WorkerAssignment>| HostPlan {
            protocol: converge_common::PROTOCOL_VERSION,
            host: HostId::new(host).unwrap(),
            workers,
        };
        // Job a: status at 3 (the helper's), plans at 4 on one host and 3 on another (the
        // crash came between the two plan writes); job b: plans and status agree.
        let statuses: BTreeMap<JobId, JobStatus> = ["a", "b"]
            .into_iter()
            .map(|j| (JobId::new(j).unwrap(), status(j, JobPhase::Running, None)))
            .collect();
        let plans: BTreeMap<HostId, HostPlan> = [
            plan("n1", vec![assignment("a", 4), assignment("b", 3)]),
            plan("n2", vec![assignment("a", 3)]),
        ]
        .into_iter()
        .map(|p| (p.host.clone(), p))
        .collect();
        let fixed = unissued_generations(&statuses, &plans);
        assert_eq!(fixed.len(), 1, "{fixed:?}");
        assert_eq!((fixed[0].job.as_str(), fixed[0].generation), ("a", 5));
        let unchanged = JobStatus {
            generation: 3,
            ..fixed[0].clone()
        };
        assert_eq!(
            unchanged,
            statuses[&JobId::new("a").unwrap()],
            "only the generation"
        );
        // A plan of a job without a status (deleted) changes nothing.
        let orphan: BTreeMap<HostId, HostPlan> = [(
            HostId::new("n3").unwrap(),
            plan("n3", vec![assignment("c", 9)]),
        )]
        .into();
        assert!(unissued_generations(&statuses, &orphan).is_empty());
    }

    fn status(job: &str, phase: JobPhase, loss: Option<f64>) -> JobStatus {
        let mut s: JobStatus = serde_json::from_value(serde_json::json!({
            "job": job, "phase": "pending", "generation": 3, "world_size": 2,
            "placement": [], "step": 10, "samples": 100, "submitted_at": 1.0, "updated_at": 2.0
        }))
        .unwrap();
        s.phase = phase;
        s.loss = loss;
        s
    }

    fn report(generation: u64, host: &str, samples: u64, loss: f64) -> ProgressReport {
        serde_json::from_value(serde_json::json!({
            "protocol": 1, "job": "j", "generation": generation, "rank": 0, "host": host,
            "step": samples / 10, "samples": samples, "loss": loss, "time": samples as f64
        }))
        .unwrap()
    }

    fn progress(r: ProgressReport, seq: u64) -> Box<Progress> {
        Box::new(Progress {
            subject: subjects::progress(&r.job, &r.host),
            report: r,
            seq,
            stored_at: None,
            replay: false,
        })
    }

    #[test]
    fn a_forged_report_is_counted_and_leaves_history_and_fit_unchanged() {
        let mut view = View::default();
        let mut placed = status("j", JobPhase::Running, None);
        placed.generation = 1;
        placed.placement = vec![
            serde_json::from_value(serde_json::json!({"rank": 0, "host": "n2", "gpus": [0]}))
                .unwrap(),
        ];
        view.reporters.note(&placed);
        let rejects = Rejects::default();
        let mut due = false;
        for i in 1..=30u64 {
            let r = report(1, "n2", i * 100, 2.0 / (1.0 + i as f64) + 0.1);
            assert_eq!(
                ingest(&mut view, progress(r, i), &rejects, &mut due, true),
                None
            );
        }
        let job: JobId = "j".parse().unwrap();
        let before = view.histories[&job].clone();
        let fit = |h: &JobHistory| {
            converge_sched::fit::fit_loss_curve(&h.loss_points(), &Default::default())
                .map(|c| format!("{c:?}"))
        };
        let fit_before = fit(&before);
        assert!(fit_before.is_some());
        // n1 runs nothing of the job: its reports, on its own subject, go nowhere; so does
        // one of n2's for a generation not placed yet, and one on a subject naming n1.
        let forged = [
            (report(1, "n1", 1_000_000, 1e-6), None),
            (report(2, "n2", 1_000_000, 1e-6), None),
            (
                report(1, "n2", 1_000_000, 1e-6),
                Some(subjects::progress(&job, &"n1".parse().unwrap())),
            ),
        ];
        for (seq, (r, subject)) in forged.into_iter().enumerate() {
            let mut p = progress(r, 100 + seq as u64);
            if let Some(subject) = subject {
                p.subject = subject;
            }
            let deleted = ingest(&mut view, p, &rejects, &mut due, true);
            assert_eq!(deleted, Some(100 + seq as u64), "refused for good");
        }
        assert_eq!(view.histories[&job], before);
        assert_eq!(fit(&view.histories[&job]), fit_before);
        assert_eq!(
            rejects.by_kind().into_iter().collect::<Vec<_>>(),
            [("not_placed", 2), ("wrong_subject", 1)]
        );
    }

    #[test]
    fn only_active_jobs_carry_series_and_missing_figures_have_none() {
        let mut statuses: BTreeMap<JobId, JobStatus> = BTreeMap::new();
        for (id, phase, loss) in [
            ("run", JobPhase::Running, Some(0.5)),
            ("wait", JobPhase::Pending, None),
            ("done", JobPhase::Completed, Some(0.1)),
            ("bad", JobPhase::Failed, Some(0.2)),
            ("gone", JobPhase::Cancelled, Some(0.3)),
        ] {
            statuses.insert(id.parse().unwrap(), status(id, phase, loss));
        }
        statuses
            .get_mut(&"run".parse().unwrap())
            .unwrap()
            .predicted_loss = Some(0.4);
        statuses
            .get_mut(&"run".parse().unwrap())
            .unwrap()
            .samples_per_s = Some(250.0);
        let text = converge_bus::metrics::render_snapshots([&job_families(&statuses)]);
        for line in [
            r#"converge_job_loss{job_id="run"} 0.5"#,
            r#"converge_job_predicted_loss{job_id="run"} 0.4"#,
            r#"converge_job_samples_per_second{job_id="run"} 250"#,
            r#"converge_job_workers{job_id="run"} 2"#,
            r#"converge_job_workers{job_id="wait"} 2"#,
            r#"converge_job_generation{job_id="run"} 3"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
        assert!(!text.contains(r#"converge_job_loss{job="wait"}"#), "{text}");
        for finished in ["done", "bad", "gone"] {
            assert!(!text.contains(&format!("job=\"{finished}\"")), "{text}");
        }
        // The job finishes: its series are gone from the next snapshot.
        statuses.get_mut(&"run".parse().unwrap()).unwrap().phase = JobPhase::Completed;
        let text = converge_bus::metrics::render_snapshots([&job_families(&statuses)]);
        assert!(!text.contains(r#"job="run""#), "{text}");
    }
}
