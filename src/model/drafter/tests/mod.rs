//! Tests of the drafter: finite-difference gradient checks of its new pieces (fc, the
//! soft cross-entropy, SmoothL1, the whole drafter), the buffer and the config here;
//! training, replicas, capture and proposals in [`train`]; the packed proposal path in
//! [`propose`]; the unrolled training-time test in [`unroll`]; the reduced draft
//! vocabulary in [`vocab`]; a tied target's one frozen table in [`tied`].
//!
//! Gradient checks follow `model/layers/tests.rs`: central differences with `h = 1e-2`,
//! the objective summed in `f64`, parameters drawn at scale 0.5, and a relative error
//! `‖g − g_fd‖ / max(‖g‖, ‖g_fd‖) < 1e-2` per tensor.

/// Its random drafter and contexts also serve the tree proposal's tests.
pub(super) mod propose;
mod tied;
mod train;
mod unroll;
mod vocab;

use super::loss::{smooth_l1, soft_cross_entropy};
use super::*;
use crate::data::SplitMix64;
use crate::model::GptConfig;
use crate::model::init::normal;
use crate::tensor::{Backend, CpuBackend, DType, IGNORE_TARGET};

const H: f32 = 1e-2;
const TOL: f64 = 1e-2;

fn be() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

fn tiny() -> GptConfig {
    GptConfig {
        vocab: 7,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 5,
        mlp_ratio: 2,
        seed: 3,
        ..GptConfig::default()
    }
}

/// Central differences of `f` at `x0`.
fn numeric(x0: &[f32], mut f: impl FnMut(&[f32]) -> f64) -> Vec<f64> {
    let mut x = x0.to_vec();
    (0..x.len())
        .map(|i| {
            x[i] = x0[i] + H;
            let up = f(&x);
            x[i] = x0[i] - H;
            let down = f(&x);
            x[i] = x0[i];
            (up - down) / (2.0 * f64::from(H))
        })
        .collect()
}

fn assert_grad(what: &str, analytic: &[f32], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len(), "{what}");
    let diff: f64 = analytic
        .iter()
        .zip(numeric)
        .map(|(&a, n)| (f64::from(a) - n).powi(2))
        .sum();
    let na: f64 = analytic.iter().map(|&a| f64::from(a).powi(2)).sum();
    let nn: f64 = numeric.iter().map(|n| n * n).sum();
    let rel = diff.sqrt() / na.sqrt().max(nn.sqrt()).max(1e-12);
    assert!(nn > 1e-6, "{what}: numerical gradient vanishes");
    assert!(rel < TOL, "{what}: relative error {rel:e}");
}

/// A probability distribution per row (rows of `vocab`), deterministic from `name`.
fn distributions(name: &str, rows: usize, vocab: usize) -> Vec<f32> {
    let mut p: Vec<f32> = normal(11, name, rows * vocab, 1.0)
        .iter()
        .map(|x| x.exp())
        .collect();
    for r in p.chunks_mut(vocab) {
        let s: f32 = r.iter().sum();
        r.iter_mut().for_each(|x| *x /= s);
    }
    p
}

