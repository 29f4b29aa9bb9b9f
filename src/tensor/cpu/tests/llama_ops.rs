//! The ops of the Llama-family options: RoPE, grouped-query `repeat_kv` and the
//! element-wise product of SwiGLU.

use super::*;

/// RoPE against an `f64` reference of Llama's `rotate_half` formula, and the properties the
/// model relies on: position 0 is the identity, `inverse` undoes the rotation (it is the
/// transpose, i.e. the input gradient), and a query·key product depends on the positions'
/// difference only.
#[test]
fn rope_rotates_pairs_by_position() {
    let be = CpuBackend::new(1).unwrap();
    let (heads, hd, theta) = (2, 6, 100.0f32);
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| theta.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    let positions = [0u32, 1, 5, 2];
    let x = rand_vec(11, positions.len() * heads * hd);
    let mut out = be.zeros(x.len(), DType::F32).unwrap();
    be.rope(
        &buf(&be, &x),
        &mut out,
        &positions,
        heads,
        hd,
        &inv_freq,
        false,
    )
    .unwrap();
    let got = host(&be, &out);
    let mut want = vec![0.0f64; x.len()];
    for (r, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (r * heads + h) * hd;
            for i in 0..hd / 2 {
                let a = f64::from(p) * f64::from(theta).powf(-2.0 * i as f64 / hd as f64);
                let (x1, x2) = (f64::from(x[base + i]), f64::from(x[base + i + hd / 2]));
                want[base + i] = x1 * a.cos() - x2 * a.sin();
                want[base + i + hd / 2] = x2 * a.cos() + x1 * a.sin();
            }
        }
    }
    assert_close("rope", &got, &want, 1e-5);
    assert_eq!(
        &got[..heads * hd],
        &x[..heads * hd],
        "position 0 is the identity"
    );
    let mut back = be.zeros(x.len(), DType::F32).unwrap();
    be.rope(&out, &mut back, &positions, heads, hd, &inv_freq, true)
        .unwrap();
    assert_close("inverse of rope", &host(&be, &back), &wide(&x), 1e-5);
    // q at position m, k at n: the product is the same at (m + s, n + s).
    let (q, k) = (rand_vec(12, hd), rand_vec(13, hd));
    let dot_at = |m: u32, n: u32| {
        let rot = |v: &[f32], p: u32| {
            let mut o = be.zeros(hd, DType::F32).unwrap();
            be.rope(&buf(&be, v), &mut o, &[p], 1, hd, &inv_freq, false)
                .unwrap();
            host(&be, &o)
        };
        let (a, b) = (rot(&q, m), rot(&k, n));
        a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum::<f64>()
    };
    assert!((dot_at(7, 3) - dot_at(11, 7)).abs() < 1e-5);
    assert!(
        (dot_at(7, 3) - dot_at(7, 4)).abs() > 1e-3,
        "positions matter"
    );
    let odd = be.rope(
        &buf(&be, &x[..5]),
        &mut be.zeros(5, DType::F32).unwrap(),
        &[0],
        1,
        5,
        &inv_freq[..2],
        false,
    );
    assert!(odd.unwrap_err().to_string().contains("must be even"));
    let mut o = be.zeros(x.len(), DType::F32).unwrap();
    let short = be.rope(
        &buf(&be, &x),
        &mut o,
        &positions,
        heads,
        hd,
        &inv_freq[..2],
        false,
    );
    assert!(short.unwrap_err().to_string().contains("got 2"));
}

/// `repeat_kv` gives query head `h` the key/value head `h / rep`; its backward sums the
/// copies back (the adjoint: ⟨repeat(a), b⟩ = ⟨a, repeat_bwd(b)⟩).
#[test]
fn repeat_kv_and_its_gradient() {
    let be = CpuBackend::new(1).unwrap();
    let (rows, kv, rep, hd) = (3, 2, 3, 2);
    let a = rand_vec(21, rows * kv * hd);
    let mut wide_buf = be.zeros(rows * kv * rep * hd, DType::F32).unwrap();
    be.repeat_kv(&buf(&be, &a), &mut wide_buf, rows, kv, rep, hd)
        .unwrap();
    let w = host(&be, &wide_buf);
    for r in 0..rows {
        for h in 0..kv * rep {
            assert_eq!(
                &w[(r * kv * rep + h) * hd..][..hd],
                &a[(r * kv + h / rep) * hd..][..hd]
            );
        }
    }
    let b = rand_vec(22, w.len());
    let mut narrow = be.zeros(a.len(), DType::F32).unwrap();
    be.repeat_kv_bwd(&buf(&be, &b), &mut narrow, rows, kv, rep, hd)
        .unwrap();
    let lhs: f64 = w
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let rhs: f64 = a
        .iter()
        .zip(&host(&be, &narrow))
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    assert!((lhs - rhs).abs() < 1e-5, "{lhs} vs {rhs}");
    let err = be
        .repeat_kv(&buf(&be, &a), &mut narrow, rows, kv, rep, hd)
        .unwrap_err();
    assert!(
        err.to_string().contains("repeat_kv: operand `dst`"),
        "{err}"
    );
}

#[test]
fn mul_is_elementwise() {
    let be = CpuBackend::new(1).unwrap();
    let (a, b) = (rand_vec(31, 9), rand_vec(32, 9));
    let mut out = be.zeros(9, DType::F32).unwrap();
    be.mul(&buf(&be, &a), &buf(&be, &b), &mut out).unwrap();
    let want: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .collect();
    assert_close("mul", &host(&be, &out), &want, 1e-7);
    assert!(be.mul(&buf(&be, &a), &buf(&be, &b[..8]), &mut out).is_err());
}
