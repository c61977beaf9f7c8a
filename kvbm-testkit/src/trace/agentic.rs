//! An agentic workload: tool-calling programs among chat traffic, each
//! request knowing when its program calls next.
//!
//! A *program* starts (a Poisson process) with one of a few shared agent
//! system prompts and a task message, and makes a geometric number of
//! calls (at least two). After each call but the last a tool runs for a
//! pause drawn from a log-normal distribution (heavy-tailed: most tools
//! return in seconds, a few take minutes), then the next call's prompt is
//! the previous prompt plus the model's output and the tool's result.
//! Chat traffic from the [`synthetic`](super::synthetic) generator (its own
//! system prompts and block ids) is interleaved by arrival time.
//!
//! Each request carries the truth an agent framework has: the time until
//! its program's next call, or that it was the last call
//! ([`NextCall`]); chat requests carry nothing. [`AgenticTrace::hints`]
//! turns the truth into hints of a given accuracy.
//!
//! Like the synthetic generator, everything is drawn from one seeded
//! SplitMix64 generator with logarithms and exponentials from IEEE basic
//! operations only, so a configuration gives the same trace everywhere.

use super::synthetic::{SplitMix64, portable_ln};
use super::{BlockId, Request, SyntheticConfig, generate_synthetic};

/// What a request knows about its program's next call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextCall {
    /// The next call arrives this many milliseconds after this one.
    After(u64),
    /// This was the program's last call.
    Done,
    /// Nothing is known (chat traffic).
    Unknown,
}

/// Parameters of the agentic workload. [`Default`] gives 300 programs
/// (about 2,300 calls) and 300 chat conversations (about 800 requests),
/// starting over about five minutes.
#[derive(Debug, Clone, PartialEq)]
pub struct AgenticConfig {
    /// Seed of the generator (the chat traffic uses `chat.seed`).
    pub seed: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Programs in the trace.
    pub programs: usize,
    /// Mean calls per program (geometric, at least two).
    pub mean_calls: f64,
    /// Distinct agent system prompts, picked with probability
    /// proportional to `1 / rank`.
    pub system_prompts: usize,
    /// Length of every agent system prompt, in whole blocks.
    pub system_prompt_blocks: u32,
    /// Mean tokens of the task message (uniform in 0.5×..1.5× mean).
    pub task_tokens: u32,
    /// Mean tokens of a tool's result.
    pub tool_result_tokens: u32,
    /// Mean tokens of each model output (the tool call).
    pub output_tokens: u32,
    /// Mean time between program starts (exponential), milliseconds.
    pub mean_program_gap_ms: f64,
    /// Median tool pause, milliseconds (log-normal).
    pub pause_median_ms: f64,
    /// Standard deviation of the pause's logarithm (larger: heavier tail).
    pub pause_sigma: f64,
    /// Longest pause, milliseconds (longer draws are cut to this).
    pub max_pause_ms: f64,
    /// The interleaved chat traffic (`conversations: 0` for none).
    pub chat: SyntheticConfig,
}

impl Default for AgenticConfig {
    fn default() -> Self {
        Self {
            seed: 0x6167_656e,
            block_tokens: super::MOONCAKE_BLOCK_TOKENS,
            programs: 300,
            mean_calls: 8.0,
            system_prompts: 4,
            system_prompt_blocks: 6,
            task_tokens: 2_000,
            tool_result_tokens: 600,
            output_tokens: 150,
            mean_program_gap_ms: 1_000.0,
            pause_median_ms: 8_000.0,
            pause_sigma: 1.2,
            max_pause_ms: 600_000.0,
            chat: SyntheticConfig {
                conversations: 300,
                mean_conversation_gap_ms: 1_000.0,
                ..SyntheticConfig::default()
            },
        }
    }
}

/// The requests of an agentic workload and what each knows.
#[derive(Debug, Clone, PartialEq)]
pub struct AgenticTrace {
    /// The requests, by arrival time.
    pub requests: Vec<Request>,
    /// For each request, its program's next call.
    pub next: Vec<NextCall>,
    /// The pause distribution `(median ms, sigma, max ms)`, for wrong hints.
    pause: (f64, f64, f64),
}

/// A hint an application gives for one request: what it believes of
/// [`NextCall`] (`Unknown`: no hint).
pub type Hint = NextCall;

/// `e^x` from IEEE basic operations only (`|x| <= 700`).
fn portable_exp(x: f64) -> f64 {
    let x = x.clamp(-700.0, 700.0);
    let k = (x / std::f64::consts::LN_2).round();
    let r = x - k * std::f64::consts::LN_2;
    let mut term = 1.0;
    let mut sum = 1.0;
    for n in 1..30 {
        term *= r / n as f64;
        sum += term;
    }
    // 2^k through the exponent bits (k within the normal range).
    let scale = f64::from_bits(((k as i64 + 1023) as u64) << 52);
    sum * scale
}

