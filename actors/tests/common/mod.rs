//! A fake `StageCompute` whose costs are known and whose payloads check their own routing.
//!
//! Costs: every F, I and W spins for a fixed thread CPU time and declares it ([`work`]), so
//! in virtual-clock mode the measured timeline replays the simulator's at the costs it ran
//! at ([`replayed`]), and in declared-clock mode it is the simulator's under the nominal
//! costs, bit for bit.
//!
//! Arithmetic: micro-batch `mb` enters stage 0 as `mb + 1`; F of stage `s` adds `s + 1`;
//! the last stage's backward starts from its own forward output times `L + 2`; I of stage
//! `s` multiplies the incoming gradient by `s + 2`. Every action checks that what arrived
//! is exactly the value (and micro-batch and producing stage) it expects, and that its own
//! earlier actions ran (I after F, W after I), so any mis-routing or mis-ordering fails.

#![allow(dead_code)] // each test binary uses a different part

pub mod weights;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pipefill_actors::{StageCompute, declare_cost, spin_cpu};
use pipefill_schedules::{
    Action, ActionKind, CostModel, Placement, Plan, Timeline, simulate_measured,
};

/// What travels between fake stages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Msg {
    pub from_stage: u32,
    pub microbatch: u32,
    pub value: f64,
}

/// Expected output of F of `stage` for `mb`.
pub fn activation(stage: u32, mb: u32) -> f64 {
    (mb + 1) as f64 + (0..=stage).map(|k| (k + 1) as f64).sum::<f64>()
}

/// Expected output of I of `stage` for `mb` in a pipeline of `stages` stages.
pub fn gradient(stage: u32, mb: u32, stages: u32) -> f64 {
    let last = stages - 1;
    let mut g = activation(last, mb) * (last + 2) as f64;
    for s in (stage..last).rev() {
        g *= (s + 2) as f64;
    }
    g
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Error,
    Panic,
    /// Sleeps this long (a hung device), then goes on.
    Hang(std::time::Duration),
}

/// What the fakes observed, shared with the test.
#[derive(Default, Debug)]
pub struct Observed {
    /// (iteration-less) losses: micro-batch → activation at the last stage.
    pub losses: HashMap<u32, f64>,
    /// micro-batch → gradient produced by stage 0.
    pub input_grads: HashMap<u32, f64>,
    /// When the injected fault fired.
    pub fault_at: Option<Instant>,
    pub optimizer_steps: Vec<(usize, u64)>,
}

/// No cost at all (wall-clock tests of order and routing).
pub const COST_NONE: (f64, f64, f64) = (0.0, 0.0, 0.0);

/// One rank's fake.
pub struct Fake {
    pub rank: usize,
    pub stages: u32,
    /// Seconds of CPU per F, I, W.
    pub cost: (f64, f64, f64),
    pub fault: Option<(Action, Fault)>,
    pub observed: Arc<Mutex<Observed>>,
    forwarded: HashMap<(u32, u32), f64>,
    input_done: HashSet<(u32, u32)>,
}

impl Fake {
    /// One fake per rank of `plan`, sharing one observation log.
    pub fn for_plan(plan: &Plan, cost: (f64, f64, f64)) -> (Vec<Fake>, Arc<Mutex<Observed>>) {
        let observed = Arc::new(Mutex::new(Observed::default()));
        let fakes = (0..plan.num_ranks())
            .map(|rank| Fake {
                rank,
                stages: plan.stages as u32,
                cost,
                fault: None,
                observed: Arc::clone(&observed),
                forwarded: HashMap::new(),
                input_done: HashSet::new(),
            })
            .collect();
        (fakes, observed)
    }

    fn maybe_fail(&self, action: Action) -> Result<(), String> {
        match self.fault {
            Some((at, fault)) if at == action => {
                self.observed.lock().unwrap().fault_at = Some(Instant::now());
                match fault {
                    Fault::Error => Err(format!("injected fault at {action}")),
                    Fault::Panic => panic!("injected panic at {action}"),
                    Fault::Hang(d) => {
                        std::thread::sleep(d);
                        Ok(())
                    }
                }
            }
            _ => Ok(()),
        }
    }

    fn check(
        &self,
        what: &str,
        got: Option<Msg>,
        from: Option<u32>,
        mb: u32,
        want: f64,
    ) -> Result<(), String> {
        match (got, from) {
            (None, None) => Ok(()),
            (Some(m), Some(s)) if m.from_stage == s && m.microbatch == mb && m.value == want => {
                Ok(())
            }
            (got, _) => Err(format!(
                "{what}: got {got:?}, expected value {want} from stage {from:?} for micro-batch {mb}"
            )),
        }
    }
}

impl StageCompute for Fake {
    type Tensor = Msg;
    type Error = String;

    fn forward(&mut self, stage: u32, mb: u32, input: Option<Msg>) -> Result<Option<Msg>, String> {
        self.maybe_fail(Action::f(stage, mb))?;
        let (from, want) = if stage == 0 {
            (None, 0.0)
        } else {
            (Some(stage - 1), activation(stage - 1, mb))
        };
        self.check(&format!("{stage}F{mb}"), input, from, mb, want)?;
        work(self.cost.0);
        let value = activation(stage, mb);
        if self.forwarded.insert((stage, mb), value).is_some() {
            return Err(format!("{stage}F{mb} ran twice"));
        }
        if stage + 1 == self.stages {
            self.observed.lock().unwrap().losses.insert(mb, value);
            return Ok(None);
        }
        Ok(Some(Msg {
            from_stage: stage,
            microbatch: mb,
            value,
        }))
    }

