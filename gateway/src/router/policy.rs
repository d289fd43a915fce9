//! Where a request goes: consistent hashing on `lora_int_id` with bounded
//! loads and residency affinity.
//!
//! The policy is pure: [`decide`] takes the ring and the workers' current
//! view (load, residency of this adapter) and returns an ordered candidate
//! list with the reason for the first choice. The fleet supplies the view
//! from its routing snapshot; the routing simulation bench drives the same
//! code through [`Router`].
//!
//! Two bounds on a worker's requests in flight, each `max(ceil(f × (total
//! load + 1) / workers), MIN_BOUND)`: the load bound (f = `load_factor`)
//! for any worker, and the resident bound (f = `resident_load_factor`, at
//! least as high) for a worker holding the adapter in its device slots,
//! since moving a request off such a worker costs an adapter load. The
//! rules, in order, among eligible workers (healthy, serving the adapter's
//! base hash) under the bound that applies to them:
//! 1. a worker where the adapter is device-resident, the least loaded
//!    first (ties in ring order);
//! 2. a worker where it is host-resident, likewise;
//! 3. its ring owner, then the next workers clockwise ("spill").
//!
//! A hot adapter spreads by rule 3: when the workers holding it are at
//! their bound, the next worker clockwise loads it, and rule 1 then shares
//! its requests among every worker holding it. If every worker is at its
//! bound, the least-loaded one takes the request.

use std::hash::Hasher;

/// The bound never falls below this many requests in flight: a worker
/// running a few requests decodes them in one step for about the cost of
/// one, so on a nearly idle fleet moving a request off the worker that
/// holds its adapter would cost an adapter load and save nothing. (Without
/// it, the bound of an idle fleet of four is one request, and one report
/// arriving late sends the next request elsewhere.)
pub const MIN_BOUND: f64 = 4.0;

/// The default resident bound's factor: where the routing simulation's
/// adapter loads fell below every peer's in the fleets where a worker's
/// slots can hold its share of the adapters, with the requests served per
/// worker still within 1.25 × the mean (BENCHMARKS.md, "routing
/// simulation").
pub const RESIDENT_LOAD_FACTOR: f64 = 1.45;

/// Virtual nodes per worker on the ring: enough that 8 workers split the
/// key space within a few percent of evenly.
const VNODES: usize = 160;

/// How near an adapter is on one worker, for routing: the worker's last
/// reported [`lorafleet_domain::Residency`], with every state that needs a
/// read from disk (loading, not loaded) as `Absent`. Ordered nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Absent,
}

/// One worker as the router sees it for one request.
#[derive(Debug, Clone)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    /// Requests running or queued there.
    pub load: u32,
    /// Where this request's adapter is there (Absent for the base model).
    pub residency: Tier,
    /// Healthy and serving the request's base hash.
    pub eligible: bool,
}

/// Which rule picked the first candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    DeviceResident,
    HostResident,
    RingOwner,
    RingSpill,
    Saturated,
}

impl Reason {
    /// A stable label for metrics and traces.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::DeviceResident => "device_resident",
            Reason::HostResident => "host_resident",
            Reason::RingOwner => "ring_owner",
            Reason::RingSpill => "ring_spill",
            Reason::Saturated => "saturated",
        }
    }
}

/// A routing decision: indexes into the views, best first, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub order: Vec<usize>,
    pub reason: Reason,
}

/// Tuning of the policy.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// No worker takes a request that would put it above c × the average,
    /// except as `resident_load_factor` allows.
    pub load_factor: f64,
    /// A worker that holds the request's adapter in its device slots may
    /// take it up to this × the average (at least `load_factor`): moving
    /// the request off costs an adapter load on another worker, and the
    /// adapter it displaces there another when it is next asked for.
    pub resident_load_factor: f64,
}

