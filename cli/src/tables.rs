//! Human tables for `converge jobs`, `converge hosts` and the monitor (comfy-table).

use crate::text::age;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use converge_common::{HostTelemetry, JobBatch, JobId, JobPhase, JobSpec, JobStatus, WorkerPhase};
use converge_sched::outlook::QueueEntry;
use std::collections::BTreeMap;

/// The phase, with how the job ended when it did by itself or by a `[stop]` criterion:
/// `completed (converged)`, `completed (target reached)`, `completed (finished)`.
pub fn phase(s: &JobStatus) -> String {
    match &s.end {
        Some(end) => format!("{} ({})", s.phase.as_str(), end.reason.as_str()),
        None => s.phase.as_str().into(),
    }
}

/// The PHASE column: [`phase`], and for a pending or failed job the allocator's reason
/// (`pending: no live host matches selector zone=a`).
/// A pending job's place in the queue and estimated start (`converge_sched::outlook`), e.g.
/// `queue #2 of GPUs, est. start in 3m05s`.
pub fn queue_note(entry: &QueueEntry, now: f64) -> String {
    let eta = match entry.estimated_start {
        Some(t) if t <= now + 1.0 => "could start now".to_string(),
        Some(t) => format!("est. start in {}", age(t - now)),
        None => "start unknown".to_string(),
    };
    format!(
        "queue #{}, needs {} GPUs, {eta}",
        entry.position, entry.gpus_needed
    )
}

pub fn phase_with_reason(s: &JobStatus) -> String {
    match (&s.message, s.phase) {
        (Some(m), JobPhase::Pending | JobPhase::Failed) if !m.is_empty() => {
            format!("{}: {m}", phase(s))
        }
        _ => phase(s),
    }
}

fn loss(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
}

/// The SAMPLES/S cell: the observed throughput and, for a shadow job whose generation
/// reported them, its background sync rounds per second and model gap on a second line
/// (`412` / `sync 6.8/s gap 0.0134`).
fn throughput(s: &JobStatus) -> String {
    let rate = s.samples_per_s.map_or("-".into(), |r| format!("{r:.0}"));
    match (s.sync_rounds_per_s, s.model_gap) {
        (None, None) => rate,
        (rounds, gap) => {
            let rounds = rounds.map_or("-".into(), |r| format!("{r:.1}/s"));
            let gap = gap.map_or("-".into(), gap_text);
            format!("{rate}\nsync {rounds} gap {gap}")
        }
    }
}

/// A model gap with three significant digits: `0.0134`, `3.53e-5` (small models
/// synchronized hundreds of times a second stay that close), `0`.
fn gap_text(g: f64) -> String {
    if g == 0.0 {
        "0".into()
    } else if g < 1e-3 {
        format!("{g:.2e}")
    } else {
        let decimals = (2 - g.log10().floor() as i32).max(0) as usize;
        format!("{g:.decimals$}")
    }
}

/// `observed / predicted` seconds per step, `-` where unknown.
fn step_times(observed: Option<f64>, predicted: Option<f64>) -> String {
    let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.3}"));
    format!("{} / {}", f(observed), f(predicted))
}

