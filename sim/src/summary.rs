//! The simulator's `summary.json`: the Pollux simulator's shape (`jcts`, `avgs`, `mean`, so
//! our numbers line up with its published results) plus tail JCTs, makespan, restarts, GPU
//! utilization and average normalized loss over time, SLAQ's time to 90 % / 95 % loss
//! reduction, and the policy's decision time per interval.

use crate::engine::SimResult;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Median, 95th and 99th percentiles and maximum of a sample (nearest rank); all 0 for none.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Quantiles {
    pub p50: f64,
    #[serde(default)]
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Nearest-rank quantiles; `None` for an empty sample.
pub fn quantiles(values: &[f64]) -> Option<Quantiles> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Quantiles {
        p50: rank(0.5),
        p95: rank(0.95),
        p99: rank(0.99),
        max: v[v.len() - 1],
    })
}

/// A run's summary. Times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub policy: String,
    /// `{workload: {job: JCT}}` (Pollux's shape); unfinished jobs are left out.
    pub jcts: BTreeMap<String, BTreeMap<String, f64>>,
    /// `{workload: mean JCT}`.
    pub avgs: BTreeMap<String, f64>,
    /// Mean of `avgs`.
    pub mean: f64,
    /// Every workload's jobs all completed.
    pub finished: bool,
    pub jct: BTreeMap<String, Quantiles>,
    /// Last completion minus first submission, per workload.
    pub makespan: BTreeMap<String, f64>,
    /// Restarts (allocation changes after the first start) per job, per workload.
    pub restarts: BTreeMap<String, BTreeMap<String, u32>>,
    pub mean_restarts_per_job: f64,
    /// Seconds from submission to first placement (queueing delay) per job, per workload;
    /// jobs never placed are left out.
    #[serde(default)]
    pub waits: BTreeMap<String, BTreeMap<String, f64>>,
    /// Mean of the above over all jobs placed, seconds.
    #[serde(default)]
    pub mean_wait_s: f64,
    /// Jobs with a restart that changed their goodput by at most 10 %
    /// ([`crate::engine::JobOutcome::low_gain_restarts`]), over all workloads.
    #[serde(default)]
    pub thrashing_jobs: usize,
    /// Such restarts, over all workloads.
    #[serde(default)]
    pub low_gain_restarts: u64,
    /// Jobs the service's stop rules ended before their completion epoch (service loop),
    /// over all workloads ([`crate::engine::JobOutcome::stopped_at_loss`]).
    #[serde(default)]
    pub stopped_by_service: usize,
    /// Their mean normalized loss when stopped (0 = the loss of their completion epoch);
    /// `None` when there were none.
    #[serde(default)]
    pub mean_loss_at_stop: Option<f64>,
    /// `[(time, fraction of GPUs allocated)]` per workload, one point per interval.
    pub utilization: BTreeMap<String, Vec<(f64, f64)>>,
    pub mean_utilization: f64,
    /// `[(time, mean normalized loss of submitted unfinished jobs)]` per workload.
    pub avg_normalized_loss: BTreeMap<String, Vec<(f64, f64)>>,
    /// Time-average of the above over each workload's intervals, then averaged.
    pub mean_normalized_loss: f64,
    /// Mean over jobs of the time from submission to 90 % (95 %) of their loss reduction.
    pub mean_time_to_90: f64,
    pub mean_time_to_95: f64,
    /// Policy plus placement (and curve fits) wall time per interval, milliseconds.
    pub decision_ms: Option<Quantiles>,
    /// Wall time to simulate each workload on one thread, seconds.
    pub simulation_s: BTreeMap<String, f64>,
    /// GPU-hours held per job (restart delays included), averaged over workloads.
    #[serde(default)]
    pub gpu_hours_per_job: f64,
    /// `{application: {GPU type: GPU-hours}}` summed over all workloads (restart delays
    /// included; Sia's Figure 6 shows the shares); empty on a cluster without types.
    #[serde(default)]
    pub gpu_hours_by_type: BTreeMap<String, BTreeMap<String, f64>>,
    /// With target losses only (decision loop): the remaining-work estimates the policy was
    /// told against the truth, by share of the job's work done, in fifths
    /// ([`crate::engine::WorkEstimate`]); empty otherwise.
    #[serde(default)]
    pub work_estimates: Vec<EstimateBand>,
}

