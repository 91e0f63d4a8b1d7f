//! The pre-tokenizer: cuts text into the pieces BPE merges, as tiktoken's split pattern does, in
//! time linear in the text.
//!
//! tiktoken's patterns (K3's, o200k's) end in `\s+(?!\S)|\s+`, a lookahead that only a backtracking
//! engine runs; on long runs that engine backtracks without bound (1 MB of `a` hit its backtrack
//! limit and the old fallback looped forever). Without that lookahead the pattern is a plain
//! regular expression, which the `regex` crate matches in linear time with the same leftmost-first
//! choice a backtracking engine makes. The lookahead is then replayed by hand: a whitespace run
//! matched by the final `\s+` that is followed by more text and longer than one character gives
//! its last character back to the next piece, which is exactly what `\s+(?!\S)` matched. A pattern
//! of another shape runs on the backtracking engine, with an error ending the text as one piece.

use crate::error::{Error, Result};

/// The lookahead alternative every tiktoken pattern ends with, followed by `|\s+`.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// A compiled split pattern.
pub(super) enum Splitter {
    /// The pattern without its lookahead, and the replayed lookahead.
    Linear(regex::Regex),
    /// A pattern of another shape.
    Backtracking(fancy_regex::Regex),
}

impl Splitter {
    pub(super) fn new(pattern: &str) -> Result<Splitter> {
        if let Some(head) = pattern.strip_suffix(LOOKAHEAD_TAIL) {
            if let Ok(re) = regex::Regex::new(&format!(r"{head}|\s+")) {
                return Ok(Splitter::Linear(re));
            }
        }
        let re = fancy_regex::Regex::new(pattern).map_err(|e| Error::Tokenizer(format!("split pattern: {e}")))?;
        Ok(Splitter::Backtracking(re))
    }

    /// Calls `f` with each piece in order until it returns false; returns whether every piece was
    /// handed over.
    pub(super) fn for_each_piece(&self, text: &str, f: &mut dyn FnMut(&str) -> bool) -> bool {
        match self {
            Splitter::Linear(re) => {
                let mut at = 0;
                while let Some(m) = re.find_at(text, at) {
                    let mut piece = m.as_str();
                    if m.end() < text.len() && is_lookahead_run(piece) {
                        let last = piece.chars().next_back().map_or(0, char::len_utf8);
                        piece = &piece[..piece.len() - last];
                    }
                    // Pieces are never empty (no alternative matches nothing), so `at` advances.
                    at = m.start() + piece.len();
                    if !f(piece) {
                        return false;
                    }
                }
                true
            }
            Splitter::Backtracking(re) => {
                let mut at = 0;
                while at < text.len() {
                    let (start, end) = match re.find_from_pos(text, at) {
                        Ok(Some(m)) if m.end() > m.start() => (m.start(), m.end()),
                        Ok(_) => return true,
                        // Past the engine's backtracking limit: the rest is one piece rather
                        // than the same error forever.
                        Err(_) => (at, text.len()),
                    };
                    at = end;
                    if !f(&text[start..end]) {
                        return false;
                    }
                }
                true
            }
        }
    }
}

/// Whether a match came from the final `\s+` where the original pattern's `\s+(?!\S)` would have
/// stopped one character short: all whitespace, more than one character, and not ending in a line
/// break (a run with a line break is matched by `\s*[\r\n]+` before either alternative).
fn is_lookahead_run(piece: &str) -> bool {
    let mut chars = piece.chars();
    let (Some(first), Some(last)) = (chars.next(), chars.next_back()) else {
        return false;
    };
    first.is_whitespace() && !matches!(last, '\r' | '\n') && piece.chars().all(char::is_whitespace)
}
