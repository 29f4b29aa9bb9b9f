//! The fused, chunked head against the unfused composition it replaces (full logits, then
//! `cross_entropy_fwd`/`_bwd` and the three products on the whole micro-batch), at a
//! vocabulary large enough for [`chunk_rows`] to split the micro-batch into several chunks
//! (the last one shorter): same loss, `dx` and `dW` up to `f32` round-off; a mean
//! cross-entropy written as a [`TokenLoss`] gives the same through the hooked path; an
//! evaluation forward gives the same loss and keeps nothing.

use std::sync::Arc;

use super::head::chunk_rows;
use super::{Head, TokenLoss};
use crate::model::GptConfig;
use crate::model::init::normal;
use crate::tensor::{Backend, CpuBackend, DType, Gemm, IGNORE_TARGET};

const D: usize = 8;
const VOCAB: usize = 1 << 16;
const ROWS: usize = 40;
const SCALE: f32 = 0.7;

/// Mean cross-entropy as a hook: `−mean logp`, each `d/d logp = −1/n`.
#[derive(Debug)]
struct MeanCe;

impl TokenLoss for MeanCe {
    fn loss(&self, _mb: usize, logp: &[f32]) -> Result<(f32, Vec<f32>), String> {
        let n = logp.len() as f64;
        let loss = -logp.iter().map(|&l| f64::from(l)).sum::<f64>() / n;
        Ok((loss as f32, vec![(-1.0 / n) as f32; logp.len()]))
    }
}

fn setup() -> (CpuBackend, Head<CpuBackend>, Vec<f32>, Vec<u32>) {
    let be = CpuBackend::new(2).unwrap();
    let cfg = GptConfig {
        vocab: VOCAB,
        d_model: D,
        ..GptConfig::default()
    };
    let mut head = Head::new(&be, "head", &cfg).unwrap();
    let w = normal(5, "w", D * VOCAB, 0.5);
    head.w.value = be.from_host(&w, DType::F32).unwrap();
    let x = normal(6, "x", ROWS * D, 1.0);
    let targets = (0..ROWS as u32)
        .map(|r| match r % 9 {
            4 => IGNORE_TARGET,
            _ => (r * 7919 + 13) % VOCAB as u32,
        })
        .collect();
    (be, head, x, targets)
}

/// A loss, `dx` and `dW`.
type Grads = (f32, Vec<f32>, Vec<f32>);

/// The unfused loss, `dx` and `dW` for `SCALE`.
fn unfused(be: &CpuBackend, head: &Head<CpuBackend>, x: &[f32], t: &[u32]) -> Grads {
    let xb = be.from_host(x, DType::F32).unwrap();
    let n = ROWS * VOCAB;
    let mut logits = be.zeros(n, DType::F32).unwrap();
    be.matmul(
        &xb,
        &head.w.value,
        &mut logits,
        Gemm::nn(ROWS, D, VOCAB).trans_b(),
    )
    .unwrap();
    let mut probs = be.zeros(n, DType::F32).unwrap();
    let (sum, count) = be.cross_entropy_fwd(&logits, t, &mut probs, VOCAB).unwrap();
    be.cross_entropy_bwd(&probs, t, &mut logits, VOCAB, SCALE / count as f32)
        .unwrap();
    let mut dx = be.zeros(ROWS * D, DType::F32).unwrap();
    be.matmul(&logits, &head.w.value, &mut dx, Gemm::nn(ROWS, VOCAB, D))
        .unwrap();
    let mut dw = be.zeros(D * VOCAB, DType::F32).unwrap();
    be.matmul(&logits, &xb, &mut dw, Gemm::nn(VOCAB, ROWS, D).trans_a())
        .unwrap();
    (
        sum / count as f32,
        be.to_host(&dx).unwrap(),
        be.to_host(&dw).unwrap(),
    )
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let norm = want
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum::<f64>()
        .sqrt();
    let err = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| f64::from(a - b).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(norm > 0.0, "{what}: a zero reference proves nothing");
    assert!(err / norm < 1e-5, "{what}: relative error {}", err / norm);
}

