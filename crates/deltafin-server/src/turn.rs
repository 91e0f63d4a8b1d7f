//! What a turn's worker events mean for its client, whatever the response's shape: the one
//! place that applies stop strings, counts generated tokens, and decides the finish reason. The
//! whole (JSON) response and the streamed (SSE) one only render its items.

use std::sync::Arc;

use deltafin::{Cancel, LoadedModel, Stats};

use crate::output::{Part, Splitter};
use crate::worker::Event;

/// One thing for the client.
pub enum Item {
    /// The prompt is being processed.
    Started,
    /// A generated token (`id`, its logprob and top alternatives if asked) and the text that
    /// became final with it.
    Token { id: u32, logprob: Option<(f32, Vec<(u32, f32)>)>, parts: Vec<(Part, String)> },
    /// Prompt tokens with their logprobs (`echo` with `logprobs`).
    Prompt(Vec<crate::worker::PromptLogprob>),
    /// Text held back until the end (a possible stop string that was not one).
    Text(Vec<(Part, String)>),
    /// The reply is over: `stop` or `length`, with the engine's stats when it finished itself.
    Finished { reason: &'static str, stats: Option<Box<Stats>> },
    /// The generation failed.
    Failed(String),
}

/// A turn's interpretation of its worker's events.
pub struct TurnEvents {
    split: Splitter,
    cancel: Cancel,
    /// Tokens generated (the last one counted ends a stop string, if one was found).
    pub generated: usize,
    /// Prompt tokens the worker reused.
    pub cached: usize,
    /// Nothing more will come.
    pub done: bool,
}

impl TurnEvents {
    /// `chat`: the prompt opened the assistant's `think` element; `stops`: the request's stop
    /// strings; `cancel` stops the worker once a stop string is found.
    pub fn new(model: Arc<LoadedModel>, chat: bool, stops: Vec<String>, cancel: Cancel) -> TurnEvents {
        TurnEvents { split: Splitter::new(model, chat, stops), cancel, generated: 0, cached: 0, done: false }
    }

    /// The items one worker event gives (`None`: the worker hung up).
    pub fn on_event(&mut self, ev: Option<Event>) -> Vec<Item> {
        if self.done {
            return vec![];
        }
        match ev {
            Some(Event::Started { cached_tokens }) => {
                self.cached = cached_tokens;
                vec![Item::Started]
            }
            Some(Event::Token { id, logprob, top }) => {
                self.generated += 1;
                let parts = self.split.push(id);
                let mut items = vec![Item::Token { id, logprob: logprob.map(|l| (l, top)), parts }];
                if self.split.stopped() {
                    // A stop string: the worker need not go on.
                    self.cancel.cancel();
                    self.done = true;
                    items.push(Item::Finished { reason: "stop", stats: None });
                }
                items
            }
            Some(Event::Done { stats, cached_tokens, hit_stop_id }) => {
                self.cached = cached_tokens;
                self.done = true;
                vec![
                    Item::Text(self.split.finish()),
                    Item::Finished { reason: if hit_stop_id { "stop" } else { "length" }, stats: Some(stats) },
                ]
            }
            Some(Event::PromptLogprobs(items)) => vec![Item::Prompt(items)],
            Some(Event::Failed(msg)) => {
                self.done = true;
                vec![Item::Failed(msg)]
            }
            None => {
                self.done = true;
                vec![Item::Text(self.split.finish()), Item::Finished { reason: "stop", stats: None }]
            }
        }
    }
}
