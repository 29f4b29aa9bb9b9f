//! The drafter's chain acceptance, without the whole rollout bench: one target (a `pipefill
//! train` run's checkpoint, or trained here), one greedy rollout of a long-tail batch whose
//! rows train the drafter, and per drafter setting: top-1 agreement, the acceptance of each
//! draft depth given the ones before it (greedy chains of K, [`Drafter::chain_acceptance`],
//! on the training rows as `pipefill bench rollout` measures, and on a held-out batch), and
//! the slice's cost (median thread CPU seconds).
//!
//! ```text
//! cargo bench -p pipefill --bench chain -- [--init RUN_DIR] [--steps N] [--slices N]
//!     [--requests N] [--k K] [--variants V,V,...] [--set KEY=VALUE]...
//! ```
//! A variant is `unroll`, then `e` for `drafter.unroll_context = "exact"`, then optionally
//! `:decay` (`drafter.unroll_decay`), e.g. `1,2,2e,3e:0.5`. Without `--init` the target is the embedded job's model (`--set
//! model.d_model=512` for the rollout bench's) trained `--steps` steps. Everything but the
//! timings is deterministic: a re-run at another commit sees the same rows.

use std::path::PathBuf;
use std::time::Instant;

use pipefill::config::JobConfig;
use pipefill::data::{SplitMix64, TaskGenerator, Tokenizer, tokenizer::BOS};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::drafter::{
    DraftBufferHandle, DraftRow, Drafter, DrafterTrainer, UnrollContext,
};
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt};
use pipefill::rl::rollout::{Request, RolloutConfig, RolloutEngine, Speculation};
use pipefill::tensor::CpuBackend;
use pipefill::train::reference::Trainer;

struct Args {
    init: Option<PathBuf>,
    steps: u64,
    slices: usize,
    requests: usize,
    k: usize,
    variants: Vec<(String, Option<f32>)>,
    sets: Vec<String>,
}

fn args() -> Args {
    let mut a = Args {
        init: None,
        steps: 100,
        slices: 3000,
        requests: 128,
        k: 4,
        variants: vec![("1".into(), None), ("2".into(), None), ("2e".into(), None)],
        sets: vec!["drafter.window=8".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let num = |v: &str| -> usize { v.parse().unwrap_or_else(|_| panic!("{flag} {v}")) };
        match flag.as_str() {
            "--init" => a.init = Some(value.into()),
            "--steps" => a.steps = num(&value) as u64,
            "--slices" => a.slices = num(&value),
            "--requests" => a.requests = num(&value),
            "--k" => a.k = num(&value),
            "--set" => a.sets.push(value),
            "--variants" => {
                a.variants = value
                    .split(',')
                    .map(|v| match v.split_once(':') {
                        Some((u, w)) => (u.to_string(), Some(w.parse().expect("a decay"))),
                        None => (v.to_string(), None),
                    })
                    .collect()
            }
            _ => panic!("unknown flag {flag}"),
        }
    }
    a
}

/// `n` task prompts with heavy-tailed caps (as `pipefill bench rollout` builds its batch).
fn batch(job: &JobConfig, n: usize, seed: u64) -> Vec<Request> {
    let tok = Tokenizer::new();
    let d = &job.data;
    let mut tasks =
        TaskGenerator::new(&d.families, d.size_scale, d.max_size, SplitMix64::new(seed))
            .expect("the job's tasks");
    let mut rng = SplitMix64::new(seed ^ 1);
    let seq_len = job.model.seq_len;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let task = tasks.next_task();
        let mut prompt = vec![BOS];
        tok.encode_into(&task.prompt, &mut prompt).expect("encode");
        if prompt.len() + 1 < seq_len {
            let room = seq_len - prompt.len();
            let cap = 2 + rng.heavy_tailed(8.0, room as u32) as usize;
            out.push(Request {
                max_new: cap.min(room),
                prompt,
            });
        }
    }
    out
}

