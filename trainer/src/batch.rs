//! Adaptive batch sizes (worker contract, docs/protocol.md): the batch the allocator plans
//! for a `[batch]` job (`CONVERGE_BATCH_SIZE`, `CONVERGE_ACCUM_STEPS`,
//! `CONVERGE_TOTAL_BATCH`, `CONVERGE_REFERENCE_BATCH`), the learning-rate scaling rule, and
//! the gradient statistics (`grad_sqr`, `grad_var`) the trainer reports so the allocator can
//! estimate the gradient noise scale.
//!
//! # Gradient statistics
//!
//! Every optimizer step averages `m ≥ 2` micro-gradients: each worker computes each of its
//! micro-batches (one, plus `CONVERGE_ACCUM_STEPS`) as two halves, so even one worker without
//! accumulation has two. With `ḡ` the step's mean gradient over all `n` samples, `gᵢ` the
//! mean gradient of micro-gradient `i` (each over `n/m` samples), `S = |ḡ|²` and
//! `L = (1/m)·Σ|gᵢ|²`, the unbiased estimates (McCandlish et al. 2018, appendix A; AdaptDL's
//! `GradientNoiseScale`) are
//!
//! ```text
//! grad_sqr = (m·S − L) / (m − 1)          ≈ |G|², the true gradient's squared norm
//! grad_var = (L − S) · n / (m − 1)        ≈ tr(Σ), the variance of one sample's gradient
//! ```
//!
//! since `E|gᵢ|² = |G|² + tr(Σ)·m/n` and `E S = |G|² + tr(Σ)/n`. A progress line carries the
//! mean of the per-step estimates since the previous line, each clamped at 0 (an estimate
//! is negative when the gradient is small next to its noise; the contract takes no negative
//! value); a line whose two means are both 0 carries none.
//!
//! # AdaScale (the default `--lr-scaling`)
//!
//! The worker also keeps the per-step estimates as AdaptDL's `GradientNoiseScale` does
//! ([`SmoothedStats`]: bias-corrected moving averages, a step of `S = total / reference`
//! reference batches decaying the past by `0.999^S`, so the memory is about `1000 / S`
//! steps) and sets every step's learning rate to `lr₀ · gain` with AdaScale's gain
//! (Johnson et al., "AdaScale SGD", ICML 2020; AdaptDL's `AdaScale` rule)
//!
//! ```text
//! gain = (grad_var/reference + grad_sqr) / (grad_var/total + grad_sqr)     ∈ [1, S]
//! ```
//!
//! `grad_var` being one sample's variance, `grad_var / reference` is the variance of the
//! gradient at the reference batch (AdaptDL's `var`), so this is AdaptDL's
//! `(var + sqr) / (var/S + sqr)`. It is also `S` times the allocator's statistical
//! efficiency `(φ + B₀)/(φ + B)` with `φ = grad_var / grad_sqr` (`sched/src/goodput.rs`):
//! AdaScale is the rule under which a step at `B` makes the progress the allocator's goodput
//! model assumes. Each step advances AdaScale's *scale-invariant progress* by its gain (steps
//! at the reference batch); the trainer logs it and keeps it in the checkpoint but stops by
//! samples (`--epochs`) or steps (`--max-steps`) as before. The step's own estimate enters
//! the averages before its gain is taken (as in AdaptDL), so with statistics on every step
//! has a gain; a step without (statistics off, a step of a single sample) uses the
//! square-root rule.

use anyhow::{Context, Result, ensure};
use clap::ValueEnum;

/// The batch the allocator planned for this generation (all in samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContractBatch {
    /// `CONVERGE_BATCH_SIZE`: samples per worker per forward/backward pass.
    pub per_worker: usize,
    /// `CONVERGE_ACCUM_STEPS`: extra micro-batches per optimizer step (default 0).
    pub accum_steps: usize,
    /// `CONVERGE_TOTAL_BATCH`: samples per optimizer step over all workers (default:
    /// workers × per_worker × (accum_steps + 1), which it must equal).
    pub total: usize,
    /// `CONVERGE_REFERENCE_BATCH`: the total the learning rate was tuned for (default:
    /// `total`, no scaling).
    pub reference: usize,
}

