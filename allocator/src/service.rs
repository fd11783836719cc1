//! The allocator service: the I/O shell around [`converge_sched::schedule::step`]. It rebuilds its
//! view (job specs and statuses, host telemetry, progress histories) from NATS on start,
//! follows updates, runs a step on every trigger and writes only the statuses and plans
//! that changed. It keeps no local state: kill it at any time and start it anywhere.

use crate::followers::{Input, follow_buckets};
use crate::progress::{Progress, delete_refused, follow_progress, queue_deletion};
use crate::reporters::Reporters;
use crate::service_metrics::{
    REFUSAL_KINDS, describe_metrics, job_families, record_changes, record_job_phases,
};
use crate::writes::{
    publish_event, reload_queue_statuses, reload_written, write_changes, write_queue_statuses,
    write_unissued_generations,
};
use converge_bus::{Bus, KvChange, Rejects, unix_now};
use converge_common::{
    EventKind, HostId, HostPlan, HostTelemetry, JobId, JobSpec, JobStatus, QueueId, QueueSpec,
    QueueStatus,
};
use converge_sched::fit_cache::FitCache;
use converge_sched::history::JobHistory;
use converge_sched::schedule::{Inputs, step};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use crate::config::{AllocatorConfig, default_replica_id};
pub use crate::writes::QUEUE_STATUS_REFRESH_S;

/// Shortest time between two steps: bursts of updates are folded into one step.
pub const STEP_SPACING: Duration = Duration::from_millis(200);
/// How often the lifecycle (completions, restarts, host timeouts) is checked without updates.
pub const LIFECYCLE_TICK: Duration = Duration::from_secs(1);
/// How long the start may read what NATS stores (progress history, specs, heartbeats)
/// before a warning says what it still waits for.
const START_WARNING: Duration = Duration::from_secs(30);

/// The allocator's view, rebuilt from NATS.
#[derive(Debug, Default)]
pub(crate) struct View {
    pub(crate) specs: BTreeMap<JobId, JobSpec>,
    pub(crate) refused: BTreeMap<JobId, String>,
    pub(crate) statuses: BTreeMap<JobId, JobStatus>,
    pub(crate) hosts: BTreeMap<HostId, HostTelemetry>,
    pub(crate) histories: BTreeMap<JobId, JobHistory>,
    /// The fits of earlier steps (curves, throughput models): derived from the histories,
    /// rebuilt after a restart by the first step's refits.
    pub(crate) fits: FitCache,
    /// The plans as stored in KV (to write only what changes).
    pub(crate) plans: BTreeMap<HostId, HostPlan>,
    /// The KV revision of each plan and status as this replica last read or wrote it:
    /// writes are compare-and-set on it ([`Bus::put_expecting`]), so a write based on an
    /// outdated view (a replaced leader's late write) fails instead of overwriting.
    pub(crate) plan_revisions: BTreeMap<HostId, u64>,
    pub(crate) status_revisions: BTreeMap<JobId, u64>,
    /// A compare-and-set write failed (re-read after the step's writes), or another
    /// writer's plan or status was seen while leading (re-read before the next step).
    pub(crate) reread: bool,
    /// Whether this replica leads (holds a valid lease and has read what it writes, as of
    /// the input being applied): only then are plans and statuses it did not write another
    /// writer's.
    pub(crate) leading: bool,
    /// The hosts of each job's current and previous generation: who may report progress.
    pub(crate) reporters: Reporters,
    /// The queues (KV `converge-queues`).
    pub(crate) queues: BTreeMap<QueueId, QueueSpec>,
    /// Each queue's status as last stored (KV `converge-queue-status`): the decayed usage
    /// the next step continues from.
    pub(crate) queue_statuses: BTreeMap<QueueId, QueueStatus>,
    /// Shadow jobs' latest sync figures, from the progress reports (for their statuses).
    pub(crate) shadow: crate::shadow::ShadowFigures,
    /// Whether the specs and the heartbeats stored at start have all been delivered (their
    /// followers' [`KvChange::CaughtUp`]). No step runs before: a step that ran with the
    /// progress history rebuilt but no heartbeat read yet would take every host for lost
    /// and restart every job (seen after an allocator restart), one without the specs
    /// would know no job.
    pub(crate) specs_read: bool,
    pub(crate) hosts_read: bool,
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

