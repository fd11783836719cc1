//! Stop criteria: when the allocator ends a job on its own (the job spec's `[stop]` table).
//!
//! SLAQ's setting is approximate, exploratory training: people watch loss curves and kill a
//! job once its loss flattens. Here the allocator does it from what it already has, the
//! job's reported losses, its fitted loss curve ([`crate::fit`]) and its attained service,
//! and the agents carry
//! it out as for any resize (SIGTERM, checkpoint, exit). One pure function,
//! [`stop_verdict`], called by the service's step ([`crate::schedule::step`]) and by the
//! simulator with the same inputs.
//!
//! # Rules (the first that holds ends the job, in this order)
//!
//! 1. **Target reached**: the loss at the job's progress is at or below `target_loss`:
//!    both the mean of rank 0's latest [`RECENT_LOSSES`] reported losses and, once a curve
//!    is fitted, the curve's prediction at the job's samples. The mean alone would end a
//!    job on a noisy dip; the curve alone, on its own bias: a fitted family smooths over
//!    the shape of a real curve (a learning-rate step, a long plateau), and near a plateau
//!    it often predicts the target a little before the losses reach it (in the simulator's
//!    service loop, eight Pollux 1.0× workloads with target losses only, jobs the curve
//!    alone ended stood on average 1.8 % of their loss range above the target;
//!    docs/scheduling.md, "Target loss only" under "The service loop"). The window is a
//!    count of reports, not of samples: a job that reports rarely averages over more
//!    training. Before a curve is fitted (fewer reports than a fit needs) the mean alone
//!    decides, so one outlying report weighs a fifth or more.
//! 2. **Converged** (plateau rule): the job has run at least `window_epochs` epochs and its
//!    fitted curve predicts a relative improvement per epoch below `min_improvement` over the
//!    next `window_epochs` epochs: `(L(k) − L(k + W·E)) / (W · L(k)) < min_improvement`, `k`
//!    the samples done, `E` the samples of one epoch (from the worker's `epoch` field), `W`
//!    the window. The rule looks ahead, so a trial the policy gives no GPUs (its predicted
//!    gain is small) is still ended once its curve is flat, rather than left waiting.
//! 3. **Budget**: the GPU-hours of service received reach `max_gpu_hours`.
//! 4. **Deadline**: `deadline_s` seconds have passed since submission (also while pending).

use crate::fit::Curve;
use converge_common::{EndReason, JobSpec, StopSpec};

/// What [`stop_verdict`] reads of a job; every figure as the service observes it.
#[derive(Debug, Clone, Copy)]
pub struct StopInputs<'a> {
    /// Now, seconds (same clock as `submitted_at`).
    pub now: f64,
    pub submitted_at: f64,
    /// Samples processed by the job so far.
    pub samples: f64,
    /// Samples in one epoch of the job's training set, when its workers report epochs.
    pub epoch_samples: Option<f64>,
    /// The mean of rank 0's latest [`RECENT_LOSSES`] reported training losses (fewer
    /// early on; [`JobHistory::recent_loss`](crate::history::JobHistory::recent_loss)).
    pub recent_loss: Option<f64>,
    /// The job's fitted loss curve (samples → loss).
    pub curve: Option<&'a Curve>,
    /// GPU-seconds of service the job has received.
    pub gpu_seconds: f64,
}

/// Why and how a job is ended.
#[derive(Debug, Clone, PartialEq)]
pub struct StopVerdict {
    pub reason: EndReason,
    /// For humans (the job status's message and the event).
    pub message: String,
}

/// The criteria of `spec` in one place: its `[stop]` table with the top-level
/// `target_loss` folded in (both may not be given; `JobSpec::validate`).
pub fn criteria(spec: &JobSpec) -> Option<StopSpec> {
    match (spec.stop, spec.target_loss) {
        (Some(s), _) => Some(StopSpec {
            target_loss: spec.target_loss(),
            ..s
        }),
        (None, Some(t)) => Some(StopSpec {
            target_loss: Some(t),
            ..StopSpec::default()
        }),
        (None, None) => None,
    }
}

/// The loss a job's fitted curve predicts it would reach had it run on: the curve's
/// asymptote (`L(∞)`), finite and non-negative.
pub fn predicted_final_loss(curve: &Curve) -> f64 {
    curve.predict(f64::INFINITY)
}

/// Reported losses averaged into [`StopInputs::recent_loss`].
pub const RECENT_LOSSES: usize = 5;