impl ContractBatch {
    /// Reads the variables through `get` (empty counts as unset) for `workers` data-parallel
    /// workers. `None` when `CONVERGE_BATCH_SIZE` is unset (the job is not a `[batch]` job:
    /// `--batch-size` applies); refused when a value is not a number, is 0, or the total does
    /// not match.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
        workers: usize,
    ) -> Result<Option<ContractBatch>> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let num = |k: &str| -> Result<Option<usize>> {
            get(k)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .with_context(|| format!("{k}={v:?} is not a whole number"))
                })
                .transpose()
        };
        let Some(per_worker) = num("CONVERGE_BATCH_SIZE")? else {
            for k in [
                "CONVERGE_ACCUM_STEPS",
                "CONVERGE_TOTAL_BATCH",
                "CONVERGE_REFERENCE_BATCH",
            ] {
                ensure!(
                    get(k).is_none(),
                    "{k} is set but CONVERGE_BATCH_SIZE is not"
                );
            }
            return Ok(None);
        };
        ensure!(per_worker >= 1, "CONVERGE_BATCH_SIZE must be at least 1");
        let accum_steps = num("CONVERGE_ACCUM_STEPS")?.unwrap_or(0);
        let expect = workers
            .checked_mul(per_worker)
            .and_then(|x| x.checked_mul(accum_steps + 1))
            .context("the batch overflows")?;
        let total = num("CONVERGE_TOTAL_BATCH")?.unwrap_or(expect);
        ensure!(
            total == expect,
            "CONVERGE_TOTAL_BATCH={total} is not {workers} workers × CONVERGE_BATCH_SIZE={per_worker} × (CONVERGE_ACCUM_STEPS={accum_steps} + 1)"
        );
        let reference = num("CONVERGE_REFERENCE_BATCH")?.unwrap_or(total);
        ensure!(
            reference >= 1,
            "CONVERGE_REFERENCE_BATCH must be at least 1"
        );
        Ok(Some(ContractBatch {
            per_worker,
            accum_steps,
            total,
            reference,
        }))
    }
}

/// How the learning rate follows the total batch (`--lr-scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LrScaling {
    /// AdaScale (Johnson et al., ICML 2020, as AdaptDL implements it): `lr = lr₀ · gain`,
    /// the gain from the smoothed gradient statistics ([`adascale_gain`]); the
    /// square-root rule until the first statistics exist or without them.
    #[default]
    #[value(name = "adascale")]
    AdaScale,
    /// `lr = lr₀ · √(total / reference)` (Krizhevsky 2014; Hoffer et al. 2017).
    Sqrt,
    /// `lr = lr₀ · total / reference` (Goyal et al. 2017).
    Linear,
    /// `lr = lr₀` whatever the batch.
    None,
}

impl LrScaling {
    /// The learning rate for a total batch of `total` samples when `lr0` was tuned at
    /// `reference` samples, by a rule that needs no statistics: AdaScale's is its
    /// fallback, the square-root rule.
    pub fn scale(self, lr0: f64, total: usize, reference: usize) -> f64 {
        let ratio = total as f64 / reference.max(1) as f64;
        match self {
            LrScaling::Sqrt | LrScaling::AdaScale => lr0 * ratio.sqrt(),
            LrScaling::Linear => lr0 * ratio,
            LrScaling::None => lr0,
        }
    }

    /// The rule's name as `--lr-scaling` spells it.
    pub fn name(self) -> &'static str {
        match self {
            LrScaling::AdaScale => "adascale",
            LrScaling::Sqrt => "sqrt",
            LrScaling::Linear => "linear",
            LrScaling::None => "none",
        }
    }
}

