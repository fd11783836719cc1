//! Exploratory jobs (SLAQ's setting): many short trials of hyperparameter sweeps that end by
//! their stop criteria, on a simulated cluster, decided by the service's own
//! [`converge_sched::decide::decide`] and ended by its own [`converge_sched::stop`].
//!
//! # Where the numbers come from
//!
//! - **Loss curves**: real `converge-trainer` runs of a sweep (`data/curves/sweep/`: five
//!   model × dataset pairs × three learning rates × two batch sizes), one CSV per run
//!   (`step,samples,loss,eval_loss,epoch`). A trial's position on its curve is in the
//!   run's own samples; the loss its workers "report" is the recorded minibatch loss at
//!   that position (real noise, linearly interpolated between rows), and its true loss,
//!   used only by the metrics, is the recorded loss smoothed by a centred moving average.
//!   With `--pollux-curves` ([`pollux_curves`]), also the measured validation runs of five
//!   Pollux applications (cifar10, deepspeech2, imagenet, ncf, yolov3; one run per total
//!   batch size, from `--traces`, which this repository does not copy): a sweep over batch
//!   sizes, each run's held-out metric as a loss (`1 − accuracy`, `1 − hit rate`, word error
//!   rate, YOLOv3's validation score, which falls) against the samples it trained on, a
//!   trial starting at the run's first row with that row's samples done (the scheduler's
//!   epoch guards count from 0, so a large batch's trial, whose first row comes several
//!   epochs in, can be judged from its first reports, and ASHA values it at its early
//!   rungs by that first row). These values carry no minibatch noise: reported, true and
//!   held-out loss are the measured value.
//! - **Sizes and durations**: a Philly trace job (`data/pollux/traces/philly.csv`) per sweep:
//!   its GPUs are the trials' requested workers (elastic from 1 to [`ELASTIC_FACTOR`] times
//!   that, at most 16), its GPU time scaled from hours to minutes ([`TIME_SCALE`]) is the
//!   single-GPU time of running one trial's whole curve (from its first row). Sweeps
//!   arrive as a Poisson process.
//! - **Throughput**: measured step times of a Pollux application (`placements.csv`,
//!   `scalability.csv`) chosen by the trace job's GPU time as the Pollux workloads chose
//!   them, at the application's smallest measured per-GPU batch: the speedup of a
//!   placement is the application's, scaled so that one GPU runs the curve in its
//!   single-GPU time.
//!
//! # Metrics (SLAQ, Zhang et al. SoCC'17, §6)
//!
//! A trial's normalized loss is `(L(x) − L_min) / (L(s) − L_min)` clamped to `[0, 1]`, `s`
//! where the trial started (0, or a validation run's first row), `L`
//! its true loss at curve position `x`, `L_min` the lowest true loss of the whole recorded
//! run (what running it to its end would reach at best). The cluster-wide average
//! normalized loss is the mean over submitted trials that have not ended, per scheduling
//! interval; time to 80/90/95 % of the loss reduction is the age at which the normalized
//! loss first fell to 0.2/0.1/0.05. Per sweep: the GPU-hours all its trials held, and the
//! true loss its best trial ended at.

use crate::apps::{Application, ValidationRun};
use anyhow::Context as _;
use converge_common::{
    EarlyStopRule, EarlyStopSpec, EndReason, HostId, JobId, ProgressReport, RankPlacement, StopSpec,
};
use converge_sched::decide::{BatchSize, ClusterState, JobView, decide};
use converge_sched::fit::FitConfig;
use converge_sched::fit_cache::{FitCache, ModelScope};
use converge_sched::history::JobHistory;
use converge_sched::placement::{HostFree, PlacementKind};
use converge_sched::policies::Policy;
use converge_sched::stop::{StopInputs, stop_verdict};
use converge_sched::throughput::{StepObservation, ThroughputPrior};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Trace GPU-hours become single-GPU minutes of a trial: seconds of trace GPU time per
/// second of a trial's work.
pub const TIME_SCALE: f64 = 60.0;
/// A trial may grow to this many times the GPUs its trace job asked for (at most
/// [`MAX_TRIAL_WORKERS`], at least 4): exploratory trainers are elastic data-parallel jobs.
pub const ELASTIC_FACTOR: u32 = 4;
/// Most workers of one trial.
pub const MAX_TRIAL_WORKERS: u32 = 16;
/// Shortest and longest single-GPU time of a trial's whole curve, seconds.
pub const WORK_RANGE_S: (f64, f64) = (120.0, 3600.0);
/// Rows on each side of the centred moving average behind a curve's true loss.
pub const SMOOTHING_ROWS: usize = 5;

/// One recorded loss curve (a `converge-trainer` run).
#[derive(Debug, Clone)]
pub struct RecordedCurve {
    /// File stem, e.g. `optdigits-mlp-lrx4-b64`.
    pub name: String,
    /// Model × dataset pair: the stem before `-lr` (the sweep a trial belongs to).
    pub pair: String,
    samples: Vec<f64>,
    loss: Vec<f64>,
    truth: Vec<f64>,
    /// Held-out loss at each row, where the run has an `eval_loss` column with a value in
    /// every row (else `None`).
    eval: Option<Vec<f64>>,
    /// Samples per epoch of the run's training set.
    pub epoch_samples: f64,
    /// Where a trial starts on the curve, samples: 0 for a recorded trainer run, the first
    /// row for a validation run (nothing was measured before its first evaluation, which
    /// for a large batch comes several epochs in; a trial starting at 0 would report that
    /// first value flat until then).
    pub start: f64,
    /// Lowest true loss of the run.
    pub floor: f64,
}

