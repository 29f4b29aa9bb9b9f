//! A tied target's one frozen table read both ways (`frozen.rs`): against an untied drafter
//! given that table as its two, the same embedding rows, soft targets,
//! logits, gradients and proposals (bitwise where the products sum in the same order: the
//! packed head is the same panels), and half the bytes.

use super::propose::{contexts, drafter, llama, pairs, shapes, to_half};
use super::*;
use crate::model::infer::rowmul::Precision;
use crate::model::tie::transpose;

fn tied(cfg: &GptConfig) -> GptConfig {
    GptConfig {
        tie_embeddings: true,
        ..cfg.clone()
    }
}

/// An untied drafter and a tied one with the same weights and tables: the untied head is
/// the tied table.
fn twins(cfg: &GptConfig) -> (Drafter<CpuBackend>, Drafter<CpuBackend>) {
    let mut untied = drafter(cfg, 6, 5);
    let tied = drafter(&tied(cfg), 6, 5);
    let [tok, _] = tied.host_tables().unwrap();
    untied.refresh("head.w", &tok, 0).unwrap();
    (untied, tied)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

#[test]
fn a_tied_target_holds_one_table_read_both_ways() {
    let cfg = llama();
    let (v, d) = (cfg.vocab, cfg.d_model);
    let (untied, tied) = twins(&cfg);
    let (tu, tt) = (untied.frozen(), tied.frozen());
    assert!(tt.tied() && tt.tok.is_none() && !tu.tied());
    assert_eq!(tu.bytes(untied.backend()), 2 * 4 * v * d);
    assert_eq!(tt.bytes(tied.backend()), 4 * v * d, "one table");
    assert_eq!(tied.host_tables().unwrap(), untied.host_tables().unwrap());
    assert_eq!(
        tied.frozen_tensors().unwrap(),
        untied.frozen_tensors().unwrap()
    );
    let ids = [3, IGNORE_TARGET, 0, (v - 1) as u32, 3];
    let rows = tied.embed_rows(&ids).unwrap();
    assert_eq!(rows, untied.embed_rows(&ids).unwrap());
    assert!(rows[d..2 * d].iter().all(|&x| x == 0.0), "ignored: zeros");
    assert!(tied.embed_rows(&[]).unwrap().is_empty());
}

#[test]
fn a_tied_table_is_refreshed_from_either_copy() {
    let cfg = tied(&tiny());
    let (v, d) = (cfg.vocab, cfg.d_model);
    let tok = normal(9, "tok", v * d, 0.5);
    let mut a = drafter(&cfg, 6, 5);
    let mut b = drafter(&cfg, 6, 5);
    a.refresh("embed.tok", &tok, 4).unwrap();
    b.refresh("head.w", &tok, 4).unwrap();
    assert_eq!(a.host_tables().unwrap(), b.host_tables().unwrap());
    assert_eq!((a.frozen_step(), b.frozen_step()), (Some(4), Some(4)));
    // A wrong length is refused whichever copy brings it.
    let err = b.refresh("head.w", &tok[1..], 5).unwrap_err().to_string();
    assert!(err.contains("head.w"), "{err}");
    // A tied drafter does not read an untied drafter's two tables, nor the reverse.
    let untied = drafter(&tiny(), 6, 5);
    let err = a.share_frozen(&untied.frozen()).unwrap_err().to_string();
    assert!(err.contains("tied"), "{err}");
    let mut untied = untied;
    assert!(untied.share_frozen(&a.frozen()).is_err());
    // Loaded weights carrying both tables take them (the embedding's).
    let mut weights = a.weights(1).unwrap();
    weights.tensors.extend(a.frozen_tensors().unwrap());
    let mut c = drafter(&cfg, 6, 7);
    c.load_weights(&weights).unwrap();
    assert_eq!(c.host_tables().unwrap(), a.host_tables().unwrap());
}

/// A training batch through the tied table: the same inputs (gathered embedding rows),
/// soft targets, logits and gradients as through the two tables, within f32 rounding
/// (the head's products read the table transposed, which may sum in another order).
#[test]
fn training_reads_the_one_table_as_the_two() {
    for cfg in [llama(), shapes()[1].clone()] {
        let (mut untied, mut tied) = twins(&cfg);
        let mut rows = Vec::new();
        for (i, n) in [5usize, 3, 7].into_iter().enumerate() {
            let (hidden, mut targets) = pairs(&cfg, n, i as u64);
            targets[1] = IGNORE_TARGET;
            rows.push(DraftRow {
                hidden,
                targets,
                step: 0,
            });
        }
        let a = untied.batch(&rows, 6, None).unwrap();
        let b = tied.batch(&rows, 6, None).unwrap();
        assert_eq!(a.inputs, b.inputs, "the embedding rows");
        assert_eq!(a.mask, b.mask);
        assert!(max_diff(&a.target_probs, &b.target_probs) < 1e-6);
        let (fa, za) = untied.forward(0, &a).unwrap();
        let (fb, zb) = tied.forward(0, &a).unwrap();
        let host = |x| be().to_host(x).unwrap();
        assert_eq!(host(&fa), host(&fb), "the block does not read the tables");
        assert!(max_diff(&host(&za), &host(&zb)) < 1e-5);
        let (sa, ga) = untied.loss_grad(&a, &fa, &za).unwrap();
        let (sb, gb) = tied.loss_grad(&a, &fb, &zb).unwrap();
        assert!((sa.ce - sb.ce).abs() < 1e-4 * sa.ce.abs().max(1.0));
        assert_eq!(sa.pairs, sb.pairs);
        assert!(max_diff(&host(&ga), &host(&gb)) < 1e-5);
        assert_eq!(host(&ga).len(), a.rows() * cfg.d_model);
    }
}

/// Proposals: the packed head of the tied table is the same panels as the untied head's, so
/// the chains are bitwise the same, in f32 and f16, over the whole vocabulary and a draft
/// vocabulary; through the backend's GEMM (which reads the table transposed) the same tokens
/// and probabilities within 1e-5.
#[test]
fn proposals_read_the_one_table_as_the_two() {
    for cfg in [llama(), shapes()[1].clone()] {
        let data: Vec<_> = [1, 4, 9]
            .iter()
            .enumerate()
            .map(|(i, &n)| pairs(&cfg, n, i as u64))
            .collect();
        let ctx = contexts(&data);
        let draft: Vec<u32> = (0..cfg.vocab as u32).filter(|t| t % 3 != 1).collect();
        for vocab in [None, Some(draft.as_slice())] {
            for temperature in [0.0, 0.9] {
                let propose = |d: &mut Drafter<CpuBackend>| {
                    d.set_draft_vocab(vocab).unwrap();
                    d.propose(&ctx, 4, temperature, &mut SplitMix64::new(1))
                        .unwrap()
                };
                for precision in [Precision::F32, Precision::F16] {
                    let (mut untied, mut tied) = twins(&cfg);
                    untied.set_proposal_precision(precision);
                    tied.set_proposal_precision(precision);
                    let at = format!("{precision:?}, draft {}, t {temperature}", vocab.is_some());
                    assert_eq!(propose(&mut tied), propose(&mut untied), "{at}");
                }
                let (mut untied, mut tied) = twins(&cfg);
                untied.packs.gemm_only = true;
                tied.packs.gemm_only = true;
                let (a, b) = (propose(&mut untied), propose(&mut tied));
                for (a, b) in a.iter().zip(&b) {
                    assert_eq!(a.tokens, b.tokens);
                    assert!(max_diff(&a.probs, &b.probs) < 1e-5);
                }
            }
        }
    }
}

/// The f16 pack of the tied table is the f16 pack of the head: the proposal over the
/// rounded table (embedding rows kept f32) equals the packed one.
#[test]
fn the_tied_head_is_packed_from_the_table_transposed() {
    let cfg = tied(&llama());
    let mut d = drafter(&cfg, 6, 5);
    let packed = d.packed_matrices().unwrap();
    let [tok, head] = d.host_tables().unwrap();
    let (dm, v) = (cfg.d_model, cfg.vocab);
    let expected = crate::model::infer::rowmul::Packed::with_precision(
        &transpose(&head, v, dm),
        dm,
        v,
        Precision::F16,
    )
    .unwrap();
    let x = normal(2, "x", 3 * dm, 1.0);
    let rowmul = crate::model::infer::rowmul::rowmul;
    assert_eq!(rowmul(&x, &packed[6], 3), rowmul(&x, &expected, 3));
    // And the f16 product is the product by the rounded head.
    let rounded = to_half(&transpose(&tok, v, dm));
    let exact = crate::model::infer::rowmul::Packed::new(&rounded, dm, v);
    assert_eq!(rowmul(&x, &packed[6], 3), rowmul(&x, &exact, 3));
}
