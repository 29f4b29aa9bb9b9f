//! Token embedding plus learned positions: `x[b, t] = tok[ids[b, t]] + pos[t]`; with rotary
//! positions (`positions = "rope"`, applied inside attention) only `x[b, t] = tok[ids[b, t]]`.
//!
//! The embedding has no input gradient (its input is token ids), so its I action only keeps
//! the output gradient, and its W action scatters it into the tables.

use super::{Stash, activation, keep};
use crate::model::ModelError;
use crate::model::config::Positions;
use crate::model::{GptConfig, Param, Result, init};
use crate::tensor::Backend;

struct Saved {
    ids: Vec<u32>,
    batch: usize,
    seq: usize,
}

/// `embed.tok: [vocab, d_model]` and, with learned positions, `embed.pos: [seq_len, d_model]`.
pub struct Embedding<B: Backend> {
    pub tok: Param<B>,
    pub pos: Option<Param<B>>,
    seq_len: usize,
    /// W needs the ids and the output gradient.
    stash: Stash<Saved, (Saved, B::Buf)>,
}

impl<B: Backend> Embedding<B> {
    pub fn new(be: &B, name: &str, config: &GptConfig) -> Result<Self> {
        let d = config.d_model;
        let mk = |w: &str, rows: usize| {
            let pname = format!("{name}.{w}");
            let values = init::normal(config.seed, &pname, rows * d, init::INIT_STD);
            Param::new(be, pname, vec![rows, d], &values, true)
        };
        Ok(Embedding {
            tok: mk("tok", config.vocab)?,
            pos: match config.positions {
                Positions::Learned => Some(mk("pos", config.seq_len)?),
                Positions::Rope => None,
            },
            seq_len: config.seq_len,
            stash: Stash::new(name),
        })
    }

    fn d(&self) -> usize {
        self.tok.shape[1]
    }

    /// Embeds `ids: [batch, seq]` into `[batch·seq, d_model]`.
    pub fn forward(
        &mut self,
        be: &B,
        mb: usize,
        ids: &[u32],
        batch: usize,
        seq: usize,
    ) -> Result<B::Buf> {
        let d = self.d();
        if seq > self.seq_len || ids.len() != batch * seq {
            return Err(ModelError::Input {
                stage: 0,
                mb,
                reason: format!(
                    "{} token ids for batch {batch} × seq {seq} (at most {} positions)",
                    ids.len(),
                    self.seq_len
                ),
            });
        }
        let x = activation(be, ids.len() * d, |x| {
            be.embedding_fwd(&self.tok.value, ids, x, d)?;
            if let Some(pos) = &self.pos {
                be.add_broadcast_rows(&pos.value, x, batch, seq * d)?;
            }
            Ok(())
        })?;
        self.stash.keep_for_i(
            mb,
            Saved {
                ids: ids.to_vec(),
                batch,
                seq,
            },
        );
        Ok(x)
    }

    /// I: nothing flows further back; keeps `dy` for W.
    pub fn backward_input(&mut self, be: &B, mb: usize, dy: &B::Buf) -> Result<()> {
        let s = self.stash.take_for_i(mb)?;
        self.stash.keep_for_w(mb, (s, keep(be, dy)?));
        Ok(())
    }

    /// W: scatter-adds into `tok`, sums over the batch into `pos`.
    pub fn backward_weight(&mut self, be: &B, mb: usize) -> Result<()> {
        let (s, dy) = self.stash.take_for_w(mb)?;
        let d = self.d();
        be.embedding_bwd(&s.ids, &dy, &mut self.tok.grad, d)?;
        if let Some(pos) = &mut self.pos {
            be.sum_rows(&dy, &mut pos.grad, s.batch, s.seq * d)?;
        }
        Ok(())
    }

    pub fn discard(&mut self, mb: usize) {
        self.stash.discard(mb);
    }

    pub fn stashed(&self) -> usize {
        self.stash.len()
    }

    pub fn params(&self) -> Vec<&Param<B>> {
        let mut v = vec![&self.tok];
        v.extend(self.pos.as_ref());
        v
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        let mut v = vec![&mut self.tok];
        v.extend(self.pos.as_mut());
        v
    }
}
