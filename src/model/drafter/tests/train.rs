//! Training the drafter on a real target: capture leaves training bitwise unchanged, the
//! loss falls, agreement with the target rises, replicas stay identical, and proposals
//! agree with the training forward.

use super::*;
use crate::config::TrainConfig;
use crate::data::DataConfig;
use crate::model::ModelError;
use crate::model::infer::rowmul::Precision;
use crate::model::{Cut, Gpt, Shape};
use crate::train::Trainer;

/// The target: small enough that a few dozen reference steps take well under a second.
pub(super) fn target() -> GptConfig {
    GptConfig {
        d_model: 32,
        heads: 4,
        layers: 2,
        seq_len: 32,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

pub(super) fn train_config(steps: u64) -> TrainConfig {
    TrainConfig {
        steps,
        micro_batches: 2,
        micro_batch_size: 4,
        warmup: 5,
        threads: 1,
        eval_tasks: 0,
        ..TrainConfig::default()
    }
}

pub(super) fn drafter_config() -> DrafterConfig {
    // Slices of 4 whole sequences (the job's default slice is 1 × 16 positions).
    DrafterConfig {
        batch_rows: 4,
        max_positions: 64,
        advanced: DrafterTuning {
            buffer_rows: 64,
            ..DrafterTuning::default()
        },
        ..DrafterConfig::default()
    }
}

/// A reference trainer whose last chunk copies into a new buffer.
pub(super) fn trainer_with_sink(steps: u64) -> (Trainer<CpuBackend>, DraftBufferHandle) {
    let mut t =
        Trainer::reference(&target(), &DataConfig::default(), &train_config(steps)).unwrap();
    let buffer = DraftBufferHandle::new(&target(), &drafter_config());
    let last = t.model_mut().chunks_mut().last_mut().unwrap();
    last.set_draft_sink(Some(buffer.clone())).unwrap();
    (t, buffer)
}

/// Trains the target `steps` steps, the buffer following its steps.
pub(super) fn run(t: &mut Trainer<CpuBackend>, buffer: &DraftBufferHandle, steps: u64) {
    for _ in 0..steps {
        buffer.begin_step(t.step());
        t.train_step().unwrap();
    }
}

/// The rows of one forward of step `step`'s data under the target's current weights.
pub(super) fn held_out(t: &mut Trainer<CpuBackend>, step: u64) -> Vec<DraftRow> {
    let sink = DraftBufferHandle::new(&target(), &drafter_config());
    let last = t.model_mut().chunks_mut().last_mut().unwrap();
    last.set_draft_sink(Some(sink.clone())).unwrap();
    t.eval_loss(step).unwrap();
    let last = t.model_mut().chunks_mut().last_mut().unwrap();
    last.set_draft_sink(None).unwrap();
    sink.lock().rows().cloned().collect()
}

fn new_trainer(
    t: &Trainer<CpuBackend>,
    buffer: &DraftBufferHandle,
    replica: usize,
    replicas: usize,
) -> DrafterTrainer<CpuBackend> {
    let mut d = Drafter::new(&target(), &drafter_config(), be()).unwrap();
    d.refresh_from_gpt(t.model(), t.step()).unwrap();
    DrafterTrainer::new(d, buffer.clone(), replica, replicas).unwrap()
}

#[test]
fn capture_changes_no_training_result() {
    let mut plain =
        Trainer::reference(&target(), &DataConfig::default(), &train_config(3)).unwrap();
    let (mut captured, buffer) = trainer_with_sink(3);
    for _ in 0..3 {
        buffer.begin_step(captured.step());
        let a = plain.train_step().unwrap();
        let b = captured.train_step().unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    }
    for name in plain.model().param_names() {
        let (a, b) = (
            plain.model().param_values(&name).unwrap(),
            captured.model().param_values(&name).unwrap(),
        );
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}"
        );
    }
    // Two steps' rows (8 sequences each) are kept: the current and the previous.
    let b = buffer.lock();
    assert_eq!((b.current_len(), b.previous_len()), (8, 8));
    let row = b.rows().last().unwrap();
    assert_eq!(row.len(), 32);
    assert_eq!(row.hidden.len(), 32 * target().d_model);
}

