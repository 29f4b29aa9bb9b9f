//! Exact-match evaluation: greedy completions of held-out task prompts, scored by each
//! task's own checker (the same reward RL will use). It recomputes the whole prefix for
//! every new token (no KV cache): simple, and cheap for the short prompts it is used on.

use serde::Serialize;

use super::TrainError;
use crate::data::{SplitMix64, Task, TaskGenerator, Tokenizer, tokenizer};
use crate::model::{Gpt, Shape};
use crate::tensor::Backend;

/// The sub-stream of the data seed held out for evaluation (never a training step).
const EVAL_STREAM: u64 = u64::MAX - 1;

/// Result of an exact-match evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExactMatch {
    pub tasks: usize,
    pub correct: usize,
}

impl ExactMatch {
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.tasks.max(1) as f64
    }
}

/// `count` held-out tasks of the stream seeded by `seed` whose whole document (BOS,
/// prompt, worked solution, EOS) fits in `seq_len` tokens, so a correct greedy
/// completion fits the model's context.
pub fn held_out_tasks(
    families: &[crate::data::TaskFamily],
    size_scale: f64,
    max_size: u32,
    seed: u64,
    seq_len: usize,
    count: usize,
) -> Result<Vec<Task>, TrainError> {
    let generator = TaskGenerator::new(
        families,
        size_scale,
        max_size,
        SplitMix64::derive(seed, EVAL_STREAM),
    )?;
    // Small tasks are the common case, so this terminates quickly; the bound only
    // guards against a max_size whose tasks never fit.
    Ok(generator
        .take(1000 * count.max(1))
        .filter(|t| t.text().chars().count() + 2 <= seq_len)
        .take(count)
        .collect())
}

/// The greedy completion of `task.prompt` (text after the prompt, up to EOS or the end of
/// the model's context).
pub fn greedy_completion<B: Backend>(
    model: &mut Gpt<B>,
    tokenizer: &Tokenizer,
    task: &Task,
) -> Result<String, TrainError> {
    let vocab = model.config().vocab;
    let seq_len = model.config().seq_len;
    let mut ids = vec![tokenizer::BOS];
    tokenizer.encode_into(&task.prompt, &mut ids)?;
    let prompt_len = ids.len();
    while ids.len() < seq_len {
        let shape = Shape {
            batch: 1,
            seq: ids.len(),
        };
        let logits = model.logits(shape, &ids)?;
        let last = &logits[(ids.len() - 1) * vocab..ids.len() * vocab];
        // Among the ids the tokenizer can write (a model with a larger vocabulary, e.g. an
        // imported one, answers the tasks in their characters); first maximum, so ties
        // break the same way everywhere.
        let last = &last[..vocab.min(tokenizer.vocab_size())];
        let next = last
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 { (i, x) } else { best }
            })
            .0 as u32;
        if next == tokenizer::EOS {
            break;
        }
        ids.push(next);
    }
    Ok(tokenizer.decode(&ids[prompt_len..])?)
}

/// Greedy exact-match accuracy of `model` on `tasks`.
pub fn exact_match<B: Backend>(
    model: &mut Gpt<B>,
    tasks: &[Task],
) -> Result<ExactMatch, TrainError> {
    let tokenizer = Tokenizer::new();
    let mut correct = 0;
    for task in tasks {
        if task.check(&greedy_completion(model, &tokenizer, task)?) {
            correct += 1;
        }
    }
    Ok(ExactMatch {
        tasks: tasks.len(),
        correct,
    })
}