impl RecordedCurve {
    /// Parses a curve CSV with at least the columns `samples`, `loss` and `epoch`. Rows with
    /// a loss that is not finite (a diverged run) end the curve.
    pub fn parse(name: &str, text: &str) -> anyhow::Result<Self> {
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        let headers = reader.headers()?.clone();
        let col = |n: &str| {
            headers
                .iter()
                .position(|h| h == n)
                .with_context(|| format!("{name}: no `{n}` column"))
        };
        let (cs, cl, ce) = (col("samples")?, col("loss")?, col("epoch")?);
        let cv = headers.iter().position(|h| h == "eval_loss");
        let (mut samples, mut loss) = (Vec::new(), Vec::new());
        let mut eval: Option<Vec<f64>> = cv.map(|_| Vec::new());
        let mut epoch_samples = None;
        for row in reader.records() {
            let row = row?;
            let num = |i: usize| row.get(i).and_then(|v| v.trim().parse::<f64>().ok());
            let (Some(s), Some(l)) = (num(cs), num(cl)) else {
                anyhow::bail!("{name}: row {} lacks samples or loss", samples.len() + 1);
            };
            if !l.is_finite() {
                break;
            }
            if let Some(e) = num(ce).filter(|e| *e > 0.0 && s > 0.0) {
                epoch_samples = Some(s / e);
            }
            if samples.last().is_some_and(|&p| s <= p) {
                anyhow::bail!("{name}: samples must increase (row {})", samples.len() + 1);
            }
            samples.push(s);
            loss.push(l);
            let e = cv.and_then(num).filter(|e| e.is_finite());
            match (&mut eval, e) {
                (Some(v), Some(e)) => v.push(e),
                (Some(_), None) => eval = None,
                _ => {}
            }
        }
        anyhow::ensure!(
            samples.len() >= MIN_CURVE_ROWS,
            "{name}: fewer than {MIN_CURVE_ROWS} finite rows"
        );
        let epoch_samples = epoch_samples.with_context(|| format!("{name}: no epoch figures"))?;
        let truth: Vec<f64> = (0..loss.len())
            .map(|i| {
                let lo = i.saturating_sub(SMOOTHING_ROWS);
                let hi = (i + SMOOTHING_ROWS + 1).min(loss.len());
                loss[lo..hi].iter().sum::<f64>() / (hi - lo) as f64
            })
            .collect();
        let floor = truth.iter().copied().fold(f64::INFINITY, f64::min);
        let pair = name.rfind("-lr").map_or(name, |i| &name[..i]).to_string();
        Ok(Self {
            name: name.to_string(),
            pair,
            samples,
            loss,
            truth,
            eval,
            epoch_samples,
            start: 0.0,
            floor,
        })
    }

    /// Samples of the whole run.
    pub fn total(&self) -> f64 {
        self.samples[self.samples.len() - 1]
    }

    fn interpolate(&self, values: &[f64], x: f64) -> f64 {
        let i = self.samples.partition_point(|&s| s < x);
        if i == 0 {
            return values[0];
        }
        if i >= self.samples.len() {
            return values[values.len() - 1];
        }
        let (s0, s1) = (self.samples[i - 1], self.samples[i]);
        let w = (x - s0) / (s1 - s0);
        values[i - 1] * (1.0 - w) + values[i] * w
    }

    /// The recorded minibatch loss at position `x` (what a worker would print).
    pub fn observed(&self, x: f64) -> f64 {
        self.interpolate(&self.loss, x)
    }

    /// The smoothed (true) loss at position `x`.
    pub fn true_loss(&self, x: f64) -> f64 {
        self.interpolate(&self.truth, x)
    }

    /// The held-out loss at position `x` (what a worker evaluating every report would
    /// print), `None` when the run has none.
    pub fn eval_loss(&self, x: f64) -> Option<f64> {
        self.eval.as_ref().map(|v| self.interpolate(v, x))
    }

    /// SLAQ's normalized loss at `x` (module docs), in `[0, 1]`.
    pub fn normalized(&self, x: f64) -> f64 {
        let span = self.truth[0] - self.floor;
        if span <= 1e-12 {
            return 0.0;
        }
        ((self.true_loss(x) - self.floor) / span).clamp(0.0, 1.0)
    }
}

/// Prefix of the curves made from the Pollux applications' validation runs
/// ([`pollux_curves`]): `pollux-<application>-b<batch size>`, one sweep per application.
pub const POLLUX_CURVE_PREFIX: &str = "pollux-";

/// Fewest rows a recorded curve has ([`RecordedCurve::parse`]).
pub const MIN_CURVE_ROWS: usize = 10;

impl RecordedCurve {
    /// A curve from one measured validation run of a Pollux application (not a minibatch
    /// loss: the held-out value at each row). Its reported loss, true loss and held-out loss
    /// are all that value: it has no minibatch noise to smooth. A trial on it starts at its
    /// first row ([`RecordedCurve::start`]).
    ///
    /// # Errors
    /// Fewer than [`MIN_CURVE_ROWS`] rows, samples that do not increase, or a value that is
    /// not finite.
    pub fn from_validation(app: &str, run: &ValidationRun) -> anyhow::Result<Self> {
        let name = format!("{POLLUX_CURVE_PREFIX}{app}-b{}", run.batch_size);
        anyhow::ensure!(
            run.samples.len() >= MIN_CURVE_ROWS,
            "{name}: fewer than {MIN_CURVE_ROWS} rows ({})",
            run.samples.len()
        );
        anyhow::ensure!(
            run.samples.windows(2).all(|w| w[1] > w[0]) && run.samples[0] > 0.0,
            "{name}: samples must be positive and increase"
        );
        anyhow::ensure!(
            run.loss.iter().all(|l| l.is_finite()),
            "{name}: a value is not finite"
        );
        anyhow::ensure!(
            run.epoch_samples.is_finite() && run.epoch_samples > 0.0,
            "{name}: no epoch size"
        );
        Ok(Self {
            pair: format!("{POLLUX_CURVE_PREFIX}{app}"),
            name,
            samples: run.samples.clone(),
            loss: run.loss.clone(),
            truth: run.loss.clone(),
            eval: Some(run.loss.clone()),
            epoch_samples: run.epoch_samples,
            start: run.samples[0],
            floor: run.loss.iter().copied().fold(f64::INFINITY, f64::min),
        })
    }
}

