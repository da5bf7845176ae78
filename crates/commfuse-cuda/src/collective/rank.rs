//! One rank's collective for groups whose ranks are separate processes, one GPU each
//! (PyTorch's model): the same checked plans and plan kernel as [`crate::collective`], with
//! every rank owning its signal pads, epoch bases, symmetric buffers and error record, and
//! knowing its peers' pads and buffers through CUDA IPC ([`crate::sys::ipc::Exported`]).
//!
//! A rank is built in two steps, as the fused operators are: [`CollectiveAllocation::new`]
//! (the plan — a pure function of the op, so every rank builds the same — and the memory), then
//! [`CollectiveAllocation::connect_exported`] with every rank's export, gathered by the caller's
//! rendezvous. A call queues on the caller's stream: the caller's input into the rank's
//! symmetric input buffer, the plan kernel, the symmetric output into the caller's output.
//! Nothing is cleared between calls (the kernel advances its epoch bases); every rank makes the
//! same calls in the same order. A wait that times out is recorded in the rank's own record
//! (`check`); a peer that never calls leaves this rank's waits to time out, not hang.

use crate::backend::call::RankBuffers;
use crate::backend::plan_kernel::{
    plan_kernel, upload_table, DeviceTable, KernelContext, LANE_MIN_BYTES, LANE_MIN_COUNT,
    LANE_TARGET_BYTES, PAD_SLOTS,
};
use crate::backend::plan_table::{
    self, BufferAddrs, ErrorRecord, Lanes, PlanArgs, MAX_RANKS, THREADS,
};
use crate::collective::ll::LlRank;
use crate::error::CudaError;
use crate::sys::driver::{
    CallOrder, DeviceMemory, Function, Gpu, IpcMapping, MappedHost, Module, Stream,
};
use crate::sys::ipc::Exported;
use crate::sys::nvrtc;
use commfuse_core::backend::{ensure_fits, PadCapacity};
use commfuse_core::cost::{choose_algo, prefers_ll};
use commfuse_core::Topology;
use commfuse_core::{build_plan, check, Algo, CheckedPlan, DType, OpKind, OpSpec, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

/// How long dropping a rank waits for its last call before it leaks its memory instead.
const DROP_WAIT: Duration = Duration::from_secs(30);

fn unavailable(msg: String) -> CudaError {
    CudaError::Unavailable(msg)
}

/// What a collective is: `kind` of `count` elements (as [`OpSpec`] counts them) of `dtype`,
/// by `algo` (None: the cost model's pick), with `reduce` and `root`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveConfig {
    pub kind: OpKind,
    pub count: usize,
    pub dtype: DType,
    pub algo: Option<Algo>,
    pub reduce: ReduceOp,
    pub root: usize,
    /// How long any device-side wait may last before the call fails with a diagnosis
    pub timeout: Duration,
}

impl CollectiveConfig {
    /// `kind` of `count` elements of `dtype`, summed where it reduces, root 0, the cost
    /// model's algorithm, 5 s waits.
    pub fn new(kind: OpKind, count: usize, dtype: DType) -> CollectiveConfig {
        CollectiveConfig {
            kind,
            count,
            dtype,
            algo: None,
            reduce: ReduceOp::Sum,
            root: 0,
            timeout: Duration::from_secs(5),
        }
    }
}

/// A rank's memory, before it knows its peers.
pub struct CollectiveAllocation {
    rank: usize,
    world: usize,
    config: CollectiveConfig,
    spec: OpSpec,
    algo: Algo,
    plan: CheckedPlan,
    lanes: Lanes,
    kernel: Function,
    memory: RankMemory,
    gpu: Arc<Gpu>,
}

/// What the plan kernel of a rank touches: freed only once its last call has ended.
struct RankMemory {
    pads: DeviceMemory,
    bases: DeviceMemory,
    bufs: RankBuffers,
    error: MappedHost<ErrorRecord>,
    /// The rank's table, once connected
    table: Option<DeviceTable>,
    /// The LL protocol, where `auto` takes it for this op (its buffer is what the peers
    /// store into)
    ll: Option<LlRank>,
    /// The peers' pads and buffers opened into this process
    mapped: Vec<IpcMapping>,
}

