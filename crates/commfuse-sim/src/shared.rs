//! Shared memory for a simulated world whose ranks are separate processes (PyTorch's model on
//! a CPU, as PyPTO's simulator runs its ranks): one POSIX shared-memory object per group,
//! mapped by every process, holding a small header (the group's abort flag, how many ranks
//! joined) and an arena from which every world's signal pads and every operator's symmetric
//! buffers are carved. Allocation is a bump pointer, so every process must create the same
//! worlds and operators in the same order (as every NCCL rank makes the same calls); the
//! arena's contents start zeroed, as the in-process allocations do.
//!
//! The object's name is removed as soon as every rank has mapped it (by the rank that completes
//! the group), or once the group cannot form (rank 0 gave up waiting, a rank that joined left,
//! a rank found rank 0's process ended): the memory then lives exactly as long as the last
//! process that maps it, however the processes end, and a name left by a rank 0 that died while
//! its group formed is replaced by the next rank 0 of that name.
//!
//! Each rank records its process (pid, start time, pid namespace) in the header when it joins
//! (rank 0 before it sizes the object), so that a rank waiting for a peer's notify can tell
//! that the peer's process has ended (killed, crashed, exited) and stop at once, naming it,
//! instead of waiting out its timeout.

use commfuse_core::backend::BackendError;
use commfuse_core::error::AbortCause;
use commfuse_core::MAX_WORLD_SIZE;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MAGIC: u64 = 0x636f_6d6d_6675_7365; // "commfuse"
/// Bytes of the header; the arena starts after it.
const HEADER: usize = 4096;
/// Arena allocations start on cache lines.
const ALIGN: usize = 64;

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// The header at the start of the mapping.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    world: AtomicU64,
    bytes: AtomicU64,
    /// Ranks that mapped the object so far
    joined: AtomicU64,
    /// Raised by a rank whose call failed: every rank's waits give up
    abort: AtomicU64,
    /// The group's nonce, set by rank 0: a segment another group left or planted under the
    /// name carries another
    nonce: AtomicU64,
    /// Bit r: rank r mapped the object
    joined_ranks: AtomicU64,
    /// 1 once the object's name was removed (by the rank that completed the group, or one
    /// that gave up on it)
    unlinked: AtomicU64,
    /// Each rank's process, recorded when it joins
    members: [Member; MAX_WORLD_SIZE],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER && MAX_WORLD_SIZE <= 64);

/// The process of one rank: its pid (0 until it joins), its start time in clock ticks since
/// boot (0 where /proc does not say), and the inode of its pid namespace (0 where unknown: its
/// pid then means nothing to the others).
#[repr(C)]
struct Member {
    pid: AtomicU64,
    start: AtomicU64,
    pid_ns: AtomicU64,
}

/// Where a process is: running, ended (no such process, a zombie, or its pid now names a
/// process started at another time), or not known (/proc unreadable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Running { start: u64 },
    Ended,
    Unknown,
}

/// What /proc/`pid`/stat says of process `pid` ("self" for this one).
fn look_at(pid: &str) -> Seen {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Seen::Ended,
        Err(_) => return Seen::Unknown,
    };
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields count from
    // the last ')'; the start time is field 22, the 20th after the state
    let Some(fields) = stat.rfind(')').map(|i| stat[i + 1..].split_whitespace()) else {
        return Seen::Unknown;
    };
    let fields: Vec<&str> = fields.collect();
    match (fields.first(), fields.get(19).and_then(|f| f.parse().ok())) {
        (Some(&("Z" | "X" | "x")), _) => Seen::Ended,
        (Some(_), Some(start)) => Seen::Running { start },
        _ => Seen::Unknown,
    }
}

