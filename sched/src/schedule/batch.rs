//! The batch-per-generation rule: a job keeps its batch size until its allocation changes;
//! the size a new generation starts with, from the job's batch spec and gradient statistics.

use crate::goodput::{BatchLimits, BatchPlan, GradientStats};
use crate::history::JobHistory;
use converge_common::{AssignedBatch, BatchSpec, JobBatch, JobPhase, JobSpec, JobStatus};

/// The batch limits of a `[batch]` table (`None` if they do not hold, which a validated
/// spec rules out).
pub fn batch_limits(b: &BatchSpec) -> Option<BatchLimits> {
    batch_limits_on(b, &[])
}

/// The batch limits of a `[batch]` table on hosts of the GPU types `gpu_types` (one entry
/// per host of the placement, `None` for a host without a type): the smallest micro-batch
/// any of them allows ([`BatchSpec::max_per_worker_on`]); no hosts: `max_per_worker`.
pub fn batch_limits_on(b: &BatchSpec, gpu_types: &[Option<&str>]) -> Option<BatchLimits> {
    let micro = gpu_types
        .iter()
        .map(|t| b.max_per_worker_on(*t))
        .min()
        .unwrap_or_else(|| b.max_per_worker());
    BatchLimits::new(b.reference, b.max_total, b.min_per_worker, micro).ok()
}

pub(super) fn assigned(plan: BatchPlan, reference: u32) -> AssignedBatch {
    AssignedBatch {
        total: plan.total,
        per_worker: plan.per_worker,
        accum_steps: plan.accum_steps,
        reference,
    }
}

/// The batch of a `[batch]` job's new generation on `workers` workers on hosts of the GPU
/// types `gpu_types` ([`batch_limits_on`]): the decision's plan when it chose one (an
/// adaptive job under a policy that reads goodput), else the smallest total the world size
/// allows, `max(B₀, workers × min_per_worker)` (the reference batch: what a job without
/// gradient statistics keeps), in micro-batches those types hold.
pub(super) fn generation_batch(
    spec: &JobSpec,
    workers: u32,
    gpu_types: &[Option<&str>],
    decided: Option<&BatchPlan>,
) -> Option<AssignedBatch> {
    let b = spec.batch.as_ref()?;
    if workers == 0 {
        return None;
    }
    let plan = match decided {
        Some(p) => *p,
        None => batch_limits_on(b, gpu_types)?.initial_plan(workers)?,
    };
    Some(assigned(plan, b.reference))
}

/// Least goodput gain (fraction) for which a running job restarts only to change its
/// batch ([`rebatch`]).
pub const REBATCH_MIN_GAIN: f64 = 0.10;

/// A batch-only restart must save at least this many times its restart cost ([`rebatch`]).
pub const REBATCH_PAYBACK: f64 = 3.0;

/// What [`rebatch`] weighs for a running job whose decided plan differs from its
/// generation's: its goodput (samples per second at its reference batch) with the current
/// plan and with the decided one on the same workers, the work it has left (samples at the
/// reference batch) and what a restart costs it (seconds).
#[derive(Debug, Clone, Copy)]
pub(super) struct RebatchValue {
    pub(super) current: f64,
    pub(super) decided: f64,
    pub(super) remaining_work: f64,
    pub(super) restart_cost_s: f64,
}

/// The total batch a running `[batch]` job restarts with although its placement stays,
/// and why: (1) its current generation's batch was chosen without gradient statistics and
/// the decision now plans another with them (once per job); or (2) the decided plan's
/// goodput beats the current one's by at least [`REBATCH_MIN_GAIN`] and the time it saves
/// on the work left, `W·(1/g − 1/g')`, is at least [`REBATCH_PAYBACK`] restart costs
/// (the service keeps a batch for a generation, so a batch that the growing gradient noise
/// scale has made too small is changed by a restart, at most when it pays;
/// docs/scheduling.md, "Adaptive batch sizes in the live cluster").
pub(super) fn rebatch(
    status: &JobStatus,
    spec: &JobSpec,
    decided: Option<&BatchPlan>,
    value: Option<RebatchValue>,
) -> Option<(u32, String)> {
    let plan = decided?;
    let b = status.batch.as_ref()?;
    let current = b.plan?;
    let reference = spec.batch.as_ref()?.reference;
    if status.phase != JobPhase::Running || assigned(*plan, reference) == current {
        return None;
    }
    if !b.planned_with_statistics {
        return Some((plan.total, "with its first gradient statistics".into()));
    }
    let v = value?;
    let gain = v.decided / v.current - 1.0;
    let saved = v.remaining_work * (1.0 / v.current - 1.0 / v.decided);
    (v.current > 0.0
        && gain.is_finite()
        && gain >= REBATCH_MIN_GAIN
        && saved >= REBATCH_PAYBACK * v.restart_cost_s.max(0.0))
    .then(|| {
        (
            plan.total,
            format!(
                "goodput +{:.0} %, saving about {saved:.0} s for a {:.0} s restart",
                gain * 100.0,
                v.restart_cost_s
            ),
        )
    })
}