/// AdaScale's gain ratio for a total batch of `total` samples when the learning rate was
/// tuned at `reference`, from `grad_sqr` (`|G|²`) and `grad_var` (the variance of **one**
/// sample's gradient, so `grad_var / b` is the variance of a gradient averaged over `b`
/// samples):
///
/// ```text
/// gain = (grad_var/reference + grad_sqr) / (grad_var/total + grad_sqr)
/// ```
///
/// which is AdaptDL's `(var + sqr) / (var/S + sqr)` with `S = total / reference` and
/// `var = grad_var / reference` (the variance at the reference batch). It lies between 1
/// and `S`: 1 when the gradient is exact (`grad_var = 0`), `S` when it is all noise
/// (`grad_sqr = 0`). `None` for negative, non-finite or all-zero statistics.
pub fn adascale_gain(grad_sqr: f64, grad_var: f64, total: usize, reference: usize) -> Option<f64> {
    if !(grad_sqr.is_finite() && grad_var.is_finite())
        || grad_sqr < 0.0
        || grad_var < 0.0
        || grad_sqr + grad_var <= 0.0
        || total == 0
        || reference == 0
    {
        return None;
    }
    let gain = (grad_var / reference as f64 + grad_sqr) / (grad_var / total as f64 + grad_sqr);
    gain.is_finite().then_some(gain)
}

/// The smoothed gradient statistics a worker keeps across steps (and in its checkpoint)
/// for AdaScale, as AdaptDL's `GradientNoiseScale` keeps them: bias-corrected exponential
/// moving averages of the per-step estimates ([`step_estimate`], unclamped), a step of
/// `total` samples decaying the earlier ones by `0.999^(total / reference)`. `grad_var`
/// is kept per sample, so the averages hold across changes of batch. `progress` is
/// AdaScale's scale-invariant progress: the sum of the steps' gains, in steps at the
/// reference batch (1 for a step without statistics).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct SmoothedStats {
    /// Biased moving average of `grad_sqr`.
    pub sqr_biased: f64,
    /// Biased moving average of `grad_var` (per sample).
    pub var_biased: f64,
    /// The weight the biased averages hold, `1 − Πθ` (0 before the first estimate).
    pub unbias: f64,
    /// Steps with an estimate.
    pub observations: u64,
    /// Scale-invariant progress: `Σ gain` over the steps, in reference-batch steps.
    pub progress: f64,
}

impl SmoothedStats {
    /// AdaptDL's smoothing per reference batch of samples.
    pub const SMOOTHING: f64 = 0.999;

    /// Adds one step's estimate (if any) of a step of `total` samples.
    pub fn observe(&mut self, estimate: Option<(f64, f64)>, total: usize, reference: usize) {
        let Some((sqr, var)) = estimate else {
            return;
        };
        if !(sqr.is_finite() && var.is_finite()) {
            return;
        }
        let theta = Self::SMOOTHING.powf(total as f64 / reference.max(1) as f64);
        self.sqr_biased = theta * self.sqr_biased + (1.0 - theta) * sqr;
        self.var_biased = theta * self.var_biased + (1.0 - theta) * var;
        self.unbias = theta * self.unbias + (1.0 - theta);
        self.observations += 1;
    }

    /// The smoothed `(grad_sqr, grad_var)`, each clamped at 0; `None` before the first
    /// estimate or when both are 0.
    pub fn estimate(&self) -> Option<(f64, f64)> {
        if self.unbias <= 0.0 {
            return None;
        }
        let sqr = (self.sqr_biased / self.unbias).max(0.0);
        let var = (self.var_biased / self.unbias).max(0.0);
        (sqr.is_finite() && var.is_finite() && sqr + var > 0.0).then_some((sqr, var))
    }

    /// AdaScale's gain from the smoothed statistics ([`adascale_gain`]).
    pub fn gain(&self, total: usize, reference: usize) -> Option<f64> {
        let (sqr, var) = self.estimate()?;
        adascale_gain(sqr, var, total, reference)
    }

    /// Advances the scale-invariant progress by one step's `gain` (1 without statistics).
    pub fn advance(&mut self, gain: Option<f64>) {
        self.progress += gain.unwrap_or(1.0);
    }

    /// Whether every field is finite and in range (a checkpoint's are checked).
    pub fn is_valid(&self) -> bool {
        self.sqr_biased.is_finite()
            && self.var_biased.is_finite()
            && (0.0..=1.0).contains(&self.unbias)
            && self.progress.is_finite()
            && self.progress >= 0.0
    }
}

