//! 64-byte block scanning of JSON strings: bit masks of `"` and `\` per block (SSE2 on x86_64,
//! plain code elsewhere), so a string costs a few instructions per 64 bytes plus a few per escape,
//! instead of one search call per escape.

/// Bit i set where `block[i]` is `"` / `\`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn masks(block: &[u8; 64]) -> (u64, u64) {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of the x86_64 baseline, so these intrinsics are always available; the
    // unaligned 16-byte loads at 16 * k (k < 4) stay inside the 64-byte array.
    unsafe {
        let quote = _mm_set1_epi8(b'"' as i8);
        let backslash = _mm_set1_epi8(b'\\' as i8);
        let (mut q, mut s) = (0u64, 0u64);
        for k in 0..4 {
            let v = _mm_loadu_si128(block.as_ptr().add(16 * k) as *const __m128i);
            q |= (_mm_movemask_epi8(_mm_cmpeq_epi8(v, quote)) as u16 as u64) << (16 * k);
            s |= (_mm_movemask_epi8(_mm_cmpeq_epi8(v, backslash)) as u16 as u64) << (16 * k);
        }
        (q, s)
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn masks(block: &[u8; 64]) -> (u64, u64) {
    let (mut q, mut s) = (0u64, 0u64);
    for (i, &c) in block.iter().enumerate() {
        q |= ((c == b'"') as u64) << i;
        s |= ((c == b'\\') as u64) << i;
    }
    (q, s)
}

/// [`masks`] with two 32-byte compares per mask instead of four 16-byte ones.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn masks_avx2(block: &[u8; 64]) -> (u64, u64) {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi8, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_set1_epi8,
    };
    // SAFETY: the caller guarantees AVX2; the unaligned 32-byte loads at 0 and 32 stay inside
    // the 64-byte array.
    unsafe {
        let quote = _mm256_set1_epi8(b'"' as i8);
        let backslash = _mm256_set1_epi8(b'\\' as i8);
        let lo = _mm256_loadu_si256(block.as_ptr() as *const __m256i);
        let hi = _mm256_loadu_si256(block.as_ptr().add(32) as *const __m256i);
        let bits = |v: __m256i, c: __m256i| _mm256_movemask_epi8(_mm256_cmpeq_epi8(v, c)) as u32;
        let q = bits(lo, quote) as u64 | (bits(hi, quote) as u64) << 32;
        let s = bits(lo, backslash) as u64 | (bits(hi, backslash) as u64) << 32;
        (q, s)
    }
}

/// Masks of the 64 bytes from `at` (bytes past the end count as neither).
#[inline(always)]
fn masks_at(b: &[u8], at: usize, masks: impl Fn(&[u8; 64]) -> (u64, u64)) -> (u64, u64) {
    match b.get(at..at + 64) {
        Some(block) => masks(block.try_into().expect("64 bytes")),
        None => {
            let mut padded = [0u8; 64];
            let rest = b.get(at..).unwrap_or_default();
            padded[..rest.len()].copy_from_slice(rest);
            masks(&padded)
        }
    }
}

/// Positions just after an odd-length run of backslashes (the escaped bytes that are not
/// backslashes themselves), branch-free, as in simdjson's stage 1. `carry` is 1 when the
/// previous block ended inside an odd-length run.
#[inline]
fn odd_backslash_ends(backslashes: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    const ODD: u64 = !EVEN;
    let starts = backslashes & !(backslashes << 1);
    // A run continued from the previous block behaves as if it started on the other parity.
    let even_start_mask = EVEN ^ *carry;
    let even_starts = starts & even_start_mask;
    let odd_starts = starts & !even_start_mask;
    // Adding a run's start bit carries through the run and lands just after it.
    let even_carries = backslashes.wrapping_add(even_starts);
    let (mut odd_carries, overflow) = backslashes.overflowing_add(odd_starts);
    odd_carries |= *carry;
    *carry = overflow as u64;
    let even_carry_ends = even_carries & !backslashes;
    let odd_carry_ends = odd_carries & !backslashes;
    (even_carry_ends & ODD) | (odd_carry_ends & EVEN)
}

