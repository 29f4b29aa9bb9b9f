//! A Hugging Face tokenizer: `tokenizer.json` read with the `tokenizers` crate, its special
//! tokens (bos / eos / pad) and chat template from `tokenizer_config.json` beside it.
//!
//! [`HfTokenizer::load`] takes a `tokenizer.json` file or a model directory holding one.
//! Every file is input, read by [`crate::input::read`] (a regular file, its size checked
//! before a byte is read), and a file that is not valid is one error naming it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::DataError;
use super::chat::ChatTemplate;
use crate::input;

/// Largest `tokenizer.json` read (Llama 3's is 9 MB, Qwen2's 7 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Largest `tokenizer_config.json` / `special_tokens_map.json` read.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// Ids and each one's byte range in the encoded text.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// A tokenizer.json with its special tokens and chat template.
#[derive(Clone)]
pub struct HfTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: PathBuf,
    vocab_size: usize,
    bos: Option<SpecialToken>,
    eos: SpecialToken,
    pad: Option<SpecialToken>,
    template: Option<ChatTemplate>,
}

/// A special token's text and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

/// A special token entry of tokenizer_config.json: a string, or an AddedToken object.
fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl HfTokenizer {
    /// Reads `path`: a tokenizer.json, or a directory with one. tokenizer_config.json (and,
    /// for missing special tokens, special_tokens_map.json) beside it give bos, eos, pad and
    /// the chat template; without an eos token there, the first of `</s>`,
    /// `<|endoftext|>`, `<|end_of_text|>`, `<|im_end|>` in the vocabulary is used.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
        let bytes = input::read(&file, MAX_TOKENIZER_BYTES, "a tokenizer.json")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
                path: file.clone(),
                reason: e.to_string(),
            })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let map = read_json(&dir.join("special_tokens_map.json"))?;
        let field = |name: &str| {
            [&config, &map]
                .into_iter()
                .flatten()
                .find_map(|c| c.get(name).and_then(token_text))
        };
        let special = |name: &'static str, text: String| -> Result<SpecialToken, DataError> {
            let id = inner
                .token_to_id(&text)
                .ok_or_else(|| DataError::Tokenizer {
                    path: file.clone(),
                    reason: format!("{name} {text:?} is not in the vocabulary"),
                })?;
            Ok(SpecialToken { text, id })
        };
        let bos = field("bos_token")
            .map(|t| special("bos_token", t))
            .transpose()?;
        let pad = field("pad_token")
            .map(|t| special("pad_token", t))
            .transpose()?;
        let eos = match field("eos_token") {
            Some(t) => special("eos_token", t)?,
            None => ["</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>"]
                .into_iter()
                .find_map(|t| {
                    inner.token_to_id(t).map(|id| SpecialToken {
                        text: t.to_string(),
                        id,
                    })
                })
                .ok_or_else(|| DataError::Tokenizer {
                    path: file.clone(),
                    reason: "no eos_token in tokenizer_config.json and none of </s>, \
                             <|endoftext|>, <|end_of_text|>, <|im_end|> in the vocabulary"
                        .into(),
                })?,
        };
        let template = match config.as_ref().and_then(|c| c.get("chat_template")) {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(source)) => Some(ChatTemplate::new(source)?),
            // A list of named templates ({"name", "template"}): the "default" one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(ChatTemplate::new)
                .transpose()?,
            Some(_) => {
                return Err(DataError::Tokenizer {
                    path: dir.join("tokenizer_config.json"),
                    reason: "chat_template is neither a string nor a list of templates".into(),
                });
            }
        };
        Ok(Self {
            inner: Arc::new(inner),
            path: file,
            vocab_size,
            bos,
            eos,
            pad,
            template,
        })
    }

    /// The tokenizer.json this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more than the largest id (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    pub fn eos(&self) -> &SpecialToken {
        &self.eos
    }

    pub fn pad(&self) -> Option<&SpecialToken> {
        self.pad.as_ref()
    }

    /// tokenizer_config.json's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The ids of `text` and each one's byte range in it (added special tokens such as a
    /// post-processor's BOS have an empty range at 0). `add_special_tokens` runs the
    /// tokenizer's post-processor (a Llama 3 BOS), as `tokenizer(text)` does in Python.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Encoded, DataError> {
        let enc =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| DataError::Tokenizer {
                    path: self.path.clone(),
                    reason: format!("encoding failed: {e}"),
                })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The ids of `text` (see [`encode_with_offsets`](Self::encode_with_offsets)).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// The text of `ids`; special tokens are dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DataError> {
        if let Some((position, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(DataError::UnknownToken {
                id,
                position,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| DataError::Tokenizer {
                path: self.path.clone(),
                reason: format!("decoding failed: {e}"),
            })
    }
}

/// A JSON object file, `None` if it does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>, DataError> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = input::read(path, MAX_CONFIG_BYTES, "a tokenizer config")?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| DataError::Tokenizer {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
    if !value.is_object() {
        return Err(DataError::Tokenizer {
            path: path.to_path_buf(),
            reason: "is not a JSON object".into(),
        });
    }
    Ok(Some(value))
}
