//! The rollout stages' idle work through a `FillerRouter` ([`RolloutRouter`]): routing the
//! verification passes and filling the long tail with drafter training changes no sample,
//! every verification goes through the router to the stage that holds its layers, the
//! drafter trains in the idle time on rows the rollout produced, and the figures add up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pipefill::data::SplitMix64;
use pipefill::model::drafter::{DraftBufferHandle, Drafter, DrafterConfig, DrafterTrainer};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt, GptConfig};
use pipefill::rl::rollout::idle::{DRAFTER, DrafterSlices, RolloutRouter, VERIFY};
use pipefill::rl::rollout::{
    MessageHook, Request, Rollout, RolloutConfig, RolloutEngine, Speculation,
};
use pipefill::rl::speculative::RandomProposer;
use pipefill::tensor::CpuBackend;
use pipefill_actors::FillerRouter;

const STAGES: usize = 4;

fn config() -> GptConfig {
    GptConfig {
        layers: 4,
        seq_len: 40,
        seed: 11,
        ..GptConfig::default()
    }
}

fn gpt() -> Gpt<CpuBackend> {
    Gpt::new(&config(), CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

fn engine(gpt: &Gpt<CpuBackend>) -> RolloutEngine<CpuBackend> {
    RolloutEngine::new(InferStage::stages_of(gpt, &Cut::Even(STAGES)).unwrap()).unwrap()
}

/// Ragged prompts and caps: a long tail.
fn requests(n: usize) -> Vec<Request> {
    let mut rng = SplitMix64::new(9);
    (0..n)
        .map(|i| Request {
            prompt: (0..2 + i % 3).map(|_| 3 + rng.below(47) as u32).collect(),
            max_new: 3 + (i * 11) % 30,
        })
        .collect()
}

fn rollout(e: &mut RolloutEngine<CpuBackend>, spec: Speculation) -> Rollout {
    let cfg = RolloutConfig {
        groups: STAGES,
        speculation: spec.clone(),
        record_rows: true,
        ..RolloutConfig::default()
    };
    let mut proposer = RandomProposer::new(50);
    let p = (spec != Speculation::Off).then_some(&mut proposer as &mut _);
    e.run(&requests(6), &cfg, p).unwrap()
}

fn trainer(buffer: DraftBufferHandle) -> Arc<Mutex<DrafterTrainer<CpuBackend>>> {
    let d = Drafter::new(
        &config(),
        &DrafterConfig::default(),
        CpuBackend::new(1).unwrap(),
    )
    .unwrap();
    Arc::new(Mutex::new(DrafterTrainer::new(d, buffer, 0, 1).unwrap()))
}

#[test]
fn routed_verification_and_idle_drafter_training_change_no_sample() {
    let model = gpt();
    let plain = rollout(&mut engine(&model), Speculation::Off);

    // The drafter's buffer holds a previous rollout's rows, so it can train from the start.
    let buffer = DraftBufferHandle::new(&config(), &DrafterConfig::default());
    buffer.begin_step(0);
    for row in &plain.rows {
        buffer.lock().push(row.clone()).unwrap();
    }
    buffer.begin_step(1);
    let trainer = trainer(buffer.clone());
    let budget = Arc::new(AtomicU64::new(1000));
    let router = FillerRouter::default();
    // A prior of 0 s: the first slice fits any idle time; measured costs take over after.
    router.set_prior(DRAFTER, 0.0);
    let slices = DrafterSlices::new(Arc::clone(&trainer), budget.clone());
    let hook = Arc::new(
        RolloutRouter::new(router.clone(), STAGES, true)
            .with_rows(buffer.clone(), 2)
            .with_drafter(slices),
    );
    let mut e = engine(&model).with_hook(Arc::clone(&hook) as Arc<dyn MessageHook>);
    let spec = rollout(&mut e, Speculation::Fixed { k: 3 });

    // Greedy speculative decoding with routed verification is plain decoding, token for token.
    assert_eq!(spec.sequences, plain.sequences);
    assert!(spec.stats.verifications > 0);

    let report = hook.report();
    let verify: Vec<_> = report.spans.iter().filter(|s| s.kind == VERIFY).collect();
    assert_eq!(verify.len(), report.verifications);
    // Every verification group step passes all stages, each through the router.
    assert!(report.verifications > 0 && report.verifications % STAGES == 0);
    for stage in 0..STAGES {
        let here = verify.iter().filter(|s| s.stage == stage).count();
        assert_eq!(here * STAGES, report.verifications, "stage {stage}");
    }
    let stats = router.stats();
    assert_eq!(stats.queued, 0, "no verification left behind");
    assert_eq!(stats.kinds[VERIFY].slices as usize, report.verifications);

    // The long tail left stages idle and the drafter trained there.
    let drafted: Vec<_> = report.spans.iter().filter(|s| s.kind == DRAFTER).collect();
    assert_eq!(drafted.len(), report.drafter_slices);
    assert!(report.drafter_slices >= 1, "{report:?}");
    assert!(drafted.iter().all(|s| s.error.is_none()), "{drafted:?}");
    let filled: f64 = drafted.iter().map(|s| s.end - s.start).sum();
    assert!((report.filled_total() - filled).abs() < 1e-9);
    assert_eq!(
        budget.load(Ordering::Acquire),
        1000 - report.drafter_slices as u64,
        "the budget pays for what ran"
    );
    assert!(trainer.lock().unwrap().pending_slices() > 0 || trainer.lock().unwrap().version() > 0);

    // Finished sequences' rows reached the buffer during the rollout, the first 2 held out.
    assert_eq!(hook.held_out().len(), 2);
    assert_eq!(buffer.lock().current_len(), spec.rows.len() - 2);
}

#[test]
fn a_hook_without_routing_leaves_verification_to_the_stages() {
    let model = gpt();
    let plain = rollout(&mut engine(&model), Speculation::Off);
    let hook = Arc::new(RolloutRouter::new(FillerRouter::default(), STAGES, false));
    let mut e = engine(&model).with_hook(Arc::clone(&hook) as Arc<dyn MessageHook>);
    let spec = rollout(&mut e, Speculation::Fixed { k: 2 });
    assert_eq!(spec.sequences, plain.sequences);
    let report = hook.report();
    assert_eq!(report.verifications, 0);
    assert_eq!(report.drafter_slices, 0, "no drafter: nothing to fill with");
    assert_eq!(report.waited_s.len(), STAGES);
    assert!(report.waited_s.iter().all(|&w| w >= 0.0));
}
