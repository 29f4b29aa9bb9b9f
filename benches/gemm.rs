//! GEMM crate comparison: which f32 matrix-product crate should the CPU backend use?
//!
//! Measures GFLOP/s of `gemm` (0.19, `x86-v4`), `matrixmultiply` (0.3) and `faer` (0.24) on
//! the matrix products of the default model — the token×d_model activations times the
//! attention projections (d×d), the MLP up-projection (d×4d), the LM head (d×vocab), and the
//! weight-gradient product of the split backward (d×tokens times tokens×4d) — plus a large
//! 256×1024×1024 product as the machine's reference peak. Each runs on 1 thread and on 2
//! threads (a dedicated rayon pool; `matrixmultiply`'s thread count is fixed per process by an
//! environment variable, so its 2-thread figure splits the rows of the output over the pool,
//! as a backend would).
//!
//! Criterion reports throughput in elements/s with one element = one flop (2·m·k·n per
//! product), so `Gelem/s` reads as GFLOP/s. After criterion, `cargo bench` also prints a plain
//! summary table from a short best-of-N timing of its own (skip it with
//! `PIPEFILL_GEMM_SUMMARY=0`). Every crate's result is checked against a naive f64 product
//! before anything is timed, so a wrong call (swapped strides) fails loudly instead of
//! producing a fast wrong number.
//!
//! Run: `cargo bench --bench gemm -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use rayon::ThreadPool;

/// One matrix product C[m×n] = A[m×k] · B[k×n], all row-major.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// What the product is in the model.
    label: &'static str,
    m: usize,
    k: usize,
    n: usize,
}

impl Shape {
    fn flops(&self) -> u64 {
        2 * (self.m * self.k * self.n) as u64
    }

    fn id(&self) -> String {
        format!("{}_{}x{}x{}", self.label, self.m, self.k, self.n)
    }
}

/// Tokens per micro-batch in the default model (micro-batch 4 × sequence 128).
const TOKENS: usize = 512;
/// Vocabulary of the synthetic reasoning tasks.
const VOCAB: usize = 48;

fn shapes() -> Vec<Shape> {
    let mut out = Vec::new();
    for d in [64, 128] {
        out.push(Shape {
            label: "attn_proj",
            m: TOKENS,
            k: d,
            n: d,
        });
        out.push(Shape {
            label: "mlp_up",
            m: TOKENS,
            k: d,
            n: 4 * d,
        });
        out.push(Shape {
            label: "lm_head",
            m: TOKENS,
            k: d,
            n: VOCAB,
        });
    }
    // Weight gradient of the MLP up-projection: dW = Xᵀ · dY reduces over the tokens.
    out.push(Shape {
        label: "mlp_up_dw",
        m: 128,
        k: TOKENS,
        n: 512,
    });
    out.push(Shape {
        label: "peak",
        m: 256,
        k: 1024,
        n: 1024,
    });
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lib {
    Gemm,
    MatrixMultiply,
    Faer,
}

impl Lib {
    const ALL: [Lib; 3] = [Lib::Gemm, Lib::MatrixMultiply, Lib::Faer];

    fn name(self) -> &'static str {
        match self {
            Lib::Gemm => "gemm",
            Lib::MatrixMultiply => "matrixmultiply",
            Lib::Faer => "faer",
        }
    }
}

