//! The rollout driver: launches group steps into the stage pipeline, turns the last stage's
//! logits into tokens (plain sampling or speculative acceptance), regroups the sequences
//! into groups of equal shares as places in flight free up ([`super::groups`]), so that
//! the stages stay busy, and records the figures. With a [`MessageHook`], each
//! sequence's drafter-training row goes to the hook as soon as the sequence finishes, so
//! that the stages' idle time in the long tail can train on it while the rollout runs.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::groups::take_groups;
use super::pipe::{Done, MessageHook, Msg, WorkKind, run_inline};
use super::seq::{Seq, contexts, draft_row};
use super::{
    LivePoint, Request, RolloutConfig, RolloutOutput, RolloutStats, Speculation, StepRecord,
};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::drafter::{DraftChain, DraftTree, TreeShape};
use crate::model::infer::{Compaction, InferStage, Span, TreeStep};
use crate::rl::RlError;
use crate::rl::accept::{accept_greedy, accept_sampling, argmax, sample, softmax};
use crate::rl::bandit::KBandit;
use crate::rl::speculative::Proposer;
use crate::rl::tree::{accept_tree_greedy, accept_tree_sampling};
use crate::tensor::Backend;

/// Fraction of the batch still live when the long tail starts.
const TAIL_FRACTION: f64 = 0.25;

struct InFlight {
    members: Vec<usize>,
    spans: Vec<Span>,
    /// The drafts being verified.
    drafts: Option<Vec<DraftChain>>,
    /// The draft trees being verified (instead of `drafts`).
    trees: Option<Vec<DraftTree>>,
    /// The bandit's choice id (a verification, or a plain step its K = 0 arm chose).
    choice: Option<usize>,
    /// Driver time spent drafting for this step.
    drafting: Duration,
    /// When it left the driver (drafting done), the live batch then, its kind and the
    /// groups in flight with it (for its [`StepRecord`]).
    launched: Instant,
    live: usize,
    kind: WorkKind,
    in_flight: usize,
}

pub(super) struct Driver<'a> {
    config: &'a RolloutConfig,
    d: usize,
    vocab: usize,
    /// The model's positions: the most rows a sequence's cache holds.
    seq_len: usize,
    seqs: Vec<Seq>,
    bandit: Option<KBandit>,
    draft_rng: SplitMix64,
    stats: RolloutStats,
    curve: Vec<LivePoint>,
    start: Instant,
    hook: Option<Arc<dyn MessageHook>>,
    /// Fewest positions a group step should carry (see [`super::MIN_GROUP_ROWS`]).
    min_rows: usize,
    /// Most groups in flight for plain decode steps ([`Driver::with_plain_groups`]).
    plain_groups: usize,
    /// Positions per sequence of the last decode or verification step launched: what the
    /// next steps will likely carry (1 for plain decoding, K+1 for a verification).
    rows_per_seq: f64,
    steps: Vec<StepRecord>,
    /// Compute time per stage of the steps run on this thread ([`run_inline`]).
    inline_busy: Vec<Duration>,
}

