//! numpy's `PCG64` bit generator and the two draws the simulator makes from it
//! (`Generator.random()` and scalar `Generator.integers(n)`), bit for bit.
//!
//! Why not a Rust RNG crate: a run's draws are shared between the engine (decode-instance
//! picks, WAN jitter, patch loss) and the Python schemes that break ties with the run's
//! generator; both must consume one stream, in one order, so that a run is the same whatever
//! side of the boundary a decision lives on. numpy seeds the state (`SeedSequence`); the
//! engine takes it over from `bit_generator.state` and continues it exactly.

/// PCG64's 128-bit LCG multiplier (O'Neill's default, as numpy's `pcg64.h`).
const MULT: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    has_u32: bool,
    u32_buf: u32,
}

impl Pcg64 {
    /// From numpy's `bit_generator.state`: `state["state"]["state"]`, `["inc"]`, `has_uint32`
    /// and `uinteger`.
    pub fn from_state(state: u128, inc: u128, has_u32: bool, u32_buf: u32) -> Self {
        Pcg64 {
            state,
            inc,
            has_u32,
            u32_buf,
        }
    }

    /// The state in numpy's terms, for handing the stream back.
    pub fn state(&self) -> (u128, u128, bool, u32) {
        (self.state, self.inc, self.has_u32, self.u32_buf)
    }

    /// A seeded stream for Rust-only uses (benchmarks, tests).
    pub fn seeded(seed: u64) -> Self {
        let mut g = Pcg64 {
            state: 0,
            inc: ((seed as u128) << 1) | 1,
            has_u32: false,
            u32_buf: 0,
        };
        g.next_u64();
        g.state = g.state.wrapping_add(0xDA3E_39CB_94B9_5BDB ^ seed as u128);
        g.next_u64();
        g
    }

    /// Step, then the XSL-RR output of the new state (`pcg64_random_r`).
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_mul(MULT).wrapping_add(self.inc);
        let s = self.state;
        (((s >> 64) as u64) ^ (s as u64)).rotate_right((s >> 122) as u32)
    }

    /// Half of a 64-bit output, the other half kept for the next call (`pcg64_next32`).
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.has_u32 {
            self.has_u32 = false;
            return self.u32_buf;
        }
        let n = self.next_u64();
        self.has_u32 = true;
        self.u32_buf = (n >> 32) as u32;
        n as u32
    }

    /// `Generator.random()`: 53 random bits in [0, 1).
    #[inline]
    pub fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `Generator.integers(n)` for a scalar int64 draw in `0..n` (numpy's
    /// `random_bounded_uint64_fill` without masking: Lemire's method, 32-bit when the range fits).
    pub fn integers(&mut self, n: u64) -> u64 {
        assert!(n >= 1, "integers(0)");
        let rng = n - 1;
        if rng == 0 {
            return 0;
        }
        if rng <= 0xFFFF_FFFF {
            if rng == 0xFFFF_FFFF {
                return self.next_u32() as u64;
            }
            let excl = rng as u32 + 1;
            let mut m = self.next_u32() as u64 * excl as u64;
            let mut left = m as u32;
            if left < excl {
                let threshold = (u32::MAX - rng as u32) % excl;
                while left < threshold {
                    m = self.next_u32() as u64 * excl as u64;
                    left = m as u32;
                }
            }
            return m >> 32;
        }
        if rng == u64::MAX {
            return self.next_u64();
        }
        let excl = rng + 1;
        let mut m = self.next_u64() as u128 * excl as u128;
        let mut left = m as u64;
        if left < excl {
            let threshold = (u64::MAX - rng) % excl;
            while left < threshold {
                m = self.next_u64() as u128 * excl as u128;
                left = m as u64;
            }
        }
        (m >> 64) as u64
    }
}
