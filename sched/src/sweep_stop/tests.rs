use super::*;
use crate::fit::{FitConfig, fit_loss_curve};
use converge_common::{HostId, ProgressReport};

/// Samples in one epoch of the synthetic trials.
const EPOCH: f64 = 1000.0;

/// A trial whose loss falls as `scale / (1 + s / 500) + floor`, reported every 100 samples
/// up to `epochs` epochs, one report per second from `start`; held-out loss 10 % above the
/// training loss when `eval`.
fn history(floor: f64, epochs: f64, start: f64, eval: bool) -> JobHistory {
    let mut h = JobHistory::default();
    let job = JobId::new("t").unwrap();
    let host = HostId::new("h").unwrap();
    let n = (epochs * EPOCH / 100.0).round() as u64;
    for i in 1..=n {
        let s = i * 100;
        let loss = 1.0 / (1.0 + s as f64 / 500.0) + floor;
        let mut r = ProgressReport::new(
            job.clone(),
            1,
            0,
            host.clone(),
            i,
            s,
            loss,
            start + i as f64,
        );
        r.line.epoch = Some(s as f64 / EPOCH);
        r.line.eval_loss = eval.then_some(loss * 1.1);
        h.add(&r);
    }
    h
}

fn curve(h: &JobHistory) -> Curve {
    fit_loss_curve(&h.loss_points(), &FitConfig::default()).expect("a curve fits")
}

fn ids(n: usize) -> Vec<JobId> {
    (1..=n)
        .map(|i| JobId::new(format!("s-{i}")).unwrap())
        .collect()
}

fn trials<'a>(
    ids: &'a [JobId],
    hs: &'a [JobHistory],
    cs: &'a [Option<Curve>],
    states: &[TrialState],
) -> Vec<SweepTrial<'a>> {
    (0..ids.len())
        .map(|i| SweepTrial {
            id: &ids[i],
            state: states[i],
            history: Some(&hs[i]),
            curve: cs[i].as_ref(),
            eval_curve: None,
            work_samples: None,
            plateau: None,
            stoppable: true,
        })
        .collect()
}

fn spec(rule: EarlyStopRule, keep: u32) -> EarlyStopSpec {
    EarlyStopSpec {
        rule,
        keep,
        ..EarlyStopSpec::default()
    }
}

const ACTIVE: TrialState = TrialState::Active;

#[test]
fn predicted_stops_a_trial_that_cannot_reach_the_keep_best_and_only_then() {
    let ids = ids(3);
    let hs = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.12, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, false),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t);
    assert_eq!(stops.len(), 1, "{stops:?}");
    assert_eq!(stops[0].job, ids[2]);
    assert_eq!(stops[0].reason, EndReason::EarlyStopped);
    assert!(
        stops[0].message.contains("training loss"),
        "{}",
        stops[0].message
    );
    // Keeping all three stops none; a band wider than the gap stops none either.
    assert!(sweep_stops(&spec(EarlyStopRule::Predicted, 3), &t).is_empty());
    let wide = EarlyStopSpec {
        band: 0.24,
        ..spec(EarlyStopRule::Predicted, 2)
    };
    assert!(sweep_stops(&wide, &t).is_empty());
    // Trials as good as each other are never stopped.
    let close = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.10, 2.0, 0.0, false),
        history(0.11, 2.0, 0.0, false),
    ];
    let cc: Vec<Option<Curve>> = close.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &close, &cc, &[ACTIVE; 3]);
    assert!(sweep_stops(&spec(EarlyStopRule::Predicted, 1), &t).is_empty());
}

#[test]
fn no_rule_stops_a_trial_before_min_epochs_or_without_a_curve() {
    let ids = ids(3);
    let hs = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.12, 2.0, 0.0, false),
        history(0.60, 0.8, 0.0, false),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    for rule in [EarlyStopRule::Predicted, EarlyStopRule::Asha] {
        let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
        let stops = sweep_stops(&spec(rule, 1), &t);
        assert!(stops.iter().all(|s| s.job != ids[2]), "{rule:?}: {stops:?}");
    }
    let hs = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.12, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, false),
    ];
    let mut cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    cs[2] = None;
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
    assert!(sweep_stops(&spec(EarlyStopRule::Predicted, 1), &t).is_empty());
    assert!(sweep_stops(&spec(EarlyStopRule::None, 1), &t).is_empty());
}

