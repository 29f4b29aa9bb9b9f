//! Finite-difference gradient checks of every layer, for I (input gradient) and W (weight
//! gradients) separately.
//!
//! The objective is `L = Σ dy·y` for a fixed random `dy` (for the head: `scale·loss`), so the
//! analytic gradients are exactly what `backward_input(dy)` / `backward_weight` compute.
//! Numerical gradients are central differences in `f32` with step `h = 1e-2`, `L` summed in
//! `f64`. Tolerance: `‖g − g_fd‖ / max(‖g‖, ‖g_fd‖) < 1e-2` per tensor (the `f32` round-off of
//! `L` divided by `2h` is ~1e-4 of the gradient's scale at these sizes; a wrong formula gives
//! errors of order 1). Parameters are drawn at scale 0.5 (not the 0.02 of the init) so the
//! gradients are well above that noise.

use super::*;
use crate::model::GptConfig;
use crate::model::init::normal;
use crate::tensor::{Activation, Backend, CpuBackend};

const H: f32 = 1e-2;
const TOL: f64 = 1e-2;

fn be() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

fn config(act: Activation) -> GptConfig {
    GptConfig {
        vocab: 7,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 5,
        mlp_ratio: 2,
        activation: act,
        norm_eps: 1e-5,
        seed: 3,
        ..GptConfig::default()
    }
}

/// Re-draws every parameter at scale 0.5 (norm gains around 1).
fn randomize(be: &CpuBackend, params: Vec<&mut Param<CpuBackend>>) {
    for p in params {
        let mut v = normal(99, &p.name, p.numel(), 0.5);
        if p.name.contains("norm") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        p.value = be.from_host(&v, DType::F32).unwrap();
    }
}

fn dot(be: &CpuBackend, y: &<CpuBackend as Backend>::Buf, dy: &[f32]) -> f64 {
    let y = be.to_host(y).unwrap();
    y.iter()
        .zip(dy)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum()
}

/// Central differences of `f` at `x0`.
fn numeric(x0: &[f32], mut f: impl FnMut(&[f32]) -> f64) -> Vec<f64> {
    let mut x = x0.to_vec();
    (0..x.len())
        .map(|i| {
            x[i] = x0[i] + H;
            let up = f(&x);
            x[i] = x0[i] - H;
            let down = f(&x);
            x[i] = x0[i];
            (up - down) / (2.0 * f64::from(H))
        })
        .collect()
}

fn assert_grad(what: &str, analytic: &[f32], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len(), "{what}");
    let diff: f64 = analytic
        .iter()
        .zip(numeric)
        .map(|(&a, n)| (f64::from(a) - n).powi(2))
        .sum();
    let na: f64 = analytic.iter().map(|&a| f64::from(a).powi(2)).sum();
    let nn: f64 = numeric.iter().map(|n| n * n).sum();
    let rel = diff.sqrt() / na.sqrt().max(nn.sqrt()).max(1e-12);
    assert!(
        nn > 1e-6,
        "{what}: numerical gradient vanishes, the check would be vacuous"
    );
    assert!(
        rel < TOL,
        "{what}: relative error {rel:e} (‖analytic‖ {}, ‖fd‖ {})",
        na.sqrt(),
        nn.sqrt()
    );
}

/// Checks W of every parameter of a layer: `run(layer)` does F, I and W for micro-batch 0
/// and returns nothing; `loss(layer)` does F only (micro-batch 1, discarded) and returns L.
fn check_weights<L>(
    be: &CpuBackend,
    layer: &mut L,
    params: fn(&mut L) -> Vec<&mut Param<CpuBackend>>,
    run: impl Fn(&mut L),
    loss: impl Fn(&mut L) -> f64,
) {
    run(layer);
    let names: Vec<String> = params(layer).iter().map(|p| p.name.clone()).collect();
    for name in names {
        let (x0, analytic) = {
            let p = params(layer).into_iter().find(|p| p.name == name).unwrap();
            (be.to_host(&p.value).unwrap(), be.to_host(&p.grad).unwrap())
        };
        let num = numeric(&x0, |x| {
            let p = params(layer).into_iter().find(|p| p.name == name).unwrap();
            p.value = be.from_host(x, DType::F32).unwrap();
            loss(layer)
        });
        let p = params(layer).into_iter().find(|p| p.name == name).unwrap();
        p.value = be.from_host(&x0, DType::F32).unwrap();
        assert_grad(&name, &analytic, &num);
    }
}