#[test]
fn fc_input_and_weight_gradients() {
    let be = be();
    let (rows, din, dout) = (5, 6, 4);
    let mut fc = Linear::new(&be, "fc", din, dout, 1).unwrap();
    fc.w.value = be
        .from_host(&normal(99, "w", din * dout, 0.5), DType::F32)
        .unwrap();
    let x0 = normal(98, "x", rows * din, 1.0);
    let dy = normal(97, "dy", rows * dout, 1.0);
    let objective = |fc: &mut Linear<CpuBackend>, x: &[f32]| {
        let x = be.from_host(x, DType::F32).unwrap();
        let y = fc.forward(&be, 1, &x, rows).unwrap();
        fc.discard(1);
        let y = be.to_host(&y).unwrap();
        y.iter()
            .zip(&dy)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum::<f64>()
    };
    let x = be.from_host(&x0, DType::F32).unwrap();
    fc.forward(&be, 0, &x, rows).unwrap();
    let dyb = be.from_host(&dy, DType::F32).unwrap();
    let dx = fc.backward_input(&be, 0, &dyb, true).unwrap().unwrap();
    fc.backward_weight(&be, 0).unwrap();
    assert_eq!(fc.stashed(), 0);
    let num = numeric(&x0, |x| objective(&mut fc, x));
    assert_grad("fc dx", &be.to_host(&dx).unwrap(), &num);
    let w0 = be.to_host(&fc.w.value).unwrap();
    let analytic = be.to_host(&fc.w.grad).unwrap();
    let num = numeric(&w0, |w| {
        fc.w.value = be.from_host(w, DType::F32).unwrap();
        objective(&mut fc, &x0)
    });
    assert_grad("fc.w", &analytic, &num);
    // Without dx, I still keeps what W needs.
    fc.forward(&be, 2, &x, rows).unwrap();
    assert!(fc.backward_input(&be, 2, &dyb, false).unwrap().is_none());
    fc.backward_weight(&be, 2).unwrap();
}

#[test]
fn soft_cross_entropy_gradient_and_mask() {
    let (rows, vocab, weight) = (4, 5, 0.7f32);
    let z0 = normal(5, "z", rows * vocab, 1.5);
    // Rows that do not sum to 1 check the general formula `q·Σp − p`.
    let mut p = distributions("p", rows, vocab);
    p[..vocab].iter_mut().for_each(|x| *x *= 1.3);
    let mask = [true, true, false, true];
    let mut dz = vec![9.0; rows * vocab];
    soft_cross_entropy(&z0, &p, &mask, vocab, weight, &mut dz);
    assert!(dz[2 * vocab..3 * vocab].iter().all(|&g| g == 0.0));
    let mut scratch = vec![0.0; rows * vocab];
    let num = numeric(&z0, |z| {
        f64::from(weight) * soft_cross_entropy(z, &p, &mask, vocab, weight, &mut scratch)
    });
    assert_grad("soft cross-entropy", &dz, &num);
    // Against a one-hot target it is the ordinary cross-entropy.
    let one_hot: Vec<f32> = (0..vocab).map(|v| f32::from(v == 2)).collect();
    let mut g = vec![0.0; vocab];
    let ce = soft_cross_entropy(&z0[..vocab], &one_hot, &[true], vocab, 1.0, &mut g);
    let lse = z0[..vocab]
        .iter()
        .map(|x| f64::from(*x).exp())
        .sum::<f64>()
        .ln();
    assert!((ce - (lse - f64::from(z0[2]))).abs() < 1e-5);
}

#[test]
fn smooth_l1_gradient_in_both_regimes() {
    let (rows, dim, beta, weight) = (3, 6, 0.5f32, 1.7f32);
    let target = normal(6, "t", rows * dim, 1.0);
    let mut pred: Vec<f32> = normal(7, "p", rows * dim, 1.0)
        .iter()
        .zip(&target)
        .map(|(&n, &t)| t + n)
        .collect();
    // Keep every difference away from the kink at |x| = β, where the derivative jumps.
    for (p, &t) in pred.iter_mut().zip(&target) {
        if ((*p - t).abs() - beta).abs() < 0.05 {
            *p += 0.2;
        }
    }
    let linear = pred.iter().zip(&target).any(|(p, t)| (p - t).abs() > beta);
    let quadratic = pred.iter().zip(&target).any(|(p, t)| (p - t).abs() < beta);
    assert!(linear && quadratic, "both regimes are exercised");
    let mask = [true, false, true];
    let mut dp = vec![9.0; rows * dim];
    let loss = smooth_l1(&pred, &target, &mask, dim, beta, weight, &mut dp);
    assert!(dp[dim..2 * dim].iter().all(|&g| g == 0.0));
    assert!(loss > 0.0);
    let mut scratch = vec![0.0; rows * dim];
    let num = numeric(&pred, |p| {
        f64::from(weight) * smooth_l1(p, &target, &mask, dim, beta, weight, &mut scratch)
    });
    assert_grad("smooth l1", &dp, &num);
}

