//! A variant's waiting requests: strict priority between classes, round robin between tenants,
//! each tenant first in, first out (the policy is described in [`crate::flow`]). A waiter names
//! instances by their ids (see [`Home`]); this module knows nothing of the table.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::priority::{Priority, Who};

/// What a waiter is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grant {
    /// A place freed (on the instance of this id, see [`Home`]; 0: any): try again.
    Go(usize),
    /// Leave: a more urgent request took the place.
    Shed,
}

struct Waiter {
    id: u64,
    wake: oneshot::Sender<Grant>,
    /// The id of the instance its placement chose ([`Home`]).
    home: usize,
    /// Until then a place on its home goes to it before one elsewhere (PREFIX_AWARE affinity);
    /// `None`: any place, in turn.
    patient_until: Option<Instant>,
}

impl Waiter {
    /// Whether it takes a place freed on `freed` (0: any instance) at `now`.
    fn takes(&self, freed: usize, now: Instant) -> bool {
        freed == 0 || self.home == freed || self.patient_until.is_none_or(|t| now >= t)
    }
}

struct TenantQueue {
    tenant: Arc<str>,
    waiters: VecDeque<Waiter>,
}

#[derive(Default)]
struct Waiting {
    /// Per priority (index: `Priority as usize`), the tenants with waiters in round-robin order.
    classes: [VecDeque<TenantQueue>; 3],
    next_id: u64,
}

impl Waiting {
    fn push(&mut self, who: &Who, waiter: Waiter, front: bool) {
        let class = &mut self.classes[who.priority as usize];
        match class.iter().position(|t| t.tenant == who.tenant) {
            Some(i) if front => {
                let mut t = class.remove(i).expect("a tenant at its position");
                t.waiters.push_front(waiter);
                class.push_front(t);
            }
            Some(i) => class[i].waiters.push_back(waiter),
            None => {
                let t = TenantQueue {
                    tenant: who.tenant.clone(),
                    waiters: VecDeque::from([waiter]),
                };
                if front {
                    class.push_front(t)
                } else {
                    class.push_back(t)
                }
            }
        }
    }

    /// The next waiter: the most urgent class, its next tenant in turn.
    fn pop(&mut self) -> Option<Waiter> {
        for p in Priority::ALL {
            let class = &mut self.classes[p as usize];
            while let Some(mut t) = class.pop_front() {
                if let Some(w) = t.waiters.pop_front() {
                    if !t.waiters.is_empty() {
                        class.push_back(t);
                    }
                    return Some(w);
                }
            }
        }
        None
    }

    /// The next waiter, in [`Waiting::pop`]'s order, that takes a place freed on `freed` at
    /// `now`: waiters holding out for other instances keep their turn.
    fn pop_for(&mut self, freed: usize, now: Instant) -> Option<Waiter> {
        for p in Priority::ALL {
            let class = &mut self.classes[p as usize];
            let found = class.iter().enumerate().find_map(|(i, t)| {
                let j = t.waiters.iter().position(|w| w.takes(freed, now))?;
                Some((i, j))
            });
            if let Some((i, j)) = found {
                let mut t = class.remove(i).expect("a tenant at its position");
                let w = t.waiters.remove(j).expect("a waiter at its position");
                if !t.waiters.is_empty() {
                    class.push_back(t);
                }
                return Some(w);
            }
        }
        None
    }

    /// The youngest waiter of the least urgent class below `above` that has any.
    fn pop_less_urgent(&mut self, above: Priority) -> Option<Waiter> {
        let p = (Priority::Sheddable as usize..above as usize)
            .find(|&p| !self.classes[p].is_empty())?;
        let class = &mut self.classes[p];
        let (i, _) = class
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.waiters.back().map(|w| (i, w.id)))
            .max_by_key(|&(_, id)| id)?;
        take_youngest(class, i)
    }

    /// When the queue is full for `who` and no less urgent request waits: the youngest waiter
    /// of the tenant with the most waiting in `who`'s class, if that tenant has at least two
    /// more waiting than `who`'s own (a flood does not keep a quieter tenant out of a full queue).
    fn pop_from_busiest(&mut self, who: &Who) -> Option<Waiter> {
        let p = who.priority as usize;
        let own = self.classes[p]
            .iter()
            .find(|t| t.tenant == who.tenant)
            .map_or(0, |t| t.waiters.len());
        let (i, len) = self.classes[p]
            .iter()
            .enumerate()
            .map(|(i, t)| (i, t.waiters.len()))
            .max_by_key(|&(_, len)| len)?;
        let class = &mut self.classes[p];
        if class[i].tenant == who.tenant || len < own + 2 {
            return None;
        }
        take_youngest(class, i)
    }

    fn remove(&mut self, who: &Who, id: u64) -> bool {
        let class = &mut self.classes[who.priority as usize];
        let Some(i) = class.iter().position(|t| t.tenant == who.tenant) else {
            return false;
        };
        let Some(j) = class[i].waiters.iter().position(|w| w.id == id) else {
            return false;
        };
        class[i].waiters.remove(j);
        if class[i].waiters.is_empty() {
            class.remove(i);
        }
        true
    }
}

