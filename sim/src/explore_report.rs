//! `converge-sim explore-workload`, `converge-sim explore` and `converge-sim explore-report`:
//! exploratory workloads (sweeps of short trials that end by their stop criteria, see
//! [`crate::explore`]) and SLAQ's measures of them, per policy; the report writes
//! `docs/exploratory.md` (with `--pollux-curves`, `docs/exploratory-pollux.md`).

use crate::apps::{Application, load_all};
use crate::engine::SimLoop;
use crate::explore::{
    ExploreConfig, ExploreResult, ExploreSummary, ExploreTrial, RecordedCurve, curve_set,
    default_stop, generate, read_trials, simulate, summarize, write_trials,
};
use crate::markdown::Table;
use crate::workload::read_philly;
use anyhow::Context as _;
use converge_common::{
    EarlyStopRule, EarlyStopSpec, EndReason, PlateauSpec, StopSpec,
    jobspec::{DEFAULT_EARLY_STOP_BAND, DEFAULT_EARLY_STOP_KEEP},
};
use converge_sched::placement::PlacementKind;
use converge_sched::policies::{Objective, Policy, PolicyParams, by_name};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

/// Where the inputs are.
#[derive(Debug, Clone, clap::Args)]
pub struct ExploreData {
    /// Folder of recorded loss curves (`step,samples,loss,eval_loss,epoch` CSVs).
    #[arg(long, default_value = "data/curves/sweep")]
    pub curves: PathBuf,
    /// Folder of the measured application traces (step times) and of `philly.csv`; repeat it
    /// to search several in order (each file from the first that has it). The default's
    /// second folder supplies the applications, whose traces are not in this repository
    /// (data/README.md).
    #[arg(long, default_values = crate::apps::DEFAULT_TRACE_DIRS)]
    pub traces: Vec<PathBuf>,
    /// Also make sweeps of the Pollux applications' measured validation runs (from
    /// `--traces`; not copied into this repository): one sweep per application (cifar10,
    /// deepspeech2, imagenet, ncf, yolov3; bert's runs have 2 epochs and are left out), one
    /// trial per measured batch size, valued by the held-out metric as a loss (`1 −
    /// accuracy`, word error rate, …). A workload generated with it needs it again in
    /// `explore`.
    #[arg(long)]
    pub pollux_curves: bool,
}

impl ExploreData {
    /// The curves of `--curves`, and with `--pollux-curves` the validation runs of `apps`
    /// (loaded from `--traces` when `None`), by name ([`crate::explore::curve_set`]).
    ///
    /// # Errors
    /// A curve that cannot be read, or (with `--pollux-curves` and no `apps`) an application
    /// that cannot be loaded from `--traces`.
    pub fn curves(
        &self,
        apps: Option<&BTreeMap<String, Application>>,
    ) -> anyhow::Result<BTreeMap<String, RecordedCurve>> {
        match apps {
            _ if !self.pollux_curves => curve_set(&self.curves, None),
            Some(apps) => curve_set(&self.curves, Some(apps)),
            None => curve_set(&self.curves, Some(&load_all(&self.traces)?)),
        }
    }

    /// `philly.csv` from the first of `--traces` that has it.
    ///
    /// # Errors
    /// When none has it.
    pub fn philly(&self) -> anyhow::Result<PathBuf> {
        crate::apps::find_in(&self.traces, "philly.csv").ok_or_else(|| {
            anyhow::anyhow!(
                "no philly.csv in {}",
                self.traces
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }
}

/// `converge-sim explore-workload`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExploreWorkloadArgs {
    /// Sweeps to generate (each a model × dataset pair with one trial per recorded run).
    #[arg(long, default_value_t = 30)]
    pub sweeps: usize,
    /// Hours over which the sweeps arrive (Poisson).
    #[arg(long, default_value_t = 2.0)]
    pub hours: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten)]
    pub data: ExploreData,
    /// The output CSV (`name,time,sweep,curve,application,workers,max_workers,work_s`).
    #[arg(long)]
    pub out: PathBuf,
}

/// Cluster, timing and stop settings of `explore` and `explore-report`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExploreClusterArgs {
    #[arg(long, default_value_t = 8)]
    pub nodes: u32,
    #[arg(long, default_value_t = 4)]
    pub gpus_per_node: u32,
    /// How often the policy decides, seconds.
    #[arg(long, default_value_t = 15.0)]
    pub scheduling_interval: f64,
    /// Seconds without progress every allocation change costs.
    #[arg(long, default_value_t = 10.0)]
    pub restart_delay: f64,
    /// Plateau rule of every trial: converged below this relative improvement per epoch.
    #[arg(long, default_value_t = 0.01)]
    pub plateau_improvement: f64,
    /// Plateau rule: epochs the improvement is judged over.
    #[arg(long, default_value_t = 2.0)]
    pub plateau_window: f64,
    /// Run every trial to the end of its curve (no stop criteria).
    #[arg(long)]
    pub no_stop: bool,
    /// How the quality policy's horizon values an allocation, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub horizon: f64,
    #[arg(long, value_enum, default_value_t = PlacementKind::FirstFit)]
    pub placement: PlacementKind,
    /// Which loop runs the trials: `decision` (the simulator builds the job views and
    /// applies the stop rule itself) or `service` (the allocator's scheduling step drives
    /// the cluster through plans, heartbeats and progress reports: its lifecycle, stop
    /// rule and measured step times and restart costs).
    #[arg(long = "loop", value_enum, default_value_t = SimLoop::Decision)]
    pub sim_loop: SimLoop,
    /// Each sweep's early stopping, as `[sweep] early_stop` in a sweep file (where
    /// `predicted` is the default): `predicted`, `asha` or `none`. The allocator's step
    /// applies it, so anything but `none` needs `--loop service`.
    #[arg(long, value_parser = serde_name::<EarlyStopRule>, default_value = "none")]
    pub early_stop: EarlyStopRule,
    /// `[sweep] keep`: the best trials of a sweep early stopping never stops.
    #[arg(long, default_value_t = DEFAULT_EARLY_STOP_KEEP)]
    pub early_stop_keep: u32,
    /// `[sweep] band`: the relative error band of a predicted final loss per doubling of the
    /// samples ahead (`predicted`).
    #[arg(long, default_value_t = DEFAULT_EARLY_STOP_BAND)]
    pub early_stop_band: f64,
    /// `[sweep] min_epochs`: epochs a trial runs before early stopping may end it (ASHA's
    /// first rung).
    #[arg(long, default_value_t = 1.0)]
    pub early_stop_min_epochs: f64,
}

