//! The cache of fits: each job's last loss-curve fit and its throughput models, an explicit
//! value that the caller owns and passes to every step ([`crate::schedule::step`]), instead
//! of a lock hidden behind `&self`. A step's outputs are a function of its inputs and of the
//! cache it is given, and the cache it leaves is too: two steps on equal inputs with equal
//! caches give equal outcomes and equal caches (a property test in [`crate::schedule`]).
//!
//! - **Curves** are refitted only when [`refit_due`] says so (every new point while the
//!   history is short, then every [`crate::fit::REFIT_EVERY`] points), or after the history
//!   was cut back (a resume from an earlier checkpoint); otherwise the last fit stands. So
//!   what a job's curve is depends only on the reports added and the steps at which it was
//!   asked for, and a replay of the same inputs gives the same curves.
//! - **Held-out curves** (sweep trials that report `eval_loss`) follow the same rule.
//! - **Throughput models** are refitted only when the observations they are fitted on
//!   change; each job has at most one per [`ModelScope`].
//!
//! The service keeps one cache for its lifetime (it is rebuilt, like everything else, on a
//! restart: the first step refits every job); the simulator keeps one per run.

use std::collections::BTreeMap;

use converge_common::JobId;

use crate::fit::{Curve, FitConfig, LossPoint, fit_loss_curve, refit_due};
use crate::history::JobHistory;
use crate::throughput::{StepObservation, ThroughputModel, ThroughputPrior};

/// Which of a job's step observations a throughput model is fitted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModelScope {
    /// Every generation observed: the model the decision uses.
    All,
    /// The generations before the job's current one: an out-of-sample prediction of the
    /// current generation's step time (the status's `predicted_step_time_s`).
    Earlier,
}

/// The last curve fit of one job: the history's reset count and points added at the time.
#[derive(Debug, Clone, PartialEq)]
struct CurveFit {
    resets: u64,
    added: usize,
    curve: Option<Curve>,
}

/// The model cached under `key` if it was fitted on `observations`, else a new fit (counted
/// in `fits`) that replaces it.
fn cached_fit<K: Ord>(
    models: &mut BTreeMap<K, (Vec<StepObservation>, ThroughputModel)>,
    fits: &mut u64,
    key: K,
    observations: &[StepObservation],
    prior: &ThroughputPrior,
) -> ThroughputModel {
    if let Some((seen, model)) = models.get(&key)
        && seen.as_slice() == observations
    {
        return model.clone();
    }
    let model = ThroughputModel::fit(observations, prior);
    *fits += 1;
    models.insert(key, (observations.to_vec(), model.clone()));
    model
}

/// The curve cached in `fits` for the job of `history` (`None` when none, or the history was
/// cut back since) unless `refit`; then a new fit on `points` (counted in `count`) that
/// replaces it.
fn cached_curve(
    fits: &mut BTreeMap<JobId, CurveFit>,
    count: &mut u64,
    (job, history): (&JobId, &JobHistory),
    refit: bool,
    points: impl FnOnce() -> Vec<LossPoint>,
    cfg: &FitConfig,
) -> Option<Curve> {
    if !refit {
        return fits
            .get(job)
            .filter(|fit| fit.resets == history.resets())
            .and_then(|fit| fit.curve.clone());
    }
    let curve = fit_loss_curve(&points(), cfg);
    *count += 1;
    fits.insert(
        job.clone(),
        CurveFit {
            resets: history.resets(),
            added: history.added(),
            curve: curve.clone(),
        },
    );
    curve
}

/// The caller-owned cache of fits (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FitCache {
    curves: BTreeMap<JobId, CurveFit>,
    eval_curves: BTreeMap<JobId, CurveFit>,
    models: BTreeMap<(JobId, ModelScope), (Vec<StepObservation>, ThroughputModel)>,
    /// Throughput models per (job, GPU type), fitted on the job's observations on that type.
    type_models: BTreeMap<(JobId, String), (Vec<StepObservation>, ThroughputModel)>,
    curve_fits: u64,
    model_fits: u64,
}

