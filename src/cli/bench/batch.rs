//! The bench's inputs: the long-tail batch of task prompts whose answer lengths are
//! heavy-tailed, and the `--tree` shape.

use std::collections::HashSet;

use anyhow::{Context, bail};
use pipefill::config::JobConfig;
use pipefill::data::{SplitMix64, TaskGenerator, Tokenizer, tokenizer::BOS};
use pipefill::model::drafter::TreeShape;
use pipefill::rl::rollout::Request;

/// Scale of the heavy-tailed law of the answer lengths the batch asks for: P(L > 1 + k) =
/// s / (s + k): the median is 1 + s, and a tenth want over 1 + 9s. With 4 on the bench's
/// d512 target of 512 positions the longest 10% of sequences took 65-70% of the plain
/// rollout's time (docs/benchmarks.md, "The rollout bench's long tail").
const ANSWER_SCALE: f64 = 4.0;
/// Tasks drawn per request to find one whose answer is as long as it wants.
const DRAWS: usize = 256;

/// Which of the job's task streams a batch draws from: the measured batch, or the one the
/// drafter trains on (other prompts of the same families and lengths, as TLT's drafter
/// learns from earlier steps' rollouts, not from the ones it then drafts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stream {
    Measured,
    Drafter,
}

impl Stream {
    /// Mixed into the job's seed (the measured batch's 0 keeps it what it always was).
    fn salt(self) -> u64 {
        match self {
            Stream::Measured => 0,
            Stream::Drafter => 0xd4af_7e45_0000_0000,
        }
    }
}

/// `n` prompts of the job's tasks of `stream` (BOS + prompt text) whose worked answers are long-tailed
/// the way reasoning rollouts are: each request draws an answer length from a heavy-tailed
/// law ([`ANSWER_SCALE`]) and takes, of [`DRAWS`] tasks that fit the model, the one with the
/// shortest answer at least that long (the longest, if none is), with that length as its
/// budget of new tokens: a target that writes the task's answer runs to the budget, and one
/// that ends early (EOS) ends there.
///
/// Why not the job's tasks as they come: their sizes are heavy-tailed, but the shortest
/// answers are already ~11 tokens and most ~20, so in the model's positions the longest
/// was only a few times the median, and the tail a small part of the rollout's time; and
/// the bench's target (100 steps) rarely ends an answer by itself, so the budget is what
/// sets the lengths.
///
/// No prompt of `avoid` is taken: the drafter's batch avoids the measured one's, whose
/// small tasks (the short answers most requests want) the other stream draws again.
pub(super) fn long_tail_batch(
    job: &JobConfig,
    n: usize,
    stream: Stream,
    avoid: &[Request],
) -> anyhow::Result<Vec<Request>> {
    let avoid: HashSet<&[u32]> = avoid.iter().map(|r| r.prompt.as_slice()).collect();
    let tok = Tokenizer::new();
    let seed = job.train.seed ^ stream.salt();
    let mut tasks = TaskGenerator::new(
        &job.data.families,
        job.data.size_scale,
        job.data.max_size,
        SplitMix64::new(seed ^ 0x5eed_0001),
    )?;
    let seq_len = job.model.seq_len;
    let mut rng = SplitMix64::new(seed ^ 0x5eed_0002);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let want = rng.heavy_tailed(ANSWER_SCALE, seq_len as u32) as usize;
        // (answer tokens with the EOS, prompt) of the best task so far.
        let mut best: Option<(usize, Vec<u32>)> = None;
        for _ in 0..DRAWS {
            let task = tasks.next_task();
            let mut prompt = vec![BOS];
            tok.encode_into(&task.prompt, &mut prompt)?;
            let answer = tok.encode(&task.solution)?.len() + 1;
            if prompt.len() + answer > seq_len || avoid.contains(prompt.as_slice()) {
                continue;
            }
            let better = match &best {
                None => true,
                Some((b, _)) if *b >= want => answer >= want && answer < *b,
                Some((b, _)) => answer > *b,
            };
            if better {
                best = Some((answer, prompt));
            }
        }
        let (_, prompt) = best.with_context(|| {
            format!("no task of the job's fits model.seq_len = {seq_len} (prompt and answer)")
        })?;
        out.push(Request {
            max_new: want.min(seq_len - prompt.len()),
            prompt,
        });
    }
    Ok(out)
}

/// `DEPTH,BRANCH,WIDTH,NODES` as a checked [`TreeShape`].
pub(super) fn parse_tree(s: &str) -> anyhow::Result<TreeShape> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--tree {s:?}: expected DEPTH,BRANCH,WIDTH,NODES"))?;
    let [depth, branch, width, nodes] = v[..] else {
        bail!("--tree {s:?}: expected 4 numbers DEPTH,BRANCH,WIDTH,NODES");
    };
    let shape = TreeShape {
        depth,
        branch,
        width,
        nodes,
    };
    if let Some((field, reason)) = shape.check() {
        bail!("--tree {s:?}: {field} {reason}");
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The drafter's batch is other prompts than the measured one's, and each stream is the
    /// same batch every time (a rerun measures, and trains its drafter on, what the last did).
    #[test]
    fn the_drafter_trains_on_other_prompts_than_the_measured_ones() {
        let mut job = JobConfig::default();
        job.model.seq_len = 256;
        let measured = long_tail_batch(&job, 32, Stream::Measured, &[]).unwrap();
        let prompts = |b: &[Request]| b.iter().map(|r| r.prompt.clone()).collect::<Vec<_>>();
        // Without `avoid` the streams share their small tasks' prompts.
        let shared = |lesson: &[Request]| {
            let m = prompts(&measured);
            prompts(lesson).iter().filter(|p| m.contains(p)).count()
        };
        let open = long_tail_batch(&job, 64, Stream::Drafter, &[]).unwrap();
        assert!(shared(&open) > 0, "the check below would be empty");
        let lesson = long_tail_batch(&job, 64, Stream::Drafter, &measured).unwrap();
        assert_eq!((lesson.len(), shared(&lesson)), (64, 0));
        let again = long_tail_batch(&job, 32, Stream::Measured, &[]).unwrap();
        assert_eq!(prompts(&again), prompts(&measured));
        let lens = |b: &[Request]| b.iter().map(|r| r.max_new).collect::<Vec<_>>();
        assert_eq!(lens(&again), lens(&measured));
    }
}
