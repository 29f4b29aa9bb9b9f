//! The small target and the ragged long-tail request batch the rollout-engine tests share.

use pipefill::data::SplitMix64;
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt, GptConfig, Shape};
use pipefill::rl::accept::argmax;
use pipefill::rl::rollout::{Request, RolloutEngine};
use pipefill::tensor::CpuBackend;

pub fn config() -> GptConfig {
    GptConfig {
        layers: 4,
        seq_len: 40,
        seed: 11,
        ..GptConfig::default()
    }
}

pub fn gpt() -> Gpt<CpuBackend> {
    Gpt::new(&config(), CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

/// The model in three stages of 1, 2 and 1 layers.
pub fn engine(gpt: &Gpt<CpuBackend>) -> RolloutEngine<CpuBackend> {
    RolloutEngine::new(InferStage::stages_of(gpt, &Cut::Layers(vec![1, 2, 1])).unwrap()).unwrap()
}

/// Ragged prompts and caps: the live batch shrinks step by step (a long tail).
pub fn requests(n: usize) -> Vec<Request> {
    let mut rng = SplitMix64::new(5);
    (0..n)
        .map(|i| Request {
            prompt: (0..3 + i % 4).map(|_| 3 + rng.below(47) as u32).collect(),
            max_new: 4 + (i * 7) % 25,
        })
        .collect()
}

/// Greedy decoding of `request` by full-sequence forwards of the training model (no KV
/// cache): what a plain rollout must reproduce. Stops at EOS (id 2) or after `max_new`.
pub fn greedy_reference(model: &mut Gpt<CpuBackend>, request: &Request) -> Vec<u32> {
    let vocab = model.config().vocab;
    let mut seq = request.prompt.clone();
    while seq.len() < request.prompt.len() + request.max_new {
        let shape = Shape {
            batch: 1,
            seq: seq.len(),
        };
        let logits = model.logits(shape, &seq).unwrap();
        let t = argmax(&logits[(seq.len() - 1) * vocab..]);
        seq.push(t);
        if t == 2 {
            break;
        }
    }
    seq
}