#[test]
fn held_out_loss_ranks_when_every_trial_reports_it() {
    let ids = ids(3);
    let hs = vec![
        history(0.10, 2.0, 0.0, true),
        history(0.12, 2.0, 0.0, true),
        history(0.60, 2.0, 0.0, true),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
    assert_eq!(metric(&t, 1.0), Metric::HeldOut);
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t);
    assert_eq!(stops.len(), 1);
    assert!(
        stops[0].message.contains("held-out loss"),
        "{}",
        stops[0].message
    );
    assert!(!stops[0].message.contains("ranked by training loss"));
    // The held-out value is the mean of the last points' eval_loss.
    let last = value_now(&hs[0], Metric::HeldOut).unwrap();
    let train = value_now(&hs[0], Metric::Training).unwrap();
    assert!((last / train - 1.1).abs() < 1e-3, "{last} {train}");
    // One trial without held-out loss: all are ranked by training loss, and it says so.
    let mixed = vec![
        history(0.10, 2.0, 0.0, true),
        history(0.12, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, true),
    ];
    let cm: Vec<Option<Curve>> = mixed.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &mixed, &cm, &[ACTIVE; 3]);
    assert_eq!(metric(&t, 1.0), Metric::Training);
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t);
    assert!(
        stops[0].message.contains("ranked by training loss"),
        "{}",
        stops[0].message
    );
}

#[test]
fn the_plateau_rule_bounds_the_prediction_without_declared_work_and_ended_trials_count_at_their_value()
 {
    let h = history(0.10, 2.0, 0.0, false);
    let c = curve(&h);
    let samples = h.latest().unwrap().samples as f64;
    let plateau = PlateauSpec {
        min_improvement: 0.05,
        window_epochs: 1.0,
    };
    let end = end_samples(&c, samples, h.epoch_samples(), Some(plateau));
    assert!(end.is_finite() && end >= samples, "{end}");
    assert_eq!(end_samples(&c, samples, None, Some(plateau)), f64::INFINITY);
    let ids = ids(1);
    let bounded = SweepTrial {
        id: &ids[0],
        state: ACTIVE,
        history: Some(&h),
        curve: Some(&c),
        eval_curve: None,
        work_samples: None,
        plateau: Some(plateau),
        stoppable: true,
    };
    let unbounded = SweepTrial {
        plateau: None,
        ..bounded
    };
    let (pb, pu) = (
        predicted_final(&bounded, Metric::Training).unwrap().0,
        predicted_final(&unbounded, Metric::Training).unwrap().0,
    );
    assert!(pu <= pb, "the asymptote is the lowest: {pu} {pb}");
    // Declared work is where a trial is predicted, whatever its plateau rule forecasts.
    let declared = SweepTrial {
        work_samples: Some(3.0 * end),
        ..bounded
    };
    assert_eq!(
        predicted_final(&declared, Metric::Training).unwrap().1,
        3.0 * end
    );
    let ended = SweepTrial {
        state: TrialState::Ended {
            early_stopped: false,
        },
        ..bounded
    };
    assert_eq!(
        predicted_final(&ended, Metric::Training).map(|p| p.0),
        value_now(&h, Metric::Training)
    );
}

#[test]
fn early_stopped_trials_do_not_count_toward_keep() {
    let ids = ids(3);
    let hs = vec![
        history(0.05, 3.0, 0.0, false),
        history(0.10, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, false),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let stopped = TrialState::Ended {
        early_stopped: true,
    };
    // Trial 1 was stopped before (it ended with its value); keep 2 leaves trials 2 and 3.
    let t = trials(&ids, &hs, &cs, &[stopped, ACTIVE, ACTIVE]);
    assert!(sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t).is_empty());
    let done = TrialState::Ended {
        early_stopped: false,
    };
    let t = trials(&ids, &hs, &cs, &[done, ACTIVE, ACTIVE]);
    assert_eq!(sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t).len(), 1);
}

#[test]
fn asha_keeps_the_best_third_at_each_rung_by_arrival() {
    // Four trials reach the first rung (1 epoch) one after another: 0.3, 0.1, 0.5, 0.2.
    let ids = ids(4);
    let floors = [0.3, 0.1, 0.5, 0.2];
    let hs: Vec<JobHistory> = floors
        .iter()
        .enumerate()
        .map(|(i, f)| history(*f, 1.5, i as f64 * 100.0, false))
        .collect();
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 4]);
    let stopped: Vec<&JobId> = sweep_stops(&spec(EarlyStopRule::Asha, 1), &t)
        .iter()
        .map(|s| &ids[ids.iter().position(|i| *i == s.job).unwrap()])
        .collect();
    // First at the rung goes on; the second is better than the first (goes on); the third
    // is not the best of 3 (stopped); the fourth is second of 4, not the best 1 (stopped).
    assert_eq!(stopped, vec![&ids[2], &ids[3]]);
    let s = sweep_stops(&spec(EarlyStopRule::Asha, 1), &t);
    assert!(
        s[0].message.contains("rung of 1 epochs"),
        "{}",
        s[0].message
    );
    // `keep` 3 of 4: only one may be stopped.
    assert_eq!(sweep_stops(&spec(EarlyStopRule::Asha, 3), &t).len(), 1);
}

