//! The simulator's commands: `converge-sim simulate`, `converge-sim workload`
//! and `converge-sim report`.

use crate::apps::{Application, SIA_SLOWDOWNS, load_all};
use crate::engine::{NodeGroup, SimConfig, SimLoop, SimResult, WorkKnowledge, simulate};
use crate::summary::{Summary, summarize};
use crate::workload::{configurations, generate, read_philly, read_workload, to_csv};
use anyhow::Context as _;
use converge_sched::placement::PlacementKind;
use converge_sched::policies::{Objective, PolicyParams};
use converge_sched::policies::{POLICY_NAMES, by_name};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// GPUs per node of the Sia artifact's machines (its `simulator_config.py`), the default of
/// `--cluster TYPE=NODES`.
pub const SIA_GPUS_PER_NODE: [(&str, u32); 6] = [
    ("aws", 4),
    ("rtx", 8),
    ("dgx-ext", 8),
    ("dgx", 8),
    ("quad", 4),
    ("azure", 8),
];

/// The node groups of `--cluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuGroups(pub Vec<NodeGroup>);

/// Parses `TYPE=NODES[xGPUS],...` (see [`ClusterArgs::cluster`]).
pub fn parse_gpu_groups(s: &str) -> Result<GpuGroups, String> {
    let mut groups: Vec<NodeGroup> = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (gpu_type, size) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not TYPE=NODES or TYPE=NODESxGPUS"))?;
        let gpu_type = gpu_type.trim();
        if gpu_type.is_empty()
            || !gpu_type
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(format!(
                "GPU type {gpu_type:?} must be letters, digits, '-', '_' or '.'"
            ));
        }
        if groups.iter().any(|g| g.gpu_type == gpu_type) {
            return Err(format!("GPU type {gpu_type:?} is listed twice"));
        }
        let (nodes, gpus) = match size.split_once('x') {
            Some((n, g)) => (n, Some(g)),
            None => (size, None),
        };
        let nodes: u32 = nodes
            .trim()
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{part:?}: nodes must be a positive integer"))?;
        let gpus_per_node = match gpus {
            Some(g) => g
                .trim()
                .parse()
                .ok()
                .filter(|&g| g > 0)
                .ok_or_else(|| format!("{part:?}: GPUs per node must be a positive integer"))?,
            None => SIA_GPUS_PER_NODE
                .iter()
                .find(|(t, _)| *t == gpu_type)
                .map(|&(_, g)| g)
                .ok_or_else(|| {
                    format!(
                        "{part:?}: GPUs per node of type {gpu_type:?} are not known; write \
                         {gpu_type}={nodes}xGPUS"
                    )
                })?,
        };
        groups.push(NodeGroup {
            gpu_type: gpu_type.to_string(),
            nodes,
            gpus_per_node,
        });
    }
    Ok(GpuGroups(groups))
}

/// How measured step times are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Calibration {
    /// As measured.
    #[default]
    None,
    /// The Sia artifact's per-application slowdowns ([`crate::apps::SIA_SLOWDOWNS`]: cifar10
    /// 1.8, ncf 1.5, the others 1.2), so that figures compare with Sia's published ones.
    Sia,
}

