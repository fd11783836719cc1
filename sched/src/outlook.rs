//! What the allocator expects, for people to read: each job's loss prediction ahead of its
//! latest point with an uncertainty band, and each pending job's queue position and estimated
//! start. `converge dashboard` draws these; nothing here changes a decision.
//!
//! # The prediction band
//! The curve is the job's fitted curve ([`JobStatus::curve`], see [`crate::fit`]). Its band
//! at `x` samples, ahead of the latest point `k`, is `prediction(x) · (1 ± e(f))` with `f = (x
//! − k) / k`, widened to at least `± 2 · rmse` (the fit's scatter). `e(f)` is the p90 relative
//! error of this fit measured by the prediction benchmark on `converge-trainer` training-loss
//! curves (docs/prediction.md, "all (pooled)", Converge row): 30.6 % at 10 % and 49.0 % at
//! 25 % of the remaining run ahead, linear between the points, from 0 at `f = 0`, and
//! extrapolated with the last slope beyond. The benchmark measures horizons as a share of
//! the *remaining* run, which the dashboard does not know; the band assumes the job is
//! halfway (as much left as done), the same guess the quality policy makes of a job's
//! remaining work when no target loss gives it ([`crate::policies::quality::remaining_work`]).
//! It is a p90 band of measured errors, not a confidence interval of the fit.
//!
//! # Queue estimates
//! Pending jobs in order of submission (the policy may admit them in another order: the
//! quality policy admits by value per GPU). Each needs `min_workers × gpus_per_worker` GPUs.
//! Running jobs free their GPUs at their estimated end: now plus remaining samples over their
//! observed samples per second, where remaining samples are what the curve needs to reach the
//! job's target loss, else as much again as done (the policy's guess); the end comes no later
//! than a deadline or a spent GPU-hour budget of the job's `[stop]` table. A pending job starts
//! when, with the jobs ahead of it started in turn, enough GPUs are free; it then keeps them
//! (its own end is not guessed). No arrivals and no resizes are assumed. `None` when a job it
//! waits for has no throughput yet. Queues are ignored: the estimate treats the cluster as
//! one pool in submission order, without quotas, borrowing or priority classes
//! ([`crate::queues`]), so a job whose queue is at its quota may start later than shown.

use crate::fit::{Curve, samples_to_reach};
use converge_common::{JobId, JobPhase, JobSpec, JobStatus};
use serde::Serialize;
use std::collections::BTreeMap;

/// `(look-ahead as a share of the remaining run, p90 relative error)` of the allocator's fit
/// on converge-trainer training-loss curves (docs/prediction.md, pooled, Converge row).
pub const MEASURED_P90_ERROR: [(f64, f64); 2] = [(0.10, 0.306), (0.25, 0.490)];

/// How far ahead of its latest point a job's prediction is drawn, as a share of the samples
/// it has processed.
pub const LOOK_AHEAD: f64 = 0.5;

/// One point of a drawn curve: samples, predicted loss, band.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BandPoint {
    pub samples: f64,
    pub loss: f64,
    pub low: f64,
    pub high: f64,
}

/// A job's fitted curve over its history and its prediction ahead, ready to draw.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CurveOutlook {
    /// The fit over `[first sample, latest sample]`: `(samples, loss)`.
    pub fit: Vec<(f64, f64)>,
    /// The prediction from the latest sample to `(1 + LOOK_AHEAD) ×` it, with its band.
    pub ahead: Vec<BandPoint>,
    /// The curve's asymptote (the loss it predicts if the job runs on forever).
    pub asymptote: f64,
}

/// p90 relative error `e(f)` of a prediction `f` of the remaining run ahead (see the module
/// documentation): 0 at `f ≤ 0`, linear through [`MEASURED_P90_ERROR`], the last slope beyond.
pub fn relative_error(f: f64) -> f64 {
    let [(f1, e1), (f2, e2)] = MEASURED_P90_ERROR;
    if f.is_nan() || f <= 0.0 {
        0.0
    } else if f <= f1 {
        e1 * f / f1
    } else {
        e1 + (e2 - e1) * (f - f1) / (f2 - f1)
    }
}

