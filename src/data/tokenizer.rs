//! The character-level tokenizer: a small fixed vocabulary, one token per character.
//!
//! The vocabulary is a constant, not learned, so every rank, every checkpoint and every
//! later RL run agree on token ids without shipping a vocabulary file.

use super::error::DataError;

/// Padding (never produced by packing; reserved for ragged batches in RL).
pub const PAD: u32 = 0;
/// Beginning of a document.
pub const BOS: u32 = 1;
/// End of a document.
pub const EOS: u32 = 2;

/// The characters of the vocabulary, in id order starting at id 3.
const CHARS: &str = " \n#+-=,:|<>0123456789abcdefghijklmnopqrstuvwxyz";
/// Ids of the special tokens come first.
const FIRST_CHAR_ID: u32 = 3;

/// Maps characters to token ids and back. Cheap to construct; a lookup table for ASCII.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    /// `ascii_to_id[c]` is the id of ASCII character `c`, or `u32::MAX` if not in the vocabulary.
    ascii_to_id: [u32; 128],
    id_to_char: Vec<char>,
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Tokenizer {
    /// The tokenizer with the fixed vocabulary.
    pub fn new() -> Self {
        let mut ascii_to_id = [u32::MAX; 128];
        let mut id_to_char = vec!['\0'; FIRST_CHAR_ID as usize];
        for (i, c) in CHARS.chars().enumerate() {
            ascii_to_id[c as usize] = FIRST_CHAR_ID + i as u32;
            id_to_char.push(c);
        }
        Self {
            ascii_to_id,
            id_to_char,
        }
    }

    /// Number of token ids (special tokens included): the model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.id_to_char.len()
    }

    /// The id of one character, if it is in the vocabulary.
    pub fn token_of(&self, c: char) -> Option<u32> {
        let i = c as usize;
        (i < 128 && self.ascii_to_id[i] != u32::MAX).then(|| self.ascii_to_id[i])
    }

    /// The ids of `text`, one per character. A character outside the vocabulary is an
    /// error that names it and its (character) position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let mut out = Vec::with_capacity(text.len());
        self.encode_into(text, &mut out)?;
        Ok(out)
    }

    /// Like [`encode`](Self::encode), appending to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), DataError> {
        for (position, c) in text.chars().enumerate() {
            let id = self
                .token_of(c)
                .ok_or(DataError::UnknownChar { ch: c, position })?;
            out.push(id);
        }
        Ok(())
    }

    /// `BOS`, the prompt and worked solution of `text`, `EOS`: one training document.
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let mut out = Vec::with_capacity(text.len() + 2);
        out.push(BOS);
        self.encode_into(text, &mut out)?;
        out.push(EOS);
        Ok(out)
    }

    /// The text of `ids`. Special tokens are dropped (they have no text); an id outside
    /// the vocabulary is an error that names it and its position.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let mut s = String::with_capacity(ids.len());
        for (position, &id) in ids.iter().enumerate() {
            match id {
                PAD | BOS | EOS => {}
                _ => match self.id_to_char.get(id as usize) {
                    Some(&c) => s.push(c),
                    None => {
                        return Err(DataError::UnknownToken {
                            id,
                            position,
                            vocab_size: self.vocab_size(),
                        });
                    }
                },
            }
        }
        Ok(s)
    }
}