/// Cluster and timing settings shared by `simulate` and `report`.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Nodes in the simulated cluster (one GPU type).
    #[arg(long, default_value_t = 16)]
    pub nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 4)]
    pub gpus_per_node: u32,
    /// A cluster of several GPU types instead of --nodes × --gpus-per-node:
    /// `TYPE=NODES[xGPUS_PER_NODE],...`, e.g. `aws=6,rtx=3,dgx-ext=2` (the Sia paper's
    /// 64-GPU cluster: 24 T4, 24 RTX 2080 Ti, 16 A100). GPUs per node default to the Sia
    /// artifact's machines (aws 4, rtx 8, dgx-ext 8, dgx 8, quad 4, azure 8). Each type's
    /// step times are read from `TRACES/<app>/placements-<type>.csv` and
    /// `scalability-<type>.csv`: pass `--traces` the Sia artifact's traces folder
    /// (../shared/data/sia/traces in this workspace). A job's new placement uses one type;
    /// a job on several would run at its slowest type's speed.
    #[arg(long, value_parser = parse_gpu_groups, conflicts_with_all = ["nodes", "gpus_per_node"])]
    pub cluster: Option<GpuGroups>,
    /// Step-time calibration: `none` (as measured) or `sia` (the Sia artifact's
    /// per-application slowdowns, to compare with its published figures).
    #[arg(long, value_enum, default_value_t = Calibration::None)]
    pub calibration: Calibration,
    /// Ablation: hold every `--cluster` type to the application's base (T4) micro-batch,
    /// larger batches by gradient accumulation, as this simulator did before 2026-11-30. By
    /// default each type runs micro-batches up to its own largest measured one (the A100
    /// `dgx-ext` traces go to four times the T4's: BERT 48 against 12 samples per GPU), as
    /// the Sia artifact's simulator does, and every job's spec says so
    /// (`max_per_worker_by_gpu_type`).
    #[arg(long)]
    pub base_micro_batch: bool,
    /// Scheduling interval: how often the policy re-decides, seconds (`--interval` is the old
    /// name).
    #[arg(long, visible_alias = "interval", default_value_t = 60.0)]
    pub scheduling_interval: f64,
    /// Seconds without progress that every allocation change costs a job.
    #[arg(long, default_value_t = 30.0)]
    pub restart_delay: f64,
    /// Slowdown factor (0–1) of a multi-node job sharing a node with another multi-node job.
    #[arg(long, default_value_t = 0.0)]
    pub interference: f64,
    /// Seed of the noise on the loss signal the policy sees.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Placement: `first-fit` (hosts in id order) or `bco` (balance contention between
    /// multi-node jobs against the overhead of spanning nodes, SJF-BCO's rule). First fit
    /// by default here, as the closer stand-in for the placement of the published Pollux
    /// baselines; the service defaults to `bco`.
    #[arg(long, value_enum, default_value_t = PlacementKind::FirstFit)]
    pub placement: PlacementKind,
    /// Ablation: pass no measured contention to the decision (BCO then prices placements by
    /// each job's throughput model alone), to see what the measurement is worth.
    #[arg(long)]
    pub ignore_contention: bool,
    /// Ablation: every job keeps its submitted batch size, even under a policy that adapts
    /// batch sizes to allocations (`quality`, `pollux`), to see what goodput is worth.
    #[arg(long)]
    pub fixed_batch: bool,
    /// Ablation of the decision loop: a running job's batch changes only with a new
    /// placement, as the service keeps a batch for a generation (the service loop always
    /// does), instead of every interval at no cost.
    #[arg(long)]
    pub batch_per_generation: bool,
    /// Folder of the measured application traces; repeat it to search several in order (each
    /// application, and each `--cluster` type's step times, from the first that has the
    /// application). The default's second folder supplies the applications, whose traces are not in this
    /// repository (data/README.md).
    #[arg(long, default_values = crate::apps::DEFAULT_TRACE_DIRS)]
    pub traces: Vec<PathBuf>,
    /// Fraction of the jobs (0–1, by a seeded hash of their names) run as shadow variants:
    /// background synchronization, compute-only steps, the algorithm's measured
    /// statistical-efficiency penalty (docs/communication.md, "Shadow jobs in the
    /// scheduler").
    #[arg(long, default_value_t = 0.0)]
    pub shadow_fraction: f64,
    /// The shadow variants' algorithm: `ma`, `bmuf` or `easgd`.
    #[arg(long, default_value = "ma", value_parser = parse_shadow_algorithm)]
    pub shadow_algorithm: converge_common::ShadowAlgorithm,
    /// What the jobs tell the scheduler about their work: `declared` (each declares its
    /// epochs, a spec's `work_samples`; a policy knows the work left) or `target-loss` (none
    /// declares; each has a target loss, and a policy knows only the fitted curve's estimate
    /// of the samples to it, as the live allocator for such a job).
    #[arg(long, value_enum, default_value_t = WorkKnowledge::Declared)]
    pub work: WorkKnowledge,
    /// Which loop simulates: `decision` (the simulator builds each decision's job views
    /// and calls the service's decision function; allocations change at once) or `service`
    /// (the allocator's whole scheduling step drives the simulated cluster through host
    /// plans, heartbeats and progress reports: its lifecycle and generation fencing, stop
    /// rules, batch-per-generation rule, measured step times and restart costs; no oracle).
    #[arg(long = "loop", value_enum, default_value_t = SimLoop::Decision)]
    pub sim_loop: SimLoop,
}

