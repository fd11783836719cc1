//! `converge-sim makespan-bench`: SJF-BCO and first-fit FIFO against the exact
//! event-start optimum ([`crate::makespan::optimal`]) on seeded random small instances, and SJF-BCO
//! against first-fit FIFO on larger ones; prints (and optionally writes) Markdown tables.
//! This part does I/O and reads the clock; the algorithms are in [`super`].

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::ensure;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::makespan::{
    Instance, ListMode, MakespanJob, bco_over_kappa, cmp_f64, fifo_first_fit, optimal_with_limit,
    sjf_bco, sjf_bco_with, sjf_order,
};
use converge_sched::contention::JobCost;

/// The target: SJF-BCO within this factor of the optimum on every small instance.
pub const TARGET_RATIO: f64 = 1.2;
/// The target: SJF-BCO's makespan at least this fraction below first-fit FIFO's.
pub const TARGET_REDUCTION: f64 = 0.20;

/// `converge-sim makespan-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct MakespanBenchArgs {
    /// Small random instances per server count.
    #[arg(long, default_value_t = 100)]
    pub instances: usize,
    /// Seed of the random instances.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fewest jobs in a small instance.
    #[arg(long, default_value_t = 2)]
    pub min_jobs: usize,
    /// Most jobs in a small instance.
    #[arg(long, default_value_t = 6)]
    pub max_jobs: usize,
    /// Server counts of the small instances.
    #[arg(long, value_delimiter = ',', default_value = "3,4")]
    pub servers: Vec<u32>,
    /// GPUs per server (small and large instances).
    #[arg(long, default_value_t = 4)]
    pub gpus_per_server: u32,
    /// Most GPUs of a job in a small instance.
    #[arg(long, default_value_t = 8)]
    pub max_gpus: u32,
    /// Search nodes allowed per optimum (an instance that needs more is reported as not
    /// proven).
    #[arg(long, default_value_t = 50_000_000)]
    pub max_nodes: u64,
    /// Jobs in a large instance.
    #[arg(long, default_value_t = 30)]
    pub large_jobs: usize,
    /// Servers in a large instance.
    #[arg(long, default_value_t = 16)]
    pub large_servers: u32,
    /// Most GPUs of a job in a large instance.
    #[arg(long, default_value_t = 16)]
    pub large_max_gpus: u32,
    /// Large instances (seeds `seed`, `seed + 1`, …).
    #[arg(long, default_value_t = 20)]
    pub large_seeds: u64,
    /// Also write the Markdown here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A random instance: `jobs` jobs of 1 to `max_gpus` GPUs (capped at the cluster),
/// about half of them needing more than one server, `iterations` log-uniform in
/// [100, 2000], compute 0.2–1 s per step, NIC sync 0.5–2× compute (real contention),
/// overhead 0–10 % of compute per extra server, intra-node sync 0–20 % of the NIC sync.
pub fn random_instance(
    rng: &mut ChaCha8Rng,
    servers: u32,
    gpus_per_server: u32,
    jobs: usize,
    max_gpus: u32,
) -> Instance {
    let capacity = servers * gpus_per_server;
    let jobs = (0..jobs)
        .map(|_| {
            let gpus = rng.gen_range(1..=max_gpus.max(1)).min(capacity);
            let iterations = (rng.gen_range(100f64.ln()..2000f64.ln())).exp().round();
            let compute = rng.gen_range(0.2..1.0);
            let sync = compute * rng.gen_range(0.5..2.0);
            let cost = JobCost {
                compute_s: compute,
                overhead_s_per_server: compute * rng.gen_range(0.0..0.1),
                sync_s: sync,
                intra_sync_s: sync * rng.gen_range(0.0..0.2),
                background_sync: false,
            };
            MakespanJob::new(gpus, iterations, cost)
        })
        .collect();
    Instance::new(servers, gpus_per_server, jobs).expect("generated instances are valid")
}

/// One small instance's results.
#[derive(Debug, Clone, Copy)]
struct SmallResult {
    jobs: usize,
    optimum: f64,
    proven: bool,
    sjf: f64,
    sjf_backfill: f64,
    lpt: f64,
    fifo: f64,
    nodes: u64,
    seconds: f64,
}

