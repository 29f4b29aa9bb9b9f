//! The schedule pipeline at scale: generate + lower + validate + simulate for p = 128 ranks,
//! v = 2 stages per rank and m = 4096 micro-batches (about 3 million compute actions,
//! 6–7 million after lowering). The target is well under a second per kind in release.
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
    let mut group = c.benchmark_group("generate+lower+validate+simulate p=128 v=2 m=4096");
    // Each iteration takes most of a second: ten equal samples of one iteration each.
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(10));
    for kind in [ScheduleKind::ZbV, ScheduleKind::Interleaved1F1B] {
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

criterion_group!(benches, pipeline);
criterion_main!(benches);
