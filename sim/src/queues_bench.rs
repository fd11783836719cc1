//! `converge-sim queues`: a workload split among teams' queues (quotas, borrowing limits,
//! weights), optionally one team flooding the cluster and one high-priority job arriving on
//! a full cluster; the report shows each team's share over time against its quota, how
//! fast idle quota is lent, and the high-priority job's start and the jobs it preempted
//! (docs/scheduling.md, "Queues, fair share and priorities"). Every decision is the
//! allocator's ([`converge_sched::decide::decide_queued`]); this module only builds the
//! workload and reads the run.

use crate::cli::{ClusterArgs, QualityArgs};
use crate::engine::{SimResult, simulate};
use crate::workload::{Teams, WorkloadJob, assign_queues, read_workload};
use anyhow::Context as _;
use converge_common::{PriorityClass, QueueId, QueueSpec};
use converge_sched::policies::by_name;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `converge-sim queues`.
#[derive(Debug, Clone, clap::Args)]
pub struct QueuesArgs {
    /// Workload (Pollux format; an optional sixth column `queue` names each job's team).
    #[arg(long, default_value = "data/pollux/workloads/workload-1.csv")]
    pub workload: PathBuf,
    /// Queues: `NAME=QUOTA[:borrow=N][:weight=W]`, comma-separated (e.g.
    /// `team-1=8,team-2=8:weight=2`); no borrow: no limit.
    #[arg(long, value_parser = parse_queues, default_value = "team-1=8,team-2=8")]
    pub queues: BTreeMap<QueueId, QueueSpec>,
    /// How jobs get their team: `hash:N` (N teams `team-1`…, by a seeded hash of the job
    /// name: the Pollux workloads have no user) or `file` (the workload's `queue` column,
    /// e.g. a workload sampled from the Philly trace by `converge-sim workload`, whose
    /// queues are the trace's virtual clusters).
    #[arg(long, default_value = "hash:2", value_parser = parse_teams)]
    pub teams: Teams,
    /// A team whose jobs are all submitted at time 0 (it floods the queue).
    #[arg(long)]
    pub flood: Option<String>,
    /// Submit one high-priority job at this second (in `--high-team`), to measure gang
    /// preemption on a full cluster.
    #[arg(long)]
    pub high_at: Option<f64>,
    #[arg(long, default_value = "team-1")]
    pub high_team: String,
    /// Its application and GPUs (it asks for them all: a gang).
    #[arg(long, default_value = "cifar10")]
    pub high_app: String,
    #[arg(long, default_value_t = 4)]
    pub high_gpus: u32,
    /// Simulated time, seconds.
    #[arg(long, default_value_t = 3600.0)]
    pub duration: f64,
    /// Half-life of the queues' usage decay, seconds.
    #[arg(long, default_value_t = converge_sched::queues::DEFAULT_USAGE_HALF_LIFE_S)]
    pub usage_half_life: f64,
    /// Policy within each queue.
    #[arg(long, default_value = "quality")]
    pub policy: String,
    /// Width of a row of the share table, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub window: f64,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub quality: QualityArgs,
    /// Folder for queues.md and queue-shares.svg.
    #[arg(long, default_value = "sim-out/queues")]
    pub out: PathBuf,
}

/// Parses `NAME=QUOTA[:borrow=N][:weight=W],…`.
pub fn parse_queues(s: &str) -> Result<BTreeMap<QueueId, QueueSpec>, String> {
    let mut out = BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, rest) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?}: expected NAME=QUOTA[:borrow=N][:weight=W]"))?;
        let name: QueueId = name.trim().parse().map_err(|e| format!("{name:?}: {e}"))?;
        let mut parts = rest.split(':');
        let quota: i64 = parts
            .next()
            .unwrap_or_default()
            .trim()
            .parse()
            .map_err(|_| format!("{item:?}: the quota must be a whole number of GPUs"))?;
        let mut spec = QueueSpec {
            name: name.clone(),
            quota_gpus: converge_common::queues::check_quota("quota_gpus", quota)?,
            ..QueueSpec::implicit_default()
        };
        for part in parts {
            match part.split_once('=') {
                Some(("borrow", n)) => {
                    let n: i64 = n
                        .trim()
                        .parse()
                        .map_err(|_| format!("{part:?}: not a number"))?;
                    spec.borrowing_limit_gpus = Some(converge_common::queues::check_quota(
                        "borrowing_limit_gpus",
                        n,
                    )?);
                }
                Some(("weight", w)) => {
                    spec.weight = w
                        .trim()
                        .parse()
                        .map_err(|_| format!("{part:?}: not a number"))?;
                }
                _ => return Err(format!("{part:?}: expected borrow=N or weight=W")),
            }
        }
        spec.check()?;
        out.insert(name, spec);
    }
    Ok(out)
}

