//! The dashboard's picture of the cluster, built from what it read off NATS: pure, so it is
//! tested without a browser. `GET /api/state` and every server-sent event carry one
//! [`State`] as JSON.
//!
//! Units: times in unix seconds, sizes in bytes, rates in bytes or samples per second, GPU
//! utilization in percent, quotas and shares in GPUs, queue usage in GPU-seconds. A host is *lost* when its latest telemetry is older than the
//! host timeout (the allocator's `--host-timeout`, 15 s by default): the allocator has taken
//! its GPUs out of the pool and its agent stops its workers (fencing).

use converge_bus::KvStore;
use converge_common::queues::PriorityClass;
use converge_common::{
    AllocationChange, HostId, HostTelemetry, JobBatch, JobEnd, JobId, JobPhase, JobSpec, JobStatus,
    QueueId, QueueSpec, QueueStatus, WorkerPhase,
};
use converge_sched::fit::Curve;
use converge_sched::outlook::{self, BandPoint};
use serde::Serialize;
use std::collections::BTreeMap;

/// Most loss points sent per job (evenly thinned beyond; the latest point is always kept).
pub const MAX_POINTS_SENT: usize = 240;

/// Points of the drawn fit and of the prediction ahead.
pub const CURVE_POINTS: usize = 40;

/// One rank-0 progress report, as the dashboard keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossPoint {
    pub time: f64,
    pub samples: f64,
    pub loss: f64,
    pub generation: u64,
}

