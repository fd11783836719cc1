//! Production jobs and sweeps on one cluster (`converge-sim mixed-workload`): a Pollux
//! workload's jobs ([`crate::world::TraceWorld`]) and a stream of sweeps
//! ([`crate::sweep_world::SweepWorld`]) run together under the allocator's own scheduling
//! step ([`crate::world::run`]), one [`World`] made of the two. Each world keeps its own
//! physics; the hosts' heartbeats carry the workers of both.
//!
//! The question it answers (issue "sweeps … and a default policy that wins SLAQ's metric
//! without being told"): does a sweep stream cost the production jobs, and what do the
//! sweeps get? Reported per policy: the production jobs' mean JCT alone and with the sweeps,
//! and the sweeps' SLAQ measures and GPU-hours.

use crate::apps::Application;
use crate::cli::{ClusterArgs, QualityArgs};
use crate::engine::SimConfig;
use crate::explore::{
    ExploreConfig, ExploreResult, ExploreTrial, RecordedCurve, generate, summarize,
};
use crate::explore_report::serde_name;
use crate::markdown::Table;
use crate::summary::summarize as summarize_jobs;
use crate::sweep_world::SweepWorld;
use crate::workload::{WorkloadJob, read_philly, read_workload};
use crate::world::{Observed, TraceWorld, World, run_under};
use anyhow::Context as _;
use converge_common::{EarlyStopRule, EarlyStopSpec, EndReason, PriorityClass};
use converge_sched::policies::{Policy, by_name};
use converge_sched::schedule::Outcome;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// A Pollux workload and a sweep stream on one cluster.
pub struct MixedWorld<'a> {
    pub(crate) trace: TraceWorld<'a>,
    pub(crate) sweeps: SweepWorld<'a>,
}

impl World for MixedWorld<'_> {
    fn advance(&mut self, now: f64, seconds: f64) {
        self.trace.advance(now, seconds);
        self.sweeps.advance(now, seconds);
    }

    fn observe(&mut self, now: f64, into: &mut Observed) {
        let mut jobs = Observed::default();
        self.trace.observe(now, &mut jobs);
        let mut trials = Observed::default();
        self.sweeps.observe(now, &mut trials);
        // One heartbeat per host, with the workers of both worlds.
        let mut extra: BTreeMap<_, Vec<_>> = BTreeMap::new();
        for t in trials.hosts {
            extra.entry(t.host).or_default().extend(t.workers);
        }
        for mut t in jobs.hosts {
            if let Some(w) = extra.remove(&t.host) {
                t.workers.extend(w);
            }
            into.hosts.push(t);
        }
        // `simulate_mixed` refuses a sweep cluster larger than the trace's, so every host
        // of the sweep world is one of the trace world's.
        debug_assert!(
            extra.is_empty(),
            "hosts only the sweep world has: {extra:?}"
        );
        into.specs.extend(jobs.specs);
        into.specs.extend(trials.specs);
        into.reports.extend(jobs.reports);
        into.reports.extend(trials.reports);
    }

    fn apply(&mut self, now: f64, outcome: &Outcome) {
        self.trace.apply(now, outcome);
        self.sweeps.apply(now, outcome);
    }

    fn finished(&self) -> bool {
        self.trace.finished() && self.sweeps.finished()
    }
}

/// What one mixed run produced.
pub struct MixedResult {
    /// The production jobs.
    pub jobs: crate::engine::SimResult,
    /// The sweeps' trials.
    pub sweeps: ExploreResult,
}

/// Runs `workload` and `trials` together under `policy` on `cfg`'s cluster (the trials'
/// physics from `explore`: their restart delay, report period, stop rules and early
/// stopping). Deterministic (decision times aside).
///
/// # Errors
/// As [`TraceWorld::new`] and [`SweepWorld::new`]; a sweep cluster larger than the trace
/// cluster.
#[allow(clippy::too_many_arguments)]
pub fn simulate_mixed(
    apps: &BTreeMap<String, Application>,
    workload: &[WorkloadJob],
    cfg: &SimConfig,
    curves: &BTreeMap<String, RecordedCurve>,
    trials: &[ExploreTrial],
    explore: &ExploreConfig,
    policy: Arc<dyn Policy>,
) -> anyhow::Result<MixedResult> {
    let started = Instant::now();
    let trace = TraceWorld::new(apps, workload, cfg, policy.inputs().goodput)?;
    anyhow::ensure!(
        explore.nodes <= trace.nodes() as u32,
        "the sweeps' cluster ({} nodes) is larger than the trace's ({})",
        explore.nodes,
        trace.nodes()
    );
    let sweeps = SweepWorld::new(curves, apps, trials, explore)?;
    let mut world = MixedWorld { trace, sweeps };
    let name = policy.name().to_string();
    let max_decision_s = run_under(
        &mut world,
        policy,
        cfg.placement,
        cfg.scheduling_interval_s,
        cfg.max_time_s,
    );
    let wall = started.elapsed().as_secs_f64();
    let MixedWorld { trace, sweeps } = world;
    Ok(MixedResult {
        jobs: trace.result(&name, Vec::new(), started),
        sweeps: sweeps.result(name.clone(), wall, max_decision_s),
    })
}

