//! Reference trainer throughput: training tokens per second of one optimizer step of the
//! default job (default model, 4 micro-batches × 4 sequences × 64 tokens) on the CPU
//! backend. Criterion reports the time per step and its throughput; afterwards the
//! median tokens/s over every measured step is printed, the figure quoted in reports.
//!
//! `cargo bench -p pipefill --bench train` (threads: `PIPEFILL_THREADS`, default all cores).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use pipefill::config::JobConfig;
use pipefill::train::Trainer;

fn main() {
    let mut job = JobConfig::default();
    if let Some(threads) = std::env::var("PIPEFILL_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
    {
        job.train.threads = threads;
    }
    let mut trainer = Trainer::reference(&job.model, &job.data, &job.train)
        .expect("the default job builds a trainer");
    let tokens = job.train.batch_size() * job.model.seq_len;
    // Warm the allocator and caches; the first steps are not representative.
    for _ in 0..2 {
        trainer.train_step().expect("a training step");
    }

    let mut per_step: Vec<Duration> = Vec::new();
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8))
        .sample_size(10)
        .configure_from_args();
    let mut group = criterion.benchmark_group("reference_trainer");
    group.throughput(Throughput::Elements(tokens as u64));
    // A step takes ~0.1 s: flat sampling (the same iterations per sample) suits long ones.
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("train_step/default_model", |b| {
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
    criterion.final_summary();

    if per_step.is_empty() {
        return;
    }
    per_step.sort();
    let median = per_step[per_step.len() / 2].as_secs_f64();
    println!(
        "reference trainer, default model ({} params) on {} thread(s): median step {:.1} ms, \
         median {:.0} tokens/s over {} steps of {} tokens",
        job.model.param_count(),
        pipefill::train::reference::cpu_threads(&job.train),
        median * 1e3,
        tokens as f64 / median,
        per_step.len(),
        tokens
    );
}
