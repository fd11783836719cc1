//! The simulator comparison's placement section: `quality` over the 1.0× workloads with first
//! fit and with BCO, with and without Pollux's interference.

use super::page::{change, pct1, verdict};
use super::policy_of;
use crate::cli::{ClusterArgs, run_policy};
use crate::summary::Summary;
use anyhow::Context as _;
use converge_sched::placement::PlacementKind;
use std::fmt::Write as _;
use std::path::PathBuf;

/// One run of the placement comparison.
pub(super) struct PlacementRun {
    pub(super) kind: PlacementKind,
    pub(super) interference: f64,
    pub(super) summary: Summary,
}

/// The placement and interference of each run, in order.
const RUNS: [(PlacementKind, f64); 4] = [
    (PlacementKind::FirstFit, 0.5),
    (PlacementKind::Bco, 0.5),
    (PlacementKind::FirstFit, 0.0),
    (PlacementKind::Bco, 0.0),
];

/// `quality` on `files` with first fit and BCO, with and without Pollux's interference (0.5),
/// on `base`'s cluster otherwise; `threads` at a time.
pub(super) fn run_placement(
    base: &ClusterArgs,
    files: &[PathBuf],
    threads: usize,
) -> anyhow::Result<Vec<PlacementRun>> {
    let mut placement: Vec<PlacementRun> = Vec::new();
    for chunk in RUNS.chunks(threads.max(1)) {
        let done: Vec<anyhow::Result<PlacementRun>> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&(kind, interference)| {
                    let mut cluster = base.clone();
                    cluster.placement = kind;
                    cluster.interference = interference;
                    scope.spawn(move || -> anyhow::Result<PlacementRun> {
                        let (policy, params) = policy_of("quality", &cluster)
                            .context("the quality policy")?;
                        let (summary, _) = run_policy(policy, files, &cluster, &params)?;
                        eprintln!(
                            "quality with {kind:?} placement at interference {interference}: mean JCT {:.0} s",
                            summary.mean
                        );
                        Ok(PlacementRun {
                            kind,
                            interference,
                            summary,
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("placement thread"))
                .collect()
        });
        for d in done {
            placement.push(d?);
        }
    }
    Ok(placement)
}

/// Mean JCT of `quality` with first fit and with BCO, per interference level.
pub(super) fn placement_section(md: &mut String, runs: &[PlacementRun]) {
    if runs.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "### Placement: first fit against BCO (`quality`, eight 1.0× workloads)\n\n\
         BCO (`--placement bco`) balances contention between multi-node jobs on shared NICs \
         against the overhead of spanning nodes (`sched/src/placement.rs`, \
         `sched/src/contention.rs`, docs/scheduling.md). Interference is Pollux's rule: a \
         multi-node job runs at (1 − interference) of its speed while one of its nodes hosts \
         another multi-node job. Both placements run through `converge_sched::decide`, as in \
         the service: under BCO a job's costs, and its throughput at sizes that share a node, \
         include the contention measured so far on multi-node jobs (the service measures it \
         from its running jobs' step times). Target: at interference 0.5, BCO's mean JCT at least 15 % \
         below first fit's (Pollux's own interference avoidance: 3,903 s → 2,751 s, about \
         30 %).\n"
    );
    let _ = writeln!(
        md,
        "| interference | first fit | BCO | change | restarts per job (FF / BCO) | ≤ −15 % |\n|---|---|---|---|---|---|"
    );
    let mut levels: Vec<f64> = runs.iter().map(|r| r.interference).collect();
    levels.sort_by(|a, b| b.total_cmp(a));
    levels.dedup();
    for level in levels {
        let find = |kind| {
            runs.iter()
                .find(|r| r.kind == kind && r.interference == level)
                .map(|r| &r.summary)
        };
        let (Some(ff), Some(bco)) = (find(PlacementKind::FirstFit), find(PlacementKind::Bco))
        else {
            continue;
        };
        let c = change(bco.mean, ff.mean);
        let _ = writeln!(
            md,
            "| {level} | {:.0} | {:.0} | {} | {:.2} / {:.2} | {} |",
            ff.mean,
            bco.mean,
            pct1(c),
            ff.mean_restarts_per_job,
            bco.mean_restarts_per_job,
            if level > 0.0 {
                verdict(c, -0.15)
            } else {
                "(no target)"
            }
        );
    }
    let _ = writeln!(md);
}
