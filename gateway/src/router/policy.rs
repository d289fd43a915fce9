//! Where a request goes: consistent hashing on `lora_int_id` with bounded
//! loads, residency affinity, and replica sets that grow for hot adapters.
//!
//! The policy is pure: [`decide`] takes the ring, the adapter's replica
//! count and the workers' current view (load, residency of this adapter)
//! and returns an ordered candidate list with the reason for the first
//! choice. The fleet supplies the view from its routing snapshot; the
//! routing simulation bench drives the same code through [`Router`], which
//! keeps replica counts between calls as the fleet does.
//!
//! The rules, in order, among eligible workers (healthy, serving the
//! adapter's base hash) whose load is under the bound
//! `max(ceil(c × (total load + 1) / workers), MIN_BOUND)`:
//! 1. a hot adapter (replicas > 1): of its replica set, one where it is
//!    device-resident, then host-resident, the least loaded first;
//! 2. a worker where the adapter is device-resident (the ring's replica set
//!    first, then the lower load);
//! 3. a worker where it is host-resident, likewise;
//! 4. its ring owner, then the next workers clockwise ("spill").
//!
//! If every worker is at the bound, the least-loaded one takes it.

use std::collections::HashMap;
use std::hash::Hasher;

/// The bound never falls below this many requests in flight: a worker
/// running a few requests decodes them in one step for about the cost of
/// one, so on a nearly idle fleet moving a request off the worker that
/// holds its adapter would cost an adapter load and save nothing. (Without
/// it, the bound of an idle fleet of four is one request, and one report
/// arriving late sends the next request elsewhere.)
pub const MIN_BOUND: f64 = 4.0;

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
    HotReplica,
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
            Reason::HotReplica => "hot_replica",
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
    /// No worker takes a request that would put it above c × the average.
    pub load_factor: f64,
    /// Load one replica of an adapter should carry before another is added.
    pub replica_share: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            load_factor: 1.25,
            replica_share: 8.0,
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

