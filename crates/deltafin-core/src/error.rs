//! The crate's one error type.
//!
//! Every variant carries enough context (field, tensor, value) for a user to act on it without a
//! debugger: "field `text_config.num_experts` is missing", not "invalid config".

/// Errors raised by model math, config validation and tokenization.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config field is missing or has the wrong JSON type.
    #[error("config: field `{field}` is missing or not a {expected}")]
    MissingField { field: String, expected: &'static str },
    /// A config field holds a value the engine does not support.
    #[error("config: field `{field}` = {value} is not supported: {why}")]
    Unsupported { field: String, value: String, why: String },
    /// The config text is not JSON.
    #[error("config: not valid JSON: {0}")]
    Json(String),
    /// A tensor the model needs is absent from the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },
    /// A tensor has the wrong shape or dtype.
    #[error("tensor `{name}` in {file}: expected {expected}, found {found}")]
    BadTensor { name: String, file: String, expected: String, found: String },
    /// Bytes handed to a kernel do not match the declared layout.
    #[error("expert bytes: {0}")]
    ExpertLayout(String),
    /// The tokenizer files are malformed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// The sequence outgrew a budgeted limit (for example the MLA cache).
    #[error("context limit: {0}")]
    ContextLimit(String),
    /// Tokenizing was stopped by its caller (the request it served went away).
    #[error("tokenizing was stopped")]
    Stopped,
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;