impl CollectiveAllocation {
    /// Builds rank `rank` of `world` on `gpu`: checks the plan, compiles (or loads) the plan
    /// kernel, allocates the pads and buffers.
    pub fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        world: usize,
        config: CollectiveConfig,
    ) -> Result<CollectiveAllocation, CudaError> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(unavailable(format!(
                "rank {rank} of {world}: collectives take 1 to {MAX_RANKS} ranks"
            )));
        }
        let fail = |e: commfuse_core::Error| unavailable(e.to_string());
        let spec = OpSpec::new(config.kind, world, config.count, config.root).map_err(fail)?;
        let topology = Topology::new(world, 1).map_err(fail)?;
        let (algo, plan) = match config.algo {
            Some(algo) => {
                let plan = build_plan(spec, algo, &topology).map_err(fail)?;
                (algo, check(plan).map_err(|e| unavailable(e.to_string()))?)
            }
            None => {
                let choice = choose_algo(spec, &topology, config.dtype.size()).map_err(fail)?;
                (choice.algo, choice.plan)
            }
        };
        ensure_fits(&plan, world, PadCapacity::Slots(PAD_SLOTS))
            .map_err(|e| unavailable(e.to_string()))?;
        let compiled = nvrtc::compile(nvrtc::kernel("plan.cu").expect("embedded"), false)?;
        let module = Module::load(&gpu, &compiled.cubin)?;
        let kernel = plan_kernel(&module, config.dtype, config.reduce)?;
        // lanes spin on their peers' lanes: all must be resident at once (the same GPUs give
        // every rank the same count; connect checks)
        let resident = kernel.max_blocks_per_sm(THREADS)? * gpu.sm_count;
        let max_lanes = resident.min(4 * gpu.sm_count);
        let eb = config.dtype.size();
        let lanes = plan_table::lanes(
            &plan,
            eb,
            LANE_TARGET_BYTES,
            LANE_MIN_BYTES,
            LANE_MIN_COUNT,
            max_lanes,
        );
        let pad_bytes = max_lanes as usize * PAD_SLOTS * 8;
        let b = plan.plan().buffers;
        let error = MappedHost::new(&gpu, ErrorRecord::default())?;
        // small all-reduces, reduce-scatters and all-gathers left to `auto` go by the LL
        // protocol (the plan stays built: it is what the op is checked against, and it is small)
        let ll = match config.algo.is_none() && prefers_ll(&spec, eb) {
            true => Some(LlRank::new(
                &gpu,
                (rank, world),
                (config.kind, config.count, config.dtype, config.reduce),
                error.device_addr(),
                config.timeout,
                (crate::collective::ll::Lines::Eight, 1),
            )?),
            false => None,
        };
        Ok(CollectiveAllocation {
            memory: RankMemory {
                pads: DeviceMemory::zeroed(&gpu, pad_bytes)?,
                bases: DeviceMemory::zeroed(&gpu, pad_bytes)?,
                // (an empty buffer still gets an allocation, and so an IPC handle)
                bufs: RankBuffers::new(&gpu, b.input * eb, b.output * eb, b.scratch * eb)?,
                error,
                table: None,
                ll,
                mapped: Vec::new(),
            },
            rank,
            world,
            config,
            spec,
            algo,
            plan,
            lanes,
            kernel,
            gpu,
        })
    }

    /// The op, algorithm and lanes every rank must agree on, as bytes.
    fn agreement(&self) -> Vec<u8> {
        format!(
            "{} {} {} {} {} {} lanes {}x{}{}",
            self.spec.kind,
            self.spec.count,
            self.config.dtype,
            self.algo,
            self.config.reduce,
            self.spec.root,
            self.lanes.count,
            self.lanes.len,
            if self.memory.ll.is_some() { " ll" } else { "" }
        )
        .into_bytes()
    }

    /// What this rank exports for its peers: the IPC handles of its pads and its three
    /// buffers (and its LL buffer where it has one), and what the op is (checked on connect).
    pub fn export(&self) -> Result<Exported, CudaError> {
        let m = &self.memory;
        let mut handles = vec![
            m.pads.ipc_handle(&self.gpu)?,
            m.bufs.input.ipc_handle(&self.gpu)?,
            m.bufs.output.ipc_handle(&self.gpu)?,
            m.bufs.scratch.ipc_handle(&self.gpu)?,
        ];
        if let Some(ll) = &m.ll {
            handles.push(ll.buffer.ipc_handle(&self.gpu)?);
        }
        Ok(Exported {
            operator: "collective".into(),
            rank: self.rank,
            world: self.world,
            handles,
            extra: self.agreement(),
        })
    }

    /// Finishes the rank from every rank's [`CollectiveAllocation::export`] (rank order, its
    /// own among them): opens the peers' pads and buffers and builds its table.
    pub fn connect_exported(mut self, exports: &[Exported]) -> Result<CollectiveRank, CudaError> {
        let mine = self.agreement();
        let handles = 4 + usize::from(self.memory.ll.is_some());
        if let Some(e) = exports.iter().find(|e| e.extra != mine) {
            return Err(unavailable(format!(
                "collective: rank {} built {:?}, rank {} built {:?}",
                e.rank,
                String::from_utf8_lossy(&e.extra),
                self.rank,
                String::from_utf8_lossy(&mine)
            )));
        }
        Exported::check_group(exports, "collective", self.world, handles)?;
        let mut pads = [0u64; MAX_RANKS];
        let mut ll_buffers = Vec::with_capacity(self.world);
        let mut addrs = Vec::with_capacity(self.world);
        for (q, e) in exports.iter().enumerate() {
            let m = &mut self.memory;
            if q == self.rank {
                ll_buffers.extend(m.ll.as_ref().map(|ll| ll.buffer.addr()));
                pads[q] = m.pads.addr();
                addrs.push(BufferAddrs {
                    input: m.bufs.input.addr(),
                    output: m.bufs.output.addr(),
                    scratch: m.bufs.scratch.addr(),
                });
                continue;
            }
            let mut open = |i: usize| -> Result<u64, CudaError> {
                let mapping = IpcMapping::open(&self.gpu, &e.handles[i])?;
                let addr = mapping.addr();
                m.mapped.push(mapping);
                Ok(addr)
            };
            pads[q] = open(0)?;
            addrs.push(BufferAddrs {
                input: open(1)?,
                output: open(2)?,
                scratch: open(3)?,
            });
            if handles > 4 {
                ll_buffers.push(open(4)?);
            }
        }
        if let Some(ll) = &mut self.memory.ll {
            ll.connect(&ll_buffers);
        }
        let context = KernelContext {
            pads,
            bases: self.memory.bases.addr(),
            error: self.memory.error.device_addr(),
            lanes: self.lanes,
            timeout: self.config.timeout,
        };
        let eb = self.config.dtype.size();
        let (table, args) = upload_table(&self.gpu, &self.plan, self.rank, &addrs, eb, &context)?;
        self.memory.table = Some(table);
        Ok(CollectiveRank {
            last: CallOrder::new(&self.gpu)?,
            args,
            broken: false,
            memory: Some(self.memory),
            rank: self.rank,
            spec: self.spec,
            algo: self.algo,
            config: self.config,
            plan: self.plan,
            lanes: self.lanes,
            kernel: self.kernel,
            gpu: self.gpu,
        })
    }
}

