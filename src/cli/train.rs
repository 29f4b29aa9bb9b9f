//! `pipefill train …` (being written).

#[derive(clap::Args)]
pub struct TrainArgs {}

pub fn run(_args: TrainArgs) -> anyhow::Result<()> {
    anyhow::bail!("`pipefill train` is being written")
}