/// The Pollux applications' validation runs as sweeps: one per application with at least
/// [`MIN_CURVE_ROWS`] epochs per run (bert's runs have 2 and are left out), one trial per
/// measured batch size, by curve name ([`RecordedCurve::from_validation`]).
///
/// # Errors
/// A run of an application with enough rows that is not a valid curve.
pub fn pollux_curves(
    apps: &BTreeMap<String, Application>,
) -> anyhow::Result<BTreeMap<String, RecordedCurve>> {
    let mut out = BTreeMap::new();
    for (name, app) in apps {
        let runs = app.validation_runs();
        if runs.iter().any(|r| r.samples.len() < MIN_CURVE_ROWS) {
            continue;
        }
        for run in &runs {
            let c = RecordedCurve::from_validation(name, run)?;
            out.insert(c.name.clone(), c);
        }
    }
    Ok(out)
}

/// The curves of `dir` ([`load_curves`]) and, with `pollux`, those applications' validation
/// runs ([`pollux_curves`]), by name: the curve set of `--curves` and `--pollux-curves`.
///
/// # Errors
/// As [`load_curves`] and [`pollux_curves`].
pub fn curve_set(
    dir: &Path,
    pollux: Option<&BTreeMap<String, Application>>,
) -> anyhow::Result<BTreeMap<String, RecordedCurve>> {
    let mut curves = load_curves(dir)?;
    if let Some(apps) = pollux {
        curves.extend(pollux_curves(apps)?);
    }
    Ok(curves)
}

/// Reads every `*.csv` of `dir` but `index.csv` as a [`RecordedCurve`], by file stem.
pub fn load_curves(dir: &Path) -> anyhow::Result<BTreeMap<String, RecordedCurve>> {
    let mut out = BTreeMap::new();
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    for e in entries {
        let path = e?.path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_none_or(|x| x != "csv") || stem == "index" {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        out.insert(stem.to_string(), RecordedCurve::parse(stem, &text)?);
    }
    anyhow::ensure!(!out.is_empty(), "no curves in {}", dir.display());
    Ok(out)
}

/// One trial of an exploratory workload (a row of its CSV).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExploreTrial {
    /// Trial (job) id.
    pub name: String,
    /// Submission, seconds from the start of the workload.
    pub time: f64,
    /// The sweep it belongs to.
    pub sweep: String,
    /// The recorded curve it follows (file stem).
    pub curve: String,
    /// The Pollux application whose step times it has.
    pub application: String,
    /// Workers it asks for (the trace job's GPUs).
    pub workers: u32,
    /// Most workers it can use.
    pub max_workers: u32,
    /// Seconds one GPU needs to run the whole curve.
    pub work_s: f64,
}

/// Reads an exploratory workload CSV.
pub fn read_trials(path: &Path) -> anyhow::Result<Vec<ExploreTrial>> {
    let mut reader =
        csv::Reader::from_path(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, row) in reader.deserialize().enumerate() {
        let t: ExploreTrial = row.with_context(|| format!("{}: row {}", path.display(), i + 2))?;
        anyhow::ensure!(
            t.workers >= 1 && t.max_workers >= t.workers && t.work_s > 0.0 && t.time >= 0.0,
            "{}: row {}: workers, max_workers, work_s or time out of range",
            path.display(),
            i + 2
        );
        out.push(t);
    }
    Ok(out)
}

/// Writes an exploratory workload CSV.
pub fn write_trials(path: &Path, trials: &[ExploreTrial]) -> anyhow::Result<()> {
    let mut w =
        csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    for t in trials {
        w.serialize(t)?;
    }
    w.flush()?;
    Ok(())
}

/// Samples an exploratory workload: `sweeps` sweeps arriving as a Poisson process over
/// `hours`, each a model × dataset pair of `curves` (uniformly) with one trial per recorded
/// run of that pair, sized by a uniformly drawn job of `philly` (module docs).
/// Deterministic for `seed`.
pub fn generate(
    philly: &[crate::workload::PhillyJob],
    curves: &BTreeMap<String, RecordedCurve>,
    sweeps: usize,
    hours: f64,
    seed: u64,
) -> anyhow::Result<Vec<ExploreTrial>> {
    anyhow::ensure!(!philly.is_empty(), "the trace has no usable jobs");
    anyhow::ensure!(hours > 0.0 && sweeps > 0, "need sweeps > 0 and hours > 0");
    let mut pairs: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for c in curves.values() {
        pairs.entry(&c.pair).or_default().push(&c.name);
    }
    let pairs: Vec<(&str, Vec<&str>)> = pairs.into_iter().collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gaps = Exp::new(sweeps as f64 / (hours * 3600.0)).context("arrival rate")?;
    let mut t = 0.0;
    let mut trials = Vec::new();
    for s in 0..sweeps {
        t += gaps.sample(&mut rng);
        let (pair, runs) = &pairs[rng.gen_range(0..pairs.len())];
        let job = &philly[rng.gen_range(0..philly.len())];
        let workers = job.num_gpus.clamp(1, MAX_TRIAL_WORKERS);
        let max_workers = (workers * ELASTIC_FACTOR).clamp(4, MAX_TRIAL_WORKERS);
        let work_s = (job.gpu_time_s / TIME_SCALE).clamp(WORK_RANGE_S.0, WORK_RANGE_S.1);
        let gpu_hours = job.gpu_time_s / 3600.0;
        let application = if gpu_hours < 1.0 {
            "cifar10"
        } else if gpu_hours < 10.0 {
            if rng.gen_bool(0.5) {
                "deepspeech2"
            } else {
                "bert"
            }
        } else if gpu_hours < 100.0 {
            "yolov3"
        } else {
            "imagenet"
        };
        // Arrivals past the window are submitted at its end.
        let time = t.min(hours * 3600.0).round();
        let sweep = format!("s{s:03}-{pair}");
        for (i, run) in runs.iter().enumerate() {
            trials.push(ExploreTrial {
                name: format!("{sweep}-{}", i + 1),
                time,
                sweep: sweep.clone(),
                curve: (*run).to_string(),
                application: application.to_string(),
                workers,
                max_workers,
                work_s: work_s.round(),
            });
        }
    }
    Ok(trials)
}

