//! Step inflation without machine-load noise: a filled step replayed without its fillers.
//!
//! Comparing a filled run with a separate run without fillers mixes what filling cost with
//! how loaded the machine was in each run (the compute actions' thread-CPU costs differ
//! between runs). Under the virtual clock the cost of filling is exact instead: take one
//! filled step's measured compute actions (their own durations), run them again in the
//! plan's order per rank with the runtime's receive rule, and leave the filler spans out.
//! Same actions, same costs; the makespans differ only by what filling cost the critical
//! path.
//!
//! The replay follows the virtual clock (`pipefill_actors` `clock.rs`, `stage/walk.rs`):
//! - each rank starts where it started the step (its first record's start minus the bubble
//!   it waited in before it, which is where any filler in that bubble began);
//! - a compute action starts when the rank is free and its inputs are there, and lasts its
//!   measured duration. Inputs (as in the simulator): `F(s, mb)` needs `F(s − 1, mb)`, a
//!   backward (`I`/`B`) of `(s, mb)` needs the backward of `(s + 1, mb)`; one produced on
//!   another rank is there `link_latency` after it was produced. Local inputs (`F` before
//!   its backward, `I` before `W`) were produced earlier on the same rank;
//! - a SEND stamps the payload with the rank's clock (no time of its own); the matching
//!   RECV completes at `max(clock, stamp + link_latency)`.

use std::collections::HashMap;

use pipefill_actors::ActionRecord;
use pipefill_schedules::{Action, ActionKind};
use thiserror::Error;

/// Why a step could not be replayed.
#[derive(Debug, Error, PartialEq)]
pub enum ReplayError {
    #[error("step replay: no record has a compute action, so there is no makespan")]
    Empty,
    #[error(
        "step replay: no rank can make progress; rank {rank} waits at {action} for an input \
         no record of the step produces"
    )]
    Stuck { rank: usize, action: Action },
}

/// What a produced value is: the forward output or input gradient of `(stage, mb)`, or the
/// stamp of the message carrying it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Made {
    Forward(u32, u32),
    Backward(u32, u32),
    SentF(u32, u32),
    SentB(u32, u32),
}

/// The makespan of one step's records (every rank's, in the order each rank ran them)
/// replayed without fillers under a virtual clock with `link_latency` between ranks:
/// last compute end − first compute start, as [`pipefill_schedules::Timeline`] measures it.
pub fn replay_makespan(records: &[ActionRecord], link_latency: f64) -> Result<f64, ReplayError> {
    let ranks = records.iter().map(|r| r.rank + 1).max().unwrap_or(0);
    let mut lists: Vec<Vec<&ActionRecord>> = vec![Vec::new(); ranks];
    for r in records {
        lists[r.rank].push(r);
    }
    for list in &mut lists {
        list.sort_by_key(|r| r.index);
    }
    // Which rank holds each stage, from where its compute actions ran.
    let mut stage_rank: HashMap<u32, usize> = HashMap::new();
    let mut last_stage = 0;
    for r in records.iter().filter(|r| r.action.kind.is_compute()) {
        for part in r.action.parts() {
            stage_rank.insert(part.stage, r.rank);
            last_stage = last_stage.max(part.stage);
        }
    }
    let mut clock: Vec<f64> = lists
        .iter()
        .map(|l| l.first().map_or(0.0, |r| r.start - r.waited))
        .collect();
    let mut pos = vec![0usize; ranks];
    let mut made: HashMap<Made, f64> = HashMap::new();
    let (mut t0, mut t1) = (f64::INFINITY, f64::NEG_INFINITY);
    let link = |from: Option<&usize>, to: usize| match from {
        Some(&f) if f != to => link_latency,
        _ => 0.0,
    };
    loop {
        let mut progressed = false;
        for rank in 0..ranks {
            while let Some(&rec) = lists[rank].get(pos[rank]) {
                let a = rec.action;
                let ready = match a.kind {
                    ActionKind::SendF | ActionKind::SendB => {
                        let key = match a.kind {
                            ActionKind::SendF => Made::SentF(a.stage, a.microbatch),
                            _ => Made::SentB(a.stage, a.microbatch),
                        };
                        made.insert(key, clock[rank]);
                        Some(clock[rank])
                    }
                    // RECV_F of stage s takes SEND_F of s − 1; RECV_B of s takes SEND_B of s + 1.
                    ActionKind::RecvF => made
                        .get(&Made::SentF(a.stage.wrapping_sub(1), a.microbatch))
                        .map(|&t| t + link_latency),
                    ActionKind::RecvB => made
                        .get(&Made::SentB(a.stage + 1, a.microbatch))
                        .map(|&t| t + link_latency),
                    _ => a.parts().try_fold(clock[rank], |at, part| {
                        let need = match part.kind {
                            ActionKind::F if part.stage > 0 => {
                                Some(Made::Forward(part.stage - 1, part.microbatch))
                            }
                            ActionKind::I | ActionKind::B if part.stage < last_stage => {
                                Some(Made::Backward(part.stage + 1, part.microbatch))
                            }
                            _ => None,
                        };
                        let Some(need) = need else { return Some(at) };
                        let (Made::Forward(s, _) | Made::Backward(s, _)) = need else {
                            unreachable!("compute inputs are forwards or backwards")
                        };
                        let lat = link(stage_rank.get(&s), rank);
                        made.get(&need).map(|&t| at.max(t + lat))
                    }),
                };
                let Some(ready) = ready else { break };
                let start = clock[rank].max(ready);
                if a.kind.is_compute() {
                    let end = start + rec.duration();
                    for part in a.parts() {
                        match part.kind {
                            ActionKind::F => {
                                made.insert(Made::Forward(part.stage, part.microbatch), end);
                            }
                            ActionKind::I | ActionKind::B => {
                                made.insert(Made::Backward(part.stage, part.microbatch), end);
                            }
                            _ => {}
                        }
                    }
                    t0 = t0.min(start);
                    t1 = t1.max(end);
                    clock[rank] = end;
                } else {
                    clock[rank] = start;
                }
                pos[rank] += 1;
                progressed = true;
            }
        }
        if (0..ranks).all(|r| pos[r] == lists[r].len()) {
            break;
        }
        if !progressed {
            let rank = (0..ranks)
                .find(|&r| pos[r] < lists[r].len())
                .unwrap_or_default();
            return Err(ReplayError::Stuck {
                rank,
                action: lists[rank][pos[rank]].action,
            });
        }
    }
    if t1 < t0 {
        return Err(ReplayError::Empty);
    }
    Ok(t1 - t0)
}

