//! [`DraftBatch`]: sampled [`DraftRow`]s laid out as one drafter micro-batch.

use super::DraftRow;
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::tensor::IGNORE_TARGET;

/// `batch` sequences of `seq` pairs, padded at the end (a padded pair is masked; causal
/// attention keeps it from touching the real ones before it).
#[derive(Clone, Debug, PartialEq)]
pub struct DraftBatch {
    pub batch: usize,
    pub seq: usize,
    /// The fc input `[batch·seq, 2·d_model]`: each pair's token embedding, then its hidden state.
    pub inputs: Vec<f32>,
    /// The hidden state to predict `[batch·seq, d_model]`.
    pub target_hidden: Vec<f32>,
    /// The target's next-token distribution to match `[batch·seq, vocab]`: recomputed from
    /// `target_hidden` through the frozen head ([`super::Drafter::batch`]), 0 on masked pairs.
    pub target_probs: Vec<f32>,
    /// Which pairs count.
    pub mask: Vec<bool>,
}

impl DraftBatch {
    /// Errors unless `inputs` holds one `2·d_model` pair per row: the forward passes read it
    /// as a `[rows, 2·d_model]` matrix.
    pub(super) fn check_inputs(&self, d_model: usize) -> Result<(), ModelError> {
        let rows = self.rows();
        if self.inputs.len() == rows * 2 * d_model {
            return Ok(());
        }
        Err(ModelError::DrafterInput {
            what: "batch",
            reason: format!(
                "{} inputs for {rows} pairs of {}",
                self.inputs.len(),
                2 * d_model
            ),
        })
    }

    /// Lays out `rows` with the (frozen) embedding rows `embed` gathers (`[ids, d]` for
    /// `ids`, zeros for [`IGNORE_TARGET`]: [`super::Drafter::embed_rows`]), `target_probs`
    /// left empty (the drafter fills it, [`super::Drafter::batch`]). A row longer than
    /// `max_positions + 1` positions contributes a window of that many, starting where `rng`
    /// says (at 0 without `rng`).
    pub(super) fn layout(
        rows: &[DraftRow],
        d: usize,
        max_positions: usize,
        mut rng: Option<&mut SplitMix64>,
        embed: impl FnOnce(&[u32]) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        let windows: Vec<(usize, usize)> = rows
            .iter()
            .map(|r| {
                let w = r.len().min(max_positions.saturating_add(1));
                let start = match rng.as_mut() {
                    Some(rng) if r.len() > w => rng.below((r.len() - w + 1) as u64) as usize,
                    _ => 0,
                };
                (start, w)
            })
            .collect();
        let seq = windows
            .iter()
            .map(|&(_, w)| w.saturating_sub(1))
            .max()
            .unwrap_or(0)
            .max(1);
        let n = rows.len() * seq;
        let mut b = DraftBatch {
            batch: rows.len(),
            seq,
            inputs: vec![0.0; n * 2 * d],
            target_hidden: vec![0.0; n * d],
            target_probs: Vec::new(),
            mask: vec![false; n],
        };
        // Each laid-out pair's token (padding's is ignored), gathered in one call.
        let mut tokens = vec![IGNORE_TARGET; n];
        for (i, (row, &(start, w))) in rows.iter().zip(&windows).enumerate() {
            for j in 0..w.saturating_sub(1) {
                tokens[i * seq + j] = row.targets[start + j];
            }
        }
        let tok = embed(&tokens)?;
        for (x, e) in b.inputs.chunks_exact_mut(2 * d).zip(tok.chunks_exact(d)) {
            x[..d].copy_from_slice(e);
        }
        for (i, (row, &(start, w))) in rows.iter().zip(&windows).enumerate() {
            for j in 0..w.saturating_sub(1) {
                let (t, out) = (start + j, i * seq + j);
                let x = &mut b.inputs[out * 2 * d..(out + 1) * 2 * d];
                x[d..].copy_from_slice(&row.hidden[t * d..(t + 1) * d]);
                b.target_hidden[out * d..(out + 1) * d]
                    .copy_from_slice(&row.hidden[(t + 1) * d..(t + 2) * d]);
                b.mask[out] = row.pair_valid(t);
            }
        }
        Ok(b)
    }

    /// The shape `(rows, positions)` of a slice laid out in at most `pairs` layout rows
    /// (`batch · seq`, what a slice's cost grows with): the longest window first (up to
    /// `max_positions`), then as many rows as fit (up to `max_rows`); at least `(1, 1)`.
    pub fn shape_within(pairs: usize, max_rows: usize, max_positions: usize) -> (usize, usize) {
        let positions = pairs.clamp(1, max_positions.max(1));
        let rows = (pairs / positions).clamp(1, max_rows.max(1));
        (rows, positions)
    }

    /// Pairs that count.
    pub fn pairs(&self) -> usize {
        self.mask.iter().filter(|&&m| m).count()
    }

    /// Rows of the layout (`batch · seq`).
    pub fn rows(&self) -> usize {
        self.shape().tokens()
    }

    /// Its `batch` sequences of `seq` positions, as the target's layers take them.
    pub fn shape(&self) -> crate::model::Shape {
        crate::model::Shape {
            batch: self.batch,
            seq: self.seq,
        }
    }
}