/// One rank of a collective whose peers may live in other processes.
pub struct CollectiveRank {
    rank: usize,
    spec: OpSpec,
    algo: Algo,
    config: CollectiveConfig,
    plan: CheckedPlan,
    lanes: Lanes,
    kernel: Function,
    args: PlanArgs,
    /// After this rank's last call (dropping waits for it)
    last: CallOrder,
    broken: bool,
    /// None once leaked (a call that never ended)
    memory: Option<RankMemory>,
    gpu: Arc<Gpu>,
}

impl CollectiveRank {
    /// The algorithm of the plan the op is built on (what `auto` picked, when it did).
    pub fn algo(&self) -> Algo {
        self.algo
    }

    /// What runs: "ll" where `auto` took the LL protocol, else the plan's algorithm.
    pub fn implementation(&self) -> String {
        match self.memory.as_ref().is_some_and(|m| m.ll.is_some()) {
            true => commfuse_core::Protocol::Ll.name().into(),
            false => self.algo.to_string(),
        }
    }

    /// What the rank was built for.
    pub fn config(&self) -> &CollectiveConfig {
        &self.config
    }

    /// What the collective computes.
    pub fn spec(&self) -> &OpSpec {
        &self.spec
    }

    /// Elements of this rank's input and output.
    pub fn lengths(&self) -> (usize, usize) {
        (
            self.spec.input_len(self.rank),
            self.spec.output_len(self.rank),
        )
    }

