//! The schedule pipeline at scale, p = 128 ranks, v = 2 stages per rank and m = 4096
//! micro-batches (about 3 million compute actions, 6–7 million after lowering):
//! - `validate+simulate`: checking and simulating an already lowered plan, the figure the
//!   target is stated for (under a second per kind in release);
//! - `generate+lower+validate+simulate`: the whole path from a schedule name.
//!
//! Run with `cargo bench -p pipefill-schedules --bench simulate`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use pipefill_schedules::{CostModel, ScheduleKind, ValidateOptions, build, simulate, validate};

const RANKS: usize = 128;
const CHUNKS: usize = 2;
const MICROBATCHES: usize = 4096;

fn pipeline(c: &mut Criterion) {
    let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.05);
    let opts = ValidateOptions {
        cost: cost.clone(),
        memory_limit: None,
    };
    let kinds = [ScheduleKind::ZbV, ScheduleKind::Interleaved1F1B];

    let mut group = c.benchmark_group("validate+simulate p=128 v=2 m=4096");
    flat(&mut group);
    for kind in kinds {
        let plan = build(kind, RANKS, MICROBATCHES, CHUNKS).unwrap();
        group.bench_function(kind.name(), |b| {
            b.iter(|| {
                validate(black_box(&plan), &opts).unwrap();
                simulate(black_box(&plan), &cost).unwrap()
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("generate+lower+validate+simulate p=128 v=2 m=4096");
    flat(&mut group);
    for kind in kinds {
        group.bench_function(kind.name(), |b| {
            b.iter(|| {
                let plan = build(kind, RANKS, black_box(MICROBATCHES), CHUNKS).unwrap();
                validate(&plan, &opts).unwrap();
                simulate(&plan, &cost).unwrap()
            })
        });
    }
    group.finish();
}

/// Each iteration takes most of a second: ten equal samples of one iteration each.
fn flat(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(8));
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
