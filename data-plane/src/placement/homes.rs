//! Homes: where a variant's reused keys live, chosen by occupancy (the prefill and queueing
//! terms of the objective, see [`crate::placement`]).
//!
//! Rendezvous hashing places each key by its own hash, blind to what else an instance holds.
//! With few popular prefixes that is luck: 8 documents on 4 instances leave some instance with
//! none, or one with four, more often than not, and where caches hold 3 documents the crowded
//! instance thrashes while another idles. The peers avoid it by sending a new prefix to the
//! emptiest cache; a router that does so from its own history alone disagrees with its
//! replicas, and with small caches every disagreement is a copy.
//!
//! So once per half-window (and twice early, see [`Tuning::home_early`]) the keys this router
//! placed often ([`crate::load::Homes`]' candidates with at least [`Tuning::home_min_requests`]
//! requests in the window and `share * n >= home_share`) are counted onto instances in one
//! pass, each where it goes: a hot key spread over replicas takes room on each of them; any other
//! stays on its top choice unless that instance already holds more than `home_slack` times the
//! mean number of reused keys per instance (at least one) more than the emptiest of the key's
//! first [`Tuning::home_choices`] instances: then that one is the key's home. Keys count alike
//! (documents of a workload are of a size) and are taken in hash order, so the pass depends
//! only on the set of reused keys. Replicas that see samples of the same traffic estimate shares
//! differently, and where the bar falls among keys of nearly equal share their sets differ by a
//! few keys (57-69 of engine-sim's long-context documents through 4 routers), and every key
//! counted after one of those may take another instance. So each router reports the keys its
//! own pass found, the control plane passes on to each the union of the others'
//! (`control-plane`'s `discovery`, at most once a second), and the pass counts that union with
//! its own keys. A key keeps a home while its home holds no more keys than its top choice
//! (moving back would be a move too); but a router that shares its keys with others keeps only
//! the homes of a pass that counted about today's keys ([`Tuning::home_settled_share`]): the
//! homes its first passes drew among 3-24 keys say nothing of where a key belongs among 60-70,
//! and each router drew its own. Through 4 routers on engine-sim's long-context fleet (80
//! documents, 7 caches of 17), seeds 1-3 twice, hit 97.7-99.1% (mean 98.25%), shares within
//! 0.98 points, against 93.8-98.3% (mean 96.78%) and up to 3.65 points before; the union with
//! every home kept, 97.53%; with none kept, 98.42% but, alone, one router's shares 3.6 points
//! apart (the pass then moved keys whenever the set changed). Request rates are left to the
//! rules below (hot replicas, re-weighing of keys without a home); where hashing is even
//! enough no key gets a home.
//!
//! What the counting takes for room is checked against the engines: an instance whose cache
//! overflows (the revisits of reused keys miss, [`crate::feedback::InstanceCache`]; a rarely
//! used key evicted by age between its requests says nothing of room for the reused ones) while
//! it holds k of the reused keys shows that its cache holds fewer, about k times the share of
//! its revisits that hit, and from then on no pass gives an instance more ([`learn_capacity`];
//! never less than an even spread of the keys; k - 1, one step at a time, left 4 routers
//! disagreeing for most of a minute while each took its steps): a key whose first
//! choices are full goes to the first instance of its ranking with room (consistent hashing
//! with bounded loads, the bound being the measured one). Copies take only the room left once every
//! reused key has its one place (the bound times the instances, less the keys), hottest keys
//! first, each all its copies or none: a hot key left without gets one instance, as its home. (All
//! or nothing for the whole set, as it was, left the instance with the hottest of 8 documents at
//! 0.38 of the requests where caches held 5 of them; see the test
//! `the_room_left_once_every_document_has_a_place_spreads_the_hottest`.) A router runs the
//! pass as soon as its revisits to one instance show an overflow
//! ([`crate::feedback::Feedback::take_pass_due`]), not only once per half-window, and while a
//! bound is known a home is not kept out of habit: the pass is then a function of the reused
//! keys and the bound alone, which replicas share. On 4 llama-servers whose caches held 2 of 8
//! documents, counting alone gave 3/1/3/2 and the two with 3 thrashed (hit 84%); with the
//! bound, 2/2/2/2 and 93.8% (the workload's ceiling 94.1%).
//!
//! A hot key's copies wait for the engines too. A router's first pass has no report from them
//! yet: it gives a hot key only as many places as its load needs ([`Tuning::least_replicas`]),
//! not the many its share asks for ([`Tuning::replicas`]), and a cache that overflows even so is
//! a bound by the next pass (which copies then respect). With copies by share at once, 4
//! routers on llama-servers whose caches held 2 of 8 documents each gave every instance 6-7 of
//! them, and the caches thrashed for the 17-21 s it took each router to see its own evidence.
//! (Waiting for a pass whose reports showed no overflow at all left engine-sim's long-context
//! fleet, where some instance's few revisits since a pass always miss a little, without copies:
//! one instance 3.6 points over its share.)
//!
//! Nor does a pass spread copies by share on the premise that there is room: while no bound is
//! known and the engines report, copies may give an instance at most one key more than an even
//! spread of the reused keys (the probe, [`crate::load::Homes::probing`], a pass every 64
//! requests), until an instance that held more than the even spread shows room (its revisits
//! missed at most half the limit); then copies go by share, and a cache that overflows even so
//! is a bound. A bound forgotten resumes the probe at the level it stood. And an overflow at an
//! even spread or less (which bounds the caches to the even spread, below) counts only once the
//! set of reused keys has settled (the last pass counted 90% of them: what an instance held of
//! the first few keys says nothing of an even spread of many) and its revisits miss clearly,
//! more than 1.5 times the limit. On engine-sim's long-context shape (80 documents, 7 caches of
//! 15, `cold_documents_evicted_by_age_teach_no_bound`) copies by share at once and marginal
//! overflows taught 5 of 12 seeds a bound their caches did not have, and the hot documents lost
//! their replicas; so, 1 of 12.
//!
//! A bound is an estimate from one sample of misses, and it is checked as the first one was: an
//! instance the pass fills to the bound (more than an even spread) whose revisits miss more than
//! the half of the limit that shows room (`room_shown`) overflows it, and the bound falls to
//! what its revisits show it holds. (One llama-server whose revisits missed 46% while it held 7
//! of 8 documents set a bound of 3 where caches held 2; the instance given 3 then missed 12-15%
//! of its revisits, under the limit, for the rest of the run: one router's hit 90% against the
//! workload's ceiling of 94.1%; `a_bound_whose_instances_miss_at_it_falls`.)
//!
//! Routers share what they learnt: each reports the bound it learnt from its own revisits on
//! its watch stream, the control plane passes on to each router the least one per variant of
//! the other routers' (`control-plane`'s `discovery`), and a router with no bound of its own
//! takes it at its next pass ([`learn_capacity`]), unless its own revisits since the last pass
//! showed room above it (an instance that held more keys missed no more than the half of the
//! limit that shows room); a router whose own bound is above it takes it whatever room it saw,
//! since overflows combine by their least (one router that kept a bound of 4 learnt from copies
//! that missed, while three placed at 2, left 4 routers at 89.9% against the ceiling's 94.1%
//! before llama-servers whose caches held 2 of 8 documents). A bound taken is not reported
//! back, so the fleet's bound goes once no router's own evidence holds it. Alone, each of 4
//! routers that see a quarter of the traffic learnt the bound from a quarter of the revisits,
//! and they placed apart meanwhile: before 4 llama-servers whose
//! caches held 2 of 8 documents the last learnt it 5 s after the first and the fleet took 20-40 s
//! to settle; in the placement simulation, the last learnt it 60-390 requests after the first
//! (`four_routers_that_share_their_learnt_bounds_agree_as_soon_as_one_has_learnt`). Nor does
//! the first router wait for a verdict from its own quarter of the revisits: each reports its
//! revisits of reused keys and their misses per instance, and each takes the others' into the
//! sample its pass judges a cache on ([`crate::feedback::InstanceCache::take_fleet_evidence`];
//! an overflow seen so, clearly past the limit, runs the pass at once). Before 4 llama-servers
//! whose caches held 2 of 8 documents, 4 routers hit 90.4% 10-20 s into a run (the mean of the
//! six cells) against 86.9% for the build before, run in turn; in the placement
//! simulation 3 or 4 of the 4 routers learnt the bound themselves in 14 of 16 runs against 6
//! (`four_routers_that_share_their_revisits_judge_each_cache_on_the_whole_fleets`). Each
//! router's first pass, at its own 64th request, is most of the wait left.
//!
//! Under a bound, only the keys a pass gave room for their copies are spread between passes: a
//! key the pass counted as not hot (or did not count) that this router's estimate later calls
//! hot stays in its one place, as it does on the routers whose estimates did not move (4 routers
//! on llama-servers whose caches held 2 of 8 documents spread such keys, each its own, and every
//! copy evicted a document another router had placed).
//!
//! Nor, under a bound, does any rule move a key the last pass counted: re-weighing and warm
//! moves act on the other keys only (on 4 llama-servers whose caches held 2 of 8 documents,
//! they moved counted keys whenever their gates reopened, 60 s into a run, and hit fell from
//! 94% to 86-91% for 10-20 s; `under_a_bound_the_keys_a_pass_counted_stay_where_it_counted_them`).
//!
//! A home is not a copy: the key leaves its top choice for the home, once. Its revisits there
//! are held to the engines' reports like plain hashing's (until a bound is known, relief moves
//! keys off a home whose cache still overflows).

