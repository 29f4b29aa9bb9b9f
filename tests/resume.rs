//! Resume is bit-identical: a pipelined run of 3 steps, saved as a sharded checkpoint (one
//! shard per rank, manifest last), read back and continued for 3 steps, ends bitwise where
//! an uninterrupted 6-step run ends — parameters, AdamW moments and step counter, and the
//! losses of steps 3..6 (the data order). A checkpoint of another job is refused.
//!
//! With the drafter in the bubbles (`filler = "drafter"`) its state (weights, AdamW, version,
//! frozen copies, buffers, samplers) is saved with the checkpoint, read back bit for bit, and
//! a resumed run continues from that drafter version instead of a fresh drafter. Under the
//! default measured placement what runs in which bubble depends on measured times, so the
//! drafter after 3 + resume + 3 steps is not compared with 6 uninterrupted steps; the target
//! still is, bit for bit. Under `[drafter] placement = "planned"` the drafter is compared
//! too, bit for bit (tests/resume_fill.rs).

use std::path::Path;

use pipefill::config::{Filler, JobConfig};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::{
    Layout, latest, load_sharded, param_stages, save_sharded, step_dir,
};
use pipefill::pipeline::{PipelineRun, PipelineTrainer, StepView};

mod common;
use common::job::{one_replica_layout, sorted_bits, tiny_job};

const STEPS: u64 = 6;

/// Two stages, clipped on some steps (the clipped path is resumed too).
fn job() -> JobConfig {
    tiny_job(2, STEPS)
}

/// Saves `run`'s final state under `run_dir` in the sharded form.
fn save(run_dir: &Path, trainer: &PipelineTrainer, run: &PipelineRun) {
    let job = trainer.job();
    let stages = param_stages(&job.model, trainer.plan().stages).unwrap();
    let dir = step_dir(run_dir, run.next_step());
    let manifest = save_sharded(
        &dir,
        &run.checkpoint().unwrap(),
        &one_replica_layout(trainer),
        &stages,
        &job.fingerprint(),
    )
    .unwrap();
    assert_eq!(manifest.shards.len(), 2, "one shard per rank");
}

#[test]
fn three_steps_resume_three_steps_equals_six_bit_for_bit() {
    let job = job();
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let whole = trainer.run(STEPS, |_| {}).unwrap();

    let run_dir = tempfile::tempdir().unwrap();
    let first = trainer.run(3, |_| {}).unwrap();
    save(run_dir.path(), &trainer, &first);
    let dir = latest(run_dir.path())
        .unwrap()
        .expect("a complete checkpoint");
    let back = load_sharded(&dir, &one_replica_layout(&trainer), &job.fingerprint()).unwrap();
    assert_eq!(back.meta.step, 3);
    let rest = trainer.clone().resume(&back).run(3, |_| {}).unwrap();

    assert_eq!(rest.next_step(), STEPS);
    let (a, b) = (whole.checkpoint().unwrap(), rest.checkpoint().unwrap());
    assert!(
        a.tensors.iter().any(|t| t.name.starts_with("optim.m.")),
        "the comparison covers AdamW moments"
    );
    assert_eq!(a.meta.optimizer_step, b.meta.optimizer_step);
    assert!(
        sorted_bits(&a) == sorted_bits(&b),
        "parameters or moments differ after resume"
    );
    // Same data in the same order: the losses of the resumed steps are the same bits.
    let losses = |r: &PipelineRun, from: u64| -> Vec<(u64, u32)> {
        r.steps
            .iter()
            .filter(|m| m.step >= from)
            .map(|m| (m.step, m.loss.to_bits()))
            .collect()
    };
    assert_eq!(losses(&rest, 3), losses(&whole, 3));
    // The state did move: the checkpoint is not the initial model.
    let init = trainer.run(1, |_| {}).unwrap().checkpoint().unwrap();
    assert!(sorted_bits(&init) != sorted_bits(&back));
}

#[test]
fn a_checkpoint_of_another_job_or_layout_is_refused() {
    let job = job();
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let run_dir = tempfile::tempdir().unwrap();
    let first = trainer.run(1, |_| {}).unwrap();
    save(run_dir.path(), &trainer, &first);
    let dir = latest(run_dir.path()).unwrap().unwrap();

    let mut other = job.clone();
    other.train.lr = 2e-2;
    let err = load_sharded(&dir, &one_replica_layout(&trainer), &other.fingerprint())
        .unwrap_err()
        .to_string();
    assert!(err.contains("job settings"), "{err}");

    // Going further (more steps) is the same job: allowed.
    let mut longer = job.clone();
    longer.train.steps = 2 * STEPS;
    assert_eq!(longer.fingerprint(), job.fingerprint());

    let four = Layout {
        dp: 2,
        ..one_replica_layout(&trainer)
    };
    let err = load_sharded(&dir, &four, &job.fingerprint())
        .unwrap_err()
        .to_string();
    assert!(err.contains("written by 2 ranks"), "{err}");
}

