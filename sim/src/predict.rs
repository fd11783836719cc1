//! Four predictors of a loss curve from its history, compared by
//! `converge-sim predict-bench` ([`crate::predict_bench`], `docs/prediction.md`).
//!
//! All four are pure functions of the history (oldest point first) and never return a NaN
//! or negative loss. Progress is in samples processed, or in epochs for curves measured per
//! epoch (the Pollux validation runs); never in raw steps, whose worth changes with the
//! number of workers. Every fit below works on rescaled data, so the unit does not matter.
//!
//! | [`Predictor`] | what it is |
//! |---|---|
//! | [`Predictor::Strawman`] | SLAQ's strawman (Zhang et al., "SLAQ: Quality-Driven Scheduling for Distributed Machine Learning", SoCC'17): "the next Δloss equals the last Δloss", extrapolated linearly per unit of progress from the last two points |
//! | [`Predictor::Slaq`] | SLAQ's fit as published: the single family `1/(a·k² + b·k + c) + d`, weights `0.95^(n−i)`, the last 100 points, on the raw points |
//! | [`Predictor::Optimus`] | Optimus's fit (Peng et al., "Optimus: An Efficient Dynamic Resource Scheduler for Deep Learning Clusters", EuroSys'18): `1/(a·k + b) + c` with `a, b, c ≥ 0`, later points weighted more (the same weighted machinery, `0.95^(n−i)` over the last 100 points) |
//! | [`Predictor::Converge`] | ours: [`converge_sched::fit::fit_loss_curve`], the allocator's own fit: SLAQ's weights over every family, replaced by faster forgetting or a single family when that clearly forecasts the newest, held-out points better (see `fit.rs`) |
//!
//! SLAQ and Optimus are fitted with [`converge_sched::fit::fit_families`], i.e. with this project's
//! bounded, multi-start Levenberg–Marquardt (non-negative parameters, an asymptote between 0
//! and the smallest observed loss), restricted to their one family; the papers' own solvers
//! are not reproduced, only their models, weights and windows.

use converge_sched::fit::{self, Curve, CurveFamily, FitConfig, LossPoint, MAX_PREDICTED_LOSS};

/// One of the compared predictors; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Predictor {
    /// "Next Δloss = last Δloss", linear in progress.
    Strawman,
    /// SLAQ's published fit: `1/(a·k² + b·k + c) + d` only.
    Slaq,
    /// Optimus's fit: `1/(a·k + b) + c` only.
    Optimus,
    /// Converge's fit, [`converge_sched::fit::fit_loss_curve`].
    Converge,
}

impl Predictor {
    /// Every predictor, in the order of the benchmark's tables.
    pub const ALL: [Predictor; 4] = [
        Predictor::Strawman,
        Predictor::Slaq,
        Predictor::Optimus,
        Predictor::Converge,
    ];

    /// The predictor's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Predictor::Strawman => "strawman",
            Predictor::Slaq => "SLAQ",
            Predictor::Optimus => "Optimus",
            Predictor::Converge => "Converge",
        }
    }

    /// The forecast made from `history` (oldest first), or `None` when the history is too
    /// short: fewer than 2 valid points at distinct progress for the strawman, fewer than
    /// [`FitConfig::min_points`] (5) valid points for the fits. Points with a non-finite or
    /// negative progress or loss are ignored.
    pub fn forecast(self, history: &[LossPoint]) -> Option<Forecast> {
        match self {
            Predictor::Strawman => strawman(history),
            Predictor::Slaq => slaq(history).map(Forecast::Curve),
            Predictor::Optimus => optimus(history).map(Forecast::Curve),
            Predictor::Converge => converge(history).map(Forecast::Curve),
        }
    }
}

/// A prediction of the loss at any later progress.
#[derive(Debug, Clone, PartialEq)]
pub enum Forecast {
    /// The strawman's line through the last point: `loss + slope·(k − progress)`.
    Linear {
        /// Progress of the last observed point.
        progress: f64,
        /// Loss of the last observed point.
        loss: f64,
        /// Last observed Δloss per unit of progress.
        slope: f64,
    },
    /// A fitted curve.
    Curve(Curve),
}

impl Forecast {
    /// Predicted loss at `progress`: always finite and in `[0, MAX_PREDICTED_LOSS]` (a line
    /// is clamped at 0 where it would go negative; a NaN progress counts as the last
    /// observed point for a line and as 0 for a curve, see [`Curve::predict`]).
    pub fn predict(&self, progress: f64) -> f64 {
        match self {
            Forecast::Linear {
                progress: from,
                loss,
                slope,
            } => {
                let ahead = if progress.is_nan() {
                    0.0
                } else {
                    progress - from
                };
                let value = loss + slope * ahead;
                if value.is_nan() {
                    // Only `0·∞` gets here (an infinite progress on a flat line).
                    *loss
                } else {
                    value.clamp(0.0, MAX_PREDICTED_LOSS)
                }
            }
            Forecast::Curve(curve) => curve.predict(progress),
        }
    }
}

