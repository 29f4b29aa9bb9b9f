//! The drafter's training in the rollout stages' idle gaps ([`DrafterSlices`]): the gaps of
//! the long tail are far shorter than a whole slice, so the step's slices are cut into
//! pieces sized to them, with one optimizer step per slice's worth of rows. The router's
//! inputs are set so that a whole slice never fits a gap (its prior says 10 s) while a
//! smallest piece fits any gap of a millisecond, and the driver spends 10 ms on every
//! proposal, so every stage waits at least that long between messages: pieces must run in
//! the gaps, whole slices could not. The samples, greedy or sampled, stay those of the same
//! rollout without the hook. With `rl.advanced.drafter_work = "idle"` nothing runs after the
//! rollout: the budget's rest is carried to the next step (capped at one step's budget), the
//! held-out rows are evaluated in the gaps, and the priors are measured up front.

mod common;

use common::rollouts::config;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pipefill::data::SplitMix64;
use pipefill::model::drafter::{
    DraftBufferHandle, DraftChain, DraftContext, Drafter, DrafterConfig, DrafterTrainer,
};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt};
use pipefill::rl::RlError;
use pipefill::rl::rollout::idle::{
    DRAFTER, DRAFTER_EVAL, DRAFTER_STEP, DrafterSlices, DrafterWork, EvalWork, MIN_PIECE_ROWS,
    RolloutRouter,
};
use pipefill::rl::rollout::{
    MessageHook, Request, RolloutConfig, RolloutEngine, RolloutOutput, Speculation,
};
use pipefill::rl::speculative::Proposer;
use pipefill::tensor::CpuBackend;
use pipefill_actors::FillerRouter;
use pipefill_actors::router::CostEstimate;

const STAGES: usize = 4;
/// Whole slices of budget per rollout.
const SLICES: usize = 2;

/// Slices of 4 sequences × 64 positions: large enough to be cut into pieces of at least
/// `MIN_PIECE_ROWS` rows (the job's default slice, 1 × 16, is one piece already).
fn drafter_config() -> DrafterConfig {
    DrafterConfig {
        batch_rows: 4,
        max_positions: 64,
        ..DrafterConfig::default()
    }
}

fn drafter() -> Drafter<CpuBackend> {
    Drafter::new(&config(), &drafter_config(), CpuBackend::new(1).unwrap()).unwrap()
}

/// The drafter's proposals, 10 ms slower: the stages wait for the driver at least that.
struct Slow(Drafter<CpuBackend>);

impl Proposer for Slow {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        std::thread::sleep(Duration::from_millis(10));
        Proposer::propose(&mut self.0, contexts, k, temperature, rng)
    }
}

/// Ragged prompts and caps: a long tail.
fn requests() -> Vec<Request> {
    let mut rng = SplitMix64::new(9);
    (0..8)
        .map(|i| Request {
            prompt: (0..2 + i % 3).map(|_| 3 + rng.below(47) as u32).collect(),
            max_new: 4 + (i * 11) % 30,
        })
        .collect()
}

fn rollout(
    gpt: &Gpt<CpuBackend>,
    temperature: f32,
    hook: Option<Arc<RolloutRouter>>,
) -> RolloutOutput {
    let stages = InferStage::stages_of(gpt, &Cut::Even(STAGES)).unwrap();
    let mut engine = RolloutEngine::new(stages).unwrap();
    if let Some(h) = hook {
        engine = engine.with_hook(h as Arc<dyn MessageHook>);
    }
    let cfg = RolloutConfig {
        groups: STAGES,
        temperature,
        seed: 5,
        speculation: Speculation::Fixed { k: 3 },
        record_rows: true,
        ..RolloutConfig::default()
    };
    // The same weights every time (the drafter's seed): what proposes is never trained.
    let mut proposer = Slow(drafter());
    engine.run(&requests(), &cfg, Some(&mut proposer)).unwrap()
}

