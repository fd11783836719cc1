//! `converge monitor`: a live jobs view refreshed every interval, which also records each
//! job's GPUs over time and writes a JSON summary of the run when it stops (after
//! `--duration`, once every job has finished with `--until-done`, or on Ctrl-C).
//!
//! On a terminal it redraws the jobs table; with `--no-clear` (scripts, logs, CI) it prints
//! one line per change instead (a job submitted, placed, resized, restarted or finished)
//! and every [`PROGRESS_EVERY_S`] a line per running job, then the final table. Either way
//! it ends with a one-line verdict ([`verdict`]).

use crate::{load_jobs, tables, text};
use converge_bus::{Bus, unix_now};
use converge_common::{JobPhase, JobSpec, JobStatus};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Options {
    pub interval: Duration,
    pub duration: Option<Duration>,
    pub until_done: Option<usize>,
    pub summary: Option<PathBuf>,
    pub clear: bool,
    pub json: bool,
    /// Also write the verdict line here (for a script that prints it again last).
    pub verdict_file: Option<PathBuf>,
}

/// Seconds between the progress lines of running jobs in `--no-clear` mode.
pub const PROGRESS_EVERY_S: f64 = 30.0;

/// What a change line is printed for: the job's phase, GPUs held and generation.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    phase: &'static str,
    gpus: u32,
    generation: u64,
}

fn seen(spec: &JobSpec, status: Option<&JobStatus>) -> Seen {
    Seen {
        phase: status.map_or("submitted", |s| s.phase.as_str()),
        gpus: gpus_held(spec, status),
        generation: status.map_or(0, |s| s.generation),
    }
}

/// One line for a job at `t` seconds into the run: its phase, GPUs, generation, step and
/// loss, and for a finished job how it ended.
pub fn job_line(t: f64, spec: &JobSpec, status: Option<&JobStatus>) -> String {
    let mut out = format!("[{:>6.1}s] {:<24} ", t, spec.id.as_str());
    let Some(s) = status else {
        out.push_str("submitted");
        return out;
    };
    out.push_str(&format!("{:<10}", s.phase.as_str()));
    if s.phase == JobPhase::Running {
        out.push_str(&format!(
            " {} GPU{} gen {}",
            gpus_held(spec, status),
            if gpus_held(spec, status) == 1 {
                ""
            } else {
                "s"
            },
            s.generation
        ));
    }
    if s.step > 0 {
        out.push_str(&format!(" step {}", s.step));
    }
    match (s.first_loss, s.loss) {
        (Some(a), Some(b)) => out.push_str(&format!(" loss {a:.4} -> {b:.4}")),
        (None, Some(b)) => out.push_str(&format!(" loss {b:.4}")),
        _ => {}
    }
    if s.phase.is_terminal() {
        if let Some(end) = &s.end {
            out.push_str(&format!(" ({})", end.reason.as_str()));
        } else if let Some(m) = &s.message {
            out.push_str(&format!(" ({m})"));
        }
    }
    out
}

/// The run's outcome in one line: `6/6 jobs completed in 154 s`, or how many completed,
/// failed, were cancelled and are still active, and why the monitor stopped.
pub fn verdict(
    rows: &[(&JobSpec, Option<&JobStatus>)],
    elapsed_s: f64,
    ended_because: &str,
) -> String {
    let count = |p: JobPhase| {
        rows.iter()
            .filter(|(_, st)| st.is_some_and(|s| s.phase == p))
            .count()
    };
    let (completed, failed, cancelled) = (
        count(JobPhase::Completed),
        count(JobPhase::Failed),
        count(JobPhase::Cancelled),
    );
    let active = rows.len() - completed - failed - cancelled;
    let total = rows.len();
    let took = format!("{:.0} s", elapsed_s);
    if total > 0 && completed == total {
        return format!("{completed}/{total} jobs completed in {took}");
    }
    let mut parts = vec![format!("{completed}/{total} jobs completed")];
    if failed > 0 {
        parts.push(format!("{failed} failed"));
    }
    if cancelled > 0 {
        parts.push(format!("{cancelled} cancelled"));
    }
    if active > 0 {
        parts.push(format!("{active} not finished"));
    }
    let why = match ended_because {
        "duration" => " (stopped: --duration reached)",
        "interrupted" => " (stopped: interrupted)",
        _ => "",
    };
    format!("{} after {took}{why}", parts.join(", "))
}

/// GPUs a job held from time `t` (seconds since the monitor started) on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuSample {
    pub t: f64,
    pub gpus: u32,
}

/// One job in the summary.
/// A `[batch]` job's batch from time `t` (seconds since the monitor started) on: the
/// current generation's plan (`total` 0 while no generation runs) and whether the job was
/// adaptive (had gradient statistics) then.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchSample {
    pub t: f64,
    pub generation: u64,
    pub total: u32,
    pub per_worker: u32,
    pub accum_steps: u32,
    pub adaptive: bool,
}

