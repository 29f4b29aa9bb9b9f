//! The tiny pipelined training job that the in-process tests run (resume, data parallel,
//! the oracle), and what they compare runs by: a checkpoint's tensors as bits, and the
//! one-replica sharded layout of a trainer's plan.

use pipefill::config::JobConfig;
use pipefill::config::TrainConfig;
use pipefill::data::DataConfig;
use pipefill::model::GptConfig;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::Layout;
use pipefill::pipeline::PipelineTrainer;

/// Clip threshold of [`tiny_job`]: small enough that the gradient norm exceeds it on some
/// steps, so the clipped path is exercised too.
pub const TINY_CLIP: f32 = 0.8;

/// A job that trains in a fraction of a second: a 4-layer GPT of width 16 over `stages`
/// stages with 1F1B, `steps` steps of 4 micro-batches of 2 sequences, lr 1e-2 after one
/// warm-up step, clipped at [`TINY_CLIP`], one compute thread, no evaluation. Callers
/// change the few fields their test is about.
pub fn tiny_job(stages: usize, steps: u64) -> JobConfig {
    JobConfig {
        schedule: "1f1b".parse().unwrap(),
        stages,
        model: GptConfig {
            d_model: 16,
            heads: 2,
            layers: 4,
            seq_len: 16,
            mlp_ratio: 2,
            ..GptConfig::default()
        },
        data: DataConfig {
            summary_tasks: 1,
            ..DataConfig::default()
        },
        train: TrainConfig {
            steps,
            micro_batches: 4,
            micro_batch_size: 2,
            lr: 1e-2,
            warmup: 1,
            clip: TINY_CLIP,
            threads: 1,
            eval_tasks: 0,
            ..TrainConfig::default()
        },
        ..JobConfig::default()
    }
}

/// Every tensor of a checkpoint as (name, shape, bits), sorted by name: two checkpoints
/// hold the same state bit for bit exactly when these are equal, whatever their tensors'
/// order (the AdamW moments are tensors too).
pub type TensorBits = Vec<(String, Vec<usize>, Vec<u32>)>;

/// `c`'s [`TensorBits`].
pub fn sorted_bits(c: &Checkpoint) -> TensorBits {
    let mut t: TensorBits = c
        .tensors
        .iter()
        .map(|t| {
            let b = t.data.iter().map(|x| x.to_bits()).collect();
            (t.name.clone(), t.shape.clone(), b)
        })
        .collect();
    t.sort();
    t
}

/// The sharded-checkpoint layout of one replica of `trainer`'s plan.
pub fn one_replica_layout(trainer: &PipelineTrainer) -> Layout {
    Layout {
        dp: 1,
        stage_rank: trainer.plan().stage_rank.clone(),
    }
}

/// Each of `names` with the bit patterns of its values (`value(name)`), in `names`' order:
/// parameters compared bit for bit, whatever holds them (a model, a chunk).
pub fn named_bits(names: Vec<String>, value: impl Fn(&str) -> Vec<f32>) -> Vec<(String, Vec<u32>)> {
    names
        .into_iter()
        .map(|n| {
            let bits = value(&n).iter().map(|x| x.to_bits()).collect();
            (n, bits)
        })
        .collect()
}