    /// Queues this rank's call on `stream`: `input` (`lengths().0` elements) into `output`
    /// (`lengths().1`). Returns once queued.
    ///
    /// # Safety
    /// `stream` must be a stream of this rank's GPU; `input` and `output` device memory of that
    /// GPU of those sizes, valid until the call completes on `stream`.
    pub unsafe fn forward(
        &mut self,
        stream: &Stream,
        input: u64,
        output: u64,
    ) -> Result<(), CudaError> {
        if self.broken {
            return Err(unavailable(
                "this collective failed earlier; its peers' state is unknown: build a new one"
                    .into(),
            ));
        }
        let memory = self.memory.as_ref().expect("present until dropped");
        self.gpu.bind()?;
        let eb = self.config.dtype.size();
        let (n_in, n_out) = self.lengths();
        let queued = (|| -> Result<(), CudaError> {
            // after this rank's previous call, even one on another stream
            self.last.after_last(stream)?;
            if let Some(ll) = &memory.ll {
                // straight from the caller's input into its output
                return ll.launch(stream, input, output);
            }
            if n_in > 0 {
                stream.copy_async(memory.bufs.input.addr(), input, n_in * eb)?;
            }
            self.kernel
                .launch(self.lanes.count, THREADS, stream, &self.args)?;
            if n_out > 0 {
                stream.copy_async(output, memory.bufs.output.addr(), n_out * eb)?;
            }
            Ok(())
        })();
        let recorded = self.last.record(stream);
        if queued.is_err() || recorded.is_err() {
            // this rank's epoch bases may now differ from its peers'
            self.broken = true;
        }
        queued?;
        recorded
    }

    /// After the caller's stream was synchronised: the diagnosis of a wait that timed out in
    /// any call so far (lane, slot, expected, seen), if one did. The rank is unusable after.
    pub fn check(&mut self) -> Result<(), CudaError> {
        let memory = self.memory.as_ref().expect("present until dropped");
        let rec = memory.error.read();
        if rec.flag == 0 {
            return Ok(());
        }
        self.broken = true;
        if let Some(ll) = &memory.ll {
            return Err(CudaError::Stalled(crate::collective::ll::describe_timeout(
                self.spec.kind,
                ll.lines(),
                &rec,
                self.config.timeout,
            )));
        }
        Err(CudaError::Stalled(describe_timeout(
            self.spec.kind,
            &self.plan,
            &rec,
            self.config.timeout,
        )))
    }
}

/// A timeout the plan kernel of `kind` recorded, in words: which rank and lane waited for
/// which rank's notify of which slot (the plan's notifier of that slot, as the simulator names
/// it), to reach what, seeing what.
pub(crate) fn describe_timeout(
    kind: OpKind,
    plan: &CheckedPlan,
    rec: &ErrorRecord,
    timeout: Duration,
) -> String {
    let (slot, from) = rec.plan_slot(plan);
    let awaited = match from {
        Some(from) => format!("rank {from}'s notify of slot {slot}"),
        // no rank notifies it: only a corrupted record names such a slot
        None => format!("slot {slot}, which no rank notifies,"),
    };
    format!(
        "{kind}: rank {} lane {} waited for {awaited} to reach {}, saw {} after {timeout:?}",
        rec.rank, rec.lane, rec.expected, rec.seen
    )
}