fn parse_shadow_algorithm(s: &str) -> Result<converge_common::ShadowAlgorithm, String> {
    converge_common::ShadowAlgorithm::ALL
        .into_iter()
        .find(|a| a.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not ma, bmuf or easgd"))
}

impl ClusterArgs {
    /// The applications of `--traces`, with the step times of every `--cluster` type and the
    /// `--calibration`.
    pub fn applications(&self) -> anyhow::Result<BTreeMap<String, Application>> {
        let mut apps = load_all(&self.traces)?;
        for app in apps.values_mut() {
            let dir = crate::apps::app_dir(&self.traces, &app.name)?;
            for group in self.cluster.iter().flat_map(|g| &g.0) {
                app.load_gpu_type(dir, &group.gpu_type).with_context(|| {
                    format!(
                        "cannot load {}'s step times on GPU type {} from {} (--cluster \
                         needs a traces folder with placements-<type>.csv and \
                         scalability-<type>.csv, such as the Sia artifact's)",
                        app.name,
                        group.gpu_type,
                        dir.display()
                    )
                })?;
            }
            app.micro_batch_per_type = !self.base_micro_batch;
            if self.calibration == Calibration::Sia {
                app.step_scale = SIA_SLOWDOWNS
                    .iter()
                    .find(|(name, _)| *name == app.name)
                    .map_or(1.0, |&(_, f)| f);
            }
        }
        Ok(apps)
    }

    pub fn config(&self) -> anyhow::Result<SimConfig> {
        anyhow::ensure!(
            self.nodes > 0 && self.gpus_per_node > 0,
            "the cluster needs at least one GPU"
        );
        anyhow::ensure!(
            self.scheduling_interval > 0.0,
            "--scheduling-interval must be positive"
        );
        anyhow::ensure!(
            self.restart_delay >= 0.0,
            "--restart-delay must not be negative"
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.interference),
            "--interference must be in [0, 1)"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.shadow_fraction),
            "--shadow-fraction must be in [0, 1]"
        );
        Ok(SimConfig {
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            gpu_groups: self.cluster.clone().map(|g| g.0).unwrap_or_default(),
            scheduling_interval_s: self.scheduling_interval,
            restart_delay_s: self.restart_delay,
            interference: self.interference,
            seed: self.seed,
            placement: self.placement,
            ignore_contention: self.ignore_contention,
            fixed_batch: self.fixed_batch,
            batch_per_generation: self.batch_per_generation,
            shadow_fraction: self.shadow_fraction,
            shadow_algorithm: self.shadow_algorithm,
            work: self.work,
            sim_loop: self.sim_loop,
            ..SimConfig::default()
        })
    }
}

/// Settings of the `quality` policy in the simulator (the other policies have none).
#[derive(Debug, Clone, clap::Args)]
pub struct QualityArgs {
    /// What the quality policy maximizes over the horizon: `auto` (the default: `loss` for
    /// exploratory jobs, `jct` for any other), `both` (the sum of the other two), `jct`
    /// (speedups weighted by rank of remaining time, after heSRPT: completion-time-aware) or
    /// `loss` (SLAQ's normalized loss reduction).
    #[arg(long, value_enum, default_value_t = Objective::default())]
    pub objective: Objective,
    /// How far ahead the quality policy values an allocation, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub horizon: f64,
    /// Starvation guard: seconds a pending job that has never run waits before it is admitted
    /// ahead of running jobs (a preempted job waits for its turn).
    #[arg(long, default_value_t = 1800.0)]
    pub max_wait: f64,
}

