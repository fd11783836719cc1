//! A job's lifecycle: new statuses, progress, stop criteria, completion and failure,
//! generations (fencing) and the move from `restarting` to `running`.

use super::observe::step_times;
use super::{Outcome, event};
use crate::fit::{Curve, FitConfig};
use crate::fit_cache::FitCache;
use crate::history::JobHistory;
use crate::placement::master_port;
use crate::stop::{self, StopInputs, predicted_final_loss};
use crate::sweep_stop::{SweepTrial, TrialState, sweep_stops};
use crate::throughput::{StepObservation, ThroughputPrior};
use converge_common::{
    ChangeCause, EarlyStopRule, EndReason, Event, EventKind, HostId, HostTelemetry, JobEnd, JobId,
    JobPhase, JobSpec, JobStatus, WorkerPhase,
};
use std::collections::{BTreeMap, BTreeSet};

/// The master ports of the jobs that have not ended.
pub(super) fn taken_ports(out: &Outcome) -> BTreeSet<u16> {
    out.statuses
        .values()
        .filter(|s| !s.phase.is_terminal())
        .filter_map(|s| s.master_port)
        .collect()
}

/// A job's new generation: frees its master port in `taken_ports`, bumps the generation and
/// takes a fresh port (`None` when the job has no workers). The one place a generation
/// changes, so old and new workers never meet (generation fencing; see the module docs).
pub(super) fn bump_generation(status: &mut JobStatus, taken_ports: &mut BTreeSet<u16>) {
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

/// Records rank 0's host address of every placed job, and moves a job to a new generation
/// (fresh `MASTER_PORT`, `restarting`) when the address changed since its generation was
/// placed: an agent restarted with a new IP.
pub(super) fn follow_master_addr(
    before: &BTreeMap<JobId, JobStatus>,
    out: &mut Outcome,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    now: f64,
) {
    let mut taken_ports = taken_ports(out);
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

pub(super) fn new_status(id: &JobId, submitted_at: f64, now: f64) -> JobStatus {
    JobStatus::pending(id.clone(), submitted_at, now)
}

pub(super) fn finish(
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
pub(super) fn advance(
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
pub(super) fn job_end(
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
pub(super) fn apply_stop_criteria(
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
        recent_loss: history.and_then(|h| h.recent_loss(stop::RECENT_LOSSES)),
        curve,
        gpu_seconds: history.map_or(0.0, |h| h.attained_gpu_seconds(spec.gpus_per_worker)),
    };
    if let Some(verdict) = stop::stop_verdict(&stop, &inputs) {
        status.end = Some(job_end(verdict.reason, spec, history, curve));
        finish(status, JobPhase::Completed, verdict.message, now, events);
    }
}

pub(super) fn older_generation_alive(
    status: &JobStatus,
    reported: Option<&Vec<(&HostId, &converge_common::WorkerState)>>,
) -> bool {
    reported.is_some_and(|v| {
        v.iter()
            .any(|(_, w)| w.generation < status.generation && w.phase.is_alive())
    })
}

/// Copies progress, the fitted curve and the prediction into the status.
pub(super) fn update_progress(
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
    status.epoch_samples = h.epoch_samples();
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

/// Ends the trials each sweep's early-stopping rule stops ([`crate::sweep_stop`]), as
/// `completed` with the reason `early stopped`. A sweep's rule is that of its first active
/// trial (every trial of a sweep file carries the same); only trials that carry that rule
/// are stopped, the others are compared. The held-out curves the `predicted` rule judges
/// by are fitted here, for the active trials of its sweeps, through `cache` with the step's
/// `fit` settings: at most `fit_budget` refits a step (sweeps and trials in id order; the
/// others keep their last fit until a later step).
#[allow(clippy::too_many_arguments)]
pub(super) fn apply_sweep_early_stops(
    specs: &BTreeMap<JobId, JobSpec>,
    histories: &BTreeMap<JobId, JobHistory>,
    curves: &BTreeMap<JobId, Curve>,
    cache: &mut FitCache,
    fit: &FitConfig,
    fit_budget: usize,
    out: &mut Outcome,
    now: f64,
) {
    let mut refits = 0usize;
    let mut sweeps: BTreeMap<&JobId, Vec<&JobId>> = BTreeMap::new();
    for (id, spec) in specs {
        if let Some(sweep) = &spec.sweep {
            sweeps.entry(sweep).or_default().push(id);
        }
    }
    for ids in sweeps.values() {
        let active = |id: &&&JobId| {
            out.statuses
                .get(**id)
                .is_some_and(|s| !s.phase.is_terminal())
        };
        let Some(rule) = ids
            .iter()
            .filter(active)
            .find_map(|id| specs[*id].early_stop)
            .filter(|r| r.rule != EarlyStopRule::None)
        else {
            continue;
        };
        let mut eval_curves: BTreeMap<&JobId, Curve> = BTreeMap::new();
        if rule.rule == EarlyStopRule::Predicted {
            for id in ids.iter().filter(active) {
                let Some(h) = histories.get(*id) else {
                    continue;
                };
                let refit = refits < fit_budget && cache.eval_refit_pending(id, h);
                refits += usize::from(refit);
                if let Some(c) = cache.eval_curve(id, h, fit, refit) {
                    eval_curves.insert(*id, c);
                }
            }
        }
        let trials: Vec<SweepTrial<'_>> = ids
            .iter()
            .filter_map(|id| {
                let status = out.statuses.get(*id)?;
                let state = match status.phase {
                    JobPhase::Completed => TrialState::Ended {
                        early_stopped: status
                            .end
                            .as_ref()
                            .is_some_and(|e| e.reason == EndReason::EarlyStopped),
                    },
                    JobPhase::Failed | JobPhase::Cancelled => return None,
                    _ => TrialState::Active,
                };
                Some(SweepTrial {
                    id,
                    state,
                    history: histories.get(*id),
                    curve: curves.get(*id),
                    eval_curve: eval_curves.get(*id),
                    work_samples: specs[*id].work_samples.map(|w| w as f64),
                    plateau: specs[*id].stop.and_then(|s| s.plateau),
                    stoppable: specs[*id].early_stop.is_some_and(|e| e == rule),
                })
            })
            .collect();
        for stop in sweep_stops(&rule, &trials) {
            let (Some(status), Some(spec)) =
                (out.statuses.get_mut(&stop.job), specs.get(&stop.job))
            else {
                continue;
            };
            let history = histories.get(&stop.job);
            status.end = Some(job_end(stop.reason, spec, history, curves.get(&stop.job)));
            finish(
                status,
                JobPhase::Completed,
                stop.message,
                now,
                &mut out.events,
            );
        }
    }
}
