//! Causal attention: forward and gradients against an `f64` reference, and bf16
//! probabilities against the rounded f32 kernel.

use super::*;

/// Causal attention in f64; returns the output in `[batch, seq, heads, head_dim]`.
fn attention_ref(q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    let (t, dh) = (s.seq, s.head_dim);
    let idx = |b: usize, i: usize, h: usize| ((b * t + i) * s.heads + h) * dh;
    let mut out = vec![0.0; q.len()];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..dh)
                            .map(|e| q[idx(b, i, h) + e] * k[idx(b, j, h) + e])
                            .sum::<f64>()
                            / (dh as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, sc) in scores.iter().enumerate() {
                    let p = (sc - max).exp() / z;
                    for e in 0..dh {
                        out[idx(b, i, h) + e] += p * v[idx(b, j, h) + e];
                    }
                }
            }
        }
    }
    out
}

#[test]
fn attention_forward_and_gradients() {
    let s = AttnShape {
        batch: 2,
        seq: 5,
        heads: 2,
        head_dim: 3,
    };
    let n = s.qkv_len();
    let (q, k, v, d_o) = (
        rand_vec(17, n),
        rand_vec(18, n),
        rand_vec(19, n),
        rand_vec(20, n),
    );
    let (qw, kw, vw, dow) = (wide(&q), wide(&k), wide(&v), wide(&d_o));
    for be in backends() {
        let (qb, kb, vb) = (buf(&be, &q), buf(&be, &k), buf(&be, &v));
        let mut out = be.zeros(n, DType::F32).unwrap();
        let mut probs = be.zeros(s.probs_len(), DType::F32).unwrap();
        be.attention_fwd(&qb, &kb, &vb, &mut out, &mut probs, s)
            .unwrap();
        assert_close(
            "attn fwd",
            &host(&be, &out),
            &attention_ref(&qw, &kw, &vw, s),
            1e-5,
        );
        // probabilities: rows sum to 1, zero above the diagonal
        let p = host(&be, &probs);
        for (r, row) in p.chunks(s.seq).enumerate() {
            let i = r % s.seq;
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            assert!(row[i + 1..].iter().all(|&x| x == 0.0));
        }
        let mut g = [(); 3].map(|_| be.zeros(n, DType::F32).unwrap());
        let [dq, dk, dv] = &mut g;
        be.attention_bwd(&qb, &kb, &vb, &probs, &buf(&be, &d_o), dq, dk, dv, s)
            .unwrap();
        let dot = |o: Vec<f64>| o.iter().zip(&dow).map(|(a, b)| a * b).sum::<f64>();
        let want_q = fd(|q| dot(attention_ref(q, &kw, &vw, s)), &qw);
        let want_k = fd(|k| dot(attention_ref(&qw, k, &vw, s)), &kw);
        let want_v = fd(|v| dot(attention_ref(&qw, &kw, v, s)), &vw);
        assert_close("attn dq", &host(&be, dq), &want_q, 1e-4);
        assert_close("attn dk", &host(&be, dk), &want_k, 1e-4);
        assert_close("attn dv", &host(&be, dv), &want_v, 1e-4);
    }
}

/// bf16 probabilities, widened one sequence and head at a time, are the f32 kernel's
/// rounded: the forward stores `bf16(p)` and the backward reads them as the f32 kernel reads
/// those rounded values, bit for bit.
#[test]
fn attention_with_bf16_probabilities_is_the_rounded_f32() {
    let s = AttnShape {
        batch: 3,
        seq: 7,
        heads: 2,
        head_dim: 4,
    };
    let n = s.qkv_len();
    let [q, k, v, d_o] = [21, 22, 23, 24].map(|seed| rand_vec(seed, n));
    for be in backends() {
        let (qb, kb, vb, db) = (buf(&be, &q), buf(&be, &k), buf(&be, &v), buf(&be, &d_o));
        let run = |dtype| {
            let mut out = be.zeros(n, DType::F32).unwrap();
            let mut probs = be.zeros(s.probs_len(), dtype).unwrap();
            be.attention_fwd(&qb, &kb, &vb, &mut out, &mut probs, s)
                .unwrap();
            (host(&be, &out), probs)
        };
        let (out32, p32) = run(DType::F32);
        let (out16, p16) = run(DType::Bf16);
        assert_eq!(out16, out32, "the output is computed before rounding");
        let rounded: Vec<f32> = host(&be, &p32)
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect();
        assert_eq!(host(&be, &p16), rounded);
        let grads = |probs: &CpuBuf| {
            let mut g = [(); 3].map(|_| be.zeros(n, DType::F32).unwrap());
            let [dq, dk, dv] = &mut g;
            be.attention_bwd(&qb, &kb, &vb, probs, &db, dq, dk, dv, s)
                .unwrap();
            g.map(|b| host(&be, &b))
        };
        assert_eq!(grads(&p16), grads(&buf(&be, &rounded)));
    }
}

/// bf16 `q`, `k`, `v`, output gradient, output and probabilities, each widened one sequence
/// (or one head's probabilities) at a time, give the f32 kernel's results on the same values,
/// rounded where stored in bf16: bit for bit, on one thread and split over heads on two (the
/// shape is large enough for the pool).
#[test]
fn attention_with_bf16_operands_is_the_f32_kernel_on_their_values() {
    let s = AttnShape {
        batch: 3,
        seq: 48,
        heads: 4,
        head_dim: 40,
    };
    assert!(s.probs_len() * s.head_dim >= crate::tensor::cpu::PARALLEL_WORK);
    let n = s.qkv_len();
    let round = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let [q, k, v, d_o] = [31, 32, 33, 34].map(|seed| round(&rand_vec(seed, n)));
    for be in backends() {
        let run = |dtype| {
            let [qb, kb, vb, db] = [&q, &k, &v, &d_o].map(|x| be.from_host(x, dtype).unwrap());
            let mut out = be.zeros(n, dtype).unwrap();
            let mut probs = be.zeros(s.probs_len(), dtype).unwrap();
            be.attention_fwd(&qb, &kb, &vb, &mut out, &mut probs, s)
                .unwrap();
            let mut g = [(); 3].map(|_| be.zeros(n, DType::F32).unwrap());
            let [dq, dk, dv] = &mut g;
            be.attention_bwd(&qb, &kb, &vb, &probs, &db, dq, dk, dv, s)
                .unwrap();
            (host(&be, &out), host(&be, &probs), g.map(|b| host(&be, &b)))
        };
        let (out32, p32, _) = run(DType::F32);
        let (out16, p16, g16) = run(DType::Bf16);
        assert_eq!(out16, round(&out32), "the output, rounded");
        assert_eq!(p16, round(&p32), "the probabilities, rounded");
        // The backward reads the rounded probabilities: the f32 kernel on those.
        let [qb, kb, vb, db] = [&q, &k, &v, &d_o].map(|x| buf(&be, x));
        let mut g = [(); 3].map(|_| be.zeros(n, DType::F32).unwrap());
        let [dq, dk, dv] = &mut g;
        be.attention_bwd(&qb, &kb, &vb, &buf(&be, &p16), &db, dq, dk, dv, s)
            .unwrap();
        assert_eq!(g16, g.map(|b| host(&be, &b)), "the gradients");
    }
}
