//! The `--cost` specification: a cost model written on one command line.
//!
//! `--cost f=1,i=1,w=1,comm=0,mb=1,mw=0.5,speed=1` — comma-separated `key=value` pairs; a
//! key left out keeps its default (shown). Keys:
//! - `f`, `i`, `w`: time of a forward, an input-gradient backward and a weight-gradient
//!   backward (a full backward B costs `i + w`). One value applies to every stage; a
//!   `:`-separated list gives one value per stage (`f=1:1:1.5:1` for 4 stages) and must
//!   have as many entries as the plan has stages.
//! - `comm`: latency of one point-to-point transfer between two ranks.
//! - `mb`, `mw`: activation memory a forward holds until its I, and the part of it that
//!   stays held after I until W (so `mw ≤ mb`).
//! - `speed`: per-rank speed factor (one value, or a `:` list with one entry per rank);
//!   a rank with speed 2 runs every action in half the time.
//!
//! Parsing is separate from applying: the number of stages and ranks is only known once
//! the plan is, so [`CostSpec::model`] checks the lists' lengths against the plan.

use anyhow::{Result, anyhow, bail};
use pipefill_schedules::{CostModel, Plan, StageCost};

/// The keys `--cost` accepts, as listed in its errors.
const KEYS: &str = "f, i, w, comm, mb, mw, speed";

/// A parsed `--cost`; lists are per stage (`f`, `i`, `w`) or per rank (`speed`).
#[derive(Clone, Debug, PartialEq)]
pub struct CostSpec {
    pub f: Vec<f64>,
    pub i: Vec<f64>,
    pub w: Vec<f64>,
    pub comm: f64,
    pub m_b: f64,
    pub m_w: f64,
    pub speed: Vec<f64>,
}

impl Default for CostSpec {
    fn default() -> Self {
        CostSpec {
            f: vec![1.0],
            i: vec![1.0],
            w: vec![1.0],
            comm: 0.0,
            m_b: 1.0,
            m_w: 0.5,
            speed: vec![1.0],
        }
    }
}

