//! The unrolled training-time test: what each unrolled step feeds and counts, that each of
//! its predictions is the one a causal forward over its chain's own context makes (the exact
//! proposal context), that one step of it is the plain slice's gradient, that slices stay
//! whole and replicas identical with it, and that it raises the acceptance of greedy chains
//! beyond their first draft on a trained target's own generations.

use super::super::masked::ChainAttention;
use super::super::unroll::Unroller;
use super::train::{drafter_config, held_out, run, target, trainer_with_sink};
use super::*;
use crate::model::Shape;
use crate::train::Trainer;

#[test]
fn each_unrolled_step_feeds_the_previous_prediction_and_counts_deeper_pairs() {
    let d = 2;
    // Two sequences of four positions; the second has an unknown token at position 1 and
    // padding at 3.
    let mut batch = DraftBatch {
        batch: 2,
        seq: 4,
        inputs: (0..8 * 2 * d).map(|i| i as f32).collect(),
        target_hidden: vec![0.0; 8 * d],
        target_probs: vec![0.0; 8],
        mask: vec![true, true, true, true, true, false, true, false],
    };
    let original = batch.clone();
    let u = Unroller::new(&batch, d);
    let f: Vec<f32> = (0..8 * d).map(|i| -(i as f32) - 1.0).collect();
    assert_eq!(u.advance(&mut batch, &f), 3);
    assert_eq!(
        batch.mask,
        [false, true, true, true, false, false, false, false]
    );
    let feature = |b: &DraftBatch, at: usize| b.inputs[at * 2 * d + d..(at + 1) * 2 * d].to_vec();
    let token = |b: &DraftBatch, at: usize| b.inputs[at * 2 * d..at * 2 * d + d].to_vec();
    for at in 0..8 {
        // Tokens never change: they are the row's true next tokens.
        assert_eq!(token(&batch, at), token(&original, at), "{at}");
        let fed = match at {
            // Padding (7) is fed too, and masked.
            1..=3 | 5 | 7 => Some(&f[(at - 1) * d..at * d]),
            // Position 6 follows an unknown pair, 4 starts a sequence.
            _ => None,
        };
        match fed {
            Some(prev) => assert_eq!(feature(&batch, at), prev, "{at}"),
            None => assert_eq!(feature(&batch, at), feature(&original, at), "{at}"),
        }
    }
    // Step 3: one prediction deeper, one pair fewer per run of real pairs.
    let g: Vec<f32> = f.iter().map(|x| x * 10.0).collect();
    assert_eq!(u.advance(&mut batch, &g), 2);
    assert_eq!(
        batch.mask,
        [false, false, true, true, false, false, false, false]
    );
    assert_eq!(feature(&batch, 2), &g[d..2 * d]);
    assert_eq!(u.advance(&mut batch, &g), 1);
    assert_eq!(u.advance(&mut batch, &g), 0);
}

#[test]
fn chains_start_in_the_rows_greedy_tail() {
    // Argmaxes 0, 1, 2, 0, 1; tokens 2, 1, 2, 0, unknown: the tail is positions 1..5.
    let greedy = [0, 1, 2, 0, 1];
    let mut row = DraftRow {
        hidden: vec![0.0; 5],
        targets: vec![2, 1, 2, 0, IGNORE_TARGET],
        step: 0,
    };
    assert_eq!(greedy_tail(&row, &greedy), 1);
    row.targets[3] = 1;
    assert_eq!(greedy_tail(&row, &greedy), 4);
    row.targets[0] = 0;
    row.targets[3] = 0;
    assert_eq!(greedy_tail(&row, &greedy), 0);
}

/// A batch of `rows` sequences of `seq` pairs with random inputs and targets (every pair
/// real but the last two of row 1, which are padding).
fn random_batch(cfg: &GptConfig, rows: usize, seq: usize, seed: u64) -> DraftBatch {
    let (d, v, n) = (cfg.d_model, cfg.vocab, rows * seq);
    let mut mask = vec![true; n];
    if rows > 1 {
        mask[2 * seq - 2..2 * seq].fill(false);
    }
    DraftBatch {
        batch: rows,
        seq,
        inputs: normal(seed, "inputs", n * 2 * d, 1.0),
        target_hidden: normal(seed, "hidden", n * d, 1.0),
        target_probs: distributions("probs", n, v),
        mask,
    }
}

