//! Part 3 of `converge-sim report`: the scale benchmark, the time of one allocation decision
//! for 10,000 jobs ([`converge_sched::benchgen`], as `bench-decision` runs it), and its
//! section.

use super::page::pct;
use crate::decision_bench::{DecisionTimes, MedianP95, millis, time_batch_modes, time_decisions};
use converge_sched::benchgen::{BenchBatches, BenchConfig, DecisionInputs};
use converge_sched::policies::Objective;
use std::fmt::Write as _;

/// The scale benchmark as the report ran it.
pub(super) struct Scale {
    pub(super) cfg: BenchConfig,
    pub(super) running: usize,
    pub(super) gpus_in_use: u64,
    pub(super) total_gpus: u32,
    pub(super) objective: Objective,
    pub(super) generate_s: f64,
    /// Generating the inputs and every timed decision.
    pub(super) seconds: f64,
    pub(super) times: DecisionTimes,
    /// The whole decision with each [`BenchBatches`] mode, side by side.
    pub(super) modes: Vec<(BenchBatches, MedianP95)>,
}

/// Fewest interleaved repeats of the batch-mode comparison, so that its 95th percentile is not
/// its maximum.
const MODE_REPEATS: usize = 20;

/// Generates the default inputs of [`converge_sched::benchgen`] and times `repeat` decisions on the
/// calling thread.
pub(super) fn run_scale(repeat: usize) -> Scale {
    let cfg = BenchConfig::default();
    let started = std::time::Instant::now();
    let inputs = DecisionInputs::generate(&cfg);
    let generate_s = started.elapsed().as_secs_f64();
    let times = time_decisions(&inputs, repeat);
    let modes = time_batch_modes(&inputs, repeat.max(MODE_REPEATS));
    Scale {
        cfg,
        running: inputs.running(),
        gpus_in_use: inputs.gpus_in_use(),
        total_gpus: inputs.total_gpus,
        objective: inputs.params.objective,
        generate_s,
        seconds: started.elapsed().as_secs_f64(),
        times,
        modes,
    }
}

/// The scale target: one whole decision in under this many milliseconds on one core.
const TARGET_DECISION_MS: f64 = 100.0;

pub(super) fn scale_section(md: &mut String, scale: Option<&Scale>) {
    let _ = writeln!(md, "## Scale: one decision for 10,000 jobs\n");
    let Some(s) = scale else {
        let _ = writeln!(
            md,
            "Left out of this run (`--skip-scale`); `converge-sim bench-decision` runs it \
             alone.\n"
        );
        return;
    };
    let _ = writeln!(
        md,
        "The time of one allocation decision as the service makes it (`converge_sched::decide`, \
         the total; timed on its own): the quality policy (`quality_allocate`, default \
         settings, objective `{}`), then placement (building the placement requests and \
         `place`), on generated inputs (`sched/src/benchgen.rs`, \
         seed {}): {} active jobs, {} running on {} GPUs, on {} nodes × {} GPUs = {} GPUs. \
         {} decisions, one after the other on one thread; the report runs them before the \
         simulations start, while nothing else of the report runs (inputs generated in \
         {:.2} s, not counted).\n",
        s.objective.as_str(),
        s.cfg.seed,
        s.cfg.jobs,
        s.running,
        s.gpus_in_use,
        s.cfg.nodes,
        s.cfg.gpus_per_node,
        s.total_gpus,
        s.times.repeat,
        s.generate_s,
    );
    let _ = writeln!(md, "| part | min | median |");
    let _ = writeln!(md, "|---|---|---|");
    for (name, part) in [
        ("policy (`quality_allocate`)", s.times.policy),
        ("placement (requests and `place`)", s.times.placement),
        ("total", s.times.total),
    ] {
        let _ = writeln!(
            md,
            "| {name} | {:.1} ms | {:.1} ms |",
            millis(part.min),
            millis(part.median)
        );
    }
    let total = millis(s.times.total.median);
    let o = s.times.outcome;
    let _ = writeln!(
        md,
        "\nTarget: a whole decision in under {TARGET_DECISION_MS:.0} ms on one core: {} \
         (median {total:.1} ms). For comparison, SLAQ reports about 2 s per scheduling \
         decision for 4,000 jobs on 16,000 workers. The last decision admitted {} jobs, \
         allocated {} GPUs, placed {} and moved {} jobs to a new placement.\n",
        if total < TARGET_DECISION_MS {
            "met"
        } else {
            "**missed**"
        },
        o.admitted,
        o.allocated_gpus,
        o.placed_gpus,
        o.placed_anew,
    );
    let _ = writeln!(
        md,
        "With batch-size choice, side by side: the same jobs given throughput models (each \
         decision then builds every job's throughput table), at a fixed batch and with batch \
         limits and gradient statistics (goodput tables: the best batch at every world size, \
         and a batch plan per placed job); `DecisionInputs::with_batches`. The three ways \
         interleaved within each of {} repeats:\n",
        s.times.repeat.max(MODE_REPEATS)
    );
    let _ = writeln!(md, "| decision | median | p95 |");
    let _ = writeln!(md, "|---|---|---|");
    for (mode, t) in &s.modes {
        let _ = writeln!(
            md,
            "| {} | {:.1} ms | {:.1} ms |",
            mode.as_str(),
            millis(t.median),
            millis(t.p95)
        );
    }
    let get = |m: BenchBatches| {
        s.modes
            .iter()
            .find(|(mode, _)| *mode == m)
            .map(|(_, t)| millis(t.median))
    };
    if let (Some(fixed), Some(adaptive)) = (get(BenchBatches::Fixed), get(BenchBatches::Adaptive)) {
        let _ = writeln!(
            md,
            "\nTargets: batch-size choice no slower than the fixed-batch decision: {} \
             ({adaptive:.1} vs {fixed:.1} ms, {}); under {TARGET_DECISION_MS:.0} ms p50: {}.\n",
            if adaptive <= fixed * 1.05 {
                "met"
            } else {
                "**missed**"
            },
            pct(adaptive, fixed),
            if adaptive < TARGET_DECISION_MS {
                "met"
            } else {
                "**missed**"
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_section_shows_its_figures_and_target() {
        let cfg = BenchConfig {
            jobs: 200,
            nodes: 200,
            gpus_per_node: 8,
            gpu_types: 1,
            seed: 3,
        };
        let inputs = DecisionInputs::generate(&cfg);
        let times = time_decisions(&inputs, 2);
        let scale = Scale {
            cfg,
            running: inputs.running(),
            gpus_in_use: inputs.gpus_in_use(),
            total_gpus: inputs.total_gpus,
            objective: inputs.params.objective,
            generate_s: 0.0,
            seconds: 0.0,
            times,
            modes: time_batch_modes(&inputs, 2),
        };
        let mut md = String::new();
        scale_section(&mut md, Some(&scale));
        assert!(md.contains("| total |"), "{md}");
        let verdict = if millis(times.total.median) < TARGET_DECISION_MS {
            "on one core: met"
        } else {
            "on one core: **missed**"
        };
        assert!(md.contains(verdict), "{md}");
    }
}