#[test]
fn rmsnorm_input_and_weight_gradients() {
    check_layer(RmsNorm::new(&be(), "n", 8, 1e-5).unwrap());
}

use crate::tensor::{CpuBuf, DType};

const BATCH: usize = 2;
const SEQ: usize = 4;
const SHAPE: Shape = Shape {
    batch: BATCH,
    seq: SEQ,
};

/// I and W of a [`Layer`] against finite differences; I must leave every grad at zero, and
/// nothing may stay stashed after W.
fn check_layer<L: Layer<CpuBackend>>(mut layer: L) {
    let be = be();
    randomize(&be, layer.params_mut());
    let n = BATCH * SEQ * 8;
    let x = normal(1, "x", n, 1.0);
    let dy = normal(2, "dy", n, 1.0);
    let xb = be.from_host(&x, DType::F32).unwrap();
    let dyb = be.from_host(&dy, DType::F32).unwrap();
    layer.forward(&be, 0, &xb, SHAPE).unwrap();
    let dx = be
        .to_host(&layer.backward_input(&be, 0, &dyb).unwrap())
        .unwrap();
    for p in layer.params_mut() {
        let g = be.to_host(&p.grad).unwrap();
        assert!(
            g.iter().all(|&g| g == 0.0),
            "I computed a weight gradient for {}",
            p.name
        );
    }
    let num = numeric(&x, |x| {
        let y = layer
            .forward(&be, 1, &be.from_host(x, DType::F32).unwrap(), SHAPE)
            .unwrap();
        layer.discard(1);
        dot(&be, &y, &dy)
    });
    assert_grad("dx", &dx, &num);
    layer.backward_weight(&be, 0).unwrap();
    check_weights(
        &be,
        &mut layer,
        |l| l.params_mut(),
        |_| {},
        |l| {
            let y = l.forward(&be, 1, &xb, SHAPE).unwrap();
            l.discard(1);
            dot(&be, &y, &dy)
        },
    );
    assert_eq!(layer.stashed(), 0);
}

#[test]
fn attention_input_and_weight_gradients() {
    check_layer(Attention::new(&be(), "attn", &config(Activation::Gelu)).unwrap());
}

#[test]
fn mlp_gelu_input_and_weight_gradients() {
    check_layer(Mlp::new(&be(), "mlp", &config(Activation::Gelu)).unwrap());
}

#[test]
fn mlp_silu_input_and_weight_gradients() {
    check_layer(Mlp::new(&be(), "mlp", &config(Activation::Silu)).unwrap());
}

#[test]
fn block_input_and_weight_gradients() {
    check_layer(Block::new(&be(), 0, &config(Activation::Gelu)).unwrap());
}

/// The Llama-family options on the test shape (`d_model` 8): rotary positions with a small
/// base (so every frequency turns visibly over 4 positions), `heads` 4 of width 2 sharing
/// `kv_heads` 2, and q/k/v biases, as asked.
fn llama(act: Activation, rope: bool, kv_heads: Option<usize>, qkv_bias: bool) -> GptConfig {
    GptConfig {
        heads: 4,
        positions: if rope {
            Positions::Rope
        } else {
            Positions::Learned
        },
        rope_theta: 10.0,
        kv_heads,
        qkv_bias,
        ..config(act)
    }
}

use crate::model::config::{Positions, RopeScaling};

#[test]
fn attention_rope_input_and_weight_gradients() {
    let cfg = llama(Activation::Gelu, true, None, false);
    check_layer(Attention::new(&be(), "attn", &cfg).unwrap());
    // A head width of 4: two frequencies per head.
    let cfg = GptConfig { heads: 2, ..cfg };
    check_layer(Attention::new(&be(), "attn", &cfg).unwrap());
    // Llama-3 scaled: the second frequency (wavelength 19.9) lies in the smoothed band.
    let cfg = GptConfig {
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 40,
        }),
        ..cfg
    };
    let freq = cfg.rope_inv_freq();
    assert_eq!(freq[0], 1.0);
    assert!(freq[1] < 0.316 && freq[1] > 0.316 / 8.0, "{freq:?}");
    check_layer(Attention::new(&be(), "attn", &cfg).unwrap());
}

