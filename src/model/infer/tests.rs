//! The KV-cache path against the training model: same logits, and rollback is exact; for
//! the default GPT and for a Llama-shaped one (rope with Llama 3 scaling, SwiGLU,
//! grouped-query attention, q/k/v biases).

use super::*;
use crate::model::config::{Positions, RopeScaling};
use crate::model::infer::rowmul::ROWMUL_MAX_ROWS;
use crate::model::{Cut, Gpt, GptConfig, Shape, init};
use crate::tensor::{Activation, CpuBackend};

fn model() -> Gpt<CpuBackend> {
    let config = GptConfig {
        layers: 4,
        seq_len: 24,
        seed: 3,
        ..GptConfig::default()
    };
    Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + salt * 13 + 3) % 50)
        .collect()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "{what}: max |Δ| = {worst}");
}

/// A Llama-shaped model: rotary positions with Llama 3's scaling, SwiGLU of width
/// `intermediate`, 4 query heads sharing 2 key/value heads, q/k/v biases. The biases are
/// set to random values (they are initialised to zero) so that they matter.
pub(super) fn llama_config() -> GptConfig {
    GptConfig {
        layers: 4,
        seq_len: 48,
        seed: 3,
        d_model: 32,
        heads: 4,
        kv_heads: Some(2),
        intermediate: Some(48),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
        qkv_bias: true,
        ..GptConfig::default()
    }
}

pub(super) fn llama_model() -> Gpt<CpuBackend> {
    let config = llama_config();
    let mut gpt = Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let names: Vec<(String, usize)> = gpt
        .params()
        .iter()
        .filter(|p| [".bq", ".bk", ".bv"].iter().any(|b| p.name.ends_with(b)))
        .map(|p| (p.name.clone(), p.numel()))
        .collect();
    assert_eq!(
        names.len(),
        3 * config.layers,
        "every block has q/k/v biases"
    );
    for (name, n) in names {
        gpt.set_param(&name, &init::normal(11, &name, n, 0.5))
            .unwrap();
    }
    gpt
}

#[test]
fn prefill_then_decode_equals_full_forward() {
    prefill_then_decode(model(), 2, (5, 12), 7);
}

/// Prefill of 4 × 33 rows (more than the host path takes: the backend's GEMM), then decode
/// and a 3-position step on the host path, against the training forward: every logit
/// within 1e-5, as for the default GPT.
#[test]
fn llama_prefill_then_decode_equals_full_forward() {
    const {
        assert!(
            4 * 33 > ROWMUL_MAX_ROWS,
            "the prefill takes the backend's GEMM"
        )
    };
    prefill_then_decode(llama_model(), 4, (33, 48), 40);
    prefill_then_decode(llama_model(), 2, (5, 12), 7);
}

/// `seq_count` sequences: a prefill of `prompt` positions each, then decode up to `total`,
/// with a three-position step at `three`.
fn prefill_then_decode(
    mut gpt: Gpt<CpuBackend>,
    seq_count: usize,
    (prompt, total): (usize, usize),
    three: usize,
) {
    let vocab = gpt.config().vocab;
    let seqs: Vec<Vec<u32>> = (0..seq_count).map(|s| ids(total, s as u32)).collect();
    let mut stages = InferStage::stages_of(&gpt, &Cut::Layers(vec![1, 2, 1])).unwrap();
    // Prefill every prompt in one call, then decode one position at a time, except a
    // three-position step in the middle (the verification shape).
    let spans: Vec<Span> = (0..seq_count)
        .map(|s| Span {
            slot: s,
            start: 0,
            len: prompt,
        })
        .collect();
    let flat: Vec<u32> = seqs
        .iter()
        .flat_map(|s| s[..prompt].iter().copied())
        .collect();
    let (first, _) = run_stages(&mut stages, &spans, &flat).unwrap();
    let mut got: Vec<Vec<f32>> = (0..seq_count)
        .map(|s| first[s * prompt * vocab..][..prompt * vocab].to_vec())
        .collect();
    let mut pos = prompt;
    while pos < total {
        let n = if pos == three { 3 } else { 1 };
        let spans: Vec<Span> = (0..seq_count)
            .map(|s| Span {
                slot: s,
                start: pos,
                len: n,
            })
            .collect();
        let flat: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s[pos..pos + n].iter().copied())
            .collect();
        let (l, _) = run_stages(&mut stages, &spans, &flat).unwrap();
        for s in 0..seq_count {
            got[s].extend_from_slice(&l[s * n * vocab..][..n * vocab]);
        }
        pos += n;
    }
    for (s, seq) in seqs.iter().enumerate() {
        let want = gpt
            .logits(
                Shape {
                    batch: 1,
                    seq: total,
                },
                seq,
            )
            .unwrap();
        assert_close(&got[s], &want, &format!("sequence {s}"));
    }
}

#[test]
fn rollback_then_redecode_equals_no_rollback() {
    rollback_then_redecode(model());
    rollback_then_redecode(llama_model());
}

fn rollback_then_redecode(gpt: Gpt<CpuBackend>) {
    let seq = ids(10, 2);
    let mut a = InferStage::stages_of(&gpt, &Cut::Even(2)).unwrap();
    let mut b = InferStage::stages_of(&gpt, &Cut::Even(2)).unwrap();
    let span = |start, len| {
        [Span {
            slot: 0,
            start,
            len,
        }]
    };
    run_stages(&mut a, &span(0, 6), &seq[..6]).unwrap();
    let (want, want_h) = run_stages(&mut a, &span(6, 4), &seq[6..]).unwrap();
    // b sees four wrong draft positions after the prefix, rolls them back, re-decodes.
    run_stages(&mut b, &span(0, 6), &seq[..6]).unwrap();
    run_stages(&mut b, &span(6, 4), &[9, 9, 9, 9]).unwrap();
    assert_eq!(b[0].cache().len(0), 10);
    let (got, got_h) = run_stages(&mut b, &span(6, 4), &seq[6..]).unwrap();
    assert_eq!(got, want, "logits after rollback");
    assert_eq!(got_h, want_h, "hidden states after rollback");
}

#[test]
fn bad_spans_are_errors_and_leave_the_cache_alone() {
    let gpt = model();
    let mut stages = InferStage::stages_of(&gpt, &Cut::Even(1)).unwrap();
    run_stages(
        &mut stages,
        &[Span {
            slot: 0,
            start: 0,
            len: 3,
        }],
        &[1, 2, 3],
    )
    .unwrap();
    let gap = run_stages(
        &mut stages,
        &[Span {
            slot: 0,
            start: 5,
            len: 1,
        }],
        &[4],
    );
    assert!(gap.unwrap_err().to_string().contains("resumes at 5"));
    let long = run_stages(
        &mut stages,
        &[Span {
            slot: 0,
            start: 3,
            len: 30,
        }],
        &[4; 30],
    );
    assert!(long.is_err(), "beyond the learned positions");
    assert_eq!(stages[0].cache().len(0), 3);
}
