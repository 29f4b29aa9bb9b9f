//! [`Drafter`]: the drafter's layers (`fc` and one decoder block), the frozen copies of the
//! target's token embedding and LM head, the loss, and its weights as a message
//! ([`DrafterWeights`]).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::loss::{argmax, smooth_l1, soft_cross_entropy, softmax_rows};
use super::{DraftBatch, DraftRow, DrafterConfig, FROZEN, FrozenTables, Linear, Result};
use crate::model::ModelError;
use crate::model::layers::{Attention, Block, Layer, Mlp, RmsNorm};
use crate::model::{GptConfig, Param, init};
use crate::tensor::{Backend, DType, Gemm};

/// One tensor by name, on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// A snapshot of a drafter's weights, trainable and frozen, that can be sent as a message
/// (to the rollout engine, or from an owner to replicas).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrafterWeights {
    /// Drafter optimizer steps taken when the snapshot was made.
    pub version: u64,
    /// Target step of the frozen copies' last refresh (`None`: the target's initial values).
    pub frozen_step: Option<u64>,
    pub tensors: Vec<NamedTensor>,
}

/// Loss sums of one forward (unweighted, summed over the counted pairs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSums {
    /// Σ soft cross-entropy.
    pub ce: f64,
    /// Σ mean-over-elements SmoothL1.
    pub hidden: f64,
    /// Pairs counted.
    pub pairs: usize,
    /// Pairs whose drafter argmax equals the target's argmax.
    pub agree: usize,
}

/// The drafter of a target model of shape `target` (see the module docs for the model).
pub struct Drafter<B: Backend> {
    pub(super) be: B,
    pub(super) target: GptConfig,
    pub(super) config: DrafterConfig,
    pub(super) fc: Linear<B>,
    pub(super) block: Block<B>,
    /// The target's frozen `embed.tok` and `head.w`, shared with the process's other
    /// drafters ([`super::frozen`]).
    pub(super) frozen: FrozenTables<B>,
    /// The reduced draft vocabulary of proposals, if set ([`super::vocab`]).
    pub(super) draft: Option<super::vocab::DraftVocab<B>>,
    /// The proposal's packed weights and memo: dropped by every `&mut` path to the weights.
    pub(super) packs: super::packed::PackCache,
}

impl<B: Backend> Drafter<B> {
    /// A drafter initialised from `config.seed`, its frozen tables equal to the target's
    /// initial `embed.tok` and `head.w` until the first refresh.
    pub fn new(target: &GptConfig, config: &DrafterConfig, be: B) -> Result<Self> {
        target.validate()?;
        let (d, v) = (target.d_model, target.vocab);
        let tok = init::normal(target.seed, FROZEN[0], v * d, init::INIT_STD);
        // A tied target's head starts as its embedding's draw (`layers/head.rs`): one table.
        let frozen = match target.tie_embeddings {
            true => FrozenTables {
                head: Arc::new(be.from_host(&tok, be.storage_dtype())?),
                tok: None,
                step: None,
            },
            false => FrozenTables {
                head: Arc::new(be.from_host(
                    &crate::model::layers::initial_values(target, FROZEN[1]),
                    be.storage_dtype(),
                )?),
                tok: Some(Arc::new(tok)),
                step: None,
            },
        };
        Drafter::sharing(target, config, be, &frozen)
    }

