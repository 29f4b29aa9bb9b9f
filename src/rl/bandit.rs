//! [`KBandit`]: the adaptive engine's choice of the draft length K, a bucketed
//! epsilon-greedy bandit.
//!
//! The best K depends on how many sequences are live: with a large batch, verification of
//! K+1 positions per sequence costs real compute and small K (or none) wins; in the long
//! tail a step costs about the same for any K and long drafts pay. So the live-batch size is
//! bucketed (powers of two: 1, 2, 3–4, 5–8, …) and each bucket learns on its own. The reward
//! of one step is `emitted tokens × batch / seconds`, the seconds being what the step cost
//! (the rollout engine reports its drafting plus every stage's compute, not its latency,
//! which with several groups in flight is mostly the other groups' work); an arm's value
//! is the median of its last `window` rewards (robust to the noise of a shared machine).
//!
//! An arm K = 0 is a plain decode step, rewarded the same way: with it a bucket learns on
//! its own whether speculation pays there at all, from the engine's own steps, instead of
//! a threshold derived from step costs timed alone (which miss the pipeline's overlap and
//! the drafter's cold caches inside a rollout). Each choice is logged (tracing at debug
//! level, and in [`KBandit::log`]).

use std::collections::{HashMap, VecDeque};

use serde::Serialize;

use crate::data::rng::SplitMix64;

/// One choice of the bandit, and what it earned once reported.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Choice {
    /// Live batch size when choosing.
    pub live: usize,
    /// The bucket's upper bound (a power of two).
    pub bucket: usize,
    pub k: usize,
    /// Chosen at random (exploration) rather than as the best so far.
    pub explored: bool,
    /// Reward of the step (tokens·batch/s), once reported.
    pub reward: Option<f64>,
}

/// Bucketed epsilon-greedy over the arms `ks`.
#[derive(Clone, Debug)]
pub struct KBandit {
    ks: Vec<usize>,
    epsilon: f64,
    window: usize,
    rng: SplitMix64,
    rewards: HashMap<(usize, usize), VecDeque<f64>>,
    log: Vec<Choice>,
}

/// The bucket of a live batch size: the smallest power of two at least `live`.
pub fn bucket(live: usize) -> usize {
    live.max(1).next_power_of_two()
}

impl KBandit {
    /// A bandit over draft lengths `ks` (at least one ≥ 1; 0 is plain decoding), exploring
    /// with probability `epsilon` and valuing each arm by the median of its last `window`
    /// rewards.
    pub fn new(ks: Vec<usize>, epsilon: f64, window: usize, seed: u64) -> Self {
        assert!(
            ks.iter().any(|&k| k >= 1),
            "arms must include a draft length K ≥ 1"
        );
        KBandit {
            ks,
            epsilon,
            window: window.max(1),
            rng: SplitMix64::new(seed),
            rewards: HashMap::new(),
            log: Vec::new(),
        }
    }

    /// Median of the recent rewards of arm `k` in `bucket`.
    pub fn value(&self, bucket: usize, k: usize) -> Option<f64> {
        let r = self.rewards.get(&(bucket, k))?;
        let mut v: Vec<f64> = r.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        (n > 0).then(|| {
            if n % 2 == 1 {
                v[n / 2]
            } else {
                (v[n / 2 - 1] + v[n / 2]) / 2.0
            }
        })
    }

    /// Chooses K for a step with `live` sequences: an untried arm first, then the best
    /// median, or with probability epsilon a random arm. Returns the index of the choice
    /// in the log, to pass to [`KBandit::reward`].
    ///
    /// An arm chosen for a step still in flight counts as tried: with several groups in
    /// the pipeline, choices come before the rewards of earlier ones, and the first untried
    /// arm would otherwise be chosen for every group in flight. Among untried arms the
    /// one with the fewest pending choices goes first, so the arms are tried in turn.
    pub fn choose(&mut self, live: usize) -> (usize, usize) {
        let b = bucket(live);
        let pending = |k: usize| {
            self.log
                .iter()
                .filter(|c| c.bucket == b && c.k == k && c.reward.is_none())
                .count()
        };
        let untried = self
            .ks
            .iter()
            .copied()
            .filter(|&k| self.value(b, k).is_none())
            .min_by_key(|&k| pending(k));
        let (k, explored) = match untried {
            Some(k) => (k, true),
            None if self.rng.next_f64() < self.epsilon => {
                (self.ks[self.rng.below(self.ks.len() as u64) as usize], true)
            }
            None => {
                let best = self
                    .ks
                    .iter()
                    .copied()
                    .max_by(|&a, &c| {
                        let (va, vc) = (
                            self.value(b, a).unwrap_or(0.0),
                            self.value(b, c).unwrap_or(0.0),
                        );
                        va.total_cmp(&vc)
                    })
                    .expect("at least one arm");
                (best, false)
            }
        };
        tracing::debug!(live, bucket = b, k, explored, "speculation: chose K");
        self.log.push(Choice {
            live,
            bucket: b,
            k,
            explored,
            reward: None,
        });
        (k, self.log.len() - 1)
    }

