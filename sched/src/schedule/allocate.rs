//! The decision: runs the policy over the observed job views and turns its allocations into
//! new generations with placements and batches.

use crate::contention::{HostNic, host_nic_background};
use crate::decide::{ClusterState, JobView, QueueSetup, decide_queued, priority_order};
use crate::placement::HostFree;

use super::batch::{RebatchValue, batch_limits_on, generation_batch, rebatch};
use super::lifecycle::{bump_generation, taken_ports};
use super::observe::{Fits, eligible_hosts, job_view, ring_nic_traffic};
use super::ps::{PsContext, plan_ps_jobs};
use super::{Inputs, Outcome, Settings, event, unknown_queue_message};
use converge_common::{
    ChangeCause, EventKind, HostId, HostTelemetry, JobBatch, JobId, JobPhase, JobSpec, JobStatus,
};
use std::collections::{BTreeMap, BTreeSet};

pub(super) fn allocate(
    inp: Inputs<'_>,
    settings: &Settings,
    live: &BTreeMap<&HostId, &HostTelemetry>,
    fits: Fits<'_>,
    out: &mut Outcome,
) {
    let now = inp.now;
    let active: Vec<(JobStatus, &JobSpec)> = out
        .statuses
        .values()
        .filter(|s| !s.phase.is_terminal())
        .filter_map(|s| inp.specs.get(&s.job).map(|spec| (s.clone(), spec)))
        .collect();
    let views: Vec<JobView> = active
        .iter()
        .map(|(s, spec)| {
            let hosts = eligible_hosts(spec, live);
            job_view(s, spec, inp.histories.get(&s.job), &fits, hosts)
        })
        .collect();
    let ours = ring_nic_traffic(&out.statuses, inp.specs, inp.histories);
    let nics: BTreeMap<&HostId, HostNic> = live
        .iter()
        .map(|(h, t)| {
            let scheduled = ours.get(*h).copied().unwrap_or(0.0);
            (*h, host_nic_background(&t.nics, scheduled))
        })
        .collect();
    let hosts: Vec<HostFree> = live
        .iter()
        .map(|(h, t)| HostFree {
            host: (*h).clone(),
            gpus: t.gpus.iter().map(|g| g.index).collect(),
            nic_factor: nics[h].factor,
            gpu_type: converge_common::labels::host_gpu_type(&t.labels),
            gpu_speed: converge_common::labels::host_gpu_speed(&t.labels),
        })
        .collect();
    let type_of: BTreeMap<&HostId, Option<&str>> = hosts
        .iter()
        .map(|h| (&h.host, h.gpu_type.as_deref()))
        .collect();
    // The GPU type of each host a placement uses (`None`: no type, or not live).
    let types_of = |ranks: &[converge_common::RankPlacement]| -> Vec<Option<&str>> {
        ranks
            .iter()
            .map(|r| type_of.get(&r.host).copied().flatten())
            .collect()
    };
    let queued = decide_queued(
        &ClusterState {
            now,
            hosts: &hosts,
            contention_per_shared_job: fits.contention,
        },
        &views,
        settings.policy.as_ref(),
        settings.placement,
        &QueueSetup {
            specs: inp.queues,
            previous: inp.queue_statuses,
            half_life_s: settings.usage_half_life_s,
        },
    );
    out.queue_statuses = queued.statuses;
    let preempted = queued.preempted;
    let unknown_queue = queued.unknown_queue;
    let decision = queued.allocation;
    let mut placed = decision.placements;
    let batches = decision.batches;
    // Every active job's speed per GPU type, as the decision estimated it (empty on one
    // type), whether or not its placement changes.
    let mut type_speeds = decision.gpu_type_speeds;
    for view in &views {
        if let Some(status) = out.statuses.get_mut(&view.id) {
            status.gpu_type_speeds = type_speeds.remove(&view.id).unwrap_or_default();
        }
    }
    // Priority order, as the decision placed them.
    let mut slots: Vec<Option<(JobStatus, &JobSpec)>> = active.into_iter().map(Some).collect();
    let active: Vec<(JobStatus, &JobSpec)> = priority_order(&views)
        .into_iter()
        .filter_map(|i| slots[i].take())
        .collect();
    let shards = plan_ps_jobs(
        &PsContext {
            settings,
            live,
            nics: &nics,
            histories: inp.histories,
            models: fits.models,
        },
        &active,
        &mut placed,
    );

    let views_by_id: BTreeMap<&JobId, &JobView> = views.iter().map(|v| (&v.id, v)).collect();
    let mut taken_ports = taken_ports(out);
    for (s, spec) in &active {
        let new_placement = placed.get(&s.job).cloned().unwrap_or_default();
        let new_shards = shards.get(&s.job).cloned().unwrap_or_default();
        let decided = batches.get(&s.job);
        let value = rebatch_value(
            s,
            spec,
            &types_of(&s.placement),
            decided,
            views_by_id.get(&s.job).copied(),
            &fits,
            settings,
        );
        let rebatch = rebatch(s, spec, decided, value);
        if new_placement == s.placement && new_shards == s.ps_placement && rebatch.is_none() {
            if let Some(queue) = unknown_queue.get(&s.job) {
                let status = out
                    .statuses
                    .get_mut(&s.job)
                    .expect("active jobs have statuses");
                status.message = Some(unknown_queue_message(queue));
            }
            continue;
        }
        let status = out
            .statuses
            .get_mut(&s.job)
            .expect("active jobs have statuses");
        let from = status.world_size;
        let moved = new_placement != status.placement;
        status.world_size = new_placement.len() as u32;
        status.placement = new_placement;
        status.ps_placement = new_shards;
        // A batch changes only with a new generation (the workers read it when they start).
        let batch = generation_batch(
            spec,
            status.world_size,
            &types_of(&status.placement),
            decided,
        );
        let old_total = status.batch.as_ref().and_then(|b| b.plan).map(|p| p.total);
        if let Some(plan) = batch {
            let b = status
                .batch
                .get_or_insert_with(|| JobBatch::new(plan.reference));
            b.plan = Some(plan);
            b.planned_with_statistics = decided.is_some();
        } else if let Some(b) = status.batch.as_mut() {
            b.plan = None;
        }
        bump_generation(status, &mut taken_ports);
        if status.world_size == 0 {
            status.phase = JobPhase::Pending;
            status.message = Some(match (unknown_queue.get(&s.job), preempted.get(&s.job)) {
                (Some(queue), _) => unknown_queue_message(queue),
                (None, Some(why)) => format!("{why}; waiting for GPUs"),
                (None, None) => "preempted: waiting for GPUs".into(),
            });
        } else {
            status.phase = JobPhase::Restarting;
            status.message = None;
        }
        let to = status.world_size;
        let policy = settings.policy.name();
        let (cause, reason) = match (rebatch, old_total) {
            (Some((total, why)), Some(old)) if from == to && !moved => (
                ChangeCause::Batch,
                format!(
                    "job {}: batch {old} -> {total} samples per step {why}, {from} workers (generation {})",
                    status.job, status.generation
                ),
            ),
            _ => {
                let cause = if to == 0 {
                    ChangeCause::Preempted
                } else if from == 0 {
                    ChangeCause::Started
                } else if to > from {
                    ChangeCause::Grown
                } else if to < from {
                    ChangeCause::Shrunk
                } else {
                    ChangeCause::Moved
                };
                let why = match cause {
                    ChangeCause::Preempted => {
                        match (unknown_queue.get(&status.job), preempted.get(&status.job)) {
                            (Some(queue), _) => unknown_queue_message(queue),
                            (None, Some(why)) => why.clone(),
                            (None, None) => format!(
                                "preempted by the {policy} policy (its GPUs went to other jobs)"
                            ),
                        }
                    }
                    ChangeCause::Moved => "placement moved its workers".to_string(),
                    _ => format!("{} by the {policy} policy", cause.as_str()),
                };
                (
                    cause,
                    format!(
                        "job {}: {from} -> {to} workers (generation {}): {why}",
                        status.job, status.generation
                    ),
                )
            }
        };
        status.record_allocation(now, from, cause, reason.clone());
        out.events.push(event(
            now,
            EventKind::AllocationChanged {
                job: status.job.clone(),
                generation: status.generation,
                from_workers: from,
                to_workers: to,
            },
            reason,
        ));
    }
}

