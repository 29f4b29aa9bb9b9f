//! `pipefill generate --model RUN_DIR --prompt TEXT`: generation from a trained model.
//!
//! The model comes from a pipefill run directory (`pipefill train` writes its final
//! whole-model `checkpoint/` there; a checkpoint directory itself is taken too) and runs
//! on the KV-cache inference path ([`InferStage`]) through the rollout engine: greedy at
//! temperature 0, otherwise sampled from `softmax(logits / T)` with `--seed`. When the
//! checkpoint holds a drafter (a run that trained one in its bubbles) the engine
//! speculates with it: at temperature 0 that is token for token plain greedy decoding
//! (lossless acceptance), and `--no-draft` turns it off.
//!
//! `--chat` renders the prompt as one user message through the tokenizer's chat template
//! (chat_template.jinja or tokenizer_config.json's `chat_template`) with the assistant's
//! header after it, as transformers' `apply_chat_template(add_generation_prompt=True)`.
//! The text is written as it is decoded ([`stream::TextStream`]); `--json` writes one
//! object at the end instead.
//!
//! The pieces are separate so that another source of models and tokenizers plugs in:
//! [`load_run`] gives a [`Loaded`] model (a Hugging Face directory can give one too),
//! [`Codec`] is what a tokenizer must do (the synthetic job's character tokenizer and a
//! `tokenizer.json` implement it), and [`generate`] takes the two.

mod codec;
mod stream;

use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};

use anyhow::{Context, anyhow, bail};
use pipefill::data::{DataConfig, DataSource, Tokenizer};
use pipefill::model::checkpoint::resume::{FINAL_DIR, ResumePoint};
use pipefill::model::checkpoint::{Checkpoint, META_FILE};
use pipefill::model::drafter::{Drafter, DrafterConfig};
use pipefill::model::hf::HfModel;
use pipefill::model::infer::InferStage;
use pipefill::model::{Cut, Gpt};
use pipefill::rl::rollout::{
    MessageHook, Request, RolloutConfig, RolloutEngine, Speculation, WorkKind,
};
use pipefill::rl::speculative::Proposer;
use pipefill::tensor::{Backend, CpuBackend};

pub use codec::Codec;
use codec::HfCodec;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A pipefill run directory (its final `checkpoint/`), a checkpoint directory, or a
    /// Hugging Face model directory (config.json, safetensors, and tokenizer.json for text).
    #[arg(long, value_name = "RUN_DIR|DIR")]
    model: PathBuf,
    /// The prompt, as text (the model's tokenizer encodes it).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// The prompt as raw token ids: `--prompt-ids 1,2,3`.
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    prompt_ids: Option<String>,
    /// The prompt is a user's chat message: rendered through the model's chat template,
    /// with the assistant's turn to answer.
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    /// Most tokens to generate (fewer when the model's positions run out or at EOS).
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// 0: greedy; otherwise sampling from softmax(logits / T).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    temperature: f32,
    /// Seed of sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Draft length of speculative decoding with the run's drafter.
    #[arg(long, default_value_t = 4)]
    draft: usize,
    /// Plain decoding even when the run has a drafter.
    #[arg(long)]
    no_draft: bool,
    /// Print one JSON object `{"tokens": [...], "text": "..."}` (the generated tokens) at
    /// the end, instead of the text as it comes.
    #[arg(long)]
    json: bool,
}

/// A model ready to generate: the target and, if it has one, its drafter.
pub struct Loaded<B: Backend> {
    pub gpt: Gpt<B>,
    pub drafter: Option<Drafter<B>>,
}

/// How to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub seed: u64,
    /// Draft length when the model has a drafter (0: plain decoding).
    pub draft: usize,
}

