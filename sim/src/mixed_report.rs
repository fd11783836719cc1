//! `converge-sim report`'s mixed-cluster section: the Sia artifact's three traces (Philly,
//! Helios, newTrace) on the Sia paper's 64-GPU cluster of three GPU types, every policy, next
//! to the paper's published figures (Sia, SOSP'23, Table 3), with each model's share of GPU
//! time per type (the paper's Figure 6).
//!
//! The Sia artifact has no licence: its workloads and step times are read in place
//! (`--sia`, `../shared/data/sia` in this workspace), never copied into the repository. The
//! section is left out, with a note saying why, when that folder is missing.

use crate::cli::{Calibration, ClusterArgs, parse_gpu_groups, run_policy};
use crate::markdown::Table;
use crate::report::policy_of;
use crate::summary::Summary;
use anyhow::Context as _;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The Sia paper's heterogeneous cluster: 6 nodes of 4 T4 (`aws`), 3 of 8 RTX 2080 Ti
/// (`rtx`), 2 of 8 A100 (`dgx-ext`): 64 GPUs.
pub const MIXED_CLUSTER: &str = "aws=6,rtx=3,dgx-ext=2";

/// The traces of the section: (name in the paper, folder under `workloads/`).
pub const MIXED_TRACES: [(&str, &str); 3] = [
    ("Philly", "philly"),
    ("Helios", "saturn"),
    ("newTrace", "newtrace"),
];

/// The policies the section runs unless told otherwise.
pub const MIXED_POLICIES: [&str; 7] = [
    "fifo", "fair", "tiresias", "optimus", "pollux", "sia", "quality",
];

/// Published figures, Sia paper Table 3 (heterogeneous setting, 64 GPUs, mean over
/// workloads): (trace, policy, mean JCT h, p99 JCT h, makespan h, GPU-hours per job).
pub const PUBLISHED: [(&str, &str, f64, f64, f64, f64); 6] = [
    ("Philly", "Sia", 0.6, 9.5, 14.2, 4.0),
    ("Philly", "Pollux", 1.0, 14.9, 24.5, 5.6),
    ("Helios", "Sia", 0.7, 10.9, 14.9, 4.8),
    ("Helios", "Pollux", 1.0, 15.0, 25.5, 5.9),
    ("newTrace", "Sia", 0.7, 4.6, 52.2, 3.0),
    ("newTrace", "Pollux", 1.5, 10.3, 62.3, 3.4),
];

/// The section's options (flattened into `converge-sim report`).
#[derive(Debug, Clone, clap::Args)]
pub struct MixedArgs {
    /// The Sia artifact's data folder (`workloads/{philly,saturn,newtrace}/`, `traces/`),
    /// read in place (it has no licence). Without it the mixed-cluster section is left out
    /// with a note.
    #[arg(long, default_value = "../shared/data/sia")]
    pub sia: PathBuf,
    /// Leave out the mixed-cluster section.
    #[arg(long)]
    pub skip_mixed: bool,
    /// Policies of the mixed-cluster section (default: fifo fair tiresias optimus pollux sia
    /// quality; report labels such as `quality-jct` work too).
    #[arg(long, num_args = 1..)]
    pub mixed_policies: Vec<String>,
    /// Run only the first N workloads of each trace (default: all), for a quicker look.
    #[arg(long)]
    pub mixed_workloads: Option<usize>,
}

impl MixedArgs {
    /// The labels to run.
    pub fn policies(&self) -> Vec<String> {
        if self.mixed_policies.is_empty() {
            MIXED_POLICIES.iter().map(|s| s.to_string()).collect()
        } else {
            self.mixed_policies.clone()
        }
    }
}

/// One policy over every workload of one trace.
#[derive(Debug, Clone)]
pub struct MixedRun {
    pub label: String,
    /// The trace's name in the paper ([`MIXED_TRACES`]).
    pub trace: &'static str,
    pub summary: Summary,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
}

/// The section's outcome: its runs, or why it was left out.
#[derive(Debug, Clone)]
pub enum Mixed {
    Ran(Vec<MixedRun>),
    Skipped(String),
}

/// `base` on the mixed cluster with the Sia artifact's traces and calibration.
///
/// # Errors
/// Never for the built-in cluster; kept as a `Result` for the parse.
pub fn mixed_cluster(base: &ClusterArgs, sia: &Path) -> anyhow::Result<ClusterArgs> {
    let mut cluster = base.clone();
    cluster.cluster = Some(parse_gpu_groups(MIXED_CLUSTER).map_err(|e| anyhow::anyhow!(e))?);
    cluster.calibration = Calibration::Sia;
    cluster.traces = vec![sia.join("traces")];
    Ok(cluster)
}

