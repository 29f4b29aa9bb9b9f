//! Whole-model tests: cutting, split vs fused backward, ordering, and training;
//! [`optim`] tests the optimizer, [`llama`] the Llama-family options and tied embeddings,
//! [`uninit`] that every layer writes its new outputs whole.

mod llama;
mod optim;
mod recompute;
mod uninit;

use super::*;
use crate::tensor::{CpuBackend, CpuBuf, IGNORE_TARGET};

fn tiny() -> GptConfig {
    GptConfig {
        vocab: 11,
        d_model: 16,
        heads: 4,
        layers: 4,
        seq_len: 8,
        mlp_ratio: 2,
        seed: 5,
        ..GptConfig::default()
    }
}

/// Two micro-batches of `batch 2 × seq 6` ids and next-token targets.
fn data(cfg: &GptConfig) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..2)
        .map(|mb| {
            let ids: Vec<u32> = (0..12)
                .map(|i| ((i * 7 + mb * 3 + i / 5) % cfg.vocab) as u32)
                .collect();
            let mut targets: Vec<u32> = ids[1..].to_vec();
            targets.push(IGNORE_TARGET);
            (ids, targets)
        })
        .collect()
}

const SHAPE: Shape = Shape { batch: 2, seq: 6 };

/// Loss per micro-batch and every gradient, by name, of `cut`.
fn run(cut: &Cut, threads: usize) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let cfg = tiny();
    let mut gpt = Gpt::new(&cfg, CpuBackend::new(threads).unwrap(), cut).unwrap();
    let losses = data(&cfg)
        .iter()
        .enumerate()
        .map(|(mb, (ids, t))| gpt.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap())
        .collect();
    let grads = gpt.param_names().into_iter().map(|n| {
        let g = gpt.grad_values(&n).unwrap();
        (n, g)
    });
    (losses, grads.collect())
}

#[test]
fn cuts_into_one_to_four_chunks_agree_bitwise() {
    let (loss, grads) = run(&Cut::Even(1), 1);
    assert!(grads.iter().any(|(n, _)| n == "blocks.3.attn.wq"));
    assert_eq!(grads.len(), 2 + 4 * 8 + 2);
    for cut in [
        Cut::Even(2),
        Cut::Even(3),
        Cut::Even(4),
        Cut::Layers(vec![0, 3, 1]),
    ] {
        let (l, g) = run(&cut, 1);
        assert_eq!(l, loss, "{cut:?}: losses");
        assert_eq!(g, grads, "{cut:?}: gradients");
    }
}

#[test]
fn two_threads_match_one_closely() {
    let (loss, grads) = run(&Cut::Even(1), 1);
    let (l2, g2) = run(&Cut::Even(2), 2);
    for (a, b) in loss.iter().zip(&l2) {
        assert!((a - b).abs() < 1e-5);
    }
    for ((n, a), (_, b)) in grads.iter().zip(&g2) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{n}: {x} vs {y}");
        }
    }
}

#[test]
fn init_does_not_depend_on_the_cut() {
    let cfg = tiny();
    let whole = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let chunk = ModelChunk::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(2), 1).unwrap();
    assert_eq!(chunk.blocks(), 2..4);
    for name in chunk.param_names() {
        assert_eq!(
            chunk.param_values(&name).unwrap(),
            whole.param_values(&name).unwrap()
        );
    }
    let other = Gpt::new(
        &GptConfig { seed: 6, ..cfg },
        CpuBackend::new(1).unwrap(),
        &Cut::Even(1),
    );
    let other = other.unwrap();
    assert_ne!(
        other.param_values("head.w").unwrap(),
        whole.param_values("head.w").unwrap()
    );
}