/// A one-layer target small enough to check every unrolled prediction by hand.
fn tiny_config() -> GptConfig {
    GptConfig {
        vocab: 9,
        d_model: 8,
        heads: 2,
        layers: 1,
        seq_len: 8,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

#[test]
fn each_unrolled_prediction_is_a_causal_forward_over_its_chains_context() {
    let cfg = tiny_config();
    let (d, seq, steps) = (cfg.d_model, 6, 3);
    let mut dr = super::propose::drafter(&cfg, 32, 5);
    let original = random_batch(&cfg, 1, seq, 1);
    let mut batch = original.clone();
    let mut chain = ChainAttention::new(1, seq, cfg.heads, d / cfg.heads);
    let out = dr.unrolled_forward(&mut batch, steps, &mut chain).unwrap();
    (0..steps).for_each(|s| dr.discard(s));
    assert_eq!(out.len(), steps);
    let be = be();
    let unrolled: Vec<Vec<f32>> = out.iter().map(|s| be.to_host(&s.f).unwrap()).collect();
    // The chain of real pair r: its pairs r + 1, r + 2, … feed the prediction before them,
    // as a proposal does (with the row's own tokens where it has its drafts).
    for r in 0..seq {
        let mut inputs = original.inputs[..(r + 1) * 2 * d].to_vec();
        for (s, step) in unrolled.iter().enumerate().take(seq - r) {
            let n = r + s + 1;
            let one = DraftBatch {
                batch: 1,
                seq: n,
                inputs: inputs.clone(),
                target_hidden: vec![0.0; n * d],
                target_probs: vec![0.0; n * cfg.vocab],
                mask: vec![true; n],
            };
            let (f, _) = dr.forward(9, &one).unwrap();
            dr.discard(9);
            let f = be.to_host(&f).unwrap();
            let last = &f[(n - 1) * d..n * d];
            let ours = &step[(n - 1) * d..n * d];
            for (a, b) in last.iter().zip(ours) {
                assert!((a - b).abs() < 1e-4, "chain from {r}, step {s}: {a} vs {b}");
            }
            if n < seq {
                inputs.extend_from_slice(&original.inputs[n * 2 * d..n * 2 * d + d]);
                inputs.extend_from_slice(last);
            }
        }
    }
}

#[test]
fn one_unrolled_step_is_the_plain_slices_gradient() {
    let cfg = tiny_config();
    let be = be();
    let mut dr = super::propose::drafter(&cfg, 32, 6);
    let batch = random_batch(&cfg, 2, 5, 2);
    let grads = |dr: &Drafter<CpuBackend>| -> Vec<Vec<f32>> {
        dr.params()
            .iter()
            .map(|p| be.to_host(&p.grad).unwrap())
            .collect()
    };
    dr.zero_grads().unwrap();
    let (f, logits) = dr.forward(0, &batch).unwrap();
    let (plain, df) = dr.loss_grad(&batch, &f, &logits).unwrap();
    dr.backward_input(0, &df).unwrap();
    dr.backward_weight(0).unwrap();
    let want = grads(&dr);
    dr.zero_grads().unwrap();
    let (sums, unrolled) = dr.unrolled_slice(&mut batch.clone(), 1).unwrap();
    assert_eq!(
        (sums.pairs, sums.agree, unrolled),
        (plain.pairs, plain.agree, 0)
    );
    assert!(
        (sums.ce - plain.ce).abs() < 1e-6 * plain.ce,
        "{sums:?} vs {plain:?}"
    );
    assert!((sums.hidden - plain.hidden).abs() < 1e-6 * plain.hidden);
    assert_eq!(dr.stashed(), 0);
    for ((g, w), p) in grads(&dr).iter().zip(&want).zip(dr.params()) {
        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{}", p.name);
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-4 * scale, "{}: {a} vs {b}", p.name);
        }
    }
}

#[test]
fn unrolled_slices_count_every_depth_and_replicas_stay_identical() {
    for context in [UnrollContext::Causal, UnrollContext::Exact] {
        unrolled_slices_count_every_depth(context);
    }
}

fn unrolled_slices_count_every_depth(unroll_context: UnrollContext) {
    let (mut t, buffer) = trainer_with_sink(2);
    run(&mut t, &buffer, 2);
    let config = DrafterConfig {
        unroll: 3,
        unroll_context,
        ..drafter_config()
    };
    let trainer = |replica| {
        let mut d = Drafter::new(&target(), &config, be()).unwrap();
        d.refresh_from_gpt(t.model(), t.step()).unwrap();
        DrafterTrainer::new(d, buffer.clone(), replica, 2).unwrap()
    };
    let mut replicas = [trainer(0), trainer(1)];
    // One sequence, a window of 10 pairs, then 9 and 8 one and two predictions deep.
    let s = replicas[0].slice_within(10).unwrap();
    assert_eq!((s.layout_rows, s.pairs, s.unrolled_pairs), (10, 10, 9 + 8));
    assert_eq!(
        replicas[0].drafter().stashed(),
        0,
        "every step's stash is used up"
    );
    replicas[1].slice().unwrap();
    let grads = [
        replicas[0].take_grads().unwrap(),
        replicas[1].take_grads().unwrap(),
    ];
    assert_eq!(
        grads[0].pairs, 10,
        "the step averages over next-token pairs"
    );
    for (i, r) in replicas.iter_mut().enumerate() {
        let mut g = grads.to_vec();
        g.rotate_left(i);
        r.step_with(&g).unwrap();
    }
    assert_eq!(
        replicas[0].weights().unwrap(),
        replicas[1].weights().unwrap()
    );
    let zero = DrafterConfig {
        unroll: 0,
        ..drafter_config()
    };
    let err = zero.validate().unwrap_err().to_string();
    assert!(err.contains("drafter.unroll"), "{err}");
}

