use super::*;
use crate::model::{Cut, Gpt, GptConfig};
use crate::rl::speculative::RandomProposer;
use crate::tensor::CpuBackend;

/// A fresh model of `layers` blocks over `seq_len` positions, drawn from `seed`.
fn model(layers: usize, seq_len: usize, seed: u64) -> Gpt<CpuBackend> {
    let config = GptConfig {
        layers,
        seq_len,
        seed,
        ..GptConfig::default()
    };
    Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

/// The engine merges groups that shrink (fewer group steps than splitting down to
/// single sequences), and what it generates does not depend on it.
#[test]
fn merging_small_groups_takes_fewer_steps_and_changes_no_output() {
    let gpt = model(2, 48, 5);
    let config = gpt.config().clone();
    let engine = |rows| {
        let stages = InferStage::stages_of(&gpt, &Cut::Even(2)).unwrap();
        RolloutEngine::new(stages)
            .unwrap()
            .with_min_group_rows(rows)
    };
    // A long tail: caps from 2 to 30 (the untrained model rarely emits EOS).
    let requests: Vec<Request> = (0..12)
        .map(|i| Request {
            prompt: vec![1, 4 + i as u32],
            max_new: 2 + (i * i) % 29,
        })
        .collect();
    let cfg = |speculation| RolloutConfig {
        groups: 4,
        speculation,
        ..RolloutConfig::default()
    };
    let split = engine(1)
        .run(&requests, &cfg(Speculation::Off), None)
        .unwrap();
    let merged = engine(4)
        .run(&requests, &cfg(Speculation::Off), None)
        .unwrap();
    assert_eq!(merged.sequences, split.sequences);
    assert!(
        merged.stats.steps < split.stats.steps,
        "{} merged steps against {} split",
        merged.stats.steps,
        split.stats.steps
    );
    let mut random = RandomProposer::new(config.vocab);
    let spec = engine(4)
        .run(
            &requests,
            &cfg(Speculation::Fixed { k: 3 }),
            Some(&mut random),
        )
        .unwrap();
    assert_eq!(spec.sequences, split.sequences, "lossless");
}

/// A bandit with a plain arm (K = 0) runs some of the tail's steps as plain decode
/// steps, rewards them like verifications, and stays lossless.
#[test]
fn a_plain_arm_decodes_some_steps_and_is_rewarded() {
    let gpt = model(2, 32, 3);
    let config = gpt.config().clone();
    let stages = || InferStage::stages_of(&gpt, &Cut::Even(2)).unwrap();
    let requests: Vec<Request> = (0..6)
        .map(|i| Request {
            prompt: vec![1, 5 + i as u32, 9],
            max_new: 6 + 3 * i,
        })
        .collect();
    let run = |speculation, proposer: Option<&mut dyn Proposer>| {
        let cfg = RolloutConfig {
            groups: 2,
            speculation,
            ..RolloutConfig::default()
        };
        RolloutEngine::new(stages())
            .unwrap()
            .run(&requests, &cfg, proposer)
            .unwrap()
    };
    let plain = run(Speculation::Off, None);
    let mut random = RandomProposer::new(config.vocab);
    let adaptive = Speculation::Adaptive(AdaptiveConfig {
        threshold: requests.len(),
        ks: vec![0, 2],
        epsilon: 0.0,
        window: 4,
        tree: None,
    });
    let ad = run(adaptive, Some(&mut random));
    assert_eq!(ad.sequences, plain.sequences, "lossless");
    let plain_steps = ad.choices.iter().filter(|c| c.k == 0).count();
    let drafted = ad.choices.iter().filter(|c| c.k == 2).count();
    assert!(plain_steps > 0 && drafted > 0, "{:?}", ad.choices);
    assert!(ad.choices.iter().all(|c| c.reward.is_some_and(|r| r > 0.0)));
    // Only the K = 2 choices verified drafts.
    assert!(ad.stats.verifications > 0 && ad.stats.drafted <= 2 * ad.stats.verifications);
    let bad = AdaptiveConfig {
        ks: vec![0],
        ..AdaptiveConfig::default()
    };
    let cfg = RolloutConfig {
        speculation: Speculation::Adaptive(bad),
        ..RolloutConfig::default()
    };
    let mut random = RandomProposer::new(config.vocab);
    let err = RolloutEngine::new(stages())
        .unwrap()
        .run(&requests, &cfg, Some(&mut random))
        .unwrap_err();
    assert!(err.to_string().contains("speculation.ks"), "{err}");
}

/// A draft length is checked against the model's positions before anything is sized by it
/// (`usize::MAX` overflowed a capacity, 1e9 asked for 200 GB): one error naming the field.
#[test]
fn a_draft_longer_than_the_positions_is_refused() {
    let gpt = model(1, 16, GptConfig::default().seed);
    let config = gpt.config().clone();
    let stages = InferStage::stages_of(&gpt, &Cut::Even(1)).unwrap();
    let mut engine = RolloutEngine::new(stages).unwrap();
    let requests = [Request {
        prompt: vec![1, 2],
        max_new: 4,
    }];
    let mut random = RandomProposer::new(config.vocab);
    for k in [16, 1_000_000_000, usize::MAX] {
        let cfg = RolloutConfig {
            speculation: Speculation::Fixed { k },
            ..RolloutConfig::default()
        };
        let err = engine
            .run(&requests, &cfg, Some(&mut random))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "`speculation.k` a draft of {k} tokens does not fit the model's 16 positions"
            )),
            "{err}"
        );
    }
    let cfg = RolloutConfig {
        speculation: Speculation::Fixed { k: 15 },
        ..RolloutConfig::default()
    };
    assert!(engine.run(&requests, &cfg, Some(&mut random)).is_ok());
}

/// Stages run on fewer threads than there are stages (a run of consecutive stages each,
/// and no more plain groups than threads) generate what a thread per stage does, plainly
/// and speculatively, and every stage's compute time is still reported.
#[test]
fn fewer_stage_threads_than_stages_change_no_output() {
    let gpt = model(4, 40, 7);
    let config = gpt.config().clone();
    let requests: Vec<Request> = (0..10)
        .map(|i| Request {
            prompt: vec![1, 3 + i as u32],
            max_new: 3 + (i * 7) % 20,
        })
        .collect();
    let run = |workers, speculation: &Speculation| {
        let stages = InferStage::stages_of(&gpt, &Cut::Even(4)).unwrap();
        let mut engine = RolloutEngine::new(stages)
            .unwrap()
            .with_min_group_rows(1)
            .with_workers(workers);
        let cfg = RolloutConfig {
            groups: 4,
            speculation: speculation.clone(),
            ..RolloutConfig::default()
        };
        let mut random = RandomProposer::new(config.vocab);
        let proposer: Option<&mut dyn Proposer> = match speculation {
            Speculation::Off => None,
            _ => Some(&mut random),
        };
        engine.run(&requests, &cfg, proposer).unwrap()
    };
    for speculation in [Speculation::Off, Speculation::Fixed { k: 2 }] {
        let each = run(4, &speculation);
        for workers in [1, 2, 3] {
            let fewer = run(workers, &speculation);
            assert_eq!(fewer.sequences, each.sequences, "{workers} threads");
            assert_eq!(fewer.stats.stage_busy_s.len(), 4);
            assert!(fewer.stats.stage_busy_s.iter().all(|&b| b > 0.0));
            let most = fewer.steps.iter().map(|s| s.in_flight).max().unwrap();
            match speculation {
                Speculation::Off => assert!(most <= workers, "{most} plain groups"),
                _ => assert!(most <= 4),
            }
        }
    }
}
