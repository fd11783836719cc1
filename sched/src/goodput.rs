//! Goodput: throughput × statistical efficiency, and the batch size that maximizes it for a
//! given allocation (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-
//! Optimized Deep Learning", OSDI'21, §3; the gradient noise scale of McCandlish et al., "An
//! Empirical Model of Large-Batch Training", 2018).
//!
//! # The model
//!
//! A job tuned at the **reference batch** `B₀` (total samples per optimizer step; its
//! learning rate and schedule are set for it) makes, per sample at a total batch `B`, a
//! fraction of the statistical progress it makes per sample at `B₀`:
//!
//! ```text
//! efficiency(B) = (φ + B₀) / (φ + B)        φ = B₀ · var / sqr   (the gradient noise scale, samples)
//! ```
//!
//! where `sqr` is the squared norm of the true gradient and `var` the variance of a gradient
//! estimated on `B₀` samples ([`GradientStats`], Pollux's `grad_sqr` and `grad_var`). It is 1 at
//! `B₀` and falls as `B` grows: little while `B ≪ φ` (more samples per step are almost as
//! useful as more steps), like `1/B` once `B ≫ φ`. **Goodput** is samples per second times
//! efficiency: progress in *reference samples* per second, the units in which a job's
//! remaining work is counted when its epochs were sized at `B₀`.
//!
//! The samples per second come from the job's fitted [`ThroughputModel`]: with `w` workers on
//! `n` hosts, a per-worker micro-batch `b` and `a` gradient-accumulation steps (so
//! `B = w·b·(a + 1)`), one optimizer step takes
//!
//! ```text
//! T = t(w, n, b) + a·(θ_c·b + θ_0) = θ_c·B/w + (a + 1)·θ_0 + S(w, n)
//! ```
//!
//! — `a` extra forward/backward passes, one synchronization `S` (the model's sync and
//! per-host terms), as Pollux's simulator charges `step + (step − sync)·accum`.
//!
//! # The best batch ([`best_plan`])
//!
//! For a fixed `a`, goodput `∝ B / ((θ_c·B/w + K)(φ + B))` with `K = (a + 1)·θ_0 + S` has one
//! maximum, at `B* = √(K·φ·w / θ_c)`, and rises before it and falls after it. So on each
//! accumulation count's range of batches (the smallest `a` that keeps `b` within the largest
//! per-worker batch) the best batch is `B*` clamped into the range; [`best_plan`] takes the
//! best of those, rounded to whole per-worker micro-batches. Pollux samples 50 batch sizes
//! on a geometric grid instead; the closed form finds the same optimum of the same model
//! (property test `best_plan_beats_a_dense_grid`) in `O(accumulation counts)`.
//!
//! Limits ([`BatchLimits`]): `B` between `max(B₀, w·min_per_worker)` and `max_total`, the
//! micro-batch between `min_per_worker` and `max_per_worker` (what fits in GPU memory). As in
//! Pollux, a single worker that trains above `B₀` accumulates at least once (the gradient
//! statistics need two micro-batches to be estimated).

use serde::{Deserialize, Serialize};

use crate::throughput::ThroughputModel;

/// Gradient statistics a worker reports (AdaptDL's `grad_sqr` and `grad_var`), for the
/// efficiency model in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradientStats {
    /// Squared L2 norm of the (true) gradient, `|g|²`; finite, `>= 0`.
    pub sqr: f64,
    /// Variance (trace of the covariance) of a gradient estimated on the reference batch;
    /// finite, `>= 0`.
    pub var: f64,
}

impl GradientStats {
    /// The statistics if both are finite and non-negative and not both 0; `None` otherwise
    /// (a report with such statistics is ignored, never fitted).
    pub fn new(sqr: f64, var: f64) -> Option<Self> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        (ok(sqr) && ok(var) && sqr + var > 0.0).then_some(Self { sqr, var })
    }

    /// The gradient noise scale `φ = B₀·var/sqr`, in samples (`+∞` when `sqr` is 0: every
    /// batch is as efficient as the reference).
    pub fn noise_scale(&self, reference_batch: f64) -> f64 {
        if self.sqr > 0.0 {
            reference_batch * self.var / self.sqr
        } else {
            f64::INFINITY
        }
    }

    /// Statistical efficiency of a total batch `batch` relative to `reference_batch`, in
    /// `(0, 1]` for `batch >= reference_batch` (above 1 below it).
    pub fn efficiency(&self, reference_batch: f64, batch: f64) -> f64 {
        let phi = self.noise_scale(reference_batch);
        if !phi.is_finite() {
            return 1.0;
        }
        if batch <= 0.0 || !batch.is_finite() {
            return 0.0;
        }
        (phi + reference_batch) / (phi + batch)
    }
}