/// Settings of an exploratory simulation.
#[derive(Debug, Clone)]
pub struct ExploreConfig {
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// How often the policy decides, seconds.
    pub scheduling_interval_s: f64,
    /// Seconds without progress every allocation change costs (a small trainer's checkpoint
    /// and restart).
    pub restart_delay_s: f64,
    /// Seconds of work between two progress reports of a trial.
    pub report_every_s: f64,
    /// Stop criteria of every trial; `None`: every trial runs its whole curve.
    pub stop: Option<StopSpec>,
    /// Each sweep's early stopping (`[sweep] early_stop`; the service loop only: the
    /// allocator's step applies it). `None`: none, as `early_stop = "none"`.
    pub early_stop: Option<EarlyStopSpec>,
    /// Priority class of every trial (service loop; the decision loop has one class).
    pub priority: converge_common::PriorityClass,
    pub placement: PlacementKind,
    /// Simulated time after which the run stops, seconds.
    pub max_time_s: f64,
}

impl Default for ExploreConfig {
    fn default() -> Self {
        Self {
            nodes: 8,
            gpus_per_node: 4,
            scheduling_interval_s: 15.0,
            restart_delay_s: 10.0,
            report_every_s: 2.0,
            stop: Some(default_stop()),
            early_stop: None,
            priority: converge_common::PriorityClass::Normal,
            placement: PlacementKind::FirstFit,
            max_time_s: 7.0 * 24.0 * 3600.0,
        }
    }
}

/// The stop criteria of the report's trials: converged when the fitted curve predicts under
/// 1 % improvement per epoch over the next 2 epochs.
pub fn default_stop() -> StopSpec {
    StopSpec {
        plateau: Some(converge_common::PlateauSpec {
            min_improvement: 0.01,
            window_epochs: 2.0,
        }),
        ..StopSpec::default()
    }
}

/// How one trial did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrialOutcome {
    pub name: String,
    pub sweep: String,
    pub curve: String,
    pub submitted_at: f64,
    pub ended_at: Option<f64>,
    /// `None` while it had not ended when the run stopped.
    pub reason: Option<EndReason>,
    /// True (smoothed) loss where it ended.
    pub final_loss: f64,
    /// Normalized loss where it ended.
    pub final_normalized: f64,
    /// Held-out loss where it ended (`None`: its curve has none).
    pub final_eval: Option<f64>,
    /// GPU-hours it held (restarts included).
    pub gpu_hours: f64,
    pub time_to_80: Option<f64>,
    pub time_to_90: Option<f64>,
    pub time_to_95: Option<f64>,
    pub restarts: u32,
}

/// Everything an exploratory run produced.
#[derive(Debug, Clone, Serialize)]
pub struct ExploreResult {
    pub policy: String,
    pub trials: Vec<TrialOutcome>,
    /// `(time, average normalized loss of active trials, active trials, GPUs allocated)`
    /// per interval with at least one active trial.
    pub intervals: Vec<(f64, f64, usize, u32)>,
    pub finished: bool,
    pub wall_s: f64,
    /// Largest wall time of one decision (policy and placement), seconds.
    pub max_decision_s: f64,
}

/// One trial as the simulated cluster runs it (both loops: [`simulate`] and
/// [`crate::sweep_world::SweepWorld`]).
pub(crate) struct Trial<'a> {
    pub(crate) spec: &'a ExploreTrial,
    pub(crate) curve: &'a RecordedCurve,
    app: &'a Application,
    pub(crate) id: JobId,
    /// Position on its curve, curve samples.
    pub(crate) x: f64,
    pub(crate) placement: Vec<RankPlacement>,
    /// Seconds of the current generation's start still to come (no progress).
    pub(crate) stall_s: f64,
    pub(crate) restarts: u32,
    pub(crate) generation: u64,
    history: JobHistory,
    /// Optimizer steps taken, over all generations (fractional).
    step: f64,
    gpu_seconds: f64,
    /// When it ended and why (`None`: the reason is not known yet).
    pub(crate) ended: Option<(f64, Option<EndReason>)>,
    times: [Option<f64>; 3],
    /// Step times seen, one per shape (the decision loop's throughput model input).
    step_times: Vec<StepObservation>,
    /// Curve samples per application sample (module docs: throughput).
    unit: f64,
}

/// Each trial of `specs`, not yet submitted, with its curve and application.
///
/// # Errors
/// A trial names an unknown curve or application, has an invalid name, or its application
/// has no throughput on one GPU.
pub(crate) fn trials_of<'a>(
    curves: &'a BTreeMap<String, RecordedCurve>,
    apps: &'a BTreeMap<String, Application>,
    specs: &'a [ExploreTrial],
) -> anyhow::Result<Vec<Trial<'a>>> {
    let mut state = Vec::with_capacity(specs.len());
    for spec in specs {
        let curve = curves.get(&spec.curve).with_context(|| {
            let hint = if spec.curve.starts_with(POLLUX_CURVE_PREFIX) {
                " (a Pollux validation run: pass --pollux-curves)"
            } else {
                ""
            };
            format!("trial {}: unknown curve {:?}{hint}", spec.name, spec.curve)
        })?;
        let app = apps.get(&spec.application).with_context(|| {
            format!(
                "trial {}: unknown application {:?}",
                spec.name, spec.application
            )
        })?;
        let id = JobId::new(spec.name.clone())
            .map_err(|e| anyhow::anyhow!("trial {:?}: {e}", spec.name))?;
        let mut t = Trial {
            spec,
            curve,
            app,
            id,
            x: curve.start,
            placement: Vec::new(),
            stall_s: 0.0,
            restarts: 0,
            generation: 0,
            history: JobHistory::default(),
            step: 0.0,
            gpu_seconds: 0.0,
            ended: None,
            times: [None; 3],
            step_times: Vec::new(),
            unit: 1.0,
        };
        let (_, one) = t.rate(&[1]);
        anyhow::ensure!(one > 0.0, "trial {}: no throughput on one GPU", spec.name);
        t.unit = (curve.total() - curve.start) / spec.work_s / one;
        state.push(t);
    }
    Ok(state)
}

