//! In-process ranks timed by the wall clock share the job's threads: one pool that every
//! rank's operations run in, so a rank's bubble lends its cores to the others' products.
//! What they compute must not change: bitwise the reference trainer on one thread.

mod common;

use pipefill::config::JobConfig;
use pipefill::model::GptConfig;
use pipefill::model::config::Positions;
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::ScheduleKind;
use pipefill::tensor::Activation;
use pipefill::train::Trainer;

use common::job::{named_bits, tiny_job};

const STEPS: u64 = 2;

/// A job whose products are big enough to be split over threads (a micro-batch of
/// 4 × 64 tokens at width 256 is 16 M multiply-adds a projection), on `threads` threads.
fn job(stages: usize, threads: usize) -> JobConfig {
    let mut job = tiny_job(stages, STEPS);
    job.model = GptConfig {
        d_model: 256,
        heads: 4,
        kv_heads: Some(2),
        layers: 2,
        seq_len: 64,
        intermediate: Some(512),
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        tie_embeddings: true,
        ..GptConfig::default()
    };
    job.train.micro_batch_size = 4;
    job.train.threads = threads;
    job
}

#[test]
fn ranks_sharing_two_threads_compute_what_one_thread_computes() {
    let one = job(1, 1);
    let mut reference = Trainer::reference(&one.model, &one.data, &one.train).unwrap();
    let expected: Vec<_> = (0..STEPS)
        .map(|_| reference.train_step().unwrap())
        .collect();

    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let trainer = PipelineTrainer::builtin(&job(2, 2), kind, None)
            .unwrap()
            .clock(Clock::Wall);
        let run = trainer.run(STEPS, |_| {}).unwrap();
        for (got, want) in run.steps.iter().zip(&expected) {
            assert!(
                (got.loss - want.loss).abs() <= 1e-6,
                "{kind}: step {} loss {} against the reference's {}",
                got.step,
                got.loss,
                want.loss
            );
        }
        let model = reference.model();
        let want = named_bits(model.param_names(), |n| model.param_values(n).unwrap());
        let got = named_bits(model.param_names(), |n| {
            run.param_values(n).unwrap().to_vec()
        });
        assert!(
            got == want,
            "{kind}: the parameters differ from the reference's"
        );
    }
}