/// `converge-sim mixed-workload`.
#[derive(Debug, Clone, clap::Args)]
pub struct MixedWorkloadArgs {
    /// Pollux-format workload file(s) of production jobs; each is run alone and with its
    /// own sweep stream (generated with seed `--seed` + the file's position).
    #[arg(long, required = true, num_args = 1..)]
    pub workload: Vec<PathBuf>,
    /// Policies (the `quality` default objective, `auto`, and e.g. `fair`).
    #[arg(long, value_delimiter = ',', default_value = "quality,fair")]
    pub policies: Vec<String>,
    /// Sweeps arriving over `--hours` (Poisson), each a model × dataset pair of
    /// `--curves` with one trial per recorded run, sized by a Philly trace job.
    #[arg(long, default_value_t = 100)]
    pub sweeps: usize,
    #[arg(long, default_value_t = 8.0)]
    pub hours: f64,
    /// Recorded loss curves of the trials.
    #[arg(long, default_value = "data/curves/sweep")]
    pub curves: PathBuf,
    /// Also draw sweeps from the Pollux applications' measured validation runs (as
    /// `explore-workload --pollux-curves`).
    #[arg(long)]
    pub pollux_curves: bool,
    /// The sweeps' early stopping (`[sweep] early_stop`; `predicted` is what a sweep file
    /// gets by default).
    #[arg(long, value_parser = serde_name::<EarlyStopRule>, default_value = "predicted")]
    pub early_stop: EarlyStopRule,
    /// The trials' priority class (`low`: production jobs preempt them; `normal`, the
    /// default of a job spec, competes with production jobs on value alone).
    #[arg(long, value_parser = serde_name::<PriorityClass>, default_value = "normal")]
    pub sweep_priority: PriorityClass,
    /// Run the trials without their plateau rule (to the end of their runs unless early
    /// stopping ends them).
    #[arg(long)]
    pub no_stop: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub quality: QualityArgs,
    /// Also write the Markdown tables here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One policy's figures over the workloads.
struct Row {
    policy: String,
    alone: f64,
    mixed: f64,
    finished: bool,
    avg_normalized_loss: f64,
    time_to_90: f64,
    gpu_hours_per_sweep: f64,
    early_stopped: f64,
    sweep_jct: f64,
}

pub fn run_mixed_workload(args: &MixedWorkloadArgs) -> anyhow::Result<()> {
    let mut cfg = args.cluster.config()?;
    // Both worlds need the service's own step.
    cfg.sim_loop = crate::engine::SimLoop::Service;
    anyhow::ensure!(
        args.cluster.cluster.is_none(),
        "mixed-workload runs one GPU type (--nodes, --gpus-per-node)"
    );
    let apps = args.cluster.applications()?;
    let curves = crate::explore::curve_set(&args.curves, args.pollux_curves.then_some(&apps))?;
    let philly_path = crate::apps::find_in(&args.cluster.traces, "philly.csv")
        .context("no philly.csv in --traces")?;
    let philly = read_philly(&philly_path)?;
    let explore = ExploreConfig {
        nodes: args.cluster.nodes,
        gpus_per_node: args.cluster.gpus_per_node,
        scheduling_interval_s: cfg.scheduling_interval_s,
        restart_delay_s: cfg.restart_delay_s,
        stop: (!args.no_stop).then(crate::explore::default_stop),
        early_stop: (args.early_stop != EarlyStopRule::None).then(|| EarlyStopSpec {
            rule: args.early_stop,
            ..EarlyStopSpec::default()
        }),
        max_time_s: cfg.max_time_s,
        priority: args.sweep_priority,
        ..ExploreConfig::default()
    };
    let params = args.quality.params(&args.cluster);
    let mut rows = Vec::new();
    for name in &args.policies {
        let policy: Arc<dyn Policy> = by_name(name, params)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .into();
        let (mut alone, mut mixed) = (Vec::new(), Vec::new());
        let mut sweep_runs = Vec::new();
        for (w, path) in args.workload.iter().enumerate() {
            let jobs = read_workload(path)?;
            let label = path.display().to_string();
            let trials = generate(
                &philly,
                &curves,
                args.sweeps,
                args.hours,
                args.cluster.seed + w as u64,
            )?;
            let a = crate::world::simulate_service(&apps, &jobs, policy.clone(), &cfg)?;
            alone.push((label.clone(), a));
            let m = simulate_mixed(
                &apps,
                &jobs,
                &cfg,
                &curves,
                &trials,
                &explore,
                policy.clone(),
            )?;
            eprintln!(
                "{name}: {label}: alone and with {} sweeps done ({:.0} s)",
                args.sweeps, m.sweeps.wall_s
            );
            mixed.push((label, m.jobs));
            sweep_runs.push(summarize(&m.sweeps));
        }
        let (a, m) = (summarize_jobs(name, &alone), summarize_jobs(name, &mixed));
        let n = sweep_runs.len().max(1) as f64;
        let mean = |f: &dyn Fn(&crate::explore::ExploreSummary) -> f64| {
            sweep_runs.iter().map(f).sum::<f64>() / n
        };
        rows.push(Row {
            policy: name.clone(),
            alone: a.mean,
            mixed: m.mean,
            finished: a.finished && m.finished,
            avg_normalized_loss: mean(&|s| s.avg_normalized_loss),
            time_to_90: mean(&|s| s.time_to[1].0.unwrap_or(0.0)),
            gpu_hours_per_sweep: mean(&|s| {
                s.sweeps.values().map(|v| v.gpu_hours).sum::<f64>() / s.sweeps.len().max(1) as f64
            }),
            early_stopped: mean(&|s| {
                let all: usize = s.ends.values().sum();
                s.ends
                    .get(EndReason::EarlyStopped.as_str())
                    .copied()
                    .unwrap_or(0) as f64
                    / all.max(1) as f64
            }),
            sweep_jct: mean(&|s| s.mean_jct),
        });
    }
    let text = render(args, &rows);
    print!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

fn render(args: &MixedWorkloadArgs, rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Production jobs of {} workload(s) on {} nodes × {} GPUs, alone and with {} sweeps \
         arriving over {} h{} (early stopping `{}`, {}, priority `{}`), service loop, decisions \
         every {} s.\n",
        args.workload.len(),
        args.cluster.nodes,
        args.cluster.gpus_per_node,
        args.sweeps,
        args.hours,
        if args.pollux_curves {
            ", drawn from the trainer's and the Pollux applications' curves"
        } else {
            ""
        },
        args.early_stop.as_str(),
        if args.no_stop {
            "no plateau rule"
        } else {
            "plateau rule below 1 % per epoch over 2 epochs"
        },
        args.sweep_priority.as_str(),
        args.cluster.scheduling_interval,
    );
    let mut t = Table::new(&[
        "policy",
        "production mean JCT alone (s)",
        "with the sweeps (s)",
        "change",
        "sweeps: avg normalized loss",
        "time to 90 % (s)",
        "trial mean JCT (s)",
        "GPU-hours per sweep",
        "early stopped",
    ]);
    for r in rows {
        t.row(vec![
            format!(
                "`{}`{}",
                r.policy,
                if r.finished { "" } else { " (unfinished)" }
            ),
            format!("{:.0}", r.alone),
            format!("{:.0}", r.mixed),
            format!("{:+.1} %", (r.mixed / r.alone.max(1e-9) - 1.0) * 100.0),
            format!("{:.3}", r.avg_normalized_loss),
            format!("{:.0}", r.time_to_90),
            format!("{:.0}", r.sweep_jct),
            format!("{:.3}", r.gpu_hours_per_sweep),
            format!("{:.0} %", r.early_stopped * 100.0),
        ]);
    }
    s.push_str(&t.render());
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{apps, workload};
    use std::path::Path;

    #[test]
    fn production_jobs_and_sweeps_share_the_cluster_and_all_end() {
        let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
        let curves = crate::explore::load_curves(&data.join("curves/sweep")).unwrap();
        let philly = read_philly(&data.join("pollux/traces/philly.csv")).unwrap();
        let trials = generate(&philly, &curves, 3, 0.3, 2).unwrap();
        let jobs = workload(12);
        let cfg = SimConfig {
            sim_loop: crate::engine::SimLoop::Service,
            ..SimConfig::default()
        };
        let explore = ExploreConfig {
            nodes: 16,
            early_stop: Some(EarlyStopSpec {
                rule: EarlyStopRule::Predicted,
                ..EarlyStopSpec::default()
            }),
            ..ExploreConfig::default()
        };
        let policy: Arc<dyn Policy> = by_name("quality", Default::default()).unwrap().into();
        let r = simulate_mixed(
            apps(),
            &jobs,
            &cfg,
            &curves,
            &trials,
            &explore,
            policy.clone(),
        )
        .unwrap();
        assert!(r.jobs.finished, "every production job ends");
        assert!(r.sweeps.finished, "every trial ends");
        assert_eq!(r.jobs.jobs.len(), jobs.len());
        assert_eq!(r.sweeps.trials.len(), trials.len());
        assert!(r.sweeps.trials.iter().all(|t| t.gpu_hours > 0.0));
        // Deterministic.
        let again =
            simulate_mixed(apps(), &jobs, &cfg, &curves, &trials, &explore, policy).unwrap();
        assert_eq!(r.sweeps.trials, again.sweeps.trials);
        // A sweep cluster larger than the trace's is refused.
        let big = ExploreConfig {
            nodes: 99,
            ..explore.clone()
        };
        let policy: Arc<dyn Policy> = by_name("fair", Default::default()).unwrap().into();
        assert!(simulate_mixed(apps(), &jobs, &cfg, &curves, &trials, &big, policy).is_err());
    }
}
