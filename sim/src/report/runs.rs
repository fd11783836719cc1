//! The simulator comparison's tables of how the runs went beyond their JCTs: restarts per job
//! by application (and thrashing), and the simulations' wall time.

use super::page::Page;
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub(super) fn restarts_section(md: &mut String, page: &Page) {
    let _ = writeln!(
        md,
        "### Restarts per job by application (1.0×, all eight workloads)\n"
    );
    let apps = [
        "cifar10",
        "ncf",
        "bert",
        "deepspeech2",
        "yolov3",
        "imagenet",
    ];
    let _ = writeln!(
        md,
        "Last two columns: jobs with at least one restart that changed their goodput by at most \
         10 % (the true progress rate at the new worker count against the old), *thrashing* by \
         the goodput issue's rule, out of all jobs; and such restarts out of all restarts.\n"
    );
    let _ = writeln!(
        md,
        "| policy | {} | thrashing jobs | low-gain restarts |",
        apps.join(" | ")
    );
    let _ = writeln!(md, "|---|{}", "---|".repeat(apps.len() + 2));
    for p in page.policies {
        let Some(r) = page.run(p, "1.0") else {
            continue;
        };
        let cells: Vec<String> = apps
            .iter()
            .map(|app| {
                let v: Vec<f64> = r
                    .restarts
                    .values()
                    .flat_map(|m| m.iter())
                    .filter(|(job, _)| job.rsplit_once('-').is_some_and(|(a, _)| a == *app))
                    .map(|(_, n)| f64::from(*n))
                    .collect();
                if v.is_empty() {
                    "-".into()
                } else {
                    format!("{:.1}", v.iter().sum::<f64>() / v.len() as f64)
                }
            })
            .collect();
        let jobs: usize = r.restarts.values().map(BTreeMap::len).sum();
        let restarts: u64 = r
            .restarts
            .values()
            .flat_map(|m| m.values())
            .map(|&n| u64::from(n))
            .sum();
        let _ = writeln!(
            md,
            "| `{p}` | {} | {} / {jobs} | {} / {restarts} |",
            cells.join(" | "),
            r.thrashing_jobs,
            r.low_gain_restarts
        );
    }
}

pub(super) fn simulation_time_section(md: &mut String, page: &Page) {
    let _ = writeln!(md, "### Simulation time\n");
    let _ = writeln!(
        md,
        "Wall time on one thread per 160-job workload (1.0×; target: under 10 s with any policy) \
         and for all eight workloads of each load ({} simulations at a time).\n",
        page.threads
    );
    let _ = writeln!(
        md,
        "| policy | slowest 1.0× workload | mean 1.0× workload | all eight 1.0× | all eight 0.5× |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|");
    for p in page.policies {
        let t = |load: &str| {
            page.results
                .get(&(p.clone(), load.to_string()))
                .map_or("-".into(), |r| format!("{:.1} s", r.seconds))
        };
        let per: Vec<f64> = page
            .run(p, "1.0")
            .map(|r| r.simulation_s.values().copied().collect())
            .unwrap_or_default();
        let slowest = per.iter().copied().fold(0.0, f64::max);
        let mean = per.iter().sum::<f64>() / per.len().max(1) as f64;
        let _ = writeln!(
            md,
            "| `{p}` | {slowest:.2} s | {mean:.2} s | {} | {} |",
            t("1.0"),
            t("0.5")
        );
    }
    let over: Vec<String> = page
        .policies
        .iter()
        .filter_map(|p| {
            let slowest = page
                .run(p, "1.0")?
                .simulation_s
                .values()
                .copied()
                .fold(0.0, f64::max);
            (slowest >= 10.0).then(|| format!("`{p}` ({slowest:.1} s)"))
        })
        .collect();
    if over.is_empty() {
        let _ = writeln!(
            md,
            "\nTarget (under 10 s per 1.0× workload): met by every policy."
        );
    } else {
        let _ = writeln!(
            md,
            "\nTarget (under 10 s per 1.0× workload): **missed** by {}.",
            over.join(", ")
        );
    }
    md.push('\n');
}