    /// Reports the outcome of choice `id`: `accepted_tokens` emitted per sequence (mean over
    /// the step's `batch` sequences; 1 for a plain step) in `seconds`;
    /// reward = emitted × batch / seconds.
    pub fn reward(&mut self, id: usize, accepted_tokens: f64, batch: usize, seconds: f64) {
        let Some(c) = self.log.get_mut(id) else {
            return;
        };
        let reward = accepted_tokens * batch as f64 / seconds.max(1e-9);
        c.reward = Some(reward);
        let q = self.rewards.entry((c.bucket, c.k)).or_default();
        q.push_back(reward);
        if q.len() > self.window {
            q.pop_front();
        }
    }

    /// Every choice so far, in order.
    pub fn log(&self) -> &[Choice] {
        &self.log
    }

    /// Hands over the choices logged so far and starts a new log, keeping what the arms
    /// have earned: a rollout engine reports each rollout's own choices while the bandit
    /// keeps learning across rollouts. Choice ids restart at 0, so call it only when no
    /// choice is waiting for its reward.
    pub fn take_log(&mut self) -> Vec<Choice> {
        std::mem::take(&mut self.log)
    }

    /// Whether this bandit was built with these arms and knobs (so it can go on learning
    /// under them).
    pub fn fits(&self, ks: &[usize], epsilon: f64, window: usize) -> bool {
        self.ks == ks && self.epsilon == epsilon && self.window == window.max(1)
    }

    /// The arms.
    pub fn arms(&self) -> &[usize] {
        &self.ks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9].map(bucket), [1, 2, 4, 4, 8, 8, 16]);
    }

    #[test]
    fn tries_every_arm_then_exploits_the_best_median() {
        let mut b = KBandit::new(vec![1, 2, 4], 0.0, 5, 0);
        let mut tried = Vec::new();
        for _ in 0..3 {
            let (k, id) = b.choose(3);
            tried.push(k);
            // K = 2 pays best, with one outlier for K = 4 that the median ignores later.
            b.reward(id, if k == 2 { 3.0 } else { 1.0 }, 1, 1.0);
        }
        tried.sort();
        assert_eq!(tried, vec![1, 2, 4]);
        for _ in 0..5 {
            let (k, id) = b.choose(4);
            assert_eq!(k, 2, "same bucket as live = 3");
            b.reward(id, 3.0, 1, 1.0);
        }
        // Another bucket learns on its own.
        let (k, _) = b.choose(16);
        assert_eq!(k, 1);
        assert!(b.log().iter().filter(|c| c.explored).count() == 4);
        assert_eq!(b.value(4, 2), Some(3.0));
    }

    #[test]
    fn choices_in_flight_try_the_arms_in_turn() {
        let mut b = KBandit::new(vec![1, 2, 4, 6], 0.0, 5, 0);
        // Four groups in flight choose before any reward comes back.
        let ids: Vec<(usize, usize)> = (0..4).map(|_| b.choose(2)).collect();
        let mut ks: Vec<usize> = ids.iter().map(|&(k, _)| k).collect();
        ks.sort();
        assert_eq!(ks, vec![1, 2, 4, 6], "each arm once, not K = 1 four times");
        // A fifth before any reward: all are pending once, so the first arm again.
        assert_eq!(b.choose(2).0, 1);
        for (k, id) in ids {
            b.reward(id, if k == 4 { 2.0 } else { 1.0 }, 1, 1.0);
        }
        assert_eq!(b.choose(2).0, 4, "every arm rewarded: the best median");
    }

    #[test]
    fn a_plain_arm_wins_where_speculation_does_not_pay() {
        let mut b = KBandit::new(vec![0, 2, 4], 0.0, 5, 0);
        for _ in 0..12 {
            // A big batch: plain steps emit 1 token per sequence fast, drafts cost more
            // than they save; in the tail (live 1) K = 4 pays.
            let (k, id) = b.choose(30);
            b.reward(id, 1.0 + k as f64 * 0.1, 30, 1.0 + k as f64);
            let (k, id) = b.choose(1);
            b.reward(id, 1.0 + k as f64 * 0.6, 1, 1.0 + k as f64 * 0.1);
        }
        assert_eq!(b.choose(30).0, 0, "plain decoding in the big bucket");
        assert_eq!(b.choose(1).0, 4, "long drafts in the tail");
    }

    #[test]
    #[should_panic(expected = "K ≥ 1")]
    fn plain_alone_is_not_a_bandit() {
        KBandit::new(vec![0], 0.1, 4, 0);
    }

    #[test]
    fn median_over_the_window() {
        let mut b = KBandit::new(vec![3], 0.0, 3, 0);
        for r in [100.0, 1.0, 2.0, 3.0] {
            let (_, id) = b.choose(1);
            b.reward(id, r, 1, 1.0);
        }
        assert_eq!(b.value(1, 3), Some(2.0), "the 100 fell out of the window");
    }

    #[test]
    fn epsilon_explores() {
        let mut b = KBandit::new(vec![1, 2], 1.0, 3, 9);
        for _ in 0..40 {
            let (_, id) = b.choose(2);
            b.reward(id, 1.0, 1, 1.0);
        }
        assert!(b.log().iter().all(|c| c.explored));
        let ones = b.log().iter().filter(|c| c.k == 1).count();
        assert!(ones > 5 && ones < 35, "both arms drawn: {ones}");
    }
}
