//! The rollout engine end to end: plain decoding through pipelined KV-cache stages equals
//! greedy generation with the training model, and speculative decoding is lossless.

mod common;

use common::rollouts::{config, engine, gpt, greedy_reference, requests};
use pipefill::model::Cut;
use pipefill::model::drafter::{DraftBufferHandle, Drafter, DrafterConfig, DrafterTrainer};
use pipefill::model::infer::InferStage;
use pipefill::rl::RlError;
use pipefill::rl::rollout::{
    AdaptiveConfig, Request, RolloutConfig, RolloutEngine, RolloutOutput, Speculation,
};
use pipefill::rl::speculative::{OracleProposer, Proposer, RandomProposer};
use pipefill::tensor::CpuBackend;

fn run(
    e: &mut RolloutEngine<CpuBackend>,
    spec: Speculation,
    groups: usize,
    p: Option<&mut dyn Proposer>,
) -> RolloutOutput {
    let cfg = RolloutConfig {
        groups,
        speculation: spec,
        record_rows: true,
        ..RolloutConfig::default()
    };
    e.run(&requests(10), &cfg, p).unwrap()
}

#[test]
fn plain_rollout_equals_greedy_generation_of_the_training_model() {
    let mut model = gpt();
    let out = run(&mut engine(&model), Speculation::Off, 3, None);
    for (i, r) in requests(10).iter().enumerate() {
        assert_eq!(
            out.sequences[i],
            greedy_reference(&mut model, r),
            "request {i}"
        );
    }
    assert!(out.live_curve.windows(2).all(|w| w[1].live <= w[0].live));
    assert_eq!(out.live_curve.last().unwrap().live, 0);
    assert_eq!(out.stats.verifications, 0);
}

#[test]
fn greedy_speculation_is_token_for_token_plain_decoding() {
    let model = gpt();
    let mut e = engine(&model);
    let plain = run(&mut e, Speculation::Off, 2, None);
    let mut random = RandomProposer::new(50);
    let fixed = run(&mut e, Speculation::Fixed { k: 3 }, 2, Some(&mut random));
    assert_eq!(fixed.sequences, plain.sequences, "random drafts");
    assert!(fixed.stats.verifications > 0);
    let mut oracle = OracleProposer::new(50, &plain.sequences);
    let exact = run(&mut e, Speculation::Fixed { k: 4 }, 3, Some(&mut oracle));
    assert_eq!(exact.sequences, plain.sequences, "oracle drafts");
    assert!(
        exact.stats.acceptance_length() > 3.0,
        "an oracle's drafts are accepted: {}",
        exact.stats.acceptance_length()
    );
    assert!(
        exact.stats.steps < plain.stats.steps,
        "fewer steps with accepted drafts"
    );
    let adaptive = AdaptiveConfig {
        threshold: 4,
        ..AdaptiveConfig::default()
    };
    let mut random = RandomProposer::new(50);
    let ad = run(
        &mut e,
        Speculation::Adaptive(adaptive),
        2,
        Some(&mut random),
    );
    assert_eq!(ad.sequences, plain.sequences, "adaptive");
    assert!(!ad.choices.is_empty(), "the bandit logged its choices");
    assert!(
        ad.choices.iter().all(|c| c.live <= 4),
        "speculation only in the tail"
    );
}

/// The adaptive engine keeps its K bandit across rollouts (and hands it to the next
/// engine): what a long tail's few choices taught it is not thrown away. With no random
/// exploration, a bandit that has tried every arm in a bucket explores there no more.
#[test]
fn the_k_bandit_keeps_learning_across_rollouts_and_engines() {
    let model = gpt();
    let adaptive = Speculation::Adaptive(AdaptiveConfig {
        threshold: 10,
        ks: vec![1, 3],
        epsilon: 0.0,
        ..AdaptiveConfig::default()
    });
    let explored = |r: &RolloutOutput| r.choices.iter().filter(|c| c.explored).count();
    let mut e = engine(&model);
    let mut random = RandomProposer::new(50);
    let first = run(&mut e, adaptive.clone(), 1, Some(&mut random));
    assert!(explored(&first) > 0, "a fresh bandit tries its arms");
    let second = run(&mut e, adaptive.clone(), 1, Some(&mut random));
    assert!(
        explored(&second) < explored(&first),
        "the same engine's bandit goes on from what it learned: {} explored choices, {} before",
        explored(&second),
        explored(&first)
    );
    // Each rollout reports its own choices only, every one with its reward.
    assert!(!second.choices.is_empty() && second.choices.len() <= second.stats.steps);
    assert!(second.choices.iter().all(|c| c.reward.is_some()));
    let bandit = e.take_bandit().expect("an adaptive run leaves its bandit");
    let mut next = engine(&model).with_bandit(bandit);
    let third = run(&mut next, adaptive.clone(), 1, Some(&mut random));
    assert!(
        explored(&third) < explored(&first),
        "handed to a new engine"
    );
    // A fresh engine starts over: it tries both arms of the buckets it visits again, so
    // it explores more than the engine that was handed the bandit. (Not a count equal to
    // the first rollout's: rewards are timed, so exploited K and with them the live-batch
    // path, and which buckets are visited, differ between runs.)
    let mut fresh = engine(&model);
    let mut random = RandomProposer::new(50);
    let again = run(&mut fresh, adaptive, 1, Some(&mut random));
    assert!(
        explored(&again) >= 2 && explored(&again) > explored(&third),
        "a fresh engine starts over: {} explored choices, {} with the handed bandit",
        explored(&again),
        explored(&third)
    );
}