impl Policy {
    /// The most requests in flight a worker may reach by taking one more,
    /// over `workers` eligible workers carrying `total`: (any worker, a
    /// worker holding the adapter in its device slots).
    pub fn bounds(&self, total: u64, workers: usize) -> (f64, f64) {
        let mean = (total + 1) as f64 / workers.max(1) as f64;
        let bound = (self.load_factor * mean).ceil().max(MIN_BOUND);
        let resident = (self.resident_load_factor.max(self.load_factor) * mean)
            .ceil()
            .max(MIN_BOUND);
        (bound, resident)
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            load_factor: 1.25,
            resident_load_factor: RESIDENT_LOAD_FACTOR,
        }
    }
}

/// The hash ring over one membership: immutable, so a routing snapshot
/// can share it until the membership changes.
#[derive(Debug, Default)]
pub struct Ring {
    workers: Vec<String>,
    /// (point, worker index), sorted by point.
    points: Vec<(u64, usize)>,
}

/// The ring and the policy together, for simulations and tests; the
/// gateway keeps its ring in the routing snapshot (`fleet.rs`) and calls
/// [`decide`] directly.
#[derive(Debug, Default)]
pub struct Router {
    policy: Policy,
    ring: Ring,
}

/// A stable 64-bit hash (FNV-1a then a mixer), the same in every gateway
/// replica and every release, unlike std's randomized hasher.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    h.write(bytes);
    mix(h.0)
}

struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// splitmix64's finalizer: spreads FNV's weak low bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Ring {
    pub fn new(ids: &[&str]) -> Ring {
        let mut points = Vec::with_capacity(ids.len() * VNODES);
        for (i, id) in ids.iter().enumerate() {
            for v in 0..VNODES {
                points.push((stable_hash(format!("{id}#{v}").as_bytes()), i));
            }
        }
        points.sort_unstable();
        Ring {
            workers: ids.iter().map(|s| (*s).to_owned()).collect(),
            points,
        }
    }

    /// The member ids, in index order.
    pub fn workers(&self) -> &[String] {
        &self.workers
    }

    /// Whether this ring is over exactly `ids`, in this order.
    pub fn is_over(&self, ids: &[&str]) -> bool {
        self.workers
            .iter()
            .map(String::as_str)
            .eq(ids.iter().copied())
    }

    /// Distinct workers clockwise from the adapter's point on the ring.
    pub fn order(&self, key: u64) -> Vec<usize> {
        let n = self.workers.len();
        let mut order = Vec::with_capacity(n);
        if n == 0 {
            return order;
        }
        let point = stable_hash(&key.to_le_bytes());
        let start = self.points.partition_point(|&(p, _)| p < point);
        let mut seen = vec![false; n];
        for k in 0..self.points.len() {
            let (_, w) = self.points[(start + k) % self.points.len()];
            if !seen[w] {
                seen[w] = true;
                order.push(w);
                if order.len() == n {
                    break;
                }
            }
        }
        order
    }
}

