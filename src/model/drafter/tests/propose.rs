//! Proposals through the packed host weights ([`super::super::packed`]): they equal the
//! backend GEMM's proposals (in f32, and in half precision those of the weights rounded to
//! f16), do not depend on the batch or on what the memo holds, and follow every weight
//! change.

use super::*;
use crate::model::infer::rowmul::Precision;

/// A drafter of `cfg` with weights at scale 0.3 (norm gains around 1), so that logits are
/// far apart and a greedy draft is not decided by rounding.
pub(in crate::model::drafter) fn drafter(
    cfg: &GptConfig,
    window: usize,
    seed: u64,
) -> Drafter<CpuBackend> {
    let dc = DrafterConfig {
        window,
        ..DrafterConfig::default()
    };
    let be = be();
    let mut d = Drafter::new(cfg, &dc, be.clone()).unwrap();
    for p in d.params_mut() {
        let mut v = normal(seed, &p.name, p.numel(), 0.3);
        if p.name.contains("norm") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        p.value = be.from_host(&v, DType::F32).unwrap();
    }
    let n = cfg.vocab * cfg.d_model;
    d.refresh("head.w", &normal(seed, "head", n, 0.3), 0)
        .unwrap();
    d.refresh("embed.tok", &normal(seed, "tok", n, 0.3), 0)
        .unwrap();
    d
}

/// `n` pairs of random hidden states and tokens.
pub(in crate::model::drafter) fn pairs(
    cfg: &GptConfig,
    n: usize,
    seed: u64,
) -> (Vec<f32>, Vec<u32>) {
    let hidden = normal(seed, "hidden", n * cfg.d_model, 1.0);
    let tokens = (0..n)
        .map(|i| ((i as u64 * 7 + seed * 3) % cfg.vocab as u64) as u32)
        .collect();
    (hidden, tokens)
}

/// `x` rounded to the nearest f16, as half-precision packing rounds it.
pub(super) fn to_half(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// Rounds what a proposal packs (every matrix and the head; not the norm gains, the q/k/v
/// biases nor the embedding, which stay f32) to f16 in `d`'s own weights.
fn round_packed_weights(d: &mut Drafter<CpuBackend>) {
    let be = be();
    for p in d.params_mut() {
        if p.shape.len() == 2 && !p.name.contains("norm") {
            let v = to_half(&be.to_host(&p.value).unwrap());
            p.value = be.from_host(&v, DType::F32).unwrap();
        }
    }
    let [_, head] = d.host_tables().unwrap();
    d.refresh("head.w", &to_half(&head), 0).unwrap();
}

pub(super) fn contexts<'a>(data: &'a [(Vec<f32>, Vec<u32>)]) -> Vec<DraftContext<'a>> {
    data.iter()
        .map(|(hidden, tokens)| DraftContext { hidden, tokens })
        .collect()
}

pub(super) fn shapes() -> Vec<GptConfig> {
    vec![
        tiny(),
        // Widths that are not multiples of a panel (8 columns): the padded last panel.
        GptConfig {
            vocab: 37,
            d_model: 12,
            heads: 3,
            mlp_ratio: 3,
            ..tiny()
        },
        GptConfig {
            vocab: 50,
            d_model: 64,
            heads: 4,
            mlp_ratio: 4,
            ..tiny()
        },
        llama(),
    ]
}

/// A Llama-shaped target: rotary positions with Llama 3's scaling, SwiGLU, 4 query heads
/// on 2 key/value heads, q/k/v biases (the drafter's block takes all of them).
pub(in crate::model::drafter) fn llama() -> GptConfig {
    GptConfig {
        vocab: 29,
        d_model: 32,
        heads: 4,
        kv_heads: Some(2),
        intermediate: Some(40),
        activation: crate::tensor::Activation::Swiglu,
        positions: crate::model::config::Positions::Rope,
        rope_theta: 500_000.0,
        rope_scaling: Some(crate::model::config::RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        qkv_bias: true,
        seq_len: 32,
        ..tiny()
    }
}

/// Each draft of a Llama-shaped drafter's chain is the training forward's prediction at
/// the last pair of its context: the context pairs, then for each earlier draft the pair
/// (predicted hidden state, drafted token), as the proposal feeds them. Within 1e-5 (f32
/// packing), for contexts shorter and longer than the window (cut to its last pairs).
#[test]
fn llama_chains_are_the_training_forward_of_their_context() {
    let cfg = llama();
    let (d, v, k, window) = (cfg.d_model, cfg.vocab, 4, 6);
    for n in [1, 4, 9] {
        let (hidden, tokens) = pairs(&cfg, n, n as u64);
        let mut dr = drafter(&cfg, window, 5);
        dr.set_proposal_precision(Precision::F32);
        let ctx = [DraftContext {
            hidden: &hidden,
            tokens: &tokens,
        }];
        let chain = dr.propose(&ctx, k, 0.0, &mut SplitMix64::new(1)).unwrap();
        let from = n.saturating_sub(window);
        let mut pairs: Vec<(u32, Vec<f32>)> = (from..n)
            .map(|i| (tokens[i], hidden[i * d..(i + 1) * d].to_vec()))
            .collect();
        for j in 0..k {
            let seq = pairs.len();
            let mut inputs = Vec::with_capacity(seq * 2 * d);
            for (t, h) in &pairs {
                inputs.extend_from_slice(&dr.embed_rows(&[*t]).unwrap());
                inputs.extend_from_slice(h);
            }
            let batch = DraftBatch {
                batch: 1,
                seq,
                inputs,
                target_hidden: vec![0.0; seq * d],
                target_probs: vec![0.0; seq * v],
                mask: vec![false; seq],
            };
            let (f, z) = dr.forward(9, &batch).unwrap();
            dr.discard(9);
            let (f, z) = (be().to_host(&f).unwrap(), be().to_host(&z).unwrap());
            let z = &z[(seq - 1) * v..seq * v];
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|x| (x - max).exp()).sum();
            let q = &chain[0].probs[j * v..(j + 1) * v];
            for (&zj, &qj) in z.iter().zip(q) {
                let diff = ((zj - max).exp() / sum - qj).abs();
                assert!(diff < 1e-5, "{n} pairs, draft {j}: q differs by {diff}");
            }
            let token = chain[0].tokens[j];
            assert_eq!(
                Some(token as usize),
                super::super::loss::argmax(z),
                "draft {j}"
            );
            pairs.push((token, f[(seq - 1) * d..seq * d].to_vec()));
        }
    }
}