#[test]
fn idle_gaps_train_the_drafter_in_pieces_and_change_no_sample() {
    let gpt = common::rollouts::gpt();
    for temperature in [0.0, 1.0] {
        let plain = rollout(&gpt, temperature, None);

        // The trainer starts with a previous rollout's rows.
        let buffer = DraftBufferHandle::new(&config(), &drafter_config());
        buffer.begin_step(0);
        for row in &plain.rows {
            buffer.lock().push(row.clone()).unwrap();
        }
        buffer.begin_step(1);
        let trainer = DrafterTrainer::new(drafter(), buffer.clone(), 0, 1).unwrap();
        let trainer = Arc::new(Mutex::new(trainer));
        let router = FillerRouter::default();
        let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
        let full = slices.full_rows();
        assert!(full > MIN_PIECE_ROWS);
        // A whole slice is predicted to cost 10 s, a smallest piece 1 ms: only pieces fit.
        let slope = (10.0 - 1e-3) / (full - MIN_PIECE_ROWS) as f64;
        router.set_prior_line(DRAFTER, CostEstimate::prior_line(full as f64, 10.0, slope));
        router.set_prior(DRAFTER_STEP, 0.0);
        slices.begin(SLICES, &router);
        assert_eq!(slices.rows_left(), SLICES * full);

        let hook = Arc::new(
            RolloutRouter::new(router.clone(), STAGES, true)
                .with_rows(buffer.clone(), 2)
                .with_drafter(slices.clone()),
        );
        let spec = rollout(&gpt, temperature, Some(Arc::clone(&hook)));
        // The drafter trained during the rollout is not the one that proposed.
        assert_eq!(spec.sequences, plain.sequences, "temperature {temperature}");

        let report = hook.report();
        let idle = slices.idle_work();
        assert!(
            report.drafter_slices >= 1,
            "no piece in the gaps: {report:?}"
        );
        assert_eq!(report.drafter_slices, idle.pieces);
        assert_eq!(report.drafter_steps, idle.steps);
        assert_eq!(report.drafter_rows, idle.rows);
        // Cut finer than whole slices (the first ones, under the prior, are the smallest).
        assert!(idle.pieces > idle.rows / full, "{idle:?}");
        let pieces: Vec<_> = (report.spans.iter())
            .filter(|s| s.kind == DRAFTER && s.label.starts_with("drafter slice"))
            .collect();
        assert_eq!(pieces.len(), idle.pieces);
        assert!(pieces.iter().all(|s| s.error.is_none()), "{pieces:?}");
        // One optimizer step per whole slice's worth of rows, none before.
        let version = trainer.lock().unwrap().version() as usize;
        assert_eq!(version, idle.steps);
        assert_eq!(version, idle.rows / full);
        assert_eq!(slices.rows_left(), SLICES * full - idle.rows);

        // After the rollout the rest of the budget runs here: as many steps as slices.
        let after = slices.finish().unwrap();
        assert_eq!(idle.rows + after.rows, SLICES * full);
        assert_eq!(idle.steps + after.steps, SLICES);
        assert_eq!(trainer.lock().unwrap().version() as usize, SLICES);
        assert_eq!(trainer.lock().unwrap().pending_slices(), 0);
        assert_eq!(slices.rows_left(), 0);
    }
}