impl CostSpec {
    /// Parses a `--cost` value (see the module docs); errors name the offending entry.
    pub fn parse(text: &str) -> Result<CostSpec> {
        let mut spec = CostSpec::default();
        let mut seen: Vec<&str> = Vec::new();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) = entry
                .split_once('=')
                .ok_or_else(|| anyhow!("--cost: `{entry}` is not key=value (keys: {KEYS})"))?;
            let (key, value) = (key.trim(), value.trim());
            let canonical = match key.to_ascii_lowercase().as_str() {
                "f" => "f",
                "i" => "i",
                "w" => "w",
                "comm" => "comm",
                "mb" | "m_b" => "mb",
                "mw" | "m_w" => "mw",
                "speed" => "speed",
                _ => bail!("--cost: unknown key `{key}` in `{entry}` (keys: {KEYS})"),
            };
            if seen.contains(&canonical) {
                bail!("--cost: `{canonical}` is given twice");
            }
            seen.push(canonical);
            let values = parse_list(key, value)?;
            let single = |values: Vec<f64>| -> Result<f64> {
                match values.as_slice() {
                    [v] => Ok(*v),
                    _ => Err(anyhow!(
                        "--cost: `{key}` takes one value, not a `:` list (`{entry}`)"
                    )),
                }
            };
            match canonical {
                "f" => spec.f = values,
                "i" => spec.i = values,
                "w" => spec.w = values,
                "comm" => spec.comm = single(values)?,
                "mb" => spec.m_b = single(values)?,
                "mw" => spec.m_w = single(values)?,
                _ => {
                    if values.iter().any(|&s| s <= 0.0) {
                        bail!("--cost: `{entry}`: a rank speed must be greater than 0");
                    }
                    spec.speed = values;
                }
            }
        }
        if spec.m_w > spec.m_b {
            bail!(
                "--cost: mw ({}) exceeds mb ({}): W cannot hold more than the forward stashed",
                spec.m_w,
                spec.m_b
            );
        }
        Ok(spec)
    }

    /// Refuses costs under which a plan of `stages` stages and `microbatches` micro-batches
    /// could reach a time past the largest `f64` (the simulator would see every action as
    /// never done): no simulated time exceeds every action's time at the slowest rank's
    /// speed plus every transfer's latency, added up, so that sum must be finite. The error
    /// names the key whose share of the sum is largest.
    pub fn check_overflow(&self, stages: usize, microbatches: usize) -> Result<()> {
        let (s, m) = (stages as f64, microbatches as f64);
        let slowest = self.speed.iter().copied().fold(f64::INFINITY, f64::min);
        let over_stages = |list: &[f64]| match list {
            [one] => one * s,
            many => many.iter().sum(),
        };
        let largest = |list: &[f64]| list.iter().copied().fold(0.0, f64::max);
        let terms = [
            ("f", over_stages(&self.f) * m / slowest, largest(&self.f)),
            ("i", over_stages(&self.i) * m / slowest, largest(&self.i)),
            ("w", over_stages(&self.w) * m / slowest, largest(&self.w)),
            ("comm", self.comm * 2.0 * s * m, self.comm),
        ];
        let total: f64 = terms.iter().map(|t| t.1).sum();
        if total.is_finite() {
            return Ok(());
        }
        let (key, _, value) = terms
            .iter()
            .copied()
            .fold(terms[0], |a, b| if b.1 > a.1 { b } else { a });
        bail!(
            "--cost {key}={}: the simulated makespan overflows: the costs of {stages} stages × \
             {microbatches} micro-batches add up past {:e}, the largest time there is; use \
             smaller costs",
            short(value),
            f64::MAX
        )
    }

    /// The cost model for `plan`, checking that per-stage and per-rank lists fit it and
    /// that its times cannot overflow ([`CostSpec::check_overflow`]).
    pub fn model(&self, plan: &Plan) -> Result<CostModel> {
        let stages = plan.stages;
        for (key, list) in [("f", &self.f), ("i", &self.i), ("w", &self.w)] {
            if list.len() > 1 && list.len() != stages {
                bail!(
                    "--cost: `{key}` has {} per-stage values but the plan has {stages} stages",
                    list.len()
                );
            }
        }
        let ranks = plan.num_ranks();
        if self.speed.len() > 1 && self.speed.len() != ranks {
            bail!(
                "--cost: `speed` has {} per-rank values but the plan has {ranks} ranks",
                self.speed.len()
            );
        }
        self.check_overflow(stages, plan.microbatches)?;
        let per_stage = [&self.f, &self.i, &self.w].iter().any(|l| l.len() > 1);
        let at = |list: &[f64], s: usize| if list.len() == 1 { list[0] } else { list[s] };
        let stage = (0..if per_stage { stages } else { 1 })
            .map(|s| StageCost {
                f: at(&self.f, s),
                i: at(&self.i, s),
                w: at(&self.w, s),
            })
            .collect();
        let rank_speed = if self.speed.len() == 1 {
            vec![self.speed[0]; ranks]
        } else {
            self.speed.clone()
        };
        Ok(CostModel {
            stage,
            comm: self.comm,
            rank_speed,
            m_b: self.m_b,
            m_w: self.m_w,
        })
    }

    /// The spec for one of `v` stages (chunks) a rank holds, when this spec describes a
    /// whole rank's share of the model: times and activation memory divided by `v`, so
    /// that schedules with different `v` model the same model on the same ranks. Per-stage
    /// lists already name each stage's cost and are kept as given.
    pub fn per_chunk(&self, v: usize) -> CostSpec {
        let single = [&self.f, &self.i, &self.w].iter().all(|l| l.len() == 1);
        if v <= 1 || !single {
            return self.clone();
        }
        let k = v as f64;
        CostSpec {
            f: vec![self.f[0] / k],
            i: vec![self.i[0] / k],
            w: vec![self.w[0] / k],
            m_b: self.m_b / k,
            m_w: self.m_w / k,
            ..self.clone()
        }
    }

    /// The spec with activation recomputation `r` on every stage
    /// ([`CostModel::recomputed`]): `i += rerun · f`, `mb ×= keep`.
    pub fn recomputed(&self, r: &pipefill_schedules::Recomputation) -> CostSpec {
        let f = |s: usize| self.f[s.min(self.f.len() - 1)];
        let stages = self.f.len().max(self.i.len());
        CostSpec {
            i: (0..stages)
                .map(|s| self.i[s.min(self.i.len() - 1)] + r.rerun * f(s))
                .collect(),
            m_b: self.m_b * r.keep,
            ..self.clone()
        }
    }

    /// The spec written back in `--cost` form (lists joined by `:`), for report headers.
    pub fn describe(&self) -> String {
        let list = |l: &[f64]| {
            l.iter()
                .map(|v| pipefill::profile::fmt_num(*v, 4))
                .collect::<Vec<_>>()
                .join(":")
        };
        let mut s = format!(
            "f={},i={},w={},comm={},mb={},mw={}",
            list(&self.f),
            list(&self.i),
            list(&self.w),
            list(&[self.comm]),
            list(&[self.m_b]),
            list(&[self.m_w])
        );
        if self.speed.iter().any(|&v| v != 1.0) {
            s.push_str(&format!(",speed={}", list(&self.speed)));
        }
        s
    }
}

/// A cost as an error shows it: in exponent form when large (`1e308`, not 309 digits).
fn short(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{v:e}")
    } else {
        pipefill::profile::fmt_num(v, 4)
    }
}

