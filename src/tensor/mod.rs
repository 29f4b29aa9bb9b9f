//! Tensors: the [`Backend`] trait, and its implementations.
//!
//! The model never touches numbers directly: it holds opaque device buffers
//! ([`Backend::Buf`]) and asks its backend to run coarse operations on them (one matrix product,
//! one RMSNorm, one attention, …). That keeps the kernels apart from the model code and lets a
//! device backend (CUDA, feature `cuda`) keep every tensor on the device and run each operation
//! as a single kernel or cuBLAS call. Host copies happen only through [`Backend::from_host`] and
//! [`Backend::to_host`] (values as `f32`), and [`Backend::from_host_bytes`] and
//! [`Backend::to_host_bytes`] (the storage's own bytes, for byte transports: `bytes.rs`).
//!
//! Conventions shared by every operation:
//! - A buffer is a flat array of `f32` values (its *storage* may be `bf16`, see [`DType`]);
//!   matrices are **row-major**: a `[rows, cols]` matrix stores row `r` at `r * cols ..`.
//! - Shapes are passed explicitly; a backend checks every buffer length against them and
//!   returns [`TensorError::Shape`] naming the operation and the operand on a mismatch. These
//!   checks are written once, per operation, in `check.rs` and called by every backend.
//! - Outputs are **overwritten** unless the operation says it *accumulates* (`+=`).
//! - Arithmetic is `f32`; `bf16` buffers are widened on read and rounded on write.
//! - Activations use the `[batch, seq, d]` layout, so an `[N = batch·seq, d]` matrix; attention
//!   heads are interleaved in `d` as `[batch, seq, heads, head_dim]`.

mod bytes;
mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;

pub use cpu::{CpuBackend, CpuBuf};
pub use error::TensorError;

use serde::{Deserialize, Serialize};

/// Result of a tensor operation.
pub type Result<T> = std::result::Result<T, TensorError>;

/// Storage type of a buffer. Arithmetic is always `f32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    #[default]
    F32,
    /// bfloat16: half the memory, 8 bits of mantissa; values are rounded to nearest-even on write.
    Bf16,
}

impl DType {
    /// Bytes one stored value takes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    /// The name a job file and a message use (`f32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// Elementwise non-linearity of the MLP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    #[default]
    Gelu,
    /// SiLU (swish): `x·σ(x)`.
    Silu,
    /// SwiGLU, Llama's gated MLP `(silu(x·W1) ∘ (x·W3))·W2`. As an elementwise non-linearity
    /// (what [`Backend::activation_fwd`] applies to the gate) it is SiLU.
    Swiglu,
}

impl Activation {
    /// Whether the MLP is gated (a third, "up", projection multiplies the activation).
    pub fn is_gated(self) -> bool {
        self == Activation::Swiglu
    }
}

/// One matrix product `C (+)= op(A) · op(B)`, all row-major.
///
/// `op(A)` is `[m, k]`: `A` is stored `[m, k]`, or `[k, m]` when `trans_a`.
/// `op(B)` is `[k, n]`: `B` is stored `[k, n]`, or `[n, k]` when `trans_b`.
/// `C` is `[m, n]`; it is overwritten, or added to when `accumulate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub accumulate: bool,
}

impl Gemm {
    /// `C = A · B` with `A: [m, k]`, `B: [k, n]`.
    pub fn nn(m: usize, k: usize, n: usize) -> Self {
        Gemm {
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        }
    }
    /// Same product, with `A` given transposed (`[k, m]` in memory).
    pub fn trans_a(mut self) -> Self {
        self.trans_a = true;
        self
    }
    /// Same product, with `B` given transposed (`[n, k]` in memory).
    pub fn trans_b(mut self) -> Self {
        self.trans_b = true;
        self
    }
    /// Add into `C` instead of overwriting it.
    pub fn accumulate(mut self) -> Self {
        self.accumulate = true;
        self
    }
}

/// `batch` independent products of the same [`Gemm`] shape; product `i` reads `A` at element
/// offset `i·stride_a`, `B` at `i·stride_b` and writes `C` at `i·stride_c` (cuBLAS
/// "strided batched"). A stride of 0 broadcasts `A` or `B`; `stride_c = 0` (every product
/// summed into one output) is allowed only with `accumulate`, and is an error otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchedGemm {
    pub gemm: Gemm,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

/// Shape of a causal multi-head attention over `[batch, seq, heads, head_dim]` tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Elements of one of `q`, `k`, `v`, `out`: `batch·seq·heads·head_dim`.
    pub fn qkv_len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }
    /// Elements of the saved probabilities `[batch, heads, seq, seq]`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }
}

