//! Optimizer tests: AdamW against hand computation, clipping, the schedule, bf16 masters.

use super::{SHAPE, data, tiny};
use crate::model::*;
use crate::tensor::CpuBackend;

/// A one-parameter "model" for optimizer tests.
fn param(
    be: &CpuBackend,
    name: &str,
    value: &[f32],
    grad: &[f32],
    decay: bool,
) -> Param<CpuBackend> {
    let mut p = Param::new(be, name.into(), vec![value.len()], value, decay).unwrap();
    p.grad = be.from_host(grad, crate::tensor::DType::F32).unwrap();
    p
}

#[test]
fn adamw_two_steps_match_hand_computation_and_skip_decay_on_norms() {
    let be = CpuBackend::new(1).unwrap();
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.99,
        eps: 0.0,
        weight_decay: 0.5,
        max_grad_norm: 0.0,
    };
    let mut opt = AdamW::new(cfg);
    let mut w = param(&be, "blocks.0.mlp.w1", &[2.0], &[0.3], true);
    let mut g = param(&be, "blocks.0.norm1.weight", &[2.0], &[0.3], false);
    let lr = 0.1f64;
    opt.step(&be, [&mut w, &mut g], lr as f32, 1.0).unwrap();
    // Step 1: m̂ = g, v̂ = g², update = 1 (eps 0).
    let w1 = 2.0 - lr * (1.0 + 0.5 * 2.0);
    let g1 = 2.0 - lr * 1.0;
    assert!((f64::from(be.to_host(&w.value).unwrap()[0]) - w1).abs() < 1e-6);
    assert!((f64::from(be.to_host(&g.value).unwrap()[0]) - g1).abs() < 1e-6);
    // Step 2 with gradient -0.1.
    w.grad = be.from_host(&[-0.1], crate::tensor::DType::F32).unwrap();
    opt.step(&be, [&mut w], lr as f32, 1.0).unwrap();
    let m = 0.9 * (0.1 * 0.3) + 0.1 * -0.1;
    let v = 0.99 * (0.01 * 0.09) + 0.01 * 0.01;
    let (mh, vh) = (m / (1.0 - 0.81), v / (1.0 - 0.9801));
    let w2 = w1 - lr * (mh / f64::sqrt(vh) + 0.5 * w1);
    assert!((f64::from(be.to_host(&w.value).unwrap()[0]) - w2).abs() < 1e-6);
    // State round-trips through the host, by name.
    let state = opt.state(&be).unwrap();
    assert_eq!(state.step, 2);
    assert_eq!(
        state.slots.keys().collect::<Vec<_>>(),
        ["blocks.0.mlp.w1", "blocks.0.norm1.weight"]
    );
    let json = serde_json::to_string(&state).unwrap();
    let mut restored = AdamW::<CpuBackend>::new(AdamWConfig::default());
    restored
        .load_state(&be, &serde_json::from_str(&json).unwrap())
        .unwrap();
    assert_eq!(restored.state(&be).unwrap(), state);
}

#[test]
fn clipping_scales_the_global_norm_to_the_limit() {
    assert_eq!(clip_scale(0.5, 1.0), 1.0);
    assert_eq!(clip_scale(5.0, 0.0), 1.0);
    assert!((clip_scale(4.0, 1.0) - 0.25).abs() < 1e-7);
    // Through the optimizer: the first moment after one step is (1 − β1)·scale·g.
    let be = CpuBackend::new(1).unwrap();
    let cfg = tiny();
    let mut gpt = Gpt::new(&cfg, be.clone(), &Cut::Even(2)).unwrap();
    for p in gpt.params_mut() {
        let n = p.numel();
        p.grad = be
            .from_host(&vec![1.0; n], crate::tensor::DType::F32)
            .unwrap();
    }
    let norm = gpt.grad_norm().unwrap();
    assert!((norm - (cfg.param_count() as f64).sqrt()).abs() < 1e-6);
    let mut opt = AdamW::new(AdamWConfig {
        max_grad_norm: 2.0,
        ..AdamWConfig::default()
    });
    let before = opt.step_chunks(gpt.chunks_mut(), 1e-3).unwrap();
    assert!((before - norm).abs() < 1e-9);
    let state = opt.state(&be).unwrap();
    let m_norm: f64 = state
        .slots
        .values()
        .flat_map(|s| &s.m)
        .map(|&m| f64::from(m).powi(2))
        .sum();
    assert!(
        (m_norm.sqrt() / 0.1 - 2.0).abs() < 1e-4,
        "clipped norm {}",
        m_norm.sqrt() / 0.1
    );
}