impl QualityArgs {
    /// The quality policy's settings; its restart cost is the cluster's restart delay.
    pub fn params(&self, cluster: &ClusterArgs) -> PolicyParams {
        PolicyParams {
            objective: self.objective,
            horizon_s: self.horizon,
            max_wait_s: self.max_wait,
            restart_cost_s: cluster.restart_delay,
            ..PolicyParams::default()
        }
    }
}

impl Default for QualityArgs {
    fn default() -> Self {
        Self {
            objective: Objective::default(),
            horizon: 60.0,
            max_wait: 1800.0,
        }
    }
}

/// `converge-sim simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Workload file(s) in the Pollux format (`name,time,application,num_replicas,batch_size`).
    #[arg(long, required = true, num_args = 1..)]
    pub workload: Vec<PathBuf>,
    /// Scheduling policy: fifo, fair, tiresias, optimus (Optimus+Oracle), quality (Converge's:
    /// loss curves, remaining work and goodput with adaptive batch sizes), sjf-bco (smallest
    /// estimated job first, for makespan; pair it with `--placement bco`) or pollux (the
    /// Pollux baseline: goodput, a genetic search over job × node allocations; places jobs
    /// itself, so `--placement` does not apply) or sia (the Sia baseline: one GPU type and
    /// count per job by a MILP over normalized goodput; on a mixed `--cluster` it picks the
    /// type, placement the hosts within it).
    #[arg(long, default_value = "quality")]
    pub policy: String,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub quality: QualityArgs,
    /// Folder for `summary.json` (created if missing).
    #[arg(long, default_value = "sim-out")]
    pub out: PathBuf,
}

/// `converge-sim workload`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// The Philly trace.
    #[arg(long, default_value = "data/pollux/traces/philly.csv")]
    pub trace: PathBuf,
    /// Jobs to sample.
    #[arg(long, default_value_t = 160)]
    pub jobs: usize,
    /// Length of the submission window, hours.
    #[arg(long, default_value_t = 8)]
    pub hours: u32,
    /// Hour of day the window starts at.
    #[arg(long, default_value_t = 2)]
    pub start_hour: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Workloads whose per-application (replicas, batch size) configurations are drawn from.
    #[arg(long, default_value = "data/pollux/workloads")]
    pub configs: PathBuf,
    /// Output file; standard output if not given.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn workload_name(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map_or("workload".into(), |s| s.to_string_lossy().into_owned());
    let dir = path
        .parent()
        .and_then(Path::file_name)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if dir.starts_with("workloads-") {
        format!("{dir}/{stem}")
    } else {
        stem
    }
}

/// Runs one policy over workload files and summarizes.
pub fn run_policy(
    policy: &str,
    workloads: &[PathBuf],
    cluster: &ClusterArgs,
    quality: &PolicyParams,
) -> anyhow::Result<(Summary, Vec<(String, SimResult)>)> {
    let cfg = cluster.config()?;
    let apps = cluster.applications()?;
    let policy_impl: std::sync::Arc<dyn converge_sched::policies::Policy> =
        by_name(policy, *quality)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .into();
    let mut runs = Vec::new();
    for path in workloads {
        let mut jobs = read_workload(path)?;
        // One pool: a workload's queue column (e.g. a generated Philly workload's virtual
        // clusters) is ignored here, as no queue is defined; `converge-sim queues` runs
        // workloads with queues.
        let queued = jobs.iter().filter(|j| j.queue.is_some()).count();
        if cfg.queues.is_empty() && queued > 0 {
            eprintln!(
                "{}: ignoring the queue column of {queued} job(s): this run has one pool \
                 (`converge-sim queues` simulates queues)",
                path.display()
            );
            for job in &mut jobs {
                job.queue = None;
            }
        }
        let result = match cfg.sim_loop {
            SimLoop::Decision => simulate(&apps, &jobs, policy_impl.as_ref(), &cfg)?,
            SimLoop::Service => {
                crate::world::simulate_service(&apps, &jobs, policy_impl.clone(), &cfg)?
            }
        };
        runs.push((workload_name(path), result));
    }
    Ok((summarize(policy, &runs), runs))
}