/// The batch sizes a job may run with, in samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchLimits {
    /// `B₀`: the total batch the job's hyperparameters were tuned for, and the smallest it
    /// runs with.
    pub reference: u32,
    /// Largest total batch (where the learning-rate scaling rule still holds).
    pub max_total: u32,
    /// Smallest per-worker micro-batch worth running.
    pub min_per_worker: u32,
    /// Largest per-worker micro-batch that fits in a worker's memory.
    pub max_per_worker: u32,
}

/// Why [`BatchLimits::new`] refused a set of limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("batch limits: {0}")]
pub struct BatchLimitsError(String);

impl BatchLimits {
    /// Checked limits: all positive, `reference <= max_total`,
    /// `min_per_worker <= max_per_worker`, `min_per_worker <= max_total`.
    pub fn new(
        reference: u32,
        max_total: u32,
        min_per_worker: u32,
        max_per_worker: u32,
    ) -> Result<Self, BatchLimitsError> {
        if reference == 0 || min_per_worker == 0 {
            return Err(BatchLimitsError(
                "reference batch and smallest per-worker batch must be positive".into(),
            ));
        }
        if reference > max_total {
            return Err(BatchLimitsError(format!(
                "reference batch {reference} above the largest total batch {max_total}"
            )));
        }
        if min_per_worker > max_per_worker || min_per_worker > max_total {
            return Err(BatchLimitsError(format!(
                "smallest per-worker batch {min_per_worker} above the largest per-worker \
                 ({max_per_worker}) or total ({max_total}) batch"
            )));
        }
        Ok(Self {
            reference,
            max_total,
            min_per_worker,
            max_per_worker,
        })
    }

    /// Most workers that can share one step: every worker needs at least
    /// `min_per_worker` samples of at most `max_total`.
    pub fn max_workers(&self) -> u32 {
        (self.max_total / self.min_per_worker.max(1)).max(1)
    }

    /// The plan a job runs before it has gradient statistics (Pollux's rule): the smallest
    /// total batch its world size allows, `max(B₀, w·min_per_worker)`, with the fewest
    /// accumulation steps; `None` when that exceeds `max_total`.
    pub fn initial_plan(&self, workers: u32) -> Option<BatchPlan> {
        let w = u64::from(workers.max(1));
        let total = u64::from(self.reference).max(w * u64::from(self.min_per_worker));
        if total > u64::from(self.max_total) {
            return None;
        }
        self.split(workers.max(1), total as f64)
    }

    /// The fewest accumulation steps that keep a total batch `total` within the per-worker
    /// limit on `workers` workers (at least 1 for one worker above the reference batch).
    fn accumulation_for(&self, workers: u32, total: f64) -> u32 {
        let local = total / f64::from(workers.max(1));
        let mut accum = ((local / f64::from(self.max_per_worker) - 1e-9).ceil() - 1.0).max(0.0);
        if workers <= 1 && total > f64::from(self.reference) + 1e-9 {
            accum = accum.max(1.0);
        }
        accum.min(f64::from(u32::MAX)) as u32
    }

    /// Whole micro-batches for about `total` samples on `workers` workers, within the limits
    /// (the per-worker batch rounded up, then capped so the total stays within `max_total`).
    fn split(&self, workers: u32, total: f64) -> Option<BatchPlan> {
        let accum = self.accumulation_for(workers, total);
        let count = u64::from(workers) * (u64::from(accum) + 1);
        let per = (total / count as f64 - 1e-9).ceil().max(1.0) as u64;
        let cap = u64::from(self.max_total) / count;
        let per = per
            .min(cap)
            .min(u64::from(self.max_per_worker))
            .max(u64::from(self.min_per_worker));
        let total = per * count;
        if total > u64::from(self.max_total) || per > u64::from(self.max_per_worker) {
            return None;
        }
        Some(BatchPlan {
            total: u32::try_from(total).ok()?,
            per_worker: per as u32,
            accum_steps: accum,
        })
    }
}