/// Where the process of `m` is, seen from a process of pid namespace `pid_ns`: its pid when it
/// has ended; None while it runs, before it was recorded, for this process, and where this
/// process cannot tell (another pid namespace, no /proc).
fn member_ended(m: &Member, pid_ns: u64) -> Option<u64> {
    let pid = m.pid.load(Ordering::Acquire);
    let (start, ns) = (
        m.start.load(Ordering::Relaxed),
        m.pid_ns.load(Ordering::Relaxed),
    );
    if pid == 0 || ns == 0 || ns != pid_ns || pid == u64::from(std::process::id()) {
        // ranks of one process (threads that each joined) run while this code does
        return None;
    }
    match look_at(&pid.to_string()) {
        Seen::Ended => Some(pid),
        Seen::Running { start: now } if start != 0 && now != start => Some(pid),
        Seen::Running { .. } | Seen::Unknown => None,
    }
}

/// Creates the group's object `path` (`/commfuse-{name}`) of `len` bytes, zeroed, as rank 0,
/// and records this process as its rank 0 in the header first, so that a rank that finds the
/// object can tell whether its maker still runs before it is set up. An object of that name
/// left by a rank 0 whose process has ended before its group formed is removed first, and one
/// still too short for its header, or whose header names no rank 0 yet, is given until it is
/// [`ABANDONED`] to be set up (a rank 0 killed between creating it and recording itself leaves
/// one; a new group of the same name, formed at once by the ranks that survived, waits that
/// long for it); any other is an error.
fn create(
    path: &CString,
    name: &str,
    len: usize,
    pid_ns: u64,
) -> Result<libc::c_int, BackendError> {
    // a left object removed, then one found young and empty waited for: at most twice
    let mut retries = 0;
    loop {
        // SAFETY: a NUL-terminated name; the flags create it or fail if it exists
        let fd = unsafe {
            libc::shm_open(
                path.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if retries < 2 && e.raw_os_error() == Some(libc::EEXIST) {
                match remove_if_left(path, pid_ns) {
                    Left::Removed => {
                        retries += 1;
                        continue;
                    }
                    Left::Young(wait) => {
                        std::thread::sleep(wait);
                        retries += 1;
                        continue;
                    }
                    Left::Kept => {}
                }
            }
            return Err(unavailable(format!(
                "rank 0 cannot create shared memory /commfuse-{name}: {e} (a group of that name exists: pick another name, or remove /dev/shm/commfuse-{name} left by a crash)"
            )));
        }
        // SAFETY: our descriptor; sizes the header, then the whole object (zero-filled),
        // reserving its pages now so that a full /dev/shm is this error rather than a SIGBUS
        // at first touch
        let mut reserved = unsafe { libc::posix_fallocate(fd, 0, HEADER as libc::off_t) };
        if reserved == 0 {
            with_header(fd, |h| record(&h.members[0], pid_ns));
            // SAFETY: as above
            reserved = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        }
        if reserved != 0 {
            let e = std::io::Error::from_raw_os_error(reserved);
            // SAFETY: ours to close and remove
            unsafe {
                libc::close(fd);
                libc::shm_unlink(path.as_ptr());
            }
            return Err(unavailable(format!(
                "sizing shared memory to {len} bytes: {e}"
            )));
        }
        return Ok(fd);
    }
}

/// `f` of the header of the object `fd` (at least [`HEADER`] bytes long), mapped for the
/// call; None where it cannot be mapped.
fn with_header<R>(fd: libc::c_int, f: impl FnOnce(&Header) -> R) -> Option<R> {
    // SAFETY: maps the header of an object at least that long, shared, read-write
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            HEADER,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: a header-sized mapping of an object that starts with a header
    let out = f(unsafe { &*(ptr as *const Header) });
    // SAFETY: mapped above with this length
    unsafe { libc::munmap(ptr, HEADER) };
    Some(out)
}

/// Records this process, of pid namespace `pid_ns`, in `m`.
fn record(m: &Member, pid_ns: u64) {
    let start = match look_at("self") {
        Seen::Running { start } => start,
        _ => 0,
    };
    m.start.store(start, Ordering::Relaxed);
    m.pid_ns.store(pid_ns, Ordering::Relaxed);
    m.pid
        .store(u64::from(std::process::id()), Ordering::Release);
}

/// The pid of the rank 0 recorded in the object `fd` (`path`, of `size` bytes, this user's
/// alone) if that process has ended, seen from pid namespace `pid_ns`: a group that never
/// formed. Its name is then removed (by whoever sees it first), so that it blocks no new group.
fn remove_if_maker_ended(fd: libc::c_int, size: usize, path: &CString, pid_ns: u64) -> Option<u64> {
    if size < HEADER {
        return None;
    }
    with_header(fd, |h| {
        let pid = member_ended(&h.members[0], pid_ns)?;
        let first = h
            .unlinked
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            // SAFETY: a NUL-terminated name, which still names this object: only the winner
            // of its flag removes it
            unsafe { libc::shm_unlink(path.as_ptr()) };
        }
        Some(pid)
    })
    .flatten()
}