/// Everything the dashboard has read.
#[derive(Debug, Default, Clone)]
pub struct Model {
    pub specs: KvStore<JobId, JobSpec>,
    pub statuses: KvStore<JobId, JobStatus>,
    pub hosts: KvStore<HostId, HostTelemetry>,
    /// Rank 0's reports per job, in stream order.
    pub points: BTreeMap<JobId, Vec<LossPoint>>,
    /// Stored queues (KV `converge-queues`), each under its own name.
    pub queues: KvStore<QueueId, QueueSpec>,
    /// The allocator's latest status of each queue (KV `converge-queue-status`).
    pub queue_statuses: KvStore<QueueId, QueueStatus>,
    /// Messages the dashboard could not read (malformed KV values or reports), by source.
    pub refused: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    pub version: u64,
    pub generated_at: f64,
    pub host_timeout_s: f64,
    pub cluster: ClusterSummary,
    pub hosts: Vec<HostView>,
    pub jobs: Vec<JobRow>,
    /// The queues, by name: every stored one, and the implicit `default` queue only when a
    /// job that has not ended is in it or the allocator published a status of it.
    pub queues: Vec<QueueView>,
    /// Messages the dashboard could not read.
    pub refused: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterSummary {
    pub gpus_total: u32,
    pub gpus_busy: u32,
    pub hosts_live: u32,
    pub hosts_lost: u32,
    pub jobs_by_phase: BTreeMap<&'static str, u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuView {
    pub index: u32,
    pub name: String,
    pub utilization_pct: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub power_w: Option<f64>,
    /// The job whose running worker holds it, if any.
    pub job: Option<JobId>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostView {
    pub host: HostId,
    pub addr: String,
    pub gpu_source: String,
    pub gpus_total: u32,
    /// GPUs with non-zero utilization (as `converge hosts` counts them).
    pub gpus_busy: u32,
    pub gpu_utilization_pct: f64,
    pub gpu_memory_used_bytes: u64,
    pub gpu_memory_total_bytes: u64,
    /// Sum over the host's NICs; `None` for a lost host (its last rates are stale).
    pub rx_bytes_per_s: Option<f64>,
    pub tx_bytes_per_s: Option<f64>,
    pub last_seen: f64,
    /// Seconds since the latest telemetry.
    pub age_s: f64,
    pub lost: bool,
    pub workers: u32,
    /// The host's labels (`gpu.model`, `gpu.memory`, `gpu.count` and its agent's own), which
    /// job selectors match.
    pub labels: BTreeMap<String, String>,
    pub gpus: Vec<GpuView>,
}

/// One queue (docs/scheduling.md, "Queues, fair share and priorities"): its settings, and
/// what the allocator last published of it (`None` until it has: no allocator running, or
/// the queue created since its last step).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueView {
    pub name: QueueId,
    /// The `default` queue nobody stored: its built-in values (quota 0, no borrowing limit,
    /// weight 1).
    pub implicit: bool,
    /// Nominal quota, GPUs: what the queue is guaranteed while its jobs need it.
    pub quota_gpus: u32,
    /// Most GPUs beyond the quota it may borrow; `None`: no limit.
    pub borrowing_limit_gpus: Option<u32>,
    /// Relative weight in the fair share of lent GPUs (no unit; 1 by default).
    pub weight: f64,
    /// Jobs the dashboard has read that name the queue and have not ended (not cancelled,
    /// no terminal status): the dashboard's own count, which the allocator's lags.
    pub active_jobs: u32,
    /// GPUs its running jobs hold.
    pub gpus_in_use: Option<u32>,
    /// Of those, GPUs beyond its quota (borrowed from other queues' idle quota).
    pub borrowed_gpus: Option<u32>,
    /// GPUs of its quota lent to other queues.
    pub lent_gpus: Option<u32>,
    /// GPUs the fair share gives it (fractional: before rounding to whole GPUs).
    pub fair_share_gpus: Option<f64>,
    /// Decayed usage, GPU-seconds, at `updated_at`; each term halves every `half_life_s`.
    pub usage_gpu_seconds: Option<f64>,
    /// Half-life of the usage decay, seconds.
    pub half_life_s: Option<f64>,
    /// Its jobs the allocator counted running and pending at its last step.
    pub running_jobs: Option<u32>,
    pub pending_jobs: Option<u32>,
    /// When the allocator computed the status, unix seconds.
    pub updated_at: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CurveView {
    pub family: String,
    pub rmse: f64,
    /// Rank 0's reports `(samples, loss)`, thinned to [`MAX_POINTS_SENT`].
    pub points: Vec<(f64, f64)>,
    /// Generations' first samples, to mark restarts on the curve.
    pub restarts: Vec<(f64, u64)>,
    /// The fitted curve over the history, `(samples, loss)`.
    pub fit: Vec<(f64, f64)>,
    /// The prediction ahead, with its p90 band (see `converge_sched::outlook`).
    pub ahead: Vec<BandPoint>,
    pub asymptote: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlacementView {
    pub rank: u32,
    pub host: HostId,
    pub gpus: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRow {
    pub job: JobId,
    pub phase: JobPhase,
    pub message: Option<String>,
    pub sweep: Option<JobId>,
    pub workers: u32,
    pub min_workers: u32,
    pub max_workers: Option<u32>,
    pub gpus_per_worker: u32,
    pub generation: u64,
    /// The queue it is scheduled in (its spec's `queue`, else `default`).
    pub queue: String,
    /// Its priority class within the queue (`low`, `normal`, `high`; from its spec).
    pub priority: PriorityClass,
    pub placement: Vec<PlacementView>,
    /// Labels a host must have to run the job (its spec's `[selector]`).
    pub selector: BTreeMap<String, String>,
    /// The GPU types the job may run on (its spec's `gpu_types`); `None`: any.
    pub gpu_types: Option<Vec<String>>,
    pub samples: u64,
    pub samples_per_s: Option<f64>,
    /// Shadow jobs: background sync rounds per second (absent for other jobs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_rounds_per_s: Option<f64>,
    /// Shadow jobs: relative distance between a worker's model and the synchronized one
    /// (0 to 2; absent for other jobs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_gap: Option<f64>,
    pub loss: Option<f64>,
    pub predicted_loss: Option<f64>,
    pub batch: Option<JobBatch>,
    pub end: Option<JobEnd>,
    pub submitted_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    /// 1-based position among pending jobs (submission order), pending jobs only.
    pub queue_position: Option<u32>,
    pub gpus_needed: Option<u32>,
    /// Estimated start of a pending job (see `converge_sched::outlook`).
    pub estimated_start: Option<f64>,
    /// Rank 0's progress reports the dashboard has read for the job.
    pub reports: usize,
    pub curve: Option<CurveView>,
    pub allocations: Vec<AllocationChange>,
}

fn phase_name(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Pending => "pending",
        JobPhase::Running => "running",
        JobPhase::Restarting => "restarting",
        JobPhase::Completed => "completed",
        JobPhase::Failed => "failed",
        JobPhase::Cancelled => "cancelled",
    }
}

/// Evenly thins `points` to at most `max`, keeping the first and the last.
pub fn thin<T: Copy>(points: &[T], max: usize) -> Vec<T> {
    if points.len() <= max || max < 2 {
        return points.to_vec();
    }
    let last = points.len() - 1;
    (0..max)
        .map(|i| points[(i * last + (max - 1) / 2) / (max - 1)])
        .collect()
}

/// The job's curve: its reports, the fit over them and, while the job is active, the
/// prediction ahead with its band (an ended job has no future to predict).
fn curve_view(status: &JobStatus, points: &[LossPoint]) -> Option<CurveView> {
    let wire = status.curve.as_ref()?;
    let curve = Curve::from_wire(wire)?;
    let first = points.first().map_or(0.0, |p| p.samples);
    let latest = points
        .iter()
        .map(|p| p.samples)
        .fold(status.samples as f64, f64::max);
    let mut o = outlook::curve_outlook(&curve, first, latest, CURVE_POINTS)?;
    if status.phase.is_terminal() {
        o.ahead.clear();
    }
    let mut restarts = Vec::new();
    for w in points.windows(2) {
        if w[1].generation != w[0].generation {
            restarts.push((w[1].samples, w[1].generation));
        }
    }
    Some(CurveView {
        family: wire.family.clone(),
        rmse: wire.rmse,
        points: thin(points, MAX_POINTS_SENT)
            .iter()
            .map(|p| (p.samples, p.loss))
            .collect(),
        restarts,
        fit: o.fit,
        ahead: o.ahead,
        asymptote: o.asymptote,
    })
}

fn host_view(t: &HostTelemetry, now: f64, host_timeout_s: f64) -> HostView {
    let mut holders: BTreeMap<u32, JobId> = BTreeMap::new();
    for w in &t.workers {
        if w.phase == WorkerPhase::Running {
            for g in &w.gpus {
                holders.insert(*g, w.job.clone());
            }
        }
    }
    let n = t.gpus.len().max(1) as f64;
    let age = (now - t.time).max(0.0);
    let lost = age > host_timeout_s;
    HostView {
        host: t.host.clone(),
        addr: t.addr.clone(),
        gpu_source: t.gpu_source.clone(),
        gpus_total: t.gpus.len() as u32,
        gpus_busy: t.gpus.iter().filter(|g| g.utilization_pct > 0.0).count() as u32,
        gpu_utilization_pct: t.gpus.iter().map(|g| g.utilization_pct).sum::<f64>() / n,
        gpu_memory_used_bytes: t.gpus.iter().map(|g| g.memory_used_bytes).sum(),
        gpu_memory_total_bytes: t.gpus.iter().map(|g| g.memory_total_bytes).sum(),
        rx_bytes_per_s: (!lost).then(|| t.nics.iter().map(|n| n.rx_bytes_per_s).sum()),
        tx_bytes_per_s: (!lost).then(|| t.nics.iter().map(|n| n.tx_bytes_per_s).sum()),
        last_seen: t.time,
        age_s: age,
        lost,
        workers: t.workers.iter().filter(|w| w.phase.is_alive()).count() as u32,
        labels: t.labels.clone(),
        gpus: t
            .gpus
            .iter()
            .map(|g| GpuView {
                index: g.index,
                name: g.name.clone(),
                utilization_pct: g.utilization_pct,
                memory_used_bytes: g.memory_used_bytes,
                memory_total_bytes: g.memory_total_bytes,
                power_w: g.power_mw.map(|mw| mw as f64 / 1e3),
                job: holders.get(&g.index).cloned(),
            })
            .collect(),
    }
}

/// The picture at `now`: hosts by id; jobs active first (running, restarting, then pending
/// in queue order), then ended ones, most recent first, at most `max_ended` of those.
pub fn build(
    model: &Model,
    version: u64,
    now: f64,
    host_timeout_s: f64,
    max_ended: usize,
) -> State {
    let hosts: Vec<HostView> = model
        .hosts
        .values()
        .map(|t| host_view(t, now, host_timeout_s))
        .collect();
    let live_gpus: u32 = hosts.iter().filter(|h| !h.lost).map(|h| h.gpus_total).sum();
    let queue: BTreeMap<JobId, outlook::QueueEntry> = outlook::queue_estimates(
        model.specs.as_map(),
        model.statuses.as_map(),
        live_gpus,
        now,
    )
    .into_iter()
    .map(|e| (e.job.clone(), e))
    .collect();
    let mut jobs: Vec<JobRow> = model
        .statuses
        .values()
        .filter_map(|s| {
            let spec = model.specs.get(&s.job)?;
            let points = model.points.get(&s.job).map_or(&[][..], Vec::as_slice);
            let q = queue.get(&s.job);
            Some(JobRow {
                job: s.job.clone(),
                phase: s.phase,
                message: s.message.clone(),
                sweep: spec.sweep.clone(),
                workers: s.world_size,
                min_workers: spec.min_workers,
                max_workers: spec.max_workers,
                gpus_per_worker: spec.gpus_per_worker,
                generation: s.generation,
                queue: spec.queue_name().to_string(),
                priority: spec.priority,
                placement: s
                    .placement
                    .iter()
                    .map(|p| PlacementView {
                        rank: p.rank,
                        host: p.host.clone(),
                        gpus: p.gpus.clone(),
                    })
                    .collect(),
                selector: spec.selector.clone(),
                gpu_types: spec.gpu_types.clone(),
                samples: s.samples,
                samples_per_s: s.samples_per_s,
                sync_rounds_per_s: s.sync_rounds_per_s,
                model_gap: s.model_gap,
                loss: s.loss,
                predicted_loss: s.predicted_loss,
                batch: s.batch.clone(),
                end: s.end.clone(),
                submitted_at: s.submitted_at,
                started_at: s.started_at,
                finished_at: s.finished_at,
                queue_position: q.map(|e| e.position),
                gpus_needed: q.map(|e| e.gpus_needed),
                estimated_start: q.and_then(|e| e.estimated_start),
                reports: points.len(),
                curve: curve_view(s, points),
                allocations: s.allocations.clone(),
            })
        })
        .collect();
    let rank = |j: &JobRow| match j.phase {
        JobPhase::Running => 0,
        JobPhase::Restarting => 1,
        JobPhase::Pending => 2,
        _ => 3,
    };
    jobs.sort_by(|a, b| {
        rank(a).cmp(&rank(b)).then_with(|| match rank(a) {
            2 => a.queue_position.cmp(&b.queue_position),
            3 => b
                .finished_at
                .unwrap_or(0.0)
                .total_cmp(&a.finished_at.unwrap_or(0.0)),
            _ => a.submitted_at.total_cmp(&b.submitted_at),
        })
    });
    let active = jobs.iter().filter(|j| rank(j) < 3).count();
    jobs.truncate(active + max_ended);
    let mut jobs_by_phase = BTreeMap::new();
    for s in model.statuses.values() {
        *jobs_by_phase.entry(phase_name(s.phase)).or_insert(0) += 1;
    }
    State {
        version,
        generated_at: now,
        host_timeout_s,
        cluster: ClusterSummary {
            gpus_total: live_gpus,
            gpus_busy: hosts.iter().filter(|h| !h.lost).map(|h| h.gpus_busy).sum(),
            hosts_live: hosts.iter().filter(|h| !h.lost).count() as u32,
            hosts_lost: hosts.iter().filter(|h| h.lost).count() as u32,
            jobs_by_phase,
        },
        hosts,
        jobs,
        queues: queue_views(model),
        refused: model.refused,
    }
}

/// The queues as `converge queue list` lists them ([`crate::queues::rows_of`]), the implicit
/// `default` queue left out while no job that has not ended is in it and the allocator has
/// published no status of it.
fn queue_views(model: &Model) -> Vec<QueueView> {
    let mut active: BTreeMap<&str, u32> = BTreeMap::new();
    for spec in model.specs.values() {
        let ended = spec.cancelled
            || model
                .statuses
                .get(&spec.id)
                .is_some_and(|s| s.phase.is_terminal());
        if !ended {
            *active.entry(spec.queue_name()).or_insert(0) += 1;
        }
    }
    crate::queues::rows_of(model.queues.values(), |name| model.queue_statuses.get(name))
        .into_iter()
        .map(|r| {
            let st = r.status.as_ref();
            QueueView {
                active_jobs: active.get(r.name.as_str()).copied().unwrap_or(0),
                implicit: r.implicit,
                quota_gpus: r.spec.quota_gpus,
                borrowing_limit_gpus: r.spec.borrowing_limit_gpus,
                weight: r.spec.weight,
                gpus_in_use: st.map(|s| s.gpus_in_use),
                borrowed_gpus: st.map(|s| s.borrowed_gpus),
                lent_gpus: st.map(|s| s.lent_gpus),
                fair_share_gpus: st.map(|s| s.fair_share_gpus),
                usage_gpu_seconds: st.map(|s| s.usage_gpu_seconds),
                half_life_s: st.map(|s| s.half_life_s),
                running_jobs: st.map(|s| s.running_jobs),
                pending_jobs: st.map(|s| s.pending_jobs),
                updated_at: st.map(|s| s.updated_at),
                name: r.name,
            }
        })
        .filter(|q| !q.implicit || q.active_jobs > 0 || q.updated_at.is_some())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_bus::KvChange;
    use converge_common::{FittedCurve, GpuSample, RankPlacement, WorkerState};

    fn status(id: &str, phase: JobPhase, workers: u32, submitted: f64) -> JobStatus {
        let mut s = JobStatus::pending(JobId::new(id).unwrap(), submitted, submitted);
        s.phase = phase;
        s.world_size = workers;
        s
    }

    fn spec(id: &str) -> JobSpec {
        JobSpec::from_toml(&format!("id = \"{id}\"\ncommand = [\"true\"]\n")).unwrap()
    }

    fn telemetry(host: &str, time: f64, busy: &[u32]) -> HostTelemetry {
        HostTelemetry {
            agent_version: "t".into(),
            gpus: (0..4)
                .map(|index| GpuSample {
                    index,
                    uuid: format!("GPU-{index}"),
                    name: "fake".into(),
                    memory_total_bytes: 100,
                    memory_used_bytes: if busy.contains(&index) { 60 } else { 0 },
                    utilization_pct: if busy.contains(&index) { 90.0 } else { 0.0 },
                    power_mw: Some(250_000),
                    sm_clock_mhz: None,
                })
                .collect(),
            nics: vec![],
            cpu_pct: 0.0,
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            workers: vec![WorkerState {
                job: JobId::new("a").unwrap(),
                generation: 1,
                rank: 0,
                phase: WorkerPhase::Running,
                pid: Some(1),
                restarts: 0,
                last_exit_code: None,
                gpus: busy.to_vec(),
            }],
            ..HostTelemetry::new(HostId::new(host).unwrap(), "10.0.0.1", time)
        }
    }

    #[test]
    fn hosts_jobs_curves_and_the_queue_are_drawn_from_the_model() {
        let mut m = Model::default();
        let mut h1 = telemetry("h1", 100.0, &[0, 1]);
        h1.labels.insert("zone".into(), "a".into());
        m.hosts.apply(KvChange::Put(HostId::new("h1").unwrap(), h1));
        m.hosts.apply(KvChange::Put(
            HostId::new("h2").unwrap(),
            telemetry("h2", 50.0, &[]),
        ));
        for id in ["p", "done"] {
            m.specs
                .apply(KvChange::Put(JobId::new(id).unwrap(), spec(id)));
        }
        // "a" runs in queue team-a at high priority; "p" (pending) and "done" are in the
        // implicit default queue.
        m.specs.apply(KvChange::Put(
            JobId::new("a").unwrap(),
            JobSpec::from_toml(
                "id = \"a\"\ncommand = [\"true\"]\nqueue = \"team-a\"\npriority = \"high\"\n",
            )
            .unwrap(),
        ));
        let team_a = QueueSpec {
            name: "team-a".parse().unwrap(),
            quota_gpus: 2,
            borrowing_limit_gpus: Some(1),
            weight: 2.0,
            ..QueueSpec::implicit_default()
        };
        let team_b = QueueSpec {
            name: "team-b".parse().unwrap(),
            quota_gpus: 1,
            ..QueueSpec::implicit_default()
        };
        m.queues
            .apply(KvChange::Put(team_a.name.clone(), team_a.clone()));
        m.queues
            .apply(KvChange::Put(team_b.name.clone(), team_b.clone()));
        let a_status = QueueStatus {
            protocol: converge_common::PROTOCOL_VERSION,
            queue: team_a.name.clone(),
            gpus_in_use: 3,
            borrowed_gpus: 1,
            lent_gpus: 0,
            fair_share_gpus: 2.5,
            usage_gpu_seconds: 5400.0,
            half_life_s: 3600.0,
            running_jobs: 1,
            pending_jobs: 0,
            updated_at: 99.0,
        };
        m.queue_statuses
            .apply(KvChange::Put(team_a.name.clone(), a_status.clone()));
        // A status of a queue deleted since is no queue.
        let gone: QueueId = "gone".parse().unwrap();
        m.queue_statuses.apply(KvChange::Put(
            gone.clone(),
            QueueStatus {
                queue: gone,
                ..a_status.clone()
            },
        ));
        let mut a = status("a", JobPhase::Running, 2, 1.0);
        a.generation = 2;
        a.placement = vec![RankPlacement {
            rank: 0,
            host: HostId::new("h1").unwrap(),
            gpus: vec![0],
        }];
        a.curve = Some(FittedCurve {
            family: "inv_linear".into(),
            params: vec![1e-3, 1.0, 0.1],
            rmse: 0.01,
            points: 10,
        });
        a.samples = 1000;
        a.samples_per_s = Some(10.0);
        a.sync_rounds_per_s = Some(6.8);
        a.model_gap = Some(0.0134);
        m.statuses.apply(KvChange::Put(a.job.clone(), a));
        m.statuses.apply(KvChange::Put(
            JobId::new("p").unwrap(),
            status("p", JobPhase::Pending, 0, 5.0),
        ));
        let mut done = status("done", JobPhase::Completed, 0, 0.5);
        done.finished_at = Some(90.0);
        m.statuses.apply(KvChange::Put(done.job.clone(), done));
        m.points.insert(
            JobId::new("a").unwrap(),
            (1..=1000)
                .map(|i| LossPoint {
                    time: i as f64,
                    samples: i as f64,
                    loss: 1.0 / (1e-3 * i as f64 + 1.0) + 0.1,
                    generation: if i < 500 { 1 } else { 2 },
                })
                .collect(),
        );
        let s = build(&m, 7, 100.0, 15.0, 10);
        assert_eq!(s.version, 7);
        // h2 is 50 s old: lost; its GPUs leave the total.
        assert_eq!(
            (
                s.cluster.gpus_total,
                s.cluster.gpus_busy,
                s.cluster.hosts_lost
            ),
            (4, 2, 1)
        );
        let h1 = &s.hosts[0];
        assert_eq!((h1.gpus_busy, h1.gpus_total, h1.lost), (2, 4, false));
        assert_eq!(h1.gpus[0].job.as_ref().map(JobId::as_str), Some("a"));
        assert_eq!(h1.gpus[0].power_w, Some(250.0));
        assert_eq!(h1.labels["zone"], "a");
        assert!(s.hosts[1].lost);
        assert_eq!(s.hosts[1].rx_bytes_per_s, None);
        assert_eq!(h1.workers, 1);
        // Running first, then pending, then ended.
        let order: Vec<&str> = s.jobs.iter().map(|j| j.job.as_str()).collect();
        assert_eq!(order, ["a", "p", "done"]);
        assert_eq!((s.jobs[0].reports, s.jobs[1].reports), (1000, 0));
        // A shadow job's sync figures are shown; other jobs' fields are left out.
        assert_eq!(
            (s.jobs[0].sync_rounds_per_s, s.jobs[0].model_gap),
            (Some(6.8), Some(0.0134))
        );
        let json = serde_json::to_value(&s.jobs[1]).unwrap();
        assert!(json.get("sync_rounds_per_s").is_none(), "{json}");
        // Each job's queue and priority class, from its spec.
        assert_eq!(
            (s.jobs[0].queue.as_str(), s.jobs[0].priority),
            ("team-a", PriorityClass::High)
        );
        assert_eq!(
            (s.jobs[1].queue.as_str(), s.jobs[1].priority),
            ("default", PriorityClass::Normal)
        );
        assert_eq!(
            (json["queue"].as_str(), json["priority"].as_str()),
            (Some("default"), Some("normal"))
        );
        // The queues, by name: the implicit default (its pending job "p"), both stored
        // queues, with team-a's status; the deleted queue's status is left out.
        let names: Vec<(&str, bool, u32)> = s
            .queues
            .iter()
            .map(|q| (q.name.as_str(), q.implicit, q.active_jobs))
            .collect();
        assert_eq!(
            names,
            [
                ("default", true, 1),
                ("team-a", false, 1),
                ("team-b", false, 0)
            ]
        );
        let qa = &s.queues[1];
        assert_eq!(
            (qa.quota_gpus, qa.borrowing_limit_gpus, qa.weight),
            (2, Some(1), 2.0)
        );
        assert_eq!(
            (qa.gpus_in_use, qa.borrowed_gpus, qa.lent_gpus),
            (Some(3), Some(1), Some(0))
        );
        assert_eq!(
            (qa.fair_share_gpus, qa.usage_gpu_seconds, qa.half_life_s),
            (Some(2.5), Some(5400.0), Some(3600.0))
        );
        assert_eq!(
            (qa.running_jobs, qa.pending_jobs, qa.updated_at),
            (Some(1), Some(0), Some(99.0))
        );
        let (qd, qb) = (&s.queues[0], &s.queues[2]);
        assert_eq!(
            (qd.quota_gpus, qd.borrowing_limit_gpus, qd.weight),
            (0, None, 1.0)
        );
        assert_eq!((qd.gpus_in_use, qb.updated_at), (None, None));
        let json = serde_json::to_value(qd).unwrap();
        assert!(json["borrowing_limit_gpus"].is_null(), "{json}");
        let c = s.jobs[0].curve.as_ref().unwrap();
        assert_eq!(c.points.len(), MAX_POINTS_SENT);
        assert_eq!(c.points.last().unwrap().0, 1000.0);
        assert_eq!(c.restarts, [(500.0, 2)]);
        assert_eq!((c.fit.len(), c.ahead.len()), (CURVE_POINTS, CURVE_POINTS));
        assert!(c.ahead.iter().all(|p| p.low <= p.loss && p.loss <= p.high));
        // "p" needs 1 GPU and 2 of 4 are free: it could start now.
        let p = &s.jobs[1];
        assert_eq!(
            (p.queue_position, p.gpus_needed, p.estimated_start),
            (Some(1), Some(1), Some(100.0))
        );
        // An ended job keeps its fit but predicts nothing ahead; a job whose reports are not
        // (yet) read still gets its curve over its samples.
        let mut m2 = m.clone();
        let mut a = m2.statuses.get(&JobId::new("a").unwrap()).unwrap().clone();
        a.phase = JobPhase::Completed;
        m2.statuses.apply(KvChange::Put(a.job.clone(), a));
        m2.points.clear();
        let s2 = build(&m2, 9, 100.0, 15.0, 10);
        let c = s2.jobs.iter().find(|j| j.job.as_str() == "a").unwrap();
        let c = c.curve.as_ref().unwrap();
        assert!(c.ahead.is_empty() && c.points.is_empty());
        assert_eq!(c.fit.last().unwrap().0, 1000.0);
        // Ended jobs beyond the limit are left out.
        let s = build(&m, 8, 100.0, 15.0, 0);
        assert_eq!(s.jobs.len(), 2);
        assert_eq!(s.cluster.jobs_by_phase["completed"], 1);
        // The implicit default queue without an active job or a status is left out (an
        // ended job does not count); once the allocator publishes its status it is shown.
        let mut m3 = m.clone();
        m3.specs.apply(KvChange::Deleted(JobId::new("p").unwrap()));
        m3.statuses
            .apply(KvChange::Deleted(JobId::new("p").unwrap()));
        let names =
            |s: &State| -> Vec<String> { s.queues.iter().map(|q| q.name.to_string()).collect() };
        assert_eq!(
            names(&build(&m3, 10, 100.0, 15.0, 10)),
            ["team-a", "team-b"]
        );
        let default: QueueId = "default".parse().unwrap();
        m3.queue_statuses.apply(KvChange::Put(
            default.clone(),
            QueueStatus {
                queue: default.clone(),
                gpus_in_use: 0,
                borrowed_gpus: 0,
                running_jobs: 0,
                ..a_status
            },
        ));
        let s3 = build(&m3, 11, 100.0, 15.0, 10);
        assert_eq!(names(&s3), ["default", "team-a", "team-b"]);
        assert_eq!((s3.queues[0].implicit, s3.queues[0].active_jobs), (true, 0));
        // A stored default queue replaces the implicit one, used or not.
        m3.queue_statuses.apply(KvChange::Deleted(default.clone()));
        m3.queues.apply(KvChange::Put(
            default.clone(),
            QueueSpec {
                quota_gpus: 1,
                ..QueueSpec::implicit_default()
            },
        ));
        let s3 = build(&m3, 12, 100.0, 15.0, 10);
        assert_eq!(names(&s3), ["default", "team-a", "team-b"]);
        assert_eq!((s3.queues[0].implicit, s3.queues[0].quota_gpus), (false, 1));
    }

    #[test]
    fn thinning_keeps_the_ends_and_the_order() {
        let v: Vec<u32> = (0..1000).collect();
        let t = thin(&v, 10);
        assert_eq!(t.len(), 10);
        assert_eq!((t[0], t[9]), (0, 999));
        assert!(t.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(thin(&v[..5], 10), v[..5]);
    }
}