/// How a job runs its batch on a given allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchPlan {
    /// Total batch per optimizer step, samples (`workers · per_worker · (accum_steps + 1)`).
    pub total: u32,
    /// Micro-batch each worker computes per forward/backward pass, samples.
    pub per_worker: u32,
    /// Extra micro-batches accumulated per optimizer step (0 = none).
    pub accum_steps: u32,
}

/// Seconds per optimizer step of `plan` on `workers` workers spanning `nodes` hosts (module
/// docs: `t(w, n, b) + a·(θ_c·b + θ_0)`).
pub fn step_time_s(model: &ThroughputModel, workers: u32, nodes: u32, plan: &BatchPlan) -> f64 {
    let b = f64::from(plan.per_worker);
    model.step_time_s(workers, nodes, b) + f64::from(plan.accum_steps) * model.compute_time_s(b)
}

/// Samples per second of `plan` (0 for 0 workers).
pub fn samples_per_s(model: &ThroughputModel, workers: u32, nodes: u32, plan: &BatchPlan) -> f64 {
    if workers == 0 {
        return 0.0;
    }
    f64::from(plan.total) / step_time_s(model, workers, nodes, plan)
}

/// Goodput of `plan`: samples per second × efficiency relative to `limits.reference`
/// (reference samples per second). Without statistics the efficiency is taken as 1.
pub fn goodput(
    model: &ThroughputModel,
    gradient: Option<&GradientStats>,
    limits: &BatchLimits,
    workers: u32,
    nodes: u32,
    plan: &BatchPlan,
) -> f64 {
    let eff = gradient.map_or(1.0, |g| {
        g.efficiency(f64::from(limits.reference), f64::from(plan.total))
    });
    samples_per_s(model, workers, nodes, plan) * eff
}

/// Most accumulation counts [`best_plan`] tries (plans with more accumulation steps than
/// this are not searched).
pub const MAX_ACCUM: u32 = 256;

/// The plan with the most goodput for `workers` workers on `nodes` hosts, and that goodput
/// (module docs, "The best batch"). Without gradient statistics, [`BatchLimits::initial_plan`].
/// `None` when no batch fits the limits at this world size (or `workers` is 0).
pub fn best_plan(
    model: &ThroughputModel,
    gradient: Option<&GradientStats>,
    limits: &BatchLimits,
    workers: u32,
    nodes: u32,
) -> Option<(BatchPlan, f64)> {
    if workers == 0 {
        return None;
    }
    let score = |plan: &BatchPlan| goodput(model, gradient, limits, workers, nodes, plan);
    let Some(gradient) = gradient else {
        let plan = limits.initial_plan(workers)?;
        return Some((plan, score(&plan)));
    };
    let w = f64::from(workers);
    let lo = f64::from(limits.reference).max(w * f64::from(limits.min_per_worker));
    let hi = f64::from(limits.max_total);
    if lo > hi {
        return None;
    }
    let [theta_c, theta_0, ..] = model.coefficients();
    // S(w, n): the step at a zero batch minus the fixed compute.
    let sync = (model.step_time_s(workers, nodes, 0.0) - theta_0).max(0.0);
    let phi = gradient.noise_scale(f64::from(limits.reference));
    let max_local = f64::from(limits.max_per_worker);
    let mut best: Option<(BatchPlan, f64)> = None;
    // A total is tried with its per-worker batch rounded up and down.
    let mut consider = |total: f64| {
        let Some(up) = limits.split(workers, total.clamp(lo, hi)) else {
            return;
        };
        let count = f64::from(workers) * f64::from(up.accum_steps + 1);
        let down = limits.split(workers, (f64::from(up.total) - count).clamp(lo, hi));
        for plan in std::iter::once(up).chain(down) {
            let g = score(&plan);
            if best
                .as_ref()
                .is_none_or(|(p, b)| g > *b || (g == *b && plan.total < p.total))
            {
                best = Some((plan, g));
            }
        }
    };
    // The largest total `accumulation_for` runs with `a` accumulation steps: `w·max_local`
    // per step, except that one worker accumulates at least once beyond the reference
    // batch (Pollux's rule), so its range without accumulation ends at `B₀`.
    let top = |a: u32| {
        let t = w * max_local * f64::from(a + 1);
        if workers <= 1 && a == 0 {
            t.min(f64::from(limits.reference))
        } else {
            t
        }
    };
    // Each accumulation count's range of totals, lowest first; at most MAX_ACCUM of them.
    let mut accum = limits.accumulation_for(workers, lo);
    let mut settled = 0;
    loop {
        // The range of totals that uses `accum` accumulation steps.
        let range_lo = if accum == 0 {
            lo
        } else {
            top(accum - 1).max(lo)
        };
        let range_hi = top(accum).min(hi);
        let k = f64::from(accum + 1) * theta_0 + sync;
        let star = if theta_c > 0.0 && phi.is_finite() {
            (k * phi * w / theta_c).sqrt()
        } else {
            f64::INFINITY
        };
        let target = if star.is_nan() {
            range_lo
        } else {
            star.clamp(range_lo, range_hi.max(range_lo))
        };
        consider(target);
        // Goodput with `accum` steps is unimodal with its peak at `star`: the range's top
        // is the target when `star` lies above it and dominated when `star` lies within.
        if star.is_nan() {
            consider(range_hi.max(range_lo));
        }
        // Goodput at a given total only falls with more accumulation steps (a larger fixed
        // cost per step), and with `accum` steps it falls beyond `star`: once `star` lies
        // within this range, a later range's totals are worth at most this range's top,
        // already considered. One more range is tried for the rounding of per-worker batches.
        if star <= range_hi {
            settled += 1;
        }
        if range_hi >= hi || accum >= MAX_ACCUM || settled > 1 {
            break;
        }
        accum += 1;
    }
    consider(lo);
    best
}