/// Index of the quote that closes the string whose content starts at `start`.
///
/// The one scan that cannot stop early (a message whose `content` comes before its `role` is
/// skipped whole), so it uses AVX2 where the CPU has it.
pub(super) fn string_end(b: &[u8], start: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { string_end_avx2(b, start) };
    }
    string_end_with(b, start, masks)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn string_end_avx2(b: &[u8], start: usize) -> Option<usize> {
    // SAFETY: the caller guarantees AVX2.
    string_end_with(b, start, |block| unsafe { masks_avx2(block) })
}

#[inline(always)]
fn string_end_with(
    b: &[u8],
    start: usize,
    masks: impl Fn(&[u8; 64]) -> (u64, u64) + Copy,
) -> Option<usize> {
    let mut at = start;
    let mut carry = 0u64;
    while at < b.len() {
        let (quotes, backslashes) = masks_at(b, at, masks);
        // Most blocks of prose have no backslash: then every quote closes.
        let closing = if backslashes | carry == 0 {
            quotes
        } else {
            quotes & !odd_backslash_ends(backslashes, &mut carry)
        };
        if closing != 0 {
            let p = at + closing.trailing_zeros() as usize;
            return (p < b.len()).then_some(p);
        }
        at += 64;
    }
    None
}

/// Positions of `"` and `\` in order, one block mask at a time.
pub(super) struct Specials<'a> {
    b: &'a [u8],
    block: usize,
    mask: u64,
    loaded: bool,
}

impl<'a> Specials<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Specials {
            b,
            block: 0,
            mask: 0,
            loaded: false,
        }
    }

    fn load(&mut self, at: usize) {
        let (q, s) = masks_at(self.b, at, masks);
        self.block = at;
        self.mask = q | s;
        self.loaded = true;
    }

    /// The first `"` or `\` at or after `from` and before `limit`.
    pub(super) fn find(&mut self, from: usize, limit: usize) -> Option<usize> {
        let limit = limit.min(self.b.len());
        if from >= limit {
            return None;
        }
        if !self.loaded || from < self.block || from >= self.block + 64 {
            self.load(from);
        }
        loop {
            let m = self.mask & (!0u64 << (from.max(self.block) - self.block));
            if m != 0 {
                let p = self.block + m.trailing_zeros() as usize;
                return (p < limit).then_some(p);
            }
            let next = self.block + 64;
            if next >= limit {
                return None;
            }
            self.load(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_end(b: &[u8], start: usize) -> Option<usize> {
        let mut escaped = false;
        for (j, &c) in b.iter().enumerate().skip(start) {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                return Some(j);
            }
        }
        None
    }

    #[test]
    fn string_end_matches_a_byte_by_byte_scan() {
        let alphabet = b"ab\\\"\\\\x";
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [0usize, 1, 2, 63, 64, 65, 127, 128, 129, 300] {
            for _ in 0..300 {
                let b: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        alphabet[(x % alphabet.len() as u64) as usize]
                    })
                    .collect();
                for start in [0, 1, 5, 63, 64].into_iter().filter(|&s| s <= len) {
                    let expected = reference_end(&b, start);
                    let text = String::from_utf8_lossy(&b);
                    // The dispatched scan (AVX2 here when the CPU has it) and the baseline one.
                    assert_eq!(string_end(&b, start), expected, "{text:?} from {start}");
                    assert_eq!(
                        string_end_with(&b, start, masks),
                        expected,
                        "baseline: {text:?} from {start}"
                    );
                }
            }
        }
        let long = format!("{}\\\\\"", "\\\"".repeat(40));
        assert_eq!(string_end(long.as_bytes(), 0), Some(long.len() - 1));
    }

    #[test]
    fn specials_in_order_within_limits() {
        let b = format!("{}\"{}\\{}", "a".repeat(70), "b".repeat(5), "c".repeat(100));
        let b = b.as_bytes();
        let mut s = Specials::new(b);
        assert_eq!(s.find(0, b.len()), Some(70));
        assert_eq!(s.find(71, b.len()), Some(76));
        assert_eq!(s.find(77, b.len()), None);
        assert_eq!(s.find(0, 70), None);
        assert_eq!(s.find(3, 71), Some(70));
        assert_eq!(s.find(b.len(), b.len() + 5), None);
    }
}