/// The fit and the prediction band of a job whose history runs from `first_samples` to
/// `latest_samples`, `points` points each (at least 2). `None` for a curve that cannot be
/// read or a history with no samples.
pub fn curve_outlook(
    curve: &Curve,
    first_samples: f64,
    latest_samples: f64,
    points: usize,
) -> Option<CurveOutlook> {
    if !(latest_samples.is_finite() && latest_samples > 0.0 && first_samples.is_finite()) {
        return None;
    }
    let n = points.max(2);
    let first = first_samples.clamp(0.0, latest_samples);
    let at = |from: f64, to: f64, i: usize| from + (to - from) * i as f64 / (n - 1) as f64;
    let fit = (0..n)
        .map(|i| {
            let x = at(first, latest_samples, i);
            (x, curve.predict(x))
        })
        .collect();
    let end = latest_samples * (1.0 + LOOK_AHEAD);
    let ahead = (0..n)
        .map(|i| {
            let x = at(latest_samples, end, i);
            let loss = curve.predict(x);
            // Halfway assumption: the remaining run is as long as the run so far.
            let f = (x - latest_samples) / latest_samples;
            let half = (loss * relative_error(f)).max(2.0 * curve.rmse);
            BandPoint {
                samples: x,
                loss,
                low: (loss - half).max(0.0),
                high: loss + half,
            }
        })
        .collect();
    Some(CurveOutlook {
        fit,
        ahead,
        asymptote: curve.predict(f64::INFINITY),
    })
}

/// A pending job's place in the queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueEntry {
    pub job: JobId,
    /// 1-based, in order of submission among pending jobs.
    pub position: u32,
    /// GPUs it needs to start (`min_workers × gpus_per_worker`).
    pub gpus_needed: u32,
    /// Estimated start, unix seconds (`now` when it could start at once); `None` when it
    /// waits for a job with no throughput yet, or needs more GPUs than the cluster has.
    pub estimated_start: Option<f64>,
}

/// Estimated end of a running job, unix seconds (see the module documentation); `None`
/// without an observed throughput.
pub fn estimated_end(spec: &JobSpec, status: &JobStatus, now: f64) -> Option<f64> {
    let rate = status.samples_per_s.filter(|r| r.is_finite() && *r > 0.0)?;
    let done = status.samples as f64;
    let to_target = spec.target_loss().and_then(|target| {
        let curve = Curve::from_wire(status.curve.as_ref()?)?;
        samples_to_reach(&curve, target, done, done * 1e3 + 1e9).map(|k| k - done)
    });
    let remaining = to_target.unwrap_or(done).max(0.0);
    let mut end = now + remaining / rate;
    if let Some(d) = spec.stop.as_ref().and_then(|stop| stop.deadline_s) {
        end = end.min((status.submitted_at + d).max(now));
    }
    end.is_finite().then_some(end)
}