/// What [`rebatch`] weighs for a running job with a decided plan: its goodput with its
/// generation's plan and with the decided one on its current workers, in the micro-batches
/// the GPU types of its hosts hold (`gpu_types`, [`batch_limits_on`]; its throughput model
/// and gradient statistics), its remaining work as the decision saw it (else the work done,
/// the policies' guess) and its measured restart cost (else the policy's default). `None`
/// without a model, statistics, limits or a current plan.
fn rebatch_value(
    status: &JobStatus,
    spec: &JobSpec,
    gpu_types: &[Option<&str>],
    decided: Option<&crate::goodput::BatchPlan>,
    view: Option<&JobView>,
    fits: &Fits<'_>,
    settings: &Settings,
) -> Option<RebatchValue> {
    let decided = decided?;
    let current = status.batch.as_ref()?.plan?;
    let limits = batch_limits_on(spec.batch.as_ref()?, gpu_types)?;
    let (model, _) = fits.models.get(&status.job)?;
    let gradient = fits.gradients.get(&status.job)?;
    let view = view?;
    let workers = status.world_size;
    let nodes = status
        .placement
        .iter()
        .map(|r| &r.host)
        .collect::<BTreeSet<_>>()
        .len() as u32;
    let goodput = |plan: &crate::goodput::BatchPlan| {
        crate::goodput::goodput(model, Some(gradient), &limits, workers, nodes, plan)
    };
    let now = crate::goodput::BatchPlan {
        total: current.total,
        per_worker: current.per_worker,
        accum_steps: current.accum_steps,
    };
    Some(RebatchValue {
        current: goodput(&now),
        decided: goodput(decided),
        remaining_work: view.remaining_work.unwrap_or(view.samples),
        restart_cost_s: view
            .restart_cost_s
            .unwrap_or(settings.policy_params.restart_cost_s),
    })
}