/// Whether the object `fd` (at least a header long) names its rank 0: its maker records
/// itself right after sizing the header, so one that does not was abandoned there or is about
/// to be recorded, as one still too short for its header.
fn maker_recorded(fd: libc::c_int) -> bool {
    with_header(fd, |h| h.members[0].pid.load(Ordering::Acquire) != 0).unwrap_or(true)
}

/// Whether the object `fd` is this user's alone (mode 0600); its size; how long ago it last
/// changed (None where the clock says nothing).
fn owned(fd: libc::c_int) -> (bool, usize, Option<Duration>) {
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: our descriptor and a stat buffer; geteuid has no preconditions
    let ok = unsafe { libc::fstat(fd, &mut stat) } == 0;
    let me = unsafe { libc::geteuid() };
    let changed = std::time::UNIX_EPOCH
        + Duration::new(
            stat.st_ctime.max(0) as u64,
            stat.st_ctime_nsec.clamp(0, 999_999_999) as u32,
        );
    (
        ok && stat.st_uid == me && stat.st_mode & 0o077 == 0,
        stat.st_size.max(0) as usize,
        std::time::SystemTime::now().duration_since(changed).ok(),
    )
}

/// An object too short for its header (its maker records itself there right after creating
/// it) that has not changed for this long was abandoned: its maker ended between the two.
const ABANDONED: Duration = Duration::from_secs(1);

/// What [`remove_if_left`] did with an object found under a group's name.
#[derive(Debug, PartialEq)]
enum Left {
    /// Removed: a group that never formed left it
    Removed,
    /// Too short for its header but younger than [`ABANDONED`]: its maker may be setting it
    /// up; ask again after this long
    Young(Duration),
    /// Kept: a group's (forming or formed), another user's, or gone already
    Kept,
}

/// Removes the object `path` when it is this user's alone and was left by a group that never
/// formed: the rank 0 recorded in it has ended, or it was abandoned empty ([`ABANDONED`]).
fn remove_if_left(path: &CString, pid_ns: u64) -> Left {
    // SAFETY: a NUL-terminated name
    let fd = unsafe { libc::shm_open(path.as_ptr(), libc::O_RDWR, 0) };
    if fd < 0 {
        return Left::Kept;
    }
    let (ours, size, age) = owned(fd);
    let left = if !ours {
        Left::Kept
    } else if remove_if_maker_ended(fd, size, path, pid_ns).is_some() {
        Left::Removed
    } else if size >= HEADER && maker_recorded(fd) {
        Left::Kept
    } else {
        match age {
            // SAFETY: a NUL-terminated name
            Some(a) if a >= ABANDONED && unsafe { libc::shm_unlink(path.as_ptr()) } == 0 => {
                Left::Removed
            }
            Some(a) if a < ABANDONED => Left::Young(ABANDONED - a + Duration::from_millis(10)),
            _ => Left::Kept,
        }
    };
    // SAFETY: ours to close
    unsafe { libc::close(fd) };
    left
}

