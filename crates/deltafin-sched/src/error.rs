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
    /// The compute backend asked for cannot be used (no GPU, no driver, too little memory, a
    /// kernel that does not load); the message names the cause.
    #[error("{0}")]
    Backend(String),
    /// A request the engine cannot honor (empty prompt, bad option).
    #[error("{0}")]
    Invalid(String),
    /// The model's output held a NaN or an infinity: no token can be chosen from it, and
    /// choosing one anyway would be a wrong token with no error.
    #[error(
        "the model's logits at position {position} are not finite ({what}): a weight the checksums cannot judge is wrong \
         (an MXFP4 scale byte of 255 is NaN in E8M0) or a value overflowed; check the checkpoint with `deltafin doctor`, \
         and report it with the model and prompt if it passes"
    )]
    NonFinite { position: usize, what: String },
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;
