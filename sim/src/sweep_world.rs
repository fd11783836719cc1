//! The sweep world: an exploratory workload's trials ([`crate::explore`]) under the
//! service's own scheduling step ([`crate::world::run`]), `converge-sim explore --loop
//! service`.
//!
//! Each trial is submitted as the job spec a sweep's trial gets (`converge submit
//! sweep.toml`: its worker bounds, the sweep it belongs to, the run's stop criteria) and
//! runs on the same physics as [`crate::explore::simulate`] (its recorded curve, its
//! application's step times, a restart delay per allocation change, a progress report every
//! few seconds of work). What the decision loop does itself, the service does here: fits
//! the curves and step times from the reports, measures the restart cost, applies the stop
//! criteria ([`converge_sched::stop`]) and ends the trials, fences generations, and marks a
//! trial completed once its workers exit at the end of its curve.

use crate::apps::Application;
use crate::explore::{
    ExploreConfig, ExploreResult, ExploreTrial, RecordedCurve, Trial, host_id, normalized_losses,
    trials_of,
};
use crate::world::{Observed, World, heartbeat, planned_workers, run_under, worker_states};
use converge_common::{HostId, JobId, JobSpec, ProgressReport, WorkerState};
use converge_sched::policies::Policy;
use converge_sched::schedule::Outcome;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// An exploratory workload on [`ExploreConfig`]'s cluster, run by its agents.
pub struct SweepWorld<'a> {
    cfg: &'a ExploreConfig,
    trials: Vec<Trial<'a>>,
    /// Each trial's spec, submitted once its time has come.
    specs: Vec<JobSpec>,
    submitted: Vec<bool>,
    /// Whether the service has ended the trial (its workers are gone).
    closed: Vec<bool>,
    /// When the trial's workers were last stopped for a new allocation: started again at
    /// the same time, that is a restart (the service stops a generation, then starts the
    /// next once it has exited).
    stopped_at: Vec<Option<f64>>,
    /// Progress reports since the latest observation.
    reports: Vec<ProgressReport>,
    /// `(time, average normalized loss, trials counted, GPUs held)` per interval with at
    /// least one trial counted ([`ExploreResult::intervals`]).
    intervals: Vec<(f64, f64, usize, u32)>,
}

/// The spec of trial `t`: one GPU per worker, `workers` of at most `max_workers`, its sweep,
/// the run's stop criteria and its sweep's early stopping, and the work it declares: the
/// samples of its recorded run (`curve`), as a trainer's `--epochs` tells them (a trial
/// of a sweep stays exploratory: `JobSpec::is_exploratory`).
///
/// # Errors
/// The sweep's name is not a valid id.
fn trial_spec(
    t: &ExploreTrial,
    curve: &RecordedCurve,
    cfg: &ExploreConfig,
) -> anyhow::Result<JobSpec> {
    let mut spec = JobSpec::from_toml(&format!("id = \"{}\"\ncommand = [\"simulated\"]\n", t.name))
        .map_err(|e| anyhow::anyhow!("trial {:?}: {e}", t.name))?;
    spec.max_workers = Some(t.max_workers);
    spec.workers = Some(t.workers.clamp(1, t.max_workers));
    spec.stop = cfg.stop;
    spec.sweep =
        Some(JobId::new(t.sweep.clone()).map_err(|e| anyhow::anyhow!("sweep {:?}: {e}", t.sweep))?);
    spec.early_stop = cfg.early_stop;
    spec.priority = cfg.priority;
    spec.submitted_at = t.time;
    spec.work_samples = Some(curve.total().round().max(1.0) as u64);
    Ok(spec)
}

