//! The KV-cache path against the training model: same logits, and rollback is exact.

use super::*;
use crate::model::{Cut, Gpt, GptConfig, Shape};
use crate::tensor::CpuBackend;

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

#[test]
fn prefill_then_decode_equals_full_forward() {
    let mut gpt = model();
    let (prompt, total) = (5, 12);
    let seqs = [ids(total, 0), ids(total, 1)];
    let mut stages = InferStage::stages_of(&gpt, &Cut::Layers(vec![1, 2, 1])).unwrap();
    // Prefill both prompts in one call, then decode one position at a time, except a
    // three-position step in the middle (the verification shape).
    let spans: Vec<Span> = (0..2)
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
    let mut got: Vec<Vec<f32>> = (0..2)
        .map(|s| first[s * prompt * 50..][..prompt * 50].to_vec())
        .collect();
    let mut pos = prompt;
    while pos < total {
        let n = if pos == 7 { 3 } else { 1 };
        let spans: Vec<Span> = (0..2)
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
        for s in 0..2 {
            got[s].extend_from_slice(&l[s * n * 50..][..n * 50]);
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
    let gpt = model();
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
