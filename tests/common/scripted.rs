//! Rollouts fixed in advance, for the tests of the RL update: known completions, so known
//! rewards and group advantages.

use pipefill::data::{Task, Tokenizer, tokenizer};
use pipefill::rl::RlError;
use pipefill::rl::generator::{Rollout, RolloutBatch};

/// `group` completions per prompt: the first of each group is the task's worked solution
/// (reward 1), the others a wrong answer (reward 0); a prompt listed in `uniform` has every
/// completion right (`true`) or wrong (`false`), a group of advantage 0.
pub fn scripted_batch(
    prompts: &[Vec<u32>],
    tasks: &[Task],
    group: usize,
    uniform: &[(usize, bool)],
) -> Result<RolloutBatch, RlError> {
    let tok = Tokenizer::new();
    let mut rollouts = Vec::new();
    for (p, (prompt, task)) in prompts.iter().zip(tasks).enumerate() {
        let all = uniform.iter().find(|u| u.0 == p).map(|u| u.1);
        for g in 0..group {
            let text = if all.unwrap_or(g == 0) {
                task.solution.clone()
            } else {
                format!("0:0\n#{}2", task.answer)
            };
            let mut generated = tok.encode(&text)?;
            generated.push(tokenizer::EOS);
            rollouts.push(Rollout {
                prompt: prompt.clone(),
                generated,
            });
        }
    }
    Ok(RolloutBatch {
        live_batch: vec![rollouts.len(), 0],
        rollouts,
        ..RolloutBatch::default()
    })
}
