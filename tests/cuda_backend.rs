//! The CUDA backend against the CPU backend (the reference): every operation on small random
//! shapes, in `f32` and through `bf16` storage, plus the error paths.
//!
//! Needs feature `cuda` and a GPU. Without a usable CUDA device every test prints why and
//! passes (skips); with a device, a backend that fails to start (e.g. a kernel that NVRTC
//! rejects) is a failure, not a skip.
#![cfg(feature = "cuda")]

use pipefill::model::ModelError;
use pipefill::tensor::TensorError;
use pipefill::tensor::cuda::CudaBackend;
use pipefill::tensor::device::cuda_device_count;
use pipefill::tensor::{
    Activation, AdamWStep, AttnShape, Backend, BatchedGemm, CpuBackend, DType, Gemm, IGNORE_TARGET,
    Result,
};

/// Both backends, or `None` (after saying why) where no CUDA device can be used.
fn backends(test: &str) -> Option<(CpuBackend, CudaBackend)> {
    match cuda_device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            eprintln!("SKIP {test}: the CUDA driver reports no device");
            return None;
        }
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            return None;
        }
    }
    let gpu = CudaBackend::new(0).expect("a CUDA device is present, so the backend must start");
    Some((CpuBackend::new(1).unwrap(), gpu))
}

/// Deterministic values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
    fn ids(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| ((self.next() + 1.0) * 0.5 * vocab as f32) as u32 % vocab as u32)
            .collect()
    }
}

/// Asserts that every output of the GPU run is within `tol·max(1, |cpu|)` of the CPU run.
fn compare(what: &str, cpu: Result<Vec<Vec<f32>>>, gpu: Result<Vec<Vec<f32>>>, tol: f32) {
    let (cpu, gpu) = (cpu.unwrap(), gpu.unwrap());
    assert_eq!(cpu.len(), gpu.len(), "{what}: number of outputs");
    for (o, (want, got)) in cpu.iter().zip(&gpu).enumerate() {
        assert_eq!(want.len(), got.len(), "{what}: output {o} length");
        for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
            let ok = (w - g).abs() <= tol * w.abs().max(1.0) || (w.is_nan() && g.is_nan());
            assert!(ok, "{what}: output {o}[{i}]: cpu {w}, cuda {g}");
        }
    }
}

/// Runs `case` on both backends with the same seed and compares the outputs.
macro_rules! both {
    ($what:expr, $tol:expr, $cpu:expr, $gpu:expr, $case:ident $(, $arg:expr)*) => {
        compare($what, $case(&$cpu, $($arg),*), $case(&$gpu, $($arg),*), $tol)
    };
}

fn host<B: Backend>(b: &B, bufs: &[&B::Buf]) -> Result<Vec<Vec<f32>>> {
    bufs.iter().map(|x| b.to_host(x)).collect()
}

fn memory<B: Backend>(b: &B, dtype: DType) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(1);
    let data: Vec<f32> = r.vec(1000).into_iter().map(|x| x * 300.0).collect();
    let a = b.from_host(&data, dtype)?;
    let mut f32_copy = b.zeros(1000, DType::F32)?;
    let mut bf16_copy = b.zeros(1000, DType::Bf16)?;
    b.copy(&a, &mut f32_copy)?;
    b.copy(&a, &mut bf16_copy)?;
    let mut filled = b.zeros(77, dtype)?;
    b.fill(&mut filled, 1.0 / 3.0)?;
    let d = b.dup(&a)?;
    let empty = b.from_host(&[], dtype)?;
    assert_eq!(b.len(&a), 1000);
    assert_eq!(b.dtype(&a), dtype);
    host(b, &[&a, &f32_copy, &bf16_copy, &filled, &d, &empty])
}

#[test]
fn memory_round_trips_and_conversions_match() {
    let Some((cpu, gpu)) = backends("memory") else {
        return;
    };
    // Conversions are exact operations (bf16 rounding is round-to-nearest-even on both sides).
    both!("memory f32", 0.0, cpu, gpu, memory, DType::F32);
    both!("memory bf16", 0.0, cpu, gpu, memory, DType::Bf16);
}

