//! `pipefill export RUN_DIR --format hf -o DIR`: writes a run's model (its newest checkpoint:
//! the final `checkpoint/` or the newest complete sharded `checkpoints/step-N/`, or a
//! checkpoint directory given directly) as a Hugging Face model directory that transformers
//! loads with `from_pretrained` ([`pipefill::model::hf::export`]). Only rotary-position
//! SwiGLU models (the Llama family) can be expressed; others are one clear error.

use std::path::PathBuf;

use anyhow::Context;
use pipefill::model::checkpoint::resume::ResumePoint;
use pipefill::model::checkpoint::sharded::{Manifest, load_sharded};
use pipefill::model::checkpoint::{Checkpoint, HostTensor, MASTER_PREFIX};
use pipefill::model::hf::{self, ExportDtype, ExportOptions};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Format {
    /// A Hugging Face model directory (config.json, model.safetensors).
    Hf,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// A run directory written by `pipefill train`, or one of its checkpoint directories.
    run_dir: PathBuf,
    /// What to write.
    #[arg(long, value_enum, default_value = "hf")]
    format: Format,
    /// The directory to write (created; refused when it exists and is not empty).
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
    /// Type of the written weights: f32 or bf16 (of a `train.precision = "bf16"` run, its f32
    /// master weights, or them rounded to bf16).
    #[arg(long, default_value = "f32")]
    dtype: ExportDtype,
    /// The Hugging Face directory the run started from: its architecture and other
    /// config.json fields are kept and its tokenizer files copied [default: the run's
    /// `model.from`, when that directory is still there].
    #[arg(long)]
    source: Option<PathBuf>,
    /// Replace the model in a non-empty output directory: its config.json, model.safetensors
    /// and tokenizer files; every other file stays.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(args: ExportArgs) -> anyhow::Result<()> {
    let Format::Hf = args.format;
    let point = ResumePoint::find(&args.run_dir)?;
    // Before the checkpoint is read: an output directory the export may not write (the
    // checkpoint itself, a directory holding it or inside it, ...) is refused at once.
    let mut opts = ExportOptions {
        dtype: args.dtype,
        overwrite: args.overwrite,
        source: args.source.clone(),
        checkpoint: Some(point.dir().to_path_buf()),
    };
    hf::check_out_dir(&args.out, &opts)?;
    let ckpt = match &point {
        ResumePoint::Whole(dir) => Checkpoint::load(dir)?,
        ResumePoint::Sharded(dir) => {
            let m = Manifest::read(dir)?;
            load_sharded(dir, &m.layout, &m.config_hash)?
        }
    };
    let config = ckpt.meta.model.clone();
    let names: Vec<String> = hf::param_shapes(&config).map(|(n, _)| n).collect();
    // A bf16 run's parameters at full precision: its f32 master weights (`--dtype bf16`
    // rounds them to the values the run computed with). The checkpoint's tensors are moved,
    // not copied: a model's worth of memory less at export.
    let mut masters = std::collections::HashMap::new();
    let mut tensors: Vec<HostTensor> = Vec::with_capacity(names.len());
    for t in ckpt.tensors {
        match t.name.strip_prefix(MASTER_PREFIX) {
            Some(name) => {
                masters.insert(name.to_string(), t.data);
            }
            None if names.contains(&t.name) => tensors.push(t),
            None => {}
        }
    }
    for t in &mut tensors {
        if let Some(master) = masters.remove(&t.name) {
            t.data = master;
        }
    }
    // Without --source, the directory the run imported its model from, where it still is.
    opts.source = match (args.source, &config.from) {
        (Some(dir), _) => Some(dir),
        (None, Some(from)) if from.is_dir() => {
            println!(
                "source: {} (the run's model.from): its config fields and tokenizer files are kept",
                from.display()
            );
            Some(from.clone())
        }
        (None, Some(from)) => {
            println!(
                "note: the run's model.from {} is not a directory here: exported without its \
                 tokenizer files (--source DIR names where it is now)",
                from.display()
            );
            None
        }
        (None, None) => None,
    };
    hf::export(&args.out, &config, &tensors, &opts)
        .with_context(|| format!("exporting {}", point.dir().display()))?;
    println!(
        "exported step {} of {} ({} tensors, {:?}) to {}",
        ckpt.meta.step,
        point.dir().display(),
        tensors.len(),
        args.dtype,
        args.out.display()
    );
    Ok(())
}
