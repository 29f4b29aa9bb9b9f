//! Per-action overhead of the actor runtime: a no-op `StageCompute` on the in-process
//! transport, 4 ranks, 1F1B with 64 micro-batches. Every measured nanosecond is runtime:
//! plan walking, payload hand-off between stage threads, records, reports, actor messages.
//!
//! Criterion's reported time is per action (each sample runs whole iterations and scales
//! the elapsed time to the number of actions it asked for). Run with
//! `cargo bench -p pipefill-actors --bench overhead`.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use pipefill_actors::{Clock, Pipeline, PlanSource, StageCompute};
use pipefill_schedules::{Plan, ScheduleKind, build};

/// Does nothing but pass an empty payload on.
struct NoOp;

impl StageCompute for NoOp {
    type Tensor = ();
    type Error = Infallible;

    fn forward(&mut self, _: u32, _: u32, _: Option<()>) -> Result<Option<()>, Infallible> {
        Ok(Some(()))
    }
    fn backward_input(&mut self, _: u32, _: u32, _: Option<()>) -> Result<Option<()>, Infallible> {
        Ok(Some(()))
    }
    fn backward_weight(&mut self, _: u32, _: u32) -> Result<(), Infallible> {
        Ok(())
    }
}

/// Runs `iterations` iterations of `plan` and returns the elapsed time.
fn run(rt: &tokio::runtime::Runtime, plan: &Plan, clock: Clock, iterations: u64) -> Duration {
    let computes = (0..plan.num_ranks()).map(|_| NoOp).collect();
    let job = Pipeline::new(PlanSource::Given(plan.clone()), clock).iterations(iterations);
    let start = Instant::now();
    rt.block_on(job.run(computes)).expect("no-op run");
    start.elapsed()
}

fn overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let plan = build(ScheduleKind::OneFOneB, 4, 64, 1).expect("1F1B plan");
    let per_iteration = plan.num_actions() as u64;
    let mut group = c.benchmark_group("runtime overhead per action (4 ranks, 1F1B, m=64)");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    for (name, clock) in [("wall", Clock::Wall), ("virtual", Clock::virtual_free())] {
        group.bench_function(name, |b| {
            b.iter_custom(|actions| {
                let iterations = actions.div_ceil(per_iteration).max(1);
                let elapsed = run(&rt, &plan, clock, iterations);
                elapsed.mul_f64(actions as f64 / (iterations * per_iteration) as f64)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);