/// The fused head's loss, `dx` and `dW` for `SCALE`, with or without the mean-CE hook.
fn fused(hooked: bool) -> (Grads, Grads) {
    let (be, mut head, x, t) = setup();
    assert!(chunk_rows(D, VOCAB) < ROWS && !ROWS.is_multiple_of(chunk_rows(D, VOCAB)));
    if hooked {
        head.set_token_loss(Some(Arc::new(MeanCe)));
    }
    let want = unfused(&be, &head, &x, &t);
    let xb = be.from_host(&x, DType::F32).unwrap();
    let (loss, count) = head.forward(&be, 0, &xb, &t, true).unwrap();
    assert_eq!(count, t.iter().filter(|&&t| t != IGNORE_TARGET).count());
    let dx = head.backward_input(&be, 0, SCALE).unwrap();
    assert_eq!(be.sum_squares(&head.w.grad).unwrap(), 0.0, "I touched dW");
    head.backward_weight(&be, 0).unwrap();
    assert_eq!(head.stashed(), 0);
    let got = (
        loss,
        be.to_host(&dx).unwrap(),
        be.to_host(&head.w.grad).unwrap(),
    );
    (got, want)
}

#[test]
fn chunked_head_matches_the_unfused_loss_and_gradients() {
    let ((loss, dx, dw), (want_loss, want_dx, want_dw)) = fused(false);
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "{loss} vs {want_loss}"
    );
    close("dx", &dx, &want_dx);
    close("dW", &dw, &want_dw);
}

#[test]
fn chunked_head_under_a_token_loss_matches_the_unfused_gradients() {
    let ((loss, dx, dw), (want_loss, want_dx, want_dw)) = fused(true);
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "{loss} vs {want_loss}"
    );
    close("dx", &dx, &want_dx);
    close("dW", &dw, &want_dw);
}

#[test]
fn a_reused_weight_gradient_buffer_starts_afresh() {
    let (be, mut head, x, t) = setup();
    let xb = be.from_host(&x, DType::F32).unwrap();
    let mut grads = Vec::new();
    for mb in 0..2 {
        be.fill(&mut head.w.grad, 0.0).unwrap();
        head.forward(&be, mb, &xb, &t, true).unwrap();
        head.backward_input(&be, mb, SCALE).unwrap();
        head.backward_weight(&be, mb).unwrap();
        grads.push(be.to_host(&head.w.grad).unwrap());
    }
    assert_eq!(grads[0], grads[1]);
}

#[test]
fn evaluation_forward_gives_the_loss_and_keeps_nothing() {
    let (be, mut head, x, t) = setup();
    let xb = be.from_host(&x, DType::F32).unwrap();
    let (trained, _) = head.forward(&be, 0, &xb, &t, true).unwrap();
    let (evaluated, _) = head.forward(&be, 1, &xb, &t, false).unwrap();
    assert_eq!(trained.to_bits(), evaluated.to_bits());
    assert_eq!(
        head.stashed(),
        1,
        "only the training forward keeps its gradients"
    );
    assert!(head.backward_input(&be, 1, 1.0).is_err());
}

#[test]
fn chunk_rows_bound_the_chunk_by_the_weight_or_a_small_vocabulary() {
    // 135M-class Llama, Qwen2.5-0.5B: d_model; a chunk's logits are the weight's size.
    assert_eq!(chunk_rows(576, 49_152), 576);
    assert_eq!(chunk_rows(896, 151_936), 896);
    // A toy vocabulary: one chunk of 2^20 logits holds any realistic micro-batch.
    assert!(chunk_rows(64, 50) >= 20_000);
    assert_eq!(chunk_rows(1, 1 << 30) % 16, 0);
    assert!(chunk_rows(1, 1 << 30) >= 1);
}