impl<'a> SweepWorld<'a> {
    /// The world of `trials` on `cfg`'s cluster.
    ///
    /// # Errors
    /// As [`crate::explore::simulate`]: an unknown curve or application, an invalid name.
    pub fn new(
        curves: &'a BTreeMap<String, RecordedCurve>,
        apps: &'a BTreeMap<String, Application>,
        trials: &'a [ExploreTrial],
        cfg: &'a ExploreConfig,
    ) -> anyhow::Result<Self> {
        // Unknown curves and applications are refused here, with a hint.
        let states = trials_of(curves, apps, trials)?;
        let specs = trials
            .iter()
            .zip(&states)
            .map(|(t, state)| trial_spec(t, state.curve, cfg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let n = trials.len();
        Ok(Self {
            cfg,
            trials: states,
            specs,
            submitted: vec![false; n],
            closed: vec![false; n],
            stopped_at: vec![None; n],
            reports: Vec::new(),
            intervals: Vec::new(),
        })
    }
}

impl SweepWorld<'_> {
    /// The run's result.
    pub(crate) fn result(self, policy: String, wall_s: f64, max_decision_s: f64) -> ExploreResult {
        ExploreResult {
            policy,
            finished: self.finished(),
            trials: self.trials.iter().map(Trial::outcome).collect(),
            intervals: self.intervals,
            wall_s,
            max_decision_s,
        }
    }
}

impl World for SweepWorld<'_> {
    fn advance(&mut self, now: f64, seconds: f64) {
        let reports = &mut self.reports;
        for t in &mut self.trials {
            t.advance(now, seconds, self.cfg.report_every_s, |r| reports.push(r));
        }
        let end = now + seconds;
        let norm = normalized_losses(&mut self.trials, end, seconds);
        if !norm.is_empty() {
            let held: u32 = self
                .trials
                .iter()
                .filter(|t| t.active(end))
                .map(|t| t.placement.len() as u32)
                .sum();
            self.intervals.push((
                end,
                norm.iter().sum::<f64>() / norm.len() as f64,
                norm.len(),
                held,
            ));
        }
    }

    fn observe(&mut self, now: f64, into: &mut Observed) {
        for (i, spec) in self.specs.iter().enumerate() {
            if !self.submitted[i] && spec.submitted_at <= now {
                self.submitted[i] = true;
                into.specs.push(spec.clone());
            }
        }
        into.reports.append(&mut self.reports);
        let mut workers: BTreeMap<&HostId, Vec<WorkerState>> = BTreeMap::new();
        for (i, t) in self.trials.iter().enumerate() {
            if self.closed[i] {
                continue;
            }
            // At the end of its curve its program has exited with code 0.
            let done = t.ended.is_some();
            for (host, w) in worker_states(&t.id, t.generation, &t.placement, done) {
                workers.entry(host).or_default().push(w);
            }
        }
        for n in 0..self.cfg.nodes {
            let host = host_id(n);
            let running = workers.remove(&host).unwrap_or_default();
            into.hosts.push(heartbeat(
                n as usize,
                host,
                None,
                self.cfg.gpus_per_node,
                running,
                now,
            ));
        }
    }

    fn apply(&mut self, now: f64, outcome: &Outcome) {
        let mut planned = BTreeMap::new();
        for plan in outcome.plans.values() {
            planned_workers(plan, &mut planned);
        }
        for (i, t) in self.trials.iter_mut().enumerate() {
            if !self.submitted[i] || self.closed[i] {
                continue;
            }
            if let Some(status) = outcome
                .statuses
                .get(&t.id)
                .filter(|s| s.phase.is_terminal())
            {
                // Ended by the service: by its stop criteria now, or completed after its
                // program's exit (which the trial already knows the time of).
                let reason = status.end.as_ref().map(|e| e.reason);
                match &mut t.ended {
                    Some((_, known)) => *known = known.or(reason),
                    None => t.ended = Some((now, reason)),
                }
                t.placement.clear();
                self.closed[i] = true;
                continue;
            }
            if t.ended.is_some() {
                continue; // exited; the service has not taken the exit in yet
            }
            let (generation, mut ranks, _) =
                planned
                    .remove(&t.id)
                    .unwrap_or((t.generation, Vec::new(), None));
            ranks.sort_by_key(|r| r.rank);
            if generation != t.generation || ranks != t.placement {
                let was_running = !t.placement.is_empty() || self.stopped_at[i] == Some(now);
                if ranks.is_empty() {
                    self.stopped_at[i] = Some(now);
                } else if was_running {
                    t.restarts += 1;
                }
                t.stall_s = if ranks.is_empty() {
                    0.0
                } else {
                    self.cfg.restart_delay_s
                };
                t.placement = ranks;
                t.generation = generation;
            }
        }
    }