impl Drop for CollectiveRank {
    fn drop(&mut self) {
        let ended = matches!(
            crate::sys::host_sync::poll_until(DROP_WAIT, || self.last.is_done()),
            Ok(true)
        );
        if !ended {
            // a kernel may still write the pads and buffers: leak them rather than let it
            // corrupt what is allocated there next
            std::mem::forget(self.memory.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::Slot;

    fn checked(kind: OpKind, world: usize, algo: Algo) -> CheckedPlan {
        let spec = OpSpec::new(kind, world, 1024, 0).unwrap();
        check(build_plan(spec, algo, &Topology::new(world, 1).unwrap()).unwrap()).unwrap()
    }

    /// The record the kernel writes when rank `rank`'s wait at its step `step` gives up.
    fn record_of_wait(plan: &CheckedPlan, rank: usize, step: usize) -> ErrorRecord {
        let commfuse_core::Step::Wait { slot, expected, .. } = plan.plan().steps[rank][step] else {
            panic!("step {step} of rank {rank} is not a wait");
        };
        ErrorRecord {
            flag: 1,
            rank: rank as u32,
            lane: 2,
            step: step as u32,
            slot: slot.row * plan.plan().pad_cols + slot.col,
            expected: expected + 7,
            seen: 7,
            ..ErrorRecord::default()
        }
    }

    #[test]
    fn a_timeout_names_the_rank_whose_notify_was_awaited() {
        // a ring all-reduce of 4: every rank waits only on its ring predecessor
        let plan = checked(OpKind::AllReduce, 4, Algo::Ring);
        for rank in 0..4 {
            let step = plan.plan().steps[rank]
                .iter()
                .position(|s| matches!(s, commfuse_core::Step::Wait { .. }))
                .unwrap();
            let rec = record_of_wait(&plan, rank, step);
            let cols = plan.plan().pad_cols;
            let slot = Slot::new(rec.slot / cols, rec.slot % cols);
            let from = plan.notifier(rank, slot).unwrap();
            assert_ne!(from, rank);
            let line = describe_timeout(OpKind::AllReduce, &plan, &rec, Duration::from_millis(250));
            assert_eq!(
                line,
                format!(
                    "all-reduce: rank {rank} lane 2 waited for rank {from}'s notify of slot {slot} to reach {}, saw 7 after 250ms",
                    rec.expected
                )
            );
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn every_wait_of_a_one_shot_all_reduce_names_a_peer() {
        let plan = checked(OpKind::AllReduce, 3, Algo::OneShot);
        let mut named = std::collections::BTreeSet::new();
        for (step, s) in plan.plan().steps[0].iter().enumerate() {
            if matches!(s, commfuse_core::Step::Wait { .. }) {
                let rec = record_of_wait(&plan, 0, step);
                let line = describe_timeout(OpKind::AllReduce, &plan, &rec, Duration::from_secs(1));
                let peer = (1..3).find(|q| line.contains(&format!("rank {q}'s notify")));
                named.insert(peer.expect(&line));
            }
        }
        // rank 0 waits on both its peers, and the line says which
        assert_eq!(named.into_iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn a_slot_no_rank_notifies_is_said_to_be_one() {
        let plan = checked(OpKind::AllReduce, 2, Algo::OneShot);
        let rec = ErrorRecord {
            flag: 1,
            slot: plan.plan().pad_rows * plan.plan().pad_cols + 3,
            ..ErrorRecord::default()
        };
        let line = describe_timeout(OpKind::AllReduce, &plan, &rec, Duration::from_secs(1));
        assert!(line.contains("which no rank notifies"), "{line}");
    }
}
