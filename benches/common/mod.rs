//! Timing helpers the micro-benchmarks share: criterion runs the iterations, and each
//! iteration's own time is kept too, so a bench can print medians and ratios of its cases
//! side by side in one table after criterion's summary.

use std::time::{Duration, Instant};

use criterion::Criterion;

/// Criterion for cases of a few milliseconds: short warm-up and measurement, 10 samples.
pub fn quick_criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
        .configure_from_args()
}

/// An `iter_custom` body that runs `f` `iters` times, pushing each run's time onto `per`.
pub fn timed(per: &mut Vec<Duration>, f: impl FnMut()) -> impl FnMut(u64) -> Duration {
    timed_after(per, || {}, f)
}

/// [`timed`], with `before` run ahead of each run of `f`, untimed (to evict the caches,
/// or to prepare the run's input).
pub fn timed_after(
    per: &mut Vec<Duration>,
    mut before: impl FnMut(),
    mut f: impl FnMut(),
) -> impl FnMut(u64) -> Duration {
    move |iters| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            before();
            let t = Instant::now();
            f();
            let took = t.elapsed();
            per.push(took);
            total += took;
        }
        total
    }
}

/// The median of `v` in milliseconds (NaN when empty).
pub fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2)
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// The default job's model at another width: the benches' targets differ only in `d_model`.
#[allow(dead_code)] // not every bench builds a model
pub fn model_config(d_model: usize) -> pipefill::model::GptConfig {
    let mut c = pipefill::config::JobConfig::default().model;
    c.d_model = d_model;
    c
}
