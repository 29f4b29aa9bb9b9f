//! The drafter at a real vocabulary: a SmolLM-135M-shaped target (Llama architecture,
//! 49,152 tokens, `d_model` 576, 30 layers, tied embeddings) with random weights made here,
//! nothing read or written but a temporary checkpoint directory.
//!
//! It reports, beside the target's size: what one drafter replica holds (its trainable
//! weights with gradients and AdamW moments), the frozen embedding and head (one snapshot per
//! process, measured on the replicas a 4-rank pipelined run builds, against a copy each as
//! before), its buffer
//! filled with 2048 training positions and 256 held-out ones (as the run held) and
//! what the same rows took when they kept their distributions, the size of
//! `drafter.safetensors` for that state, a slice's time (median), and a K = 4 proposal's
//! time with the full head against reduced draft vocabularies (median, memo warm).
//! `cargo bench --bench vocab` (`VOCAB_REPS` sets the repetitions, 7 by default).

use std::time::Instant;

use pipefill::config::JobConfig;
use pipefill::data::SplitMix64;
use pipefill::model::checkpoint::drafter::save_drafter;
use pipefill::model::config::Positions;
use pipefill::model::drafter::state::{BufferState, DrafterState};
use pipefill::model::drafter::{
    DraftBufferHandle, DraftContext, DraftRow, Drafter, DrafterTrainer, frequent_tokens,
};
use pipefill::model::{GptConfig, init};
use pipefill::pipeline::fill::DrafterFill;
use pipefill::tensor::{Activation, CpuBackend};

const MB: f64 = 1e6;