use std::collections::HashMap;

use super::rendezvous::{rendezvous_top, RendezvousWalk};
use super::Tuning;
use crate::feedback::Rule;
use crate::load::{now_ms, Home};
use crate::table::Variant;

/// Assigns homes to the variant's reused keys (see the module doc).
pub(super) fn assign_homes(v: &Variant, t: &Tuning) {
    let load = v.load();
    let homes = load.homes();
    let hashes = v.id_hashes();
    let n = hashes.len();
    let e = load.epoch();
    let total = load.recent(e);
    if n < 2 || total <= 0.0 {
        homes.store(Vec::new());
        homes.store_reused(Vec::new());
        homes.store_own_reused(Vec::new());
        homes.store_copied(Vec::new());
        return;
    }
    let rates = load.key_rates();
    let previous: HashMap<u64, Home> = homes.assignment().iter().map(|h| (h.key, *h)).collect();
    let mut keys: Vec<(f64, u64)> = homes
        .candidates()
        .filter_map(|k| {
            let count = rates.value(k, e);
            let s = (count / total).min(1.0);
            // a key with a home keeps it down to half the thresholds (an estimate near them
            // would otherwise move the key at every pass)
            let bar = if previous.contains_key(&k) { 0.5 } else { 1.0 };
            (count >= t.home_min_requests * bar && s * n as f64 >= t.home_share * bar)
                .then_some((s, k))
        })
        .collect();
    // In key order: the pass is then a function of the set of reused keys alone (the routers'
    // share estimates differ).
    keys.sort_unstable_by_key(|&(_, k)| k);
    keys.dedup_by_key(|&mut (_, k)| k);
    // The keys the other routers' passes found (see the module doc) count too: each router's
    // own set is what it found over its bar, and the bar falls among keys of nearly equal share,
    // so the sets of replicas that see samples of the same traffic differ by a few keys.
    homes.store_own_reused(keys.iter().map(|&(_, k)| k).collect());
    let fleet = homes.fleet_reused();
    if !fleet.is_empty() {
        let share = |k: u64| (rates.value(k, e) / total).min(1.0);
        keys.extend(fleet.iter().map(|&k| (share(k), k)));
        keys.sort_unstable_by_key(|&(_, k)| k);
        keys.dedup_by_key(|&mut (_, k)| k);
    }
    // A router alone keeps its homes (below); one that shares its reused keys with others keeps
    // only those of a pass that counted about today's keys (see the module doc).
    let keep = fleet.is_empty() || settled(homes, keys.len(), t);
    let (cap, probe) = learn_capacity(v, keys.len(), t);
    let room = |held: &[u32], i: usize| cap.is_none_or(|c| held[i] < c);
    // what copies may fill: the bound, else the probe's level
    let copy_cap = cap.or(probe);
    let copy_room = |held: &[u32], i: usize| copy_cap.is_none_or(|c| held[i] < c);
    let spread = homes.spreads() && load.feedback().allows(Rule::HotReplica, now_ms());
    let replicas = |s: f64| {
        if spread {
            t.replicas(s, n)
        } else {
            t.least_replicas(s, n)
        }
    };
    // Which hot keys get their copies. With a bound, every key first gets its one place and
    // the copies only the room left (the bound times the instances, less one place per key),
    // hottest keys first, each all its copies or none (placement spreads a hot key without a
    // home over all of them): where the caches hold every key once and some again, the
    // hottest keys' load still spreads.
    let wanted: Vec<usize> = keys.iter().map(|&(s, _)| replicas(s)).collect();
    let mut copies = vec![true; keys.len()];
    if let Some(c) = copy_cap {
        let mut spare = (c as usize * n).saturating_sub(keys.len());
        let mut hottest: Vec<usize> = (0..keys.len()).filter(|&i| wanted[i] > 1).collect();
        hottest.sort_unstable_by(|&a, &b| {
            keys[b]
                .0
                .total_cmp(&keys[a].0)
                .then(keys[a].1.cmp(&keys[b].1))
        });
        for i in hottest {
            copies[i] = wanted[i] - 1 <= spare;
            if copies[i] {
                spare -= wanted[i] - 1;
            }
        }
    }
    let mut held = vec![0u32; n];
    let slack = (t.home_slack * keys.len() as f64 / n as f64).max(1.0);
    let mut out = Vec::new();
    let mut copied = Vec::new();
    let mut first = Vec::with_capacity(t.home_choices.max(1));
    for (i, &(_, key)) in keys.iter().enumerate() {
        let r = wanted[i];
        let (top, score) = rendezvous_top(hashes, key);
        let mut walk = RendezvousWalk::new(hashes, key, top, score);
        let home = |index: usize| Home {
            key,
            index: index as u32,
            id_hash: hashes[index],
        };
        if r > 1 && copies[i] {
            first.clear();
            first.push(top);
            first.extend(RendezvousWalk::new(hashes, key, top, score).take(r - 1));
            if first.iter().all(|&j| copy_room(&held, j)) {
                // spread over replicas: it takes room in each
                first.iter().for_each(|&i| held[i] += 1);
                copied.push(key);
                continue;
            }
        }
        // A hot key whose copies have no room is placed as any other key (a router's estimate
        // of which keys are hot is its own; where it placed them apart from the others, routers
        // whose estimates differed disagreed), and gets a home even on its top choice, so that
        // placement does not spread it.
        let pin = r > 1;
        // A home is kept while it is no more crowded than the top choice (moving back would
        // be a move too), unless the caches are known to be full: the pass is then a function
        // of the reused keys and the bound alone, as replicas must agree where each
        // disagreement is an eviction.
        if cap.is_none() && keep {
            if let Some(h) = previous.get(&key).and_then(|h| h.locate(hashes)) {
                if h != top && held[h] <= held[top] {
                    held[h] += 1;
                    out.push(home(h));
                    continue;
                }
            }
        }
        let mut best = top;
        for i in walk.by_ref().take(t.home_choices.saturating_sub(1)) {
            if held[i] < held[best] {
                best = i;
            }
        }
        if room(&held, top) && held[top] as f64 <= held[best] as f64 + slack {
            held[top] += 1;
            if pin {
                out.push(home(top));
            }
            continue;
        }
        // the emptiest of its first choices, else (all of them full) the first instance of
        // its ranking with room: consistent hashing with bounded loads, the bound being what
        // the engines showed their caches hold
        let to = if room(&held, best) {
            best
        } else {
            walk.find(|&i| room(&held, i)).unwrap_or(best)
        };
        held[to] += 1;
        if to != top || pin {
            out.push(home(to));
        }
    }
    out.sort_unstable_by_key(|h| h.key);
    tracing::debug!(
        variant = v.name(),
        reused = keys.len(),
        homes = out.len(),
        ?held,
        ?cap,
        ?probe,
        spread,
        "homes assigned"
    );
    homes.store_held(hashes.iter().copied().zip(held).collect());
    homes.store_reused(keys.iter().map(|&(_, k)| k).collect());
    homes.store_copied(copied);
    homes.store(out);
}

