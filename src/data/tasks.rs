//! Synthetic reasoning tasks with verifiable answers.
//!
//! Each [`Task`] keeps together what later stages need: the prompt the model sees, a
//! worked (step-by-step) solution to learn from, the exact final answer, and the checker
//! that scores a completion by exact match of its final answer (the RL reward). Solutions
//! always end with `#` followed by the answer, so a completion's answer is whatever
//! follows its last `#`.
//!
//! The size of each task (digits, list length, ...) is drawn from a heavy-tailed law, so
//! most worked solutions are short and a few are much longer: the long tail that makes
//! pipeline bubbles appear in RL rollouts.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::DataError;
use super::rng::SplitMix64;

/// The marker that precedes the final answer in a worked solution or a completion.
pub const ANSWER_MARKER: char = '#';

/// The kinds of task. Every family's prompt starts with its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskFamily {
    /// Multi-digit addition, worked digit by digit from the right with carries.
    Addition,
    /// Sorting a list of numbers by repeatedly taking the minimum of what remains.
    Sorting,
    /// Counting the occurrences of one digit in a digit string, with a running count.
    Counting,
    /// The parity of a bit string, with a running parity.
    Parity,
}

impl TaskFamily {
    /// Every family, in a fixed order.
    pub const ALL: [TaskFamily; 4] = [
        TaskFamily::Addition,
        TaskFamily::Sorting,
        TaskFamily::Counting,
        TaskFamily::Parity,
    ];

    /// The family's name, as written in configs and at the start of its prompts.
    pub fn name(self) -> &'static str {
        match self {
            TaskFamily::Addition => "addition",
            TaskFamily::Sorting => "sorting",
            TaskFamily::Counting => "counting",
            TaskFamily::Parity => "parity",
        }
    }

    /// Builds a task of this family whose size parameter is `size` (≥ 1): number of
    /// digits, list length, string length.
    pub fn generate(self, size: u32, rng: &mut SplitMix64) -> Task {
        let size = size.max(1) as usize;
        match self {
            TaskFamily::Addition => addition(size, rng),
            TaskFamily::Sorting => sorting(size, rng),
            TaskFamily::Counting => counting(size, rng),
            TaskFamily::Parity => parity(size, rng),
        }
    }
}

impl fmt::Display for TaskFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TaskFamily {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskFamily::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| DataError::UnknownFamily(s.to_string()))
    }
}

/// One task: prompt, worked solution (ending in `#answer`), final answer, family and size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    pub family: TaskFamily,
    /// The size parameter the task was generated with.
    pub size: u32,
    /// What the model is given, ending in a newline.
    pub prompt: String,
    /// The worked solution: the steps, then `#` and the answer.
    pub solution: String,
    /// The exact final answer.
    pub answer: String,
}

impl Task {
    /// Whether `completion` (the text generated after the prompt) ends in the right answer:
    /// the text after its last `#`, up to the first newline, must equal the answer exactly.
    pub fn check(&self, completion: &str) -> bool {
        parse_answer(completion) == Some(self.answer.as_str())
    }

    /// The whole training text: prompt followed by worked solution.
    pub fn text(&self) -> String {
        let mut s = String::with_capacity(self.prompt.len() + self.solution.len());
        s.push_str(&self.prompt);
        s.push_str(&self.solution);
        s
    }
}

/// The final answer of a completion: what follows its last `#`, up to a newline.
/// `None` when there is no `#` at all.
pub fn parse_answer(completion: &str) -> Option<&str> {
    let at = completion.rfind(ANSWER_MARKER)?;
    let rest = &completion[at + ANSWER_MARKER.len_utf8()..];
    Some(rest.split('\n').next().unwrap_or(""))
}

fn digit(rng: &mut SplitMix64) -> u8 {
    rng.below(10) as u8
}

/// A number of exactly `n` digits, most significant first (no leading zero unless n = 1).
fn number(n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let mut d: Vec<u8> = (0..n).map(|_| digit(rng)).collect();
    if n > 1 && d[0] == 0 {
        d[0] = 1 + rng.below(9) as u8;
    }
    d
}

fn digits_to_string(d: &[u8]) -> String {
    d.iter().map(|&x| char::from(b'0' + x)).collect()
}

/// `add 347+85` → `7+5+0=12` / `4+8+1=13` / `3+0+1=4` / `#432`: one line per column,
/// right to left: the two digits, the incoming carry, and their sum.
fn addition(size: usize, rng: &mut SplitMix64) -> Task {
    let a = number(size, rng);
    let b = number(1 + rng.below(size as u64) as usize, rng);
    let (a, b) = if rng.below(2) == 0 { (a, b) } else { (b, a) };
    let prompt = format!("add {}+{}\n", digits_to_string(&a), digits_to_string(&b));
    let mut solution = String::new();
    let mut sum = Vec::new();
    let mut carry = 0u8;
    for i in 0..a.len().max(b.len()) {
        let da = if i < a.len() { a[a.len() - 1 - i] } else { 0 };
        let db = if i < b.len() { b[b.len() - 1 - i] } else { 0 };
        let s = da + db + carry;
        solution.push_str(&format!("{da}+{db}+{carry}={s}\n"));
        sum.push(s % 10);
        carry = s / 10;
    }
    if carry > 0 {
        sum.push(carry);
    }
    sum.reverse();
    let answer = digits_to_string(&sum);
    worked(TaskFamily::Addition, size, prompt, solution, answer)
}

