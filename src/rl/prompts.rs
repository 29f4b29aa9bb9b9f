//! [`PromptSource`]: what each RL step rolls out and how a completion is scored.
//!
//! - `data.source = "synthetic"`: the job's task families ([`step_prompts`]), each prompt
//!   after the character tokenizer's `BOS`, scored by its task's own checker.
//! - `data.source = "jsonl"`: the file's `{"prompt": ..., "answer": ...}` records, each
//!   prompt encoded by `data.tokenizer` with its special tokens (as the SFT warm-up encodes
//!   the same record's prefix), scored against the answer by `rl.reward` (exact, numeric
//!   as GSM8K's `####`, boxed as MATH's `\boxed{}`). Records whose prompt leaves fewer than
//!   `rl.max_new_tokens` positions in `model.seq_len` are left out once, at load. Steps walk
//!   the rest in epochs: each epoch is a permutation seeded by `(rl.seed, epoch)`, so every
//!   record is rolled out once per epoch and step `k`'s prompts are a pure function of the
//!   job.
//!
//! A completion is the generated ids up to (without) the tokenizer's EOS; a completion cut
//! off by the token budget is scored like any other.

use std::path::PathBuf;
use std::sync::Arc;

use super::reward::{completion_tokens, reward};
use crate::config::JobConfig;
use crate::data::jsonl::{Record, read_records};
use crate::data::reward::Reward;
use crate::data::{DataError, DataSource, SplitMix64, Task, TaskGenerator, TextTokenizer};
use crate::rl::RlError;

/// One prompt of a step: its ids (special tokens included) and what a completion is
/// checked against.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub check: Check,
}

/// How a completion of a [`Prompt`] is scored.
#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    /// A synthetic task's own checker.
    Task(Task),
    /// A JSONL record's reference answer under `rl.reward`.
    Answer {
        answer: String,
        reward: Reward,
        /// The record's line in the file (which record it is).
        line: u64,
    },
}

/// One usable `prompt`/`answer` record.
#[derive(Debug)]
struct Entry {
    line: u64,
    ids: Vec<u32>,
    answer: String,
}

#[derive(Debug, Clone)]
enum Stream {
    Tasks,
    Records {
        entries: Arc<Vec<Entry>>,
        reward: Reward,
    },
}

/// The job's RL prompts and the tokenizer that encodes and decodes them.
#[derive(Debug, Clone)]
pub struct PromptSource {
    job: JobConfig,
    tokenizer: TextTokenizer,
    stream: Stream,
}

impl PromptSource {
    /// The prompts `job` names: its synthetic tasks, or its JSONL file's `prompt`/`answer`
    /// records (read and tokenized once, here).
    pub fn from_job(job: &JobConfig) -> Result<Self, RlError> {
        let data = &job.data;
        data.validate()?;
        let tokenizer = data.text_tokenizer()?;
        let stream = match (data.source, &data.path) {
            (DataSource::Jsonl, Some(path)) => {
                let lines = read_records(path, data.max_file_bytes, data.max_line_bytes)?;
                Stream::Records {
                    entries: Arc::new(entries(&lines, path.clone(), &tokenizer, job)?),
                    reward: job.rl.reward,
                }
            }
            _ => Stream::Tasks,
        };
        Ok(PromptSource {
            job: job.clone(),
            tokenizer,
            stream,
        })
    }

    /// The id that ends a completion.
    pub fn eos(&self) -> u32 {
        self.tokenizer.eos()
    }

    /// Usable JSONL records (prompt short enough), or `None` for synthetic tasks.
    pub fn records(&self) -> Option<usize> {
        match &self.stream {
            Stream::Tasks => None,
            Stream::Records { entries, .. } => Some(entries.len()),
        }
    }