/// Parses a flag's value as the serde name of a `converge-common` enum (`predicted`,
/// `asha`, `low`, …): the names job specs and sweep files use, one parser for all of them.
/// `Err` names the accepted values.
pub fn serde_name<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|e| e.to_string())
}

impl ExploreClusterArgs {
    pub fn config(&self) -> anyhow::Result<ExploreConfig> {
        anyhow::ensure!(
            self.nodes > 0 && self.gpus_per_node > 0,
            "the cluster needs at least one GPU"
        );
        anyhow::ensure!(
            self.scheduling_interval > 0.0 && self.restart_delay >= 0.0,
            "--scheduling-interval must be positive and --restart-delay not negative"
        );
        let stop = StopSpec {
            plateau: Some(PlateauSpec {
                min_improvement: self.plateau_improvement,
                window_epochs: self.plateau_window,
            }),
            ..default_stop()
        };
        stop.validate()
            .map_err(|e| anyhow::anyhow!("plateau rule: {e}"))?;
        let early_stop = EarlyStopSpec {
            rule: self.early_stop,
            keep: self.early_stop_keep,
            band: self.early_stop_band,
            min_epochs: self.early_stop_min_epochs,
        };
        early_stop
            .validate()
            .map_err(|e| anyhow::anyhow!("early stopping: {e}"))?;
        anyhow::ensure!(
            early_stop.rule == EarlyStopRule::None || self.sim_loop == SimLoop::Service,
            "--early-stop {} needs --loop service: the allocator's scheduling step applies it",
            early_stop.rule.as_str()
        );
        Ok(ExploreConfig {
            early_stop: (early_stop.rule != EarlyStopRule::None).then_some(early_stop),
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            scheduling_interval_s: self.scheduling_interval,
            restart_delay_s: self.restart_delay,
            stop: (!self.no_stop).then_some(stop),
            placement: self.placement,
            ..ExploreConfig::default()
        })
    }

    /// Runs `trials` under `policy` in the loop `--loop` names.
    ///
    /// # Errors
    /// An unknown curve or application, or an invalid trial or sweep name.
    fn simulate(
        &self,
        (curves, apps): (
            &BTreeMap<String, RecordedCurve>,
            &BTreeMap<String, crate::apps::Application>,
        ),
        trials: &[ExploreTrial],
        policy: Arc<dyn Policy>,
        cfg: &ExploreConfig,
    ) -> anyhow::Result<ExploreResult> {
        match self.sim_loop {
            SimLoop::Decision => simulate(curves, apps, trials, policy.as_ref(), cfg),
            SimLoop::Service => {
                crate::sweep_world::simulate_service(curves, apps, trials, policy, cfg)
            }
        }
    }

    fn params(&self, objective: Objective) -> PolicyParams {
        PolicyParams {
            objective,
            horizon_s: self.horizon,
            restart_cost_s: self.restart_delay,
            ..PolicyParams::default()
        }
    }
}

/// `converge-sim explore`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExploreArgs {
    /// Workload CSV from `explore-workload`.
    #[arg(long)]
    pub workload: PathBuf,
    /// Policies: fifo, fair, tiresias, optimus, quality (the default objective, `auto`),
    /// quality-loss, quality-jct, quality-both
    /// (the quality policy per objective).
    #[arg(long, value_delimiter = ',', default_value = "quality,fair")]
    pub policies: Vec<String>,
    #[command(flatten)]
    pub cluster: ExploreClusterArgs,
    #[command(flatten)]
    pub data: ExploreData,
    /// Write every trial's outcome and the intervals as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `converge-sim explore-report`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExploreReportArgs {
    /// Seeds of the generated workloads.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub seeds: Vec<u64>,
    /// Sweeps per workload (200 in 2 hours on 32 GPUs: about as much single-GPU work as
    /// the cluster has GPU time).
    #[arg(long, default_value_t = 200)]
    pub sweeps: usize,
    /// Hours over which they arrive.
    #[arg(long, default_value_t = 2.0)]
    pub hours: f64,
    /// Sweep counts of the sensitivity table (load), each with the plateau thresholds of
    /// `--sensitivity-plateau` and without stop criteria.
    #[arg(long, value_delimiter = ',', default_value = "100,200")]
    pub sensitivity_sweeps: Vec<usize>,
    /// Plateau thresholds (relative improvement per epoch) of the sensitivity table.
    #[arg(long, value_delimiter = ',', default_value = "0.01,0.002")]
    pub sensitivity_plateau: Vec<f64>,
    /// Early-stopping rules of the "Sweep early stopping" section (always in the service
    /// loop), each under the default `quality` policy and `fair`.
    #[arg(
        long,
        value_parser = serde_name::<EarlyStopRule>,
        value_delimiter = ',',
        default_value = "none,predicted,asha"
    )]
    pub early_stop_rules: Vec<EarlyStopRule>,
    #[command(flatten)]
    pub cluster: ExploreClusterArgs,
    #[command(flatten)]
    pub data: ExploreData,
    /// The Markdown report (default: docs/exploratory.md, with `--pollux-curves`
    /// docs/exploratory-pollux.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Simulations run at once (default: the available cores). The report is the same for
    /// any number: every run is deterministic and results are kept in order.
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ExploreReportArgs {
    fn threads(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
            .max(1)
    }

    /// `--out`, else the report of the curve set chosen.
    fn out_path(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            PathBuf::from(if self.data.pollux_curves {
                "docs/exploratory-pollux.md"
            } else {
                "docs/exploratory.md"
            })
        })
    }
}

