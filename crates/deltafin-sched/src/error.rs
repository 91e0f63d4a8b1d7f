//! The engine's error type: model math and store errors pass through with their context.

/// Errors from the engine loop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// From model math (config, tensors, context limit, tokenizer).
    #[error(transparent)]
    Model(#[from] deltafin_core::Error),
    /// From the store (files, drives, integrity, budget).
    #[error(transparent)]
    Store(#[from] deltafin_store::Error),
    /// The generation was cancelled (its client went away).
    #[error("cancelled")]
    Cancelled,
    /// A request the engine cannot honor (empty prompt, bad option).
    #[error("{0}")]
    Invalid(String),
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;