/// Hyper-parameters of one AdamW update (decoupled weight decay, bias-corrected moments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled decay: `p -= lr·weight_decay·p` (0 for parameters that are not decayed).
    pub weight_decay: f32,
    /// 1-based step number, for the bias corrections `1 − βᵗ`.
    pub step: u64,
    /// Multiplies the gradient before use (global-norm clipping, loss scaling); 1 for none.
    pub grad_scale: f32,
}

/// Token ids standing for "no target here": the position adds nothing to the loss.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// The operations a GPT needs forward and backward, over device buffers.
///
/// Every method checks its operands' lengths against the shape it is given. Unless a method
/// says otherwise, output buffers are overwritten and must not alias inputs (the borrow
/// checker enforces this).
pub trait Backend: Clone + Send + Sync + 'static {
    /// A device buffer of `f32` values (storage type [`DType`]). `Sync` so that a buffer
    /// nobody writes (the drafter's frozen tables) can be read through an `Arc` by several
    /// owners.
    type Buf: Send + Sync + 'static;

    /// Human-readable name of the device ("cpu (2 threads)", "cuda:0 (H100)").
    fn name(&self) -> String;

    /// Storage type the model should use for parameters and stashed activations
    /// (gradients, optimizer moments and master weights are always `f32`).
    fn storage_dtype(&self) -> DType;

    // ---- memory -------------------------------------------------------------------------

    /// A new buffer of `len` zeros.
    fn zeros(&self, len: usize, dtype: DType) -> Result<Self::Buf>;
    /// A new buffer of `len` values for operations to overwrite whole: its values are
    /// unspecified until then, so a backend need not zero it (zeroing a step's new outputs
    /// was 4% of a SmolLM-135M-shaped step on the CPU, docs/benchmarks.md). The default is
    /// [`Backend::zeros`].
    ///
    /// # Safety
    /// Every element is written, by operations that overwrite their output (not
    /// accumulate into it), before anything reads the buffer.
    unsafe fn uninit(&self, len: usize, dtype: DType) -> Result<Self::Buf> {
        self.zeros(len, dtype)
    }
    /// A new buffer holding `data` (rounded to `dtype`).
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, data: &[f32], dtype: DType) -> Result<Self::Buf>;
    /// [`Backend::from_host`] of values no longer needed on the host: a backend whose
    /// buffers are host memory keeps `f32` values without a copy.
    #[allow(clippy::wrong_self_convention)]
    fn from_host_vec(&self, data: Vec<f32>, dtype: DType) -> Result<Self::Buf> {
        self.from_host(&data, dtype)
    }
    /// The buffer's values, widened to `f32`.
    fn to_host(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// The buffer's storage as little-endian bytes, each value as it is stored: 4 bytes an
    /// `f32`, the 2-byte bits of a `bf16` (never widened). What a byte transport sends.
    fn to_host_bytes(&self, buf: &Self::Buf) -> Result<Vec<u8>>;
    /// A new buffer of `dtype` holding `bytes` as [`Backend::to_host_bytes`] gives them
    /// (no rounding: the values are the stored ones). A length that is not a whole number
    /// of `dtype` values is [`TensorError::Invalid`].
    #[allow(clippy::wrong_self_convention)]
    fn from_host_bytes(&self, bytes: &[u8], dtype: DType) -> Result<Self::Buf>;
    /// Number of elements.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Storage type.
    fn dtype(&self, buf: &Self::Buf) -> DType;
    /// `dst = src` (converting storage type); lengths must match.
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;
    /// Every element of `buf` set to `value`.
    fn fill(&self, buf: &mut Self::Buf, value: f32) -> Result<()>;

    /// Whether a buffer made by `other` can be read by this backend's operations as they
    /// are ordered (the same memory and, on a GPU, the same stream), so that one copy of a
    /// read-only buffer serves both. The default, `false`, is always safe.
    fn shares_buffers_with(&self, other: &Self) -> bool {
        let _ = other;
        false
    }

    /// `dst[dst_at..dst_at + len] = src[src_at..src_at + len]`, both of one storage type: a
    /// range of rows of a row-major matrix (the fused LM head's chunks of tokens).
    fn copy_range(
        &self,
        src: &Self::Buf,
        src_at: usize,
        dst: &mut Self::Buf,
        dst_at: usize,
        len: usize,
    ) -> Result<()>;

    /// A new buffer with the same values and storage type as `src`.
    fn dup(&self, src: &Self::Buf) -> Result<Self::Buf> {
        // SAFETY: `copy` overwrites every element before the buffer is returned.
        let mut out = unsafe { self.uninit(self.len(src), self.dtype(src))? };
        self.copy(src, &mut out)?;
        Ok(out)
    }

    /// [`Backend::to_host`] of a buffer no longer needed: a backend whose buffers are host
    /// memory hands the `f32` values over without a copy (the end of a run, where a copy
    /// of the whole state would be the run's peak).
    fn take_host(&self, buf: Self::Buf) -> Result<Vec<f32>> {
        self.to_host(&buf)
    }

    // ---- matrix products ----------------------------------------------------------------

    /// `c (+)= op(a) · op(b)`, see [`Gemm`].
    fn matmul(&self, a: &Self::Buf, b: &Self::Buf, c: &mut Self::Buf, g: Gemm) -> Result<()>;
    /// `batch` products at fixed strides, see [`BatchedGemm`].
    fn matmul_batched(
        &self,
        a: &Self::Buf,
        b: &Self::Buf,
        c: &mut Self::Buf,
        g: BatchedGemm,
    ) -> Result<()>;

    // ---- elementwise --------------------------------------------------------------------

    /// `out = a + b` (same length).
    fn add(&self, a: &Self::Buf, b: &Self::Buf, out: &mut Self::Buf) -> Result<()>;
    /// `dst += alpha · src` (same length). Accumulates.
    fn axpy(&self, alpha: f32, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;
    /// `buf *= alpha`, in place.
    fn scale(&self, buf: &mut Self::Buf, alpha: f32) -> Result<()>;
    /// `out = act(x)`.
    fn activation_fwd(&self, act: Activation, x: &Self::Buf, out: &mut Self::Buf) -> Result<()>;
    /// `dx = dy · act'(x)` (the input gradient of [`Backend::activation_fwd`]).
    fn activation_bwd(
        &self,
        act: Activation,
        x: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()>;

    /// `out = a ∘ b`, elementwise (same length).
    fn mul(&self, a: &Self::Buf, b: &Self::Buf, out: &mut Self::Buf) -> Result<()>;

    // ---- positions and heads ----------------------------------------------------------------

    /// Rotary position embedding of `x: [rows, heads, head_dim]` into `out` (same shape), row
    /// `r` at position `positions[r]` (`rows = positions.len()`), Llama's `rotate_half`
    /// convention: for `i < head_dim/2` and `a = positions[r]·inv_freq[i]` (`inv_freq` has
    /// `head_dim/2` frequencies, e.g. `theta^(−2i/head_dim)`, see `GptConfig::rope_inv_freq`),
    /// `out[i] = x[i]·cos a − x[i+head_dim/2]·sin a`,
    /// `out[i+head_dim/2] = x[i+head_dim/2]·cos a + x[i]·sin a`. With `inverse` the rotation
    /// is by `−a`: the transpose, so the input gradient of the forward rotation. `head_dim`
    /// must be even.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &Self::Buf,
        out: &mut Self::Buf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        inverse: bool,
    ) -> Result<()>;
    /// Grouped-query attention's sharing: `dst: [rows, kv_heads·rep, head_dim]` from
    /// `src: [rows, kv_heads, head_dim]`, query head `h` getting key/value head `h / rep`.
    fn repeat_kv(
        &self,
        src: &Self::Buf,
        dst: &mut Self::Buf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// The gradient of [`Backend::repeat_kv`]: `dst[g] = Σ_{r < rep} src[g·rep + r]` per row,
    /// summed in increasing `r`; `src: [rows, kv_heads·rep, head_dim]`. Overwrites `dst`.
    fn repeat_kv_bwd(
        &self,
        src: &Self::Buf,
        dst: &mut Self::Buf,
        rows: usize,
        kv_heads: usize,
        rep: usize,
        head_dim: usize,
    ) -> Result<()>;

    // ---- row-wise ------------------------------------------------------------------------

    /// Row softmax of `x: [rows, cols]` into `out`.
    fn softmax_rows(
        &self,
        x: &Self::Buf,
        out: &mut Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()>;
    /// RMSNorm of `x: [rows, dim]` with `weight: [dim]`:
    /// `rstd[r] = 1/√(mean(x[r]²) + eps)`, `out[r] = x[r]·rstd[r]·weight`.
    /// Writes `out: [rows, dim]` and `rstd: [rows]` (kept for the backward).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_fwd(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// Input gradient of RMSNorm: with `n = x·rstd` and `g = dy·weight`,
    /// `dx = rstd·(g − n·mean(g·n))` per row. Overwrites `dx: [rows, dim]`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd_input(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        rstd: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
        rows: usize,
        dim: usize,
    ) -> Result<()>;
    /// Weight gradient of RMSNorm: `dweight[j] += Σ_r dy[r,j]·x[r,j]·rstd[r]`. Accumulates.
    fn rmsnorm_bwd_weight(
        &self,
        x: &Self::Buf,
        rstd: &Self::Buf,
        dy: &Self::Buf,
        dweight: &mut Self::Buf,
        rows: usize,
        dim: usize,
    ) -> Result<()>;

    // ---- attention -----------------------------------------------------------------------

    /// Causal attention: for each (batch, head), `P = softmax(Q·Kᵀ/√head_dim)` with position
    /// `i` attending to `j ≤ i` only, and `out = P·V`. `q, k, v, out` are
    /// `[batch, seq, heads, head_dim]`; `probs: [batch, heads, seq, seq]` is written (zeros
    /// above the diagonal) and kept for the backward.
    #[allow(clippy::too_many_arguments)]
    fn attention_fwd(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        out: &mut Self::Buf,
        probs: &mut Self::Buf,
        shape: AttnShape,
    ) -> Result<()>;
    /// Gradients of [`Backend::attention_fwd`] w.r.t. `q`, `k` and `v` given `d_out` and the
    /// saved `probs`: `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(dP∘P))/√head_dim`,
    /// `dQ = dS·K`, `dK = dSᵀ·Q`. Overwrites `dq, dk, dv`.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        probs: &Self::Buf,
        d_out: &Self::Buf,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        shape: AttnShape,
    ) -> Result<()>;

    // ---- embeddings ------------------------------------------------------------------------

    /// `out[i] = table[ids[i]]`, rows of width `dim`; `table: [vocab, dim]`, `out: [ids, dim]`.
    /// An id `≥ vocab` is an error.
    fn embedding_fwd(
        &self,
        table: &Self::Buf,
        ids: &[u32],
        out: &mut Self::Buf,
        dim: usize,
    ) -> Result<()>;
    /// Scatter-add gradient of [`Backend::embedding_fwd`]: `dtable[ids[i]] += dy[i]`. Accumulates.
    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &Self::Buf,
        dtable: &mut Self::Buf,
        dim: usize,
    ) -> Result<()>;
    /// `dst[b] += row[..row_len]` for every row `b` of `dst: [batch, row_len]`; `row` has at
    /// least `row_len` elements (e.g. the first `seq·d` learned positions added to every
    /// sequence). Accumulates.
    fn add_broadcast_rows(
        &self,
        row: &Self::Buf,
        dst: &mut Self::Buf,
        batch: usize,
        row_len: usize,
    ) -> Result<()>;
    /// `out[..row_len] += Σ_b src[b]` over the rows of `src: [batch, row_len]`; `out` has at
    /// least `row_len` elements (the gradient of [`Backend::add_broadcast_rows`]). Accumulates.
    fn sum_rows(
        &self,
        src: &Self::Buf,
        out: &mut Self::Buf,
        batch: usize,
        row_len: usize,
    ) -> Result<()>;

    // ---- loss ------------------------------------------------------------------------------

    /// Cross-entropy of `logits: [rows, vocab]` against `targets: [rows]`. Writes the row
    /// softmax into `probs` (kept for the backward) and returns `(Σ loss, counted rows)`,
    /// where rows whose target is [`IGNORE_TARGET`] are skipped.
    fn cross_entropy_fwd(
        &self,
        logits: &Self::Buf,
        targets: &[u32],
        probs: &mut Self::Buf,
        vocab: usize,
    ) -> Result<(f32, usize)>;
    /// `dlogits = scale·(probs − onehot(target))` per counted row, 0 for ignored rows.
    fn cross_entropy_bwd(
        &self,
        probs: &Self::Buf,
        targets: &[u32],
        dlogits: &mut Self::Buf,
        vocab: usize,
        scale: f32,
    ) -> Result<()>;

    /// The fused loss and gradient of `logits: [rows, vocab]` against `targets: [rows]`, in
    /// place: each counted row becomes `scale·(softmax(row) − onehot(target))`, each ignored
    /// row 0; returns `(Σ loss, counted rows)` as [`Backend::cross_entropy_fwd`] does. The
    /// fused LM head's one pass over a chunk's logits, so that probabilities and gradients
    /// never exist beside them.
    fn cross_entropy_grad(
        &self,
        logits: &mut Self::Buf,
        targets: &[u32],
        vocab: usize,
        scale: f32,
    ) -> Result<(f32, usize)>;

    // ---- reductions and optimizer ----------------------------------------------------------

    /// `Σ x²` over the buffer (in `f64` on the CPU, for a stable global gradient norm).
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64>;
    /// One AdamW update of `param` from `grad` (scaled by `hp.grad_scale`), updating the
    /// moments `m`, `v` (all `f32`). When `master` is given it holds the `f32` master copy:
    /// the update is applied to it and `param` (e.g. `bf16`) receives the rounded result.
    #[allow(clippy::too_many_arguments)]
    fn adamw_step(
        &self,
        param: &mut Self::Buf,
        master: Option<&mut Self::Buf>,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        hp: AdamWStep,
    ) -> Result<()>;
}
