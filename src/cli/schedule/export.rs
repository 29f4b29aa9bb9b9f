//! `export`: a schedule's simulated timeline as an SVG picture or a Chrome/Perfetto trace,
//! or the plan itself as CSV or TOML, written to a file (`-o -` writes to stdout).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use pipefill::profile::chrome::{ChromeOptions, chrome_trace_json};
use pipefill::profile::fmt_num;
use pipefill::profile::svg::{SvgOptions, fitting_width, svg};
use pipefill_schedules::{simulate, to_csv, to_toml};

use super::source::{
    ACTION_BYTES, CHROME_ACTION_BYTES, PlanArgs, SVG_ACTION_BYTES, describe_shape,
};
use super::{CostArgs, check_memory, emit, maybe_lower};
use pipefill::config::memory::MemoryLimit;

/// What `export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ExportFormat {
    /// An SVG timeline: one lane per rank, a legend and a time axis in cost units.
    Svg,
    /// A Chrome trace-event JSON file; open it in ui.perfetto.dev or chrome://tracing.
    Chrome,
    /// The plan in PyTorch pipelining's CSV form.
    Csv,
    /// The plan in pipefill's TOML form.
    Toml,
}

#[derive(clap::Args)]
pub(crate) struct ExportArgs {
    #[command(flatten)]
    plan: PlanArgs,
    #[command(flatten)]
    cost: CostArgs,
    /// What to write.
    #[arg(long, value_enum)]
    format: ExportFormat,
    /// The file to write (`-` for stdout).
    #[arg(short = 'o', long, value_name = "FILE")]
    output: PathBuf,
    /// Lower the plan first (SEND/RECV inserted): the plan as a runtime executes it.
    #[arg(long)]
    lower: bool,
    /// SVG: width of the picture in pixels [default: wide enough to label every action,
    /// between 800 and 4000].
    #[arg(long, value_name = "PX")]
    width: Option<f64>,
    /// Chrome trace: microseconds per cost unit. The default, 1000, shows one cost unit as
    /// one millisecond in Perfetto.
    #[arg(long, value_name = "US", default_value_t = 1000.0)]
    us_per_unit: f64,
    /// Chrome trace: add a `bubbles` lane (tid 1) holding every idle slot of each rank.
    #[arg(long)]
    bubbles: bool,
}

pub(crate) fn export_cmd(args: ExportArgs, limit: &MemoryLimit) -> Result<()> {
    let spec = args.cost.spec()?;
    if let Some(w) = args.width
        && !(w.is_finite() && w > 0.0)
    {
        anyhow::bail!("--width: {w} is not a positive number of pixels");
    }
    if !(args.us_per_unit.is_finite() && args.us_per_unit > 0.0) {
        anyhow::bail!(
            "--us-per-unit: {} is not a positive number",
            args.us_per_unit
        );
    }
    let per_action = match args.format {
        ExportFormat::Svg => SVG_ACTION_BYTES,
        ExportFormat::Chrome => CHROME_ACTION_BYTES,
        ExportFormat::Csv | ExportFormat::Toml => ACTION_BYTES,
    };
    let loaded = args.plan.load(per_action, limit)?;
    let plan = maybe_lower(loaded.plan, args.lower)?;
    let (text, what) = match args.format {
        ExportFormat::Csv => (to_csv(&plan), "CSV plan".to_string()),
        ExportFormat::Toml => (to_toml(&plan), "TOML plan".to_string()),
        ExportFormat::Svg | ExportFormat::Chrome => {
            let timeline = simulate(&plan, &spec.model(&plan)?)?;
            check_memory(&timeline, args.cost.memory_limit).context(loaded.name.clone())?;
            let summary = format!(
                "makespan {}, bubble ratio {}, steady bubble ratio {}",
                fmt_num(timeline.makespan, 3),
                fmt_num(timeline.bubble_ratio, 4),
                fmt_num(timeline.steady_bubble_ratio, 4)
            );
            if args.format == ExportFormat::Svg {
                let show_stage = plan.stages > plan.num_ranks();
                let opts = SvgOptions {
                    width: args
                        .width
                        .unwrap_or_else(|| fitting_width(&timeline, show_stage, 800.0, 4000.0)),
                    title: Some(format!(
                        "{}: {}\ncost {}; {summary}",
                        loaded.name,
                        describe_shape(&plan),
                        spec.describe()
                    )),
                    show_stage,
                    ..SvgOptions::default()
                };
                (svg(&timeline, &opts), format!("SVG timeline ({summary})"))
            } else {
                let opts = ChromeOptions {
                    us_per_unit: args.us_per_unit,
                    bubbles: args.bubbles,
                    ..ChromeOptions::default()
                };
                (
                    chrome_trace_json(&timeline, &opts) + "\n",
                    format!("Chrome trace ({summary})"),
                )
            }
        }
    };
    if args.output.as_os_str() == "-" {
        return emit(&text);
    }
    std::fs::write(&args.output, &text)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    emit(&format!(
        "wrote {}: {what} of {}\n",
        args.output.display(),
        loaded.name
    ))
}
