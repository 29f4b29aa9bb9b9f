//! Merged profiles of a multi-process run: every rank's spans on rank 0's clock, written as
//! the same run-directory files a single-process run writes (`trace.json`, `timeline.svg`,
//! `report.txt`/`report.json`).
//!
//! Each process measures its own rank on its own clock. At rendezvous every rank estimates
//! the offset of its clock to rank 0's with NTP-style exchanges ([`measure_clock`] against
//! [`serve_clock`]): for one exchange sent at `t0`, received by rank 0 at `t1`, answered at
//! `t2` and received back at `t3`, the offset is `((t1 − t0) + (t2 − t3)) / 2` and the
//! round trip `(t3 − t0) − (t2 − t1)`. The exchange with the smallest round trip is kept
//! ([`estimate_offset`]): its error is at most half its round trip, whatever the delays.
//! After the run each rank sends its [`RankProfile`] (spans per iteration, extra lanes) to
//! rank 0 ([`send_profile`] / [`gather_profiles`]), which shifts every rank by its offset
//! ([`merge`]) and recomputes the metrics with `Timeline::from_spans`, the only metric
//! computation, so a merged timeline means what a single-process one means.
//!
//! With data parallelism the mesh holds `dp` replicas of the plan's `pp` ranks (mesh rank =
//! replica × pp + pipeline rank). Every replica's ranks are merged, one row each
//! ([`MergedProfile::with_pipeline`] says which stages each pipeline rank holds): the trace
//! names each process by replica and stages, the report gives every replica's figures next
//! to the bubble ratio over all ranks, and the picture shows every rank.

use std::path::Path;

use std::fmt::Write as _;

use pipefill_schedules::{Plan, Span, Timeline};
use serde::{Deserialize, Serialize};

use super::LaneSpan;
use super::chrome::{ChromeOptions, write_chrome_trace};
use super::report::{BubbleReport, REPORT_JSON, REPORT_TXT, RunInfo, steady_iteration};
use super::svg::{SvgOptions, svg_with};
use crate::comm::link::{Channel, PeerLink};
use crate::profile::ProfileError;

/// Lane of the filler work (drawn in the SVG too; other lanes go to the trace only).
pub const FILLER_LANE: &str = "filler";

/// One clock exchange: `sent` and `received` on the measuring rank's clock, `served_at`
/// (request received) and `answered_at` (reply sent) on rank 0's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockSample {
    pub sent: f64,
    pub served_at: f64,
    pub answered_at: f64,
    pub received: f64,
}

impl ClockSample {
    /// Time on the wire, both ways.
    pub fn round_trip(&self) -> f64 {
        (self.received - self.sent) - (self.answered_at - self.served_at)
    }

    /// What to add to the rank's times to get rank 0's.
    pub fn offset(&self) -> f64 {
        ((self.served_at - self.sent) + (self.answered_at - self.received)) / 2.0
    }
}

/// A rank's clock offset to rank 0: `rank 0 time = own time + offset`, within
/// `± round_trip / 2`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClockOffset {
    pub offset: f64,
    pub round_trip: f64,
}

/// The offset of the exchange with the smallest round trip (NTP's minimum-delay filter).
pub fn estimate_offset(samples: &[ClockSample]) -> Option<ClockOffset> {
    samples
        .iter()
        .filter(|s| s.round_trip().is_finite())
        .min_by(|a, b| a.round_trip().total_cmp(&b.round_trip()))
        .map(|s| ClockOffset {
            offset: s.offset(),
            round_trip: s.round_trip().max(0.0),
        })
}

fn f64s(frame: &[u8], peer: usize, what: &'static str) -> Result<Vec<f64>, ProfileError> {
    if !frame.len().is_multiple_of(8) {
        return Err(ProfileError::BadFrame {
            peer,
            what,
            reason: format!("{} bytes is not a whole number of f64", frame.len()),
        });
    }
    Ok(frame
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("chunks of 8")))
        .collect())
}

/// Rank 0's side of `rounds` clock exchanges with `peer`: answers each request with the
/// time it arrived and the time of the answer, on `now` (rank 0's clock, seconds).
pub fn serve_clock(
    link: &dyn PeerLink,
    peer: usize,
    channel: Channel,
    rounds: usize,
    now: &dyn Fn() -> f64,
) -> Result<(), ProfileError> {
    for _ in 0..rounds {
        let request = link.recv(peer, channel)?;
        let served_at = now();
        f64s(&request, peer, "clock request")?;
        let mut reply = served_at.to_le_bytes().to_vec();
        reply.extend(now().to_le_bytes());
        link.send(peer, channel, &reply)?;
    }
    Ok(())
}