    /// A drafter initialised from `config.seed` that reads `tables` (another drafter's of
    /// this process, on memory `be` reads: see [`Drafter::share_frozen`]), without drawing
    /// tables of its own.
    pub fn sharing(
        target: &GptConfig,
        config: &DrafterConfig,
        be: B,
        tables: &FrozenTables<B>,
    ) -> Result<Self> {
        target.validate()?;
        config.validate()?;
        let d = target.d_model;
        let shape = GptConfig {
            seed: config.seed,
            ..target.clone()
        };
        let block = Block {
            norm1: RmsNorm::new(&be, "drafter.block.norm1", d, target.norm_eps)?,
            attn: Attention::new(&be, "drafter.block.attn", &shape)?,
            norm2: RmsNorm::new(&be, "drafter.block.norm2", d, target.norm_eps)?,
            mlp: Mlp::new(&be, "drafter.block.mlp", &shape)?,
        };
        let mut drafter = Drafter {
            fc: Linear::new(&be, "drafter.fc", 2 * d, d, config.seed)?,
            block,
            frozen: tables.clone(),
            draft: None,
            packs: Default::default(),
            target: target.clone(),
            config: config.clone(),
            be,
        };
        drafter.share_frozen(tables)?;
        Ok(drafter)
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.config
    }

    /// The target model's shape.
    pub fn target_config(&self) -> &GptConfig {
        &self.target
    }

    pub fn backend(&self) -> &B {
        &self.be
    }

    /// The trainable parameters (`drafter.fc.w`, then the block's).
    pub fn params(&self) -> Vec<&Param<B>> {
        let mut v = self.fc.params();
        v.extend(self.block.params());
        v
    }

    /// The trainable parameters, to change: the proposal's packed copies are dropped.
    pub fn params_mut(&mut self) -> Vec<&mut Param<B>> {
        self.packs.invalidate();
        let mut v = self.fc.params_mut();
        v.extend(self.block.params_mut());
        v
    }

    /// F: the predicted hidden states `[rows, d]` and the logits `[rows, vocab]` of `batch`.
    pub fn forward(&mut self, mb: usize, batch: &DraftBatch) -> Result<(B::Buf, B::Buf)> {
        let be = self.be.clone();
        let (d, rows) = (self.target.d_model, batch.rows());
        batch.check_inputs(d)?;
        let x = be.from_host(&batch.inputs, be.storage_dtype())?;
        let result = (|| {
            let z = self.fc.forward(&be, mb, &x, rows)?;
            let f = self.block.forward(&be, mb, &z, batch.shape())?;
            let logits = self.logits(&f, rows)?;
            Ok((f, logits))
        })();
        if result.is_err() {
            self.discard(mb);
        }
        result
    }

