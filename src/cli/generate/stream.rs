//! Generated text written as its tokens come ([`TextStream`]).
//!
//! A token is not always a whole character: a byte-level tokenizer splits `é` or `€` over
//! tokens, and a decode that ends inside a character ends in U+FFFD. So the stream decodes
//! every token so far and writes the part of that text it has not written yet, once the text
//! does not end in U+FFFD (the standard way: transformers' `TextStreamer`, TGI). What it
//! writes in all is the whole generation's decoded text.

use std::io::Write;

use super::codec::Codec;

/// Writes the text of generated tokens to `out` as they are pushed, then a newline.
pub struct TextStream<'c, W: Write> {
    codec: &'c dyn Codec,
    out: W,
    tokens: Vec<u32>,
    /// Bytes of the decoded text written so far.
    written: usize,
}

impl<'c, W: Write> TextStream<'c, W> {
    pub fn new(codec: &'c dyn Codec, out: W) -> Self {
        TextStream {
            codec,
            out,
            tokens: Vec::new(),
            written: 0,
        }
    }

    /// `tokens` follow those pushed before: writes (and flushes) the text they add, unless
    /// it ends inside a character, which a later token completes.
    pub fn push(&mut self, tokens: &[u32]) -> anyhow::Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.tokens.extend_from_slice(tokens);
        let text = self.codec.decode(&self.tokens)?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(());
        }
        self.write_new(&text)
    }

    /// The generation is over: writes the rest of its text (an incomplete character as the
    /// whole decode gives it) and a newline.
    pub fn finish(mut self) -> anyhow::Result<()> {
        let text = self.codec.decode(&self.tokens)?;
        self.write_new(&text)?;
        self.out.write_all(b"\n")?;
        self.out.flush()?;
        Ok(())
    }

    /// Writes `text` past what was written. A decode of more tokens extends the decode of
    /// fewer (the tokenizers' decoders do not rewrite earlier text once a character is
    /// complete); should one not, nothing is written until the text grows past it again.
    fn write_new(&mut self, text: &str) -> anyhow::Result<()> {
        if text.len() > self.written && text.is_char_boundary(self.written) {
            self.out.write_all(&text.as_bytes()[self.written..])?;
            self.out.flush()?;
            self.written = text.len();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level codec: each id is one byte of UTF-8 text, decoded lossily.
    struct Bytes;

    impl Codec for Bytes {
        fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn encode_chat(&self, _: &str) -> anyhow::Result<Option<Vec<u32>>> {
            Ok(None)
        }
        fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
            let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        fn eos(&self) -> Option<u32> {
            None
        }
    }

    /// A writer that records each write, to see what was written when.
    #[derive(Default)]
    struct Writes(Vec<String>);

    impl Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .push(String::from_utf8(buf.to_vec()).expect("whole characters only"));
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Multi-byte characters split over tokens are written whole, once complete; the
    /// stream is the whole decode, newline ended, however the tokens come.
    #[test]
    fn split_characters_are_written_whole() {
        let text = "a€é 😀b";
        let ids = Bytes.encode_prompt(text).unwrap();
        for chunk in [1, 2, 3, 5, ids.len()] {
            let mut w = Writes::default();
            let mut s = TextStream::new(&Bytes, &mut w);
            for c in ids.chunks(chunk) {
                s.push(c).unwrap();
            }
            s.finish().unwrap();
            let writes = w.0;
            assert_eq!(writes.concat(), format!("{text}\n"), "chunks of {chunk}");
            if chunk == 1 {
                assert_eq!(writes, ["a", "€", "é", " ", "😀", "b", "\n"]);
            }
        }
        // A generation that ends inside a character writes what the whole decode gives.
        let mut out = Vec::new();
        let mut s = TextStream::new(&Bytes, &mut out);
        s.push(&[b'x' as u32, 0xe2, 0x82]).unwrap();
        s.finish().unwrap();
        let whole = Bytes.decode(&[b'x' as u32, 0xe2, 0x82]).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), format!("{whole}\n"));
        // No tokens: just the newline.
        let mut out = Vec::new();
        TextStream::new(&Bytes, &mut out).finish().unwrap();
        assert_eq!(out, b"\n");
    }
}