/// A rank's side of `rounds` clock exchanges with rank 0 (which runs [`serve_clock`]); `now`
/// is this rank's clock in seconds.
pub fn measure_clock(
    link: &dyn PeerLink,
    channel: Channel,
    rounds: usize,
    now: &dyn Fn() -> f64,
) -> Result<ClockOffset, ProfileError> {
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let sent = now();
        link.send(0, channel, &sent.to_le_bytes())?;
        let reply = link.recv(0, channel)?;
        let received = now();
        let times = f64s(&reply, 0, "clock reply")?;
        let [served_at, answered_at] = times[..] else {
            return Err(ProfileError::BadFrame {
                peer: 0,
                what: "clock reply",
                reason: format!("{} values, expected 2", times.len()),
            });
        };
        samples.push(ClockSample {
            sent,
            served_at,
            answered_at,
            received,
        });
    }
    estimate_offset(&samples).ok_or(ProfileError::NoSamples)
}

/// One extra-lane span of a rank (its rank is the profile's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaneRecord {
    pub lane: String,
    pub start: f64,
    pub end: f64,
    pub label: String,
}

/// What one rank measured, on its own clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankProfile {
    pub rank: usize,
    /// The rank's compute spans of each iteration (= optimizer step), in order.
    pub iterations: Vec<Vec<Span>>,
    /// Waits, filler work and other extra lanes, whole run.
    pub lanes: Vec<LaneRecord>,
    /// Peak activation memory of the rank (the timeline's figure).
    pub peak_memory: f64,
    /// This rank's clock offset to rank 0 (zero for rank 0).
    pub clock: ClockOffset,
}

/// Sends this rank's profile to rank 0 as one JSON frame on `channel`.
pub fn send_profile(
    link: &dyn PeerLink,
    channel: Channel,
    profile: &RankProfile,
) -> Result<(), ProfileError> {
    let json = serde_json::to_vec(profile).expect("a profile always serializes");
    Ok(link.send(0, channel, &json)?)
}

/// On rank 0: `own` and every other rank's profile, by rank.
pub fn gather_profiles(
    link: &dyn PeerLink,
    channel: Channel,
    own: RankProfile,
) -> Result<Vec<RankProfile>, ProfileError> {
    let mut all = vec![own];
    for peer in 1..link.world() {
        let frame = link.recv(peer, channel)?;
        let p: RankProfile =
            serde_json::from_slice(&frame).map_err(|e| ProfileError::BadFrame {
                peer,
                what: "profile",
                reason: e.to_string(),
            })?;
        all.push(p);
    }
    Ok(all)
}

/// Every rank's profile on rank 0's clock: one timeline per iteration, the whole run's, and
/// the extra lanes. Times start at 0 at the earliest span of any rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedProfile {
    pub iterations: Vec<Timeline>,
    pub overall: Timeline,
    pub lanes: Vec<LaneSpan>,
    /// The stages each rank of one pipeline holds; the merged ranks are `ranks / len`
    /// replicas of it. Empty: one pipeline of all ranks, stages unnamed.
    pub pipeline: Vec<Vec<u32>>,
    /// The filler figures the report gives, when the run filled its bubbles.
    pub filling: Option<super::report::Filling>,
}

/// Merges one profile per rank `0..ranks` (see the module docs).
pub fn merge(profiles: &[RankProfile], ranks: usize) -> Result<MergedProfile, ProfileError> {
    let mut by_rank: Vec<Option<&RankProfile>> = vec![None; ranks];
    for p in profiles {
        match by_rank.get_mut(p.rank) {
            Some(slot @ None) => *slot = Some(p),
            _ => {
                return Err(ProfileError::BadRank {
                    rank: p.rank,
                    ranks,
                });
            }
        }
    }
    let by_rank = by_rank
        .into_iter()
        .enumerate()
        .map(|(rank, p)| p.ok_or(ProfileError::MissingRank { rank, ranks }))
        .collect::<Result<Vec<_>, _>>()?;
    let expected = by_rank.first().map_or(0, |p| p.iterations.len());
    for p in &by_rank {
        if p.iterations.len() != expected {
            return Err(ProfileError::Iterations {
                rank: p.rank,
                got: p.iterations.len(),
                expected,
            });
        }
        if let Some(s) = p.iterations.iter().flatten().find(|s| s.rank != p.rank) {
            return Err(ProfileError::SpanRank {
                rank: p.rank,
                span_rank: s.rank,
            });
        }
    }
    let t0 = by_rank
        .iter()
        .flat_map(|p| {
            p.iterations
                .iter()
                .flatten()
                .map(|s| s.start + p.clock.offset)
        })
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let shift = |p: &RankProfile, t: f64| t + p.clock.offset - t0;
    let peak: Vec<f64> = by_rank.iter().map(|p| p.peak_memory).collect();
    let iterations: Vec<Timeline> = (0..expected)
        .map(|i| {
            let spans = by_rank
                .iter()
                .flat_map(|p| {
                    p.iterations[i].iter().map(move |s| Span {
                        start: shift(p, s.start),
                        end: shift(p, s.end),
                        ..*s
                    })
                })
                .collect();
            Timeline::from_spans(ranks, spans, &peak)
        })
        .collect();
    let all = iterations
        .iter()
        .flat_map(|t| t.spans.iter().copied())
        .collect();
    let overall = Timeline::from_spans(ranks, all, &peak);
    let lanes = by_rank
        .iter()
        .flat_map(|p| {
            p.lanes.iter().map(move |l| LaneSpan {
                rank: p.rank,
                lane: l.lane.clone(),
                start: shift(p, l.start),
                end: shift(p, l.end),
                label: l.label.clone(),
            })
        })
        .collect();
    Ok(MergedProfile {
        iterations,
        overall,
        lanes,
        pipeline: Vec::new(),
        filling: None,
    })
}

