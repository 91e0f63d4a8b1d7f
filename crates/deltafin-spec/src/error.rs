//! Errors of drafters: a draft model that cannot be loaded or run.

/// What went wrong, naming the field or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The draft model's `config.json` is not a supported Qwen3 config.
    #[error("draft model config: `{field}`: {why}")]
    Config { field: String, why: String },
    /// A tensor, tokenizer or token problem found by the core.
    #[error("draft model: {0}")]
    Core(#[from] deltafin_core::Error),
}

impl Error {
    pub(crate) fn config(field: &str, why: impl Into<String>) -> Error {
        Error::Config { field: field.into(), why: why.into() }
    }
}

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
