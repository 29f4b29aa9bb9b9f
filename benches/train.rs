//! Training throughput: tokens per second of one optimizer step (4 micro-batches × 4
//! sequences × 64 tokens) on the CPU backend, for
//! - `train_step/default_model`: the reference trainer on the default job's model;
//! - `train_step/llama_d256`: the reference trainer on a Llama-shaped model (d 256, 8 layers,
//!   RoPE, SwiGLU with intermediate 704, GQA 4 query / 2 key-value heads, tied embeddings);
//! - `pipeline_1f1b/llama_d256`: the same model in the in-process pipeline (2 stages, 1F1B,
//!   no filler), each step's time as its metrics report it.
//!
//! Criterion reports the time per step; afterwards each case prints the median tokens/s
//! over its measured steps, the figure quoted in reports. `scripts/bench_torch_llama.py`
//! times transformers + torch on the same model and batch for the comparison.
//!
//! Two real-shape cases (issue 31), random weights drawn at bench time, run only when the
//! filter names them (`-- real`, `-- llama_135m`, `-- llama_135m/1f1b`, `-- qwen`, …: each
//! under the reference trainer, `/reference`, and the 2-stage pipeline under 1F1B, ZB-H1 or
//! ZB-H2, `/1f1b`, `/zbh1`, `/zbh2`), since one step takes seconds
//! to tens of seconds on a few cores and the Qwen shape about 10 GB: `real/llama_135m` (a
//! 135 M-class Llama: SmolLM's 30 layers, d 576, 9/3 heads, SwiGLU 1536, tied embeddings,
//! 49,152 vocabulary) and `real/qwen2.5_0.5b` (Qwen2.5-0.5B's shape: 24 layers, d 896, 14/2
//! heads, q/k/v biases, SwiGLU 4864, tied, 151,936 vocabulary), on the same step of
//! 4 × 4 × 64 tokens. They are
//! timed step by step without criterion (whose ten samples would take minutes per case):
//! one warm-up step, then `PIPEFILL_BENCH_STEPS` (default 3) measured ones. The pipeline
//! cases run on the wall clock, their two ranks sharing the job's threads
//! (`PIPEFILL_THREADS=1`: one thread a rank).
//!
//! `cargo bench -p pipefill --bench train [-- FILTER]` (threads: `PIPEFILL_THREADS`,
//! default all cores).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use pipefill::config::{ClockKind, Filler, JobConfig};
use pipefill::model::GptConfig;
use pipefill::model::config::Positions;
use pipefill::pipeline::PipelineTrainer;
use pipefill::schedules::ScheduleKind;
use pipefill::tensor::Activation;
use pipefill::train::Trainer;

/// The Llama-shaped case's model (the default job's vocabulary and sequence length).
fn llama_d256() -> GptConfig {
    GptConfig {
        d_model: 256,
        heads: 4,
        kv_heads: Some(2),
        layers: 8,
        intermediate: Some(704),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        tie_embeddings: true,
        ..GptConfig::default()
    }
}

/// A 135 M-class Llama (SmolLM-135M's shape).
fn llama_135m() -> GptConfig {
    GptConfig {
        vocab: 49_152,
        d_model: 576,
        heads: 9,
        kv_heads: Some(3),
        layers: 30,
        intermediate: Some(1536),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        tie_embeddings: true,
        ..GptConfig::default()
    }
}

/// Qwen2.5-0.5B's shape.
fn qwen_05b() -> GptConfig {
    GptConfig {
        vocab: 151_936,
        d_model: 896,
        heads: 14,
        kv_heads: Some(2),
        layers: 24,
        intermediate: Some(4864),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        rope_theta: 1_000_000.0,
        qkv_bias: true,
        tie_embeddings: true,
        norm_eps: 1e-6,
        ..GptConfig::default()
    }
}

fn job(model: GptConfig) -> JobConfig {
    let mut job = JobConfig {
        model,
        ..JobConfig::default()
    };
    job.train.micro_batches = 4;
    job.train.micro_batch_size = 4;
    job.train.eval_tasks = 0;
    job.filler = Filler::None;
    if let Some(threads) = std::env::var("PIPEFILL_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
    {
        job.train.threads = threads;
    }
    job
}

fn tokens(job: &JobConfig) -> usize {
    job.train.batch_size() * job.model.seq_len
}

/// The median of `steps` as one line of the report.
fn report(case: &str, job: &JobConfig, mut steps: Vec<Duration>) {
    if steps.is_empty() {
        return;
    }
    steps.sort();
    let median = steps[steps.len() / 2].as_secs_f64();
    println!(
        "{case}: {} params on {} thread(s): median step {:.1} ms, median {:.0} tokens/s over \
         {} steps of {} tokens",
        job.model.param_count(),
        pipefill::train::reference::cpu_threads(&job.train),
        median * 1e3,
        tokens(job) as f64 / median,
        steps.len(),
        tokens(job)
    );
}

/// The reference trainer's step on `job`, timed by criterion; the steps' durations.
fn reference(c: &mut Criterion, name: &str, job: &JobConfig) -> Vec<Duration> {
    let mut per_step = Vec::new();
    let mut group = c.benchmark_group("train_step");
    group.throughput(Throughput::Elements(tokens(job) as u64));
    // A step takes 0.1–1 s: flat sampling (the same iterations per sample) suits long ones.
    group.sampling_mode(SamplingMode::Flat);
    let mut trainer = None;
    group.bench_function(name, |b| {
        let trainer = trainer.get_or_insert_with(|| {
            let mut t = Trainer::reference(&job.model, &job.data, &job.train)
                .expect("the job builds a trainer");
            // Warm the allocator and caches; the first steps are not representative.
            for _ in 0..2 {
                t.train_step().expect("a training step");
            }
            t
        });
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let started = Instant::now();
                black_box(trainer.train_step().expect("a training step"));
                let took = started.elapsed();
                per_step.push(took);
                total += took;
            }
            total
        })
    });
    group.finish();
    per_step
}