/// A job's goodput as a function of its allocation: its throughput model, its latest
/// gradient statistics (none yet: [`BatchLimits::initial_plan`]) and its batch limits.
#[derive(Debug, Clone, PartialEq)]
pub struct GoodputFn {
    pub model: ThroughputModel,
    pub gradient: Option<GradientStats>,
    pub limits: BatchLimits,
}

impl GoodputFn {
    /// [`best_plan`] for `workers` workers on `nodes` hosts.
    pub fn best(&self, workers: u32, nodes: u32) -> Option<(BatchPlan, f64)> {
        best_plan(
            &self.model,
            self.gradient.as_ref(),
            &self.limits,
            workers,
            nodes,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(theta_c: f64, theta_0: f64, inter: f64) -> ThroughputModel {
        ThroughputModel::from_coefficients([theta_c, theta_0, inter / 4.0, inter, 0.0], 3)
    }

    fn limits() -> BatchLimits {
        BatchLimits::new(128, 4096, 16, 256).unwrap()
    }

    #[test]
    fn efficiency_is_one_at_the_reference_and_falls_with_the_batch() {
        let g = GradientStats::new(1.0, 4.0).unwrap();
        assert_eq!(g.noise_scale(128.0), 512.0);
        assert!((g.efficiency(128.0, 128.0) - 1.0).abs() < 1e-12);
        let e = g.efficiency(128.0, 512.0);
        assert!((e - 640.0 / 1024.0).abs() < 1e-12);
        assert!(g.efficiency(128.0, 4096.0) < e);
        // No gradient signal left to lose: every batch is as efficient.
        assert_eq!(
            GradientStats::new(0.0, 1.0)
                .unwrap()
                .efficiency(128.0, 4096.0),
            1.0
        );
    }

    #[test]
    fn bad_statistics_are_refused() {
        for (s, v) in [
            (f64::NAN, 1.0),
            (1.0, -1.0),
            (f64::INFINITY, 1.0),
            (0.0, 0.0),
        ] {
            assert!(GradientStats::new(s, v).is_none(), "{s} {v}");
        }
    }

    #[test]
    fn limits_are_checked() {
        assert!(BatchLimits::new(0, 10, 1, 1).is_err());
        assert!(BatchLimits::new(256, 128, 1, 1).is_err());
        assert!(BatchLimits::new(64, 128, 32, 16).is_err());
        assert_eq!(limits().max_workers(), 256);
    }

    #[test]
    fn initial_plan_is_the_smallest_batch_the_world_size_allows() {
        let l = limits();
        let p = l.initial_plan(1).unwrap();
        assert_eq!((p.total, p.per_worker, p.accum_steps), (128, 128, 0));
        let p = l.initial_plan(16).unwrap();
        assert_eq!((p.total, p.per_worker, p.accum_steps), (256, 16, 0));
        assert!(l.initial_plan(300).is_none());
    }

    #[test]
    fn a_noisy_gradient_wants_a_large_batch_and_a_clean_one_a_small_batch() {
        let m = model(1e-3, 0.05, 0.1);
        let l = limits();
        let noisy = GradientStats::new(1.0, 100.0).unwrap(); // φ = 12,800 samples
        let clean = GradientStats::new(1.0, 0.1).unwrap(); // φ = 12.8 samples
        let (big, _) = best_plan(&m, Some(&noisy), &l, 8, 2).unwrap();
        let (small, _) = best_plan(&m, Some(&clean), &l, 8, 2).unwrap();
        assert!(big.total > 4 * small.total, "{big:?} vs {small:?}");
        assert!(small.total < 256, "{small:?}");
    }

    #[test]
    fn one_worker_above_the_reference_accumulates() {
        let m = model(1e-3, 0.2, 0.0);
        let noisy = GradientStats::new(1.0, 1000.0).unwrap();
        let (plan, _) = best_plan(&m, Some(&noisy), &limits(), 1, 1).unwrap();
        assert!(plan.total > 128);
        assert!(plan.accum_steps >= 1, "{plan:?}");
        assert_eq!(plan.total, plan.per_worker * (plan.accum_steps + 1));
    }

    fn arbitrary_case()
    -> impl Strategy<Value = (ThroughputModel, GradientStats, BatchLimits, u32, u32)> {
        (
            1e-5f64..1e-2,
            0.0f64..0.5,
            0.0f64..1.0,
            0.0f64..0.5,
            1e-3f64..10.0,
            1e-3f64..100.0,
            (1u32..512, 1u32..64, 1u32..8, 1u32..64),
            1u32..64,
            1u32..8,
        )
            .prop_map(|(c, t0, intra, inter, sqr, var, (r, mx, mn, ml), w, n)| {
                let m = ThroughputModel::from_coefficients([c, t0, intra, inter, 0.01], 4);
                let min_pw = mn;
                let max_pw = min_pw * ml;
                let reference = r;
                let max_total = reference * mx;
                let l = BatchLimits::new(reference, max_total.max(min_pw), min_pw, max_pw).unwrap();
                (m, GradientStats::new(sqr, var).unwrap(), l, w, n.min(w))
            })
    }

    proptest! {
        #[test]
        fn best_plan_beats_a_dense_grid((m, g, l, w, n) in arbitrary_case()) {
            let best = best_plan(&m, Some(&g), &l, w, n);
            let lo = f64::from(l.reference).max(f64::from(w) * f64::from(l.min_per_worker));
            let hi = f64::from(l.max_total);
            if lo > hi {
                prop_assert!(best.is_none());
                return Ok(());
            }
            // Whole micro-batches may miss every total within the bounds: then no point of
            // the grid is feasible either.
            let Some((plan, value)) = best else {
                for i in 0..=2000u32 {
                    let total = lo * (hi / lo).powf(f64::from(i) / 2000.0);
                    prop_assert!(l.split(w, total).is_none(), "grid found a plan at {}", total);
                }
                return Ok(());
            };
            prop_assert_eq!(plan.total, w * plan.per_worker * (plan.accum_steps + 1));
            prop_assert!(plan.total <= l.max_total);
            prop_assert!(plan.per_worker >= l.min_per_worker && plan.per_worker <= l.max_per_worker);
            prop_assert!((value - goodput(&m, Some(&g), &l, w, n, &plan)).abs() <= 1e-9 * value.max(1.0));
            // Pollux's search: 50 geometric points between the bounds (plus 2,000 here).
            for i in 0..=2000u32 {
                let total = lo * (hi / lo).powf(f64::from(i) / 2000.0);
                if let Some(p) = l.split(w, total).filter(|p| p.accum_steps <= MAX_ACCUM) {
                    let v = goodput(&m, Some(&g), &l, w, n, &p);
                    prop_assert!(v <= value * (1.0 + 1e-3), "grid {:?} {} beats {:?} {}", p, v, plan, value);
                }
            }
        }
    }
}