/// The youngest waiter of the `i`th tenant of `class`; a tenant left with none leaves the ring.
fn take_youngest(class: &mut VecDeque<TenantQueue>, i: usize) -> Option<Waiter> {
    let w = class[i].waiters.pop_back();
    if class[i].waiters.is_empty() {
        class.remove(i);
    }
    w
}

/// A variant's waiting requests (kept in its [`VariantLoad`](crate::load::VariantLoad), so that it outlives table
/// changes that keep the variant).
#[derive(Default)]
pub struct Queue {
    /// Waiters in `waiting` (read without the lock on every request).
    len: AtomicUsize,
    waiting: Mutex<Waiting>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("len", &self.len.load(Relaxed))
            .finish()
    }
}

impl Queue {
    /// Whether anyone waits.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len.load(Relaxed) == 0
    }

    /// Waiters now.
    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Waiters now by priority (index: `Priority as usize`).
    pub fn depths(&self) -> [u32; 3] {
        if self.is_empty() {
            return [0; 3];
        }
        let waiting = self.lock();
        waiting.classes.each_ref().map(|class| {
            let n: usize = class.iter().map(|t| t.waiters.len()).sum();
            u32::try_from(n).unwrap_or(u32::MAX)
        })
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue, locked, for a request to join it ([`Line::join`]).
    pub(crate) fn line(&self) -> Line<'_> {
        Line {
            queue: self,
            waiting: self.lock(),
        }
    }

    /// Takes waiter `id` of `who` out of the queue (its request left); false: it was no longer
    /// there (granted or shed).
    pub(crate) fn leave(&self, who: &Who, id: u64) -> bool {
        let mut waiting = self.lock();
        let removed = waiting.remove(who, id);
        if removed {
            self.len.fetch_sub(1, Relaxed);
        }
        removed
    }

    /// A place freed on the instance of id `freed` ([`Home`]) (0: some instance): the next
    /// waiter that takes it (see `Waiter::takes`), else the next waiter, may.
    pub fn release(&self, freed: usize) {
        if self.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut waiting = self.lock();
        // the next waiter that takes it, else the next one: no place stays idle while any wait
        while let Some(w) = waiting.pop_for(freed, now).or_else(|| waiting.pop()) {
            self.len.fetch_sub(1, Relaxed);
            if w.wake.send(Grant::Go(freed)).is_ok() {
                return;
            }
        }
    }

    /// Wakes every waiter (its variant is gone from the table: see
    /// [`FlowControl::table_changed`](crate::flow::FlowControl::table_changed)).
    pub(crate) fn release_all(&self) {
        let woken: Vec<Waiter> = {
            let mut waiting = self.lock();
            std::iter::from_fn(|| waiting.pop()).collect()
        };
        self.len.fetch_sub(woken.len(), Relaxed);
        for w in woken {
            let _ = w.wake.send(Grant::Go(0));
        }
    }
}

/// A [`Queue`] held locked while a request joins it.
pub(crate) struct Line<'q> {
    queue: &'q Queue,
    waiting: MutexGuard<'q, Waiting>,
}

impl Line<'_> {
    /// Makes room for `who` in a full queue: the youngest waiter of the least urgent class below
    /// its own, else of the tenant with the most waiting in its class (if that tenant has at least
    /// two more than `who`'s), is told to leave. False: no one may be.
    pub(crate) fn shed_for(&mut self, who: &Who) -> bool {
        let shed = self
            .waiting
            .pop_less_urgent(who.priority)
            .or_else(|| self.waiting.pop_from_busiest(who));
        match shed {
            Some(w) => {
                // its ticket counts itself out when it reads the grant
                self.queue.len.fetch_sub(1, Relaxed);
                let _ = w.wake.send(Grant::Shed);
                true
            }
            None => false,
        }
    }

    /// Queues `who` (`front`: ahead of its class's other tenants and first of its own), first in
    /// line for places on its [`Home`]; its id, and where its [`Grant`] comes.
    pub(crate) fn join(
        mut self,
        who: &Who,
        home: Home,
        front: bool,
    ) -> (u64, oneshot::Receiver<Grant>) {
        let (tx, rx) = oneshot::channel();
        let id = self.waiting.next_id;
        self.waiting.next_id += 1;
        let waiter = Waiter {
            id,
            wake: tx,
            home: home.instance,
            patient_until: home.patient_until,
        };
        self.waiting.push(who, waiter, front);
        self.queue.len.fetch_add(1, Relaxed);
        (id, rx)
    }
}