/// Operands of one shape, filled with a deterministic pseudo-random sequence.
struct Operands {
    shape: Shape,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Operands {
    fn new(shape: Shape) -> Self {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ shape.flops();
        let mut next = move || {
            // xorshift64*: enough spread for a benchmark, no extra dependency.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            bits as f32 / (1u64 << 24) as f32 - 0.5
        };
        let a = (0..shape.m * shape.k).map(|_| next()).collect();
        let b = (0..shape.k * shape.n).map(|_| next()).collect();
        Operands {
            shape,
            a,
            b,
            c: vec![0.0; shape.m * shape.n],
        }
    }

    /// C = A·B with `lib` on `threads` threads (`pool` has exactly `threads` workers).
    fn multiply(&mut self, lib: Lib, threads: usize, pool: &ThreadPool) {
        let Shape { m, k, n, .. } = self.shape;
        let (a, b, c) = (&self.a[..], &self.b[..], &mut self.c[..]);
        if threads == 1 {
            // Straight on the calling thread: no pool hop in the single-thread figure.
            run_lib(lib, 1, a, b, c, m, k, n);
        } else {
            pool.install(|| run_lib(lib, threads, a, b, c, m, k, n));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_lib(
    lib: Lib,
    threads: usize,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) {
    match lib {
        Lib::Gemm => {
            let par = if threads == 1 {
                gemm::Parallelism::None
            } else {
                gemm::Parallelism::Rayon(threads)
            };
            // SAFETY: the three buffers hold m·k, k·n and m·n elements (asserted by the
            // caller's construction) and the strides describe row-major layouts of them.
            // gemm's convention: dst = alpha·dst + beta·lhs·rhs; read_dst=false drops dst.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
                    1,
                    n as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                )
            }
        }
        Lib::MatrixMultiply => {
            if threads == 1 {
                mm_rows(a, b, c, m, k, n);
            } else {
                // Split the output rows into `threads` bands, one per pool worker.
                let band = m.div_ceil(threads);
                rayon::scope(|s| {
                    for (a_band, c_band) in a.chunks(band * k).zip(c.chunks_mut(band * n)) {
                        s.spawn(move |_| mm_rows(a_band, b, c_band, a_band.len() / k, k, n));
                    }
                });
            }
        }
        Lib::Faer => {
            let par = if threads == 1 {
                faer::Par::Seq
            } else {
                faer::Par::rayon(threads)
            };
            faer::linalg::matmul::matmul(
                faer::MatMut::from_row_major_slice_mut(c, m, n),
                faer::Accum::Replace,
                faer::MatRef::from_row_major_slice(a, m, k),
                faer::MatRef::from_row_major_slice(b, k, n),
                1.0f32,
                par,
            );
        }
    }
}

fn mm_rows(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    // SAFETY: lengths asserted above; row-major strides (row stride, column stride).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

/// Checks every crate, on 1 and 2 threads, against a naive f64 product of the same operands.
fn verify(ops: &mut Operands, pools: &[(usize, ThreadPool)]) {
    let Shape { m, k, n, .. } = ops.shape;
    let mut reference = vec![0.0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let aip = f64::from(ops.a[i * k + p]);
            let row = &ops.b[p * n..(p + 1) * n];
            for (r, &bpj) in reference[i * n..(i + 1) * n].iter_mut().zip(row) {
                *r += aip * f64::from(bpj);
            }
        }
    }
    // Entries are sums of k products of values in [-0.5, 0.5): f32 error grows like k·eps.
    let tolerance = 1e-6 * k as f64;
    for lib in Lib::ALL {
        for (threads, pool) in pools {
            ops.c.fill(f32::NAN);
            ops.multiply(lib, *threads, pool);
            let worst = ops
                .c
                .iter()
                .zip(&reference)
                .map(|(&got, &want)| (f64::from(got) - want).abs())
                .fold(0.0f64, |acc, d| {
                    if d.is_nan() {
                        f64::INFINITY
                    } else {
                        acc.max(d)
                    }
                });
            assert!(
                worst <= tolerance,
                "{} on {threads} thread(s) is wrong for {}: max |error| {worst:e} > {tolerance:e}",
                lib.name(),
                ops.shape.id()
            );
        }
    }
}

fn bench(c: &mut Criterion, cases: &mut [Operands], pools: &[(usize, ThreadPool)]) {
    for ops in cases.iter_mut() {
        let shape = ops.shape;
        let mut group = c.benchmark_group(format!("gemm/{}", shape.id()));
        group.throughput(Throughput::Elements(shape.flops()));
        for lib in Lib::ALL {
            for (threads, pool) in pools {
                let id = BenchmarkId::new(lib.name(), format!("{threads}t"));
                group.bench_function(id, |bencher| {
                    bencher.iter(|| {
                        ops.multiply(lib, *threads, pool);
                        black_box(&ops.c);
                    })
                });
            }
        }
        group.finish();
    }
}

/// Best-of-N GFLOP/s within a small time budget: the least disturbed run on a shared machine.
fn best_gflops(ops: &mut Operands, lib: Lib, threads: usize, pool: &ThreadPool) -> f64 {
    let budget = Duration::from_millis(300);
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || (start.elapsed() < budget && runs < 10_000) {
        let t = Instant::now();
        ops.multiply(lib, threads, pool);
        black_box(&ops.c);
        best = best.min(t.elapsed());
        runs += 1;
    }
    ops.shape.flops() as f64 / best.as_secs_f64() / 1e9
}

fn summary(cases: &mut [Operands], pools: &[(usize, ThreadPool)]) {
    println!("\nGEMM summary: best-of-N GFLOP/s (f32, row-major, C = A·B; m×k×n)");
    let mut header = format!("{:<28}", "shape");
    for (threads, _) in pools {
        for lib in Lib::ALL {
            header.push_str(&format!(" {:>18}", format!("{}@{threads}t", lib.name())));
        }
    }
    println!("{header}");
    for ops in cases.iter_mut() {
        let mut line = format!("{:<28}", ops.shape.id());
        for (threads, pool) in pools {
            let figures: Vec<f64> = Lib::ALL
                .iter()
                .map(|&lib| best_gflops(ops, lib, *threads, pool))
                .collect();
            let best = figures.iter().cloned().fold(0.0, f64::max);
            for g in figures {
                let mark = if g == best { "*" } else { " " };
                line.push_str(&format!(" {:>17.1}{mark}", g));
            }
        }
        println!("{line}");
    }
    println!("(* = fastest crate for that shape and thread count)");
}

fn main() {
    let pools: Vec<(usize, ThreadPool)> = [1usize, 2]
        .into_iter()
        .map(|threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("gemm-bench-{threads}t-{i}"))
                .build()
                .expect("building a rayon pool for the GEMM benchmark");
            (threads, pool)
        })
        .collect();
    let mut cases: Vec<Operands> = shapes().into_iter().map(Operands::new).collect();
    for ops in &mut cases {
        verify(ops, &pools);
    }

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    bench(&mut criterion, &mut cases, &pools);
    criterion.final_summary();

    // `cargo bench` passes --bench; `cargo test --benches` does not (a smoke run only).
    let benchmarking = std::env::args().any(|arg| arg == "--bench");
    let wanted = std::env::var("PIPEFILL_GEMM_SUMMARY").map_or(true, |v| v != "0");
    if benchmarking && wanted {
        summary(&mut cases, &pools);
    }
}