#[test]
fn attention_grouped_query_input_and_weight_gradients() {
    let cfg = llama(Activation::Gelu, false, Some(2), false);
    let attn = Attention::new(&be(), "attn", &cfg).unwrap();
    assert_eq!(attn.wk.shape, vec![8, 4]);
    check_layer(attn);
    let cfg = llama(Activation::Gelu, false, Some(1), false);
    check_layer(Attention::new(&be(), "attn", &cfg).unwrap());
}

/// With rotary positions (without them the key bias adds `q·bk` to every score of a query,
/// which the softmax ignores: its gradient is zero, checked below, and its finite
/// difference would be vacuous).
#[test]
fn attention_qkv_bias_input_and_weight_gradients() {
    let cfg = llama(Activation::Gelu, true, None, true);
    let attn = Attention::new(&be(), "attn", &cfg).unwrap();
    assert_eq!(attn.params().len(), 7);
    check_layer(attn);
    let be = be();
    let cfg = llama(Activation::Gelu, false, None, true);
    let mut attn = Attention::new(&be, "attn", &cfg).unwrap();
    randomize(&be, attn.params_mut());
    let n = BATCH * SEQ * 8;
    let x = be.from_host(&normal(1, "x", n, 1.0), DType::F32).unwrap();
    let dy = be.from_host(&normal(2, "dy", n, 1.0), DType::F32).unwrap();
    attn.forward(&be, 0, &x, SHAPE).unwrap();
    attn.backward_input(&be, 0, &dy).unwrap();
    attn.backward_weight(&be, 0).unwrap();
    let [bq, bk, _] = attn.bias.as_ref().unwrap();
    let norm = |p: &Param<CpuBackend>| {
        let g = be.to_host(&p.grad).unwrap();
        g.iter().map(|v| v * v).sum::<f32>().sqrt()
    };
    assert!(norm(bk) < 1e-5 * norm(bq), "{} vs {}", norm(bk), norm(bq));
}

#[test]
fn attention_llama_input_and_weight_gradients() {
    let cfg = llama(Activation::Gelu, true, Some(2), true);
    check_layer(Attention::new(&be(), "attn", &cfg).unwrap());
}

#[test]
fn mlp_swiglu_input_and_weight_gradients() {
    let mlp = Mlp::new(&be(), "mlp", &config(Activation::Swiglu)).unwrap();
    assert_eq!(mlp.params().len(), 3, "gate, down and up");
    check_layer(mlp);
    let cfg = GptConfig {
        intermediate: Some(5),
        ..config(Activation::Swiglu)
    };
    let mlp = Mlp::new(&be(), "mlp", &cfg).unwrap();
    assert_eq!(mlp.w3.as_ref().unwrap().shape, vec![8, 5]);
    check_layer(mlp);
}

#[test]
fn llama_block_input_and_weight_gradients() {
    let cfg = llama(Activation::Swiglu, true, Some(2), true);
    check_layer(Block::new(&be(), 0, &cfg).unwrap());
}

/// Grouped-query attention is multi-head attention whose key/value projections repeat each
/// shared head's columns for the `heads / kv_heads` query heads that read it (query head `h`
/// reads key/value head `h / 2` here), with rotary positions and biases on.
#[test]
fn grouped_query_attention_is_attention_with_repeated_key_value_heads() {
    let be = be();
    let gqa_cfg = llama(Activation::Gelu, true, Some(2), true);
    let mut gqa = Attention::new(&be, "attn", &gqa_cfg).unwrap();
    randomize(&be, gqa.params_mut());
    let mha_cfg = GptConfig {
        kv_heads: None,
        ..gqa_cfg
    };
    let mut mha = Attention::new(&be, "attn", &mha_cfg).unwrap();
    let hd = 2;
    // Column block `h` of the full projection is block `h / 2` of the shared one.
    let widen = |w: &[f32], rows: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * 4 * hd);
        for r in 0..rows {
            for h in 0..4 {
                let g = h / 2;
                out.extend_from_slice(&w[r * 2 * hd + g * hd..][..hd]);
            }
        }
        out
    };
    let host = |p: &Param<CpuBackend>| be.to_host(&p.value).unwrap();
    let set = |p: &mut Param<CpuBackend>, v: &[f32]| p.value = be.from_host(v, DType::F32).unwrap();
    set(&mut mha.wq, &host(&gqa.wq));
    set(&mut mha.wo, &host(&gqa.wo));
    set(&mut mha.wk, &widen(&host(&gqa.wk), 8));
    set(&mut mha.wv, &widen(&host(&gqa.wv), 8));
    let (gb, mb) = (gqa.bias.as_ref().unwrap(), mha.bias.as_mut().unwrap());
    set(&mut mb[0], &host(&gb[0]));
    set(&mut mb[1], &widen(&host(&gb[1]), 1));
    set(&mut mb[2], &widen(&host(&gb[2]), 1));
    let x = be
        .from_host(&normal(1, "x", BATCH * SEQ * 8, 1.0), DType::F32)
        .unwrap();
    let a = be
        .to_host(&gqa.forward(&be, 0, &x, SHAPE).unwrap())
        .unwrap();
    let b = be
        .to_host(&mha.forward(&be, 0, &x, SHAPE).unwrap())
        .unwrap();
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(
        err < 1e-5,
        "grouped-query vs repeated heads differ by {err}"
    );
    assert!(a.iter().any(|&v| v.abs() > 1e-3), "a vanishing output");
}

