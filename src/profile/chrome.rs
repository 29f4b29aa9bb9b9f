//! A Chrome trace-event JSON file of a timeline, for Perfetto (`ui.perfetto.dev`) and
//! `chrome://tracing`.
//!
//! Layout: `{"traceEvents": [...], "displayTimeUnit": "ms"}`. Each rank is a process
//! (`pid` = rank, named `rank N` by a `process_name` metadata event); each lane of a rank
//! is a thread (`tid` [`COMPUTE_LANE`] = 0 holds the compute actions; [`BUBBLE_LANE`] = 1,
//! when asked for, holds the bubble slots; extra lanes such as the runtime's filler work,
//! given as [`LaneSpan`]s, follow from tid [`FIRST_EXTRA_LANE`] = 2 on, one per lane name,
//! each named by a `thread_name` metadata event). Every action is one complete event (`"ph":"X"`)
//! named by its text form (`2I5`, `(0F7;7B3)OVERLAP_F_B`) with `cat` = its kind (`F`, `I`,
//! `W`, `B`, `OVERLAP_F_B`), so Perfetto can colour and filter by kind.
//!
//! **Time scale.** Trace events are in microseconds; a timeline is in cost units (the
//! simulator's) or seconds (a measured one). `us_per_unit` converts: the default, 1000,
//! maps one cost unit to one millisecond, which `displayTimeUnit: "ms"` then shows as `1`.
//! Times are snapped to whole nanoseconds (what Perfetto stores) before `dur` is taken as
//! end − start, so events of one lane never overlap, not even by a rounding error, since
//! the spans of one rank never do.

use pipefill_schedules::Timeline;
use std::io::Write;

use serde_json::{Value, json};

use super::{LaneSpan, lane_names};

/// `tid` of the lane holding compute actions.
pub const COMPUTE_LANE: u64 = 0;
/// `tid` of the lane holding bubble slots (see [`ChromeOptions::bubbles`]).
pub const BUBBLE_LANE: u64 = 1;
/// `tid` of the first extra lane (see [`chrome_trace_with`]).
pub const FIRST_EXTRA_LANE: u64 = 2;

/// How to write the trace.
#[derive(Clone, Debug)]
pub struct ChromeOptions {
    /// Microseconds per timeline unit (1000: one cost unit shows as one millisecond).
    pub us_per_unit: f64,
    /// Also write every bubble slot as an event named `bubble` on lane [`BUBBLE_LANE`].
    pub bubbles: bool,
    /// Each rank's process name, by rank; `rank N` for a rank past its end.
    pub process_names: Vec<String>,
}

impl Default for ChromeOptions {
    fn default() -> Self {
        ChromeOptions {
            us_per_unit: 1000.0,
            bubbles: false,
            process_names: Vec::new(),
        }
    }
}

/// `[start, end)` in cost units → (`ts`, `dur`) in µs, both on a whole-nanosecond grid.
fn ts_dur(start: f64, end: f64, scale: f64) -> (f64, f64) {
    let ns = |t: f64| (t * scale * 1000.0).round();
    let (a, b) = (ns(start), ns(end));
    (a / 1000.0, (b - a).max(0.0) / 1000.0)
}

/// The trace of `timeline` as a JSON value (see the module docs).
pub fn chrome_trace(timeline: &Timeline, opts: &ChromeOptions) -> Value {
    chrome_trace_with(timeline, &[], opts)
}

/// The trace of `timeline` plus `extra` spans (filler work, transfers, …), each distinct
/// lane name on its own thread of its rank, from [`FIRST_EXTRA_LANE`] on.
pub fn chrome_trace_with(timeline: &Timeline, extra: &[LaneSpan], opts: &ChromeOptions) -> Value {
    let mut events = Vec::new();
    for_each_event(timeline, extra, opts, |e| {
        events.push(e);
        Ok(())
    })
    .unwrap_or_default();
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// [`chrome_trace_with`] written to `out` event by event: a whole run's trace is the
/// largest thing a run writes, and as a [`Value`] it would be held whole, several times
/// its text's size, at the end of the run (the peak of a long run's memory).
pub fn write_chrome_trace(
    out: impl Write,
    timeline: &Timeline,
    extra: &[LaneSpan],
    opts: &ChromeOptions,
) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(out);
    out.write_all(b"{\"traceEvents\":[")?;
    let mut first = true;
    for_each_event(timeline, extra, opts, |e| {
        if !first {
            out.write_all(b",")?;
        }
        first = false;
        serde_json::to_writer(&mut out, &e).map_err(std::io::Error::from)
    })?;
    out.write_all(b"],\"displayTimeUnit\":\"ms\"}")?;
    out.flush()
}