    /// `rows` laid out as a batch ([`DraftBatch`]) with its soft targets: each pair's next-token
    /// distribution `softmax(h_{t+1} · W_head)` through the frozen head, as the target's own
    /// head computed it from the same hidden state (the buffer keeps no distributions). The
    /// head is the one of the last refresh: a previous step's row is scored by the newer head.
    pub fn batch(
        &self,
        rows: &[DraftRow],
        max_positions: usize,
        rng: Option<&mut crate::data::SplitMix64>,
    ) -> Result<DraftBatch> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        for r in rows {
            r.check(d, v)?;
        }
        let mut batch =
            DraftBatch::layout(rows, d, max_positions, rng, |ids| self.embed_rows(ids))?;
        let h = self
            .be
            .from_host(&batch.target_hidden, self.be.storage_dtype())?;
        let mut probs = self.be.to_host(&self.logits(&h, batch.rows())?)?;
        softmax_rows(&mut probs, &batch.mask, v);
        batch.target_probs = probs;
        Ok(batch)
    }

    /// The target's greedy token after each position of `row` (argmax of `h_t · W_head`
    /// through the frozen head).
    pub fn target_argmax(&self, row: &DraftRow) -> Result<Vec<usize>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        row.check(d, v)?;
        let h = self.be.from_host(&row.hidden, self.be.storage_dtype())?;
        let z = self.be.to_host(&self.logits(&h, row.len())?)?;
        Ok(z.chunks(v).map(|r| argmax(r).unwrap_or(0)).collect())
    }

    /// `logits = f · W_head` for `f: [rows, d]` (nothing stashed).
    pub fn logits(&self, f: &B::Buf, rows: usize) -> Result<B::Buf> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        let mut logits = self.be.zeros(rows * v, self.be.storage_dtype())?;
        let g = self.frozen.by_head(Gemm::nn(rows, d, v));
        self.be.matmul(f, &self.frozen.head, &mut logits, g)?;
        Ok(logits)
    }

    /// The loss sums of a forward's outputs and the gradient of their weighted sum
    /// (`ce_weight · Σ CE + hidden_weight · Σ SmoothL1`) w.r.t. the predicted hidden states.
    pub fn loss_grad(
        &self,
        batch: &DraftBatch,
        f: &B::Buf,
        logits: &B::Buf,
    ) -> Result<(LossSums, B::Buf)> {
        self.loss_grad_weighted(batch, f, logits, 1.0)
    }

    /// [`Drafter::loss_grad`] with the gradient scaled by `weight` (an unrolled step's, see
    /// [`super::DrafterConfig::unroll_decay`]); the sums stay unweighted.
    pub(super) fn loss_grad_weighted(
        &self,
        batch: &DraftBatch,
        f: &B::Buf,
        logits: &B::Buf,
        weight: f32,
    ) -> Result<(LossSums, B::Buf)> {
        let be = &self.be;
        let (d, v, rows) = (self.target.d_model, self.target.vocab, batch.rows());
        let c = &self.config;
        let (f_host, z_host) = (be.to_host(f)?, be.to_host(logits)?);
        let mut df = vec![0.0; rows * d];
        let hidden = smooth_l1(
            &f_host,
            &batch.target_hidden,
            &batch.mask,
            d,
            c.advanced.smooth_l1_beta,
            c.hidden_weight * weight,
            &mut df,
        );
        let mut dz = vec![0.0; rows * v];
        let ce = soft_cross_entropy(
            &z_host,
            &batch.target_probs,
            &batch.mask,
            v,
            c.ce_weight * weight,
            &mut dz,
        );
        let agree = (0..rows)
            .filter(|&r| batch.mask[r])
            .filter(|&r| {
                let span = r * v..(r + 1) * v;
                argmax(&z_host[span.clone()]) == argmax(&batch.target_probs[span])
            })
            .count();
        let mut dfeat = be.from_host(&df, DType::F32)?;
        let dz = be.from_host(&dz, DType::F32)?;
        be.matmul(
            &dz,
            &self.frozen.head,
            &mut dfeat,
            self.frozen
                .by_head(Gemm::nn(rows, v, d).trans_b().accumulate()),
        )?;
        let sums = LossSums {
            ce,
            hidden,
            pairs: batch.pairs(),
            agree,
        };
        Ok((sums, dfeat))
    }

    /// I: from the gradient w.r.t. the predicted hidden states through the block into fc
    /// (whose input is data, so nothing flows further).
    pub fn backward_input(&mut self, mb: usize, dfeat: &B::Buf) -> Result<()> {
        let be = self.be.clone();
        let dz = self.block.backward_input(&be, mb, dfeat)?;
        self.fc.backward_input(&be, mb, &dz, false)?;
        Ok(())
    }

    /// W: accumulates the weight gradients of micro-batch `mb`.
    pub fn backward_weight(&mut self, mb: usize) -> Result<()> {
        let be = self.be.clone();
        self.block.backward_weight(&be, mb)?;
        self.fc.backward_weight(&be, mb)?;
        Ok(())
    }

    /// Forgets micro-batch `mb`.
    pub fn discard(&mut self, mb: usize) {
        self.fc.discard(mb);
        self.block.discard(mb);
    }

    /// Layer stashes held (0 when no micro-batch is in flight).
    pub fn stashed(&self) -> usize {
        self.fc.stashed() + self.block.stashed()
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) -> Result<()> {
        let be = self.be.clone();
        for p in self.params_mut() {
            be.fill(&mut p.grad, 0.0)?;
        }
        Ok(())
    }

    /// The trainable weights as a message versioned `version`, with the frozen tables' step
    /// but not the tables: whoever loads them holds the target they come from.
    pub fn weights(&self, version: u64) -> Result<DrafterWeights> {
        let be = &self.be;
        let mut tensors = Vec::new();
        for p in self.params() {
            tensors.push(NamedTensor {
                name: p.name.clone(),
                shape: p.shape.clone(),
                values: be.to_host(&p.value)?,
            });
        }
        Ok(DrafterWeights {
            version,
            frozen_step: self.frozen.step,
            tensors,
        })
    }

    /// The frozen tables as named tensors (`embed.tok`, `head.w`), for the one case where
    /// they must travel with the weights: a checkpoint whose tables lag the target's own
    /// values (see `pipeline/fill/state.rs`).
    pub fn frozen_tensors(&self) -> Result<Vec<NamedTensor>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        let [tok, head] = self.host_tables()?;
        Ok(vec![
            NamedTensor {
                name: FROZEN[0].into(),
                shape: vec![v, d],
                values: tok,
            },
            NamedTensor {
                name: FROZEN[1].into(),
                shape: vec![v, d],
                values: head,
            },
        ])
    }

    /// Loads a snapshot made by [`Drafter::weights`] of a drafter of the same shape: every
    /// trainable tensor must be present once, known and of the right length. The frozen
    /// tables stay those this drafter holds (refreshed from its target), unless the snapshot
    /// carries both (a file written before the tables were shared, or tables that lag the
    /// target's checkpoint): then those, checked, with their step.
    pub fn load_weights(&mut self, weights: &DrafterWeights) -> Result<()> {
        let be = self.be.clone();
        let missing = |name: &str| ModelError::DrafterInput {
            what: "weights",
            reason: format!("no `{name}`"),
        };
        let find = |name: &str| weights.tensors.iter().find(|t| t.name == name);
        let frozen: Vec<&NamedTensor> = FROZEN.iter().filter_map(|&n| find(n)).collect();
        if frozen.len() == 1 {
            let (has, lacks) = match frozen[0].name == FROZEN[0] {
                true => (FROZEN[0], FROZEN[1]),
                false => (FROZEN[1], FROZEN[0]),
            };
            return Err(ModelError::DrafterInput {
                what: "weights",
                reason: format!("`{has}` without `{lacks}`: the frozen tables come as a pair"),
            });
        }
        let expected = self.params().len() + frozen.len();
        if weights.tensors.len() != expected {
            return Err(ModelError::DrafterInput {
                what: "weights",
                reason: format!("{} tensors, expected {expected}", weights.tensors.len()),
            });
        }
        // Every check first, so a bad snapshot leaves the drafter as it was.
        let mut values = Vec::with_capacity(expected);
        for p in self.params() {
            let t = find(&p.name).ok_or_else(|| missing(&p.name))?;
            if t.values.len() != p.numel() {
                let (name, expected, got) = (t.name.clone(), p.numel(), t.values.len());
                return Err(ModelError::ParamLen {
                    name,
                    expected,
                    got,
                });
            }
            values.push(&t.values);
        }
        let size = self.target.vocab * self.target.d_model;
        if let Some(t) = frozen.iter().find(|t| t.values.len() != size) {
            let (name, got) = (t.name.clone(), t.values.len());
            return Err(ModelError::ParamLen {
                name,
                expected: size,
                got,
            });
        }
        for (p, v) in self.params_mut().into_iter().zip(values) {
            p.value = be.from_host(v, be.dtype(&p.value))?;
        }
        for t in &frozen {
            if self.takes(&t.name, true) {
                self.refresh(&t.name, &t.values, 0)?;
            }
        }
        if !frozen.is_empty() {
            self.frozen.step = weights.frozen_step;
        }
        Ok(())
    }
}

impl<B: Backend> std::fmt::Debug for Drafter<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drafter")
            .field("d_model", &self.target.d_model)
            .field("vocab", &self.target.vocab)
            .field("frozen_step", &self.frozen.step)
            .field("stashed", &self.stashed())
            .finish()
    }
}
