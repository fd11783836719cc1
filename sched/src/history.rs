//! Per-job progress history rebuilt from the progress stream: the loss curve the fit sees
//! (rank 0's reports, progress in samples) and the throughput of each generation.
//! Pure data structure: no I/O, no clock.

use crate::fit::LossPoint;
use crate::goodput::GradientStats;
use crate::throughput::StepObservation;
use converge_common::{GradientReading, HostId, ProgressReport};
use std::collections::{BTreeMap, BTreeSet};

/// What is known of one generation: highest rank seen + 1, hosts seen reporting, and the
/// workers and hosts its reports declare.
type Shape = (u32, BTreeSet<HostId>, Option<u32>, Option<u32>);

/// Generations whose shape (world size, hosts) is remembered for the throughput model.
pub const MAX_GENERATIONS: usize = 64;

/// Points kept per job; the fit uses only the most recent `FitConfig::window` of them.
pub const MAX_POINTS: usize = 2_000;

/// Gradient observations kept per job (rank 0's valid `grad_sqr`/`grad_var` pairs).
pub const MAX_GRADIENT_POINTS: usize = 2_000;

/// Smoothing of the gradient statistics per reference batch of samples, as AdaptDL's
/// `GradientNoiseScale` (`0.999^(B/B₀)` per step of total batch `B`): an observation
/// covering `n` samples decays the earlier ones by `0.999^(n/B₀)`, so the estimate
/// remembers about the last thousand reference batches.
pub const GRADIENT_SMOOTHING: f64 = 0.999;

/// One valid gradient observation of rank 0: the worker's `grad_sqr` and `grad_var` (per
/// sample) for the samples since its previous report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradientPoint {
    /// The report's samples (job total).
    pub samples: u64,
    /// Samples the observation covers (since the previous rank-0 report; 0 when unknown).
    pub covered: u64,
    pub sqr: f64,
    pub var: f64,
}

/// One progress report of rank 0.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgressPoint {
    pub generation: u64,
    pub step: u64,
    pub samples: u64,
    pub loss: f64,
    pub eval_loss: Option<f64>,
    /// UNIX seconds.
    pub time: f64,
    /// Seconds per step spent synchronizing, mean over the steps since the previous report
    /// (as the worker sent it; finite and >= 0 after decoding).
    pub sync_time_s: Option<f64>,
}

/// A job's progress history.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobHistory {
    points: Vec<ProgressPoint>,
    first_loss: Option<f64>,
    latest_generation: u64,
    last_eval_loss: Option<f64>,
    /// The latest model size rank 0 reported (bytes).
    model_bytes: Option<u64>,
    /// Reports dropped because they came from a generation older than one already seen.
    pub stale_reports: u64,
    /// Per generation, the ranks and hosts seen reporting (its world size and servers
    /// spanned), for the last [`MAX_GENERATIONS`] generations.
    shapes: BTreeMap<u64, Shape>,
    /// Rank-0 points kept since the history began or was last cut back (a resume from an
    /// earlier checkpoint).
    added: usize,
    /// Times the history was cut back (a resume from an earlier checkpoint); a fit cache
    /// keys on it ([`crate::fit_cache::FitCache`]).
    resets: u64,
    /// Worker-seconds of service received: per rank-0 report, the time since the previous
    /// rank-0 report of the same generation times that generation's world size.
    attained_worker_seconds: f64,
    /// Generation and time of the latest rank-0 report (not affected by cuts).
    last_report: Option<(u64, f64)>,
    /// Rank 0's valid gradient statistics, oldest first (cut back with the points).
    gradient: Vec<GradientPoint>,
    /// Rank-0 reports with valid gradient statistics (not affected by cuts).
    pub gradient_reports: u64,
    /// Samples in one epoch of the job's training set: rank 0's latest report with an
    /// `epoch` field, `samples / epoch` (the plateau rule of [`crate::stop`]).
    epoch_samples: Option<f64>,
    /// Rank-0 reports whose gradient statistics were ignored: one of the pair missing, not
    /// finite, negative or both 0 ([`GradientReading::Invalid`]). The report's loss counts.
    pub ignored_gradient_stats: u64,
}

