//! A fake `StageCompute` with real weights, for the optimizer-step tests.
//!
//! Stage `s` computes `y = a·h + b` (f32 weights `a`, `b`, f64 activations), the last
//! stage's loss is `½(y − target)²`, I returns `g·a`, W accumulates `g·h` and `g` into f32
//! gradients, and the step is SGD with momentum (so the optimizer state matters too).
//! Gradients depend on the data and on the weights, so a wrong step changes every later
//! iteration. Data depend on the iteration: the fake counts its steps (a rollback un-counts
//! one), so a first-stage forward recomputed after a rollback sees the same micro-batch
//! again. It keeps a snapshot for speculative steps and logs the weights and momentum after
//! every committed step, and every loss, as bits.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use pipefill_actors::{GradStats, StageCompute, StepDecision};
use pipefill_schedules::Plan;

use super::work;

#[derive(Debug, Clone, Copy)]
pub struct Act {
    pub microbatch: u32,
    pub value: f64,
}

/// What every fake of one run records: weights and momentum after each committed step, by
/// (rank, iteration), and each loss by (iteration, micro-batch), all as bits.
#[derive(Default, Debug, PartialEq)]
pub struct Log {
    pub after_step: BTreeMap<(usize, u64), Vec<u32>>,
    pub losses: BTreeMap<(u64, u32), u64>,
}

#[derive(Clone)]
pub struct StageState {
    pub w: [f32; 2],
    pub momentum: [f32; 2],
    pub grad: [f32; 2],
}

pub struct WeightFake {
    pub rank: usize,
    pub last: u32,
    /// Stages held by this rank, in stage order.
    pub stages: BTreeMap<u32, StageState>,
    /// Steps taken (the iteration the next forwards belong to).
    pub steps: u64,
    pub snapshot: Option<(u64, BTreeMap<u32, StageState>)>,
    /// (stage, mb) → (input, output) of its forward; (stage, mb) → upstream gradient.
    pub stash: HashMap<(u32, u32), (f64, f64)>,
    pub grads_in: HashMap<(u32, u32), f64>,
    /// Inject an Inf gradient in this iteration on this rank.
    pub inf_at: Option<u64>,
    pub rollback: bool,
    /// The iteration whose data are large.
    pub large_at: Option<u64>,
    /// Fail `grad_stats` of this iteration.
    pub stats_error_at: Option<u64>,
    pub cost: f64,
    pub step_cost: f64,
    pub log: Arc<Mutex<Log>>,
}

pub fn data(iteration: u64, mb: u32, large_at: Option<u64>) -> f64 {
    // One iteration's data may be large, so that its gradient norm is too (clipping
    // triggers there).
    let amp = if large_at == Some(iteration) {
        6.0
    } else {
        1.0
    };
    amp * (0.3 + 0.1 * mb as f64 + 0.05 * iteration as f64)
}

pub fn target(mb: u32) -> f64 {
    1.0 - 0.07 * mb as f64
}

impl WeightFake {
    pub fn for_plan(
        plan: &Plan,
        inf: Option<(usize, u64)>,
        cost: f64,
    ) -> (Vec<Self>, Arc<Mutex<Log>>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let fakes = (0..plan.num_ranks())
            .map(|rank| WeightFake {
                rank,
                last: plan.stages as u32 - 1,
                stages: (0..plan.stages as u32)
                    .filter(|&s| plan.rank_of(s) == rank)
                    .map(|s| {
                        let state = StageState {
                            w: [0.9 + 0.02 * s as f32, 0.1 - 0.01 * s as f32],
                            momentum: [0.0; 2],
                            grad: [0.0; 2],
                        };
                        (s, state)
                    })
                    .collect(),
                steps: 0,
                snapshot: None,
                stash: HashMap::new(),
                grads_in: HashMap::new(),
                inf_at: inf.filter(|&(r, _)| r == rank).map(|(_, it)| it),
                rollback: true,
                large_at: Some(2),
                stats_error_at: None,
                cost,
                step_cost: cost,
                log: Arc::clone(&log),
            })
            .collect();
        (fakes, log)
    }

    fn stage(&mut self, s: u32) -> Result<&mut StageState, String> {
        let rank = self.rank;
        self.stages
            .get_mut(&s)
            .ok_or(format!("rank {rank} does not hold stage {s}"))
    }

    fn record(&self, iteration: u64) {
        let bits = self
            .stages
            .values()
            .flat_map(|st| st.w.iter().chain(&st.momentum).map(|x| x.to_bits()))
            .collect();
        self.log
            .lock()
            .unwrap()
            .after_step
            .insert((self.rank, iteration), bits);
    }
}

