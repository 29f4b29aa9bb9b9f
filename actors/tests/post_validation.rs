//! Optimizer post-validation equals the barrier, bit for bit.
//!
//! The fake holds real weights: stage `s` computes `y = a·h + b` (f32 weights `a`, `b`,
//! f64 activations), the last stage's loss is `½(y − target)²`, I returns `g·a`, W
//! accumulates `g·h` and `g` into f32 gradients, and the step is SGD with momentum (so
//! the optimizer state matters too). Gradients depend on the data and on the weights, so a
//! wrong step changes every later iteration. Data depend on the iteration: the fake counts
//! its steps (a rollback un-counts one), so a first-stage forward recomputed after a
//! rollback sees the same micro-batch again.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use pipefill_actors::{
    Clock, GradStats, Pipeline, PlanSource, RunReport, RuntimeError, StageCompute, StepDecision,
    StepMode, StepPolicy, spin_cpu,
};
use pipefill_schedules::{Plan, ScheduleKind, generate};

#[derive(Debug, Clone, Copy)]
struct Act {
    microbatch: u32,
    value: f64,
}

/// What every fake of one run records: weights and momentum after each committed step, by
/// (rank, iteration), and each loss by (iteration, micro-batch), all as bits.
#[derive(Default, Debug, PartialEq)]
struct Log {
    after_step: BTreeMap<(usize, u64), Vec<u32>>,
    losses: BTreeMap<(u64, u32), u64>,
}

#[derive(Clone)]
struct StageState {
    w: [f32; 2],
    momentum: [f32; 2],
    grad: [f32; 2],
}

struct WeightFake {
    rank: usize,
    last: u32,
    /// Stages held by this rank, in stage order.
    stages: BTreeMap<u32, StageState>,
    /// Steps taken (the iteration the next forwards belong to).
    steps: u64,
    snapshot: Option<(u64, BTreeMap<u32, StageState>)>,
    /// (stage, mb) → (input, output) of its forward; (stage, mb) → upstream gradient.
    stash: HashMap<(u32, u32), (f64, f64)>,
    grads_in: HashMap<(u32, u32), f64>,
    /// Inject an Inf gradient in this iteration on this rank.
    inf_at: Option<u64>,
    rollback: bool,
    /// The iteration whose data are large.
    large_at: Option<u64>,
    /// Fail `grad_stats` of this iteration.
    stats_error_at: Option<u64>,
    cost: f64,
    step_cost: f64,
    log: Arc<Mutex<Log>>,
}

fn data(iteration: u64, mb: u32, large_at: Option<u64>) -> f64 {
    // One iteration's data may be large, so that its gradient norm is too (clipping
    // triggers there).
    let amp = if large_at == Some(iteration) {
        6.0
    } else {
        1.0
    };
    amp * (0.3 + 0.1 * mb as f64 + 0.05 * iteration as f64)
}

fn target(mb: u32) -> f64 {
    1.0 - 0.07 * mb as f64
}

