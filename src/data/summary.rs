//! The dataset summary printed before training: how many tasks of each family, and how
//! long their worked solutions are (mean, median, p90, p99, max and a log-scale text
//! histogram), so the long tail is visible at a glance.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::error::DataError;
use super::rng::SplitMix64;
use super::tasks::{Task, TaskFamily, TaskGenerator};

/// The sub-stream of the seed used for the summary sample (disjoint from every step's).
const SUMMARY_STREAM: u64 = u64::MAX;
/// Width in characters of the longest histogram bar.
const BAR_WIDTH: usize = 40;

/// Statistics of a sample of tasks. Lengths are in tokens (= characters: the tokenizer is
/// character-level) of the worked solution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetSummary {
    pub tasks: usize,
    pub per_family: BTreeMap<TaskFamily, usize>,
    pub mean: f64,
    pub median: usize,
    pub p90: usize,
    pub p99: usize,
    pub max: usize,
    /// `(low, high, count)`: solutions of length in `[low, high]`, doubling buckets.
    pub histogram: Vec<(usize, usize, usize)>,
}

impl DatasetSummary {
    /// The summary of the data `data` trains on: for the synthetic tasks,
    /// `data.summary_tasks` tasks drawn like its stream (from a sub-stream of its seed no
    /// step uses); for a `jsonl` source, its documents (lengths in tokens of whole
    /// documents, no families).
    pub fn of(data: &super::batch::StepData) -> Result<Self, DataError> {
        if let Some(docs) = data.documents() {
            return Ok(Self::from_lengths(
                docs.lengths().collect(),
                BTreeMap::new(),
            ));
        }
        let config = data.config();
        let tasks: Vec<Task> = TaskGenerator::new(
            &config.families,
            config.size_scale,
            config.max_size,
            SplitMix64::derive(data.seed(), SUMMARY_STREAM),
        )?
        .take(config.summary_tasks)
        .collect();
        Ok(Self::from_tasks(&tasks))
    }

    /// The summary of `tasks` (an empty sample gives zeros and no histogram).
    pub fn from_tasks(tasks: &[Task]) -> Self {
        let mut per_family = BTreeMap::new();
        let mut lengths: Vec<usize> = Vec::with_capacity(tasks.len());
        for t in tasks {
            *per_family.entry(t.family).or_insert(0) += 1;
            lengths.push(t.solution.chars().count());
        }
        Self::from_lengths(lengths, per_family)
    }

    fn from_lengths(mut lengths: Vec<usize>, per_family: BTreeMap<TaskFamily, usize>) -> Self {
        lengths.sort_unstable();
        let n = lengths.len();
        let mean = if n == 0 {
            0.0
        } else {
            lengths.iter().sum::<usize>() as f64 / n as f64
        };
        Self {
            tasks: n,
            per_family,
            mean,
            median: percentile(&lengths, 50.0),
            p90: percentile(&lengths, 90.0),
            p99: percentile(&lengths, 99.0),
            max: lengths.last().copied().unwrap_or(0),
            histogram: histogram(&lengths),
        }
    }
}

/// Nearest-rank percentile of sorted `xs` (0 when empty).
fn percentile(xs: &[usize], p: f64) -> usize {
    if xs.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * xs.len() as f64).ceil() as usize;
    xs[rank.clamp(1, xs.len()) - 1]
}

/// Doubling buckets `[2^i, 2^(i+1) - 1]` from the one holding the shortest length to the
/// one holding the longest; a long tail shows as a run of thin bars to the bottom.
fn histogram(sorted: &[usize]) -> Vec<(usize, usize, usize)> {
    let (Some(&lo), Some(&hi)) = (sorted.first(), sorted.last()) else {
        return Vec::new();
    };
    let bucket = |x: usize| (usize::BITS - x.max(1).leading_zeros() - 1) as usize;
    let mut out: Vec<(usize, usize, usize)> = (bucket(lo)..=bucket(hi))
        .map(|b| (1usize << b, (1usize << (b + 1)) - 1, 0))
        .collect();
    let first = bucket(lo);
    for &x in sorted {
        out[bucket(x) - first].2 += 1;
    }
    out
}

impl fmt::Display for DatasetSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let families: Vec<String> = self
            .per_family
            .iter()
            .map(|(fam, n)| format!("{fam} {n}"))
            .collect();
        let what = if self.per_family.is_empty() {
            // A file's documents (no task families).
            let tokens = (self.mean * self.tasks as f64).round();
            writeln!(f, "dataset: {} documents, {tokens} tokens", self.tasks)?;
            "document"
        } else {
            writeln!(f, "dataset: {} tasks ({})", self.tasks, families.join(", "))?;
            "solution"
        };
        writeln!(
            f,
            "{what} length (tokens): mean {:.1}, median {}, p90 {}, p99 {}, max {}",
            self.mean, self.median, self.p90, self.p99, self.max
        )?;
        let top = self.histogram.iter().map(|b| b.2).max().unwrap_or(0).max(1);
        let width = self
            .histogram
            .last()
            .map(|b| b.1.to_string().len())
            .unwrap_or(1);
        for &(lo, hi, count) in &self.histogram {
            // Any non-empty bucket gets at least one mark, so the tail stays visible.
            let bar = if count == 0 {
                0
            } else {
                (count * BAR_WIDTH).div_ceil(top)
            };
            let share = 100.0 * count as f64 / self.tasks.max(1) as f64;
            writeln!(
                f,
                "  {lo:>width$}-{hi:<width$} |{:<BAR_WIDTH$}| {count} ({share:.1}%)",
                "#".repeat(bar)
            )?;
        }
        Ok(())
    }
}