/// Where a waiter would rather go: a place freed on `instance` ([`InstanceState::id`](crate::load::InstanceState::id)) goes to it before
/// the waiters ahead of it until `patient_until` (PREFIX_AWARE affinity; `None`: none).
#[derive(Debug, Clone, Copy)]
pub struct Home {
    pub instance: usize,
    pub patient_until: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::priority::tests::who;
    use std::time::Duration;

    impl Waiter {
        /// A waiter that takes any place.
        fn any(id: u64, wake: oneshot::Sender<Grant>) -> Self {
            Waiter {
                id,
                wake,
                home: 0,
                patient_until: None,
            }
        }
    }

    #[test]
    fn a_place_goes_first_to_a_waiter_whose_home_it_is_or_who_holds_out_no_longer() {
        let mut w = Waiting::default();
        let now = Instant::now();
        let later = Some(now + Duration::from_secs(60));
        let chat = who("chat", Priority::Standard);
        // ids 0-2 hold out for homes 10, 20 and 10; id 3 held out until just now
        for (id, home, until) in [
            (0, 10, later),
            (1, 20, later),
            (2, 10, later),
            (3, 30, Some(now)),
        ] {
            let (tx, _rx) = oneshot::channel();
            let waiter = Waiter {
                id,
                wake: tx,
                home,
                patient_until: until,
            };
            w.push(&chat, waiter, false);
        }
        let id = |w: Option<Waiter>| w.map(|w| w.id);
        assert_eq!(
            id(w.pop_for(20, now)),
            Some(1),
            "the one whose home it is, queued second"
        );
        assert_eq!(
            id(w.pop_for(40, now)),
            Some(3),
            "the one that holds out no longer"
        );
        assert_eq!(id(w.pop_for(40, now)), None, "the others hold out");
        assert_eq!(
            id(w.pop_for(0, now)),
            Some(0),
            "a place on any instance: in turn"
        );
        assert_eq!(id(w.pop()), Some(2));
    }

    #[test]
    fn the_most_urgent_class_goes_first_and_tenants_take_turns() {
        let mut w = Waiting::default();
        let mut rx = Vec::new();
        let mut push = |w: &mut Waiting, who: &Who, id: u64| {
            let (tx, r) = oneshot::channel();
            w.push(who, Waiter::any(id, tx), false);
            rx.push(r);
        };
        let (a, b) = (who("a", Priority::Standard), who("b", Priority::Standard));
        for id in 0..4 {
            push(&mut w, &a, id); // a floods first
        }
        push(&mut w, &b, 10);
        push(&mut w, &b, 11);
        push(&mut w, &who("batch", Priority::Sheddable), 20);
        push(&mut w, &who("chat", Priority::Critical), 30);
        let order: Vec<u64> = std::iter::from_fn(|| w.pop().map(|x| x.id)).collect();
        assert_eq!(order, [30, 0, 10, 1, 11, 2, 3, 20]);
    }

    #[test]
    fn a_shed_takes_the_youngest_sheddable_and_removal_finds_its_waiter() {
        let mut w = Waiting::default();
        let s1 = who("s1", Priority::Sheddable);
        let s2 = who("s2", Priority::Sheddable);
        for (who, id) in [(&s1, 1), (&s2, 2), (&s1, 3)] {
            let (tx, _) = oneshot::channel();
            w.push(who, Waiter::any(id, tx), false);
        }
        assert_eq!(w.pop_less_urgent(Priority::Standard).map(|x| x.id), Some(3));
        assert!(
            w.pop_less_urgent(Priority::Sheddable).is_none(),
            "nothing below sheddable"
        );
        assert!(w.remove(&s2, 2));
        assert!(!w.remove(&s2, 2));
        assert_eq!(w.pop().map(|x| x.id), Some(1));
        assert!(w.pop().is_none());
    }

    #[test]
    fn a_full_queue_gives_a_quiet_tenant_the_place_of_the_floods_youngest() {
        let mut w = Waiting::default();
        let flood = who("flood", Priority::Standard);
        for id in 0..3 {
            let (tx, _) = oneshot::channel();
            w.push(&flood, Waiter::any(id, tx), false);
        }
        let quiet = who("quiet", Priority::Standard);
        assert_eq!(w.pop_from_busiest(&quiet).map(|x| x.id), Some(2));
        // the flood's own requests do not displace each other
        assert!(w.pop_from_busiest(&flood).is_none());
        let (tx, _) = oneshot::channel();
        w.push(&quiet, Waiter::any(5, tx), false);
        assert!(
            w.pop_from_busiest(&quiet).is_none(),
            "2 against 1: close enough"
        );
        // a more urgent class is never displaced by a less urgent one
        for id in 10..14 {
            let (tx, _) = oneshot::channel();
            w.push(&who("vip", Priority::Critical), Waiter::any(id, tx), false);
        }
        assert!(w
            .pop_from_busiest(&who("other", Priority::Sheddable))
            .is_none());
        assert_eq!(
            w.pop_from_busiest(&who("boss", Priority::Critical))
                .map(|x| x.id),
            Some(13)
        );
    }
}
