//! The report's SVG plots: the JCT CDF per policy and the cluster-wide average normalized
//! loss over time, one color per label.

use super::{REPORT_POLICIES, Run};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// One color per label, the same in every plot.
fn color_of(policy: &str) -> RGBColor {
    let i = REPORT_POLICIES
        .iter()
        .position(|p| *p == policy)
        .unwrap_or(COLORS.len() - 1);
    COLORS[i % COLORS.len()]
}

/// matplotlib's `tab10`, in order; the last is for labels outside [`REPORT_POLICIES`].
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
    RGBColor(127, 127, 127),
];

pub(super) fn jct_cdf(
    results: &BTreeMap<(String, String), Run>,
    policies: &[String],
    path: &Path,
) -> anyhow::Result<()> {
    let series: Vec<(String, Vec<f64>)> = policies
        .iter()
        .filter_map(|p| {
            let r = results.get(&(p.clone(), "1.0".into()))?;
            let mut v: Vec<f64> = r
                .summary
                .jcts
                .values()
                .flat_map(|m| m.values().copied())
                .collect();
            v.sort_by(f64::total_cmp);
            Some((p.clone(), v))
        })
        .collect();
    let max_x = series
        .iter()
        .flat_map(|(_, v)| v.last().copied())
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("JCT CDF, eight 1.0x Pollux workloads", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1.0..max_x).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("JCT (s, log scale)")
        .y_desc("fraction of jobs")
        .draw()?;
    for (name, v) in &series {
        let color = color_of(name);
        let n = v.len().max(1) as f64;
        chart
            .draw_series(LineSeries::new(
                v.iter()
                    .enumerate()
                    .map(|(k, x)| (x.max(1.0), (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

pub(super) fn loss_over_time(
    results: &BTreeMap<(String, String), Run>,
    policies: &[String],
    path: &Path,
) -> anyhow::Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = policies
        .iter()
        .filter_map(|p| {
            let r = results.get(&(p.clone(), "1.0".into()))?;
            r.summary
                .avg_normalized_loss
                .get("workload-1")
                .map(|v| (p.clone(), v.clone()))
        })
        .collect();
    let max_x = series
        .iter()
        .flat_map(|(_, v)| v.last().map(|p| p.0))
        .fold(60.0, f64::max)
        / 3600.0;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Average normalized loss of active jobs, workload-1 (1.0x)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..max_x, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time (h)")
        .y_desc("normalized loss (1 = start, 0 = final)")
        .draw()?;
    for (name, v) in &series {
        let color = color_of(name);
        chart
            .draw_series(LineSeries::new(
                v.iter().map(|(t, l)| (t / 3600.0, *l)),
                color.stroke_width(2),
            ))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
