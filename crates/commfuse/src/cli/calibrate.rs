//! `commfuse calibrate`: the cost model's link figures fitted to measured bench tables (bench
//! --json files), with how well they predict rows the fit did not see.

use anyhow::{bail, Context, Result};
use clap::Args;
use commfuse_core::topology::LinkModel;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// bench --json files measured on the machine to model
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
    /// Fit and judge only rows of at least this many bytes
    #[arg(long, default_value = "8M", allow_hyphen_values = true)]
    pub min_size: String,
    /// Write the fitted figures as JSON (for --link-gbps/--latency-us/--launch-us)
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub(super) fn calibrate_cmd(a: CalibrateArgs) -> Result<i32> {
    let min = crate::sizes::parse_size(&a.min_size).context("--min-size")?;
    let mut reports = Vec::new();
    for path in &a.reports {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        // files from before bench recorded every plan parameter: their plans cannot be rebuilt
        // with certainty, so say so rather than assume the defaults
        if value.get("rows").is_some() && value.get("numa_groups").is_none() {
            bail!(
                "{} does not record the root and NUMA groups its plans were built with (written by an older bench): measure it again",
                path.display()
            );
        }
        let report: crate::bench::BenchReport = serde_json::from_value(value)
            .with_context(|| format!("{} is not a bench --json file", path.display()))?;
        reports.push(report);
    }
    let samples = crate::calibrate::samples(&reports, min)?;
    let before = crate::calibrate::worst_error(&samples, LinkModel::default());
    let held = crate::calibrate::held_out(&samples)?;
    let model = crate::calibrate::fit(&samples);
    let in_sample = crate::calibrate::worst_error(&samples, model);
    println!(
        "fitted on {} rows of at least {}: --link-gbps {:.1} --latency-us {:.2} --launch-us {:.2}",
        samples.len(),
        crate::sizes::format_size(min),
        model.link_gbps,
        model.latency_us,
        model.launch_us
    );
    println!("{}", crate::calibrate::report(&samples, model, Some(&held)));
    println!(
        "held-out error (fitted on every other size, judged on the sizes between, both ways): worst {:.1}%, mean {:.1}%",
        100.0 * held.worst(),
        100.0 * held.mean()
    );
    println!(
        "worst error on the rows fitted: {:.1}% ({:.1}% with the defaults)",
        100.0 * in_sample,
        100.0 * before
    );
    if let Some(path) = &a.json {
        let out = Calibration {
            model,
            rows: samples.len(),
            held_out_worst_error: held.worst(),
            held_out_mean_error: held.mean(),
            in_sample_worst_error: in_sample,
            default_worst_error: before,
            held_out_folds: held.fitted,
        };
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(0)
}

/// `calibrate --json`: the fitted figures (the keys of --link-gbps/--latency-us/--launch-us)
/// and how well they predict.
#[derive(serde::Serialize)]
struct Calibration {
    #[serde(flatten)]
    model: LinkModel,
    rows: usize,
    /// Worst relative error on rows the fit did not see (two folds of alternating sizes)
    held_out_worst_error: f64,
    held_out_mean_error: f64,
    /// Worst relative error of the figures fitted on all rows, on those rows
    in_sample_worst_error: f64,
    /// Worst relative error of the default figures
    default_worst_error: f64,
    /// The figures fitted on the even-indexed sizes and on the odd-indexed ones
    held_out_folds: [LinkModel; 2],
}
