//! New outputs are not zeroed ([`crate::tensor::Backend::uninit`]): every layer must write
//! each output whole before anything reads it. On a backend that fills new outputs with NaN
//! (`CpuBackend::with_poisoned_outputs`), any element read before it is written turns the
//! loss or a gradient into NaN; so the losses and gradients match the plain backend's
//! bitwise in every shape, precision, thread count and recomputation mode only where the
//! contract holds.

use super::*;
use crate::model::config::Positions;
use crate::tensor::{Activation, DType};

/// Every Llama-family option, with tied embeddings.
fn llama() -> GptConfig {
    GptConfig {
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        kv_heads: Some(2),
        qkv_bias: true,
        intermediate: Some(24),
        tie_embeddings: true,
        ..tiny()
    }
}

/// Losses and gradients of two micro-batches on a model cut in two.
fn run(cfg: &GptConfig, be: CpuBackend, mode: Recompute) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut gpt = Gpt::new(cfg, be, &Cut::Even(2)).unwrap();
    gpt.set_recompute(mode).unwrap();
    let losses = data(cfg)
        .iter()
        .enumerate()
        .map(|(mb, (ids, t))| {
            let loss = gpt.forward_backward(mb, SHAPE, ids, t, 0.5).unwrap();
            assert!(loss.is_finite());
            loss.to_bits()
        })
        .collect();
    let grads = gpt.param_names().into_iter().map(|n| {
        let g = gpt.grad_values(&n).unwrap();
        g.iter().map(|x| x.to_bits()).collect()
    });
    (losses, grads.collect())
}

#[test]
fn every_layer_writes_its_new_outputs_whole() {
    for cfg in [tiny(), llama()] {
        for dtype in [DType::F32, DType::Bf16] {
            for threads in [1, 2] {
                for mode in [Recompute::None, Recompute::Selective, Recompute::Full] {
                    let be = CpuBackend::new(threads).unwrap().with_storage(dtype);
                    let plain = run(&cfg, be.clone(), mode);
                    let poisoned = run(&cfg, be.with_poisoned_outputs(), mode);
                    let what = format!("{:?} {dtype:?} {threads} threads {mode:?}", cfg.positions);
                    assert_eq!(plain.0, poisoned.0, "losses, {what}");
                    assert_eq!(plain.1, poisoned.1, "gradients, {what}");
                }
            }
        }
    }
}

#[test]
fn the_poisoned_backend_fills_new_outputs_with_nan() {
    let be = CpuBackend::new(1).unwrap().with_poisoned_outputs();
    for dtype in [DType::F32, DType::Bf16] {
        // SAFETY: only the poisoned backend's NaN is read here, which is written.
        let buf = unsafe { be.uninit(5, dtype).unwrap() };
        assert!(be.to_host(&buf).unwrap().iter().all(|x| x.is_nan()));
    }
}