/// Storage bytes (what a TCP frame carries) are the same on both backends, bf16 as its 2-byte
/// bits, and read back to the same buffer; a length that is not whole values is the CPU's error.
#[test]
fn storage_bytes_match() {
    let Some((cpu, gpu)) = backends("bytes") else {
        return;
    };
    let data: Vec<f32> = Rng(3).vec(1001).into_iter().map(|x| x * 300.0).collect();
    for dtype in [DType::F32, DType::Bf16] {
        let want = cpu
            .to_host_bytes(&cpu.from_host(&data, dtype).unwrap())
            .unwrap();
        assert_eq!(want.len(), 1001 * dtype.size());
        let on_gpu = gpu.from_host(&data, dtype).unwrap();
        assert_eq!(gpu.to_host_bytes(&on_gpu).unwrap(), want, "{dtype:?}");
        let back = gpu.from_host_bytes(&want, dtype).unwrap();
        assert_eq!(gpu.dtype(&back), dtype);
        assert_eq!(gpu.to_host_bytes(&back).unwrap(), want, "{dtype:?}");
        let empty = gpu.from_host_bytes(&[], dtype).unwrap();
        assert_eq!(gpu.len(&empty), 0);
    }
    let odd = |b: &dyn Fn() -> Result<()>| b().unwrap_err().to_string();
    assert_eq!(
        odd(&|| gpu.from_host_bytes(&[0; 5], DType::Bf16).map(|_| ())),
        odd(&|| cpu.from_host_bytes(&[0; 5], DType::Bf16).map(|_| ()))
    );
}

fn products<B: Backend>(b: &B, dtype: DType) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(2);
    let (m, k, n) = (7, 13, 5);
    let mut out = Vec::new();
    for (ta, tb, acc) in [
        (false, false, false),
        (true, false, false),
        (false, true, true),
        (true, true, true),
    ] {
        let a = b.from_host(&r.vec(m * k), dtype)?;
        let bb = b.from_host(&r.vec(k * n), dtype)?;
        let mut c = b.from_host(&r.vec(m * n), dtype)?;
        let mut g = Gemm::nn(m, k, n);
        g.trans_a = ta;
        g.trans_b = tb;
        g.accumulate = acc;
        b.matmul(&a, &bb, &mut c, g)?;
        out.push(b.to_host(&c)?);
    }
    // Strided batch, A broadcast (stride 0).
    let batch = 3;
    let a = b.from_host(&r.vec(m * k), dtype)?;
    let bb = b.from_host(&r.vec(batch * k * n), dtype)?;
    let mut c = b.zeros(batch * m * n, dtype)?;
    let g = BatchedGemm {
        gemm: Gemm::nn(m, k, n),
        batch,
        stride_a: 0,
        stride_b: k * n,
        stride_c: m * n,
    };
    b.matmul_batched(&a, &bb, &mut c, g)?;
    out.push(b.to_host(&c)?);
    // Every product accumulated into one output (stride_c = 0): the overlapping path.
    let mut c1 = b.from_host(&r.vec(m * n), dtype)?;
    let a3 = b.from_host(&r.vec(batch * m * k), dtype)?;
    let g = BatchedGemm {
        gemm: Gemm::nn(m, k, n).accumulate(),
        batch,
        stride_a: m * k,
        stride_b: k * n,
        stride_c: 0,
    };
    b.matmul_batched(&a3, &bb, &mut c1, g)?;
    out.push(b.to_host(&c1)?);
    // k = 0: the output is zeroed.
    let mut z = b.from_host(&r.vec(m * n), dtype)?;
    let e = b.zeros(0, dtype)?;
    b.matmul(&e, &e, &mut z, Gemm::nn(m, 0, n))?;
    out.push(b.to_host(&z)?);
    Ok(out)
}

