//! `converge-sim ps-bench`: the PS planner against its LP bound, the exhaustive
//! optimum and the greedy baseline on seeded random small instances, and an online
//! sequence; prints (and optionally writes) Markdown. This part does I/O and reads the
//! clock; the algorithms are in [`converge_sched::ps_plan`] and [`crate::ps_offline`].

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, ensure};
use rand::SeedableRng as _;
use rand_chacha::ChaCha8Rng;

use converge_sched::ps_plan::{
    PsHost, PsJob, PsMethod, PsOptions, greedy_ps_job, plan_ps_job_with,
};

use converge_sched::ps_plan::fixtures::{random_host, random_instance, random_job};

use crate::ps_offline::{
    exact_search_size, optimal_ps_fixed, optimal_ps_job, place_ps_jobs_online_with,
};

/// The target: within this factor of the LP bound on small instances.
pub const TARGET_RATIO: f64 = 1.25;

/// `converge-sim ps-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct PsBenchArgs {
    /// Random small instances (2–4 hosts).
    #[arg(long, default_value_t = 1000)]
    pub instances: usize,
    /// Seed of the instances and of the rounding.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Randomized roundings per (w, p) pair.
    #[arg(long, default_value_t = converge_sched::ps_plan::DEFAULT_ROUNDINGS)]
    pub roundings: usize,
    /// Largest exhaustive search (placements evaluated) per instance.
    #[arg(long, default_value_t = 20_000_000)]
    pub max_exact: u64,
    /// Hosts of the online sequence.
    #[arg(long, default_value_t = 8)]
    pub online_hosts: usize,
    /// Jobs of the online sequence.
    #[arg(long, default_value_t = 24)]
    pub online_jobs: usize,
    /// Also write the Markdown here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

fn share(v: &[f64], pred: impl Fn(f64) -> bool) -> String {
    let n = v.iter().filter(|&&r| pred(r)).count();
    format!(
        "{n}/{} ({:.0} %)",
        v.len(),
        100.0 * n as f64 / v.len().max(1) as f64
    )
}