impl JobHistory {
    /// Adds a report. Only rank 0's reports form the curve (ranks of a data-parallel job
    /// report the same global loss). Reports of a generation older than the newest seen are
    /// stale (a fenced worker) and dropped. A report whose samples fall below the last
    /// point's (the job resumed from an earlier checkpoint) drops the points beyond it: that
    /// work was lost and will be redone.
    pub fn add(&mut self, r: &ProgressReport) {
        if r.generation + (MAX_GENERATIONS as u64) > self.latest_generation {
            let shape = self.shapes.entry(r.generation).or_default();
            shape.0 = shape.0.max(r.rank.saturating_add(1));
            if shape.1.len() < 4096 {
                shape.1.insert(r.host.clone());
            }
            // The agent's figures from the assignment, when it sends them, over what the
            // reporting ranks show (usually rank 0 alone).
            if let Some(w) = r.workers.filter(|&w| w > 0) {
                shape.2 = Some(w);
            }
            if let Some(h) = r.hosts.filter(|&h| h > 0) {
                shape.3 = Some(h);
            }
            while self.shapes.len() > MAX_GENERATIONS {
                self.shapes.pop_first();
            }
        }
        if r.rank != 0 {
            return;
        }
        if r.generation < self.latest_generation {
            self.stale_reports += 1;
            return;
        }
        self.latest_generation = r.generation;
        if self.first_loss.is_none() {
            self.first_loss = Some(r.line.loss);
        }
        if r.line.eval_loss.is_some() {
            self.last_eval_loss = r.line.eval_loss;
        }
        if r.line.model_bytes.is_some() {
            self.model_bytes = r.line.model_bytes;
        }
        if let Some(e) = r.line.epoch.filter(|e| e.is_finite() && *e > 0.0)
            && r.line.samples > 0
        {
            let per_epoch = r.line.samples as f64 / e;
            if per_epoch.is_finite() && per_epoch >= 1.0 {
                self.epoch_samples = Some(per_epoch);
            }
        }
        let mut cut = false;
        while self
            .points
            .last()
            .is_some_and(|p| p.samples > r.line.samples)
        {
            self.points.pop();
            cut = true;
        }
        if cut {
            self.added = self.points.len();
            self.resets += 1;
        }
        while self
            .gradient
            .last()
            .is_some_and(|g| g.samples > r.line.samples)
        {
            self.gradient.pop();
        }
        match r.gradient() {
            GradientReading::Absent => {}
            GradientReading::Invalid => self.ignored_gradient_stats += 1,
            GradientReading::Valid { sqr, var } => {
                self.gradient_reports += 1;
                let covered = self
                    .points
                    .last()
                    .map_or(0, |p| r.line.samples.saturating_sub(p.samples));
                self.gradient.push(GradientPoint {
                    samples: r.line.samples,
                    covered,
                    sqr,
                    var,
                });
                if self.gradient.len() > MAX_GRADIENT_POINTS {
                    let excess = self.gradient.len() - MAX_GRADIENT_POINTS;
                    self.gradient.drain(..excess);
                }
            }
        }
        if let Some((_, prev)) = self.last_report.filter(|(g, _)| *g == r.generation) {
            let dt = r.time - prev;
            let workers = self
                .shapes
                .get(&r.generation)
                .map_or(1, |s| s.2.unwrap_or(s.0).max(1));
            if dt.is_finite() && dt > 0.0 {
                self.attained_worker_seconds += dt * f64::from(workers);
            }
        }
        if r.time.is_finite() && self.last_report.is_none_or(|(_, t)| r.time >= t) {
            self.last_report = Some((r.generation, r.time));
        }
        self.added += 1;
        self.points.push(ProgressPoint {
            generation: r.generation,
            step: r.line.step,
            samples: r.line.samples,
            loss: r.line.loss,
            eval_loss: r.line.eval_loss,
            time: r.time,
            sync_time_s: r.line.sync_s.filter(|s| s.is_finite() && *s >= 0.0),
        });
        if self.points.len() > MAX_POINTS {
            let excess = self.points.len() - MAX_POINTS;
            self.points.drain(..excess);
        }
    }