#[test]
fn a_young_trial_without_held_out_loss_does_not_switch_the_sweep_to_training_loss() {
    let ids = ids(3);
    let hs = vec![
        history(0.10, 2.0, 0.0, true),
        history(0.60, 2.0, 0.0, true),
        // Started late: half an epoch, no evaluation yet.
        history(0.10, 0.5, 0.0, false),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
    assert_eq!(metric(&t, 1.0), Metric::HeldOut);
    // Past its first epoch without one, it does.
    assert_eq!(metric(&t, 0.4), Metric::Training);
}

#[test]
fn only_trials_that_carry_the_rule_are_stopped_and_the_worst_go_first() {
    let ids = ids(4);
    let hs = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.50, 2.0, 0.0, false),
        history(0.70, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, false),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let mut t = trials(&ids, &hs, &cs, &[ACTIVE; 4]);
    // Keep 1: the three weak trials are all stopped, the worst first.
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 1), &t);
    let order: Vec<&JobId> = stops.iter().map(|s| &s.job).collect();
    assert_eq!(order, vec![&ids[2], &ids[3], &ids[1]]);
    // ASHA, all four at the first rung together: it would stop three; keep 2 lets two go,
    // the worst two, whatever the id order.
    let stops = sweep_stops(&spec(EarlyStopRule::Asha, 2), &t);
    let order: Vec<&JobId> = stops.iter().map(|s| &s.job).collect();
    assert_eq!(order, vec![&ids[2], &ids[3]]);
    // A trial without the sweep's rule is compared but never stopped.
    t[2].stoppable = false;
    let stops = sweep_stops(&spec(EarlyStopRule::Asha, 2), &t);
    let order: Vec<&JobId> = stops.iter().map(|s| &s.job).collect();
    assert_eq!(order, vec![&ids[3], &ids[1]]);
}

#[test]
fn an_active_trial_without_a_curve_still_counts_by_what_it_has_attained() {
    let ids = ids(3);
    let hs = vec![
        history(0.10, 2.0, 0.0, false),
        history(0.12, 2.0, 0.0, false),
        history(0.60, 2.0, 0.0, false),
    ];
    let mut cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    cs[1] = None;
    let t = trials(&ids, &hs, &cs, &[ACTIVE; 3]);
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 2), &t);
    assert_eq!(stops.len(), 1, "trial 2's attained loss counts: {stops:?}");
    assert_eq!(stops[0].job, ids[2]);
}

/// A held-out curve that predicts `value` at every sample count.
fn flat(value: f64) -> Curve {
    Curve {
        family: crate::fit::CurveFamily::Exp,
        params: vec![0.0, value, 0.0],
        rmse: 0.0,
        points: 10,
    }
}

#[test]
fn the_band_widens_per_doubling_of_the_samples_ahead_between_one_and_four() {
    assert_eq!(band_at(0.02, 1000.0, 1500.0), 0.02, "under one doubling");
    assert!(
        (band_at(0.02, 1000.0, 8000.0) - 0.06).abs() < 1e-12,
        "three"
    );
    assert_eq!(band_at(0.02, 1000.0, 1e9), 0.08, "at most four");
    assert_eq!(band_at(0.02, 1000.0, f64::INFINITY), 0.08, "no known end");
    assert_eq!(band_at(0.02, 0.0, 10.0), 0.08, "nothing done yet");
}