fn batch_sample(t: f64, status: Option<&JobStatus>) -> Option<BatchSample> {
    let s = status?;
    let b = s.batch.as_ref()?;
    let (total, per_worker, accum_steps) = b
        .plan
        .map_or((0, 0, 0), |p| (p.total, p.per_worker, p.accum_steps));
    Some(BatchSample {
        t,
        generation: s.generation,
        total,
        per_worker,
        accum_steps,
        adaptive: b.adaptive,
    })
}

#[derive(Debug, Serialize)]
pub struct JobSummary {
    pub id: String,
    pub model: Option<String>,
    pub dataset: Option<String>,
    pub phase: String,
    /// UNIX seconds.
    pub submitted_at: f64,
    pub finished_at: Option<f64>,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub last_eval_loss: Option<f64>,
    pub final_step: u64,
    pub final_samples: u64,
    /// Allocations the job ran with (its generation counter: one per allocation change).
    pub generations: u64,
    pub max_gpus: u32,
    /// Changes of the job's GPU count, seconds since the run started.
    pub gpus_over_time: Vec<GpuSample>,
    /// `[batch]` jobs only: each change of batch plan or of adaptivity.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub batches_over_time: Vec<BatchSample>,
    /// The sweep the job is a trial of.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<String>,
    /// How a completed job ended (its status's `end`: reason, loss, predicted loss,
    /// GPU-hours).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end: Option<converge_common::JobEnd>,
    /// The job's latest reported training loss at each refresh where its samples changed:
    /// the loss curve against samples, for comparing runs at equal samples.
    pub loss_over_samples: Vec<LossSample>,
    /// Shadow jobs only: their status's background sync rounds per second and model gap at
    /// each refresh where the job's samples changed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sync_over_time: Vec<SyncSample>,
}

/// A shadow job's sync figures ([`JobStatus::sync_rounds_per_s`], [`JobStatus::model_gap`])
/// seen `t` seconds into the run, at `samples`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SyncSample {
    pub t: f64,
    pub samples: u64,
    /// Rounds per second.
    pub sync_rounds_per_s: Option<f64>,
    /// Relative distance, 0 to 2.
    pub model_gap: Option<f64>,
}

/// The training loss rank 0 last reported, at `samples`, seen `t` seconds into the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossSample {
    pub t: f64,
    pub samples: u64,
    pub loss: f64,
}

/// The run summary.
#[derive(Debug, Serialize)]
pub struct RunSummary {
    pub started_at: f64,
    pub ended_at: f64,
    pub duration_s: f64,
    /// `all_jobs_finished`, `duration`, or `interrupted`.
    pub ended_because: String,
    pub jobs: Vec<JobSummary>,
}

fn gpus_held(spec: &JobSpec, status: Option<&JobStatus>) -> u32 {
    match status {
        Some(s) if s.phase == JobPhase::Running => s.world_size * spec.gpus_per_worker,
        _ => 0,
    }
}