/// The unbiased per-step estimates of the module docs from `m` micro-gradients over `n`
/// samples: `total_sqr = |ḡ|²`, `local_sqr = (1/m)·Σ|gᵢ|²`. `None` with fewer than 2
/// micro-gradients or a non-finite input.
pub fn step_estimate(total_sqr: f64, local_sqr: f64, m: f64, n: f64) -> Option<(f64, f64)> {
    if m < 2.0 || n <= 0.0 || !(total_sqr.is_finite() && local_sqr.is_finite()) {
        return None;
    }
    let sqr = (m * total_sqr - local_sqr) / (m - 1.0);
    let var = (local_sqr - total_sqr) * n / (m - 1.0);
    (sqr.is_finite() && var.is_finite()).then_some((sqr, var))
}

/// The mean of per-step estimates since the previous progress line.
#[derive(Debug, Clone, Default)]
pub struct StatsWindow {
    sqr: f64,
    var: f64,
    steps: u64,
}

impl StatsWindow {
    pub fn add(&mut self, estimate: Option<(f64, f64)>) {
        if let Some((s, v)) = estimate {
            self.sqr += s;
            self.var += v;
            self.steps += 1;
        }
    }

    /// The window's `(grad_sqr, grad_var)`: means clamped at 0; `None` when no step had an
    /// estimate or both are 0. Empties the window.
    pub fn take(&mut self) -> Option<(f64, f64)> {
        let w = std::mem::take(self);
        if w.steps == 0 {
            return None;
        }
        let n = w.steps as f64;
        let (s, v) = ((w.sqr / n).max(0.0), (w.var / n).max(0.0));
        (s + v > 0.0 && s.is_finite() && v.is_finite()).then_some((s, v))
    }
}