/// The simulated cluster's hosts: `nodes` of `gpus_per_node` GPUs, `n000`, `n001`, ….
pub(crate) fn host_id(n: u32) -> HostId {
    HostId::new(format!("n{n:03}")).expect("valid host id")
}

impl Trial<'_> {
    fn local_batch(&self) -> f64 {
        f64::from(self.app.min_local_bsz.max(1))
    }

    /// Step time and curve samples per second on `per_node` GPUs per node.
    fn rate(&self, per_node: &[u32]) -> (f64, f64) {
        let workers: u32 = per_node.iter().sum();
        if workers == 0 {
            return (f64::INFINITY, 0.0);
        }
        let (step, _) = self.app.throughput(per_node, self.local_batch());
        let rate = f64::from(workers) * self.local_batch() / step * self.unit;
        (step, if rate.is_finite() { rate } else { 0.0 })
    }

    pub(crate) fn active(&self, now: f64) -> bool {
        self.spec.time <= now && self.ended.is_none()
    }

    /// Runs the trial for `dt` seconds from `now` on its placement (its restart first),
    /// handing `report` a progress report of rank 0 every `report_every_s` of work; it
    /// ends `Finished` at the end of its curve.
    pub(crate) fn advance(
        &mut self,
        now: f64,
        dt: f64,
        report_every_s: f64,
        mut report: impl FnMut(ProgressReport),
    ) {
        let workers = self.placement.len() as u32;
        if workers == 0 || !self.active(now) {
            return;
        }
        self.gpu_seconds += f64::from(workers) * dt;
        let stall = self.stall_s.min(dt);
        self.stall_s -= stall;
        let work = dt - stall;
        let spread = per_node(&self.placement);
        let (step_s, rate) = self.rate(&spread);
        let nodes = spread.len() as u32;
        let seen = StepObservation {
            workers,
            nodes,
            local_batch: self.local_batch() * self.unit,
            step_time_s: step_s,
            sync_time_s: None,
        };
        if !self.step_times.contains(&seen) {
            self.step_times.push(seen);
        }
        let left = (self.curve.total() - self.x).max(0.0);
        let took = if rate > 0.0 {
            (left / rate).min(work)
        } else {
            work
        };
        let reports = (took / report_every_s).ceil().max(1.0) as u32;
        for k in 1..=reports {
            let elapsed = took * f64::from(k) / f64::from(reports);
            let x = (self.x + rate * elapsed).min(self.curve.total());
            let mut r = ProgressReport::new(
                self.id.clone(),
                self.generation,
                0,
                self.placement[0].host.clone(),
                (self.step + elapsed / step_s).floor() as u64,
                x.round() as u64,
                self.curve.observed(x),
                now + stall + elapsed,
            );
            r.line.epoch = Some(x / self.curve.epoch_samples);
            r.line.eval_loss = self.curve.eval_loss(x);
            r.workers = Some(workers);
            r.hosts = Some(nodes);
            self.history.add(&r);
            report(r);
        }
        self.step += took / step_s;
        self.x = (self.x + rate * took).min(self.curve.total());
        if self.x >= self.curve.total() {
            self.ended = Some((now + stall + took, Some(EndReason::Finished)));
        }
    }

    /// How it did, so far.
    pub(crate) fn outcome(&self) -> TrialOutcome {
        TrialOutcome {
            name: self.spec.name.clone(),
            sweep: self.spec.sweep.clone(),
            curve: self.spec.curve.clone(),
            submitted_at: self.spec.time,
            ended_at: self.ended.map(|(e, _)| e),
            reason: self.ended.and_then(|(_, r)| r),
            final_loss: self.curve.true_loss(self.x),
            final_normalized: self.curve.normalized(self.x),
            final_eval: self.curve.eval_loss(self.x),
            gpu_hours: self.gpu_seconds / 3600.0,
            time_to_80: self.times[0],
            time_to_90: self.times[1],
            time_to_95: self.times[2],
            restarts: self.restarts,
        }
    }
}