pub async fn run(bus: &Bus, opts: Options) -> anyhow::Result<()> {
    let started = Instant::now();
    let started_at = unix_now();
    let mut history: BTreeMap<String, Vec<GpuSample>> = BTreeMap::new();
    let mut batches: BTreeMap<String, Vec<BatchSample>> = BTreeMap::new();
    let mut losses: BTreeMap<String, Vec<LossSample>> = BTreeMap::new();
    let mut syncs: BTreeMap<String, Vec<SyncSample>> = BTreeMap::new();
    let mut last: (Vec<JobSpec>, Vec<JobStatus>) = (Vec::new(), Vec::new());
    let mut seen_before: BTreeMap<String, Seen> = BTreeMap::new();
    let mut last_progress_line = 0.0_f64;
    let mut tick = tokio::time::interval(opts.interval);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let ended_because = loop {
        tokio::select! {
            _ = &mut ctrl_c => break "interrupted",
            _ = tick.tick() => {}
        }
        let (specs, statuses) = match load_jobs(bus).await {
            Ok(x) => x,
            Err(e) => {
                eprintln!("converge monitor: {e:#}");
                continue;
            }
        };
        let t = started.elapsed().as_secs_f64();
        for spec in &specs {
            let st = statuses.iter().find(|s| s.job == spec.id);
            let gpus = gpus_held(spec, st);
            let h = history.entry(spec.id.to_string()).or_default();
            if h.last().is_none_or(|s| s.gpus != gpus) {
                h.push(GpuSample {
                    t: (t * 10.0).round() / 10.0,
                    gpus,
                });
            }
            if let Some(s) = st
                && let Some(loss) = s.loss
            {
                let l = losses.entry(spec.id.to_string()).or_default();
                if l.last().is_none_or(|p| p.samples != s.samples) {
                    l.push(LossSample {
                        t: (t * 10.0).round() / 10.0,
                        samples: s.samples,
                        loss,
                    });
                }
            }
            if let Some(s) = st
                && (s.sync_rounds_per_s.is_some() || s.model_gap.is_some())
            {
                let l = syncs.entry(spec.id.to_string()).or_default();
                if l.last().is_none_or(|p| p.samples != s.samples) {
                    l.push(SyncSample {
                        t: (t * 10.0).round() / 10.0,
                        samples: s.samples,
                        sync_rounds_per_s: s.sync_rounds_per_s,
                        model_gap: s.model_gap,
                    });
                }
            }
            if let Some(sample) = batch_sample((t * 10.0).round() / 10.0, st) {
                let b = batches.entry(spec.id.to_string()).or_default();
                let changed = |l: &BatchSample| {
                    (l.total, l.per_worker, l.accum_steps, l.adaptive)
                        != (
                            sample.total,
                            sample.per_worker,
                            sample.accum_steps,
                            sample.adaptive,
                        )
                };
                if b.last().is_none_or(changed) {
                    b.push(sample);
                }
            }
        }
        let rows: Vec<(&JobSpec, Option<&JobStatus>)> = specs
            .iter()
            .map(|s| (s, statuses.iter().find(|st| st.job == s.id)))
            .collect();
        if opts.json {
            let out: Vec<_> = rows
                .iter()
                .map(|(spec, st)| serde_json::json!({"t": t, "spec": spec.id, "status": st}))
                .collect();
            println!("{}", serde_json::to_string(&out)?);
        } else if !opts.clear {
            // No terminal: a line per change, and the running jobs' progress now and then.
            let progress_due = t - last_progress_line >= PROGRESS_EVERY_S;
            if progress_due {
                last_progress_line = t;
            }
            for (spec, st) in &rows {
                let now_seen = seen(spec, *st);
                let changed = seen_before.get(spec.id.as_str()) != Some(&now_seen);
                let running = st.is_some_and(|s| s.phase == JobPhase::Running);
                if changed || (progress_due && running) {
                    println!("{}", text::terminal_safe(&job_line(t, spec, *st)));
                }
                seen_before.insert(spec.id.to_string(), now_seen);
            }
        } else {
            print!("\x1b[2J\x1b[H");
            let done = rows
                .iter()
                .filter(|(_, st)| st.is_some_and(|s| s.phase.is_terminal()))
                .count();
            println!(
                "converge monitor: {} jobs ({done} finished), {} elapsed{}",
                rows.len(),
                text::age(t),
                opts.duration.map_or(String::new(), |d| format!(
                    " of {}",
                    text::age(d.as_secs_f64())
                ))
            );
            let now = unix_now();
            let queue = crate::queue_estimates(bus, &specs, &statuses, now)
                .await
                .unwrap_or_default();
            let table = tables::jobs(&rows, now, &queue, None).to_string();
            println!("{}", text::terminal_safe(&table));
        }
        let all_done = !statuses.is_empty()
            && specs.iter().all(|spec| {
                statuses
                    .iter()
                    .any(|s| s.job == spec.id && s.phase.is_terminal())
            });
        last = (specs, statuses);
        if let Some(n) = opts.until_done
            && all_done
            && last.0.len() >= n
        {
            break "all_jobs_finished";
        }
        if opts.duration.is_some_and(|d| started.elapsed() >= d) {
            break "duration";
        }
    };
    let elapsed = started.elapsed().as_secs_f64();
    if !opts.json {
        let (specs, statuses) = &last;
        let rows: Vec<(&JobSpec, Option<&JobStatus>)> = specs
            .iter()
            .map(|s| (s, statuses.iter().find(|st| st.job == s.id)))
            .collect();
        if !opts.clear && !rows.is_empty() {
            let now = unix_now();
            let table = tables::jobs(&rows, now, &BTreeMap::new(), None).to_string();
            println!("{}", text::terminal_safe(&table));
        }
        let line = format!(
            "converge monitor: {}",
            verdict(&rows, elapsed, ended_because)
        );
        println!("{line}");
        if let Some(path) = &opts.verdict_file {
            std::fs::write(path, format!("{line}\n"))?;
        }
    }
    if let Some(path) = &opts.summary {
        let (specs, statuses) = last;
        let jobs = specs
            .iter()
            .map(|spec| {
                let st = statuses.iter().find(|s| s.job == spec.id);
                let gpus_over_time = history.remove(spec.id.as_str()).unwrap_or_default();
                JobSummary {
                    id: spec.id.to_string(),
                    model: spec.labels.get("model").cloned(),
                    dataset: spec.labels.get("dataset").cloned(),
                    phase: st.map_or("submitted", |s| s.phase.as_str()).to_string(),
                    submitted_at: spec.submitted_at,
                    finished_at: st.and_then(|s| s.finished_at),
                    first_loss: st.and_then(|s| s.first_loss),
                    last_loss: st.and_then(|s| s.loss),
                    last_eval_loss: st.and_then(|s| s.eval_loss),
                    final_step: st.map_or(0, |s| s.step),
                    final_samples: st.map_or(0, |s| s.samples),
                    generations: st.map_or(0, |s| s.generation),
                    max_gpus: gpus_over_time.iter().map(|g| g.gpus).max().unwrap_or(0),
                    gpus_over_time,
                    batches_over_time: batches.remove(spec.id.as_str()).unwrap_or_default(),
                    sweep: spec.sweep.as_ref().map(ToString::to_string),
                    end: st.and_then(|s| s.end.clone()),
                    loss_over_samples: losses.remove(spec.id.as_str()).unwrap_or_default(),
                    sync_over_time: syncs.remove(spec.id.as_str()).unwrap_or_default(),
                }
            })
            .collect();
        let ended_at = unix_now();
        let summary = RunSummary {
            started_at,
            ended_at,
            duration_s: ended_at - started_at,
            ended_because: ended_because.to_string(),
            jobs,
        };
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)?;
        eprintln!("summary written to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::tests::running_status;

    fn spec(id: &str) -> JobSpec {
        JobSpec::from_toml(&format!(
            "id = \"{id}\"\ncommand = [\"t\"]\nmax_workers = 4\ngpus_per_worker = 2\n"
        ))
        .unwrap()
    }

    fn status(id: &str, phase: JobPhase) -> JobStatus {
        let mut s = running_status();
        s.job = converge_common::JobId::new(id).unwrap();
        s.phase = phase;
        s
    }

    #[test]
    fn the_verdict_says_how_many_jobs_completed_and_why_the_run_stopped() {
        let (a, b, c) = (spec("a"), spec("b"), spec("c"));
        let done = status("a", JobPhase::Completed);
        let done_b = status("b", JobPhase::Completed);
        let done_c = status("c", JobPhase::Completed);
        let rows = [(&a, Some(&done)), (&b, Some(&done_b)), (&c, Some(&done_c))];
        assert_eq!(
            verdict(&rows, 154.4, "all_jobs_finished"),
            "3/3 jobs completed in 154 s"
        );
        let failed = status("b", JobPhase::Failed);
        let running = status("c", JobPhase::Running);
        let rows = [(&a, Some(&done)), (&b, Some(&failed)), (&c, Some(&running))];
        assert_eq!(
            verdict(&rows, 300.0, "duration"),
            "1/3 jobs completed, 1 failed, 1 not finished after 300 s (stopped: --duration reached)"
        );
        let rows = [(&a, None), (&b, Some(&done_b))];
        assert_eq!(
            verdict(&rows, 12.0, "interrupted"),
            "1/2 jobs completed, 1 not finished after 12 s (stopped: interrupted)"
        );
        assert_eq!(
            verdict(&[], 5.0, "duration"),
            "0/0 jobs completed after 5 s (stopped: --duration reached)"
        );
    }

    #[test]
    fn a_job_line_gives_phase_gpus_generation_step_and_loss() {
        let a = spec("a9a-logreg");
        assert_eq!(
            job_line(3.04, &a, None),
            "[   3.0s] a9a-logreg               submitted"
        );
        let mut s = status("a9a-logreg", JobPhase::Running);
        s.world_size = 2;
        s.generation = 3;
        s.step = 120;
        s.first_loss = Some(0.69);
        s.loss = Some(0.41234);
        assert_eq!(
            job_line(42.0, &a, Some(&s)),
            "[  42.0s] a9a-logreg               running    4 GPUs gen 3 step 120 loss 0.6900 -> 0.4123"
        );
        s.phase = JobPhase::Failed;
        s.message = Some("worker exited with status 1".into());
        assert_eq!(
            job_line(50.0, &a, Some(&s)),
            "[  50.0s] a9a-logreg               failed     step 120 loss 0.6900 -> 0.4123 (worker exited with status 1)"
        );
    }

    #[test]
    fn change_lines_follow_phase_gpus_and_generation_only() {
        let a = spec("a");
        let mut s = status("a", JobPhase::Running);
        s.world_size = 1;
        let first = seen(&a, Some(&s));
        s.step = 500;
        assert_eq!(seen(&a, Some(&s)), first, "progress alone is no change");
        s.world_size = 2;
        assert_ne!(seen(&a, Some(&s)), first, "a resize is");
        assert_ne!(seen(&a, None), first);
    }
}