impl SplitMix64 {
    /// A standard normal draw (Marsaglia's polar method).
    fn normal(&mut self) -> f64 {
        loop {
            let u = 2.0 * self.unit() - 1.0;
            let v = 2.0 * self.unit() - 1.0;
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                return u * (-2.0 * portable_ln(s) / s).sqrt();
            }
        }
    }

    /// A log-normal pause in whole milliseconds (at least 1).
    fn pause(&mut self, (median, sigma, max): (f64, f64, f64)) -> u64 {
        let x = median.max(1.0) * portable_exp(sigma.max(0.0) * self.normal());
        x.clamp(1.0, max.max(1.0)) as u64
    }
}

/// One request of the trace with what it is ordered by: `(timestamp,
/// program, call, request, next)`; chat requests have program
/// `usize::MAX`.
type Entry = (u64, usize, usize, Request, NextCall);

/// Draws the agent programs' calls, handing out fresh block ids.
struct Programs<'a> {
    config: &'a AgenticConfig,
    rng: SplitMix64,
    /// Tokens per block (at least 1).
    bt: u32,
    /// The next unused block id.
    next_id: BlockId,
    /// The agent system prompts' blocks.
    prompts: Vec<Vec<BlockId>>,
    /// The sum of `1 / rank` over the system prompts.
    harmonic: f64,
    /// The chance that a program goes on after a call (past its first).
    p_continue: f64,
    /// The pause distribution `(median ms, sigma, max ms)`.
    pause: (f64, f64, f64),
}

impl<'a> Programs<'a> {
    /// The generator for `config`, its system prompts drawn.
    fn new(config: &'a AgenticConfig) -> Self {
        let mut programs = Programs {
            config,
            rng: SplitMix64(config.seed),
            bt: config.block_tokens.max(1),
            next_id: 0,
            prompts: Vec::new(),
            harmonic: 0.0,
            p_continue: 1.0 - 1.0 / (config.mean_calls - 1.0).max(1.0),
            pause: (
                config.pause_median_ms,
                config.pause_sigma,
                config.max_pause_ms,
            ),
        };
        programs.prompts = (0..config.system_prompts)
            .map(|_| {
                (0..config.system_prompt_blocks)
                    .map(|_| programs.fresh())
                    .collect()
            })
            .collect();
        programs.harmonic = (1..=programs.prompts.len()).map(|r| 1.0 / r as f64).sum();
        programs
    }

    /// A block id not used before.
    fn fresh(&mut self) -> BlockId {
        self.next_id += 1;
        self.next_id - 1
    }

    /// A system prompt's index, picked with probability proportional to
    /// `1 / rank` (the prompts must not be empty).
    fn pick_prompt(&mut self) -> usize {
        let mut pick = self.rng.unit() * self.harmonic;
        let mut chosen = self.prompts.len() - 1;
        for r in 0..self.prompts.len() {
            pick -= 1.0 / (r + 1) as f64;
            if pick <= 0.0 {
                chosen = r;
                break;
            }
        }
        chosen
    }

    /// Adds to `out` every call of program `program`, which starts at
    /// `start` milliseconds.
    fn program(&mut self, program: usize, start: f64, out: &mut Vec<Entry>) {
        let (config, bt) = (self.config, self.bt);
        let mut full: Vec<BlockId> = Vec::new();
        let mut tokens = 0u32;
        if !self.prompts.is_empty() {
            let chosen = self.pick_prompt();
            full.extend_from_slice(&self.prompts[chosen]);
            tokens = config.system_prompt_blocks * bt;
        }
        tokens += self.rng.around(config.task_tokens).max(1);
        let mut at = start as u64;
        let mut call = 0;
        loop {
            let request = self.call(&mut full, tokens, at);
            let output_length = request.output_length;
            // At least two calls, then geometric.
            let last = call > 0 && self.rng.unit() > self.p_continue;
            if last {
                out.push((at, program, call, request, NextCall::Done));
                break;
            }
            let wait = self.rng.pause(self.pause);
            out.push((at, program, call, request, NextCall::After(wait)));
            at += wait;
            call += 1;
            tokens = tokens
                .saturating_add(output_length)
                .saturating_add(self.rng.around(config.tool_result_tokens).max(1));
        }
    }