/// The losses at the job's progress that the target rule compares, the higher of: the mean
/// of the latest reports and, when a curve is fitted, its prediction at the job's samples
/// (module docs, rule 1). `None` before the first report.
pub fn loss_now(inp: &StopInputs<'_>) -> Option<f64> {
    let reported = inp.recent_loss.filter(|l| l.is_finite())?;
    Some(match inp.curve.map(|c| c.predict(inp.samples)) {
        Some(fitted) if fitted.is_finite() => fitted.max(reported),
        _ => reported,
    })
}

/// Relative improvement per epoch the curve predicts over the next `window_epochs` epochs
/// from `samples`; `None` when the epoch size is unknown or the predicted loss is 0.
pub fn predicted_improvement_per_epoch(
    curve: &Curve,
    samples: f64,
    epoch_samples: f64,
    window_epochs: f64,
) -> Option<f64> {
    if !(epoch_samples.is_finite() && epoch_samples > 0.0 && window_epochs > 0.0) {
        return None;
    }
    let now = curve.predict(samples);
    if now <= 0.0 {
        return None;
    }
    let ahead = curve.predict(samples + window_epochs * epoch_samples);
    Some(((now - ahead) / now).max(0.0) / window_epochs)
}

/// Whether `stop` ends the job now, and why (module docs). `None`: it goes on.
pub fn stop_verdict(stop: &StopSpec, inp: &StopInputs<'_>) -> Option<StopVerdict> {
    if let (Some(target), Some(loss)) = (stop.target_loss, loss_now(inp))
        && loss <= target
    {
        let fitted = inp
            .curve
            .map(|c| format!(", fitted curve {:.4}", c.predict(inp.samples)))
            .unwrap_or_default();
        return Some(StopVerdict {
            reason: EndReason::TargetReached,
            message: format!(
                "reached target loss {target} (mean of the latest reported losses {:.4}{fitted})",
                inp.recent_loss.unwrap_or(loss)
            ),
        });
    }
    if let (Some(p), Some(curve), Some(epoch)) = (stop.plateau, inp.curve, inp.epoch_samples)
        && inp.samples >= p.window_epochs * epoch
        && let Some(gain) =
            predicted_improvement_per_epoch(curve, inp.samples, epoch, p.window_epochs)
        && gain < p.min_improvement
    {
        return Some(StopVerdict {
            reason: EndReason::Converged,
            message: format!(
                "converged: the fitted curve predicts {:.3} % improvement per epoch over the next {} epochs (rule: below {} %)",
                gain * 100.0,
                p.window_epochs,
                p.min_improvement * 100.0
            ),
        });
    }
    if let Some(budget) = stop.max_gpu_hours
        && inp.gpu_seconds / 3600.0 >= budget
    {
        return Some(StopVerdict {
            reason: EndReason::Budget,
            message: format!(
                "GPU-time budget spent: {:.3} of {budget} GPU-hours",
                inp.gpu_seconds / 3600.0
            ),
        });
    }
    if let Some(deadline) = stop.deadline_s
        && inp.now - inp.submitted_at >= deadline
    {
        return Some(StopVerdict {
            reason: EndReason::Deadline,
            message: format!("deadline: {deadline} s after submission"),
        });
    }
    None
}

