//! Kimi K3 model math for Deltafin: the validated config, the layers (KDA, gated NoPE MLA,
//! Block Attention-Residuals, latent MoE), the MXFP4 and BF16 kernels, and the tokenizers.
//!
//! This crate is pure computation. It never opens a file or a socket: weights arrive as
//! [`Bytes`] lent by a [`TensorSource`] (the store implements it over memory maps), and expert
//! bytes arrive one expert at a time from whoever schedules the forward pass.
//!
//! The principal types:
//! - [`K3Config`]: every dimension and the layer schedule, parsed strictly from `config.json`.
//! - [`Model`]: the spine weights and the per-layer steps a scheduler walks through.
//! - [`Mat`]: F32 activations, one row per token.
//! - [`Tokenizer`]: K3's tiktoken-format BPE; [`ChatFormat`] renders conversations to ids.
//!
//! **Exactness.** Every output value is computed by one fixed-order dot product (see the
//! `kernels` module docs), so the logits of a token are bit-identical whether it is processed in
//! a prompt batch or alone in decode, on any thread count and any of the SIMD paths.

mod backend;
mod chat;
mod config;
mod error;
mod kernels;
mod math;
mod model;
mod reply;
mod tensor;
mod tokenizer;
mod weights;

pub use crate::{
    backend::{Backend, Cpu, ExpertId, MlaHead},
    chat::{attr_of, attr_value, ChatFormat, Message, Role, ToolCall, ToolTurn},
    config::{AttentionKind, ExpertShape, IndexerConfig, IndexerRounding, K3Config, MlpKind},
    error::{Error, Result},
    kernels::{
        dot_bf16, dot_bf16_inputs, dot_bf16_rows, dot_bf16_rows_side_by_side, dot_f32, dot_mxfp4, dot_mxfp4_inputs, e2m1_value, e8m0_scale,
        first_come, for_row_chunks, matmul_bf16, matmul_bf16_with, matmul_bf16_without_panels, matmul_mxfp4, matmul_mxfp4_without_assembly,
        on_compute_threads, permute_for_mxfp4, permute_for_mxfp4_into, row_chunks, Isa, IsaKind, LinedRows, Mxfp4Matrix, PromptKernel,
        LANES,
    },
    math::{argmax, exp, rms_norm_in_place, situ, softmax_in_place, TRANSCENDENTAL_CONSTANTS},
    model::{
        chunked_delta_rule, expert_forward, expert_row_chunks, index_score, prepare_index_query, quantize_e4m3, round_index_key,
        round_to_bf16, round_to_e4m3, top_keys, ue8m0_scale, EmbedRows, ExpertLayout, KdaState, LayerState, MlaCache, Model, MoeCombine,
        Recording, Residual, Route, LM_PREFIX,
    },
    reply::{Part as ReplyPart, ReplySplitter, ToolEvent},
    tensor::Mat,
    tokenizer::{byte_level_spelling, reserved_token_name, HfTokenizer, StreamDecoder, Tokenizer, K3_PATTERN, RESERVED},
    weights::{bf16_to_f32, Bf16Matrix, ByteOwner, Bytes, BytesId, DType, TensorBytes, TensorSource},
};