#[test]
fn captured_rows_are_the_heads_input_and_the_batch_its_softmax() {
    let cfg = target();
    let mut gpt = Gpt::new(&cfg, be(), &Cut::Even(2)).unwrap();
    let buffer = DraftBufferHandle::new(&cfg, &drafter_config());
    let err = gpt.chunks_mut()[0]
        .set_draft_sink(Some(buffer.clone()))
        .unwrap_err();
    assert!(err.to_string().contains("only the last chunk"), "{err}");
    let wrong = DraftBufferHandle::from_buffer(DraftBuffer::new(cfg.d_model + 1, cfg.vocab, 4));
    assert!(gpt.chunks_mut()[1].set_draft_sink(Some(wrong)).is_err());
    gpt.chunks_mut()[1]
        .set_draft_sink(Some(buffer.clone()))
        .unwrap();
    let shape = Shape { batch: 1, seq: 6 };
    let ids = [3u32, 9, 4, 1, 7, 2];
    let targets = [9u32, 4, 1, 7, 2, 5];
    gpt.forward_backward(0, shape, &ids, &targets, 1.0).unwrap();
    let logits = gpt.logits(shape, &ids).unwrap();
    let rows: Vec<DraftRow> = buffer.lock().rows().cloned().collect();
    assert_eq!(
        rows.len(),
        1,
        "inference forwards (no targets) capture nothing"
    );
    let r = &rows[0];
    assert_eq!(r.targets, targets);
    // logits = hidden · head.wᵀ, and a slice's soft targets, recomputed through the drafter's
    // frozen head, are softmax(logits) of the next position: pair t's at position t + 1.
    let head = gpt.param_values("head.w").unwrap();
    let v = cfg.vocab;
    let mut drafter = Drafter::new(&cfg, &drafter_config(), be()).unwrap();
    drafter.refresh_from_gpt(&gpt, 0).unwrap();
    let batch = drafter.batch(&rows, usize::MAX, None).unwrap();
    assert_eq!((batch.batch, batch.seq, batch.pairs()), (1, 5, 5));
    let greedy = drafter.target_argmax(r).unwrap();
    for t in 0..6 {
        let z = &logits[t * v..(t + 1) * v];
        assert_eq!(Some(greedy[t]), crate::model::drafter::loss::argmax(z));
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = z.iter().map(|x| (x - max).exp()).sum();
        for j in 0..v {
            let q = (z[j] - max).exp() / sum;
            if t > 0 {
                assert!((q - batch.target_probs[(t - 1) * v + j]).abs() < 1e-5);
            }
            let hz: f32 = (0..cfg.d_model)
                .map(|k| r.hidden[t * cfg.d_model + k] * head[j * cfg.d_model + k])
                .sum();
            assert!((hz - z[j]).abs() < 1e-4);
        }
    }
}

#[test]
fn loss_falls_and_agreement_rises_on_a_trained_target() {
    let (mut t, buffer) = trainer_with_sink(60);
    run(&mut t, &buffer, 40);
    let held = held_out(&mut t, 1000);
    let mut dt = new_trainer(&t, &buffer, 0, 1);
    let before = dt.evaluate(&held).unwrap();
    let mut last = None;
    for _ in 0..120 {
        last = Some(dt.slice().unwrap());
    }
    let after = dt.evaluate(&held).unwrap();
    let last = last.unwrap();
    assert_eq!(dt.version(), 120);
    assert!(last.stepped == Some(120) && last.pairs > 0);
    let cost = dt.predicted_cost().unwrap();
    assert!(cost > 0.0 && cost.is_finite());
    eprintln!("before {before:?}\nafter {after:?}\nslice cost EMA {cost:.6} s");
    // The soft cross-entropy is bounded below by the target's entropy, so it cannot fall
    // by a large factor; the hidden-state term can.
    assert!(after.ce < before.ce - 0.25, "{before:?} → {after:?}");
    assert!(after.hidden < 0.5 * before.hidden, "{before:?} → {after:?}");
    assert!(
        after.agreement > before.agreement + 0.2,
        "{before:?} → {after:?}"
    );
    assert!(
        after.agreement > 4.0 / target().vocab as f64,
        "well above chance"
    );
}