/// Keeps a `[batch]` job's [`JobBatch`] up to date: adaptive once it has gradient
/// statistics, the current generation's plan (none without workers), the noise scale, the
/// plan's efficiency and the counts of used and ignored statistics (a finished job keeps
/// them as they were). Jobs without a `[batch]` table have none.
pub(super) fn update_batch(
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

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::JobId;

    fn running(planned_with_statistics: bool) -> (JobStatus, JobSpec) {
        let spec = JobSpec::from_toml(
            "id = \"j\"\ncommand = [\"t\"]\n[batch]\nreference = 128\nmax_total = 4096\n",
        )
        .unwrap();
        let mut status = JobStatus::pending(JobId::new("j").unwrap(), 0.0, 0.0);
        status.phase = JobPhase::Running;
        let mut b = JobBatch::new(128);
        b.plan = Some(AssignedBatch {
            total: 256,
            per_worker: 128,
            accum_steps: 0,
            reference: 128,
        });
        b.planned_with_statistics = planned_with_statistics;
        status.batch = Some(b);
        (status, spec)
    }

    const BIGGER: BatchPlan = BatchPlan {
        total: 1024,
        per_worker: 512,
        accum_steps: 0,
    };

    fn value(decided: f64, remaining_work: f64) -> Option<RebatchValue> {
        Some(RebatchValue {
            current: 100.0,
            decided,
            remaining_work,
            restart_cost_s: 30.0,
        })
    }

    #[test]
    fn a_batch_restart_happens_once_for_statistics_then_only_when_it_pays() {
        // The first statistics: once, whatever the gain.
        let (status, spec) = running(false);
        let first = rebatch(&status, &spec, Some(&BIGGER), None).unwrap();
        assert_eq!(first.0, 1024);
        assert!(first.1.contains("first gradient statistics"), "{first:?}");
        let (status, spec) = running(true);
        // No plan decided, or the same batch: nothing.
        assert_eq!(rebatch(&status, &spec, None, value(200.0, 1e9)), None);
        let same = BatchPlan {
            total: 256,
            per_worker: 128,
            accum_steps: 0,
        };
        assert_eq!(
            rebatch(&status, &spec, Some(&same), value(200.0, 1e9)),
            None
        );
        // A 5 % gain is under the least gain, however long the job.
        assert_eq!(
            rebatch(&status, &spec, Some(&BIGGER), value(105.0, 1e9)),
            None
        );
        // +50 % on 1e6 samples saves 3,333 s: worth a 30 s restart.
        let paid = rebatch(&status, &spec, Some(&BIGGER), value(150.0, 1e6)).unwrap();
        assert_eq!(paid.0, 1024);
        assert!(paid.1.contains("goodput +50 %"), "{paid:?}");
        // On 20,000 samples it saves 67 s, under 3 restarts (90 s).
        assert_eq!(
            rebatch(&status, &spec, Some(&BIGGER), value(150.0, 2e4)),
            None
        );
        // Without a model or statistics there is nothing to weigh.
        assert_eq!(rebatch(&status, &spec, Some(&BIGGER), None), None);
        // Only a running job restarts for its batch.
        let (mut status, spec) = running(false);
        status.phase = JobPhase::Restarting;
        assert_eq!(rebatch(&status, &spec, Some(&BIGGER), None), None);
    }
}