pub fn run_simulate(args: &SimulateArgs) -> anyhow::Result<()> {
    if !POLICY_NAMES.contains(&args.policy.as_str()) {
        anyhow::bail!(
            "unknown policy {:?}; choose one of {}",
            args.policy,
            POLICY_NAMES.join(", ")
        );
    }
    let started = std::time::Instant::now();
    let (summary, _) = run_policy(
        &args.policy,
        &args.workload,
        &args.cluster,
        &args.quality.params(&args.cluster),
    )?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let path = args.out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)?;
    eprintln!(
        "{}: mean JCT {:.0} s over {} workload(s), {:.2} restarts per job, mean utilization {:.0} %, {} ({:.1} s); summary in {}",
        summary.policy,
        summary.mean,
        summary.avgs.len(),
        summary.mean_restarts_per_job,
        summary.mean_utilization * 100.0,
        if summary.finished {
            "all jobs finished"
        } else {
            "SOME JOBS DID NOT FINISH"
        },
        started.elapsed().as_secs_f64(),
        path.display()
    );
    if let Some(loss) = summary.mean_loss_at_stop {
        eprintln!(
            "{} job(s) ended by the service's stop rules before their completion epoch, at a \
             mean normalized loss of {loss:.3} (0 = the completion epoch's loss)",
            summary.stopped_by_service
        );
    }
    if !summary.work_estimates.is_empty() {
        eprintln!(
            "remaining-work estimates told to the policy (fitted curve to the target) against the \
             samples to the completion epoch, by work done:"
        );
        for b in &summary.work_estimates {
            let ratio = b.ratio.map_or_else(
                || "none told".to_string(),
                |[p10, p50, p90]| format!("p10 {p10:.2} p50 {p50:.2} p90 {p90:.2}"),
            );
            eprintln!(
                "  {:>3.0}-{:>3.0} %: {} views, {:.0} % without an estimate, estimate/truth {ratio}",
                b.done.0 * 100.0,
                b.done.1 * 100.0,
                b.views,
                b.without * 100.0,
            );
        }
    }
    Ok(())
}

pub fn run_workload(args: &WorkloadArgs) -> anyhow::Result<()> {
    let philly = read_philly(&args.trace)?;
    let configs = configurations(&args.configs)?;
    let jobs = generate(
        &philly,
        &configs,
        args.jobs,
        args.start_hour,
        args.hours,
        args.seed,
    )?;
    let csv = to_csv(&jobs);
    match &args.out {
        Some(path) => {
            std::fs::write(path, csv).with_context(|| format!("cannot write {}", path.display()))?
        }
        None => print!("{csv}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_groups_parse_with_known_and_given_gpus_per_node() {
        let groups = parse_gpu_groups("aws=6, rtx=3,dgx-ext=2,h100=1x4")
            .unwrap()
            .0;
        let got: Vec<(&str, u32, u32)> = groups
            .iter()
            .map(|g| (g.gpu_type.as_str(), g.nodes, g.gpus_per_node))
            .collect();
        assert_eq!(
            got,
            [
                ("aws", 6, 4),
                ("rtx", 3, 8),
                ("dgx-ext", 2, 8),
                ("h100", 1, 4)
            ]
        );
        for (bad, why) in [
            ("aws", "is not TYPE=NODES"),
            ("aws=0", "nodes must be a positive integer"),
            ("aws=2x0", "GPUs per node must be a positive integer"),
            ("h100=2", "write h100=2xGPUS"),
            ("aws=1,aws=2", "listed twice"),
            ("a b=1", "must be letters"),
        ] {
            let err = parse_gpu_groups(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
