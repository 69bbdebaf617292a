//! Text ↔ token ids with the model's tokenizer.json (HF `tokenizers`, pure-Rust regex build).

use std::path::{Path, PathBuf};

use crate::error::{FdppError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// `dir/tokenizer.json`, when the model directory has one.
    pub fn find(dir: &Path) -> Option<PathBuf> {
        let p = dir.join("tokenizer.json");
        p.is_file().then_some(p)
    }

    /// Load a tokenizer.json; a file that does not parse is an error naming it and the reason.
    pub fn load(path: &Path) -> Result<Self> {
        let loaded = guarded(|| tokenizers::Tokenizer::from_file(path).map_err(|e| e.to_string()));
        let inner = loaded.map_err(|e| FdppError::Config {
            path: path.to_path_buf(),
            msg: format!("tokenizer does not load: {e}; give --token-ids instead, or fix the file"),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Wrap a tokenizer built elsewhere (from a GGUF vocabulary); `path` names its source in
    /// messages.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer, path: &Path) -> Self {
        Tokenizer {
            inner,
            path: path.to_path_buf(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ids of `text`, with the tokenizer's special tokens (BOS) added as the model expects.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            guarded(|| self.inner.encode(text, true).map_err(|e| e.to_string())).map_err(|e| self.err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of `text` alone, no special tokens added (perplexity scores the text itself).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            guarded(|| self.inner.encode(text, false).map_err(|e| e.to_string())).map_err(|e| self.err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        guarded(|| self.inner.decode(ids, true).map_err(|e| e.to_string())).map_err(|e| self.err("decode", e))
    }

    /// The id of a token string (e.g. "</s>"), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id (e.g. 2 → "<|im_end|>"), if the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> FdppError {
        FdppError::Config {
            path: self.path.clone(),
            msg: format!("tokenizer {what} failed: {e}"),
        }
    }
}

thread_local! {
    /// Set while [`guarded`] runs on this thread: its panics are errors, not messages.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run a call into the `tokenizers` crate, turning a panic into an error: some malformed
/// tokenizer.json files make it panic while deserializing (a decoder section that is not valid
/// JSON panicked in `decoders/mod.rs`, found by tests/parser_fuzz.rs), and a bad file must be an
/// error naming the file, not a crash. The panic's message is kept for the error and not printed.
pub fn guarded<T>(f: impl FnOnce() -> std::result::Result<T, String>) -> std::result::Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(|q| q.get()) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    match r {
        Ok(r) => r,
        Err(payload) => {
            let why = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(format!("the tokenizers library failed on this file ({why})"))
        }
    }
}

/// Text of a growing token sequence, handed out piece by piece for streaming. Decoding the
/// whole sequence each time (rather than token by token) keeps merges and spaces right; a
/// piece is held back while it ends inside a multi-byte character (U+FFFD).
#[derive(Clone, Debug, Default)]
pub struct StreamText {
    ids: Vec<u32>,
    emitted: String,
}

impl StreamText {
    /// Add a token; returns the text that is now final and not yet emitted (may be empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = match text.strip_prefix(self.emitted.as_str()) {
            Some(rest) => rest.to_string(),
            // The tokenizer rewrote earlier text (rare): emit nothing now, the final text is
            // still right.
            None => String::new(),
        };
        if !piece.is_empty() {
            self.emitted.push_str(&piece);
        }
        Ok(piece)
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_the_library_is_an_error_with_its_message() {
        let r: std::result::Result<(), String> = guarded(|| panic!("decoder: expected `:`"));
        let e = r.expect_err("a panic is an error");
        assert!(
            e.contains("tokenizers library failed") && e.contains("expected `:`"),
            "{e}"
        );
        assert_eq!(guarded(|| Ok::<_, String>(3)), Ok(3));
        assert_eq!(guarded(|| Err::<(), _>("plain".to_string())), Err("plain".to_string()));
    }
}