#[test]
fn lr_schedule_warms_up_then_decays() {
    let s = LrSchedule {
        peak_lr: 1.0,
        min_lr: 0.1,
        warmup_steps: 4,
        total_steps: 14,
    };
    assert_eq!(s.lr(0), 0.25);
    assert_eq!(s.lr(3), 1.0);
    assert_eq!(s.lr(4), 1.0);
    assert!((s.lr(9) - 0.55).abs() < 1e-6);
    assert!((s.lr(14) - 0.1).abs() < 1e-7);
    assert_eq!(s.lr(100), 0.1);
    assert!((4..14).all(|k| s.lr(k + 1) <= s.lr(k)));
}

#[test]
fn bf16_storage_trains_with_f32_master_weights() {
    let cfg = tiny();
    let be = CpuBackend::new(1)
        .unwrap()
        .with_storage(crate::tensor::DType::Bf16);
    let mut gpt = Gpt::new(&cfg, be.clone(), &Cut::Even(1)).unwrap();
    let (ids, t) = &data(&cfg)[0];
    let mut opt = AdamW::new(AdamWConfig::default());
    let first = gpt.loss(SHAPE, ids, t).unwrap();
    for step in 0..30 {
        gpt.zero_grads().unwrap();
        gpt.forward_backward(0, SHAPE, ids, t, 1.0).unwrap();
        opt.step_chunks(gpt.chunks_mut(), 1e-2 * (step as f32 + 1.0).min(5.0) / 5.0)
            .unwrap();
    }
    let last = gpt.loss(SHAPE, ids, t).unwrap();
    assert!(last < 0.6 * first, "{first} -> {last}");
    let state = opt.state(&be).unwrap();
    assert!(state.slots.values().all(|s| s.master.is_some()));
    // Taken at the end of a run: the same state, moved out, and nothing left behind.
    let mut taken = AdamW::new(AdamWConfig::default());
    taken.load_state(&be, &state).unwrap();
    assert_eq!(taken.take_state(&be).unwrap(), state);
    assert!(taken.state(&be).unwrap().slots.is_empty());
    // Stored values are the master weights rounded to bf16.
    let master = &state.slots["head.w"].master.as_ref().unwrap()[..4];
    let stored = &gpt.param_values("head.w").unwrap()[..4];
    for (m, s) in master.iter().zip(stored) {
        assert_eq!(half::bf16::from_f32(*m).to_f32(), *s);
    }
}

#[test]
fn an_f32_state_loaded_for_bf16_parameters_steps_them_through_master_weights() {
    use crate::tensor::DType;
    let f32_be = CpuBackend::new(1).unwrap();
    let bf16_be = CpuBackend::new(1).unwrap().with_storage(DType::Bf16);
    let p = |be: &CpuBackend| param(be, "w", &[0.5, -0.25, 1.0], &[0.1, -0.2, 0.3], true);
    // One step in f32: its state has moments and no master.
    let (mut w, mut opt) = (p(&f32_be), AdamW::new(AdamWConfig::default()));
    opt.step(&f32_be, [&mut w], 1e-3, 1.0).unwrap();
    let state = opt.state(&f32_be).unwrap();
    assert!(state.slots["w"].master.is_none());

    // Resumed with the parameter in bf16: the update goes through an f32 master made from
    // the value, so a step too small for bf16 still moves it.
    let mut w = p(&bf16_be);
    let mut opt = AdamW::new(AdamWConfig::default());
    opt.load_state(&bf16_be, &state).unwrap();
    opt.step(&bf16_be, [&mut w], 1e-5, 1.0).unwrap();
    let master = opt.state(&bf16_be).unwrap().slots["w"].master.clone();
    let master = master.expect("a bf16 parameter has master weights");
    assert!(
        master
            .iter()
            .zip([0.5f32, -0.25, 1.0])
            .all(|(m, v)| *m != v)
    );
    let stored = bf16_be.to_host(&w.value).unwrap();
    for (m, s) in master.iter().zip(&stored) {
        assert_eq!(half::bf16::from_f32(*m).to_f32(), *s);
    }
}