/// Rows of `len` positions with random hidden states and tokens.
fn random_rows(cfg: &GptConfig, n: usize, len: usize, seed: u64) -> Vec<DraftRow> {
    (0..n)
        .map(|i| {
            let name = format!("row{seed}.{i}");
            let mut targets: Vec<u32> = normal(seed, &name, len, 1.0)
                .iter()
                .map(|x| (x.abs() * 100.0) as u32 % cfg.vocab as u32)
                .collect();
            targets[len / 2] = IGNORE_TARGET;
            DraftRow {
                hidden: normal(seed + 1, &name, len * cfg.d_model, 1.0),
                targets,
                step: 0,
            }
        })
        .collect()
}

#[test]
fn drafter_weight_gradients_end_to_end() {
    let be = be();
    let cfg = tiny();
    // β large: the SmoothL1 term stays quadratic, away from its kink (checked above).
    let dc = DrafterConfig {
        ce_weight: 0.8,
        hidden_weight: 1.3,
        advanced: DrafterTuning {
            smooth_l1_beta: 10.0,
            ..DrafterTuning::default()
        },
        ..DrafterConfig::default()
    };
    let mut drafter = Drafter::new(&cfg, &dc, be.clone()).unwrap();
    for p in drafter.params_mut() {
        let mut v = normal(99, &p.name, p.numel(), 0.5);
        if p.name.contains("norm") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        p.value = be.from_host(&v, DType::F32).unwrap();
    }
    let rows = random_rows(&cfg, 2, 5, 1);
    let batch = drafter.batch(&rows, 16, None).unwrap();
    assert_eq!((batch.batch, batch.seq), (2, 4));
    assert_eq!(
        batch.pairs(),
        6,
        "4 pairs per row, one with an ignored token each"
    );
    let objective = |d: &mut Drafter<CpuBackend>| {
        let (f, z) = d.forward(1, &batch).unwrap();
        d.discard(1);
        let (s, _) = d.loss_grad(&batch, &f, &z).unwrap();
        0.8 * s.ce + 1.3 * s.hidden
    };
    let (f, z) = drafter.forward(0, &batch).unwrap();
    let (_, dfeat) = drafter.loss_grad(&batch, &f, &z).unwrap();
    drafter.backward_input(0, &dfeat).unwrap();
    drafter.backward_weight(0).unwrap();
    assert_eq!(drafter.stashed(), 0);
    let names: Vec<String> = drafter.params().iter().map(|p| p.name.clone()).collect();
    assert_eq!(names[0], "drafter.fc.w");
    assert!(names.iter().any(|n| n == "drafter.block.attn.wq"));
    for name in names {
        let i = drafter
            .params()
            .iter()
            .position(|p| p.name == name)
            .unwrap();
        let (x0, analytic) = {
            let p = &drafter.params()[i];
            (be.to_host(&p.value).unwrap(), be.to_host(&p.grad).unwrap())
        };
        let num = numeric(&x0, |x| {
            drafter.params_mut()[i].value = be.from_host(x, DType::F32).unwrap();
            objective(&mut drafter)
        });
        drafter.params_mut()[i].value = be.from_host(&x0, DType::F32).unwrap();
        assert_grad(&name, &analytic, &num);
    }
}

fn row(step_marker: f32, len: usize, cfg: &GptConfig) -> DraftRow {
    DraftRow {
        hidden: vec![step_marker; len * cfg.d_model],
        targets: vec![1; len],
        step: 0,
    }
}

