//! Tree verification against plain decoding: every node's logits are those of decoding its
//! path one token at a time, and the compacted cache is the cache of the accepted path.

use super::*;
use crate::model::infer::{InferStage, Span, StageInput, StageOutput, run_stages};
use crate::model::{Cut, Gpt, GptConfig};
use crate::tensor::CpuBackend;

fn model() -> Gpt<CpuBackend> {
    let config = GptConfig {
        layers: 3,
        seq_len: 24,
        seed: 5,
        ..GptConfig::default()
    };
    Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

const PROMPT: [u32; 5] = [1, 17, 4, 33, 8];

/// Verification rows: root (token 9), then nodes; parents per row.
///   root ─ 1:12 ─ 3:7 ─ 6:2
///        ├ 2:40 ─ 4:7
///        │      └ 5:11
///        └ 7:3
const TOKENS: [u32; 8] = [9, 12, 40, 7, 7, 11, 2, 3];
const PARENTS: [usize; 8] = [0, 0, 0, 1, 2, 2, 3, 0];

fn stages(gpt: &Gpt<CpuBackend>) -> Vec<InferStage<CpuBackend>> {
    let layers = gpt.config().layers;
    InferStage::stages_of(gpt, &Cut::Layers(vec![layers - 1, 1])).unwrap()
}

/// `stages` after the prompt on slot 0.
fn prefilled(gpt: &Gpt<CpuBackend>) -> Vec<InferStage<CpuBackend>> {
    let mut s = stages(gpt);
    let span = Span {
        slot: 0,
        start: 0,
        len: PROMPT.len(),
    };
    run_stages(&mut s, &[span], &PROMPT).unwrap();
    s
}

/// Runs one step with `tree` through every stage.
fn run_tree(
    stages: &mut [InferStage<CpuBackend>],
    spans: &[Span],
    ids: &[u32],
    tree: &TreeStep,
) -> crate::model::Result<(Vec<f32>, Vec<f32>)> {
    let mut input = StageInput::Tokens(ids);
    for stage in stages.iter_mut() {
        match stage.forward_with(spans, Some(tree), input)? {
            StageOutput::Hidden(h) => input = StageInput::Hidden(h),
            StageOutput::Final { logits, hidden } => return Ok((logits, hidden)),
        }
    }
    unreachable!("the last stage holds the head")
}

/// Decodes `path` one token at a time after the prompt; the last step's logits.
fn decode_path(gpt: &Gpt<CpuBackend>, path: &[u32]) -> (Vec<f32>, Vec<InferStage<CpuBackend>>) {
    let mut s = prefilled(gpt);
    let mut last = Vec::new();
    for (i, &t) in path.iter().enumerate() {
        let span = Span {
            slot: 0,
            start: PROMPT.len() + i,
            len: 1,
        };
        last = run_stages(&mut s, &[span], &[t]).unwrap().0;
    }
    (last, s)
}

/// The tokens from the root down to row `r`.
fn path_to(r: usize) -> Vec<u32> {
    let mut rows = vec![r];
    while rows[0] != 0 {
        rows.insert(0, PARENTS[rows[0]]);
    }
    rows.iter().map(|&r| TOKENS[r]).collect()
}

/// Bitwise: the tree rows take the prefix and ancestor keys in decode order, and the
/// row products (`rowmul`) do not depend on how many rows share a call.
#[test]
fn every_node_sees_exactly_its_path() {
    every_node_sees_its_path(&model());
    // Rotary positions at each node's depth, grouped-query heads, SwiGLU, biases.
    every_node_sees_its_path(&crate::model::infer::tests::llama_model());
}

fn every_node_sees_its_path(gpt: &Gpt<CpuBackend>) {
    let vocab = gpt.config().vocab;
    let mut s = prefilled(gpt);
    let span = Span {
        slot: 0,
        start: PROMPT.len(),
        len: TOKENS.len(),
    };
    let step = TreeStep {
        parents: vec![Some(PARENTS.to_vec())],
        compact: Vec::new(),
    };
    let (logits, _) = run_tree(&mut s, &[span], &TOKENS, &step).unwrap();
    for r in 0..TOKENS.len() {
        let (want, _) = decode_path(gpt, &path_to(r));
        assert_eq!(&logits[r * vocab..][..vocab], &want[..], "row {r}");
    }
}

#[test]
fn compaction_leaves_the_cache_of_the_accepted_path() {
    compaction_leaves_the_accepted_path(model());
    compaction_leaves_the_accepted_path(crate::model::infer::tests::llama_model());
}

fn compaction_leaves_the_accepted_path(gpt: Gpt<CpuBackend>) {
    let mut s = prefilled(&gpt);
    let start = PROMPT.len();
    let span = Span {
        slot: 0,
        start,
        len: TOKENS.len(),
    };
    let step = TreeStep {
        parents: vec![Some(PARENTS.to_vec())],
        compact: Vec::new(),
    };
    run_tree(&mut s, &[span], &TOKENS, &step).unwrap();
    // Accept root → row 2 → row 5, then emit token 20 as the bonus.
    let keep = vec![0, 2, 5];
    let (_, plain) = decode_path(&gpt, &path_to(5));
    let next = TreeStep {
        parents: Vec::new(),
        compact: vec![Compaction {
            slot: 0,
            start,
            keep: keep.clone(),
        }],
    };
    let span = Span {
        slot: 0,
        start: start + keep.len(),
        len: 1,
    };
    let (got, _) = run_tree(&mut s, &[span], &[20], &next).unwrap();
    let mut plain = plain;
    let (want, _) = run_stages(&mut plain, &[span], &[20]).unwrap();
    assert_eq!(got, want, "the step after compaction");
    for (a, b) in s.iter().zip(&plain) {
        assert_eq!(a.cache().len(0), start + keep.len() + 1);
        for layer in 0..a.blocks().len() {
            assert_eq!(a.cache().layer(0, layer), b.cache().layer(0, layer));
        }
    }
}

#[test]
fn bad_trees_are_errors_and_leave_the_cache_alone() {
    let gpt = model();
    let mut s = prefilled(&gpt);
    let span = Span {
        slot: 0,
        start: PROMPT.len(),
        len: 3,
    };
    let bad =
        |parents: Vec<Option<Vec<usize>>>, compact: Vec<Compaction>| TreeStep { parents, compact };
    let cases = [
        (bad(vec![Some(vec![0, 0])], vec![]), "2 parents for 3 rows"),
        (bad(vec![Some(vec![0, 2, 0])], vec![]), "before its parent"),
        (bad(vec![Some(vec![1, 0, 0])], vec![]), "root"),
        (bad(vec![None, None], vec![]), "2 tree shapes for 1 spans"),
        (
            bad(
                vec![],
                vec![Compaction {
                    slot: 0,
                    start: 2,
                    keep: vec![0, 9],
                }],
            ),
            "cannot keep row 9",
        ),
        (
            bad(
                vec![],
                vec![Compaction {
                    slot: 0,
                    start: 1,
                    keep: vec![0],
                }],
            ),
            "resumes at 5",
        ),
    ];
    for (step, want) in cases {
        let err = s[0]
            .forward_with(&[span], Some(&step), StageInput::Tokens(&[1, 2, 3]))
            .err()
            .unwrap_or_else(|| panic!("{want}: accepted"));
        assert!(err.to_string().contains(want), "{want}: {err}");
        assert_eq!(s[0].cache().len(0), PROMPT.len());
    }
}
