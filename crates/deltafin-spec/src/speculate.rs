//! Speculative generation on the engine step: each step feeds K3's latest token plus up to `k`
//! drafted ones as one verify slot, keeps the longest prefix K3 agrees with plus K3's own next
//! token, and cuts the sequence back exactly (`Engine::rewind`). Every emitted token is K3's
//! greedy choice computed by the same batch-invariant kernels as plain decoding, so the output,
//! and the sequence state left behind, are those of plain decoding.

use deltafin_core::argmax;
use deltafin_sched::{Engine, GenerateOptions, LogitRows, Phase, Result, Sequence, Slot};

use crate::{verify_greedy, Drafter};

/// What speculation did in one generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpecStats {
    /// Tokens emitted.
    pub generated: usize,
    /// Draft tokens proposed and verified.
    pub drafted: usize,
    /// Of which K3 agreed with.
    pub accepted: usize,
    /// Verify steps run.
    pub verifies: usize,
    /// Generation stopped at the sequence's context limit.
    pub context_limit_reached: bool,
}

/// Greedy generation after `prompt` with drafts of at most `max_draft` tokens from `drafter`;
/// calls `on_token` with each new id (as [`Engine::generate`] does) and ends the same way: at a
/// stop id, after `opts.max_new` tokens, at the context limit, or when `on_token` says so.
pub fn generate(
    engine: &Engine,
    seq: &mut Sequence,
    prompt: &[u32],
    opts: &GenerateOptions,
    drafter: &mut dyn Drafter,
    max_draft: usize,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<SpecStats> {
    let mut stats = SpecStats::default();
    if opts.max_new == 0 {
        return Ok(stats);
    }
    let (logits, _) = engine.forward_with(seq, prompt, LogitRows::Last, opts.cancel.as_ref())?;
    let mut next = argmax(logits.row(logits.rows - 1));
    loop {
        stats.generated += 1;
        let more = on_token(next);
        if opts.stop_ids.contains(&next) || !more || stats.generated == opts.max_new {
            break;
        }
        let room = seq.context_limit() - seq.ids().len();
        if room == 0 {
            stats.context_limit_reached = true;
            break;
        }
        let mut context = seq.ids().to_vec();
        context.push(next);
        let want = max_draft.min(opts.max_new - stats.generated).min(room - 1);
        let mut drafts = drafter.draft(&context, want);
        drafts.truncate(want);
        let mut ids = Vec::with_capacity(1 + drafts.len());
        ids.push(next);
        ids.extend_from_slice(&drafts);
        let start = seq.ids().len();
        let out = engine.step(&mut [Slot::new(seq, &ids, Phase::Verify)], opts.cancel.as_ref())?;
        let verdict = verify_greedy(&drafts, &out.logits[0]);
        stats.verifies += 1;
        stats.drafted += drafts.len();
        stats.accepted += verdict.accepted;
        drafter.accepted(drafts.len(), verdict.accepted);
        // Emit the accepted drafts (each is K3's own choice), stopping as plain decoding would.
        let mut stopped_at = None;
        for (i, &t) in drafts[..verdict.accepted].iter().enumerate() {
            stats.generated += 1;
            let more = on_token(t);
            if opts.stop_ids.contains(&t) || !more || stats.generated == opts.max_new {
                stopped_at = Some(i);
                break;
            }
        }
        // Keep what plain decoding would hold: every emitted token but the last one emitted.
        let keep = match stopped_at {
            Some(i) => start + 1 + i,
            None => start + 1 + verdict.accepted,
        };
        engine.rewind(seq, keep)?;
        if stopped_at.is_some() {
            break;
        }
        next = verdict.next;
    }
    Ok(stats)
}