#[test]
fn matrix_products_match() {
    let Some((cpu, gpu)) = backends("matmul") else {
        return;
    };
    both!("matmul f32", 1e-5, cpu, gpu, products, DType::F32);
    // bf16 outputs may round differently when the f32 results differ in the last bits.
    both!("matmul bf16", 1e-2, cpu, gpu, products, DType::Bf16);
}

fn elementwise<B: Backend>(b: &B) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(3);
    let n = 1037;
    let x = b.from_host(
        &r.vec(n).iter().map(|v| v * 4.0).collect::<Vec<_>>(),
        DType::F32,
    )?;
    let y = b.from_host(&r.vec(n), DType::F32)?;
    let mut sum = b.zeros(n, DType::F32)?;
    b.add(&x, &y, &mut sum)?;
    let mut acc = b.dup(&y)?;
    b.axpy(-0.75, &x, &mut acc)?;
    b.scale(&mut acc, 1.5)?;
    let mut outs = vec![b.to_host(&sum)?, b.to_host(&acc)?];
    for act in [Activation::Gelu, Activation::Silu] {
        let mut fwd = b.zeros(n, DType::F32)?;
        let mut bwd = b.zeros(n, DType::F32)?;
        b.activation_fwd(act, &x, &mut fwd)?;
        b.activation_bwd(act, &x, &y, &mut bwd)?;
        outs.push(b.to_host(&fwd)?);
        outs.push(b.to_host(&bwd)?);
    }
    Ok(outs)
}

#[test]
fn elementwise_and_activations_match() {
    let Some((cpu, gpu)) = backends("elementwise") else {
        return;
    };
    both!("elementwise", 1e-5, cpu, gpu, elementwise);
}

/// Rotary embedding forward and inverse (the input gradient), at positions up to a long
/// context's (the angle's range reduction matters there), with an odd row count.
fn rope<B: Backend>(b: &B, dtype: DType) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(12);
    let (rows, heads, head_dim) = (37, 6, 16);
    let n = rows * heads * head_dim;
    let x = b.from_host(&r.vec(n), dtype)?;
    let positions: Vec<u32> = (0..rows as u32).map(|i| i * 2917 % 32768).collect();
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 500000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    let (mut fwd, mut back) = (b.zeros(n, dtype)?, b.zeros(n, dtype)?);
    b.rope(&x, &mut fwd, &positions, heads, head_dim, &inv_freq, false)?;
    b.rope(
        &fwd, &mut back, &positions, heads, head_dim, &inv_freq, true,
    )?;
    host(b, &[&fwd, &back])
}

/// Grouped-query sharing and its gradient, and the SwiGLU product: copies and sums in the
/// CPU's order, so the two backends agree exactly.
fn heads_and_products<B: Backend>(b: &B) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(13);
    let (rows, kv_heads, rep, head_dim) = (11, 2, 3, 8);
    let (narrow, wide) = (rows * kv_heads * head_dim, rows * kv_heads * rep * head_dim);
    let kv = b.from_host(&r.vec(narrow), DType::F32)?;
    let grad = b.from_host(&r.vec(wide), DType::F32)?;
    let mut repeated = b.zeros(wide, DType::F32)?;
    b.repeat_kv(&kv, &mut repeated, rows, kv_heads, rep, head_dim)?;
    let mut summed = b.zeros(narrow, DType::F32)?;
    b.repeat_kv_bwd(&grad, &mut summed, rows, kv_heads, rep, head_dim)?;
    let other = b.from_host(&r.vec(wide), DType::F32)?;
    let mut product = b.zeros(wide, DType::F32)?;
    b.mul(&grad, &other, &mut product)?;
    host(b, &[&repeated, &summed, &product])
}

#[test]
fn llama_ops_match() {
    let Some((cpu, gpu)) = backends("llama ops") else {
        return;
    };
    both!("rope f32", 1e-5, cpu, gpu, rope, DType::F32);
    both!("rope bf16", 2e-2, cpu, gpu, rope, DType::Bf16);
    both!(
        "repeat_kv, its gradient, mul",
        0.0,
        cpu,
        gpu,
        heads_and_products
    );
}

