//! The two ops of the fused LM head: `cross_entropy_grad` (the loss and the logits'
//! gradient in place, in one pass) against `cross_entropy_fwd` then `_bwd`, serial and on a
//! pool; and `copy_range` (a range of rows) with its refusals.

use super::*;

#[test]
fn cross_entropy_grad_is_the_forward_then_the_backward_in_place() {
    let (rows, vocab) = (6, 9000);
    let logits: Vec<f32> = rand_vec(31, rows * vocab).iter().map(|v| v * 4.0).collect();
    let targets = [1u32, IGNORE_TARGET, 8999, 0, 4500, 7];
    // One thread (rows serial) and two (rows on the pool: over 2^15 elements).
    for threads in [1, 2] {
        let be = CpuBackend::new(threads).unwrap();
        let lb = buf(&be, &logits);
        let mut probs = be.zeros(rows * vocab, DType::F32).unwrap();
        let (want_sum, want_count) = be
            .cross_entropy_fwd(&lb, &targets, &mut probs, vocab)
            .unwrap();
        let mut want = be.zeros(rows * vocab, DType::F32).unwrap();
        be.cross_entropy_bwd(&probs, &targets, &mut want, vocab, 0.25)
            .unwrap();
        let mut got = buf(&be, &logits);
        let (sum, count) = be
            .cross_entropy_grad(&mut got, &targets, vocab, 0.25)
            .unwrap();
        assert_eq!(count, want_count);
        assert!(
            (sum - want_sum).abs() <= 1e-5 * want_sum.abs(),
            "{sum} vs {want_sum}"
        );
        let got = host(&be, &got);
        assert!(
            got[vocab..2 * vocab].iter().all(|&g| g == 0.0),
            "ignored row"
        );
        let want = host(&be, &want);
        let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        assert_close("cross_entropy_grad", &got, &want, 1e-6);
        let err = be
            .cross_entropy_grad(&mut buf(&be, &logits), &[1, 2, 9000, 0, 0, 0], vocab, 1.0)
            .unwrap_err();
        assert!(err.to_string().contains("id 9000 at position 2"), "{err}");
    }
}

#[test]
fn copy_range_copies_rows_and_refuses_what_does_not_fit() {
    let be = CpuBackend::new(1).unwrap();
    let src = buf(&be, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut dst = be.zeros(4, DType::F32).unwrap();
    be.copy_range(&src, 2, &mut dst, 1, 3).unwrap();
    assert_eq!(host(&be, &dst), vec![0.0, 3.0, 4.0, 5.0]);
    let err = be.copy_range(&src, 4, &mut dst, 0, 3).unwrap_err();
    assert_eq!(
        err.to_string(),
        "copy_range: operand `src` has 6 elements, expected 7"
    );
    let err = be.copy_range(&src, 0, &mut dst, 2, 3).unwrap_err();
    assert!(
        err.to_string()
            .contains("operand `dst` has 4 elements, expected 5"),
        "{err}"
    );
    let mut half = be.zeros(4, DType::Bf16).unwrap();
    let err = be.copy_range(&src, 0, &mut half, 0, 2).unwrap_err();
    assert!(err.to_string().contains("storage type"), "{err}");
}
