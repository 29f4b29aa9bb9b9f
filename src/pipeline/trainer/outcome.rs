//! [`PipelineRun`]: what a pipelined run hands back — each step's metrics, the runtime's
//! measured timelines and the simulator's prediction, the final parameters and optimizer
//! moments (served as a model or a checkpoint), and the drafter trained in the bubbles.

use pipefill_actors::RunReport;

use super::super::join::DrafterRun;
use super::super::shared::RankFinal;
use super::PipelineTrainer;
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::checkpoint::{Checkpoint, HostTensor};
use crate::model::drafter::state::DrafterState;
use crate::model::{Cut, Gpt, OptimizerState};
use crate::pipeline::error::PipelineError;
use crate::schedules::{CostModel, Plan, StageCost, Timeline, simulate};
use crate::tensor::CpuBackend;
use crate::train::StepMetrics;

/// What a pipelined run learned and measured.
#[derive(Debug, Clone)]
pub struct PipelineRun {
    /// Each step's metrics, in step order.
    pub steps: Vec<StepMetrics>,
    /// The runtime's report: per-iteration measured timelines and action records.
    pub report: RunReport,
    /// Per-stage median T_F, T_I, T_W (seconds) over the whole run.
    pub measured_cost: Option<CostModel>,
    /// The simulator's timeline of the plan under [`PipelineRun::measured_cost`].
    pub predicted: Option<Timeline>,
    pub plan: Plan,
    job: JobConfig,
    /// The step after the last one run.
    next_step: u64,
    /// Final parameters in model order.
    params: Vec<HostTensor>,
    optimizer: OptimizerState,
    /// The drafter trained in the bubbles (`filler = "drafter"`).
    pub drafter: Option<DrafterRun>,
    /// Its whole state after the run, for the final checkpoint.
    pub(super) drafter_state: Option<DrafterState>,
}

impl PipelineRun {
    pub(super) fn new(
        trainer: &PipelineTrainer,
        mut steps: Vec<StepMetrics>,
        report: RunReport,
        predicted: Option<Timeline>,
        finals: Vec<RankFinal>,
    ) -> Self {
        steps.sort_by_key(|m| m.step);
        let (params, optimizer) = RankFinal::merge(finals);
        // The plan the last step ran (an auto-scheduled run's may differ from its first).
        let plan = match (&trainer.auto, &report.plan) {
            (Some(_), Some(last)) => last.as_ref().clone(),
            _ => trainer.plan.clone(),
        };
        PipelineRun {
            measured_cost: report.measured_cost.clone(),
            next_step: trainer.first_step() + report.iterations.len() as u64,
            steps,
            report,
            predicted,
            plan,
            job: trainer.job.clone(),
            params,
            optimizer,
            drafter: None,
            drafter_state: None,
        }
    }

    /// The measured timeline of every iteration (= step), in order.
    pub fn timelines(&self) -> impl Iterator<Item = &Timeline> {
        self.report.iterations.iter().map(|i| &i.timeline)
    }

    /// Every filler span of the run: what [`crate::profile::report::Filling::measure`]
    /// measures the bubble-fill ratio from.
    pub fn filler_spans(&self) -> Vec<crate::profile::report::FillerSpan> {
        self.report
            .iterations
            .iter()
            .flat_map(|it| it.fillers.iter().map(|f| (f.rank, f.start, f.end)))
            .collect()
    }

    /// Per-stage **mean** T_F, T_I, T_W (seconds) over the iterations from `skip` on (e.g.
    /// 1 to leave out the warm-up iteration), see [`StageCost::means`]; link latency and
    /// memory figures as in [`PipelineRun::measured_cost`]. `None` when some stage has no
    /// measured forward.
    pub fn mean_cost(&self, skip: usize) -> Option<CostModel> {
        self.cost_over(self.timelines().skip(skip))
    }

    /// [`PipelineRun::mean_cost`] over the given iterations' timelines only (e.g. one
    /// iteration, to predict that iteration from its own costs).
    pub fn cost_over<'a>(
        &self,
        timelines: impl IntoIterator<Item = &'a Timeline>,
    ) -> Option<CostModel> {
        let stage = StageCost::means(self.plan.stages, timelines)?;
        let base = self.measured_cost.clone().unwrap_or_default();
        Some(CostModel { stage, ..base })
    }

    /// The simulator's timeline of this run's plan under `cost`.
    pub fn predict(&self, cost: &CostModel) -> Result<Timeline, PipelineError> {
        Ok(simulate(&self.plan, cost)?)
    }

    /// Every parameter's name, in model order.
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// A parameter's final values.
    pub fn param_values(&self, name: &str) -> Result<&[f32], PipelineError> {
        self.params
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.data.as_slice())
            .ok_or_else(|| ModelError::UnknownParam(name.to_string()).into())
    }

    /// The step a continuation would start at.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The trained model, whole, on a single-threaded CPU backend (evaluation, sampling).
    pub fn model(&self) -> Result<Gpt<CpuBackend>, PipelineError> {
        let be = CpuBackend::new(1).map_err(ModelError::from)?;
        // Blank, then every parameter of the model set from the run's (a missing one fails).
        let mut gpt = Gpt::blank(&self.job.model, be, &Cut::Even(1))?;
        for name in gpt.param_names() {
            let values = self.param_values(&name)?;
            gpt.set_param(&name, values)?;
        }
        Ok(gpt)
    }

    /// A checkpoint of the final parameters and optimizer state, in the reference trainer's
    /// format, so either trainer can resume it, with the drafter's state when the run
    /// trained one.
    ///
    /// Straight from the run's host copies: what [`Checkpoint::capture`] of
    /// [`PipelineRun::model`] and an AdamW loaded with the run's moments would hold (the same
    /// tensors in the same model order), without building either (`pipefill rl` takes one
    /// per step).
    pub fn checkpoint(&self) -> Result<Checkpoint, PipelineError> {
        let mut checkpoint = crate::model::checkpoint::sharded::from_state(
            self.job.model.clone(),
            self.job.train.seed,
            self.next_step,
            self.params.clone(),
            &self.optimizer,
        );
        checkpoint.drafter = self.drafter_state.clone();
        Ok(checkpoint)
    }

    /// [`PipelineRun::checkpoint`], consuming the run: its parameters move into the
    /// checkpoint instead of being copied.
    pub fn into_checkpoint(self) -> Checkpoint {
        let mut checkpoint = crate::model::checkpoint::sharded::from_owned_state(
            self.job.model,
            self.job.train.seed,
            self.next_step,
            self.params,
            self.optimizer,
        );
        checkpoint.drafter = self.drafter_state;
        checkpoint
    }

    /// The drafter's whole state after the run (`filler = "drafter"`).
    pub fn drafter_state(&self) -> Option<&DrafterState> {
        self.drafter_state.as_ref()
    }

    /// Predicted (simulated under the measured costs) next to measured figures of the
    /// last iteration: makespan and both bubble ratios.
    pub fn side_by_side(&self) -> String {
        match &self.predicted {
            Some(p) => self
                .report
                .side_by_side(self.report.iterations.len().saturating_sub(1), p),
            None => "no prediction: not every stage was measured\n".into(),
        }
    }
}