fn csv_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = crate::report::workload_files(dir)?;
    // workload-2 before workload-10.
    files.sort_by_key(|p| {
        let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned());
        let n = stem
            .as_deref()
            .and_then(|s| s.rsplit('-').next())
            .and_then(|n| n.parse::<u32>().ok());
        (n, p.clone())
    });
    Ok(files)
}

/// Runs every (policy, trace) pair, `threads` at a time, the slowest (newTrace, `sia`,
/// `pollux`) first.
///
/// # Errors
/// An unknown label, an unreadable workload or trace, or a failed simulation.
pub fn run(args: &MixedArgs, base: &ClusterArgs, threads: usize) -> anyhow::Result<Mixed> {
    if args.skip_mixed {
        return Ok(Mixed::Skipped("left out (`--skip-mixed`)".into()));
    }
    if !args.sia.join("workloads").is_dir() {
        return Ok(Mixed::Skipped(format!(
            "left out: no Sia artifact data at `{}` (pass `--sia DIR`)",
            args.sia.display()
        )));
    }
    let cluster = mixed_cluster(base, &args.sia)?;
    let policies = args.policies();
    for p in &policies {
        anyhow::ensure!(
            policy_of(p, &cluster).is_some(),
            "unknown policy {p:?} in --mixed-policies"
        );
    }
    let mut pairs: Vec<(String, &'static str, Vec<PathBuf>)> = Vec::new();
    for (trace, folder) in MIXED_TRACES {
        let mut files = csv_files(&args.sia.join("workloads").join(folder))?;
        anyhow::ensure!(!files.is_empty(), "no workloads in {folder}");
        if let Some(n) = args.mixed_workloads {
            anyhow::ensure!(n > 0, "--mixed-workloads must be at least 1");
            files.truncate(n);
        }
        for p in &policies {
            pairs.push((p.clone(), trace, files.clone()));
        }
    }
    pairs.sort_by_key(|(p, trace, _)| {
        (
            *trace != "newTrace",
            !matches!(p.as_str(), "sia" | "pollux" | "quality"),
        )
    });
    let outcomes = crate::report::on_threads(&pairs, threads, |(label, trace, files)| {
        run_one(label, trace, files, &cluster)
    });
    let mut runs = outcomes.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let order = |r: &MixedRun| {
        (
            MIXED_TRACES.iter().position(|(t, _)| *t == r.trace),
            policies.iter().position(|p| *p == r.label),
        )
    };
    runs.sort_by_key(order);
    Ok(Mixed::Ran(runs))
}

fn run_one(
    label: &str,
    trace: &'static str,
    files: &[PathBuf],
    cluster: &ClusterArgs,
) -> anyhow::Result<MixedRun> {
    let (policy, params) =
        policy_of(label, cluster).with_context(|| format!("unknown policy {label:?}"))?;
    let t = std::time::Instant::now();
    let (summary, _) = run_policy(policy, files, cluster, &params)
        .with_context(|| format!("{label} on the {trace} workloads"))?;
    let seconds = t.elapsed().as_secs_f64();
    eprintln!(
        "{label} on {trace} (mixed cluster): mean JCT {:.0} s ({seconds:.1} s)",
        summary.mean
    );
    Ok(MixedRun {
        label: label.to_string(),
        trace,
        summary,
        seconds,
    })
}

fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = xs
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { sum / n as f64 }
}

/// Mean over workloads of each workload's p99 JCT, seconds.
pub fn mean_p99(s: &Summary) -> f64 {
    mean(s.jct.values().map(|q| q.p99))
}

/// Mean makespan over workloads, seconds.
pub fn mean_makespan(s: &Summary) -> f64 {
    mean(s.makespan.values().copied())
}

fn hours(seconds: f64) -> String {
    format!("{:.2}", seconds / 3600.0)
}