/// Parses `value` as one number or a `:`-separated list of finite, non-negative numbers.
fn parse_list(key: &str, value: &str) -> Result<Vec<f64>> {
    if value.is_empty() {
        bail!("--cost: `{key}` has no value");
    }
    value
        .split(':')
        .map(|v| {
            let v = v.trim();
            let x: f64 = v
                .parse()
                .map_err(|_| anyhow!("--cost: `{key}={value}`: `{v}` is not a number"))?;
            if !x.is_finite() || x < 0.0 {
                bail!("--cost: `{key}={value}`: `{v}` must be a finite number ≥ 0");
            }
            Ok(x)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipefill_schedules::Placement;

    fn plan(ranks: usize, stages: usize) -> Plan {
        Plan::new(ranks, stages, 4, Placement::Looped)
    }

    #[test]
    fn defaults_and_partial_overrides() {
        assert_eq!(CostSpec::parse("").unwrap(), CostSpec::default());
        let s = CostSpec::parse("w=0.5, comm=0.1,mb=2,mw=1").unwrap();
        assert_eq!((s.f.clone(), s.w.clone()), (vec![1.0], vec![0.5]));
        assert_eq!((s.comm, s.m_b, s.m_w), (0.1, 2.0, 1.0));
        let m = s.model(&plan(2, 4)).unwrap();
        assert_eq!(m.stage.len(), 1);
        assert_eq!(m.of(3).b(), 1.5);
        assert_eq!(m.rank_speed, vec![1.0, 1.0]);
    }

    #[test]
    fn per_stage_lists_broadcast_single_values() {
        let s = CostSpec::parse("f=1:1:1.5:1,i=2").unwrap();
        let m = s.model(&plan(2, 4)).unwrap();
        assert_eq!(m.stage.len(), 4);
        assert_eq!(m.of(2).f, 1.5);
        assert_eq!(m.of(2).i, 2.0);
        let err = s.model(&plan(4, 8)).unwrap_err().to_string();
        assert_eq!(
            err,
            "--cost: `f` has 4 per-stage values but the plan has 8 stages"
        );
        let s = CostSpec::parse("speed=1:0.5").unwrap();
        assert_eq!(s.model(&plan(2, 2)).unwrap().speed(1), 0.5);
        assert!(s.model(&plan(4, 4)).is_err());
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("f=abc", "`f=abc`: `abc` is not a number"),
            ("x=1", "unknown key `x`"),
            ("f1", "`f1` is not key=value"),
            ("w=-1", "must be a finite number ≥ 0"),
            ("comm=1:2", "`comm` takes one value"),
            ("f=1,f=2", "`f` is given twice"),
            ("mb=1,mw=2", "mw (2) exceeds mb (1)"),
            ("speed=0", "a rank speed must be greater than 0"),
            ("i=", "`i` has no value"),
            ("f=1::2", "`` is not a number"),
        ];
        for (text, expected) in cases {
            let err = CostSpec::parse(text).unwrap_err().to_string();
            assert!(err.starts_with("--cost: "), "{text}: {err}");
            assert!(err.contains(expected), "{text}: {err}");
            assert!(!err.contains('\n'), "{text}: {err}");
        }
    }

    #[test]
    fn costs_that_overflow_the_makespan_name_the_key() {
        let s = CostSpec::parse("f=1e308,i=1e308,w=1e308").unwrap();
        let err = s.model(&plan(4, 4)).unwrap_err().to_string();
        assert!(
            err.starts_with("--cost f=1e308: the simulated makespan overflows"),
            "{err}"
        );
        assert!(!err.contains('\n') && !err.contains("deadlock"), "{err}");
        let err = CostSpec::parse("comm=1e307")
            .unwrap()
            .model(&plan(4, 4))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--cost comm=1e307:"), "{err}");
        // The same large costs fit a plan small enough, and a slow rank counts.
        let one = CostSpec::parse("f=1e306,i=1e306,w=1e306").unwrap();
        assert!(one.model(&plan(1, 1)).is_ok());
        let slow = CostSpec::parse("f=1e306,i=1e306,w=1e306,speed=1e-10").unwrap();
        assert!(slow.check_overflow(1, 4).is_err());
        assert!(CostSpec::default().check_overflow(100_000, 100_000).is_ok());
    }

    #[test]
    fn per_chunk_splits_a_ranks_share() {
        let s = CostSpec::parse("f=2,i=2,w=1,comm=0.5,mb=2,mw=1").unwrap();
        let c = s.per_chunk(2);
        assert_eq!((c.f[0], c.i[0], c.w[0]), (1.0, 1.0, 0.5));
        assert_eq!((c.m_b, c.m_w, c.comm), (1.0, 0.5, 0.5));
        assert_eq!(s.per_chunk(1), s);
        let lists = CostSpec::parse("f=1:2:1:2").unwrap();
        assert_eq!(lists.per_chunk(2), lists);
    }

    #[test]
    fn describes_itself_in_cost_form() {
        let s = CostSpec::parse("f=1:2,comm=0.25").unwrap();
        assert_eq!(s.describe(), "f=1:2,i=1,w=1,comm=0.25,mb=1,mw=0.5");
        assert_eq!(CostSpec::parse(&s.describe()).unwrap(), s);
    }
}
