//! `pipefill profile RUN_DIR`: prints the bubble report of a finished run again, from the
//! run directory's `report.json`: exactly the text the run wrote to `report.txt`, so the two
//! can be diffed. The run's pictures are beside it: `trace.json` (open it in
//! `ui.perfetto.dev`) and `timeline.svg`.

use std::path::PathBuf;

use pipefill::profile::report::BubbleReport;

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// A run directory written by `pipefill train` (holds report.json).
    run_dir: PathBuf,
}

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    let report = BubbleReport::read(&args.run_dir)?;
    print!("{}", report.to_text());
    Ok(())
}