/// One large instance's results (makespans in seconds).
#[derive(Debug, Clone, Copy)]
struct LargeResult {
    seed: u64,
    sjf: f64,
    kappa: u32,
    fifo: f64,
    lpt: f64,
    bound: f64,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn worst(v: &[f64]) -> f64 {
    v.iter()
        .copied()
        .max_by(|a, b| cmp_f64(*a, *b))
        .unwrap_or(f64::NAN)
}

fn best(v: &[f64]) -> f64 {
    v.iter()
        .copied()
        .min_by(|a, b| cmp_f64(*a, *b))
        .unwrap_or(f64::NAN)
}

/// The makespan of BCO-κ list scheduling, strict, largest estimated job first (the
/// reverse of SJF's order): not SJF-BCO, shown to tell the order's share of the gap.
fn lpt_bco(instance: &Instance) -> f64 {
    let mut order = sjf_order(instance);
    order.reverse();
    bco_over_kappa(instance, &order, ListMode::Strict)
        .1
        .makespan_s
}

/// Runs the benchmark and returns the Markdown.
pub fn render(args: &MakespanBenchArgs) -> anyhow::Result<String> {
    ensure!(
        args.gpus_per_server > 0,
        "--gpus-per-server must be positive"
    );
    ensure!(
        args.min_jobs >= 1 && args.min_jobs <= args.max_jobs,
        "need 1 ≤ --min-jobs ≤ --max-jobs"
    );
    ensure!(
        args.servers.iter().all(|&s| s > 0) && !args.servers.is_empty(),
        "--servers must list positive counts"
    );
    ensure!(args.large_servers > 0, "--large-servers must be positive");
    let started = Instant::now();
    let mut md = String::new();
    let _ = writeln!(md, "# Makespan: SJF-BCO vs first-fit FIFO vs the optimum\n");
    let _ = writeln!(
        md,
        "Command: `converge-sim makespan-bench --instances {} --seed {} --min-jobs {} \
         --max-jobs {} --servers {} --gpus-per-server {} --max-gpus {} --large-jobs {} \
         --large-servers {} --large-max-gpus {} --large-seeds {}`\n",
        args.instances,
        args.seed,
        args.min_jobs,
        args.max_jobs,
        args.servers
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.gpus_per_server,
        args.max_gpus,
        args.large_jobs,
        args.large_servers,
        args.large_max_gpus,
        args.large_seeds,
    );

    // Small instances against the optimum.
    let mut results: Vec<(u32, SmallResult)> = Vec::new();
    for (k, &servers) in args.servers.iter().enumerate() {
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(1000 * k as u64));
        for _ in 0..args.instances {
            let jobs = rng.gen_range(args.min_jobs..=args.max_jobs);
            let instance =
                random_instance(&mut rng, servers, args.gpus_per_server, jobs, args.max_gpus);
            let t = Instant::now();
            let optimum = optimal_with_limit(&instance, args.max_nodes);
            let seconds = t.elapsed().as_secs_f64();
            results.push((
                servers,
                SmallResult {
                    jobs,
                    optimum: optimum.schedule.makespan_s,
                    proven: optimum.proven,
                    sjf: sjf_bco(&instance).makespan_s,
                    sjf_backfill: sjf_bco_with(&instance, ListMode::Backfill).1.makespan_s,
                    lpt: lpt_bco(&instance),
                    fifo: fifo_first_fit(&instance).makespan_s,
                    nodes: optimum.nodes,
                    seconds,
                },
            ));
        }
    }
    let _ = writeln!(
        md,
        "## Small instances: ratio to the optimum\n\n\
         Random instances of {}–{} jobs of 1–{} GPUs on servers of {} GPUs ({} per server \
         count, seed {}); iterations log-uniform in [100, 2000], compute 0.2–1 s per step, \
         NIC sync 0.5–2× compute, overhead 0–10 % of compute per extra server. The optimum \
         is the exact minimum over event-start schedules (every list schedule is one; see \
         `sim/src/makespan.rs`). SJF-BCO is strict list order; \"backfill\" is the \
         same with backfilling; \"LPT-BCO\" (not part of SJF-BCO, for comparison) is BCO-κ \
         with the largest estimated job first. Reduction = 1 − SJF-BCO / FIFO-FF \
         makespan. Optimum time: total and slowest instance (release build, one \
         thread).\n",
        args.min_jobs,
        args.max_jobs,
        args.max_gpus,
        args.gpus_per_server,
        args.instances,
        args.seed,
    );
    let _ = writeln!(
        md,
        "| servers | instances | proven | SJF-BCO/opt mean | worst | ≤ {TARGET_RATIO}× | \
         backfill/opt mean | worst | LPT-BCO/opt mean | worst | FIFO-FF/opt mean | worst \
         | reduction vs FIFO-FF mean | SJF-BCO worse than FIFO-FF | optimum time total / \
         max | nodes max |"
    );
    let _ = writeln!(
        md,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut groups: Vec<(String, Vec<SmallResult>)> = args
        .servers
        .iter()
        .map(|&s| {
            (
                s.to_string(),
                results.iter().filter(|r| r.0 == s).map(|r| r.1).collect(),
            )
        })
        .collect();
    if args.servers.len() > 1 {
        groups.push(("all".to_string(), results.iter().map(|r| r.1).collect()));
    }
    for (label, rs) in &groups {
        let sjf: Vec<f64> = rs.iter().map(|r| r.sjf / r.optimum).collect();
        let bf: Vec<f64> = rs.iter().map(|r| r.sjf_backfill / r.optimum).collect();
        let lpt: Vec<f64> = rs.iter().map(|r| r.lpt / r.optimum).collect();
        let fifo: Vec<f64> = rs.iter().map(|r| r.fifo / r.optimum).collect();
        let reduction: Vec<f64> = rs.iter().map(|r| 1.0 - r.sjf / r.fifo).collect();
        let within = sjf.iter().filter(|&&x| x <= TARGET_RATIO).count();
        let worse = rs.iter().filter(|r| r.sjf > r.fifo * (1.0 + 1e-9)).count();
        let proven = rs.iter().filter(|r| r.proven).count();
        let total: f64 = rs.iter().map(|r| r.seconds).sum();
        let slowest = rs.iter().map(|r| r.seconds).fold(0.0, f64::max);
        let nodes = rs.iter().map(|r| r.nodes).max().unwrap_or(0);
        let _ = writeln!(
            md,
            "| {label} | {} | {proven} | {:.3} | {:.3} | {within}/{} | {:.3} | {:.3} | {:.3} \
             | {:.3} | {:.3} | {:.3} | {:.1} % | {worse} | {:.2} s / {:.2} s | {nodes} |",
            rs.len(),
            mean(&sjf),
            worst(&sjf),
            rs.len(),
            mean(&bf),
            worst(&bf),
            mean(&lpt),
            worst(&lpt),
            mean(&fifo),
            worst(&fifo),
            100.0 * mean(&reduction),
            total,
            slowest,
        );
    }
    let _ = writeln!(md);
    // By job count (all server counts).
    let _ = writeln!(
        md,
        "By number of jobs (all server counts):\n\n\
         | jobs | instances | SJF-BCO/opt mean | worst | FIFO-FF/opt mean | worst | \
         reduction vs FIFO-FF mean | optimum time mean |\n|---|---|---|---|---|---|---|---|"
    );
    for jobs in args.min_jobs..=args.max_jobs {
        let rs: Vec<SmallResult> = results
            .iter()
            .map(|r| r.1)
            .filter(|r| r.jobs == jobs)
            .collect();
        if rs.is_empty() {
            continue;
        }
        let sjf: Vec<f64> = rs.iter().map(|r| r.sjf / r.optimum).collect();
        let fifo: Vec<f64> = rs.iter().map(|r| r.fifo / r.optimum).collect();
        let reduction: Vec<f64> = rs.iter().map(|r| 1.0 - r.sjf / r.fifo).collect();
        let secs: Vec<f64> = rs.iter().map(|r| r.seconds).collect();
        let _ = writeln!(
            md,
            "| {jobs} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} % | {:.3} s |",
            rs.len(),
            mean(&sjf),
            worst(&sjf),
            mean(&fifo),
            worst(&fifo),
            100.0 * mean(&reduction),
            mean(&secs),
        );
    }
    let _ = writeln!(md);

    // Large instances, no optimum.
    let mut large: Vec<LargeResult> = Vec::new();
    let mut heuristic_seconds = 0.0;
    for i in 0..args.large_seeds {
        let seed = args.seed.wrapping_add(i);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_1a46e);
        let instance = random_instance(
            &mut rng,
            args.large_servers,
            args.gpus_per_server,
            args.large_jobs,
            args.large_max_gpus,
        );
        let t = Instant::now();
        let (kappa, sjf) = sjf_bco_with(&instance, ListMode::Strict);
        let fifo = fifo_first_fit(&instance);
        heuristic_seconds += t.elapsed().as_secs_f64();
        large.push(LargeResult {
            seed,
            sjf: sjf.makespan_s,
            kappa,
            fifo: fifo.makespan_s,
            lpt: lpt_bco(&instance),
            bound: instance.lower_bound_s(),
        });
    }
    let _ = writeln!(
        md,
        "## Large instances: SJF-BCO vs first-fit FIFO\n\n\
         {} jobs of 1–{} GPUs on {} servers × {} GPUs, same cost distributions, {} seeds \
         from {} (no optimum; \"bound\" is the trivial lower bound: longest job or total \
         GPU-seconds over the GPUs, each at contention 1 on its fastest span). Reduction = \
         1 − SJF-BCO / FIFO-FF. LPT-BCO (largest first, for comparison only) as above.\n",
        args.large_jobs,
        args.large_max_gpus,
        args.large_servers,
        args.gpus_per_server,
        args.large_seeds,
        args.seed,
    );
    let reductions: Vec<f64> = large.iter().map(|l| 1.0 - l.sjf / l.fifo).collect();
    let of = |f: &dyn Fn(&LargeResult) -> f64| large.iter().map(f).collect::<Vec<f64>>();
    let met = reductions
        .iter()
        .filter(|&&r| r >= TARGET_REDUCTION)
        .count();
    let _ = writeln!(
        md,
        "| instances | SJF-BCO mean makespan | FIFO-FF mean makespan | reduction mean | \
         min | max | ≥ {:.0} % | SJF-BCO/bound mean | FIFO-FF/bound mean | LPT-BCO/bound \
         mean | heuristics time |\n|---|---|---|---|---|---|---|---|---|---|---|",
        100.0 * TARGET_REDUCTION
    );
    let _ = writeln!(
        md,
        "| {} | {:.0} s | {:.0} s | {:.1} % | {:.1} % | {:.1} % | {met}/{} | {:.3} | {:.3} \
         | {:.3} | {:.3} s |\n",
        large.len(),
        mean(&of(&|l| l.sjf)),
        mean(&of(&|l| l.fifo)),
        100.0 * mean(&reductions),
        100.0 * best(&reductions),
        100.0 * worst(&reductions),
        large.len(),
        mean(&of(&|l| l.sjf / l.bound)),
        mean(&of(&|l| l.fifo / l.bound)),
        mean(&of(&|l| l.lpt / l.bound)),
        heuristic_seconds,
    );
    let _ = writeln!(
        md,
        "| seed | SJF-BCO makespan | best κ | FIFO-FF makespan | reduction | LPT-BCO \
         makespan | bound |\n|---|---|---|---|---|---|---|"
    );
    for l in &large {
        let _ = writeln!(
            md,
            "| {} | {:.0} s | {} | {:.0} s | {:.1} % | {:.0} s | {:.0} s |",
            l.seed,
            l.sjf,
            l.kappa,
            l.fifo,
            100.0 * (1.0 - l.sjf / l.fifo),
            l.lpt,
            l.bound,
        );
    }
    let small_ratio = results
        .iter()
        .map(|r| r.1.sjf / r.1.optimum)
        .fold(0.0, f64::max);
    let small_ok = results
        .iter()
        .all(|r| r.1.sjf <= TARGET_RATIO * r.1.optimum);
    let all_proven = results.iter().all(|r| r.1.proven);
    let small_reduction = mean(
        &results
            .iter()
            .map(|r| 1.0 - r.1.sjf / r.1.fifo)
            .collect::<Vec<_>>(),
    );
    let large_reduction = mean(&reductions);
    let verdict = |ok: bool| if ok { "met" } else { "not met" };
    let within = results
        .iter()
        .filter(|r| r.1.sjf <= TARGET_RATIO * r.1.optimum)
        .count();
    let _ = writeln!(
        md,
        "\n## Targets\n\n\
         - SJF-BCO within {TARGET_RATIO}× of the optimum on every small instance: **{}** \
         ({within} of {} within, worst {:.3}×{}).\n\
         - Makespan at least {:.0} % below first-fit FIFO's: small instances, mean \
         reduction {:.1} %: **{}**; large instances, mean reduction {:.1} %: **{}** (≥ {:.0} \
         % on {met} of {} instances).\n\n\
         Total run time {:.1} s.",
        verdict(small_ok),
        results.len(),
        small_ratio,
        if all_proven {
            ""
        } else {
            "; some optima not proven within the node limit"
        },
        100.0 * TARGET_REDUCTION,
        100.0 * small_reduction,
        verdict(small_reduction >= TARGET_REDUCTION),
        100.0 * large_reduction,
        verdict(large_reduction >= TARGET_REDUCTION),
        100.0 * TARGET_REDUCTION,
        large.len(),
        started.elapsed().as_secs_f64(),
    );
    Ok(md)
}

/// `converge-sim makespan-bench`: prints the Markdown, and writes it to `--out`.
pub fn run_makespan_bench(args: &MakespanBenchArgs) -> anyhow::Result<()> {
    let md = render(args)?;
    crate::markdown::emit(&md, args.out.as_deref())
}
