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
    /// `lr = lr₀ · √(total / reference)` (Krizhevsky 2014; Hoffer et al. 2017).
    #[default]
    Sqrt,
    /// `lr = lr₀ · total / reference` (Goyal et al. 2017).
    Linear,
    /// `lr = lr₀` whatever the batch.
    None,
}

impl LrScaling {
    /// The learning rate for a total batch of `total` samples when `lr0` was tuned at
    /// `reference` samples.
    pub fn scale(self, lr0: f64, total: usize, reference: usize) -> f64 {
        let ratio = total as f64 / reference.max(1) as f64;
        match self {
            LrScaling::Sqrt => lr0 * ratio.sqrt(),
            LrScaling::Linear => lr0 * ratio,
            LrScaling::None => lr0,
        }
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