impl WeightFake {
    fn for_plan(plan: &Plan, inf: Option<(usize, u64)>, cost: f64) -> (Vec<Self>, Arc<Mutex<Log>>) {
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
        spin_cpu(self.cost);
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
        spin_cpu(self.cost);
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
        spin_cpu(self.cost);
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
        spin_cpu(self.step_cost);
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

const ITERATIONS: u64 = 5;
const INF_ITERATION: u64 = 3;
const COST: f64 = 0.0003;

async fn run(
    plan: &Plan,
    policy: StepPolicy,
    inf: Option<(usize, u64)>,
    clock: Clock,
    rollback: bool,
) -> (RunReport, Log) {
    let (mut fakes, log) = WeightFake::for_plan(plan, inf, COST);
    for f in &mut fakes {
        f.rollback = rollback;
    }
    let report = Pipeline::new(PlanSource::Given(plan.clone()), clock)
        .iterations(ITERATIONS)
        .step_policy(policy)
        .run(fakes)
        .await
        .unwrap();
    let log = std::mem::take(&mut *log.lock().unwrap());
    (report, log)
}

fn policy(mode: StepMode, max_grad_norm: Option<f64>) -> StepPolicy {
    StepPolicy {
        max_grad_norm,
        mode,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn post_validation_equals_the_barrier_with_clipping_and_an_inf_gradient() {
    let mut total_recomputed = 0;
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ] {
        let plan = generate(kind, 4, 6, 1).unwrap();
        let inf = Some((0, INF_ITERATION));
        // The unclipped norms decide a limit that iteration 2 (large data) exceeds.
        let (free, _) = run(
            &plan,
            policy(StepMode::Barrier, None),
            None,
            Clock::virtual_free(),
            true,
        )
        .await;
        let norms: Vec<f64> = free.steps.iter().map(|s| s.grad_norm).collect();
        let max = (norms[2] + norms[1]) / 2.0;
        assert!(
            norms[2] > max && norms[1] < max,
            "{kind:?}: norms {norms:?}"
        );

        let (barrier, want) = run(
            &plan,
            policy(StepMode::Barrier, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        let (post, got) = run(
            &plan,
            policy(StepMode::PostValidate, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        assert_eq!(
            want.after_step.len(),
            plan.num_ranks() * ITERATIONS as usize
        );
        assert_eq!(
            got, want,
            "{kind:?}: post-validation differs from the barrier"
        );

        // (a) Clipping triggered at iteration 2 and not at every iteration.
        let decisions: Vec<StepDecision> = barrier.steps.iter().map(|s| s.decision).collect();
        assert!(barrier.steps[2].clipped(), "{kind:?}: {decisions:?}");
        assert!(
            barrier
                .steps
                .iter()
                .any(|s| !s.clipped() && s.decision != StepDecision::Skip)
        );
        for (b, p) in barrier.steps.iter().zip(&post.steps) {
            assert!(
                b.decision.same_as(&p.decision),
                "{kind:?} iteration {}",
                b.iteration
            );
            assert_eq!(b.grad_norm.to_bits(), p.grad_norm.to_bits());
            assert_eq!(b.rollbacks(), 0, "the barrier never speculates");
        }
        // (b) The Inf gradient on rank 0 skipped the step on every rank: weights and
        // momentum after that iteration are those after the one before.
        let skipped = INF_ITERATION;
        assert_eq!(post.steps[skipped as usize].decision, StepDecision::Skip);
        assert!(post.steps[skipped as usize].grad_norm.is_nan());
        for rank in 0..plan.num_ranks() {
            assert_eq!(
                got.after_step[&(rank, skipped)],
                got.after_step[&(rank, skipped - 1)],
                "{kind:?}: rank {rank} changed its weights in the skipped iteration"
            );
            assert_ne!(got.after_step[&(rank, 2)], got.after_step[&(rank, 1)]);
        }
        // (c) Some rank stepped speculatively with a wrong guess there and rolled back.
        let rolled: Vec<(u64, usize)> = post
            .steps
            .iter()
            .flat_map(|s| {
                s.ranks
                    .iter()
                    .filter(|r| r.rolled_back)
                    .map(move |r| (s.iteration, r.rank))
            })
            .collect();
        assert!(
            rolled.iter().any(|&(it, _)| it == 2 || it == skipped),
            "{kind:?}: no rollback in the clipped or skipped iteration: {rolled:?}"
        );
        for s in &post.steps {
            for r in s.ranks.iter().filter(|r| r.rolled_back) {
                let guess = r
                    .speculative
                    .expect("a rollback follows a speculative step");
                assert!(!guess.same_as(&s.decision));
            }
        }
        let recomputed: usize = post
            .steps
            .iter()
            .flat_map(|s| &s.ranks)
            .map(|r| r.recomputed)
            .sum();
        println!(
            "{kind:?}: max_grad_norm {max:.4}, norms {:?}, rollbacks (iteration, rank) {rolled:?}, \
             first-stage forwards recomputed {recomputed}",
            post.steps.iter().map(|s| s.grad_norm).collect::<Vec<_>>()
        );
        total_recomputed += recomputed;
    }
    // Somewhere rank 0 had run forwards on a wrong speculative step and recomputed them
    // (the equality above shows the recomputation was right).
    assert!(total_recomputed > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn wall_clock_and_deferred_steps_equal_the_barrier_too() {
    let plan = generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap();
    let inf = Some((2, INF_ITERATION));
    let (free, _) = run(
        &plan,
        policy(StepMode::Barrier, None),
        None,
        Clock::virtual_free(),
        true,
    )
    .await;
    let max = (free.steps[2].grad_norm + free.steps[1].grad_norm) / 2.0;
    let (_, want) = run(
        &plan,
        policy(StepMode::Barrier, Some(max)),
        inf,
        Clock::Wall,
        true,
    )
    .await;
    // Wall clock: what a rank knows when it speculates depends on thread timing.
    let (_, got) = run(
        &plan,
        policy(StepMode::PostValidate, Some(max)),
        inf,
        Clock::Wall,
        true,
    )
    .await;
    assert_eq!(got, want);
    // A compute that cannot roll back defers its step; same result.
    let (deferred, got) = run(
        &plan,
        policy(StepMode::PostValidate, Some(max)),
        inf,
        Clock::virtual_free(),
        false,
    )
    .await;
    assert_eq!(got, want);
    assert!(
        deferred
            .steps
            .iter()
            .flat_map(|s| &s.ranks)
            .all(|r| r.speculative.is_none())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn post_validation_shortens_zb_h2_against_the_barrier() {
    let plan = generate(ScheduleKind::ZbH2, 4, 8, 1).unwrap();
    let iterations = 6;
    let mut makespan = Vec::new();
    let mut logs = Vec::new();
    for mode in [
        StepMode::Barrier,
        StepMode::PostValidate,
        StepMode::Unchecked,
    ] {
        let (mut fakes, log) = WeightFake::for_plan(&plan, None, 0.001);
        for f in &mut fakes {
            f.large_at = None;
        }
        let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::virtual_free())
            .iterations(iterations)
            .step_mode(mode)
            .run(fakes)
            .await
            .unwrap();
        assert_eq!(report.rollbacks(), 0);
        println!(
            "zb-h2, 4 ranks, 8 micro-batches, {iterations} iterations, {mode:?}: makespan {:.4} s, steady bubble {:.3}",
            report.overall.makespan, report.overall.steady_bubble_ratio
        );
        makespan.push(report.overall.makespan);
        logs.push(std::mem::take(&mut *log.lock().unwrap()));
    }
    // Without clipping or non-finite gradients all three modes compute the same thing.
    assert_eq!(logs[0], logs[1]);
    assert_eq!(logs[0], logs[2]);
    // No agreement at all is the lower bound: the wait for the slowest rank's statistics
    // before the next iteration's later-stage work is what post-validation still pays.
    assert!(makespan[2] <= makespan[1] + 1e-4);
    // The steps (1 ms each) leave the critical path, and rank 0 runs its warm-up forwards
    // early: at least a quarter of a step per iteration is saved.
    assert!(
        makespan[1] < makespan[0] - 0.25 * 0.001 * iterations as f64,
        "post-validation {} vs barrier {}",
        makespan[1],
        makespan[0]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_step_policies_are_refused() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    for (policy, what) in [
        (policy(StepMode::Unchecked, Some(1.0)), "Unchecked"),
        (policy(StepMode::Barrier, Some(-1.0)), "max_grad_norm -1"),
        (
            policy(StepMode::PostValidate, Some(f64::NAN)),
            "max_grad_norm NaN",
        ),
    ] {
        let (fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
        let err = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
            .step_policy(policy)
            .run(fakes)
            .await
            .expect_err("a bad policy");
        assert!(err.to_string().contains(what), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_gradient_reduction_stops_the_job_and_names_the_rank() {
    let plan = generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap();
    for mode in [StepMode::Barrier, StepMode::PostValidate] {
        let (mut fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
        fakes[2].stats_error_at = Some(1);
        let err = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
            .iterations(3)
            .step_mode(mode)
            .stall_timeout(std::time::Duration::from_secs(20))
            .run(fakes)
            .await
            .expect_err("rank 2 fails");
        assert!(
            matches!(
                err,
                RuntimeError::Optimizer {
                    rank: 2,
                    iteration: 1,
                    ..
                }
            ),
            "{mode:?}: {err}"
        );
        assert!(err.to_string().contains("device lost"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn several_chunks_per_rank_and_lowered_plans_equal_the_barrier() {
    let plans = [
        generate(ScheduleKind::ZbV, 4, 8, 2).unwrap(),
        generate(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap(),
        // Explicit SEND/RECV: held first-stage outputs leave at their SEND, after validation.
        pipefill_schedules::lower(&generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap()).unwrap(),
    ];
    for plan in &plans {
        let inf = Some((1, INF_ITERATION));
        let (free, _) = run(
            plan,
            policy(StepMode::Barrier, None),
            None,
            Clock::virtual_free(),
            true,
        )
        .await;
        let max = (free.steps[2].grad_norm + free.steps[1].grad_norm) / 2.0;
        let (barrier, want) = run(
            plan,
            policy(StepMode::Barrier, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        let (post, got) = run(
            plan,
            policy(StepMode::PostValidate, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        assert_eq!(got, want, "{} stages", plan.stages);
        assert!(barrier.steps[2].clipped());
        assert_eq!(
            post.steps[INF_ITERATION as usize].decision,
            StepDecision::Skip
        );
    }
}