fn parse_teams(s: &str) -> Result<Teams, String> {
    if s == "file" {
        return Ok(Teams::AsWritten);
    }
    let n = s
        .strip_prefix("hash:")
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?}: expected hash:N (N ≥ 1) or file"))?;
    Ok(Teams::Hash { teams: n, seed: 0 })
}

/// Name of the high-priority job.
pub const HIGH_JOB: &str = "high-priority-0";

/// The workload as the run sees it: teams assigned, the flooding team's jobs at time 0,
/// the high-priority job added.
pub fn build_workload(args: &QueuesArgs) -> anyhow::Result<Vec<WorkloadJob>> {
    let mut jobs = read_workload(&args.workload)?;
    let teams = match args.teams {
        Teams::Hash { teams, .. } => Teams::Hash {
            teams,
            seed: args.cluster.seed,
        },
        Teams::AsWritten => Teams::AsWritten,
    };
    assign_queues(&mut jobs, &teams);
    if let Some(team) = &args.flood {
        for j in jobs.iter_mut().filter(|j| j.queue.as_deref() == Some(team)) {
            j.time = 0.0;
        }
    }
    if let Some(at) = args.high_at {
        jobs.push(WorkloadJob {
            name: HIGH_JOB.into(),
            time: at,
            application: args.high_app.clone(),
            num_replicas: args.high_gpus,
            batch_size: 128 * args.high_gpus,
            queue: Some(args.high_team.clone()),
            priority: PriorityClass::High,
        });
    }
    jobs.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.name.cmp(&b.name)));
    Ok(jobs)
}

/// What the report measures of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueFigures {
    /// Per queue: mean GPUs held over the intervals in which every queue with a quota had
    /// work beyond it (contended), and the number of such intervals.
    pub contended_gpus: BTreeMap<QueueId, f64>,
    pub contended_intervals: usize,
    /// Intervals in which a queue left quota idle while another queue had pending jobs, and
    /// the GPUs lent out in them (mean), the idle GPUs left in them (mean, max).
    pub lending_intervals: usize,
    pub mean_lent: f64,
    pub mean_idle_while_pending: f64,
    pub max_idle_while_pending: u32,
}

/// Measures `result` (see [`QueueFigures`]).
pub fn figures(
    result: &SimResult,
    specs: &BTreeMap<QueueId, QueueSpec>,
    total: u32,
) -> QueueFigures {
    let mut contended: BTreeMap<QueueId, f64> = BTreeMap::new();
    let mut contended_intervals = 0;
    let (mut lending_intervals, mut lent_sum, mut idle_sum, mut idle_max) = (0, 0.0, 0.0, 0);
    for i in result.intervals.iter().filter(|i| !i.queues.is_empty()) {
        let with_quota: Vec<&QueueId> = specs
            .iter()
            .filter(|(_, s)| s.quota_gpus > 0)
            .map(|(n, _)| n)
            .collect();
        let busy = |q: &QueueId| {
            i.queues
                .get(q)
                .is_some_and(|s| s.pending_jobs > 0 || s.gpus_in_use >= specs[q].quota_gpus)
        };
        if !with_quota.is_empty() && with_quota.iter().all(|q| busy(q)) {
            contended_intervals += 1;
            for q in &with_quota {
                *contended.entry((*q).clone()).or_default() += f64::from(i.queues[*q].gpus_in_use);
            }
        }
        let lent: u32 = i.queues.values().map(|s| s.lent_gpus).sum();
        let pending = i.queues.values().any(|s| s.pending_jobs > 0);
        let idle_quota = specs.iter().any(|(n, s)| {
            i.queues
                .get(n)
                .is_some_and(|st| st.gpus_in_use < s.quota_gpus && st.pending_jobs == 0)
        });
        if idle_quota && pending {
            lending_intervals += 1;
            lent_sum += f64::from(lent);
            let held: u32 = i.queues.values().map(|s| s.gpus_in_use).sum();
            let idle = total.saturating_sub(held);
            idle_sum += f64::from(idle);
            idle_max = idle_max.max(idle);
        }
    }
    for v in contended.values_mut() {
        *v /= contended_intervals.max(1) as f64;
    }
    QueueFigures {
        contended_gpus: contended,
        contended_intervals,
        lending_intervals,
        mean_lent: lent_sum / lending_intervals.max(1) as f64,
        mean_idle_while_pending: idle_sum / lending_intervals.max(1) as f64,
        max_idle_while_pending: idle_max,
    }
}