/// The section in Markdown (`## Mixed GPU generations …`).
pub fn render(mixed: &Mixed, sia: &Path) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## Mixed GPU generations: the Sia traces on 64 GPUs of three types\n\n\
         The Sia artifact's workloads (Philly: 8 workloads of 160 jobs over 8 h; Helios, the \
         artifact's `saturn`: 10 workloads; newTrace: 10 workloads of 960 jobs over 48 h) on the \
         Sia paper's heterogeneous cluster `--cluster {MIXED_CLUSTER}` (24 T4, 24 RTX 2080 Ti, \
         16 A100), with each type's measured step times and largest micro-batch (the A100's \
         up to four times the T4's, as in the artifact's simulator; docs/heterogeneous.md, \
         \"Micro-batches per GPU type\") and the artifact's calibration \
         (`--calibration sia`). Data: Sia artifact (`siasosp23/artifacts`, commit `aaf7a0d`, \
         `sia-simulator/`), read in place from `{}`; published figures: Sia paper (SOSP'23) \
         Table 3. Times in hours; p99 and makespan are means over workloads of each workload's \
         figure; GPU-hours per job count restart delays; decision time is policy plus placement \
         per interval on one thread; simulation time is per workload.\n",
        sia.display()
    );
    let runs = match mixed {
        Mixed::Skipped(why) => {
            let _ = writeln!(md, "Not run this time: {why}.\n");
            return md;
        }
        Mixed::Ran(runs) => runs,
    };
    for (trace, _) in MIXED_TRACES {
        let of_trace: Vec<&MixedRun> = runs.iter().filter(|r| r.trace == trace).collect();
        if of_trace.is_empty() {
            continue;
        }
        let sia_mean = of_trace
            .iter()
            .find(|r| r.label == "sia")
            .map(|r| r.summary.mean);
        let _ = writeln!(md, "### {trace}\n");
        let mut t = Table::new(&[
            "policy",
            "mean JCT (h)",
            "against `sia`",
            "p99 JCT (h)",
            "makespan (h)",
            "GPU-hours per job",
            "restarts per job",
            "decision p50 / p95 (ms)",
            "simulation (s)",
        ]);
        for r in &of_trace {
            let s = &r.summary;
            let decision = s
                .decision_ms
                .map_or("–".into(), |q| format!("{:.1} / {:.1}", q.p50, q.p95));
            let workloads = s.avgs.len().max(1) as f64;
            t.row(vec![
                format!("`{}`", r.label),
                format!(
                    "{}{}",
                    hours(s.mean),
                    if s.finished { "" } else { " (unfinished)" }
                ),
                sia_mean.map_or("–".into(), |m| format!("{:.2}×", s.mean / m)),
                hours(mean_p99(s)),
                hours(mean_makespan(s)),
                format!("{:.1}", s.gpu_hours_per_job),
                format!("{:.2}", s.mean_restarts_per_job),
                decision,
                format!("{:.1}", r.seconds / workloads),
            ]);
        }
        for (_, policy, jct, p99, makespan, gpu_hours) in PUBLISHED.iter().filter(|p| p.0 == trace)
        {
            t.row(vec![
                format!("{policy} (paper)"),
                format!("{jct:.1}"),
                sia_mean.map_or("–".into(), |m| format!("({:.2}×)", jct * 3600.0 / m)),
                format!("{p99:.1}"),
                format!("{makespan:.1}"),
                format!("{gpu_hours:.1}"),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        md.push_str(&t.render());
        md.push('\n');
    }

    // Figure 6: each model's share of GPU time per type, over the three traces.
    let types: Vec<String> = parse_gpu_groups(MIXED_CLUSTER)
        .map(|g| g.0.into_iter().map(|g| g.gpu_type).collect())
        .unwrap_or_default();
    let mut hours_of: BTreeMap<(&str, String), BTreeMap<String, f64>> = BTreeMap::new();
    for r in runs {
        for (app, by_type) in &r.summary.gpu_hours_by_type {
            let entry = hours_of.entry((r.label.as_str(), app.clone())).or_default();
            for (gpu_type, h) in by_type {
                *entry.entry(gpu_type.clone()).or_default() += h;
            }
        }
    }
    let _ = writeln!(
        md,
        "### Where each model ran (Sia's Figure 6)\n\n\
         Share of each model's GPU time on each type ({}), over the three traces.\n",
        types.join(" / ")
    );
    let labels: Vec<&str> = {
        let mut seen = Vec::new();
        for r in runs {
            if !seen.contains(&r.label.as_str()) {
                seen.push(r.label.as_str());
            }
        }
        seen
    };
    let apps: Vec<String> = {
        let mut a: Vec<String> = hours_of.keys().map(|(_, app)| app.clone()).collect();
        a.sort();
        a.dedup();
        a
    };
    let mut header = vec!["model".to_string()];
    header.extend(labels.iter().map(|l| format!("`{l}`")));
    let header_refs: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new(&header_refs);
    for app in &apps {
        let mut row = vec![app.clone()];
        for label in &labels {
            let cell = hours_of
                .get(&(*label, app.clone()))
                .map(|by_type| {
                    let total: f64 = by_type.values().sum();
                    types
                        .iter()
                        .map(|ty| {
                            let h = by_type.get(ty).copied().unwrap_or(0.0);
                            format!("{:.0}", if total > 0.0 { 100.0 * h / total } else { 0.0 })
                        })
                        .collect::<Vec<_>>()
                        .join(" / ")
                })
                .unwrap_or_else(|| "–".into());
            row.push(cell);
        }
        t.row(row);
    }
    md.push_str(&t.render());
    md.push('\n');
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::ReportArgs;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        report: ReportArgs,
    }

    fn sia() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/sia")
    }

    /// The report's arguments with the Sia data of [`sia`] and `extra`.
    fn with_sia(extra: &[&str]) -> ReportArgs {
        let sia = sia();
        let head = ["report", "--sia", sia.to_str().unwrap()];
        Cli::parse_from(head.iter().chain(extra)).report
    }

    #[test]
    fn without_the_sia_data_the_section_says_why() {
        let args = Cli::parse_from(["report", "--sia", "/nonexistent/sia"]).report;
        let mixed = run(&args.mixed, &args.cluster, 1).unwrap();
        let md = render(&mixed, &args.mixed.sia);
        assert!(
            md.contains("Not run this time: left out: no Sia artifact data at `/nonexistent/sia`"),
            "{md}"
        );
        let args = Cli::parse_from(["report", "--skip-mixed"]).report;
        let Mixed::Skipped(why) = run(&args.mixed, &args.cluster, 1).unwrap() else {
            panic!("ran");
        };
        assert!(why.contains("--skip-mixed"));
    }

    #[test]
    fn an_unknown_policy_is_refused() {
        let args = with_sia(&["--mixed-policies", "nope"]);
        let err = run(&args.mixed, &args.cluster, 1).unwrap_err();
        assert!(err.to_string().contains("\"nope\""), "{err}");
    }

    /// One workload of each trace, two policies: every pair runs to completion on the mixed
    /// cluster, and the page shows each trace with the paper's figures and where each model
    /// ran.
    #[test]
    fn each_trace_runs_on_the_mixed_cluster_and_renders_next_to_the_paper() {
        let sia = sia();
        let args = with_sia(&[
            "--mixed-policies",
            "fifo",
            "quality",
            "--mixed-workloads",
            "1",
        ]);
        let Mixed::Ran(runs) = run(&args.mixed, &args.cluster, 2).unwrap() else {
            panic!(
                "skipped: the Sia artifact data is expected at {}",
                sia.display()
            );
        };
        let pairs: Vec<(&str, &str)> = runs.iter().map(|r| (r.trace, r.label.as_str())).collect();
        assert_eq!(
            pairs,
            [
                ("Philly", "fifo"),
                ("Philly", "quality"),
                ("Helios", "fifo"),
                ("Helios", "quality"),
                ("newTrace", "fifo"),
                ("newTrace", "quality"),
            ]
        );
        for r in &runs {
            assert!(r.summary.finished, "{} {}", r.trace, r.label);
            assert_eq!(r.summary.avgs.len(), 1);
            assert!(r.summary.gpu_hours_per_job > 0.0);
        }
        // quality uses every type; its GPU time per type adds up to its GPU-hours.
        let quality: Vec<&MixedRun> = runs.iter().filter(|r| r.label == "quality").collect();
        let types: std::collections::BTreeSet<&String> = quality
            .iter()
            .flat_map(|r| r.summary.gpu_hours_by_type.values().flat_map(|t| t.keys()))
            .collect();
        assert_eq!(types.len(), 3, "{types:?}");
        let md = render(&Mixed::Ran(runs.clone()), &sia);
        for heading in [
            "### Philly",
            "### Helios",
            "### newTrace",
            "### Where each model ran",
        ] {
            assert!(md.contains(heading), "{heading}");
        }
        assert_eq!(md.matches("| Sia (paper) | ").count(), 3, "{md}");
        assert_eq!(md.matches("| Pollux (paper) | ").count(), 3, "{md}");
        for app in ["bert", "cifar10", "deepspeech2", "imagenet", "yolov3"] {
            assert!(md.contains(&format!("\n| {app} | ")), "{app}: {md}");
        }
    }
}