/// The target's greedy continuations of the first `prompt` tokens of `prompts`, to
/// `seq_len` positions, as drafter rows (hidden states and distributions captured by a
/// forward with the greedy tokens as targets): what a rollout at temperature 0 records.
fn greedy_rows(t: &mut Trainer<CpuBackend>, prompts: &[DraftRow], prompt: usize) -> Vec<DraftRow> {
    let cfg = target();
    let (len, v) = (cfg.seq_len, cfg.vocab);
    let mut seqs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|r| r.targets[..prompt].to_vec())
        .filter(|p| p.iter().all(|&x| (x as usize) < v))
        .collect();
    let b = seqs.len();
    let gpt = t.model_mut();
    // seq_len ids and the greedy token after the last one (its target).
    while seqs[0].len() <= len {
        let n = seqs[0].len();
        let ids: Vec<u32> = seqs.iter().flatten().copied().collect();
        let logits = gpt.logits(Shape { batch: b, seq: n }, &ids).unwrap();
        for (i, s) in seqs.iter_mut().enumerate() {
            let last = &logits[(i * n + n - 1) * v..(i * n + n) * v];
            s.push(super::super::loss::argmax(last).unwrap() as u32);
        }
    }
    let sink = DraftBufferHandle::new(&cfg, &drafter_config());
    sink.begin_step(0);
    let last = gpt.chunks_mut().last_mut().unwrap();
    last.set_draft_sink(Some(sink.clone())).unwrap();
    let ids: Vec<u32> = seqs.iter().flat_map(|s| s[..len].to_vec()).collect();
    let next: Vec<u32> = seqs.iter().flat_map(|s| s[1..].to_vec()).collect();
    gpt.forward_backward(0, Shape { batch: b, seq: len }, &ids, &next, 1.0)
        .unwrap();
    let last = gpt.chunks_mut().last_mut().unwrap();
    last.set_draft_sink(None).unwrap();
    let rows: Vec<DraftRow> = sink.lock().rows().cloned().collect();
    rows
}

/// A drafter trained `slices` slices with `unroll` on `train`, and its chains on `held`.
fn chains(
    t: &Trainer<CpuBackend>,
    train: &[DraftRow],
    held: &[DraftRow],
    unroll: usize,
    slices: usize,
) -> ChainStats {
    let config = DrafterConfig {
        unroll,
        advanced: DrafterTuning {
            buffer_rows: train.len(),
            ..DrafterTuning::default()
        },
        ..drafter_config()
    };
    let buffer = DraftBufferHandle::new(&target(), &config);
    buffer.begin_step(0);
    for r in train {
        buffer.lock().push(r.clone()).unwrap();
    }
    let mut d = Drafter::new(&target(), &config, be()).unwrap();
    d.refresh_from_gpt(t.model(), t.step()).unwrap();
    let mut dt = DrafterTrainer::new(d, buffer, 0, 1).unwrap();
    for _ in 0..slices {
        dt.slice().unwrap();
    }
    dt.drafter_mut().chain_acceptance(held, 4).unwrap()
}

#[test]
fn unrolling_raises_chain_acceptance_beyond_the_first_draft() {
    let (mut t, buffer) = trainer_with_sink(60);
    run(&mut t, &buffer, 60);
    // Prompts from data rows the target did not train on.
    let mut prompts = Vec::new();
    for step in 0..8 {
        prompts.extend(held_out(&mut t, 1000 + step));
    }
    let train = greedy_rows(&mut t, &prompts[..48], 2);
    let held = greedy_rows(&mut t, &prompts[48..], 2);
    let report = |name: &str, s: &ChainStats| {
        let c: Vec<String> = (1..=4)
            .map(|j| format!("{:.3}", s.conditional(j)))
            .collect();
        eprintln!(
            "{name}: acceptance length {:.3}, per depth given the ones before {c:?}, {s:?}",
            s.acceptance_length()
        );
    };
    // Same rows, same seed, same slices: only the unrolled steps differ.
    let slices = 200;
    let one = chains(&t, &train, &held, 1, slices);
    let three = chains(&t, &train, &held, 3, slices);
    report("unroll 1", &one);
    report("unroll 3", &three);
    // Drafts 2..=4 accepted (each after the ones before it).
    let deep = |s: &ChainStats| s.accepted[1..].iter().sum::<usize>();
    assert_eq!(one.proposals, three.proposals);
    assert!(deep(&three) > deep(&one), "{one:?} vs {three:?}");
}
