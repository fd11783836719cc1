//! What a step observes: fitted curves and throughput models, measured contention, step
//! times by GPU type, eligible hosts, and the decision's view of each job ([`job_view`]).

use super::batch::batch_limits;
use super::{Inputs, MODEL_LABEL};
use crate::contention::{ContentionSamples, ring_nic_bytes_per_s};
use crate::decide::{AdaptiveBatch, BatchSize, JobView};
use crate::fit::{Curve, samples_to_reach};
use crate::fit_cache::{FitCache, ModelScope};
use crate::goodput::GradientStats;
use crate::history::JobHistory;
use crate::throughput::{StepObservation, ThroughputModel, ThroughputPrior};
use converge_common::{HostId, HostTelemetry, JobId, JobPhase, JobSpec, JobStatus, SyncArch};
use std::collections::{BTreeMap, BTreeSet};

/// The work a job has left (samples, over all its workers) as the service can know it, in
/// this order: the work its spec declares that is not done yet (`declared_left`, from
/// [`converge_common::JobSpec::work_samples`]); else the fitted curve's estimate to its
/// target loss (`remaining_samples`); else `None` (the policy then guesses, see
/// [`crate::policies::quality::remaining_work`]). The service and the simulator both call
/// it, so a simulated policy knows no more than a live one.
pub fn known_remaining_work(
    declared_left: Option<f64>,
    curve: Option<&Curve>,
    target_loss: Option<f64>,
    samples: f64,
) -> Option<f64> {
    declared_left
        .filter(|w| w.is_finite())
        .map(|w| w.max(0.0))
        .or_else(|| remaining_samples(curve, target_loss, samples))
}