/// The error of rank `rank` that found the group `name` made by a rank 0 whose process `pid`
/// has ended before the group formed (its name now removed).
fn left_behind(rank: usize, name: &str, pid: u64) -> BackendError {
    unavailable(format!(
        "rank {rank} found /commfuse-{name} made by rank 0, whose process (pid {pid}) has ended before the group formed (the name is removed: start the group again)"
    ))
}

/// The inode of this process's pid namespace, 0 where unknown.
fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// "rank 2", "ranks 1, 3": the ranks whose bits are clear in `joined`, of `world`.
fn missing(joined: u64, world: usize) -> String {
    let ranks: Vec<String> = (0..world)
        .filter(|r| joined >> r & 1 == 0)
        .map(|r| r.to_string())
        .collect();
    match ranks.len() {
        1 => format!("rank {}", ranks[0]),
        _ => format!("ranks {}", ranks.join(", ")),
    }
}

/// One group's shared memory, mapped into this process.
pub struct Arena {
    ptr: *mut u8,
    len: usize,
    rank: usize,
    world: usize,
    /// This process's pid namespace (see [`Member`])
    pid_ns: u64,
    /// The object's name, `/commfuse-{name}`
    path: CString,
    /// Whether this rank joined (a rank that refused the object leaves its name alone)
    joined: std::sync::atomic::AtomicBool,
    /// Offset of the next allocation
    next: Mutex<usize>,
}