#[test]
fn buffer_keeps_current_and_previous_step_bounded() {
    let cfg = tiny();
    let mut b = DraftBuffer::new(cfg.d_model, cfg.vocab, 3);
    b.begin_step(0);
    for i in 0..5 {
        b.push(row(i as f32, 4, &cfg)).unwrap();
    }
    assert_eq!((b.current_len(), b.previous_len(), b.dropped()), (3, 0, 2));
    // The oldest rows went first.
    let firsts: Vec<f32> = b.rows().map(|r| r.hidden[0]).collect();
    assert_eq!(firsts, [2.0, 3.0, 4.0]);
    // A row without a training pair (one position, or only ignored tokens) is not kept.
    b.push(row(9.0, 1, &cfg)).unwrap();
    let mut ignored = row(9.0, 3, &cfg);
    ignored.targets.fill(IGNORE_TARGET);
    b.push(ignored).unwrap();
    assert_eq!(b.len(), 3);
    b.begin_step(1);
    b.push(row(10.0, 4, &cfg)).unwrap();
    b.begin_step(1);
    assert_eq!((b.current_len(), b.previous_len()), (1, 3));
    // Sampling reaches both generations.
    let mut rng = SplitMix64::new(1);
    let steps: std::collections::BTreeSet<u64> =
        b.sample(&mut rng, 64).iter().map(|r| r.step).collect();
    assert_eq!(steps.into_iter().collect::<Vec<_>>(), [0, 1]);
    // Step 2: step 0's rows are gone, step 1's stay as the previous generation.
    b.begin_step(2);
    assert_eq!((b.current_len(), b.previous_len()), (0, 1));
    assert!(b.rows().all(|r| r.step == 1));
}

#[test]
fn buffer_splits_micro_batches_and_rejects_bad_lengths() {
    let cfg = tiny();
    let (d, v) = (cfg.d_model, cfg.vocab);
    let h = DraftBufferHandle::from_buffer(DraftBuffer::new(d, v, 8));
    let shape = crate::model::Shape { batch: 2, seq: 3 };
    let hidden: Vec<f32> = (0..6 * d).map(|i| i as f32).collect();
    h.push_micro_batch(shape, &hidden, &[1, 2, 3, 4, 5, 6])
        .unwrap();
    let rows: Vec<DraftRow> = h.lock().rows().cloned().collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].targets, [4, 5, 6]);
    assert_eq!(rows[1].hidden, hidden[3 * d..]);
    let err = h
        .push_micro_batch(shape, &hidden[1..], &[1; 6])
        .unwrap_err();
    assert!(err.to_string().contains("micro-batch"), "{err}");
    let mut bad = row(0.0, 3, &cfg);
    bad.targets[1] = 99;
    let err = h.lock().push(bad).unwrap_err();
    assert!(err.to_string().contains("target 99 at position 1"), "{err}");
}

#[test]
fn config_defaults_validate_and_errors_name_the_field() {
    DrafterConfig::default().validate().unwrap();
    let parsed: DrafterConfig = toml::from_str("batch_rows = 8\nlr = 0.01").unwrap();
    assert_eq!((parsed.batch_rows, parsed.lr), (8, 0.01));
    let err = toml::from_str::<DrafterConfig>("batch_row = 8").unwrap_err();
    assert!(err.to_string().contains("batch_row"), "{err}");
    let zero = DrafterConfig {
        batch_rows: 0,
        ..DrafterConfig::default()
    };
    let err = zero.validate().unwrap_err().to_string();
    assert!(err.contains("drafter.batch_rows"), "{err}");
    let beta = DrafterConfig {
        advanced: DrafterTuning {
            smooth_l1_beta: 0.0,
            ..DrafterTuning::default()
        },
        ..DrafterConfig::default()
    };
    assert!(
        beta.validate()
            .unwrap_err()
            .to_string()
            .contains("smooth_l1_beta")
    );
    let err = Drafter::new(&tiny(), &zero, be()).err().unwrap();
    assert!(err.to_string().contains("drafter.batch_rows"), "{err}");
}
