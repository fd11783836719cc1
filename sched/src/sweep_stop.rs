//! Sweep early stopping: ending a sweep's weak trials before their programs or their own
//! `[stop]` rules would, so that the sweep's GPU-hours go to the trials that can win
//! (`[sweep] early_stop`; docs/scheduling.md "Sweep early stopping").
//!
//! Hyperparameter-search systems stop weak trials across a sweep by rung rules (ASHA,
//! Li et al., MLSys'20; Optuna's successive-halving pruner). Converge already fits each
//! trial's loss curve (SLAQ's predictor, [`crate::fit`]), so its default rule asks the curve
//! instead: can this trial still reach the sweep's best? ASHA is here as the baseline, in
//! the same code path. One pure function, [`sweep_stops`], called by the service's step
//! ([`crate::schedule::step`]) once per sweep, and so by the simulator's service loop.
//!
//! # The value of a trial
//!
//! A trial is judged by its **held-out loss** (`eval_loss`) when every trial of the sweep
//! that has reported reports one (a trial still in its first `min_epochs` epochs that has
//! not evaluated yet does not count), else by its training loss (the stop message says
//! which).
//! Minibatch losses are noisy, so a value is the mean of the last [`TAIL_POINTS`] points that
//! carry the metric, never a single point.
//!
//! # `predicted`
//!
//! For each active trial with a fitted curve, its **predicted final value** at `H`, where the
//! trial will end at the latest: the samples it declares (`work_samples`, as a trainer's
//! `--epochs` implies); without them, where its plateau rule would end it (the first epoch
//! from `k`, the samples done, at which the curve predicts less than the rule's improvement
//! per epoch, [`crate::stop::predicted_improvement_per_epoch`]); without either, the
//! curve's asymptote. A trial that declares its work is predicted there even when it
//! carries a plateau rule: that rule's end comes from the same early fit, which often
//! predicts a flattening that does not come. In a live sweep (docs/local-cluster.md, "A
//! live sweep", run 5) trials one epoch into 40 were predicted at the end their plateau
//! rule was forecast to give them, a few epochs ahead, with a narrow band, and all but one
//! were stopped, the eventual best among them.
//! - Judged by **held-out loss**: the trial's own fitted held-out curve at `H`
//!   ([`SweepTrial::eval_curve`], fitted on its `eval_loss` reports like the training
//!   curve), never above its value now. Held-out curves are smooth: the fit forecasts them
//!   with a median error of 1.4–2.2 % a tenth to a quarter of the remaining run ahead,
//!   against 7.9–8.7 % for the noisy training loss (docs/prediction.md, `converge-sim
//!   predict-bench`).
//! - Judged by **training loss**, or before a held-out curve is fitted: its value now
//!   times the fall its training-loss curve still predicts, `L(H) / L(k)`.
//!
//! A trial that has ended is valued at the value it ended with (the mean of its last
//! reports).
//!
//! A forecast's error grows with how far ahead it reaches, so the error band is the band
//! `b` ([`EarlyStopSpec::band`], default 2 %) per doubling of the samples ahead:
//! `b_H = b · clamp(log₂(H / k), 1, 4)`. A trial one epoch into a ten-epoch run is judged
//! with a band of `3.3·b`; one halfway or further, `b`; one without a known end (no
//! declared work, no plateau rule), `4·b`. A forecast to a known end further ahead than
//! that, beyond 16× the samples done, is not trusted at all: such a trial is not judged
//! until it has done a sixteenth of its run ([`within_reach`]; the held-out fit's error was
//! measured a tenth to a quarter of the run ahead). A trial without a known end is judged
//! at its curve's asymptote, with the widest band, from `min_epochs` on: for a falling
//! curve the asymptote is the lowest value it predicts, the most lenient forecast of all,
//! and waiting for a sixteenth of an unknown run would never end.
//!
//! A trial is stopped when its prediction less the band, `(1 − b_H)·p`, is above the values
//! at least `keep` other trials have **already attained** (their value now; ended trials:
//! their final value): even if it did as well as its band allows, `keep` trials are better
//! already. The other trials are judged by what they have reached, not by their own
//! predictions: fits on a trial's first epochs often predict it flattens too early, and
//! comparing predictions with predictions ended the eventual best trial of many simulated
//! sweeps (experiments not committed; docs/scheduling.md, "Sweep early stopping"). The
//! `keep` best trials are never stopped.
//!
//! # `asha`
//!
//! Rungs at `min_epochs · 3^r` epochs (`r = 0, 1, …`). When a trial has passed a rung, its
//! value there (the mean of the last points up to the rung) is compared with the values
//! there of every trial of the sweep that passed it no later; it goes on only if it is
//! among the best `max(1, ⌊n/3⌋)` of those `n` (Optuna's successive-halving pruner;
//! the first trial at a rung always goes on). Judged at the highest rung passed, by when
//! each trial passed it, so a verdict does not change as later trials arrive.
//!
//! # Both
//!
//! A trial is never stopped before it has run `min_epochs` epochs with a fitted curve (its
//! workers must report `epoch`), nor when fewer than `keep` other trials would be left not
//! early-stopped (when the rules would stop more, the worst go first); so at least `keep`
//! trials are never early-stopped, under `predicted` the `keep` best. Only a trial whose
//! own spec carries the sweep's rule is stopped; others are compared. Failed and cancelled
//! trials do not count.