/// Drives the chunks of `Cut::Even(2)` by hand in a zero-bubble-like order (I before W,
/// W of micro-batches interleaved and reversed), and compares with fused B per micro-batch.
#[test]
fn split_input_weight_equals_fused_backward() {
    let cfg = tiny();
    let be = CpuBackend::new(1).unwrap();
    let batches = data(&cfg);
    let mut fused = Gpt::new(&cfg, be.clone(), &Cut::Even(2)).unwrap();
    for (mb, (ids, t)) in batches.iter().enumerate() {
        fused.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap();
    }
    let mut chunks = Gpt::new(&cfg, be.clone(), &Cut::Even(2))
        .unwrap()
        .into_chunks();
    let mut grads_in = Vec::new();
    for (mb, (ids, t)) in batches.iter().enumerate() {
        let ChunkOutput::Hidden(h) = chunks[0]
            .forward(mb, SHAPE, ChunkInput::Tokens(ids), None)
            .unwrap()
        else {
            panic!("first chunk returns activations")
        };
        let out = chunks[1]
            .forward(mb, SHAPE, ChunkInput::Hidden(h), Some(t))
            .unwrap();
        assert!(matches!(out, ChunkOutput::Loss { tokens: 11, .. }));
        let g = chunks[1]
            .backward_input(mb, ChunkGrad::Loss(0.5))
            .unwrap()
            .unwrap();
        // After I, no weight gradient exists yet on this stage.
        assert_eq!(chunks[1].grad_sq_norm().unwrap(), 0.0);
        grads_in.push(g);
    }
    for (mb, g) in grads_in.into_iter().enumerate().rev() {
        assert!(
            chunks[0]
                .backward_input(mb, ChunkGrad::Hidden(g))
                .unwrap()
                .is_none()
        );
    }
    for mb in [1, 0] {
        chunks[1].backward_weight(mb).unwrap();
    }
    for mb in [0, 1] {
        chunks[0].backward_weight(mb).unwrap();
    }
    for (split, whole) in chunks.iter().zip(fused.chunks()) {
        assert_eq!(split.stashed(), 0);
        assert_eq!(split.in_flight(), 0);
        for name in split.param_names() {
            // W of micro-batches 1 and 0 ran in the opposite order on stage 1, so the sums
            // of their contributions may differ in the last bits
            // (relative to the tensor's largest entry).
            let (a, b) = (
                split.grad_values(&name).unwrap(),
                whole.grad_values(&name).unwrap(),
            );
            let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6 * scale, "{name}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let cfg = tiny();
    let be = CpuBackend::new(1).unwrap();
    let mut chunks = Gpt::new(&cfg, be.clone(), &Cut::Even(2))
        .unwrap()
        .into_chunks();
    let (ids, t) = &data(&cfg)[0];
    let h = be.zeros(5, crate::tensor::DType::F32).unwrap();
    let err = chunks[1]
        .forward(0, SHAPE, ChunkInput::Hidden(h), Some(t))
        .unwrap_err();
    assert!(err.to_string().contains("stage 1, micro-batch 0"), "{err}");
    let err = chunks[1]
        .forward(0, SHAPE, ChunkInput::Tokens(ids), Some(t))
        .unwrap_err();
    assert!(err.to_string().contains("without embedding"), "{err}");
    let err = chunks[0].backward_weight(4).unwrap_err();
    assert!(err.to_string().contains("micro-batch 4"), "{err}");
    let long = Shape { batch: 1, seq: 9 };
    assert!(
        chunks[0]
            .forward(0, long, ChunkInput::Tokens(&[0; 9]), None)
            .is_err()
    );
    let bad_ids: Vec<u32> = vec![11; 12];
    assert!(
        chunks[0]
            .forward(0, SHAPE, ChunkInput::Tokens(&bad_ids), None)
            .is_err()
    );
    // A failed forward leaves nothing behind.
    assert_eq!(chunks[0].stashed(), 0);
    assert!(Cut::Even(5).ranges(4).is_err());
    assert!(Cut::Layers(vec![2, 1]).ranges(4).is_err());
    assert_eq!(Cut::Even(3).ranges(8).unwrap(), vec![0..3, 3..6, 6..8]);
    let bad = GptConfig { heads: 3, ..cfg };
    assert!(
        Gpt::new(&bad, be, &Cut::Even(1))
            .unwrap_err()
            .to_string()
            .contains("heads")
    );
}

#[test]
fn logits_and_eval_loss_leave_no_stash() {
    let cfg = tiny();
    let mut gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(2)).unwrap();
    let (ids, t) = &data(&cfg)[0];
    let logits = gpt.logits(SHAPE, ids).unwrap();
    assert_eq!(logits.len(), 12 * cfg.vocab);
    let loss = gpt.loss(SHAPE, ids, t).unwrap();
    // The loss is the mean cross-entropy of those logits over the 11 counted targets.
    let mut want = 0.0f64;
    for (r, &target) in t.iter().enumerate().filter(|(_, t)| **t != IGNORE_TARGET) {
        let row = &logits[r * cfg.vocab..(r + 1) * cfg.vocab];
        let lse = row.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        want += lse - f64::from(row[target as usize]);
    }
    assert!(
        (f64::from(loss) - want / 11.0).abs() < 1e-5,
        "{loss} vs {}",
        want / 11.0
    );
    assert!(
        gpt.chunks()
            .iter()
            .all(|c| c.stashed() == 0 && c.in_flight() == 0)
    );
    // At init the loss is close to ln(vocab).
    assert!((loss - (cfg.vocab as f32).ln()).abs() < 0.1, "{loss}");
}

#[test]
fn training_reduces_the_loss() {
    let cfg = tiny();
    let be = CpuBackend::new(1).unwrap();
    let mut gpt = Gpt::new(&cfg, be, &Cut::Even(2)).unwrap();
    let mut opt = AdamW::new(AdamWConfig::default());
    let sched = LrSchedule {
        peak_lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 5,
        total_steps: 60,
    };
    let batches = data(&cfg);
    let mut first = 0.0;
    let mut last = 0.0;
    for step in 0..60 {
        gpt.zero_grads().unwrap();
        let mut loss = 0.0;
        for (mb, (ids, t)) in batches.iter().enumerate() {
            loss += gpt.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap() / 2.0;
        }
        opt.step_chunks(gpt.chunks_mut(), sched.lr(step)).unwrap();
        if step == 0 {
            first = loss;
        }
        last = loss;
    }
    assert!(last < 0.5 * first, "loss went from {first} to {last}");
    assert_eq!(opt.steps(), 60);
}

#[test]
fn accumulating_micro_batches_equals_one_big_batch() {
    // Two micro-batches of 11 counted targets each, `scale = 1/2`, against one micro-batch
    // holding both (22 targets, scale 1): the mean-over-tokens normalisation makes the
    // accumulated gradients those of the big batch, up to float rounding.
    let cfg = tiny();
    let be = CpuBackend::new(1).unwrap();
    let batches = data(&cfg);
    let mut split = Gpt::new(&cfg, be.clone(), &Cut::Even(2)).unwrap();
    let mut losses = 0.0;
    for (mb, (ids, t)) in batches.iter().enumerate() {
        losses += split.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap() / 2.0;
    }
    let ids: Vec<u32> = batches.iter().flat_map(|(i, _)| i.clone()).collect();
    let t: Vec<u32> = batches.iter().flat_map(|(_, t)| t.clone()).collect();
    let mut whole = Gpt::new(&cfg, be, &Cut::Even(1)).unwrap();
    let big = Shape { batch: 4, seq: 6 };
    let loss = whole.forward_backward(0, big, &ids, &t, 1.0).unwrap();
    assert!((loss - losses).abs() < 1e-6, "{loss} vs {losses}");
    for name in whole.param_names() {
        let (a, b) = (
            split.grad_values(&name).unwrap(),
            whole.grad_values(&name).unwrap(),
        );
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * scale, "{name}: {x} vs {y}");
        }
    }
}