/// One replica's figures in a step's timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaFigures {
    pub replica: usize,
    /// Its mesh ranks.
    pub ranks: std::ops::Range<usize>,
    pub makespan: f64,
    pub bubble_ratio: f64,
    pub steady_bubble_ratio: f64,
}

/// `timeline` (over `replicas` × `pp` ranks) cut into its replicas, each with the metrics of
/// its own ranks (`Timeline::from_spans` on its spans, renumbered from 0).
pub fn replica_figures(timeline: &Timeline, pp: usize) -> Vec<ReplicaFigures> {
    let pp = pp.max(1);
    let replicas = timeline.ranks.len() / pp;
    (0..replicas)
        .map(|r| {
            let ranks = r * pp..(r + 1) * pp;
            let spans = timeline
                .spans
                .iter()
                .filter(|s| ranks.contains(&s.rank))
                .map(|s| Span {
                    rank: s.rank - ranks.start,
                    ..*s
                })
                .collect();
            let own = Timeline::from_spans(pp, spans, &[]);
            ReplicaFigures {
                replica: r,
                ranks,
                makespan: own.makespan,
                bubble_ratio: own.bubble_ratio,
                steady_bubble_ratio: own.steady_bubble_ratio,
            }
        })
        .collect()
}

/// `timeline` of one pipeline repeated for `replicas` replicas (mesh rank = replica × pp +
/// rank): the prediction for every rank of a data-parallel job, whose replicas run the same
/// plan on the same shapes.
pub fn tile(timeline: &Timeline, replicas: usize) -> Timeline {
    let pp = timeline.ranks.len();
    let spans = (0..replicas)
        .flat_map(|r| {
            timeline.spans.iter().map(move |s| Span {
                rank: r * pp + s.rank,
                ..*s
            })
        })
        .collect();
    let peak: Vec<f64> = (0..replicas)
        .flat_map(|_| timeline.ranks.iter().map(|r| r.peak_memory))
        .collect();
    Timeline::from_spans(pp * replicas, spans, &peak)
}

impl MergedProfile {
    /// Names the merged ranks by `plan`'s pipeline: mesh rank g is replica g / pp, holding
    /// the stages of `plan`'s rank g % pp.
    pub fn with_pipeline(mut self, plan: &Plan) -> Self {
        self.pipeline = (0..plan.num_ranks()).map(|r| plan.stages_of(r)).collect();
        self
    }

    /// Ranks of one pipeline (all ranks when no pipeline was given).
    fn pp(&self) -> usize {
        match self.pipeline.len() {
            0 => self.overall.ranks.len().max(1),
            pp => pp,
        }
    }

    /// The trace's name of mesh rank `rank`.
    fn process_name(&self, rank: usize) -> String {
        let pp = self.pp();
        let Some(stages) = self.pipeline.get(rank % pp) else {
            return format!("rank {rank}");
        };
        let list: Vec<String> = stages.iter().map(u32::to_string).collect();
        let word = if stages.len() == 1 { "stage" } else { "stages" };
        format!(
            "rank {rank} · replica {} {word} {}",
            rank / pp,
            list.join(",")
        )
    }

