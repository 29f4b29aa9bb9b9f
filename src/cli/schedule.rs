//! `pipefill schedule …` (being written).

#[derive(clap::Args)]
pub struct ScheduleArgs {}

pub fn run(_args: ScheduleArgs) -> anyhow::Result<()> {
    anyhow::bail!("`pipefill schedule` is being written")
}
