//! Part 2 of `converge-sim report`: the loss-prediction benchmark ([`crate::predict_bench`])
//! run inside the report, and its headline tables.

use crate::predict::Predictor;
use crate::predict_bench::PredictionResults;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The loss-prediction benchmark as the report ran it.
pub(super) struct Prediction {
    pub(super) results: PredictionResults,
    pub(super) seconds: f64,
}

/// Runs the loss-prediction benchmark over the application traces in `traces` and the
/// recorded curves in `curves`.
pub(super) fn run_prediction(traces: &[PathBuf], curves: &Path) -> anyhow::Result<Prediction> {
    let t = std::time::Instant::now();
    let results = PredictionResults::compute(traces, curves)?;
    let seconds = t.elapsed().as_secs_f64();
    eprintln!("loss prediction: {} ({seconds:.1} s)", results.headline());
    Ok(Prediction { results, seconds })
}

pub(super) fn prediction_section(md: &mut String, prediction: Option<&Prediction>) {
    let _ = writeln!(md, "## Loss prediction\n");
    let Some(p) = prediction else {
        let _ = writeln!(
            md,
            "Left out of this run (`--skip-prediction`); `converge-sim predict-bench` \
             writes the full benchmark to [prediction.md](prediction.md).\n"
        );
        return;
    };
    let names: Vec<&str> = Predictor::ALL.iter().map(|p| p.name()).collect();
    let _ = writeln!(
        md,
        "How far off is a job's loss predicted from its curve so far? Each curve is cut after \
         20 %, 22.5 %, …, 80 % of its run; from the history each predictor ({}: SLAQ's \
         strawman, SLAQ's published fit, Optimus's fit, ours) forecasts the loss 10 % and 25 % \
         of the remaining run ahead. Cells are the **median / p90** relative error over every \
         cut; the best median of a row is bold; *noise* is how far single points scatter \
         around their neighbours. The curves: the Pollux applications' validation curves, and \
         the training and held-out loss recorded from converge-trainer runs, pooled here. \
         Method, predictors and the per-run tables: [prediction.md](prediction.md), written by \
         `converge-sim predict-bench` from the same code \
         (`sim/src/predict_bench.rs`); the report ran it in {:.1} s.\n",
        names.join(" / "),
        p.seconds
    );
    md.push_str(&p.results.summary());
    md.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict_bench::{Series, evaluate_groups};
    use converge_sched::fit::LossPoint;

    #[test]
    fn prediction_section_shows_its_figures() {
        // A toy curve (the real ones take half a minute in a debug build).
        let points: Vec<LossPoint> = [10.0, 8.0, 7.0, 6.5, 6.0, 5.8, 5.6, 5.5, 5.4, 5.0]
            .iter()
            .enumerate()
            .map(|(i, &loss)| LossPoint {
                samples: (i + 1) as f64,
                loss,
            })
            .collect();
        let groups = evaluate_groups(&[Series {
            group: "toy".into(),
            label: String::new(),
            points,
        }]);
        let prediction = Prediction {
            results: PredictionResults {
                pollux: groups.clone(),
                train: groups.clone(),
                held_out: groups,
            },
            seconds: 1.0,
        };
        let mut md = String::new();
        prediction_section(&mut md, Some(&prediction));
        assert!(md.contains("| toy | 1 | 4 | 10 % |"), "{md}");
        assert!(
            md.contains("| Pollux, all (pooled) | 1 | 4 | 10 % |"),
            "{md}"
        );
        assert!(md.contains("| toy (held-out loss) |"), "{md}");
        assert!(md.contains("evaluable curve groups"), "{md}");
        assert!(md.contains("predict-bench"));
    }
}
