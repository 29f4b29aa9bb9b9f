//! The rollout engine's long tail, narrowly: the `bench rollout` engine setup (a `d_model`
//! 512, 8-layer target cut into 4 stages, 4 groups in flight, 128 requests with
//! heavy-tailed caps) without its minutes of target and drafter training, so that the
//! tail can be measured again and again.
//!
//! The target is untrained (its weights cost the same to read as a trained one's); every
//! request runs to its heavy-tailed cap, so the live batch shrinks into a long tail as in
//! `bench rollout`. Speculation uses a [`Replay`] proposer: it pays a real (untrained)
//! drafter's proposal on the driver thread, then proposes the target's own greedy
//! continuation with each token kept with probability [`AGREE`] (a fixed hash, the same in
//! every run), which gives an acceptance length near the trained drafter's (3.0–3.4 at
//! K = 4). Outputs stay lossless, and are checked against the plain run.
//!
//! Modes: plain decoding, a fixed K = 4, adaptive speculation below 4 and 16 live, each with
//! the engine's groups carrying at least `r` rows (`RolloutEngine::with_min_group_rows`;
//! `TAIL_ROWS`, comma-separated, default 1 and [`MIN_GROUP_ROWS`]; r1 splits the live batch
//! down to single sequences, as the engine did before it merged groups). Per mode it prints
//! medians over `TAIL_REPS` runs (default 5, the modes alternating run by run): the whole
//! run, the long tail (from the moment a quarter of the batch is live), driver time
//! (proposing, absorbing), each stage's busy time, and the tail per live-batch bucket:
//! time between group results, tokens/s and group steps. `TAIL_MODES` (comma-separated
//! names, default all) picks modes.
//!
//! `cargo bench -p pipefill --bench tail`

use std::collections::BTreeMap;

use pipefill::config::JobConfig;
use pipefill::data::SplitMix64;
use pipefill::model::drafter::{DraftChain, DraftContext, Drafter};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt};
use pipefill::rl::RlError;
use pipefill::rl::rollout::{
    AdaptiveConfig, MIN_GROUP_ROWS, Request, RolloutConfig, RolloutEngine, RolloutOutput,
    Speculation,
};
use pipefill::rl::speculative::Proposer;
use pipefill::tensor::CpuBackend;

#[allow(dead_code)] // the timing helpers are for criterion benches
mod common;

/// Probability that a replayed draft token is the target's own.
const AGREE: f64 = 0.78;
const REQUESTS: usize = 128;
const STAGES: usize = 4;

/// A real drafter's proposal cost, with the target's own continuation as the draft
/// (each token right with probability [`AGREE`]).
struct Replay {
    drafter: Drafter<CpuBackend>,
    known: Vec<Vec<u32>>,
    vocab: usize,
}

impl Proposer for Replay {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        // The real drafter's proposal, for its cost; its tokens are then replaced.
        let mut chains = Proposer::propose(&mut self.drafter, contexts, k, temperature, rng)?;
        for (c, chain) in contexts.iter().zip(&mut chains) {
            let n = c.tokens.len();
            let seq = self
                .known
                .iter()
                .find(|s| s.len() > n && s[1..=n] == *c.tokens);
            for j in 0..k {
                let right = seq.and_then(|s| s.get(n + 1 + j).copied()).unwrap_or(0);
                let mut h = SplitMix64::derive(n as u64 * 131 + j as u64, right as u64);
                let t = if h.next_f64() < AGREE {
                    right
                } else {
                    (right + 1) % self.vocab as u32
                };
                chain.tokens[j] = t;
                chain.probs[j * self.vocab..(j + 1) * self.vocab].fill(0.0);
                chain.probs[j * self.vocab + t as usize] = 1.0;
            }
        }
        Ok(chains)
    }
}