    /// A call at `at` whose prompt is `tokens` long: `full` (the prompt's
    /// full blocks so far) grows to cover it, and a partial last block
    /// gets an id of its own.
    fn call(&mut self, full: &mut Vec<BlockId>, tokens: u32, at: u64) -> Request {
        let bt = self.bt;
        while (full.len() as u32 + 1) * bt <= tokens {
            full.push(self.fresh());
        }
        let mut hash_ids = full.clone();
        if !tokens.is_multiple_of(bt) {
            hash_ids.push(self.fresh());
        }
        let output_length = self.rng.around(self.config.output_tokens).max(1);
        Request {
            timestamp_ms: at,
            input_length: tokens,
            output_length,
            hash_ids,
        }
    }
}

/// The interleaved chat traffic, its block ids moved up by `offset` (past
/// the agents').
fn chat_entries(config: &AgenticConfig, bt: u32, offset: BlockId) -> Vec<Entry> {
    let chat = generate_synthetic(&SyntheticConfig {
        block_tokens: bt,
        ..config.chat.clone()
    });
    chat.into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            for h in &mut r.hash_ids {
                *h += offset;
            }
            (r.timestamp_ms, usize::MAX, i, r, NextCall::Unknown)
        })
        .collect()
}

/// Generates the workload described by `config`.
pub fn generate_agentic(config: &AgenticConfig) -> AgenticTrace {
    let mut programs = Programs::new(config);
    let mut out: Vec<Entry> = Vec::new();
    let mut start = 0.0;
    for program in 0..config.programs {
        start += programs.rng.exponential(config.mean_program_gap_ms);
        programs.program(program, start, &mut out);
    }
    out.extend(chat_entries(config, programs.bt, programs.next_id));
    out.sort_by_key(|(t, program, call, ..)| (*t, *program, *call));
    let (requests, next) = out.into_iter().map(|(.., r, n)| (r, n)).unzip();
    AgenticTrace {
        requests,
        next,
        pause: programs.pause,
    }
}

impl AgenticTrace {
    /// Hints of accuracy `accuracy` (0 to 1), drawn with `seed`: each
    /// program call's hint is the truth with probability `accuracy`;
    /// otherwise it is wrong — for a call that continues, "done" one time
    /// in three and otherwise a pause drawn afresh from the workload's pause
    /// distribution; for a last call, such a fresh pause. Chat requests get
    /// no hint ([`NextCall::Unknown`]).
    pub fn hints(&self, accuracy: f64, seed: u64) -> Vec<Hint> {
        let mut rng = SplitMix64(seed);
        self.next
            .iter()
            .map(|&truth| {
                if truth == NextCall::Unknown {
                    return NextCall::Unknown;
                }
                if rng.unit() <= accuracy {
                    return truth;
                }
                match truth {
                    NextCall::After(_) if rng.unit() < 1.0 / 3.0 => NextCall::Done,
                    _ => NextCall::After(rng.pause(self.pause)),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_exp_agrees_with_libm() {
        for &x in &[-20.0, -1.0, -0.3, 0.0, 0.5, 1.0, 3.3, 10.0, 50.0] {
            let (a, b) = (portable_exp(x), f64::exp(x));
            assert!((a - b).abs() <= 1e-12 * b, "{x}: {a} vs {b}");
        }
    }

    #[test]
    fn next_calls_tell_the_truth() {
        let t = generate_agentic(&AgenticConfig {
            programs: 40,
            chat: SyntheticConfig {
                conversations: 20,
                ..SyntheticConfig::default()
            },
            ..AgenticConfig::default()
        });
        assert_eq!(t.requests.len(), t.next.len());
        assert!(
            t.requests
                .windows(2)
                .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms)
        );
        let mut checked = 0;
        for (i, (r, n)) in t.requests.iter().zip(&t.next).enumerate() {
            if let NextCall::After(ms) = *n {
                // The next call extends this prompt's full blocks.
                let at = r.timestamp_ms + ms;
                let full = r.input_length / 512;
                let prefix = &r.hash_ids[..full as usize];
                let found = t.requests[i + 1..]
                    .iter()
                    .any(|q| q.timestamp_ms == at && q.hash_ids.starts_with(prefix));
                assert!(found, "request {i}: no call {ms} ms later");
                checked += 1;
            }
        }
        assert!(checked > 100);
        assert_eq!(t.next.iter().filter(|n| **n == NextCall::Done).count(), 40);
        // Accuracy 1 is the truth; accuracy 0 is never the truth.
        assert_eq!(t.hints(1.0, 7), t.next);
        let wrong = t.hints(0.0, 7);
        assert!(
            wrong
                .iter()
                .zip(&t.next)
                .all(|(h, n)| *n == NextCall::Unknown || h != n)
        );
    }
}
