//! Every kernel against a naive product, and against each other bitwise.

use super::*;
use crate::model::ModelError;

fn val(i: usize) -> f32 {
    ((i * 7919 % 101) as f32 - 50.0) / 37.0
}

#[test]
fn rows_match_a_naive_product_and_do_not_depend_on_the_batch() {
    let (rows, din, dout) = (11, 13, 107);
    let x: Vec<f32> = (0..rows * din).map(val).collect();
    let w: Vec<f32> = (0..din * dout).map(|i| val(i + 5)).collect();
    let packed = Packed::new(&w, din, dout);
    let y = rowmul(&x, &packed, rows);
    for r in 0..rows {
        for c in 0..dout {
            let want: f64 = (0..din)
                .map(|k| f64::from(x[r * din + k]) * f64::from(w[k * dout + c]))
                .sum();
            assert!((f64::from(y[r * dout + c]) - want).abs() < 1e-4);
        }
    }
    // Every pass shape (1 to 11 rows, several panels at a time plus the remainder)
    // gives each row bitwise what the 11-row call gave it.
    for n in 1..=rows {
        for r0 in [0, rows - n] {
            let part = rowmul(&x[r0 * din..(r0 + n) * din], &packed, n);
            assert_eq!(part, y[r0 * dout..(r0 + n) * dout], "rows {r0}..{}", r0 + n);
        }
    }
}

/// Each kernel this CPU has, forced, gives bitwise what the plain one gives (the same
/// chain of FMAs per element), for widths that leave a partial last panel or half, every
/// pass shape and several passes over blocks of panels (up to 33 rows), with weights in
/// f32 and in half precision.
#[test]
fn every_kernel_gives_bitwise_the_same_values() {
    let available: Vec<Isa> = [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|i| i.is_available())
        .collect();
    // Panels: 1 partial; 2 with a 1-column half; 13 (blocks of 6 and a remainder) with
    // the last half all padding; 50 the vocabulary.
    for (din, dout) in [(3, 5), (17, 17), (29, 203), (40, 50), (8, 16 * 13 + 7)] {
        let w: Vec<f32> = (0..din * dout).map(|i| val(i + 3)).collect();
        for precision in [Precision::F32, Precision::F16] {
            let packed = Packed::with_precision(&w, din, dout, precision).unwrap();
            for rows in 1..=33 {
                let x: Vec<f32> = (0..rows * din).map(|i| val(2 * i + 1)).collect();
                let plain = rowmul_on(Isa::Plain, &x, &packed, rows).unwrap();
                for &isa in &available {
                    let y = rowmul_on(isa, &x, &packed, rows).unwrap();
                    let same = y
                        .iter()
                        .zip(&plain)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} {precision:?}, rows {rows}, {din} -> {dout}");
                }
            }
        }
    }
}

/// Half precision rounds each weight once and changes nothing else: the product equals,
/// bitwise, the f32 product of the rounded weights, at half the bytes.
#[test]
fn half_precision_is_the_f32_product_of_rounded_weights() {
    let (rows, din, dout) = (5, 37, 45);
    // Magnitudes from 1e-6 (f16 subnormals) to 1e3, both signs.
    let w: Vec<f32> = (0..din * dout)
        .map(|i| val(i) * 10f32.powi((i % 10) as i32 - 6))
        .collect();
    let rounded: Vec<f32> = w.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
    assert!(
        w.iter().zip(&rounded).any(|(a, b)| a != b),
        "some weight rounds"
    );
    let x: Vec<f32> = (0..rows * din).map(|i| val(3 * i)).collect();
    let half = Packed::with_precision(&w, din, dout, Precision::F16).unwrap();
    let full = Packed::new(&rounded, din, dout);
    assert_eq!(half.precision(), Precision::F16);
    assert_eq!(2 * half.bytes(), full.bytes());
    let (a, b) = (rowmul(&x, &half, rows), rowmul(&x, &full, rows));
    assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Within f16's relative rounding (2^-11 per weight) of the exact product.
    let exact = rowmul(&x, &Packed::new(&w, din, dout), rows);
    for (r, (a, e)) in a.iter().zip(&exact).enumerate() {
        let scale: f32 = (0..din)
            .map(|k| (x[r / dout * din + k] * w[k * dout + r % dout]).abs())
            .sum();
        assert!((a - e).abs() <= scale * 2f32.powi(-11) + 1e-6, "{a} vs {e}");
    }
}

#[test]
fn a_weight_beyond_half_range_is_an_error() {
    let err = Packed::with_precision(&[1.0, 7e4, 0.0, 1.0], 2, 2, Precision::F16).unwrap_err();
    assert!(matches!(err, ModelError::HalfRange(v) if v == 7e4), "{err}");
    let err = Packed::with_precision(&[1.0; 3], 2, 2, Precision::F32).unwrap_err();
    assert!(
        matches!(err, ModelError::RowmulWeights { got: 3, .. }),
        "{err}"
    );
}

#[test]
fn a_wrong_shape_is_an_error() {
    let packed = Packed::new(&[1.0; 6], 2, 3);
    let err = rowmul_on(Isa::Plain, &[1.0; 5], &packed, 2).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::RowmulShape {
                got: 5,
                rows: 2,
                din: 2
            }
        ),
        "{err}"
    );
    assert_eq!(
        rowmul_on(Isa::Plain, &[], &packed, 0).unwrap(),
        Vec::<f32>::new()
    );
}

/// A matrix packed from its transpose is the same panels as packed from itself (f32 and
/// f16, a partial last panel included), and a wrong length is refused either way.
#[test]
fn packing_from_the_transpose_gives_the_same_panels() {
    for (din, dout) in [(3, 5), (17, 35), (8, 16)] {
        let w: Vec<f32> = (0..din * dout).map(|i| val(i + 3)).collect();
        let wt = crate::model::tie::transpose(&w, din, dout);
        for precision in [Precision::F32, Precision::F16] {
            let a = Packed::with_precision(&w, din, dout, precision).unwrap();
            let b = Packed::with_precision_transposed(&wt, din, dout, precision).unwrap();
            assert_eq!(b.precision(), precision);
            for p in 0..a.panels() {
                for k in 0..din {
                    for j in 0..PANEL {
                        let (x, y) = (a.weight(p, k, j), b.weight(p, k, j));
                        assert_eq!(x.to_bits(), y.to_bits(), "{din}x{dout} {p} {k} {j}");
                    }
                }
            }
        }
        let short = &wt[1..];
        assert!(Packed::with_precision_transposed(short, din, dout, Precision::F32).is_err());
    }
}