/// Runs the benchmark and returns the Markdown.
pub fn render(args: &PsBenchArgs) -> anyhow::Result<String> {
    ensure!(args.instances > 0, "--instances must be positive");
    ensure!(args.online_hosts > 0, "--online-hosts must be positive");
    let opts = PsOptions {
        roundings: args.roundings,
        local_search_starts: converge_sched::ps_plan::DEFAULT_LOCAL_SEARCH_STARTS,
    };
    let plain = PsOptions {
        local_search_starts: 0,
        ..opts
    };
    let started = Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let (mut step_vs_lp, mut tps_vs_lp) = (Vec::new(), Vec::new());
    let (mut tps_vs_exact, mut step_vs_exact, mut exact_vs_lp) =
        (Vec::new(), Vec::new(), Vec::new());
    let mut over_greedy = Vec::new();
    let (mut plain_vs_lp, mut plain_vs_exact) = (Vec::new(), Vec::new());
    let mut t_plain = 0.0f64;
    let (mut greedy_chosen, mut lp_failures, mut exact_skipped) = (0usize, 0u32, 0usize);
    let (mut t_ours, mut t_greedy, mut t_exact) = (0.0f64, 0.0f64, 0.0f64);
    let mut worst: Option<(f64, String)> = None;
    for i in 0..args.instances {
        let (hosts, job) = random_instance(&mut rng);
        let t = Instant::now();
        let ours = plan_ps_job_with(&hosts, &job, args.seed.wrapping_add(i as u64), &opts)
            .context("a generated instance did not fit")?;
        t_ours += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let rounded = plan_ps_job_with(&hosts, &job, args.seed.wrapping_add(i as u64), &plain)
            .context("a generated instance did not fit")?;
        t_plain += t.elapsed().as_secs_f64();
        plain_vs_lp.push(rounded.lp_bound_throughput / rounded.throughput);
        let t = Instant::now();
        let greedy = greedy_ps_job(&hosts, &job).context("greedy found no plan")?;
        t_greedy += t.elapsed().as_secs_f64();
        let r = ours.step_time_s / ours.lp_bound_step_time_s;
        step_vs_lp.push(r);
        tps_vs_lp.push(ours.lp_bound_throughput / ours.throughput);
        over_greedy.push(ours.throughput / greedy.throughput - 1.0);
        if ours.method == PsMethod::Greedy {
            greedy_chosen += 1;
        }
        lp_failures += ours.lp_failures;
        if worst.as_ref().is_none_or(|(w, _)| r > *w) {
            worst = Some((
                r,
                format!(
                    "hosts {:?}; M = {:.0} MB, t_c = {:.3} s, g = {}, w ∈ [{}, {}], \
                     p ∈ [{}, {}]; plan w = {}, p = {}, workers {:?}, shards {:?}, \
                     step {:.3} s vs LP bound {:.3} s",
                    hosts
                        .iter()
                        .map(|h| (h.free_gpus, h.free_cpu_slots, h.nic_bytes_per_s / 1.25e8))
                        .collect::<Vec<_>>(),
                    job.model_bytes / 1e6,
                    job.compute_s,
                    job.gpus_per_worker,
                    job.min_workers,
                    job.max_workers,
                    job.min_shards,
                    job.max_shards,
                    ours.workers,
                    ours.shards,
                    ours.workers_per_host,
                    ours.shards_per_host,
                    ours.step_time_s,
                    ours.lp_bound_step_time_s,
                ),
            ));
        }
        if exact_search_size(&hosts, &job) <= u128::from(args.max_exact) {
            let t = Instant::now();
            let exact = optimal_ps_job(&hosts, &job).context("no exact plan")?;
            let best_same_w = (job.min_shards..=job.max_shards)
                .filter_map(|p| optimal_ps_fixed(&hosts, &job, ours.workers, p))
                .map(|(_, _, s)| s)
                .fold(f64::INFINITY, f64::min);
            t_exact += t.elapsed().as_secs_f64();
            tps_vs_exact.push(exact.throughput / ours.throughput);
            plain_vs_exact.push(exact.throughput / rounded.throughput);
            step_vs_exact.push(ours.step_time_s / best_same_w);
            exact_vs_lp.push(best_same_w / ours.lp_bound_step_time_s);
        } else {
            exact_skipped += 1;
        }
    }
    let n = args.instances;
    let mut md = String::new();
    let _ = writeln!(md, "# PS planning: LP relaxation + randomized rounding\n");
    let _ = writeln!(
        md,
        "Command: `converge-sim ps-bench --instances {n} --seed {} --roundings {} \
         --max-exact {} --online-hosts {} --online-jobs {}`\n",
        args.seed, args.roundings, args.max_exact, args.online_hosts, args.online_jobs
    );
    let _ = writeln!(
        md,
        "Random instances: 2–4 hosts × 2–8 GPUs, 2–4 CPU slots, 10/25/100 GbE; one job of \
         10 MB–2 GB, t_c 0.05–1 s, up to 12 workers and 4 shards; the planner picks w, p \
         and the placement maximizing throughput. Ratios ≥ 1; \"time per sample\" is \
         1/throughput.\n"
    );
    let _ = writeln!(md, "| metric | mean | worst | share |");
    let _ = writeln!(md, "| --- | --- | --- | --- |");
    let _ = writeln!(
        md,
        "| step time / LP bound (same w), {n} instances | {:.3} | {:.3} | ≤ {TARGET_RATIO}: {} |",
        mean(&step_vs_lp),
        max(&step_vs_lp),
        share(&step_vs_lp, |r| r <= TARGET_RATIO)
    );
    let _ = writeln!(
        md,
        "| time per sample / LP bound (any w, p) | {:.3} | {:.3} | ≤ {TARGET_RATIO}: {} |",
        mean(&tps_vs_lp),
        max(&tps_vs_lp),
        share(&tps_vs_lp, |r| r <= TARGET_RATIO)
    );
    let _ = writeln!(
        md,
        "| time per sample / exact optimum, {} instances | {:.4} | {:.4} | optimal: {} |",
        tps_vs_exact.len(),
        mean(&tps_vs_exact),
        max(&tps_vs_exact),
        share(&tps_vs_exact, |r| r <= 1.0 + 1e-9)
    );
    let _ = writeln!(
        md,
        "| step time / exact optimum (same w) | {:.4} | {:.4} | optimal: {} |",
        mean(&step_vs_exact),
        max(&step_vs_exact),
        share(&step_vs_exact, |r| r <= 1.0 + 1e-9)
    );
    let _ = writeln!(
        md,
        "| exact optimum / LP bound (same w; the relaxation's gap) | {:.3} | {:.3} | ≤ {TARGET_RATIO}: {} |",
        mean(&exact_vs_lp),
        max(&exact_vs_lp),
        share(&exact_vs_lp, |r| r <= TARGET_RATIO)
    );
    let _ = writeln!(
        md,
        "| rounding only (no shard moves): time per sample / LP bound | {:.3} | {:.3} | ≤ {TARGET_RATIO}: {} |",
        mean(&plain_vs_lp),
        max(&plain_vs_lp),
        share(&plain_vs_lp, |r| r <= TARGET_RATIO)
    );
    let _ = writeln!(
        md,
        "| rounding only (no shard moves): time per sample / exact optimum | {:.4} | {:.4} | optimal: {} |",
        mean(&plain_vs_exact),
        max(&plain_vs_exact),
        share(&plain_vs_exact, |r| r <= 1.0 + 1e-9)
    );
    let _ = writeln!(
        md,
        "| throughput gain over greedy-only | {:+.1} % | max {:+.1} % | better: {} |",
        100.0 * mean(&over_greedy),
        100.0 * max(&over_greedy),
        share(&over_greedy, |r| r > 1e-9)
    );
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Greedy plan chosen (LP failed, or greedy strictly better than every rounding): \
         {greedy_chosen}/{n}; (w, p) pairs whose LP failed: {lp_failures}; exhaustive \
         search skipped (over --max-exact): {exact_skipped}.\n"
    );
    let _ = writeln!(
        md,
        "Run time: LP + rounding + shard moves {:.1} ms per instance ({:.2} s in all), \
         rounding only {:.1} ms, greedy {:.3} ms, exhaustive {:.1} ms.\n",
        1e3 * t_ours / n as f64,
        t_ours,
        1e3 * t_plain / n as f64,
        1e3 * t_greedy / n as f64,
        1e3 * t_exact / tps_vs_exact.len().max(1) as f64,
    );
    if let Some((r, text)) = &worst {
        let _ = writeln!(md, "Worst step time / LP bound ({r:.3}): {text}.\n");
    }
    let met = max(&step_vs_lp) <= TARGET_RATIO;
    let _ = writeln!(
        md,
        "Target (within {TARGET_RATIO}× of the LP bound on every small instance): **{}** \
         (step time at the chosen w; {} of instances within it).\n",
        if met { "met" } else { "not met" },
        share(&step_vs_lp, |r| r <= TARGET_RATIO)
    );

    // Online sequence.
    let mut orng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x5eed);
    let hosts: Vec<PsHost> = (0..args.online_hosts)
        .map(|_| random_host(&mut orng))
        .collect();
    let jobs: Vec<PsJob> = (0..args.online_jobs)
        .map(|_| {
            let mut j = random_job(&mut orng, 8, 4, 8);
            j.target_fraction = 0.9;
            j
        })
        .collect();
    let t = Instant::now();
    let (lp_plans, _) = place_ps_jobs_online_with(&hosts, &jobs, args.seed, |h, j, s| {
        plan_ps_job_with(h, j, s, &opts)
    });
    let t_online = t.elapsed().as_secs_f64();
    let (greedy_plans, _) =
        place_ps_jobs_online_with(&hosts, &jobs, args.seed, |h, j, _| greedy_ps_job(h, j));
    let _ = writeln!(
        md,
        "## Online: {} jobs arriving on {} hosts ({} GPUs, {} CPU slots)\n",
        jobs.len(),
        hosts.len(),
        hosts.iter().map(|h| h.free_gpus).sum::<u32>(),
        hosts.iter().map(|h| h.free_cpu_slots).sum::<u32>()
    );
    let _ = writeln!(
        md,
        "Each job takes the fewest workers reaching 90 % of its best throughput on what is \
         left; NIC shares are reserved. Effective workers = Σ w·t_c/S over admitted jobs.\n"
    );
    let _ = writeln!(
        md,
        "| planner | admitted | effective workers | mean S/t_c | GPUs used |"
    );
    let _ = writeln!(md, "| --- | --- | --- | --- | --- |");
    for (name, plans) in [("LP + rounding", &lp_plans), ("greedy", &greedy_plans)] {
        let admitted: Vec<(&PsJob, &converge_sched::ps_plan::PsPlan)> = jobs
            .iter()
            .zip(plans.iter())
            .filter_map(|(j, p)| p.as_ref().map(|p| (j, p)))
            .collect();
        let eff: f64 = admitted
            .iter()
            .map(|(j, p)| f64::from(p.workers) * j.compute_s / p.step_time_s)
            .sum();
        let slow: Vec<f64> = admitted
            .iter()
            .map(|(j, p)| p.step_time_s / j.compute_s)
            .collect();
        let gpus: u32 = admitted
            .iter()
            .map(|(j, p)| p.workers * j.gpus_per_worker)
            .sum();
        let _ = writeln!(
            md,
            "| {name} | {}/{} | {:.2} | {:.2} | {gpus} |",
            admitted.len(),
            jobs.len(),
            eff,
            mean(&slow)
        );
    }
    let _ = writeln!(
        md,
        "\nOnline LP planning time: {:.1} ms. Total run time: {:.2} s.",
        1e3 * t_online,
        started.elapsed().as_secs_f64()
    );
    Ok(md)
}

/// `converge-sim ps-bench`: prints the Markdown and writes it to `--out`.
pub fn run_ps_bench(args: &PsBenchArgs) -> anyhow::Result<()> {
    let md = render(args)?;
    crate::markdown::emit(&md, args.out.as_deref())
}