/// Pieces only accumulate: the trainer steps once per whole slice's worth of rows,
/// whatever the pieces' sizes, and a budget's rest finishes the slice it is in.
#[test]
fn pieces_accumulate_into_one_step_per_slice() {
    let gpt = common::rollouts::gpt();
    let rows = rollout(&gpt, 0.0, None).rows;
    let buffer = DraftBufferHandle::new(&config(), &drafter_config());
    buffer.begin_step(0);
    for row in rows {
        buffer.lock().push(row).unwrap();
    }
    let mut trainer = DrafterTrainer::new(drafter(), buffer, 0, 1).unwrap();
    let full = trainer.max_slice_rows();
    let mut sum = 0;
    for piece in [MIN_PIECE_ROWS, 2 * MIN_PIECE_ROWS, MIN_PIECE_ROWS] {
        let size = trainer.slice_size(piece);
        trainer.accumulate_within(size).unwrap();
        sum += size;
        assert_eq!(trainer.version(), 0, "no step before a slice's worth");
    }
    assert_eq!(trainer.pending_slices(), 3);
    trainer.accumulate_within(full - sum).unwrap();
    assert_eq!(trainer.step_accumulated().unwrap(), 1);
    assert_eq!(trainer.pending_slices(), 0);

    // Through DrafterSlices with no gaps: everything runs in `finish`.
    let router = FillerRouter::default();
    let trainer = Arc::new(Mutex::new(trainer));
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    slices.begin(3, &router);
    let done = slices.finish().unwrap();
    assert_eq!((done.rows, done.steps, done.pieces), (3 * full, 3, 3));
    assert_eq!(trainer.lock().unwrap().version(), 4);
    // The next step's budget starts from a prior line through the whole slice measured.
    slices.begin(1, &router);
    let estimate = router.stats().kinds[DRAFTER].estimate;
    assert_eq!(estimate.samples, 0);
    assert!(estimate.slope > 0.0 && estimate.line(full as f64) > 0.0);
    assert!(estimate.line(MIN_PIECE_ROWS as f64) < estimate.line(full as f64));
    assert!(router.stats().kinds.contains_key(DRAFTER_STEP));
}

/// The trainer of a fresh drafter whose buffer holds `rows` as step 0's rows, now at step 1.
fn trainer_on(
    rows: &[pipefill::model::drafter::DraftRow],
) -> Arc<Mutex<DrafterTrainer<CpuBackend>>> {
    let buffer = DraftBufferHandle::new(&config(), &drafter_config());
    buffer.begin_step(0);
    for row in rows {
        buffer.lock().push(row.clone()).unwrap();
    }
    buffer.begin_step(1);
    Arc::new(Mutex::new(
        DrafterTrainer::new(drafter(), buffer, 0, 1).unwrap(),
    ))
}

#[test]
fn a_deferred_step_trains_only_in_the_gaps_and_carries_the_rest() {
    let gpt = common::rollouts::gpt();
    let plain = rollout(&gpt, 0.0, None);
    let trainer = trainer_on(&plain.rows);
    let buffer = trainer.lock().unwrap().buffer().clone();
    let router = FillerRouter::default();
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    let full = slices.full_rows();
    // As above: only pieces fit; an evaluation fits any gap.
    let slope = (10.0 - 1e-3) / (full - MIN_PIECE_ROWS) as f64;
    router.set_prior_line(DRAFTER, CostEstimate::prior_line(full as f64, 10.0, slope));
    router.set_prior(DRAFTER_STEP, 0.0);
    router.set_prior(DRAFTER_EVAL, 0.0);
    // More than the gaps can take.
    const BUDGET: usize = 1000;
    slices.begin_carrying(BUDGET, &router);
    let begun = slices.account();
    assert_eq!(
        (begun.leftover, begun.budget_rows),
        ("defer", BUDGET * full)
    );
    assert_eq!(begun.carried_in_rows, 0);

    let held = 2;
    let hook = Arc::new(
        RolloutRouter::new(router.clone(), STAGES, true)
            .with_rows(buffer.clone(), held)
            .with_drafter(slices.clone()),
    );
    let spec = rollout(&gpt, 0.0, Some(Arc::clone(&hook)));
    assert_eq!(spec.sequences, plain.sequences);
    let report = hook.report();
    let idle = slices.idle_work();
    assert!(
        report.drafter_slices >= 1,
        "no piece in the gaps: {report:?}"
    );
    let version = trainer.lock().unwrap().version();
    let accumulated = trainer.lock().unwrap().pending_slices();

    // The step ends: nothing trains here, the rest of the budget is carried.
    let account = slices.defer();
    assert_eq!(trainer.lock().unwrap().version(), version);
    assert_eq!(trainer.lock().unwrap().pending_slices(), accumulated);
    assert_eq!(account.after, DrafterWork::default());
    assert_eq!(account.eval_after, EvalWork::default());
    assert_eq!(account.idle, idle);
    let left = BUDGET * full - idle.rows;
    assert!(left > 0, "the gaps took the whole budget: {idle:?}");
    assert_eq!((account.carried_out_rows, account.dropped_rows), (left, 0));
    assert_eq!(slices.rows_left(), left);
    // Rows accumulated since the last optimizer step stay, for the next step's gaps.
    assert_eq!(account.pending_rows, idle.rows - idle.steps * full);
    // The held-out rows: evaluated in the gaps or, if none fitted, sent to training as
    // they are; every row with a training pair ends in the buffer either way.
    assert_eq!(account.eval_idle.rows + account.eval_skipped_rows, held);
    assert_eq!(report.drafter_evals, account.eval_idle.pieces);
    // (an evaluation is predicted free here, so the gaps take it.)
    assert!(account.eval_idle.rows > 0, "{account:?}");
    assert!(slices.held_out_stats().unwrap().pairs > 0);
    let trainable = spec.rows.iter().filter(|r| r.pairs() > 0).count();
    assert_eq!(buffer.lock().current_len(), trainable);

    // The next step's budget adds what was carried.
    slices.begin_carrying(BUDGET, &router);
    let next = slices.account();
    assert_eq!(next.carried_in_rows, left);
    assert_eq!(next.budget_rows, left + BUDGET * full);
    assert_eq!(slices.rows_left(), left + BUDGET * full);
    assert_eq!(next.idle, DrafterWork::default());
}

