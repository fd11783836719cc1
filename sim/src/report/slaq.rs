//! The simulator comparison's SLAQ section: the quality variants against `fair` on SLAQ's
//! metrics, next to SLAQ's published changes and the targets.

use super::page::{Page, change, pct1, verdict};
use crate::summary::Summary;
use converge_sched::policies::Objective;
use std::fmt::Write as _;

/// SLAQ's published changes against a fair scheduler (Zhang et al., SoCC'17): average
/// normalized loss, time to 90 % and to 95 % loss reduction.
const SLAQ_LOSS: f64 = -0.73;
const SLAQ_T90: f64 = -0.45;
const SLAQ_T95: f64 = -0.30;
/// The targets for the quality policy against `fair`: average normalized loss and
/// time to 90 % loss reduction.
const TARGET_LOSS: f64 = -0.50;
const TARGET_T90: f64 = -0.30;

pub(super) fn slaq_section(md: &mut String, page: &Page) {
    let _ = writeln!(
        md,
        "\n### SLAQ's metrics: the quality variants against `fair` (1.0×)\n"
    );
    let variants = page.variants();
    let (Some(fair), false) = (page.run("fair", "1.0"), variants.is_empty()) else {
        let _ = writeln!(
            md,
            "Needs `fair` and at least one quality variant in `--policies`.\n"
        );
        return;
    };
    let present: Vec<(&str, Objective, &Summary)> = variants
        .iter()
        .filter_map(|&(label, objective)| Some((label, objective, page.run(label, "1.0")?)))
        .collect();
    let _ = write!(md, "| metric | `fair` |");
    for (label, objective, _) in &present {
        let _ = write!(md, " `{label}` ({}) |", objective.as_str());
    }
    let _ = writeln!(md, "\n|---|---|{}", "---|".repeat(present.len()));
    type Metric = fn(&Summary) -> f64;
    let rows: [(&str, Metric, usize); 5] = [
        (
            "average normalized loss over time",
            |s| s.mean_normalized_loss,
            3,
        ),
        ("time to 90 % loss reduction (s)", |s| s.mean_time_to_90, 0),
        ("time to 95 % loss reduction (s)", |s| s.mean_time_to_95, 0),
        ("mean JCT (s)", |s| s.mean, 0),
        ("restarts per job", |s| s.mean_restarts_per_job, 2),
    ];
    for (name, metric, digits) in rows {
        let _ = write!(md, "| {name} | {:.digits$} |", metric(fair));
        for (_, _, s) in &present {
            let _ = write!(md, " {:.digits$} |", metric(s));
        }
        md.push('\n');
    }

    let _ = writeln!(
        md,
        "\nChange against `fair` (negative is better), next to SLAQ's published changes \
         against a fair scheduler and the issue's targets:\n"
    );
    let _ = writeln!(
        md,
        "| | average normalized loss | time to 90 % | time to 95 % | mean JCT | loss target (≤ {:.0} %) | time-to-90 % target (≤ {:.0} %) |",
        TARGET_LOSS * 100.0,
        TARGET_T90 * 100.0
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    let mut both_met = Vec::new();
    for (label, _, s) in &present {
        let loss = change(s.mean_normalized_loss, fair.mean_normalized_loss);
        let t90 = change(s.mean_time_to_90, fair.mean_time_to_90);
        let (v_loss, v_t90) = (verdict(loss, TARGET_LOSS), verdict(t90, TARGET_T90));
        if v_loss == "met" && v_t90 == "met" {
            both_met.push(format!("`{label}`"));
        }
        let _ = writeln!(
            md,
            "| `{label}` vs `fair` | {} | {} | {} | {} | {v_loss} | {v_t90} |",
            pct1(loss),
            pct1(t90),
            pct1(change(s.mean_time_to_95, fair.mean_time_to_95)),
            pct1(change(s.mean, fair.mean)),
        );
    }
    let _ = writeln!(
        md,
        "| SLAQ (published) | {} | {} | {} | | | |",
        pct1(Some(SLAQ_LOSS)),
        pct1(Some(SLAQ_T90)),
        pct1(Some(SLAQ_T95))
    );
    let _ = writeln!(
        md,
        "| issue target | ≤ {:.0} % | ≤ {:.0} % | | | | |",
        TARGET_LOSS * 100.0,
        TARGET_T90 * 100.0
    );
    let _ = writeln!(
        md,
        "\nBoth targets met by: {}.",
        if both_met.is_empty() {
            "none of the variants".to_string()
        } else {
            both_met.join(", ")
        }
    );
    let _ = writeln!(md, "{QUALITY_NOTES}");
}

/// What the quality variants maximize.
const QUALITY_NOTES: &str = "
Reading the quality rows. The three variants are the service's quality policy
(`sched/src/policies/quality.rs`, `docs/scheduling.md`) with the same settings; they differ only in
what they maximize over the horizon, summed over jobs:
- `loss` (SLAQ's objective): the predicted loss reduction, normalized per job by its loss
  range. A short job (cifar10, minutes) removes a large share of its range per horizon, a
  long one (yolov3, imagenet: hours) a tiny share, so the long jobs give up GPUs at arrivals
  and get them back at departures, paying the restart cost each time.
- `jct` (completion-time aware, after heSRPT): each job's speedup weighted by its rank by
  remaining time, so that shorter jobs get more GPUs and long ones still get some; a change
  of allocation pays the restart budget (a job spends at most about a tenth of its age
  restarting).
- `both`: the sum of the two (both dimensionless, per horizon).
- `auto` (the default, `quality`): `loss` for exploratory jobs (a sweep's trials, jobs with
  stop criteria but no target), `jct` for any other; as `jct` on these workloads.

SLAQ measured its changes on its own Spark MLlib jobs against a fair scheduler; here the jobs
are the Pollux traces' deep-learning jobs and `fair` is our work-conserving equal share, so
the published figures are a reference, not a like-for-like comparison. The targets are
checked from the numbers above.
";