#[test]
fn replicas_exchanging_gradients_stay_identical() {
    let (mut t, buffer) = trainer_with_sink(4);
    run(&mut t, &buffer, 2);
    let mut replicas: Vec<_> = (0..3).map(|r| new_trainer(&t, &buffer, r, 3)).collect();
    let start = replicas[0].weights().unwrap();
    for step in 0..3u64 {
        let mut grads = Vec::new();
        for r in &mut replicas {
            r.slice().unwrap();
            let s = r.slice().unwrap();
            assert_eq!(s.stepped, None, "replicas step only together");
            assert!(r.ready_to_step() == (r.drafter().config().accumulation <= 2));
            grads.push(r.take_grads().unwrap());
        }
        // Different data per replica, so different gradients.
        assert_ne!(grads[0].tensors, grads[1].tensors);
        // Each replica receives them in a different order.
        for (i, r) in replicas.iter_mut().enumerate() {
            let mut g = grads.clone();
            g.rotate_left(i);
            assert_eq!(r.step_with(&g).unwrap(), step + 1);
        }
    }
    // A slice run while the exchange is under way is kept for the next step.
    let posted = replicas[0].take_grads().unwrap();
    assert_eq!(posted.pairs, 0);
    let late = replicas[0].slice().unwrap();
    let others: Vec<DrafterGrads> = replicas[1..]
        .iter_mut()
        .map(|r| r.take_grads().unwrap())
        .collect();
    let mut round = others.clone();
    round.push(posted);
    for r in &mut replicas {
        assert_eq!(r.step_with(&round).unwrap(), 4);
    }
    let kept = replicas[0].take_grads().unwrap();
    assert_eq!((kept.version, kept.pairs), (4, late.pairs));
    assert!(
        kept.tensors
            .iter()
            .any(|t| t.values.iter().any(|&g| g != 0.0))
    );
    let w: Vec<DrafterWeights> = replicas.iter().map(|r| r.weights().unwrap()).collect();
    assert_eq!(w[0].version, 4);
    assert!(
        w.iter().all(|x| *x == w[0]),
        "every replica holds the same weights"
    );
    assert_ne!(w[0].tensors, start.tensors);
    // A missing replica or a stale step is refused, naming the step.
    let g = replicas[0].take_grads().unwrap();
    let err = replicas[0].step_with(std::slice::from_ref(&g)).unwrap_err();
    assert!(err.to_string().contains("drafter step 4"), "{err}");
    let mut stale = vec![g.clone(), g.clone(), g];
    for (i, s) in stale.iter_mut().enumerate() {
        s.replica = i;
    }
    stale[2].version = 2;
    let err = replicas[1].step_with(&stale).unwrap_err();
    assert!(
        err.to_string()
            .contains("replica 2 sent gradients of step 2"),
        "{err}"
    );
    // The owner placement: a replica that loads the owner's weights holds the same.
    let mut other = new_trainer(&t, &buffer, 0, 1);
    other.load_weights(&w[0]).unwrap();
    assert_eq!(other.weights().unwrap(), w[0]);
}

#[test]
fn owner_placement_keeps_workers_identical() {
    let (mut t, buffer) = trainer_with_sink(3);
    run(&mut t, &buffer, 2);
    // Replica 0 owns the optimizer; the others only compute gradients and load weights.
    let mut all: Vec<_> = (0..3).map(|r| new_trainer(&t, &buffer, r, 3)).collect();
    for round in 1..=2u64 {
        let mut grads = Vec::new();
        for r in &mut all {
            r.slice().unwrap();
            grads.push(r.take_grads().unwrap());
        }
        grads.reverse();
        assert_eq!(all[0].step_with(&grads).unwrap(), round);
        let w = all[0].weights().unwrap();
        assert_eq!(w.version, round);
        for r in &mut all[1..] {
            r.load_weights(&w).unwrap();
            assert_eq!((r.version(), r.weights().unwrap()), (round, w.clone()));
        }
    }
}

/// The first `n` pairs of `r` as a proposal context.
fn ctx(r: &DraftRow, n: usize) -> DraftContext<'_> {
    let dm = target().d_model;
    DraftContext {
        hidden: &r.hidden[..n * dm],
        tokens: &r.targets[..n],
    }
}