#[test]
fn the_carry_is_capped_at_one_steps_budget_and_after_runs_the_rest_here() {
    let gpt = common::rollouts::gpt();
    let rows = rollout(&gpt, 0.0, None).rows;
    let trainer = trainer_on(&rows);
    let buffer = trainer.lock().unwrap().buffer().clone();
    let router = FillerRouter::default();
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    let full = slices.full_rows();

    // No rollout, so no gap: a whole step's budget is carried, nothing dropped or run.
    slices.begin_carrying(3, &router);
    let first = slices.defer();
    assert_eq!((first.carried_out_rows, first.dropped_rows), (3 * full, 0));
    assert_eq!(first.idle, DrafterWork::default());
    assert_eq!(first.after, DrafterWork::default());
    assert_eq!(trainer.lock().unwrap().version(), 0);
    // Twice the budget left: one step's worth carried, the other dropped.
    slices.begin_carrying(3, &router);
    assert_eq!(slices.account().budget_rows, 6 * full);
    let held = &rows[0];
    assert!(slices.hold(held), "a deferred step evaluates in the gaps");
    let before = buffer.lock().current_len();
    let second = slices.defer();
    assert_eq!(
        (second.carried_out_rows, second.dropped_rows),
        (3 * full, 3 * full)
    );
    assert_eq!(slices.rows_left(), 3 * full);
    // The held row no gap evaluated went to training unevaluated.
    assert_eq!(second.eval_skipped_rows, 1);
    assert!(slices.held_out_stats().is_none());
    assert_eq!(
        buffer.lock().current_len(),
        before + usize::from(held.pairs() > 0)
    );
    // A budget of nothing carries nothing.
    slices.begin_carrying(0, &router);
    let none = slices.defer();
    assert_eq!((none.carried_out_rows, none.dropped_rows), (0, 3 * full));

    // "after": a fresh budget whatever was carried, evaluated by the caller, run here.
    slices.begin(2, &router);
    assert!(!slices.hold(held));
    assert_eq!(slices.rows_left(), 2 * full);
    assert_eq!(slices.account().leftover, "after");
    let done = slices.finish().unwrap();
    assert_eq!((done.rows, done.steps), (2 * full, 2));
    assert_eq!(trainer.lock().unwrap().version(), 2);
}

