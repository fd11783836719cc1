//! The batch-per-generation rule: a job keeps its batch size until its allocation changes;
//! the size a new generation starts with, from the job's batch spec and gradient statistics.

use crate::goodput::{BatchLimits, BatchPlan, GradientStats};
use crate::history::JobHistory;
use converge_common::{AssignedBatch, BatchSpec, JobBatch, JobPhase, JobSpec, JobStatus};

/// The batch limits of a `[batch]` table (`None` if they do not hold, which a validated
/// spec rules out).
pub fn batch_limits(b: &BatchSpec) -> Option<BatchLimits> {
    BatchLimits::new(
        b.reference,
        b.max_total,
        b.min_per_worker,
        b.max_per_worker(),
    )
    .ok()
}

pub(super) fn assigned(plan: BatchPlan, reference: u32) -> AssignedBatch {
    AssignedBatch {
        total: plan.total,
        per_worker: plan.per_worker,
        accum_steps: plan.accum_steps,
        reference,
    }
}

/// The batch of a `[batch]` job's new generation on `workers` workers: the decision's plan
/// when it chose one (an adaptive job under a policy that reads goodput), else the smallest
/// total the world size allows, `max(B₀, workers × min_per_worker)` (the reference batch:
/// what a job without gradient statistics keeps).
pub(super) fn generation_batch(
    spec: &JobSpec,
    workers: u32,
    decided: Option<&BatchPlan>,
) -> Option<AssignedBatch> {
    let b = spec.batch.as_ref()?;
    if workers == 0 {
        return None;
    }
    let plan = match decided {
        Some(p) => *p,
        None => batch_limits(b)?.initial_plan(workers)?,
    };
    Some(assigned(plan, b.reference))
}

/// The total batch a running `[batch]` job restarts with although its placement stays: its
/// current generation's batch was chosen without gradient statistics and the decision now
/// plans another with them (`decided`). At most once per job: later batches change only
/// with the allocation (docs/scheduling.md, "Adaptive batch sizes in the live cluster").
pub(super) fn first_statistics_batch(
    status: &JobStatus,
    spec: &JobSpec,
    decided: Option<&BatchPlan>,
) -> Option<u32> {
    let plan = decided?;
    let b = status.batch.as_ref()?;
    let current = b.plan?;
    let reference = spec.batch.as_ref()?.reference;
    (status.phase == JobPhase::Running
        && !b.planned_with_statistics
        && assigned(*plan, reference) != current)
        .then_some(plan.total)
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