/// Whether a job's first reported loss already meets its target: the target cannot be a
/// goal for a loss that falls, and the job is refused (failed) with this reason.
pub fn target_not_below_first_loss(target: f64, first_loss: f64) -> Option<String> {
    (first_loss <= target).then(|| {
        format!(
            "`target_loss` {target} is not below the job's first loss {first_loss:.4}: for a loss that falls the target is met before training starts; refused"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::CurveFamily;
    use converge_common::PlateauSpec;

    /// `1/(a·k + b) + c` with `a = 1e-3`, `b = 1`, `c = 0.1`: loss 1.1 at 0, 0.1 at ∞.
    fn curve() -> Curve {
        Curve {
            family: CurveFamily::InvLinear,
            params: vec![1e-3, 1.0, 0.1],
            rmse: 0.0,
            points: 20,
        }
    }

    fn inputs(curve: Option<&Curve>, samples: f64) -> StopInputs<'_> {
        StopInputs {
            now: 100.0,
            submitted_at: 0.0,
            samples,
            epoch_samples: Some(1000.0),
            recent_loss: Some(0.9),
            curve,
            gpu_seconds: 0.0,
        }
    }

    #[test]
    fn target_needs_the_reported_losses_and_the_curve_below_it() {
        let c = curve();
        let stop = StopSpec {
            target_loss: Some(0.2),
            ..StopSpec::default()
        };
        // At 1e4 samples the curve says 1/11 + 0.1 ≈ 0.19, but the reports average 0.9:
        // the curve alone does not end the job.
        assert!(stop_verdict(&stop, &inputs(Some(&c), 1e4)).is_none());
        let mut inp = inputs(Some(&c), 1e4);
        inp.recent_loss = Some(0.195);
        let v = stop_verdict(&stop, &inp).unwrap();
        assert_eq!(v.reason, EndReason::TargetReached);
        assert!(v.message.contains("0.1950"), "{}", v.message);
        assert!(v.message.contains("fitted curve 0.19"), "{}", v.message);
        // Reports below the target, the curve still above it (1e3 samples: ≈ 0.6): goes on.
        let mut inp = inputs(Some(&c), 1e3);
        inp.recent_loss = Some(0.15);
        assert!(stop_verdict(&stop, &inp).is_none());
        // No curve: the reports decide.
        assert!(stop_verdict(&stop, &inputs(None, 1e6)).is_none());
        let mut inp = inputs(None, 0.0);
        inp.recent_loss = Some(0.15);
        assert!(stop_verdict(&stop, &inp).is_some());
        // No report yet: nothing to compare, whatever the curve says.
        let mut inp = inputs(Some(&c), 1e6);
        inp.recent_loss = None;
        assert!(stop_verdict(&stop, &inp).is_none());
    }

    #[test]
    fn plateau_looks_ahead_on_the_curve_once_the_window_has_run() {
        let c = curve();
        let stop = StopSpec {
            plateau: Some(PlateauSpec {
                min_improvement: 0.01,
                window_epochs: 2.0,
            }),
            ..StopSpec::default()
        };
        // Early: steep, goes on; before 2 epochs the rule does not apply at all.
        assert!(stop_verdict(&stop, &inputs(Some(&c), 1500.0)).is_none());
        assert!(stop_verdict(&stop, &inputs(Some(&c), 3000.0)).is_none());
        // Late: at 1e6 samples the loss is ~0.101 and improves ~0.001 % per epoch.
        let v = stop_verdict(&stop, &inputs(Some(&c), 1e6)).unwrap();
        assert_eq!(v.reason, EndReason::Converged);
        assert!(v.message.contains("per epoch"), "{}", v.message);
        // No epoch size, no plateau verdict.
        let mut inp = inputs(Some(&c), 1e6);
        inp.epoch_samples = None;
        assert!(stop_verdict(&stop, &inp).is_none());
        let gain = predicted_improvement_per_epoch(&c, 1e6, 1000.0, 2.0).unwrap();
        assert!(gain > 0.0 && gain < 1e-4, "{gain}");
    }

    #[test]
    fn budget_and_deadline_end_a_job_whatever_its_loss() {
        let stop = StopSpec {
            max_gpu_hours: Some(1.0),
            deadline_s: Some(200.0),
            ..StopSpec::default()
        };
        let mut inp = inputs(None, 0.0);
        assert!(stop_verdict(&stop, &inp).is_none());
        inp.gpu_seconds = 3600.0;
        assert_eq!(stop_verdict(&stop, &inp).unwrap().reason, EndReason::Budget);
        inp.gpu_seconds = 0.0;
        inp.now = 200.0;
        assert_eq!(
            stop_verdict(&stop, &inp).unwrap().reason,
            EndReason::Deadline
        );
    }

    #[test]
    fn the_top_level_target_folds_into_the_criteria() {
        let spec =
            JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\ntarget_loss = 0.3\n").unwrap();
        assert_eq!(criteria(&spec).unwrap().target_loss, Some(0.3));
        let spec = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        assert!(criteria(&spec).is_none());
        let spec =
            JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n[stop]\ndeadline_s = 5\n").unwrap();
        let c = criteria(&spec).unwrap();
        assert_eq!((c.deadline_s, c.target_loss), (Some(5.0), None));
        assert!(target_not_below_first_loss(0.5, 0.4).is_some());
        assert!(target_not_below_first_loss(0.3, 0.4).is_none());
        assert!((predicted_final_loss(&curve()) - 0.1).abs() < 1e-12);
    }
}