// SAFETY: the mapping is plain memory; the header's words are atomics, and the arena's
// allocations are handed out once each (their users order their accesses)
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Drop for Arena {
    fn drop(&mut self) {
        // a group whose name is still there never formed, and cannot now that this rank
        // leaves it: its name goes, so that it blocks no new group
        if self.joined.load(Ordering::Relaxed) {
            self.remove_name();
        }
        // SAFETY: mapped in `open` with this length; every allocation's owner holds an Arc to
        // this arena, so nothing points into it any more
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl Arena {
    /// Maps the group `name` as rank `rank` of `world`, `bytes` of arena: rank 0 creates the
    /// object, the others open it once it exists (each waits at most `timeout`). `name` is the
    /// caller's: a job id every rank knows (letters, digits, `-`, `_`, `.`). The same as
    /// [`Arena::open_with_nonce`] with nonce 0.
    pub fn open(
        name: &str,
        rank: usize,
        world: usize,
        bytes: usize,
        timeout: Duration,
    ) -> Result<Arena, BackendError> {
        Arena::open_with_nonce(name, rank, world, bytes, timeout, 0)
    }

    /// [`Arena::open`] for a group whose ranks also share `nonce` (a random number passed
    /// through the caller's rendezvous with the name): a rank joins only an object that this
    /// user owns, that no one else may open, and that rank 0 made with the same nonce, so
    /// that a segment left by a crash or planted under the name cannot capture the group.
    pub fn open_with_nonce(
        name: &str,
        rank: usize,
        world: usize,
        bytes: usize,
        timeout: Duration,
        nonce: u64,
    ) -> Result<Arena, BackendError> {
        let max = commfuse_core::MAX_WORLD_SIZE;
        if world == 0 || world > max {
            return Err(unavailable(format!(
                "a group has 1 to {max} ranks, got {world}"
            )));
        }
        if rank >= world {
            return Err(unavailable(format!(
                "rank {rank} is not a rank of a group of {world} (0 to {})",
                world - 1
            )));
        }
        if name.is_empty()
            || name.len() > 200
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(unavailable(format!(
                "group name {name:?}: 1 to 200 letters, digits, '-', '_' or '.'"
            )));
        }
        let path = CString::new(format!("/commfuse-{name}")).expect("checked above");
        crate::memory::Footprint::new(format!("the shared memory of group {name}"))
            .item(&[bytes])
            .item(&[HEADER + ALIGN])
            .check()?;
        let len = HEADER + bytes.next_multiple_of(ALIGN);
        let deadline = Instant::now() + timeout;
        let pid_ns = pid_namespace();
        let fd = if rank == 0 {
            create(&path, name, len, pid_ns)?
        } else {
            loop {
                // SAFETY: a NUL-terminated name
                let fd = unsafe { libc::shm_open(path.as_ptr(), libc::O_RDWR, 0) };
                if fd >= 0 {
                    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
                    // SAFETY: our descriptor and a stat buffer
                    let sized =
                        unsafe { libc::fstat(fd, &mut stat) } == 0 && stat.st_size as usize == len;
                    // SAFETY: geteuid has no preconditions and cannot fail
                    let me = unsafe { libc::geteuid() };
                    if sized && (stat.st_uid != me || stat.st_mode & 0o077 != 0) {
                        // SAFETY: ours to close
                        unsafe { libc::close(fd) };
                        return Err(unavailable(format!(
                            "rank {rank} refuses /commfuse-{name}: it belongs to user {} with mode {:o}, not to this process's user {me} alone",
                            stat.st_uid,
                            stat.st_mode & 0o777
                        )));
                    }
                    if sized {
                        break fd;
                    }
                    // not set up yet: its maker may be gone
                    let (ours, size, _) = owned(fd);
                    let gone = ours
                        .then(|| remove_if_maker_ended(fd, size, &path, pid_ns))
                        .flatten();
                    // SAFETY: ours to close
                    unsafe { libc::close(fd) };
                    if let Some(pid) = gone {
                        return Err(left_behind(rank, name, pid));
                    }
                }
                if Instant::now() >= deadline {
                    let removed = if remove_if_left(&path, pid_ns) == Left::Removed {
                        " (one left there by a rank 0 that ended was removed)"
                    } else {
                        ""
                    };
                    return Err(unavailable(format!(
                        "rank {rank} waited {timeout:?} for rank 0 to create the group's shared memory /commfuse-{name} of {len} bytes{removed}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        // SAFETY: maps the whole object shared, read-write
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: the mapping keeps the object alive; the descriptor is no longer needed
        unsafe { libc::close(fd) };
        if ptr == libc::MAP_FAILED {
            if rank == 0 {
                // SAFETY: the name rank 0 created above
                unsafe { libc::shm_unlink(path.as_ptr()) };
            }
            return Err(unavailable(format!(
                "mapping {len} bytes of shared memory: {}",
                std::io::Error::last_os_error()
            )));
        }
        let arena = Arena {
            ptr: ptr.cast(),
            len,
            rank,
            world,
            pid_ns,
            path,
            joined: std::sync::atomic::AtomicBool::new(false),
            next: Mutex::new(HEADER),
        };
        let h = arena.header();
        if rank == 0 {
            // (`create` recorded this process as rank 0)
            h.world.store(world as u64, Ordering::Relaxed);
            h.bytes.store(bytes as u64, Ordering::Relaxed);
            h.nonce.store(nonce, Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
        } else {
            while h.magic.load(Ordering::Acquire) != MAGIC {
                if let Some(pid) = arena.ended(0) {
                    return Err(arena.left_behind(name, pid));
                }
                if Instant::now() >= deadline {
                    return Err(unavailable(format!(
                        "rank {rank} waited {timeout:?} for rank 0 to set up /commfuse-{name}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let (w, b) = (
                h.world.load(Ordering::Relaxed),
                h.bytes.load(Ordering::Relaxed),
            );
            if w != world as u64 || b != bytes as u64 {
                return Err(unavailable(format!(
                    "rank {rank} joined /commfuse-{name} for {world} ranks and {bytes} bytes, rank 0 made it for {w} and {b}"
                )));
            }
            if h.nonce.load(Ordering::Relaxed) != nonce {
                return Err(unavailable(format!(
                    "rank {rank} refuses /commfuse-{name}: it was made with another nonce than the group's (a segment left by another group, or planted)"
                )));
            }
            if let Some(pid) = arena.ended(0) {
                return Err(arena.left_behind(name, pid));
            }
            arena.record_member();
        }
        arena.joined.store(true, Ordering::Relaxed);
        h.joined_ranks.fetch_or(1 << rank, Ordering::AcqRel);
        if h.joined.fetch_add(1, Ordering::AcqRel) + 1 == world as u64 {
            // the rank that completes the group removes its name, whether or not rank 0 still
            // runs: the memory then ends with the last process
            arena.remove_name();
        }
        if rank == 0 {
            while h.joined.load(Ordering::Acquire) < world as u64 {
                if Instant::now() >= deadline {
                    let joined = h.joined_ranks.load(Ordering::Acquire);
                    let first = (0..world).find(|r| joined >> r & 1 == 0).unwrap_or(0);
                    // the ranks that joined may already wait in a call: stop them, naming it
                    arena.raise_cause(AbortCause::NotJoined {
                        rank: 0,
                        missing: first,
                    });
                    arena.remove_name();
                    return Err(unavailable(format!(
                        "rank 0 waited {timeout:?} for the group's other ranks to join /commfuse-{name}: {} of {world} did, not {}",
                        h.joined.load(Ordering::Acquire),
                        missing(joined, world)
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Ok(arena)
    }

    /// Writes this process into the header as this rank's.
    fn record_member(&self) {
        record(&self.header().members[self.rank], self.pid_ns);
    }

    /// Removes the group's name, once whoever asks (the memory stays until its last mapping
    /// goes).
    fn remove_name(&self) {
        let unlinked = &self.header().unlinked;
        if unlinked
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: a NUL-terminated name, which still names this object: only this flag's
            // winner removes it
            unsafe { libc::shm_unlink(self.path.as_ptr()) };
        }
    }

    /// The error of this rank, which found the group `name` made by a rank 0 whose process
    /// `pid` has ended before the group formed; the group is aborted with that cause, and its
    /// name removed, so that it blocks no new group.
    fn left_behind(&self, name: &str, pid: u64) -> BackendError {
        // ranks that joined before rank 0 ended may already wait in a call for this one
        self.raise_cause(AbortCause::PeerGone {
            rank: self.rank,
            gone: 0,
        });
        self.remove_name();
        left_behind(self.rank, name, pid)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header-sized, page-aligned, zeroed region
        unsafe { &*(self.ptr as *const Header) }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The group's size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The group's abort flag (non-zero: a rank failed, and why).
    pub(crate) fn abort_flag(&self) -> &AtomicU64 {
        &self.header().abort
    }

    /// Raises the group's abort flag as this rank's failure: every rank's waits, in every
    /// process, give up and name this rank. For a rank that fails outside a call (building an
    /// operator its peers are already running).
    pub fn raise_abort(&self) {
        self.raise_cause(AbortCause::Failed { rank: self.rank });
    }

    fn raise_cause(&self, cause: AbortCause) {
        crate::signal::raise_abort(self.abort_flag(), cause);
    }

    /// Why the group was aborted, if it was: the first rank that failed and how.
    pub fn abort_cause(&self) -> Option<AbortCause> {
        crate::signal::abort_cause(self.abort_flag())
    }

    /// The pid of rank `rank`'s process if that process has ended (killed, crashed or exited);
    /// None while it runs, before it joined, for this process's own rank, and where this
    /// process cannot tell (another pid namespace, no /proc).
    pub fn ended(&self, rank: usize) -> Option<u64> {
        let m = self.header().members.get(rank)?;
        (rank != self.rank).then(|| member_ended(m, self.pid_ns))?
    }

    /// `bytes` of zeroed shared memory at the same offset in every process (when every process
    /// allocates in the same order).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<*mut u8, BackendError> {
        let mut next = self.next.lock().unwrap();
        let start = *next;
        let end = start
            .checked_add(bytes.next_multiple_of(ALIGN))
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                unavailable(format!(
                    "the group's shared memory is full: {} of {} bytes used, {bytes} more asked for (make the group with more)",
                    start - HEADER,
                    self.len - HEADER
                ))
            })?;
        *next = end;
        // SAFETY: in bounds of the mapping
        Ok(unsafe { self.ptr.add(start) })
    }
}