/// Steps of the in-process pipeline (1F1B over `job.stages`), each as long as its metrics
/// say; the first step of every run (thread start, first touch of every buffer) is left
/// out.
fn pipeline(c: &mut Criterion, name: &str, job: &JobConfig) -> Vec<Duration> {
    const STEPS: u64 = 4;
    let mut per_step = Vec::new();
    let mut group = c.benchmark_group("pipeline_1f1b");
    group.throughput(Throughput::Elements(tokens(job) as u64));
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let trainer = PipelineTrainer::builtin(job, ScheduleKind::OneFOneB, None)
                    .expect("the job builds a pipeline");
                let run = black_box(trainer.run(STEPS, |_| {}).expect("a pipelined run"));
                for m in run.steps.iter().skip(1) {
                    let took = Duration::from_secs_f64(m.seconds);
                    per_step.push(took);
                    total += took;
                }
            }
            total / (STEPS as u32 - 1)
        })
    });
    group.finish();
    per_step
}

/// Whether the bench's filter (its first argument that is not a flag) names `case`; no
/// filter names nothing, so the real-shape cases run only when asked for.
fn selected(case: &str) -> bool {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    filter.is_some_and(|f| case.contains(&f))
}

/// Measured steps of a real-shape case (`PIPEFILL_BENCH_STEPS`, default 3).
fn real_steps() -> u64 {
    let steps = std::env::var("PIPEFILL_BENCH_STEPS").ok();
    steps.and_then(|s| s.parse().ok()).unwrap_or(3)
}

/// A real-shape case under the reference trainer (`real/{case}/reference`) and the 2-stage
/// pipeline (`real/{case}/1f1b`, `/zbh1`, `/zbh2`), each selected by the filter on its own
/// (so that one process measures one, for its peak RSS): one warm-up step, then
/// [`real_steps`] timed ones.
fn real(case: &str, model: GptConfig) {
    let steps = real_steps();
    let single = job(model);
    let name = format!("real/{case}/reference");
    if selected(&name) {
        let mut trainer = Trainer::reference(&single.model, &single.data, &single.train)
            .expect("the job builds a trainer");
        trainer.train_step().expect("a training step");
        let per_step = (0..steps)
            .map(|_| {
                let started = Instant::now();
                black_box(trainer.train_step().expect("a training step"));
                started.elapsed()
            })
            .collect();
        report(&format!("reference trainer, {name}"), &single, per_step);
    }
    for (label, kind) in [
        ("1f1b", ScheduleKind::OneFOneB),
        ("zbh1", ScheduleKind::ZbH1),
        ("zbh2", ScheduleKind::ZbH2),
    ] {
        let name = format!("real/{case}/{label}");
        if !selected(&name) {
            continue;
        }
        // Timed by the wall clock, as the reference trainer is: the ranks share the job's
        // threads, and a step takes as long as it really did.
        let piped = JobConfig {
            stages: 2,
            clock: ClockKind::Wall,
            ..single.clone()
        };
        let trainer =
            PipelineTrainer::builtin(&piped, kind, None).expect("the job builds a pipeline");
        let run = trainer.run(steps + 1, |_| {}).expect("a pipelined run");
        let per_step = run.steps.iter().skip(1);
        let per_step = per_step
            .map(|m| Duration::from_secs_f64(m.seconds))
            .collect();
        report(
            &format!("in-process pipeline ({label}, 2 stages), {name}"),
            &piped,
            per_step,
        );
    }
}

fn main() {
    real("llama_135m", llama_135m());
    real("qwen2.5_0.5b", qwen_05b());
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8))
        .sample_size(10)
        .configure_from_args();
    let default = job(GptConfig::default());
    let steps = reference(&mut criterion, "default_model", &default);
    report("reference trainer, default model", &default, steps);
    let llama = job(llama_d256());
    let steps = reference(&mut criterion, "llama_d256", &llama);
    report("reference trainer, llama_d256", &llama, steps);
    let piped = JobConfig {
        stages: 2,
        ..llama.clone()
    };
    let steps = pipeline(&mut criterion, "llama_d256", &piped);
    report(
        "in-process pipeline (1f1b, 2 stages), llama_d256",
        &piped,
        steps,
    );
    criterion.final_summary();
}