/// A stateful router for simulations and tests: the ring, and each
/// adapter's replica count kept between calls. The gateway keeps those
/// counts beside its atomic loads instead (`fleet.rs`) and calls
/// [`decide`] directly.
#[derive(Debug, Default)]
pub struct Router {
    policy: Policy,
    ring: Ring,
    /// Adapter -> current replica count; absent means 1.
    replicas: HashMap<u64, usize>,
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

/// An adapter's replica count, from its `current` count and `adapter_load`
/// requests in flight, over `workers` eligible workers. Grows as soon as
/// the load passes the current replicas' share; shrinks only when it falls
/// below half of one fewer replica's share, so a load near a boundary does
/// not flap.
pub fn next_replicas(policy: Policy, current: usize, adapter_load: u32, workers: usize) -> usize {
    let share = policy.replica_share;
    let load = f64::from(adapter_load);
    let mut k = current.max(1);
    while k < workers.max(1) && load > k as f64 * share {
        k += 1;
    }
    while k > 1 && load < (k - 1) as f64 * share * 0.5 {
        k -= 1;
    }
    k
}

/// The eligible workers in ring order for `key`.
pub fn eligible_ring(ring: &Ring, key: u64, views: &[WorkerView<'_>]) -> Vec<usize> {
    ring.order(key)
        .into_iter()
        .filter(|&i| i < views.len() && views[i].eligible)
        .collect()
}

/// Chooses for a request on adapter `key` (0 for the base model) whose
/// adapter currently has `replicas` replicas; `views` are in the ring's
/// worker order. None when no worker is eligible. Pure: the same inputs
/// give the same decision.
pub fn decide(
    policy: Policy,
    ring: &Ring,
    key: u64,
    replicas: usize,
    views: &[WorkerView<'_>],
) -> Option<Decision> {
    let eligible: Vec<usize> = (0..views.len()).filter(|&i| views[i].eligible).collect();
    if eligible.is_empty() {
        return None;
    }
    let total: u64 = eligible.iter().map(|&i| u64::from(views[i].load)).sum();
    let bound = (policy.load_factor * (total + 1) as f64 / eligible.len() as f64)
        .ceil()
        .max(MIN_BOUND);
    let under = |i: usize| f64::from(views[i].load) + 1.0 <= bound;
    let ring = eligible_ring(ring, key, views);
    let k = if key == 0 {
        1
    } else {
        replicas.clamp(1, ring.len().max(1))
    };
    let replica_rank = |i: usize| ring.iter().position(|&r| r == i).unwrap_or(usize::MAX);
    let in_replicas = |i: usize| replica_rank(i) < k;

    let first: Option<(usize, Reason)> = if k > 1 {
        ring[..k]
            .iter()
            .copied()
            .filter(|&i| under(i))
            // The replica that has the adapter nearest, then the least
            // loaded: both under the bound.
            .min_by_key(|&i| (views[i].residency, views[i].load, replica_rank(i)))
            .map(|i| (i, Reason::HotReplica))
    } else {
        None
    };
    let first = first
        .or_else(|| {
            [
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
                    .min_by_key(|&i| (!in_replicas(i), views[i].load, replica_rank(i)))
                    .map(|i| (i, reason))
            })
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
                .min_by_key(|&&i| (views[i].load, replica_rank(i)))
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

    /// The adapter's replica count after seeing `adapter_load` requests in
    /// flight for it (see [`next_replicas`]), kept for the next call.
    pub fn update_replicas(&mut self, key: u64, adapter_load: u32, workers: usize) -> usize {
        let current = self.replicas.get(&key).copied().unwrap_or(1);
        let k = next_replicas(self.policy, current, adapter_load, workers);
        if k == 1 {
            self.replicas.remove(&key);
        } else {
            self.replicas.insert(key, k);
        }
        k
    }

    /// [`decide`] with this router's ring and replica counts, updating the
    /// adapter's count from `adapter_load` first.
    pub fn choose(
        &mut self,
        key: u64,
        adapter_load: u32,
        views: &[WorkerView<'_>],
    ) -> Option<Decision> {
        let k = if key == 0 {
            1
        } else {
            let n = eligible_ring(&self.ring, key, views).len();
            self.update_replicas(key, adapter_load, n)
        };
        decide(self.policy, &self.ring, key, k, views)
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
        let (mut r, ids) = router(4);
        let key = 42;
        let owner = r.ring_order(key)[0];
        let other = (owner + 1) % 4;
        let mut v = views(&ids, &[2, 2, 2, 2]);
        v[other].residency = Tier::Device;
        let d = r.choose(key, 0, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (other, Reason::DeviceResident));
        assert_eq!(d.order.len(), 4);

        // Over the bound (ceil(1.25 * 11 / 4) = 4, so a worker at 4 is
        // full), the resident worker is skipped and the ring owner takes it.
        let mut v = views(&ids, &[2, 2, 2, 2]);
        v[other].load = 4;
        v[other].residency = Tier::Device;
        let d = r.choose(key, 0, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (owner, Reason::RingOwner));

        let mut v = views(&ids, &[0, 0, 0, 0]);
        v[other].residency = Tier::Host;
        assert_eq!(r.choose(key, 0, &v).unwrap().reason, Reason::HostResident);
    }

    #[test]
    fn ineligible_workers_are_never_chosen_and_none_eligible_is_none() {
        let (mut r, ids) = router(3);
        let mut v = views(&ids, &[0, 0, 0]);
        for x in &mut v {
            x.eligible = false;
        }
        assert!(r.choose(7, 0, &v).is_none());
        v[1].eligible = true;
        let d = r.choose(7, 0, &v).unwrap();
        assert_eq!(d.order, vec![1]);
    }

    #[test]
    fn a_hot_adapter_grows_replicas_and_shrinks_back_without_flapping() {
        let (mut r, _) = router(8);
        assert_eq!(r.update_replicas(9, 4, 8), 1);
        assert_eq!(r.update_replicas(9, 20, 8), 3);
        // Just under the growth point: stays at 3 (no flapping at 16..24).
        assert_eq!(r.update_replicas(9, 15, 8), 3);
        assert_eq!(r.update_replicas(9, 9, 8), 3);
        // Well below: shrinks one step at a time as the load falls.
        assert_eq!(r.update_replicas(9, 7, 8), 2);
        assert_eq!(r.update_replicas(9, 3, 8), 1);
        assert_eq!(
            r.update_replicas(9, 1000, 8),
            8,
            "never more than the workers"
        );
    }

    #[test]
    fn an_overloaded_ring_owner_spills_to_the_next_worker_clockwise() {
        let (mut r, ids) = router(4);
        let ring = r.ring_order(5);
        let mut loads = [1, 1, 1, 1];
        loads[ring[0]] = 6;
        let v = views(&ids, &loads);
        // bound = ceil(1.25 * 10 / 4) = 4: the owner (6) is over it.
        let d = r.choose(5, 0, &v).unwrap();
        assert_eq!((d.order[0], d.reason), (ring[1], Reason::RingSpill));
        assert_eq!(d.order[1..], [ring[0], ring[2], ring[3]]);
    }
}
