//! `pipefill rl` in one process: rank 0's work (policy, reference, rollouts, drafter) on
//! one backend, the update's ranks each on their own ([`RankBackend::for_rank`]); ticks
//! [`Bar::Rollout`] with each batch's mean reward and [`Bar::Update`] with the update's
//! loss, gradient norm and bubble ratio.

use super::drafter_line;
use super::line::{MetricsLine, step_line, summary_lines, write_line};
use crate::config::JobConfig;
use crate::model::checkpoint::Checkpoint;
use crate::rl::config::SpecThreshold;
use crate::rl::generator::RolloutGenerator;
use crate::rl::launched::{final_drafter, rollout_engine, starting_drafter};
use crate::rl::step_metrics::RlStepMetrics;
use crate::rl::trainer::RlTrainer;
use crate::rl::trainer_spec::PipelineRollouts;
use crate::run::RunDir;
use crate::run::RunError;
use crate::run::dir::METRICS_FILE;
use crate::run::show::{Bar, Show, Tick};
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
    let metrics_path = out_dir.join(METRICS_FILE);
    let mut metrics = run_dir.create(&job.to_toml(), 0)?;

    // Rank 0's work (policy, reference, drafter) on one backend, the update's ranks each on
    // their own.
    let backend = B::for_rank(0, job.train.precision)?;
    let mut engine = rollout_engine(job, Some(&checkpoint), backend.clone())?;
    let version = starting_drafter(job, Some(&checkpoint)).map(|d| d.weights.version);
    // Where the rollouts do not speculate nothing trains the drafter: the run's checkpoint
    // keeps `--init`'s.
    let init_drafter = checkpoint.drafter.clone();
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
    let mut history: Vec<RlStepMetrics> = Vec::new();
    // Whatever ends the steps, the bars end with them.
    let mut steps = || -> Result<(), RunError> {
        for _ in 0..rl.steps {
            let step = trainer.step();
            let m = trainer
                .run_step(&mut engine as &mut dyn RolloutGenerator<B>, |reward| {
                    show.tick(Tick {
                        bar: Bar::Rollout,
                        pos: step + 1,
                        len: rl.steps,
                        message: &format!("reward {reward:.3}"),
                        plain: None,
                    });
                })
                .map_err(|source| RunError::RlStep {
                    step,
                    source: Box::new(source),
                })?;
            let plain = step_line(&m, rl.steps, engine.threshold());
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
            write_line(&mut metrics, &metrics_path, &line)?;
            history.push(m);
        }
        Ok(())
    };
    let ran = steps();
    show.finish(Bar::Rollout, ran.is_ok());
    show.finish(Bar::Update, ran.is_ok());
    ran?;

    let mut checkpoint = trainer.checkpoint()?;
    checkpoint.drafter = final_drafter(init_drafter.as_ref(), &engine)?;
    run_dir.save_final(&mut checkpoint, job)?;
    let ran = format!(
        "run directory {} (metrics.jsonl, checkpoint/)",
        out_dir.display()
    );
    for line in summary_lines(&history, &ran) {
        show.line(&line);
    }
    Ok(())
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