    /// The samples done, each counted at `efficiency` of the total batch it was processed
    /// at: with the statistical efficiency relative to a job's reference batch
    /// ([`crate::goodput::GradientStats::efficiency`]), the work done in samples at the
    /// reference batch (Pollux's scale-invariant progress), the unit of a goodput. The batch of
    /// the span between two consecutive rank-0 points is its samples over its steps; the
    /// samples up to the first point kept count at the first point's batch (its samples over
    /// its steps). A span without steps counts at efficiency 1, one that goes back (work
    /// redone from a checkpoint) not at all. 0 without points.
    pub fn samples_at(&self, efficiency: impl Fn(f64) -> f64) -> f64 {
        let at = |samples: f64, steps: u64| {
            if steps == 0 {
                samples
            } else {
                let e = efficiency(samples / steps as f64);
                samples * if e.is_finite() && e >= 0.0 { e } else { 1.0 }
            }
        };
        let Some(first) = self.points.first() else {
            return 0.0;
        };
        let mut done = at(first.samples as f64, first.step);
        for pair in self.points.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.samples > a.samples {
                done += at(
                    (b.samples - a.samples) as f64,
                    b.step.saturating_sub(a.step),
                );
            }
        }
        done
    }

    pub fn points(&self) -> &[ProgressPoint] {
        &self.points
    }
    pub fn latest(&self) -> Option<&ProgressPoint> {
        self.points.last()
    }
    pub fn first_loss(&self) -> Option<f64> {
        self.first_loss
    }
    /// The mean of the latest `n` reported losses (fewer when fewer are kept; `None` with no
    /// report or `n == 0`). Losses of every generation count: a restart resumes from a
    /// checkpoint, so its losses continue the curve.
    pub fn recent_loss(&self, n: usize) -> Option<f64> {
        let tail: Vec<f64> = self.points.iter().rev().take(n).map(|p| p.loss).collect();
        (!tail.is_empty()).then(|| tail.iter().sum::<f64>() / tail.len() as f64)
    }
    pub fn last_eval_loss(&self) -> Option<f64> {
        self.last_eval_loss
    }
    /// Bytes of the parameters the job synchronizes, from rank 0's latest report that had
    /// the figure (`None` if no worker reported it).
    pub fn model_bytes(&self) -> Option<u64> {
        self.model_bytes
    }

    /// Samples in one epoch, from rank 0's reports of `epoch` (`None` if it sends none).
    pub fn epoch_samples(&self) -> Option<f64> {
        self.epoch_samples
    }

    /// Rank-0 points added since the history began or was last cut back.
    pub fn added(&self) -> usize {
        self.added
    }

    /// Times the history was cut back (a resume from an earlier checkpoint).
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// GPU-seconds of service the job has received, as its reports show it: for each pair of
    /// consecutive rank-0 reports of one generation, the time between them times the
    /// generation's world size times `gpus_per_worker` (Tiresias's attained service). Time
    /// before a generation's first report (start-up, restore) does not count; time whose
    /// points were later cut (a resume from an earlier checkpoint) still does, once: the
    /// total is kept as reports arrive. A history rebuilt from the progress stream counts
    /// only the reports the stream still holds (its per-job limit), so after an allocator
    /// restart a long job's figure can be lower than before.
    pub fn attained_gpu_seconds(&self, gpus_per_worker: u32) -> f64 {
        self.attained_worker_seconds * f64::from(gpus_per_worker)
    }

    /// The curve the fit sees: (samples, loss) of every kept point.
    pub fn loss_points(&self) -> Vec<LossPoint> {
        self.points
            .iter()
            .map(|p| LossPoint {
                samples: p.samples as f64,
                loss: p.loss,
            })
            .collect()
    }

    /// The held-out curve: (samples, eval_loss) of every kept point that carries a finite
    /// held-out loss.
    pub fn eval_points(&self) -> Vec<LossPoint> {
        self.points
            .iter()
            .filter_map(|p| {
                let v = p.eval_loss.filter(|v| v.is_finite())?;
                Some(LossPoint {
                    samples: p.samples as f64,
                    loss: v,
                })
            })
            .collect()
    }

    /// Observed loss range (max − min) of the kept points: the per-job scale that turns a
    /// predicted loss drop into a normalized gain (SLAQ normalizes per job so jobs with
    /// different loss scales compare). 0 with fewer than two points.
    pub fn loss_scale(&self) -> f64 {
        let (lo, hi) = self
            .points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.loss), hi.max(p.loss))
            });
        if hi > lo { hi - lo } else { 0.0 }
    }

    /// Throughput of `generation` in samples per second, from its first and last report;
    /// `None` with fewer than two reports or no elapsed time.
    pub fn samples_per_s(&self, generation: u64) -> Option<f64> {
        let mut it = self.points.iter().filter(|p| p.generation == generation);
        let first = it.next()?;
        let last = it.next_back()?;
        let dt = last.time - first.time;
        (dt > 0.0 && last.samples > first.samples)
            .then(|| (last.samples - first.samples) as f64 / dt)
    }

    /// Seconds of progress one restart cost this job, measured on its own restarts: for each
    /// change of generation between consecutive rank-0 points, the time between the last
    /// report of the old generation and the first of the new one, less the time the steps
    /// between them take at the new generation's step time (checkpoint, stop, start,
    /// rendezvous and any work redone from an older checkpoint remain). The median over the
    /// restarts kept in the history; `None` when no restart is measurable (a new generation
    /// needs two reports for its step time).
    pub fn restart_cost_s(&self) -> Option<f64> {
        // Per generation: its first and last point (points are in generation order).
        let mut spans: Vec<(&ProgressPoint, &ProgressPoint)> = Vec::new();
        for p in &self.points {
            match spans.last_mut() {
                Some((first, last)) if first.generation == p.generation => *last = p,
                _ => spans.push((p, p)),
            }
        }
        let costs: Vec<f64> = spans
            .windows(2)
            .filter_map(|w| {
                let ((_, old), (first, last)) = (w[0], w[1]);
                let steps = last.step.checked_sub(first.step).filter(|&s| s > 0)?;
                let step_s = (last.time - first.time) / steps as f64;
                let between = first.step.saturating_sub(old.step) as f64;
                let stall = (first.time - old.time) - between * step_s;
                stall.is_finite().then_some(stall.max(0.0))
            })
            .collect();
        crate::gpu_types::median(costs)
    }

    /// The hosts seen reporting for `generation` (empty when unknown or forgotten).
    pub fn generation_hosts(&self, generation: u64) -> impl Iterator<Item = &HostId> {
        self.shapes.get(&generation).into_iter().flat_map(|s| &s.1)
    }

    /// One step-time observation per generation with at least two rank-0 reports that
    /// advanced the step count: world size and servers spanned from the ranks and hosts seen
    /// reporting, seconds per step and samples per worker per step from the first and last
    /// report (samples are the job's total). Oldest first, each with its generation.
    ///
    /// The synchronization time per step covers the same steps as the step time (those after
    /// the generation's first report): the mean of the reports' `sync_time_s` after the first,
    /// each weighted by the steps it covers (its step minus the previous report's). Reports
    /// without the figure are left out of the mean; `None` when none after the first has it.
    pub fn step_observations(&self) -> Vec<(u64, StepObservation)> {
        let mut out = Vec::new();
        for (&generation, (ranks_seen, hosts_seen, declared_workers, declared_hosts)) in
            &self.shapes
        {
            let world = &declared_workers.unwrap_or(*ranks_seen);
            let hosts = declared_hosts.unwrap_or(hosts_seen.len() as u32);
            let mut it = self.points.iter().filter(|p| p.generation == generation);
            let (Some(first), Some(last)) = (it.next(), it.next_back()) else {
                continue;
            };
            let steps = last.step.saturating_sub(first.step);
            let dt = last.time - first.time;
            if steps == 0 || dt <= 0.0 || last.samples <= first.samples || *world == 0 {
                continue;
            }
            let per_step = (last.samples - first.samples) as f64 / steps as f64;
            let seen = StepObservation {
                workers: *world,
                nodes: hosts.max(1),
                local_batch: per_step / f64::from(*world),
                step_time_s: dt / steps as f64,
                sync_time_s: self.sync_time_s(generation),
            };
            if seen.is_usable() {
                out.push((generation, seen));
            }
        }
        out
    }

    /// Step-weighted mean synchronization time per step of `generation`'s rank-0 reports
    /// after its first (see [`JobHistory::step_observations`]).
    fn sync_time_s(&self, generation: u64) -> Option<f64> {
        let points: Vec<&ProgressPoint> = self
            .points
            .iter()
            .filter(|p| p.generation == generation)
            .collect();
        let (mut total, mut steps) = (0.0, 0u64);
        for pair in points.windows(2) {
            let covered = pair[1].step.saturating_sub(pair[0].step);
            if let Some(s) = pair[1].sync_time_s
                && covered > 0
            {
                total += s * covered as f64;
                steps += covered;
            }
        }
        let mean = total / steps as f64;
        (steps > 0 && mean.is_finite()).then_some(mean)
    }

    /// The job's gradient statistics for a reference batch of `reference_batch` samples
    /// ([`GradientStats`]: `sqr`, and `var` of a gradient averaged over `reference_batch`
    /// samples, i.e. the reported per-sample `grad_var / reference_batch`): bias-corrected
    /// exponential moving averages of rank 0's valid observations, each decaying the earlier
    /// ones by [`GRADIENT_SMOOTHING`]`^(covered / reference_batch)` (an observation whose
    /// coverage is unknown counts as one reference batch), as AdaptDL's
    /// `GradientNoiseScale`. `None` before any valid observation.
    pub fn gradient_estimate(&self, reference_batch: u32) -> Option<GradientStats> {
        let b0 = f64::from(reference_batch.max(1));
        let (mut sqr, mut var, mut unbias) = (0.0, 0.0, 0.0);
        for g in &self.gradient {
            let scale = if g.covered > 0 {
                g.covered as f64 / b0
            } else {
                1.0
            };
            let theta = GRADIENT_SMOOTHING.powf(scale);
            sqr = theta * sqr + (1.0 - theta) * g.sqr;
            var = theta * var + (1.0 - theta) * g.var;
            unbias = theta * unbias + (1.0 - theta);
        }
        if unbias <= 0.0 {
            return None;
        }
        GradientStats::new(sqr / unbias, var / unbias / b0)
    }

    /// Rank 0's valid gradient observations kept, oldest first.
    pub fn gradient_points(&self) -> &[GradientPoint] {
        &self.gradient
    }

    pub fn latest_rate(&self) -> Option<(u64, f64)> {
        let mut gens: Vec<u64> = self.points.iter().map(|p| p.generation).collect();
        gens.dedup();
        gens.iter()
            .rev()
            .find_map(|&g| self.samples_per_s(g).map(|r| (g, r)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use converge_common::{HostId, JobId};

    /// A report of job `j`'s `rank` on host `h` (step = samples / 10, no optional fields).
    pub(crate) fn report(
        generation: u64,
        rank: u32,
        samples: u64,
        loss: f64,
        time: f64,
    ) -> ProgressReport {
        let (job, host) = (JobId::new("j").unwrap(), HostId::new("h").unwrap());
        ProgressReport::new(
            job,
            generation,
            rank,
            host,
            samples / 10,
            samples,
            loss,
            time,
        )
    }

    fn with_gradient(mut r: ProgressReport, sqr: Option<f64>, var: Option<f64>) -> ProgressReport {
        r.line.grad_sqr = sqr;
        r.line.grad_var = var;
        r
    }

    #[test]
    fn gradient_statistics_are_smoothed_and_normalized_to_the_reference_batch() {
        let mut h = JobHistory::default();
        assert_eq!(h.gradient_estimate(64), None);
        // Constant statistics: the bias-corrected average is exact from the first report.
        for i in 1..=5u64 {
            h.add(&with_gradient(
                report(1, 0, i * 640, 1.0, i as f64),
                Some(0.5),
                Some(32.0),
            ));
        }
        let g = h.gradient_estimate(64).unwrap();
        assert!(
            (g.sqr - 0.5).abs() < 1e-12 && (g.var - 0.5).abs() < 1e-12,
            "{g:?}"
        );
        // Noise scale in samples: grad_var / grad_sqr, whatever the reference.
        assert!((g.noise_scale(64.0) - 64.0).abs() < 1e-9);
        assert!((h.gradient_estimate(16).unwrap().noise_scale(16.0) - 64.0).abs() < 1e-9);
        assert_eq!((h.gradient_reports, h.ignored_gradient_stats), (5, 0));
        // A change moves the estimate towards the new value, by more for more samples.
        let mut a = h.clone();
        let mut b = h.clone();
        a.add(&with_gradient(
            report(1, 0, 3840, 1.0, 6.0),
            Some(1.5),
            Some(32.0),
        ));
        b.add(&with_gradient(
            report(1, 0, 3200 + 6400, 1.0, 6.0),
            Some(1.5),
            Some(32.0),
        ));
        let (ea, eb) = (
            a.gradient_estimate(64).unwrap(),
            b.gradient_estimate(64).unwrap(),
        );
        assert!(
            0.5 < ea.sqr && ea.sqr < eb.sqr && eb.sqr < 1.5,
            "{ea:?} {eb:?}"
        );
    }

    #[test]
    fn bad_gradient_statistics_are_counted_and_never_reach_the_estimate_or_the_curve() {
        let mut h = JobHistory::default();
        h.add(&with_gradient(
            report(1, 0, 100, 2.0, 1.0),
            Some(1.0),
            Some(4.0),
        ));
        let before = h.gradient_estimate(10).unwrap();
        let bad = [
            (Some(f64::NAN), Some(1.0)),
            (Some(-1.0), Some(1.0)),
            (Some(1.0), None),
            (None, Some(f64::INFINITY)),
            (Some(0.0), Some(0.0)),
        ];
        for (i, (s, v)) in bad.into_iter().enumerate() {
            let samples = 200 + 100 * i as u64;
            h.add(&with_gradient(
                report(1, 0, samples, 1.0, 2.0 + i as f64),
                s,
                v,
            ));
        }
        assert_eq!(h.ignored_gradient_stats, 5);
        assert_eq!(h.gradient_reports, 1);
        assert_eq!(h.gradient_estimate(10).unwrap(), before);
        // Their losses are kept.
        assert_eq!(h.loss_points().len(), 6);
        // Other ranks' statistics are not the job's (rank 0 sees the averaged gradient).
        h.add(&with_gradient(
            report(1, 1, 800, 1.0, 9.0),
            Some(9.0),
            Some(9.0),
        ));
        assert_eq!(h.gradient_reports, 1);
        // A resume from an earlier checkpoint drops the observations beyond it.
        h.add(&report(1, 0, 50, 2.0, 10.0));
        assert_eq!(h.gradient_estimate(10), None);
    }

    fn on(mut r: ProgressReport, host: &str) -> ProgressReport {
        r.host = HostId::new(host).unwrap();
        r
    }

    #[test]
    fn attained_service_counts_each_generations_world_size_and_survives_a_cut() {
        let mut h = JobHistory::default();
        // Generation 1: two workers (rank 1 reports too), reports 10 s apart.
        h.add(&report(1, 0, 100, 1.0, 0.0));
        h.add(&report(1, 1, 100, 1.0, 0.0));
        h.add(&report(1, 0, 200, 0.9, 10.0));
        h.add(&report(1, 0, 300, 0.8, 20.0));
        assert_eq!(h.attained_gpu_seconds(1), 40.0);
        assert_eq!(h.attained_gpu_seconds(4), 160.0);
        // Generation 2 declares 3 workers; its first report adds nothing (restart time).
        let mut r = report(2, 0, 300, 0.8, 50.0);
        r.workers = Some(3);
        h.add(&r);
        let mut r = report(2, 0, 400, 0.7, 55.0);
        r.workers = Some(3);
        h.add(&r);
        assert_eq!(h.attained_gpu_seconds(1), 55.0);
        // A resume from an earlier checkpoint cuts points, not the service received.
        let mut r = report(3, 0, 150, 0.95, 60.0);
        r.workers = Some(3);
        h.add(&r);
        assert_eq!(h.resets(), 1);
        assert_eq!(h.attained_gpu_seconds(1), 55.0);
        // A worker restarted within generation 3 resumes from an earlier checkpoint: the
        // time since the previous report counts once, not again from an older point.
        for (samples, time) in [(250, 70.0), (120, 75.0)] {
            let mut r = report(3, 0, samples, 0.9, time);
            r.workers = Some(3);
            h.add(&r);
        }
        assert_eq!(h.resets(), 2);
        assert_eq!(h.attained_gpu_seconds(1), 55.0 + 3.0 * 10.0 + 3.0 * 5.0);
    }

    #[test]
    fn recent_loss_is_the_mean_of_the_latest_reports_kept() {
        let mut h = JobHistory::default();
        assert_eq!(h.recent_loss(5), None);
        h.add(&report(1, 0, 100, 0.9, 1.0));
        h.add(&report(1, 0, 200, 0.7, 2.0));
        assert_eq!(h.recent_loss(0), None);
        // Fewer reports than asked: the mean of those there are.
        assert!((h.recent_loss(5).unwrap() - 0.8).abs() < 1e-12);
        for (samples, loss) in [(300, 0.6), (400, 0.5), (500, 0.4), (600, 0.3)] {
            h.add(&report(1, 0, samples, loss, samples as f64 / 100.0));
        }
        // The latest five: 0.7, 0.6, 0.5, 0.4, 0.3.
        assert!((h.recent_loss(5).unwrap() - 0.5).abs() < 1e-12);
        assert!((h.recent_loss(1).unwrap() - 0.3).abs() < 1e-12);
        // A resume from an earlier checkpoint drops the points past it: the mean is of the
        // losses on the path the job resumes from (0.9, 0.7 and the new 0.75).
        h.add(&report(2, 0, 250, 0.75, 10.0));
        assert_eq!(h.resets(), 1);
        assert!((h.recent_loss(5).unwrap() - (0.9 + 0.7 + 0.75) / 3.0).abs() < 1e-12);
    }

    #[test]
    fn step_observations_take_world_size_and_hosts_from_the_reports() {
        let mut h = JobHistory::default();
        // Generation 1: two ranks on one host, 10 samples per step (step = samples / 10).
        h.add(&report(1, 0, 100, 1.0, 10.0));
        h.add(&report(1, 1, 100, 1.0, 10.0));
        h.add(&report(1, 0, 300, 0.9, 12.0));
        // Generation 2: three ranks on two hosts.
        h.add(&report(2, 0, 400, 0.8, 20.0));
        h.add(&on(report(2, 2, 400, 0.8, 20.0), "other"));
        h.add(&report(2, 1, 400, 0.8, 20.0));
        h.add(&report(2, 0, 700, 0.7, 21.5));
        // Generation 3 has a single report: no observation.
        h.add(&report(3, 0, 800, 0.6, 30.0));
        let seen: Vec<_> = h.step_observations().into_iter().map(|(_, o)| o).collect();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!((seen[0].workers, seen[0].nodes), (2, 1));
        assert!((seen[0].local_batch - 5.0).abs() < 1e-12);
        assert!((seen[0].step_time_s - 0.1).abs() < 1e-12);
        assert_eq!((seen[1].workers, seen[1].nodes), (3, 2));
        assert!((seen[1].step_time_s - 1.5 / 30.0).abs() < 1e-12);
        // Generation 4: only rank 0 reports, but the agent declares 4 workers on 2 hosts.
        let declared = |samples, time| ProgressReport {
            workers: Some(4),
            hosts: Some(2),
            ..report(4, 0, samples, 0.5, time)
        };
        h.add(&declared(1000, 40.0));
        h.add(&declared(1400, 41.0));
        let seen: Vec<_> = h.step_observations().into_iter().map(|(_, o)| o).collect();
        let last = seen.last().unwrap();
        assert_eq!((last.workers, last.nodes), (4, 2));
        assert!((last.local_batch - 400.0 / 40.0 / 4.0).abs() < 1e-12);
    }

    #[test]
    fn step_observations_carry_the_step_weighted_sync_time_and_the_model_size() {
        let mut h = JobHistory::default();
        let with = |generation, samples, time, sync: Option<f64>, bytes: Option<u64>| {
            let mut r = report(generation, 0, samples, 1.0, time);
            (r.workers, r.hosts) = (Some(4), Some(2));
            (r.line.sync_s, r.line.model_bytes) = (sync, bytes);
            r
        };
        assert_eq!(h.model_bytes(), None);
        // Generation 1 (step = samples / 10): the first report's sync (its steps precede
        // the observed interval) is left out; 10 steps at 0.02 s, then 30 steps at 0.06 s.
        h.add(&with(1, 100, 10.0, Some(9.0), Some(5200)));
        h.add(&with(1, 200, 11.0, Some(0.02), None));
        h.add(&with(1, 500, 14.0, Some(0.06), Some(5200)));
        // Generation 2: no sync figures at all.
        h.add(&with(2, 600, 20.0, None, None));
        h.add(&with(2, 700, 21.0, None, None));
        // Generation 3: one report without the figure among two with it.
        h.add(&with(3, 800, 30.0, None, Some(6400)));
        h.add(&with(3, 900, 31.0, Some(0.01), None));
        h.add(&with(3, 1000, 32.0, None, None));
        h.add(&with(3, 1200, 33.0, Some(0.04), None));
        let seen: Vec<_> = h.step_observations();
        assert_eq!(seen.len(), 3, "{seen:?}");
        let sync = |i: usize| seen[i].1.sync_time_s;
        let want = (10.0 * 0.02 + 30.0 * 0.06) / 40.0;
        assert!((sync(0).unwrap() - want).abs() < 1e-12, "{:?}", sync(0));
        assert_eq!(sync(1), None);
        let want = (10.0 * 0.01 + 20.0 * 0.04) / 30.0;
        assert!((sync(2).unwrap() - want).abs() < 1e-12, "{:?}", sync(2));
        assert!((seen[0].1.step_time_s - 0.1).abs() < 1e-12);
        // The latest report that had the figure.
        assert_eq!(h.model_bytes(), Some(6400));
        // A stale report (older generation) changes neither.
        h.add(&with(1, 1300, 40.0, Some(5.0), Some(1)));
        assert_eq!(h.model_bytes(), Some(6400));
    }

    #[test]
    fn restart_cost_is_the_stall_between_generations_less_the_steps_made() {
        let mut h = JobHistory::default();
        for (samples, time) in [(100, 10.0), (200, 11.0), (300, 12.0)] {
            h.add(&report(1, 0, samples, 1.0, time));
        }
        assert_eq!(h.restart_cost_s(), None, "no restart yet");
        // Generation 2 reports 38 s later, 2 steps on; its step time is 0.1 s.
        h.add(&report(2, 0, 320, 0.9, 50.0));
        assert_eq!(h.restart_cost_s(), None, "one report gives no step time");
        h.add(&report(2, 0, 420, 0.9, 51.0));
        assert!((h.restart_cost_s().unwrap() - 37.8).abs() < 1e-9);
        // Generation 3 after a 12 s stall with nothing redone (step time 0.05 s).
        h.add(&report(3, 0, 420, 0.8, 63.0));
        h.add(&report(3, 0, 620, 0.8, 64.0));
        let median = 0.5 * (37.8 + 12.0);
        assert!((h.restart_cost_s().unwrap() - median).abs() < 1e-9);
    }

    #[test]
    fn samples_at_counts_each_span_at_its_batchs_efficiency() {
        let mut h = JobHistory::default();
        assert_eq!(h.samples_at(|_| 0.5), 0.0);
        let at = |generation, step, samples, time| {
            let mut r = report(generation, 0, samples, 1.0, time);
            r.line.step = step;
            r
        };
        // Generation 1 at a batch of 100 (efficiency 1), generation 2 at 400 (0.5).
        h.add(&at(1, 2, 200, 10.0));
        h.add(&at(1, 5, 500, 11.0));
        h.add(&at(2, 6, 900, 20.0));
        h.add(&at(2, 8, 1700, 21.0));
        let efficiency = |batch: f64| if batch > 150.0 { 0.5 } else { 1.0 };
        assert_eq!(h.samples_at(efficiency), 500.0 + 0.5 * 1200.0);
        // At efficiency 1 it is the samples done.
        assert_eq!(h.samples_at(|_| 1.0), 1700.0);
        // Work redone from a checkpoint is not counted twice.
        h.add(&at(3, 7, 1300, 30.0));
        h.add(&at(3, 8, 1700, 31.0));
        assert_eq!(h.samples_at(efficiency), 500.0 + 0.5 * 800.0 + 0.5 * 400.0);
    }

    #[test]
    fn keeps_rank0_drops_stale_and_truncates_redone_work() {
        let mut h = JobHistory::default();
        h.add(&report(1, 0, 100, 1.0, 10.0));
        h.add(&report(1, 1, 100, 1.0, 10.0));
        h.add(&report(1, 0, 200, 0.8, 11.0));
        h.add(&report(1, 0, 300, 0.7, 12.0));
        assert_eq!(h.points().len(), 3);
        assert_eq!(h.samples_per_s(1), Some(100.0));
        // Generation 2 resumed from the checkpoint at 200 samples: the point at 300 is gone.
        h.add(&report(2, 0, 220, 0.78, 20.0));
        let samples: Vec<u64> = h.points().iter().map(|p| p.samples).collect();
        assert_eq!(samples, vec![100, 200, 220]);
        // A late report of generation 1 is stale.
        h.add(&report(1, 0, 400, 0.6, 21.0));
        assert_eq!(h.stale_reports, 1);
        assert_eq!(h.first_loss(), Some(1.0));
        assert!((h.loss_scale() - 0.22).abs() < 1e-12);
        assert_eq!(h.latest_rate(), Some((1, 100.0)));
        h.add(&report(2, 0, 620, 0.7, 22.0));
        assert_eq!(h.latest_rate(), Some((2, 200.0)));
    }

    #[test]
    fn bounded() {
        let mut h = JobHistory::default();
        for i in 0..(MAX_POINTS as u64 + 50) {
            h.add(&report(1, 0, i, 1.0, i as f64));
        }
        assert_eq!(h.points().len(), MAX_POINTS);
        assert_eq!(h.first_loss(), Some(1.0));
    }
}