impl StageCompute for WeightFake {
    type Tensor = Act;
    type Error = String;

    fn forward(&mut self, s: u32, mb: u32, input: Option<Act>) -> Result<Option<Act>, String> {
        work(self.cost);
        let h = match input {
            Some(a) if a.microbatch == mb => a.value,
            None if s == 0 => data(self.steps, mb, self.large_at),
            other => return Err(format!("{s}F{mb}: got {other:?}")),
        };
        let w = self.stage(s)?.w;
        let y = w[0] as f64 * h + w[1] as f64;
        // A recomputed first-stage forward (after a rollback) replaces its stash.
        self.stash.insert((s, mb), (h, y));
        if s == self.last {
            let loss = 0.5 * (y - target(mb)).powi(2);
            let it = self.steps;
            self.log
                .lock()
                .unwrap()
                .losses
                .insert((it, mb), loss.to_bits());
            return Ok(None);
        }
        Ok(Some(Act {
            microbatch: mb,
            value: y,
        }))
    }

    fn backward_input(
        &mut self,
        s: u32,
        mb: u32,
        grad: Option<Act>,
    ) -> Result<Option<Act>, String> {
        work(self.cost);
        let &(_, y) = self
            .stash
            .get(&(s, mb))
            .ok_or(format!("{s}I{mb} before F"))?;
        let g = match grad {
            Some(a) if a.microbatch == mb => a.value,
            None if s == self.last => y - target(mb),
            other => return Err(format!("{s}I{mb}: got {other:?}")),
        };
        self.grads_in.insert((s, mb), g);
        let a = self.stage(s)?.w[0] as f64;
        Ok((s > 0).then_some(Act {
            microbatch: mb,
            value: g * a,
        }))
    }

    fn backward_weight(&mut self, s: u32, mb: u32) -> Result<(), String> {
        work(self.cost);
        let g = self
            .grads_in
            .remove(&(s, mb))
            .ok_or(format!("{s}W{mb} before I"))?;
        let (h, _) = self
            .stash
            .remove(&(s, mb))
            .ok_or(format!("{s}W{mb} before F"))?;
        let inject = self.inf_at == Some(self.steps) && mb == 0;
        let st = self.stage(s)?;
        st.grad[0] += (g * h) as f32;
        st.grad[1] += g as f32;
        if inject {
            st.grad[0] = f32::INFINITY;
        }
        Ok(())
    }

    fn grad_stats(&mut self, iteration: u64) -> Result<GradStats, String> {
        if self.stats_error_at == Some(iteration) {
            return Err("device lost while reducing gradients".into());
        }
        let mut stats = GradStats::default();
        for st in self.stages.values() {
            for g in st.grad {
                stats.sq_norm += (g as f64) * (g as f64);
                stats.nonfinite |= !g.is_finite();
            }
        }
        Ok(stats)
    }

    fn can_roll_back(&self) -> bool {
        self.rollback
    }

    fn apply_step(
        &mut self,
        iteration: u64,
        decision: StepDecision,
        speculative: bool,
    ) -> Result<(), String> {
        if self.steps != iteration {
            return Err(format!(
                "step of iteration {iteration} after {} steps",
                self.steps
            ));
        }
        work(self.step_cost);
        if speculative {
            self.snapshot = Some((iteration, self.stages.clone()));
        }
        for st in self.stages.values_mut() {
            if let StepDecision::Apply { clip_scale } = decision {
                for j in 0..2 {
                    st.momentum[j] = 0.9 * st.momentum[j] + st.grad[j] * clip_scale;
                    st.w[j] -= 0.05 * st.momentum[j];
                }
            }
            st.grad = [0.0; 2];
        }
        self.steps += 1;
        if !speculative {
            self.record(iteration);
        }
        Ok(())
    }

    fn rollback_step(&mut self, iteration: u64) -> Result<(), String> {
        match self.snapshot.take() {
            Some((it, stages)) if it == iteration => {
                self.stages = stages;
                self.steps -= 1;
                Ok(())
            }
            other => Err(format!(
                "rollback of iteration {iteration} with snapshot {:?}",
                other.map(|(it, _)| it)
            )),
        }
    }

    fn confirm_step(&mut self, iteration: u64) -> Result<(), String> {
        match self.snapshot.take() {
            Some((it, _)) if it == iteration => {
                self.record(iteration);
                Ok(())
            }
            _ => Err(format!(
                "confirm of iteration {iteration} without its snapshot"
            )),
        }
    }
}
