//! A plan as the kernel reads it: one `#[repr(C)]` table per rank, mirrored field for field by
//! the structs in plan.cu and sys/common.cuh.

use bytemuck::{Pod, Zeroable};
use commfuse_core::{BufferKind, CheckedPlan, Cmp, Region, Slot, Step};

/// The most ranks a kernel's tables address: the project's one maximum world size (the
/// kernels get it as `COMMFUSE_MAX_RANKS` from the compiler options).
pub const MAX_RANKS: usize = commfuse_core::MAX_WORLD_SIZE;
/// Threads per lane (block).
pub const THREADS: u32 = 512;
/// Elements per lane are a multiple of this, so lanes of aligned regions stay 16-byte aligned.
const LANE_GRAIN: usize = 64;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub struct DeviceRegion {
    pub ptr: u64,
    pub len: u64,
}

pub const STEP_WAIT: u32 = 0;
pub const STEP_NOTIFY: u32 = 1;
pub const STEP_COPY: u32 = 2;
pub const STEP_REDUCE: u32 = 3;
pub const CMP_EQ: u32 = 0;
pub const CMP_GE: u32 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub struct DeviceStep {
    pub kind: u32,
    /// wait/notify: slot index within a lane (row × cols + col)
    pub slot: u32,
    /// notify: target rank
    pub peer: u32,
    pub nsrc: u32,
    /// wait: expected value (relative to the epoch base); notify: amount added
    pub value: u64,
    /// sources at regions[src_begin ..][..nsrc], destinations at regions[dst_begin ..][..ndst]
    pub src_begin: u32,
    pub ndst: u32,
    pub dst_begin: u32,
    /// wait: CMP_EQ or CMP_GE
    pub cmp: u32,
    /// elements in every region of the step
    pub len: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub struct ErrorRecord {
    pub flag: u32,
    pub abort: u32,
    pub rank: u32,
    pub lane: u32,
    pub step: u32,
    pub slot: u32,
    pub expected: u64,
    pub seen: u64,
}

impl ErrorRecord {
    /// What a plan kernel's wait that gave up waited on: the pad slot (recorded as one index,
    /// row · cols + col) and the rank whose notify of it `plan` says the waiter awaited (None:
    /// no rank notifies it, which only a corrupted record names).
    pub(crate) fn plan_slot(&self, plan: &CheckedPlan) -> (Slot, Option<usize>) {
        let cols = plan.plan().pad_cols.max(1);
        let slot = Slot::new(self.slot / cols, self.slot % cols);
        (slot, plan.notifier(self.rank as usize, slot))
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct PlanArgs {
    pub steps: u64,
    pub regions: u64,
    pub pads: [u64; MAX_RANKS],
    pub bases: u64,
    pub increments: u64,
    pub error: u64,
    pub lane_len: u64,
    pub timeout_ns: u64,
    pub nsteps: u32,
    pub rank: u32,
    pub slots: u32,
    pub pad: u32,
}

/// Device addresses of every rank's three buffers.
#[derive(Debug, Clone, Copy)]
pub struct BufferAddrs {
    pub input: u64,
    pub output: u64,
    pub scratch: u64,
}

impl BufferAddrs {
    fn get(&self, kind: BufferKind) -> u64 {
        match kind {
            BufferKind::Input => self.input,
            BufferKind::Output => self.output,
            BufferKind::Scratch => self.scratch,
        }
    }
}

/// One rank's steps and region list, with addresses resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTable {
    pub steps: Vec<DeviceStep>,
    pub regions: Vec<DeviceRegion>,
}

fn resolve(region: &Region, addrs: &[BufferAddrs], elem_bytes: usize) -> DeviceRegion {
    DeviceRegion {
        ptr: addrs[region.rank].get(region.buffer) + (region.offset * elem_bytes) as u64,
        len: region.len as u64,
    }
}

/// Encodes rank `rank`'s steps; `addrs[q]` are rank q's buffer addresses.
pub fn encode(
    plan: &CheckedPlan,
    rank: usize,
    addrs: &[BufferAddrs],
    elem_bytes: usize,
) -> RankTable {
    let p = plan.plan();
    let cols = p.pad_cols;
    let mut table = RankTable {
        steps: Vec::new(),
        regions: Vec::new(),
    };
    for step in &p.steps[rank] {
        let mut d = DeviceStep::default();
        match step {
            Step::Wait {
                slot,
                expected,
                cmp,
            } => {
                d.kind = STEP_WAIT;
                d.cmp = match cmp {
                    Cmp::Eq => CMP_EQ,
                    Cmp::Ge => CMP_GE,
                };
                d.slot = slot.row * cols + slot.col;
                d.value = *expected;
            }
            Step::Notify {
                peer, slot, value, ..
            } => {
                d.kind = STEP_NOTIFY;
                d.slot = slot.row * cols + slot.col;
                d.peer = *peer as u32;
                d.value = *value;
            }
            Step::Copy { .. } | Step::Reduce { .. } => {
                let (srcs, dsts) = step.regions();
                d.kind = if matches!(step, Step::Copy { .. }) {
                    STEP_COPY
                } else {
                    STEP_REDUCE
                };
                d.len = dsts[0].len as u64;
                d.nsrc = srcs.len() as u32;
                d.src_begin = table.regions.len() as u32;
                table
                    .regions
                    .extend(srcs.iter().map(|s| resolve(s, addrs, elem_bytes)));
                d.ndst = dsts.len() as u32;
                d.dst_begin = table.regions.len() as u32;
                table
                    .regions
                    .extend(dsts.iter().map(|s| resolve(s, addrs, elem_bytes)));
            }
        }
        table.steps.push(d);
    }
    table
}

/// How a plan is cut into lanes: how many, and how many elements each takes of every region.
/// Every rank must use the same cut, so it depends only on the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lanes {
    pub count: u32,
    pub len: u64,
}

/// Lanes for the largest region: about `target_bytes` each, but at least `min_lanes` (down to
/// `min_bytes` each) so that small messages spread their link latency over several blocks, and
/// at most `max`.
pub fn lanes(
    plan: &CheckedPlan,
    elem_bytes: usize,
    target_bytes: usize,
    min_bytes: usize,
    min_lanes: usize,
    max: u32,
) -> Lanes {
    let longest = plan
        .plan()
        .steps
        .iter()
        .flatten()
        .filter_map(|s| s.regions().1.first().map(|d| d.len))
        .max()
        .unwrap_or(0);
    let bytes = longest * elem_bytes;
    let floor = min_lanes.min(bytes.div_ceil(min_bytes)).max(1);
    let wanted = bytes
        .div_ceil(target_bytes)
        .max(floor)
        .clamp(1, max.max(1) as usize);
    let len = longest
        .div_ceil(wanted)
        .next_multiple_of(LANE_GRAIN)
        .max(LANE_GRAIN);
    Lanes {
        count: longest.div_ceil(len).max(1) as u32,
        len: len as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Topology};

    #[test]
    fn layouts_match_the_cuda_structs() {
        // sizes fixed by plan.cu and sys/common.cuh
        assert_eq!(std::mem::size_of::<DeviceRegion>(), 16);
        assert_eq!(std::mem::size_of::<DeviceStep>(), 48);
        assert_eq!(std::mem::offset_of!(DeviceStep, len), 40);
        assert_eq!(std::mem::size_of::<ErrorRecord>(), 40);
        assert_eq!(
            std::mem::size_of::<PlanArgs>(),
            8 * (2 + MAX_RANKS + 5) + 16
        );
        assert_eq!(
            std::mem::offset_of!(PlanArgs, nsteps),
            8 * (2 + MAX_RANKS + 5)
        );
    }

    #[test]
    fn encoding_resolves_addresses_and_slots() {
        let spec = OpSpec::new(OpKind::AllReduce, 2, 10, 0).unwrap();
        let plan =
            check(build_plan(spec, Algo::OneShot, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
        let addrs = [
            BufferAddrs {
                input: 0x1000,
                output: 0x2000,
                scratch: 0x3000,
            },
            BufferAddrs {
                input: 0x5000,
                output: 0x6000,
                scratch: 0x7000,
            },
        ];
        let t = encode(&plan, 1, &addrs, 2);
        let reduce = t.steps.iter().find(|s| s.kind == STEP_REDUCE).unwrap();
        assert_eq!((reduce.nsrc, reduce.ndst, reduce.len), (2, 1, 10));
        let at = |i: u32| t.regions[i as usize];
        assert_eq!(
            at(reduce.src_begin),
            DeviceRegion {
                ptr: 0x1000,
                len: 10
            }
        );
        assert_eq!(
            at(reduce.src_begin + 1),
            DeviceRegion {
                ptr: 0x5000,
                len: 10
            }
        );
        assert_eq!(
            at(reduce.dst_begin),
            DeviceRegion {
                ptr: 0x6000,
                len: 10
            }
        );
        let notify = t.steps.iter().find(|s| s.kind == STEP_NOTIFY).unwrap();
        assert_eq!(notify.peer, 0);
        assert_eq!(notify.slot, 1); // the entry handshake: row 0, column 1 (the sender)
    }

    #[test]
    fn lanes_cover_the_longest_region_in_aligned_pieces() {
        let spec = OpSpec::new(OpKind::AllReduce, 2, 1_000_003, 0).unwrap();
        let plan =
            check(build_plan(spec, Algo::OneShot, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
        let l = lanes(&plan, 4, 64 << 10, 4 << 10, 16, 264);
        assert_eq!(l.len % 64, 0);
        assert!(l.len * l.count as u64 >= 1_000_003);
        assert!(l.len * (l.count as u64 - 1) < 1_000_003);
        assert!(l.count <= 264);
        let tiny = lanes(&plan, 4, 1 << 30, 1 << 30, 16, 264);
        assert_eq!(tiny.count, 1);
        // a small message still gets several lanes
        let spec = OpSpec::new(OpKind::AllReduce, 2, 32 << 10, 0).unwrap();
        let plan =
            check(build_plan(spec, Algo::OneShot, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
        assert_eq!(lanes(&plan, 2, 64 << 10, 4 << 10, 16, 264).count, 16);
    }
}
