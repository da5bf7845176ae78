//! `bench --plot F.svg`: bus bandwidth against message size, one line per algorithm and
//! baseline, on a log-2 size axis.

use crate::bench::BenchReport;
use crate::sizes::format_size;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

pub fn busbw_svg(report: &BenchReport, path: &Path) -> Result<()> {
    let mut names: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !names.contains(&r.algo.as_str()) {
            names.push(&r.algo);
        }
    }
    let lo = report
        .rows
        .iter()
        .map(|r| r.bytes)
        .min()
        .unwrap_or(1)
        .max(1);
    let hi = report
        .rows
        .iter()
        .map(|r| r.bytes)
        .max()
        .unwrap_or(2)
        .max(lo * 2);
    let top = report.rows.iter().map(|r| r.busbw_gbps).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "{} busbw, {} ranks, {} ({})",
        report.op, report.ranks, report.dtype, report.backend
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo as f64).log2()..(hi as f64).log2(), 0.0..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| format_size(2f64.powf(*x).round() as u64))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, name) in names.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = report
            .rows
            .iter()
            .filter(|r| r.algo == *name)
            .map(|r| ((r.bytes as f64).log2(), r.busbw_gbps))
            .collect();
        let dashed = report.rows.iter().any(|r| r.algo == *name && r.baseline);
        let style = if dashed {
            color.stroke_width(1)
        } else {
            color.stroke_width(3)
        };
        chart
            .draw_series(LineSeries::new(points.clone(), style))
            .map_err(|e| err(&e))?
            .label(name.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