/// Ranks per host in rank order of first appearance, e.g. `node-1×2 node-2×1`, then the
/// parameter-server shards the same way, e.g. `ps: node-1×1`.
fn placement(s: &JobStatus) -> String {
    let per_host = |ranks: &[converge_common::RankPlacement]| {
        let mut hosts: Vec<(&str, usize)> = Vec::new();
        for r in ranks {
            match hosts.iter_mut().find(|(h, _)| *h == r.host.as_str()) {
                Some((_, n)) => *n += 1,
                None => hosts.push((r.host.as_str(), 1)),
            }
        }
        hosts
            .iter()
            .map(|(h, n)| format!("{h}×{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if s.placement.is_empty() {
        return "-".into();
    }
    let workers = per_host(&s.placement);
    if s.ps_placement.is_empty() {
        workers
    } else {
        format!("{workers} ps: {}", per_host(&s.ps_placement))
    }
}

/// How a job's batch is chosen: `adaptive` (a `[batch]` job with gradient statistics: its
/// batch follows its allocation), `awaiting statistics` (a `[batch]` job that has not
/// reported progress yet: whether it is adaptive is known from its first report on),
/// `fixed (no gradient statistics)` (a `[batch]` job that reports progress but no valid
/// gradient statistics, or ended without any: it keeps its reference batch and is scheduled
/// by throughput alone)
/// or `fixed` (no `[batch]` table: the command's own batch).
pub fn batch_mode(spec: &JobSpec, status: Option<&JobStatus>) -> &'static str {
    match (&spec.batch, status.and_then(|s| s.batch.as_ref())) {
        (None, _) => "fixed",
        (Some(_), Some(b)) if b.adaptive => "adaptive",
        (Some(_), b)
            if !has_reported(status, b) && !status.is_some_and(|s| s.phase.is_terminal()) =>
        {
            "awaiting statistics"
        }
        (Some(_), _) => "fixed (no gradient statistics)",
    }
}

/// Whether the allocator has seen a progress report of the job (any generation): a step, a
/// loss, or gradient statistics it had to ignore.
fn has_reported(status: Option<&JobStatus>, batch: Option<&JobBatch>) -> bool {
    status.is_some_and(|s| s.step > 0 || s.loss.is_some())
        || batch.is_some_and(|b| b.gradient_reports > 0 || b.ignored_gradient_stats > 0)
}

/// The line under `converge jobs`' table when finished jobs (completed, failed, cancelled)
/// were left out: how many, and the flag that shows them. `None` when none were.
pub fn hidden_jobs_note(hidden: usize) -> Option<String> {
    match hidden {
        0 => None,
        1 => Some("1 finished job not shown (converge jobs -a shows it)".into()),
        n => Some(format!(
            "{n} finished jobs not shown (converge jobs -a shows them)"
        )),
    }
}

/// The BATCH column: the mode, then the current generation's plan as
/// `total (per-worker/worker ×micro-batches)`, the noise scale and ignored statistics.
pub fn batch(spec: &JobSpec, status: Option<&JobStatus>) -> String {
    let mode = batch_mode(spec, status);
    let Some(b) = status.and_then(|s| s.batch.as_ref()) else {
        return match &spec.batch {
            Some(b) => format!("{mode}, ref {}", b.reference),
            None => mode.into(),
        };
    };
    let mut out = mode.to_string();
    match &b.plan {
        Some(p) if p.accum_steps > 0 => out.push_str(&format!(
            " {} ({}/worker ×{})",
            p.total,
            p.per_worker,
            p.accum_steps + 1
        )),
        Some(p) => out.push_str(&format!(" {} ({}/worker)", p.total, p.per_worker)),
        None => out.push_str(&format!(", ref {}", b.reference)),
    }
    if let Some(phi) = b.noise_scale {
        out.push_str(&format!(" φ≈{phi:.0}"));
    }
    if b.ignored_gradient_stats > 0 {
        out.push_str(&format!(
            " [{} bad stats ignored]",
            b.ignored_gradient_stats
        ));
    }
    out
}

/// The GPU TYPES column: the job's speed on each GPU type, fastest first, compute samples
/// per second per GPU; a type it has not run on is marked `(projected)` (scheduled from
/// other jobs' ratios, docs/heterogeneous.md). `-` on a cluster of one type.
pub fn gpu_type_speeds(status: &JobStatus) -> String {
    let mut speeds: Vec<(&String, &converge_common::GpuTypeSpeed)> =
        status.gpu_type_speeds.iter().collect();
    if speeds.is_empty() {
        return "-".into();
    }
    speeds.sort_by(|a, b| b.1.samples_per_s.total_cmp(&a.1.samples_per_s));
    speeds
        .iter()
        .map(|(t, s)| {
            let v = s.samples_per_s;
            let v = if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.3}")
                    .trim_end_matches('0')
                    .trim_end_matches('.')
                    .to_string()
            };
            if s.measured {
                format!("{t} {v}")
            } else {
                format!("{t} ≈{v} (projected)")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The jobs table.
/// The jobs table; `queue` holds the pending jobs' queue entries (their PHASE cell adds the
/// position and estimated start).
/// `queues` holds the queues the jobs name (`None`: not read, every job is in `default`); a
/// job whose queue does not exist shows `(missing)` in QUEUE/PRIO, and a pending job the
/// allocator gave no reason says what its queue holds.
pub fn jobs(
    rows: &[(&JobSpec, Option<&JobStatus>)],
    now: f64,
    queue: &BTreeMap<JobId, QueueEntry>,
    queues: Option<&crate::queues::Context>,
) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(vec![
        "JOB",
        "QUEUE/PRIO",
        "MODEL/DATA",
        "PHASE",
        "WORKERS",
        "GEN",
        "STEP",
        "SAMPLES",
        "SAMPLES/S",
        "LOSS (first→now)",
        "PREDICTED",
        "STEP s (obs/pred)",
        "BATCH",
        "PLACEMENT",
        "GPU TYPES (samples/s/GPU)",
        "AGE",
    ]);
    for (spec, st) in rows {
        let label = format!(
            "{}/{}",
            spec.labels.get("model").map_or("-", String::as_str),
            spec.labels.get("dataset").map_or("-", String::as_str)
        );
        let range = format!("{}-{}", spec.min_workers, spec.max_workers());
        match st {
            Some(s) => t.add_row(vec![
                spec.id.to_string(),
                crate::queues::cell(spec, queues),
                label,
                {
                    let phase = match queues.and_then(|c| c.waiting(spec, Some(s))) {
                        Some(why) => format!("{}: {why}", phase(s)),
                        None => phase_with_reason(s),
                    };
                    match queue.get(&s.job) {
                        Some(q) if s.phase == JobPhase::Pending => {
                            format!("{phase} ({})", queue_note(q, now))
                        }
                        _ => phase,
                    }
                },
                format!("{} ({range})", s.world_size),
                s.generation.to_string(),
                s.step.to_string(),
                s.samples.to_string(),
                throughput(s),
                format!("{} → {}", loss(s.first_loss), loss(s.loss)),
                loss(s.predicted_loss),
                step_times(s.step_time_s, s.predicted_step_time_s),
                batch(spec, Some(s)),
                placement(s),
                gpu_type_speeds(s),
                age(s.finished_at.unwrap_or(now) - s.submitted_at),
            ]),
            None => t.add_row(vec![
                spec.id.to_string(),
                crate::queues::cell(spec, queues),
                label,
                match queues.and_then(|c| c.waiting(spec, None)) {
                    Some(why) => format!("submitted: {why}"),
                    None => "submitted".into(),
                },
                format!("0 ({range})"),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                batch(spec, None),
                "-".into(),
                "-".into(),
                age(now - spec.submitted_at),
            ]),
        };
    }
    t
}

/// GPUs per type over `hosts` (`a100 8, t4 16`), types in order; `None` without GPUs.
pub fn gpus_by_type(hosts: &[HostTelemetry]) -> Option<String> {
    let per_type = converge_common::labels::gpus_by_type(hosts);
    (!per_type.is_empty()).then(|| {
        per_type
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// The hosts table.
pub fn hosts(hosts: &[HostTelemetry], now: f64) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(vec![
        "HOST",
        "ADDR",
        "GPUS (busy/all)",
        "GPU TYPE",
        "GPU UTIL",
        "CPU",
        "MEMORY",
        "NET RX/TX MiB/s",
        "WORKERS",
        "LABELS",
        "SEEN",
    ]);
    for h in hosts {
        let busy = h.gpus.iter().filter(|g| g.utilization_pct > 0.0).count();
        let util = if h.gpus.is_empty() {
            0.0
        } else {
            h.gpus.iter().map(|g| g.utilization_pct).sum::<f64>() / h.gpus.len() as f64
        };
        let (rx, tx) = h.nics.iter().fold((0.0, 0.0), |(r, t), n| {
            (r + n.rx_bytes_per_s, t + n.tx_bytes_per_s)
        });
        let running = h
            .workers
            .iter()
            .filter(|w| w.phase == WorkerPhase::Running)
            .count();
        t.add_row(vec![
            h.host.to_string(),
            h.addr.clone(),
            format!("{busy}/{} ({})", h.gpus.len(), h.gpu_source),
            converge_common::labels::host_gpu_type(&h.labels).unwrap_or_else(|| "-".into()),
            format!("{util:.0}%"),
            format!("{:.0}%", h.cpu_pct),
            format!(
                "{:.1}/{:.1} GiB",
                h.memory_used_bytes as f64 / (1u64 << 30) as f64,
                h.memory_total_bytes as f64 / (1u64 << 30) as f64
            ),
            format!(
                "{:.2}/{:.2}",
                rx / (1u64 << 20) as f64,
                tx / (1u64 << 20) as f64
            ),
            format!("{running} running / {}", h.workers.len()),
            converge_common::labels::format(&h.labels),
            format!("{} ago", age(now - h.time)),
        ]);
    }
    t
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use converge_common::{HostId, JobId, PROTOCOL_VERSION, RankPlacement};

    /// Job `j`, running in generation 1, nothing placed or reported yet (a status as an
    /// older allocator wrote it: no optional field present).
    pub(crate) fn running_status() -> JobStatus {
        serde_json::from_value(serde_json::json!({
            "protocol": PROTOCOL_VERSION, "job": "j", "phase": "running", "generation": 1,
            "world_size": 0, "placement": [], "master_port": null, "step": 0, "samples": 0,
            "first_loss": null, "loss": null, "eval_loss": null, "curve": null,
            "predicted_loss": null, "samples_per_s": null, "submitted_at": 0.0,
            "started_at": null, "finished_at": null, "updated_at": 0.0, "message": null
        }))
        .unwrap()
    }

    fn rank(rank: u32, host: &str, gpus: &[u32]) -> RankPlacement {
        RankPlacement {
            rank,
            host: HostId::new(host).unwrap(),
            gpus: gpus.to_vec(),
        }
    }

    #[test]
    fn the_batch_column_says_how_the_batch_is_chosen() {
        let spec = |table: &str| {
            JobSpec::from_toml(&format!(
                "id = \"j\"\ncommand = [\"t\"]\nmax_workers = 4\n{table}"
            ))
            .unwrap()
        };
        let plain = spec("");
        let adaptive = spec("[batch]\nreference = 32\nmax_total = 512\n");
        let mut s: JobStatus = running_status();
        assert_eq!(batch(&plain, Some(&s)), "fixed");
        assert_eq!(batch(&adaptive, None), "awaiting statistics, ref 32");
        let mut b = converge_common::JobBatch::new(32);
        b.plan = Some(converge_common::AssignedBatch {
            total: 32,
            per_worker: 16,
            accum_steps: 0,
            reference: 32,
        });
        // Placed, no report yet: not known to be fixed.
        s.batch = Some(b.clone());
        assert_eq!(
            batch(&adaptive, Some(&s)),
            "awaiting statistics 32 (16/worker)"
        );
        // Ended without a report: nothing is awaited any more.
        s.phase = JobPhase::Failed;
        assert_eq!(
            batch_mode(&adaptive, Some(&s)),
            "fixed (no gradient statistics)"
        );
        s.phase = JobPhase::Running;
        // Reports without statistics: fixed.
        s.step = 40;
        s.loss = Some(0.7);
        assert_eq!(
            batch_mode(&adaptive, Some(&s)),
            "fixed (no gradient statistics)"
        );
        s.step = 0;
        s.loss = None;
        // Statistics it had to ignore are reports too.
        b.ignored_gradient_stats = 3;
        s.batch = Some(b.clone());
        assert_eq!(
            batch(&adaptive, Some(&s)),
            "fixed (no gradient statistics) 32 (16/worker) [3 bad stats ignored]"
        );
        b.adaptive = true;
        b.noise_scale = Some(811.6);
        b.ignored_gradient_stats = 0;
        b.plan = Some(converge_common::AssignedBatch {
            total: 256,
            per_worker: 64,
            accum_steps: 1,
            reference: 32,
        });
        s.batch = Some(b);
        assert_eq!(
            batch(&adaptive, Some(&s)),
            "adaptive 256 (64/worker ×2) φ≈812"
        );
        assert_eq!(batch_mode(&adaptive, Some(&s)), "adaptive");
    }

    #[test]
    fn finished_jobs_left_out_are_counted_under_the_table() {
        assert_eq!(hidden_jobs_note(0), None);
        assert_eq!(
            hidden_jobs_note(1).unwrap(),
            "1 finished job not shown (converge jobs -a shows it)"
        );
        assert_eq!(
            hidden_jobs_note(6).unwrap(),
            "6 finished jobs not shown (converge jobs -a shows them)"
        );
    }

    #[test]
    fn shadow_jobs_show_their_sync_rounds_and_model_gap() {
        let mut s = running_status();
        assert_eq!(throughput(&s), "-");
        s.samples_per_s = Some(411.6);
        assert_eq!(throughput(&s), "412", "ring jobs: the throughput only");
        s.sync_rounds_per_s = Some(6.84);
        s.model_gap = Some(0.01342);
        assert_eq!(throughput(&s), "412\nsync 6.8/s gap 0.0134");
        s.model_gap = Some(3.53382e-5);
        assert_eq!(throughput(&s), "412\nsync 6.8/s gap 3.53e-5");
        s.model_gap = Some(0.0);
        assert_eq!(throughput(&s), "412\nsync 6.8/s gap 0");
        s.model_gap = Some(1.5);
        assert_eq!(throughput(&s), "412\nsync 6.8/s gap 1.50");
        s.model_gap = None;
        assert_eq!(throughput(&s), "412\nsync 6.8/s gap -");
        let spec = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        s.model_gap = Some(0.01342);
        let text = jobs(&[(&spec, Some(&s))], 100.0, &BTreeMap::new(), None).to_string();
        assert!(text.contains("sync 6.8/s gap 0.0134"), "{text}");
    }

    #[test]
    fn placement_lists_workers_then_shards_per_host() {
        let mut s: JobStatus = running_status();
        assert_eq!(
            (s.job.clone(), s.phase),
            (JobId::new("j").unwrap(), JobPhase::Running)
        );
        assert_eq!(placement(&s), "-");
        s.world_size = 3;
        s.placement = vec![
            rank(0, "n2", &[0]),
            rank(1, "n1", &[0]),
            rank(2, "n2", &[1]),
        ];
        assert_eq!(placement(&s), "n2×2 n1×1");
        s.ps_placement = vec![rank(3, "n2", &[]), rank(4, "n2", &[])];
        assert_eq!(placement(&s), "n2×2 n1×1 ps: n2×2");
    }

    #[test]
    fn the_jobs_table_shows_how_a_completed_job_ended() {
        let spec = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        let mut s = running_status();
        assert_eq!(phase(&s), "running");
        s.phase = JobPhase::Completed;
        s.end = Some(converge_common::JobEnd {
            reason: converge_common::EndReason::TargetReached,
            loss: Some(0.3),
            predicted_loss: Some(0.28),
            gpu_hours: 0.5,
        });
        assert_eq!(phase(&s), "completed (target reached)");
        let text = jobs(&[(&spec, Some(&s))], 100.0, &BTreeMap::new(), None).to_string();
        assert!(text.contains("completed (target reached)"), "{text}");
    }

    #[test]
    fn the_jobs_table_shows_speeds_per_gpu_type_and_which_are_projected() {
        let spec = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        let mut s = running_status();
        assert_eq!(gpu_type_speeds(&s), "-");
        let speed = |samples_per_s, measured| converge_common::GpuTypeSpeed {
            samples_per_s,
            measured,
        };
        s.gpu_type_speeds = BTreeMap::from([
            ("t4".to_string(), speed(95.4, true)),
            ("a100".to_string(), speed(312.2, false)),
            ("rtx".to_string(), speed(0.125, true)),
        ]);
        assert_eq!(
            gpu_type_speeds(&s),
            "a100 ≈312 (projected), t4 95.4, rtx 0.125"
        );
        let text = jobs(&[(&spec, Some(&s))], 1.0, &BTreeMap::new(), None).to_string();
        assert!(text.contains("GPU TYPES (samples/s/GPU)"), "{text}");
        assert!(text.contains("a100 ≈312 (projected)"), "{text}");
    }

    #[test]
    fn the_jobs_table_shows_why_a_job_waits_and_hosts_show_their_labels() {
        let spec = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        let mut s = running_status();
        s.phase = JobPhase::Pending;
        s.message = Some("no live host matches selector zone=c".into());
        assert_eq!(
            phase_with_reason(&s),
            "pending: no live host matches selector zone=c"
        );
        let entry = QueueEntry {
            job: s.job.clone(),
            position: 2,
            gpus_needed: 4,
            estimated_start: Some(285.0),
        };
        let queue = BTreeMap::from([(s.job.clone(), entry.clone())]);
        let text = jobs(&[(&spec, Some(&s))], 100.0, &queue, None).to_string();
        assert!(
            text.contains("no live host matches selector zone=c"),
            "{text}"
        );
        assert!(
            text.contains("queue #2, needs 4 GPUs, est. start in 3m05s"),
            "{text}"
        );
        let unknown = QueueEntry {
            estimated_start: None,
            ..entry
        };
        assert_eq!(
            queue_note(&unknown, 100.0),
            "queue #2, needs 4 GPUs, start unknown"
        );
        s.phase = JobPhase::Running;
        assert_eq!(phase_with_reason(&s), "running");

        let mut h: HostTelemetry = serde_json::from_value(serde_json::json!({
            "protocol": 1, "host": "n1", "addr": "127.0.0.1", "time": 0.0,
            "agent_version": "t", "gpu_source": "fake", "gpus": [], "nics": [],
            "cpu_pct": 0.0, "memory_used_bytes": 0, "memory_total_bytes": 0,
            "workers": [], "malformed_progress_lines": 0
        }))
        .unwrap();
        h.labels.insert("zone".into(), "a".into());
        h.labels.insert("gpu.count".into(), "0".into());
        let text = hosts(&[h.clone()], 1.0).to_string();
        assert!(text.contains("LABELS"), "{text}");
        assert!(text.contains("gpu.count=0,zone=a"), "{text}");
        assert_eq!(gpus_by_type(&[h.clone()]), None, "no GPUs");

        // Typed hosts: the type column, and the GPUs per type.
        let gpu: converge_common::GpuSample = serde_json::from_value(serde_json::json!({
            "index": 0, "uuid": "GPU-0", "name": "Tesla T4", "memory_total_bytes": 1,
            "memory_used_bytes": 0, "utilization_pct": 0.0
        }))
        .unwrap();
        let mut t4 = h.clone();
        t4.gpus = vec![gpu.clone(), gpu.clone()];
        t4.labels.insert("gpu.type".into(), "t4".into());
        let mut old = h;
        old.gpus = vec![gpu];
        old.labels
            .insert("gpu.model".into(), "NVIDIA-A100-SXM4-40GB".into());
        let text = hosts(&[t4.clone(), old.clone()], 1.0).to_string();
        assert!(text.contains("GPU TYPE"), "{text}");
        assert_eq!(
            gpus_by_type(&[t4.clone(), t4, old]).as_deref(),
            Some("a100 1, t4 4")
        );
    }
}
