//! A plan as the kernel reads it: one `#[repr(C)]` table per rank, mirrored field for field by
//! the structs in kernels/plan.cu and kernels/common.cuh.

use commfuse_core::{BufferKind, CheckedPlan, Region, Step};

pub const MAX_RANKS: usize = 64;
/// Threads per lane (block).
pub const THREADS: u32 = 512;
/// Elements per lane are a multiple of this, so lanes of aligned regions stay 16-byte aligned.
const LANE_GRAIN: usize = 64;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceRegion {
    pub ptr: u64,
    pub len: u64,
}

pub const STEP_WAIT: u32 = 0;
pub const STEP_NOTIFY: u32 = 1;
pub const STEP_COPY: u32 = 2;
pub const STEP_REDUCE: u32 = 3;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceStep {
    pub kind: u32,
    pub nsrc: u32,
    pub slot: u32,
    pub peer: u32,
    pub value: u64,
    pub src_begin: u32,
    pub pad: u32,
    pub dst: DeviceRegion,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
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

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PlanArgs {
    pub steps: u64,
    pub srcs: u64,
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

/// One rank's steps and source list, with addresses resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTable {
    pub steps: Vec<DeviceStep>,
    pub srcs: Vec<DeviceRegion>,
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
        srcs: Vec::new(),
    };
    for step in &p.steps[rank] {
        let mut d = DeviceStep::default();
        match step {
            Step::Wait { slot, expected, .. } => {
                d.kind = STEP_WAIT;
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
            Step::Copy { src, dst } => {
                d.kind = STEP_COPY;
                d.nsrc = 1;
                d.src_begin = table.srcs.len() as u32;
                table.srcs.push(resolve(src, addrs, elem_bytes));
                d.dst = resolve(dst, addrs, elem_bytes);
            }
            Step::Reduce { srcs, dst } => {
                d.kind = STEP_REDUCE;
                d.nsrc = srcs.len() as u32;
                d.src_begin = table.srcs.len() as u32;
                table
                    .srcs
                    .extend(srcs.iter().map(|s| resolve(s, addrs, elem_bytes)));
                d.dst = resolve(dst, addrs, elem_bytes);
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

/// About `target_bytes` per lane for the largest region, at most `max` lanes.
pub fn lanes(plan: &CheckedPlan, elem_bytes: usize, target_bytes: usize, max: u32) -> Lanes {
    let longest = plan
        .plan()
        .steps
        .iter()
        .flatten()
        .filter_map(|s| match s {
            Step::Copy { dst, .. } | Step::Reduce { dst, .. } => Some(dst.len),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let wanted = (longest * elem_bytes)
        .div_ceil(target_bytes)
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
        // sizes fixed by kernels/plan.cu and kernels/common.cuh
        assert_eq!(std::mem::size_of::<DeviceRegion>(), 16);
        assert_eq!(std::mem::size_of::<DeviceStep>(), 48);
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
        assert_eq!(reduce.nsrc, 2);
        assert_eq!(
            t.srcs[reduce.src_begin as usize],
            DeviceRegion {
                ptr: 0x1000,
                len: 10
            }
        );
        assert_eq!(
            t.srcs[reduce.src_begin as usize + 1],
            DeviceRegion {
                ptr: 0x5000,
                len: 10
            }
        );
        assert_eq!(
            reduce.dst,
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
        let l = lanes(&plan, 4, 64 << 10, 264);
        assert_eq!(l.len % 64, 0);
        assert!(l.len * l.count as u64 >= 1_000_003);
        assert!(l.len * (l.count as u64 - 1) < 1_000_003);
        assert!(l.count <= 264);
        let tiny = lanes(&plan, 4, 1 << 30, 264);
        assert_eq!(tiny.count, 1);
    }
}
