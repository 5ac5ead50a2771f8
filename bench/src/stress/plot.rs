//! SVG plots (plotters, SVG backend only): the latency CDF of every run and the message rate
//! second by second.

use super::report::RunResult;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plot: {e}")
}

/// One line per run, in the palette's colours, and the legend at `at`.
fn lines_with_legend<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    series: Vec<(String, Vec<(f64, f64)>)>,
    at: SeriesLabelPosition,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(at)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Fraction of round trips at or below each latency, one curve per run, log-scale x.
pub fn latency_cdf(path: &Path, title: &str, runs: &[RunResult]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .filter(|r| !r.hist.is_empty())
        .map(|r| (r.label(), r.cdf()))
        .collect();
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let lo = series
        .iter()
        .filter_map(|s| s.1.first().map(|p| p.0))
        .fold(f64::INFINITY, f64::min);
    let hi = series
        .iter()
        .filter_map(|s| s.1.last().map(|p| p.0))
        .fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (0.1, 10.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0001f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("round trip (µs, log scale)")
        .y_desc("fraction of round trips")
        .draw()
        .map_err(err)?;
    lines_with_legend(&mut chart, series, SeriesLabelPosition::LowerRight)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Messages per second (acks, or sends one-way) in every second of every run.
pub fn throughput(path: &Path, title: &str, runs: &[RunResult]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let pts = r
                .per_sec
                .iter()
                .enumerate()
                .map(|(i, l)| (i as f64 + 1.0, if r.p.one_way { l.tx_s } else { l.rx_s }))
                .collect();
            (r.label(), pts)
        })
        .collect();
    let xmax = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2) as f64;
    let ymax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(1f64..xmax, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("second of the run")
        .x_labels(xmax as usize)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("messages per second")
        .y_label_formatter(&|v| crate::util::fmt_rate(*v))
        .draw()
        .map_err(err)?;
    lines_with_legend(&mut chart, series, SeriesLabelPosition::UpperRight)?;
    root.present().map_err(err)?;
    Ok(())
}