    // Rebuild the view from NATS. The progress stream's end first: every report up to it
    // that the replay could accept is of a job in the statuses or plans read next.
    let history_end = crate::progress::last_sequence(&bus.js).await;
    let mut view = View::default();
    crate::writes::read_statuses(&bus, &mut view, &rejects).await?;
    crate::writes::read_plans(&bus, &mut view, &rejects).await?;
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
    follow_buckets(&mut tasks, &bus, &queue_buckets, &ctl_tx, &rejects);
    // Reports the leader refused for good are deleted from the stream (bounded queue; a
    // report not deleted is refused again when read again).
    let (refused_tx, refused_rx) = mpsc::channel::<u64>(1_024);
    tasks.spawn(delete_refused(bus.js.clone(), refused_rx));
    let placed: BTreeSet<JobId> = (view.statuses.keys().cloned())
        .chain(
            view.plans
                .values()
                .flat_map(|p| p.workers.iter().map(|w| w.job.clone())),
        )
        .collect();
    tasks.spawn(follow_progress(
        bus.client.clone(),
        bus.js.clone(),
        tx.clone(),
        rejects.clone(),
        crate::progress::replay_filter(history_end, placed),
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
    let started = Instant::now();
    let mut start_warned = false;

    loop {
        let spacing = STEP_SPACING.saturating_sub(last_step.elapsed());
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            input = ctl_rx.recv(), if !ctl_rx.is_closed() || !ctl_rx.is_empty() => {
                let Some(input) = input else { continue };
                view.leading = leading && leadership.borrow().is_valid();
                apply(&mut view, input, &mut policy_due, &mut lifecycle_due, caught_up);
            }
            changed = leadership.changed() => {
                if changed.is_err() { break; }
                let now_leading = leadership.borrow_and_update().is_valid();
                if now_leading && !leading {
                    // Another replica may have written since this one last read. Each read
                    // and write is bounded, but with NATS gone they add up: SIGTERM stops
                    // them (a new leader reads again).
                    let reload = async {
                        reload_written(&bus, &mut view, &rejects).await;
                        write_unissued_generations(&bus, &mut view).await;
                        reload_queue_statuses(&bus, &queue_buckets, &mut view, &rejects).await;
                    };
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break,
                        () = reload => {}
                    }
                    policy_due = true;
                    // The reads above can take seconds (a NATS cluster electing leaders):
                    // apply what the followers delivered meanwhile before any step, or the
                    // step would judge hosts by telemetry older than the host timeout:
                    // heartbeats, specs, statuses and plans first (their own channel),
                    // then progress reports.
                    view.leading = now_leading;
                    for _ in 0..ctl_rx.len() {
                        let Ok(input) = ctl_rx.try_recv() else { break };
                        apply(&mut view, input, &mut policy_due, &mut lifecycle_due, caught_up);
                    }
                    for _ in 0..rx.len() {
                        let Ok(input) = rx.try_recv() else { break };
                        let due = (&mut policy_due, &mut lifecycle_due);
                        if let Some(seq) = take(&mut view, input, &rejects, due, &mut caught_up) {
                            queue_deletion(&refused_tx, seq);
                        }
                    }
                }
                leading = now_leading;
                view.leading = leading;
            }
            input = rx.recv() => {
                let Some(input) = input else { break };
                // A lease that ran out since the last step: another replica may lead and
                // write now.
                view.leading = leading && leadership.borrow().is_valid();
                let due = (&mut policy_due, &mut lifecycle_due);
                if let Some(seq) = take(&mut view, input, &rejects, due, &mut caught_up)
                    && leadership.borrow().is_valid()
                {
                    queue_deletion(&refused_tx, seq);
                }
            }
            _ = scheduling.tick() => policy_due = true,
            _ = tick.tick() => {
                lifecycle_due = true;
                // A flood's last refusals, counted but not logged, get their line.
                rejects.log_unlogged();
            }
            _ = tokio::time::sleep(spacing), if (policy_due || lifecycle_due) && !spacing.is_zero() => {}
        }
        if !(caught_up && view.specs_read && view.hosts_read) {
            if !start_warned && started.elapsed() >= START_WARNING {
                start_warned = true;
                tracing::warn!(
                    progress_replayed = caught_up,
                    specs_read = view.specs_read,
                    heartbeats_read = view.hosts_read,
                    "no step yet: still reading what NATS stores (a step before would take \
                     unread hosts for lost); is the JetStream meta leader up?"
                );
            }
            continue;
        }
        if !(policy_due || lifecycle_due) || last_step.elapsed() < STEP_SPACING {
            continue;
        }
        if !leadership.borrow().is_valid() {
            // Followers keep their view current and wait; a leader whose lease ran out
            // stops writing until it renews.
            leading = false;
            view.leading = false;
            converge_bus::metrics::remove_snapshot(&job_series.0);
            continue;
        }
        if std::mem::take(&mut view.reread) {
            // Another writer's plan or status was seen: read what is stored before
            // deciding, so that this step writes over what differs (bounded reads; SIGTERM
            // stops them).
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                () = reload_written(&bus, &mut view, &rejects) => {}
            }
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
            // Bounded writes that add up with NATS gone: SIGTERM stops them (what is left
            // half written is what a crash between the writes leaves, which the next leader
            // reads back).
            let writes = async {
                write_changes(&bus, &mut view, outcome.statuses, outcome.plans, now).await;
                let reread = std::mem::take(&mut view.reread);
                if reread {
                    reload_written(&bus, &mut view, &rejects).await;
                }
                write_queue_statuses(&bus, &queue_buckets, &mut view, outcome.queue_statuses).await;
                reread
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                reread = writes => policy_due |= reread,
            }
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
    if !bus.flush_within(Duration::from_secs(1)).await {
        tracing::warn!("the last buffered messages did not reach NATS within 1 s; stopping anyway");
    }
    tracing::info!(refused_messages = rejects.total(), "allocator stopped");
    Ok(())
}

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

/// Applies one update to the view and says what it makes due.
fn apply(
    view: &mut View,
    input: Input,
    policy_due: &mut bool,
    lifecycle_due: &mut bool,
    caught_up: bool,
) {
    match input {
        Input::Spec(change) => match *change {
            KvChange::Put(id, spec) => {
                if view.specs.get(&id) != Some(&spec) {
                    *policy_due = true;
                }
                view.refused.remove(&id);
                view.specs.insert(id, spec);
            }
            KvChange::Refused { key: id, reason } => {
                view.specs.remove(&id);
                view.refused.insert(id, reason);
                *lifecycle_due = true;
            }
            KvChange::Deleted(id) => {
                view.specs.remove(&id);
                view.refused.remove(&id);
                *policy_due = true;
            }
            KvChange::CaughtUp => {
                if !std::mem::replace(&mut view.specs_read, true) {
                    tracing::info!(jobs = view.specs.len(), "job specs read");
                }
            }
            // A bad key (counted or logged by the decoder).
            KvChange::BadKey { .. } => {}
        },
        Input::Host(KvChange::Put(_, t)) => {
            view.hosts.insert(t.host.clone(), t);
            *lifecycle_due = true;
        }
        Input::Host(KvChange::Deleted(h)) => {
            view.hosts.remove(&h);
            *policy_due = true;
        }
        Input::Host(KvChange::CaughtUp) => {
            if !std::mem::replace(&mut view.hosts_read, true) {
                tracing::info!(hosts = view.hosts.len(), "heartbeats read");
            }
        }
        Input::Status(change, revision) => {
            if let Some(job) = change_key(&change)
                && newer_than_mine(view.leading, revision, view.status_revisions.get(job))
            {
                another_writer(view, "status", job.as_str(), revision, policy_due);
            }
            match *change {
                KvChange::Put(_, status) => view.reporters.note(&status),
                KvChange::Deleted(job) => view.reporters.forget(&job),
                _ => {}
            }
        }
        Input::Plan(change, revision) => {
            if let Some(host) = change_key(&change)
                && newer_than_mine(view.leading, revision, view.plan_revisions.get(host))
            {
                another_writer(view, "plans", host.as_str(), revision, policy_due);
            }
        }
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
        Input::Queue(KvChange::Put(_, spec)) => {
            if view.queues.get(&spec.name) != Some(&spec) {
                *policy_due = true;
            }
            view.queues.insert(spec.name.clone(), spec);
        }
        Input::Queue(KvChange::Deleted(name)) => {
            if view.queues.remove(&name).is_some() {
                *policy_due = true;
            }
        }
        Input::QueueStatus(change) => match *change {
            KvChange::Put(_, status) => {
                view.queue_statuses.insert(status.queue.clone(), status);
            }
            KvChange::Deleted(name) => {
                view.queue_statuses.remove(&name);
            }
            _ => {}
        },
        // Bad keys and refused values (counted or logged by the decoder, and the key's last
        // valid value kept), the end of a bucket's values at start.
        Input::Host(_) | Input::Queue(_) => {}
        Input::ProgressCaughtUp | Input::Undecodable(_) => {}
    }
}

/// The key of a KV change that names one (not a bad key, not the end of the values).
fn change_key<K, V>(change: &KvChange<K, V>) -> Option<&K> {
    match change {
        KvChange::Put(key, _) | KvChange::Deleted(key) | KvChange::Refused { key, .. } => Some(key),
        KvChange::BadKey { .. } | KvChange::CaughtUp => None,
    }
}

/// Whether an entry of `revision` is another writer's: this replica leads and the entry
/// is newer than the revision it last read or wrote of the key (`mine`; none for a key it
/// has neither read nor written). Its own writes come back at the revision it recorded,
/// their late echoes and what it read at takeover at older ones.
fn newer_than_mine(leading: bool, revision: u64, mine: Option<&u64>) -> bool {
    leading && revision > mine.copied().unwrap_or(0)
}

/// The leader saw an entry of a plan or status (`bucket`, `key`) newer than its own last
/// read or write of the key: a replaced leader's late write, which passes compare-and-set
/// on a key this leader has not written since it took over (its revision is still the one
/// both read), or another client's put, delete or undecodable value. Before, such a write
/// stuck while this leader's view said the key held its own value, so it never wrote it
/// again. Now it re-reads plans and statuses before its next step, which writes its own
/// value over what differs (compare-and-set on the revision just read). Counted in
/// `converge_allocator_foreign_writes_total`.
fn another_writer(
    view: &mut View,
    bucket: &'static str,
    key: &str,
    revision: u64,
    policy_due: &mut bool,
) {
    metrics::counter!("converge_allocator_foreign_writes_total", "bucket" => bucket).increment(1);
    tracing::warn!(
        bucket,
        key,
        revision,
        "a write this leader did not make (a replaced leader's late write?): re-reading, then writing over it"
    );
    view.reread = true;
    *policy_due = true;
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
    match view
        .reporters
        .check_stored(&p.subject, &p.report, p.replay, p.stored_at)
    {
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

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::status;
    use converge_common::{JobPhase, ProgressReport, subjects};

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
    fn a_refused_spec_refuses_the_job_and_other_refusals_change_nothing() {
        let mut view = View::default();
        let (mut policy, mut lifecycle) = (false, false);
        let a: JobId = "a".parse().unwrap();
        let refused = KvChange::Refused {
            key: a.clone(),
            reason: "spec id b differs from its key a".into(),
        };
        apply(
            &mut view,
            Input::Spec(Box::new(refused)),
            &mut policy,
            &mut lifecycle,
            true,
        );
        assert_eq!(view.refused[&a], "spec id b differs from its key a");
        assert!(lifecycle && !policy);
        let (mut policy, mut lifecycle) = (false, false);
        fn bad_key<K, V>() -> KvChange<K, V> {
            KvChange::BadKey {
                key: "x.y".into(),
                reason: "bad".into(),
            }
        }
        let host_refused = KvChange::Refused {
            key: "h1".parse().unwrap(),
            reason: "heartbeat of h2 stored under h1".into(),
        };
        for input in [
            Input::Host(host_refused),
            Input::Host(bad_key()),
            Input::Spec(Box::new(bad_key())),
            Input::Status(Box::new(bad_key()), 7),
            Input::Queue(bad_key()),
            Input::QueueStatus(Box::new(KvChange::CaughtUp)),
        ] {
            apply(&mut view, input, &mut policy, &mut lifecycle, true);
        }
        assert!(!policy && !lifecycle);
        assert!(view.hosts.is_empty() && view.queues.is_empty() && view.specs.is_empty());
        assert_eq!(view.refused.len(), 1);
    }

    #[test]
    fn an_entry_newer_than_the_leaders_own_makes_it_reread() {
        use converge_common::{HostPlan, PROTOCOL_VERSION};
        let host: HostId = "n1".parse().unwrap();
        let job: JobId = "j".parse().unwrap();
        let mine = HostPlan {
            protocol: PROTOCOL_VERSION,
            host: host.clone(),
            workers: Vec::new(),
        };
        let written = status("j", JobPhase::Running, None);
        let mut view = View::default();
        view.plans.insert(host.clone(), mine.clone());
        view.plan_revisions.insert(host.clone(), 10);
        view.statuses.insert(job.clone(), written.clone());
        view.status_revisions.insert(job.clone(), 12);
        let plan = |c: KvChange<HostId, HostPlan>, rev| Input::Plan(Box::new(c), rev);
        let status = |c: KvChange<JobId, JobStatus>, rev| Input::Status(Box::new(c), rev);
        let refused = || KvChange::Refused {
            key: job.clone(),
            reason: "not json".into(),
        };
        // (the input, whether it is another writer's while leading)
        let cases: Vec<(Box<dyn Fn() -> Input>, bool)> = vec![
            // Its own writes, at the revisions it recorded, and their late echoes.
            (
                Box::new(|| plan(KvChange::Put(host.clone(), mine.clone()), 10)),
                false,
            ),
            (
                Box::new(|| plan(KvChange::Put(host.clone(), mine.clone()), 9)),
                false,
            ),
            (
                Box::new(|| status(KvChange::Put(job.clone(), written.clone()), 12)),
                false,
            ),
            (
                Box::new(|| status(KvChange::Deleted(job.clone()), 3)),
                false,
            ),
            // Entries past them: a put (even of the same value), a delete, a value that
            // does not decode, a key it never wrote.
            (
                Box::new(|| plan(KvChange::Put(host.clone(), mine.clone()), 11)),
                true,
            ),
            (Box::new(|| plan(KvChange::Deleted(host.clone()), 11)), true),
            (
                Box::new(|| status(KvChange::Put(job.clone(), written.clone()), 13)),
                true,
            ),
            (Box::new(|| status(refused(), 13)), true),
            (
                Box::new(|| {
                    let other = "other".parse().unwrap();
                    status(KvChange::Put(other, written.clone()), 1)
                }),
                true,
            ),
            // Nothing to tell by: a bad key, the end of the values.
            (
                Box::new(|| {
                    status(
                        KvChange::BadKey {
                            key: "a.b".into(),
                            reason: "bad".into(),
                        },
                        99,
                    )
                }),
                false,
            ),
            (Box::new(|| plan(KvChange::CaughtUp, 0)), false),
        ];
        for (i, (input, foreign)) in cases.iter().enumerate() {
            for leading in [false, true] {
                view.leading = leading;
                view.reread = false;
                let (mut policy, mut lifecycle) = (false, false);
                apply(&mut view, input(), &mut policy, &mut lifecycle, true);
                assert_eq!(
                    view.reread,
                    leading && *foreign,
                    "case {i}, leading {leading}"
                );
                assert_eq!(policy, leading && *foreign, "case {i}, leading {leading}");
            }
        }
        // The view itself is left to the re-read.
        assert_eq!(view.plans[&host], mine);
        assert_eq!(view.statuses[&job], written);
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
}
