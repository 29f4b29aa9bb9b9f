//! The profile and step log of a multi-process run, brought to rank 0: clock offsets
//! measured at join ([`sync_clock`]), every rank's spans after the run ([`rank_profile`],
//! gathered from every replica's ranks by [`crate::profile::merge::gather_profiles`]), and the step losses, which only the process of
//! the last stage knows ([`loss_rank`]).
//!
//! Span times are seconds from the runtime's epoch, taken when `run_local` starts; the
//! clock exchange runs on an epoch of our own taken at join. [`ClockSync::at_run_start`]
//! records how far into our epoch the run started, so a rank's offset to rank 0's span
//! times is `offset + lead − lead₀` (the runtime's own setup before its epoch, microseconds
//! on every rank alike, is the error left). With the virtual clock every rank's times are
//! already on one base (payloads carry their send time), so the offsets are zero.

use std::time::Instant;

use pipefill_actors::RunReport;

use crate::comm::link::{Channel, PeerLink};
use crate::comm::tcp::TcpMesh;
use crate::profile::ProfileError;
use crate::profile::merge::{
    ClockOffset, FILLER_LANE, LaneRecord, RankProfile, measure_clock, serve_clock,
};
use crate::schedules::{CostModel, Plan, Span, StageCost, Timeline};
use crate::train::StepMetrics;

/// Channel of the clock exchanges at join.
pub const CLOCK_CHANNEL: Channel = u32::MAX - 4;
/// Channel of the ranks' profiles after the run.
pub const PROFILE_CHANNEL: Channel = u32::MAX - 5;
/// Channel of the step log (last stage's process → rank 0).
pub const METRICS_CHANNEL: Channel = u32::MAX - 6;

/// Clock exchanges per rank; the one with the smallest round trip is kept.
const CLOCK_ROUNDS: usize = 16;
/// Lane of the runtime's measured waits for input (as a single-process run names it).
const WAIT_LANE: &str = "waiting for input";

/// This rank's clock relation to rank 0 (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct ClockSync {
    epoch: Instant,
    offset: ClockOffset,
    /// Where in `epoch`'s time the run started.
    lead: f64,
}

impl ClockSync {
    /// Marks the start of the run (call right before the runtime starts).
    pub fn at_run_start(&mut self) {
        self.lead = self.epoch.elapsed().as_secs_f64();
    }

    /// What to add to this rank's span times to get rank 0's run time, before rank 0's own
    /// lead is subtracted by the merge (which aligns the earliest span at 0).
    fn span_offset(&self) -> ClockOffset {
        ClockOffset {
            offset: self.offset.offset + self.lead,
            round_trip: self.offset.round_trip,
        }
    }
}

/// Measures every rank's clock offset to rank 0 over the mesh (every rank calls it at
/// join); `virtual_clock`: the run's times share one base already, offsets are zero.
pub fn sync_clock(mesh: &TcpMesh, virtual_clock: bool) -> Result<ClockSync, ProfileError> {
    let epoch = Instant::now();
    let zero = ClockOffset {
        offset: 0.0,
        round_trip: 0.0,
    };
    let mut sync = ClockSync {
        epoch,
        offset: zero,
        lead: 0.0,
    };
    if virtual_clock {
        return Ok(sync);
    }
    let now = move || epoch.elapsed().as_secs_f64();
    if mesh.rank() == 0 {
        for peer in 1..mesh.world() {
            serve_clock(mesh, peer, CLOCK_CHANNEL, CLOCK_ROUNDS, &now)?;
        }
    } else {
        sync.offset = measure_clock(mesh, CLOCK_CHANNEL, CLOCK_ROUNDS, &now)?;
    }
    Ok(sync)
}

/// This rank's profile from its run report: its spans per iteration, its waits and filler
/// work, its peak memory, and its clock offset. The report numbers the rank by its place in
/// its replica's pipeline (`pipeline_rank`); the profile by its mesh rank (`rank` = replica
/// × pp + pipeline rank), so that every replica's ranks have their own rows once merged.
pub fn rank_profile(
    rank: usize,
    pipeline_rank: usize,
    report: &RunReport,
    clock: &ClockSync,
) -> RankProfile {
    let iterations = report
        .iterations
        .iter()
        .map(|it| {
            it.timeline
                .spans
                .iter()
                .filter(|s| s.rank == pipeline_rank)
                .map(|s| Span { rank, ..*s })
                .collect()
        })
        .collect();
    let lane = |lane: &str, start, end, label| LaneRecord {
        lane: lane.into(),
        start,
        end,
        label,
    };
    let mut lanes = Vec::new();
    for it in &report.iterations {
        let bubbles = it.bubbles.iter().filter(|b| b.rank == pipeline_rank);
        lanes.extend(bubbles.map(|b| {
            lane(
                WAIT_LANE,
                b.start,
                b.end,
                format!("wait for {}", b.waiting_for),
            )
        }));
        let fillers = it.fillers.iter().filter(|f| f.rank == pipeline_rank);
        lanes.extend(fillers.map(|f| lane(FILLER_LANE, f.start, f.end, f.label.clone())));
    }
    RankProfile {
        rank,
        iterations,
        lanes,
        peak_memory: report
            .overall
            .ranks
            .get(pipeline_rank)
            .map_or(0.0, |r| r.peak_memory),
        clock: clock.span_offset(),
    }
}

/// The rank holding the plan's last stage: the one process that knows the losses.
pub fn loss_rank(plan: &Plan) -> usize {
    let last = plan.stages.saturating_sub(1) as u32;
    (0..plan.num_ranks())
        .find(|&r| plan.stages_of(r).contains(&last))
        .unwrap_or(0)
}

/// Sends the step log to rank 0 as one JSON frame.
pub fn send_metrics(mesh: &TcpMesh, metrics: &[StepMetrics]) -> Result<(), ProfileError> {
    let json = serde_json::to_vec(metrics).expect("step metrics always serialize");
    Ok(mesh.send(0, METRICS_CHANNEL, &json)?)
}

/// On rank 0: the step log `from` sent.
pub fn recv_metrics(mesh: &TcpMesh, from: usize) -> Result<Vec<StepMetrics>, ProfileError> {
    let frame = mesh.recv(from, METRICS_CHANNEL)?;
    serde_json::from_slice(&frame).map_err(|e| ProfileError::BadFrame {
        peer: from,
        what: "step log",
        reason: e.to_string(),
    })
}

/// Per-stage mean T_F, T_I, T_W over the merged iterations from `skip` on (as
/// `PipelineRun::mean_cost` does for a single-process run); `None` when a stage has no
/// measured forward.
pub fn mean_cost(plan: &Plan, iterations: &[Timeline], skip: usize) -> Option<CostModel> {
    Some(CostModel {
        stage: StageCost::means(plan.stages, iterations.iter().skip(skip))?,
        ..CostModel::default()
    })
}