/// The eligible workers in ring order for `key`.
fn eligible_ring(ring: &Ring, key: u64, views: &[WorkerView<'_>]) -> Vec<usize> {
    ring.order(key)
        .into_iter()
        .filter(|&i| i < views.len() && views[i].eligible)
        .collect()
}

/// Chooses for a request on adapter `key` (0 for the base model); `views`
/// are in the ring's worker order. None when no worker is eligible. Pure:
/// the same inputs give the same decision.
pub fn decide(policy: Policy, ring: &Ring, key: u64, views: &[WorkerView<'_>]) -> Option<Decision> {
    let eligible: Vec<usize> = (0..views.len()).filter(|&i| views[i].eligible).collect();
    if eligible.is_empty() {
        return None;
    }
    let total: u64 = eligible.iter().map(|&i| u64::from(views[i].load)).sum();
    let (bound, resident_bound) = policy.bounds(total, eligible.len());
    // Under the bound that applies to this worker: the resident one where
    // the adapter is in its device slots.
    let under = |i: usize| {
        let b = if key != 0 && views[i].residency == Tier::Device {
            resident_bound
        } else {
            bound
        };
        f64::from(views[i].load) + 1.0 <= b
    };
    let ring = eligible_ring(ring, key, views);
    let ring_rank = |i: usize| ring.iter().position(|&r| r == i).unwrap_or(usize::MAX);

    let first = [
        (Tier::Device, Reason::DeviceResident),
        (Tier::Host, Reason::HostResident),
    ]
    .into_iter()
    .filter(|_| key != 0)
    .find_map(|(tier, reason)| {
        eligible
            .iter()
            .copied()
            .filter(|&i| views[i].residency == tier && under(i))
            .min_by_key(|&i| (views[i].load, ring_rank(i)))
            .map(|i| (i, reason))
    })
    .or_else(|| {
        ring.iter().position(|&i| under(i)).map(|p| {
            (
                ring[p],
                if p == 0 {
                    Reason::RingOwner
                } else {
                    Reason::RingSpill
                },
            )
        })
    })
    .unwrap_or_else(|| {
        let i = *eligible
            .iter()
            .min_by_key(|&&i| (views[i].load, ring_rank(i)))
            .expect("eligible is not empty");
        (i, Reason::Saturated)
    });
    // Fallbacks for retries: the ring order, skipping the first choice.
    let mut order = vec![first.0];
    order.extend(ring.iter().copied().filter(|&i| i != first.0));
    Some(Decision {
        order,
        reason: first.1,
    })
}

impl Router {
    pub fn new(policy: Policy) -> Router {
        Router {
            policy,
            ..Router::default()
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Rebuilds the ring if the membership changed.
    pub fn set_workers(&mut self, ids: &[&str]) {
        if !self.ring.is_over(ids) {
            self.ring = Ring::new(ids);
        }
    }

    /// Distinct workers clockwise from the adapter's point on the ring.
    pub fn ring_order(&self, key: u64) -> Vec<usize> {
        self.ring.order(key)
    }

    /// [`decide`] with this router's ring.
    pub fn choose(&self, key: u64, views: &[WorkerView<'_>]) -> Option<Decision> {
        decide(self.policy, &self.ring, key, views)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn views<'a>(ids: &'a [String], loads: &[u32]) -> Vec<WorkerView<'a>> {
        ids.iter()
            .zip(loads)
            .map(|(id, &load)| WorkerView {
                id,
                load,
                residency: Tier::Absent,
                eligible: true,
            })
            .collect()
    }

    fn router(n: usize) -> (Router, Vec<String>) {
        let ids: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let mut r = Router::new(Policy::default());
        r.set_workers(&ids.iter().map(String::as_str).collect::<Vec<_>>());
        (r, ids)
    }

    #[test]
    fn the_ring_spreads_keys_evenly_and_moves_few_keys_when_a_worker_leaves() {
        let (r, _) = router(8);
        let mut owners = [0usize; 8];
        let owner: Vec<usize> = (1..=8000u64).map(|k| r.ring_order(k)[0]).collect();
        for &o in &owner {
            owners[o] += 1;
        }
        let (min, max) = (owners.iter().min().unwrap(), owners.iter().max().unwrap());
        assert!((*max as f64 / *min as f64) < 1.35, "{owners:?}");

        let ids: Vec<String> = (0..8)
            .filter(|&i| i != 3)
            .map(|i| format!("w{i}"))
            .collect();
        let mut r7 = Router::new(Policy::default());
        r7.set_workers(&ids.iter().map(String::as_str).collect::<Vec<_>>());
        let moved = (1..=8000u64)
            .filter(|&k| {
                let before = format!("w{}", owner[k as usize - 1]);
                let after = &ids[r7.ring_order(k)[0]];
                before != "w3" && &before != after
            })
            .count();
        assert_eq!(moved, 0, "only the leaving worker's keys move");
    }

    #[test]
    fn residency_wins_over_the_ring_owner_until_the_load_bound() {
        let (r, ids) = router(4);
        let key = 42;
        let owner = r.ring_order(key)[0];
        let other = (owner + 1) % 4;
        let mut v = views(&ids, &[2, 2, 2, 2]);
        v[other].residency = Tier::Device;
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (other, Reason::DeviceResident));
        assert_eq!(d.order.len(), 4);

        // Over both bounds (ceil(1.25 * 11 / 4) = ceil(1.45 * 11 / 4) = 4,
        // so a worker at 4 is full), the resident worker is skipped and the
        // ring owner takes it.
        let mut v = views(&ids, &[2, 2, 2, 2]);
        v[other].load = 4;
        v[other].residency = Tier::Device;
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (owner, Reason::RingOwner));

        let mut v = views(&ids, &[0, 0, 0, 0]);
        v[other].residency = Tier::Host;
        assert_eq!(r.choose(key, &v).unwrap().reason, Reason::HostResident);
    }

    #[test]
    fn ineligible_workers_are_never_chosen_and_none_eligible_is_none() {
        let (r, ids) = router(3);
        let mut v = views(&ids, &[0, 0, 0]);
        for x in &mut v {
            x.eligible = false;
        }
        assert!(r.choose(7, &v).is_none());
        v[1].eligible = true;
        let d = r.choose(7, &v).unwrap();
        assert_eq!(d.order, vec![1]);
    }

    #[test]
    fn a_worker_holding_the_adapter_may_run_past_the_load_bound_to_the_resident_bound() {
        let (r, ids) = router(4);
        let key = 42;
        let holder = (r.ring_order(key)[0] + 1) % 4;
        let mut v = views(&ids, &[6, 6, 6, 6]);
        v[holder].load = 10;
        v[holder].residency = Tier::Device;
        // Total 28: the load bound is ceil(1.25 * 29 / 4) = 10, the
        // resident bound ceil(1.45 * 29 / 4) = 11: the holder's 11th
        // request stays with it.
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (holder, Reason::DeviceResident));
        // With no room above the load bound, it goes to the ring owner and
        // costs a load there.
        let flat = Policy {
            resident_load_factor: 1.25,
            ..Policy::default()
        };
        let ring = Ring::new(&ids.iter().map(String::as_str).collect::<Vec<_>>());
        let d = decide(flat, &ring, key, &v).unwrap();
        assert_eq!(d.reason, Reason::RingOwner);
        assert_ne!(d.order[0], holder);
    }

    #[test]
    fn a_hot_adapter_spreads_clockwise_then_shares_among_its_holders() {
        let (r, ids) = router(8);
        let key = 9;
        let ring = r.ring_order(key);
        // Only the owner holds it, at its resident bound (total 32+7: the
        // resident bound is ceil(1.45 * 40 / 8) = 8).
        let mut loads = [4u32; 8];
        loads[ring[0]] = 8;
        let mut v = views(&ids, &loads);
        v[ring[0]].residency = Tier::Device;
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (ring[1], Reason::RingSpill));
        // Once the next worker clockwise holds it too, requests go to the
        // less loaded of the two holders, and only to holders.
        v[ring[1]].residency = Tier::Device;
        v[ring[1]].load = 5;
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (ring[1], Reason::DeviceResident));
        v[ring[0]].load = 3;
        let d = r.choose(key, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (ring[0], Reason::DeviceResident));
    }

    #[test]
    fn an_overloaded_ring_owner_spills_to_the_next_worker_clockwise() {
        let (r, ids) = router(4);
        let ring = r.ring_order(5);
        let mut loads = [1, 1, 1, 1];
        loads[ring[0]] = 6;
        let v = views(&ids, &loads);
        // bound = ceil(1.25 * 10 / 4) = 4: the owner (6) is over it.
        let d = r.choose(5, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (ring[1], Reason::RingSpill));
        assert_eq!(d.order[1..], [ring[0], ring[2], ring[3]]);
    }
}
