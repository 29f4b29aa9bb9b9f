//! The bench's inputs: the long-tail batch of task prompts with heavy-tailed caps, and the
//! `--tree` shape.

use anyhow::{Context, bail};
use pipefill::config::JobConfig;
use pipefill::data::{SplitMix64, TaskGenerator, Tokenizer, tokenizer::BOS};
use pipefill::model::drafter::TreeShape;
use pipefill::rl::rollout::Request;

/// Scale of the heavy-tailed per-request caps: P(cap > 2 + k) = s / (s + k).
const CAP_SCALE: f64 = 8.0;

/// Prompts of the job's tasks (BOS + prompt text), each with a heavy-tailed cap.
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
        let task = tasks.next_task();
        let mut prompt = vec![BOS];
        tok.encode_into(&task.prompt, &mut prompt)?;
        if prompt.len() + 1 < seq_len {
            // Response lengths of RL rollouts are heavy-tailed: most stop early, a few run
            // long. The task sizes give that only weakly in 64 positions, so each request
            // also draws its own cap from the heavy-tailed law (EOS may still end it first).
            let room = seq_len - prompt.len();
            let cap = 2 + rng.heavy_tailed(CAP_SCALE, room as u32) as usize;
            out.push(Request {
                max_new: cap.min(room),
                prompt,
            });
        }
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