impl FitCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Points added to `history` since its last fit when a refit is due (`usize::MAX` when
    /// it was never fitted, or was cut back since), `None` when the last fit stands.
    pub fn refit_pending(&self, job: &JobId, history: &JobHistory) -> Option<usize> {
        match self.curves.get(job) {
            Some(fit) if fit.resets == history.resets() => {
                let new = history.added().saturating_sub(fit.added);
                refit_due(history.points().len(), new).then_some(new)
            }
            _ => Some(usize::MAX),
        }
    }

    /// The job's loss curve: refitted on [`JobHistory::loss_points`] with `cfg` when `refit`
    /// is true and a refit is due ([`FitCache::refit_pending`]); otherwise the last fit as it
    /// stands (`None` if there was none). `refit = false` lets a step spread refits over
    /// several steps. `cfg` must be the same at every call (the cache does not key on it).
    pub fn curve(
        &mut self,
        job: &JobId,
        history: &JobHistory,
        cfg: &FitConfig,
        refit: bool,
    ) -> Option<Curve> {
        let pending = self.refit_pending(job, history).is_some();
        cached_curve(
            &mut self.curves,
            &mut self.curve_fits,
            (job, history),
            pending && refit,
            || history.loss_points(),
            cfg,
        )
    }

    /// Whether the job's held-out curve is due for a refit: never fitted, the history cut
    /// back since, or points added by the rule of [`FitCache::refit_pending`].
    pub fn eval_refit_pending(&self, job: &JobId, history: &JobHistory) -> bool {
        self.eval_curves.get(job).is_none_or(|fit| {
            fit.resets != history.resets()
                || refit_due(
                    history.points().len(),
                    history.added().saturating_sub(fit.added),
                )
        })
    }

    /// The job's held-out loss curve ([`crate::sweep_stop`] judges sweep trials by it):
    /// refitted on [`JobHistory::eval_points`] with `cfg` when `refit` is true and a refit
    /// is due ([`FitCache::eval_refit_pending`]), otherwise the last fit as it stands
    /// (`None` if there was none, or the history was cut back since). `None` with fewer
    /// held-out points than `cfg.min_points`. Counted with the curve fits
    /// ([`FitCache::fits`]).
    pub fn eval_curve(
        &mut self,
        job: &JobId,
        history: &JobHistory,
        cfg: &FitConfig,
        refit: bool,
    ) -> Option<Curve> {
        let pending = self.eval_refit_pending(job, history);
        cached_curve(
            &mut self.eval_curves,
            &mut self.curve_fits,
            (job, history),
            pending && refit,
            || history.eval_points(),
            cfg,
        )
    }

    /// The job's throughput model on `observations` (its [`ModelScope`] tells which), fitted
    /// with `prior` only when they differ from those of the cached model. `prior` must be the
    /// same at every call.
    pub fn model(
        &mut self,
        job: &JobId,
        scope: ModelScope,
        observations: &[StepObservation],
        prior: &ThroughputPrior,
    ) -> ThroughputModel {
        cached_fit(
            &mut self.models,
            &mut self.model_fits,
            (job.clone(), scope),
            observations,
            prior,
        )
    }

    /// The job's throughput model on its `observations` on GPU type `gpu_type` (for its speed
    /// there, [`crate::gpu_types`]), refitted only when they change, as [`FitCache::model`].
    pub fn model_on_type(
        &mut self,
        job: &JobId,
        gpu_type: &str,
        observations: &[StepObservation],
        prior: &ThroughputPrior,
    ) -> ThroughputModel {
        cached_fit(
            &mut self.type_models,
            &mut self.model_fits,
            (job.clone(), gpu_type.to_string()),
            observations,
            prior,
        )
    }

    /// Forgets every job for which `keep` is false (finished or deleted jobs), so the cache
    /// stays as large as the active jobs.
    pub fn retain(&mut self, mut keep: impl FnMut(&JobId) -> bool) {
        self.curves.retain(|job, _| keep(job));
        self.eval_curves.retain(|job, _| keep(job));
        self.models.retain(|(job, _), _| keep(job));
        self.type_models.retain(|(job, _), _| keep(job));
    }

    /// Curve fits and throughput-model fits run through this cache so far.
    pub fn fits(&self) -> (u64, u64) {
        (self.curve_fits, self.model_fits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::ProgressReport;

    /// Rank 0's report of `generation` (see [`crate::history::tests::report`]).
    fn report(generation: u64, samples: u64, loss: f64, time: f64) -> ProgressReport {
        crate::history::tests::report(generation, 0, samples, loss, time)
    }

    /// After `retain` keeps no job, `cache` holds nothing but its count of `curve_fits`.
    fn assert_forgets_every_fit(mut cache: FitCache, curve_fits: u64) {
        cache.retain(|_| false);
        assert_eq!(
            cache,
            FitCache {
                curve_fits,
                ..FitCache::new()
            }
        );
    }

    #[test]
    fn curves_are_refitted_every_few_points_and_after_a_cut() {
        let cfg = FitConfig::default();
        let id = JobId::new("j").unwrap();
        let loss = |k: u64| 2.0 / (1.0 + k as f64 / 300.0) + 0.2;
        let mut h = JobHistory::default();
        let mut cache = FitCache::new();
        for i in 1..=30 {
            h.add(&report(1, i * 10, loss(i * 10), i as f64));
        }
        let fitted = cache
            .curve(&id, &h, &cfg, true)
            .expect("a curve from 30 points");
        assert_eq!(cache.fits().0, 1);
        // A few more points: the last fit stands, no new fit.
        for i in 31..=33 {
            h.add(&report(1, i * 10, loss(i * 10), i as f64));
        }
        assert_eq!(cache.refit_pending(&id, &h), None);
        assert_eq!(cache.curve(&id, &h, &cfg, true), Some(fitted.clone()));
        assert_eq!(cache.fits().0, 1);
        // Enough new points: refitted.
        for i in 34..=45 {
            h.add(&report(1, i * 10, loss(i * 10), i as f64));
        }
        assert!(cache.refit_pending(&id, &h).is_some());
        // Not allowed to refit this step: the last fit stands.
        assert_eq!(cache.curve(&id, &h, &cfg, false), Some(fitted.clone()));
        cache.curve(&id, &h, &cfg, true);
        assert_eq!(cache.fits().0, 2);
        // A resume from an earlier checkpoint cuts the history back: refit at once.
        h.add(&report(2, 200, loss(200), 50.0));
        assert_eq!(cache.refit_pending(&id, &h), Some(usize::MAX));
        assert_eq!(cache.curve(&id, &h, &cfg, false), None);
        cache.curve(&id, &h, &cfg, true);
        assert_eq!(cache.fits().0, 3);
        // Forgotten jobs are fitted anew.
        assert_forgets_every_fit(cache, 3);
    }

    #[test]
    fn held_out_curves_fit_the_eval_losses_by_the_same_refit_rule() {
        let cfg = FitConfig::default();
        let id = JobId::new("j").unwrap();
        let held_out = |k: u64| 1.5 / (1.0 + k as f64 / 200.0) + 0.4;
        let mut h = JobHistory::default();
        let mut cache = FitCache::new();
        let add = |h: &mut JobHistory, i: u64, generation: u64| {
            let mut r = report(generation, i * 10, 9.0, i as f64);
            // Every other report carries a held-out loss; the rest are skipped by the fit.
            r.line.eval_loss = i.is_multiple_of(2).then_some(held_out(i * 10));
            h.add(&r);
        };
        for i in 1..=8 {
            add(&mut h, i, 1);
        }
        assert_eq!(h.eval_points().len(), 4);
        assert_eq!(
            cache.eval_curve(&id, &h, &cfg, true),
            None,
            "4 points are too few"
        );
        for i in 9..=30 {
            add(&mut h, i, 1);
        }
        assert_eq!(h.eval_points().len(), 15);
        let fitted = cache
            .eval_curve(&id, &h, &cfg, true)
            .expect("a held-out curve");
        assert_eq!(cache.fits().0, 2);
        let at = fitted.predict(600.0);
        assert!(
            (at - held_out(600)).abs() < 0.01,
            "{at} against {}",
            held_out(600)
        );
        // The training losses (all 9) are not what it fits.
        assert!(fitted.predict(300.0) < 2.0);
        // A few more points: the last fit stands.
        add(&mut h, 31, 1);
        assert_eq!(cache.eval_curve(&id, &h, &cfg, true), Some(fitted.clone()));
        assert_eq!(cache.fits().0, 2);
        // Enough new points but no refit allowed this step: the last fit stands.
        for i in 32..=45 {
            add(&mut h, i, 1);
        }
        assert!(cache.eval_refit_pending(&id, &h));
        assert_eq!(cache.eval_curve(&id, &h, &cfg, false), Some(fitted.clone()));
        assert_eq!(cache.fits().0, 2);
        // A resume from an earlier checkpoint: the last fit no longer stands; refitted.
        add(&mut h, 20, 2);
        assert_eq!(cache.eval_curve(&id, &h, &cfg, false), None);
        cache.eval_curve(&id, &h, &cfg, true);
        assert_eq!(cache.fits().0, 3);
        assert_forgets_every_fit(cache, 3);
    }

    #[test]
    fn models_are_refitted_only_when_their_observations_change() {
        let id = JobId::new("j").unwrap();
        let prior = ThroughputPrior::default();
        let seen = |step_time_s: f64| StepObservation {
            workers: 2,
            nodes: 1,
            local_batch: 32.0,
            step_time_s,
            sync_time_s: None,
        };
        let mut cache = FitCache::new();
        let a = cache.model(&id, ModelScope::All, &[seen(0.5)], &prior);
        assert_eq!(a, ThroughputModel::fit(&[seen(0.5)], &prior));
        assert_eq!(cache.model(&id, ModelScope::All, &[seen(0.5)], &prior), a);
        assert_eq!(cache.fits().1, 1);
        // Another scope is another model.
        cache.model(&id, ModelScope::Earlier, &[], &prior);
        assert_eq!(cache.fits().1, 2);
        let b = cache.model(&id, ModelScope::All, &[seen(0.5), seen(0.7)], &prior);
        assert_eq!(cache.fits().1, 3);
        assert_eq!(b, ThroughputModel::fit(&[seen(0.5), seen(0.7)], &prior));
    }
}