#[test]
fn proposals_match_the_training_forward_and_batching() {
    let (mut t, buffer) = trainer_with_sink(10);
    run(&mut t, &buffer, 10);
    let mut dt = new_trainer(&t, &buffer, 0, 1);
    for _ in 0..10 {
        dt.slice().unwrap();
    }
    let weights = dt.weights().unwrap();
    let mut d = Drafter::new(&target(), &drafter_config(), be()).unwrap();
    d.load_weights(&weights).unwrap();
    let rows: Vec<DraftRow> = buffer.lock().rows().take(2).cloned().collect();
    let (dm, v) = (target().d_model, target().vocab);
    let n = 9;
    let mut rng = SplitMix64::new(0);
    // The first draft is the training forward's prediction at the last context pair: its
    // q within 1e-5 with the matrices packed in f32, within 1e-3 in half precision (the
    // default: each weight rounded by at most 2^-11 of itself).
    d.set_proposal_precision(Precision::F32);
    let full = d.propose(&[ctx(&rows[0], n)], 3, 0.0, &mut rng).unwrap();
    d.set_proposal_precision(Precision::F16);
    let alone = d.propose(&[ctx(&rows[0], n)], 3, 0.0, &mut rng).unwrap();
    let mut cut = rows[0].clone();
    cut.targets.truncate(n + 1);
    cut.hidden.truncate((n + 1) * dm);
    let batch = d.batch(&[cut], usize::MAX, None).unwrap();
    let (_, z) = d.forward(7, &batch).unwrap();
    d.discard(7);
    let z = be().to_host(&z).unwrap();
    let z = &z[(n - 1) * v..n * v];
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = z.iter().map(|x| (x - max).exp()).sum();
    for (chain, tol) in [(&full, 1e-5), (&alone, 1e-3)] {
        for (&zj, &q) in z.iter().zip(&chain[0].probs[..v]) {
            let diff = ((zj - max).exp() / sum - q).abs();
            assert!(diff < tol, "q differs by {diff} (tolerance {tol})");
        }
        assert_eq!(chain[0].tokens[0] as usize, super::loss::argmax(z).unwrap());
    }
    assert_eq!((alone[0].tokens.len(), alone[0].probs.len()), (3, 3 * v));
    // Batched with sequences of the same and of another length: the same chains.
    let both = d
        .propose(
            &[ctx(&rows[1], n), ctx(&rows[0], n), ctx(&rows[1], 4)],
            3,
            0.0,
            &mut rng,
        )
        .unwrap();
    let second = d.propose(&[ctx(&rows[1], 4)], 3, 0.0, &mut rng).unwrap();
    assert_eq!(both[1].tokens, alone[0].tokens);
    for (a, b) in both[1].probs.iter().zip(&alone[0].probs) {
        assert!((a - b).abs() < 1e-5);
    }
    assert_eq!(both[2].tokens, second[0].tokens);
    // Sampling draws from q; a token outside the vocabulary is refused.
    let sampled = d.propose(&[ctx(&rows[0], n)], 4, 1.0, &mut rng).unwrap();
    assert!(sampled[0].tokens.iter().all(|&x| (x as usize) < v));
    let bad = DraftContext {
        hidden: &rows[0].hidden[..dm],
        tokens: &[99],
    };
    let err = d.propose(&[bad], 1, 0.0, &mut rng).unwrap_err();
    assert!(err.to_string().contains("context 0: token 99"), "{err}");
}