    /// RL step `step`'s `rl.prompts` prompts.
    pub fn prompts(&self, step: u64) -> Result<Vec<Prompt>, RlError> {
        let wanted = self.job.rl.prompts;
        match &self.stream {
            Stream::Tasks => {
                let bos = self.tokenizer.bos();
                step_prompts(&self.job, step)?
                    .into_iter()
                    .map(|task| {
                        let mut ids: Vec<u32> = bos.into_iter().collect();
                        ids.extend(self.tokenizer.encode(&task.prompt, false)?);
                        Ok(Prompt {
                            ids,
                            check: Check::Task(task),
                        })
                    })
                    .collect()
            }
            Stream::Records { entries, reward } => {
                let n = entries.len() as u64;
                let first = step
                    .checked_mul(wanted as u64)
                    .ok_or_else(|| RlError::Rollout(format!("step {step} overflows")))?;
                let mut order: Option<(u64, Vec<usize>)> = None;
                (first..first + wanted as u64)
                    .map(|k| {
                        let (epoch, at) = (k / n, (k % n) as usize);
                        if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                            order =
                                Some((epoch, permutation(entries.len(), self.job.rl.seed, epoch)));
                        }
                        let e = &entries[order.as_ref().expect("set above").1[at]];
                        Ok(Prompt {
                            ids: e.ids.clone(),
                            check: Check::Answer {
                                answer: e.answer.clone(),
                                reward: *reward,
                                line: e.line,
                            },
                        })
                    })
                    .collect()
            }
        }
    }

    /// The reward of the ids `generated` after `prompt`: 1 for a right answer, else 0.
    pub fn score(&self, prompt: &Prompt, generated: &[u32]) -> Result<f32, RlError> {
        let text = self
            .tokenizer
            .decode(completion_tokens(generated, self.eos()))?;
        Ok(match &prompt.check {
            Check::Task(task) => reward(task, &text),
            Check::Answer { answer, reward, .. } => reward.score(&text, answer),
        })
    }
}

/// `0..n` shuffled (Fisher-Yates) by the stream `(seed, epoch)`, apart from the training
/// stream's seeds.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = SplitMix64::derive(seed ^ 0x5eed_0fa1_u64, epoch);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// The usable `prompt`/`answer` records of `lines`: any other form is an error naming its
/// line; a prompt that leaves fewer than `rl.max_new_tokens` positions is skipped; none
/// left is an error.
fn entries(
    lines: &[crate::data::jsonl::Line],
    path: PathBuf,
    tokenizer: &TextTokenizer,
    job: &JobConfig,
) -> Result<Vec<Entry>, RlError> {
    let (seq_len, max_new) = (job.model.seq_len, job.rl.max_new_tokens);
    let vocab = job.model.vocab;
    let at = |line: u64, reason: String| DataError::Line {
        path: path.clone(),
        line,
        reason,
    };
    let mut out = Vec::new();
    for l in lines {
        let Record::Answer { prompt, answer } = &l.record else {
            return Err(at(
                l.line,
                "pipefill rl needs `prompt` + `answer` records (the answer its reward checks)"
                    .into(),
            )
            .into());
        };
        let ids = tokenizer
            .encode(prompt, true)
            .map_err(|e| at(l.line, e.to_string()))?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(at(
                l.line,
                format!("the prompt encodes to id {id}, outside model.vocab = {vocab}"),
            )
            .into());
        }
        if ids.is_empty() || ids.len() + max_new > seq_len {
            continue;
        }
        out.push(Entry {
            line: l.line,
            ids,
            answer: answer.clone(),
        });
    }
    if out.is_empty() {
        return Err(DataError::File {
            path,
            reason: format!(
                "has no `prompt`/`answer` record whose prompt fits model.seq_len = {seq_len} \
                 with rl.max_new_tokens = {max_new}"
            ),
        }
        .into());
    }
    Ok(out)
}

#[cfg(test)]
#[path = "prompts_tests.rs"]
mod tests;

/// The `count` prompts of RL step `step`: tasks of the job's families, seeded by
/// `(rl.seed, step)`, whose `BOS` + prompt leaves `rl.max_new_tokens` in `model.seq_len`.
pub fn step_prompts(job: &JobConfig, step: u64) -> Result<Vec<Task>, RlError> {
    let (rl, seq_len) = (&job.rl, job.model.seq_len);
    let generator = TaskGenerator::new(
        &job.data.families,
        job.data.size_scale,
        job.data.max_size,
        // Apart from the training stream (seeded by (train.seed, step)) even when the seeds
        // are equal, so RL prompts are not the warm-up's documents.
        SplitMix64::derive(rl.seed ^ 0x5eed_0fa1_u64, step),
    )?;
    // Short prompts are the common case; the bound only guards a budget nothing fits.
    let tasks: Vec<Task> = generator
        .take(1000 * rl.prompts)
        .filter(|t| 1 + t.prompt.chars().count() + rl.max_new_tokens <= seq_len)
        .take(rl.prompts)
        .collect();
    if tasks.len() < rl.prompts {
        return Err(RlError::NoPrompts {
            step,
            found: tasks.len(),
            wanted: rl.prompts,
            seq_len,
            max_new: rl.max_new_tokens,
        });
    }
    Ok(tasks)
}