fn requests(seq_len: usize, vocab: usize) -> Vec<Request> {
    let mut rng = SplitMix64::new(0x7a11);
    (0..REQUESTS)
        .map(|_| {
            let plen = 6 + (rng.next_u64() % 12) as usize;
            let prompt: Vec<u32> = (0..plen)
                .map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32)
                .collect();
            let room = seq_len - plen;
            let cap = 2 + rng.heavy_tailed(8.0, room as u32) as usize;
            Request {
                prompt,
                max_new: cap.min(room),
            }
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Per live-batch size in the tail: (seconds, tokens, group steps).
fn breakdown(r: &RolloutOutput, tail_live: usize) -> BTreeMap<usize, (f64, usize, usize)> {
    let mut out: BTreeMap<usize, (f64, usize, usize)> = BTreeMap::new();
    for w in r.live_curve.windows(2) {
        if w[0].live == 0 || w[0].live > tail_live {
            continue;
        }
        let e = out.entry(w[0].live).or_default();
        e.0 += w[1].t - w[0].t;
        e.1 += w[1].tokens - w[0].tokens;
        e.2 += 1;
    }
    out
}

fn main() {
    let reps: usize = std::env::var("TAIL_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let only: Option<Vec<String>> = std::env::var("TAIL_MODES")
        .ok()
        .map(|s| s.split(',').map(str::to_string).collect());
    // `bench rollout`'s job: `d_model` 512, proposals over the last 8 target pairs.
    let cfg = common::model_config(512);
    let mut drafter_cfg = JobConfig::default().drafter;
    drafter_cfg.window = 8;
    let be = CpuBackend::new(1).expect("a one-thread backend");
    let gpt = Gpt::new(&cfg, be.clone(), &Cut::Even(1)).expect("the target");
    let engine = |min_rows| {
        let stages = InferStage::stages_of(&gpt, &Cut::Even(STAGES)).expect("the stages");
        RolloutEngine::new(stages)
            .expect("the engine")
            .with_min_group_rows(min_rows)
    };
    let reqs = requests(cfg.seq_len, cfg.vocab);
    let run_cfg = |speculation| RolloutConfig {
        groups: STAGES,
        speculation,
        ..RolloutConfig::default()
    };
    let reference = engine(1)
        .run(&reqs, &run_cfg(Speculation::Off), None)
        .expect("the plain run");
    let mut replay = Replay {
        drafter: Drafter::new(&cfg, &drafter_cfg, be).expect("the drafter"),
        known: reference.sequences.clone(),
        vocab: cfg.vocab,
    };
    let adaptive = |threshold| {
        Speculation::Adaptive(AdaptiveConfig {
            threshold,
            ..AdaptiveConfig::default()
        })
    };
    // (name, speculation, fewest rows per group step); r1 splits as far as `groups` allows.
    let mut modes: Vec<(String, Speculation, usize)> = Vec::new();
    let rows: Vec<usize> = std::env::var("TAIL_ROWS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, MIN_GROUP_ROWS]);
    for &r in &rows {
        modes.push((format!("plain r{r}"), Speculation::Off, r));
        modes.push((format!("fixed4 r{r}"), Speculation::Fixed { k: 4 }, r));
        modes.push((format!("adapt4 r{r}"), adaptive(4), r));
        modes.push((format!("adapt16 r{r}"), adaptive(16), r));
    }
    modes.retain(|(n, _, _)| only.as_ref().is_none_or(|o| o.iter().any(|x| x == n)));
    let mut engines: Vec<_> = modes.iter().map(|(_, _, m)| engine(*m)).collect();
    let mut runs: Vec<Vec<RolloutOutput>> = vec![Vec::new(); modes.len()];
    for _ in 0..reps {
        for (m, (_, spec, _)) in modes.iter().enumerate() {
            let proposer: Option<&mut dyn Proposer> = match spec {
                Speculation::Off => None,
                _ => Some(&mut replay),
            };
            let r = engines[m]
                .run(&reqs, &run_cfg(spec.clone()), proposer)
                .expect("a run");
            assert_eq!(r.sequences, reference.sequences, "lossless");
            runs[m].push(r);
        }
    }
    let tail_live = REQUESTS / 4;
    println!(
        "{REQUESTS} requests, {} tokens, {STAGES} stages and groups, medians of {reps} (modes alternate)",
        reference.stats.tokens
    );
    println!(
        "{:<13} {:>8} {:>8} {:>10} {:>8} {:>7} {:>8} {:>8}",
        "mode", "total s", "tail s", "tail tok/s", "accept", "steps", "propose", "absorb"
    );
    for ((name, _, _), rs) in modes.iter().zip(&runs) {
        let m = |f: &dyn Fn(&RolloutOutput) -> f64| median(rs.iter().map(f).collect());
        println!(
            "{name:<13} {:>8.3} {:>8.3} {:>10.1} {:>8.2} {:>7.0} {:>8.3} {:>8.3}",
            m(&|r| r.stats.seconds),
            m(&|r| r.stats.seconds - r.stats.tail_start_s),
            m(&|r| r.stats.tail_tokens_per_s()),
            m(&|r| r.stats.acceptance_length()),
            m(&|r| r.stats.steps as f64),
            m(&|r| r.stats.propose_s),
            m(&|r| r.stats.absorb_s),
        );
        let busy: Vec<String> = (0..STAGES)
            .map(|s| format!("{:.3}", m(&|r| r.stats.stage_busy_s[s])))
            .collect();
        println!("  stage busy s (whole run): {}", busy.join(" "));
    }
    // Per live size: the run with the median tail, bucketed by powers of two.
    println!("tail per live-batch bucket (median-tail run): ms per group step / tokens/s / steps");
    for ((name, _, _), rs) in modes.iter().zip(&runs) {
        let mut by: Vec<&RolloutOutput> = rs.iter().collect();
        by.sort_by(|a, b| {
            (a.stats.seconds - a.stats.tail_start_s)
                .total_cmp(&(b.stats.seconds - b.stats.tail_start_s))
        });
        let r = by[by.len() / 2];
        let mut buckets: BTreeMap<usize, (f64, usize, usize)> = BTreeMap::new();
        for (live, (s, t, n)) in breakdown(r, tail_live) {
            let e = buckets.entry(live.next_power_of_two()).or_default();
            e.0 += s;
            e.1 += t;
            e.2 += n;
        }
        let line: Vec<String> = buckets
            .iter()
            .map(|(b, (s, t, n))| {
                format!(
                    "≤{b}: {:.2}ms {:.0}t/s {n}",
                    1e3 * s / *n as f64,
                    *t as f64 / s
                )
            })
            .collect();
        println!("  {name:<13} {}", line.join(" | "));
    }
}