/// Runs `converge-sim queues`.
pub fn run_queues(args: &QueuesArgs) -> anyhow::Result<()> {
    let mut cfg = args.cluster.config()?;
    cfg.queues = args.queues.clone();
    cfg.usage_half_life_s = args.usage_half_life;
    cfg.max_time_s = args.duration;
    let apps = args.cluster.applications()?;
    let policy = by_name(&args.policy, args.quality.params(&args.cluster))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let jobs = build_workload(args)?;
    let result = simulate(&apps, &jobs, policy.as_ref(), &cfg)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let total = cfg.total_gpus();
    let md = report(args, &jobs, &result, total);
    std::fs::write(args.out.join("queues.md"), &md)?;
    plot_shares(
        &result,
        &args.queues,
        total,
        &args.out.join("queue-shares.svg"),
    )?;
    print!("{md}");
    Ok(())
}

/// The markdown report of one run.
pub fn report(args: &QueuesArgs, jobs: &[WorkloadJob], result: &SimResult, total: u32) -> String {
    let mut md = String::new();
    let interval = args.cluster.scheduling_interval;
    let _ = writeln!(
        md,
        "Policy `{}`, {} nodes × {} GPUs ({total} GPUs), scheduling interval {interval:.0} s, restart delay {:.0} s, usage half-life {:.0} s, {:.0} s simulated; {} jobs of {}{}.\n",
        args.policy,
        args.cluster.nodes,
        args.cluster.gpus_per_node,
        args.cluster.restart_delay,
        args.usage_half_life,
        args.duration,
        jobs.len(),
        args.workload.display(),
        args.flood.as_ref().map_or(String::new(), |t| format!(
            ", every job of {t} submitted at 0 s (flood)"
        )),
    );
    let mut teams: BTreeMap<&str, usize> = BTreeMap::new();
    for j in jobs {
        *teams
            .entry(j.queue.as_deref().unwrap_or("default"))
            .or_default() += 1;
    }
    md.push_str("| queue | quota | borrowing limit | weight | jobs |\n|---|---:|---:|---:|---:|\n");
    for (name, s) in &args.queues {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {} |",
            s.quota_gpus,
            s.borrowing_limit_gpus
                .map_or("none".into(), |b| b.to_string()),
            s.weight,
            teams.get(name.as_str()).copied().unwrap_or(0)
        );
    }
    // Share over time.
    md.push_str("\nGPUs held (mean over the window), share of the cluster against the quota's share, and pending jobs at the window's end:\n\n");
    md.push_str("| window (s) |");
    for name in args.queues.keys() {
        let _ = write!(
            md,
            " {name} GPUs | {name} share / quota share | {name} pending |"
        );
    }
    md.push_str("\n|---|");
    for _ in args.queues.keys() {
        md.push_str("---:|---:|---:|");
    }
    md.push('\n');
    let window = args.window.max(interval);
    let mut start = 0.0;
    while start < args.duration {
        let end = start + window;
        let rows: Vec<_> = result
            .intervals
            .iter()
            .filter(|i| i.time > start && i.time <= end && !i.queues.is_empty())
            .collect();
        if rows.is_empty() {
            break;
        }
        let _ = write!(md, "| {start:.0}–{end:.0} |");
        for (name, s) in &args.queues {
            let held: f64 = rows
                .iter()
                .map(|i| f64::from(i.queues.get(name).map_or(0, |q| q.gpus_in_use)))
                .sum::<f64>()
                / rows.len() as f64;
            let pending = rows
                .last()
                .and_then(|i| i.queues.get(name))
                .map_or(0, |q| q.pending_jobs);
            let _ = write!(
                md,
                " {held:.1} | {:.0} % / {:.0} % | {pending} |",
                100.0 * held / f64::from(total),
                100.0 * f64::from(s.quota_gpus) / f64::from(total)
            );
        }
        md.push('\n');
        start = end;
    }
    let f = figures(result, &args.queues, total);
    let _ = writeln!(
        md,
        "\nContended intervals (every queue with a quota has pending jobs or holds its quota): {} of {}.",
        f.contended_intervals,
        result.intervals.len()
    );
    for (name, gpus) in &f.contended_gpus {
        let quota = f64::from(args.queues[name].quota_gpus);
        let _ = writeln!(
            md,
            "- {name}: {gpus:.2} GPUs on average, {:.1} % of the cluster against a quota share of {:.1} % ({:+.1} % of its quota share)",
            100.0 * gpus / f64::from(total),
            100.0 * quota / f64::from(total),
            100.0 * (gpus - quota) / quota.max(1e-9)
        );
    }
    let _ = writeln!(
        md,
        "\nLending: in {} intervals a queue left quota idle while another had pending jobs; {:.1} GPUs were lent on average in them, and {:.2} GPUs (at most {}) stayed idle at the decision (gangs that did not fit).",
        f.lending_intervals, f.mean_lent, f.mean_idle_while_pending, f.max_idle_while_pending
    );
    if let Some(at) = args.high_at {
        let high = result.jobs.iter().find(|j| j.name == HIGH_JOB);
        match high.and_then(|j| j.first_placed_at) {
            Some(placed) => {
                let _ = writeln!(
                    md,
                    "\nHigh-priority job ({} GPUs of {}, queue {}) submitted at {at:.0} s on a cluster with {} of {total} GPUs busy: placed by the decision at {placed:.0} s ({:.0} s, {:.2} scheduling periods, after submission), training from {:.0} s (after the {:.0} s restart delay): {:.0} s after submission.",
                    args.high_gpus,
                    args.high_app,
                    args.high_team,
                    busy_before(result, at),
                    placed - at,
                    (placed - at) / interval,
                    placed + args.cluster.restart_delay,
                    args.cluster.restart_delay,
                    placed + args.cluster.restart_delay - at
                );
            }
            None => {
                let _ = writeln!(
                    md,
                    "\nHigh-priority job submitted at {at:.0} s: never placed."
                );
            }
        }
        let at_arrival: Vec<_> = result
            .preemptions
            .iter()
            .filter(|p| p.time >= at && p.time <= at + 2.0 * interval)
            .collect();
        let _ = writeln!(
            md,
            "Jobs preempted whole in the two scheduling periods after it arrived: {} ({} workers, all of each job's).",
            if at_arrival.is_empty() {
                "none".to_string()
            } else {
                at_arrival
                    .iter()
                    .map(|p| {
                        format!(
                            "{} ({} workers at {:.0} s: {})",
                            p.job, p.workers, p.time, p.reason
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
            at_arrival.iter().map(|p| p.workers).sum::<u32>()
        );
    }
    let _ = writeln!(
        md,
        "\nWhole-job preemptions over the run: {} ({} workers).",
        result.preemptions.len(),
        result.preemptions.iter().map(|p| p.workers).sum::<u32>()
    );
    md
}

/// GPUs held just before `at` (the last interval ending at or before it).
fn busy_before(result: &SimResult, at: f64) -> u32 {
    result
        .intervals
        .iter()
        .rfind(|i| i.time <= at && !i.queues.is_empty())
        .map_or(0, |i| i.queues.values().map(|q| q.gpus_in_use).sum())
}

/// GPUs each queue holds over time, with its quota as a dashed line.
fn plot_shares(
    result: &SimResult,
    specs: &BTreeMap<QueueId, QueueSpec>,
    total: u32,
    path: &Path,
) -> anyhow::Result<()> {
    let end = result.intervals.last().map_or(1.0, |i| i.time).max(1.0);
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "GPUs held per queue, against its quota (dashed)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..end, 0.0..f64::from(total) * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("GPUs")
        .draw()?;
    for (k, (name, spec)) in specs.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        let points: Vec<(f64, f64)> = result
            .intervals
            .iter()
            .filter(|i| !i.queues.is_empty())
            .map(|i| {
                (
                    i.time,
                    f64::from(i.queues.get(name).map_or(0, |q| q.gpus_in_use)),
                )
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(name.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        let quota = f64::from(spec.quota_gpus);
        chart.draw_series(DashedLineSeries::new(
            vec![(0.0, quota), (end, quota)],
            6,
            4,
            color.stroke_width(1),
        ))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apps::load_all;
    use crate::engine::SimConfig;
    use std::sync::OnceLock;

    fn apps() -> &'static BTreeMap<String, crate::apps::Application> {
        static APPS: OnceLock<BTreeMap<String, crate::apps::Application>> = OnceLock::new();
        APPS.get_or_init(|| load_all(&crate::apps::test_trace_dirs()).unwrap())
    }

    fn workload(n: usize) -> Vec<WorkloadJob> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/pollux/workloads/workload-1.csv");
        read_workload(&path).unwrap().into_iter().take(n).collect()
    }

    #[test]
    fn queue_syntax_parses_and_bad_values_are_refused() {
        let q = parse_queues("team-a=8,team-b=4:borrow=2:weight=2").unwrap();
        let b = &q[&"team-b".parse::<QueueId>().unwrap()];
        assert_eq!(
            (b.quota_gpus, b.borrowing_limit_gpus, b.weight),
            (4, Some(2), 2.0)
        );
        assert_eq!(
            q[&"team-a".parse::<QueueId>().unwrap()].borrowing_limit_gpus,
            None
        );
        assert!(parse_queues("a=-1").unwrap_err().contains("below zero"));
        assert!(parse_queues("a=1:weight=0").unwrap_err().contains("weight"));
        assert!(parse_queues("a").is_err());
        assert!(parse_teams("hash:0").is_err());
        assert_eq!(parse_teams("file").unwrap(), Teams::AsWritten);
    }

    #[test]
    fn one_unlimited_queue_runs_exactly_as_without_queues() {
        let jobs = workload(30);
        let cfg = SimConfig {
            nodes: 4,
            ..SimConfig::default()
        };
        let policy = by_name("quality", Default::default()).unwrap();
        let plain = simulate(apps(), &jobs, policy.as_ref(), &cfg).unwrap();
        let mut teamed = jobs.clone();
        for j in &mut teamed {
            j.queue = Some("team-a".into());
        }
        let queued = SimConfig {
            queues: parse_queues("team-a=4").unwrap(),
            ..cfg
        };
        let with = simulate(apps(), &teamed, policy.as_ref(), &queued).unwrap();
        let strip = |r: &SimResult| {
            r.jobs
                .iter()
                .map(|j| (j.name.clone(), j.completed_at, j.restarts))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&plain), strip(&with));
        assert!(with.preemptions.is_empty());
    }

    /// One simulated hour on 4 nodes (16 GPUs) under `quality`: 60 jobs split between
    /// `team-1` and `team-2` (quota 8 each) by a seeded hash, every team-1 job submitted at
    /// 0 s (the flood) and each team-2 job at `team_2_time(its workload time)`.
    fn two_teams(team_2_time: impl Fn(f64) -> f64) -> (SimResult, QueueFigures) {
        let mut jobs = workload(60);
        assign_queues(&mut jobs, &Teams::Hash { teams: 2, seed: 1 });
        for j in &mut jobs {
            j.time = if j.queue.as_deref() == Some("team-1") {
                0.0
            } else {
                team_2_time(j.time)
            };
        }
        let specs = parse_queues("team-1=8,team-2=8").unwrap();
        let cfg = SimConfig {
            nodes: 4,
            queues: specs.clone(),
            max_time_s: 3600.0,
            ..SimConfig::default()
        };
        let policy = by_name("quality", Default::default()).unwrap();
        let r = simulate(apps(), &jobs, policy.as_ref(), &cfg).unwrap();
        let f = figures(&r, &specs, 16);
        (r, f)
    }

    #[test]
    fn two_flooding_teams_get_their_quotas_and_idle_quota_is_lent() {
        let (r, f) = two_teams(|t| t);
        assert!(f.contended_intervals > 10);
        for (q, gpus) in &f.contended_gpus {
            assert!((gpus - 8.0).abs() <= 0.8 + 1e-9, "{q}: {gpus}");
        }
        // No queue holds more than the cluster; a lender's GPUs go out in the same decision.
        for i in &r.intervals {
            let held: u32 = i.queues.values().map(|s| s.gpus_in_use).sum();
            assert!(held <= 16);
        }
        assert!(f.lending_intervals == 0 || f.mean_lent > 0.0);
    }

    #[test]
    fn quota_left_idle_is_lent_at_once_and_taken_back() {
        // team-1 floods at 0 s; team-2's jobs arrive from 1,800 s on. While team-2 has
        // nothing to run, its 8 GPUs go to team-1 (lent, none idle while team-1 waits);
        // once team-2's jobs come, it gets its quota back.
        let (r, f) = two_teams(|t| 1800.0 + t / 4.0);
        assert!(f.lending_intervals >= 10, "{f:?}");
        assert!(f.mean_lent >= 4.0, "{f:?}");
        assert_eq!(f.max_idle_while_pending, 0, "{f:?}");
        let team2: QueueId = "team-2".parse().unwrap();
        let late = r
            .intervals
            .iter()
            .filter(|i| i.time >= 2400.0)
            .filter_map(|i| i.queues.get(&team2))
            .filter(|s| s.pending_jobs > 0)
            .map(|s| s.gpus_in_use)
            .collect::<Vec<_>>();
        assert!(!late.is_empty(), "team-2 never waited after 2,400 s");
        assert!(
            late.iter().all(|&g| g >= 8),
            "team-2 below its quota while waiting: {late:?}"
        );
    }
}
