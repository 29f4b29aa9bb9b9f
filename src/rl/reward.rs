//! Rewards of RL rollouts: exact answer match, scored by each task's own checker
//! ([`crate::data::Task::check`], the same one `pipefill train`'s evaluation uses).
//!
//! A rollout is a prompt's sampled continuation as token ids. Generation stops at `EOS`
//! or at the token budget; whatever a sampler produced after the first `EOS` is not part
//! of the completion. A completion cut off by the budget is scored like any other: its
//! answer is what follows its last `#`, so a cut-off answer does not match.

use crate::data::{DataError, Task, Tokenizer, tokenizer};

/// Reward of a correct completion.
pub const CORRECT: f32 = 1.0;
/// Reward of anything else (wrong answer, no answer).
pub const WRONG: f32 = 0.0;

/// The reward of `completion` (the text after the prompt) for `task`.
pub fn reward(task: &Task, completion: &str) -> f32 {
    if task.check(completion) {
        CORRECT
    } else {
        WRONG
    }
}

/// The generated tokens up to (without) the first `eos`.
pub fn completion_tokens(ids: &[u32], eos: u32) -> &[u32] {
    let end = ids.iter().position(|&t| t == eos).unwrap_or(ids.len());
    &ids[..end]
}

/// Tokens the policy produced in `generation`: up to and with its `eos`.
pub fn generated_len(generation: &[u32], eos: u32) -> usize {
    (completion_tokens(generation, eos).len() + 1).min(generation.len())
}

/// The reward of the generated token ids `ids` (after the prompt) for `task`. An id
/// outside the vocabulary is an error naming it and its position.
pub fn reward_of_tokens(task: &Task, tok: &Tokenizer, ids: &[u32]) -> Result<f32, DataError> {
    Ok(reward(
        task,
        &tok.decode(completion_tokens(ids, tokenizer::EOS))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{SplitMix64, TaskFamily};

    #[test]
    fn every_family_rewards_exactly_the_right_answer() {
        let tok = Tokenizer::new();
        let mut rng = SplitMix64::new(11);
        for family in TaskFamily::ALL {
            for size in [1, 3, 7] {
                let task = family.generate(size, &mut rng);
                let what = format!("{family} size {size}: {task:?}");
                // The worked solution is correct, as text and as tokens ending in EOS with
                // garbage after it.
                assert_eq!(reward(&task, &task.solution), CORRECT, "{what}");
                let mut ids = tok.encode(&task.solution).unwrap();
                ids.push(tokenizer::EOS);
                ids.extend(tok.encode("#999").unwrap());
                assert_eq!(
                    reward_of_tokens(&task, &tok, &ids).unwrap(),
                    CORRECT,
                    "{what}"
                );
                // Only the final answer counts: a wrong worked-out step does not matter.
                let sloppy = format!("garbage\n#{}", task.answer);
                assert_eq!(reward(&task, &sloppy), CORRECT, "{what}");
                // A different answer, an extra character, a cut-off answer, no answer.
                let wrong = format!("#{}1", task.answer);
                assert_eq!(reward(&task, &wrong), WRONG, "{what}");
                // Cut off by the token budget one character early: the answer is short.
                let cut = &task.solution[..task.solution.len() - 1];
                assert_eq!(reward(&task, cut), WRONG, "{what}");
                let no_marker = task.solution.replace('#', "");
                assert_eq!(reward(&task, &no_marker), WRONG, "{what}");
                assert_eq!(reward_of_tokens(&task, &tok, &[]).unwrap(), WRONG, "{what}");
            }
        }
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_named() {
        let task = TaskFamily::Parity.generate(2, &mut SplitMix64::new(1));
        let err = reward_of_tokens(&task, &Tokenizer::new(), &[5, 999]).unwrap_err();
        assert!(
            err.to_string().contains("token id 999 at position 1"),
            "{err}"
        );
    }
}
