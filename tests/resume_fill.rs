//! The planned placement of drafter work (`[drafter] placement = "planned"`) makes the drafter
//! reproducible: what runs in which step is a function of the plan, the configs and the step,
//! so two runs train the same drafter bit for bit (weights, AdamW, version, samplers, buffers,
//! the posted round), N steps + resume + N steps equal 2N steps for the target, its optimizer
//! AND the drafter (from the final checkpoint and from the periodic one), and the target is
//! that of the run without filling.

use std::path::Path;

use pipefill::config::{Filler, JobConfig};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::sharded::{load_sharded, step_dir};
use pipefill::model::drafter::FillMode;
use pipefill::model::drafter::state::DrafterState;
use pipefill::pipeline::{PipelineRun, PipelineTrainer};

mod common;
use common::job::{one_replica_layout, tiny_job};

/// Steps of each half.
const N: u64 = 3;

/// The tiny pipelined job on 2 stages with the drafter in its bubbles, planned.
fn job() -> JobConfig {
    let mut job = tiny_job(2, 2 * N);
    job.filler = Filler::Drafter;
    job.drafter.placement = FillMode::Planned;
    job
}

fn trainer(job: &JobConfig) -> PipelineTrainer {
    PipelineTrainer::from_job(job).unwrap().filler(job.filler)
}

/// Every float of the target's checkpoint (parameters and AdamW moments) as bits, by name.
fn target_bits(run: &PipelineRun) -> Vec<(String, Vec<u32>)> {
    let c = run.checkpoint().unwrap();
    let mut t: Vec<_> = c
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect();
    t.sort();
    t
}

/// Every float of the drafter's state as bits, by name, and the rest (version, AdamW step,
/// samplers, rows' targets and steps, the posted round's shape) as JSON.
fn drafter_bits(job: &JobConfig, state: &DrafterState) -> (Vec<(String, Vec<u32>)>, String) {
    let (tensors, meta) = state.to_parts(job.model.d_model);
    let mut t: Vec<_> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect();
    t.sort();
    (t, serde_json::to_string(&meta).unwrap())
}

fn drafter_of(job: &JobConfig, run: &PipelineRun) -> (Vec<(String, Vec<u32>)>, String) {
    drafter_bits(job, run.drafter_state().expect("the drafter's state"))
}

/// Slices the run's router handed out in bubbles.
fn bubble_slices(run: &PipelineRun) -> u64 {
    let stats = &run.drafter.as_ref().expect("a drafter run").router;
    stats.kinds.get("drafter").map_or(0, |k| k.slices)
}

#[test]
fn two_planned_runs_train_the_same_drafter_bit_for_bit() {
    let job = job();
    let a = trainer(&job).run(2 * N, |_| {}).unwrap();
    let b = trainer(&job).run(2 * N, |_| {}).unwrap();
    let state = a.drafter_state().unwrap();
    assert!(
        state.weights.version >= 2,
        "the drafter trained: version {}",
        state.weights.version
    );
    assert!(state.round.is_some(), "the last step's round is kept");
    assert!(bubble_slices(&a) > 0, "no slice ran in a bubble");
    assert!(
        drafter_of(&job, &a) == drafter_of(&job, &b),
        "two runs trained different drafters"
    );
}

fn save_and_load(run: &PipelineRun, dir: &Path) -> Checkpoint {
    run.checkpoint().unwrap().save(dir).unwrap();
    Checkpoint::load(dir).unwrap()
}

#[test]
fn n_steps_resume_n_steps_equal_2n_steps_with_the_drafter_bit_for_bit() {
    let job = job();
    let t = trainer(&job);
    let run_dir = tempfile::tempdir().unwrap();
    let whole = t
        .clone()
        .checkpoint_every(N, run_dir.path())
        .run(2 * N, |_| {})
        .unwrap();
    let (target, drafter) = (target_bits(&whole), drafter_of(&job, &whole));

    // From the final checkpoint of an N-step run (saved whole and read back).
    let first = t.run(N, |_| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let back = save_and_load(&first, dir.path());
    assert_eq!(back.meta.step, N);
    let rest = t.clone().resume(&back).run(N, |_| {}).unwrap();
    assert!(
        target_bits(&rest) == target,
        "the target differs after resume"
    );
    assert!(
        drafter_of(&job, &rest) == drafter,
        "the drafter differs after resume (final checkpoint)"
    );

    // From the periodic checkpoint the 2N-step run saved after step N (sharded).
    let periodic = load_sharded(
        &step_dir(run_dir.path(), N),
        &one_replica_layout(&t),
        &job.fingerprint(),
    )
    .unwrap();
    assert!(periodic.drafter.is_some());
    let rest = t.clone().resume(&periodic).run(N, |_| {}).unwrap();
    assert!(target_bits(&rest) == target);
    assert!(
        drafter_of(&job, &rest) == drafter,
        "the drafter differs after resume (periodic checkpoint)"
    );
}

#[test]
fn planned_filling_leaves_the_target_of_the_unfilled_run() {
    let job = job();
    let filled = trainer(&job).run(2 * N, |_| {}).unwrap();
    assert!(bubble_slices(&filled) > 0);
    let plain = JobConfig {
        filler: Filler::None,
        ..job.clone()
    };
    let unfilled = trainer(&plain).run(2 * N, |_| {}).unwrap();
    assert!(unfilled.drafter.is_none());
    assert!(target_bits(&filled) == target_bits(&unfilled));
}

/// The drafter's file keeps no frozen table when a refresh was due at the checkpoint's step
/// (the tables are the target's weights in the same checkpoint), and keeps them when
/// `refresh_every` left them behind the target's; either way N + resume + N equals 2N.
#[test]
fn the_frozen_tables_travel_in_the_file_only_when_they_lag_the_target() {
    let frozen_in = |state: &DrafterState| {
        let (tensors, _) = state.to_parts(job().model.d_model);
        let names = ["embed.tok", "head.w"];
        tensors
            .iter()
            .filter(|t| names.iter().any(|n| t.name.ends_with(n)))
            .count()
    };
    for (refresh_every, tables) in [(1, 0), (2, 2)] {
        let mut job = job();
        job.drafter.refresh_every = refresh_every;
        let t = trainer(&job);
        let whole = t.clone().run(2 * N, |_| {}).unwrap();
        let first = t.run(N, |_| {}).unwrap();
        // After step N − 1 = 2: a refresh was due there with every step, not every second.
        let saved = first.drafter_state().unwrap();
        assert_eq!(frozen_in(saved), tables, "refresh_every = {refresh_every}");
        let dir = tempfile::tempdir().unwrap();
        let back = save_and_load(&first, dir.path());
        let rest = t.clone().resume(&back).run(N, |_| {}).unwrap();
        assert!(target_bits(&rest) == target_bits(&whole));
        assert!(
            drafter_of(&job, &rest) == drafter_of(&job, &whole),
            "refresh_every = {refresh_every}: the drafter differs after resume"
        );
    }
}