/// What [`generate`] produced.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Generation {
    /// The generated ids (EOS included when the model ended with it).
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature {} is not a finite number ≥ 0 (0 is greedy)",
            args.temperature
        );
    }
    let be = CpuBackend::new(1)?;
    // A Hugging Face directory (its config.json, whatever it is: one that is not a file is
    // the import's error to name) or a pipefill run.
    let hf = std::fs::symlink_metadata(args.model.join(pipefill::model::hf::CONFIG_FILE)).is_ok();
    let (mut loaded, tokenizer): (_, Box<dyn Codec>) = if hf {
        let model = HfModel::open(&args.model)?;
        let gpt = model.gpt(be, &Cut::Even(1))?;
        let codec: Box<dyn Codec> = Box::new(HfCodec::load(&args.model)?);
        (Loaded { gpt, drafter: None }, codec)
    } else {
        (load_run(&args.model, be)?, run_codec(&args.model)?)
    };
    if args.no_draft {
        loaded.drafter = None;
    }
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) if args.chat => tokenizer
            .encode_chat(text)
            .with_context(|| format!("--chat --prompt {text:?}"))?
            .ok_or_else(|| {
                anyhow!(
                    "--chat: the tokenizer of {} has no chat template (a chat_template.jinja \
                     or a chat_template in the tokenizer_config.json beside its \
                     tokenizer.json)",
                    args.model.display()
                )
            })?,
        (Some(text), None) => tokenizer
            .encode_prompt(text)
            .with_context(|| format!("--prompt {text:?}"))?,
        (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let options = Options {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        seed: args.seed,
        draft: args.draft,
    };
    if args.json {
        let out = generate(&mut loaded, tokenizer.as_ref(), &prompt, &options)?;
        println!("{}", serde_json::to_string(&out)?);
    } else {
        let mut text = stream::TextStream::new(tokenizer.as_ref(), std::io::stdout());
        generate_streaming(
            &mut loaded,
            tokenizer.as_ref(),
            &prompt,
            &options,
            &mut |tokens| text.push(tokens),
        )?;
        text.finish()?;
    }
    Ok(())
}

/// `1,2,3` (spaces allowed) as token ids.
fn parse_ids(text: &str) -> anyhow::Result<Vec<u32>> {
    text.split(',')
        .map(|s| {
            let s = s.trim();
            s.parse::<u32>().with_context(|| {
                format!("--prompt-ids {text:?}: {s:?} is not a token id (ids are 0, 1, 2, ...)")
            })
        })
        .collect()
}

/// The model of the run directory (or checkpoint directory) `path` on `be`: its final
/// whole-model checkpoint, and the drafter it holds (with the run's `[drafter]` settings
/// from its `job.toml` where there is one).
pub fn load_run<B: Backend>(path: &Path, be: B) -> anyhow::Result<Loaded<B>> {
    if !path.exists() {
        bail!("--model {}: no such run directory", path.display());
    }
    let dir = if path.join(META_FILE).is_file() {
        path.to_path_buf()
    } else if path.join(FINAL_DIR).join(META_FILE).is_file() {
        path.join(FINAL_DIR)
    } else {
        match ResumePoint::find(path).with_context(|| format!("--model {}", path.display()))? {
            ResumePoint::Whole(dir) => dir,
            ResumePoint::Sharded(dir) => bail!(
                "--model {}: only the sharded checkpoint {} (a run still going or stopped \
                 early); generate reads a finished run's {FINAL_DIR}/",
                path.display(),
                dir.display()
            ),
        }
    };
    let checkpoint =
        Checkpoint::load(&dir).with_context(|| format!("--model {}", path.display()))?;
    let config = checkpoint.meta.model.clone();
    // Every parameter comes from the checkpoint (nothing drawn, nothing imported).
    let mut gpt = Gpt::blank(&config, be.clone(), &Cut::Even(1))?;
    checkpoint
        .restore_model(&mut gpt, checkpoint.meta.data_seed)
        .with_context(|| format!("--model {}", dir.display()))?;
    let drafter = match &checkpoint.drafter {
        Some(state) => {
            let dc = drafter_config(path).unwrap_or_default();
            let mut d = Drafter::new(&config, &dc, be)?;
            // The file keeps no frozen tables (one written before they were shared does,
            // and loading them below keeps them): the target's own.
            d.refresh_from_gpt(&gpt, checkpoint.meta.step)?;
            d.load_weights(&state.weights)
                .with_context(|| format!("--model {}: its drafter", dir.display()))?;
            Some(d)
        }
        None => None,
    };
    Ok(Loaded { gpt, drafter })
}

