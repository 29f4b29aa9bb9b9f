//! The LM head and its loss at a real vocabulary, fused and chunked (`model::layers::Head`)
//! against the unfused composition it replaced (the whole micro-batch's logits, softmax
//! kept for I, logit gradients kept for W, the three products over all tokens), on the
//! 135 M-class Llama's head (d 576, 49,152 tokens, as `cargo bench --bench train`'s
//! `real/llama_135m`), for micro-batches of 256 tokens (that bench's) and 2048.
//!
//! Each side runs F, I and W of one micro-batch on a one-thread CPU backend and is timed by
//! the thread's CPU time (so that other processes on a shared machine change the figure
//! little), alternating, `HEAD_REPS` rounds (default 7); the medians are printed, with
//! each side's largest buffers (the fused head: one chunk of logits and the `[d, vocab]`
//! gradient kept for W; the unfused: two `[tokens, vocab]` buffers at once).
//! `cargo bench --bench head`.

use pipefill::model::GptConfig;
use pipefill::model::layers::{Head, chunk_rows};
use pipefill::tensor::{Backend, CpuBackend, DType, Gemm};
use pipefill_actors::thread_cpu_time;

const D: usize = 576;
const VOCAB: usize = 49_152;

/// The unfused head's F, I and W for loss scale `scale`: what `Head` computed before it
/// was fused (logits, `cross_entropy_fwd` into probabilities, `cross_entropy_bwd`, then
/// `dx = dlogits·Wᵀ` and `dW += xᵀ·dlogits`).
fn unfused(
    be: &CpuBackend,
    w: &<CpuBackend as Backend>::Buf,
    x: &<CpuBackend as Backend>::Buf,
    t: &[u32],
    grad: &mut <CpuBackend as Backend>::Buf,
) {
    let n = t.len();
    let mut logits = be.zeros(n * VOCAB, DType::F32).unwrap();
    be.matmul(x, w, &mut logits, Gemm::nn(n, D, VOCAB).trans_b())
        .unwrap();
    let mut probs = be.zeros(n * VOCAB, DType::F32).unwrap();
    let (_, count) = be.cross_entropy_fwd(&logits, t, &mut probs, VOCAB).unwrap();
    drop(logits);
    let mut dlogits = be.zeros(n * VOCAB, DType::F32).unwrap();
    be.cross_entropy_bwd(&probs, t, &mut dlogits, VOCAB, 0.25 / count as f32)
        .unwrap();
    drop(probs);
    let mut dx = be.zeros(n * D, DType::F32).unwrap();
    be.matmul(&dlogits, w, &mut dx, Gemm::nn(n, VOCAB, D))
        .unwrap();
    be.matmul(
        &dlogits,
        x,
        grad,
        Gemm::nn(VOCAB, n, D).trans_a().accumulate(),
    )
    .unwrap();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of this thread's CPU time that `f` took.
fn timed(f: impl FnOnce()) -> f64 {
    let started = thread_cpu_time();
    f();
    thread_cpu_time() - started
}

fn main() {
    let reps: usize = std::env::var("HEAD_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(7);
    let be = CpuBackend::new(1).unwrap();
    let config = GptConfig {
        vocab: VOCAB,
        d_model: D,
        tie_embeddings: true,
        ..GptConfig::default()
    };
    let mut head = Head::new(&be, "head", &config).unwrap();
    for tokens in [256, 2048] {
        let x: Vec<f32> = (0..tokens * D)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let x = be.from_host(&x, DType::F32).unwrap();
        let t: Vec<u32> = (0..tokens as u32).map(|i| i * 31 % VOCAB as u32).collect();
        let mut grad = be.zeros(D * VOCAB, DType::F32).unwrap();
        let (mut fused, mut plain) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            fused.push(timed(|| {
                head.forward(&be, 0, &x, &t, true).unwrap();
                let dx = head.backward_input(&be, 0, 0.25).unwrap();
                head.backward_weight(&be, 0).unwrap();
                std::hint::black_box(dx);
            }));
            plain.push(timed(|| unfused(&be, &head.w.value, &x, &t, &mut grad)));
        }
        let chunk = chunk_rows(D, VOCAB).min(tokens);
        let mib = |elems: usize| (elems * 4) as f64 / (1 << 20) as f64;
        let (f, p) = (median(fused), median(plain));
        println!(
            "head d {D} vocab {VOCAB}, {tokens} tokens, 1 thread, median of {reps} (thread CPU): \
             fused {:.0} ms (chunks of {chunk} tokens; logits chunk {:.0} MiB, dW kept {:.0} MiB), \
             unfused {:.0} ms (logits and softmax {:.0} MiB each); fused/unfused {:.3}",
            f * 1e3,
            mib(chunk * VOCAB),
            mib(D * VOCAB),
            p * 1e3,
            mib(tokens * VOCAB),
            f / p
        );
    }
}