fn rows<B: Backend>(b: &B, dim: usize) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(4 + dim as u64);
    let n_rows = 9;
    let x = b.from_host(
        &r.vec(n_rows * dim)
            .iter()
            .map(|v| v * 3.0)
            .collect::<Vec<_>>(),
        DType::F32,
    )?;
    let w = b.from_host(&r.vec(dim), DType::F32)?;
    let dy = b.from_host(&r.vec(n_rows * dim), DType::F32)?;
    let mut sm = b.zeros(n_rows * dim, DType::F32)?;
    b.softmax_rows(&x, &mut sm, n_rows, dim)?;
    let mut out = b.zeros(n_rows * dim, DType::F32)?;
    let mut rstd = b.zeros(n_rows, DType::F32)?;
    b.rmsnorm_fwd(&x, &w, &mut out, &mut rstd, n_rows, dim, 1e-5)?;
    let mut dx = b.zeros(n_rows * dim, DType::F32)?;
    b.rmsnorm_bwd_input(&x, &w, &rstd, &dy, &mut dx, n_rows, dim)?;
    let mut dw = b.from_host(&r.vec(dim), DType::F32)?;
    b.rmsnorm_bwd_weight(&x, &rstd, &dy, &mut dw, n_rows, dim)?;
    host(b, &[&sm, &out, &rstd, &dx, &dw])
}

#[test]
fn softmax_and_rmsnorm_match() {
    let Some((cpu, gpu)) = backends("rows") else {
        return;
    };
    // Widths below one warp, between block sizes, and wider than the largest block.
    for dim in [5, 48, 100, 300, 1031] {
        both!(&format!("rows dim={dim}"), 2e-5, cpu, gpu, rows, dim);
    }
}

fn attention<B: Backend>(b: &B, s: AttnShape, dtype: DType) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(5 + s.seq as u64);
    let n = s.qkv_len();
    let q = b.from_host(&r.vec(n), dtype)?;
    let k = b.from_host(&r.vec(n), dtype)?;
    let v = b.from_host(&r.vec(n), dtype)?;
    let d_out = b.from_host(&r.vec(n), dtype)?;
    let mut out = b.zeros(n, dtype)?;
    let mut probs = b.zeros(s.probs_len(), dtype)?;
    b.attention_fwd(&q, &k, &v, &mut out, &mut probs, s)?;
    let (mut dq, mut dk, mut dv) = (b.zeros(n, dtype)?, b.zeros(n, dtype)?, b.zeros(n, dtype)?);
    b.attention_bwd(&q, &k, &v, &probs, &d_out, &mut dq, &mut dk, &mut dv, s)?;
    host(b, &[&out, &probs, &dq, &dk, &dv])
}

#[test]
fn causal_attention_matches() {
    let Some((cpu, gpu)) = backends("attention") else {
        return;
    };
    for s in [
        AttnShape {
            batch: 1,
            seq: 1,
            heads: 1,
            head_dim: 4,
        },
        AttnShape {
            batch: 2,
            seq: 7,
            heads: 3,
            head_dim: 8,
        },
        AttnShape {
            batch: 3,
            seq: 40,
            heads: 2,
            head_dim: 16,
        },
        AttnShape {
            batch: 1,
            seq: 300,
            heads: 2,
            head_dim: 5,
        },
    ] {
        both!(
            &format!("attention {s:?}"),
            1e-4,
            cpu,
            gpu,
            attention,
            s,
            DType::F32
        );
    }
    let s = AttnShape {
        batch: 2,
        seq: 9,
        heads: 2,
        head_dim: 4,
    };
    both!("attention bf16", 2e-2, cpu, gpu, attention, s, DType::Bf16);
}