fn main() {
    let a = args();
    let mut job = JobConfig::embedded(&a.sets).expect("the job");
    let t0 = Instant::now();
    // Whichever target is used lives in one of these two.
    let (trainer, loaded);
    let (model, step): (&Gpt<CpuBackend>, u64) = match &a.init {
        Some(dir) => {
            let init = JobConfig::load(&dir.join("job.toml"), &[]).expect("--init: job.toml");
            job.model = init.model;
            job.train.seed = init.train.seed;
            let cp = Checkpoint::load(&dir.join("checkpoint")).expect("--init: checkpoint");
            let be = CpuBackend::new(1).expect("backend");
            let mut m = Gpt::blank(&job.model, be, &Cut::Even(1)).expect("model");
            cp.restore_model(&mut m, job.train.seed).expect("restore");
            loaded = m;
            (&loaded, cp.meta.step)
        }
        None => {
            let mut t = Trainer::reference(&job.model, &job.data, &job.train).expect("trainer");
            for _ in 0..a.steps {
                t.train_step().expect("step");
            }
            trainer = t;
            (trainer.model(), a.steps)
        }
    };
    println!(
        "target: d_model {}, {} layers, step {step} ({:.1} s)",
        job.model.d_model,
        job.model.layers,
        t0.elapsed().as_secs_f64()
    );
    let stages = InferStage::stages_of(model, &Cut::Even(2)).expect("stages");
    let mut engine = RolloutEngine::new(stages).expect("engine");
    let cfg = RolloutConfig {
        record_rows: true,
        speculation: Speculation::Off,
        ..RolloutConfig::default()
    };
    let seed = job.train.seed;
    let mut rows = |n, s| -> Vec<DraftRow> {
        let r = engine.run(&batch(&job, n, s), &cfg, None).expect("rollout");
        r.rows
    };
    let train = rows(a.requests, seed ^ 0x5eed_0001);
    let held = rows(a.requests / 2, seed ^ 0x5eed_0003);
    let pairs = |r: &[DraftRow]| r.iter().map(|r| r.len()).sum::<usize>();
    println!(
        "rows: {} training ({} positions), {} held out ({} positions)",
        train.len(),
        pairs(&train),
        held.len(),
        pairs(&held)
    );
    for (variant, decay) in &a.variants {
        let mut config = job.drafter.clone();
        let (unroll, exact) = match variant.strip_suffix('e') {
            Some(u) => (u, true),
            None => (variant.as_str(), false),
        };
        config.unroll = unroll.parse().expect("--variants: an unroll count");
        if exact {
            config.unroll_context = UnrollContext::Exact;
        }
        if let Some(w) = *decay {
            config.unroll_decay = w;
        }
        config.advanced.buffer_rows = train.len();
        let buffer = DraftBufferHandle::new(&job.model, &config);
        buffer.begin_step(step);
        for r in &train {
            buffer.lock().push(r.clone()).expect("row");
        }
        let mut d =
            Drafter::new(&job.model, &config, CpuBackend::new(1).expect("be")).expect("drafter");
        d.refresh_from_gpt(model, step).expect("refresh");
        let mut t = DrafterTrainer::new(d, buffer, 0, 1).expect("trainer");
        let t1 = Instant::now();
        let mut cpu = Vec::with_capacity(a.slices);
        for _ in 0..a.slices {
            cpu.push(t.slice().expect("slice").cpu_seconds);
        }
        let wall = t1.elapsed().as_secs_f64();
        cpu.sort_by(f64::total_cmp);
        let name = format!(
            "unroll {unroll} {:?} decay {}",
            config.unroll_context, config.unroll_decay
        );
        println!(
            "{name}: {} slices in {wall:.1} s, median {:.2} ms CPU per slice",
            a.slices,
            cpu[cpu.len() / 2] * 1e3
        );
        for (what, set) in [("train", &train), ("held", &held)] {
            let agree = t.agreement(set).expect("agreement");
            let s = t.drafter_mut().chain_acceptance(set, a.k).expect("chains");
            let per: Vec<String> = (1..=a.k)
                .map(|j| format!("{:.3}", s.conditional(j)))
                .collect();
            println!(
                "{name} {what}: top-1 {:.1}%, acceptance length at K={} {:.3}, per depth [{}] ({} proposals)",
                100.0 * agree,
                a.k,
                s.acceptance_length(),
                per.join(", "),
                s.proposals
            );
        }
    }
}
