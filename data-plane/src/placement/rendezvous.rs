//! Rendezvous (highest random weight) ranking of a variant's instances for a key: the same on
//! every router replica, and adding or removing one of n instances moves about 1/(n+1) of the
//! keys.

/// The murmur3 64-bit finalizer: a bijective mix.
#[inline]
pub(crate) fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// Rendezvous score of an instance for a key; higher ranks first.
#[inline]
pub fn rendezvous_score(key: u64, id_hash: u64) -> u64 {
    fmix64(key ^ id_hash)
}

/// Ranking order: higher score first, then lower index (a total order, the same on every replica).
#[inline]
fn before(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// The rendezvous top choice and its score. `hashes` must not be empty.
#[inline]
pub fn rendezvous_top(hashes: &[u64], key: u64) -> (usize, u64) {
    let mut best = (rendezvous_score(key, hashes[0]), 0);
    for (i, &h) in hashes.iter().enumerate().skip(1) {
        let s = rendezvous_score(key, h);
        if s > best.0 {
            best = (s, i);
        }
    }
    (best.1, best.0)
}

/// Linear steps before a walk sorts the whole ranking.
const LINEAR_STEPS: usize = 3;
/// Variants up to this size sort their ranking on the stack.
const STACK_RANKING: usize = 64;

/// Iterates a variant's instances in rendezvous order after the top choice: a few O(n) steps
/// (the common spill finds room at once), then a full sort (on the stack up to 64 instances).
pub struct RendezvousWalk<'a> {
    hashes: &'a [u64],
    key: u64,
    last: (u64, usize),
    steps: usize,
    sorted: Sorted,
}

// The stack ranking is the point: no heap allocation for variants of up to 64 instances.
#[allow(clippy::large_enum_variant)]
enum Sorted {
    No,
    Stack {
        ranking: [(u64, u32); STACK_RANKING],
        len: usize,
        pos: usize,
    },
    Heap {
        ranking: Vec<(u64, u32)>,
        pos: usize,
    },
}

/// Every instance in `key`'s rendezvous order, top choice first.
pub fn ranking(hashes: &[u64], key: u64) -> impl Iterator<Item = usize> + '_ {
    (!hashes.is_empty())
        .then(|| {
            let (top, score) = rendezvous_top(hashes, key);
            std::iter::once(top).chain(RendezvousWalk::new(hashes, key, top, score))
        })
        .into_iter()
        .flatten()
}

impl<'a> RendezvousWalk<'a> {
    pub fn new(hashes: &'a [u64], key: u64, top: usize, top_score: u64) -> Self {
        RendezvousWalk {
            hashes,
            key,
            last: (top_score, top),
            steps: 1,
            sorted: Sorted::No,
        }
    }

    fn sort(&mut self) {
        let n = self.hashes.len();
        let fill = |ranking: &mut [(u64, u32)]| {
            for (i, slot) in ranking.iter_mut().enumerate() {
                *slot = (rendezvous_score(self.key, self.hashes[i]), i as u32);
            }
            ranking.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        };
        self.sorted = if n <= STACK_RANKING {
            let mut ranking = [(0u64, 0u32); STACK_RANKING];
            fill(&mut ranking[..n]);
            Sorted::Stack {
                ranking,
                len: n,
                pos: self.steps,
            }
        } else {
            let mut ranking = vec![(0u64, 0u32); n];
            fill(&mut ranking);
            Sorted::Heap {
                ranking,
                pos: self.steps,
            }
        };
    }
}

impl Iterator for RendezvousWalk<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.steps >= self.hashes.len() {
            return None;
        }
        if self.steps < LINEAR_STEPS {
            let mut best: Option<(u64, usize)> = None;
            for (i, &h) in self.hashes.iter().enumerate() {
                let c = (rendezvous_score(self.key, h), i);
                if before(self.last, c) && best.is_none_or(|b| before(c, b)) {
                    best = Some(c);
                }
            }
            let best = best?;
            self.last = best;
            self.steps += 1;
            return Some(best.1);
        }
        if matches!(self.sorted, Sorted::No) {
            self.sort();
        }
        self.steps += 1;
        match &mut self.sorted {
            Sorted::Stack { ranking, len, pos } => {
                let r = ranking[..*len].get(*pos)?;
                *pos += 1;
                Some(r.1 as usize)
            }
            Sorted::Heap { ranking, pos } => {
                let r = ranking.get(*pos)?;
                *pos += 1;
                Some(r.1 as usize)
            }
            Sorted::No => None,
        }
    }
}
