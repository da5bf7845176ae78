//! Topology as code: NUMA groups, ring orders, and the link figures the cost model uses.
//!
//! Defaults come from the figures measured on the project's 2 × H200 machine (docs/performance.md and docs/results/hardware/link-ceilings.txt have
//! the runs): SM stores over NVLink reach about 370 GB/s per direction, a flag round
//! trip takes about 2.4 µs (1.2 µs one way), and HBM moves about 3.95 TB/s (read + write).

use crate::error::Error;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Topology {
    pub world: usize,
    /// Ranks are split into this many NUMA groups of consecutive ranks.
    pub numa_groups: usize,
    /// Bandwidth per rank and direction between ranks of one group, GB/s.
    pub link_gbps: f64,
    /// Bandwidth per rank and direction between ranks of different groups, GB/s.
    pub inter_group_gbps: f64,
    /// One-way signal latency, µs.
    pub latency_us: f64,
    /// Local memory bandwidth (bytes read + written), GB/s.
    pub local_gbps: f64,
    /// Fixed cost of launching one call, µs.
    pub launch_us: f64,
}

impl Topology {
    pub fn new(world: usize, numa_groups: usize) -> Result<Self, Error> {
        if numa_groups == 0 || numa_groups > world.max(1) {
            return Err(Error::Unsupported(format!(
                "--numa-groups must be between 1 and the world size {world}, got {numa_groups}"
            )));
        }
        Ok(Topology {
            world,
            numa_groups,
            link_gbps: 370.0,
            inter_group_gbps: 370.0,
            latency_us: 1.2,
            local_gbps: 3950.0,
            launch_us: 5.0,
        })
    }

    /// Group sizes as even as possible; group k holds consecutive ranks.
    pub fn group_of(&self, rank: usize) -> usize {
        (0..self.numa_groups)
            .find(|&k| crate::op::chunk_range(self.world, self.numa_groups, k).contains(&rank))
            .unwrap_or(0)
    }

    pub fn group_members(&self, group: usize) -> Vec<usize> {
        crate::op::chunk_range(self.world, self.numa_groups, group).collect()
    }

    /// Bandwidth between two ranks, GB/s (= bytes per ns).
    pub fn bandwidth(&self, a: usize, b: usize) -> f64 {
        if a == b {
            self.local_gbps
        } else if self.group_of(a) == self.group_of(b) {
            self.link_gbps
        } else {
            self.inter_group_gbps
        }
    }
}

/// The figures of the latency–bandwidth model that calibration fits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkModel {
    pub link_gbps: f64,
    pub latency_us: f64,
    pub launch_us: f64,
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel {
            link_gbps: 370.0,
            latency_us: 1.2,
            launch_us: 5.0,
        }
    }
}

impl Topology {
    /// This topology with `model`'s link figures (the same between and within NUMA groups).
    pub fn with_model(mut self, model: LinkModel) -> Topology {
        self.link_gbps = model.link_gbps;
        self.inter_group_gbps = model.link_gbps;
        self.latency_us = model.latency_us;
        self.launch_us = model.launch_us;
        self
    }
}

/// The ring through `members` in the given order, as (left, right) of position `pos`.
/// Written with `rem_euclid`-free arithmetic so that position 0 has a valid left neighbour.
pub fn ring_neighbours(members: &[usize], pos: usize) -> (usize, usize) {
    let m = members.len();
    (members[(pos + m - 1) % m], members[(pos + 1) % m])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_partition_ranks() {
        let t = Topology::new(7, 3).unwrap();
        let all: Vec<usize> = (0..3).flat_map(|g| t.group_members(g)).collect();
        assert_eq!(all, (0..7).collect::<Vec<_>>());
        assert_eq!(t.group_of(0), 0);
        assert_eq!(t.group_of(6), 2);
        assert!(Topology::new(4, 0).is_err());
        assert!(Topology::new(4, 5).is_err());
    }

    #[test]
    fn ring_wraps_at_position_zero() {
        assert_eq!(ring_neighbours(&[3, 5, 9], 0), (9, 5));
        assert_eq!(ring_neighbours(&[3, 5, 9], 2), (5, 3));
        assert_eq!(ring_neighbours(&[4], 0), (4, 4));
    }
}