fn is_valid(p: &LossPoint) -> bool {
    p.samples.is_finite() && p.samples >= 0.0 && p.loss.is_finite() && p.loss >= 0.0
}

/// The strawman: the line through the last valid point with the slope between it and the
/// latest earlier valid point at a smaller progress. `None` without two such points.
pub fn strawman(history: &[LossPoint]) -> Option<Forecast> {
    let mut valid = history.iter().rev().filter(|p| is_valid(p));
    let last = valid.next()?;
    let previous = valid.find(|p| p.samples < last.samples)?;
    let slope = (last.loss - previous.loss) / (last.samples - previous.samples);
    slope.is_finite().then_some(Forecast::Linear {
        progress: last.samples,
        loss: last.loss,
        slope,
    })
}

/// SLAQ's published fit: [`CurveFamily::InvQuadratic`] only, SLAQ's weights and window
/// ([`FitConfig::default`]), on the raw points.
pub fn slaq(history: &[LossPoint]) -> Option<Curve> {
    fit::fit_families(history, &FitConfig::default(), &[CurveFamily::InvQuadratic])
}

/// Optimus's fit: [`CurveFamily::InvLinear`] only (`a, b, c ≥ 0`), newest points weighing
/// most ([`FitConfig::default`]'s weights and window).
pub fn optimus(history: &[LossPoint]) -> Option<Curve> {
    fit::fit_families(history, &FitConfig::default(), &[CurveFamily::InvLinear])
}