/// Step inflation of each step: its measured makespan / its replay without fillers − 1.
pub fn step_inflations<'a>(
    steps: impl IntoIterator<Item = (f64, &'a [ActionRecord])>,
    link_latency: f64,
) -> Result<Vec<f64>, ReplayError> {
    steps
        .into_iter()
        .map(|(measured, records)| {
            let without = replay_makespan(records, link_latency)?;
            Ok(if without > 0.0 {
                measured / without - 1.0
            } else {
                0.0
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: usize, index: usize, action: Action, start: f64, end: f64) -> ActionRecord {
        ActionRecord {
            rank,
            iteration: 0,
            index,
            action,
            start,
            end,
            waited: 0.0,
        }
    }

    /// Two ranks, two stages, one micro-batch, compute-only: 0F0 [0,1), 1F0 [1,2),
    /// 1B0 [2,4), 0B0 [4,6); `late` delays rank 1's forward by that much (a filler that
    /// overran the slot it was given while rank 1 waited for 0F0).
    fn one_microbatch(late: f64) -> Vec<ActionRecord> {
        let mut r1 = rec(1, 0, Action::f(1, 0), 1.0 + late, 2.0 + late);
        r1.waited = 1.0 + late;
        vec![
            rec(0, 0, Action::f(0, 0), 0.0, 1.0),
            rec(0, 1, Action::b(0, 0), 4.0 + late, 6.0 + late),
            r1,
            rec(1, 1, Action::b(1, 0), 2.0 + late, 4.0 + late),
        ]
    }

    fn makespan(records: &[ActionRecord]) -> f64 {
        let t0 = records
            .iter()
            .map(|r| r.start)
            .fold(f64::INFINITY, f64::min);
        let t1 = records.iter().map(|r| r.end).fold(0.0, f64::max);
        t1 - t0
    }

    #[test]
    fn an_unfilled_step_replays_to_its_measured_makespan() {
        let step = one_microbatch(0.0);
        assert_eq!(replay_makespan(&step, 0.0), Ok(makespan(&step)));
        assert_eq!(step_inflations([(6.0, &step[..])], 0.0), Ok(vec![0.0]));
    }

    #[test]
    fn a_filler_overrun_on_the_critical_path_is_the_inflation() {
        // The filler ran 0.3 past 0F0's arrival: the measured step is 6.3, the replay 6.
        let step = one_microbatch(0.3);
        assert!((makespan(&step) - 6.3).abs() < 1e-12);
        assert!((replay_makespan(&step, 0.0).unwrap() - 6.0).abs() < 1e-12);
        let inflation = step_inflations([(6.3, &step[..])], 0.0).unwrap()[0];
        assert!((inflation - 0.05).abs() < 1e-12, "{inflation}");
    }

    #[test]
    fn lowered_plans_receive_at_the_send_stamp_plus_the_link_latency() {
        use ActionKind::{RecvB, RecvF, SendB, SendF};
        let lat = 0.5;
        // Rank 1 waits from 0 for 0F0; rank 0 waits from 1 for 1B0.
        let waiting = |mut r: ActionRecord, waited: f64| {
            r.waited = waited;
            r
        };
        let step = vec![
            rec(0, 0, Action::f(0, 0), 0.0, 1.0),
            rec(0, 1, Action::new(SendF, 0, 0), 1.0, 1.0),
            waiting(rec(0, 2, Action::new(RecvB, 0, 0), 5.0, 5.0), 4.0),
            rec(0, 3, Action::b(0, 0), 5.0, 7.0),
            waiting(rec(1, 0, Action::new(RecvF, 1, 0), 1.5, 1.5), 1.5),
            rec(1, 1, Action::f(1, 0), 1.5, 2.5),
            rec(1, 2, Action::b(1, 0), 2.5, 4.5),
            rec(1, 3, Action::new(SendB, 1, 0), 4.5, 4.5),
        ];
        assert_eq!(replay_makespan(&step, lat), Ok(7.0));
        // Without the latency both hand-offs are immediate: 1 + 1 + 2 + 2.
        assert_eq!(replay_makespan(&step, 0.0), Ok(6.0));
    }

    #[test]
    fn a_step_missing_a_producer_is_refused_naming_who_waits() {
        let step = vec![rec(1, 0, Action::f(1, 0), 0.0, 1.0), {
            // Stage 0 is on rank 0, but its forward is missing from the records.
            rec(0, 0, Action::b(0, 0), 1.0, 2.0)
        }];
        let err = replay_makespan(&step, 0.0).unwrap_err();
        assert!(matches!(err, ReplayError::Stuck { .. }), "{err}");
        assert_eq!(replay_makespan(&[], 0.0), Err(ReplayError::Empty));
    }
}