#[test]
fn packed_proposals_equal_the_gemm_path_and_do_not_depend_on_the_batch() {
    for precision in [Precision::F32, Precision::F16] {
        packed_proposals_equal_the_gemm_path(precision);
    }
}

/// The packed path in `precision` against the backend's GEMM on the same weights (rounded
/// to f16 for [`Precision::F16`]): the same tokens, probabilities within 1e-5 (the GEMM
/// sums in another order).
fn packed_proposals_equal_the_gemm_path(precision: Precision) {
    for (s, cfg) in shapes().iter().enumerate() {
        let window = 6;
        // Lengths below, at and beyond the window (cut to its last 6 pairs).
        let lens = [1, 3, 6, 9, 3, 14];
        let data: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| pairs(cfg, n, 10 * s as u64 + i as u64))
            .collect();
        for batch in [1, 2, 6] {
            let ctx = contexts(&data[..batch]);
            for temperature in [0.0, 0.9] {
                let mut packed = drafter(cfg, window, 5);
                packed.set_proposal_precision(precision);
                let mut gemm = drafter(cfg, window, 5);
                if precision == Precision::F16 {
                    round_packed_weights(&mut gemm);
                }
                gemm.packs.gemm_only = true;
                let a = packed
                    .propose(&ctx, 4, temperature, &mut SplitMix64::new(1))
                    .unwrap();
                let b = gemm
                    .propose(&ctx, 4, temperature, &mut SplitMix64::new(1))
                    .unwrap();
                assert_eq!((packed.packs.packs(), gemm.packs.packs()), (1, 0));
                assert_eq!(gemm.packs.remembered(), 0);
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    let at = format!(
                        "{precision:?}, shape {s}, batch {batch}, t {temperature}, seq {i}"
                    );
                    assert_eq!(a.tokens, b.tokens, "{at}");
                    assert_eq!(a.probs.len(), 4 * cfg.vocab, "{at}");
                    let diff = a
                        .probs
                        .iter()
                        .zip(&b.probs)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0f32, f32::max);
                    assert!(diff < 1e-5, "{at}: probabilities differ by {diff}");
                }
                // Greedy: each sequence alone gives bitwise its batched chain.
                if temperature == 0.0 {
                    for (i, chain) in a.iter().enumerate() {
                        let mut fresh = drafter(cfg, window, 5);
                        fresh.set_proposal_precision(precision);
                        let alone = fresh
                            .propose(&ctx[i..=i], 4, 0.0, &mut SplitMix64::new(1))
                            .unwrap();
                        assert_eq!(&alone[0], chain, "shape {s}, batch {batch}, seq {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_memo_of_context_pairs_changes_no_bit() {
    the_memo_changes_no_bit(&shapes()[1]);
    // Rotary keys: the memo keeps them unrotated, the window's sliding moves their places.
    the_memo_changes_no_bit(&llama());
}

fn the_memo_changes_no_bit(cfg: &GptConfig) {
    let (hidden, tokens) = pairs(cfg, 12, 7);
    let d = cfg.d_model;
    let mut warm = drafter(cfg, 8, 2);
    let mut rng = SplitMix64::new(0);
    // The sequence grows by one or two pairs per proposal, as in a rollout: the warm
    // drafter recomputes only the new pairs, a fresh one all of them.
    for n in [3, 4, 6, 7, 9, 12, 12] {
        let ctx = [DraftContext {
            hidden: &hidden[..n * d],
            tokens: &tokens[..n],
        }];
        let got = warm.propose(&ctx, 3, 0.0, &mut rng).unwrap();
        let want = drafter(cfg, 8, 2).propose(&ctx, 3, 0.0, &mut rng).unwrap();
        assert_eq!(got, want, "{n} pairs");
        assert_eq!(warm.packs.packs(), 1, "packed once for all of them");
    }
    assert_eq!(
        warm.packs.remembered(),
        12,
        "each context pair remembered once"
    );
    // A pair with the same token but another hidden state is not taken for a known one.
    let mut other = hidden.clone();
    other[5 * d] += 1.0;
    let ctx = [DraftContext {
        hidden: &other[..9 * d],
        tokens: &tokens[..9],
    }];
    let got = warm.propose(&ctx, 3, 0.0, &mut rng).unwrap();
    let want = drafter(cfg, 8, 2).propose(&ctx, 3, 0.0, &mut rng).unwrap();
    assert_eq!(got, want);
}

/// A way to change a drafter's weights.
type Change<'a> = &'a dyn Fn(&mut Drafter<CpuBackend>);

#[test]
fn a_weight_change_between_proposals_is_packed_again() {
    let cfg = &shapes()[2];
    let be = be();
    let (hidden, tokens) = pairs(cfg, 5, 3);
    let ctx = [DraftContext {
        hidden: &hidden,
        tokens: &tokens,
    }];
    let mut rng = SplitMix64::new(0);
    let mut d = drafter(cfg, 32, 1);
    let first = d.propose(&ctx, 4, 0.0, &mut rng).unwrap();
    assert_eq!(d.propose(&ctx, 4, 0.0, &mut rng).unwrap(), first);
    assert_eq!(d.packs.packs(), 1);
    // Each way the weights change: the next proposal is a fresh drafter's with the new
    // weights, bit for bit.
    let other = drafter(cfg, 32, 9).weights(0).unwrap();
    let changes: [Change<'_>; 4] = [
        // An optimizer step writes through `params_mut`.
        &|d| {
            let p = &mut d.params_mut()[3];
            let mut v = be.to_host(&p.value).unwrap();
            v.iter_mut().for_each(|x| *x *= -1.5);
            p.value = be.from_host(&v, DType::F32).unwrap();
        },
        &|d| {
            let head = normal(4, "head2", cfg.d_model * cfg.vocab, 0.3);
            d.refresh("head.w", &head, 1).unwrap();
        },
        &|d| {
            let tok = normal(4, "tok2", cfg.d_model * cfg.vocab, 0.3);
            d.refresh("embed.tok", &tok, 1).unwrap();
        },
        &|d| d.load_weights(&other).unwrap(),
    ];
    let mut before = first;
    for (i, change) in changes.iter().enumerate() {
        change(&mut d);
        let got = d.propose(&ctx, 4, 0.0, &mut rng).unwrap();
        assert_eq!(d.packs.packs(), i as u64 + 2, "change {i}");
        let mut fresh = Drafter::new(cfg, d.config(), be.clone()).unwrap();
        fresh.load_weights(&d.weights(0).unwrap()).unwrap();
        fresh.share_frozen(&d.frozen()).unwrap();
        assert_eq!(
            got,
            fresh.propose(&ctx, 4, 0.0, &mut rng).unwrap(),
            "change {i}"
        );
        assert_ne!(
            got[0].probs, before[0].probs,
            "change {i} changed the drafts"
        );
        before = got;
    }
}

#[test]
fn matrices_are_packed_in_half_precision_unless_set_or_out_of_range() {
    let cfg = &shapes()[2];
    let (hidden, tokens) = pairs(cfg, 5, 3);
    let ctx = [DraftContext {
        hidden: &hidden,
        tokens: &tokens,
    }];
    let mut d = drafter(cfg, 32, 1);
    assert_eq!(d.proposal_precision(), Precision::F16);
    let all = |d: &mut Drafter<CpuBackend>| -> Vec<Precision> {
        d.packed_matrices()
            .unwrap()
            .iter()
            .map(|p| p.precision())
            .collect()
    };
    assert_eq!(all(&mut d), vec![Precision::F16; 7]);
    let half = d.propose(&ctx, 4, 0.0, &mut SplitMix64::new(0)).unwrap();
    // Setting f32 repacks (and forgets the memo); the drafts move by the rounding only.
    d.set_proposal_precision(Precision::F32);
    assert_eq!(all(&mut d), vec![Precision::F32; 7]);
    let full = d.propose(&ctx, 4, 0.0, &mut SplitMix64::new(0)).unwrap();
    assert_eq!(d.packs.packs(), 2);
    let diff = half[0]
        .probs
        .iter()
        .zip(&full[0].probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff > 0.0 && diff < 1e-2, "f16 moved q by {diff}");
    // A matrix with a weight f16 cannot hold stays in f32; the others are halved.
    d.set_proposal_precision(Precision::F16);
    let be = be();
    let p = &mut d.params_mut()[0];
    assert_eq!(p.name, "drafter.fc.w");
    let mut v = be.to_host(&p.value).unwrap();
    v[3] = 1e5;
    p.value = be.from_host(&v, DType::F32).unwrap();
    let mut want = vec![Precision::F16; 7];
    want[0] = Precision::F32;
    assert_eq!(all(&mut d), want);
}
