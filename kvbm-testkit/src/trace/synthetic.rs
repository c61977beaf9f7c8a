//! A deterministic synthetic multi-turn chat workload.
//!
//! Conversations start as a Poisson process. Each opens with one of a few
//! shared system prompts (whole blocks, shared by every conversation that
//! picks it) followed by a user message; each later turn's prompt is the
//! previous prompt plus the model's answer plus a new user message, after
//! an exponentially distributed think time. Block ids follow kvbm's
//! chaining rule: the full blocks of a prefix keep their ids from turn to
//! turn, while a partially filled last block gets a fresh id every time
//! (its tokens change as the conversation grows).
//!
//! Everything is drawn from one seeded SplitMix64 generator written here,
//! and logarithms use IEEE basic operations only, so the same configuration
//! yields the same trace on every platform and every dependency version.

use super::{BlockId, Request};

/// Parameters of the synthetic workload. [`Default`] is small: 1,604
/// requests over 6.5 minutes, 19,694 block references, 6,058 unique blocks
/// (69% hit rate with an infinite cache); it replays in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// Seed of the generator; equal configurations give equal traces.
    pub seed: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Conversations in the trace.
    pub conversations: usize,
    /// Mean turns per conversation (geometric, at least one).
    pub mean_turns: f64,
    /// Distinct shared system prompts; conversations pick one with
    /// probability proportional to `1 / rank` (a few are popular).
    pub system_prompts: usize,
    /// Length of every system prompt, in whole blocks.
    pub system_prompt_blocks: u32,
    /// Mean tokens of the first user message (uniform in 0.5×..1.5× mean).
    pub first_message_tokens: u32,
    /// Mean tokens of each later user message.
    pub followup_message_tokens: u32,
    /// Mean tokens of each answer.
    pub output_tokens: u32,
    /// Mean time between conversation starts (exponential), milliseconds.
    pub mean_conversation_gap_ms: f64,
    /// Mean time between turns of one conversation (exponential), ms.
    pub mean_think_time_ms: f64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            seed: 0x6b76_626d,
            block_tokens: super::MOONCAKE_BLOCK_TOKENS,
            conversations: 600,
            mean_turns: 2.5,
            system_prompts: 16,
            system_prompt_blocks: 4,
            first_message_tokens: 3_000,
            followup_message_tokens: 300,
            output_tokens: 300,
            mean_conversation_gap_ms: 250.0,
            mean_think_time_ms: 20_000.0,
        }
    }
}

/// SplitMix64: tiny, fast, and fixed forever.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub(crate) fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    pub(crate) fn exponential(&mut self, mean: f64) -> f64 {
        -mean.max(0.0) * portable_ln(self.unit())
    }

    /// Uniform integer in `[mean / 2, 3 * mean / 2]`.
    pub(crate) fn around(&mut self, mean: u32) -> u32 {
        let lo = mean / 2;
        let span = u64::from(mean) + 1;
        lo + (self.next_u64() % span) as u32
    }
}

/// Natural logarithm of `x > 0` from IEEE basic operations only, so the
/// result does not depend on the platform's libm (whose `ln` may differ in
/// the last bit and shift a truncated timestamp).
pub(crate) fn portable_ln(x: f64) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return f64::NEG_INFINITY;
    }
    // x = m * 2^e with m in [1, 2); the inputs here are normal numbers.
    let bits = x.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    // ln m = 2 atanh(z), z = (m - 1) / (m + 1) in [0, 1/3).
    let z = (m - 1.0) / (m + 1.0);
    let z2 = z * z;
    let mut term = z;
    let mut sum = 0.0;
    for k in 0..24 {
        sum += term / (2 * k + 1) as f64;
        term *= z2;
    }
    e as f64 * std::f64::consts::LN_2 + 2.0 * sum
}

/// Generates the workload described by `config`, sorted by arrival time.
pub fn generate_synthetic(config: &SyntheticConfig) -> Vec<Request> {
    let mut rng = SplitMix64(config.seed);
    let block_tokens = config.block_tokens.max(1);
    let mut next_id: BlockId = 0;
    let mut fresh = || {
        next_id += 1;
        next_id - 1
    };

    let prompt_blocks = config.system_prompt_blocks as usize;
    let system_prompts: Vec<Vec<BlockId>> = (0..config.system_prompts)
        .map(|_| (0..prompt_blocks).map(|_| fresh()).collect())
        .collect();
    let harmonic: f64 = (1..=system_prompts.len()).map(|r| 1.0 / r as f64).sum();
    // Probability that a conversation goes on after a turn, for the mean.
    let p_continue = 1.0 - 1.0 / config.mean_turns.max(1.0);

    // (timestamp, conversation, turn, request)
    let mut out: Vec<(u64, usize, usize, Request)> = Vec::new();
    let mut start = 0.0;
    for conv in 0..config.conversations {
        start += rng.exponential(config.mean_conversation_gap_ms);
        let mut full: Vec<BlockId> = Vec::new();
        let mut tokens: u32 = 0;
        if !system_prompts.is_empty() {
            let mut pick = rng.unit() * harmonic;
            let mut chosen = system_prompts.len() - 1;
            for r in 0..system_prompts.len() {
                pick -= 1.0 / (r + 1) as f64;
                if pick <= 0.0 {
                    chosen = r;
                    break;
                }
            }
            full.extend_from_slice(&system_prompts[chosen]);
            tokens = config.system_prompt_blocks * block_tokens;
        }
        tokens += rng.around(config.first_message_tokens).max(1);
        let mut at = start;
        let mut turn = 0;
        loop {
            while (full.len() as u32 + 1) * block_tokens <= tokens {
                full.push(fresh());
            }
            let mut hash_ids = full.clone();
            if !tokens.is_multiple_of(block_tokens) {
                hash_ids.push(fresh());
            }
            let output_length = rng.around(config.output_tokens).max(1);
            out.push((
                at as u64,
                conv,
                turn,
                Request {
                    timestamp_ms: at as u64,
                    input_length: tokens,
                    output_length,
                    hash_ids,
                },
            ));
            if rng.unit() > p_continue {
                break;
            }
            turn += 1;
            at += rng.exponential(config.mean_think_time_ms);
            tokens = tokens
                .saturating_add(output_length)
                .saturating_add(rng.around(config.followup_message_tokens).max(1));
        }
    }
    out.sort_by_key(|(t, conv, turn, _)| (*t, *conv, *turn));
    out.into_iter().map(|(.., r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::portable_ln;

    #[test]
    fn portable_ln_agrees_with_libm() {
        for &x in &[1e-12, 1e-3, 0.1, 0.5, 0.999, 1.0, 1.5, 2.0, 3.7, 1e6] {
            let (a, b) = (portable_ln(x), x.ln());
            assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{x}: {a} vs {b}");
        }
    }
}
