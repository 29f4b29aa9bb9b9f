//! `pipefill rl` in one process: rank 0's work (policy, reference, rollouts, drafter) on
//! one backend, the update's ranks each on their own ([`RankBackend::for_rank`]); ticks
//! [`Bar::Rollout`] with each batch's mean reward and [`Bar::Update`] with the update's
//! loss, gradient norm and bubble ratio.

use std::io::Write;
use std::time::Instant;

use super::drafter_line;
use crate::config::JobConfig;
use crate::model::checkpoint::Checkpoint;
use crate::rl::calibrate::Calibration;
use crate::rl::config::SpecThreshold;
use crate::rl::trainer::{RlStepMetrics, RlTrainer, RolloutEngine};
use crate::rl::trainer_spec::{PipelineRollouts, ThresholdChoice};
use crate::run::show::{Bar, Show, Tick};
use crate::run::{RunDir, RunError};
use crate::tensor::device::{OnBackend, RankBackend};

/// The in-process RL run after its checkpoint is known, on the backend `B` of the job's
/// `device` ([`crate::tensor::device::on_backend`]).
pub(super) struct InProcess<'a> {
    pub(super) job: &'a JobConfig,
    pub(super) checkpoint: Checkpoint,
    pub(super) run_dir: &'a RunDir,
    pub(super) show: &'a mut dyn Show,
}

impl OnBackend for InProcess<'_> {
    type Output = Result<(), RunError>;
    fn run<B: RankBackend>(self) -> Result<(), RunError> {
        run::<B>(self.job, self.checkpoint, self.run_dir, self.show)
    }
}

fn run<B: RankBackend>(
    job: &JobConfig,
    checkpoint: Checkpoint,
    run_dir: &RunDir,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    let rl = &job.rl;
    let out_dir = run_dir.path().to_path_buf();
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics = run_dir.create(&job.to_toml(), 0)?;

    // Rank 0's work (policy, reference, drafter) on one backend, the update's ranks each on
    // their own.
    let backend = B::for_rank(0)?;
    let mut engine = PipelineRollouts::on(job, backend.clone())?;
    let mut version = None;
    if rl.speculation
        && let Some(state) = &checkpoint.drafter
    {
        engine = engine.with_drafter(state)?;
        version = Some(engine.drafter_version());
    }
    let mut trainer = RlTrainer::on(job, checkpoint, backend)?;
    if let (Some(n), Some(path)) = (trainer.prompts().records(), &job.data.path) {
        show.line(&format!(
            "prompts: {n} prompt/answer records of {} (each once per epoch), scored by rl.reward = {:?}",
            path.display(),
            rl.reward
        ));
    }
    if rl.speculation {
        let arms = match rl.advanced.plain_arm {
            true => format!("K ∈ 0..={} (0: plain)", rl.draft_k),
            false => format!("K ≤ {}", rl.draft_k),
        };
        let below = match rl.spec_threshold {
            SpecThreshold::Live(n) => format!("at most {n} sequences (rl.spec_threshold)"),
            SpecThreshold::Auto => "at most a threshold calibrated on the policy".into(),
        };
        show.line(&format!(
            "rollouts: speculative decoding while {below} are live ({arms} chosen by a \
             bandit), drafter trained {} slices per step on the rollouts",
            rl.drafter_slices
        ));
        if let Some(t) = &rl.draft_tree {
            show.line(&format!(
                "rollouts: draft trees of up to {} nodes ({} children of the {} best nodes a \
                 level), as deep as the bandit's K",
                t.nodes, t.branch, t.width
            ));
        }
        show.line(&drafter_line(version));
        engine.calibrate(trainer.policy())?;
        if let Some(line) = calibration_line(&engine) {
            show.line(&line);
        }
    } else {
        show.line("rollouts: plain sampling (rl.speculation = false)");
    }
    let started = Instant::now();
    let mut history: Vec<RlStepMetrics> = Vec::new();
    for _ in 0..rl.steps {
        let step = trainer.step();
        let m = trainer.run_step(&mut engine as &mut dyn RolloutEngine<B>, |reward| {
            show.tick(Tick {
                bar: Bar::Rollout,
                pos: step + 1,
                len: rl.steps,
                message: &format!("reward {reward:.3}"),
                plain: None,
            });
        });
        let m = match m {
            Ok(m) => m,
            Err(source) => {
                show.finish(Bar::Rollout, false);
                show.finish(Bar::Update, false);
                return Err(RunError::RlStep { step, source });
            }
        };
        let plain = format!(
            "step {:>4}/{} reward {:.3} | rollout {:.2} s ({:.0} tok/s, {:.0}% of the step, \
             stages idle {}){} | drafter {:.2} s | reference {:.2} s | update {:.2} s, grad \
             norm {:.3}",
            m.step + 1,
            rl.steps,
            m.reward,
            m.rollout_seconds,
            m.tokens_per_s,
            100.0 * m.rollout_share,
            idle_line(&m),
            engine
                .threshold()
                .map_or(String::new(), |t| format!(" speculating ≤ {}", t.threshold)),
            m.drafter_seconds,
            m.reference_seconds,
            m.update_seconds,
            m.grad_norm
        );
        show.tick(Tick {
            bar: Bar::Update,
            pos: m.step + 1,
            len: rl.steps,
            message: &format!(
                "loss {:+.4} | grad norm {:.3} | bubble {}",
                m.surrogate_loss,
                m.grad_norm,
                m.bubble_ratio
                    .map_or("-".into(), |b| format!("{:.1}%", 100.0 * b))
            ),
            plain: Some(&plain),
        });
        let line = MetricsLine {
            step: &m,
            spec_threshold: engine.threshold(),
            calibration: (m.step == 0).then(|| engine.calibration()).flatten(),
        };
        serde_json::to_writer(&mut metrics, &line)
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(metrics))
            .and_then(|()| metrics.flush())
            .map_err(|e| RunError::write(&metrics_path, e))?;
        history.push(m);
    }
    show.finish(Bar::Rollout, true);
    show.finish(Bar::Update, true);

    run_dir.save_final(&mut trainer.checkpoint()?, job)?;
    let window = history.len().clamp(1, 5);
    let mean = |ms: &[RlStepMetrics]| ms.iter().map(|m| m.reward).sum::<f64>() / ms.len() as f64;
    let rollout: f64 = history.iter().map(|m| m.rollout_seconds).sum();
    let total = started.elapsed().as_secs_f64();
    let median = |f: fn(&RlStepMetrics) -> f64| {
        let mut v: Vec<f64> = history.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    show.line(&format!(
        "median step {:.3} s: rollout {:.3} s, drafter {:.3} s, reference {:.3} s, update {:.3} s",
        median(|m| m.step_seconds),
        median(|m| m.rollout_seconds),
        median(|m| m.drafter_seconds),
        median(|m| m.reference_seconds),
        median(|m| m.update_seconds),
    ));
    show.line(&format!(
        "done: {} RL steps in {total:.1} s (rollouts {:.0}%); reward {:.3} → {:.3} (mean of \
         first/last {window} steps); run directory {} (metrics.jsonl, checkpoint/)",
        history.len(),
        100.0 * rollout / total.max(1e-9),
        mean(&history[..window]),
        mean(&history[history.len() - window..]),
        out_dir.display()
    ));
    Ok(())
}