/// SLAQ's measures at `now`, the end of an interval of `dt` seconds: the normalized loss of
/// every submitted trial that has not ended or ended within the interval (each also marks
/// the age it first reached 80/90/95 % of its loss reduction at).
pub(crate) fn normalized_losses(trials: &mut [Trial<'_>], now: f64, dt: f64) -> Vec<f64> {
    let mut norm = Vec::new();
    for t in trials
        .iter_mut()
        .filter(|t| t.spec.time <= now && t.ended.is_none_or(|(e, _)| e > now - dt))
    {
        let n = t.curve.normalized(t.x);
        let age = now - t.spec.time;
        for (slot, level) in t.times.iter_mut().zip([0.2, 0.1, 0.05]) {
            if n <= level {
                slot.get_or_insert(age);
            }
        }
        norm.push(n);
    }
    norm
}

fn per_node(placement: &[RankPlacement]) -> Vec<u32> {
    let mut counts: BTreeMap<&HostId, u32> = BTreeMap::new();
    for p in placement {
        *counts.entry(&p.host).or_default() += p.gpus.len() as u32;
    }
    counts.into_values().collect()
}

/// Runs `trials` under `policy` (module docs). Deterministic (decision times aside).
pub fn simulate(
    curves: &BTreeMap<String, RecordedCurve>,
    apps: &BTreeMap<String, Application>,
    trials: &[ExploreTrial],
    policy: &dyn Policy,
    cfg: &ExploreConfig,
) -> anyhow::Result<ExploreResult> {
    anyhow::ensure!(
        cfg.early_stop.is_none_or(|e| e.rule == EarlyStopRule::None),
        "sweep early stopping is the allocator's: it runs in the service loop only (--loop service)"
    );
    let wall = Instant::now();
    let wants = policy.inputs();
    let mut state = trials_of(curves, apps, trials)?;
    let hosts: Vec<HostFree> = (0..cfg.nodes)
        .map(|n| HostFree::new(host_id(n), (0..cfg.gpus_per_node).collect()))
        .collect();
    let fit_cfg = FitConfig::default();
    let prior = ThroughputPrior::default();
    let mut fits = FitCache::new();
    let mut intervals = Vec::new();
    let mut max_decision_s: f64 = 0.0;
    let dt = cfg.scheduling_interval_s;
    let mut now = 0.0;
    loop {
        // 1. Progress over the interval, with a report every `report_every_s` of work.
        for t in &mut state {
            t.advance(now, dt, cfg.report_every_s, |_| {});
        }
        now += dt;

        // 2. Metrics: every submitted trial counts until the end of the interval it ends in.
        let norm = normalized_losses(&mut state, now, dt);

        // 3. Stop criteria, as the service's step applies them.
        for t in state
            .iter_mut()
            .filter(|t| cfg.stop.is_some() && t.active(now))
        {
            let stop = cfg.stop.as_ref().expect("filtered on stop criteria");
            let curve = fits.curve(&t.id, &t.history, &fit_cfg, true);
            let verdict = stop_verdict(
                stop,
                &StopInputs {
                    now,
                    submitted_at: t.spec.time,
                    samples: t.x,
                    epoch_samples: t.history.epoch_samples(),
                    recent_loss: t.history.recent_loss(converge_sched::stop::RECENT_LOSSES),
                    curve: curve.as_ref(),
                    gpu_seconds: t.history.attained_gpu_seconds(1),
                },
            );
            if let Some(v) = verdict {
                t.ended = Some((now, Some(v.reason)));
                t.placement.clear();
            }
        }
        let active: Vec<usize> = (0..state.len()).filter(|&i| state[i].active(now)).collect();
        let allocated: u32 = active
            .iter()
            .map(|&i| state[i].placement.len() as u32)
            .sum();
        if !norm.is_empty() {
            intervals.push((
                now,
                norm.iter().sum::<f64>() / norm.len() as f64,
                norm.len(),
                allocated,
            ));
        }
        let pending_arrivals = state.iter().any(|t| t.spec.time > now);
        if (active.is_empty() && !pending_arrivals) || now >= cfg.max_time_s {
            break;
        }
        if active.is_empty() {
            continue;
        }

        // 4. The decision, as the service takes it.
        let started = Instant::now();
        let mut views = Vec::with_capacity(active.len());
        for &i in &active {
            let t = &state[i];
            let curve = if wants.curves {
                fits.curve(&t.id, &t.history, &fit_cfg, true)
            } else {
                None
            };
            let model = (!t.step_times.is_empty())
                .then(|| fits.model(&t.id, ModelScope::All, &t.step_times, &prior));
            let workers = t.placement.len() as u32;
            views.push(JobView {
                id: t.id.clone(),
                gpus_per_worker: 1,
                min_workers: 1,
                max_workers: t.spec.max_workers,
                requested_workers: t.spec.workers.clamp(1, t.spec.max_workers),
                workers_declared: true,
                submitted_at: t.spec.time,
                placement: t.placement.clone(),
                curve,
                samples: t.x,
                loss_scale: t.history.loss_scale(),
                samples_per_s_per_worker: t
                    .history
                    .samples_per_s(t.generation)
                    .map(|r| r / f64::from(workers.max(1))),
                attained_gpu_seconds: t.history.attained_gpu_seconds(1),
                model,
                batch: BatchSize::PerWorker(t.local_batch() * t.unit),
                remaining_work: None,
                oracle: None,
                restarts: t.restarts,
                restart_cost_s: (t.restarts > 0).then_some(cfg.restart_delay_s),
                adaptive: None,
                hosts: None,
                queue: converge_sched::queues::default_queue(),
                priority: converge_common::PriorityClass::Normal,
                started_at: None,
                shadow: None,
                family: None,
                gpu_type_speeds: BTreeMap::new(),
                // A sweep's trial without a target loss (`JobSpec::is_exploratory`). The
                // decision loop declares no work (`remaining_work: None` above); the sweep
                // world's specs declare their recorded run's samples, which only the
                // completion-time objectives (`quality-both`, `quality-jct`) read.
                exploratory: true,
            });
        }
        let cluster = ClusterState {
            now,
            hosts: &hosts,
            contention_per_shared_job: 0.0,
        };
        let decision = decide(&cluster, &views, policy, cfg.placement);
        max_decision_s = max_decision_s.max(started.elapsed().as_secs_f64());
        for &i in &active {
            let t = &mut state[i];
            let new = decision.placements.get(&t.id).cloned().unwrap_or_default();
            if new != t.placement {
                if !t.placement.is_empty() && !new.is_empty() {
                    t.restarts += 1;
                }
                t.generation += 1;
                t.stall_s = if new.is_empty() {
                    0.0
                } else {
                    cfg.restart_delay_s
                };
                t.placement = new;
            }
        }
    }
    let finished = state.iter().all(|t| t.ended.is_some());
    Ok(ExploreResult {
        policy: policy.name().to_string(),
        trials: state.iter().map(Trial::outcome).collect(),
        intervals,
        finished,
        wall_s: wall.elapsed().as_secs_f64(),
        max_decision_s,
    })
}

/// SLAQ's measures of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExploreSummary {
    pub policy: String,
    /// Time-average over the run of the average normalized loss of active trials.
    pub avg_normalized_loss: f64,
    /// Mean time to 80/90/95 % loss reduction over the trials that got there, seconds, and
    /// the share of trials that got there.
    pub time_to: [(Option<f64>, f64); 3],
    /// Mean trial completion time (submission to end), seconds.
    pub mean_jct: f64,
    /// Mean normalized loss trials ended at.
    pub mean_final_normalized: f64,
    /// Per sweep: GPU-hours of all its trials and its best trial's losses.
    pub sweeps: BTreeMap<String, SweepSummary>,
    /// Per trial: the GPU-hours it held (restarts included) and whether its sweep's
    /// early-stopping rule ended it.
    pub trials: BTreeMap<String, TrialHours>,
    /// How trials ended: reason (or `running`) → count.
    pub ends: BTreeMap<String, usize>,
    pub makespan_s: f64,
    /// Mean allocation changes per trial that moved or resized it while it ran.
    pub restarts_per_trial: f64,
}