/// Section `name` of the run's `job.toml` at `path` (its default when the file or the
/// section is missing). Only that section is read: the rest of the job (a `model.from`
/// directory that has moved since, say) does not matter here.
fn job_section<T: serde::de::DeserializeOwned + Default>(
    path: &Path,
    name: &str,
) -> anyhow::Result<T> {
    let job = path.join("job.toml");
    if !job.is_file() {
        return Ok(T::default());
    }
    let context = || format!("--model {}: its job.toml's [{name}]", path.display());
    let text = pipefill::input::read_text(&job, pipefill::config::MAX_JOB_BYTES, "a job file")
        .with_context(context)?;
    let mut table: toml::Table = toml::from_str(&text).with_context(context)?;
    match table.remove(name) {
        Some(section) => section.try_into().with_context(context),
        None => Ok(T::default()),
    }
}

/// The tokenizer the run at `path` trained with: a JSONL run's `data.tokenizer` (from its
/// `job.toml`), else the synthetic tasks' characters.
fn run_codec(path: &Path) -> anyhow::Result<Box<dyn Codec>> {
    let data: DataConfig = job_section(path, "data")?;
    if data.source != DataSource::Jsonl {
        return Ok(Box::new(Tokenizer::new()));
    }
    let context = || format!("--model {}: its job.toml's [data]", path.display());
    Ok(Box::new(data.text_tokenizer().with_context(context)?))
}

/// The `[drafter]` of the run's `job.toml`, when `path` is a run directory that has one.
fn drafter_config(path: &Path) -> Option<DrafterConfig> {
    path.join("job.toml")
        .is_file()
        .then(|| job_section(path, "drafter").ok())
        .flatten()
}

/// Generates after `prompt` (ids) with `model`, decoding the generated ids with `codec`.
/// Every bad input is an error: an empty prompt, an id outside the vocabulary, a prompt
/// that leaves no position to generate into, a temperature below 0.
pub fn generate<B: Backend>(
    model: &mut Loaded<B>,
    codec: &dyn Codec,
    prompt: &[u32],
    options: &Options,
) -> anyhow::Result<Generation> {
    generate_streaming(model, codec, prompt, options, &mut |_| Ok(()))
}

/// The rollout engine's hook that hands each step's accepted ids on, as the step ends.
struct Tap(mpsc::Sender<Vec<u32>>);

impl MessageHook for Tap {
    fn filed(&self, _stage: usize, _group: usize, _kind: WorkKind, _rows: usize) {}
    fn tokens(&self, _seq: usize, tokens: &[u32]) {
        // No receiver: `on_tokens` failed, and the generation returns its error.
        let _ = self.0.send(tokens.to_vec());
    }
}

