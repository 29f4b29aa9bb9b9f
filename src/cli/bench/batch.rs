//! The bench's inputs: the long-tail batch of task prompts whose answer lengths are
//! heavy-tailed, and the `--tree` shape.

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

/// `n` prompts of the job's tasks (BOS + prompt text) whose worked answers are long-tailed
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
pub(super) fn long_tail_batch(job: &JobConfig, n: usize) -> anyhow::Result<Vec<Request>> {
    let tok = Tokenizer::new();
    let mut tasks = TaskGenerator::new(
        &job.data.families,
        job.data.size_scale,
        job.data.max_size,
        SplitMix64::new(job.train.seed ^ 0x5eed_0001),
    )?;
    let seq_len = job.model.seq_len;
    let mut rng = SplitMix64::new(job.train.seed ^ 0x5eed_0002);
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
            if prompt.len() + answer > seq_len {
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