#[test]
fn priors_are_measured_once_on_a_scratch_drafter() {
    let gpt = common::rollouts::gpt();
    let trainer = trainer_on(&rollout(&gpt, 0.0, None).rows);
    let router = FillerRouter::default();
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    let (version, sampler) = {
        let t = trainer.lock().unwrap();
        (t.version(), t.sampler().state())
    };
    let p = slices.measure_priors(&router).unwrap().expect("measured");
    assert!(p.small > 0.0 && p.large > 0.0 && p.step > 0.0, "{p:?}");
    assert!(
        p.large_rows > p.small_rows && p.small_rows == MIN_PIECE_ROWS,
        "{p:?}"
    );
    assert!(p.eval_short > 0.0 && p.eval_long > 0.0, "{p:?}");
    let kinds = router.stats().kinds;
    for kind in [DRAFTER, DRAFTER_STEP, DRAFTER_EVAL] {
        let e = kinds[kind].estimate;
        assert_eq!(e.samples, 0, "{kind}: a prior, not a measurement");
        assert!(
            e.line(1.0) >= 0.0 && e.predicted(0.0) > 0.0,
            "{kind}: {e:?}"
        );
    }
    let line = kinds[DRAFTER].estimate;
    assert!(line.line(p.small_rows as f64) < line.line(slices.full_rows() as f64));
    // The real drafter is untouched: no step, no gradient, the same row sampler.
    let t = trainer.lock().unwrap();
    assert_eq!((t.version(), t.sampler().state()), (version, sampler));
    assert_eq!(t.pending_slices(), 0);
    drop(t);
    assert!(slices.measure_priors(&router).unwrap().is_none(), "once");
}

/// A kind whose estimate went too high for any gap is never handed out, so never measured
/// again: a deferred step whose gaps took none of its work starts the next from the prior.
#[test]
fn a_stale_estimate_is_reset_to_its_prior_after_a_step_without_pieces() {
    use pipefill::model::drafter::DraftRow;
    use pipefill_actors::{Bubble, BubbleFiller, FillerSpan};
    use pipefill_schedules::Action;

    let gpt = common::rollouts::gpt();
    let rows: Vec<DraftRow> = rollout(&gpt, 0.0, None).rows;
    let trainer = trainer_on(&rows);
    let router = FillerRouter::default();
    let slices = DrafterSlices::new(Arc::clone(&trainer), &router);
    slices.measure_priors(&router).unwrap().expect("measured");
    let prior = router.stats().kinds[DRAFTER].estimate;

    // Step A: one piece runs and is measured at 100 s (a preempted run, say).
    slices.begin_carrying(2, &router);
    let mut filler = router.filler(0);
    let bubble = Bubble {
        rank: 0,
        iteration: 0,
        waiting_for: Action::f(0, 0),
        predicted_idle: Some(1e6),
        exact: true,
    };
    let work = filler.fill(&bubble).expect("a piece fits a huge gap");
    assert!(work.label.starts_with("drafter slice"), "{}", work.label);
    (work.run)().unwrap();
    filler.finished(&FillerSpan {
        rank: 0,
        iteration: 0,
        start: 0.0,
        end: 100.0,
        label: work.label,
        predicted_cost: work.predicted_cost,
        error: None,
    });
    let stale = router.stats().kinds[DRAFTER].estimate;
    assert_eq!(stale.samples, 1);
    assert!(
        stale.predicted_at(MIN_PIECE_ROWS as f64, 2.0) > 10.0,
        "{stale:?}"
    );
    slices.defer();
    // Step B ran a piece last step: nothing reset; its gaps take none (no gaps here).
    slices.begin_carrying(2, &router);
    assert_eq!(slices.account().reset_estimates, 0);
    assert_eq!(router.stats().kinds[DRAFTER].estimate, stale);
    slices.defer();
    // Step C: the last step had budget and no piece, so the estimate is the prior again.
    slices.begin_carrying(2, &router);
    assert_eq!(slices.account().reset_estimates, 1);
    assert_eq!(router.stats().kinds[DRAFTER].estimate, prior);
}