fn target() -> GptConfig {
    GptConfig {
        vocab: 49_152,
        d_model: 576,
        heads: 9,
        kv_heads: Some(3),
        layers: 30,
        seq_len: 2048,
        intermediate: Some(1536),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        tie_embeddings: true,
        ..GptConfig::default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `n` rows of `len` positions: random hidden states, tokens drawn with a Zipf-like skew
/// (a few tokens most of the time, as text is) so that a draft vocabulary has a head to keep.
fn rows(rng: &mut SplitMix64, n: usize, len: usize, cfg: &GptConfig) -> Vec<DraftRow> {
    let zipf = |rng: &mut SplitMix64| {
        let u = rng.next_f64().max(1e-12);
        ((cfg.vocab as f64).powf(u) - 1.0) as u32 % cfg.vocab as u32
    };
    (0..n)
        .map(|_| DraftRow {
            hidden: (0..len * cfg.d_model)
                .map(|_| rng.next_f64() as f32 - 0.5)
                .collect(),
            targets: (0..len).map(|_| zipf(rng)).collect(),
            step: 0,
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let reps: usize = std::env::var("VOCAB_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let cfg = target();
    let job = JobConfig::embedded(&[])?;
    let dc = job.drafter.clone();
    let (v, d) = (cfg.vocab, cfg.d_model);
    let target_params = cfg.param_count();
    // Weights, gradients and two AdamW moments, f32.
    let target_bytes = 16.0 * target_params as f64;
    println!(
        "target: {target_params} parameters (vocab {v}, d_model {d}, {} layers): weights {:.0} MB, with gradients and AdamW moments {:.0} MB",
        cfg.layers,
        4.0 * target_params as f64 / MB,
        target_bytes / MB
    );

    let be = CpuBackend::new(1)?;
    let drafter = Drafter::new(&cfg, &dc, be)?;
    let trained: usize = drafter.params().iter().map(|p| p.numel()).sum();
    let replica = 16.0 * trained as f64;
    let tables = drafter.frozen().bytes(drafter.backend()) as f64;
    println!(
        "drafter replica: {trained} trainable parameters, with gradients and moments {:.1} MB ({:.1}% of the target's)",
        replica / MB,
        100.0 * replica / target_bytes,
    );
    // A pipelined run's replicas in one process (here 4, as a 4-stage run holds), built as the
    // fill builds them: the tables they read, each counted once.
    let ranks = 4;
    let fill = DrafterFill::with_tables(
        &cfg,
        &dc,
        ranks,
        init::normal(cfg.seed, "embed.tok", v * d, init::INIT_STD),
        init::normal(cfg.seed, "head.w", v * d, init::INIT_STD),
        0,
    )?;
    let shared = fill.frozen_table_bytes() as f64;
    drop(fill);
    println!(
        "frozen embedding and head: {:.1} MB a snapshot; {ranks} replicas of one process read {:.1} MB of them (a copy each: {:.1} MB)",
        tables / MB,
        shared / MB,
        ranks as f64 * tables / MB
    );
    for n in [1, ranks] {
        let each = replica + shared / n as f64;
        let copies = replica + tables;
        println!(
            "per replica, {n} in a process: {:.1} MB ({:.1}% of the target's); with a copy of the tables each {:.1} MB ({:.1}%)",
            each / MB,
            100.0 * each / target_bytes,
            copies / MB,
            100.0 * copies / target_bytes
        );
    }

    // The buffer: 2048 training positions (2 generations of 16 rows of 64) and 256
    // held out.
    let mut rng = SplitMix64::new(7);
    let buffer = DraftBufferHandle::new(&cfg, &dc);
    let held = DraftBufferHandle::new(&cfg, &dc);
    buffer.begin_step(0);
    held.begin_step(1);
    for r in rows(&mut rng, 16, 64, &cfg) {
        buffer.lock().push(r)?;
    }
    buffer.begin_step(1);
    for r in rows(&mut rng, 16, 64, &cfg) {
        buffer.lock().push(r)?;
    }
    for r in rows(&mut rng, 4, 64, &cfg) {
        held.lock().push(r)?;
    }
    let positions: usize = buffer.lock().rows().map(DraftRow::len).sum();
    let held_positions: usize = held.lock().rows().map(DraftRow::len).sum();
    let row_bytes = |p: usize| (4 * p * (d + 1)) as f64;
    println!(
        "buffer: {positions} + {held_positions} held-out positions hold {:.1} MB (hidden states and tokens); with each position's distribution, as before, {:.1} MB",
        (row_bytes(positions) + row_bytes(held_positions)) / MB,
        (row_bytes(positions + held_positions) + (4 * (positions + held_positions) * v) as f64)
            / MB
    );

    let mut trainer = DrafterTrainer::new(drafter, buffer.clone(), 0, 1)?;
    let mut slice_ms = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        trainer.slice()?;
        slice_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "slice ({} row of {} positions, unroll {}): median {:.1} ms over {reps}",
        dc.batch_rows,
        dc.max_positions,
        dc.unroll,
        median(slice_ms)
    );

    let state = DrafterState {
        weights: trainer.weights()?,
        optimizer: trainer.optimizer_state()?,
        samplers: vec![trainer.sampler()],
        buffer: BufferState::of(&buffer.lock()),
        held_out: BufferState::of(&held.lock()),
        round: None,
    };
    let dir = tempfile::tempdir()?;
    let entry = save_drafter(dir.path(), &state, &cfg)?;
    // The target's checkpoint: its values and both AdamW moments, f32.
    let (shard, ckpt) = (4.0 * target_params as f64, 12.0 * target_params as f64);
    let with_tables = entry.bytes as f64 + tables;
    println!(
        "drafter.safetensors: {:.1} MB ({:.1}% of the target's checkpoint of {:.0} MB, {:.1}% of its {:.0} MB of f32 weights); with the tables, as it was, {:.1} MB ({:.1}%, {:.1}%)",
        entry.bytes as f64 / MB,
        100.0 * entry.bytes as f64 / ckpt,
        ckpt / MB,
        100.0 * entry.bytes as f64 / shard,
        shard / MB,
        with_tables / MB,
        100.0 * with_tables / ckpt,
        100.0 * with_tables / shard
    );
    drop(dir);

    // Proposals: K = 4 for one sequence over a full window, the memo warm (one untimed call).
    let probe = rows(&mut rng, 1, dc.window, &cfg).remove(0);
    let ctx = [DraftContext {
        hidden: &probe.hidden,
        tokens: &probe.targets,
    }];
    let counts: Vec<DraftRow> = buffer.lock().rows().cloned().collect();
    let drafter = trainer.drafter_mut();
    for n in [None, Some(32_768), Some(16_384), Some(8_192), Some(4_096)] {
        let ids = n.map(|n| frequent_tokens(&counts, v, n));
        drafter.set_draft_vocab(ids.as_deref())?;
        let mut rng = SplitMix64::new(0);
        drafter.propose(&ctx, 4, 0.0, &mut rng)?;
        let mut ms = Vec::new();
        for _ in 0..reps.max(5) {
            let t = Instant::now();
            drafter.propose(&ctx, 4, 0.0, &mut rng)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        println!(
            "proposal K=4, {}: median {:.2} ms",
            n.map_or("full head (49,152)".to_string(), |n| format!(
                "draft vocabulary {n}"
            )),
            median(ms)
        );
    }
    Ok(())
}