use crate::fit::Curve;
use crate::history::{JobHistory, ProgressPoint};
use crate::stop::predicted_improvement_per_epoch;
use converge_common::{EarlyStopRule, EarlyStopSpec, EndReason, JobId, PlateauSpec};

/// Points averaged into a trial's value (at most; fewer early on).
pub const TAIL_POINTS: usize = 5;

/// ASHA's reduction factor (η): a third of the trials at a rung go on.
pub const ASHA_REDUCTION: f64 = 3.0;

/// Most epochs ahead the `predicted` rule looks for where a plateau rule would end a trial.
pub const MAX_HORIZON_EPOCHS: u32 = 1000;

/// Most doublings of the samples ahead that widen the `predicted` rule's band: a trial
/// without a known end, or one very early in a long run, is judged with `4·b`.
pub const MAX_BAND_DOUBLINGS: f64 = 4.0;

/// Where a trial stands, as the step sees it.
#[derive(Debug, Clone, Copy)]
pub enum TrialState {
    /// Pending, restarting or running: the rule may stop it.
    Active,
    /// Completed: valued at its final value. `early_stopped`: ended by this rule before.
    Ended { early_stopped: bool },
}

/// One trial of a sweep.
#[derive(Debug, Clone, Copy)]
pub struct SweepTrial<'a> {
    pub id: &'a JobId,
    pub state: TrialState,
    pub history: Option<&'a JobHistory>,
    /// The trial's fitted training-loss curve (active trials).
    pub curve: Option<&'a Curve>,
    /// The trial's fitted held-out loss curve (active trials that report `eval_loss`;
    /// [`crate::fit_cache::FitCache::eval_curve`]).
    pub eval_curve: Option<&'a Curve>,
    /// The samples the trial declares it processes in all (`work_samples`), where it ends.
    pub work_samples: Option<f64>,
    /// The trial's own plateau rule (`[stop.plateau]`): where it is predicted to end the
    /// trial is the rule's horizon when the trial declares no work.
    pub plateau: Option<PlateauSpec>,
    /// Whether the rule may stop this trial: its own spec carries the sweep's rule. A trial
    /// without it (`early_stop` absent or another rule) is compared, never stopped.
    pub stoppable: bool,
}

/// A trial the rule stops, and why (for the trial's status message and event).
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyStop {
    pub job: JobId,
    pub reason: EndReason,
    pub message: String,
    /// What the rule judged the trial by (`predicted`: its prediction less the band;
    /// `asha`: its value at the rung); lower is better.
    pub value: f64,
}