/// Samples the job still needs, when it has a target loss and a fitted curve that reaches
/// it within a thousand times the samples done so far (at least 10⁹): the curve's prediction,
/// inverted. `None` otherwise.
pub(super) fn remaining_samples(
    curve: Option<&Curve>,
    target_loss: Option<f64>,
    samples: f64,
) -> Option<f64> {
    let limit = (samples * 1000.0).max(1e9);
    let reach = samples_to_reach(curve?, target_loss?, samples, limit)?;
    Some((reach - samples).max(0.0))
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
pub(super) fn measured_contention(
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
pub(super) fn ring_nic_traffic(
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
pub(super) fn refits<'a>(inp: Inputs<'a>, cache: &FitCache, budget: usize) -> BTreeSet<&'a JobId> {
    let mut due: Vec<(usize, &JobId)> = inp
        .specs
        .keys()
        .filter(|id| inp.statuses.get(*id).is_none_or(|s| !s.phase.is_terminal()))
        .filter_map(|id| Some((cache.refit_pending(id, inp.histories.get(id)?)?, id)))
        .collect();
    due.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    due.into_iter().take(budget).map(|(_, id)| id).collect()
}

/// Observed seconds per step of the status's generation, and what the throughput model
/// fitted on the earlier generations predicts for its world size and servers spanned.
pub(super) fn step_times(
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
pub(super) fn observations_by_type(
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
pub(super) struct Fits<'a> {
    pub(super) curves: &'a BTreeMap<JobId, Curve>,
    /// Each active job's throughput model on all its generations, and the per-worker batch
    /// it last ran with.
    pub(super) models: &'a BTreeMap<JobId, (ThroughputModel, f64)>,
    /// Each active job's measured speed per GPU type ([`observations_by_type`]).
    pub(super) type_speeds: &'a BTreeMap<JobId, BTreeMap<String, f64>>,
    /// Each active `[batch]` job's gradient statistics (those with valid reports).
    pub(super) gradients: &'a BTreeMap<JobId, GradientStats>,
    /// [`measured_contention`].
    pub(super) contention: f64,
}

/// The live hosts the spec allows ([`JobSpec::allows_host`]: its `[selector]` and
/// `gpu_types`); `None` when it restricts nothing (any host will do).
pub(super) fn eligible_hosts(
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
pub(super) fn unmatched_selector_message(
    spec: &JobSpec,
    live: &BTreeMap<&HostId, &HostTelemetry>,
) -> String {
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
pub(super) fn note_unmatched_selectors(
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
pub(super) fn job_view(
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
    let samples = status.samples as f64;
    // An adaptive job's rate is its goodput, in samples at its reference batch, so its work
    // is counted in those too: the declared work (samples at the reference batch) less the
    // work done at that unit, or the curve's samples to the target at the efficiency of
    // the batch it trains with now.
    let gradient = fits
        .gradients
        .get(&status.job)
        .filter(|_| spec.batch.is_some());
    let reference = spec.batch.as_ref().map_or(0.0, |b| f64::from(b.reference));
    let efficiency = |batch: f64| gradient.map_or(1.0, |g| g.efficiency(reference, batch));
    let done = match (gradient, history) {
        (Some(_), Some(h)) => h.samples_at(efficiency),
        _ => samples,
    };
    let current = status
        .batch
        .as_ref()
        .and_then(|b| b.plan)
        .map_or(reference, |p| f64::from(p.total));
    let declared_left = spec.work_samples.map(|w| w as f64 - done);
    let remaining_work =
        known_remaining_work(declared_left, curve.as_ref(), spec.target_loss(), samples).map(
            |left| {
                if declared_left.is_some() {
                    left
                } else {
                    left * efficiency(current)
                }
            },
        );
    JobView {
        id: status.job.clone(),
        gpus_per_worker: spec.gpus_per_worker,
        min_workers: spec.min_workers,
        max_workers: spec.max_workers(),
        requested_workers: spec.requested_workers(),
        workers_declared: spec.workers.is_some(),
        submitted_at: status.submitted_at,
        placement: status.placement.clone(),
        curve,
        samples: status.samples as f64,
        loss_scale: history.map_or(0.0, JobHistory::loss_scale),
        samples_per_s_per_worker: per_worker,
        attained_gpu_seconds: history.map_or(0.0, |h| h.attained_gpu_seconds(spec.gpus_per_worker)),
        model: model.map(|(m, _)| m.clone()),
        // A `[batch]` job trains with the total its generation was assigned (the reference
        // before it has one), split over its workers; a job without one keeps its program's
        // per-worker batch whatever its world size (the worker contract).
        batch: match &spec.batch {
            Some(b) => BatchSize::Total(f64::from(
                status
                    .batch
                    .as_ref()
                    .and_then(|jb| jb.plan)
                    .map_or(b.reference, |plan| plan.total),
            )),
            None => BatchSize::PerWorker(
                model.map_or(crate::throughput::DEFAULT_PRIOR_LOCAL_BATCH, |(_, b)| *b),
            ),
        },
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
                max_per_worker_by_type: spec
                    .batch
                    .as_ref()
                    .map(|b| b.max_per_worker_by_gpu_type.clone())
                    .unwrap_or_default(),
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
        exploratory: spec.is_exploratory(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::CurveFamily;

    /// `1/(k/1000 + 1) + 0`: loss 1 at 0 samples, 0.5 at 1,000, 0.1 at 9,000.
    fn curve() -> Curve {
        Curve {
            family: CurveFamily::InvLinear,
            params: vec![1e-3, 1.0, 0.0],
            rmse: 0.0,
            points: 10,
        }
    }

    #[test]
    fn declared_work_comes_first_then_the_curve_to_the_target_then_nothing() {
        let c = curve();
        // Declared: what is left of it, whatever the curve says.
        assert_eq!(
            known_remaining_work(Some(4000.0), Some(&c), Some(0.1), 1000.0),
            Some(4000.0)
        );
        // Done more than declared: nothing left, never negative.
        assert_eq!(
            known_remaining_work(Some(-20.0), Some(&c), None, 1000.0),
            Some(0.0)
        );
        // Not declared: the curve's samples to the target, less those done.
        let left = known_remaining_work(None, Some(&c), Some(0.1), 1000.0).unwrap();
        assert!((left - 8000.0).abs() < 1.0, "{left}");
        // A declared figure that is not a number falls back to the curve.
        let left = known_remaining_work(Some(f64::NAN), Some(&c), Some(0.1), 1000.0).unwrap();
        assert!((left - 8000.0).abs() < 1.0, "{left}");
        // Neither declared nor a target (or no curve): unknown.
        assert_eq!(known_remaining_work(None, Some(&c), None, 1000.0), None);
        assert_eq!(known_remaining_work(None, None, Some(0.1), 1000.0), None);
    }

    #[test]
    fn a_batch_jobs_view_splits_its_total_and_any_other_keeps_its_per_worker_batch() {
        let (curves, models, type_speeds, gradients) = Default::default();
        let fits = Fits {
            curves: &curves,
            models: &models,
            type_speeds: &type_speeds,
            gradients: &gradients,
            contention: 0.0,
        };
        let id = JobId::new("j").unwrap();
        let mut status = JobStatus::pending(id.clone(), 0.0, 0.0);
        let plain = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        assert_eq!(
            job_view(&status, &plain, None, &fits, None).batch,
            BatchSize::PerWorker(crate::throughput::DEFAULT_PRIOR_LOCAL_BATCH)
        );
        let batched = JobSpec::from_toml(
            "id = \"j\"\ncommand = [\"t\"]\n[batch]\nreference = 256\nmax_total = 1024\n",
        )
        .unwrap();
        // Before a generation has a batch: the reference, split over the workers.
        assert_eq!(
            job_view(&status, &batched, None, &fits, None).batch,
            BatchSize::Total(256.0)
        );
        // Then the total its generation trains with.
        let mut b = converge_common::JobBatch::new(256);
        b.plan = Some(converge_common::AssignedBatch {
            total: 512,
            per_worker: 128,
            accum_steps: 0,
            reference: 256,
        });
        status.batch = Some(b);
        assert_eq!(
            job_view(&status, &batched, None, &fits, None).batch,
            BatchSize::Total(512.0)
        );
    }

    #[test]
    fn an_adaptive_jobs_work_counts_samples_at_its_reference_batch() {
        let id = JobId::new("j").unwrap();
        let spec = JobSpec::from_toml(
            "id = \"j\"\ncommand = [\"t\"]\nwork_samples = 10000\n[batch]\nreference = 100\nmax_total = 1000\n",
        )
        .unwrap();
        // 4,000 samples at a batch of 400 (10 steps).
        let mut h = JobHistory::default();
        for (step, samples, time) in [(0, 0, 0.0), (10, 4000, 4.0)] {
            let mut r = converge_common::ProgressReport::new(
                id.clone(),
                1,
                0,
                HostId::new("h").unwrap(),
                step,
                samples,
                1.0,
                time,
            );
            r.workers = Some(1);
            h.add(&r);
        }
        let mut status = JobStatus::pending(id.clone(), 0.0, 0.0);
        status.samples = 4000;
        // Noise scale 300 samples at the reference batch: a batch of 400 is half as
        // efficient per sample as one of 100.
        let g = GradientStats::new(1.0, 3.0).unwrap();
        assert!((g.efficiency(100.0, 400.0) - 0.571_428_571).abs() < 1e-6);
        let (curves, models, type_speeds) = Default::default();
        let with = BTreeMap::from([(id.clone(), g)]);
        let without = BTreeMap::new();
        let fits = |gradients| Fits {
            curves: &curves,
            models: &models,
            type_speeds: &type_speeds,
            gradients,
            contention: 0.0,
        };
        // With statistics: 4,000 samples at 4/7 efficiency did 2,286 samples' worth.
        let left = job_view(&status, &spec, Some(&h), &fits(&with), None)
            .remaining_work
            .unwrap();
        assert!(
            (left - (10000.0 - 4000.0 * 4.0 / 7.0)).abs() < 1e-6,
            "{left}"
        );
        // Without, the samples done.
        let left = job_view(&status, &spec, Some(&h), &fits(&without), None)
            .remaining_work
            .unwrap();
        assert_eq!(left, 6000.0);
    }
}