fn embeddings<B: Backend>(b: &B) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(6);
    let (vocab, dim, tokens, batch) = (11, 6, 40, 4);
    let table = b.from_host(&r.vec(vocab * dim), DType::F32)?;
    let ids = r.ids(tokens, vocab); // 40 ids over 11 rows: repeats exercise the atomics
    let mut out = b.zeros(tokens * dim, DType::F32)?;
    b.embedding_fwd(&table, &ids, &mut out, dim)?;
    let dy = b.from_host(&r.vec(tokens * dim), DType::F32)?;
    let mut dtable = b.from_host(&r.vec(vocab * dim), DType::F32)?;
    b.embedding_bwd(&ids, &dy, &mut dtable, dim)?;
    // Positions: add the first 10·dim of a longer row to every sequence, and back.
    let row = b.from_host(&r.vec(12 * dim), DType::F32)?;
    let mut seqs = b.from_host(&r.vec(batch * 10 * dim), DType::F32)?;
    b.add_broadcast_rows(&row, &mut seqs, batch, 10 * dim)?;
    let mut grad = b.from_host(&r.vec(12 * dim), DType::F32)?;
    b.sum_rows(&seqs, &mut grad, batch, 10 * dim)?;
    host(b, &[&out, &dtable, &seqs, &grad])
}

#[test]
fn embeddings_and_row_broadcasts_match() {
    let Some((cpu, gpu)) = backends("embeddings") else {
        return;
    };
    both!("embeddings", 1e-5, cpu, gpu, embeddings);
}

fn loss<B: Backend>(b: &B, vocab: usize) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(7 + vocab as u64);
    let rows = 13;
    let logits = b.from_host(
        &r.vec(rows * vocab)
            .iter()
            .map(|v| v * 5.0)
            .collect::<Vec<_>>(),
        DType::F32,
    )?;
    let mut targets = r.ids(rows, vocab);
    targets[3] = IGNORE_TARGET;
    targets[8] = IGNORE_TARGET;
    let mut probs = b.zeros(rows * vocab, DType::F32)?;
    let (total, counted) = b.cross_entropy_fwd(&logits, &targets, &mut probs, vocab)?;
    let mut dlogits = b.zeros(rows * vocab, DType::F32)?;
    b.cross_entropy_bwd(&probs, &targets, &mut dlogits, vocab, 1.0 / counted as f32)?;
    let norm = b.sum_squares(&logits)? as f32;
    // The fused head's ops: the loss and gradient in place, and a range of rows.
    let mut fused = b.dup(&logits)?;
    let (fused_total, _) = b.cross_entropy_grad(&mut fused, &targets, vocab, 0.5)?;
    let mut rows_2_to_5 = b.zeros(3 * vocab, DType::F32)?;
    b.copy_range(&logits, 2 * vocab, &mut rows_2_to_5, 0, 3 * vocab)?;
    Ok(vec![
        vec![total, counted as f32, norm, fused_total],
        b.to_host(&probs)?,
        b.to_host(&dlogits)?,
        b.to_host(&fused)?,
        b.to_host(&rows_2_to_5)?,
    ])
}

#[test]
fn cross_entropy_and_sum_squares_match() {
    let Some((cpu, gpu)) = backends("loss") else {
        return;
    };
    for vocab in [3, 48, 700] {
        both!(&format!("loss vocab={vocab}"), 2e-5, cpu, gpu, loss, vocab);
    }
}

fn adamw<B: Backend>(b: &B, dtype: DType) -> Result<Vec<Vec<f32>>> {
    let mut r = Rng(8);
    let n = 517;
    let init = r.vec(n);
    let mut param = b.from_host(&init, dtype)?;
    let mut master = b.from_host(&init, DType::F32)?;
    let (mut m, mut v) = (b.zeros(n, DType::F32)?, b.zeros(n, DType::F32)?);
    for step in 1..=3 {
        let grad = b.from_host(&r.vec(n), DType::F32)?;
        let hp = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 0.5,
        };
        let master = (dtype == DType::Bf16).then_some(&mut master);
        b.adamw_step(&mut param, master, &grad, &mut m, &mut v, hp)?;
    }
    host(b, &[&param, &master, &m, &v])
}

#[test]
fn adamw_matches() {
    let Some((cpu, gpu)) = backends("adamw") else {
        return;
    };
    both!("adamw f32", 1e-5, cpu, gpu, adamw, DType::F32);
    both!("adamw bf16 + master", 1e-2, cpu, gpu, adamw, DType::Bf16);
}

