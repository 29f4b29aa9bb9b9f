//! Tests of the launched auto switch: ranks on threads joined by the in-process link stand
//! for the processes of a job.

use std::thread;

use pipefill_actors::spin_cpu;

use super::*;
use crate::comm::link::InProcessLink;
use crate::schedules::simulate;

/// Iteration 0 of one rank: `m` F, I and W of `stage`, each kind around its own cost and
/// scaled by `slow`, then iteration 1's (much slower, so that using them would show).
fn samples(stage: u32, m: usize, slow: f64) -> Samples {
    let mut v = Vec::new();
    for (scale, extra) in [(slow, 0.0), (100.0, 1.0)] {
        for mb in 0..m {
            let jitter = 1.0 + 0.01 * ((mb * 7 % 5) as f64) + extra;
            v.push((stage, ActionKind::F, 1.0 * scale * jitter));
            v.push((stage, ActionKind::I, 1.2 * scale * jitter));
            v.push((stage, ActionKind::W, 0.8 * scale * jitter));
        }
    }
    Arc::new(Mutex::new(v))
}

/// Runs iterations 0..4 of every rank's re-planner on threads; returns each rank's plans
/// and its choice.
fn agree(pp: usize, dp: usize, m: usize, slow: &[f64]) -> Vec<(Vec<Plan>, AutoChoice)> {
    let handles: Vec<_> = InProcessLink::group(pp * dp)
        .into_iter()
        .map(|link| {
            let rank = link.rank();
            let switch = AutoSwitch::new(pp, dp, m, Clock::virtual_free());
            let samples = samples((rank % pp) as u32, m, slow[rank]);
            thread::spawn(move || {
                let mut replan = switch
                    .replanner(Arc::new(link) as Arc<dyn PeerLink>, samples)
                    .unwrap();
                let plans = (0..4).map(|i| replan(i, None).unwrap()).collect();
                (plans, switch.choice().unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn every_rank_gathers_the_measured_costs_and_switches_to_the_same_plan() {
    let (pp, m) = (4, 8);
    // Rank 2's stage is three times slower.
    let slow = [1.0, 1.0, 3.0, 1.0];
    let ranks = agree(pp, 1, m, &slow);
    let zb_h1 = build(ScheduleKind::ZbH1, pp, m, 1).unwrap();
    let (_, first) = &ranks[0];
    for (rank, (plans, choice)) in ranks.iter().enumerate() {
        assert_eq!(plans[0], zb_h1, "rank {rank}: iteration 0");
        assert_eq!(plans[1], zb_h1, "rank {rank}: iteration 1");
        assert_eq!(plans[2], choice.plan, "rank {rank}: iteration 2");
        assert_eq!(plans[3], choice.plan, "rank {rank}: iteration 3");
        assert_eq!(choice.iteration, SWITCH_AT);
        assert_eq!(choice.plan_hash(), first.plan_hash(), "rank {rank}");
        assert_eq!(choice.cost, first.cost, "rank {rank}");
        // The gathered entry of each stage is bitwise what its rank measured in iteration 0.
        let own = first_medians(&lock(&samples(rank as u32, m, slow[rank])), rank as u32, m);
        assert_eq!(Some(choice.measured), own);
        assert_eq!(first.cost.stage[rank], choice.measured);
    }
    assert_eq!(first.cost.stage[2].f, 3.0 * first.cost.stage[0].f);
    // The slow stage makes the auto plan differ from ZB-H1, and it is no worse under the
    // gathered costs (the slow stage bounds both: 3× leaves nothing to win).
    assert_ne!(first.plan, zb_h1);
    let auto = simulate(&first.plan, &first.cost).unwrap();
    let base = simulate(&zb_h1, &first.cost).unwrap();
    assert!(
        auto.steady_bubble_ratio <= base.steady_bubble_ratio + 1e-9,
        "auto {} vs ZB-H1 {}",
        auto.steady_bubble_ratio,
        base.steady_bubble_ratio
    );
}

#[test]
fn replicas_average_each_stage_and_agree_too() {
    // dp = 2 × pp = 2: ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1.
    let slow = [1.0, 2.0, 3.0, 4.0];
    let ranks = agree(2, 2, 4, &slow);
    let medians = |r: usize| {
        first_medians(
            &lock(&samples((r % 2) as u32, 4, slow[r])),
            (r % 2) as u32,
            4,
        )
        .unwrap()
    };
    let (_, first) = &ranks[0];
    for s in 0..2 {
        let (a, b) = (medians(s), medians(s + 2));
        assert_eq!(first.cost.stage[s].f, (a.f + b.f) / 2.0);
        assert_eq!(first.cost.stage[s].w, (a.w + b.w) / 2.0);
    }
    for (_, choice) in &ranks {
        assert_eq!(choice.plan, first.plan);
        assert_eq!(choice.cost, first.cost);
    }
}

#[test]
fn a_rank_without_iteration_0_measured_is_named() {
    let link = InProcessLink::group(2).into_iter().nth(1).unwrap();
    let switch = AutoSwitch::new(2, 1, 4, Clock::virtual_free());
    // Iteration 0 without its last weight backward.
    let partial = samples(1, 4, 1.0);
    lock(&partial).truncate(3 * 4 - 1);
    let mut replan = switch
        .replanner(Arc::new(link) as Arc<dyn PeerLink>, partial)
        .unwrap();
    let err = replan(SWITCH_AT, None).unwrap_err().to_string();
    assert!(
        err.contains("rank 1") && err.contains("stage 1 has not measured 4"),
        "{err}"
    );
}

/// A compute whose actions burn known CPU time.
struct Burn;

impl StageCompute for Burn {
    type Tensor = ();
    type Error = String;

    fn forward(&mut self, _: u32, _: u32, _: Option<()>) -> Result<Option<()>, String> {
        spin_cpu(0.002);
        Ok(Some(()))
    }

    fn backward_input(&mut self, _: u32, _: u32, _: Option<()>) -> Result<Option<()>, String> {
        spin_cpu(0.006);
        Ok(Some(()))
    }

    fn backward_weight(&mut self, _: u32, _: u32) -> Result<(), String> {
        spin_cpu(0.018);
        Ok(())
    }
}

#[test]
fn the_meter_times_each_action_on_thread_cpu_time_and_off_times_nothing() {
    let mut meter = CostMeter::on(Burn, true);
    for mb in 0..3 {
        meter.forward(1, mb, None).unwrap();
        meter.backward_input(1, mb, None).unwrap();
        meter.backward_weight(1, mb).unwrap();
    }
    let samples = Arc::clone(meter.samples.as_ref().unwrap());
    let c = first_medians(&lock(&samples), 1, 3).unwrap();
    // Thread CPU time is what each action burnt, whatever else the machine runs; the upper
    // bounds only leave room for the timer's own granularity.
    assert!((0.002..0.005).contains(&c.f), "{c:?}");
    assert!((0.006..0.012).contains(&c.i), "{c:?}");
    assert!((0.018..0.030).contains(&c.w), "{c:?}");
    assert_eq!(first_medians(&lock(&samples), 0, 3), None);

    let mut off = CostMeter::off(Burn);
    off.forward(0, 0, None).unwrap();
    assert!(off.samples.is_none());
}