/// Every event of the trace, in order, handed to `emit` one at a time.
fn for_each_event(
    timeline: &Timeline,
    extra: &[LaneSpan],
    opts: &ChromeOptions,
    mut emit: impl FnMut(Value) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let scale = if opts.us_per_unit > 0.0 {
        opts.us_per_unit
    } else {
        1000.0
    };
    for r in &timeline.ranks {
        let name = opts
            .process_names
            .get(r.rank)
            .cloned()
            .unwrap_or_else(|| format!("rank {}", r.rank));
        emit(json!({
            "name": "process_name", "ph": "M", "pid": r.rank, "tid": COMPUTE_LANE,
            "args": { "name": name }
        }))?;
        emit(json!({
            "name": "process_sort_index", "ph": "M", "pid": r.rank, "tid": COMPUTE_LANE,
            "args": { "sort_index": r.rank }
        }))?;
        emit(json!({
            "name": "thread_name", "ph": "M", "pid": r.rank, "tid": COMPUTE_LANE,
            "args": { "name": "compute" }
        }))?;
        if opts.bubbles {
            emit(json!({
                "name": "thread_name", "ph": "M", "pid": r.rank, "tid": BUBBLE_LANE,
                "args": { "name": "bubbles" }
            }))?;
        }
    }
    for span in &timeline.spans {
        let a = &span.action;
        let mut args = json!({
            "stage": a.stage,
            "microbatch": a.microbatch,
            "start": span.start,
            "end": span.end,
        });
        if let Some(b) = a.pair {
            args["backward_stage"] = json!(b.stage);
            args["backward_microbatch"] = json!(b.microbatch);
        }
        let (ts, dur) = ts_dur(span.start, span.end, scale);
        emit(json!({
            "name": a.to_string(),
            "cat": a.kind.as_str(),
            "ph": "X",
            "pid": span.rank,
            "tid": COMPUTE_LANE,
            "ts": ts,
            "dur": dur,
            "args": args,
        }))?;
    }
    if opts.bubbles {
        for slot in &timeline.slots {
            let (ts, dur) = ts_dur(slot.start, slot.start + slot.length, scale);
            emit(json!({
                "name": "bubble",
                "cat": "bubble",
                "ph": "X",
                "pid": slot.rank,
                "tid": BUBBLE_LANE,
                "ts": ts,
                "dur": dur,
                "args": {
                    "length": slot.length,
                    "before": slot.before.map(|a| a.to_string()),
                    "after": slot.after.map(|a| a.to_string()),
                },
            }))?;
        }
    }
    let lanes = lane_names(extra);
    let tid_of =
        |lane: &str| FIRST_EXTRA_LANE + lanes.iter().position(|l| *l == lane).unwrap_or(0) as u64;
    let mut named: Vec<(usize, u64)> = Vec::new();
    for span in extra {
        let tid = tid_of(&span.lane);
        if !named.contains(&(span.rank, tid)) {
            named.push((span.rank, tid));
            emit(json!({
                "name": "thread_name", "ph": "M", "pid": span.rank, "tid": tid,
                "args": { "name": span.lane }
            }))?;
        }
        let (ts, dur) = ts_dur(span.start, span.end, scale);
        emit(json!({
            "name": span.label,
            "cat": span.lane,
            "ph": "X",
            "pid": span.rank,
            "tid": tid,
            "ts": ts,
            "dur": dur,
            "args": { "start": span.start, "end": span.end },
        }))?;
    }
    Ok(())
}

/// The trace of `timeline` as JSON text, ready to write to a `.json` file.
pub fn chrome_trace_json(timeline: &Timeline, opts: &ChromeOptions) -> String {
    chrome_trace_json_with(timeline, &[], opts)
}