impl<'a> Driver<'a> {
    pub(super) fn new(
        requests: &[Request],
        config: &'a RolloutConfig,
        d: usize,
        vocab: usize,
        seq_len: usize,
        bandit: Option<KBandit>,
        min_rows: usize,
    ) -> Self {
        let seqs = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Seq {
                tokens: r.prompt.clone(),
                prompt: r.prompt.len(),
                cap: (r.prompt.len() + r.max_new).min(seq_len),
                done: r.max_new == 0,
                hidden: Vec::new(),
                rng: SplitMix64::derive(config.seed, i as u64),
                compact: None,
            })
            .collect();
        Driver {
            config,
            d,
            vocab,
            seq_len,
            seqs,
            bandit,
            draft_rng: SplitMix64::derive(config.seed, u64::MAX),
            stats: RolloutStats::default(),
            curve: Vec::new(),
            start: Instant::now(),
            hook: None,
            min_rows,
            plain_groups: config.groups,
            // Until a step is launched, the mode's: the first steps after the prefill are
            // grouped as the rest will be.
            rows_per_seq: match &config.speculation {
                Speculation::Fixed { k } => (k + 1) as f64,
                Speculation::Tree(shape) => (shape.nodes + 1) as f64,
                Speculation::Off | Speculation::Adaptive(_) => 1.0,
            },
            steps: Vec::new(),
            inline_busy: Vec::new(),
        }
    }

    /// Keeps at most `groups` groups in flight while steps decode plainly (at most the
    /// config's; verifications keep the config's).
    pub(super) fn with_plain_groups(mut self, groups: usize) -> Self {
        self.plain_groups = groups.clamp(1, self.config.groups.max(1));
        self
    }

    /// Hands each finished sequence's drafter row to `hook` (when rows are recorded).
    pub(super) fn with_hook(mut self, hook: Option<Arc<dyn MessageHook>>) -> Self {
        self.hook = hook;
        self
    }

    fn live(&self) -> usize {
        self.seqs.iter().filter(|s| !s.done).count()
    }

    /// Generates until every sequence is done: steps go to the stage threads through
    /// `first` and come back on `results`; with `inline`, a step that would be the only
    /// group in flight runs through those stages on this thread instead.
    pub(super) fn run<B: Backend>(
        &mut self,
        first: &Sender<Msg<B>>,
        results: &Receiver<Result<Done, ModelError>>,
        inline: Option<&[Mutex<&mut InferStage<B>>]>,
        mut proposer: Option<&mut dyn Proposer>,
    ) -> Result<(), RlError> {
        self.start = Instant::now();
        self.inline_busy = vec![Duration::ZERO; inline.map_or(0, <[_]>::len)];
        let live: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| !self.seqs[i].done)
            .collect();
        let groups = self.groups_for(live.len());
        // Sequences waiting for a step, in the order they launch: at first the groups
        // strided over the batch, one after another.
        let mut waiting: VecDeque<usize> = (0..groups)
            .flat_map(|g| live.iter().copied().skip(g).step_by(groups))
            .collect();
        let mut in_flight: HashMap<usize, InFlight> = HashMap::new();
        let mut next_id = 0;
        self.point();
        loop {
            let live = self.live();
            let groups = self.groups_for(live);
            let slots = groups.saturating_sub(in_flight.len());
            let launches = take_groups(&mut waiting, slots, live.div_ceil(groups));
            let alone = in_flight.is_empty() && waiting.is_empty() && launches.len() == 1;
            // The result of a step run on this thread.
            let mut lone = None;
            for members in launches {
                let (mut f, msg) = self.launch(next_id, members, proposer.as_deref_mut())?;
                f.in_flight = in_flight.len() + 1;
                match inline {
                    // Nothing to overlap it with: the stages would run it one after another.
                    Some(stages) if alone => {
                        lone = Some(run_inline(stages, msg, &mut self.inline_busy)?);
                    }
                    _ => first.send(msg).map_err(|_| RlError::Stopped)?,
                }
                in_flight.insert(next_id, f);
                next_id += 1;
            }
            if in_flight.is_empty() {
                return Ok(());
            }
            let done = match lone {
                Some(done) => done,
                None => results.recv().map_err(|_| RlError::Stopped)??,
            };
            let f = in_flight.remove(&done.group).ok_or(RlError::Stopped)?;
            let clock = Instant::now();
            let tokens = self.stats.tokens;
            let (alive, finished) = self.absorb(&f, &done);
            self.steps.push(StepRecord {
                t: self.start.elapsed().as_secs_f64(),
                live: f.live,
                sequences: f.members.len(),
                context: f.spans.iter().map(|s| s.start).sum::<usize>() / f.spans.len().max(1),
                kind: f.kind,
                emitted: self.stats.tokens - tokens,
                in_flight: f.in_flight,
                drafting_s: f.drafting.as_secs_f64(),
                compute_s: done.spent.as_secs_f64(),
                latency_s: (clock - f.launched).as_secs_f64(),
            });
            self.stats.absorb_s += clock.elapsed().as_secs_f64();
            self.point();
            if !finished.is_empty() {
                first
                    .send(Msg::Release(finished))
                    .map_err(|_| RlError::Stopped)?;
            }
            // The next launch regroups them with any already waiting.
            waiting.extend(alive);
        }
    }

    /// Groups to keep in flight while `live` sequences are live: at most the config's (at
    /// most `plain_groups` while steps decode plainly), and none whose step would carry
    /// fewer than `min_rows` positions (but at least one).
    fn groups_for(&self, live: usize) -> usize {
        let most = match self.rows_per_seq > 1.0 {
            true => self.config.groups,
            false => self.plain_groups,
        };
        super::groups_in_flight(live, self.rows_per_seq, most, self.min_rows)
    }

    fn point(&mut self) {
        self.curve.push(LivePoint {
            t: self.start.elapsed().as_secs_f64(),
            live: self.live(),
            tokens: self.stats.tokens,
        });
    }

    /// One step of `members` (prefill, decode or, speculation on, verification): what the
    /// driver keeps of it, and the message that runs it.
    fn launch<'p, B: Backend>(
        &mut self,
        group: usize,
        members: Vec<usize>,
        proposer: Option<&mut (dyn Proposer + 'p)>,
    ) -> Result<(InFlight, Msg<B>), RlError> {
        let mut drafting = Duration::ZERO;
        let prefill = members.iter().all(|&i| self.seqs[i].hidden.is_empty());
        let live = self.live();
        let (k, choice, shape) = match (&self.config.speculation, prefill) {
            (_, true) | (Speculation::Off, _) => (0, None, None),
            (Speculation::Fixed { k }, _) => (*k, None, None),
            (Speculation::Tree(shape), _) => (shape.depth, None, Some(*shape)),
            (Speculation::Adaptive(a), _) if live > a.threshold => (0, None, None),
            (Speculation::Adaptive(a), _) => {
                let bandit = self
                    .bandit
                    .as_mut()
                    .expect("adaptive speculation has a bandit");
                let (k, id) = bandit.choose(live);
                let shape = a.tree.map(|s| TreeShape { depth: k, ..s });
                (k, Some(id), shape)
            }
        };
        let mut trees = None;
        let drafts = match (k, proposer) {
            (0, _) | (_, None) => None,
            (_, Some(p)) if let Some(shape) = shape => {
                let clock = Instant::now();
                let t = self.config.temperature;
                let contexts = contexts(&self.seqs, &members, self.d);
                let got = p.propose_tree(&contexts, &shape, t, &mut self.draft_rng)?;
                drafting = clock.elapsed();
                self.stats.propose_s += drafting.as_secs_f64();
                trees = Some(self.fit_trees(&members, got, &shape)?);
                None
            }
            (k, Some(p)) => {
                let contexts = contexts(&self.seqs, &members, self.d);
                let t = self.config.temperature;
                let clock = Instant::now();
                let chains = p.propose(&contexts, k, t, &mut self.draft_rng)?;
                drafting = clock.elapsed();
                self.stats.propose_s += drafting.as_secs_f64();
                if chains.len() != members.len() || chains.iter().any(|c| c.tokens.len() != k) {
                    return Err(RlError::proposer(format!(
                        "asked {k} tokens for {} sequences",
                        members.len()
                    )));
                }
                Some(chains)
            }
        };
        let (mut spans, mut ids) = (Vec::with_capacity(members.len()), Vec::new());
        let mut step = TreeStep::default();
        for (m, &i) in members.iter().enumerate() {
            step.compact.extend(self.seqs[i].compact.take());
            let s = &self.seqs[i];
            if prefill {
                spans.push(Span {
                    slot: i,
                    start: 0,
                    len: s.tokens.len(),
                });
                ids.extend_from_slice(&s.tokens);
                continue;
            }
            let len = s.tokens.len();
            if let Some(trees) = &trees {
                let tree = &trees[m];
                spans.push(Span {
                    slot: i,
                    start: len - 1,
                    len: 1 + tree.len(),
                });
                ids.push(s.tokens[len - 1]);
                ids.extend_from_slice(&tree.tokens);
                step.parents.push(Some(tree.row_parents()));
                continue;
            }
            // Never draft past the cap: the verified positions must fit the model.
            let ki = drafts
                .as_ref()
                .map_or(0, |c| c[m].tokens.len().min(s.cap - len));
            spans.push(Span {
                slot: i,
                start: len - 1,
                len: 1 + ki,
            });
            ids.push(s.tokens[len - 1]);
            if let Some(chains) = &drafts {
                ids.extend_from_slice(&chains[m].tokens[..ki]);
            }
        }
        if !prefill {
            // A chain's K+1 even where a sequence near its cap drafts fewer: the groups'
            // count and sizes follow the mode's rows, not which sequences end next.
            self.rows_per_seq = match drafts {
                Some(_) => (k + 1) as f64,
                None => {
                    let rows: usize = spans.iter().map(|s| s.len).sum();
                    rows as f64 / members.len() as f64
                }
            };
        }
        let kind = match (prefill, drafts.is_some() || trees.is_some()) {
            (true, _) => WorkKind::Prefill,
            (false, false) => WorkKind::Decode,
            (false, true) => WorkKind::Verify { k },
        };
        let tree = (!step.parents.is_empty() || !step.compact.is_empty()).then_some(step);
        tracing::trace!(group, ?kind, sequences = members.len(), "rollout step");
        let msg = Msg::Work {
            group,
            kind,
            spans: spans.clone(),
            ids,
            hidden: None,
            tree,
            spent: Duration::ZERO,
        };
        let f = InFlight {
            members,
            spans,
            drafts,
            trees,
            choice,
            drafting,
            launched: Instant::now(),
            live,
            kind,
            in_flight: 1,
        };
        Ok((f, msg))
    }

    /// Checks the proposer's trees and prunes each to what its sequence has room for: no
    /// node deeper than the positions left, no more rows than the cache holds.
    fn fit_trees(
        &self,
        members: &[usize],
        trees: Vec<DraftTree>,
        shape: &TreeShape,
    ) -> Result<Vec<DraftTree>, RlError> {
        let bad = |reason: String| RlError::proposer(reason);
        if trees.len() != members.len() {
            return Err(bad(format!(
                "{} trees for {} sequences",
                trees.len(),
                members.len()
            )));
        }
        members
            .iter()
            .zip(trees)
            .map(|(&i, tree)| {
                let depth = tree.depths().into_iter().max().unwrap_or(0);
                let problem = tree.check(self.vocab).or_else(|| {
                    (tree.len() > shape.nodes || depth > shape.depth).then(|| {
                        format!(
                            "a tree of {} nodes, {depth} deep, beyond the shape {shape:?}",
                            tree.len()
                        )
                    })
                });
                if let Some(reason) = problem {
                    return Err(bad(reason));
                }
                // Depth is bounded by the tokens the sequence may still emit, the node
                // count only by the cache's rows: pruning near the cap by count would cut
                // the deep greedy chain and keep the shallow side branches.
                let len = self.seqs[i].tokens.len();
                Ok(tree.pruned(self.seq_len - len, self.seqs[i].cap - len))
            })
            .collect()
    }

    /// Applies a group's results; returns its still-live and its finished sequences.
    fn absorb(&mut self, f: &InFlight, done: &Done) -> (Vec<usize>, Vec<usize>) {
        let (d, v, t) = (self.d, self.vocab, self.config.temperature);
        let (mut alive, mut finished) = (Vec::new(), Vec::new());
        let mut r0 = 0;
        let mut emitted_total = 0;
        for (m, (&i, span)) in f.members.iter().zip(&f.spans).enumerate() {
            let logits = &done.logits[r0 * v..(r0 + span.len) * v];
            let hidden = &done.hidden[r0 * d..(r0 + span.len) * d];
            r0 += span.len;
            let row = |j: usize| &logits[j * v..(j + 1) * v];
            let seq = &mut self.seqs[i];
            // Verification rows whose positions the sequence keeps; `None`: the first `kept`.
            let mut tree_rows = None;
            let (kept, emitted) = match (&f.drafts, &f.trees) {
                (_, Some(trees)) if span.len > 1 => {
                    let tree = &trees[m];
                    let verdict = if t == 0.0 {
                        let rows: Vec<&[f32]> = (0..span.len).map(row).collect();
                        accept_tree_greedy(tree, &rows)
                    } else {
                        let p: Vec<Vec<f32>> = (0..span.len).map(|j| softmax(row(j), t)).collect();
                        let p: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
                        accept_tree_sampling(tree, &p, &mut seq.rng)
                    };
                    self.stats.verifications += 1;
                    self.stats.drafted += tree.len();
                    self.stats.accepted += verdict.path.len();
                    let keep = verdict.kept_rows();
                    // Rows 0..n kept in place need no compaction: the next span's start
                    // rolls the rest back, as for a chain.
                    if keep.iter().enumerate().any(|(j, &r)| j != r) {
                        seq.compact = Some(Compaction {
                            slot: i,
                            start: span.start,
                            keep: keep.clone(),
                        });
                    }
                    let n = keep.len();
                    tree_rows = Some(keep);
                    (n, verdict.tokens)
                }
                (Some(chains), _) if span.len > 1 => {
                    let k = span.len - 1;
                    let draft = &chains[m].tokens[..k];
                    let verdict = if t == 0.0 {
                        let rows: Vec<&[f32]> = (0..=k).map(row).collect();
                        accept_greedy(draft, &rows)
                    } else {
                        let p: Vec<Vec<f32>> = (0..=k).map(|j| softmax(row(j), t)).collect();
                        let p: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
                        let q: Vec<&[f32]> = (0..k)
                            .map(|j| &chains[m].probs[j * v..(j + 1) * v])
                            .collect();
                        accept_sampling(draft, &p, &q, &mut seq.rng)
                    };
                    self.stats.verifications += 1;
                    self.stats.drafted += k;
                    self.stats.accepted += verdict.accepted;
                    (verdict.accepted + 1, verdict.tokens)
                }
                _ => {
                    let last = row(span.len - 1);
                    let token = if t == 0.0 {
                        argmax(last)
                    } else {
                        sample(&softmax(last, t), &mut seq.rng)
                    };
                    (span.len, vec![token])
                }
            };
            // Hidden states of the positions the target has now really seen.
            let kept_rows = tree_rows.unwrap_or_else(|| (0..kept).collect());
            seq.hidden.truncate(span.start * d);
            for &j in &kept_rows {
                seq.hidden.extend_from_slice(&hidden[j * d..(j + 1) * d]);
            }
            let grown = seq.tokens.len();
            for tok in emitted {
                seq.tokens.push(tok);
                emitted_total += 1;
                if tok == self.config.eos || seq.tokens.len() >= seq.cap {
                    seq.done = true;
                    break;
                }
            }
            if let Some(h) = &self.hook {
                h.tokens(i, &seq.tokens[grown..]);
            }
            if seq.done {
                if let (Some(h), true) = (&self.hook, self.config.record_rows)
                    && let Some(row) = draft_row(seq, d, self.config.step)
                {
                    h.row(&row);
                }
                finished.push(i);
            } else {
                alive.push(i);
            }
        }
        self.stats.tokens += emitted_total;
        self.stats.steps += 1;
        if let (Some(id), Some(b)) = (f.choice, self.bandit.as_mut()) {
            // The step's own cost (drafting and every stage's compute), not its latency:
            // with several groups in flight, a step's latency is mostly the other groups'
            // work queued ahead of it, which would favour long drafts in every bucket.
            let per_seq = emitted_total as f64 / f.members.len() as f64;
            let cost = f.drafting + done.spent;
            b.reward(id, per_seq, f.members.len(), cost.as_secs_f64());
        }
        (alive, finished)
    }

    pub(super) fn finish(self, stage_busy_s: Vec<f64>) -> (RolloutOutput, Option<KBandit>) {
        let mut bandit = self.bandit;
        let mut stats = self.stats;
        stats.seconds = self.start.elapsed().as_secs_f64();
        stats.stage_busy_s = stage_busy_s;
        for (busy, inline) in stats.stage_busy_s.iter_mut().zip(&self.inline_busy) {
            *busy += inline.as_secs_f64();
        }
        let n = self.seqs.len();
        let tail_live = ((n as f64 * TAIL_FRACTION).floor() as usize).max(1);
        let tail = self.curve.iter().find(|p| p.live <= tail_live);
        if let Some(p) = tail {
            stats.tail_start_s = p.t;
            stats.tail_tokens = stats.tokens - p.tokens;
        }
        let d = self.d;
        let record = self.config.record_rows;
        let step = self.config.step;
        let mut rows = Vec::new();
        let mut sequences = Vec::with_capacity(n);
        let mut prompt_lens = Vec::with_capacity(n);
        for s in self.seqs {
            if record {
                rows.extend(draft_row(&s, d, step));
            }
            prompt_lens.push(s.prompt);
            sequences.push(s.tokens);
        }
        let rollout = RolloutOutput {
            sequences,
            prompt_lens,
            rows,
            stats,
            live_curve: self.curve,
            steps: self.steps,
            choices: bandit.as_mut().map(KBandit::take_log).unwrap_or_default(),
        };
        (rollout, bandit)
    }
}