/// One sweep of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SweepSummary {
    /// GPU-hours all its trials held (restarts included).
    pub gpu_hours: f64,
    /// The lowest true (smoothed) training loss a trial ended at.
    pub best_loss: f64,
    /// The lowest held-out loss a trial ended at: the best trial as a user picks it by
    /// held-out loss (`None`: the curves have none).
    pub best_eval: Option<f64>,
}

/// One trial's share of its sweep's GPU-hours.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TrialHours {
    /// GPU-hours it held (restarts included).
    pub gpu_hours: f64,
    /// Ended by its sweep's early-stopping rule.
    pub early_stopped: bool,
}

/// Summarizes a run.
pub fn summarize(r: &ExploreResult) -> ExploreSummary {
    let n = r.trials.len().max(1) as f64;
    let time_to = |f: fn(&TrialOutcome) -> Option<f64>| {
        let got: Vec<f64> = r.trials.iter().filter_map(f).collect();
        (
            (!got.is_empty()).then(|| got.iter().sum::<f64>() / got.len() as f64),
            got.len() as f64 / n,
        )
    };
    let mut sweeps: BTreeMap<String, SweepSummary> = BTreeMap::new();
    let mut ends: BTreeMap<String, usize> = BTreeMap::new();
    let mut trials = BTreeMap::new();
    for t in &r.trials {
        trials.insert(
            t.name.clone(),
            TrialHours {
                gpu_hours: t.gpu_hours,
                early_stopped: t.reason == Some(EndReason::EarlyStopped),
            },
        );
        let e = sweeps.entry(t.sweep.clone()).or_insert(SweepSummary {
            gpu_hours: 0.0,
            best_loss: f64::INFINITY,
            best_eval: None,
        });
        e.gpu_hours += t.gpu_hours;
        e.best_loss = e.best_loss.min(t.final_loss);
        if let Some(v) = t.final_eval {
            e.best_eval = Some(e.best_eval.map_or(v, |b: f64| b.min(v)));
        }
        *ends
            .entry(t.reason.map_or("running", EndReason::as_str).to_string())
            .or_default() += 1;
    }
    let jcts: Vec<f64> = r
        .trials
        .iter()
        .filter_map(|t| t.ended_at.map(|e| e - t.submitted_at))
        .collect();
    ExploreSummary {
        policy: r.policy.clone(),
        // Every record covers one scheduling interval, so the plain mean is the time average.
        avg_normalized_loss: r.intervals.iter().map(|i| i.1).sum::<f64>()
            / r.intervals.len().max(1) as f64,
        time_to: [
            time_to(|t| t.time_to_80),
            time_to(|t| t.time_to_90),
            time_to(|t| t.time_to_95),
        ],
        mean_jct: jcts.iter().sum::<f64>() / jcts.len().max(1) as f64,
        mean_final_normalized: r.trials.iter().map(|t| t.final_normalized).sum::<f64>() / n,
        sweeps,
        trials,
        ends,
        makespan_s: r
            .trials
            .iter()
            .filter_map(|t| t.ended_at)
            .fold(0.0, f64::max),
        restarts_per_trial: r.trials.iter().map(|t| f64::from(t.restarts)).sum::<f64>() / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apps::load_all;
    use converge_sched::policies::{Fair, PolicyParams, Quality};
    use std::path::PathBuf;

    fn data() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
    }

    fn synthetic(name: &str, rows: usize, scale: f64) -> RecordedCurve {
        let mut text = String::from("step,samples,loss,eval_loss,epoch\n");
        for i in 1..=rows {
            let s = (i * 100) as f64;
            text.push_str(&format!(
                "{i},{s},{},,{}\n",
                scale / (1.0 + s / 500.0) + 0.05,
                s / 1000.0
            ));
        }
        RecordedCurve::parse(name, &text).unwrap()
    }

    #[test]
    fn curves_parse_interpolate_and_normalize() {
        let c = synthetic("opt-mlp-lrx1-b16", 100, 1.0);
        assert_eq!(c.pair, "opt-mlp");
        assert_eq!(c.epoch_samples, 1000.0);
        assert_eq!(c.total(), 10_000.0);
        assert!((c.normalized(0.0) - 1.0).abs() < 1e-12);
        assert!(c.normalized(c.total()) < 1e-9);
        let mid = c.normalized(2000.0);
        assert!(mid > 0.0 && mid < 1.0, "{mid}");
        assert!(c.observed(150.0) < c.observed(100.0));
        assert!(RecordedCurve::parse("x", "samples,loss\n1,2\n").is_err());
        let diverged = "samples,loss,epoch\n".to_string()
            + &(1..=20)
                .map(|i| {
                    format!(
                        "{i},{},0.1\n",
                        if i > 12 {
                            "NaN".into()
                        } else {
                            format!("{}", 1.0 / i as f64)
                        }
                    )
                })
                .collect::<String>();
        assert!(RecordedCurve::parse("d", &diverged).is_ok());
    }

    #[test]
    fn the_recorded_sweep_loads_and_a_workload_runs_under_quality_and_fair() {
        let dir = data().join("curves/sweep");
        let curves = load_curves(&dir).unwrap();
        assert!(curves.len() >= 12);
        let philly =
            crate::workload::read_philly(&data().join("pollux/traces/philly.csv")).unwrap();
        let trials = generate(&philly, &curves, 6, 0.5, 7).unwrap();
        assert_eq!(trials, generate(&philly, &curves, 6, 0.5, 7).unwrap());
        let apps = load_all(&crate::apps::test_trace_dirs()).unwrap();
        let cfg = ExploreConfig::default();
        let quality = Quality {
            params: PolicyParams {
                objective: converge_sched::policies::Objective::Loss,
                ..PolicyParams::default()
            },
        };
        for policy in [&quality as &dyn Policy, &Fair] {
            let r = simulate(&curves, &apps, &trials, policy, &cfg).unwrap();
            assert!(r.finished, "{}: every trial ends", r.policy);
            assert!(r.trials.iter().all(|t| t.reason.is_some()));
            let s = summarize(&r);
            assert!(s.avg_normalized_loss > 0.0 && s.avg_normalized_loss < 1.0);
            // Deterministic for the same inputs (decision times aside).
            let again = simulate(&curves, &apps, &trials, policy, &cfg).unwrap();
            assert_eq!(r.trials, again.trials);
        }
    }

    #[test]
    fn the_pollux_validation_runs_make_sweeps_of_their_batch_sizes() {
        let apps = load_all(&crate::apps::test_trace_dirs()).unwrap();
        let curves = pollux_curves(&apps).unwrap();
        let pairs: std::collections::BTreeSet<&str> =
            curves.values().map(|c| c.pair.as_str()).collect();
        // bert's runs have 2 epochs: too short for a curve.
        assert_eq!(
            pairs.into_iter().collect::<Vec<_>>(),
            [
                "pollux-cifar10",
                "pollux-deepspeech2",
                "pollux-imagenet",
                "pollux-ncf",
                "pollux-yolov3"
            ]
        );
        assert_eq!(curves.len(), 6 + 6 + 7 + 8 + 7);
        let c = &curves["pollux-cifar10-b128"];
        assert!(
            (c.epoch_samples - 50_000.0).abs() < 1.0,
            "{}",
            c.epoch_samples
        );
        assert_eq!(c.total(), 39_062.0 * 128.0);
        // No minibatch noise: reported, true and held-out values are the measured ones.
        let x = 10.0 * 50_000.0;
        assert_eq!(c.observed(x), c.true_loss(x));
        assert_eq!(c.eval_loss(x), Some(c.true_loss(x)));
        assert!((c.floor - (1.0 - 0.9463)).abs() < 1e-12, "{}", c.floor);
        assert!(c.normalized(c.total()) < 0.05);
        // A large batch's run: epochs of the same 50,000 samples; its trials start at its
        // first row (106 steps of 4,096: more than 8 epochs in).
        let large = &curves["pollux-cifar10-b4096"];
        assert_eq!(large.epoch_samples, c.epoch_samples);
        assert_eq!(large.start, 106.0 * 4096.0);
        assert_eq!(c.start, 390.0 * 128.0);
        let short = ValidationRun {
            batch_size: 8,
            samples: vec![1.0, 2.0],
            epoch_samples: 1.0,
            loss: vec![2.0, 1.0],
        };
        let err = RecordedCurve::from_validation("x", &short).unwrap_err();
        assert!(err.to_string().contains("fewer than 10 rows"), "{err}");
    }

    #[test]
    fn a_workload_with_pollux_sweeps_runs_and_names_the_flag_without_it() {
        let apps = load_all(&crate::apps::test_trace_dirs()).unwrap();
        let mut curves = load_curves(&data().join("curves/sweep")).unwrap();
        let trainer_only = curves.clone();
        curves.extend(pollux_curves(&apps).unwrap());
        let philly =
            crate::workload::read_philly(&data().join("pollux/traces/philly.csv")).unwrap();
        let trials = generate(&philly, &curves, 12, 0.5, 3).unwrap();
        assert!(
            trials
                .iter()
                .any(|t| t.curve.starts_with(POLLUX_CURVE_PREFIX))
        );
        let r = simulate(&curves, &apps, &trials, &Fair, &ExploreConfig::default()).unwrap();
        assert!(r.finished);
        // The same workload without the Pollux curves is refused with the flag to pass.
        let err = simulate(
            &trainer_only,
            &apps,
            &trials,
            &Fair,
            &ExploreConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("--pollux-curves"), "{err}");
        // A Pollux trial starts at its curve's first row, a trainer trial at 0.
        for t in trials_of(&curves, &apps, &trials).unwrap() {
            if t.spec.curve.starts_with(POLLUX_CURVE_PREFIX) {
                assert!(t.x > 0.0 && t.x == t.curve.samples[0], "{}", t.spec.name);
            } else {
                assert_eq!(t.x, 0.0);
            }
        }
        // An unknown curve that is not a Pollux run gets no such hint.
        let mut unknown = trials[..1].to_vec();
        unknown[0].curve = "no-such-curve-lrx1-b16".into();
        let err = simulate(&curves, &apps, &unknown, &Fair, &ExploreConfig::default()).unwrap_err();
        assert!(!err.to_string().contains("--pollux-curves"), "{err}");
    }
}