/// Which loss the sweep's trials are compared by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// `eval_loss`: every trial that reported reports it.
    HeldOut,
    /// Training loss: some trial reports no held-out loss.
    Training,
}

impl Metric {
    fn name(self) -> &'static str {
        match self {
            Metric::HeldOut => "held-out loss",
            Metric::Training => "training loss",
        }
    }

    fn of(self, p: &ProgressPoint) -> Option<f64> {
        match self {
            Metric::HeldOut => p.eval_loss,
            Metric::Training => Some(p.loss),
        }
        .filter(|v| v.is_finite())
    }
}

/// The metric a sweep is judged by: held-out loss when every trial that has points reports
/// it. A trial still in its first `min_epochs` epochs that has not evaluated yet does not
/// count (a trial that starts late would otherwise switch the sweep to training loss until
/// its first evaluation); it has no held-out value to compare meanwhile.
pub fn metric(trials: &[SweepTrial<'_>], min_epochs: f64) -> Metric {
    let young = |h: &JobHistory| matches!(h.epoch_samples().zip(h.latest()), Some((e, p)) if (p.samples as f64) < min_epochs * e);
    let reported: Vec<(&SweepTrial<'_>, &JobHistory)> = trials
        .iter()
        .filter_map(|t| Some((t, t.history?)))
        .filter(|(_, h)| !h.points().is_empty())
        .collect();
    let evaluated = |h: &JobHistory| h.last_eval_loss().is_some();
    if reported.iter().any(|(_, h)| evaluated(h))
        && reported
            .iter()
            .all(|(t, h)| evaluated(h) || (matches!(t.state, TrialState::Active) && young(h)))
    {
        Metric::HeldOut
    } else {
        Metric::Training
    }
}

/// The mean of the metric over the last [`TAIL_POINTS`] points of `points` that carry it.
fn tail_value(points: &[ProgressPoint], metric: Metric) -> Option<f64> {
    let tail: Vec<f64> = points
        .iter()
        .rev()
        .filter_map(|p| metric.of(p))
        .take(TAIL_POINTS)
        .collect();
    (!tail.is_empty()).then(|| tail.iter().sum::<f64>() / tail.len() as f64)
}

/// A trial's value now (module docs).
pub fn value_now(history: &JobHistory, metric: Metric) -> Option<f64> {
    tail_value(history.points(), metric)
}

/// A trial's value where it first passed `samples`, and the time of that report; `None`
/// before it gets there, or when the history no longer holds that point.
pub fn value_at(history: &JobHistory, samples: f64, metric: Metric) -> Option<(f64, f64)> {
    let points = history.points();
    let i = points.iter().position(|p| p.samples as f64 >= samples)?;
    // The oldest points were dropped (a long history): where it passed `samples` is lost.
    if i == 0 && history.added() > points.len() {
        return None;
    }
    Some((tail_value(&points[..=i], metric)?, points[i].time))
}

/// Samples at which a trial with `curve` at `samples` will end: where `plateau` would end
/// it, else never (`f64::INFINITY`, the asymptote).
pub fn end_samples(
    curve: &Curve,
    samples: f64,
    epoch_samples: Option<f64>,
    plateau: Option<PlateauSpec>,
) -> f64 {
    let (Some(p), Some(epoch)) = (plateau, epoch_samples) else {
        return f64::INFINITY;
    };
    (0..=MAX_HORIZON_EPOCHS)
        .map(|e| samples.max(p.window_epochs * epoch) + f64::from(e) * epoch)
        .find(|&k| {
            predicted_improvement_per_epoch(curve, k, epoch, p.window_epochs)
                .is_none_or(|g| g < p.min_improvement)
        })
        .unwrap_or(f64::INFINITY)
}

/// Samples at which the active trial `t`, `samples` done, is predicted: its declared work;
/// without it, where its plateau rule would end it ([`end_samples`]); `f64::INFINITY`
/// without either. Never before `samples`. The plateau's end is not used when work is
/// declared: it comes from the same early fit that often predicts a flattening that does
/// not come, and ended a live sweep's best trial (module docs).
pub fn horizon(t: &SweepTrial<'_>, curve: &Curve, samples: f64, epoch: Option<f64>) -> f64 {
    t.work_samples
        .unwrap_or_else(|| end_samples(curve, samples, epoch, t.plateau))
        .max(samples)
}

/// Whether the `predicted` rule may judge a trial with `samples` done that it predicts at
/// `end`: the forecast reaches no further than the band covers, [`MAX_BAND_DOUBLINGS`]
/// doublings (16× the samples done), or the end is unknown (`end` infinite: judged at the
/// curve's asymptote with the widest band). Module docs.
pub fn within_reach(samples: f64, end: f64) -> bool {
    samples > 0.0 && (end.is_infinite() || end <= samples * MAX_BAND_DOUBLINGS.exp2())
}

/// The error band a prediction from `samples` to `end` is judged with: `band` per doubling
/// of the samples ahead, at least one and at most [`MAX_BAND_DOUBLINGS`] (module docs).
pub fn band_at(band: f64, samples: f64, end: f64) -> f64 {
    let doublings = if samples > 0.0 {
        (end / samples).log2()
    } else {
        f64::INFINITY
    };
    band * doublings.clamp(1.0, MAX_BAND_DOUBLINGS)
}

/// The trial's predicted final value and the samples it is predicted at (module docs,
/// `predicted`); `None` without a value or, for an active trial, a curve. An ended trial is
/// predicted at its samples done.
pub fn predicted_final(t: &SweepTrial<'_>, metric: Metric) -> Option<(f64, f64)> {
    let h = t.history?;
    let now = value_now(h, metric)?;
    let samples = h.latest()?.samples as f64;
    match t.state {
        TrialState::Ended { .. } => Some((now, samples)),
        TrialState::Active => {
            let curve = t.curve?;
            let end = horizon(t, curve, samples, h.epoch_samples());
            if let (Metric::HeldOut, Some(eval)) = (metric, t.eval_curve) {
                return Some((eval.predict(end).min(now), end));
            }
            let at = curve.predict(samples);
            let to = curve.predict(end);
            let fall = if at > 0.0 && to.is_finite() {
                (to / at).clamp(0.0, 1.0)
            } else {
                1.0
            };
            Some((now * fall, end))
        }
    }
}

/// Whether the rule may judge the trial yet: stoppable, active, with a curve and
/// `min_epochs` epochs.
fn eligible(t: &SweepTrial<'_>, spec: &EarlyStopSpec) -> bool {
    let Some(h) = t.history else { return false };
    t.stoppable
        && matches!(t.state, TrialState::Active)
        && t.curve.is_some()
        && h.epoch_samples()
            .zip(h.latest())
            .is_some_and(|(epoch, p)| p.samples as f64 >= spec.min_epochs * epoch)
}

/// The trials of one sweep that `spec` stops now, with the reasons (module docs). Pure and
/// deterministic: trials are judged in the order given.
pub fn sweep_stops(spec: &EarlyStopSpec, trials: &[SweepTrial<'_>]) -> Vec<EarlyStop> {
    let metric = metric(trials, spec.min_epochs);
    let mut stops = match spec.rule {
        EarlyStopRule::None => return Vec::new(),
        EarlyStopRule::Predicted => predicted(spec, trials, metric),
        EarlyStopRule::Asha => asha(spec, trials, metric),
    };
    // Never leave fewer than `keep` trials not early-stopped: the worst go first.
    stops.sort_by(|a, b| b.value.total_cmp(&a.value).then_with(|| a.job.cmp(&b.job)));
    let mut left = trials
        .iter()
        .filter(|t| {
            !matches!(
                t.state,
                TrialState::Ended {
                    early_stopped: true
                }
            )
        })
        .count();
    stops.retain(|_| {
        let ok = left > spec.keep as usize;
        left -= usize::from(ok);
        ok
    });
    if metric == Metric::Training {
        for s in &mut stops {
            s.message.push_str(
                "; ranked by training loss (some trial of the sweep reports no held-out loss)",
            );
        }
    }
    stops
}

fn predicted(spec: &EarlyStopSpec, trials: &[SweepTrial<'_>], metric: Metric) -> Vec<EarlyStop> {
    let b = spec.band;
    // Per trial: the value it has attained (ended trials: their final one) and, for an
    // active trial with a curve, the low end of its predicted final value's band.
    let attained: Vec<Option<f64>> = trials
        .iter()
        .map(|t| value_now(t.history?, metric))
        .collect();
    let keep = spec.keep as usize;
    let mut out = Vec::new();
    for (i, t) in trials.iter().enumerate() {
        if !eligible(t, spec) {
            continue;
        }
        let Some((p, end)) = predicted_final(t, metric) else {
            continue;
        };
        let samples = t
            .history
            .and_then(JobHistory::latest)
            .map_or(0.0, |l| l.samples as f64);
        if !within_reach(samples, end) {
            continue;
        }
        let band = band_at(b, samples, end);
        let low = (1.0 - band) * p;
        let mut better: Vec<f64> = attained
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, v)| *v)
            .filter(|&v| v < low)
            .collect();
        if better.len() < keep {
            continue;
        }
        better.sort_by(f64::total_cmp);
        let message = format!(
            "early stopped by its sweep (predicted): its {} cannot get below {low:.4} \
             (prediction less the {:.1} % band), and {} already below that \
             (the {}{} best at {:.4})",
            metric.name(),
            band * 100.0,
            match better.len() {
                1 => "1 other trial is".to_string(),
                n => format!("{n} other trials are"),
            },
            keep,
            ordinal(keep),
            better[keep - 1]
        );
        out.push(EarlyStop {
            job: t.id.clone(),
            reason: EndReason::EarlyStopped,
            message,
            value: low,
        });
    }
    out
}

fn asha(spec: &EarlyStopSpec, trials: &[SweepTrial<'_>], metric: Metric) -> Vec<EarlyStop> {
    let mut out = Vec::new();
    for t in trials.iter().filter(|t| eligible(t, spec)) {
        let Some(h) = t.history else { continue };
        let (Some(epoch), Some(latest)) = (h.epoch_samples(), h.latest()) else {
            continue;
        };
        let done_epochs = latest.samples as f64 / epoch;
        // The highest rung passed.
        let mut rung = spec.min_epochs;
        while rung * ASHA_REDUCTION <= done_epochs {
            rung *= ASHA_REDUCTION;
        }
        let Some((mine, when)) = value_at(h, rung * epoch, metric) else {
            continue;
        };
        // Every trial that passed the rung no later, this one included.
        let mut there: Vec<f64> = trials
            .iter()
            .filter(|o| o.id != t.id)
            .filter_map(|o| {
                let oh = o.history?;
                let oe = oh.epoch_samples()?;
                value_at(oh, rung * oe, metric).filter(|(_, w)| *w <= when)
            })
            .map(|(v, _)| v)
            .collect();
        there.push(mine);
        there.sort_by(f64::total_cmp);
        let n = there.len();
        let promoted = ((n as f64 / ASHA_REDUCTION).floor() as usize).max(1);
        let cut = there[promoted - 1];
        if mine > cut {
            out.push(EarlyStop {
                job: t.id.clone(),
                reason: EndReason::EarlyStopped,
                message: format!(
                    "early stopped by its sweep (asha): at the rung of {rung} epochs its {} \
                     {mine:.4} is not among the best {promoted} of the {n} trials there \
                     (at most {cut:.4})",
                    metric.name()
                ),
                value: mine,
            });
        }
    }
    out
}

fn ordinal(n: usize) -> &'static str {
    match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    }
}

#[cfg(test)]
mod tests;