/// Four stages, four micro-batches, and I/W actions picked in a pseudo-random order among
/// those whose dependencies are met (I of stage s needs I of stage s+1; W needs its own I),
/// with F of later micro-batches mixed in: the gradients equal the fused run's.
#[test]
fn any_dependency_respecting_order_gives_the_same_gradients() {
    let cfg = tiny();
    let be = CpuBackend::new(1).unwrap();
    let ids: Vec<u32> = (0..4 * 12).map(|i| (i * 5 % cfg.vocab) as u32).collect();
    let targets: Vec<u32> = ids.iter().map(|&i| (i + 1) % cfg.vocab as u32).collect();
    let mb_ids = |mb: usize| &ids[mb * 12..(mb + 1) * 12];
    let mb_targets = |mb: usize| &targets[mb * 12..(mb + 1) * 12];
    let mut fused = Gpt::new(&cfg, be.clone(), &Cut::Even(4)).unwrap();
    for mb in 0..4 {
        fused
            .forward_backward(mb, SHAPE, mb_ids(mb), mb_targets(mb), 0.25)
            .unwrap();
    }
    let mut chunks = Gpt::new(&cfg, be, &Cut::Even(4)).unwrap().into_chunks();
    // pending[s][mb]: the activation or gradient waiting to enter stage s (F) or leave it (I).
    let mut acts: Vec<Vec<Option<CpuBuf>>> =
        (0..4).map(|_| (0..4).map(|_| None).collect()).collect();
    let mut grads: Vec<Vec<Option<CpuBuf>>> =
        (0..4).map(|_| (0..4).map(|_| None).collect()).collect();
    let (mut f_done, mut i_done, mut w_done) = ([[false; 4]; 4], [[false; 4]; 4], [[false; 4]; 4]);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    loop {
        // Every action whose inputs are ready: (kind, stage, mb).
        let mut ready = Vec::new();
        for s in 0..4 {
            for mb in 0..4 {
                if !f_done[s][mb] && (s == 0 || f_done[s - 1][mb]) {
                    ready.push((0, s, mb));
                }
                if f_done[s][mb] && !i_done[s][mb] && (s == 3 || i_done[s + 1][mb]) {
                    ready.push((1, s, mb));
                }
                if i_done[s][mb] && !w_done[s][mb] {
                    ready.push((2, s, mb));
                }
            }
        }
        if ready.is_empty() {
            break;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let (kind, s, mb) = ready[(rng % ready.len() as u64) as usize];
        match kind {
            0 => {
                let input = match acts[s][mb].take() {
                    Some(h) => ChunkInput::Hidden(h),
                    None => ChunkInput::Tokens(mb_ids(mb)),
                };
                let t = (s == 3).then(|| mb_targets(mb));
                if let ChunkOutput::Hidden(h) = chunks[s].forward(mb, SHAPE, input, t).unwrap() {
                    acts[s + 1][mb] = Some(h);
                }
                f_done[s][mb] = true;
            }
            1 => {
                let g = match grads[s][mb].take() {
                    Some(g) => ChunkGrad::Hidden(g),
                    None => ChunkGrad::Loss(0.25),
                };
                if let Some(dx) = chunks[s].backward_input(mb, g).unwrap() {
                    grads[s - 1][mb] = Some(dx);
                }
                i_done[s][mb] = true;
            }
            _ => {
                chunks[s].backward_weight(mb).unwrap();
                w_done[s][mb] = true;
            }
        }
    }
    for (split, whole) in chunks.iter().zip(fused.chunks()) {
        assert_eq!(split.stashed(), 0);
        for name in split.param_names() {
            let (a, b) = (
                split.grad_values(&name).unwrap(),
                whole.grad_values(&name).unwrap(),
            );
            let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6 * scale, "{name}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn chunks_and_optimizer_move_between_threads() {
    fn send<T: Send>() {}
    send::<ModelChunk<CpuBackend>>();
    send::<AdamW<CpuBackend>>();
    send::<Gpt<CpuBackend>>();
}

/// Timing of the default model (not a correctness test): F, I, W per micro-batch of
/// 4 × 64 tokens and a whole step of 4 micro-batches, on 1 and 2 threads.
/// `cargo test --release -p pipefill --lib default_model_timing -- --ignored --nocapture`
#[test]
#[ignore]
fn default_model_timing() {
    use std::time::Instant;
    let cfg = GptConfig::default();
    let shape = Shape {
        batch: 4,
        seq: cfg.seq_len,
    };
    let ids: Vec<u32> = (0..shape.tokens())
        .map(|i| (i * 13 % cfg.vocab) as u32)
        .collect();
    for threads in [1, 2] {
        let be = CpuBackend::new(threads).unwrap();
        let mut chunk = ModelChunk::new(&cfg, be.clone(), &Cut::Even(1), 0).unwrap();
        let mut opt = AdamW::new(AdamWConfig::default());
        let (mut f, mut i, mut w, mut step) = (0.0, 0.0, 0.0, 0.0);
        let reps = 10;
        for rep in 0..reps + 2 {
            let t0 = Instant::now();
            chunk.zero_grads().unwrap();
            let (mut tf, mut ti, mut tw) = (0.0, 0.0, 0.0);
            for mb in 0..4 {
                let t = Instant::now();
                chunk
                    .forward(mb, shape, ChunkInput::Tokens(&ids), Some(&ids))
                    .unwrap();
                tf += t.elapsed().as_secs_f64();
                let t = Instant::now();
                chunk.backward_input(mb, ChunkGrad::Loss(0.25)).unwrap();
                ti += t.elapsed().as_secs_f64();
                let t = Instant::now();
                chunk.backward_weight(mb).unwrap();
                tw += t.elapsed().as_secs_f64();
            }
            opt.step_chunks(std::slice::from_mut(&mut chunk), 1e-3)
                .unwrap();
            if rep >= 2 {
                (f, i, w) = (f + tf / 4.0, i + ti / 4.0, w + tw / 4.0);
                step += t0.elapsed().as_secs_f64();
            }
        }
        let ms = |x: f64| 1e3 * x / reps as f64;
        println!(
            "threads {threads}: per micro-batch F {:.2} ms, I {:.2} ms, W {:.2} ms; step {:.1} ms ({:.0} tokens/s)",
            ms(f),
            ms(i),
            ms(w),
            ms(step),
            4.0 * shape.tokens() as f64 * reps as f64 / step
        );
    }
}