/// The remaining-work estimates of the job views whose job had done `done.0`–`done.1` of
/// its work: how many views (over all workloads), the share of them without an estimate
/// (the policy then guesses from the work done), and estimate ÷ truth of those with one
/// at the 10th, 50th and 90th percentiles (nearest rank; `None` when none had one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EstimateBand {
    pub done: (f64, f64),
    pub views: usize,
    pub without: f64,
    pub ratio: Option<[f64; 3]>,
}

/// [`Summary::work_estimates`] of `estimates`: five bands of work done.
pub fn estimate_bands(estimates: &[crate::engine::WorkEstimate]) -> Vec<EstimateBand> {
    if estimates.is_empty() {
        return Vec::new();
    }
    (0..5)
        .map(|k| {
            let (from, to) = (k as f64 / 5.0, (k + 1) as f64 / 5.0);
            let band: Vec<_> = estimates
                .iter()
                .filter(|e| e.done >= from && (e.done < to || (k == 4 && e.done <= to)))
                .collect();
            let mut ratios: Vec<f64> = band
                .iter()
                .filter_map(|e| e.ratio)
                .filter(|r| r.is_finite())
                .collect();
            ratios.sort_by(f64::total_cmp);
            let at = |q: f64| {
                let i = ((q * ratios.len() as f64).ceil() as usize).clamp(1, ratios.len());
                ratios[i - 1]
            };
            EstimateBand {
                done: (from, to),
                views: band.len(),
                without: if band.is_empty() {
                    0.0
                } else {
                    band.iter().filter(|e| e.ratio.is_none()).count() as f64 / band.len() as f64
                },
                ratio: (!ratios.is_empty()).then(|| [at(0.1), at(0.5), at(0.9)]),
            }
        })
        .collect()
}

fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = xs
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// Summarizes runs of one policy over named workloads.
pub fn summarize(policy: &str, runs: &[(String, SimResult)]) -> Summary {
    let mut s = Summary {
        policy: policy.to_string(),
        jcts: BTreeMap::new(),
        avgs: BTreeMap::new(),
        mean: 0.0,
        finished: runs.iter().all(|(_, r)| r.finished),
        jct: BTreeMap::new(),
        makespan: BTreeMap::new(),
        restarts: BTreeMap::new(),
        mean_restarts_per_job: 0.0,
        waits: BTreeMap::new(),
        mean_wait_s: 0.0,
        thrashing_jobs: 0,
        low_gain_restarts: 0,
        stopped_by_service: 0,
        mean_loss_at_stop: None,
        utilization: BTreeMap::new(),
        mean_utilization: 0.0,
        avg_normalized_loss: BTreeMap::new(),
        mean_normalized_loss: 0.0,
        mean_time_to_90: 0.0,
        mean_time_to_95: 0.0,
        decision_ms: None,
        simulation_s: BTreeMap::new(),
        gpu_hours_per_job: 0.0,
        gpu_hours_by_type: BTreeMap::new(),
        work_estimates: Vec::new(),
    };
    let mut gpu_hours = Vec::new();

    let mut all_restarts = Vec::new();
    let mut all_waits = Vec::new();
    let mut stopped_losses: Vec<f64> = Vec::new();
    let mut decisions = Vec::new();
    let mut t90 = Vec::new();
    let mut t95 = Vec::new();
    let mut util_means = Vec::new();
    let mut loss_means = Vec::new();
    for (name, r) in runs {
        let jcts: BTreeMap<String, f64> = r
            .jobs
            .iter()
            .filter_map(|j| j.completed_at.map(|c| (j.name.clone(), c - j.submitted_at)))
            .collect();
        let values: Vec<f64> = jcts.values().copied().collect();
        s.avgs.insert(name.clone(), mean(values.iter().copied()));
        if let Some(q) = quantiles(&values) {
            s.jct.insert(name.clone(), q);
        }
        s.jcts.insert(name.clone(), jcts);
        let first = r
            .jobs
            .iter()
            .map(|j| j.submitted_at)
            .fold(f64::INFINITY, f64::min);
        let last = r
            .jobs
            .iter()
            .filter_map(|j| j.completed_at)
            .fold(0.0, f64::max);
        s.makespan.insert(name.clone(), (last - first).max(0.0));
        s.restarts.insert(
            name.clone(),
            r.jobs
                .iter()
                .map(|j| (j.name.clone(), j.restarts))
                .collect(),
        );
        all_restarts.extend(r.jobs.iter().map(|j| f64::from(j.restarts)));
        let waits: BTreeMap<String, f64> = r
            .jobs
            .iter()
            .filter_map(|j| Some((j.name.clone(), j.first_placed_at? - j.submitted_at)))
            .collect();
        all_waits.extend(waits.values().copied());
        s.waits.insert(name.clone(), waits);
        s.thrashing_jobs += r.jobs.iter().filter(|j| j.low_gain_restarts > 0).count();
        stopped_losses.extend(r.jobs.iter().filter_map(|j| j.stopped_at_loss));
        s.low_gain_restarts += r
            .jobs
            .iter()
            .map(|j| u64::from(j.low_gain_restarts))
            .sum::<u64>();
        t90.extend(r.jobs.iter().filter_map(|j| j.time_to_90));
        t95.extend(r.jobs.iter().filter_map(|j| j.time_to_95));
        let util: Vec<(f64, f64)> = r
            .intervals
            .iter()
            .map(|i| (i.time, i.utilization))
            .collect();
        util_means.push(mean(util.iter().map(|p| p.1)));
        s.utilization.insert(name.clone(), util);
        let losses: Vec<(f64, f64)> = r
            .intervals
            .iter()
            .filter_map(|i| i.avg_normalized_loss.map(|l| (i.time, l)))
            .collect();
        loss_means.push(mean(losses.iter().map(|p| p.1)));
        s.avg_normalized_loss.insert(name.clone(), losses);
        decisions.extend(r.intervals.iter().map(|i| i.decision_s * 1e3));
        s.simulation_s.insert(name.clone(), r.wall_s);
        if !r.jobs.is_empty() {
            let held: f64 = r.jobs.iter().map(|j| j.gpu_seconds).sum();
            gpu_hours.push(held / 3600.0 / r.jobs.len() as f64);
        }
        for j in &r.jobs {
            for (gpu_type, seconds) in &j.gpu_seconds_by_type {
                *s.gpu_hours_by_type
                    .entry(j.application.clone())
                    .or_default()
                    .entry(gpu_type.clone())
                    .or_default() += seconds / 3600.0;
            }
        }
    }
    s.gpu_hours_per_job = mean(gpu_hours);

    s.mean = mean(s.avgs.values().copied());
    s.mean_restarts_per_job = mean(all_restarts);
    s.mean_wait_s = mean(all_waits);
    s.stopped_by_service = stopped_losses.len();
    s.mean_loss_at_stop = (!stopped_losses.is_empty()).then(|| mean(stopped_losses));
    s.mean_utilization = mean(util_means);
    s.mean_normalized_loss = mean(loss_means);
    s.mean_time_to_90 = mean(t90);
    s.mean_time_to_95 = mean(t95);
    s.decision_ms = quantiles(&decisions);
    let estimates: Vec<_> = runs
        .iter()
        .flat_map(|(_, r)| r.work_estimates.iter().copied())
        .collect();
    s.work_estimates = estimate_bands(&estimates);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::WorkEstimate;

    #[test]
    fn estimate_bands_split_by_work_done_and_count_the_views_without_one() {
        assert!(estimate_bands(&[]).is_empty());
        let e = |done: f64, ratio: Option<f64>| WorkEstimate { done, ratio };
        let bands = estimate_bands(&[
            e(0.0, None),
            e(0.1, Some(0.5)),
            e(0.19, Some(2.0)),
            e(0.1, Some(1.0)),
            e(0.5, None),
            e(1.0, Some(0.0)),
        ]);
        assert_eq!(bands.len(), 5);
        let first = &bands[0];
        assert_eq!(
            (first.done, first.views, first.without),
            ((0.0, 0.2), 4, 0.25)
        );
        assert_eq!(first.ratio, Some([0.5, 1.0, 2.0]));
        assert_eq!((bands[1].views, bands[1].ratio), (0, None));
        assert_eq!(
            (bands[2].views, bands[2].without, bands[2].ratio),
            (1, 1.0, None)
        );
        // Done = 1 counts in the last band.
        assert_eq!((bands[4].views, bands[4].ratio), (1, Some([0.0; 3])));
    }

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            quantiles(&v),
            Some(Quantiles {
                p50: 50.0,
                p95: 95.0,
                p99: 99.0,
                max: 100.0
            })
        );
        assert_eq!(quantiles(&[3.0]).unwrap().p99, 3.0);
        assert!(quantiles(&[]).is_none());
    }
}