#[test]
fn declared_work_ends_the_horizon_and_a_held_out_curve_predicts_the_held_out_loss() {
    let h = history(0.10, 2.0, 0.0, true);
    let c = curve(&h);
    let e = fit_loss_curve(&h.eval_points(), &FitConfig::default()).expect("a curve fits");
    let samples = h.latest().unwrap().samples as f64;
    let ids = ids(1);
    let t = SweepTrial {
        id: &ids[0],
        state: ACTIVE,
        history: Some(&h),
        curve: Some(&c),
        eval_curve: Some(&e),
        work_samples: Some(4.0 * EPOCH),
        plateau: None,
        stoppable: true,
    };
    assert_eq!(horizon(&t, &c, samples, h.epoch_samples()), 4.0 * EPOCH);
    let no_work = SweepTrial {
        work_samples: None,
        ..t
    };
    assert_eq!(
        horizon(&no_work, &c, samples, h.epoch_samples()),
        f64::INFINITY
    );
    let behind = SweepTrial {
        work_samples: Some(0.5 * EPOCH),
        ..t
    };
    assert_eq!(horizon(&behind, &c, samples, h.epoch_samples()), samples);
    // The held-out curve at the declared end: 1.1 × (1 / (1 + 4000 / 500) + 0.10).
    let (p, end) = predicted_final(&t, Metric::HeldOut).unwrap();
    let want = 1.1 * (1.0 / 9.0 + 0.10);
    assert_eq!(end, 4.0 * EPOCH);
    assert!((p - want).abs() / want < 0.02, "{p} against {want}");
    // Without one (or judged by training loss), the training curve's fall scales the value.
    let now = value_now(&h, Metric::HeldOut).unwrap();
    let fall = c.predict(4.0 * EPOCH) / c.predict(samples);
    let train_only = SweepTrial {
        eval_curve: None,
        ..t
    };
    let (q, _) = predicted_final(&train_only, Metric::HeldOut).unwrap();
    assert!((q - now * fall).abs() < 1e-12, "{q} {}", now * fall);
    // A held-out curve that predicts a rise is held at the value now.
    let rising = flat(2.0 * now);
    let held = SweepTrial {
        eval_curve: Some(&rising),
        ..t
    };
    assert_eq!(predicted_final(&held, Metric::HeldOut).unwrap().0, now);
}

/// Trial 1 ended at its held-out value `a` after 10 epochs; trial 2, 2 epochs in, has a
/// held-out curve that predicts `factor · a` and declares `work` samples. What
/// `predicted` (keep 1) stops.
fn judge_second_trial(factor: f64, work: Option<f64>) -> (Vec<JobId>, Vec<EarlyStop>) {
    let ids = ids(2);
    let hs = vec![
        history(0.10, 10.0, 0.0, true),
        history(0.10, 2.0, 0.0, true),
    ];
    let cs: Vec<Option<Curve>> = hs.iter().map(|h| Some(curve(h))).collect();
    let e = flat(factor * value_now(&hs[0], Metric::HeldOut).unwrap());
    let done = TrialState::Ended {
        early_stopped: false,
    };
    let mut t = trials(&ids, &hs, &cs, &[done, ACTIVE]);
    t[1].eval_curve = Some(&e);
    t[1].work_samples = work;
    let stops = sweep_stops(&spec(EarlyStopRule::Predicted, 1), &t);
    (ids, stops)
}

#[test]
fn a_trial_far_from_its_end_gets_the_wider_band() {
    // Trial 2's held-out curve predicts 3 % above trial 1's value. One doubling or less
    // ahead (band 2 %) it cannot get below it: stopped. Ten times its samples ahead (band
    // 2 % × log2(10) = 6.6 %) it might: it goes on.
    let (ids, near) = judge_second_trial(1.03, Some(2.5 * EPOCH));
    assert_eq!(near.len(), 1, "{near:?}");
    assert_eq!(near[0].job, ids[1]);
    assert!(
        near[0].message.contains("held-out loss"),
        "{}",
        near[0].message
    );
    assert!(
        near[0].message.contains("2.0 % band"),
        "{}",
        near[0].message
    );
    assert!(judge_second_trial(1.03, Some(20.0 * EPOCH)).1.is_empty());
}

#[test]
fn a_forecast_beyond_sixteen_times_the_samples_done_is_not_judged() {
    // Trial 2 is predicted to end 50 % above what trial 1 attained: clearly worse,
    // wherever its run ends, as long as the forecast is trusted.
    let stopped = |w: Option<f64>| {
        let (ids, stops) = judge_second_trial(1.5, w);
        (
            ids[1].clone(),
            stops.into_iter().map(|s| s.job).collect::<Vec<_>>(),
        )
    };
    let (second, judged) = stopped(Some(32.0 * EPOCH));
    assert_eq!(judged, vec![second.clone()], "16x ahead: judged");
    assert!(
        stopped(Some(40.0 * EPOCH)).1.is_empty(),
        "20x ahead: not yet"
    );
    assert_eq!(stopped(None).1, vec![second], "no known end: the asymptote");
    assert!(within_reach(1.0, 16.0) && !within_reach(1.0, 16.5));
    assert!(within_reach(1.0, f64::INFINITY) && !within_reach(0.0, 1.0));
}