    fn backward_input(
        &mut self,
        stage: u32,
        mb: u32,
        grad: Option<Msg>,
    ) -> Result<Option<Msg>, String> {
        self.maybe_fail(Action::i(stage, mb))?;
        let last = self.stages - 1;
        let (from, want) = if stage == last {
            (None, 0.0)
        } else {
            (Some(stage + 1), gradient(stage + 1, mb, self.stages))
        };
        self.check(&format!("{stage}I{mb}"), grad, from, mb, want)?;
        let act = self
            .forwarded
            .get(&(stage, mb))
            .copied()
            .ok_or(format!("{stage}I{mb} before its forward"))?;
        work(self.cost.1);
        let g = match grad {
            Some(g) => g.value * (stage + 2) as f64,
            None => act * (last + 2) as f64,
        };
        self.input_done.insert((stage, mb));
        if stage == 0 {
            self.observed.lock().unwrap().input_grads.insert(mb, g);
            return Ok(None);
        }
        Ok(Some(Msg {
            from_stage: stage,
            microbatch: mb,
            value: g,
        }))
    }

    fn backward_weight(&mut self, stage: u32, mb: u32) -> Result<(), String> {
        self.maybe_fail(Action::w(stage, mb))?;
        if !self.input_done.remove(&(stage, mb)) {
            return Err(format!("{stage}W{mb} before its input-gradient backward"));
        }
        self.forwarded.remove(&(stage, mb));
        work(self.cost.2);
        Ok(())
    }

    /// No weights to restore, so a speculative step is always undoable (and with the
    /// default, zero gradient statistics it is never wrong).
    fn can_roll_back(&self) -> bool {
        true
    }

    fn optimizer_step(&mut self, iteration: u64) -> Result<(), String> {
        if !self.forwarded.is_empty() {
            return Err(format!(
                "optimizer step with {} micro-batches not backpropagated",
                self.forwarded.len()
            ));
        }
        self.observed
            .lock()
            .unwrap()
            .optimizer_steps
            .push((self.rank, iteration));
        Ok(())
    }
}

/// Spins `seconds` of thread CPU and declares them: the cost of one piece of fake work,
/// whichever clock times it.
pub fn work(seconds: f64) {
    spin_cpu(seconds);
    declare_cost(seconds);
}

/// The cost model (seconds) matching a fake's costs.
pub fn cost_model(cost: (f64, f64, f64)) -> CostModel {
    CostModel::uniform(cost.0, cost.1, cost.2, 0.0)
}

/// The simulator's timeline of `plan` with every action lasting what `measured` recorded:
/// what a virtual-clock run must reproduce. The fake spins for its nominal cost, but on a
/// busy VM a thread's CPU clock now and then reads several milliseconds late and catches
/// up, so one spin of 1 ms can read 5 ms (CI saw a makespan 12% over the nominal
/// prediction); the nominal costs only bound each action from below, which this checks.
pub fn replayed(plan: &Plan, measured: &Timeline, base: &CostModel) -> Timeline {
    for span in &measured.spans {
        let nominal = base.duration(span.rank, &span.action);
        assert!(
            span.duration() >= nominal * (1.0 - 1e-6),
            "{span:?} took {} s, below the fake's spin of {nominal} s",
            span.duration()
        );
    }
    simulate_measured(plan, base, measured).expect("simulates")
}

/// Checks every micro-batch's loss and input gradient after a run.
pub fn assert_routed(observed: &Observed, plan: &Plan) {
    let stages = plan.stages as u32;
    for mb in 0..plan.microbatches as u32 {
        assert_eq!(
            observed.losses.get(&mb),
            Some(&activation(stages - 1, mb)),
            "loss of micro-batch {mb}"
        );
        assert_eq!(
            observed.input_grads.get(&mb),
            Some(&gradient(0, mb, stages)),
            "input gradient of micro-batch {mb}"
        );
    }
}

/// Inserts SEND/RECV for every cross-rank edge: RECV right before the consuming action,
/// SEND right after the producing one. Exercises the runtime's explicit-communication path
/// independently of the schedules crate's lowering.
pub fn lower_simply(plan: &Plan) -> Plan {
    let mut out = plan.clone();
    let last = plan.stages as u32 - 1;
    for (rank, list) in plan.ranks.iter().enumerate() {
        let mut lowered = Vec::new();
        for step in list {
            let Some(a) = *step else {
                lowered.push(None);
                continue;
            };
            let remote = |s: u32| plan.rank_of(s) != rank;
            let (mb, s) = (a.microbatch, a.stage);
            match a.kind {
                ActionKind::F if s > 0 && remote(s - 1) => {
                    lowered.push(Some(Action::new(ActionKind::RecvF, s, mb)))
                }
                ActionKind::I | ActionKind::B if s < last && remote(s + 1) => {
                    lowered.push(Some(Action::new(ActionKind::RecvB, s, mb)))
                }
                _ => {}
            }
            lowered.push(Some(a));
            match a.kind {
                ActionKind::F if s < last && remote(s + 1) => {
                    lowered.push(Some(Action::new(ActionKind::SendF, s, mb)))
                }
                ActionKind::I | ActionKind::B if s > 0 && remote(s - 1) => {
                    lowered.push(Some(Action::new(ActionKind::SendB, s, mb)))
                }
                _ => {}
            }
        }
        out.ranks[rank] = lowered;
    }
    out
}

/// `plan` with ranks `a` and `b` swapped (a custom placement): proves routing follows the
/// placement table, not "stage s lives on rank s".
pub fn swap_ranks(plan: &Plan, a: usize, b: usize) -> Plan {
    let mut out = plan.clone();
    out.ranks.swap(a, b);
    for r in &mut out.stage_rank {
        if *r == a {
            *r = b;
        } else if *r == b {
            *r = a;
        }
    }
    out.placement = Placement::Custom(out.stage_rank.clone());
    out
}