/// `run` on every item, `threads` at a time, the results in the items' order.
fn in_order<T: Sync, R: Send>(items: &[T], threads: usize, run: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let indexed: Vec<(usize, &T)> = items.iter().enumerate().collect();
    let mut done = crate::report::on_threads(&indexed, threads, |(i, t)| (*i, run(t)));
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// The policies of the report, in its order.
pub const REPORT_POLICIES: [&str; 7] = [
    "quality",
    "quality-loss",
    "quality-both",
    "quality-jct",
    "fair",
    "fifo",
    "tiresias",
];

fn policy(name: &str, cluster: &ExploreClusterArgs) -> anyhow::Result<Arc<dyn Policy>> {
    let objective = match name {
        "quality-loss" => Some(Objective::Loss),
        "quality-jct" => Some(Objective::Jct),
        "quality-both" => Some(Objective::Both),
        "quality" => Some(Objective::default()),
        _ => None,
    };
    let base = if objective.is_some() { "quality" } else { name };
    by_name(base, cluster.params(objective.unwrap_or_default()))
        .map(Arc::from)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

pub fn run_explore_workload(args: &ExploreWorkloadArgs) -> anyhow::Result<()> {
    let curves = args.data.curves(None)?;
    let philly = read_philly(&args.data.philly()?)?;
    let trials = generate(&philly, &curves, args.sweeps, args.hours, args.seed)?;
    write_trials(&args.out, &trials)?;
    println!(
        "{}: {} trials in {} sweeps",
        args.out.display(),
        trials.len(),
        args.sweeps
    );
    Ok(())
}

pub fn run_explore(args: &ExploreArgs) -> anyhow::Result<()> {
    let apps = load_all(&args.data.traces)?;
    let curves = args.data.curves(Some(&apps))?;
    let trials = read_trials(&args.workload)?;
    let cfg = args.cluster.config()?;
    let mut results = Vec::new();
    for name in &args.policies {
        let p = policy(name, &args.cluster)?;
        let mut r = args.cluster.simulate((&curves, &apps), &trials, p, &cfg)?;
        r.policy = name.clone();
        results.push(r);
    }
    let summaries: Vec<ExploreSummary> = results.iter().map(summarize).collect();
    print!("{}", policy_table(std::slice::from_ref(&summaries)));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Means over workloads of each policy's summaries (`runs[workload][policy]`).
fn policy_table(runs: &[Vec<ExploreSummary>]) -> String {
    let policies: Vec<&str> = runs[0].iter().map(|s| s.policy.as_str()).collect();
    let mean = |f: &dyn Fn(&ExploreSummary) -> Option<f64>, p: usize| {
        let v: Vec<f64> = runs.iter().filter_map(|w| f(&w[p])).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let fair = policies.iter().position(|&p| p == "fair");
    let mut t = Table::new(&[
        "policy",
        "average normalized loss",
        "vs fair",
        "time to 80 % (s)",
        "time to 90 % (s)",
        "vs fair",
        "time to 95 % (s)",
        "reached 90 %",
        "mean JCT (s)",
        "final normalized loss",
    ]);
    let fmt = |v: Option<f64>, d: usize| v.map_or("—".into(), |v| format!("{v:.d$}"));
    let change = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:+.1} %", (a / b - 1.0) * 100.0),
        _ => "—".into(),
    };
    for (i, name) in policies.iter().enumerate() {
        let loss = mean(&|s| Some(s.avg_normalized_loss), i);
        let t90 = mean(&|s| s.time_to[1].0, i);
        let fair_loss = fair.and_then(|f| mean(&|s| Some(s.avg_normalized_loss), f));
        let fair_t90 = fair.and_then(|f| mean(&|s| s.time_to[1].0, f));
        t.row(vec![
            format!("`{name}`"),
            fmt(loss, 3),
            change(loss, fair_loss),
            fmt(mean(&|s| s.time_to[0].0, i), 0),
            fmt(t90, 0),
            change(t90, fair_t90),
            fmt(mean(&|s| s.time_to[2].0, i), 0),
            fmt(mean(&|s| Some(s.time_to[1].1 * 100.0), i), 0) + " %",
            fmt(mean(&|s| Some(s.mean_jct), i), 0),
            fmt(mean(&|s| Some(s.mean_final_normalized), i), 3),
        ]);
    }
    t.render()
}

pub fn run_explore_report(args: &ExploreReportArgs) -> anyhow::Result<()> {
    let apps = load_all(&args.data.traces)?;
    let curves = args.data.curves(Some(&apps))?;
    let philly = read_philly(&args.data.philly()?)?;
    let cfg = args.cluster.config()?;
    let to_end = ExploreConfig {
        stop: None,
        ..cfg.clone()
    };
    // The report's workloads, one per seed, generated once.
    let workloads = args
        .seeds
        .iter()
        .map(|&seed| generate(&philly, &curves, args.sweeps, args.hours, seed))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let threads = args.threads();
    // Every (workload, policy) run, then each workload's fair run to the end (None).
    let main_runs: Vec<(usize, Option<&str>)> = (0..workloads.len())
        .flat_map(|w| {
            REPORT_POLICIES
                .iter()
                .map(move |&name| (w, Some(name)))
                .chain([(w, None)])
        })
        .collect();
    let mut done = in_order(&main_runs, threads, |&(w, name)| {
        let (trials, seed) = (&workloads[w], args.seeds[w]);
        let s = match name {
            Some(name) => run_one(name, trials, &cfg, (&curves, &apps, args)),
            None => run_one("fair", trials, &to_end, (&curves, &apps, args)).map(|mut s| {
                s.policy = "fair, every trial to its end".into();
                s
            }),
        };
        eprintln!(
            "seed {seed}: {}: {} trials",
            name.unwrap_or("fair to the end"),
            trials.len()
        );
        s
    })
    .into_iter();
    let mut runs: Vec<Vec<ExploreSummary>> = Vec::new();
    let mut baseline: Vec<ExploreSummary> = Vec::new();
    for _ in &workloads {
        runs.push(
            done.by_ref()
                .take(REPORT_POLICIES.len())
                .collect::<anyhow::Result<_>>()?,
        );
        baseline.push(done.next().expect("one run to the end per workload")?);
    }
    // Sensitivity: the default quality policy against fair at other loads and stop rules; the runs of the
    // tables above are reused where the settings are theirs.
    let column = |name: &str| REPORT_POLICIES.iter().position(|p| *p == name);
    let (quality, fair) = (column("quality"), column("fair"));
    let mut sensitivity = Table::new(&[
        "sweeps in 2 h (load)",
        "stop rule",
        "`quality` avg normalized loss",
        "`fair`",
        "change",
        "time to 90 %: `quality`",
        "`fair`",
        "change",
    ]);
    for &sweeps in &args.sensitivity_sweeps {
        let workloads = args
            .seeds
            .iter()
            .map(|&seed| generate(&philly, &curves, sweeps, args.hours, seed))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let work: f64 = workloads.iter().flatten().map(|t| t.work_s).sum();
        let load = work
            / (f64::from(cfg.nodes * cfg.gpus_per_node) * args.hours * 3600.0)
            / workloads.len().max(1) as f64;
        let mut rules: Vec<Option<f64>> =
            args.sensitivity_plateau.iter().copied().map(Some).collect();
        rules.push(None);
        for rule in rules {
            let c = ExploreConfig {
                stop: rule.map(|r| StopSpec {
                    plateau: Some(PlateauSpec {
                        min_improvement: r,
                        window_epochs: args.cluster.plateau_window,
                    }),
                    ..StopSpec::default()
                }),
                ..cfg.clone()
            };
            let main = sweeps == args.sweeps && c.stop == cfg.stop;
            let pairs: Vec<[ExploreSummary; 2]> = match (main, quality, fair) {
                (true, Some(q), Some(f)) => (0..workloads.len())
                    .map(|w| [runs[w][q].clone(), runs[w][f].clone()])
                    .collect(),
                _ => {
                    let each: Vec<(usize, &str)> = (0..workloads.len())
                        .flat_map(|w| [(w, "quality"), (w, "fair")])
                        .collect();
                    let mut done = in_order(&each, threads, |&(w, name)| {
                        run_one(name, &workloads[w], &c, (&curves, &apps, args))
                    })
                    .into_iter();
                    let mut pairs = Vec::new();
                    while let (Some(q), Some(f)) = (done.next(), done.next()) {
                        pairs.push([q?, f?]);
                    }
                    pairs
                }
            };
            let mean = |k: usize, f: fn(&ExploreSummary) -> f64| {
                pairs.iter().map(|p| f(&p[k])).sum::<f64>() / pairs.len().max(1) as f64
            };
            let loss = |s: &ExploreSummary| s.avg_normalized_loss;
            let t90 = |s: &ExploreSummary| s.time_to[1].0.unwrap_or(0.0);
            let pct = |a: f64, b: f64| format!("{:+.1} %", (a / b - 1.0) * 100.0);
            sensitivity.row(vec![
                format!("{sweeps} ({load:.2})"),
                rule.map_or("none (every trial to its end)".into(), |r| {
                    format!("plateau below {} % per epoch", r * 100.0)
                }),
                format!("{:.3}", mean(0, loss)),
                format!("{:.3}", mean(1, loss)),
                pct(mean(0, loss), mean(1, loss)),
                format!("{:.0}", mean(0, t90)),
                format!("{:.0}", mean(1, t90)),
                pct(mean(0, t90), mean(1, t90)),
            ]);
            eprintln!("sensitivity: {sweeps} sweeps, rule {rule:?} done");
        }
    }
    // The other loop on the same workloads, for the policies SLAQ's comparison is about.
    let other = ExploreReportArgs {
        cluster: ExploreClusterArgs {
            sim_loop: args.cluster.sim_loop.other(),
            ..args.cluster.clone()
        },
        ..args.clone()
    };
    let mut loops = Vec::new();
    for name in LOOP_POLICIES {
        let i = column(name).expect("a report policy");
        let others = in_order(&workloads, threads, |trials| {
            run_one(name, trials, &cfg, (&curves, &apps, &other))
        });
        let mut pairs = Vec::new();
        for (w, s) in others.into_iter().enumerate() {
            pairs.push([runs[w][i].clone(), s?]);
        }
        eprintln!("loops: {name} done");
        loops.push((name, pairs));
    }
    // Each early-stopping rule under quality and fair, in the service loop; the runs above
    // are reused where they are the same.
    let service = ExploreReportArgs {
        cluster: ExploreClusterArgs {
            sim_loop: SimLoop::Service,
            ..args.cluster.clone()
        },
        ..args.clone()
    };
    let same_loop = args.cluster.sim_loop == SimLoop::Service;
    let mut early: Vec<(&str, Vec<Row>)> = Vec::new();
    for (title, stop) in [
        ("With the plateau rule", cfg.stop),
        ("Without stop criteria (SLAQ's setting)", None),
    ] {
        let mut rows = Vec::new();
        for &rule in &args.early_stop_rules {
            for name in EARLY_STOP_POLICIES {
                let i = column(name).expect("a report policy");
                let c = ExploreConfig {
                    stop,
                    early_stop: (rule != EarlyStopRule::None).then_some(EarlyStopSpec {
                        rule,
                        keep: args.cluster.early_stop_keep,
                        band: args.cluster.early_stop_band,
                        min_epochs: args.cluster.early_stop_min_epochs,
                    }),
                    ..cfg.clone()
                };
                let none = rule == EarlyStopRule::None && same_loop;
                let indices: Vec<usize> = (0..workloads.len()).collect();
                let per_workload = in_order(&indices, threads, |&w| {
                    Ok(match (none, stop.is_some(), name) {
                        (true, true, _) => runs[w][i].clone(),
                        (true, false, "fair") => {
                            let mut s = baseline[w].clone();
                            s.policy = name.to_string();
                            s
                        }
                        _ => run_one(name, &workloads[w], &c, (&curves, &apps, &service))?,
                    })
                })
                .into_iter()
                .collect::<anyhow::Result<Vec<_>>>()?;
                eprintln!("early stopping: {title}: {name}, {} done", rule.as_str());
                rows.push((format!("`{name}`, {}", rule.as_str()), per_workload));
            }
        }
        early.push((title, rows));
    }
    let pollux = curves
        .keys()
        .filter(|k| k.starts_with(crate::explore::POLLUX_CURVE_PREFIX))
        .count();
    let mut text = render(args, &runs, &baseline, (curves.len() - pollux, pollux));
    text.push_str(&early_stop_section(args, &early, &baseline));
    text.push_str(&loop_table(args.cluster.sim_loop, &loops));
    let _ = writeln!(
        text,
        "\n## Sensitivity: load and stop rule, `quality` (the default) against `fair`\n\n\
         Same seeds; load is the workload's single-GPU work divided by the cluster's GPU time \
         over the arrival window (mean over seeds). Without stop criteria every trial runs \
         its whole recorded curve (SLAQ's own setting: jobs run to completion).\n"
    );
    text.push_str(&sensitivity.render());
    let out = args.out_path();
    std::fs::write(&out, text).with_context(|| format!("cannot write {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// One policy (report name) on one workload, summarized.
fn run_one(
    name: &str,
    trials: &[ExploreTrial],
    cfg: &ExploreConfig,
    (curves, apps, args): (
        &BTreeMap<String, RecordedCurve>,
        &BTreeMap<String, crate::apps::Application>,
        &ExploreReportArgs,
    ),
) -> anyhow::Result<ExploreSummary> {
    let p = policy(name, &args.cluster)?;
    let mut r = args.cluster.simulate((curves, apps), trials, p, cfg)?;
    r.policy = name.to_string();
    Ok(summarize(&r))
}

/// Per row (a label and one summary per workload), over all sweeps of all workloads:
/// GPU-hours against the fair run-to-end baseline, split between the trials the sweep's
/// rule stopped early and the others (each against the same trials' runs to the end), and
/// how far the best trial's held-out loss (training loss where the curves have none) is
/// from the run-to-end best.
fn sweep_table(rows: &[(String, Vec<ExploreSummary>)], baseline: &[ExploreSummary]) -> String {
    let mut t = Table::new(&[
        "policy",
        "GPU-hours per sweep",
        "vs every trial to its end (fair)",
        "best held-out loss vs to-the-end best (mean)",
        "sweeps within 1 % (held-out)",
        "worst gap (held-out)",
        "sweeps within 1 % (training loss)",
        "early-stopped trials: GPU-hours vs their runs to the end",
        "other trials: GPU-hours vs their runs to the end",
    ]);
    let base_hours: f64 = baseline
        .iter()
        .flat_map(|b| b.sweeps.values().map(|v| v.gpu_hours))
        .sum::<f64>();
    let sweeps = baseline
        .iter()
        .map(|b| b.sweeps.len())
        .sum::<usize>()
        .max(1) as f64;
    let gap = |got: f64, best: f64| if best > 0.0 { got / best - 1.0 } else { 0.0 };
    let share = |gaps: &[f64]| {
        gaps.iter().filter(|g| **g <= 0.01).count() as f64 / gaps.len().max(1) as f64 * 100.0
    };
    for (label, per_workload) in rows {
        let mut hours = 0.0;
        // [early stopped, others]: (GPU-hours here, the same trials' to the end).
        let mut split = [(0.0, 0.0); 2];
        let (mut held_out, mut training) = (Vec::new(), Vec::new());
        for (w, b) in per_workload.iter().zip(baseline) {
            // The same workload: every trial is in the baseline (one missing would count
            // on neither side).
            for (name, got) in &w.trials {
                if let Some(to_end) = b.trials.get(name) {
                    let s = &mut split[usize::from(!got.early_stopped)];
                    s.0 += got.gpu_hours;
                    s.1 += to_end.gpu_hours;
                }
            }
            for (sweep, got) in &w.sweeps {
                hours += got.gpu_hours;
                let base = b.sweeps[sweep];
                training.push(gap(got.best_loss, base.best_loss));
                held_out.push(match (got.best_eval, base.best_eval) {
                    (Some(g), Some(b)) => gap(g, b),
                    _ => gap(got.best_loss, base.best_loss),
                });
            }
        }
        let worst = held_out.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        t.row(vec![
            label.clone(),
            format!("{:.3}", hours / sweeps),
            format!("{:.2}×", hours / base_hours.max(1e-12)),
            format!(
                "{:+.2} %",
                held_out.iter().sum::<f64>() / held_out.len().max(1) as f64 * 100.0
            ),
            format!("{:.0} %", share(&held_out)),
            format!("{:+.1} %", worst * 100.0),
            format!("{:.0} %", share(&training)),
            ratio(split[0]),
            ratio(split[1]),
        ]);
    }
    t.row(vec![
        "`fair`, every trial to its end".into(),
        format!("{:.3}", base_hours / sweeps),
        "1.00×".into(),
        "0 %".into(),
        "100 %".into(),
        "0 %".into(),
        "100 %".into(),
        "—".into(),
        "1.00×".into(),
    ]);
    t.render()
}

/// `got / to_end` as `0.21×`, `—` without trials (`to_end` 0).
fn ratio((got, to_end): (f64, f64)) -> String {
    if to_end > 0.0 {
        format!("{:.2}×", got / to_end)
    } else {
        "—".into()
    }
}

/// `runs[workload][policy]` as rows of [`sweep_table`], one per policy.
fn by_policy(runs: &[Vec<ExploreSummary>]) -> Vec<(String, Vec<ExploreSummary>)> {
    (0..runs[0].len())
        .map(|i| {
            (
                format!("`{}`", runs[0][i].policy),
                runs.iter().map(|w| w[i].clone()).collect(),
            )
        })
        .collect()
}

fn ends_table(runs: &[Vec<ExploreSummary>]) -> String {
    let policies: Vec<&str> = runs[0].iter().map(|s| s.policy.as_str()).collect();
    let reasons: std::collections::BTreeSet<&String> =
        runs.iter().flatten().flat_map(|s| s.ends.keys()).collect();
    let mut header = vec!["policy".to_string()];
    header.extend(reasons.iter().map(|r| (*r).clone()));
    let refs: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new(&refs);
    for (i, name) in policies.iter().enumerate() {
        let mut row = vec![format!("`{name}`")];
        for r in &reasons {
            let n: usize = runs
                .iter()
                .map(|w| w[i].ends.get(r.as_str()).copied().unwrap_or(0))
                .sum();
            row.push(n.to_string());
        }
        t.row(row);
    }
    t.render()
}

/// The policies the report also runs in the other loop.
pub const LOOP_POLICIES: [&str; 3] = ["quality", "quality-both", "fair"];

/// A row of [`sweep_table`]: its label and one summary per workload.
type Row = (String, Vec<ExploreSummary>);

/// The policies the report runs under each early-stopping rule.
pub const EARLY_STOP_POLICIES: [&str; 2] = ["quality", "fair"];

/// The "Sweep early stopping" section: per rule and policy, the sweep table and SLAQ's
/// measures.
fn early_stop_section(
    args: &ExploreReportArgs,
    settings: &[(&str, Vec<Row>)],
    baseline: &[ExploreSummary],
) -> String {
    let mut out = String::new();
    if settings.iter().all(|(_, rows)| rows.is_empty()) {
        return out;
    }
    let _ = writeln!(
        out,
        "\n## Sweep early stopping\n\n\
         The same workloads in the service loop, each sweep with an early-stopping rule \
         (`[sweep] early_stop`, applied by the allocator's step across the sweep's trials: \
         `sched/src/sweep_stop.rs`, docs/scheduling.md \"Sweep early stopping\"): `predicted` \
         (the default for sweeps; keep {}, band {} % per doubling of the samples ahead, each \
         trial's held-out loss predicted by its own fitted held-out curve), `asha` (reduction \
         factor 3, rungs at 1, 3, 9 … epochs; the same `keep`) and `none`. Trials \
         are ranked by held-out loss (every recorded run reports it). Columns as in \"Sweeps\" above; the second table of each setting \
         gives SLAQ's measures of the same runs (means over workloads; \"early stopped\": the \
         trials the rule ended, of all trials).\n",
        args.cluster.early_stop_keep,
        args.cluster.early_stop_band * 100.0
    );
    for (title, rows) in settings {
        let _ = writeln!(out, "### {title}\n");
        out.push_str(&sweep_table(rows, baseline));
        out.push('\n');
        out.push_str(&early_measures(rows));
        out.push('\n');
    }
    out
}

/// SLAQ's measures and the early-stopped share of each row's runs.
fn early_measures(rows: &[(String, Vec<ExploreSummary>)]) -> String {
    let mut t = Table::new(&[
        "policy, rule",
        "average normalized loss",
        "time to 90 % (s)",
        "mean JCT (s)",
        "early stopped",
        "restarts per trial",
    ]);
    for (label, runs) in rows {
        let mean = |f: &dyn Fn(&ExploreSummary) -> f64| {
            runs.iter().map(f).sum::<f64>() / runs.len().max(1) as f64
        };
        let trials: usize = runs.iter().map(|s| s.ends.values().sum::<usize>()).sum();
        let stopped: usize = runs
            .iter()
            .filter_map(|s| s.ends.get(EndReason::EarlyStopped.as_str()))
            .sum();
        t.row(vec![
            label.clone(),
            format!("{:.3}", mean(&|s| s.avg_normalized_loss)),
            format!("{:.0}", mean(&|s| s.time_to[1].0.unwrap_or(0.0))),
            format!("{:.0}", mean(&|s| s.mean_jct)),
            format!("{:.0} %", stopped as f64 / trials.max(1) as f64 * 100.0),
            format!("{:.2}", mean(&|s| s.restarts_per_trial)),
        ]);
    }
    t.render()
}

/// Each of [`LOOP_POLICIES`] in the report's loop (`this`) and the other, on the same
/// workloads: `(policy, [this, other] per workload)`.
fn loop_table(this: SimLoop, loops: &[(&str, Vec<[ExploreSummary; 2]>)]) -> String {
    let (a, b) = (this.name(), this.other().name());
    let mut out = format!(
        "\n## The {a} loop against the {b} loop\n\n\
         The same workloads in both loops of the simulator (`--loop`). In the decision loop \
         the simulator builds each trial's job view itself, gives the policy the exact \
         restart delay and applies the stop rule itself; in the service loop the \
         allocator's own scheduling step runs the trials through host plans, heartbeats and \
         progress reports: it fits curves and step times from the reports, measures the \
         restart cost, fences generations and ends trials by their stop rule or their \
         program's exit (`sim/src/sweep_world.rs`).\n\n"
    );
    let h = [
        "policy".to_string(),
        format!("avg normalized loss, {a}"),
        b.to_string(),
        format!("time to 90 % (s), {a}"),
        b.to_string(),
        format!("mean JCT (s), {a}"),
        b.to_string(),
        format!("restarts per trial, {a}"),
        b.to_string(),
    ];
    let refs: Vec<&str> = h.iter().map(String::as_str).collect();
    let mut t = Table::new(&refs);
    for (name, pairs) in loops {
        let mean = |k: usize, f: &dyn Fn(&ExploreSummary) -> f64| {
            pairs.iter().map(|p| f(&p[k])).sum::<f64>() / pairs.len().max(1) as f64
        };
        let loss = |s: &ExploreSummary| s.avg_normalized_loss;
        let t90 = |s: &ExploreSummary| s.time_to[1].0.unwrap_or(0.0);
        let jct = |s: &ExploreSummary| s.mean_jct;
        let restarts = |s: &ExploreSummary| s.restarts_per_trial;
        t.row(vec![
            format!("`{name}`"),
            format!("{:.3}", mean(0, &loss)),
            format!("{:.3}", mean(1, &loss)),
            format!("{:.0}", mean(0, &t90)),
            format!("{:.0}", mean(1, &t90)),
            format!("{:.0}", mean(0, &jct)),
            format!("{:.0}", mean(1, &jct)),
            format!("{:.2}", mean(0, &restarts)),
            format!("{:.2}", mean(1, &restarts)),
        ]);
    }
    out.push_str(&t.render());
    out
}

fn render(
    args: &ExploreReportArgs,
    runs: &[Vec<ExploreSummary>],
    baseline: &[ExploreSummary],
    (curves, pollux): (usize, usize),
) -> String {
    let mut s = String::new();
    let seeds: Vec<String> = args.seeds.iter().map(u64::to_string).collect();
    let _ = writeln!(
        s,
        "# Exploratory jobs: SLAQ's measures on sweeps of short trials{}\n\n\
         Generated by `converge-sim explore-report --seeds {} --loop {}{}` (`--sweeps {} --hours {}`, {} nodes × {} GPUs, \
         decisions every {} s, {} s per restart, plateau rule: below {} % per epoch over {} epochs). \
         Do not edit by hand.\n",
        if args.data.pollux_curves {
            ", with the Pollux applications' batch-size sweeps"
        } else {
            ""
        },
        seeds.join(","),
        args.cluster.sim_loop.name(),
        if args.data.pollux_curves {
            " --pollux-curves"
        } else {
            ""
        },
        args.sweeps,
        args.hours,
        args.cluster.nodes,
        args.cluster.gpus_per_node,
        args.cluster.scheduling_interval,
        args.cluster.restart_delay,
        args.cluster.plateau_improvement * 100.0,
        args.cluster.plateau_window,
    );
    let _ = writeln!(
        s,
        "Each workload: {} sweeps arriving as a Poisson process, each one model × dataset pair \
         with one trial per recorded run of `data/curves/sweep` ({curves} real `converge-trainer` \
         runs: 3 learning rates × 2 batch sizes per pair){}, sized by a Philly trace job (GPUs \
         requested; GPU time scaled from hours to minutes), with the measured step times of a \
         Pollux application. Every trial carries the same `[stop]` plateau rule, decided by \
         `converge-sched`'s `stop` module on its fitted curve, as the service does; a trial \
         also ends when it reaches the end of its recorded run, and declares that run's samples \
         as its work (`work_samples`: where the sweep's early stopping expects it to end). See \
         `sim/src/explore.rs` for \
         the model and docs/scheduling.md \"Stop criteria\" for the rule. {}\n",
        args.sweeps,
        if pollux > 0 {
            format!(
                " or of a Pollux application's measured validation runs (`--pollux-curves`: \
                 {pollux} runs, one per batch size, of cifar10, deepspeech2, imagenet, ncf and \
                 yolov3, valued by the held-out metric as a loss; pairs are drawn uniformly, \
                 Pollux applications among them)"
            )
        } else {
            String::new()
        },
        match args.cluster.sim_loop {
            SimLoop::Service =>
                "Every run goes through the service loop: the allocator's own \
                scheduling step decides, measures step times and restart costs from the \
                trials' progress reports and ends trials by their stop rule \
                (`sim/src/sweep_world.rs`; the last section compares the decision loop).",
            SimLoop::Decision =>
                "Every run goes through the decision loop: the simulator \
                builds the job views and applies the stop rule itself (the last section \
                compares the service loop).",
        }
    );
    let _ = writeln!(
        s,
        "## SLAQ's measures, mean over {} workloads\n\n\
         Average normalized loss: the mean over time of the mean normalized loss of the \
         trials submitted and not yet ended (1 = where a trial started, 0 = the lowest loss \
         its whole run reaches). Time to 80/90/95 %: seconds from submission until a trial's \
         normalized loss first falls to 0.2/0.1/0.05, mean over the trials that got there \
         (\"reached 90 %\": their share; a trial ended earlier by its plateau rule never \
         gets there). Final normalized loss: where trials ended.\n",
        runs.len()
    );
    s.push_str(&policy_table(runs));
    let _ = writeln!(
        s,
        "\n## Sweeps: GPU-hours to find the best trial\n\n\
         Per sweep, the GPU-hours all its trials held (restarts included) and the held-out \
         loss of its best trial (the lowest held-out loss any trial ended at: the trial a user \
         picks), against running every trial to the end of its run under `fair` (no stop \
         criteria); the column after the gaps judges by the true (smoothed) training loss \
         instead. Held-out loss can rise late in a run (overfitting), so a trial ended early \
         can beat its own run to the end (a negative gap). The last two columns split the \
         GPU-hours between the trials the sweep's rule stopped early and all the others \
         (those its program or its own plateau rule ended), each against the same trials \
         run to the end: the first says how early the rule stops; without stop criteria the \
         second says what the trials left cost (under a policy that grows them they may \
         take the GPUs the stopped ones free, and restart to do so), with a plateau rule it \
         also holds what that rule saves. \
         Target: at most half the GPU-hours with the best trial within 1 % in 95 % of \
         sweeps. No early stopping here (the second column is the total): see \"Sweep early \
         stopping\" below.\n"
    );
    s.push_str(&sweep_table(&by_policy(runs), baseline));
    let _ = writeln!(s, "\n## How trials ended (all workloads)\n");
    s.push_str(&ends_table(runs));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explore::{SweepSummary, TrialHours};

    /// A run of one sweep whose trials held `hours`, the named ones early-stopped.
    fn run(hours: &[(&str, f64, bool)]) -> ExploreSummary {
        let total: f64 = hours.iter().map(|h| h.1).sum();
        ExploreSummary {
            policy: "p".into(),
            avg_normalized_loss: 0.0,
            time_to: [(None, 0.0); 3],
            mean_jct: 0.0,
            mean_final_normalized: 0.0,
            sweeps: BTreeMap::from([(
                "s".to_string(),
                SweepSummary {
                    gpu_hours: total,
                    best_loss: 1.0,
                    best_eval: Some(1.0),
                },
            )]),
            trials: hours
                .iter()
                .map(|&(name, gpu_hours, early_stopped)| {
                    (
                        name.to_string(),
                        TrialHours {
                            gpu_hours,
                            early_stopped,
                        },
                    )
                })
                .collect(),
            ends: BTreeMap::new(),
            makespan_s: 0.0,
            restarts_per_trial: 0.0,
        }
    }

    /// The split columns compare each group of trials with the same trials run to the end:
    /// two stopped trials that held 1 of their 4 GPU-hours, and two others that held 3
    /// where they held 2 to the end.
    #[test]
    fn the_sweep_table_splits_gpu_hours_between_stopped_and_other_trials() {
        let to_end = run(&[
            ("a", 2.0, false),
            ("b", 2.0, false),
            ("c", 1.0, false),
            ("d", 1.0, false),
        ]);
        let got = run(&[
            ("a", 0.5, true),
            ("b", 0.5, true),
            ("c", 1.5, false),
            ("d", 1.5, false),
        ]);
        let table = sweep_table(&[("`x`".into(), vec![got])], std::slice::from_ref(&to_end));
        let row = table
            .lines()
            .find(|l| l.starts_with("| `x`"))
            .expect("a row");
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // policy, hours, vs, gap, within, worst, within (training), stopped, others
        assert_eq!(cells[2], "4.000");
        assert_eq!(cells[3], "0.67×");
        assert_eq!(cells[8], "0.25×");
        assert_eq!(cells[9], "1.50×");
        // Without early stopping the first group is empty.
        let table = sweep_table(&[("`y`".into(), vec![to_end.clone()])], &[to_end]);
        let row = table
            .lines()
            .find(|l| l.starts_with("| `y`"))
            .expect("a row");
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!((cells[8], cells[9]), ("—", "1.00×"));
    }
}