/// The last pass counted about today's `reused` keys ([`Tuning::home_settled_share`] of them).
fn settled(homes: &crate::load::Homes, reused: usize, t: &Tuning) -> bool {
    homes.reused_count() as f64 >= t.home_settled_share * reused as f64
}

/// The most reused keys a pass may give one instance (`None`: no bound), from what the engines'
/// reports said since the last pass. An instance whose cache overflows (the revisits of reused
/// keys since the last verdict miss, see [`crate::feedback::InstanceCache::take_miss_rate`]; its
/// gate's windows count every revisit, and misses of cold keys evicted by age closed it on
/// engine-sim's long-context fleet, whose caches had room for every reused key) while holding
/// k of the keys the last pass counted, more than an even spread of the `reused` keys over the
/// instances, shows that its cache holds fewer than k: about k times the share of its revisits
/// that hit (an LRU cache of c among k keys used alike hits about c / k), at least the even
/// spread and at most k - 1, at once. (At k - 1, stepping down once per overflow seen, 4
/// routers on llama-servers with small caches, document as the system message, reached
/// 75.4-88.8% hit against 91.1-94.0% so: the first overflows a router sees are of the early
/// passes' copies, 7 keys where 2 fit, and each step waited for its own evidence; their
/// revisits miss 60-70%, so the estimate is 2 at once. The even spread at once confined
/// engine-sim's long-context fleet, an instance at 14 of 62 keys missing 21%, to 9 each, and
/// the hot keys lost their replicas.) An instance that overflows at an even spread or less
/// bounds the pass to the even spread: counting cannot give it fewer keys, but it shows that the
/// caches have no room for copies, whoever placed what fills it. (Where routers disagree, an
/// engine holds more than any one router counted onto it: on 4 routers before 4 llama-servers
/// whose caches held 2 of 8 documents, routers whose overflowing instances held 2 by their own
/// count learnt no bound for 20-40 s, and one spread every hot document over every instance,
/// 5-7 documents each, in the meantime.) Relief stands down while a bound is known. After
/// [`Tuning::home_probe_passes`] passes with no overflow the bound rises by one, and is forgotten
/// once no instance reaches it. Copies' revisits count too, but only after the variant's
/// revisits missed following a pass that spread copies (see
/// [`crate::feedback::InstanceCache::take_copy_miss_rate`]).
pub(super) fn learn_capacity(v: &Variant, reused: usize, t: &Tuning) -> (Option<u32>, Option<u32>) {
    let homes = v.load().homes();
    let hashes = v.id_hashes();
    let even = reused.div_ceil(hashes.len()).max(1) as u32;
    let last = homes.held();
    // stored in instance order: where the instances are those of the last pass, at their index
    let held_at = |i: usize, h: u64| {
        last.get(i)
            .filter(|x| x.0 == h)
            .or_else(|| last.iter().find(|x| x.0 == h))
            .map_or(0, |x| x.1)
    };
    let before = homes.capacity();
    let mut cap = before;
    let mut overflowed = false;
    // The last pass counted about today's reused keys: only then does an overflow at an even
    // spread or less say the caches hold no more than an even spread (what an instance held of
    // the first few keys says nothing of an even spread of many).
    let settled = settled(homes, reused, t);
    // an instance that held more than an even spread while its revisits missed no more than
    // this shows room
    let room_line = t.feedback.miss_limit / 2.0;
    let mut room_shown = false;
    // the most keys an instance held while its revisits missed no more than the room line
    let mut roomy = 0;
    // A pass that spread copies (its instances held more keys than there are, a copy counting
    // as a key on each of its instances), after which the variant's revisits missed whatever
    // placed them: the copies' own revisits also say how many keys each cache holds (see
    // [`crate::feedback::InstanceCache::take_copy_miss_rate`]).
    let copies_overflowed = homes.take_closings(v.load().feedback().variant().closings())
        && last.iter().map(|x| x.1 as usize).sum::<usize>() > reused;
    for (i, instance) in v.instances().iter().enumerate() {
        let cache = instance.state().cache();
        let plain = cache.take_miss_rate();
        let copies = cache.take_copy_miss_rate().filter(|_| copies_overflowed);
        tracing::debug!(
            variant = v.name(),
            instance = i,
            ?plain,
            ?copies,
            k = held_at(i, hashes[i]),
            even,
            "revisits since the last pass"
        );
        let k = held_at(i, hashes[i]);
        room_shown |= k > even && plain.is_some_and(|m| m <= room_line);
        if plain.is_some_and(|m| m <= room_line) {
            roomy = roomy.max(k);
        }
        let Some(missed) = plain
            .into_iter()
            .chain(copies)
            .reduce(f64::max)
            .filter(|&m| match k > even {
                // at the bound, the line between room and none is the one `room_shown` draws
                true if before.is_some_and(|c| k >= c) => m > room_line,
                true => m > t.feedback.miss_limit,
                false => settled && m > t.feedback.miss_limit * t.home_even_overflow,
            })
        else {
            continue;
        };
        overflowed = true;
        // the cache holds about k * (1 - missed) (see above); one that overflows at an even
        // spread or less is bounded to the even spread: counting cannot give it fewer, but
        // copies would only add to what already does not fit
        let holds = match k > even {
            true => ((f64::from(k) * (1.0 - missed)).floor() as u32).clamp(even, k - 1),
            false => even,
        };
        cap = Some(cap.map_or(holds, |c| c.min(holds)));
    }
    // The fleet's bound (the least one the other routers on this control plane learnt from
    // their own revisits, see `crate::watch`): a router that has none takes it, unless its own
    // revisits showed room above it (an instance that held more keys missed no more than the
    // room line). Each of 4 routers that see a quarter of the traffic learns from a quarter of
    // the revisits; alone, they took 9-15 s to learn a bound on 4 llama-servers, and placed
    // apart until then. A router whose bound is above the fleet's takes the fleet's whatever
    // room it saw: the fleet's is an overflow seen on some instance, and overflows combine by
    // their least, as one router's own instances' do (room on one instance is no answer to an
    // overflow on another). A router that kept a bound of 4 learnt from copies that missed,
    // while the other three placed at 2, gave two instances a third document each on 4
    // llama-servers whose caches held 2 of 8, and the fleet hit 89.9% against the ceiling's
    // 94.1% (`a_router_whose_bound_is_above_the_fleets_takes_the_fleets`).
    let mut adopted = homes.adopted() && !overflowed && cap.is_some();
    let mut taken = false;
    if let Some(b) = homes.fleet_bound() {
        let take = match cap {
            None => roomy <= b,
            Some(c) => b < c,
        };
        if take {
            tracing::debug!(
                variant = v.name(),
                bound = b,
                own = ?cap,
                "the fleet's cache bound taken"
            );
            cap = Some(b);
            (adopted, taken) = (true, true);
        }
    }
    homes.store_adopted(adopted);
    let mut calm = if overflowed || taken {
        0
    } else {
        homes.calm() + 1
    };
    if calm >= t.home_probe_passes {
        calm = 0;
        let most = last.iter().map(|x| x.1).max().unwrap_or(0);
        cap = cap.filter(|&c| c <= most).map(|c| c + 1);
    }
    homes.store_capacity(cap, calm);
    // Copies by share wait for the second pass: the first places keys before any engine has
    // reported on them, and an overflow it causes is a bound by the next (see the module doc).
    homes.store_past_first_pass(homes.past_first_pass() || !last.is_empty());
    // The probe (see the module doc): with no bound and engines that report, copies may give
    // an instance one key more than an even spread until one that held more showed room.
    let mut level = homes.probe_level();
    if let (Some(c), None) = (before, cap) {
        // a bound forgotten: probing resumes where it stood
        level = c;
    }
    if cap.is_none() && v.load().feedback().reported() {
        if level == 0 {
            level = even + 1;
        }
        if room_shown {
            level = u32::MAX;
        }
    }
    homes.store_probe_level(level);
    let probe = homes.probing().then_some(level.max(even + 1));
    (cap.map(|c| c.max(even)), probe)
}