/// `x` rounded to 6 significant digits (statistics span many orders of magnitude).
pub fn significant(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let digits = 5 - x.abs().log10().floor() as i32;
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::{Stream, normal, rng};
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_contract_batch_is_read_and_checked() {
        assert_eq!(ContractBatch::from_lookup(lookup(&[]), 2).unwrap(), None);
        let b = ContractBatch::from_lookup(
            lookup(&[
                ("CONVERGE_BATCH_SIZE", "16"),
                ("CONVERGE_ACCUM_STEPS", "1"),
                ("CONVERGE_TOTAL_BATCH", "64"),
                ("CONVERGE_REFERENCE_BATCH", "32"),
            ]),
            2,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (b.per_worker, b.accum_steps, b.total, b.reference),
            (16, 1, 64, 32)
        );
        let b = ContractBatch::from_lookup(lookup(&[("CONVERGE_BATCH_SIZE", "8")]), 3)
            .unwrap()
            .unwrap();
        assert_eq!((b.accum_steps, b.total, b.reference), (0, 24, 24));
        for bad in [
            vec![("CONVERGE_BATCH_SIZE", "0")],
            vec![("CONVERGE_BATCH_SIZE", "x")],
            vec![("CONVERGE_BATCH_SIZE", "-3")],
            vec![("CONVERGE_BATCH_SIZE", "8"), ("CONVERGE_TOTAL_BATCH", "17")],
            vec![
                ("CONVERGE_BATCH_SIZE", "8"),
                ("CONVERGE_REFERENCE_BATCH", "0"),
            ],
            vec![("CONVERGE_ACCUM_STEPS", "1")],
        ] {
            assert!(
                ContractBatch::from_lookup(lookup(&bad), 2).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn learning_rate_rules() {
        assert!((LrScaling::Sqrt.scale(0.1, 256, 64) - 0.2).abs() < 1e-12);
        assert!((LrScaling::Linear.scale(0.1, 256, 64) - 0.4).abs() < 1e-12);
        assert_eq!(LrScaling::None.scale(0.1, 256, 64), 0.1);
        assert_eq!(LrScaling::Sqrt.scale(0.1, 64, 64), 0.1);
        // AdaScale's rule without statistics is the square-root rule.
        assert_eq!(LrScaling::AdaScale.scale(0.1, 256, 64), 0.2);
        for rule in [
            LrScaling::AdaScale,
            LrScaling::Sqrt,
            LrScaling::Linear,
            LrScaling::None,
        ] {
            assert_eq!(LrScaling::from_str(rule.name(), false), Ok(rule));
        }
    }

    #[test]
    fn adascale_gain_lies_between_one_and_the_scale() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * b.max(1.0);
        // At the reference batch the gain is 1 whatever the statistics.
        for (sqr, var) in [(1.0, 0.0), (0.0, 1.0), (0.02, 3.0)] {
            assert!(close(adascale_gain(sqr, var, 64, 64).unwrap(), 1.0));
        }
        // All noise (|G|² = 0): the linear rule's S; an exact gradient: 1.
        assert!(close(adascale_gain(0.0, 2.5, 256, 64).unwrap(), 4.0));
        assert!(close(adascale_gain(0.3, 0.0, 256, 64).unwrap(), 1.0));
        // Units: grad_var is one sample's variance. At the noise scale grad_var/grad_sqr =
        // 64 samples = the reference, the reference batch's gradient is half noise:
        // (1/64·64 + 1)/(64/256 + 1) = 2/1.25.
        assert!(close(adascale_gain(1.0, 64.0, 256, 64).unwrap(), 1.6));
        // AdaptDL's form, (var + sqr)/(var/S + sqr) with var at the reference batch.
        let (sqr, var, total, reference) = (0.0153, 2.41, 512usize, 32usize);
        let s = total as f64 / reference as f64;
        let v = var / reference as f64;
        assert!(close(
            adascale_gain(sqr, var, total, reference).unwrap(),
            (v + sqr) / (v / s + sqr)
        ));
        // S times the allocator's statistical efficiency (φ + B₀)/(φ + B), φ = var/sqr.
        let phi = var / sqr;
        assert!(close(
            adascale_gain(sqr, var, total, reference).unwrap(),
            s * (phi + reference as f64) / (phi + total as f64)
        ));
        // Always in [1, S], rising with the noise.
        let mut last = 1.0;
        for var in [0.0, 0.01, 0.1, 1.0, 10.0, 100.0, 1e4] {
            let g = adascale_gain(0.05, var, 512, 32).unwrap();
            assert!((1.0..=16.0).contains(&g) && g >= last, "{var}: {g}");
            last = g;
        }
        for (sqr, var) in [(0.0, 0.0), (-1.0, 1.0), (1.0, -1.0), (f64::NAN, 1.0)] {
            assert_eq!(adascale_gain(sqr, var, 256, 64), None, "{sqr} {var}");
        }
        assert_eq!(adascale_gain(1.0, 1.0, 256, 0), None);
    }

    #[test]
    fn smoothed_statistics_are_bias_corrected_moving_averages() {
        let mut s = SmoothedStats::default();
        // Before any estimate: no statistics, no gain (the trainer falls back to sqrt).
        assert_eq!(s.estimate(), None);
        assert_eq!(s.gain(256, 64), None);
        s.observe(None, 256, 64);
        assert_eq!(s.gain(256, 64), None);
        s.advance(None);
        assert_eq!((s.observations, s.progress), (0, 1.0));
        // The first estimate is taken whole; a constant one stays exact.
        s.observe(Some((0.5, 8.0)), 256, 64);
        let (sqr, var) = s.estimate().unwrap();
        assert!((sqr - 0.5).abs() < 1e-12 && (var - 8.0).abs() < 1e-12);
        for _ in 0..50 {
            s.observe(Some((0.5, 8.0)), 256, 64);
        }
        let (sqr, var) = s.estimate().unwrap();
        assert!((sqr - 0.5).abs() < 1e-12 && (var - 8.0).abs() < 1e-12);
        assert_eq!(s.observations, 51);
        // A step of S reference batches decays the past by 0.999^S: after a change the
        // average moves by (1 - 0.999^4) / unbias of the difference.
        let before = s;
        s.observe(Some((1.5, 8.0)), 256, 64);
        let theta = 0.999f64.powi(4);
        let unbias = theta * before.unbias + (1.0 - theta);
        let expect = 0.5 + (1.0 - theta) / unbias;
        assert!((s.estimate().unwrap().0 - expect).abs() < 1e-12);
        // Negative averages are clamped at use, not at entry (as AdaptDL does).
        let mut n = SmoothedStats::default();
        n.observe(Some((-0.2, 4.0)), 128, 32);
        assert_eq!(n.estimate(), Some((0.0, 4.0)));
        assert!((n.gain(128, 32).unwrap() - 4.0).abs() < 1e-12);
        n.observe(Some((0.6, -8.0)), 128, 32);
        assert!(n.estimate().unwrap().1 == 0.0);
        assert!((n.gain(128, 32).unwrap() - 1.0).abs() < 1e-12);
        // Progress advances by the gain: in steps at the reference batch.
        let mut p = SmoothedStats::default();
        p.advance(Some(3.5));
        p.advance(Some(2.0));
        assert_eq!(p.progress, 5.5);
        assert!(p.is_valid() && s.is_valid());
        assert!(!SmoothedStats { unbias: 2.0, ..p }.is_valid());
    }

    /// Per-sample gradients `G + ε` with `ε ~ N(0, σ²·I)` in `d` dimensions: the estimates,
    /// averaged over many steps, find `|G|²` and `tr(Σ) = d·σ²`.
    #[test]
    fn estimates_recover_known_gradient_statistics() {
        let d = 20;
        let g: Vec<f64> = (0..d).map(|i| 0.1 * (i as f64 - 10.0)).collect();
        let true_sqr: f64 = g.iter().map(|x| x * x).sum();
        let sigma: f64 = 0.8;
        let true_var = d as f64 * sigma * sigma;
        for (m, per_micro) in [(2usize, 16usize), (6, 4), (12, 1)] {
            let mut r = rng(7, m as u64, Stream::Init);
            let mut window = StatsWindow::default();
            let steps = 4000;
            for _ in 0..steps {
                let micro: Vec<Vec<f64>> = (0..m)
                    .map(|_| {
                        let mut sum = vec![0.0; d];
                        for _ in 0..per_micro {
                            for (s, gi) in sum.iter_mut().zip(&g) {
                                *s += gi + sigma * normal(&mut r);
                            }
                        }
                        sum.iter().map(|s| s / per_micro as f64).collect()
                    })
                    .collect();
                let mean: Vec<f64> = (0..d)
                    .map(|j| micro.iter().map(|v| v[j]).sum::<f64>() / m as f64)
                    .collect();
                let total_sqr: f64 = mean.iter().map(|x| x * x).sum();
                let local_sqr: f64 = micro
                    .iter()
                    .map(|v| v.iter().map(|x| x * x).sum::<f64>())
                    .sum::<f64>()
                    / m as f64;
                window.add(step_estimate(
                    total_sqr,
                    local_sqr,
                    m as f64,
                    (m * per_micro) as f64,
                ));
            }
            let (sqr, var) = window.take().unwrap();
            assert!(
                (sqr - true_sqr).abs() < 0.05 * true_sqr,
                "m {m}: {sqr} vs {true_sqr}"
            );
            assert!(
                (var - true_var).abs() < 0.05 * true_var,
                "m {m}: {var} vs {true_var}"
            );
            assert_eq!(window.take(), None, "the window empties");
        }
        assert_eq!(step_estimate(1.0, 2.0, 1.0, 8.0), None);
        assert_eq!(step_estimate(f64::NAN, 2.0, 4.0, 8.0), None);
    }

    #[test]
    fn windows_clamp_negative_means_and_round() {
        let mut w = StatsWindow::default();
        w.add(Some((-1.0, 3.0)));
        w.add(Some((0.5, 1.0)));
        assert_eq!(w.take(), Some((0.0, 2.0)));
        w.add(Some((-1.0, -1.0)));
        assert_eq!(w.take(), None);
        assert_eq!(significant(0.000123456789), 0.000123457);
        assert_eq!(significant(98765432.1), 98765400.0);
    }
}
