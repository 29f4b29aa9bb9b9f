//! What generation needs of a tokenizer ([`Codec`]): a prompt's text (or, for `--chat`, one
//! user message rendered through the chat template) to ids, and generated ids back to text.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use pipefill::data::tokenizer::{BOS, EOS};
use pipefill::data::{TextTokenizer, Tokenizer};

/// What a tokenizer does for generation: a prompt's text to the ids the model expects
/// (special tokens included), and generated ids back to text. `Sync`: the generated text is
/// decoded on a thread beside the engine's.
pub trait Codec: Sync {
    fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>>;
    /// `text` as one user message rendered through the chat template with the assistant's
    /// header after it (`add_generation_prompt`), as ids; `None`: the tokenizer has no chat
    /// template.
    fn encode_chat(&self, text: &str) -> anyhow::Result<Option<Vec<u32>>>;
    fn decode(&self, ids: &[u32]) -> anyhow::Result<String>;
    /// The id that ends a generation (`None`: only the length does).
    fn eos(&self) -> Option<u32>;
}

/// The synthetic job's characters: a prompt is `BOS` and its characters, as the job's
/// documents and `pipefill rl`'s prompts begin. It has no chat template.
impl Codec for Tokenizer {
    fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut ids = vec![BOS];
        self.encode_into(text, &mut ids)?;
        Ok(ids)
    }
    fn encode_chat(&self, _text: &str) -> anyhow::Result<Option<Vec<u32>>> {
        Ok(None)
    }
    fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        Ok(Tokenizer::decode(self, ids)?)
    }
    fn eos(&self) -> Option<u32> {
        Some(EOS)
    }
}

/// A Hugging Face tokenizer.json: the prompt encoded with the special tokens its
/// post-processor adds (e.g. BOS), special tokens dropped from the text. A chat prompt is
/// encoded without them, as transformers' `apply_chat_template(tokenize=True)` does (the
/// template writes its own).
impl Codec for TextTokenizer {
    fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(self.encode(text, true)?)
    }
    fn encode_chat(&self, text: &str) -> anyhow::Result<Option<Vec<u32>>> {
        let Some(template) = self.chat_template() else {
            return Ok(None);
        };
        let (bos, eos) = self.special_texts();
        let user = serde_json::json!({"role": "user", "content": text});
        let rendered = template.render(&[user], true, &bos, &eos)?;
        Ok(Some(self.encode(&rendered, false)?))
    }
    fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        Ok(TextTokenizer::decode(self, ids)?)
    }
    fn eos(&self) -> Option<u32> {
        Some(TextTokenizer::eos(self))
    }
}

/// A Hugging Face directory's codec: its tokenizer.json when it has one (else ids only),
/// and the EOS of its generation_config.json (else the tokenizer's), where transformers'
/// `generate` stops too.
pub struct HfCodec {
    dir: PathBuf,
    tokenizer: Option<TextTokenizer>,
    eos: Option<u32>,
}

impl HfCodec {
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let tokenizer = match dir.join("tokenizer.json").is_file() {
            true => Some(TextTokenizer::load(dir)?),
            false => None,
        };
        let eos = generation_eos(dir)?.or(tokenizer.as_ref().map(TextTokenizer::eos));
        Ok(HfCodec {
            dir: dir.to_path_buf(),
            tokenizer,
            eos,
        })
    }
}

impl Codec for HfCodec {
    fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match &self.tokenizer {
            Some(t) => t.encode_prompt(text),
            None => bail!(
                "{} has no tokenizer.json to encode --prompt with: give --prompt-ids 1,2,3",
                self.dir.display()
            ),
        }
    }
    fn encode_chat(&self, text: &str) -> anyhow::Result<Option<Vec<u32>>> {
        match &self.tokenizer {
            Some(t) => t.encode_chat(text),
            None => bail!(
                "{} has no tokenizer.json (nor a chat template) to encode a --chat prompt with",
                self.dir.display()
            ),
        }
    }
    /// Without a tokenizer, no text: the generated ids are the output.
    fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match &self.tokenizer {
            Some(t) => Codec::decode(t, ids),
            None => Ok(String::new()),
        }
    }
    fn eos(&self) -> Option<u32> {
        self.eos
    }
}

/// Most bytes of a generation_config.json read (a few hundred in practice).
const GENERATION_CONFIG_MAX_BYTES: u64 = 1 << 20;

/// `eos_token_id` of `dir`'s generation_config.json (a number, or a list whose first entry
/// is taken), `None` without the file or the field.
fn generation_eos(dir: &Path) -> anyhow::Result<Option<u32>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = pipefill::input::read(&path, GENERATION_CONFIG_MAX_BYTES, "a generation config")?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let id = match &json["eos_token_id"] {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::Array(ids) => ids.first().cloned().unwrap_or_default(),
        v => v.clone(),
    };
    match id.as_u64().and_then(|i| u32::try_from(i).ok()) {
        Some(id) => Ok(Some(id)),
        None if id.is_null() => Ok(None),
        None => bail!("{}: eos_token_id {id} is not a token id", path.display()),
    }
}