/// [`generate`], handing the generated ids to `on_tokens` as each step of the engine
/// accepts them (one id, or a verified draft's), in order and each once. `on_tokens` runs on
/// a thread of its own, beside the engine; an error it returns is the generation's error.
pub fn generate_streaming<B: Backend>(
    model: &mut Loaded<B>,
    codec: &dyn Codec,
    prompt: &[u32],
    options: &Options,
    on_tokens: &mut (dyn FnMut(&[u32]) -> anyhow::Result<()> + Send),
) -> anyhow::Result<Generation> {
    let config = model.gpt.config().clone();
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token");
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= config.vocab) {
        bail!(
            "prompt token {t} is outside the model's vocabulary (ids 0..{})",
            config.vocab
        );
    }
    if prompt.len() >= config.seq_len {
        bail!(
            "the prompt has {} tokens; the model has {} positions, so at most {} leave room \
             to generate",
            prompt.len(),
            config.seq_len,
            config.seq_len - 1
        );
    }
    if !(options.temperature >= 0.0 && options.temperature.is_finite()) {
        bail!(
            "temperature {} is not a finite number ≥ 0 (0 is greedy)",
            options.temperature
        );
    }
    if model.drafter.is_some() && options.draft >= config.seq_len {
        bail!(
            "--draft {}: a draft must be shorter than the model's {} positions",
            options.draft,
            config.seq_len
        );
    }
    let max_new = options.max_new_tokens.min(config.seq_len - prompt.len());
    if max_new == 0 {
        return Ok(Generation {
            tokens: Vec::new(),
            text: String::new(),
        });
    }
    let stages = InferStage::stages_of(&model.gpt, &Cut::Even(1))?;
    let (tap, taken) = mpsc::channel::<Vec<u32>>();
    let mut engine = RolloutEngine::new(stages)?.with_hook(Arc::new(Tap(tap)));
    let speculate = model.drafter.is_some() && options.draft > 0;
    let rollout = RolloutConfig {
        // Never a token: the generation ends at its length only.
        eos: codec.eos().unwrap_or(u32::MAX),
        temperature: options.temperature,
        groups: 1,
        seed: options.seed,
        speculation: match speculate {
            true => Speculation::Fixed { k: options.draft },
            false => Speculation::Off,
        },
        ..RolloutConfig::default()
    };
    let request = Request {
        prompt: prompt.to_vec(),
        max_new,
    };
    let proposer = match (speculate, model.drafter.as_mut()) {
        (true, Some(d)) => Some(d as &mut dyn Proposer),
        _ => None,
    };
    let out = std::thread::scope(|scope| {
        let writer = scope.spawn(move || taken.iter().try_for_each(|t| on_tokens(&t)));
        let out = engine.run(&[request], &rollout, proposer);
        // The hook's sender goes with the engine: the writer ends after the last ids.
        drop(engine);
        let written = writer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        written.and(Ok(out?))
    })?;
    let tokens = out.completion(0).to_vec();
    let text = codec.decode(&tokens)?;
    Ok(Generation { tokens, text })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipefill::model::GptConfig;

    fn model() -> Loaded<CpuBackend> {
        let config = GptConfig {
            layers: 2,
            seq_len: 12,
            ..GptConfig::default()
        };
        let gpt = Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
        Loaded { gpt, drafter: None }
    }

    fn options() -> Options {
        Options {
            max_new_tokens: 4,
            temperature: 0.0,
            seed: 0,
            draft: 4,
        }
    }

    #[test]
    fn bad_prompts_are_errors() {
        let mut m = model();
        let t = Tokenizer::new();
        let err = |prompt: &[u32], o: &Options, m: &mut Loaded<CpuBackend>| {
            generate(m, &t, prompt, o).unwrap_err().to_string()
        };
        assert!(err(&[], &options(), &mut m).contains("empty"));
        assert!(err(&[3, 50], &options(), &mut m).contains("token 50"));
        assert!(err(&[3; 12], &options(), &mut m).contains("12 positions"));
        let cold = Options {
            temperature: -1.0,
            ..options()
        };
        assert!(err(&[3], &cold, &mut m).contains("temperature"));
        assert!(
            parse_ids("1, 2,x")
                .unwrap_err()
                .to_string()
                .contains("\"x\"")
        );
        assert_eq!(parse_ids("1, 2,3").unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn generation_stops_at_the_models_positions() {
        let mut m = model();
        let o = Options {
            max_new_tokens: 100,
            ..options()
        };
        let g = generate(&mut m, &Tokenizer::new(), &[3, 4, 5], &o).unwrap();
        assert!(
            !g.tokens.is_empty() && g.tokens.len() <= 9,
            "{:?}",
            g.tokens
        );
    }

    /// The engine hands the ids over step by step: one call per plain decoding step, in
    /// order, together the generation.
    #[test]
    fn tokens_come_as_each_step_accepts_them() {
        let mut m = model();
        let mut calls = Vec::new();
        let g = generate_streaming(
            &mut m,
            &Tokenizer::new(),
            &[3, 4, 5],
            &options(),
            &mut |t| {
                calls.push(t.to_vec());
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(calls.concat(), g.tokens);
        assert_eq!(calls.len(), g.tokens.len(), "{calls:?}");
    }
}
