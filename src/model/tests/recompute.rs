//! Activation recomputation in a chunk: what each mode holds, measured against the
//! element counts the memory model uses ([`Recompute::block_stash`]), and gradients
//! bitwise those without recomputation, including I and W of several micro-batches
//! interleaved.

use super::*;
use crate::model::config::Positions;
use crate::model::layers::Held;
use crate::tensor::Activation;

fn llama() -> GptConfig {
    GptConfig {
        kv_heads: Some(2),
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        qkv_bias: true,
        ..tiny()
    }
}

/// The last chunk of `cfg` cut in two (blocks without the embedding), in `mode`.
fn chunk(cfg: &GptConfig, mode: Recompute) -> ModelChunk<CpuBackend> {
    let mut c = ModelChunk::new(cfg, CpuBackend::new(1).unwrap(), &Cut::Even(2), 0).unwrap();
    c.set_recompute(mode).unwrap();
    c
}

#[test]
fn each_mode_holds_what_the_memory_model_counts() {
    for cfg in [tiny(), llama()] {
        let blocks = (cfg.layers / 2) as u64;
        let tokens = SHAPE.tokens() as u64;
        for mode in Recompute::ALL {
            let want = mode.block_stash(&cfg, SHAPE.seq);
            let mut c = chunk(&cfg, mode);
            let (ids, _) = &data(&cfg)[0];
            let ChunkOutput::Hidden(out) =
                c.forward(0, SHAPE, ChunkInput::Tokens(ids), None).unwrap()
            else {
                panic!("the first chunk returns hidden states")
            };
            let per = |n: u64| (n * blocks * tokens) as usize;
            assert_eq!(
                c.held(),
                Held {
                    for_i: per(want.forward),
                    for_w: 0
                },
                "{mode}: after F"
            );
            c.backward_input(0, ChunkGrad::Hidden(out)).unwrap();
            assert_eq!(
                c.held(),
                Held {
                    for_i: 0,
                    for_w: per(want.for_w)
                },
                "{mode}: after I"
            );
            c.backward_weight(0).unwrap();
            assert_eq!((c.held(), c.stashed()), (Held::default(), 0), "{mode}");
        }
        let (none, full) = (
            Recompute::None.block_stash(&cfg, SHAPE.seq),
            Recompute::Full.block_stash(&cfg, SHAPE.seq),
        );
        assert!(
            full.forward * 10 < none.forward,
            "full keeps the input only"
        );
    }
}

/// F of both micro-batches, then I and W interleaved (I1 I0 W1 W0): every gradient
/// bitwise the same in every mode.
fn grads(cfg: &GptConfig, mode: Recompute) -> Vec<Vec<f32>> {
    let be = CpuBackend::new(1).unwrap();
    let mut first = ModelChunk::new(cfg, be.clone(), &Cut::Even(2), 0).unwrap();
    let mut last = ModelChunk::new(cfg, be, &Cut::Even(2), 1).unwrap();
    first.set_recompute(mode).unwrap();
    last.set_recompute(mode).unwrap();
    let batches = data(cfg);
    for (mb, (ids, targets)) in batches.iter().enumerate() {
        let Ok(ChunkOutput::Hidden(h)) = first.forward(mb, SHAPE, ChunkInput::Tokens(ids), None)
        else {
            panic!("hidden states")
        };
        last.forward(mb, SHAPE, ChunkInput::Hidden(h), Some(targets))
            .unwrap();
    }
    for mb in [1, 0] {
        let dx = last
            .backward_input(mb, ChunkGrad::Loss(0.5))
            .unwrap()
            .unwrap();
        first.backward_input(mb, ChunkGrad::Hidden(dx)).unwrap();
    }
    for mb in [1, 0] {
        last.backward_weight(mb).unwrap();
        first.backward_weight(mb).unwrap();
    }
    let names = [first.param_names(), last.param_names()];
    let chunks = [&first, &last];
    chunks
        .iter()
        .zip(&names)
        .flat_map(|(c, n)| n.iter().map(|n| c.grad_values(n).unwrap()))
        .collect()
}

#[test]
fn recomputed_gradients_are_bitwise_the_stored_ones() {
    for cfg in [tiny(), llama()] {
        let want = grads(&cfg, Recompute::None);
        assert!(want.iter().flatten().any(|&g| g != 0.0));
        for mode in [Recompute::Selective, Recompute::Full] {
            assert!(grads(&cfg, mode) == want, "{mode}: gradients differ");
        }
    }
}

#[test]
fn recomputation_changes_only_between_steps() {
    let cfg = tiny();
    let mut c = chunk(&cfg, Recompute::Full);
    let (ids, _) = &data(&cfg)[0];
    c.forward(3, SHAPE, ChunkInput::Tokens(ids), None).unwrap();
    let err = c.set_recompute(Recompute::None).unwrap_err().to_string();
    assert!(err.contains("in flight"), "{err}");
    assert_eq!(c.recompute(), Recompute::Full);
    c.discard(3);
    assert_eq!(c.stashed(), 0, "discard drops the kept inputs");
    c.set_recompute(Recompute::None).unwrap();
}

#[test]
fn full_recomputation_reruns_all_but_the_down_projection() {
    for cfg in [tiny(), llama()] {
        let seq = SHAPE.seq;
        let [none, selective, full] = Recompute::ALL.map(|m| m.rerun_share(&cfg, seq));
        assert!(none == 0.0 && 0.0 < selective && selective < full && full < 1.0);
        // The down projection: a fifth to a third of a block's multiply-adds.
        assert!(1.0 - full > 0.2 && 1.0 - full < 0.4, "{full}");
    }
}