    fn finished(&self) -> bool {
        self.trials.iter().all(|t| t.ended.is_some())
    }
}

/// Runs `trials` under `policy` through the service's scheduling step ([`crate::world::run`] over a
/// [`SweepWorld`]). Deterministic (decision times aside).
///
/// # Errors
/// As [`SweepWorld::new`].
pub fn simulate_service(
    curves: &BTreeMap<String, RecordedCurve>,
    apps: &BTreeMap<String, Application>,
    trials: &[ExploreTrial],
    policy: Arc<dyn Policy>,
    cfg: &ExploreConfig,
) -> anyhow::Result<ExploreResult> {
    let started = Instant::now();
    let mut world = SweepWorld::new(curves, apps, trials, cfg)?;
    let name = policy.name().to_string();
    let max_decision_s = run_under(
        &mut world,
        policy,
        cfg.placement,
        cfg.scheduling_interval_s,
        cfg.max_time_s,
    );
    Ok(world.result(name, started.elapsed().as_secs_f64(), max_decision_s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apps::load_all;
    use crate::explore::{generate, load_curves, simulate, summarize};
    use converge_common::EndReason;
    use converge_sched::policies::{Fair, Objective, PolicyParams, Quality};
    use std::path::Path;

    type Curves = BTreeMap<String, RecordedCurve>;

    /// The recorded sweep curves, the applications, and a generated workload of `sweeps`
    /// sweeps over `hours` (seed `seed`; none for 0 sweeps).
    fn fixture(
        sweeps: usize,
        hours: f64,
        seed: u64,
    ) -> (Curves, BTreeMap<String, Application>, Vec<ExploreTrial>) {
        let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
        let curves = load_curves(&data.join("curves/sweep")).unwrap();
        let apps = load_all(&crate::apps::test_trace_dirs()).unwrap();
        let trials = if sweeps == 0 {
            Vec::new()
        } else {
            let philly =
                crate::workload::read_philly(&data.join("pollux/traces/philly.csv")).unwrap();
            generate(&philly, &curves, sweeps, hours, seed).unwrap()
        };
        (curves, apps, trials)
    }

    #[test]
    fn trials_go_through_the_service_and_end_by_its_stop_rule_or_their_curve() {
        let (curves, apps, trials) = fixture(6, 0.5, 7);
        let cfg = ExploreConfig::default();
        let quality: Arc<dyn Policy> = Arc::new(Quality {
            params: PolicyParams {
                objective: Objective::Loss,
                ..PolicyParams::default()
            },
        });
        for policy in [quality, Arc::new(Fair) as Arc<dyn Policy>] {
            let r = simulate_service(&curves, &apps, &trials, policy.clone(), &cfg).unwrap();
            assert!(r.finished, "{}: every trial ends", r.policy);
            assert_eq!(r.trials.len(), trials.len());
            // Every trial's end has the service's reason: its stop rule (converged) or the
            // end of its curve (finished).
            for t in &r.trials {
                assert!(
                    matches!(t.reason, Some(EndReason::Converged | EndReason::Finished)),
                    "{}: {:?}",
                    t.name,
                    t.reason
                );
                assert!(t.ended_at.unwrap() >= t.submitted_at && t.gpu_hours > 0.0);
            }
            assert!(
                r.trials
                    .iter()
                    .any(|t| t.reason == Some(EndReason::Converged)),
                "{}: the plateau rule ends some trials",
                r.policy
            );
            let s = summarize(&r);
            assert!(s.avg_normalized_loss > 0.0 && s.avg_normalized_loss < 1.0);
            let again = simulate_service(&curves, &apps, &trials, policy.clone(), &cfg).unwrap();
            assert_eq!(r.trials, again.trials, "deterministic");
            // The decision loop on the same trials ends them at about the same loss.
            let d = summarize(&simulate(&curves, &apps, &trials, policy.as_ref(), &cfg).unwrap());
            assert!(
                (s.mean_final_normalized - d.mean_final_normalized).abs() < 0.1,
                "{}: service {} vs decision {}",
                r.policy,
                s.mean_final_normalized,
                d.mean_final_normalized
            );
        }
    }

    #[test]
    fn without_stop_criteria_every_trial_runs_its_whole_curve() {
        let (curves, apps, trials) = fixture(3, 0.2, 3);
        let cfg = ExploreConfig {
            stop: None,
            ..ExploreConfig::default()
        };
        let r = simulate_service(&curves, &apps, &trials, Arc::new(Fair), &cfg).unwrap();
        assert!(r.finished);
        for t in &r.trials {
            assert_eq!(t.reason, Some(EndReason::Finished), "{}", t.name);
            let curve = &curves[&t.curve];
            assert_eq!(t.final_loss, curve.true_loss(curve.total()), "{}", t.name);
        }
    }

    #[test]
    fn each_trial_declares_its_recorded_runs_samples_and_stays_exploratory() {
        let (curves, apps, trials) = fixture(2, 0.2, 3);
        assert!(!trials.is_empty());
        let cfg = ExploreConfig::default();
        let world = SweepWorld::new(&curves, &apps, &trials, &cfg).unwrap();
        for (t, spec) in trials.iter().zip(&world.specs) {
            let total = curves[&t.curve].total().round() as u64;
            assert_eq!(spec.work_samples, Some(total), "{}", t.name);
            assert!(spec.is_exploratory(), "{}", t.name);
        }
    }

    #[test]
    fn the_sweeps_early_stopping_ends_weak_trials_and_saves_gpu_hours() {
        let (curves, apps, trials) = fixture(4, 0.2, 5);
        let none = ExploreConfig {
            stop: None,
            ..ExploreConfig::default()
        };
        let early = |rule| ExploreConfig {
            early_stop: Some(converge_common::EarlyStopSpec {
                rule,
                ..Default::default()
            }),
            ..none.clone()
        };
        let hours = |r: &ExploreResult| r.trials.iter().map(|t| t.gpu_hours).sum::<f64>();
        let base = simulate_service(&curves, &apps, &trials, Arc::new(Fair), &none).unwrap();
        for rule in [
            converge_common::EarlyStopRule::Predicted,
            converge_common::EarlyStopRule::Asha,
        ] {
            let cfg = early(rule);
            let r = simulate_service(&curves, &apps, &trials, Arc::new(Fair), &cfg).unwrap();
            assert!(r.finished);
            let stopped = r
                .trials
                .iter()
                .filter(|t| t.reason == Some(EndReason::EarlyStopped))
                .count();
            assert!(stopped > 0, "{rule:?} stops some trial");
            // keep 1 (the default): at least one trial of each sweep is never stopped.
            let mut kept: BTreeMap<&str, usize> = BTreeMap::new();
            for t in &r.trials {
                *kept.entry(&t.sweep).or_default() +=
                    usize::from(t.reason != Some(EndReason::EarlyStopped));
            }
            assert!(kept.values().all(|&k| k >= 1), "{rule:?}: {kept:?}");
            assert!(hours(&r) < hours(&base), "{rule:?} saves GPU-hours");
            // Held-out losses come from the recorded runs.
            assert!(r.trials.iter().all(|t| t.final_eval.is_some()));
            // The decision loop has no early stopping of its own.
            let e = simulate(&curves, &apps, &trials, &Fair, &cfg).expect_err("refused");
            assert!(e.to_string().contains("service loop"), "{e}");
        }
    }

    #[test]
    fn a_trial_with_an_invalid_sweep_name_is_an_error() {
        let (curves, apps, _) = fixture(0, 0.0, 0);
        let curve = curves.keys().next().unwrap().clone();
        let trials = vec![ExploreTrial {
            name: "t-1".into(),
            time: 0.0,
            sweep: "not a valid id".into(),
            curve,
            application: "cifar10".into(),
            workers: 1,
            max_workers: 4,
            work_s: 600.0,
        }];
        let cfg = ExploreConfig::default();
        let e = simulate_service(&curves, &apps, &trials, Arc::new(Fair), &cfg)
            .map(|_| ())
            .expect_err("refused");
        assert!(e.to_string().contains("sweep"), "{e}");
    }
}
