//! Drafter training in the bubbles (`filler = "drafter"`): the target's training is exactly
//! that of a run without filler, every rank's drafter replica ends with the same weights,
//! the drafter learns, and its work fills the bubbles it is given; the replay that measures
//! step inflation gives an unfilled run back its own timeline.

use pipefill::config::{Filler, JobConfig};
use pipefill::pipeline::{Clock, PipelineRun, PipelineTrainer, StepMode, StepView};
use pipefill::profile::report::{replay, replay_makespans};
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
    // The four replicas read one embedding and one head between them, not a copy each.
    let job = job(6);
    let table = 4 * job.model.vocab * job.model.d_model;
    assert_eq!(
        d.frozen_table_bytes,
        2 * table,
        "the replicas' frozen tables"
    );
    for (rank, r) in d.replicas.iter().enumerate().skip(1) {
        assert_eq!(r.version, first.version, "rank {rank}'s replica");
        assert_eq!(
            r.frozen_step, first.frozen_step,
            "rank {rank}'s frozen tables"
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

#[test]
fn an_unfilled_run_replays_to_its_measured_timeline() {
    // The replay that measures step inflation, run on real steps without filler, must give
    // back each step's own makespan (and each action its own times): any gap it cannot
    // explain would read as inflation. Every way a rank can take its optimizer step: the
    // default post-validation (stepping at the end of a walk or deferred to the next),
    // speculative steps, and the barrier.
    let job = job(4);
    type Setup = fn(PipelineTrainer) -> PipelineTrainer;
    let cases: [(ScheduleKind, Setup); 5] = [
        (ScheduleKind::ZbH1, |t| t),
        (ScheduleKind::OneFOneB, |t| t),
        (ScheduleKind::ZbH2, |t| t),
        (ScheduleKind::ZbH1, |t| t.speculative_steps(true)),
        (ScheduleKind::OneFOneB, |t| t.step_mode(StepMode::Barrier)),
    ];
    for (case, (kind, setup)) in cases.into_iter().enumerate() {
        let trainer = setup(PipelineTrainer::builtin(&job, kind, None).unwrap());
        let run = trainer.run(job.train.steps, |_| {}).unwrap();
        let its = &run.report.iterations;
        assert_eq!(its.len() as u64, job.train.steps);
        let Clock::Virtual { link_latency } = run.report.clock else {
            panic!("the default job runs on the virtual clock");
        };
        let replayed = replay_makespans(its, link_latency).unwrap();
        for (it, replayed) in its.iter().zip(replayed) {
            let measured = it.timeline.makespan;
            assert!(
                (replayed - measured).abs() <= 1e-9 * measured,
                "{kind} (case {case}) step {}: replayed {replayed}, measured {measured}",
                it.iteration
            );
        }
        let records: Vec<_> = its.iter().flat_map(|it| it.records.clone()).collect();
        let steps: Vec<_> = its.iter().flat_map(|it| it.steps.clone()).collect();
        let times = replay(&records, &steps, link_latency).unwrap();
        for (m, r) in records.iter().zip(&times) {
            assert!(
                (m.start - r.start).abs() <= 1e-9 * m.end && (m.end - r.end).abs() <= 1e-9 * m.end,
                "{kind} (case {case}) rank {} step {} {}: measured {:?}, replayed {:?}",
                m.rank,
                m.iteration,
                m.action,
                (m.start, m.end),
                (r.start, r.end)
            );
        }
    }
}