/// Converge's own fit, exactly as the allocator runs it: [`converge_sched::fit::fit_loss_curve`] with
/// [`FitConfig::default`].
pub fn converge(history: &[LossPoint]) -> Option<Curve> {
    fit::fit_loss_curve(history, &FitConfig::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn points(f: impl Fn(f64) -> f64, ks: impl IntoIterator<Item = f64>) -> Vec<LossPoint> {
        ks.into_iter()
            .map(|k| LossPoint {
                samples: k,
                loss: f(k),
            })
            .collect()
    }

    fn relative_error(got: f64, want: f64) -> f64 {
        (got - want).abs() / want.abs()
    }

    /// Largest relative error of `forecast` against `truth` from `from` to `to`.
    fn worst(forecast: &Forecast, truth: impl Fn(f64) -> f64, from: f64, to: f64) -> f64 {
        (0..=40)
            .map(|i| from + (to - from) * f64::from(i) / 40.0)
            .map(|k| relative_error(forecast.predict(k), truth(k)))
            .fold(0.0, f64::max)
    }

    #[test]
    fn strawman_is_exact_on_a_line_and_clamped_at_zero() {
        let line = |k: f64| 2.0 - 0.001 * k;
        let history = points(line, (1..=10).map(|i| f64::from(i) * 100.0));
        let forecast = Predictor::Strawman.forecast(&history).unwrap();
        for k in [1000.0, 1100.0, 1500.0, 1999.0] {
            assert!((forecast.predict(k) - line(k)).abs() < 1e-12, "{k}");
        }
        // The line crosses 0 at k = 2000; the prediction stops there.
        assert_eq!(forecast.predict(2500.0), 0.0);
        assert_eq!(forecast.predict(f64::INFINITY), 0.0);
        assert_eq!(forecast.predict(f64::NAN), line(1000.0));
    }

    #[test]
    fn strawman_uses_only_the_last_step() {
        // Whatever came before, only the last Δloss per Δprogress counts; repeated progress
        // and invalid points are skipped.
        let history = [
            LossPoint {
                samples: 0.0,
                loss: 100.0,
            },
            LossPoint {
                samples: 10.0,
                loss: 5.0,
            },
            LossPoint {
                samples: 20.0,
                loss: 4.0,
            },
            LossPoint {
                samples: 20.0,
                loss: 3.0,
            },
            LossPoint {
                samples: 25.0,
                loss: f64::NAN,
            },
        ];
        let Some(Forecast::Linear {
            progress,
            loss,
            slope,
        }) = strawman(&history)
        else {
            panic!("no line");
        };
        assert_eq!((progress, loss), (20.0, 3.0));
        assert!((slope - (3.0 - 5.0) / 10.0).abs() < 1e-15);
        assert!(strawman(&history[..1]).is_none());
        assert!(strawman(&[]).is_none());
        // Flat and rising histories extrapolate flat and rising.
        let rising = points(|k| k, [1.0, 2.0]);
        assert_eq!(strawman(&rising).unwrap().predict(4.0), 4.0);
    }

    #[test]
    fn slaq_recovers_an_inverse_quadratic_curve() {
        // 1/(a·k² + b·k + c) + d over 60 epochs, predicted 50 % beyond the history.
        let truth = |k: f64| 1.0 / ((0.002 * k + 0.05) * k + 1.2) + 0.08;
        let history = points(truth, (1..=60).map(f64::from));
        let forecast = Predictor::Slaq.forecast(&history).unwrap();
        let Forecast::Curve(curve) = &forecast else {
            panic!("not a curve")
        };
        assert_eq!(curve.family, CurveFamily::InvQuadratic);
        assert!(worst(&forecast, truth, 1.0, 90.0) < 1e-3, "{curve:?}");
    }

    #[test]
    fn optimus_recovers_an_inverse_linear_curve() {
        let truth = |k: f64| 1.0 / (0.0005 * k + 2.0) + 0.3;
        let history = points(truth, (1..=80).map(|i| f64::from(i) * 256.0));
        let forecast = Predictor::Optimus.forecast(&history).unwrap();
        let Forecast::Curve(curve) = &forecast else {
            panic!("not a curve")
        };
        assert_eq!(curve.family, CurveFamily::InvLinear);
        assert!(worst(&forecast, truth, 256.0, 30_000.0) < 1e-3, "{curve:?}");
        // Optimus's family cannot bend like an exponential: its parameters stay in the family.
        assert_eq!(curve.params.len(), 3);
    }

    #[test]
    fn converge_recovers_each_family_including_the_exponential() {
        let exp = |k: f64| 2.0 * (-k / 5000.0).exp() + 0.05;
        let inv_linear = |k: f64| 1.0 / (0.0005 * k + 2.0) + 0.3;
        let inv_quadratic = |k: f64| 1.0 / ((0.002 * k + 0.05) * k + 1.2) + 0.08;
        let cases: [(&dyn Fn(f64) -> f64, f64); 3] =
            [(&exp, 250.0), (&inv_linear, 256.0), (&inv_quadratic, 1.0)];
        for (truth, step) in cases {
            let history = points(truth, (1..=80).map(|i| f64::from(i) * step));
            let forecast = Predictor::Converge.forecast(&history).unwrap();
            let last = 80.0 * step;
            assert!(
                worst(&forecast, truth, step, 1.25 * last) < 2e-3,
                "{forecast:?}"
            );
        }
        // SLAQ's single family misses the exponential's tail that ours recovers.
        let history = points(exp, (1..=80).map(|i| f64::from(i) * 250.0));
        let slaq = Predictor::Slaq.forecast(&history).unwrap();
        let ours = Predictor::Converge.forecast(&history).unwrap();
        assert!(worst(&ours, exp, 250.0, 40_000.0) < worst(&slaq, exp, 250.0, 40_000.0));
    }

    #[test]
    fn fits_need_five_points() {
        let history = points(|k| 1.0 / k, [1.0, 2.0, 3.0, 4.0]);
        assert!(Predictor::Strawman.forecast(&history).is_some());
        for p in [Predictor::Slaq, Predictor::Optimus, Predictor::Converge] {
            assert!(p.forecast(&history).is_none(), "{}", p.name());
        }
    }

    fn arbitrary_history() -> impl Strategy<Value = Vec<LossPoint>> {
        (-3i32..10, -4i32..5).prop_flat_map(|(sample_exponent, loss_exponent)| {
            let sample_scale = 10f64.powi(sample_exponent);
            let loss_scale = 10f64.powi(loss_exponent);
            prop::collection::vec((0.0..1.0f64, 0.0..1.0f64), 5..150).prop_map(move |raw| {
                let mut points: Vec<LossPoint> = raw
                    .into_iter()
                    .map(|(s, l)| LossPoint {
                        samples: s * sample_scale,
                        loss: l * loss_scale,
                    })
                    .collect();
                points.sort_by(|a, b| a.samples.total_cmp(&b.samples));
                points
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn predictions_are_never_nan_or_negative(history in arbitrary_history()) {
            let last = history.last().map_or(0.0, |p| p.samples);
            for predictor in Predictor::ALL {
                let Some(forecast) = predictor.forecast(&history) else {
                    continue;
                };
                for k in [0.0, last, 1.1 * last, 2.0 * last, 1e3 * last + 1.0, f64::MAX,
                          f64::INFINITY, f64::NAN, -1.0] {
                    let loss = forecast.predict(k);
                    prop_assert!(
                        loss.is_finite() && loss >= 0.0,
                        "{}: predict({}) = {}", predictor.name(), k, loss
                    );
                }
            }
        }
    }
}