#[test]
fn a_run_checkpointing_every_three_steps_resumes_from_its_middle_checkpoint_bit_for_bit() {
    let job = job();
    let run_dir = tempfile::tempdir().unwrap();
    let trainer = PipelineTrainer::from_job(&job).unwrap();
    let whole = trainer
        .clone()
        .checkpoint_every(3, run_dir.path())
        .run(STEPS, |_| {})
        .unwrap();
    // Saved during the run after steps 3 and 6; the last equals the run's final state.
    assert_eq!(
        latest(run_dir.path()).unwrap(),
        Some(step_dir(run_dir.path(), 6))
    );
    let (layout, hash) = (one_replica_layout(&trainer), job.fingerprint());
    let last = load_sharded(&step_dir(run_dir.path(), 6), &layout, &hash).unwrap();
    assert!(sorted_bits(&last) == sorted_bits(&whole.checkpoint().unwrap()));
    assert_eq!(last.meta.optimizer_step, 6);

    // As if the run had stopped after step 3: resume from that checkpoint.
    let middle = load_sharded(&step_dir(run_dir.path(), 3), &layout, &hash).unwrap();
    let rest = trainer.resume(&middle).run(3, |_| {}).unwrap();
    assert!(sorted_bits(&rest.checkpoint().unwrap()) == sorted_bits(&whole.checkpoint().unwrap()));
}

#[test]
fn the_drafter_is_saved_with_the_checkpoint_and_a_resumed_run_continues_it() {
    let job = JobConfig {
        filler: Filler::Drafter,
        ..job()
    };
    let trainer = PipelineTrainer::from_job(&job)
        .unwrap()
        .filler(Filler::Drafter);
    let run_dir = tempfile::tempdir().unwrap();
    let whole = trainer.run(STEPS, |_| {}).unwrap();
    let first = trainer
        .clone()
        .checkpoint_every(3, run_dir.path())
        .run(3, |_| {})
        .unwrap();
    let state = first.drafter_state().expect("the drafter's state").clone();
    let version = state.weights.version;
    // One exchange round per target step (each applied once every rank posted it).
    assert!(version >= 2, "drafter version {version} after 3 steps");
    assert_eq!(state.samplers.len(), 2, "one sampler per replica (rank)");
    assert!(
        !state.buffer.current.is_empty(),
        "the buffer's rows are kept"
    );

    // Saved == restored, whole and sharded (the periodic checkpoint of step 3 took the
    // drafter as the last rank finished step 3; the final one after the run settled).
    let final_dir = tempfile::tempdir().unwrap();
    let mut c = first.checkpoint().unwrap();
    c.save(final_dir.path()).unwrap();
    let back = Checkpoint::load(final_dir.path()).unwrap();
    assert!(
        back.drafter.as_ref() == Some(&state),
        "whole checkpoint round trip"
    );
    let (layout, hash) = (one_replica_layout(&trainer), job.fingerprint());
    let periodic = load_sharded(&step_dir(run_dir.path(), 3), &layout, &hash).unwrap();
    let saved = periodic
        .drafter
        .expect("the periodic checkpoint has the drafter");
    assert!(saved.weights.version >= 1 && saved.weights.version <= version);
    let resaved = tempfile::tempdir().unwrap();
    let stages = param_stages(&job.model, trainer.plan().stages).unwrap();
    save_sharded(resaved.path(), &back, &layout, &stages, &hash).unwrap();
    let again = load_sharded(resaved.path(), &layout, &hash).unwrap();
    assert!(again.drafter.as_ref() == Some(&state), "sharded round trip");

    // The resumed run starts from the saved version (a fresh drafter reports at most 1
    // after its first step).
    let mut versions = Vec::new();
    let rest = trainer
        .clone()
        .resume(&back)
        .run_observed(3, |v: &StepView| {
            versions.extend(v.drafter.as_ref().map(|d| d.version))
        })
        .unwrap();
    assert_eq!(versions.len(), 3);
    assert!(
        versions[0] >= version,
        "{versions:?} from version {version}"
    );
    assert!(rest.drafter_state().unwrap().weights.version > version);
    // Filling never touches the target: it ends where 6 uninterrupted steps end.
    assert!(sorted_bits(&rest.checkpoint().unwrap()) == sorted_bits(&whole.checkpoint().unwrap()));
}
