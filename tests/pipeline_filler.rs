//! Drafter training in the bubbles (`filler = "drafter"`): the target's training is exactly
//! that of a run without filler, every rank's drafter replica ends with the same weights,
//! the drafter learns, and its work fills the bubbles it is given.

use pipefill::config::{Filler, JobConfig};
use pipefill::pipeline::{PipelineRun, PipelineTrainer, StepView};
use pipefill::schedules::ScheduleKind;

/// The default model and pipeline (4 stages, 4 micro-batches), `steps` steps.
fn job(steps: u64) -> JobConfig {
    let mut job = JobConfig::default();
    job.train.steps = steps;
    job.train.eval_tasks = 0;
    job
}

fn run(job: &JobConfig, kind: ScheduleKind, filler: Filler) -> (PipelineRun, Vec<(f64, f64)>) {
    let trainer = PipelineTrainer::builtin(job, kind, None)
        .unwrap()
        .filler(filler);
    let mut fill = Vec::new();
    let run = trainer
        .run_observed(job.train.steps, |v: &StepView| {
            if let Some(p) = v.profile {
                fill.push((p.waited(), p.filled()));
            }
        })
        .unwrap();
    (run, fill)
}

#[test]
fn filler_work_never_touches_the_target() {
    let job = job(4);
    for kind in [ScheduleKind::ZbH1, ScheduleKind::OneFOneB] {
        let (bare, _) = run(&job, kind, Filler::None);
        let (filled, _) = run(&job, kind, Filler::Drafter);
        assert!(bare.drafter.is_none());
        let drafter = filled.drafter.as_ref().expect("the drafter ran");
        assert!(
            drafter.router.kinds["drafter"].slices > 0,
            "{kind}: no slice ran"
        );
        for name in bare.param_names() {
            let (a, b) = (
                bare.param_values(name).unwrap(),
                filled.param_values(name).unwrap(),
            );
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{kind}: `{name}` differs with the drafter in the bubbles"
            );
        }
        let losses = |r: &PipelineRun| r.steps.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
        assert_eq!(losses(&bare), losses(&filled), "{kind}");
    }
}

#[test]
fn drafter_replicas_hold_the_same_weights_after_every_step() {
    let (run, _) = run(&job(6), ScheduleKind::ZbH1, Filler::Drafter);
    let d = run.drafter.unwrap();
    assert_eq!(d.replicas.len(), 4, "one replica per rank");
    let first = &d.replicas[0];
    assert!(
        first.version >= 4,
        "only {} drafter steps in 6 target steps",
        first.version
    );
    for (rank, r) in d.replicas.iter().enumerate().skip(1) {
        assert_eq!(r.version, first.version, "rank {rank}'s replica");
        assert_eq!(
            r.frozen_step, first.frozen_step,
            "rank {rank}'s frozen copies"
        );
        assert_eq!(r.tensors.len(), first.tensors.len());
        for (a, b) in first.tensors.iter().zip(&r.tensors) {
            assert_eq!(a.name, b.name);
            assert!(
                a.values
                    .iter()
                    .zip(&b.values)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "rank {rank}'s `{}` differs from rank 0's at version {}",
                a.name,
                r.version
            );
        }
    }
    let k = &d.router.kinds;
    assert_eq!(k["drafter"].failed, 0);
    assert_eq!(k["drafter step"].failed, 0);
}

#[test]
fn the_drafter_learns_in_the_bubbles_it_fills() {
    let (run, fill) = run(&job(13), ScheduleKind::ZbH1, Filler::Drafter);
    let d = run.drafter.unwrap();
    // Measured at steps 0, 4, 8, 12 from the published weights, on rows never trained on.
    let curve: Vec<f64> = d.agreement.iter().map(|a| a.2).collect();
    assert!(curve.len() >= 3, "{:?}", d.agreement);
    assert!(
        curve[curve.len() - 1] > curve[0] + 0.05,
        "held-out agreement did not rise: {curve:?}"
    );
    // Most of the time the ranks wait for input runs drafter work (steps after the first,
    // whose first waits come before any row exists).
    let (waited, filled) = fill[1..]
        .iter()
        .fold((0.0, 0.0), |(w, f), (a, b)| (w + a, f + b));
    assert!(
        filled >= 0.8 * waited,
        "filled {filled} s of {waited} s waited"
    );
}