    /// Writes `report.json`/`report.txt` (the steady step next to `predicted`),
    /// `trace.json` (the whole run) and `timeline.svg` (the steady step, in ms) into `dir`,
    /// as a single-process run does. `info`'s `iteration` and `iteration_note` are filled
    /// here from the steady step; `first_step` is the step of iteration 0.
    pub fn write_files(
        &self,
        dir: &Path,
        mut info: RunInfo,
        first_step: u64,
        predicted: &Timeline,
        show_stage: bool,
    ) -> Result<BubbleReport, ProfileError> {
        let makespans: Vec<f64> = self.iterations.iter().map(|t| t.makespan).collect();
        let (index, note) =
            steady_iteration(&makespans, first_step).ok_or(ProfileError::NothingMeasured)?;
        info.iteration = first_step as usize + index;
        info.iteration_note = note;
        let measured = &self.iterations[index];
        let (ranks, pp) = (measured.ranks.len(), self.pp());
        // `predicted` is one pipeline's; every replica runs the same plan.
        let tiled;
        let predicted = if predicted.ranks.len() == pp && ranks > pp {
            tiled = tile(predicted, ranks / pp);
            &tiled
        } else {
            predicted
        };
        let mut report = BubbleReport::new(info, measured, predicted)?
            .with_whole_run(&self.overall, self.iterations.len());
        if let Some(filling) = &self.filling {
            report = report.with_filling(filling.clone(), None);
        }
        let mut text = report.to_text();
        if ranks > pp {
            text += &self.replica_text(measured, report.info.iteration, &report.info.units);
        }
        for (name, body) in [(REPORT_JSON, report.to_json()), (REPORT_TXT, text)] {
            let path = dir.join(name);
            std::fs::write(&path, body).map_err(|error| ProfileError::Write { path, error })?;
        }

        let path = dir.join("trace.json");
        let trace = std::fs::File::create(&path).and_then(|file| {
            write_chrome_trace(
                file,
                &self.overall,
                &self.lanes,
                &ChromeOptions {
                    us_per_unit: 1e6,
                    bubbles: true,
                    process_names: (0..self.overall.ranks.len())
                        .map(|rank| self.process_name(rank))
                        .collect(),
                },
            )
        });
        trace.map_err(|error| ProfileError::Write { path, error })?;

        // The picture: the steady step only, in milliseconds from its own start.
        let (start, end) = (
            measured.start(),
            measured
                .spans
                .iter()
                .map(|s| s.end)
                .fold(f64::NEG_INFINITY, f64::max),
        );
        let timeline_ms = measured.rescaled(start, 1e3);
        let fillers: Vec<LaneSpan> = self
            .lanes
            .iter()
            .filter(|l| l.lane == FILLER_LANE && l.start >= start && l.end <= end)
            .map(|l| l.clone().rescaled(start, 1e3))
            .collect();
        let replicas = if ranks > pp {
            format!(" = {} replicas × {pp}", ranks / pp)
        } else {
            String::new()
        };
        let title = report.timeline_title(&format!(
            "{} · {} ranks{replicas} (merged from {} processes) · step {} measured ({} clock) · ms",
            report.info.schedule,
            report.ranks_count,
            report.ranks_count,
            report.info.iteration,
            report.info.clock,
        ));
        let svg = svg_with(
            &timeline_ms,
            &fillers,
            &SvgOptions {
                title: Some(title),
                show_stage,
                ..SvgOptions::default()
            },
        );
        let path = dir.join("timeline.svg");
        std::fs::write(&path, svg).map_err(|error| ProfileError::Write { path, error })?;
        Ok(report)
    }
}

impl MergedProfile {
    /// The report's section on every replica's figures in `measured` (step `step`) and the
    /// whole run's, in the report's units.
    fn replica_text(&self, measured: &Timeline, step: usize, units: &str) -> String {
        let pp = self.pp();
        let (scale, unit) = if units == "s" {
            (1e3, "ms")
        } else {
            (1.0, units)
        };
        let mut out = format!(
            "\nreplicas ({} × {pp} ranks; bubble ratios over each replica's own ranks, the figures above over all {} ranks):\n",
            measured.ranks.len() / pp,
            measured.ranks.len()
        );
        let whole = replica_figures(&self.overall, pp);
        for (r, w) in replica_figures(measured, pp).iter().zip(&whole) {
            let _ = writeln!(
                out,
                "replica {} (ranks {}–{}): step {step} makespan {:.3} {unit}, bubble ratio {:.1}%, steady {:.1}%; whole run bubble ratio {:.1}%, steady {:.1}%",
                r.replica,
                r.ranks.start,
                r.ranks.end - 1,
                r.makespan * scale,
                100.0 * r.bubble_ratio,
                100.0 * r.steady_bubble_ratio,
                100.0 * w.bubble_ratio,
                100.0 * w.steady_bubble_ratio,
            );
        }
        out
    }
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
