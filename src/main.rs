//! The `pipefill` command line. Library errors become `anyhow` here, at the edge.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// pipefill: pipeline-parallel training whose bubbles do useful work.
#[derive(Parser)]
#[command(name = "pipefill", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show, validate, simulate, compare and export pipeline schedules.
    Schedule(cli::schedule::ScheduleArgs),
    /// Train the model (the embedded default job when no config is given).
    Train(cli::train::TrainArgs),
    /// Reinforcement learning (GRPO) from a `pipefill train` run or a supervised warm-up.
    Rl(cli::rl::RlArgs),
    /// Run an N-process job on this machine: `pipefill launch -n 4 -- train [ARGS]`.
    Launch(cli::launch::LaunchArgs),
    /// Benchmarks: `pipefill bench rollout [--json]` (plain vs speculative rollouts).
    Bench(cli::bench::BenchArgs),
    /// Print the bubble report of a finished run from its run directory.
    Profile(cli::profile::ProfileArgs),
    /// Write a run's model as a Hugging Face directory: `pipefill export RUN_DIR -o DIR`.
    Export(cli::export::ExportArgs),
    /// Generate from a trained run: `pipefill generate --model RUN_DIR --prompt TEXT`.
    Generate(cli::generate::GenerateArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Schedule(args) => cli::schedule::run(args),
        Command::Train(args) => cli::train::run(args),
        Command::Profile(args) => cli::profile::run(args),
        Command::Launch(args) => cli::launch::run(args),
        Command::Rl(args) => cli::rl::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Export(args) => cli::export::run(args),
        Command::Generate(args) => cli::generate::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