#[test]
fn embedding_weight_gradients() {
    let be = be();
    let cfg = config(Activation::Gelu);
    let mut emb = Embedding::new(&be, "embed", &cfg).unwrap();
    randomize(&be, emb.params_mut());
    let ids = [1u32, 3, 3, 0, 6, 1, 2, 3]; // repeated ids exercise the scatter-add
    let dy = normal(2, "dy", ids.len() * 8, 1.0);
    let dyb = be.from_host(&dy, DType::F32).unwrap();
    check_weights(
        &be,
        &mut emb,
        |e| e.params_mut(),
        |e| {
            e.forward(&be, 0, &ids, BATCH, SEQ).unwrap();
            e.backward_input(&be, 0, &dyb).unwrap();
            assert!(
                be.to_host(&e.tok.grad).unwrap().iter().all(|&g| g == 0.0),
                "I touched W"
            );
            e.backward_weight(&be, 0).unwrap();
        },
        |e| {
            let y = e.forward(&be, 1, &ids, BATCH, SEQ).unwrap();
            e.discard(1);
            dot(&be, &y, &dy)
        },
    );
    // Rows of `pos` past the sequence length get no gradient.
    let pos = be.to_host(&emb.pos.as_ref().unwrap().grad).unwrap();
    assert!(pos[SEQ * 8..].iter().all(|&g| g == 0.0));
}

#[test]
fn head_and_loss_input_and_weight_gradients() {
    let be = be();
    let cfg = config(Activation::Gelu);
    let mut head = Head::new(&be, "head", &cfg).unwrap();
    randomize(&be, head.params_mut());
    let rows = BATCH * SEQ;
    let x = normal(1, "x", rows * 8, 1.0);
    let targets = [0u32, 6, 2, crate::tensor::IGNORE_TARGET, 2, 5, 1, 3];
    let scale = 0.7;
    let xb = be.from_host(&x, DType::F32).unwrap();
    let (_, count) = head.forward(&be, 0, &xb, &targets, true).unwrap();
    assert_eq!(count, 7);
    let dx = be
        .to_host(&head.backward_input(&be, 0, scale).unwrap())
        .unwrap();
    let loss_at = |head: &mut Head<CpuBackend>, x: &CpuBuf| {
        let (loss, _) = head.forward(&be, 1, x, &targets, true).unwrap();
        head.discard(1);
        f64::from(scale) * f64::from(loss)
    };
    let num = numeric(&x, |x| {
        loss_at(&mut head, &be.from_host(x, DType::F32).unwrap())
    });
    assert_grad("head dx", &dx, &num);
    head.backward_weight(&be, 0).unwrap();
    check_weights(
        &be,
        &mut head,
        |h| h.params_mut(),
        |_| {},
        |h| loss_at(h, &xb),
    );
}

#[test]
fn out_of_order_calls_are_errors() {
    let be = be();
    let mut mlp = Mlp::new(&be, "blocks.0.mlp", &config(Activation::Gelu)).unwrap();
    let err = mlp.backward_weight(&be, 3).unwrap_err().to_string();
    assert!(
        err.contains("blocks.0.mlp") && err.contains("micro-batch 3"),
        "{err}"
    );
    let dy = be.zeros(8 * 8, DType::F32).unwrap();
    assert!(mlp.backward_input(&be, 0, &dy).is_err());
}