/// A task of `family` whose worked `solution` ends in the answer line.
fn worked(
    family: TaskFamily,
    size: usize,
    prompt: String,
    mut solution: String,
    answer: String,
) -> Task {
    solution.push(ANSWER_MARKER);
    solution.push_str(&answer);
    Task {
        family,
        size: size as u32,
        prompt,
        solution,
        answer,
    }
}

fn join(xs: &[u32]) -> String {
    xs.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `sort 53,3,9` → `3|53,9` / `9|53` / `53|` / `#3,9,53`: each line takes the minimum of
/// what remains and writes what is left after it. Lists have `size + 1` items.
fn sorting(size: usize, rng: &mut SplitMix64) -> Task {
    let mut rest: Vec<u32> = (0..=size).map(|_| rng.below(100) as u32).collect();
    let prompt = format!("sort {}\n", join(&rest));
    let mut solution = String::new();
    let mut sorted = Vec::with_capacity(rest.len());
    while !rest.is_empty() {
        // The first occurrence of the minimum, so the steps are unique.
        let (at, &min) = rest
            .iter()
            .enumerate()
            .min_by_key(|&(i, &v)| (v, i))
            .expect("non-empty");
        rest.remove(at);
        sorted.push(min);
        solution.push_str(&format!("{min}|{}\n", join(&rest)));
    }
    let answer = join(&sorted);
    worked(TaskFamily::Sorting, size, prompt, solution, answer)
}

/// `count 3 in 1323` → `1:0 3:1 2:1 3:2` / `#2`: each digit with the running count.
/// Strings have `2 * size` digits.
fn counting(size: usize, rng: &mut SplitMix64) -> Task {
    let target = digit(rng);
    let s: Vec<u8> = (0..2 * size).map(|_| digit(rng)).collect();
    let prompt = format!("count {target} in {}\n", digits_to_string(&s));
    let mut steps = Vec::with_capacity(s.len());
    let mut count = 0usize;
    for &d in &s {
        count += usize::from(d == target);
        steps.push(format!("{d}:{count}"));
    }
    let answer = count.to_string();
    let solution = format!("{}\n", steps.join(" "));
    worked(TaskFamily::Counting, size, prompt, solution, answer)
}

/// `parity 1011` → `1:1 0:1 1:0 1:1` / `#1`: each bit with the running parity.
/// Strings have `2 * size` bits.
fn parity(size: usize, rng: &mut SplitMix64) -> Task {
    let bits: Vec<u8> = (0..2 * size).map(|_| rng.below(2) as u8).collect();
    let prompt = format!("parity {}\n", digits_to_string(&bits));
    let mut steps = Vec::with_capacity(bits.len());
    let mut p = 0u8;
    for &b in &bits {
        p ^= b;
        steps.push(format!("{b}:{p}"));
    }
    let answer = p.to_string();
    let solution = format!("{}\n", steps.join(" "));
    worked(TaskFamily::Parity, size, prompt, solution, answer)
}

/// A seeded stream of tasks: each draws its family uniformly from `families` and its size
/// from the heavy-tailed law of [`SplitMix64::heavy_tailed`].
#[derive(Debug, Clone)]
pub struct TaskGenerator {
    families: Vec<TaskFamily>,
    size_scale: f64,
    max_size: u32,
    rng: SplitMix64,
}

impl TaskGenerator {
    /// A generator over `families` (not empty) whose sizes have scale `size_scale` (> 0)
    /// and never exceed `max_size` (≥ 1).
    pub fn new(
        families: &[TaskFamily],
        size_scale: f64,
        max_size: u32,
        rng: SplitMix64,
    ) -> Result<Self, DataError> {
        if families.is_empty() {
            return Err(DataError::Invalid {
                field: "data.families",
                reason: "at least one task family is needed".into(),
            });
        }
        if !(size_scale.is_finite() && size_scale > 0.0) {
            return Err(DataError::Invalid {
                field: "data.size_scale",
                reason: format!("must be a positive number, got {size_scale}"),
            });
        }
        if max_size == 0 {
            return Err(DataError::Invalid {
                field: "data.max_size",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            families: families.to_vec(),
            size_scale,
            max_size,
            rng,
        })
    }

    /// The generator's random state (to store in a checkpoint).
    pub fn rng(&self) -> SplitMix64 {
        self.rng
    }

    /// The next task of the stream.
    pub fn next_task(&mut self) -> Task {
        let family = self.families[self.rng.below(self.families.len() as u64) as usize];
        let size = self.rng.heavy_tailed(self.size_scale, self.max_size);
        family.generate(size, &mut self.rng)
    }
}

impl Iterator for TaskGenerator {
    type Item = Task;

    fn next(&mut self) -> Option<Task> {
        Some(self.next_task())
    }
}