/// A line of metrics.jsonl: the step's [`RlStepMetrics`], the live-batch threshold its
/// rollout speculated below (and where it came from), and on the first line the step costs
/// a calibrated threshold was derived from.
#[derive(serde::Serialize)]
struct MetricsLine<'a> {
    #[serde(flatten)]
    step: &'a RlStepMetrics,
    spec_threshold: Option<&'a ThresholdChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<&'a Calibration>,
}

/// The calibration in one line: what it measured, the acceptance it starts from and the
/// threshold of the first rollout; `None` without one.
fn calibration_line<B: RankBackend>(engine: &PipelineRollouts<B>) -> Option<String> {
    let c = engine.calibration()?;
    let t = engine.next_threshold()?;
    let outcome = match (t.source, t.alpha, t.alpha_from) {
        ("cannot pay", ..) => "speculation cannot pay on this target (not even with every \
                               draft accepted): plain decoding, drafter not trained"
            .to_string(),
        (_, Some(alpha), Some(from)) => format!(
            "per-token acceptance {alpha:.2} ({from}) → speculate while live ≤ {} ({} per \
             group × {} groups), re-derived each step",
            t.threshold,
            t.threshold / c.groups,
            c.groups
        ),
        _ => "no acceptance measured yet → no speculation in the first rollout, re-derived \
              each step"
            .to_string(),
    };
    Some(format!(
        "calibration ({:.2} s, fastest of {}): {}; {outcome}",
        c.seconds,
        c.reps,
        c.summary()
    ))
}

/// `"1.23 s, 45% filled (6 slices)"`, or `-` without an idle-work router.
fn idle_line(m: &RlStepMetrics) -> String {
    match (m.rollout_idle_seconds, m.rollout_idle_filled_seconds) {
        (Some(idle), Some(filled)) => format!(
            "{idle:.2} s, {:.0}% filled ({} drafter slices)",
            100.0 * filled / idle.max(1e-9),
            m.idle_drafter_slices
        ),
        _ => "-".into(),
    }
}