#[test]
fn greedy_speculation_with_the_drafter_untrained_and_trained() {
    let model = gpt();
    let mut e = engine(&model);
    let plain = run(&mut e, Speculation::Off, 2, None);
    let dc = DrafterConfig {
        window: 8,
        batch_rows: 4,
        max_positions: 32,
        ..DrafterConfig::default()
    };
    let be = CpuBackend::new(1).unwrap();
    let mut drafter = Drafter::new(&config(), &dc, be).unwrap();
    drafter.refresh_from_gpt(&model, 0).unwrap();
    let untrained = run(&mut e, Speculation::Fixed { k: 3 }, 2, Some(&mut drafter));
    assert_eq!(untrained.sequences, plain.sequences, "untrained drafter");
    // Train on the rows the plain rollout just produced (its own outputs).
    let buffer = DraftBufferHandle::new(&config(), &dc);
    buffer.begin_step(0);
    for row in plain.rows.iter().cloned() {
        buffer.lock().push(row).unwrap();
    }
    let mut trainer = DrafterTrainer::new(drafter, buffer, 0, 1).unwrap();
    for _ in 0..60 {
        trainer.slice().unwrap();
    }
    let out = run(
        &mut e,
        Speculation::Fixed { k: 3 },
        2,
        Some(trainer.drafter_mut()),
    );
    assert_eq!(out.sequences, plain.sequences, "trained drafter");
    assert!(
        out.stats.acceptance_length() > untrained.stats.acceptance_length(),
        "training on the rollouts raises acceptance: {} vs {}",
        out.stats.acceptance_length(),
        untrained.stats.acceptance_length()
    );
}

#[test]
fn sampling_is_reproducible_and_independent_of_grouping() {
    let model = gpt();
    let mut e = engine(&model);
    let cfg = |groups| RolloutConfig {
        temperature: 0.8,
        groups,
        seed: 4,
        ..RolloutConfig::default()
    };
    let a = e.run(&requests(8), &cfg(1), None).unwrap();
    let b = e.run(&requests(8), &cfg(4), None).unwrap();
    assert_eq!(a.sequences, b.sequences);
    let greedy = e
        .run(&requests(8), &RolloutConfig::default(), None)
        .unwrap();
    assert_ne!(
        a.sequences, greedy.sequences,
        "temperature 0.8 is not greedy"
    );
}

#[test]
fn bad_requests_and_configs_are_errors() {
    let model = gpt();
    let mut e = engine(&model);
    let empty = [Request {
        prompt: vec![],
        max_new: 3,
    }];
    let err = e.run(&empty, &RolloutConfig::default(), None).unwrap_err();
    assert!(matches!(err, RlError::Request { index: 0, .. }), "{err}");
    let spec = RolloutConfig {
        speculation: Speculation::Fixed { k: 2 },
        ..RolloutConfig::default()
    };
    let err = e.run(&requests(2), &spec, None).unwrap_err();
    assert!(err.to_string().contains("needs a proposer"), "{err}");
    let stages = InferStage::stages_of(&model, &Cut::Even(2)).unwrap();
    let reversed: Vec<_> = stages.into_iter().rev().collect();
    assert!(RolloutEngine::new(reversed).is_err());
}

/// A step that is the only group in flight (the long tail) runs through the stages on the
/// driver's thread; with that off, it crosses the stage threads. The tokens are the same
/// either way (greedy with and without drafts, and sampled), the inline path runs (lone
/// steps) and the step log accounts for every step and token.
#[test]
fn inline_tail_generates_what_the_stage_threads_generate() {
    let model = gpt();
    let cases = [
        (Speculation::Off, 0.0),
        (Speculation::Fixed { k: 3 }, 0.0),
        (Speculation::Off, 0.8),
    ];
    for (spec, temperature) in cases {
        let mut outs = Vec::new();
        for inline in [false, true] {
            let mut e = engine(&model)
                .with_min_group_rows(1)
                .with_inline_tail(inline);
            let mut random = RandomProposer::new(50);
            let p: Option<&mut dyn Proposer> = match spec {
                Speculation::Off => None,
                _ => Some(&mut random),
            };
            let cfg = RolloutConfig {
                groups: 3,
                speculation: spec.clone(),
                temperature,
                seed: 7,
                ..RolloutConfig::default()
            };
            let out = e.run(&requests(10), &cfg, p).unwrap();
            let emitted: usize = out.steps.iter().map(|s| s.emitted).sum();
            assert_eq!(emitted, out.stats.tokens, "{spec:?} inline {inline}");
            assert_eq!(out.steps.len(), out.stats.steps, "{spec:?} inline {inline}");
            assert!(
                out.steps.iter().any(|s| s.in_flight == 1)
                    && out.steps.iter().any(|s| s.in_flight > 1),
                "{spec:?}: the batch starts with several groups and ends with one"
            );
            assert!(out.stats.stage_busy_s.iter().all(|&b| b > 0.0));
            outs.push(out.sequences);
        }
        assert_eq!(outs[0], outs[1], "{spec:?} at temperature {temperature}");
    }
}
