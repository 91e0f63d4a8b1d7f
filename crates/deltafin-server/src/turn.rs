//! What a turn's worker events mean for its client, whatever the response's shape: the one
//! place that applies stop strings, counts generated tokens, and decides the finish reason. The
//! whole (JSON) response and the streamed (SSE) one only render its items.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use deltafin::{LoadedModel, Stats};

use crate::output::{Part, Splitter};
use crate::worker::Event;

/// One thing for the client.
pub enum Item {
    /// The prompt is being processed.
    Started,
    /// A generated token (`id`, its logprob and top alternatives if asked) and the text that
    /// became final with it.
    Token { id: u32, logprob: Option<(f32, Vec<(u32, f32)>)>, parts: Vec<(Part, String)>, tools: Vec<deltafin::ToolEvent> },
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
    stop: Arc<AtomicBool>,
    /// A stop string ended the reply; the worker's last events are awaited for its stats.
    stopping: bool,
    /// Tokens generated (the last one counted ends a stop string, if one was found).
    pub generated: usize,
    /// Prompt tokens the worker reused.
    pub cached: usize,
    /// Nothing more will come.
    pub done: bool,
}

impl TurnEvents {
    /// `chat`: the prompt opened the assistant's `think` element; `stops`: the request's stop
    /// strings; `stop` tells the worker to end after its current token once one is found.
    pub fn new(
        model: Arc<LoadedModel>,
        chat: bool,
        stops: Vec<String>,
        stop: Arc<AtomicBool>,
        tools: Option<Option<Vec<u32>>>,
        structured: bool,
    ) -> TurnEvents {
        TurnEvents {
            split: Splitter::new(model, chat, stops, tools, structured),
            stop,
            stopping: false,
            generated: 0,
            cached: 0,
            done: false,
        }
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
            // Tokens the worker made before it saw the stop are not the client's.
            Some(Event::Token { .. }) if self.stopping => vec![],
            Some(Event::Token { id, logprob, top }) => {
                self.generated += 1;
                let parts = self.split.push(id);
                if self.split.stopped() {
                    // A stop string: the worker ends after this token and reports its stats.
                    self.stop.store(true, Ordering::Release);
                    self.stopping = true;
                }
                let tools = self.split.take_tool_events();
                vec![Item::Token { id, logprob: logprob.map(|l| (l, top)), parts, tools }]
            }
            Some(Event::Done { stats, cached_tokens, hit_stop_id }) => {
                self.cached = cached_tokens;
                self.done = true;
                let reason = match (hit_stop_id || self.stopping, self.split.called_tools()) {
                    (true, true) => "tool_calls",
                    (true, false) => "stop",
                    _ => "length",
                };
                vec![Item::Text(self.split.finish()), Item::Finished { reason, stats: Some(stats) }]
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