#[test]
fn refresh_follows_the_target_and_no_data_is_an_error() {
    let (mut t, buffer) = trainer_with_sink(3);
    let mut d = Drafter::new(&target(), &drafter_config(), be()).unwrap();
    // Before any refresh the tables equal the target's initial values; the weights carry
    // the trainable tensors only.
    let w = d.weights(0).unwrap();
    assert!(w.tensors.iter().all(|x| x.name.starts_with("drafter.")));
    let tables = d.frozen_tensors().unwrap();
    let head = tables.iter().find(|x| x.name == "head.w").unwrap();
    assert_eq!(head.values, t.model().param_values("head.w").unwrap());
    assert!(d.needs_refresh(0));
    run(&mut t, &buffer, 2);
    let last = t.model().chunks().last().unwrap();
    assert_eq!(
        d.refresh_from_chunk(last, 2).unwrap(),
        2,
        "one chunk holds both"
    );
    assert!(!d.needs_refresh(2) && d.needs_refresh(3));
    let w = d.weights(0).unwrap();
    let tables = d.frozen_tensors().unwrap();
    let head = tables.iter().find(|x| x.name == "head.w").unwrap();
    assert_eq!(head.values, t.model().param_values("head.w").unwrap());
    assert!(d.refresh("blocks.0.attn.wq", &[0.0], 2).is_err());
    // A snapshot lacking a tensor is refused and changes nothing.
    let mut partial = d.weights(5).unwrap();
    let gone = partial.tensors.remove(3).name;
    partial.tensors.push(partial.tensors[0].clone());
    let err = d.load_weights(&partial).unwrap_err();
    assert!(err.to_string().contains(&format!("no `{gone}`")), "{err}");
    assert_eq!(d.weights(0).unwrap(), w);
    let empty = DraftBufferHandle::new(&target(), &drafter_config());
    let mut dt = DrafterTrainer::new(d, empty, 0, 1).unwrap();
    assert!(matches!(dt.slice(), Err(ModelError::NoData)));
    assert!(dt.predicted_cost().is_none());
}

#[test]
fn sized_slices_compute_what_they_announce_and_replicas_stay_identical() {
    let (mut t, buffer) = trainer_with_sink(2);
    run(&mut t, &buffer, 2);
    let mut replicas: Vec<_> = (0..2).map(|r| new_trainer(&t, &buffer, r, 2)).collect();
    // batch_rows 4 windows of at most seq_len − 1 = 31 pairs.
    let full = replicas[0].max_slice_rows();
    assert_eq!(full, 4 * 31);
    let mut last = 0;
    for rows in [1, 2, 5, 30, 31, 40, 62, 100, 124, 1000] {
        let size = replicas[0].slice_size(rows);
        assert!(
            size >= 1 && size <= rows.min(full),
            "{rows} rows asked, {size}"
        );
        assert!(size >= last, "{rows} rows asked: {size}, less than {last}");
        last = size;
        let s = replicas[0].slice_within(rows).unwrap();
        // The target's sequences are seq_len long: the announced size is exact.
        assert_eq!(s.layout_rows, size, "{rows} rows asked");
        assert!(s.pairs <= size);
    }
    assert_eq!(last, full);
    // Replicas whose slices had different sizes apply the same update.
    replicas[1].slice_within(full).unwrap();
    let grads = vec![
        replicas[0].take_grads().unwrap(),
        replicas[1].take_grads().unwrap(),
    ];
    assert_ne!(grads[0].pairs, grads[1].pairs);
    let mut reversed = grads.clone();
    reversed.reverse();
    replicas[0].step_with(&grads).unwrap();
    replicas[1].step_with(&reversed).unwrap();
    let (a, b) = (
        replicas[0].weights().unwrap(),
        replicas[1].weights().unwrap(),
    );
    assert_eq!(a.version, 1);
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert!(
            x.values
                .iter()
                .zip(&y.values)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "`{}` differs between the replicas",
            x.name
        );
    }
}

/// A drafter's slices (the unrolled training-time test included) write every new output
/// whole: on a backend that fills new outputs with NaN they train the same weights bitwise.
#[test]
fn drafter_slices_write_their_new_outputs_whole() {
    let (mut t, buffer) = trainer_with_sink(3);
    run(&mut t, &buffer, 2);
    let make = |be: CpuBackend| {
        let mut d = Drafter::new(&target(), &drafter_config(), be).unwrap();
        d.refresh_from_gpt(t.model(), t.step()).unwrap();
        DrafterTrainer::new(d, buffer.clone(), 0, 1).unwrap()
    };
    let (mut plain, mut poisoned) = (make(be()), make(be().with_poisoned_outputs()));
    assert!(plain.drafter().config().unroll > 1);
    let start = plain.weights().unwrap();
    for _ in 0..4 {
        plain.slice().unwrap();
        poisoned.slice().unwrap();
    }
    let w = plain.weights().unwrap();
    assert!(w.version > start.version, "the slices stepped the drafter");
    assert_eq!(w, poisoned.weights().unwrap());
}
