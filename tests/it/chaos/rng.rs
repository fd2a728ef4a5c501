//! A small seeded generator (SplitMix64), so a chaos run is reproducible from
//! its printed seed without another dependency. Each actor derives its own
//! stream from the seed and its identity, so the decisions do not depend on
//! how tasks interleave.

use std::time::Duration;

/// One stream of pseudo-random numbers.
pub struct Rng(u64);

impl Rng {
    /// The stream for `seed` and an actor's identity.
    pub fn derive(seed: u64, stream: u64, index: u64) -> Self {
        let mut rng = Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let _ = rng.next_u64();
        rng.0 ^= index.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let _ = rng.next_u64();
        rng
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform between `low` and `high`.
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        low + (high.saturating_sub(low)).mul_f64(self.unit())
    }
}

/// A seed from `DEDUPE_CHAOS_SEED` (decimal or 0x-hex), else from the clock.
pub fn seed_from_env() -> u64 {
    match std::env::var("DEDUPE_CHAOS_SEED") {
        Ok(text) => {
            let text = text.trim();
            let parsed = match text.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => text.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("DEDUPE_CHAOS_SEED={text} is not a number"))
        }
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_nanos() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::derive(7, 1, 2).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            Rng::derive(7, 1, 2).next_u64(),
            Rng::derive(7, 1, 3).next_u64()
        );
        let mut rng = Rng::derive(7, 0, 0);
        assert!((0..1000).all(|_| rng.below(3) < 3));
    }
}