/// [`chrome_trace_with`] as JSON text.
pub fn chrome_trace_json_with(
    timeline: &Timeline,
    extra: &[LaneSpan],
    opts: &ChromeOptions,
) -> String {
    let mut text = Vec::new();
    // Writing numbers and strings to memory cannot fail, and JSON is UTF-8.
    write_chrome_trace(&mut text, timeline, extra, opts).unwrap_or_default();
    String::from_utf8(text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::test_support::{fillers, two_rank_timeline};

    fn x_events(v: &Value) -> Vec<&Value> {
        v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect()
    }

    #[test]
    fn one_x_event_per_action_one_process_per_rank() {
        let t = two_rank_timeline();
        let text = chrome_trace_json(&t, &ChromeOptions::default());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["displayTimeUnit"], "ms");
        let xs = x_events(&v);
        assert_eq!(xs.len(), t.spans.len());
        let names: Vec<_> = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(names, vec![(0, "rank 0"), (1, "rank 1")]);
        // Rank 1's B0 runs [2, 4) cost units → ts 2000 µs, dur 2000 µs.
        let b0 = xs
            .iter()
            .find(|e| e["name"] == "1B0")
            .expect("1B0 is in the trace");
        assert_eq!(b0["cat"], "B");
        assert_eq!((b0["pid"].as_u64(), b0["tid"].as_u64()), (Some(1), Some(0)));
        assert_eq!(b0["ts"].as_f64(), Some(2000.0));
        assert_eq!(b0["dur"].as_f64(), Some(2000.0));
        let o = xs.iter().find(|e| e["cat"] == "OVERLAP_F_B").unwrap();
        assert_eq!(o["name"], "(0F2;0B1)OVERLAP_F_B");
        assert_eq!(o["args"]["backward_microbatch"], 1);
    }

    #[test]
    fn times_snap_to_whole_nanoseconds() {
        // Thirds of a unit: back-to-back spans stay back to back after scaling.
        let (ts0, dur0) = ts_dur(0.0, 1.0 / 3.0, 1000.0);
        let (ts1, _) = ts_dur(1.0 / 3.0, 2.0 / 3.0, 1000.0);
        assert_eq!(ts0, 0.0);
        assert_eq!(dur0, 333.333);
        assert_eq!(ts1, 333.333);
        assert!(ts0 + dur0 <= ts1);
    }

    #[test]
    fn events_of_a_lane_do_not_overlap() {
        let t = two_rank_timeline();
        let v = chrome_trace(
            &t,
            &ChromeOptions {
                us_per_unit: 1.0,
                bubbles: true,
                ..ChromeOptions::default()
            },
        );
        let mut xs: Vec<(u64, u64, f64, f64)> = x_events(&v)
            .iter()
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap(),
                    e["tid"].as_u64().unwrap(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                )
            })
            .collect();
        xs.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)).then(a.2.total_cmp(&b.2)));
        for pair in xs.windows(2) {
            if (pair[0].0, pair[0].1) == (pair[1].0, pair[1].1) {
                assert!(pair[0].2 + pair[0].3 <= pair[1].2 + 1e-9, "{pair:?}");
            }
        }
        // Bubble slots: rank 0 [2,3); rank 1 [0,1), [4,6).
        let bubbles: Vec<_> = xs.iter().filter(|e| e.1 == BUBBLE_LANE).collect();
        assert_eq!(bubbles.len(), t.slots.len());
        assert_eq!(bubbles.len(), 3);
    }

    #[test]
    fn extra_lanes_get_their_own_named_threads() {
        let t = two_rank_timeline();
        let text = chrome_trace_json_with(&t, &fillers(), &ChromeOptions::default());
        let v: Value = serde_json::from_str(&text).unwrap();
        let xs = x_events(&v);
        assert_eq!(xs.len(), t.spans.len() + fillers().len());
        let filler: Vec<_> = xs.iter().filter(|e| e["cat"] == "filler").collect();
        assert_eq!(filler.len(), 3);
        assert!(filler.iter().all(|e| e["tid"] == FIRST_EXTRA_LANE));
        assert_eq!(filler[1]["name"], "verify <12> & co");
        assert_eq!(filler[1]["pid"], 1);
        assert_eq!(filler[1]["ts"].as_f64(), Some(4000.0));
        // One thread_name per (rank, lane) used: rank 0 and rank 1 each have a filler lane.
        let names: Vec<_> = v["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "thread_name" && e["args"]["name"] == "filler")
            .map(|e| e["pid"].as_u64().unwrap())
            .collect();
        assert_eq!(names, vec![0, 1]);
    }

    #[test]
    fn the_written_trace_is_the_value_and_names_processes_as_asked() {
        let t = two_rank_timeline();
        let opts = ChromeOptions {
            bubbles: true,
            process_names: vec!["replica 0 · stage 0".into()],
            ..ChromeOptions::default()
        };
        let mut text = Vec::new();
        write_chrome_trace(&mut text, &t, &fillers(), &opts).unwrap();
        let written: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(written, chrome_trace_with(&t, &fillers(), &opts));
        let names: Vec<_> = written["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["replica 0 · stage 0", "rank 1"]);
    }
}