#[test]
fn bad_operands_are_the_same_errors_as_on_the_cpu() {
    let Some((cpu, gpu)) = backends("errors") else {
        return;
    };
    fn errors<B: Backend>(b: &B) -> Vec<String> {
        let a = b.zeros(6, DType::F32).unwrap();
        let mut c = b.zeros(5, DType::F32).unwrap(); // 2×2 expected
        let table = b.zeros(12, DType::F32).unwrap();
        let mut out = b.zeros(6, DType::F32).unwrap();
        let mut probs = b.zeros(6, DType::F32).unwrap();
        let attn = AttnShape {
            batch: 1,
            seq: 2,
            heads: 0,
            head_dim: 3,
        };
        let results: Vec<std::result::Result<(), TensorError>> = vec![
            b.matmul(&a, &a, &mut c, Gemm::nn(2, 3, 2)),
            b.embedding_fwd(&table, &[1, 7], &mut out, 3),
            b.cross_entropy_fwd(&a, &[0, 3], &mut probs, 3).map(|_| ()),
            b.attention_fwd(&a, &a, &a, &mut out, &mut probs, attn),
        ];
        results
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect()
    }
    assert_eq!(errors(&cpu), errors(&gpu));
}

#[test]
fn backend_names_its_device() {
    let Some((_, gpu)) = backends("name") else {
        return;
    };
    assert!(gpu.name().starts_with("cuda:0 ("), "{}", gpu.name());
    gpu.synchronize().unwrap();
}

/// The drafter trained on the same rows on both backends: its weights after four slices (one
/// optimizer step each) and its held-out figures agree to rounding. Each slice's time is
/// printed (the first pays the backend's one-off costs).
#[test]
fn the_drafter_trains_alike() {
    use pipefill::config::JobConfig;
    use pipefill::model::drafter::{DraftBufferHandle, DraftRow, Drafter, DrafterTrainer};
    let Some((cpu, gpu)) = backends("the_drafter_trains_alike") else {
        return;
    };
    let job = JobConfig::embedded(&[]).unwrap();
    let (target, config) = (job.model, job.drafter);
    let mut rng = Rng(7);
    let len = 16;
    let rows: Vec<DraftRow> = (0..8)
        .map(|_| DraftRow {
            hidden: rng.vec(len * target.d_model),
            targets: rng.ids(len, target.vocab),
            step: 0,
        })
        .collect();
    fn train<B: Backend>(
        be: B,
        target: &pipefill::model::GptConfig,
        config: &pipefill::model::drafter::DrafterConfig,
        rows: &[DraftRow],
    ) -> Result<Vec<Vec<f32>>> {
        let run = || -> std::result::Result<Vec<Vec<f32>>, ModelError> {
            let buffer = DraftBufferHandle::new(target, config);
            for row in &rows[2..] {
                buffer.lock().push(row.clone())?;
            }
            let drafter = Drafter::new(target, config, be.clone())?;
            let mut trainer = DrafterTrainer::new(drafter, buffer, 0, 1)?;
            let mut ms = Vec::new();
            for _ in 0..4 {
                let started = std::time::Instant::now();
                trainer.slice()?;
                ms.push(format!("{:.2}", started.elapsed().as_secs_f64() * 1e3));
            }
            println!("{}: drafter slices of [{}] ms", be.name(), ms.join(", "));
            let stats = trainer.evaluate(&rows[..2])?;
            let mut out: Vec<Vec<f32>> = (trainer.weights()?.tensors.into_iter())
                .map(|t| t.values)
                .collect();
            out.push(vec![
                stats.agreement as f32,
                stats.ce as f32,
                stats.overlap as f32,
            ]);
            Ok(out)
        };
        run().map_err(|e| TensorError::Device(e.to_string()))
    }
    compare(
        "drafter training",
        train(cpu, &target, &config, &rows),
        train(gpu, &target, &config, &rows),
        1e-3,
    );
}
