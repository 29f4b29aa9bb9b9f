//! [`TextTokenizer`]: the one tokenizer type the engine's data sources use, either the fixed
//! character vocabulary of the synthetic tasks ([`Tokenizer`]) or a Hugging Face
//! `tokenizer.json` ([`HfTokenizer`]).

use std::path::Path;
use std::sync::Arc;

use super::chat::ChatTemplate;
use super::error::DataError;
use super::hf_tokenizer::{Encoded, HfTokenizer};
use super::tokenizer::{self, Tokenizer};

/// `data.tokenizer`'s value naming the character tokenizer instead of a file.
pub const CHARS: &str = "chars";

/// A tokenizer, character-level or Hugging Face.
#[derive(Debug, Clone)]
pub enum TextTokenizer {
    Chars(Box<Tokenizer>),
    Hf(Arc<HfTokenizer>),
}

impl TextTokenizer {
    /// `"chars"`, or a tokenizer.json / model directory (see [`HfTokenizer::load`]).
    pub fn load(path: &Path) -> Result<Self, DataError> {
        if path.as_os_str() == CHARS {
            return Ok(Self::Chars(Box::default()));
        }
        Ok(Self::Hf(Arc::new(HfTokenizer::load(path)?)))
    }

    /// Number of ids (the model's `vocab` must be at least this).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Chars(t) => t.vocab_size(),
            Self::Hf(t) => t.vocab_size(),
        }
    }

    /// The id that ends a document.
    pub fn eos(&self) -> u32 {
        match self {
            Self::Chars(_) => tokenizer::EOS,
            Self::Hf(t) => t.eos().id,
        }
    }

    /// The id that begins a document, if the tokenizer has one.
    pub fn bos(&self) -> Option<u32> {
        match self {
            Self::Chars(_) => Some(tokenizer::BOS),
            Self::Hf(t) => t.bos().map(|b| b.id),
        }
    }

    /// The padding id, if the tokenizer has one.
    pub fn pad(&self) -> Option<u32> {
        match self {
            Self::Chars(_) => Some(tokenizer::PAD),
            Self::Hf(t) => t.pad().map(|b| b.id),
        }
    }

    /// The chat template, if any (the character tokenizer has none).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            Self::Chars(_) => None,
            Self::Hf(t) => t.chat_template(),
        }
    }

    /// `(bos_token, eos_token)` as the chat template sees them (empty when absent).
    pub fn special_texts(&self) -> (String, String) {
        match self {
            Self::Chars(_) => (String::new(), String::new()),
            Self::Hf(t) => (
                t.bos().map(|b| b.text.clone()).unwrap_or_default(),
                t.eos().text.clone(),
            ),
        }
    }

    /// The ids of `text` and each one's byte range. With `add_special_tokens`, the
    /// character tokenizer starts with BOS and a Hugging Face one runs its post-processor.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Encoded, DataError> {
        match self {
            Self::Chars(t) => {
                let mut ids = Vec::with_capacity(text.len() + 1);
                let mut offsets = Vec::with_capacity(text.len() + 1);
                if add_special_tokens {
                    ids.push(tokenizer::BOS);
                    offsets.push((0, 0));
                }
                for (position, (at, c)) in text.char_indices().enumerate() {
                    ids.push(
                        t.token_of(c)
                            .ok_or(DataError::UnknownChar { ch: c, position })?,
                    );
                    offsets.push((at, at + c.len_utf8()));
                }
                Ok((ids, offsets))
            }
            Self::Hf(t) => t.encode_with_offsets(text, add_special_tokens),
        }
    }

    /// The ids of `text` (see [`encode_with_offsets`](Self::encode_with_offsets)).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// The text of `ids`, special tokens dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Self::Chars(t) => t.decode(ids),
            Self::Hf(t) => t.decode(ids, true),
        }
    }
}