/// Queue positions and estimated starts of the pending jobs on a cluster of `total_gpus`
/// GPUs (see the module documentation).
pub fn queue_estimates(
    specs: &BTreeMap<JobId, JobSpec>,
    statuses: &BTreeMap<JobId, JobStatus>,
    total_gpus: u32,
    now: f64,
) -> Vec<QueueEntry> {
    let gpus_of = |s: &JobStatus| {
        specs
            .get(&s.job)
            .map_or(0, |spec| s.world_size * spec.gpus_per_worker)
    };
    let running: Vec<&JobStatus> = statuses
        .values()
        .filter(|s| !s.phase.is_terminal() && s.world_size > 0)
        .collect();
    let busy: u32 = running.iter().map(|s| gpus_of(s)).sum();
    let mut free = i64::from(total_gpus) - i64::from(busy);
    // (end, GPUs) of the running jobs; unknown ends last.
    let mut ends: Vec<(Option<f64>, u32)> = running
        .iter()
        .map(|s| {
            let end = specs
                .get(&s.job)
                .and_then(|spec| estimated_end(spec, s, now));
            (end, gpus_of(s))
        })
        .collect();
    ends.sort_by(|a, b| match (a.0, b.0) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    let mut ends = ends.into_iter();
    let mut pending: Vec<&JobStatus> = statuses
        .values()
        .filter(|s| s.phase == JobPhase::Pending && specs.contains_key(&s.job))
        .collect();
    pending.sort_by(|a, b| {
        a.submitted_at
            .total_cmp(&b.submitted_at)
            .then(a.job.cmp(&b.job))
    });
    let mut clock = Some(now);
    pending
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let spec = &specs[&s.job];
            let need = spec.min_workers * spec.gpus_per_worker;
            if need > total_gpus {
                clock = None;
            }
            while clock.is_some() && free < i64::from(need) {
                match ends.next() {
                    Some((Some(end), gpus)) => {
                        free += i64::from(gpus);
                        clock = clock.map(|c| c.max(end));
                    }
                    _ => clock = None,
                }
            }
            if clock.is_some() {
                free -= i64::from(need);
            }
            QueueEntry {
                job: s.job.clone(),
                position: i as u32 + 1,
                gpus_needed: need,
                estimated_start: clock,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::CurveFamily;

    fn spec(id: &str, min: u32, gpus: u32) -> JobSpec {
        JobSpec::from_toml(&format!(
            "id = \"{id}\"\ncommand = [\"true\"]\nmin_workers = {min}\ngpus_per_worker = {gpus}\n"
        ))
        .unwrap()
    }

    fn status(id: &str, phase: JobPhase, workers: u32, submitted: f64) -> JobStatus {
        let mut s = JobStatus::pending(JobId::new(id).unwrap(), submitted, submitted);
        s.phase = phase;
        s.world_size = workers;
        s
    }

    #[test]
    fn the_band_widens_ahead_and_never_goes_below_zero() {
        let curve = Curve {
            family: CurveFamily::InvLinear,
            params: vec![1e-3, 1.0, 0.1],
            rmse: 0.01,
            points: 20,
        };
        let o = curve_outlook(&curve, 100.0, 1000.0, 11).unwrap();
        assert_eq!(o.fit.len(), 11);
        assert_eq!(o.fit[0].0, 100.0);
        assert_eq!(o.ahead[0].samples, 1000.0);
        assert!((o.ahead[10].samples - 1500.0).abs() < 1e-9);
        // At the latest point only the fit's scatter remains.
        assert!((o.ahead[0].high - o.ahead[0].loss - 0.02).abs() < 1e-12);
        let widths: Vec<f64> = o.ahead.iter().map(|p| p.high - p.low).collect();
        assert!(
            widths.windows(2).all(|w| w[1] >= w[0] - 1e-12),
            "{widths:?}"
        );
        assert!(o.ahead.iter().all(|p| p.low >= 0.0 && p.low <= p.loss));
        assert!((o.asymptote - 0.1).abs() < 1e-12);
        // 10 % ahead: the measured p90.
        assert!((relative_error(0.10) - 0.306).abs() < 1e-12);
        assert!((relative_error(0.25) - 0.490).abs() < 1e-12);
        assert!(relative_error(0.5) > 0.49);
        assert_eq!(relative_error(-1.0), 0.0);
        assert!(curve_outlook(&curve, 0.0, 0.0, 5).is_none());
    }

    #[test]
    fn the_wire_curve_reads_back_and_a_bad_one_is_refused() {
        let curve = Curve {
            family: CurveFamily::InvQuadratic,
            params: vec![1e-6, 1e-3, 1.0, 0.2],
            rmse: 0.01,
            points: 20,
        };
        assert_eq!(Curve::from_wire(&curve.to_wire()), Some(curve.clone()));
        let mut bad = curve.to_wire();
        bad.params.pop();
        assert_eq!(Curve::from_wire(&bad), None);
        bad.family = "spline".into();
        assert_eq!(Curve::from_wire(&bad), None);
    }

    #[test]
    fn pending_jobs_start_as_running_jobs_end_in_submission_order() {
        let mut specs = BTreeMap::new();
        let mut statuses = BTreeMap::new();
        let now = 1000.0;
        // Two running jobs on 4 GPUs: "r1" ends in 100 s (1000 samples done at 10/s, as
        // much again left), "r2" in 300 s.
        for (id, rate) in [("r1", 10.0), ("r2", 1000.0 / 300.0)] {
            specs.insert(JobId::new(id).unwrap(), spec(id, 1, 2));
            let mut s = status(id, JobPhase::Running, 1, 0.0);
            s.samples = 1000;
            s.samples_per_s = Some(rate);
            statuses.insert(s.job.clone(), s);
        }
        // "p2" submitted before "p1"; both need 2 GPUs; "big" needs more than exist.
        for (id, min, at) in [("p1", 1, 20.0), ("p2", 1, 10.0), ("big", 3, 30.0)] {
            specs.insert(JobId::new(id).unwrap(), spec(id, min, 2));
            let s = status(id, JobPhase::Pending, 0, at);
            statuses.insert(s.job.clone(), s);
        }
        let q = queue_estimates(&specs, &statuses, 4, now);
        let got: Vec<(&str, u32, Option<f64>)> = q
            .iter()
            .map(|e| (e.job.as_str(), e.position, e.estimated_start))
            .collect();
        assert_eq!(got[0].0, "p2");
        assert_eq!(got[1].0, "p1");
        assert!((got[0].2.unwrap() - 1100.0).abs() < 1e-6, "{got:?}");
        assert!((got[1].2.unwrap() - 1300.0).abs() < 1e-6, "{got:?}");
        assert_eq!((got[2].0, got[2].1, got[2].2), ("big", 3, None));

        // Free GPUs: the first pending job starts now.
        let q = queue_estimates(&specs, &statuses, 8, now);
        assert_eq!(q[0].estimated_start, Some(now));
        assert_eq!(q[1].estimated_start, Some(now));

        // A running job without throughput: who waits for it gets no estimate.
        statuses
            .get_mut(&JobId::new("r1").unwrap())
            .unwrap()
            .samples_per_s = None;
        let q = queue_estimates(&specs, &statuses, 4, now);
        assert!(
            (q[0].estimated_start.unwrap() - 1300.0).abs() < 1e-6,
            "{q:?}"
        );
        assert_eq!(q[1].estimated_start, None);
    }
}
